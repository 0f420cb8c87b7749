//! What travels on a link between two ranks: message headers, payload segments, and abort
//! notices. All integers little-endian. Every header starts with a tag byte, so a reader at a
//! boundary knows what comes next and a corrupt or misaligned stream is caught at once.
//!
//! ```text
//! message header, 40 bytes, one per unit (chunk c of rank s's block) and call:
//!   off len field
//!     0   1 tag 'M'
//!     1   1 op: 1 all_gather, 2 barrier
//!     2   1 dtype (ncclDataType_t number)
//!     3   1 algorithm (algo::Algo code)
//!     4   1 payload format: 0 raw bytes; other values name a frame codec
//!     5   1 wire version (2)
//!     6   2 reserved, zero
//!     8   8 call sequence number (every collective on a communicator counts one)
//!    16   8 count: elements per rank
//!    24   4 source rank s
//!    28   4 chunk index c
//!    32   4 chunks per block
//!    36   4 payload length in bytes (the frame's length for a codec: known only once made)
//! then the payload, as segments until `payload length` bytes have gone:
//!   segment header, 8 bytes: tag 'S', 3 reserved, u32 segment length; then that many bytes;
//!   or, over a shm link whose peer proved it can read the sender's memory, a reference
//!   segment, 40 bytes: tag 'R', 3 reserved, u32 segment length, u64 address of those bytes
//!   in the sender's process, then the shared buffer holding them if any (u64 buffer id,
//!   0 for none; u64 address of the buffer in the sender; u32 the sender's descriptor for
//!   it; 4 reserved); no bytes follow: the receiver copies them out of the sender (from its
//!   mapping of that shared buffer, else with process_vm_readv; see ciera-transport's shm/
//!   and shared.rs), and the sender keeps them unchanged until the receiver has claimed them.
//! abort notice, 8 bytes: tag 'A', reason (1 call mismatch, 2 peer failed, 3 aborted,
//!   4 timeout, 5 other), 2 reserved, u32 length; then u32 culprit rank (u32::MAX: none) and
//!   the UTF-8 description.
//! ```
//!
//! Why segments: a rank that fails mid-message (say, it was forwarding a chunk whose source
//! just died) can still finish the segment it started, from bytes it holds, and then put an
//! abort notice on the stream; the receiver learns who failed instead of seeing a bare close.
//! Segments are cut by the sender (up to [`MAX_SEGMENT`]), so forwarding can start before the
//! whole chunk has arrived.

use crate::algo::{Algo, Unit};
use crate::coded_enum::coded_enum;
use crate::mem::{PeerRegion, PeerSpan, SharedRegion};
use crate::DType;

pub const MSG_HEADER_LEN: usize = 40;
pub const SHORT_HEADER_LEN: usize = 8;
pub const TAG_MESSAGE: u8 = b'M';
pub const TAG_SEGMENT: u8 = b'S';
pub const TAG_ABORT: u8 = b'A';
pub const TAG_REF: u8 = b'R';
pub const REF_HEADER_LEN: usize = 40;
pub const WIRE_VERSION: u8 = 2;

/// Largest segment a sender cuts. Big enough that the 8-byte segment header is noise,
/// small enough that a failing rank can finish a started segment quickly.
pub const MAX_SEGMENT: usize = 1 << 20;
/// Longest abort-notice text a receiver accepts.
pub const MAX_NOTICE: usize = 4096;

coded_enum! {
    #[repr(u8)]
    /// Which collective a message belongs to.
    pub enum Op {
        AllGather = 1,
        Barrier = 2,
    }
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::AllGather => "all_gather",
            Op::Barrier => "barrier",
        }
    }
}

/// Everything about a call that all ranks must agree on. Sent in every message header and
/// checked by the receiver, so ranks that disagree fail with `CallMismatch` instead of
/// exchanging garbage or hanging.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallSig {
    pub op: Op,
    pub seq: u64,
    pub count: u64,
    pub dtype: DType,
    pub algo: Algo,
    pub format: u8,
    pub nchunks: u32,
}

impl CallSig {
    pub fn describe(&self) -> String {
        describe_call(
            self.op.name(),
            self.seq,
            self.count,
            &self.dtype.to_string(),
            self.algo.name(),
            self.nchunks,
            self.format,
        )
    }
}

/// A call in words, the same for this rank's call and a peer's header.
fn describe_call(
    op: &str,
    seq: u64,
    count: u64,
    dtype: &str,
    algo: &str,
    nchunks: u32,
    format: u8,
) -> String {
    let payload = if format == 0 {
        "raw".to_string()
    } else {
        format!("codec format {format}")
    };
    format!(
        "{op} call #{seq} (count {count} of {dtype}, algorithm {algo}, {nchunks} chunk(s) per block, {payload})"
    )
}

