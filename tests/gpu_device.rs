//! The codec kernels run on a GPU (`ciera::gpu::codec`): frames equal to the Rust codec's byte
//! for byte (and the same `FrameInfo`), bf16, fp16 and fp32, exponent and full-value caches
//! (Exp, Hybrid and FILL frames), synthetic drift with special values and every mask coding,
//! and the real trace; several jobs per batch, some ending in
//! the middle of a tile; the kernels decode the CPU's frames to the input bit for bit and leave
//! the encoder's cache; damaged frames are refused, with the same errors the host build of the
//! kernels gives; jobs carved from one device allocation, as a collective would lay them out;
//! Delta frames encoded (the CPU's bytes) and decoded with delta caches (values and contexts).
//!
//! Without a GPU those tests print a SKIPPED line naming what is missing (driver, device,
//! NVRTC), unless CIERA_REQUIRE_GPU=1 (bench/gpu_check.sh sets it), where they fail. What needs
//! no GPU runs everywhere: the scratch sizes against the kernels' own (host build), the
//! mapping of the kernels' refusals to codec errors (host build against the CPU decoder, Delta
//! frames too), and
//! the cubin declaring every kernel the launcher looks up (NVRTC, skipped without it).

#[path = "common/skip.rs"]
mod skip;
#[path = "common/trace_data.rs"]
mod trace_data;

use std::collections::BTreeMap;
use std::sync::Arc;

use ciera::codec::{CacheMode, CacheSlot, CodecError, FrameChoice, HEADER_LEN};
use ciera::gpu::codec::{
    self as gpu, DeviceDecJob, DeviceEncJob, GpuCodec, HostDecChunk, HostEncChunk, Refusal,
};
use ciera::gpu::nvrtc::{self, Arch};
use ciera::DType;
use trace_data::*;

const TYPES: [DType; 3] = [DType::BF16, DType::F16, DType::F32];
/// Synthetic Delta shapes on a GPU (elements, job): 1 to 32 lanes, several groups and jobs.
const DELTA_SHAPES: [(usize, usize); 4] = [(1, 1), (600, 600), (70_001, 70_001), (300_000, 65_536)];

/// The codec on this machine's GPU, or None after printing why the test is skipped.
fn gpu(test: &str) -> Option<Arc<GpuCodec>> {
    match gpu::device() {
        Ok(g) => Some(g),
        Err(e) if std::env::var_os("CIERA_REQUIRE_GPU").is_some_and(|v| v == "1") => {
            panic!("CIERA_REQUIRE_GPU=1 but the GPU codec is not usable: {e}")
        }
        Err(e) => {
            skip::skip(test, &format!("no GPU: {e}").replace('\n', " "));
            None
        }
    }
}

/// Decode one frame with the host build of the kernels (in the launch order the device
/// uses) against an exponent cache, or a full-value one (`full`): Ok, or the kernels' refusal.
#[allow(clippy::too_many_arguments)]
fn emu_decode(
    dtype: DType,
    frame: &[u8],
    out: &mut [u8],
    cache: &mut [u8],
    full: bool,
    offset: u64,
    version: u64,
    warm: bool,
) -> Result<(), Refusal> {
    let n = out.len() / dtype.size();
    assert_eq!(cache.len(), gpu::cache_bytes(dtype, n, full));
    let chunk = ciera_cuda_host::DecChunk {
        frame,
        out,
        cache,
        offset,
        version,
        warm,
        full,
        ctx: None,
    };
    ciera_cuda_host::decode(dtype.code() as u32, &mut [chunk])
        .remove(0)
        .map_err(|r| Refusal {
            code: r.code,
            a: r.a,
            b: r.b,
        })
}

/// The launcher's buffer sizes are the kernels' (`sizeof` of their structs, as g++ lays them
/// out: the same layout NVRTC gives these u64/u32 structs).
#[test]
fn scratch_sizes_match_the_kernels() {
    assert_eq!(
        ciera_cuda_host::plan_bytes(),
        gpu::PLAN_BYTES,
        "sizeof(Plan) changed: the launcher's scratch sizes and plan reading are stale"
    );
    for n in (1..300u64)
        .chain([
            4095,
            4096,
            4097,
            8191,
            65_536,
            70_001,
            1 << 22,
            (1 << 22) + 3,
        ])
        .chain((0..40).map(|s| 1u64 << s))
    {
        for full in [false, true] {
            assert_eq!(
                gpu::enc_scratch_bytes(n as usize, full),
                ciera_cuda_host::enc_scratch_bytes(n as usize, full),
                "encode n={n} full={full}"
            );
        }
        assert_eq!(
            gpu::dec_scratch_bytes(n as usize),
            ciera_cuda_host::dec_scratch_bytes(n as usize),
            "decode n={n}"
        );
        assert_eq!(
            gpu::delta_scratch_bytes(n as usize),
            ciera_cuda_host::delta_scratch_bytes(n as usize),
            "delta decode n={n}"
        );
        assert_eq!(
            gpu::enc_delta_scratch_bytes(n as usize),
            ciera_cuda_host::enc_delta_scratch_bytes(n as usize),
            "delta encode n={n}"
        );
    }
}

/// NVRTC's cubin declares every kernel the launcher looks up, each fitting 256 threads per
/// block in static shared memory and registers.
#[test]
fn the_cubin_declares_every_kernel_the_launcher_loads() {
    const TEST: &str = "the_cubin_declares_every_kernel_the_launcher_loads";
    let src = std::fs::read_to_string(repo_dir().join("cuda/codec.cu")).unwrap();
    let compiled = match nvrtc::compile(&src, "codec.cu", Arch::sm(90)) {
        Ok(c) => c,
        Err(e) if std::env::var_os("CIERA_REQUIRE_NVRTC").is_some_and(|v| v == "1") => {
            panic!("CIERA_REQUIRE_NVRTC=1 but: {e}")
        }
        Err(e) => {
            skip::skip(TEST, &format!("{e}").replace('\n', " "));
            return;
        }
    };
    for k in gpu::kernel_names() {
        assert!(
            compiled.entries.iter().any(|e| e.name == k),
            "{k} is not an entry point of the cubin"
        );
        let r = compiled
            .kernel(k)
            .unwrap_or_else(|| panic!("ptxas reported nothing for {k}"));
        assert!(
            r.shared_bytes <= 48 << 10,
            "{k}: {} B shared",
            r.shared_bytes
        );
        assert!(
            r.registers * 256 <= 65_536,
            "{k}: {} registers",
            r.registers
        );
    }
}

