//! libciera_mpi.so under Open MPI: an unmodified MPI program (tests/c/mpi_app.c) run by
//! `mpirun -np 3 -x LD_PRELOAD=...` gathers fp32 and bf16-in-uint16 data exactly, its
//! MPI_COMM_WORLD and split-communicator gathers are served by CIERA (its statistics, printed
//! at MPI_Finalize / MPI_Comm_free with CIERA_STATS=1, say so, one line per communicator), the
//! calls CIERA must not take (a heterogeneous struct, MPI_Iallgather, a one-rank communicator)
//! go to MPI and are counted by reason, and CIERA_DISABLE=1 passes everything through. Ranks
//! describing the same data with different datatypes (tests/c/mpi_mixed.c: legal MPI) are
//! served exactly. Skipped, with the reason printed, where mpicc or mpirun is missing (CI
//! installs openmpi-bin and libopenmpi-dev).

#[path = "common/skip.rs"]
mod skip;
#[path = "c/support.rs"]
mod support;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use support::*;

const RANKS: usize = 3;
const ITERS: usize = 30;

fn mpi_missing() -> Option<String> {
    for tool in ["mpicc", "mpirun"] {
        if !have(tool) {
            return Some(format!(
                "{tool} not found (apt-get install openmpi-bin libopenmpi-dev)"
            ));
        }
    }
    let v = Command::new("mpirun").arg("--version").output().ok()?;
    let v = String::from_utf8_lossy(&v.stdout).to_string() + &String::from_utf8_lossy(&v.stderr);
    (!v.contains("Open MPI"))
        .then(|| format!("mpirun is not Open MPI's (the interposer speaks Open MPI's ABI): {v}"))
}

fn build(name: &str) -> PathBuf {
    let dir = scratch("mpi");
    let exe = dir.join(name);
    cc_with(
        "mpicc",
        &exe,
        &[c_dir().join(format!("{name}.c"))],
        &[format!("-I{}", c_dir().display()), "-lm".into()],
    );
    exe
}

/// `mpirun -np RANKS` of `app args...` with `env`; must succeed.
fn mpirun_with(app: &PathBuf, args: &[String], env: &[(&str, String)]) -> (String, String) {
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &RANKS.to_string(),
    ]);
    for (k, v) in env {
        cmd.args(["-x", &format!("{k}={v}")]);
    }
    cmd.arg(app).args(args);
    let o = run_limited(cmd, Duration::from_secs(180));
    assert_success("mpirun", &o);
    text(&o)
}

/// World allgathers mpi_app serves: two per iteration, a double, two of a float pair type.
const WORLD_SERVED: usize = 2 * ITERS + 3;

fn mpirun(app: &PathBuf, env: &[(&str, String)]) -> (String, String) {
    let (out, err) = mpirun_with(app, &[ITERS.to_string()], env);
    for r in 0..RANKS {
        let want = format!("mpi_app rank {r}: OK {WORLD_SERVED} world allgathers");
        assert!(out.contains(&want), "no '{want}':\n{out}\n{err}");
    }
    (out, err)
}

fn stats_line(err: &str, rank: usize, size: usize) -> &str {
    let head = format!("ciera-mpi: rank {rank}/{size} comm ");
    err.lines()
        .find(|l| l.starts_with(&head))
        .unwrap_or_else(|| panic!("no stats for rank {rank}/{size}:\n{err}"))
}

/// The MPI app and the interposer's path, built; None (after saying why `test` is skipped)
/// without MPI.
fn prepare(test: &str) -> Option<(PathBuf, String)> {
    if let Some(why) = mpi_missing() {
        skip::skip(test, &why);
        return None;
    }
    build_libs(&["ciera-mpi"]);
    let preload = lib_path("libciera_mpi.so").display().to_string();
    Some((build("mpi_app"), preload))
}

