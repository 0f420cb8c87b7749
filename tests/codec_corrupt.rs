//! Corrupt frames: take valid frames of real training-trace drift (tests/data/olmoe-slice:
//! bf16 and fp32 weights of consecutive optimizer steps; fp16 by conversion), damage them, and
//! decode against a copy of the receiver's slot. The decoder must never panic, and:
//!
//! - damage the checksums would catch (bit flips, truncation, extension, swaps, inserted or
//!   deleted bytes, overwritten ranges), and structural edits resealed with valid checksums
//!   (moved section boundaries, grown or shrunk sections, edited header fields) must give `Err`
//!   or `Ok` with output exactly equal to the original input;
//! - content edits resealed with valid checksums (the deep parsers: masks, rANS, exponents,
//!   packing) may decode to other values, but must leave the receiver's slot consistent with what
//!   it reported: a sender holding those values at the receiver's version must then get its
//!   next frame through exactly;
//! - arbitrary bytes, with or without a plausible resealed header, give `Err` (or, where the
//!   header happens to be valid, a consistent `Ok`).
//!
//! `CIERA_CORRUPT_SEED` and `CIERA_CORRUPT_SCALE` (a multiplier) vary the run; a failure names
//! the seed, the case and the mutation, and writes the frame to the temp directory.

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use ciera::codec::bitmask::MaskCoding;
use ciera::codec::CodecError;
use ciera::codec::{
    bitmask, decode_raw, frame, CacheMode, CacheSlot, FrameChoice, FrameInfo, Mode,
};
use ciera::safetensors::SafeTensors;
use ciera::DType;

#[path = "common/frame_support.rs"]
mod frame_support;
use frame_support::{mask_is_canonical, reseal, section_lens, set_section_lens, slot_at, Rng};

// ---- helpers -------------------------------------------------------------------------------

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

// ---- trace data ------------------------------------------------------------------------------

/// Three consecutive steps of one tensor: (dtype, [x0, x1, x2]).
struct Trajectory {
    name: String,
    dtype: DType,
    steps: [Vec<u8>; 3],
}

fn f32_to_f16(x: u32) -> u16 {
    let sign = ((x >> 16) & 0x8000) as u16;
    let e = ((x >> 23) & 0xff) as i32;
    let m = x & 0x7f_ffff;
    if e == 0xff {
        return sign | 0x7c00 | if m != 0 { 0x200 | (m >> 13) as u16 } else { 0 };
    }
    let e16 = e - 127 + 15;
    if e16 >= 31 {
        sign | 0x7c00
    } else if e16 <= 0 {
        if e16 < -10 {
            sign
        } else {
            sign | ((m | 0x80_0000) >> (14 - e16)) as u16
        }
    } else {
        sign | (e16 as u16) << 10 | (m >> 13) as u16
    }
}

fn trajectories() -> Vec<Trajectory> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/olmoe-slice");
    let mut out = Vec::new();
    for window in [
        [0u32, 1, 2],
        [100, 101, 102],
        [300, 301, 302],
        [597, 598, 599],
    ] {
        let files: Vec<SafeTensors> = window
            .iter()
            .map(|s| {
                SafeTensors::open(&dir.join(format!("step_{s:05}.safetensors")))
                    .expect("bundled trace slice")
            })
            .collect();
        for t in &files[0].tensors {
            let steps: [Vec<u8>; 3] =
                std::array::from_fn(|i| files[i].bytes(files[i].get(&t.name).unwrap()).to_vec());
            if t.dtype == DType::F32 {
                let half: [Vec<u8>; 3] = std::array::from_fn(|i| {
                    steps[i]
                        .chunks_exact(4)
                        .flat_map(|c| {
                            f32_to_f16(u32::from_le_bytes(c.try_into().unwrap())).to_le_bytes()
                        })
                        .collect()
                });
                out.push(Trajectory {
                    name: format!("{}@{}->f16", t.name, window[0]),
                    dtype: DType::F16,
                    steps: half,
                });
            }
            out.push(Trajectory {
                name: format!("{}@{}", t.name, window[0]),
                dtype: t.dtype,
                steps,
            });
        }
    }
    assert!(
        out.len() >= 12,
        "trace slice has {} trajectories",
        out.len()
    );
    out
}

// ---- valid frames and the receiver state they need ----------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// A delta frame to a warm receiver.
    Delta,
    /// A FILL to a cold receiver.
    ColdFill,
    /// A FILL to a warm receiver (the sender lost its cache).
    WarmFill,
    /// A delta frame of a sub-range of the slot (nonzero offset), decoded by that chunk.
    Chunk,
    /// A type the codec does not compress.
    Raw,
}

