//! The CUDA driver, asked only if this process has loaded it already (`libcuda.so.1`, e.g. by
//! PyTorch): the library never loads CUDA itself, so it builds and runs with no GPU. Raw
//! driver entry points are looked up with `dlsym` once and wrapped in safe functions here.
//!
//! - [`classify`]: where a pointer lives ([`Location`]): what the C ABI and the interposers
//!   check before they touch a buffer.
//! - [`synchronize`]: wait for a stream (the interposers order host work after queued GPU work).
//! - [`PinnedHost`]: page-locked host memory the GPU can address (a small exchange through the
//!   real NCCL).

use std::ffi::{c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use crate::mem::Location;

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
    /// The dlopen handle of the loaded driver, kept for the process's life.
    handle: usize,
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
    /// loaded, it still is (dlopen with RTLD_NOLOAD searches the library path on disk, a
    /// cost on every collective when CUDA is absent: ARCHITECTURE.md, interposer timings).
    static ABSENT_AT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(u64::MAX);
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
            handle: handle as usize,
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

/// The address of driver entry point `name`, if this process has loaded the driver and it
/// has that symbol.
pub(super) fn lookup(name: &CStr) -> Option<*mut c_void> {
    let d = driver()?;
    let p = symbol(d.handle as *mut c_void, name);
    (!p.is_null()).then_some(p)
}

/// Where `p` lives: host memory unless the CUDA driver is loaded and says otherwise.
pub fn classify(p: *const c_void) -> Location {
    let Some(d) = driver() else {
        return Location::Host;
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
        CUDA_SUCCESS if kind == CU_MEMORYTYPE_HOST => Location::Host,
        CUDA_SUCCESS => Location::Device,
        CUDA_ERROR_INVALID_VALUE | CUDA_ERROR_NOT_INITIALIZED | CUDA_ERROR_DEINITIALIZED => {
            Location::Host
        }
        _ => Location::Unknown,
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
