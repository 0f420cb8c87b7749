//! `ciera sim`: project FSDP training of an MoE model with CIERA's Allgather (and the
//! alternatives) from 8 to 1024 GPUs, and `ciera sim --validate DIR`: the same Allgather model
//! configured as this machine's runs, side by side with what `ciera perf --trace` measured
//! (bench/sim_validate.sh writes DIR). The model is in `crate::sim`; this file measures what it
//! needs here (codec ratios and, for validation, codec throughput on this host's cores) and
//! prints.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::args::Args;
use super::perf_trace::{fill_tiled, pick_tensor, windows};
use crate::codec::{CacheMode, CacheSlot};
use crate::error::{Error, Result};
use crate::safetensors::SafeTensors;
use crate::sim::model::ModelSpec;
use crate::sim::net::{
    self, Cluster, Codec, CodecHost, Compression, Hops, HostCpu, Link, Schedule,
};
use crate::sim::svg::{Plot, Series};
use crate::sim::train::{self, UnitCost};
use crate::sim::{cluster_presets, gather_time, Method, MethodInputs};
use crate::DType;

const USAGE: &str = "usage: ciera sim [options]            project training to 8..1024 GPUs
       ciera sim --validate DIR [options] the Allgather model against runs measured here

Projection (every assumption is printed with the table):
  --model NAME|FILE     olmoe-1b-7b (default), mixtral-8x7b, deepseek-moe-16b, qwen2-57b-a14b,
                        or a `key = value` file (see docs/SIM.md)
  --cluster NAME        h100-ib400 (default), h200-ib400, a100-ib200, a100-ib200x1, h100-eth100
  --gpus-per-node N, --nics-per-node N, --nic-gbit G, --nvlink-gbs G   override the preset
  --gpus LIST           GPU counts (default 8,16,32,64,128,256,512,1024)
  --seq N               sequence length (default 4096)
  --batch N             sequences per GPU per step (default 2)
  --mfu F               model FLOPs utilisation of the compute (default 0.3)
  --tflops F            the GPU's dense bf16 peak (default: the cluster preset's)
  --no-prefetch         gathers not overlapped with compute
  --trace DIR           trace the ratios are measured on (default ../shared/traces/olmoe-mini-s0,
                        else the bundled tests/data/olmoe-slice)
  --step N              the window of the trace holding step N (default 100: peak learning rate)
  --gpu-codec-gbs G     CIERA's GPU codec throughput, exponent cache (default 400: assumed, no GPU
                        measurement exists); full-value frames run at 3/4 of it, Delta at 3/8
  --svg FILE            write the plot (default sim.svg)
  --json                one object per GPU count and method

Validation:
  --validate DIR        DIR/runs.jsonl: `ciera perf --trace --json` rows with the run's rate_gbit,
                        nodes, ranks_per_node, algo and trace (bench/sim_validate.sh writes it)
  --cores N             cores of the machine the runs shared (default: this machine's)";

pub fn main(args: &[String]) -> i32 {
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return 0;
    }
    let o = match parse(args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("ciera sim: {e}\n\n{USAGE}");
            return 2;
        }
    };
    let r = match &o.validate {
        Some(dir) => validate(&o, dir),
        None => project(&o),
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("ciera sim: {e}");
            1
        }
    }
}

#[derive(Clone, Debug)]
struct Opts {
    model: String,
    cluster: String,
    gpus_per_node: Option<usize>,
    nics_per_node: Option<usize>,
    nic_gbit: Option<f64>,
    nvlink_gbs: Option<f64>,
    gpus: Vec<usize>,
    seq: usize,
    batch: usize,
    mfu: f64,
    tflops: Option<f64>,
    prefetch: bool,
    trace: Option<PathBuf>,
    step: u64,
    gpu_codec_gbs: f64,
    svg: PathBuf,
    json: bool,
    validate: Option<PathBuf>,
    cores: Option<f64>,
}

