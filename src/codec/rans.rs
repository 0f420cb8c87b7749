//! Order-0 rANS over bytes (32-bit state, byte-wise renormalisation, 12-bit probabilities).
//!
//! Used for the change masks when they are dense enough that a flat or hierarchical bitmap
//! wastes bits (the full-value cache at mid learning rates, where 10-80% of values change).
//! Layout of a coded block (all little-endian):
//!
//! ```text
//! table   : u8 nsym-1 | symbols (nsym bytes if nsym < 32, else a 32-byte presence bitmap)
//!           | nsym LEB128 varints freq-1   (frequencies sum to 4096)
//! u32 u32 : final encoder states x0, x1 (L <= x < L*256)
//! bytes   : renormalisation bytes, in decoding order
//! ```
//! Two interleaved states: symbol i is coded by state i % 2, so a decoder works on two
//! independent dependency chains at once (about twice the speed of one state).
//! The decoder checks every step: a table that does not sum to 4096, a state out of range, a
//! stream that ends early, bytes left over, or a final state other than the encoder's initial
//! one are all errors. No input can make it panic or read out of bounds.

use super::error::{CodecError, Result};

pub(super) const PROB_BITS: u32 = 12;
const PROB_SCALE: u32 = 1 << PROB_BITS;
/// Lower bound of the normalised state interval [L, L*256).
const RANS_L: u32 = 1 << 23;

/// Normalised frequencies of the 256 byte values; present symbols have freq >= 1.
#[derive(Clone)]
pub struct FreqTable {
    freq: [u32; 256],
    cum: [u32; 256],
}

impl FreqTable {
    /// Scale a histogram to frequencies summing to `PROB_SCALE`. `hist` must not be all zero.
    pub fn from_histogram(hist: &[u64; 256]) -> FreqTable {
        let total: u64 = hist.iter().sum();
        debug_assert!(total > 0);
        let mut freq = [0u32; 256];
        let mut sum: i64 = 0;
        for (f, &c) in freq.iter_mut().zip(hist.iter()) {
            if c > 0 {
                let scaled = ((c as u128 * PROB_SCALE as u128) / total as u128) as u32;
                *f = scaled.max(1);
                sum += *f as i64;
            }
        }
        // Move the rounding error onto the largest symbols, keeping every present one >= 1.
        let mut diff = PROB_SCALE as i64 - sum;
        while diff != 0 {
            let mut order: Vec<usize> = (0..256).filter(|&s| freq[s] > 0).collect();
            order.sort_by_key(|&s| std::cmp::Reverse(freq[s]));
            for &s in &order {
                if diff == 0 {
                    break;
                }
                if diff > 0 {
                    freq[s] += diff as u32;
                    diff = 0;
                } else if freq[s] > 1 {
                    let take = ((freq[s] - 1) as i64).min(-diff);
                    freq[s] -= take as u32;
                    diff += take;
                }
            }
        }
        FreqTable::with_freqs(freq)
    }

    fn with_freqs(freq: [u32; 256]) -> FreqTable {
        let mut cum = [0u32; 256];
        let mut acc = 0;
        for s in 0..256 {
            cum[s] = acc;
            acc += freq[s];
        }
        FreqTable { freq, cum }
    }

    /// Estimated coded size in bytes of data with this histogram (table + state + payload).
    pub fn estimate_bytes(&self, hist: &[u64; 256]) -> usize {
        // Integer arithmetic (Q16 code lengths), so a GPU encoder (cuda/codec.cu) makes the
        // same choices bit for bit.
        let mut bits: u64 = 0;
        for (s, &h) in hist.iter().enumerate() {
            if h > 0 {
                bits += h * ((12 << 16) - log2_q16(self.freq[s] as u64));
            }
        }
        bits.div_ceil(8 << 16) as usize + self.table_bytes() + 8
    }

    fn nsym(&self) -> usize {
        self.freq.iter().filter(|&&f| f > 0).count()
    }

    fn table_bytes(&self) -> usize {
        let n = self.nsym();
        let syms = if n < 32 { n } else { 32 };
        let varints: usize = self
            .freq
            .iter()
            .filter(|&&f| f > 0)
            .map(|&f| if f - 1 < 128 { 1 } else { 2 })
            .sum();
        1 + syms + varints
    }

    fn write(&self, out: &mut Vec<u8>) {
        let n = self.nsym();
        out.push((n - 1) as u8);
        if n < 32 {
            out.extend((0..256).filter(|&s| self.freq[s] > 0).map(|s| s as u8));
        } else {
            let mut bm = [0u8; 32];
            for s in 0..256 {
                if self.freq[s] > 0 {
                    bm[s / 8] |= 1 << (s % 8);
                }
            }
            out.extend_from_slice(&bm);
        }
        for s in 0..256 {
            if self.freq[s] > 0 {
                write_varint(out, self.freq[s] - 1);
            }
        }
    }

