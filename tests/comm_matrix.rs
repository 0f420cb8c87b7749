//! Allgather correctness over real processes: transport {shm, tcp} x ranks 1..=5 x counts
//! {0, 1, 7, 1000, 1_000_003} x {out of place, in place} x every algorithm, exact bytes checked
//! on every rank; the codec hook (frames of any length, forwarded unchanged); and a job
//! started by mpirun (skipped, with the reason printed, when mpirun is not installed).

#[path = "common/comm_harness.rs"]
mod harness;
#[path = "common/skip.rs"]
mod skip;

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

/// Runs `role` on `n` ranks and asserts that the job succeeded and every rank reported "ok";
/// returns the ranks' stderr.
fn launch_all_ok(n: usize, role: &str, transport: &str, env: &[(&str, &str)]) -> String {
    let out = launch(n, role, env);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
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
    err
}

/// Bytes each rank reported offering by reference (single-copy shm), indexed by rank.
fn single_copy_bytes(stderr: &str) -> Vec<u64> {
    reported_bytes(stderr, "SINGLE_COPY_BYTES ")
}

/// Each rank's "`prefix`RANK BYTES" report, indexed by rank.
fn reported_bytes(stderr: &str, prefix: &str) -> Vec<u64> {
    let mut by_rank: Vec<(usize, u64)> = stderr
        .lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .map(|v| {
            let (rank, bytes) = v.trim().split_once(' ').expect("rank and bytes");
            (rank.parse().unwrap(), bytes.parse().unwrap())
        })
        .collect();
    by_rank.sort_unstable();
    for (i, &(rank, _)) in by_rank.iter().enumerate() {
        assert_eq!(rank, i, "one report per rank: {by_rank:?}");
    }
    by_rank.into_iter().map(|(_, b)| b).collect()
}

/// Runs the matrix for each rank count; returns each run's per-rank single-copy bytes.
fn run_matrix_with(
    transport: &str,
    ranks: std::ops::RangeInclusive<usize>,
    extra_env: &[(&str, &str)],
) -> Vec<Vec<u64>> {
    let mut single = Vec::new();
    for n in ranks {
        let mut env = vec![("CIERA_TRANSPORT", transport)];
        env.extend_from_slice(extra_env);
        let err = launch_all_ok(n, "matrix", transport, &env);
        single.push(single_copy_bytes(&err));
    }
    single
}

/// Every rank of every multi-rank run offered some bytes by reference.
fn assert_all_offered(single: &[Vec<u64>], first_n: usize, what: &str) {
    for (i, per_rank) in single.iter().enumerate() {
        let n = first_n + i;
        assert_eq!(per_rank.len(), n, "{what}, {n} ranks: {per_rank:?}");
        if n > 1 {
            assert!(
                per_rank.iter().all(|&b| b > 0),
                "{what}, {n} ranks: every rank should offer by reference: {per_rank:?}"
            );
        }
    }
}

#[test]
fn matrix_over_shm() {
    // The default (CIERA_SHM_SINGLE_COPY unset = auto): each size class tries the rings and
    // references in turn before it measures, so the two large calls of every configuration
    // (out of place, then in place) go one way each, and every rank offers by reference.
    // Where the ranks outnumber the CPUs, auto keeps to the rings.
    let single = run_matrix_with("shm", 1..=5, &[("CIERA_SHM_SINGLE_COPY", "")]);
    for (i, per_rank) in single.iter().enumerate() {
        let n = i + 1;
        if ciera::comm::oversubscribed(n) {
            assert!(
                per_rank.iter().all(|&b| b == 0),
                "auto, {n} ranks: {per_rank:?}"
            );
        } else {
            assert_all_offered(&single[i..=i], n, "auto");
        }
    }
}

#[test]
fn matrix_over_shm_single_copy() {
    // CIERA_SHM_SINGLE_COPY=1: every big raw segment goes by reference.
    let single = run_matrix_with("shm", 2..=4, &[("CIERA_SHM_SINGLE_COPY", "1")]);
    assert_all_offered(&single, 2, "single copy on");
}

#[test]
fn matrix_over_shm_mixed_ways() {
    // Even ranks send by reference, odd ranks through the rings: every link carries both.
    let single = run_matrix_with(
        "shm",
        2..=3,
        &[
            ("CIERA_SHM_SINGLE_COPY", "auto"),
            ("CIERA_TEST_REFS", "mixed"),
        ],
    );
    for per_rank in &single {
        for (rank, &b) in per_rank.iter().enumerate() {
            assert_eq!(b > 0, rank % 2 == 0, "rank {rank}: {per_rank:?}");
        }
    }
}

#[test]
fn matrix_over_shm_shared_buffers() {
    // Every buffer a fresh SharedBuffer: in the default auto mode, every big raw segment goes
    // by reference and is copied out of the receiver's mapping of the sender's buffer, also
    // where the ranks outnumber the CPUs (auto alone would keep to the rings there).
    for n in 2..=4 {
        let err = launch_all_ok(
            n,
            "matrix",
            "shm",
            &[
                ("CIERA_TRANSPORT", "shm"),
                ("CIERA_SHM_SINGLE_COPY", ""),
                ("CIERA_TEST_SHARED", "1"),
            ],
        );
        let offered = single_copy_bytes(&err);
        let read = reported_bytes(&err, "SHARED_READ_BYTES ");
        assert!(
            offered.iter().all(|&b| b > 0) && read.iter().all(|&b| b > 0),
            "{n} ranks: offered {offered:?}, read from shared buffers {read:?}"
        );
        // Every byte offered was read by some peer through a mapping (none fell back to
        // process_vm_readv).
        assert_eq!(
            offered.iter().sum::<u64>(),
            read.iter().sum::<u64>(),
            "{n} ranks"
        );
    }
}

#[test]
fn matrix_over_shm_through_the_rings() {
    // CIERA_SHM_SINGLE_COPY=0: every byte goes through the rings.
    let single = run_matrix_with("shm", 2..=3, &[("CIERA_SHM_SINGLE_COPY", "0")]);
    assert!(single.iter().flatten().all(|&b| b == 0), "{single:?}");
}

#[test]
fn matrix_over_tcp() {
    let single = run_matrix_with("tcp", 1..=5, &[]);
    assert!(single.iter().flatten().all(|&b| b == 0), "{single:?}");
}

#[test]
fn framed_codec_hook_over_shm_and_tcp() {
    for (transport, n) in [("shm", 3), ("tcp", 4), ("shm", 2)] {
        launch_all_ok(n, "framed", transport, &[("CIERA_TRANSPORT", transport)]);
    }
}

#[test]
fn job_started_by_mpirun() {
    let Ok(which) = std::process::Command::new("sh")
        .args(["-c", "command -v mpirun"])
        .output()
    else {
        skip::skip("job_started_by_mpirun", "cannot run sh");
        return;
    };
    if !which.status.success() {
        skip::skip(
            "job_started_by_mpirun",
            "mpirun is not installed (apt-get install openmpi-bin)",
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
