//! The executor: drives one call's [`Progress`] over the endpoint's links in a single polling
//! loop. Every send lane and every receive lane is pumped on every turn (never block on a send
//! while the peer blocks on its own send); a chunk received from one peer is forwarded to the
//! next as soon as its bytes arrive (cut-through, in segments); idle turns spin briefly, then
//! yield, then sleep in `Endpoint::wait`, so oversubscribed ranks do not burn the CPU their
//! peers need. Every wait has a deadline; a failure puts an abort notice on every link that
//! names the culprit, so peers fail fast with the right rank instead of timing out.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ciera_transport::{shared_region_of, Endpoint, Kind, TransportError};

use super::payloads::Payloads;
use super::wire::{
    self, AbortReason, CallSig, MsgHeader, RefSrc, MAX_NOTICE, MAX_SEGMENT, MSG_HEADER_LEN,
    REF_HEADER_LEN, SHORT_HEADER_LEN, TAG_ABORT, TAG_MESSAGE, TAG_REF, TAG_SEGMENT,
};
use crate::algo::{Progress, Unit, UnitState};
use crate::error::{Error, Result};

/// Most payload bytes handed to the transport in one call. A shm link publishes what it took
/// only when the call returns, so smaller pieces let the receiver start copying out while the
/// sender is still copying in (measured: 2 ranks, 8 MiB, 3.25 -> 3.5 GB/s busbw).
const SEND_PIECE_SHM: usize = 256 * 1024;
/// Over TCP the kernel hands segments to the peer as it copies them in, so there is nothing to
/// publish early; every send() instead takes the socket lock and processes the ACKs queued
/// behind it. One call per segment (2 ranks over loopback, cubic, 5 interleaved launches each,
/// 256 KiB -> 1 MiB pieces: 2 MiB 226-294 -> 183-240 µs, 1 MiB 109-146 -> 101-125 µs, 16 MiB
/// 3.87-5.23 -> 3.33-5.02 ms; 4 MiB unchanged within noise).
const SEND_PIECE_TCP: usize = MAX_SEGMENT;

/// How a dead link's error starts (see `Exec::collect_notice`).
const LINK_CLOSED: &str = "link closed";
/// How long a rank whose link just closed looks for abort notices from its peers.
const NOTICE_GRACE: Duration = Duration::from_millis(250);

/// Payloads up to this size travel inline: header and payload copied into one staging buffer
/// and handed to the transport in one piece. Over shm the copy costs more than the extra ring
/// write it saves beyond a few KiB; over TCP an extra send() (and segment) costs more than
/// copying 64 KiB (measured, 2 ranks: 16-64 KiB allgathers 33-55 us -> 15-24 us over TCP;
/// shm 32-64 KiB got slower with 64 KiB inline).
const INLINE_MAX_SHM: usize = 4096;
const INLINE_MAX_TCP: usize = 64 * 1024;
/// Most bytes packed into one lane's staging buffer (several small units to the same peer).
const STAGE_MAX: usize = 128 * 1024;
/// A unit still arriving is forwarded once at least this much of it is here (or all of it):
/// big enough that the 8-byte segment header and the transport call are amortized.
const MIN_FORWARD: usize = 64 * 1024;

/// Segments at least this big go by reference over a shm link that can (single copy: the
/// receiver copies them out of this process; see ciera-transport's shm.rs). Below it the
/// system call and the claim round trip cost more than the second copy saves.
pub(crate) const REF_MIN: usize = 64 * 1024;
/// Most bytes a receiver copies by reference in one go, so it forwards and polls its other
/// lanes in between. 1 MiB rather than 256 KiB: fewer system calls and claim updates (2 ranks,
/// single copy on, interleaved runs: faster in most, e.g. 4 MiB 440-593 vs 526-670 µs).
const REF_PIECE: usize = 1024 * 1024;

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

/// Per-peer receive state that outlives a call: a header of the next call may be read (and
/// parked) while this one finishes, and a notice may come at any boundary.
#[derive(Debug)]
pub struct LinkRx {
    hdr: [u8; MSG_HEADER_LEN],
    got: usize,
    phase: RxPhase,
    inbuf: RxBuf,
}

