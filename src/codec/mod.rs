//! The CIERA codec: lossless cross-iteration compression of float tensors.
//!
//! Every source rank's shard has a [`CacheSlot`] on the sender and on every receiver. It holds
//! what was sent last time, either the exponent byte of each element ([`CacheMode::Exponent`],
//! 1 byte per element) or the whole previous value ([`CacheMode::FullValue`], element size per
//! element). Sender and receivers code against the same slot state, so a frame only needs to
//! carry what changed:
//!
//! - `Exp` frames: the sign+mantissa of every element, plus the positions and new exponents of
//!   the few elements whose exponent changed (1.5-3.5% at peak LR, 0.2% at low LR).
//! - `Hybrid` frames (full-value cache): positions of the values that changed at all, their
//!   sign+mantissa, and which of those also changed exponent (with the new exponent).
//! - `Raw` frames: the values themselves; with the FILL flag they (re)fill a cold slot.
//!
//! A slot has a version, bumped once per iteration on both sides ([`CacheSlot::commit`]); a
//! delta frame names the version it was coded against and a slot at another version refuses
//! it. Frames are per chunk ([`CacheSlot::chunks`]) and self-delimiting, so chunks of one shard
//! can be coded, sent and decoded independently and in parallel. The byte layout is in
//! docs/WIRE.md and in [`frame`].

pub mod bitmask;
pub mod checksum;
pub mod float;
pub mod frame;
pub mod kernels;
pub mod rans;
mod simd;

use float::{Bf16, Layout, F16, F32};
use kernels::CacheRef;

pub use frame::{Frame, Mode, HEADER_LEN};

use crate::error::{Error, Result};
use crate::DType;

/// What a cache slot remembers per element.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CacheMode {
    /// The exponent field: 1 byte per element. Enables `Exp` frames.
    Exponent,
    /// The whole previous value: element size per element. Enables `Exp` and `Hybrid` frames.
    FullValue,
}

impl CacheMode {
    /// Cache bytes per element for `dtype` (0 for types that travel raw).
    pub fn bytes_per_element(self, dtype: DType) -> usize {
        if !dtype.is_compressible() {
            return 0;
        }
        match self {
            CacheMode::Exponent => 1,
            CacheMode::FullValue => dtype.size(),
        }
    }
}

/// Which delta frame a full-value slot sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrameChoice {
    Exp,
    Hybrid,
    /// Per chunk: Hybrid where it saves at least a fifth of the bytes of Exp (it costs
    /// several times the codec time), else Exp.
    Auto,
}

/// What one frame did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrameInfo {
    pub mode: Mode,
    pub fill: bool,
    pub dtype: DType,
    pub count: usize,
    pub offset: usize,
    /// The slot version the frame was coded against.
    pub version: u64,
    pub raw_bytes: usize,
    pub frame_bytes: usize,
    /// Elements whose exponent changed (delta frames).
    pub exp_changes: usize,
    /// Elements whose value changed (hybrid frames).
    pub value_changes: Option<usize>,
}

impl FrameInfo {
    /// What a parsed frame says of itself (change counts filled in by the decoder).
    fn of(f: &Frame<'_>, raw_bytes: usize) -> FrameInfo {
        FrameInfo {
            mode: f.mode,
            fill: f.flags & frame::FLAG_FILL != 0,
            dtype: f.dtype,
            count: f.count,
            offset: f.offset,
            version: f.version,
            raw_bytes,
            frame_bytes: f.len,
            exp_changes: 0,
            value_changes: None,
        }
    }
}

/// One source shard's cache, identical on the sender and on every receiver.
pub struct CacheSlot {
    dtype: DType,
    mode: CacheMode,
    choice: FrameChoice,
    len: usize,
    version: u64,
    warm: bool,
    state: Vec<u8>,
}

/// A fresh random slot version. A slot takes one whenever it becomes cold, and its FILL frames
/// carry it: a receiver then adopts it. So a delta frame decoded against the wrong slot (say,
/// ranks that inferred different cache keys) fails the version check instead of producing
/// wrong bits, except with probability 2^-64.
fn random_version() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is seeded from the OS once per thread and stepped per call.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x9E37_79B9_7F4A_7C15);
    h.finish()
}

