//! The send side of a call: one lane per peer this rank sends to, each a FIFO of units in
//! schedule order. Small complete units are packed with their headers into one staging buffer
//! (one transport call for several messages); larger ones go as a message header and segments
//! cut from what is here (cut-through: a unit still arriving is forwarded in pieces).

use ciera_transport::{Endpoint, Kind};

use super::exec::{transport_error, Exec};
use super::payloads::Payloads;
use super::recv::available;
use super::wire::{self, MsgHeader, MAX_SEGMENT, MSG_HEADER_LEN, REF_HEADER_LEN, SHORT_HEADER_LEN};
use crate::algo::{Unit, UnitState};
use crate::error::Result;

/// Most payload bytes handed to the transport in one call. A shm link publishes what it took
/// only when the call returns, so smaller pieces let the receiver start copying out while the
/// sender is still copying in.
const SEND_PIECE_SHM: usize = 256 * 1024;
/// Over TCP the kernel hands segments to the peer as it copies them in, so there is nothing to
/// publish early; every send() instead takes the socket lock and processes the ACKs queued
/// behind it: one call per segment.
const SEND_PIECE_TCP: usize = MAX_SEGMENT;

/// Payloads up to this size travel inline: header and payload copied into one staging buffer
/// and handed to the transport in one piece. Over shm the copy costs more than the extra ring
/// write it saves beyond a few KiB; over TCP an extra send() (and segment) costs more than
/// copying 64 KiB (ARCHITECTURE.md, "Transports").
const INLINE_MAX_SHM: usize = 4096;
const INLINE_MAX_TCP: usize = 64 * 1024;
/// Most bytes packed into one lane's staging buffer (several small units to the same peer).
const STAGE_MAX: usize = 128 * 1024;
/// A unit still arriving is forwarded once at least this much of it is here (or all of it):
/// big enough that the 8-byte segment header and the transport call are amortized.
const MIN_FORWARD: usize = 64 * 1024;

/// Segments at least this big go by reference over a shm link that can (single copy: the
/// receiver copies them out of this process; see ciera-transport's shm/). Below it the
/// system call and the claim round trip cost more than the second copy saves.
pub(crate) const REF_MIN: usize = 64 * 1024;

/// One send lane's state; kept by the engine so staging buffers are reused.
#[derive(Debug, Default)]
pub struct SendLane {
    pub(super) peer: usize,
    /// Inline messages ready to go, and how much of them went.
    pub(super) stage: Vec<u8>,
    pub(super) stage_off: usize,
    pub(super) cur: Option<SendMsg>,
}

#[derive(Debug)]
pub(super) struct SendMsg {
    pub(super) unit: Unit,
    len: usize,
    /// Header bytes (message header, then a segment header) to go before more payload.
    pub(super) ctl: [u8; MSG_HEADER_LEN + REF_HEADER_LEN],
    pub(super) ctl_len: usize,
    pub(super) ctl_off: usize,
    /// Payload bytes handed to the transport, and bytes left in the current segment.
    pub(super) sent: usize,
    pub(super) seg_left: usize,
}

impl SendLane {
    /// Ready for a new call, sending to `peer`.
    pub(super) fn reset(&mut self, peer: usize) {
        self.peer = peer;
        self.stage.clear();
        self.stage_off = 0;
        self.cur = None;
    }

    /// True when the stream to this peer stops in the middle of a message (or segment).
    pub(super) fn mid_message(&self) -> bool {
        self.stage_off < self.stage.len() || self.cur.is_some()
    }
}

impl<P: Payloads> Exec<'_, P> {
    /// Push as much of lane `li` as the transport takes.
    pub(super) fn pump_send(&mut self, li: usize) -> Result<bool> {
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
                    Kind::Tcp | Kind::Rdma => SEND_PIECE_TCP,
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
                    let done = self.progress.sent(li);
                    self.payloads.sent(done);
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
                Kind::Tcp | Kind::Rdma => INLINE_MAX_TCP,
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
                    let done = self.progress.sent(li);
                    self.payloads.sent(done);
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
}

/// Put the header of `m`'s next segment (`seg` bytes from `m.sent`) into `m.ctl` at `at`.
/// A big segment of memory a peer on this host may read itself (the payloads say where:
/// [`Payloads::peer_span`]) goes by reference when this call offers by reference (`refs`) or
/// when it lies in a shared buffer (the peer then copies it out of its own mapping: one plain
/// copy, faster than the rings whatever the placement and also with more ranks than CPUs).
/// Only where it is travels; the bytes count as sent at once and the link counts them as
/// offered until the peer claims them.
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
    let span = if seg >= REF_MIN && link.can_offer() {
        payloads.peer_span(m.unit, m.sent, seg)
    } else {
        None
    };
    match span {
        Some(span) if refs || span.is_shared() => {
            link.offer(seg);
            m.ctl[at..at + REF_HEADER_LEN].copy_from_slice(&wire::ref_header(seg, span));
            m.ctl_len = at + REF_HEADER_LEN;
            m.sent += seg;
            m.seg_left = 0;
        }
        _ => {
            m.ctl[at..at + SHORT_HEADER_LEN].copy_from_slice(&wire::segment_header(seg));
            m.ctl_len = at + SHORT_HEADER_LEN;
            m.seg_left = seg;
        }
    }
}
