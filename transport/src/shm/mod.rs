//! `ShmTransport`: a link to a peer on the same host through one POSIX shared-memory segment
//! holding two single-producer single-consumer byte rings, one per direction.
//!
//! ## Segment layout
//!
//! | offset            | size | field                                                    |
//! |-------------------|------|----------------------------------------------------------|
//! | 0                 | 8    | magic `CIERASHM`                                         |
//! | 8                 | 4    | layout version                                           |
//! | 16                | 8    | `R`: bytes per ring (a power of two)                     |
//! | 24                | 4    | pid of the creator                                       |
//! | 64 + 128·i        | 8    | `head[i]`: bytes ever written into ring `i` (producer)   |
//! | 128 + 128·i       | 8    | `tail[i]`: bytes ever read from ring `i` (consumer)      |
//! | 320 + 64·s        | 4    | `closed[s]`: side `s` dropped its link cleanly           |
//! | 448 + 64·i        | 8    | `claimed[i]`: bytes offered by reference on ring `i` that its consumer has copied |
//! | 576 + 64·s        | 4    | `withdrawn[s]`: side `s` took back its offers (its call failed) |
//! | 704 + 64·s        | 16   | side `s`'s probe: address and value of a u64 in its memory |
//! | 832 + 64·s        | 4    | `reads_ok[s]`: side `s` proved it can copy from its peer's memory |
//! | 4096 + R·i        | R    | data of ring `i`                                         |
//!
//! Side 0 is the creator (the lower rank, which accepted the setup connection); it produces
//! into ring 0 and consumes ring 1. Every counter has its own 64-byte cache line, so the
//! producer's stores to `head` never invalidate the line the consumer writes `tail` on.
//!
//! ## Ring protocol
//!
//! `head` and `tail` are free-running u64 byte counters (they never wrap in practice); byte `n`
//! of the stream lives at `data[n % R]`. The producer owns `[head, tail + R)`, the consumer
//! owns `[tail, head)`. The producer copies into its region, then publishes with a Release
//! store of `head`; the consumer loads `head` with Acquire, copies out, then releases the space
//! with a Release store of `tail`, which the producer loads with Acquire. Each side keeps its
//! own counter in a local variable too, so it never trusts the peer with it; a peer counter
//! that would put more than `R` bytes in flight is reported as corruption.
//!
//! After publishing, each side rings the *other* rank's doorbell (see `doorbell.rs`), so a
//! sleeping consumer wakes for data and a sleeping producer wakes for space.
//!
//! ## Single copy (by reference)
//!
//! Copying through a ring costs two copies per byte (in, then out). For large payloads whose
//! memory stays put until the collective returns, the sender may instead *offer* it: it puts
//! only the address on the stream (the caller's framing) and counts the bytes as offered; the
//! receiver copies them straight from the sender's memory with process_vm_readv (one copy, by
//! the kernel) and adds them to `claimed`, which the sender waits for before it lets its caller
//! reuse the memory. Whether the receiver may do that (same user, no ptrace restrictions,
//! seccomp) is proved at setup, not assumed: each side publishes the address and value of a
//! random u64 in its memory, the peer reads it through process_vm_readv and sets
//! `reads_ok[its side]` only if the value matches. A sender offers only to a peer that proved
//! it. With `CIERA_SHM_SINGLE_COPY=0` a process publishes no probe and reads none.
//!
//! When the offered bytes lie in one of the sender's [`SharedBuffer`](crate::SharedBuffer)s
//! the offer names it and the receiver copies out of its own mapping of that buffer instead
//! of calling process_vm_readv (`shared.rs`); everything else above is unchanged.
//!
//! A sender whose call fails before everything it offered was claimed sets `withdrawn[side]`
//! before it returns (after which its memory may change). The receiver checks the flag after
//! each copy (SeqCst on both sides): if it reads it clear, its copy finished before the sender
//! set it, hence before the memory could change; if set, it reports the link closed instead
//! of delivering bytes that may be stale.
//!
//! ## Liveness
//!
//! The authenticated TCP connection that set the pair up stays open as a control channel and
//! carries no data. The kernel closes it when the peer's process exits for any reason, so EOF
//! or RST on it means the peer is gone even if it was SIGKILLed mid-transfer. A clean close
//! also sets `closed[side]`. Bytes the peer published before it went away can still be read;
//! after them `try_recv` reports `PeerClosed`.