#[test]
fn mpi_allgathers_are_served_by_ciera() {
    let Some((app, preload)) = prepare("mpi_allgathers_are_served_by_ciera") else {
        return;
    };
    let (out, err) = mpirun(
        &app,
        &[
            ("LD_PRELOAD", preload.clone()),
            ("CIERA_STATS", "1".into()),
            ("CIERA_MPI_16BIT", "bf16".into()),
            ("CIERA_TIMEOUT", "60".into()),
        ],
    );
    // MPI_COMM_WORLD: every float, uint16, double and float-pair gather was CIERA's; the
    // struct of a float and an int and the MPI_Iallgather went to MPI, and the line says why.
    for r in 0..RANKS {
        let line = stats_line(&err, r, RANKS);
        assert!(
            line.contains(&format!(": {WORLD_SERVED} allgathers served by CIERA")),
            "{line}"
        );
        assert!(
            line.contains(" 0 failed")
                && line.ends_with(", 2 passed to MPI (datatype not served: 1, MPI_Iallgather: 1)"),
            "{line}"
        );
        // malloc'd buffers: nothing to map.
        assert_eq!(shared_read(&err, r), 0, "{line}");
    }
    // The split communicator of the even ranks {0, 2} (size 2) was served too; the odd rank is
    // alone in its half, and a one-rank gather is left to MPI: its line says so.
    for r in [0, 1] {
        let line = stats_line(&err, r, 2);
        assert!(
            line.contains(": 10 allgathers served by CIERA") && line.ends_with(", 0 passed to MPI"),
            "{line}"
        );
    }
    let alone = stats_line(&err, 0, 1);
    assert!(
        alone.contains(
            ": 0 allgathers served by CIERA, 10 passed to MPI (one-rank communicator: 10)"
        ),
        "{alone}"
    );
    eprintln!("{out}{err}");

    // CIERA_DISABLE=1: the same program, nothing served, nothing printed by the interposer.
    let (_, err) = mpirun(
        &app,
        &[
            ("LD_PRELOAD", preload),
            ("CIERA_STATS", "1".into()),
            ("CIERA_DISABLE", "1".into()),
        ],
    );
    assert!(!err.contains("ciera-mpi"), "{err}");
}

/// Bytes rank `rank` of MPI_COMM_WORLD read out of peers' shared buffers, from its stats line.
fn shared_read(err: &str, rank: usize) -> u64 {
    let line = stats_line(err, rank, RANKS);
    line.split("; ")
        .find(|part| part.contains(" B read from peers' shared buffers)"))
        .and_then(|part| part.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no shared-buffer bytes in {line}"))
}

#[test]
fn mpi_alloc_mem_gives_shared_buffers_that_peers_read() {
    let Some((app, preload)) = prepare("mpi_alloc_mem_gives_shared_buffers_that_peers_read") else {
        return;
    };
    // The program takes its buffers from MPI_Alloc_mem; raw gathers (compression off), so
    // big segments go by reference and, the buffers being the interposer's shared buffers,
    // peers copy them out of their mappings. Every element is checked by the program.
    for (alloc_mem, shared) in [("1", true), ("0", false)] {
        let (_, err) = mpirun(
            &app,
            &[
                ("LD_PRELOAD", preload.clone()),
                ("CIERA_STATS", "1".into()),
                ("CIERA_COMPRESS", "off".into()),
                ("CIERA_TIMEOUT", "60".into()),
                ("MPI_APP_ALLOC_MEM", "1".into()),
                ("CIERA_MPI_ALLOC_MEM", alloc_mem.into()),
            ],
        );
        for r in 0..RANKS {
            let bytes = shared_read(&err, r);
            assert_eq!(
                bytes > 0,
                shared,
                "CIERA_MPI_ALLOC_MEM={alloc_mem}: rank {r} read {bytes} B from shared buffers\n{err}"
            );
        }
    }
}

#[test]
fn mpi_interposer_exports_only_its_four_functions() {
    build_libs(&["ciera-mpi"]);
    assert_eq!(
        exported_symbols(&lib_path("libciera_mpi.so")),
        [
            "MPI_Allgather",
            "MPI_Alloc_mem",
            "MPI_Free_mem",
            "MPI_Iallgather"
        ]
    );
}

#[test]
fn ranks_with_different_datatypes_for_one_signature_are_served_exactly() {
    let Some((_, preload)) =
        prepare("ranks_with_different_datatypes_for_one_signature_are_served_exactly")
    else {
        return;
    };
    let app = build("mpi_mixed");
    // 16 elements: latency-bound, raw; 262144: the ring, compressed (drifting floats).
    for count in [16usize, 262_144] {
        let (out, err) = mpirun_with(
            &app,
            &[count.to_string(), "4".into()],
            &[
                ("LD_PRELOAD", preload.clone()),
                ("CIERA_STATS", "1".into()),
                ("CIERA_TIMEOUT", "60".into()),
            ],
        );
        for r in 0..RANKS {
            let ok = format!("mpi_mixed rank {r}: OK 12 allgathers of {count} elements");
            assert!(out.contains(&ok), "no '{ok}':\n{out}\n{err}");
            let line = stats_line(&err, r, RANKS);
            assert!(
                line.contains(": 12 allgathers served by CIERA")
                    && line.ends_with(", 0 passed to MPI"),
                "count {count}: {line}"
            );
        }
    }
}

#[test]
fn stats_show_every_communicator_even_when_nothing_was_served() {
    let Some((app, preload)) =
        prepare("stats_show_every_communicator_even_when_nothing_was_served")
    else {
        return;
    };
    let (out, err) = mpirun_with(
        &app,
        &[ITERS.to_string()],
        &[
            ("LD_PRELOAD", preload),
            ("CIERA_STATS", "1".into()),
            ("MPI_APP_UNSERVED_ONLY", "1".into()),
        ],
    );
    for r in 0..RANKS {
        assert!(
            out.contains(&format!("mpi_app rank {r}: OK 3 unserved calls")),
            "{out}\n{err}"
        );
        let world = stats_line(&err, r, RANKS);
        assert!(
            world.ends_with(
                ": 0 allgathers served by CIERA, 2 passed to MPI (datatype not served: 1, MPI_Iallgather: 1)"
            ),
            "{world}"
        );
    }
    let selves = err
        .lines()
        .filter(|l| {
            l.starts_with("ciera-mpi: rank 0/1 comm ")
                && l.ends_with(
                    ": 0 allgathers served by CIERA, 1 passed to MPI (one-rank communicator: 1)",
                )
        })
        .count();
    assert_eq!(selves, RANKS, "{err}");
}

/// A python3 that imports mpi4py and numpy (Debian's, where pyenv shims hide it), or why none.
fn python_with_mpi4py() -> Result<String, String> {
    for py in ["/usr/bin/python3", "python3"] {
        let ok = Command::new(py)
            .args(["-c", "import mpi4py, numpy"])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Ok(py.to_string());
        }
    }
    Err("no python3 with mpi4py and numpy (apt-get install python3-mpi4py python3-numpy)".into())
}

