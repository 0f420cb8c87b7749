//! `ciera perf` (in progress).

pub fn main(_args: &[String]) -> i32 {
    eprintln!("ciera perf: not built yet");
    2
}
