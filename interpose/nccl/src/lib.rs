//! `libciera_nccl.so`: put in front of the real `libnccl.so.2` with `LD_PRELOAD`, it serves
//! `ncclAllGather` (and `pncclAllGather`, the profiling name) with CIERA and leaves everything
//! else to NCCL.
//!
//! It defines only those two symbols (tests/capi_nccl.rs checks `nm -D`), so every other NCCL
//! function an application calls binds to the real library as if we were not there. What we
//! need of the real library (ncclAllGather for the fallback and the bootstrap, ncclBroadcast,
//! ncclCommCount, ncclCommUserRank) is looked up lazily with `dlsym(RTLD_NEXT, ...)`.
//!
//! Per real NCCL communicator, on its first AllGather that we can serve, a CIERA communicator is
//! bootstrapped *through the real one*: rank 0 makes a `UniqueId` and the real ncclBroadcast
//! carries it to the others, then a one-byte real ncclAllGather makes every rank agree that all
//! joined (else all of them stay with NCCL). No rendezvous configuration is needed.
//!
//! Served: a valid `ncclDataType_t`, a communicator whose CIERA twin came up, and buffers both
//! in host memory or both in CUDA device memory (the driver, if loaded, says which). Host
//! memory: the stream's earlier work is waited for first (`cuStreamSynchronize`) and the
//! gather has completed when the call returns. Device memory: stream-ordered, as NCCL
//! (`ciera::capi::LiveComm::all_gather_device`: queued behind the stream's work, the stream's
//! later work waits for it; CUDA IPC between the ranks of one host, else host-staged).
//! Everything else goes to the real ncclAllGather, and the reason is printed once to stderr.
//!
//! Environment: `CIERA_DISABLE=1` passes every call through untouched; `CIERA_STATS=1` prints
//! per-communicator counts to stderr at exit; `CIERA_TIMEOUT`, `CIERA_TRANSPORT`, ... configure
//! the CIERA communicators as for `Communicator::from_env`.
//!
//! Every rank of a communicator must make the same choice for each call, or the ranks that
//! chose CIERA wait for the others until `CIERA_TIMEOUT`: the choice depends only on the
//! datatype (equal on every rank by NCCL's rules) and on the memory kind of the buffers (the
//! same on every rank in practice). Limitations: the first AllGather of a communicator must
//! not be inside ncclGroupStart/End (the bootstrap's real collectives would only run at
//! ncclGroupEnd); a NCCL communicator destroyed and another created at the same address reuses
//! the old CIERA twin (we do not see ncclCommDestroy; the twin is checked against the new
//! communicator's size and rank only).

use std::collections::HashMap;
use std::ffi::{c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use ciera::capi::ResultCode;
use ciera::capi::{gather_buffers, Failure};
use ciera::comm::UniqueId;
use ciera::gpu::driver::{self as cuda, PinnedHost};
use ciera::DType;

/// One line to stderr in a single write, so lines from ranks sharing a terminal or a pipe do
/// not interleave mid-line (eprintln! writes each formatted piece separately).
macro_rules! say {
    ($($arg:tt)*) => {{
        let line = format!("{}\n", format_args!($($arg)*));
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }};
}

type NcclComm = *mut c_void;
type AllGatherFn =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, NcclComm, *mut c_void) -> c_int;
type BroadcastFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    NcclComm,
    *mut c_void,
) -> c_int;
type CommIntFn = unsafe extern "C" fn(NcclComm, *mut c_int) -> c_int;

const NCCL_SUCCESS: c_int = 0;
const NCCL_UINT8: c_int = 1;

/// The real library's functions (whatever comes after us in the lookup order).
struct Real {
    all_gather: Option<AllGatherFn>,
    p_all_gather: Option<AllGatherFn>,
    broadcast: Option<BroadcastFn>,
    comm_count: Option<CommIntFn>,
    user_rank: Option<CommIntFn>,
}

fn next_symbol(name: &CStr) -> *mut c_void {
    // SAFETY: RTLD_NEXT lookup of a NUL-terminated name; no memory is handed over.
    unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) }
}

