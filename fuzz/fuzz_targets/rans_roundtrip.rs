//! rANS and the coded masks: any byte string round-trips through rANS with its own frequency
//! table; any mask round-trips through every coding; and arbitrary bytes decoded as a rANS block
//! or a coded mask never panic (and, when accepted, re-encode in that coding to the same bytes
//! where the coding is deterministic).

#![no_main]

use ciera::codec::bitmask::{self, MaskCoding};
use ciera::codec::rans;
use ciera_fuzz::{assert_mask_canonical, rans_table, Input};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut inp = Input(data);
    let sel = inp.u8();
    let body = inp.rest();
    match sel % 3 {
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
            let codings: &[MaskCoding] =
                if ones == 0 { &[MaskCoding::Zero] } else { &[MaskCoding::Flat, MaskCoding::Hier, MaskCoding::Rans] };
            for &c in codings {
                let mut enc = Vec::new();
                bitmask::encode(&words, m, c, &mut enc);
                let mut back = Vec::new();
                let n = bitmask::decode(&enc, m, &mut back).unwrap_or_else(|e| panic!("{c:?}: {e}"));
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
                assert_eq!(ones, words.iter().map(|w| w.count_ones() as usize).sum::<usize>());
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
});
