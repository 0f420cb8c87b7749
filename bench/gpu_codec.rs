//! `cargo bench --bench gpu_codec`: the codec kernels on a GPU (`ciera::gpu::codec`), encode
//! and decode throughput in GB/s of uncompressed bytes, each beside a device-to-device copy of
//! the same bytes timed in the same run (CUDA events around the kernels alone, best of the
//! repetitions), with the compression ratio, for an exponent cache (Exp frames), a
//! full-value cache (Exp or Hybrid, as the CPU chooses) and a delta cache (Delta frames,
//! values and contexts; checked against the CPU's frames). Data: the bf16
//! and fp32 tensors of consecutive snapshots of the real trace (fp16: the fp32 ones cast),
//! concatenated and tiled to at least 256 MiB per run, coded as one batch of 1 Mi-element
//! jobs; every run is a real delta of one step (the two steps alternate, so the caches never
//! need restoring; the delta row restores its receiver by device copies instead). The first
//! repetition's decodes (every frame of both steps) are compared bit for bit with the input,
//! and every decode's verdicts are checked.
//!
//! CIERA_TRACE: the trace folder (default ../shared/traces/olmoe-mini-s0, else the slice in
//! tests/data); CIERA_GPU_BENCH_MIB (256), CIERA_GPU_BENCH_JOB (elements per job, 1048576:
//! many frames per batch, so the one-block steps of each frame overlap), CIERA_BENCH_REPS (5).
//! Without a GPU it prints "no GPU: <why>" and exits 0 (1 with CIERA_REQUIRE_GPU=1, as
//! bench/gpu_check.sh runs it); it exits 1 if a row failed (the row says why).

#[path = "../tests/common/trace_data.rs"]
mod trace_data;

use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ciera::codec::{CacheMode, CacheSlot, FrameChoice, FrameInfo, Mode};
use ciera::gpu::codec::{self as gpu, DeviceDecJob, DeviceEncJob, GpuCodec};
use ciera::safetensors::SafeTensors;
use ciera::DType;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};

type Res<T> = Result<T, Box<dyn Error>>;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&v| v > 0)
        .unwrap_or(default)
}

fn trace_dir() -> PathBuf {
    match std::env::var("CIERA_TRACE") {
        Ok(p) => p.into(),
        Err(_) => trace_data::trace_dir(),
    }
}

/// The step numbers of the trace's snapshots (`step_NNNNN.safetensors`), ascending.
fn steps(dir: &Path) -> Vec<u64> {
    let mut v: Vec<u64> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let name = e.ok()?.file_name().to_string_lossy().into_owned();
            name.strip_prefix("step_")?
                .strip_suffix(".safetensors")?
                .parse()
                .ok()
        })
        .collect();
    v.sort_unstable();
    v
}

/// Pairs of consecutive steps: peak LR, mid decay and the end where the trace has them,
/// else the first consecutive pair.
fn pairs(steps: &[u64]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = [(101, 102), (301, 302), (598, 599)]
        .into_iter()
        .filter(|(a, b)| steps.contains(a) && steps.contains(b))
        .collect();
    if out.is_empty() {
        out.extend(
            steps
                .windows(2)
                .find(|w| w[1] == w[0] + 1)
                .map(|w| (w[0], w[1])),
        );
    }
    out
}

