//! Delta frames (docs/WIRE.md, "Delta", format version 2) re-derived from the document alone,
//! without the codec: keys, moves, zigzag, tokens and extra bits, contexts, the model section
//! `s1` and the groups of `s0` (lane states, then one rANS word stream per group shared by its
//! lanes: 32-bit states, L = 2^15, 16-bit words).
//!
//! Shared by tests/codec_golden.rs (the spec side of the golden vectors), tests/codec_corrupt.rs
//! and the fuzz targets (an accepted Delta frame must be the coding of its output under its own
//! tables: the rANS decoder is a bijection, so nothing else can pass its end checks).
//!
//! Nothing here may call into `ciera::codec`: a mistake shared by the codec and this file would
//! go unnoticed.
#![allow(dead_code)]

/// Lower bound of a lane state (the encoder's initial state, every lane's final one).
pub const L: u32 = 1 << 15;
/// Contexts -8..8, stored as move + 8.
pub const NCTX: usize = 17;
/// The context byte of "no previous move" (after a FILL, an Exp or a Hybrid frame).
pub const CONTEXT_NONE: u8 = 8;
/// Frequencies sum to 2^PROB_BITS ("present ones sum to 4096 (12-bit)"); the decoding step's
/// `x & 4095` and `x >> 12` are this precision.
pub const PROB_BITS: u32 = 12;
pub const SCALE: u32 = 1 << PROB_BITS;
/// Most lanes, and most elements of a group.
pub const MAX_LANES: usize = 64;
pub const MAX_GROUP_ELEMS: usize = 1 << 24;

pub fn mask(w: u32) -> u32 {
    if w == 32 {
        u32::MAX
    } else {
        (1 << w) - 1
    }
}

/// `key(u)`: `u XOR (2^W - 1)` if the sign bit is set, else `u OR 2^(W-1)`.
pub fn key(u: u32, w: u32) -> u32 {
    let top = 1u32 << (w - 1);
    if u & top != 0 {
        u ^ mask(w)
    } else {
        u | top
    }
}

/// The inverse of `key`: a key with its top bit set came from a value without sign.
pub fn unkey(k: u32, w: u32) -> u32 {
    let top = 1u32 << (w - 1);
    if k & top != 0 {
        k & !top
    } else {
        k ^ mask(w)
    }
}

/// A W-bit number read as signed.
pub fn signed(d: u32, w: u32) -> i64 {
    let d = d as i64 & mask(w) as i64;
    if d >= 1 << (w - 1) {
        d - (1i64 << w)
    } else {
        d
    }
}

/// The move `d = key(new) - key(old) mod 2^W`.
pub fn ulp_move(old: u32, new: u32, w: u32) -> u32 {
    key(new, w).wrapping_sub(key(old, w)) & mask(w)
}

/// `zigzag(d) = (2s) XOR (s >> (W-1))` mod 2^W.
pub fn zigzag(d: u32, w: u32) -> u32 {
    let s = signed(d, w);
    ((2 * s) ^ (s >> (w - 1))) as u32 & mask(w)
}

/// `d = (z >> 1) XOR -(z & 1)` mod 2^W.
pub fn unzigzag(z: u32, w: u32) -> u32 {
    ((z >> 1) ^ 0u32.wrapping_sub(z & 1)) & mask(w)
}

/// `clip(previous move, -8, 8) + 8`.
pub fn context(d: u32, w: u32) -> u8 {
    (signed(d, w).clamp(-8, 8) + 8) as u8
}

/// T: 32 direct tokens, then two per bit length 5..W-1.
pub fn ntokens(w: u32) -> usize {
    32 + 2 * (w as usize - 5)
}

/// (token, number of extra bits) of a zigzag value; the extra bits are its low bits.
pub fn token(z: u32) -> (usize, u32) {
    if z < 32 {
        return (z as usize, 0);
    }
    let b = 31 - z.leading_zeros(); // floor(log2 z), 5..W-1
    (
        32 + 2 * (b as usize - 5) + ((z >> (b - 1)) & 1) as usize,
        b - 1,
    )
}

