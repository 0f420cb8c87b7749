//! The compression policy of the CIERA Allgather: the codec fused into the engine's pipeline,
//! used only where it pays. The communicator owns one [`Compressor`] and every caller (the C
//! ABI, the interposers, the CLI) reaches it through `Communicator::all_gather_keyed` /
//! `all_gather_with`.
//!
//! Per call: find the tensor's policy (an explicit key, or the call's shape when the key is
//! inferred), decide raw or compressed, and run the allgather. A compressed call goes through
//! the engine's framed allgather ([`crate::engine::Engine::all_gather_framed`]): each rank
//! encodes its own chunks against its own cache of its shard (compress once, at the source),
//! every hop forwards frames unchanged, and every receiver decodes each frame into the output
//! and into its copy of that source's cache, found by the version the frame names (see
//! [`store`]). After a compressed call the ranks exchange a small status record (decode
//! failures, call time, optional shard hashes); every decision after that is a function of
//! exchanged values and call counts only, so all ranks always agree on raw versus compressed
//! without an extra round trip.
//!
//! Decisions (`CIERA_COMPRESS=auto`, the default):
//! - raw: types the codec does not compress, shards below `min_shard_bytes`, latency-bound
//!   algorithms (not the ring or the hierarchical rings), and tensors whose caches alone exceed the budget;
//! - the first call of a policy is raw and keeps a sample of this rank's shard (`keep_sample`);
//! - the second is a timed raw call (the baseline; one call in 64 is again, to keep it
//!   current); where the prediction made at it (below) finds compression not far ahead of
//!   raw, the third is a second raw probe and the prediction is made with the faster of the
//!   two (the second call is often slow: buffers first touched, TCP windows after an idle
//!   gap). The probe that makes the prediction fills every rank's caches of every source from
//!   its result, in the cache mode decided, unless it sends the tensor raw
//!   (`fill_if_decided`): a tensor that never compresses never holds a cache. Under `on` the
//!   first call is a raw *fill* instead (a raw call plus a copy into every cache);
//! - then delta calls; each one's time (slowest rank) is compared with the raw baseline
//!   (slowest rank); after two in a row that are not at least 5% faster, the policy goes raw
//!   for a back-off period (256 calls, doubling each time), drops its caches (`drop_caches`),
//!   and is re-probed and recalibrated after it (against a sample kept at the call before). A policy
//!   with several frame levels (below) is judged by its fastest level, once each is timed.
//!   A delta or full-value cache the default chose then tries an exponent cache once (two
//!   calls after a refill; kept if as fast as its own best level, see `Trial`), and when even
//!   its best level loses to raw it moves to an exponent cache before it goes raw: Exp frames
//!   that must also keep full values cost more than on an exponent cache; not where the
//!   exponent cache's least time, scaled by how far the measured levels fell short of their
//!   own, loses too (then raw at once). `on`
//!   always compresses, `off` never.
//! - a policy on delta or full-value caches also chooses its frame level by time (Exp only,
//!   Exp or Hybrid, everything the cache takes): each level timed after the first timed call
//!   of the one in use, then one other every few calls, the fastest kept unless within 5% of
//!   the one in use (`level_for_call`, `prefer_level`): heavier codecs cost several times
//!   Exp's, which a fast link does not pay back. Frames name their kind, so this is the
//!   sender's choice alone.
//! - Predicted before tried (`predict`): at a policy's first raw probe every rank codes a
//!   sample of its new shard against its cache at each frame level and as an exponent cache
//!   would (real frames, real codec time), and the ranks exchange those with the probe's
//!   time. The agreed least time of each choice, the larger of its wire (the raw baseline
//!   scaled by its frame bytes) and its codec work (each rank's, on the cores of its host),
//!   picks the level to start at, moves to an exponent cache or skips its trial, and sends a
//!   tensor raw at once when even the best choice is predicted 25% slower than raw (then
//!   recalibrated after the back-off), its least times weighed by the model's error measured
//!   on this communicator's earlier calls of that size (`Compressor::model_error`). Where
//!   that error is not known yet and another tensor of the size, filled, is measuring it, a
//!   tensor predicted to compress waits raw (`predict::TRIAL_WAITS` calls at most) and is
//!   predicted again with it: a model's layers are not all filled and tried at once. The
//!   ranks pass a barrier before they code their samples, so that no rank's coding is timed
//!   in another's probe on shared cores.
//! - A new regime is predicted again (`Policy::drift`): when a level's wire moves more than
//!   `RECALIBRATE_DRIFT` from its first call after the last prediction (the learning rate fell,
//!   the ratios rose), the next compressed call codes the sample before it encodes and the
//!   ranks exchange it after the call, with the raw baseline they hold (no raw call).
//! - Moves between cache modes convert the tensor's caches in place where they hold values
//!   (`Policy::convert_cache`, `CacheSlot::converted`): no raw refill. A default delta cache
//!   whose Delta frames lose to its lighter levels becomes a full-value cache (`promotable`:
//!   at each new regime it is calibrated as a delta cache and goes back if Delta frames are
//!   expected fastest).
//! - While it runs, every encoder estimates, per chunk, its frames' bytes at each
//!   frame level (`SlotChunk::encode_estimated`, from the counts its choice computes anyway), and
//!   the status record carries each rank's sums, so every rank knows the wire every level
//!   would send. A level (or the exponent-cache trial) whose least time (its wire, the raw
//!   baseline scaled by its bytes, or its predicted codec time, the larger) is longer than the
//!   best level's measured call cannot win and is neither timed nor probed (`Policy::hopeless_levels`, `cannot_win`): on a 1 Gbit/s link a
//!   delta cache never tries Exp frames (1.9x) against Delta's 5x, while on a fast link,
//!   where the codec sets the time, every level is still measured.
//! - A source with no cache of its shard (a buffer that moved, an evicted or reset cache)
//!   sends FILL frames within a delta call: a *miss*, counted apart from repairs.
//!
//! Memory: caches are evicted least recently used first after every call until they fit
//! `CIERA_CACHE_MB` (every rank alike); a compressed call holds only the frames in flight.
//!
//! Failures: a frame that does not decode (a version this rank does not hold after a reset, a
//! checksum error) or, with `CIERA_VERIFY=1`, a decoded shard whose hash differs from the
//! sender's, is detected on the receiver, exchanged in the status record, logged as an error
//! naming the source rank, and repaired at once: the call is redone raw, so the returned
//! tensor is exact, and every rank refills its cache of that source from the result.

#![forbid(unsafe_code)]

mod config;
mod framed;
mod group_codec;
mod predict;
pub use predict::TRIAL_WAITS;
mod stats;
mod store;
mod verify;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::codec::{CacheMode, FrameChoice};
use crate::engine::Engine;
use crate::error::Result;
use crate::DType;
pub use config::{
    cache_mb_to_bytes, CompressConfig, CompressMode, GatherOptions, DEFAULT_CACHE_MB,
    DEFAULT_MIN_SHARD_BYTES,
};
pub use group_codec::FRAME_FORMAT;
pub use stats::{CallKind, CallReport, SlotKey, SlotStats, Stats};
use store::Store;