/// Frames compared, FILLs and Hybrids among them, and the mask codings of the Exp ones.
#[derive(Default, Debug)]
struct Seen {
    frames: usize,
    fills: usize,
    hybrid: usize,
    coding: BTreeMap<u8, usize>,
}

fn first_difference(a: &[u8], b: &[u8]) -> usize {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()))
}

/// Encode `iters` (one tensor per iteration) through CPU slots and on the GPU, `chunk`
/// elements per job, all jobs of an iteration in one batch: an exponent cache, and a
/// full-value cache choosing as the CPU does and always Hybrid.
fn same_frames(
    g: &GpuCodec,
    dtype: DType,
    iters: &[Vec<u8>],
    chunk: usize,
    ctx: &str,
    seen: &mut Seen,
) {
    for (mode, choice) in [
        (CacheMode::Exponent, FrameChoice::Auto),
        (CacheMode::FullValue, FrameChoice::Auto),
        (CacheMode::FullValue, FrameChoice::Hybrid),
    ] {
        let ctx = format!("{ctx} {mode:?} {choice:?}");
        same_frames_in(g, dtype, mode, choice, iters, chunk, &ctx, seen);
    }
}

/// `same_frames` for one cache: identical frames and infos; the GPU decodes the CPU's frames
/// back to the input and to the encoder's cache; the CPU decodes the GPU's.
#[allow(clippy::too_many_arguments)]
fn same_frames_in(
    g: &GpuCodec,
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
    let mut tx = CacheSlot::new(dtype, mode, n);
    let mut rx = CacheSlot::new(dtype, mode, n);
    tx.set_frame_choice(choice);
    rx.set_frame_choice(choice);
    let mut cache = vec![0u8; n * per];
    let mut dcache = vec![0u8; n * per];
    for (it, input) in iters.iter().enumerate() {
        assert_eq!(input.len(), n * size);
        let (version, cold) = (tx.version(), !tx.is_warm());
        let (cpu, infos) = encode_chunks(&mut tx, input, chunk);

        let mut jobs: Vec<HostEncChunk<'_>> = cache
            .chunks_mut(chunk * per)
            .enumerate()
            .map(|(i, c)| {
                let off = i * chunk;
                HostEncChunk {
                    input: &input[off * size..(off + c.len() / per) * size],
                    cache: c,
                    offset: off as u64,
                    version,
                    cold,
                    full,
                    choice,
                    ctx: None,
                }
            })
            .collect();
        let got = g
            .encode_host_batch(dtype, &mut jobs)
            .unwrap_or_else(|e| panic!("{ctx} {dtype} iteration {it}: {e}"));
        assert_eq!(got.len(), cpu.len(), "{ctx}: frame count");
        for (k, ((gf, gi), (cf, ci))) in got.iter().zip(cpu.iter().zip(&infos)).enumerate() {
            if gf != cf {
                panic!(
                    "{ctx} {dtype} iteration {it} chunk {k}: GPU frame differs from the CPU's at \
                     byte {} (lengths {} vs {}; mode {} vs {})",
                    first_difference(gf, cf),
                    gf.len(),
                    cf.len(),
                    gf.get(6).copied().unwrap_or(255),
                    cf[6]
                );
            }
            assert_eq!(gi, ci, "{ctx} {dtype} iteration {it} chunk {k}: frame info");
            seen.frames += 1;
            if cf[7] & 1 == 1 {
                seen.fills += 1;
            } else if cf[6] == 2 {
                seen.hybrid += 1;
            } else {
                let s0 = u32::from_le_bytes(cf[32..36].try_into().unwrap()) as usize;
                *seen.coding.entry(cf[HEADER_LEN + s0]).or_default() += 1;
            }
        }

        // The GPU decodes the CPU's frames: the input, and the encoder's cache.
        let mut out = vec![0u8; input.len()];
        let (warm, rv) = (rx.is_warm(), rx.version());
        let mut djobs: Vec<HostDecChunk<'_>> = dcache
            .chunks_mut(chunk * per)
            .zip(out.chunks_mut(chunk * size))
            .zip(&cpu)
            .enumerate()
            .map(|(i, ((c, o), f))| HostDecChunk {
                frame: f,
                out: o,
                cache: c,
                offset: (i * chunk) as u64,
                version: rv,
                warm,
                full,
                ctx: None,
            })
            .collect();
        let verdicts = g
            .decode_host_batch(dtype, &mut djobs)
            .unwrap_or_else(|e| panic!("{ctx} {dtype} iteration {it}: {e}"));
        for (k, v) in verdicts.iter().enumerate() {
            assert_eq!(
                *v,
                Ok(()),
                "{ctx} {dtype} iteration {it} chunk {k}: the GPU refused the CPU's frame"
            );
        }
        assert!(
            out == *input,
            "{ctx} {dtype} iteration {it}: GPU decode differs at byte {}",
            first_difference(&out, input)
        );
        assert!(
            dcache == cache,
            "{ctx} {dtype} iteration {it}: GPU decoder and encoder caches differ"
        );

        // The CPU decodes the GPU's frames (and keeps the receiver's version in step).
        let mut back = vec![0u8; input.len()];
        let mut rinfos = Vec::new();
        for (k, c) in rx.chunks(chunk).iter_mut().enumerate() {
            let (off, len) = (c.offset(), c.len());
            let f = ciera::codec::frame::parse(&got[k].0).unwrap();
            rinfos.push(
                c.decode(&f, &mut back[off * size..(off + len) * size])
                    .unwrap(),
            );
        }
        rx.commit(&rinfos).unwrap();
        assert!(
            back == *input,
            "{ctx} {dtype} iteration {it}: CPU decode differs"
        );
    }
}

