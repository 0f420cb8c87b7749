//! `ciera perf --trace DIR`: the compressed Allgather on real weights. Rank r sends slice r of
//! a trace tensor (tiled to the requested size) at step t; iterations walk the consecutive
//! steps of each window of the trace back and forth (every call is a real one-step delta; the
//! calls at the turns, which undo the previous move, are made and checked but not timed:
//! [`turns_back`]); every received bit is checked against the trace. For each window, size and
//! mode it prints time, busbw, the wire ratio and the speedup over the raw mode measured in the
//! same run.
//!
//! With `--layers L` an iteration gathers a model instead of one tensor, as FSDP gathers its
//! layers one after another: L layers, each every trace tensor of the chosen type, each its own
//! tensor (key) with its own caches, so the caches' demand is the sum over all of them and
//! `CIERA_CACHE_MB` decides which fit ([`run_model`]).

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::args::Args;
use super::ranks;
use crate::codec::{CacheMode, FrameChoice};
use crate::comm::{Communicator, Config};
use crate::compress::{CompressMode, GatherOptions};
use crate::error::{Error, Result};
use crate::safetensors::SafeTensors;
use crate::DType;

const USAGE: &str = "usage: ciera perf --trace DIR [options]

Replays a real training trace through the compressed Allgather and checks every bit.

  -n N                 ranks to launch on this host (as in `ciera perf`)
  --trace DIR          folder of step_NNNNN.safetensors snapshots (e.g. ../shared/traces/olmoe-mini-s0)
  --tensor NAME        tensor to replay (default: the first *.bf16 tensor; give the .f32 one for fp32)
  -b / -e / -f SIZE    total gathered sizes, as in `ciera perf` (default 16M..16M); the tensor is
                       tiled to the size
  -i, --iters N        timed calls per window, size and mode (default 10)
  -w, --warmup N       untimed calls first, those that fill caches included (default 3)
  --modes LIST         comma list of: auto (the configuration users get: CIERA_COMPRESS and
                       CIERA_CACHE_MODE as set, auto by default; the row says what it chose),
                       raw (CIERA_COMPRESS=off), exp (auto, exponent cache),
                       full (auto, full-value cache), delta (auto, delta cache: Delta frames
                       besides Exp and Hybrid), exp-on, full-on, delta-on (compression forced)
                       (default raw,exp,full)
  --stat mean|median   time statistic over calls (default mean; median resists a noisy host)
  --layers L           gather a model per iteration: L layers, each every trace tensor of the
                       type --tensor picks (bf16 by default), each its own tensor and caches,
                       one after another; -b/-e/-f then size one layer (split among its tensors
                       in proportion to theirs). The modes share CIERA_CACHE_MB: to measure a
                       budget, run raw and one compressed mode. Rows add per-call time, the
                       caches' peak bytes, their demand (full, delta, exp) and misses
  --through            one tensor per size through every window: keys and caches kept from
                       window to window, so a policy meets each window's regime in turn (as
                       in a long run, where it must notice the change); default: each window
                       and size is a new tensor (cold caches, new policies)
  --json               one object per row: size count type time_us algbw busbw wrong mode step
                       wire_ratio speedup window
