//! The C ABI of `libciera.so`, declared for C callers by `include/ciera.h` (hand-kept; the test
//! `tests/capi_c.rs` compiles a C program against it and compares every enum value, struct size
//! and field offset with this file).
//!
//! The shape follows NCCL's: `cieraResult_t` numbers are `ncclResult_t`'s, `cieraDataType_t`
//! numbers are `ncclDataType_t`'s, communicators are opaque handles, `cieraConfig_t` and
//! `cieraStats_t` are versioned structs (size, magic, version, then fields) that a newer header
//! may grow at the end.
//!
//! What every entry point guarantees:
//! - no panic crosses the ABI (`catch_unwind`; a panic is `cieraInternalError` with its message);
//! - every pointer is checked for NULL and every number for range, and the error message
//!   (`cieraGetLastError`) names the argument;
//! - communicator handles are looked up in a registry of live communicators, so a destroyed,
//!   aborted or made-up handle is `cieraInvalidUsage`, not undefined behaviour. Handles are
//!   never reused and lie outside the user-space address range, so a stale handle cannot alias
//!   a new communicator and dereferencing one faults at once.
//!
//! Memory: all buffers are host memory, and every collective has completed when it returns.
//! The `stream` argument exists so that the signatures match NCCL's; it is ignored. A pointer
//! that the CUDA driver (if this process has loaded it) reports as device or managed memory is
//! refused with `cieraInvalidArgument`.
//!
//! The interposers (`interpose/nccl`, `interpose/mpi`) reuse [`LiveComm`], [`gather_buffers`]
//! and [`cuda`] from here; they do not go through the `extern "C"` functions.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use ciera_transport::TransportChoice;

use crate::comm::{AbortHandle, Communicator, Config, UniqueId};
use crate::compress::{CompressConfig, CompressMode, Compressor, Stats as CompressStats};
use crate::error::{Error, ResultCode};
use crate::DType;

// ---- constants shared with include/ciera.h ------------------------------------------------

pub const VERSION_MAJOR: c_int = 0;
pub const VERSION_MINOR: c_int = 1;
pub const VERSION_PATCH: c_int = 0;
/// `CIERA_VERSION_CODE`: major*10000 + minor*100 + patch (NCCL's scheme since 2.9).
pub const VERSION_CODE: c_int = VERSION_MAJOR * 10000 + VERSION_MINOR * 100 + VERSION_PATCH;
/// `CIERA_API_MAGIC`, "CIER": marks a `cieraConfig_t` / `cieraStats_t` set up by its initializer.
pub const API_MAGIC: u32 = 0x4349_4552;
/// `CIERA_CONFIG_UNDEF_INT`: a config field left at this value takes the environment's or the
/// default value.
pub const CONFIG_UNDEF_INT: c_int = c_int::MIN;
pub const UNIQUE_ID_BYTES: usize = crate::comm::id::UNIQUE_ID_BYTES;

/// `cieraCompression_t`.
pub const COMPRESSION_AUTO: c_int = 0;
pub const COMPRESSION_ON: c_int = 1;
pub const COMPRESSION_OFF: c_int = 2;
/// `cieraTransport_t`.
pub const TRANSPORT_AUTO: c_int = 0;
pub const TRANSPORT_SHM: c_int = 1;
pub const TRANSPORT_TCP: c_int = 2;

/// `cieraUniqueId`: 128 opaque bytes, passed by value like `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUniqueId {
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// `cieraConfig_t` (version 1). Fields a caller's (older, smaller) struct lacks count as
/// undefined; bytes past the fields known here (a newer header) are not read.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CConfig {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    /// Milliseconds any wait may make no progress before failing (`CIERA_TIMEOUT` otherwise).
    pub timeout_ms: c_int,
    /// `cieraCompression_t` (`CIERA_COMPRESS`).
    pub compression: c_int,
    /// Memory all cache slots of the communicator may use, MiB (`CIERA_CACHE_MB`).
    pub cache_budget_mb: c_int,
    /// `cieraTransport_t` (`CIERA_TRANSPORT` otherwise).
    pub transport: c_int,
    /// 1: compare a hash of every decoded shard with the sender's (`CIERA_VERIFY`); 0: don't.
    pub verify: c_int,
}

