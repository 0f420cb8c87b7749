//! `libciera_mpi.so`: a PMPI interposer for Open MPI (`mpirun -x LD_PRELOAD=.../libciera_mpi.so`)
//! that serves `MPI_Allgather` with CIERA where it can and calls `PMPI_Allgather` otherwise.
//!
//! Open MPI's ABI: `MPI_Comm` and `MPI_Datatype` are pointers; the predefined datatypes are the
//! addresses of globals (`MPI_FLOAT` is `&ompi_mpi_float`), found here with
//! `dlsym(RTLD_DEFAULT)` (which returns the executable's copy if it has one, the address the
//! application passes); `MPI_IN_PLACE` is `(void*)1` (mpi.h of Open MPI 4.1). There is no
//! link-time dependency on libmpi: every PMPI function is looked up with dlsym, so the crate
//! builds without MPI installed.
//!
//! Served: sendtype == recvtype (or MPI_IN_PLACE), sendcount == recvcount, a predefined
//! contiguous type from the table in `type_table`, an intracommunicator of at least 2 ranks,
//! host memory. The element type the codec is told: MPI_FLOAT → fp32, MPI_DOUBLE and the
//! integer types → raw (exact) bytes, 16-bit types (MPI_UINT16_T, MPI_INT16_T, MPI_SHORT,
//! MPI_UNSIGNED_SHORT) → `CIERA_MPI_16BIT=bf16|fp16|raw` (default raw), since MPI has no bf16.
//!
//! One CIERA communicator per MPI communicator, made on the first served call: rank 0 makes a
//! UniqueId, `PMPI_Bcast` carries it, a one-byte `PMPI_Allgather` makes every rank agree that
//! all joined (else all of them keep using MPI for that communicator). It is cached as an MPI
//! attribute on the communicator, so `MPI_Comm_free` frees it (the attribute's delete callback)
//! and a later communicator at the same address starts fresh. An attribute on MPI_COMM_SELF,
//! whose delete callback MPI runs first thing in MPI_Finalize, prints the statistics
//! (`CIERA_STATS=1`) and frees the rest, without exporting MPI_Finalize.
//!
//! `MPI_Alloc_mem` / `MPI_Free_mem` hand out CIERA shared buffers (`ciera::SharedBuffer`):
//! ranks on one host then copy each other's shards straight out of them, no system call. They
//! are ordinary memory to MPI. `CIERA_MPI_ALLOC_MEM=0` leaves both to MPI; a pointer that is
//! not one of ours goes to `PMPI_Free_mem`.
//!
//! Exports only MPI_Allgather, MPI_Alloc_mem and MPI_Free_mem (tests/capi_mpi.rs checks
//! `nm -D`). MPI_Iallgather is not interposed. `CIERA_DISABLE=1` passes every call to MPI
//! untouched.
//!
//! Every rank of a communicator must make the same choice for a call or the CIERA ranks wait
//! for the others until `CIERA_TIMEOUT`: the choice depends on the type handles and counts,
//! which MPI requires to match (a rank using an equivalent derived type where the others use a
//! predefined one is the case that breaks this), and on the memory kind (host everywhere).

