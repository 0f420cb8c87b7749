//! `ciera launch` (in progress).

pub fn main(_args: &[String]) -> i32 {
    eprintln!("ciera launch: not built yet");
    2
}
