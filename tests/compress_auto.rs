//! How an `auto` policy starts, over real processes (shm and TCP, 3 ranks): its first call is
//! raw and fills no cache; the raw probe after it predicts, and fills the caches from its own
//! result only where compression may pay, so no compressed call of a tensor whose buffers stay
//! put ever sends FILL frames (a miss); a tensor predicted raw, and never compressed, holds no
//! cache at all. The same after a back-off, which drops the caches: the probe that ends it
//! calibrates against a sample kept at the call before and refills where compression pays.
//!
//! Whether compression pays is a matter of this host's timings, so each run reports which way
//! its predictions went and the test checks what must hold either way, on two kinds of tensor,
//! each gathered for longer than a back-off: one that drifts by a few ulps (compression may pay)
//! and one of fresh random bits every call (it cannot). Each rank gathers two tensors of a kind
//! in turn, so that the second meets the model's error the first one measured
//! (`Stats::model_error`, by size: both are of one). Every result is checked bit for bit.

#[path = "common/comm_harness.rs"]
mod harness;

use ciera::comm::{Communicator, Config};
use ciera::compress::{CallKind, CompressMode, GatherOptions};
use ciera::DType;
use harness::*;

/// Past the first back-off (256 calls after a policy goes raw): the call before the probe that
/// ends it keeps a new sample, and that probe calibrates against it and refills the caches
/// where compression may pay again (checked by the same invariants).
const CALLS: u64 = 280;
const COUNT: usize = 1 << 18;

/// Rank `rank`'s shard at `call`: bf16 values that drift (a few ulps in one element in 16
/// each call) or random bits.
fn shard(rank: usize, call: u64, noise: bool) -> Vec<u8> {
    let mut s = (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ call.wrapping_mul(0xD1B5);
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    (0..COUNT)
        .flat_map(|i| {
            let v = if noise {
                next() as u16
            } else {
                let base = 0x3c00u16 + ((i * 31 + rank * 7) % 700) as u16;
                base + ((i % 16 == 0) as u64 * (call % 3)) as u16
            };
            v.to_le_bytes()
        })
        .collect()
}

fn role_start() {
    let mut comm = Communicator::from_env(Config::from_env().unwrap()).expect("communicator");
    let rank = comm.rank();
    let noise = std::env::var("CIERA_TEST_KIND").as_deref() == Ok("noise");
    for key in [7, 8] {
        let line = gather_tensor(&mut comm, key, noise);
        report(&format!("rank={rank} key={key} {line}"));
    }
}

/// CALLS calls of one tensor (its own key) in `auto` mode: what the test checks of them.
fn gather_tensor(comm: &mut Communicator, key: u64, noise: bool) -> String {
    let (rank, n) = (comm.rank(), comm.size());
    let opts = GatherOptions {
        key: Some(key),
        compress: Some(CompressMode::Auto),
        ..GatherOptions::default()
    };
    let cache_before = comm.compress_stats().cache_bytes;
    let (mut wrong, mut first_cache, mut delta_misses) = (0, usize::MAX, 0);
    let mut kinds = String::new();
    for call in 0..CALLS {
        let want: Vec<u8> = (0..n).flat_map(|r| shard(r, call, noise)).collect();
        let mine = shard(rank, call, noise);
        let mut recv = vec![0xA5u8; want.len()];
        let r = comm
            .all_gather_with(Some(&mine), &mut recv, COUNT, DType::BF16, &opts)
            .unwrap_or_else(|e| panic!("rank {rank} key {key} call {call}: {e}"));
        wrong += u64::from(recv != want);
        if call == 0 {
            // This tensor's caches: what the store holds beyond the ones it held before.
            first_cache = comm
                .compress_stats()
                .cache_bytes
                .saturating_sub(cache_before);
        }
        if r.kind == CallKind::Delta {
            delta_misses += r.misses;
        }
        kinds.push(match r.kind {
            CallKind::Raw => 'R',
            CallKind::Fill => 'F',
            CallKind::Delta => 'D',
        });
    }
    let (_, _, s) = comm
        .slot_stats()
        .into_iter()
        .find(|(k, _, _)| k.id == key)
        .expect("the tensor's policy");
    let stats = comm.compress_stats();
    format!(
        "wrong={wrong} first_cache={first_cache} delta_misses={delta_misses} deltas={} \
         predicted_raw={} end_cache={} model_error={:?} kinds={kinds}",
        s.delta_calls,
        s.predicted_raw,
        // This tensor's caches at the end (the other tensor's are not touched meanwhile).
        stats.cache_bytes as i64 - cache_before as i64,
        stats
            .model_error
            .iter()
            .map(|(c, e)| format!("2^{c}:{e:.2}"))
            .collect::<Vec<_>>()
            .join(","),
    )
}

/// Calls of each of the two tensors of one size that `role_pair` gathers in turn.
const PAIR_CALLS: u64 = 40;

/// Two drifting tensors of one size (keys 11 and 12), gathered in turn call by call, as a
/// model's layers are: the first whose prediction says compression may pay is tried, and the
/// other waits, raw, until the calls of the first have measured the model's error of their
/// size (or for `TRIAL_WAITS` calls). Reports, per tensor, its calls' kinds, its waits, and
/// how many of its compressed calls came while the size had no error yet and the other tensor
/// had already compressed.
fn role_pair() {
    let mut comm = Communicator::from_env(Config::from_env().unwrap()).expect("communicator");
    let (rank, n) = (comm.rank(), comm.size());
    let keys = [11u64, 12];
    let mut kinds = [String::new(), String::new()];
    let mut early = [0u32; 2];
    let mut wrong = 0;
    for call in 0..PAIR_CALLS {
        for (t, &key) in keys.iter().enumerate() {
            let opts = GatherOptions {
                key: Some(key),
                compress: Some(CompressMode::Auto),
                ..GatherOptions::default()
            };
            // Distinct values per tensor (the rank's offset), the same size.
            let at = |r: usize| r + 5 * t;
            let want: Vec<u8> = (0..n).flat_map(|r| shard(at(r), call, false)).collect();
            let mut recv = vec![0u8; want.len()];
            let learned = !comm.compress_stats().model_error.is_empty();
            let other_compressed = kinds[1 - t].contains('D');
            let r = comm
                .all_gather_with(
                    Some(&shard(at(rank), call, false)),
                    &mut recv,
                    COUNT,
                    DType::BF16,
                    &opts,
                )
                .unwrap_or_else(|e| panic!("rank {rank} key {key} call {call}: {e}"));
            wrong += u64::from(recv != want);
            if r.kind == CallKind::Delta && !learned && other_compressed {
                early[t] += 1;
            }
            kinds[t].push(match r.kind {
                CallKind::Raw => 'R',
                CallKind::Fill => 'F',
                CallKind::Delta => 'D',
            });
        }
    }
    let slots = comm.slot_stats();
    for (t, &key) in keys.iter().enumerate() {
        let (_, _, s) = slots
            .iter()
            .find(|(k, _, _)| k.id == key)
            .expect("the tensor's policy");
        report(&format!(
            "rank={rank} key={key} wrong={wrong} early={} waits={} kinds={}",
            early[t], s.trial_waits, kinds[t]
        ));
    }
}

#[test]
fn rank_main() {
    let Ok(role) = std::env::var("CIERA_TEST_ROLE") else {
        return;
    };
    match role.as_str() {
        "start" => role_start(),
        "pair" => role_pair(),
        other => panic!("unknown role {other}"),
    }
}

/// A number of a RESULT line (`field`).
fn num(line: &str, key: &str) -> i64 {
    field(line, key)
        .parse()
        .unwrap_or_else(|_| panic!("{key} in {line}"))
}

#[test]
fn an_auto_policy_fills_caches_only_once_compression_may_pay() {
    for transport in ["shm", "tcp"] {
        for kind in ["drift", "noise"] {
            let out = launch(
                3,
                "start",
                &[("CIERA_TRANSPORT", transport), ("CIERA_TEST_KIND", kind)],
            );
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success(),
                "{transport} {kind}: {}\n{err}",
                out.status
            );
            let lines = result_lines(&err);
            assert_eq!(lines.len(), 6, "{err}");
            for line in &lines {
                println!("{transport} {kind}: {line}");
                assert_eq!(num(line, "wrong"), 0, "a wrong result: {line}");
                assert_eq!(
                    num(line, "first_cache"),
                    0,
                    "caches filled before any prediction: {line}"
                );
                assert!(
                    line.contains("kinds=R"),
                    "the first call must travel raw: {line}"
                );
                assert_eq!(
                    num(line, "delta_misses"),
                    0,
                    "a compressed call sent FILL frames: the probe did not fill: {line}"
                );
                if num(line, "predicted_raw") > 0 && num(line, "deltas") == 0 {
                    assert_eq!(
                        num(line, "end_cache"),
                        0,
                        "a tensor predicted raw holds caches: {line}"
                    );
                }
            }
            // Every rank took the same path for each tensor (agreed decisions).
            for key in ["key=7 ", "key=8 "] {
                let kinds: Vec<&str> = lines
                    .iter()
                    .filter(|l| l.contains(key))
                    .map(|l| l.split("kinds=").nth(1).unwrap())
                    .collect();
                assert_eq!(kinds.len(), 3, "{lines:?}");
                assert!(kinds.iter().all(|k| *k == kinds[0]), "{kinds:?}");
            }
        }
    }
}