    fn read(input: &[u8], pos: &mut usize) -> Result<FreqTable> {
        let n = *take(input, pos, 1)?.first().unwrap_or(&0) as usize + 1;
        let mut present = [false; 256];
        if n < 32 {
            let syms = take(input, pos, n)?;
            let mut prev: i32 = -1;
            for &s in syms {
                if (s as i32) <= prev {
                    return Err(CodecError::corrupt(
                        "rans table",
                        "symbols not strictly increasing",
                    ));
                }
                prev = s as i32;
                present[s as usize] = true;
            }
        } else {
            let bm = take(input, pos, 32)?;
            let mut count = 0;
            for s in 0..256 {
                if bm[s / 8] >> (s % 8) & 1 == 1 {
                    present[s] = true;
                    count += 1;
                }
            }
            if count != n {
                return Err(CodecError::corrupt(
                    "rans table",
                    format!("presence bitmap has {count} symbols, header says {n}"),
                ));
            }
        }
        let mut freq = [0u32; 256];
        let mut sum: u64 = 0;
        for s in 0..256 {
            if present[s] {
                let f = read_varint(input, pos, "rans table")? as u64 + 1;
                if f > PROB_SCALE as u64 {
                    return Err(CodecError::corrupt(
                        "rans table",
                        format!("frequency {f} > {PROB_SCALE}"),
                    ));
                }
                sum += f;
                freq[s] = f as u32;
            }
        }
        if sum != PROB_SCALE as u64 {
            return Err(CodecError::corrupt(
                "rans table",
                format!("frequencies sum to {sum}, expected {PROB_SCALE}"),
            ));
        }
        Ok(FreqTable::with_freqs(freq))
    }
}

/// Byte histogram of `data`.
/// log2(x) in Q16 fixed point (16 fraction bits, truncated), x >= 1: the integer part, then
/// one fraction bit per squaring of the mantissa. Integer-only, so the CPU and GPU encoders'
/// size estimates (and so their frames) agree exactly; cuda/codec.cu has the same function.
pub fn log2_q16(x: u64) -> u64 {
    debug_assert!(x >= 1);
    let k = 63 - x.leading_zeros();
    let mut m = if k >= 31 {
        x >> (k - 31)
    } else {
        x << (31 - k)
    };
    let mut frac = 0u64;
    for i in 0..16 {
        m = (m * m) >> 31;
        if m >= 1 << 32 {
            frac |= 1 << (15 - i);
            m >>= 1;
        }
    }
    ((k as u64) << 16) | frac
}

pub fn histogram(data: &[u8]) -> [u64; 256] {
    // Four interleaved tables hide the store-to-load latency of repeated symbols.
    let mut h = [[0u32; 256]; 4];
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        h[0][c[0] as usize] += 1;
        h[1][c[1] as usize] += 1;
        h[2][c[2] as usize] += 1;
        h[3][c[3] as usize] += 1;
    }
    for &b in chunks.remainder() {
        h[0][b as usize] += 1;
    }
    let mut out = [0u64; 256];
    for s in 0..256 {
        out[s] = h.iter().map(|t| t[s] as u64).sum();
    }
    out
}

/// Per-symbol encoder constants: the division `x / freq` of the rANS step done as a multiply
/// and shifts (exact for x < 2^31, which the renormalisation guarantees). See `enc_step`.
/// Shared with the Delta frames' coder (`delta.rs`), which renormalises by 16-bit words.
#[derive(Clone, Copy, Default)]
pub(super) struct EncSym {
    /// Renormalise (emit) while x >= x_max.
    pub(super) x_max: u32,
    pub(super) rcp_freq: u32,
    pub(super) rcp_shift: u32,
    pub(super) bias: u32,
    pub(super) cmpl_freq: u32,
    /// The symbol's cumulative frequency.
    pub(super) cum: u32,
}

impl EncSym {
    fn new(freq: u32, cum: u32) -> EncSym {
        EncSym::with_limit(freq, cum, (RANS_L >> PROB_BITS) << 8)
    }