/// Every tensor of `dtype` in snapshot `step` (fp16: the fp32 ones, cast), by name, one after
/// another.
fn snapshot(dir: &Path, step: u64, dtype: DType) -> Res<Vec<u8>> {
    let st = SafeTensors::open(&dir.join(format!("step_{step:05}.safetensors")))?;
    let stored = if dtype == DType::F16 {
        DType::F32
    } else {
        dtype
    };
    let mut tensors: Vec<_> = st.tensors.iter().filter(|t| t.dtype == stored).collect();
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    let mut out = Vec::new();
    for t in tensors {
        let b = st.bytes(t);
        if dtype == DType::F16 {
            out.extend(b.chunks_exact(4).flat_map(|c| {
                trace_data::f32_to_f16(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes()
            }));
        } else {
            out.extend_from_slice(b);
        }
    }
    if out.is_empty() {
        return Err(format!("no {stored} tensors in step {step}").into());
    }
    Ok(out)
}

/// A run's delta caches, if any: every job's contexts, their Delta scratch and its stride.
type DeltaBufs<'a> = Option<(&'a mut CudaSlice<u8>, &'a mut CudaSlice<u8>, usize)>;

/// A run's shape: `jobs` jobs of `job` elements, each job's cache, frame and scratch at a
/// stride; the cache holds exponents, or (`full`) the previous values.
struct Layout {
    dtype: DType,
    full: bool,
    jobs: usize,
    job: usize,
    cache_stride: usize,
    frame_stride: usize,
    enc_stride: usize,
    dec_stride: usize,
}

impl Layout {
    fn new(dtype: DType, full: bool, bytes: usize, job: usize) -> Layout {
        let jobs = bytes.div_ceil(job * dtype.size()).max(1);
        Layout {
            dtype,
            full,
            jobs,
            job,
            cache_stride: gpu::cache_bytes(dtype, job, full),
            frame_stride: gpu::max_frame_bytes(dtype, job).next_multiple_of(gpu::ALIGN),
            enc_stride: gpu::enc_scratch_bytes(job, full).next_multiple_of(gpu::ALIGN),
            dec_stride: gpu::dec_scratch_bytes(job).next_multiple_of(gpu::ALIGN),
        }
    }
    /// Each job's delta cache, from `delta`'s contexts and Delta scratch (at stride `.2`),
    /// or None for every job.
    fn deltas<'a>(&self, delta: DeltaBufs<'a>) -> Vec<Option<gpu::DeviceDelta<'a>>> {
        match delta {
            Some((ctx, scratch, stride)) => ctx
                .as_view_mut()
                .chunks_exact_mut(self.job)
                .zip(scratch.as_view_mut().chunks_exact_mut(stride))
                .map(|(ctx, scratch)| Some(gpu::DeviceDelta { ctx, scratch }))
                .collect(),
            None => (0..self.jobs).map(|_| None).collect(),
        }
    }
    fn elements(&self) -> usize {
        self.jobs * self.job
    }
    fn bytes(&self) -> usize {
        self.elements() * self.dtype.size()
    }
}

/// The device buffers of a run.
struct Buffers {
    cache_tx: CudaSlice<u8>,
    cache_rx: CudaSlice<u8>,
    frames: CudaSlice<u8>,
    enc_scratch: CudaSlice<u8>,
    dec_scratch: CudaSlice<u8>,
    out: CudaSlice<u8>,
}

/// Timing events around the kernels of one batch.
struct Timer {
    start: CudaEvent,
    end: CudaEvent,
}

impl Timer {
    fn new(g: &GpuCodec) -> Res<Timer> {
        let ctx = g.context();
        Ok(Timer {
            start: ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
            end: ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
        })
    }
    fn seconds(&self) -> Res<f64> {
        Ok(f64::from(self.start.elapsed_ms(&self.end)?) / 1e3)
    }
}

/// A run's codec, stream and shape.
struct Runner<'a> {
    g: &'a GpuCodec,
    s: Arc<CudaStream>,
    l: &'a Layout,
}

