//! `ciera analyze DIR [--mode exp|hybrid|auto|all] [--json]`: what would CIERA save on these
//! checkpoints? Pairs consecutive snapshots, runs the real encoder and decoder over the
//! iterations as one source rank would (one sender slot and one receiver slot per tensor and
//! mode), checks every decoded bit, and prints per pair and tensor the change rates, the ratio
//! achieved, the entropy bounds as the traces' BOUNDS.txt defines them, and codec speed.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::codec::{CacheMode, CacheSlot, FrameChoice};
use crate::error::{Error, Result};
use crate::safetensors::SafeTensors;
use crate::DType;

const HELP: &str = "usage: ciera analyze DIR [--mode exp|hybrid|auto|all] [--json]

Reads every *.safetensors file in DIR (one snapshot per training step; the step is taken from
the file's metadata \"step\" or the digits in its name), pairs consecutive steps, and for each
pair and tensor encodes the later step against a cache filled by the earlier ones, decodes it,
and checks every bit. Modes:
  exp     exponent-only cache (1 byte/element): sign+mantissa always sent, exponent exceptions
  hybrid  full-value cache (element size/element): unchanged values cost ~nothing
  auto    full-value cache; each frame is hybrid where that saves at least a fifth of the
          bytes of exp (hybrid costs more codec time), else exp
  all     (default) all three
Columns: p_exp = fraction of exponents changed, q_val = fraction of values unchanged, ratio =
raw bytes / frame bytes (headers included), bound = the entropy bound for the mode's cache
(exc_bound for exp, hyb_bound for hybrid and auto), eff = ratio / bound.
Exits 1 if any decoded bit differs from the input, 2 on bad arguments or unreadable input.";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum AnalyzeMode {
    Exp,
    Hybrid,
    Auto,
}

impl AnalyzeMode {
    fn name(self) -> &'static str {
        match self {
            AnalyzeMode::Exp => "exp",
            AnalyzeMode::Hybrid => "hybrid",
            AnalyzeMode::Auto => "auto",
        }
    }
    fn slot(self, dtype: DType, len: usize) -> CacheSlot {
        let mut s = CacheSlot::new(
            dtype,
            if self == AnalyzeMode::Exp {
                CacheMode::Exponent
            } else {
                CacheMode::FullValue
            },
            len,
        );
        s.set_frame_choice(match self {
            AnalyzeMode::Exp => FrameChoice::Exp,
            AnalyzeMode::Hybrid => FrameChoice::Hybrid,
            AnalyzeMode::Auto => FrameChoice::Auto,
        });
        s
    }
}

struct Options {
    dir: PathBuf,
    modes: Vec<AnalyzeMode>,
    json: bool,
}

fn parse_args(args: &[String]) -> std::result::Result<Options, String> {
    let mut dir = None;
    let mut modes = vec![AnalyzeMode::Exp, AnalyzeMode::Hybrid, AnalyzeMode::Auto];
    let mut json = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--json" => json = true,
            "--mode" => {
                let m = it
                    .next()
                    .ok_or("--mode needs a value: exp, hybrid, auto or all")?;
                modes = match m.as_str() {
                    "exp" => vec![AnalyzeMode::Exp],
                    "hybrid" => vec![AnalyzeMode::Hybrid],
                    "auto" => vec![AnalyzeMode::Auto],
                    "all" => vec![AnalyzeMode::Exp, AnalyzeMode::Hybrid, AnalyzeMode::Auto],
                    other => {
                        return Err(format!("unknown mode '{other}' (exp, hybrid, auto or all)"))
                    }
                };
            }
            s if s.starts_with('-') => return Err(format!("unknown option '{s}'")),
            s => {
                if dir.replace(PathBuf::from(s)).is_some() {
                    return Err("more than one DIR given".into());
                }
            }
        }
    }
    let dir = dir.ok_or("missing DIR (a folder of *.safetensors snapshots)")?;
    Ok(Options { dir, modes, json })
}

pub fn main(args: &[String]) -> i32 {
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{HELP}");
        return 0;
    }
    let opts = match parse_args(args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("ciera analyze: {e}\n\n{HELP}");
            return 2;
        }
    };
    match run(&opts) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("ciera analyze: {e}");
            2
        }
    }
}

