//! Property tests of the codec: a sender slot and a receiver slot run many iterations of a
//! drift model (values change with probability q, exponents with probability p, plus NaNs
//! with payloads, infinities, signed zeros, subnormals and random bit patterns) and every
//! frame must reproduce its input bit for bit, with both sides at the same version.
//!
//! Covered: every `DType`, all three cache modes (exponent, full-value, delta), every frame
//! choice, lengths 0, 1, odd, around the 64-element block, ~100k; whole-slot and chunked coding
//! (random chunk sizes, chunks decoded in a shuffled order and on two threads); poisoning
//! mid-sequence; and the refusals (a replayed or future frame: `VersionMismatch`; another
//! element type: `DTypeMismatch`; another count, offset or buffer size: `LengthMismatch`; a
//! delta for a cold slot, a hybrid frame for an exponent slot or a Delta frame for a slot
//! without contexts: `SlotState`). `simd_and_plain_paths_agree` re-runs this binary with
//! `CIERA_NO_SIMD=1` and checks that both paths produce the same bytes;
//! `delta_avx512_avx2_plain_agree` runs Delta frames of bf16/fp16 through the AVX-512 path
//! (this process), the AVX2 path (`CIERA_NO_AVX512=1`) and the plain path (`CIERA_NO_SIMD=1`).
//!
//! Delta slots (values and one context byte per element, docs/WIRE.md "Delta") also get drift
//! in ulps (`Drift::ulp`: key-space moves of 1 to 2^30 ulps, which cross exponents, signs and
//! special values), and the sender switches its frame choice between iterations (Delta, Auto,
//! Exp, Hybrid: contexts must follow every frame kind on both sides).
//!
//! Failures found by proptest are persisted in tests/codec_props.proptest-regressions (commit
//! it) and replayed first on every run.

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;

use ciera::codec::CodecError;
use ciera::codec::{
    checksum, frame, CacheMode, CacheSlot, FrameChoice, FrameInfo, Mode, SlotChunk,
};
use ciera::DType;

#[path = "common/frame_support.rs"]
mod frame_support;
use frame_support::{reseal, slot_at, Rng};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

// ---- element bit layouts, written from the IEEE / OCP definitions (not from the codec) -----

#[derive(Clone, Copy)]
struct FloatBits {
    /// Mantissa bits (= the exponent field's shift).
    mant: u32,
    /// Exponent field bits.
    exp: u32,
}

fn float_bits(dtype: DType) -> Option<FloatBits> {
    Some(match dtype {
        DType::BF16 => FloatBits { mant: 7, exp: 8 },
        DType::F16 => FloatBits { mant: 10, exp: 5 },
        DType::F32 => FloatBits { mant: 23, exp: 8 },
        DType::F64 => FloatBits { mant: 52, exp: 11 },
        DType::F8E4M3 => FloatBits { mant: 3, exp: 4 },
        DType::F8E5M2 => FloatBits { mant: 2, exp: 5 },
        _ => return None,
    })
}

fn load(b: &[u8], size: usize, i: usize) -> u64 {
    let mut w = [0u8; 8];
    w[..size].copy_from_slice(&b[i * size..(i + 1) * size]);
    u64::from_le_bytes(w)
}

fn store(b: &mut [u8], size: usize, i: usize, v: u64) {
    b[i * size..(i + 1) * size].copy_from_slice(&v.to_le_bytes()[..size]);
}

fn low_bits(n: u32) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}

fn exp_field(fb: FloatBits, v: u64) -> u64 {
    (v >> fb.mant) & low_bits(fb.exp)
}

/// The field an exponent cache keeps (docs/WIRE.md, "Modes and sections"): the high byte of
/// bf16 and fp32 (sign and exponent bits 7..1), the exponent of fp16.
fn cached_field(dtype: DType, fb: FloatBits, v: u64) -> u64 {
    match dtype {
        DType::BF16 => (v >> 8) & 0xff,
        DType::F32 => (v >> 24) & 0xff,
        _ => exp_field(fb, v),
    }
}

/// A weight-like value: random sign and mantissa, exponent a little below the bias (|x| ~ 0.01).
fn fresh_value(rng: &mut Rng, dtype: DType) -> u64 {
    let size = dtype.size() as u32;
    let Some(fb) = float_bits(dtype) else {
        return rng.next() & low_bits(8 * size);
    };
    let bias = low_bits(fb.exp - 1) as i64;
    let emax = low_bits(fb.exp) as i64;
    let e = (bias - 1 - rng.below(8) as i64).clamp(1, emax - 1) as u64;
    let sign = rng.next() & 1;
    let mant = rng.next() & low_bits(fb.mant);
    (sign << (fb.mant + fb.exp)) | (e << fb.mant) | mant
}

/// A special value: NaN with a payload (quiet or signalling), +-Inf, +-0, a subnormal, the
/// extremes, or a fully random bit pattern.
fn special_value(rng: &mut Rng, dtype: DType) -> u64 {
    let size = dtype.size() as u32;
    let Some(fb) = float_bits(dtype) else {
        return match rng.below(4) {
            0 => 0,
            1 => low_bits(8 * size),
            2 => 1 << (8 * size - 1),
            _ => rng.next() & low_bits(8 * size),
        };
    };
    let sign = (rng.next() & 1) << (fb.mant + fb.exp);
    let emax = low_bits(fb.exp);
    let mmask = low_bits(fb.mant);
    match rng.below(7) {
        0 => sign | (emax << fb.mant) | (rng.next() & mmask).max(1), // NaN with payload
        1 => sign | (emax << fb.mant),                               // +-Inf
        2 => sign,                                                   // +-0
        3 => sign | (rng.next() & mmask).max(1),                     // subnormal
        4 => sign | ((emax - 1) << fb.mant) | mmask,                 // largest finite
        5 => sign | (1 << fb.mant),                                  // smallest normal
        _ => rng.next() & low_bits(8 * size),                        // any bits
    }
}

/// How values move from one iteration to the next.
#[derive(Clone, Copy, Debug)]
struct Drift {
    /// Probability that an element's sign+mantissa changes.
    q: f64,
    /// Probability that an element's exponent changes (by a small step).
    p: f64,
    /// Probability that an element becomes a special value.
    special: f64,
    /// Probability that an element moves by a number of ulps (in the order of the values:
    /// across exponents, through zero and into the special values); mostly 1 to 15, a tenth of
    /// them up to 2^(W-2).
    ulp: f64,
}

/// `v` moved by `m` ulps: the W-bit pattern mapped to an integer that is monotone in the value
/// (negative values reversed, -0 just below +0), moved, mapped back (modulo 2^W). Written
/// from the IEEE layout, not from the codec.
fn ulp_step(v: u64, size: usize, m: i64) -> u64 {
    let w = 8 * size as u32;
    let (top, all) = (1u64 << (w - 1), low_bits(w));
    let key = if v & top != 0 { !v & all } else { v | top };
    let k = (key as i64).wrapping_add(m) as u64 & all;
    if k & top != 0 {
        k & !top
    } else {
        !k & all
    }
}

fn initial_tensor(rng: &mut Rng, dtype: DType, len: usize, special: f64) -> Vec<u8> {
    let size = dtype.size();
    let mut v = vec![0u8; len * size];
    for i in 0..len {
        let x = if rng.chance(special) {
            special_value(rng, dtype)
        } else {
            fresh_value(rng, dtype)
        };
        store(&mut v, size, i, x);
    }
    v
}

