//! A valid frame (Exp, Hybrid, Delta or FILL; a Delta frame may be the second, against the
//! contexts the first left) of fuzzer-chosen data, then fuzzer-chosen damage, decoded against a
//! copy of the receiver. The body and its input layout: `ciera_fuzz::decode_mutated`.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ciera_fuzz::decode_mutated(data);
});
