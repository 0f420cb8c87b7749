//! Golden vectors of the wire format (docs/WIRE.md), stored as annotated hex in
//! tests/data/golden/. For every case:
//! (a) the encoder, fed the case's inputs, produces exactly the stored frames;
//! (b) a receiver decodes the stored frames back to exactly the inputs;
//! (c) the frames are re-derived here, independently of the codec, from the document alone
//!     (header fields, section layouts, sign+mantissa packing, mask codings, rANS, SH64, and
//!     for Delta frames keys, moves, tokens, contexts, the model section and the groups' lane
//!     states and shared rANS word streams (tests/common/delta_spec.rs); only XXH3 comes from a
//!     library), and must match byte for byte. This makes WIRE.md a spec: a change to the
//!     format must change the document, the vectors and this file together.
//!
//! Encoders write format version 3, whose masks coded by rANS are segmented rANS blocks
//! (coding 4: one state and stream per 4096 mask bytes; the rANS-coded cases include masks of
//! one, two, four and nine segments). `*_v1.hex` and `*_v2.hex` vectors are version 1 and 2
//! frames kept as they were stored before versions 2 and 3 (never re-blessed; their rANS masks
//! are coding 3): the current decoder must still decode them, and they must be the version 3
//! frames of the same inputs but for the version byte, the checksums and each coding 3 mask
//! coded 4 with the same table. Every vector without a coding 4 mask must also decode, and be
//! derived, relabelled version 2 (and 1, without Delta frames); one with a coding 4 mask so
//! relabelled must be refused.
//!
//! Large cases repeat their values, and the files write a run of a repeated unit as
//! `HEX*COUNT` (a FILL frame's s0 is its values); the rANS streams are written out in full.
//!
//! `CIERA_BLESS=1 cargo test --test codec_golden` rewrites the vectors from the encoder (not
//! the `_v1` and `_v2` ones); (b) and (c) still run, so a blessed vector that contradicts the
//! document fails anyway.

use std::fmt::Write as _;
use std::path::PathBuf;

use ciera::codec::bitmask::{self, MaskCoding};
use ciera::codec::{checksum, frame, CacheMode, CacheSlot, CodecError, FrameChoice, FrameInfo};
use ciera::DType;

#[path = "common/delta_spec.rs"]
mod delta_spec;
#[path = "common/frame_support.rs"]
mod frame_support;

// ---- the wire format, re-derived from docs/WIRE.md --------------------------------------------

mod spec {
    use ciera::DType;

    pub const HEADER: usize = 64;

    /// The element type byte: `ncclDataType_t` numbering, as WIRE.md lists it.
    pub fn dtype_code(d: DType) -> u8 {
        match d {
            DType::I8 => 0,
            DType::U8 => 1,
            DType::I32 => 2,
            DType::U32 => 3,
            DType::I64 => 4,
            DType::U64 => 5,
            DType::F16 => 6,
            DType::F32 => 7,
            DType::F64 => 8,
            DType::BF16 => 9,
            DType::F8E4M3 => 10,
            DType::F8E5M2 => 11,
        }
    }

    /// (shift, mask) of the cached field of a compressible type ("Modes and sections").
    fn exp_field(d: DType) -> (u32, u32) {
        match d {
            DType::BF16 => (8, 0xff),
            DType::F16 => (10, 0x1f),
            DType::F32 => (24, 0xff),
            _ => panic!("{d} is not delta-coded"),
        }
    }

    pub fn size(d: DType) -> usize {
        match d {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
            _ => panic!(),
        }
    }

    pub fn value(d: DType, b: &[u8], i: usize) -> u32 {
        match size(d) {
            2 => u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32,
            _ => u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()),
        }
    }

    pub fn exponent(d: DType, v: u32) -> u8 {
        let (shift, mask) = exp_field(d);
        ((v >> shift) & mask) as u8
    }

    /// Packed `sm` of `vals`, per the table in "Modes and sections".
    pub fn pack_sm(d: DType, vals: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        match d {
            DType::BF16 => {
                for &v in vals {
                    out.push((v & 0xff) as u8); // bits 7..0
                }
            }
            DType::F32 => {
                for &v in vals {
                    out.extend_from_slice(&(v & 0xff_ffff).to_le_bytes()[..3]); // bits 23..0
                }
            }
            DType::F16 => {
                for group in vals.chunks(8) {
                    let mut fields = 0u32;
                    for (j, &v) in group.iter().enumerate() {
                        out.push((v & 0xff) as u8); // mantissa bits 7..0
                        let f = (((v >> 15) & 1) << 2) | ((v >> 8) & 3); // sign<<2 | mantissa 9..8
                        fields |= f << (3 * j);
                    }
                    let r = group.len();
                    out.extend_from_slice(&fields.to_le_bytes()[..(3 * r).div_ceil(8)]);
                }
                assert_eq!(out.len(), vals.len() + (3 * vals.len()).div_ceil(8));
            }
            _ => panic!(),
        }
        out
    }

    /// Mask bytes b_j: bit i of byte j is bit 8j+i.
    pub fn mask_bytes(bits: &[bool]) -> Vec<u8> {
        let mut b = vec![0u8; bits.len().div_ceil(8)];
        for (i, &x) in bits.iter().enumerate() {
            if x {
                b[i / 8] |= 1 << (i % 8);
            }
        }
        b
    }

    /// A coded mask in `coding` ("Coded masks"). For Rans and RansSeg, the frequency table is
    /// the one of `rans_like` (a stored block: the encoder's choice of frequencies is not part
    /// of the format); the coded stream is re-derived from it.
    pub fn mask(bits: &[bool], coding: u8, rans_like: Option<&[u8]>) -> Vec<u8> {
        let b = mask_bytes(bits);
        let mut out = vec![coding];
        match coding {
            0 => assert!(bits.iter().all(|&x| !x), "Zero coding of a non-zero mask"),
            1 => out.extend_from_slice(&b),
            2 => {
                let words: Vec<&[u8]> = b.chunks(8).collect();
                let g = words.len();
                let mut l1 = vec![0u8; g.div_ceil(8)];
                let (mut l2, mut l3) = (Vec::new(), Vec::new());
                for (wi, w) in words.iter().enumerate() {
                    if w.iter().any(|&x| x != 0) {
                        l1[wi / 8] |= 1 << (wi % 8);
                        let mut map = 0u8;
                        for (j, &x) in w.iter().enumerate() {
                            if x != 0 {
                                map |= 1 << j;
                                l3.push(x);
                            }
                        }
                        l2.push(map);
                    }
                }
                out.extend(l1);
                out.extend(l2);
                out.extend(l3);
            }
            3 | 4 => {
                let like = rans_like.expect("rans needs a table");
                let (freq, table_len) = rans_table(like);
                // "of all nbytes bytes": the table's symbols are the bytes of the mask.
                let mut present = [false; 256];
                for &x in &b {
                    present[x as usize] = true;
                }
                for s in 0..256 {
                    assert_eq!(
                        freq[s] > 0,
                        present[s],
                        "symbol {s:#04x}: in the table iff in the mask's bytes"
                    );
                }
                out.extend_from_slice(&like[..table_len]);
                if coding == 3 {
                    out.extend(rans_encode(&b, &freq));
                } else {
                    out.extend(rans_seg_encode(&b, &freq));
                }
            }
            c => panic!("unknown coding {c}"),
        }
        out
    }

    /// Sizes of the Zero/Flat/Hier codings of a mask (the cheap ones the encoder picks from).
    pub fn cheap_sizes(bits: &[bool]) -> Vec<usize> {
        if bits.iter().all(|&x| !x) {
            return vec![1];
        }
        vec![mask(bits, 1, None).len(), mask(bits, 2, None).len()]
    }

    fn leb128(b: &[u8], pos: &mut usize) -> u32 {
        let mut v = 0u32;
        let mut shift = 0;
        loop {
            let x = b[*pos];
            *pos += 1;
            v |= ((x & 0x7f) as u32) << shift;
            if x & 0x80 == 0 {
                return v;
            }
            shift += 7;
        }
    }

    /// Parse the table of a rANS block: (freq per symbol, table length in bytes).
    pub fn rans_table(b: &[u8]) -> ([u32; 256], usize) {
        let nsym = b[0] as usize + 1;
        let mut pos = 1;
        let mut syms = Vec::new();
        if nsym < 32 {
            syms.extend(b[1..1 + nsym].iter().map(|&s| s as usize));
            pos += nsym;
        } else {
            for s in 0..256 {
                if b[1 + s / 8] >> (s % 8) & 1 == 1 {
                    syms.push(s);
                }
            }
            pos += 32;
        }
        assert_eq!(syms.len(), nsym);
        let mut freq = [0u32; 256];
        for s in syms {
            freq[s] = leb128(b, &mut pos) + 1;
        }
        assert_eq!(freq.iter().sum::<u32>(), 4096, "frequencies sum to 4096");
        (freq, pos)
    }

    fn cum(freq: &[u32; 256]) -> [u32; 256] {
        let mut c = [0u32; 256];
        let mut acc = 0;
        for s in 0..256 {
            c[s] = acc;
            acc += freq[s];
        }
        c
    }

    const L: u32 = 1 << 23;

    /// One encoder step (the inverse of a decoding step) of symbol `s` on state `st`, its
    /// renormalisation bytes pushed onto `rev` (the stream backwards).
    fn rans_put(st: &mut u32, s: u8, freq: &[u32; 256], c: &[u32; 256], rev: &mut Vec<u8>) {
        let f = freq[s as usize];
        // Push bytes until the decoder's step will land back in [2^23, 2^31).
        while *st >= ((L >> 12) << 8) * f {
            rev.push(*st as u8);
            *st >>= 8;
        }
        *st = (*st / f) * 4096 + *st % f + c[s as usize];
    }

    /// States and renormalisation bytes coding `data` with `freq`: the inverse of the decoding
    /// rule in "rANS block" (two states, symbol i on state i % 2, both starting at 2^23).
    pub fn rans_encode(data: &[u8], freq: &[u32; 256]) -> Vec<u8> {
        let c = cum(freq);
        let mut x = [L; 2];
        let mut rev = Vec::new();
        for (i, &s) in data.iter().enumerate().rev() {
            rans_put(&mut x[i % 2], s, freq, &c, &mut rev);
        }
        let mut out = Vec::new();
        out.extend_from_slice(&x[0].to_le_bytes());
        out.extend_from_slice(&x[1].to_le_bytes());
        out.extend(rev.iter().rev());
        out
    }

    /// Bytes per segment of a segmented rANS block.
    pub const SEGMENT: usize = 4096;

    /// States, lengths and streams of the segmented rANS block ("Segmented rANS block") coding
    /// `data` with `freq`: `S = ceil(nbytes / 4096)` segments of 4096 bytes (the last one
    /// shorter), each coded backwards by one state of its own from 2^23, with its own stream.
    pub fn rans_seg_encode(data: &[u8], freq: &[u32; 256]) -> Vec<u8> {
        let c = cum(freq);
        let nseg = data.len().div_ceil(SEGMENT);
        let mut states = Vec::new();
        let mut streams: Vec<Vec<u8>> = Vec::new();
        for j in 0..nseg {
            let seg = &data[SEGMENT * j..(SEGMENT * (j + 1)).min(data.len())];
            let mut x = L;
            let mut rev = Vec::new();
            for &s in seg.iter().rev() {
                rans_put(&mut x, s, freq, &c, &mut rev);
            }
            assert!(rev.len() <= 2 * seg.len(), "at most 2 bytes a symbol");
            states.push(x);
            streams.push(rev.into_iter().rev().collect());
        }
        let mut out = Vec::new();
        for x in &states {
            out.extend_from_slice(&x.to_le_bytes());
        }
        for s in &streams {
            out.extend_from_slice(&u16::try_from(s.len()).unwrap().to_le_bytes());
        }
        for s in &streams {
            out.extend_from_slice(s);
        }
        out
    }

    /// Decode the `nbytes` bytes of a segmented rANS block by the rule in the document: each
    /// segment from its own state and stream, one step as in the rANS block per byte.
    pub fn rans_seg_decode(block: &[u8], nbytes: usize) -> Vec<u8> {
        let (freq, mut pos) = rans_table(block);
        let c = cum(&freq);
        let nseg = nbytes.div_ceil(SEGMENT);
        let u32_at = |p: usize| u32::from_le_bytes(block[p..p + 4].try_into().unwrap());
        let states: Vec<u32> = (0..nseg).map(|j| u32_at(pos + 4 * j)).collect();
        pos += 4 * nseg;
        let lens: Vec<usize> = (0..nseg)
            .map(|j| u16::from_le_bytes([block[pos + 2 * j], block[pos + 2 * j + 1]]) as usize)
            .collect();
        pos += 2 * nseg;
        assert_eq!(
            lens.iter().sum::<usize>(),
            block.len() - pos,
            "the lengths add up to the bytes after them"
        );
        let mut out = Vec::new();
        for j in 0..nseg {
            let mut x = states[j];
            assert!((L..1 << 31).contains(&x), "segment {j}: state out of range");
            let stream = &block[pos..pos + lens[j]];
            let mut at = 0;
            let count = SEGMENT.min(nbytes - SEGMENT * j);
            for _ in 0..count {
                let slot = x & 4095;
                let s = (0..256)
                    .find(|&s| freq[s] > 0 && c[s] <= slot && slot < c[s] + freq[s])
                    .unwrap();
                out.push(s as u8);
                x = freq[s] * (x >> 12) + slot - c[s];
                while x < L {
                    x = (x << 8) | stream[at] as u32;
                    at += 1;
                }
            }
            assert_eq!(at, stream.len(), "segment {j}: its stream consumed exactly");
            assert_eq!(x, L, "segment {j}: final state");
            pos += lens[j];
        }
        out
    }

    /// Decode `n` symbols of a rANS block by the rule in the document.
    pub fn rans_decode(block: &[u8], n: usize) -> Vec<u8> {
        let (freq, mut pos) = rans_table(block);
        let c = cum(&freq);
        let mut x = [0u32; 2];
        for s in &mut x {
            *s = u32::from_le_bytes(block[pos..pos + 4].try_into().unwrap());
            pos += 4;
            assert!((L..1 << 31).contains(s), "state out of range");
        }
        let mut out = Vec::new();
        for i in 0..n {
            let st = &mut x[i % 2];
            let slot = *st & 4095;
            let s = (0..256)
                .find(|&s| freq[s] > 0 && c[s] <= slot && slot < c[s] + freq[s])
                .unwrap();
            out.push(s as u8);
            *st = freq[s] * (*st >> 12) + slot - c[s];
            while *st < L {
                *st = (*st << 8) | block[pos] as u32;
                pos += 1;
            }
        }
        assert_eq!(pos, block.len(), "every byte consumed");
        assert_eq!(x, [L, L], "final states");
        out
    }

    fn fmix(mut x: u64) -> u64 {
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51afd7ed558ccd);
        x ^= x >> 33;
        x = x.wrapping_mul(0xc4ceb9fe1a85ec53);
        x ^ (x >> 33)
    }

    /// SH64, transcribed from the pseudocode in "SH64".
    pub fn sh64(data: &[u8]) -> u64 {
        const P1: u64 = 0x9E3779B185EBCA87;
        const P2: u64 = 0xC2B2AE3D27D4EB4F;
        const P3: u64 = 0x165667B19E3779F9;
        const KEY: [u64; 4] = [
            0xbe4ba423396cfeb8,
            0x1cad21f72c81017c,
            0xdb979083e96dd4de,
            0x1f67b3b7a4a44072,
        ];
        let mut acc = [P1, P2, P3, 0x27D4EB2F165667C5];
        for (s, stripe) in data.chunks(32).enumerate() {
            let mut padded = [0u8; 32];
            padded[..stripe.len()].copy_from_slice(stripe);
            let w: [u64; 4] = std::array::from_fn(|l| {
                u64::from_le_bytes(padded[8 * l..8 * l + 8].try_into().unwrap())
            });
            for l in 0..4 {
                let v = w[l] ^ KEY[l] ^ (s as u64).wrapping_mul(P2);
                acc[l] = acc[l]
                    .wrapping_add((v & 0xffffffff).wrapping_mul(v >> 32))
                    .wrapping_add(w[l ^ 1]);
            }
        }
        let mut h = (data.len() as u64).wrapping_mul(P3);
        for a in acc {
            h = (h ^ fmix(a)).wrapping_mul(P1).rotate_left(27);
        }
        fmix(h)
    }

    /// The format version encoders write ("Frame header", byte 4).
    pub const FORMAT: u8 = 3;

    pub struct Header {
        /// Format version byte: 3, or 2 or 1 for the kept (or derived) older vectors.
        pub format: u8,
        pub dtype: DType,
        pub mode: u8,
        pub fill: bool,
        pub count: u64,
        pub offset: u64,
        pub version: u64,
    }

    /// A whole frame: the header table, then s0..s3.
    pub fn frame(h: &Header, s: [&[u8]; 4]) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(b"CIRF");
        f.push(h.format);
        f.push(dtype_code(h.dtype));
        f.push(h.mode);
        f.push(h.fill as u8);
        f.extend_from_slice(&h.count.to_le_bytes());
        f.extend_from_slice(&h.offset.to_le_bytes());
        f.extend_from_slice(&h.version.to_le_bytes());
        for sec in s {
            f.extend_from_slice(&(sec.len() as u32).to_le_bytes());
        }
        f.extend_from_slice(&sh64(s[0]).to_le_bytes());
        let mut x = xxhash_rust::xxh3::Xxh3::with_seed(0);
        x.update(&f[..56]);
        for sec in &s[1..] {
            x.update(sec);
        }
        f.extend_from_slice(&x.digest().to_le_bytes());
        assert_eq!(f.len(), HEADER);
        for sec in s {
            f.extend_from_slice(sec);
        }
        f
    }
}

