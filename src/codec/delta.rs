//! Delta frames: each value's move in units in the last place (ulps), entropy-coded with the
//! element's previous move as context. Layout in docs/WIRE.md ("Delta").
//!
//! Per element: `key(u)` maps the value's bits to an integer that is monotone in the value
//! (sign set: `!u`, else `u | sign bit`), `d = key(new) - key(old)` modulo 2^W (W = 16 or 32)
//! is the move in ulps, exact and invertible for every bit pattern (NaN payloads, infinities,
//! -0, subnormals). `z = zigzag(d)` is split into a *token* (the value itself below
//! `DIRECT` (32), else its bit length and next bit) and *extra bits* sent verbatim. Tokens are
//! coded by rANS with one static frequency table per context; the context is the element's
//! previous move clipped to -8..8, which the slot keeps per element (one byte) and both sides
//! update alike after every frame. A chunk is cut in groups of elements; in a group, elements
//! are dealt round-robin to `lanes` interleaved coder states that share one word stream, taken
//! in lane order row by row. Groups share nothing (a GPU decodes one per warp, a thread per
//! lane; the CPU decodes eight lanes per AVX2 vector, `delta_simd.rs`), and nothing is
//! adaptive within a frame.

use super::error::{CodecError, Result};
use super::float::Layout;
use std::ops::Range;

/// Probability precision of the token tables.
pub const PROB_BITS: u32 = 12;
pub(super) const PROB_SCALE: u32 = 1 << PROB_BITS;
/// Lower bound of a lane state; states live in [RANS_L, RANS_L << 16) and renormalise by
/// 16-bit words (at most one per step: no data-dependent loop in a decoder).
pub(super) const RANS_L: u32 = 1 << 15;
/// Contexts: the previous move clipped to -CLIP..CLIP, stored as move + CLIP.
pub const CLIP: i32 = 8;
pub const NCTX: usize = 2 * CLIP as usize + 1;
/// The context byte of "no previous move" (a filled slot, or after an Exp or Hybrid frame):
/// that of a move of 0.
pub const CONTEXT_NONE: u8 = CLIP as u8;
/// zigzag values below 2^DIRECT_BITS are tokens themselves.
pub const DIRECT_BITS: u32 = 5;
const DIRECT: u32 = 1 << DIRECT_BITS;
/// Interleaved coder states (lanes) per group the encoder uses: a GPU warp.
pub const LANES: usize = 32;
/// Most lanes a frame may declare.
pub const MAX_LANES: usize = 64;
/// Elements per group the encoder uses (64 KiB of bf16).
pub const GROUP_ELEMS: usize = 32768;
/// Most elements a group may declare (its stream length then fits 32 bits: at most three words
/// per element, plus the states).
pub const MAX_GROUP_ELEMS: usize = 1 << 24;
/// Extra bits travel in steps of at most this many bits.
const EXTRA_STEP: u32 = 15;
/// Pass one counts the (context, token) pairs of every element of a chunk below
/// [`SAMPLE_MIN`] elements; of a larger one (`sampled`), only those of the tiles of
/// `SAMPLE_TILE` elements whose index is a multiple of [`SAMPLE_EVERY`] (tiles 0, 8, 16, ...),
/// and the tables give every token of every context a frequency of at least 1, so that every
/// element of the other tiles still has a code. Pass one then reads an eighth of the values and
/// the context bytes, where it read all of them; the exact change counts come from pass two,
/// which reads every value anyway.
///
/// Measured (`cargo bench --bench codec`, olmoe-mini-s0 w1, one core with AVX-512): bf16
/// encode 1.00-1.10 -> 1.57-1.81 GB/s on 64 MiB (1.07-1.16 -> 1.66-1.81 on 1 MiB chunks) for
/// 0.5-2.8% more frame bytes (the most at the end of the schedule, where the frames are
/// smallest), fp32 encode 1.2-1.3 -> 1.7-1.8 GB/s (1 MiB: 1.6 -> 1.9) for under 0.2%. On the
/// traces the other tiles hold all 17 contexts (but on a first frame after a fill, all 8: 16
/// tables of 55-90 bytes more) and their largest move has the largest token, so bounding either
/// by a survey of those tiles saved nothing measurable and read all of their bytes again
/// (measured: 8% of encode on 64 MiB). The tables are the encoder's choice: decoders read
/// whatever they say.
pub const SAMPLE_TILE: usize = 4096;
/// One tile in this many is counted in a sampled chunk.
pub const SAMPLE_EVERY: usize = 8;
/// Chunks of at least this many elements are sampled (32 tiles: four counted).
pub const SAMPLE_MIN: usize = 32 * SAMPLE_TILE;

/// Whether pass one samples a chunk of `n` elements (see [`SAMPLE_TILE`]).
pub fn sampled(n: usize) -> bool {
    n >= SAMPLE_MIN
}

/// The element ranges of a chunk of `n` elements pass one counts (true) or skips (false), in
/// order, each as long as it can be.
pub(super) fn count_ranges(n: usize) -> impl Iterator<Item = (std::ops::Range<usize>, bool)> {
    let tile = if sampled(n) { SAMPLE_TILE } else { n.max(1) };
    let mut at = 0;
    std::iter::from_fn(move || {
        if at >= n {
            return None;
        }
        let counted = !sampled(n) || (at / SAMPLE_TILE).is_multiple_of(SAMPLE_EVERY);
        let len = if counted {
            tile
        } else {
            (SAMPLE_EVERY - 1) * SAMPLE_TILE
        };
        let r = at..(at + len).min(n);
        at = r.end;
        Some((r, counted))
    })
}

/// Tokens of a W-bit type: the direct ones, then two per bit length DIRECT_BITS..W-1.
pub const fn tokens(width: u32) -> usize {
    (DIRECT + (width - DIRECT_BITS) * 2) as usize
}
const MAX_TOKENS: usize = tokens(32);
/// Entries of one histogram of pass one: above every symbol index, and not a multiple of
/// 1024 (4 KiB): the four histograms' same bins then differ in their low address bits, else
/// a store-to-load check sees them alike and the four chains of increments wait on each
/// other (measured: pass one 2.8x slower with a stride of 2048).
pub(super) const HIST: usize = 2048 + 16;
const _: () = assert!(NCTX * MAX_TOKENS <= HIST);

/// Bits of a type's ordered key.
pub fn width<L: Layout>() -> u32 {
    (L::BYTES * 8) as u32
}

#[inline(always)]
fn mask(w: u32) -> u32 {
    if w == 32 {
        u32::MAX
    } else {
        (1 << w) - 1
    }
}

