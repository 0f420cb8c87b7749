//! A cache slot: one source shard's cache, identical on the sender and on every receiver, its
//! versions, and what one frame did ([`FrameInfo`]).

use super::chunk::SlotChunk;
use super::error::{CodecError, Result};
use super::frame::{self, Frame, Mode};
use crate::DType;

/// What a cache slot remembers per element.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CacheMode {
    /// The exponent field: 1 byte per element. Enables `Exp` frames.
    Exponent,
    /// The whole previous value: element size per element. Enables `Exp` and `Hybrid` frames.
    FullValue,
    /// The whole previous value and the element's previous move (one context byte): element
    /// size + 1 per element. Enables `Exp`, `Hybrid` and `Delta` frames.
    Delta,
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
            CacheMode::Delta => dtype.size() + 1,
        }
    }

    /// Whether the slot keeps whole values (Hybrid frames possible).
    pub fn holds_values(self) -> bool {
        self != CacheMode::Exponent
    }

    pub fn name(self) -> &'static str {
        match self {
            CacheMode::Exponent => "exp",
            CacheMode::FullValue => "full",
            CacheMode::Delta => "delta",
        }
    }
}

/// Which delta frame a full-value slot sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrameChoice {
    Exp,
    Hybrid,
    /// Delta frames (delta slots only; a full-value slot sends Hybrid).
    Delta,
    /// Per chunk: full-value slots send Hybrid where it saves at least a fifth of the bytes of
    /// Exp (it costs several times the codec time), else Exp; delta slots send the smallest of
    /// Exp, Hybrid and Delta.
    Auto,
    /// Per chunk as a full-value slot's `Auto` (Exp or Hybrid), also on a delta slot: where
    /// Delta's codec time costs more than its smaller frames save (a fast link).
    NoDelta,
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

/// The encoder's estimate of a chunk's frame bytes at each frame level (Exp only; Exp or
/// Hybrid; every kind the cache takes, as `compress::LEVEL_CHOICES`), where the choice it made
/// computed it (None elsewhere): what the policy predicts other levels' wire from without
/// trying them. Not a property of the frame (a receiver cannot know it), so not in
/// [`FrameInfo`].
pub type LevelBytes = [Option<usize>; 3];

