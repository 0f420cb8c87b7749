//! The `extern "C"` entry points of `libciera.so`. Each runs its body through [`entry`]: a
//! panic is caught and reported as `cieraInternalError`, a failure's message is kept for
//! `cieraGetLastError`, and the result code is returned.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::abi::{
    error_cstr, resolve_config, CConfig, CStats, CUniqueId, Failure, ResultCode, API_MAGIC,
    UNIQUE_ID_BYTES, VERSIONED_HEADER_BYTES, VERSION_CODE,
};
use super::live::{gather_buffers, LiveComm};
use super::registry::{live, register, unregister};
use crate::comm::{Communicator, UniqueId};
use crate::DType;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    // An interior NUL would truncate the C string; replace it rather than lose the message.
    let c = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|slot| *slot.borrow_mut() = c);
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Runs the body of entry point `name`: catches panics, records the message of a failure for
/// `cieraGetLastError`, returns the result code.
pub(super) fn entry(name: &'static str, body: impl FnOnce() -> Result<(), Failure>) -> c_int {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => ResultCode::Success as c_int,
        Ok(Err(f)) => {
            set_last_error(&format!("{name}: {}", f.message));
            f.code as c_int
        }
        Err(payload) => {
            let msg = panic_message(payload.as_ref());
            set_last_error(&format!("{name}: internal error (panic: {msg})"));
            ResultCode::InternalError as c_int
        }
    }
}

fn datatype(code: c_int) -> Result<DType, Failure> {
    u8::try_from(code)
        .ok()
        .and_then(DType::from_code)
        .ok_or_else(|| {
            Failure::invalid_argument(format!(
                "datatype {code} is not a cieraDataType_t (0..{})",
                DType::ALL.len() - 1
            ))
        })
}

fn nranks_rank(nranks: c_int, rank: c_int) -> Result<(usize, usize), Failure> {
    if nranks < 1 {
        return Err(Failure::invalid_argument(format!(
            "nranks is {nranks}; must be >= 1"
        )));
    }
    if rank < 0 || rank >= nranks {
        return Err(Failure::invalid_argument(format!(
            "rank is {rank}; must be in 0..{}",
            nranks - 1
        )));
    }
    Ok((nranks as usize, rank as usize))
}

// ---- the entry points ---------------------------------------------------------------------------

/// # Safety
/// `version` is NULL (an error) or points to a writable `int`.
#[no_mangle]
pub unsafe extern "C" fn cieraGetVersion(version: *mut c_int) -> c_int {
    entry("cieraGetVersion", || {
        if version.is_null() {
            return Err(Failure::invalid_argument("version is NULL"));
        }
        // SAFETY: non-null, and the caller passes a writable int.
        unsafe { version.write(VERSION_CODE) };
        Ok(())
    })
}

/// Makes a new job id and starts its rendezvous root (a thread of this process), which serves
/// one job and waits at most `CIERA_TIMEOUT` for its ranks.
///
/// # Safety
/// `unique_id` is NULL (an error) or points to a writable `cieraUniqueId`.
#[no_mangle]
pub unsafe extern "C" fn cieraGetUniqueId(unique_id: *mut CUniqueId) -> c_int {
    entry("cieraGetUniqueId", || {
        if unique_id.is_null() {
            return Err(Failure::invalid_argument("uniqueId is NULL"));
        }
        let id = UniqueId::new()?;
        let mut out = CUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        for (o, b) in out.internal.iter_mut().zip(id.as_bytes()) {
            *o = *b as c_char;
        }
        // SAFETY: non-null, and the caller passes a writable cieraUniqueId.
        unsafe { unique_id.write(out) };
        Ok(())
    })
}

/// # Safety
/// `comm` is NULL (an error) or writable; `config` is NULL or a `cieraConfig_t` set up with
/// `CIERA_CONFIG_INITIALIZER` (its `size` bytes readable).
#[no_mangle]
pub unsafe extern "C" fn cieraCommInitRankConfig(
    comm: *mut *mut c_void,
    nranks: c_int,
    unique_id: CUniqueId,
    rank: c_int,
    config: *const CConfig,
) -> c_int {
    entry("cieraCommInitRankConfig", || {
        // SAFETY: forwarded caller contract.
        unsafe { init_rank(comm, nranks, unique_id, rank, config) }
    })
}

/// # Safety
/// `comm` is NULL (an error) or writable.
#[no_mangle]
pub unsafe extern "C" fn cieraCommInitRank(
    comm: *mut *mut c_void,
    nranks: c_int,
    unique_id: CUniqueId,
    rank: c_int,
) -> c_int {
    entry("cieraCommInitRank", || {
        // SAFETY: forwarded caller contract; a NULL config is allowed.
        unsafe { init_rank(comm, nranks, unique_id, rank, std::ptr::null()) }
    })
}