/// Synthetic drift from no exceptions to most, with special values, in batches of several
/// jobs (some ending inside a tile, one over many tiles): every mask coding is compared.
#[test]
fn gpu_frames_match_the_cpu_on_synthetic_drift() {
    let Some(g) = gpu("gpu_frames_match_the_cpu_on_synthetic_drift") else {
        return;
    };
    let mut seen = Seen::default();
    for (di, dtype) in TYPES.into_iter().enumerate() {
        for (n, chunk) in [
            (1usize, 1usize),
            (63, 64),
            (4097, 4096),
            (70_001, 9000),
            (200_000, 200_000),
            (300_000, 65_536),
        ] {
            let mut rng = Rng(1 + di as u64 * 1000 + n as u64);
            let mut v = rng.bytes(n * dtype.size());
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
                &g,
                dtype,
                &iters,
                chunk,
                &format!("synthetic n={n} chunk={chunk}"),
                &mut seen,
            );
        }
    }
    skip::show(&format!(
        "GPU {} ({}): frames == CPU frames on synthetic drift: {} frames, {} FILL, {} Hybrid, \
         Exp mask codings {:?}\n",
        g.name(),
        g.arch(),
        seen.frames,
        seen.fills,
        seen.hybrid,
        seen.coding
    ));
    for coding in 0..4u8 {
        assert!(
            seen.coding.contains_key(&coding),
            "mask coding {coding} never compared: {seen:?}"
        );
    }
    assert!(seen.hybrid > 0, "no Hybrid frame compared: {seen:?}");
}

/// Every bf16 and fp32 tensor of the trace (and fp32 cast to fp16), its snapshots in order,
/// one frame per tensor and 5000-element jobs.
#[test]
fn gpu_frames_match_the_cpu_on_the_trace() {
    let Some(g) = gpu("gpu_frames_match_the_cpu_on_the_trace") else {
        return;
    };
    let dir = trace_dir();
    let mut seen = Seen::default();
    let series = trace_series(&dir);
    for (name, dtype, iters) in &series {
        for &chunk in trace_chunks(*dtype) {
            same_frames(&g, *dtype, iters, chunk, name, &mut seen);
        }
    }
    let tensors = series.iter().filter(|s| s.1 != DType::F16).count();
    skip::show(&format!(
        "GPU frames == CPU frames on {} ({tensors} tensors, {} snapshots): {} frames, {} FILL, \
         {} Hybrid, Exp mask codings {:?}\n",
        dir.display(),
        series.first().map_or(0, |s| s.2.len()),
        seen.frames,
        seen.fills,
        seen.hybrid,
        seen.coding
    ));
    assert!(seen.frames > seen.fills, "no Exp frame compared");
}

/// A FILL and a delta frame (Exp, or Hybrid for a full-value cache) of `n` elements of
/// `dtype`, from the CPU encoder: the second values, the frames, and the version the delta
/// frame was coded against.
struct Pair {
    v1: Vec<u8>,
    f0: Vec<u8>,
    f1: Vec<u8>,
    version: u64,
}

fn pair(dtype: DType, full: bool, n: usize, p_exp: u64, seed: u64) -> Pair {
    let mut rng = Rng(seed);
    let v0 = rng.bytes(n * dtype.size());
    let v1 = drift(dtype, &v0, p_exp, 5, if full { 900 } else { 0 }, &mut rng);
    let mode = if full {
        CacheMode::FullValue
    } else {
        CacheMode::Exponent
    };
    let mut tx = CacheSlot::new(dtype, mode, n);
    if full {
        tx.set_frame_choice(FrameChoice::Hybrid);
    }
    let (mut f0, mut f1) = (Vec::new(), Vec::new());
    tx.encode(&v0, &mut f0).unwrap();
    let version = tx.version();
    tx.encode(&v1, &mut f1).unwrap();
    Pair {
        v1,
        f0,
        f1,
        version,
    }
}

/// The cache a receiver holds after the FILL `f0` (decoded by the host build).
fn cache_after_fill(dtype: DType, full: bool, n: usize, f0: &[u8]) -> Vec<u8> {
    let mut cache = vec![0u8; gpu::cache_bytes(dtype, n, full)];
    let mut out = vec![0u8; n * dtype.size()];
    assert_eq!(
        emu_decode(dtype, f0, &mut out, &mut cache, full, 0, 0, false),
        Ok(())
    );
    cache
}

/// The kernels' verdict (host build) on one frame for `n` elements against `cache`, as the
/// GPU path reports it.
#[allow(clippy::too_many_arguments)]
fn kernel_error(
    dtype: DType,
    frame: &[u8],
    n: usize,
    cache: &[u8],
    full: bool,
    offset: u64,
    version: u64,
    warm: bool,
) -> Result<(), CodecError> {
    let mut cache = cache[..gpu::cache_bytes(dtype, n, full)].to_vec();
    let mut out = vec![0u8; n * dtype.size()];
    emu_decode(
        dtype, frame, &mut out, &mut cache, full, offset, version, warm,
    )
    .map_err(|r| r.to_error(n as u64, offset, full, frame.get(..HEADER_LEN)))
}

/// A warm CPU exponent-cache receiver at `version` holding the FILL `f0`'s exponents.
fn warm_slot(dtype: DType, n: usize, version: u64, f0: &[u8]) -> CacheSlot {
    let mut rx = CacheSlot::with_version(dtype, CacheMode::Exponent, n, version);
    let mut out = vec![0u8; n * dtype.size()];
    let f = ciera::codec::frame::parse(f0).unwrap();
    rx.chunk(0..n).decode(&f, &mut out).unwrap();
    rx.fill_from(&out).unwrap();
    rx
}

