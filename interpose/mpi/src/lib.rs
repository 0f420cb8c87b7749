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
//! Which calls are served is decided from what MPI guarantees equal on every rank of a call:
//! the type signature (the sequence of basic types one rank's block holds). A call is served
//! when that signature is one basic type from the table in `type_table` (any number of them,
//! however the rank's datatype lays them out: predefined, contiguous, vector, indexed, struct
//! of that one type, resized...), on an intracommunicator of at least 2 ranks, in host memory.
//! Ranks may describe the same data with different datatypes (legal MPI): each decodes its own
//! (`signature`), all reach the same answer, and a rank whose layout is not dense packs its
//! shard and unpacks the gathered blocks itself (PMPI_Pack/PMPI_Unpack through reused staging
//! buffers). The element type the codec is told: MPI_FLOAT → fp32, MPI_DOUBLE and the integer
//! types → raw (exact) bytes, 16-bit types (MPI_UINT16_T, MPI_INT16_T, MPI_SHORT,
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
//! Exports only MPI_Allgather, MPI_Iallgather (passed to MPI, counted for the statistics),
//! MPI_Alloc_mem and MPI_Free_mem (tests/capi_mpi.rs checks `nm -D`). `CIERA_DISABLE=1`
//! passes every call to MPI untouched. `CIERA_STATS=1` prints, at MPI_Finalize (or
//! MPI_Comm_free), one line per communicator that called MPI_Allgather or MPI_Iallgather:
//! what CIERA served and what went to MPI, and why.
//!
//! Every rank of a communicator must make the same choice for a call or the CIERA ranks wait
//! for the others until `CIERA_TIMEOUT`: the choice depends only on the type signature and
//! count (equal on every rank by MPI's rules), the communicator, and the memory kind (host
//! everywhere). MPI_PACKED, which matches any signature, is the one legal mix this cannot see;
//! it goes to MPI, as do types it cannot decode (Fortran parameterized types).

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
const MPI_IN_PLACE: *const c_void = std::ptr::dangling::<c_void>();

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
type EnvelopeFn =
    unsafe extern "C" fn(MpiDatatype, *mut c_int, *mut c_int, *mut c_int, *mut c_int) -> c_int;
type ContentsFn = unsafe extern "C" fn(
    MpiDatatype,
    c_int,
    c_int,
    c_int,
    *mut c_int,
    *mut MpiAint,
    *mut MpiDatatype,
) -> c_int;
type ExtentFn = unsafe extern "C" fn(MpiDatatype, *mut MpiAint, *mut MpiAint) -> c_int;
type TypeFreeFn = unsafe extern "C" fn(*mut MpiDatatype) -> c_int;
type PackFn = unsafe extern "C" fn(
    *const c_void,
    c_int,
    MpiDatatype,
    *mut c_void,
    c_int,
    *mut c_int,
    MpiComm,
) -> c_int;
type UnpackFn = unsafe extern "C" fn(
    *const c_void,
    c_int,
    *mut c_int,
    *mut c_void,
    c_int,
    MpiDatatype,
    MpiComm,
) -> c_int;
type IallgatherFn = unsafe extern "C" fn(
    *const c_void,
    c_int,
    MpiDatatype,
    *mut c_void,
    c_int,
    MpiDatatype,
    MpiComm,
    *mut c_void,
) -> c_int;

/// `MPI_COMBINER_NAMED` (the first of Open MPI's combiner enum): a predefined type.
const MPI_COMBINER_NAMED: c_int = 0;
/// `MPI_Aint` of Open MPI on LP64 (`ptrdiff_t`).
type MpiAint = isize;

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
    envelope: EnvelopeFn,
    contents: ContentsFn,
    extent: ExtentFn,
    true_extent: ExtentFn,
    type_free: TypeFreeFn,
    pack: PackFn,
    unpack: UnpackFn,
    iallgather: IallgatherFn,
    byte: MpiDatatype,
    comm_null: MpiComm,
    comm_self: MpiComm,
    /// (datatype handle, what its elements are, how many per element) for the predefined
    /// types served: the basic ones, and pairs of one basic type (MPI_2INT, ...).
    types: Vec<(usize, Elem, usize)>,
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

