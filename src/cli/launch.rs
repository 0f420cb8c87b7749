//! `ciera launch -n N [--] PROGRAM [ARGS...]`: run N ranks of PROGRAM on this host.
//!
//! The launcher generates a job secret and serves the bootstrap root itself (a thread bound to
//! 127.0.0.1 on a port the kernel picks: no port race, no rank is special). Each rank gets
//! CIERA_ROOT, CIERA_ROOT_SERVED=1, CIERA_RANK, CIERA_NRANKS, CIERA_LOCAL_RANK,
//! CIERA_LOCAL_NRANKS and CIERA_SECRET, and inherits stdout/stderr (nothing is prefixed);
//! stdin goes to rank 0 only, as with mpirun. With no more ranks than CPUs, rank i is bound to
//! the i-th CPU this launcher may use (through `taskset`, as mpirun binds to cores): unbound
//! busy ranks get stacked on one CPU by the scheduler when another job is running, and a rank
//! spinning for its peer then holds that peer off. If a rank exits non-zero or dies by a signal,
//! the launcher says which and how, gives the others a short grace period to fail on their own
//! (their errors name the culprit), kills the rest, and exits non-zero.

use std::io::ErrorKind;
use std::net::TcpListener;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::args::Args;
use crate::comm::bootstrap::{spawn_root, RootMode};
use crate::comm::id::{hex, random_secret, round_timeout};
use crate::comm::Config;
use crate::parse::MAX_WAIT;

const USAGE: &str =
    "usage: ciera launch -n N [--grace SECONDS] [--bind auto|none] [--] PROGRAM [ARGS...]

Runs N ranks of PROGRAM on this host. Each rank finds its rank, the job size, the bootstrap
root and the job secret in CIERA_RANK, CIERA_NRANKS, CIERA_ROOT, CIERA_SECRET (read by
Communicator::from_env). stdout/stderr are passed through unprefixed; stdin goes to rank 0.
If a rank fails, the others get --grace seconds (default 3) to exit, then are killed; the exit
status is the failed rank's (128+signal for a signal). --bind auto (default; CIERA_BIND) binds
rank i to the i-th allowed CPU when N is at most the number of CPUs and taskset is installed.
";

/// What to run.
#[derive(Clone, Debug)]
pub struct LaunchSpec {
    pub nranks: usize,
    pub program: String,
    pub args: Vec<String>,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
    /// How long the others may take to exit after one rank failed.
    pub grace: Duration,
}

pub fn main(args: &[String]) -> i32 {
    match parse(args) {
        Ok(Some((spec, bind))) => run_with(&spec, bind),
        Ok(None) => {
            print!("{USAGE}");
            0
        }
        Err(e) => {
            eprintln!("ciera launch: {e}\n\n{USAGE}");
            2
        }
    }
}

fn parse(args: &[String]) -> Result<Option<(LaunchSpec, bool)>, String> {
    let mut a = Args::new(args);
    let mut nranks = None;
    let mut grace = Duration::from_secs(3);
    let mut bind = bind_from_env();
    let program = loop {
        let Some(flag) = a.next_flag("n") else {
            return Err("no PROGRAM given".into());
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "-n" | "-np" | "--nranks" => nranks = Some(a.value_parsed::<usize>(&flag)?),
            "--grace" => {
                let s: f64 = a.value_parsed(&flag)?;
                if !(s.is_finite() && s >= 0.0 && s <= MAX_WAIT.as_secs_f64()) {
                    return Err(format!(
                        "--grace {s}: expected seconds from 0 to {}",
                        MAX_WAIT.as_secs()
                    ));
                }
                grace = Duration::from_secs_f64(s);
            }
            "--bind" => {
                bind = match a.value(&flag)?.as_str() {
                    "auto" | "core" => true,
                    "none" => false,
                    v => return Err(format!("--bind {v}: expected auto or none")),
                }
            }
            "--" => match a.rest().first() {
                Some(p) => {
                    let p = p.clone();
                    a.next_flag("");
                    break p;
                }
                None => return Err("no PROGRAM after --".into()),
            },
            f if f.starts_with('-') => return Err(format!("unknown option {f}")),
            p => break p.to_string(),
        }
    };
    let nranks = nranks.ok_or("-n N is required")?;
    if nranks == 0 {
        return Err("-n must be at least 1".into());
    }
    Ok(Some((
        LaunchSpec {
            nranks,
            program,
            args: a.rest().to_vec(),
            env: Vec::new(),
            grace,
        },
        bind,
    )))
}

