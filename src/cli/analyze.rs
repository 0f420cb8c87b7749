//! `ciera analyze DIR [--mode exp|hybrid|auto|delta|all] [--json]`: what would CIERA save on
//! these checkpoints? Pairs consecutive snapshots, runs the real encoder and decoder over the
//! iterations as one source rank would (one sender slot and one receiver slot per tensor and
//! mode), checks every decoded bit, and prints per pair and tensor the change rates, the ratio
//! achieved, the entropy bounds as the traces' BOUNDS.txt and DELTA_BOUNDS.txt define them, and
//! codec speed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::codec::{CacheMode, CacheSlot, FrameChoice};
use crate::error::{Error, Result};
use crate::safetensors::SafeTensors;
use crate::DType;

const HELP: &str = "usage: ciera analyze DIR [--mode exp|hybrid|auto|delta|all] [--json]

Reads every *.safetensors file in DIR (one snapshot per training step; the step is taken from
the file's metadata \"step\" or the digits in its name), pairs consecutive steps, and for each
pair and tensor encodes the later step against a cache filled by the earlier ones, decodes it,
and checks every bit. Modes:
  exp     exponent-only cache (1 byte/element): sign+mantissa always sent, exponent exceptions
  hybrid  full-value cache (element size/element): unchanged values cost ~nothing
  auto    full-value cache; each frame is hybrid where that saves at least a fifth of the
          bytes of exp (hybrid costs more codec time), else exp
  delta   delta cache (element size + 1 byte/element: the value and its previous move); each
          chunk sends the smallest of exp, hybrid and delta (the change in ulps, coded with
          the previous change as context)
  all     (default) all four
Columns: p_exp = fraction of exponents changed, q_val = fraction of values unchanged, ratio =
raw bytes / frame bytes (headers included), bound = the entropy bound for the mode's cache
(exc_bound for exp, hyb_bound for hybrid and auto, dc_bound for delta), eff = ratio / bound.
dc_bound = bits / H(d | previous d), d = the change in ulps: taken from DIR/DELTA_BOUNDS.txt
where it lists the pair and tensor (a warning if it differs from ours by over 1%), else
computed; a computed dc_bound is not measurable (eff shown as -, left out of the summary's
worst) where over 1/8 of the elements are distinct (previous move, move) pairs: the sample
is then too small for the entropy (typical of fp32, whose moves span thousands of ulps).
--json rows of delta also give unchanged, d_bound (bits / H(d)), bound_source,
dc_bound_measurable and (computed) distinct_share.
Exits 1 if any decoded bit differs from the input, 2 on bad arguments or unreadable input.";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum AnalyzeMode {
    Exp,
    Hybrid,
    Auto,
    Delta,
}

impl AnalyzeMode {
    fn name(self) -> &'static str {
        match self {
            AnalyzeMode::Exp => "exp",
            AnalyzeMode::Hybrid => "hybrid",
            AnalyzeMode::Auto => "auto",
            AnalyzeMode::Delta => "delta",
        }
    }
    fn slot(self, dtype: DType, len: usize) -> CacheSlot {
        let mut s = CacheSlot::new(
            dtype,
            match self {
                AnalyzeMode::Exp => CacheMode::Exponent,
                AnalyzeMode::Hybrid | AnalyzeMode::Auto => CacheMode::FullValue,
                AnalyzeMode::Delta => CacheMode::Delta,
            },
            len,
        );
        s.set_frame_choice(match self {
            AnalyzeMode::Exp => FrameChoice::Exp,
            AnalyzeMode::Hybrid => FrameChoice::Hybrid,
            AnalyzeMode::Auto | AnalyzeMode::Delta => FrameChoice::Auto,
        });
        s
    }
}

const ALL_MODES: [AnalyzeMode; 4] = [
    AnalyzeMode::Exp,
    AnalyzeMode::Hybrid,
    AnalyzeMode::Auto,
    AnalyzeMode::Delta,
];

struct Options {
    dir: PathBuf,
    modes: Vec<AnalyzeMode>,
    json: bool,
}