/// The predefined types served, by Open MPI global name, with their element meaning and how
/// many basic elements one of them is (2 for the pair types).
fn type_table() -> Result<Vec<(&'static CStr, Elem, usize)>, String> {
    let e = |dtype, per_mpi| Elem { dtype, per_mpi };
    let b16 = match sixteen_bit()? {
        Some(d) => e(d, 1),
        None => e(DType::U8, 2),
    };
    let basic = [
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
    ];
    // Predefined pairs of one basic type: their signature is two of it (a rank may gather
    // 2n x MPI_INT where another gathers n x MPI_2INT).
    let pairs = [
        (c"ompi_mpi_2int", e(DType::I32, 1)),
        (c"ompi_mpi_2integer", e(DType::I32, 1)),
        (c"ompi_mpi_2real", e(DType::F32, 1)),
        (c"ompi_mpi_2dblprec", e(DType::F64, 1)),
    ];
    Ok(basic
        .into_iter()
        .map(|(n, e)| (n, e, 1))
        .chain(pairs.into_iter().map(|(n, e)| (n, e, 2)))
        .collect())
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
        envelope: f!(c"PMPI_Type_get_envelope", EnvelopeFn),
        contents: f!(c"PMPI_Type_get_contents", ContentsFn),
        extent: f!(c"PMPI_Type_get_extent", ExtentFn),
        true_extent: f!(c"PMPI_Type_get_true_extent", ExtentFn),
        type_free: f!(c"PMPI_Type_free", TypeFreeFn),
        pack: f!(c"PMPI_Pack", PackFn),
        unpack: f!(c"PMPI_Unpack", UnpackFn),
        iallgather: f!(c"PMPI_Iallgather", IallgatherFn),
        byte: object(c"ompi_mpi_byte").ok_or("ompi_mpi_byte not found")?,
        comm_null: object(c"ompi_mpi_comm_null").ok_or("ompi_mpi_comm_null not found")?,
        comm_self: object(c"ompi_mpi_comm_self").ok_or("ompi_mpi_comm_self not found")?,
        types: Vec::new(),
    };
    for (name, elem, per) in type_table()? {
        let Some(handle) = object(name) else { continue };
        let mut size: c_int = 0;
        // SAFETY: a predefined datatype handle and an int slot; PMPI_Type_size only reads the type.
        let rc = unsafe { (m.type_size)(handle, &mut size) };
        // Serve a type only if its size is what the table assumes (MPI_LONG is 8 bytes on LP64).
        if rc == MPI_SUCCESS && size as usize == elem.dtype.size() * elem.per_mpi * per {
            m.types.push((handle as usize, elem, per));
        }
    }
    Ok(m)
}

/// Loaded on the first MPI_Allgather (MPI is initialized by then). Err: why nothing is served.
fn mpi() -> &'static Result<Mpi, String> {
    static MPI: OnceLock<Result<Mpi, String>> = OnceLock::new();
    MPI.get_or_init(load)
}

// ---- type signatures ---------------------------------------------------------------------------

/// A datatype as CIERA serves it, from its type signature: one kind of basic element, how many
/// of them one element of the datatype holds, and whether this rank's datatype lays them out
/// densely (no gaps, starting at the buffer, elements back to back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sig {
    elem: Elem,
    per_type: usize,
    dense: bool,
}

/// How deep a derived datatype may nest before it is left to MPI.
const MAX_TYPE_DEPTH: usize = 16;

/// The signature of `t`, or None when it is not one basic type CIERA serves (heterogeneous,
/// a type it does not know, MPI_DATATYPE_NULL, MPI_PACKED). A function of the type signature
/// only (plus the layout, `dense`), so ranks describing the same data differently agree.
fn signature(m: &Mpi, t: MpiDatatype) -> Option<Sig> {
    let (elem, basic) = basic_elements(m, t, 0)?;
    let size = type_size(m, t)?;
    let unit = elem.dtype.size() * elem.per_mpi;
    if size % unit != 0 || size / unit != basic {
        return None;
    }
    let (mut lb, mut extent, mut tlb, mut textent): (MpiAint, MpiAint, MpiAint, MpiAint) =
        (0, 0, 0, 0);
    // SAFETY: a datatype handle of the application's call and writable MPI_Aint slots.
    let ok = unsafe {
        (m.extent)(t, &mut lb, &mut extent) == MPI_SUCCESS
            && (m.true_extent)(t, &mut tlb, &mut textent) == MPI_SUCCESS
    };
    if !ok {
        return None;
    }
    let size = size as MpiAint;
    Some(Sig {
        elem,
        per_type: basic,
        dense: lb == 0 && extent == size && tlb == 0 && textent == size,
    })
}