fn drift_step(rng: &mut Rng, dtype: DType, prev: &[u8], d: Drift) -> Vec<u8> {
    let size = dtype.size();
    let mut v = prev.to_vec();
    for i in 0..prev.len() / size {
        let mut x = load(prev, size, i);
        if rng.chance(d.special) {
            x = special_value(rng, dtype);
        } else if rng.chance(d.ulp) {
            let w = 8 * size;
            let bits = if rng.chance(0.9) {
                1 + rng.below(4)
            } else {
                rng.below(w - 1)
            };
            let m = (rng.next() & low_bits(bits as u32)).max(1) as i64;
            x = ulp_step(x, size, if rng.chance(0.5) { m } else { -m });
            if rng.chance(0.01) {
                x ^= 1 << (w - 1); // a sign flip
            }
        } else if let Some(fb) = float_bits(dtype) {
            if rng.chance(d.q) {
                // A small update: re-draw some low mantissa bits, sometimes the sign.
                let k = 1 + rng.below(fb.mant as usize) as u32;
                x ^= rng.next() & low_bits(k);
                if rng.chance(0.05) {
                    x ^= 1 << (fb.mant + fb.exp);
                }
            }
            if rng.chance(d.p) {
                let e = exp_field(fb, x) as i64;
                let step = 1 + rng.below(3) as i64;
                let ne = if rng.chance(0.5) { e + step } else { e - step };
                let ne = ne.clamp(0, low_bits(fb.exp) as i64) as u64;
                x = (x & !(low_bits(fb.exp) << fb.mant)) | (ne << fb.mant);
            }
        } else if rng.chance(d.q) {
            x ^= 1 << rng.below(8 * size);
        }
        store(&mut v, size, i, x);
    }
    v
}

// ---- the sender/receiver pair ---------------------------------------------------------------

/// Which refusals to probe on copies of the receiver after an iteration.
#[derive(Clone, Copy, Debug, Default)]
struct Probes {
    replay: bool,
    wrong_dtype: bool,
    wrong_count: bool,
    wrong_out_len: bool,
    cold: bool,
    other_version: bool,
    other_mode: bool,
}

impl Probes {
    fn random(rng: &mut Rng, p: f64) -> Probes {
        Probes {
            replay: rng.chance(p),
            wrong_dtype: rng.chance(p),
            wrong_count: rng.chance(p),
            wrong_out_len: rng.chance(p),
            cold: rng.chance(p),
            other_version: rng.chance(p),
            other_mode: rng.chance(p),
        }
    }
    fn all() -> Probes {
        Probes {
            replay: true,
            wrong_dtype: true,
            wrong_count: true,
            wrong_out_len: true,
            cold: true,
            other_version: true,
            other_mode: true,
        }
    }
}

struct Pair {
    dtype: DType,
    mode: CacheMode,
    choice: FrameChoice,
    len: usize,
    tx: CacheSlot,
    rx: CacheSlot,
    /// The sender's previous input (what its cache holds when warm).
    tx_last: Vec<u8>,
    /// The receiver's previous output.
    rx_last: Vec<u8>,
    /// Whether both sides have completed an iteration together since they were created or
    /// poisoned (fresh and poisoned slots take random versions until a FILL is exchanged).
    synced: bool,
    frames: usize,
    bytes: usize,
    /// Frames the sender produced, by mode (header byte 6).
    by_mode: std::cell::Cell<[usize; 4]>,
}

fn assert_kind(r: Result<FrameInfo, CodecError>, what: &str, ok: impl Fn(&CodecError) -> bool) {
    match r {
        Err(e) if ok(&e) => {}
        Err(e) => panic!("{what}: wrong error {e:?}"),
        Ok(i) => panic!("{what}: accepted ({i:?})"),
    }
}

impl Pair {
    fn new(dtype: DType, mode: CacheMode, choice: FrameChoice, len: usize) -> Pair {
        let mut tx = CacheSlot::new(dtype, mode, len);
        let mut rx = CacheSlot::new(dtype, mode, len);
        tx.set_frame_choice(choice);
        rx.set_frame_choice(choice);
        let bytes = len * dtype.size();
        Pair {
            dtype,
            mode,
            choice,
            len,
            tx,
            rx,
            tx_last: vec![0; bytes],
            rx_last: vec![0; bytes],
            synced: false,
            frames: 0,
            bytes: 0,
            by_mode: Default::default(),
        }
    }

    /// The sender switches to another frame choice (the receiver needs none).
    fn set_choice(&mut self, choice: FrameChoice) {
        self.choice = choice;
        self.tx.set_frame_choice(choice);
    }

    fn ctx(&self) -> String {
        format!(
            "{:?}/{:?}/{:?} len {} v{}",
            self.dtype,
            self.mode,
            self.choice,
            self.len,
            self.tx.version()
        )
    }

    /// What the frame the sender is about to produce for `input` must say about itself.
    fn check_info(
        &self,
        info: &FrameInfo,
        input: &[u8],
        tx_warm: bool,
        offset: usize,
        count: usize,
    ) {
        let ctx = self.ctx();
        let size = self.dtype.size();
        assert_eq!(
            (info.dtype, info.count, info.offset),
            (self.dtype, count, offset),
            "{ctx}"
        );
        assert_eq!(info.raw_bytes, count * size, "{ctx}");
        if !self.dtype.is_compressible() {
            assert_eq!((info.mode, info.fill), (Mode::Raw, false), "{ctx}");
            return;
        }
        // No frame is longer than the values plus the header.
        assert!(
            info.frame_bytes <= frame::HEADER_LEN + info.raw_bytes,
            "{ctx}: {} byte frame for {} bytes",
            info.frame_bytes,
            info.raw_bytes
        );
        if !tx_warm || info.mode == Mode::Raw {
            // A cold sender FILLs; so does a warm one whose delta would be longer than that.
            assert_eq!(
                (info.mode, info.fill, info.exp_changes, info.value_changes),
                (Mode::Raw, true, 0, None),
                "{ctx}"
            );
            assert_eq!(
                info.frame_bytes,
                frame::HEADER_LEN + info.raw_bytes,
                "{ctx}"
            );
            return;
        }
        assert!(!info.fill, "{ctx}");
        let fb = float_bits(self.dtype).unwrap();
        let range = offset..offset + count;
        let exp_changed = range
            .clone()
            .filter(|&i| {
                cached_field(self.dtype, fb, load(input, size, i))
                    != cached_field(self.dtype, fb, load(&self.tx_last, size, i))
            })
            .count();
        let value_changed = range
            .filter(|&i| load(input, size, i) != load(&self.tx_last, size, i))
            .count();
        let want = match (self.mode, self.choice) {
            (CacheMode::Exponent, _) | (_, FrameChoice::Exp) => Some(Mode::Exp),
            // A full-value slot asked for Delta frames sends Hybrid (it has no contexts).
            (CacheMode::FullValue, FrameChoice::Hybrid | FrameChoice::Delta) => Some(Mode::Hybrid),
            (CacheMode::Delta, FrameChoice::Hybrid) => Some(Mode::Hybrid),
            (CacheMode::Delta, FrameChoice::Delta) => Some(Mode::Delta),
            (_, FrameChoice::Auto | FrameChoice::NoDelta) => None,
        };
        if let Some(m) = want {
            assert_eq!(info.mode, m, "{ctx}");
        }
        if self.mode != CacheMode::Delta {
            assert_ne!(
                info.mode,
                Mode::Delta,
                "{ctx}: a Delta frame needs a delta slot"
            );
        }
        assert_eq!(info.exp_changes, exp_changed, "{ctx}: exponent changes");
        match info.mode {
            Mode::Exp => assert_eq!(info.value_changes, None, "{ctx}"),
            Mode::Hybrid | Mode::Delta => assert_eq!(
                info.value_changes,
                Some(value_changed),
                "{ctx}: value changes"
            ),
            Mode::Raw => panic!("{ctx}: raw frame from a warm sender"),
        }
    }

    /// Frame self-description: header fields and the section lengths add up to the frame.
    fn check_frame(&self, f: &[u8], info: &FrameInfo) {
        assert_eq!(f.len(), info.frame_bytes, "{}", self.ctx());
        assert_eq!(frame::peek_len(f).unwrap(), f.len(), "{}", self.ctx());
        let p = frame::parse(f).unwrap();
        assert_eq!(
            (p.dtype, p.mode, p.count, p.offset, p.version),
            (info.dtype, info.mode, info.count, info.offset, info.version)
        );
        assert_eq!(p.flags, if info.fill { frame::FLAG_FILL } else { 0 });
        let mut m = self.by_mode.get();
        m[f[6] as usize] += 1;
        self.by_mode.set(m);
    }