fn parse(args: &[String]) -> std::result::Result<Opts, String> {
    let mut o = Opts {
        model: "olmoe-1b-7b".into(),
        cluster: "h100-ib400".into(),
        gpus_per_node: None,
        nics_per_node: None,
        nic_gbit: None,
        nvlink_gbs: None,
        gpus: (3..=10).map(|p| 1usize << p).collect(),
        seq: 4096,
        batch: 2,
        mfu: 0.3,
        tflops: None,
        prefetch: true,
        trace: None,
        step: 100,
        gpu_codec_gbs: 400.0,
        svg: PathBuf::from("sim.svg"),
        json: false,
        validate: None,
        cores: None,
    };
    let mut a = Args::new(args);
    while let Some(f) = a.next_flag("") {
        match f.as_str() {
            "--model" => o.model = a.value(&f)?,
            "--cluster" => o.cluster = a.value(&f)?,
            "--gpus-per-node" => o.gpus_per_node = Some(positive(a.value_parsed(&f)?, &f)?),
            "--nics-per-node" => o.nics_per_node = Some(positive(a.value_parsed(&f)?, &f)?),
            "--nic-gbit" => o.nic_gbit = Some(positive_f(a.value_parsed(&f)?, &f)?),
            "--nvlink-gbs" => o.nvlink_gbs = Some(positive_f(a.value_parsed(&f)?, &f)?),
            "--gpus" => {
                let v = a.value(&f)?;
                o.gpus = v
                    .split(',')
                    .map(|s| {
                        s.trim()
                            .parse::<usize>()
                            .ok()
                            .filter(|&g| g > 0)
                            .ok_or_else(|| format!("--gpus: {s:?} is not a GPU count"))
                    })
                    .collect::<std::result::Result<_, _>>()?;
            }
            "--seq" => o.seq = positive(a.value_parsed(&f)?, &f)?,
            "--batch" => o.batch = positive(a.value_parsed(&f)?, &f)?,
            "--mfu" => {
                o.mfu = a.value_parsed(&f)?;
                if !(o.mfu > 0.0 && o.mfu <= 1.0) {
                    return Err(format!("--mfu {} is not in (0, 1]", o.mfu));
                }
            }
            "--tflops" => o.tflops = Some(positive_f(a.value_parsed(&f)?, &f)?),
            "--no-prefetch" => o.prefetch = false,
            "--trace" => o.trace = Some(PathBuf::from(a.value(&f)?)),
            "--step" => o.step = a.value_parsed(&f)?,
            "--gpu-codec-gbs" => o.gpu_codec_gbs = positive_f(a.value_parsed(&f)?, &f)?,
            "--svg" => o.svg = PathBuf::from(a.value(&f)?),
            "--json" => o.json = true,
            "--validate" => o.validate = Some(PathBuf::from(a.value(&f)?)),
            "--cores" => o.cores = Some(positive_f(a.value_parsed(&f)?, &f)?),
            other => return Err(format!("unknown option '{other}'")),
        }
    }
    Ok(o)
}

fn positive(v: usize, flag: &str) -> std::result::Result<usize, String> {
    if v == 0 {
        return Err(format!("{flag} must be at least 1"));
    }
    Ok(v)
}

fn positive_f(v: f64, flag: &str) -> std::result::Result<f64, String> {
    if !(v > 0.0 && v.is_finite()) {
        return Err(format!("{flag} must be a positive number"));
    }
    Ok(v)
}

/// The trace to measure on: the one given, the shared traces, or the bundled slice.
fn trace_dir(o: &Opts) -> PathBuf {
    if let Some(t) = &o.trace {
        return t.clone();
    }
    let shared = PathBuf::from("../shared/traces/olmoe-mini-s0");
    if shared.is_dir() {
        shared
    } else {
        PathBuf::from("tests/data/olmoe-slice")
    }
}

/// The window of consecutive steps holding `step`, or the one starting nearest to it.
fn window_at(dir: &Path, step: u64) -> Result<Vec<(u64, PathBuf)>> {
    let ws = windows(dir)?;
    if let Some(w) = ws.iter().find(|w| w.iter().any(|s| s.0 == step)) {
        return Ok(w.clone());
    }
    Ok(ws
        .into_iter()
        .min_by_key(|w| w[0].0.abs_diff(step))
        .expect("windows() returns at least one"))
}

/// `v` repeated to `len` bytes (whole elements of `es` bytes).
fn tiled(v: &[u8], len: usize, es: usize) -> Vec<u8> {
    let mut out = vec![0u8; len / es * es];
    fill_tiled(&mut out, v, 0);
    out
}

/// One codec's result on a sequence of steps: the ratio of the last step's frame and the
/// best encode / decode time of it over `reps` runs (fresh slots each run), in raw bytes/s.
#[derive(Clone, Copy, Debug)]
struct Coded {
    raw: f64,
    frame: f64,
    encode_bps: f64,
    decode_bps: f64,
}

