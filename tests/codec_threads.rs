//! Delta frames encoded and decoded on several threads (`CacheSlot::set_codec_threads`) give
//! exactly what one thread gives: the same frames byte for byte, the values, the change
//! counts, the contexts left behind (a second Delta frame, coded against them, decodes
//! exactly), and for damaged frames (resealed, so that they reach the lane decoders) the same
//! refusal, with the same message, or the same output.
//!
//! Chunks of the bundled trace slice, tiled to 4-10 groups of 32768 elements (the unit a
//! thread takes; a chunk of fewer than four stays on one thread), bf16 and fp32, at the four
//! windows of the schedule.

#[path = "common/frame_support.rs"]
mod frame_support;
#[path = "common/trace_data.rs"]
mod trace_data;

use ciera::codec::{delta, CacheMode, CacheSlot, FrameChoice, FrameInfo, Mode, HEADER_LEN};
use ciera::DType;
use frame_support::{reseal, section_lens, Rng};
use trace_data::{repo_dir, snapshots};

/// Three consecutive steps of every tensor of the bundled slice (its windows of three), tiled
/// to `elems` elements.
fn steps(elems: usize) -> Vec<(String, DType, [Vec<u8>; 3])> {
    let files = snapshots(&repo_dir().join("tests/data/olmoe-slice"));
    let mut out = Vec::new();
    for (k, w) in files.chunks_exact(3).enumerate() {
        for t in &w[0].tensors {
            let bytes = elems * t.dtype.size();
            let s: [Vec<u8>; 3] = std::array::from_fn(|i| {
                let b = w[i].bytes(w[i].get(&t.name).unwrap());
                b.iter().copied().cycle().take(bytes).collect()
            });
            out.push((format!("{} (window {k})", t.name), t.dtype, s));
        }
    }
    assert!(out.len() >= 16, "trace slice has {} tensors", out.len());
    out
}

/// The frames a delta slot coding on `threads` threads sends for the three steps: a FILL, then
/// two Delta frames.
fn frames(dtype: DType, s: &[Vec<u8>; 3], what: &str, threads: usize) -> [Vec<u8>; 3] {
    let len = s[0].len() / dtype.size();
    // One version for every sender: frames of different thread counts compare byte for byte.
    let mut tx = CacheSlot::with_version(dtype, CacheMode::Delta, len, 0x5EED);
    tx.set_frame_choice(FrameChoice::Delta);
    tx.set_codec_threads(threads);
    std::array::from_fn(|i| {
        let mut f = Vec::new();
        let info = tx.encode(&s[i], &mut f).unwrap();
        if i > 0 {
            assert_eq!(
                info.mode,
                Mode::Delta,
                "{what}: step {i} goes as a Delta frame"
            );
        }
        f
    })
}

/// A receiver on `threads` threads that took the first `k` frames, checking each output.
fn receiver(
    dtype: DType,
    s: &[Vec<u8>; 3],
    f: &[Vec<u8>; 3],
    k: usize,
    threads: usize,
) -> CacheSlot {
    let len = s[0].len() / dtype.size();
    let mut rx = CacheSlot::new(dtype, CacheMode::Delta, len);
    rx.set_codec_threads(threads);
    let mut out = vec![0u8; s[0].len()];
    for i in 0..k {
        rx.decode(&f[i], &mut out).unwrap();
        assert!(out == s[i], "history frame {i}");
    }
    rx
}

/// Decode `frame` on a receiver that took the first `k` frames, on `threads` threads.
fn decode(
    dtype: DType,
    s: &[Vec<u8>; 3],
    f: &[Vec<u8>; 3],
    k: usize,
    threads: usize,
    frame: &[u8],
) -> (Result<FrameInfo, String>, Vec<u8>, bool) {
    let mut rx = receiver(dtype, s, f, k, threads);
    let mut out = vec![0xA5u8; s[0].len()];
    let r = rx.decode(frame, &mut out).map_err(|e| e.to_string());
    let warm = rx.is_warm();
    (r, out, warm)
}