/// One snapshot file and its step number.
struct Snapshot {
    step: u64,
    path: PathBuf,
}

fn list_snapshots(dir: &Path) -> Result<Vec<Snapshot>> {
    let shown = dir.display().to_string();
    let meta = std::fs::metadata(dir).map_err(|e| Error::Io {
        what: format!("folder {shown}"),
        source: e,
    })?;
    if !meta.is_dir() {
        return Err(Error::Format {
            path: shown,
            detail: "is not a folder (give the folder that holds the step_*.safetensors snapshots)"
                .into(),
        });
    }
    let rd = std::fs::read_dir(dir).map_err(|e| Error::Io {
        what: format!("listing {shown}"),
        source: e,
    })?;
    let mut snaps = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|e| Error::Io {
            what: format!("listing {shown}"),
            source: e,
        })?;
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
            continue;
        }
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_string();
        let digits: String = name.chars().filter(|c| c.is_ascii_digit()).collect();
        let step = digits.parse::<u64>().map_err(|_| Error::Format {
            path: path.display().to_string(),
            detail: "cannot tell the training step: name the file like step_00042.safetensors"
                .into(),
        })?;
        snaps.push(Snapshot { step, path });
    }
    snaps.sort_by_key(|s| s.step);
    for w in snaps.windows(2) {
        if w[0].step == w[1].step {
            return Err(Error::Format {
                path: shown,
                detail: format!(
                    "two snapshots for step {}: {} and {}",
                    w[0].step,
                    w[0].path.display(),
                    w[1].path.display()
                ),
            });
        }
    }
    if snaps.len() < 2 {
        return Err(Error::Format {
            path: shown,
            detail: format!("found {} *.safetensors snapshot(s); need at least two consecutive steps to compare", snaps.len()),
        });
    }
    if !snaps.windows(2).any(|w| w[1].step == w[0].step + 1) {
        return Err(Error::Format {
            path: shown,
            detail: "no two snapshots are consecutive steps (e.g. step_00100 and step_00101)"
                .into(),
        });
    }
    Ok(snaps)
}

/// Change statistics and the bounds of BOUNDS.txt for one pair of one tensor.
#[derive(Clone, Copy, Debug, Default)]
pub struct PairStats {
    pub p_exp: f64,
    pub q_val: f64,
    pub ciera512: f64,
    pub exc_bitmap: f64,
    pub exc_bound: f64,
    pub val_bound: f64,
    pub hyb_bound: f64,
}

fn h2(p: f64) -> f64 {
    if p <= 0.0 || p >= 1.0 {
        0.0
    } else {
        -(p * p.log2() + (1.0 - p) * (1.0 - p).log2())
    }
}

fn hn(ps: &[f64]) -> f64 {
    ps.iter()
        .filter(|&&p| p > 0.0)
        .map(|&p| -p * p.log2())
        .sum()
}

/// The statistics BOUNDS.txt defines, computed from the previous and current bytes.
pub fn pair_stats(dtype: DType, prev: &[u8], cur: &[u8]) -> Option<PairStats> {
    let (bits, exp_bits, shift) = match dtype {
        DType::BF16 => (16.0, 8.0, 7u32),
        DType::F16 => (16.0, 5.0, 10),
        DType::F32 => (32.0, 8.0, 23),
        _ => return None,
    };
    let sz = dtype.size();
    let n = cur.len() / sz;
    if n == 0 {
        return None;
    }
    let word = |b: &[u8], i: usize| -> u32 {
        if sz == 2 {
            u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32
        } else {
            u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap())
        }
    };
    let emask = ((1u32 << exp_bits as u32) - 1) << shift;
    let (mut ce, mut same) = (0usize, 0usize);
    let mut blocks_changed = 0usize;
    let mut block_any = false;
    for i in 0..n {
        let (a, b) = (word(prev, i), word(cur, i));
        if a == b {
            same += 1;
        }
        if a & emask != b & emask {
            ce += 1;
            block_any = true;
        }
        if i % 512 == 511 || i == n - 1 {
            blocks_changed += block_any as usize;
            block_any = false;
        }
    }
    let p = ce as f64 / n as f64;
    let q = same as f64 / n as f64;
    let sm_bits = bits - exp_bits;
    let nblocks = n.div_ceil(512) as f64;
    let b512 = (blocks_changed as f64 * 512.0 * bits
        + (nblocks - blocks_changed as f64) * 512.0 * sm_bits
        + nblocks)
        / (nblocks * 512.0);
    let r = 1.0 - q - p; // value changed, exponent kept
    Some(PairStats {
        p_exp: p,
        q_val: q,
        ciera512: bits / b512,
        exc_bitmap: bits / (sm_bits + 1.0 + p * exp_bits),
        exc_bound: bits / (sm_bits + h2(p) + p * exp_bits),
        val_bound: bits / (h2(q) + (1.0 - q) * bits),
        hyb_bound: bits / (hn(&[q, r, p]) + r * sm_bits + p * bits),
    })
}