// ---- the cases ---------------------------------------------------------------------------------

struct Case {
    name: &'static str,
    about: &'static str,
    dtype: DType,
    mode: CacheMode,
    choice: FrameChoice,
    /// Elements per chunk (None: whole-slot frames).
    chunk: Option<usize>,
    /// The input of each iteration, and `Some(v)` where both sides start over before it with
    /// fresh (cold) slots at version v. Slots start at version 0.
    steps: Vec<(Vec<u8>, Option<u64>)>,
}

fn u16s(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn u32s(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn plain(steps: Vec<Vec<u8>>) -> Vec<(Vec<u8>, Option<u64>)> {
    steps.into_iter().map(|s| (s, None)).collect()
}

// ---- Delta case data ---------------------------------------------------------------------------

/// Bits of a Delta-coded type (W) and of its mantissa.
fn bits_of(d: DType) -> (u32, u32) {
    match d {
        DType::BF16 => (16, 7),
        DType::F16 => (16, 10),
        DType::F32 => (32, 23),
        _ => panic!("{d} is not Delta-coded"),
    }
}

fn to_bytes(d: DType, v: &[u32]) -> Vec<u8> {
    match d.size() {
        2 => v.iter().flat_map(|&x| (x as u16).to_le_bytes()).collect(),
        _ => u32s(v),
    }
}

/// Eight special values per step, at elements 0..8: +0, -0, a NaN with a payload, +inf, 1.0,
/// the smallest subnormal, -1.0, the largest finite value; then (step 1) every one of them
/// moved: +0 -> -0 (one ulp down), -0 -> +0 (one up), the NaN's payload, +inf -> -inf, a sign
/// flip 1.0 -> -1.0, the subnormal's sign, -1.0 -> -0.5, max -> +inf; and (step 2) back or on.
fn specials(d: DType, step: usize) -> [u32; 8] {
    let (w, mant) = bits_of(d);
    let sign = 1u32 << (w - 1);
    let inf = ((1u32 << (w - 1 - mant)) - 1) << mant;
    let one = ((1u32 << (w - 2 - mant)) - 1) << mant;
    let half = one - (1 << mant);
    let qnan = inf | 1 << (mant - 1);
    match step {
        0 => [0, sign, qnan | 1, inf, one, 1, sign | one, inf - 1],
        1 => [
            sign,
            0,
            qnan | 5,
            sign | inf,
            sign | one,
            sign | 1,
            sign | half,
            inf,
        ],
        _ => [
            sign,
            1,
            qnan | 5,
            sign | inf,
            one,
            sign | 1,
            (sign | half) + 1,
            inf - 1,
        ],
    }
}

/// A weight-like value (|x| around 2^-7 .. 2^-5, some negative).
fn weight(d: DType, i: usize) -> u32 {
    let (w, mant) = bits_of(d);
    let bias = (1u32 << (w - 2 - mant)) - 1;
    let e = bias - 7 + (i as u32 * 7) % 3;
    let m = (i as u32).wrapping_mul(0x9E37_79B9) >> (32 - mant);
    (i.is_multiple_of(5) as u32) << (w - 1) | e << mant | m
}

/// Moves of mixed sizes (ulps): mostly 0 and small, contexts -8..8 all reached (12 clips to
/// 8), escapes (zigzag >= 32), a few large ones; `big` adds fp32 moves whose zigzag needs
/// more than 15 extra bits (z >= 2^17), up to 2^29.
fn mixed_move(i: usize, big: bool) -> i64 {
    if i % 101 == 50 {
        return 1000;
    }
    if i % 211 == 7 {
        return -12345;
    }
    if big && i % 97 == 13 {
        return [(1 << 16) + 5, -(1 << 20) - 3, (1 << 24) + 77, -(1 << 29)][i / 97 % 4];
    }
    match i % 16 {
        0..=5 => 0,
        6 => 1,
        7 => -1,
        8 => 2,
        9 => -2,
        10 => 3,
        11 => -4,
        12 => 7,
        13 => -8,
        14 => 12,
        _ => [40, -25, 31, -300][i / 16 % 4],
    }
}

/// A second step's moves, correlated with the first's so its contexts matter: repeat it, stop,
/// or turn back by half.
fn second_move(i: usize, big: bool) -> i64 {
    match i % 3 {
        0 => mixed_move(i, big),
        1 => 0,
        _ => -mixed_move(i, big) / 2,
    }
}

/// `u` moved by `m` ulps (key space, modulo 2^W).
fn moved(d: DType, u: u32, m: i64) -> u32 {
    let w = bits_of(d).0;
    let k = (delta_spec::key(u, w) as i64).wrapping_add(m) as u32 & delta_spec::mask(w);
    delta_spec::unkey(k, w)
}

/// How a step changes element i's value.
type StepFn<'a> = &'a dyn Fn(usize, u32) -> u32;

/// Steps of a Delta case: weights (with the specials in front if `sp`), then `steps` applied
/// in turn (step s > 0 puts `specials(d, s)` in front).
fn delta_steps(d: DType, n: usize, sp: bool, steps: &[StepFn<'_>]) -> Vec<Vec<u8>> {
    let mut v: Vec<u32> = (0..n).map(|i| weight(d, i)).collect();
    let with_specials = |v: &mut Vec<u32>, s: usize| {
        if sp {
            for (x, sp) in v.iter_mut().zip(specials(d, s)) {
                *x = sp;
            }
        }
    };
    with_specials(&mut v, 0);
    let mut out = vec![to_bytes(d, &v)];
    for (s, f) in steps.iter().enumerate() {
        v = v.iter().enumerate().map(|(i, &u)| f(i, u)).collect();
        with_specials(&mut v, s + 1);
        out.push(to_bytes(d, &v));
    }
    out
}

/// Delta cases of several lanes (a partial last row in each group).
fn delta_cases() -> Vec<Case> {
    let mut v = Vec::new();
    let first = |i: usize, u: u32| moved(DType::BF16, u, mixed_move(i, false));
    let second = |i: usize, u: u32| moved(DType::BF16, u, second_move(i, false));
    v.push(Case {
        name: "bf16_delta_1537",
        about: "bf16, delta cache, Delta frames, 1537 values (3 lanes; the last row has lane 0 \
                only): a FILL, then a Delta frame \
                with every context 0 (byte 8, as the FILL left it) and moves of mixed sizes: 0, +-1 .. +-8, 12 \
                (context +8), escapes (zigzag >= 32: 40, -25, -300, 1000, -12345), +0 -> -0 and \
                -0 -> +0 (one ulp), a NaN payload, +inf -> -inf, the sign flip 1.0 -> -1.0; \
                then a Delta frame against the contexts the first left (its previous moves \
                clipped to -8..8: tables for up to 17 contexts)",
        dtype: DType::BF16,
        mode: CacheMode::Delta,
        choice: FrameChoice::Delta,
        chunk: None,
        steps: plain(delta_steps(DType::BF16, 1537, true, &[&first, &second])),
    });
    let first_big = |i: usize, u: u32| moved(DType::F32, u, mixed_move(i, true));
    let second_big = |i: usize, u: u32| moved(DType::F32, u, second_move(i, true));
    v.push(Case {
        name: "f32_delta_1025",
        about: "fp32, delta cache, Delta frames, 1025 values (2 lanes, a partial last row): moves \
                of mixed sizes as in bf16_delta_1537 plus moves of 2^16+5, -2^20-3, 2^24+77 and -2^29 ulps (zigzag \
                >= 2^17: more than 15 extra bits, in two steps) and the sign flip 1.0 -> -1.0 \
                (a move of about -2^31: 30 extra bits); two Delta frames, the second with the \
                first's contexts",
        dtype: DType::F32,
        mode: CacheMode::Delta,
        choice: FrameChoice::Delta,
        chunk: None,
        steps: plain(delta_steps(
            DType::F32,
            1025,
            true,
            &[&first_big, &second_big],
        )),
    });
    let first16 = |i: usize, u: u32| moved(DType::F16, u, mixed_move(i, false));
    let second16 = |i: usize, u: u32| moved(DType::F16, u, second_move(i, false));
    v.push(Case {
        name: "f16_delta_1537",
        about:
            "fp16, delta cache, Delta frames, 1537 values (3 lanes): moves of mixed sizes as in \
                bf16_delta_1537 (with fp16's +-0, NaN, inf, subnormal and max), two Delta \
                frames, the second with the first's contexts",
        dtype: DType::F16,
        mode: CacheMode::Delta,
        choice: FrameChoice::Delta,
        chunk: None,
        steps: plain(delta_steps(DType::F16, 1537, true, &[&first16, &second16])),
    });
    // Chunk 1 of step 2 draws every mantissa afresh: Auto sends it as an Exp frame, which
    // resets that chunk's contexts; step 3 then codes chunk 0 with the contexts of step 2 and
    // chunk 1 with context 0 everywhere.
    let wholesale = |i: usize, u: u32| {
        if i >= 600 {
            (u & !0x7f) | ((i as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93) >> 57) as u32
        } else {
            moved(DType::BF16, u, mixed_move(i, false))
        }
    };
    v.push(Case {
        name: "bf16_delta_auto_chunked_1200",
        about: "bf16, delta cache, frame choice Auto, 1200 values in chunks of 600 (offsets 0 \
                and 600): a FILL; two Delta frames; then chunk 0 a Delta frame (contexts from \
                step 1) while chunk 1's mantissas are all drawn afresh, which Auto sends as an \
                Exp frame (it leaves context 0 behind); then two Delta frames again",
        dtype: DType::BF16,
        mode: CacheMode::Delta,
        choice: FrameChoice::Auto,
        chunk: Some(600),
        steps: plain(delta_steps(
            DType::BF16,
            1200,
            true,
            &[&first, &wholesale, &second],
        )),
    });
    v
}

/// Delta cases of small frames: one lane, a partial row, a FILL instead.
fn small_delta_cases() -> Vec<Case> {
    let mut v = Vec::new();
    let first = |i: usize, u: u32| moved(DType::BF16, u, mixed_move(i, false));
    let second = |i: usize, u: u32| moved(DType::BF16, u, second_move(i, false));
    v.push(Case {
        name: "bf16_delta_fill_fallback_10",
        about: "bf16, delta cache, Delta frames forced, 10 values: every Delta frame would be \
                longer than the 84 bytes of the values plus the header (s1 alone is 5 + 17 \
                bytes and a group length, s0 a lane state), so the warm sender sends raw FILLs",
        dtype: DType::BF16,
        mode: CacheMode::Delta,
        choice: FrameChoice::Delta,
        chunk: None,
        steps: plain(delta_steps(DType::BF16, 10, true, &[&first, &second])),
    });
    let small = |i: usize, u: u32| {
        moved(
            DType::F32,
            u,
            [0i64, 0, 1, -1, 0, 2, 0, 0, -1, 0, 0, 1][i % 12],
        )
    };
    v.push(Case {
        name: "f32_delta_12",
        about: "fp32, delta cache, Delta frames, 12 values (one lane): moves of 0, +-1 and 2, twice (no specials: their tokens would need tables too \
                long for a frame of 48 value bytes)",
        dtype: DType::F32,
        mode: CacheMode::Delta,
        choice: FrameChoice::Delta,
        chunk: None,
        steps: plain(delta_steps(DType::F32, 12, false, &[&small, &small])),
    });
    v.push(Case {
        name: "bf16_delta_300",
        about: "bf16, delta cache, Delta frames, 300 values: moves of mixed sizes as in \
                bf16_delta_1537 (escapes, +-0, NaN payload, sign flip), then a second Delta frame \
                with the first's contexts",
        dtype: DType::BF16,
        mode: CacheMode::Delta,
        choice: FrameChoice::Delta,
        chunk: None,
        steps: plain(delta_steps(DType::BF16, 300, true, &[&first, &second])),
    });
    v.push(Case {
        name: "bf16_delta_chunked_700",
        about: "bf16, delta cache, Delta frames, 700 values in chunks of 256 (offsets 0, 256, \
                512; the last chunk 188 values): per chunk a FILL, then Delta frames",
        dtype: DType::BF16,
        mode: CacheMode::Delta,
        choice: FrameChoice::Delta,
        chunk: Some(256),
        steps: plain(delta_steps(DType::BF16, 700, true, &[&first, &second])),
    });
    v
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    v.push(Case {
        name: "bf16_exp_8",
        about:
            "bf16, exponent cache, 8 values: a FILL, then an exp frame with one exponent change \
                (element 0, 1.0 -> 2.0) and three mantissa changes; flat mask",
        dtype: DType::BF16,
        mode: CacheMode::Exponent,
        choice: FrameChoice::Auto,
        chunk: None,
        steps: plain(vec![
            // 1.0, -2.0, 0.5, 3.0, 0.0, -0.0, 1.5, 100.0
            u16s(&[
                0x3F80, 0xC000, 0x3F00, 0x4040, 0x0000, 0x8000, 0x3FC0, 0x42C8,
            ]),
            // 2.0, -2.5, 0.5, 3.5, 0.0, -0.0, 1.75, 100.0
            u16s(&[
                0x4000, 0xC020, 0x3F00, 0x4060, 0x0000, 0x8000, 0x3FE0, 0x42C8,
            ]),
        ]),
    });
    v.push(Case {
        name: "f16_exp_11",
        about:
            "fp16, exponent cache, 11 values (a group of 8 and a tail of 3 in the 3-bit packing), \
                with +inf, a NaN with payload, a subnormal and -0; two exponent changes (3, 9)",
        dtype: DType::F16,
        mode: CacheMode::Exponent,
        choice: FrameChoice::Auto,
        chunk: None,
        steps: plain(vec![
            u16s(&[
                0x3C00, 0xC000, 0x3800, 0x7BFF, 0x7C00, 0x7E01, 0x0001, 0x8000, 0x3E00, 0x2E66,
                0x4200,
            ]),
            u16s(&[
                0x3C01, 0xC000, 0x3A00, 0x77FF, 0x7C00, 0x7E02, 0x0003, 0x8000, 0x3E00, 0x3266,
                0x4201,
            ]),
        ]),
    });
    v.push(Case {
        name: "f32_exp_5",
        about:
            "fp32, full-value cache sending exp frames, 5 values (a subnormal, a quiet NaN with \
                payload): one exponent change, then none (Zero mask)",
        dtype: DType::F32,
        mode: CacheMode::FullValue,
        choice: FrameChoice::Exp,
        chunk: None,
        steps: plain(vec![
            u32s(&[
                0x3F80_0000,
                0xBDCC_CCCD,
                0x0001_16C2,
                0x7FC0_0123,
                0x447A_0000,
            ]),
            u32s(&[
                0x3F80_0001,
                0xBE4C_CCCD,
                0x0001_16C2,
                0x7FC0_0124,
                0x447A_0000,
            ]),
            u32s(&[
                0x3F80_0002,
                0xBE4C_CCCE,
                0x0001_16C3,
                0x7FC0_0124,
                0x447A_0001,
            ]),
        ]),
    });
    v.push(Case {
        name: "bf16_hybrid_10",
        about:
            "bf16, full-value cache, hybrid frames, 10 values: 3 change (one with its exponent, \
                one a NaN payload), then nothing changes (k = 0: empty s0, Zero masks)",
        dtype: DType::BF16,
        mode: CacheMode::FullValue,
        choice: FrameChoice::Hybrid,
        chunk: None,
        steps: plain(vec![
            u16s(&[
                0x3F80, 0x3F81, 0x3F82, 0x3F83, 0xBF80, 0x4000, 0x4001, 0x0000, 0x7FC1, 0x3C00,
            ]),
            u16s(&[
                0x3F80, 0x3F85, 0x3F82, 0x3F83, 0xBF80, 0x4080, 0x4001, 0x0000, 0x7FC2, 0x3C00,
            ]),
            u16s(&[
                0x3F80, 0x3F85, 0x3F82, 0x3F83, 0xBF80, 0x4080, 0x4001, 0x0000, 0x7FC2, 0x3C00,
            ]),
        ]),
    });
    v.push(Case {
        name: "f16_hybrid_13",
        about:
            "fp16, full-value cache, hybrid frames, 13 values: 9 change (the 3-bit packing over \
                the 9 changed values: a group of 8 and a tail of 1), two of them in exponent",
        dtype: DType::F16,
        mode: CacheMode::FullValue,
        choice: FrameChoice::Hybrid,
        chunk: None,
        steps: plain(vec![
            u16s(&[
                0x3C00, 0x3C01, 0x3C02, 0x3C03, 0xBC04, 0x3C05, 0x3C06, 0x3C07, 0x3C08, 0x3C09,
                0x3C0A, 0x3C0B, 0x3C0C,
            ]),
            u16s(&[
                0x3C00, 0x3D01, 0x3C12, 0x4003, 0xBE04, 0x3C05, 0x3F06, 0x3C17, 0x3C08, 0xB809,
                0x3C1A, 0x3C0B, 0x3FFF,
            ]),
        ]),
    });
    v.push(Case {
        name: "bf16_exp_hier_200",
        about:
            "bf16, exponent cache, 200 values, exponent changes at 5, 6 and 150: a hierarchical \
                mask (L1 = 0b0101, L2 = [0x01, 0x04], L3 = [0x60, 0x40])",
        dtype: DType::BF16,
        mode: CacheMode::Exponent,
        choice: FrameChoice::Auto,
        chunk: None,
        steps: plain(vec![
            u16s(
                &(0..200u16)
                    .map(|i| 0x3C00 | ((i * 37) & 0x7f) | ((i & 1) << 15))
                    .collect::<Vec<_>>(),
            ),
            u16s(
                &(0..200u16)
                    .map(|i| {
                        let e = if [5, 6, 150].contains(&i) { 121 } else { 120 };
                        (e << 7) | ((i * 37 + 1) & 0x7f) | ((i & 1) << 15)
                    })
                    .collect::<Vec<_>>(),
            ),
        ]),
    });
    v.push(Case {
        name: "bf16_hybrid_rans_512",
        about:
            "bf16, full-value cache, hybrid frames, 512 values; the changed-value mask has bytes \
                0x0f (7 of 8) and 0xf0: coded with rANS (two symbols, freqs 3584 and 512)",
        dtype: DType::BF16,
        mode: CacheMode::FullValue,
        choice: FrameChoice::Hybrid,
        chunk: None,
        steps: plain(vec![
            u16s(&(0..512u16).map(|i| 0x3D00 | (i & 0x7f)).collect::<Vec<_>>()),
            u16s(
                &(0..512u16)
                    .map(|i| {
                        let byte = (i / 8) as usize;
                        let m: u8 = if byte % 8 == 7 { 0xf0 } else { 0x0f };
                        let changed = m >> (i % 8) & 1 == 1;
                        (0x3D00 | (i & 0x7f)) ^ changed as u16
                    })
                    .collect::<Vec<_>>(),
            ),
        ]),
    });
    v.push(Case {
        name: "bf16_exp_chunked_20",
        about: "bf16, exponent cache, 20 values in chunks of 8: three frames per iteration with \
                offsets 0, 8, 16; one exponent change, in the last chunk",
        dtype: DType::BF16,
        mode: CacheMode::Exponent,
        choice: FrameChoice::Auto,
        chunk: Some(8),
        steps: plain(vec![
            u16s(&(0..20u16).map(|i| 0x3F00 + i).collect::<Vec<_>>()),
            u16s(
                &(0..20u16)
                    .map(|i| if i == 17 { 0x3F80 + i } else { 0x3F00 + i + 1 })
                    .collect::<Vec<_>>(),
            ),
        ]),
    });
    v.push(Case {
        name: "bf16_refill_at_version",
        about: "bf16, exponent cache, 4 values: FILL at version 0, an exp frame at version 1, then \
                both sides start over with cold slots at version 0x0123456789abcdef: a FILL at that \
                version, and an exp frame at the next",
        dtype: DType::BF16,
        mode: CacheMode::Exponent,
        choice: FrameChoice::Auto,
        chunk: None,
        steps: vec![
            (u16s(&[0x3F80, 0x3F81, 0x3F82, 0x3F83]), None),
            (u16s(&[0x3F80, 0x4001, 0x3F82, 0x3F83]), None),
            (u16s(&[0x4080, 0x4001, 0x3F82, 0x7F80]), Some(0x0123_4567_89ab_cdef)),
            (u16s(&[0x4080, 0x4002, 0x3F82, 0x7F80]), None),
        ],
    });
    v.push(Case {
        name: "bf16_fill_fallback_4",
        about: "bf16, exponent cache, 4 values whose exponents all change: the exp frame would be \
                74 bytes, more than the 72 of the values plus the header, so the warm sender sends \
                a raw FILL instead (version 1); then an exp frame again",
        dtype: DType::BF16,
        mode: CacheMode::Exponent,
        choice: FrameChoice::Auto,
        chunk: None,
        steps: plain(vec![
            u16s(&[0x3F80, 0x3F81, 0x3F82, 0x3F83]),
            u16s(&[0x4080, 0x4081, 0x4082, 0x4083]),
            u16s(&[0x4081, 0x4081, 0x4082, 0x4083]),
        ]),
    });
    v.push(Case {
        name: "i32_raw_3",
        about: "int32 (not compressed), 3 values: raw frames without FILL, versions 0 and 1",
        dtype: DType::I32,
        mode: CacheMode::Exponent,
        choice: FrameChoice::Auto,
        chunk: None,
        steps: plain(vec![
            u32s(&[1, 0xFFFF_FFFF, 0x8000_0000]),
            u32s(&[2, 0xFFFF_FFFE, 0x8000_0000]),
        ]),
    });
    v.extend(rans_seg_cases());
    v.extend(delta_cases());
    v.extend(small_delta_cases());
    v
}

/// Steps of a large Hybrid case whose masks the encoder codes by segmented rANS: `n` values of
/// `d` repeating every 8 (mantissa `(i % 8) * 9`), then the values of mask byte j's set bits
/// changed, `bytes[j % bytes.len()]`; a changed value at `i % 8 == 3` changes its cached field
/// (its lowest bit), the others their mantissa's lowest bit. Every mask byte is non-zero, so
/// neither Flat nor Hier gets near the entropy of the few byte values. The values repeat
/// (every `8 * bytes.len()`), so the file writes them as runs; the rANS streams do not.
fn rans_seg_steps(d: DType, n: usize, bytes: &[u8]) -> Vec<Vec<u8>> {
    let (one, exp_bit) = match d {
        DType::BF16 => (0x3D00u32, 8),
        DType::F16 => (0x3C00, 10),
        _ => panic!("{d}"),
    };
    let old: Vec<u32> = (0..n).map(|i| one | ((i as u32 % 8) * 9)).collect();
    let new: Vec<u32> = old
        .iter()
        .enumerate()
        .map(|(i, &u)| {
            let changed = bytes[i / 8 % bytes.len()] >> (i % 8) & 1 == 1;
            match (changed, i % 8 == 3) {
                (false, _) => u,
                (true, true) => u ^ (1 << exp_bit),
                (true, false) => u ^ 1,
            }
        })
        .collect();
    vec![to_bytes(d, &old), to_bytes(d, &new)]
}

/// Cases whose masks are segmented rANS blocks (coding 4) of one segment, two, and nine (eight
/// whole segments, which the vector decoder runs at once, and a short one).
fn rans_seg_cases() -> Vec<Case> {
    let mut v = Vec::new();
    v.push(Case {
        name: "bf16_exp_rans_2048",
        about: "bf16, exponent cache, 2048 values: a FILL, then an exp frame whose mask of \
                exponent changes has bytes 0x01 (7 of 8) and 0x10: coded by segmented rANS \
                (coding 4, one segment of 256 bytes)",
        dtype: DType::BF16,
        mode: CacheMode::Exponent,
        choice: FrameChoice::Auto,
        chunk: None,
        steps: plain(vec![
            u16s(
                &(0..2048u16)
                    .map(|i| 0x3D00 | ((i % 128 * 37) & 0x7f))
                    .collect::<Vec<_>>(),
            ),
            u16s(
                &(0..2048u16)
                    .map(|i| {
                        let byte = (i / 8) as usize;
                        let m: u8 = if byte % 8 == 7 { 0x10 } else { 0x01 };
                        let exp = m >> (i % 8) & 1 == 1;
                        (0x3D00 | ((i % 128 * 37 + 1) & 0x7f)) ^ (exp as u16) << 8
                    })
                    .collect::<Vec<_>>(),
            ),
        ]),
    });
    v.push(Case {
        name: "f16_hybrid_rans_40000",
        about: "fp16, full-value cache, hybrid frames, 40000 values: the changed-value mask \
                (5000 bytes: 0x0f, 0xf0 and 0x3c, repeating every 13 bytes) coded by segmented \
                rANS in two segments (4096 bytes and 904); the exponent mask over the changed \
                values by segmented rANS in one",
        dtype: DType::F16,
        mode: CacheMode::FullValue,
        choice: FrameChoice::Hybrid,
        chunk: None,
        steps: plain(rans_seg_steps(
            DType::F16,
            40_000,
            &[
                0x0f, 0x0f, 0x0f, 0x0f, 0x0f, 0xf0, 0x0f, 0x0f, 0x0f, 0x3c, 0x0f, 0x0f, 0xf0,
            ],
        )),
    });
    v.push(Case {
        name: "bf16_hybrid_rans_270000",
        about: "bf16, full-value cache, hybrid frames, 270000 values: the changed-value mask \
                (33750 bytes: 0x0f, 0xf0, 0x3c and 0x81, repeating every 11 bytes) coded by \
                segmented rANS in nine segments (eight of 4096 bytes and one of 982); the \
                exponent mask over the changed values in four",
        dtype: DType::BF16,
        mode: CacheMode::FullValue,
        choice: FrameChoice::Hybrid,
        chunk: None,
        steps: plain(rans_seg_steps(
            DType::BF16,
            270_000,
            &[
                0x0f, 0x0f, 0xf0, 0x0f, 0x3c, 0x0f, 0x0f, 0x81, 0x0f, 0xf0, 0x0f,
            ],
        )),
    });
    v
}

// ---- running a case ------------------------------------------------------------------------------

/// Frames of every step (one per chunk), from a fresh sender.
fn encode_case(c: &Case) -> Vec<Vec<(FrameInfo, Vec<u8>)>> {
    let len = c.steps[0].0.len() / c.dtype.size();
    let fresh = |v: u64| {
        let mut s = CacheSlot::with_version(c.dtype, c.mode, len, v);
        s.set_frame_choice(c.choice);
        s
    };
    let mut tx = fresh(0);
    let mut all = Vec::new();
    for (input, restart) in &c.steps {
        if let Some(v) = restart {
            tx = fresh(*v);
        }
        let frames = match c.chunk {
            None => {
                let mut f = Vec::new();
                let info = tx.encode(input, &mut f).unwrap();
                vec![(info, f)]
            }
            Some(n) => {
                let size = c.dtype.size();
                let r: Vec<(FrameInfo, Vec<u8>)> = tx
                    .chunks(n)
                    .iter_mut()
                    .map(|ch| {
                        let mut f = Vec::new();
                        let info = ch
                            .encode(
                                &input[ch.offset() * size..(ch.offset() + ch.len()) * size],
                                &mut f,
                            )
                            .unwrap();
                        (info, f)
                    })
                    .collect();
                let infos: Vec<FrameInfo> = r.iter().map(|(i, _)| i.clone()).collect();
                tx.commit(&infos).unwrap();
                r
            }
        };
        all.push(frames);
    }
    all
}

/// Decode stored frames with a fresh receiver; returns the output of every step.
fn decode_case(c: &Case, frames: &[Vec<Vec<u8>>]) -> Vec<Vec<u8>> {
    let len = c.steps[0].0.len() / c.dtype.size();
    let size = c.dtype.size();
    // The receiver's own start version is irrelevant: the first FILL sets it.
    let mut rx = CacheSlot::new(c.dtype, c.mode, len);
    let mut outs = Vec::new();
    for (step, ((_, restart), fs)) in c.steps.iter().zip(frames).enumerate() {
        if restart.is_some() {
            rx = CacheSlot::new(c.dtype, c.mode, len);
        }
        let mut out = vec![0xEEu8; len * size];
        match c.chunk {
            None => {
                assert_eq!(fs.len(), 1);
                rx.decode(&fs[0], &mut out)
                    .unwrap_or_else(|e| panic!("{} step {step}: {e}", c.name));
            }
            Some(n) => {
                let infos: Vec<FrameInfo> =
                    {
                        let mut chunks = rx.chunks(n);
                        assert_eq!(chunks.len(), fs.len());
                        // Decode in reverse order: frames are independent.
                        let mut infos = Vec::new();
                        for (i, ch) in chunks.iter_mut().enumerate().rev() {
                            let p = frame::parse(&fs[i]).unwrap();
                            let r = ch.offset() * size..(ch.offset() + ch.len()) * size;
                            infos.push(ch.decode(&p, &mut out[r]).unwrap_or_else(|e| {
                                panic!("{} step {step} chunk {i}: {e}", c.name)
                            }));
                        }
                        infos
                    };
                rx.commit(&infos).unwrap();
            }
        }
        outs.push(out);
    }
    outs
}

/// Re-derive every frame of a case from the document, in format version `format`. `stored`
/// supplies only what the format leaves to the encoder: the mode an `Auto` slot picks, the
/// coding of each mask (and a rANS or segmented rANS block's frequency table), and a Delta
/// frame's lanes, group and token tables (checked against the document's rules and the
/// elements they describe). Format version 3 masks coded by rANS must be coding 4, older ones
/// coding 3.
fn derive_case(c: &Case, stored: &[Vec<Vec<u8>>], format: u8) -> Vec<Vec<Vec<u8>>> {
    let size = c.dtype.size();
    let n_all = c.steps[0].0.len() / size;
    let chunk = c.chunk.unwrap_or(n_all.max(1));
    let mut warm = false;
    let mut version = 0u64;
    let mut prev: Vec<u8> = Vec::new();
    // Delta caches: the context byte of every element (8, "no previous move", after a FILL).
    let mut contexts = vec![delta_spec::CONTEXT_NONE; n_all];
    let mut derived = Vec::new();
    for (step, ((input, restart), fs)) in c.steps.iter().zip(stored).enumerate() {
        if let Some(v) = restart {
            warm = false;
            version = *v;
        }
        let mut frames = Vec::new();
        let offsets: Vec<usize> = if n_all == 0 {
            vec![0]
        } else {
            (0..n_all).step_by(chunk).collect()
        };
        for (ci, &off) in offsets.iter().enumerate() {
            let n = chunk.min(n_all - off);
            let cur = &input[off * size..(off + n) * size];
            let actual = &fs[ci];
            let ctx = format!("{} step {step} chunk {ci}", c.name);
            let mut h = spec::Header {
                format,
                dtype: c.dtype,
                mode: 0,
                fill: false,
                count: n as u64,
                offset: off as u64,
                version,
            };
            let ctxs = &mut contexts[off..off + n];
            let f = if !c.dtype.is_compressible() {
                spec::frame(&h, [cur, &[], &[], &[]])
            } else if !warm {
                h.fill = true;
                ctxs.fill(delta_spec::CONTEXT_NONE);
                spec::frame(&h, [cur, &[], &[], &[]])
            } else {
                let old = &prev[off * size..(off + n) * size];
                let vals: Vec<u32> = (0..n).map(|i| spec::value(c.dtype, cur, i)).collect();
                let olds: Vec<u32> = (0..n).map(|i| spec::value(c.dtype, old, i)).collect();
                let exp_changed: Vec<bool> = (0..n)
                    .map(|i| spec::exponent(c.dtype, vals[i]) != spec::exponent(c.dtype, olds[i]))
                    .collect();
                let fallback = actual[6] == 0;
                // Exponent caches send Exp; full-value caches Exp or Hybrid (Hybrid for a
                // forced Delta); delta caches any of the three.
                let mode = match (c.mode, c.choice) {
                    (CacheMode::Exponent, _) | (_, FrameChoice::Exp) => 1,
                    (CacheMode::FullValue, FrameChoice::Hybrid | FrameChoice::Delta) => 2,
                    (CacheMode::Delta, FrameChoice::Hybrid) => 2,
                    (CacheMode::Delta, FrameChoice::Delta) => 3,
                    (_, FrameChoice::Auto | FrameChoice::NoDelta) if fallback => {
                        panic!("{ctx}: cannot tell which delta an Auto slot replaced by a FILL")
                    }
                    (_, FrameChoice::NoDelta) | (CacheMode::FullValue, FrameChoice::Auto) => {
                        assert!(
                            actual[6] == 1 || actual[6] == 2,
                            "{ctx}: mode {}",
                            actual[6]
                        );
                        actual[6]
                    }
                    (CacheMode::Delta, FrameChoice::Auto) => {
                        assert!((1..=3).contains(&actual[6]), "{ctx}: mode {}", actual[6]);
                        actual[6]
                    }
                };
                let mut h = spec::Header { mode, ..h };
                // Each mask section's coding byte is read from the stored frame, the rest derived.
                // (Where the encoder sent a FILL instead, the delta is sized with the smallest
                // of the cheap codings.)
                let coded = |bits: &[bool], at: usize| -> Vec<u8> {
                    let coding = if fallback {
                        if bits.iter().all(|&b| !b) {
                            0
                        } else if spec::mask(bits, 2, None).len() <= spec::mask(bits, 1, None).len()
                        {
                            2
                        } else {
                            1
                        }
                    } else {
                        actual[at]
                    };
                    // Encoders of format version 3 write coding 4 where earlier ones wrote 3;
                    // coding 4 is refused in a version 1 or 2 frame.
                    match coding {
                        3 => assert!(format < 3, "{ctx}: coding 3 in a version {format} frame"),
                        4 => assert!(format >= 3, "{ctx}: coding 4 in a version {format} frame"),
                        _ => {}
                    }
                    let rans = coding == 3 || coding == 4;
                    let m = spec::mask(bits, coding, rans.then(|| &actual[at + 1..]));
                    if rans && !fallback {
                        // The stored block decodes by the document, too.
                        let block = &actual[at + 1..at + m.len()];
                        let nbytes = bits.len().div_ceil(8);
                        let back = if coding == 3 {
                            spec::rans_decode(block, nbytes)
                        } else {
                            spec::rans_seg_decode(block, nbytes)
                        };
                        assert_eq!(back, spec::mask_bytes(bits), "{ctx}: rANS by the document");
                    }
                    if !rans {
                        let best = *spec::cheap_sizes(bits).iter().min().unwrap();
                        assert_eq!(
                            m.len(),
                            best,
                            "{ctx}: the encoder picks the smallest cheap coding"
                        );
                    }
                    m
                };
                let (delta, new_ctx) = if mode == 1 {
                    let s0 = spec::pack_sm(c.dtype, &vals);
                    let s1 = coded(&exp_changed, spec::HEADER + s0.len());
                    let s2: Vec<u8> = (0..n)
                        .filter(|&i| exp_changed[i])
                        .map(|i| spec::exponent(c.dtype, vals[i]))
                        .collect();
                    (spec::frame(&h, [&s0, &s1, &s2, &[]]), None)
                } else if mode == 2 {
                    let changed: Vec<bool> = (0..n).map(|i| vals[i] != olds[i]).collect();
                    let idx: Vec<usize> = (0..n).filter(|&i| changed[i]).collect();
                    let s0 =
                        spec::pack_sm(c.dtype, &idx.iter().map(|&i| vals[i]).collect::<Vec<_>>());
                    let s1 = coded(&changed, spec::HEADER + s0.len());
                    let sub: Vec<bool> = idx.iter().map(|&i| exp_changed[i]).collect();
                    let s2 = coded(&sub, spec::HEADER + s0.len() + s1.len());
                    let s3: Vec<u8> = idx
                        .iter()
                        .filter(|&&i| exp_changed[i])
                        .map(|&i| spec::exponent(c.dtype, vals[i]))
                        .collect();
                    (spec::frame(&h, [&s0, &s1, &s2, &s3]), None)
                } else {
                    let (f, new_ctx) = derive_delta(&ctx, &h, &olds, &vals, ctxs, actual, fallback);
                    (f, Some(new_ctx))
                };
                // "An encoder never emits a frame longer than 64 + n x size bytes": a longer
                // delta goes as a raw FILL (which leaves context 0 behind, as Exp and Hybrid
                // frames do).
                if delta.len() > spec::HEADER + n * size {
                    h.mode = 0;
                    h.fill = true;
                    ctxs.fill(delta_spec::CONTEXT_NONE);
                    spec::frame(&h, [cur, &[], &[], &[]])
                } else {
                    match new_ctx {
                        Some(nc) => ctxs.copy_from_slice(&nc),
                        None => ctxs.fill(delta_spec::CONTEXT_NONE),
                    }
                    delta
                }
            };
            assert_eq!(
                hex(&f),
                hex(actual),
                "{ctx}: frame re-derived from docs/WIRE.md"
            );
            frames.push(f);
        }
        // Every chunk of an iteration FILLs or none does, so the slot is warm from here on.
        warm = c.dtype.is_compressible();
        version = version.wrapping_add(1);
        prev = input.clone();
        derived.push(frames);
    }
    derived
}

/// A Delta frame ("Delta") of a chunk whose old values are `olds`, new ones `vals` and
/// contexts `ctxs`: the frame and the contexts it leaves. The lanes, group and tables come
/// from the stored frame `actual` (checked against the encoder's rules the document states:
/// lanes = clamp(n / 512, 1, 32), group = 32768); where the encoder sent a FILL instead
/// (`fallback`), from those rules and the encoder's normalisation, which only size the frame.
fn derive_delta(
    what: &str,
    h: &spec::Header,
    olds: &[u32],
    vals: &[u32],
    ctxs: &[u8],
    actual: &[u8],
    fallback: bool,
) -> (Vec<u8>, Vec<u8>) {
    let n = vals.len();
    let w = (8 * spec::size(h.dtype)) as u32;
    let d: Vec<u32> = (0..n)
        .map(|i| delta_spec::ulp_move(olds[i], vals[i], w))
        .collect();
    let z: Vec<u32> = d.iter().map(|&d| delta_spec::zigzag(d, w)).collect();
    let lanes = (n / 512).clamp(1, 32);
    let mut model = if fallback {
        delta_spec::encoder_model(w, &z, ctxs, lanes, 32768)
    } else {
        let lens = frame_support::section_lens(actual);
        assert_eq!(
            lens[2..],
            [0, 0],
            "{what}: s2 and s3 of a Delta frame are empty"
        );
        let s1 = &actual[spec::HEADER + lens[0]..spec::HEADER + lens[0] + lens[1]];
        let m = delta_spec::parse_s1(s1, n, w).unwrap_or_else(|e| panic!("{what}: s1: {e}"));
        assert_eq!(
            (m.lanes, m.group),
            (lanes, 32768),
            "{what}: the encoder's lanes = clamp(n / 512, 1, 32) and group = 32768"
        );
        delta_spec::tables_describe(&m, w, &z, ctxs)
            .unwrap_or_else(|e| panic!("{what}: tables: {e}"));
        let mine = delta_spec::encoder_model(w, &z, ctxs, m.lanes, m.group);
        assert_eq!(mine.tables, m.tables, "{what}: the encoder's normalisation");
        // Decode the stored groups by the document's pseudocode, too.
        let s0 = &actual[spec::HEADER..spec::HEADER + lens[0]];
        let (back, _) = delta_spec::decode(s0, &m, w, olds, ctxs)
            .unwrap_or_else(|e| panic!("{what}: decoding by the document: {e}"));
        assert_eq!(back, vals, "{what}: decoded by the document");
        m
    };
    let (s0, lens) =
        delta_spec::encode_groups(&model, w, &z, ctxs).unwrap_or_else(|e| panic!("{what}: {e}"));
    model.lens = lens;
    let s1 = delta_spec::write_s1(&model);
    let f = spec::frame(h, [&s0, &s1, &[], &[]]);
    let new_ctx = d.iter().map(|&d| delta_spec::context(d, w)).collect();
    (f, new_ctx)
}

// ---- the hex files -------------------------------------------------------------------------------

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden")
}

fn blessing() -> bool {
    std::env::var_os("CIERA_BLESS").is_some_and(|v| v == "1")
}

fn hex(b: &[u8]) -> String {
    b.iter()
        .fold(String::with_capacity(2 * b.len()), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

/// Bytes of hex tokens separated by white space: `-` is nothing, `HEX*N` is HEX N times.
fn unhex(s: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for t in s.split_whitespace().filter(|t| *t != "-") {
        let (t, times) = match t.split_once('*') {
            Some((t, n)) => (t, n.parse::<usize>().expect("repeat count")),
            None => (t, 1),
        };
        assert!(t.len().is_multiple_of(2), "odd hex length");
        let b: Vec<u8> = (0..t.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&t[i..i + 2], 16).expect("hex digit"))
            .collect();
        for _ in 0..times {
            out.extend_from_slice(&b);
        }
    }
    out
}

/// Runs this long or longer (of a unit of at most `RUN_UNIT` bytes repeated) are written
/// `UNIT*COUNT`: the large cases' values repeat, and so would their FILL frames.
const RUN_MIN: usize = 2048;
const RUN_UNIT: usize = 512;

/// `b` as hex tokens: runs as `UNIT*COUNT`, the bytes between them in tokens of `width` bytes
/// (None: one token). Data without such runs gives what plain hex (in `width` pieces) does.
fn hex_tokens(b: &[u8], width: Option<usize>) -> Vec<String> {
    let mut tokens = Vec::new();
    let literal = |tokens: &mut Vec<String>, lit: &[u8]| {
        if !lit.is_empty() {
            tokens.extend(lit.chunks(width.unwrap_or(lit.len())).map(hex));
        }
    };
    let (mut i, mut lit) = (0, 0);
    while i < b.len() {
        // The smallest unit that repeats over at least RUN_MIN bytes from i.
        let run = (1..=RUN_UNIT.min((b.len() - i) / 2))
            .find(|&p| i + RUN_MIN <= b.len() && b[i..i + RUN_MIN - p] == b[i + p..i + RUN_MIN]);
        match run {
            Some(p) => {
                let same = b[i + p..]
                    .iter()
                    .zip(&b[i..])
                    .take_while(|(x, y)| x == y)
                    .count();
                let count = (p + same) / p;
                literal(&mut tokens, &b[lit..i]);
                tokens.push(format!("{}*{count}", hex(&b[i..i + p])));
                i += p * count;
                lit = i;
            }
            None => i += 1,
        }
    }
    literal(&mut tokens, &b[lit..]);
    tokens
}

/// One frame as annotated lines: the header split at its fields, then each section.
fn frame_lines(key: &str, f: &[u8]) -> String {
    let h = &f[..64];
    let fields = [
        &h[0..4],
        &h[4..5],
        &h[5..6],
        &h[6..7],
        &h[7..8],
        &h[8..16],
        &h[16..24],
        &h[24..32],
    ];
    let lens = [&h[32..36], &h[36..40], &h[40..44], &h[44..48]];
    let mut s = format!("{key} header   {}\n", fields.map(hex).join(" "));
    s += &format!("{key} sections {}\n", lens.map(hex).join(" "));
    s += &format!("{key} checks   {} {}\n", hex(&h[48..56]), hex(&h[56..64]));
    let mut pos = 64;
    for (i, l) in lens.iter().enumerate() {
        let l = u32::from_le_bytes((*l).try_into().unwrap()) as usize;
        let body = &f[pos..pos + l];
        pos += l;
        let text = if body.is_empty() {
            "-".to_string()
        } else {
            hex_tokens(body, Some(32)).join(" ")
        };
        s += &format!("{key} s{i}       {text}\n");
    }
    s
}

fn case_file(c: &Case, frames: &[Vec<(FrameInfo, Vec<u8>)>]) -> String {
    let mut s = String::new();
    for line in textwrap(c.about, 92) {
        s += &format!("# {line}\n");
    }
    s += &format!(
        "# dtype {} ({}), cache {:?}, frame choice {:?}, {} elements{}\n",
        c.dtype,
        c.dtype.code(),
        c.mode,
        c.choice,
        c.steps[0].0.len() / c.dtype.size(),
        c.chunk
            .map(|n| format!(", chunks of {n}"))
            .unwrap_or_default()
    );
    s +=
        "# Lines: `input STEP HEX` (the values, little-endian), then per frame `frame STEP.CHUNK\n";
    s += "# FIELD HEX`; a frame is the concatenation of its lines' hex (`-` = empty section).\n";
    let head = s;
    let mut s = String::new();
    for (step, ((input, restart), fs)) in c.steps.iter().zip(frames).enumerate() {
        s += "\n";
        if let Some(v) = restart {
            s += &format!(
                "# both sides start over before step {step}: cold slots at version {v:#x}\n"
            );
        }
        s += &format!("input {step} {}\n", hex_tokens(input, None).join(" "));
        for (ci, (info, f)) in fs.iter().enumerate() {
            s += &format!(
                "# {} frame{}, slot version {}, {} bytes\n",
                info.mode.name(),
                if info.fill { " (FILL)" } else { "" },
                info.version,
                f.len()
            );
            if f[6] == 3 {
                s += &delta_note(info, f);
            }
            s += &frame_lines(&format!("frame {step}.{ci}"), f);
        }
    }
    let runs = s.lines().any(|l| !l.starts_with('#') && l.contains('*'));
    let note = if runs {
        "# A token `HEX*N` stands for HEX repeated N times.\n"
    } else {
        ""
    };
    head + note + &s
}

/// A comment line that reads a Delta frame's s1: lanes, group, the tables, group lengths.
fn delta_note(info: &FrameInfo, f: &[u8]) -> String {
    let l = frame_support::section_lens(f);
    let w = bits_of(info.dtype).0;
    let s1 = &f[64 + l[0]..64 + l[0] + l[1]];
    let Ok(m) = delta_spec::parse_s1(s1, info.count, w) else {
        return "# (s1 does not parse)\n".into();
    };
    let tables: Vec<String> = m
        .tables
        .iter()
        .enumerate()
        .filter_map(|(c, t)| {
            t.as_ref()
                .map(|t| format!("{:+}:{}", c as i32 - 8, t.len()))
        })
        .collect();
    format!(
        "# s1: {} lane(s), groups of {}; tables (context:m) {}; group lengths {:?}\n",
        m.lanes,
        m.group,
        tables.join(" "),
        m.lens
    )
}

fn textwrap(s: &str, width: usize) -> Vec<String> {
    let mut lines = vec![String::new()];
    for w in s.split_whitespace() {
        let cur = lines.last_mut().unwrap();
        if !cur.is_empty() && cur.len() + 1 + w.len() > width {
            lines.push(w.to_string());
        } else {
            if !cur.is_empty() {
                cur.push(' ');
            }
            cur.push_str(w);
        }
    }
    lines
}

/// (inputs, frames[step][chunk]) from a case file.
fn parse_case_file(text: &str) -> (Vec<Vec<u8>>, Vec<Vec<Vec<u8>>>) {
    let mut inputs = Vec::new();
    let mut frames: Vec<Vec<Vec<u8>>> = Vec::new();
    for line in text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let mut t = line.splitn(3, ' ');
        let (kind, key, rest) = (t.next().unwrap(), t.next().unwrap(), t.next().unwrap_or(""));
        match kind {
            "input" => {
                assert_eq!(
                    key.parse::<usize>().unwrap(),
                    inputs.len(),
                    "inputs in order"
                );
                inputs.push(unhex(rest));
            }
            "frame" => {
                let (step, chunk) = key.split_once('.').expect("STEP.CHUNK");
                let (step, chunk): (usize, usize) = (step.parse().unwrap(), chunk.parse().unwrap());
                let body = rest.split_once(' ').map_or("", |(_, b)| b);
                if frames.len() <= step {
                    frames.resize(step + 1, Vec::new());
                }
                if frames[step].len() <= chunk {
                    frames[step].resize(chunk + 1, Vec::new());
                }
                frames[step][chunk].extend(unhex(body));
            }
            other => panic!("unknown line kind {other:?}"),
        }
    }
    (inputs, frames)
}

/// The stored vector `name`, or (blessing) `fresh()`, written there.
fn read_or_bless(name: &str, fresh: impl FnOnce() -> String) -> String {
    let path = golden_dir().join(name);
    if blessing() {
        let fresh = fresh();
        std::fs::create_dir_all(golden_dir()).unwrap();
        std::fs::write(&path, &fresh).unwrap();
        eprintln!("blessed {}", path.display());
        return fresh;
    }
    std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run with CIERA_BLESS=1 to create the golden vectors)",
            path.display()
        )
    })
}