/// The agreed state of one policy: one tensor (an explicit key), or every tensor of one shape
/// (inferred keys: addresses differ between ranks, count and type do not). Every field is a
/// function of call counts and exchanged values, so every rank holds the same.
struct Policy {
    /// The cache mode of the lineages this policy starts; None: too large for the budget.
    mode: Option<CacheMode>,
    /// Raw until this call number (of this policy), after two slow deltas in a row.
    raw_until: u64,
    backoff: u64,
    /// The raw baseline: agreed (slowest rank) time of the last timed raw call, and how many
    /// raw calls have been timed.
    raw_time: Option<Duration>,
    raw_probes: u32,
    /// This rank's time of a raw probe call not yet exchanged (sent with the next status).
    pending_raw: Option<Duration>,
    /// A first prediction that found compression not far ahead of raw waits for a second raw
    /// probe (the next call): this rank's calibration and the first probe's agreed time
    /// (`predict::CONFIRM_SHARE`).
    deferred: Option<(predict::Sample, Duration)>,
    /// Consecutive delta calls slower than the raw baseline (one slow call is noise).
    slow_streak: u32,
    /// Policies under `auto`: the frame level in use (an index of `LEVEL_CHOICES`; several on
    /// delta and full-value caches), the agreed (slowest rank) time of the calls at each level
    /// (`smoothed`; an exponent cache's one level too), and the level of the call in flight.
    level: usize,
    level_time: [Option<Duration>; 3],
    call_level: usize,
    /// Agreed wire bytes a call of this policy would send at each frame level: measured at the
    /// level of the last call, predicted for the others from the encoders' estimates (the
    /// `LevelBytes` sums every rank reports in its status record).
    level_wire: [Option<f64>; 3],
    /// Per frame level, measured over estimated bytes at its last call (estimates miss
    /// different overheads at different levels: each level's is corrected by its own).
    wire_scale: [Option<f64>; 3],
    /// The prediction made at the first raw probe (and after each back-off), see `predict`.
    prediction: Option<predict::Prediction>,
    /// The next raw probe calibrates a new prediction (after a back-off it decided).
    recalibrate: bool,
    /// The wire drifted (`drift`): the next compressed call calibrates on its own shard before
    /// it encodes, and the ranks predict again after it, with the raw baseline they hold (no
    /// raw call: on a slow link one costs several compressed ones).
    drifted: bool,
    /// Per frame level, the agreed wire bytes of its first call after the last prediction, and
    /// the call number of that prediction: what `drift` compares later calls with.
    wire_ref: [Option<f64>; 3],
    predicted_at: u64,
    /// Calls after a prediction before the wire may call for another: doubles with each one
    /// the wire called for (a tensor whose ratios swing from step to step settles), up to
    /// `RECALIBRATE_MAX_CALLS`.
    drift_spacing: u64,
    /// The cache mode was the default's choice (not asked for), so a policy whose every frame
    /// level loses to raw may move to an exponent cache before it goes raw.
    may_demote: bool,
    /// The next call fills new caches (after a move to another cache mode).
    refill: bool,
    /// The next compressed call first converts the tensor's caches, on every rank, to this
    /// mode (`CacheSlot::converted`): a move from a delta or full-value cache costs a pass
    /// over the caches, not a raw call.
    convert_to: Option<CacheMode>,
    /// (source, version) of the tensor's lineages after its last call: what a conversion
    /// converts (every rank holds the same).
    held: Vec<(usize, u64)>,
    /// The cache mode is the default's (not asked for): a delta cache whose Delta frames lose
    /// becomes a full-value cache, and goes back when the regime changes (`promotable`).
    default_mode: bool,
    /// A full-value cache that was such a delta cache.
    promotable: bool,
    /// The one trial of an exponent cache a default delta / full-value cache makes.
    trial: Trial,
    /// An `auto` policy holds no caches until a prediction says compression may pay (its
    /// first call, and every back-off, leaves it without): the raw probe that decides so fills
    /// them from its result, in the mode decided (`Compressor::fill_if_decided`).
    unfilled: bool,
    /// This rank's first `predict::SAMPLE_ELEMS` elements of its shard at the raw call before a
    /// calibrating probe of an unfilled policy, with the key of that call (an inferred-key
    /// policy serves several tensors): what the probe's calibration codes against.
    prev_sample: Option<(SlotKey, Vec<u8>)>,
    stats: SlotStats,
}

impl Policy {
    /// A new policy of caches of `mode` (None: raw), the default's choice or asked for.
    fn new(mode: Option<CacheMode>, default_mode: bool) -> Policy {
        Policy {
            mode,
            raw_until: 0,
            backoff: 256,
            raw_time: None,
            raw_probes: 0,
            pending_raw: None,
            deferred: None,
            slow_streak: 0,
            level: 2,
            level_time: [None; 3],
            call_level: 2,
            level_wire: [None; 3],
            wire_scale: [None; 3],
            prediction: None,
            recalibrate: false,
            drifted: false,
            wire_ref: [None; 3],
            predicted_at: 0,
            drift_spacing: RECALIBRATE_MIN_CALLS,
            may_demote: default_mode,
            refill: false,
            convert_to: None,
            held: Vec::new(),
            default_mode,
            promotable: false,
            trial: Trial::NotYet,
            unfilled: false,
            prev_sample: None,
            stats: SlotStats::default(),
        }
    }

    /// Moves to caches of `mode`: the next call refills them (the old ones are no longer used
    /// and leave by the budget's least-recently-used eviction, alike on every rank), and its
    /// frame levels are timed afresh.
    fn switch_cache(&mut self, mode: CacheMode) {
        self.mode = Some(mode);
        self.refill = true;
        self.convert_to = None;
        self.level = 2;
        self.level_time = [None, None, None];
        self.level_wire = [None, None, None];
        self.wire_scale = [None; 3];
        self.stats.frame_choice = None;
    }

    /// Moves from a delta or full-value cache to caches of `mode` converted from it (see
    /// `convert_to`; no refill). What was measured of each frame level carries over where the
    /// other mode sends the same frames: a delta cache's Exp-or-Hybrid level is a full-value
    /// cache's everything level, and the other way round; toward an exponent cache nothing does.
    fn convert_cache(&mut self, mode: CacheMode) {
        let from = self.mode;
        self.mode = Some(mode);
        self.refill = false;
        self.convert_to = Some(mode);
        self.stats.frame_choice = None;
        self.wire_ref = [None; 3];
        // Level l of the old mode is level map[l] of the new one.
        let map: [Option<usize>; 3] = match (from, mode) {
            (Some(CacheMode::Delta), CacheMode::FullValue) => [Some(0), Some(2), None],
            (Some(CacheMode::FullValue), CacheMode::Delta) => [Some(0), None, Some(1)],
            _ => [None; 3],
        };
        fn remap<T: Copy>(old: [Option<T>; 3], map: [Option<usize>; 3]) -> [Option<T>; 3] {
            let mut new = [None; 3];
            for (l, to) in map.iter().enumerate() {
                if let Some(t) = to {
                    new[*t] = old[l];
                }
            }
            new
        }
        self.level = map[self.level].unwrap_or(2);
        self.level_time = remap(self.level_time, map);
        self.level_wire = remap(self.level_wire, map);
        self.wire_scale = remap(self.wire_scale, map);
        if let Some(p) = self.prediction.as_mut() {
            let (mut w, mut c) = (
                remap([p.wire[0], p.wire[1], p.wire[2]], map),
                remap([p.codec[0], p.codec[1], p.codec[2]], map),
            );
            if mode == CacheMode::Exponent {
                // An exponent cache's one level is the prediction's exponent-cache choice.
                (w[2], c[2]) = (p.wire[predict::EXP_CACHE], p.codec[predict::EXP_CACHE]);
            }
            p.wire[..3].copy_from_slice(&w);
            p.codec[..3].copy_from_slice(&c);
        }
    }

    /// The least time a call at each frame level can take, predicted before it is tried: the
    /// raw baseline scaled by the level's wire bytes over the raw bytes (`raw_bytes`, all
    /// ranks' shards). Moving bytes costs time in proportion to them, on the wire or in the
    /// transport's CPU, while the codec costs extra: a call at that level takes at least this
    /// long, about. None where the level's wire or the raw baseline is not known yet.
    fn wire_bound(&self, raw_bytes: u64) -> [Option<Duration>; 3] {
        std::array::from_fn(|l| self.wire_time(self.level_wire[l]?, raw_bytes))
    }

    /// The raw baseline scaled by `wire` bytes over the raw bytes (`raw_bytes`): the least time
    /// moving `wire` bytes takes (`wire_bound`). None before a baseline, or for no raw bytes.
    fn wire_time(&self, wire: f64, raw_bytes: u64) -> Option<Duration> {
        let base = self.raw_time.filter(|_| raw_bytes > 0)?;
        Some(base.mul_f64(wire / raw_bytes as f64))
    }

