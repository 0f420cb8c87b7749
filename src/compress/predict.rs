//! What a compressed call would cost, predicted before it is tried (`CIERA_COMPRESS=auto`).
//!
//! At a policy's first raw probe (its second call: every cache holds the previous iteration,
//! the probe carries this one) each rank codes a sample of its own shard, the new values
//! against its cache's, at every frame level its cache takes and as an exponent cache would:
//! the frame bytes and the codec time of real data, scaled to the shard. The ranks exchange
//! these with the probe's time (one small allgather, once per policy), so every rank holds the
//! same prediction: per level, the least time a call can take, from
//! - its wire: the raw baseline scaled by the level's frame bytes over the raw bytes (moving
//!   bytes costs time in proportion to them, on the wire or in the transport's CPU);
//! - its codec: each rank encodes its shard and decodes the others', one encoder thread and one
//!   decoding thread per rank, each splitting a Delta frame over the rank's codec threads
//!   (`CIERA_CODEC_THREADS`, timed so in the sample too), the ranks of a host sharing its cores;
//!
//! the larger of the two where every rank's threads (transport, encoder, decoder) have cores
//! of their own (the codec overlaps the moving of the bytes), else their sum (`additive`).
//!
//! The policy starts at the level predicted fastest, does not try what is predicted to lose
//! (a level slower than one measured, an exponent cache slower than the best level, any
//! compression much slower than raw), and measures the rest as before.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use crate::algo::Topology;
use crate::codec::{CacheMode, CacheSlot, FrameChoice};
use crate::DType;

use super::LEVEL_CHOICES;

/// Elements of a rank's shard coded to calibrate (the first ones; all of a smaller shard).
pub(super) const SAMPLE_ELEMS: usize = 1 << 18;
/// Index of an exponent cache's Exp frames (the trial) in a prediction, after the three levels.
pub(super) const EXP_CACHE: usize = 3;
/// Words of one rank's calibration in the exchange: the probe's time, the rank's cores, its
/// codec threads, then per choice (three levels and the exponent cache) its frame bytes,
/// encode and decode ns on one thread, and encode and decode ns on the codec threads.
pub(super) const WORDS: usize = 3 + 5 * 4;
const UNKNOWN: u64 = u64::MAX;

/// One rank's calibration: per choice (index as `LEVEL_CHOICES`, then `EXP_CACHE`) the frame
/// bytes of its whole shard, the ns to encode it and the ns to decode it on one thread (the
/// CPU time it takes); None where not coded. On more than one codec thread, a delta cache's
/// level that may send Delta frames (which split over them) is timed there too: `*_wall_ns`
/// (None elsewhere: the same as on one thread).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Sample {
    pub wire: [Option<u64>; 4],
    pub enc_ns: [Option<u64>; 4],
    pub dec_ns: [Option<u64>; 4],
    pub enc_wall_ns: [Option<u64>; 4],
    pub dec_wall_ns: [Option<u64>; 4],
}

/// Code `input` (this call's shard) against `cached` (the values of the previous call) in a
/// sample at each of `levels` on a `mode` cache and, with `exp_cache`, on an exponent cache.
/// Scratch slots only: the real caches are untouched. Each timing is the faster of two runs
/// (a busy host preempts one, rarely both). With `threads` > 1 (the codec threads), a delta
/// cache's level that may send Delta frames is also timed on that many threads, as its real
/// chunks are coded.
pub(super) fn calibrate(
    dtype: DType,
    mode: CacheMode,
    levels: &[usize],
    exp_cache: bool,
    cached: &[u8],
    input: &[u8],
    threads: usize,
) -> Sample {
    let size = dtype.size();
    let count = input.len() / size;
    let m = count.min(SAMPLE_ELEMS);
    let mut out = Sample::default();
    // `cached`: the previous values of the whole shard (a cache's), or of its sample alone.
    if m == 0 || cached.len() < m * size || cached.len() > input.len() {
        return out;
    }
    let scale = count as f64 / m as f64;
    let (old, new) = (&cached[..m * size], &input[..m * size]);
    let mut choices: Vec<(usize, CacheMode)> = levels.iter().map(|&l| (l, mode)).collect();
    if exp_cache {
        choices.push((EXP_CACHE, CacheMode::Exponent));
    }
    let mut frame = Vec::with_capacity(m * size + 4096);
    let mut decoded = vec![0u8; m * size];
    let ns = |secs: f64| Some((secs * scale * 1e9) as u64);
    for (i, cache) in choices {
        // One pair of slots for every run (their memory faulted in once): each run starts them
        // cold again.
        let mut tx = CacheSlot::new(dtype, cache, m);
        let mut rx = CacheSlot::new(dtype, cache, m);
        if i < EXP_CACHE {
            tx.set_frame_choice(LEVEL_CHOICES[i]);
        }
        // Only Delta frames split: a delta cache's level that may send them.
        let split = threads > 1
            && cache == CacheMode::Delta
            && i < EXP_CACHE
            && LEVEL_CHOICES[i] == FrameChoice::Auto;
        for t in if split { vec![1, threads] } else { vec![1] } {
            tx.set_codec_threads(t);
            rx.set_codec_threads(t);
            let Some((bytes, enc, dec)) =
                time_coding(&mut tx, &mut rx, old, new, &mut frame, &mut decoded)
            else {
                return out;
            };
            if t == 1 {
                out.wire[i] = Some((bytes as f64 * scale) as u64);
                (out.enc_ns[i], out.dec_ns[i]) = (ns(enc), ns(dec));
            } else {
                (out.enc_wall_ns[i], out.dec_wall_ns[i]) = (ns(enc), ns(dec));
            }
        }
    }
    out
}

