//! `ciera analyze` end to end: the bundled real-trace slice is exact and near the bounds, and
//! bad input gets an error that says what is wrong.

#[path = "common/skip.rs"]
mod skip;

use std::path::{Path, PathBuf};
use std::process::Command;

fn ciera() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ciera"))
}

fn slice() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/olmoe-slice")
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ciera-analyze-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `ciera analyze DIR --json ARGS`, which must succeed: one JSON object per output line, and
/// what it wrote to stderr.
fn analyze_json_with(dir: &Path, args: &[&str]) -> (Vec<serde_json::Value>, String) {
    let out = ciera()
        .arg("analyze")
        .arg(dir)
        .arg("--json")
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "stderr: {err}");
    let rows = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    (rows, err)
}

/// `ciera analyze DIR --json`, which must succeed: one JSON object per output line.
fn analyze_json(dir: &Path) -> Vec<serde_json::Value> {
    analyze_json_with(dir, &[]).0
}

#[test]
fn bundled_slice_is_exact_and_near_bounds() {
    let rows = analyze_json(&slice());
    // 4 windows x 2 consecutive pairs x 4 tensors x 4 modes.
    assert_eq!(rows.len(), 4 * 2 * 4 * 4);
    for r in &rows {
        for k in [
            "step",
            "tensor",
            "dtype",
            "mode",
            "ratio",
            "exc_bound",
            "hyb_bound",
            "exact",
            "encode_gbps",
            "decode_gbps",
        ] {
            assert!(r.get(k).is_some(), "missing key {k} in {r}");
        }
        assert_eq!(r["exact"], true, "{r}");
        let ratio = r["ratio"].as_f64().unwrap();
        let (exc, hyb) = (
            r["exc_bound"].as_f64().unwrap(),
            r["hyb_bound"].as_f64().unwrap(),
        );
        match r["mode"].as_str().unwrap() {
            // The slice's tensors are small (12288 values), so headers and tables weigh more
            // than on the full trace; the full-trace thresholds are in the issue note.
            "exp" => assert!(ratio >= 0.93 * exc, "{r}"),
            // Delta slots send the smallest of exp, hybrid and delta chunk by chunk.
            "hybrid" | "auto" | "delta" => assert!(ratio >= 0.85 * hyb, "{r}"),
            m => panic!("unexpected mode {m}: {r}"),
        }
    }
    // The steps reported are the later step of each consecutive pair.
    let steps: std::collections::BTreeSet<u64> =
        rows.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(
        steps.into_iter().collect::<Vec<_>>(),
        vec![1, 2, 101, 102, 301, 302, 598, 599]
    );
}

