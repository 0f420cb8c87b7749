//! Helpers shared by tests/capi_*.rs (included with `#[path]`): where the built libraries
//! are, building the interposer crates, compiling C programs, running commands with a deadline.
#![allow(dead_code)]

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

pub const MANIFEST_DIR: &str = env!("CARGO_MANIFEST_DIR");

/// target/<profile>/, the folder holding this test's binaries and the workspace's libraries.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test binary>
    exe.parent()
        .and_then(Path::parent)
        .expect("test binary in target/<profile>/deps")
        .to_path_buf()
}

/// Builds `packages`' libraries into this test's target folder and profile (a no-op when they
/// are fresh), once per test process. Running cargo from a test is fine: cargo holds no lock
/// on the target folder while tests run.
pub fn build_libs(packages: &[&str]) {
    static BUILT: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    let mut built = BUILT
        .get_or_init(|| Mutex::new(Vec::new()))
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let todo: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| !built.iter().any(|b| b == p))
        .collect();
    if todo.is_empty() {
        return;
    }
    let dir = profile_dir();
    let profile = dir.file_name().unwrap().to_string_lossy().into_owned();
    let target = dir.parent().unwrap();
    let mut cmd =
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_string()));
    cmd.args([
        "build",
        "--quiet",
        "--lib",
        "--manifest-path",
        &format!("{MANIFEST_DIR}/Cargo.toml"),
    ]);
    cmd.args([
        "--profile",
        if profile == "debug" { "dev" } else { &profile },
    ]);
    for p in &todo {
        cmd.args(["-p", p]);
    }
    cmd.env("CARGO_TARGET_DIR", target);
    let out = cmd.output().expect("running cargo build");
    assert!(
        out.status.success(),
        "cargo build of {todo:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    built.extend(todo.iter().map(|s| s.to_string()));
}

/// A built library of the workspace, e.g. "libciera_nccl.so".
pub fn lib_path(name: &str) -> PathBuf {
    let p = profile_dir().join(name);
    assert!(p.exists(), "{} was not built", p.display());
    p
}

/// A fresh scratch folder under the target folder (kept after the test for inspection), one
/// per call: the tests of one binary run in parallel threads of one process, and two that
/// shared a folder would rebuild a program while the other launches it.
pub fn scratch(name: &str) -> PathBuf {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = profile_dir()
        .join("capi-tests")
        .join(format!("{name}-{}-{call}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn c_dir() -> PathBuf {
    Path::new(MANIFEST_DIR).join("tests/c")
}

/// `cc -O1 -Wall -Werror -o out srcs... args...`, panicking with the compiler's output.
pub fn cc(out: &Path, srcs: &[PathBuf], args: &[String]) {
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    cc_with(&compiler, out, srcs, args)
}

pub fn cc_with(compiler: &str, out: &Path, srcs: &[PathBuf], args: &[String]) {
    let mut cmd = Command::new(compiler);
    cmd.args([
        "-O1",
        "-g",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-Wno-unused-parameter",
        "-o",
    ])
    .arg(out);
    cmd.args(srcs).args(args);
    let o = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {compiler}: {e}"));
    assert!(
        o.status.success(),
        "{compiler} failed for {}:\n{}{}",
        out.display(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

pub fn have(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Runs `cmd` in its own process group; past `limit` the whole group is killed and the test
/// fails with what it printed so far.
pub fn run_limited(mut cmd: Command, limit: Duration) -> Output {
    cmd.process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let desc = format!("{cmd:?}");
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {desc}: {e}"));
    let pid = child.id() as i32;
    // Drain the pipes on threads so a chatty child cannot block on a full pipe.
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut so, &mut v).ok();
        v
    });
    let t_err = std::thread::spawn(move || {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut se, &mut v).ok();
        v
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if Instant::now() > deadline {
            // SAFETY: kill(2) on the process group this function created; no memory involved.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = t_out.join().unwrap();
    let stderr = t_err.join().unwrap();
    match status {
        Some(status) => Output {
            status,
            stdout,
            stderr,
        },
        None => panic!(
            "{desc} ran past {limit:?}; killed.\nstdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        ),
    }
}

/// Panics with both streams unless `o` exited 0.
pub fn assert_success(what: &str, o: &Output) {
    assert!(
        o.status.success(),
        "{what} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

pub fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// `nm -D --defined-only` of a library: the names of its exported symbols, sorted.
pub fn exported_symbols(lib: &Path) -> Vec<String> {
    let o = Command::new("nm")
        .args(["-D", "--defined-only", "--format=posix"])
        .arg(lib)
        .output()
        .expect("running nm");
    assert!(
        o.status.success(),
        "nm {}: {}",
        lib.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    let mut names: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(|n| n.split('@').next().unwrap().to_string())
        .collect();
    names.sort();
    names.dedup();
    names
}
