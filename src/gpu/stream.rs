//! The CUDA driver calls of the device-memory Allgather (`capi::device`): contexts, streams,
//! events, device and pinned memory, copies, stream waits on a host flag and legacy IPC
//! handles, each behind a small owning type that frees its handle when dropped.
//!
//! Like [`super::driver`], this never loads CUDA: the entry points are looked up in the
//! `libcuda.so.1` the process already has (PyTorch's, or in CI the stand-in that
//! tests/capi_device.rs builds from tests/c/standin_cuda.c, which gives these calls CUDA's
//! semantics on host memory). Every call's failure is a [`CudaError`] naming the call.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::fmt;
use std::sync::OnceLock;

use super::driver::lookup;

const CUDA_SUCCESS: c_int = 0;
const CUDA_ERROR_NOT_READY: c_int = 600;
const CU_STREAM_NON_BLOCKING: c_uint = 1;
const CU_EVENT_DISABLE_TIMING: c_uint = 2;
const CU_STREAM_WAIT_VALUE_GEQ: c_uint = 0;
const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// A driver call that failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaError {
    pub call: &'static str,
    /// The `CUresult`, or -1 when the entry point is missing.
    pub code: i32,
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.code < 0 {
            return write!(f, "the CUDA driver has no {}", self.call);
        }
        let name = api().ok().and_then(|a| a.error_name).and_then(|get| {
            let mut p: *const c_char = std::ptr::null();
            // SAFETY: cuGetErrorName writes a pointer to a static string into `p`.
            (unsafe { get(self.code, &mut p) } == CUDA_SUCCESS && !p.is_null())
                // SAFETY: the driver's static NUL-terminated string.
                .then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        });
        match name {
            Some(n) => write!(f, "{} returned {} ({n})", self.call, self.code),
            None => write!(f, "{} returned {}", self.call, self.code),
        }
    }
}

impl std::error::Error for CudaError {}

pub type Result<T> = std::result::Result<T, CudaError>;

fn check(call: &'static str, rc: c_int) -> Result<()> {
    if rc == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError { call, code: rc })
    }
}

type Ptr = *mut c_void;

/// `CUipcMemHandle`: 64 opaque bytes, passed by value as the C struct.
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcHandle {
    reserved: [u8; 64],
}
type HostFn = unsafe extern "C" fn(*mut c_void);

/// The entry points, with the driver API's C signatures.
struct Api {
    ctx_get_current: unsafe extern "C" fn(*mut Ptr) -> c_int,
    ctx_set_current: unsafe extern "C" fn(Ptr) -> c_int,
    mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> c_int,
    mem_free: unsafe extern "C" fn(u64) -> c_int,
    htod: unsafe extern "C" fn(u64, *const c_void, usize, Ptr) -> c_int,
    dtoh: unsafe extern "C" fn(*mut c_void, u64, usize, Ptr) -> c_int,
    dtod: unsafe extern "C" fn(u64, u64, usize, Ptr) -> c_int,
    stream_create: unsafe extern "C" fn(*mut Ptr, c_uint) -> c_int,
    stream_destroy: unsafe extern "C" fn(Ptr) -> c_int,
    stream_synchronize: unsafe extern "C" fn(Ptr) -> c_int,
    event_create: unsafe extern "C" fn(*mut Ptr, c_uint) -> c_int,
    event_record: unsafe extern "C" fn(Ptr, Ptr) -> c_int,
    event_query: unsafe extern "C" fn(Ptr) -> c_int,
    event_destroy: unsafe extern "C" fn(Ptr) -> c_int,
    launch_host_func: unsafe extern "C" fn(Ptr, HostFn, *mut c_void) -> c_int,
    mem_alloc_host: unsafe extern "C" fn(*mut Ptr, usize) -> c_int,
    mem_free_host: unsafe extern "C" fn(Ptr) -> c_int,
    host_device_pointer: Option<unsafe extern "C" fn(*mut u64, Ptr, c_uint) -> c_int>,
    wait_value32: Option<unsafe extern "C" fn(Ptr, u64, u32, c_uint) -> c_int>,
    ipc_get: Option<unsafe extern "C" fn(*mut IpcHandle, u64) -> c_int>,
    ipc_open: Option<unsafe extern "C" fn(*mut u64, IpcHandle, c_uint) -> c_int>,
    ipc_close: Option<unsafe extern "C" fn(u64) -> c_int>,
    error_name: Option<unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int>,
}

