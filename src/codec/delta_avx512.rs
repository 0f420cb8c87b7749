//! AVX-512 coding of Delta frames for the 16-bit types (bf16, fp16) and fp32: the 32 lanes of a
//! group as two vectors of sixteen states, one row of 32 elements per step, bit for bit what the
//! AVX2 coder in `delta_simd.rs` (16-bit types only) and the plain coder in `delta.rs` compute
//! on valid frames (the same frames, the same decodes); on a damaged stream every path runs the
//! same checks after each group, not necessarily with the same garbage on the way.
//!
//! fp32 differs from the 16-bit types only where the plain coder does: 32-bit keys and moves (a
//! row is two vectors of sixteen elements), 86 tokens, and extra bits in two steps (the low 15,
//! then the rest: the encoder puts the high step first, the decoder reads it last, each step
//! followed by a refill); pass one (`scan32`) is here too. Measured (`cargo bench --bench
//! codec`, fp32 rows, Zen 4): encode 0.22 -> 1.5-1.7 GB/s, decode 0.21 -> 2.4-2.6 GB/s.
//!
//! What differs from the AVX2 coder: mask registers instead of movemask and blends; the words
//! of a step's 32 lanes move in one 16-bit compress (encoder, in a register: the
//! memory-destination form is microcoded on Zen 4) or expand (decoder; the compiler folds the
//! word load into it, which measured as fast as the register form on Zen 4), with one popcount
//! of the 32-bit mask advancing the stream position; the encoder's quotient `x / freq` comes
//! from a reciprocal (`rcp14` and one Newton step, off the state's dependency chain) instead of
//! a division, with the same exact correction by one either way; the encoder holds its states
//! in descending lane order (lanes 31..16, then 15..0), so that the words of a step compress in
//! the order the encoder writes them (highest lane first) without a permute per step, and
//! makes each row's moves, tokens and table gathers a row ahead; and the decoder runs two
//! whole groups in lockstep (`delta::decode` pairs them), so that one group's table gathers
//! (on its states' dependency chain) overlap the other's.
//!
//! Dispatch: `delta_simd::{encode_rows, decode_rows, scan_vector}` take this path when [`on`]
//! says so: the AVX2 path applies (`CIERA_NO_SIMD` unset) and the processor has AVX-512 F, BW,
//! VL, CD, VBMI and VBMI2; `CIERA_NO_AVX512=1` keeps the AVX2 path (for diff-testing and for
//! timing it).
#![allow(unsafe_code)] // the AVX-512 intrinsics; every block says why it is sound

