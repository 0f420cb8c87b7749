//! The per-rank doorbell: one futex word that every producer and consumer touching this rank's
//! rings bumps after making progress, and that the rank sleeps on in `Endpoint::wait`.
//!
//! Layout of a doorbell page (the same in shared memory and in the private fallback):
//!
//! | offset | field                                                     |
//! |--------|-----------------------------------------------------------|
//! | 0      | magic `CIERABEL` (u64), version (u32)                     |
//! | 64     | `counter` (u32): bumped by every ring; the futex word     |
//! | 128    | `sleepers` (u32): > 0 while the owner is in FUTEX_WAIT    |
//!
//! The two words sit on separate cache lines so that ringers, who write `counter`, only read
//! the owner's `sleepers` line.
//!
//! ## Why no wake-up is lost
//!
//! Ringer: `counter += 1` (SeqCst), then `if sleepers > 0 { FUTEX_WAKE }`.
//! Owner: it samples `seen = counter` *before* checking its rings (at the end of the previous
//! `wait`), then in `wait`: `sleepers += 1` (SeqCst), `FUTEX_WAIT(counter, seen)`,
//! `sleepers -= 1`.
//!
//! * If a push happened after `seen` was sampled, `counter != seen` and FUTEX_WAIT returns at
//!   once (the kernel compares the word atomically with queueing the waiter).
//! * A push that the owner's ring check missed happened after `seen` was sampled (the ring's
//!   head is published with Release before the counter bump, so a bump included in `seen`
//!   makes the data visible to the check) - case 1.
//! * If the ringer read `sleepers == 0` and skipped the syscall, then in the SeqCst order its
//!   read precedes the owner's increment, so its bump precedes the owner's FUTEX_WAIT, which
//!   therefore sees `counter != seen` and does not sleep.
//!
//! The wait is also bounded (the caller's timeout, at most a liveness-check interval), so even
//! a bug here would cost latency, not a hang.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::sys::{futex_wait, futex_wake, ShmMapping};
use crate::{Result, TransportError};

pub(crate) const BELL_PAGE_BYTES: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"CIERABEL");
const VERSION: u32 = 1;
const MAGIC_OFF: usize = 0;
const VERSION_OFF: usize = 8;
const COUNTER_OFF: usize = 64;
const SLEEPERS_OFF: usize = 128;

#[repr(C, align(64))]
struct PrivatePage {
    words: [AtomicU32; 48],
}

enum Backing {
    Private(Box<PrivatePage>),
    Shared(ShmMapping),
}

/// One rank's doorbell, either private to this process (no shm peers) or in a shm page that
/// same-host peers map.
pub(crate) struct Doorbell {
    backing: Backing,
}

impl Doorbell {
    /// A doorbell only this process rings (wakers, and nothing else).
    pub fn private() -> Doorbell {
        Doorbell {
            backing: Backing::Private(Box::new(PrivatePage {
                words: std::array::from_fn(|_| AtomicU32::new(0)),
            })),
        }
    }

    /// Creates this rank's shared doorbell page, a memory file called `name`; same-host peers
    /// open it through this process's descriptor until [`Doorbell::stop_sharing`].
    pub fn create_shared(name: &str) -> Result<Doorbell> {
        let map = ShmMapping::create(name, BELL_PAGE_BYTES)?;
        map.atomic_u32(VERSION_OFF)
            .store(VERSION, Ordering::Relaxed);
        map.atomic_u64(MAGIC_OFF).store(MAGIC, Ordering::Release);
        Ok(Doorbell {
            backing: Backing::Shared(map),
        })
    }

    /// Maps the doorbell page `name` that process `pid` shares as its descriptor `fd`.
    pub fn open_shared(pid: u32, fd: u32, name: &str) -> Result<Doorbell> {
        let map = ShmMapping::open_peer(pid, fd, name, BELL_PAGE_BYTES, BELL_PAGE_BYTES)?;
        let magic = map.atomic_u64(MAGIC_OFF).load(Ordering::Acquire);
        let version = map.atomic_u32(VERSION_OFF).load(Ordering::Relaxed);
        if magic != MAGIC || version != VERSION {
            return Err(TransportError::Protocol {
                detail: format!("shm doorbell {name}: magic {magic:#x} version {version} (expected {MAGIC:#x} v{VERSION})"),
            });
        }
        Ok(Doorbell {
            backing: Backing::Shared(map),
        })
    }

