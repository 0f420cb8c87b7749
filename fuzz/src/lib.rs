//! The fuzz targets' bodies (`fuzz_targets/*.rs` only wrap them, so `cargo test` here replays
//! inputs through them without libFuzzer) and their helpers: reading fuzzer bytes as
//! parameters, building a cache slot in a given state through the public API, resealing frame
//! checksums so the fuzzer gets past them, and the checks every accepted frame must pass.

use ciera::codec::{
    bitmask, decode_raw, frame, rans, rans_seg, CacheMode, CacheSlot, FrameChoice, FrameInfo, Mode,
};
use ciera::DType;

// Frame surgery (section lengths, checksums, slots in a given state, canonical masks) is the
// same as the tests': one file serves both. So is the Delta frame coding re-derived from
// docs/WIRE.md.
#[path = "../../tests/common/frame_support.rs"]
mod frame_support;
pub use frame_support::{
    mask_is_canonical, rans_table, reseal, section_lens, set_section_lens, slot_at,
};
#[path = "../../tests/common/delta_spec.rs"]
pub mod delta_spec;

/// Fuzzer bytes consumed from the front; runs out into zeros.
pub struct Input<'a>(pub &'a [u8]);

impl Input<'_> {
    pub fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    pub fn u64(&mut self) -> u64 {
        (0..8).fold(0u64, |a, i| a | (self.u8() as u64) << (8 * i))
    }
    /// `n` bytes, cycling the remaining input (zeros if none is left). Consumes up to `n`.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let src = self.0;
        let take = n.min(src.len());
        self.0 = &src[take..];
        if src.is_empty() {
            return vec![0; n];
        }
        (0..n)
            .map(|i| src[i % src.len()].wrapping_add((i / src.len()) as u8))
            .collect()
    }
    pub fn rest(&mut self) -> &[u8] {
        std::mem::take(&mut self.0)
    }
}

/// An accepted coded mask is the one encoding of its bits in its coding (rANS: with its own
/// frequency table).
pub fn assert_mask_canonical(section: &[u8], m: usize, words: &[u64]) {
    if let Err(e) = mask_is_canonical(section, m, words) {
        panic!("{e}");
    }
}

/// What the receiver held before the frame.
pub struct Before<'a> {
    pub dtype: DType,
    pub mode: CacheMode,
    pub choice: FrameChoice,
    pub len: usize,
    pub prev: &'a [u8],
    /// Delta slots: the context byte of every element (empty: all "no previous move", as after
    /// a FILL).
    pub ctx: &'a [u8],
}

impl Before<'_> {
    fn contexts(&self) -> Vec<u8> {
        if self.ctx.is_empty() {
            vec![delta_spec::CONTEXT_NONE; self.len]
        } else {
            self.ctx.to_vec()
        }
    }
}

fn value(b: &[u8], size: usize, i: usize) -> u32 {
    let mut w = [0u8; 4];
    w[..size].copy_from_slice(&b[i * size..(i + 1) * size]);
    u32::from_le_bytes(w)
}

/// `f(move, width)` of every element's move from `prev` to `out` (docs/WIRE.md, "Delta").
fn per_move<T>(dtype: DType, prev: &[u8], out: &[u8], f: impl Fn(u32, u32) -> T) -> Vec<T> {
    let (size, w) = (dtype.size(), 8 * dtype.size() as u32);
    (0..prev.len() / size)
        .map(|i| {
            f(
                delta_spec::ulp_move(value(prev, size, i), value(out, size, i), w),
                w,
            )
        })
        .collect()
}

/// The moves from `prev` to `out` as zigzag values.
pub fn zigzag_moves(dtype: DType, prev: &[u8], out: &[u8]) -> Vec<u32> {
    per_move(dtype, prev, out, delta_spec::zigzag)
}