// ---- the tests -----------------------------------------------------------------------------------

/// (a), (b) and (c) for one case; returns the stored frames.
fn check_case(c: &Case) -> Vec<Vec<Vec<u8>>> {
    let encoded = encode_case(c);
    let text = read_or_bless(&format!("{}.hex", c.name), || case_file(c, &encoded));
    let (inputs, stored) = parse_case_file(&text);
    // The file's inputs are the case's inputs.
    assert_eq!(inputs.len(), c.steps.len(), "{}", c.name);
    for (a, (b, _)) in inputs.iter().zip(&c.steps) {
        assert_eq!(hex(a), hex(b), "{}: stored input", c.name);
    }
    // (a) encoder == stored bytes.
    assert_eq!(stored.len(), encoded.len(), "{}", c.name);
    for (step, (s, e)) in stored.iter().zip(&encoded).enumerate() {
        assert_eq!(s.len(), e.len(), "{} step {step}: frame count", c.name);
        for (ci, (sf, (_, ef))) in s.iter().zip(e).enumerate() {
            assert_eq!(
                hex(ef),
                hex(sf),
                "{} step {step} chunk {ci}: encoder output differs from the golden frame",
                c.name
            );
        }
    }
    // (b) stored bytes decode to the inputs.
    let outs = decode_case(c, &stored);
    for (step, (o, (i, _))) in outs.iter().zip(&c.steps).enumerate() {
        assert_eq!(
            hex(o),
            hex(i),
            "{} step {step}: decoded golden frame",
            c.name
        );
    }
    // (c) the document re-derives the stored bytes.
    derive_case(c, &stored, spec::FORMAT);
    stored
}

