//! Allgather correctness over real processes: transport {shm, tcp} x ranks 1..=5 x counts
//! {0, 1, 7, 1000, 1_000_003} x {out of place, in place} x every algorithm, exact bytes checked
//! on every rank; the codec hook (frames of any length, forwarded unchanged); and a job
//! started by mpirun (skipped, with the reason printed, when mpirun is not installed).

#[path = "common/comm_harness.rs"]
mod harness;

use ciera::comm::Communicator;
use harness::*;

/// The rank program: does nothing unless a test started this binary as a rank.
#[test]
fn rank_main() {
    let Ok(role) = std::env::var("CIERA_TEST_ROLE") else {
        return;
    };
    match role.as_str() {
        "matrix" => role_matrix(&mut |c| Communicator::from_env(c)),
        "framed" => role_framed(&mut |c| Communicator::from_env(c)),
        other => panic!("unknown role {other}"),
    }
}

fn run_matrix(transport: &str) {
    for n in 1..=5 {
        let out = launch(n, "matrix", &[("CIERA_TRANSPORT", transport)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{transport} with {n} ranks failed ({}):\n{err}",
            out.status
        );
        assert_eq!(
            result_lines(&err),
            vec!["ok"; n],
            "{transport} with {n} ranks:\n{err}"
        );
    }
}

#[test]
fn matrix_over_shm() {
    run_matrix("shm");
}

#[test]
fn matrix_over_tcp() {
    run_matrix("tcp");
}

#[test]
fn framed_codec_hook_over_shm_and_tcp() {
    for (transport, n) in [("shm", 3), ("tcp", 4), ("shm", 2)] {
        let out = launch(n, "framed", &[("CIERA_TRANSPORT", transport)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{transport} with {n} ranks failed ({}):\n{err}",
            out.status
        );
        assert_eq!(
            result_lines(&err),
            vec!["ok"; n],
            "{transport} with {n} ranks:\n{err}"
        );
    }
}

#[test]
fn job_started_by_mpirun() {
    let Ok(which) = std::process::Command::new("sh")
        .args(["-c", "command -v mpirun"])
        .output()
    else {
        println!("SKIPPED job_started_by_mpirun: cannot run sh");
        return;
    };
    if !which.status.success() {
        println!(
            "SKIPPED job_started_by_mpirun: mpirun is not installed (apt-get install openmpi-bin)"
        );
        return;
    }
    // Open MPI gives ranks OMPI_COMM_WORLD_*; with no CIERA_ROOT/CIERA_SECRET, rank 0 publishes
    // the root in a private file (single host) and the others read it.
    let mut c = std::process::Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "3",
        "-x",
        "CIERA_TEST_ROLE=matrix",
        "-x",
        "CIERA_TRANSPORT=auto",
    ])
    .args(self_args())
    .env("CIERA_TEST_ROLE", "matrix")
    .env_remove("CIERA_ROOT")
    .env_remove("CIERA_SECRET")
    .env_remove("CIERA_RANK")
    .env_remove("CIERA_NRANKS");
    let out = c.output().expect("run mpirun");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "mpirun job failed ({}):\n{err}",
        out.status
    );
    assert_eq!(result_lines(&err), vec!["ok"; 3], "{err}");
}