use std::ffi::{c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use ciera::capi::{gather_buffers, shared_mem, Failure};
use ciera::comm::UniqueId;
use ciera::gpu::driver as cuda;
use ciera::mem::Location;
use ciera::DType;

/// One line to stderr in a single write, so lines from ranks sharing a terminal or a pipe do
/// not interleave mid-line (eprintln! writes each formatted piece separately).
macro_rules! say {
    ($($arg:tt)*) => {{
        let line = format!("{}\n", format_args!($($arg)*));
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }};
}

type MpiComm = *mut c_void;
type MpiDatatype = *mut c_void;

const MPI_SUCCESS: c_int = 0;
const MPI_ERR_ARG: c_int = 13;
const MPI_ERR_OTHER: c_int = 16;
const MPI_ERR_INTERN: c_int = 17;
const MPI_IN_PLACE: *const c_void = 1 as *const c_void;

type AllgatherFn = unsafe extern "C" fn(
    *const c_void,
    c_int,
    MpiDatatype,
    *mut c_void,
    c_int,
    MpiDatatype,
    MpiComm,
) -> c_int;
type BcastFn = unsafe extern "C" fn(*mut c_void, c_int, MpiDatatype, c_int, MpiComm) -> c_int;
type CommIntFn = unsafe extern "C" fn(MpiComm, *mut c_int) -> c_int;
type TypeSizeFn = unsafe extern "C" fn(MpiDatatype, *mut c_int) -> c_int;
type CopyAttrFn = unsafe extern "C" fn(
    MpiComm,
    c_int,
    *mut c_void,
    *mut c_void,
    *mut c_void,
    *mut c_int,
) -> c_int;
type DeleteAttrFn = unsafe extern "C" fn(MpiComm, c_int, *mut c_void, *mut c_void) -> c_int;
type CreateKeyvalFn =
    unsafe extern "C" fn(CopyAttrFn, DeleteAttrFn, *mut c_int, *mut c_void) -> c_int;
type GetAttrFn = unsafe extern "C" fn(MpiComm, c_int, *mut c_void, *mut c_int) -> c_int;
type SetAttrFn = unsafe extern "C" fn(MpiComm, c_int, *mut c_void) -> c_int;
type CallErrhandlerFn = unsafe extern "C" fn(MpiComm, c_int) -> c_int;

/// The PMPI functions and predefined handles of the Open MPI in this process.
struct Mpi {
    allgather: AllgatherFn,
    bcast: BcastFn,
    comm_rank: CommIntFn,
    comm_size: CommIntFn,
    comm_test_inter: CommIntFn,
    type_size: TypeSizeFn,
    create_keyval: CreateKeyvalFn,
    get_attr: GetAttrFn,
    set_attr: SetAttrFn,
    call_errhandler: CallErrhandlerFn,
    byte: MpiDatatype,
    comm_null: MpiComm,
    comm_self: MpiComm,
    /// (datatype handle, what its elements are) for the types served.
    types: Vec<(usize, Elem)>,
}

// SAFETY: the raw pointers are addresses of MPI's predefined objects, constant for the life of
// the process and only compared or handed back to MPI.
unsafe impl Send for Mpi {}
// SAFETY: as above; nothing is ever written through them here.
unsafe impl Sync for Mpi {}

/// How the elements of an MPI type travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Elem {
    dtype: DType,
    /// CIERA elements per MPI element (2 for 16-bit types sent as raw bytes).
    per_mpi: usize,
}

fn lookup(handle: *mut c_void, name: &CStr) -> *mut c_void {
    // SAFETY: dlsym with a handle from dlopen or a pseudo-handle, and a NUL-terminated name.
    unsafe { libc::dlsym(handle, name.as_ptr()) }
}

/// libmpi loaded with RTLD_LOCAL (by a Python extension, say) is not in the global scope;
/// this reaches it by name, without loading anything.
fn libmpi_handle() -> *mut c_void {
    for name in [c"libmpi.so.40", c"libmpi.so"] {
        // SAFETY: RTLD_NOLOAD only returns a handle to an already loaded library.
        let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
        if !h.is_null() {
            return h;
        }
    }
    std::ptr::null_mut()
}

/// A function: the next definition after us, else libmpi's.
fn function(name: &CStr) -> Result<*mut c_void, String> {
    let p = lookup(libc::RTLD_NEXT, name);
    if !p.is_null() {
        return Ok(p);
    }
    let h = libmpi_handle();
    let p = if h.is_null() { h } else { lookup(h, name) };
    if p.is_null() {
        Err(format!(
            "{} not found (is this Open MPI?)",
            name.to_string_lossy()
        ))
    } else {
        Ok(p)
    }
}