struct Base {
    desc: String,
    dtype: DType,
    mode: CacheMode,
    choice: FrameChoice,
    len: usize,
    kind: Kind,
    range: Range<usize>,
    rx_version: u64,
    rx_warm: bool,
    /// The receiver's cached values before the frame.
    rx_prev: Vec<u8>,
    frame: Vec<u8>,
    /// What the valid frame decodes to (the chunk's range only, for `Chunk`).
    expect: Vec<u8>,
    /// The next iteration's input (whole slot), for the follow-up check.
    next: Vec<u8>,
}

fn make_base(rng: &mut Rng, trajs: &[Trajectory]) -> Base {
    let kind = [
        Kind::Delta,
        Kind::Delta,
        Kind::Delta,
        Kind::ColdFill,
        Kind::WarmFill,
        Kind::Chunk,
        Kind::Chunk,
        Kind::Raw,
    ][rng.below(8)];
    let t = &trajs[rng.below(trajs.len())];
    let (dtype, steps): (DType, [Vec<u8>; 3]) = if kind == Kind::Raw {
        // Every type the codec does not compress (DType::ALL's order, so the same draws).
        let raw: Vec<DType> = DType::ALL
            .into_iter()
            .filter(|d| !d.is_compressible())
            .collect();
        let d = raw[rng.below(raw.len())];
        // Reinterpret trace bytes: raw types only move bytes.
        (d, t.steps.clone())
    } else {
        (t.dtype, t.steps.clone())
    };
    let size = dtype.size();
    let total = t.steps[0].len() / size;
    let len = match rng.below(10) {
        0 => rng.below(3),
        1 => 64 * (1 + rng.below(8)) + rng.below(3) - 1,
        _ => 1 + rng.below(3000),
    }
    .min(total);
    let start = rng.below(total - len + 1);
    let cut = |v: &Vec<u8>| v[start * size..(start + len) * size].to_vec();
    let [x0, x1, x2] = [cut(&steps[0]), cut(&steps[1]), cut(&steps[2])];
    let mode = [CacheMode::Exponent, CacheMode::FullValue][rng.below(2)];
    let choice = [FrameChoice::Exp, FrameChoice::Hybrid, FrameChoice::Auto][rng.below(3)];
    // Versions from the seed, so a reported case replays exactly.
    let mut tx = CacheSlot::with_version(dtype, mode, len, rng.next());
    tx.set_frame_choice(choice);
    let mut f0 = Vec::new();
    tx.encode(&x0, &mut f0).unwrap();
    let (mut rx_version, mut rx_warm, mut rx_prev) = (tx.version(), tx.is_warm(), x0.clone());
    let mut frame = Vec::new();
    let mut range = 0..len;
    match kind {
        Kind::Delta | Kind::Raw => {
            tx.encode(&x1, &mut frame).unwrap();
        }
        Kind::ColdFill => {
            let mut cold = CacheSlot::with_version(dtype, mode, len, rng.next());
            cold.set_frame_choice(choice);
            cold.encode(&x1, &mut frame).unwrap();
            rx_version = rng.next();
            rx_warm = false;
            rx_prev = vec![0; x0.len()];
        }
        Kind::WarmFill => {
            // The sender lost its slot (as after `poison`, at a fresh version) and refills.
            let mut fresh = CacheSlot::with_version(dtype, mode, len, rng.next());
            fresh.set_frame_choice(choice);
            fresh.encode(&x1, &mut frame).unwrap();
        }
        Kind::Chunk => {
            let a = rng.below(len + 1);
            let b = a + rng.below(len - a + 1);
            range = a..b;
            tx.chunk(range.clone())
                .encode(&x1[a * size..b * size], &mut frame)
                .unwrap();
        }
    }
    if !dtype.is_compressible() {
        rx_warm = false;
    }
    let expect = x1[range.start * size..range.end * size].to_vec();
    let info = frame::parse(&frame).unwrap();
    Base {
        desc: format!("{kind:?} {} as {dtype:?} {mode:?} {choice:?} len {len} range {range:?} ({} frame, {} bytes)", t.name, info.mode.name(), frame.len()),
        dtype,
        mode,
        choice,
        len,
        kind,
        range,
        rx_version,
        rx_warm: rx_warm && dtype.is_compressible(),
        rx_prev,
        frame,
        expect,
        next: x2,
    }
}

// ---- decoding a (damaged) frame ----------------------------------------------------------------

struct Decoded {
    result: Result<FrameInfo, CodecError>,
    out: Vec<u8>,
    rx: CacheSlot,
}