fn type_size(m: &Mpi, t: MpiDatatype) -> Option<usize> {
    let mut size: c_int = 0;
    // SAFETY: a datatype handle and an int slot; PMPI_Type_size only reads the type.
    (unsafe { (m.type_size)(t, &mut size) } == MPI_SUCCESS && size >= 0).then_some(size as usize)
}

/// The one basic element kind of `t`'s signature and how many of them one `t` holds.
fn basic_elements(m: &Mpi, t: MpiDatatype, depth: usize) -> Option<(Elem, usize)> {
    if let Some(&(_, elem, per)) = m.types.iter().find(|(h, _, _)| *h == t as usize) {
        return Some((elem, per));
    }
    if depth >= MAX_TYPE_DEPTH || t.is_null() {
        return None;
    }
    let (mut ni, mut na, mut nd, mut combiner) = (0, 0, 0, -1);
    // SAFETY: the application's datatype handle and writable int slots.
    if unsafe { (m.envelope)(t, &mut ni, &mut na, &mut nd, &mut combiner) } != MPI_SUCCESS
        || combiner == MPI_COMBINER_NAMED
        || nd <= 0
        || ni < 0
        || na < 0
    {
        // A predefined type not in the table, or a Fortran parameterized one: not served.
        return None;
    }
    let mut ints = vec![0 as c_int; ni as usize];
    let mut addrs = vec![0 as MpiAint; na as usize];
    let mut types = vec![std::ptr::null_mut::<c_void>(); nd as usize];
    // SAFETY: arrays of exactly the lengths the envelope gave.
    if unsafe {
        (m.contents)(
            t,
            ni,
            na,
            nd,
            ints.as_mut_ptr(),
            addrs.as_mut_ptr(),
            types.as_mut_ptr(),
        )
    } != MPI_SUCCESS
    {
        return None;
    }
    let mut found: Option<Elem> = None;
    let mut homogeneous = true;
    for &child in &types {
        match basic_elements(m, child, depth + 1) {
            Some((e, _)) if found.is_none_or(|f| f == e) => found = Some(e),
            _ => homogeneous = false,
        }
        free_if_derived(m, child);
    }
    let elem = found.filter(|_| homogeneous)?;
    let unit = elem.dtype.size() * elem.per_mpi;
    let size = type_size(m, t)?;
    (size % unit == 0).then_some((elem, size / unit))
}

/// Datatypes MPI_Type_get_contents returns for derived types are new handles the caller frees.
fn free_if_derived(m: &Mpi, t: MpiDatatype) {
    let (mut ni, mut na, mut nd, mut combiner) = (0, 0, 0, MPI_COMBINER_NAMED);
    // SAFETY: a handle MPI just returned, and int slots.
    let rc = unsafe { (m.envelope)(t, &mut ni, &mut na, &mut nd, &mut combiner) };
    if rc == MPI_SUCCESS && combiner != MPI_COMBINER_NAMED {
        let mut t = t;
        // SAFETY: a derived datatype handle returned to us by MPI_Type_get_contents.
        unsafe { (m.type_free)(&mut t) };
    }
}

use ciera::capi::interpose::{disabled, env_flag, Twin};

/// Prints `msg` to stderr the first time a given `reason` comes up in this process.
fn log_once(reason: &'static str, msg: impl FnOnce() -> String) {
    ciera::capi::interpose::log_once("ciera-mpi", reason, msg)
}

// ---- per-communicator twins ------------------------------------------------------------------

/// Why a call went to MPI, as the statistics name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Passed {
    /// The type signature is not one basic type CIERA serves (or not decodable).
    Type,
    /// Send and receive signatures differ, or counts are negative (MPI reports the error).
    Args,
    Intercommunicator,
    OneRank,
    DeviceMemory,
    Nonblocking,
    /// CIERA could not start on every rank of the communicator.
    NotStarted,
    /// A shard too big for MPI_Pack's int sizes, in a layout that needs packing.
    TooBig,
}

impl Passed {
    const ALL: [Passed; 8] = [
        Passed::Type,
        Passed::Args,
        Passed::Intercommunicator,
        Passed::OneRank,
        Passed::DeviceMemory,
        Passed::Nonblocking,
        Passed::NotStarted,
        Passed::TooBig,
    ];

    fn name(self) -> &'static str {
        match self {
            Passed::Type => "datatype not served",
            Passed::Args => "send/recv signatures differ",
            Passed::Intercommunicator => "intercommunicator",
            Passed::OneRank => "one-rank communicator",
            Passed::DeviceMemory => "device memory",
            Passed::Nonblocking => "MPI_Iallgather",
            Passed::NotStarted => "CIERA not started",
            Passed::TooBig => "too big to pack",
        }
    }
}

