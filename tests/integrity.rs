//! `CIERA_VERIFY=1` covers every delivered byte: with bytes of a shared-memory ring overwritten
//! while a job runs (a fault injector in one rank writes into its ring mappings through
//! /proc/self/mem, as another process on the host could), every call either returns the exact
//! tensor or fails with an error; none returns wrong bytes. Raw and compressed calls alike.

#[path = "common/comm_harness.rs"]
mod harness;
#[path = "common/skip.rs"]
mod skip;

use std::io::{Seek, SeekFrom, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ciera::comm::{Config, UniqueId};
use ciera::compress::{CompressMode, GatherOptions};
use ciera::DType;
use harness::*;

/// The data regions of this process's shm link segments (memory files `ciera-*`, not the
/// doorbells), from /proc/self/maps: skip the 4 KiB header of counters, so the injector hits
/// the bytes in flight, not the ring's bookkeeping.
fn ring_regions() -> Vec<(u64, u64)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter(|l| {
            (l.contains("/dev/shm/ciera-") || l.contains("/memfd:ciera-")) && !l.contains("-bell")
        })
        .filter_map(|l| {
            let range = l.split_whitespace().next()?;
            let (a, b) = range.split_once('-')?;
            let (a, b) = (
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            );
            (b - a > 8192).then_some((a + 4096, b))
        })
        .collect()
}

/// Overwrite a few bytes somewhere in the rings every few microseconds until `stop`.
fn inject(stop: Arc<AtomicBool>) -> usize {
    let regions = ring_regions();
    assert!(!regions.is_empty(), "no shm ring mapped");
    let mut mem = std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/self/mem")
        .expect("/proc/self/mem");
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut writes = 0;
    while !stop.load(Ordering::Relaxed) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let (a, b) = regions[(x % regions.len() as u64) as usize];
        let at = a + (x >> 8) % (b - a - 16);
        if mem.seek(SeekFrom::Start(at)).is_ok() && mem.write_all(&x.to_le_bytes()).is_ok() {
            writes += 1;
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    writes
}

/// Rank program: 2 ranks over shm rings, 4 MB shards, up to 150 calls checked element by
/// element; rank 1 runs the injector. Reports how many calls returned Ok with wrong bytes, how
/// many were repaired, and the error that ended the loop, if one did.
fn role_corrupt(mode: CompressMode) {
    let mut comm = comm_from_test_env(Config::from_env().unwrap()).expect("communicator");
    let (rank, n) = (comm.rank(), comm.size());
    let stop = Arc::new(AtomicBool::new(false));
    let injector = (rank == 1).then(|| {
        let stop = stop.clone();
        std::thread::spawn(move || inject(stop))
    });
    let count = 1 << 20;
    let dtype = DType::BF16;
    let opts = GatherOptions {
        key: Some(1),
        compress: Some(mode),
        cache_mode: None,
        ..GatherOptions::default()
    };
    let (mut wrong_ok, mut calls) = (0u64, 0u64);
    let mut ended = "none".to_string();
    for call in 0..150u64 {
        let mut send = vec![0u8; count * dtype.size()];
        // Slowly drifting values, so compressed calls send deltas.
        fill(&mut send, dtype, rank, call / 8);
        let want = expected(n, count, dtype, call / 8);
        let mut recv = vec![0u8; want.len()];
        match comm.all_gather_with(Some(&send), &mut recv, count, dtype, &opts) {
            Ok(_) => {
                calls += 1;
                if recv != want {
                    wrong_ok += 1;
                }
            }
            Err(e) => {
                ended = e.to_string().replace(' ', "_");
                break;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let writes = injector.map_or(0, |h| h.join().unwrap());
    report(&format!(
        "wrong_ok={wrong_ok} calls={calls} repairs={} writes={writes} ended={ended}",
        comm.compress_stats().repairs
    ));
}

#[test]
fn rank_main() {
    let Ok(role) = std::env::var("CIERA_TEST_ROLE") else {
        return;
    };
    match role.as_str() {
        "corrupt_raw" => role_corrupt(CompressMode::Off),
        "corrupt_compressed" => role_corrupt(CompressMode::On),
        other => panic!("unknown role {other}"),
    }
}

fn corrupted_rings_never_give_wrong_bytes(role: &str) {
    if std::fs::File::options()
        .write(true)
        .open("/proc/self/mem")
        .is_err()
    {
        skip::skip(
            role,
            "this process may not write /proc/self/mem (the fault injector needs it)",
        );
        return;
    }
    let id = UniqueId::new().unwrap();
    let env = [
        ("CIERA_TRANSPORT", "shm"),
        ("CIERA_SHM_SINGLE_COPY", "0"),
        ("CIERA_VERIFY", "1"),
        ("CIERA_TIMEOUT", "20"),
    ];
    let children: Vec<_> = (0..2).map(|r| spawn_rank(&id, 2, r, role, &env)).collect();
    let mut detected = 0;
    for (rank, c) in children.into_iter().enumerate() {
        let (status, err) = stderr_of(c);
        let res = result_lines(&err);
        assert_eq!(res.len(), 1, "{role} rank {rank} ({status}):\n{err}");
        println!("{role} rank {rank}: {}", res[0]);
        assert!(status.success(), "{role} rank {rank}:\n{err}");
        assert_eq!(
            field(&res[0], "wrong_ok"),
            "0",
            "{role} rank {rank} returned wrong bytes from a call that succeeded: {}",
            res[0]
        );
        let repairs: u64 = field(&res[0], "repairs").parse().unwrap();
        detected += repairs + u64::from(field(&res[0], "ended") != "none");
        assert!(
            !err.contains("panicked"),
            "{role} rank {rank} panicked:\n{err}"
        );
    }
    // The injector did hit bytes in flight (else this test proves nothing).
    assert!(detected > 0, "{role}: no corruption was detected at all");
}

#[test]
fn verify_catches_corrupted_raw_calls() {
    corrupted_rings_never_give_wrong_bytes("corrupt_raw");
}

#[test]
fn verify_catches_corrupted_compressed_calls_and_their_repairs() {
    corrupted_rings_never_give_wrong_bytes("corrupt_compressed");
}