#[test]
fn frames_match_golden_vectors() {
    for c in cases() {
        check_case(&c);
    }
}

/// What the Delta cases must show: every frame kind they promise is there.
#[test]
fn delta_cases_cover_what_they_say() {
    let modes = |name: &str| -> Vec<Vec<(u8, bool)>> {
        let c = cases().into_iter().find(|c| c.name == name).unwrap();
        encode_case(&c)
            .iter()
            .map(|s| s.iter().map(|(_, f)| (f[6], f[7] & 1 == 1)).collect())
            .collect()
    };
    let fill = (0u8, true);
    let delta = (3u8, false);
    assert_eq!(
        modes("bf16_delta_fill_fallback_10"),
        vec![vec![fill], vec![fill], vec![fill]]
    );
    assert_eq!(
        modes("bf16_delta_chunked_700"),
        vec![vec![fill; 3], vec![delta; 3], vec![delta; 3]]
    );
    for name in [
        "bf16_delta_1537",
        "f32_delta_1025",
        "f16_delta_1537",
        "f32_delta_12",
        "bf16_delta_300",
    ] {
        assert_eq!(
            modes(name),
            vec![vec![(0, true)], vec![(3, false)], vec![(3, false)]],
            "{name}"
        );
    }
    assert_eq!(
        modes("bf16_delta_auto_chunked_1200"),
        vec![
            vec![(0, true), (0, true)],
            vec![(3, false), (3, false)],
            vec![(3, false), (1, false)],
            vec![(3, false), (3, false)],
        ]
    );
    // The second Delta frame of each uses contexts other than 0 (its tables cover more than
    // context 0), and the fp32 case has moves needing more than 15 extra bits.
    for c in cases().iter().filter(|c| {
        c.name.ends_with("_1537")
            || c.name.ends_with("_1025")
            || c.name.ends_with("_1200")
            || c.name == "bf16_delta_300"
    }) {
        let e = encode_case(c);
        let f = &e[2][0].1;
        let l = frame_support::section_lens(f);
        let w = bits_of(c.dtype).0;
        let n = c.chunk.unwrap_or(c.steps[0].0.len() / c.dtype.size());
        let m = delta_spec::parse_s1(&f[64 + l[0]..64 + l[0] + l[1]], n, w).unwrap();
        let with_tables = m.tables.iter().filter(|t| t.is_some()).count();
        assert!(
            with_tables >= 10,
            "{}: {with_tables} contexts with tables",
            c.name
        );
        if c.dtype == DType::F32 {
            let longest = m.tables.iter().flatten().map(|t| t.len()).max().unwrap();
            // Token 32 + 2 (b - 5) with b >= 17: e = b - 1 > 15 extra bits.
            assert!(
                longest > 32 + 2 * (17 - 5),
                "{}: longest table {longest}",
                c.name
            );
        }
    }
}

