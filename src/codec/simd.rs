//! AVX2 fast path for the Exp frame kernels: the hot loop of the exponent mode (split 32
//! values into their low (sent) and high (cached) bytes, compare with the cache, build the
//! change mask) for bf16 and fp32, and its inverse. The cache is an exponent cache (one field
//! byte per value) or a full-value one (the previous values: the fields are read from them and
//! the new values stored back in the same pass, so an Exp frame on a full-value or delta cache
//! costs about what it costs on an exponent cache). Everything else, and every CPU without
//! AVX2, uses the plain kernels in `kernels.rs`; `tests` below check both paths bit for bit on
//! the same data.
//!
//! Dispatch returns `false` when this path does not apply, so callers fall back to the plain
//! kernel. `CIERA_NO_SIMD=1` disables it (for diff-testing and for bisecting a suspected bug).
#![allow(unsafe_code)] // the AVX2 intrinsics; every block says why it is sound

use super::checksum::StripeHash;
use super::error::Result;
use super::float::{Layout, BLOCK};
use super::kernels::{self, CacheRef};
use crate::DType;

pub(super) fn enabled() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static ON: OnceLock<bool> = OnceLock::new();
        *ON.get_or_init(|| {
            std::is_x86_feature_detected!("avx2")
                && std::env::var_os("CIERA_NO_SIMD").is_none_or(|v| v == "0")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Ask for the cache lines of the `bytes` bytes at `p`, to read them or (`WRITE`) to write
/// them: the values passes that work span by span or group by group call it for the lines
/// they will need next, where the hardware prefetchers lose the streams. A prefetch is a
/// hint: it reads and writes nothing and never faults, so `p` may point anywhere (callers
/// compute it with wrapping arithmetic; past the end of their data it is only wasted).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_lines<const WRITE: bool>(p: *const u8, bytes: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0, _MM_HINT_T0};
    for line in (0..bytes).step_by(64) {
        let at = p.wrapping_add(line) as *const i8;
        // SAFETY: a prefetch only hints (see above); SSE is part of x86-64.
        unsafe {
            if WRITE {
                _mm_prefetch::<_MM_HINT_ET0>(at);
            } else {
                _mm_prefetch::<_MM_HINT_T0>(at);
            }
        }
    }
}

/// Whether the Exp fast paths apply to `L` (bf16 or fp32, AVX2); and whether it is fp32.
fn exp_fast_path<L: Layout>() -> Option<bool> {
    let f32 = match L::DTYPE {
        DType::BF16 => false,
        DType::F32 => true,
        _ => return None,
    };
    enabled().then_some(f32)
}

/// Encode with the fast path if it applies (bf16 or fp32, AVX2): appends the dense
/// sign+mantissa section (`L::sm_len(n)` bytes) to `out` and returns its SH64. Otherwise
/// `None`, and the caller uses `kernels::encode_exp`. A full-value cache is read and updated in
/// the same pass: its values' cached fields are taken from the values as they are loaded (the
/// same frame as an exponent cache of them), and the new values are stored in their place.
pub fn encode_exp<L: Layout>(
    input: &[u8],
    cache: &mut CacheRef<'_>,
    out: &mut Vec<u8>,
    masks: &mut Vec<u64>,
    exps: &mut Vec<u8>,
) -> Option<u64> {
    let f32 = exp_fast_path::<L>()?;
    Some(match cache {
        CacheRef::Exp(ce) => encode_exp_cache::<L, false>(f32, input, ce, out, masks, exps),
        CacheRef::Full(prev) => encode_exp_cache::<L, true>(f32, input, prev, out, masks, exps),
    })
}

/// Bytes of cache per value: one field byte, or (FULL) the whole value.
fn cache_width<L: Layout, const FULL: bool>() -> usize {
    if FULL {
        L::BYTES
    } else {
        1
    }
}

/// The cache of `n` values as the plain kernels take it.
fn cache_ref<const FULL: bool>(c: &mut [u8]) -> CacheRef<'_> {
    if FULL {
        CacheRef::Full(c)
    } else {
        CacheRef::Exp(c)
    }
}

fn encode_exp_cache<L: Layout, const FULL: bool>(
    f32: bool,
    input: &[u8],
    ce: &mut [u8],
    out: &mut Vec<u8>,
    masks: &mut Vec<u64>,
    exps: &mut Vec<u8>,
) -> u64 {
    let n = input.len() / L::BYTES;
    let cw = cache_width::<L, FULL>();
    let mut hash = StripeHash::default();
    assert!(
        ce.len() == cw * n,
        "{} exp encode: cache {} bytes for {n} values",
        L::DTYPE,
        ce.len()
    );
    let full = n / BLOCK * BLOCK;
    let (dense_full, dense_n) = (L::sm_len(full), L::sm_len(n));
    masks.clear();
    masks.reserve(n.div_ceil(BLOCK));
    exps.reserve(n / 16);
    let d0 = out.len();
    // fp32 writes its 12-byte groups with 16-byte stores: 4 bytes of slack past the end.
    out.reserve(dense_n + 16);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `enabled()` checked that the CPU has AVX2. `out` has room for `dense_n + 16 >=
    // dense_full + 4` more bytes (reserved above); the encoders write the `dense_full` bytes
    // after `d0` (fp32 also up to 4 bytes past them, within the reserve, never exposed), so
    // those are initialised when `set_len` exposes them.
    unsafe {
        let dense = out.as_mut_ptr().add(d0);
        let (inp, c) = (&input[..L::BYTES * full], &mut ce[..cw * full]);
        if f32 {
            avx2::encode_f32::<FULL>(inp, c, dense, masks, exps, &mut hash);
        } else {
            avx2::encode_bf16::<FULL>(inp, c, dense, masks, exps, &mut hash);
        }
        out.set_len(d0 + dense_full);
    }
    if full < n {
        out.resize(d0 + dense_n, 0);
        let mut tail = Vec::new();
        kernels::encode_exp::<L>(
            &input[L::BYTES * full..],
            cache_ref::<FULL>(&mut ce[cw * full..]),
            &mut out[d0 + dense_full..],
            &mut tail,
            exps,
        );
        masks.extend_from_slice(&tail);
    }
    finish_hash(hash, &out[d0 + dense_full..], dense_n)
}

