//! Segmented order-0 rANS (mask coding 4; docs/WIRE.md, "Segmented rANS block").
//!
//! The bytes are cut in segments of [`SEG_BYTES`], each coded by one state of its own with its
//! own byte stream, all under one frequency table (`rans::FreqTable`, the step of `rans.rs`):
//!
//! ```text
//! table   : as in rans.rs
//! states  : S u32, segment j's final encoder state (L <= x < L*256), S = ceil(n / SEG_BYTES)
//! lengths : S u16, the bytes of segment j's stream
//! streams : segment 0's renormalisation bytes in decoding order, then segment 1's, ...
//! ```
//! The two-state block of `rans.rs` is two dependency chains however long the data: a mask
//! decoded at 4-6 ns a byte and encoded at 4-5 on one core, the largest share of a Hybrid
//! frame's codec time after its values. Segments are independent chains: with AVX2 the coder
//! here encodes eight of them in lockstep, one per vector lane (symbol constants by gathers,
//! the division by a reciprocal), and decodes eight or sixteen (a gather of a packed table and
//! one of the stream bytes per step); a GPU gives each a thread. Measured on one core, a
//! 4.2 MB mask of 65% set bits, quiet machine: decode 1.2 ns a byte against 3.6-3.8 for the
//! two-state block, encode 1.7-2.3 against 2.9-3.6. Without AVX2, two segments in lockstep
//! code about as fast as the two-state block. Segments cost 6 bytes each (0.15% of a dense mask).
//! Decoding checks what `rans::decode` checks, per segment; no input makes it panic.

use super::error::{CodecError, Result};
use super::rans::{self, DecTable, EncSym, FreqTable, RANS_L};

/// Bytes of data per segment (the last one may be shorter). A segment emits at most two bytes
/// a symbol, so its stream's length fits the u16 it is sent as.
pub const SEG_BYTES: usize = 4096;
const _: () = assert!(2 * SEG_BYTES <= u16::MAX as usize);

/// Segments the vector encoder codes in lockstep (one AVX2 vector of states). Two vectors
/// interleaved measured slower (2.8-3.8 against 1.7-2.3 ns a byte: the lanes' byte writes
/// are scalar); the decoder, all vector, takes two (1.2 against 2.15 ns a byte).
const BATCH: usize = 8;

/// Segments of `n` bytes of data.
pub fn segments(n: usize) -> usize {
    n.div_ceil(SEG_BYTES)
}

/// Estimated coded size in bytes (table, states, lengths and streams) of data with histogram
/// `hist` under `table`: `FreqTable::estimate_bytes` with 6 bytes a segment in place of its
/// two states. Integer arithmetic, as the GPU encoder's (cuda/codec.cu) must agree exactly.
pub fn estimate_bytes(table: &FreqTable, hist: &[u64; 256]) -> usize {
    let n: u64 = hist.iter().sum();
    table.estimate_bytes(hist) - 8 + 6 * segments(n as usize)
}

/// `estimate_bytes` of `n` bytes of which `hist` counts a sample (`FreqTable::estimate_scaled`).
pub fn estimate_scaled(table: &FreqTable, hist: &[u64; 256], n: usize) -> usize {
    table.estimate_scaled(hist, n) - 8 + 6 * segments(n)
}

/// Room for one segment's stream, written backwards: two bytes a symbol, and the two bytes
/// `rans::put` may write below what it keeps.
const REGION: usize = 2 * SEG_BYTES + 2;