/// What the attribute on an MPI communicator points to (a leaked `Arc`, reclaimed by the
/// attribute's delete callback): made by the communicator's first MPI_Allgather or
/// MPI_Iallgather, with the CIERA communicator serving it (its twin) made by its first call
/// CIERA can serve.
struct CommCell {
    twin: OnceLock<Twin>,
    rank: c_int,
    size: c_int,
    comm_addr: usize,
    /// Calls that went to MPI, per reason (`Passed::ALL` order).
    passed: [AtomicU64; 8],
    /// Packing buffers for ranks whose datatypes are not dense, reused call after call (their
    /// addresses name the tensor for the caches).
    staging: Mutex<(Vec<u8>, Vec<u8>)>,
    reported: AtomicBool,
}

impl CommCell {
    fn pass(&self, why: Passed) {
        let i = Passed::ALL.iter().position(|&p| p == why).unwrap_or(0);
        self.passed[i].fetch_add(1, Ordering::Relaxed);
    }

    /// One line per communicator, always (`CIERA_STATS=1`): what CIERA served, what went to
    /// MPI and why.
    fn report(&self) {
        if !env_flag("CIERA_STATS") || self.reported.swap(true, Ordering::SeqCst) {
            return;
        }
        let counts: Vec<(Passed, u64)> = Passed::ALL
            .iter()
            .zip(&self.passed)
            .map(|(&p, n)| (p, n.load(Ordering::Relaxed)))
            .collect();
        let total: u64 = counts.iter().map(|c| c.1).sum();
        let reasons: Vec<String> = counts
            .iter()
            .filter(|c| c.1 > 0)
            .map(|(p, n)| format!("{}: {n}", p.name()))
            .collect();
        let passed = if reasons.is_empty() {
            format!("{total} passed to MPI")
        } else {
            format!("{total} passed to MPI ({})", reasons.join(", "))
        };
        let served = match self.twin.get() {
            Some(Twin::Serving(live)) => live.stats().summary(),
            Some(Twin::PassThrough(why)) => format!("0 allgathers served by CIERA ({why})"),
            None => "0 allgathers served by CIERA".to_string(),
        };
        say!(
            "ciera-mpi: rank {}/{} comm {:#x}: {served}, {passed}",
            self.rank,
            self.size,
            self.comm_addr
        );
    }
}

/// Every communicator cell made and not yet freed, for the report at MPI_Finalize.
static CELLS: Mutex<Vec<Arc<CommCell>>> = Mutex::new(Vec::new());
/// Calls on no communicator CIERA can attach to (MPI_COMM_NULL, a failed query), by reason.
static PASSED_ELSEWHERE: AtomicU64 = AtomicU64::new(0);

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
        let cell = unsafe { Arc::from_raw(value as *const CommCell) };
        cell.report();
        CELLS
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
        let cells = std::mem::take(&mut *CELLS.lock().unwrap_or_else(|p| p.into_inner()));
        for c in &cells {
            c.report();
        }
        let elsewhere = PASSED_ELSEWHERE.load(Ordering::Relaxed);
        if env_flag("CIERA_STATS") && elsewhere > 0 {
            say!("ciera-mpi: {elsewhere} allgathers on no valid communicator passed to MPI");
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

/// The cell of `comm`, made on its first call (not collective: no twin yet).
fn cell(m: &Mpi, comm: MpiComm, rank: c_int, size: c_int) -> Result<Arc<CommCell>, String> {
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
        let p = value as *const CommCell;
        // SAFETY: the attribute holds one strong count from `Arc::into_raw` (released only by
        // the delete callback); add one for the caller.
        unsafe { Arc::increment_strong_count(p) };
        // SAFETY: as above.
        return Ok(unsafe { Arc::from_raw(p) });
    }
    let cell = Arc::new(CommCell {
        twin: OnceLock::new(),
        rank,
        size,
        comm_addr: comm as usize,
        passed: Default::default(),
        staging: Mutex::new((Vec::new(), Vec::new())),
        reported: AtomicBool::new(false),
    });
    CELLS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(cell.clone());
    let raw = Arc::into_raw(cell.clone()) as *mut c_void;
    // SAFETY: stores the pointer as the attribute value; the delete callback reclaims it.
    if unsafe { (m.set_attr)(comm, kv, raw) } != MPI_SUCCESS {
        // SAFETY: not stored, so reclaim it here.
        drop(unsafe { Arc::from_raw(raw as *const CommCell) });
        return Err("PMPI_Comm_set_attr failed".into());
    }
    Ok(cell)
}

