//! Coded bitmasks: which elements changed. A mask of `m` bits is held as `u64` words (bit i of
//! word w is element 64w+i) and travels in one of four codings, chosen per mask by size:
//!
//! ```text
//! method byte | payload
//! 0 Zero      | (none)                      every bit clear
//! 1 Flat      | ceil(m/8) bytes             bit i of byte j is element 8j+i
//! 2 Hier      | L1: ceil(G/8) bytes, G = ceil(m/64): bit g set iff word g is non-zero
//!             | L2: one byte per set L1 bit: bit j set iff byte j of that word is non-zero
//!             | L3: one byte per set L2 bit: that byte of the mask
//! 3 Rans      | rans::encode of the ceil(m/8) mask bytes (see rans.rs)
//! ```
//! Hier costs about 1/64 + P(word)/8 + P(byte) bits per element and is cheap to code: it wins
//! when changes are rare (exponent changes, 0.2-4%). Rans gets within a few percent of the
//! entropy at any density: it wins for the value-changed mask of the full-value cache (10-80%).
//! Decoding is strict: bits past `m`, zero bytes that Hier says are non-zero, and unconsumed
//! payload are errors, so every accepted mask has exactly one encoding per method.

use super::error::{CodecError, Result};
use super::rans;
use crate::coded_enum::coded_enum;

coded_enum! {
    #[repr(u8)]
    /// How a mask section is coded (its first byte).
    pub enum MaskCoding {
        Zero = 0,
        Flat = 1,
        Hier = 2,
        Rans = 3,
    }
}

/// Number of u64 words holding `m` bits.
pub fn words_for(m: usize) -> usize {
    m.div_ceil(64)
}

/// Number of non-zero bytes in a word.
#[inline]
fn nonzero_bytes(w: u64) -> u32 {
    let mut t = w;
    t |= t >> 4;
    t |= t >> 2;
    t |= t >> 1;
    (t & 0x0101_0101_0101_0101).count_ones()
}

/// Bit j set iff byte j of `w` is non-zero.
#[inline]
fn nonzero_byte_map(w: u64) -> u8 {
    let mut t = w;
    t |= t >> 4;
    t |= t >> 2;
    t |= t >> 1;
    let t = t & 0x0101_0101_0101_0101;
    // Gather bit 0 of each byte into one byte.
    (t.wrapping_mul(0x0102_0408_1020_4080) >> 56) as u8
}

fn mask_bytes(words: &[u64], m: usize) -> Vec<u8> {
    let mut b: Vec<u8> = Vec::with_capacity(words.len() * 8);
    for w in words {
        b.extend_from_slice(&w.to_le_bytes());
    }
    b.truncate(m.div_ceil(8));
    b
}

/// Binary entropy in bits of a bit that is set with probability `p`.
pub fn entropy(p: f64) -> f64 {
    h2(p)
}

fn h2(p: f64) -> f64 {
    if p <= 0.0 || p >= 1.0 {
        0.0
    } else {
        -(p * p.log2() + (1.0 - p) * (1.0 - p).log2())
    }
}

/// Bytes of a mask of `m` bits with `ones` set at the entropy of independent bits (floor), in
/// integer arithmetic (Q16 logarithms) so that GPU encoders choose exactly as this does.
pub fn iid_bytes(ones: u64, m: u64) -> u64 {
    if ones == 0 || ones >= m {
        return 0;
    }
    let lm = rans::log2_q16(m);
    let bits = ones * (lm - rans::log2_q16(ones)) + (m - ones) * (lm - rans::log2_q16(m - ones));
    bits / (8 << 16)
}

/// Sizes of each coding for a mask, to choose one.
pub struct MaskPlan {
    pub coding: MaskCoding,
    pub bytes: usize,
    pub ones: usize,
}