/// Code `new` from `tx` to `rx`, both first filled with `old`, twice: the frame's bytes and the
/// faster encode and decode (seconds); None where a coding fails or decodes wrong.
fn time_coding(
    tx: &mut CacheSlot,
    rx: &mut CacheSlot,
    old: &[u8],
    new: &[u8],
    frame: &mut Vec<u8>,
    decoded: &mut [u8],
) -> Option<(usize, f64, f64)> {
    let (mut enc, mut dec) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..2 {
        tx.poison();
        rx.poison();
        frame.clear();
        // FILL frames set both slots to the previous values, as the real caches hold.
        if tx.encode(old, frame).is_err() || rx.decode(frame, decoded).is_err() {
            return None;
        }
        frame.clear();
        let t = Instant::now();
        let r = tx.encode(new, frame);
        enc = enc.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let ok = r.is_ok() && rx.decode(frame, decoded).is_ok();
        dec = dec.min(t.elapsed().as_secs_f64());
        if !ok || decoded != new {
            return None;
        }
    }
    Some((frame.len(), enc, dec))
}

/// This rank's words for the exchange.
pub(super) fn words(raw_probe: Duration, cores: usize, threads: usize, s: &Sample) -> [u64; WORDS] {
    let mut w = [UNKNOWN; WORDS];
    w[0] = raw_probe.as_nanos() as u64;
    w[1] = cores as u64;
    w[2] = threads as u64;
    for i in 0..4 {
        w[3 + i] = s.wire[i].unwrap_or(UNKNOWN);
        w[7 + i] = s.enc_ns[i].unwrap_or(UNKNOWN);
        w[11 + i] = s.dec_ns[i].unwrap_or(UNKNOWN);
        w[15 + i] = s.enc_wall_ns[i].unwrap_or(UNKNOWN);
        w[19 + i] = s.dec_wall_ns[i].unwrap_or(UNKNOWN);
    }
    w
}

/// The agreed prediction, from every rank's words (`all[r]` starting at `at`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Prediction {
    /// The raw baseline: the slowest rank's probe.
    pub raw: Duration,
    /// Per choice: the wire bytes of a call (every rank's frames) and the least time of its
    /// codec work on the busiest host.
    pub wire: [Option<f64>; 4],
    pub codec: [Option<Duration>; 4],
    /// A host has fewer cores than its ranks have threads to run (each rank's transport, its
    /// encoder and its decoder): the codec cannot run beside the moving of the bytes (the
    /// transport's copies, the kernel's TCP work), so a call takes its wire and its codec
    /// time, not the larger of them. Measured (4 ranks on 2 cores, loopback TCP, 16 MiB bf16):
    /// raw 10-12 ms; Exp frames, predicted at 5.4-8.2 ms as the larger (their wire is 2x
    /// smaller, their codec 2-4 ms), took 10-14 ms.
    pub additive: bool,
}

impl Prediction {
    pub fn from_words(all: &[Vec<u64>], at: usize, topo: &Topology) -> Prediction {
        let n = all.len();
        let get = |r: usize, k: usize| {
            let v = all[r][at + k];
            (v != UNKNOWN).then_some(v)
        };
        let raw = Duration::from_nanos((0..n).filter_map(|r| get(r, 0)).max().unwrap_or(0));
        let wire = std::array::from_fn(|i| {
            (0..n).try_fold(0.0, |a, r| get(r, 3 + i).map(|b| a + b as f64))
        });
        // A rank's codec threads (1 where unknown).
        let threads_of = |r: usize| get(r, 2).unwrap_or(1).max(1) as f64;
        let codec = std::array::from_fn(|i| {
            let enc: Option<Vec<f64>> = (0..n).map(|r| get(r, 7 + i).map(|v| v as f64)).collect();
            let dec: Option<Vec<f64>> = (0..n).map(|r| get(r, 11 + i).map(|v| v as f64)).collect();
            let (enc, dec) = (enc?, dec?);
            // The times on the codec threads (the one-thread times where not timed there).
            let wall = |at: usize, one: &[f64]| -> Vec<f64> {
                (0..n)
                    .map(|r| get(r, at + i).map_or(one[r], |v| v as f64))
                    .collect()
            };
            let (enc_wall, dec_wall) = (wall(15, &enc), wall(19, &dec));
            let total_dec: f64 = dec.iter().sum();
            let total_dec_wall: f64 = dec_wall.iter().sum();
            let mut worst: f64 = 0.0;
            for h in 0..topo.hosts() {
                let ranks: Vec<usize> = (0..n).filter(|&r| topo.host_of(r) == h).collect();
                if ranks.is_empty() {
                    continue;
                }
                let cores = ranks
                    .iter()
                    .filter_map(|&r| get(r, 1))
                    .min()
                    .unwrap_or(1)
                    .max(1) as f64;
                // Each rank: its encode on its encoder thread, the others' shards decoded on
                // another, each on the rank's codec threads. The work is the one-thread CPU
                // time; the longest of them takes its time on the codec threads.
                let work: f64 = ranks.iter().map(|&r| enc[r] + total_dec - dec[r]).sum();
                let longest = ranks
                    .iter()
                    .map(|&r| enc_wall[r].max(total_dec_wall - dec_wall[r]))
                    .fold(0.0, f64::max);
                let threads: f64 = ranks.iter().map(|&r| 2.0 * threads_of(r)).sum();
                worst = worst.max((work / cores.min(threads)).max(longest));
            }
            Some(Duration::from_nanos(worst as u64))
        });
        let additive = (0..topo.hosts()).any(|h| {
            let ranks: Vec<usize> = (0..n).filter(|&r| topo.host_of(r) == h).collect();
            let cores = ranks.iter().filter_map(|&r| get(r, 1)).min().unwrap_or(1);
            !ranks.is_empty() && (cores as usize) < 3 * ranks.len()
        });
        Prediction {
            raw,
            wire,
            codec,
            additive,
        }
    }

