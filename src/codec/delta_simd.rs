//! AVX2 coding of Delta frames (bf16, fp16, fp32): the 32 lanes of a group as
//! four vectors of eight states, one row of 32 elements per step, bit for bit what the plain
//! coder in `delta.rs` computes on valid frames. The lanes of a group share one word stream:
//! the lanes of a vector that need a word take the next ones in lane order (a shuffle from a
//! table indexed by the need mask, no gather), and the encoder stores the words of the lanes
//! that emit likewise. On a damaged stream both decoders fail (the checks after each group),
//! not necessarily with the same garbage on the way. tests/codec_props.rs runs both paths on
//! the same frames. Dispatch: [`decode_rows`] / [`encode_rows`] return false when they do not
//! apply (no AVX2, `CIERA_NO_SIMD=1`, another lane count or type), and the caller codes those
//! rows plainly. Where they apply they take the AVX-512 coders of `delta_avx512.rs` when the
//! processor has AVX-512 F/BW/VL/CD/VBMI/VBMI2, unless `CIERA_NO_AVX512=1` (then these AVX2
//! coders, as on AVX2-only processors); pass one is AVX2 either way for the 16-bit types. fp32
//! differs as the plain coder does (32-bit moves, 86 tokens, extra bits in two steps: the low
//! 15 bits, then the rest; `prep32`, `values32`, `scan32`); measured with `CIERA_NO_AVX512=1`,
//! fp32 rows: encode 1.2-1.3 GB/s, decode 1.75-2.0 GB/s (plain: 0.2).
#![allow(unsafe_code)] // the AVX2 intrinsics; every block says why it is sound

use super::delta::{Reader, Words, CLIP, HIST, NCTX, PROB_SCALE};
use super::float::Layout;

/// The outcome of the rows a vector decoder did.
#[derive(Default)]
pub(super) struct RowCounts {
    pub changed: usize,
    pub exp_changed: usize,
    /// Some element's context had no table.
    pub no_table: bool,
}