/// `cieraStats_t` (version 1), filled by `cieraCommGetStats` up to the caller's `size`. The
/// call and byte counts of the compressor are `ciera::compress::Stats`'s.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CStats {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    /// AllGather calls that completed successfully.
    pub calls: u64,
    /// Of those, how many were in place.
    pub in_place_calls: u64,
    /// Calls that returned an error after their arguments were accepted.
    pub failed_calls: u64,
    /// Calls that travelled uncompressed (type, size, algorithm, budget or back-off said so).
    pub raw_calls: u64,
    /// Compressed-path calls that filled the caches (values in frames).
    pub fill_calls: u64,
    /// Calls sent as deltas against last iteration's caches.
    pub delta_calls: u64,
    /// Frames that did not decode (or verify) and were redone raw.
    pub repairs: u64,
    /// Bytes of the gathered tensors (nranks * sendcount * size per call).
    pub raw_bytes: u64,
    /// Bytes that stood for them on the wire (frames, or the values for raw calls).
    pub wire_bytes: u64,
    /// Memory the caches hold now.
    pub cache_bytes: u64,
    /// Time spent encoding and decoding on this rank, nanoseconds.
    pub encode_ns: u64,
    pub decode_ns: u64,
}

pub const CONFIG_VERSION: u32 = 1;
pub const STATS_VERSION: u32 = 1;
/// The size/magic/version header every versioned struct starts with.
const VERSIONED_HEADER_BYTES: usize = std::mem::size_of::<usize>() + 8;

// ---- failures: a result code and a message --------------------------------------------------

/// What a failed entry point returns: the code, and the message `cieraGetLastError` gives.
#[derive(Debug)]
pub struct Failure {
    pub code: ResultCode,
    pub message: String,
}

impl Failure {
    pub fn invalid_argument(message: impl Into<String>) -> Failure {
        Failure {
            code: ResultCode::InvalidArgument,
            message: message.into(),
        }
    }

    pub fn invalid_usage(message: impl Into<String>) -> Failure {
        Failure {
            code: ResultCode::InvalidUsage,
            message: message.into(),
        }
    }

    pub fn internal(message: impl Into<String>) -> Failure {
        Failure {
            code: ResultCode::InternalError,
            message: message.into(),
        }
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure {
            code: e.code(),
            message: e.to_string(),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, error_string(self.code as c_int))
    }
}

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
fn entry(name: &'static str, body: impl FnOnce() -> Result<(), Failure>) -> c_int {
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

/// `cieraGetErrorString`'s strings; static, NUL-terminated.
fn error_cstr(code: c_int) -> &'static [u8] {
    match code {
        0 => b"no error\0",
        1 => b"unhandled cuda error (call cieraGetLastError for details)\0",
        2 => b"unhandled system error (network, file or timeout; call cieraGetLastError for details)\0",
        3 => b"internal error - please report this issue to the CIERA developers\0",
        4 => b"invalid argument (call cieraGetLastError for details)\0",
        5 => b"invalid usage (call cieraGetLastError for details)\0",
        6 => b"remote process exited, failed or sent corrupt data (call cieraGetLastError for details)\0",
        7 => b"operation in progress\0",
        _ => b"unknown result code\0",
    }
}

pub fn error_string(code: c_int) -> &'static str {
    let b = error_cstr(code);
    std::str::from_utf8(&b[..b.len() - 1]).unwrap_or("unknown result code")
}

// ---- options and configuration ----------------------------------------------------------------

fn read_field(cfg: &CConfig, offset: usize, value: c_int) -> Option<c_int> {
    // A field beyond the caller's `size` is absent from its (older) struct: undefined.
    let present = cfg.size >= offset + std::mem::size_of::<c_int>();
    (present && value != CONFIG_UNDEF_INT).then_some(value)
}

