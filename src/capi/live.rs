//! A communicator as the C ABI and the interposers hold it ([`LiveComm`]), and the checks that
//! turn an allgather's C pointers into slices ([`gather_buffers`]).

use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

use super::abi::{CStats, API_MAGIC, STATS_VERSION};
use super::abi::{Failure, ResultCode};
use super::device::{DeviceCall, DeviceQueue};
use crate::comm::{AbortHandle, Communicator, Config, UniqueId};
use crate::compress::{CompressConfig, GatherOptions, Stats as CompressStats};
use crate::gpu::driver;
use crate::gpu::stream::StreamRef;
use crate::mem::Location;
use crate::DType;

// ---- statistics ---------------------------------------------------------------------------------

/// What `cieraCommGetStats` reports: the calls as the C API saw them, and the compressor's
/// own statistics as of the last call that finished.
#[derive(Clone, Debug, Default)]
pub struct CallStats {
    pub calls: u64,
    pub in_place_calls: u64,
    pub failed_calls: u64,
    pub compress: CompressStats,
    /// Bytes copied out of same-host peers' shared buffers through mappings (single copy
    /// without a system call; see `cieraMemAlloc`).
    pub shared_read_bytes: u64,
}

impl CallStats {
    /// Calls that went through the codec (filling or delta).
    pub fn compressed_calls(&self) -> u64 {
        self.compress.fill_calls + self.compress.delta_calls
    }

    /// One line for the interposers' `CIERA_STATS=1` reports.
    pub fn summary(&self) -> String {
        let c = &self.compress;
        format!(
            "{} allgathers served by CIERA ({} in place, {} failed; {} raw, {} fill, {} delta calls; {} B gathered, \
             {} B on the wire, ratio {:.3}; {} repairs, {} cache misses; {} B read from peers' shared buffers)",
            self.calls,
            self.in_place_calls,
            self.failed_calls,
            c.raw_calls,
            c.fill_calls,
            c.delta_calls,
            c.raw_bytes,
            c.wire_bytes,
            c.ratio(),
            c.repairs,
            c.misses,
            self.shared_read_bytes
        )
    }

    pub(super) fn to_c(&self) -> CStats {
        let c = &self.compress;
        CStats {
            size: std::mem::size_of::<CStats>(),
            magic: API_MAGIC,
            version: STATS_VERSION,
            calls: self.calls,
            in_place_calls: self.in_place_calls,
            failed_calls: self.failed_calls,
            raw_calls: c.raw_calls,
            fill_calls: c.fill_calls,
            delta_calls: c.delta_calls,
            repairs: c.repairs,
            raw_bytes: c.raw_bytes,
            wire_bytes: c.wire_bytes,
            cache_bytes: c.cache_bytes as u64,
            encode_ns: c.encode_ns,
            decode_ns: c.decode_ns,
            misses: c.misses,
        }
    }
}

// ---- live communicators ----------------------------------------------------------------------

/// The buffers of one allgather call, checked against each other.
pub enum GatherBuffers<'a> {
    /// This rank's shard is already at `recv[rank*block..]`.
    InPlace {
        recv: &'a mut [u8],
    },
    OutOfPlace {
        send: &'a [u8],
        recv: &'a mut [u8],
    },
}

/// Checks the pointers and sizes of an allgather (NCCL's rules: `recvbuff` holds
/// `nranks*count` elements, in place when `sendbuff == recvbuff + rank*count*size`) and makes
/// slices of them. `what` prefixes are the C argument names.
///
/// # Safety
/// If the checks pass, `send` must be readable for `count*dtype.size()` bytes and `recv`
/// writable for `nranks*count*dtype.size()` bytes, both for `'a`, and nothing else may write
/// them (or read `recv`) during `'a`. NULL and overlap are checked here, not assumed.
pub unsafe fn gather_buffers<'a>(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: DType,
    rank: usize,
    nranks: usize,
) -> Result<GatherBuffers<'a>, Failure> {
    let c = check_buffers(send, recv, count, dtype, rank, nranks)?;
    if c.total == 0 {
        // Nothing is read or written; NULL is fine here (as with NCCL).
        return Ok(if c.in_place {
            GatherBuffers::InPlace { recv: &mut [] }
        } else {
            GatherBuffers::OutOfPlace {
                send: &[],
                recv: &mut [],
            }
        });
    }
    for (name, p) in [("sendbuff", send), ("recvbuff", recv as *const c_void)] {
        if driver::classify(p) != Location::Host {
            return Err(Failure::invalid_argument(format!(
                "{name} {p:p} is CUDA device or managed memory, but the other buffer is not: \
                 both must be device memory, or both host memory"
            )));
        }
    }
    if c.in_place {
        // SAFETY: non-null, `total` bytes writable for 'a and unaliased (caller's contract).
        let recv = unsafe { std::slice::from_raw_parts_mut(recv as *mut u8, c.total) };
        return Ok(GatherBuffers::InPlace { recv });
    }
    // SAFETY: both non-null, sized as the caller's contract says, and disjoint (checked),
    // so the shared and the mutable slice do not alias.
    let (send, recv) = unsafe {
        (
            std::slice::from_raw_parts(send as *const u8, c.block),
            std::slice::from_raw_parts_mut(recv as *mut u8, c.total),
        )
    };
    Ok(GatherBuffers::OutOfPlace { send, recv })
}

