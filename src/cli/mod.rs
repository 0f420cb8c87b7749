//! The `ciera` command: `analyze`, `perf`, `launch`, `sim`. Each subcommand takes its arguments
//! (without the program and subcommand names) and returns the process exit code.
#![forbid(unsafe_code)]

pub mod analyze;
pub mod args;
pub mod launch;
pub mod perf;
pub mod perf_trace;
pub mod ranks;
pub mod sim;