/// CIERA_BIND=none turns CPU binding off (default auto).
fn bind_from_env() -> bool {
    std::env::var("CIERA_BIND")
        .map(|v| v != "none")
        .unwrap_or(true)
}

/// Start the ranks, watch them, return the exit code for the launcher. CPU binding as
/// `CIERA_BIND` says (auto unless "none").
pub fn run(spec: &LaunchSpec) -> i32 {
    run_with(spec, bind_from_env())
}

/// The program to run, as a path: one with a `/` must name an executable file; a bare name
/// is looked up in PATH (so a missing program is reported as such, not as a failure of
/// `taskset`, which starts it when ranks are bound to CPUs).
fn resolve_program(program: &str) -> Result<String, String> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &std::path::Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let p = std::path::Path::new(program);
        return match std::fs::metadata(p) {
            Err(e) => Err(format!("cannot run {program}: {e}")),
            Ok(_) if !executable(p) => Err(format!("cannot run {program}: not an executable file")),
            Ok(_) => Ok(program.to_string()),
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| executable(p))
        .map(|p| p.to_string_lossy().into_owned())
        .ok_or_else(|| format!("cannot run {program}: not found in PATH"))
}

/// As [`run`], binding ranks to CPUs when `bind` (and there are enough CPUs).
pub fn run_with(spec: &LaunchSpec, bind: bool) -> i32 {
    // What every rank would otherwise fail on, once: the program, and CIERA_* settings.
    let program = match resolve_program(&spec.program) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("ciera launch: {e}");
            return 127;
        }
    };
    let timeout = match Config::from_env() {
        Ok(c) => c.timeout,
        Err(e) => {
            eprintln!("ciera launch: {e}");
            return 2;
        }
    };
    let secret = match random_secret() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ciera launch: {e}");
            return 1;
        }
    };
    let root = TcpListener::bind(("127.0.0.1", 0))
        .map_err(|e| format!("binding the bootstrap root on 127.0.0.1: {e}"))
        .and_then(|l| {
            spawn_root(l, secret, RootMode::Forever, round_timeout(timeout))
                .map_err(|e| e.to_string())
        });
    let root = match root {
        Ok(addr) => addr,
        Err(e) => {
            eprintln!("ciera launch: {e}");
            return 1;
        }
    };
    let secret_hex = hex(&secret);
    let cpus = if bind {
        binding_cpus(spec.nranks)
    } else {
        None
    };
    let mut children: Vec<Option<Child>> = Vec::with_capacity(spec.nranks);
    let mut pids = Vec::with_capacity(spec.nranks);
    for rank in 0..spec.nranks {
        let mut cmd = match &cpus {
            Some(cpus) => {
                let mut c = Command::new("taskset");
                c.args(["-c", &cpus[rank].to_string(), &program]);
                c
            }
            None => Command::new(&program),
        };
        cmd.args(&spec.args)
            .env("CIERA_ROOT", root.to_string())
            .env("CIERA_ROOT_SERVED", "1")
            .env("CIERA_RANK", rank.to_string())
            .env("CIERA_NRANKS", spec.nranks.to_string())
            .env("CIERA_LOCAL_RANK", rank.to_string())
            .env("CIERA_LOCAL_NRANKS", spec.nranks.to_string())
            .env("CIERA_SECRET", &secret_hex)
            .stdin(if rank == 0 {
                Stdio::inherit()
            } else {
                Stdio::null()
            });
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        match cmd.spawn() {
            Ok(c) => {
                pids.push(c.id());
                children.push(Some(c));
            }
            Err(e) => {
                eprintln!(
                    "ciera launch: cannot start rank {rank} ({}): {e}",
                    spec.program
                );
                for c in children.iter_mut().flatten() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return if e.kind() == ErrorKind::NotFound {
                    127
                } else {
                    126
                };
            }
        }
    }

    let mut first_failure: Option<(usize, ExitStatus)> = None;
    let mut kill_at: Option<Instant> = None;
    let mut killed: Vec<usize> = Vec::new();
    let mut quiet_stop = false;
    let mut live = spec.nranks;
    while live > 0 {
        let mut reaped = false;
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            match child.try_wait() {
                Ok(Some(status)) => {
                    *slot = None;
                    live -= 1;
                    reaped = true;
                    if !status.success() && !killed.contains(&rank) && first_failure.is_none() {
                        first_failure = Some((rank, status));
                        if status.signal() == Some(libc::SIGPIPE) {
                            // Its output was closed (`ciera perf | head`): nothing to wait for.
                            eprintln!(
                                "ciera launch: the output of rank {rank} was closed (SIGPIPE); \
                                 stopping the job"
                            );
                            quiet_stop = true;
                            kill_at = Some(Instant::now());
                        } else {
                            eprintln!(
                                "ciera launch: rank {rank} (pid {}) {}; stopping the other ranks",
                                pids[rank],
                                describe(status)
                            );
                            kill_at = Some(Instant::now() + spec.grace);
                        }
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    eprintln!("ciera launch: waiting for rank {rank}: {e}");
                    *slot = None;
                    live -= 1;
                }
            }
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            for (rank, slot) in children.iter_mut().enumerate() {
                if let Some(child) = slot {
                    if !killed.contains(&rank) {
                        let _ = child.kill();
                        killed.push(rank);
                    }
                }
            }
            if !killed.is_empty() && !quiet_stop {
                eprintln!(
                    "ciera launch: killed rank(s) {killed:?}, still running {:?} after rank {} failed",
                    spec.grace,
                    first_failure.map(|f| f.0).unwrap_or(0)
                );
            }
            kill_at = None;
        }
        if !reaped {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    match first_failure {
        None => 0,
        Some((_, status)) => match (status.code(), status.signal()) {
            (Some(c), _) => c.clamp(1, 255),
            (None, Some(sig)) => (128 + sig).min(255),
            _ => 1,
        },
    }
}

/// CPUs to bind ranks 0..n to: the first n this process may run on, if there are that many
/// and `taskset` is on the PATH.
fn binding_cpus(n: usize) -> Option<Vec<usize>> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?
        .trim();
    let cpus = parse_cpu_list(list)?;
    if cpus.len() < n {
        return None;
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).find(|d| d.join("taskset").is_file())?;
    Some(cpus[..n].to_vec())
}