/// `--mode delta` on the slice (no DELTA_BOUNDS.txt there): every row exact, its ulp-delta
/// statistics computed and sane. The slice's tensors hold 12288 values, so the empirical
/// entropies are those of a small sample (fp32 moves are nearly all distinct: H(d) is close to
/// log2 12288); the full-trace test compares with the trace's own DELTA_BOUNDS.txt.
#[test]
fn delta_mode_on_the_slice_is_exact_with_computed_bounds() {
    let (rows, err) = analyze_json_with(&slice(), &["--mode", "delta"]);
    assert!(!err.contains("warning"), "{err}");
    // 4 windows x 2 consecutive pairs x 4 tensors.
    assert_eq!(rows.len(), 4 * 2 * 4);
    for r in &rows {
        assert_eq!(r["mode"], "delta", "{r}");
        assert_eq!(r["exact"], true, "{r}");
        assert_eq!(r["bound_source"], "computed", "{r}");
        let f = |k: &str| {
            r[k].as_f64()
                .unwrap_or_else(|| panic!("no number {k} in {r}"))
        };
        let (unchanged, d, dc) = (f("unchanged"), f("d_bound"), f("dc_bound"));
        assert!(dc >= d && d >= 1.0, "{r}");
        assert!(dc.is_finite(), "{r}");
        // d = 0 exactly when the bits are equal.
        assert_eq!(unchanged, f("q_val"), "{r}");
        // The first pair of a window has no previous move: no context, dc_bound = d_bound.
        if [1, 101, 301, 598].contains(&r["step"].as_u64().unwrap()) {
            assert_eq!(dc, d, "{r}");
        }
        // The text table's bound for a delta row is dc_bound: eff = ratio / dc_bound.
        assert!(f("ratio") > 1.0, "{r}");
        // A computed dc_bound is measurable where at most 1/8 of the elements are distinct
        // (previous move, move) pairs: every bf16 pair here (moves of a few ulps), no fp32 one
        // (moves of thousands of ulps, nearly all distinct in 12288 values).
        let share = f("distinct_share");
        assert!(share > 0.0 && share <= 1.0, "{r}");
        assert_eq!(
            r["dc_bound_measurable"],
            share <= ciera::cli::analyze::MEASURABLE_DISTINCT,
            "{r}"
        );
        assert_eq!(r["dc_bound_measurable"], r["dtype"] == "bfloat16", "{r}");
    }
    // The summary leaves the unmeasurable rows out of the worst efficiency, and says so.
    let out = ciera()
        .arg("analyze")
        .arg(slice())
        .args(["--mode", "delta"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = |dtype: &str| {
        text.lines()
            .find(|l| l.trim_start().starts_with(dtype) && l.contains("delta:"))
            .unwrap_or_else(|| panic!("no {dtype} summary line in {text}"))
            .to_string()
    };
    assert!(
        line("float").contains("worst eff -,")
            && line("float").contains("16 computed; 16 not measurable"),
        "{text}"
    );
    assert!(!line("bfloat16").contains("not measurable"), "{text}");
    // Adam's momentum makes consecutive moves alike: with the context the bf16 bound rises.
    assert!(
        rows.iter()
            .filter(|r| r["dtype"] == "bfloat16" && r["step"] == 102)
            .all(|r| r["dc_bound"].as_f64() > r["d_bound"].as_f64()),
        "{rows:?}"
    );
}

/// A DELTA_BOUNDS.txt beside the snapshots supplies the bounds of the rows it lists; a value
/// more than 1% from ours is used but warned about; unlisted rows are computed.
#[test]
fn delta_bounds_file_is_used_and_checked() {
    let (computed, _) = analyze_json_with(&slice(), &["--mode", "delta"]);
    let row = |step: u64, tensor: &str| {
        computed
            .iter()
            .find(|r| r["step"] == step && r["tensor"] == tensor)
            .unwrap_or_else(|| panic!("no row {step} {tensor}"))
            .clone()
    };
    let (good, bad) = (
        row(102, "layers.1.attn.qkv.bf16"),
        row(302, "layers.1.experts.w1.bf16"),
    );
    let d = tmpdir("delta-bounds");
    for e in std::fs::read_dir(slice()).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            std::fs::copy(&p, d.join(p.file_name().unwrap())).unwrap();
        }
    }
    let line = |r: &serde_json::Value, dc: f64| {
        format!(
            "  {} {}  unchanged={:.4} d_bound={:.2} dc_bound={:.2}\n",
            r["step"],
            r["tensor"].as_str().unwrap(),
            r["unchanged"].as_f64().unwrap(),
            r["d_bound"].as_f64().unwrap(),
            dc
        )
    };
    let good_dc = good["dc_bound"].as_f64().unwrap();
    let bad_dc = 2.0 * bad["dc_bound"].as_f64().unwrap();
    std::fs::write(
        d.join("DELTA_BOUNDS.txt"),
        format!(
            "# ulp-delta bounds (a test's)\n{}{}",
            line(&good, good_dc),
            line(&bad, bad_dc)
        ),
    )
    .unwrap();
    let (rows, err) = analyze_json_with(&d, &["--mode", "delta"]);
    assert_eq!(rows.len(), computed.len());
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(
        warnings[0].contains("step 302 tensor layers.1.experts.w1.bf16")
            && warnings[0].contains("DELTA_BOUNDS.txt"),
        "{err}"
    );
    for r in &rows {
        assert_eq!(r["exact"], true, "{r}");
        let listed = [
            (102, "layers.1.attn.qkv.bf16", good_dc),
            (302, "layers.1.experts.w1.bf16", bad_dc),
        ]
        .into_iter()
        .find(|(s, t, _)| r["step"] == *s && r["tensor"] == *t);
        match listed {
            Some((_, _, dc)) => {
                assert_eq!(r["bound_source"], "DELTA_BOUNDS.txt", "{r}");
                assert_eq!(
                    r["dc_bound"].as_f64(),
                    Some((dc * 100.0).round() / 100.0),
                    "{r}"
                );
                assert!(r["dc_bound_computed"].as_f64().is_some(), "{r}");
            }
            None => assert_eq!(r["bound_source"], "computed", "{r}"),
        }
    }
}

