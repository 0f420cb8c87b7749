//! What `ciera perf` and `ciera perf --trace` share as multi-rank programs: starting their own
//! ranks under `ciera launch` when no launcher did, checking the environment once before that,
//! and saying what went wrong in one line per job rather than one per rank.

use super::launch::{self, LaunchSpec};
use crate::comm::env::{real_env, LaunchEnv};
use crate::comm::Config;
use crate::error::Error;

/// What the subcommand should do.
enum Start {
    /// Run as one rank here (under a launcher, or a single rank): this rank's number.
    Here { rank: usize },
    /// The job ran (launched here); exit with this code.
    Done(i32),
}

/// `ciera <sub> [pass...]` asked for `nranks` ranks: without a launcher around (and with more
/// than one rank) this runs them under `ciera launch` and returns its exit code; under a
/// launcher it checks `-n` matches. The environment (`CIERA_*`) is checked here, once, so a bad
/// value is one line and exit 2 rather than one failure per rank. Err: the line to print
/// (exit 2).
fn start(sub: &str, nranks: Option<usize>, pass: &[String]) -> Result<Start, String> {
    let env = LaunchEnv::detect(&real_env).map_err(|e| e.to_string())?;
    Config::from_env().map_err(|e| e.to_string())?;
    if env.launcher == "none" && nranks.unwrap_or(1) > 1 {
        let exe = std::env::current_exe()
            .map_err(|e| format!("cannot find my own executable to launch ranks: {e}"))?;
        let mut args = vec![sub.to_string()];
        args.extend(pass.iter().cloned());
        return Ok(Start::Done(launch::run(&LaunchSpec {
            nranks: nranks.unwrap_or(1),
            program: exe.to_string_lossy().into_owned(),
            args,
            env: Vec::new(),
            grace: std::time::Duration::from_secs(3),
        })));
    }
    if let Some(n) = nranks {
        if env.launcher != "none" && n != env.nranks {
            return Err(format!(
                "-n {n}, but {} started {} ranks; drop -n under a launcher",
                env.launcher, env.nranks
            ));
        }
    }
    Ok(Start::Here { rank: env.rank })
}

/// `ciera <sub>` as a job of `nranks` ranks: start them (see [`start`]), then run `rank` as
/// this rank; exit 0 when it returns true (everything checked out), 1 when false, and as
/// [`rank_failed`] says on an error. A bad environment is one line and exit 2.
pub fn run(
    sub: &str,
    nranks: Option<usize>,
    pass: &[String],
    rank: impl FnOnce() -> crate::error::Result<bool>,
) -> i32 {
    let cmd = format!("ciera {sub}");
    let me = match start(sub, nranks, pass) {
        Ok(Start::Here { rank }) => rank,
        Ok(Start::Done(code)) => return code,
        Err(e) => {
            eprintln!("{cmd}: {e}");
            return 2;
        }
    };
    match rank() {
        Ok(ok) => i32::from(!ok),
        Err(e) => rank_failed(&cmd, me, &e),
    }
}

/// The exit code of a rank that failed with `e`, after printing it, unless another rank is to
/// blame and `ciera launch` started the job: then a rank whose peer failed says nothing (the
/// culprit, or the launcher when the culprit died, says what happened), so a job that fails
/// prints one line, not one per rank. Under another launcher (mpirun, srun, torchrun), which
/// knows only that a process died, every rank says which rank stopped it and why, with its
/// host, so the log of every node names the culprit.
pub fn rank_failed(cmd: &str, rank: usize, e: &Error) -> i32 {
    let someone_else = matches!(e, Error::PeerFailed { peer, .. } if *peer != rank);
    let our_launcher = std::env::var_os("CIERA_ROOT_SERVED").is_some();
    let line = if !someone_else {
        format!("{cmd}: rank {rank}: {e}\n")
    } else if !our_launcher {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{cmd}: rank {rank} (on {}): stopped: {e}\n", host.trim())
    } else {
        return 1;
    };
    // One write, so the lines of ranks sharing a terminal or a pipe do not interleave.
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    1
}