/// The contexts a Delta frame from `prev` to `out` leaves behind.
pub fn contexts_after(dtype: DType, prev: &[u8], out: &[u8]) -> Vec<u8> {
    per_move(dtype, prev, out, delta_spec::context)
}

/// An accepted Delta frame is exactly the coding of its output under its own model: its s1
/// keeps the document's rules, and its groups are what the document's encoder writes for those
/// moves and contexts with those tables (the rANS decoder inverts the encoder step for step).
pub fn assert_delta_canonical(b: &Before<'_>, bytes: &[u8], out: &[u8]) {
    let p = frame::parse(bytes).expect("an accepted frame parses");
    let w = 8 * b.dtype.size() as u32;
    let m = delta_spec::parse_s1(p.sections[1], p.count, w)
        .unwrap_or_else(|e| panic!("accepted a Delta frame whose s1 the document refuses: {e}"));
    let z = zigzag_moves(b.dtype, b.prev, out);
    let (lanes, lens) = delta_spec::encode_groups(&m, w, &z, &b.contexts())
        .unwrap_or_else(|e| panic!("accepted a Delta frame the document cannot code: {e}"));
    assert_eq!(
        lens, m.lens,
        "accepted group lengths that are not the coding of the output"
    );
    assert!(
        lanes == p.sections[0],
        "accepted groups that are not the coding of the output"
    );
}

/// An accepted delta frame is the canonical coding of its output against the prior state
/// (Exp and Hybrid: same s0 and exponent bytes, masks with the same bits; Delta: see
/// `assert_delta_canonical`).
pub fn assert_canonical(b: &Before<'_>, bytes: &[u8], info: &FrameInfo, out: &[u8]) {
    if info.mode == Mode::Raw {
        return;
    }
    if info.mode == Mode::Delta {
        assert_delta_canonical(b, bytes, out);
        return;
    }
    let choice = if info.mode == Mode::Exp {
        FrameChoice::Exp
    } else {
        FrameChoice::Hybrid
    };
    let mut tx = slot_at(b.dtype, b.mode, choice, b.len, info.version, true, b.prev);
    let mut f = Vec::new();
    let t = tx.encode(out, &mut f).expect("canonical encode");
    if t.mode == Mode::Raw {
        // The encoder sends a FILL where its delta would be longer than the values; such a
        // delta is still a valid frame to accept, but there is no canonical one to compare.
        return;
    }
    assert_eq!(
        (t.mode, t.exp_changes, t.value_changes),
        (info.mode, info.exp_changes, info.value_changes),
        "accepted a non-canonical frame"
    );
    let (p, q) = (frame::parse(bytes).unwrap(), frame::parse(&f).unwrap());
    let masks: &[usize] = if info.mode == Mode::Exp {
        &[1]
    } else {
        &[1, 2]
    };
    for i in 0..4 {
        if masks.contains(&i) {
            let m = if i == 1 {
                b.len
            } else {
                info.value_changes.unwrap()
            };
            let (mut x, mut y) = (Vec::new(), Vec::new());
            let _ = bitmask::decode(p.sections[i], m, &mut x);
            let _ = bitmask::decode(q.sections[i], m, &mut y);
            assert_eq!(x, y, "mask s{i} of an accepted frame");
            assert_mask_canonical(p.sections[i], m, &x);
        } else {
            assert_eq!(
                p.sections[i], q.sections[i],
                "s{i} of an accepted frame is not canonical"
            );
        }
    }
}