fn decode_on_copy(b: &Base, bytes: &[u8]) -> Decoded {
    let mut rx = slot_at(
        b.dtype,
        b.mode,
        b.choice,
        b.len,
        b.rx_version,
        b.rx_warm,
        &b.rx_prev,
    );
    let size = b.dtype.size();
    let mut out = vec![0xC3u8; b.range.len() * size];
    let result = if b.kind == Kind::Chunk {
        let r = frame::parse(bytes).and_then(|p| rx.chunk(b.range.clone()).decode(&p, &mut out));
        if r.is_err() {
            rx.poison();
        }
        r
    } else {
        rx.decode(bytes, &mut out)
    };
    Decoded { result, out, rx }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Class {
    /// Err, or Ok with exactly the original output.
    Strict,
    /// Any outcome, but an Ok must leave a consistent slot.
    Consistent,
}

/// The receiver's slot after an Ok must be what it reported: the decoded values at its version.
/// A sender in exactly that state sends the next iteration; it must come through exactly.
fn follow_up(b: &Base, d: &mut Decoded) -> Result<(), String> {
    if b.kind == Kind::Chunk || !d.rx.is_warm() {
        return Ok(());
    }
    let mut tx = slot_at(
        b.dtype,
        b.mode,
        b.choice,
        b.len,
        d.rx.version(),
        true,
        &d.out,
    );
    let mut f = Vec::new();
    tx.encode(&b.next, &mut f)
        .map_err(|e| format!("follow-up encode: {e}"))?;
    let mut out = vec![0u8; b.next.len()];
    match d.rx.decode(&f, &mut out) {
        Ok(_) if out == b.next => Ok(()),
        Ok(_) => Err(
            "follow-up frame decoded to other values: the slot disagrees with what it reported"
                .into(),
        ),
        Err(e) => Err(format!("follow-up frame refused: {e}")),
    }
}

/// An accepted delta frame must be the canonical coding of what it decoded to: a sender in the
/// receiver's prior state, sending the same mode, produces the same s0 and exponent bytes and
/// masks with the same bits (the mask codings may differ: each coding is a valid choice). So
/// no accepted frame carries a non-zero padding bit, an exception that repeats the cached
/// exponent, or a "changed" value equal to the cached one.
fn canonical(b: &Base, bytes: &[u8], info: &FrameInfo, out: &[u8]) -> Result<(), String> {
    if info.mode == Mode::Raw {
        return Ok(());
    }
    let choice = if info.mode == Mode::Exp {
        FrameChoice::Exp
    } else {
        FrameChoice::Hybrid
    };
    let mut tx = slot_at(
        b.dtype,
        b.mode,
        choice,
        b.len,
        info.version,
        true,
        &b.rx_prev,
    );
    let mut f = Vec::new();
    let tinfo = tx
        .chunk(b.range.clone())
        .encode(out, &mut f)
        .map_err(|e| format!("canonical encode: {e}"))?;
    if tinfo.mode == Mode::Raw {
        // The encoder sends a FILL where its delta would be longer than the values; such a
        // delta is still a valid frame to accept, but there is no canonical one to compare.
        return Ok(());
    }
    if tinfo.mode != info.mode
        || (tinfo.exp_changes, tinfo.value_changes) != (info.exp_changes, info.value_changes)
    {
        return Err(format!(
            "accepted {info:?}; the canonical frame for its output is {tinfo:?}"
        ));
    }
    let (p, q) = (frame::parse(bytes).unwrap(), frame::parse(&f).unwrap());
    let mask_sections: &[usize] = if info.mode == Mode::Exp {
        &[1]
    } else {
        &[1, 2]
    };
    for i in 0..4 {
        if mask_sections.contains(&i) {
            let m = if i == 1 {
                b.range.len()
            } else {
                info.value_changes.unwrap()
            };
            let (mut x, mut y) = (Vec::new(), Vec::new());
            let _ = bitmask::decode(p.sections[i], m, &mut x);
            let _ = bitmask::decode(q.sections[i], m, &mut y);
            if x != y {
                return Err(format!(
                    "accepted frame's mask s{i} differs from the canonical one"
                ));
            }
            mask_is_canonical(p.sections[i], m, &x)
                .map_err(|e| format!("accepted frame's mask s{i}: {e}"))?;
        } else if p.sections[i] != q.sections[i] {
            return Err(format!(
                "accepted frame's s{i} differs from the canonical coding of its output"
            ));
        }
    }
    Ok(())
}

/// Decode `bytes` on a copy of `b`'s receiver and check `class`; never panics (a panic in the
/// decoder is caught and reported as a failure).
fn check(b: &Base, bytes: &[u8], class: Class, what: &str) -> Result<bool, String> {
    let r = catch_unwind(AssertUnwindSafe(|| {
        let mut d = decode_on_copy(b, bytes);
        match &d.result {
            Err(_) => return Ok(false),
            Ok(info) => {
                if class == Class::Strict && d.out != b.expect {
                    return Err(format!(
                        "accepted with different output ({:?} frame)",
                        info.mode
                    ));
                }
                if info.count != b.range.len() || info.dtype != b.dtype {
                    return Err(format!("accepted with info {info:?}"));
                }
                canonical(b, bytes, info, &d.out)?;
            }
        }
        follow_up(b, &mut d).map(|_| true)
    }));
    match r {
        Ok(Ok(ok)) => Ok(ok),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            Err(format!(
                "{what}: decoder PANICKED: {}",
                msg.unwrap_or_default()
            ))
        }
    }
}

