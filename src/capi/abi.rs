//! What `include/ciera.h` declares, on the Rust side: version and magic numbers, the enums'
//! numbers, the versioned structs (`cieraConfig_t`, `cieraStats_t`, `cieraUniqueId`), result
//! codes (NCCL's numbers) with their strings and their mapping from [`Error`], and how a
//! `cieraConfig_t` overrides the environment.

use std::ffi::{c_char, c_int};
use std::time::Duration;

use ciera_transport::TransportChoice;

use crate::codec::CodecError;
use crate::coded_enum::coded_enum;
use crate::comm::Config;
use crate::compress::{cache_mb_to_bytes, CompressMode};
use crate::error::Error;

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
    /// Sources whose cache held no copy of their shard (a moved buffer, an evicted or reset
    /// cache) and that sent it as FILL frames within a compressed call; not repairs.
    pub misses: u64,
}

pub const CONFIG_VERSION: u32 = 1;
pub const STATS_VERSION: u32 = 1;
/// The size/magic/version header every versioned struct starts with.
pub(super) const VERSIONED_HEADER_BYTES: usize = std::mem::size_of::<usize>() + 8;

coded_enum! {
    #[repr(i32)]
    /// Result codes, numerically identical to NCCL's `ncclResult_t`.
    pub enum ResultCode {
        Success = 0,
        UnhandledCudaError = 1,
        SystemError = 2,
        InternalError = 3,
        InvalidArgument = 4,
        InvalidUsage = 5,
        RemoteError = 6,
        InProgress = 7,
    }
}

/// The C ABI result code for a library error: the caller's arguments, the caller's use of
/// the API, a peer (or what it sent), or the system (files, network, time).
pub fn result_code(e: &Error) -> ResultCode {
    match e {
        Error::InvalidArgument(_)
        | Error::LengthMismatch { .. }
        | Error::Codec(CodecError::DTypeMismatch { .. } | CodecError::LengthMismatch { .. }) => {
            ResultCode::InvalidArgument
        }
        Error::CallMismatch { .. }
        | Error::Codec(CodecError::SlotState { .. })
        | Error::Unsupported(_) => ResultCode::InvalidUsage,
        Error::Codec(_)
        | Error::PeerFailed { .. }
        | Error::Corrupted { .. }
        | Error::Aborted { .. } => ResultCode::RemoteError,
        Error::Io { .. }
        | Error::Format { .. }
        | Error::Transport { .. }
        | Error::Timeout { .. }
        | Error::Bootstrap(_) => ResultCode::SystemError,
    }
}

// ---- failures: a result code and a message --------------------------------------------------

/// What a failed entry point returns: the code, and the message `cieraGetLastError` gives.
#[derive(Clone, Debug)]
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
            code: result_code(&e),
            message: e.to_string(),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, error_string(self.code as c_int))
    }
}

/// `cieraGetErrorString`'s strings; static, NUL-terminated.
pub(super) fn error_cstr(code: c_int) -> &'static [u8] {
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

/// `Config::from_env()`, overridden by the fields of `cfg` that are set (timeoutMs, transport,
/// compression, cacheBudgetMB, verify).
///
/// # Safety
/// `cfg` is NULL or points to at least `VERSIONED_HEADER_BYTES` readable bytes whose `size`
/// field says how many bytes of a `cieraConfig_t` are readable there.
pub unsafe fn resolve_config(cfg: *const CConfig) -> Result<Config, Failure> {
    let mut config =
        Config::from_env().map_err(|e| Failure::invalid_argument(format!("environment: {e}")))?;
    if cfg.is_null() {
        return Ok(config);
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
        config.compress.mode = match v {
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
        config.compress.cache_bytes = cache_mb_to_bytes(v as usize).ok_or_else(|| {
            Failure::invalid_argument(format!(
                "config.cacheBudgetMB is {v}; more than this machine can address"
            ))
        })?;
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
        config.compress.verify = match v {
            0 => false,
            1 => true,
            _ => {
                return Err(Failure::invalid_argument(format!(
                    "config.verify is {v}; expected 0, 1 or CIERA_CONFIG_UNDEF_INT"
                )))
            }
        };
    }
    Ok(config)
}