/// After an accepted frame (`took`: its mode), the receiver's slot must be what it reported: a
/// sender in that state (values `out`; on a delta slot that took a Delta frame, the contexts of
/// the moves prev -> out) gets `next` through exactly.
pub fn assert_consistent(b: &Before<'_>, took: Mode, rx: &mut CacheSlot, out: &[u8], next: &[u8]) {
    if !rx.is_warm() {
        return;
    }
    let v = rx.version();
    let choice = b.choice;
    let mut tx = if took == Mode::Delta {
        // A Delta frame from prev at v - 1 leaves exactly the contexts of the moves.
        let mut tx = slot_at(
            b.dtype,
            CacheMode::Delta,
            FrameChoice::Delta,
            b.len,
            v.wrapping_sub(1),
            true,
            b.prev,
        );
        if tx.encode(out, &mut Vec::new()).expect("sender encode").mode != Mode::Delta {
            return; // the encoder would send a FILL: no sender has those contexts
        }
        tx.set_frame_choice(choice);
        tx
    } else {
        slot_at(b.dtype, b.mode, choice, b.len, v, true, out)
    };
    let mut f = Vec::new();
    tx.encode(next, &mut f).expect("follow-up encode");
    let mut o = vec![0u8; next.len()];
    let r = rx.decode(&f, &mut o);
    assert!(r.is_ok(), "follow-up frame refused: {r:?}");
    assert!(o == next, "follow-up frame decoded to other values");
}

pub const DTYPES: [DType; 12] = DType::ALL;
pub const MODES: [CacheMode; 3] = [CacheMode::Exponent, CacheMode::FullValue, CacheMode::Delta];
pub const CHOICES: [FrameChoice; 4] = [
    FrameChoice::Exp,
    FrameChoice::Hybrid,
    FrameChoice::Delta,
    FrameChoice::Auto,
];

/// Target `decode_arbitrary`: arbitrary bytes decoded against a cache slot whose state (type,
/// mode, length, version, warm or cold, cached values) is also taken from the input. No input
/// may panic; a frame that is accepted must be the canonical coding of its output and leave
/// the slot consistent.
///
/// Input: dtype, flags, len (u16), version (u8), the cached values, then the frame. Flags: bit
/// 0 and bit 6 the cache mode, bit 1 warm, bit 2 reseal the frame's checksums, bit 3 build its
/// header from the next input bytes (so the fuzzer reaches the section decoders without
/// learning the magic and the hashes), bits 4-5 the frame choice.
pub fn decode_arbitrary(data: &[u8]) {
    let mut inp = Input(data);
    let dtype = DTYPES[inp.u8() as usize % DTYPES.len()];
    let flags = inp.u8();
    let mode = MODES[((flags & 1) | (flags >> 5 & 2)) as usize % 3];
    let warm = flags & 2 != 0;
    let choice = CHOICES[(flags >> 4) as usize % 4];
    let len = inp.u16() as usize % 1025;
    let version = inp.u8() as u64;
    let size = dtype.size();
    let prev = inp.bytes(len * size);
    let mut f = Vec::new();
    if flags & 8 != 0 {
        f.extend_from_slice(b"CIRF");
        f.push(1 + inp.u8() % 3);
        f.push(if inp.u8() < 240 {
            dtype.code()
        } else {
            inp.u8()
        });
        f.push(inp.u8() % 4);
        f.push(inp.u8() % 3);
        let count = if inp.u8() < 240 {
            len as u64
        } else {
            inp.u16() as u64
        };
        f.extend_from_slice(&count.to_le_bytes());
        f.extend_from_slice(&0u64.to_le_bytes());
        f.extend_from_slice(&version.to_le_bytes());
        for _ in 0..4 {
            f.extend_from_slice(&(inp.u16() as u32 % 4096).to_le_bytes());
        }
        f.extend_from_slice(&[0; 16]);
    }
    f.extend_from_slice(inp.rest());
    if flags & 12 != 0 {
        reseal(&mut f);
    }

    let mut rx = slot_at(dtype, mode, choice, len, version, warm, &prev);
    let mut out = vec![0u8; len * size];
    match rx.decode(&f, &mut out) {
        Ok(info) => {
            assert_eq!((info.dtype, info.count, info.offset), (dtype, len, 0));
            let before = Before {
                dtype,
                mode,
                choice,
                len,
                prev: &prev,
                ctx: &[],
            };
            if warm && dtype.is_compressible() {
                assert_canonical(&before, &f, &info, &out);
            }
            let next: Vec<u8> = out
                .iter()
                .enumerate()
                .map(|(i, &b)| if i % 7 == 0 { b ^ 1 } else { b })
                .collect();
            assert_consistent(&before, info.mode, &mut rx, &out, &next);
        }
        Err(_) => assert!(!rx.is_warm(), "a refused frame must poison the slot"),
    }
    if let Ok(p) = frame::parse(&f) {
        // Whatever count the header claims (the output buffer is capped, so a huge count
        // must be refused, not allocated).
        let mut o = vec![0u8; p.count.saturating_mul(p.dtype.size()).min(1 << 24)];
        if let Ok(info) = decode_raw(&f, &mut o) {
            assert_eq!(&o[..], p.sections[0]);
            assert_eq!(info.count, p.count);
        }
    }
}