    /// Stops peers from opening the shared page (the mapping stays). No-op for a private
    /// doorbell.
    pub fn stop_sharing(&self) {
        if let Backing::Shared(map) = &self.backing {
            map.stop_sharing();
        }
    }

    /// The name and descriptor peers open this page by, while it is shared.
    pub fn shared_ref(&self) -> Option<(&str, u32)> {
        match &self.backing {
            Backing::Shared(map) => map.shared_fd().map(|fd| (map.name(), fd)),
            Backing::Private(_) => None,
        }
    }

    fn word(&self, offset: usize) -> &AtomicU32 {
        match &self.backing {
            Backing::Private(page) => &page.words[offset / 4],
            Backing::Shared(map) => map.atomic_u32(offset),
        }
    }

    /// Signals the owner that progress may be possible.
    pub fn ring(&self) {
        let counter = self.word(COUNTER_OFF);
        counter.fetch_add(1, Ordering::SeqCst);
        if self.word(SLEEPERS_OFF).load(Ordering::SeqCst) != 0 {
            futex_wake(counter);
        }
    }

    /// The current counter value; pass it to [`Doorbell::sleep`] later.
    pub fn sample(&self) -> u32 {
        self.word(COUNTER_OFF).load(Ordering::SeqCst)
    }

    /// Sleeps until the counter differs from `seen` or `timeout` passes (or spuriously).
    pub fn sleep(&self, seen: u32, timeout: Duration) {
        let sleepers = self.word(SLEEPERS_OFF);
        sleepers.fetch_add(1, Ordering::SeqCst);
        futex_wait(self.word(COUNTER_OFF), seen, timeout);
        sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn ring_before_sleep_is_not_lost() {
        let bell = Doorbell::private();
        let seen = bell.sample();
        bell.ring();
        // The counter moved since `seen`, so this must return without waiting 60 s.
        bell.sleep(seen, Duration::from_secs(60));
        assert_ne!(bell.sample(), seen);
    }

    #[test]
    fn ring_from_another_thread_wakes_a_sleeper() {
        let pid = std::process::id();
        let name = format!("ciera-{pid}-{}-testbell", crate::sys::random_hex(8));
        let owner = Arc::new(Doorbell::create_shared(&name).unwrap());
        let (_, fd) = owner.shared_ref().unwrap();
        let peer = Doorbell::open_shared(pid, fd, &name).unwrap();
        owner.stop_sharing();
        assert!(owner.shared_ref().is_none());
        let seen = owner.sample();
        let sleeper = {
            let owner = owner.clone();
            std::thread::spawn(move || {
                let start = Instant::now();
                while owner.sample() == seen && start.elapsed() < Duration::from_secs(60) {
                    owner.sleep(seen, Duration::from_secs(60));
                }
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        peer.ring();
        sleeper.join().unwrap();
        assert_eq!(owner.sample(), seen.wrapping_add(1));
    }

    #[test]
    fn foreign_pages_and_stale_descriptors_are_rejected() {
        let pid = std::process::id();
        let name = format!("ciera-{pid}-{}-testjunk", crate::sys::random_hex(8));
        let junk = ShmMapping::create(&name, BELL_PAGE_BYTES).unwrap();
        let fd = junk.shared_fd().unwrap();
        let err = Doorbell::open_shared(pid, fd, &name).err().unwrap();
        assert!(err.to_string().contains("magic"), "{err}");
        // The descriptor names another object than the one asked for.
        let err = Doorbell::open_shared(pid, fd, "ciera-1-other-bell")
            .err()
            .unwrap();
        assert!(err.to_string().contains("not shared memory"), "{err}");
        // A page of the wrong size.
        let big = format!("ciera-{pid}-{}-testbig", crate::sys::random_hex(8));
        let big_map = ShmMapping::create(&big, 2 * BELL_PAGE_BYTES).unwrap();
        let err = Doorbell::open_shared(pid, big_map.shared_fd().unwrap(), &big)
            .err()
            .unwrap();
        assert!(err.to_string().contains("8192 bytes"), "{err}");
        // No longer shared: nothing to open.
        junk.stop_sharing();
        assert!(Doorbell::open_shared(pid, fd, &name).is_err());
    }
}
