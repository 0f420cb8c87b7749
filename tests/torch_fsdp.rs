//! The `ciera` Python package under real PyTorch: FSDP2 trains the MoE example
//! (python/examples/fsdp2_moe.py) with torchrun, 2 and 4 processes, once with gloo's
//! all-gathers and once with CIERA's (FSDP2's `set_custom_all_gather`, through
//! `ciera.torch.attach`), from the same seed: every step's loss and every rank's final
//! parameters must be bit-identical, CIERA must have sent compressed calls after the first
//! iteration and found its caches (hit rate >= 99%); at 2 ranks also with CIERA registered as
//! the torch.distributed backend (`--comm ciera-backend`, no hook). Then
//! python/tests/check_errors.py: bad input gives exceptions naming the problem.
//!
//! The package is assembled here from python/ciera/*.py and the native module this test
//! builds (`cargo build -p ciera-python`), so it tests this checkout, not an installed wheel.
//! Needs torch >= 2.9 in CIERA_VENV or .venv (`.ci/run` installs it); skips visibly without.

#[path = "common/skip.rs"]
mod skip;
#[path = "c/support.rs"]
mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use support::*;

fn venv() -> PathBuf {
    std::env::var_os("CIERA_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(MANIFEST_DIR).join(".venv"))
}

/// The venv's python if it has torch 2.9+ (else the reason).
fn python_with_torch() -> Result<PathBuf, String> {
    let py = venv().join("bin/python");
    if !py.exists() {
        return Err(format!("no {} (run .ci/run, which makes it)", py.display()));
    }
    let o = Command::new(&py)
        .args([
            "-c",
            "import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); \
             sys.exit(0 if v >= (2, 9) else 3)",
        ])
        .output()
        .map_err(|e| format!("running {}: {e}", py.display()))?;
    match o.status.code() {
        Some(0) => Ok(py),
        Some(3) => Err("torch in the venv is older than 2.9 (FSDP2's custom all-gather)".into()),
        _ => Err(format!(
            "no torch in {} (.ci/run installs it): {}",
            venv().display(),
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )),
    }
}

/// python/ciera/*.py plus the freshly built native module, as an importable package.
fn package() -> PathBuf {
    build_libs(&["ciera-python"]);
    let dir = scratch("pypkg");
    let pkg = dir.join("ciera");
    std::fs::create_dir_all(&pkg).unwrap();
    for f in ["__init__.py", "torch.py"] {
        std::fs::copy(
            Path::new(MANIFEST_DIR).join("python/ciera").join(f),
            pkg.join(f),
        )
        .unwrap();
    }
    std::fs::copy(lib_path("lib_ciera.so"), pkg.join("_ciera.abi3.so")).unwrap();
    dir
}

fn train(py: &Path, pkg: &Path, n: usize, comm: &str) -> String {
    let torchrun = py.with_file_name("torchrun");
    let mut cmd = Command::new(&torchrun);
    cmd.args(["--standalone", "--nproc-per-node", &n.to_string()])
        .arg(Path::new(MANIFEST_DIR).join("python/examples/fsdp2_moe.py"))
        .args(["--comm", comm, "--steps", "20"])
        .env("PYTHONPATH", pkg)
        .env("OMP_NUM_THREADS", "1")
        // Every shard of the small example compressed (4 ranks' shards are under the default
        // 64 KiB), and `auto`'s timing decisions out of the way: the stats are then exact.
        .env("CIERA_COMPRESS", "on")
        .env("CIERA_COMPRESS_MIN_BYTES", "4096")
        .env("CIERA_TIMEOUT", "120");
    let o = run_limited(cmd, Duration::from_secs(600));
    assert_success(&format!("torchrun -n {n} fsdp2_moe.py --comm {comm}"), &o);
    text(&o).0
}

/// The lines that must be bit-identical between the runs: losses, and parameters per rank.
fn outcome(out: &str) -> BTreeMap<String, String> {
    out.lines()
        .filter_map(|l| {
            let (k, v) = if l.starts_with("step ") {
                let (a, b) = l.split_once(" loss ")?;
                (a.to_string(), b.to_string())
            } else {
                let (a, b) = l.split_once(" params ")?;
                (format!("{a} params"), b.to_string())
            };
            Some((k, v))
        })
        .collect()
}

#[test]
fn fsdp2_trains_bit_identically_through_ciera() {
    let py = match python_with_torch() {
        Ok(p) => p,
        Err(why) => return skip::skip("fsdp2_trains_bit_identically_through_ciera", &why),
    };
    let pkg = package();
    for n in [2, 4] {
        let gloo = train(&py, &pkg, n, "gloo");
        let ciera = train(&py, &pkg, n, "ciera");
        let (a, b) = (outcome(&gloo), outcome(&ciera));
        assert_eq!(a.len(), 20 + n, "{n} ranks: gloo run printed:\n{gloo}");
        assert_eq!(
            a, b,
            "{n} ranks: gloo and CIERA runs differ:\n{gloo}\n---\n{ciera}"
        );
        for r in 0..n {
            let stats = ciera
                .lines()
                .find_map(|l| l.strip_prefix(&format!("rank {r} ciera ")))
                .unwrap_or_else(|| panic!("{n} ranks: no stats from rank {r}:\n{ciera}"));
            let num = |k: &str| -> f64 {
                let at = stats
                    .find(&format!("\"{k}\": "))
                    .unwrap_or_else(|| panic!("{k}: {stats}"));
                let rest = &stats[at + k.len() + 4..];
                rest[..rest.find([',', '}']).unwrap()]
                    .trim()
                    .parse()
                    .unwrap_or(-1.0)
            };
            // Per step: each block and the root, gathered in forward and (blocks) backward.
            assert!(num("calls") >= 60.0, "{n} ranks, rank {r}: {stats}");
            assert_eq!(
                num("fill_calls") + num("delta_calls"),
                num("calls"),
                "{stats}"
            );
            assert!(
                num("delta_calls") >= num("calls") - 3.0,
                "{n} ranks, rank {r}: {stats}"
            );
            assert!(num("hit_rate") >= 0.99, "{n} ranks, rank {r}: {stats}");
            assert_eq!(num("failed_calls") + num("repairs"), 0.0, "{stats}");
            assert!(num("ratio") > 1.0, "{stats}");
        }
        if n == 2 {
            // CIERA as the torch.distributed backend (no hook): FSDP2's own all-gathers reach
            // it through dist.all_gather_into_tensor; the rest goes to its inner gloo group.
            let backend = train(&py, &pkg, n, "ciera-backend");
            assert_eq!(
                a,
                outcome(&backend),
                "{n} ranks: gloo and the ciera backend differ:\n{backend}"
            );
            let stats = backend
                .lines()
                .find_map(|l| l.strip_prefix("rank 0 ciera "))
                .unwrap_or_else(|| panic!("no stats from the backend run:\n{backend}"));
            assert!(stats.contains("\"calls\": 100,"), "{stats}");
            assert!(stats.contains("\"failed_calls\": 0,"), "{stats}");
        }
        skip::show(&format!(
            "fsdp2 {n} ranks: 20 steps bit-identical with gloo; rank 0 {}\n",
            ciera
                .lines()
                .find(|l| l.starts_with("rank 0 ciera "))
                .unwrap_or("")
        ));
    }
}

#[test]
fn bad_tensors_raise_python_exceptions() {
    let py = match python_with_torch() {
        Ok(p) => p,
        Err(why) => return skip::skip("bad_tensors_raise_python_exceptions", &why),
    };
    let pkg = package();
    let mut cmd = Command::new(&py);
    cmd.arg(Path::new(MANIFEST_DIR).join("python/tests/check_errors.py"))
        .env("PYTHONPATH", &pkg)
        .env_remove("CIERA_RANK")
        .env_remove("CIERA_NRANKS");
    let o = run_limited(cmd, Duration::from_secs(120));
    assert_success("check_errors.py", &o);
    assert!(
        text(&o).0.contains("check_errors: OK 14 checks"),
        "{:?}",
        text(&o)
    );
}