/// The model section: lane count, group size, a table per context, the group lengths.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    pub lanes: usize,
    pub group: usize,
    /// Per context -8..8: `None` (m = 0) or the frequencies of tokens 0..m-1.
    pub tables: Vec<Option<Vec<u32>>>,
    /// Group lengths in bytes (the lane states and the group's words).
    pub lens: Vec<usize>,
}

fn leb128(v: u32, out: &mut Vec<u8>) {
    let mut v = v;
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

/// Parse `s1` of a Delta frame of `n` elements of a W-bit type, checking every rule of the
/// document that needs no element: 1..64 lanes, groups of 1..2^24 elements, m <= T, varints of
/// at most 3 bytes, frequencies summing to SCALE, G group lengths (each 4 x lanes + an even
/// number) and nothing after them.
pub fn parse_s1(s1: &[u8], n: usize, w: u32) -> Result<Model, String> {
    if s1.len() < 5 {
        return Err(format!("s1 of {} bytes", s1.len()));
    }
    let lanes = s1[0] as usize;
    let group = u32::from_le_bytes(s1[1..5].try_into().unwrap()) as usize;
    if !(1..=MAX_LANES).contains(&lanes) {
        return Err(format!("{lanes} lanes"));
    }
    if !(1..=MAX_GROUP_ELEMS).contains(&group) {
        return Err(format!("groups of {group} elements"));
    }
    let mut pos = 5;
    let mut tables = Vec::new();
    for c in 0..NCTX {
        let m = *s1.get(pos).ok_or("s1 ends in the tables")? as usize;
        pos += 1;
        if m == 0 {
            tables.push(None);
            continue;
        }
        if m > ntokens(w) {
            return Err(format!(
                "context {}: m = {m} > T = {}",
                c as i32 - 8,
                ntokens(w)
            ));
        }
        let mut f = Vec::new();
        for _ in 0..m {
            let (mut v, mut shift) = (0u32, 0);
            loop {
                let b = *s1.get(pos).ok_or("s1 ends in a varint")?;
                pos += 1;
                v |= ((b & 0x7f) as u32) << shift;
                shift += 7;
                if b & 0x80 == 0 {
                    break;
                }
                if shift == 21 {
                    return Err("varint longer than 3 bytes".into());
                }
            }
            f.push(v);
        }
        let sum: u64 = f.iter().map(|&x| x as u64).sum();
        if sum != SCALE as u64 {
            return Err(format!(
                "context {}: frequencies sum to {sum}",
                c as i32 - 8
            ));
        }
        tables.push(Some(f));
    }
    let groups = n.div_ceil(group);
    if s1.len() - pos != 4 * groups {
        return Err(format!(
            "{} bytes of group lengths for {groups} groups",
            s1.len() - pos
        ));
    }
    let lens: Vec<usize> = s1[pos..]
        .chunks(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()) as usize)
        .collect();
    if let Some(l) = lens
        .iter()
        .find(|&&l| l < 4 * lanes || !(l - 4 * lanes).is_multiple_of(2))
    {
        return Err(format!("group length {l} for {lanes} lanes"));
    }
    Ok(Model {
        lanes,
        group,
        tables,
        lens,
    })
}

/// `s1` as the document lays it out (varints in their shortest form).
pub fn write_s1(m: &Model) -> Vec<u8> {
    let mut s = vec![m.lanes as u8];
    s.extend_from_slice(&(m.group as u32).to_le_bytes());
    for t in &m.tables {
        match t {
            None => s.push(0),
            Some(f) => {
                s.push(f.len() as u8);
                for &x in f {
                    leb128(x, &mut s);
                }
            }
        }
    }
    for &l in &m.lens {
        s.extend_from_slice(&(l as u32).to_le_bytes());
    }
    s
}