fn parse_args(args: &[String]) -> std::result::Result<Options, String> {
    let mut dir = None;
    let mut modes = ALL_MODES.to_vec();
    let mut json = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--json" => json = true,
            "--mode" => {
                let m = it
                    .next()
                    .ok_or("--mode needs a value: exp, hybrid, auto, delta or all")?;
                modes = match m.as_str() {
                    "exp" => vec![AnalyzeMode::Exp],
                    "hybrid" => vec![AnalyzeMode::Hybrid],
                    "auto" => vec![AnalyzeMode::Auto],
                    "delta" => vec![AnalyzeMode::Delta],
                    "all" => ALL_MODES.to_vec(),
                    other => {
                        return Err(format!(
                            "unknown mode '{other}' (exp, hybrid, auto, delta or all)"
                        ))
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

/// Empirical order-0 entropy, in bits per symbol, of a sample given by the counts of its
/// distinct symbols (in any order; zeros are skipped): sum (c/n) log2 (n/c), exactly 0 for a
/// sample of one symbol.
pub fn entropy_of_counts(counts: impl IntoIterator<Item = u64>) -> f64 {
    let counts: Vec<u64> = counts.into_iter().filter(|&c| c > 0).collect();
    let n = counts.iter().sum::<u64>() as f64;
    counts
        .iter()
        .map(|&c| c as f64 / n * (n / c as f64).log2())
        .sum()
}

/// The lengths of the runs of equal values of a sorted slice.
fn run_lengths<T: PartialEq>(sorted: &[T]) -> impl Iterator<Item = u64> + '_ {
    sorted.chunk_by(|a, b| a == b).map(|run| run.len() as u64)
}

/// Empirical order-0 entropy H(X), in bits per symbol, of a sample of symbols.
pub fn entropy(symbols: &[u64]) -> f64 {
    let mut v = symbols.to_vec();
    v.sort_unstable();
    entropy_of_counts(run_lengths(&v))
}

/// Empirical conditional entropy H(X | C), in bits per symbol, of the sample of pairs
/// (`symbols[i]`, `contexts[i]`): the entropy of X within each context, weighted by the
/// context's share of the sample. Never above `entropy(symbols)`; equal to it (to the bit)
/// when every context is the same.
pub fn conditional_entropy(symbols: &[u64], contexts: &[u8]) -> f64 {
    assert_eq!(symbols.len(), contexts.len(), "one context per symbol");
    let n = symbols.len();
    if n == 0 {
        return 0.0;
    }
    let mut v: Vec<(u8, u64)> = contexts
        .iter()
        .copied()
        .zip(symbols.iter().copied())
        .collect();
    v.sort_unstable();
    let h: f64 = v
        .chunk_by(|a, b| a.0 == b.0)
        .map(|ctx| ctx.len() as f64 / n as f64 * entropy_of_counts(run_lengths(ctx)))
        .sum();
    h.min(entropy(symbols))
}

/// The previous move of an element is clipped to this many ulps either way for a context.
pub const DELTA_CONTEXT_CLIP: i64 = 8;

/// The ulp-delta statistics of DELTA_BOUNDS.txt for one pair of one tensor (see the traces'
/// README): with `key` the total-order key of a value's bits (bits XOR all-ones when the sign
/// bit is set, else bits OR the sign bit) and `d = key(new) - key(old)` modulo 2^bits, the
/// move in ulps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeltaStats {
    /// Fraction of elements with d = 0.
    pub unchanged: f64,
    /// bits / H(d): the order-0 bound.
    pub d_bound: f64,
    /// bits / H(d | d_prev), d_prev the element's previous move (signed, clipped to -8..8;
    /// 0 at the first pair of a window): the bound with the previous move as context.
    pub dc_bound: f64,
    /// The share of distinct (previous move, move) pairs among the elements (computed
    /// statistics; None when read from DELTA_BOUNDS.txt).
    pub distinct: Option<f64>,
}

/// Above this share of distinct (previous move, move) pairs a computed dc_bound is not
/// measurable from the sample: most moves are seen once, so the empirical entropy reads low
/// (it cannot exceed log2 of the sample size: fp32 moves of 10^4-10^5 ulps in a tensor of
/// 49K values give a "bound" of about 32 / log2 49152 = 2.05 whatever the data) and the bound
/// high. The traces' bf16 pairs stay below a few percent.
pub const MEASURABLE_DISTINCT: f64 = 0.125;

impl DeltaStats {
    /// Whether dc_bound means what it says (see [`MEASURABLE_DISTINCT`]); always for bounds
    /// read from DELTA_BOUNDS.txt.
    pub fn measurable(&self) -> bool {
        self.distinct.is_none_or(|s| s <= MEASURABLE_DISTINCT)
    }
}

/// The DELTA_BOUNDS.txt statistics of the pair `prev` -> `cur` (bf16, fp16: 16-bit keys;
/// fp32: 32-bit keys; None for other types or no elements). `moves` holds each element's
/// previous move, clipped to -8..8 (all 0 at the first pair of a window), and is updated to
/// this pair's moves.
pub fn delta_stats(dtype: DType, prev: &[u8], cur: &[u8], moves: &mut [i8]) -> Option<DeltaStats> {
    let sz = dtype.size();
    let bits = match dtype {
        DType::BF16 | DType::F16 => 16u32,
        DType::F32 => 32,
        _ => return None,
    };
    let n = cur.len() / sz;
    if n == 0 {
        return None;
    }
    assert!(
        prev.len() == cur.len() && moves.len() == n,
        "one move per element"
    );
    let sign = 1u64 << (bits - 1);
    let ones = (1u64 << bits) - 1;
    let key = |w: u64| if w & sign != 0 { w ^ ones } else { w | sign };
    let word = |b: &[u8], i: usize| -> u64 {
        if sz == 2 {
            u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u64
        } else {
            u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().expect("4 bytes")) as u64
        }
    };
    let mut ds = Vec::with_capacity(n);
    let mut ctx = Vec::with_capacity(n);
    let mut same = 0usize;
    for (i, m) in moves.iter_mut().enumerate() {
        let d = key(word(cur, i)).wrapping_sub(key(word(prev, i))) & ones;
        same += (d == 0) as usize;
        ds.push(d);
        ctx.push((*m as i64 + DELTA_CONTEXT_CLIP) as u8);
        // d as a signed move of `bits` bits.
        let signed = if d & sign != 0 {
            d as i64 - (1i64 << bits)
        } else {
            d as i64
        };
        *m = signed.clamp(-DELTA_CONTEXT_CLIP, DELTA_CONTEXT_CLIP) as i8;
    }
    let bits = bits as f64;
    let mut pairs: Vec<(u8, u64)> = ctx.iter().copied().zip(ds.iter().copied()).collect();
    pairs.sort_unstable();
    pairs.dedup();
    Some(DeltaStats {
        unchanged: same as f64 / n as f64,
        d_bound: bits / entropy(&ds),
        dc_bound: bits / conditional_entropy(&ds, &ctx),
        distinct: Some(pairs.len() as f64 / n as f64),
    })
}

/// DELTA_BOUNDS.txt of a trace folder: (step, tensor) -> its statistics. Lines
/// `STEP TENSOR unchanged=X d_bound=Y dc_bound=Z`; lines starting with `#` are comments. An
/// absent file is an empty table, an unreadable one too (with a warning); a line that does not
/// parse is reported and skipped.
fn read_delta_bounds(path: &Path) -> HashMap<(u64, String), DeltaStats> {
    let mut out = HashMap::new();
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            if e.kind() != std::io::ErrorKind::NotFound {
                eprintln!(
                    "ciera analyze: warning: {}: {e}; computing every dc_bound",
                    path.display()
                );
            }
            return out;
        }
    };
    for (no, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match parse_delta_line(line) {
            Some((step, tensor, st)) => {
                out.insert((step, tensor), st);
            }
            None => eprintln!(
                "ciera analyze: warning: {}:{}: not `STEP TENSOR unchanged=X d_bound=Y dc_bound=Z`; ignored",
                path.display(),
                no + 1
            ),
        }
    }
    out
}