// ---- mutations ---------------------------------------------------------------------------------

/// Damage that the checksums (or the structure) must catch, or that leaves the frame intact.
fn mutate_raw(rng: &mut Rng, f: &[u8]) -> (String, Vec<u8>) {
    let mut g = f.to_vec();
    let n = g.len();
    let d = match rng.below(10) {
        0 => {
            let k = 1 + rng.below(8);
            for _ in 0..k {
                let at = rng.below(n);
                g[at] ^= 1 << rng.below(8);
            }
            format!("flip {k} bits")
        }
        1 => {
            let at = rng.below(64.min(n));
            g[at] ^= 1 << rng.below(8);
            format!("flip a header bit in byte {at}")
        }
        2 => {
            let at = rng.below(n);
            g[at] = rng.next() as u8;
            format!("set byte {at}")
        }
        3 => {
            let l = rng.below(n);
            g.truncate(l);
            format!("truncate to {l}")
        }
        4 => {
            let k = 1 + rng.below(100);
            g.extend(rng.bytes(k));
            format!("append {k} bytes")
        }
        5 => {
            let (a, b) = (rng.below(n), rng.below(n));
            g.swap(a, b);
            format!("swap bytes {a} {b}")
        }
        6 => {
            let a = rng.below(n);
            let b = (a + 1 + rng.below(16)).min(n);
            for x in &mut g[a..b] {
                *x = rng.next() as u8;
            }
            format!("overwrite {a}..{b}")
        }
        7 => {
            let at = rng.below(n + 1);
            g.insert(at, rng.next() as u8);
            format!("insert a byte at {at}")
        }
        8 => {
            let at = rng.below(n);
            g.remove(at);
            format!("delete byte {at}")
        }
        _ => {
            let a = rng.below(n);
            let b = (a + 1 + rng.below(64)).min(n);
            g[a..b].fill(0);
            format!("zero {a}..{b}")
        }
    };
    (d, g)
}

/// Structural edits, resealed: the frame means something else or nothing; it must not decode
/// to anything but the original.
fn mutate_structure(rng: &mut Rng, f: &[u8]) -> (String, Vec<u8>) {
    let mut g = f.to_vec();
    let mut s = section_lens(&g);
    let h = frame::HEADER_LEN;
    let d = match rng.below(8) {
        0 => {
            // Move a boundary: the bytes stay, the sections they belong to change.
            let i = rng.below(4);
            let j = (i + 1 + rng.below(3)) % 4;
            let k = (1 + rng.below(8)).min(s[i]);
            s[i] -= k;
            s[j] += k;
            set_section_lens(&mut g, s);
            format!("move {k} bytes of length from s{i} to s{j}")
        }
        1 => {
            // Grow or shrink one section in place, keeping the others intact.
            let i = rng.below(4);
            let end = h + s[..=i].iter().sum::<usize>();
            if rng.below(2) == 0 || s[i] == 0 {
                let k = 1 + rng.below(8);
                let fill = rng.bytes(k);
                g.splice(end..end, fill);
                s[i] += k;
                set_section_lens(&mut g, s);
                format!("grow s{i} by {k}")
            } else {
                let k = (1 + rng.below(8)).min(s[i]);
                g.drain(end - k..end);
                s[i] -= k;
                set_section_lens(&mut g, s);
                format!("shrink s{i} by {k}")
            }
        }
        2 => {
            let c = u64::from_le_bytes(g[8..16].try_into().unwrap());
            let nc = [
                c.wrapping_add(1),
                c.wrapping_sub(1),
                c * 2,
                rng.next() % 100_000,
                0,
            ][rng.below(5)];
            g[8..16].copy_from_slice(&nc.to_le_bytes());
            format!("count {c} -> {nc}")
        }
        3 => {
            let o = u64::from_le_bytes(g[16..24].try_into().unwrap());
            let no = [o.wrapping_add(1), o.wrapping_sub(1), rng.next() % 4096][rng.below(3)];
            g[16..24].copy_from_slice(&no.to_le_bytes());
            format!("offset {o} -> {no}")
        }
        4 => {
            let v = u64::from_le_bytes(g[24..32].try_into().unwrap());
            let nv = [v.wrapping_add(1), v.wrapping_sub(1), rng.next()][rng.below(3)];
            g[24..32].copy_from_slice(&nv.to_le_bytes());
            format!("version {v} -> {nv}")
        }
        5 => {
            let at = [5usize, 6, 7][rng.below(3)];
            let old = g[at];
            g[at] = match rng.below(3) {
                0 => old ^ 1,
                1 => rng.below(16) as u8,
                _ => rng.next() as u8,
            };
            format!("header byte {at} {old} -> {}", g[at])
        }
        6 => {
            let at = rng.below(5);
            g[at] ^= 1 << rng.below(8);
            format!("magic/format byte {at}")
        }
        _ => {
            // Swap two sections (contents and lengths).
            let (i, j) = (rng.below(4), rng.below(4));
            let mut secs: Vec<Vec<u8>> = Vec::new();
            let mut pos = h;
            for l in s {
                secs.push(g[pos..pos + l].to_vec());
                pos += l;
            }
            secs.swap(i, j);
            s.swap(i, j);
            g.truncate(h);
            for sec in secs {
                g.extend(sec);
            }
            set_section_lens(&mut g, s);
            format!("swap sections s{i} s{j}")
        }
    };
    reseal(&mut g);
    (d, g)
}