/// Target `decode_mutated`: a valid frame of fuzzer-chosen data, then fuzzer-chosen damage,
/// decoded against a copy of the receiver: damage the checksums should catch, or structural
/// header edits resealed, must give Err or exactly the original values; content edits resealed
/// may decode to other values but the frame must then be canonical and the slot consistent.
/// Never a panic.
///
/// Input: dtype (bf16/fp16/fp32), flags (bits 0-1 cache mode, 2-3 frame choice, 4-5 frame
/// kind: a delta frame, a FILL to a cold slot, a FILL to a warm slot, a second delta frame
/// against the contexts of the first), len (u16), the previous values, one change byte per
/// element, then up to 8 mutations of 4 bytes (op, position u16, value). Returns the mode of
/// the valid frame (for the replay tests' coverage).
pub fn decode_mutated(data: &[u8]) -> Mode {
    let mut inp = Input(data);
    let dtype = [DType::BF16, DType::F16, DType::F32][inp.u8() as usize % 3];
    let flags = inp.u8();
    let mode = MODES[(flags & 3) as usize % 3];
    let choice = CHOICES[(flags >> 2) as usize % 4];
    let kind = (flags >> 4) % 4;
    let len = inp.u16() as usize % 2049;
    let size = dtype.size();
    let x0 = inp.bytes(len * size);
    let changes = inp.bytes(len);
    let exp_shift: u32 = match dtype {
        DType::BF16 => 7,
        DType::F16 => 10,
        _ => 23,
    };
    let change = |x: &[u8], rot: usize| -> Vec<u8> {
        let mut y = x.to_vec();
        for i in 0..len {
            let c = changes[(i + rot) % len];
            let mut w = [0u8; 4];
            w[..size].copy_from_slice(&x[i * size..(i + 1) * size]);
            let mut v = u32::from_le_bytes(w);
            if c & 1 != 0 {
                v ^= 1 << ((c as u32 >> 4) % exp_shift); // mantissa
            }
            if c & 2 != 0 {
                v ^= 1 << (exp_shift + (c as u32 >> 5) % 3); // exponent
            }
            if c & 4 != 0 {
                v ^= 1 << (8 * size - 1); // sign
            }
            if c & 8 != 0 {
                // A move of a few ulps in the order of the values (Delta frames' unit).
                let w = 8 * size as u32;
                let k = (delta_spec::key(v, w) as i64 + (c as i64 >> 4) - 8) as u32
                    & delta_spec::mask(w);
                v = delta_spec::unkey(k, w);
            }
            y[i * size..(i + 1) * size].copy_from_slice(&v.to_le_bytes()[..size]);
        }
        y
    };
    let x1 = change(&x0, 0);
    let mode_of = |f: &[u8]| Mode::ALL[f[6] as usize];

    let mut tx = CacheSlot::new(dtype, mode, len);
    tx.set_frame_choice(choice);
    let mut f = Vec::new();
    tx.encode(&x0, &mut f).unwrap();
    let (mut version, mut warm, mut prev) = (tx.version(), true, x0.clone());
    // A second delta frame: the receiver takes the first (and keeps its contexts).
    let mut history = vec![f.clone()];
    let mut ctx = Vec::new();
    let mut expect = x1.clone();
    f.clear();
    match kind {
        0 => {
            tx.encode(&x1, &mut f).unwrap();
        }
        1 => {
            let mut cold = CacheSlot::new(dtype, mode, len);
            cold.encode(&x1, &mut f).unwrap();
            version = 12345;
            warm = false;
            prev = vec![0; x0.len()];
        }
        2 => {
            tx.poison();
            tx.encode(&x1, &mut f).unwrap();
        }
        _ => {
            let first = tx.encode(&x1, &mut f).unwrap();
            history.push(f.clone());
            if first.mode == Mode::Delta {
                ctx = contexts_after(dtype, &x0, &x1);
            }
            let x2 = change(&x1, 1 + len / 2);
            f.clear();
            tx.encode(&x2, &mut f).unwrap();
            version = first.version.wrapping_add(1);
            prev = x1.clone();
            expect = x2;
        }
    }

    let valid = mode_of(&f);
    // Damage.
    let mut g = f.clone();
    // Damage stays "strict" (Err or exact) unless checksums are recomputed over bytes that were
    // changed: then the frame may validly mean other values.
    let mut touched = false;
    let mut content = false;
    let mut resealed = false;
    for _ in 0..inp.u8() % 9 {
        let (op, pos, val) = (inp.u8() % 12, inp.u16() as usize, inp.u8());
        if g.is_empty() {
            break;
        }
        let at = pos % g.len();
        match op {
            0 => {
                g[at] ^= 1 << (val % 8);
                touched = true;
            }
            1 => {
                g[at] = val;
                touched = true;
            }
            2 => {
                g.truncate(at);
                touched = true;
            }
            3 => {
                g.insert(at, val);
                touched = true;
            }
            4 => {
                g.remove(at);
                touched = true;
            }
            5 => g.extend(std::iter::repeat_n(val, 1 + pos % 64)),
            // Header fields, resealed: count, offset, version, format version, dtype/mode/flags,
            // section lengths.
            6..=8 if g.len() >= frame::HEADER_LEN => {
                let field = [8usize, 16, 24, 4, 5, 6, 7, 32, 36, 40, 44][pos % 11];
                g[field] ^= val | 1;
                resealed = true;
            }
            // Content, resealed.
            9..=11 if g.len() > frame::HEADER_LEN => {
                let at = frame::HEADER_LEN + pos % (g.len() - frame::HEADER_LEN);
                g[at] ^= val | 1;
                resealed = true;
                content = true;
            }
            _ => {}
        }
    }
    if resealed {
        reseal(&mut g);
    }
    let strict = !(resealed && (touched || content));

    let mut rx = if kind == 3 {
        let mut rx = CacheSlot::new(dtype, mode, len);
        rx.set_frame_choice(choice);
        let mut o = vec![0u8; x0.len()];
        for h in &history {
            rx.decode(h, &mut o).expect("history frame");
        }
        rx
    } else {
        slot_at(dtype, mode, choice, len, version, warm, &prev)
    };
    let mut out = vec![0u8; len * size];
    match rx.decode(&g, &mut out) {
        Ok(info) => {
            if strict {
                assert!(out == expect, "damaged frame accepted with other values");
            }
            let before = Before {
                dtype,
                mode,
                choice,
                len,
                prev: &prev,
                ctx: &ctx,
            };
            if warm {
                assert_canonical(&before, &g, &info, &out);
            }
            let next = x0;
            assert_consistent(&before, info.mode, &mut rx, &out, &next);
        }
        Err(_) => assert!(!rx.is_warm()),
    }
    valid
}