    /// One raw probe in how many calls (see `RAW_PROBE_RARELY`), from agreed times. The first
    /// baseline is the policy's second call, often slow (buffers first touched, TCP windows
    /// after the fill's idle gap: unshaped, 13-17 ms against 10-11 ms later): unless far
    /// ahead of it, the compressed calls meet a second one within RAW_PROBE_CLOSE calls.
    fn raw_probe_period(&self) -> u64 {
        let best = self.level_time.iter().flatten().min();
        match (best, self.raw_time) {
            (Some(b), Some(r)) if b.as_secs_f64() < 0.5 * r.as_secs_f64() => RAW_PROBE_RARELY,
            (Some(b), Some(r))
                if b.as_secs_f64() > RAW_CLOSE * r.as_secs_f64() || self.raw_probes < 2 =>
            {
                RAW_PROBE_CLOSE
            }
            _ => RAW_PROBE_EVERY,
        }
    }

    /// The least time of a call at each level: its wire bound with its codec time as
    /// predicted (`predict`, `least_of`), where known.
    fn least_time(&self, raw_bytes: u64) -> [Option<Duration>; 3] {
        let wire = self.wire_bound(raw_bytes);
        std::array::from_fn(|l| self.least_of(wire[l], l))
    }

    /// The least time of an exponent cache's calls: the Exp level's wire, its own codec.
    fn exp_cache_least(&self, raw_bytes: u64) -> Option<Duration> {
        self.least_of(self.wire_bound(raw_bytes)[0], predict::EXP_CACHE)
    }

    /// Whether an exponent cache would lose to the raw baseline too (a policy whose every
    /// level lost decides between it and raw): its least time, scaled by how far this
    /// policy's measured levels fell short of their own least times (the smallest such
    /// factor, at least 1: the model's error they share, e.g. a transport that takes the
    /// codec's cores), is above `SLOW_SHARE` of the baseline. Unknown: it may win. Measured
    /// (4 ranks on 2 cores, loopback TCP, 16 MiB bf16): levels 1.4-1.8x their least times,
    /// and the exponent cache then tried took 16-18 ms against raw's 12-15 ms.
    fn exp_cache_loses_too(&self, raw_bytes: u64) -> bool {
        let (Some(base), Some(bound)) = (self.raw_time, self.exp_cache_least(raw_bytes)) else {
            return false;
        };
        let least = self.least_time(raw_bytes);
        let shortfall = (0..3)
            .filter_map(|l| {
                let (t, b) = (self.level_time[l]?, least[l]?);
                (b > Duration::ZERO).then(|| t.as_secs_f64() / b.as_secs_f64())
            })
            .fold(f64::INFINITY, f64::min);
        shortfall.is_finite() && slow(bound.mul_f64(shortfall.max(1.0)), base)
    }

    /// Whether the level in use measured slow against the raw baseline (`slow`).
    fn level_loses_to_raw(&self) -> bool {
        matches!((self.level_time[self.level], self.raw_time), (Some(t), Some(r)) if slow(t, r))
    }

    /// `wire` with the predicted codec time of choice `i` (`Prediction::combine`), whichever
    /// are known.
    fn least_of(&self, wire: Option<Duration>, i: usize) -> Option<Duration> {
        let p = self.prediction;
        match (wire, p.and_then(|p| p.codec[i])) {
            (Some(w), Some(c)) => p.map(|p| p.combine(w, c)),
            (w, c) => w.or(c),
        }
    }

    /// After a compressed call at `level` that sent `wire` bytes (agreed): whether the tensor's
    /// statistics moved so far from those the prediction was made on (a new training regime:
    /// the learning rate fell, the ratios rose) that it should be made again. Compares with
    /// the level's first call after the prediction, not with the sample's scaled bytes (a
    /// tensor's first elements need not be like the rest); not sooner than
    /// `drift_spacing` calls after the last prediction.
    fn drift(&mut self, level: usize, wire: f64) -> bool {
        if self.prediction.is_none() || self.recalibrate || self.drifted || wire <= 0.0 {
            return false;
        }
        let Some(then) = self.wire_ref[level] else {
            self.wire_ref[level] = Some(wire);
            return false;
        };
        let moved = (wire / then).max(then / wire);
        let due =
            moved > RECALIBRATE_DRIFT && self.stats.calls >= self.predicted_at + self.drift_spacing;
        if due {
            self.drift_spacing = (self.drift_spacing * 2).min(RECALIBRATE_MAX_CALLS);
        }
        due
    }

    /// The frame levels that cannot win, predicted (see `cannot_win`): not timed, not probed.
    fn hopeless_levels(&self, levels: &[usize], raw_bytes: u64) -> [bool; 3] {
        let bound = self.least_time(raw_bytes);
        let best = levels.iter().filter_map(|&l| self.level_time[l]).min();
        std::array::from_fn(|l| {
            l != self.level && self.level_time[l].is_none() && cannot_win(bound[l], best)
        })
    }
}

/// Whether a choice whose least possible time is `bound` (`Policy::least_time`) cannot beat
/// `best`, a time measured: even at its least it would take longer. Either unknown: it may win.
fn cannot_win(bound: Option<Duration>, best: Option<Duration>) -> bool {
    matches!((bound, best), (Some(b), Some(t)) if b > t)
}

/// A default delta or full-value cache, once each of its frame levels is timed (and it beats
/// raw), tries an exponent cache for `TRIAL_CALLS` calls and keeps it if those were at least as
/// fast as its own best level; else it goes back (refilled). Exp frames on an exponent cache
/// cost less than on a cache that also keeps full values, which a fast link can prefer to the
/// heavier frames' smaller wire.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Trial {
    NotYet,
    Running {
        from: CacheMode,
        best: Duration,
        calls: u32,
        time: Option<Duration>,
    },
    Done,
}

const TRIAL_CALLS: u32 = 2;

/// After a call of an exponent-cache trial (its smoothed time over `calls` calls): None while
/// it runs, then whether to keep the exponent cache against `best`, the time of the cache it
/// left.
fn trial_verdict(time: Duration, calls: u32, best: Duration) -> Option<bool> {
    (calls >= TRIAL_CALLS).then_some(time <= best)
}

/// Per-communicator compression state.
pub struct Compressor {
    pub config: CompressConfig,
    store: Store,
    policies: HashMap<SlotKey, Policy>,
    clock: u64,
    /// How far this communicator's compressed calls fell short of their predicted least
    /// times, per size class of the gathered tensor (`size_class`): the smallest ratio of a
    /// call's agreed time to its level's least time (its wire, as measured, and its predicted
    /// codec) seen so far, at least 1. What the model leaves out (the pipeline's copies and
    /// hand-offs, a codec slower on a whole shard than on the cache-warm sample, cores shared
    /// with the transport, a call's fixed costs) is a property of the host, its links and the
    /// size of a call, not of one tensor: a later policy's raw decision weighs its least times
    /// by its class's (`predict::decide`), so that what one tensor measured to lose is not
    /// tried again on every other of its size. By size: fixed costs weigh on a small call
    /// (4 ranks on 2 cores, shm, 1 MiB shards: 7.7x its least time) as they do not on a large
    /// one (16 MiB, TCP: 2.2-2.4x), where the small one's would send a tensor raw that
    /// compression speeds up. Agreed: times and predictions are, and every rank sees the
    /// calls in the same order.
    model_error: BTreeMap<u32, f64>,
    /// Per size class without a model error yet, the policy whose compressed calls will
    /// measure it first; the first predictions of others of that size wait for it
    /// (`predict::TRIAL_WAITS`). Agreed, as the error is.
    learning: BTreeMap<u32, SlotKey>,
    stats: Stats,
    /// `CIERA_CODEC_THREADS` (`auto` resolved) at the first compressed call.
    codec_threads: Option<usize>,
}

