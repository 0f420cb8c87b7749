//! Test and bench data: the trace (its folder, its snapshots in order), an fp16 cast of fp32
//! values, and synthetic drift with special values, from a deterministic generator.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use ciera::codec::{CacheSlot, FrameInfo};
use ciera::safetensors::SafeTensors;
use ciera::DType;

/// The repository: `CIERA_REPO_DIR` (set by bench/gpu_check.sh, whose programs were built in
/// another checkout), else the one these programs were built from.
pub fn repo_dir() -> PathBuf {
    std::env::var_os("CIERA_REPO_DIR")
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// The real trace beside the repository (CI has it), else the slice the repository ships.
pub fn trace_dir() -> PathBuf {
    let root = repo_dir();
    let full = root.join("../shared/traces/olmoe-mini-s0");
    if full.is_dir() {
        full
    } else {
        root.join("tests/data/olmoe-slice")
    }
}

/// The snapshots of a trace folder, in step order.
pub fn snapshots(dir: &Path) -> Vec<SafeTensors> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    files
        .iter()
        .map(|p| SafeTensors::open(p).unwrap())
        .collect()
}

/// fp32 -> fp16, round to nearest even (fp16 data with real drift).
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    if exp == 0xff {
        return sign
            | 0x7c00
            | if man != 0 {
                0x200 | (man >> 13) as u16
            } else {
                0
            };
    }
    let e = exp - 127 + 15;
    if e >= 31 {
        return sign | 0x7c00;
    }
    let (m, shift) = if e <= 0 {
        if e < -10 {
            return sign;
        }
        (man | 0x80_0000, (14 - e) as u32)
    } else {
        (man, 13)
    };
    let mut h = m >> shift;
    let rem = m & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    if rem > half || (rem == half && h & 1 == 1) {
        h += 1;
    }
    let v = if e <= 0 { h } else { ((e as u32) << 10) + h };
    sign | v as u16
}

/// A deterministic generator for synthetic drift.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let x = self.0;
        (x ^ (x >> 29)).wrapping_mul(0xbf58476d1ce4e5b9) ^ (x >> 32)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}

/// Values of `dtype` drifting from `prev`: a share `keep` (per mille) stay as they were (what
/// a full-value cache sees); of the others a share `p_exp` change their cached field, a share
/// `p_special` become NaN, infinities, -0, 0 or subnormals, the rest change low mantissa bits
/// only.
pub fn drift(
    dtype: DType,
    prev: &[u8],
    p_exp: u64,
    p_special: u64,
    keep: u64,
    rng: &mut Rng,
) -> Vec<u8> {
    let size = dtype.size();
    let mut out = prev.to_vec();
    let bf16: [u16; 8] = [
        0x7fc0, 0xffc1, 0x7f80, 0xff80, 0x8000, 0x0000, 0x0001, 0x807f,
    ];
    let f16: [u16; 8] = [
        0x7e00, 0xfe01, 0x7c00, 0xfc00, 0x8000, 0x0000, 0x0001, 0x83ff,
    ];
    let f32: [u32; 8] = [
        0x7fc0_0001,
        0xffa0_0000,
        0x7f80_0000,
        0xff80_0000,
        0x8000_0000,
        0,
        1,
        0x807f_ffff,
    ];
    for v in out.chunks_exact_mut(size) {
        let r = rng.below(1000);
        let x = rng.next();
        let s = (x % 8) as usize;
        if (x >> 40) % 1000 < keep {
            continue;
        }
        if r < p_special {
            match dtype {
                DType::BF16 => v.copy_from_slice(&bf16[s].to_le_bytes()),
                DType::F16 => v.copy_from_slice(&f16[s].to_le_bytes()),
                _ => v.copy_from_slice(&f32[s].to_le_bytes()),
            }
        } else if r < p_special + p_exp {
            match dtype {
                DType::BF16 => v[1] ^= 1 << (x % 8),
                DType::F16 => {
                    let w = u16::from_le_bytes([v[0], v[1]]) ^ (1 << (10 + x % 5));
                    v.copy_from_slice(&w.to_le_bytes());
                }
                _ => v[3] ^= 1 << (x % 8),
            }
        } else {
            v[0] ^= (x >> 8) as u8;
            if size == 4 {
                v[1] ^= (x >> 16) as u8;
            }
        }
    }
    out
}

/// Values moved by a few ulps (a share `p_move` per mille of them; a tenth of those by up to
/// 2^(W-2)), a share `p_special` per mille replaced by NaN payloads, infinities, -0, 0 or
/// subnormals: the moves Delta frames code, across exponents, through zero and into the
/// special values. A move steps the W-bit pattern as an integer monotone in the value
/// (negative values reversed, -0 just below +0), from the IEEE layout, not from the codec.
pub fn ulp_drift(dtype: DType, prev: &[u8], p_move: u64, p_special: u64, rng: &mut Rng) -> Vec<u8> {
    let size = dtype.size();
    let w = 8 * size as u32;
    let (top, all) = (1u64 << (w - 1), (1u64 << w) - 1);
    let mut out = drift(dtype, prev, 0, p_special, 1000 - p_special, rng);
    for v in out.chunks_exact_mut(size) {
        if rng.below(1000) >= p_move {
            continue;
        }
        let mut b = [0u8; 8];
        b[..size].copy_from_slice(v);
        let u = u64::from_le_bytes(b);
        let m = if rng.below(10) == 0 {
            rng.below(1 << (w - 2))
        } else {
            1 + rng.below(15)
        };
        let key = if u & top != 0 { !u & all } else { u | top };
        let k = if rng.below(2) == 0 {
            key.wrapping_add(m)
        } else {
            key.wrapping_sub(m)
        } & all;
        let u = if k & top != 0 { k & !top } else { !k & all };
        v.copy_from_slice(&u.to_le_bytes()[..size]);
    }
    out
}

