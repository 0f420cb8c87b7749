//! The Allgather over RDMA links for real (feature `rdma`): `ciera perf --trace` on the bundled
//! trace slice (consecutive steps, raw and compressed, every received bit checked) with
//! `CIERA_TRANSPORT=rdma` at 2 and 3 ranks; a rank SIGKILLed mid-transfer named by rank on
//! every other rank; a `CIERA_IB_HCA` that names no device named. Needs an RDMA device:
//! bench/rxe_guest.sh runs this in a QEMU guest with a soft-RoCE device (and
//! CIERA_REQUIRE_RDMA=1, which turns a missing device into a failure); elsewhere the tests
//! print why they skip. Sizes are small: the guest's soft-RoCE
//! moves about 100 Mbit/s under full emulation.
//!
//! Without the feature (the README's `cargo test --workspace`) one test runs instead: the
//! default build of libciera.so does not depend on libibverbs.

#[path = "common/skip.rs"]
mod skip;
#[path = "c/support.rs"]
mod support;

#[cfg(not(feature = "rdma"))]
#[test]
fn the_default_build_does_not_link_libibverbs() {
    use support::*;
    if !have("ldd") {
        return skip::skip("the_default_build_does_not_link_libibverbs", "no ldd");
    }
    build_libs(&["ciera"]);
    let lib = lib_path("libciera.so");
    let o = std::process::Command::new("ldd")
        .arg(&lib)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "ldd {}: {out}{err}", lib.display());
    assert!(!out.contains("libibverbs"), "ldd {}:\n{out}", lib.display());
    assert!(out.contains("libc.so"), "ldd {}:\n{out}", lib.display());
}

#[cfg(feature = "rdma")]
mod over_rdma {
    use super::{skip, support};
    use std::io::{BufRead, BufReader};
    use std::path::Path;
    use std::process::{Child, Command, Stdio};
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use support::*;

    /// Why RDMA cannot run here; panics instead under CIERA_REQUIRE_RDMA=1.
    fn cannot(test: &str) -> bool {
        match ciera_transport::rdma_unavailable_reason() {
            None => false,
            Some(why) if std::env::var("CIERA_REQUIRE_RDMA").as_deref() == Ok("1") => {
                panic!("{test}: CIERA_REQUIRE_RDMA=1 but {why}")
            }
            Some(why) => {
                skip::skip(test, &format!("skipped: {why}"));
                true
            }
        }
    }

    fn data() -> String {
        Path::new(MANIFEST_DIR)
            .join("tests/data/olmoe-slice")
            .display()
            .to_string()
    }

    /// Bytes gathered per call: whole bf16 elements per rank at 2 and 3 ranks.
    const SIZE: &str = "96K";

    fn perf_args(iters: &str, modes: &str) -> Vec<String> {
        [
            "perf",
            "--trace",
            &data(),
            "-b",
            SIZE,
            "-e",
            SIZE,
            "-i",
            iters,
            "-w",
            "1",
            "--modes",
            modes,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    #[test]
    fn allgather_over_rdma_is_exact_raw_and_compressed_at_2_and_3_ranks() {
        let test = "allgather_over_rdma_is_exact_raw_and_compressed_at_2_and_3_ranks";
        if cannot(test) {
            return;
        }
        for n in [2, 3] {
            let mut c = Command::new(env!("CARGO_BIN_EXE_ciera"));
            c.args(["launch", "-n", &n.to_string(), "--"])
                .arg(env!("CARGO_BIN_EXE_ciera"))
                .args(perf_args("2", "raw,delta-on"))
                .env("CIERA_TRANSPORT", "rdma")
                .env("CIERA_TIMEOUT", "300");
            let o = run_limited(c, Duration::from_secs(900));
            let (out, err) = text(&o);
            assert!(o.status.success(), "{n} ranks:\n{out}\n{err}");
            assert!(out.contains("transport Rdma"), "{n} ranks:\n{out}");
            assert!(out.contains("# wrong elements: 0 OK"), "{n} ranks:\n{out}");
            for mode in [" raw ", " delta-on "] {
                let rows: Vec<&str> = out.lines().filter(|l| l.contains(mode)).collect();
                assert!(
                    rows.len() >= 2,
                    "{n} ranks, {mode}: windows of steps:\n{out}"
                );
                assert!(
                    rows.iter().all(|l| l.trim_end().ends_with(" 0")),
                    "{n} ranks:\n{out}"
                );
            }
            skip::show(&format!("{n} ranks over RDMA:\n{out}"));
        }
    }

    #[test]
    fn a_missing_rdma_device_is_named() {
        let test = "a_missing_rdma_device_is_named";
        if cannot(test) {
            return;
        }
        let mut c = Command::new(env!("CARGO_BIN_EXE_ciera"));
        c.args(["launch", "-n", "2", "--"])
            .arg(env!("CARGO_BIN_EXE_ciera"))
            .args(perf_args("1", "raw"))
            .env("CIERA_TRANSPORT", "rdma")
            .env("CIERA_IB_HCA", "no_such_hca0")
            .env("CIERA_TIMEOUT", "60");
        let o = run_limited(c, Duration::from_secs(300));
        let (out, err) = text(&o);
        assert!(!o.status.success(), "{out}\n{err}");
        assert!(
            err.contains("CIERA_TRANSPORT=rdma on rank")
                && err.contains("CIERA_IB_HCA=no_such_hca0 is not one of"),
            "{out}\n{err}"
        );
        skip::show(&format!("CIERA_IB_HCA=no_such_hca0:\n{err}"));
    }

    fn spawn_lines(child: &mut Child) -> (mpsc::Receiver<String>, mpsc::Receiver<String>) {
        let pipe = |r: Box<dyn std::io::Read + Send>| {
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(r).lines().map_while(Result::ok) {
                    let _ = tx.send(line);
                }
            });
            rx
        };
        (
            pipe(Box::new(child.stdout.take().unwrap())),
            pipe(Box::new(child.stderr.take().unwrap())),
        )
    }

