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
pub(super) const RANS_L: u32 = 1 << 23;

/// Normalised frequencies of the 256 byte values; present symbols have freq >= 1.
#[derive(Clone)]
pub struct FreqTable {
    freq: [u32; 256],
    cum: [u32; 256],
}

impl FreqTable {
    /// The frequency of each byte value (summing to `PROB_SCALE`; 0 for absent ones).
    pub fn freqs(&self) -> &[u32; 256] {
        &self.freq
    }

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

    /// The decoder's slots packed in one word each, for vector decoders that look them up
    /// with one gather: `sym << 24 | (freq - 1) << 12 | (slot - cum)`.
    pub(super) fn packed_slots(&self) -> Vec<u32> {
        let mut t = vec![0u32; PROB_SCALE as usize];
        for s in 0..256 {
            let (c, f) = (self.cum[s] as usize, self.freq[s]);
            for r in 0..f as usize {
                t[c + r] = (s as u32) << 24 | (f - 1) << 12 | r as u32;
            }
        }
        t
    }

    /// The encoder's constants of each symbol (absent ones left zero).
    pub(super) fn enc_syms(&self) -> [EncSym; 256] {
        let mut syms = [EncSym::default(); 256];
        for (s, e) in syms.iter_mut().enumerate() {
            if self.freq[s] > 0 {
                *e = EncSym::new(self.freq[s], self.cum[s]);
            }
        }
        syms
    }

    /// Estimated coded size in bytes of data with this histogram (table + state + payload).
    pub fn estimate_bytes(&self, hist: &[u64; 256]) -> usize {
        // Integer arithmetic (Q16 code lengths), so a GPU encoder (cuda/codec.cu) makes the
        // same choices bit for bit.
        self.payload_q16(hist).div_ceil(8 << 16) as usize + self.table_bytes() + 8
    }

    /// `estimate_bytes` of `n` bytes of which `hist` counts a sample (not all zero): the
    /// sample's payload scaled to `n` bytes (its Q16 bits a byte, rounded down, times `n`),
    /// one table. The same arithmetic in cuda/codec.cu.
    pub fn estimate_scaled(&self, hist: &[u64; 256], n: usize) -> usize {
        let seen: u64 = hist.iter().sum();
        (self.payload_q16(hist) / seen * n as u64).div_ceil(8 << 16) as usize
            + self.table_bytes()
            + 8
    }

