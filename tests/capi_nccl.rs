//! libciera_nccl.so in front of a stand-in libnccl.so.2 (tests/c/fake_nccl.c, host memory,
//! file exchange, logs every call it receives). An unmodified NCCL program (tests/c/nccl_app.c)
//! runs as 3 ranks under `ciera launch`:
//! - with LD_PRELOAD=libciera_nccl.so its AllGathers are served by CIERA: the stand-in sees only
//!   the bootstrap (one 128-byte ncclBroadcast and one 1-byte ncclAllGather per rank) and the
//!   calls we do not interpose (ncclCommCount, ...);
//! - with CIERA_DISABLE=1 every AllGather reaches the stand-in;
//! - with CIERA unable to start (a bad CIERA_TRANSPORT), every rank agrees to stay with NCCL.
//!
//! In all three, every byte gathered is checked by the app.

#[path = "c/support.rs"]
mod support;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use support::*;

const RANKS: usize = 3;
const ITERS: usize = 40;

struct Built {
    dir: PathBuf,
    app: PathBuf,
    preload: PathBuf,
}

fn build() -> Built {
    build_libs(&["ciera-nccl"]);
    let dir = scratch("nccl");
    let fake = dir.join("libnccl.so.2");
    cc(
        &fake,
        &[c_dir().join("fake_nccl.c")],
        &[
            "-shared".into(),
            "-fPIC".into(),
            "-Wl,-soname,libnccl.so.2".into(),
        ],
    );
    std::os::unix::fs::symlink("libnccl.so.2", dir.join("libnccl.so")).unwrap();
    let app = dir.join("nccl_app");
    cc(
        &app,
        &[c_dir().join("nccl_app.c")],
        &[
            format!("-I{}", c_dir().display()),
            format!("-L{}", dir.display()),
            "-lnccl".into(),
            "-lm".into(),
            format!("-Wl,-rpath,{}", dir.display()),
        ],
    );
    Built {
        dir,
        app,
        preload: lib_path("libciera_nccl.so"),
    }
}

/// Runs the app as RANKS ranks; returns (stdout, stderr, the stand-in's log lines).
fn run(b: &Built, name: &str, env: &[(&str, String)]) -> (String, String, Vec<String>) {
    let log = b.dir.join(format!("{name}.log"));
    let id = b.dir.join(format!("{name}.id"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ciera"));
    // The preload goes on the ranks only (through env), not on the launcher.
    cmd.args(["launch", "-n", &RANKS.to_string(), "--", "env"]);
    for (k, v) in env {
        cmd.arg(format!("{k}={v}"));
    }
    cmd.arg(&b.app).arg(&id).arg(ITERS.to_string());
    cmd.env("FAKE_NCCL_LOG", &log)
        .env("FAKE_NCCL_DIR", &b.dir)
        .env("CIERA_TIMEOUT", "60");
    let o = run_limited(cmd, Duration::from_secs(180));
    assert_success(name, &o);
    let (out, err) = text(&o);
    for r in 0..RANKS {
        assert!(
            out.contains(&format!("nccl_app rank {r}: OK {ITERS} allgathers checked")),
            "{name}: rank {r}:\n{out}\n{err}"
        );
    }
    let lines = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    (out, err, lines)
}

fn count(lines: &[String], pat: &str) -> usize {
    lines.iter().filter(|l| l.contains(pat)).count()
}

#[test]
fn nccl_allgathers_are_served_by_ciera_and_the_rest_passes_through() {
    let b = build();

    // Preloaded: the stand-in sees the bootstrap, not the app's gathers.
    let (_, err, log) = run(
        &b,
        "served",
        &[
            ("LD_PRELOAD", b.preload.display().to_string()),
            ("CIERA_STATS", "1".into()),
        ],
    );
    let gathers: Vec<&String> = log.iter().filter(|l| l.contains("AllGather")).collect();
    assert_eq!(
        gathers.len(),
        RANKS,
        "expected only the bootstrap's agreement allgather per rank:\n{gathers:#?}"
    );
    assert!(
        gathers
            .iter()
            .all(|l| l.contains("ncclAllGather count=1 datatype=1")),
        "{gathers:#?}"
    );
    assert_eq!(
        count(&log, "ncclBroadcast count=128 datatype=1 root=0"),
        RANKS,
        "{log:#?}"
    );
    // Calls we do not define reach the real library: the app's own ncclCommCount/UserRank,
    // plus the interposer's (one each per gather call).
    assert!(
        count(&log, "ncclCommCount") >= RANKS * (ITERS + 1),
        "{log:#?}"
    );
    assert!(
        count(&log, "ncclCommUserRank") >= RANKS * (ITERS + 1),
        "{log:#?}"
    );
    assert_eq!(count(&log, "ncclCommInitRank"), RANKS);
    assert_eq!(count(&log, "ncclCommDestroy"), RANKS);
    for r in 0..RANKS {
        let want = format!("ciera-nccl: rank {r}/{RANKS} nccl comm");
        let line = err
            .lines()
            .find(|l| l.starts_with(&want))
            .unwrap_or_else(|| panic!("no stats from rank {r}:\n{err}"));
        assert!(
            line.contains(&format!(": {ITERS} allgathers served by CIERA")),
            "{line}"
        );
        assert!(
            line.contains("0 failed") && line.contains(", 0 passed to NCCL"),
            "{line}"
        );
    }
    eprintln!(
        "served run, stand-in log: {} lines; stats:\n{err}",
        log.len()
    );

    // CIERA_DISABLE=1: pure pass-through, every gather reaches the stand-in.
    let (_, err, log) = run(
        &b,
        "disabled",
        &[
            ("LD_PRELOAD", b.preload.display().to_string()),
            ("CIERA_DISABLE", "1".into()),
        ],
    );
    assert_eq!(count(&log, "AllGather count="), RANKS * ITERS, "{log:#?}");
    assert_eq!(
        count(&log, "pncclAllGather count="),
        RANKS,
        "the app's last call uses the profiling name"
    );
    assert_eq!(count(&log, "ncclBroadcast"), 0);
    assert!(!err.contains("ciera-nccl"), "{err}");

    // CIERA cannot start on any rank: all agree to stay with NCCL; results still exact.
    let (_, err, log) = run(
        &b,
        "fallback",
        &[
            ("LD_PRELOAD", b.preload.display().to_string()),
            ("CIERA_TRANSPORT", "carrier-pigeon".into()),
        ],
    );
    assert_eq!(count(&log, "ncclBroadcast count=128"), RANKS);
    // The agreement allgather plus every one of the app's.
    assert_eq!(
        count(&log, "AllGather count="),
        RANKS * (ITERS + 1),
        "{log:#?}"
    );
    assert!(
        err.contains("CIERA did not start") && err.contains("CIERA_TRANSPORT"),
        "{err}"
    );

    // No preload at all: the same as disabled (the baseline the others are compared with).
    let (_, _, log) = run(&b, "plain", &[]);
    assert_eq!(count(&log, "AllGather count="), RANKS * ITERS);
}

#[test]
fn nccl_interposer_exports_only_allgather() {
    build_libs(&["ciera-nccl"]);
    let syms = exported_symbols(&lib_path("libciera_nccl.so"));
    assert_eq!(syms, ["ncclAllGather", "pncclAllGather"]);
}