    /// The least time of a call at choice `i` whose raw bytes (every rank's shard) are `raw`:
    /// its wire, scaled from the raw baseline, and its codec (`combine`).
    pub fn least(&self, i: usize, raw_bytes: u64) -> Option<Duration> {
        self.bound(i, raw_bytes, |c| c)
    }

    /// Choice `i`'s wire with `codec` of its codec time (`combine`).
    fn bound(
        &self,
        i: usize,
        raw_bytes: u64,
        codec: impl Fn(Duration) -> Duration,
    ) -> Option<Duration> {
        let wire = self.raw.mul_f64(self.wire[i]? / raw_bytes.max(1) as f64);
        Some(self.combine(wire, codec(self.codec[i]?)))
    }

    /// A call's least time from its wire and its codec time: their sum where moving bytes
    /// takes the codec's cores (`additive`), else the larger (the codec overlaps the wire).
    pub fn combine(&self, wire: Duration, codec: Duration) -> Duration {
        if self.additive {
            wire + codec
        } else {
            wire.max(codec)
        }
    }

    /// The time a call at choice `i` is expected to take, for choosing where to start: as
    /// `least`, with the codec's share `CODEC_SLACK` times longer. Where the codec binds, the
    /// ranks' codec threads, the transport's and the kernel's share the cores, and calls take
    /// longer than the sample's time says (measured: 4 ranks on 2 cores at 5 Gbit/s, Delta
    /// frames predicted at 31 ms took 50-55 ms, while Exp frames, bound by the wire, took what
    /// their wire said).
    pub fn expected(&self, i: usize, raw_bytes: u64) -> Option<Duration> {
        self.bound(i, raw_bytes, |c| c.mul_f64(CODEC_SLACK))
    }
}

/// See `Prediction::expected`.
const CODEC_SLACK: f64 = 1.5;

/// A policy's first prediction whose best choice's least time is above this share of the raw
/// baseline waits for a second raw probe (the next call) and is made with the faster of the
/// two: the first probe is the policy's second call, often slow (buffers first touched, TCP
/// windows after the fill's idle gap; unshaped, 4 ranks, 16 MiB: 14-19 ms against 11-12 ms
/// later), and a baseline a third too slow keeps a losing compression going (each compressed
/// call is judged against it). Where compression is predicted to take less than this share,
/// a raw call is the slowest there is, and the close-call probes (`RAW_PROBE_CLOSE`) follow up.
pub(super) const CONFIRM_SHARE: f64 = 0.5;

/// Whether a first prediction waits for a second raw probe: its best least time `best` is
/// above `CONFIRM_SHARE` of the `raw` probe (unknown: no).
pub(super) fn not_far_ahead(best: Option<Duration>, raw: Duration) -> bool {
    best.is_some_and(|b| b.as_secs_f64() > CONFIRM_SHARE * raw.as_secs_f64())
}

/// A prediction above raw by more than this share sends a policy raw without trying: the
/// prediction is a least time, this is room for its error (a busy host timing the sample).
const RAW_MARGIN: f64 = 1.25;

/// What a policy does after its prediction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Decision {
    /// Even the best choice (its least time given) is more than `RAW_MARGIN` slower than raw.
    Raw(Duration),
    /// An exponent cache is predicted more than 5% faster than the cache's best level.
    ExponentCache,
    /// Start at this level. The exponent-cache trial is not skipped on the prediction alone:
    /// a heavy level's predicted codec time is a least time that a busy host misses by half.
    /// It is skipped once the levels are measured and the exponent cache's least time is
    /// longer than the best of them (`exponent_trial`).
    Level(usize),
    /// Nothing predicted (a sample failed): as before, measure.
    Unknown,
}

