//! The compression policy of the CIERA Allgather: the codec fused into the engine's pipeline,
//! used only where it pays. The communicator owns one [`Compressor`] and every caller (the C
//! ABI, the interposers, the CLI) reaches it through `Communicator::all_gather_keyed` /
//! `all_gather_with`.
//!
//! Per call: find the cache-slot group of the tensor (an explicit key, or one inferred from the
//! call), decide raw or compressed, and run the allgather. A compressed call goes through
//! the engine's framed allgather ([`crate::engine::Engine::all_gather_framed`]): each rank encodes its own chunks against its own slot
//! (compress once, at the source), every hop forwards frames unchanged, and every receiver
//! decodes each frame into the output and into its slot for that source. After a compressed
//! call the ranks exchange a small status record (decode failures, call time, optional shard
//! hashes); every decision after that is a function of exchanged values and call counts only,
//! so all ranks always agree on raw versus compressed without an extra round trip.
//!
//! Decisions (`CIERA_COMPRESS=auto`, the default):
//! - raw: types the codec does not compress, shards below `min_shard_bytes`, latency-bound
//!   algorithms (not the ring), and groups that did not fit the cache budget;
//! - the first use of a group is a FILL call (raw values in frames: warms every cache), the
//!   second a timed raw call (the baseline; one call in 64 is again, to keep it current);
//! - then delta calls; each one's time (slowest rank) is compared with the raw baseline
//!   (slowest rank); after two in a row that are not at least 5% faster, the group goes raw for
//!   a back-off period (256 calls, doubling each time) and is re-probed after it. `on` always
//!   compresses, `off` never.
//!
//! Failures: a frame that does not decode (version mismatch after a restart, a checksum error)
//! or, with `CIERA_VERIFY=1`, a decoded shard whose hash differs from the sender's, is detected
//! on the receiver, exchanged in the status record, logged as an error naming the source rank
//! and slot, and repaired at once: every rank poisons that source's slot and the call is redone
//! raw, so the returned tensor is exact and the next call refills the cache.

#![forbid(unsafe_code)]

mod config;
mod group_codec;
mod stats;
mod verify;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::codec::{CacheMode, CacheSlot, FrameInfo, Mode};
use crate::engine::Engine;
use crate::error::Result;
use crate::DType;
pub use config::{
    cache_mb_to_bytes, CompressConfig, CompressMode, GatherOptions, DEFAULT_CACHE_MB,
    DEFAULT_MIN_SHARD_BYTES,
};
pub use group_codec::FRAME_FORMAT;
use group_codec::{GroupCodec, OwnEncoder};
pub use stats::{CallKind, CallReport, SlotKey, SlotStats, Stats};

#[derive(Clone, Copy, Debug, PartialEq)]
enum GroupState {
    /// Next framed call fills the caches.
    Cold,
    /// Caches hold the last call; deltas possible.
    Warm,
    /// Raw until call number `until` (of this group), then Cold again.
    RawFor { until: u64, backoff: u64 },
}

struct Group {
    slots: Vec<CacheSlot>,
    mode: CacheMode,
    state: GroupState,
    last_use: u64,
    /// The raw baseline: agreed (slowest rank) time of the last timed raw call.
    raw_time: Option<Duration>,
    /// This rank's time of a raw probe call not yet exchanged (sent with the next status).
    pending_raw: Option<Duration>,
    backoff: u64,
    /// Consecutive delta calls slower than the raw baseline (one slow call is noise).
    slow_streak: u32,
    stats: SlotStats,
}

impl Group {
    fn memory(&self) -> usize {
        self.slots.iter().map(|s| s.memory_bytes()).sum()
    }
}

/// Per-communicator compression state.
pub struct Compressor {
    pub config: CompressConfig,
    groups: HashMap<SlotKey, Group>,
    /// Keys that did not fit the budget even alone: raw, without asking again.
    oversized: HashMap<SlotKey, ()>,
    clock: u64,
    stats: Stats,
}