/// Value-changed and exponent-changed masks against a full-value cache (`kernels::scan_full`),
/// with AVX2 for every compressible type. Returns false where it does not apply.
pub fn scan_full<L: Layout>(
    input: &[u8],
    prev: &[u8],
    changed: &mut Vec<u64>,
    exp_changed: &mut Vec<u64>,
) -> bool {
    if !enabled() {
        return false;
    }
    let n = input.len() / L::BYTES;
    assert_eq!(prev.len(), input.len());
    let full = n / BLOCK * BLOCK;
    changed.clear();
    exp_changed.clear();
    changed.reserve(n.div_ceil(BLOCK));
    exp_changed.reserve(n.div_ceil(BLOCK));
    let bytes = full * L::BYTES;
    scan_blocks::<L>(&input[..bytes], &prev[..bytes], changed, exp_changed);
    if full < n {
        let (mut a, mut e) = (Vec::new(), Vec::new());
        kernels::scan_full::<L>(&input[bytes..], &prev[bytes..], &mut a, &mut e);
        changed.extend_from_slice(&a);
        exp_changed.extend_from_slice(&e);
    }
    true
}

/// `scan_full`'s masks of whole blocks (`input.len()` a multiple of 64 values), appended to
/// `changed` and `exp_changed`. The caller has checked `enabled()`.
pub(super) fn scan_blocks<L: Layout>(
    input: &[u8],
    prev: &[u8],
    changed: &mut Vec<u64>,
    exp_changed: &mut Vec<u64>,
) {
    assert!(enabled() && prev.len() == input.len() && input.len().is_multiple_of(BLOCK * L::BYTES));
    let exp_mask = (L::EXP_MAX as u32) << L::EXP_SHIFT;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 checked by `enabled()` (asserted); both slices hold whole blocks of
    // L::BYTES-byte values, the same number (asserted).
    unsafe {
        if L::BYTES == 2 {
            avx2::scan16(input, prev, exp_mask as u16, changed, exp_changed)
        } else {
            avx2::scan32(input, prev, exp_mask, changed, exp_changed)
        }
    };
}

/// Finish a fused SH64 whose whole stripes up to a 64-byte boundary are in `hash`, given the
/// remaining `rest` bytes of a section of `len` bytes.
fn finish_hash(mut hash: StripeHash, rest: &[u8], len: usize) -> u64 {
    let whole = rest.len() / 32 * 32;
    hash.update(&rest[..whole]);
    hash.finish(&rest[whole..], len)
}

/// Absorb whole stripes (`data.len()` a multiple of 32) into `hash`, with AVX2 if available.
pub(super) fn stripes(data: &[u8], hash: &mut StripeHash) {
    #[cfg(target_arch = "x86_64")]
    if enabled() {
        // SAFETY: AVX2 checked by `enabled()`; the function reads exactly `data`.
        unsafe { avx2::stripes(data, hash) };
        return;
    }
    hash.update(data);
}

/// SH64 with AVX2, if available.
pub fn sh64(data: &[u8]) -> Option<u64> {
    if !enabled() {
        return None;
    }
    let whole = data.len() / 32 * 32;
    let mut hash = StripeHash::default();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 checked by `enabled()`; the function reads exactly `whole` bytes of `data`.
    unsafe {
        avx2::stripes(&data[..whole], &mut hash)
    };
    Some(hash.finish(&data[whole..], data.len()))
}

/// Decode with the fast path if it applies, returning SH64 of `dense` (computed while decoding;
/// the caller compares it with the frame's). `None`: use `kernels::decode_exp`.
pub fn decode_exp<L: Layout>(
    dense: &[u8],
    masks: &[u64],
    exps: &[u8],
    cache: &mut CacheRef<'_>,
    out: &mut [u8],
) -> Result<Option<u64>> {
    let Some(f32) = exp_fast_path::<L>() else {
        return Ok(None);
    };
    // A full-value cache takes the decoded values in the same pass (on error it holds some of
    // them, and the caller poisons the slot).
    match cache {
        CacheRef::Exp(ce) => {
            decode_exp_cache::<L, false>(f32, dense, masks, exps, ce, out).map(Some)
        }
        CacheRef::Full(prev) => {
            decode_exp_cache::<L, true>(f32, dense, masks, exps, prev, out).map(Some)
        }
    }
}