/// Small reads (headers, inline payloads) come through a per-link buffer filled with one
/// transport call, so a small message costs one `try_recv` instead of four (each is a
/// syscall on TCP and a few cross-core cache-line transfers on shm). Reads of at least
/// [`RX_DIRECT`] bytes go straight from the transport into their destination.
#[derive(Debug)]
struct RxBuf {
    data: Box<[u8]>,
    start: usize,
    end: usize,
}

const RX_BUF: usize = 16 * 1024;
const RX_DIRECT: usize = 2048;

impl RxBuf {
    fn new() -> RxBuf {
        RxBuf {
            data: vec![0u8; RX_BUF].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    /// Like `Link::try_recv` (0 = nothing yet), buffered.
    fn read(
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

#[derive(Debug)]
enum RxPhase {
    /// Between messages: reading a message header or an abort notice.
    Boundary,
    /// Inside a message's payload.
    Payload {
        unit: Unit,
        len: usize,
        got: usize,
        seg_left: usize,
        /// For a reference segment: where its next byte is in the sender's memory.
        src: Option<RefSrc>,
    },
    /// Reading an abort notice's body.
    Notice {
        reason: u8,
        body: Vec<u8>,
        len: usize,
    },
}

impl LinkRx {
    pub fn new() -> LinkRx {
        LinkRx {
            hdr: [0; MSG_HEADER_LEN],
            got: 0,
            phase: RxPhase::Boundary,
            inbuf: RxBuf::new(),
        }
    }

    /// Bytes of `unit` that have arrived, if it is this link's message in progress.
    fn arrived(&self, unit: Unit) -> Option<usize> {
        match self.phase {
            RxPhase::Payload { unit: u, got, .. } if u == unit => Some(got),
            _ => None,
        }
    }
}

impl Default for LinkRx {
    fn default() -> Self {
        LinkRx::new()
    }
}

/// One send lane's state; kept by the communicator so staging buffers are reused.
#[derive(Debug, Default)]
pub struct SendLane {
    peer: usize,
    /// Inline messages ready to go, and how much of them went.
    stage: Vec<u8>,
    stage_off: usize,
    cur: Option<SendMsg>,
}

#[derive(Debug)]
struct SendMsg {
    unit: Unit,
    len: usize,
    /// Header bytes (message header, then a segment header) to go before more payload.
    ctl: [u8; MSG_HEADER_LEN + REF_HEADER_LEN],
    ctl_len: usize,
    ctl_off: usize,
    /// Payload bytes handed to the transport, and bytes left in the current segment.
    sent: usize,
    seg_left: usize,
}

impl SendLane {
    /// True when the stream to this peer stops in the middle of a message (or segment).
    fn mid_message(&self) -> bool {
        self.stage_off < self.stage.len() || self.cur.is_some()
    }
}

/// Everything one call needs; the communicator builds it and calls [`Exec::run`].
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
}

/// What the communicator should do with its links after a failed call.
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
            lane.peer = self.progress.send_peer(i);
            lane.stage.clear();
            lane.stage_off = 0;
            lane.cur = None;
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
            let mut moved = false;
            for lane in 0..self.lanes.len() {
                moved |= self.pump_send(lane)?;
            }
            for lane in 0..self.progress.recv_lanes() {
                moved |= self.pump_recv(lane)?;
            }
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
            if idle_since.is_some() && idle_turns % 16 != 0 && !in_slow_phase {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            let since = *idle_since.get_or_insert(now);
            let idle_for = now - since;
            if idle_for >= self.timeout {
                return Err(self.timeout_error(idle_for));
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
                if last_scan.map_or(true, |t| now - t > Duration::from_millis(5)) {
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

    /// Push as much of lane `li` as the transport takes.
    fn pump_send(&mut self, li: usize) -> Result<bool> {
        let mut moved = false;
        let lane = &mut self.lanes[li];
        let peer = lane.peer;
        loop {
            // Inline messages first: they precede anything later on this lane.
            if lane.stage_off < lane.stage.len() {
                let n = self
                    .ep
                    .link(peer)
                    .try_send(&lane.stage[lane.stage_off..])
                    .map_err(|e| transport_error("send", peer, e))?;
                if n == 0 {
                    return Ok(moved);
                }
                lane.stage_off += n;
                moved = true;
                continue;
            }
            if let Some(m) = lane.cur.as_mut() {
                let link = self.ep.link(peer);
                let piece = m.seg_left.min(match link.kind() {
                    Kind::Shm => SEND_PIECE_SHM,
                    Kind::Tcp => SEND_PIECE_TCP,
                });
                if m.ctl_off < m.ctl_len {
                    // Over TCP the headers and the payload behind them go in one call.
                    let ctl = &m.ctl[m.ctl_off..m.ctl_len];
                    let payload = &self.payloads.bytes(m.unit)[m.sent..m.sent + piece];
                    let n = link
                        .try_send_vectored(&[ctl, payload])
                        .map_err(|e| transport_error("send", peer, e))?;
                    if n == 0 {
                        return Ok(moved);
                    }
                    let to_ctl = n.min(ctl.len());
                    m.ctl_off += to_ctl;
                    m.sent += n - to_ctl;
                    m.seg_left -= n - to_ctl;
                    moved = true;
                    continue;
                }
                if m.seg_left > 0 {
                    let bytes = &self.payloads.bytes(m.unit)[m.sent..m.sent + piece];
                    let n = link
                        .try_send(bytes)
                        .map_err(|e| transport_error("send", peer, e))?;
                    if n == 0 {
                        return Ok(moved);
                    }
                    m.sent += n;
                    m.seg_left -= n;
                    moved = true;
                    continue;
                }
                if m.sent == m.len {
                    lane.cur = None;
                    self.progress.sent(li);
                    moved = true;
                    continue;
                }
                // Cut the next segment from what is here.
                let avail = available(self.progress, self.rx, m.unit, m.len);
                let can = avail - m.sent;
                if can == 0 || (avail < m.len && can < MIN_FORWARD) {
                    return Ok(moved);
                }
                let seg = can.min(MAX_SEGMENT);
                m.ctl_off = 0;
                cut_segment(self.ep, &self.payloads, self.refs, peer, m, 0, seg);
                continue;
            }
            // Start the lane's next unit, if it is here (or arriving).
            let Some(unit) = self.progress.next_send(li) else {
                return Ok(moved);
            };
            if unit.src as usize == self.rank && self.progress.state(unit) == UnitState::Missing {
                self.payloads.produce(unit.chunk as usize)?;
                self.progress.produced(unit);
            }
            if self.progress.state(unit) == UnitState::Missing {
                return Ok(moved);
            }
            let complete = self.progress.state(unit) == UnitState::Complete;
            let len = self.payloads.len(unit);
            let inline_max = match self.ep.link(peer).kind() {
                Kind::Shm => INLINE_MAX_SHM,
                Kind::Tcp => INLINE_MAX_TCP,
            };
            if complete && len <= inline_max {
                // Pack this and the following small, complete units into the stage.
                lane.stage.clear();
                lane.stage_off = 0;
                let mut unit = unit;
                loop {
                    let len = self.payloads.len(unit);
                    let hdr = MsgHeader::new(&self.sig, unit, len).encode();
                    lane.stage.extend_from_slice(&hdr);
                    if len > 0 {
                        lane.stage.extend_from_slice(&wire::segment_header(len));
                        lane.stage.extend_from_slice(self.payloads.bytes(unit));
                    }
                    self.progress.sent(li);
                    let Some(next) = self.progress.next_send(li) else {
                        break;
                    };
                    if next.src as usize == self.rank
                        && self.progress.state(next) == UnitState::Missing
                    {
                        self.payloads.produce(next.chunk as usize)?;
                        self.progress.produced(next);
                    }
                    if self.progress.state(next) != UnitState::Complete {
                        break;
                    }
                    let next_len = self.payloads.len(next);
                    if next_len > inline_max
                        || lane.stage.len() + MSG_HEADER_LEN + SHORT_HEADER_LEN + next_len
                            > STAGE_MAX
                    {
                        break;
                    }
                    unit = next;
                }
                moved = true;
                continue;
            }
            let mut m = SendMsg {
                unit,
                len,
                ctl: [0; MSG_HEADER_LEN + REF_HEADER_LEN],
                ctl_len: MSG_HEADER_LEN,
                ctl_off: 0,
                sent: 0,
                seg_left: 0,
            };
            m.ctl[..MSG_HEADER_LEN].copy_from_slice(&MsgHeader::new(&self.sig, unit, len).encode());
            // Send the first segment header with the message header when we can.
            let avail = available(self.progress, self.rx, unit, len);
            if len > 0 && (avail == len || avail >= MIN_FORWARD) {
                let seg = avail.min(MAX_SEGMENT);
                cut_segment(
                    self.ep,
                    &self.payloads,
                    self.refs,
                    peer,
                    &mut m,
                    MSG_HEADER_LEN,
                    seg,
                );
            }
            lane.cur = Some(m);
            moved = true;
        }
    }

    /// Pull what has arrived for receive lane `li`.
    fn pump_recv(&mut self, li: usize) -> Result<bool> {
        let peer = self.progress.recv_peer(li);
        let mut moved = false;
        loop {
            let Some(want) = self.progress.next_recv(li) else {
                return Ok(moved);
            };
            let rx = &mut self.rx[peer];
            match rx.phase {
                RxPhase::Boundary => {
                    if !read_header(self.ep, rx, peer, &mut moved)? {
                        return Ok(moved);
                    }
                    if rx.hdr[0] == TAG_ABORT {
                        start_notice(rx);
                        continue;
                    }
                    let h = MsgHeader::decode(&rx.hdr);
                    rx.got = 0;
                    if let Some(theirs) = h.mismatch(&self.sig) {
                        return Err(self.mismatch_error(peer, &theirs));
                    }
                    if h.unit != want {
                        return Err(Error::CallMismatch {
                            detail: format!(
                                "rank {peer} sent chunk {} of rank {}'s block where rank {} \
                                 expects chunk {} of rank {} in {}",
                                h.unit.chunk,
                                h.unit.src,
                                self.rank,
                                want.chunk,
                                want.src,
                                self.sig.describe()
                            ),
                        });
                    }
                    let len = h.payload_len as usize;
                    self.payloads.begin_recv(peer, want, len)?;
                    self.progress.arriving(li);
                    moved = true;
                    if len == 0 {
                        self.payloads.finish_recv(want)?;
                        self.progress.received(li);
                    } else {
                        self.rx[peer].phase = RxPhase::Payload {
                            unit: want,
                            len,
                            got: 0,
                            seg_left: 0,
                            src: None,
                        };
                    }
                }
                RxPhase::Payload {
                    len,
                    got,
                    seg_left: 0,
                    ..
                } => {
                    // A segment header (or a notice) comes next.
                    match read_segment_header(self.ep, rx, peer, &mut moved)? {
                        None => return Ok(moved),
                        Some(SegmentHeader::Abort) => start_notice(rx),
                        Some(SegmentHeader::Segment { len: s, src }) => {
                            if s == 0 || got + s > len {
                                return Err(protocol_error(
                                    peer,
                                    format!("segment of {s} bytes at offset {got} of a {len}-byte payload"),
                                ));
                            }
                            if let RxPhase::Payload {
                                seg_left, src: at, ..
                            } = &mut rx.phase
                            {
                                *seg_left = s;
                                *at = src;
                            }
                        }
                    }
                }
                RxPhase::Payload {
                    unit,
                    len,
                    got,
                    seg_left,
                    src,
                } => {
                    let dst = &mut self.payloads.dest(unit)[got..got + seg_left];
                    let n = match src {
                        None => rx.inbuf.read(self.ep, peer, dst),
                        Some(at) => {
                            let piece = seg_left.min(REF_PIECE);
                            self.ep
                                .link(peer)
                                .try_read_peer(at.addr, at.region, &mut dst[..piece])
                        }
                    }
                    .map_err(|e| transport_error("recv", peer, e))?;
                    if n == 0 {
                        return Ok(moved);
                    }
                    moved = true;
                    if got + n == len {
                        rx.phase = RxPhase::Boundary;
                        self.payloads.finish_recv(unit)?;
                        self.progress.received(li);
                    } else {
                        rx.phase = RxPhase::Payload {
                            unit,
                            len,
                            got: got + n,
                            seg_left: seg_left - n,
                            src: src.map(|at| at.advanced(n)),
                        };
                    }
                }
                RxPhase::Notice { .. } => {
                    if !read_notice(self.ep, rx, peer, &mut moved)? {
                        return Ok(moved);
                    }
                    return Err(notice_error(rx, peer));
                }
            }
        }
    }

    /// Read headers on links this call does not receive from: an abort notice there fails the
    /// call now (instead of at the timeout); a message of this very call there means the
    /// ranks disagree on the schedule (different algorithm or rank count) — also a mismatch.
    /// Headers of later calls are left parked for those calls.
    fn scan_other_links(&mut self) -> Result<()> {
        for peer in 0..self.nranks {
            if peer == self.rank {
                continue;
            }
            let expecting = (0..self.progress.recv_lanes()).any(|l| {
                self.progress.recv_peer(l) == peer && self.progress.next_recv(l).is_some()
            });
            if expecting {
                continue;
            }
            let rx = &mut self.rx[peer];
            let mut moved = false;
            match rx.phase {
                RxPhase::Boundary => {
                    // A peer that finished its part of this call may have exited cleanly: a
                    // closed link here is not an error (a later call that needs it will say).
                    match read_header(self.ep, rx, peer, &mut moved) {
                        Ok(true) => {}
                        Ok(false) | Err(Error::PeerFailed { .. }) => continue,
                        Err(e) => return Err(e),
                    }
                    if rx.hdr[0] == TAG_ABORT {
                        start_notice(rx);
                    } else {
                        let h = MsgHeader::decode(&rx.hdr);
                        if h.seq <= self.sig.seq {
                            let theirs = h.mismatch(&self.sig).unwrap_or_else(|| {
                                format!(
                                    "{} (unexpected chunk {} of rank {})",
                                    self.sig.describe(),
                                    h.unit.chunk,
                                    h.unit.src
                                )
                            });
                            return Err(self.mismatch_error(peer, &theirs));
                        }
                        continue; // parked for a later call
                    }
                }
                RxPhase::Notice { .. } => {}
                RxPhase::Payload { .. } => continue,
            }
            if read_notice(self.ep, rx, peer, &mut moved)? && self.still_needs(peer) {
                return Err(notice_error(&self.rx[peer], peer));
            }
            // A notice from a peer this call no longer needs (it already got and sent all it
            // had for us: it may have failed in a *later* call) stays parked: this call can
            // still finish exactly, and the next call that reads the link fails with it.
        }
        Ok(())
    }

    /// Whether this call still has to send to `peer` (or wait for it to copy what was
    /// offered to it).
    fn still_needs(&mut self, peer: usize) -> bool {
        let sending = (0..self.lanes.len()).any(|l| {
            self.lanes[l].peer == peer
                && (self.lanes[l].mid_message() || self.progress.next_send(l).is_some())
        });
        sending || !matches!(self.ep.link(peer).unclaimed(), Ok(0))
    }

    fn mismatch_error(&self, peer: usize, theirs: &str) -> Error {
        Error::CallMismatch {
            detail: format!(
                "rank {peer} is in {theirs}; rank {} is in {}",
                self.rank,
                self.sig.describe()
            ),
        }
    }

    /// After the link to `dead` closed: read what every peer sent until a notice turns up or
    /// [`NOTICE_GRACE`] passes (payload bytes are skipped: the call has failed anyway). A peer
    /// that dies on its own sends nothing; one that gave up because of a third rank names it.
    fn collect_notice(&mut self, dead: usize) -> Option<Error> {
        let deadline = Instant::now() + NOTICE_GRACE;
        let mut scratch = vec![0u8; 64 * 1024];
        // The dead peer first: on shm its last bytes stay readable after it is gone.
        let order: Vec<usize> = std::iter::once(dead)
            .chain((0..self.nranks).filter(|&p| p != self.rank && p != dead))
            .collect();
        loop {
            for &peer in &order {
                if let Some(e) = skim_for_notice(self.ep, &mut self.rx[peer], peer, &mut scratch) {
                    return Some(e);
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            let _ = self.ep.wait(Duration::from_millis(1));
        }
    }

    /// Tell every peer this rank is failing, and why, so they fail now and name the culprit.
    /// A lane stopped mid-message first finishes what it started from bytes it holds (the
    /// staging buffer, the current segment): a notice must start at a boundary. Returns
    /// whether every peer's link got its whole notice.
    fn notify_peers(&mut self, error: &Error) -> bool {
        let (reason, culprit) = match error {
            Error::CallMismatch { .. } => (AbortReason::CallMismatch, None),
            Error::PeerFailed { peer, .. } => (AbortReason::PeerFailed, Some(*peer)),
            Error::Timeout { peer, .. } => (AbortReason::Timeout, *peer),
            Error::Aborted { .. } => (AbortReason::Aborted, Some(self.rank)),
            Error::Transport { peer, .. } => (AbortReason::PeerFailed, Some(*peer)),
            _ => (AbortReason::Other, Some(self.rank)),
        };
        let notice = wire::abort_notice(reason, culprit, &format!("rank {}: {error}", self.rank));
        let deadline = Instant::now() + Duration::from_millis(200);
        // The peer whose link failed goes last: writing to it may only time out.
        let dead = culprit_if_dead(error);
        let order = (0..self.nranks)
            .filter(|&p| p != self.rank && Some(p) != dead)
            .chain(dead);
        let mut all = true;
        for peer in order.collect::<Vec<_>>() {
            if !self.finish_and_send(peer, &notice, deadline) {
                all = false;
            }
        }
        all
    }

    fn finish_and_send(&mut self, peer: usize, notice: &[u8], deadline: Instant) -> bool {
        // Finish whatever this rank started on the link to `peer` (bytes it holds).
        let mut pending: Vec<Vec<u8>> = Vec::new();
        for lane in self.lanes.iter_mut().filter(|l| l.peer == peer) {
            if lane.stage_off < lane.stage.len() {
                pending.push(lane.stage[lane.stage_off..].to_vec());
                lane.stage_off = lane.stage.len();
            }
            if let Some(m) = lane.cur.take() {
                // Nothing of a header sent yet: the stream is at a boundary, drop it. A header
                // partly sent must be finished, and a segment started must be completed; then
                // the notice cuts the payload short.
                let header_started = m.ctl_off > 0;
                if header_started && m.ctl_off < m.ctl_len {
                    pending.push(m.ctl[m.ctl_off..m.ctl_len].to_vec());
                }
                if header_started && m.seg_left > 0 {
                    pending.push(self.payloads.bytes(m.unit)[m.sent..m.sent + m.seg_left].to_vec());
                }
            }
        }
        pending.push(notice.to_vec());
        for buf in pending {
            let mut off = 0;
            while off < buf.len() {
                match self.ep.link(peer).try_send(&buf[off..]) {
                    Ok(0) => {
                        if Instant::now() >= deadline {
                            return false;
                        }
                        let _ = self.ep.wait(Duration::from_micros(200));
                    }
                    Ok(n) => off += n,
                    Err(_) => return false,
                }
            }
        }
        true
    }
}

/// The peer whose link is known dead (no point writing to it).
fn culprit_if_dead(error: &Error) -> Option<usize> {
    match error {
        Error::PeerFailed { peer, .. } | Error::Transport { peer, .. } => Some(*peer),
        _ => None,
    }
}

/// Read through `rx`'s stream, discarding payloads, until an abort notice (returned as the
/// error it stands for), no more bytes, or a dead or corrupt link.
fn skim_for_notice(
    ep: &mut Endpoint,
    rx: &mut LinkRx,
    peer: usize,
    scratch: &mut [u8],
) -> Option<Error> {
    let mut moved = false;
    loop {
        match rx.phase {
            RxPhase::Boundary => {
                if !read_header(ep, rx, peer, &mut moved).ok()? {
                    return None;
                }
                if rx.hdr[0] == TAG_ABORT {
                    start_notice(rx);
                    continue;
                }
                let h = MsgHeader::decode(&rx.hdr);
                rx.got = 0;
                if h.payload_len > 0 {
                    let unit = h.unit;
                    rx.phase = RxPhase::Payload {
                        unit,
                        len: h.payload_len as usize,
                        got: 0,
                        seg_left: 0,
                        src: None,
                    };
                }
            }
            RxPhase::Payload {
                unit,
                len,
                got,
                seg_left,
                src,
            } => {
                if seg_left == 0 {
                    match read_segment_header(ep, rx, peer, &mut moved).ok()?? {
                        SegmentHeader::Abort => start_notice(rx),
                        SegmentHeader::Segment { len: s, src } => {
                            if s == 0 || got + s > len {
                                return None;
                            }
                            rx.phase = if src.is_some() {
                                // By reference: nothing of it is on the stream to skip.
                                if got + s == len {
                                    RxPhase::Boundary
                                } else {
                                    RxPhase::Payload {
                                        unit,
                                        len,
                                        got: got + s,
                                        seg_left: 0,
                                        src: None,
                                    }
                                }
                            } else {
                                RxPhase::Payload {
                                    unit,
                                    len,
                                    got,
                                    seg_left: s,
                                    src: None,
                                }
                            };
                        }
                    }
                } else if src.is_some() {
                    // A reference segment this rank was copying when the call failed: none of
                    // it is on the stream; what follows it there is the next header or notice.
                    let got = got + seg_left;
                    rx.phase = if got == len {
                        RxPhase::Boundary
                    } else {
                        RxPhase::Payload {
                            unit,
                            len,
                            got,
                            seg_left: 0,
                            src: None,
                        }
                    };
                } else {
                    let want = seg_left.min(scratch.len());
                    let n = rx.inbuf.read(ep, peer, &mut scratch[..want]).ok()?;
                    if n == 0 {
                        return None;
                    }
                    rx.phase = if got + n == len {
                        RxPhase::Boundary
                    } else {
                        RxPhase::Payload {
                            unit,
                            len,
                            got: got + n,
                            seg_left: seg_left - n,
                            src: None,
                        }
                    };
                }
            }
            RxPhase::Notice { .. } => {
                return if read_notice(ep, rx, peer, &mut moved).ok()? {
                    Some(notice_error(rx, peer))
                } else {
                    None
                };
            }
        }
    }
}

/// Put the header of `m`'s next segment (`seg` bytes from `m.sent`) into `m.ctl` at `at`.
/// A big segment of memory that stays put until the call returns, over a link whose peer
/// can copy out of this process, goes by reference when this call offers by reference
/// (`refs`) or when it lies in a shared buffer (the peer then copies it out of its own
/// mapping: one plain copy, measured faster than the rings whatever the placement and also
/// with more ranks than CPUs). Only its address travels; the bytes count as sent at once and
/// the link counts them as offered until the peer claims them.
fn cut_segment<P: Payloads>(
    ep: &mut Endpoint,
    payloads: &P,
    refs: bool,
    peer: usize,
    m: &mut SendMsg,
    at: usize,
    seg: usize,
) {
    let link = ep.link(peer);
    let by_ref = seg >= REF_MIN && payloads.stable_bytes() && link.can_offer();
    let addr = payloads.bytes(m.unit)[m.sent..].as_ptr() as u64;
    let region = if by_ref {
        shared_region_of(addr, seg)
    } else {
        None
    };
    if by_ref && (refs || region.is_some()) {
        link.offer(seg);
        m.ctl[at..at + REF_HEADER_LEN].copy_from_slice(&wire::ref_header(seg, addr, region));
        m.ctl_len = at + REF_HEADER_LEN;
        m.sent += seg;
        m.seg_left = 0;
    } else {
        m.ctl[at..at + SHORT_HEADER_LEN].copy_from_slice(&wire::segment_header(seg));
        m.ctl_len = at + SHORT_HEADER_LEN;
        m.seg_left = seg;
    }
}

/// What a reader inside a payload found where a segment starts.
enum SegmentHeader {
    /// `len` bytes follow on the stream (`src` None) or are to be copied from the sender's
    /// memory at `src`.
    Segment { len: usize, src: Option<RefSrc> },
    /// An abort notice starts here (`rx.hdr` holds its 8-byte header).
    Abort,
}

/// Read a segment header inside a payload: 8 bytes, 16 for a reference segment. None until
/// complete.
fn read_segment_header(
    ep: &mut Endpoint,
    rx: &mut LinkRx,
    peer: usize,
    moved: &mut bool,
) -> Result<Option<SegmentHeader>> {
    let len_for = |tag| match tag {
        TAG_SEGMENT | TAG_ABORT => Some(SHORT_HEADER_LEN),
        TAG_REF => Some(REF_HEADER_LEN),
        _ => None,
    };
    if !read_tagged(ep, rx, peer, moved, "segment header", len_for)? {
        return Ok(None);
    }
    let len = wire::short_len(&rx.hdr[..SHORT_HEADER_LEN]);
    let header = match rx.hdr[0] {
        TAG_SEGMENT => SegmentHeader::Segment { len, src: None },
        TAG_REF => SegmentHeader::Segment {
            len,
            src: Some(wire::ref_src(&rx.hdr[..REF_HEADER_LEN])),
        },
        _ => return Ok(Some(SegmentHeader::Abort)),
    };
    rx.got = 0;
    Ok(Some(header))
}

/// Bytes of `unit` present on this rank: all of it when complete, else what its receive has
/// brought so far.
fn available(progress: &Progress, rx: &[LinkRx], unit: Unit, len: usize) -> usize {
    match progress.state(unit) {
        UnitState::Complete => len,
        UnitState::Missing => 0,
        UnitState::Arriving => rx.iter().find_map(|r| r.arrived(unit)).unwrap_or(0),
    }
}

/// Read a boundary header (8 bytes, then 32 more for a message header). True once complete.
fn read_header(ep: &mut Endpoint, rx: &mut LinkRx, peer: usize, moved: &mut bool) -> Result<bool> {
    let len_for = |tag| match tag {
        TAG_MESSAGE => Some(MSG_HEADER_LEN),
        TAG_ABORT => Some(SHORT_HEADER_LEN),
        _ => None,
    };
    read_tagged(ep, rx, peer, moved, "message header", len_for)
}

/// Read into `rx.hdr` a header whose length its tag byte decides (`len_for`; None: that tag
/// may not start here, a corrupt stream). True once complete.
fn read_tagged(
    ep: &mut Endpoint,
    rx: &mut LinkRx,
    peer: usize,
    moved: &mut bool,
    what: &str,
    len_for: impl Fn(u8) -> Option<usize>,
) -> Result<bool> {
    loop {
        let target = if rx.got < SHORT_HEADER_LEN {
            SHORT_HEADER_LEN
        } else {
            match len_for(rx.hdr[0]) {
                Some(len) => len,
                None => {
                    return Err(protocol_error(
                        peer,
                        format!("byte {:#04x} where a {what} should start", rx.hdr[0]),
                    ))
                }
            }
        };
        if rx.got == target {
            return Ok(true);
        }
        let n = rx
            .inbuf
            .read(ep, peer, &mut rx.hdr[rx.got..target])
            .map_err(|e| transport_error("recv", peer, e))?;
        if n == 0 {
            return Ok(false);
        }
        *moved = true;
        rx.got += n;
    }
}

/// Switch `rx` (holding a complete 8-byte abort header) to reading the notice body.
fn start_notice(rx: &mut LinkRx) {
    let len = wire::short_len(&rx.hdr[..SHORT_HEADER_LEN]).min(MAX_NOTICE);
    rx.phase = RxPhase::Notice {
        reason: rx.hdr[1],
        body: Vec::with_capacity(len),
        len,
    };
    rx.got = 0;
}

/// Read the notice body. True once complete.
fn read_notice(ep: &mut Endpoint, rx: &mut LinkRx, peer: usize, moved: &mut bool) -> Result<bool> {
    let RxPhase::Notice { body, len, .. } = &mut rx.phase else {
        return Ok(false);
    };
    let mut buf = [0u8; 512];
    while body.len() < *len {
        let want = (*len - body.len()).min(buf.len());
        match rx.inbuf.read(ep, peer, &mut buf[..want]) {
            Ok(0) => return Ok(false),
            Ok(n) => {
                body.extend_from_slice(&buf[..n]);
                *moved = true;
            }
            // The sender may close right after its notice; what arrived is what it said.
            Err(_) => return Ok(true),
        }
    }
    Ok(true)
}

/// The error a received abort notice stands for, naming the rank that caused it.
fn notice_error(rx: &LinkRx, peer: usize) -> Error {
    let RxPhase::Notice { reason, body, .. } = &rx.phase else {
        return protocol_error(peer, "notice expected".into());
    };
    let (culprit, text) = wire::parse_notice_body(body);
    match AbortReason::from_code(*reason) {
        AbortReason::CallMismatch => Error::CallMismatch {
            detail: format!("reported by rank {peer}: {text}"),
        },
        AbortReason::PeerFailed | AbortReason::Timeout => Error::PeerFailed {
            peer: culprit.unwrap_or(peer),
            detail: format!("reported by rank {peer}: {text}"),
        },
        AbortReason::Aborted | AbortReason::Other => Error::PeerFailed {
            peer: culprit.unwrap_or(peer),
            detail: format!("rank {peer} gave up: {text}"),
        },
    }
}

fn protocol_error(peer: usize, detail: String) -> Error {
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