/// The trace's series for the codec tests: every bf16 and fp32 tensor of `dir`'s snapshots in
/// order (name, type, its values per snapshot), each fp32 one followed by its cast to fp16.
pub fn trace_series(dir: &Path) -> Vec<(String, DType, Vec<Vec<u8>>)> {
    let snaps = snapshots(dir);
    let mut out = Vec::new();
    for t in &snaps[0].tensors {
        if t.dtype != DType::BF16 && t.dtype != DType::F32 {
            continue;
        }
        let iters: Vec<Vec<u8>> = snaps
            .iter()
            .map(|s| s.bytes(s.get(&t.name).unwrap()).to_vec())
            .collect();
        let half = (t.dtype == DType::F32).then(|| {
            iters
                .iter()
                .map(|v| {
                    v.chunks_exact(4)
                        .flat_map(|c| {
                            f32_to_f16(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes()
                        })
                        .collect()
                })
                .collect()
        });
        out.push((t.name.clone(), t.dtype, iters));
        if let Some(h) = half {
            out.push((t.name.clone(), DType::F16, h));
        }
    }
    assert!(!out.is_empty(), "no bf16/fp32 tensors in {}", dir.display());
    out
}

/// The chunk sizes the codec tests code a trace series in: whole tensors (so 32 lanes in a
/// Delta frame) and 5000-element chunks (9 lanes); the fp16 casts in chunks only.
pub fn trace_chunks(dtype: DType) -> &'static [usize] {
    if dtype == DType::F16 {
        &[5000]
    } else {
        &[usize::MAX, 5000]
    }
}

/// Synthetic data for Delta frames: `n` random values of `dtype` (generator seeded with
/// `seed`), then five steps of `ulp_drift`, from a tenth to nearly all of the values moving,
/// with special values among them.
pub fn ulp_series(dtype: DType, n: usize, seed: u64) -> Vec<Vec<u8>> {
    let mut rng = Rng(seed);
    let mut v = rng.bytes(n * dtype.size());
    let mut iters = vec![v.clone()];
    for (p_move, p_special) in [(500, 0), (900, 5), (100, 0), (999, 50), (300, 1)] {
        v = ulp_drift(dtype, &v, p_move, p_special, &mut rng);
        iters.push(v.clone());
    }
    iters
}

/// Values of `dtype` through regimes where each frame of a delta cache is the smallest: `n`
/// random values (seeded with `seed`), ulp moves (Delta), every mantissa new with signs and
/// exponents kept (Exp), 2% of the values new (Hybrid), ulp moves with special values, and
/// nothing moving.
pub fn regime_series(dtype: DType, n: usize, seed: u64) -> Vec<Vec<u8>> {
    let size = dtype.size();
    let mut rng = Rng(seed);
    let mantissa: u64 = match dtype {
        DType::BF16 => 0x7f,
        DType::F16 => 0x3ff,
        _ => 0x7f_ffff,
    };
    let v0 = rng.bytes(n * size);
    let v1 = ulp_drift(dtype, &v0, 500, 0, &mut rng);
    let mut v2 = v1.clone();
    for v in v2.chunks_exact_mut(size) {
        let mut b = [0u8; 8];
        b[..size].copy_from_slice(v);
        let u = u64::from_le_bytes(b) & !mantissa | rng.next() & mantissa;
        v.copy_from_slice(&u.to_le_bytes()[..size]);
    }
    let mut v3 = v2.clone();
    for v in v3.chunks_exact_mut(size) {
        if rng.below(1000) < 20 {
            v.copy_from_slice(&rng.bytes(size));
        }
    }
    let v4 = ulp_drift(dtype, &v3, 900, 5, &mut rng);
    let v5 = v4.clone();
    vec![v0, v1, v2, v3, v4, v5]
}

/// `input` through `slot` (the CPU codec), chunk by chunk (`chunk` elements): a frame per chunk
/// and its `FrameInfo`, committed.
pub fn encode_chunks(
    slot: &mut CacheSlot,
    input: &[u8],
    chunk: usize,
) -> (Vec<Vec<u8>>, Vec<FrameInfo>) {
    let size = slot.dtype().size();
    let mut frames = Vec::new();
    let mut infos = Vec::new();
    for c in slot.chunks(chunk).iter_mut() {
        let (off, len) = (c.offset(), c.len());
        let mut f = Vec::new();
        infos.push(
            c.encode(&input[off * size..(off + len) * size], &mut f)
                .unwrap(),
        );
        frames.push(f);
    }
    slot.commit(&infos).unwrap();
    (frames, infos)
}

/// `frames` (one per chunk of `chunk` elements, in order) decoded by `slot` (the CPU codec),
/// committed: the values.
pub fn decode_chunks(slot: &mut CacheSlot, frames: &[Vec<u8>], chunk: usize) -> Vec<u8> {
    let size = slot.dtype().size();
    let mut out = vec![0u8; slot.len() * size];
    let mut infos = Vec::new();
    for (k, c) in slot.chunks(chunk).iter_mut().enumerate() {
        let (off, len) = (c.offset(), c.len());
        let f = ciera::codec::frame::parse(&frames[k]).unwrap();
        infos.push(
            c.decode(&f, &mut out[off * size..(off + len) * size])
                .unwrap(),
        );
    }
    slot.commit(&infos).unwrap();
    out
}