/// # Safety
/// As [`cieraCommInitRankConfig`].
unsafe fn init_rank(
    comm: *mut *mut c_void,
    nranks: c_int,
    unique_id: CUniqueId,
    rank: c_int,
    config: *const CConfig,
) -> Result<(), Failure> {
    if comm.is_null() {
        return Err(Failure::invalid_argument(
            "comm (the output pointer) is NULL",
        ));
    }
    // SAFETY: non-null and writable by contract; NULL until a communicator exists.
    unsafe { comm.write(std::ptr::null_mut()) };
    let (nranks, rank) = nranks_rank(nranks, rank)?;
    let mut bytes = [0u8; UNIQUE_ID_BYTES];
    for (b, c) in bytes.iter_mut().zip(unique_id.internal) {
        *b = c as u8;
    }
    let id = UniqueId::from_bytes(&bytes)
        .map_err(|e| Failure::invalid_argument(format!("commId: {e}")))?;
    // SAFETY: forwarded caller contract for `config`.
    let config = unsafe { resolve_config(config) }?;
    let live = LiveComm::init_rank(&id, nranks, rank, config)?;
    // SAFETY: as above.
    unsafe { comm.write(register(live)) };
    Ok(())
}

/// Joins the job a launcher describes in the environment (`ciera launch`, mpirun, srun,
/// torchrun; see `Communicator::from_env`). An extension: NCCL has no such call.
///
/// # Safety
/// `comm` is NULL (an error) or writable; `config` as for [`cieraCommInitRankConfig`].
#[no_mangle]
pub unsafe extern "C" fn cieraCommInitFromEnv(
    comm: *mut *mut c_void,
    config: *const CConfig,
) -> c_int {
    entry("cieraCommInitFromEnv", || {
        if comm.is_null() {
            return Err(Failure::invalid_argument(
                "comm (the output pointer) is NULL",
            ));
        }
        // SAFETY: non-null and writable by contract.
        unsafe { comm.write(std::ptr::null_mut()) };
        // SAFETY: forwarded caller contract for `config`.
        let config = unsafe { resolve_config(config) }?;
        let c = Communicator::from_env(config)?;
        // SAFETY: as above.
        unsafe { comm.write(register(LiveComm::new(c))) };
        Ok(())
    })
}

/// # Safety
/// Buffers as [`gather_buffers`] requires (host memory, sized by `sendcount`, `datatype` and
/// the communicator's size), or NULL (an error unless `sendcount` is 0); or, both device
/// memory, as [`LiveComm::all_gather_device`] requires, with `stream` a live stream.
unsafe fn all_gather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    comm: *mut c_void,
    key: Option<u64>,
    stream: *mut c_void,
) -> Result<(), Failure> {
    let live = live(comm)?;
    let dtype = datatype(dtype)?;
    if super::device::on_device(send, recv)? {
        // SAFETY: forwarded caller contract (device memory, a live stream).
        return unsafe { live.all_gather_device(send, recv, count, dtype, key, stream) };
    }
    // SAFETY: forwarded caller contract.
    let bufs = unsafe { gather_buffers(send, recv, count, dtype, live.rank(), live.size()) }?;
    live.all_gather(bufs, count, dtype, key)
}

/// `ncclAllGather`'s contract. Host memory: returns when the gather is complete (`stream` is
/// ignored). Device memory (both buffers): the gather is queued on `stream` and the call
/// returns; work queued on `stream` afterwards sees the result; failures of the exchange are
/// reported by `cieraCommGetAsyncError`.
///
/// # Safety
/// `sendbuff` readable for `sendcount` elements, `recvbuff` writable for `nranks*sendcount`
/// elements of `datatype`, untouched by others during the call (for device memory: until the
/// stream's work reaches past it); in place when `sendbuff == recvbuff + rank*sendcount*size`,
/// otherwise not overlapping (checked); `stream` a live `CUstream` of the current context (or
/// NULL) when the buffers are device memory.
#[no_mangle]
pub unsafe extern "C" fn cieraAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    entry("cieraAllGather", || {
        // SAFETY: forwarded caller contract.
        unsafe { all_gather(sendbuff, recvbuff, sendcount, datatype, comm, None, stream) }
    })
}

/// As [`cieraAllGather`], with `key` naming the tensor (the same key every iteration for the
/// same tensor) so the cache slot it compresses against is chosen by name, not by call order.
/// Results never depend on the key.
///
/// # Safety
/// As [`cieraAllGather`].
#[no_mangle]
pub unsafe extern "C" fn cieraAllGatherKeyed(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: c_int,
    key: u64,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    entry("cieraAllGatherKeyed", || {
        // SAFETY: forwarded caller contract.
        unsafe {
            all_gather(
                sendbuff,
                recvbuff,
                sendcount,
                datatype,
                comm,
                Some(key),
                stream,
            )
        }
    })
}

/// Aborts the communicator's collective in flight (other threads' calls return
/// `cieraRemoteError`, peers are told), and frees the handle.
#[no_mangle]
pub extern "C" fn cieraCommAbort(comm: *mut c_void) -> c_int {
    entry("cieraCommAbort", || {
        if comm.is_null() {
            return Ok(());
        }
        let live = unregister(comm)?;
        live.abort();
        Ok(())
    })
}

