//! The compressed Allgather over real processes, replaying a real training trace: rank r sends
//! slice r of each tensor at step t, iterations walk the snapshots in order (consecutive steps
//! within each window), every received bit is checked. bf16 and fp32, 2..5 ranks, shm and TCP,
//! in place and out of place. Uses ../shared/traces/olmoe-mini-s0 when it is beside the
//! repository (CI has it), else the bundled slice. Also: a rank that loses its caches mid-run
//! (a restarted peer) is detected, repaired, and every result stays exact.

#[path = "common/comm_harness.rs"]
mod harness;
#[path = "common/trace_data.rs"]
mod trace_data;

use ciera::comm::{Communicator, Config};
use ciera::compress::{CompressMode, GatherOptions};
use harness::*;
use trace_data::{snapshots, trace_dir};

/// Rank program: replay the trace through the communicator's compressed Allgather with
/// compression forced on.
fn role_trace(comm: &mut Communicator) {
    let (rank, n) = (comm.rank(), comm.size());
    let lose_cache_at: Option<usize> = std::env::var("CIERA_TEST_LOSE_CACHE")
        .ok()
        .map(|v| v.parse().unwrap());
    let snaps = snapshots(&trace_dir());
    for (si, st) in snaps.iter().enumerate() {
        if lose_cache_at == Some(si) && rank == 1 {
            comm.reset_caches(); // rank 1 "restarts": its caches are gone, the others' are not
        }
        for (ti, t) in st.tensors.iter().enumerate() {
            let full = st.bytes(t);
            let es = t.dtype.size();
            let total = t.elements();
            let count = total.div_ceil(n);
            // The gathered tensor: the real values, zero-padded to n * count elements.
            let mut want = vec![0u8; n * count * es];
            want[..full.len()].copy_from_slice(full);
            let shard = &want[rank * count * es..(rank + 1) * count * es];
            for in_place in [false, true] {
                let opts = GatherOptions {
                    key: Some((ti * 2 + in_place as usize) as u64),
                    compress: Some(CompressMode::On),
                    cache_mode: None,
                    ..GatherOptions::default()
                };
                let mut recv = vec![0xA5u8; want.len()];
                let r = if in_place {
                    recv[rank * count * es..(rank + 1) * count * es].copy_from_slice(shard);
                    comm.all_gather_with(None, &mut recv, count, t.dtype, &opts)
                } else {
                    comm.all_gather_with(Some(shard), &mut recv, count, t.dtype, &opts)
                };
                let ctx = format!(
                    "rank {rank}/{n} snapshot {si} {} in_place={in_place}",
                    t.name
                );
                if let Err(e) = r {
                    report(&format!("error {ctx}: {e}"));
                    std::process::exit(1);
                }
                if recv != want {
                    let i = recv.iter().zip(&want).position(|(a, b)| a != b).unwrap();
                    report(&format!("WRONG {ctx}: first differing byte {i}"));
                    std::process::exit(1);
                }
            }
        }
    }
    let s = comm.compress_stats();
    report(&format!(
        "ok fill={} delta={} repairs={} ratio={:.3} raw_calls={}",
        s.fill_calls,
        s.delta_calls,
        s.repairs,
        s.ratio(),
        s.raw_calls
    ));
}

#[test]
fn rank_main() {
    let Ok(role) = std::env::var("CIERA_TEST_ROLE") else {
        return;
    };
    let mut comm = Communicator::from_env(Config::from_env().unwrap()).expect("communicator");
    match role.as_str() {
        "trace" => role_trace(&mut comm),
        other => panic!("unknown role {other}"),
    }
}

fn parse_ok(line: &str) -> (u64, u64, u64, f64) {
    let mut f = (0, 0, 0, 0.0);
    for kv in line.split_whitespace().skip(1) {
        let (k, v) = kv.split_once('=').unwrap();
        match k {
            "fill" => f.0 = v.parse().unwrap(),
            "delta" => f.1 = v.parse().unwrap(),
            "repairs" => f.2 = v.parse().unwrap(),
            "ratio" => f.3 = v.parse().unwrap(),
            _ => {}
        }
    }
    f
}

fn run(transport: &str, n: usize, extra: &[(&str, &str)]) -> Vec<(u64, u64, u64, f64)> {
    let mut env = vec![("CIERA_TRANSPORT", transport)];
    env.extend_from_slice(extra);
    let out = launch(n, "trace", &env);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{transport} x {n} ranks failed ({}):\n{err}",
        out.status
    );
    let lines = result_lines(&err);
    assert_eq!(lines.len(), n, "{err}");
    lines
        .iter()
        .map(|l| {
            assert!(l.starts_with("ok "), "{transport} x {n}: {l}");
            parse_ok(l)
        })
        .collect()
}

#[test]
fn trace_exact_shm_and_tcp_2_to_5_ranks() {
    eprintln!("trace: {}", trace_dir().display());
    for transport in ["shm", "tcp"] {
        for n in 2..=5 {
            for (fill, delta, repairs, ratio) in run(transport, n, &[]) {
                assert!(
                    delta > fill,
                    "{transport} x {n}: {delta} delta calls vs {fill} fills"
                );
                assert_eq!(repairs, 0);
                // Mixed bf16 and fp32 tensors, full-value caches: well above 1.
                assert!(ratio > 1.3, "{transport} x {n}: ratio {ratio}");
            }
        }
    }
}

/// CIERA_VERIFY=1: every receiver checks every decoded shard against its sender's hash (an
/// extra status exchange per call); results stay exact and nothing is flagged.
#[test]
fn verify_mode_is_exact() {
    for (_, delta, repairs, _) in run("tcp", 3, &[("CIERA_VERIFY", "1")]) {
        assert!(delta > 0);
        assert_eq!(repairs, 0);
    }
}

#[test]
fn restarted_rank_is_repaired_and_exact() {
    for (_, _, repairs, _) in run("shm", 3, &[("CIERA_TEST_LOSE_CACHE", "3")]) {
        // Every rank learns of the failure from the status exchange and counts the repair.
        assert!(repairs >= 1, "no repair recorded");
    }
}