/// A predefined object: the global scope's (the application's copy if it has one), else libmpi's.
fn object(name: &CStr) -> Option<*mut c_void> {
    let p = lookup(libc::RTLD_DEFAULT, name);
    if !p.is_null() {
        return Some(p);
    }
    let h = libmpi_handle();
    (!h.is_null())
        .then(|| lookup(h, name))
        .filter(|p| !p.is_null())
}

fn sixteen_bit() -> Result<Option<DType>, String> {
    match std::env::var("CIERA_MPI_16BIT").as_deref() {
        Err(_) | Ok("") | Ok("raw") => Ok(None),
        Ok("bf16") | Ok("bfloat16") => Ok(Some(DType::BF16)),
        Ok("fp16") | Ok("f16") | Ok("half") => Ok(Some(DType::F16)),
        Ok(other) => Err(format!(
            "CIERA_MPI_16BIT={other:?}: expected bf16, fp16 or raw"
        )),
    }
}

/// The predefined types served, by Open MPI global name, with their element meaning.
fn type_table() -> Result<Vec<(&'static CStr, Elem)>, String> {
    let e = |dtype, per_mpi| Elem { dtype, per_mpi };
    let b16 = match sixteen_bit()? {
        Some(d) => e(d, 1),
        None => e(DType::U8, 2),
    };
    Ok(vec![
        (c"ompi_mpi_float", e(DType::F32, 1)),
        (c"ompi_mpi_double", e(DType::F64, 1)),
        (c"ompi_mpi_uint16_t", b16),
        (c"ompi_mpi_int16_t", b16),
        (c"ompi_mpi_short", b16),
        (c"ompi_mpi_unsigned_short", b16),
        (c"ompi_mpi_int", e(DType::I32, 1)),
        (c"ompi_mpi_int32_t", e(DType::I32, 1)),
        (c"ompi_mpi_unsigned", e(DType::U32, 1)),
        (c"ompi_mpi_uint32_t", e(DType::U32, 1)),
        (c"ompi_mpi_long", e(DType::I64, 1)),
        (c"ompi_mpi_long_long_int", e(DType::I64, 1)),
        (c"ompi_mpi_int64_t", e(DType::I64, 1)),
        (c"ompi_mpi_unsigned_long", e(DType::U64, 1)),
        (c"ompi_mpi_unsigned_long_long", e(DType::U64, 1)),
        (c"ompi_mpi_uint64_t", e(DType::U64, 1)),
        (c"ompi_mpi_char", e(DType::I8, 1)),
        (c"ompi_mpi_signed_char", e(DType::I8, 1)),
        (c"ompi_mpi_int8_t", e(DType::I8, 1)),
        (c"ompi_mpi_unsigned_char", e(DType::U8, 1)),
        (c"ompi_mpi_uint8_t", e(DType::U8, 1)),
        (c"ompi_mpi_byte", e(DType::U8, 1)),
    ])
}