/// Frees the handle (the communicator goes once a call still running on it returns). NULL is
/// a no-op, as with NCCL.
#[no_mangle]
pub extern "C" fn cieraCommDestroy(comm: *mut c_void) -> c_int {
    entry("cieraCommDestroy", || {
        if comm.is_null() {
            return Ok(());
        }
        unregister(comm).map(drop)
    })
}

/// # Safety
/// `async_error` is NULL (an error) or points to a writable `cieraResult_t`.
#[no_mangle]
pub unsafe extern "C" fn cieraCommGetAsyncError(
    comm: *mut c_void,
    async_error: *mut c_int,
) -> c_int {
    entry("cieraCommGetAsyncError", || {
        if async_error.is_null() {
            return Err(Failure::invalid_argument("asyncError is NULL"));
        }
        let live = live(comm)?;
        let code = match live.async_error() {
            Some((code, message)) => {
                // cieraGetLastError then says what broke the communicator.
                set_last_error(&message);
                code
            }
            None => ResultCode::Success,
        };
        // SAFETY: non-null, writable by contract.
        unsafe { async_error.write(code as c_int) };
        Ok(())
    })
}

/// # Safety
/// `count` is NULL (an error) or points to a writable `int`.
#[no_mangle]
pub unsafe extern "C" fn cieraCommCount(comm: *mut c_void, count: *mut c_int) -> c_int {
    entry("cieraCommCount", || {
        if count.is_null() {
            return Err(Failure::invalid_argument("count is NULL"));
        }
        let live = live(comm)?;
        // SAFETY: non-null, writable by contract. A size was an int when it came in.
        unsafe { count.write(live.size() as c_int) };
        Ok(())
    })
}

/// # Safety
/// `rank` is NULL (an error) or points to a writable `int`.
#[no_mangle]
pub unsafe extern "C" fn cieraCommUserRank(comm: *mut c_void, rank: *mut c_int) -> c_int {
    entry("cieraCommUserRank", || {
        if rank.is_null() {
            return Err(Failure::invalid_argument("rank is NULL"));
        }
        let live = live(comm)?;
        // SAFETY: non-null, writable by contract.
        unsafe { rank.write(live.rank() as c_int) };
        Ok(())
    })
}

/// Fills `stats` up to its `size` (set by `CIERA_STATS_INITIALIZER`); `size`, `magic` and
/// `version` are left as the caller set them.
///
/// # Safety
/// `stats` is NULL (an error) or points to a `cieraStats_t` whose `size` bytes are writable.
#[no_mangle]
pub unsafe extern "C" fn cieraCommGetStats(comm: *mut c_void, stats: *mut CStats) -> c_int {
    entry("cieraCommGetStats", || {
        if stats.is_null() {
            return Err(Failure::invalid_argument("stats is NULL"));
        }
        // SAFETY: the header is readable by contract; unaligned reads cope with any alignment.
        let size = unsafe { std::ptr::read_unaligned(stats as *const usize) };
        // SAFETY: the magic follows `size` in the header.
        let magic = unsafe {
            std::ptr::read_unaligned(
                (stats as *const u8).add(std::mem::size_of::<usize>()) as *const u32
            )
        };
        if magic != API_MAGIC {
            return Err(Failure::invalid_argument(format!(
                "stats: magic is {magic:#010x}, not CIERA_API_MAGIC; initialize it with CIERA_STATS_INITIALIZER"
            )));
        }
        if !(VERSIONED_HEADER_BYTES..=(1 << 20)).contains(&size) {
            return Err(Failure::invalid_argument(format!(
                "stats: size field is {size}; expected sizeof(cieraStats_t)"
            )));
        }
        let live = live(comm)?;
        let c = live.stats().to_c();
        let n = size.min(std::mem::size_of::<CStats>());
        // SAFETY: the caller's struct has `size >= n` writable bytes; copy only past its header
        // (which stays as the caller set it); `c` is a distinct local.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&c as *const CStats as *const u8).add(VERSIONED_HEADER_BYTES),
                (stats as *mut u8).add(VERSIONED_HEADER_BYTES),
                n - VERSIONED_HEADER_BYTES,
            )
        };
        Ok(())
    })
}

/// A static string for `result`.
#[no_mangle]
pub extern "C" fn cieraGetErrorString(result: c_int) -> *const c_char {
    error_cstr(result).as_ptr() as *const c_char
}

/// The message of the last call on this thread that failed ("" if none). Valid until the next
/// failing call on this thread. `comm` is accepted for NCCL's signature and may be NULL.
#[no_mangle]
pub extern "C" fn cieraGetLastError(_comm: *mut c_void) -> *const c_char {
    match catch_unwind(|| LAST_ERROR.with(|slot| slot.borrow().as_ptr())) {
        Ok(p) => p,
        Err(_) => c"".as_ptr(),
    }
}