/// The entropy functions on a sample small enough to count by hand.
#[test]
fn entropies_of_a_hand_made_sample() {
    use ciera::cli::analyze::{conditional_entropy, delta_stats, entropy, entropy_of_counts};
    // X = a a b c: p = 1/2, 1/4, 1/4, H = 1/2 + 2 x 1/4 x 2 = 1.5 bits.
    let x = [7u64, 7, 3, 9];
    assert_eq!(entropy(&x), 1.5);
    assert_eq!(entropy_of_counts([2, 1, 1, 0]), 1.5);
    assert_eq!(entropy(&[5, 5, 5]), 0.0);
    assert_eq!(entropy(&[]), 0.0);
    assert_eq!(entropy(&[0, 1, 2, 3, 4, 5, 6, 7]), 3.0);
    // Contexts 0 1 0 1: {a, b} and {a, c}, one bit each: H(X | C) = 1.
    assert_eq!(conditional_entropy(&x, &[0, 1, 0, 1]), 1.0);
    // Contexts that name the symbol leave nothing: 0; one context for all: H(X).
    assert_eq!(conditional_entropy(&x, &[0, 0, 1, 2]), 0.0);
    assert_eq!(conditional_entropy(&x, &[4, 4, 4, 4]), 1.5);

    // bf16 values moving 0, 0, +1 and -1 ulp (1.0 -> 1.0078125; -1.0 -> -1.0078125, one
    // ulp further from zero is one key lower): d = 0 0 1 0xFFFF, H = 1.5 bits.
    let le = |w: &[u16]| w.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    let v0 = le(&[0x3F80, 0xBF80, 0x3F80, 0xBF80]);
    let v1 = le(&[0x3F80, 0xBF80, 0x3F81, 0xBF81]);
    let mut moves = vec![0i8; 4];
    let s = delta_stats(ciera::DType::BF16, &v0, &v1, &mut moves).unwrap();
    assert_eq!(s.unchanged, 0.5);
    assert_eq!(s.d_bound, 16.0 / 1.5);
    assert_eq!(s.dc_bound, s.d_bound); // first pair: no context
                                       // The moves just made (0 0 +1 -1) are the contexts of the next pair.
    assert_eq!(moves, [0, 0, 1, -1]);
    let v2 = le(&[0x3F80, 0xBF80, 0x3F82, 0xBF82]);
    let s = delta_stats(ciera::DType::BF16, &v1, &v2, &mut moves).unwrap();
    assert_eq!(s.d_bound, 16.0 / 1.5);
    assert_eq!(s.dc_bound, f64::INFINITY); // the context predicts every move
                                           // Moves are clipped to -8..8 (fp32: 32-bit keys; -0.0 -> +0.0 is one ulp up).
    let le32 = |w: &[u32]| w.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    let a = le32(&[0x3F80_0000, 0x8000_0000, 0xBF80_0000]);
    let b = le32(&[0x3F80_0064, 0x0000_0000, 0xBF80_0003]);
    let mut moves = vec![0i8; 3];
    let s = delta_stats(ciera::DType::F32, &a, &b, &mut moves).unwrap();
    assert_eq!(moves, [8, 1, -3]);
    assert_eq!(s.unchanged, 0.0);
    assert_eq!(s.d_bound, 32.0 / 3f64.log2());
}

fn expect_error(args: &[&str], dir: &Path, needle: &str) {
    let out = ciera().arg("analyze").arg(dir).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(err.contains(needle), "expected '{needle}' in: {err}");
}

#[test]
fn missing_folder() {
    expect_error(&[], Path::new("/nonexistent/ciera"), "/nonexistent/ciera");
}