/// "0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11].
fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                out.extend(a.trim().parse::<usize>().ok()?..=b.trim().parse::<usize>().ok()?)
            }
            None => out.push(part.trim().parse().ok()?),
        }
    }
    Some(out)
}

/// "exited with status 3" / "was killed by signal 9 (SIGKILL)".
pub fn describe(status: ExitStatus) -> String {
    if let Some(c) = status.code() {
        return format!("exited with status {c}");
    }
    if let Some(sig) = status.signal() {
        let name = match sig {
            1 => "SIGHUP",
            2 => "SIGINT",
            3 => "SIGQUIT",
            4 => "SIGILL",
            6 => "SIGABRT",
            7 => "SIGBUS",
            8 => "SIGFPE",
            9 => "SIGKILL",
            11 => "SIGSEGV",
            13 => "SIGPIPE",
            15 => "SIGTERM",
            _ => "",
        };
        let core = if status.core_dumped() {
            ", core dumped"
        } else {
            ""
        };
        return if name.is_empty() {
            format!("was killed by signal {sig}{core}")
        } else {
            format!("was killed by signal {sig} ({name}){core}")
        };
    }
    format!("ended with {status}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn parses_program_and_its_args() {
        let (spec, _) = parse(&s(&["-n", "3", "--", "prog", "-n", "x"]))
            .unwrap()
            .unwrap();
        assert_eq!((spec.nranks, spec.program.as_str()), (3, "prog"));
        assert_eq!(spec.args, s(&["-n", "x"]));
        let (spec, _) = parse(&s(&["-n4", "prog", "--flag"])).unwrap().unwrap();
        assert_eq!((spec.nranks, spec.program.as_str()), (4, "prog"));
        assert_eq!(spec.args, s(&["--flag"]));
        assert!(parse(&s(&["prog"])).is_err());
        assert!(parse(&s(&["-n", "0", "prog"])).is_err());
        assert!(parse(&s(&["-n", "2"])).is_err());
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn a_failing_rank_fails_the_job() {
        let spec = LaunchSpec {
            nranks: 3,
            program: "sh".into(),
            args: s(&[
                "-c",
                "if [ \"$CIERA_RANK\" = 1 ]; then exit 7; fi; sleep 30",
            ]),
            env: Vec::new(),
            grace: Duration::from_millis(100),
        };
        assert_eq!(run_with(&spec, false), 7);
        let ok = LaunchSpec {
            args: s(&["-c", "test -n \"$CIERA_SECRET\" -a \"$CIERA_NRANKS\" = 3"]),
            ..spec
        };
        assert_eq!(run_with(&ok, true), 0);
    }
}