/// A parsed message header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsgHeader {
    pub op: u8,
    pub dtype: u8,
    pub algo: u8,
    pub format: u8,
    pub version: u8,
    pub seq: u64,
    pub count: u64,
    pub unit: Unit,
    pub nchunks: u32,
    pub payload_len: u32,
}

impl MsgHeader {
    pub fn new(sig: &CallSig, unit: Unit, payload_len: usize) -> MsgHeader {
        MsgHeader {
            op: sig.op as u8,
            dtype: sig.dtype.code(),
            algo: sig.algo.code(),
            format: sig.format,
            version: WIRE_VERSION,
            seq: sig.seq,
            count: sig.count,
            unit,
            nchunks: sig.nchunks,
            payload_len: payload_len as u32,
        }
    }

    pub fn encode(&self) -> [u8; MSG_HEADER_LEN] {
        let mut b = [0u8; MSG_HEADER_LEN];
        b[0] = TAG_MESSAGE;
        b[1] = self.op;
        b[2] = self.dtype;
        b[3] = self.algo;
        b[4] = self.format;
        b[5] = self.version;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b[24..28].copy_from_slice(&self.unit.src.to_le_bytes());
        b[28..32].copy_from_slice(&self.unit.chunk.to_le_bytes());
        b[32..36].copy_from_slice(&self.nchunks.to_le_bytes());
        b[36..40].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Parse; the caller has checked the tag.
    pub fn decode(b: &[u8; MSG_HEADER_LEN]) -> MsgHeader {
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        MsgHeader {
            op: b[1],
            dtype: b[2],
            algo: b[3],
            format: b[4],
            version: b[5],
            seq: u64_at(8),
            count: u64_at(16),
            unit: Unit {
                src: u32_at(24),
                chunk: u32_at(28),
            },
            nchunks: u32_at(32),
            payload_len: u32_at(36),
        }
    }

    /// How this header's call differs from `mine`, in words; None when it is the same call.
    pub fn mismatch(&self, mine: &CallSig) -> Option<String> {
        let theirs_sig = || {
            let op = Op::from_code(self.op)
                .map(|o| o.name().to_string())
                .unwrap_or_else(|| format!("op {}", self.op));
            let dtype = DType::from_code(self.dtype)
                .map(|d| d.to_string())
                .unwrap_or_else(|| format!("dtype code {}", self.dtype));
            let algo = Algo::from_code(self.algo)
                .map(|a| a.to_string())
                .unwrap_or_else(|| format!("algorithm code {}", self.algo));
            describe_call(
                &op,
                self.seq,
                self.count,
                &dtype,
                &algo,
                self.nchunks,
                self.format,
            )
        };
        let same = self.version == WIRE_VERSION
            && self.op == mine.op as u8
            && self.seq == mine.seq
            && self.count == mine.count
            && self.dtype == mine.dtype.code()
            && self.algo == mine.algo.code()
            && self.format == mine.format
            && self.nchunks == mine.nchunks;
        if same {
            None
        } else if self.version != WIRE_VERSION {
            Some(format!(
                "wire version {} (this build speaks {WIRE_VERSION})",
                self.version
            ))
        } else {
            Some(theirs_sig())
        }
    }
}

pub fn segment_header(len: usize) -> [u8; SHORT_HEADER_LEN] {
    let mut b = [0u8; SHORT_HEADER_LEN];
    b[0] = TAG_SEGMENT;
    b[4..8].copy_from_slice(&(len as u32).to_le_bytes());
    b
}

/// A reference segment header: `len` bytes at `span` in the sender's memory (bytes 16..40 name
/// its shared buffer, zero for [`PeerRegion::Process`]). Byte 1 stays 0: the kind of region
/// for the kinds to come (device memory handles, RDMA keys), 0 being host memory.
pub fn ref_header(len: usize, span: PeerSpan) -> [u8; REF_HEADER_LEN] {
    let mut b = [0u8; REF_HEADER_LEN];
    b[0] = TAG_REF;
    b[4..8].copy_from_slice(&(len as u32).to_le_bytes());
    b[8..16].copy_from_slice(&span.addr.to_le_bytes());
    if let PeerRegion::Shared(r) = span.region {
        b[16..24].copy_from_slice(&r.id.to_le_bytes());
        b[24..32].copy_from_slice(&r.base.to_le_bytes());
        b[32..36].copy_from_slice(&r.fd.to_le_bytes());
    }
    b
}

/// Where a reference segment's bytes are in its sender (the header's bytes 8..40).
pub fn ref_span(b: &[u8]) -> PeerSpan {
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
    let id = u64_at(16);
    let region = if id == 0 {
        PeerRegion::Process
    } else {
        PeerRegion::Shared(SharedRegion {
            id,
            base: u64_at(24),
            fd: u32::from_le_bytes(b[32..36].try_into().unwrap()),
        })
    };
    PeerSpan {
        addr: u64_at(8),
        region,
    }
}

/// The length field of a segment or abort header.
pub fn short_len(b: &[u8]) -> usize {
    u32::from_le_bytes(b[4..8].try_into().unwrap()) as usize
}

coded_enum! {
    #[repr(u8)]
    /// Why a rank gave up, as carried by an abort notice (an unknown number reads as
    /// [`AbortReason::Other`]).
    pub enum AbortReason {
        CallMismatch = 1,
        PeerFailed = 2,
        Aborted = 3,
        Timeout = 4,
        Other = 5,
    }
}

/// An abort notice: header and body in one buffer, ready to send.
pub fn abort_notice(reason: AbortReason, culprit: Option<usize>, text: &str) -> Vec<u8> {
    let mut text = text.as_bytes();
    if text.len() > MAX_NOTICE - 4 {
        text = &text[..MAX_NOTICE - 4];
    }
    let body_len = 4 + text.len();
    let mut v = Vec::with_capacity(SHORT_HEADER_LEN + body_len);
    v.extend_from_slice(&[TAG_ABORT, reason as u8, 0, 0]);
    v.extend_from_slice(&(body_len as u32).to_le_bytes());
    v.extend_from_slice(&culprit.map(|c| c as u32).unwrap_or(u32::MAX).to_le_bytes());
    v.extend_from_slice(text);
    v
}

/// Parse an abort notice body: (culprit, text).
pub fn parse_notice_body(body: &[u8]) -> (Option<usize>, String) {
    if body.len() < 4 {
        return (None, String::from_utf8_lossy(body).into_owned());
    }
    let c = u32::from_le_bytes(body[..4].try_into().unwrap());
    let culprit = if c == u32::MAX {
        None
    } else {
        Some(c as usize)
    };
    (culprit, String::from_utf8_lossy(&body[4..]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig() -> CallSig {
        CallSig {
            op: Op::AllGather,
            seq: 7,
            count: 1000,
            dtype: DType::F32,
            algo: Algo::Ring,
            format: 0,
            nchunks: 3,
        }
    }

    #[test]
    fn header_round_trips_and_matches_its_call() {
        let h = MsgHeader::new(&sig(), Unit::new(5, 2), 4000);
        let b = h.encode();
        assert_eq!(b[0], TAG_MESSAGE);
        let d = MsgHeader::decode(&b);
        assert_eq!(d, h);
        assert_eq!(d.mismatch(&sig()), None);
    }

    #[test]
    fn mismatch_names_the_other_call() {
        let mut other = sig();
        other.count = 7;
        let h = MsgHeader::new(&other, Unit::new(0, 0), 28);
        let m = h.mismatch(&sig()).unwrap();
        assert!(m.contains("count 7 of float"), "{m}");
        let mut other = sig();
        other.dtype = DType::BF16;
        let m = MsgHeader::new(&other, Unit::new(0, 0), 28)
            .mismatch(&sig())
            .unwrap();
        assert!(m.contains("bfloat16"), "{m}");
    }

    #[test]
    fn ref_header_round_trips() {
        let span = PeerSpan {
            addr: 0x7fff_dead_beef,
            region: PeerRegion::Process,
        };
        let b = ref_header(123_456, span);
        assert_eq!(b[0], TAG_REF);
        assert_eq!(b[1..4], [0, 0, 0]);
        assert_eq!(b[16..40], [0u8; 24]);
        assert_eq!(short_len(&b), 123_456);
        assert_eq!(ref_span(&b), span);
        let r = SharedRegion {
            id: 0x1234_5678_9abc,
            base: 0x7fff_0000_1000,
            fd: 0xdead_beef,
        };
        let span = PeerSpan {
            addr: 0x7fff_0000_2000,
            region: PeerRegion::Shared(r),
        };
        let b = ref_header(1, span);
        assert_eq!(short_len(&b), 1);
        assert_eq!(b[16..24], 0x1234_5678_9abcu64.to_le_bytes());
        assert_eq!(ref_span(&b), span);
    }

    #[test]
    fn notice_round_trips() {
        let n = abort_notice(AbortReason::PeerFailed, Some(3), "rank 3 died");
        assert_eq!(n[0], TAG_ABORT);
        assert_eq!(short_len(&n[..8]), n.len() - 8);
        assert_eq!(
            parse_notice_body(&n[8..]),
            (Some(3), "rank 3 died".to_string())
        );
        let long = "x".repeat(10_000);
        let n = abort_notice(AbortReason::Other, None, &long);
        assert_eq!(n.len(), 8 + MAX_NOTICE);
    }
}
