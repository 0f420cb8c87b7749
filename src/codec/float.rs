//! Bit layouts of the compressible types and the plain (portable) coding kernels.
//!
//! A value is split into its *cached field* (what the exponent cache keeps, one byte) and the
//! rest ("sm", always sent in Exp frames):
//!
//! | type | cached field            | sm bits | sm packing                                      |
//! |------|-------------------------|---------|-------------------------------------------------|
//! | bf16 | bits 15..8: sign and exponent bits 7..1 | 8 | 1 byte: exponent bit 0 and mantissa (bits 7..0) |
//! | fp16 | bits 14..10: exponent   | 11      | per 8 values: 8 low mantissa bytes, then 3 bytes |
//! |      |                         |         | holding 8 x 3 bits (sign<<2 \| mantissa bits 9..8) |
//! | fp32 | bits 31..24: sign and exponent bits 7..1 | 24 | 3 bytes LE: bits 23..0                 |
//!
//! Why the high byte rather than the exponent for bf16 and fp32: from one step to the next an
//! exponent moves by one, and half of those moves only flip its lowest bit. Keeping that bit in
//! the always-sent byte (where the mantissa bits are as good as random anyway) and the sign in
//! the cache (weights rarely cross zero) halves the exceptions: at peak learning rate 2.0%
//! instead of 3.6% of values, 2.4% fewer bits than the exponent-exception bound.
//!
//! Values are handled as `u32` words (16-bit types in the low half), loaded little-endian.

use crate::DType;

/// Everything the kernels need to know about one floating-point type.
pub trait Layout {
    const DTYPE: DType;
    /// Bytes per element.
    const BYTES: usize;
    /// Position of the cached field (see the table above; "exponent" in names below).
    const EXP_SHIFT: u32;
    /// The largest cached field value (all ones).
    const EXP_MAX: u8;

    fn load(b: &[u8], i: usize) -> u32;
    fn store(b: &mut [u8], i: usize, w: u32);

    #[inline(always)]
    fn exp(w: u32) -> u8 {
        ((w >> Self::EXP_SHIFT) & Self::EXP_MAX as u32) as u8
    }
    #[inline(always)]
    fn sm(w: u32) -> u32 {
        w & !((Self::EXP_MAX as u32) << Self::EXP_SHIFT)
    }
    #[inline(always)]
    fn with_exp(sm: u32, e: u8) -> u32 {
        sm | ((e as u32) << Self::EXP_SHIFT)
    }

    /// Packed sign+mantissa bytes for `k` values.
    fn sm_len(k: usize) -> usize;
    /// Pack the sm of `words` (a stream position that is a multiple of 8) into `out`
    /// (`out.len() == sm_len(words.len())`).
    fn pack(words: &[u32], out: &mut [u8]);
    /// Inverse of `pack`: sm words (exponent field zero). Returns false if padding bits that
    /// must be zero are not.
    fn unpack(inp: &[u8], out: &mut [u32]) -> bool;
}

#[inline(always)]
fn load16(b: &[u8], i: usize) -> u32 {
    u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32
}

#[inline(always)]
fn store16(b: &mut [u8], i: usize, w: u32) {
    b[2 * i..2 * i + 2].copy_from_slice(&(w as u16).to_le_bytes());
}

pub struct Bf16;
pub struct F16;
pub struct F32;

impl Layout for Bf16 {
    const DTYPE: DType = DType::BF16;
    const BYTES: usize = 2;
    const EXP_SHIFT: u32 = 8;
    const EXP_MAX: u8 = 0xff;

    #[inline(always)]
    fn load(b: &[u8], i: usize) -> u32 {
        load16(b, i)
    }
    #[inline(always)]
    fn store(b: &mut [u8], i: usize, w: u32) {
        store16(b, i, w)
    }
    fn sm_len(k: usize) -> usize {
        k
    }
    #[inline(always)]
    fn pack(words: &[u32], out: &mut [u8]) {
        for (o, &w) in out.iter_mut().zip(words) {
            *o = w as u8;
        }
    }
    #[inline(always)]
    fn unpack(inp: &[u8], out: &mut [u32]) -> bool {
        for (o, &b) in out.iter_mut().zip(inp) {
            *o = b as u32;
        }
        true
    }
}

impl Layout for F32 {
    const DTYPE: DType = DType::F32;
    const BYTES: usize = 4;
    const EXP_SHIFT: u32 = 24;
    const EXP_MAX: u8 = 0xff;

    #[inline(always)]
    fn load(b: &[u8], i: usize) -> u32 {
        u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
    }
    #[inline(always)]
    fn store(b: &mut [u8], i: usize, w: u32) {
        b[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
    }
    fn sm_len(k: usize) -> usize {
        3 * k
    }
    #[inline(always)]
    fn pack(words: &[u32], out: &mut [u8]) {
        for (o, &w) in out.chunks_exact_mut(3).zip(words) {
            o.copy_from_slice(&w.to_le_bytes()[..3]);
        }
    }
    #[inline(always)]
    fn unpack(inp: &[u8], out: &mut [u32]) -> bool {
        for (o, c) in out.iter_mut().zip(inp.chunks_exact(3)) {
            *o = u32::from_le_bytes([c[0], c[1], c[2], 0]);
        }
        true
    }
}

impl Layout for F16 {
    const DTYPE: DType = DType::F16;
    const BYTES: usize = 2;
    const EXP_SHIFT: u32 = 10;
    const EXP_MAX: u8 = 0x1f;

    #[inline(always)]
    fn load(b: &[u8], i: usize) -> u32 {
        load16(b, i)
    }
    #[inline(always)]
    fn store(b: &mut [u8], i: usize, w: u32) {
        store16(b, i, w)
    }
    fn sm_len(k: usize) -> usize {
        k + (3 * k).div_ceil(8)
    }
    fn pack(words: &[u32], out: &mut [u8]) {
        let mut pos = 0;
        for g in words.chunks(8) {
            let mut hi: u32 = 0;
            for (j, &w) in g.iter().enumerate() {
                out[pos + j] = w as u8;
                hi |= (((w >> 15) << 2) | ((w >> 8) & 3)) << (3 * j);
            }
            pos += g.len();
            let hb = (3 * g.len()).div_ceil(8);
            out[pos..pos + hb].copy_from_slice(&hi.to_le_bytes()[..hb]);
            pos += hb;
        }
    }
    fn unpack(inp: &[u8], out: &mut [u32]) -> bool {
        let mut pos = 0;
        for g in out.chunks_mut(8) {
            let n = g.len();
            let hb = (3 * n).div_ceil(8);
            let mut h = [0u8; 4];
            h[..hb].copy_from_slice(&inp[pos + n..pos + n + hb]);
            let hi = u32::from_le_bytes(h);
            if hi >> (3 * n) != 0 {
                return false;
            }
            for (j, o) in g.iter_mut().enumerate() {
                let t = (hi >> (3 * j)) & 7;
                *o = inp[pos + j] as u32 | ((t & 3) << 8) | ((t >> 2) << 15);
            }
            pos += n + hb;
        }
        true
    }
}

/// Elements per mask word and per coding block.
pub const BLOCK: usize = 64;