/// Status record: call ns, encode ns, decode ns, shard hash, raw probe ns, and this rank's
/// estimated frame bytes of its shard at each of the three frame levels (u64::MAX: unknown).
/// Then 1 where the budget had evicted this rank's own cache of the tensor (a budget miss).
const STATUS_FIXED_WORDS: usize = 9;
const STATUS_LEVEL_BYTES: usize = 5;
const STATUS_BUDGET_MISS: usize = 8;
/// A frame level's wire that moved by more than this factor (either way) since its first call
/// after the last prediction makes the policy predict again (`Policy::drift`): between the
/// peak and the end of a learning-rate schedule Delta frames go from ~5.6x to ~14x, Hybrid
/// frames from ~2x to ~7x, and which cache and frames are fastest changes with them.
const RECALIBRATE_DRIFT: f64 = 1.3;
/// ... but not sooner than this many calls after the last prediction, twice as many after each
/// such prediction, up to `RECALIBRATE_MAX_CALLS`.
const RECALIBRATE_MIN_CALLS: u64 = 4;
const RECALIBRATE_MAX_CALLS: u64 = 256;
/// A compressed call slower than this share of the raw baseline is a slow one (two in a row
/// and the policy moves on).
const SLOW_SHARE: f64 = 0.95;

/// This rank's shard of a call: its send buffer, or its block of the result in place
/// (`shard`: bytes per rank).
pub(super) fn own_shard<'a>(
    engine: &Engine,
    send: Option<&'a [u8]>,
    recv: &'a [u8],
    shard: usize,
) -> &'a [u8] {
    let me = engine.rank();
    send.unwrap_or(&recv[me * shard..(me + 1) * shard])
}

/// The size class of a call gathering `raw_bytes` (every rank's shard): the power of two at or
/// below it, as its exponent (`Compressor::model_error`).
fn size_class(raw_bytes: u64) -> u32 {
    raw_bytes.max(1).ilog2()
}

/// Whether a compressed call's time `t` is slow against the raw baseline `raw` (`SLOW_SHARE`).
fn slow(t: Duration, raw: Duration) -> bool {
    t.as_secs_f64() > SLOW_SHARE * raw.as_secs_f64()
}
/// A warm policy times one raw call in this many, to keep its raw baseline current.
const RAW_PROBE_EVERY: u64 = 64;
/// ... and one in this many while its compressed calls take less than half the raw baseline:
/// far from the verdict, a raw call (the slowest there is on a slow link) buys nothing.
const RAW_PROBE_RARELY: u64 = 512;
/// ... and one in this many while they take more than `RAW_CLOSE` of it: a close call, where a
/// baseline timed once on a busy host (too slow by a tenth, say) keeps a losing compression
/// going for a whole period; there a raw call costs about what a compressed one does.
const RAW_PROBE_CLOSE: u64 = 8;
const RAW_CLOSE: f64 = 0.8;

impl Compressor {
    pub fn new(config: CompressConfig) -> Compressor {
        crate::logging::init_from_env();
        Compressor {
            config,
            store: Store::default(),
            policies: HashMap::new(),
            clock: 0,
            model_error: BTreeMap::new(),
            learning: BTreeMap::new(),
            stats: Stats::default(),
            codec_threads: None,
        }
    }