impl CacheSlot {
    /// A cold slot for `len` elements, at a random version. Types the codec does not compress
    /// get an empty state.
    pub fn new(dtype: DType, mode: CacheMode, len: usize) -> CacheSlot {
        CacheSlot::with_version(dtype, mode, len, random_version())
    }

    /// A cold slot at a given version (reproducible frames, e.g. golden tests).
    pub fn with_version(dtype: DType, mode: CacheMode, len: usize, version: u64) -> CacheSlot {
        CacheSlot {
            dtype,
            mode,
            choice: FrameChoice::Auto,
            len,
            version,
            warm: false,
            state: Vec::new(),
        }
    }

    /// Which delta frames a full-value slot sends (default `Auto`; exponent slots always `Exp`).
    pub fn set_frame_choice(&mut self, choice: FrameChoice) {
        self.choice = choice;
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn mode(&self) -> CacheMode {
        self.mode
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn version(&self) -> u64 {
        self.version
    }
    /// Whether the slot holds a complete previous iteration (delta frames possible).
    pub fn is_warm(&self) -> bool {
        self.warm
    }
    /// Bytes of cache memory this slot holds (or will once filled).
    pub fn memory_bytes(&self) -> usize {
        self.len * self.mode.bytes_per_element(self.dtype)
    }

    /// Forget the cached values: the next frame for this slot must be a raw FILL. The slot takes
    /// a fresh random version, so no delta frame made against the old state can match it.
    pub fn poison(&mut self) {
        self.warm = false;
        self.version = random_version();
    }

    fn ensure_state(&mut self) {
        let want = self.memory_bytes();
        if self.state.len() != want {
            self.state = vec![0u8; want];
        }
    }

    /// Split the slot into chunks of `chunk_elems` elements (the last may be shorter), each able
    /// to encode or decode its range independently of the others (e.g. on worker threads).
    /// After every chunk of an iteration has been coded, call [`commit`](Self::commit).
    pub fn chunks(&mut self, chunk_elems: usize) -> Vec<SlotChunk<'_>> {
        if chunk_elems >= self.len {
            return vec![self.chunk(0..self.len)];
        }
        assert!(chunk_elems > 0, "chunk_elems must be positive");
        self.ensure_state();
        let per = self.mode.bytes_per_element(self.dtype);
        let (dtype, mode, choice, version, warm, len) = (
            self.dtype,
            self.mode,
            self.choice,
            self.version,
            self.warm,
            self.len,
        );
        let mut out = Vec::with_capacity(len.div_ceil(chunk_elems));
        let mut rest: &mut [u8] = &mut self.state;
        let mut offset = 0;
        while offset < len {
            let n = chunk_elems.min(len - offset);
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(n * per);
            rest = tail;
            out.push(SlotChunk {
                dtype,
                mode,
                choice,
                version,
                warm,
                offset,
                len: n,
                state: head,
            });
            offset += n;
        }
        out
    }

    /// The chunk of elements `elems` (within `0..len`), to code on its own.
    pub fn chunk(&mut self, elems: std::ops::Range<usize>) -> SlotChunk<'_> {
        assert!(
            elems.start <= elems.end && elems.end <= self.len,
            "chunk {elems:?} of a {}-element slot",
            self.len
        );
        self.ensure_state();
        let per = self.mode.bytes_per_element(self.dtype);
        SlotChunk {
            dtype: self.dtype,
            mode: self.mode,
            choice: self.choice,
            version: self.version,
            warm: self.warm,
            offset: elems.start,
            len: elems.len(),
            state: &mut self.state[elems.start * per..elems.end * per],
        }
    }

    /// End an iteration whose chunks produced `infos` (all chunks, each exactly once). Both
    /// sides advance to `version + 1`; the slot is warm if it was, or if every chunk filled it.
    pub fn commit(&mut self, infos: &[FrameInfo]) -> Result<()> {
        let base = infos.first().map_or(self.version, |i| i.version);
        let covered: usize = infos.iter().map(|i| i.count).sum();
        if covered != self.len || infos.iter().any(|i| i.version != base) {
            self.poison();
            return Err(Error::SlotState {
                detail: format!(
                    "commit of {} chunk(s) covering {covered} of {} elements at versions {:?}",
                    infos.len(),
                    self.len,
                    infos.iter().map(|i| i.version).collect::<Vec<_>>()
                ),
            });
        }
        // A warm slot stays warm: deltas and fills update both sides alike, and a raw frame
        // without FILL leaves both sides untouched. A cold slot warms only if every chunk filled.
        let all_fill = infos.iter().all(|i| i.fill);
        self.warm = self.dtype.is_compressible() && (self.warm || all_fill);
        self.version = base.wrapping_add(1);
        Ok(())
    }

