//! `ciera analyze` (in progress).

pub fn main(_args: &[String]) -> i32 {
    eprintln!("ciera analyze: not built yet");
    2
}