/// An unmodified mpi4py program (tests/py/mpi4py_drift.py: drifting weights, fresh numpy arrays
/// every step, fp32, bf16 and in place) stays exact under the preload, with compression chosen
/// by policy and forced on; buffers that move are misses, never repairs or mismatched paths
/// (f328414: "mismatched collective calls" at call 33 under auto, 2 repairs forced on).
#[test]
fn mpi4py_drift_under_the_preload_is_exact() {
    let test = "mpi4py_drift_under_the_preload_is_exact";
    let Some((_, preload)) = prepare(test) else {
        return;
    };
    let python = match python_with_mpi4py() {
        Ok(p) => p,
        Err(why) => return skip::skip(test, &why),
    };
    let script = c_dir().join("../py/mpi4py_drift.py");
    let (count, steps) = (262_144usize, 12usize);
    for mode in ["auto", "on"] {
        let (out, err) = mpirun_with(
            &PathBuf::from(&python),
            &[
                script.display().to_string(),
                count.to_string(),
                steps.to_string(),
            ],
            &[
                ("LD_PRELOAD", preload.clone()),
                ("CIERA_STATS", "1".into()),
                ("CIERA_MPI_16BIT", "bf16".into()),
                ("CIERA_COMPRESS", mode.into()),
                ("CIERA_TIMEOUT", "60".into()),
            ],
        );
        let calls = 3 * steps;
        for r in 0..RANKS {
            let ok = format!("mpi4py_drift rank {r}: OK {calls} allgathers, 0 wrong");
            assert!(out.contains(&ok), "{mode}: no '{ok}':\n{out}\n{err}");
            let line = stats_line(&err, r, RANKS);
            println!("{mode}: {line}");
            assert!(
                line.contains(&format!(": {calls} allgathers served by CIERA ("))
                    && line.contains(" 0 failed;")
                    && line.contains("; 0 repairs, "),
                "{mode}: {line}"
            );
            if mode == "on" {
                let misses: u64 = line
                    .split("repairs, ")
                    .nth(1)
                    .and_then(|s| s.split(' ').next())
                    .and_then(|s| s.parse().ok())
                    .unwrap_or_else(|| panic!("no misses in {line}"));
                assert!(misses > 0, "fresh arrays must show as misses: {line}");
            }
        }
    }
}