impl Runner<'_> {
    /// Encode `input` as one batch (timed by `timer` when given, the kernels alone).
    fn encode(
        &self,
        input: &CudaSlice<u8>,
        b: &mut Buffers,
        version: u64,
        cold: bool,
        timer: Option<&Timer>,
    ) -> Res<Vec<FrameInfo>> {
        self.encode_into(input, b, None, version, cold, timer)
    }

    /// [`Runner::encode`], with delta caches (Delta frames) when `delta` gives their contexts
    /// and Delta frame scratch (per job at strides `l.job` and the given one).
    fn encode_into(
        &self,
        input: &CudaSlice<u8>,
        b: &mut Buffers,
        delta: DeltaBufs<'_>,
        version: u64,
        cold: bool,
        timer: Option<&Timer>,
    ) -> Res<Vec<FrameInfo>> {
        let (g, s, l) = (self.g, &self.s, self.l);
        let size = l.dtype.size();
        let iv = input.as_view();
        let choice = if delta.is_some() {
            FrameChoice::Delta
        } else {
            FrameChoice::Auto
        };
        let mut deltas = l.deltas(delta);
        let mut jobs: Vec<DeviceEncJob<'_>> = iv
            .chunks_exact(l.job * size)
            .zip(b.cache_tx.as_view_mut().chunks_exact_mut(l.cache_stride))
            .zip(b.frames.as_view_mut().chunks_exact_mut(l.frame_stride))
            .zip(b.enc_scratch.as_view_mut().chunks_exact_mut(l.enc_stride))
            .zip(deltas.iter_mut())
            .enumerate()
            .map(
                |(j, ((((input, cache), frame), scratch), d))| DeviceEncJob {
                    input,
                    cache,
                    frame,
                    scratch,
                    offset: (j * l.job) as u64,
                    version,
                    cold,
                    full: l.full,
                    choice,
                    delta: d.take(),
                },
            )
            .collect();
        {
            let batch = g.prepare_encode(s, l.dtype, &mut jobs)?;
            if let Some(t) = timer {
                t.start.record(s)?;
            }
            batch.launch()?;
            if let Some(t) = timer {
                t.end.record(s)?;
            }
        }
        Ok(g.encode_results(s, l.dtype, &jobs)?)
    }

    /// Decode the frames `infos` describe (in `b.frames`) as one batch; Err if any is
    /// refused.
    fn decode(
        &self,
        infos: &[FrameInfo],
        b: &mut Buffers,
        version: u64,
        warm: bool,
        timer: Option<&Timer>,
    ) -> Res<()> {
        self.decode_into(infos, b, None, version, warm, timer)
    }

    /// [`Runner::decode`], into delta caches when `delta` gives their contexts and Delta model
    /// scratch (per job at strides `l.job` and `delta_stride`).
    fn decode_into(
        &self,
        infos: &[FrameInfo],
        b: &mut Buffers,
        delta: DeltaBufs<'_>,
        version: u64,
        warm: bool,
        timer: Option<&Timer>,
    ) -> Res<()> {
        let (g, s, l) = (self.g, &self.s, self.l);
        let size = l.dtype.size();
        let frames = &b.frames;
        let mut deltas = l.deltas(delta);
        let mut jobs: Vec<DeviceDecJob<'_>> = b
            .out
            .as_view_mut()
            .chunks_exact_mut(l.job * size)
            .zip(b.cache_rx.as_view_mut().chunks_exact_mut(l.cache_stride))
            .zip(b.dec_scratch.as_view_mut().chunks_exact_mut(l.dec_stride))
            .zip(infos)
            .zip(deltas.iter_mut())
            .enumerate()
            .map(|(j, ((((out, cache), scratch), info), d))| DeviceDecJob {
                frame: frames.slice(j * l.frame_stride..j * l.frame_stride + info.frame_bytes),
                out,
                cache,
                scratch,
                offset: (j * l.job) as u64,
                version,
                warm,
                full: l.full,
                delta: d.take(),
            })
            .collect();
        {
            let batch = g.prepare_decode(s, l.dtype, &mut jobs)?;
            if let Some(t) = timer {
                t.start.record(s)?;
            }
            batch.launch()?;
            if let Some(t) = timer {
                t.end.record(s)?;
            }
        }
        for (j, v) in g.decode_results(s, l.dtype, &jobs)?.into_iter().enumerate() {
            v.map_err(|e| format!("job {j}: the GPU refused its frame: {e}"))?;
        }
        Ok(())
    }
}

/// One table row: best seconds per encode, decode and copy, the compression ratio, and the
/// frames that were FILLs and Hybrids.
struct Row {
    enc: f64,
    dec: f64,
    copy: f64,
    ratio: f64,
    fills: usize,
    hybrids: usize,
}

impl Row {
    /// Before the first repetition: every time infinite (each repetition keeps the least).
    fn new() -> Row {
        Row {
            enc: f64::INFINITY,
            dec: f64::INFINITY,
            copy: f64::INFINITY,
            ratio: 0.0,
            fills: 0,
            hybrids: 0,
        }
    }

    /// The ratio, FILLs and Hybrid frames of one repetition's frames.
    fn count(&mut self, infos: &[FrameInfo]) {
        let raw: usize = infos.iter().map(|i| i.raw_bytes).sum();
        let framed: usize = infos.iter().map(|i| i.frame_bytes).sum();
        self.ratio = raw as f64 / framed as f64;
        self.fills = infos.iter().filter(|i| i.fill).count();
        self.hybrids = infos.iter().filter(|i| i.mode == Mode::Hybrid).count();
    }

    /// The baseline of one repetition: `src` copied device to device into `dst`, timed.
    fn time_copy(
        &mut self,
        s: &Arc<CudaStream>,
        tc: &Timer,
        src: &CudaSlice<u8>,
        dst: &mut CudaSlice<u8>,
    ) -> Res<()> {
        tc.start.record(s)?;
        s.memcpy_dtod(src, dst)?;
        tc.end.record(s)?;
        self.copy = self.copy.min(tc.seconds()?);
        Ok(())
    }
}

