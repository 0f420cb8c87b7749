//! `ciera`: analyze checkpoints, measure Allgather performance, launch local ranks.

use std::process::ExitCode;

const USAGE: &str = "usage: ciera <command> [args]

commands:
  analyze DIR [--mode exp|hybrid|auto|delta|all] [--json]
        what CIERA would save on consecutive safetensors snapshots in DIR (checks every bit)
  perf [-n N] [-b MIN] [-e MAX] [-f FACTOR] [-i ITERS] [-w WARMUP] [-c CHECK] [-R 0|1] [--json]
        nccl-tests style Allgather timings (run `ciera perf --help`)
  perf --trace DIR [-n N] [--modes raw,exp,full,delta,...] ...
        the compressed Allgather replaying a real training trace, every bit checked
  launch -n N [--] PROGRAM [ARGS...]
        run N ranks of PROGRAM on this machine
  sim [--model M] [--cluster C] [--gpus LIST] ... | sim --validate DIR
        project training with CIERA to 8..1024 GPUs; check the model against runs measured here
";

fn main() -> ExitCode {
    // Die quietly on a closed pipe (`ciera analyze ... | head`) like other command-line tools,
    // instead of panicking on the failed write.
    // SAFETY: called first thing in main, before any other thread exists; SIG_DFL is a valid
    // disposition for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first() else {
        eprint!("{USAGE}");
        return ExitCode::from(2);
    };
    let rest = &args[1..];
    let code = match cmd.as_str() {
        "analyze" => ciera::cli::analyze::main(rest),
        "perf" => ciera::cli::perf::main(rest),
        "launch" => ciera::cli::launch::main(rest),
        "sim" => ciera::cli::sim::main(rest),
        "-h" | "--help" | "help" => {
            print!("{USAGE}");
            0
        }
        "-V" | "--version" => {
            println!("ciera {}", env!("CARGO_PKG_VERSION"));
            0
        }
        other => {
            eprintln!("ciera: unknown command '{other}'\n\n{USAGE}");
            2
        }
    };
    ExitCode::from(code.clamp(0, 255) as u8)
}
