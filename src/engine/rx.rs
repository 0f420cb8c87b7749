//! The receive side of one link as a pure state machine (sans-IO, as quinn-proto keeps its
//! framing): it never touches a link. The executor asks it what comes next ([`RxDecoder::need`]),
//! moves that many bytes (from the stream, or out of the sender's memory for a reference
//! segment), and tells it how many it moved ([`RxDecoder::control`], [`RxDecoder::payload`]).
//! The same machine serves the call in progress (`recv.rs`), the scan of links the call does not
//! read from, and the hunt for an abort notice after a failure (`abort.rs`), so the stream format
//! of `wire.rs` is walked in one place.
//!
//! ```text
//! Boundary --'M' header complete--> Header --accept, len 0--> Boundary
//!    |                                 \--accept, len > 0--> Payload{segment header}
//!    '--'A' header--> Notice           Payload: 'S' -> Stream{left}, 'R' -> Reference{left},
//!                                               'A' -> Notice (the sender gave up mid-message);
//!                                               last payload byte -> Boundary
//! ```

use super::wire::{
    self, MsgHeader, MAX_NOTICE, MSG_HEADER_LEN, REF_HEADER_LEN, SHORT_HEADER_LEN, TAG_ABORT,
    TAG_MESSAGE, TAG_REF, TAG_SEGMENT,
};
use crate::algo::Unit;
use crate::mem::PeerSpan;

/// The stream says something impossible (an unknown tag, a segment that overruns its message).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Corrupt(pub String);