    /// One iteration, whole slot: encode, probe refusals on copies of the receiver, decode.
    fn step_whole(&mut self, input: &[u8], probes: Probes) {
        let ctx = self.ctx();
        let tx_warm = self.tx.is_warm();
        let v = self.tx.version();
        if self.synced {
            assert_eq!(v, self.rx.version(), "{ctx}: versions before the iteration");
        }
        let mut f = Vec::new();
        let info = self
            .tx
            .encode(input, &mut f)
            .unwrap_or_else(|e| panic!("{ctx}: encode: {e}"));
        assert_eq!(info.version, v);
        self.check_info(&info, input, tx_warm, 0, self.len);
        self.check_frame(&f, &info);
        self.probe(&f, &info, input, probes);
        // The receiver decodes into a buffer of stale bytes: every output byte must be written.
        let mut out = vec![0xA5u8; input.len()];
        let rinfo = self
            .rx
            .decode(&f, &mut out)
            .unwrap_or_else(|e| panic!("{ctx}: decode {:?} frame: {e}", info.mode));
        assert!(
            out == input,
            "{ctx}: decoded {:?} frame differs from the input",
            info.mode
        );
        assert_eq!(rinfo, info, "{ctx}: receiver's and sender's frame info");
        assert_eq!(self.rx.version(), self.tx.version(), "{ctx}");
        assert_eq!(self.rx.is_warm(), self.tx.is_warm(), "{ctx}");
        self.synced = true;
        if probes.replay {
            // The same frame again, to a receiver that has already taken it.
            let mut copy = self.rx_copy_of(&out);
            let r = copy.decode(&f, &mut vec![0u8; input.len()]);
            if info.mode == Mode::Raw {
                assert!(r.is_ok(), "{ctx}: replayed raw frame: {r:?}");
            } else {
                assert_kind(
                    r,
                    &ctx,
                    |e| matches!(e, CodecError::VersionMismatch { slot_version, frame_version } if *slot_version == v.wrapping_add(1) && *frame_version == v),
                );
                assert!(!copy.is_warm(), "{ctx}: a refused frame poisons the slot");
            }
        }
        self.frames += 1;
        self.bytes += f.len();
        self.tx_last = input.to_vec();
        self.rx_last = out;
    }

    fn rx_copy_of(&self, values: &[u8]) -> CacheSlot {
        slot_at(
            self.dtype,
            self.mode,
            self.choice,
            self.len,
            self.rx.version(),
            self.rx.is_warm(),
            values,
        )
    }

    /// Refusals, each on a copy of the receiver's state before `f`.
    fn probe(&self, f: &[u8], info: &FrameInfo, input: &[u8], probes: Probes) {
        let ctx = self.ctx();
        let (dtype, len, v) = (self.dtype, self.len, info.version);
        let delta = info.mode != Mode::Raw;
        let buf = || vec![0u8; input.len()];
        if probes.wrong_dtype {
            let other = DType::ALL
                [(DType::ALL.iter().position(|&d| d == dtype).unwrap() + 1 + len % 11) % 12];
            let mut s = CacheSlot::new(other, self.mode, len);
            let r = s.decode(f, &mut vec![0u8; len * other.size()]);
            assert_kind(
                r,
                &ctx,
                |e| matches!(e, CodecError::DTypeMismatch { expected, found } if *expected == other && *found == dtype),
            );
        }
        if probes.wrong_count {
            for n in [len + 1, len.wrapping_sub(1)]
                .into_iter()
                .filter(|&n| n != usize::MAX)
            {
                let mut s = CacheSlot::new(dtype, self.mode, n);
                let r = s.decode(f, &mut vec![0u8; n * dtype.size()]);
                assert_kind(
                    r,
                    &ctx,
                    |e| matches!(e, CodecError::LengthMismatch { what, expected, found } if what.contains("count") && *expected == n && *found == len),
                );
            }
        }
        if probes.wrong_out_len {
            let mut s = self.rx_copy_of(&self.rx_last);
            let r = s.decode(f, &mut vec![0u8; input.len() + 1]);
            assert_kind(
                r,
                &ctx,
                |e| matches!(e, CodecError::LengthMismatch { what, .. } if what.contains("output")),
            );
            assert!(!s.is_warm());
        }
        if probes.cold {
            let mut s = CacheSlot::new(dtype, self.mode, len);
            let mut out = buf();
            let r = s.decode(f, &mut out);
            if delta {
                assert_kind(r, &ctx, |e| matches!(e, CodecError::SlotState { .. }));
            } else {
                assert!(
                    r.is_ok() && out == input,
                    "{ctx}: raw frame on a cold slot: {r:?}"
                );
            }
        }
        if probes.other_version && self.rx.is_warm() {
            for w in [v.wrapping_add(1), v.wrapping_sub(1), v ^ (1 << 40)] {
                let mut s = slot_at(dtype, self.mode, self.choice, len, w, true, &self.rx_last);
                let mut out = buf();
                let r = s.decode(f, &mut out);
                if delta {
                    assert_kind(
                        r,
                        &ctx,
                        |e| matches!(e, CodecError::VersionMismatch { slot_version, frame_version } if *slot_version == w && *frame_version == v),
                    );
                } else {
                    // A raw FILL resynchronises a slot at any version.
                    assert!(
                        r.is_ok() && out == input,
                        "{ctx}: raw frame at another version: {r:?}"
                    );
                    assert_eq!(s.version(), v.wrapping_add(1));
                }
            }
        }
        if probes.other_mode && self.rx.is_warm() {
            // Exp frames only need exponents, which every cache mode holds; Hybrid frames need
            // values (full-value and delta slots); Delta frames need values and contexts (delta
            // slots). A delta slot built from values has the contexts of a FILL, which an Exp or
            // Hybrid frame does not read.
            for other in [CacheMode::Exponent, CacheMode::FullValue, CacheMode::Delta] {
                if other == self.mode {
                    continue;
                }
                let mut s = slot_at(dtype, other, self.choice, len, v, true, &self.rx_last);
                let mut out = buf();
                let r = s.decode(f, &mut out);
                let refused = match info.mode {
                    Mode::Hybrid => other == CacheMode::Exponent,
                    Mode::Delta => true,
                    _ => false,
                };
                if refused {
                    assert_kind(r, &ctx, |e| matches!(e, CodecError::SlotState { .. }));
                    assert!(!s.is_warm(), "{ctx}: a refused frame poisons the slot");
                } else {
                    assert!(
                        r.is_ok() && out == input,
                        "{ctx}: {:?} frame on a {other:?} slot: {r:?}",
                        info.mode
                    );
                }
            }
        }
    }

