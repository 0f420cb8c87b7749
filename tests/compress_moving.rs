//! Buffers that move between calls (issue 20 item 11): a program that hands the Allgather a
//! different send buffer from call to call (mpi4py with fresh numpy arrays, a pool of
//! buffers) while the other ranks do otherwise. Keys inferred from addresses then differ
//! between ranks and calls; every result must still be exact, no call may need a repair, a
//! source whose buffer moved costs a FILL of its shard (a *miss*, counted as such), and the
//! ranks must agree on every call's path. The caches stay within `CIERA_CACHE_MB` throughout.

#[path = "common/comm_harness.rs"]
mod harness;

use ciera::comm::{Communicator, Config};
use ciera::compress::{CallKind, CompressMode, GatherOptions};
use ciera::DType;
use harness::*;

/// Rank program: rank r cycles through a pool of 2 + r send buffers (so ranks see their own
/// buffers come back at different periods), then allocates a fresh buffer every call; keys
/// inferred, compression forced on. Reports every call's kind as agreed, and the counts.
fn role_moving() {
    let mut comm = Communicator::from_env(Config::from_env().unwrap()).expect("communicator");
    let (rank, n) = (comm.rank(), comm.size());
    let count = 50_000;
    let dtype = DType::BF16;
    let opts = GatherOptions {
        key: None,
        compress: Some(CompressMode::On),
        cache_mode: None,
        ..GatherOptions::default()
    };
    let mut pool: Vec<Vec<u8>> = (0..2 + rank)
        .map(|_| vec![0u8; count * dtype.size()])
        .collect();
    let mut kept: Vec<Vec<u8>> = Vec::new(); // fresh buffers, kept so no address repeats
    let (mut wrong, mut misses, mut repaired) = (0, 0, 0);
    let mut kinds = String::new();
    let budget: usize = std::env::var("CIERA_CACHE_MB").map_or(4096, |v| v.parse().unwrap()) << 20;
    let mut most_cached = 0;
    for call in 0..40u64 {
        let send: &mut Vec<u8> = if call < 30 {
            &mut pool[call as usize % (2 + rank)]
        } else {
            kept.push(vec![0u8; count * dtype.size()]);
            kept.last_mut().unwrap()
        };
        // Values that change every fourth call (and not in between: deltas of nothing).
        fill(send, dtype, rank, call / 4);
        let want = expected(n, count, dtype, call / 4);
        let mut recv = vec![0u8; want.len()];
        let r = comm
            .all_gather_with(Some(send), &mut recv, count, dtype, &opts)
            .unwrap_or_else(|e| panic!("rank {rank} call {call}: {e}"));
        wrong += u64::from(recv != want);
        misses += r.misses;
        repaired += u64::from(r.repaired);
        most_cached = most_cached.max(comm.compress_stats().cache_bytes);
        kinds.push(match r.kind {
            CallKind::Raw => 'R',
            CallKind::Fill => 'F',
            CallKind::Delta => 'D',
        });
        kinds.push_str(&r.misses.to_string());
    }
    let s = comm.compress_stats();
    report(&format!(
        "wrong={wrong} repaired={repaired} repairs={} misses={misses} stat_misses={} deltas={} \
         over_budget={} evictions={} kinds={kinds}",
        s.repairs,
        s.misses,
        s.delta_calls,
        most_cached > budget,
        s.evictions
    ));
}

#[test]
fn rank_main() {
    let Ok(role) = std::env::var("CIERA_TEST_ROLE") else {
        return;
    };
    match role.as_str() {
        "moving" => role_moving(),
        other => panic!("unknown role {other}"),
    }
}

fn moving_buffers(n: usize, transport: &str, cache_mb: &str) {
    let out = launch(
        n,
        "moving",
        &[("CIERA_TRANSPORT", transport), ("CIERA_CACHE_MB", cache_mb)],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{transport} {n} ranks ({}):\n{err}",
        out.status
    );
    let res = result_lines(&err);
    assert_eq!(res.len(), n, "{err}");
    for line in &res {
        println!("{transport} {n} ranks: {line}");
        assert_eq!(field(line, "wrong"), "0", "a wrong result: {line}");
        assert_eq!(
            field(line, "repaired"),
            "0",
            "a call needed a repair: {line}"
        );
        assert_eq!(field(line, "repairs"), "0", "{line}");
        let misses: u64 = field(line, "misses").parse().unwrap();
        assert!(misses > 0, "moved buffers must show as misses: {line}");
        assert_eq!(field(line, "stat_misses"), misses.to_string(), "{line}");
        let deltas: u64 = field(line, "deltas").parse().unwrap();
        assert!(
            deltas > 0,
            "buffers that came back must send deltas: {line}"
        );
        assert_eq!(
            field(line, "over_budget"),
            "false",
            "caches beyond CIERA_CACHE_MB: {line}"
        );
        // Every rank took the same path in every call and saw the same misses.
        assert_eq!(field(line, "kinds"), field(&res[0], "kinds"), "{err}");
    }
    // The first call fills every cache from a raw call; the last ten (fresh buffers on every
    // rank) miss on every rank.
    let kinds = field(&res[0], "kinds");
    assert!(kinds.starts_with("F0"), "{kinds}");
    assert!(kinds.ends_with(&format!("F{n}")), "{kinds}");
    if cache_mb == "1" {
        // Every fresh buffer starts caches of its own: a 1 MiB budget must evict (the same
        // caches on every rank, or the deltas after it would need repairs).
        assert_ne!(field(&res[0], "evictions"), "0", "{err}");
    }
}

#[test]
fn moving_buffers_cost_misses_not_repairs_shm() {
    moving_buffers(3, "shm", "4096");
}

#[test]
fn moving_buffers_cost_misses_not_repairs_tcp() {
    moving_buffers(2, "tcp", "1");
}