/// Pick the coding for `words` (m bits). rANS is only tried when `rans_min_gain` is Some(g), and
/// chosen only if it saves more than g bytes over the best cheap coding: it costs codec time.
pub fn plan(words: &[u64], m: usize, rans_min_gain: Option<usize>) -> MaskPlan {
    let mut ones = 0usize;
    let mut nz_words = 0usize;
    let mut nz_bytes = 0usize;
    for &w in words {
        if w != 0 {
            ones += w.count_ones() as usize;
            nz_words += 1;
            nz_bytes += nonzero_bytes(w) as usize;
        }
    }
    if ones == 0 {
        return MaskPlan {
            coding: MaskCoding::Zero,
            bytes: 1,
            ones,
        };
    }
    let flat = 1 + m.div_ceil(8);
    let hier = 1 + words.len().div_ceil(8) + nz_words + nz_bytes;
    let (mut coding, mut bytes) = if hier <= flat {
        (MaskCoding::Hier, hier)
    } else {
        (MaskCoding::Flat, flat)
    };
    // rANS cannot beat the entropy of independent bits by much; skip the histogram when even
    // that would not save `gain` bytes.
    let iid_bytes = iid_bytes(ones as u64, m as u64) as usize;
    if let Some(gain) = rans_min_gain.filter(|&g| iid_bytes + g < bytes) {
        let hist = rans::histogram(&mask_bytes(words, m));
        let est = 1 + rans::FreqTable::from_histogram(&hist).estimate_bytes(&hist);
        if est + gain < bytes {
            coding = MaskCoding::Rans;
            bytes = est;
        }
    }
    MaskPlan {
        coding,
        bytes,
        ones,
    }
}

/// Append the mask in `coding` to `out`.
pub fn encode(words: &[u64], m: usize, coding: MaskCoding, out: &mut Vec<u8>) {
    debug_assert_eq!(words.len(), words_for(m));
    out.push(coding.code());
    match coding {
        MaskCoding::Zero => {}
        MaskCoding::Flat => out.extend_from_slice(&mask_bytes(words, m)),
        MaskCoding::Hier => {
            let l1_start = out.len();
            out.resize(l1_start + words.len().div_ceil(8), 0);
            for (g, &w) in words.iter().enumerate() {
                if w != 0 {
                    out[l1_start + g / 8] |= 1 << (g % 8);
                }
            }
            for &w in words.iter().filter(|&&w| w != 0) {
                out.push(nonzero_byte_map(w));
            }
            for &w in words.iter().filter(|&&w| w != 0) {
                out.extend(w.to_le_bytes().iter().filter(|&&b| b != 0));
            }
        }
        MaskCoding::Rans => {
            let bytes = mask_bytes(words, m);
            let table = rans::FreqTable::from_histogram(&rans::histogram(&bytes));
            rans::encode(&bytes, &table, out);
        }
    }
}

/// Decode a mask of `m` bits from exactly `input` into `words` (resized). Returns the number of
/// set bits.
pub fn decode(input: &[u8], m: usize, words: &mut Vec<u64>) -> Result<usize> {
    let nwords = words_for(m);
    words.clear();
    words.resize(nwords, 0);
    let (&method, payload) = input
        .split_first()
        .ok_or_else(|| CodecError::corrupt("mask", "empty section (no coding byte)"))?;
    let nbytes = m.div_ceil(8);
    let Some(coding) = MaskCoding::from_code(method) else {
        return Err(CodecError::corrupt(
            "mask",
            format!("unknown coding {method}"),
        ));
    };
    match coding {
        MaskCoding::Zero => {
            if !payload.is_empty() {
                return Err(CodecError::corrupt("mask", "zero mask with a payload"));
            }
        }
        MaskCoding::Flat => {
            if payload.len() != nbytes {
                return Err(CodecError::corrupt(
                    "mask",
                    format!(
                        "flat mask of {m} bits needs {nbytes} bytes, has {}",
                        payload.len()
                    ),
                ));
            }
            bytes_to_words(payload, words);
        }
        MaskCoding::Hier => decode_hier(payload, words)?,
        MaskCoding::Rans => {
            if nbytes == 0 {
                return Err(CodecError::corrupt("mask", "rans coding of an empty mask"));
            }
            let mut bytes = vec![0u8; nbytes];
            rans::decode(payload, &mut bytes)?;
            bytes_to_words(&bytes, words);
        }
    }
    // Bits past m must be clear.
    if !m.is_multiple_of(64) {
        if let Some(&last) = words.last() {
            if last >> (m % 64) != 0 {
                return Err(CodecError::corrupt(
                    "mask",
                    format!("bits set past the mask's {m} bits"),
                ));
            }
        }
    }
    let ones: usize = words.iter().map(|w| w.count_ones() as usize).sum();
    if method != 0 && ones == 0 {
        return Err(CodecError::corrupt(
            "mask",
            "non-zero coding of an all-zero mask",
        ));
    }
    Ok(ones)
}

fn bytes_to_words(bytes: &[u8], words: &mut [u64]) {
    for (w, c) in words.iter_mut().zip(bytes.chunks(8)) {
        let mut b = [0u8; 8];
        b[..c.len()].copy_from_slice(c);
        *w = u64::from_le_bytes(b);
    }
}