    /// Constants for 12-bit frequencies with `x_max = limit * freq` (`limit` = the lower state
    /// bound / 4096, times the renormalisation radix).
    pub(super) fn with_limit(freq: u32, cum: u32, limit: u32) -> EncSym {
        let x_max = limit * freq;
        let cmpl_freq = PROB_SCALE - freq;
        if freq < 2 {
            // x / 1 = x: rcp = 2^32-1 with shift 0 gives x-1 for x >= 1, and the bias adds
            // the missing M-1 back: x + (cum + M - 1) + (x-1)(M-1) = x*M + cum.
            EncSym {
                x_max,
                rcp_freq: u32::MAX,
                rcp_shift: 0,
                bias: cum + PROB_SCALE - 1,
                cmpl_freq,
                cum,
            }
        } else {
            let shift = 32 - (freq - 1).leading_zeros(); // ceil(log2(freq))
            let rcp = (1u64 << (shift + 31)).div_ceil(freq as u64) as u32;
            EncSym {
                x_max,
                rcp_freq: rcp,
                rcp_shift: shift - 1,
                bias: cum,
                cmpl_freq,
                cum,
            }
        }
    }
}

/// One encoder step without the renormalisation: x' = (x / f) * M + x % f + cum
/// = x + cum + (x / f) * (M - f).
#[inline(always)]
pub(super) fn enc_step(x: u32, e: &EncSym) -> u32 {
    let q = (((x as u64 * e.rcp_freq as u64) >> 32) as u32) >> e.rcp_shift;
    x.wrapping_add(e.bias)
        .wrapping_add(q.wrapping_mul(e.cmpl_freq))
}

/// Encode `data` (non-empty) with `table`, appending to `out`.
pub fn encode(data: &[u8], table: &FreqTable, out: &mut Vec<u8>) {
    table.write(out);
    let mut syms = [EncSym::default(); 256];
    for (s, e) in syms.iter_mut().enumerate() {
        if table.freq[s] > 0 {
            *e = EncSym::new(table.freq[s], table.cum[s]);
        }
    }
    let mut rev: Vec<u8> = Vec::with_capacity(data.len() / 2 + 8);
    let mut x = [RANS_L; 2];
    for (i, &s) in data.iter().enumerate().rev() {
        let st = &mut x[i & 1];
        let e = &syms[s as usize];
        debug_assert!(table.freq[s as usize] > 0, "symbol {s} missing from table");
        while *st >= e.x_max {
            rev.push(*st as u8);
            *st >>= 8;
        }
        *st = enc_step(*st, e);
    }
    out.extend_from_slice(&x[0].to_le_bytes());
    out.extend_from_slice(&x[1].to_le_bytes());
    out.extend(rev.iter().rev());
}

/// Decode exactly `out.len()` symbols from `input`, which must be consumed exactly.
pub fn decode(input: &[u8], out: &mut [u8]) -> Result<()> {
    let mut pos = 0;
    let table = FreqTable::read(input, &mut pos)?;
    let mut slot_sym = vec![0u8; PROB_SCALE as usize];
    for s in 0..256 {
        let (c, f) = (table.cum[s] as usize, table.freq[s] as usize);
        slot_sym[c..c + f].fill(s as u8);
    }
    let st = take(input, &mut pos, 8)?;
    let mut x = [
        u32::from_le_bytes([st[0], st[1], st[2], st[3]]),
        u32::from_le_bytes([st[4], st[5], st[6], st[7]]),
    ];
    for s in x {
        if s < RANS_L || (s as u64) >= (RANS_L as u64) << 8 {
            return Err(CodecError::corrupt(
                "rans stream",
                format!("initial state {s:#x} out of range"),
            ));
        }
    }
    let bytes = &input[pos..];
    let mut bi = 0usize;
    let ends_early = || CodecError::corrupt("rans stream", "ends before all symbols are decoded");
    let step = |x: &mut u32, o: &mut u8, bi: &mut usize| -> Result<()> {
        let slot = *x & (PROB_SCALE - 1);
        let s = slot_sym[slot as usize];
        *o = s;
        let f = table.freq[s as usize];
        // f * (x >> 12) + slot - cum < 2^32 because slot - cum < f and x < 2^32.
        let mut nx = f * (*x >> PROB_BITS) + slot - table.cum[s as usize];
        while nx < RANS_L {
            let &b = bytes.get(*bi).ok_or_else(ends_early)?;
            *bi += 1;
            nx = (nx << 8) | b as u32;
        }
        *x = nx;
        Ok(())
    };
    let mut pairs = out.chunks_exact_mut(2);
    for p in &mut pairs {
        let [a, b] = p else { unreachable!() };
        let [x0, x1] = &mut x;
        step(x0, a, &mut bi)?;
        step(x1, b, &mut bi)?;
    }
    if let [o] = pairs.into_remainder() {
        step(&mut x[0], o, &mut bi)?;
    }
    if bi != bytes.len() {
        return Err(CodecError::corrupt(
            "rans stream",
            format!("{} trailing bytes after the last symbol", bytes.len() - bi),
        ));
    }
    if x != [RANS_L; 2] {
        return Err(CodecError::corrupt(
            "rans stream",
            format!("final states {x:#x?} != {RANS_L:#x}"),
        ));
    }
    Ok(())
}