/// Delta frames too big to store, from the encoder, re-derived from the document: several
/// groups of 32768 (32 lanes each, the last group short), every type, chunked, Auto; and
/// chunks the encoder samples (at least 32 tiles of 4096: tables from every eighth tile, and at
/// least 1 for every pair of the other tiles' box), which must still code every element.
#[test]
fn delta_frames_match_the_document_at_scale() {
    let mut rng = frame_support::Rng(0xDE17A);
    for (dtype, n, chunk, choice) in [
        (DType::BF16, 70_001, None, FrameChoice::Delta),
        (DType::BF16, 200_003, None, FrameChoice::Delta),
        (DType::F32, 32 * 4096, None, FrameChoice::Delta),
        (DType::F16, 40_000, Some(33_000), FrameChoice::Delta),
        (DType::F32, 65_536 + 4096, None, FrameChoice::Auto),
        (DType::BF16, 20_000, Some(5_000), FrameChoice::Auto),
    ] {
        let (w, mant) = bits_of(dtype);
        let mut v: Vec<u32> = (0..n).map(|i| weight(dtype, i)).collect();
        let mut steps = vec![to_bytes(dtype, &v)];
        for s in 0..3 {
            v = v
                .iter()
                .map(|&u| {
                    let r = rng.next();
                    let m = match r % 100 {
                        0..=49 => 0,
                        50..=89 => (r >> 8) as i64 % 5 - 2,
                        90..=97 => (r >> 8) as i64 % 300 - 150,
                        _ => ((r >> 8) % (1 << (w - 2))) as i64 - (1 << (w - 3)),
                    };
                    if s == 1 && r % 1000 == 999 {
                        u ^ (1 << (w - 1)) // a sign flip
                    } else if s == 2 && r.is_multiple_of(997) {
                        (((1u32 << (w - 1 - mant)) - 1) << mant)
                            | (r >> 40) as u32 & ((1 << mant) - 1)
                    } else {
                        moved(dtype, u, m)
                    }
                })
                .collect();
            steps.push(to_bytes(dtype, &v));
        }
        let c = Case {
            name: "generated",
            about: "",
            dtype,
            mode: CacheMode::Delta,
            choice,
            chunk,
            steps: plain(steps),
        };
        let encoded = encode_case(&c);
        let frames: Vec<Vec<Vec<u8>>> = encoded
            .iter()
            .map(|s| s.iter().map(|(_, f)| f.clone()).collect())
            .collect();
        let deltas = frames.iter().flatten().filter(|f| f[6] == 3).count();
        assert!(deltas >= 3, "{dtype} n {n}: {deltas} Delta frames");
        let outs = decode_case(&c, &frames);
        for (o, (i, _)) in outs.iter().zip(&c.steps) {
            assert!(o == i, "{dtype} n {n}: decoded");
        }
        derive_case(&c, &frames, spec::FORMAT);
    }
}