/// The kernels' refusals become the codec errors the CPU decoder gives for the same fault
/// (checked with the host build of the kernels: no GPU needed).
#[test]
fn refusals_map_to_the_cpu_decoders_errors() {
    let (dtype, n) = (DType::BF16, 5000usize);
    let p = pair(dtype, false, n, 30, 11);
    let cache = cache_after_fill(dtype, false, n, &p.f0);
    let v = p.version;
    let cpu = |slot: &mut CacheSlot, f: &[u8]| {
        let mut out = vec![0u8; slot.len() * dtype.size()];
        slot.decode(f, &mut out).map(|_| ())
    };
    let kernels = |f: &[u8], n: usize, offset: u64, version: u64, warm: bool| {
        kernel_error(dtype, f, n, &cache, false, offset, version, warm)
    };
    assert_eq!(kernels(&p.f1, n, 0, v, true), Ok(()));

    // A flipped byte past s0: the frame checksum.
    let mut f = p.f1.clone();
    *f.last_mut().unwrap() ^= 0x10;
    let k = kernels(&f, n, 0, v, true);
    assert!(matches!(k, Err(CodecError::Checksum { .. })), "{k:?}");
    assert_eq!(k, cpu(&mut warm_slot(dtype, n, v, &p.f0), &f));

    // A flipped byte in s0: its SH64.
    let mut f = p.f1.clone();
    f[HEADER_LEN + 100] ^= 0x01;
    let k = kernels(&f, n, 0, v, true);
    assert!(matches!(k, Err(CodecError::Checksum { .. })), "{k:?}");
    assert_eq!(k, cpu(&mut warm_slot(dtype, n, v, &p.f0), &f));

    // Another slot version.
    let k = kernels(&p.f1, n, 0, v ^ 7, true);
    assert_eq!(
        k,
        Err(CodecError::VersionMismatch {
            slot_version: v ^ 7,
            frame_version: v
        })
    );
    assert_eq!(k, cpu(&mut warm_slot(dtype, n, v ^ 7, &p.f0), &p.f1));

    // A cold slot.
    let k = kernels(&p.f1, n, 0, v, false);
    assert!(matches!(k, Err(CodecError::SlotState { .. })), "{k:?}");
    assert_eq!(
        k,
        cpu(&mut CacheSlot::new(dtype, CacheMode::Exponent, n), &p.f1)
    );

    // Another element count, another offset.
    let k = kernels(&p.f1, n - 1, 0, v, true);
    assert_eq!(
        k,
        Err(CodecError::LengthMismatch {
            what: "frame element count",
            expected: n - 1,
            found: n
        })
    );
    assert_eq!(
        k,
        cpu(
            &mut CacheSlot::new(dtype, CacheMode::Exponent, n - 1),
            &p.f1
        )
    );
    let k = kernels(&p.f1, n, 5, v, true);
    let mut wide = CacheSlot::new(dtype, CacheMode::Exponent, n + 5);
    let mut out = vec![0u8; n * dtype.size()];
    let f = ciera::codec::frame::parse(&p.f1).unwrap();
    let c = wide.chunk(5..5 + n).decode(&f, &mut out).map(|_| ());
    assert!(matches!(
        k,
        Err(CodecError::LengthMismatch {
            what: "frame element offset",
            ..
        })
    ));
    assert_eq!(k, c);

    // Another element type of the same size.
    let k = kernel_error(DType::F16, &p.f1, n, &cache, false, 0, v, true);
    assert_eq!(
        k,
        Err(CodecError::DTypeMismatch {
            expected: DType::F16,
            found: DType::BF16
        })
    );
    assert_eq!(
        k,
        cpu(
            &mut CacheSlot::new(DType::F16, CacheMode::Exponent, n),
            &p.f1
        )
    );

    // Truncated: the header's section lengths.
    for cut in [&p.f1[..p.f1.len() - 1], &p.f1[..10]] {
        let k = kernels(cut, n, 0, v, true);
        assert!(
            matches!(k, Err(CodecError::CorruptFrame { what: "header", .. })),
            "{k:?}"
        );
    }

    // A Hybrid frame for an exponent cache, and for a cold full-value one.
    let h = pair(dtype, true, n, 30, 12);
    let k = kernels(&h.f1, n, 0, h.version, true);
    assert!(matches!(k, Err(CodecError::SlotState { .. })), "{k:?}");
    let k = kernel_error(
        dtype,
        &h.f1,
        n,
        &vec![0u8; 2 * n],
        true,
        0,
        h.version,
        false,
    );
    assert_eq!(
        k,
        cpu(&mut CacheSlot::new(dtype, CacheMode::FullValue, n), &h.f1)
    );
}

/// Damaged frames (one bit flipped anywhere, checksums left as they were; truncated), decoded
/// in one batch beside intact ones (also with a byte after the frame, which is not the
/// frame's), Exp frames against exponent caches and Hybrid frames against full-value ones:
/// the GPU refuses every damaged frame, with the error the host build of the kernels gives,
/// and accepts the intact ones.
#[test]
fn gpu_refuses_damaged_frames() {
    let Some(g) = gpu("gpu_refuses_damaged_frames") else {
        return;
    };
    let mut refused = 0;
    for (di, dtype) in TYPES.into_iter().enumerate() {
        for full in [false, true] {
            for (n, p_exp) in [(1usize, 500u64), (100, 30), (5000, 20), (9000, 300)] {
                let p = pair(dtype, full, n, p_exp, 77 + di as u64 * 31 + n as u64);
                let cache = cache_after_fill(dtype, full, n, &p.f0);
                let mut rng = Rng(n as u64 ^ p_exp);
                let mut frames: Vec<Vec<u8>> = Vec::new();
                for k in 0..120 {
                    let mut f = p.f1.clone();
                    if k % 10 == 0 {
                        frames.push(f); // intact
                        continue;
                    }
                    let at = rng.below(f.len() as u64) as usize;
                    f[at] ^= 1 << rng.below(8);
                    frames.push(f);
                }
                for cut in [1, 7, 64] {
                    if p.f1.len() > cut {
                        frames.push(p.f1[..p.f1.len() - cut].to_vec());
                    }
                }
                let mut longer = p.f1.clone();
                longer.push(0xa5);
                frames.push(longer);

                let size = dtype.size();
                let mut caches: Vec<Vec<u8>> = frames.iter().map(|_| cache.clone()).collect();
                let mut outs: Vec<Vec<u8>> = frames.iter().map(|_| vec![0u8; n * size]).collect();
                let mut jobs: Vec<HostDecChunk<'_>> = frames
                    .iter()
                    .zip(caches.iter_mut().zip(outs.iter_mut()))
                    .map(|(f, (c, o))| HostDecChunk {
                        frame: f,
                        out: o,
                        cache: c,
                        offset: 0,
                        version: p.version,
                        warm: true,
                        full,
                        ctx: None,
                    })
                    .collect();
                let verdicts = g.decode_host_batch(dtype, &mut jobs).unwrap();
                drop(jobs);
                let ctx = format!("{dtype} full={full} n={n}");
                for (k, (f, v)) in frames.iter().zip(&verdicts).enumerate() {
                    let want = kernel_error(dtype, f, n, &cache, full, 0, p.version, true);
                    assert_eq!(*v, want, "{ctx} frame {k}: GPU vs host build");
                    if f.starts_with(&p.f1) {
                        assert_eq!(*v, Ok(()), "{ctx} frame {k}: intact frame refused");
                        assert!(outs[k] == p.v1, "{ctx} frame {k}: values differ");
                    } else {
                        assert!(v.is_err(), "{ctx} frame {k}: damaged frame accepted");
                        refused += 1;
                    }
                }
            }
        }
    }
    skip::show(&format!(
        "GPU refused {refused} damaged frames, each with the host build's error\n"
    ));
}