    /// Threads a chunk's Delta frame is encoded or decoded on: `CIERA_CODEC_THREADS`, else this
    /// rank's share of its host's CPUs (`engine::cpu_share`, at most
    /// `codec::MAX_CODEC_THREADS`); resolved at the first call, logged at INFO.
    fn codec_threads(&mut self, engine: &crate::engine::Engine) -> usize {
        let asked = self.config.codec_threads;
        *self.codec_threads.get_or_insert_with(|| {
            let local = engine.topology().ranks_on_host_of(engine.rank());
            let t = asked.unwrap_or_else(|| {
                crate::engine::cpu_share(local).min(crate::codec::MAX_CODEC_THREADS)
            });
            tracing::info!(
                threads = t,
                local_ranks = local,
                "Delta frames coded on up to {t} thread(s) per chunk (CIERA_CODEC_THREADS={})",
                asked.map_or("auto".to_string(), |a| a.to_string())
            );
            t
        })
    }

    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.cache_bytes = self.store.bytes();
        s.slots = self.store.len();
        s.model_error = self.model_error.iter().map(|(&c, &e)| (c, e)).collect();
        s
    }

    /// Per-policy statistics (one tensor for explicit keys, one shape for inferred keys, whose
    /// `id` is then 0), in no particular order. The mode is that of the caches the policy
    /// starts; tensors too large for the budget are not listed.
    pub fn slot_stats(&self) -> Vec<(SlotKey, CacheMode, SlotStats)> {
        self.policies
            .iter()
            .filter_map(|(k, p)| Some((*k, p.mode?, p.stats.clone())))
            .collect()
    }

    /// Forget every cache (e.g. after the application changed all weights out of band). The
    /// agreed call counts stay, so this rank keeps taking the same paths as the others: its
    /// next compressed calls send FILL frames (misses) and refill from the others' frames.
    pub fn reset(&mut self) {
        self.store.clear();
    }

    /// The slot key of a call: the caller's, or inferred. Inference uses this rank's send
    /// buffer address (out of place: FSDP's sharded parameters live at a fixed address per
    /// layer) or the recv address (in place), with count and type. The key only finds this
    /// rank's own cache of its shard: receivers find a source's cache by the version its
    /// frames name, so ranks that infer differently (buffers that move) cost a FILL of the
    /// moved shard (a miss), never a wrong value or a repair.
    pub fn key_for(
        send: Option<&[u8]>,
        recv: &[u8],
        count: usize,
        dtype: DType,
        key: Option<u64>,
    ) -> SlotKey {
        match key {
            Some(id) => SlotKey {
                id,
                inferred: false,
                count,
                dtype,
            },
            None => {
                let addr = send.map_or(recv.as_ptr() as usize ^ 1, |s| s.as_ptr() as usize);
                SlotKey {
                    id: addr as u64,
                    inferred: true,
                    count,
                    dtype,
                }
            }
        }
    }

    /// The policy of a key: itself when explicit, its shape when inferred.
    fn policy_key(key: SlotKey) -> SlotKey {
        if key.inferred {
            SlotKey { id: 0, ..key }
        } else {
            key
        }
    }

    /// The cache mode of the lineages of a new policy: the one asked for (`CIERA_CACHE_MODE`
    /// or the call's options), else [`default_cache_mode`]; then, while the caches of that
    /// mode do not fit the budget, the next smaller one: delta, full values, exponents, none
    /// (raw). `network_ring`: the ring crosses a network link ([`ring_crosses_network`]).
    fn mode_for(
        &self,
        key: SlotKey,
        n: usize,
        asked: Option<CacheMode>,
        network_ring: bool,
    ) -> Option<CacheMode> {
        let per = |mode: CacheMode| caches_bytes(n, key.count, key.dtype, mode);
        let first = asked.unwrap_or_else(|| default_cache_mode(key.dtype, network_ring));
        let fits = BY_SIZE
            .iter()
            .skip_while(|&&m| m != first)
            .copied()
            .find(|&m| per(m) <= self.config.cache_bytes);
        if fits.is_none() {
            tracing::info!(count = key.count, dtype = %key.dtype, "tensor exceeds CIERA_CACHE_MB alone: raw");
        }
        fits
    }

    /// Allgather with compression where it pays (`opts` may override the mode and name the
    /// tensor). `send` None = in place.
    pub fn all_gather(
        &mut self,
        engine: &mut Engine,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        opts: &GatherOptions,
    ) -> Result<CallReport> {
        self.clock += 1;
        self.stats.calls += 1;
        let n = engine.size();
        let mode = opts.compress.unwrap_or(self.config.mode);
        let shard = count.saturating_mul(dtype.size());
        let eligible = mode != CompressMode::Off
            && dtype.is_compressible()
            && n > 1
            && count > 0
            && (mode == CompressMode::On
                || (shard >= self.config.min_shard_bytes
                    && matches!(
                        engine.algo_for(count, dtype),
                        crate::algo::Algo::Ring | crate::algo::Algo::Hierarchical
                    )));
        if !eligible {
            return self.raw(engine, send, recv, count, dtype);
        }
        let key = match (opts.key, opts.infer_addr) {
            (None, Some(addr)) => SlotKey {
                id: addr,
                inferred: true,
                count,
                dtype,
            },
            (key, _) => Self::key_for(send, recv, count, dtype, key),
        };
        let pkey = Self::policy_key(key);
        if !self.policies.contains_key(&pkey) {
            let asked = opts.cache_mode.or(self.config.cache_mode);
            let new_mode = self.mode_for(key, n, asked, ring_crosses_network(engine.topology()));
            self.policies
                .insert(pkey, Policy::new(new_mode, asked.is_none()));
        }
        let p = self.policies.get_mut(&pkey).expect("inserted above");
        let Some(new_mode) = p.mode else {
            return self.raw(engine, send, recv, count, dtype);
        };
        p.stats.calls += 1;
        let calls = p.stats.calls;
        if calls == 1 && mode == CompressMode::Auto {
            // The first call of an `auto` policy travels raw and keeps a sample of this rank's
            // shard: the next call, a raw probe, calibrates against it and fills the caches
            // only where the prediction says compression may pay. A tensor on a link faster
            // than the codec then never pays for caches (their page faults and copy took
            // 25-30 ms against a 28 ms first call: 4 ranks on 2 cores, 16 MiB bf16, delta
            // caches of 25 MB a rank) nor holds them.
            p.unfilled = true;
            p.stats.raw_calls += 1;
            let r = self.raw(engine, send, recv, count, dtype)?;
            self.keep_sample(pkey, key, own_shard(engine, send, recv, shard), dtype);
            return Ok(r);
        }
        if calls == 1 || p.refill {
            // The first call of a policy compressing by force (`on`) travels raw and every
            // rank fills its caches of every source from the result: costs a raw call plus a
            // copy, where FILL frames would copy each shard through the codec on both sides.
            // So does the first call after a move to another cache mode.
            p.refill = false;
            p.convert_to = None;
            p.stats.fill_calls += 1;
            let (r, held) = self.raw_fill(engine, key, new_mode, send, recv, count, dtype)?;
            self.policies
                .get_mut(&pkey)
                .expect("policy of the call")
                .held = held;
            return Ok(r);
        }
        if calls < p.raw_until {
            p.stats.raw_calls += 1;
            // The call before the probe that ends a back-off keeps the sample that probe
            // calibrates against (the policy dropped its caches when it went raw).
            let sample = p.unfilled && calls + 1 == p.raw_until;
            let r = self.raw(engine, send, recv, count, dtype)?;
            if sample {
                self.keep_sample(pkey, key, own_shard(engine, send, recv, shard), dtype);
            }
            return Ok(r);
        }
        if let Some((sample, first)) = p.deferred.take() {
            // The second raw probe of a close first prediction (`predict::CONFIRM_SHARE`):
            // the baseline is the faster of the two, and the prediction is made with it.
            p.stats.raw_calls += 1;
            let t = Instant::now();
            let r = self.raw(engine, send, recv, count, dtype)?;
            let took = t.elapsed();
            self.predict_from(
                engine,
                key,
                pkey,
                new_mode,
                count,
                dtype,
                took,
                &sample,
                Some(first),
            )?;
            self.fill_if_decided(engine, key, pkey, recv, count, dtype)?;
            return Ok(r);
        }
        // In auto mode the raw baseline comes from timed raw calls: the second call of a
        // policy (the first has touched every buffer by then), then one in RAW_PROBE_EVERY.
        // Every rank makes the same choice (call counts); each rank's time travels in the next
        // compressed call's status record. A raw call between compressed ones is safe: no
        // cache changes on any side.
        let probe = mode == CompressMode::Auto
            && p.pending_raw.is_none()
            && (p.raw_time.is_none()
                || p.recalibrate
                || calls.is_multiple_of(p.raw_probe_period()));
        if probe {
            p.stats.raw_calls += 1;
            let calibrate = p.raw_time.is_none() || p.recalibrate;
            let t = Instant::now();
            let r = self.raw(engine, send, recv, count, dtype)?;
            let took = t.elapsed();
            if calibrate {
                self.predict(engine, key, pkey, new_mode, recv, count, dtype, took)?;
                self.fill_if_decided(engine, key, pkey, recv, count, dtype)?;
            } else {
                let p = self.policies.get_mut(&pkey).expect("exists");
                p.pending_raw = Some(took);
            }
            return Ok(r);
        }
        self.framed(engine, key, pkey, new_mode, mode, send, recv, count, dtype)
    }

    /// An uncompressed allgather that touches no cache, checked end to end when
    /// `CIERA_VERIFY` is on (a call redone because a shard arrived different counts as a
    /// repair).
    pub fn all_gather_uncompressed(
        &mut self,
        engine: &mut Engine,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        if self.config.verify {
            if verify::raw_all_gather(engine, send, recv, count, dtype)? {
                self.stats.repairs += 1;
            }
            Ok(())
        } else {
            engine.all_gather(send, recv, count, dtype)
        }
    }

    fn raw(
        &mut self,
        engine: &mut Engine,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
    ) -> Result<CallReport> {
        self.uncompressed_as(CallKind::Raw, engine, send, recv, count, dtype)
    }

    /// An uncompressed call, counted as `kind`: Raw, or the Fill that starts a policy.
    fn uncompressed_as(
        &mut self,
        kind: CallKind,
        engine: &mut Engine,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
    ) -> Result<CallReport> {
        if kind == CallKind::Fill {
            self.stats.fill_calls += 1;
        } else {
            self.stats.raw_calls += 1;
        }
        let bytes = recv.len() as u64;
        self.stats.raw_bytes += bytes;
        self.stats.wire_bytes += bytes;
        self.all_gather_uncompressed(engine, send, recv, count, dtype)?;
        Ok(CallReport {
            kind,
            ..CallReport::raw(bytes)
        })
    }
}

/// The cache modes from the largest caches to the smallest: the order in which a mode that
/// does not fit the budget falls back.
const BY_SIZE: [CacheMode; 3] = [CacheMode::Delta, CacheMode::FullValue, CacheMode::Exponent];

/// The cache mode a new policy starts from when none is asked for (before the budget):
/// delta caches when the ring crosses a network link, else full-value caches.
///
/// Why delta only there: Delta frames (the change of each value in ulps, coded with its
/// previous change as context) code at ~1 GB/s (encode) and ~2-2.7 GB/s (decode) per core today
/// for bf16 (fp32: ~1.5-1.7 and ~2.4-2.6 GB/s; AVX-512; `cargo bench --bench codec`). That is
/// slower than shared memory moves the raw bytes (several GB/s per link), so within one host
/// the codec time would exceed the wire time it saves, and full-value caches (Exp frames at
/// ~5-9 GB/s per core, Hybrid where it pays) are the better trade. A 1-10 Gbit/s network
/// carries only 0.125-1.25 GB/s, so a byte saved there is worth far more time than coding it
/// costs: on bf16 at peak learning rate Delta frames reach ~5.3x (bound ~5.6x, the traces'
/// DELTA_BOUNDS.txt) against ~1.9x for Exp and ~2.2x for Hybrid (`ciera analyze --mode all`),
/// on fp32 1.6-2.0x against 1.3x (its low mantissa bits move by many ulps each step; measured
/// at 1 Gbit/s, 4 ranks: 1.57-1.95x over raw against 1.30-1.32x for a full-value cache, and
/// 1.26-1.59x against 1.21-1.27x at 5 Gbit/s, `bench/shaped_compare.sh`, 2026-12-06), and a
/// delta slot still sends Exp or Hybrid for chunks where they are smaller. Where this host
/// codes Delta frames slowly (without AVX2 they are coded plainly, ~0.15-0.2 GB/s), the policy's
/// prediction, from codec times measured here, keeps it at Exp or Hybrid frames. The choice
/// depends on the type and the topology only, which every rank shares, so ranks agree.
/// A delta cache costs one byte per element more than a full-value cache.
fn default_cache_mode(dtype: DType, network_ring: bool) -> CacheMode {
    if network_ring && matches!(dtype, DType::BF16 | DType::F16 | DType::F32) {
        CacheMode::Delta
    } else {
        CacheMode::FullValue
    }
}

