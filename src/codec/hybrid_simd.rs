//! Vector fast paths of the Hybrid kernels (`kernels::emit_hybrid`, `kernels::decode_hybrid`)
//! for bf16 and fp32. The plain kernels walk the changed values one set bit at a time; here
//! - AVX2 + BMI2: a group of 8 bf16 (or 4 fp32) values is compacted or expanded by one byte
//!   shuffle chosen by its 8 (4) mask bits from a table;
//! - AVX-512 (F/BW/VL/VBMI2): a vector of 32 bf16 (16 fp32) values is compacted or expanded by
//!   one byte compress / expand under its mask, its new exponents likewise, with masked loads
//!   and stores (nothing read or written past a section);
//!
//! and on both the exponent mask over the changed values is one `pext` / `pdep` per block of 64.
//! A chunk already known to go as Hybrid is scanned and emitted in one pass ([`scan_emit`]):
//! each span of 2048 values is compared with the cache, emitted and copied to the cache while
//! it is in the first-level cache, instead of a pass to scan and another to emit (measured,
//! `cargo bench --bench codec`, 64 MiB, old and new binaries taking turns: bf16 encode
//! 0.91-1.00 -> 1.29-1.31 GB/s at step 102, 1.19-1.20 -> 1.47-1.74 at 599; fp32 1.27-1.44 ->
//! 1.47-1.94). Frames are the same bytes; `tests`
//! below check every path against the plain kernels bit for bit.
//!
//! Dispatch returns `None` / `Ok(None)` where no path applies (fp16, no AVX2 or BMI2,
//! `CIERA_NO_SIMD=1`), and the caller uses the plain kernel; `CIERA_NO_AVX512=1` keeps the AVX2
//! path (as for Delta frames).
#![allow(unsafe_code)] // the AVX2/BMI2 and AVX-512 intrinsics; every block says why it is sound

use super::checksum::StripeHash;
use super::error::Result;
use super::float::{Layout, BLOCK};
use super::kernels::{self, bad_exception, repeats_cached};
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

/// Which vector kernels code a block: AVX2 shuffles from tables, or AVX-512 byte compress /
/// expand (VBMI2) under masks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Avx2,
    Avx512,
}

/// Whether the processor has what the AVX-512 kernels use (F, BW, VL, VBMI2), beside AVX2/BMI2.
fn avx512_cpu() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static ON: OnceLock<bool> = OnceLock::new();
        *ON.get_or_init(|| {
            enabled()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx512vbmi2")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The path this process codes with: AVX-512 where the processor has it and
/// `CIERA_NO_AVX512` is unset (or "0"), as for Delta frames; else AVX2; None where neither
/// applies.
fn path() -> Option<Path> {
    use std::sync::OnceLock;
    static P: OnceLock<Option<Path>> = OnceLock::new();
    *P.get_or_init(|| {
        if avx512_cpu() && std::env::var_os("CIERA_NO_AVX512").is_none_or(|v| v == "0") {
            Some(Path::Avx512)
        } else if enabled() {
            Some(Path::Avx2)
        } else {
            None
        }
    })
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
    let masks = Masks::Given(changed, exp_changed);
    emit_on::<L>(path()?, input, masks, out, exp_sub, exps, prev).map(|(h, _)| h)
}

/// `kernels::scan_full` and [`emit`] in one pass, for a chunk already known to go as a Hybrid
/// frame: a span's masks are computed, its values emitted and the cache set while its bytes
/// are still in the first-level cache (one pass over the values and the cache instead of
/// two). `changed` and `exp_changed` are set as `scan_full` sets them, for the mask coding.
/// Returns SH64 of the sm and the number of changed values; None (and nothing touched) where
/// this path does not apply.
#[allow(clippy::too_many_arguments)] // the masks, emit's outputs, the cache
pub fn scan_emit<L: Layout>(
    input: &[u8],
    changed: &mut Vec<u64>,
    exp_changed: &mut Vec<u64>,
    out: &mut Vec<u8>,
    exp_sub: &mut Vec<u64>,
    exps: &mut Vec<u8>,
    prev: &mut [u8],
) -> Option<(u64, usize)> {
    let masks = Masks::Scan(changed, exp_changed);
    emit_on::<L>(path()?, input, masks, out, exp_sub, exps, prev)
}

/// Where `emit_on` takes the masks from.
enum Masks<'a> {
    /// Computed by the caller (`scan_full`), a word per block of 64 values.
    Given(&'a [u64], &'a [u64]),
    /// Computed here, span by span, into these (cleared first).
    Scan(&'a mut Vec<u64>, &'a mut Vec<u64>),
}

impl Masks<'_> {
    /// (changed, exponent changed) of blocks `b`.
    fn blocks(&self, b: std::ops::Range<usize>) -> (&[u64], &[u64]) {
        match self {
            Masks::Given(a, e) => (&a[b.clone()], &e[b]),
            Masks::Scan(a, e) => (&a[b.clone()], &e[b]),
        }
    }
}