mod offers;
mod segment;

use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;

use crate::copy::{copy_fast_raw, copy_streaming_raw};
use crate::doorbell::Doorbell;
use crate::shared::PeerMaps;
use crate::sys::{pid_alive, ShmMapping};
use crate::{Result, TransportError};
use segment::{claimed_off, closed_off, head_off, tail_off, RING_BYTES_OFF};
pub(crate) use segment::{create_segment, open_segment, probe_peer, publish_probe, HEADER_BYTES};

/// How often (in consecutive no-progress calls) `try_send`/`try_recv` look at the control
/// socket themselves, for callers that spin without calling `Endpoint::wait`.
const IDLE_CALLS_PER_CONTROL_CHECK: u32 = 1024;

/// One end of a shm pair.
pub(crate) struct ShmLink {
    seg: ShmMapping,
    side: usize,
    ring_bytes: u64,
    /// Our copy of `head[send ring]`: only we write it.
    send_head: u64,
    /// Our copy of `tail[recv ring]`: only we write it.
    recv_tail: u64,
    peer_bell: Doorbell,
    control: TcpStream,
    /// Why the peer is known to be gone (control EOF, clean close flag).
    closed: Option<String>,
    idle_calls: u32,
    peer_desc: String,
    peer_pid: u32,
    /// Bytes ever offered by reference on our send ring (compare with the peer's `claimed`).
    offered: u64,
    /// Bytes ever copied from the peer's memory (our copy of `claimed[recv ring]`).
    claimed: u64,
    /// We withdrew our offers once (a failed call): never offer again on this link.
    withdrawn: bool,
    /// Copy out of the receive ring with non-temporal stores (see `copy.rs`).
    streaming: bool,
    /// Our mappings of the peer's shared buffers (single copy without the kernel).
    maps: Box<PeerMaps>,
}

impl ShmLink {
    /// `side` 0 is the creator. `control` is the authenticated setup connection.
    pub fn new(
        seg: ShmMapping,
        side: usize,
        peer_bell: Doorbell,
        control: TcpStream,
        peer_desc: String,
        peer_pid: u32,
    ) -> Result<ShmLink> {
        control
            .set_nonblocking(true)
            .map_err(|e| TransportError::io("set control socket non-blocking", &peer_desc, e))?;
        let ring_bytes = seg.atomic_u64(RING_BYTES_OFF).load(Ordering::Relaxed);
        let send_head = seg.atomic_u64(head_off(side)).load(Ordering::Acquire);
        let recv_tail = seg.atomic_u64(tail_off(1 - side)).load(Ordering::Acquire);
        let offered = seg.atomic_u64(claimed_off(side)).load(Ordering::Acquire);
        let claimed = seg
            .atomic_u64(claimed_off(1 - side))
            .load(Ordering::Acquire);
        Ok(ShmLink {
            seg,
            side,
            ring_bytes,
            send_head,
            recv_tail,
            peer_bell,
            control,
            closed: None,
            idle_calls: 0,
            peer_desc,
            peer_pid,
            offered,
            claimed,
            withdrawn: false,
            streaming: false,
            maps: Box::default(),
        })
    }

    fn send_ring(&self) -> usize {
        self.side
    }

    fn recv_ring(&self) -> usize {
        1 - self.side
    }

    fn data_ptr(&self, ring: usize) -> *mut u8 {
        // SAFETY: HEADER_BYTES + ring * R + R <= segment length (checked when the segment was
        // created or opened), so the offset stays inside the mapping.
        unsafe {
            self.seg
                .base()
                .add(HEADER_BYTES + ring * self.ring_bytes as usize)
        }
    }

    fn corrupt(&self, what: &str, ours: u64, theirs: u64) -> TransportError {
        TransportError::Protocol {
            detail: format!(
                "shm link to {}: ring counters out of range ({what}: ours {ours}, peer's {theirs}, ring {} bytes); \
                 the segment {} was corrupted",
                self.peer_desc,
                self.ring_bytes,
                self.seg.name()
            ),
        }
    }