/// Jobs carved from one device allocation each (values, caches, frames at an 8-aligned
/// stride, scratch), as a collective lays a shard out: encode cold then warm (an exponent
/// cache, and a full-value one sending Hybrid frames), decode the frames where they lie,
/// against the CPU's frames and values.
#[test]
fn gpu_jobs_share_device_buffers() {
    let Some(g) = gpu("gpu_jobs_share_device_buffers") else {
        return;
    };
    let s = g.stream().clone();
    for (di, dtype) in TYPES.into_iter().enumerate() {
        for full in [false, true] {
            let (jobs_n, m) = (5usize, 10_000usize);
            let size = dtype.size();
            let n = jobs_n * m;
            let per = gpu::cache_bytes(dtype, m, full);
            let stride = gpu::max_frame_bytes(dtype, m).next_multiple_of(gpu::ALIGN);
            let (es, ds) = (
                gpu::enc_scratch_bytes(m, full).next_multiple_of(gpu::ALIGN),
                gpu::dec_scratch_bytes(m).next_multiple_of(gpu::ALIGN),
            );
            let (mode, choice) = if full {
                (CacheMode::FullValue, FrameChoice::Hybrid)
            } else {
                (CacheMode::Exponent, FrameChoice::Auto)
            };
            let mut rng = Rng(900 + di as u64);
            let v0 = rng.bytes(n * size);
            let v1 = drift(dtype, &v0, 25, 3, 800, &mut rng);
            let mut tx = CacheSlot::new(dtype, mode, n);
            tx.set_frame_choice(choice);
            let mut cache = s.alloc_zeros::<u8>(jobs_n * per).unwrap();
            let mut dcache = s.alloc_zeros::<u8>(jobs_n * per).unwrap();
            let mut frames = s.alloc_zeros::<u8>(jobs_n * stride).unwrap();
            let mut escratch = s.alloc_zeros::<u8>(jobs_n * es).unwrap();
            let mut dscratch = s.alloc_zeros::<u8>(jobs_n * ds).unwrap();
            let mut out = s.alloc_zeros::<u8>(n * size).unwrap();
            for (it, values) in [&v0, &v1].into_iter().enumerate() {
                let ctx = format!("{dtype} full={full} iteration {it}");
                let (version, cold) = (tx.version(), !tx.is_warm());
                let mut cpu = Vec::new();
                let mut infos = Vec::new();
                for c in tx.chunks(m).iter_mut() {
                    let mut f = Vec::new();
                    let off = c.offset();
                    infos.push(
                        c.encode(&values[off * size..(off + m) * size], &mut f)
                            .unwrap(),
                    );
                    cpu.push(f);
                }
                tx.commit(&infos).unwrap();

                let input = s.clone_htod(values.as_slice()).unwrap();
                let lens: Vec<usize> = {
                    let iv = input.as_view();
                    let mut jobs: Vec<DeviceEncJob<'_>> = iv
                        .chunks_exact(m * size)
                        .zip(cache.as_view_mut().chunks_exact_mut(per))
                        .zip(frames.as_view_mut().chunks_exact_mut(stride))
                        .zip(escratch.as_view_mut().chunks_exact_mut(es))
                        .enumerate()
                        .map(|(j, (((input, cache), frame), scratch))| DeviceEncJob {
                            input,
                            cache,
                            frame,
                            scratch,
                            offset: (j * m) as u64,
                            version,
                            cold,
                            full,
                            choice,
                            delta: None,
                        })
                        .collect();
                    let got = g.encode(&s, dtype, &mut jobs).unwrap();
                    assert_eq!(got, infos, "{ctx}: frame infos");
                    got.iter().map(|i| i.frame_bytes).collect()
                };
                for (j, f) in cpu.iter().enumerate() {
                    let gf = s
                        .clone_dtoh(&frames.slice(j * stride..j * stride + lens[j]))
                        .unwrap();
                    assert!(gf == *f, "{ctx} job {j}: frame differs");
                }
                let verdicts = {
                    let mut jobs: Vec<DeviceDecJob<'_>> = out
                        .as_view_mut()
                        .chunks_exact_mut(m * size)
                        .zip(dcache.as_view_mut().chunks_exact_mut(per))
                        .zip(dscratch.as_view_mut().chunks_exact_mut(ds))
                        .enumerate()
                        .map(|(j, ((out, cache), scratch))| DeviceDecJob {
                            // The whole slot of the frame: bytes past it are not read.
                            frame: frames.slice(j * stride..(j + 1) * stride),
                            out,
                            cache,
                            scratch,
                            offset: (j * m) as u64,
                            version,
                            warm: !cold,
                            full,
                            delta: None,
                        })
                        .collect();
                    g.decode(&s, dtype, &mut jobs).unwrap()
                };
                assert!(verdicts.iter().all(|v| v.is_ok()), "{ctx}: {verdicts:?}");
                assert!(
                    s.clone_dtoh(&out).unwrap() == *values,
                    "{ctx}: decoded values differ"
                );
                assert!(
                    s.clone_dtoh(&dcache).unwrap() == s.clone_dtoh(&cache).unwrap(),
                    "{ctx}: caches differ"
                );
            }
            if full {
                assert!(tx.is_warm(), "{dtype}: the full-value slot did not warm up");
            }
        }
    }
}

/// A delta receiver's verdict from the kernels (host build): `frame` decoded into `cache`
/// (values) and `ctx` (contexts), mapped to the codec's error as the GPU path maps it.
#[allow(clippy::too_many_arguments)]
fn emu_delta_error(
    dtype: DType,
    frame: &[u8],
    out: &mut [u8],
    cache: &mut [u8],
    ctx: &mut [u8],
    version: u64,
    warm: bool,
) -> Result<(), CodecError> {
    let n = ctx.len();
    let chunk = ciera_cuda_host::DecChunk {
        frame,
        out,
        cache,
        offset: 0,
        version,
        warm,
        full: true,
        ctx: Some(ctx),
    };
    ciera_cuda_host::decode(dtype.code() as u32, &mut [chunk])
        .remove(0)
        .map_err(|r| {
            Refusal {
                code: r.code,
                a: r.a,
                b: r.b,
            }
            .to_error(n as u64, 0, true, frame.get(..HEADER_LEN))
        })
}