/// Whether the AVX-512 coders apply: the vector coders apply (`delta_simd::on`), the processor
/// has the AVX-512 subsets they use, and `CIERA_NO_AVX512` is unset (or "0").
pub(super) fn on() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static ON: OnceLock<bool> = OnceLock::new();
        *ON.get_or_init(|| {
            super::delta_simd::on()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx512cd")
                && std::is_x86_feature_detected!("avx512vbmi")
                && std::is_x86_feature_detected!("avx512vbmi2")
                && std::env::var_os("CIERA_NO_AVX512").is_none_or(|v| v == "0")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Bytes a decoder may read past the end of the lane section (one 32-word load); the caller's
/// `padded` copy of the section ends with at least this many zero bytes.
pub(super) const PAD: usize = 64;

#[cfg(target_arch = "x86_64")]
pub(super) use imp::{decode_rows, encode_rows, scan32};

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::arch::x86_64::*;

    use super::super::delta::{Reader, Words, CLIP, PROB_BITS, PROB_SCALE, RANS_L};
    use super::super::delta_simd::{EncTable, RowCounts, ScanCounts};
    use super::super::float::Layout;

    /// Word indices for `_mm512_permutex2var_epi16(a, EVEN, b)`: the low words of the sixteen
    /// 32-bit lanes of `a`, then of `b` (32 words in lane order).
    const EVEN: [i16; 32] = {
        let mut t = [0i16; 32];
        let mut j = 0;
        while j < 32 {
            t[j] = 2 * j as i16;
            j += 1;
        }
        t
    };

    /// Word indices for `_mm512_permutex2var_epi16(zz, REV[h], zero)`: 32-bit lane j of half h
    /// takes word 31 - (16h + j) of `zz`, zero-extended (word 32: the first of `zero`).
    const REV: [[i16; 32]; 2] = {
        let mut t = [[32i16; 32]; 2];
        let mut h = 0;
        while h < 2 {
            let mut j = 0;
            while j < 16 {
                t[h][2 * j] = 31 - (16 * h + j) as i16;
                j += 1;
            }
            h += 1;
        }
        t
    };

    /// Byte indices for `_mm512_maskz_permutexvar_epi8(0x1111.., REVB[h], c)`: 32-bit lane j of
    /// half h takes byte 31 - (16h + j) of `c`, zero-extended.
    const REVB: [[i8; 64]; 2] = {
        let mut t = [[0i8; 64]; 2];
        let mut h = 0;
        while h < 2 {
            let mut j = 0;
            while j < 16 {
                t[h][4 * j] = 31 - (16 * h + j) as i8;
                j += 1;
            }
            h += 1;
        }
        t
    };

    /// Elements ahead of the row being coded (decode: on, encode: back, as it codes
    /// backwards) whose lines the row coders ask for: two groups coded in lockstep are six to
    /// eight streams, more than the hardware prefetchers follow (measured, 64 MiB chunks, one
    /// core: Delta decode 4-14% faster).
    const AHEAD: usize = 2048;

    /// `simd::prefetch_lines` of `bytes` bytes from element `at` (of `size` bytes) of `p`.
    #[inline(always)]
    fn prefetch<const WRITE: bool>(p: *const u8, at: usize, size: usize, bytes: usize) {
        super::super::simd::prefetch_lines::<WRITE>(p.wrapping_add(at * size), bytes);
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    fn load_i16x32(t: &[i16; 32]) -> __m512i {
        // SAFETY: `t` is 64 readable bytes.
        unsafe { _mm512_loadu_si512(t.as_ptr() as *const _) }
    }

    /// The lanes' states as two vectors of sixteen (lanes 0..16, 16..32), or in descending
    /// order (lanes 31..16, 15..0) when `rev`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    fn load_states(xl: &[u32], rev: bool) -> [__m512i; 2] {
        assert!(xl.len() == 32);
        // SAFETY: xl holds 32 u32 (asserted): two 64-byte loads.
        let (a, b) = unsafe {
            (
                _mm512_loadu_si512(xl.as_ptr() as *const _),
                _mm512_loadu_si512(xl.as_ptr().add(16) as *const _),
            )
        };
        if rev {
            let r = _mm512_set_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            [
                _mm512_permutexvar_epi32(r, b),
                _mm512_permutexvar_epi32(r, a),
            ]
        } else {
            [a, b]
        }
    }

    /// The inverse of [`load_states`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    fn store_states(xl: &mut [u32], x: [__m512i; 2], rev: bool) {
        assert!(xl.len() == 32);
        let [a, b] = if rev {
            let r = _mm512_set_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            [
                _mm512_permutexvar_epi32(r, x[1]),
                _mm512_permutexvar_epi32(r, x[0]),
            ]
        } else {
            x
        };
        // SAFETY: xl holds 32 u32 (asserted): two 64-byte stores.
        unsafe {
            _mm512_storeu_si512(xl.as_mut_ptr() as *mut _, a);
            _mm512_storeu_si512(xl.as_mut_ptr().add(16) as *mut _, b);
        }
    }

    /// Lanes of sixteen 32-bit values `a` and `b` whose cached fields (`exp_max << exp_shift`)
    /// are equal: the exponent changes every pass counts.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    fn fields_same32(a: __m512i, b: __m512i, exp_shift: __m128i, exp_max: __m512i) -> u32 {
        let ex = _mm512_and_si512(_mm512_srl_epi32(_mm512_xor_si512(a, b), exp_shift), exp_max);
        _mm512_cmpeq_epi32_mask(ex, _mm512_setzero_si512()).count_ones()
    }

    /// As [`fields_same32`] for 32 16-bit values (`exp_max` in 16-bit lanes).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    fn fields_same16(a: __m512i, b: __m512i, exp_shift: __m128i, exp_max: __m512i) -> u32 {
        let ex = _mm512_and_si512(_mm512_srl_epi16(_mm512_xor_si512(a, b), exp_shift), exp_max);
        _mm512_cmpeq_epi16_mask(ex, _mm512_setzero_si512()).count_ones()
    }

    /// The context bytes 32 16-bit moves leave (`delta::context_of`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    fn contexts32(d: __m512i) -> __m256i {
        let chi = _mm512_set1_epi16(CLIP as i16);
        let cl = _mm512_add_epi16(
            _mm512_min_epi16(_mm512_max_epi16(d, _mm512_set1_epi16(-CLIP as i16)), chi),
            chi,
        );
        _mm512_cvtepi16_epi8(cl)
    }

    /// The order key of 32 16-bit values: u ^ 0xffff with the sign bit set, else u ^ 0x8000.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    fn key32(u: __m512i) -> __m512i {
        _mm512_xor_si512(
            u,
            _mm512_or_si512(_mm512_srai_epi16::<15>(u), _mm512_set1_epi16(i16::MIN)),
        )
    }

    /// The order key of 16 32-bit values: u ^ 0xffffffff with the sign bit set, else
    /// u ^ 0x80000000.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    fn key32x(u: __m512i) -> __m512i {
        _mm512_xor_si512(
            u,
            _mm512_or_si512(_mm512_srai_epi32::<31>(u), _mm512_set1_epi32(i32::MIN)),
        )
    }

    /// The context bytes 32 32-bit moves (elements 0..16, 16..32) leave.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    fn contexts_d32(d: [__m512i; 2]) -> __m256i {
        let chi = _mm512_set1_epi32(CLIP);
        let c = d.map(|v| {
            _mm512_cvtepi32_epi8(_mm512_add_epi32(
                _mm512_min_epi32(_mm512_max_epi32(v, _mm512_set1_epi32(-CLIP)), chi),
                chi,
            ))
        });
        _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(c[0]), c[1])
    }

    /// Pass one of a 32-bit type over the first `n / 16 * 16` elements: the (context, token)
    /// counts into four histograms of HIST entries each (`hist`, element j of each sixteen into
    /// histogram j % 4), as `delta_simd`'s AVX2 pass one for the 16-bit types.
    ///
    /// # Safety
    /// The processor has the enabled features; `input` and `old` hold `4 n` bytes, `ctx` `n`,
    /// `hist` `4 * HIST` entries, and `HIST >= NCTX * tokens(32)`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    pub(in crate::codec) unsafe fn scan32<L: Layout>(
        input: &[u8],
        old: &[u8],
        ctx: &[u8],
        hist: &mut [u32],
    ) -> ScanCounts {
        let n = ctx.len();
        let one = _mm512_set1_epi32(1);
        let ntok = _mm512_set1_epi32(crate::codec::delta::tokens(32) as i32);
        let cmax = _mm512_set1_epi32(2 * CLIP);
        let exp_shift = _mm_cvtsi32_si128(L::EXP_SHIFT as i32);
        let exp_max = _mm512_set1_epi32(L::EXP_MAX as i32);
        let zero = _mm512_setzero_si512();
        let h = hist.as_mut_ptr();
        let mut extra = zero;
        let (mut same, mut exp_same) = (0usize, 0usize);
        let full = n / 16 * 16;
        let mut ks = [0u64; 8];
        let mut i = 0;
        while i < full {
            // SAFETY: i + 16 <= n: 64 bytes of input and old, 16 of ctx.
            let (a, b, c8) = unsafe {
                (
                    _mm512_loadu_si512(old.as_ptr().add(4 * i) as *const _),
                    _mm512_loadu_si512(input.as_ptr().add(4 * i) as *const _),
                    _mm_loadu_si128(ctx.as_ptr().add(i) as *const __m128i),
                )
            };
            let d = _mm512_sub_epi32(key32x(b), key32x(a));
            let z = _mm512_xor_si512(_mm512_slli_epi32::<1>(d), _mm512_srai_epi32::<31>(d));
            let lg = _mm512_sub_epi32(_mm512_set1_epi32(31), _mm512_lzcnt_epi32(z));
            let big = _mm512_cmpgt_epu32_mask(z, _mm512_set1_epi32(31));
            let bm1 = _mm512_sub_epi32(lg, one);
            let tb = _mm512_add_epi32(
                _mm512_add_epi32(_mm512_slli_epi32::<1>(lg), _mm512_set1_epi32(22)),
                _mm512_and_si512(_mm512_srlv_epi32(z, bm1), one),
            );
            let t = _mm512_mask_blend_epi32(big, z, tb);
            extra = _mm512_mask_add_epi32(extra, big, extra, bm1);
            let c = _mm512_min_epu32(_mm512_cvtepu8_epi32(c8), cmax);
            let k = _mm512_add_epi32(_mm512_mullo_epi32(c, ntok), t);
            // SAFETY: ks is 64 bytes.
            unsafe { _mm512_storeu_si512(ks.as_mut_ptr() as *mut _, k) };
            // SAFETY: every index < NCTX * tokens(32) <= HIST (contexts clipped to 16, tokens
            // below tokens(32)); `h` holds 4 * HIST counters, the caller's bound.
            unsafe { super::super::delta_simd::count_pairs(h, &ks) };
            same += _mm512_cmpeq_epi32_mask(a, b).count_ones() as usize;
            exp_same += fields_same32(a, b, exp_shift, exp_max) as usize;
            i += 16;
        }
        // Per lane at most 30 bits an element: no lane overflows below 2^31 elements.
        let mut e = [0u32; 16];
        // SAFETY: e is 64 bytes.
        unsafe { _mm512_storeu_si512(e.as_mut_ptr() as *mut _, extra) };
        ScanCounts {
            extra_bits: e.iter().map(|&v| v as u64).sum(),
            changed: full - same,
            exp_changed: full - exp_same,
            counted: full,
        }
    }

    /// Append the low words of the lanes set in `over` (the first vector's lanes, then the
    /// second's, in position order: the encoder's states are in descending lane order) to the
    /// group's words, then shift those states right by 16.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    fn emit(x: &mut [__m512i; 2], over: [__mmask16; 2], even: __m512i, words: &mut Words<'_>) {
        let m = over[0] as u32 | (over[1] as u32) << 16;
        let lo = _mm512_permutex2var_epi16(x[0], even, x[1]);
        let packed = _mm512_maskz_compress_epi16(m, lo);
        // Without a branch on the mask: with no lane over, the store writes past the words
        // (overwritten later) and the position does not move.
        let dst = &mut words.buf[words.pos..words.pos + 32];
        // SAFETY: dst is 32 u16 (64 bytes), bounds-checked as a slice.
        unsafe { _mm512_storeu_si512(dst.as_mut_ptr() as *mut _, packed) };
        words.pos += m.count_ones() as usize;
        for v in 0..2 {
            x[v] = _mm512_mask_srli_epi32::<16>(x[v], over[v], x[v]);
        }
    }

    /// What the coding steps of one row take, lanes in the encoder's descending order: zigzag
    /// moves, extra bit counts of the low step (at most 15) and of the high step (32-bit types:
    /// the bits above 15), whether any lane has bits in each, and the gathered table entries.
    struct RowIn {
        zs: [__m512i; 2],
        lo: [__m512i; 2],
        hi: [__m512i; 2],
        any_lo: bool,
        any_hi: bool,
        ps: [__m512i; 2],
        /// Elements of the row whose value, and whose cached field, did not change.
        same: u32,
        exp_same: u32,
    }

    /// The constants of the encoder's row preparation.
    struct Prep {
        zero: __m512i,
        one: __m512i,
        cmax: __m512i,
        ntok: __m512i,
        pk: *const i32,
        rev: [__m512i; 2],
        revb: [__m512i; 2],
        rev32: __m512i,
        /// The cached field: `exp_max << exp_shift` (16- or 32-bit lanes as the type).
        exp_shift: __m128i,
        exp_max: __m512i,
    }

    /// Tokens, extra bit counts and table entries of the zigzag moves `z` (two vectors of 16,
    /// descending lanes) under the context bytes `c512` (the row's 32, ascending).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    unsafe fn tokens_of(k: &Prep, z: [__m512i; 2], c512: __m512i) -> RowIn {
        let mut r = RowIn {
            zs: z,
            lo: [k.zero; 2],
            hi: [k.zero; 2],
            any_lo: false,
            any_hi: false,
            ps: [k.zero; 2],
            same: 0,
            exp_same: 0,
        };
        let fifteen = _mm512_set1_epi32(15);
        for (h, &zh) in z.iter().enumerate() {
            // Lanes 31 - 16h - j, j = 0..16: their old contexts.
            let c = _mm512_min_epu32(
                _mm512_maskz_permutexvar_epi8(0x1111_1111_1111_1111, k.revb[h], c512),
                k.cmax,
            );
            // Tokens: z below 32 itself, else 2 * lg + 22 + bit lg - 1, with lg - 1 extra bits
            // (lg = floor(log2 z)).
            let lg = _mm512_sub_epi32(_mm512_set1_epi32(31), _mm512_lzcnt_epi32(zh));
            let big = _mm512_cmpgt_epu32_mask(zh, _mm512_set1_epi32(31));
            let bm1 = _mm512_sub_epi32(lg, k.one);
            let tb = _mm512_add_epi32(
                _mm512_add_epi32(_mm512_slli_epi32::<1>(lg), _mm512_set1_epi32(22)),
                _mm512_and_si512(_mm512_srlv_epi32(zh, bm1), k.one),
            );
            let t = _mm512_mask_blend_epi32(big, zh, tb);
            let kidx = _mm512_add_epi32(_mm512_mullo_epi32(c, k.ntok), t);
            // SAFETY: kidx < NCTX * ntok = the table's length (contexts clipped to 16, tokens
            // below ntok): the caller's bound.
            r.ps[h] = unsafe { _mm512_i32gather_epi32::<4>(kidx, k.pk) };
            let e = _mm512_maskz_mov_epi32(big, bm1);
            r.lo[h] = _mm512_min_epu32(e, fifteen);
            r.hi[h] = _mm512_max_epi32(_mm512_sub_epi32(e, fifteen), k.zero);
            r.any_lo |= big != 0;
            r.any_hi |= _mm512_test_epi32_mask(r.hi[h], r.hi[h]) != 0;
        }
        r
    }

    /// A row of a 16-bit type from element `row`: its moves (the row then takes the new values
    /// and the contexts they leave), tokens and table entries.
    ///
    /// # Safety
    /// 64 bytes of `input` and `state` and 32 of `ctx` at the row; the table as for
    /// [`tokens_of`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    unsafe fn prep16(
        k: &Prep,
        input: &[u8],
        state: &mut [u8],
        ctx: &mut [u8],
        row: usize,
    ) -> RowIn {
        // SAFETY: the caller's bound.
        unsafe {
            let a = _mm512_loadu_si512(state.as_ptr().add(2 * row) as *const _);
            let b = _mm512_loadu_si512(input.as_ptr().add(2 * row) as *const _);
            let c8 = _mm256_loadu_si256(ctx.as_ptr().add(row) as *const __m256i);
            let same = _mm512_cmpeq_epi16_mask(a, b).count_ones();
            let exp_same = fields_same16(a, b, k.exp_shift, k.exp_max);
            let d = _mm512_sub_epi16(key32(b), key32(a));
            let zz = _mm512_xor_si512(_mm512_slli_epi16::<1>(d), _mm512_srai_epi16::<15>(d));
            _mm256_storeu_si256(ctx.as_mut_ptr().add(row) as *mut __m256i, contexts32(d));
            _mm512_storeu_si512(state.as_mut_ptr().add(2 * row) as *mut _, b);
            // Lanes 31 - 16h - j: zigzag moves, zero-extended.
            let z = [
                _mm512_permutex2var_epi16(zz, k.rev[0], k.zero),
                _mm512_permutex2var_epi16(zz, k.rev[1], k.zero),
            ];
            RowIn {
                same,
                exp_same,
                ..tokens_of(k, z, _mm512_castsi256_si512(c8))
            }
        }
    }

    /// As [`prep16`] for a 32-bit type (128 bytes of `input` and `state` at the row).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    unsafe fn prep32(
        k: &Prep,
        input: &[u8],
        state: &mut [u8],
        ctx: &mut [u8],
        row: usize,
    ) -> RowIn {
        // SAFETY: the caller's bound.
        unsafe {
            let sp = state.as_ptr().add(4 * row);
            let ip = input.as_ptr().add(4 * row);
            let a = [
                _mm512_loadu_si512(sp as *const _),
                _mm512_loadu_si512(sp.add(64) as *const _),
            ];
            let b = [
                _mm512_loadu_si512(ip as *const _),
                _mm512_loadu_si512(ip.add(64) as *const _),
            ];
            let c8 = _mm256_loadu_si256(ctx.as_ptr().add(row) as *const __m256i);
            let (mut same, mut exp_same) = (0, 0);
            for h in 0..2 {
                same += _mm512_cmpeq_epi32_mask(a[h], b[h]).count_ones();
                exp_same += fields_same32(a[h], b[h], k.exp_shift, k.exp_max);
            }
            let d = [
                _mm512_sub_epi32(key32x(b[0]), key32x(a[0])),
                _mm512_sub_epi32(key32x(b[1]), key32x(a[1])),
            ];
            _mm256_storeu_si256(ctx.as_mut_ptr().add(row) as *mut __m256i, contexts_d32(d));
            let so = state.as_mut_ptr().add(4 * row);
            _mm512_storeu_si512(so as *mut _, b[0]);
            _mm512_storeu_si512(so.add(64) as *mut _, b[1]);
            let zz =
                d.map(|v| _mm512_xor_si512(_mm512_slli_epi32::<1>(v), _mm512_srai_epi32::<31>(v)));
            // Descending lanes: elements 31..16, then 15..0.
            let z = [
                _mm512_permutexvar_epi32(k.rev32, zz[1]),
                _mm512_permutexvar_epi32(k.rev32, zz[0]),
            ];
            RowIn {
                same,
                exp_same,
                ..tokens_of(k, z, _mm512_castsi256_si512(c8))
            }
        }
    }

    /// `bits` (per lane, at most 15) raw bits `v` into the states (the scalar `put_bits`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    fn put_bits(
        x: &mut [__m512i; 2],
        bits: [__m512i; 2],
        v: [__m512i; 2],
        even: __m512i,
        words: &mut Words<'_>,
    ) {
        let one = _mm512_set1_epi32(1);
        let top = _mm512_set1_epi32(i32::MIN); // 2^31 as u32
        let mut over = [0 as __mmask16; 2];
        for h in 0..2 {
            let lim = _mm512_sub_epi32(_mm512_srlv_epi32(top, bits[h]), one);
            over[h] = _mm512_cmpgt_epu32_mask(x[h], lim);
        }
        emit(x, over, even, words);
        for h in 0..2 {
            let low = _mm512_sub_epi32(_mm512_sllv_epi32(one, bits[h]), one);
            x[h] = _mm512_or_si512(
                _mm512_sllv_epi32(x[h], bits[h]),
                _mm512_and_si512(v[h], low),
            );
        }
    }

    /// Encode `rows` full rows of a group backwards, of a type of `W` (16 or 32) bits; see
    /// `delta_simd::encode_rows`, which asserts the bounds this relies on.
    ///
    /// # Safety
    /// The processor has the enabled features; `input` and `state` hold at least
    /// `W / 8 * (base + 32 * rows)` bytes, `ctx` at least `base + 32 * rows` (any context byte:
    /// they are clipped to 16 here); `table.packed` holds `NCTX * tokens(W)` entries;
    /// `words.buf` holds at least `words.pos + (W / 16 + 1) * 32 * rows + 32` words (at most two
    /// words per element for W = 16, three for W = 32, and a 32-word store past the last).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    pub(in crate::codec) unsafe fn encode_rows<const W: u32>(
        table: &EncTable,
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
        let mut x = load_states(xl, true);
        let one = _mm512_set1_epi32(1);
        let m12 = _mm512_set1_epi32(0xfff);
        let zero = _mm512_setzero_si512();
        let scale = _mm512_set1_epi32(PROB_SCALE as i32);
        let two = _mm512_set1_ps(2.0);
        let even = load_i16x32(&EVEN);
        let k = Prep {
            zero,
            one,
            cmax: _mm512_set1_epi32(2 * CLIP),
            ntok: _mm512_set1_epi32(crate::codec::delta::tokens(W) as i32),
            pk: table.packed.as_ptr() as *const i32,
            rev: [load_i16x32(&REV[0]), load_i16x32(&REV[1])],
            // SAFETY: REVB rows are 64 readable bytes.
            revb: unsafe {
                [
                    _mm512_loadu_si512(REVB[0].as_ptr() as *const _),
                    _mm512_loadu_si512(REVB[1].as_ptr() as *const _),
                ]
            },
            rev32: _mm512_set_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            exp_shift: _mm_cvtsi32_si128(exp.0),
            exp_max: if W == 16 {
                _mm512_set1_epi16(exp.1 as i16)
            } else {
                _mm512_set1_epi32(exp.1)
            },
        };
        let (mut same, mut exp_same) = (0usize, 0usize);
        // The rows' moves, tokens and table entries depend on the data only, not on the
        // states: each row's are made (gathers issued) one row ahead of its coding steps.
        let prep = |row: usize, state: &mut [u8], ctx: &mut [u8]| {
            // SAFETY: row + 32 <= base + 32 * rows, the caller's bounds (either width).
            unsafe {
                if W == 16 {
                    prep16(&k, input, state, ctx, row)
                } else {
                    prep32(&k, input, state, ctx, row)
                }
            }
        };
        if rows == 0 {
            return;
        }
        let mut next = prep(base + (rows - 1) * 32, state, ctx);
        for r in (0..rows).rev() {
            // fp32 only: bf16 rows code no faster with it (measured: fp32 encode 5-10% faster,
            // bf16 1-5% slower; the bf16 coder is bound by its vector ports).
            if let Some(back) = (base + r * 32).checked_sub(AHEAD).filter(|_| W == 32) {
                let size = W as usize / 8;
                prefetch::<false>(input.as_ptr(), back, size, 32 * size);
                prefetch::<true>(state.as_ptr(), back, size, 32 * size);
                prefetch::<true>(ctx.as_ptr(), back, 1, 32);
            }
            let RowIn {
                zs,
                lo,
                hi,
                any_lo,
                any_hi,
                ps,
                same: sr,
                exp_same: er,
            } = next;
            same += sr as usize;
            exp_same += er as usize;
            if r > 0 {
                next = prep(base + (r - 1) * 32, state, ctx);
            }
            // Extra bits (the decoder reads them after every lane's token: the low step, then
            // the high one), lanes downwards. Without extra bits a step changes nothing
            // (x < 2^31: no word either).
            if any_hi {
                let zh = [
                    _mm512_srli_epi32::<15>(zs[0]),
                    _mm512_srli_epi32::<15>(zs[1]),
                ];
                put_bits(&mut x, hi, zh, even, words);
            }
            if any_lo {
                put_bits(&mut x, lo, zs, even, words);
            }
            // Tokens, lanes downwards.
            let mut over = [0 as __mmask16; 2];
            let (mut cum, mut freq, mut rf) = ([zero; 2], [zero; 2], [_mm512_setzero_ps(); 2]);
            for v in 0..2 {
                let p = ps[v];
                cum[v] = _mm512_and_si512(p, m12);
                freq[v] = _mm512_sub_epi32(scale, _mm512_srli_epi32::<12>(p));
                let xmax1 = _mm512_sub_epi32(_mm512_slli_epi32::<{ 31 - PROB_BITS }>(freq[v]), one);
                over[v] = _mm512_cmpgt_epu32_mask(x[v], xmax1);
                // 1 / freq to about 2^-23: rcp14 and one Newton step.
                let f = _mm512_cvtepi32_ps(freq[v]);
                let r0 = _mm512_rcp14_ps(f);
                rf[v] = _mm512_mul_ps(r0, _mm512_fnmadd_ps(f, r0, two));
            }
            emit(&mut x, over, even, words);
            for v in 0..2 {
                // q = x / freq: x < freq * 2^19 here, so the float quotient is within 1/8 of
                // the true one and one correction each way makes it exact.
                let xv = x[v];
                let mut q = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_cvtepi32_ps(xv), rf[v]));
                let mut r = _mm512_sub_epi32(xv, _mm512_mullo_epi32(q, freq[v]));
                let hi = _mm512_cmpge_epi32_mask(r, freq[v]);
                q = _mm512_mask_add_epi32(q, hi, q, one);
                r = _mm512_mask_sub_epi32(r, hi, r, freq[v]);
                let lo = _mm512_cmplt_epi32_mask(r, zero);
                q = _mm512_mask_sub_epi32(q, lo, q, one);
                r = _mm512_mask_add_epi32(r, lo, r, freq[v]);
                // x' = (q << 12) + x mod freq + cum.
                x[v] = _mm512_add_epi32(
                    _mm512_add_epi32(_mm512_slli_epi32::<{ PROB_BITS }>(q), r),
                    cum[v],
                );
            }
        }
        store_states(xl, x, true);
        rc.changed += 32 * rows - same;
        rc.exp_changed += 32 * rows - exp_same;
    }

    /// Refill the lanes below RANS_L with the next words of the stream, in lane order.
    ///
    /// # Safety
    /// `base + min(rd.at, limit) + 64` bytes are readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    unsafe fn refill(x: &mut [__m512i; 2], rd: &mut Reader, base: *const u8, limit: usize) {
        let l = _mm512_set1_epi32(RANS_L as i32);
        let need = [
            _mm512_cmplt_epu32_mask(x[0], l),
            _mm512_cmplt_epu32_mask(x[1], l),
        ];
        let m = need[0] as u32 | (need[1] as u32) << 16;
        // No branch on the mask (as good as random): with no lane in need nothing changes.
        // SAFETY: the caller's bound.
        let w = unsafe { _mm512_loadu_si512(base.add(rd.at.min(limit)) as *const _) };
        let we = _mm512_maskz_expand_epi16(m, w);
        let wv = [
            _mm512_cvtepu16_epi32(_mm512_castsi512_si256(we)),
            _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64::<1>(we)),
        ];
        for v in 0..2 {
            x[v] = _mm512_mask_or_epi32(x[v], need[v], _mm512_slli_epi32::<16>(x[v]), wv[v]);
        }
        rd.at += 2 * m.count_ones() as usize;
    }

    /// Tokens `t` (those in `big` above the direct ones) -> the high part of their zigzag
    /// values and their extra bit counts (the scalar `detokenize`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    fn detoken(t: __m512i, big: __mmask16) -> (__m512i, __m512i) {
        let bm1 = _mm512_add_epi32(
            _mm512_srli_epi32::<1>(_mm512_sub_epi32(t, _mm512_set1_epi32(32))),
            _mm512_set1_epi32(4),
        );
        let zb = _mm512_sllv_epi32(
            _mm512_or_si512(
                _mm512_set1_epi32(2),
                _mm512_and_si512(t, _mm512_set1_epi32(1)),
            ),
            bm1,
        );
        (
            _mm512_mask_blend_epi32(big, t, zb),
            _mm512_maskz_mov_epi32(big, bm1),
        )
    }

    /// The extra bits and values of a row of a 32-bit type whose tokens `t` (lanes 0..16,
    /// 16..32) were decoded, from element `row`: the low step of at most 15 bits, then the
    /// high step (the bits above), each followed by a refill, as the scalar decoder; the new
    /// values go to `out` and `state`, the contexts they leave to `ctx`. Returns the row's
    /// unchanged values and values with an unchanged exponent.
    ///
    /// # Safety
    /// As `decode_rows`: `padded` holds `limit + 64` bytes; 128 bytes of `state` and `out`
    /// and 32 of `ctx` at the row.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    unsafe fn values32<L: Layout>(
        x: &mut [__m512i; 2],
        t: [__m512i; 2],
        rd: &mut Reader,
        s0: *const u8,
        limit: usize,
        state: &mut [u8],
        ctx: &mut [u8],
        out: &mut [u8],
        row: usize,
    ) -> (u64, u64) {
        let zero = _mm512_setzero_si512();
        let one = _mm512_set1_epi32(1);
        let fifteen = _mm512_set1_epi32(15);
        let big = [
            _mm512_cmpgt_epu32_mask(t[0], _mm512_set1_epi32(31)),
            _mm512_cmpgt_epu32_mask(t[1], _mm512_set1_epi32(31)),
        ];
        let mut zs = t;
        if big[0] | big[1] != 0 {
            let mut hi = [zero; 2];
            for v in 0..2 {
                // At most 30 extra bits for 32 bits.
                let (z, eb) = detoken(t[v], big[v]);
                let lo = _mm512_min_epu32(eb, fifteen);
                hi[v] = _mm512_max_epi32(_mm512_sub_epi32(eb, fifteen), zero);
                let low = _mm512_sub_epi32(_mm512_sllv_epi32(one, lo), one);
                zs[v] = _mm512_or_si512(z, _mm512_and_si512(x[v], low));
                x[v] = _mm512_srlv_epi32(x[v], lo);
            }
            // SAFETY: the caller's bound.
            unsafe { refill(x, rd, s0, limit) };
            if _mm512_test_epi32_mask(hi[0], hi[0]) | _mm512_test_epi32_mask(hi[1], hi[1]) != 0 {
                for v in 0..2 {
                    let low = _mm512_sub_epi32(_mm512_sllv_epi32(one, hi[v]), one);
                    zs[v] = _mm512_or_si512(
                        zs[v],
                        _mm512_slli_epi32::<15>(_mm512_and_si512(x[v], low)),
                    );
                    x[v] = _mm512_srlv_epi32(x[v], hi[v]);
                }
                // SAFETY: as above.
                unsafe { refill(x, rd, s0, limit) };
            }
        }
        // Moves -> new values: unkey(key(old) + d).
        let d = zs.map(|z| {
            _mm512_xor_si512(
                _mm512_srli_epi32::<1>(z),
                _mm512_srai_epi32::<31>(_mm512_slli_epi32::<31>(z)),
            )
        });
        let exp_shift = _mm_cvtsi32_si128(L::EXP_SHIFT as i32);
        let exp_max = _mm512_set1_epi32(L::EXP_MAX as i32);
        let (mut unchanged, mut exp_same) = (0u64, 0u64);
        // SAFETY: the caller's bound: 128 bytes of state and out, 32 of ctx at the row.
        unsafe {
            let sp = state.as_mut_ptr().add(4 * row);
            let op = out.as_mut_ptr().add(4 * row);
            for (v, &dv) in d.iter().enumerate() {
                let old = _mm512_loadu_si512(sp.add(64 * v) as *const _);
                let kk = _mm512_add_epi32(key32x(old), dv);
                // unkey: k ^ 0x80000000 with the sign bit set, else k ^ 0xffffffff.
                let new = _mm512_xor_si512(
                    kk,
                    _mm512_or_si512(
                        _mm512_andnot_si512(
                            _mm512_srai_epi32::<31>(kk),
                            _mm512_set1_epi32(i32::MAX),
                        ),
                        _mm512_set1_epi32(i32::MIN),
                    ),
                );
                _mm512_storeu_si512(op.add(64 * v) as *mut _, new);
                _mm512_storeu_si512(sp.add(64 * v) as *mut _, new);
                unchanged += _mm512_cmpeq_epi32_mask(dv, zero).count_ones() as u64;
                exp_same += fields_same32(old, new, exp_shift, exp_max) as u64;
            }
            _mm256_storeu_si256(ctx.as_mut_ptr().add(row) as *mut __m256i, contexts_d32(d));
        }
        (unchanged, exp_same)
    }

    /// Decode `rows` full rows of each of `G` groups (one or two) in lockstep, group `g` from
    /// element `bases[g]` with states `xls[g]` and stream `rds[g]` (the groups' steps are
    /// independent: two groups keep twice the table gathers in flight); see
    /// `delta_simd::decode_rows`, which asserts the bounds this relies on.
    ///
    /// # Safety
    /// The processor has the enabled features; `padded` holds at least `limit + 64` bytes;
    /// `dec` holds `NCTX * PROB_SCALE` entries; `ctx` holds at least `bases[g] + 32 * rows`
    /// bytes for every g, `state` and `out` `L::BYTES` (2 or 4) times that; each `xls[g]` holds 32
    /// states.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512cd,avx512vbmi,avx512vbmi2,popcnt")]
    pub(in crate::codec) unsafe fn decode_rows<L: Layout, const G: usize>(
        padded: &[u8],
        limit: usize,
        dec: &[u32],
        xls: [&mut [u32]; G],
        rds: [&mut Reader; G],
        state: &mut [u8],
        ctx: &mut [u8],
        out: &mut [u8],
        bases: [usize; G],
        rows: usize,
        counts: &mut RowCounts,
    ) {
        let zero = _mm512_setzero_si512();
        let mut x = [[zero; 2]; G];
        for g in 0..G {
            x[g] = load_states(xls[g], false);
        }
        let s0 = padded.as_ptr();
        let table = dec.as_ptr() as *const i32;
        let one = _mm512_set1_epi32(1);
        let mslot = _mm512_set1_epi32(PROB_SCALE as i32 - 1);
        let m4095 = _mm512_set1_epi32(4095);
        let cmax = _mm512_set1_epi32(2 * CLIP);
        let exp_shift = _mm_cvtsi32_si128(L::EXP_SHIFT as i32);
        let exp_max16 = _mm512_set1_epi16(L::EXP_MAX as i16);
        let (h8000, h7fff) = (_mm512_set1_epi16(i16::MIN), _mm512_set1_epi16(0x7fff));
        let even = load_i16x32(&EVEN);
        let (mut unchanged, mut exp_same) = (0u64, 0u64);
        let mut no_table: __mmask16 = 0;
        for k in 0..rows {
            let mut t = [[zero; 2]; G];
            for base in bases {
                let ahead = base + k * 32 + AHEAD;
                prefetch::<false>(state.as_ptr(), ahead, L::BYTES, 32 * L::BYTES);
                prefetch::<true>(out.as_ptr(), ahead, L::BYTES, 32 * L::BYTES);
                prefetch::<false>(ctx.as_ptr(), ahead, 1, 32);
            }
            for g in 0..G {
                let row = bases[g] + k * 32;
                // SAFETY: row + 32 <= bases[g] + 32 * rows: 32 bytes of ctx.
                let c8 = unsafe { _mm256_loadu_si256(ctx.as_ptr().add(row) as *const __m256i) };
                let cs = [
                    _mm512_cvtepu8_epi32(_mm256_castsi256_si128(c8)),
                    _mm512_cvtepu8_epi32(_mm256_extracti128_si256::<1>(c8)),
                ];
                for v in 0..2 {
                    let c = _mm512_min_epu32(cs[v], cmax);
                    let idx = _mm512_or_si512(
                        _mm512_slli_epi32::<{ PROB_BITS }>(c),
                        _mm512_and_si512(x[g][v], mslot),
                    );
                    // SAFETY: idx = min(ctx, 16) * 4096 + (x & 4095) < NCTX * 4096 = dec.len().
                    t[g][v] = unsafe { _mm512_i32gather_epi32::<4>(idx, table) };
                }
            }
            for g in 0..G {
                for v in 0..2 {
                    let e = t[g][v];
                    no_table |= _mm512_cmpeq_epi32_mask(e, zero);
                    let f = _mm512_srli_epi32::<19>(e);
                    let bias = _mm512_and_si512(_mm512_srli_epi32::<7>(e), m4095);
                    x[g][v] = _mm512_add_epi32(
                        _mm512_mullo_epi32(f, _mm512_srli_epi32::<{ PROB_BITS }>(x[g][v])),
                        bias,
                    );
                    t[g][v] = _mm512_and_si512(e, _mm512_set1_epi32(0x7f));
                }
                // SAFETY: padded holds limit + 64 bytes.
                unsafe { refill(&mut x[g], rds[g], s0, limit) };
            }
            for g in 0..G {
                let row = bases[g] + k * 32;
                if L::BYTES == 4 {
                    // SAFETY: as above; 128 bytes of state and out at the row.
                    let (u, e) = unsafe {
                        values32::<L>(&mut x[g], t[g], rds[g], s0, limit, state, ctx, out, row)
                    };
                    unchanged += u;
                    exp_same += e;
                    continue;
                }
                // Direct tokens are their zigzag values. Without extra bits in the row the
                // extra step would change nothing (the states are >= RANS_L after the refill,
                // so they take no word either).
                let tg = t[g];
                let big = [
                    _mm512_cmpgt_epu32_mask(tg[0], _mm512_set1_epi32(31)),
                    _mm512_cmpgt_epu32_mask(tg[1], _mm512_set1_epi32(31)),
                ];
                let mut zs = tg;
                if big[0] | big[1] != 0 {
                    for v in 0..2 {
                        // At most 14 extra bits for 16 bits.
                        let (z, eb) = detoken(tg[v], big[v]);
                        let low = _mm512_sub_epi32(_mm512_sllv_epi32(one, eb), one);
                        zs[v] = _mm512_or_si512(z, _mm512_and_si512(x[g][v], low));
                        x[g][v] = _mm512_srlv_epi32(x[g][v], eb);
                    }
                    // SAFETY: as above.
                    unsafe { refill(&mut x[g], rds[g], s0, limit) };
                }
                // Moves -> new values, the 32 elements as 16-bit lanes (the zigzag values are
                // below 2^16).
                let z = _mm512_permutex2var_epi16(zs[0], even, zs[1]);
                let d = _mm512_xor_si512(
                    _mm512_srli_epi16::<1>(z),
                    _mm512_srai_epi16::<15>(_mm512_slli_epi16::<15>(z)),
                );
                // SAFETY: row + 32 <= bases[g] + 32 * rows: 64 bytes of state.
                let old = unsafe { _mm512_loadu_si512(state.as_ptr().add(2 * row) as *const _) };
                let kk = _mm512_add_epi16(key32(old), d);
                // unkey: k ^ 0x8000 with the sign bit set, else k ^ 0xffff.
                let new = _mm512_xor_si512(
                    kk,
                    _mm512_or_si512(
                        _mm512_andnot_si512(_mm512_srai_epi16::<15>(kk), h7fff),
                        h8000,
                    ),
                );
                // SAFETY: 64 bytes of out and state, 32 of ctx at the row (as above).
                unsafe {
                    _mm512_storeu_si512(out.as_mut_ptr().add(2 * row) as *mut _, new);
                    _mm512_storeu_si512(state.as_mut_ptr().add(2 * row) as *mut _, new);
                    _mm256_storeu_si256(ctx.as_mut_ptr().add(row) as *mut __m256i, contexts32(d));
                }
                unchanged += _mm512_cmpeq_epi16_mask(d, zero).count_ones() as u64;
                exp_same += fields_same16(old, new, exp_shift, exp_max16) as u64;
            }
        }
        counts.changed += G * rows * 32 - unchanged as usize;
        counts.exp_changed += G * rows * 32 - exp_same as usize;
        counts.no_table |= no_table != 0;
        for (g, xl) in xls.into_iter().enumerate() {
            store_states(xl, x[g], false);
        }
    }
}