fn load() -> Result<Mpi, String> {
    macro_rules! f {
        ($name:expr, $t:ty) => {
            // SAFETY: each PMPI function has, in Open MPI's mpi.h, the C signature of the type
            // it is cast to.
            unsafe { std::mem::transmute::<*mut c_void, $t>(function($name)?) }
        };
    }
    let mut m = Mpi {
        allgather: f!(c"PMPI_Allgather", AllgatherFn),
        bcast: f!(c"PMPI_Bcast", BcastFn),
        comm_rank: f!(c"PMPI_Comm_rank", CommIntFn),
        comm_size: f!(c"PMPI_Comm_size", CommIntFn),
        comm_test_inter: f!(c"PMPI_Comm_test_inter", CommIntFn),
        type_size: f!(c"PMPI_Type_size", TypeSizeFn),
        create_keyval: f!(c"PMPI_Comm_create_keyval", CreateKeyvalFn),
        get_attr: f!(c"PMPI_Comm_get_attr", GetAttrFn),
        set_attr: f!(c"PMPI_Comm_set_attr", SetAttrFn),
        call_errhandler: f!(c"PMPI_Comm_call_errhandler", CallErrhandlerFn),
        byte: object(c"ompi_mpi_byte").ok_or("ompi_mpi_byte not found")?,
        comm_null: object(c"ompi_mpi_comm_null").ok_or("ompi_mpi_comm_null not found")?,
        comm_self: object(c"ompi_mpi_comm_self").ok_or("ompi_mpi_comm_self not found")?,
        types: Vec::new(),
    };
    for (name, elem) in type_table()? {
        let Some(handle) = object(name) else { continue };
        let mut size: c_int = 0;
        // SAFETY: a predefined datatype handle and an int slot; PMPI_Type_size only reads the type.
        let rc = unsafe { (m.type_size)(handle, &mut size) };
        // Serve a type only if its size is what the table assumes (MPI_LONG is 8 bytes on LP64).
        if rc == MPI_SUCCESS && size as usize == elem.dtype.size() * elem.per_mpi {
            m.types.push((handle as usize, elem));
        }
    }
    Ok(m)
}

/// Loaded on the first MPI_Allgather (MPI is initialized by then). Err: why nothing is served.
fn mpi() -> &'static Result<Mpi, String> {
    static MPI: OnceLock<Result<Mpi, String>> = OnceLock::new();
    MPI.get_or_init(load)
}

use ciera::capi::interpose::{disabled, env_flag, Twin};

/// Prints `msg` to stderr the first time a given `reason` comes up in this process.
fn log_once(reason: &'static str, msg: impl FnOnce() -> String) {
    ciera::capi::interpose::log_once("ciera-mpi", reason, msg)
}

// ---- per-communicator twins ------------------------------------------------------------------

/// What the attribute on an MPI communicator points to (a leaked `Arc`, reclaimed by the
/// attribute's delete callback).
struct TwinCell {
    twin: Twin,
    rank: c_int,
    size: c_int,
    comm_addr: usize,
    passed_through: AtomicU64,
    reported: AtomicBool,
}

impl TwinCell {
    fn report(&self) {
        if !env_flag("CIERA_STATS") || self.reported.swap(true, Ordering::SeqCst) {
            return;
        }
        let passed = self.passed_through.load(Ordering::Relaxed);
        match &self.twin {
            Twin::Serving(live) => {
                say!(
                    "ciera-mpi: rank {}/{} comm {:#x}: {}, {passed} passed to MPI",
                    self.rank,
                    self.size,
                    self.comm_addr,
                    live.stats().summary()
                );
            }
            Twin::PassThrough(why) => say!(
                "ciera-mpi: rank {}/{} comm {:#x}: 0 served by CIERA ({why}), {passed} passed to MPI",
                self.rank, self.size, self.comm_addr
            ),
        }
    }
}

/// Every twin made and not yet freed, for the report at MPI_Finalize.
static TWINS: Mutex<Vec<Arc<TwinCell>>> = Mutex::new(Vec::new());
static PASSED_UNSERVABLE: AtomicU64 = AtomicU64::new(0);

/// The copy callback of the per-communicator attribute (MPI_Comm_dup).
///
/// # Safety
/// Called by MPI, with `flag` NULL or writable.
unsafe extern "C" fn no_copy(
    _: MpiComm,
    _: c_int,
    _: *mut c_void,
    _: *mut c_void,
    _: *mut c_void,
    flag: *mut c_int,
) -> c_int {
    // A duplicated communicator gets no twin of its own until its first served call.
    if !flag.is_null() {
        // SAFETY: MPI passes a writable flag.
        unsafe { *flag = 0 };
    }
    MPI_SUCCESS
}