    fn peer_closed_flag(&self) -> bool {
        self.seg
            .atomic_u32(closed_off(1 - self.side))
            .load(Ordering::Acquire)
            != 0
    }

    fn closed_error(&self) -> TransportError {
        TransportError::PeerClosed {
            detail: self
                .closed
                .clone()
                .unwrap_or_else(|| format!("{} closed the shm link", self.peer_desc)),
        }
    }

    fn note_idle(&mut self) {
        self.idle_calls = self.idle_calls.wrapping_add(1);
        if self.idle_calls.is_multiple_of(IDLE_CALLS_PER_CONTROL_CHECK) {
            self.check_control();
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed.is_some()
    }

    pub fn control_fd(&self) -> RawFd {
        self.control.as_raw_fd()
    }

    /// Reads the control socket without blocking; EOF, an error or stray bytes mark the peer
    /// as gone. Returns true if this call discovered that.
    pub fn check_control(&mut self) -> bool {
        if self.closed.is_some() {
            return false;
        }
        let mut byte = [0u8; 1];
        let what = loop {
            match self.control.read(&mut byte) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(0) => break "its control connection reached EOF".to_string(),
                Ok(_) => break "it sent unexpected bytes on the control connection".to_string(),
                Err(e) => break format!("its control connection failed: {e}"),
            }
        };
        let gone = if pid_alive(self.peer_pid) {
            String::new()
        } else {
            format!("; process {} has exited", self.peer_pid)
        };
        self.closed = Some(format!("{} went away: {what}{gone}", self.peer_desc));
        true
    }

