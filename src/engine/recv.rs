//! The receive side of a call: one lane per peer this rank receives from, each expecting its
//! units in schedule order. The bytes are moved here (from the stream, or out of the sender's
//! memory for reference segments); what they mean is the pure decoder's business (`rx.rs`).

use super::exec::{protocol_error, transport_error, Exec, LinkRx};
use super::payloads::Payloads;
use super::rx::Need;
use crate::algo::{Progress, Unit, UnitState};
use crate::error::{Error, Result};

/// Most bytes a receiver copies by reference in one go, so it forwards and polls its other
/// lanes in between.
const REF_PIECE: usize = 1024 * 1024;

/// Bytes of `unit` present on this rank: all of it when complete, else what its receive has
/// brought so far.
pub(super) fn available(progress: &Progress, rx: &[LinkRx], unit: Unit, len: usize) -> usize {
    match progress.state(unit) {
        UnitState::Complete => len,
        UnitState::Missing => 0,
        UnitState::Arriving => rx.iter().find_map(|r| r.dec.arrived(unit)).unwrap_or(0),
    }
}

impl<P: Payloads> Exec<'_, P> {
    /// Pull what has arrived for receive lane `li`.
    pub(super) fn pump_recv(&mut self, li: usize) -> Result<bool> {
        let peer = self.progress.recv_peer(li);
        let mut moved = false;
        loop {
            let Some(want) = self.progress.next_recv(li) else {
                return Ok(moved);
            };
            let LinkRx { dec, inbuf } = &mut self.rx[peer];
            match dec.need() {
                Need::Control(buf) => {
                    let n = inbuf
                        .read(self.ep, peer, buf)
                        .map_err(|e| transport_error("recv", peer, e))?;
                    if n == 0 {
                        return Ok(moved);
                    }
                    moved = true;
                    dec.control(n).map_err(|c| protocol_error(peer, c.0))?;
                }
                Need::Header(h) => {
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
                    let (_, len) = dec.accept();
                    self.payloads.begin_recv(peer, want, len)?;
                    self.progress.arriving(li);
                    moved = true;
                    if len == 0 {
                        self.payloads.finish_recv(want)?;
                        self.progress.received(li);
                    }
                }
                Need::Stream { unit, at, len } => {
                    let dst = &mut self.payloads.dest(unit)[at..at + len];
                    let n = inbuf
                        .read(self.ep, peer, dst)
                        .map_err(|e| transport_error("recv", peer, e))?;
                    if n == 0 {
                        return Ok(moved);
                    }
                    moved = true;
                    self.payload_moved(li, peer, n)?;
                }
                Need::Reference {
                    unit,
                    at,
                    len,
                    span,
                } => {
                    let piece = len.min(REF_PIECE);
                    let dst = &mut self.payloads.dest(unit)[at..at + piece];
                    let n = self
                        .ep
                        .link(peer)
                        .try_read_peer(span.addr, span.shared(), dst)
                        .map_err(|e| transport_error("recv", peer, e))?;
                    if n == 0 {
                        return Ok(moved);
                    }
                    moved = true;
                    self.payload_moved(li, peer, n)?;
                }
                Need::Notice => return Err(self.notice_error(peer)),
            }
        }
    }

    /// `n` payload bytes for receive lane `li` (from `peer`) were moved: tell the decoder, and
    /// finish the unit if that was its last byte.
    fn payload_moved(&mut self, li: usize, peer: usize, n: usize) -> Result<()> {
        if let Some(u) = self.rx[peer].dec.payload(n) {
            self.payloads.finish_recv(u)?;
            self.progress.received(li);
        }
        Ok(())
    }

    /// Read headers on links this call does not receive from: an abort notice there fails the
    /// call now (instead of at the timeout); a message of this very call there means the
    /// ranks disagree on the schedule (different algorithm or rank count) — also a mismatch.
    /// Headers of later calls are left parked for those calls.
    pub(super) fn scan_other_links(&mut self) -> Result<()> {
        for peer in 0..self.nranks {
            if peer == self.rank {
                continue;
            }
            let expecting = (0..self.progress.recv_lanes()).any(|l| {
                self.progress.recv_peer(l) == peer && self.progress.next_recv(l).is_some()
            });
            if expecting || self.rx[peer].dec.in_payload() {
                continue;
            }
            let LinkRx { dec, inbuf } = &mut self.rx[peer];
            let notice = loop {
                let in_notice = dec.in_notice();
                match dec.need() {
                    Need::Control(buf) => match inbuf.read(self.ep, peer, buf) {
                        Ok(0) => break false,
                        Ok(n) => {
                            // A corrupt stream here is left for a call that reads this link.
                            if dec.control(n).is_err() {
                                break false;
                            }
                        }
                        // The sender may close right after its notice: what arrived is what
                        // it said.
                        Err(_) if in_notice => dec.truncate_notice(),
                        // A peer that finished its part of this call may have exited cleanly:
                        // a closed link here is not an error (a later call that needs it will
                        // say).
                        Err(e) => match transport_error("recv", peer, e) {
                            Error::PeerFailed { .. } => break false,
                            other => return Err(other),
                        },
                    },
                    Need::Header(h) => {
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
                        break false; // parked for a later call
                    }
                    Need::Notice => break true,
                    Need::Stream { .. } | Need::Reference { .. } => break false,
                }
            };
            // A notice from a peer this call no longer needs (it already got and sent all it
            // had for us: it may have failed in a *later* call) stays parked: this call can
            // still finish exactly, and the next call that reads the link fails with it.
            if notice && self.still_needs(peer) {
                return Err(self.notice_error(peer));
            }
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
}