fn run(g: &GpuCodec, l: &Layout, x0: &[u8], x1: &[u8], reps: usize) -> Res<Row> {
    let r = Runner {
        g,
        s: g.stream().clone(),
        l,
    };
    let s = &r.s;
    let d0 = s.clone_htod(x0)?;
    let d1 = s.clone_htod(x1)?;
    let mut copy_dst = s.alloc_zeros::<u8>(l.bytes())?;
    let mut b = Buffers {
        cache_tx: s.alloc_zeros(l.jobs * l.cache_stride)?,
        cache_rx: s.alloc_zeros(l.jobs * l.cache_stride)?,
        frames: s.alloc_zeros(l.jobs * l.frame_stride)?,
        enc_scratch: s.alloc_zeros(l.jobs * l.enc_stride)?,
        dec_scratch: s.alloc_zeros(l.jobs * l.dec_stride)?,
        out: s.alloc_zeros(l.bytes())?,
    };
    let (te, td, tc) = (Timer::new(g)?, Timer::new(g)?, Timer::new(g)?);
    let version = 1;

    // Prime both caches with step a: a FILL, decoded.
    let infos = r.encode(&d0, &mut b, version, true, None)?;
    if !infos.iter().all(|i| i.fill) {
        return Err("a cold slot's frames are not all FILLs".into());
    }
    r.decode(&infos, &mut b, version, false, None)?;
    if s.clone_dtoh(&b.out)? != x0 {
        return Err("the FILL frames decode to other values".into());
    }

    let mut row = Row::new();
    for rep in 0..reps {
        // Step b against a: timed.
        let infos = r.encode(&d1, &mut b, version, false, Some(&te))?;
        row.enc = row.enc.min(te.seconds()?);
        r.decode(&infos, &mut b, version, true, Some(&td))?;
        row.dec = row.dec.min(td.seconds()?);
        row.count(&infos);
        if rep == 0 {
            if s.clone_dtoh(&b.out)? != x1 {
                return Err("decoded values differ from the input".into());
            }
            if s.clone_dtoh(&b.cache_rx)? != s.clone_dtoh(&b.cache_tx)? {
                return Err("decoder and encoder caches differ".into());
            }
        }
        // Step a against b (untimed): both caches hold a again.
        let back = r.encode(&d0, &mut b, version, false, None)?;
        r.decode(&back, &mut b, version, true, None)?;
        if rep == 0 && s.clone_dtoh(&b.out)? != x0 {
            return Err("decoded values differ from the input (reverse step)".into());
        }
        // The baseline: the same bytes copied device to device.
        row.time_copy(s, &tc, &d1, &mut copy_dst)?;
    }
    Ok(row)
}