    /// One iteration in chunks of `chunk` elements; the sender encodes and the receiver decodes
    /// the chunks in shuffled orders, the receiver optionally on two threads.
    fn step_chunked(&mut self, input: &[u8], chunk: usize, rng: &mut Rng, threads: bool) {
        let ctx = format!("{} chunk {chunk}", self.ctx());
        let size = self.dtype.size();
        let tx_warm = self.tx.is_warm();
        let v = self.tx.version();
        if self.synced {
            assert_eq!(v, self.rx.version(), "{ctx}: versions before the iteration");
        }
        let (frames, tx_infos) = {
            let mut chunks = self.tx.chunks(chunk);
            let n = chunks.len();
            assert_eq!(
                n,
                self.len.div_ceil(chunk).max(1),
                "{ctx}: number of chunks"
            );
            let mut order: Vec<usize> = (0..n).collect();
            rng.shuffle(&mut order);
            let mut frames = vec![Vec::new(); n];
            let mut infos = vec![None; n];
            for &i in &order {
                let c = &mut chunks[i];
                assert_eq!(
                    (c.offset(), c.len()),
                    (i * chunk, chunk.min(self.len - i * chunk)),
                    "{ctx}"
                );
                let r = c.offset() * size..(c.offset() + c.len()) * size;
                infos[i] = Some(
                    c.encode(&input[r], &mut frames[i])
                        .unwrap_or_else(|e| panic!("{ctx}: encode chunk {i}: {e}")),
                );
            }
            (
                frames,
                infos.into_iter().map(Option::unwrap).collect::<Vec<_>>(),
            )
        };
        for (i, (f, info)) in frames.iter().zip(&tx_infos).enumerate() {
            assert_eq!(info.version, v);
            self.check_info(
                info,
                input,
                tx_warm,
                i * chunk,
                chunk.min(self.len - i * chunk),
            );
            self.check_frame(f, info);
        }
        // Commit in a shuffled order too: commit must not care.
        let mut shuffled = tx_infos.clone();
        rng.shuffle(&mut shuffled);
        self.tx
            .commit(&shuffled)
            .unwrap_or_else(|e| panic!("{ctx}: sender commit: {e}"));

        let mut out = vec![0x5Au8; input.len()];
        let results = {
            let mut chunks = self.rx.chunks(chunk);
            let mut outs: Vec<&mut [u8]> = if self.len == 0 {
                vec![&mut []]
            } else {
                out.chunks_mut(chunk * size).collect()
            };
            assert_eq!(outs.len(), chunks.len());
            // Wrong offset: chunk 1 refuses chunk 0's frame even where the lengths agree.
            if chunks.len() >= 3 {
                let p = frame::parse(&frames[0]).unwrap();
                let r = chunks[1].decode(&p, &mut vec![0u8; chunk * size]);
                assert_kind(
                    r,
                    &ctx,
                    |e| matches!(e, CodecError::LengthMismatch { what, expected, found } if what.contains("offset") && *expected == chunk && *found == 0),
                );
            }
            let mut jobs: Vec<(usize, &mut SlotChunk<'_>, &mut [u8])> = chunks
                .iter_mut()
                .zip(outs.iter_mut())
                .enumerate()
                .map(|(i, (c, o))| (i, c, &mut **o))
                .collect();
            rng.shuffle(&mut jobs);
            let decode = |(i, c, o): (usize, &mut SlotChunk<'_>, &mut [u8])| {
                (i, frame::parse(&frames[i]).and_then(|p| c.decode(&p, o)))
            };
            if threads && jobs.len() > 1 {
                let second = jobs.split_off(jobs.len() / 2);
                std::thread::scope(|s| {
                    let h = s.spawn(|| second.into_iter().map(decode).collect::<Vec<_>>());
                    let mut r: Vec<_> = jobs.into_iter().map(decode).collect();
                    r.extend(h.join().expect("decoder thread"));
                    r
                })
            } else {
                jobs.into_iter().map(decode).collect::<Vec<_>>()
            }
        };
        let mut rx_infos = Vec::new();
        for (i, r) in results {
            let info = r.unwrap_or_else(|e| panic!("{ctx}: decode chunk {i}: {e}"));
            assert_eq!(info, tx_infos[i], "{ctx}: chunk {i} info");
            rx_infos.push(info);
        }
        self.rx
            .commit(&rx_infos)
            .unwrap_or_else(|e| panic!("{ctx}: receiver commit: {e}"));
        assert!(out == input, "{ctx}: chunked decode differs from the input");
        assert_eq!(self.rx.version(), self.tx.version(), "{ctx}");
        assert_eq!(self.rx.is_warm(), self.tx.is_warm(), "{ctx}");
        self.synced = true;
        self.frames += frames.len();
        self.bytes += frames.iter().map(Vec::len).sum::<usize>();
        self.tx_last = input.to_vec();
        self.rx_last = out;
    }

    /// One iteration in chunks of random, unequal sizes (`CacheSlot::chunk(range)`), coded one
    /// at a time; the receiver decodes them in a shuffled order.
    fn step_ranges(&mut self, input: &[u8], rng: &mut Rng) {
        let ctx = format!("{} ranges", self.ctx());
        let size = self.dtype.size();
        let tx_warm = self.tx.is_warm();
        let mut ranges = Vec::new();
        let mut at = 0;
        while at < self.len || ranges.is_empty() {
            let n = (1 + rng.below(1 + self.len / 3)).min(self.len - at);
            ranges.push(at..at + n);
            at += n;
        }
        let mut frames = Vec::new();
        let mut tx_infos = Vec::new();
        for r in &ranges {
            let mut f = Vec::new();
            let info = self
                .tx
                .chunk(r.clone())
                .encode(&input[r.start * size..r.end * size], &mut f)
                .unwrap_or_else(|e| panic!("{ctx}: {e}"));
            self.check_info(&info, input, tx_warm, r.start, r.len());
            self.check_frame(&f, &info);
            frames.push(f);
            tx_infos.push(info);
        }
        self.tx.commit(&tx_infos).unwrap();
        let mut order: Vec<usize> = (0..ranges.len()).collect();
        rng.shuffle(&mut order);
        let mut out = vec![0x3Cu8; input.len()];
        let mut rx_infos = Vec::new();
        for i in order {
            let r = ranges[i].clone();
            let p = frame::parse(&frames[i]).unwrap();
            let info = self
                .rx
                .chunk(r.clone())
                .decode(&p, &mut out[r.start * size..r.end * size])
                .unwrap_or_else(|e| panic!("{ctx}: range {r:?}: {e}"));
            assert_eq!(info, tx_infos[i]);
            rx_infos.push(info);
        }
        self.rx.commit(&rx_infos).unwrap();
        assert!(out == input, "{ctx}: decoded ranges differ from the input");
        assert_eq!(
            (self.rx.version(), self.rx.is_warm()),
            (self.tx.version(), self.tx.is_warm()),
            "{ctx}"
        );
        self.synced = true;
        self.frames += frames.len();
        self.bytes += frames.iter().map(Vec::len).sum::<usize>();
        self.tx_last = input.to_vec();
        self.rx_last = out;
    }

    /// The receiver alone loses its cache (or gets a damaged frame): it refuses the sender's
    /// delta, the sender is told, poisons its own slot and resends the iteration as a raw FILL.
    fn step_receiver_lost(&mut self, input: &[u8], damage: Option<usize>) {
        let ctx = self.ctx();
        if damage.is_none() {
            self.rx.poison();
        }
        let mut f = Vec::new();
        let info = self.tx.encode(input, &mut f).unwrap();
        if let Some(at) = damage {
            let at = at % f.len();
            f[at] ^= 0x10;
        }
        let mut out = vec![0u8; input.len()];
        let r = self.rx.decode(&f, &mut out);
        if damage.is_some() {
            assert!(
                r.is_err(),
                "{ctx}: damaged {:?} frame accepted: {r:?}",
                info.mode
            );
        } else if info.mode == Mode::Raw {
            // Nothing was lost that a raw frame needed (raw types, or a FILL anyway).
            assert!(r.is_ok() && out == input, "{ctx}: {r:?}");
            self.synced = true;
            self.tx_last = input.to_vec();
            self.rx_last = out;
            return;
        } else {
            assert_kind(r, &ctx, |e| matches!(e, CodecError::SlotState { .. }));
        }
        assert!(
            !self.rx.is_warm(),
            "{ctx}: a refused frame poisons the slot"
        );
        assert_ne!(
            self.rx.version(),
            info.version.wrapping_add(1),
            "{ctx}: a refused frame does not advance the receiver"
        );
        // Resend.
        self.tx.poison();
        let w = self.tx.version();
        let mut f = Vec::new();
        let info = self.tx.encode(input, &mut f).unwrap();
        assert_eq!(
            (info.mode, info.fill, info.version),
            (Mode::Raw, self.dtype.is_compressible(), w),
            "{ctx}"
        );
        let rinfo = self
            .rx
            .decode(&f, &mut out)
            .unwrap_or_else(|e| panic!("{ctx}: resent raw frame: {e}"));
        assert_eq!(rinfo, info);
        assert!(out == input, "{ctx}: resent raw frame");
        assert_eq!(
            (self.rx.version(), self.rx.is_warm()),
            (self.tx.version(), self.tx.is_warm()),
            "{ctx}"
        );
        self.synced = true;
        self.tx_last = input.to_vec();
        self.rx_last = out;
    }
}

/// A whole run: `iters` iterations of drift with random chunking, poisoning and probes.
#[derive(Clone, Debug)]
struct Run {
    dtype: DType,
    mode: CacheMode,
    choice: FrameChoice,
    len: usize,
    iters: usize,
    drift: Drift,
    seed: u64,
    /// Probability of each disturbance per iteration (poison, probes, chunking, and on delta
    /// slots a switch of the sender's frame choice).
    stir: f64,
}

impl Run {
    fn go(&self) -> Pair {
        let mut rng = Rng(self.seed);
        let len = self.len;
        let mut pair = Pair::new(self.dtype, self.mode, self.choice, len);
        let mut x = initial_tensor(&mut rng, self.dtype, len, self.drift.special);
        for it in 0..self.iters {
            if it > 0 {
                x = drift_step(&mut rng, self.dtype, &x, self.drift);
            }
            if self.mode == CacheMode::Delta && rng.chance(self.stir * 0.3) {
                let c = [
                    FrameChoice::Delta,
                    FrameChoice::Auto,
                    FrameChoice::Exp,
                    FrameChoice::Hybrid,
                ][rng.below(4)];
                pair.set_choice(c);
            }
            let r = rng.below(1000) as f64 / 1000.0;
            if r < self.stir * 0.15 {
                pair.tx.poison();
                pair.rx.poison();
                pair.synced = false;
                pair.step_whole(&x, Probes::random(&mut rng, self.stir));
            } else if r < self.stir * 0.25 && pair.tx.is_warm() {
                pair.step_receiver_lost(&x, None);
            } else if r < self.stir * 0.35 && pair.tx.is_warm() {
                let at = rng.next() as usize;
                pair.step_receiver_lost(&x, Some(at));
            } else if r < self.stir * 0.45 {
                pair.step_ranges(&x, &mut rng);
            } else if r < self.stir * 0.7 {
                let chunk = match rng.below(4) {
                    0 => 64 * (1 + rng.below(4)),
                    1 => 1 + rng.below(8),
                    _ => 1 + rng.below(len + 10),
                };
                let threads = rng.chance(0.3);
                pair.step_chunked(&x, chunk, &mut rng, threads);
            } else {
                pair.step_whole(&x, Probes::random(&mut rng, self.stir * 0.3));
            }
        }
        pair
    }
}

fn dtypes() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

fn compressible() -> impl Strategy<Value = DType> {
    prop::sample::select(vec![DType::BF16, DType::F16, DType::F32])
}

fn modes() -> impl Strategy<Value = CacheMode> {
    prop::sample::select(vec![
        CacheMode::Exponent,
        CacheMode::FullValue,
        CacheMode::Delta,
    ])
}

fn choices() -> impl Strategy<Value = FrameChoice> {
    prop::sample::select(vec![
        FrameChoice::Exp,
        FrameChoice::Hybrid,
        FrameChoice::Delta,
        FrameChoice::Auto,
    ])
}

/// Delta slots mostly send Delta frames or choose (Auto).
fn delta_choices() -> impl Strategy<Value = FrameChoice> {
    prop_oneof![
        3 => Just(FrameChoice::Delta),
        3 => Just(FrameChoice::Auto),
        1 => Just(FrameChoice::Exp),
        1 => Just(FrameChoice::Hybrid),
        1 => Just(FrameChoice::NoDelta),
    ]
}

fn lengths() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0usize),
        Just(1usize),
        (0usize..600).prop_map(|k| 2 * k + 1),
        (1usize..10, -3i64..=3).prop_map(|(k, d)| (64 * k as i64 + d) as usize),
        0usize..5000,
    ]
}