/// The kernels' refusals of Delta frames (host build) name the part the CPU decoder names:
/// the model ("delta tables") or the lane streams ("delta lanes"); a Delta frame for a cache
/// without contexts is a slot-state error on both.
#[test]
fn delta_refusals_map_to_the_cpu_decoders_errors() {
    let (dtype, n) = (DType::BF16, 5000usize);
    let size = dtype.size();
    let mut rng = Rng(21);
    let v0 = rng.bytes(n * size);
    let v1 = ulp_drift(dtype, &v0, 600, 2, &mut rng);
    let mut tx = CacheSlot::new(dtype, CacheMode::Delta, n);
    tx.set_frame_choice(FrameChoice::Delta);
    let (mut f0, mut f1) = (Vec::new(), Vec::new());
    tx.encode(&v0, &mut f0).unwrap();
    tx.encode(&v1, &mut f1).unwrap();
    assert_eq!(f1[6], 3, "not a Delta frame");
    // The slot version the Delta frame was encoded against (a receiver holds it after f0).
    let version = u64::from_le_bytes(f1[24..32].try_into().unwrap());
    let s0 = u32::from_le_bytes(f1[32..36].try_into().unwrap()) as usize;
    let s1 = HEADER_LEN + s0;
    let verdicts = |f: &[u8]| {
        let mut rx = CacheSlot::new(dtype, CacheMode::Delta, n);
        let mut out = vec![0u8; n * size];
        rx.decode(&f0, &mut out).unwrap();
        let cpu = rx.decode(f, &mut out).map(|_| ());
        let (mut cache, mut ctx, mut out) =
            (vec![0u8; n * size], vec![0u8; n], vec![0u8; n * size]);
        emu_delta_error(dtype, &f0, &mut out, &mut cache, &mut ctx, 0, false).unwrap();
        let k = emu_delta_error(dtype, f, &mut out, &mut cache, &mut ctx, version, true);
        (cpu, k)
    };
    assert_eq!(verdicts(&f1), (Ok(()), Ok(())));
    let what = |r: &Result<(), CodecError>| match r {
        Err(CodecError::CorruptFrame { what, .. }) => *what,
        other => panic!("not a corrupt frame: {other:?}"),
    };
    // The model: no lanes; a group of 0 elements; a frequency off by one (sums to 4095 or
    // 4097); a group length off by a word.
    let mut cases: Vec<(Vec<u8>, &str)> = Vec::new();
    let mut f = f1.clone();
    f[s1] = 0;
    cases.push((f, "delta tables"));
    let mut f = f1.clone();
    f[s1 + 1..s1 + 5].copy_from_slice(&0u32.to_le_bytes());
    cases.push((f, "delta tables"));
    // A frequency stored in one varint byte (2..=126): one more, one less.
    let mut at = s1 + 5;
    let mut one_byte = None;
    for _ in 0..17 {
        let m = f1[at] as usize;
        at += 1;
        for _ in 0..m {
            if one_byte.is_none() && f1[at] & 0x80 == 0 && (2..0x7f).contains(&f1[at]) {
                one_byte = Some(at);
            }
            while f1[at] & 0x80 != 0 {
                at += 1;
            }
            at += 1;
        }
    }
    let first = one_byte.expect("no one-byte frequency in the tables");
    for delta in [1u8, 0xff] {
        let mut f = f1.clone();
        f[first] = f[first].wrapping_add(delta);
        cases.push((f, "delta tables"));
    }
    let lens = f1.len() - 4;
    let mut f = f1.clone();
    let l = u32::from_le_bytes(f[lens..].try_into().unwrap()) + 2;
    f[lens..].copy_from_slice(&l.to_le_bytes());
    cases.push((f, "delta lanes"));
    // The lanes: a state below 2^15; the stream's last word.
    let mut f = f1.clone();
    f[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&16u32.to_le_bytes());
    cases.push((f, "delta lanes"));
    let mut f = f1.clone();
    f[s1 - 1] ^= 0x40;
    cases.push((f, "delta lanes"));
    assert!(cases.len() >= 6, "{} cases", cases.len());
    for (i, (f, part)) in cases.iter_mut().enumerate() {
        reseal(f);
        let (cpu, k) = verdicts(f);
        assert_eq!(
            (what(&cpu), what(&k)),
            (*part, *part),
            "case {i}: CPU {cpu:?}, kernels {k:?}"
        );
    }
    // A Delta frame for a full-value cache (no contexts).
    let mut rx = CacheSlot::new(dtype, CacheMode::FullValue, n);
    let mut out = vec![0u8; n * size];
    rx.decode(&f0, &mut out).unwrap();
    let cpu = rx.decode(&f1, &mut out);
    let mut cache = out.clone();
    let k = emu_decode(
        dtype,
        &f1,
        &mut out,
        &mut cache,
        true,
        0,
        rx.version(),
        true,
    )
    .map_err(|r| r.to_error(n as u64, 0, true, f1.get(..HEADER_LEN)));
    assert!(matches!(cpu, Err(CodecError::SlotState { .. })), "{cpu:?}");
    assert!(matches!(k, Err(CodecError::SlotState { .. })), "{k:?}");
}

/// Recompute a frame's two checksums (SH64 of s0, XXH3 of the header and s1..s3), so that
/// damage reaches the decoders' section checks (a frame whose s0 length runs past its end is
/// left as it is).
fn reseal(f: &mut [u8]) {
    let s0 = u32::from_le_bytes(f[32..36].try_into().unwrap()) as usize;
    if HEADER_LEN + s0 > f.len() {
        return; // a damaged section length: nothing to seal
    }
    let h = ciera::codec::checksum::sh64(&f[HEADER_LEN..HEADER_LEN + s0]);
    f[48..56].copy_from_slice(&h.to_le_bytes());
    let mut x = f[..56].to_vec();
    x.extend_from_slice(&f[HEADER_LEN + s0..]);
    let h = xxhash_rust::xxh3::xxh3_64(&x);
    f[56..64].copy_from_slice(&h.to_le_bytes());
}