/// The delete callback of the per-communicator attribute: MPI_Comm_free, or finalize.
///
/// # Safety
/// Called by MPI, once per attribute, with the value `twin` stored (an `Arc::into_raw`).
unsafe extern "C" fn free_twin(_: MpiComm, _: c_int, value: *mut c_void, _: *mut c_void) -> c_int {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if value.is_null() {
            return;
        }
        // SAFETY: `value` is what `Arc::into_raw` gave `set_attr`, reclaimed exactly once: MPI
        // calls the delete callback once per attribute.
        let cell = unsafe { Arc::from_raw(value as *const TwinCell) };
        cell.report();
        TWINS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|c| !Arc::ptr_eq(c, &cell));
    }));
    MPI_SUCCESS
}

/// The delete callback of the attribute on MPI_COMM_SELF, which MPI_Finalize runs first.
///
/// # Safety
/// Called by MPI; touches none of its arguments.
unsafe extern "C" fn at_finalize(_: MpiComm, _: c_int, _: *mut c_void, _: *mut c_void) -> c_int {
    let _ = catch_unwind(|| {
        // Report and let go; a communicator goes when the attribute on its MPI communicator is
        // deleted too (Open MPI deletes MPI_COMM_WORLD's during finalize) or at exit. Not
        // aborted: a peer may still be reading the last chunks this rank sent.
        let twins = std::mem::take(&mut *TWINS.lock().unwrap_or_else(|p| p.into_inner()));
        for t in &twins {
            t.report();
        }
        let early = PASSED_UNSERVABLE.load(Ordering::Relaxed);
        if env_flag("CIERA_STATS") && early > 0 {
            say!("ciera-mpi: {early} allgathers CIERA does not serve (types, counts, communicators) passed to MPI");
        }
    });
    MPI_SUCCESS
}

/// The keyval for the per-communicator attribute; registers the finalize hook the first time.
fn keyval(m: &Mpi) -> Result<c_int, String> {
    static KEYVAL: Mutex<Option<c_int>> = Mutex::new(None);
    let mut k = KEYVAL.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(k) = *k {
        return Ok(k);
    }
    let mut kv: c_int = 0;
    let mut fin: c_int = 0;
    // SAFETY: callbacks with the C signatures MPI expects; int slots for the keyvals; the
    // MPI_COMM_SELF handle is MPI's own.
    unsafe {
        if (m.create_keyval)(no_copy, free_twin, &mut kv, std::ptr::null_mut()) != MPI_SUCCESS
            || (m.create_keyval)(no_copy, at_finalize, &mut fin, std::ptr::null_mut())
                != MPI_SUCCESS
            || (m.set_attr)(m.comm_self, fin, std::ptr::null_mut()) != MPI_SUCCESS
        {
            return Err("PMPI_Comm_create_keyval/set_attr failed".into());
        }
    }
    *k = Some(kv);
    Ok(kv)
}

fn comm_int(f: CommIntFn, comm: MpiComm) -> Option<c_int> {
    let mut v: c_int = -1;
    // SAFETY: an MPI query on the application's communicator with an int slot.
    (unsafe { f(comm, &mut v) } == MPI_SUCCESS).then_some(v)
}

