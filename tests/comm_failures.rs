//! Failures must be clear errors naming who, on every rank, never hangs or garbage: a rank
//! SIGKILLed mid-allgather, a process with the wrong secret, ranks that disagree on the call
//! or on the job, abort from another thread, and a peer that never comes (timeout).

#[path = "common/comm_harness.rs"]
mod harness;

use std::io::{BufRead, BufReader};
use std::sync::mpsc;
use std::time::Duration;

use ciera::comm::{Communicator, Config, UniqueId};
use ciera::{DType, Error};
use harness::*;

#[test]
fn rank_main() {
    let Ok(role) = std::env::var("CIERA_TEST_ROLE") else {
        return;
    };
    let connect = |c: Config| comm_from_test_env(c);
    match role.as_str() {
        "loop" => role_loop(&mut connect(Config::from_env().unwrap()).expect("init")),
        "small_loop" => role_small_loop(&mut connect(Config::from_env().unwrap()).expect("init")),
        "one_call" => role_one_call(&mut connect(Config::from_env().unwrap()).expect("init")),
        "mismatch" => {
            role_mismatch(&mut Communicator::from_env(Config::from_env().unwrap()).expect("init"))
        }
        "init_only" => {
            let r = connect(Config::from_env().unwrap()).map(|_| ());
            report(&describe(&r));
        }
        "abort" => {
            let mut comm = connect(Config::from_env().unwrap()).expect("init");
            if comm.rank() == 1 {
                // Never joins the collective; the test kills this rank at the end.
                loop {
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            let handle = comm.abort_handle();
            let aborter = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                handle.abort();
            });
            let mut recv = vec![0u8; 8 * comm.size()];
            let r = comm.all_gather(&[0u8; 8], &mut recv, 8, DType::U8);
            aborter.join().unwrap();
            let again = comm.all_gather(&[0u8; 8], &mut recv, 8, DType::U8);
            assert!(
                matches!(again, Err(Error::Aborted { .. })),
                "after abort: {again:?}"
            );
            report(&describe(&r));
        }
        "timeout" => {
            let mut comm = connect(Config::from_env().unwrap()).expect("init");
            if comm.rank() == 1 {
                loop {
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            let mut recv = vec![0u8; 8 * comm.size()];
            let r = comm.all_gather(&[0u8; 8], &mut recv, 8, DType::U8);
            report(&describe(&r));
        }
        other => panic!("unknown role {other}"),
    }
}

/// Spawn `n` ranks of job `id` running `role`; returns the children and a reader per rank
/// that collects its stderr, once every rank has printed READY (is inside its loop).
fn spawn_ready(
    id: &UniqueId,
    n: usize,
    role: &str,
    env: &[(&str, &str)],
) -> (
    Vec<std::process::Child>,
    Vec<std::thread::JoinHandle<String>>,
) {
    let mut children: Vec<_> = (0..n).map(|r| spawn_rank(id, n, r, role, env)).collect();
    let (tx, rx) = mpsc::channel();
    let readers: Vec<_> = children
        .iter_mut()
        .enumerate()
        .map(|(rank, c)| {
            let err = c.stderr.take().unwrap();
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut all = String::new();
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    if line == "READY" {
                        let _ = tx.send(rank);
                    }
                    all.push_str(&line);
                    all.push('\n');
                }
                all
            })
        })
        .collect();
    for _ in 0..n {
        rx.recv().expect("a rank died before it was ready");
    }
    (children, readers)
}

fn kill_one_of_four(transport: &str, single_copy: &str, shared_buffers: bool) {
    let id = UniqueId::new().unwrap();
    let env = [
        ("CIERA_TRANSPORT", transport),
        ("CIERA_TIMEOUT", "60"),
        ("CIERA_SHM_SINGLE_COPY", single_copy),
        ("CIERA_TEST_SHARED", if shared_buffers { "1" } else { "0" }),
    ];
    let (mut children, readers) = spawn_ready(&id, 4, "loop", &env);
    // All four are looping over 8 MB-per-rank allgathers: kill rank 2 mid-call.
    children[2].kill().unwrap();
    let mut outputs = Vec::new();
    for (c, reader) in children.iter_mut().zip(readers) {
        let status = c.wait().unwrap();
        outputs.push((status, reader.join().unwrap()));
    }
    for (rank, (status, err)) in outputs.iter().enumerate() {
        println!(
            "{transport} rank {rank}: {status}: {}",
            result_lines(err).join(" | ")
        );
        if rank == 2 {
            continue;
        }
        assert!(
            !status.success(),
            "{transport}: rank {rank} should fail:\n{err}"
        );
        let res = result_lines(err);
        assert_eq!(res.len(), 1, "{transport}: rank {rank}:\n{err}");
        assert!(
            res[0].starts_with("peer_failed peer=2 "),
            "{transport}: rank {rank} should name rank 2 as the failed peer, said: {}",
            res[0]
        );
    }
}

