//! One chunk of a cache slot: encoding and decoding its frame (Raw/FILL, Exp, Hybrid, Delta),
//! with the kernels of `kernels.rs` and `delta.rs` (and their AVX2 twins in `simd.rs` and
//! `delta_simd.rs`), and the choice of frame per chunk.

use super::delta;
use super::error::{CodecError, Result};
use super::float::{Bf16, Layout, F16, F32};
use super::frame::{self, Frame, Mode};
use super::kernels::{self, CacheRef};
use super::scratch::{with_scratch, Scratch};
use super::slot::{CacheMode, FrameChoice, FrameInfo, LevelBytes};
use super::{bitmask, hybrid_simd, simd};
use crate::DType;

/// One chunk of a [`CacheSlot`]: encodes or decodes elements `offset..offset+len`.
pub struct SlotChunk<'a> {
    pub(super) dtype: DType,
    pub(super) mode: CacheMode,
    pub(super) choice: FrameChoice,
    pub(super) version: u64,
    pub(super) warm: bool,
    pub(super) offset: usize,
    pub(super) len: usize,
    pub(super) state: &'a mut [u8],
    /// Delta slots: the context byte of every element (empty otherwise).
    pub(super) ctx: &'a mut [u8],
    /// Threads a Delta frame's encode or decode may use (`CacheSlot::set_codec_threads`).
    pub(super) threads: usize,
}