/// The decision from the least and the expected times of each choice (`least[l]`,
/// `expected[l]` for the cache's `levels`, `[EXP_CACHE]` for an exponent cache, weighed only
/// with `exp_cache`) and the raw time: raw only when even the least time, times `error` (how
/// far the communicator's measured calls of this size fell short of theirs, at least 1:
/// `Compressor::model_error`), loses; otherwise where to start, by expected time. Ties go to
/// the heavier level (the smaller wire).
pub(super) fn decide(
    least: &[Option<Duration>; 4],
    expected: &[Option<Duration>; 4],
    levels: &[usize],
    exp_cache: bool,
    raw: Duration,
    error: f64,
) -> Decision {
    let best_level = levels
        .iter()
        .filter_map(|&l| expected[l].map(|t| (t, l)))
        .min_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
    let exp = if exp_cache { expected[EXP_CACHE] } else { None };
    let known =
        levels.iter().all(|&l| least[l].is_some()) && (!exp_cache || least[EXP_CACHE].is_some());
    let Some((t, level)) = best_level else {
        return Decision::Unknown;
    };
    match best_least(least, levels, exp_cache) {
        Some(best) if known && best.as_secs_f64() * error > RAW_MARGIN * raw.as_secs_f64() => {
            Decision::Raw(best.mul_f64(error))
        }
        _ if exp.is_some_and(|e| e.as_secs_f64() < t.as_secs_f64() / 1.05) => {
            Decision::ExponentCache
        }
        _ => Decision::Level(level),
    }
}

/// The least of the least times of the cache's `levels` and, with `exp_cache`, of an exponent
/// cache.
fn best_least(
    least: &[Option<Duration>; 4],
    levels: &[usize],
    exp_cache: bool,
) -> Option<Duration> {
    levels
        .iter()
        .filter_map(|&l| least[l])
        .chain(least[EXP_CACHE].filter(|_| exp_cache))
        .min()
}

/// A full-value cache that was a delta cache goes back only where Delta frames are expected
/// this much faster than its other levels: it left because they measured slower, and a near
/// tie flips back and forth with each new prediction (seen at 5 Gbit/s early in training:
/// predicted 23.2 against 24.1 ms, measured slower again), a conversion each way.
const PROMOTE_MARGIN: f64 = 1.05;

/// Whether the Delta level's expected time (`expected[2]`) beats every other known level's by
/// `PROMOTE_MARGIN`.
pub(super) fn delta_clearly_fastest(expected: &[Option<Duration>; 4]) -> bool {
    expected[2].is_some_and(|d| {
        expected[..2]
            .iter()
            .flatten()
            .all(|o| d.as_secs_f64() * PROMOTE_MARGIN < o.as_secs_f64())
    })
}

