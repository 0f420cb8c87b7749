//! The device-memory Allgather, multi-process, without a GPU: tests/c/device_app.c (a CUDA
//! program; nothing in it is a test double) runs under `ciera launch` against a stand-in
//! libcuda.so.1 (tests/c/standin_cuda.c: device memory in memfd mappings, streams as threads,
//! legacy IPC through /proc/<pid>/fd), through the C ABI and through the NCCL interposer,
//! over CUDA IPC and host-staged (shm and TCP, compressed), gathering the bundled OLMoE steps
//! with every byte checked. The stand-in's copies are slowed down so that a call not ordered
//! on its stream would read or deliver stale bytes. A rank killed mid-run must be reported by
//! rank; every driver handle must be released at the end. The same program runs on a GPU in
//! bench/gpu_check.sh (nothing measured here is GPU performance).

#[path = "c/support.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use support::*;

struct Built {
    dir: PathBuf,
    ciera_app: PathBuf,
    nccl_app: PathBuf,
}

fn olmoe() -> String {
    Path::new(MANIFEST_DIR)
        .join("tests/data/olmoe-slice")
        .display()
        .to_string()
}

fn build() -> Built {
    build_libs(&["ciera", "ciera-nccl"]);
    let dir = scratch("device");
    let so = |name: &str, src: &str, soname: &str, extra: &[&str]| {
        let mut args = vec![
            "-shared".to_string(),
            "-fPIC".into(),
            format!("-Wl,-soname,{soname}"),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        cc(&dir.join(name), &[c_dir().join(src)], &args);
    };
    so(
        "libcuda.so.1",
        "standin_cuda.c",
        "libcuda.so.1",
        &["-lpthread"],
    );
    so("libnccl.so.2", "fake_nccl.c", "libnccl.so.2", &[]);
    std::os::unix::fs::symlink("libnccl.so.2", dir.join("libnccl.so")).unwrap();
    let lib_dir = profile_dir();
    let common = |extra: &[String]| -> Vec<String> {
        let mut args = vec![
            format!("-I{}", Path::new(MANIFEST_DIR).join("include").display()),
            format!("-I{}", c_dir().display()),
            format!("-L{}", dir.display()),
            "-l:libcuda.so.1".into(),
            format!("-Wl,-rpath,{}", dir.display()),
            "-ldl".into(),
        ];
        args.extend(extra.iter().cloned());
        args
    };
    let ciera_app = dir.join("device_app_ciera");
    cc(
        &ciera_app,
        &[c_dir().join("device_app.c")],
        &common(&[
            format!("-L{}", lib_dir.display()),
            "-lciera".into(),
            format!("-Wl,-rpath,{}", lib_dir.display()),
        ]),
    );
    let nccl_app = dir.join("device_app_nccl");
    cc(
        &nccl_app,
        &[c_dir().join("device_app.c")],
        &common(&["-DUSE_NCCL".into(), "-lnccl".into()]),
    );
    Built {
        dir,
        ciera_app,
        nccl_app,
    }
}

/// `ciera launch -n n -- env ENV... app ARGS...`: the environment goes on the ranks only.
fn launch(n: usize, app: &Path, args: &[String], env: &[(&str, String)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ciera"));
    cmd.args(["launch", "-n", &n.to_string(), "--grace", "30", "--", "env"]);
    for (k, v) in env {
        cmd.arg(format!("{k}={v}"));
    }
    cmd.arg(app).args(args);
    cmd.env("CIERA_TIMEOUT", "60");
    run_limited(cmd, Duration::from_secs(240))
}

fn ok_lines(out: &str, n: usize, what: &str) {
    for r in 0..n {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("device_app rank {r}: OK")))
            .unwrap_or_else(|| panic!("{what}: no OK line from rank {r}:\n{out}"));
        assert!(line.contains("24 calls of 12 step files"), "{what}: {line}");
    }
}

/// Slow stream copies: an allgather that did not wait for the copy in would send the
/// previous call's bytes, and a copy out not ordered after it would read the poison.
const DELAY: (&str, &str) = ("STANDIN_CUDA_COPY_DELAY_US", "3000");

