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
mod framed;
mod group_codec;
mod stats;
mod verify;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::codec::{CacheMode, CacheSlot};
use crate::engine::Engine;
use crate::error::Result;
use crate::DType;
pub use config::{
    cache_mb_to_bytes, CompressConfig, CompressMode, GatherOptions, DEFAULT_CACHE_MB,
    DEFAULT_MIN_SHARD_BYTES,
};
pub use group_codec::FRAME_FORMAT;
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
}
