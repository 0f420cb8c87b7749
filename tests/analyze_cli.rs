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

/// `ciera analyze DIR --json`, which must succeed: one JSON object per output line.
fn analyze_json(dir: &Path) -> Vec<serde_json::Value> {
    let out = ciera()
        .arg("analyze")
        .arg(dir)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

#[test]
fn bundled_slice_is_exact_and_near_bounds() {
    let rows = analyze_json(&slice());
    // 4 windows x 2 consecutive pairs x 4 tensors x 3 modes.
    assert_eq!(rows.len(), 4 * 2 * 4 * 3);
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
            _ => assert!(ratio >= 0.85 * hyb, "{r}"),
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
    let rows = analyze_json(&dir);
    assert!(rows.len() >= 3 * 4 * 21, "{} rows", rows.len());
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
            _ => {}
        }
    }
}
