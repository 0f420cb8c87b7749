//! The CUDA codec kernels' logic (cuda/codec.cu), run on the CPU by its host build (the
//! `ciera-cuda-host` crate: g++ compiles the same block bodies NVRTC compiles for the device), must
//! write the Rust codec's frames byte for byte: every consecutive snapshot pair of the real
//! trace (../shared/traces when present, else the bundled slice), every tensor, bf16, fp16
//! (cast from the fp32 masters) and fp32; special values (NaN payloads, infinities, -0,
//! subnormals); every mask coding; odd lengths and chunk edges (proptest). Against delta
//! caches it must write the CPU's frames for every frame choice (forced Delta, and Auto's pick
//! of Exp, Hybrid or Delta) and read Delta frames as the CPU does (values, cached values,
//! contexts), and refuse the damaged ones the CPU refuses. What the host build cannot show
//! (blocks running concurrently on a device) is bench/gpu_check.sh's part.

#[path = "common/delta_spec.rs"]
mod delta_spec;
#[path = "common/skip.rs"]
mod skip;
#[path = "common/trace_data.rs"]
mod trace_data;

use std::collections::BTreeMap;

use ciera::codec::{CacheMode, CacheSlot, FrameChoice, HEADER_LEN};
use ciera::DType;
use ciera_cuda_host::{DecChunk, EncChunk};
use proptest::prelude::*;
use trace_data::Rng;
use trace_data::*;

/// Mask codings seen in the frames compared (s1's first byte of Exp frames), and FILLs.
#[derive(Default, Debug)]
struct Seen {
    frames: usize,
    fills: usize,
    hybrid: usize,
    coding: BTreeMap<u8, usize>,
}

/// Encode `iters` (one tensor's values per iteration) through a CPU exponent-cache slot and
/// through the kernels' host build, chunk by chunk, and require identical frames. The CPU
/// decoder also decodes every frame back to the input (the frames are the same bytes).
fn same_frames(dtype: DType, iters: &[Vec<u8>], chunk: usize, ctx: &str, seen: &mut Seen) {
    for (mode, choice) in [
        (CacheMode::Exponent, FrameChoice::Auto),
        (CacheMode::FullValue, FrameChoice::Auto),
        (CacheMode::FullValue, FrameChoice::Hybrid),
    ] {
        same_frames_in(dtype, mode, choice, iters, chunk, ctx, seen);
    }
}

/// `same_frames` for one cache mode and frame choice.
fn same_frames_in(
    dtype: DType,
    mode: CacheMode,
    choice: FrameChoice,
    iters: &[Vec<u8>],
    chunk: usize,
    ctx: &str,
    seen: &mut Seen,
) {
    let size = dtype.size();
    let n = iters[0].len() / size;
    let chunk = chunk.min(n);
    let full = mode == CacheMode::FullValue;
    let per = if full { size } else { 1 };
    let choice_code = match choice {
        FrameChoice::Exp => 1,
        FrameChoice::Hybrid => 2,
        _ => 0,
    };
    let mut tx = CacheSlot::new(dtype, mode, n);
    let mut rx = CacheSlot::new(dtype, mode, n);
    tx.set_frame_choice(choice);
    rx.set_frame_choice(choice);
    let mut cache = vec![0u8; n * per];
    let mut dcache = vec![0u8; n * per];
    for (it, input) in iters.iter().enumerate() {
        assert_eq!(input.len(), n * size);
        let (version, cold) = (tx.version(), !tx.is_warm());
        let (cpu, _) = encode_chunks(&mut tx, input, chunk);
        let mut jobs: Vec<EncChunk<'_>> = cache
            .chunks_mut(chunk * per)
            .enumerate()
            .map(|(i, c)| {
                let off = i * chunk;
                EncChunk {
                    input: &input[off * size..(off + c.len() / per) * size],
                    cache: c,
                    offset: off as u64,
                    version,
                    cold,
                    full,
                    choice: choice_code,
                    ctx: None,
                }
            })
            .collect();
        let emu = ciera_cuda_host::encode(dtype.code() as u32, &mut jobs);
        assert_eq!(emu.len(), cpu.len(), "{ctx}: frame count");
        for (k, (g, c)) in emu.iter().zip(&cpu).enumerate() {
            if g != c {
                let at = g
                    .iter()
                    .zip(c)
                    .position(|(a, b)| a != b)
                    .unwrap_or(g.len().min(c.len()));
                let layout = |f: &[u8]| -> String {
                    if f.len() < HEADER_LEN {
                        return "short".into();
                    }
                    let sec: Vec<usize> = (0..4)
                        .map(|q| {
                            u32::from_le_bytes(f[32 + 4 * q..36 + 4 * q].try_into().unwrap())
                                as usize
                        })
                        .collect();
                    let c1 = f.get(HEADER_LEN + sec[0]).copied();
                    let c2 = f.get(HEADER_LEN + sec[0] + sec[1]).copied();
                    format!("mode {} sections {sec:?} codings {c1:?}/{c2:?}", f[6])
                };
                panic!(
                    "{ctx} {dtype} {mode:?} {choice:?} iteration {it} chunk {k}: kernel frame differs \
                     from the CPU's at byte {at} (kernels: {}; CPU: {})",
                    layout(g),
                    layout(c)
                );
            }
            seen.frames += 1;
            if c[7] & 1 == 1 {
                seen.fills += 1;
            } else if c[6] == 2 {
                seen.hybrid += 1;
            } else {
                let s0 = u32::from_le_bytes(c[32..36].try_into().unwrap()) as usize;
                *seen.coding.entry(c[HEADER_LEN + s0]).or_default() += 1;
            }
        }
        // The kernels decode the CPU's frames: the input back, and the encoder's cache.
        let mut got = vec![0u8; input.len()];
        let warm = rx.is_warm();
        let mut djobs: Vec<DecChunk<'_>> = dcache
            .chunks_mut(chunk * per)
            .zip(got.chunks_mut(chunk * size))
            .zip(&cpu)
            .enumerate()
            .map(|(i, ((c, o), f))| DecChunk {
                frame: f,
                out: o,
                cache: c,
                offset: (i * chunk) as u64,
                version: rx.version(),
                warm,
                full,
                ctx: None,
            })
            .collect();
        for (k, r) in ciera_cuda_host::decode(dtype.code() as u32, &mut djobs)
            .iter()
            .enumerate()
        {
            assert_eq!(
                *r,
                Ok(()),
                "{ctx} {dtype} iteration {it} chunk {k}: kernels refused the CPU's frame"
            );
        }
        assert!(
            got == *input,
            "{ctx} {dtype} iteration {it}: kernel decode differs"
        );
        assert!(
            dcache == cache,
            "{ctx} {dtype} iteration {it}: decoder and encoder caches differ"
        );
        let out = decode_chunks(&mut rx, &emu, chunk);
        assert!(
            out == *input,
            "{ctx} {dtype} iteration {it}: decode differs"
        );
    }
}