#[test]
fn sigkill_of_one_rank_fails_the_others_naming_it_shm() {
    kill_one_of_four("shm", "0", false);
}

#[test]
fn sigkill_of_one_rank_fails_the_others_naming_it_shm_single_copy() {
    // Peers copy out of each other's memory: the dead rank's offers must fail its readers
    // (process gone), and its own pending claims must not hang anyone.
    kill_one_of_four("shm", "1", false);
}

#[test]
fn sigkill_of_one_rank_fails_the_others_naming_it_shm_shared_buffers() {
    // Peers copy out of their mappings of each other's shared buffers (auto mode): a mapping
    // outlives the dead rank, so what it offered may still be copied (it cannot change any
    // more), but everything after fails, naming it, and nobody waits for its claims.
    kill_one_of_four("shm", "auto", true);
}

#[test]
fn sigkill_of_one_rank_fails_the_others_naming_it_tcp() {
    kill_one_of_four("tcp", "0", false);
}

#[test]
fn wrong_secret_is_refused_and_the_job_still_works() {
    let id = UniqueId::new().unwrap();
    let mut wrong = id.secret();
    wrong[0] ^= 1;
    let intruder_id = UniqueId::from_parts(id.root(), &wrong);
    // The intruder comes first and claims rank 1.
    let intruder = spawn_rank(&intruder_id, 2, 1, "init_only", &[("CIERA_TIMEOUT", "20")]);
    let (status, err) = stderr_of(intruder);
    let res = result_lines(&err);
    assert!(status.success(), "{err}");
    assert_eq!(res.len(), 1, "{err}");
    assert!(res[0].starts_with("bootstrap :: "), "intruder: {}", res[0]);
    assert!(res[0].contains("authenticat"), "intruder: {}", res[0]);
    // The real ranks still form the job.
    let ranks: Vec<_> = (0..2)
        .map(|r| spawn_rank(&id, 2, r, "one_call", &[("CIERA_TIMEOUT", "60")]))
        .collect();
    for (r, c) in ranks.into_iter().enumerate() {
        let (status, err) = stderr_of(c);
        assert!(status.success(), "rank {r}: {err}");
        assert_eq!(result_lines(&err), vec!["ok"], "rank {r}: {err}");
    }
}

#[test]
fn two_processes_claiming_one_rank_are_told_so() {
    let id = UniqueId::new().unwrap();
    let env = [("CIERA_TIMEOUT", "60")];
    let a = spawn_rank(&id, 3, 1, "init_only", &env);
    let b = spawn_rank(&id, 3, 1, "init_only", &env);
    for c in [a, b] {
        let (_, err) = stderr_of(c);
        let res = result_lines(&err);
        assert_eq!(res.len(), 1, "{err}");
        assert!(
            res[0].starts_with("bootstrap :: ") && res[0].contains("two processes claim rank 1"),
            "{}",
            res[0]
        );
    }
}

#[test]
fn ranks_disagreeing_on_nranks_are_told_so() {
    let id = UniqueId::new().unwrap();
    let env = [("CIERA_TIMEOUT", "60")];
    let a = spawn_rank(&id, 3, 0, "init_only", &env);
    let b = spawn_rank(&id, 4, 2, "init_only", &env);
    for c in [a, b] {
        let (_, err) = stderr_of(c);
        let res = result_lines(&err);
        assert_eq!(res.len(), 1, "{err}");
        assert!(
            res[0].starts_with("bootstrap :: ")
                && res[0].contains("disagree on the number of ranks"),
            "{}",
            res[0]
        );
    }
}

