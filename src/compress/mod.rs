//! The CIERA Allgather: the codec fused into the communicator's pipeline, used only where it
//! pays.
//!
//! Per call: find the cache-slot group of the tensor (an explicit key, or one inferred from the
//! call), decide raw or compressed, and run the allgather. A compressed call goes through
//! [`Communicator::all_gather_framed`]: each rank encodes its own chunks against its own slot
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

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::codec::{checksum, frame, CacheMode, CacheSlot, CodecScratch, FrameInfo, Mode};
use crate::comm::{ChunkRef, Communicator, FrameCodec};
use crate::error::{Error, Result};
use crate::DType;

/// `CIERA_COMPRESS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompressMode {
    Auto,
    On,
    Off,
}

impl CompressMode {
    pub fn parse(s: &str) -> Option<CompressMode> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(CompressMode::Auto),
            "on" | "1" | "true" | "yes" => Some(CompressMode::On),
            "off" | "0" | "false" | "no" => Some(CompressMode::Off),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            CompressMode::Auto => "auto",
            CompressMode::On => "on",
            CompressMode::Off => "off",
        }
    }
}

/// Compression settings; `from_env` reads `CIERA_COMPRESS`, `CIERA_CACHE_MB`, `CIERA_VERIFY`,
/// `CIERA_COMPRESS_MIN_BYTES`.
#[derive(Clone, Debug)]
pub struct CompressConfig {
    pub mode: CompressMode,
    /// Memory all cache slots of a communicator may hold.
    pub cache_bytes: usize,
    /// Check a hash of every shard after decoding.
    pub verify: bool,
    /// Shards smaller than this go raw (latency-bound: nothing to win).
    pub min_shard_bytes: usize,
    /// Force one cache mode (`CIERA_CACHE_MODE=exp|full`); None: full-value caches while they
    /// fit the budget, else exponent caches.
    pub cache_mode: Option<CacheMode>,
}

pub const DEFAULT_CACHE_MB: usize = 4096;
pub const DEFAULT_MIN_SHARD_BYTES: usize = 64 << 10;

impl Default for CompressConfig {
    fn default() -> Self {
        CompressConfig {
            mode: CompressMode::Auto,
            cache_bytes: DEFAULT_CACHE_MB << 20,
            verify: false,
            min_shard_bytes: DEFAULT_MIN_SHARD_BYTES,
            cache_mode: None,
        }
    }
}

fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

impl CompressConfig {
    pub fn from_env() -> Result<CompressConfig> {
        let mut c = CompressConfig::default();
        if let Some(v) = env_var("CIERA_COMPRESS") {
            c.mode = CompressMode::parse(&v).ok_or_else(|| {
                Error::InvalidArgument(format!("CIERA_COMPRESS={v:?}: expected auto, on or off"))
            })?;
        }
        if let Some(v) = env_var("CIERA_CACHE_MB") {
            let mb: usize = v.trim().parse().map_err(|_| {
                Error::InvalidArgument(format!("CIERA_CACHE_MB={v:?} is not a number of MiB"))
            })?;
            c.cache_bytes = mb << 20;
        }
        if let Some(v) = env_var("CIERA_VERIFY") {
            c.verify = !matches!(v.trim(), "0" | "false" | "no" | "off");
        }
        if let Some(v) = env_var("CIERA_CACHE_MODE") {
            c.cache_mode = match v.trim().to_ascii_lowercase().as_str() {
                "auto" => None,
                "exp" | "exponent" => Some(CacheMode::Exponent),
                "full" | "value" | "full-value" => Some(CacheMode::FullValue),
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "CIERA_CACHE_MODE={v:?}: expected auto, exp or full"
                    )))
                }
            };
        }
        if let Some(v) = env_var("CIERA_COMPRESS_MIN_BYTES") {
            c.min_shard_bytes = crate::cli::args::parse_size(&v).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "CIERA_COMPRESS_MIN_BYTES={v:?} is not a size (e.g. 64K)"
                ))
            })?;
        }
        Ok(c)
    }
}

/// Which cached tensor a call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotKey {
    /// The caller's key, or one inferred from the call.
    pub id: u64,
    pub inferred: bool,
    pub count: usize,
    pub dtype: DType,
}

