//! AVX2 + BMI2 fast path of the Hybrid kernels (`kernels::emit_hybrid`, `kernels::decode_hybrid`)
//! for bf16 and fp32. The plain kernels walk the changed values one set bit at a time; here a
//! group of 8 bf16 (or 4 fp32) values is compacted or expanded by one byte shuffle chosen by its
//! 8 (4) mask bits from a table, and the exponent mask over the changed values is one `pext` /
//! `pdep` per block of 64. Frames are the same bytes; `tests` below check both paths bit for bit.
//!
//! Dispatch returns `false` / `Ok(false)` where this path does not apply (fp16, no AVX2 or BMI2,
//! `CIERA_NO_SIMD=1`), and the caller uses the plain kernel.
#![allow(unsafe_code)] // the AVX2/BMI2 intrinsics; every block says why it is sound

use super::checksum::StripeHash;
use super::error::Result;
use super::float::{Layout, BLOCK};
use super::kernels::{bad_exception, repeats_cached};
use super::simd;
use crate::DType;

fn enabled() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static ON: OnceLock<bool> = OnceLock::new();
        *ON.get_or_init(|| super::simd::enabled() && std::is_x86_feature_detected!("bmi2"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Packed sign+mantissa bytes per value (bf16 1, fp32 3), or None where this path does not apply.
fn sm_bytes<L: Layout>() -> Option<usize> {
    match L::DTYPE {
        DType::BF16 => Some(1),
        DType::F32 => Some(3),
        _ => None,
    }
}

/// Blocks of 64 values coded between two steps of the fused checksum and cache update: the
/// bytes they touch are still in the first-level cache.
const SPAN: usize = 32;

/// `kernels::emit_hybrid` with the packed sm appended to `out` (not a separate buffer), the
/// cache `prev` set to `input` on the way (what the caller does next for a Hybrid frame), and
/// SH64 of the sm returned. None (and nothing touched) where this path does not apply.
pub fn emit<L: Layout>(
    input: &[u8],
    changed: &[u64],
    exp_changed: &[u64],
    out: &mut Vec<u8>,
    exp_sub: &mut Vec<u64>,
    exps: &mut Vec<u8>,
    prev: &mut [u8],
) -> Option<u64> {
    let smb = sm_bytes::<L>()?;
    if !enabled() {
        return None;
    }
    assert_eq!(prev.len(), input.len());
    let n = input.len() / L::BYTES;
    assert!(changed.len() == n.div_ceil(BLOCK) && exp_changed.len() == changed.len());
    let k: usize = changed.iter().map(|w| w.count_ones() as usize).sum();
    exp_sub.clear();
    exp_sub.resize(k.div_ceil(64), 0);
    let start = out.len();
    // The group stores write up to 16 bytes at the cursor: slack past the section.
    out.reserve(smb * k + 16);
    let full = n / BLOCK;
    let mut hash = StripeHash::default();
    let mut hashed = start;
    let mut idx = 0usize;
    for b0 in (0..full).step_by(SPAN) {
        let b1 = full.min(b0 + SPAN);
        let vals = b0 * BLOCK * L::BYTES..b1 * BLOCK * L::BYTES;
        let at = out.len();
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and BMI2 checked by `enabled()`. `input` holds the blocks b0..b1 of 64
        // values; `changed`/`exp_changed` have a word per block (asserted); the writes go to
        // `out`'s spare capacity after `at`, which holds at least `smb * (k - idx) + 16`
        // bytes (`smb * k + 16` reserved after `start`, `smb * idx` used since), and the
        // kernel returns how many of them it initialised (the packed sm of the changed values
        // of those blocks) and how many changed values it saw.
        let (written, seen) = unsafe {
            avx2::emit(
                &input[vals.clone()],
                &changed[b0..b1],
                &exp_changed[b0..b1],
                smb,
                out.as_mut_ptr().add(at),
                exp_sub,
                idx,
                exps,
            )
        };
        #[cfg(not(target_arch = "x86_64"))]
        let (written, seen) = (0usize, 0usize);
        // SAFETY: the kernel initialised `written` bytes after `at`, within the reserve.
        unsafe { out.set_len(at + written) };
        idx += seen;
        prev[vals.clone()].copy_from_slice(&input[vals]);
        let whole = (out.len() - hashed) / 32 * 32;
        simd::stripes(&out[hashed..hashed + whole], &mut hash);
        hashed += whole;
    }
    // The partial last block, one value at a time.
    for bi in full..changed.len() {
        let (a, e) = (changed[bi], exp_changed[bi]);
        let mut t = a;
        while t != 0 {
            let j = t.trailing_zeros() as usize;
            t &= t - 1;
            let w = L::load(input, bi * BLOCK + j);
            if e >> j & 1 == 1 {
                exp_sub[idx / 64] |= 1 << (idx % 64);
                exps.push(L::exp(w));
            }
            out.extend_from_slice(&w.to_le_bytes()[..smb]);
            idx += 1;
        }
    }
    debug_assert_eq!(idx, k);
    debug_assert_eq!(out.len(), start + L::sm_len(k));
    let tail = full * BLOCK * L::BYTES;
    prev[tail..].copy_from_slice(&input[tail..]);
    let whole = (out.len() - hashed) / 32 * 32;
    simd::stripes(&out[hashed..hashed + whole], &mut hash);
    hashed += whole;
    Some(hash.finish(&out[hashed..], out.len() - start))
}

/// `kernels::decode_hybrid` (same checks, same cache and output) where it applies, returning
/// SH64 of `sm`, computed on the way: the caller compares it with the frame's (and, on an
/// error, checks the frame's first: a corrupt frame is reported as such). Ok(None) where this
/// path does not apply, having touched nothing.
pub fn decode<L: Layout>(
    sm: &[u8],
    changed: &[u64],
    exp_sub: &[u64],
    exps: &[u8],
    prev: &mut [u8],
    out: &mut [u8],
) -> Result<Option<u64>> {
    let Some(smb) = sm_bytes::<L>() else {
        return Ok(None);
    };
    if !enabled() {
        return Ok(None);
    }
    let n = out.len() / L::BYTES;
    assert!(prev.len() == out.len() && changed.len() == n.div_ceil(BLOCK));
    let mut st = Cursor::default();
    // Whole blocks while a block's 16-byte shuffle loads stay inside `sm`.
    let fast_end = sm.len().saturating_sub(smb * BLOCK + 16);
    let full = n / BLOCK;
    let mut hash = StripeHash::default();
    let mut hashed = 0usize;
    let mut bi = 0;
    while bi < full && st.pos <= fast_end {
        if bi % SPAN == 0 {
            let whole = (st.pos - hashed) / 32 * 32;
            simd::stripes(&sm[hashed..hashed + whole], &mut hash);
            hashed += whole;
        }
        let range = bi * BLOCK * L::BYTES..(bi + 1) * BLOCK * L::BYTES;
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and BMI2 checked by `enabled()`; `prev` and `out` ranges hold one block
        // of 64 values; `st.pos + 64 * smb + 16 <= sm.len()`, so every shuffle load of the block
        // (at most 64 * smb bytes consumed, 16 read) is inside `sm`.
        unsafe {
            avx2::decode_block(
                smb,
                sm,
                changed[bi],
                exp_sub,
                exps,
                &mut prev[range.clone()],
                &mut out[range],
                &mut st,
                bi * BLOCK,
            )?
        };
        bi += 1;
    }
    for (b, &a) in changed.iter().enumerate().skip(bi) {
        decode_block_plain::<L>(sm, a, exp_sub, exps, prev, out, &mut st, b)?;
    }
    let whole = (sm.len() - hashed) / 32 * 32;
    simd::stripes(&sm[hashed..hashed + whole], &mut hash);
    hashed += whole;
    Ok(Some(hash.finish(&sm[hashed..], sm.len())))
}

/// Where a Hybrid decode stands: bytes of `sm` consumed, changed values and exponents seen.
#[derive(Default)]
struct Cursor {
    pos: usize,
    idx: usize,
    ei: usize,
}

/// The `cnt` (<= 64) bits of `words` from bit `idx` on (bits past the words read as zero).
#[inline(always)]
fn bits_at(words: &[u64], idx: usize, cnt: u32) -> u64 {
    if cnt == 0 {
        return 0;
    }
    let (wi, sh) = (idx / 64, idx % 64);
    let lo = words.get(wi).map_or(0, |w| w >> sh);
    let hi = if sh != 0 {
        words.get(wi + 1).map_or(0, |w| w << (64 - sh))
    } else {
        0
    };
    let v = lo | hi;
    if cnt == 64 {
        v
    } else {
        v & ((1u64 << cnt) - 1)
    }
}

/// One block of the decode, a value at a time (the tail, and blocks too near the end of `sm`).
#[allow(clippy::too_many_arguments)] // the frame's sections, the cache, the output, the cursor
fn decode_block_plain<L: Layout>(
    sm: &[u8],
    a: u64,
    exp_sub: &[u64],
    exps: &[u8],
    prev: &mut [u8],
    out: &mut [u8],
    st: &mut Cursor,
    bi: usize,
) -> Result<()> {
    let smb = L::sm_len(1);
    let len = BLOCK.min(out.len() / L::BYTES - bi * BLOCK);
    let mut sub = bits_at(exp_sub, st.idx, a.count_ones());
    for j in 0..len {
        let i = bi * BLOCK + j;
        let p = L::load(prev, i);
        if a >> j & 1 == 1 {
            let mut b = [0u8; 4];
            b[..smb].copy_from_slice(&sm[st.pos..st.pos + smb]);
            st.pos += smb;
            let v = L::sm(u32::from_le_bytes(b));
            let w = if sub & 1 == 1 {
                let e = exps[st.ei];
                st.ei += 1;
                if e > L::EXP_MAX || e == L::exp(p) {
                    return Err(bad_exception::<L>(i, e, L::exp(p)));
                }
                L::with_exp(v, e)
            } else {
                let w = L::with_exp(v, L::exp(p));
                if w == p {
                    return Err(repeats_cached(i));
                }
                w
            };
            sub >>= 1;
            st.idx += 1;
            L::store(prev, i, w);
            L::store(out, i, w);
        } else {
            L::store(out, i, p);
        }
    }
    Ok(())
}

/// Shuffle tables, built at compile time.
mod tables {
    /// bf16 emit: the low bytes of the set lanes of 8 16-bit values, in order, at the front.
    pub static EMIT16: [[u8; 16]; 256] = {
        let mut t = [[0x80u8; 16]; 256];
        let mut m = 0;
        while m < 256 {
            let (mut j, mut r) = (0, 0);
            while j < 8 {
                if m >> j & 1 == 1 {
                    t[m][r] = 2 * j as u8;
                    r += 1;
                }
                j += 1;
            }
            m += 1;
        }
        t
    };
    /// bf16 decode: set lane j (of rank r among the set lanes) takes byte r as its low byte.
    pub static DEC16: [[u8; 16]; 256] = {
        let mut t = [[0x80u8; 16]; 256];
        let mut m = 0;
        while m < 256 {
            let (mut j, mut r) = (0, 0);
            while j < 8 {
                if m >> j & 1 == 1 {
                    t[m][2 * j] = r;
                    r += 1;
                }
                j += 1;
            }
            m += 1;
        }
        t
    };
    /// fp32 emit: the low 3 bytes of the set lanes of 4 32-bit values, in order, at the front.
    pub static EMIT32: [[u8; 16]; 16] = {
        let mut t = [[0x80u8; 16]; 16];
        let mut m = 0;
        while m < 16 {
            let (mut j, mut r) = (0, 0);
            while j < 4 {
                if m >> j & 1 == 1 {
                    t[m][3 * r] = 4 * j as u8;
                    t[m][3 * r + 1] = 4 * j as u8 + 1;
                    t[m][3 * r + 2] = 4 * j as u8 + 2;
                    r += 1;
                }
                j += 1;
            }
            m += 1;
        }
        t
    };
    /// fp32 decode: set lane j (of rank r) takes bytes 3r..3r+3 as its low 3 bytes.
    pub static DEC32: [[u8; 16]; 16] = {
        let mut t = [[0x80u8; 16]; 16];
        let mut m = 0;
        while m < 16 {
            let (mut j, mut r) = (0, 0);
            while j < 4 {
                if m >> j & 1 == 1 {
                    t[m][4 * j] = 3 * r;
                    t[m][4 * j + 1] = 3 * r + 1;
                    t[m][4 * j + 2] = 3 * r + 2;
                    r += 1;
                }
                j += 1;
            }
            m += 1;
        }
        t
    };
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{bad_exception, bits_at, repeats_cached, tables, Cursor};
    use crate::codec::error::Result;
    use crate::codec::float::{Bf16, Layout, F32};

    #[inline(always)]
    fn table(t: &[u8; 16]) -> __m128i {
        // SAFETY: `t` is 16 readable bytes; the load is unaligned.
        unsafe { _mm_loadu_si128(t.as_ptr() as *const __m128i) }
    }

    /// Emit whole blocks: the packed sm of the changed values to `dst`, the exponent mask over
    /// them into `exp_sub` (zeroed past bit `idx0`, where these blocks' bits start), the new
    /// exponents to `exps`. Returns (bytes written at `dst`, changed values seen).
    ///
    /// # Safety
    /// The CPU must support AVX2 and BMI2. `input` holds 64 values of `smb` = 1 (bf16) or 3
    /// (fp32) sm bytes per word of `changed` (as many as of `exp_changed`), `exp_sub` holds at
    /// least `idx0 + popcount(changed)` bits, and `dst` is valid for writes of
    /// `smb * popcount(changed) + 16` bytes.
    #[target_feature(enable = "avx2,bmi2,popcnt")]
    #[allow(clippy::too_many_arguments)] // the blocks, their masks, the outputs, the cursor
    pub unsafe fn emit(
        input: &[u8],
        changed: &[u64],
        exp_changed: &[u64],
        smb: usize,
        dst: *mut u8,
        exp_sub: &mut [u64],
        idx0: usize,
        exps: &mut Vec<u8>,
    ) -> (usize, usize) {
        let (mut pos, mut idx) = (0usize, idx0);
        let vsize = if smb == 1 { 2 } else { 4 };
        for (bi, (&a, &e)) in changed.iter().zip(exp_changed).enumerate() {
            if a == 0 {
                continue;
            }
            let base = bi * 64 * vsize;
            if e != 0 {
                // The exponent bits of the changed values, in order, appended at bit `idx`.
                let bits = _pext_u64(e, a);
                let (wi, sh) = (idx / 64, idx % 64);
                exp_sub[wi] |= bits << sh;
                if sh != 0 && (a.count_ones() as usize) + sh > 64 {
                    exp_sub[wi + 1] |= bits >> (64 - sh);
                }
                let mut t = e;
                while t != 0 {
                    let j = t.trailing_zeros() as usize;
                    t &= t - 1;
                    // The high byte of the value: the cached field of bf16 and fp32.
                    exps.push(input[base + vsize * j + vsize - 1]);
                }
            }
            idx += a.count_ones() as usize;
            // SAFETY: the block's 64 values are in `input` (16-byte loads at base + 16g with
            // 16g + 16 <= 64 * vsize); the stores write 8 (bf16) or 16 (fp32) bytes at
            // dst + pos where pos <= smb * (changed values before this group) and those
            // bytes are within the caller's `smb * popcount + 16`.
            unsafe {
                let src = input.as_ptr().add(base);
                if smb == 1 {
                    for g in 0..8 {
                        let m = (a >> (8 * g)) as u8;
                        if m == 0 {
                            continue;
                        }
                        let v = _mm_loadu_si128(src.add(16 * g) as *const __m128i);
                        let c = _mm_shuffle_epi8(v, table(&tables::EMIT16[m as usize]));
                        _mm_storel_epi64(dst.add(pos) as *mut __m128i, c);
                        pos += m.count_ones() as usize;
                    }
                } else {
                    for g in 0..16 {
                        let m = ((a >> (4 * g)) & 15) as usize;
                        if m == 0 {
                            continue;
                        }
                        let v = _mm_loadu_si128(src.add(16 * g) as *const __m128i);
                        let c = _mm_shuffle_epi8(v, table(&tables::EMIT32[m]));
                        _mm_storeu_si128(dst.add(pos) as *mut __m128i, c);
                        pos += 3 * m.count_ones() as usize;
                    }
                }
            }
        }
        (pos, idx - idx0)
    }

    /// Decode one whole block of 64 values (`prev`, `out`: 64 values each).
    ///
    /// # Safety
    /// The CPU must support AVX2 and BMI2; `smb` is 1 (bf16) or 3 (fp32) and
    /// `st.pos + 64 * smb + 16 <= sm.len()`.
    #[target_feature(enable = "avx2,bmi2,popcnt")]
    #[allow(clippy::too_many_arguments)] // the frame's sections, the cache, the output, the cursor
    pub unsafe fn decode_block(
        smb: usize,
        sm: &[u8],
        a: u64,
        exp_sub: &[u64],
        exps: &[u8],
        prev: &mut [u8],
        out: &mut [u8],
        st: &mut Cursor,
        first: usize,
    ) -> Result<()> {
        let cnt = a.count_ones();
        let eb = if cnt == 0 {
            0
        } else {
            _pdep_u64(bits_at(exp_sub, st.idx, cnt), a)
        };
        st.idx += cnt as usize;
        // Set bits: lanes whose new value came out equal to the cached one.
        let mut same = 0u64;
        let (pp, op) = (prev.as_mut_ptr(), out.as_mut_ptr());
        // SAFETY: `prev` and `out` hold 128 (bf16) or 256 (fp32) bytes: the 16-byte loads and
        // stores at 16g stay inside; the shuffle loads at sm + pos are inside `sm` by the
        // caller's bound (pos grows by at most 64 * smb over the block).
        unsafe {
            let sp = sm.as_ptr();
            if smb == 1 {
                let hi = _mm_set1_epi16(0xff00u16 as i16);
                let bit = _mm_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128);
                for g in 0..8 {
                    let m = (a >> (8 * g)) as u8;
                    let p = _mm_loadu_si128(pp.add(16 * g) as *const __m128i);
                    if m != 0 {
                        let s = _mm_loadu_si128(sp.add(st.pos) as *const __m128i);
                        let x = _mm_shuffle_epi8(s, table(&tables::DEC16[m as usize]));
                        let lanes =
                            _mm_cmpeq_epi16(_mm_and_si128(_mm_set1_epi16(m as i16), bit), bit);
                        let nv = _mm_blendv_epi8(p, _mm_or_si128(_mm_and_si128(p, hi), x), lanes);
                        let eq = _mm_and_si128(_mm_cmpeq_epi16(nv, p), lanes);
                        let eq8 = _mm_movemask_epi8(_mm_packs_epi16(eq, _mm_setzero_si128()));
                        same |= ((eq8 as u64) & 0xff) << (8 * g);
                        _mm_storeu_si128(pp.add(16 * g) as *mut __m128i, nv);
                        _mm_storeu_si128(op.add(16 * g) as *mut __m128i, nv);
                        st.pos += m.count_ones() as usize;
                    } else {
                        _mm_storeu_si128(op.add(16 * g) as *mut __m128i, p);
                    }
                }
            } else {
                let hi = _mm_set1_epi32(0xff00_0000u32 as i32);
                let bit = _mm_setr_epi32(1, 2, 4, 8);
                for g in 0..16 {
                    let m = ((a >> (4 * g)) & 15) as usize;
                    let p = _mm_loadu_si128(pp.add(16 * g) as *const __m128i);
                    if m != 0 {
                        let s = _mm_loadu_si128(sp.add(st.pos) as *const __m128i);
                        let x = _mm_shuffle_epi8(s, table(&tables::DEC32[m]));
                        let lanes =
                            _mm_cmpeq_epi32(_mm_and_si128(_mm_set1_epi32(m as i32), bit), bit);
                        let nv = _mm_blendv_epi8(p, _mm_or_si128(_mm_and_si128(p, hi), x), lanes);
                        let eq = _mm_and_si128(_mm_cmpeq_epi32(nv, p), lanes);
                        let eq4 = _mm_movemask_ps(_mm_castsi128_ps(eq));
                        same |= ((eq4 as u64) & 15) << (4 * g);
                        _mm_storeu_si128(pp.add(16 * g) as *mut __m128i, nv);
                        _mm_storeu_si128(op.add(16 * g) as *mut __m128i, nv);
                        st.pos += 3 * m.count_ones() as usize;
                    } else {
                        _mm_storeu_si128(op.add(16 * g) as *mut __m128i, p);
                    }
                }
            }
        }
        // A changed value whose exponent is kept must differ from the cached value.
        let bad = same & !eb;
        // The exponent changes: the lane holds the new sm with the cached exponent.
        let mut t = eb;
        while t != 0 {
            let j = t.trailing_zeros() as usize;
            t &= t - 1;
            if bad & ((1u64 << j) - 1) != 0 {
                break; // the first error is a repeated value, before this one
            }
            let e = exps[st.ei];
            st.ei += 1;
            if smb == 1 {
                let p = Bf16::load(prev, j);
                if e == Bf16::exp(p) {
                    return Err(bad_exception::<Bf16>(first + j, e, e));
                }
                let w = Bf16::with_exp(Bf16::sm(p), e);
                Bf16::store(prev, j, w);
                Bf16::store(out, j, w);
            } else {
                let p = F32::load(prev, j);
                if e == F32::exp(p) {
                    return Err(bad_exception::<F32>(first + j, e, e));
                }
                let w = F32::with_exp(F32::sm(p), e);
                F32::store(prev, j, w);
                F32::store(out, j, w);
            }
        }
        if bad != 0 {
            return Err(repeats_cached(first + bad.trailing_zeros() as usize));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::float::{Bf16, F32};
    use crate::codec::kernels;
    use proptest::prelude::*;

    /// Both paths of `L` on the same data: the same sm bytes, exponent mask and exponents; both
    /// decoders back to the input with the same cache; corruptions refused by both.
    fn paths_match<L: Layout>(input: &[u8], prev0: &[u8]) {
        if !enabled() {
            eprintln!("skipping: no AVX2/BMI2 on this CPU (or CIERA_NO_SIMD set)");
            return;
        }
        let (mut a, mut e) = (Vec::new(), Vec::new());
        kernels::scan_full::<L>(input, prev0, &mut a, &mut e);
        let k: usize = a.iter().map(|w| w.count_ones() as usize).sum();
        let (mut sm1, mut sub1, mut ex1, mut vals) =
            (vec![7u8], Vec::new(), Vec::new(), Vec::new());
        kernels::emit_hybrid::<L>(input, &a, &e, &mut sm1, &mut sub1, &mut ex1, &mut vals);
        let (mut sm2, mut sub2, mut ex2) = (vec![7u8], vec![99], vec![]);
        let mut pe = prev0.to_vec();
        let h = emit::<L>(input, &a, &e, &mut sm2, &mut sub2, &mut ex2, &mut pe);
        assert_eq!((&sm1, &sub1, &ex1), (&sm2, &sub2, &ex2), "emit");
        assert_eq!(pe, input, "emit updates the cache");
        let sm = &sm1[1..];
        let hash = crate::codec::checksum::sh64_plain(sm);
        assert_eq!(h, Some(hash), "fused encode hash");
        let n = input.len() / L::BYTES;
        let (mut p1, mut p2) = (prev0.to_vec(), prev0.to_vec());
        let (mut o1, mut o2) = (vec![0u8; input.len()], vec![1u8; input.len()]);
        kernels::decode_hybrid::<L>(sm, &a, &sub1, &ex1, k, &mut p1, &mut o1, &mut vals).unwrap();
        let h = decode::<L>(sm, &a, &sub1, &ex1, &mut p2, &mut o2).unwrap();
        assert_eq!(h, Some(hash), "fused decode hash");
        assert_eq!(o1, input);
        assert_eq!(o2, input);
        assert_eq!(p2, input);
        // A kept-exponent change that repeats the cached value, and an exponent change that
        // repeats the cached exponent, are refused by both, naming the same element.
        let first_kept =
            (0..n).find(|&i| a[i / 64] >> (i % 64) & 1 == 1 && e[i / 64] >> (i % 64) & 1 == 0);
        if let Some(i) = first_kept {
            let r = (0..i).filter(|&x| a[x / 64] >> (x % 64) & 1 == 1).count();
            let smb = L::sm_len(1);
            let mut bad = sm.to_vec();
            let pw = L::load(prev0, i).to_le_bytes();
            bad[r * smb..(r + 1) * smb].copy_from_slice(&pw[..smb]);
            check_refused::<L>(&bad, &a, &sub1, &ex1, k, prev0);
        }
        if !ex1.is_empty() {
            let i = (0..n).find(|&x| e[x / 64] >> (x % 64) & 1 == 1).unwrap();
            let mut bad = ex1.clone();
            bad[0] = L::exp(L::load(prev0, i));
            check_refused::<L>(sm, &a, &sub1, &bad, k, prev0);
        }
    }

    fn check_refused<L: Layout>(
        sm: &[u8],
        a: &[u64],
        sub: &[u64],
        ex: &[u8],
        k: usize,
        prev0: &[u8],
    ) {
        let (mut p1, mut p2) = (prev0.to_vec(), prev0.to_vec());
        let (mut o1, mut o2) = (vec![0u8; prev0.len()], vec![0u8; prev0.len()]);
        let e1 = kernels::decode_hybrid::<L>(sm, a, sub, ex, k, &mut p1, &mut o1, &mut Vec::new());
        let e2 = decode::<L>(sm, a, sub, ex, &mut p2, &mut o2);
        match (e1, e2) {
            (Err(x), Err(y)) => assert_eq!(x.to_string(), y.to_string()),
            (x, y) => panic!("plain {x:?}, fast {y:?}"),
        }
    }

    /// Values and a cache that agree in most places, where the differences are drawn with
    /// densities from none to all, exponents changing with their own probability.
    fn data(bytes: usize, n: usize, seed: u64, p_change: u32, p_exp: u32) -> (Vec<u8>, Vec<u8>) {
        let mut s = seed;
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let prev: Vec<u8> = (0..n * bytes).map(|_| next() as u8).collect();
        let mut input = prev.clone();
        for i in 0..n {
            if next() % 100 < p_change {
                let v = &mut input[i * bytes..(i + 1) * bytes];
                v[0] ^= 1 + (next() % 255) as u8;
                if next() % 100 < p_exp {
                    v[bytes - 1] ^= 1 + (next() % 255) as u8;
                }
            } else if next() % 100 < p_exp / 2 {
                // An exponent-only change.
                input[(i + 1) * bytes - 1] ^= 0x10;
            }
        }
        (input, prev)
    }

    #[test]
    fn fast_matches_plain_at_every_density() {
        for n in [0usize, 1, 63, 64, 65, 127, 128, 129, 1000, 4096 + 17] {
            for (pc, pe) in [
                (0, 0),
                (1, 50),
                (10, 5),
                (50, 3),
                (90, 20),
                (100, 0),
                (100, 100),
            ] {
                let (x, p) = data(2, n, n as u64 * 31 + pc as u64, pc, pe);
                paths_match::<Bf16>(&x, &p);
                let (x, p) = data(4, n, n as u64 * 17 + pe as u64, pc, pe);
                paths_match::<F32>(&x, &p);
            }
        }
    }

    proptest! {
        #[test]
        fn fast_matches_plain_random(n in 0usize..700, seed: u64, pc in 0u32..=100, pe in 0u32..=100) {
            let (x, p) = data(2, n, seed, pc, pe);
            paths_match::<Bf16>(&x, &p);
            let (x, p) = data(4, n, seed ^ 1, pc, pe);
            paths_match::<F32>(&x, &p);
        }
    }
}