fn probabilities() -> impl Strategy<Value = f64> {
    prop_oneof![Just(0.0), Just(1.0), Just(0.002), Just(0.03), 0.0..1.0f64]
}

fn drifts() -> impl Strategy<Value = Drift> {
    (
        probabilities(),
        probabilities(),
        prop_oneof![Just(0.0), Just(0.001), Just(0.05), Just(0.5), Just(1.0)],
    )
        .prop_map(|(q, p, special)| Drift {
            q,
            p,
            special,
            ulp: 0.0,
        })
}

/// Drift in ulps first, with the other kinds mixed in.
fn delta_drifts() -> impl Strategy<Value = Drift> {
    (
        prop_oneof![Just(0.0), Just(0.01), Just(0.3), 0.0..1.0f64],
        prop_oneof![Just(0.0), Just(0.002), Just(0.03)],
        prop_oneof![Just(0.0), Just(0.001), Just(0.05), Just(1.0)],
        prop_oneof![Just(0.01), Just(0.3), Just(0.9), Just(1.0), 0.0..1.0f64],
    )
        .prop_map(|(q, p, special, ulp)| Drift { q, p, special, ulp })
}

/// `cases` per run; `PROPTEST_CASES` overrides it (e.g. a long soak: PROPTEST_CASES=100000).
fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        max_shrink_iters: 2000,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config(1024))]

    /// Every dtype, cache mode and frame choice, random lengths, drift, chunking, poisoning.
    #[test]
    fn drift_round_trips(
        dtype in dtypes(), mode in modes(), choice in choices(), len in lengths(),
        iters in 1usize..7, drift in drifts(), seed in any::<u64>(), stir in 0.0..1.0f64,
    ) {
        Run { dtype, mode, choice, len, iters, drift, seed, stir }.go();
    }
}

proptest! {
    #![proptest_config(config(512))]

    /// The compressed types over longer runs, where the caches carry state for many iterations.
    #[test]
    fn long_drift_round_trips(
        dtype in compressible(), mode in modes(), choice in choices(), len in lengths(),
        iters in 8usize..24, drift in drifts(), seed in any::<u64>(), stir in 0.0..0.5f64,
    ) {
        Run { dtype, mode, choice, len, iters, drift, seed, stir }.go();
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// Delta slots of the three compressed types: drift in ulps (with sign flips, exponent
    /// crossings, special values, random bit patterns), whole and chunked, the sender's frame
    /// choice switching between iterations.
    #[test]
    fn delta_drift_round_trips(
        dtype in compressible(), choice in delta_choices(), len in lengths(),
        iters in 2usize..12, drift in delta_drifts(), seed in any::<u64>(), stir in 0.0..0.7f64,
    ) {
        let mode = CacheMode::Delta;
        Run { dtype, mode, choice, len, iters, drift, seed, stir }.go();
    }
}

/// Slot modes and frame choices of every frame kind but Delta (delta slots sending Exp or
/// Hybrid frames: their contexts go back to "no previous move").
const ALL_MODES: [(CacheMode, FrameChoice); 6] = [
    (CacheMode::Exponent, FrameChoice::Auto),
    (CacheMode::FullValue, FrameChoice::Exp),
    (CacheMode::FullValue, FrameChoice::Hybrid),
    (CacheMode::FullValue, FrameChoice::Auto),
    (CacheMode::Delta, FrameChoice::Exp),
    (CacheMode::Delta, FrameChoice::Hybrid),
];

/// Delta slots that send Delta frames (or choose them).
const DELTA_CODING: [(CacheMode, FrameChoice); 2] = [
    (CacheMode::Delta, FrameChoice::Delta),
    (CacheMode::Delta, FrameChoice::Auto),
];

const BLOCK_LENS: [usize; 28] = [
    0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255,
    256, 257, 1023, 1024, 1025,
];

/// Every length around the 64-element block (and the fp16 8-value packing group), every dtype
/// and mode, with every refusal probed on every frame.
#[test]
fn block_boundary_lengths() {
    for (k, &len) in BLOCK_LENS.iter().enumerate() {
        for dtype in DType::ALL {
            for (mode, choice) in ALL_MODES.into_iter().chain(DELTA_CODING) {
                let mut rng = Rng(k as u64 * 1000 + dtype.code() as u64);
                let mut pair = Pair::new(dtype, mode, choice, len);
                let drift = Drift {
                    q: 0.3,
                    p: 0.05,
                    special: 0.02,
                    ulp: if mode == CacheMode::Delta { 0.3 } else { 0.0 },
                };
                let mut x = initial_tensor(&mut rng, dtype, len, 0.02);
                for it in 0..4 {
                    if it > 0 {
                        x = drift_step(&mut rng, dtype, &x, drift);
                    }
                    pair.step_whole(&x, Probes::all());
                }
                x = drift_step(&mut rng, dtype, &x, drift);
                pair.step_chunked(&x, 64, &mut rng, false);
            }
        }
    }
}

/// Delta frames of lengths where their geometry changes: lanes = clamp(n / 512, 1, 32) steps
/// (a lane up to 1023, two from 1024, 32 from 16384), partial last rows, groups of 32768 (a
/// second group, a short last one, lanes with no element in the last group), with every
/// refusal probed; then chunked, and in ranges.
#[test]
fn delta_geometry_boundaries() {
    let lens = [
        1usize,
        7,
        33,
        100,
        511,
        512,
        1023,
        1024,
        1025,
        1536,
        2047,
        2048,
        2049,
        2559,
        2560,
        4095,
        4096,
        16383,
        16384,
        16385,
        32767,
        32768,
        32769,
        32768 + 31,
        65536,
        65536 + 2048 + 5,
    ];
    for (k, &len) in lens.iter().enumerate() {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for (mode, choice) in DELTA_CODING {
                let mut rng = Rng(0xDE17A + k as u64 * 1000 + dtype.code() as u64);
                let mut pair = Pair::new(dtype, mode, choice, len);
                let drift = Drift {
                    q: 0.02,
                    p: 0.002,
                    special: 0.001,
                    ulp: 0.6,
                };
                let mut x = initial_tensor(&mut rng, dtype, len, 0.01);
                for it in 0..4 {
                    if it > 0 {
                        x = drift_step(&mut rng, dtype, &x, drift);
                    }
                    let probes = if it == 2 {
                        Probes::all()
                    } else {
                        Probes::default()
                    };
                    pair.step_whole(&x, probes);
                }
                // (Auto finds Exp smaller on short chunks.)
                if len
                    >= if choice == FrameChoice::Auto {
                        2048
                    } else {
                        100
                    }
                {
                    let m = pair.by_mode.get();
                    assert!(m[3] >= 2, "{}: {m:?}", pair.ctx());
                }
                x = drift_step(&mut rng, dtype, &x, drift);
                pair.step_chunked(&x, (len / 3).max(1), &mut rng, true);
                x = drift_step(&mut rng, dtype, &x, drift);
                pair.step_ranges(&x, &mut rng);
            }
        }
    }
}

