//! Helpers shared by the fuzz targets: reading fuzzer bytes as parameters, building a cache
//! slot in a given state through the public API, resealing frame checksums so the fuzzer gets
//! past them, and the checks every accepted frame must pass.

use ciera::codec::{bitmask, frame, CacheMode, CacheSlot, FrameChoice, FrameInfo, Mode};
use ciera::DType;

// Frame surgery (section lengths, checksums, slots in a given state, canonical masks) is the
// same as the tests': one file serves both.
#[path = "../../tests/common/frame_support.rs"]
mod frame_support;
pub use frame_support::{mask_is_canonical, rans_table, reseal, section_lens, set_section_lens, slot_at};

/// Fuzzer bytes consumed from the front; runs out into zeros.
pub struct Input<'a>(pub &'a [u8]);

impl Input<'_> {
    pub fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    pub fn u64(&mut self) -> u64 {
        (0..8).fold(0u64, |a, i| a | (self.u8() as u64) << (8 * i))
    }
    /// `n` bytes, cycling the remaining input (zeros if none is left). Consumes up to `n`.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let src = self.0;
        let take = n.min(src.len());
        self.0 = &src[take..];
        if src.is_empty() {
            return vec![0; n];
        }
        (0..n).map(|i| src[i % src.len()].wrapping_add((i / src.len()) as u8)).collect()
    }
    pub fn rest(&mut self) -> &[u8] {
        std::mem::take(&mut self.0)
    }
}

/// An accepted coded mask is the one encoding of its bits in its coding (rANS: with its own
/// frequency table).
pub fn assert_mask_canonical(section: &[u8], m: usize, words: &[u64]) {
    if let Err(e) = mask_is_canonical(section, m, words) {
        panic!("{e}");
    }
}

/// What the receiver held before the frame.
pub struct Before<'a> {
    pub dtype: DType,
    pub mode: CacheMode,
    pub choice: FrameChoice,
    pub len: usize,
    pub prev: &'a [u8],
}

/// An accepted delta frame is the canonical coding of its output against the prior state
/// (same s0 and exponent bytes, masks with the same bits).
pub fn assert_canonical(b: &Before<'_>, bytes: &[u8], info: &FrameInfo, out: &[u8]) {
    if info.mode == Mode::Raw {
        return;
    }
    let choice = if info.mode == Mode::Exp { FrameChoice::Exp } else { FrameChoice::Hybrid };
    let mut tx = slot_at(b.dtype, b.mode, choice, b.len, info.version, true, b.prev);
    let mut f = Vec::new();
    let t = tx.encode(out, &mut f).expect("canonical encode");
    if t.mode == Mode::Raw {
        // The encoder sends a FILL where its delta would be longer than the values; such a
        // delta is still a valid frame to accept, but there is no canonical one to compare.
        return;
    }
    assert_eq!((t.mode, t.exp_changes, t.value_changes), (info.mode, info.exp_changes, info.value_changes), "accepted a non-canonical frame");
    let (p, q) = (frame::parse(bytes).unwrap(), frame::parse(&f).unwrap());
    let masks: &[usize] = if info.mode == Mode::Exp { &[1] } else { &[1, 2] };
    for i in 0..4 {
        if masks.contains(&i) {
            let m = if i == 1 { b.len } else { info.value_changes.unwrap() };
            let (mut x, mut y) = (Vec::new(), Vec::new());
            let _ = bitmask::decode(p.sections[i], m, &mut x);
            let _ = bitmask::decode(q.sections[i], m, &mut y);
            assert_eq!(x, y, "mask s{i} of an accepted frame");
            assert_mask_canonical(p.sections[i], m, &x);
        } else {
            assert_eq!(p.sections[i], q.sections[i], "s{i} of an accepted frame is not canonical");
        }
    }
}

/// After an accepted frame, the receiver's slot must be what it reported: a sender holding the
/// output at the receiver's version gets `next` through exactly.
pub fn assert_consistent(b: &Before<'_>, rx: &mut CacheSlot, out: &[u8], next: &[u8]) {
    if !rx.is_warm() {
        return;
    }
    let mut tx = slot_at(b.dtype, b.mode, b.choice, b.len, rx.version(), true, out);
    let mut f = Vec::new();
    tx.encode(next, &mut f).expect("follow-up encode");
    let mut o = vec![0u8; next.len()];
    let r = rx.decode(&f, &mut o);
    assert!(r.is_ok(), "follow-up frame refused: {r:?}");
    assert!(o == next, "follow-up frame decoded to other values");
}

pub const DTYPES: [DType; 12] = DType::ALL;
pub const MODES: [CacheMode; 2] = [CacheMode::Exponent, CacheMode::FullValue];
pub const CHOICES: [FrameChoice; 3] = [FrameChoice::Exp, FrameChoice::Hybrid, FrameChoice::Auto];
