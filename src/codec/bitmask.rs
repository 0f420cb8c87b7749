//! Coded bitmasks: which elements changed. A mask of `m` bits is held as `u64` words (bit i of
//! word w is element 64w+i) and travels in one of five codings, chosen per mask by size:
//!
//! ```text
//! method byte | payload
//! 0 Zero      | (none)                      every bit clear
//! 1 Flat      | ceil(m/8) bytes             bit i of byte j is element 8j+i
//! 2 Hier      | L1: ceil(G/8) bytes, G = ceil(m/64): bit g set iff word g is non-zero
//!             | L2: one byte per set L1 bit: bit j set iff byte j of that word is non-zero
//!             | L3: one byte per set L2 bit: that byte of the mask
//! 3 Rans      | rans::encode of the ceil(m/8) mask bytes (see rans.rs); decoded, no longer
//!             | written (format versions 1 and 2 wrote it)
//! 4 RansSeg   | rans_seg::encode of the ceil(m/8) mask bytes (format version 3)
//! ```
//! Hier costs about 1/64 + P(word)/8 + P(byte) bits per element and is cheap to code: it wins
//! when changes are rare (exponent changes, 0.2-4%). rANS gets within a few percent of the
//! entropy at any density: it wins for the value-changed mask of the full-value cache (10-80%).
//! RansSeg codes it in segments of 4096 bytes, independent chains that decoders run at once
//! (eight or sixteen per core, a thread each on a GPU); Rans is two chains however long.
//! Decoding is strict: bits past `m`, zero bytes that Hier says are non-zero, and unconsumed
//! payload are errors, so every accepted mask has exactly one encoding per method.

use super::error::{CodecError, Result};
use super::{rans, rans_seg};
use crate::coded_enum::coded_enum;