/// The delta drift runs do what they are for: most frames of drifting delta slots are Delta
/// frames, ulp drift compresses well below the raw size, and switching choices reaches every
/// frame kind.
#[test]
fn delta_runs_send_delta_frames() {
    let mut total = [0usize; 4];
    let (mut bytes, mut raw) = (0, 0);
    for seed in 0..24u64 {
        let dtype = [DType::BF16, DType::F16, DType::F32][seed as usize % 3];
        let choice = [FrameChoice::Delta, FrameChoice::Auto][seed as usize / 3 % 2];
        let pair = Run {
            dtype,
            mode: CacheMode::Delta,
            choice,
            len: 3000 + 1000 * (seed as usize % 5),
            iters: 10,
            drift: Drift {
                q: 0.0,
                p: 0.0,
                special: 0.0005,
                ulp: 0.7,
            },
            seed,
            stir: if seed < 12 { 0.0 } else { 0.6 },
        }
        .go();
        let m = pair.by_mode.get();
        for (t, x) in total.iter_mut().zip(m) {
            *t += x;
        }
        if seed < 12 {
            // No disturbance: a FILL, then Delta frames only (Auto finds them the smallest).
            assert_eq!((m[0], m[3]), (1, 9), "{}: {m:?}", pair.ctx());
            bytes += pair.bytes;
            raw += 10 * pair.len * dtype.size();
        }
    }
    assert!(
        bytes * 2 < raw,
        "ulp drift: {bytes} frame bytes for {raw} raw bytes"
    );
    assert!(total.iter().all(|&x| x > 0), "frames by mode {total:?}");
}

/// A value of one special class from random bits.
type MakeValue = Box<dyn Fn(u64) -> u64>;

/// Each special class alone, as the whole tensor and as the drift: NaN payloads, infinities,
/// zeros, subnormals must survive every frame kind bit for bit.
#[test]
fn special_values_round_trip() {
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let fb = float_bits(dtype).unwrap();
        let size = dtype.size();
        let sign = 1u64 << (fb.mant + fb.exp);
        let emax = low_bits(fb.exp);
        let classes: [(&str, MakeValue); 6] = [
            (
                "nan",
                Box::new(move |r: u64| {
                    (r & sign) | (emax << fb.mant) | (r & low_bits(fb.mant)).max(1)
                }),
            ),
            (
                "inf",
                Box::new(move |r: u64| (r & sign) | (emax << fb.mant)),
            ),
            ("zero", Box::new(move |r: u64| r & sign)),
            (
                "subnormal",
                Box::new(move |r: u64| (r & sign) | (r & low_bits(fb.mant)).max(1)),
            ),
            (
                "normal",
                Box::new(move |r: u64| {
                    (r & sign) | (((r >> 32) % (emax - 1) + 1) << fb.mant) | (r & low_bits(fb.mant))
                }),
            ),
            (
                "bits",
                Box::new(move |r: u64| r & low_bits(8 * size as u32)),
            ),
        ];
        for (mode, choice) in ALL_MODES.into_iter().chain(DELTA_CODING) {
            let len = 300;
            let mut pair = Pair::new(dtype, mode, choice, len);
            let mut rng = Rng(dtype.code() as u64);
            for (_class, make) in classes.iter().chain(classes.iter().rev()) {
                let mut x = vec![0u8; len * size];
                for i in 0..len {
                    // Mix the class with the previous iteration's values so both frames and
                    // masks see transitions into and out of the class.
                    let v = if rng.chance(0.7) {
                        make(rng.next())
                    } else {
                        load(&pair.tx_last, size, i)
                    };
                    store(&mut x, size, i, v);
                }
                pair.step_whole(&x, Probes::default());
            }
        }
    }
}

/// ~100k elements, every compressed dtype and mode, chunked on two threads, and whole.
#[test]
fn large_tensors() {
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (mode, choice) in ALL_MODES.into_iter().chain(DELTA_CODING) {
            let len = 100_003;
            let mut rng = Rng(0xC1E7A + dtype.code() as u64);
            let mut pair = Pair::new(dtype, mode, choice, len);
            let mut x = initial_tensor(&mut rng, dtype, len, 0.001);
            pair.step_whole(&x, Probes::default());
            for (it, (q, p)) in [(0.9, 0.03), (0.2, 0.002), (1.0, 0.5)]
                .into_iter()
                .enumerate()
            {
                x = drift_step(
                    &mut rng,
                    dtype,
                    &x,
                    Drift {
                        q,
                        p,
                        special: 0.0005,
                        ulp: if mode == CacheMode::Delta { 0.5 } else { 0.0 },
                    },
                );
                if it % 2 == 0 {
                    pair.step_chunked(&x, 16_384, &mut rng, true);
                } else {
                    pair.step_whole(&x, Probes::default());
                }
            }
            assert_eq!(pair.tx.version(), pair.rx.version());
        }
    }
    // And a raw type, where the frame is the tensor.
    let mut pair = Pair::new(DType::I64, CacheMode::FullValue, FrameChoice::Auto, 100_001);
    let x = initial_tensor(&mut Rng(5), DType::I64, 100_001, 0.0);
    pair.step_chunked(&x, 30_000, &mut Rng(6), true);
    pair.step_whole(&x, Probes::default());
}

// ---- SIMD against plain, in a child process ------------------------------------------------

const ROLE_VAR: &str = "CIERA_CODECTEST_ROLE";
const OUT_VAR: &str = "CIERA_CODECTEST_OUT";