struct Row {
    step: u64,
    tensor: String,
    dtype: DType,
    mode: AnalyzeMode,
    stats: PairStats,
    raw_bytes: usize,
    frame_bytes: usize,
    exact: bool,
    encode_gbps: f64,
    decode_gbps: f64,
}

impl Row {
    fn ratio(&self) -> f64 {
        self.raw_bytes as f64 / self.frame_bytes as f64
    }
    fn bound(&self) -> f64 {
        if self.mode == AnalyzeMode::Exp {
            self.stats.exc_bound
        } else {
            self.stats.hyb_bound
        }
    }
}

/// Per tensor and mode: the sender's slot and the receiver's slot.
struct Track {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    prev: Vec<u8>,
    prev_step: u64,
    slots: Vec<(AnalyzeMode, CacheSlot, CacheSlot)>,
}

fn run(opts: &Options) -> Result<bool> {
    let snaps = list_snapshots(&opts.dir)?;
    let mut tracks: Vec<Track> = Vec::new();
    let mut rows: Vec<Row> = Vec::new();
    let mut frame = Vec::new();
    let mut decoded = Vec::new();
    let mut all_exact = true;
    if !opts.json {
        println!(
            "{:>6} {:<28} {:>5} {:>6} {:>7} {:>6} | {:>6} {:>6} {:>5} | {:>8} {:>8}",
            "step",
            "tensor",
            "dtype",
            "p_exp",
            "q_val",
            "mode",
            "ratio",
            "bound",
            "eff",
            "enc GB/s",
            "dec GB/s"
        );
    }
    for snap in &snaps {
        let st = SafeTensors::open(&snap.path)?;
        for t in &st.tensors {
            let bytes = st.bytes(t);
            let idx = match tracks.iter().position(|k| k.name == t.name) {
                Some(i) => i,
                None => {
                    tracks.push(Track {
                        name: t.name.clone(),
                        dtype: t.dtype,
                        shape: t.shape.clone(),
                        prev: Vec::new(),
                        prev_step: u64::MAX,
                        slots: opts
                            .modes
                            .iter()
                            .map(|&m| {
                                (
                                    m,
                                    m.slot(t.dtype, t.elements()),
                                    m.slot(t.dtype, t.elements()),
                                )
                            })
                            .collect(),
                    });
                    tracks.len() - 1
                }
            };
            let tr = &mut tracks[idx];
            if tr.dtype != t.dtype || tr.shape != t.shape {
                return Err(Error::Format {
                    path: st.path.clone(),
                    detail: format!(
                        "tensor '{}' is {} {:?} here but {} {:?} in step {}: snapshots must hold the same tensors",
                        t.name, t.dtype, t.shape, tr.dtype, tr.shape, tr.prev_step
                    ),
                });
            }
            let consecutive = tr.prev_step != u64::MAX && snap.step == tr.prev_step + 1;
            let stats = if consecutive {
                pair_stats(t.dtype, &tr.prev, bytes)
            } else {
                None
            };
            for (mode, tx, rx) in tr.slots.iter_mut() {
                if !consecutive {
                    // A new window of steps: start over from a cold cache (raw warm-up frame).
                    tx.poison();
                }
                frame.clear();
                let t0 = Instant::now();
                let info = tx.encode(bytes, &mut frame)?;
                let t1 = Instant::now();
                decoded.clear();
                decoded.resize(bytes.len(), 0);
                let dinfo = rx.decode(&frame, &mut decoded);
                let t2 = Instant::now();
                let exact = dinfo.is_ok() && decoded == bytes;
                if let Err(e) = &dinfo {
                    eprintln!(
                        "ciera analyze: step {} tensor {} mode {}: decode failed: {e}",
                        snap.step,
                        t.name,
                        mode.name()
                    );
                }
                if !exact {
                    all_exact = false;
                    eprintln!(
                        "ciera analyze: step {} tensor {} mode {}: DECODED BITS DIFFER",
                        snap.step,
                        t.name,
                        mode.name()
                    );
                }
                let Some(stats) = stats else { continue };
                let gbps =
                    |d: std::time::Duration| bytes.len() as f64 / d.as_secs_f64().max(1e-9) / 1e9;
                let row = Row {
                    step: snap.step,
                    tensor: t.name.clone(),
                    dtype: t.dtype,
                    mode: *mode,
                    stats,
                    raw_bytes: info.raw_bytes,
                    frame_bytes: info.frame_bytes,
                    exact,
                    encode_gbps: gbps(t1 - t0),
                    decode_gbps: gbps(t2 - t1),
                };
                print_row(&row, opts.json);
                rows.push(row);
            }
            tr.prev.clear();
            tr.prev.extend_from_slice(bytes);
            tr.prev_step = snap.step;
        }
    }
    if !opts.json {
        print_summary(&rows);
    }
    Ok(all_exact)
}

