//! Live communicators by handle, so a destroyed, aborted or made-up handle is an error with a
//! message instead of undefined behaviour.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::abi::Failure;
use super::live::{lock, LiveComm};

/// Live communicators by handle. Handles are `HANDLE_TAG | id << 4` with `id` counting up from
/// 1 and never reused: above the canonical user-space range (so no real pointer equals one),
/// and an id below the counter that is absent was destroyed.
struct Registry {
    live: HashMap<usize, Arc<LiveComm>>,
}

pub(super) const HANDLE_TAG: usize = 0x7C1E_0000_0000_0000;
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn registry() -> MutexGuard<'static, Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    lock(REGISTRY.get_or_init(|| {
        Mutex::new(Registry {
            live: HashMap::new(),
        })
    }))
}

pub(super) fn register(comm: Arc<LiveComm>) -> *mut c_void {
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

pub(super) fn live(handle: *mut c_void) -> Result<Arc<LiveComm>, Failure> {
    if handle.is_null() {
        return Err(Failure::invalid_argument("comm is NULL"));
    }
    registry()
        .live
        .get(&(handle as usize))
        .cloned()
        .ok_or_else(|| describe_dead_handle(handle))
}

pub(super) fn unregister(handle: *mut c_void) -> Result<Arc<LiveComm>, Failure> {
    registry()
        .live
        .remove(&(handle as usize))
        .ok_or_else(|| describe_dead_handle(handle))
}