/// Decode `rows` full rows of 32 elements starting at element `base`, for a group of 32 lanes
/// in states `x` reading the group's stream from `rd`. `padded` is the lane section followed by
/// at least 16 bytes (a refill loads 8 words). Returns false (and does nothing) when this path
/// does not apply.
#[allow(clippy::too_many_arguments)]
pub(super) fn decode_rows<L: Layout>(
    padded: &[u8],
    s0_len: usize,
    dec: &[u32],
    x: &mut [u32],
    rd: &mut Reader,
    state: &mut [u8],
    ctx: &mut [u8],
    out: &mut [u8],
    base: usize,
    rows: usize,
    counts: &mut RowCounts,
) -> bool {
    if x.len() != 32 || !applies::<L>() {
        return false;
    }
    let end = base + rows * 32;
    assert!(
        padded.len() >= s0_len + 16
            && dec.len() == NCTX * PROB_SCALE as usize
            && ctx.len() >= end
            && state.len() >= L::BYTES * end
            && out.len() >= L::BYTES * end
            && rd.end <= s0_len,
        "delta avx2 decode: inconsistent buffers"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if super::delta_avx512::on() {
            assert!(
                padded.len() >= s0_len + super::delta_avx512::PAD,
                "delta avx512 decode: section not padded"
            );
            // SAFETY: AVX-512 F/BW/VL/CD/VBMI/VBMI2 are present (delta_avx512::on checked
            // them). The asserts above bound every access as for AVX2, and word loads read 64
            // bytes at min(rd.at, s0_len) <= padded.len() - 64.
            unsafe {
                super::delta_avx512::decode_rows::<L, 1>(
                    padded,
                    s0_len,
                    dec,
                    [x],
                    [rd],
                    state,
                    ctx,
                    out,
                    [base],
                    rows,
                    counts,
                );
            }
            return true;
        }
        // SAFETY: AVX2 is present (enabled() checked it). The asserts above bound every
        // access: rows of 32 elements below `end` in ctx/state/out; table indices are
        // min(ctx, 16) * 4096 + (x & 4095) < dec.len(); word loads read 16 bytes at
        // min(rd.at, s0_len) <= padded.len() - 16.
        unsafe {
            avx2::rows::<L>(
                padded, s0_len, dec, x, rd, state, ctx, out, base, rows, counts,
            );
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether [`decode_rows_n`] applies (the AVX-512 decoder: the callers batch whole groups for
/// it).
pub(super) fn decode_batches() -> bool {
    super::delta_avx512::on()
}

/// Decode `rows` full rows of 32 elements of `G` groups in lockstep (their steps overlap), group
/// `g` starting at element `bases[g]` with states `xs[g]` reading its stream from `rds[g]`;
/// otherwise as [`decode_rows`]. Returns false (and does nothing) when this path does not apply
/// (see [`decode_batches`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn decode_rows_n<L: Layout, const G: usize>(
    padded: &[u8],
    s0_len: usize,
    dec: &[u32],
    xs: [&mut [u32]; G],
    rds: [&mut Reader; G],
    state: &mut [u8],
    ctx: &mut [u8],
    out: &mut [u8],
    bases: [usize; G],
    rows: usize,
    counts: &mut RowCounts,
) -> bool {
    if !matches!(L::BYTES, 2 | 4) || xs.iter().any(|x| x.len() != 32) || !decode_batches() {
        return false;
    }
    let end = bases.iter().max().map_or(0, |&b| b + rows * 32);
    assert!(
        padded.len() >= s0_len + super::delta_avx512::PAD
            && dec.len() == NCTX * PROB_SCALE as usize
            && ctx.len() >= end
            && state.len() >= L::BYTES * end
            && out.len() >= L::BYTES * end
            && rds.iter().all(|rd| rd.end <= s0_len),
        "delta avx512 decode: inconsistent buffers"
    );
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: AVX-512 F/BW/VL/CD/VBMI/VBMI2 are present (decode_batches checked them). The
        // asserts above bound every access: rows of 32 elements below `end` in ctx/state/out
        // for every group; table indices are min(ctx, 16) * 4096 + (x & 4095) < dec.len();
        // word loads read 64 bytes at min(rd.at, s0_len) <= padded.len() - 64; 32 states each.
        unsafe {
            super::delta_avx512::decode_rows::<L, G>(
                padded, s0_len, dec, xs, rds, state, ctx, out, bases, rows, counts,
            );
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the vector coders apply to the type `L` (bf16, fp16, fp32): the AVX2 coders, or
/// the AVX-512 ones where present.
pub(super) fn applies<L: Layout>() -> bool {
    match L::BYTES {
        2 => on(),
        4 => on(),
        _ => false,
    }
}

/// The vector coders apply: AVX2 (and POPCNT, which every AVX2 processor has, for the word
/// counts) present and SIMD not turned off (`simd::enabled`).
pub(super) fn on() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static ON: OnceLock<bool> = OnceLock::new();
        *ON.get_or_init(|| super::simd::enabled() && std::is_x86_feature_detected!("popcnt"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// For a mask of lanes: lane j's rank among the set lanes (ascending), for expanding words.
const fn expand_table() -> [[i32; 8]; 256] {
    let mut t = [[0i32; 8]; 256];
    let mut m = 0;
    while m < 256 {
        let (mut j, mut c) = (0, 0);
        while j < 8 {
            if (m >> j) & 1 == 1 {
                t[m][j] = c;
                c += 1;
            }
            j += 1;
        }
        m += 1;
    }
    t
}

/// For a mask of lanes: the set lanes from the highest down, for compressing words.
const fn compress_desc_table() -> [[i32; 8]; 256] {
    let mut t = [[0i32; 8]; 256];
    let mut m = 0;
    while m < 256 {
        let (mut j, mut c) = (8, 0);
        while j > 0 {
            j -= 1;
            if (m >> j) & 1 == 1 {
                t[m][c] = j;
                c += 1;
            }
        }
        m += 1;
    }
    t
}

static EXPAND: [[i32; 8]; 256] = expand_table();
static COMPRESS_DESC: [[i32; 8]; 256] = compress_desc_table();

/// Count the (context, token) indices a vector loop stored in `ks` (two per word, element
/// order) into the four histograms of pass one at `h`, element j into histogram j % 4.
///
/// The words are read back through memory (volatile loads: the load ports are idle in pass
/// one); left to itself the compiler takes each index out of the vector register (`vpextrd`,
/// two uops each on the vector ports the pass's own arithmetic needs), which made the bf16
/// pass one port-bound (measured: 13% of its samples on one `vpextrd`).
///
/// # Safety
/// Every index in `ks` is below `HIST` and `h` points to `4 * HIST` counters.
#[inline(always)]
pub(super) unsafe fn count_pairs<const N: usize>(h: *mut u32, ks: &[u64; N]) {
    for p in 0..N {
        // SAFETY: p < N, an aligned u64 of ks.
        let w = unsafe { std::ptr::read_volatile(ks.as_ptr().add(p)) };
        let (lo, hi) = (w as u32 as usize, (w >> 32) as usize);
        // SAFETY: the caller's bound; (2p) % 4 and (2p + 1) % 4 are below 4.
        unsafe {
            *h.add(((2 * p) & 3) * HIST + lo) += 1;
            *h.add(((2 * p + 1) & 3) * HIST + hi) += 1;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Reader, RowCounts, Words, CLIP, COMPRESS_DESC, EXPAND};
    use crate::codec::delta::{PROB_BITS, PROB_SCALE, RANS_L};
    use crate::codec::float::Layout;

    /// A token's extra bit count less one where it has extra bits (`b - 1` of `detokenize`,
    /// garbage below 32), and the mask of the lanes that have them.
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    fn token_bits(t: __m256i) -> (__m256i, __m256i) {
        let big = _mm256_cmpgt_epi32(t, _mm256_set1_epi32(31));
        let bm1 = _mm256_add_epi32(
            _mm256_srli_epi32(_mm256_sub_epi32(t, _mm256_set1_epi32(32)), 1),
            _mm256_set1_epi32(4),
        );
        (bm1, big)
    }

    /// Eight lanes' values below 2^16 as eight u16 (the low 128 bits).
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    fn pack16(v: __m256i) -> __m128i {
        _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(
            v, v,
        )))
    }

    /// Refill the lanes of `x` that are below RANS_L with the next words of the stream, in
    /// lane order.
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    unsafe fn refill(x: &mut __m256i, rd: &mut Reader, base: *const u8, limit: usize) {
        let need = _mm256_cmpgt_epi32(_mm256_set1_epi32(RANS_L as i32), *x);
        // No branch on the mask (it is as good as random): with no lane in need the shuffle
        // and blend change nothing and the position does not move.
        let m = _mm256_movemask_ps(_mm256_castsi256_ps(need)) as usize;
        let words =
            _mm256_cvtepu16_epi32(_mm_loadu_si128(base.add(rd.at.min(limit)) as *const __m128i));
        let idx = _mm256_loadu_si256(EXPAND[m].as_ptr() as *const __m256i);
        let w = _mm256_permutevar8x32_epi32(words, idx);
        *x = _mm256_blendv_epi8(*x, _mm256_or_si256(_mm256_slli_epi32(*x, 16), w), need);
        rd.at += 2 * m.count_ones() as usize;
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,popcnt")]
    pub(super) unsafe fn rows<L: Layout>(
        padded: &[u8],
        limit: usize,
        dec: &[u32],
        xl: &mut [u32],
        rd: &mut Reader,
        state: &mut [u8],
        ctx: &mut [u8],
        out: &mut [u8],
        base: usize,
        rows: usize,
        counts: &mut RowCounts,
    ) {
        let mut x = [_mm256_setzero_si256(); 4];
        for (v, xv) in x.iter_mut().enumerate() {
            *xv = _mm256_loadu_si256(xl.as_ptr().add(8 * v) as *const __m256i);
        }
        let s0 = padded.as_ptr();
        let table = dec.as_ptr() as *const i32;
        let zero = _mm256_setzero_si256();
        let one = _mm256_set1_epi32(1);
        let mslot = _mm256_set1_epi32(PROB_SCALE as i32 - 1);
        let m4095 = _mm256_set1_epi32(4095);
        let exp_shift = _mm_cvtsi32_si128(L::EXP_SHIFT as i32);
        let exp_max16 = _mm256_set1_epi16(L::EXP_MAX as i16);
        let (h8000, h7fff) = (_mm256_set1_epi16(i16::MIN), _mm256_set1_epi16(0x7fff));
        let (mut unchanged, mut exp_same) = (0u32, 0u32);
        let mut no_table = zero;
        // Each phase runs over the four vectors before the next one starts, so that their
        // gathers are in flight together (the lanes are independent).
        for k in 0..rows {
            let row = base + k * 32;
            let mut t = [zero; 4];
            for v in 0..4 {
                let c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                    ctx.as_ptr().add(row + 8 * v) as *const __m128i
                ));
                let c = _mm256_min_epu32(c, _mm256_set1_epi32(2 * CLIP));
                let idx = _mm256_or_si256(
                    _mm256_slli_epi32(c, PROB_BITS as i32),
                    _mm256_and_si256(x[v], mslot),
                );
                t[v] = _mm256_i32gather_epi32::<4>(table, idx);
            }
            for v in 0..4 {
                let e = t[v];
                no_table = _mm256_or_si256(no_table, _mm256_cmpeq_epi32(e, zero));
                let f = _mm256_srli_epi32(e, 19);
                let bias = _mm256_and_si256(_mm256_srli_epi32(e, 7), m4095);
                x[v] = _mm256_add_epi32(
                    _mm256_mullo_epi32(f, _mm256_srli_epi32(x[v], PROB_BITS as i32)),
                    bias,
                );
                t[v] = _mm256_and_si256(e, _mm256_set1_epi32(0x7f));
            }
            for xv in x.iter_mut() {
                refill(xv, rd, s0, limit);
            }
            if L::BYTES == 4 {
                let (u, e) = values32::<L>(&mut x, t, rd, s0, limit, state, ctx, out, row);
                unchanged += u;
                exp_same += e;
                continue;
            }
            // Direct tokens are their zigzag values. A vector without extra bits skips its
            // extra step, which would change nothing (its states are >= RANS_L after the
            // refill, so it takes no word either); the words go to the vectors in lane order
            // as before.
            let mut zs = t;
            for v in 0..4 {
                // Token -> zigzag high part and extra bit count (at most 14 for 16 bits).
                let tv = t[v];
                let (bm1, big) = token_bits(tv);
                if _mm256_testz_si256(big, big) != 0 {
                    continue;
                }
                let eb = _mm256_and_si256(bm1, big);
                let zb = _mm256_sllv_epi32(
                    _mm256_or_si256(_mm256_set1_epi32(2), _mm256_and_si256(tv, one)),
                    bm1,
                );
                let z = _mm256_blendv_epi8(tv, zb, big);
                let low = _mm256_sub_epi32(_mm256_sllv_epi32(one, eb), one);
                zs[v] = _mm256_or_si256(z, _mm256_and_si256(x[v], low));
                x[v] = _mm256_srlv_epi32(x[v], eb);
                refill(&mut x[v], rd, s0, limit);
            }
            // Moves -> new values, sixteen 16-bit lanes at a time (the zigzag values are below
            // 2^16).
            for h in 0..2 {
                let i = row + 16 * h;
                let z = _mm256_permute4x64_epi64::<0b11011000>(_mm256_packus_epi32(
                    zs[2 * h],
                    zs[2 * h + 1],
                ));
                let d = _mm256_xor_si256(
                    _mm256_srli_epi16(z, 1),
                    _mm256_srai_epi16(_mm256_slli_epi16(z, 15), 15),
                );
                let old = _mm256_loadu_si256(state.as_ptr().add(2 * i) as *const __m256i);
                // key: u ^ 0xffff with the sign bit set, else u ^ 0x8000; unkey inverts it.
                let k = _mm256_xor_si256(old, _mm256_or_si256(_mm256_srai_epi16(old, 15), h8000));
                let k = _mm256_add_epi16(k, d);
                let new = _mm256_xor_si256(
                    k,
                    _mm256_or_si256(_mm256_andnot_si256(_mm256_srai_epi16(k, 15), h7fff), h8000),
                );
                _mm256_storeu_si256(out.as_mut_ptr().add(2 * i) as *mut __m256i, new);
                _mm256_storeu_si256(state.as_mut_ptr().add(2 * i) as *mut __m256i, new);
                // Context byte: the move clipped to -CLIP..CLIP, plus CLIP.
                let cl = _mm256_add_epi16(
                    _mm256_min_epi16(
                        _mm256_max_epi16(d, _mm256_set1_epi16(-CLIP as i16)),
                        _mm256_set1_epi16(CLIP as i16),
                    ),
                    _mm256_set1_epi16(CLIP as i16),
                );
                let cb = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi16(cl, cl));
                _mm_storeu_si128(
                    ctx.as_mut_ptr().add(i) as *mut __m128i,
                    _mm256_castsi256_si128(cb),
                );
                unchanged += lanes_eq16(d, zero);
                exp_same += fields_same16(old, new, exp_shift, exp_max16);
            }
        }
        let exp_changed = rows * 32 - exp_same as usize;
        counts.changed += rows * 32 - unchanged as usize;
        counts.exp_changed += exp_changed;
        counts.no_table |= _mm256_movemask_ps(_mm256_castsi256_ps(no_table)) != 0;
        for (v, xv) in x.iter().enumerate() {
            _mm256_storeu_si256(xl.as_mut_ptr().add(8 * v) as *mut __m256i, *xv);
        }
    }

    /// The extra bits and values of a row of 32 fp32 elements from `row` whose tokens `t` were
    /// decoded: the low step of at most 15 bits for every lane, then the high step (the bits
    /// above), each vector refilled after its step, lanes in order, as the scalar decoder; the
    /// new values go to `out` and `state`, the contexts they leave to `ctx`. Returns the row's
    /// unchanged values and values with an unchanged exponent.
    ///
    /// # Safety
    /// As [`rows`]: `base + min(rd.at, limit) + 16` bytes readable at `s0`; 128 bytes of
    /// `state` and `out` and 32 of `ctx` at the row.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    unsafe fn values32<L: Layout>(
        x: &mut [__m256i; 4],
        t: [__m256i; 4],
        rd: &mut Reader,
        s0: *const u8,
        limit: usize,
        state: &mut [u8],
        ctx: &mut [u8],
        out: &mut [u8],
        row: usize,
    ) -> (u32, u32) {
        let zero = _mm256_setzero_si256();
        let one = _mm256_set1_epi32(1);
        let fifteen = _mm256_set1_epi32(15);
        let mut zs = t;
        let mut hi = [zero; 4];
        for v in 0..4 {
            let (bm1, big) = token_bits(t[v]);
            if _mm256_testz_si256(big, big) != 0 {
                continue;
            }
            // At most 30 extra bits for 32 bits.
            let eb = _mm256_and_si256(bm1, big);
            let zb = _mm256_sllv_epi32(
                _mm256_or_si256(_mm256_set1_epi32(2), _mm256_and_si256(t[v], one)),
                bm1,
            );
            let lo = _mm256_min_epu32(eb, fifteen);
            hi[v] = _mm256_max_epi32(_mm256_sub_epi32(eb, fifteen), zero);
            let low = _mm256_sub_epi32(_mm256_sllv_epi32(one, lo), one);
            zs[v] = _mm256_or_si256(
                _mm256_blendv_epi8(t[v], zb, big),
                _mm256_and_si256(x[v], low),
            );
            x[v] = _mm256_srlv_epi32(x[v], lo);
            refill(&mut x[v], rd, s0, limit);
        }
        for v in 0..4 {
            if _mm256_testz_si256(hi[v], hi[v]) != 0 {
                continue;
            }
            let low = _mm256_sub_epi32(_mm256_sllv_epi32(one, hi[v]), one);
            zs[v] = _mm256_or_si256(zs[v], _mm256_slli_epi32(_mm256_and_si256(x[v], low), 15));
            x[v] = _mm256_srlv_epi32(x[v], hi[v]);
            refill(&mut x[v], rd, s0, limit);
        }
        let exp_shift = _mm_cvtsi32_si128(L::EXP_SHIFT as i32);
        let exp_max = _mm256_set1_epi32(L::EXP_MAX as i32);
        let (mut unchanged, mut exp_same) = (0u32, 0u32);
        let mut ds = [zero; 4];
        for v in 0..4 {
            let i = row + 8 * v;
            let z = zs[v];
            let d = _mm256_xor_si256(
                _mm256_srli_epi32(z, 1),
                _mm256_srai_epi32(_mm256_slli_epi32(z, 31), 31),
            );
            let old = _mm256_loadu_si256(state.as_ptr().add(4 * i) as *const __m256i);
            let k = _mm256_add_epi32(key32(old), d);
            // unkey: k ^ 0x80000000 with the sign bit set, else k ^ 0xffffffff.
            let new = _mm256_xor_si256(
                k,
                _mm256_or_si256(
                    _mm256_andnot_si256(_mm256_srai_epi32(k, 31), _mm256_set1_epi32(i32::MAX)),
                    _mm256_set1_epi32(i32::MIN),
                ),
            );
            _mm256_storeu_si256(out.as_mut_ptr().add(4 * i) as *mut __m256i, new);
            _mm256_storeu_si256(state.as_mut_ptr().add(4 * i) as *mut __m256i, new);
            unchanged += lanes_eq32(d, zero);
            exp_same += fields_same32(old, new, exp_shift, exp_max);
            ds[v] = d;
        }
        _mm256_storeu_si256(ctx.as_mut_ptr().add(row) as *mut __m256i, contexts32(ds));
        (unchanged, exp_same)
    }

    /// Pass one of fp32 over the first `n / 16 * 16` elements, as [`scan`] for the 16-bit
    /// types.
    #[target_feature(enable = "avx2,popcnt")]
    pub(super) unsafe fn scan32<L: Layout>(
        input: &[u8],
        old: &[u8],
        ctx: &[u8],
        hist: &mut [u32],
    ) -> super::ScanCounts {
        let ntok = _mm256_set1_epi32(crate::codec::delta::tokens(32) as i32);
        let cmax = _mm256_set1_epi32(2 * CLIP);
        let n = ctx.len();
        let zero = _mm256_setzero_si256();
        let exp_shift = _mm_cvtsi32_si128(L::EXP_SHIFT as i32);
        let exp_max = _mm256_set1_epi32(L::EXP_MAX as i32);
        let h = hist.as_mut_ptr();
        let mut extra = zero;
        let (mut same, mut exp_same) = (0usize, 0usize);
        let full = n / 16 * 16;
        let mut ks = [0u64; 4];
        let mut i = 0;
        while i < full {
            let a = _mm256_loadu_si256(old.as_ptr().add(4 * i) as *const __m256i);
            let b = _mm256_loadu_si256(input.as_ptr().add(4 * i) as *const __m256i);
            let (_, zz) = moves32(a, b);
            let (t, eb) = tokens8_32(zz);
            extra = _mm256_add_epi32(extra, eb);
            let c = _mm256_min_epu32(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(ctx.as_ptr().add(i) as *const __m128i)),
                cmax,
            );
            let k = _mm256_add_epi32(_mm256_mullo_epi32(c, ntok), t);
            _mm256_storeu_si256(ks.as_mut_ptr() as *mut __m256i, k);
            super::count_pairs(h, &ks);
            same += lanes_eq32(a, b) as usize;
            exp_same += fields_same32(a, b, exp_shift, exp_max) as usize;
            i += 8;
        }
        let mut e = [0u32; 8];
        _mm256_storeu_si256(e.as_mut_ptr() as *mut __m256i, extra);
        super::ScanCounts {
            extra_bits: e.iter().map(|&v| v as u64).sum(),
            changed: full - same,
            exp_changed: full - exp_same,
            counted: full,
        }
    }

    /// The moves of sixteen 16-bit values from `a` to `b`: the move as a signed 16-bit number
    /// (`key(b) - key(a)` wraps like the move), and its zigzag value.
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    fn moves16(a: __m256i, b: __m256i) -> (__m256i, __m256i) {
        // key: u ^ 0xffff with the sign bit set, else u ^ 0x8000.
        let h8000 = _mm256_set1_epi16(i16::MIN);
        let ka = _mm256_xor_si256(a, _mm256_or_si256(_mm256_srai_epi16(a, 15), h8000));
        let kb = _mm256_xor_si256(b, _mm256_or_si256(_mm256_srai_epi16(b, 15), h8000));
        let d = _mm256_sub_epi16(kb, ka);
        let zz = _mm256_xor_si256(_mm256_slli_epi16(d, 1), _mm256_srai_epi16(d, 15));
        (d, zz)
    }

    /// The context bytes sixteen 16-bit moves leave (`delta::context_of`), in the low 128 bits.
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    fn contexts16(d: __m256i) -> __m128i {
        let chi = _mm256_set1_epi16(CLIP as i16);
        let cl = _mm256_add_epi16(
            _mm256_min_epi16(_mm256_max_epi16(d, _mm256_set1_epi16(-CLIP as i16)), chi),
            chi,
        );
        _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi16(
            cl, cl,
        )))
    }

    /// Eight zigzag values (32-bit lanes, below 2^16): their tokens, and the tokens' extra bit
    /// counts (0 for the direct tokens).
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    fn tokens8(zz: __m256i) -> (__m256i, __m256i) {
        let one = _mm256_set1_epi32(1);
        // floor(log2 z) from the float exponent (exact below 2^24).
        let lg = _mm256_sub_epi32(
            _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(zz)), 23),
            _mm256_set1_epi32(127),
        );
        let big = _mm256_cmpgt_epi32(zz, _mm256_set1_epi32(31));
        let bm1 = _mm256_sub_epi32(lg, one);
        let tb = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_slli_epi32(lg, 1), _mm256_set1_epi32(22)),
            _mm256_and_si256(_mm256_srlv_epi32(zz, bm1), one),
        );
        (_mm256_blendv_epi8(zz, tb, big), _mm256_and_si256(bm1, big))
    }

    /// The moves of eight 32-bit values from `a` to `b` (as [`moves16`]).
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    fn moves32(a: __m256i, b: __m256i) -> (__m256i, __m256i) {
        let d = _mm256_sub_epi32(key32(b), key32(a));
        let zz = _mm256_xor_si256(_mm256_slli_epi32(d, 1), _mm256_srai_epi32(d, 31));
        (d, zz)
    }

    /// The order key of eight 32-bit values: u ^ 0xffffffff with the sign bit set, else
    /// u ^ 0x80000000.
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    fn key32(u: __m256i) -> __m256i {
        _mm256_xor_si256(
            u,
            _mm256_or_si256(_mm256_srai_epi32(u, 31), _mm256_set1_epi32(i32::MIN)),
        )
    }

    /// The context bytes of 32 32-bit moves (four vectors of eight, in element order).
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    fn contexts32(d: [__m256i; 4]) -> __m256i {
        let chi = _mm256_set1_epi32(CLIP);
        let c = d.map(|v| {
            _mm256_add_epi32(
                _mm256_min_epi32(_mm256_max_epi32(v, _mm256_set1_epi32(-CLIP)), chi),
                chi,
            )
        });
        // Packing interleaves the 128-bit halves: dwords c0a c1a c2a c3a c0b c1b c2b c3b.
        let b = _mm256_packus_epi16(
            _mm256_packs_epi32(c[0], c[1]),
            _mm256_packs_epi32(c[2], c[3]),
        );
        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }

    /// Eight zigzag values of any 32 bits: their tokens and extra bit counts (as [`tokens8`],
    /// with floor(log2 z) from the high or the low half, each exact as a float).
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    fn tokens8_32(zz: __m256i) -> (__m256i, __m256i) {
        let one = _mm256_set1_epi32(1);
        let zh = _mm256_srli_epi32(zz, 16);
        let upper = _mm256_cmpgt_epi32(zh, _mm256_setzero_si256());
        let v = _mm256_blendv_epi8(zz, zh, upper);
        let lg = _mm256_add_epi32(
            _mm256_sub_epi32(
                _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(v)), 23),
                _mm256_set1_epi32(127),
            ),
            _mm256_and_si256(upper, _mm256_set1_epi32(16)),
        );
        let big = _mm256_cmpgt_epi32(
            _mm256_xor_si256(zz, _mm256_set1_epi32(i32::MIN)),
            _mm256_set1_epi32(i32::MIN + 31),
        );
        let bm1 = _mm256_sub_epi32(lg, one);
        let tb = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_slli_epi32(lg, 1), _mm256_set1_epi32(22)),
            _mm256_and_si256(_mm256_srlv_epi32(zz, bm1), one),
        );
        (_mm256_blendv_epi8(zz, tb, big), _mm256_and_si256(bm1, big))
    }

    /// Sixteen 16-bit lanes as two vectors of eight 32-bit lanes (elements 0..8, 8..16).
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    fn widen16(v: __m256i) -> [__m256i; 2] {
        [
            _mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)),
            _mm256_cvtepu16_epi32(_mm256_extracti128_si256::<1>(v)),
        ]
    }

    /// Pass one over the first `n / 16 * 16` elements: the (context, token) counts into four
    /// histograms of HIST entries each (`hist`), element j of each eight into histogram j % 4.
    #[target_feature(enable = "avx2,popcnt")]
    pub(super) unsafe fn scan<L: Layout>(
        input: &[u8],
        old: &[u8],
        ctx: &[u8],
        hist: &mut [u32],
    ) -> super::ScanCounts {
        let ntok = _mm256_set1_epi32(crate::codec::delta::tokens(16) as i32);
        let cmax = _mm256_set1_epi32(2 * CLIP);
        let n = input.len() / 2;
        let zero = _mm256_setzero_si256();
        let exp_shift = _mm_cvtsi32_si128(L::EXP_SHIFT as i32);
        let exp_max = _mm256_set1_epi16(L::EXP_MAX as i16);
        let h = hist.as_mut_ptr();
        let mut extra = zero;
        let (mut same, mut exp_same) = (0usize, 0usize);
        let full = n / 16 * 16;
        let mut ks = [0u64; 4];
        let mut i = 0;
        while i + 16 <= full {
            let a = _mm256_loadu_si256(old.as_ptr().add(2 * i) as *const __m256i);
            let b = _mm256_loadu_si256(input.as_ptr().add(2 * i) as *const __m256i);
            let (_, zz) = moves16(a, b);
            for (hf, z8) in widen16(zz).into_iter().enumerate() {
                let (t, eb) = tokens8(z8);
                extra = _mm256_add_epi32(extra, eb);
                let c = _mm256_min_epu32(
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        ctx.as_ptr().add(i + 8 * hf) as *const __m128i
                    )),
                    cmax,
                );
                let k = _mm256_add_epi32(_mm256_mullo_epi32(c, ntok), t);
                _mm256_storeu_si256(ks.as_mut_ptr() as *mut __m256i, k);
                super::count_pairs(h, &ks);
            }
            same += lanes_eq16(a, b) as usize;
            exp_same += fields_same16(a, b, exp_shift, exp_max) as usize;
            i += 16;
        }
        let full = i;
        let mut e = [0u32; 8];
        _mm256_storeu_si256(e.as_mut_ptr() as *mut __m256i, extra);
        super::ScanCounts {
            extra_bits: e.iter().map(|&v| v as u64).sum(),
            changed: full - same,
            exp_changed: full - exp_same,
            counted: full,
        }
    }

    /// Append the low words of the lanes where `over` is set (highest lane first: the encoder
    /// runs backwards) to the group's words, then shift those states right by 16.
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    unsafe fn emit(x: &mut __m256i, over: __m256i, words: &mut Words<'_>) {
        // No branch on the mask (as good as random): with no lane over, the store writes past
        // the end of the words (overwritten later) and the position does not move.
        let m = _mm256_movemask_ps(_mm256_castsi256_ps(over)) as usize;
        let idx = _mm256_loadu_si256(COMPRESS_DESC[m].as_ptr() as *const __m256i);
        let lo = _mm256_and_si256(*x, _mm256_set1_epi32(0xffff));
        let perm = _mm256_permutevar8x32_epi32(lo, idx);
        let dst = &mut words.buf[words.pos..words.pos + 8];
        _mm_storeu_si128(dst.as_mut_ptr() as *mut __m128i, pack16(perm));
        words.pos += m.count_ones() as usize;
        *x = _mm256_blendv_epi8(*x, _mm256_srli_epi32(*x, 16), over);
    }

    /// One row's coding inputs for the encoder, lanes ascending in four vectors of eight:
    /// zigzag moves, extra bit counts of the low step (at most 15) and the high step (fp32: the
    /// bits above 15), and the (context, token) table indices.
    struct RowIn {
        zs: [__m256i; 4],
        lo: [__m256i; 4],
        hi: [__m256i; 4],
        ks: [__m256i; 4],
        /// Elements of the row whose value, and whose cached field, did not change.
        same: u32,
        exp_same: u32,
    }

    impl RowIn {
        /// Every vector zero, nothing counted: what a row's preparation starts from.
        #[inline]
        #[target_feature(enable = "avx2")]
        fn zeroed() -> RowIn {
            let z = _mm256_setzero_si256();
            RowIn {
                zs: [z; 4],
                lo: [z; 4],
                hi: [z; 4],
                ks: [z; 4],
                same: 0,
                exp_same: 0,
            }
        }
    }

    /// Lanes of sixteen 16-bit values `a` and `b` that are equal.
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    fn lanes_eq16(a: __m256i, b: __m256i) -> u32 {
        // Two mask bits per lane.
        (_mm256_movemask_epi8(_mm256_cmpeq_epi16(a, b)) as u32).count_ones() / 2
    }

    /// Lanes of eight 32-bit values `a` and `b` that are equal.
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    fn lanes_eq32(a: __m256i, b: __m256i) -> u32 {
        (_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, b))) as u32).count_ones()
    }

    /// Lanes of sixteen 16-bit values `a` and `b` whose cached fields (`exp_max << exp_shift`,
    /// `exp_max` in 16-bit lanes) are equal: the exponent changes every pass counts.
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    fn fields_same16(a: __m256i, b: __m256i, exp_shift: __m128i, exp_max: __m256i) -> u32 {
        let ex = _mm256_and_si256(_mm256_srl_epi16(_mm256_xor_si256(a, b), exp_shift), exp_max);
        lanes_eq16(ex, _mm256_setzero_si256())
    }

    /// As [`fields_same16`] for eight 32-bit values (`exp_max` in 32-bit lanes).
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    fn fields_same32(a: __m256i, b: __m256i, exp_shift: __m128i, exp_max: __m256i) -> u32 {
        let ex = _mm256_and_si256(_mm256_srl_epi32(_mm256_xor_si256(a, b), exp_shift), exp_max);
        lanes_eq32(ex, _mm256_setzero_si256())
    }

    /// The row of 32 16-bit elements from `row`: moves from the cached values and contexts,
    /// which then take the new values and the contexts the moves leave.
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    unsafe fn prep16(
        input: &[u8],
        state: &mut [u8],
        ctx: &mut [u8],
        row: usize,
        exp: (__m128i, __m256i),
    ) -> RowIn {
        let ntok = _mm256_set1_epi32(crate::codec::delta::tokens(16) as i32);
        let cmax = _mm256_set1_epi32(2 * CLIP);
        let mut r = RowIn::zeroed();
        for hf in 0..2 {
            let i = row + 16 * hf;
            let a = _mm256_loadu_si256(state.as_ptr().add(2 * i) as *const __m256i);
            let b = _mm256_loadu_si256(input.as_ptr().add(2 * i) as *const __m256i);
            r.same += lanes_eq16(a, b);
            r.exp_same += fields_same16(a, b, exp.0, exp.1);
            let (d, zz) = moves16(a, b);
            for (q, z8) in widen16(zz).into_iter().enumerate() {
                let v = 2 * hf + q;
                let (t, eb) = tokens8(z8);
                let c = _mm256_min_epu32(
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        ctx.as_ptr().add(i + 8 * q) as *const __m128i
                    )),
                    cmax,
                );
                r.ks[v] = _mm256_add_epi32(_mm256_mullo_epi32(c, ntok), t);
                r.zs[v] = z8;
                r.lo[v] = eb;
            }
            _mm_storeu_si128(ctx.as_mut_ptr().add(i) as *mut __m128i, contexts16(d));
            _mm256_storeu_si256(state.as_mut_ptr().add(2 * i) as *mut __m256i, b);
        }
        r
    }

    /// As [`prep16`] for 32 fp32 elements.
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    unsafe fn prep32(
        input: &[u8],
        state: &mut [u8],
        ctx: &mut [u8],
        row: usize,
        exp: (__m128i, __m256i),
    ) -> RowIn {
        let zero = _mm256_setzero_si256();
        let ntok = _mm256_set1_epi32(crate::codec::delta::tokens(32) as i32);
        let cmax = _mm256_set1_epi32(2 * CLIP);
        let fifteen = _mm256_set1_epi32(15);
        let mut r = RowIn::zeroed();
        let mut ds = [zero; 4];
        for (v, dv) in ds.iter_mut().enumerate() {
            let i = row + 8 * v;
            let a = _mm256_loadu_si256(state.as_ptr().add(4 * i) as *const __m256i);
            let b = _mm256_loadu_si256(input.as_ptr().add(4 * i) as *const __m256i);
            r.same += lanes_eq32(a, b);
            r.exp_same += fields_same32(a, b, exp.0, exp.1);
            let (d, zz) = moves32(a, b);
            let (t, eb) = tokens8_32(zz);
            let c = _mm256_min_epu32(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(ctx.as_ptr().add(i) as *const __m128i)),
                cmax,
            );
            r.ks[v] = _mm256_add_epi32(_mm256_mullo_epi32(c, ntok), t);
            r.zs[v] = zz;
            r.lo[v] = _mm256_min_epu32(eb, fifteen);
            r.hi[v] = _mm256_max_epi32(_mm256_sub_epi32(eb, fifteen), zero);
            *dv = d;
            _mm256_storeu_si256(state.as_mut_ptr().add(4 * i) as *mut __m256i, b);
        }
        _mm256_storeu_si256(ctx.as_mut_ptr().add(row) as *mut __m256i, contexts32(ds));
        r
    }

    /// `bits` (per lane, at most 15) raw bits `v` into the states of one vector (the scalar
    /// `put_bits`); nothing where no lane has bits.
    #[inline]
    #[target_feature(enable = "avx2,popcnt")]
    unsafe fn put_bits(x: &mut __m256i, bits: __m256i, v: __m256i, words: &mut Words<'_>) {
        // Without bits the step changes nothing (x < 2^31: no word either).
        if _mm256_testz_si256(bits, bits) != 0 {
            return;
        }
        let one = _mm256_set1_epi32(1);
        let top = _mm256_set1_epi32(i32::MIN); // 2^31 as u32
        let lim = _mm256_sub_epi32(_mm256_srlv_epi32(top, bits), one);
        let over = _mm256_cmpgt_epi32(*x, lim);
        emit(x, over, words);
        let low = _mm256_sub_epi32(_mm256_sllv_epi32(one, bits), one);
        *x = _mm256_or_si256(_mm256_sllv_epi32(*x, bits), _mm256_and_si256(v, low));
    }

    /// Encode `rows` full rows of a group backwards, of a type of `W` (16 or 32) bits whose
    /// cached field is `exp.1 << exp.0`, counting the changes into `rc`; see
    /// `super::encode_rows`, which asserts the bounds this relies on.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,popcnt")]
    pub(super) unsafe fn encode_rows<const W: u32>(
        table: &super::EncTable,
        input: &[u8],
        state: &mut [u8],
        ctx: &mut [u8],
        xl: &mut [u32],
        words: &mut Words<'_>,
        base: usize,
        rows: usize,
        exp: (i32, i32),
        rc: &mut RowCounts,
    ) {
        let (mut same, mut exp_same) = (0usize, 0usize);
        // The cached field's shift and mask, in lanes of the type's width.
        let exp = (
            _mm_cvtsi32_si128(exp.0),
            if W == 16 {
                _mm256_set1_epi16(exp.1 as i16)
            } else {
                _mm256_set1_epi32(exp.1)
            },
        );
        let mut x = [_mm256_setzero_si256(); 4];
        for (v, xv) in x.iter_mut().enumerate() {
            *xv = _mm256_loadu_si256(xl.as_ptr().add(8 * v) as *const __m256i);
        }
        let one = _mm256_set1_epi32(1);
        let pk = table.packed.as_ptr() as *const i32;
        let m12 = _mm256_set1_epi32(0xfff);
        let zero = _mm256_setzero_si256();
        let scale = _mm256_set1_epi32(PROB_SCALE as i32);
        for k in (0..rows).rev() {
            let row = base + k * 32;
            let r = if W == 16 {
                prep16(input, state, ctx, row, exp)
            } else {
                prep32(input, state, ctx, row, exp)
            };
            same += r.same as usize;
            exp_same += r.exp_same as usize;
            // Extra bits (the decoder reads them after every lane's token: the low step, then
            // the high one), lanes downwards.
            if W == 32 {
                for v in (0..4).rev() {
                    put_bits(&mut x[v], r.hi[v], _mm256_srli_epi32(r.zs[v], 15), words);
                }
            }
            for v in (0..4).rev() {
                put_bits(&mut x[v], r.lo[v], r.zs[v], words);
            }
            // Tokens, lanes downwards.
            for v in (0..4).rev() {
                let p = _mm256_i32gather_epi32::<4>(pk, r.ks[v]);
                let cum = _mm256_and_si256(p, m12);
                let cmpl = _mm256_srli_epi32(p, 12);
                let freq = _mm256_sub_epi32(scale, cmpl);
                let xmax1 = _mm256_sub_epi32(_mm256_slli_epi32(freq, 31 - PROB_BITS as i32), one);
                let over = _mm256_cmpgt_epi32(x[v], xmax1);
                emit(&mut x[v], over, words);
                // q = x / freq: x < freq * 2^19 here, so the float quotient is within 1/16 of
                // the true one and one correction each way makes it exact.
                let mut q = _mm256_cvttps_epi32(_mm256_div_ps(
                    _mm256_cvtepi32_ps(x[v]),
                    _mm256_cvtepi32_ps(freq),
                ));
                let rem = _mm256_sub_epi32(x[v], _mm256_mullo_epi32(q, freq));
                q = _mm256_sub_epi32(q, _mm256_cmpgt_epi32(rem, _mm256_sub_epi32(freq, one)));
                q = _mm256_add_epi32(q, _mm256_cmpgt_epi32(zero, rem));
                // x' = (q << 12) + x - q * freq + cum = x + cum + q * (4096 - freq).
                x[v] = _mm256_add_epi32(_mm256_add_epi32(x[v], cum), _mm256_mullo_epi32(q, cmpl));
            }
        }
        for (v, xv) in x.iter().enumerate() {
            _mm256_storeu_si256(xl.as_mut_ptr().add(8 * v) as *mut __m256i, *xv);
        }
        rc.changed += 32 * rows - same;
        rc.exp_changed += 32 * rows - exp_same;
    }
}