/// What the decoder needs next.
#[derive(Debug, PartialEq, Eq)]
pub enum Need<'a> {
    /// Control bytes (a header, or an abort notice's text) from the stream: read into this
    /// buffer, then call [`RxDecoder::control`].
    Control(&'a mut [u8]),
    /// `len` payload bytes of `unit`, from offset `at`, follow on the stream: read them into
    /// their destination, then call [`RxDecoder::payload`].
    Stream { unit: Unit, at: usize, len: usize },
    /// `len` payload bytes of `unit`, from offset `at`, are to be copied out of the sender at
    /// `span` (none of them is on the stream); then call [`RxDecoder::payload`].
    Reference {
        unit: Unit,
        at: usize,
        len: usize,
        span: PeerSpan,
    },
    /// A message header is complete: [`RxDecoder::accept`] it to read its payload, or leave it
    /// parked (a header of a later call, read early).
    Header(MsgHeader),
    /// An abort notice is complete: [`RxDecoder::notice`] has it.
    Notice,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Segment {
    /// Reading a segment header into `hdr` (or an abort header that cuts the payload short).
    Header,
    Stream {
        left: usize,
    },
    Reference {
        left: usize,
        span: PeerSpan,
    },
}

#[derive(Debug)]
enum Phase {
    /// Between messages: reading a message header or an abort notice header into `hdr`.
    Boundary,
    /// A complete message header, not accepted yet.
    Header(MsgHeader),
    /// Inside a message's payload: `got` of `len` bytes are here.
    Payload {
        unit: Unit,
        len: usize,
        got: usize,
        seg: Segment,
    },
    /// An abort notice: reason code and text (`filled` of `body.len()` bytes read).
    Notice {
        reason: u8,
        body: Vec<u8>,
        filled: usize,
    },
}

/// The receive state of one link. It outlives a call: a header of the next call may be read
/// (and parked) while this one finishes, and a notice may come at any boundary.
#[derive(Debug)]
pub struct RxDecoder {
    hdr: [u8; MSG_HEADER_LEN],
    /// Bytes of `hdr` filled.
    got: usize,
    phase: Phase,
}

impl Default for RxDecoder {
    fn default() -> Self {
        RxDecoder::new()
    }
}

impl RxDecoder {
    pub fn new() -> RxDecoder {
        RxDecoder {
            hdr: [0; MSG_HEADER_LEN],
            got: 0,
            phase: Phase::Boundary,
        }
    }

    /// How long the header being read is: 8 bytes until its tag says it is longer.
    fn header_target(&self) -> usize {
        if self.got < SHORT_HEADER_LEN {
            return SHORT_HEADER_LEN;
        }
        match (&self.phase, self.hdr[0]) {
            (Phase::Boundary, TAG_MESSAGE) => MSG_HEADER_LEN,
            (Phase::Payload { .. }, TAG_REF) => REF_HEADER_LEN,
            _ => SHORT_HEADER_LEN,
        }
    }

    pub fn need(&mut self) -> Need<'_> {
        let target = self.header_target();
        match &mut self.phase {
            Phase::Boundary
            | Phase::Payload {
                seg: Segment::Header,
                ..
            } => Need::Control(&mut self.hdr[self.got..target]),
            Phase::Header(h) => Need::Header(*h),
            Phase::Payload {
                unit,
                got,
                seg: Segment::Stream { left },
                ..
            } => Need::Stream {
                unit: *unit,
                at: *got,
                len: *left,
            },
            Phase::Payload {
                unit,
                got,
                seg: Segment::Reference { left, span },
                ..
            } => Need::Reference {
                unit: *unit,
                at: *got,
                len: *left,
                span: *span,
            },
            Phase::Notice { body, filled, .. } if *filled < body.len() => {
                Need::Control(&mut body[*filled..])
            }
            Phase::Notice { .. } => Need::Notice,
        }
    }

    /// `n` bytes were read into the buffer of the last [`Need::Control`].
    pub fn control(&mut self, n: usize) -> Result<(), Corrupt> {
        match &mut self.phase {
            Phase::Notice { filled, .. } => {
                *filled += n;
                return Ok(());
            }
            Phase::Boundary
            | Phase::Payload {
                seg: Segment::Header,
                ..
            } => self.got += n,
            Phase::Header(_) | Phase::Payload { .. } => {
                debug_assert!(n == 0, "control bytes outside a header");
                return Ok(());
            }
        }
        if self.got < self.header_target() {
            return Ok(());
        }
        let tag = self.hdr[0];
        match &mut self.phase {
            Phase::Boundary => match tag {
                TAG_MESSAGE => {
                    self.phase = Phase::Header(MsgHeader::decode(&self.hdr));
                    self.got = 0;
                }
                TAG_ABORT => self.start_notice(),
                t => {
                    return Err(Corrupt(format!(
                        "byte {t:#04x} where a message header should start"
                    )))
                }
            },
            Phase::Payload { len, got, seg, .. } => {
                let s = wire::short_len(&self.hdr[..SHORT_HEADER_LEN]);
                let check = |s: usize| {
                    if s == 0 || *got + s > *len {
                        Err(Corrupt(format!(
                            "segment of {s} bytes at offset {got} of a {len}-byte payload"
                        )))
                    } else {
                        Ok(())
                    }
                };
                match tag {
                    TAG_SEGMENT => {
                        check(s)?;
                        *seg = Segment::Stream { left: s };
                        self.got = 0;
                    }
                    TAG_REF => {
                        check(s)?;
                        *seg = Segment::Reference {
                            left: s,
                            span: wire::ref_span(&self.hdr[..REF_HEADER_LEN]),
                        };
                        self.got = 0;
                    }
                    TAG_ABORT => self.start_notice(),
                    t => {
                        return Err(Corrupt(format!(
                            "byte {t:#04x} where a segment header should start"
                        )))
                    }
                }
            }
            Phase::Header(_) | Phase::Notice { .. } => {}
        }
        Ok(())
    }

    /// `hdr` holds a complete 8-byte abort header: read its text next.
    fn start_notice(&mut self) {
        let len = wire::short_len(&self.hdr[..SHORT_HEADER_LEN]).min(MAX_NOTICE);
        self.phase = Phase::Notice {
            reason: self.hdr[1],
            body: vec![0; len],
            filled: 0,
        };
        self.got = 0;
    }

    /// The link broke while a notice's text was arriving: the sender may close right after its
    /// notice, and what arrived is what it said.
    pub fn truncate_notice(&mut self) {
        if let Phase::Notice { body, filled, .. } = &mut self.phase {
            body.truncate(*filled);
        }
    }

    /// Take the message header of [`Need::Header`] and start on its payload. Returns its unit
    /// and payload length (0: the message is complete already).
    pub fn accept(&mut self) -> (Unit, usize) {
        let Phase::Header(h) = self.phase else {
            panic!("RxDecoder::accept without a complete header");
        };
        let len = h.payload_len as usize;
        self.phase = if len == 0 {
            Phase::Boundary
        } else {
            Phase::Payload {
                unit: h.unit,
                len,
                got: 0,
                seg: Segment::Header,
            }
        };
        (h.unit, len)
    }

    /// `n` bytes of the segment of the last [`Need::Stream`] or [`Need::Reference`] were moved.
    /// Returns the unit once its whole payload is here.
    pub fn payload(&mut self, n: usize) -> Option<Unit> {
        let Phase::Payload {
            unit,
            len,
            got,
            seg,
        } = &mut self.phase
        else {
            return None;
        };
        match seg {
            Segment::Stream { left } => {
                debug_assert!(n <= *left);
                *left -= n;
                if *left == 0 {
                    *seg = Segment::Header;
                }
            }
            Segment::Reference { left, span } => {
                debug_assert!(n <= *left);
                *left -= n;
                *span = span.advanced(n);
                if *left == 0 {
                    *seg = Segment::Header;
                }
            }
            Segment::Header => return None,
        }
        *got += n;
        if *got == *len {
            let u = *unit;
            self.phase = Phase::Boundary;
            return Some(u);
        }
        None
    }

    /// Bytes of `unit` that have arrived, if it is this link's message in progress.
    pub fn arrived(&self, unit: Unit) -> Option<usize> {
        match self.phase {
            Phase::Payload { unit: u, got, .. } if u == unit => Some(got),
            _ => None,
        }
    }

    /// Inside a message's payload (not at a boundary, a parked header or a notice).
    pub fn in_payload(&self) -> bool {
        matches!(self.phase, Phase::Payload { .. })
    }

    /// Reading (or holding) an abort notice.
    pub fn in_notice(&self) -> bool {
        matches!(self.phase, Phase::Notice { .. })
    }

    /// The complete notice of [`Need::Notice`]: its reason code and text (culprit first).
    pub fn notice(&self) -> Option<(u8, &[u8])> {
        match &self.phase {
            Phase::Notice {
                reason,
                body,
                filled,
            } if *filled >= body.len() => Some((*reason, body)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::Algo;
    use crate::engine::wire::{AbortReason, CallSig, Op};
    use crate::mem::{PeerRegion, SharedRegion};
    use crate::DType;

    fn sig() -> CallSig {
        CallSig {
            op: Op::AllGather,
            seq: 3,
            count: 100,
            dtype: DType::U8,
            algo: Algo::Ring,
            format: 0,
            nchunks: 1,
        }
    }

    /// What a receiver saw, in order: headers, payload bytes per unit, reference reads, a
    /// notice.
    #[derive(Debug, Default, PartialEq, Eq)]
    struct Seen {
        headers: Vec<MsgHeader>,
        bytes: Vec<(Unit, Vec<u8>)>,
        refs: Vec<(Unit, usize, usize, PeerSpan)>,
        complete: Vec<Unit>,
        notice: Option<(u8, Vec<u8>)>,
    }

    /// Feed `stream` to a decoder at most `step` bytes per read (references are "copied" in
    /// pieces of `step` too), accepting every header; stop at a notice, the end, or an error.
    fn run(stream: &[u8], step: usize) -> (Seen, Result<(), Corrupt>) {
        let mut d = RxDecoder::new();
        let mut seen = Seen::default();
        let mut at = 0;
        loop {
            match d.need() {
                Need::Control(buf) => {
                    let n = buf.len().min(step).min(stream.len() - at);
                    if n == 0 {
                        return (seen, Ok(()));
                    }
                    buf[..n].copy_from_slice(&stream[at..at + n]);
                    at += n;
                    if let Err(e) = d.control(n) {
                        return (seen, Err(e));
                    }
                }
                Need::Header(h) => {
                    seen.headers.push(h);
                    let (unit, len) = d.accept();
                    if len == 0 {
                        seen.complete.push(unit);
                    }
                }
                Need::Stream { unit, at: off, len } => {
                    let n = len.min(step).min(stream.len() - at);
                    if n == 0 {
                        return (seen, Ok(()));
                    }
                    match seen.bytes.last_mut() {
                        Some((u, b)) if *u == unit && b.len() == off => {
                            b.extend_from_slice(&stream[at..at + n])
                        }
                        _ => seen.bytes.push((unit, stream[at..at + n].to_vec())),
                    }
                    at += n;
                    if let Some(u) = d.payload(n) {
                        seen.complete.push(u);
                    }
                }
                Need::Reference {
                    unit,
                    at: off,
                    len,
                    span,
                } => {
                    let n = len.min(step);
                    seen.refs.push((unit, off, n, span));
                    if let Some(u) = d.payload(n) {
                        seen.complete.push(u);
                    }
                }
                Need::Notice => {
                    let (r, body) = d.notice().expect("complete notice");
                    seen.notice = Some((r, body.to_vec()));
                    return (seen, Ok(()));
                }
            }
        }
    }

    fn message(unit: Unit, payload: &[&[u8]]) -> Vec<u8> {
        let len: usize = payload.iter().map(|p| p.len()).sum();
        let mut v = MsgHeader::new(&sig(), unit, len).encode().to_vec();
        for p in payload {
            v.extend_from_slice(&wire::segment_header(p.len()));
            v.extend_from_slice(p);
        }
        v
    }

    #[test]
    fn messages_in_segments_decode_whatever_the_read_sizes() {
        let a: Vec<u8> = (0..200).map(|i| i as u8).collect();
        let mut stream = message(Unit::new(1, 0), &[&a[..50], &a[50..]]);
        stream.extend(message(Unit::new(2, 0), &[]));
        stream.extend(message(Unit::new(3, 1), &[&[7, 8, 9]]));
        for step in [1, 2, 3, 7, 8, 39, 40, 41, 64, 4096] {
            let (seen, r) = run(&stream, step);
            assert_eq!(r, Ok(()), "step {step}");
            assert_eq!(seen.headers.len(), 3);
            assert_eq!(seen.headers[0].payload_len, 200);
            assert_eq!(
                seen.complete,
                [Unit::new(1, 0), Unit::new(2, 0), Unit::new(3, 1)],
                "step {step}"
            );
            let mut got: Vec<(Unit, Vec<u8>)> = Vec::new();
            for (u, b) in seen.bytes {
                match got.last_mut() {
                    Some((v, c)) if *v == u => c.extend(b),
                    _ => got.push((u, b)),
                }
            }
            assert_eq!(
                got,
                [
                    (Unit::new(1, 0), a.clone()),
                    (Unit::new(3, 1), vec![7, 8, 9])
                ]
            );
        }
    }

    #[test]
    fn reference_segments_are_not_on_the_stream_and_advance_their_span() {
        let unit = Unit::new(0, 2);
        let region = SharedRegion {
            id: 9,
            base: 0x1000,
            fd: 5,
        };
        let span = PeerSpan {
            addr: 0x1100,
            region: PeerRegion::Shared(region),
        };
        let mut stream = MsgHeader::new(&sig(), unit, 300).encode().to_vec();
        stream.extend(wire::ref_header(250, span));
        stream.extend(wire::segment_header(50));
        stream.extend([0xAB; 50]);
        let (seen, r) = run(&stream, 100);
        assert_eq!(r, Ok(()));
        assert_eq!(
            seen.refs,
            [
                (unit, 0, 100, span),
                (unit, 100, 100, span.advanced(100)),
                (unit, 200, 50, span.advanced(200))
            ]
        );
        assert_eq!(seen.bytes, [(unit, vec![0xAB; 50])]);
        assert_eq!(seen.complete, [unit]);
    }

    #[test]
    fn a_notice_at_a_boundary_or_inside_a_payload_is_read_whole() {
        let notice = wire::abort_notice(AbortReason::PeerFailed, Some(3), "rank 3 died");
        let mut at_boundary = message(Unit::new(1, 0), &[&[1, 2]]);
        at_boundary.extend(&notice);
        let mut mid_payload = MsgHeader::new(&sig(), Unit::new(1, 0), 100)
            .encode()
            .to_vec();
        mid_payload.extend(wire::segment_header(10));
        mid_payload.extend([0; 10]);
        mid_payload.extend(&notice);
        for stream in [at_boundary, mid_payload] {
            for step in [1, 5, 1000] {
                let (seen, r) = run(&stream, step);
                assert_eq!(r, Ok(()));
                let (reason, body) = seen.notice.expect("the notice");
                assert_eq!(reason, AbortReason::PeerFailed.code());
                assert_eq!(
                    wire::parse_notice_body(&body),
                    (Some(3), "rank 3 died".to_string())
                );
            }
        }
    }

    #[test]
    fn a_notice_cut_short_by_a_closed_link_keeps_what_arrived() {
        let notice = wire::abort_notice(AbortReason::Timeout, None, "waited too long");
        let mut d = RxDecoder::new();
        let Need::Control(buf) = d.need() else {
            panic!()
        };
        buf.copy_from_slice(&notice[..8]);
        d.control(8).unwrap();
        let Need::Control(buf) = d.need() else {
            panic!()
        };
        buf[..6].copy_from_slice(&notice[8..14]);
        d.control(6).unwrap();
        assert!(d.in_notice() && d.notice().is_none());
        d.truncate_notice();
        assert_eq!(d.need(), Need::Notice);
        let (reason, body) = d.notice().unwrap();
        assert_eq!(reason, AbortReason::Timeout.code());
        assert_eq!(body, &notice[8..14]);
    }

    #[test]
    fn corrupt_streams_are_refused_naming_what_was_wrong() {
        // An unknown tag where a message should start.
        let (_, r) = run(b"X1234567", 8);
        assert!(r.unwrap_err().0.contains("0x58 where a message header"));
        // A segment longer than what is left of its payload.
        let mut s = MsgHeader::new(&sig(), Unit::new(0, 0), 10)
            .encode()
            .to_vec();
        s.extend(wire::segment_header(11));
        let (_, r) = run(&s, 64);
        assert_eq!(
            r.unwrap_err().0,
            "segment of 11 bytes at offset 0 of a 10-byte payload"
        );
        // An empty segment, and a bad tag where a segment should start.
        let mut s = MsgHeader::new(&sig(), Unit::new(0, 0), 10)
            .encode()
            .to_vec();
        s.extend(wire::segment_header(0));
        assert!(run(&s, 64).1.is_err());
        let mut s = MsgHeader::new(&sig(), Unit::new(0, 0), 10)
            .encode()
            .to_vec();
        s.extend(*b"M\0\0\0\x0a\0\0\0");
        assert!(run(&s, 64).1.unwrap_err().0.contains("segment header"));
    }

    #[test]
    fn a_parked_header_stays_until_accepted_and_arrived_counts_payload_bytes() {
        let unit = Unit::new(4, 0);
        let stream = message(unit, &[&[1; 30]]);
        let mut d = RxDecoder::new();
        let Need::Control(buf) = d.need() else {
            panic!()
        };
        buf.copy_from_slice(&stream[..8]);
        d.control(8).unwrap();
        let Need::Control(buf) = d.need() else {
            panic!()
        };
        assert_eq!(buf.len(), 32);
        buf.copy_from_slice(&stream[8..40]);
        d.control(32).unwrap();
        // Not accepted: asked again, the same header.
        for _ in 0..2 {
            assert!(matches!(d.need(), Need::Header(h) if h.unit == unit));
        }
        assert_eq!(d.arrived(unit), None);
        assert_eq!(d.accept(), (unit, 30));
        assert_eq!(d.arrived(unit), Some(0));
        let Need::Control(buf) = d.need() else {
            panic!()
        };
        buf.copy_from_slice(&stream[40..48]);
        d.control(8).unwrap();
        assert_eq!(
            d.need(),
            Need::Stream {
                unit,
                at: 0,
                len: 30
            }
        );
        assert_eq!(d.payload(12), None);
        assert_eq!(d.arrived(unit), Some(12));
        assert_eq!(d.payload(18), Some(unit));
        assert!(!d.in_payload());
    }
}