The modes take turns call by call (raw, exp, full, raw, ...; the first mode rotates), so a
slow spell of the host hits every mode alike. The calls walk each window's steps back and
forth (0 1 2 .. 2 1 0 1 ..); a call at a turn undoes the previous call's move, which no
training run does and which Delta frames (whose context is each element's previous move) code
nearly for free: such calls are made and checked, not timed. Columns: window (steps), mode,
time (us, mean or median over calls of the slowest rank's time; each call starts after a
barrier), busbw (GB/s), wire = raw bytes / bytes sent for the timed calls, speedup = raw
time / time, compressed = calls that sent frames.";

#[derive(Clone, Debug)]
struct Opts {
    nranks: Option<usize>,
    dir: PathBuf,
    tensor: Option<String>,
    min_bytes: usize,
    max_bytes: usize,
    factor: f64,
    iters: usize,
    warmup: usize,
    modes: Vec<String>,
    json: bool,
    /// Report the median over calls instead of the mean (robust to a noisy host).
    median: bool,
    /// `--layers`: gather this many layers of every tensor per iteration.
    layers: Option<usize>,
    /// `--through`: one tensor per size across the windows (no new keys, no cache reset).
    through: bool,
}

pub fn main(args: &[String]) -> i32 {
    let (o, pass) = match parse(args) {
        Ok(Some(x)) => x,
        Ok(None) => {
            println!("{USAGE}");
            return 0;
        }
        Err(e) => {
            eprintln!("ciera perf: {e}\n\n{USAGE}");
            return 2;
        }
    };
    // The trace is checked here, before any rank starts: a wrong folder or tensor name is one
    // line and exit 2, as for `ciera analyze`.
    if let Err(e) = windows(&o.dir).and_then(|w| tensor_of(&w[0][0].1, o.tensor.as_deref())) {
        eprintln!("ciera perf: {e}");
        return 2;
    }
    ranks::run("perf", o.nranks, &pass, || {
        match o.layers {
            Some(layers) => run_model(&o, layers),
            None => run_rank(&o),
        }
        .map(|wrong| wrong == 0)
    })
}

fn parse(args: &[String]) -> std::result::Result<Option<(Opts, Vec<String>)>, String> {
    let mut o = Opts {
        nranks: None,
        dir: PathBuf::new(),
        tensor: None,
        min_bytes: 16 << 20,
        max_bytes: 16 << 20,
        factor: 2.0,
        iters: 10,
        warmup: 3,
        modes: vec!["raw".into(), "exp".into(), "full".into()],
        json: false,
        median: false,
        through: false,
        layers: None,
    };
    let mut pass = Vec::new();
    let mut a = Args::new(args);
    let mut have_dir = false;
    while let Some(flag) = a.next_flag("nNbefiw") {
        let value = match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "-n" | "-N" | "--nranks" => {
                o.nranks = Some(a.value_parsed::<usize>(&flag)?.max(1));
                continue;
            }
            "--trace" => {
                let v = a.value(&flag)?;
                o.dir = PathBuf::from(&v);
                have_dir = true;
                Some(v)
            }
            "--tensor" => {
                let v = a.value(&flag)?;
                o.tensor = Some(v.clone());
                Some(v)
            }
            "-b" | "--minbytes" => {
                o.min_bytes = a.value_size(&flag)?;
                Some(o.min_bytes.to_string())
            }
            "-e" | "--maxbytes" => {
                o.max_bytes = a.value_size(&flag)?;
                Some(o.max_bytes.to_string())
            }
            "-f" | "--stepfactor" => {
                o.factor = a.value_parsed(&flag)?;
                if !(o.factor.is_finite() && o.factor > 1.0) {
                    return Err(format!("{flag}: the step factor must be > 1"));
                }
                Some(o.factor.to_string())
            }
            "-i" | "--iters" => {
                o.iters = a.value_parsed::<usize>(&flag)?.max(1);
                Some(o.iters.to_string())
            }
            "-w" | "--warmup" | "--warmup_iters" => {
                o.warmup = a.value_parsed(&flag)?;
                Some(o.warmup.to_string())
            }
            "--modes" => {
                let v = a.value(&flag)?;
                o.modes = v
                    .split(',')
                    .map(|m| m.trim().to_string())
                    .filter(|m| !m.is_empty())
                    .collect();
                for m in &o.modes {
                    if !MODES.contains(&m.as_str()) {
                        return Err(format!(
                            "--modes: unknown mode {m:?} (one of {})",
                            MODES.join(", ")
                        ));
                    }
                }
                Some(v)
            }
            "--through" => {
                o.through = true;
                None
            }
            "--json" => {
                o.json = true;
                None
            }
            "--layers" => {
                let l = a.value_parsed::<usize>(&flag)?;
                if l == 0 {
                    return Err(format!("{flag}: at least one layer"));
                }
                o.layers = Some(l);
                Some(l.to_string())
            }
            "--stat" => {
                let v = a.value(&flag)?;
                o.median = match v.as_str() {
                    "mean" => false,
                    "median" => true,
                    other => return Err(format!("--stat: {other:?} is not mean or median")),
                };
                Some(v)
            }
            f => return Err(format!("unknown option {f}")),
        };
        pass.push(flag);
        pass.extend(value);
    }
    if !have_dir {
        return Err("--trace DIR is required here".into());
    }
    if o.min_bytes > o.max_bytes {
        return Err(format!(
            "-b {} is larger than -e {}",
            o.min_bytes, o.max_bytes
        ));
    }
    Ok(Some((o, pass)))
}