coded_enum! {
    #[repr(u8)]
    /// How a mask section is coded (its first byte).
    pub enum MaskCoding {
        Zero = 0,
        Flat = 1,
        Hier = 2,
        Rans = 3,
        RansSeg = 4,
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

thread_local! {
    /// Masks as bytes for rANS (two: `decode_two`), reused call after call (fresh buffers
    /// would page-fault in).
    static MASK_BYTES: std::cell::RefCell<[Vec<u8>; 2]> =
        const { std::cell::RefCell::new([Vec::new(), Vec::new()]) };
}

/// The `ceil(m/8)` bytes of the mask into `b`.
fn fill_bytes(b: &mut Vec<u8>, words: &[u64], m: usize) {
    b.clear();
    b.reserve(words.len() * 8);
    for w in words {
        b.extend_from_slice(&w.to_le_bytes());
    }
    b.truncate(m.div_ceil(8));
}

/// `plan_gated` samples masks of at least this many words: every `SAMPLE_STRIDE`th block of
/// `SAMPLE_BLOCK` words (an eighth, at least eight blocks).
const SAMPLE_BLOCK: usize = 64;
const SAMPLE_STRIDE: usize = 8;
const SAMPLE_MIN_WORDS: usize = SAMPLE_BLOCK * SAMPLE_STRIDE * 8;

/// Histogram of the mask's `ceil(m/8)` bytes (`rans::histogram` of them) read from the words,
/// a zero word at a time where it can; with `stride` > 1, of every `stride`th block of
/// `SAMPLE_BLOCK` whole words only.
fn mask_histogram(words: &[u64], m: usize, stride: usize) -> [u64; 256] {
    let nbytes = m.div_ceil(8);
    let whole = nbytes / 8;
    // Four interleaved tables hide the store-to-load latency of repeated symbols.
    let mut h = [[0u32; 256]; 4];
    let mut zeros = 0u64;
    for block in words[..whole].chunks(SAMPLE_BLOCK).step_by(stride) {
        for &w in block {
            if w == 0 {
                zeros += 8;
                continue;
            }
            let b = w.to_le_bytes();
            for (j, &x) in b.iter().enumerate() {
                h[j & 3][x as usize] += 1;
            }
        }
    }
    let mut out = [0u64; 256];
    for (s, o) in out.iter_mut().enumerate() {
        *o = h.iter().map(|t| t[s] as u64).sum();
    }
    out[0] += zeros;
    if stride == 1 && nbytes > whole * 8 {
        for &x in &words[whole].to_le_bytes()[..nbytes - whole * 8] {
            out[x as usize] += 1;
        }
    }
    out
}

/// Run `f` on the `ceil(m/8)` bytes of the mask.
fn with_mask_bytes<R>(words: &[u64], m: usize, f: impl FnOnce(&[u8]) -> R) -> R {
    MASK_BYTES.with(|c| {
        let mut bufs = c.take();
        fill_bytes(&mut bufs[0], words, m);
        let r = f(&bufs[0]);
        c.replace(bufs);
        r
    })
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
    /// The rANS table, when the plan chose RansSeg (`encode_planned` reuses it).
    pub table: Option<rans::FreqTable>,
}

/// Pick the coding for `words` (m bits). rANS is only tried when `rans_min_gain` is Some(g), and
/// chosen only if it saves more than g bytes over the best cheap coding: it costs codec time.
pub fn plan(words: &[u64], m: usize, rans_min_gain: Option<usize>) -> MaskPlan {
    plan_gated(words, m, rans_min_gain.map(|g| (g, g)))
}

/// `plan` with two margins, `rans = Some((try_gain, min_gain))`: the histogram is built where
/// the entropy of independent bits is more than `try_gain` bytes under the best cheap coding,
/// and rANS chosen where its estimate is more than `min_gain` under it. A mask whose bytes
/// repeat (runs, a stripe) codes far below that entropy: `try_gain` 0 still finds it.
pub fn plan_gated(words: &[u64], m: usize, rans: Option<(usize, usize)>) -> MaskPlan {
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
            table: None,
        };
    }
    let flat = 1 + m.div_ceil(8);
    let hier = 1 + words.len().div_ceil(8) + nz_words + nz_bytes;
    let (mut coding, mut bytes) = if hier <= flat {
        (MaskCoding::Hier, hier)
    } else {
        (MaskCoding::Flat, flat)
    };
    // rANS rarely beats the entropy of independent bits by much; skip the histogram when even
    // that would not save `try_gain` bytes.
    let iid_bytes = iid_bytes(ones as u64, m as u64) as usize;
    let mut table = None;
    // On a large mask, a sample first: most dense masks (a Hybrid frame's, mid-schedule) are
    // near one bit per bit, and the full histogram was a tenth of that encoder's time.
    // Sampled estimates came within 1.5% of the mask's full ones on the traces; an eighth of
    // the gain is 4-12% of a Hybrid frame's mask.
    let hopeless = |gain: usize| {
        words.len() >= SAMPLE_MIN_WORDS && {
            let hist = mask_histogram(words, m, SAMPLE_STRIDE);
            let t = rans::FreqTable::from_histogram(&hist);
            let est = 1 + rans_seg::estimate_scaled(&t, &hist, m.div_ceil(8));
            est + gain - gain / 8 >= bytes
        }
    };
    if let Some((_, gain)) = rans.filter(|&(t, g)| iid_bytes + t < bytes && !hopeless(g)) {
        let hist = mask_histogram(words, m, 1);
        let t = rans::FreqTable::from_histogram(&hist);
        let est = 1 + rans_seg::estimate_bytes(&t, &hist);
        if est + gain < bytes {
            coding = MaskCoding::RansSeg;
            bytes = est;
            table = Some(t);
        }
    }
    MaskPlan {
        coding,
        bytes,
        ones,
        table,
    }
}

/// Append the mask as `plan` (of these `words`) chose, to `out`: `encode` without building the
/// rANS table again.
pub fn encode_planned(words: &[u64], m: usize, plan: &MaskPlan, out: &mut Vec<u8>) {
    match (&plan.table, plan.coding) {
        (Some(table), MaskCoding::RansSeg) => {
            out.push(MaskCoding::RansSeg.code());
            with_mask_bytes(words, m, |bytes| rans_seg::encode(bytes, table, out));
        }
        _ => encode(words, m, plan.coding, out),
    }
}

/// `encode_planned` of mask a then mask b onto `out`, returning the bytes of a's.
#[allow(clippy::too_many_arguments)] // two masks, their sizes and plans
pub fn encode_planned_two(
    wa: &[u64],
    ma: usize,
    pa: &MaskPlan,
    wb: &[u64],
    mb: usize,
    pb: &MaskPlan,
    out: &mut Vec<u8>,
) -> usize {
    let start = out.len();
    encode_planned(wa, ma, pa, out);
    let a = out.len() - start;
    encode_planned(wb, mb, pb, out);
    a
}