#[test]
fn delta_frames_code_alike_on_one_and_several_threads() {
    let group = delta::GROUP_ELEMS;
    for (elems, thread_counts) in [
        (9 * group + 1000, &[2usize, 3, 8][..]),
        (4 * group, &[2, 4][..]),
    ] {
        for (name, dtype, s) in steps(elems) {
            let what = format!("{name} ({elems} elements)");
            let f = frames(dtype, &s, &what, 1);
            // One thread: the reference (values exact, counts as the encoder's).
            let mut one = Vec::new();
            let mut rx = receiver(dtype, &s, &f, 0, 1);
            for (i, frame) in f.iter().enumerate() {
                let mut out = vec![0u8; s[i].len()];
                one.push(rx.decode(frame, &mut out).unwrap());
                assert!(out == s[i], "{what}: frame {i} on one thread");
            }
            for &t in thread_counts {
                let split = ciera::codec::split_codings();
                let ft = frames(dtype, &s, &what, t);
                for i in 0..3 {
                    assert!(
                        ft[i] == f[i],
                        "{what}: frame {i} encoded on {t} threads differs"
                    );
                }
                let mut rx = receiver(dtype, &s, &f, 0, t);
                assert_eq!(rx.codec_threads(), t);
                for (i, frame) in f.iter().enumerate() {
                    let mut out = vec![0u8; s[i].len()];
                    let info = rx.decode(frame, &mut out).unwrap();
                    // Frame 2's values depend on the contexts frame 1 left on every thread's
                    // span: exact bits here check those too.
                    assert!(
                        out == s[i],
                        "{what}: frame {i} on {t} threads: other values"
                    );
                    assert_eq!(
                        info, one[i],
                        "{what}: frame {i} on {t} threads: other counts"
                    );
                }
                // Both Delta frames were split, encoding and decoding: four codings (other
                // tests may add to the count, never take from it).
                assert!(
                    ciera::codec::split_codings() >= split + 4,
                    "{what}: the Delta frames were not coded on {t} threads"
                );
            }
        }
    }
}

#[test]
fn damaged_delta_frames_are_refused_alike_on_one_and_several_threads() {
    let group = delta::GROUP_ELEMS;
    let elems = 9 * group + 1000;
    let mut rng = Rng(0x7EAD_5EED);
    let (mut refused, mut accepted) = (0, 0);
    for (name, dtype, s) in steps(elems).into_iter().step_by(3) {
        let f = frames(dtype, &s, &name, 1);
        let [s0, s1, ..] = section_lens(&f[2]);
        let lens_at = HEADER_LEN + s0 + s1 - 4 * elems.div_ceil(group);
        let mut cases: Vec<(String, Vec<u8>)> = Vec::new();
        // Lane words anywhere (the error lands in whichever group holds them), the tables,
        // and the group lengths (which move every later group's start).
        let mut at: Vec<(usize, String)> = Vec::new();
        for _ in 0..12 {
            let a = HEADER_LEN + rng.below(s0);
            at.push((a, format!("lane byte {}", a - HEADER_LEN)));
        }
        for _ in 0..4 {
            let a = HEADER_LEN + s0 + rng.below(s1);
            at.push((a, format!("model byte {}", a - HEADER_LEN - s0)));
        }
        for g in [0, 3, 5, 9] {
            at.push((lens_at + 4 * g, format!("group {g}'s length")));
        }
        for (a, what) in at {
            let mut g = f[2].clone();
            g[a] ^= 1 << rng.below(8);
            cases.push((what, g));
        }
        // Two groups damaged, on different threads' parts: the first one is reported.
        let mut g = f[2].clone();
        g[HEADER_LEN + 200] ^= 0x10;
        g[HEADER_LEN + s0 - 200] ^= 0x10;
        cases.push(("the first and the last group's words".into(), g));
        for (what, mut g) in cases {
            reseal(&mut g);
            let (r1, o1, w1) = decode(dtype, &s, &f, 2, 1, &g);
            for t in [2, 3, 8] {
                let (rt, ot, wt) = decode(dtype, &s, &f, 2, t, &g);
                assert_eq!(rt, r1, "{name}, {what}: {t} threads against one");
                assert_eq!(
                    wt, w1,
                    "{name}, {what}: slot state, {t} threads against one"
                );
                if r1.is_ok() {
                    assert!(
                        ot == o1,
                        "{name}, {what}: accepted with other values on {t} threads"
                    );
                }
            }
            if r1.is_ok() {
                accepted += 1;
            } else {
                assert!(!w1, "{name}, {what}: refused but the slot stayed warm");
                refused += 1;
            }
        }
    }
    // The damage must reach the lane decoders, not only the header checks.
    assert!(
        refused >= 20,
        "{refused} damaged frames refused, {accepted} accepted"
    );
}