fn print_row(r: &Row, json: bool) {
    if json {
        let v = serde_json::json!({
            "step": r.step,
            "tensor": r.tensor,
            "dtype": r.dtype.name(),
            "mode": r.mode.name(),
            "ratio": round(r.ratio(), 4),
            "raw_bytes": r.raw_bytes,
            "frame_bytes": r.frame_bytes,
            "p_exp": round(r.stats.p_exp, 6),
            "q_val": round(r.stats.q_val, 6),
            "ciera512": round(r.stats.ciera512, 4),
            "exc_bitmap": round(r.stats.exc_bitmap, 4),
            "exc_bound": round(r.stats.exc_bound, 4),
            "val_bound": round(r.stats.val_bound, 4),
            "hyb_bound": round(r.stats.hyb_bound, 4),
            "exact": r.exact,
            "encode_gbps": round(r.encode_gbps, 3),
            "decode_gbps": round(r.decode_gbps, 3),
        });
        println!("{v}");
    } else {
        println!(
            "{:>6} {:<28} {:>5} {:>6.4} {:>7.4} {:>6} | {:>6.3} {:>6.3} {:>5.3} | {:>8.2} {:>8.2}{}",
            r.step,
            r.tensor,
            r.dtype.name(),
            r.stats.p_exp,
            r.stats.q_val,
            r.mode.name(),
            r.ratio(),
            r.bound(),
            r.ratio() / r.bound(),
            r.encode_gbps,
            r.decode_gbps,
            if r.exact { "" } else { "  NOT EXACT" }
        );
    }
}

fn round(x: f64, digits: i32) -> f64 {
    let m = 10f64.powi(digits);
    (x * m).round() / m
}

fn print_summary(rows: &[Row]) {
    println!("\nsummary (per dtype and mode: pairs, total raw/frame ratio, worst ratio/bound, all exact):");
    let mut keys: Vec<(DType, AnalyzeMode)> = Vec::new();
    for r in rows {
        if !keys.contains(&(r.dtype, r.mode)) {
            keys.push((r.dtype, r.mode));
        }
    }
    for (d, m) in keys {
        let sel: Vec<&Row> = rows
            .iter()
            .filter(|r| r.dtype == d && r.mode == m)
            .collect();
        let raw: usize = sel.iter().map(|r| r.raw_bytes).sum();
        let fr: usize = sel.iter().map(|r| r.frame_bytes).sum();
        let worst = sel
            .iter()
            .map(|r| r.ratio() / r.bound())
            .fold(f64::INFINITY, f64::min);
        println!(
            "  {:>8} {:>6}: {:>3} pairs, ratio {:.3}, worst eff {:.3}, exact {}",
            d.name(),
            m.name(),
            sel.len(),
            raw as f64 / fr as f64,
            worst,
            sel.iter().all(|r| r.exact)
        );
    }
}