fn real() -> &'static Real {
    static REAL: OnceLock<Real> = OnceLock::new();
    REAL.get_or_init(|| {
        let f = |name: &CStr| {
            let p = next_symbol(name);
            (!p.is_null()).then_some(p)
        };
        // SAFETY: each symbol, where the real libnccl defines it, has the signature of nccl.h
        // that the type it is cast to spells out.
        unsafe {
            Real {
                all_gather: f(c"ncclAllGather")
                    .map(|p| std::mem::transmute::<*mut c_void, AllGatherFn>(p)),
                p_all_gather: f(c"pncclAllGather")
                    .map(|p| std::mem::transmute::<*mut c_void, AllGatherFn>(p)),
                broadcast: f(c"ncclBroadcast")
                    .map(|p| std::mem::transmute::<*mut c_void, BroadcastFn>(p)),
                comm_count: f(c"ncclCommCount")
                    .map(|p| std::mem::transmute::<*mut c_void, CommIntFn>(p)),
                user_rank: f(c"ncclCommUserRank")
                    .map(|p| std::mem::transmute::<*mut c_void, CommIntFn>(p)),
            }
        }
    })
}

use ciera::capi::interpose::{disabled, env_flag, Twin};

/// Prints `msg` to stderr the first time a given `reason` comes up in this process.
fn log_once(reason: &'static str, msg: impl FnOnce() -> String) {
    ciera::capi::interpose::log_once("ciera-nccl", reason, msg)
}

struct CommSlot {
    nccl_rank: c_int,
    nccl_size: c_int,
    twin: Option<Twin>,
    passed_through: u64,
}

/// Slots by real communicator address. A slot has its own lock so that bootstrapping one
/// communicator does not hold up calls on another.
fn slots() -> MutexGuard<'static, HashMap<usize, Arc<Mutex<CommSlot>>>> {
    static SLOTS: OnceLock<Mutex<HashMap<usize, Arc<Mutex<CommSlot>>>>> = OnceLock::new();
    SLOTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

static PASSED_UNSERVABLE: AtomicU64 = AtomicU64::new(0);

fn comm_int(f: Option<CommIntFn>, comm: NcclComm, what: &str) -> Result<c_int, String> {
    let f = f.ok_or_else(|| format!("the real NCCL has no {what}"))?;
    let mut v: c_int = -1;
    // SAFETY: a real NCCL function given the application's communicator and an int slot.
    let rc = unsafe { f(comm, &mut v) };
    if rc != NCCL_SUCCESS {
        return Err(format!("{what} returned {rc}"));
    }
    Ok(v)
}

/// A small buffer the real NCCL can read and write: pinned host memory when CUDA is loaded,
/// plain memory otherwise (a host-only NCCL, like the test's stand-in).
enum ExchangeBuf {
    Pinned(PinnedHost),
    Plain(Vec<u8>),
}

impl ExchangeBuf {
    fn new(len: usize) -> Result<ExchangeBuf, String> {
        if cuda::driver_loaded() {
            PinnedHost::new(len)
                .map(ExchangeBuf::Pinned)
                .ok_or_else(|| {
                    "cuMemAllocHost failed (no CUDA context on this thread?)".to_string()
                })
        } else {
            Ok(ExchangeBuf::Plain(vec![0; len]))
        }
    }

    fn bytes(&mut self) -> &mut [u8] {
        match self {
            ExchangeBuf::Pinned(p) => p.as_mut_slice(),
            ExchangeBuf::Plain(v) => v,
        }
    }
}