/// The collective bootstrap of a twin for `comm` (every rank runs it on the same call).
fn bootstrap(m: &Mpi, comm: MpiComm, rank: c_int, size: c_int) -> Twin {
    let n = ciera::comm::id::UNIQUE_ID_BYTES;
    let mut id = [0u8; 128];
    if rank == 0 {
        match UniqueId::new() {
            Ok(u) => id.copy_from_slice(u.as_bytes()),
            // Zeros are not an id: the others see it and stay with MPI.
            Err(e) => log_once("uid", || {
                format!("rank 0 could not make a CIERA unique id: {e}")
            }),
        }
    }
    // SAFETY: a 128-byte buffer described as 128 MPI_BYTEs, on the application's communicator.
    if unsafe { (m.bcast)(id.as_mut_ptr() as *mut c_void, n as c_int, m.byte, 0, comm) }
        != MPI_SUCCESS
    {
        return Twin::PassThrough("PMPI_Bcast of the unique id failed".into());
    }
    let joined = ciera::capi::interpose::join(&id, size as usize, rank as usize);
    let ok = [joined.is_ok() as u8];
    let mut all = vec![0u8; size as usize];
    // SAFETY: one byte from each rank into `size` bytes.
    let rc = unsafe {
        (m.allgather)(
            ok.as_ptr() as *const c_void,
            1,
            m.byte,
            all.as_mut_ptr() as *mut c_void,
            1,
            m.byte,
            comm,
        )
    };
    if rc != MPI_SUCCESS {
        return Twin::PassThrough("PMPI_Allgather of the join flags failed".into());
    }
    let failed: Vec<usize> = (0..size as usize).filter(|&i| all[i] != 1).collect();
    match joined {
        Ok(live) if failed.is_empty() => Twin::Serving(live),
        Ok(_) => Twin::PassThrough(format!("ranks {failed:?} could not start CIERA")),
        Err(e) => Twin::PassThrough(format!("rank {rank} could not start CIERA: {e}")),
    }
}

/// The twin of `comm`, made on first use.
fn twin(m: &Mpi, comm: MpiComm, rank: c_int, size: c_int) -> Result<Arc<TwinCell>, String> {
    let kv = keyval(m)?;
    let mut value: *mut c_void = std::ptr::null_mut();
    let mut flag: c_int = 0;
    // SAFETY: MPI writes the attribute (a pointer) into `value` and the found flag into `flag`.
    if unsafe {
        (m.get_attr)(
            comm,
            kv,
            &mut value as *mut *mut c_void as *mut c_void,
            &mut flag,
        )
    } != MPI_SUCCESS
    {
        return Err("PMPI_Comm_get_attr failed".into());
    }
    if flag != 0 && !value.is_null() {
        let p = value as *const TwinCell;
        // SAFETY: the attribute holds one strong count from `Arc::into_raw` (released only by
        // the delete callback); add one for the caller.
        unsafe { Arc::increment_strong_count(p) };
        // SAFETY: as above.
        return Ok(unsafe { Arc::from_raw(p) });
    }
    let t = bootstrap(m, comm, rank, size);
    if let Twin::PassThrough(why) = &t {
        log_once("bootstrap", || {
            format!("CIERA did not start for a communicator ({why}); its allgathers go to MPI")
        });
    }
    let cell = Arc::new(TwinCell {
        twin: t,
        rank,
        size,
        comm_addr: comm as usize,
        passed_through: AtomicU64::new(0),
        reported: AtomicBool::new(false),
    });
    TWINS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(cell.clone());
    let raw = Arc::into_raw(cell.clone()) as *mut c_void;
    // SAFETY: stores the pointer as the attribute value; the delete callback reclaims it.
    if unsafe { (m.set_attr)(comm, kv, raw) } != MPI_SUCCESS {
        // SAFETY: not stored, so reclaim it here.
        drop(unsafe { Arc::from_raw(raw as *const TwinCell) });
        return Err("PMPI_Comm_set_attr failed".into());
    }
    Ok(cell)
}

struct Call {
    send: *const c_void,
    send_count: c_int,
    send_type: MpiDatatype,
    recv: *mut c_void,
    recv_count: c_int,
    recv_type: MpiDatatype,
    comm: MpiComm,
}

fn pmpi(m: &Mpi, c: &Call) -> c_int {
    // SAFETY: the application's own arguments, to the function it meant to call.
    unsafe {
        (m.allgather)(
            c.send,
            c.send_count,
            c.send_type,
            c.recv,
            c.recv_count,
            c.recv_type,
            c.comm,
        )
    }
}