    #[test]
    fn a_rank_killed_mid_transfer_is_named_by_every_other_rank() {
        let test = "a_rank_killed_mid_transfer_is_named_by_every_other_rank";
        if cannot(test) {
            return;
        }
        // Started by hand (as another launcher would), so every rank reports, not the launcher.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let secret: String = (0..32).map(|i| format!("{:02x}", i * 7 + 3)).collect();
        let n = 3;
        let mut ranks: Vec<Child> = (0..n)
            .map(|r| {
                Command::new(env!("CARGO_BIN_EXE_ciera"))
                    .args(perf_args("100000", "raw"))
                    .env("CIERA_RANK", r.to_string())
                    .env("CIERA_NRANKS", n.to_string())
                    .env("CIERA_ROOT", format!("127.0.0.1:{port}"))
                    .env("CIERA_SECRET", &secret)
                    .env("CIERA_TRANSPORT", "rdma")
                    .env("CIERA_TIMEOUT", "300")
                    .env_remove("CIERA_ROOT_SERVED")
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("ciera perf")
            })
            .collect();
        let pipes: Vec<_> = ranks.iter_mut().map(spawn_lines).collect();
        // Once rank 0 prints its column header the timed calls run: let some go, then kill.
        let started = Instant::now();
        let mut out = String::new();
        loop {
            match pipes[0].0.recv_timeout(Duration::from_secs(5)) {
                Ok(l) => {
                    out.push_str(&l);
                    out.push('\n');
                    if l.starts_with("#    window") {
                        break;
                    }
                }
                Err(_) if started.elapsed() > Duration::from_secs(400) => {
                    for r in &mut ranks {
                        let _ = r.kill();
                    }
                    panic!("the job never started its timed calls:\n{out}");
                }
                Err(_) => {}
            }
        }
        std::thread::sleep(Duration::from_secs(2));
        ranks[2].kill().expect("SIGKILL rank 2");
        let _ = ranks[2].wait();
        let mut errs = vec![String::new(); n];
        let deadline = Instant::now() + Duration::from_secs(120);
        for r in 0..2 {
            let status = loop {
                if let Some(s) = ranks[r].try_wait().unwrap() {
                    break Some(s);
                }
                if Instant::now() > deadline {
                    let _ = ranks[r].kill();
                    break None;
                }
                std::thread::sleep(Duration::from_millis(100));
            };
            while let Ok(l) = pipes[r].1.recv_timeout(Duration::from_millis(500)) {
                errs[r].push_str(&l);
                errs[r].push('\n');
            }
            let want = format!("ciera perf: rank {r} (on ");
            assert!(
                status.is_some_and(|s| !s.success()),
                "rank {r} did not fail after rank 2 was killed ({status:?}):\n{}",
                errs[r]
            );
            assert!(
                errs[r]
                    .lines()
                    .any(|l| l.starts_with(&want) && l.contains("stopped: rank 2 failed")),
                "rank {r} did not name rank 2:\n{}",
                errs[r]
            );
        }
        skip::show(&format!(
            "rank 2 killed mid-transfer:\n{}{}",
            errs[0], errs[1]
        ));
    }
}