/// An allgather's buffers as [`check_buffers`] found them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckedBuffers {
    /// Bytes per rank.
    pub block: usize,
    /// Bytes of recv.
    pub total: usize,
    /// `send == recv + rank*block`.
    pub in_place: bool,
}

/// NCCL's rules for an allgather's pointers and sizes, wherever the memory is: sizes that fit
/// the address space, no NULL unless nothing is moved, in place or not overlapping.
pub fn check_buffers(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: DType,
    rank: usize,
    nranks: usize,
) -> Result<CheckedBuffers, Failure> {
    let block = count.checked_mul(dtype.size()).ok_or_else(|| {
        Failure::invalid_argument(format!(
            "sendcount {count} of {dtype} overflows a byte length"
        ))
    })?;
    let total = block
        .checked_mul(nranks)
        .filter(|&t| t <= isize::MAX as usize)
        .ok_or_else(|| {
            Failure::invalid_argument(format!(
                "sendcount {count} x {} bytes x {nranks} ranks overflows the address space",
                dtype.size()
            ))
        })?;
    let (r, s) = (recv as usize, send as usize);
    if total == 0 {
        return Ok(CheckedBuffers {
            block,
            total,
            in_place: s == r,
        });
    }
    if recv.is_null() {
        return Err(Failure::invalid_argument(format!(
            "recvbuff is NULL (sendcount {count})"
        )));
    }
    if send.is_null() {
        return Err(Failure::invalid_argument(format!(
            "sendbuff is NULL (sendcount {count})"
        )));
    }
    if r.checked_add(total).is_none() {
        return Err(Failure::invalid_argument(format!(
            "recvbuff {recv:p} + {total} bytes wraps the address space"
        )));
    }
    if s.checked_add(block).is_none() {
        return Err(Failure::invalid_argument(format!(
            "sendbuff {send:p} + {block} bytes wraps the address space"
        )));
    }
    let in_place = s == r + rank * block;
    if !in_place && s < r + total && r < s + block {
        return Err(Failure::invalid_argument(format!(
            "sendbuff {send:p} ({block} bytes) overlaps recvbuff {recv:p} ({total} bytes) but is not the in-place \
             position recvbuff + rank*sendcount*size = {:#x}",
            r + rank * block
        )));
    }
    Ok(CheckedBuffers {
        block,
        total,
        in_place,
    })
}

/// A communicator as the C ABI and the interposers hold it: the shared [`Core`] (the
/// `Communicator` behind a lock, with what other threads may ask while a collective runs), and
/// the queue of its device-memory calls ([`super::device`]), started by the first one.
pub struct LiveComm {
    core: Arc<Core>,
    device: Mutex<Option<DeviceQueue>>,
}

/// What a communicator's calls share, from the caller's thread or the device queue's proxy.
pub(super) struct Core {
    comm: Mutex<Communicator>,
    abort: AbortHandle,
    rank: usize,
    nranks: usize,
    compress_config: CompressConfig,
    stats: Mutex<CallStats>,
    /// Set when a collective failed in a way that leaves the communicator unusable.
    async_error: Mutex<Option<(ResultCode, String)>>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks is caught at the ABI; what they guard stays
    // usable (counters; a communicator whose failed call marked it broken), so keep going.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl LiveComm {
    pub fn new(comm: Communicator) -> Arc<LiveComm> {
        Arc::new(LiveComm {
            core: Arc::new(Core {
                abort: comm.abort_handle(),
                rank: comm.rank(),
                nranks: comm.size(),
                compress_config: comm.config().compress.clone(),
                comm: Mutex::new(comm),
                stats: Mutex::new(CallStats::default()),
                async_error: Mutex::new(None),
            }),
            device: Mutex::new(None),
        })
    }

    pub fn init_rank(
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        config: Config,
    ) -> Result<Arc<LiveComm>, Failure> {
        let comm = Communicator::init_rank(id, nranks, rank, config)?;
        Ok(LiveComm::new(comm))
    }

    pub fn rank(&self) -> usize {
        self.core.rank
    }

    pub fn size(&self) -> usize {
        self.core.nranks
    }

    pub fn compress_config(&self) -> &CompressConfig {
        &self.core.compress_config
    }

    pub fn stats(&self) -> CallStats {
        lock(&self.core.stats).clone()
    }

    pub fn async_error(&self) -> Option<(ResultCode, String)> {
        self.core.async_error()
    }

    /// Frames received that decoded against a warm cache, and all frames received, over
    /// every tensor this communicator compressed (the cache hit rate is their ratio).
    pub fn frame_hits(&self) -> (u64, u64) {
        lock(&self.core.comm)
            .slot_stats()
            .iter()
            .fold((0, 0), |(h, f), (_, _, s)| (h + s.hits, f + s.frames))
    }