/// The total-order key of a W-bit value: monotone in the value, -0 just below +0.
#[inline(always)]
pub fn key(u: u32, w: u32) -> u32 {
    // Sign set: !u (u ^ mask), else u | sign (u ^ sign); without a branch (signs are random).
    let sign = 1u32 << (w - 1);
    let neg = (((u << (32 - w)) as i32) >> 31) as u32;
    u ^ (sign | (neg & (mask(w) ^ sign)))
}

#[inline(always)]
pub fn unkey(k: u32, w: u32) -> u32 {
    let sign = 1u32 << (w - 1);
    if k & sign != 0 {
        k & !sign
    } else {
        !k & mask(w)
    }
}

/// The move from `old` to `new` in ulps, as a W-bit two's complement number.
#[inline(always)]
pub fn ulp_move(old: u32, new: u32, w: u32) -> u32 {
    key(new, w).wrapping_sub(key(old, w)) & mask(w)
}

/// A W-bit move as a signed number.
#[inline(always)]
fn signed(d: u32, w: u32) -> i32 {
    ((d << (32 - w)) as i32) >> (32 - w)
}

/// The context byte of a move: the move as a signed number clipped to -CLIP..CLIP, plus CLIP.
#[inline(always)]
pub fn context_of(d: u32, w: u32) -> u8 {
    (signed(d, w).clamp(-CLIP, CLIP) + CLIP) as u8
}

#[inline(always)]
fn zigzag(d: u32, w: u32) -> u32 {
    let s = signed(d, w);
    ((s << 1) ^ (s >> 31)) as u32 & mask(w)
}

#[inline(always)]
fn unzigzag(z: u32, w: u32) -> u32 {
    ((z >> 1) ^ (0u32.wrapping_sub(z & 1))) & mask(w)
}

/// Token of a zigzag value, and how many extra bits follow it. Without a branch: whether a
/// move is direct is as good as random (with the branch-free refill below, the plain fp32
/// decoder went from 0.20 to 0.23 GB/s).
#[inline(always)]
fn tokenize(z: u32) -> (u8, u32) {
    let b = 31 - (z | 1).leading_zeros();
    let big = z >= DIRECT;
    // For z >= DIRECT, b >= DIRECT_BITS; below, the arithmetic is discarded (kept in range).
    let bb = b.max(DIRECT_BITS);
    let t = DIRECT + (bb - DIRECT_BITS) * 2 + ((z >> (bb - 1)) & 1);
    if big {
        (t as u8, bb - 1)
    } else {
        (z as u8, 0)
    }
}

/// The high part of a zigzag value from its token, and its extra bit count (without a branch,
/// as [`tokenize`]).
#[inline(always)]
fn detokenize(t: u32) -> (u32, u32) {
    let big = t >= DIRECT;
    let b = (t.max(DIRECT) - DIRECT) / 2 + DIRECT_BITS;
    let hi = (2 | (t & 1)) << (b - 1);
    if big {
        (hi, b - 1)
    } else {
        (t, 0)
    }
}

/// The coding temporaries of Delta frames.
#[derive(Default)]
pub(super) struct DeltaScratch {
    /// The symbol table as the vector encoder gathers it.
    enc: super::delta_simd::EncTable,
    /// Four histograms of pass one.
    hist: Vec<u32>,
    /// Decoder lookup: per context PROB_SCALE entries.
    dec: Vec<u32>,
    /// The lane section and 64 zero bytes (the vector decoders read 8 (AVX2) or 32 (AVX-512)
    /// words at a time).
    pad: Vec<u8>,
    /// The words of the group being encoded.
    words: Vec<u16>,
}

/// What pass one of the encoder learned about a chunk.
pub(super) struct Scan {
    pub hist: [[u32; MAX_TOKENS]; NCTX],
    pub extra_bits: u64,
    /// Values that changed at all, and whose cached field (exponent) changed, among the
    /// counted elements (every element unless the chunk is sampled: then estimates, scaled to
    /// the chunk; `write` returns the exact counts).
    pub changed: usize,
    pub exp_changed: usize,
    /// Elements whose pairs `hist` and `extra_bits` count (all but a sampled chunk's).
    pub counted: usize,
}

/// The encoder's index of (context byte, token): `min(c, 16) * tokens(w) + t`.
#[inline(always)]
pub(super) fn sym_index(c: u8, t: u8, w: u32) -> u16 {
    ((c as usize).min(NCTX - 1) * tokens(w) + t as usize) as u16
}

/// The zigzag move, token and extra bit count of a value moving from `a` to `b`.
#[inline(always)]
pub(super) fn token_of(a: u32, b: u32, w: u32) -> (u32, u8, u32) {
    let z = zigzag(ulp_move(a, b, w), w);
    let (t, e) = tokenize(z);
    (z, t, e)
}

/// Pass one: the histograms of (context, token) and the counts. Nothing per element is kept:
/// the writer (pass two) computes the moves again from the same values and contexts, which
/// costs less than storing and reloading them.
pub(super) fn scan<L: Layout>(
    input: &[u8],
    old: &[u8],
    ctx: &[u8],
    s: &mut DeltaScratch,
) -> Box<Scan> {
    let w = width::<L>();
    let mut sc = Box::new(Scan {
        hist: [[0; MAX_TOKENS]; NCTX],
        extra_bits: 0,
        changed: 0,
        exp_changed: 0,
        counted: 0,
    });
    // Four histograms in turn, so that runs of one (context, token) do not wait on each other;
    // indexed by the symbol index (below HIST).
    s.hist.clear();
    s.hist.resize(4 * HIST, 0);
    let counts = match super::delta_simd::scan_vector::<L>(input, old, ctx, &mut s.hist) {
        Some(c) => c,
        None => {
            let mut c = super::delta_simd::ScanCounts::default();
            for (r, _) in count_ranges(ctx.len()).filter(|(_, counted)| *counted) {
                scan_plain::<L>(input, old, ctx, r, &mut s.hist, &mut c);
            }
            c
        }
    };
    let (h0, rest) = s.hist.split_at(HIST);
    let (h1, rest) = rest.split_at(HIST);
    let (h2, h3) = rest.split_at(HIST);
    let ntok = tokens(w);
    for (c, acc) in sc.hist.iter_mut().enumerate() {
        for (t, a) in acc.iter_mut().enumerate().take(ntok) {
            let k = c * ntok + t;
            *a = h0[k] + h1[k] + h2[k] + h3[k];
        }
    }
    let n = ctx.len();
    let scale = |k: usize| {
        if counts.counted == n || counts.counted == 0 {
            k
        } else {
            ((k as u128 * n as u128 + counts.counted as u128 / 2) / counts.counted as u128) as usize
        }
    };
    sc.extra_bits = counts.extra_bits;
    sc.changed = scale(counts.changed);
    sc.exp_changed = scale(counts.exp_changed);
    sc.counted = counts.counted;
    sc
}