impl SlotChunk<'_> {
    pub fn offset(&self) -> usize {
        self.offset
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Encode this chunk's `input` (exactly `len` elements) as one frame appended to `out`.
    pub fn encode(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<FrameInfo> {
        self.encode_estimated(input, out).map(|(info, _)| info)
    }

    /// [`encode`](Self::encode), and the encoder's estimate of the frame's bytes at each frame
    /// level ([`LevelBytes`]).
    pub fn encode_estimated(
        &mut self,
        input: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(FrameInfo, LevelBytes)> {
        let expect = self.len * self.dtype.size();
        if input.len() != expect {
            return Err(CodecError::LengthMismatch {
                what: "encoder input bytes",
                expected: expect,
                found: input.len(),
            });
        }
        let start = out.len();
        let mut level_bytes = [None; 3];
        let (mode, fill, sections, exp_changes, value_changes, s0_hash) =
            if !self.dtype.is_compressible() {
                raw_sections(input, out);
                (Mode::Raw, false, [input.len(), 0, 0, 0], 0, None, None)
            } else if !self.warm {
                raw_sections(input, out);
                self.fill(input);
                (Mode::Raw, true, [input.len(), 0, 0, 0], 0, None, None)
            } else {
                let d = match self.dtype {
                    DType::BF16 => encode_delta::<Bf16>(self, input, out),
                    DType::F16 => encode_delta::<F16>(self, input, out),
                    DType::F32 => encode_delta::<F32>(self, input, out),
                    _ => unreachable!("is_compressible covers exactly these"),
                };
                if out.len() - start > frame::HEADER_LEN + input.len() {
                    // A delta larger than the values (tiny chunks, or values that changed
                    // wholesale): send the values instead, as a FILL. The cache already holds
                    // `input`, which is what a FILL leaves on both sides, so a frame is never
                    // longer than the raw bytes plus the header.
                    out.truncate(start);
                    raw_sections(input, out);
                    self.fill(input);
                    (Mode::Raw, true, [input.len(), 0, 0, 0], 0, None, None)
                } else {
                    level_bytes = d.levels;
                    (
                        d.mode,
                        false,
                        d.sections,
                        d.exp_changes,
                        d.value_changes,
                        d.s0_hash,
                    )
                }
            };
        let h = frame::Header {
            dtype: self.dtype,
            mode,
            flags: if fill { frame::FLAG_FILL } else { 0 },
            count: self.len,
            offset: self.offset,
            version: self.version,
        };
        frame::finish(out, start, &h, sections, s0_hash);
        let info = FrameInfo {
            mode,
            fill,
            dtype: self.dtype,
            count: self.len,
            offset: self.offset,
            version: self.version,
            raw_bytes: input.len(),
            frame_bytes: out.len() - start,
            exp_changes,
            value_changes,
        };
        Ok((info, level_bytes))
    }

    /// Decode a parsed frame for this chunk into `out` (exactly `len` elements).
    pub fn decode(&mut self, f: &Frame<'_>, out: &mut [u8]) -> Result<FrameInfo> {
        if f.dtype != self.dtype {
            return Err(CodecError::DTypeMismatch {
                expected: self.dtype,
                found: f.dtype,
            });
        }
        if f.count != self.len {
            return Err(CodecError::LengthMismatch {
                what: "frame element count",
                expected: self.len,
                found: f.count,
            });
        }
        if f.offset != self.offset {
            return Err(CodecError::LengthMismatch {
                what: "frame element offset",
                expected: self.offset,
                found: f.offset,
            });
        }
        let bytes = self.len * self.dtype.size();
        if out.len() != bytes {
            return Err(CodecError::LengthMismatch {
                what: "decoder output bytes",
                expected: bytes,
                found: out.len(),
            });
        }
        let mut info = FrameInfo::of(f, bytes);
        match f.mode {
            Mode::Raw => {
                if self.dtype.is_compressible() && !info.fill {
                    // Every encoder FILLs with raw frames of these types: a raw frame that
                    // leaves the cache alone would desynchronise it from the sender's.
                    return Err(CodecError::corrupt(
                        "flags",
                        format!("raw {} frame without FILL", self.dtype),
                    ));
                }
                if f.sections[0].len() != bytes || f.sections[1..].iter().any(|s| !s.is_empty()) {
                    return Err(CodecError::corrupt(
                        "raw frame",
                        format!(
                            "sections {:?} for {bytes} value bytes",
                            f.sections.map(|s| s.len())
                        ),
                    ));
                }
                f.verify_s0()?;
                out.copy_from_slice(f.sections[0]);
                if info.fill && self.dtype.is_compressible() {
                    self.fill(out);
                }
            }
            Mode::Exp | Mode::Hybrid | Mode::Delta => {
                if !self.dtype.is_compressible() {
                    return Err(CodecError::corrupt(
                        "mode",
                        format!("{} frame for {}", f.mode.name(), self.dtype),
                    ));
                }
                if !self.warm {
                    return Err(CodecError::SlotState {
                        detail: format!(
                            "{} frame (version {}) for a cold or reset slot; the sender must send raw",
                            f.mode.name(),
                            f.version
                        ),
                    });
                }
                if f.version != self.version {
                    return Err(CodecError::VersionMismatch {
                        slot_version: self.version,
                        frame_version: f.version,
                    });
                }
                let (e, v) = match self.dtype {
                    DType::BF16 => decode_delta::<Bf16>(self, f, out)?,
                    DType::F16 => decode_delta::<F16>(self, f, out)?,
                    DType::F32 => decode_delta::<F32>(self, f, out)?,
                    _ => unreachable!(),
                };
                info.exp_changes = e;
                info.value_changes = v;
            }
        }
        Ok(info)
    }

    pub(super) fn fill(&mut self, values: &[u8]) {
        match (self.mode, self.dtype) {
            (CacheMode::FullValue, _) => self.state.copy_from_slice(values),
            (CacheMode::Delta, _) => {
                self.state.copy_from_slice(values);
                self.ctx.fill(delta::CONTEXT_NONE);
            }
            (CacheMode::Exponent, DType::BF16) => kernels::fill_exps::<Bf16>(values, self.state),
            (CacheMode::Exponent, DType::F16) => kernels::fill_exps::<F16>(values, self.state),
            (CacheMode::Exponent, DType::F32) => kernels::fill_exps::<F32>(values, self.state),
            _ => {}
        }
    }
}

fn raw_sections(input: &[u8], out: &mut Vec<u8>) {
    frame::begin(out);
    out.extend_from_slice(input);
}

struct Delta {
    mode: Mode,
    s0_hash: Option<u64>,
    sections: [usize; 4],
    exp_changes: usize,
    value_changes: Option<usize>,
    /// Estimated frame bytes at each frame level, where this choice computed them.
    levels: LevelBytes,
}

/// Estimated frame bytes (header included) at the three frame levels from the estimated
/// payloads of an Exp, a Hybrid and (on a delta cache) a Delta frame: Exp only; the smaller
/// of Exp and Hybrid; the smallest of all (None without a Delta estimate).
fn level_estimates(exp: f64, hybrid: f64, delta: Option<f64>) -> LevelBytes {
    let h = frame::HEADER_LEN as f64;
    let l1 = exp.min(hybrid);
    [
        Some((exp + h) as usize),
        Some((l1 + h) as usize),
        delta.map(|d| (l1.min(d) + h) as usize),
    ]
}

/// rANS is worth its codec time on a mask of an Exp or Hybrid frame only when it saves this
/// share of the frame's other sections (values and exponents) over the mask's Flat or Hier
/// coding. A Hybrid frame's value-change mask of density 30-70% (mid-schedule) codes near
/// one bit per bit: there rANS saved under 0.2% of the frame for half the encoder's time.
const RANS_MIN_GAIN: usize = 50; // 1/50 = 2%

/// The same gate for a Hybrid frame's value-change mask, twice as demanding: that mask is a
/// whole bit per value (the exponent-substitution mask covers only the changed values), so its
/// rANS pass (histogram plus coding) is the largest single cost of a Hybrid encode. On
/// olmoe-mini-s0, bf16 layers.1.experts.w1 step 102 (41% changed), rANS there saved 2.9% of
/// the frame and cost a quarter of its encode time (1.79 vs 2.40 GB/s per core); at 4% the
/// worst ratio loss over the 84 trace windows of `ciera analyze --mode hybrid` is 2.8%, late
/// windows (step 599: 10% from rANS on a sparse mask) keep it.
const RANS_MIN_GAIN_VALUES: usize = 25; // 1/25 = 4%

fn encode_delta<L: Layout>(c: &mut SlotChunk<'_>, input: &[u8], out: &mut Vec<u8>) -> Delta {
    with_scratch(|s| encode_delta_with::<L>(c, input, out, s))
}

fn encode_delta_with<L: Layout>(
    c: &mut SlotChunk<'_>,
    input: &[u8],
    out: &mut Vec<u8>,
    s: &mut Scratch,
) -> Delta {
    let n = c.len;
    frame::begin(out);
    let mut choice = match (c.mode, c.choice) {
        (CacheMode::Exponent, _) => FrameChoice::Exp,
        (CacheMode::FullValue, FrameChoice::Delta) => FrameChoice::Hybrid,
        (_, ch) => ch,
    };
    let Scratch {
        masks,
        exps,
        changed,
        exp_changed,
        exp_sub,
        vals,
        delta: ds,
    } = s;
    exps.clear();
    let mut levels = [None; 3];
    if c.mode == CacheMode::Delta {
        if matches!(choice, FrameChoice::Delta | FrameChoice::Auto) {
            let sc = delta::scan::<L>(input, c.state, c.ctx, ds);
            // The three frames, each estimated from pass one's counts (the masks near their
            // entropy).
            // Integer arithmetic, so that a GPU encoder chooses exactly as this does
            // (cuda/codec.cu, `enc_delta_model`).
            let d_est = delta::estimate(&sc, n, delta::width::<L>());
            let (k, ke) = (sc.changed, sc.exp_changed);
            let exp_est = L::sm_len(n) + bitmask::iid_bytes(ke as u64, n as u64) as usize + ke;
            let hyb_est = hybrid_estimate::<L>(n, k, ke);
            levels = level_estimates(exp_est as f64, hyb_est as f64, Some(d_est as f64));
            if choice == FrameChoice::Auto {
                // The smallest of the three.
                choice = if d_est <= exp_est.min(hyb_est) {
                    FrameChoice::Delta
                } else if hyb_est < exp_est {
                    FrameChoice::Hybrid
                } else {
                    FrameChoice::Exp
                };
            }
            if choice == FrameChoice::Delta {
                let (s0, s1, changed, exp_changed) =
                    delta::write::<L>(&sc, input, c.state, c.ctx, ds, out, c.threads);
                return Delta {
                    mode: Mode::Delta,
                    s0_hash: None,
                    sections: [s0, s1, 0, 0],
                    exp_changes: exp_changed,
                    value_changes: Some(changed),
                    levels,
                };
            }
        }
        // An Exp or Hybrid frame leaves no moves behind: the next frame codes every element
        // as a first move (both sides alike).
        c.ctx.fill(delta::CONTEXT_NONE);
    }
    if choice == FrameChoice::NoDelta {
        // Exp or Hybrid, as a full-value slot's Auto.
        choice = FrameChoice::Auto;
    }
    if choice == FrameChoice::Exp {
        return Delta {
            levels,
            ..write_exp::<L>(c, input, out, masks, exps)
        };
    }
    // The packed sm goes straight into the frame: s0 comes first.
    let s0_start = out.len();
    // A chunk known to go as Hybrid is scanned and emitted in one pass (which also sets the
    // cache to `input` and hashes the sm on the way).
    let fused = if choice == FrameChoice::Hybrid {
        hybrid_simd::scan_emit::<L>(input, changed, exp_changed, out, exp_sub, exps, c.state)
    } else {
        None
    };
    let (s0_hash, k) = match fused {
        Some((h, k)) => (Some(h), k),
        None => {
            // Full-value cache: which values and which exponents changed.
            if !simd::scan_full::<L>(input, c.state, changed, exp_changed) {
                kernels::scan_full::<L>(input, c.state, changed, exp_changed);
            }
            let k: usize = changed.iter().map(|w| w.count_ones() as usize).sum();
            if choice == FrameChoice::Auto {
                // Estimate both frames from the counts alone (the hybrid masks near their
                // entropy), and take Hybrid only where it saves at least a fifth of the bytes:
                // it costs several times the codec time of Exp, which must be paid back on the
                // wire.
                let ke: usize = exp_changed.iter().map(|w| w.count_ones() as usize).sum();
                let pe = bitmask::plan(exp_changed, n, None);
                let exp_bytes = L::sm_len(n) + pe.bytes + ke;
                let hyb_bytes = hybrid_estimate::<L>(n, k, ke);
                // The levels this choice weighs (a full-value cache's heaviest is this one).
                levels = level_estimates(exp_bytes as f64, hyb_bytes as f64, None);
                if c.mode == CacheMode::FullValue {
                    levels[2] = levels[1];
                }
                if hyb_bytes as u64 * 5 >= exp_bytes as u64 * 4 {
                    return Delta {
                        levels,
                        ..write_exp::<L>(c, input, out, masks, exps)
                    };
                }
            }
            // The fast path also sets the cache to `input` and hashes the sm on the way.
            let h =
                hybrid_simd::emit::<L>(input, changed, exp_changed, out, exp_sub, exps, c.state);
            if h.is_none() {
                kernels::emit_hybrid::<L>(input, changed, exp_changed, out, exp_sub, exps, vals);
                c.state.copy_from_slice(input);
            }
            (h, k)
        }
    };
    let sm_len = out.len() - s0_start;
    // Histograms wherever rANS may save anything (a mask of runs codes far below the entropy
    // of independent bits), rANS where it saves RANS_MIN_GAIN's share of the frame's other
    // sections (RANS_MIN_GAIN_VALUES' for the value-change mask).
    let rest = sm_len + exps.len();
    let pa = bitmask::plan_gated(changed, n, Some((0, rest / RANS_MIN_GAIN_VALUES)));
    let pb = bitmask::plan_gated(exp_sub, k, Some((0, rest / RANS_MIN_GAIN)));
    let s1 = out.len();
    let s2 = s1 + bitmask::encode_planned_two(changed, n, &pa, exp_sub, k, &pb, out);
    let s3 = out.len();
    out.extend_from_slice(exps);
    Delta {
        mode: Mode::Hybrid,
        s0_hash,
        sections: [sm_len, s2 - s1, s3 - s2, exps.len()],
        exp_changes: exps.len(),
        value_changes: Some(k),
        levels,
    }
}

/// Estimated bytes of a Hybrid frame of `n` values, `k` changed, `ke` of them in exponent (its
/// masks at the entropy of independent bits, plus a table's worth). Integer arithmetic, so a
/// GPU encoder (cuda/codec.cu, `hybrid_estimate`) chooses Exp or Hybrid exactly as this does.
fn hybrid_estimate<L: Layout>(n: usize, k: usize, ke: usize) -> usize {
    L::sm_len(k)
        + bitmask::iid_bytes(k as u64, n as u64) as usize
        + bitmask::iid_bytes(ke as u64, k as u64) as usize
        + ke
        + 300
}

fn write_exp<L: Layout>(
    c: &mut SlotChunk<'_>,
    input: &[u8],
    out: &mut Vec<u8>,
    masks: &mut Vec<u64>,
    exps: &mut Vec<u8>,
) -> Delta {
    let n = c.len;
    let dense_len = L::sm_len(n);
    let d0 = out.len();
    let mut cache = match c.mode {
        CacheMode::Exponent => CacheRef::Exp(c.state),
        CacheMode::FullValue | CacheMode::Delta => CacheRef::Full(c.state),
    };
    let s0_hash = simd::encode_exp::<L>(input, &mut cache, out, masks, exps);
    if s0_hash.is_none() {
        out.resize(d0 + dense_len, 0);
        kernels::encode_exp::<L>(input, cache, &mut out[d0..], masks, exps);
    }
    let budget = (dense_len + exps.len()) / RANS_MIN_GAIN;
    let p = bitmask::plan(masks, n, Some(budget));
    let s1 = out.len();
    bitmask::encode(masks, n, p.coding, out);
    let s2 = out.len();
    out.extend_from_slice(exps);
    Delta {
        mode: Mode::Exp,
        s0_hash,
        sections: [dense_len, s2 - s1, exps.len(), 0],
        exp_changes: exps.len(),
        value_changes: None,
        levels: [None; 3],
    }
}

fn decode_delta<L: Layout>(
    c: &mut SlotChunk<'_>,
    f: &Frame<'_>,
    out: &mut [u8],
) -> Result<(usize, Option<usize>)> {
    with_scratch(|s| decode_delta_with::<L>(c, f, out, s))
}

fn decode_delta_with<L: Layout>(
    c: &mut SlotChunk<'_>,
    f: &Frame<'_>,
    out: &mut [u8],
    scratch: &mut Scratch,
) -> Result<(usize, Option<usize>)> {
    let n = c.len;
    let [s0, s1, s2, s3] = f.sections;
    let Scratch {
        masks,
        exp_sub: sub,
        vals,
        ..
    } = scratch;
    // Segmented rANS masks are new in format version 3.
    let coded: &[&[u8]] = match f.mode {
        Mode::Exp => &[s1],
        Mode::Hybrid => &[s1, s2],
        _ => &[],
    };
    let seg = bitmask::MaskCoding::RansSeg.code();
    if f.format < 3 && coded.iter().any(|m| m.first() == Some(&seg)) {
        return Err(CodecError::corrupt(
            "mask",
            format!(
                "coding {seg} (segmented rANS) in a version {} frame",
                f.format
            ),
        ));
    }
    match f.mode {
        Mode::Exp => {
            if s0.len() != L::sm_len(n) {
                return Err(CodecError::LengthMismatch {
                    what: "sign+mantissa section bytes",
                    expected: L::sm_len(n),
                    found: s0.len(),
                });
            }
            let ones = bitmask::decode(s1, n, masks)?;
            if s2.len() != ones || !s3.is_empty() {
                return Err(CodecError::corrupt(
                    "exponent section",
                    format!(
                        "{} exponents (+{} extra bytes) for {ones} marked changes",
                        s2.len(),
                        s3.len()
                    ),
                ));
            }
            let mut cache = match c.mode {
                CacheMode::Exponent => CacheRef::Exp(c.state),
                CacheMode::FullValue | CacheMode::Delta => CacheRef::Full(c.state),
            };
            // The fused path checks s0 as it decodes (the slot is poisoned if that fails);
            // the plain path checks first.
            match simd::decode_exp::<L>(s0, masks, s2, &mut cache, out)? {
                Some(h) => f.check_s0(h)?,
                None => {
                    f.verify_s0()?;
                    kernels::decode_exp::<L>(s0, masks, s2, cache, out)?;
                }
            }
            c.ctx.fill(delta::CONTEXT_NONE);
            Ok((ones, None))
        }
        Mode::Hybrid => {
            if !c.mode.holds_values() {
                return Err(CodecError::SlotState {
                    detail: "hybrid frame for an exponent-only slot (cache modes disagree)".into(),
                });
            }
            // s0's length says how many values changed (bf16, fp32: sm bytes per value), so
            // both masks can be decoded at once.
            let per = L::sm_len(1);
            let k_hint = (L::sm_len(64) == 64 * per && s0.len() % per == 0).then(|| s0.len() / per);
            let (k, ke) = bitmask::decode_two(s1, n, masks, s2, k_hint, sub)?;
            if s0.len() != L::sm_len(k) {
                return Err(CodecError::LengthMismatch {
                    what: "sign+mantissa section bytes",
                    expected: L::sm_len(k),
                    found: s0.len(),
                });
            }
            if s3.len() != ke {
                return Err(CodecError::corrupt(
                    "exponent section",
                    format!("{} exponents for {ke} marked changes", s3.len()),
                ));
            }
            // The fast path checks s0 as it decodes (the slot is poisoned if that fails); on
            // any error a corrupt s0 is what is reported, as the plain path, which checks first.
            match hybrid_simd::decode::<L>(s0, masks, sub, s3, c.state, out) {
                Ok(Some(h)) => f.check_s0(h)?,
                Ok(None) => {
                    f.verify_s0()?;
                    kernels::decode_hybrid::<L>(s0, masks, sub, s3, k, c.state, out, vals)?;
                }
                Err(e) => {
                    f.verify_s0()?;
                    return Err(e);
                }
            }
            c.ctx.fill(delta::CONTEXT_NONE);
            Ok((ke, Some(k)))
        }
        Mode::Delta => {
            if c.mode != CacheMode::Delta {
                return Err(CodecError::SlotState {
                    detail: format!(
                        "delta frame for a {} slot (cache modes disagree)",
                        c.mode.name()
                    ),
                });
            }
            if !s2.is_empty() || !s3.is_empty() {
                return Err(CodecError::corrupt(
                    "delta frame",
                    format!(
                        "sections s2/s3 hold {}/{} bytes; must be empty",
                        s2.len(),
                        s3.len()
                    ),
                ));
            }
            f.verify_s0()?;
            let (k, ke) =
                delta::decode::<L>(s0, s1, c.state, c.ctx, out, &mut scratch.delta, c.threads)?;
            Ok((ke, Some(k)))
        }
        Mode::Raw => unreachable!(),
    }
}

/// Decode a frame that needs no cache (a raw frame) into `out`.
pub fn decode_raw(frame_bytes: &[u8], out: &mut [u8]) -> Result<FrameInfo> {
    let f = frame::parse(frame_bytes)?;
    if f.mode != Mode::Raw {
        return Err(CodecError::SlotState {
            detail: format!("{} frame needs a cache slot", f.mode.name()),
        });
    }
    let bytes = f
        .count
        .checked_mul(f.dtype.size())
        .filter(|&b| b == f.sections[0].len())
        .ok_or_else(|| {
            CodecError::corrupt(
                "raw frame",
                format!(
                    "{} elements of {} in a {}-byte section",
                    f.count,
                    f.dtype,
                    f.sections[0].len()
                ),
            )
        })?;
    if out.len() != bytes {
        return Err(CodecError::LengthMismatch {
            what: "decoder output bytes",
            expected: bytes,
            found: out.len(),
        });
    }
    if f.sections[1..].iter().any(|s| !s.is_empty()) {
        return Err(CodecError::corrupt(
            "raw frame",
            "raw frames have one section",
        ));
    }
    f.verify_s0()?;
    out.copy_from_slice(f.sections[0]);
    Ok(FrameInfo::of(&f, bytes))
}