fn parse_delta_line(line: &str) -> Option<(u64, String, DeltaStats)> {
    let mut it = line.split_whitespace();
    let step = it.next()?.parse().ok()?;
    let tensor = it.next()?.to_string();
    let (mut u, mut d, mut dc) = (None, None, None);
    for kv in it {
        let (k, v) = kv.split_once('=')?;
        let v: f64 = v.parse().ok()?;
        match k {
            "unchanged" => u = Some(v),
            "d_bound" => d = Some(v),
            "dc_bound" => dc = Some(v),
            _ => {}
        }
    }
    Some((
        step,
        tensor,
        DeltaStats {
            unchanged: u?,
            d_bound: d?,
            dc_bound: dc?,
            distinct: None,
        },
    ))
}

/// The delta statistics of a row: those reported (from DELTA_BOUNDS.txt when it lists the
/// pair, else ours) and ours.
#[derive(Clone, Copy, Debug)]
struct DeltaRow {
    used: DeltaStats,
    computed: DeltaStats,
    from_file: bool,
}

impl DeltaRow {
    fn source(&self) -> &'static str {
        if self.from_file {
            "DELTA_BOUNDS.txt"
        } else {
            "computed"
        }
    }
}

struct Row {
    step: u64,
    tensor: String,
    dtype: DType,
    mode: AnalyzeMode,
    stats: PairStats,
    /// Delta rows: the ulp-delta statistics.
    delta: Option<DeltaRow>,
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
    /// Whether the row's bound is measurable (a delta row's dc_bound may not be: see
    /// [`MEASURABLE_DISTINCT`]).
    fn measurable(&self) -> bool {
        self.delta.is_none_or(|d| d.used.measurable())
    }
    fn bound(&self) -> f64 {
        match (self.mode, self.delta) {
            (AnalyzeMode::Exp, _) => self.stats.exc_bound,
            (AnalyzeMode::Delta, Some(d)) => d.used.dc_bound,
            _ => self.stats.hyb_bound,
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
    /// Per element its previous move in ulps, clipped (delta mode only; all 0 at the first
    /// pair of a window).
    moves: Vec<i8>,
    slots: Vec<(AnalyzeMode, CacheSlot, CacheSlot)>,
}

fn run(opts: &Options) -> Result<bool> {
    let snaps = list_snapshots(&opts.dir)?;
    let want_delta = opts.modes.contains(&AnalyzeMode::Delta);
    let delta_file = opts.dir.join("DELTA_BOUNDS.txt");
    let file_bounds = if want_delta {
        read_delta_bounds(&delta_file)
    } else {
        HashMap::new()
    };
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
                        moves: Vec::new(),
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
            let mut delta = None;
            if want_delta {
                if !consecutive {
                    // The first pair of a window has no previous move.
                    tr.moves.clear();
                    tr.moves.resize(t.elements(), 0);
                } else if let Some(computed) = delta_stats(t.dtype, &tr.prev, bytes, &mut tr.moves)
                {
                    let listed = file_bounds.get(&(snap.step, t.name.clone())).copied();
                    if let Some(f) = listed {
                        let off = (computed.dc_bound - f.dc_bound).abs() / f.dc_bound.abs();
                        // Equal covers two infinite bounds; NaN (an odd file value) disagrees.
                        let agree = computed.dc_bound == f.dc_bound || off <= 0.01;
                        if !agree {
                            eprintln!(
                                "ciera analyze: warning: step {} tensor {}: dc_bound {:.4} computed, {:.4} in {} ({:.1}% apart)",
                                snap.step,
                                t.name,
                                computed.dc_bound,
                                f.dc_bound,
                                delta_file.display(),
                                off * 100.0
                            );
                        }
                    }
                    delta = Some(DeltaRow {
                        used: listed.unwrap_or(computed),
                        computed,
                        from_file: listed.is_some(),
                    });
                }
            }
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
                    delta: if *mode == AnalyzeMode::Delta {
                        delta
                    } else {
                        None
                    },
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
        let mut v = serde_json::json!({
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
        if let Some(d) = &r.delta {
            let o = v.as_object_mut().expect("an object");
            o.insert("unchanged".into(), round(d.used.unchanged, 6).into());
            o.insert("d_bound".into(), round(d.used.d_bound, 4).into());
            o.insert("dc_bound".into(), round(d.used.dc_bound, 4).into());
            o.insert("bound_source".into(), d.source().into());
            o.insert("dc_bound_measurable".into(), d.used.measurable().into());
            if let Some(share) = d.used.distinct {
                o.insert("distinct_share".into(), round(share, 4).into());
            }
            if d.from_file {
                o.insert(
                    "dc_bound_computed".into(),
                    round(d.computed.dc_bound, 4).into(),
                );
            }
        }
        println!("{v}");
    } else {
        let eff = if r.measurable() {
            format!("{:>5.3}", r.ratio() / r.bound())
        } else {
            format!("{:>5}", "-")
        };
        println!(
            "{:>6} {:<28} {:>5} {:>6.4} {:>7.4} {:>6} | {:>6.3} {:>6.3} {} | {:>8.2} {:>8.2}{}",
            r.step,
            r.tensor,
            r.dtype.name(),
            r.stats.p_exp,
            r.stats.q_val,
            r.mode.name(),
            r.ratio(),
            r.bound(),
            eff,
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
            .filter(|r| r.measurable())
            .map(|r| r.ratio() / r.bound())
            .fold(f64::INFINITY, f64::min);
        let worst = if worst.is_finite() {
            format!("{worst:.3}")
        } else {
            "-".to_string()
        };
        // Delta rows: where their bound (dc_bound) came from.
        let source = if m == AnalyzeMode::Delta {
            let listed = sel
                .iter()
                .filter(|r| r.delta.is_some_and(|d| d.from_file))
                .count();
            let unmeasurable = sel.iter().filter(|r| !r.measurable()).count();
            let skipped = if unmeasurable > 0 {
                format!(
                    "; {unmeasurable} not measurable from their sample, left out: over \
                     {MEASURABLE_DISTINCT} distinct (previous move, move) pairs per element"
                )
            } else {
                String::new()
            };
            format!(
                " (eff against dc_bound: {listed} from DELTA_BOUNDS.txt, {} computed{skipped})",
                sel.len() - listed
            )
        } else {
            String::new()
        };
        println!(
            "  {:>8} {:>6}: {:>3} pairs, ratio {:.3}, worst eff {}, exact {}{source}",
            d.name(),
            m.name(),
            sel.len(),
            raw as f64 / fr as f64,
            worst,
            sel.iter().all(|r| r.exact)
        );
    }
}