impl super::Compressor {
    /// After a policy's calibrating raw probe (which took `probe` here): calibrate on this
    /// call's shard (in `recv`, after the raw call) against this rank's cache, exchange, and
    /// choose from the agreed prediction where to start, and what not to try.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn predict(
        &mut self,
        engine: &mut crate::engine::Engine,
        key: super::SlotKey,
        pkey: super::SlotKey,
        mode: CacheMode,
        recv: &[u8],
        count: usize,
        dtype: DType,
        probe: Duration,
    ) -> crate::error::Result<()> {
        // No rank codes its sample while another is still in the probe: where ranks share
        // cores, that coding was timed in the others' probe, and the baseline with it (4 ranks
        // on 2 cores: 1.3 MiB gathers probed at 5-7 ms, their raw calls 1-3 ms).
        engine.barrier()?;
        let me = engine.rank();
        let shard = count * dtype.size();
        let input = &recv[me * shard..(me + 1) * shard];
        let own = self.store.take_own(&key);
        // An unfilled policy calibrates against the sample its previous call kept (of this
        // tensor: an inferred-key policy serves several).
        let kept = self
            .policies
            .get_mut(&pkey)
            .expect("policy of the call")
            .prev_sample
            .take()
            .filter(|(k, _)| *k == key)
            .map(|(_, v)| v);
        let cached = own
            .as_ref()
            .and_then(|l| l.slot.values())
            .or(kept.as_deref());
        let threads = self.codec_threads(engine);
        let sample = self.sample(pkey, mode, cached, input, dtype, threads);
        if let Some(l) = own {
            self.store.put(me, l, Some(key));
        }
        self.predict_from(engine, key, pkey, mode, count, dtype, probe, &sample, None)
    }

    /// This rank's calibration for policy `pkey` on a `mode` cache: `input` (this call's shard)
    /// coded against `cached` (the previous call's, None without a cache: nothing coded).
    pub(super) fn sample(
        &self,
        pkey: super::SlotKey,
        mode: CacheMode,
        cached: Option<&[u8]>,
        input: &[u8],
        dtype: DType,
        threads: usize,
    ) -> Sample {
        let levels = super::levels_of(mode);
        let exp_cache = self.policies[&pkey].may_demote && levels.len() > 1;
        let t = Instant::now();
        let s = cached
            .map(|v| calibrate(dtype, mode, levels, exp_cache, v, input, threads))
            .unwrap_or_default();
        tracing::debug!(
            slot = pkey.id,
            ms = t.elapsed().as_secs_f64() * 1e3,
            "calibration sample coded"
        );
        s
    }

    /// Exchange every rank's `sample` and its raw time `probe` (a raw probe's, or the agreed
    /// baseline) and choose from the agreed prediction where to go on, and what not to try.
    /// `first`: the agreed time of an earlier raw probe of this prediction (see
    /// `CONFIRM_SHARE`); the baseline is then the faster of the two.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn predict_from(
        &mut self,
        engine: &mut crate::engine::Engine,
        key: super::SlotKey,
        pkey: super::SlotKey,
        mode: CacheMode,
        count: usize,
        dtype: DType,
        probe: Duration,
        sample: &Sample,
        first: Option<Duration>,
    ) -> crate::error::Result<()> {
        let n = engine.size();
        let shard = count * dtype.size();
        let levels = super::levels_of(mode);
        let exp_cache = self.policies[&pkey].may_demote && levels.len() > 1;
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let threads = self.codec_threads(engine);
        let all = super::verify::exchange_words(engine, &words(probe, cores, threads, sample))?;
        let mut pred = Prediction::from_words(&all, 0, engine.topology());
        if let Some(f) = first {
            pred.raw = pred.raw.min(f);
        }
        let raw_bytes = (n * shard) as u64;
        let least: [Option<Duration>; 4] = std::array::from_fn(|i| pred.least(i, raw_bytes));
        let class = super::size_class(raw_bytes);
        let learned = self.model_error.get(&class).copied();
        let error = learned.unwrap_or(1.0);
        // Another tensor of this size whose compressed calls are measuring the model's error.
        let learner = self
            .learning
            .get(&class)
            .filter(|&&l| l != pkey && self.policies.contains_key(&l))
            .is_some();
        let p = self.policies.get_mut(&pkey).expect("policy of the call");
        let best = best_least(&least, levels, exp_cache);
        if first.is_none()
            && p.raw_probes == 0
            && not_far_ahead(best.map(|b| b.mul_f64(error)), pred.raw)
        {
            // Agreed (every rank holds the same prediction): the next call probes raw again.
            tracing::info!(
                slot = key.id,
                raw_ms = pred.raw.as_secs_f64() * 1e3,
                best_ms = best.map_or(0.0, |b| b.as_secs_f64() * 1e3),
                "predicted: compression not far ahead of raw for this tensor; a second raw probe first"
            );
            p.deferred = Some((*sample, pred.raw));
            return Ok(());
        }
        let expected: [Option<Duration>; 4] = std::array::from_fn(|i| pred.expected(i, raw_bytes));
        let decision = decide(&least, &expected, levels, exp_cache, pred.raw, error);
        let compresses = matches!(decision, Decision::Level(_) | Decision::ExponentCache);
        let first_try = compresses && p.unfilled && learned.is_none();
        if first_try && learner && p.stats.trial_waits < u64::from(TRIAL_WAITS) {
            // Agreed (the learner and the error are): raw, probed, until the other tensor's
            // calls have measured the error of this size, then predicted again with it.
            p.stats.trial_waits += 1;
            tracing::info!(
                slot = key.id,
                raw_ms = pred.raw.as_secs_f64() * 1e3,
                best_ms = best.map_or(0.0, |b| b.as_secs_f64() * 1e3),
                "predicted: compression may pay for this tensor, but another of its size is tried first; raw until its calls have measured the model's error"
            );
            p.deferred = Some((*sample, pred.raw));
            return Ok(());
        }
        // A full-value cache that was a delta cache, calibrated as a delta cache: judged as one
        // (converted back unless Delta frames are expected fastest, below).
        let promoting = p.mode == Some(CacheMode::FullValue) && mode == CacheMode::Delta;
        if promoting {
            p.convert_cache(CacheMode::Delta);
        }
        p.raw_time = Some(pred.raw);
        // Two probes where this prediction waited for a second one.
        p.raw_probes = p.raw_probes.saturating_add(1 + first.is_some() as u32);
        p.prediction = Some(pred);
        p.recalibrate = false;
        p.drifted = false;
        // Times and wire measured in the previous regime no longer compare: every level is
        // judged afresh from the new prediction.
        p.level_time = [None; 3];
        p.wire_ref = [None; 3];
        p.predicted_at = p.stats.calls;
        for &l in levels {
            p.level_wire[l] = pred.wire[l];
        }
        let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e3);
        p.stats.predicted = least;
        tracing::info!(
            slot = key.id,
            raw_ms = pred.raw.as_secs_f64() * 1e3,
            levels_ms = ?levels.iter().map(|&l| ms(least[l])).collect::<Vec<_>>(),
            exp_cache_ms = ?ms(exp_cache.then_some(least[EXP_CACHE]).flatten()),
            model_error = error,
            "predicted least call times ({:?} cache, levels {:?})",
            mode,
            levels.iter().map(|&l| LEVEL_CHOICES[l]).collect::<Vec<_>>()
        );
        let mut drop = false;
        let promote =
            promoting && decision == Decision::Level(2) && delta_clearly_fastest(&expected);
        if promoting {
            if promote {
                tracing::info!(
                    slot = key.id,
                    "predicted: Delta frames pay again for this tensor: back to a delta cache (converted)"
                );
            } else {
                // Stays a full-value cache: nothing to convert.
                p.convert_cache(CacheMode::FullValue);
                p.convert_to = None;
            }
        }
        match decision {
            Decision::Raw(best) => {
                p.raw_until = p.stats.calls + p.backoff;
                p.recalibrate = true;
                drop = true;
                p.stats.predicted_raw += 1;
                tracing::info!(
                    slot = key.id,
                    best_ms = best.as_secs_f64() * 1e3,
                    raw_ms = pred.raw.as_secs_f64() * 1e3,
                    "predicted: compression cannot beat raw on this link for this tensor: raw for {} calls, not tried",
                    p.backoff
                );
                p.backoff = (p.backoff * 2).min(1 << 16);
            }
            Decision::ExponentCache => {
                p.trial = super::Trial::Done;
                p.may_demote = false;
                p.convert_cache(CacheMode::Exponent);
                tracing::info!(
                    slot = key.id,
                    "predicted: an exponent cache is faster for this tensor than its {mode:?} cache's best level: moving to it"
                );
            }
            Decision::Level(level) => {
                p.level = if promoting && !promote {
                    // The delta cache's level as the full-value cache's (Exp and Hybrid: its
                    // everything level).
                    [0, 2, 2][level]
                } else {
                    level
                };
            }
            Decision::Unknown => {}
        }
        if drop {
            // Raw for a back-off: caches it holds (a new regime predicted) go, as after slow
            // calls (`drop_caches`); an unfilled policy holds none.
            self.drop_caches(pkey, key);
        }
        if first_try {
            // This tensor's calls measure its size's error; others of its size wait for it.
            self.learning.insert(class, pkey);
        }
        Ok(())
    }
}

