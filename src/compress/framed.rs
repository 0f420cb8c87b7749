//! One compressed call: encode at the source, forward, decode into every source's cache, then
//! the status exchange that makes every later decision a function of agreed values, and the
//! repair of a call whose frames did not decode (or verify) somewhere. Also the raw *fill*
//! call that starts a policy: uncompressed, then every cache filled from the result.

use std::time::{Duration, Instant};

use super::group_codec::{GroupCodec, Incoming, OwnEncoder};
use super::stats::{CallKind, CallReport, SlotKey};
use super::store::Lineage;
use super::{
    caches_bytes, verify, CompressMode, Compressor, STATUS_BUDGET_MISS, STATUS_FIXED_WORDS,
    STATUS_LEVEL_BYTES,
};
use crate::codec::{CacheMode, CacheSlot, FrameInfo, Mode};
use crate::engine::Engine;
use crate::error::Result;
use crate::DType;

/// The version of a cache every rank filled from an uncompressed result in call `clock`:
/// agreed without a message, and unlike the versions of other sources and other calls (a
/// cache filled by FILL frames takes a random version instead).
fn agreed_version(clock: u64, src: usize) -> u64 {
    let mut z = clock
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((src as u64).rotate_left(40) ^ 0xC1E5_A000_F111_0000);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// An empty cache of source `src` at the version every rank gives it in call `clock`.
fn agreed_slot(clock: u64, src: usize, dtype: DType, mode: CacheMode, count: usize) -> CacheSlot {
    CacheSlot::with_version(dtype, mode, count, agreed_version(clock, src))
}

impl Compressor {
    /// The first call of a policy: an uncompressed allgather, then every rank fills its cache
    /// of every source from the result (the caches of the call are made room for first, by
    /// the same rule on every rank). Also returns the (source, version) of each cache filled.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn raw_fill(
        &mut self,
        engine: &mut Engine,
        key: SlotKey,
        mode: CacheMode,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
    ) -> Result<(CallReport, Vec<(usize, u64)>)> {
        let n = engine.size();
        let need = self.make_room(n, count, dtype, mode);
        let t = Instant::now();
        // The caches' memory is allocated and faulted in on a thread of its own while the
        // transfer runs (fresh memory costs page faults of the order of the copy itself).
        let clock = self.clock;
        let (raw, slots) = std::thread::scope(|s| {
            let alloc = s.spawn(move || {
                (0..n)
                    .map(|src| {
                        let mut slot = agreed_slot(clock, src, dtype, mode, count);
                        slot.allocate();
                        slot
                    })
                    .collect::<Vec<_>>()
            });
            let raw = self.uncompressed_as(CallKind::Fill, engine, send, recv, count, dtype);
            // A panic there is this thread's, as if the allocation had run here.
            (
                raw,
                alloc
                    .join()
                    .unwrap_or_else(|p| std::panic::resume_unwind(p)),
            )
        });
        let report = raw?;
        let raw_time = t.elapsed();
        let held =
            self.fill_slots_from_result(engine.rank(), key, recv, slots.into_iter().enumerate())?;
        tracing::info!(
            slot = key.id,
            count,
            dtype = %dtype,
            ?mode,
            raw_ms = raw_time.as_secs_f64() * 1e3,
            fill_ms = (t.elapsed() - raw_time).as_secs_f64() * 1e3,
            cache_bytes = need,
            "first call of a tensor: raw, then every cache filled from the result"
        );
        Ok((report, held))
    }

    /// Evict (least recently used first, alike on every rank) until the caches of a tensor of
    /// `count` elements from each of `n` sources, in `mode`, fit the budget beside the rest;
    /// returns their bytes.
    fn make_room(&mut self, n: usize, count: usize, dtype: DType, mode: CacheMode) -> usize {
        let need = caches_bytes(n, count, dtype, mode);
        self.stats.evictions += self
            .store
            .evict_to(self.config.cache_bytes.saturating_sub(need));
        need
    }

    /// After a raw call of an unfilled `auto` policy (its first, or the last of a back-off):
    /// keep the first `predict::SAMPLE_ELEMS` elements of this rank's shard (`own`), what the
    /// next call's calibration codes its shard against (a copy of 512 KiB of bf16 at most).
    pub(super) fn keep_sample(&mut self, pkey: SlotKey, key: SlotKey, own: &[u8], dtype: DType) {
        let m = (own.len() / dtype.size()).min(super::predict::SAMPLE_ELEMS) * dtype.size();
        let p = self.policies.get_mut(&pkey).expect("policy of the call");
        p.prev_sample = Some((key, own[..m].to_vec()));
    }

    /// After the prediction at a raw probe of an unfilled policy: fill every rank's caches of
    /// every source from the probe's result (`recv`), in the cache mode decided, unless the
    /// prediction sent the tensor raw (it stays unfilled) or waits for a second probe. Every
    /// rank decides alike (agreed prediction), and fills at the same agreed versions.
    pub(super) fn fill_if_decided(
        &mut self,
        engine: &Engine,
        key: SlotKey,
        pkey: SlotKey,
        recv: &[u8],
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        let p = self.policies.get_mut(&pkey).expect("policy of the call");
        if !p.unfilled || p.deferred.is_some() {
            return Ok(());
        }
        let Some(mode) = p.mode.filter(|_| p.stats.calls >= p.raw_until) else {
            return Ok(());
        };
        p.unfilled = false;
        p.refill = false;
        p.convert_to = None;
        let n = engine.size();
        let need = self.make_room(n, count, dtype, mode);
        let t = Instant::now();
        let srcs: Vec<usize> = (0..n).collect();
        let held = self.fill_from_result(engine.rank(), key, mode, recv, &srcs, count, dtype)?;
        tracing::info!(
            slot = key.id,
            count,
            dtype = %dtype,
            ?mode,
            fill_ms = t.elapsed().as_secs_f64() * 1e3,
            cache_bytes = need,
            "predicted: compression may pay for this tensor; every cache filled from the probe's result"
        );
        self.policies
            .get_mut(&pkey)
            .expect("policy of the call")
            .held = held;
        Ok(())
    }

    /// A policy that goes raw for a back-off drops its caches of the tensor (every source's it
    /// held after the last call, its own included, alike on every rank; and its own under
    /// `key`, should the buffer have moved): they
    /// would be a back-off old when it compresses again, and their memory serves other
    /// tensors meanwhile. The probe that ends the back-off calibrates against a sample kept
    /// at the call before it, and fills them again if compression is still predicted to pay.
    pub(super) fn drop_caches(&mut self, pkey: SlotKey, key: SlotKey) {
        let p = self.policies.get_mut(&pkey).expect("policy of the call");
        let held = std::mem::take(&mut p.held);
        p.unfilled = true;
        p.recalibrate = true;
        p.refill = false;
        p.convert_to = None;
        // This rank's own too by its held version, as every receiver drops it: where the
        // buffer moved, the one under `key` is another (an own cache kept where receivers
        // dropped theirs would send deltas they cannot decode when its address came back).
        for (src, version) in held {
            self.store.take(src, version);
        }
        self.store.take_own(&key);
    }

    /// Fill this rank's cache of each of `srcs` from their blocks of `recv` (a result every rank
    /// holds alike), replacing any it held; then evict to the budget. Returns the (source,
    /// version) of each cache filled.
    #[allow(clippy::too_many_arguments)]
    fn fill_from_result(
        &mut self,
        me: usize,
        key: SlotKey,
        mode: CacheMode,
        recv: &[u8],
        srcs: &[usize],
        count: usize,
        dtype: DType,
    ) -> Result<Vec<(usize, u64)>> {
        let clock = self.clock;
        let slots = srcs
            .iter()
            .map(|&src| (src, agreed_slot(clock, src, dtype, mode, count)));
        self.fill_slots_from_result(me, key, recv, slots)
    }

    /// Fill each (source, new slot) from the source's block of `recv`, at the slot's (agreed)
    /// version, and keep it; then evict to the budget. Returns each (source, version) filled.
    fn fill_slots_from_result(
        &mut self,
        me: usize,
        key: SlotKey,
        recv: &[u8],
        slots: impl Iterator<Item = (usize, CacheSlot)>,
    ) -> Result<Vec<(usize, u64)>> {
        let mut filled = Vec::new();
        for (src, mut slot) in slots {
            let shard = slot.len() * slot.dtype().size();
            slot.fill_from(&recv[src * shard..(src + 1) * shard])?;
            let lineage = Lineage {
                slot,
                last_use: self.clock,
            };
            filled.push((src, lineage.slot.version()));
            self.store.put(src, lineage, (src == me).then_some(key));
        }
        self.stats.evictions += self.store.evict_to(self.config.cache_bytes);
        Ok(filled)
    }

    /// Convert this rank's lineages of the tensor of `pkey` (every source's it held after the
    /// last call, its own included) to caches of `mode`, at the same versions. Every rank
    /// holds the same (source, version) lineages and converts them alike; one that cannot be
    /// converted (cold) goes, alike everywhere, and its source's next frames fill it (a miss).
    /// This rank's own goes by its version too, not by this call's key: where the buffer
    /// moved (inferred keys), the lineage under the key is another, which the receivers did
    /// not convert (seen: a Hybrid frame for an exponent slot when the old address came back,
    /// repaired, in 2 of 10 runs of an mpi4py program).
    fn convert_lineages(&mut self, pkey: SlotKey, mode: CacheMode) {
        let p = self.policies.get_mut(&pkey).expect("policy of the call");
        let held = std::mem::take(&mut p.held);
        let mut kept = Vec::with_capacity(held.len());
        for (src, version) in held {
            let Some(mut l) = self.store.take(src, version) else {
                continue;
            };
            // Same version: an own lineage stays under its key.
            if l.slot.convert(mode) {
                kept.push((src, l.slot.version()));
                self.store.put(src, l, None);
            }
        }
        self.policies
            .get_mut(&pkey)
            .expect("policy of the call")
            .held = kept;
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn framed(
        &mut self,
        engine: &mut Engine,
        key: SlotKey,
        pkey: SlotKey,
        new_mode: CacheMode,
        mode: CompressMode,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
    ) -> Result<CallReport> {
        let n = engine.size();
        let me = engine.rank();
        let shard_bytes = count * dtype.size();
        let verify = self.config.verify;
        let own_hash = if verify {
            verify::own_hash(engine, send, recv, shard_bytes)
        } else {
            0
        };
        let clock = self.clock;
        if let Some(to) = self
            .policies
            .get_mut(&pkey)
            .expect("policy of the call")
            .convert_to
            .take()
        {
            self.convert_lineages(pkey, to);
        }
        // Which frames this call sends on a delta cache (every rank alike: agreed values).
        let p = self.policies.get_mut(&pkey).expect("policy of the call");
        let levels = super::levels_of(new_mode);
        let raw = (n * shard_bytes) as u64;
        p.call_level = if mode == CompressMode::Auto {
            let hopeless = p.hopeless_levels(levels, raw);
            super::level_for_call(p.level, p.level_time, p.stats.calls, levels, hopeless)
        } else {
            2
        };
        let choice = super::LEVEL_CHOICES[p.call_level];
        p.stats.frame_choice = (levels.len() > 1 && mode == CompressMode::Auto).then_some(choice);
        // This rank's cache of its shard, found by its own key; none (a miss) codes FILL
        // frames against a new cache, which every receiver starts from them.
        let own = self.store.take_own(&key);
        let own_missed = own.is_none();
        let budget_miss = own_missed && self.store.take_evicted(&key);
        let mut own = own.unwrap_or_else(|| Lineage {
            slot: CacheSlot::new(dtype, new_mode, count),
            last_use: clock,
        });
        own.slot.set_frame_choice(choice);
        let own_version = own.slot.version();
        // The wire drifted (a new regime): calibrate on this call's shard against the cache
        // before the call replaces it; the ranks predict again after the call.
        let recalibrate = p
            .raw_time
            .filter(|_| mode == CompressMode::Auto && p.drifted);
        // A full-value cache that was a delta cache weighs Delta frames again (`predict_from`).
        let sample_mode = if p.promotable && new_mode == CacheMode::FullValue {
            CacheMode::Delta
        } else {
            new_mode
        };
        let sample = recalibrate.map(|_| {
            let threads = self.codec_threads(engine);
            let input = super::own_shard(engine, send, recv, shard_bytes);
            let cached = (!own_missed).then(|| own.slot.values()).flatten();
            self.sample(pkey, sample_mode, cached, input, dtype, threads)
        });

        let t0 = Instant::now();
        // Compress once, at the source: the engine's encoder worker encodes this rank's chunks
        // while the executor sends the frames already made and decodes what arrives.
        let mut encoder = OwnEncoder {
            lineage: own,
            infos: Vec::new(),
            levels: Vec::new(),
            encode_ns: 0,
        };
        let codec_threads = self.codec_threads(engine);
        encoder.lineage.slot.set_codec_threads(codec_threads);
        let mut codec = GroupCodec::new(&mut self.store, me, n, count, dtype, new_mode, clock);
        codec.codec_threads = codec_threads;
        let r = engine.all_gather_framed(send, recv, count, dtype, &mut encoder, &mut codec);
        let elapsed = t0.elapsed();
        let GroupCodec {
            mut incoming,
            failures,
            decode_ns,
            ..
        } = codec;
        let OwnEncoder {
            lineage: own,
            infos: own_infos,
            levels: own_estimates,
            encode_ns,
        } = encoder;
        // The transfer failed (a peer died, an abort): the caches this call used are dropped
        // (half-updated), and the error goes to the caller.
        r?;
        // This rank's estimate of its frames' bytes at each level (all chunks, or unknown).
        let own_levels: [u64; 3] = std::array::from_fn(|l| {
            own_estimates
                .iter()
                .try_fold(0u64, |a, e| e[l].map(|b| a + b as u64))
                .filter(|_| !own_estimates.is_empty())
                .unwrap_or(u64::MAX)
        });
        incoming[me] = Some(Incoming {
            lineage: own,
            version: own_version,
            missed: own_missed,
            infos: own_infos,
        });
        // Commit every source's cache, or note why it cannot be.
        let mut failed: Vec<Option<String>> = failures
            .into_iter()
            .map(|f| f.map(|e| e.to_string()))
            .collect();
        for (src, inc) in incoming.iter_mut().enumerate() {
            if failed[src].is_some() {
                continue;
            }
            match inc {
                Some(inc) => {
                    if let Err(e) = inc.lineage.slot.commit(&inc.infos) {
                        failed[src] = Some(e.to_string());
                    }
                }
                None => failed[src] = Some("no frame of it arrived".into()),
            }
        }
        // Status exchange: [call ns, encode ns, decode ns, shard hash, raw probe ns, estimated
        // frame bytes at levels 0..3, failure bitmap words].
        let p = self.policies.get_mut(&pkey).expect("policy of the call");
        let words = STATUS_FIXED_WORDS + n.div_ceil(64);
        let mut mine = vec![0u64; words];
        mine[0] = elapsed.as_nanos() as u64;
        mine[1] = encode_ns;
        mine[2] = decode_ns;
        mine[3] = own_hash;
        mine[4] = p.pending_raw.take().map_or(0, |d| d.as_nanos() as u64);
        mine[STATUS_LEVEL_BYTES..STATUS_LEVEL_BYTES + 3].copy_from_slice(&own_levels);
        mine[STATUS_BUDGET_MISS] = budget_miss as u64;
        if verify {
            // Hashes must be known before this rank can report a mismatch, so verification
            // takes a first exchange of the hashes alone when it is on.
            let hashes: Vec<u64> = verify::exchange_words(engine, &mine)?
                .iter()
                .map(|r| r[3])
                .collect();
            let skip: Vec<bool> = failed.iter().map(Option::is_some).collect();
            for (src, why) in verify::mismatches(me, recv, shard_bytes, &hashes, &skip) {
                failed[src] = Some(why);
            }
        }
        for (src, f) in failed.iter().enumerate() {
            if f.is_some() {
                mine[STATUS_FIXED_WORDS + src / 64] |= 1 << (src % 64);
            }
        }
        let t_status = Instant::now();
        let status = verify::exchange_words(engine, &mine)?;
        let status_time = t_status.elapsed();
        let slowest = Duration::from_nanos(status.iter().map(|s| s[0]).max().unwrap_or(0));
        let probe = status.iter().map(|s| s[4]).max().unwrap_or(0);
        if probe > 0 && status.iter().all(|s| s[4] > 0) {
            p.raw_time = Some(Duration::from_nanos(probe));
            p.raw_probes = p.raw_probes.saturating_add(1);
        }
        let is_bad: Vec<bool> = (0..n)
            .map(|src| {
                status
                    .iter()
                    .any(|s| s[STATUS_FIXED_WORDS + src / 64] >> (src % 64) & 1 == 1)
            })
            .collect();
        let bad: Vec<usize> = (0..n).filter(|&src| is_bad[src]).collect();
        // Account. Every rank saw the same frames, so all agree on the misses.
        let infos: Vec<&[FrameInfo]> = incoming
            .iter()
            .map(|i| i.as_ref().map_or(&[][..], |i| &i.infos[..]))
            .collect();
        let wire: u64 = infos
            .iter()
            .flat_map(|v| v.iter())
            .map(|i| i.frame_bytes as u64)
            .sum();
        let misses = (0..n)
            .filter(|&src| !is_bad[src] && incoming[src].as_ref().is_some_and(|i| i.missed))
            .count() as u64;
        // Every source missed: the call was a FILL of the whole tensor.
        let all_fill = misses == n as u64;
        self.stats.raw_bytes += raw;
        self.stats.wire_bytes += wire;
        self.stats.encode_ns += encode_ns;
        self.stats.decode_ns += decode_ns;
        self.stats.transfer_ns += (elapsed.as_nanos() as u64).saturating_sub(encode_ns + decode_ns);
        self.stats.misses += misses;
        p.stats.misses += misses;
        p.stats.framed_raw_bytes += raw;
        p.stats.framed_wire_bytes += wire;
        p.stats.frames += infos.iter().map(|v| v.len() as u64).sum::<u64>();
        p.stats.hits += infos
            .iter()
            .flat_map(|v| v.iter())
            .filter(|i| i.mode != Mode::Raw)
            .count() as u64;
        if all_fill {
            self.stats.fill_calls += 1;
            p.stats.fill_calls += 1;
        } else {
            self.stats.delta_calls += 1;
            p.stats.delta_calls += 1;
            p.stats.last_ratio = raw as f64 / wire.max(1) as f64;
        }
        let report = |repaired| CallReport {
            kind: if all_fill {
                CallKind::Fill
            } else {
                CallKind::Delta
            },
            repaired,
            misses,
            raw_bytes: raw,
            wire_bytes: wire,
        };
        tracing::info!(
            slot = key.id,
            count = key.count,
            dtype = %key.dtype,
            misses,
            ratio = raw as f64 / wire.max(1) as f64,
            wire_bytes = wire,
            encode_ms = encode_ns as f64 / 1e6,
            decode_ms = decode_ns as f64 / 1e6,
            call_ms = elapsed.as_secs_f64() * 1e3,
            status_ms = status_time.as_secs_f64() * 1e3,
            slowest_ms = slowest.as_secs_f64() * 1e3,
            "compressed allgather"
        );
        // The budget evicted a cache of this tensor on some rank (a budget miss): it moves to
        // smaller caches (or raw) below, and this call's caches of it go now, so that they do
        // not evict the caches of tensors that still fit.
        let budget_missed = bad.is_empty() && status.iter().any(|s| s[STATUS_BUDGET_MISS] == 1);
        // The caches of the sources that went well everywhere are kept (this rank's own under
        // its key); those of the others are refilled from the repaired result below.
        p.held.clear();
        for (src, inc) in incoming.into_iter().enumerate() {
            if let Some(mut inc) = inc.filter(|_| !is_bad[src] && !budget_missed) {
                inc.lineage.last_use = clock;
                p.held.push((src, inc.lineage.slot.version()));
                self.store.put(src, inc.lineage, (src == me).then_some(key));
            }
        }
        if !bad.is_empty() {
            for &src in &bad {
                let why = failed[src]
                    .clone()
                    .unwrap_or_else(|| "failed on another rank".into());
                tracing::error!(
                    source_rank = src,
                    slot = key.id,
                    count = key.count,
                    dtype = %key.dtype,
                    "frames of rank {src} failed to decode ({why}); repairing this call raw and refilling its cache from the result"
                );
            }
            p.stats.repairs += 1;
            self.stats.repairs += 1;
            // Redo raw: the own shard is intact (send buffer, or recv's own block, which no
            // decoder writes), so the result is exact on every rank (and checked again when
            // verifying: a detected corruption never leaves wrong bytes behind).
            self.all_gather_uncompressed(engine, send, recv, count, dtype)?;
            let filled = self.fill_from_result(me, key, new_mode, recv, &bad, count, dtype)?;
            let p = self.policies.get_mut(&pkey).expect("policy of the call");
            p.held.extend(filled);
            return Ok(report(true));
        }
        self.stats.evictions += self.store.evict_to(self.config.cache_bytes);
        // Decide what the next call of this policy does, from agreed values only.
        let p = self.policies.get_mut(&pkey).expect("policy of the call");
        if budget_missed {
            let to = super::budget_demotion(new_mode);
            p.stats.budget_demotions += 1;
            tracing::info!(
                slot = key.id,
                budget_mb = self.config.cache_bytes >> 20,
                "CIERA_CACHE_MB evicted a cache of this tensor: {}",
                to.map_or("raw from now on".into(), |m| format!(
                    "{m:?} caches instead of {new_mode:?}"
                ))
            );
            match to {
                Some(m) => p.switch_cache(m),
                None => p.mode = None,
            }
            return Ok(report(false));
        }
        let levels = super::levels_of(new_mode);
        if !all_fill {
            // Every level's wire: this call's, scaled by the ranks' estimates (all of them,
            // where every rank knew its own).
            let est: [Option<f64>; 3] = std::array::from_fn(|l| {
                status.iter().try_fold(0.0, |a, s| {
                    let b = s[STATUS_LEVEL_BYTES + l];
                    (b != u64::MAX).then_some(a + b as f64)
                })
            });
            if let Some(e) = est[p.call_level].filter(|&e| e > 0.0) {
                // Each level's estimate corrected by its own last measurement, where it has
                // one: the Delta level's estimate can miss by a fifth where Exp's is close, and
                // scaling Exp by Delta's miss made an exponent cache look hopeless.
                p.wire_scale[p.call_level] = Some(wire as f64 / e);
                let scale = p.wire_scale;
                p.level_wire = std::array::from_fn(|l| est[l].map(|x| x * scale[l].unwrap_or(1.0)));
                p.level_wire[p.call_level] = Some(wire as f64);
            }
            if mode == CompressMode::Auto && p.drift(p.call_level, wire as f64) {
                tracing::info!(
                    slot = key.id,
                    wire_then = p.wire_ref[p.call_level].unwrap_or(0.0),
                    wire_now = wire,
                    "this tensor's frames changed size (a new training regime?): predicting again at the next call"
                );
                p.drifted = true;
                p.stats.recalibrations += 1;
            }
        }
        if let (Some(raw_time), Some(sample)) = (recalibrate, sample) {
            // Every rank calibrated before this call (agreed: the drift and the baseline are):
            // predict afresh; what this call measured belongs to the old prediction.
            self.predict_from(
                engine,
                key,
                pkey,
                sample_mode,
                count,
                dtype,
                raw_time,
                &sample,
                None,
            )?;
            return Ok(report(false));
        }
        if mode == CompressMode::Auto && !all_fill {
            // The model's error (`Compressor::model_error`), from a level's second call on (a
            // level's first call after a fill or a move is slower: buffers first touched).
            // Its least time from this call's wire (the raw baseline scaled by it) and the
            // level's predicted codec, where both are known.
            let codec = p.prediction.and_then(|q| q.codec[p.call_level]);
            let least = p
                .wire_time(wire as f64, raw)
                .filter(|_| codec.is_some())
                .and_then(|w| p.least_of(Some(w), p.call_level))
                .filter(|l| !l.is_zero());
            if let (Some(_), Some(least)) = (p.level_time[p.call_level], least) {
                let ratio = (slowest.as_secs_f64() / least.as_secs_f64()).max(1.0);
                let e = self
                    .model_error
                    .entry(super::size_class(raw))
                    .or_insert(ratio);
                *e = e.min(ratio);
            }
            // A cache of one level (an exponent cache) is timed too: its time against the raw
            // baseline sets how often raw is probed (`raw_probe_period`).
            p.level_time[p.call_level] = Some(super::smoothed(p.level_time[p.call_level], slowest));
            let next = super::prefer_level(p.level_time, p.level, levels);
            if next != p.level {
                let ms = |l: usize| p.level_time[l].map_or(0.0, |d| d.as_secs_f64() * 1e3);
                tracing::info!(
                    slot = key.id,
                    from_ms = ms(p.level),
                    to_ms = ms(next),
                    "frames for this tensor: {:?} instead of {:?}",
                    super::LEVEL_CHOICES[next],
                    super::LEVEL_CHOICES[p.level]
                );
                p.level = next;
            }
        }
        if mode == CompressMode::Auto
            && !all_fill
            && new_mode == CacheMode::Delta
            && p.default_mode
            && !matches!(p.trial, super::Trial::Running { .. })
        {
            // A delta cache whose Delta frames lose to its lighter levels keeps move contexts
            // and checks every level for nothing: a full-value cache sends the same frames
            // with less upkeep (converted in place; back on a new regime).
            let hopeless = p.hopeless_levels(levels, raw);
            let judged = levels
                .iter()
                .all(|&l| p.level_time[l].is_some() || hopeless[l]);
            // Not where even the best level loses to raw: a full-value cache sends the same
            // frames, and the policy moves on from here (below).
            if judged && p.level != 2 && !p.level_loses_to_raw() {
                let ms = |l: usize| p.level_time[l].map_or(0.0, |d| d.as_secs_f64() * 1e3);
                tracing::info!(
                    slot = key.id,
                    delta_frames_ms = ms(2),
                    best_ms = ms(p.level),
                    "Delta frames do not pay for this tensor on this link: a full-value cache instead (converted)"
                );
                p.convert_cache(CacheMode::FullValue);
                p.promotable = true;
                return Ok(report(false));
            }
        }
        if mode == CompressMode::Auto && !all_fill {
            if let Some(r) = self.exponent_trial(pkey, key, new_mode, slowest, raw) {
                return Ok(report(r));
            }
        }
        let p = self.policies.get_mut(&pkey).expect("policy of the call");
        if mode == CompressMode::Auto {
            let hopeless = p.hopeless_levels(levels, raw);
            if hopeless != p.stats.hopeless_levels && levels.len() > 1 {
                tracing::info!(
                    slot = key.id,
                    wire_bound_ms = ?p.wire_bound(raw).map(|b| b.map(|d| d.as_secs_f64() * 1e3)),
                    level_ms = ?p.level_time.map(|t| t.map(|d| d.as_secs_f64() * 1e3)),
                    "frame levels that cannot win on this link (not tried): {:?}",
                    levels
                        .iter()
                        .filter(|&&l| hopeless[l])
                        .map(|&l| super::LEVEL_CHOICES[l])
                        .collect::<Vec<_>>()
                );
                p.stats.hopeless_levels = hopeless;
            }
            let compared = super::compared_time(p.level_time, levels, hopeless, all_fill, slowest);
            if let (Some(base), Some(t)) = (p.raw_time, compared) {
                if super::slow(t, base) {
                    p.slow_streak += 1;
                } else {
                    p.slow_streak = 0;
                }
                // Two slow calls in a row: one slow call on a shared machine is noise (a call
                // of FILL frames counts too: buffers that move every call never pay).
                // Not to an exponent cache that would lose as well (then raw at once).
                let demote_to = super::demotion(new_mode, p.may_demote)
                    .filter(|_| !(p.slow_streak >= 2 && p.exp_cache_loses_too(raw)));
                if let (true, Some(lighter)) = (p.slow_streak >= 2, demote_to) {
                    // Every level of a delta / full-value cache lost: an exponent cache's
                    // Exp frames are cheaper (no full values to keep).
                    p.slow_streak = 0;
                    p.may_demote = false;
                    p.convert_cache(lighter);
                    tracing::info!(
                        slot = key.id,
                        delta_ms = t.as_secs_f64() * 1e3,
                        raw_ms = base.as_secs_f64() * 1e3,
                        "a {new_mode:?} cache does not pay on this link for this tensor: an exponent cache instead"
                    );
                } else if p.slow_streak >= 2 {
                    p.slow_streak = 0;
                    p.raw_until = p.stats.calls + p.backoff;
                    tracing::info!(
                        slot = key.id,
                        delta_ms = t.as_secs_f64() * 1e3,
                        raw_ms = base.as_secs_f64() * 1e3,
                        "compression does not pay on this link for this tensor: raw for {} calls",
                        p.backoff
                    );
                    p.backoff = (p.backoff * 2).min(1 << 16);
                    self.drop_caches(pkey, key);
                }
            }
        }
        Ok(report(false))
    }

    /// A default delta / full-value cache's one trial of an exponent cache (see `Trial`):
    /// starts it once every level is timed and compression beats raw, times it, and keeps it
    /// or goes back. Some(false) when it decided this call's next step (the caller returns).
    fn exponent_trial(
        &mut self,
        pkey: SlotKey,
        key: SlotKey,
        new_mode: CacheMode,
        slowest: Duration,
        raw: u64,
    ) -> Option<bool> {
        let p = self.policies.get_mut(&pkey).expect("policy of the call");
        let levels = super::levels_of(new_mode);
        match p.trial {
            super::Trial::Running {
                from,
                best,
                calls,
                time,
            } if new_mode == CacheMode::Exponent => {
                let time = super::smoothed(time, slowest);
                let calls = calls + 1;
                p.slow_streak = 0;
                match super::trial_verdict(time, calls, best) {
                    None => {
                        p.trial = super::Trial::Running {
                            from,
                            best,
                            calls,
                            time: Some(time),
                        };
                    }
                    Some(keep) => {
                        p.trial = super::Trial::Done;
                        tracing::info!(
                            slot = key.id,
                            exp_ms = time.as_secs_f64() * 1e3,
                            before_ms = best.as_secs_f64() * 1e3,
                            "{}",
                            if keep {
                                "an exponent cache is faster for this tensor: kept".to_string()
                            } else {
                                format!("an exponent cache is slower for this tensor: back to a {from:?} cache")
                            }
                        );
                        if !keep {
                            p.switch_cache(from);
                        }
                    }
                }
                Some(false)
            }
            super::Trial::NotYet if p.may_demote && levels.len() > 1 => {
                let hopeless = p.hopeless_levels(levels, raw);
                let best = super::compared_time(p.level_time, levels, hopeless, false, slowest)?;
                let base = p.raw_time?;
                if best.as_secs_f64() > 0.95 * base.as_secs_f64() {
                    return None; // the raw verdict decides (and may demote)
                }
                // An exponent cache sends the Exp level's frames: if their wire (or its
                // predicted codec time) alone takes longer than the best level, the trial (a
                // refill, two calls and maybe a refill back) cannot pay.
                let bound = p.exp_cache_least(raw);
                if super::cannot_win(bound, Some(best)) {
                    p.trial = super::Trial::Done;
                    p.stats.trials_skipped += 1;
                    tracing::info!(
                        slot = key.id,
                        best_ms = best.as_secs_f64() * 1e3,
                        exp_bound_ms = bound.map_or(0.0, |b| b.as_secs_f64() * 1e3),
                        "an exponent cache cannot beat this tensor's {new_mode:?} cache on this link (its frames' least time is longer): not tried"
                    );
                    return None;
                }
                p.trial = super::Trial::Running {
                    from: new_mode,
                    best,
                    calls: 0,
                    time: None,
                };
                p.may_demote = false;
                p.convert_cache(CacheMode::Exponent);
                tracing::info!(
                    slot = key.id,
                    best_ms = best.as_secs_f64() * 1e3,
                    "trying an exponent cache for this tensor (its {new_mode:?} cache's best level is timed)"
                );
                Some(false)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compress::{CompressConfig, Policy};

    const COUNT: usize = 64;

    fn lineage(mode: CacheMode, version: u64, byte: u8) -> Lineage {
        let mut slot = CacheSlot::with_version(DType::BF16, mode, COUNT, version);
        slot.fill_from(&[byte; COUNT * 2]).unwrap();
        Lineage { slot, last_use: 0 }
    }

    fn key(id: u64) -> SlotKey {
        SlotKey {
            id,
            inferred: true,
            count: COUNT,
            dtype: DType::BF16,
        }
    }

    /// Rank 0 after a call whose own buffer was at address A (own lineage at version 10,
    /// held with source 1's at version 20), now called with its buffer back at an older
    /// address B, whose own lineage (version 5) the receivers did not use last call.
    fn moved_buffer() -> Compressor {
        let mut c = Compressor::new(CompressConfig::default());
        let mut p = Policy::new(Some(CacheMode::FullValue), true);
        p.held = vec![(0, 10), (1, 20)];
        c.policies.insert(key(1), p);
        c.store
            .put(0, lineage(CacheMode::FullValue, 10, 1), Some(key(0xA)));
        c.store
            .put(0, lineage(CacheMode::FullValue, 5, 2), Some(key(0xB)));
        c.store.put(1, lineage(CacheMode::FullValue, 20, 3), None);
        c
    }

    /// A conversion takes every held lineage by its version, this rank's own included (as
    /// every receiver converts its lineage of this rank), not the one under this call's key.
    #[test]
    fn a_conversion_converts_the_held_own_lineage_where_the_buffer_moved() {
        let mut c = moved_buffer();
        c.convert_lineages(key(1), CacheMode::Exponent);
        let own_a = c
            .store
            .take_own(&key(0xA))
            .expect("the held own lineage, under its key");
        assert_eq!(
            (own_a.slot.mode(), own_a.slot.version()),
            (CacheMode::Exponent, 10)
        );
        let own_b = c.store.take_own(&key(0xB)).expect("the other own lineage");
        assert_eq!(
            (own_b.slot.mode(), own_b.slot.version()),
            (CacheMode::FullValue, 5)
        );
        let src1 = c.store.take(1, 20).expect("source 1's");
        assert_eq!(src1.slot.mode(), CacheMode::Exponent);
        assert_eq!(c.policies[&key(1)].held, vec![(0, 10), (1, 20)]);
    }

    /// Dropping a policy's caches drops this rank's held own lineage as the receivers drop
    /// theirs of it, and the one under this call's key.
    #[test]
    fn dropped_caches_include_the_held_own_lineage_where_the_buffer_moved() {
        let mut c = moved_buffer();
        c.drop_caches(key(1), key(0xB));
        assert!(c.store.take_own(&key(0xA)).is_none());
        assert!(c.store.take_own(&key(0xB)).is_none());
        assert!(c.store.take(1, 20).is_none());
        assert!(c.policies[&key(1)].held.is_empty());
    }
}