fn code_steps(
    steps: &[Vec<u8>],
    dtype: DType,
    mode: CacheMode,
    reps: usize,
    what: &str,
) -> Result<Coded> {
    let n = steps[0].len() / dtype.size();
    let (mut enc, mut dec) = (f64::INFINITY, f64::INFINITY);
    let mut sizes = (0f64, 0f64);
    let mut frame = Vec::with_capacity(steps[0].len() + 4096);
    let mut out = vec![0u8; steps[0].len()];
    for _ in 0..reps.max(1) {
        let mut tx = CacheSlot::new(dtype, mode, n);
        let mut rx = CacheSlot::new(dtype, mode, n);
        for (i, x) in steps.iter().enumerate() {
            frame.clear();
            let t = Instant::now();
            let info = tx
                .encode(x, &mut frame)
                .map_err(|e| Error::InvalidArgument(format!("{what}: encode: {e}")))?;
            let te = t.elapsed().as_secs_f64();
            let t = Instant::now();
            rx.decode(&frame, &mut out)
                .map_err(|e| Error::InvalidArgument(format!("{what}: decode: {e}")))?;
            let td = t.elapsed().as_secs_f64();
            if out != *x {
                return Err(Error::InvalidArgument(format!(
                    "{what}: step {i} did not decode to its bits"
                )));
            }
            if i + 1 == steps.len() {
                enc = enc.min(te);
                dec = dec.min(td);
                sizes = (info.raw_bytes as f64, info.frame_bytes as f64);
            }
        }
    }
    Ok(Coded {
        raw: sizes.0,
        frame: sizes.1,
        encode_bps: sizes.0 / enc,
        decode_bps: sizes.0 / dec,
    })
}

/// The paper's per-block scheme on a bf16 / fp16 step: a block of 512 with any exponent
/// change is sent whole, else sign+mantissa only; one flag bit per block. Returns
/// (raw bytes, sent bytes).
fn block512(dtype: DType, prev: &[u8], cur: &[u8]) -> (f64, f64) {
    let es = dtype.size();
    let exp_mask: u32 = match dtype {
        DType::BF16 => 0x7f80,
        DType::F16 => 0x7c00,
        _ => 0x7f80_0000,
    };
    let exp_bits = match dtype {
        DType::BF16 => 8,
        DType::F16 => 5,
        _ => 8,
    };
    let val = |b: &[u8], i: usize| -> u32 {
        let mut v = 0u32;
        for k in 0..es {
            v |= (b[i * es + k] as u32) << (8 * k);
        }
        v
    };
    let n = cur.len() / es;
    let mut sent_bits = 0f64;
    for start in (0..n).step_by(512) {
        let end = (start + 512).min(n);
        let changed = (start..end).any(|i| (val(prev, i) ^ val(cur, i)) & exp_mask != 0);
        let per = if changed { 8 * es } else { 8 * es - exp_bits };
        sent_bits += ((end - start) * per) as f64 + 1.0;
    }
    (cur.len() as f64, sent_bits / 8.0)
}

/// Ratios of each CIERA cache mode and of the block scheme over all bf16 tensors of a window.
struct WindowRatios {
    steps: String,
    tensors: usize,
    exp: f64,
    full: f64,
    delta: f64,
    block512: f64,
}

fn window_ratios(dir: &Path, step: u64) -> Result<WindowRatios> {
    let w = window_at(dir, step)?;
    let snaps: Vec<SafeTensors> = w
        .iter()
        .map(|(_, p)| SafeTensors::open(p))
        .collect::<Result<_>>()?;
    let mut sums = [(0f64, 0f64); 4];
    let mut tensors = 0;
    for t in snaps[0].tensors.iter().filter(|t| t.dtype == DType::BF16) {
        let mut steps = Vec::new();
        for s in &snaps {
            let ti = s.get(&t.name).ok_or_else(|| Error::Format {
                path: s.path.clone(),
                detail: format!("no tensor {:?} (it is in {})", t.name, snaps[0].path),
            })?;
            steps.push(s.bytes(ti).to_vec());
        }
        tensors += 1;
        for (k, mode) in [CacheMode::Exponent, CacheMode::FullValue, CacheMode::Delta]
            .into_iter()
            .enumerate()
        {
            let c = code_steps(&steps, t.dtype, mode, 1, &t.name)?;
            sums[k].0 += c.raw;
            sums[k].1 += c.frame;
        }
        let (r, s) = block512(t.dtype, &steps[steps.len() - 2], &steps[steps.len() - 1]);
        sums[3].0 += r;
        sums[3].1 += s;
    }
    if tensors == 0 {
        return Err(Error::Format {
            path: dir.display().to_string(),
            detail: "no bf16 tensors to measure ratios on".into(),
        });
    }
    let r = |k: usize| sums[k].0 / sums[k].1;
    Ok(WindowRatios {
        steps: format!("{}-{}", w[0].0, w[w.len() - 1].0),
        tensors,
        exp: r(0),
        full: r(1),
        delta: r(2),
        block512: r(3),
    })
}