/// A tensor whose first prediction says compression may pay waits, raw, for at most this many
/// calls while another tensor of its size (`size_class`) measures the model's error of that
/// size (`Compressor::model_error`), then is predicted again with it: the layers of a model
/// come in sizes, and each of its first calls costs a fill and trial calls of every tensor
/// alike (4 ranks on 2 cores, 3 layers: every one of 6 tensors filled and tried before the
/// first verdict, 0.81-0.91x raw over 100 iterations).
pub const TRIAL_WAITS: u32 = 8;

#[cfg(test)]
mod tests {
    use super::*;

    /// 4 ranks on one host of 2 cores, each shard 4 MiB: per rank Exp encodes in 1 ms and
    /// decodes a shard in 0.5 ms, Delta 8 ms and 5 ms; wire 2x and 5x smaller than raw.
    fn words_of(cores: u64) -> Vec<Vec<u64>> {
        let raw = 4u64 << 20;
        let s = Sample {
            wire: [Some(raw / 2), None, Some(raw / 5), Some(raw / 2)],
            enc_ns: [Some(1_000_000), None, Some(8_000_000), Some(800_000)],
            dec_ns: [Some(500_000), None, Some(5_000_000), Some(400_000)],
            ..Sample::default()
        };
        (0..4)
            .map(|_| words(Duration::from_millis(40), cores as usize, 1, &s).to_vec())
            .collect()
    }

    #[test]
    fn a_close_first_prediction_waits_for_a_second_raw_probe() {
        let ms = |v: f64| Duration::from_secs_f64(v / 1e3);
        // Unshaped, 4 ranks on 2 cores: 9.2 ms predicted against a 12 ms first probe.
        assert!(not_far_ahead(Some(ms(9.2)), ms(12.0)));
        assert!(not_far_ahead(Some(ms(6.1)), ms(12.0)));
        // 5 Gbit/s: 24 ms against 84 ms; 1 Gbit/s further still.
        assert!(!not_far_ahead(Some(ms(24.2)), ms(84.3)));
        assert!(!not_far_ahead(Some(ms(5.9)), ms(12.0)));
        assert!(!not_far_ahead(None, ms(12.0)));
    }

    #[test]
    fn a_delta_cache_comes_back_only_on_a_clear_win() {
        let ms = |v: f64| Some(Duration::from_secs_f64(v / 1e3));
        assert!(!delta_clearly_fastest(&[
            ms(46.4),
            ms(24.1),
            ms(23.2),
            None
        ]));
        assert!(delta_clearly_fastest(&[ms(46.4), ms(24.1), ms(22.9), None]));
        assert!(delta_clearly_fastest(&[None, None, ms(22.9), None]));
        assert!(!delta_clearly_fastest(&[ms(46.4), ms(24.1), None, None]));
        // The exponent cache (index 3) is another decision's.
        assert!(delta_clearly_fastest(&[
            ms(46.4),
            ms(24.1),
            ms(20.0),
            ms(1.0)
        ]));
    }