/// The tensor to replay in `st`: the one named, else the first bf16 one, else the first.
pub(crate) fn pick_tensor<'a>(
    st: &'a SafeTensors,
    want: Option<&str>,
) -> Result<&'a crate::safetensors::TensorInfo> {
    match want {
        Some(want) => st.get(want).ok_or_else(|| Error::Format {
            path: st.path.clone(),
            detail: format!(
                "no tensor named {want:?} (have: {})",
                st.tensors
                    .iter()
                    .map(|t| t.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }),
        None => st
            .tensors
            .iter()
            .find(|t| t.dtype == DType::BF16)
            .or(st.tensors.first())
            .ok_or_else(|| Error::Format {
                path: st.path.clone(),
                detail: "holds no tensors".into(),
            }),
    }
}

/// Whether the snapshot at `path` has the tensor `want` (or any, when None).
fn tensor_of(path: &Path, want: Option<&str>) -> Result<()> {
    let st = SafeTensors::open(path)?;
    pick_tensor(&st, want).map(|_| ())
}

/// The order in which calls visit a window of `k` steps: back and forth, 0 1 .. k-1 k-2 .. 1
/// (then again from 0).
fn walk(k: usize) -> Vec<usize> {
    (0..k).chain((1..k.saturating_sub(1)).rev()).collect()
}

/// Whether call `it` of the walk `order` (a window's steps back and forth) turns back: it
/// returns to the step of two calls before, so its move is exactly the previous call's move
/// undone. No training run moves so, and Delta frames, whose context is each element's previous
/// move, code it nearly for free (seen: 153-159x where the calls around it reach 15-18x; Exp
/// and Hybrid frames have no such context and code it as any one-step move). Those calls are
/// made and checked but not timed: every timed call is a one-step move after a one-step move in
/// the same direction, forward in the trace or backward (a reversed trajectory, whose
/// consecutive moves are the forward ones negated, in reverse order). In a window of two steps
/// every call but the first two turns back; there they are timed (there is no other move).
fn turns_back(order: &[usize], it: usize) -> bool {
    order.len() > 2 && it >= 2 && order[it % order.len()] == order[(it - 2) % order.len()]
}

/// The windows of consecutive steps in a trace folder, each a list of (step, path).
pub(crate) fn windows(dir: &Path) -> Result<Vec<Vec<(u64, PathBuf)>>> {
    let shown = dir.display().to_string();
    let rd = std::fs::read_dir(dir).map_err(|e| Error::Io {
        what: format!("trace folder {shown}"),
        source: e,
    })?;
    let mut steps: Vec<(u64, PathBuf)> = Vec::new();
    for e in rd {
        let p = e
            .map_err(|e| Error::Io {
                what: format!("listing {shown}"),
                source: e,
            })?
            .path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let digits: String = p
                .file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .chars()
                .filter(|c| c.is_ascii_digit())
                .collect();
            if let Ok(s) = digits.parse() {
                steps.push((s, p));
            }
        }
    }
    steps.sort();
    let mut out: Vec<Vec<(u64, PathBuf)>> = Vec::new();
    for s in steps {
        match out.last_mut() {
            Some(w) if w.last().map(|l| l.0 + 1) == Some(s.0) => w.push(s),
            _ => out.push(vec![s]),
        }
    }
    out.retain(|w| w.len() >= 2);
    if out.is_empty() {
        return Err(Error::Format {
            path: shown,
            detail: "no two consecutive step_NNNNN.safetensors snapshots".into(),
        });
    }
    Ok(out)
}

/// The `--modes` entries.
const MODES: [&str; 8] = [
    "auto", "raw", "exp", "full", "delta", "exp-on", "full-on", "delta-on",
];

/// The per-call options of a `--modes` entry; `key` keeps each mode's caches apart.
fn mode_options(mode: &str, key: u64) -> GatherOptions {
    let (compress, cache_mode) = match mode {
        "raw" => (CompressMode::Off, None),
        "exp" => (CompressMode::Auto, Some(CacheMode::Exponent)),
        "full" => (CompressMode::Auto, Some(CacheMode::FullValue)),
        "delta" => (CompressMode::Auto, Some(CacheMode::Delta)),
        "exp-on" => (CompressMode::On, Some(CacheMode::Exponent)),
        "full-on" => (CompressMode::On, Some(CacheMode::FullValue)),
        "delta-on" => (CompressMode::On, Some(CacheMode::Delta)),
        // What users get: the communicator's configuration (CIERA_COMPRESS, CIERA_CACHE_MODE).
        "auto" => {
            return GatherOptions {
                key: Some(key),
                ..GatherOptions::default()
            }
        }
        other => unreachable!("--modes {other:?} passed the check in parse"),
    };
    GatherOptions {
        key: Some(key),
        compress: Some(compress),
        cache_mode,
        ..GatherOptions::default()
    }
}