#[test]
fn single_snapshot() {
    let d = tmpdir("single");
    std::fs::copy(
        slice().join("step_00101.safetensors"),
        d.join("step_00101.safetensors"),
    )
    .unwrap();
    expect_error(&[], &d, "found 1 *.safetensors snapshot(s)");
}

#[test]
fn no_consecutive_steps() {
    let d = tmpdir("gap");
    std::fs::copy(
        slice().join("step_00101.safetensors"),
        d.join("step_00101.safetensors"),
    )
    .unwrap();
    std::fs::copy(
        slice().join("step_00300.safetensors"),
        d.join("step_00300.safetensors"),
    )
    .unwrap();
    expect_error(&[], &d, "no two snapshots are consecutive");
}

#[test]
fn not_safetensors() {
    let d = tmpdir("garbage");
    std::fs::copy(
        slice().join("step_00101.safetensors"),
        d.join("step_00101.safetensors"),
    )
    .unwrap();
    std::fs::write(
        d.join("step_00102.safetensors"),
        b"this is not a safetensors file",
    )
    .unwrap();
    expect_error(&[], &d, "step_00102.safetensors: not a safetensors file");
}

#[test]
fn mismatched_shapes() {
    let d = tmpdir("shapes");
    std::fs::copy(
        slice().join("step_00101.safetensors"),
        d.join("step_00101.safetensors"),
    )
    .unwrap();
    // Rewrite the next step with one tensor's shape transposed (same byte count).
    let b = std::fs::read(slice().join("step_00102.safetensors")).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let hdr = String::from_utf8(b[8..8 + n].to_vec())
        .unwrap()
        .replacen("[96,128]", "[128,96]", 1);
    assert_eq!(hdr.len(), n);
    let mut out = b[..8].to_vec();
    out.extend_from_slice(hdr.as_bytes());
    out.extend_from_slice(&b[8 + n..]);
    std::fs::write(d.join("step_00102.safetensors"), out).unwrap();
    expect_error(&[], &d, "[128, 96] here but");
}

#[test]
fn bad_mode() {
    expect_error(&["--mode", "zstd"], &slice(), "unknown mode 'zstd'");
}

/// The acceptance thresholds on the full trace, when it is beside the repository
/// (../shared/traces/olmoe-mini-s0; CI has it): exact everywhere, bf16 exp >= 0.95 x exc_bound,
/// bf16 hybrid >= 0.85 x hyb_bound, fp32 exp >= 0.95 x exc_bound, on every pair.
#[test]
fn full_trace_meets_bounds() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces/olmoe-mini-s0");
    if !dir.is_dir() {
        skip::skip(
            "full_trace_meets_bounds",
            &format!("{} not present", dir.display()),
        );
        return;
    }
    let (rows, err) = analyze_json_with(&dir, &[]);
    assert!(rows.len() >= 4 * 4 * 21, "{} rows", rows.len());
    // Our dc_bound agrees with the trace's DELTA_BOUNDS.txt (a warning if not).
    assert!(!err.contains("warning"), "{err}");
    for r in &rows {
        assert_eq!(r["exact"], true, "{r}");
        let ratio = r["ratio"].as_f64().unwrap();
        let (exc, hyb) = (
            r["exc_bound"].as_f64().unwrap(),
            r["hyb_bound"].as_f64().unwrap(),
        );
        match (r["dtype"].as_str().unwrap(), r["mode"].as_str().unwrap()) {
            (_, "exp") => assert!(ratio >= 0.95 * exc, "{r}"),
            ("bfloat16", "hybrid") => assert!(ratio >= 0.85 * hyb, "{r}"),
            ("bfloat16", "delta") if dir.join("DELTA_BOUNDS.txt").is_file() => {
                assert_eq!(r["bound_source"], "DELTA_BOUNDS.txt", "{r}");
                let (dc, ours) = (
                    r["dc_bound"].as_f64().unwrap(),
                    r["dc_bound_computed"].as_f64().unwrap(),
                );
                assert!((dc - ours).abs() <= 0.01 * dc, "{r}");
            }
            _ => {}
        }
    }
}