/// Pass one, plainly, over the counted elements `r`: their pairs into the four histograms
/// `hist` (element i into histogram i % 4) and their changes.
pub(super) fn scan_plain<L: Layout>(
    input: &[u8],
    old: &[u8],
    ctx: &[u8],
    r: std::ops::Range<usize>,
    hist: &mut [u32],
    c: &mut super::delta_simd::ScanCounts,
) {
    let w = width::<L>();
    for i in r {
        let (a, b) = (L::load(old, i), L::load(input, i));
        let (_, t, e) = token_of(a, b, w);
        c.changed += (a != b) as usize;
        c.exp_changed += (L::exp(a) != L::exp(b)) as usize;
        c.extra_bits += e as u64;
        c.counted += 1;
        hist[(i & 3) * HIST + sym_index(ctx[i], t, w) as usize] += 1;
    }
}

/// Lanes per group and elements per group the encoder uses for a chunk of `n` elements: fewer
/// lanes for small chunks (each costs its 4-byte state).
pub fn geometry(n: usize) -> (usize, usize) {
    ((n / 512).clamp(1, LANES), GROUP_ELEMS)
}

/// Bytes of lane states and group lengths of a chunk of `n` elements.
fn lane_overhead(n: usize) -> usize {
    let (lanes, group) = geometry(n);
    n.div_ceil(group) * (4 * lanes + 4)
}

/// Scale a histogram to frequencies summing to PROB_SCALE, every present token >= 1; with
/// `all` (a sampled chunk, `SAMPLE_TILE`) every token is present whatever its count.
fn normalize(hist: &[u32], all: bool, freq: &mut [u32]) {
    let total: u64 = hist.iter().map(|&h| h as u64).sum();
    let present = |t: usize| hist[t] > 0 || all;
    let mut sum: i64 = 0;
    for (t, (f, &h)) in freq.iter_mut().zip(hist).enumerate() {
        *f = if !present(t) {
            0
        } else if h == 0 {
            1
        } else {
            (((h as u64) * PROB_SCALE as u64 + total / 2) / total).max(1) as u32
        };
        sum += *f as i64;
    }
    // Spread the rounding error over the largest tokens, keeping each present one >= 1.
    let mut diff = PROB_SCALE as i64 - sum;
    let mut order: Vec<usize> = (0..hist.len()).filter(|&t| present(t)).collect();
    order.sort_by_key(|&t| std::cmp::Reverse(freq[t]));
    while diff != 0 {
        for &t in &order {
            if diff == 0 {
                break;
            }
            if diff > 0 {
                freq[t] += 1;
                diff -= 1;
            } else if freq[t] > 1 {
                freq[t] -= 1;
                diff += 1;
            }
        }
    }
}

/// Tokens a context's table describes (`m`), for its counts `h` in a chunk of `n` elements:
/// one past the highest counted token, or every token where the chunk is sampled.
fn table_tokens(h: &[u32], n: usize) -> usize {
    if sampled(n) {
        h.len()
    } else {
        h.iter().rposition(|&x| x > 0).map_or(0, |p| p + 1)
    }
}

/// Estimated frame payload bytes (sections, not the header) of a Delta frame for a scan: the
/// tokens at the entropy of their context's counts, the extra bits, the tables and the lanes'
/// states. Integer arithmetic (Q16 logarithms, as `bitmask::iid_bytes`), so that a GPU encoder
/// (cuda/codec.cu, `de_context_cost` and `de_pick_frame`) makes the same choice of frame as
/// this one.
pub(super) fn estimate(sc: &Scan, n: usize, w: u32) -> usize {
    use super::rans::log2_q16;
    let ntok = tokens(w);
    // Bits in Q16.
    let mut bits: u64 = sc.extra_bits << 16;
    let mut table = 2usize;
    for h in &sc.hist {
        let h = &h[..ntok];
        let total: u64 = h.iter().map(|&x| x as u64).sum();
        // Its m byte, then a byte per token described (two for the frequent ones, below).
        table += 1 + table_tokens(h, n);
        if total == 0 {
            continue;
        }
        table += h.iter().filter(|&&x| x as u64 * 32 > total).count();
        let lt = log2_q16(total);
        for &x in h.iter().filter(|&&x| x > 0) {
            bits += x as u64 * lt.saturating_sub(log2_q16(x as u64));
        }
    }
    // A sampled chunk's counts stand for the whole chunk (floor of bits * n / counted, without
    // overflow: counted and n are element counts).
    let (n64, c) = (n as u64, sc.counted as u64);
    if c > 0 && c < n64 {
        bits = bits / c * n64 + bits % c * n64 / c;
    }
    (bits >> 19) as usize + table + 5 + lane_overhead(n)
}

/// An encoder's view of one (context, token): the reciprocal form of `x / freq` that the
/// mask coder uses too, with the 16-bit-word renormalisation limit.
type EncSym = super::rans::EncSym;

fn enc_sym(cum: u32, freq: u32) -> EncSym {
    EncSym::with_limit(freq, cum, (RANS_L >> PROB_BITS) << 16)
}

const _: () = assert!(PROB_BITS == super::rans::PROB_BITS);

/// The words of a group, in encoding order (reversed when written out). Sized up front (at
/// most three words per element, plus slack for 8-word vector stores), so that a step writes
/// its word without a branch and only advances where it emitted.
pub(super) struct Words<'a> {
    pub(super) buf: &'a mut [u16],
    pub(super) pos: usize,
}

impl Words<'_> {
    #[inline(always)]
    fn emit_if(&mut self, x: &mut u32, over: bool) {
        self.buf[self.pos] = *x as u16;
        self.pos += over as usize;
        *x = if over { *x >> 16 } else { *x };
    }

    #[inline(always)]
    fn put(&mut self, x: &mut u32, s: &EncSym) {
        self.emit_if(x, *x >= s.x_max);
        *x = super::rans::enc_step(*x, s);
    }

    /// `bits` (<= EXTRA_STEP) raw bits `v`.
    #[inline(always)]
    fn put_bits(&mut self, x: &mut u32, v: u32, bits: u32) {
        self.emit_if(x, *x >= (RANS_L << 16) >> bits);
        *x = (*x << bits) | v;
    }
}