impl FrameInfo {
    /// What a parsed frame says of itself (change counts filled in by the decoder).
    pub(super) fn of(f: &Frame<'_>, raw_bytes: usize) -> FrameInfo {
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
    /// The cached values (full-value and delta slots) or cached fields (exponent slots).
    state: Vec<u8>,
    /// Delta slots: per element its previous move, clipped (see `delta::context_of`).
    ctx: Vec<u8>,
    /// Threads a chunk's Delta frame may be encoded or decoded on (1: the caller's alone).
    threads: usize,
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
            ctx: Vec::new(),
            threads: 1,
        }
    }

    /// Which delta frames a full-value slot sends (default `Auto`; exponent slots always `Exp`).
    pub fn set_frame_choice(&mut self, choice: FrameChoice) {
        self.choice = choice;
    }

    /// Encode and decode a chunk's Delta frame on up to `threads` threads (clamped to
    /// 1..=[`MAX_CODEC_THREADS`](super::MAX_CODEC_THREADS)): the caller's and the codec's
    /// pool's, each a run of whole groups of 32768 elements (a chunk of fewer than four groups
    /// stays on the caller's). The frames, values, counts and errors are those of one thread.
    pub fn set_codec_threads(&mut self, threads: usize) {
        self.threads = threads.clamp(1, super::MAX_CODEC_THREADS);
    }

    pub fn codec_threads(&self) -> usize {
        self.threads
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
    /// The cached values of a warm full-value or delta slot (`len` elements); None for
    /// exponent slots and cold slots.
    pub fn values(&self) -> Option<&[u8]> {
        let bytes = self.len * self.dtype.size();
        (self.warm && self.mode.holds_values() && self.state.len() == bytes).then_some(&self.state)
    }

    /// The move contexts of a warm delta slot: one byte per element, the previous move
    /// clipped to -8..8, plus 8 (docs/WIRE.md, "Delta"); None for other modes and cold slots.
    pub fn contexts(&self) -> Option<&[u8]> {
        (self.warm && self.mode == CacheMode::Delta && self.ctx.len() == self.len)
            .then_some(&self.ctx)
    }

    /// The same cache in another mode, at the same version, without a frame: a warm
    /// full-value or delta slot holds every value, so it makes a warm slot of any mode (a
    /// delta slot's move contexts start at "no previous move", as after a fill). Every rank
    /// converts its copy alike, so the next frames decode as against the slot they replace.
    /// None for exponent and cold slots (they hold no values).
    pub fn converted(&self, mode: CacheMode) -> Option<CacheSlot> {
        let values = self.values()?;
        let mut slot = CacheSlot::with_version(self.dtype, mode, self.len, self.version);
        slot.choice = self.choice;
        slot.fill_from(values).ok()?;
        Some(slot)
    }

    /// [`converted`](Self::converted) in place, reusing this slot's memory where the other
    /// mode's fits in it: a delta slot becomes a full-value slot by dropping its move contexts
    /// (its values stay where they are) and an exponent slot in its context bytes (one byte
    /// per element either way); a full-value slot becomes a delta slot around its values (only
    /// the contexts are new). Fresh memory costs page faults of the order of a copy
    /// (unshaped, 4 ranks on 2 cores: a 24 MiB cache's faults took ~10 ms a rank), and a
    /// policy converts its caches more than once while it finds the fastest frames. The slot
    /// ends as the one `converted` makes, byte for byte; false (the slot unchanged) where that
    /// makes none.
    pub fn convert(&mut self, mode: CacheMode) -> bool {
        if self.values().is_none() {
            return false;
        }
        let len = self.len;
        match (self.mode, mode) {
            // As after a fill: no previous move.
            (CacheMode::Delta, CacheMode::Delta) => self.ctx.fill(super::delta::CONTEXT_NONE),
            (from, to) if from == to => {}
            (CacheMode::Delta, CacheMode::FullValue) => self.ctx = Vec::new(),
            (CacheMode::FullValue, CacheMode::Delta) => {
                self.ctx = vec![super::delta::CONTEXT_NONE; len];
            }
            (CacheMode::Delta, CacheMode::Exponent) => {
                let values = std::mem::take(&mut self.state);
                self.state = std::mem::take(&mut self.ctx);
                self.mode = mode;
                self.chunk(0..len).fill(&values);
            }
            _ => match self.converted(mode) {
                Some(slot) => *self = slot,
                None => return false,
            },
        }
        self.mode = mode;
        true
    }

    /// Bytes of cache memory this slot holds (or will once filled).
    pub fn memory_bytes(&self) -> usize {
        self.len * self.mode.bytes_per_element(self.dtype)
    }

    /// Fill the slot with `values` (every element, as a raw FILL frame would) without a frame:
    /// the values reached every rank some other way (an uncompressed call) and every rank
    /// fills its copy alike. The slot is warm at its current version afterwards, which every
    /// rank must have made identical (see [`CacheSlot::with_version`]) and unlike any version
    /// this slot's source used before.
    pub fn fill_from(&mut self, values: &[u8]) -> Result<()> {
        let expect = self.len * self.dtype.size();
        if values.len() != expect {
            return Err(CodecError::LengthMismatch {
                what: "fill values bytes",
                expected: expect,
                found: values.len(),
            });
        }
        let len = self.len;
        self.chunk(0..len).fill(values);
        self.warm = self.dtype.is_compressible();
        Ok(())
    }

    /// Forget the cached values: the next frame for this slot must be a raw FILL. The slot takes
    /// a fresh random version, so no delta frame made against the old state can match it.
    pub fn poison(&mut self) {
        self.warm = false;
        self.version = random_version();
    }

    /// Allocate the slot's memory now and touch every page of it, so that a later fill or
    /// decode does not take the page faults (e.g. on another thread while a transfer runs).
    pub fn allocate(&mut self) {
        self.ensure_state();
        for b in self
            .state
            .iter_mut()
            .step_by(4096)
            .chain(self.ctx.iter_mut().step_by(4096))
        {
            // A write the compiler cannot drop: the page is then resident.
            *b = std::hint::black_box(0);
        }
    }

    fn ensure_state(&mut self) {
        let per = self.mode.bytes_per_element(self.dtype);
        let ctx = if self.mode == CacheMode::Delta && per > 0 {
            self.len
        } else {
            0
        };
        let want = self.len * per - ctx;
        if self.state.len() != want {
            self.state = vec![0u8; want];
        }
        if self.ctx.len() != ctx {
            self.ctx = vec![0u8; ctx];
        }
    }

    /// Value (or cached field) bytes per element of the state.
    fn value_bytes(&self) -> usize {
        let per = self.mode.bytes_per_element(self.dtype);
        if self.mode == CacheMode::Delta && per > 0 {
            per - 1
        } else {
            per
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
        let per = self.value_bytes();
        let has_ctx = !self.ctx.is_empty();
        let (dtype, mode, choice, version, warm, len, threads) = (
            self.dtype,
            self.mode,
            self.choice,
            self.version,
            self.warm,
            self.len,
            self.threads,
        );
        let mut out = Vec::with_capacity(len.div_ceil(chunk_elems));
        let mut rest: &mut [u8] = &mut self.state;
        let mut rest_ctx: &mut [u8] = &mut self.ctx;
        let mut offset = 0;
        while offset < len {
            let n = chunk_elems.min(len - offset);
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(n * per);
            rest = tail;
            let (ctx, tail) =
                std::mem::take(&mut rest_ctx).split_at_mut(if has_ctx { n } else { 0 });
            rest_ctx = tail;
            out.push(SlotChunk {
                dtype,
                mode,
                choice,
                version,
                warm,
                offset,
                len: n,
                state: head,
                ctx,
                threads,
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
        let per = self.value_bytes();
        let ctx = if self.ctx.is_empty() {
            &mut self.ctx[..]
        } else {
            &mut self.ctx[elems.clone()]
        };
        SlotChunk {
            dtype: self.dtype,
            mode: self.mode,
            choice: self.choice,
            version: self.version,
            warm: self.warm,
            offset: elems.start,
            len: elems.len(),
            state: &mut self.state[elems.start * per..elems.end * per],
            ctx,
            threads: self.threads,
        }
    }

    /// End an iteration whose chunks produced `infos` (all chunks, each exactly once). Both
    /// sides advance to `version + 1`; the slot is warm if it was, or if every chunk filled it.
    pub fn commit(&mut self, infos: &[FrameInfo]) -> Result<()> {
        let base = infos.first().map_or(self.version, |i| i.version);
        let covered: usize = infos.iter().map(|i| i.count).sum();
        if covered != self.len || infos.iter().any(|i| i.version != base) {
            self.poison();
            return Err(CodecError::SlotState {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// bf16 values near 1.0 that move by a few ulps each step (some elements not at all).
    fn steps(n: usize, k: usize) -> Vec<Vec<u8>> {
        let mut v: Vec<u16> = (0..n).map(|i| 0x3f80 + (i % 251) as u16).collect();
        (0..k)
            .map(|s| {
                for (i, x) in v.iter_mut().enumerate() {
                    let m = ((i * 7 + s * 13) % 5) as u16;
                    *x = if i % 3 == 0 { *x } else { x.wrapping_add(m) };
                }
                v.iter().flat_map(|x| x.to_le_bytes()).collect()
            })
            .collect()
    }

    /// A converted cache codes the next step exactly as a cache of that mode filled with the
    /// same values at the same version would (byte for byte), and decodes it exactly on a
    /// receiver that converted its copy alike.
    #[test]
    fn converted_caches_code_like_filled_ones() {
        let n = 20_000;
        let s = steps(n, 5);
        for to in [CacheMode::FullValue, CacheMode::Exponent, CacheMode::Delta] {
            let mut tx = CacheSlot::new(DType::BF16, CacheMode::Delta, n);
            let mut rx = CacheSlot::new(DType::BF16, CacheMode::Delta, n);
            let mut frame = Vec::new();
            let mut out = vec![0u8; 2 * n];
            for x in &s[..4] {
                frame.clear();
                tx.encode(x, &mut frame).unwrap();
                rx.decode(&frame, &mut out).unwrap();
                assert_eq!(&out, x);
            }
            let (mut ctx_, mut crx) = (tx.converted(to).unwrap(), rx.converted(to).unwrap());
            assert_eq!((ctx_.mode(), ctx_.version()), (to, tx.version()));
            // In place: the same slot, byte for byte (and a receiver converted in place
            // decodes what the copy encodes).
            let inplace = |from: &CacheSlot| {
                let mut c = CacheSlot::with_version(DType::BF16, from.mode(), n, from.version());
                c.fill_from(from.values().unwrap()).unwrap();
                c.ctx.copy_from_slice(&from.ctx);
                c.set_frame_choice(from.choice);
                assert!(c.convert(to));
                c
            };
            let (mut itx, mut irx) = (inplace(&tx), inplace(&rx));
            for (a, b) in [(&itx, &ctx_), (&irx, &crx)] {
                assert_eq!(
                    (a.mode, a.version, a.warm, a.choice, &a.state, &a.ctx),
                    (b.mode, b.version, b.warm, b.choice, &b.state, &b.ctx),
                    "{to:?}"
                );
            }
            // And back: a full-value cache made a delta cache in place.
            if to == CacheMode::FullValue {
                assert!(itx.convert(CacheMode::Delta));
                let copy = ctx_.converted(CacheMode::Delta).unwrap();
                assert_eq!((&itx.state, &itx.ctx), (&copy.state, &copy.ctx));
                assert_eq!((itx.mode, itx.version), (CacheMode::Delta, tx.version()));
            }
            let mut filled = CacheSlot::with_version(DType::BF16, to, n, tx.version());
            filled.fill_from(&s[3]).unwrap();
            let (mut a, mut b) = (Vec::new(), Vec::new());
            ctx_.encode(&s[4], &mut a).unwrap();
            filled.encode(&s[4], &mut b).unwrap();
            assert_eq!(a, b, "{to:?}");
            crx.decode(&a, &mut out).unwrap();
            assert_eq!(out, s[4], "{to:?}");
            out.fill(0);
            irx.decode(&a, &mut out).unwrap();
            assert_eq!(out, s[4], "{to:?} (converted in place)");
        }
        // Nothing to convert from: an exponent cache, a cold one.
        let mut e = CacheSlot::new(DType::BF16, CacheMode::Exponent, n);
        e.fill_from(&s[0]).unwrap();
        assert!(e.converted(CacheMode::FullValue).is_none());
        assert!(!e.convert(CacheMode::Delta));
        assert_eq!(e.mode(), CacheMode::Exponent);
        let mut cold = CacheSlot::new(DType::BF16, CacheMode::Delta, n);
        assert!(cold.converted(CacheMode::FullValue).is_none());
        assert!(!cold.convert(CacheMode::Exponent));
    }
}