/// Target `rans_roundtrip`: rANS and the coded masks: any byte string round-trips through rANS
/// with its own frequency table; any mask round-trips through every coding; and arbitrary bytes
/// decoded as a rANS block or a coded mask never panic (and, when accepted, re-encode in that
/// coding to the same bytes where the coding is deterministic).
pub fn rans_roundtrip(data: &[u8]) {
    use ciera::codec::bitmask::MaskCoding;
    let mut inp = Input(data);
    let sel = inp.u8();
    let body = inp.rest();
    match sel % 4 {
        0 => {
            if body.is_empty() {
                return;
            }
            let table = rans::FreqTable::from_histogram(&rans::histogram(body));
            let mut enc = Vec::new();
            rans::encode(body, &table, &mut enc);
            let mut dec = vec![0u8; body.len()];
            rans::decode(&enc, &mut dec).expect("rANS round trip");
            assert_eq!(dec, body);
            // One symbol fewer or more must not decode: every byte is consumed exactly.
            let mut short = vec![0u8; body.len() + 1];
            let _ = rans::decode(&enc, &mut short);
        }
        3 => {
            // The segmented block, the body repeated up to past eight segments (the vector
            // decoder's batch) so that the fuzzer's bytes reach every segment layout.
            if body.is_empty() {
                return;
            }
            let n = 1 + (sel >> 2) as usize * 1291 % (9 * rans_seg::SEG_BYTES);
            let data: Vec<u8> = body.iter().copied().cycle().take(n).collect();
            let table = rans::FreqTable::from_histogram(&rans::histogram(&data));
            let mut enc = Vec::new();
            rans_seg::encode(&data, &table, &mut enc);
            let mut dec = vec![0u8; n];
            rans_seg::decode(&enc, &mut dec).expect("segmented rANS round trip");
            assert_eq!(dec, data);
            let mut other = vec![0u8; n + 1];
            let _ = rans_seg::decode(&enc, &mut other);
            // The body itself as a block: no panic, and an accepted one is canonical.
            let mut out = vec![0u8; n];
            if rans_seg::decode(body, &mut out).is_ok() {
                let hist = rans_table(body).expect("table of an accepted block");
                let mut enc = Vec::new();
                rans_seg::encode(&out, &rans::FreqTable::from_histogram(&hist), &mut enc);
                assert_eq!(enc, body, "accepted segmented rANS block is not canonical");
            }
        }
        1 => {
            // The body as a mask of m bits (bits past m cleared).
            let m = (body.len() * 8).saturating_sub((sel >> 2) as usize % 8);
            let mut words = vec![0u64; m.div_ceil(64)];
            for i in 0..m {
                if body[i / 8] >> (i % 8) & 1 == 1 {
                    words[i / 64] |= 1 << (i % 64);
                }
            }
            let ones: usize = words.iter().map(|w| w.count_ones() as usize).sum();
            let codings: &[MaskCoding] = if ones == 0 {
                &[MaskCoding::Zero]
            } else {
                &[
                    MaskCoding::Flat,
                    MaskCoding::Hier,
                    MaskCoding::Rans,
                    MaskCoding::RansSeg,
                ]
            };
            for &c in codings {
                let mut enc = Vec::new();
                bitmask::encode(&words, m, c, &mut enc);
                let mut back = Vec::new();
                let n =
                    bitmask::decode(&enc, m, &mut back).unwrap_or_else(|e| panic!("{c:?}: {e}"));
                assert_eq!((n, &back), (ones, &words), "{c:?}");
            }
            let p = bitmask::plan(&words, m, Some(0));
            assert_eq!(p.ones, ones);
        }
        _ => {
            let n = (sel >> 2) as usize * 7 + body.len() % 13;
            let mut out = vec![0u8; n];
            // As a coded mask of m bits; an accepted Zero/Flat/Hier mask re-encodes identically.
            let m = n * 3;
            let mut words = Vec::new();
            if let Ok(ones) = bitmask::decode(body, m, &mut words) {
                assert_eq!(
                    ones,
                    words.iter().map(|w| w.count_ones() as usize).sum::<usize>()
                );
                assert_mask_canonical(body, m, &words);
            }
            // An accepted rANS block re-encodes to itself with its own table.
            if rans::decode(body, &mut out).is_ok() {
                let hist = rans_table(body).expect("table of an accepted block");
                let mut enc = Vec::new();
                rans::encode(&out, &rans::FreqTable::from_histogram(&hist), &mut enc);
                assert_eq!(enc, body, "accepted rANS block is not canonical");
            }
        }
    }
}