/// Write a Delta frame's sections for the chunk scanned into `sc` (values `input` against the
/// cached `state` and contexts `ctx`); returns the lengths of s0 and s1 and the exact change
/// counts (values, and cached fields). Updates the contexts and the values (`state` ends equal
/// to `input`).
#[allow(clippy::too_many_arguments)]
pub(super) fn write<L: Layout>(
    sc: &Scan,
    input: &[u8],
    state: &mut [u8],
    ctx: &mut [u8],
    s: &mut DeltaScratch,
    out: &mut Vec<u8>,
    threads: usize,
) -> (usize, usize, usize, usize) {
    let w = width::<L>();
    let ntok = tokens(w);
    let n = ctx.len();
    let (lanes, group) = geometry(n);
    // Tables.
    let mut model = Vec::with_capacity(5 + NCTX * 40 + 4 * n.div_ceil(group));
    model.push(lanes as u8);
    model.extend_from_slice(&(group as u32).to_le_bytes());
    let mut syms = vec![EncSym::default(); NCTX * ntok];
    let mut freq = [0u32; MAX_TOKENS];
    for c in 0..NCTX {
        let h = &sc.hist[c][..ntok];
        let m = table_tokens(h, n);
        model.push(m as u8);
        if m == 0 {
            continue;
        }
        normalize(&h[..m], sampled(n), &mut freq[..m]);
        let mut cum = 0;
        for t in 0..m {
            super::rans::write_varint(&mut model, freq[t]);
            if freq[t] > 0 {
                syms[c * ntok + t] = enc_sym(cum, freq[t]);
            }
            cum += freq[t];
        }
    }
    let vector = lanes == 32 && super::delta_simd::applies::<L>();
    if vector {
        let e = &mut s.enc;
        e.packed.clear();
        for y in &syms {
            // Absent tokens (freq 0) are never gathered: any value does.
            e.packed.push(y.cum | (y.cmpl_freq & 0xfff) << 12);
        }
    }
    let k = Coder {
        syms: &syms,
        table: &s.enc,
        ntok,
        lanes,
        group,
        n,
        w,
        vector,
    };
    let s0_start = out.len();
    let mut rc = super::delta_simd::RowCounts::default();
    match runs(n, group, threads) {
        None => encode_groups::<L>(
            &k,
            input,
            state,
            ctx,
            0..n.div_ceil(group),
            &mut s.words,
            out,
            &mut model,
            &mut rc,
        ),
        Some(parts) => encode_parts::<L>(
            &k,
            &parts,
            input,
            state,
            ctx,
            &mut s.words,
            out,
            &mut model,
            &mut rc,
        ),
    }
    let s0 = out.len() - s0_start;
    out.extend_from_slice(&model);
    (s0, model.len(), rc.changed, rc.exp_changed)
}

/// What every group's encoder reads: the symbols (and the vector coders' packed table), the
/// geometry.
struct Coder<'a> {
    syms: &'a [EncSym],
    table: &'a super::delta_simd::EncTable,
    ntok: usize,
    lanes: usize,
    group: usize,
    /// Elements in the chunk.
    n: usize,
    w: u32,
    /// A vector row coder applies.
    vector: bool,
}

/// Encode the chunk's `parts` (see [`runs`]) on as many threads (this one and the codec
/// pool's): the first into `out` and `model`, the others into buffers of their own, appended
/// in group order after: the bytes one thread writes. `words` is the first part's scratch.
#[allow(clippy::too_many_arguments)]
fn encode_parts<L: Layout>(
    k: &Coder<'_>,
    parts: &[(Range<usize>, usize)],
    mut input: &[u8],
    state: &mut [u8],
    ctx: &mut [u8],
    words: &mut Vec<u16>,
    out: &mut Vec<u8>,
    model: &mut Vec<u8>,
    rc: &mut super::delta_simd::RowCounts,
) {
    type Part = (Vec<u16>, Vec<u8>, Vec<u8>, super::delta_simd::RowCounts);
    let sizes = || parts.iter().map(|(_, elems)| *elems);
    let states = cut(state, sizes().map(|e| e * L::BYTES));
    let ctxs = cut(ctx, sizes());
    let jobs: Vec<_> = parts
        .iter()
        .zip(states.into_iter().zip(ctxs))
        .map(|((gs, elems), (st, c))| {
            let (i, rest) = input.split_at(elems * L::BYTES);
            input = rest;
            (gs.clone(), i, st, c)
        })
        .collect();
    // The first part writes into the frame itself; the others into buffers of their own,
    // each room for its raw bytes and lane states (a Delta frame longer than that goes as a
    // FILL anyway), appended after.
    let mut done: Vec<Part> = jobs[1..]
        .iter()
        .map(|(gs, i, ..)| {
            let lanes = Vec::with_capacity(i.len() + 4 * k.lanes * gs.len() + 64);
            (Vec::new(), lanes, Vec::new(), Default::default())
        })
        .collect();
    let mut jobs = jobs.into_iter();
    let (gs0, i0, st0, c0) = jobs.next().expect("at least two parts");
    super::pool::count_split();
    super::pool::coders().in_place_scope(|scope| {
        for ((gs, i, st, c), (words, lanes, lens, rc)) in jobs.zip(done.iter_mut()) {
            scope.spawn(move |_| encode_groups::<L>(k, i, st, c, gs, words, lanes, lens, rc));
        }
        encode_groups::<L>(k, i0, st0, c0, gs0, words, out, model, rc);
    });
    for (_, lanes, lens, r) in done {
        out.extend_from_slice(&lanes);
        model.extend_from_slice(&lens);
        rc.changed += r.changed;
        rc.exp_changed += r.exp_changed;
    }
}

