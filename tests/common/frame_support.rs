//! Frame surgery shared by tests/codec_props.rs, tests/codec_corrupt.rs and the fuzz targets
//! (fuzz/src/lib.rs includes this file): read and set a frame's section lengths, recompute its
//! checksums, build a cache slot in a given state through the public API, and check that a
//! coded change mask is the one canonical encoding of its bits.
#![allow(dead_code)]

use ciera::codec::bitmask::MaskCoding;
use ciera::codec::{bitmask, checksum, frame, rans, CacheMode, CacheSlot, FrameChoice};
use ciera::DType;

/// The four section lengths of the frame header (bytes 32..48).
pub fn section_lens(f: &[u8]) -> [usize; 4] {
    std::array::from_fn(|i| {
        u32::from_le_bytes(f[32 + 4 * i..36 + 4 * i].try_into().unwrap()) as usize
    })
}

pub fn set_section_lens(f: &mut [u8], s: [usize; 4]) {
    for (i, l) in s.iter().enumerate() {
        f[32 + 4 * i..36 + 4 * i].copy_from_slice(&(*l as u32).to_le_bytes());
    }
}

/// Recompute both checksums of the frame at the start of `f` (SH64 of s0 at 48, xxh3 of the
/// header and s1..s3 at 56) as docs/WIRE.md defines them, as far as the bytes present allow.
pub fn reseal(f: &mut [u8]) {
    if f.len() < frame::HEADER_LEN {
        return;
    }
    let s = section_lens(f);
    let h = frame::HEADER_LEN;
    let end0 = (h + s[0]).min(f.len());
    let s0 = checksum::sh64(&f[h..end0]);
    f[48..56].copy_from_slice(&s0.to_le_bytes());
    let end = (h + s.iter().sum::<usize>()).min(f.len());
    let mut x = xxhash_rust::xxh3::Xxh3::new();
    x.update(&f[..56]);
    x.update(&f[end0..end]);
    let sum = x.digest();
    f[56..64].copy_from_slice(&sum.to_le_bytes());
}

/// A slot at `version`, holding `values` as its previous iteration (when `warm`): the state a
/// peer would be in after decoding `values` at `version - 1`. Built through the public API
/// alone: a raw FILL frame whose version field is rewritten.
pub fn slot_at(
    dtype: DType,
    mode: CacheMode,
    choice: FrameChoice,
    len: usize,
    version: u64,
    warm: bool,
    values: &[u8],
) -> CacheSlot {
    let mut src = CacheSlot::new(dtype, mode, len);
    let mut f = Vec::new();
    src.encode(values, &mut f).expect("raw encode");
    f[24..32].copy_from_slice(&version.wrapping_sub(1).to_le_bytes());
    reseal(&mut f);
    let mut s = CacheSlot::new(dtype, mode, len);
    s.set_frame_choice(choice);
    let mut out = vec![0u8; values.len()];
    s.decode(&f, &mut out).expect("decode of a raw frame");
    assert_eq!(out, values);
    assert_eq!(s.version(), version);
    if !warm {
        s.poison();
    }
    assert_eq!(s.is_warm(), warm && dtype.is_compressible());
    s
}

/// The frequency table at the start of a rANS block (docs/WIRE.md), as a histogram that
/// `FreqTable::from_histogram` scales to exactly that table.
pub fn rans_table(b: &[u8]) -> Option<[u64; 256]> {
    let nsym = *b.first()? as usize + 1;
    let mut pos = 1;
    let mut syms = Vec::new();
    if nsym < 32 {
        syms.extend(b.get(1..1 + nsym)?.iter().map(|&s| s as usize));
        pos += nsym;
    } else {
        let bm = b.get(1..33)?;
        syms.extend((0..256).filter(|&s| bm[s / 8] >> (s % 8) & 1 == 1));
        pos += 32;
    }
    let mut freq = [0u64; 256];
    for s in syms {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let x = *b.get(pos)?;
            pos += 1;
            v |= ((x & 0x7f) as u64) << shift;
            shift += 7;
            if x & 0x80 == 0 {
                break;
            }
        }
        freq[s] = v + 1;
    }
    Some(freq)
}

/// An accepted coded mask is the one encoding of its bits in its coding: Zero, Flat and Hier
/// are deterministic; a rANS block re-encodes to itself with its own frequency table (a
/// histogram equal to the frequencies scales to exactly that table).
pub fn mask_is_canonical(section: &[u8], m: usize, words: &[u64]) -> Result<(), String> {
    let coding = match section[0] {
        0 => MaskCoding::Zero,
        1 => MaskCoding::Flat,
        2 => MaskCoding::Hier,
        3 => MaskCoding::Rans,
        _ => MaskCoding::RansSeg,
    };
    let mut again = Vec::new();
    if matches!(coding, MaskCoding::Rans | MaskCoding::RansSeg) {
        let hist = rans_table(&section[1..]).ok_or("unparsable rANS table")?;
        let bytes: Vec<u8> = words
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .take(m.div_ceil(8))
            .collect();
        let table = rans::FreqTable::from_histogram(&hist);
        again.push(coding.code());
        if coding == MaskCoding::Rans {
            rans::encode(&bytes, &table, &mut again);
        } else {
            ciera::codec::rans_seg::encode(&bytes, &table, &mut again);
        }
    } else {
        bitmask::encode(words, m, coding, &mut again);
    }
    if again != section {
        return Err(format!(
            "{coding:?} mask accepted in a non-canonical form ({} bytes, canonical {})",
            section.len(),
            again.len()
        ));
    }
    Ok(())
}

/// SplitMix64: the data of a case is derived from one seed, so a failure (or a persisted
/// proptest regression) replays exactly.
#[derive(Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in 0..n (0 for n = 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && ((self.next() >> 11) as f64) / ((1u64 << 53) as f64) < p
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}