    #[test]
    fn prediction_is_wire_and_shared_codec_time() {
        let topo = Topology::single_host(4);
        let p = Prediction::from_words(&words_of(2), 0, &topo);
        assert_eq!(p.raw, Duration::from_millis(40));
        assert!(
            p.additive,
            "4 ranks on 2 cores: the cores that code also move the bytes"
        );
        // Whole ms (the wire is scaled in floating point).
        let ms = |d: Option<Duration>| d.map(|d| (d.as_secs_f64() * 1e3).round() as u64);
        let raw_bytes = 16u64 << 20;
        assert_eq!(p.wire[0], Some((raw_bytes / 2) as f64));
        assert_eq!(p.wire[1], None);
        // Exp: wire 20 ms; codec per rank 1 + 3 x 0.5 ms, 4 ranks on 2 cores: 5 ms; one host:
        // the sum.
        assert_eq!(p.codec[0], Some(Duration::from_millis(5)));
        assert_eq!(ms(p.least(0, raw_bytes)), Some(25));
        // Delta: wire 8 ms; codec (8 + 15) x 4 / 2 = 46 ms.
        assert_eq!(p.codec[2], Some(Duration::from_millis(46)));
        assert_eq!(ms(p.least(2, raw_bytes)), Some(54));
        assert_eq!(p.least(1, raw_bytes), None);
        // Cores enough for every thread: the codec overlaps the wire, the larger.
        let p = Prediction::from_words(&words_of(12), 0, &topo);
        assert!(!p.additive);
        assert_eq!(ms(p.least(0, raw_bytes)), Some(20));
        assert_eq!(ms(p.least(2, raw_bytes)), Some(15));
        // With 16 cores each rank has its two threads: Delta's longest thread, 15 ms of
        // decoding, bounds it.
        let p = Prediction::from_words(&words_of(16), 0, &topo);
        assert_eq!(p.codec[2], Some(Duration::from_millis(15)));
        // Two hosts of two ranks: each host's own ranks share its cores.
        let topo = Topology::new(&[0, 0, 1, 1], true);
        let p = Prediction::from_words(&words_of(2), 0, &topo);
        assert_eq!(p.codec[2], Some(Duration::from_millis(23)));
        assert!(p.additive, "2 ranks on 2 cores per host");
    }

    #[test]
    fn codec_threads_shorten_the_longest_thread_not_the_work() {
        // As `words_of`, on 4 codec threads per rank: Delta encodes in 3 ms and decodes a
        // shard in 2 ms there (8 and 5 on one).
        let raw = 4u64 << 20;
        let s = Sample {
            wire: [Some(raw / 2), None, Some(raw / 5), Some(raw / 2)],
            enc_ns: [Some(1_000_000), None, Some(8_000_000), Some(800_000)],
            dec_ns: [Some(500_000), None, Some(5_000_000), Some(400_000)],
            enc_wall_ns: [None, None, Some(3_000_000), None],
            dec_wall_ns: [None, None, Some(2_000_000), None],
        };
        let all = |cores: usize, threads: usize| -> Vec<Vec<u64>> {
            (0..4)
                .map(|_| words(Duration::from_millis(40), cores, threads, &s).to_vec())
                .collect()
        };
        let topo = Topology::single_host(4);
        // 64 cores: Delta's longest thread decodes three shards, 3 x 2 ms (15 ms on one
        // thread); Exp, not timed on threads, as before (1 + 1.5 ms: 1.5 ms).
        let p = Prediction::from_words(&all(64, 4), 0, &topo);
        assert_eq!(p.codec[2], Some(Duration::from_millis(6)));
        assert_eq!(p.codec[0], Some(Duration::from_micros(1500)));
        // 8 cores for 32 threads: the work, (8 + 15) x 4 ms on one thread, over 8 cores.
        let p = Prediction::from_words(&all(8, 4), 0, &topo);
        assert_eq!(p.codec[2], Some(Duration::from_micros(11_500)));
        // Without threaded times (one codec thread): the one-thread decode, 15 ms, bounds it.
        let p = Prediction::from_words(&words_of(64), 0, &topo);
        assert_eq!(p.codec[2], Some(Duration::from_millis(15)));
    }

    #[test]
    fn decisions_from_least_times() {
        let ms = |v: u64| Some(Duration::from_millis(v));
        let raw = Duration::from_millis(400);
        let all = &[0, 1, 2];
        // 1 Gbit/s: Delta frames fastest; an exponent cache's wire (210 ms) cannot beat them.
        let at_1g = [ms(210), ms(180), ms(80), ms(210)];
        assert_eq!(
            decide(&at_1g, &at_1g, all, true, raw, 1.0),
            Decision::Level(2)
        );
        // Without an exponent cache to weigh: the same start.
        assert_eq!(
            decide(&at_1g, &at_1g, all, false, raw, 1.0),
            Decision::Level(2)
        );
        // A fast link where the codec sets the time: Exp or Hybrid first, the trial still open
        // (an exponent cache's 60 ms is within 5% of 62 ms); more than 5% faster: moved to.
        let fast = [ms(70), ms(62), ms(120), ms(60)];
        assert_eq!(
            decide(&fast, &fast, all, true, raw, 1.0),
            Decision::Level(1)
        );
        let fast = [ms(70), ms(62), ms(120), ms(50)];
        assert_eq!(
            decide(&fast, &fast, all, true, raw, 1.0),
            Decision::ExponentCache
        );
        // Everything more than 25% slower than raw: raw, untried. Within 25%: measured.
        let slow = [ms(30), ms(60), ms(90), ms(26)];
        let r = Duration::from_millis(20);
        assert_eq!(
            decide(&slow, &slow, all, true, r, 1.0),
            Decision::Raw(Duration::from_millis(26))
        );
        let r = Duration::from_millis(21);
        assert_eq!(
            decide(&slow, &slow, all, true, r, 1.0),
            Decision::ExponentCache
        );
        // Where the communicator's calls measured 1.6x their least times, 26 ms is 41.6 ms:
        // raw even against 33 ms; not against 34 ms (41.6 < 1.25 x 34).
        assert_eq!(
            decide(&slow, &slow, all, true, Duration::from_millis(33), 1.6),
            Decision::Raw(Duration::from_micros(41_600))
        );
        assert_eq!(
            decide(&slow, &slow, all, true, Duration::from_millis(34), 1.6),
            Decision::ExponentCache
        );
        // A choice not predicted (a failed sample): never raw untried.
        let partial = [ms(30), None, ms(90), ms(26)];
        assert_eq!(
            decide(&partial, &partial, all, true, Duration::from_millis(1), 1.0),
            Decision::ExponentCache
        );
        assert_eq!(
            decide(&[None; 4], &[None; 4], all, true, raw, 1.0),
            Decision::Unknown
        );
        // Where the codec binds, the start is chosen by expected time (the codec 1.5x longer):
        // Delta frames predicted at 31 ms of codec (46.5 expected) start behind Hybrid's 43 ms
        // of wire; the raw verdict still weighs least times.
        let least_5g = [ms(43), ms(43), ms(31), ms(43)];
        let expected_5g = [ms(43), ms(43), ms(46), ms(43)];
        let start_at_hybrid = Decision::Level(1);
        for (raw_ms, want) in [
            (400, start_at_hybrid),
            (36, start_at_hybrid),
            (24, Decision::Raw(Duration::from_millis(31))),
        ] {
            let r = Duration::from_millis(raw_ms);
            assert_eq!(
                decide(&least_5g, &expected_5g, all, true, r, 1.0),
                want,
                "{raw_ms}"
            );
        }
        // Ties: the heavier level.
        let tie = [ms(50), None, ms(50), None];
        assert_eq!(
            decide(&tie, &tie, &[0, 2], false, raw, 1.0),
            Decision::Level(2)
        );
    }