/// Encode groups `gs` of the chunk from `input` against `state` and `ctx` (which hold exactly
/// those groups' elements, and take the new values and contexts), each coded backwards (rANS)
/// into one stream shared by its lanes: the exact reverse of the decoder's order (rows; in a
/// row the token steps of every lane, then their extra bits; lanes in order). Appends each
/// group's final lane states and words to `lanes` and its byte length to `lens`; `words` is
/// scratch.
#[allow(clippy::too_many_arguments)]
fn encode_groups<L: Layout>(
    k: &Coder<'_>,
    input: &[u8],
    state: &mut [u8],
    ctx: &mut [u8],
    gs: Range<usize>,
    words_buf: &mut Vec<u16>,
    lanes_out: &mut Vec<u8>,
    lens: &mut Vec<u8>,
    rc: &mut super::delta_simd::RowCounts,
) {
    let (lanes, group, w) = (k.lanes, k.group, k.w);
    let syms = k.syms;
    let two_steps = w > EXTRA_STEP + DIRECT_BITS;
    // The row of `m` elements from `first`: their moves from the cached values and contexts
    // (which it then updates), coded into the lane states.
    let row = |first: usize,
               m: usize,
               x: &mut [u32],
               words: &mut Words<'_>,
               state: &mut [u8],
               ctx: &mut [u8],
               rc: &mut super::delta_simd::RowCounts| {
        let mut zs = [0u32; MAX_LANES];
        let mut ks = [0u16; MAX_LANES];
        for l in 0..m {
            let i = first + l;
            let (a, b) = (L::load(state, i), L::load(input, i));
            rc.changed += (a != b) as usize;
            rc.exp_changed += (L::exp(a) != L::exp(b)) as usize;
            let (z, t, _) = token_of(a, b, w);
            zs[l] = z;
            ks[l] = sym_index(ctx[i], t, w);
            ctx[i] = context_of(ulp_move(a, b, w), w);
            L::store(state, i, b);
        }
        if two_steps {
            for l in (0..m).rev() {
                let zi = zs[l];
                let hi = tokenize(zi).1.saturating_sub(EXTRA_STEP);
                words.put_bits(&mut x[l], (zi >> EXTRA_STEP) & mask(hi), hi);
            }
        }
        for l in (0..m).rev() {
            let zi = zs[l];
            let lo = tokenize(zi).1.min(EXTRA_STEP);
            words.put_bits(&mut x[l], zi & mask(lo), lo);
        }
        for l in (0..m).rev() {
            words.put(&mut x[l], &syms[ks[l] as usize]);
        }
    };
    // Element 0 of these spans.
    let first = gs.start * group;
    let mut x = vec![RANS_L; lanes];
    for g in gs {
        let base = g * group - first;
        let cnt = group.min(k.n - g * group);
        words_buf.resize(3 * cnt + 32, 0);
        let mut words = Words {
            buf: &mut words_buf[..],
            pos: 0,
        };
        x.fill(RANS_L);
        let (rows, rem) = (cnt / lanes, cnt % lanes);
        row(base + rows * lanes, rem, &mut x, &mut words, state, ctx, rc);
        let plain_rows = if k.vector
            && super::delta_simd::encode_rows::<L>(
                k.table, k.ntok, input, state, ctx, &mut x, &mut words, base, rows, rc,
            ) {
            0
        } else {
            rows
        };
        for r in (0..plain_rows).rev() {
            row(base + r * lanes, lanes, &mut x, &mut words, state, ctx, rc);
        }
        for xl in &x {
            lanes_out.extend_from_slice(&xl.to_le_bytes());
        }
        let at = lanes_out.len();
        lanes_out.resize(at + 2 * words.pos, 0);
        for (o, &wd) in lanes_out[at..]
            .chunks_exact_mut(2)
            .zip(words.buf[..words.pos].iter().rev())
        {
            o.copy_from_slice(&wd.to_le_bytes());
        }
        lens.extend_from_slice(&((4 * lanes + 2 * words.pos) as u32).to_le_bytes());
    }
}

/// Decode a Delta frame (`s0` lane streams, `s1` model) against a chunk's values `state` and
/// contexts `ctx`, into `out`; updates both. On error `out`, `state` and `ctx` hold
/// unspecified bytes (the caller poisons the slot). Returns the number of changed values and
/// of values whose cached field (exponent) changed. Up to `threads` threads (this one and the
/// codec pool's, `pool::coders`) decode its groups, each a run of whole groups: the same
/// bytes, counts and errors as one thread.
#[allow(clippy::too_many_arguments)]
pub(super) fn decode<L: Layout>(
    s0: &[u8],
    s1: &[u8],
    state: &mut [u8],
    ctx: &mut [u8],
    out: &mut [u8],
    s: &mut DeltaScratch,
    threads: usize,
) -> Result<(usize, usize)> {
    let w = width::<L>();
    let ntok = tokens(w);
    let n = ctx.len();
    if s1.len() < 5 {
        return Err(CodecError::corrupt(
            "delta tables",
            "shorter than the lane and group sizes",
        ));
    }
    let lanes = s1[0] as usize;
    let group = u32::from_le_bytes([s1[1], s1[2], s1[3], s1[4]]) as usize;
    if lanes == 0 || lanes > MAX_LANES || group == 0 || group > MAX_GROUP_ELEMS {
        return Err(CodecError::corrupt(
            "delta tables",
            format!(
                "{lanes} lanes of groups of {group} elements (1..={MAX_LANES} lanes, \
                 1..={MAX_GROUP_ELEMS} elements)"
            ),
        ));
    }
    let groups = n.div_ceil(group);
    // Tables into the decoder lookup: sym | (slot - cum) << 7 | freq << 19; 0 = no token.
    let mut pos = 5;
    // A present context's table is written whole (its frequencies sum to PROB_SCALE); an
    // absent one is zeroed (entry 0: no token).
    s.dec.resize(NCTX * PROB_SCALE as usize, 0);
    for c in 0..NCTX {
        let m = *s1
            .get(pos)
            .ok_or_else(|| CodecError::corrupt("delta tables", "end before the last context"))?
            as usize;
        pos += 1;
        if m == 0 {
            s.dec[c * PROB_SCALE as usize..(c + 1) * PROB_SCALE as usize].fill(0);
            continue;
        }
        if m > ntok {
            return Err(CodecError::corrupt(
                "delta tables",
                format!(
                    "context {} declares {m} tokens; {} has {ntok}",
                    c as i32 - CLIP,
                    L::DTYPE
                ),
            ));
        }
        let table = &mut s.dec[c * PROB_SCALE as usize..(c + 1) * PROB_SCALE as usize];
        let mut cum = 0u32;
        for t in 0..m {
            let f = super::rans::read_varint(s1, &mut pos, "delta tables")?;
            if f > PROB_SCALE - cum {
                return Err(CodecError::corrupt(
                    "delta tables",
                    format!(
                        "context {}: frequencies exceed {PROB_SCALE}",
                        c as i32 - CLIP
                    ),
                ));
            }
            for (j, e) in table[cum as usize..(cum + f) as usize]
                .iter_mut()
                .enumerate()
            {
                *e = t as u32 | (j as u32) << 7 | f << 19;
            }
            cum += f;
        }
        if cum != PROB_SCALE {
            return Err(CodecError::corrupt(
                "delta tables",
                format!(
                    "context {}: frequencies sum to {cum}, not {PROB_SCALE}",
                    c as i32 - CLIP
                ),
            ));
        }
    }
    if s1.len() != pos + 4 * groups {
        return Err(CodecError::corrupt(
            "delta tables",
            format!(
                "{} bytes after the tables for {groups} group lengths",
                s1.len() - pos.min(s1.len())
            ),
        ));
    }
    let lens = &s1[pos..];
    let vector = lanes == 32 && super::delta_simd::applies::<L>();
    // Every decoder reads words from a copy of the section padded with zeros.
    s.pad.clear();
    s.pad.extend_from_slice(s0);
    s.pad.extend_from_slice(&[0; super::delta_avx512::PAD]);
    let sec = Section {
        s0,
        padded: &s.pad,
        dec: &s.dec,
        lens,
        lanes,
        group,
        n,
        w,
        vector,
    };
    let parts = split_groups(&sec, groups, threads);
    let (p, changed, exp_changed) = match parts.as_deref() {
        Some(parts) => decode_parts::<L>(&sec, parts, state, ctx, out)?,
        None => decode_groups::<L>(&sec, 0..groups, 0, state, ctx, out)?,
    };
    if p != s0.len() {
        return Err(CodecError::corrupt(
            "delta lanes",
            format!("groups hold {p} bytes of a {}-byte section", s0.len()),
        ));
    }
    Ok((changed, exp_changed))
}