fn decode_exp_cache<L: Layout, const FULL: bool>(
    f32: bool,
    dense: &[u8],
    masks: &[u64],
    exps: &[u8],
    ce: &mut [u8],
    out: &mut [u8],
) -> Result<u64> {
    let mut hash = StripeHash::default();
    let n = out.len() / L::BYTES;
    let cw = cache_width::<L, FULL>();
    assert!(ce.len() == cw * n && dense.len() == L::sm_len(n) && masks.len() == n.div_ceil(BLOCK));
    let full = n / BLOCK * BLOCK;
    let (nb, dense_full) = (full / BLOCK, L::sm_len(full));
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 checked by `enabled()`; all slices hold at least `full` values (asserted).
    let used = unsafe {
        let (d, m, c, o) = (
            &dense[..dense_full],
            &masks[..nb],
            &mut ce[..cw * full],
            &mut out[..L::BYTES * full],
        );
        if f32 {
            avx2::decode_f32::<FULL>(d, m, exps, c, o, &mut hash)?
        } else {
            avx2::decode_bf16::<FULL>(d, m, exps, c, o, &mut hash)?
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let used = 0;
    if full < n {
        kernels::decode_exp::<L>(
            &dense[dense_full..],
            &masks[nb..],
            &exps[used..],
            cache_ref::<FULL>(&mut ce[cw * full..]),
            &mut out[L::BYTES * full..],
        )?;
    }
    Ok(finish_hash(hash, &dense[dense_full..], L::sm_len(n)))
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::codec::checksum::{StripeHash, KEY, P2};
    use crate::codec::error::{CodecError, Result};

    /// One SH64 stripe step on 32 bytes held in a register (see checksum.rs).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn stripe_step(acc: __m256i, s: __m256i, stripe: u64) -> __m256i {
        let key = _mm256_xor_si256(
            _mm256_setr_epi64x(KEY[0] as i64, KEY[1] as i64, KEY[2] as i64, KEY[3] as i64),
            _mm256_set1_epi64x(stripe.wrapping_mul(P2) as i64),
        );
        let v = _mm256_xor_si256(s, key);
        let prod = _mm256_mul_epu32(v, _mm256_srli_epi64(v, 32));
        let swapped = _mm256_shuffle_epi32(s, 0b01_00_11_10);
        _mm256_add_epi64(acc, _mm256_add_epi64(prod, swapped))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn load_acc(h: &StripeHash) -> __m256i {
        _mm256_setr_epi64x(
            h.acc[0] as i64,
            h.acc[1] as i64,
            h.acc[2] as i64,
            h.acc[3] as i64,
        )
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn store_acc(acc: __m256i, h: &mut StripeHash, stripes: u64) {
        let mut a = [0u64; 4];
        // SAFETY: `a` is 32 bytes; unaligned store.
        unsafe { _mm256_storeu_si256(a.as_mut_ptr() as *mut __m256i, acc) };
        h.acc = a;
        h.stripes += stripes;
    }

    /// Absorb `data` (a multiple of 32 bytes) into `h`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn stripes(data: &[u8], h: &mut StripeHash) {
        let mut acc = load_acc(h);
        let base = h.stripes;
        let n = data.len() / 32;
        for i in 0..n {
            // SAFETY: i < n = data.len() / 32, so bytes [32i, 32i+32) are in bounds.
            let s = unsafe { _mm256_loadu_si256(data.as_ptr().add(32 * i) as *const __m256i) };
            acc = stripe_step(acc, s, base + i as u64);
        }
        store_acc(acc, h, n as u64);
    }

    /// Masks of 16-bit values (`input.len()` a multiple of 128 bytes): changed, exponent changed.
    ///
    /// # Safety
    /// The CPU must support AVX2; `prev.len() == input.len()`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn scan16(
        input: &[u8],
        prev: &[u8],
        exp_mask: u16,
        changed: &mut Vec<u64>,
        exp_changed: &mut Vec<u64>,
    ) {
        let em = _mm256_set1_epi16(exp_mask as i16);
        let zero = _mm256_setzero_si256();
        // 32 values (64 bytes) per step: two compares packed to one byte per value.
        let half = |off: usize| -> (u32, u32) {
            // SAFETY: the caller passes off + 64 <= input.len() == prev.len().
            let (x0, x1, p0, p1) = unsafe {
                (
                    _mm256_loadu_si256(input.as_ptr().add(off) as *const __m256i),
                    _mm256_loadu_si256(input.as_ptr().add(off + 32) as *const __m256i),
                    _mm256_loadu_si256(prev.as_ptr().add(off) as *const __m256i),
                    _mm256_loadu_si256(prev.as_ptr().add(off + 32) as *const __m256i),
                )
            };
            let eqv = _mm256_packs_epi16(_mm256_cmpeq_epi16(x0, p0), _mm256_cmpeq_epi16(x1, p1));
            let eqe = _mm256_packs_epi16(
                _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_xor_si256(x0, p0), em), zero),
                _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_xor_si256(x1, p1), em), zero),
            );
            let v = _mm256_movemask_epi8(_mm256_permute4x64_epi64(eqv, 0b11_01_10_00)) as u32;
            let e = _mm256_movemask_epi8(_mm256_permute4x64_epi64(eqe, 0b11_01_10_00)) as u32;
            (!v, !e)
        };
        for b in (0..input.len()).step_by(128) {
            let (a0, e0) = half(b);
            let (a1, e1) = half(b + 64);
            changed.push(a0 as u64 | (a1 as u64) << 32);
            exp_changed.push(e0 as u64 | (e1 as u64) << 32);
        }
    }

    /// Masks of 32-bit values (`input.len()` a multiple of 256 bytes): changed, exponent changed.
    ///
    /// # Safety
    /// The CPU must support AVX2; `prev.len() == input.len()`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn scan32(
        input: &[u8],
        prev: &[u8],
        exp_mask: u32,
        changed: &mut Vec<u64>,
        exp_changed: &mut Vec<u64>,
    ) {
        let em = _mm256_set1_epi32(exp_mask as i32);
        let zero = _mm256_setzero_si256();
        for b in (0..input.len()).step_by(256) {
            let (mut a, mut e) = (0u64, 0u64);
            for q in 0..8 {
                let off = b + 32 * q;
                // SAFETY: off + 32 <= input.len() == prev.len() (b + 256 <= len).
                let (x, p) = unsafe {
                    (
                        _mm256_loadu_si256(input.as_ptr().add(off) as *const __m256i),
                        _mm256_loadu_si256(prev.as_ptr().add(off) as *const __m256i),
                    )
                };
                let eqv = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(x, p))) as u64;
                let eqe = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(
                    _mm256_and_si256(_mm256_xor_si256(x, p), em),
                    zero,
                ))) as u64;
                a |= (!eqv & 0xff) << (8 * q);
                e |= (!eqe & 0xff) << (8 * q);
            }
            changed.push(a);
            exp_changed.push(e);
        }
    }

    /// The high bytes of 32 bf16 values (two vectors of 16), in order.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn high_bytes16(xa: __m256i, xb: __m256i) -> __m256i {
        // packus works per 128-bit lane; the permute restores element order.
        _mm256_permute4x64_epi64(
            _mm256_packus_epi16(_mm256_srli_epi16(xa, 8), _mm256_srli_epi16(xb, 8)),
            0b11_01_10_00,
        )
    }

    /// The top bytes of 32 fp32 values (four vectors of 8), in order.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn high_bytes32(x: [__m256i; 4]) -> __m256i {
        // packus per lane leaves dwords a0-3 b0-3 c0-3 d0-3 a4-7 b4-7 c4-7 d4-7.
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let e01 = _mm256_packus_epi32(_mm256_srli_epi32(x[0], 24), _mm256_srli_epi32(x[1], 24));
        let e23 = _mm256_packus_epi32(_mm256_srli_epi32(x[2], 24), _mm256_srli_epi32(x[3], 24));
        _mm256_permutevar8x32_epi32(_mm256_packus_epi16(e01, e23), order)
    }

    /// Load `k` vectors of 32 bytes from `p`.
    ///
    /// # Safety
    /// `p` is valid for reads of `32 * K` bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load<const K: usize>(p: *const u8) -> [__m256i; K] {
        // SAFETY: the caller's contract; unaligned loads.
        std::array::from_fn(|i| unsafe { _mm256_loadu_si256(p.add(32 * i) as *const __m256i) })
    }

    /// Store `K` vectors of 32 bytes at `p`.
    ///
    /// # Safety
    /// `p` is valid for writes of `32 * K` bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn store<const K: usize>(p: *mut u8, x: [__m256i; K]) {
        for (i, v) in x.into_iter().enumerate() {
            // SAFETY: the caller's contract; unaligned stores.
            unsafe { _mm256_storeu_si256(p.add(32 * i) as *mut __m256i, v) };
        }
    }

    /// Encode `input.len() / 2` (a multiple of 64) bf16 values, writing one sign+mantissa byte
    /// per value at `dense`. The cache holds one field byte per value, or with FULL the values
    /// themselves (their high bytes are the fields; the new values replace them).
    ///
    /// # Safety
    /// The CPU must support AVX2. `cache` holds 1 (FULL: 2) bytes per value of `input`, and
    /// `dense` is valid for writes of `input.len() / 2` bytes (it may be uninitialised).
    #[target_feature(enable = "avx2")]
    pub unsafe fn encode_bf16<const FULL: bool>(
        input: &[u8],
        cache: &mut [u8],
        dense: *mut u8,
        masks: &mut Vec<u64>,
        exps: &mut Vec<u8>,
        hash: &mut StripeHash,
    ) {
        let n = input.len() / 2;
        let mut acc = load_acc(hash);
        let base = hash.stripes;
        debug_assert!(n.is_multiple_of(64) && cache.len() == if FULL { 2 * n } else { n });
        let ff = _mm256_set1_epi16(0xff);
        let mut tmp = [0u8; 32];
        for b in (0..n).step_by(64) {
            let mut m = 0u64;
            for h in 0..2 {
                let v = b + 32 * h;
                // SAFETY: v + 32 <= n, so bytes [2v, 2v+64) of input, [v, v+32) of dense (by the
                // caller's contract) and of a field cache, [2v, 2v+64) of a FULL one are in
                // bounds; unaligned intrinsics.
                let ([xa, xb], c) = unsafe {
                    let x = load::<2>(input.as_ptr().add(2 * v));
                    let c = if FULL {
                        let [pa, pb] = load::<2>(cache.as_ptr().add(2 * v));
                        store::<2>(cache.as_mut_ptr().add(2 * v), x);
                        high_bytes16(pa, pb)
                    } else {
                        _mm256_loadu_si256(cache.as_ptr().add(v) as *const __m256i)
                    };
                    (x, c)
                };
                // Cached field: the high byte; always sent: the low byte.
                let e = high_bytes16(xa, xb);
                let sa = _mm256_and_si256(xa, ff);
                let sb = _mm256_and_si256(xb, ff);
                // packus works per 128-bit lane; the permute restores element order.
                let s = _mm256_permute4x64_epi64(_mm256_packus_epi16(sa, sb), 0b11_01_10_00);
                // SAFETY: as above.
                unsafe { _mm256_storeu_si256(dense.add(v) as *mut __m256i, s) };
                acc = stripe_step(acc, s, base + (v / 32) as u64);
                let diff = !(_mm256_movemask_epi8(_mm256_cmpeq_epi8(e, c)) as u32);
                if diff != 0 {
                    // SAFETY: as above; tmp is 32 bytes.
                    unsafe {
                        if !FULL {
                            _mm256_storeu_si256(cache.as_mut_ptr().add(v) as *mut __m256i, e);
                        }
                        _mm256_storeu_si256(tmp.as_mut_ptr() as *mut __m256i, e);
                    }
                    let mut t = diff;
                    while t != 0 {
                        exps.push(tmp[t.trailing_zeros() as usize]);
                        t &= t - 1;
                    }
                }
                m |= (diff as u64) << (32 * h);
            }
            masks.push(m);
        }
        store_acc(acc, hash, (n / 32) as u64);
    }

    /// Encode `input.len() / 4` (a multiple of 64) fp32 values, writing three sign+mantissa
    /// bytes per value at `dense` (bits 23..0, little-endian) and the high byte to the cache
    /// (FULL: the cache holds the values, whose high bytes are the fields; the new values
    /// replace them).
    ///
    /// # Safety
    /// The CPU must support AVX2. `cache` holds 1 (FULL: 4) bytes per value of `input`, and
    /// `dense` is valid for writes of `3 * input.len() / 4 + 4` bytes (it may be
    /// uninitialised): groups of 12 bytes are written with 16-byte stores, the next one
    /// overwriting the 4 extra.
    #[target_feature(enable = "avx2")]
    pub unsafe fn encode_f32<const FULL: bool>(
        input: &[u8],
        cache: &mut [u8],
        dense: *mut u8,
        masks: &mut Vec<u64>,
        exps: &mut Vec<u8>,
        hash: &mut StripeHash,
    ) {
        let n = input.len() / 4;
        let mut acc = load_acc(hash);
        let base = hash.stripes;
        debug_assert!(n.is_multiple_of(64) && cache.len() == if FULL { 4 * n } else { n });
        // Per 128-bit lane: the low three bytes of its four values, then nothing.
        let low3 = _mm256_setr_epi8(
            0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1, 0, 1, 2, 4, 5, 6, 8, 9, 10, 12,
            13, 14, -1, -1, -1, -1,
        );
        let mut tmp = [0u8; 32];
        for b in (0..n).step_by(64) {
            let mut m = 0u64;
            for h in 0..2 {
                let v = b + 32 * h;
                // SAFETY: v + 32 <= n, so bytes [4v, 4v+128) of input and of a FULL cache, and
                // [v, v+32) of a field cache are in bounds; unaligned loads.
                let (x, c) = unsafe {
                    let x = load::<4>(input.as_ptr().add(4 * v));
                    let c = if FULL {
                        let p = load::<4>(cache.as_ptr().add(4 * v));
                        store::<4>(cache.as_mut_ptr().add(4 * v), x);
                        high_bytes32(p)
                    } else {
                        _mm256_loadu_si256(cache.as_ptr().add(v) as *const __m256i)
                    };
                    (x, c)
                };
                let [x0, x1, x2, x3] = x;
                // Cached field: the high byte of each value, 32 of them in order.
                let e = high_bytes32(x);
                // Always sent: the low three bytes, 96 for 32 values, 12 per lane.
                let d = dense.add(3 * v);
                for (k, x) in [x0, x1, x2, x3].into_iter().enumerate() {
                    let y = _mm256_shuffle_epi8(x, low3);
                    // SAFETY: bytes [3v + 24k, 3v + 24k + 28) <= 3v + 100 <= 3n + 4: within
                    // the caller's contract.
                    unsafe {
                        _mm_storeu_si128(d.add(24 * k) as *mut __m128i, _mm256_castsi256_si128(y));
                        _mm_storeu_si128(
                            d.add(24 * k + 12) as *mut __m128i,
                            _mm256_extracti128_si256(y, 1),
                        );
                    }
                }
                for q in 0..3 {
                    // SAFETY: the 96 bytes at d were just written (in bounds, as above).
                    let s = unsafe { _mm256_loadu_si256(d.add(32 * q) as *const __m256i) };
                    acc = stripe_step(acc, s, base + (3 * v / 32 + q) as u64);
                }
                let diff = !(_mm256_movemask_epi8(_mm256_cmpeq_epi8(e, c)) as u32);
                if diff != 0 {
                    // SAFETY: [v, v+32) of a field cache is in bounds; tmp is 32 bytes.
                    unsafe {
                        if !FULL {
                            _mm256_storeu_si256(cache.as_mut_ptr().add(v) as *mut __m256i, e);
                        }
                        _mm256_storeu_si256(tmp.as_mut_ptr() as *mut __m256i, e);
                    }
                    let mut t = diff;
                    while t != 0 {
                        exps.push(tmp[t.trailing_zeros() as usize]);
                        t &= t - 1;
                    }
                }
                m |= (diff as u64) << (32 * h);
            }
            masks.push(m);
        }
        store_acc(acc, hash, (3 * n / 32) as u64);
    }

    /// The exceptions of one 64-value block `b` (mask word `mask`) into its 64 cached fields,
    /// from `exps[*k..]`: each must differ from the cached field.
    fn patch_exceptions(
        mask: u64,
        b: usize,
        exps: &[u8],
        k: &mut usize,
        fields: &mut [u8],
    ) -> Result<()> {
        let mut t = mask;
        while t != 0 {
            let j = t.trailing_zeros() as usize;
            t &= t - 1;
            let e = exps[*k];
            *k += 1;
            if e == fields[j] {
                return Err(CodecError::corrupt(
                    "exponent section",
                    format!(
                        "element {}: exception repeats the cached exponent {e}",
                        b + j
                    ),
                ));
            }
            fields[j] = e;
        }
        Ok(())
    }

    /// Patch block `b`'s fields (`mask`, `exps[*k..]`): in a field cache in place; for a FULL
    /// cache (the values) into `local`, from the high bytes (`high`) of the values' 32-byte
    /// vectors (`per` of them per 32 values). Returns the block's 64 fields.
    ///
    /// # Safety
    /// The CPU must support AVX2; the cache holds block `b` whole (64 values).
    #[inline]
    #[target_feature(enable = "avx2")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block_fields<const FULL: bool>(
        mask: u64,
        b: usize,
        exps: &[u8],
        k: &mut usize,
        cache: &mut [u8],
        local: &mut [u8; 64],
        per: usize,
        high: impl Fn(*const u8) -> __m256i,
    ) -> Result<*const u8> {
        if FULL {
            for h in 0..2 {
                let v = b + 32 * h;
                // SAFETY: the values v..v+32 are in the cache (`per` vectors of 32 bytes each
                // hold them); local is 64 bytes.
                unsafe {
                    let c = high(cache.as_ptr().add(per * v));
                    _mm256_storeu_si256(local.as_mut_ptr().add(32 * h) as *mut __m256i, c);
                }
            }
            patch_exceptions(mask, b, exps, k, local)?;
            Ok(local.as_ptr())
        } else {
            patch_exceptions(mask, b, exps, k, &mut cache[b..b + 64])?;
            // SAFETY: b + 64 <= cache.len() (the slice above).
            Ok(unsafe { cache.as_ptr().add(b) })
        }
    }

    /// Decode `dense.len() / 3` (a multiple of 64) fp32 values; returns how many exponents it
    /// used. FULL: the cache holds the values (the fields are their high bytes) and takes the
    /// decoded ones.
    ///
    /// # Safety
    /// The CPU must support AVX2. `cache` holds one byte (FULL: four) and `out` four bytes per
    /// value; `masks` one word per 64 values; `exps` at least as many bytes as mask bits.
    #[target_feature(enable = "avx2")]
    pub unsafe fn decode_f32<const FULL: bool>(
        dense: &[u8],
        masks: &[u64],
        exps: &[u8],
        cache: &mut [u8],
        out: &mut [u8],
        hash: &mut StripeHash,
    ) -> Result<usize> {
        let n = dense.len() / 3;
        let mut acc = load_acc(hash);
        let base = hash.stripes;
        debug_assert!(
            n.is_multiple_of(64)
                && cache.len() == if FULL { 4 * n } else { n }
                && out.len() == 4 * n
                && masks.len() == n / 64
        );
        // Lane 0 reads its 12 bytes from a load at the group's start, lane 1 from a load 4 bytes
        // before its group (so no load passes the group's end); each value's top byte is zero.
        let spread = _mm256_setr_epi8(
            0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1, 4, 5, 6, -1, 7, 8, 9, -1, 10, 11,
            12, -1, 13, 14, 15, -1,
        );
        let mut k = 0usize;
        let mut local = [0u8; 64];
        for (bi, &mask) in masks.iter().enumerate() {
            let b = bi * 64;
            // SAFETY: AVX2; the cache holds the block (n is a multiple of 64); the closure
            // reads 128 bytes of values (4 per value, 32 values).
            let fields = unsafe {
                block_fields::<FULL>(mask, b, exps, &mut k, cache, &mut local, 4, |p| {
                    high_bytes32(load::<4>(p))
                })?
            };
            for h in 0..2 {
                let v = b + 32 * h;
                let d = dense.as_ptr().add(3 * v);
                for q in 0..3 {
                    // SAFETY: 3v + 96 <= 3n: bytes [3v, 3v+96) of dense are in bounds.
                    let s = unsafe { _mm256_loadu_si256(d.add(32 * q) as *const __m256i) };
                    acc = stripe_step(acc, s, base + (3 * v / 32 + q) as u64);
                }
                for g in 0..4 {
                    // SAFETY: the loads cover [3v + 24g, 3v + 24g + 24) within the 96 bytes
                    // above; the block's fields [32h + 8g, +8) (64 of them), out's and a FULL
                    // cache's [4v + 32g, +32) are in bounds as v + 32 <= n.
                    unsafe {
                        let lo = _mm_loadu_si128(d.add(24 * g) as *const __m128i);
                        let hi = _mm_loadu_si128(d.add(24 * g + 8) as *const __m128i);
                        let sm = _mm256_shuffle_epi8(
                            _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1),
                            spread,
                        );
                        let e8 = _mm_loadl_epi64(fields.add(32 * h + 8 * g) as *const __m128i);
                        let e = _mm256_slli_epi32(_mm256_cvtepu8_epi32(e8), 24);
                        let x = _mm256_or_si256(sm, e);
                        _mm256_storeu_si256(
                            out.as_mut_ptr().add(4 * (v + 8 * g)) as *mut __m256i,
                            x,
                        );
                        if FULL {
                            store::<1>(cache.as_mut_ptr().add(4 * (v + 8 * g)), [x]);
                        }
                    }
                }
            }
        }
        store_acc(acc, hash, (3 * n / 32) as u64);
        Ok(k)
    }

    /// Decode `dense.len()` (a multiple of 64) bf16 values; returns how many exponents it used.
    /// FULL: the cache holds the values (the fields are their high bytes) and takes the decoded
    /// ones.
    ///
    /// # Safety
    /// The CPU must support AVX2. `cache` holds one byte (FULL: two) and `out` two bytes per
    /// value of `dense`; `masks` one word per 64 values; `exps` at least as many bytes as mask
    /// bits.
    #[target_feature(enable = "avx2")]
    pub unsafe fn decode_bf16<const FULL: bool>(
        dense: &[u8],
        masks: &[u64],
        exps: &[u8],
        cache: &mut [u8],
        out: &mut [u8],
        hash: &mut StripeHash,
    ) -> Result<usize> {
        let n = dense.len();
        let mut acc = load_acc(hash);
        let base = hash.stripes;
        debug_assert!(
            n.is_multiple_of(64)
                && out.len() == 2 * n
                && cache.len() == if FULL { 2 * n } else { n }
                && masks.len() == n / 64
        );
        let mut k = 0usize;
        let mut local = [0u8; 64];
        for (bi, &mask) in masks.iter().enumerate() {
            let b = bi * 64;
            // SAFETY: AVX2; the cache holds the block (n is a multiple of 64); the closure
            // reads 64 bytes of values (2 per value, 32 values).
            let fields = unsafe {
                block_fields::<FULL>(mask, b, exps, &mut k, cache, &mut local, 2, |p| {
                    let [a, b] = load::<2>(p);
                    high_bytes16(a, b)
                })?
            };
            for h in 0..2 {
                let v = b + 32 * h;
                // SAFETY: v + 32 <= n: bytes [v, v+32) of dense, [2v, 2v+64) of out and of a
                // FULL cache; the block's fields [32h, 32h+32) of 64.
                let (s, e) = unsafe {
                    (
                        _mm256_loadu_si256(dense.as_ptr().add(v) as *const __m256i),
                        _mm256_loadu_si256(fields.add(32 * h) as *const __m256i),
                    )
                };
                acc = stripe_step(acc, s, base + (v / 32) as u64);
                // value = cached byte << 8 | sent byte.
                let lo = _mm256_unpacklo_epi8(s, e);
                let hi = _mm256_unpackhi_epi8(s, e);
                let x = [
                    _mm256_permute2x128_si256(lo, hi, 0x20),
                    _mm256_permute2x128_si256(lo, hi, 0x31),
                ];
                // SAFETY: as above.
                unsafe {
                    store::<2>(out.as_mut_ptr().add(2 * v), x);
                    if FULL {
                        store::<2>(cache.as_mut_ptr().add(2 * v), x);
                    }
                }
            }
        }
        store_acc(acc, hash, (n / 32) as u64);
        Ok(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::float::Bf16;

    fn lcg(s: &mut u64) -> u64 {
        *s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *s >> 11
    }

    /// The AVX2 kernels against the plain ones, on the same data, for lengths around the
    /// 64-value block size and with random cache states.
    #[test]
    fn scan_matches_plain() {
        if !enabled() {
            eprintln!("skipping: no AVX2");
            return;
        }
        use crate::codec::float::{F16, F32};
        let mut s = 3;
        for n in [0usize, 1, 63, 64, 65, 200, 1000] {
            for bytes in [2usize, 4] {
                let input: Vec<u8> = (0..bytes * n).map(|_| lcg(&mut s) as u8).collect();
                let prev: Vec<u8> = input
                    .iter()
                    .map(|&b| {
                        if lcg(&mut s).is_multiple_of(3) {
                            lcg(&mut s) as u8
                        } else {
                            b
                        }
                    })
                    .collect();
                let (mut a1, mut e1, mut a2, mut e2) =
                    (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                if bytes == 2 {
                    kernels::scan_full::<Bf16>(&input, &prev, &mut a1, &mut e1);
                    assert!(scan_full::<Bf16>(&input, &prev, &mut a2, &mut e2));
                    assert_eq!((&a1, &e1), (&a2, &e2), "bf16 n={n}");
                    kernels::scan_full::<F16>(&input, &prev, &mut a1, &mut e1);
                    assert!(scan_full::<F16>(&input, &prev, &mut a2, &mut e2));
                } else {
                    kernels::scan_full::<F32>(&input, &prev, &mut a1, &mut e1);
                    assert!(scan_full::<F32>(&input, &prev, &mut a2, &mut e2));
                }
                assert_eq!((a1, e1), (a2, e2), "n={n} bytes={bytes}");
            }
        }
    }

    /// The AVX2 coders of `L` (bf16, fp32) against the plain ones, on the same data, for lengths
    /// around the 64-value block and random cache states: same dense bytes, masks, exceptions,
    /// cache and fused hashes, both decoders back to the input, a repeated field refused.
    fn coders_match_plain<L: crate::codec::float::Layout>(seed: u64) {
        if !enabled() {
            eprintln!("skipping: no AVX2 on this CPU (or CIERA_NO_SIMD set)");
            return;
        }
        let mut s = seed;
        let size = L::BYTES;
        for n in [0usize, 1, 31, 63, 64, 65, 127, 128, 1000, 4096 + 17] {
            let input: Vec<u8> = (0..size * n).map(|_| lcg(&mut s) as u8).collect();
            let cache0: Vec<u8> = (0..n)
                .map(|i| {
                    if lcg(&mut s).is_multiple_of(4) {
                        lcg(&mut s) as u8
                    } else {
                        input[size * i + size - 1]
                    }
                })
                .collect();
            let (mut c1, mut c2) = (cache0.clone(), cache0.clone());
            let (mut d1, mut d2) = (vec![0u8; L::sm_len(n)], vec![0xaa]);
            let (mut m1, mut m2, mut e1, mut e2) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            kernels::encode_exp::<L>(&input, CacheRef::Exp(&mut c1), &mut d1, &mut m1, &mut e1);
            let h = encode_exp::<L>(
                &input,
                &mut CacheRef::Exp(&mut c2),
                &mut d2,
                &mut m2,
                &mut e2,
            );
            assert_eq!(d2.remove(0), 0xaa, "appends after existing bytes");
            let hash = Some(crate::codec::checksum::sh64_plain(&d1));
            assert_eq!(h, hash, "fused encode hash n={n}");
            assert_eq!((&c1, &d1, &m1, &e1), (&c2, &d2, &m2, &e2), "encode n={n}");
            let (mut r1, mut r2) = (cache0.clone(), cache0.clone());
            let (mut o1, mut o2) = (vec![0u8; size * n], vec![0u8; size * n]);
            kernels::decode_exp::<L>(&d1, &m1, &e1, CacheRef::Exp(&mut r1), &mut o1).unwrap();
            let h = decode_exp::<L>(&d1, &m1, &e1, &mut CacheRef::Exp(&mut r2), &mut o2).unwrap();
            assert_eq!(h, hash, "fused decode hash n={n}");
            assert_eq!(o1, input, "plain decode n={n}");
            assert_eq!(o2, input, "avx2 decode n={n}");
            assert_eq!(r1, r2);
            // An exception that repeats the cached field is refused.
            if let Some(first) = (0..n).find(|&i| m1[i / 64] >> (i % 64) & 1 == 1) {
                let mut bad = e1.clone();
                bad[0] = cache0[first];
                let mut r = cache0.clone();
                let got = decode_exp::<L>(&d1, &m1, &bad, &mut CacheRef::Exp(&mut r), &mut o2);
                assert!(got.is_err(), "n={n}: a repeated field accepted");
            }
        }
    }

    /// The same on a full-value cache (the cache holds the previous values, fields their high
    /// bytes): the AVX2 coders read the fields from the values and store the new values in the
    /// same pass, as the plain ones do.
    fn full_cache_coders_match_plain<L: crate::codec::float::Layout>(seed: u64) {
        if !enabled() {
            eprintln!("skipping: no AVX2 on this CPU (or CIERA_NO_SIMD set)");
            return;
        }
        let mut s = seed;
        let size = L::BYTES;
        for n in [0usize, 1, 31, 63, 64, 65, 127, 128, 1000, 4096 + 17] {
            let input: Vec<u8> = (0..size * n).map(|_| lcg(&mut s) as u8).collect();
            // Previous values: the same, with a new top byte (the field) for about a quarter,
            // and new low bytes for about half.
            let mut prev0 = input.clone();
            for v in prev0.chunks_exact_mut(size) {
                if lcg(&mut s).is_multiple_of(4) {
                    v[size - 1] = lcg(&mut s) as u8;
                }
                if lcg(&mut s).is_multiple_of(2) {
                    v[0] = lcg(&mut s) as u8;
                }
            }
            let (mut c1, mut c2) = (prev0.clone(), prev0.clone());
            let (mut d1, mut d2) = (vec![0u8; L::sm_len(n)], Vec::new());
            let (mut m1, mut m2, mut e1, mut e2) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            kernels::encode_exp::<L>(&input, CacheRef::Full(&mut c1), &mut d1, &mut m1, &mut e1);
            let h = encode_exp::<L>(
                &input,
                &mut CacheRef::Full(&mut c2),
                &mut d2,
                &mut m2,
                &mut e2,
            );
            assert_eq!(
                h,
                Some(crate::codec::checksum::sh64_plain(&d1)),
                "hash n={n}"
            );
            assert_eq!((&d1, &m1, &e1), (&d2, &m2, &e2), "full encode n={n}");
            assert_eq!(
                (&c1, &c2),
                (&input, &input),
                "full caches take the values n={n}"
            );
            let (mut r1, mut r2) = (prev0.clone(), prev0.clone());
            let (mut o1, mut o2) = (vec![0u8; size * n], vec![0u8; size * n]);
            kernels::decode_exp::<L>(&d1, &m1, &e1, CacheRef::Full(&mut r1), &mut o1).unwrap();
            decode_exp::<L>(&d1, &m1, &e1, &mut CacheRef::Full(&mut r2), &mut o2).unwrap();
            assert_eq!((&o1, &o2), (&input, &input), "full decode n={n}");
            assert_eq!((&r1, &r2), (&input, &input), "full decode caches n={n}");
            // An exception that repeats the cached field is refused.
            if let Some(first) = (0..n).find(|&i| m1[i / 64] >> (i % 64) & 1 == 1) {
                let mut bad = e1.clone();
                bad[0] = prev0[size * first + size - 1];
                let mut r = prev0.clone();
                let got = decode_exp::<L>(&d1, &m1, &bad, &mut CacheRef::Full(&mut r), &mut o2);
                assert!(got.is_err(), "n={n}: a repeated field accepted");
            }
        }
    }

    #[test]
    fn avx2_matches_plain() {
        coders_match_plain::<Bf16>(7);
    }

    #[test]
    fn avx2_full_cache_matches_plain() {
        full_cache_coders_match_plain::<Bf16>(13);
        full_cache_coders_match_plain::<crate::codec::float::F32>(17);
    }

    #[test]
    fn avx2_f32_matches_plain() {
        coders_match_plain::<crate::codec::float::F32>(11);
    }
}
