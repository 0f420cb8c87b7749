//! A communicator as the C ABI and the interposers hold it ([`LiveComm`]), and the checks that
//! turn an allgather's C pointers into slices ([`gather_buffers`]).

use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

use super::abi::{CStats, API_MAGIC, STATS_VERSION};
use super::abi::{Failure, ResultCode};
use crate::comm::{AbortHandle, Communicator, Config, UniqueId};
use crate::compress::{CompressConfig, Stats as CompressStats};
use crate::gpu::driver;
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
    if total == 0 {
        // Nothing is read or written; NULL is fine here (as with NCCL).
        return Ok(if std::ptr::eq(send, recv) {
            GatherBuffers::InPlace { recv: &mut [] }
        } else {
            GatherBuffers::OutOfPlace {
                send: &[],
                recv: &mut [],
            }
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
    let (r, s) = (recv as usize, send as usize);
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
    for (name, p) in [("sendbuff", send), ("recvbuff", recv as *const c_void)] {
        if driver::classify(p) != Location::Host {
            return Err(Failure::invalid_argument(format!(
                "{name} {p:p} is CUDA device or managed memory; this build gathers host memory only"
            )));
        }
    }
    if s == r + rank * block {
        // SAFETY: non-null, `total` bytes writable for 'a and unaliased (caller's contract).
        let recv = unsafe { std::slice::from_raw_parts_mut(recv as *mut u8, total) };
        return Ok(GatherBuffers::InPlace { recv });
    }
    if s < r + total && r < s + block {
        return Err(Failure::invalid_argument(format!(
            "sendbuff {send:p} ({block} bytes) overlaps recvbuff {recv:p} ({total} bytes) but is not the in-place \
             position recvbuff + rank*sendcount*size = {:#x}",
            r + rank * block
        )));
    }
    // SAFETY: both non-null, sized as the caller's contract says, and disjoint (checked above),
    // so the shared and the mutable slice do not alias.
    let (send, recv) = unsafe {
        (
            std::slice::from_raw_parts(send as *const u8, block),
            std::slice::from_raw_parts_mut(recv as *mut u8, total),
        )
    };
    Ok(GatherBuffers::OutOfPlace { send, recv })
}

/// A communicator as the C ABI and the interposers hold it: the `Communicator` behind a lock
/// (one collective at a time), with what other threads may ask while a collective runs (abort,
/// async error, statistics) outside that lock.
pub struct LiveComm {
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
            abort: comm.abort_handle(),
            rank: comm.rank(),
            nranks: comm.size(),
            compress_config: comm.config().compress.clone(),
            comm: Mutex::new(comm),
            stats: Mutex::new(CallStats::default()),
            async_error: Mutex::new(None),
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
        self.rank
    }

    pub fn size(&self) -> usize {
        self.nranks
    }

    pub fn compress_config(&self) -> &CompressConfig {
        &self.compress_config
    }

    pub fn stats(&self) -> CallStats {
        lock(&self.stats).clone()
    }

    pub fn async_error(&self) -> Option<(ResultCode, String)> {
        lock(&self.async_error).clone()
    }

    pub fn abort(&self) {
        self.abort.abort();
    }

    /// One allgather through the communicator's compressed Allgather (compressed where it
    /// pays, raw otherwise). `key` names the tensor for the cache-slot choice (None: inferred
    /// from the buffer addresses); results never depend on it.
    pub fn all_gather(
        &self,
        bufs: GatherBuffers<'_>,
        count: usize,
        dtype: DType,
        key: Option<u64>,
    ) -> Result<(), Failure> {
        let in_place = matches!(bufs, GatherBuffers::InPlace { .. });
        let (result, compress) = {
            let mut comm = lock(&self.comm);
            let r = match bufs {
                GatherBuffers::InPlace { recv } => {
                    comm.all_gather_keyed(None, recv, count, dtype, key)
                }
                GatherBuffers::OutOfPlace { send, recv } => {
                    comm.all_gather_keyed(Some(send), recv, count, dtype, key)
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
                    lock(&self.async_error).get_or_insert((failure.code, failure.message.clone()));
                }
                Err(failure)
            }
        }
    }
}