/// A Delta frame's lane section and what every group's decoder reads: the section (and its
/// padded copy), the decoder lookup, the group lengths and the geometry.
struct Section<'a> {
    s0: &'a [u8],
    /// `s0` and zeros (`delta_avx512::PAD` bytes) after it.
    padded: &'a [u8],
    dec: &'a [u32],
    lens: &'a [u8],
    lanes: usize,
    group: usize,
    /// Elements in the chunk.
    n: usize,
    w: u32,
    /// A vector row decoder applies.
    vector: bool,
}

/// A part should hold at least this many groups (64Ki elements of 32 lanes): below it, handing
/// the part to another thread costs more than the thread saves.
const MIN_PART_GROUPS: usize = 2;

/// How `threads` threads split a chunk of `n` elements in groups of `group`: contiguous runs of
/// whole groups, an even number each (the AVX-512 decoder pairs groups from an even one, as on
/// one thread), each with its element count. None where one thread codes it all: one thread
/// asked for, or a chunk of fewer than `2 * MIN_PART_GROUPS` groups.
fn runs(n: usize, group: usize, threads: usize) -> Option<Vec<(Range<usize>, usize)>> {
    let groups = n.div_ceil(group);
    let parts = threads.min(groups / MIN_PART_GROUPS);
    if parts < 2 {
        return None;
    }
    let per = groups.div_ceil(parts).next_multiple_of(2);
    Some(
        (0..groups)
            .step_by(per)
            .map(|g| {
                let gs = g..(g + per).min(groups);
                let elems = (gs.end * group).min(n) - gs.start * group;
                (gs, elems)
            })
            .collect(),
    )
}

/// `s` cut into consecutive spans of `sizes` bytes.
fn cut(mut s: &mut [u8], sizes: impl Iterator<Item = usize>) -> Vec<&mut [u8]> {
    sizes
        .map(|k| {
            let (head, tail) = std::mem::take(&mut s).split_at_mut(k);
            s = tail;
            head
        })
        .collect()
}

/// Where `threads` (more than one) decoders may split a chunk of `groups` groups: its
/// [`runs`] (groups, elements), each with the byte of the section where its first group
/// starts. None where one
/// thread decodes it all: as for `runs`, or group lengths that do not add up within the
/// section (the single decoder then reports the first wrong group, as always).
fn split_groups(
    sec: &Section<'_>,
    groups: usize,
    threads: usize,
) -> Option<Vec<(Range<usize>, usize, usize)>> {
    let parts = runs(sec.n, sec.group, threads)?;
    let mut starts = Vec::with_capacity(groups + 1);
    let mut p = 0usize;
    for g in 0..groups {
        starts.push(p);
        let len = group_len(sec.lens, g);
        if len > sec.s0.len() - p {
            return None;
        }
        p += len;
    }
    Some(
        parts
            .into_iter()
            .map(|(gs, elems)| {
                let p = starts[gs.start];
                (gs, elems, p)
            })
            .collect(),
    )
}

/// Decode the chunk's `parts` (see `split_groups`) on as many threads (this one and the codec
/// pool's), each into its own span of `state`, `ctx` and `out`. Returns what `decode_groups`
/// returns for the whole chunk: the byte after the last group and the counts; or the error of
/// the first group that failed, as one thread decoding them in order would report it (every
/// part before it decoded without error).
fn decode_parts<L: Layout>(
    sec: &Section<'_>,
    parts: &[(Range<usize>, usize, usize)],
    state: &mut [u8],
    ctx: &mut [u8],
    out: &mut [u8],
) -> Result<(usize, usize, usize)> {
    let elems = || parts.iter().map(|(_, elems, _)| *elems);
    let states = cut(state, elems().map(|e| e * L::BYTES));
    let ctxs = cut(ctx, elems());
    let outs = cut(out, elems().map(|e| e * L::BYTES));
    let spans: Vec<_> = parts
        .iter()
        .zip(states.into_iter().zip(ctxs).zip(outs))
        .map(|((gs, _, p), ((s, c), o))| (gs.clone(), *p, s, c, o))
        .collect();
    let mut results: Vec<Option<Result<(usize, usize, usize)>>> = vec![None; parts.len()];
    let mut spans = spans.into_iter();
    let (gs0, p0, s0, c0, o0) = spans.next().expect("at least two parts");
    let (first, rest) = results.split_first_mut().expect("at least two parts");
    super::pool::count_split();
    super::pool::coders().in_place_scope(|scope| {
        for ((gs, p, s, c, o), r) in spans.zip(rest.iter_mut()) {
            scope.spawn(move |_| *r = Some(decode_groups::<L>(sec, gs, p, s, c, o)));
        }
        *first = Some(decode_groups::<L>(sec, gs0, p0, s0, c0, o0));
    });
    let (mut p, mut changed, mut exp_changed) = (0, 0, 0);
    for r in results {
        let (pe, c, e) = r.expect("every part ran")?;
        (p, changed, exp_changed) = (pe, changed + c, exp_changed + e);
    }
    Ok((p, changed, exp_changed))
}