/// `Config::from_env()` and `CompressConfig::from_env()`, overridden by the fields of `cfg`
/// that are set (timeoutMs, transport; compression, cacheBudgetMB, verify).
///
/// # Safety
/// `cfg` is NULL or points to at least `VERSIONED_HEADER_BYTES` readable bytes whose `size`
/// field says how many bytes of a `cieraConfig_t` are readable there.
pub unsafe fn resolve_config(cfg: *const CConfig) -> Result<(Config, CompressConfig), Failure> {
    let mut config =
        Config::from_env().map_err(|e| Failure::invalid_argument(format!("environment: {e}")))?;
    let mut options = CompressConfig::from_env()
        .map_err(|e| Failure::invalid_argument(format!("environment: {e}")))?;
    if cfg.is_null() {
        return Ok((config, options));
    }
    // Copy only the bytes the caller vouches for (its `size`), so a shorter, older struct is
    // never read past its end.
    // SAFETY: the caller guarantees the header is readable; `read_unaligned` copes with any
    // alignment.
    let header_size = unsafe { std::ptr::read_unaligned(cfg as *const usize) };
    // SAFETY: as above, the magic follows `size` inside the header.
    let magic = unsafe {
        std::ptr::read_unaligned((cfg as *const u8).add(std::mem::size_of::<usize>()) as *const u32)
    };
    if magic != API_MAGIC {
        return Err(Failure::invalid_argument(format!(
            "config: magic is {magic:#010x}, not CIERA_API_MAGIC {API_MAGIC:#010x}; initialize it with CIERA_CONFIG_INITIALIZER"
        )));
    }
    if !(VERSIONED_HEADER_BYTES..=(1 << 20)).contains(&header_size) {
        return Err(Failure::invalid_argument(format!(
            "config: size field is {header_size}; expected sizeof(cieraConfig_t) (set by CIERA_CONFIG_INITIALIZER)"
        )));
    }
    let mut c = CConfig {
        size: header_size,
        magic,
        version: 0,
        timeout_ms: CONFIG_UNDEF_INT,
        compression: CONFIG_UNDEF_INT,
        cache_budget_mb: CONFIG_UNDEF_INT,
        transport: CONFIG_UNDEF_INT,
        verify: CONFIG_UNDEF_INT,
    };
    let n = header_size.min(std::mem::size_of::<CConfig>());
    // SAFETY: the caller's struct has `header_size >= n` readable bytes; `c` is a local of at
    // least `n` bytes; the two do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(cfg as *const u8, &mut c as *mut CConfig as *mut u8, n)
    };
    c.size = header_size;

    use std::mem::offset_of;
    if let Some(ms) = read_field(&c, offset_of!(CConfig, timeout_ms), c.timeout_ms) {
        if ms <= 0 {
            return Err(Failure::invalid_argument(format!(
                "config.timeoutMs is {ms}; must be > 0"
            )));
        }
        config.timeout = Duration::from_millis(ms as u64);
    }
    if let Some(v) = read_field(&c, offset_of!(CConfig, compression), c.compression) {
        options.mode = match v {
            COMPRESSION_AUTO => CompressMode::Auto,
            COMPRESSION_ON => CompressMode::On,
            COMPRESSION_OFF => CompressMode::Off,
            _ => {
                return Err(Failure::invalid_argument(format!(
                    "config.compression is {v}; expected cieraCompressionAuto (0), On (1), Off (2) or CIERA_CONFIG_UNDEF_INT"
                )))
            }
        };
    }
    if let Some(v) = read_field(&c, offset_of!(CConfig, cache_budget_mb), c.cache_budget_mb) {
        if v < 0 {
            return Err(Failure::invalid_argument(format!(
                "config.cacheBudgetMB is {v}; must be >= 0"
            )));
        }
        options.cache_bytes = (v as usize) << 20;
    }
    if let Some(v) = read_field(&c, offset_of!(CConfig, transport), c.transport) {
        config.transport = match v {
            TRANSPORT_AUTO => TransportChoice::Auto,
            TRANSPORT_SHM => TransportChoice::Shm,
            TRANSPORT_TCP => TransportChoice::Tcp,
            _ => {
                return Err(Failure::invalid_argument(format!(
                    "config.transport is {v}; expected cieraTransportAuto (0), Shm (1), Tcp (2) or CIERA_CONFIG_UNDEF_INT"
                )))
            }
        };
    }
    if let Some(v) = read_field(&c, offset_of!(CConfig, verify), c.verify) {
        options.verify = match v {
            0 => false,
            1 => true,
            _ => {
                return Err(Failure::invalid_argument(format!(
                    "config.verify is {v}; expected 0, 1 or CIERA_CONFIG_UNDEF_INT"
                )))
            }
        };
    }
    Ok((config, options))
}

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
             {} B on the wire, ratio {:.3}; {} repairs; {} B read from peers' shared buffers)",
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
            self.shared_read_bytes
        )
    }

    fn to_c(&self) -> CStats {
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
        if cuda::classify(p) != cuda::MemoryKind::Host {
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

/// A communicator as the C ABI and the interposers hold it: the `Communicator` and its
/// `Compressor` behind a lock (one collective at a time), with what other threads may ask while
/// a collective runs (abort, async error, statistics) outside that lock.
pub struct LiveComm {
    engine: Mutex<Engine>,
    abort: AbortHandle,
    rank: usize,
    nranks: usize,
    compress_config: CompressConfig,
    stats: Mutex<CallStats>,
    /// Set when a collective failed in a way that leaves the communicator unusable.
    async_error: Mutex<Option<(ResultCode, String)>>,
}

struct Engine {
    comm: Communicator,
    compressor: Compressor,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks is caught at the ABI; what they guard stays
    // usable (counters; a communicator whose failed call marked it broken), so keep going.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl LiveComm {
    pub fn new(comm: Communicator, compress_config: CompressConfig) -> Arc<LiveComm> {
        Arc::new(LiveComm {
            abort: comm.abort_handle(),
            rank: comm.rank(),
            nranks: comm.size(),
            engine: Mutex::new(Engine {
                comm,
                compressor: Compressor::new(compress_config.clone()),
            }),
            compress_config,
            stats: Mutex::new(CallStats::default()),
            async_error: Mutex::new(None),
        })
    }

    pub fn init_rank(
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        config: Config,
        compress_config: CompressConfig,
    ) -> Result<Arc<LiveComm>, Failure> {
        let comm = Communicator::init_rank(id, nranks, rank, config)?;
        Ok(LiveComm::new(comm, compress_config))
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

    /// One allgather through the compressor (compressed where it pays, raw otherwise). `key`
    /// names the tensor for the cache-slot choice (None: inferred from the buffer addresses);
    /// results never depend on it. The one place that calls into `compress::Compressor`: if
    /// the compressor moves into `Communicator` (an `all_gather_keyed` and a `stats()`), only
    /// this function and `Engine` change.
    pub fn all_gather(
        &self,
        bufs: GatherBuffers<'_>,
        count: usize,
        dtype: DType,
        key: Option<u64>,
    ) -> Result<(), Failure> {
        let in_place = matches!(bufs, GatherBuffers::InPlace { .. });
        let (result, compress) = {
            let mut engine = lock(&self.engine);
            let Engine { comm, compressor } = &mut *engine;
            let r = match bufs {
                GatherBuffers::InPlace { recv } => {
                    compressor.all_gather(comm, None, recv, count, dtype, key)
                }
                GatherBuffers::OutOfPlace { send, recv } => {
                    compressor.all_gather(comm, Some(send), recv, count, dtype, key)
                }
            };
            (r, (compressor.stats(), comm.shared_read_bytes()))
        };
        let mut stats = lock(&self.stats);
        (stats.compress, stats.shared_read_bytes) = compress;
        match result {
            Ok(()) => {
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

/// Live communicators by handle. Handles are `HANDLE_TAG | id << 4` with `id` counting up from
/// 1 and never reused: above the canonical user-space range (so no real pointer equals one),
/// and an id below the counter that is absent was destroyed.
struct Registry {
    live: HashMap<usize, Arc<LiveComm>>,
}

const HANDLE_TAG: usize = 0x7C1E_0000_0000_0000;
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn registry() -> MutexGuard<'static, Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    lock(REGISTRY.get_or_init(|| {
        Mutex::new(Registry {
            live: HashMap::new(),
        })
    }))
}

fn register(comm: Arc<LiveComm>) -> *mut c_void {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed) as usize;
    let handle = HANDLE_TAG | (id << 4);
    registry().live.insert(handle, comm);
    handle as *mut c_void
}

fn describe_dead_handle(handle: *mut c_void) -> Failure {
    let h = handle as usize;
    let id = (h & !HANDLE_TAG) >> 4;
    if h & HANDLE_TAG == HANDLE_TAG
        && h & 0xF == 0
        && id >= 1
        && (id as u64) < NEXT_ID.load(Ordering::Relaxed)
    {
        Failure::invalid_usage(format!("comm {handle:p} was destroyed or aborted"))
    } else {
        Failure::invalid_usage(format!(
            "comm {handle:p} is not a communicator made by cieraCommInitRank*"
        ))
    }
}

fn live(handle: *mut c_void) -> Result<Arc<LiveComm>, Failure> {
    if handle.is_null() {
        return Err(Failure::invalid_argument("comm is NULL"));
    }
    registry()
        .live
        .get(&(handle as usize))
        .cloned()
        .ok_or_else(|| describe_dead_handle(handle))
}

fn unregister(handle: *mut c_void) -> Result<Arc<LiveComm>, Failure> {
    registry()
        .live
        .remove(&(handle as usize))
        .ok_or_else(|| describe_dead_handle(handle))
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
    let (config, options) = unsafe { resolve_config(config) }?;
    let live = LiveComm::init_rank(&id, nranks, rank, config, options)?;
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
        let (config, options) = unsafe { resolve_config(config) }?;
        let c = Communicator::from_env(config)?;
        // SAFETY: as above.
        unsafe { comm.write(register(LiveComm::new(c, options))) };
        Ok(())
    })
}