    /// Encode the whole slot as one frame and commit. Cold slots send a raw FILL frame.
    pub fn encode(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<FrameInfo> {
        let info = self.chunk(0..self.len).encode(input, out)?;
        self.commit(std::slice::from_ref(&info))?;
        Ok(info)
    }

    /// Decode one whole-slot frame into `out` and commit. On error the slot is poisoned (the
    /// next frame it accepts is a raw FILL) and `out` holds unspecified bytes.
    pub fn decode(&mut self, frame: &[u8], out: &mut [u8]) -> Result<FrameInfo> {
        let len = self.len;
        let r = frame::parse(frame).and_then(|f| self.chunk(0..len).decode(&f, out));
        match r {
            Ok(info) => {
                self.commit(std::slice::from_ref(&info))?;
                Ok(info)
            }
            Err(e) => {
                self.poison();
                Err(e)
            }
        }
    }
}

/// One chunk of a [`CacheSlot`]: encodes or decodes elements `offset..offset+len`.
pub struct SlotChunk<'a> {
    dtype: DType,
    mode: CacheMode,
    choice: FrameChoice,
    version: u64,
    warm: bool,
    offset: usize,
    len: usize,
    state: &'a mut [u8],
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
        let expect = self.len * self.dtype.size();
        if input.len() != expect {
            return Err(Error::LengthMismatch {
                what: "encoder input bytes",
                expected: expect,
                found: input.len(),
            });
        }
        let start = out.len();
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
        Ok(FrameInfo {
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
        })
    }

    /// Decode a parsed frame for this chunk into `out` (exactly `len` elements).
    pub fn decode(&mut self, f: &Frame<'_>, out: &mut [u8]) -> Result<FrameInfo> {
        if f.dtype != self.dtype {
            return Err(Error::DTypeMismatch {
                expected: self.dtype,
                found: f.dtype,
            });
        }
        if f.count != self.len {
            return Err(Error::LengthMismatch {
                what: "frame element count",
                expected: self.len,
                found: f.count,
            });
        }
        if f.offset != self.offset {
            return Err(Error::LengthMismatch {
                what: "frame element offset",
                expected: self.offset,
                found: f.offset,
            });
        }
        let bytes = self.len * self.dtype.size();
        if out.len() != bytes {
            return Err(Error::LengthMismatch {
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
                    return Err(Error::corrupt(
                        "flags",
                        format!("raw {} frame without FILL", self.dtype),
                    ));
                }
                if f.sections[0].len() != bytes || f.sections[1..].iter().any(|s| !s.is_empty()) {
                    return Err(Error::corrupt(
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
            Mode::Exp | Mode::Hybrid => {
                if !self.dtype.is_compressible() {
                    return Err(Error::corrupt(
                        "mode",
                        format!("{} frame for {}", f.mode.name(), self.dtype),
                    ));
                }
                if !self.warm {
                    return Err(Error::SlotState {
                        detail: format!(
                            "{} frame (version {}) for a cold or reset slot; the sender must send raw",
                            f.mode.name(),
                            f.version
                        ),
                    });
                }
                if f.version != self.version {
                    return Err(Error::VersionMismatch {
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

    fn fill(&mut self, values: &[u8]) {
        match (self.mode, self.dtype) {
            (CacheMode::FullValue, _) => self.state.copy_from_slice(values),
            (CacheMode::Exponent, DType::BF16) => fill_exps::<Bf16>(values, self.state),
            (CacheMode::Exponent, DType::F16) => fill_exps::<F16>(values, self.state),
            (CacheMode::Exponent, DType::F32) => fill_exps::<F32>(values, self.state),
            _ => {}
        }
    }
}

fn fill_exps<L: Layout>(values: &[u8], exps: &mut [u8]) {
    for (i, e) in exps.iter_mut().enumerate() {
        *e = L::exp(L::load(values, i));
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
}

/// rANS is worth its codec time in an `Exp` frame only when it saves this share of the frame.
const EXP_RANS_MIN_GAIN: usize = 50; // 1/50 = 2%

/// Reusable buffers for the coding temporaries: tensors are coded every iteration, and fresh
/// multi-megabyte allocations would page-fault their way through every call. Each thread has
/// one; a thread that lives for one call only (an encoder worker) can be lent a long-lived one
/// with [`CodecScratch::lend`].
#[derive(Default)]
pub struct Scratch {
    masks: Vec<u64>,
    exps: Vec<u8>,
    changed: Vec<u64>,
    exp_changed: Vec<u64>,
    sm: Vec<u8>,
    exp_sub: Vec<u64>,
    vals: Vec<u32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// A coding scratch that outlives threads: `lend` installs it as the current thread's for the
/// duration of `f`, and takes it back (with whatever capacity it grew) afterwards.
#[derive(Default)]
pub struct CodecScratch(Scratch);

impl CodecScratch {
    pub fn lend<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let mine = std::mem::take(&mut self.0);
        let prev = SCRATCH.with(|c| c.replace(mine));
        let r = f();
        self.0 = SCRATCH.with(|c| c.replace(prev));
        r
    }
}

fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    let mut s = SCRATCH.with(|c| c.take());
    let r = f(&mut s);
    SCRATCH.with(|c| c.replace(s));
    r
}

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
    let choice = if c.mode == CacheMode::Exponent {
        FrameChoice::Exp
    } else {
        c.choice
    };
    let Scratch {
        masks,
        exps,
        changed,
        exp_changed,
        sm,
        exp_sub,
        vals,
    } = s;
    exps.clear();
    if choice == FrameChoice::Exp {
        return write_exp::<L>(c, input, out, masks, exps);
    }
    // Full-value cache: which values and which exponents changed.
    if !simd::scan_full::<L>(input, c.state, changed, exp_changed) {
        kernels::scan_full::<L>(input, c.state, changed, exp_changed);
    }
    let k: usize = changed.iter().map(|w| w.count_ones() as usize).sum();
    if choice == FrameChoice::Auto {
        // Estimate both frames from the counts alone (the hybrid masks near their entropy),
        // and take Hybrid only where it saves at least a fifth of the bytes: it costs several
        // times the codec time of Exp, which must be paid back on the wire.
        let ke: usize = exp_changed.iter().map(|w| w.count_ones() as usize).sum();
        let pe = bitmask::plan(exp_changed, n, None);
        let exp_bytes = L::sm_len(n) + pe.bytes + ke;
        let h = |x: usize, m: usize| {
            if m == 0 {
                0.0
            } else {
                m as f64 * bitmask::entropy(x as f64 / m as f64) / 8.0
            }
        };
        let hybrid_est = L::sm_len(k) as f64 + h(k, n) + h(ke, k) + ke as f64 + 300.0;
        if hybrid_est * 1.25 >= exp_bytes as f64 {
            return write_exp::<L>(c, input, out, masks, exps);
        }
    }
    sm.clear();
    kernels::emit_hybrid::<L>(input, changed, exp_changed, sm, exp_sub, exps, vals);
    let pa = bitmask::plan(changed, n, Some(0));
    let pb = bitmask::plan(exp_sub, k, Some(0));
    c.state.copy_from_slice(input);
    out.extend_from_slice(sm);
    let s1 = out.len();
    bitmask::encode(changed, n, pa.coding, out);
    let s2 = out.len();
    bitmask::encode(exp_sub, k, pb.coding, out);
    let s3 = out.len();
    out.extend_from_slice(exps);
    Delta {
        mode: Mode::Hybrid,
        s0_hash: None,
        sections: [sm.len(), s2 - s1, s3 - s2, exps.len()],
        exp_changes: exps.len(),
        value_changes: Some(k),
    }
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
        CacheMode::FullValue => CacheRef::Full(c.state),
    };
    let s0_hash = simd::encode_exp::<L>(input, &mut cache, out, masks, exps);
    if s0_hash.is_none() {
        out.resize(d0 + dense_len, 0);
        kernels::encode_exp::<L>(input, cache, &mut out[d0..], masks, exps);
    }
    let budget = (dense_len + exps.len()) / EXP_RANS_MIN_GAIN;
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
    match f.mode {
        Mode::Exp => {
            if s0.len() != L::sm_len(n) {
                return Err(Error::LengthMismatch {
                    what: "sign+mantissa section bytes",
                    expected: L::sm_len(n),
                    found: s0.len(),
                });
            }
            let ones = bitmask::decode(s1, n, masks)?;
            if s2.len() != ones || !s3.is_empty() {
                return Err(Error::corrupt(
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
                CacheMode::FullValue => CacheRef::Full(c.state),
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
            Ok((ones, None))
        }
        Mode::Hybrid => {
            if c.mode != CacheMode::FullValue {
                return Err(Error::SlotState {
                    detail: "hybrid frame for an exponent-only slot (cache modes disagree)".into(),
                });
            }
            let k = bitmask::decode(s1, n, masks)?;
            let ke = bitmask::decode(s2, k, sub)?;
            if s0.len() != L::sm_len(k) {
                return Err(Error::LengthMismatch {
                    what: "sign+mantissa section bytes",
                    expected: L::sm_len(k),
                    found: s0.len(),
                });
            }
            if s3.len() != ke {
                return Err(Error::corrupt(
                    "exponent section",
                    format!("{} exponents for {ke} marked changes", s3.len()),
                ));
            }
            f.verify_s0()?;
            kernels::decode_hybrid::<L>(s0, masks, sub, s3, k, c.state, out, vals)?;
            Ok((ke, Some(k)))
        }
        Mode::Raw => unreachable!(),
    }
}

/// Decode a frame that needs no cache (a raw frame) into `out`.
pub fn decode_raw(frame_bytes: &[u8], out: &mut [u8]) -> Result<FrameInfo> {
    let f = frame::parse(frame_bytes)?;
    if f.mode != Mode::Raw {
        return Err(Error::SlotState {
            detail: format!("{} frame needs a cache slot", f.mode.name()),
        });
    }
    let bytes = f
        .count
        .checked_mul(f.dtype.size())
        .filter(|&b| b == f.sections[0].len())
        .ok_or_else(|| {
            Error::corrupt(
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
        return Err(Error::LengthMismatch {
            what: "decoder output bytes",
            expected: bytes,
            found: out.len(),
        });
    }
    if f.sections[1..].iter().any(|s| !s.is_empty()) {
        return Err(Error::corrupt("raw frame", "raw frames have one section"));
    }
    f.verify_s0()?;
    out.copy_from_slice(f.sections[0]);
    Ok(FrameInfo::of(&f, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame is never longer than the values plus the header: tiny chunks and values whose
    /// exponents all change fall back to a FILL, and still round-trip.
    #[test]
    fn frames_never_exceed_raw_plus_header() {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for mode in [CacheMode::Exponent, CacheMode::FullValue] {
                for n in [1usize, 2, 3, 5, 8, 13, 64, 65] {
                    let (mut tx, mut rx) = (
                        CacheSlot::new(dtype, mode, n),
                        CacheSlot::new(dtype, mode, n),
                    );
                    let mut s = 12345u64;
                    for it in 0..12 {
                        let input: Vec<u8> = (0..n * dtype.size())
                            .map(|_| {
                                s = s
                                    .wrapping_mul(6364136223846793005)
                                    .wrapping_add(1442695040888963407);
                                (s >> 56) as u8
                            })
                            .collect();
                        let mut f = Vec::new();
                        let info = tx.encode(&input, &mut f).unwrap();
                        assert!(
                            f.len() <= HEADER_LEN + input.len(),
                            "{dtype} {mode:?} n={n} it={it}: {} bytes",
                            f.len()
                        );
                        let mut out = vec![0u8; input.len()];
                        rx.decode(&f, &mut out).unwrap();
                        assert_eq!(out, input);
                        assert_eq!(tx.version(), rx.version());
                        let _ = info;
                    }
                }
            }
        }
    }
}