/// Decode groups `gs` of the chunk, their words from byte `p` of the section on, into `state`,
/// `ctx` and `out`, which hold exactly those groups' elements; check each group. Returns the
/// byte after the last group's words and the counts of changed values and of values whose
/// cached field (exponent) changed.
fn decode_groups<L: Layout>(
    sec: &Section<'_>,
    gs: Range<usize>,
    mut p: usize,
    state: &mut [u8],
    ctx: &mut [u8],
    out: &mut [u8],
) -> Result<(usize, usize, usize)> {
    let (lanes, group, n) = (sec.lanes, sec.group, sec.n);
    let mut v = Values::<L> {
        s0: sec.s0,
        padded: sec.padded,
        dec: sec.dec,
        state,
        ctx,
        out,
        w: sec.w,
        changed: 0,
        exp_changed: 0,
        no_table: false,
        _l: std::marker::PhantomData,
    };
    // Element 0 of these spans.
    let first = gs.start * group;
    // The AVX-512 decoder takes two whole groups at a time where it can (their steps overlap;
    // four are slower: the gathers' throughput); otherwise a group at a time, its full rows by
    // a vector decoder where one applies, the rest plainly. Every group is checked the same way
    // either way.
    let batches = sec.vector && super::delta_simd::decode_batches();
    let mut x = vec![0u32; lanes];
    let mut g = gs.start;
    while g < gs.end {
        let base = g * group - first;
        let cnt = group.min(n - g * group);
        let (rows, rem) = (cnt / lanes, cnt % lanes);
        // Groups g and g + 1 both whole (all but the chunk's last group are) and both here.
        if batches && rem == 0 && rows > 0 && g + 2 <= gs.end && (n - g * group) / cnt >= 2 {
            p = decode_batch::<L, 2>(&mut v, sec.padded, sec.lens, g, p, base, cnt, rows)?;
            g += 2;
            continue;
        }
        let mut rd = open_group(sec.s0, sec.lens, g, p, &mut x)?;
        let mut plain_from = 0;
        if sec.vector {
            let mut rc = super::delta_simd::RowCounts::default();
            if super::delta_simd::decode_rows::<L>(
                sec.padded,
                sec.s0.len(),
                sec.dec,
                &mut x,
                &mut rd,
                v.state,
                v.ctx,
                v.out,
                base,
                rows,
                &mut rc,
            ) {
                v.changed += rc.changed;
                v.exp_changed += rc.exp_changed;
                v.no_table |= rc.no_table;
                plain_from = rows;
            }
        }
        for k in plain_from..rows {
            v.row(&mut x, &mut rd, base + k * lanes, lanes);
        }
        v.row(&mut x, &mut rd, base + rows * lanes, rem);
        check_group(g, &rd, &x, v.no_table)?;
        p = rd.end;
        g += 1;
    }
    Ok((p, v.changed, v.exp_changed))
}

/// Decode `B` whole groups from group `g` (lane section byte `p` on, element `base` of the
/// decoder's spans) of `cnt` elements, `rows` rows of 32 lanes each, in lockstep with the
/// AVX-512 decoder (plainly where it does not apply), and check each; returns the byte after
/// them.
#[allow(clippy::too_many_arguments)]
fn decode_batch<L: Layout, const B: usize>(
    v: &mut Values<'_, L>,
    pad: &[u8],
    lens: &[u8],
    g: usize,
    mut p: usize,
    base: usize,
    cnt: usize,
    rows: usize,
) -> Result<usize> {
    let mut xs = [[0u32; LANES]; B];
    let mut rds: [Reader; B] = std::array::from_fn(|_| Reader { at: 0, end: 0 });
    for (i, (x, rd)) in xs.iter_mut().zip(rds.iter_mut()).enumerate() {
        *rd = open_group(v.s0, lens, g + i, p, x)?;
        p = rd.end;
    }
    let bases: [usize; B] = std::array::from_fn(|i| base + i * cnt);
    let mut rc = super::delta_simd::RowCounts::default();
    if super::delta_simd::decode_rows_n::<L, B>(
        pad,
        v.s0.len(),
        v.dec,
        xs.each_mut().map(|x| &mut x[..]),
        rds.each_mut(),
        v.state,
        v.ctx,
        v.out,
        bases,
        rows,
        &mut rc,
    ) {
        v.changed += rc.changed;
        v.exp_changed += rc.exp_changed;
        v.no_table |= rc.no_table;
    } else {
        for i in 0..B {
            for k in 0..rows {
                v.row(&mut xs[i], &mut rds[i], bases[i] + k * LANES, LANES);
            }
        }
    }
    for i in 0..B {
        check_group(g + i, &rds[i], &xs[i], v.no_table)?;
    }
    Ok(p)
}

/// Group `g` of a Delta frame's lane section `s0`, starting at byte `p`: its length from the
/// group lengths `lens` checked, its lane states read into `x` (checked), and a reader of its
/// words.
fn open_group(s0: &[u8], lens: &[u8], g: usize, p: usize, x: &mut [u32]) -> Result<Reader> {
    let lanes = x.len();
    let len = group_len(lens, g);
    if len < 4 * lanes || !(len - 4 * lanes).is_multiple_of(2) || len > s0.len() - p {
        return Err(CodecError::corrupt(
            "delta lanes",
            format!(
                "group {g}: {len} bytes ({lanes} states and whole words expected), {} left \
                 in the section",
                s0.len() - p
            ),
        ));
    }
    for (l, xl) in x.iter_mut().enumerate() {
        let q = p + 4 * l;
        *xl = u32::from_le_bytes([s0[q], s0[q + 1], s0[q + 2], s0[q + 3]]);
        if !(RANS_L..RANS_L << 16).contains(xl) {
            return Err(CodecError::corrupt(
                "delta lanes",
                format!("group {g} lane {l}: state {xl:#x} out of range"),
            ));
        }
    }
    Ok(Reader {
        at: p + 4 * lanes,
        end: p + len,
    })
}

/// Group `g`'s byte length from a Delta frame's group lengths `lens`.
fn group_len(lens: &[u8], g: usize) -> usize {
    let o = 4 * g;
    u32::from_le_bytes([lens[o], lens[o + 1], lens[o + 2], lens[o + 3]]) as usize
}

/// The checks after group `g` is decoded: every element had a table, every word of its stream
/// was consumed and every lane is back at the encoder's initial state.
fn check_group(g: usize, rd: &Reader, x: &[u32], no_table: bool) -> Result<()> {
    if no_table {
        return Err(CodecError::corrupt(
            "delta tables",
            format!("an element of group {g} has a context the frame has no table for"),
        ));
    }
    if rd.at != rd.end || x.iter().any(|&xl| xl != RANS_L) {
        return Err(CodecError::corrupt(
            "delta lanes",
            format!(
                "group {g}: stream ends {} bytes {} its last element, final states {:x?} \
                 (expected {RANS_L:#x})",
                rd.end.abs_diff(rd.at),
                if rd.at > rd.end { "before" } else { "after" },
                x.iter()
                    .filter(|&&xl| xl != RANS_L)
                    .take(4)
                    .collect::<Vec<_>>()
            ),
        ));
    }
    Ok(())
}

/// Where a group's shared word stream is read. Past its end it reads zeros (and the check
/// after the group, every word consumed exactly, catches it).
pub(super) struct Reader {
    pub(super) at: usize,
    pub(super) end: usize,
}

/// What a decoder writes to.
struct Values<'a, L> {
    s0: &'a [u8],
    /// `s0` and zeros (at least two bytes) after it.
    padded: &'a [u8],
    dec: &'a [u32],
    state: &'a mut [u8],
    ctx: &'a mut [u8],
    out: &'a mut [u8],
    w: u32,
    changed: usize,
    exp_changed: usize,
    /// Some element's context had no table.
    no_table: bool,
    _l: std::marker::PhantomData<L>,
}