fn all_gather(c: Call) -> c_int {
    let m = match mpi() {
        Ok(m) => m,
        Err(e) => {
            // Without PMPI we cannot even pass the call on.
            say!("ciera-mpi: {e}");
            return MPI_ERR_INTERN;
        }
    };
    if disabled() {
        return pmpi(m, &c);
    }
    // Everything CIERA does not take goes to MPI (counted for the CIERA_STATS report).
    let unservable = |_why: &'static str| {
        PASSED_UNSERVABLE.fetch_add(1, Ordering::Relaxed);
        pmpi(m, &c)
    };
    let in_place = c.send == MPI_IN_PLACE;
    let Some(&(_, elem)) = m.types.iter().find(|(h, _)| *h == c.recv_type as usize) else {
        return unservable("type");
    };
    if !in_place && (c.send_type != c.recv_type || c.send_count != c.recv_count) {
        return unservable("signature");
    }
    if c.recv_count < 0 || c.comm.is_null() || c.comm == m.comm_null {
        return unservable("args");
    }
    match comm_int(m.comm_test_inter, c.comm) {
        Some(0) => {}
        _ => return unservable("intercomm"),
    }
    let (Some(rank), Some(size)) = (comm_int(m.comm_rank, c.comm), comm_int(m.comm_size, c.comm))
    else {
        return unservable("comm");
    };
    if size < 2 {
        return unservable("size");
    }
    for p in [
        if in_place {
            c.recv as *const c_void
        } else {
            c.send
        },
        c.recv as *const c_void,
    ] {
        if cuda::classify(p) != Location::Host {
            log_once("device", || {
                "device or managed buffers go to MPI (CUDA-aware MPI handles them)".into()
            });
            return unservable("device");
        }
    }
    let cell = match twin(m, c.comm, rank, size) {
        Ok(t) => t,
        Err(e) => {
            log_once("attr", || format!("{e}; allgathers go to MPI"));
            return unservable("attr");
        }
    };
    let live = match &cell.twin {
        Twin::Serving(live) => live,
        Twin::PassThrough(_) => {
            cell.passed_through.fetch_add(1, Ordering::Relaxed);
            return pmpi(m, &c);
        }
    };
    let count = c.recv_count as usize * elem.per_mpi;
    let block = count * elem.dtype.size();
    let send = if in_place {
        (c.recv as usize + rank as usize * block) as *const c_void
    } else {
        c.send
    };
    // SAFETY: MPI's contract for MPI_Allgather's buffers: recvbuf holds size*recvcount elements
    // and sendbuf sendcount (= recvcount) elements of a contiguous type; host memory (checked).
    let served =
        unsafe { gather_buffers(send, c.recv, count, elem.dtype, live.rank(), live.size()) }
            .and_then(|bufs| live.all_gather(bufs, count, elem.dtype, None));
    match served {
        Ok(()) => MPI_SUCCESS,
        Err(Failure { code, message }) => {
            say!("ciera-mpi: rank {rank}: MPI_Allgather: {message}");
            let err = if code == ciera::capi::ResultCode::InvalidArgument {
                MPI_ERR_ARG
            } else {
                MPI_ERR_OTHER
            };
            // The communicator's error handler decides (the default aborts the job).
            // SAFETY: the application's communicator and an MPI error class.
            unsafe { (m.call_errhandler)(c.comm, err) };
            err
        }
    }
}

/// # Safety
/// MPI's contract for `MPI_Allgather`.
#[no_mangle]
pub unsafe extern "C" fn MPI_Allgather(
    sendbuf: *const c_void,
    sendcount: c_int,
    sendtype: MpiDatatype,
    recvbuf: *mut c_void,
    recvcount: c_int,
    recvtype: MpiDatatype,
    comm: MpiComm,
) -> c_int {
    let call = Call {
        send: sendbuf,
        send_count: sendcount,
        send_type: sendtype,
        recv: recvbuf,
        recv_count: recvcount,
        recv_type: recvtype,
        comm,
    };
    match catch_unwind(AssertUnwindSafe(|| all_gather(call))) {
        Ok(rc) => rc,
        Err(_) => {
            say!("ciera-mpi: internal error (panic) in MPI_Allgather");
            MPI_ERR_INTERN
        }
    }
}

