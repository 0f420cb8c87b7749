//! `cargo bench --bench codec`: single-thread encode and decode throughput of the codec on
//! 64 MiB of real trace weights (bf16 and fp32, tiled), each printed with its ratio to a memcpy
//! of the same bytes measured in the same run, right before that row (last column). Set
//! CIERA_TRACE to another trace folder; by default ../shared/traces/olmoe-mini-s0 when
//! present, else the slice bundled in tests/data.
//! CIERA_BENCH_CLOCK=cpu times with the thread's CPU time instead of wall time (for a shared,
//! noisy machine; memcpy is timed the same way).
//! CIERA_BENCH_CODEC_THREADS=N encodes and decodes Delta frames on N threads
//! (`set_codec_threads`; the other frames stay on one); time it by the wall clock.

#[path = "../tests/common/trace_data.rs"]
mod trace_data;

use std::path::PathBuf;
/// Wall time, or with CIERA_BENCH_CLOCK=cpu this thread's CPU time (on a shared machine a
/// run preempted by other work then still measures what the codec itself spent).
#[derive(Clone, Copy)]
struct Instant(f64);

impl Instant {
    fn now() -> Self {
        static CPU: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let cpu = *CPU.get_or_init(|| std::env::var("CIERA_BENCH_CLOCK").is_ok_and(|v| v == "cpu"));
        let clock = if cpu {
            libc::CLOCK_THREAD_CPUTIME_ID
        } else {
            libc::CLOCK_MONOTONIC
        };
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec through a valid pointer.
        unsafe { libc::clock_gettime(clock, &mut ts) };
        Instant(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
    }

    fn elapsed(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64((Instant::now().0 - self.0).max(0.0))
    }
}

use ciera::codec::{CacheMode, CacheSlot, FrameChoice};
use ciera::safetensors::SafeTensors;

/// Bytes per run: 64 MiB, or CIERA_BENCH_BYTES (e.g. 1048576 for one pipeline chunk).
fn bytes() -> usize {
    std::env::var("CIERA_BENCH_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64 << 20)
}
/// Threads a Delta frame's encode and decode may use: CIERA_BENCH_CODEC_THREADS, else 1.
fn codec_threads() -> usize {
    std::env::var("CIERA_BENCH_CODEC_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

fn reps() -> usize {
    std::env::var("CIERA_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7)
}

fn trace_dir() -> PathBuf {
    match std::env::var("CIERA_TRACE") {
        Ok(p) => p.into(),
        Err(_) => trace_data::trace_dir(),
    }
}

fn tile(b: &[u8]) -> Vec<u8> {
    b.iter().copied().cycle().take(bytes()).collect()
}

fn best<F: FnMut()>(mut f: F) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..reps() {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

/// The tiled tensor `name` of the step before `step` (e.g. "step_00101" -> step_00100).
fn prev_step(dir: &std::path::Path, step: &str, name: &str) -> Option<Vec<u8>> {
    let num: u64 = step.trim_start_matches("step_").parse().ok()?;
    let st = SafeTensors::open(&dir.join(format!("step_{:05}.safetensors", num.checked_sub(1)?)))
        .ok()?;
    let t = st.get(name)?;
    Some(tile(st.bytes(t)))
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` would pass nothing: run only when asked.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let dir = trace_dir();
    let bytes = bytes();
    println!(
        "codec bench: {} KiB per run, best of {}, one thread (Delta frames: {}), {} time, trace {}",
        bytes >> 10,
        reps(),
        codec_threads(),
        if std::env::var("CIERA_BENCH_CLOCK").is_ok_and(|v| v == "cpu") {
            "CPU"
        } else {
            "wall"
        },
        dir.display()
    );
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    // The baseline is timed again right before every row, and that row's ratios are to it:
    // this machine's memcpy moved 8.4-14 GB/s from run to run, and drifts within a run too.
    let mut memcpy_gbps = || {
        let t = best(|| {
            std::hint::black_box(&mut dst).copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
        });
        bytes as f64 / t / 1e9
    };
    println!("memcpy baseline: {:.2} GB/s\n", memcpy_gbps());
    println!(
        "{:<10} {:<26} {:>7} {:>7} | {:>9} {:>8} | {:>9} {:>8} | {:>6}",
        "pair", "tensor", "mode", "ratio", "enc GB/s", "x memcpy", "dec GB/s", "x memcpy", "memcpy"
    );
    for (a, b) in [
        ("step_00101", "step_00102"),
        ("step_00301", "step_00302"),
        ("step_00598", "step_00599"),
    ] {
        let (Ok(sa), Ok(sb)) = (
            SafeTensors::open(&dir.join(format!("{a}.safetensors"))),
            SafeTensors::open(&dir.join(format!("{b}.safetensors"))),
        ) else {
            continue;
        };
        for ta in &sa.tensors {
            if !ta.name.contains("experts.w1") && !dir.ends_with("olmoe-slice") {
                continue;
            }
            let Some(tb) = sb.get(&ta.name) else { continue };
            let (x0, x1) = (tile(sa.bytes(ta)), tile(sb.bytes(tb)));
            let n = bytes / ta.dtype.size();
            for (mode, cm, choice) in [
                ("exp", CacheMode::Exponent, FrameChoice::Exp),
                // Exp frames on a full-value cache (a delta or full-value policy's Exp level).
                ("exp/full", CacheMode::FullValue, FrameChoice::Exp),
                ("hybrid", CacheMode::FullValue, FrameChoice::Hybrid),
                ("delta", CacheMode::Delta, FrameChoice::Delta),
            ] {
                // CIERA_BENCH_ONLY=substring picks rows, e.g. "bf16 hybrid".
                if let Ok(f) = std::env::var("CIERA_BENCH_ONLY") {
                    if !format!("{} {} {mode}", &b[5..], ta.name).contains(&f) {
                        continue;
                    }
                }
                let memcpy_gbps = memcpy_gbps();
                let mut tx = CacheSlot::new(ta.dtype, cm, n);
                let mut rx = CacheSlot::new(ta.dtype, cm, n);
                tx.set_codec_threads(codec_threads());
                rx.set_codec_threads(codec_threads());
                tx.set_frame_choice(choice);
                let mut frame = Vec::with_capacity(bytes + 4096);
                let mut out = vec![0u8; bytes];
                let (mut enc, mut dec) = (f64::INFINITY, f64::INFINITY);
                let mut ratio = 0.0;
                if cm == CacheMode::Delta {
                    // Delta frames code each move with the previous one as context: run the
                    // real sequence (step a-1, a, b) with fresh slots every time, timing b.
                    let Some(xp) = prev_step(&dir, a, &ta.name) else {
                        continue;
                    };
                    for _ in 0..reps() {
                        for x in [&xp, &x0] {
                            frame.clear();
                            tx.encode(x, &mut frame).unwrap();
                            rx.decode(&frame, &mut out).unwrap();
                        }
                        frame.clear();
                        let t = Instant::now();
                        let info = tx.encode(&x1, &mut frame).unwrap();
                        enc = enc.min(t.elapsed().as_secs_f64());
                        let t = Instant::now();
                        let dinfo = rx.decode(&frame, &mut out).unwrap();
                        dec = dec.min(t.elapsed().as_secs_f64());
                        assert!(out == x1, "decoded bits differ");
                        assert_eq!(info.mode, ciera::codec::Mode::Delta);
                        assert_eq!(
                            (dinfo.exp_changes, dinfo.value_changes),
                            (info.exp_changes, info.value_changes),
                            "decoder and encoder count different changes"
                        );
                        ratio = info.raw_bytes as f64 / info.frame_bytes as f64;
                        tx.poison();
                    }
                } else {
                    tx.encode(&x0, &mut frame).unwrap();
                    rx.decode(&frame, &mut out).unwrap();
                    // Alternate the two steps so every timed run is a real delta of one step.
                    for r in 0..reps() * 2 {
                        let x = if r % 2 == 0 { &x1 } else { &x0 };
                        frame.clear();
                        let t = Instant::now();
                        let info = tx.encode(x, &mut frame).unwrap();
                        enc = enc.min(t.elapsed().as_secs_f64());
                        let t = Instant::now();
                        rx.decode(&frame, &mut out).unwrap();
                        dec = dec.min(t.elapsed().as_secs_f64());
                        assert!(out == *x, "decoded bits differ");
                        ratio = info.raw_bytes as f64 / info.frame_bytes as f64;
                    }
                }
                let (eg, dg) = (bytes as f64 / enc / 1e9, bytes as f64 / dec / 1e9);
                println!(
                    "{:<10} {:<26} {:>7} {:>7.3} | {:>9.2} {:>8.2} | {:>9.2} {:>8.2} | {:>6.2}",
                    &b[5..],
                    ta.name,
                    mode,
                    ratio,
                    eg,
                    eg / memcpy_gbps,
                    dg,
                    dg / memcpy_gbps,
                    memcpy_gbps
                );
            }
        }
    }
}