/// The driver's entry point `name` as a function pointer of type `T`.
///
/// # Safety
/// `T` is the function pointer type of that entry point's C signature.
unsafe fn entry<T: Copy>(name: &CStr) -> Option<T> {
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: a function's address as the function pointer type the caller vouches for.
    lookup(name).map(|p| unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<Api> = OnceLock::new();
    if let Some(a) = API.get() {
        return Ok(a);
    }
    macro_rules! need {
        ($name:literal) => {{
            // SAFETY: each field's type is the C signature of the entry point named for it
            // (CUDA driver API, cuda.h of CUDA 11-13; the _v2 names are what cuda.h's macros
            // expand to).
            unsafe { entry($name) }.ok_or(CudaError {
                call: match $name.to_str() {
                    Ok(s) => s,
                    Err(_) => "?",
                },
                code: -1,
            })?
        }};
    }
    macro_rules! want {
        ($name:literal) => {
            // SAFETY: as for need!.
            unsafe { entry($name) }
        };
    }
    if lookup(c"cuPointerGetAttribute").is_none() {
        return Err(CudaError {
            call: "libcuda.so.1 (not loaded in this process)",
            code: -1,
        });
    }
    let a = Api {
        ctx_get_current: need!(c"cuCtxGetCurrent"),
        ctx_set_current: need!(c"cuCtxSetCurrent"),
        mem_alloc: need!(c"cuMemAlloc_v2"),
        mem_free: need!(c"cuMemFree_v2"),
        htod: need!(c"cuMemcpyHtoDAsync_v2"),
        dtoh: need!(c"cuMemcpyDtoHAsync_v2"),
        dtod: need!(c"cuMemcpyDtoDAsync_v2"),
        stream_create: need!(c"cuStreamCreate"),
        stream_destroy: need!(c"cuStreamDestroy_v2"),
        stream_synchronize: need!(c"cuStreamSynchronize"),
        event_create: need!(c"cuEventCreate"),
        event_record: need!(c"cuEventRecord"),
        event_query: need!(c"cuEventQuery"),
        event_destroy: need!(c"cuEventDestroy_v2"),
        launch_host_func: need!(c"cuLaunchHostFunc"),
        mem_alloc_host: need!(c"cuMemAllocHost_v2"),
        mem_free_host: need!(c"cuMemFreeHost"),
        host_device_pointer: want!(c"cuMemHostGetDevicePointer_v2"),
        wait_value32: want!(c"cuStreamWaitValue32_v2"),
        ipc_get: want!(c"cuIpcGetMemHandle"),
        ipc_open: want!(c"cuIpcOpenMemHandle_v2"),
        ipc_close: want!(c"cuIpcCloseMemHandle"),
        error_name: want!(c"cuGetErrorName"),
    };
    Ok(API.get_or_init(|| a))
}

/// Whether the loaded driver offers what the device-memory Allgather needs (the error names
/// the first missing entry point).
pub fn available() -> Result<()> {
    api().map(|_| ())
}

/// Whether the driver has legacy IPC (cuIpcGetMemHandle and friends).
pub fn has_ipc() -> bool {
    api().is_ok_and(|a| a.ipc_get.is_some() && a.ipc_open.is_some() && a.ipc_close.is_some())
}

/// A CUDA context (`CUcontext`), not owned: the caller's, made current on other threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Context(usize);

impl Context {
    /// The calling thread's current context (None if it has none).
    pub fn current() -> Result<Option<Context>> {
        let a = api()?;
        let mut c: Ptr = std::ptr::null_mut();
        // SAFETY: `c` is a writable slot for the handle.
        check("cuCtxGetCurrent", unsafe { (a.ctx_get_current)(&mut c) })?;
        Ok((!c.is_null()).then_some(Context(c as usize)))
    }

    /// Makes it the calling thread's current context.
    pub fn make_current(self) -> Result<()> {
        let a = api()?;
        // SAFETY: a context handle the driver gave this process (current() above).
        check("cuCtxSetCurrent", unsafe {
            (a.ctx_set_current)(self.0 as Ptr)
        })
    }
}

/// A stream handle of the caller's (`CUstream`; 0 is the default stream), not owned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamRef(pub usize);

impl StreamRef {
    fn raw(self) -> Ptr {
        self.0 as Ptr
    }

    /// Waits on the host for everything queued on it.
    pub fn synchronize(self) -> Result<()> {
        let a = api()?;
        // SAFETY: a live stream handle (the caller's contract where a StreamRef is made).
        check("cuStreamSynchronize", unsafe {
            (a.stream_synchronize)(self.raw())
        })
    }
}

/// A non-blocking stream of our own.
pub struct Stream(StreamRef);

// SAFETY: CUDA stream handles may be used from any thread (with a context current).
unsafe impl Send for Stream {}

impl Stream {
    pub fn new() -> Result<Stream> {
        let a = api()?;
        let mut s: Ptr = std::ptr::null_mut();
        // SAFETY: `s` is a writable slot for the handle.
        check("cuStreamCreate", unsafe {
            (a.stream_create)(&mut s, CU_STREAM_NON_BLOCKING)
        })?;
        Ok(Stream(StreamRef(s as usize)))
    }

    pub fn as_ref(&self) -> StreamRef {
        self.0
    }

    pub fn synchronize(&self) -> Result<()> {
        self.0.synchronize()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Ok(a) = api() {
            // SAFETY: created by cuStreamCreate and not destroyed before; the driver finishes
            // its queued work first.
            unsafe { (a.stream_destroy)(self.0.raw()) };
        }
    }
}

/// An event without timing.
pub struct Event(usize);

// SAFETY: CUDA event handles may be used from any thread.
unsafe impl Send for Event {}

impl Event {
    pub fn new() -> Result<Event> {
        let a = api()?;
        let mut e: Ptr = std::ptr::null_mut();
        // SAFETY: `e` is a writable slot for the handle.
        check("cuEventCreate", unsafe {
            (a.event_create)(&mut e, CU_EVENT_DISABLE_TIMING)
        })?;
        Ok(Event(e as usize))
    }

    /// Records it on `stream`: it completes when the work queued there before it has.
    pub fn record(&self, stream: StreamRef) -> Result<()> {
        let a = api()?;
        // SAFETY: a live event of ours and a live stream handle.
        check("cuEventRecord", unsafe {
            (a.event_record)(self.0 as Ptr, stream.raw())
        })
    }

    /// Whether the work before its last record has completed.
    pub fn done(&self) -> Result<bool> {
        let a = api()?;
        // SAFETY: a live event of ours.
        match unsafe { (a.event_query)(self.0 as Ptr) } {
            CUDA_SUCCESS => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            rc => Err(CudaError {
                call: "cuEventQuery",
                code: rc,
            }),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok(a) = api() {
            // SAFETY: created by cuEventCreate and not destroyed before.
            unsafe { (a.event_destroy)(self.0 as Ptr) };
        }
    }
}

/// Device memory of our own (cuMemAlloc: IPC-able, unlike stream-ordered pools).
pub struct DeviceBuffer {
    ptr: u64,
    len: usize,
}

// SAFETY: a device address, usable from any thread of the process.
unsafe impl Send for DeviceBuffer {}

impl DeviceBuffer {
    pub fn new(len: usize) -> Result<DeviceBuffer> {
        let a = api()?;
        let mut p = 0u64;
        // SAFETY: `p` is a writable slot for the address.
        check("cuMemAlloc", unsafe { (a.mem_alloc)(&mut p, len.max(1)) })?;
        Ok(DeviceBuffer { ptr: p, len })
    }

    pub fn addr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its legacy IPC handle (64 bytes a process on this host opens with [`IpcMapping`]).
    pub fn ipc_handle(&self) -> Result<[u8; 64]> {
        let a = api()?;
        let get = a.ipc_get.ok_or(CudaError {
            call: "cuIpcGetMemHandle",
            code: -1,
        })?;
        let mut h = IpcHandle { reserved: [0; 64] };
        // SAFETY: `h` is the CUipcMemHandle the call writes; `ptr` is our allocation.
        check("cuIpcGetMemHandle", unsafe { get(&mut h, self.ptr) })?;
        Ok(h.reserved)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Ok(a) = api() {
            // SAFETY: allocated by cuMemAlloc and not freed before. cuMemFree waits for
            // nothing, so owners synchronize the streams that use it first.
            unsafe { (a.mem_free)(self.ptr) };
        }
    }
}

/// Another process's device memory, mapped here from its IPC handle.
pub struct IpcMapping {
    ptr: u64,
}

// SAFETY: a device address, usable from any thread of the process.
unsafe impl Send for IpcMapping {}

impl IpcMapping {
    pub fn open(handle: &[u8; 64]) -> Result<IpcMapping> {
        let a = api()?;
        let open = a.ipc_open.ok_or(CudaError {
            call: "cuIpcOpenMemHandle",
            code: -1,
        })?;
        let mut p = 0u64;
        // SAFETY: `p` is a writable slot; the handle is passed by value as CUipcMemHandle is.
        check("cuIpcOpenMemHandle", unsafe {
            open(
                &mut p,
                IpcHandle { reserved: *handle },
                CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
            )
        })?;
        Ok(IpcMapping { ptr: p })
    }

    pub fn addr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if let Some(close) = api().ok().and_then(|a| a.ipc_close) {
            // SAFETY: opened by cuIpcOpenMemHandle and not closed before.
            unsafe { close(self.ptr) };
        }
    }
}

/// Page-locked host memory, its device address with it.
pub struct Pinned {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain memory owned by this value; the pointer is not shared elsewhere.
unsafe impl Send for Pinned {}

impl Pinned {
    pub fn new(len: usize) -> Result<Pinned> {
        let a = api()?;
        let mut p: Ptr = std::ptr::null_mut();
        // SAFETY: `p` is a writable slot for the address.
        check("cuMemAllocHost", unsafe {
            (a.mem_alloc_host)(&mut p, len.max(1))
        })?;
        // SAFETY: the driver just allocated at least `len` bytes at `p`.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, len) };
        Ok(Pinned {
            ptr: p as *mut u8,
            len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes owned by self, borrowed mutably once.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    fn device_addr(&self) -> Result<u64> {
        let a = api()?;
        match a.host_device_pointer {
            Some(get) => {
                let mut d = 0u64;
                // SAFETY: `d` is a writable slot; `ptr` is pinned memory of ours.
                check("cuMemHostGetDevicePointer", unsafe {
                    get(&mut d, self.ptr as Ptr, 0)
                })?;
                Ok(d)
            }
            // Unified addressing: the host address is the device address.
            None => Ok(self.ptr as u64),
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Ok(a) = api() {
            // SAFETY: allocated by cuMemAllocHost and not freed before.
            unsafe { (a.mem_free_host)(self.ptr as Ptr) };
        }
    }
}

/// A 32-bit counter in pinned memory that streams can wait for (cuStreamWaitValue32), so
/// a caller's stream resumes when the host says so, without a host thread blocking in it.
pub struct Flag {
    mem: Pinned,
    device: u64,
}

// SAFETY: a Flag is only read and written through atomics (`cell`); its other fields are a
// device address and the owning allocation, which no method mutates.
unsafe impl Sync for Flag {}

impl Flag {
    pub fn new() -> Result<Flag> {
        let mem = Pinned::new(64)?;
        let device = mem.device_addr()?;
        Ok(Flag { mem, device })
    }

    fn cell(&self) -> &std::sync::atomic::AtomicU32 {
        // SAFETY: 64 pinned bytes owned by self, 4096-aligned by the driver (so aligned
        // for u32); only ever accessed atomically, here and by the device.
        unsafe { &*(self.mem.ptr as *const std::sync::atomic::AtomicU32) }
    }

    /// Sets the counter (release: everything this thread wrote before is visible first).
    pub fn set(&self, value: u32) {
        self.cell()
            .store(value, std::sync::atomic::Ordering::Release);
    }

    pub fn get(&self) -> u32 {
        self.cell().load(std::sync::atomic::Ordering::Acquire)
    }

    /// Queues on `stream` a wait until the counter is at least `value` (cyclically, as a
    /// 32-bit difference). Errors if the driver has no stream memory operations.
    pub fn enqueue_wait(&self, stream: StreamRef, value: u32) -> Result<()> {
        let a = api()?;
        let wait = a.wait_value32.ok_or(CudaError {
            call: "cuStreamWaitValue32",
            code: -1,
        })?;
        // SAFETY: a live stream handle; `device` is the device address of our pinned flag,
        // which outlives every wait queued on it (its owner synchronizes before dropping it).
        check("cuStreamWaitValue32", unsafe {
            wait(stream.raw(), self.device, value, CU_STREAM_WAIT_VALUE_GEQ)
        })
    }
}

/// Queues `f` on `stream` (cuLaunchHostFunc): it runs on a driver thread once the work before
/// it is done, and the stream's later work waits for it to return. `f` must not call CUDA.
pub fn enqueue_host_fn(stream: StreamRef, f: Box<dyn FnOnce() + Send>) -> Result<()> {
    unsafe extern "C" fn trampoline(arg: *mut c_void) {
        // SAFETY: `arg` is the Box made below, run exactly once by the driver.
        let f = unsafe { Box::from_raw(arg as *mut Box<dyn FnOnce() + Send>) };
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    }
    let a = api()?;
    let arg = Box::into_raw(Box::new(f)) as *mut c_void;
    // SAFETY: a live stream handle; the driver calls `trampoline(arg)` once.
    let rc = unsafe { (a.launch_host_func)(stream.raw(), trampoline, arg) };
    if rc != CUDA_SUCCESS {
        // SAFETY: the driver refused, so it will not call it: reclaim the box.
        drop(unsafe { Box::from_raw(arg as *mut Box<dyn FnOnce() + Send>) });
    }
    check("cuLaunchHostFunc", rc)
}

/// Queues a copy of `len` bytes from device address `src` to host memory `dst`.
///
/// # Safety
/// `dst` stays valid and unread by others until the copy is done (the stream synchronized);
/// `src..src+len` is device memory.
pub unsafe fn copy_dtoh(dst: *mut u8, src: u64, len: usize, stream: StreamRef) -> Result<()> {
    let a = api()?;
    // SAFETY: the caller's contract.
    check("cuMemcpyDtoHAsync", unsafe {
        (a.dtoh)(dst as *mut c_void, src, len, stream.raw())
    })
}

/// Queues a copy of `len` bytes from host memory `src` to device address `dst`.
///
/// # Safety
/// `src` stays valid and unchanged until the copy is done; `dst..dst+len` is device memory.
pub unsafe fn copy_htod(dst: u64, src: *const u8, len: usize, stream: StreamRef) -> Result<()> {
    let a = api()?;
    // SAFETY: the caller's contract.
    check("cuMemcpyHtoDAsync", unsafe {
        (a.htod)(dst, src as *const c_void, len, stream.raw())
    })
}

/// Queues a device-to-device copy (also between this device and a peer's IPC mapping).
///
/// # Safety
/// Both ranges are device memory that stays allocated until the copy is done.
pub unsafe fn copy_dtod(dst: u64, src: u64, len: usize, stream: StreamRef) -> Result<()> {
    let a = api()?;
    // SAFETY: the caller's contract.
    check("cuMemcpyDtoDAsync", unsafe {
        (a.dtod)(dst, src, len, stream.raw())
    })
}