/// The collective part of making a CIERA twin: every rank of `comm` runs it on its first
/// servable AllGather. Returns the twin every rank agreed on.
fn bootstrap(comm: NcclComm, rank: c_int, size: c_int, stream: *mut c_void) -> Twin {
    let r = real();
    let (Some(all_gather), nranks, me) = (r.all_gather, size as usize, rank as usize) else {
        return Twin::PassThrough("the real NCCL has no ncclAllGather".into());
    };
    let id_bytes = ciera::comm::id::UNIQUE_ID_BYTES;
    // One buffer: [0, 128) the id, then one agreement byte per rank.
    let mut buf = match ExchangeBuf::new(id_bytes + nranks) {
        Ok(b) => b,
        // Every rank has CUDA or none has; all fail alike.
        Err(e) => return Twin::PassThrough(e),
    };
    if me == 0 {
        match UniqueId::new() {
            Ok(id) => buf.bytes()[..id_bytes].copy_from_slice(id.as_bytes()),
            // Zeros are not an id: the others see the failure and stay with NCCL too.
            Err(e) => log_once("uid", || {
                format!("rank 0 could not make a CIERA unique id: {e}")
            }),
        }
    }
    let p = buf.bytes().as_mut_ptr();
    // SAFETY: the real NCCL reads and writes `id_bytes` bytes of a buffer that has them, on the
    // application's communicator and stream, as the application's own calls do.
    let rc = unsafe {
        match r.broadcast {
            Some(bcast) => bcast(
                p as *const c_void,
                p as *mut c_void,
                id_bytes,
                NCCL_UINT8,
                0,
                comm,
                stream,
            ),
            None => return Twin::PassThrough("the real NCCL has no ncclBroadcast".into()),
        }
    };
    if rc != NCCL_SUCCESS {
        return Twin::PassThrough(format!("bootstrap ncclBroadcast returned {rc}"));
    }
    // SAFETY: the application's stream, as it handed it to NCCL.
    if let Err(rc) = unsafe { cuda::synchronize(stream) } {
        return Twin::PassThrough(format!(
            "cuStreamSynchronize after the bootstrap broadcast returned {rc}"
        ));
    }
    let mut id = [0u8; 128];
    id.copy_from_slice(&buf.bytes()[..id_bytes]);
    let joined = ciera::capi::interpose::join(&id, nranks, me);
    // Agree: every rank says whether it joined; CIERA serves only if all did.
    let agree = id_bytes;
    buf.bytes()[agree + me] = joined.is_ok() as u8;
    // SAFETY: in place (send = recv + rank*1), `nranks` bytes inside the buffer.
    let rc = unsafe {
        all_gather(
            p.add(agree + me) as *const c_void,
            p.add(agree) as *mut c_void,
            1,
            NCCL_UINT8,
            comm,
            stream,
        )
    };
    if rc != NCCL_SUCCESS {
        return Twin::PassThrough(format!("bootstrap ncclAllGather returned {rc}"));
    }
    // SAFETY: the application's stream, as it handed it to NCCL.
    if let Err(rc) = unsafe { cuda::synchronize(stream) } {
        return Twin::PassThrough(format!(
            "cuStreamSynchronize after the bootstrap allgather returned {rc}"
        ));
    }
    let failed: Vec<usize> = (0..nranks)
        .filter(|&i| buf.bytes()[agree + i] != 1)
        .collect();
    match joined {
        Ok(live) if failed.is_empty() => Twin::Serving(live),
        Ok(_) => Twin::PassThrough(format!("ranks {failed:?} could not start CIERA")),
        Err(e) => Twin::PassThrough(format!("rank {me} could not start CIERA: {e}")),
    }
}

fn pass_through(
    real_fn: Option<AllGatherFn>,
    args: (
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        NcclComm,
        *mut c_void,
    ),
) -> c_int {
    match real_fn.or(real().all_gather) {
        // SAFETY: the application's own arguments, to the function it meant to call.
        Some(f) => unsafe { f(args.0, args.1, args.2, args.3, args.4, args.5) },
        None => {
            log_once("noreal", || {
                "no real ncclAllGather after libciera_nccl.so in the lookup order".into()
            });
            ResultCode::InternalError as c_int
        }
    }
}

fn stats_at_exit() {
    static REGISTERED: OnceLock<()> = OnceLock::new();
    if !env_flag("CIERA_STATS") {
        return;
    }
    REGISTERED.get_or_init(|| {
        extern "C" fn print_stats() {
            let _ = catch_unwind(|| {
                let slots = slots();
                for (addr, slot) in slots.iter() {
                    let Ok(s) = slot.try_lock() else { continue };
                    match &s.twin {
                        Some(Twin::Serving(live)) => {
                            say!(
                                "ciera-nccl: rank {}/{} nccl comm {addr:#x}: {}, {} passed to NCCL",
                                s.nccl_rank,
                                s.nccl_size,
                                live.stats().summary(),
                                s.passed_through
                            );
                        }
                        Some(Twin::PassThrough(why)) => say!(
                            "ciera-nccl: rank {}/{} nccl comm {addr:#x}: 0 served by CIERA ({why}), {} passed to NCCL",
                            s.nccl_rank, s.nccl_size, s.passed_through
                        ),
                        None => {}
                    }
                }
                let early = PASSED_UNSERVABLE.load(Ordering::Relaxed);
                if early > 0 {
                    say!("ciera-nccl: {early} allgathers CIERA cannot serve passed to NCCL (reasons above)");
                }
            });
        }
        // SAFETY: registers a function with C linkage and no arguments, as atexit expects.
        unsafe { libc::atexit(print_stats) };
    });
}