/// A delta cache's row: Delta frames encoded on the device (a FILL of step a, then step b
/// against it, `FrameChoice::Delta`) and decoded there into delta caches, both timed; before
/// each repetition both sides' values and contexts are put back to step a (untimed device
/// copies). The first repetition's frames are compared byte for byte with the CPU's
/// (`CacheSlot`, the same jobs as chunks), and its decode with the input and the CPU
/// receiver's values and contexts.
fn run_delta(g: &GpuCodec, l: &Layout, x0: &[u8], x1: &[u8], reps: usize) -> Res<Row> {
    let r = Runner {
        g,
        s: g.stream().clone(),
        l,
    };
    let s = &r.s;
    let size = l.dtype.size();
    let dstride = gpu::delta_scratch_bytes(l.job).next_multiple_of(gpu::ALIGN);
    let estride = gpu::enc_delta_scratch_bytes(l.job).next_multiple_of(gpu::ALIGN);
    let mut b = Buffers {
        cache_tx: s.alloc_zeros(l.jobs * l.cache_stride)?,
        cache_rx: s.alloc_zeros(l.jobs * l.cache_stride)?,
        frames: s.alloc_zeros(l.jobs * l.frame_stride)?,
        enc_scratch: s.alloc_zeros(l.jobs * l.enc_stride)?,
        dec_scratch: s.alloc_zeros(l.jobs * l.dec_stride)?,
        out: s.alloc_zeros(l.bytes())?,
    };
    let (mut ctx_tx, mut ctx_rx) = (
        s.alloc_zeros::<u8>(l.elements())?,
        s.alloc_zeros::<u8>(l.elements())?,
    );
    let mut escratch = s.alloc_zeros::<u8>(l.jobs * estride)?;
    let mut dscratch = s.alloc_zeros::<u8>(l.jobs * dstride)?;
    // The CPU's side, for reference: step a, then step b's frames and its receiver.
    let mut tx = CacheSlot::new(l.dtype, CacheMode::Delta, l.elements());
    tx.set_frame_choice(FrameChoice::Delta);
    let mut rx = CacheSlot::new(l.dtype, CacheMode::Delta, l.elements());
    let mut cpu_frames = |x: &[u8], rx: &mut CacheSlot| -> Res<Vec<Vec<u8>>> {
        let mut frames = Vec::new();
        let mut infos = Vec::new();
        for (j, c) in tx.chunks(l.job).iter_mut().enumerate() {
            let mut f = Vec::new();
            infos.push(c.encode(&x[j * l.job * size..(j + 1) * l.job * size], &mut f)?);
            frames.push(f);
        }
        tx.commit(&infos)?;
        let mut out = vec![0u8; x.len()];
        let mut rinfos = Vec::new();
        for (j, c) in rx.chunks(l.job).iter_mut().enumerate() {
            let f = ciera::codec::frame::parse(&frames[j])?;
            rinfos.push(c.decode(&f, &mut out[j * l.job * size..(j + 1) * l.job * size])?);
        }
        rx.commit(&rinfos)?;
        Ok(frames)
    };
    let cpu0 = cpu_frames(x0, &mut rx)?;
    let cpu1 = cpu_frames(x1, &mut rx)?;
    // The slot versions the frames carry (a slot's version moves on after each frame).
    let version_of = |f: &[u8]| u64::from_le_bytes(f[24..32].try_into().unwrap());
    let (v0, version) = (version_of(&cpu0[0]), version_of(&cpu1[0]));
    // The device: step a as FILLs (a cold slot), decoded.
    let (d0, d1) = (s.clone_htod(x0)?, s.clone_htod(x1)?);
    let i0 = r.encode_into(
        &d0,
        &mut b,
        Some((&mut ctx_tx, &mut escratch, estride)),
        v0,
        true,
        None,
    )?;
    r.decode_into(
        &i0,
        &mut b,
        Some((&mut ctx_rx, &mut dscratch, dstride)),
        version,
        false,
        None,
    )?;
    if s.clone_dtoh(&b.out)? != x0 {
        return Err("the FILL frames decode to other values".into());
    }
    let saved = [
        s.clone_dtod(&b.cache_tx)?,
        s.clone_dtod(&ctx_tx)?,
        s.clone_dtod(&b.cache_rx)?,
        s.clone_dtod(&ctx_rx)?,
    ];
    let (te, td, tc) = (Timer::new(g)?, Timer::new(g)?, Timer::new(g)?);
    let mut copy_dst = s.alloc_zeros::<u8>(l.bytes())?;
    let mut row = Row::new();
    for rep in 0..reps {
        s.memcpy_dtod(&saved[0], &mut b.cache_tx)?;
        s.memcpy_dtod(&saved[1], &mut ctx_tx)?;
        s.memcpy_dtod(&saved[2], &mut b.cache_rx)?;
        s.memcpy_dtod(&saved[3], &mut ctx_rx)?;
        let i1 = r.encode_into(
            &d1,
            &mut b,
            Some((&mut ctx_tx, &mut escratch, estride)),
            version,
            false,
            Some(&te),
        )?;
        row.enc = row.enc.min(te.seconds()?);
        r.decode_into(
            &i1,
            &mut b,
            Some((&mut ctx_rx, &mut dscratch, dstride)),
            version,
            true,
            Some(&td),
        )?;
        row.dec = row.dec.min(td.seconds()?);
        row.count(&i1);
        if rep == 0 {
            let frames = s.clone_dtoh(&b.frames)?;
            for (j, (info, c)) in i1.iter().zip(&cpu1).enumerate() {
                let gf = &frames[j * l.frame_stride..j * l.frame_stride + info.frame_bytes];
                if gf != &c[..] {
                    return Err(format!("job {j}: the GPU's frame differs from the CPU's").into());
                }
            }
            if s.clone_dtoh(&b.out)? != x1 {
                return Err("decoded values differ from the input".into());
            }
            let (vals, ctx) = (s.clone_dtoh(&b.cache_rx)?, s.clone_dtoh(&ctx_rx)?);
            if Some(&vals[..]) != rx.values() || Some(&ctx[..]) != rx.contexts() {
                return Err("the GPU receiver's values or contexts differ from the CPU's".into());
            }
            if s.clone_dtoh(&b.cache_tx)? != vals || s.clone_dtoh(&ctx_tx)? != ctx {
                return Err(
                    "the GPU encoder's values or contexts differ from its receiver's".into(),
                );
            }
        }
        row.time_copy(s, &tc, &d1, &mut copy_dst)?;
    }
    Ok(row)
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` would pass nothing: run only when asked.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let g = match gpu::device() {
        Ok(g) => g,
        Err(e) => {
            println!("no GPU: {e}");
            if std::env::var("CIERA_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                std::process::exit(1); // the device check asked for one
            }
            return;
        }
    };
    let dir = trace_dir();
    let mib = env_usize("CIERA_GPU_BENCH_MIB", 256);
    let job = env_usize("CIERA_GPU_BENCH_JOB", 1 << 20);
    let reps = env_usize("CIERA_BENCH_REPS", 5);
    let (dmaj, dmin) = g.driver_version();
    println!(
        "GPU codec bench: {} ({}, driver {dmaj}.{dmin}), >= {mib} MiB per run in jobs of {job} \
         elements, best of {reps}, trace {}",
        g.name(),
        g.arch(),
        dir.display()
    );
    let steps = steps(&dir);
    let pairs = pairs(&steps);
    if pairs.is_empty() {
        println!("error: no consecutive snapshots in {}", dir.display());
        std::process::exit(1);
    }
    let mut failed = 0;
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let l = Layout::new(dtype, false, mib << 20, job);
        println!(
            "\n{dtype}: {} MiB per run, {} jobs of {} elements",
            l.bytes() >> 20,
            l.jobs,
            l.job
        );
        println!(
            "{:<19} {:>7} {:>5} {:>5} | {:>9} {:>7} | {:>9} {:>7} | {:>9}",
            "cache  steps",
            "ratio",
            "FILL",
            "Hyb",
            "enc GB/s",
            "x copy",
            "dec GB/s",
            "x copy",
            "copy GB/s"
        );
        for (cache, &(a, b)) in ["exp", "full", "delta"]
            .into_iter()
            .flat_map(|c| pairs.iter().map(move |p| (c, p)))
        {
            let l = Layout::new(dtype, cache != "exp", mib << 20, job);
            let label = format!("{cache:<6} {a}->{b}");
            let row = snapshot(&dir, a, dtype)
                .and_then(|s0| Ok((s0, snapshot(&dir, b, dtype)?)))
                .and_then(|(s0, s1)| {
                    let tile = |v: &[u8]| -> Vec<u8> {
                        v.iter().copied().cycle().take(l.bytes()).collect()
                    };
                    let (x0, x1) = (tile(&s0), tile(&s1));
                    if cache == "delta" {
                        run_delta(&g, &l, &x0, &x1, reps)
                    } else {
                        run(&g, &l, &x0, &x1, reps)
                    }
                });
            match row {
                Ok(r) => {
                    let gbs = |t: f64| l.bytes() as f64 / t / 1e9;
                    let (e, d, c) = (gbs(r.enc), gbs(r.dec), gbs(r.copy));
                    println!(
                        "{label:<19} {:>7.3} {:>5} {:>5} | {e:>9.1} {:>7.3} | {d:>9.1} {:>7.3} | \
                         {c:>9.1}",
                        r.ratio,
                        r.fills,
                        r.hybrids,
                        e / c,
                        d / c
                    );
                }
                Err(e) => {
                    failed += 1;
                    println!("{label:<19} error: {e}");
                }
            }
        }
    }
    println!(
        "\ncache: exp (exponents, Exp frames) or full (previous values, Exp or Hybrid as the \
         CPU chooses); GB/s: uncompressed bytes per second of the kernels alone (CUDA events); \
         x copy: against cuMemcpyDtoDAsync of the same bytes; every decode checked (bit-exact \
         on the first repetition, the kernels' verdicts on all); delta: Delta frames encoded \
         on the device (forced Delta; the first repetition's equal to the CPU's byte for byte), \
         decoded into delta caches"
    );
    if failed > 0 {
        println!("{failed} row(s) failed");
        std::process::exit(1);
    }
}