fn run_rank(o: &Opts) -> Result<u64> {
    let mut comm = Communicator::from_env(Config::from_env()?)?;
    let (rank, n) = (comm.rank(), comm.size());
    let wins = windows(&o.dir)?;
    let print = rank == 0;
    let mut wrong_total = 0u64;
    let mut header_done = false;
    let mut tensor_no = 0u64;
    for win in &wins {
        // The window's values of the chosen tensor, one Vec per step.
        let mut dtype = DType::U8;
        let mut name = String::new();
        let mut steps: Vec<(u64, Vec<u8>)> = Vec::new();
        for (step, path) in win {
            let st = SafeTensors::open(path)?;
            let t = pick_tensor(&st, o.tensor.as_deref())?;
            dtype = t.dtype;
            name = t.name.clone();
            steps.push((*step, st.bytes(t).to_vec()));
        }
        let es = dtype.size();
        if print && !o.json && !header_done {
            println!(
                "# ciera perf --trace {}: {name} ({dtype}), {n} ranks, transport {:?}",
                o.dir.display(),
                comm.config().transport
            );
            println!(
                "# topology: {}; {} B per rank: {}",
                comm.topology(),
                o.max_bytes / n,
                comm.algo_for(o.max_bytes / n / es, dtype)
            );
            println!(
                "#   iters {}, warmup {} (caches filled among them), every bit checked",
                o.iters, o.warmup
            );
            println!(
                "# {:>9} {:>10} {:>10} {:>8} {:>8} {:>10} {:>11} {:>6} {:>7} {:>10} {:>6}",
                "window",
                "size",
                "count",
                "type",
                "mode",
                "time(us)",
                "busbw(GB/s)",
                "wire",
                "speedup",
                "compressed",
                "#wrong"
            );
            header_done = true;
        }
        // Walk the window back and forth: 0 1 2 .. k k-1 .. 1 0 1 ... (the turns untimed).
        let k = steps.len();
        let order = walk(k);
        let mut bytes = o.min_bytes;
        let mut size_no = 0u64;
        loop {
            let count = (bytes / es / n).max(1);
            let size = count * es * n;
            let mut raw_time: Option<f64> = None;
            struct Run {
                opts: GatherOptions,
                recv: Vec<u8>,
                timed: Vec<f64>,
                wrong: u64,
                /// Of the timed calls: bytes gathered, bytes on the wire, calls with frames.
                raw_bytes: u64,
                wire_bytes: u64,
                compressed: u64,
            }
            // Each window and size gathers a new tensor (keys): cold caches and new policies,
            // as `--layers` does. A policy's life spans one regime here; a regime's slow drift
            // over a real run is the policy's own business (recalibration).
            if o.through {
                size_no += 1;
            } else {
                comm.reset_caches();
                tensor_no += 1;
            }
            let key_base = if o.through { size_no } else { tensor_no };
            let mut runs: Vec<Run> = o
                .modes
                .iter()
                .enumerate()
                .map(|(m, mode)| Run {
                    opts: mode_options(mode, key_base * MODES.len() as u64 + m as u64 + 1),
                    recv: vec![0u8; size],
                    timed: Vec::with_capacity(o.iters),
                    wrong: 0,
                    raw_bytes: 0,
                    wire_bytes: 0,
                    compressed: 0,
                })
                .collect();
            let mut shard = vec![0u8; count * es];
            let mut last_step = 0;
            let (mut it, mut timed_calls) = (0, 0);
            while it < o.warmup || timed_calls < o.iters {
                let (step, vals) = &steps[order[it % order.len()]];
                last_step = *step;
                let timed = it >= o.warmup && !turns_back(&order, it);
                // Rank r's shard: elements [r*count, (r+1)*count) of the tiled tensor.
                fill_tiled(&mut shard, vals, rank * count * es);
                for m in 0..runs.len() {
                    let run = &mut runs[(m + it) % o.modes.len()];
                    // Every call starts together: a rank that finished early would otherwise
                    // send its next shard while the others still check theirs, untimed, and
                    // flatter the modes without a closing exchange (raw) on a shaped link.
                    comm.barrier()?;
                    let t0 = Instant::now();
                    let report =
                        comm.all_gather_with(Some(&shard), &mut run.recv, count, dtype, &run.opts)?;
                    if timed {
                        run.timed.push(t0.elapsed().as_secs_f64());
                        run.raw_bytes += report.raw_bytes;
                        run.wire_bytes += report.wire_bytes;
                        run.compressed += report.compressed() as u64;
                    }
                    // Every call ends before any rank checks its result: on a host with fewer
                    // cores than ranks, an early rank's check would take a core from a rank
                    // still decoding, and time the harness, not the library.
                    comm.barrier()?;
                    run.wrong += count_wrong(&run.recv, vals, es);
                }
                timed_calls += timed as usize;
                it += 1;
            }
            for (mode, run) in o.modes.iter().zip(runs.iter_mut()) {
                let Run {
                    timed,
                    wrong,
                    raw_bytes,
                    wire_bytes,
                    compressed,
                    ..
                } = run;
                // A call takes as long as its slowest rank: the mean (or median) over calls of
                // the per-call maximum (a rank that finished a call early would otherwise lower
                // the mean of a mode whose ranks finish at different times, e.g. raw).
                let slowest = slowest_over_calls(&mut comm, timed, o.median)?;
                let wrongs: u64 = gather_f64(&mut comm, *wrong as f64)?
                    .iter()
                    .map(|&w| w as u64)
                    .sum();
                wrong_total += wrongs;
                let wire_ratio = *raw_bytes as f64 / (*wire_bytes).max(1) as f64;
                let compressed = *compressed;
                if mode == "raw" {
                    raw_time = Some(slowest);
                }
                let speedup = raw_time.map(|r| r / slowest);
                let algbw = size as f64 / slowest / 1e9;
                let busbw = algbw * (n - 1) as f64 / n as f64;
                let wname = format!("{}-{}", steps[0].0, steps[k - 1].0);
                let chose =
                    (mode == "auto").then(|| auto_choice(&comm, run.opts.key, compressed, o.iters));
                if print {
                    if o.json {
                        println!(
                            "{}",
                            serde_json::json!({
                                "size": size, "count": count, "type": dtype.name(), "time_us": slowest * 1e6,
                                "algbw": algbw, "busbw": busbw, "wrong": wrongs, "mode": mode, "step": last_step,
                                "window": wname, "wire_ratio": wire_ratio, "speedup": speedup,
                                "compressed_calls": compressed, "nranks": n, "tensor": name,
                                "chose": chose,
                            })
                        );
                    } else {
                        println!(
                            "  {:>9} {:>10} {:>10} {:>8} {:>8} {:>10.1} {:>11.3} {:>6.2} {:>7} {:>10} {:>6}",
                            wname,
                            size,
                            count,
                            dtype.name(),
                            mode,
                            slowest * 1e6,
                            busbw,
                            wire_ratio,
                            speedup.map(|s| format!("{s:.2}x")).unwrap_or_else(|| "-".into()),
                            format!("{compressed}/{}", o.iters),
                            wrongs
                        );
                        if let Some(c) = &chose {
                            println!("  {:>9} auto chose: {c}", "");
                        }
                    }
                }
            }
            match super::perf::next_size(bytes, o.factor, o.max_bytes) {
                Some(next) => bytes = next,
                None => break,
            }
        }
    }
    print_wrong_total(print && !o.json, wrong_total)
}