/// Every tensor of the trace, its snapshots in order (so every consecutive pair is coded),
/// as stored (bf16, fp32) and fp32 cast to fp16; one frame per tensor and 5000-element chunks.
#[test]
fn kernel_frames_match_the_cpu_on_the_trace() {
    let dir = trace_dir();
    let mut seen = Seen::default();
    let series = trace_series(&dir);
    for (name, dtype, iters) in &series {
        for &chunk in trace_chunks(*dtype) {
            same_frames(*dtype, iters, chunk, name, &mut seen);
        }
    }
    let tensors = series.iter().filter(|s| s.1 != DType::F16).count();
    skip::show(&format!(
        "kernel frames == CPU frames on {} ({} tensors, {} snapshots; exponent and full-value \
         caches): {} frames, {} FILL, {} Hybrid, Exp mask codings {:?}\n",
        dir.display(),
        tensors,
        series.first().map_or(0, |s| s.2.len()),
        seen.frames,
        seen.fills,
        seen.hybrid,
        seen.coding
    ));
    assert!(seen.frames > seen.fills, "no Exp frame compared");
}

/// Synthetic drift at exception rates from none to most, with special values: every mask
/// coding the encoders write (Zero, Flat, Hier and segmented rANS) is produced by the CPU and
/// matched by the kernels.
#[test]
fn kernel_frames_match_at_every_density_and_special_values() {
    let mut seen = Seen::default();
    for (di, dtype) in [DType::BF16, DType::F16, DType::F32]
        .into_iter()
        .enumerate()
    {
        for (n, chunk) in [
            (1usize, 1usize),
            (63, 64),
            (4097, 4096),
            (70_001, 9000),
            (200_000, 200_000),
        ] {
            let mut rng = Rng(1 + di as u64 * 1000 + n as u64);
            let mut v: Vec<u8> = (0..n * dtype.size()).map(|_| rng.next() as u8).collect();
            let mut iters = vec![v.clone()];
            for (p_exp, p_special, keep) in [
                (0, 0, 0),
                (20, 0, 900),
                (5, 2, 0),
                (150, 0, 500),
                (500, 10, 0),
                (0, 0, 999),
                (1, 1, 700),
            ] {
                v = drift(dtype, &v, p_exp, p_special, keep, &mut rng);
                iters.push(v.clone());
            }
            same_frames(
                dtype,
                &iters,
                chunk,
                &format!("synthetic n={n} chunk={chunk}"),
                &mut seen,
            );
        }
    }
    skip::show(&format!(
        "kernel frames == CPU frames on synthetic drift: {} frames, {} FILL, {} Hybrid, Exp mask codings {:?}\n",
        seen.frames, seen.fills, seen.hybrid, seen.coding
    ));
    for coding in [0u8, 1, 2, 4] {
        assert!(
            seen.coding.contains_key(&coding),
            "mask coding {coding} never compared: {seen:?}"
        );
    }
    assert!(seen.hybrid > 0, "no Hybrid frame compared: {seen:?}");
}