fn project(o: &Opts) -> Result<()> {
    let model = if let Some(m) = ModelSpec::preset(&o.model) {
        m
    } else if Path::new(&o.model).is_file() {
        ModelSpec::from_file(Path::new(&o.model)).map_err(Error::InvalidArgument)?
    } else {
        return Err(Error::InvalidArgument(format!(
            "--model {:?}: neither a preset ({}) nor a file",
            o.model,
            ModelSpec::preset_names().join(", ")
        )));
    };
    let presets = cluster_presets();
    let preset = presets
        .iter()
        .find(|p| p.name == o.cluster)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "--cluster {:?}: not a preset ({})",
                o.cluster,
                presets
                    .iter()
                    .map(|p| p.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
    let mut node = preset.cluster.clone();
    if let Some(g) = o.gpus_per_node {
        node.gpus_per_node = g;
    }
    if let Some(n) = o.nics_per_node {
        node.nics_per_node = n;
    }
    if let Some(g) = o.nic_gbit {
        node.inter = Link::gbit(g, crate::sim::NIC_EFF, node.inter.latency_s * 1e6);
    }
    if let Some(g) = o.nvlink_gbs {
        node.intra = Link::gbytes(g * crate::sim::NVLINK_EFF, node.intra.latency_s * 1e6);
    }
    let tflops = o.tflops.unwrap_or(preset.peak_tflops);
    let dir = trace_dir(o);
    let wr = window_ratios(&dir, o.step)?;
    let g = o.gpu_codec_gbs * 1e9;
    let inputs = MethodInputs {
        ratio_exp: wr.exp,
        ratio_full: wr.full,
        ratio_delta: wr.delta,
        ratio_block512: wr.block512,
        // int8 with one fp16 scale per 256 values, from bf16.
        ratio_int8: 2.0 * 256.0 / (256.0 + 2.0),
        ratio_dietgpu: 1.5,
        gpu_exp_bps: g,
        gpu_full_bps: g * 0.75,
        gpu_delta_bps: g * 0.375,
        gpu_int8_bps: 1000e9,
        gpu_dietgpu_bps: 400e9,
        chunk_bytes: crate::comm::DEFAULT_CHUNK_BYTES as f64,
    };
    let tokens = (o.seq * o.batch) as f64;
    let rate = tflops * 1e12 * o.mfu;
    let flops = model.unit_flops_per_token(o.seq);
    let units: Vec<UnitCost> = model
        .units()
        .into_iter()
        .zip(flops)
        .map(|(u, f)| UnitCost {
            gather_bytes: u.params as f64 * 2.0,
            forward_s: tokens * f / rate,
            name: u.name,
        })
        .collect();
    let mut notes = vec![
        format!("model: {}", model.describe()),
        format!(
            "cluster: {} ({}); {} GPUs per node, NVLink {:.0} GB/s per GPU achieved ({:.0}% of nominal), {} NIC(s) per node of {:.1} GB/s ({:.0}% of line rate), NIC latency {:.0} us",
            preset.name,
            preset.about,
            node.gpus_per_node,
            node.intra.bytes_per_s / 1e9,
            crate::sim::NVLINK_EFF * 100.0,
            node.nics_per_node,
            node.inter.bytes_per_s / 1e9,
            crate::sim::NIC_EFF * 100.0,
            node.inter.latency_s * 1e6
        ),
        format!(
            "training: FSDP full shard, one unit per block (+ embedding, + head), bf16 gathers; {} sequences of {} tokens per GPU; compute at {:.0} TFLOP/s x MFU {:.2}; {}; backward re-gathers, gradient reduce-scatter raw in bf16",
            o.batch,
            o.seq,
            tflops,
            o.mfu,
            if o.prefetch { "prefetch one unit ahead" } else { "no prefetch" }
        ),
        format!(
            "ratios measured on {} window {} ({} bf16 tensors): ciera-exp {:.2}, ciera-full {:.2}, ciera-delta {:.2}, block512 {:.2}; int8 {:.2} (lossy, one fp16 scale per 256); dietgpu {:.2} (as published for bf16)",
            dir.display(),
            wr.steps,
            wr.tensors,
            wr.exp,
            wr.full,
            wr.delta,
            wr.block512,
            inputs.ratio_int8,
            inputs.ratio_dietgpu
        ),
        format!(
            "GPU codec throughput ASSUMED (no GPU measurement exists yet): ciera-exp and block512 {:.0} GB/s, ciera-full {:.0}, ciera-delta {:.0}; int8 {:.0}; dietgpu {:.0} (its published 250-600 on A100)",
            inputs.gpu_exp_bps / 1e9,
            inputs.gpu_full_bps / 1e9,
            inputs.gpu_delta_bps / 1e9,
            inputs.gpu_int8_bps / 1e9,
            inputs.gpu_dietgpu_bps / 1e9
        ),
        "schedules: raw = the faster of NCCL's multi-channel ring and the hierarchical one; the codecs run hierarchical with frames on the inter-node hops only, and fall back to raw where that is faster (net-benefit choice)".to_string(),
    ];
    if !o.json {
        println!("# ciera sim: {} on {}", model.name, preset.name);
        for n in &notes {
            println!("# {n}");
        }
        print!(
            "{:>6} {:>6} {:>10} {:>10} {:>9}",
            "gpus", "nodes", "AG ms/it", "iter ms", "AG share"
        );
        for m in &Method::ALL[1..] {
            print!(" {:>18}", m.name());
        }
        println!();
        println!(
            "{:>6} {:>6} {:>10} {:>10} {:>9} {:>18}",
            "", "", "(raw)", "(raw)", "", "(iter x / AG x)"
        );
    }
    let mut series: Vec<Series> = Vec::new();
    for (k, m) in Method::ALL[1..].iter().enumerate() {
        for dashed in [false, true] {
            series.push(Series {
                name: format!(
                    "{} ({})",
                    m.name(),
                    if dashed { "Allgather" } else { "iteration" }
                ),
                points: Vec::new(),
                dashed,
                style: Some(k),
            });
        }
    }
    for &gpus in &o.gpus {
        let mut c = node.clone();
        if gpus < c.gpus_per_node {
            c.gpus_per_node = gpus;
            c.nodes = 1;
        } else {
            if !gpus.is_multiple_of(c.gpus_per_node) {
                return Err(Error::InvalidArgument(format!(
                    "--gpus {gpus} is not a multiple of {} GPUs per node",
                    c.gpus_per_node
                )));
            }
            c.nodes = gpus / c.gpus_per_node;
        }
        // Gradient reduce-scatters go raw for every method: one time per unit.
        let rs: Vec<f64> = units
            .iter()
            .map(|u| gather_time(&c, &inputs, Method::Raw, u.gather_bytes).0)
            .collect();
        let mut raw_it = None;
        let mut raw_ag = 0.0;
        let mut cells = Vec::new();
        for (mi, &m) in Method::ALL.iter().enumerate() {
            let it = train::iteration(
                &units,
                o.prefetch,
                |u| gather_time(&c, &inputs, m, units[u].gather_bytes).0,
                |u| rs[u],
            );
            let (rit, rag): (train::Iteration, f64) = match raw_it {
                None => {
                    raw_it = Some(it);
                    raw_ag = it.gathers_s;
                    (it, it.gathers_s)
                }
                Some(r) => (r, raw_ag),
            };
            let (sx, ax) = (rit.total_s / it.total_s, rag / it.gathers_s.max(1e-30));
            if o.json {
                println!(
                    "{}",
                    serde_json::json!({
                        "model": model.name, "cluster": preset.name, "gpus": gpus, "nodes": c.nodes,
                        "method": m.name(), "iteration_s": it.total_s, "gathers_s": it.gathers_s,
                        "compute_s": it.compute_s, "exposed_s": it.exposed_s,
                        "reduce_scatters_s": it.reduce_scatters_s,
                        "iteration_speedup": sx, "allgather_speedup": ax,
                    })
                );
            }
            if mi > 0 {
                cells.push(format!("{sx:.2}x / {ax:.2}x"));
                series[2 * (mi - 1)].points.push((gpus as f64, sx));
                series[2 * (mi - 1) + 1].points.push((gpus as f64, ax));
            }
        }
        if !o.json {
            let r = raw_it.expect("raw runs first");
            print!(
                "{:>6} {:>6} {:>10.1} {:>10.1} {:>8.0}%",
                gpus,
                c.nodes,
                r.gathers_s * 1e3,
                r.total_s * 1e3,
                100.0 * r.exposed_s / r.total_s
            );
            for cell in &cells {
                print!(" {cell:>18}");
            }
            println!();
        }
    }
    notes.push(
        "solid: iteration speedup over raw; dashed: Allgather speedup over raw (sum of the gathers per iteration)"
            .into(),
    );
    let plot = Plot {
        title: format!(
            "{} on {}: speedup over uncompressed Allgather",
            model.name, preset.name
        ),
        x_label: "GPUs".into(),
        y_label: "speedup over raw".into(),
        log2_x: true,
        series,
        notes,
    };
    std::fs::write(&o.svg, plot.to_svg()).map_err(|e| Error::Io {
        what: format!("writing {}", o.svg.display()),
        source: e,
    })?;
    if !o.json {
        println!(
            "# AG share: the part of the raw iteration spent waiting on communication; plot: {}",
            o.svg.display()
        );
    }
    Ok(())
}

/// 4M, 16M, 64M, 512K: a size as the bench scripts spell it.
fn size_label(b: usize) -> String {
    if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{}M", b >> 20)
    } else if b >= 1 << 10 && b.is_multiple_of(1 << 10) {
        format!("{}K", b >> 10)
    } else {
        b.to_string()
    }
}