/// # Safety
/// Buffers as [`gather_buffers`] requires (host memory, sized by `sendcount`, `datatype` and
/// the communicator's size), or NULL (an error unless `sendcount` is 0).
unsafe fn all_gather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    comm: *mut c_void,
    key: Option<u64>,
) -> Result<(), Failure> {
    let live = live(comm)?;
    let dtype = datatype(dtype)?;
    // SAFETY: forwarded caller contract.
    let bufs = unsafe { gather_buffers(send, recv, count, dtype, live.rank(), live.size()) }?;
    live.all_gather(bufs, count, dtype, key)
}

/// `ncclAllGather`'s contract on host memory: returns when the gather is complete. `stream`
/// is ignored.
///
/// # Safety
/// `sendbuff` readable for `sendcount` elements, `recvbuff` writable for `nranks*sendcount`
/// elements of `datatype`, host memory, untouched by others during the call; in place when
/// `sendbuff == recvbuff + rank*sendcount*size`, otherwise not overlapping (checked).
#[no_mangle]
pub unsafe extern "C" fn cieraAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: c_int,
    comm: *mut c_void,
    _stream: *mut c_void,
) -> c_int {
    entry("cieraAllGather", || {
        // SAFETY: forwarded caller contract.
        unsafe { all_gather(sendbuff, recvbuff, sendcount, datatype, comm, None) }
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
    _stream: *mut c_void,
) -> c_int {
    entry("cieraAllGatherKeyed", || {
        // SAFETY: forwarded caller contract.
        unsafe { all_gather(sendbuff, recvbuff, sendcount, datatype, comm, Some(key)) }
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
        let code = live.async_error().map_or(ResultCode::Success, |(c, _)| c);
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

/// Shared buffers handed out to C callers by address (`cieraMemAlloc`, and the MPI
/// interposer's `MPI_Alloc_mem`), until freed.
pub mod shared_mem {
    use std::collections::HashMap;
    use std::ffi::c_void;
    use std::sync::{Mutex, MutexGuard, OnceLock};

    use crate::comm::Communicator;
    use crate::error::Result;

    fn buffers() -> MutexGuard<'static, HashMap<usize, crate::SharedBuffer>> {
        static BUFFERS: OnceLock<Mutex<HashMap<usize, crate::SharedBuffer>>> = OnceLock::new();
        BUFFERS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// A new zeroed shared buffer of `len` bytes, kept alive until [`free`] of its address.
    pub fn alloc(len: usize) -> Result<*mut c_void> {
        let buf = Communicator::alloc_shared(len)?;
        let p = buf.as_ptr() as *mut c_void;
        buffers().insert(p as usize, buf);
        Ok(p)
    }

    /// Frees the buffer [`alloc`] returned at `p`; false (nothing freed) for any other pointer.
    pub fn free(p: *mut c_void) -> bool {
        buffers().remove(&(p as usize)).is_some()
    }
}

/// Allocates `size` zeroed bytes of host memory that same-host peers copy straight out of
/// when it is a collective's send or receive buffer (`ciera::SharedBuffer`). Free it with
/// `cieraMemFree`. `size` 0 gives a valid, unique pointer to no bytes.
///
/// # Safety
/// `ptr` is NULL (an error) or points to a writable `void*`.
#[no_mangle]
pub unsafe extern "C" fn cieraMemAlloc(ptr: *mut *mut c_void, size: usize) -> c_int {
    entry("cieraMemAlloc", || {
        if ptr.is_null() {
            return Err(Failure::invalid_argument("ptr is NULL"));
        }
        let p = shared_mem::alloc(size).map_err(|e| Failure {
            code: ResultCode::SystemError,
            message: e.to_string(),
        })?;
        // SAFETY: non-null, and the caller passes a writable pointer.
        unsafe { ptr.write(p) };
        Ok(())
    })
}

/// Frees memory from `cieraMemAlloc`. NULL: no-op. Any other pointer (including one freed
/// already) is `cieraInvalidArgument` and frees nothing.
#[no_mangle]
pub extern "C" fn cieraMemFree(ptr: *mut c_void) -> c_int {
    entry("cieraMemFree", || {
        if ptr.is_null() {
            return Ok(());
        }
        if shared_mem::free(ptr) {
            Ok(())
        } else {
            Err(Failure::invalid_argument(format!(
                "ptr {ptr:p} was not returned by cieraMemAlloc (or was freed already)"
            )))
        }
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

// ---- CUDA probing -----------------------------------------------------------------------------

/// What the CUDA driver says about a pointer, asked only if this process has already loaded the
/// driver (`libcuda.so.1`); the library never loads CUDA itself.
/// What both LD_PRELOAD interposers (interpose/nccl, interpose/mpi) share.
pub mod interpose {
    use std::sync::{Mutex, OnceLock};

    /// Whether an environment variable is set to 1 / true / yes.
    pub fn env_flag(name: &str) -> bool {
        std::env::var(name)
            .map(|v| v == "1" || v.eq_ignore_ascii_case("true") || v.eq_ignore_ascii_case("yes"))
            .unwrap_or(false)
    }

    /// `CIERA_DISABLE=1`: the interposer passes every call through (read once per process).
    pub fn disabled() -> bool {
        static DISABLED: OnceLock<bool> = OnceLock::new();
        *DISABLED.get_or_init(|| env_flag("CIERA_DISABLE"))
    }

    /// Print `prefix: msg` to stderr, as one write, the first time `reason` comes up in this
    /// process.
    pub fn log_once(prefix: &str, reason: &'static str, msg: impl FnOnce() -> String) {
        static SEEN: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
        let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
        if !seen.contains(&reason) {
            seen.push(reason);
            let line = format!("{prefix}: {}\n", msg());
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
        }
    }
}

pub mod cuda {
    use std::ffi::{c_int, c_uint, c_void, CStr};
    use std::sync::OnceLock;

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum MemoryKind {
        /// Pageable or pinned host memory: the CPU may read and write it.
        Host,
        /// Device or managed memory.
        Device,
        /// The driver answered with an error that says neither.
        Unknown,
    }

    const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
    const CU_MEMORYTYPE_HOST: c_uint = 1;
    const CUDA_SUCCESS: c_int = 0;
    /// Returned for memory no CUDA context knows (plain malloc).
    const CUDA_ERROR_INVALID_VALUE: c_int = 1;
    const CUDA_ERROR_NOT_INITIALIZED: c_int = 3;
    const CUDA_ERROR_DEINITIALIZED: c_int = 4;

    type PointerGetAttribute = unsafe extern "C" fn(*mut c_void, c_int, u64) -> c_int;
    type StreamSynchronize = unsafe extern "C" fn(*mut c_void) -> c_int;

    type MemAllocHost = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
    type MemFreeHost = unsafe extern "C" fn(*mut c_void) -> c_int;

    struct Driver {
        pointer_get_attribute: PointerGetAttribute,
        stream_synchronize: StreamSynchronize,
        mem_alloc_host: Option<MemAllocHost>,
        mem_free_host: Option<MemFreeHost>,
    }

    fn symbol(handle: *mut c_void, name: &CStr) -> *mut c_void {
        // SAFETY: `handle` came from dlopen and is never closed; `name` is NUL-terminated.
        unsafe { libc::dlsym(handle, name.as_ptr()) }
    }

    /// How many objects the dynamic loader has loaded in this process so far (glibc's
    /// `dlpi_adds`), or None if it does not say.
    fn loads_so_far() -> Option<u64> {
        unsafe extern "C" fn first(
            info: *mut libc::dl_phdr_info,
            size: libc::size_t,
            out: *mut c_void,
        ) -> c_int {
            let needed = std::mem::offset_of!(libc::dl_phdr_info, dlpi_adds)
                + std::mem::size_of::<libc::c_ulonglong>();
            if size >= needed {
                // SAFETY: the loader passes a valid info of `size` bytes, which covers
                // dlpi_adds; `out` is the `Option<u64>` given below.
                unsafe { *(out as *mut Option<u64>) = Some((*info).dlpi_adds) };
            }
            1 // one object is enough: the counter is the same in all
        }
        let mut adds: Option<u64> = None;
        // SAFETY: `first` matches the callback type and writes only through `out`, which
        // points to `adds`, alive for the call.
        unsafe { libc::dl_iterate_phdr(Some(first), &mut adds as *mut Option<u64> as *mut c_void) };
        adds
    }

    fn driver() -> Option<&'static Driver> {
        static DRIVER: OnceLock<Driver> = OnceLock::new();
        /// The loader's count when libcuda was last found absent: until something new is
        /// loaded, it still is (dlopen with RTLD_NOLOAD searches the library path on disk,
        /// ~20 failed openat and ~100 µs per collective on the dev VM when CUDA is absent).
        static ABSENT_AT: std::sync::atomic::AtomicU64 =
            std::sync::atomic::AtomicU64::new(u64::MAX);
        if let Some(d) = DRIVER.get() {
            return Some(d);
        }
        let loads = loads_so_far();
        if loads.is_some_and(|n| n == ABSENT_AT.load(std::sync::atomic::Ordering::Relaxed)) {
            return None;
        }
        // RTLD_NOLOAD: a handle only if the process already has the driver; never load it.
        // SAFETY: a NUL-terminated name; the handle is kept for the process's life.
        let handle = unsafe {
            libc::dlopen(
                c"libcuda.so.1".as_ptr(),
                libc::RTLD_NOLOAD | libc::RTLD_LAZY,
            )
        };
        if handle.is_null() {
            if let Some(n) = loads {
                ABSENT_AT.store(n, std::sync::atomic::Ordering::Relaxed);
            }
            return None;
        }
        let (pga, sync) = (
            symbol(handle, c"cuPointerGetAttribute"),
            symbol(handle, c"cuStreamSynchronize"),
        );
        if pga.is_null() || sync.is_null() {
            return None;
        }
        let (alloc, free) = (
            symbol(handle, c"cuMemAllocHost_v2"),
            symbol(handle, c"cuMemFreeHost"),
        );
        // SAFETY: these driver entry points have had these C signatures since CUDA 4
        // (CUresult cuPointerGetAttribute(void*, CUpointer_attribute, CUdeviceptr);
        // CUresult cuStreamSynchronize(CUstream); CUresult cuMemAllocHost_v2(void**, size_t);
        // CUresult cuMemFreeHost(void*)).
        let d = unsafe {
            Driver {
                pointer_get_attribute: std::mem::transmute::<*mut c_void, PointerGetAttribute>(pga),
                stream_synchronize: std::mem::transmute::<*mut c_void, StreamSynchronize>(sync),
                mem_alloc_host: (!alloc.is_null())
                    .then(|| std::mem::transmute::<*mut c_void, MemAllocHost>(alloc)),
                mem_free_host: (!free.is_null())
                    .then(|| std::mem::transmute::<*mut c_void, MemFreeHost>(free)),
            }
        };
        Some(DRIVER.get_or_init(|| d))
    }

    /// Host unless the CUDA driver is loaded and says otherwise.
    pub fn classify(p: *const c_void) -> MemoryKind {
        let Some(d) = driver() else {
            return MemoryKind::Host;
        };
        let mut kind: c_uint = 0;
        // SAFETY: `kind` is a writable unsigned int, what MEMORY_TYPE writes; the driver only
        // looks the address up, never dereferences it.
        let rc = unsafe {
            (d.pointer_get_attribute)(
                &mut kind as *mut c_uint as *mut c_void,
                CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                p as u64,
            )
        };
        match rc {
            CUDA_SUCCESS if kind == CU_MEMORYTYPE_HOST => MemoryKind::Host,
            CUDA_SUCCESS => MemoryKind::Device,
            CUDA_ERROR_INVALID_VALUE | CUDA_ERROR_NOT_INITIALIZED | CUDA_ERROR_DEINITIALIZED => {
                MemoryKind::Host
            }
            _ => MemoryKind::Unknown,
        }
    }

    /// Waits for the work queued on `stream` (a `cudaStream_t`/`CUstream`; NULL is the default
    /// stream) if the driver is loaded. Returns the driver's error code, if any.
    ///
    /// # Safety
    /// `stream` is NULL or a stream handle that is live in this process (the driver follows it).
    pub unsafe fn synchronize(stream: *mut c_void) -> Result<(), c_int> {
        let Some(d) = driver() else { return Ok(()) };
        // SAFETY: a live stream handle or NULL, by this function's contract.
        match unsafe { (d.stream_synchronize)(stream) } {
            CUDA_SUCCESS => Ok(()),
            rc => Err(rc),
        }
    }

    /// Whether this process has loaded the CUDA driver.
    pub fn driver_loaded() -> bool {
        driver().is_some()
    }

    /// Page-locked host memory that both the CPU and the GPU (through unified addressing) can
    /// use: what a small exchange through the real NCCL needs when CUDA is present.
    pub struct PinnedHost {
        ptr: *mut u8,
        len: usize,
        free: MemFreeHost,
    }

    impl PinnedHost {
        /// `len` zeroed bytes, or None without the driver, or when it refuses (no current
        /// context on this thread, out of memory).
        pub fn new(len: usize) -> Option<PinnedHost> {
            let d = driver()?;
            let (alloc, free) = (d.mem_alloc_host?, d.mem_free_host?);
            let mut p: *mut c_void = std::ptr::null_mut();
            // SAFETY: `p` is a writable pointer slot for the driver's result.
            if unsafe { alloc(&mut p, len.max(1)) } != CUDA_SUCCESS || p.is_null() {
                return None;
            }
            // SAFETY: the driver just allocated `len` bytes at `p`.
            unsafe { std::ptr::write_bytes(p as *mut u8, 0, len) };
            Some(PinnedHost {
                ptr: p as *mut u8,
                len,
                free,
            })
        }

        pub fn as_mut_slice(&mut self) -> &mut [u8] {
            // SAFETY: `len` bytes allocated by the driver, owned by self, freed only in drop.
            unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
        }
    }

    impl Drop for PinnedHost {
        fn drop(&mut self) {
            // SAFETY: allocated by cuMemAllocHost and not freed before.
            unsafe { (self.free)(self.ptr as *mut c_void) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last_error() -> String {
        // SAFETY: cieraGetLastError returns a valid NUL-terminated string.
        unsafe { CStr::from_ptr(cieraGetLastError(std::ptr::null_mut())) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn null_and_dead_handles_are_errors_with_messages() {
        let mut n = 0;
        // SAFETY: a valid out pointer.
        assert_eq!(unsafe { cieraCommCount(std::ptr::null_mut(), &mut n) }, 4);
        assert!(last_error().contains("comm is NULL"), "{}", last_error());
        let fake = (HANDLE_TAG | (1 << 40)) as *mut c_void;
        // SAFETY: as above.
        assert_eq!(unsafe { cieraCommCount(fake, &mut n) }, 5);
        assert!(
            last_error().contains("not a communicator"),
            "{}",
            last_error()
        );
        assert_eq!(cieraCommDestroy(fake), 5);
        assert_eq!(cieraCommDestroy(std::ptr::null_mut()), 0);
    }

    #[test]
    fn buffer_checks() {
        let mut recv = vec![0u8; 48];
        let p = recv.as_mut_ptr() as *mut c_void;
        // SAFETY: the buffers are live vectors of the sizes described.
        unsafe {
            assert!(matches!(
                gather_buffers(p.add(16), p, 4, DType::F32, 1, 3),
                Ok(GatherBuffers::InPlace { .. })
            ));
            let e = gather_buffers(p.add(8), p, 4, DType::F32, 1, 3)
                .err()
                .unwrap();
            assert_eq!(e.code, ResultCode::InvalidArgument);
            assert!(e.message.contains("overlaps"), "{}", e.message);
            let e = gather_buffers(std::ptr::null(), p, 4, DType::F32, 1, 3)
                .err()
                .unwrap();
            assert!(e.message.contains("sendbuff is NULL"));
            let e = gather_buffers(p, p, usize::MAX / 2, DType::F32, 1, 3)
                .err()
                .unwrap();
            assert!(e.message.contains("overflows"), "{}", e.message);
            assert!(
                gather_buffers(std::ptr::null(), std::ptr::null_mut(), 0, DType::F32, 0, 3).is_ok()
            );
        }
    }

    #[test]
    fn config_fields_validate_and_undefined_means_env() {
        let mut c = CConfig {
            size: std::mem::size_of::<CConfig>(),
            magic: API_MAGIC,
            version: CONFIG_VERSION,
            timeout_ms: 1500,
            compression: COMPRESSION_OFF,
            cache_budget_mb: CONFIG_UNDEF_INT,
            transport: TRANSPORT_TCP,
            verify: CONFIG_UNDEF_INT,
        };
        // SAFETY: `c` is a full, readable struct.
        let (cfg, opt) = unsafe { resolve_config(&c) }.unwrap();
        assert_eq!(cfg.timeout, Duration::from_millis(1500));
        assert_eq!(cfg.transport, TransportChoice::Tcp);
        assert_eq!(opt.mode, CompressMode::Off);
        assert_eq!(opt.cache_bytes, CompressConfig::default().cache_bytes);
        // An older, shorter struct: fields past its size are undefined even if bytes follow.
        c.size = std::mem::offset_of!(CConfig, compression);
        // SAFETY: as above.
        let (_, opt) = unsafe { resolve_config(&c) }.unwrap();
        assert_eq!(opt.mode, CompressMode::Auto);
        c.size = std::mem::size_of::<CConfig>();
        c.transport = 7;
        // SAFETY: as above.
        let e = unsafe { resolve_config(&c) }.err().unwrap();
        assert!(e.message.contains("config.transport is 7"), "{}", e.message);
        c.transport = TRANSPORT_AUTO;
        c.magic = 0;
        // SAFETY: as above.
        assert!(unsafe { resolve_config(&c) }
            .err()
            .unwrap()
            .message
            .contains("CIERA_CONFIG_INITIALIZER"));
    }
}