/// The kernels' checksum pieces against the Rust codec's: XXH3 over a header and a tail at
/// every length class (17..240 bytes and the 8-lane long path), SH64 from word partial sums,
/// and the integer log2 both use for size estimates.
#[test]
fn kernel_hashes_and_log2_match() {
    let mut rng = Rng(7);
    let data: Vec<u8> = (0..70_000).map(|_| rng.next() as u8).collect();
    let head: [u8; 56] = data[..56].try_into().unwrap();
    for tail in (0..300).chain([1000, 1023, 1024, 1025, 4096, 65_000]) {
        let want = xxhash_rust::xxh3::xxh3_64(&data[..56 + tail]);
        assert_eq!(
            ciera_cuda_host::xxh3(&head, &data[56..56 + tail]),
            want,
            "tail {tail}"
        );
    }
    for len in (0..200).chain([4096, 5631, 69_999]) {
        assert_eq!(
            ciera_cuda_host::sh64(&data[..len]),
            ciera::codec::checksum::sh64(&data[..len]),
            "len {len}"
        );
    }
    for x in (1..5000u64)
        .chain((0..64).map(|s| 1u64 << s))
        .chain((0..64).map(|s| u64::MAX >> s))
    {
        assert_eq!(
            ciera_cuda_host::log2_q16(x),
            ciera::codec::rans::log2_q16(x),
            "x {x}"
        );
    }
    assert_eq!(ciera::codec::rans::log2_q16(1), 0);
    assert_eq!(ciera::codec::rans::log2_q16(4096), 12 << 16);
    assert_eq!(
        ciera::codec::rans::log2_q16(3) >> 8,
        (3f64.log2() * 256.0) as u64
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Random lengths, chunk sizes, densities and types: identical frames.
    #[test]
    fn kernel_frames_match_on_random_shapes(
        n in 1usize..20_000,
        chunk in 1usize..9_000,
        dt in 0usize..3,
        seed in any::<u64>(),
        rates in proptest::collection::vec((0u64..600, 0u64..30, 0u64..1000), 1..4),
    ) {
        let dtype = [DType::BF16, DType::F16, DType::F32][dt];
        let mut rng = Rng(seed);
        let mut v: Vec<u8> = (0..n * dtype.size()).map(|_| rng.next() as u8).collect();
        let mut iters = vec![v.clone()];
        for (p_exp, p_special, keep) in rates {
            v = drift(dtype, &v, p_exp, p_special, keep, &mut rng);
            iters.push(v.clone());
        }
        same_frames(dtype, &iters, chunk, &format!("random n={n} chunk={chunk}"), &mut Seen::default());
    }
}

/// Recompute a frame's two checksums, so that damage past them reaches the decoders' section
/// checks.
fn reseal(f: &mut [u8]) {
    let s0 = u32::from_le_bytes(f[32..36].try_into().unwrap()) as usize;
    if HEADER_LEN + s0 <= f.len() {
        let h = ciera::codec::checksum::sh64(&f[HEADER_LEN..HEADER_LEN + s0]);
        f[48..56].copy_from_slice(&h.to_le_bytes());
        let mut x = f[..56].to_vec();
        x.extend_from_slice(&f[HEADER_LEN + s0..]);
        let h = xxhash_rust::xxh3::xxh3_64(&x);
        f[56..64].copy_from_slice(&h.to_le_bytes());
    }
}

/// Damaged frames (Exp frames of both caches, Hybrid frames): bytes flipped (checksums left
/// stale, or recomputed so the damage reaches the section checks), truncated or extended. The
/// kernels and the CPU decoder agree on every one: both refuse, or both accept and write the
/// same values.
#[test]
fn kernel_decoder_refuses_what_the_cpu_refuses() {
    let (mut cases, mut refused, mut accepted) = (0, 0, 0);
    let mut modes = BTreeMap::new();
    for (mi, (mode, choice)) in [
        (CacheMode::Exponent, FrameChoice::Auto),
        (CacheMode::FullValue, FrameChoice::Exp),
        (CacheMode::FullValue, FrameChoice::Hybrid),
    ]
    .into_iter()
    .enumerate()
    {
        let full = mode == CacheMode::FullValue;
        for (di, dtype) in [DType::BF16, DType::F16, DType::F32]
            .into_iter()
            .enumerate()
        {
            for (n, p_exp) in [
                (1usize, 500u64),
                (100, 30),
                (5000, 20),
                (5000, 300),
                (3000, 900),
                // Masks of several rANS segments (coding 4).
                (70_001, 20),
            ] {
                let size = dtype.size();
                let mut rng = Rng(77 + di as u64 * 31 + n as u64 + p_exp + mi as u64 * 1000);
                let v0: Vec<u8> = (0..n * size).map(|_| rng.next() as u8).collect();
                let v1 = drift(dtype, &v0, p_exp, 5, if full { 700 } else { 0 }, &mut rng);
                let per = if full { size } else { 1 };
                let mut tx = CacheSlot::new(dtype, mode, n);
                tx.set_frame_choice(choice);
                let (mut f0, mut f1) = (Vec::new(), Vec::new());
                let i0 = tx.encode(&v0, &mut f0).unwrap();
                let _ = i0;
                tx.encode(&v1, &mut f1).unwrap();
                *modes.entry(f1[6]).or_insert(0usize) += 1;
                let mut damaged: Vec<Vec<u8>> = Vec::new();
                for _ in 0..300 {
                    let mut f = f1.clone();
                    let at = rng.below(f.len() as u64) as usize;
                    f[at] ^= 1 << rng.below(8);
                    if rng.below(3) > 0 {
                        reseal(&mut f);
                    }
                    damaged.push(f);
                }
                for cut in [1, 7, 64] {
                    if f1.len() > cut {
                        damaged.push(f1[..f1.len() - cut].to_vec());
                    }
                }
                let mut longer = f1.clone();
                longer.push(0);
                damaged.push(longer);
                for f in &damaged {
                    // CPU: a receiver that took the FILL, then this frame.
                    let mut rx = CacheSlot::new(dtype, mode, n);
                    let mut out0 = vec![0u8; n * size];
                    rx.decode(&f0, &mut out0).unwrap();
                    let version = rx.version();
                    let mut cpu_out = vec![0u8; n * size];
                    let cpu = rx.decode(f, &mut cpu_out);
                    // Kernels: the same.
                    let mut cache = vec![0u8; n * per];
                    let mut out = vec![0u8; n * size];
                    let r0 = ciera_cuda_host::decode(
                        dtype.code() as u32,
                        &mut [DecChunk {
                            frame: &f0,
                            out: &mut out,
                            cache: &mut cache,
                            offset: 0,
                            version: 0,
                            warm: false,
                            full,
                            ctx: None,
                        }],
                    );
                    assert_eq!(r0[0], Ok(()));
                    let mut out = vec![0u8; n * size];
                    let r = ciera_cuda_host::decode(
                        dtype.code() as u32,
                        &mut [DecChunk {
                            frame: f,
                            out: &mut out,
                            cache: &mut cache,
                            offset: 0,
                            version,
                            warm: true,
                            full,
                            ctx: None,
                        }],
                    );
                    cases += 1;
                    match (&cpu, &r[0]) {
                        (Ok(_), Ok(())) => {
                            accepted += 1;
                            assert!(out == cpu_out, "{dtype} n={n}: both accept, values differ");
                        }
                        (Err(_), Err(_)) => refused += 1,
                        (c, k) => panic!("{dtype} {mode:?} n={n}: CPU {c:?}, kernels {k:?}"),
                    }
                }
            }
        }
    }
    skip::show(&format!(
        "damaged frames: {cases} (from frames of modes {modes:?}), refused by both {refused}, \
         accepted by both {accepted} (same values)\n"
    ));
    assert!(modes.contains_key(&2), "no Hybrid frame damaged: {modes:?}");
    // Resealed flips inside s0 are valid frames of other values (both decoders accept them).
    assert!(
        refused > cases / 4,
        "too few refusals: {refused} of {cases}"
    );
}

/// `f` (format version 3) with its segmented rANS masks (coding 4) re-coded in the two-state
/// block (coding 3, which `bitmask::encode` still writes when asked) and its version byte set to `version`, resealed: the frame
/// an encoder of format version 1 or 2 wrote for the same values. None without a coding 4 mask.
fn with_coding_3(f: &[u8], n: usize, version: u8) -> Option<Vec<u8>> {
    use ciera::codec::bitmask::{self, MaskCoding};
    let mut at = HEADER_LEN;
    let mut secs: Vec<Vec<u8>> = Vec::new();
    for q in 0..4 {
        let len = u32::from_le_bytes(f[32 + 4 * q..36 + 4 * q].try_into().unwrap()) as usize;
        secs.push(f[at..at + len].to_vec());
        at += len;
    }
    let recode = |s: &[u8], m: usize| -> Vec<u8> {
        let (mut words, mut out) = (Vec::new(), Vec::new());
        bitmask::decode(s, m, &mut words).unwrap();
        bitmask::encode(&words, m, MaskCoding::Rans, &mut out);
        out
    };
    // s1: the Exp mask, or Hybrid's changed mask (n bits); s2: Hybrid's exponent mask, over
    // the k changed values.
    let mut words = Vec::new();
    let k = bitmask::decode(&secs[1], n, &mut words).ok()?;
    let mut recoded = false;
    if f[6] == 2 && secs[2].first() == Some(&4) {
        secs[2] = recode(&secs[2], k);
        recoded = true;
    }
    if matches!(f[6], 1 | 2) && secs[1].first() == Some(&4) {
        secs[1] = recode(&secs[1], n);
        recoded = true;
    }
    if !recoded {
        return None;
    }
    let mut g = f.to_vec();
    g[4] = version;
    Some(with_sections(&g, [&secs[0], &secs[1], &secs[2], &secs[3]]))
}

/// Exp and Hybrid frames whose masks take segmented rANS (coding 4) over 1 to 10 segments: the
/// kernels write the CPU's frames. The same frames as format versions 1 and 2 wrote them, their
/// rANS masks two-state blocks (coding 3, no longer written): the kernels decode them as the
/// CPU does (Exp masks with `ciera_dec_rans`, Hybrid ones with `ciera_dec_hyb`), and both refuse
/// them claiming version 1 or 2 with their coding 4 masks left in.
#[test]
fn kernel_codes_rans_masks_of_every_format_version() {
    let (mut exp, mut hybrid) = (0, 0);
    for (di, dtype) in [DType::BF16, DType::F16, DType::F32]
        .into_iter()
        .enumerate()
    {
        let size = dtype.size();
        // Exp frames (exponent cache): one exponent change in every group of 8 values, at a
        // random place, so that rANS beats Hier by the 2% of the frame it must (not with
        // fp32's 3 bytes of sign+mantissa a value); Hybrid frames (full-value cache): a few
        // values changed. n spans 1 to several segments of 4096 mask bytes.
        for (full, n) in [
            (false, 5000usize),
            (false, 70_001),
            (false, 300_000),
            (true, 20_000),
            (true, 150_001),
        ] {
            if !full && dtype == DType::F32 {
                continue;
            }
            let mode = if full {
                CacheMode::FullValue
            } else {
                CacheMode::Exponent
            };
            let mut rng = Rng(31 + di as u64 * 7 + n as u64);
            let v0: Vec<u8> = (0..n * size).map(|_| rng.next() as u8).collect();
            let v1 = if full {
                drift(dtype, &v0, 5, 1, 990, &mut rng)
            } else {
                let mut v = v0.clone();
                // The codec's cached field is the top byte (bf16, fp32) or the 5 bits above
                // fp16's mantissa: flip its lowest bit.
                let bit = match dtype {
                    DType::F16 => 10,
                    _ => 8 * size - 8,
                };
                for g in 0..n / 8 {
                    let i = 8 * g + rng.below(8) as usize;
                    v[i * size + bit / 8] ^= 1 << (bit % 8);
                }
                v
            };
            let mut tx = CacheSlot::new(dtype, mode, n);
            if full {
                tx.set_frame_choice(FrameChoice::Hybrid);
            }
            let per = if full { size } else { 1 };
            let mut cache = vec![0u8; n * per];
            let mut frames = Vec::new();
            for (step, v) in [&v0, &v1].into_iter().enumerate() {
                let (version, mut f) = (tx.version(), Vec::new());
                tx.encode(v, &mut f).unwrap();
                let emu = ciera_cuda_host::encode(
                    dtype.code() as u32,
                    &mut [EncChunk {
                        input: v,
                        cache: &mut cache,
                        offset: 0,
                        version,
                        cold: step == 0,
                        full,
                        choice: if full { 2 } else { 0 },
                        ctx: None,
                    }],
                );
                assert!(
                    emu[0] == f,
                    "{dtype} n={n} step {step}: kernel frame differs"
                );
                frames.push(f);
            }
            let (f0, f1) = (&frames[0], &frames[1]);
            let old: Vec<(Vec<u8>, bool)> = [1u8, 2]
                .into_iter()
                .filter_map(|version| with_coding_3(f1, n, version).map(|g| (g, true)))
                .chain([1u8, 2].into_iter().map(|version| {
                    let mut g = f1.clone();
                    g[4] = version;
                    reseal(&mut g);
                    (g, false)
                }))
                .collect();
            assert!(
                old.iter().any(|(_, ok)| *ok),
                "{dtype} n={n}: no coding 4 mask in the frame (mode {})",
                f1[6]
            );
            for (f, ok) in &old {
                let mut rx = CacheSlot::new(dtype, mode, n);
                let mut out = vec![0u8; n * size];
                rx.decode(f0, &mut out).unwrap();
                let version = rx.version();
                let cpu = rx.decode(f, &mut out);
                let mut cache = vec![0u8; n * per];
                let mut got = vec![0u8; n * size];
                let mut chunk = |frame: &[u8], warm: bool, got: &mut [u8]| {
                    ciera_cuda_host::decode(
                        dtype.code() as u32,
                        &mut [DecChunk {
                            frame,
                            out: got,
                            cache: &mut cache,
                            offset: 0,
                            version,
                            warm,
                            full,
                            ctx: None,
                        }],
                    )[0]
                };
                assert_eq!(chunk(f0, false, &mut got), Ok(()));
                let kernels = chunk(f, true, &mut got);
                let what = format!("{dtype} n={n} version {} mode {}", f[4], f[6]);
                if *ok {
                    assert!(cpu.is_ok(), "{what}: the CPU refused: {cpu:?}");
                    assert_eq!(kernels, Ok(()), "{what}: the kernels refused");
                    assert!(got == v1 && out == v1, "{what}: values differ");
                    if full {
                        hybrid += 1;
                    } else {
                        exp += 1;
                    }
                } else {
                    assert!(cpu.is_err(), "{what}: the CPU took coding 4");
                    assert!(kernels.is_err(), "{what}: the kernels took coding 4");
                }
            }
        }
    }
    skip::show(&format!(
        "segmented rANS masks: kernel frames == CPU frames; as format versions 1 and 2 with \
         two-state rANS masks: {exp} Exp, {hybrid} Hybrid frames decoded alike, and coding 4 \
         under those versions refused by both\n"
    ));
    assert!(exp > 0 && hybrid > 0);
}

/// Frames of a delta slot (`choice`: Delta forced, or Auto: the smallest of Exp, Hybrid and
/// Delta per chunk) for `iters`, chunk by chunk, decoded by the CPU and by the kernels' host
/// build into delta caches: the same values (the input), the same cached values and the same
/// context bytes after every iteration. Counts the frame modes decoded into `seen`.
fn same_delta_decode(
    dtype: DType,
    choice: FrameChoice,
    iters: &[Vec<u8>],
    chunk: usize,
    what: &str,
    seen: &mut BTreeMap<u8, usize>,
) {
    let size = dtype.size();
    let n = iters[0].len() / size;
    let chunk = chunk.min(n);
    let mut tx = CacheSlot::new(dtype, CacheMode::Delta, n);
    let mut rx = CacheSlot::new(dtype, CacheMode::Delta, n);
    tx.set_frame_choice(choice);
    let mut cache = vec![0u8; n * size];
    let mut ctx = vec![0u8; n];
    for (it, input) in iters.iter().enumerate() {
        let (frames, _) = encode_chunks(&mut tx, input, chunk);
        let (version, warm) = (rx.version(), rx.is_warm());
        let mut got = vec![0u8; n * size];
        let mut jobs: Vec<DecChunk<'_>> = cache
            .chunks_mut(chunk * size)
            .zip(ctx.chunks_mut(chunk))
            .zip(got.chunks_mut(chunk * size))
            .zip(&frames)
            .enumerate()
            .map(|(i, (((c, x), o), f))| DecChunk {
                frame: f,
                out: o,
                cache: c,
                offset: (i * chunk) as u64,
                version,
                warm,
                full: true,
                ctx: Some(x),
            })
            .collect();
        for (k, r) in ciera_cuda_host::decode(dtype.code() as u32, &mut jobs)
            .iter()
            .enumerate()
        {
            assert_eq!(
                *r,
                Ok(()),
                "{what} {dtype} iteration {it} chunk {k} (mode {}): kernels refused the CPU's frame",
                frames[k][6]
            );
            *seen.entry(frames[k][6]).or_default() += 1;
        }
        let out = decode_chunks(&mut rx, &frames, chunk);
        assert!(
            out == *input,
            "{what} {dtype} iteration {it}: CPU decode differs"
        );
        assert!(
            got == *input,
            "{what} {dtype} iteration {it}: kernel decode differs"
        );
        assert!(
            rx.values() == Some(&cache[..]),
            "{what} {dtype} iteration {it}: kernel and CPU cached values differ"
        );
        let at = rx
            .contexts()
            .unwrap()
            .iter()
            .zip(&ctx)
            .position(|(a, b)| a != b);
        assert!(
            at.is_none(),
            "{what} {dtype} iteration {it}: kernel and CPU context bytes differ at element {at:?}"
        );
    }
}

/// Delta frames decoded by the kernels (a warp-shaped group per 64 threads, docs/WIRE.md) as
/// the CPU decodes them: every tensor of the trace (bf16, fp32, fp32 cast to fp16; whole and
/// 5000-element chunks, so 32 and 9 lanes), and synthetic ulp drift with special values from 1
/// to 70,001 elements (1 to 32 lanes, up to 3 groups per chunk), with Delta frames forced and
/// with the slot's own choice (Exp and Hybrid frames, which reset the contexts, between them).
#[test]
fn kernel_decodes_delta_frames_like_the_cpu() {
    let dir = trace_dir();
    let mut seen = BTreeMap::new();
    let series = trace_series(&dir);
    for (name, dtype, iters) in &series {
        // fp16 (the fp32 tensors cast): the slot's own choice, in chunks.
        let (chunks, choices): (&[usize], &[FrameChoice]) = if *dtype == DType::F16 {
            (&[5000], &[FrameChoice::Auto])
        } else {
            (
                &[usize::MAX, 5000],
                &[FrameChoice::Delta, FrameChoice::Auto],
            )
        };
        for &chunk in chunks {
            for &choice in choices {
                same_delta_decode(*dtype, choice, iters, chunk, name, &mut seen);
            }
        }
    }
    let tensors = series.iter().filter(|s| s.1 != DType::F16).count();
    let trace = seen.clone();
    for (di, dtype) in [DType::BF16, DType::F16, DType::F32]
        .into_iter()
        .enumerate()
    {
        for (n, chunk) in DELTA_SHAPES {
            let iters = ulp_series(dtype, n, 5 + di as u64 * 1000 + n as u64);
            for choice in [FrameChoice::Delta, FrameChoice::Auto] {
                same_delta_decode(
                    dtype,
                    choice,
                    &iters,
                    chunk,
                    &format!("synthetic n={n} chunk={chunk}"),
                    &mut seen,
                );
            }
        }
    }
    skip::show(&format!(
        "kernel Delta decode == CPU on {} ({} tensors) and synthetic ulp drift: frames by mode \
         {:?} (trace alone {:?}), values, cached values and contexts alike\n",
        dir.display(),
        tensors,
        seen,
        trace
    ));
    assert!(
        trace.get(&3).copied().unwrap_or(0) > 0,
        "no trace Delta frame: {trace:?}"
    );
    assert!(
        seen.get(&3).copied().unwrap_or(0) > 0 && seen.contains_key(&1),
        "{seen:?}"
    );
}

/// Synthetic Delta shapes (elements, chunk): 1 to 32 lanes, up to three groups per chunk.
const DELTA_SHAPES: [(usize, usize); 5] = [
    (1, 1),
    (63, 64),
    (600, 600),
    (40_000, 17_000),
    (70_001, 70_001),
];

/// `iters` through a CPU delta slot with frame choice `choice` (the kernels' `EncChunk::choice`
/// for it: Delta forced, Auto, or an Exp/Hybrid one) and through the kernels' host build with a
/// delta cache, chunk by chunk: the same frames byte for byte (with Delta forced: FILLs of a
/// cold slot and where a Delta frame would be longer, Delta frames otherwise) and the same
/// cached values and contexts after every iteration. Counts frame modes into `seen`.
fn same_delta_cache_frames(
    dtype: DType,
    choice: FrameChoice,
    iters: &[Vec<u8>],
    chunk: usize,
    what: &str,
    seen: &mut BTreeMap<u8, usize>,
) {
    let size = dtype.size();
    let n = iters[0].len() / size;
    let chunk = chunk.min(n);
    let mut tx = CacheSlot::new(dtype, CacheMode::Delta, n);
    tx.set_frame_choice(choice);
    let kernel_choice = match choice {
        FrameChoice::NoDelta => 0,
        FrameChoice::Exp => 1,
        FrameChoice::Hybrid => 2,
        FrameChoice::Delta => 3,
        FrameChoice::Auto => 4,
    };
    let (mut cache, mut ctx) = (vec![0u8; n * size], vec![0u8; n]);
    for (it, input) in iters.iter().enumerate() {
        let (version, cold) = (tx.version(), !tx.is_warm());
        let (cpu, _) = encode_chunks(&mut tx, input, chunk);
        let mut jobs: Vec<EncChunk<'_>> = cache
            .chunks_mut(chunk * size)
            .zip(ctx.chunks_mut(chunk))
            .enumerate()
            .map(|(i, (c, x))| {
                let off = i * chunk;
                EncChunk {
                    input: &input[off * size..(off + x.len()) * size],
                    cache: c,
                    offset: off as u64,
                    version,
                    cold,
                    full: true,
                    choice: kernel_choice,
                    ctx: Some(x),
                }
            })
            .collect();
        let emu = ciera_cuda_host::encode(dtype.code() as u32, &mut jobs);
        for (k, (g, c)) in emu.iter().zip(&cpu).enumerate() {
            let at = g.iter().zip(c).position(|(a, b)| a != b);
            assert!(
                g.len() == c.len() && at.is_none(),
                "{what} {dtype} {choice:?} iteration {it} chunk {k}: kernel frame ({} bytes, mode \
                 {}) differs from the CPU's ({} bytes, mode {}) at byte {at:?}",
                g.len(),
                g.get(6).copied().unwrap_or(0),
                c.len(),
                c[6]
            );
            *seen.entry(c[6]).or_default() += 1;
        }
        assert!(
            tx.values() == Some(&cache[..]),
            "{what} {dtype} {choice:?} iteration {it}: kernel and CPU cached values differ"
        );
        assert!(
            tx.contexts() == Some(&ctx[..]),
            "{what} {dtype} {choice:?} iteration {it}: kernel and CPU contexts differ"
        );
    }
}

/// The kernels encode Delta frames as the CPU does, byte for byte: every trace tensor (bf16,
/// fp32, fp16 cast; whole and 5000-element chunks: 32 and 9 lanes) and synthetic ulp drift
/// with special values (1 to 70,001 elements: FILLs where a Delta frame is longer, 1 to 32
/// lanes, up to three groups per chunk).
#[test]
fn kernel_encodes_delta_frames_like_the_cpu() {
    let dir = trace_dir();
    let mut seen = BTreeMap::new();
    for (name, dtype, iters) in &trace_series(&dir) {
        for &chunk in trace_chunks(*dtype) {
            same_delta_cache_frames(*dtype, FrameChoice::Delta, iters, chunk, name, &mut seen);
        }
    }
    let trace = seen.clone();
    for (di, dtype) in [DType::BF16, DType::F16, DType::F32]
        .into_iter()
        .enumerate()
    {
        for (n, chunk) in DELTA_SHAPES {
            let iters = ulp_series(dtype, n, 8 + di as u64 * 1000 + n as u64);
            same_delta_cache_frames(
                dtype,
                FrameChoice::Delta,
                &iters,
                chunk,
                &format!("synthetic n={n} chunk={chunk}"),
                &mut seen,
            );
        }
    }
    skip::show(&format!(
        "kernel Delta frames == CPU frames on {} and synthetic ulp drift: frames by mode {seen:?} \
         (trace alone {trace:?}); cached values and contexts alike\n",
        dir.display()
    ));
    assert!(
        trace.get(&3).copied().unwrap_or(0) > 0,
        "no trace Delta frame: {trace:?}"
    );
    assert!(seen.get(&0).copied().unwrap_or(0) > 0, "no FILL: {seen:?}");
}

/// The kernels choose a delta cache's frame as the CPU does and code it byte for byte, for
/// every frame choice: `Auto` (the smallest of Exp, Hybrid and Delta, estimated from pass one's
/// counts, a sampled chunk's scaled) on every trace tensor and on synthetic regimes where each
/// frame wins (600 to 140,000 elements, sampled chunks among them); `NoDelta`, `Exp` and
/// `Hybrid` (contexts reset) on the regimes. Cached values and contexts alike after every
/// iteration; under `Auto` every frame kind is seen.
#[test]
fn kernel_picks_delta_cache_frames_like_the_cpu() {
    let dir = trace_dir();
    let (mut auto, mut others) = (BTreeMap::new(), BTreeMap::new());
    for (name, dtype, iters) in &trace_series(&dir) {
        for &chunk in trace_chunks(*dtype) {
            same_delta_cache_frames(*dtype, FrameChoice::Auto, iters, chunk, name, &mut auto);
        }
    }
    let trace = auto.clone();
    for (di, dtype) in [DType::BF16, DType::F16, DType::F32]
        .into_iter()
        .enumerate()
    {
        for (n, chunk) in [(600, 600), (40_000, 17_000), (140_000, 140_000)] {
            let iters = regime_series(dtype, n, 77 + di as u64 * 1000 + n as u64);
            let what = format!("regimes n={n} chunk={chunk}");
            for choice in [
                FrameChoice::Auto,
                FrameChoice::NoDelta,
                FrameChoice::Exp,
                FrameChoice::Hybrid,
            ] {
                let seen = if choice == FrameChoice::Auto {
                    &mut auto
                } else {
                    &mut others
                };
                same_delta_cache_frames(dtype, choice, &iters, chunk, &what, seen);
            }
        }
    }
    skip::show(&format!(
        "kernel frames == CPU frames of delta caches, every frame choice: Auto's frames by mode \
         {auto:?} (trace alone {trace:?}), NoDelta/Exp/Hybrid's {others:?}; cached values and \
         contexts alike\n"
    ));
    for (mode, name) in [(0u8, "FILL"), (1, "Exp"), (2, "Hybrid"), (3, "Delta")] {
        assert!(
            auto.get(&mode).copied().unwrap_or(0) > 0,
            "Auto never sent a {name} frame: {auto:?}"
        );
    }
    assert!(
        trace.get(&3).copied().unwrap_or(0) > 0,
        "no trace Delta frame under Auto: {trace:?}"
    );
}

/// `f` with these sections (lengths in the header) and both checksums recomputed.
fn with_sections(f: &[u8], secs: [&[u8]; 4]) -> Vec<u8> {
    let mut g = f[..HEADER_LEN].to_vec();
    for (q, sec) in secs.iter().enumerate() {
        g[32 + 4 * q..36 + 4 * q].copy_from_slice(&(sec.len() as u32).to_le_bytes());
    }
    for sec in secs {
        g.extend_from_slice(sec);
    }
    reseal(&mut g);
    g
}

/// Delta frames of every geometry the format allows, not only the encoder's (lanes =
/// clamp(n/512, 1, 32), groups of 32768): 1 to 64 lanes, groups of 1 to all elements (so up
/// to thousands of groups, whose starts the kernels find from every 64th), written by the
/// document's own encoder (tests/common/delta_spec.rs) for two consecutive steps of ulp drift
/// (the second against the contexts the first leaves). The CPU decoder and the kernels both
/// take each one, with the same values, cached values and contexts.
#[test]
fn kernel_decodes_delta_frames_of_any_geometry() {
    let mut cases = 0;
    for (di, dtype) in [DType::BF16, DType::F16, DType::F32]
        .into_iter()
        .enumerate()
    {
        let (size, w) = (dtype.size(), 8 * dtype.size() as u32);
        let n = 3000usize;
        let iters = ulp_series(dtype, n, 31 + di as u64);
        let (v0, v1, v2) = (&iters[0], &iters[1], &iters[2]);
        // A frame to take the header from (its sections are replaced).
        let mut tx = CacheSlot::new(dtype, CacheMode::Delta, n);
        tx.set_frame_choice(FrameChoice::Delta);
        let (mut f0, mut f1, mut f2) = (Vec::new(), Vec::new(), Vec::new());
        tx.encode(v0, &mut f0).unwrap();
        tx.encode(v1, &mut f1).unwrap();
        tx.encode(v2, &mut f2).unwrap();
        assert!(f1[6] == 3 && f2[6] == 3, "{dtype}: not Delta frames");
        let val = |v: &[u8], i: usize| {
            let mut b = [0u8; 4];
            b[..size].copy_from_slice(&v[i * size..(i + 1) * size]);
            u32::from_le_bytes(b)
        };
        let moves = |a: &[u8], b: &[u8]| -> Vec<u32> {
            (0..n)
                .map(|i| delta_spec::ulp_move(val(a, i), val(b, i), w))
                .collect()
        };
        let (d1, d2) = (moves(v0, v1), moves(v1, v2));
        let z1: Vec<u32> = d1.iter().map(|&d| delta_spec::zigzag(d, w)).collect();
        let z2: Vec<u32> = d2.iter().map(|&d| delta_spec::zigzag(d, w)).collect();
        let c1 = vec![delta_spec::CONTEXT_NONE; n];
        let c2: Vec<u8> = d1.iter().map(|&d| delta_spec::context(d, w)).collect();
        for (lanes, group) in [
            (1usize, 1usize),
            (64, 1),
            (33, 97),
            (64, 1000),
            (7, 3000),
            (63, 64),
        ] {
            let spec_frame = |z: &[u32], ctx: &[u8], like: &[u8]| {
                let mut m = delta_spec::encoder_model(w, z, ctx, lanes, group);
                let (s0, lens) = delta_spec::encode_groups(&m, w, z, ctx).unwrap();
                m.lens = lens;
                with_sections(like, [&s0, &delta_spec::write_s1(&m), &[], &[]])
            };
            let (g1, g2) = (spec_frame(&z1, &c1, &f1), spec_frame(&z2, &c2, &f2));
            let what = format!("{dtype} lanes {lanes} group {group}");
            // CPU.
            let mut rx = CacheSlot::new(dtype, CacheMode::Delta, n);
            let mut out = vec![0u8; n * size];
            for (f, v) in [(&f0, v0), (&g1, v1), (&g2, v2)] {
                rx.decode(f, &mut out)
                    .unwrap_or_else(|e| panic!("{what}: the CPU refused: {e}"));
                assert!(out == *v, "{what}: the CPU decoded other values");
            }
            // Kernels.
            let (mut cache, mut ctx) = (vec![0u8; n * size], vec![0u8; n]);
            for (k, (f, v)) in [(&f0, v0), (&g1, v1), (&g2, v2)].into_iter().enumerate() {
                let version = u64::from_le_bytes(f[24..32].try_into().unwrap());
                let mut got = vec![0u8; n * size];
                let r = ciera_cuda_host::decode(
                    dtype.code() as u32,
                    &mut [DecChunk {
                        frame: f,
                        out: &mut got,
                        cache: &mut cache,
                        offset: 0,
                        version,
                        warm: k > 0,
                        full: true,
                        ctx: Some(&mut ctx),
                    }],
                );
                assert_eq!(r[0], Ok(()), "{what}: frame {k}: the kernels refused");
                assert!(
                    got == *v,
                    "{what}: frame {k}: the kernels decoded other values"
                );
            }
            assert!(
                rx.values() == Some(&cache[..]),
                "{what}: cached values differ"
            );
            assert!(rx.contexts() == Some(&ctx[..]), "{what}: contexts differ");
            cases += 1;
        }
    }
    skip::show(&format!(
        "Delta frames of {cases} geometries (1-64 lanes, groups of 1 to 3000 elements; two steps \
         each) decoded alike by the CPU and the kernels\n"
    ));
}

/// Damaged Delta frames (bytes flipped with stale or recomputed checksums, so that damage
/// reaches the tables, the group lengths, the lane states and the streams; truncated;
/// extended): the kernels and the CPU decoder both refuse, or both accept and write the same
/// values, cached values and contexts.
#[test]
fn kernel_delta_decoder_refuses_what_the_cpu_refuses() {
    let (mut cases, mut refused, mut accepted) = (0, 0, 0);
    for (di, dtype) in [DType::BF16, DType::F16, DType::F32]
        .into_iter()
        .enumerate()
    {
        for n in [100usize, 5000, 40_000] {
            let size = dtype.size();
            let mut rng = Rng(99 + di as u64 * 31 + n as u64);
            let v0 = rng.bytes(n * size);
            let v1 = ulp_drift(dtype, &v0, 600, 5, &mut rng);
            let mut tx = CacheSlot::new(dtype, CacheMode::Delta, n);
            tx.set_frame_choice(FrameChoice::Delta);
            let (mut f0, mut f1) = (Vec::new(), Vec::new());
            tx.encode(&v0, &mut f0).unwrap();
            tx.encode(&v1, &mut f1).unwrap();
            assert_eq!(f1[6], 3, "{dtype} n={n}: not a Delta frame");
            let trials = if n >= 40_000 { 60 } else { 200 };
            let mut damaged: Vec<Vec<u8>> = Vec::new();
            for _ in 0..trials {
                let mut f = f1.clone();
                // Half the flips in the model (s1) and the lane states, where they matter most.
                let s0 = u32::from_le_bytes(f[32..36].try_into().unwrap()) as usize;
                let at = if rng.below(2) == 0 {
                    HEADER_LEN + s0 + rng.below((f.len() - HEADER_LEN - s0) as u64) as usize
                } else {
                    rng.below(f.len() as u64) as usize
                };
                f[at] ^= 1 << rng.below(8);
                if rng.below(4) > 0 {
                    reseal(&mut f);
                }
                damaged.push(f);
            }
            for cut in [1, 2, 7, 64] {
                if f1.len() > cut {
                    damaged.push(f1[..f1.len() - cut].to_vec());
                }
            }
            let mut longer = f1.clone();
            longer.push(0);
            damaged.push(longer);
            for f in &damaged {
                let mut rx = CacheSlot::new(dtype, CacheMode::Delta, n);
                let mut out0 = vec![0u8; n * size];
                rx.decode(&f0, &mut out0).unwrap();
                let version = rx.version();
                let mut cpu_out = vec![0u8; n * size];
                let cpu = rx.decode(f, &mut cpu_out);
                let (mut cache, mut ctx) = (vec![0u8; n * size], vec![0u8; n]);
                let mut out = vec![0u8; n * size];
                let r0 = ciera_cuda_host::decode(
                    dtype.code() as u32,
                    &mut [DecChunk {
                        frame: &f0,
                        out: &mut out,
                        cache: &mut cache,
                        offset: 0,
                        version: 0,
                        warm: false,
                        full: true,
                        ctx: Some(&mut ctx),
                    }],
                );
                assert_eq!(r0[0], Ok(()));
                let r = ciera_cuda_host::decode(
                    dtype.code() as u32,
                    &mut [DecChunk {
                        frame: f,
                        out: &mut out,
                        cache: &mut cache,
                        offset: 0,
                        version,
                        warm: true,
                        full: true,
                        ctx: Some(&mut ctx),
                    }],
                );
                cases += 1;
                match (&cpu, &r[0]) {
                    (Ok(_), Ok(())) => {
                        accepted += 1;
                        assert!(out == cpu_out, "{dtype} n={n}: both accept, values differ");
                        assert!(
                            rx.values() == Some(&cache[..]),
                            "{dtype} n={n}: caches differ"
                        );
                        assert!(
                            rx.contexts() == Some(&ctx[..]),
                            "{dtype} n={n}: contexts differ"
                        );
                    }
                    (Err(_), Err(_)) => refused += 1,
                    (c, k) => panic!("{dtype} n={n}: CPU {c:?}, kernels {k:?}"),
                }
            }
        }
    }
    skip::show(&format!(
        "damaged Delta frames: {cases}, refused by both {refused}, accepted by both {accepted} \
         (same values, caches and contexts)\n"
    ));
    assert!(
        refused > cases / 2,
        "too few refusals: {refused} of {cases}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    /// The kernels' mask coder picks bitmask::plan_gated's coding and writes bitmask::encode's
    /// bytes, at every density (both rANS margins included: the histogram's and the choice's),
    /// and its decoder reads them back. A quarter of the masks are up to 80,000 bits: segmented
    /// rANS (coding 4) then has up to 3 segments of 4096 bytes, coded and decoded a thread per
    /// segment; the decoder refuses coding 4 in a frame of format version 2. A sixth are over
    /// 4096 words, where plan_gated first weighs rANS on a sample (an eighth of the words),
    /// with margins scaled to the mask.
    #[test]
    fn kernel_mask_coder_matches_bitmask(
        m in prop_oneof![3 => 0usize..5000, 1 => 5000usize..80_000, 1 => 262_144usize..330_000],
        density in 0u64..1001,
        seed in any::<u64>(),
        gain in proptest::option::of((0usize..200, 0usize..200)),
    ) {
        let gain = gain.map(|(t, g)| (t * (1 + m / 20_000), g * (1 + m / 20_000)));
        let mut rng = Rng(seed);
        let mut words = vec![0u64; m.div_ceil(64)];
        // Bursts (runs of set bits) half the time, so rANS wins often and its margin is hit.
        let burst = seed % 2 == 0;
        let mut on = false;
        for i in 0..m {
            let set = if burst {
                if rng.below(1000) < density / 8 + 1 {
                    on = !on;
                }
                on
            } else {
                rng.below(1000) < density
            };
            if set {
                words[i / 64] |= 1 << (i % 64);
            }
        }
        let plan = ciera::codec::bitmask::plan_gated(&words, m, gain);
        prop_assert_eq!(
            ciera_cuda_host::mask_plan(&words, m, gain),
            (plan.coding as u8, plan.bytes),
            "plan, m={} density={} gain={:?}", m, density, gain
        );
        let mut want = Vec::new();
        ciera::codec::bitmask::encode(&words, m, plan.coding, &mut want);
        let got = ciera_cuda_host::mask_encode(&words, m, gain);
        prop_assert_eq!(&got, &want, "m={} density={} gain={:?}", m, density, gain);
        let (back, ones) = ciera_cuda_host::mask_decode(&got, m, 3).unwrap();
        prop_assert_eq!(&back, &words);
        prop_assert_eq!(ones as usize, plan.ones);
        if got[0] == 4 {
            prop_assert!(ciera_cuda_host::mask_decode(&got, m, 2).is_err());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]
    /// The block's Hier reader (runs of words: level-1 bits counted and scanned to place the
    /// level-2 bytes, their bits counted and scanned to place the level-3 bytes) against the
    /// one-thread reader it replaced, on Hier masks intact and damaged (a byte changed, the
    /// payload cut or lengthened, a level-1 bit set past the last word, one or two level-2 or
    /// level-3 bytes zeroed): the same words and ones, or the same reason. Both accept exactly what
    /// `bitmask::decode` accepts, with its words.
    #[test]
    fn kernel_hier_mask_reader_matches_one_thread(
        m in prop_oneof![3 => 1usize..5000, 1 => 5000usize..80_000],
        density in 0u64..300,
        seed in any::<u64>(),
        damage in 0u32..8,
    ) {
        let mut rng = Rng(seed);
        let mut words = vec![0u64; m.div_ceil(64)];
        for i in 0..m {
            // Sparse words (the masks Hier wins on), each bit of a live word at `density`.
            if (i / 64) as u64 % 7 == seed % 7 && rng.below(1000) < density {
                words[i / 64] |= 1 << (i % 64);
            }
        }
        let mut enc = Vec::new();
        ciera::codec::bitmask::encode(&words, m, ciera::codec::bitmask::MaskCoding::Hier, &mut enc);
        let (l1, len) = ((m.div_ceil(64)).div_ceil(8), enc.len());
        let at = 1 + rng.below(len.max(2) as u64 - 1) as usize;
        match damage {
            1 if len > 1 => enc[at] ^= 1 + rng.below(255) as u8,
            2 if len > 1 => enc.truncate(at),
            3 => enc.extend((0..1 + rng.below(9)).map(|_| rng.below(256) as u8)),
            // A level-1 bit past the last word (where there is one).
            4 if m.div_ceil(64) % 8 != 0 => enc[l1] |= 0x80,
            // A level-2 or level-3 byte zeroed (past level 1).
            5 if len > 1 + l1 => enc[1 + l1 + rng.below((len - 1 - l1) as u64) as usize] = 0,
            // Two of them: the first (in word order) is the one reported.
            6 if len > 1 + l1 => {
                for _ in 0..2 {
                    enc[1 + l1 + rng.below((len - 1 - l1) as u64) as usize] = 0;
                }
            }
            _ => {}
        }
        let blk = ciera_cuda_host::mask_decode(&enc, m, 3);
        let one = ciera_cuda_host::mask_decode_one_thread(&enc, m, 3);
        prop_assert_eq!(&blk, &one, "m={} damage={} at={}", m, damage, at);
        let mut cpu = Vec::new();
        match (ciera::codec::bitmask::decode(&enc, m, &mut cpu), &blk) {
            (Ok(ones), Ok((w, o))) => {
                prop_assert_eq!(&cpu, w);
                prop_assert_eq!(ones as u64, *o);
            }
            (Err(_), Err(_)) => {}
            (c, g) => prop_assert!(false, "cpu {:?} kernels {:?} (m={} damage={})", c.is_ok(), g.is_ok(), m, damage),
        }
        // Intact, it reads back (a zero mask is never coded Hier: refused as a non-zero coding
        // of nothing, by all three).
        if damage == 0 && words.iter().any(|&w| w != 0) {
            prop_assert_eq!(blk.unwrap().0, words);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    /// The kernels' rANS table by the block (a symbol per thread: scaling, then each symbol's
    /// place in the order of descending frequency counted by its thread) is the one-thread
    /// table it replaced and `rans::FreqTable::from_histogram`'s, for histograms of every shape:
    /// one symbol, a few, all 256; flat, skewed (one huge count beside many small ones, where
    /// the rounding is taken back over several symbols and passes) and random.
    #[test]
    fn kernel_freq_table_matches_cpu(
        seed in any::<u64>(),
        shape in 0u32..4,
        present in 1usize..=256,
    ) {
        let mut rng = Rng(seed);
        let mut hist = [0u32; 256];
        for _ in 0..present {
            let s = rng.below(256) as usize;
            hist[s] = match shape {
                0 => 1 + rng.below(3) as u32,
                1 => 1 + rng.below(1 << 20) as u32,
                2 => 1,
                _ => 1 + rng.below(40) as u32,
            };
        }
        if shape == 2 {
            // One symbol holding nearly everything: the many small ones round up to 1 each.
            hist[rng.below(256) as usize] = 1 << 26;
        }
        let blk = ciera_cuda_host::freq_table(&hist, true);
        let one = ciera_cuda_host::freq_table(&hist, false);
        prop_assert_eq!(blk, one);
        let h64: [u64; 256] = std::array::from_fn(|s| hist[s] as u64);
        let cpu = ciera::codec::rans::FreqTable::from_histogram(&h64);
        prop_assert_eq!(&blk, cpu.freqs());
        prop_assert_eq!(blk.iter().sum::<u32>(), 4096);
    }
}