/// Rows whose predicted host CPU time reaches this share of their wire time are host-CPU-bound:
/// the model's `max(wire, CPU)` is a lower bound there (`validate` counts them apart).
const HOST_BOUND: f64 = 0.75;

/// One measured row of bench/sim_validate.sh.
#[derive(Clone, Debug)]
struct Measured {
    nodes: usize,
    ranks_per_node: usize,
    algo: String,
    rate_gbit: f64,
    size: usize,
    mode: String,
    window: String,
    trace: PathBuf,
    time_s: f64,
    wire_ratio: f64,
    wrong: u64,
}

fn read_runs(dir: &Path) -> Result<Vec<Measured>> {
    let path = dir.join("runs.jsonl");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::Io {
        what: format!("reading {}", path.display()),
        source: e,
    })?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if !line.trim_start().starts_with('{') {
            continue;
        }
        let bad = |d: String| Error::Format {
            path: format!("{}:{}", path.display(), i + 1),
            detail: d,
        };
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        let num = |k: &str| v[k].as_f64().ok_or_else(|| bad(format!("no number {k:?}")));
        let s = |k: &str| {
            v[k].as_str()
                .map(str::to_string)
                .ok_or_else(|| bad(format!("no string {k:?}")))
        };
        out.push(Measured {
            nodes: num("nodes")? as usize,
            ranks_per_node: num("ranks_per_node")? as usize,
            algo: s("algo")?,
            rate_gbit: num("rate_gbit")?,
            size: num("size")? as usize,
            mode: s("mode")?,
            window: s("window")?,
            trace: PathBuf::from(s("trace")?),
            time_s: num("time_us")? * 1e-6,
            wire_ratio: num("wire_ratio")?,
            wrong: num("wrong")? as u64,
        });
    }
    if out.is_empty() {
        return Err(Error::Format {
            path: path.display().to_string(),
            detail: "no rows".into(),
        });
    }
    Ok(out)
}