/// Whether a link of the ring (rank r to r+1, the schedule compressed calls run on in auto
/// mode) is a network link. Every rank holds the same topology, so every rank agrees.
fn ring_crosses_network(t: &crate::algo::Topology) -> bool {
    let n = t.nranks();
    n > 1 && (0..n).any(|r| t.link(r, (r + 1) % n) == crate::algo::LinkClass::Network)
}

/// A delta- or full-value-cache policy under `auto` times each frame level it has not timed
/// right after the first timed call of the one in use, then one other level in this many calls
/// (`FAMILY_PROBE_EARLY` in a policy's first `FAMILY_EARLY_CALLS` calls, while one call per
/// level says little on a noisy host).
const FAMILY_PROBE_EVERY: u64 = 64;
const FAMILY_PROBE_EARLY: u64 = 32;
const FAMILY_EARLY_CALLS: u64 = 256;

fn probe_period(calls: u64) -> u64 {
    if calls < FAMILY_EARLY_CALLS {
        FAMILY_PROBE_EARLY
    } else {
        FAMILY_PROBE_EVERY
    }
}

/// A level's time after another call at it: the mean of the two, so one slow call (a busy
/// host) does not decide alone.
fn smoothed(old: Option<Duration>, new: Duration) -> Duration {
    old.map_or(new, |o| (o + new) / 2)
}

/// Frame levels, lightest first: Exp frames only; Exp or Hybrid per chunk (`NoDelta`); every
/// kind the cache allows (`Auto`: Delta too on a delta cache). A policy keeps the heaviest
/// (smallest wire) unless a lighter one measured more than 5% faster.
pub(crate) const LEVEL_CHOICES: [FrameChoice; 3] =
    [FrameChoice::Exp, FrameChoice::NoDelta, FrameChoice::Auto];

/// The levels a cache mode chooses among: a delta cache all three, a full-value cache Exp
/// only or Exp/Hybrid (its `Auto`), others just their `Auto`.
pub(crate) fn levels_of(mode: CacheMode) -> &'static [usize] {
    match mode {
        CacheMode::Delta => &[0, 1, 2],
        CacheMode::FullValue => &[0, 2],
        _ => &[2],
    }
}

/// The frame level of this call of a policy: the one in use; once it is timed, each level
/// not yet timed (heaviest first); then every `FAMILY_PROBE_EVERY` calls (at the half) one
/// other level, taking turns. `times` per level (the slowest rank's time of its last call).
/// Levels predicted hopeless (`Policy::hopeless_levels`) are neither timed nor probed.
fn level_for_call(
    current: usize,
    times: [Option<Duration>; 3],
    calls: u64,
    levels: &[usize],
    hopeless: [bool; 3],
) -> usize {
    if times[current].is_none() {
        return current;
    }
    if let Some(&l) = levels
        .iter()
        .rev()
        .find(|&&l| times[l].is_none() && !hopeless[l])
    {
        return l;
    }
    let others: Vec<usize> = levels
        .iter()
        .copied()
        .filter(|&l| l != current && !hopeless[l])
        .collect();
    let every = probe_period(calls);
    if !others.is_empty() && calls % every == every / 2 {
        return others[(calls / every) as usize % others.len()];
    }
    current
}

/// Which level a policy uses next: the fastest timed one if it beat the one in use by more
/// than 5%, else the one in use. Heavier frames cost several times the codec time of Exp, so
/// on a link fast enough that the codec, not the wire, sets the call time, they lose.
fn prefer_level(times: [Option<Duration>; 3], current: usize, levels: &[usize]) -> usize {
    let Some(now) = times[current] else {
        return current;
    };
    let best = levels
        .iter()
        .filter_map(|&l| times[l].map(|t| (t, l)))
        .min_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
    match best {
        Some((t, l)) if t.as_secs_f64() < now.as_secs_f64() / 1.05 => l,
        _ => current,
    }
}

/// What a policy compares with its raw baseline after a call. A cache of one frame level: the
/// call's time. One of several levels: None while a level that may win is still untimed (the
/// lighter levels are tried before raw is judged faster: a delta cache's Delta frames can lose
/// to raw on a link where Exp frames win; a level predicted `hopeless` is not waited for),
/// then the fastest level's (smoothed) time. A call of FILL frames only times no level and is
/// compared as it is (buffers that move every call never pay).
fn compared_time(
    times: [Option<Duration>; 3],
    levels: &[usize],
    hopeless: [bool; 3],
    all_fill: bool,
    call: Duration,
) -> Option<Duration> {
    if all_fill || levels.len() < 2 {
        return Some(call);
    }
    if levels.iter().any(|&l| times[l].is_none() && !hopeless[l]) {
        return None;
    }
    levels.iter().filter_map(|&l| times[l]).min()
}

/// The cache mode a policy moves to when the budget evicted a cache of its tensor (a budget
/// miss): the next smaller one (delta, full values, exponents), None (raw) after exponents.
/// Evictions under a budget too small for every tensor's caches would otherwise repeat every
/// iteration (FSDP gathers in the same order each step: least recently used is next needed).
fn budget_demotion(mode: CacheMode) -> Option<CacheMode> {
    BY_SIZE.iter().skip_while(|&&m| m != mode).nth(1).copied()
}

/// The cache mode a policy moves to when every frame level of its cache lost to raw: an
/// exponent cache, for a delta or full-value cache the default chose; None (go raw) for an
/// exponent cache or a cache mode the caller asked for.
fn demotion(mode: CacheMode, may_demote: bool) -> Option<CacheMode> {
    (may_demote && matches!(mode, CacheMode::Delta | CacheMode::FullValue))
        .then_some(CacheMode::Exponent)
}

