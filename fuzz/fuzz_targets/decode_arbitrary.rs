//! Arbitrary bytes decoded against a cache slot whose state (type, mode, length, version,
//! warm or cold, cached values) is also taken from the input. No input may panic; a frame
//! that is accepted must be the canonical coding of its output and leave the slot consistent.
//!
//! Input: dtype, flags, len (u16), version (u8), the cached values, then the frame. Flags bit 2
//! reseals the frame's checksums; bit 3 builds its header from the next input bytes (so the
//! fuzzer reaches the section decoders without learning the magic and the hashes).

#![no_main]

use ciera::codec::{decode_raw, frame};
use ciera_fuzz::*;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut inp = Input(data);
    let dtype = DTYPES[inp.u8() as usize % DTYPES.len()];
    let flags = inp.u8();
    let mode = MODES[(flags & 1) as usize];
    let warm = flags & 2 != 0;
    let choice = CHOICES[(flags >> 4) as usize % 3];
    let len = inp.u16() as usize % 1025;
    let version = inp.u8() as u64;
    let size = dtype.size();
    let prev = inp.bytes(len * size);
    let mut f = Vec::new();
    if flags & 8 != 0 {
        f.extend_from_slice(b"CIRF");
        f.push(1);
        f.push(if inp.u8() < 240 { dtype.code() } else { inp.u8() });
        f.push(inp.u8() % 4);
        f.push(inp.u8() % 3);
        let count = if inp.u8() < 240 { len as u64 } else { inp.u16() as u64 };
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
            let before = Before { dtype, mode, choice, len, prev: &prev };
            if warm && dtype.is_compressible() {
                assert_canonical(&before, &f, &info, &out);
            }
            let next: Vec<u8> = out.iter().enumerate().map(|(i, &b)| if i % 7 == 0 { b ^ 1 } else { b }).collect();
            assert_consistent(&before, &mut rx, &out, &next);
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
});