/// TCP payload per byte tbf counts on a link of this MTU (IPv4, TCP timestamps, Ethernet
/// header): 8948 / 9014 on the shaped loopback and the nodes' veths (both use jumbo frames).
fn tcp_efficiency(mtu: f64) -> f64 {
    (mtu - 52.0) / (mtu + 14.0)
}

/// What moving a byte costs this host (bench/tcp_probe.py, written to DIR/probe.json by
/// bench/sim_validate.sh): one TCP stream's rate, unshaped, over the namespaces' loopback and
/// between two namespaced nodes; the cores' busy time per byte of a stream shaped to each of
/// the runs' rates; and one core's memcpy rate.
#[derive(Clone, Debug)]
struct HostRates {
    loopback_tcp_bps: f64,
    veth_tcp_bps: f64,
    /// (link: "loopback" or "veth", rate in Gbit/s, busy CPU seconds per byte, both sides).
    shaped: Vec<(String, f64, f64)>,
    memcpy_bps: f64,
}

impl HostRates {
    /// One unshaped stream's rate on `link` ("loopback", else between nodes).
    fn unshaped_bps(&self, link: &str) -> f64 {
        if link == "loopback" {
            self.loopback_tcp_bps
        } else {
            self.veth_tcp_bps
        }
    }

    /// CPU seconds a side spends per TCP byte on `link` at `rate_gbit`: half the cores' busy
    /// time per byte of a stream shaped to that rate where probed, else 1 / the unshaped rate
    /// (a stream bound by the cores).
    fn tcp_s_per_byte(&self, link: &str, rate_gbit: f64) -> f64 {
        self.shaped
            .iter()
            .find(|(l, g, _)| l == link && (g - rate_gbit).abs() <= 1e-9 * rate_gbit.max(1.0))
            .map(|(_, _, cpu)| cpu / 2.0)
            .unwrap_or_else(|| 1.0 / self.unshaped_bps(link))
    }
}

/// This machine's configuration for a measured row: a shaped loopback shared by all ranks
/// (one node), or nodes whose egress is shaped and whose ranks talk over shared memory. A TCP
/// byte costs a core what the probe measured on that link at that rate, on each side
/// (`HostRates::tcp_s_per_byte`); a shared-memory byte one memcpy on each side (into the ring,
/// out of it).
fn cluster_of(m: &Measured, cores: f64, h: &HostRates) -> Cluster {
    let shm_bps = h.memcpy_bps / 2.0;
    if m.nodes == 1 {
        let eff = tcp_efficiency(9000.0);
        let tcp = h.tcp_s_per_byte("loopback", m.rate_gbit);
        Cluster {
            name: "netns loopback".into(),
            gpus_per_node: m.ranks_per_node,
            nodes: 1,
            intra: Link::gbit(m.rate_gbit, eff, 50.0),
            intra_shared: Some(m.rate_gbit * 1e9 / 8.0 * eff),
            inter: Link::gbit(m.rate_gbit, eff, 50.0),
            nics_per_node: 1,
            codec: CodecHost::Cpu(HostCpu {
                cores_per_node: cores,
                intra_s_per_byte: tcp,
                inter_s_per_byte: tcp,
            }),
        }
    } else {
        Cluster {
            name: "netns nodes".into(),
            gpus_per_node: m.ranks_per_node,
            nodes: m.nodes,
            intra: Link::gbytes(shm_bps / 1e9, 10.0),
            intra_shared: None,
            inter: Link::gbit(m.rate_gbit, tcp_efficiency(9000.0), 100.0),
            nics_per_node: 1,
            codec: CodecHost::Cpu(HostCpu {
                cores_per_node: cores / m.nodes as f64,
                intra_s_per_byte: 1.0 / h.memcpy_bps,
                inter_s_per_byte: h.tcp_s_per_byte("veth", m.rate_gbit),
            }),
        }
    }
}