/// The twin of a cell's communicator, made by the first call CIERA can serve (every rank
/// makes that call, by the signature rule, so the bootstrap is collective).
fn twin<'c>(m: &Mpi, comm: MpiComm, cell: &'c CommCell) -> &'c Twin {
    cell.twin.get_or_init(|| {
        let t = bootstrap(m, comm, cell.rank, cell.size);
        if let Twin::PassThrough(why) = &t {
            log_once("bootstrap", || {
                format!("CIERA did not start for a communicator ({why}); its allgathers go to MPI")
            });
        }
        t
    })
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

/// The communicator's cell, or None (counted) when the call is on no communicator CIERA can
/// attach to.
fn cell_of(m: &Mpi, comm: MpiComm) -> Option<Arc<CommCell>> {
    let fail = || {
        PASSED_ELSEWHERE.fetch_add(1, Ordering::Relaxed);
        None
    };
    if comm.is_null() || comm == m.comm_null {
        return fail();
    }
    let (Some(rank), Some(size)) = (comm_int(m.comm_rank, comm), comm_int(m.comm_size, comm))
    else {
        return fail();
    };
    match cell(m, comm, rank, size) {
        Ok(c) => Some(c),
        Err(e) => {
            log_once("attr", || format!("{e}; allgathers go to MPI"));
            fail()
        }
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
    let Some(cell) = cell_of(m, c.comm) else {
        return pmpi(m, &c);
    };
    // Everything CIERA does not take goes to MPI, counted per reason for CIERA_STATS.
    let pass = |why: Passed| {
        cell.pass(why);
        pmpi(m, &c)
    };
    let in_place = c.send == MPI_IN_PLACE;
    // The decision reads only what MPI guarantees equal on every rank: the type signature and
    // count of a block, and the communicator.
    let Some(rsig) = signature(m, c.recv_type) else {
        return pass(Passed::Type);
    };
    if c.recv_count < 0 {
        return pass(Passed::Args);
    }
    let basic = c.recv_count as usize * rsig.per_type;
    let ssig = if in_place {
        None
    } else {
        let Some(ssig) = signature(m, c.send_type) else {
            return pass(Passed::Type);
        };
        if c.send_count < 0
            || ssig.elem != rsig.elem
            || c.send_count as usize * ssig.per_type != basic
        {
            return pass(Passed::Args);
        }
        Some(ssig)
    };
    match comm_int(m.comm_test_inter, c.comm) {
        Some(0) => {}
        _ => return pass(Passed::Intercommunicator),
    }
    if cell.size < 2 {
        return pass(Passed::OneRank);
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
            return pass(Passed::DeviceMemory);
        }
    }
    let elem = rsig.elem;
    let count = basic * elem.per_mpi;
    let block = count * elem.dtype.size();
    // In place there is no send type: the shard is in the receive layout.
    let dense_send = ssig.is_none_or(|s| s.dense);
    if (!rsig.dense || !dense_send)
        && block.saturating_mul(cell.size as usize) > c_int::MAX as usize
    {
        return pass(Passed::TooBig);
    }
    let live = match twin(m, c.comm, &cell) {
        Twin::Serving(live) => live,
        Twin::PassThrough(_) => return pass(Passed::NotStarted),
    };
    let rank = cell.rank as usize;
    let served = if rsig.dense && dense_send {
        let send = if in_place {
            (c.recv as usize + rank * block) as *const c_void
        } else {
            c.send
        };
        // SAFETY: MPI's contract for MPI_Allgather's buffers: recvbuf holds size*recvcount
        // elements and sendbuf sendcount elements of dense types of `block` bytes per rank;
        // host memory (checked).
        unsafe { gather_buffers(send, c.recv, count, elem.dtype, live.rank(), live.size()) }
            .and_then(|bufs| live.all_gather(bufs, count, elem.dtype, None))
    } else {
        staged(m, &c, &cell, live, rsig, count, block)
    };
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

/// An allgather where this rank's send or receive datatype is not dense: its shard is packed
/// into a staging buffer, the blocks are gathered densely (into a second staging buffer when
/// the receive layout has gaps) and unpacked into the caller's layout. The other ranks do not
/// know or care: on the wire every block is the same signature.
fn staged(
    m: &Mpi,
    c: &Call,
    cell: &CommCell,
    live: &ciera::capi::LiveComm,
    rsig: Sig,
    count: usize,
    block: usize,
) -> Result<(), Failure> {
    let size = cell.size as usize;
    let rank = cell.rank as usize;
    let mut staging = cell.staging.lock().unwrap_or_else(|p| p.into_inner());
    let (send_buf, recv_buf) = &mut *staging;
    let pack_failed = |what: &str| Failure::invalid_argument(format!("PMPI_{what} failed"));
    // This rank's shard, packed (in place: its block of recvbuf, in the receive layout).
    send_buf.resize(block, 0);
    let (src, src_count, src_type) = if c.send == MPI_IN_PLACE {
        let mut lb: MpiAint = 0;
        let mut extent: MpiAint = 0;
        // SAFETY: the application's receive datatype and MPI_Aint slots.
        if unsafe { (m.extent)(c.recv_type, &mut lb, &mut extent) } != MPI_SUCCESS {
            return Err(pack_failed("Type_get_extent"));
        }
        let at = c.recv as isize + rank as isize * c.recv_count as isize * extent;
        (at as *const c_void, c.recv_count, c.recv_type)
    } else {
        (c.send, c.send_count, c.send_type)
    };
    let mut pos: c_int = 0;
    // SAFETY: MPI's contract for the caller's buffer and datatype; `send_buf` holds `block`
    // bytes, exactly the packed size of the shard (the signature says so).
    if unsafe {
        (m.pack)(
            src,
            src_count,
            src_type,
            send_buf.as_mut_ptr() as *mut c_void,
            block as c_int,
            &mut pos,
            c.comm,
        )
    } != MPI_SUCCESS
        || pos as usize != block
    {
        return Err(pack_failed("Pack"));
    }
    let total = block * size;
    let into_user = rsig.dense;
    let recv_ptr = if into_user {
        c.recv
    } else {
        recv_buf.resize(total, 0);
        recv_buf.as_mut_ptr() as *mut c_void
    };
    // SAFETY: `send_buf` holds this rank's packed shard (`block` bytes); the destination is the
    // caller's dense receive buffer (MPI's contract: size*recvcount elements) or `recv_buf`,
    // `total` bytes; the two do not overlap.
    unsafe {
        gather_buffers(
            send_buf.as_ptr() as *const c_void,
            recv_ptr,
            count,
            rsig.elem.dtype,
            live.rank(),
            live.size(),
        )
    }
    .and_then(|bufs| live.all_gather(bufs, count, rsig.elem.dtype, None))?;
    if !into_user {
        let mut pos: c_int = 0;
        // SAFETY: `recv_buf` holds `total` packed bytes: size*recvcount elements of the
        // receive datatype, unpacked into the caller's buffer by MPI's contract.
        if unsafe {
            (m.unpack)(
                recv_buf.as_ptr() as *const c_void,
                total as c_int,
                &mut pos,
                c.recv,
                cell.size * c.recv_count,
                c.recv_type,
                c.comm,
            )
        } != MPI_SUCCESS
        {
            return Err(pack_failed("Unpack"));
        }
    }
    Ok(())
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

/// Passed to MPI (CIERA has no nonblocking allgather yet), and counted, so `CIERA_STATS`
/// shows a communicator that only uses it.
///
/// # Safety
/// MPI's contract for `MPI_Iallgather`.
#[no_mangle]
pub unsafe extern "C" fn MPI_Iallgather(
    sendbuf: *const c_void,
    sendcount: c_int,
    sendtype: MpiDatatype,
    recvbuf: *mut c_void,
    recvcount: c_int,
    recvtype: MpiDatatype,
    comm: MpiComm,
    request: *mut c_void,
) -> c_int {
    let body = || {
        let m = match mpi() {
            Ok(m) => m,
            Err(e) => {
                say!("ciera-mpi: {e}");
                return MPI_ERR_INTERN;
            }
        };
        if !disabled() {
            if let Some(cell) = cell_of(m, comm) {
                cell.pass(Passed::Nonblocking);
            }
        }
        // SAFETY: the application's own arguments, to the function it meant to call.
        unsafe {
            (m.iallgather)(
                sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm, request,
            )
        }
    };
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|_| {
        say!("ciera-mpi: internal error (panic) in MPI_Iallgather");
        MPI_ERR_INTERN
    })
}

// ---- MPI_Alloc_mem / MPI_Free_mem: shared buffers --------------------------------------------

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
