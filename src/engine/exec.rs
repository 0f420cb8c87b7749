//! The executor: drives one call's [`Progress`] over the endpoint's links in a single polling
//! loop. Every send lane and every receive lane is pumped on every turn (never block on a send
//! while the peer blocks on its own send); a chunk received from one peer is forwarded to the
//! next as soon as its bytes arrive (cut-through, in segments); idle turns spin briefly, then
//! yield, then sleep in `Endpoint::wait`, so oversubscribed ranks do not burn the CPU their
//! peers need. Every wait has a deadline; a failure puts an abort notice on every link that
//! names the culprit, so peers fail fast with the right rank instead of timing out.
//!
//! The parts: this file (the loop, deadlines, the error kinds), `send.rs` (send lanes and
//! segments), `recv.rs` (receive lanes, over the pure decoder of `rx.rs`) and `abort.rs`
//! (failing: notices out, and the search for a peer's notice after a link closed).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ciera_transport::{Endpoint, TransportError};

use super::payloads::Payloads;
use super::rx::RxDecoder;
use super::send::SendLane;
use super::wire::CallSig;
use crate::algo::Progress;
use crate::error::{Error, Result};

/// How a dead link's error starts (see `Exec::collect_notice`).
pub(super) const LINK_CLOSED: &str = "link closed";

/// While spinning, yield the CPU once per this long (see `Exec::drive`).
const SPIN_YIELD_EVERY: Duration = Duration::from_micros(20);

/// How an idle rank waits: spin, then yield the CPU, then sleep in the transport.
#[derive(Clone, Copy, Debug)]
pub struct IdlePolicy {
    pub spin: Duration,
    /// Offer the CPU every `SPIN_YIELD_EVERY` (20 µs) while spinning (when this rank is not bound
    /// to a CPU of its own, a peer may share it).
    pub yield_while_spinning: bool,
    pub yield_for: Duration,
    /// Longest single sleep in `Endpoint::wait` (the abort flag and deadline are checked
    /// between sleeps; the transport's waker cuts a sleep short).
    pub max_sleep: Duration,
}

/// Per-peer receive state that outlives a call: the decoder of the link's stream and a small
/// read-ahead buffer.
#[derive(Debug, Default)]
pub struct LinkRx {
    pub(super) dec: RxDecoder,
    pub(super) inbuf: RxBuf,
}

impl LinkRx {
    pub fn new() -> LinkRx {
        LinkRx::default()
    }
}

/// Small reads (headers, inline payloads) come through a per-link buffer filled with one
/// transport call, so a small message costs one `try_recv` instead of four (each is a
/// syscall on TCP and a few cross-core cache-line transfers on shm). Reads of at least
/// [`RX_DIRECT`] bytes go straight from the transport into their destination.
#[derive(Debug)]
pub(super) struct RxBuf {
    data: Box<[u8]>,
    start: usize,
    end: usize,
}

const RX_BUF: usize = 16 * 1024;
const RX_DIRECT: usize = 2048;

impl Default for RxBuf {
    fn default() -> Self {
        RxBuf {
            data: vec![0u8; RX_BUF].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }
}

impl RxBuf {
    /// Like `Link::try_recv` (0 = nothing yet), buffered.
    pub(super) fn read(
        &mut self,
        ep: &mut Endpoint,
        peer: usize,
        dst: &mut [u8],
    ) -> std::result::Result<usize, TransportError> {
        if dst.is_empty() {
            return Ok(0);
        }
        if self.start == self.end {
            if dst.len() >= RX_DIRECT {
                return ep.link(peer).try_recv(dst);
            }
            // Empty first: if the read fails, no stale bytes may look buffered.
            self.start = 0;
            self.end = 0;
            self.end = ep.link(peer).try_recv(&mut self.data)?;
        }
        let n = dst.len().min(self.end - self.start);
        dst[..n].copy_from_slice(&self.data[self.start..self.start + n]);
        self.start += n;
        Ok(n)
    }
}

/// Everything one call needs; the engine builds it and calls [`Exec::run`].
pub struct Exec<'c, P: Payloads> {
    pub ep: &'c mut Endpoint,
    pub rx: &'c mut [LinkRx],
    pub lanes: &'c mut Vec<SendLane>,
    pub progress: &'c mut Progress,
    pub payloads: P,
    pub sig: CallSig,
    pub rank: usize,
    pub nranks: usize,
    pub timeout: Duration,
    pub idle: IdlePolicy,
    /// Offer large raw segments to shm peers that can read this process by reference
    /// (single copy) instead of writing them into the rings.
    pub refs: bool,
    pub abort: &'c AtomicBool,
    /// The text of the peer's notice this call failed on, if it did: passed on unchanged.
    pub relayed: Option<String>,
}

