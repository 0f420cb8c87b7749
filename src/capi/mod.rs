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
//! The parts: [`abi`] (constants, versioned structs, result codes and their mapping from
//! [`crate::Error`]), `entry` (the `extern "C"` functions, panics caught, the last error),
//! [`registry`] (live communicators by handle), [`live`] (a communicator as the C ABI and the
//! interposers hold it, and the checks of an allgather's pointers), [`mem`] (`cieraMemAlloc`),
//! [`interpose`] (what the LD_PRELOAD interposers share). The interposers (`interpose/nccl`,
//! `interpose/mpi`) reuse [`live::LiveComm`], [`live::gather_buffers`] and
//! [`crate::gpu::driver`]; they do not go through the `extern "C"` functions.

pub mod abi;
mod device;
mod entry;
pub mod interpose;
pub mod live;
pub mod mem;
pub mod registry;

pub use abi::{
    error_string, resolve_config, result_code, CConfig, CStats, CUniqueId, Failure, ResultCode,
    API_MAGIC, COMPRESSION_AUTO, COMPRESSION_OFF, COMPRESSION_ON, CONFIG_UNDEF_INT, CONFIG_VERSION,
    STATS_VERSION, TRANSPORT_AUTO, TRANSPORT_SHM, TRANSPORT_TCP, UNIQUE_ID_BYTES, VERSION_CODE,
    VERSION_MAJOR, VERSION_MINOR, VERSION_PATCH,
};
pub use device::on_device;
pub use entry::*;
pub use live::{gather_buffers, CallStats, GatherBuffers, LiveComm};
pub use mem::shared_mem;

#[cfg(test)]
mod tests {
    use super::registry::HANDLE_TAG;
    use super::*;
    use crate::compress::{CompressConfig, CompressMode};
    use crate::DType;
    use ciera_transport::TransportChoice;
    use std::ffi::{c_void, CStr};
    use std::time::Duration;

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
        let cfg = unsafe { resolve_config(&c) }.unwrap();
        assert_eq!(cfg.timeout, Duration::from_millis(1500));
        assert_eq!(cfg.transport, TransportChoice::Tcp);
        assert_eq!(cfg.compress.mode, CompressMode::Off);
        assert_eq!(
            cfg.compress.cache_bytes,
            CompressConfig::default().cache_bytes
        );
        // An older, shorter struct: fields past its size are undefined even if bytes follow.
        c.size = std::mem::offset_of!(CConfig, compression);
        // SAFETY: as above.
        let cfg = unsafe { resolve_config(&c) }.unwrap();
        assert_eq!(cfg.compress.mode, CompressMode::Auto);
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