/// Copy rate of one core on this host (bytes/s): the shared-memory hop's rate.
fn memcpy_bps() -> f64 {
    let src = vec![1u8; 64 << 20];
    let mut dst = vec![0u8; 64 << 20];
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        best = best.min(t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    src.len() as f64 / best
}

fn host_rates(dir: &Path) -> Result<HostRates> {
    let path = dir.join("probe.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::Io {
        what: format!(
            "reading {} (bench/sim_validate.sh writes it)",
            path.display()
        ),
        source: e,
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Format {
        path: path.display().to_string(),
        detail: e.to_string(),
    })?;
    let rate = |k: &str| {
        v[k].as_f64()
            .filter(|x| *x > 0.0)
            .ok_or_else(|| Error::Format {
                path: path.display().to_string(),
                detail: format!("no positive number {k:?}"),
            })
    };
    // Shaped probes are optional (older probe files have none); each present one must be whole.
    let mut shaped = Vec::new();
    for (i, e) in v["shaped"].as_array().into_iter().flatten().enumerate() {
        let bad = |k: &str| Error::Format {
            path: path.display().to_string(),
            detail: format!("shaped[{i}]: no {k}"),
        };
        let link = e["link"].as_str().ok_or_else(|| bad("string \"link\""))?;
        let g = e["rate_gbit"]
            .as_f64()
            .filter(|x| *x > 0.0)
            .ok_or_else(|| bad("positive number \"rate_gbit\""))?;
        let cpu = e["cpu_s_per_byte"]
            .as_f64()
            .filter(|x| *x > 0.0)
            .ok_or_else(|| bad("positive number \"cpu_s_per_byte\""))?;
        shaped.push((link.to_string(), g, cpu));
    }
    Ok(HostRates {
        loopback_tcp_bps: rate("loopback_tcp_bps")?,
        veth_tcp_bps: rate("veth_tcp_bps")?,
        shaped,
        memcpy_bps: memcpy_bps(),
    })
}

fn validate(o: &Opts, dir: &Path) -> Result<()> {
    let runs = read_runs(dir)?;
    let cores = o.cores.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get() as f64)
            .unwrap_or(1.0)
    });
    let rates = host_rates(dir)?;
    println!(
        "# ciera sim --validate {}: {} measured rows; {cores} cores; memcpy {:.2} GB/s (a shm hop: half that); one TCP stream {:.2} GB/s on the loopback, {:.2} GB/s between nodes (probe.json)",
        dir.display(),
        runs.len(),
        rates.memcpy_bps / 1e9,
        rates.loopback_tcp_bps / 1e9,
        rates.veth_tcp_bps / 1e9,
    );
    for (link, g, cpu) in &rates.shaped {
        println!(
            "# a TCP byte on the {link} shaped to {g} Gbit/s costs the cores {:.2} ns (both sides; unshaped: {:.2})",
            cpu * 1e9,
            2e9 / rates.unshaped_bps(link)
        );
    }
    println!("# codec throughput measured here, one core, on each run's trace window tiled to the run's block; ratio likewise (the run's measured wire ratio beside it)");
    // Codec measurements per (trace, window, mode, block bytes).
    let mut codecs: BTreeMap<(PathBuf, String, String, usize), Coded> = BTreeMap::new();
    println!(
        "{:>5} {:>5} {:>5} {:>6} {:>6} {:>9} {:>9} | {:>6} {:>6} | {:>5} | {:>10} {:>10} {:>7}",
        "nodes",
        "ranks",
        "algo",
        "Gbit",
        "size",
        "mode",
        "window",
        "ratio",
        "wire",
        "cpu",
        "measured",
        "predicted",
        "error"
    );
    // [link-bound rows, host-CPU-bound rows]: (rows, within 10%, worst error).
    let mut classes = [(0usize, 0usize, 0f64); 2];
    let mut wrong = 0;
    for m in &runs {
        wrong += m.wrong;
        let n = m.nodes * m.ranks_per_node;
        let block = m.size / n;
        let cmode = match m.mode.as_str() {
            "raw" => None,
            "exp-on" | "exp" => Some(CacheMode::Exponent),
            "full-on" | "full" => Some(CacheMode::FullValue),
            "delta-on" | "delta" => Some(CacheMode::Delta),
            other => {
                return Err(Error::InvalidArgument(format!(
                    "mode {other:?} has no model (raw, exp-on, full-on, delta-on)"
                )))
            }
        };
        let comp = match cmode {
            None => None,
            Some(cm) => {
                let key = (m.trace.clone(), m.window.clone(), m.mode.clone(), block);
                let c = match codecs.get(&key) {
                    Some(c) => *c,
                    None => {
                        let c = measure_run_codec(m, cm, block)?;
                        codecs.insert(key, c);
                        c
                    }
                };
                Some(Compression {
                    codec: Codec {
                        ratio: c.raw / c.frame,
                        encode_bps: c.encode_bps,
                        decode_bps: c.decode_bps,
                    },
                    hops: Hops::All,
                    chunk_bytes: crate::comm::DEFAULT_CHUNK_BYTES as f64,
                })
            }
        };
        let c = cluster_of(m, cores, &rates);
        let sched = if m.nodes > 1 && m.algo == "hier" {
            Schedule::Hierarchical
        } else {
            Schedule::Ring { channels: 1 }
        };
        let p = net::allgather(&c, sched, m.size as f64, comp.as_ref());
        let err = (p.total_s - m.time_s) / m.time_s;
        // The host's cores: predicted busy time of a core (codec and moving bytes) per second
        // of wire time.
        let cpu = p.cpu_s / p.wire_s.max(1e-12);
        let class = &mut classes[(cpu >= HOST_BOUND) as usize];
        class.0 += 1;
        class.1 += (err.abs() <= 0.10) as usize;
        class.2 = class.2.max(err.abs());
        println!(
            "{:>5} {:>5} {:>5} {:>6} {:>6} {:>9} {:>9} | {:>6} {:>6.2} | {:>5.2} | {:>8.1}ms {:>8.1}ms {:>+6.1}%",
            m.nodes,
            n,
            if m.nodes > 1 { m.algo.as_str() } else { "ring" },
            m.rate_gbit,
            size_label(m.size),
            m.mode,
            m.window,
            comp.map(|k| format!("{:.2}", k.codec.ratio))
                .unwrap_or_else(|| "-".into()),
            m.wire_ratio,
            cpu,
            m.time_s * 1e3,
            p.total_s * 1e3,
            err * 100.0
        );
    }
    let [(ln, lw, lworst), (hn, hw, hworst)] = classes;
    println!(
        "# {}/{} rows within 10%; link-bound rows (cpu < {HOST_BOUND}): {lw}/{ln} within 10%, worst error {:.1}%; host-CPU-bound rows: {hw}/{hn}, worst {:.1}%; wrong elements in the runs: {wrong}",
        lw + hw,
        runs.len(),
        lworst * 100.0,
        hworst * 100.0
    );
    if hn > 0 {
        println!("# cpu: the predicted busy time of this host's cores (codec, moving bytes) per second of wire time. At {HOST_BOUND} and above the cores, which the kernel's TCP work, the ranks and the scheduler share, bind the call with the link: the model's max(wire, CPU) assumes they overlap perfectly, so it is a lower bound there. GPU clusters (GPU codec, DMA NICs) sit far below.");
    }
    Ok(())
}