/// What the engine should do with its links after a failed call.
pub struct Failure {
    pub error: Error,
    /// Every peer got an abort notice; links may stay open until the communicator drops.
    pub notified_all: bool,
}

impl<P: Payloads> Exec<'_, P> {
    /// Run the call to completion, or fail (after telling the peers).
    pub fn run(mut self) -> std::result::Result<(), Failure> {
        // Reuse the lanes (and their staging buffers) of earlier calls.
        let nlanes = self.progress.send_lanes();
        self.lanes
            .resize_with(nlanes.max(self.lanes.len()), SendLane::default);
        self.lanes.truncate(nlanes);
        for (i, lane) in self.lanes.iter_mut().enumerate() {
            lane.reset(self.progress.send_peer(i));
        }
        match self.drive() {
            Ok(()) => Ok(()),
            Err(mut error) => {
                if let Error::PeerFailed { peer, detail } = &error {
                    if detail.starts_with(LINK_CLOSED) {
                        // A closed link is often the consequence of a failure elsewhere: the
                        // peer gave up (and said why in a notice) and exited. Prefer the
                        // reason a notice gives, from any peer, over blaming this link.
                        if let Some(better) = self.collect_notice(*peer) {
                            error = better;
                        }
                    }
                }
                // Peers must not copy, after we return, memory our caller may reuse.
                for peer in (0..self.nranks).filter(|&p| p != self.rank) {
                    self.ep.link(peer).withdraw_offers();
                }
                let notified_all = self.notify_peers(&error);
                Err(Failure {
                    error,
                    notified_all,
                })
            }
        }
    }

    fn drive(&mut self) -> Result<()> {
        let mut idle_since: Option<Instant> = None;
        let mut next_yield = SPIN_YIELD_EVERY;
        let mut last_scan: Option<Instant> = None;
        let mut idle_turns = 0u32;
        let mut in_slow_phase = false;
        loop {
            if self.abort.load(Ordering::Relaxed) {
                return Err(Error::Aborted {
                    detail: "abort() was called on this rank".into(),
                });
            }
            let moved = self.pump_all()?;
            if self.progress.is_done()
                && self.lanes.iter().all(|l| !l.mid_message())
                && self.offers_claimed()?
            {
                self.payloads.finish();
                return Ok(());
            }
            if moved || self.payloads.background() {
                idle_since = None;
                next_yield = SPIN_YIELD_EVERY;
                idle_turns = 0;
                in_slow_phase = false;
                continue;
            }
            // While spinning, read the clock only every few turns (it costs as much as a
            // poll of every link) and pause only briefly (a PAUSE can take ~100 cycles).
            idle_turns += 1;
            if idle_since.is_some() && !idle_turns.is_multiple_of(16) && !in_slow_phase {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            let since = *idle_since.get_or_insert(now);
            let idle_for = now - since;
            if idle_for >= self.timeout {
                // One more look before blaming a peer: this process may itself have been
                // stopped (SIGSTOP, a debugger, swapping) while the peers' bytes, or their
                // notices, arrived.
                if !self.pump_all()? {
                    return Err(self.timeout_error(idle_for));
                }
                idle_since = None;
                continue;
            }
            in_slow_phase = idle_for >= self.idle.spin;
            if idle_for < self.idle.spin {
                // Spin, but offer the CPU now and then: if a peer shares this CPU (the
                // scheduler put us together, or another job took the other CPUs) spinning
                // alone would hold it off for the whole spin.
                if self.idle.yield_while_spinning && idle_for >= next_yield {
                    std::thread::yield_now();
                    next_yield = idle_for + SPIN_YIELD_EVERY;
                } else {
                    std::hint::spin_loop();
                }
            } else if idle_for < self.idle.spin + self.idle.yield_for {
                std::thread::yield_now();
            } else {
                // Before sleeping, look for notices (or stray calls) from peers this call does
                // not read from, at most every few milliseconds.
                if last_scan.is_none_or(|t| now - t > Duration::from_millis(5)) {
                    last_scan = Some(now);
                    self.scan_other_links()?;
                }
                let left = self.timeout - idle_for;
                self.ep
                    .wait(left.min(self.idle.max_sleep))
                    .map_err(|e| transport_error("wait", self.rank, e))?;
            }
        }
    }

    /// Pump every send lane, then every receive lane, once. Returns whether anything moved.
    fn pump_all(&mut self) -> Result<bool> {
        let mut moved = false;
        for lane in 0..self.lanes.len() {
            moved |= self.pump_send(lane)?;
        }
        for lane in 0..self.progress.recv_lanes() {
            moved |= self.pump_recv(lane)?;
        }
        Ok(moved)
    }

    /// Whether every peer this call sent to has copied what was offered to it by reference
    /// (until then the memory must stay as it is, so the call may not return).
    fn offers_claimed(&mut self) -> Result<bool> {
        for li in 0..self.lanes.len() {
            let peer = self.lanes[li].peer;
            let left = self
                .ep
                .link(peer)
                .unclaimed()
                .map_err(|e| transport_error("send", peer, e))?;
            if left > 0 {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The peer this rank is stuck on, for a timeout: the first receive lane with units left,
    /// else the first send lane the transport will not take more from.
    fn timeout_error(&self, after: Duration) -> Error {
        let mut peer = None;
        let mut what = String::new();
        for lane in 0..self.progress.recv_lanes() {
            if let Some(u) = self.progress.next_recv(lane) {
                peer = Some(self.progress.recv_peer(lane));
                what = format!("receiving chunk {} of rank {}'s block", u.chunk, u.src);
                break;
            }
        }
        if peer.is_none() {
            if let Some(l) = self.lanes.iter().find(|l| l.mid_message()) {
                peer = Some(l.peer);
                what = "sending (the peer is not draining its link)".into();
            }
        }
        if peer.is_none() {
            peer = self.lanes.first().map(|l| l.peer);
            what = "waiting for the peer to copy the bytes offered to it".into();
        }
        Error::Timeout {
            op: format!("{}, {what}", self.sig.describe()),
            peer,
            after,
        }
    }

    pub(super) fn mismatch_error(&self, peer: usize, theirs: &str) -> Error {
        Error::CallMismatch {
            detail: format!(
                "rank {peer} is in {theirs}; rank {} is in {}",
                self.rank,
                self.sig.describe()
            ),
        }
    }
}

/// The stream from `peer` says something impossible.
pub(super) fn protocol_error(peer: usize, detail: String) -> Error {
    Error::PeerFailed {
        peer,
        detail: format!("corrupt stream from rank {peer}: {detail}"),
    }
}

/// A transport error with `peer`; a closed link means the peer is gone.
pub fn transport_error(op: &'static str, peer: usize, e: TransportError) -> Error {
    match e {
        TransportError::PeerClosed { detail } => Error::PeerFailed {
            peer,
            detail: format!("{LINK_CLOSED} during {op} ({detail}): the process died or dropped its communicator"),
        },
        TransportError::Timeout { op: top } => Error::Timeout {
            op: format!("{op} ({top})"),
            peer: Some(peer),
            after: Duration::ZERO,
        },
        source => Error::Transport { op, peer, source },
    }
}