/// Content edits inside the sections, resealed: the deep decoders see bytes the checksums
/// vouch for.
fn mutate_content(rng: &mut Rng, f: &[u8]) -> Option<(String, Vec<u8>)> {
    let mut g = f.to_vec();
    let s = section_lens(&g);
    let nonempty: Vec<usize> = (0..4).filter(|&i| s[i] > 0).collect();
    if nonempty.is_empty() {
        return None;
    }
    let i = nonempty[rng.below(nonempty.len())];
    let start = frame::HEADER_LEN + s[..i].iter().sum::<usize>();
    let d = match rng.below(4) {
        0 => {
            let at = start + rng.below(s[i]);
            g[at] ^= 1 << rng.below(8);
            format!("flip a bit of s{i} at {at}")
        }
        1 => {
            let at = start + rng.below(s[i]);
            g[at] = rng.next() as u8;
            format!("set s{i} byte {at}")
        }
        2 => {
            // The first byte of a mask section is its coding.
            g[start] = rng.below(5) as u8;
            format!("s{i} first byte -> {}", g[start])
        }
        _ => {
            let k = 1 + rng.below(4);
            for _ in 0..k {
                let at = start + rng.below(s[i]);
                g[at] ^= 1 << rng.below(8);
            }
            format!("flip {k} bits of s{i}")
        }
    };
    reseal(&mut g);
    Some((d, g))
}

fn report(seed: u64, case: usize, b: &Base, g: &[u8], msg: String) -> String {
    let path = std::env::temp_dir().join(format!("ciera-corrupt-{seed}-{case}.bin"));
    let _ = std::fs::write(&path, g);
    format!(
        "seed {seed} case {case}: {}\n  {msg}\n  frame written to {}",
        b.desc,
        path.display()
    )
}

// ---- the tests ---------------------------------------------------------------------------------

