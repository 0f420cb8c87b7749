//! A test that cannot run here says so in `cargo test`'s normal output: libtest captures what
//! the print macros write, not writes to the stderr handle, so the reason shows without
//! `--nocapture` (as "SKIPPED <test>: <reason>" above the test's `ok`).
#![allow(dead_code)]

use std::io::Write;

/// Report that `test` did nothing here, and why.
pub fn skip(test: &str, reason: &str) {
    let line = format!("SKIPPED {test}: {reason}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// Show `text` in `cargo test`'s normal output, as [`skip`] does (a table a test printed).
pub fn show(text: &str) {
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}