/// Two tensors of one size in turn: never both in their first trial before the model's error
/// of their size is known, unless the second waited `TRIAL_WAITS` calls for it; every result
/// exact, every rank on the same path.
#[test]
fn a_second_tensor_of_a_size_waits_for_the_first_ones_trial() {
    for transport in ["shm", "tcp"] {
        let out = launch(3, "pair", &[("CIERA_TRANSPORT", transport)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{transport}: {}\n{err}", out.status);
        let lines = result_lines(&err);
        assert_eq!(lines.len(), 6, "{err}");
        for line in &lines {
            println!("{transport}: {line}");
            assert_eq!(num(line, "wrong"), 0, "a wrong result: {line}");
            assert!(
                num(line, "waits") <= i64::from(ciera::compress::TRIAL_WAITS),
                "waited past the bound: {line}"
            );
            if num(line, "early") > 0 {
                assert_eq!(
                    num(line, "waits"),
                    i64::from(ciera::compress::TRIAL_WAITS),
                    "tried while another tensor of its size was on trial, without waiting: {line}"
                );
            }
        }
        for key in ["key=11 ", "key=12 "] {
            let paths: Vec<String> = lines
                .iter()
                .filter(|l| l.contains(key))
                .map(|l| {
                    format!(
                        "waits={} {}",
                        num(l, "waits"),
                        l.split("kinds=").nth(1).unwrap()
                    )
                })
                .collect();
            assert_eq!(paths.len(), 3, "{lines:?}");
            assert!(paths.iter().all(|k| *k == paths[0]), "{paths:?}");
        }
    }
}