const STATUS_FIXED_WORDS: usize = 5; // call ns, encode ns, decode ns, shard hash, raw probe ns
/// A warm group times one raw call in this many, to keep its raw baseline current.
const RAW_PROBE_EVERY: u64 = 64;

impl Compressor {
    pub fn new(config: CompressConfig) -> Compressor {
        crate::logging::init_from_env();
        Compressor {
            config,
            groups: HashMap::new(),
            oversized: HashMap::new(),
            clock: 0,
            stats: Stats::default(),
        }
    }

    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.cache_bytes = self.groups.values().map(Group::memory).sum();
        s.slots = self.groups.len();
        s
    }

    /// Per-slot statistics, in no particular order.
    pub fn slot_stats(&self) -> Vec<(SlotKey, CacheMode, SlotStats)> {
        self.groups
            .iter()
            .map(|(k, g)| (*k, g.mode, g.stats.clone()))
            .collect()
    }

    /// Forget every cache (e.g. after the application changed all weights out of band).
    pub fn reset(&mut self) {
        self.groups.clear();
    }

    /// The slot key of a call: the caller's, or inferred. Inference uses this rank's send
    /// buffer address (out of place: FSDP's sharded parameters live at a fixed address per
    /// layer) or the recv address (in place), with count and type. Ranks that infer
    /// differently only lose ratio: a delta against the wrong slot fails its version check and
    /// is repaired (see the module docs), never decoded into wrong values.
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
                    && engine.algo_for(count, dtype) == crate::algo::Algo::Ring));
        let skey = Self::key_for(send, recv, count, dtype, opts.key);
        if !eligible || self.oversized.contains_key(&skey) {
            return self.raw(engine, send, recv, count, dtype);
        }
        let cache_mode = opts.cache_mode.or(self.config.cache_mode);
        if !self.groups.contains_key(&skey) && !self.admit(skey, n, cache_mode) {
            return self.raw(engine, send, recv, count, dtype);
        }
        let clock = self.clock;
        let g = self.groups.get_mut(&skey).expect("admitted");
        g.last_use = clock;
        g.stats.calls += 1;
        if let GroupState::RawFor { until, backoff } = g.state {
            if g.stats.calls < until {
                g.stats.raw_calls += 1;
                return self.raw(engine, send, recv, count, dtype);
            }
            g.backoff = backoff;
            g.state = GroupState::Cold;
        }
        // In auto mode the raw baseline comes from timed raw calls: the second call of a group
        // (the first, a FILL, has touched every buffer by then), then one in RAW_PROBE_EVERY.
        // Every rank makes the same choice (call counts); each rank's time travels in the next
        // compressed call's status record. A raw call between compressed ones is safe: no cache
        // changes on any side.
        let probe = mode == CompressMode::Auto
            && g.state == GroupState::Warm
            && g.pending_raw.is_none()
            && (g.raw_time.is_none() || g.stats.calls.is_multiple_of(RAW_PROBE_EVERY));
        if probe {
            g.stats.raw_calls += 1;
            let t = Instant::now();
            let r = self.raw(engine, send, recv, count, dtype);
            let g = self.groups.get_mut(&skey).expect("admitted");
            g.pending_raw = Some(t.elapsed());
            return r;
        }
        self.framed(engine, skey, mode, send, recv, count, dtype)
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
        self.stats.raw_calls += 1;
        let bytes = recv.len() as u64;
        self.stats.raw_bytes += bytes;
        self.stats.wire_bytes += bytes;
        self.all_gather_uncompressed(engine, send, recv, count, dtype)?;
        Ok(CallReport::raw(bytes))
    }

    /// Make room for a new group within the budget: full-value caches if they fit, else
    /// exponent caches; least recently used groups are evicted (every rank makes the same
    /// choices: same calls, same sizes, same budget).
    fn admit(&mut self, key: SlotKey, n: usize, cache_mode: Option<CacheMode>) -> bool {
        let per = |mode: CacheMode| {
            n.saturating_mul(key.count)
                .saturating_mul(mode.bytes_per_element(key.dtype))
        };
        let budget = self.config.cache_bytes;
        let mode = if let Some(m) = cache_mode.filter(|&m| per(m) <= budget) {
            m
        } else if cache_mode != Some(CacheMode::Exponent) && per(CacheMode::FullValue) <= budget {
            CacheMode::FullValue
        } else if per(CacheMode::Exponent) <= budget {
            CacheMode::Exponent
        } else {
            tracing::info!(count = key.count, dtype = %key.dtype, "tensor exceeds CIERA_CACHE_MB alone: raw");
            self.oversized.insert(key, ());
            return false;
        };
        let need = per(mode);
        let mut used: usize = self.groups.values().map(Group::memory).sum();
        while used + need > budget {
            let Some((&victim, _)) = self.groups.iter().min_by_key(|(k, g)| (g.last_use, k.id))
            else {
                break;
            };
            used -= self.groups[&victim].memory();
            self.groups.remove(&victim);
            self.stats.evictions += 1;
            tracing::debug!(
                count = victim.count,
                "evicted a cache slot group (CIERA_CACHE_MB)"
            );
        }
        let slots = (0..n)
            .map(|_| CacheSlot::new(key.dtype, mode, key.count))
            .collect();
        self.groups.insert(
            key,
            Group {
                slots,
                mode,
                state: GroupState::Cold,
                last_use: self.clock,
                raw_time: None,
                pending_raw: None,
                backoff: 256,
                slow_streak: 0,
                stats: SlotStats::default(),
            },
        );
        true
    }

    #[allow(clippy::too_many_arguments)]
    fn framed(
        &mut self,
        engine: &mut Engine,
        key: SlotKey,
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
        let g = self.groups.get_mut(&key).expect("group exists");
        let filling = g.state == GroupState::Cold;
        if filling {
            for s in g.slots.iter_mut() {
                s.poison();
            }
        }
        let t0 = Instant::now();
        // Compress once, at the source: the engine's encoder worker encodes this rank's chunks
        // against its own slot while the executor sends the frames already made and decodes
        // what arrives into the other slots.
        let (before, rest) = g.slots.split_at_mut(me);
        let (own_slot, after) = rest.split_first_mut().expect("own slot");
        let mut encoder = OwnEncoder {
            slot: own_slot,
            infos: Vec::new(),
            encode_ns: 0,
        };
        let mut codec = GroupCodec::new(before, after, me);
        let r = engine.all_gather_framed(send, recv, count, dtype, &mut encoder, &mut codec);
        let elapsed = t0.elapsed();
        let (own_infos, encode_ns) = (encoder.infos, encoder.encode_ns);
        let GroupCodec {
            mut infos,
            failures,
            decode_ns,
            ..
        } = codec;
        infos[me] = own_infos;
        if let Err(e) = r {
            // The transfer failed (a peer died, an abort): caches are half-updated everywhere.
            for s in g.slots.iter_mut() {
                s.poison();
            }
            g.state = GroupState::Cold;
            return Err(e);
        }
        // Commit every source's slot, or note why it cannot be.
        let mut failed: Vec<Option<String>> = failures
            .into_iter()
            .map(|f| f.map(|e| e.to_string()))
            .collect();
        for (src, slot) in g.slots.iter_mut().enumerate() {
            if failed[src].is_none() {
                if let Err(e) = slot.commit(&infos[src]) {
                    failed[src] = Some(e.to_string());
                }
            }
        }
        // Status exchange: [call ns, encode ns, decode ns, shard hash, failure bitmap words].
        let words = STATUS_FIXED_WORDS + n.div_ceil(64);
        let mut mine = vec![0u64; words];
        mine[0] = elapsed.as_nanos() as u64;
        mine[1] = encode_ns;
        mine[2] = decode_ns;
        mine[3] = own_hash;
        mine[4] = g.pending_raw.take().map_or(0, |d| d.as_nanos() as u64);
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
            g.raw_time = Some(Duration::from_nanos(probe));
        }
        let mut bad: Vec<usize> = Vec::new();
        for src in 0..n {
            if status
                .iter()
                .any(|s| s[STATUS_FIXED_WORDS + src / 64] >> (src % 64) & 1 == 1)
            {
                bad.push(src);
            }
        }
        // Account.
        let wire: u64 = infos_wire(&infos);
        let raw = (n * shard_bytes) as u64;
        self.stats.raw_bytes += raw;
        self.stats.wire_bytes += wire;
        self.stats.encode_ns += encode_ns;
        self.stats.decode_ns += decode_ns;
        self.stats.transfer_ns += (elapsed.as_nanos() as u64).saturating_sub(encode_ns + decode_ns);
        g.stats.framed_raw_bytes += raw;
        g.stats.framed_wire_bytes += wire;
        g.stats.frames += infos.iter().map(|v| v.len() as u64).sum::<u64>();
        g.stats.hits += infos
            .iter()
            .flatten()
            .filter(|i| i.mode != Mode::Raw)
            .count() as u64;
        if filling {
            self.stats.fill_calls += 1;
            g.stats.fill_calls += 1;
        } else {
            self.stats.delta_calls += 1;
            g.stats.delta_calls += 1;
            g.stats.last_ratio = raw as f64 / wire.max(1) as f64;
        }
        let report = |repaired| CallReport {
            kind: if filling {
                CallKind::Fill
            } else {
                CallKind::Delta
            },
            repaired,
            raw_bytes: raw,
            wire_bytes: wire,
        };
        tracing::info!(
            slot = key.id,
            count = key.count,
            dtype = %key.dtype,
            fill = filling,
            ratio = raw as f64 / wire.max(1) as f64,
            wire_bytes = wire,
            encode_ms = encode_ns as f64 / 1e6,
            decode_ms = decode_ns as f64 / 1e6,
            call_ms = elapsed.as_secs_f64() * 1e3,
            status_ms = status_time.as_secs_f64() * 1e3,
            slowest_ms = slowest.as_secs_f64() * 1e3,
            "compressed allgather"
        );
        if !bad.is_empty() {
            for &src in &bad {
                g.slots[src].poison();
                let why = failed[src]
                    .clone()
                    .unwrap_or_else(|| "failed on another rank".into());
                tracing::error!(
                    source_rank = src,
                    slot = key.id,
                    count = key.count,
                    dtype = %key.dtype,
                    "cache slot of rank {src} failed to decode ({why}); repairing this call raw, next call refills the cache"
                );
            }
            g.stats.repairs += 1;
            self.stats.repairs += 1;
            g.state = GroupState::Cold;
            // Redo raw: the own shard is intact (send buffer, or recv's own block, which no
            // decoder writes), so the result is exact on every rank (and checked again when
            // verifying: a detected corruption never leaves wrong bytes behind).
            self.all_gather_uncompressed(engine, send, recv, count, dtype)?;
            return Ok(report(true));
        }
        // Decide what the next call on this group does, from agreed values only.
        if filling {
            g.slow_streak = 0;
            g.state = GroupState::Warm;
        } else if mode == CompressMode::Auto {
            if let Some(base) = g.raw_time {
                if slowest.as_secs_f64() > 0.95 * base.as_secs_f64() {
                    g.slow_streak += 1;
                } else {
                    g.slow_streak = 0;
                }
                // Two slow deltas in a row: the first after a FILL pays for cold buffers, and
                // one slow call on a shared machine is noise.
                if g.slow_streak >= 2 {
                    g.slow_streak = 0;
                    let until = g.stats.calls + g.backoff;
                    tracing::info!(
                        slot = key.id,
                        delta_ms = slowest.as_secs_f64() * 1e3,
                        raw_ms = base.as_secs_f64() * 1e3,
                        "compression does not pay on this link for this tensor: raw for {} calls",
                        g.backoff
                    );
                    g.state = GroupState::RawFor {
                        until,
                        backoff: (g.backoff * 2).min(1 << 16),
                    };
                }
            }
        }
        Ok(report(false))
    }
}

fn infos_wire(infos: &[Vec<FrameInfo>]) -> u64 {
    infos.iter().flatten().map(|i| i.frame_bytes as u64).sum()
}