    /// Copies as much of `data` as fits into the send ring.
    pub fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        if self.closed.is_some() {
            return Err(self.closed_error());
        }
        if self.peer_closed_flag() {
            self.closed = Some(format!("{} closed the shm link", self.peer_desc));
            return Err(self.closed_error());
        }
        if data.is_empty() {
            return Ok(0);
        }
        let ring = self.send_ring();
        let r = self.ring_bytes;
        let tail = self.seg.atomic_u64(tail_off(ring)).load(Ordering::Acquire);
        let used = self.send_head.wrapping_sub(tail);
        if used > r {
            return Err(self.corrupt("send head vs peer's tail", self.send_head, tail));
        }
        let n = (r - used).min(data.len() as u64) as usize;
        if n == 0 {
            self.note_idle();
            return Ok(0);
        }
        self.idle_calls = 0;
        let offset = (self.send_head & (r - 1)) as usize;
        let first = n.min(r as usize - offset);
        let base = self.data_ptr(ring);
        // SAFETY: bytes [send_head, send_head + n) are in the producer-owned region because
        // n <= R - (head - tail); the consumer does not read them until the Release store of
        // head below. `offset + first <= R` and `n - first <= R`, so both copies stay inside
        // ring `ring`'s data; `data` is a separate buffer of at least n bytes.
        unsafe {
            copy_fast_raw(base.add(offset), data.as_ptr(), first);
            copy_fast_raw(base, data.as_ptr().add(first), n - first);
        }
        self.send_head += n as u64;
        self.seg
            .atomic_u64(head_off(ring))
            .store(self.send_head, Ordering::Release);
        self.peer_bell.ring();
        Ok(n)
    }

    /// Copies up to `buf.len()` available bytes out of the receive ring.
    pub fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let ring = self.recv_ring();
        let r = self.ring_bytes;
        let head_word = self.seg.atomic_u64(head_off(ring));
        let mut head = head_word.load(Ordering::Acquire);
        if head == self.recv_tail {
            if self.peer_closed_flag() {
                // The flag is set after the peer's last head store; re-read to get all of it.
                head = head_word.load(Ordering::Acquire);
                if head == self.recv_tail {
                    if self.closed.is_none() {
                        self.closed = Some(format!("{} closed the shm link", self.peer_desc));
                    }
                    return Err(self.closed_error());
                }
            } else if self.closed.is_some() {
                return Err(self.closed_error());
            } else {
                self.note_idle();
                return Ok(0);
            }
        }
        let avail = head.wrapping_sub(self.recv_tail);
        if avail > r {
            return Err(self.corrupt("peer's head vs recv tail", self.recv_tail, head));
        }
        self.idle_calls = 0;
        let n = avail.min(buf.len() as u64) as usize;
        let offset = (self.recv_tail & (r - 1)) as usize;
        let first = n.min(r as usize - offset);
        let base = self.data_ptr(ring);
        // SAFETY: bytes [recv_tail, recv_tail + n) were published by the producer's Release
        // store of head, which our Acquire load observed, and it will not overwrite them
        // until our Release store of tail below. Both copies stay inside the ring (as in
        // try_send) and `buf` has at least n bytes and does not alias the mapping.
        unsafe {
            if self.streaming {
                copy_streaming_raw(buf.as_mut_ptr(), base.add(offset), first);
                copy_streaming_raw(buf.as_mut_ptr().add(first), base, n - first);
            } else {
                copy_fast_raw(buf.as_mut_ptr(), base.add(offset), first);
                copy_fast_raw(buf.as_mut_ptr().add(first), base, n - first);
            }
        }
        self.recv_tail += n as u64;
        self.seg
            .atomic_u64(tail_off(ring))
            .store(self.recv_tail, Ordering::Release);
        self.peer_bell.ring();
        Ok(n)
    }
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        self.seg
            .atomic_u32(closed_off(self.side))
            .store(1, Ordering::Release);
        self.peer_bell.ring();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::random_hex;
    use std::net::TcpListener;

    fn control_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        (a, listener.accept().unwrap().0)
    }

    /// Two ends of one segment inside this process, with a tiny ring to force wrap-around.
    fn pair(ring_bytes: usize) -> (ShmLink, ShmLink, TcpStream) {
        let tag = random_hex(8);
        let pid = std::process::id();
        let seg_name = format!("ciera-{pid}-{tag}-unit");
        let seg = create_segment(&seg_name, ring_bytes).unwrap();
        let (seg_b, got) = open_segment(pid, seg.shared_fd().unwrap(), &seg_name).unwrap();
        assert_eq!(got, ring_bytes);
        seg.stop_sharing();
        let own_a = Doorbell::create_shared(&format!("ciera-{pid}-{tag}-bella")).unwrap();
        let own_b = Doorbell::create_shared(&format!("ciera-{pid}-{tag}-bellb")).unwrap();
        let open = |bell: &Doorbell| {
            let (name, fd) = bell.shared_ref().unwrap();
            Doorbell::open_shared(pid, fd, name).unwrap()
        };
        let peer_of_a = open(&own_b);
        let peer_of_b = open(&own_a);
        own_a.stop_sharing();
        own_b.stop_sharing();
        let (ca, cb) = control_pair();
        let (cb2, keep) = control_pair();
        drop(cb);
        let a = ShmLink::new(seg, 0, peer_of_a, ca, "rank 1".into(), pid).unwrap();
        let b = ShmLink::new(seg_b, 1, peer_of_b, cb2, "rank 0".into(), pid).unwrap();
        (a, b, keep)
    }

    #[test]
    fn bytes_survive_wraparound_in_both_directions() {
        let (mut a, mut b, _keep) = pair(4096);
        let msg: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let (mut sent, mut got) = (0, Vec::new());
        let mut chunk = vec![0u8; 1000];
        let mut step = 1usize;
        while got.len() < msg.len() {
            // Odd-sized writes and reads so every wrap offset is exercised.
            step = step % 3001 + 777;
            let end = (sent + step).min(msg.len());
            sent += a.try_send(&msg[sent..end]).unwrap();
            let want = (step % 997 + 1).min(chunk.len());
            let n = b.try_recv(&mut chunk[..want]).unwrap();
            got.extend_from_slice(&chunk[..n]);
        }
        assert_eq!(got, msg);
        // And the other way.
        assert_eq!(b.try_send(b"pong").unwrap(), 4);
        let mut four = [0u8; 4];
        assert_eq!(a.try_recv(&mut four).unwrap(), 4);
        assert_eq!(&four, b"pong");
    }

    #[test]
    fn full_ring_accepts_nothing_and_empty_ring_yields_nothing() {
        let (mut a, mut b, _keep) = pair(4096);
        assert_eq!(b.try_recv(&mut [0u8; 16]).unwrap(), 0);
        assert_eq!(a.try_send(&[1u8; 5000]).unwrap(), 4096);
        assert_eq!(a.try_send(&[1u8; 10]).unwrap(), 0);
        let mut buf = vec![0u8; 5000];
        assert_eq!(b.try_recv(&mut buf).unwrap(), 4096);
        assert!(buf[..4096].iter().all(|&x| x == 1));
    }

    #[test]
    fn clean_close_delivers_pending_bytes_then_peer_closed() {
        let (mut a, mut b, _keep) = pair(4096);
        a.try_send(b"last words").unwrap();
        drop(a);
        let mut buf = [0u8; 64];
        assert_eq!(b.try_recv(&mut buf).unwrap(), 10);
        assert_eq!(&buf[..10], b"last words");
        let err = b.try_recv(&mut buf).unwrap_err();
        assert!(err.is_peer_closed(), "{err}");
        assert!(b.try_send(b"x").unwrap_err().is_peer_closed());
    }

    #[test]
    fn control_eof_marks_the_link_closed() {
        let (mut a, _b, keep) = pair(4096);
        // `keep` is the far end of b's control socket, not a's: a's far end was dropped.
        assert!(a.check_control());
        assert!(a.try_send(b"x").unwrap_err().is_peer_closed());
        drop(keep);
    }

    #[test]
    fn offers_are_copied_by_reference_claimed_and_withdrawn() {
        let (mut a, mut b, _keep) = pair(4096);
        // No probes published yet: nothing may be offered; disabled probes do nothing.
        assert!(!a.can_offer() && !b.can_offer());
        publish_probe(&a.seg, 0, false);
        assert!(!probe_peer(&b.seg, 1, std::process::id(), true));
        assert!(!a.can_offer());
        publish_probe(&a.seg, 0, true);
        publish_probe(&b.seg, 1, true);
        assert!(probe_peer(&b.seg, 1, std::process::id(), true));
        assert!(a.can_offer(), "b proved it can read a's memory");
        assert!(!b.can_offer(), "a has not probed b yet");
        assert!(probe_peer(&a.seg, 0, std::process::id(), true));
        assert!(b.can_offer());

        // 1 MiB (bigger than the ring) offered by a, copied by b in uneven pieces.
        let src: Vec<u8> = (0..1u32 << 20).map(|i| (i * 31 + i / 977) as u8).collect();
        a.offer(src.len());
        assert_eq!(a.unclaimed().unwrap(), src.len() as u64);
        let mut dst = vec![0u8; src.len()];
        let mut got = 0;
        while got < src.len() {
            let end = (got + 300_007).min(src.len());
            let addr = src.as_ptr() as u64 + got as u64;
            got += b.try_read_peer(addr, None, &mut dst[got..end]).unwrap();
        }
        assert_eq!(dst, src);
        assert_eq!(a.unclaimed().unwrap(), 0);
        // Nothing outstanding: withdrawing is a no-op and later offers still work.
        a.withdraw_offers();
        assert!(a.can_offer());

        // Outstanding offer withdrawn: the reader refuses to deliver, and a never offers again.
        a.offer(16);
        a.withdraw_offers();
        assert!(!a.can_offer());
        let err = b
            .try_read_peer(src.as_ptr() as u64, None, &mut [0u8; 16])
            .unwrap_err();
        assert!(
            err.is_peer_closed() && err.to_string().contains("withdrew"),
            "{err}"
        );

        // An address that is not mapped in the peer is a protocol/io error, not a crash.
        let (_c, mut d, _keep2) = pair(4096);
        let err = d.try_read_peer(8, None, &mut [0u8; 64]).unwrap_err();
        assert!(err.to_string().contains("rank 0"), "{err}");
    }

    #[test]
    fn corrupt_counters_are_reported() {
        let (a, mut b, _keep) = pair(4096);
        // The peer claims 1 MiB in flight in a 4 KiB ring.
        a.seg
            .atomic_u64(head_off(0))
            .store(1 << 20, Ordering::Release);
        let err = b.try_recv(&mut [0u8; 8]).unwrap_err();
        assert!(
            matches!(err, TransportError::Protocol { .. }) && err.to_string().contains("rank 0"),
            "{err}"
        );
    }
}
