//! Failing a call: tell every peer why (an abort notice naming the culprit, after finishing
//! whatever segment this rank had started, so the notice starts at a boundary), and, when a link
//! closed under this rank, look for the notice a peer left explaining it.

use std::time::{Duration, Instant};

use ciera_transport::Endpoint;

use super::exec::{Exec, LinkRx};
use super::payloads::Payloads;
use super::rx::Need;
use super::wire::{self, AbortReason};
use crate::error::Error;

/// How long a rank whose link just closed looks for abort notices from its peers.
const NOTICE_GRACE: Duration = Duration::from_millis(250);

impl<P: Payloads> Exec<'_, P> {
    /// After the link to `dead` closed: read what every peer sent until a notice turns up or
    /// [`NOTICE_GRACE`] passes (payload bytes are skipped: the call has failed anyway). A peer
    /// that dies on its own sends nothing; one that gave up because of a third rank names it.
    pub(super) fn collect_notice(&mut self, dead: usize) -> Option<Error> {
        let deadline = Instant::now() + NOTICE_GRACE;
        let mut scratch = vec![0u8; 64 * 1024];
        // The dead peer first: on shm its last bytes stay readable after it is gone.
        let order: Vec<usize> = std::iter::once(dead)
            .chain((0..self.nranks).filter(|&p| p != self.rank && p != dead))
            .collect();
        loop {
            for &peer in &order {
                if skim_for_notice(self.ep, &mut self.rx[peer], peer, &mut scratch) {
                    return Some(self.notice_error(peer));
                }
            }
            if Instant::now() >= deadline {
                return None;
            }
            let _ = self.ep.wait(Duration::from_millis(1));
        }
    }

    /// The error the complete abort notice on `peer`'s link stands for, naming the rank that
    /// caused it. A culprit outside the world is not believed (the reporting peer is named);
    /// a notice naming this very rank (its peers gave up on it, e.g. after it was stopped for
    /// longer than the timeout) says so. The notice's text is what the rank that first failed
    /// said; this rank passes it on as it is (`relayed`), so a failure reads the same on every
    /// rank instead of growing a "reported by" per hop.
    pub(super) fn notice_error(&mut self, peer: usize) -> Error {
        let Some((reason, body)) = self.rx[peer].dec.notice() else {
            return super::exec::protocol_error(peer, "an abort notice expected".into());
        };
        let (culprit, text) = wire::parse_notice_body(body);
        self.relayed = Some(text.clone());
        let culprit = culprit.filter(|&c| c < self.nranks);
        if culprit == Some(self.rank) {
            return Error::Aborted {
                detail: format!(
                    "rank {peer} reports that this rank (rank {}) failed; the others gave up on \
                     it: {text}",
                    self.rank
                ),
            };
        }
        match AbortReason::from_code(reason).unwrap_or(AbortReason::Other) {
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

    /// Tell every peer this rank is failing, and why, so they fail now and name the culprit.
    /// A lane stopped mid-message first finishes what it started from bytes it holds (the
    /// staging buffer, the current segment): a notice must start at a boundary. Returns
    /// whether every peer's link got its whole notice.
    pub(super) fn notify_peers(&mut self, error: &Error) -> bool {
        let (reason, culprit) = match error {
            Error::CallMismatch { .. } => (AbortReason::CallMismatch, None),
            Error::PeerFailed { peer, .. } => (AbortReason::PeerFailed, Some(*peer)),
            Error::Timeout { peer, .. } => (AbortReason::Timeout, *peer),
            Error::Aborted { .. } => (AbortReason::Aborted, Some(self.rank)),
            Error::Transport { peer, .. } => (AbortReason::PeerFailed, Some(*peer)),
            _ => (AbortReason::Other, Some(self.rank)),
        };
        let text = match self.relayed.take() {
            Some(first) => first,
            None => format!("rank {}: {error}", self.rank),
        };
        let notice = wire::abort_notice(reason, culprit, &text);
        let deadline = Instant::now() + Duration::from_millis(200);
        // The peer whose link failed goes last: writing to it may only time out.
        let dead = culprit_if_dead(error).filter(|&p| p != self.rank && p < self.nranks);
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

/// Read through `rx`'s stream, discarding payloads, until an abort notice is complete (true),
/// no more bytes are there, or the link is dead or corrupt (false).
fn skim_for_notice(ep: &mut Endpoint, rx: &mut LinkRx, peer: usize, scratch: &mut [u8]) -> bool {
    let LinkRx { dec, inbuf } = rx;
    loop {
        let in_notice = dec.in_notice();
        match dec.need() {
            Need::Control(buf) => match inbuf.read(ep, peer, buf) {
                Ok(0) => return false,
                Ok(n) => {
                    if dec.control(n).is_err() {
                        return false;
                    }
                }
                Err(_) if in_notice => dec.truncate_notice(),
                Err(_) => return false,
            },
            Need::Header(_) => {
                dec.accept();
            }
            Need::Stream { len, .. } => {
                let want = len.min(scratch.len());
                match inbuf.read(ep, peer, &mut scratch[..want]) {
                    Ok(0) | Err(_) => return false,
                    Ok(n) => {
                        dec.payload(n);
                    }
                }
            }
            // By reference: none of it is on the stream to skip.
            Need::Reference { len, .. } => {
                dec.payload(len);
            }
            Need::Notice => return true,
        }
    }
}