fn decode_hier(payload: &[u8], words: &mut [u64]) -> Result<()> {
    let l1_len = words.len().div_ceil(8);
    let too_short = || CodecError::corrupt("mask", "hierarchical mask ends early");
    let l1 = payload.get(..l1_len).ok_or_else(too_short)?;
    let nz_words: usize = l1.iter().map(|b| b.count_ones() as usize).sum();
    let l2 = payload
        .get(l1_len..l1_len + nz_words)
        .ok_or_else(too_short)?;
    let mut l3_pos = l1_len + nz_words;
    let mut k = 0usize;
    for (g, w) in words.iter_mut().enumerate() {
        if l1[g / 8] >> (g % 8) & 1 == 0 {
            continue;
        }
        let map = l2[k];
        k += 1;
        if map == 0 {
            return Err(CodecError::corrupt(
                "mask",
                format!("word {g} marked non-zero has no bytes"),
            ));
        }
        let mut bytes = [0u8; 8];
        for (j, b) in bytes.iter_mut().enumerate() {
            if map >> j & 1 == 1 {
                let v = *payload.get(l3_pos).ok_or_else(too_short)?;
                if v == 0 {
                    return Err(CodecError::corrupt(
                        "mask",
                        format!("byte {j} of word {g} is zero"),
                    ));
                }
                *b = v;
                l3_pos += 1;
            }
        }
        *w = u64::from_le_bytes(bytes);
    }
    // L1 bits for words that do not exist (padding of the last byte) must be clear.
    if !words.len().is_multiple_of(8) && l1_len > 0 && l1[l1_len - 1] >> (words.len() % 8) != 0 {
        return Err(CodecError::corrupt(
            "mask",
            "level-1 bits set past the last word",
        ));
    }
    if l3_pos != payload.len() {
        return Err(CodecError::corrupt(
            "mask",
            format!(
                "{} trailing bytes after the hierarchical mask",
                payload.len() - l3_pos
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(words: &[u64], m: usize) {
        let zero = words.iter().all(|&w| w == 0);
        for coding in [MaskCoding::Flat, MaskCoding::Hier, MaskCoding::Rans]
            .into_iter()
            .filter(|_| !zero)
        {
            let mut out = Vec::new();
            encode(words, m, coding, &mut out);
            let mut back = Vec::new();
            match decode(&out, m, &mut back) {
                Ok(_) => assert_eq!(back, words, "{coding:?}"),
                Err(e) => panic!("{coding:?}: {e}"),
            }
        }
        let p = plan(words, m, Some(0));
        let mut out = Vec::new();
        encode(words, m, p.coding, &mut out);
        if p.coding != MaskCoding::Rans {
            assert_eq!(out.len(), p.bytes, "{:?}", p.coding);
        }
    }

    #[test]
    fn byte_map() {
        assert_eq!(nonzero_byte_map(0), 0);
        assert_eq!(nonzero_byte_map(0x0100_0000_0000_0080), 0b1000_0001);
        assert_eq!(nonzero_byte_map(u64::MAX), 0xff);
        assert_eq!(nonzero_bytes(0x00ff_0000_0100_0000), 2);
    }

    #[test]
    fn roundtrips() {
        check(&[], 0);
        check(&[1], 1);
        check(&[0b101], 3);
        check(&[0, 0, 1 << 20], 150);
        check(&[u64::MAX, 0x8000_0000_0000_0001, 0x7f], 135);
        let mut s = 99u64;
        let words: Vec<u64> = (0..1000)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
                let a = s;
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
                a & s & (s >> 7)
            })
            .collect();
        check(&words, 64_000);
    }

    #[test]
    fn strictness() {
        let mut back = Vec::new();
        assert!(decode(&[], 8, &mut back).is_err());
        assert!(decode(&[0, 1], 8, &mut back).is_err());
        assert!(decode(&[1, 0x10], 4, &mut back).is_err(), "bit past m");
        assert!(
            decode(&[1, 0x00], 4, &mut back).is_err(),
            "flat all-zero must be Zero"
        );
        assert!(decode(&[9], 4, &mut back).is_err());
        // Hier: L1 says word 0 non-zero, L2 names byte 0, L3 byte is zero.
        assert!(decode(&[2, 1, 1, 0], 64, &mut back).is_err());
        assert!(
            decode(&[2, 1, 1, 5, 7], 64, &mut back).is_err(),
            "trailing byte"
        );
        assert_eq!(decode(&[2, 1, 1, 5], 64, &mut back).unwrap(), 2);
        assert_eq!(back, vec![5]);
    }
}