/// A deterministic transcript of everything the SIMD switch can influence: frames of drifting
/// tensors (bf16 and fp32 Exp frames take the AVX2 path, on exponent and on full-value caches;
/// Delta frames with 32 lanes take the vector paths, AVX2 or AVX-512), decodes of damaged frames (resealed, so the deep decoders run), and SH64 of assorted
/// lengths. Identical transcripts from both
/// processes mean identical behaviour.
/// `tries` damaged copies of frame `f` (a bit flipped past the header, the checksum resealed),
/// each decoded by a new receiver that first took the same `history`; appends each outcome to
/// the transcript `t` (0: refused; 1 and the decoded bytes: accepted).
#[allow(clippy::too_many_arguments)]
fn damaged_outcomes(
    t: &mut Vec<u8>,
    rng: &mut Rng,
    f: &[u8],
    dtype: DType,
    mode: CacheMode,
    len: usize,
    history: &[Vec<u8>],
    tries: u32,
) {
    for d in 0..tries {
        let mut g = f.to_vec();
        let at = frame::HEADER_LEN + rng.below(g.len() - frame::HEADER_LEN);
        g[at] ^= 1 << (d * 3 % 8);
        reseal(&mut g);
        let mut s = CacheSlot::new(dtype, mode, len);
        let mut o = vec![0u8; len * dtype.size()];
        for h in history {
            s.decode(h, &mut o).unwrap();
        }
        match s.decode(&g, &mut o) {
            Ok(_) => {
                t.push(1);
                t.extend_from_slice(&o);
            }
            Err(_) => t.push(0),
        }
    }
}

fn transcript() -> Vec<u8> {
    let mut t = Vec::new();
    let mut rng = Rng(0x51D);
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (mode, choice) in ALL_MODES {
            for len in [0usize, 1, 31, 63, 64, 65, 200, 1000, 4097, 20_000] {
                // Fixed start versions: the transcripts of two processes must be comparable.
                let mut tx = CacheSlot::with_version(dtype, mode, len, 7);
                let mut rx = CacheSlot::with_version(dtype, mode, len, 9);
                tx.set_frame_choice(choice);
                let mut x = initial_tensor(&mut rng, dtype, len, 0.01);
                let mut prev = x.clone();
                for it in 0..5 {
                    if it > 0 {
                        let p = [0.0, 0.002, 0.03, 0.3][it - 1];
                        x = drift_step(
                            &mut rng,
                            dtype,
                            &x,
                            Drift {
                                q: 0.5,
                                p,
                                special: 0.001,
                                ulp: 0.0,
                            },
                        );
                    }
                    let (v, warm) = (rx.version(), rx.is_warm());
                    let mut f = Vec::new();
                    tx.encode(&x, &mut f).unwrap();
                    t.extend_from_slice(&(f.len() as u64).to_le_bytes());
                    t.extend_from_slice(&f);
                    for d in 0..4 {
                        if f.len() <= frame::HEADER_LEN {
                            break;
                        }
                        let mut g = f.clone();
                        let at = frame::HEADER_LEN + rng.below(g.len() - frame::HEADER_LEN);
                        g[at] ^= 1 << (d * 3 % 8);
                        reseal(&mut g);
                        let mut s = slot_at(dtype, mode, choice, len, v, warm, &prev);
                        let mut o = vec![0u8; x.len()];
                        match s.decode(&g, &mut o) {
                            Ok(_) => {
                                t.push(1);
                                t.extend_from_slice(&o);
                            }
                            Err(_) => t.push(0),
                        }
                    }
                    let mut o = vec![0u8; x.len()];
                    rx.decode(&f, &mut o).unwrap();
                    assert!(o == x);
                    prev = o;
                }
            }
        }
    }
    // Delta slots sending Delta frames (their vector paths: 32 lanes from 16384 elements):
    // frames, and damaged copies decoded by receivers that took the same history
    // (so their contexts are the ones the damaged frame was coded against).
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (mode, choice) in DELTA_CODING {
            for len in [300, 2048, 16_384, 40_000 + 17] {
                let mut tx = CacheSlot::with_version(dtype, mode, len, 7);
                let mut rx = CacheSlot::with_version(dtype, mode, len, 9);
                tx.set_frame_choice(choice);
                let mut x = initial_tensor(&mut rng, dtype, len, 0.001);
                let mut history: Vec<Vec<u8>> = Vec::new();
                for it in 0..5 {
                    if it > 0 {
                        let d = Drift {
                            q: 0.01,
                            p: 0.001,
                            special: 0.001,
                            ulp: [0.2, 0.9, 1.0, 0.5][it - 1],
                        };
                        x = drift_step(&mut rng, dtype, &x, d);
                    }
                    let mut f = Vec::new();
                    tx.encode(&x, &mut f).unwrap();
                    t.extend_from_slice(&(f.len() as u64).to_le_bytes());
                    t.extend_from_slice(&f);
                    damaged_outcomes(&mut t, &mut rng, &f, dtype, mode, len, &history, 4);
                    let mut o = vec![0u8; x.len()];
                    rx.decode(&f, &mut o).unwrap();
                    assert!(o == x);
                    history.push(f);
                }
            }
        }
    }
    for n in [0usize, 1, 31, 32, 33, 63, 64, 65, 1000, 4097] {
        let d: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
        t.extend_from_slice(&checksum::sh64(&d).to_le_bytes());
        t.extend_from_slice(&checksum::sh64_plain(&d).to_le_bytes());
    }
    t
}

/// Not a test of its own: the child half of `simd_and_plain_paths_agree`, run only when the
/// parent re-executes this binary with the role variable set.
#[test]
fn simd_child_role() {
    if std::env::var_os(ROLE_VAR).is_none_or(|r| r != "plain") {
        return;
    }
    assert!(
        std::env::var_os("CIERA_NO_SIMD").is_some_and(|v| v == "1"),
        "child must run with CIERA_NO_SIMD=1"
    );
    let out = PathBuf::from(std::env::var_os(OUT_VAR).expect("output path"));
    std::fs::File::create(out)
        .unwrap()
        .write_all(&transcript())
        .unwrap();
}

