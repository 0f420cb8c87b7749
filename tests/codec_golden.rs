//! Golden vectors of the wire format (docs/WIRE.md), stored as annotated hex in
//! tests/data/golden/. For every case:
//! (a) the encoder, fed the case's inputs, produces exactly the stored frames;
//! (b) a receiver decodes the stored frames back to exactly the inputs;
//! (c) the frames are re-derived here, independently of the codec, from the document alone
//!     (header fields, section layouts, sign+mantissa packing, mask codings, rANS, SH64; only
//!     XXH3 comes from a library), and must match byte for byte. This makes WIRE.md a spec: a
//!     change to the format must change the document, the vectors and this file together.
//!
//! `CIERA_BLESS=1 cargo test --test codec_golden` rewrites the vectors from the encoder; (b)
//! and (c) still run, so a blessed vector that contradicts the document fails anyway.

use std::fmt::Write as _;
use std::path::PathBuf;

use ciera::codec::bitmask::{self, MaskCoding};
use ciera::codec::{checksum, frame, CacheMode, CacheSlot, FrameChoice, FrameInfo};
use ciera::DType;

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

    /// A coded mask in `coding` ("Coded masks"). For Rans, the frequency table is the one of
    /// `rans_like` (a stored block: the encoder's choice of frequencies is not part of the
    /// format); the coded stream is re-derived from it.
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
            3 => {
                let (freq, table_len) = rans_table(rans_like.expect("rans needs a table"));
                out.extend_from_slice(&rans_like.unwrap()[..table_len]);
                out.extend(rans_encode(&b, &freq));
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

    /// States and renormalisation bytes coding `data` with `freq`: the inverse of the decoding
    /// rule in "rANS block" (two states, symbol i on state i % 2, both starting at 2^23).
    pub fn rans_encode(data: &[u8], freq: &[u32; 256]) -> Vec<u8> {
        let c = cum(freq);
        let mut x = [L; 2];
        let mut rev = Vec::new();
        for (i, &s) in data.iter().enumerate().rev() {
            let f = freq[s as usize];
            let st = &mut x[i % 2];
            // Push bytes until the decoder's step will land back in [2^23, 2^31).
            while *st >= ((L >> 12) << 8) * f {
                rev.push(*st as u8);
                *st >>= 8;
            }
            *st = (*st / f) * 4096 + *st % f + c[s as usize];
        }
        let mut out = Vec::new();
        out.extend_from_slice(&x[0].to_le_bytes());
        out.extend_from_slice(&x[1].to_le_bytes());
        out.extend(rev.iter().rev());
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

    pub struct Header {
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
        f.push(1);
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

/// Re-derive every frame of a case from the document. `stored` supplies only what the format
/// leaves to the encoder: the mode a full-value `Auto` slot picks, the coding of each mask (and
/// a rANS block's frequency table).
fn derive_case(c: &Case, stored: &[Vec<Vec<u8>>]) -> Vec<Vec<Vec<u8>>> {
    let size = c.dtype.size();
    let n_all = c.steps[0].0.len() / size;
    let chunk = c.chunk.unwrap_or(n_all.max(1));
    let mut warm = false;
    let mut version = 0u64;
    let mut prev: Vec<u8> = Vec::new();
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
                dtype: c.dtype,
                mode: 0,
                fill: false,
                count: n as u64,
                offset: off as u64,
                version,
            };
            let f = if !c.dtype.is_compressible() {
                spec::frame(&h, [cur, &[], &[], &[]])
            } else if !warm {
                h.fill = true;
                spec::frame(&h, [cur, &[], &[], &[]])
            } else {
                let old = &prev[off * size..(off + n) * size];
                let vals: Vec<u32> = (0..n).map(|i| spec::value(c.dtype, cur, i)).collect();
                let olds: Vec<u32> = (0..n).map(|i| spec::value(c.dtype, old, i)).collect();
                let exp_changed: Vec<bool> = (0..n)
                    .map(|i| spec::exponent(c.dtype, vals[i]) != spec::exponent(c.dtype, olds[i]))
                    .collect();
                let fallback = actual[6] == 0;
                let mode = match (c.mode, c.choice) {
                    (CacheMode::Exponent, _) | (_, FrameChoice::Exp) => 1,
                    (_, FrameChoice::Hybrid) => 2,
                    (_, FrameChoice::Auto) if fallback => {
                        panic!("{ctx}: cannot tell which delta an Auto slot replaced by a FILL")
                    }
                    (_, FrameChoice::Auto) => actual[6],
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
                    let m = spec::mask(bits, coding, (coding == 3).then(|| &actual[at + 1..]));
                    if coding != 3 {
                        let best = *spec::cheap_sizes(bits).iter().min().unwrap();
                        assert_eq!(
                            m.len(),
                            best,
                            "{ctx}: the encoder picks the smallest cheap coding"
                        );
                    }
                    m
                };
                let delta = if mode == 1 {
                    let s0 = spec::pack_sm(c.dtype, &vals);
                    let s1 = coded(&exp_changed, spec::HEADER + s0.len());
                    let s2: Vec<u8> = (0..n)
                        .filter(|&i| exp_changed[i])
                        .map(|i| spec::exponent(c.dtype, vals[i]))
                        .collect();
                    spec::frame(&h, [&s0, &s1, &s2, &[]])
                } else {
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
                    spec::frame(&h, [&s0, &s1, &s2, &s3])
                };
                // "An encoder never emits a frame longer than 64 + n x size bytes": a longer
                // delta goes as a raw FILL.
                if delta.len() > spec::HEADER + n * size {
                    h.mode = 0;
                    h.fill = true;
                    spec::frame(&h, [cur, &[], &[], &[]])
                } else {
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

fn unhex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().filter(|t| *t != "-").collect();
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digit"))
        .collect()
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
            body.chunks(32).map(hex).collect::<Vec<_>>().join(" ")
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
    for (step, ((input, restart), fs)) in c.steps.iter().zip(frames).enumerate() {
        s += "\n";
        if let Some(v) = restart {
            s += &format!(
                "# both sides start over before step {step}: cold slots at version {v:#x}\n"
            );
        }
        s += &format!("input {step} {}\n", hex(input));
        for (ci, (info, f)) in fs.iter().enumerate() {
            s += &format!(
                "# {} frame{}, version {}, {} bytes\n",
                info.mode.name(),
                if info.fill { " (FILL)" } else { "" },
                info.version,
                f.len()
            );
            s += &frame_lines(&format!("frame {step}.{ci}"), f);
        }
    }
    s
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

fn read_or_bless(name: &str, fresh: String) -> String {
    let path = golden_dir().join(name);
    if blessing() {
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

#[test]
fn frames_match_golden_vectors() {
    for c in cases() {
        let encoded = encode_case(&c);
        let text = read_or_bless(&format!("{}.hex", c.name), case_file(&c, &encoded));
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
        let outs = decode_case(&c, &stored);
        for (step, (o, (i, _))) in outs.iter().zip(&c.steps).enumerate() {
            assert_eq!(
                hex(o),
                hex(i),
                "{} step {step}: decoded golden frame",
                c.name
            );
        }
        // (c) the document re-derives the stored bytes.
        derive_case(&c, &stored);
    }
}

/// Spot checks of header fields against the document's table, written out by hand, so a
/// reader can see the layout without running anything.
#[test]
fn header_layout_by_hand() {
    let c = &cases()[0]; // bf16_exp_8
    let e = encode_case(c);
    let f = &e[1][0].1;
    assert_eq!(&f[0..4], b"CIRF");
    assert_eq!(f[4], 1, "format version");
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
    let text = read_or_bless("sh64.hex", fresh);
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
    let text = read_or_bless("masks.hex", fresh);
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
    }
}