    /// The payload of data with this histogram, in bits << 16.
    fn payload_q16(&self, hist: &[u64; 256]) -> u64 {
        let mut bits: u64 = 0;
        for (s, &h) in hist.iter().enumerate() {
            if h > 0 {
                bits += h * ((12 << 16) - log2_q16(self.freq[s] as u64));
            }
        }
        bits
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

    pub(super) fn write(&self, out: &mut Vec<u8>) {
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

    pub(super) fn read(input: &[u8], pos: &mut usize) -> Result<FreqTable> {
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

/// Byte histogram of `data`.
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

/// Code a symbol (its constants `e`) with state `x`, returning the new state: renormalise
/// (emit 0-2 bytes backwards before `*p`, which moves down by as many), then `enc_step`. Always
/// writes the two bytes before `*p` (the second is overwritten by the next step when not
/// taken), without branches.
#[inline(always)]
pub(super) fn put(buf: &mut [u8], p: &mut usize, x: u32, e: &EncSym) -> u32 {
    let one = x >= e.x_max;
    let two = (x as u64) >= (e.x_max as u64) << 8;
    buf[*p - 1] = x as u8;
    buf[*p - 2] = (x >> 8) as u8;
    let n = one as u32 + two as u32;
    *p -= n as usize;
    enc_step(x >> (8 * n), e)
}

/// Encode `data` (non-empty) with `table`, appending to `out`.
pub fn encode(data: &[u8], table: &FreqTable, out: &mut Vec<u8>) {
    ENC_BUF.with(|c| {
        let mut e = EncStream::new(data, table, c.take());
        let mut l = e.lane;
        while l.i >= 2 {
            e.step2(&mut l);
        }
        e.lane = l;
        c.replace(e.finish(table, out));
    });
}

thread_local! {
    /// The encoder's byte buffer, reused call after call (fresh ones would page-fault in).
    static ENC_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The moving part of an encoder, held in registers by the loops (a copy, written back).
#[derive(Clone, Copy)]
struct EncLane {
    x0: u32,
    x1: u32,
    /// Next byte goes at `p - 1`.
    p: usize,
    /// Symbols `data[..i]` are still to code; `i` is even after `EncStream::new`.
    i: usize,
}

/// One block being encoded. The symbols are coded backwards; their renormalisation bytes are
/// written backwards from the end of `buf`, so that they lie in decoding order with no
/// reversal. A step emits at most two bytes (x < 2^31 and x_max >= 2^19) and always writes two
/// (the second is overwritten by the next step when not taken): two bytes of slack at the front.
struct EncStream<'a> {
    data: &'a [u8],
    syms: [EncSym; 256],
    buf: Vec<u8>,
    /// The stream is `buf[lane.p..end]`.
    end: usize,
    lane: EncLane,
}

impl<'a> EncStream<'a> {
    fn new(data: &'a [u8], table: &FreqTable, mut buf: Vec<u8>) -> EncStream<'a> {
        let syms = table.enc_syms();
        let end = 2 * data.len() + 2;
        if buf.len() < end {
            buf.resize(end, 0);
        }
        let mut e = EncStream {
            data,
            syms,
            buf,
            end,
            lane: EncLane {
                x0: RANS_L,
                x1: RANS_L,
                p: end,
                i: data.len(),
            },
        };
        if data.len() % 2 == 1 {
            // The last symbol has an even index: state 0.
            let mut l = e.lane;
            l.x0 = e.put(&mut l.p, l.x0, data[data.len() - 1]);
            l.i -= 1;
            e.lane = l;
        }
        e
    }

    /// Code symbol `s` with state `x`, returning the new state.
    #[inline(always)]
    fn put(&mut self, p: &mut usize, x: u32, s: u8) -> u32 {
        let e = &self.syms[s as usize];
        debug_assert!(e.x_max > 0, "symbol {s} missing from table");
        put(&mut self.buf, p, x, e)
    }

    /// Code the two symbols before `l.i` (states 1 then 0, as the decoder reads them
    /// backwards).
    #[inline(always)]
    fn step2(&mut self, l: &mut EncLane) {
        let (s1, s0) = (self.data[l.i - 1], self.data[l.i - 2]);
        l.x1 = self.put(&mut l.p, l.x1, s1);
        l.x0 = self.put(&mut l.p, l.x0, s0);
        l.i -= 2;
    }

    /// Append the block (table, states, bytes) to `out`; returns the buffer for reuse.
    fn finish(self, table: &FreqTable, out: &mut Vec<u8>) -> Vec<u8> {
        table.write(out);
        out.extend_from_slice(&self.lane.x0.to_le_bytes());
        out.extend_from_slice(&self.lane.x1.to_le_bytes());
        out.extend_from_slice(&self.buf[self.lane.p..self.end]);
        self.buf
    }
}

/// Decode exactly `out.len()` symbols from `input`, which must be consumed exactly.
pub fn decode(input: &[u8], out: &mut [u8]) -> Result<()> {
    let mut d = DecStream::new(input, out)?;
    d.bulk();
    d.finish()
}

/// `decode` of two blocks at once, with the same results: the two blocks' dependency chains
/// interleave, four states in flight instead of two.
pub fn decode_pair(
    in_a: &[u8],
    out_a: &mut [u8],
    in_b: &[u8],
    out_b: &mut [u8],
) -> (Result<()>, Result<()>) {
    let (mut da, mut db) = match (DecStream::new(in_a, out_a), DecStream::new(in_b, out_b)) {
        (Ok(a), Ok(b)) => (a, b),
        (a, b) => {
            // A header error: decode each on its own (no time to save).
            let ra = a.and_then(|mut d| {
                d.bulk();
                d.finish()
            });
            let rb = b.and_then(|mut d| {
                d.bulk();
                d.finish()
            });
            return (ra, rb);
        }
    };
    loop {
        let m = da.safe_pairs().min(db.safe_pairs());
        if m == 0 {
            break;
        }
        let (mut la, mut lb) = (da.lane, db.lane);
        for _ in 0..m {
            da.step2(&mut la);
            db.step2(&mut lb);
        }
        (da.lane, db.lane) = (la, lb);
    }
    da.bulk();
    db.bulk();
    (da.finish(), db.finish())
}

/// The moving part of a decoder, held in registers by the loops (a copy, written back).
#[derive(Clone, Copy)]
struct DecLane {
    x0: u32,
    x1: u32,
    /// Next renormalisation byte.
    bi: usize,
    /// Next symbol.
    i: usize,
}

/// Per slot of the 4096: freq << 12 | (slot - cum), and the symbol.
pub(super) struct DecTable {
    fb: [u32; PROB_SCALE as usize],
    sym: [u8; PROB_SCALE as usize],
}

impl DecTable {
    pub(super) fn new(table: &FreqTable) -> Box<DecTable> {
        let mut t = Box::new(DecTable {
            fb: [0; PROB_SCALE as usize],
            sym: [0; PROB_SCALE as usize],
        });
        for s in 0..256 {
            let (c, f) = (table.cum[s] as usize, table.freq[s]);
            for r in 0..f as usize {
                t.fb[c + r] = f << 12 | r as u32;
                t.sym[c + r] = s as u8;
            }
        }
        t
    }

    /// One decoder step of state `x` (in [2^23, 2^31)): the symbol, and the state before
    /// renormalisation (at least 2^11, so it takes at most two bytes).
    #[inline(always)]
    pub(super) fn step(&self, x: u32) -> (u32, u8) {
        let slot = (x & (PROB_SCALE - 1)) as usize;
        let e = self.fb[slot];
        ((e >> 12) * (x >> PROB_BITS) + (e & 0xfff), self.sym[slot])
    }

    /// `step`, then the renormalisation from `bytes[*bi..]` without branches: the caller
    /// knows two more bytes are there (it reads two whatever it takes).
    #[inline(always)]
    pub(super) fn get(&self, x: u32, bytes: &[u8], bi: &mut usize) -> (u32, u8) {
        let (nx, sym) = self.step(x);
        let b = (bytes[*bi] as u32) << 8 | bytes[*bi + 1] as u32;
        // Shifts by the count rather than a choice of three: compilers turn that into
        // branches, which mispredict at mid densities.
        let n = (nx < RANS_L) as u32 + (nx < 1 << 15) as u32;
        *bi += n as usize;
        (
            ((nx as u64) << (8 * n) | (b as u64) >> (16 - 8 * n)) as u32,
            sym,
        )
    }
}

/// One block being decoded.
struct DecStream<'a, 'o> {
    table: Box<DecTable>,
    bytes: &'a [u8],
    out: &'o mut [u8],
    lane: DecLane,
}

impl<'a, 'o> DecStream<'a, 'o> {
    fn new(input: &'a [u8], out: &'o mut [u8]) -> Result<DecStream<'a, 'o>> {
        let mut pos = 0;
        let table = FreqTable::read(input, &mut pos)?;
        let t = DecTable::new(&table);
        let st = take(input, &mut pos, 8)?;
        let x = [
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
        Ok(DecStream {
            table: t,
            bytes: &input[pos..],
            out,
            lane: DecLane {
                x0: x[0],
                x1: x[1],
                bi: 0,
                i: 0,
            },
        })
    }

    /// One step of a state (`DecTable::get`; the caller knows two more bytes are there).
    #[inline(always)]
    fn get(&self, x: u32, bi: &mut usize) -> (u32, u8) {
        self.table.get(x, self.bytes, bi)
    }

    /// How many `step2` can run with no checks: symbols left, and at most four renormalisation
    /// bytes per `step2` (it reads at most one byte past those it takes).
    fn safe_pairs(&self) -> usize {
        let l = &self.lane;
        ((self.out.len() - l.i) / 2).min((self.bytes.len() - l.bi) / 4)
    }

    /// Decode the next two symbols (states 0 then 1).
    #[inline(always)]
    fn step2(&mut self, l: &mut DecLane) {
        let (x0, s0) = self.get(l.x0, &mut l.bi);
        let (x1, s1) = self.get(l.x1, &mut l.bi);
        self.out[l.i] = s0;
        self.out[l.i + 1] = s1;
        (l.x0, l.x1) = (x0, x1);
        l.i += 2;
    }

    fn bulk(&mut self) {
        loop {
            let m = self.safe_pairs();
            if m == 0 {
                break;
            }
            let mut l = self.lane;
            for _ in 0..m {
                self.step2(&mut l);
            }
            self.lane = l;
        }
    }

    /// The rest, checking for the end of the stream, then the end conditions.
    fn finish(mut self) -> Result<()> {
        let ends_early =
            || CodecError::corrupt("rans stream", "ends before all symbols are decoded");
        let mut l = self.lane;
        while l.i < self.out.len() {
            let x = if l.i & 1 == 0 { l.x0 } else { l.x1 };
            let (mut nx, sym) = self.table.step(x);
            self.out[l.i] = sym;
            while nx < RANS_L {
                let &b = self.bytes.get(l.bi).ok_or_else(ends_early)?;
                l.bi += 1;
                nx = (nx << 8) | b as u32;
            }
            if l.i & 1 == 0 {
                l.x0 = nx;
            } else {
                l.x1 = nx;
            }
            l.i += 1;
        }
        self.lane = l;
        if l.bi != self.bytes.len() {
            return Err(CodecError::corrupt(
                "rans stream",
                format!(
                    "{} trailing bytes after the last symbol",
                    self.bytes.len() - l.bi
                ),
            ));
        }
        let x = [l.x0, l.x1];
        if x != [RANS_L; 2] {
            return Err(CodecError::corrupt(
                "rans stream",
                format!("final states {x:#x?} != {RANS_L:#x}"),
            ));
        }
        Ok(())
    }
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

pub(super) fn take<'a>(input: &'a [u8], pos: &mut usize, n: usize) -> Result<&'a [u8]> {
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
mod reference {
    use super::*;

    /// The straightforward encoder (one symbol at a time, bytes reversed at the end): the
    /// reference the fast one must match byte for byte.
    /// (non-empty) with `table`, appending to `out`.
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

    /// The straightforward decoder, the reference for acceptance and errors.
    /// `out.len()` symbols from `input`, which must be consumed exactly.
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
        let ends_early =
            || CodecError::corrupt("rans stream", "ends before all symbols are decoded");
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

    /// The encoder matches the reference byte for byte, and the decoder accepts and refuses
    /// exactly what the reference does (same symbols, same errors), also on corrupted blocks.
    #[test]
    fn fast_matches_reference() {
        let mut s: u64 = 5;
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            s >> 33
        };
        for len in [1usize, 2, 3, 4, 5, 7, 16, 100, 1001, 20_000] {
            for skew in [0u64, 1, 3, 8, 40] {
                let data: Vec<u8> = (0..len)
                    .map(|_| match skew {
                        0 => next() as u8,
                        40 => 0xff ^ (next() % 1000 == 0) as u8,
                        k => (next() % (k * k + 1)) as u8 & (next() as u8 | 0xf0),
                    })
                    .collect();
                let t = FreqTable::from_histogram(&histogram(&data));
                let (mut a, mut b) = (vec![1u8], vec![1u8]);
                encode(&data, &t, &mut a);
                reference::encode(&data, &t, &mut b);
                assert_eq!(a, b, "len {len} skew {skew}");
                let enc = &a[1..];
                let same = |inp: &[u8], n: usize| {
                    let (mut o1, mut o2) = (vec![0u8; n], vec![0u8; n]);
                    let r1 = decode(inp, &mut o1).map_err(|e| e.to_string());
                    let r2 = reference::decode(inp, &mut o2).map_err(|e| e.to_string());
                    assert_eq!(r1, r2, "len {len} skew {skew}");
                    if r1.is_ok() {
                        assert_eq!(o1, o2);
                    }
                };
                same(enc, len);
                // The pair decoder gives each block what the single one does.
                let other: Vec<u8> = data.iter().rev().map(|&x| x ^ 0x0f).collect();
                let to = FreqTable::from_histogram(&histogram(&other));
                let mut single = vec![2u8];
                encode(&other, &to, &mut single);
                let (mut oa, mut ob) = (vec![0u8; len], vec![0u8; len]);
                let (ra, rb) = decode_pair(enc, &mut oa, &single[1..], &mut ob);
                assert!(ra.is_ok() && rb.is_ok() && oa == data && ob == other);
                let mut bad = single[1..].to_vec();
                let last = bad.len() - 1;
                bad[last] ^= 0x40;
                let (ra, rb) = decode_pair(enc, &mut oa, &bad, &mut ob);
                let mut o = vec![0u8; len];
                assert_eq!(
                    (ra.map_err(|e| e.to_string()), rb.map_err(|e| e.to_string())),
                    (Ok(()), decode(&bad, &mut o).map_err(|e| e.to_string()))
                );
                same(enc, len + 1);
                same(enc, len - 1);
                same(&enc[..enc.len() - 1], len);
                for _ in 0..20 {
                    let mut bad = enc.to_vec();
                    let i = next() as usize % bad.len();
                    bad[i] ^= 1 << (next() % 8);
                    same(&bad, len);
                }
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