    pub fn abort(&self) {
        self.core.abort.abort();
    }

    /// One allgather of host memory through the communicator's compressed Allgather
    /// (compressed where it pays, raw otherwise), after every device-memory call queued
    /// before it (calls run in the order they were made, as NCCL's do). `key` names the
    /// tensor for the cache-slot choice (None: inferred from the buffer addresses); results
    /// never depend on it.
    pub fn all_gather(
        &self,
        bufs: GatherBuffers<'_>,
        count: usize,
        dtype: DType,
        key: Option<u64>,
    ) -> Result<(), Failure> {
        if let Some(q) = lock(&self.device).as_ref() {
            q.wait_idle();
        }
        let in_place = matches!(bufs, GatherBuffers::InPlace { .. });
        self.core
            .gather(bufs, count, dtype, &GatherOptions::keyed(key), in_place)
    }

    /// One allgather of device memory, NCCL's way: queued on `stream` (the caller's
    /// `CUstream`) and returned at once; later work on the stream sees the result. Errors
    /// found here (arguments, a broken communicator) are returned; those of the exchange
    /// itself become the communicator's async error (`cieraCommGetAsyncError`).
    ///
    /// # Safety
    /// `send`/`recv` are device memory of the current CUDA context, sized as NCCL's
    /// ncclAllGather requires, untouched by other work until the call's work on `stream` is
    /// done; `stream` is a live stream of that context (or NULL, the default stream).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_gather_device(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DType,
        key: Option<u64>,
        stream: *mut c_void,
    ) -> Result<(), Failure> {
        let checked = check_buffers(send, recv, count, dtype, self.rank(), self.size())?;
        if let Some((code, message)) = self.async_error() {
            return Err(Failure {
                code,
                message: format!("the communicator failed earlier: {message}"),
            });
        }
        let mut q = lock(&self.device);
        if q.is_none() {
            *q = Some(DeviceQueue::start(self.core.clone())?);
        }
        let job = DeviceCall {
            send: send as u64,
            recv: recv as u64,
            count,
            dtype,
            key,
            checked,
        };
        q.as_mut()
            .expect("started above")
            .enqueue(job, StreamRef(stream as usize))
    }
}

impl Core {
    pub(super) fn rank(&self) -> usize {
        self.rank
    }

    pub(super) fn size(&self) -> usize {
        self.nranks
    }

    pub(super) fn async_error(&self) -> Option<(ResultCode, String)> {
        lock(&self.async_error).clone()
    }

    pub(super) fn aborted(&self) -> bool {
        self.abort.is_aborted()
    }

    /// Records a failure that leaves the communicator unusable (the first one stays).
    pub(super) fn fail(&self, failure: &Failure) {
        lock(&self.async_error).get_or_insert((failure.code, failure.message.clone()));
    }

    /// One counted allgather of host buffers through the compressed Allgather.
    pub(super) fn gather(
        &self,
        bufs: GatherBuffers<'_>,
        count: usize,
        dtype: DType,
        opts: &GatherOptions,
        in_place: bool,
    ) -> Result<(), Failure> {
        let (result, compress) = {
            let mut comm = lock(&self.comm);
            let r = match bufs {
                GatherBuffers::InPlace { recv } => {
                    comm.all_gather_with(None, recv, count, dtype, opts)
                }
                GatherBuffers::OutOfPlace { send, recv } => {
                    comm.all_gather_with(Some(send), recv, count, dtype, opts)
                }
            };
            (r, (comm.compress_stats(), comm.shared_read_bytes()))
        };
        let mut stats = lock(&self.stats);
        (stats.compress, stats.shared_read_bytes) = compress;
        match result {
            Ok(_) => {
                stats.calls += 1;
                stats.in_place_calls += in_place as u64;
                Ok(())
            }
            Err(e) => {
                stats.failed_calls += 1;
                let failure = Failure::from(e);
                // Argument errors leave the communicator usable; anything from the exchange
                // itself (a peer, the transport, an abort, a timeout) breaks it.
                if failure.code != ResultCode::InvalidArgument {
                    self.fail(&failure);
                }
                Err(failure)
            }
        }
    }

    /// Counts a call that did not go through [`Core::gather`] (the device path's IPC calls).
    pub(super) fn count_call(&self, in_place: bool) {
        let mut stats = lock(&self.stats);
        stats.calls += 1;
        stats.in_place_calls += in_place as u64;
    }

    /// An uncounted raw allgather of small host records (the device path's handshakes).
    pub(super) fn exchange(&self, mine: &[u8]) -> Result<Vec<u8>, Failure> {
        let mut all = vec![0u8; mine.len() * self.nranks];
        let r = lock(&self.comm).all_gather(mine, &mut all, mine.len(), DType::U8);
        r.map_err(|e| {
            let f = Failure::from(e);
            self.fail(&f);
            f
        })?;
        Ok(all)
    }

    /// Whether every rank is on this host (CUDA IPC can reach them all).
    pub(super) fn single_host(&self) -> bool {
        lock(&self.comm).topology().hosts() == 1
    }
}