/// What happened to one group of slots (one tensor key) so far.
#[derive(Clone, Debug, Default)]
pub struct SlotStats {
    pub calls: u64,
    pub raw_calls: u64,
    pub fill_calls: u64,
    pub delta_calls: u64,
    /// Bytes gathered by framed calls, and the frame bytes that carried them.
    pub framed_raw_bytes: u64,
    pub framed_wire_bytes: u64,
    /// Ratio of the last delta call (raw bytes / frame bytes).
    pub last_ratio: f64,
    /// Delta frames that decoded against a warm cache / all frames received.
    pub hits: u64,
    pub frames: u64,
    pub repairs: u64,
}

/// Communicator-wide statistics.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub calls: u64,
    pub raw_calls: u64,
    pub fill_calls: u64,
    pub delta_calls: u64,
    /// Logical bytes gathered (nranks x shard) by all calls, and the bytes that stood for them
    /// on the wire (frames for framed calls, the values for raw calls), per gathered tensor.
    pub raw_bytes: u64,
    pub wire_bytes: u64,
    pub encode_ns: u64,
    pub decode_ns: u64,
    /// Wall time of framed calls minus their codec time on this rank.
    pub transfer_ns: u64,
    pub repairs: u64,
    pub cache_bytes: usize,
    pub slots: usize,
    pub evictions: u64,
}