/// Bytes of the caches of one tensor on every rank: each of `n` sources' `count` elements.
fn caches_bytes(n: usize, count: usize, dtype: DType, mode: CacheMode) -> usize {
    n.saturating_mul(count)
        .saturating_mul(mode.bytes_per_element(dtype))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::Topology;

    const NONE: [bool; 3] = [false; 3];

    /// A policy times each untimed level right after the first timed call of the one in use
    /// and then one other level in FAMILY_PROBE_EVERY calls, and moves to a lighter or heavier
    /// level only when it was more than 5% faster (synthetic times: no clock involved).
    #[test]
    fn frame_levels_are_probed_and_chosen_by_time() {
        let ms = |x: u64| Some(Duration::from_millis(x));
        let all: &[usize] = &[0, 1, 2];
        // Nothing timed yet: the level in use.
        assert_eq!(level_for_call(2, [None, None, None], 2, all, NONE), 2);
        // The one in use timed: the untimed ones, heaviest first.
        assert_eq!(level_for_call(2, [None, None, ms(100)], 3, all, NONE), 1);
        assert_eq!(level_for_call(2, [None, ms(90), ms(100)], 4, all, NONE), 0);
        // A full-value cache has no level 1.
        assert_eq!(
            level_for_call(2, [None, None, ms(100)], 3, &[0, 2], NONE),
            0
        );
        // All timed: the one in use, except every FAMILY_PROBE_EVERY calls (at the half; early
        // on every FAMILY_PROBE_EARLY), when the others take turns.
        let t = [ms(80), ms(90), ms(100)];
        assert_eq!(level_for_call(2, t, 5, all, NONE), 2);
        let (late, half) = (
            FAMILY_EARLY_CALLS + 10 * FAMILY_PROBE_EVERY,
            FAMILY_PROBE_EVERY / 2,
        );
        assert_eq!(level_for_call(2, t, late + half, all, NONE), 0);
        assert_eq!(
            level_for_call(2, t, late + FAMILY_PROBE_EVERY + half, all, NONE),
            1
        );
        assert_eq!(
            level_for_call(0, t, late + FAMILY_PROBE_EVERY + half, all, NONE),
            2
        );
        assert_eq!(level_for_call(2, t, late + 5, all, NONE), 2);
        // Early on, every FAMILY_PROBE_EARLY calls.
        let e = FAMILY_PROBE_EARLY;
        assert_eq!(level_for_call(2, t, e + e / 2, all, NONE), 1);
        assert_eq!(level_for_call(2, t, e + e / 2 + 1, all, NONE), 2);
        // Times are smoothed: one slow call moves a level's time halfway.
        assert_eq!(
            smoothed(ms(100), Duration::from_millis(200)),
            Duration::from_millis(150)
        );
        assert_eq!(
            smoothed(None, Duration::from_millis(200)),
            Duration::from_millis(200)
        );
        // Kept within 5%, left for one more than 5% faster, the fastest of those.
        assert_eq!(prefer_level([ms(100), ms(100), ms(104)], 2, all), 2);
        assert_eq!(prefer_level([ms(90), ms(100), ms(104)], 2, all), 0);
        assert_eq!(prefer_level([ms(98), ms(90), ms(104)], 2, all), 1);
        assert_eq!(prefer_level([ms(100), None, ms(60)], 0, all), 2);
        assert_eq!(prefer_level([None, None, ms(500)], 2, all), 2);
        assert_eq!(prefer_level([ms(500), None, None], 2, all), 2);
    }

    /// Raw is judged against the fastest frame level, and only once every level of the cache
    /// has been timed; a call of FILL frames is judged as it is.
    #[test]
    fn raw_is_judged_against_the_fastest_level_once_all_are_timed() {
        let ms = |v: u64| Some(Duration::from_millis(v));
        let call = Duration::from_millis(70);
        let all = &[0, 1, 2];
        assert_eq!(
            compared_time([None, None, ms(74)], all, NONE, false, call),
            None
        );
        assert_eq!(
            compared_time([None, ms(72), ms(74)], all, NONE, false, call),
            None
        );
        assert_eq!(
            compared_time([ms(41), ms(72), ms(74)], all, NONE, false, call),
            ms(41)
        );
        assert_eq!(
            compared_time([ms(41), None, ms(74)], &[0, 2], NONE, false, call),
            ms(41)
        );
        assert_eq!(
            compared_time([None, None, None], all, NONE, true, call),
            Some(call)
        );
    }

    /// Levels whose wire alone (the raw baseline scaled by their estimated bytes) is longer
    /// than the best level's measured call are predicted hopeless: never timed or probed, and
    /// not waited for before raw is judged (synthetic values: no clock involved).
    #[test]
    fn levels_that_cannot_win_are_not_tried() {
        let ms = |v: u64| Some(Duration::from_millis(v));
        let mut p = Policy {
            raw_time: ms(400),
            level_time: [None, None, ms(85)],
            ..Policy::new(Some(CacheMode::Delta), true)
        };
        let raw = 64 << 20;
        // Nothing known of the other levels' wire: nothing is hopeless.
        assert_eq!(p.hopeless_levels(&[0, 1, 2], raw), NONE);
        // A 1 Gbit/s link: raw 400 ms; Exp frames at 1.9x (210 ms of wire), Exp/Hybrid at
        // 2.2x (182 ms), Delta measured 85 ms: both lighter levels are hopeless.
        p.level_wire = [
            Some(raw as f64 / 1.9),
            Some(raw as f64 / 2.2),
            Some(raw as f64 / 5.5),
        ];
        let b = p.wire_bound(raw);
        assert_eq!(b[0].unwrap().as_millis(), 210);
        assert_eq!(b[2].unwrap().as_millis(), 72);
        let h = p.hopeless_levels(&[0, 1, 2], raw);
        assert_eq!(h, [true, true, false]);
        assert_eq!(level_for_call(2, p.level_time, 3, &[0, 1, 2], h), 2);
        for calls in 3..300 {
            assert_eq!(level_for_call(2, p.level_time, calls, &[0, 1, 2], h), 2);
        }
        assert_eq!(
            compared_time(p.level_time, &[0, 1, 2], h, false, Duration::ZERO),
            ms(85)
        );
        // A fast link (raw 60 ms): Exp frames' wire (32 ms) may beat Delta's 85 ms call.
        p.raw_time = ms(60);
        let h = p.hopeless_levels(&[0, 1, 2], raw);
        assert_eq!(h, NONE);
        assert_eq!(level_for_call(2, p.level_time, 3, &[0, 1, 2], h), 1);
        assert_eq!(
            compared_time(p.level_time, &[0, 1, 2], h, false, Duration::ZERO),
            None
        );
        // A level already timed, or the one in use, is never hopeless.
        p.raw_time = ms(400);
        p.level_time[0] = ms(300);
        assert_eq!(p.hopeless_levels(&[0, 1, 2], raw), [false, true, false]);
        p.level = 1;
        assert_eq!(p.hopeless_levels(&[0, 1, 2], raw), NONE);
        // No raw baseline (forced modes): nothing predicted.
        p.raw_time = None;
        assert_eq!(p.wire_bound(raw), [None; 3]);
        assert!(!cannot_win(None, ms(1)));
        assert!(!cannot_win(ms(1), None));
        assert!(cannot_win(ms(2), ms(1)));
        assert!(!cannot_win(ms(1), ms(1)));
    }

    /// Raw is probed often while compressed calls are close to it, whatever the cache: an
    /// exponent cache (one level) whose baseline was timed slow (a busy host) meets its verdict
    /// within RAW_PROBE_CLOSE calls, not RAW_PROBE_EVERY (seen: 64 losing calls unshaped).
    #[test]
    fn raw_is_probed_often_while_close_on_every_cache() {
        let ms = |v: u64| Some(Duration::from_millis(v));
        for (mode, level) in [(CacheMode::Exponent, 2), (CacheMode::Delta, 0)] {
            let mut p = Policy {
                raw_time: ms(15),
                raw_probes: 2,
                ..Policy::new(Some(mode), true)
            };
            assert!(levels_of(mode).contains(&level));
            // Nothing timed yet.
            assert_eq!(p.raw_probe_period(), RAW_PROBE_EVERY);
            p.level_time[level] = ms(13);
            assert_eq!(p.raw_probe_period(), RAW_PROBE_CLOSE, "{mode:?}");
            p.level_time[level] = ms(10);
            assert_eq!(p.raw_probe_period(), RAW_PROBE_EVERY, "{mode:?}");
            // Only one baseline so far (the second call's): a second one soon.
            p.raw_probes = 1;
            assert_eq!(p.raw_probe_period(), RAW_PROBE_CLOSE, "{mode:?}");
            p.raw_probes = 2;
            p.level_time[level] = ms(7);
            assert_eq!(p.raw_probe_period(), RAW_PROBE_RARELY, "{mode:?}");
            // Far ahead: no early second baseline (on a slow link a raw call is the slowest).
            p.raw_probes = 1;
            assert_eq!(p.raw_probe_period(), RAW_PROBE_RARELY, "{mode:?}");
        }
    }

    /// A policy whose levels all lost decides between an exponent cache and raw by the
    /// exponent cache's least time scaled by how far the measured levels fell short of theirs.
    #[test]
    fn an_exponent_cache_that_would_lose_too_is_not_tried() {
        let ms = |v: f64| Some(Duration::from_secs_f64(v / 1e3));
        let raw_bytes = 100;
        let mut p = Policy {
            raw_time: ms(12.0),
            raw_probes: 2,
            ..Policy::new(Some(CacheMode::Delta), true)
        };
        // Nothing predicted: it may win.
        p.level_time[0] = ms(18.0);
        assert!(!p.exp_cache_loses_too(raw_bytes));
        // Exp frames: half the raw bytes (6 ms of wire) and 6 ms of codec, 12 ms in all (the
        // transport shares the cores); an exponent cache's Exp frames 2 ms of codec: 8 ms.
        p.level_wire[0] = Some(50.0);
        p.prediction = Some(predict::Prediction {
            raw: Duration::from_millis(12),
            wire: [Some(50.0), None, None, Some(50.0)],
            codec: [ms(6.0), None, None, ms(2.0)],
            additive: true,
        });
        assert_eq!(p.least_time(raw_bytes)[0], ms(12.0));
        assert_eq!(p.exp_cache_least(raw_bytes), ms(8.0));
        // Exp frames took 18 ms, 1.5x their least: the exponent cache's 8 ms is 12 ms, above
        // 0.95 x 12 ms.
        assert!(p.exp_cache_loses_too(raw_bytes));
        // 12.5 ms (1.04x): 8.3 ms, it may win.
        p.level_time[0] = ms(12.5);
        assert!(!p.exp_cache_loses_too(raw_bytes));
        // The smallest shortfall counts: another level at its least time.
        p.level_time[0] = ms(18.0);
        p.level_wire[1] = Some(40.0);
        p.prediction.as_mut().unwrap().codec[1] = ms(9.0);
        p.level_time[1] = ms(13.8); // least 4.8 + 9 = 13.8
        assert!(!p.exp_cache_loses_too(raw_bytes));
        // And a level that lost: the policy goes raw instead of converting to full values.
        p.level = 0;
        assert!(p.level_loses_to_raw());
        p.level_time[0] = ms(11.0);
        assert!(!p.level_loses_to_raw());
    }

    #[test]
    fn budget_misses_step_down_one_cache_mode() {
        assert_eq!(
            budget_demotion(CacheMode::Delta),
            Some(CacheMode::FullValue)
        );
        assert_eq!(
            budget_demotion(CacheMode::FullValue),
            Some(CacheMode::Exponent)
        );
        assert_eq!(budget_demotion(CacheMode::Exponent), None);
    }

    #[test]
    fn only_a_default_delta_or_full_value_cache_moves_to_an_exponent_cache() {
        assert_eq!(demotion(CacheMode::Delta, true), Some(CacheMode::Exponent));
        assert_eq!(
            demotion(CacheMode::FullValue, true),
            Some(CacheMode::Exponent)
        );
        assert_eq!(demotion(CacheMode::Exponent, true), None);
        assert_eq!(demotion(CacheMode::Delta, false), None);
        assert_eq!(demotion(CacheMode::FullValue, false), None);
    }

    #[test]
    fn an_exponent_cache_trial_is_kept_only_if_as_fast() {
        let ms = Duration::from_millis;
        assert_eq!(trial_verdict(ms(40), 1, ms(60)), None);
        assert_eq!(trial_verdict(ms(40), 2, ms(60)), Some(true));
        assert_eq!(trial_verdict(ms(60), 2, ms(60)), Some(true));
        assert_eq!(trial_verdict(ms(61), 2, ms(60)), Some(false));
    }

    fn key(count: usize, dtype: DType) -> SlotKey {
        SlotKey {
            id: 1,
            inferred: false,
            count,
            dtype,
        }
    }

    fn compressor(cache_bytes: usize) -> Compressor {
        Compressor::new(CompressConfig {
            cache_bytes,
            ..CompressConfig::default()
        })
    }

    #[test]
    fn rings_that_cross_a_network_link() {
        assert!(!ring_crosses_network(&Topology::single_host(4)));
        assert!(!ring_crosses_network(&Topology::single_host(1)));
        assert!(ring_crosses_network(&Topology::new(&[0, 0, 1, 1], true)));
        // Ranks on one host that talk TCP.
        assert!(ring_crosses_network(&Topology::new(&[7, 7], false)));
        assert!(!ring_crosses_network(&Topology::new(&[3], false)));
    }

    #[test]
    fn default_mode_is_delta_over_a_network_only() {
        let c = compressor(DEFAULT_CACHE_MB << 20);
        let (n, count) = (4, 1000);
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            assert_eq!(
                c.mode_for(key(count, dtype), n, None, true),
                Some(CacheMode::Delta)
            );
            assert_eq!(
                c.mode_for(key(count, dtype), n, None, false),
                Some(CacheMode::FullValue)
            );
        }
        // What is asked for wins where it fits, network or not.
        assert_eq!(
            c.mode_for(key(count, DType::BF16), n, Some(CacheMode::Exponent), true),
            Some(CacheMode::Exponent)
        );
        assert_eq!(
            c.mode_for(key(count, DType::F32), n, Some(CacheMode::Delta), false),
            Some(CacheMode::Delta)
        );
    }

    #[test]
    fn modes_fall_back_to_smaller_caches_delta_full_exp_raw() {
        let (n, count, dtype) = (4, 1000, DType::BF16);
        let bytes = |m: CacheMode| caches_bytes(n, count, dtype, m);
        assert_eq!(bytes(CacheMode::Delta), 4 * 1000 * 3);
        for (budget, want) in [
            (bytes(CacheMode::Delta), Some(CacheMode::Delta)),
            (bytes(CacheMode::Delta) - 1, Some(CacheMode::FullValue)),
            (bytes(CacheMode::FullValue) - 1, Some(CacheMode::Exponent)),
            (bytes(CacheMode::Exponent) - 1, None),
        ] {
            let c = compressor(budget);
            assert_eq!(
                c.mode_for(key(count, dtype), n, None, true),
                want,
                "{budget}"
            );
            assert_eq!(
                c.mode_for(key(count, dtype), n, Some(CacheMode::Delta), false),
                want,
                "{budget}"
            );
        }
        // Asking for a smaller cache never climbs to a larger one.
        let c = compressor(bytes(CacheMode::Delta));
        assert_eq!(
            c.mode_for(key(count, dtype), n, Some(CacheMode::FullValue), true),
            Some(CacheMode::FullValue)
        );
    }

    /// A policy predicts again when a level's wire moves more than 1.3x from its first call
    /// after the last prediction (either way), not sooner than 4 calls after it (then 8, 16, ...), and not
    /// before it has predicted at all (synthetic values: no clock involved).
    #[test]
    fn a_new_regime_is_predicted_again() {
        let mut p = Policy {
            raw_time: Some(Duration::from_millis(400)),
            ..Policy::new(Some(CacheMode::Delta), true)
        };
        // No prediction yet: nothing to drift from, nothing recorded.
        assert!(!p.drift(2, 1000.0));
        assert_eq!(p.wire_ref, [None; 3]);
        p.prediction = Some(predict::Prediction {
            raw: Duration::from_millis(400),
            wire: [None; 4],
            codec: [None; 4],
            additive: false,
        });
        p.predicted_at = 2;
        p.stats.calls = 3;
        // The first call at a level sets its reference.
        assert!(!p.drift(2, 1000.0));
        assert_eq!(p.wire_ref[2], Some(1000.0));
        // Within 1.3x: no drift; beyond, but too soon after the prediction: none yet.
        assert!(!p.drift(2, 1290.0) && !p.drift(2, 775.0));
        assert!(!p.drift(2, 700.0));
        p.stats.calls = 18;
        assert!(p.drift(2, 700.0));
        // Each time the wire calls for one, the next waits twice as long (here 8, then 16).
        assert_eq!(p.drift_spacing, 8);
        assert!(p.drift(2, 1400.0));
        assert_eq!(p.drift_spacing, 16);
        assert!(p.drift(2, 1400.0), "18 calls >= 2 + 16");
        assert!(!p.drift(2, 1400.0), "18 calls < 2 + 32");
        p.drift_spacing = 4;
        // Each level against its own reference.
        assert!(!p.drift(0, 3000.0));
        assert!(!p.drift(0, 2500.0) && p.drift(0, 2000.0));
        // Already due to predict again: no second count.
        p.drifted = true;
        assert!(!p.drift(2, 700.0));
        p.drifted = false;
        p.recalibrate = true;
        assert!(!p.drift(2, 700.0));
    }
}