thread_local! {
    /// The encoder's stream regions, reused call after call.
    static ENC_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Encode `data` (non-empty, every byte in `table`) with `table`, appending the block to `out`.
pub fn encode(data: &[u8], table: &FreqTable, out: &mut Vec<u8>) {
    encode_with(data, table, out, vector::on());
}

/// `encode`, with the vector encoder or without (tests run both).
fn encode_with(data: &[u8], table: &FreqTable, out: &mut Vec<u8>, vector: bool) {
    let syms = table.enc_syms();
    let nseg = segments(data.len());
    let vt = (vector && data.len() >= BATCH * SEG_BYTES).then(|| vector::enc_tables(&syms));
    ENC_BUF.with(|c| {
        let mut buf = c.take();
        if buf.len() < nseg * REGION {
            buf.resize(nseg * REGION, 0);
        }
        // Per segment: its final state, and where its stream starts in its region.
        let mut ends = vec![(RANS_L, 0usize); nseg];
        let whole = data.len() / SEG_BYTES;
        let mut j = 0;
        while j < nseg {
            // Whole segments: eight per vector where it runs, else two in lockstep (more
            // scalar chains measured slower: 7.5 ns a byte for eight, 5.7 for two states);
            // the rest (and the shorter last one) one by one.
            let b = match (&vt, whole.saturating_sub(j)) {
                (Some(_), BATCH..) => BATCH,
                (_, 2..) => 2,
                _ => 1,
            };
            let regions = &mut buf[j * REGION..(j + b) * REGION];
            match (&vt, b) {
                (Some(vt), BATCH) => {
                    let d = &data[j * SEG_BYTES..(j + b) * SEG_BYTES];
                    vector::enc_batch(vt, d, regions, &mut ends[j..j + b]);
                }
                (_, 2) => enc_batch::<2>(data, j, &syms, regions, &mut ends[j..j + b]),
                _ => enc_batch::<1>(data, j, &syms, regions, &mut ends[j..j + b]),
            }
            j += b;
        }
        table.write(out);
        for &(x, _) in &ends {
            out.extend_from_slice(&x.to_le_bytes());
        }
        for &(_, p) in &ends {
            out.extend_from_slice(&((REGION - p) as u16).to_le_bytes());
        }
        for (j, &(_, p)) in ends.iter().enumerate() {
            out.extend_from_slice(&buf[j * REGION + p..(j + 1) * REGION]);
        }
        c.replace(buf);
    });
}

/// The data of segment `j`.
fn segment(data: &[u8], j: usize) -> &[u8] {
    &data[j * SEG_BYTES..((j + 1) * SEG_BYTES).min(data.len())]
}

/// Encode segments `j0..j0+B` into `regions` (one `REGION` each), backwards; `ends` gets each
/// one's final state and the start of its stream in its region. A shorter segment (the last)
/// is alone in a batch of one.
fn enc_batch<const B: usize>(
    data: &[u8],
    j0: usize,
    syms: &[EncSym; 256],
    regions: &mut [u8],
    ends: &mut [(u32, usize)],
) {
    let segs: [&[u8]; B] = std::array::from_fn(|b| segment(data, j0 + b));
    let len = segs[0].len();
    debug_assert!(segs.iter().all(|s| s.len() == len));
    let mut x = [RANS_L; B];
    let mut p: [usize; B] = std::array::from_fn(|b| (b + 1) * REGION);
    for i in (0..len).rev() {
        for b in 0..B {
            x[b] = rans::put(regions, &mut p[b], x[b], &syms[segs[b][i] as usize]);
        }
    }
    for b in 0..B {
        ends[b] = (x[b], p[b] - b * REGION);
    }
}

/// Decode exactly `out.len()` bytes (non-zero) from the block `input`, which must be consumed
/// exactly.
pub fn decode(input: &[u8], out: &mut [u8]) -> Result<()> {
    decode_with(input, out, vector::on())
}

/// `decode`, with the vector decoder or without (tests run both).
fn decode_with(input: &[u8], out: &mut [u8], vector: bool) -> Result<()> {
    let mut pos = 0;
    let table = FreqTable::read(input, &mut pos)?;
    let t = DecTable::new(&table);
    let nseg = segments(out.len());
    let states = rans::take(input, &mut pos, 4 * nseg)?;
    let lens = rans::take(input, &mut pos, 2 * nseg)?;
    let streams = &input[pos..];
    // Where each segment's stream starts (and, at the end, where the last one ends).
    let mut at = Vec::with_capacity(nseg + 1);
    at.push(0usize);
    for l in lens.chunks_exact(2) {
        at.push(at[at.len() - 1] + u16::from_le_bytes([l[0], l[1]]) as usize);
    }
    if at[nseg] != streams.len() {
        return Err(CodecError::corrupt(
            "segmented rans block",
            format!(
                "segment streams of {} bytes in all, {} bytes follow them",
                at[nseg],
                streams.len()
            ),
        ));
    }
    let mut x = Vec::with_capacity(nseg);
    for (j, s) in states.chunks_exact(4).enumerate() {
        let s = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        if s < RANS_L || (s as u64) >= (RANS_L as u64) << 8 {
            return Err(CodecError::corrupt(
                "segmented rans block",
                format!("segment {j}: initial state {s:#x} out of range"),
            ));
        }
        x.push(s);
    }
    // The vector decoder's table, where it will run (eight whole segments or more).
    let packed = if vector && out.len() >= 8 * SEG_BYTES && streams.len() < 1 << 31 {
        table.packed_slots()
    } else {
        Vec::new()
    };
    let whole = out.len() / SEG_BYTES;
    let mut j = 0;
    while j < nseg {
        // Sixteen whole segments at a time (two AVX2 vectors of states), then eight, then one.
        let b = match whole.saturating_sub(j) {
            16.. => 16,
            8..=15 => 8,
            _ => 1,
        };
        let end = ((j + b) * SEG_BYTES).min(out.len());
        let o = &mut out[j * SEG_BYTES..end];
        let (at, x) = (&at[j..=j + b], &x[j..j + b]);
        match b {
            16 => dec_batch::<16>(&t, &packed, streams, at, x, j, o)?,
            8 => dec_batch::<8>(&t, &packed, streams, at, x, j, o)?,
            _ => dec_batch::<1>(&t, &packed, streams, at, x, j, o)?,
        }
        j += b;
    }
    Ok(())
}

/// Decode the `B` segments from `j0` into `o` (`B` whole segments, or one shorter): their
/// streams are `streams[at[b]..at[b + 1]]`, their states `x`. The vector decoder first where
/// `packed` is given (B a multiple of 8); then lockstep while every stream holds the two bytes
/// a step reads; then one by one with checks; then the end conditions.
fn dec_batch<const B: usize>(
    t: &DecTable,
    packed: &[u32],
    streams: &[u8],
    at: &[usize],
    x: &[u32],
    j0: usize,
    o: &mut [u8],
) -> Result<()> {
    let s: [&[u8]; B] = std::array::from_fn(|b| &streams[at[b]..at[b + 1]]);
    let mut x: [u32; B] = std::array::from_fn(|b| x[b]);
    let mut bi = [0usize; B];
    let len = if B == 1 { o.len() } else { SEG_BYTES };
    let mut i = 0;
    if B.is_multiple_of(8) && !packed.is_empty() {
        // Offsets into `streams` (below 2^31, as the caller checked), back to each stream's
        // own after: a damaged stream may have run into the next one's bytes, which the
        // checks below then refuse.
        let mut abs: [u32; B] = std::array::from_fn(|b| at[b] as u32);
        i = vector::lockstep(packed, streams, &mut x, &mut abs, o);
        for b in 0..B {
            bi[b] = abs[b] as usize - at[b];
        }
    }
    loop {
        // A step takes at most two bytes and reads two: m steps are safe with 2m left.
        let m = (0..B).fold(len - i, |m, b| m.min(s[b].len().saturating_sub(bi[b]) / 2));
        if m == 0 {
            break;
        }
        for _ in 0..m {
            for b in 0..B {
                let (nx, sym) = t.get(x[b], s[b], &mut bi[b]);
                o[b * SEG_BYTES + i] = sym;
                x[b] = nx;
            }
            i += 1;
        }
    }
    for b in 0..B {
        let seg = j0 + b;
        let ends_early = || {
            CodecError::corrupt(
                "segmented rans block",
                format!("segment {seg}: stream ends before its symbols do"),
            )
        };
        if bi[b] > s[b].len() {
            // The vector decoder ran on into the next stream's bytes: where this one ended,
            // the scalar decoder would have stopped with this error.
            return Err(ends_early());
        }
        for o in &mut o[b * SEG_BYTES + i..b * SEG_BYTES + len] {
            let (mut nx, sym) = t.step(x[b]);
            *o = sym;
            while nx < RANS_L {
                let &byte = s[b].get(bi[b]).ok_or_else(ends_early)?;
                bi[b] += 1;
                nx = nx << 8 | byte as u32;
            }
            x[b] = nx;
        }
        if bi[b] != s[b].len() {
            return Err(CodecError::corrupt(
                "segmented rans block",
                format!(
                    "segment {seg}: stream of {} bytes, its symbols took {}",
                    s[b].len(),
                    bi[b]
                ),
            ));
        }
        if x[b] != RANS_L {
            return Err(CodecError::corrupt(
                "segmented rans block",
                format!("segment {seg}: final state {:#x} != {RANS_L:#x}", x[b]),
            ));
        }
    }
    Ok(())
}

/// The AVX2 decoder: eight segments' states per vector, one gather of the packed table and
/// one of the stream bytes per step.
#[allow(unsafe_code)] // the call into the AVX2 code; see its SAFETY note
mod vector {
    /// Whether it runs: AVX2 present and SIMD not turned off (`simd::enabled`).
    pub(super) fn on() -> bool {
        super::super::simd::enabled()
    }

    /// The vector encoder's tables: per symbol `bias | freq << 13 | rcp_shift << 27` (13, 13
    /// and 4 bits: bias <= 8190, freq <= 4096, shift <= 11), and its reciprocal.
    pub(super) struct EncTables {
        packed: [u32; 256],
        rcp: [u32; 256],
    }

    pub(super) fn enc_tables(syms: &[super::EncSym; 256]) -> EncTables {
        let mut t = EncTables {
            packed: [0; 256],
            rcp: [0; 256],
        };
        for (s, e) in syms.iter().enumerate() {
            let freq = 4096 - e.cmpl_freq;
            if e.x_max > 0 {
                t.packed[s] = e.bias | freq << 13 | e.rcp_shift << 27;
                t.rcp[s] = e.rcp_freq;
            }
        }
        t
    }

    /// `super::enc_batch` of the eight whole segments `data` into `regions`, with AVX2.
    pub(super) fn enc_batch(
        t: &EncTables,
        data: &[u8],
        regions: &mut [u8],
        ends: &mut [(u32, usize)],
    ) {
        use super::{BATCH, REGION, SEG_BYTES};
        assert!(data.len() == BATCH * SEG_BYTES && regions.len() == BATCH * REGION);
        let mut x = [super::RANS_L; BATCH];
        let mut p: [u32; BATCH] = std::array::from_fn(|b| ((b + 1) * REGION) as u32);
        #[cfg(target_arch = "x86_64")]
        if on() {
            // SAFETY: AVX2 is present (`on`); the lengths are checked above.
            unsafe { avx2::enc_steps(t, data, regions, &mut x, &mut p) };
        }
        for b in 0..BATCH {
            ends[b] = (x[b], p[b] as usize - b * REGION);
        }
    }

    /// Decode whole steps of the `B` (8 or 16) whole segments in `o`, four at a time, while
    /// every read stays inside `streams`; returns the steps taken. `x` and `abs` (offsets into
    /// `streams`) move on as the scalar decoder's would.
    pub(super) fn lockstep<const B: usize>(
        packed: &[u32],
        streams: &[u8],
        x: &mut [u32; B],
        abs: &mut [u32; B],
        o: &mut [u8],
    ) -> usize {
        assert!(B == 8 || B == 16, "lanes in whole vectors");
        assert!(packed.len() == 4096 && o.len() == B * super::SEG_BYTES);
        assert!(streams.len() < 1 << 31);
        #[cfg(target_arch = "x86_64")]
        if on() {
            // SAFETY: AVX2 is present (`on`); the rest is `steps`'s contract, checked above.
            return unsafe { avx2::steps(packed, streams, x, abs, o) };
        }
        0
    }

    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)] // the AVX2 intrinsics and gathers; each block says why it is sound
    mod avx2 {
        use super::super::{BATCH, RANS_L, SEG_BYTES};
        use super::EncTables;
        use std::arch::x86_64::*;

        /// Code the eight whole segments `data` backwards, lane b into region b of `regions`
        /// from `p[b]` down, states `x`: per step `rans::put` of every lane, its symbol's
        /// constants by gathers, the division by a reciprocal (`rans::enc_step`), the two
        /// bytes below each lane's cursor written from the lanes one by one. Contract: AVX2
        /// present, `data` 8 segments, `regions` 8 regions with `p` at their ends.
        #[target_feature(enable = "avx2")]
        pub(super) unsafe fn enc_steps(
            t: &EncTables,
            data: &[u8],
            regions: &mut [u8],
            x: &mut [u32; BATCH],
            p: &mut [u32; BATCH],
        ) {
            let seg = SEG_BYTES as i32;
            let offs =
                _mm256_setr_epi32(0, seg, 2 * seg, 3 * seg, 4 * seg, 5 * seg, 6 * seg, 7 * seg);
            // SAFETY: 8-lane arrays, 32 bytes each.
            let (mut xv, mut pv) = unsafe {
                (
                    _mm256_loadu_si256(x.as_ptr() as *const __m256i),
                    _mm256_loadu_si256(p.as_ptr() as *const __m256i),
                )
            };
            let m13 = _mm256_set1_epi32(0x1fff);
            let byte = _mm256_set1_epi32(0xff);
            let scale = _mm256_set1_epi32(4096);
            let (mut xs, mut ps) = ([0u32; BATCH], [0u32; BATCH]);
            let mut i = SEG_BYTES;
            while i >= 4 {
                i -= 4;
                // SAFETY: lane b reads bytes b * SEG_BYTES + i .. + 4 of `data` (8 segments).
                let w = unsafe {
                    _mm256_i32gather_epi32::<1>(
                        data.as_ptr() as *const i32,
                        _mm256_add_epi32(offs, _mm256_set1_epi32(i as i32)),
                    )
                };
                // Symbols i + 3 down to i: coded backwards.
                for k in (0..4).rev() {
                    let s = _mm256_and_si256(_mm256_srlv_epi32(w, _mm256_set1_epi32(8 * k)), byte);
                    // SAFETY: s < 256, the tables' length.
                    let (a, r) = unsafe {
                        (
                            _mm256_i32gather_epi32::<4>(t.packed.as_ptr() as *const i32, s),
                            _mm256_i32gather_epi32::<4>(t.rcp.as_ptr() as *const i32, s),
                        )
                    };
                    let freq = _mm256_and_si256(_mm256_srli_epi32::<13>(a), m13);
                    let x_max = _mm256_slli_epi32::<19>(freq);
                    // n = (x >= x_max) + (x >= 256 x_max) bytes out, unsigned compares.
                    let one = _mm256_cmpeq_epi32(_mm256_max_epu32(xv, x_max), xv);
                    let x8 = _mm256_srli_epi32::<8>(xv);
                    let two = _mm256_cmpeq_epi32(_mm256_max_epu32(x8, x_max), x8);
                    let n = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_add_epi32(one, two));
                    // SAFETY: 8-lane arrays, 32 bytes each.
                    unsafe {
                        _mm256_storeu_si256(xs.as_mut_ptr() as *mut __m256i, xv);
                        _mm256_storeu_si256(ps.as_mut_ptr() as *mut __m256i, pv);
                    }
                    for (&xb, &pb) in xs.iter().zip(&ps) {
                        let pb = pb as usize;
                        regions[pb - 1] = xb as u8;
                        regions[pb - 2] = (xb >> 8) as u8;
                    }
                    pv = _mm256_sub_epi32(pv, n);
                    let xr = _mm256_srlv_epi32(xv, _mm256_slli_epi32::<3>(n));
                    // q = (xr * rcp) >> 32 >> shift: even lanes, then odd lanes.
                    let even = _mm256_srli_epi64::<32>(_mm256_mul_epu32(xr, r));
                    let odd =
                        _mm256_mul_epu32(_mm256_srli_epi64::<32>(xr), _mm256_srli_epi64::<32>(r));
                    let hi = _mm256_blend_epi32::<0b1010_1010>(even, odd);
                    let q = _mm256_srlv_epi32(hi, _mm256_srli_epi32::<27>(a));
                    let bias = _mm256_and_si256(a, m13);
                    xv = _mm256_add_epi32(
                        _mm256_add_epi32(xr, bias),
                        _mm256_mullo_epi32(q, _mm256_sub_epi32(scale, freq)),
                    );
                }
            }
            // SAFETY: 8-lane arrays, 32 bytes each.
            unsafe {
                _mm256_storeu_si256(x.as_mut_ptr() as *mut __m256i, xv);
                _mm256_storeu_si256(p.as_mut_ptr() as *mut __m256i, pv);
            }
        }

        /// See `lockstep`. Contract: AVX2 present, `packed` 4096 entries, `o` B whole segments,
        /// `streams` under 2^31 bytes.
        #[target_feature(enable = "avx2")]
        pub(super) unsafe fn steps<const B: usize>(
            packed: &[u32],
            streams: &[u8],
            x: &mut [u32; B],
            abs: &mut [u32; B],
            o: &mut [u8],
        ) -> usize {
            const G_MAX: usize = 2;
            let g = B / 8;
            let load = |a: &[u32; B], k: usize| {
                // SAFETY: lanes 8k..8k+8 of a B-lane array, k < B / 8.
                unsafe { _mm256_loadu_si256(a.as_ptr().add(8 * k) as *const __m256i) }
            };
            let mut xv = [_mm256_setzero_si256(); G_MAX];
            let mut bv = [_mm256_setzero_si256(); G_MAX];
            for k in 0..g {
                xv[k] = load(x, k);
                bv[k] = load(abs, k);
            }
            let lo12 = _mm256_set1_epi32(0xfff);
            let top = _mm256_set1_epi32(0xff00_0000u32 as i32);
            let one = _mm256_set1_epi32(1);
            let l = _mm256_set1_epi32(RANS_L as i32);
            let l15 = _mm256_set1_epi32(1 << 15);
            let byte = _mm256_set1_epi32(0xff);
            let sixteen = _mm256_set1_epi32(16);
            let mut i = 0;
            let mut lanes = [0u32; 16];
            while i + 4 <= SEG_BYTES {
                // Four steps take at most 8 bytes a lane and read 2 past: stop where any lane
                // could read past the streams (the scalar decoder finishes with checks).
                let hi = bv[1..g].iter().fold(bv[0], |h, &b| _mm256_max_epu32(h, b));
                // SAFETY: a 32-byte store into a 64-byte array.
                unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, hi) };
                let most = lanes[..8].iter().copied().max().unwrap_or(0) as usize;
                if most + 12 > streams.len() {
                    break;
                }
                let mut acc = [_mm256_setzero_si256(); G_MAX];
                for _ in 0..4 {
                    for k in 0..g {
                        let xk = xv[k];
                        let slot = _mm256_and_si256(xk, lo12);
                        // SAFETY: slot < 4096 = packed.len().
                        let e = unsafe {
                            _mm256_i32gather_epi32::<4>(packed.as_ptr() as *const i32, slot)
                        };
                        let f = _mm256_add_epi32(
                            _mm256_and_si256(_mm256_srli_epi32::<12>(e), lo12),
                            one,
                        );
                        let nx = _mm256_add_epi32(
                            _mm256_mullo_epi32(f, _mm256_srli_epi32::<12>(xk)),
                            _mm256_and_si256(e, lo12),
                        );
                        // n = (nx < 2^23) + (nx < 2^15) bytes; nx < 2^31, so signed compares.
                        let n = _mm256_sub_epi32(
                            _mm256_setzero_si256(),
                            _mm256_add_epi32(
                                _mm256_cmpgt_epi32(l, nx),
                                _mm256_cmpgt_epi32(l15, nx),
                            ),
                        );
                        // SAFETY: every lane's offset is at most `most + 6` here (two bytes a
                        // step), and the four bytes from it lie inside `streams`
                        // (most + 12 <= len).
                        let w = unsafe {
                            _mm256_i32gather_epi32::<1>(streams.as_ptr() as *const i32, bv[k])
                        };
                        // The next two bytes as a big-endian 16-bit number.
                        let b2 = _mm256_or_si256(
                            _mm256_slli_epi32::<8>(_mm256_and_si256(w, byte)),
                            _mm256_and_si256(_mm256_srli_epi32::<8>(w), byte),
                        );
                        let sh = _mm256_slli_epi32::<3>(n);
                        xv[k] = _mm256_or_si256(
                            _mm256_sllv_epi32(nx, sh),
                            _mm256_srlv_epi32(b2, _mm256_sub_epi32(sixteen, sh)),
                        );
                        bv[k] = _mm256_add_epi32(bv[k], n);
                        acc[k] = _mm256_or_si256(
                            _mm256_srli_epi32::<8>(acc[k]),
                            _mm256_and_si256(e, top),
                        );
                    }
                }
                for (k, &a) in acc[..g].iter().enumerate() {
                    // SAFETY: a 32-byte store into a 64-byte array.
                    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, a) };
                    for (lane, &v) in lanes[..8].iter().enumerate() {
                        let at = (8 * k + lane) * SEG_BYTES + i;
                        o[at..at + 4].copy_from_slice(&v.to_le_bytes());
                    }
                }
                i += 4;
            }
            for k in 0..g {
                // SAFETY: lanes 8k..8k+8 of B-lane arrays, k < B / 8.
                unsafe {
                    _mm256_storeu_si256(x.as_mut_ptr().add(8 * k) as *mut __m256i, xv[k]);
                    _mm256_storeu_si256(abs.as_mut_ptr().add(8 * k) as *mut __m256i, bv[k]);
                }
            }
            i
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The straightforward coder of WIRE.md's text: each segment alone, one symbol at a time,
    /// bytes reversed at the end.
    fn reference(data: &[u8], table: &FreqTable) -> Vec<u8> {
        let syms = table.enc_syms();
        let mut out = Vec::new();
        table.write(&mut out);
        let mut states = Vec::new();
        let mut streams: Vec<Vec<u8>> = Vec::new();
        for seg in data.chunks(SEG_BYTES) {
            let mut x = RANS_L;
            let mut rev = Vec::new();
            for &s in seg.iter().rev() {
                let e = &syms[s as usize];
                while x >= e.x_max {
                    rev.push(x as u8);
                    x >>= 8;
                }
                x = rans::enc_step(x, e);
            }
            rev.reverse();
            states.push(x);
            streams.push(rev);
        }
        for x in &states {
            out.extend_from_slice(&x.to_le_bytes());
        }
        for s in &streams {
            out.extend_from_slice(&(s.len() as u16).to_le_bytes());
        }
        for s in &streams {
            out.extend_from_slice(s);
        }
        out
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// Bytes of a mask with bits set with probability `p` per mille, or skewed symbols.
    fn sample(n: usize, p: u64, seed: u64) -> Vec<u8> {
        let mut r = Rng(seed | 1);
        (0..n)
            .map(|_| (0..8).fold(0u8, |b, i| b | (((r.next() % 1000) < p) as u8) << i))
            .collect()
    }

    #[test]
    fn matches_reference_and_roundtrips() {
        let sizes = [
            1,
            2,
            7,
            SEG_BYTES - 1,
            SEG_BYTES,
            SEG_BYTES + 1,
            3 * SEG_BYTES + 5,
            BATCH * SEG_BYTES - 5,
            BATCH * SEG_BYTES,
            BATCH * SEG_BYTES + 1,
            2 * BATCH * SEG_BYTES + 3 * SEG_BYTES + 17,
            3 * BATCH * SEG_BYTES + 5,
        ];
        for (k, &n) in sizes.iter().enumerate() {
            for p in [1, 30, 300, 500, 900, 999] {
                let data = sample(n, p, (k * 1000) as u64 + p);
                let table = FreqTable::from_histogram(&rans::histogram(&data));
                let mut got = vec![0xAA];
                encode(&data, &table, &mut got);
                let want = reference(&data, &table);
                assert_eq!(&got[1..], &want[..], "n={n} p={p}");
                let mut plain = vec![0xAA];
                encode_with(&data, &table, &mut plain, false);
                assert_eq!(plain, got, "n={n} p={p}: plain encoder");
                // The estimate counts the segments' fields as they are written.
                let est = estimate_bytes(&table, &rans::histogram(&data));
                let slack = 8 + n / 50;
                assert!(
                    est.abs_diff(got.len() - 1) <= slack,
                    "estimate {est} n={n} p={p}"
                );
                for vector in [false, true] {
                    let mut back = vec![0u8; n];
                    decode_with(&got[1..], &mut back, vector).unwrap();
                    assert_eq!(back, data, "n={n} p={p} vector={vector}");
                }
            }
        }
    }

    #[test]
    fn damage_is_an_error_or_exact() {
        let n = BATCH * SEG_BYTES + 2 * SEG_BYTES + 100;
        let data = sample(n, 300, 7);
        let table = FreqTable::from_histogram(&rans::histogram(&data));
        let mut block = Vec::new();
        encode(&data, &table, &mut block);
        let mut back = vec![0u8; n];
        // Cut anywhere, one byte more, a segment's state and length, every byte flipped in
        // turn over the header and a stride of the streams.
        for cut in [0, 1, 5, block.len() / 2, block.len() - 1] {
            assert!(decode(&block[..cut], &mut back).is_err(), "cut at {cut}");
        }
        let mut longer = block.clone();
        longer.push(0);
        assert!(decode(&longer, &mut back).is_err());
        assert!(decode(&block, &mut vec![0u8; n - 1]).is_err());
        assert!(decode(&block, &mut vec![0u8; n + SEG_BYTES]).is_err());
        let (mut wrong, mut tries) = (0, 0);
        for i in (0..block.len()).step_by(7) {
            tries += 1;
            let mut d = block.clone();
            d[i] ^= 0x10;
            // Both decoders alike: the same error, or the same bytes.
            let mut plain = vec![0u8; n];
            let r = decode_with(&d, &mut back, true).map_err(|e| e.to_string());
            let p = decode_with(&d, &mut plain, false).map_err(|e| e.to_string());
            assert_eq!(r, p, "flip at {i}");
            if r.is_ok() {
                assert_eq!(back, plain, "flip at {i}");
                wrong += (back != data) as usize;
            }
        }
        // rANS has no check of its own on the symbols: a damaged byte that desynchronises a
        // stream can still end in the initial state with its bytes consumed (the two-state
        // block of rans.rs: 25 of 5222 such flips). The frame's XXH3 covers the masks.
        assert!(
            wrong * 100 <= tries,
            "{wrong} of {tries} damaged blocks decoded to other data"
        );
    }

    #[test]
    fn refuses_bad_segment_fields() {
        let n = 2 * SEG_BYTES + 9;
        let data = sample(n, 400, 3);
        let table = FreqTable::from_histogram(&rans::histogram(&data));
        let mut block = Vec::new();
        encode(&data, &table, &mut block);
        let tlen = {
            let mut t = Vec::new();
            table.write(&mut t);
            t.len()
        };
        let mut back = vec![0u8; n];
        let err = |b: &[u8], back: &mut [u8]| decode(b, back).unwrap_err().to_string();
        // Segment 1's state below the range.
        let mut d = block.clone();
        d[tlen + 4..tlen + 8].copy_from_slice(&(RANS_L - 1).to_le_bytes());
        assert!(
            err(&d, &mut back).contains("segment 1: initial state"),
            "{}",
            err(&d, &mut back)
        );
        // Lengths that move a byte from segment 0 to segment 1: same total.
        let mut d = block.clone();
        let l0 = tlen + 12;
        let a = u16::from_le_bytes([d[l0], d[l0 + 1]]) - 1;
        let b = u16::from_le_bytes([d[l0 + 2], d[l0 + 3]]) + 1;
        d[l0..l0 + 2].copy_from_slice(&a.to_le_bytes());
        d[l0 + 2..l0 + 4].copy_from_slice(&b.to_le_bytes());
        assert!(
            err(&d, &mut back).contains("segment 0"),
            "{}",
            err(&d, &mut back)
        );
        // A length one more than the streams hold.
        let mut d = block.clone();
        d[l0 + 4] = d[l0 + 4].wrapping_add(1);
        assert!(
            err(&d, &mut back).contains("in all"),
            "{}",
            err(&d, &mut back)
        );
    }
}