/// `--layers L`: every iteration gathers a model, L layers of every trace tensor of the chosen
/// type one after another (layer by layer, each tensor its own key and caches), as FSDP gathers
/// a model's layers in its forward pass; the modes take turns by iteration. A layer's size (-b
/// .. -e) is split among its tensors in proportion to the trace's. Reported per mode: the time
/// of an iteration (the sum of its calls' slowest-rank times) and of a call, the wire ratio,
/// the misses (sources that sent FILL frames: their cache had been evicted), and per size the
/// caches' peak bytes over the timed calls and what every tensor's caches would need.
fn run_model(o: &Opts, layers: usize) -> Result<u64> {
    let mut comm = Communicator::from_env(Config::from_env()?)?;
    let (rank, n) = (comm.rank(), comm.size());
    let budget = comm.config().compress.cache_bytes;
    let wins = windows(&o.dir)?;
    let print = rank == 0;
    let mut wrong_total = 0u64;
    let mut header_done = false;
    // Each window and size gathers new tensors (keys): cold caches and new policies.
    let mut model_no = 0u64;
    for win in &wins {
        // The tensors of the chosen type (names from the window's first step) and, per step,
        // their values.
        let first = SafeTensors::open(&win[0].1)?;
        let dtype = pick_tensor(&first, o.tensor.as_deref())?.dtype;
        let es = dtype.size();
        let names: Vec<String> = first
            .tensors
            .iter()
            .filter(|t| t.dtype == dtype)
            .map(|t| t.name.clone())
            .collect();
        let mut steps: Vec<(u64, Vec<Vec<u8>>)> = Vec::new();
        for (step, path) in win {
            let st = SafeTensors::open(path)?;
            let vals = names
                .iter()
                .map(|name| pick_tensor(&st, Some(name)).map(|t| st.bytes(t).to_vec()))
                .collect::<Result<Vec<_>>>()?;
            steps.push((*step, vals));
        }
        let elems: Vec<usize> = steps[0].1.iter().map(|v| (v.len() / es).max(1)).collect();
        let all_elems: usize = elems.iter().sum();
        let tensors = names.len();
        let calls = layers * tensors;
        if print && !o.json && !header_done {
            println!(
                "# ciera perf --trace {} --layers {layers}: {tensors} {dtype} tensors per layer ({}), {n} ranks, transport {:?}",
                o.dir.display(),
                names.join(", "),
                comm.config().transport
            );
            println!(
                "#   iters {}, warmup {} (caches filled among them), every bit checked; CIERA_CACHE_MB {} MiB",
                o.iters,
                o.warmup,
                budget >> 20
            );
            println!(
                "# {:>9} {:>10} {:>8} {:>10} {:>10} {:>6} {:>7} {:>10} {:>7} {:>9} {:>6}",
                "window",
                "size",
                "mode",
                "iter(ms)",
                "call(us)",
                "wire",
                "speedup",
                "compressed",
                "misses",
                "cache(MB)",
                "#wrong"
            );
            header_done = true;
        }
        let k = steps.len();
        let order = walk(k);
        let mut bytes = o.min_bytes;
        loop {
            // Elements per rank of each tensor of a layer.
            let counts: Vec<usize> = elems
                .iter()
                .map(|&e| ((bytes as f64 * e as f64 / all_elems as f64) as usize / es / n).max(1))
                .collect();
            let layer_count: usize = counts.iter().sum();
            let size = layers * layer_count * es * n;
            // What every tensor's caches need on each rank: each of n sources' shard.
            let demand = |mode: CacheMode| layers * n * layer_count * mode.bytes_per_element(dtype);
            let wname = format!("{}-{}", steps[0].0, steps[k - 1].0);
            if print && !o.json {
                println!(
                    "  {wname:>9} caches needed (every rank): full {:.1} MB, delta {:.1} MB, exp {:.1} MB",
                    demand(CacheMode::FullValue) as f64 / MIB,
                    demand(CacheMode::Delta) as f64 / MIB,
                    demand(CacheMode::Exponent) as f64 / MIB,
                );
            }
            struct Run {
                /// Per tensor of the model (layer-major).
                opts: Vec<GatherOptions>,
                /// Per tensor of a layer.
                recv: Vec<Vec<u8>>,
                timed: Vec<f64>,
                wrong: u64,
                raw_bytes: u64,
                wire_bytes: u64,
                compressed: u64,
                misses: u64,
            }
            comm.reset_caches();
            model_no += 1;
            let mut runs: Vec<Run> = o
                .modes
                .iter()
                .enumerate()
                .map(|(m, mode)| Run {
                    opts: (0..calls)
                        .map(|c| {
                            mode_options(mode, model_no << 40 | (m as u64 + 1) << 32 | c as u64)
                        })
                        .collect(),
                    recv: counts.iter().map(|&c| vec![0u8; c * es * n]).collect(),
                    timed: Vec::with_capacity(o.iters * calls),
                    wrong: 0,
                    raw_bytes: 0,
                    wire_bytes: 0,
                    compressed: 0,
                    misses: 0,
                })
                .collect();
            let mut shards: Vec<Vec<u8>> = counts.iter().map(|&c| vec![0u8; c * es]).collect();
            let mut peak_cache = 0usize;
            let mut last_step = 0;
            let (mut it, mut timed_calls) = (0, 0);
            while it < o.warmup || timed_calls < o.iters {
                let (step, vals) = &steps[order[it % order.len()]];
                last_step = *step;
                for (j, shard) in shards.iter_mut().enumerate() {
                    fill_tiled(shard, &vals[j], rank * counts[j] * es);
                }
                let timed = it >= o.warmup && !turns_back(&order, it);
                for m in 0..runs.len() {
                    let run = &mut runs[(m + it) % o.modes.len()];
                    for c in 0..calls {
                        let j = c % tensors;
                        comm.barrier()?;
                        let t0 = Instant::now();
                        let report = comm.all_gather_with(
                            Some(&shards[j]),
                            &mut run.recv[j],
                            counts[j],
                            dtype,
                            &run.opts[c],
                        )?;
                        if timed {
                            run.timed.push(t0.elapsed().as_secs_f64());
                            run.raw_bytes += report.raw_bytes;
                            run.wire_bytes += report.wire_bytes;
                            run.compressed += report.compressed() as u64;
                            run.misses += report.misses;
                            peak_cache = peak_cache.max(comm.compress_stats().cache_bytes);
                        }
                        // As in `run_rank`: no rank checks while another still decodes.
                        comm.barrier()?;
                        run.wrong += count_wrong(&run.recv[j], &vals[j], es);
                    }
                }
                timed_calls += timed as usize;
                it += 1;
            }
            let mut raw_time: Option<f64> = None;
            for (mode, run) in o.modes.iter().zip(&runs) {
                let per_call = slowest_per_call(&mut comm, &run.timed)?;
                let mut per_iter: Vec<f64> =
                    per_call.chunks(calls).map(|c| c.iter().sum()).collect();
                let iter_time = if o.median {
                    median_of(&mut per_iter)
                } else {
                    per_iter.iter().sum::<f64>() / per_iter.len().max(1) as f64
                };
                let wrongs: u64 = gather_f64(&mut comm, run.wrong as f64)?
                    .iter()
                    .map(|&w| w as u64)
                    .sum();
                wrong_total += wrongs;
                let wire_ratio = run.raw_bytes as f64 / run.wire_bytes.max(1) as f64;
                if mode == "raw" {
                    raw_time = Some(iter_time);
                }
                let speedup = raw_time.map(|r| r / iter_time);
                let algbw = size as f64 / iter_time / 1e9;
                let busbw = algbw * (n - 1) as f64 / n as f64;
                let chose = (mode != "raw").then(|| model_choice(&comm, &run.opts));
                if !print {
                    continue;
                }
                if o.json {
                    println!(
                        "{}",
                        serde_json::json!({
                            "size": size, "count": layers * layer_count, "type": dtype.name(),
                            "time_us": iter_time * 1e6, "call_us": iter_time * 1e6 / calls as f64,
                            "algbw": algbw, "busbw": busbw, "wrong": wrongs, "mode": mode,
                            "step": last_step, "window": wname, "wire_ratio": wire_ratio,
                            "speedup": speedup, "compressed_calls": run.compressed,
                            "timed_calls": o.iters * calls, "misses": run.misses,
                            "nranks": n, "layers": layers, "tensors": names,
                            "cache_budget": budget, "cache_bytes_peak": peak_cache,
                            "demand_full": demand(CacheMode::FullValue),
                            "demand_delta": demand(CacheMode::Delta),
                            "demand_exp": demand(CacheMode::Exponent),
                            "chose": chose,
                        })
                    );
                } else {
                    println!(
                        "  {:>9} {:>10} {:>8} {:>10.1} {:>10.1} {:>6.2} {:>7} {:>10} {:>7} {:>9.1} {:>6}",
                        wname,
                        size,
                        mode,
                        iter_time * 1e3,
                        iter_time * 1e6 / calls as f64,
                        wire_ratio,
                        speedup.map(|s| format!("{s:.2}x")).unwrap_or_else(|| "-".into()),
                        format!("{}/{}", run.compressed, o.iters * calls),
                        run.misses,
                        peak_cache as f64 / MIB,
                        wrongs
                    );
                    if let Some(c) = &chose {
                        println!("  {:>9} caches: {c}", "");
                    }
                }
            }
            match super::perf::next_size(bytes, o.factor, o.max_bytes) {
                Some(next) => bytes = next,
                None => break,
            }
        }
    }
    print_wrong_total(print && !o.json, wrong_total)
}

