//! The C ABI called from Rust, ranks as threads of one process: abort from another thread,
//! the async error a dead peer leaves, and calls on a broken communicator.

use std::ffi::{c_int, c_void, CStr};
use std::ptr::null_mut;
use std::time::Duration;

use ciera::capi::*;

const SUCCESS: c_int = 0;
const INVALID_USAGE: c_int = 5;
const BFLOAT16: c_int = 9;

fn last_error() -> String {
    // SAFETY: cieraGetLastError returns a NUL-terminated string valid until the next failure.
    unsafe { CStr::from_ptr(cieraGetLastError(null_mut())) }
        .to_string_lossy()
        .into_owned()
}

struct Handle(*mut c_void);
// SAFETY: a communicator handle is an opaque number; the library serializes calls on it.
unsafe impl Send for Handle {}

/// Two communicators (ranks 0 and 1 of one job) over TCP, with a short timeout.
fn pair() -> (Handle, Handle) {
    let mut id = CUniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    assert_eq!(
        // SAFETY: a writable id.
        unsafe { cieraGetUniqueId(&mut id) },
        SUCCESS,
        "{}",
        last_error()
    );
    let config = CConfig {
        size: std::mem::size_of::<CConfig>(),
        magic: API_MAGIC,
        version: CONFIG_VERSION,
        timeout_ms: 20_000,
        compression: CONFIG_UNDEF_INT,
        cache_budget_mb: CONFIG_UNDEF_INT,
        transport: TRANSPORT_TCP,
        verify: CONFIG_UNDEF_INT,
    };
    let ranks: Vec<Handle> = std::thread::scope(|s| {
        let joins: Vec<_> = (0..2)
            .map(|rank| {
                s.spawn(move || {
                    let mut comm = null_mut();
                    // SAFETY: writable out pointer; a full config struct.
                    let rc = unsafe { cieraCommInitRankConfig(&mut comm, 2, id, rank, &config) };
                    assert_eq!(rc, SUCCESS, "rank {rank}: {}", last_error());
                    Handle(comm)
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let mut it = ranks.into_iter();
    (it.next().unwrap(), it.next().unwrap())
}

fn gather(comm: &Handle, send: &[u16], recv: &mut [u16]) -> (c_int, String) {
    // SAFETY: live vectors of the sizes the call describes (count = send.len(), 2 ranks).
    let rc = unsafe {
        cieraAllGather(
            send.as_ptr() as *const c_void,
            recv.as_mut_ptr() as *mut c_void,
            send.len(),
            BFLOAT16,
            comm.0,
            null_mut(),
        )
    };
    (
        rc,
        if rc == SUCCESS {
            String::new()
        } else {
            last_error()
        },
    )
}

#[test]
fn abort_from_another_thread_ends_a_blocked_call() {
    let (r0, r1) = pair();
    let abort_target = r0.0 as usize;
    let blocked = std::thread::spawn(move || {
        let send = vec![1u16; 1000];
        let mut recv = vec![0u16; 2000];
        // Rank 1 never joins this call: only the abort can end it.
        gather(&r0, &send, &mut recv)
    });
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        cieraCommAbort(abort_target as *mut c_void),
        SUCCESS,
        "{}",
        last_error()
    );
    let (rc, msg) = blocked.join().unwrap();
    // Aborted while blocked (remote error), or, if the abort won the race to the registry,
    // refused as an aborted handle (invalid usage). Either way the message says so.
    assert!(rc == 6 || rc == INVALID_USAGE, "rc {rc}: {msg}");
    assert!(msg.contains("abort"), "{msg}");
    eprintln!("blocked call: rc {rc}: {msg}");
    // The handle is gone now.
    let mut n = 0;
    assert_eq!(
        // SAFETY: a writable int.
        unsafe { cieraCommCount(abort_target as *mut c_void, &mut n) },
        INVALID_USAGE
    );
    assert!(
        last_error().contains("destroyed or aborted"),
        "{}",
        last_error()
    );
    assert_eq!(cieraCommDestroy(r1.0), SUCCESS);
}

#[test]
fn a_peer_that_goes_away_leaves_an_async_error() {
    let (r0, r1) = pair();
    // One good gather first.
    let h = std::thread::spawn(move || {
        let mut recv = vec![0u16; 8];
        let (rc, msg) = gather(&r1, &[7, 7, 7, 7], &mut recv);
        assert_eq!(rc, SUCCESS, "{msg}");
        assert_eq!(recv, [5, 5, 5, 5, 7, 7, 7, 7]);
        r1
    });
    let mut recv = vec![0u16; 8];
    let (rc, msg) = gather(&r0, &[5, 5, 5, 5], &mut recv);
    assert_eq!(rc, SUCCESS, "{msg}");
    assert_eq!(recv, [5, 5, 5, 5, 7, 7, 7, 7]);
    let r1 = h.join().unwrap();
    let mut async_err: c_int = -1;
    assert_eq!(
        // SAFETY: a writable result slot.
        unsafe { cieraCommGetAsyncError(r0.0, &mut async_err) },
        SUCCESS
    );
    assert_eq!(async_err, SUCCESS);

    // Rank 1 goes away (its links close); rank 0's next gather fails naming it.
    assert_eq!(cieraCommDestroy(r1.0), SUCCESS);
    let (rc, msg) = gather(&r0, &[5, 5, 5, 5], &mut recv);
    assert_ne!(rc, SUCCESS);
    assert!(msg.contains("rank 1"), "{msg}");
    eprintln!("after the peer left: rc {rc}: {msg}");
    assert_eq!(
        // SAFETY: as above.
        unsafe { cieraCommGetAsyncError(r0.0, &mut async_err) },
        SUCCESS
    );
    assert_eq!(async_err, rc, "the async error is the failure's code");
    // The communicator stays broken: the next call fails at once with the same code.
    let (rc2, msg2) = gather(&r0, &[5, 5, 5, 5], &mut recv);
    assert_eq!(rc2, rc, "{msg2}");
    let mut stats = CStats {
        size: std::mem::size_of::<CStats>(),
        magic: API_MAGIC,
        version: STATS_VERSION,
        ..Default::default()
    };
    // SAFETY: a full, initialized stats struct.
    assert_eq!(unsafe { cieraCommGetStats(r0.0, &mut stats) }, SUCCESS);
    assert_eq!((stats.calls, stats.failed_calls), (1, 2));
    assert_eq!(cieraCommDestroy(r0.0), SUCCESS);
}