/// LEB128, as the rANS tables and the Delta tables write their frequencies.
pub(super) fn write_varint(out: &mut Vec<u8>, mut v: u32) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A LEB128 varint of at most 3 bytes at `pos` (errors name `what`: the table it is in).
pub(super) fn read_varint(input: &[u8], pos: &mut usize, what: &'static str) -> Result<u32> {
    let mut v: u32 = 0;
    for shift in [0u32, 7, 14] {
        let b = *input.get(*pos).ok_or_else(|| {
            CodecError::corrupt(what, format!("ends inside a varint at offset {pos}"))
        })?;
        *pos += 1;
        v |= ((b & 0x7f) as u32) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(CodecError::corrupt(what, "varint longer than 3 bytes"))
}

fn take<'a>(input: &'a [u8], pos: &mut usize, n: usize) -> Result<&'a [u8]> {
    let end = pos
        .checked_add(n)
        .filter(|&e| e <= input.len())
        .ok_or_else(|| {
            CodecError::corrupt(
                "rans block",
                format!("needs {n} bytes at offset {pos}, has {}", input.len()),
            )
        })?;
    let s = &input[*pos..end];
    *pos = end;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(data: &[u8]) -> Vec<u8> {
        let t = FreqTable::from_histogram(&histogram(data));
        let mut enc = Vec::new();
        encode(data, &t, &mut enc);
        let mut dec = vec![0u8; data.len()];
        decode(&enc, &mut dec).unwrap();
        assert_eq!(dec, data);
        enc
    }

    /// The reciprocal step equals the division step for every frequency and many states.
    #[test]
    fn reciprocal_matches_division() {
        let mut s = 1u64;
        for f in 1..=PROB_SCALE {
            let cum = (PROB_SCALE - f) / 2;
            let e = EncSym::new(f, cum);
            // After renormalisation the encoder's state is in [x_max / 256, x_max).
            let (lo, hi) = (e.x_max >> 8, e.x_max);
            for k in 0..200u32 {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let x = match k {
                    0 => lo,
                    1 => hi - 1,
                    _ => lo + ((s >> 33) as u32) % (hi - lo),
                };
                let want = ((x / f) << PROB_BITS) + (x % f) + cum;
                assert_eq!(enc_step(x, &e), want, "f={f} x={x}");
            }
        }
    }

    #[test]
    fn roundtrips() {
        roundtrip(&[7]);
        roundtrip(&[0; 1000]);
        roundtrip(&(0..=255).collect::<Vec<u8>>());
        let skew: Vec<u8> = (0..100_000u32)
            .map(|i| if i % 17 == 0 { (i % 251) as u8 } else { 0 })
            .collect();
        let enc = roundtrip(&skew);
        assert!(
            enc.len() < skew.len() / 4,
            "skewed data should compress: {}",
            enc.len()
        );
    }

    #[test]
    fn near_entropy() {
        // Bernoulli(0.1) bits packed in bytes: entropy 0.469 bits per bit.
        let mut s: u64 = 12345;
        let data: Vec<u8> = (0..200_000)
            .map(|_| {
                let mut b = 0u8;
                for i in 0..8 {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    if (s >> 33).is_multiple_of(10) {
                        b |= 1 << i;
                    }
                }
                b
            })
            .collect();
        let enc = roundtrip(&data);
        let bits_per_bit = enc.len() as f64 * 8.0 / (data.len() as f64 * 8.0);
        assert!(bits_per_bit < 0.469 * 1.03, "{bits_per_bit}");
    }

    #[test]
    fn corrupt_is_error() {
        let data: Vec<u8> = (0..5000u32).map(|i| (i * i % 7) as u8).collect();
        let t = FreqTable::from_histogram(&histogram(&data));
        let mut enc = Vec::new();
        encode(&data, &t, &mut enc);
        let mut out = vec![0u8; data.len()];
        assert!(decode(&enc[..enc.len() - 1], &mut out).is_err());
        let mut longer = enc.clone();
        longer.push(0);
        assert!(decode(&longer, &mut out).is_err());
        for i in 0..enc.len() {
            let mut bad = enc.clone();
            bad[i] ^= 0x5a;
            // Must not panic; may decode to something else only if the stream stays consistent.
            let _ = decode(&bad, &mut out);
        }
    }
}