/// The codec of a measured run: its trace window's steps, the run's tensor tiled to one rank's
/// block, coded in sequence; ratio and one-core throughput of the last step.
fn measure_run_codec(m: &Measured, mode: CacheMode, block: usize) -> Result<Coded> {
    let first: u64 = m
        .window
        .split('-')
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            Error::InvalidArgument(format!("window {:?} is not FIRST-LAST", m.window))
        })?;
    let w = window_at(&m.trace, first)?;
    let mut steps = Vec::new();
    let mut dtype = DType::BF16;
    for (_, p) in &w {
        let st = SafeTensors::open(p)?;
        let t = pick_tensor(&st, None)?;
        dtype = t.dtype;
        steps.push(tiled(st.bytes(t), block, t.dtype.size()));
    }
    code_steps(
        &steps,
        dtype,
        mode,
        3,
        &format!("{} {}", m.trace.display(), m.window),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block512_counts_whole_blocks_and_flags() {
        // 1024 bf16 values; one exponent change in the second block.
        let prev = vec![0u8; 2048];
        let mut cur = prev.clone();
        cur[2 * 600 + 1] = 0x01; // bit 8 of element 600: an exponent bit
        let (raw, sent) = block512(DType::BF16, &prev, &cur);
        assert_eq!(raw, 2048.0);
        assert_eq!(sent, (512.0 * 8.0 + 512.0 * 16.0 + 2.0) / 8.0);
    }

    #[test]
    fn tcp_efficiency_of_the_two_mtus() {
        assert_eq!(tcp_efficiency(9000.0), 8948.0 / 9014.0);
        assert_eq!(tcp_efficiency(1500.0), 1448.0 / 1514.0);
    }
}