#[test]
fn damaged_trace_frames_are_refused_or_exact() {
    let seed = env_u64("CIERA_CORRUPT_SEED", 0xC0FFEE);
    let scale = env_u64("CIERA_CORRUPT_SCALE", 1) as usize;
    let trajs = trajectories();
    let mut rng = Rng(seed);
    let mut failures = Vec::new();
    let (mut decodes, mut accepted) = (0usize, [0usize; 3]);
    for case in 0..1000 * scale {
        let b = make_base(&mut rng, &trajs);
        // The valid frame itself decodes exactly.
        if let Err(e) = check(&b, &b.frame, Class::Strict, "valid frame") {
            failures.push(report(seed, case, &b, &b.frame, e));
            continue;
        }
        let d = decode_on_copy(&b, &b.frame);
        assert!(
            d.result.is_ok() && d.out == b.expect,
            "{}: valid frame",
            b.desc
        );
        for _ in 0..8 {
            let (what, g) = mutate_raw(&mut rng, &b.frame);
            decodes += 1;
            match check(&b, &g, Class::Strict, &what) {
                Ok(ok) => accepted[0] += ok as usize,
                Err(e) => failures.push(report(seed, case, &b, &g, e)),
            }
        }
        for _ in 0..6 {
            let (what, g) = mutate_structure(&mut rng, &b.frame);
            decodes += 1;
            match check(&b, &g, Class::Strict, &what) {
                Ok(ok) => accepted[1] += ok as usize,
                Err(e) => failures.push(report(seed, case, &b, &g, e)),
            }
        }
        for _ in 0..6 {
            let Some((what, g)) = mutate_content(&mut rng, &b.frame) else {
                break;
            };
            decodes += 1;
            match check(&b, &g, Class::Consistent, &what) {
                Ok(ok) => accepted[2] += ok as usize,
                Err(e) => failures.push(report(seed, case, &b, &g, e)),
            }
        }
        if failures.len() > 20 {
            break;
        }
    }
    eprintln!(
        "{decodes} damaged frames decoded; accepted: {} of the checksum-caught damage (intact or trailing bytes), \
         {} structural edits, {} content edits",
        accepted[0], accepted[1], accepted[2]
    );
    assert!(
        failures.is_empty(),
        "{} failure(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A flat-coded mask (coding 1, then the bits LSB first).
fn flat(bits: &[bool]) -> Vec<u8> {
    let mut b = vec![0u8; 1 + bits.len().div_ceil(8)];
    b[0] = 1;
    for (i, &x) in bits.iter().enumerate() {
        b[1 + i / 8] |= (x as u8) << (i % 8);
    }
    b
}

/// rANS blocks and coded masks on their own: damaged blocks are refused or, if accepted, are
/// the canonical coding of what they decode to (with the block's own table).
#[test]
fn damaged_masks_are_refused_or_canonical() {
    let mut rng = Rng(env_u64("CIERA_CORRUPT_SEED", 0x3A5C));
    let scale = env_u64("CIERA_CORRUPT_SCALE", 1) as usize;
    let mut accepted = 0;
    for case in 0..3000 * scale {
        let m = [1usize, 7, 8, 63, 64, 65, 200, 512, 1000, 4096][rng.below(10)];
        let density = [1u64, 8, 32, 128, 255][rng.below(5)];
        let mut words = vec![0u64; m.div_ceil(64)];
        for i in 0..m {
            if (rng.next() & 255) < density {
                words[i / 64] |= 1 << (i % 64);
            }
        }
        let ones: u32 = words.iter().map(|w| w.count_ones()).sum();
        let coding = if ones == 0 {
            MaskCoding::Zero
        } else {
            [MaskCoding::Flat, MaskCoding::Hier, MaskCoding::Rans][rng.below(3)]
        };
        let mut enc = Vec::new();
        bitmask::encode(&words, m, coding, &mut enc);
        let mut g = enc.clone();
        let g_words = m.div_ceil(64);
        if coding == MaskCoding::Hier && !g_words.is_multiple_of(8) && rng.below(4) == 0 {
            // A level-1 bit for a word past the end, with a level-2 byte for it where the
            // decoder would look: must be refused, not skipped.
            let l1_len = g_words.div_ceil(8);
            let nz: usize = g[1..1 + l1_len]
                .iter()
                .map(|b| b.count_ones() as usize)
                .sum();
            g[l1_len] |= 1 << (g_words % 8);
            g.insert(1 + l1_len + nz, 1 + rng.below(255) as u8);
        }
        match rng.below(5) {
            4 => {}
            0 => {
                let at = rng.below(g.len());
                g[at] ^= 1 << rng.below(8);
            }
            1 => {
                let at = rng.below(g.len());
                g[at] = rng.next() as u8;
            }
            2 => {
                let at = 1 + rng.below(g.len());
                g.insert(at.min(g.len()), rng.next() as u8);
            }
            _ => {
                if g.len() > 1 {
                    let at = 1 + rng.below(g.len() - 1);
                    g.remove(at);
                }
            }
        }
        let r = catch_unwind(AssertUnwindSafe(|| {
            let mut back = Vec::new();
            match bitmask::decode(&g, m, &mut back) {
                Ok(n) => {
                    assert_eq!(
                        n,
                        back.iter().map(|w| w.count_ones() as usize).sum::<usize>()
                    );
                    mask_is_canonical(&g, m, &back).map(|_| 1)
                }
                Err(_) => Ok(0),
            }
        }));
        match r {
            Ok(Ok(n)) => accepted += n,
            Ok(Err(e)) => panic!(
                "case {case}: {coding:?} mask of {m} bits, damaged {:02x?}: {e}",
                g
            ),
            Err(_) => panic!("case {case}: mask decoder panicked on {:02x?} (m = {m})", g),
        }
    }
    eprintln!(
        "{} damaged masks, {accepted} accepted (all canonical)",
        3000 * scale
    );
}

/// Arbitrary bytes, and arbitrary bytes behind a plausible resealed header, against random slots.
#[test]
fn arbitrary_bytes_are_refused_without_panicking() {
    let seed = env_u64("CIERA_CORRUPT_SEED", 0xBAD5EED);
    let scale = env_u64("CIERA_CORRUPT_SCALE", 1) as usize;
    let mut rng = Rng(seed);
    let mut oks = 0;
    for case in 0..8000 * scale {
        let dtype = DType::ALL[rng.below(12)];
        let mode = [CacheMode::Exponent, CacheMode::FullValue][rng.below(2)];
        let len = [0, 1, 7, 64, 65, 300][rng.below(6)];
        let warm = rng.below(2) == 0;
        let prev = rng.bytes(len * dtype.size());
        let version = rng.next() % 4;
        let mut g = if case % 4 == 0 {
            let n = rng.below(200);
            rng.bytes(n)
        } else if case % 4 == 1 {
            // A frame laid out as the format says for this slot, with random contents.
            let size = dtype.size();
            let sm_len = match dtype {
                DType::BF16 => len,
                DType::F16 => len + (3 * len).div_ceil(8),
                DType::F32 => 3 * len,
                _ => len * size,
            };
            let mode = if dtype.is_compressible() {
                rng.below(3) as u8
            } else {
                0
            };
            let mut secs: [Vec<u8>; 4] = Default::default();
            match mode {
                0 => secs[0] = rng.bytes(len * size),
                1 => {
                    secs[0] = rng.bytes(sm_len);
                    let bits: Vec<bool> = (0..len).map(|_| rng.below(8) == 0).collect();
                    let ones = bits.iter().filter(|&&b| b).count();
                    secs[1] = if ones == 0 { vec![0] } else { flat(&bits) };
                    secs[2] = rng.bytes(ones);
                }
                _ => {
                    let changed: Vec<bool> = (0..len).map(|_| rng.below(3) == 0).collect();
                    let k = changed.iter().filter(|&&b| b).count();
                    let sub: Vec<bool> = (0..k).map(|_| rng.below(4) == 0).collect();
                    let ke = sub.iter().filter(|&&b| b).count();
                    secs[0] = rng.bytes(match dtype {
                        DType::BF16 => k,
                        DType::F16 => k + (3 * k).div_ceil(8),
                        _ => 3 * k,
                    });
                    secs[1] = if k == 0 { vec![0] } else { flat(&changed) };
                    secs[2] = if ke == 0 { vec![0] } else { flat(&sub) };
                    secs[3] = rng.bytes(ke);
                }
            }
            let mut g = vec![0u8; frame::HEADER_LEN];
            g[0..4].copy_from_slice(b"CIRF");
            g[4] = 1;
            g[5] = dtype.code();
            g[6] = mode;
            g[7] = (mode == 0 && rng.below(2) == 0) as u8;
            g[8..16].copy_from_slice(&(len as u64).to_le_bytes());
            g[24..32].copy_from_slice(&version.to_le_bytes());
            set_section_lens(
                &mut g,
                [secs[0].len(), secs[1].len(), secs[2].len(), secs[3].len()],
            );
            for sec in secs {
                g.extend(sec);
            }
            reseal(&mut g);
            g
        } else {
            // A header this slot could take, random sections.
            let mut g = rng.bytes(frame::HEADER_LEN);
            g[0..4].copy_from_slice(b"CIRF");
            g[4] = 1;
            g[5] = if rng.below(8) == 0 {
                rng.next() as u8
            } else {
                dtype.code()
            };
            g[6] = rng.below(4) as u8;
            g[7] = [0, 0, 1, rng.next() as u8][rng.below(4)];
            g[8..16].copy_from_slice(
                &(if rng.below(8) == 0 {
                    rng.next() % 1000
                } else {
                    len as u64
                })
                .to_le_bytes(),
            );
            g[16..24].copy_from_slice(&0u64.to_le_bytes());
            g[24..32].copy_from_slice(&version.to_le_bytes());
            let s: [usize; 4] = std::array::from_fn(|_| {
                [0, 1, 2, 3, 8, rng.below(64), len * dtype.size()][rng.below(7)]
            });
            set_section_lens(&mut g, s);
            let body = rng.bytes(s.iter().sum());
            g.extend(body);
            if rng.below(4) != 0 {
                // A coding byte the mask decoder knows, at the start of s1 and s2.
                let h = frame::HEADER_LEN;
                if s[1] > 0 {
                    g[h + s[0]] = rng.below(4) as u8;
                }
                if s[2] > 0 {
                    g[h + s[0] + s[1]] = rng.below(4) as u8;
                }
            }
            reseal(&mut g);
            g
        };
        if rng.below(10) == 0 && !g.is_empty() {
            let at = rng.below(g.len());
            g[at] ^= 1;
        }
        let r = catch_unwind(AssertUnwindSafe(|| {
            let mut rx = slot_at(dtype, mode, FrameChoice::Auto, len, version, warm, &prev);
            let mut out = vec![0u8; len * dtype.size()];
            let r = rx.decode(&g, &mut out);
            if let Ok(info) = &r {
                // Only a frame that fits this slot can be taken.
                assert_eq!((info.dtype, info.count, info.offset), (dtype, len, 0));
                assert!(info.mode == Mode::Raw || rx.is_warm());
            } else {
                assert!(!rx.is_warm(), "a refused frame poisons the slot");
            }
            // The cache-free decoder too, whatever count the header claims.
            if let Ok(p) = frame::parse(&g) {
                let mut o = vec![0u8; p.count.saturating_mul(p.dtype.size()).min(1 << 24)];
                if let Ok(info) = decode_raw(&g, &mut o) {
                    assert_eq!((info.count, &o[..]), (p.count, p.sections[0]));
                }
            }
            r.is_ok()
        }));
        match r {
            Ok(ok) => oks += ok as usize,
            Err(_) => panic!(
                "seed {seed} case {case}: decoder panicked on {} bytes: {:02x?}",
                g.len(),
                &g[..g.len().min(128)]
            ),
        }
    }
    eprintln!(
        "{} arbitrary frames, {oks} accepted (valid by construction)",
        8000 * scale
    );
}

/// The error each refusal reports names the failed check.
#[test]
fn damage_reports_a_codec_error() {
    let trajs = trajectories();
    let mut rng = Rng(7);
    for _ in 0..50 {
        let b = make_base(&mut rng, &trajs);
        let mut g = b.frame.clone();
        let last = g.len() - 1;
        g[last] ^= 0x40;
        let d = decode_on_copy(&b, &g);
        match d.result {
            Err(CodecError::Checksum { .. }) => {}
            other => panic!("{}: last byte flipped: {other:?}", b.desc),
        }
        let d = decode_on_copy(&b, &b.frame[..b.frame.len() - 1]);
        assert!(
            matches!(d.result, Err(CodecError::LengthMismatch { .. })),
            "{}: truncated: {:?}",
            b.desc,
            d.result
        );
        let d = decode_on_copy(&b, &b.frame[..10.min(b.frame.len())]);
        assert!(
            matches!(d.result, Err(CodecError::LengthMismatch { .. })),
            "{}: 10 bytes: {:?}",
            b.desc,
            d.result
        );
        let mut g = b.frame.clone();
        g[0] = b'X';
        assert!(matches!(
            decode_on_copy(&b, &g).result,
            Err(CodecError::CorruptFrame { what: "magic", .. })
        ));
        let mut g = b.frame.clone();
        g[4] = 2;
        reseal(&mut g);
        assert!(matches!(
            decode_on_copy(&b, &g).result,
            Err(CodecError::CorruptFrame {
                what: "format version",
                ..
            })
        ));
    }
}

/// A raw frame WITHOUT the FILL flag for a compressible type (which no encoder produces) would
/// advance the version but leave the cache at the previous values while the sender's was
/// refilled; the next delta would decode against stale values. It must be refused.
#[test]
fn raw_frame_without_fill_leaves_no_stale_cache() {
    let dtype = DType::BF16;
    let (x0, x1) = (vec![0x80, 0x3F, 0x80, 0x3F], vec![0x00, 0x40, 0x80, 0x3F]); // 1.0 1.0 -> 2.0 1.0
    let mut tx = CacheSlot::new(dtype, CacheMode::Exponent, 2);
    let mut rx = CacheSlot::new(dtype, CacheMode::Exponent, 2);
    let (mut f, mut out) = (Vec::new(), vec![0u8; 4]);
    tx.encode(&x0, &mut f).unwrap();
    rx.decode(&f, &mut out).unwrap();
    // The sender lost its cache and refills; the frame reaches the receiver without FILL.
    tx.poison();
    f.clear();
    tx.encode(&x1, &mut f).unwrap();
    f[7] = 0;
    reseal(&mut f);
    let first = rx.decode(&f, &mut out);
    // Next iteration: nothing changes, so the sender sends an exp frame with no exceptions.
    f.clear();
    tx.encode(&x1, &mut f).unwrap();
    let second = rx.decode(&f, &mut out);
    assert!(
        first.is_err() || second.is_err() || out == x1,
        "silently wrong: decoded {out:02x?}, sent {x1:02x?} (first {first:?})"
    );
}

/// decode_raw (no cache slot): a small resealed frame claiming 2^63 elements must be refused,
/// not panic on capacity overflow or abort on a failed allocation.
#[test]
fn decode_raw_refuses_a_huge_count() {
    // 2^63 overflowed a capacity (a panic); 2^40 failed an allocation (an abort); u64::MAX
    // overflows count x size.
    for count in [1u64 << 63, 1 << 40, u64::MAX, 3] {
        for dtype in [DType::BF16, DType::F32, DType::I64] {
            let mut src = CacheSlot::new(dtype, CacheMode::Exponent, 2);
            let mut f = Vec::new();
            src.encode(&vec![7u8; 2 * dtype.size()], &mut f).unwrap();
            f[8..16].copy_from_slice(&count.to_le_bytes());
            reseal(&mut f);
            let mut out = vec![0u8; 2 * dtype.size()];
            let r = catch_unwind(AssertUnwindSafe(|| decode_raw(&f, &mut out).map(|_| ())));
            assert!(
                matches!(r, Ok(Err(_))),
                "decode_raw of a {dtype:?} frame of 2 values claiming {count}: {r:?}"
            );
        }
    }
}