fn mismatch(n: usize, odd: usize, what: &str, transport: &str, algo: &str) {
    let odd_s = odd.to_string();
    let out = launch(
        n,
        "mismatch",
        &[
            ("CIERA_TEST_ODD_RANK", &odd_s),
            ("CIERA_TEST_MISMATCH", what),
            ("CIERA_TRANSPORT", transport),
            ("CIERA_ALGO", algo),
            ("CIERA_TIMEOUT", "60"),
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let res = result_lines(&err);
    assert_eq!(
        res.len(),
        n,
        "{what} mismatch over {transport}, {n} ranks:\n{err}"
    );
    for r in &res {
        assert!(
            r.starts_with("call_mismatch :: "),
            "{what} mismatch over {transport}: {r}\n{err}"
        );
    }
}

#[test]
fn mismatched_count_fails_every_rank() {
    mismatch(3, 2, "count", "shm", "ring"); // rank 1 never reads from rank 2 directly
    mismatch(4, 0, "count", "tcp", "auto");
}

#[test]
fn mismatched_dtype_fails_every_rank() {
    mismatch(2, 1, "dtype", "tcp", "auto");
    mismatch(5, 3, "dtype", "shm", "bruck");
}

/// Runs `role` on 2 ranks with `CIERA_TIMEOUT=timeout`; rank 0 must exit cleanly having
/// reported one result; rank 1 is killed afterwards. Returns rank 0's result line.
fn rank0_result_of_two(role: &str, timeout: &str) -> String {
    let id = UniqueId::new().unwrap();
    let env = [("CIERA_TIMEOUT", timeout)];
    let r0 = spawn_rank(&id, 2, 0, role, &env);
    let mut r1 = spawn_rank(&id, 2, 1, role, &env);
    let (status, err) = stderr_of(r0);
    r1.kill().unwrap();
    r1.wait().unwrap();
    assert!(status.success(), "{err}");
    let res = result_lines(&err);
    assert_eq!(res.len(), 1, "{err}");
    res[0].clone()
}

#[test]
fn abort_from_another_thread_unblocks_a_waiting_collective() {
    let res = rank0_result_of_two("abort", "120");
    assert!(res.starts_with("aborted :: "), "{res}");
}

#[test]
fn a_peer_that_never_comes_is_a_timeout_naming_it() {
    let res = rank0_result_of_two("timeout", "1");
    assert!(res.starts_with("timeout peer=Some(1) "), "{res}");
}

/// A rank stopped (SIGSTOP) for longer than the timeout: its peer gives up on it, naming it;
/// when it resumes, it finds a notice blaming itself and must fail with a clear error that
/// says so (it used to panic: "Endpoint::link(1) on rank 1 of 2: no link to itself"). Small
/// calls, so the links hold no backlog and the notice always fits.
fn stopped_rank_resumes_after_its_peer_gave_up(transport: &str) {
    let id = UniqueId::new().unwrap();
    let env = [("CIERA_TRANSPORT", transport), ("CIERA_TIMEOUT", "1")];
    let (mut children, readers) = spawn_ready(&id, 2, "small_loop", &env);
    let stopped = children[1].id() as libc::pid_t;
    // SAFETY: kill(2) on a child of ours that has not been waited for (its pid is ours).
    assert_eq!(unsafe { libc::kill(stopped, libc::SIGSTOP) }, 0);
    // Rank 0 times out on rank 1 (after 1 s without progress) and exits; only then rank 1
    // goes on.
    let status0 = children[0].wait().unwrap();
    // SAFETY: as above; the child is stopped, not reaped.
    assert_eq!(unsafe { libc::kill(stopped, libc::SIGCONT) }, 0);
    let status1 = children[1].wait().unwrap();
    let outputs: Vec<String> = readers.into_iter().map(|r| r.join().unwrap()).collect();
    for (rank, (status, err)) in [status0, status1].iter().zip(&outputs).enumerate() {
        println!(
            "{transport} rank {rank}: {status}: {}",
            result_lines(err).join(" | ")
        );
        assert!(
            !err.contains("panicked"),
            "{transport}: rank {rank} panicked:\n{err}"
        );
        assert_eq!(status.code(), Some(1), "{transport}: rank {rank}:\n{err}");
        assert_eq!(
            result_lines(err).len(),
            1,
            "{transport}: rank {rank}:\n{err}"
        );
    }
    let r0 = &result_lines(&outputs[0])[0];
    assert!(r0.starts_with("timeout peer=Some(1) "), "{transport}: {r0}");
    let r1 = &result_lines(&outputs[1])[0];
    assert!(
        r1.starts_with("aborted :: rank 0 reports that this rank (rank 1) failed"),
        "{transport}: the resumed rank should say its peer gave up on it: {r1}"
    );
}

#[test]
fn a_stopped_rank_that_resumes_is_told_it_was_given_up_shm() {
    stopped_rank_resumes_after_its_peer_gave_up("shm");
}

#[test]
fn a_stopped_rank_that_resumes_is_told_it_was_given_up_tcp() {
    stopped_rank_resumes_after_its_peer_gave_up("tcp");
}