/// Delta frames decoded on the GPU into delta caches (values and contexts in device memory):
/// the input bit for bit, and the CPU receiver's values and contexts, over the trace's bf16
/// and fp32 tensors and synthetic ulp drift with special values (1 to 32 lanes, up to three
/// groups per job; Exp and Hybrid frames between, which reset the contexts).
#[test]
fn gpu_decodes_delta_frames_like_the_cpu() {
    let Some(g) = gpu("gpu_decodes_delta_frames_like_the_cpu") else {
        return;
    };
    let mut modes: BTreeMap<u8, usize> = BTreeMap::new();
    let mut run = |dtype: DType, iters: &[Vec<u8>], chunk: usize, what: &str| {
        let size = dtype.size();
        let n = iters[0].len() / size;
        let chunk = chunk.min(n);
        let mut tx = CacheSlot::new(dtype, CacheMode::Delta, n);
        let mut rx = CacheSlot::new(dtype, CacheMode::Delta, n);
        let (mut cache, mut ctx) = (vec![0u8; n * size], vec![0u8; n]);
        for (it, input) in iters.iter().enumerate() {
            let (frames, _) = encode_chunks(&mut tx, input, chunk);
            let (version, warm) = (rx.version(), rx.is_warm());
            let mut got = vec![0u8; n * size];
            let mut jobs: Vec<HostDecChunk<'_>> = cache
                .chunks_mut(chunk * size)
                .zip(ctx.chunks_mut(chunk))
                .zip(got.chunks_mut(chunk * size))
                .zip(&frames)
                .enumerate()
                .map(|(i, (((c, x), o), f))| HostDecChunk {
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
            let verdicts = g.decode_host_batch(dtype, &mut jobs).unwrap();
            for (k, v) in verdicts.iter().enumerate() {
                assert!(
                    v.is_ok(),
                    "{what} {dtype} iteration {it} chunk {k}: GPU refused: {v:?}"
                );
                *modes.entry(frames[k][6]).or_default() += 1;
            }
            let out = decode_chunks(&mut rx, &frames, chunk);
            assert!(
                out == *input,
                "{what} {dtype} iteration {it}: CPU decode differs"
            );
            assert!(
                got == *input,
                "{what} {dtype} iteration {it}: GPU decode differs"
            );
            assert!(
                rx.values() == Some(&cache[..]),
                "{what} {dtype} iteration {it}: values"
            );
            assert!(
                rx.contexts() == Some(&ctx[..]),
                "{what} {dtype} iteration {it}: contexts"
            );
        }
    };
    for (di, dtype) in TYPES.into_iter().enumerate() {
        for (n, chunk) in DELTA_SHAPES {
            let iters = ulp_series(dtype, n, 3 + di as u64 * 1000 + n as u64);
            run(
                dtype,
                &iters,
                chunk,
                &format!("synthetic n={n} chunk={chunk}"),
            );
        }
    }
    for (name, dtype, iters) in &trace_series(&trace_dir()) {
        run(*dtype, iters, 1 << 20, name);
    }
    skip::show(&format!(
        "GPU {} ({}): Delta decode == CPU (values, caches, contexts); frames by mode {modes:?}\n",
        g.name(),
        g.arch()
    ));
    assert!(
        modes.get(&3).copied().unwrap_or(0) > 0,
        "no Delta frame: {modes:?}"
    );
}

/// Frames encoded on the GPU against delta caches in device memory: the CPU's frames byte for
/// byte and the same `FrameInfo`, values and contexts, for `FrameChoice::Delta` (FILLs where a
/// Delta frame is longer) and `Auto` (the smallest of Exp, Hybrid and Delta, as the CPU picks
/// it) over synthetic ulp drift with special values and the trace, and for every choice
/// (`Auto`, `NoDelta`, `Exp`, `Hybrid`) over regimes where each frame wins.
#[test]
fn gpu_encodes_delta_frames_like_the_cpu() {
    let Some(g) = gpu("gpu_encodes_delta_frames_like_the_cpu") else {
        return;
    };
    let mut modes: BTreeMap<(String, u8), usize> = BTreeMap::new();
    let mut run =
        |dtype: DType, choice: FrameChoice, iters: &[Vec<u8>], chunk: usize, what: &str| {
            let size = dtype.size();
            let n = iters[0].len() / size;
            let chunk = chunk.min(n);
            let mut tx = CacheSlot::new(dtype, CacheMode::Delta, n);
            tx.set_frame_choice(choice);
            let (mut cache, mut ctx) = (vec![0u8; n * size], vec![0u8; n]);
            for (it, input) in iters.iter().enumerate() {
                let (version, cold) = (tx.version(), !tx.is_warm());
                let (cpu, infos) = encode_chunks(&mut tx, input, chunk);
                let mut jobs: Vec<HostEncChunk<'_>> = cache
                    .chunks_mut(chunk * size)
                    .zip(ctx.chunks_mut(chunk))
                    .enumerate()
                    .map(|(i, (c, x))| HostEncChunk {
                        input: &input[i * chunk * size..(i * chunk + x.len()) * size],
                        cache: c,
                        offset: (i * chunk) as u64,
                        version,
                        cold,
                        full: true,
                        choice,
                        ctx: Some(x),
                    })
                    .collect();
                let got = g.encode_host_batch(dtype, &mut jobs).unwrap();
                for (k, ((f, info), (c, ci))) in got.iter().zip(cpu.iter().zip(&infos)).enumerate()
                {
                    assert!(
                        f == c,
                        "{what} {dtype} {choice:?} iteration {it} chunk {k}: GPU frame differs"
                    );
                    assert_eq!(
                        info, ci,
                        "{what} {dtype} {choice:?} iteration {it} chunk {k}: FrameInfo"
                    );
                    *modes.entry((format!("{choice:?}"), c[6])).or_default() += 1;
                }
                assert!(
                    tx.values() == Some(&cache[..]),
                    "{what} {dtype} {choice:?} iteration {it}: values"
                );
                assert!(
                    tx.contexts() == Some(&ctx[..]),
                    "{what} {dtype} {choice:?} iteration {it}: contexts"
                );
            }
        };
    for (di, dtype) in TYPES.into_iter().enumerate() {
        for (n, chunk) in DELTA_SHAPES {
            let iters = ulp_series(dtype, n, 13 + di as u64 * 1000 + n as u64);
            let what = format!("synthetic n={n} chunk={chunk}");
            for choice in [FrameChoice::Delta, FrameChoice::Auto] {
                run(dtype, choice, &iters, chunk, &what);
            }
        }
        for (n, chunk) in [(600, 600), (40_000, 17_000), (140_000, 140_000)] {
            let iters = regime_series(dtype, n, 77 + di as u64 * 1000 + n as u64);
            let what = format!("regimes n={n} chunk={chunk}");
            for choice in [
                FrameChoice::Auto,
                FrameChoice::NoDelta,
                FrameChoice::Exp,
                FrameChoice::Hybrid,
            ] {
                run(dtype, choice, &iters, chunk, &what);
            }
        }
    }
    for (name, dtype, iters) in &trace_series(&trace_dir()) {
        for choice in [FrameChoice::Delta, FrameChoice::Auto] {
            run(*dtype, choice, iters, 1 << 20, name);
        }
    }
    skip::show(&format!(
        "GPU {} ({}): frames of delta caches == CPU frames (and FrameInfo, values, contexts); \
         frames by choice and mode {modes:?}\n",
        g.name(),
        g.arch()
    ));
    for (choice, mode) in [("Delta", 3u8), ("Auto", 1), ("Auto", 2), ("Auto", 3)] {
        assert!(
            modes.get(&(choice.to_string(), mode)).copied().unwrap_or(0) > 0,
            "{choice} never sent a frame of mode {mode}: {modes:?}"
        );
    }
}

/// The same kind of fault on both sides: both accept, or both refuse with the same error
/// variant (and, for a corrupt frame, the same part named). The details may differ where a
/// frame has several faults: blocks that run concurrently on a device report the first one
/// they reach.
fn same_fault(a: &Result<(), CodecError>, b: &Result<(), CodecError>) -> bool {
    match (a, b) {
        (Ok(()), Ok(())) => true,
        (
            Err(CodecError::CorruptFrame { what: x, .. }),
            Err(CodecError::CorruptFrame { what: y, .. }),
        ) => x == y,
        (Err(x), Err(y)) => std::mem::discriminant(x) == std::mem::discriminant(y),
        _ => false,
    }
}

/// Damaged Delta frames decoded on the GPU into delta caches, in one batch beside intact ones:
/// bytes flipped (three in four resealed, so the damage reaches the model, the lane states and
/// the streams, where blocks of one launch refuse the frame concurrently), truncated, extended.
/// The GPU refuses each damaged frame the host build refuses, naming the same part, and
/// decodes the intact ones to the CPU receiver's values and contexts.
#[test]
fn gpu_refuses_damaged_delta_frames() {
    let Some(g) = gpu("gpu_refuses_damaged_delta_frames") else {
        return;
    };
    let (mut refused, mut accepted) = (0, 0);
    for (di, dtype) in TYPES.into_iter().enumerate() {
        for n in [100usize, 5000, 70_001] {
            let size = dtype.size();
            let iters = ulp_series(dtype, n, 51 + di as u64 * 31 + n as u64);
            let mut tx = CacheSlot::new(dtype, CacheMode::Delta, n);
            tx.set_frame_choice(FrameChoice::Delta);
            let (mut f0, mut f1) = (Vec::new(), Vec::new());
            tx.encode(&iters[0], &mut f0).unwrap();
            tx.encode(&iters[1], &mut f1).unwrap();
            assert_eq!(f1[6], 3, "{dtype} n={n}: not a Delta frame");
            let version = u64::from_le_bytes(f1[24..32].try_into().unwrap());
            // The CPU receiver after each frame: the intact frame's values and contexts.
            let mut rx = CacheSlot::new(dtype, CacheMode::Delta, n);
            let mut out = vec![0u8; n * size];
            rx.decode(&f0, &mut out).unwrap();
            rx.decode(&f1, &mut out).unwrap();
            let mut rng = Rng(n as u64 ^ 0xde17a);
            let mut frames: Vec<Vec<u8>> = Vec::new();
            for k in 0..100 {
                let mut f = f1.clone();
                if k % 10 == 0 {
                    frames.push(f); // intact
                    continue;
                }
                let at = rng.below(f.len() as u64) as usize;
                f[at] ^= 1 << rng.below(8);
                if rng.below(4) > 0 {
                    reseal(&mut f);
                }
                frames.push(f);
            }
            for cut in [1, 7, 64] {
                frames.push(f1[..f1.len() - cut].to_vec());
            }
            let mut longer = f1.clone();
            longer.push(0xa5);
            frames.push(longer);
            let mut caches: Vec<Vec<u8>> = frames.iter().map(|_| iters[0].clone()).collect();
            let mut ctxs: Vec<Vec<u8>> = frames.iter().map(|_| vec![8u8; n]).collect();
            let mut outs: Vec<Vec<u8>> = frames.iter().map(|_| vec![0u8; n * size]).collect();
            let mut jobs: Vec<HostDecChunk<'_>> = frames
                .iter()
                .zip(caches.iter_mut().zip(ctxs.iter_mut().zip(outs.iter_mut())))
                .map(|(f, (c, (x, o)))| HostDecChunk {
                    frame: f,
                    out: o,
                    cache: c,
                    offset: 0,
                    version,
                    warm: true,
                    full: true,
                    ctx: Some(x),
                })
                .collect();
            let verdicts = g.decode_host_batch(dtype, &mut jobs).unwrap();
            drop(jobs);
            let what = format!("{dtype} n={n}");
            for (k, (f, v)) in frames.iter().zip(&verdicts).enumerate() {
                let (mut cache, mut ctx, mut o) =
                    (iters[0].clone(), vec![8u8; n], vec![0u8; n * size]);
                let want = emu_delta_error(dtype, f, &mut o, &mut cache, &mut ctx, version, true);
                assert!(
                    same_fault(v, &want),
                    "{what} frame {k}: GPU {v:?}, host build {want:?}"
                );
                if k % 10 == 0 && k < 100 {
                    assert_eq!(*v, Ok(()), "{what} frame {k}: intact frame refused");
                    assert!(outs[k] == iters[1], "{what} frame {k}: values differ");
                    assert!(
                        rx.contexts() == Some(&ctxs[k][..]),
                        "{what} frame {k}: contexts"
                    );
                    accepted += 1;
                } else if v.is_err() {
                    refused += 1;
                }
            }
        }
    }
    skip::show(&format!(
        "GPU Delta decoder: {refused} damaged frames refused as the host build refuses them, \
         {accepted} intact ones decoded to the CPU's values and contexts\n"
    ));
}
