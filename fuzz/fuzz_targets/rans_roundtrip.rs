//! rANS and the coded masks: round trips, and arbitrary bytes decoded as a rANS block or a coded
//! mask never panic. The body: `ciera_fuzz::rans_roundtrip`.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| ciera_fuzz::rans_roundtrip(data));