impl Stats {
    pub fn ratio(&self) -> f64 {
        if self.wire_bytes == 0 {
            1.0
        } else {
            self.raw_bytes as f64 / self.wire_bytes as f64
        }
    }
}

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
    /// The encoder worker's coding buffers, kept warm across calls.
    encoder_scratch: CodecScratch,
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
            encoder_scratch: CodecScratch::default(),
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

    /// Allgather with compression where it pays. `send` None = in place.
    pub fn all_gather(
        &mut self,
        comm: &mut Communicator,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        key: Option<u64>,
    ) -> Result<()> {
        self.clock += 1;
        self.stats.calls += 1;
        let n = comm.size();
        let shard = count.saturating_mul(dtype.size());
        let eligible = self.config.mode != CompressMode::Off
            && dtype.is_compressible()
            && n > 1
            && count > 0
            && (self.config.mode == CompressMode::On
                || (shard >= self.config.min_shard_bytes
                    && comm.algo_for(count, dtype) == crate::algo::Algo::Ring));
        let skey = Self::key_for(send, recv, count, dtype, key);
        if !eligible || self.oversized.contains_key(&skey) {
            return self.raw(comm, send, recv, count, dtype);
        }
        if !self.groups.contains_key(&skey) && !self.admit(skey, n) {
            return self.raw(comm, send, recv, count, dtype);
        }
        let clock = self.clock;
        let g = self.groups.get_mut(&skey).expect("admitted");
        g.last_use = clock;
        g.stats.calls += 1;
        if let GroupState::RawFor { until, backoff } = g.state {
            if g.stats.calls < until {
                g.stats.raw_calls += 1;
                return self.raw(comm, send, recv, count, dtype);
            }
            g.backoff = backoff;
            g.state = GroupState::Cold;
        }
        // In auto mode the raw baseline comes from timed raw calls: the second call of a group
        // (the first, a FILL, has touched every buffer by then), then one in RAW_PROBE_EVERY.
        // Every rank makes the same choice (call counts); each rank's time travels in the next
        // compressed call's status record. A raw call between compressed ones is safe: no cache
        // changes on any side.
        let probe = self.config.mode == CompressMode::Auto
            && g.state == GroupState::Warm
            && g.pending_raw.is_none()
            && (g.raw_time.is_none() || g.stats.calls % RAW_PROBE_EVERY == 0);
        if probe {
            g.stats.raw_calls += 1;
            let t = Instant::now();
            let r = self.raw(comm, send, recv, count, dtype);
            let g = self.groups.get_mut(&skey).expect("admitted");
            g.pending_raw = Some(t.elapsed());
            return r;
        }
        self.framed(comm, skey, send, recv, count, dtype)
    }

    fn raw(
        &mut self,
        comm: &mut Communicator,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        self.stats.raw_calls += 1;
        let bytes = (recv.len()) as u64;
        self.stats.raw_bytes += bytes;
        self.stats.wire_bytes += bytes;
        comm.all_gather_raw(send, recv, count, dtype)
    }

    /// Make room for a new group within the budget: full-value caches if they fit, else
    /// exponent caches; least recently used groups are evicted (every rank makes the same
    /// choices: same calls, same sizes, same budget).
    fn admit(&mut self, key: SlotKey, n: usize) -> bool {
        let per = |mode: CacheMode| n * key.count * mode.bytes_per_element(key.dtype);
        let budget = self.config.cache_bytes;
        let mode = if let Some(m) = self.config.cache_mode.filter(|&m| per(m) <= budget) {
            m
        } else if self.config.cache_mode != Some(CacheMode::Exponent)
            && per(CacheMode::FullValue) <= budget
        {
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

    fn framed(
        &mut self,
        comm: &mut Communicator,
        key: SlotKey,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        let n = comm.size();
        let me = comm.rank();
        let shard_bytes = count * dtype.size();
        let verify = self.config.verify;
        let own_hash = if verify {
            let own = match send {
                Some(s) => s,
                None => &recv[me * shard_bytes..(me + 1) * shard_bytes],
            };
            checksum::sh64(own)
        } else {
            0
        };
        let scratch = &mut self.encoder_scratch;
        let g = self.groups.get_mut(&key).expect("group exists");
        let filling = g.state == GroupState::Cold;
        if filling {
            for s in g.slots.iter_mut() {
                s.poison();
            }
        }
        let t0 = Instant::now();
        // Compress once, at the source, on a worker thread: it encodes this rank's chunks in
        // order while the executor sends the ones already made and decodes what arrives.
        let chunk_elems = (comm.config().chunk_bytes / dtype.size()).max(1);
        let own_copy;
        let own: &[u8] = match send {
            Some(s) => s,
            None => {
                own_copy = recv[me * shard_bytes..(me + 1) * shard_bytes].to_vec();
                &own_copy
            }
        };
        let (before, rest) = g.slots.split_at_mut(me);
        let (own_slot, after) = rest.split_first_mut().expect("own slot");
        let (r, codec, enc) = std::thread::scope(|sc| {
            let (tx, rx) = std::sync::mpsc::channel();
            let worker = sc.spawn(move || {
                scratch.lend(|| {
                    let t = Instant::now();
                    let es = dtype.size();
                    let mut start = 0;
                    while start < count {
                        let end = (start + chunk_elems).min(count);
                        let mut out = Vec::with_capacity((end - start) * es + frame::HEADER_LEN);
                        let r = own_slot
                            .chunk(start..end)
                            .encode(&own[start * es..end * es], &mut out);
                        if tx.send(r.map(|info| (out, info))).is_err() {
                            break;
                        }
                        start = end;
                    }
                    t.elapsed().as_nanos() as u64
                })
            });
            let mut codec = GroupCodec::new(before, after, me, rx);
            let r = comm.all_gather_framed(send, recv, count, dtype, &mut codec);
            drop(codec.own_frames.take());
            let enc = worker.join().unwrap_or(0);
            (r, codec, enc)
        });
        let elapsed = t0.elapsed();
        let GroupCodec {
            mut infos,
            failures,
            decode_ns,
            own_infos,
            ..
        } = codec;
        let encode_ns = enc;
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
        let mut all = vec![0u8; n * words * 8];
        let collect_status = |mine: &Vec<u64>,
                              all: &mut Vec<u8>,
                              comm: &mut Communicator|
         -> Result<Vec<Vec<u64>>> {
            let bytes: Vec<u8> = mine.iter().flat_map(|w| w.to_le_bytes()).collect();
            comm.all_gather(&bytes, all, words * 8, DType::U8)?;
            Ok(all
                .chunks(words * 8)
                .map(|r| {
                    r.chunks(8)
                        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                        .collect()
                })
                .collect())
        };
        if verify {
            // Hashes must be known before this rank can report a mismatch, so verification
            // takes a first exchange of the hashes alone when it is on.
            let status = collect_status(&mine, &mut all, comm)?;
            for src in 0..n {
                if src != me && failed[src].is_none() {
                    let got = checksum::sh64(&recv[src * shard_bytes..(src + 1) * shard_bytes]);
                    if got != status[src][3] {
                        failed[src] = Some(format!(
                            "CIERA_VERIFY: decoded shard hashes to {got:#018x}, rank {src} sent {:#018x}",
                            status[src][3]
                        ));
                    }
                }
            }
        }
        for (src, f) in failed.iter().enumerate() {
            if f.is_some() {
                mine[STATUS_FIXED_WORDS + src / 64] |= 1 << (src % 64);
            }
        }
        let t_status = Instant::now();
        let status = collect_status(&mine, &mut all, comm)?;
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
            // decoder writes), so the result is exact on every rank.
            return comm.all_gather_raw(send, recv, count, dtype);
        }
        // Decide what the next call on this group does, from agreed values only.
        if filling {
            g.slow_streak = 0;
            g.state = GroupState::Warm;
        } else if self.config.mode == CompressMode::Auto {
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
        Ok(())
    }
}

fn infos_wire(infos: &[Vec<FrameInfo>]) -> u64 {
    infos.iter().flatten().map(|i| i.frame_bytes as u64).sum()
}

type OwnFrame = Result<(Vec<u8>, FrameInfo)>;

/// The frame codec of one call: the receivers' slots of the other ranks, and the frames of
/// this rank's chunks as the encoder thread makes them (in chunk order).
struct GroupCodec<'a> {
    /// Slots of sources `0..me` and `me+1..n`.
    before: &'a mut [CacheSlot],
    after: &'a mut [CacheSlot],
    me: usize,
    own_frames: Option<std::sync::mpsc::Receiver<OwnFrame>>,
    parked: HashMap<usize, (Vec<u8>, FrameInfo)>,
    own_infos: Vec<FrameInfo>,
    infos: Vec<Vec<FrameInfo>>,
    failures: Vec<Option<Error>>,
    decode_ns: u64,
}

