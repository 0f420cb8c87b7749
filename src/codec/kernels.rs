//! Plain (portable, safe) coding kernels, generic over the float layout. They work in blocks
//! of 64 elements: one mask word per block. The AVX2 path in `simd.rs` is checked against
//! these bit for bit.

use super::error::{CodecError, Result};
use super::float::{Layout, BLOCK};

/// The cache range a kernel reads and updates.
pub enum CacheRef<'a> {
    /// One exponent byte per element.
    Exp(&'a mut [u8]),
    /// The previous value of every element (element bytes, little-endian).
    Full(&'a mut [u8]),
}

/// Exponent-delta encode of `input` (n elements): writes the packed sign+mantissa of every
/// element into `dense` (len `L::sm_len(n)`), one mask word per 64 elements into `masks`
/// (bit set = exponent differs from the cache), the new exponent of each set bit into `exps`,
/// and updates the cache to `input`.
pub fn encode_exp<L: Layout>(
    input: &[u8],
    cache: CacheRef<'_>,
    dense: &mut [u8],
    masks: &mut Vec<u64>,
    exps: &mut Vec<u8>,
) {
    let n = input.len() / L::BYTES;
    masks.clear();
    masks.reserve(n.div_ceil(BLOCK));
    let mut words = [0u32; BLOCK];
    match cache {
        CacheRef::Exp(ce) => {
            for b in (0..n).step_by(BLOCK) {
                let len = BLOCK.min(n - b);
                let mut m = 0u64;
                for j in 0..len {
                    let w = L::load(input, b + j);
                    words[j] = w;
                    m |= ((L::exp(w) != ce[b + j]) as u64) << j;
                }
                L::pack(&words[..len], &mut dense[L::sm_len(b)..L::sm_len(b + len)]);
                let mut t = m;
                while t != 0 {
                    let j = t.trailing_zeros() as usize;
                    t &= t - 1;
                    let e = L::exp(words[j]);
                    exps.push(e);
                    ce[b + j] = e;
                }
                masks.push(m);
            }
        }
        CacheRef::Full(prev) => {
            for b in (0..n).step_by(BLOCK) {
                let len = BLOCK.min(n - b);
                let mut m = 0u64;
                for (j, word) in words[..len].iter_mut().enumerate() {
                    let w = L::load(input, b + j);
                    *word = w;
                    m |= ((L::exp(w) != L::exp(L::load(prev, b + j))) as u64) << j;
                }
                L::pack(&words[..len], &mut dense[L::sm_len(b)..L::sm_len(b + len)]);
                let mut t = m;
                while t != 0 {
                    let j = t.trailing_zeros() as usize;
                    t &= t - 1;
                    exps.push(L::exp(words[j]));
                }
                masks.push(m);
            }
            prev.copy_from_slice(input);
        }
    }
}

/// A Hybrid value marked changed that equals the cached one.
pub(super) fn repeats_cached(i: usize) -> CodecError {
    CodecError::corrupt(
        "value section",
        format!("element {i} is marked changed but repeats the cached value"),
    )
}

/// An Exp or Hybrid exception that is out of range or repeats the cached exponent.
pub(super) fn bad_exception<L: Layout>(i: usize, e: u8, cached: u8) -> CodecError {
    if e > L::EXP_MAX {
        CodecError::corrupt(
            "exponent section",
            format!(
                "element {i}: exponent {e} exceeds the {} maximum {}",
                L::DTYPE,
                L::EXP_MAX
            ),
        )
    } else {
        CodecError::corrupt(
            "exponent section",
            format!("element {i}: exception repeats the cached exponent {cached}"),
        )
    }
}

/// Inverse of `encode_exp`. `exps.len()` must equal the number of set mask bits (checked by
/// the caller). Writes `out` and updates the cache; on error the cache range is inconsistent
/// and the caller must poison the slot.
pub fn decode_exp<L: Layout>(
    dense: &[u8],
    masks: &[u64],
    exps: &[u8],
    cache: CacheRef<'_>,
    out: &mut [u8],
) -> Result<()> {
    let n = out.len() / L::BYTES;
    let mut words = [0u32; BLOCK];
    let mut k = 0usize;
    let pad_err = || CodecError::corrupt("sign+mantissa section", "non-zero padding bits");
    match cache {
        CacheRef::Exp(ce) => {
            for (bi, b) in (0..n).step_by(BLOCK).enumerate() {
                let len = BLOCK.min(n - b);
                let mut t = masks[bi];
                while t != 0 {
                    let j = t.trailing_zeros() as usize;
                    t &= t - 1;
                    let e = exps[k];
                    k += 1;
                    if e > L::EXP_MAX || e == ce[b + j] {
                        return Err(bad_exception::<L>(b + j, e, ce[b + j]));
                    }
                    ce[b + j] = e;
                }
                if !L::unpack(&dense[L::sm_len(b)..L::sm_len(b + len)], &mut words[..len]) {
                    return Err(pad_err());
                }
                for j in 0..len {
                    L::store(out, b + j, L::with_exp(words[j], ce[b + j]));
                }
            }
        }
        CacheRef::Full(prev) => {
            let mut es = [0u8; BLOCK];
            for (bi, b) in (0..n).step_by(BLOCK).enumerate() {
                let len = BLOCK.min(n - b);
                fill_exps::<L>(&prev[b * L::BYTES..(b + len) * L::BYTES], &mut es[..len]);
                let mut t = masks[bi];
                while t != 0 {
                    let j = t.trailing_zeros() as usize;
                    t &= t - 1;
                    let e = exps[k];
                    k += 1;
                    if e > L::EXP_MAX || e == es[j] {
                        return Err(bad_exception::<L>(b + j, e, es[j]));
                    }
                    es[j] = e;
                }
                if !L::unpack(&dense[L::sm_len(b)..L::sm_len(b + len)], &mut words[..len]) {
                    return Err(pad_err());
                }
                for j in 0..len {
                    L::store(out, b + j, L::with_exp(words[j], es[j]));
                }
            }
            prev.copy_from_slice(out);
        }
    }
    Ok(())
}

/// Masks of a value-delta against the previous values: `changed` (value differs) and
/// `exp_changed` (exponent differs; a subset of `changed`).
pub fn scan_full<L: Layout>(
    input: &[u8],
    prev: &[u8],
    changed: &mut Vec<u64>,
    exp_changed: &mut Vec<u64>,
) {
    let n = input.len() / L::BYTES;
    changed.clear();
    exp_changed.clear();
    for b in (0..n).step_by(BLOCK) {
        let len = BLOCK.min(n - b);
        let (mut a, mut e) = (0u64, 0u64);
        for j in 0..len {
            let w = L::load(input, b + j);
            let p = L::load(prev, b + j);
            a |= ((w != p) as u64) << j;
            e |= ((L::exp(w) != L::exp(p)) as u64) << j;
        }
        changed.push(a);
        exp_changed.push(e);
    }
}

/// The hybrid sections from the masks of `scan_full`: `sm` (packed sign+mantissa of the
/// changed values), `exp_sub` (over the changed values in order: exponent changed), `exps`
/// (new exponents). Leaves the cache alone: the caller updates it once it has chosen the frame.
pub fn emit_hybrid<L: Layout>(
    input: &[u8],
    changed: &[u64],
    exp_changed: &[u64],
    sm: &mut Vec<u8>,
    exp_sub: &mut Vec<u64>,
    exps: &mut Vec<u8>,
    vals: &mut Vec<u32>,
) {
    let k: usize = changed.iter().map(|w| w.count_ones() as usize).sum();
    vals.clear();
    vals.reserve(k);
    exp_sub.clear();
    exp_sub.resize(k.div_ceil(64), 0);
    for (bi, (&a, &e)) in changed.iter().zip(exp_changed).enumerate() {
        let mut t = a;
        if e == 0 {
            // The common block: values changed, exponents kept.
            while t != 0 {
                let j = t.trailing_zeros() as usize;
                t &= t - 1;
                vals.push(L::load(input, bi * BLOCK + j));
            }
            continue;
        }
        while t != 0 {
            let j = t.trailing_zeros() as usize;
            t &= t - 1;
            let w = L::load(input, bi * BLOCK + j);
            let idx = vals.len();
            if e >> j & 1 == 1 {
                exp_sub[idx / 64] |= 1 << (idx % 64);
                exps.push(L::exp(w));
            }
            vals.push(w);
        }
    }
    let start = sm.len();
    sm.resize(start + L::sm_len(k), 0);
    L::pack(vals, &mut sm[start..]);
}

/// Inverse of `emit_hybrid`. On error the cache range is half-updated: the caller must poison
/// the slot. The caller has checked `sm.len() == L::sm_len(k)` and
/// `exps.len() == popcount(exp_sub)`, where k = popcount(changed).
#[allow(clippy::too_many_arguments)] // the frame's sections, the cache and the output
pub fn decode_hybrid<L: Layout>(
    sm: &[u8],
    changed: &[u64],
    exp_sub: &[u64],
    exps: &[u8],
    k: usize,
    prev: &mut [u8],
    out: &mut [u8],
    vals: &mut Vec<u32>,
) -> Result<()> {
    vals.clear();
    vals.resize(k, 0);
    if !L::unpack(sm, vals) {
        return Err(CodecError::corrupt(
            "sign+mantissa section",
            "non-zero padding bits",
        ));
    }
    // Patch the changed values into the cache in place, then copy the cache out once. The
    // exponent changes are few: walk them with a cursor instead of testing a bit per value.
    let mut next_e = next_set(exp_sub, 0);
    let mut idx = 0usize;
    let mut ei = 0usize;
    for (bi, &a) in changed.iter().enumerate() {
        let mut t = a;
        while t != 0 {
            let j = t.trailing_zeros() as usize;
            t &= t - 1;
            let i = bi * BLOCK + j;
            let p = L::load(prev, i);
            let w = if idx == next_e {
                next_e = next_set(exp_sub, idx + 1);
                let e = exps[ei];
                ei += 1;
                if e > L::EXP_MAX || e == L::exp(p) {
                    return Err(bad_exception::<L>(i, e, L::exp(p)));
                }
                L::with_exp(vals[idx], e)
            } else {
                let w = L::with_exp(vals[idx], L::exp(p));
                if w == p {
                    return Err(repeats_cached(i));
                }
                w
            };
            L::store(prev, i, w);
            idx += 1;
        }
    }
    out.copy_from_slice(prev);
    Ok(())
}

/// Index of the first set bit at or after `from` in `words`, or usize::MAX.
fn next_set(words: &[u64], from: usize) -> usize {
    let mut wi = from / 64;
    if wi >= words.len() {
        return usize::MAX;
    }
    let mut w = words[wi] & (u64::MAX << (from % 64));
    loop {
        if w != 0 {
            return wi * 64 + w.trailing_zeros() as usize;
        }
        wi += 1;
        if wi >= words.len() {
            return usize::MAX;
        }
        w = words[wi];
    }
}

/// The exponent field of each of `values` into `exps` (as many as both hold): what an exponent
/// cache keeps of values, and what the Exp decoder compares a full-value cache's with.
pub fn fill_exps<L: Layout>(values: &[u8], exps: &mut [u8]) {
    match L::BYTES {
        // Whole elements as arrays: the compiler vectorises these loops (2-3x faster than
        // indexing the bytes element by element).
        2 => {
            let (v, _) = values.as_chunks::<2>();
            for (e, v) in exps.iter_mut().zip(v) {
                *e = L::exp(u16::from_le_bytes(*v) as u32);
            }
        }
        _ => {
            let (v, _) = values.as_chunks::<4>();
            for (e, v) in exps.iter_mut().zip(v) {
                *e = L::exp(u32::from_le_bytes(*v));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::float::{Bf16, F16, F32};

    /// The vectorised exponent fill gives each element's exponent field, as the per-element
    /// definition does, for every type and for lengths that end mid-vector.
    #[test]
    fn exponent_fill_is_each_elements_field() {
        fn check<L: Layout>() {
            let mut s = 0x2545_F491_4F6C_DD1Du64;
            let bytes: Vec<u8> = (0..4099 * L::BYTES)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    s as u8
                })
                .collect();
            for n in [0, 1, 31, 64, 65, 1000, 4099] {
                let values = &bytes[..n * L::BYTES];
                let mut exps = vec![0xA5u8; n];
                fill_exps::<L>(values, &mut exps);
                let want: Vec<u8> = (0..n).map(|i| L::exp(L::load(values, i))).collect();
                assert_eq!(exps, want, "{:?}, {n} elements", L::DTYPE);
            }
        }
        check::<Bf16>();
        check::<F16>();
        check::<F32>();
    }
}
