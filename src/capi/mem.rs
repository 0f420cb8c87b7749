//! `cieraMemAlloc` / `cieraMemFree`: shared buffers for C callers, and the registry of them by
//! address that the MPI interposer's `MPI_Alloc_mem` shares.

use std::ffi::{c_int, c_void};

use super::abi::{Failure, ResultCode};
use super::entry::entry;

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