/// What this rank does with one call.
fn all_gather_entry(
    real_fn: Option<AllGatherFn>,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: c_int,
    comm: NcclComm,
    stream: *mut c_void,
) -> c_int {
    let args = (send, recv, count, datatype, comm, stream);
    if disabled() {
        return pass_through(real_fn, args);
    }
    stats_at_exit();
    let early_pass = |reason: &'static str, msg: String| {
        log_once(reason, || {
            format!("{msg}; passing ncclAllGather to the real NCCL")
        });
        PASSED_UNSERVABLE.fetch_add(1, Ordering::Relaxed);
        pass_through(real_fn, args)
    };
    let Some(dtype) = u8::try_from(datatype).ok().and_then(DType::from_code) else {
        return early_pass(
            "dtype",
            format!("datatype {datatype} is not one CIERA knows"),
        );
    };
    if comm.is_null() {
        return early_pass("nullcomm", "comm is NULL".into());
    }
    let device = match ciera::capi::on_device(send, recv) {
        Ok(d) => d,
        Err(f) => return early_pass("kind", f.message),
    };
    let (rank, size) = match (
        comm_int(real().user_rank, comm, "ncclCommUserRank"),
        comm_int(real().comm_count, comm, "ncclCommCount"),
    ) {
        (Ok(r), Ok(s)) => (r, s),
        (Err(e), _) | (_, Err(e)) => return early_pass("commquery", e),
    };
    let slot = slots()
        .entry(comm as usize)
        .or_insert_with(|| {
            Arc::new(Mutex::new(CommSlot {
                nccl_rank: rank,
                nccl_size: size,
                twin: None,
                passed_through: 0,
            }))
        })
        .clone();
    let mut s = slot.lock().unwrap_or_else(|p| p.into_inner());
    if s.twin.is_some() && (s.nccl_rank != rank || s.nccl_size != size) {
        // Another communicator at a freed one's address: start over.
        *s = CommSlot {
            nccl_rank: rank,
            nccl_size: size,
            twin: None,
            passed_through: 0,
        };
    }
    if s.twin.is_none() {
        let twin = bootstrap(comm, rank, size, stream);
        if let Twin::PassThrough(why) = &twin {
            log_once("bootstrap", || {
                format!("CIERA did not start for a communicator ({why}); its allgathers go to NCCL")
            });
        }
        s.twin = Some(twin);
    }
    let live = match &s.twin {
        Some(Twin::Serving(live)) => live.clone(),
        _ => {
            s.passed_through += 1;
            drop(s);
            return pass_through(real_fn, args);
        }
    };
    drop(s);
    let served = if device {
        // SAFETY: NCCL's contract for ncclAllGather's buffers (device memory, checked) and
        // stream, which the application handed us.
        unsafe { live.all_gather_device(send, recv, count, dtype, None, stream) }
    } else {
        // SAFETY: the application's stream, as it handed it to NCCL.
        if let Err(rc) = unsafe { cuda::synchronize(stream) } {
            say!("ciera-nccl: cuStreamSynchronize before an allgather returned {rc}");
            return ResultCode::UnhandledCudaError as c_int;
        }
        // SAFETY: NCCL's contract for ncclAllGather's buffers, on host memory (checked above).
        unsafe { gather_buffers(send, recv, count, dtype, live.rank(), live.size()) }
            .and_then(|bufs| live.all_gather(bufs, count, dtype, None))
    };
    match served {
        Ok(()) => NCCL_SUCCESS,
        Err(Failure { code, message }) => {
            say!("ciera-nccl: rank {rank}: ncclAllGather: {message}");
            code as c_int
        }
    }
}

fn guarded(name: &str, f: impl FnOnce() -> c_int) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(rc) => rc,
        Err(_) => {
            say!("ciera-nccl: internal error (panic) in {name}");
            ResultCode::InternalError as c_int
        }
    }
}

/// Defines an exported NCCL all-gather entry point (`$name`) that serves host memory with
/// CIERA and passes everything else to the real library's `$real` function.
macro_rules! all_gather_export {
    ($(#[$doc:meta])* $name:ident, $real:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// NCCL's contract for `ncclAllGather`.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            sendbuff: *const c_void,
            recvbuff: *mut c_void,
            sendcount: usize,
            datatype: c_int,
            comm: NcclComm,
            stream: *mut c_void,
        ) -> c_int {
            guarded(stringify!($name), || {
                all_gather_entry(
                    real().$real,
                    sendbuff,
                    recvbuff,
                    sendcount,
                    datatype,
                    comm,
                    stream,
                )
            })
        }
    };
}

all_gather_export!(
    /// `ncclAllGather`.
    ncclAllGather,
    all_gather
);
all_gather_export!(
    /// `pncclAllGather`, the profiling interface's name for `ncclAllGather`.
    pncclAllGather,
    p_all_gather
);