/// The AVX2 path (this process, when the CPU has AVX2) against the plain path (a child process
/// with `CIERA_NO_SIMD=1`; the switch is read once per process): byte-identical frames and
/// identical decodes.
#[test]
fn simd_and_plain_paths_agree() {
    if std::env::var_os(ROLE_VAR).is_some() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    let simd_here = std::is_x86_feature_detected!("avx2")
        && std::env::var_os("CIERA_NO_SIMD").is_none_or(|v| v == "0");
    #[cfg(not(target_arch = "x86_64"))]
    let simd_here = false;
    if !simd_here {
        eprintln!("note: no AVX2 or CIERA_NO_SIMD set: comparing the plain path with itself");
    }
    let path = std::env::temp_dir().join(format!("ciera-codec-plain-{}.bin", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "simd_child_role",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("CIERA_NO_SIMD", "1")
        .env(ROLE_VAR, "plain")
        .env(OUT_VAR, &path)
        .output()
        .expect("re-running the test binary");
    assert!(
        child.status.success(),
        "child (plain path) failed: {}\n{}{}",
        child.status,
        String::from_utf8_lossy(&child.stdout),
        String::from_utf8_lossy(&child.stderr)
    );
    let plain =
        std::fs::read(&path).expect("the child wrote no transcript (test filter did not match?)");
    let _ = std::fs::remove_file(&path);
    let here = transcript();
    if let Some(at) = here.iter().zip(&plain).position(|(a, b)| a != b) {
        panic!(
            "SIMD and plain transcripts differ first at byte {at} of {}",
            here.len()
        );
    }
    assert_eq!(here.len(), plain.len(), "transcript lengths");
}

// ---- Delta frames: AVX-512 against AVX2 against plain, in child processes -------------------

/// A deterministic transcript of Delta coding for bf16, fp16 and fp32 on the vector paths (32
/// lanes from 16384 elements): one group, several groups, partial last rows, element counts not
/// a multiple of 32, a sampled chunk; drift in ulps with large moves (extra bits), NaN/inf/-0/subnormal; every
/// frame, every decode (which must reproduce the input), damaged frames decoded by receivers
/// with the same history (an error or the values, never a panic; some damage, on every path,
/// decodes to other values without an error), and a frame
/// each receiver encodes from the contexts its decodes left.
fn delta_transcript() -> Vec<u8> {
    let mut t = Vec::new();
    let mut rng = Rng(0xD512);
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        // 32 * 4096 + 4101: a chunk the encoder samples (tables counted from every eighth tile
        // of 4096), ending in a short uncounted tile.
        for len in [
            16_384usize,
            16_389,
            2 * 32_768 + 33,
            100_003,
            32 * 4096 + 4101,
        ] {
            let mode = CacheMode::Delta;
            let mut tx = CacheSlot::with_version(dtype, mode, len, 7);
            let mut rx = CacheSlot::with_version(dtype, mode, len, 9);
            tx.set_frame_choice(FrameChoice::Delta);
            let mut x = initial_tensor(&mut rng, dtype, len, 0.01);
            let mut history: Vec<Vec<u8>> = Vec::new();
            for it in 0..6 {
                if it > 0 {
                    let d = Drift {
                        q: 0.02,
                        p: 0.002,
                        special: [0.0, 0.01, 0.001, 0.05, 0.0][it - 1],
                        ulp: [0.2, 0.9, 1.0, 0.5, 0.05][it - 1],
                    };
                    x = drift_step(&mut rng, dtype, &x, d);
                }
                let mut f = Vec::new();
                let sent = tx.encode(&x, &mut f).unwrap();
                t.extend_from_slice(&(f.len() as u64).to_le_bytes());
                t.extend_from_slice(&f);
                if it > 0 {
                    damaged_outcomes(&mut t, &mut rng, &f, dtype, mode, len, &history, 6);
                }
                let mut o = vec![0u8; x.len()];
                let got = rx.decode(&f, &mut o).unwrap();
                assert!(
                    o == x,
                    "{dtype:?} n={len} iteration {it}: decoded bits differ"
                );
                // Both sides count the same changes (values, exponents), on every path.
                assert_eq!(
                    (got.value_changes, got.exp_changes),
                    (sent.value_changes, sent.exp_changes),
                    "{dtype:?} n={len} iteration {it}: decoder and encoder count different changes"
                );
                for k in [sent.value_changes.unwrap_or(usize::MAX), sent.exp_changes] {
                    t.extend_from_slice(&(k as u64).to_le_bytes());
                }
                t.extend_from_slice(&o);
                history.push(f);
            }
            // The receiver's contexts (left by its decodes) code its next frame.
            let next = drift_step(
                &mut rng,
                dtype,
                &x,
                Drift {
                    q: 0.02,
                    p: 0.0,
                    special: 0.001,
                    ulp: 0.7,
                },
            );
            rx.set_frame_choice(FrameChoice::Delta);
            let mut f = Vec::new();
            rx.encode(&next, &mut f).unwrap();
            t.extend_from_slice(&f);
        }
    }
    t
}

/// Not a test of its own: the child half of `delta_avx512_avx2_plain_agree`, run only when
/// the parent re-executes this binary with the role variable set.
#[test]
fn delta_child_role() {
    if std::env::var_os(ROLE_VAR).is_none_or(|r| r != "delta") {
        return;
    }
    let out = PathBuf::from(std::env::var_os(OUT_VAR).expect("output path"));
    std::fs::File::create(out)
        .unwrap()
        .write_all(&delta_transcript())
        .unwrap();
}

/// Delta frames of bf16, fp16 and fp32 through the AVX-512 path (this process, when the CPU has
/// it), the AVX2 path (a child with `CIERA_NO_AVX512=1`) and the plain path (a child with `CIERA_NO_SIMD=1`): byte-identical frames,
/// identical decodes, identical contexts.
#[test]
fn delta_avx512_avx2_plain_agree() {
    if std::env::var_os(ROLE_VAR).is_some() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    let (avx2, avx512) = (
        std::is_x86_feature_detected!("avx2"),
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("avx512cd")
            && std::is_x86_feature_detected!("avx512vbmi")
            && std::is_x86_feature_detected!("avx512vbmi2"),
    );
    #[cfg(not(target_arch = "x86_64"))]
    let (avx2, avx512) = (false, false);
    let env_on = |v: &str| std::env::var_os(v).is_some_and(|x| x != "0");
    if !avx512 || env_on("CIERA_NO_AVX512") || env_on("CIERA_NO_SIMD") {
        eprintln!(
            "note: skipping the AVX-512 leg (no AVX-512 F/BW/VL/CD/VBMI/VBMI2 on this CPU, or \
             CIERA_NO_AVX512/CIERA_NO_SIMD set): this process runs {} path",
            if avx2 && !env_on("CIERA_NO_SIMD") {
                "the AVX2"
            } else {
                "the plain"
            }
        );
    }
    let run = |name: &str, var: &str| -> Vec<u8> {
        let path = std::env::temp_dir().join(format!(
            "ciera-codec-delta-{name}-{}.bin",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "delta_child_role",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(var, "1")
            .env(ROLE_VAR, "delta")
            .env(OUT_VAR, &path)
            .output()
            .expect("re-running the test binary");
        assert!(
            child.status.success(),
            "child ({name} path) failed: {}\n{}{}",
            child.status,
            String::from_utf8_lossy(&child.stdout),
            String::from_utf8_lossy(&child.stderr)
        );
        let t = std::fs::read(&path)
            .expect("the child wrote no transcript (test filter did not match?)");
        let _ = std::fs::remove_file(&path);
        t
    };
    let avx2_t = run("avx2", "CIERA_NO_AVX512");
    let plain_t = run("plain", "CIERA_NO_SIMD");
    let here = delta_transcript();
    for (name, other) in [("AVX2", &avx2_t), ("plain", &plain_t)] {
        if let Some(at) = here.iter().zip(other).position(|(a, b)| a != b) {
            panic!(
                "this process's and the {name} path's Delta transcripts differ first at byte \
                 {at} of {}",
                here.len()
            );
        }
        assert_eq!(here.len(), other.len(), "{name} transcript length");
    }
}

/// A chunk the encoder samples (at least 32 tiles of 4096 elements: its tables are counted from
/// tiles 0, 8, 16, ... only) still codes every element: here the frame's only moves, a sign
/// flip, a NaN and a move of 1000 ulps, lie in uncounted tiles and in contexts the counted
/// tiles never have (they hold no move at all), and every type decodes them exactly from a
/// Delta frame.
#[test]
fn sampled_delta_tables_cover_the_uncounted_tiles() {
    for (dtype, one, nan) in [
        (DType::BF16, 0x3f80u32, 0x7fc1u32),
        (DType::F16, 0x3c00, 0x7e01),
        (DType::F32, 0x3f80_0000, 0x7fc0_0001),
    ] {
        let size = dtype.size();
        let n = 32 * 4096 + 7;
        let sign = 1u32 << (8 * size - 1);
        let put = |v: &mut Vec<u8>, i: usize, bits: u32| {
            v[i * size..(i + 1) * size].copy_from_slice(&bits.to_le_bytes()[..size]);
        };
        let mut x0 = vec![0u8; n * size];
        for i in 0..n {
            put(&mut x0, i, one);
        }
        // Elements in tiles 3, 9 and 17 (none a multiple of 8).
        let (a, b, c) = (3 * 4096 + 5, 9 * 4096 + 100, 17 * 4096 + 1);
        let mut x1 = x0.clone();
        put(&mut x1, a, one - 5); // context -5 for the next frame
        put(&mut x1, b, one + 3); // context 3
        let mut x2 = x1.clone();
        put(&mut x2, a, (one - 5) ^ sign);
        put(&mut x2, b, nan);
        put(&mut x2, c, one + 1000);
        let mut tx = CacheSlot::new(dtype, CacheMode::Delta, n);
        let mut rx = CacheSlot::new(dtype, CacheMode::Delta, n);
        tx.set_frame_choice(FrameChoice::Delta);
        let mut modes = Vec::new();
        for x in [&x0, &x1, &x2] {
            let mut f = Vec::new();
            tx.encode(x, &mut f).unwrap();
            modes.push(f[6]);
            let mut out = vec![0u8; n * size];
            rx.decode(&f, &mut out)
                .unwrap_or_else(|e| panic!("{dtype}: {e}"));
            assert!(out == *x, "{dtype}: decoded bits differ");
        }
        assert_eq!(
            modes[1..],
            [3, 3],
            "{dtype}: Delta frames (modes {modes:?})"
        );
    }
}