/// Pass one where the vector coders apply (`applies`: AVX2 for the 16-bit types, AVX-512 for
/// fp32): the (context, token) counts into `hist` (four histograms of `delta::HIST` entries,
/// zeroed by the caller) and the counts, over the ranges `delta::count_ranges` counts. Returns
/// None (and does nothing) when this path does not apply.
pub(super) fn scan_vector<L: Layout>(
    input: &[u8],
    old: &[u8],
    ctx: &[u8],
    hist: &mut [u32],
) -> Option<ScanCounts> {
    if !applies::<L>() {
        return None;
    }
    let n = ctx.len();
    assert!(
        old.len() == input.len(),
        "delta avx2 scan: cache and input differ in size"
    );
    assert!(
        input.len() == L::BYTES * n,
        "delta avx2 scan: contexts and input differ in size"
    );
    assert!(
        hist.len() >= 4 * HIST,
        "delta avx2 scan: histograms too short"
    );
    #[cfg(target_arch = "x86_64")]
    {
        let mut c = ScanCounts::default();
        for (r, _) in super::delta::count_ranges(n).filter(|(_, counted)| *counted) {
            let (lo, hi) = (r.start, r.end);
            let full = lo + (hi - lo) / 16 * 16;
            let (inp, od, cx) = (
                &input[L::BYTES * lo..L::BYTES * hi],
                &old[L::BYTES * lo..L::BYTES * hi],
                &ctx[lo..hi],
            );
            // SAFETY: AVX2 is present (and AVX-512 where its pass one runs); the loops read
            // whole sixteens of elements below (hi - lo) / 16 * 16 of inp/od (L::BYTES per
            // element) and cx, slices of that length. Histogram indices are (j & 3) * HIST +
            // min(ctx, 16) * tokens(w) + token, with token < tokens(w), so below 3 * HIST +
            // NCTX * tokens(32) <= 4 * HIST (asserted above). fp32 has a pass one of its own
            // (measured: the 16-bit loop's shape made it half as fast).
            let part = unsafe {
                if L::BYTES == 2 {
                    avx2::scan::<L>(inp, od, cx, hist)
                } else if super::delta_avx512::on() {
                    super::delta_avx512::scan32::<L>(inp, od, cx, hist)
                } else {
                    avx2::scan32::<L>(inp, od, cx, hist)
                }
            };
            c.add(part);
            // The rest of the range (the chunk's last elements), plainly; histogram parity
            // does not matter (the four are summed).
            super::delta::scan_plain::<L>(input, old, ctx, full..hi, hist, &mut c);
        }
        Some(c)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// Counts of pass one.
#[derive(Default)]
pub(super) struct ScanCounts {
    pub extra_bits: u64,
    pub changed: usize,
    pub exp_changed: usize,
    /// Elements counted into the histograms (`delta::Scan`).
    pub counted: usize,
}

impl ScanCounts {
    /// Both counts together (`b` of elements after `a`'s).
    fn add(&mut self, b: ScanCounts) {
        self.extra_bits += b.extra_bits;
        self.changed += b.changed;
        self.exp_changed += b.exp_changed;
        self.counted += b.counted;
    }
}

/// The encoder's symbol table as the vector encoder gathers it (one gather per step): per
/// (context, token) index `cum | (4096 - freq) << 12` (both < 2^12 for present tokens; x_max
/// and the quotient x / freq follow from freq).
#[derive(Default)]
pub(super) struct EncTable {
    pub packed: Vec<u32>,
}

/// Encode `rows` full rows of 32 elements of a group starting at element `base`, backwards
/// (the last row first), with 32 lane states `x` into the group's `words`: the moves from the
/// cached values `state` and contexts `ctx` to `input`, updating both (the rows' values become
/// `input`'s, their contexts those the moves leave), adding the rows' changes (values, cached
/// fields) to `rc`. Returns false (and does nothing) when this path does not apply.
#[allow(clippy::too_many_arguments)]
pub(super) fn encode_rows<L: Layout>(
    table: &EncTable,
    ntok: usize,
    input: &[u8],
    state: &mut [u8],
    ctx: &mut [u8],
    x: &mut [u32],
    words: &mut Words<'_>,
    base: usize,
    rows: usize,
    rc: &mut RowCounts,
) -> bool {
    if x.len() != 32 || !applies::<L>() {
        return false;
    }
    let exp = (L::EXP_SHIFT as i32, L::EXP_MAX as i32);
    let end = base + rows * 32;
    // At most two words per element for the 16-bit types, three for fp32.
    let per = L::BYTES / 2 + 1;
    assert!(
        input.len() >= L::BYTES * end
            && state.len() >= L::BYTES * end
            && ctx.len() >= end
            && ntok == super::delta::tokens(8 * L::BYTES as u32)
            && table.packed.len() == NCTX * ntok
            && words.buf.len() >= words.pos + per * 32 * rows + 8,
        "delta avx2 encode: inconsistent buffers"
    );
    if rows == 0 {
        return true;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if super::delta_avx512::on() {
            assert!(
                words.buf.len() >= words.pos + per * 32 * rows + 32,
                "delta avx512 encode: words too short"
            );
            // SAFETY: AVX-512 F/BW/VL/CD/VBMI/VBMI2 are present (delta_avx512::on checked
            // them); the asserts above bound every access as for AVX2 (L::BYTES per element),
            // and the word stores are 32 words at pos, bounds-checked as a slice.
            unsafe {
                if L::BYTES == 4 {
                    super::delta_avx512::encode_rows::<32>(
                        table, input, state, ctx, x, words, base, rows, exp, rc,
                    )
                } else {
                    super::delta_avx512::encode_rows::<16>(
                        table, input, state, ctx, x, words, base, rows, exp, rc,
                    )
                }
            };
            return true;
        }
        // SAFETY: AVX2 is present; reads of input/state/ctx and writes of state/ctx stay below
        // element `end` (asserted); gather indices are min(ctx, 16) * ntok + token with
        // token < tokens(16) = ntok, so below NCTX * ntok, the table's length (asserted); word
        // stores are 8 words at pos, bounds-checked as a slice (at most two words per element
        // are emitted).
        unsafe {
            if L::BYTES == 4 {
                avx2::encode_rows::<32>(table, input, state, ctx, x, words, base, rows, exp, rc)
            } else {
                avx2::encode_rows::<16>(table, input, state, ctx, x, words, base, rows, exp, rc)
            }
        };
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