/// [`emit`] (or [`scan_emit`]) on the given path (which the caller has checked applies):
/// SH64 of the sm and the number of changed values.
fn emit_on<L: Layout>(
    path: Path,
    input: &[u8],
    mut masks: Masks<'_>,
    out: &mut Vec<u8>,
    exp_sub: &mut Vec<u64>,
    exps: &mut Vec<u8>,
    prev: &mut [u8],
) -> Option<(u64, usize)> {
    let smb = sm_bytes::<L>()?;
    assert_eq!(prev.len(), input.len());
    let n = input.len() / L::BYTES;
    let blocks = n.div_ceil(BLOCK);
    // The changed values (at most n while scanning: the bounds below take the worst case).
    let k = match &mut masks {
        Masks::Given(a, e) => {
            assert!(a.len() == blocks && e.len() == blocks);
            a.iter().map(|w| w.count_ones() as usize).sum()
        }
        Masks::Scan(a, e) => {
            a.clear();
            e.clear();
            a.reserve(blocks);
            e.reserve(blocks);
            n
        }
    };
    exp_sub.clear();
    if let Masks::Given(..) = masks {
        exp_sub.resize(k.div_ceil(64), 0);
    }
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
        if let Masks::Scan(a, e) = &mut masks {
            let (x, p) = (&input[vals.clone()], &prev[vals.clone()]);
            match path {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX-512 F/BW checked by `avx512_cpu()` (the caller's path); x and p
                // are the same whole blocks of L::BYTES-byte values.
                Path::Avx512 => unsafe {
                    let exp_mask = (L::EXP_MAX as u32) << L::EXP_SHIFT;
                    avx512::scan(x, p, L::BYTES, exp_mask, a, e)
                },
                _ => simd::scan_blocks::<L>(x, p, a, e),
            }
            // Room for the exponent bits of every value of the span.
            let need = (idx + (b1 - b0) * BLOCK).div_ceil(64);
            if exp_sub.len() < need {
                exp_sub.resize(need, 0);
            }
        }
        let (cw, ew) = masks.blocks(b0..b1);
        let at = out.len();
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and BMI2 checked by `enabled()` (AVX-512 by `avx512_cpu()`, on that
        // path: `path()` or the caller of `emit_on`). `input` holds the blocks b0..b1 of 64
        // values; `cw`/`ew` have a word per block; `exp_sub` holds the bits of every changed
        // value up to these blocks' last (sized from k, or grown above for the span); the
        // writes go to `out`'s spare capacity after `at`, which holds at least
        // `smb * (k - idx) + 16` bytes (`smb * k + 16` reserved after `start`, `smb * idx`
        // used since), and the kernel returns how many of them it initialised (the packed sm
        // of the changed values of those blocks) and how many changed values it saw.
        let (written, seen) = unsafe {
            let emit = match path {
                Path::Avx2 => avx2::emit,
                // AVX-512 F/BW/VL/VBMI2 checked by `avx512_cpu()` (the caller's path).
                Path::Avx512 => avx512::emit,
            };
            emit(
                &input[vals.clone()],
                cw,
                ew,
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
    let tail = full * BLOCK * L::BYTES;
    if let Masks::Scan(a, e) = &mut masks {
        if full < blocks {
            let (mut ta, mut te) = (Vec::new(), Vec::new());
            kernels::scan_full::<L>(&input[tail..], &prev[tail..], &mut ta, &mut te);
            a.extend_from_slice(&ta);
            e.extend_from_slice(&te);
            exp_sub.resize((idx + ta[0].count_ones() as usize).div_ceil(64), 0);
        }
    }
    // The partial last block, one value at a time.
    let (cw, ew) = masks.blocks(full..blocks);
    for (bi, (&a, &e)) in (full..).zip(cw.iter().zip(ew)) {
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
    if let Masks::Scan(..) = masks {
        exp_sub.truncate(idx.div_ceil(64));
    }
    debug_assert!(matches!(masks, Masks::Scan(..)) || idx == k);
    debug_assert_eq!(out.len(), start + L::sm_len(idx));
    prev[tail..].copy_from_slice(&input[tail..]);
    let whole = (out.len() - hashed) / 32 * 32;
    simd::stripes(&out[hashed..hashed + whole], &mut hash);
    hashed += whole;
    Some((hash.finish(&out[hashed..], out.len() - start), idx))
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
    match path() {
        Some(p) => decode_on::<L>(p, sm, changed, exp_sub, exps, prev, out),
        None => Ok(None),
    }
}

/// [`decode`] on the given path (which the caller has checked applies).
fn decode_on<L: Layout>(
    path: Path,
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
    let n = out.len() / L::BYTES;
    assert!(prev.len() == out.len() && changed.len() == n.div_ceil(BLOCK));
    let mut st = Cursor::default();
    // Whole blocks while a block's 16-byte shuffle loads stay inside `sm` (AVX2); the AVX-512
    // kernel's masked loads read only the bytes they use, and it checks them against `sm`.
    let fast_end = match path {
        Path::Avx2 => sm.len().saturating_sub(smb * BLOCK + 16),
        Path::Avx512 => sm.len(),
    };
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
        prefetch_ahead(&prev[range.start..], &out[range.start..], L::BYTES);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and BMI2 checked by `enabled()` (AVX-512 by `avx512_cpu()`, on that
        // path); `prev` and `out` ranges hold one block of 64 values; on the AVX2 path
        // `st.pos + 64 * smb + 16 <= sm.len()`, so every shuffle load of the block (at most
        // 64 * smb bytes consumed, 16 read) is inside `sm`.
        unsafe {
            let decode_block = match path {
                Path::Avx2 => avx2::decode_block,
                // AVX-512 F/BW/VL/VBMI2 checked by `avx512_cpu()` (the caller's path); the
                // kernel bounds its reads of `sm` and `exps` itself.
                Path::Avx512 => avx512::decode_block,
            };
            decode_block(
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

/// How far ahead (bytes) the values passes ask for the lines they will read: a span's worth.
/// The encoder's scan and emit, and the decoder's blocks, work span by span, and between two
/// spans' loads the hardware prefetchers lose the stream (measured, 64 MiB chunks: encode
/// 7-11% faster with 4096, less with 2048 or 8192).
const PREFETCH: usize = 4096;

/// Ask for the lines of the block `PREFETCH` bytes on in `prev` (to read) and `out` (to
/// write), for a block of 64 values of `vsize` bytes (`simd::prefetch_lines`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ahead(prev: &[u8], out: &[u8], vsize: usize) {
    simd::prefetch_lines::<false>(prev.as_ptr().wrapping_add(PREFETCH), 64 * vsize);
    simd::prefetch_lines::<true>(out.as_ptr().wrapping_add(PREFETCH), 64 * vsize);
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

/// The lanes of a block (changed lanes `a`) whose exponent changed: the next popcount(a) bits
/// of `exp_sub` from bit `idx`, deposited on the set bits of `a`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "bmi2")]
fn exp_lanes(a: u64, exp_sub: &[u64], idx: usize) -> u64 {
    if a == 0 {
        0
    } else {
        std::arch::x86_64::_pdep_u64(bits_at(exp_sub, idx, a.count_ones()), a)
    }
}

/// Append the exponent bits of a block's changed values (lanes `a`, exponent changed `e`), in
/// order, to `exp_sub` at bit `idx` (the bits there and past them are zero).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "bmi2")]
fn append_exp_bits(exp_sub: &mut [u64], idx: usize, a: u64, e: u64) {
    let bits = std::arch::x86_64::_pext_u64(e, a);
    let (wi, sh) = (idx / 64, idx % 64);
    exp_sub[wi] |= bits << sh;
    if sh != 0 && (a.count_ones() as usize) + sh > 64 {
        exp_sub[wi + 1] |= bits >> (64 - sh);
    }
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

    use super::{append_exp_bits, bad_exception, exp_lanes, repeats_cached, tables, Cursor};
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
                append_exp_bits(exp_sub, idx, a, e);
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
        let eb = exp_lanes(a, exp_sub, st.idx);
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

/// The AVX-512 kernels: what `avx2` does, with the byte compress and expand of VBMI2 under a
/// mask instead of a table shuffle per eight (bf16) or four (fp32) values. A bf16 block is two
/// vectors of 32 values, an fp32 block four of 16. The sm bytes of a vector's changed values
/// are one compress (emit) or one expand into the cached values (decode), and so are its new
/// exponents (the high byte of each value: bf16 and fp32 alike); loads and stores are masked to
/// the bytes they use, so nothing is read or written past a section.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{append_exp_bits, bad_exception, exp_lanes, repeats_cached, Cursor};
    use crate::codec::error::{CodecError, Result};
    use crate::codec::float::{Bf16, Layout, F32};
    use crate::codec::simd::prefetch_lines;

    /// Byte masks of one vector's values from their lane mask `m`: (the sm bytes, the high
    /// byte). bf16: 32 lanes of 2 bytes; fp32: 16 lanes of 4 bytes.
    #[inline(always)]
    fn byte_masks(smb: usize, m: u64) -> (u64, u64) {
        // SAFETY: BMI2 (`pdep`) is checked by the callers' path (`avx512_cpu()` implies it).
        unsafe {
            if smb == 1 {
                (
                    _pdep_u64(m, 0x5555_5555_5555_5555),
                    _pdep_u64(m, 0xaaaa_aaaa_aaaa_aaaa),
                )
            } else {
                let ones = _pdep_u64(m, 0x1111_1111_1111_1111);
                (ones * 7, ones << 3)
            }
        }
    }

    /// The low `bytes` (<= 64) bits set.
    #[inline(always)]
    fn low(bytes: usize) -> u64 {
        if bytes >= 64 {
            u64::MAX
        } else {
            (1u64 << bytes) - 1
        }
    }

    /// `simd::scan_blocks` (the same masks): the changed and exponent-changed values of whole
    /// blocks of 64 values of `vsize` (2 or 4) bytes, a word each appended to `changed` and
    /// `exp_changed`, the lane masks straight from the compares (AVX2 packs and moves them).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW; `input.len() == prev.len()`, a multiple of
    /// `64 * vsize`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn scan(
        input: &[u8],
        prev: &[u8],
        vsize: usize,
        exp_mask: u32,
        changed: &mut Vec<u64>,
        exp_changed: &mut Vec<u64>,
    ) {
        const PF: usize = super::PREFETCH;
        let blocks = input.len() / (64 * vsize);
        changed.reserve(blocks);
        exp_changed.reserve(blocks);
        let (c0, e0) = (changed.len(), exp_changed.len());
        let (cp, ep) = (changed.as_mut_ptr(), exp_changed.as_mut_ptr());
        let (ip, pp) = (input.as_ptr(), prev.as_ptr());
        // SAFETY: the loads: block b's 64 * vsize bytes lie in both slices (the caller's
        // lengths); the stores: `blocks` words of spare capacity reserved above, which
        // `set_len` then covers.
        unsafe {
            if vsize == 2 {
                let em = _mm512_set1_epi16(exp_mask as i16);
                for b in 0..blocks {
                    let (mut a, mut e) = (0u64, 0u64);
                    for h in 0..2 {
                        let off = 128 * b + 64 * h;
                        prefetch_lines::<false>(ip.wrapping_add(off + PF), 64);
                        prefetch_lines::<false>(pp.wrapping_add(off + PF), 64);
                        let x = _mm512_loadu_si512(ip.add(off) as *const _);
                        let p = _mm512_loadu_si512(pp.add(off) as *const _);
                        a |= (_mm512_cmpneq_epi16_mask(x, p) as u64) << (32 * h);
                        e |=
                            (_mm512_test_epi16_mask(_mm512_xor_si512(x, p), em) as u64) << (32 * h);
                    }
                    *cp.add(c0 + b) = a;
                    *ep.add(e0 + b) = e;
                }
            } else {
                let em = _mm512_set1_epi32(exp_mask as i32);
                for b in 0..blocks {
                    let (mut a, mut e) = (0u64, 0u64);
                    for q in 0..4 {
                        let off = 256 * b + 64 * q;
                        prefetch_lines::<false>(ip.wrapping_add(off + PF), 64);
                        prefetch_lines::<false>(pp.wrapping_add(off + PF), 64);
                        let x = _mm512_loadu_si512(ip.add(off) as *const _);
                        let p = _mm512_loadu_si512(pp.add(off) as *const _);
                        a |= (_mm512_cmpneq_epi32_mask(x, p) as u64) << (16 * q);
                        e |=
                            (_mm512_test_epi32_mask(_mm512_xor_si512(x, p), em) as u64) << (16 * q);
                    }
                    *cp.add(c0 + b) = a;
                    *ep.add(e0 + b) = e;
                }
            }
            changed.set_len(c0 + blocks);
            exp_changed.set_len(e0 + blocks);
        }
    }

    /// Emit whole blocks, as `avx2::emit` (same arguments, same results).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL/VBMI2 and BMI2; otherwise as `avx2::emit`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,bmi2,popcnt")]
    #[allow(clippy::too_many_arguments)] // as avx2::emit
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
        // Values per vector and their lane-mask width.
        let (per, vsize) = if smb == 1 { (32, 2) } else { (16, 4) };
        let lane_mask = low(per);
        exps.reserve(64 * changed.len());
        let (ep, mut elen) = (exps.as_mut_ptr(), exps.len());
        // No branch on a vector's changes or exponent changes (as good as random in the
        // middle of training): a vector without any stores nothing (its store masks are empty).
        for (bi, (&a, &e)) in changed.iter().zip(exp_changed).enumerate() {
            if a == 0 {
                continue;
            }
            append_exp_bits(exp_sub, idx, a, e);
            idx += a.count_ones() as usize;
            let base = bi * 64 * vsize;
            for v in 0..64 / per {
                let m = (a >> (per * v)) & lane_mask;
                let me = (e >> (per * v)) & lane_mask;
                let (ks, ke) = (byte_masks(smb, m).0, byte_masks(smb, me).1);
                // SAFETY: the vector's 64 bytes are inside the block of `input` (64 values of
                // `vsize` bytes per word of `changed`); the masked store writes
                // `smb * popcount(m)` bytes at dst + pos, within the caller's
                // `smb * popcount(changed)`; the exponents' masked store writes popcount(me)
                // <= 32 bytes into `exps`' spare capacity (64 per block reserved above), which
                // `set_len` below covers.
                unsafe {
                    let x = _mm512_loadu_si512(input.as_ptr().add(base + 64 * v) as *const _);
                    let c = _mm512_maskz_compress_epi8(ks, x);
                    let nb = smb * m.count_ones() as usize;
                    _mm512_mask_storeu_epi8(dst.add(pos) as *mut i8, low(nb), c);
                    pos += nb;
                    let ce = _mm512_maskz_compress_epi8(ke, x);
                    let ne = me.count_ones() as usize;
                    _mm512_mask_storeu_epi8(ep.add(elen) as *mut i8, low(ne), ce);
                    elen += ne;
                }
            }
        }
        // SAFETY: the masked stores above initialised exps[len..elen), within the reserve.
        unsafe { exps.set_len(elen) };
        (pos, idx - idx0)
    }

    /// Decode one whole block of 64 values, as `avx2::decode_block` (same arguments, same
    /// results, the same first error), with no bound on `st.pos`: the reads of `sm` and `exps`
    /// are checked here (a corrupt-section error where they would run past; the caller's
    /// length checks make that unreachable for a frame that passed them).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL/VBMI2 and BMI2; `smb` is 1 (bf16) or 3 (fp32);
    /// `prev` and `out` hold 64 values each.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,bmi2,popcnt")]
    #[allow(clippy::too_many_arguments)] // as avx2::decode_block
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
        let eb = exp_lanes(a, exp_sub, st.idx);
        let need_sm = smb * cnt as usize;
        let need_e = eb.count_ones() as usize;
        if st.pos + need_sm > sm.len() || st.ei + need_e > exps.len() {
            return Err(CodecError::corrupt(
                "hybrid frame",
                "masks mark more changes than the sections hold",
            ));
        }
        st.idx += cnt as usize;
        let (per, hi) = if smb == 1 {
            (32, 0xaaaa_aaaa_aaaa_aaaa_u64)
        } else {
            (16, 0x8888_8888_8888_8888_u64)
        };
        let lane_mask = low(per);
        let (pp, op) = (prev.as_mut_ptr(), out.as_mut_ptr());
        // Lanes (of the block) whose new value repeats the cached one, and exponent changes
        // that repeat the cached exponent.
        let (mut same, mut same_exp) = (0u64, 0u64);
        for v in 0..64 / per {
            let m = (a >> (per * v)) & lane_mask;
            // SAFETY: `prev` and `out` hold 64 values (128 or 256 bytes): the vector at 64v is
            // inside. The masked loads read `smb * popcount(m)` bytes of `sm` at `st.pos` and
            // popcount(me) of `exps` at `st.ei`, inside both by the check above (the block's
            // totals fit, and these are parts of them).
            unsafe {
                let p = _mm512_loadu_si512(pp.add(64 * v) as *const _);
                if m == 0 {
                    _mm512_storeu_si512(op.add(64 * v) as *mut _, p);
                    continue;
                }
                let me = (eb >> (per * v)) & lane_mask;
                let (ks, ke) = (byte_masks(smb, m).0, byte_masks(smb, me).1);
                let nb = smb * m.count_ones() as usize;
                let s = _mm512_maskz_loadu_epi8(low(nb), sm.as_ptr().add(st.pos) as *const i8);
                st.pos += nb;
                let mut nv = _mm512_mask_expand_epi8(p, ks, s);
                if me != 0 {
                    let ne = me.count_ones() as usize;
                    let x = _mm512_maskz_loadu_epi8(low(ne), exps.as_ptr().add(st.ei) as *const i8);
                    st.ei += ne;
                    nv = _mm512_mask_expand_epi8(nv, ke, x);
                }
                _mm512_storeu_si512(pp.add(64 * v) as *mut _, nv);
                _mm512_storeu_si512(op.add(64 * v) as *mut _, nv);
                let (eq, eq_hi) = if smb == 1 {
                    (
                        _mm512_cmpeq_epi16_mask(nv, p) as u64,
                        _pext_u64(_mm512_cmpeq_epi8_mask(nv, p), hi),
                    )
                } else {
                    (
                        _mm512_cmpeq_epi32_mask(nv, p) as u64,
                        _pext_u64(_mm512_cmpeq_epi8_mask(nv, p), hi),
                    )
                };
                same |= (eq & m & !me) << (per * v);
                same_exp |= (eq_hi & me) << (per * v);
            }
        }
        let bad = same | same_exp;
        if bad != 0 {
            let j = bad.trailing_zeros() as usize;
            if same_exp >> j & 1 == 1 {
                let e = if smb == 1 {
                    Bf16::exp(Bf16::load(prev, j))
                } else {
                    F32::exp(F32::load(prev, j))
                };
                return Err(if smb == 1 {
                    bad_exception::<Bf16>(first + j, e, e)
                } else {
                    bad_exception::<F32>(first + j, e, e)
                });
            }
            return Err(repeats_cached(first + j));
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
        for path in test_paths() {
            path_matches::<L>(path, input, prev0);
        }
    }

    /// Every vector path this processor can run (whatever `CIERA_NO_AVX512` says: the test
    /// compares each with the plain kernels).
    fn test_paths() -> Vec<Path> {
        let mut v = vec![Path::Avx2];
        if avx512_cpu() {
            v.push(Path::Avx512);
        } else {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| eprintln!("note: no AVX-512 VBMI2 here: the AVX2 path only"));
        }
        v
    }

    fn path_matches<L: Layout>(path: Path, input: &[u8], prev0: &[u8]) {
        let (mut a, mut e) = (Vec::new(), Vec::new());
        kernels::scan_full::<L>(input, prev0, &mut a, &mut e);
        let k: usize = a.iter().map(|w| w.count_ones() as usize).sum();
        let (mut sm1, mut sub1, mut ex1, mut vals) =
            (vec![7u8], Vec::new(), Vec::new(), Vec::new());
        kernels::emit_hybrid::<L>(input, &a, &e, &mut sm1, &mut sub1, &mut ex1, &mut vals);
        let (mut sm2, mut sub2, mut ex2) = (vec![7u8], vec![99], vec![]);
        let mut pe = prev0.to_vec();
        let masks = Masks::Given(&a, &e);
        let h = emit_on::<L>(path, input, masks, &mut sm2, &mut sub2, &mut ex2, &mut pe);
        assert_eq!((&sm1, &sub1, &ex1), (&sm2, &sub2, &ex2), "emit on {path:?}");
        assert_eq!(pe, input, "emit updates the cache");
        let sm = &sm1[1..];
        let hash = crate::codec::checksum::sh64_plain(sm);
        assert_eq!(h, Some((hash, k)), "fused encode hash");
        // Scanned and emitted in one pass: the same masks and sections, from stale outputs.
        let (mut a3, mut e3) = (vec![5u64; 3], vec![6u64]);
        let (mut sm3, mut sub3, mut ex3) = (vec![7u8], vec![99, 98], vec![]);
        let mut pe = prev0.to_vec();
        let masks = Masks::Scan(&mut a3, &mut e3);
        let h3 = emit_on::<L>(path, input, masks, &mut sm3, &mut sub3, &mut ex3, &mut pe);
        assert_eq!((&a3, &e3), (&a, &e), "scan_emit masks on {path:?}");
        assert_eq!(
            (&sm1, &sub1, &ex1),
            (&sm3, &sub3, &ex3),
            "scan_emit on {path:?}"
        );
        assert_eq!(pe, input, "scan_emit updates the cache");
        assert_eq!(h3, Some((hash, k)), "scan_emit hash and changed values");
        let n = input.len() / L::BYTES;
        let (mut p1, mut p2) = (prev0.to_vec(), prev0.to_vec());
        let (mut o1, mut o2) = (vec![0u8; input.len()], vec![1u8; input.len()]);
        kernels::decode_hybrid::<L>(sm, &a, &sub1, &ex1, k, &mut p1, &mut o1, &mut vals).unwrap();
        let h = decode_on::<L>(path, sm, &a, &sub1, &ex1, &mut p2, &mut o2).unwrap();
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
            check_refused::<L>(path, &bad, &a, &sub1, &ex1, k, prev0);
        }
        if !ex1.is_empty() {
            let i = (0..n).find(|&x| e[x / 64] >> (x % 64) & 1 == 1).unwrap();
            let mut bad = ex1.clone();
            bad[0] = L::exp(L::load(prev0, i));
            check_refused::<L>(path, sm, &a, &sub1, &bad, k, prev0);
        }
    }

    fn check_refused<L: Layout>(
        path: Path,
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
        let e2 = decode_on::<L>(path, sm, a, sub, ex, &mut p2, &mut o2);
        match (e1, e2) {
            (Err(x), Err(y)) => assert_eq!(x.to_string(), y.to_string(), "{path:?}"),
            (x, y) => panic!("plain {x:?}, {path:?} {y:?}"),
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

    /// The AVX-512 decode bounds its own reads: sections shorter than the masks say are an
    /// error, never a read past them (the frame's length checks come first in `chunk.rs`; this
    /// is the kernel's own guard).
    #[test]
    fn avx512_decode_refuses_short_sections() {
        if !avx512_cpu() {
            eprintln!("skipping: no AVX-512 VBMI2 on this CPU (or CIERA_NO_SIMD set)");
            return;
        }
        let (x, p) = data(2, 4096, 7, 60, 30);
        let (mut a, mut e) = (Vec::new(), Vec::new());
        kernels::scan_full::<Bf16>(&x, &p, &mut a, &mut e);
        let (mut sm, mut sub, mut ex, mut vals) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        kernels::emit_hybrid::<Bf16>(&x, &a, &e, &mut sm, &mut sub, &mut ex, &mut vals);
        assert!(!sm.is_empty() && !ex.is_empty());
        let run = |sm: &[u8], ex: &[u8]| {
            let (mut pc, mut o) = (p.clone(), vec![0u8; x.len()]);
            decode_on::<Bf16>(Path::Avx512, sm, &a, &sub, ex, &mut pc, &mut o)
        };
        assert!(run(&sm, &ex).unwrap().is_some());
        for cut in [1, 2, 31, sm.len() / 2, sm.len()] {
            let e = run(&sm[..sm.len() - cut], &ex).unwrap_err().to_string();
            assert!(
                e.contains("more changes than the sections hold"),
                "sm cut {cut}: {e}"
            );
        }
        for cut in [1, ex.len()] {
            let e = run(&sm, &ex[..ex.len() - cut]).unwrap_err().to_string();
            assert!(
                e.contains("more changes than the sections hold"),
                "exps cut {cut}: {e}"
            );
        }
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