/// The stored vector `{name}{suffix}.hex` of a case, and the case.
fn stored_vector(name: &str, suffix: &str) -> (Case, Vec<Vec<Vec<u8>>>) {
    let c = cases().into_iter().find(|c| c.name == name).unwrap();
    let path = golden_dir().join(format!("{name}{suffix}.hex"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let (inputs, stored) = parse_case_file(&text);
    assert_eq!(inputs.len(), c.steps.len(), "{name}{suffix}");
    for (a, (b, _)) in inputs.iter().zip(&c.steps) {
        assert_eq!(hex(a), hex(b), "{name}{suffix}: stored input");
    }
    (c, stored)
}

/// The sections of a frame.
fn sections(f: &[u8]) -> [&[u8]; 4] {
    let l = frame_support::section_lens(f);
    let mut at = spec::HEADER;
    std::array::from_fn(|i| {
        at += l[i];
        &f[at - l[i]..at]
    })
}

/// (section index, bits) of the coded masks of a frame ("Modes and sections": s1 of an Exp
/// frame; s1 and s2 of a Hybrid frame, s2 of as many bits as s1 has set).
fn masks_of(f: &[u8]) -> Vec<(usize, usize)> {
    let n = u64::from_le_bytes(f[8..16].try_into().unwrap()) as usize;
    match f[6] {
        1 => vec![(1, n)],
        2 => {
            let mut w = Vec::new();
            let k = bitmask::decode(sections(f)[1], n, &mut w).unwrap();
            vec![(1, n), (2, k)]
        }
        _ => vec![],
    }
}

/// The mask codings of a frame (their coding bytes, in section order).
fn mask_codings(f: &[u8]) -> Vec<u8> {
    let s = sections(f);
    masks_of(f).iter().map(|&(i, _)| s[i][0]).collect()
}

/// `f` (of type `d`) rebuilt by the document at format version `format`, each mask section
/// `i` replaced by `recode(i, the mask's bytes, the section)`.
fn rebuild(
    d: DType,
    f: &[u8],
    format: u8,
    recode: impl Fn(usize, &[u8], &[u8]) -> Vec<u8>,
) -> Vec<u8> {
    let u64_at = |at: usize| u64::from_le_bytes(f[at..at + 8].try_into().unwrap());
    let h = spec::Header {
        format,
        dtype: d,
        mode: f[6],
        fill: f[7] & 1 == 1,
        count: u64_at(8),
        offset: u64_at(16),
        version: u64_at(24),
    };
    let mut s: [Vec<u8>; 4] = sections(f).map(<[u8]>::to_vec);
    for (i, m) in masks_of(f) {
        let mut w = Vec::new();
        bitmask::decode(&s[i], m, &mut w).unwrap();
        let bytes: Vec<u8> = w
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .take(m.div_ceil(8))
            .collect();
        s[i] = recode(i, &bytes, &s[i]);
    }
    spec::frame(&h, [&s[0], &s[1], &s[2], &s[3]])
}

/// The version 3 frame of a version 1 or 2 frame: "version 3 added mask coding 4 (segmented
/// rANS), which encoders write instead of coding 3": each coding 3 mask is coded 4 with the
/// same table (both are of all the mask's bytes); the rest is the same.
fn as_version_3(d: DType, f: &[u8]) -> Vec<u8> {
    rebuild(d, f, 3, |_, bytes, sec| {
        if sec[0] != 3 {
            return sec.to_vec();
        }
        assert_eq!(
            spec::rans_decode(&sec[1..], bytes.len()),
            bytes,
            "rANS by the document"
        );
        let (freq, table_len) = spec::rans_table(&sec[1..]);
        let mut out = vec![4];
        out.extend_from_slice(&sec[1..1 + table_len]);
        out.extend(spec::rans_seg_encode(bytes, &freq));
        out
    })
}

/// Every frame of `frames` with byte 4 set to `format`, resealed.
fn relabelled(frames: &[Vec<Vec<u8>>], format: u8) -> Vec<Vec<Vec<u8>>> {
    frames
        .iter()
        .map(|s| {
            s.iter()
                .map(|f| {
                    let mut g = f.clone();
                    g[4] = format;
                    frame_support::reseal(&mut g);
                    g
                })
                .collect()
        })
        .collect()
}

/// Kept vectors (never re-blessed) of format version 1 (stored before version 2) and 2
/// (stored before version 3) still decode; they are frames of their version as the document
/// describes them (coding 3 masks, never coding 4), and the version 3 frames of the same
/// inputs but for the version byte, the checksums and each coding 3 mask coded 4 instead with
/// the same table. Relabelled version 3, with their coding 3 masks, they decode the same.
#[test]
fn older_version_frames_still_decode() {
    let mut rans3 = 0;
    for (name, format) in [
        ("bf16_exp_8", 1u8),
        ("bf16_hybrid_rans_512", 1),
        ("bf16_hybrid_rans_512", 2),
        ("bf16_delta_1537", 2),
    ] {
        let (c, stored) = stored_vector(name, &format!("_v{format}"));
        for f in stored.iter().flatten() {
            assert_eq!(f[4], format, "{name}_v{format}: a version {format} frame");
            rans3 += mask_codings(f).iter().filter(|&&m| m == 3).count();
        }
        let outs = decode_case(&c, &stored);
        for (step, (o, (i, _))) in outs.iter().zip(&c.steps).enumerate() {
            assert_eq!(hex(o), hex(i), "{name}_v{format} step {step}: decoded");
        }
        derive_case(&c, &stored, format);
        let now = encode_case(&c);
        for (s, e) in stored.iter().zip(&now) {
            for (old, (_, new)) in s.iter().zip(e) {
                assert_eq!(
                    hex(&as_version_3(c.dtype, old)),
                    hex(new),
                    "{name}_v{format}: the version 3 frame differs in more than the document says"
                );
            }
        }
        assert_eq!(
            decode_case(&c, &relabelled(&stored, 3)),
            outs,
            "{name}_v{format}: coding 3 masks in version 3 frames"
        );
    }
    assert!(rans3 >= 2, "the kept vectors have coding 3 masks");
}

/// A receiver of case `c` (whole-slot frames) that has decoded `frames`.
fn receiver_after(c: &Case, frames: &[&[u8]]) -> (CacheSlot, Vec<u8>) {
    let len = c.steps[0].0.len() / c.dtype.size();
    let mut rx = CacheSlot::new(c.dtype, c.mode, len);
    let mut out = vec![0u8; len * c.dtype.size()];
    for f in frames {
        rx.decode(f, &mut out).unwrap();
    }
    (rx, out)
}

/// Every stored vector relabelled format version 2 (and, without mode 3, version 1): byte 4
/// changed, the header checksum resealed. Without a coding 4 mask it decodes to the same values
/// and is what the document derives at that version; a frame with a coding 4 mask is refused
/// ("a coding 4 mask in a frame that says version 1 or 2 is refused") with what = "mask", a
/// Hybrid frame whose s2 alone is coding 4 too (s1 recoded flat), which version 3 takes.
#[test]
fn version_2_frames_decode_without_coding_4() {
    let (mut derived, mut refused) = (0, 0);
    for c in cases() {
        let (_, stored) = stored_vector(c.name, "");
        let has_seg = stored
            .iter()
            .flatten()
            .any(|f| mask_codings(f).contains(&4));
        let has_delta = stored.iter().flatten().any(|f| f[6] == 3);
        for format in [2u8, 1] {
            if format == 1 && has_delta {
                continue;
            }
            let old = relabelled(&stored, format);
            if !has_seg {
                let outs = decode_case(&c, &old);
                for (step, (o, (i, _))) in outs.iter().zip(&c.steps).enumerate() {
                    assert_eq!(hex(o), hex(i), "{} v{format} step {step}", c.name);
                }
                derive_case(&c, &old, format);
                derived += 1;
                continue;
            }
            assert!(c.chunk.is_none(), "{}: whole-slot frames", c.name);
            let new: Vec<&[u8]> = stored.iter().map(|s| &s[0][..]).collect();
            for (step, f) in new.iter().enumerate() {
                let codings = mask_codings(f);
                if !codings.contains(&4) {
                    continue;
                }
                let refuse = |g: &[u8], what: &str| {
                    let (mut rx, mut out) = receiver_after(&c, &new[..step]);
                    let r = rx.decode(g, &mut out);
                    assert!(
                        matches!(r, Err(CodecError::CorruptFrame { what: "mask", .. })),
                        "{} step {step} as version {format}{what}: {r:?}",
                        c.name
                    );
                    assert!(!rx.is_warm(), "a refused frame poisons the slot");
                };
                refuse(&old[step][0], "");
                refused += 1;
                if codings == [4, 4] {
                    let flat_s1 = |v: u8| {
                        rebuild(c.dtype, f, v, |i, bytes, sec| {
                            if i == 1 {
                                [&[1u8][..], bytes].concat()
                            } else {
                                sec.to_vec()
                            }
                        })
                    };
                    refuse(&flat_s1(format), " (s1 flat, s2 coding 4)");
                    refused += 1;
                    let (mut rx, mut out) = receiver_after(&c, &new[..step]);
                    rx.decode(&flat_s1(3), &mut out).unwrap();
                    assert_eq!(out, c.steps[step].0, "{}: s1 flat at version 3", c.name);
                }
            }
        }
    }
    assert!(derived >= 20, "{derived} vectors derived as version 2 or 1");
    assert!(refused >= 10, "{refused} frames refused");
}

/// The cases with segmented rANS masks have what they say: (coding of s1, its segments) and
/// (coding of s2, its segments) of their delta frame.
#[test]
fn rans_seg_cases_cover_what_they_say() {
    for (name, want) in [
        ("bf16_hybrid_rans_512", vec![(4, 1), (0, 0)]),
        ("bf16_exp_rans_2048", vec![(4, 1)]),
        ("f16_hybrid_rans_40000", vec![(4, 2), (4, 1)]),
        ("bf16_hybrid_rans_270000", vec![(4, 9), (4, 4)]),
    ] {
        let (_, stored) = stored_vector(name, "");
        let f = &stored[1][0];
        let s = sections(f);
        let got: Vec<(u8, usize)> = masks_of(f)
            .iter()
            .map(|&(i, m)| {
                let segs = if s[i][0] == 4 {
                    m.div_ceil(8).div_ceil(spec::SEGMENT)
                } else {
                    0
                };
                (s[i][0], segs)
            })
            .collect();
        assert_eq!(got, want, "{name}");
    }
}

/// "A decoder refuses versions it does not know, with an error naming both"; "a mode 3 frame
/// that says version 1 is refused"; a version 1 frame of modes 0-2 decodes.
#[test]
fn format_versions_are_checked() {
    let c = cases()
        .into_iter()
        .find(|c| c.name == "bf16_delta_1537")
        .unwrap();
    let e = encode_case(&c);
    let (fill, delta) = (&e[0][0].1, &e[1][0].1);
    assert_eq!((fill[4], delta[4], delta[6]), (3, 3, 3));
    let rx_at = |frames: &[&Vec<u8>]| {
        let f: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
        receiver_after(&c, &f)
    };
    for v in [0u8, 4, 5, 0x80, 0xff] {
        for f in [fill, delta] {
            let mut g = f.clone();
            g[4] = v;
            frame_support::reseal(&mut g);
            let (mut rx, mut out) = rx_at(&[fill]);
            match rx.decode(&g, &mut out) {
                Err(CodecError::CorruptFrame {
                    what: "format version",
                    detail,
                }) => {
                    assert!(
                        detail.contains(&format!("version {v}")) && detail.contains('3'),
                        "the error names the frame's version and the known ones: {detail}"
                    );
                }
                other => panic!("version {v}: {other:?}"),
            }
        }
    }
    // Mode 3 with version 1: refused, however it is sealed.
    let mut g = delta.clone();
    g[4] = 1;
    frame_support::reseal(&mut g);
    let (mut rx, mut out) = rx_at(&[fill]);
    let r = rx.decode(&g, &mut out);
    assert!(
        matches!(r, Err(CodecError::CorruptFrame { what: "mode", .. })),
        "{r:?}"
    );
    assert!(!rx.is_warm(), "a refused frame poisons the slot");
    // The same frame at version 3 is taken, and at version 2; a version 1 FILL (mode 0) too.
    let (_, out) = rx_at(&[fill, delta]);
    assert_eq!(out, c.steps[1].0);
    let mut g = delta.clone();
    g[4] = 2;
    frame_support::reseal(&mut g);
    let (_, out) = rx_at(&[fill, &g]);
    assert_eq!(out, c.steps[1].0);
    let mut g = fill.clone();
    g[4] = 1;
    frame_support::reseal(&mut g);
    let (_, out) = rx_at(&[&g]);
    assert_eq!(out, c.steps[0].0);
}

/// Spot checks of header fields against the document's table, written out by hand, so a
/// reader can see the layout without running anything.
#[test]
fn header_layout_by_hand() {
    let c = &cases()[0]; // bf16_exp_8
    let e = encode_case(c);
    let f = &e[1][0].1;
    assert_eq!(&f[0..4], b"CIRF");
    assert_eq!(f[4], 3, "format version");
    assert_eq!(f[5], 9, "bf16 is ncclBfloat16 = 9");
    assert_eq!(f[6], 1, "exp mode");
    assert_eq!(f[7], 0, "no flags");
    assert_eq!(u64::from_le_bytes(f[8..16].try_into().unwrap()), 8, "count");
    assert_eq!(
        u64::from_le_bytes(f[16..24].try_into().unwrap()),
        0,
        "offset"
    );
    assert_eq!(
        u64::from_le_bytes(f[24..32].try_into().unwrap()),
        1,
        "version: the second iteration"
    );
    // s0: 8 sm bytes; s1: flat mask (coding 1, one byte 0b0000_0001); s2: one new cached
    // field, the high byte of 2.0 (0x4000), where 1.0 (0x3F80) had 0x3F.
    assert_eq!(
        &f[32..48],
        &[8, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    );
    // sm of 2.0, -2.5, 0.5, 3.5, 0, -0, 1.75, 100: the low byte of each value.
    assert_eq!(
        &f[64..72],
        &[0x00, 0x20, 0x00, 0x60, 0x00, 0x00, 0xE0, 0xC8]
    );
    assert_eq!(&f[72..75], &[1, 0x01, 0x40]);
    assert_eq!(f.len(), 75);
    let fill = &e[0][0].1;
    assert_eq!((fill[6], fill[7]), (0, 1), "raw FILL");
    assert_eq!(&fill[64..], &c.steps[0].0[..]);
}

#[test]
fn sh64_matches_golden_vectors() {
    let inputs: Vec<Vec<u8>> = vec![
        vec![],
        b"a".to_vec(),
        b"abc".to_vec(),
        vec![0],
        (0..31u8).collect(),
        (0..32u8).collect(),
        (0..33u8).collect(),
        (0..64u8).collect(),
        (0..100u8).map(|i| i.wrapping_mul(151)).collect(),
        vec![0xff; 257],
    ];
    let mut fresh = String::from(
        "# SH64 (docs/WIRE.md) of byte strings: `sh64 HEX-INPUT = HEX-U64` (`-` = empty input)\n",
    );
    for d in &inputs {
        let input = if d.is_empty() {
            "-".to_string()
        } else {
            hex(d)
        };
        fresh += &format!("sh64 {input} = {:016x}\n", checksum::sh64(d));
    }
    let text = read_or_bless("sh64.hex", || fresh);
    let mut seen = 0;
    for line in text.lines().filter(|l| l.starts_with("sh64 ")) {
        let (data, want) = line["sh64 ".len()..].split_once(" = ").unwrap();
        let data = unhex(data);
        let want = u64::from_str_radix(want.trim(), 16).unwrap();
        assert_eq!(checksum::sh64(&data), want, "sh64 of {}", hex(&data));
        assert_eq!(
            checksum::sh64_plain(&data),
            want,
            "sh64_plain of {}",
            hex(&data)
        );
        assert_eq!(
            spec::sh64(&data),
            want,
            "the document's SH64 of {}",
            hex(&data)
        );
        assert_eq!(data, inputs[seen]);
        seen += 1;
    }
    assert_eq!(seen, inputs.len());
}

/// Standalone coded masks in each coding (the building block of s1 and s2).
#[test]
fn masks_match_golden_vectors() {
    fn bits_of(m: usize, set: impl Fn(usize) -> bool) -> Vec<bool> {
        (0..m).map(set).collect()
    }
    fn sparse(i: usize) -> bool {
        let x = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (x ^ x >> 29).wrapping_mul(0xBF58_476D_1CE4_E5B9) >> 57 < 15
    }
    let masks: Vec<(&str, usize, Vec<bool>, MaskCoding)> = vec![
        ("zero", 0, vec![], MaskCoding::Zero),
        ("zero", 100, bits_of(100, |_| false), MaskCoding::Zero),
        (
            "flat",
            10,
            bits_of(10, |i| [1, 5, 8].contains(&i)),
            MaskCoding::Flat,
        ),
        ("flat", 3, bits_of(3, |i| i == 1), MaskCoding::Flat),
        (
            "hier",
            200,
            bits_of(200, |i| [5, 6, 150].contains(&i)),
            MaskCoding::Hier,
        ),
        (
            "hier",
            600,
            bits_of(600, |i| i % 97 == 3 || i == 599),
            MaskCoding::Hier,
        ),
        (
            "rans",
            512,
            bits_of(512, |i| {
                (if (i / 8) % 8 == 7 { 0xf0u8 } else { 0x0f }) >> (i % 8) & 1 == 1
            }),
            MaskCoding::Rans,
        ),
        (
            "rans",
            77,
            bits_of(77, |i| (i * 7) % 5 < 2),
            MaskCoding::Rans,
        ),
        ("rans", 9, bits_of(9, |i| i % 2 == 0), MaskCoding::Rans),
        (
            "rans",
            2048,
            bits_of(2048, |i| (i * i + 3 * i) % 11 < 3),
            MaskCoding::Rans,
        ),
        (
            "ransseg",
            512,
            bits_of(512, |i| {
                (if (i / 8) % 8 == 7 { 0xf0u8 } else { 0x0f }) >> (i % 8) & 1 == 1
            }),
            MaskCoding::RansSeg,
        ),
        (
            "ransseg",
            77,
            bits_of(77, |i| (i * 7) % 5 < 2),
            MaskCoding::RansSeg,
        ),
        (
            "ransseg",
            9,
            bits_of(9, |i| i % 2 == 0),
            MaskCoding::RansSeg,
        ),
        // One symbol (frequency 4096).
        (
            "ransseg",
            1000,
            bits_of(1000, |_| true),
            MaskCoding::RansSeg,
        ),
        // Bits set with probability 15/128: many byte values (a table with the presence
        // bitmap); one whole segment, then a second of one byte, then of 904.
        (
            "ransseg",
            32768,
            bits_of(32768, sparse),
            MaskCoding::RansSeg,
        ),
        (
            "ransseg",
            32769,
            bits_of(32769, sparse),
            MaskCoding::RansSeg,
        ),
        (
            "ransseg",
            40000,
            bits_of(40000, sparse),
            MaskCoding::RansSeg,
        ),
    ];
    let words = |bits: &[bool]| -> Vec<u64> {
        let mut w = vec![0u64; bits.len().div_ceil(64)];
        for (i, &b) in bits.iter().enumerate() {
            w[i / 64] |= (b as u64) << (i % 64);
        }
        w
    };
    let mut fresh = String::from(
        "# Coded masks (docs/WIRE.md, \"Coded masks\"): `mask CODING M MASK-BYTES = CODED` (`-` = empty)\n",
    );
    for (name, m, bits, coding) in &masks {
        let mut out = Vec::new();
        bitmask::encode(&words(bits), *m, *coding, &mut out);
        let b = spec::mask_bytes(bits);
        fresh += &format!(
            "mask {name} {m} {} = {}\n",
            if b.is_empty() { "-".into() } else { hex(&b) },
            hex(&out)
        );
    }
    let text = read_or_bless("masks.hex", || fresh);
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("mask ")).collect();
    assert_eq!(lines.len(), masks.len());
    for (line, (name, m, bits, coding)) in lines.iter().zip(&masks) {
        let (lhs, coded) = line.split_once(" = ").unwrap();
        let coded = unhex(coded);
        let f: Vec<&str> = lhs.split_whitespace().collect();
        assert_eq!((f[1], f[2].parse::<usize>().unwrap()), (*name, *m));
        assert_eq!(unhex(f[3]), spec::mask_bytes(bits), "{line}");
        // The codec encodes exactly this, and decodes it back.
        let mut out = Vec::new();
        bitmask::encode(&words(bits), *m, *coding, &mut out);
        assert_eq!(hex(&out), hex(&coded), "{line}");
        let mut back = Vec::new();
        let ones = bitmask::decode(&coded, *m, &mut back).unwrap();
        assert_eq!(back, words(bits), "{line}");
        assert_eq!(ones, bits.iter().filter(|&&b| b).count());
        // The document derives it.
        assert_eq!(coded[0], *coding as u8);
        assert_eq!(
            hex(&spec::mask(bits, coded[0], Some(&coded[1..]))),
            hex(&coded),
            "{line}: re-derived"
        );
        if *coding == MaskCoding::Rans {
            assert_eq!(
                spec::rans_decode(&coded[1..], m.div_ceil(8)),
                spec::mask_bytes(bits),
                "{line}: rANS by the document"
            );
        }
        if *coding == MaskCoding::RansSeg {
            assert_eq!(
                spec::rans_seg_decode(&coded[1..], m.div_ceil(8)),
                spec::mask_bytes(bits),
                "{line}: segmented rANS by the document"
            );
        }
    }
}