// ---- MPI_Alloc_mem / MPI_Free_mem: shared buffers --------------------------------------------

/// `MPI_Aint` of Open MPI on LP64 (`ptrdiff_t`).
type MpiAint = isize;
type AllocMemFn = unsafe extern "C" fn(MpiAint, *mut c_void, *mut c_void) -> c_int;
type FreeMemFn = unsafe extern "C" fn(*mut c_void) -> c_int;

/// MPI's own function `name` (`PMPI_Alloc_mem`, `PMPI_Free_mem`).
fn pmpi_fn(name: &CStr) -> Option<*mut c_void> {
    function(name).map_err(|e| say!("ciera-mpi: {e}")).ok()
}

fn alloc_mem(size: MpiAint, info: *mut c_void, baseptr: *mut c_void) -> c_int {
    let to_mpi = || match pmpi_fn(c"PMPI_Alloc_mem") {
        // SAFETY: PMPI_Alloc_mem has this signature in Open MPI's mpi.h; the arguments are the
        // caller's, unchanged.
        Some(f) => unsafe {
            std::mem::transmute::<*mut c_void, AllocMemFn>(f)(size, info, baseptr)
        },
        None => MPI_ERR_INTERN,
    };
    if disabled()
        || std::env::var("CIERA_MPI_ALLOC_MEM").as_deref() == Ok("0")
        || size < 0
        || baseptr.is_null()
    {
        // MPI reports its own argument errors.
        return to_mpi();
    }
    match shared_mem::alloc(size as usize) {
        Ok(p) => {
            // SAFETY: MPI_Alloc_mem's `baseptr` is, by the standard, the address of a pointer
            // the result is stored in (checked non-null above).
            unsafe { (baseptr as *mut *mut c_void).write(p) };
            MPI_SUCCESS
        }
        Err(e) => {
            log_once("alloc_mem", || {
                format!("ciera-mpi: MPI_Alloc_mem of {size} bytes left to MPI: {e}")
            });
            to_mpi()
        }
    }
}

fn free_mem(base: *mut c_void) -> c_int {
    if shared_mem::free(base) {
        return MPI_SUCCESS;
    }
    match pmpi_fn(c"PMPI_Free_mem") {
        // SAFETY: PMPI_Free_mem has this signature in Open MPI's mpi.h; `base` is the caller's.
        Some(f) => unsafe { std::mem::transmute::<*mut c_void, FreeMemFn>(f)(base) },
        None => MPI_ERR_INTERN,
    }
}

/// # Safety
/// MPI's contract for `MPI_Alloc_mem` (`baseptr` is the address of a `void*`).
#[no_mangle]
pub unsafe extern "C" fn MPI_Alloc_mem(
    size: MpiAint,
    info: *mut c_void,
    baseptr: *mut c_void,
) -> c_int {
    catch_unwind(AssertUnwindSafe(|| alloc_mem(size, info, baseptr))).unwrap_or_else(|_| {
        say!("ciera-mpi: internal error (panic) in MPI_Alloc_mem");
        MPI_ERR_INTERN
    })
}

/// # Safety
/// MPI's contract for `MPI_Free_mem`.
#[no_mangle]
pub unsafe extern "C" fn MPI_Free_mem(base: *mut c_void) -> c_int {
    catch_unwind(AssertUnwindSafe(|| free_mem(base))).unwrap_or_else(|_| {
        say!("ciera-mpi: internal error (panic) in MPI_Free_mem");
        MPI_ERR_INTERN
    })
}