/// Replays without libFuzzer (`cargo test` here): every file under `corpus/<target>/` and
/// `artifacts/<target>/` where a fuzzing run left them, then generated inputs that reach the
/// deep decoders (Delta slots and frames of every kind, damaged).
#[cfg(test)]
mod replay {
    use super::*;

    type Target = fn(&[u8]);
    const TARGETS: [(&str, Target); 3] = [
        ("decode_arbitrary", decode_arbitrary),
        ("decode_mutated", |d| {
            decode_mutated(d);
        }),
        ("rans_roundtrip", rans_roundtrip),
    ];

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
    }

    #[test]
    fn stored_inputs() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut n = 0;
        for (name, run) in TARGETS {
            for dir in ["corpus", "artifacts"] {
                let Ok(rd) = std::fs::read_dir(root.join(dir).join(name)) else {
                    continue;
                };
                for e in rd.flatten() {
                    if let Ok(data) = std::fs::read(e.path()) {
                        run(&data);
                        n += 1;
                    }
                }
            }
        }
        eprintln!("{n} stored inputs replayed");
    }

    /// `decode_mutated` inputs: every dtype, cache mode, frame choice and kind, with damage.
    #[test]
    fn generated_mutations() {
        let mut rng = Rng(0xF022);
        let mut modes = [0usize; 4];
        for case in 0..900u64 {
            let mut d = vec![case as u8 % 3, (case / 3) as u8];
            let len: u16 = [0, 1, 9, 300, 1000, 2048, 2100, 3000, 700][case as usize % 9];
            d.extend_from_slice(&len.to_le_bytes());
            // Values: weight-like (moderate exponents), then change bytes, then damage.
            let size = [2usize, 2, 4][case as usize % 3];
            for i in 0..len as usize {
                let v: u32 =
                    0x3C00_0000 | (rng.next() as u32 & 0x03FF_FFFF) | ((i % 3 == 0) as u32) << 31;
                d.extend_from_slice(&(v >> (32 - 8 * size as u32)).to_le_bytes()[..size]);
            }
            d.extend(rng.bytes(len as usize).iter().map(|&c| {
                if case % 2 == 0 {
                    c & 0xF8 | 8
                } else {
                    c
                }
            }));
            d.push((rng.next() % 9) as u8);
            d.extend(rng.bytes(32));
            modes[decode_mutated(&d) as usize] += 1;
        }
        assert!(
            modes.iter().all(|&m| m >= 20),
            "valid frames by mode: {modes:?}"
        );
    }

    /// `decode_arbitrary` inputs: random slots and frames, with built headers and resealing.
    #[test]
    fn generated_arbitrary() {
        let mut rng = Rng(0xA4B1);
        for case in 0..3000u64 {
            let n = (rng.next() % 400) as usize;
            let mut d = rng.bytes(n);
            if d.len() > 4 {
                d[1] |= [0u8, 4, 8, 12][case as usize % 4];
                d[2] %= 64;
                d[3] = 0;
            }
            decode_arbitrary(&d);
        }
        for case in 0..1500u64 {
            let n = (rng.next() % 300) as usize;
            let mut d = vec![case as u8];
            d.extend(rng.bytes(n));
            rans_roundtrip(&d);
        }
    }
}