#[test]
fn device_memory_through_the_c_abi_is_exact_and_stream_ordered() {
    let b = build();
    let data = olmoe();
    for (n, ipc, transport, compress) in [
        (2, "1", "auto", "on"),
        (3, "1", "auto", "on"),
        (3, "0", "auto", "on"),
        (2, "0", "tcp", "on"),
        (4, "auto", "auto", "off"),
    ] {
        let what = format!("{n} ranks, CIERA_DEVICE_IPC={ipc}, {transport}, compress {compress}");
        let o = launch(
            n,
            &b.ciera_app,
            &["-".into(), data.clone()],
            &[
                (DELAY.0, DELAY.1.into()),
                ("CIERA_DEVICE_IPC", ipc.into()),
                ("CIERA_TRANSPORT", transport.into()),
                ("CIERA_COMPRESS", compress.into()),
            ],
        );
        assert_success(&what, &o);
        let (out, err) = text(&o);
        ok_lines(&out, n, &what);
        // Host-staged with compression on: the trace's later steps travel as deltas.
        if ipc == "0" && compress == "on" {
            for r in 0..n {
                let stats = out
                    .lines()
                    .find(|l| l.starts_with(&format!("device_app rank {r}: stats")))
                    .unwrap_or_else(|| panic!("{what}: no stats from rank {r}:\n{out}"));
                let deltas: u64 = stats
                    .split(", ")
                    .find_map(|p| p.strip_suffix(" delta calls"))
                    .and_then(|s| s.parse().ok())
                    .unwrap_or_else(|| panic!("{what}: {stats}"));
                assert!(deltas > 0, "{what}: no delta calls: {stats}");
            }
        }
        eprintln!("{what}:\n{out}{err}");
    }
}

#[test]
fn device_memory_through_the_nccl_interposer() {
    let b = build();
    let preload = lib_path("libciera_nccl.so").display().to_string();
    for (n, ipc) in [(3, "auto"), (2, "0")] {
        let log = b.dir.join(format!("nccl-{n}-{ipc}.log"));
        let id = b.dir.join(format!("nccl-{n}-{ipc}.id"));
        let what = format!("interposer, {n} ranks, CIERA_DEVICE_IPC={ipc}");
        let o = launch(
            n,
            &b.nccl_app,
            &[id.display().to_string(), olmoe()],
            &[
                (DELAY.0, DELAY.1.into()),
                ("CIERA_DEVICE_IPC", ipc.into()),
                ("CIERA_COMPRESS", "on".into()),
                ("CIERA_STATS", "1".into()),
                ("LD_PRELOAD", preload.clone()),
                ("FAKE_NCCL_LOG", log.display().to_string()),
                ("FAKE_NCCL_DIR", b.dir.display().to_string()),
            ],
        );
        assert_success(&what, &o);
        let (out, err) = text(&o);
        ok_lines(&out, n, &what);
        // Only the bootstrap's one-byte allgather reached the real NCCL; CIERA served the 24.
        let lines = std::fs::read_to_string(&log).unwrap_or_default();
        let to_nccl = lines
            .lines()
            .filter(|l| l.contains(" ncclAllGather"))
            .count();
        assert_eq!(to_nccl, n, "{what}: allgathers that reached NCCL:\n{lines}");
        for r in 0..n {
            assert!(
                err.lines()
                    .any(|l| l.starts_with(&format!("ciera-nccl: rank {r}/{n}"))
                        && l.contains(": 24 allgathers served by CIERA (12 in place, 0 failed")
                        && l.ends_with(", 0 passed to NCCL")),
                "{what}: rank {r} served all 24:\n{err}"
            );
        }
        eprintln!("{what}:\n{out}{err}");
    }
}

#[test]
fn a_killed_rank_is_reported_by_rank_and_nothing_leaks() {
    let b = build();
    for ipc in ["1", "0"] {
        let what = format!("kill, CIERA_DEVICE_IPC={ipc}");
        let o = launch(
            3,
            &b.ciera_app,
            &["-".into(), olmoe(), "5".into()],
            &[("CIERA_DEVICE_IPC", ipc.into())],
        );
        let (out, err) = text(&o);
        // The launcher exits with the killed rank's status; the others must have reported.
        assert!(
            !o.status.success(),
            "{what}: launcher succeeded:\n{out}{err}"
        );
        for r in [0, 2] {
            let line = out
                .lines()
                .find(|l| l.starts_with(&format!("device_app rank {r}: failure reported")))
                .unwrap_or_else(|| panic!("{what}: rank {r} reported nothing:\n{out}{err}"));
            assert!(line.contains("rank 1"), "{what}: {line}");
        }
        assert!(
            !err.contains("live driver handles"),
            "{what}: leaked handles:\n{err}"
        );
        eprintln!("{what}:\n{out}{err}");
    }
}
