//! The frame header: fixed 64 bytes, little-endian, then four sections. See docs/WIRE.md.
//!
//! ```text
//! off len field
//!   0   4 magic "CIRF"
//!   4   1 format version (3; version 2 frames, which have no mask coding 4, and version 1
//!           frames, which also have no Delta mode, still decode)
//!   5   1 dtype (ncclDataType_t number)
//!   6   1 mode: 0 raw, 1 exp (exponent delta), 2 hybrid (value delta), 3 delta (ulp moves)
//!   7   1 flags: bit 0 FILL (raw frame that (re)fills the receiver's cache slot); others zero
//!   8   8 element count n
//!  16   8 element offset of this chunk within the cache slot
//!  24   8 slot version the frame was encoded against
//!  32  16 four u32 section lengths s0..s3
//!  48   8 SH64 of section s0 (checksum.rs; computed inside the coding loops)
//!  56   8 checksum: xxh3-64 of header bytes 0..56 followed by sections s1, s2, s3
//! ```

use xxhash_rust::xxh3::Xxh3;

use super::checksum;
use super::error::{CodecError, Result};
use crate::coded_enum::coded_enum;
use crate::DType;

pub const MAGIC: [u8; 4] = *b"CIRF";
pub const FORMAT_VERSION: u8 = 3;
/// The oldest format version this build still decodes (version 1: no Delta mode; version 2:
/// no segmented rANS masks).
pub const OLDEST_FORMAT_VERSION: u8 = 1;
pub const HEADER_LEN: usize = 64;
pub const FLAG_FILL: u8 = 1;

coded_enum! {
    #[repr(u8)]
    /// How a frame's payload is coded (the number is header byte 6).
    pub enum Mode {
        /// The values themselves (s0). With FLAG_FILL the receiver also refills its cache slot.
        Raw = 0,
        /// Exponent delta against an exponent (or full-value) cache: s0 sign+mantissa of every
        /// element, s1 mask of exponent changes, s2 the new exponents.
        Exp = 1,
        /// Value delta against a full-value cache: s0 sign+mantissa of changed values, s1 mask
        /// of changed values, s2 mask (over the changed ones) of exponent changes, s3 new
        /// exponents.
        Hybrid = 2,
        /// Ulp moves against a delta cache (values and previous moves): s0 the lane streams,
        /// s1 the lane count, the token tables per context and the lane lengths.
        Delta = 3,
    }
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Raw => "raw",
            Mode::Exp => "exp",
            Mode::Hybrid => "hybrid",
            Mode::Delta => "delta",
        }
    }
}

/// A parsed, checksum-verified header with its sections.
#[derive(Debug)]
pub struct Frame<'a> {
    pub dtype: DType,
    pub mode: Mode,
    pub flags: u8,
    pub count: usize,
    pub offset: usize,
    pub version: u64,
    /// The format version the frame says (header byte 4), `OLDEST_FORMAT_VERSION` to
    /// `FORMAT_VERSION`.
    pub format: u8,
    pub sections: [&'a [u8]; 4],
    /// Total bytes of the frame (header + sections).
    pub len: usize,
    /// SH64 of s0 as the header states it; check with `verify_s0` or inside a fused decoder.
    pub s0_hash: u64,
}

impl Frame<'_> {
    /// Check section s0 against the header's SH64.
    pub fn verify_s0(&self) -> Result<()> {
        self.check_s0(checksum::sh64(self.sections[0]))
    }

    /// Compare a SH64 computed elsewhere (a fused decoder) with the header's.
    pub fn check_s0(&self, actual: u64) -> Result<()> {
        if actual != self.s0_hash {
            return Err(CodecError::Checksum {
                expected: self.s0_hash,
                actual,
            });
        }
        Ok(())
    }
}

pub struct Header {
    pub dtype: DType,
    pub mode: Mode,
    pub flags: u8,
    pub count: usize,
    pub offset: usize,
    pub version: u64,
}

/// Reserve room for a header at the end of `out`; returns where it starts.
pub fn begin(out: &mut Vec<u8>) -> usize {
    let start = out.len();
    out.resize(start + HEADER_LEN, 0);
    start
}