impl<L: Layout> Values<'_, L> {
    /// Read one word into a state below RANS_L (one suffices after any step). Without a branch
    /// (whether a lane reads is as good as random): the word at `rd.at` is read either way,
    /// from the padded copy of the section (zeros past its end; past the group's end it may
    /// read the next group's words, and the check after the group, every word consumed
    /// exactly, fails either way).
    #[inline(always)]
    fn refill(&self, rd: &mut Reader, x: &mut u32) {
        let need = (*x < RANS_L) as u32;
        let at = rd.at.min(self.s0.len());
        let word = u16::from_le_bytes([self.padded[at], self.padded[at + 1]]) as u32;
        let keep = need.wrapping_sub(1); // all ones where the lane does not read
        *x = (*x & keep) | (((*x << 16) | word) & !keep);
        rd.at += 2 * need as usize;
    }

    /// Decode the row of `m` elements starting at element `first` (lane l has element
    /// first + l): token steps of every lane, then extra bits, then the values.
    fn row(&mut self, x: &mut [u32], rd: &mut Reader, first: usize, m: usize) {
        let w = self.w;
        let mut zs = [0u32; MAX_LANES];
        let mut ebs = [0u32; MAX_LANES];
        for l in 0..m {
            let c = self.ctx[first + l] as usize;
            let xs = &mut x[l];
            let e = self.dec[c * PROB_SCALE as usize + (*xs & (PROB_SCALE - 1)) as usize];
            self.no_table |= e == 0;
            *xs = (e >> 19) * (*xs >> PROB_BITS) + ((e >> 7) & 0xfff);
            self.refill(rd, xs);
            (zs[l], ebs[l]) = detokenize(e & 0x7f);
        }
        for l in 0..m {
            let lo = ebs[l].min(EXTRA_STEP);
            zs[l] |= x[l] & mask(lo);
            x[l] >>= lo;
            self.refill(rd, &mut x[l]);
        }
        if w > EXTRA_STEP + DIRECT_BITS {
            for l in 0..m {
                let hi = ebs[l].saturating_sub(EXTRA_STEP);
                zs[l] |= (x[l] & mask(hi)) << EXTRA_STEP;
                x[l] >>= hi;
                self.refill(rd, &mut x[l]);
            }
        }
        for (l, &z) in zs.iter().enumerate().take(m) {
            let i = first + l;
            let dm = unzigzag(z, w);
            let old = L::load(self.state, i);
            let new = unkey(key(old, w).wrapping_add(dm) & mask(w), w);
            self.changed += (dm != 0) as usize;
            self.exp_changed += (L::exp(old) != L::exp(new)) as usize;
            L::store(self.out, i, new);
            L::store(self.state, i, new);
            self.ctx[i] = context_of(dm, w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_ranges_cover_the_chunk_and_count_every_eighth_tile_of_a_sampled_one() {
        for n in [
            0,
            1,
            4095,
            SAMPLE_MIN - 1,
            SAMPLE_MIN,
            SAMPLE_MIN + 1,
            40 * SAMPLE_TILE + 17,
            200_003,
        ] {
            let rs: Vec<_> = count_ranges(n).collect();
            let mut at = 0;
            for (r, counted) in &rs {
                assert_eq!(r.start, at, "n {n}: ranges are contiguous");
                assert!(r.end > r.start, "n {n}: no empty range");
                at = r.end;
                for i in [r.start, r.end - 1] {
                    let want = !sampled(n) || (i / SAMPLE_TILE).is_multiple_of(SAMPLE_EVERY);
                    assert_eq!(*counted, want, "n {n}: element {i}");
                }
            }
            assert_eq!(at, n, "n {n}: ranges cover the chunk");
            let counted: usize = rs.iter().filter(|r| r.1).map(|r| r.0.len()).sum();
            if !sampled(n) {
                assert_eq!(counted, n, "n {n}: an unsampled chunk is counted whole");
            } else {
                assert!(
                    counted * SAMPLE_EVERY <= n + SAMPLE_EVERY * SAMPLE_TILE,
                    "n {n}"
                );
                assert!(
                    counted * SAMPLE_EVERY >= n - SAMPLE_EVERY * SAMPLE_TILE,
                    "n {n}"
                );
            }
        }
    }

    #[test]
    fn keys_and_moves_are_bijective_on_16_bits() {
        for u in 0..=0xffffu32 {
            assert_eq!(unkey(key(u, 16), 16), u);
            let z = zigzag(u, 16);
            assert_eq!(unzigzag(z, 16), u);
            let (t, e) = tokenize(z);
            let (hi, e2) = detokenize(t as u32);
            assert_eq!(e, e2);
            assert!((t as usize) < tokens(16));
            assert_eq!(hi | (z & mask(e)), z);
        }
        // Monotone: keys sort like the values (-0 just below +0).
        let v = |x: f32| x.to_bits() >> 16;
        assert!(key(v(-1.0), 16) < key(v(-0.0), 16));
        assert_eq!(key(v(-0.0), 16) + 1, key(v(0.0), 16));
        assert!(key(v(0.0), 16) < key(v(1e-40), 16));
        assert_eq!(ulp_move(v(1.0), v(1.0078125), 16), 1);
    }

    #[test]
    fn reciprocal_encoding_equals_division() {
        // Every state an encoder divides is in [x_max >> 16, x_max) after renormalisation.
        for freq in 1..=PROB_SCALE {
            let s = enc_sym(0, freq);
            let check = |x: u32| {
                let mut buf = [0u16; 2];
                let mut w = Words {
                    buf: &mut buf,
                    pos: 0,
                };
                let mut y = x;
                w.put(&mut y, &s);
                assert_eq!(w.pos, 0, "freq {freq} x {x}: emitted");
                assert_eq!(y, (x / freq) * PROB_SCALE + x % freq, "freq {freq} x {x}");
            };
            let lo = s.x_max >> 16;
            let mut x = lo;
            while x < s.x_max {
                check(x);
                x += 1 + (s.x_max - lo) / 997 + (x & 7);
            }
            check(s.x_max - 2);
            check(s.x_max - 1);
        }
    }

    #[test]
    fn contexts_clip_moves() {
        assert_eq!(context_of(0, 16), 8);
        assert_eq!(context_of(0xffff, 16), 7);
        assert_eq!(context_of(100, 16), 16);
        assert_eq!(context_of(0x8000, 16), 0);
        assert_eq!(context_of(u32::MAX, 32), 7);
    }
}
