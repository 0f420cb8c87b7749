//! Arbitrary bytes decoded against a cache slot whose state (type, mode (exponent, full-value or
//! delta), length, version, warm or cold, cached values) is also taken from the input. No input
//! may panic; a frame that is accepted must be the canonical coding of its output and leave
//! the slot consistent. The body and its input layout: `ciera_fuzz::decode_arbitrary`.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| ciera_fuzz::decode_arbitrary(data));