    /// `n` bf16 values before and after a step that moves a quarter of them by one ulp.
    fn one_ulp_step(n: usize) -> (Vec<u8>, Vec<u8>) {
        let at = |i: usize, moved: bool| (0x3f80u16 + (i % 97) as u16 + moved as u16).to_le_bytes();
        (
            (0..n).flat_map(|i| at(i, false)).collect(),
            (0..n).flat_map(|i| at(i, i % 4 == 0)).collect(),
        )
    }

    /// `calibrate` of bf16 values on a delta cache, every level and the exponent cache.
    fn calibrate_bf16_delta(old: &[u8], new: &[u8], threads: usize) -> Sample {
        calibrate(
            DType::BF16,
            CacheMode::Delta,
            &[0, 1, 2],
            true,
            old,
            new,
            threads,
        )
    }

    #[test]
    fn calibration_codes_real_frames_at_every_level() {
        let n = 50_000usize;
        let (old, new) = one_ulp_step(n);
        let s = calibrate_bf16_delta(&old, &new, 1);
        assert_eq!((s.enc_wall_ns, s.dec_wall_ns), ([None; 4], [None; 4]));
        for i in 0..4 {
            let w = s.wire[i].unwrap_or_else(|| panic!("choice {i} not coded"));
            assert!(w > 0 && w < (2 * n) as u64, "choice {i}: {w} bytes");
            assert!(s.enc_ns[i].is_some() && s.dec_ns[i].is_some());
        }
        // Delta frames code one-ulp moves in far fewer bytes than Exp frames' mantissas.
        assert!(s.wire[2].unwrap() * 3 < s.wire[0].unwrap(), "{s:?}");
        // A full-value cache has no level 1 here, and nothing is coded without a cache.
        let s = calibrate(
            DType::BF16,
            CacheMode::FullValue,
            &[0, 2],
            false,
            &old,
            &new,
            4,
        );
        assert_eq!((s.wire[1], s.wire[3]), (None, None));
        assert!(s.wire[0].is_some() && s.wire[2].is_some());
        // A full-value cache's frames never split: not timed on threads.
        assert_eq!((s.enc_wall_ns, s.dec_wall_ns), ([None; 4], [None; 4]));
        let s = calibrate(
            DType::BF16,
            CacheMode::Delta,
            &[2],
            false,
            &old[2..],
            &new,
            1,
        );
        assert_eq!(s, Sample::default());
    }

    #[test]
    fn calibration_times_a_delta_cache_on_the_codec_threads() {
        // A sample of eight groups (the first 2^18 elements), whose Delta frames split.
        let (old, new) = one_ulp_step(300_000);
        let before = crate::codec::split_codings();
        let s = calibrate_bf16_delta(&old, &new, 3);
        assert!(
            crate::codec::split_codings() > before,
            "no coding was split over the threads"
        );
        // The level that may send Delta frames, and only that one (Exp and Hybrid frames
        // never split).
        assert!(
            s.enc_wall_ns[2].is_some() && s.dec_wall_ns[2].is_some(),
            "{s:?}"
        );
        for i in [0, 1, 3] {
            assert_eq!((s.enc_wall_ns[i], s.dec_wall_ns[i]), (None, None), "{s:?}");
        }
        // The one-thread times, bytes and all, are as without threads.
        let one = calibrate_bf16_delta(&old, &new, 1);
        assert_eq!(s.wire, one.wire);
    }
}