/// The rules that tie the tables to the elements ("0: no element of this context in the
/// frame"; "0 for an absent token"): a context has a table iff an element has it, and a
/// token has a non-zero frequency iff an element of that context has it; in a sampled chunk
/// (SAMPLE_MIN elements or more) only "if" (it has every table, and every frequency). (A decoder
/// may still take a frame that breaks them: they do not change what it decodes to.)
pub fn tables_describe(m: &Model, w: u32, z: &[u32], ctx: &[u8]) -> Result<(), String> {
    let mut hist = vec![vec![0u32; ntokens(w)]; NCTX];
    for (&zi, &c) in z.iter().zip(ctx) {
        hist[c as usize][token(zi).0] += 1;
    }
    // A sampled chunk's tables hold every token: they must still hold every element.
    let exact = z.len() < SAMPLE_MIN;
    for (c, (t, h)) in m.tables.iter().zip(&hist).enumerate() {
        let used = h.iter().any(|&x| x > 0);
        match t {
            None if used => return Err(format!("context {}: elements but no table", c as i32 - 8)),
            None => {}
            Some(_) if !used && exact => {
                return Err(format!("context {}: a table but no element", c as i32 - 8))
            }
            Some(f) => {
                for (tok, &x) in h.iter().enumerate() {
                    let fr = f.get(tok).copied().unwrap_or(0);
                    if (x > 0 && fr == 0) || (exact && x == 0 && fr > 0) {
                        return Err(format!(
                            "context {} token {tok}: {x} elements, frequency {fr}",
                            c as i32 - 8
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// The steps of a row of a group in the document's decoding order: (lane, step), step 0 the
/// token step, 1 the extra step, 2 fp32's second extra step.
fn row_steps(m: usize, w: u32) -> Vec<(usize, u8)> {
    let mut v: Vec<(usize, u8)> = (0..m).map(|l| (l, 0)).collect();
    v.extend((0..m).map(|l| (l, 1)));
    if w == 32 {
        v.extend((0..m).map(|l| (l, 2)));
    }
    v
}

/// The rows of a group of `cnt` elements: (first element, lanes in the row), in order.
fn rows(base: usize, cnt: usize, lanes: usize) -> Vec<(usize, usize)> {
    (0..cnt.div_ceil(lanes))
        .map(|r| (base + r * lanes, lanes.min(cnt - r * lanes)))
        .collect()
}

/// `s0` and the group lengths coding the moves `z` of elements whose contexts are `ctx`, with
/// `m`'s lanes, group and tables: each group coded backwards from states 2^15, the exact
/// reverse of the document's decoding order (rows; in a row the token steps of its lanes, then
/// their extra steps, then fp32's second extra steps, lanes in order), into one word stream
/// per group. Before a step would leave its lane's state at or above 2^31 (out of the state
/// range), the encoder moves the state's low 16 bits to the stream: that is the word the
/// decoder's refill after the step takes back.
pub fn encode_groups(
    m: &Model,
    w: u32,
    z: &[u32],
    ctx: &[u8],
) -> Result<(Vec<u8>, Vec<usize>), String> {
    let n = z.len();
    let (mut s0, mut lens) = (Vec::new(), Vec::new());
    for g in 0..n.div_ceil(m.group) {
        let base = g * m.group;
        let cnt = m.group.min(n - base);
        let mut x: Vec<u64> = vec![L as u64; m.lanes];
        let mut words: Vec<u16> = Vec::new(); // in encoding order
        for (first, k) in rows(base, cnt, m.lanes).into_iter().rev() {
            for (l, step) in row_steps(k, w).into_iter().rev() {
                let i = first + l;
                let (t, e) = token(z[i]);
                if t >= ntokens(w) {
                    return Err(format!(
                        "element {i}: zigzag {:#x} wider than {w} bits",
                        z[i]
                    ));
                }
                let lo = e.min(15);
                // The state this step leaves, from the state before it (in decoding order:
                // the state after it, before its refill).
                let next: Box<dyn Fn(u64) -> u64> = match step {
                    0 => {
                        let table = m.tables[ctx[i] as usize].as_ref().ok_or_else(|| {
                            format!("element {i}: no table for context {}", ctx[i] as i32 - 8)
                        })?;
                        let f = *table.get(t).filter(|&&f| f > 0).ok_or_else(|| {
                            format!(
                                "element {i}: token {t} has no frequency in context {}",
                                ctx[i] as i32 - 8
                            )
                        })? as u64;
                        let cum: u64 = table[..t].iter().map(|&x| x as u64).sum();
                        Box::new(move |x| (x / f) * SCALE as u64 + x % f + cum)
                    }
                    1 => {
                        let v = (z[i] & mask(lo)) as u64;
                        Box::new(move |x| (x << lo) | v)
                    }
                    _ => {
                        let hi = e - lo;
                        let v = ((z[i] >> 15) & mask(hi)) as u64;
                        Box::new(move |x| (x << hi) | v)
                    }
                };
                let xl = &mut x[l];
                if next(*xl) >= 1 << 31 {
                    words.push(*xl as u16);
                    *xl >>= 16;
                }
                assert!(next(*xl) < 1 << 31);
                *xl = next(*xl);
            }
        }
        let start = s0.len();
        for &xl in &x {
            assert!((L as u64..1 << 31).contains(&xl));
            s0.extend_from_slice(&(xl as u32).to_le_bytes());
        }
        for wd in words.iter().rev() {
            s0.extend_from_slice(&wd.to_le_bytes());
        }
        lens.push(s0.len() - start);
    }
    Ok((s0, lens))
}

/// Decode `s0` by the document's pseudocode, against the old values and contexts: the new
/// values and contexts, or why the frame is refused.
pub fn decode(
    s0: &[u8],
    m: &Model,
    w: u32,
    old: &[u32],
    ctx: &[u8],
) -> Result<(Vec<u32>, Vec<u8>), String> {
    let n = old.len();
    let (mut new, mut nctx) = (old.to_vec(), ctx.to_vec());
    let mut p = 0usize;
    for g in 0..n.div_ceil(m.group) {
        let base = g * m.group;
        let cnt = m.group.min(n - base);
        let len = m.lens[g];
        let bytes = s0.get(p..p + len).ok_or("groups run past s0")?;
        p += len;
        let mut x: Vec<u32> = bytes[..4 * m.lanes]
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        if let Some(bad) = x.iter().find(|&&xl| !(L..1 << 31).contains(&xl)) {
            return Err(format!("group {g}: state {bad:#x}"));
        }
        let mut words = bytes[4 * m.lanes..]
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32);
        let mut refill = |x: &mut u32| -> Result<(), String> {
            if *x < L {
                *x = (*x << 16) | words.next().ok_or("group stream ends early")?;
            }
            Ok(())
        };
        for (first, k) in rows(base, cnt, m.lanes) {
            let mut zs = vec![0u32; k];
            let mut es = vec![0u32; k];
            for (l, step) in row_steps(k, w) {
                let i = first + l;
                let xl = &mut x[l];
                match step {
                    0 => {
                        let table = m.tables[ctx[i] as usize]
                            .as_ref()
                            .ok_or_else(|| format!("element {i}: no table for its context"))?;
                        let slot = *xl & (SCALE - 1);
                        let (mut cum, mut t) = (0u32, 0usize);
                        while cum + table[t] <= slot {
                            cum += table[t];
                            t += 1;
                        }
                        *xl = table[t] * (*xl >> PROB_BITS) + slot - cum;
                        if t < 32 {
                            zs[l] = t as u32;
                        } else {
                            let b = (t as u32 - 32) / 2 + 5;
                            zs[l] = (2 + (t as u32 & 1)) << (b - 1);
                            es[l] = b - 1;
                        }
                    }
                    1 => {
                        let lo = es[l].min(15);
                        zs[l] |= *xl & mask(lo);
                        *xl >>= lo;
                    }
                    _ => {
                        let hi = es[l] - es[l].min(15);
                        zs[l] |= (*xl & mask(hi)) << 15;
                        *xl >>= hi;
                    }
                }
                refill(xl)?;
            }
            for (l, &z) in zs.iter().enumerate() {
                let i = first + l;
                let d = unzigzag(z, w);
                new[i] = unkey(key(old[i], w).wrapping_add(d) & mask(w), w);
                nctx[i] = context(d, w);
            }
        }
        if words.next().is_some() || x.iter().any(|&xl| xl != L) {
            return Err(format!("group {g}: words left or final states {x:x?}"));
        }
    }
    if p != s0.len() {
        return Err(format!("groups hold {p} of {} bytes", s0.len()));
    }
    Ok((new, nctx))
}

/// The encoder's tables (its choice, not part of the format): each present token gets
/// `round(count x SCALE / total)` (at least 1), and the rounding error is spread one unit at a
/// time over the present tokens in decreasing order of frequency (ties: lower token first),
/// never taking one below 1. With `all` (a sampled chunk) every token is present, counted or
/// not.
pub fn normalize(hist: &[u32], all: bool) -> Vec<u32> {
    let total: u64 = hist.iter().map(|&h| h as u64).sum();
    let present = |t: usize| hist[t] > 0 || all;
    let mut f: Vec<u32> = hist
        .iter()
        .enumerate()
        .map(|(t, &h)| {
            if !present(t) {
                0
            } else if h == 0 {
                1
            } else {
                ((h as u64 * SCALE as u64 + total / 2) / total).max(1) as u32
            }
        })
        .collect();
    let mut diff = SCALE as i64 - f.iter().map(|&x| x as i64).sum::<i64>();
    let mut order: Vec<usize> = (0..hist.len()).filter(|&t| present(t)).collect();
    order.sort_by_key(|&t| std::cmp::Reverse(f[t]));
    while diff != 0 {
        for &t in &order {
            if diff > 0 {
                f[t] += 1;
                diff -= 1;
            } else if diff < 0 && f[t] > 1 {
                f[t] -= 1;
                diff += 1;
            }
        }
    }
    f
}

/// The encoder's sampling ("sampled" in the document): a chunk of at least SAMPLE_MIN elements
/// has the tokens of only every SAMPLE_EVERY-th tile of SAMPLE_TILE elements counted, and a
/// frequency of at least 1 for every token of every context.
pub const SAMPLE_TILE: usize = 4096;
pub const SAMPLE_EVERY: usize = 8;
pub const SAMPLE_MIN: usize = 32 * SAMPLE_TILE;

/// The tables the encoder builds for moves `z` in contexts `ctx` (m: one past the highest token
/// used; every token of every context in a sampled chunk), with lane count `lanes` and group
/// `group`; the group lengths are left empty.
pub fn encoder_model(w: u32, z: &[u32], ctx: &[u8], lanes: usize, group: usize) -> Model {
    let n = z.len();
    let mut hist = vec![vec![0u32; ntokens(w)]; NCTX];
    for (i, (&zi, &c)) in z.iter().zip(ctx).enumerate() {
        if n < SAMPLE_MIN || (i / SAMPLE_TILE).is_multiple_of(SAMPLE_EVERY) {
            hist[c as usize][token(zi).0] += 1;
        }
    }
    let all = n >= SAMPLE_MIN;
    let tables = hist
        .iter()
        .map(|h| {
            let m = if all {
                h.len()
            } else {
                h.iter().rposition(|&x| x > 0).map_or(0, |p| p + 1)
            };
            (m > 0).then(|| normalize(&h[..m], all))
        })
        .collect();
    Model {
        lanes,
        group,
        tables,
        lens: Vec::new(),
    }
}