/// Write the header of the frame that starts at `start` and whose sections follow it in `out`
/// with lengths `sections`, and its checksums. `s0_hash` is SH64 of s0 if the encoder already
/// computed it.
pub fn finish(
    out: &mut [u8],
    start: usize,
    h: &Header,
    sections: [usize; 4],
    s0_hash: Option<u64>,
) {
    let body = start + HEADER_LEN;
    let s0_hash = s0_hash.unwrap_or_else(|| checksum::sh64(&out[body..body + sections[0]]));
    let hdr = &mut out[start..start + HEADER_LEN];
    hdr[0..4].copy_from_slice(&MAGIC);
    hdr[4] = FORMAT_VERSION;
    hdr[5] = h.dtype.code();
    hdr[6] = h.mode.code();
    hdr[7] = h.flags;
    hdr[8..16].copy_from_slice(&(h.count as u64).to_le_bytes());
    hdr[16..24].copy_from_slice(&(h.offset as u64).to_le_bytes());
    hdr[24..32].copy_from_slice(&h.version.to_le_bytes());
    for (i, s) in sections.iter().enumerate() {
        let s = u32::try_from(*s).expect("section longer than 4 GiB: chunk the tensor");
        hdr[32 + 4 * i..36 + 4 * i].copy_from_slice(&s.to_le_bytes());
    }
    hdr[48..56].copy_from_slice(&s0_hash.to_le_bytes());
    let payload_end = body + sections.iter().sum::<usize>();
    let sum = header_checksum(
        &out[start..start + 56],
        &out[body + sections[0]..payload_end],
    );
    out[start + 56..start + 64].copy_from_slice(&sum.to_le_bytes());
}

fn header_checksum(header: &[u8], payload: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(header);
    h.update(payload);
    h.digest()
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

/// Total length of the frame starting at `bytes`, from its header alone (for stream framing).
pub fn peek_len(bytes: &[u8]) -> Result<usize> {
    if bytes.len() < HEADER_LEN {
        return Err(CodecError::LengthMismatch {
            what: "frame header bytes",
            expected: HEADER_LEN,
            found: bytes.len(),
        });
    }
    if bytes[0..4] != MAGIC {
        return Err(CodecError::corrupt(
            "magic",
            format!("{:02x?} is not \"CIRF\"", &bytes[0..4]),
        ));
    }
    let mut total = HEADER_LEN;
    for i in 0..4 {
        let s = u32::from_le_bytes([
            bytes[32 + 4 * i],
            bytes[33 + 4 * i],
            bytes[34 + 4 * i],
            bytes[35 + 4 * i],
        ]);
        total += s as usize;
    }
    Ok(total)
}

/// Parse and verify the frame at the start of `bytes` (which may hold more after it).
pub fn parse(bytes: &[u8]) -> Result<Frame<'_>> {
    let len = peek_len(bytes)?;
    if !(OLDEST_FORMAT_VERSION..=FORMAT_VERSION).contains(&bytes[4]) {
        return Err(CodecError::corrupt(
            "format version",
            format!(
                "frame has version {}, this build reads {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION}",
                bytes[4]
            ),
        ));
    }
    if len > bytes.len() {
        return Err(CodecError::LengthMismatch {
            what: "frame bytes",
            expected: len,
            found: bytes.len(),
        });
    }
    let s0_len = u32::from_le_bytes([bytes[32], bytes[33], bytes[34], bytes[35]]) as usize;
    let sum = header_checksum(&bytes[..56], &bytes[HEADER_LEN + s0_len..len]);
    let stored = u64_at(bytes, 56);
    if sum != stored {
        return Err(CodecError::Checksum {
            expected: stored,
            actual: sum,
        });
    }
    let dtype = DType::from_code(bytes[5]).ok_or_else(|| {
        CodecError::corrupt("dtype", format!("unknown element type {}", bytes[5]))
    })?;
    let mode = Mode::from_code(bytes[6])
        .filter(|&m| m != Mode::Delta || bytes[4] >= 2)
        .ok_or_else(|| {
            CodecError::corrupt(
                "mode",
                format!("unknown mode {} in a version {} frame", bytes[6], bytes[4]),
            )
        })?;
    let flags = bytes[7];
    if flags & !FLAG_FILL != 0 || (flags & FLAG_FILL != 0 && mode != Mode::Raw) {
        return Err(CodecError::corrupt(
            "flags",
            format!("invalid flags {flags:#x} for mode {}", mode.name()),
        ));
    }
    let count = usize::try_from(u64_at(bytes, 8))
        .map_err(|_| CodecError::corrupt("count", "element count does not fit this machine"))?;
    let offset = usize::try_from(u64_at(bytes, 16))
        .map_err(|_| CodecError::corrupt("offset", "element offset does not fit this machine"))?;
    let version = u64_at(bytes, 24);
    let mut sections: [&[u8]; 4] = [&[]; 4];
    let mut pos = HEADER_LEN;
    for (i, s) in sections.iter_mut().enumerate() {
        let l = u32::from_le_bytes([
            bytes[32 + 4 * i],
            bytes[33 + 4 * i],
            bytes[34 + 4 * i],
            bytes[35 + 4 * i],
        ]) as usize;
        *s = &bytes[pos..pos + l];
        pos += l;
    }
    Ok(Frame {
        dtype,
        mode,
        flags,
        count,
        offset,
        version,
        format: bytes[4],
        sections,
        len,
        s0_hash: u64_at(bytes, 48),
    })
}