/// Append the mask in `coding` to `out`.
pub fn encode(words: &[u64], m: usize, coding: MaskCoding, out: &mut Vec<u8>) {
    debug_assert_eq!(words.len(), words_for(m));
    out.push(coding.code());
    match coding {
        MaskCoding::Zero => {}
        MaskCoding::Flat => with_mask_bytes(words, m, |b| out.extend_from_slice(b)),
        MaskCoding::Hier => {
            // The levels' sizes first, then one pass writing all three in place (L3 at up to
            // 8 bytes per non-zero word, cut to size at the end): no per-byte push.
            let nz = words.iter().filter(|&&w| w != 0).count();
            let l1_start = out.len();
            let l2_start = l1_start + words.len().div_ceil(8);
            let l3_start = l2_start + nz;
            out.resize(l3_start + 8 * nz, 0);
            let (head, l3) = out.split_at_mut(l3_start);
            let (l1, l2) = head[l1_start..].split_at_mut(l2_start - l1_start);
            let (mut k, mut p) = (0usize, 0usize);
            for (g, &w) in words.iter().enumerate() {
                if w == 0 {
                    continue;
                }
                l1[g / 8] |= 1 << (g % 8);
                l2[k] = nonzero_byte_map(w);
                k += 1;
                // Every byte is stored; the cursor moves past the non-zero ones only.
                for b in w.to_le_bytes() {
                    l3[p] = b;
                    p += (b != 0) as usize;
                }
            }
            out.truncate(l3_start + p);
        }
        MaskCoding::Rans | MaskCoding::RansSeg => {
            with_mask_bytes(words, m, |bytes| {
                let table = rans::FreqTable::from_histogram(&rans::histogram(bytes));
                if coding == MaskCoding::Rans {
                    rans::encode(bytes, &table, out);
                } else {
                    rans_seg::encode(bytes, &table, out);
                }
            });
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
        MaskCoding::Rans | MaskCoding::RansSeg => {
            if nbytes == 0 {
                return Err(CodecError::corrupt("mask", "rans coding of an empty mask"));
            }
            MASK_BYTES.with(|c| {
                let mut bufs = c.take();
                let bytes = &mut bufs[0];
                bytes.clear();
                bytes.resize(nbytes, 0);
                let r = if coding == MaskCoding::Rans {
                    rans::decode(payload, bytes)
                } else {
                    rans_seg::decode(payload, bytes)
                };
                if r.is_ok() {
                    bytes_to_words(bytes, words);
                }
                c.replace(bufs);
                r
            })?;
        }
    }
    check_words(words, m, method)
}

/// `decode` of mask a (`ma` bits), then of mask b over its set bits (as many bits as a has
/// set), with the same results and errors; `mb_hint` is what the caller expects that count to
/// be (from another section's length). When both masks are two-state rANS blocks (coding 3,
/// format versions 1-2) and the hint is right, their decoders run interleaved
/// (`rans::decode_pair`); segmented ones (coding 4) decode one after the other, each already
/// many chains.
pub fn decode_two(
    in_a: &[u8],
    ma: usize,
    wa: &mut Vec<u64>,
    in_b: &[u8],
    mb_hint: Option<usize>,
    wb: &mut Vec<u64>,
) -> Result<(usize, usize)> {
    let rans_code = MaskCoding::Rans.code();
    let Some(mb) = mb_hint.filter(|&mb| {
        ma > 0 && mb > 0 && in_a.first() == Some(&rans_code) && in_b.first() == Some(&rans_code)
    }) else {
        let k = decode(in_a, ma, wa)?;
        let ke = decode(in_b, k, wb)?;
        return Ok((k, ke));
    };
    MASK_BYTES.with(|c| {
        let mut bufs = c.take();
        let [ba, bb] = &mut bufs;
        ba.clear();
        ba.resize(ma.div_ceil(8), 0);
        bb.clear();
        bb.resize(mb.div_ceil(8), 0);
        let (ra, rb) = rans::decode_pair(&in_a[1..], ba, &in_b[1..], bb);
        let r = (|| {
            ra?;
            wa.clear();
            wa.resize(words_for(ma), 0);
            bytes_to_words(ba, wa);
            let k = check_words(wa, ma, rans_code)?;
            if k != mb {
                // Mask b has another length than the caller thought: decode it as `decode`.
                return Ok((k, decode(in_b, k, wb)?));
            }
            rb?;
            wb.clear();
            wb.resize(words_for(mb), 0);
            bytes_to_words(bb, wb);
            Ok((k, check_words(wb, mb, rans_code)?))
        })();
        c.replace(bufs);
        r
    })
}

/// The checks every decoded mask passes (bits past `m` clear, a non-zero coding not of an
/// all-zero mask); returns its set bits.
fn check_words(words: &[u64], m: usize, method: u8) -> Result<usize> {
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
    // Whole words by fixed-size loads (a variable-length copy per word measured as a call to
    // memcpy each), then the last partial one.
    let whole = bytes.chunks_exact(8);
    let rest = whole.remainder();
    for (w, c) in words.iter_mut().zip(whole) {
        *w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
    }
    if !rest.is_empty() {
        if let Some(w) = words.get_mut(bytes.len() / 8) {
            let mut b = [0u8; 8];
            b[..rest.len()].copy_from_slice(rest);
            *w = u64::from_le_bytes(b);
        }
    }
}

/// For each level-2 byte `map`: entry j is the number of set bits of `map` below bit j (where
/// byte j of the word is in its level-3 bytes).
static HIER_RANK: [[u8; 8]; 256] = {
    let mut t = [[0u8; 8]; 256];
    let mut m = 0;
    while m < 256 {
        let mut j = 0;
        while j < 8 {
            t[m][j] = (m & ((1 << j) - 1)).count_ones() as u8;
            j += 1;
        }
        m += 1;
    }
    t
};

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
        let cnt = map.count_ones() as usize;
        let word = if let Some(win) = payload.get(l3_pos..l3_pos + 8) {
            // Eight bytes in reach: byte j of the word is byte RANK[map][j] of the window
            // where map bit j is set; the eight are independent (no chain through a cursor).
            let src = u64::from_le_bytes(win.try_into().expect("8 bytes"));
            let rank = &HIER_RANK[map as usize];
            let mut word = 0u64;
            for (j, &r) in rank.iter().enumerate() {
                let keep = 0u64.wrapping_sub((map >> j & 1) as u64);
                word |= ((src >> (8 * r)) & 0xff & keep) << (8 * j);
            }
            word
        } else {
            let src = payload.get(l3_pos..l3_pos + cnt).ok_or_else(too_short)?;
            let mut bytes = [0u8; 8];
            let mut t = map;
            for &v in src {
                bytes[t.trailing_zeros() as usize] = v;
                t &= t - 1;
            }
            u64::from_le_bytes(bytes)
        };
        if nonzero_bytes(word) as usize != cnt {
            let j = (0..8)
                .find(|&j| map >> j & 1 == 1 && word >> (8 * j) & 0xff == 0)
                .unwrap_or(0);
            return Err(CodecError::corrupt(
                "mask",
                format!("byte {j} of word {g} is zero"),
            ));
        }
        l3_pos += cnt;
        *w = word;
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
        for coding in [
            MaskCoding::Flat,
            MaskCoding::Hier,
            MaskCoding::Rans,
            MaskCoding::RansSeg,
        ]
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
        let mut planned = Vec::new();
        encode_planned(words, m, &p, &mut planned);
        assert_eq!(planned, out, "{:?}", p.coding);
        if p.coding != MaskCoding::RansSeg {
            assert_eq!(out.len(), p.bytes, "{:?}", p.coding);
        }
    }

    /// The word-wise histogram counts exactly the mask's bytes (zero words, a partial last
    /// word); a sampled one counts whole words of every eighth block only.
    #[test]
    fn mask_histogram_matches_bytes() {
        let mut s = 11u64;
        for m in [1, 7, 64, 65, 1000, 4095, SAMPLE_MIN_WORDS * 64 + 77] {
            for density in [0u64, 3, 128, 250] {
                let mut words = vec![0u64; words_for(m)];
                for (i, w) in words.iter_mut().enumerate() {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    // Runs of zero words, and bytes set with about density/256.
                    if (i / 37) % 3 != 0 {
                        for j in 0..64 {
                            s ^= s << 13;
                            s ^= s >> 7;
                            s ^= s << 17;
                            *w |= u64::from(s % 256 < density) << j;
                        }
                    }
                }
                if m % 64 != 0 {
                    *words.last_mut().unwrap() &= (1u64 << (m % 64)) - 1;
                }
                let want = with_mask_bytes(&words, m, rans::histogram);
                assert_eq!(
                    mask_histogram(&words, m, 1),
                    want,
                    "m {m} density {density}"
                );
                let sampled: u64 = mask_histogram(&words, m, SAMPLE_STRIDE).iter().sum();
                let whole = m.div_ceil(8) / 8;
                let blocks = whole.div_ceil(SAMPLE_BLOCK).div_ceil(SAMPLE_STRIDE);
                assert!(sampled <= (blocks * SAMPLE_BLOCK * 8) as u64, "m {m}");
                assert!(
                    whole < SAMPLE_BLOCK * SAMPLE_STRIDE || sampled >= (SAMPLE_BLOCK * 8) as u64
                );
                // The full histogram scaled to itself is the plain estimate (to a byte); the
                // sample's, scaled to the mask, is within 2% of the mask's bytes here.
                let t = rans::FreqTable::from_histogram(&want);
                let full = rans_seg::estimate_bytes(&t, &want);
                let selfs = rans_seg::estimate_scaled(&t, &want, m.div_ceil(8));
                assert!(full.abs_diff(selfs) <= 1, "m {m}: {full} vs {selfs}");
                if m >= SAMPLE_MIN_WORDS * 64 && density > 0 {
                    let hs = mask_histogram(&words, m, SAMPLE_STRIDE);
                    let ts = rans::FreqTable::from_histogram(&hs);
                    let est = rans_seg::estimate_scaled(&ts, &hs, m.div_ceil(8));
                    let slack = m.div_ceil(8) / 50;
                    assert!(
                        full.abs_diff(est) <= slack,
                        "m {m} density {density}: {full} vs {est}"
                    );
                }
            }
        }
    }

    /// The two-mask coders give what two single calls give: bytes, masks, counts, errors (also
    /// with a wrong length hint and with corrupted sections).
    #[test]
    fn two_masks_match_single() {
        let mut s = 7u64;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
            s
        };
        for (n, dense) in [
            (1usize, 1u32),
            (70, 2),
            (640, 2),
            (5000, 3),
            (20_000, 1),
            (777, 6),
        ] {
            let wa: Vec<u64> = (0..words_for(n))
                .map(|w| {
                    let r = next() | next() >> (dense as u64);
                    let r = if dense > 4 { r & next() & next() } else { r };
                    if (w + 1) * 64 > n && !n.is_multiple_of(64) {
                        r & ((1u64 << (n % 64)) - 1)
                    } else {
                        r
                    }
                })
                .collect();
            let k: usize = wa.iter().map(|w| w.count_ones() as usize).sum();
            let wb: Vec<u64> = (0..words_for(k))
                .map(|w| {
                    let r = next() & next() & next();
                    if (w + 1) * 64 > k && !k.is_multiple_of(64) {
                        r & ((1u64 << (k % 64)) - 1)
                    } else {
                        r
                    }
                })
                .collect();
            let (pa, pb) = (plan(&wa, n, Some(0)), plan(&wb, k, Some(0)));
            let mut single = Vec::new();
            encode_planned(&wa, n, &pa, &mut single);
            let a_len = single.len();
            encode_planned(&wb, k, &pb, &mut single);
            let mut two = Vec::new();
            assert_eq!(
                encode_planned_two(&wa, n, &pa, &wb, k, &pb, &mut two),
                a_len
            );
            assert_eq!(two, single, "n={n} {:?} {:?}", pa.coding, pb.coding);
            let (sa, sb) = single.split_at(a_len);
            let run = |sa: &[u8], sb: &[u8], hint| {
                let (mut x, mut y) = (Vec::new(), Vec::new());
                let r1 = decode(sa, n, &mut x).and_then(|k| Ok((k, decode(sb, k, &mut y)?)));
                let (mut x2, mut y2) = (Vec::new(), Vec::new());
                let r2 = decode_two(sa, n, &mut x2, sb, hint, &mut y2);
                let (r1, r2) = (r1.map_err(|e| e.to_string()), r2.map_err(|e| e.to_string()));
                assert_eq!(r1, r2, "n={n} hint={hint:?}");
                if r1.is_ok() {
                    assert_eq!((x, y), (x2, y2));
                }
            };
            for hint in [Some(k), Some(k + 1), None] {
                run(sa, sb, hint);
            }
            for _ in 0..30 {
                let (mut ba, mut bb) = (sa.to_vec(), sb.to_vec());
                let t = if next() % 2 == 0 { &mut ba } else { &mut bb };
                let i = 1 + next() as usize % (t.len() - 1).max(1);
                if i < t.len() {
                    t[i] ^= 1 << (next() % 8);
                }
                run(&ba, &bb, Some(k));
            }
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