impl<'a> GroupCodec<'a> {
    fn new(
        before: &'a mut [CacheSlot],
        after: &'a mut [CacheSlot],
        me: usize,
        own_frames: std::sync::mpsc::Receiver<OwnFrame>,
    ) -> GroupCodec<'a> {
        let n = before.len() + after.len() + 1;
        GroupCodec {
            before,
            after,
            me,
            own_frames: Some(own_frames),
            parked: HashMap::new(),
            own_infos: Vec::new(),
            infos: vec![Vec::new(); n],
            failures: (0..n).map(|_| None).collect(),
            decode_ns: 0,
        }
    }

    fn slot(&mut self, src: usize) -> &mut CacheSlot {
        if src < self.me {
            &mut self.before[src]
        } else {
            &mut self.after[src - self.me - 1]
        }
    }
}

/// Frame format code in message headers for CIERA frames (docs/WIRE.md).
pub const FRAME_FORMAT: u8 = 1;

impl FrameCodec for GroupCodec<'_> {
    fn format(&self) -> u8 {
        FRAME_FORMAT
    }

    fn max_frame_len(&self, raw_len: usize) -> usize {
        raw_len + frame::HEADER_LEN
    }

    fn encode(&mut self, chunk: &ChunkRef, _raw: &[u8], out: &mut Vec<u8>) -> Result<()> {
        // The encoder thread made this chunk already (or is making it), in chunk order; an
        // algorithm that asks out of order gets the ones made meanwhile parked.
        let (mut frame, info) = loop {
            if let Some(f) = self.parked.remove(&chunk.elems.start) {
                break f;
            }
            let rx = self.own_frames.as_ref().ok_or_else(|| Error::SlotState {
                detail: "encoder finished".into(),
            })?;
            let (frame, info) = rx.recv().map_err(|_| Error::SlotState {
                detail: format!("encoder thread ended before chunk {}", chunk.chunk),
            })??;
            if info.offset == chunk.elems.start {
                break (frame, info);
            }
            self.parked.insert(info.offset, (frame, info));
        };
        if info.count != chunk.elems.len() {
            return Err(Error::LengthMismatch {
                what: "encoded chunk elements",
                expected: chunk.elems.len(),
                found: info.count,
            });
        }
        std::mem::swap(out, &mut frame);
        self.own_infos.push(info);
        Ok(())
    }

    fn decode(&mut self, chunk: &ChunkRef, bytes: &[u8], out: &mut [u8]) -> Result<()> {
        // A frame that does not decode is not fatal to the communicator: it is recorded,
        // exchanged and repaired after the call (module docs). Later frames of the same source
        // are skipped.
        let src = chunk.src;
        if src >= self.failures.len() || src == self.me || self.failures[src].is_some() {
            return Ok(());
        }
        let t = Instant::now();
        let r = frame::parse(bytes).and_then(|f| {
            if f.offset != chunk.elems.start || f.count != chunk.elems.len() {
                return Err(Error::LengthMismatch {
                    what: "frame element range start",
                    expected: chunk.elems.start,
                    found: f.offset,
                });
            }
            self.slot(src).chunk(chunk.elems.clone()).decode(&f, out)
        });
        match r {
            Ok(info) => self.infos[src].push(info),
            Err(e) => self.failures[src] = Some(e),
        }
        self.decode_ns += t.elapsed().as_nanos() as u64;
        Ok(())
    }
}
