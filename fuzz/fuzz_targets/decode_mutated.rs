//! A valid frame of fuzzer-chosen data, then fuzzer-chosen damage, decoded against a copy of
//! the receiver: damage the checksums should catch, or structural header edits resealed, must
//! give Err or exactly the original values; content edits resealed may decode to other values
//! but the frame must then be canonical and the slot consistent. Never a panic.
//!
//! Input: dtype (bf16/fp16/fp32), flags (cache mode, frame choice, frame kind), len (u16),
//! the previous values, one change byte per element, then up to 8 mutations of 4 bytes
//! (op, position u16, value).

#![no_main]

use ciera::codec::{frame, CacheSlot};
use ciera::DType;
use ciera_fuzz::*;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut inp = Input(data);
    let dtype = [DType::BF16, DType::F16, DType::F32][inp.u8() as usize % 3];
    let flags = inp.u8();
    let mode = MODES[(flags & 1) as usize];
    let choice = CHOICES[(flags >> 1) as usize % 3];
    let kind = (flags >> 3) % 3; // 0 delta, 1 FILL to a cold slot, 2 FILL to a warm slot
    let len = inp.u16() as usize % 2049;
    let size = dtype.size();
    let x0 = inp.bytes(len * size);
    let changes = inp.bytes(len);
    let exp_shift: u32 = match dtype {
        DType::BF16 => 7,
        DType::F16 => 10,
        _ => 23,
    };
    let mut x1 = x0.clone();
    for (i, &c) in changes.iter().enumerate() {
        let mut w = [0u8; 4];
        w[..size].copy_from_slice(&x0[i * size..(i + 1) * size]);
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
        x1[i * size..(i + 1) * size].copy_from_slice(&v.to_le_bytes()[..size]);
    }

    let mut tx = CacheSlot::new(dtype, mode, len);
    tx.set_frame_choice(choice);
    let mut f = Vec::new();
    tx.encode(&x0, &mut f).unwrap();
    let (mut version, mut warm, mut prev) = (tx.version(), true, x0.clone());
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
        _ => {
            tx.poison();
            tx.encode(&x1, &mut f).unwrap();
        }
    }

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
            // Header fields, resealed: count, offset, version, dtype/mode/flags, section lengths.
            6..=8 if g.len() >= frame::HEADER_LEN => {
                let field = [8usize, 16, 24, 5, 6, 7, 32, 36, 40, 44][pos % 10];
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

    let mut rx = slot_at(dtype, mode, choice, len, version, warm, &prev);
    let mut out = vec![0u8; len * size];
    match rx.decode(&g, &mut out) {
        Ok(info) => {
            if strict {
                assert!(out == x1, "damaged frame accepted with other values");
            }
            let before = Before { dtype, mode, choice, len, prev: &prev };
            if warm {
                assert_canonical(&before, &g, &info, &out);
            }
            let next = x0;
            assert_consistent(&before, &mut rx, &out, &next);
        }
        Err(_) => assert!(!rx.is_warm()),
    }
});