const MIB: f64 = (1u64 << 20) as f64;

/// The cache modes the policies of a model's tensors hold, as "delta 12, exp 4, raw 2" (raw: no
/// policy with caches, e.g. a tensor whose caches alone exceed the budget).
fn model_choice(comm: &Communicator, opts: &[GatherOptions]) -> String {
    let stats = comm.slot_stats();
    let mut by_mode: Vec<(&str, usize)> = Vec::new();
    for o in opts {
        let name = stats
            .iter()
            .find(|(k, _, _)| Some(k.id) == o.key && !k.inferred)
            .map_or("raw", |(_, mode, _)| mode.name());
        match by_mode.iter_mut().find(|(m, _)| *m == name) {
            Some((_, c)) => *c += 1,
            None => by_mode.push((name, 1)),
        }
    }
    by_mode
        .iter()
        .map(|(m, c)| format!("{m} {c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What the `auto` mode's policy chose for its tensor: the cache mode, whether it kept the
/// cache's heavy frames (Hybrid, Delta), and how many timed calls went raw.
fn auto_choice(comm: &Communicator, key: Option<u64>, compressed: u64, iters: usize) -> String {
    let Some((_, mode, st)) = comm
        .slot_stats()
        .into_iter()
        .find(|(k, _, _)| Some(k.id) == key && !k.inferred)
    else {
        return "raw (no cache: type, size or budget)".into();
    };
    if st.delta_calls == 0 && st.predicted_raw > 0 {
        // Never filled: its caches wait for a prediction that compression may pay.
        return format!(
            "raw, predicted (compression cannot win here; no cache held); {} of {iters} timed calls raw",
            iters as u64 - compressed
        );
    }
    let heavy = match (mode, st.frame_choice) {
        (_, Some(FrameChoice::Exp)) => ", Exp frames only",
        (CacheMode::Delta, Some(FrameChoice::NoDelta)) => ", Exp and Hybrid frames (no Delta)",
        (CacheMode::Delta, Some(FrameChoice::Auto)) => ", Exp, Hybrid and Delta frames",
        (CacheMode::FullValue, Some(_)) => ", Exp and Hybrid frames",
        _ => "",
    };
    format!(
        "{} cache{heavy}; {} of {iters} timed calls raw",
        mode.name(),
        iters as u64 - compressed
    )
}

/// `out` = bytes `[start, start + out.len())` of `vals` tiled end to end (whole runs copied at
/// once: the ranks check and refill between timed calls, and a per-element loop there is slow
/// enough on a busy host to skew when the ranks enter the next call).
pub(crate) fn fill_tiled(out: &mut [u8], vals: &[u8], start: usize) {
    let m = vals.len();
    let mut done = 0;
    while done < out.len() {
        let from = (start + done) % m;
        let run = (m - from).min(out.len() - done);
        out[done..done + run].copy_from_slice(&vals[from..from + run]);
        done += run;
    }
}

/// Elements of `recv` that differ from `vals` tiled end to end (compared a run at a time;
/// element by element only inside a run that differs).
fn count_wrong(recv: &[u8], vals: &[u8], es: usize) -> u64 {
    let m = vals.len();
    let mut wrong = 0u64;
    let mut at = 0;
    while at < recv.len() {
        let from = at % m;
        let run = (m - from).min(recv.len() - at);
        let (got, want) = (&recv[at..at + run], &vals[from..from + run]);
        if got != want {
            wrong += got
                .chunks(es)
                .zip(want.chunks(es))
                .filter(|(g, w)| g != w)
                .count() as u64;
        }
        at += run;
    }
    wrong
}

/// Mean (or median) over calls of the slowest rank's time of each call (`mine`: this rank's
/// per-call times; every rank has the same number).
fn slowest_over_calls(comm: &mut Communicator, mine: &[f64], median: bool) -> Result<f64> {
    let mut per_call_max = slowest_per_call(comm, mine)?;
    if median {
        Ok(median_of(&mut per_call_max))
    } else {
        Ok(per_call_max.iter().sum::<f64>() / per_call_max.len().max(1) as f64)
    }
}

/// The slowest rank's time of each call (`mine`: this rank's per-call times; every rank has the
/// same number).
fn slowest_per_call(comm: &mut Communicator, mine: &[f64]) -> Result<Vec<f64>> {
    let n = comm.size();
    let k = mine.len();
    let bytes: Vec<u8> = mine
        .iter()
        .flat_map(|t| t.to_bits().to_le_bytes())
        .collect();
    let mut all = vec![0u8; 8 * k * n];
    comm.all_gather(&bytes, &mut all, k, DType::U64)?;
    let t = |r: usize, i: usize| {
        let at = 8 * (r * k + i);
        f64::from_bits(u64::from_le_bytes(
            all[at..at + 8].try_into().expect("8 bytes"),
        ))
    };
    Ok((0..k)
        .map(|i| (0..n).map(|r| t(r, i)).fold(0.0, f64::max))
        .collect())
}

/// The median (mean of the two middle values for an even count; 0 for none).
fn median_of(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let k = v.len();
    if k % 2 == 1 {
        v[k / 2]
    } else {
        (v[k / 2 - 1] + v[k / 2]) / 2.0
    }
}

fn gather_f64(comm: &mut Communicator, v: f64) -> Result<Vec<f64>> {
    let n = comm.size();
    let mut out = vec![0u8; 8 * n];
    comm.all_gather(&v.to_bits().to_le_bytes(), &mut out, 1, DType::U64)?;
    Ok(out
        .chunks_exact(8)
        .map(|c| f64::from_bits(u64::from_le_bytes(c.try_into().unwrap())))
        .collect())
}

/// The closing line of a table (when printing one), and the total as the run's result.
fn print_wrong_total(print: bool, wrong_total: u64) -> Result<u64> {
    if print {
        println!(
            "# wrong elements: {wrong_total} {}",
            if wrong_total == 0 { "OK" } else { "FAILED" }
        );
    }
    Ok(wrong_total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median_of(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median_of(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median_of(&mut []), 0.0);
    }

    #[test]
    fn the_walk_times_every_call_but_the_turns() {
        // The steps each call visits, and which are timed (after no warmup).
        let visits = |k: usize, calls: usize| -> Vec<(usize, bool)> {
            let order = walk(k);
            (0..calls)
                .map(|it| (order[it % order.len()], !turns_back(&order, it)))
                .collect()
        };
        let t = |s: usize| (s, true);
        let u = |s: usize| (s, false);
        // 0 1 2 3 | 2 (undoes 2->3) 1 0 | 1 (undoes 1->0) 2 3 | 2 ...
        assert_eq!(
            visits(4, 11),
            [
                t(0),
                t(1),
                t(2),
                t(3),
                u(2),
                t(1),
                t(0),
                u(1),
                t(2),
                t(3),
                u(2)
            ]
        );
        // Three steps (the bundled slice's windows): 0 1 2 | 1 0 | 1 2 | 1 0 ...
        assert_eq!(
            visits(3, 8),
            [t(0), t(1), t(2), u(1), t(0), u(1), t(2), u(1)]
        );
        // Two steps: every move undoes the last, and there is nothing else to time.
        assert_eq!(visits(2, 4), [t(0), t(1), t(0), t(1)]);
        assert_eq!(visits(1, 3), [t(0), t(0), t(0)]);
        // Every untimed call returns to the step of two calls before, and no timed one does
        // (beyond two steps).
        for k in 3..9 {
            let v = visits(k, 5 * k);
            for i in 2..v.len() {
                assert_eq!(v[i].1, v[i].0 != v[i - 2].0, "k {k}, call {i}");
            }
        }
    }

    #[test]
    fn fill_tiled_wraps_around_the_tensor() {
        let vals: Vec<u8> = (0..6).collect();
        let mut out = [0u8; 10];
        fill_tiled(&mut out, &vals, 4);
        assert_eq!(out, [4, 5, 0, 1, 2, 3, 4, 5, 0, 1]);
        let mut empty: [u8; 0] = [];
        fill_tiled(&mut empty, &vals, 3);
    }

    #[test]
    fn count_wrong_counts_elements_not_bytes() {
        let vals: Vec<u8> = (0..8).collect(); // 4 two-byte elements
        let mut recv: Vec<u8> = (0..20).map(|i| (i % 8) as u8).collect();
        assert_eq!(count_wrong(&recv, &vals, 2), 0);
        recv[0] ^= 1; // element 0
        recv[1] ^= 1; // same element
        recv[9] ^= 0x80; // element 4 (second tile)
        recv[19] ^= 1; // last element (partial tile)
        assert_eq!(count_wrong(&recv, &vals, 2), 3);
    }
}
