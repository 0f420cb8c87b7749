//! Ranks as separate OS processes (this test binary re-executed with `CIERA_TEST_CHILD` set),
//! over real shm segments and TCP sockets: bulk exchange, full mesh, a SIGKILLed peer, and no
//! leftovers in /dev/shm.

mod common;

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ciera_transport::{Endpoint, PeerInfo, TransportChoice};
use common::*;

const ROLE: &str = "CIERA_TEST_CHILD";
const TAG: &str = "CIERA:";
/// Generous failure bound for anything a child or the parent waits for.
const BOUND: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------- child side

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{TAG}{line}").unwrap();
    out.flush().unwrap();
}

fn env_usize(name: &str) -> usize {
    std::env::var(name).unwrap().parse().unwrap()
}

/// Entry point of every child process; a no-op in the parent's own test run.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let code = match run_child(&role) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!(
                "child {role} rank {}: {e}",
                std::env::var("CIERA_TEST_RANK").unwrap_or_default()
            );
            say(&format!("ERROR {e}"));
            1
        }
    };
    std::process::exit(code);
}

fn run_child(role: &str) -> Result<(), String> {
    let me = env_usize("CIERA_TEST_RANK");
    let world = env_usize("CIERA_TEST_WORLD");
    let choice = TransportChoice::from_env().map_err(|e| e.to_string())?;
    let mut ep = Endpoint::bind(localhost()).map_err(|e| e.to_string())?;
    say(&format!("INFO {}", hex(&ep.local_info().to_bytes())));
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    let peers: Vec<PeerInfo> = line
        .trim()
        .strip_prefix("PEERS ")
        .ok_or("no PEERS line")?
        .split(',')
        .map(|h| PeerInfo::from_bytes(&unhex(h)).unwrap())
        .collect();
    ep.connect_all(me, &peers, &SECRET, choice, Instant::now() + BOUND)
        .map_err(|e| e.to_string())?;
    say(&format!("READY {}", ep.link((me + 1) % world).kind()));
    match role {
        "exchange" => {
            exchange(&mut ep, me, world, env_usize("CIERA_TEST_BYTES"), BOUND)?;
            say("DONE");
            Ok(())
        }
        "by-rank" => {
            let roles = std::env::var("CIERA_TEST_ROLES").map_err(|e| e.to_string())?;
            match roles.split(',').nth(me) {
                Some("stream") => stream_forever(&mut ep, me),
                Some("survive") => survive(&mut ep, me),
                other => Err(format!("no role for rank {me}: {other:?}")),
            }
        }
        "stream" => stream_forever(&mut ep, me),
        "survive" => survive(&mut ep, me),
        other => Err(format!("unknown role {other}")),
    }
}

/// Victim: streams patterned bytes to the other rank until it is killed.
fn stream_forever(ep: &mut Endpoint, me: usize) -> Result<(), String> {
    let peer = 1 - me;
    let mut chunk = vec![0u8; 1 << 20];
    let mut offset = 0u64;
    let start = Instant::now();
    while start.elapsed() < BOUND {
        pattern(me, peer, offset, &mut chunk);
        let mut done = 0;
        while done < chunk.len() {
            let n = ep
                .link(peer)
                .try_send(&chunk[done..])
                .map_err(|e| e.to_string())?;
            if n == 0 {
                ep.wait(Duration::from_millis(100))
                    .map_err(|e| e.to_string())?;
            }
            done += n;
        }
        offset += chunk.len() as u64;
    }
    Err("stream_forever: never killed".into())
}

/// Survivor: checks the victim's bytes until the link reports the victim gone.
fn survive(ep: &mut Endpoint, me: usize) -> Result<(), String> {
    let peer = 1 - me;
    let mut buf = vec![0u8; 1 << 20];
    let mut scratch = Vec::new();
    let mut got = 0u64;
    let mut announced = false;
    let start = Instant::now();
    while start.elapsed() < BOUND {
        match ep.link(peer).try_recv(&mut buf) {
            Ok(0) => ep
                .wait(Duration::from_millis(100))
                .map_err(|e| e.to_string())?,
            Ok(n) => {
                verify(peer, me, got, &buf[..n], &mut scratch)?;
                got += n as u64;
                if !announced && got >= 4 << 20 {
                    announced = true;
                    say("STREAMING");
                }
            }
            Err(e) if e.is_peer_closed() => {
                say(&format!("CLOSED after {got} bytes: {e}"));
                return Ok(());
            }
            Err(e) => return Err(format!("expected PeerClosed, got {e}")),
        }
    }
    Err(format!(
        "no PeerClosed within {BOUND:?} ({got} bytes received)"
    ))
}

// ---------------------------------------------------------------- parent side

struct Rank {
    child: Child,
    lines: mpsc::Receiver<String>,
    stderr_path: std::path::PathBuf,
}

impl Rank {
    fn stderr(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = File::open(&self.stderr_path) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    /// The next tagged line, or a panic naming what was awaited.
    fn expect(&self, prefix: &str) -> String {
        match self.lines.recv_timeout(BOUND) {
            Ok(line) if line.starts_with(prefix) => line,
            Ok(line) => panic!(
                "child {} sent {line:?} while {prefix:?} was expected; stderr:\n{}",
                self.child.id(),
                self.stderr()
            ),
            Err(_) => panic!(
                "child {} gave no {prefix:?} within {BOUND:?}; stderr:\n{}",
                self.child.id(),
                self.stderr()
            ),
        }
    }
}

/// Starts `world` children in `role`, runs the PeerInfo exchange (a stand-in for bootstrap)
/// and returns once every child printed READY.
fn launch(role: &str, world: usize, env: &[(&str, String)]) -> Vec<Rank> {
    let exe = std::env::current_exe().unwrap();
    let mut ranks: Vec<Rank> = (0..world)
        .map(|rank| {
            static LAUNCHES: AtomicUsize = AtomicUsize::new(0);
            let n = LAUNCHES.fetch_add(1, Ordering::Relaxed);
            let stderr_path = std::env::temp_dir().join(format!(
                "ciera-transport-test-{}-{n}-{role}-{rank}.stderr",
                std::process::id()
            ));
            let mut cmd = Command::new(&exe);
            cmd.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
                .env(ROLE, role)
                .env("CIERA_TEST_RANK", rank.to_string())
                .env("CIERA_TEST_WORLD", world.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(File::create(&stderr_path).unwrap());
            for (k, v) in env {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().unwrap();
            let stdout = child.stdout.take().unwrap();
            let (tx, lines) = mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    // libtest may have printed "test child_entry ... " on the same line.
                    if let Some(at) = line.find(TAG) {
                        if tx.send(line[at + TAG.len()..].to_string()).is_err() {
                            break;
                        }
                    }
                }
            });
            Rank {
                child,
                lines,
                stderr_path,
            }
        })
        .collect();
    let infos: Vec<String> = ranks
        .iter()
        .map(|r| r.expect("INFO ")["INFO ".len()..].to_string())
        .collect();
    let table = format!("PEERS {}\n", infos.join(","));
    for r in &mut ranks {
        r.child
            .stdin
            .as_mut()
            .unwrap()
            .write_all(table.as_bytes())
            .unwrap();
    }
    for r in &ranks {
        r.expect("READY ");
    }
    ranks
}

impl Drop for Rank {
    fn drop(&mut self) {
        // Never leave a child behind when a test fails half-way.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.stderr_path);
        }
    }
}

fn wait_exit(rank: &mut Rank) -> std::process::ExitStatus {
    let deadline = Instant::now() + BOUND;
    loop {
        if let Some(status) = rank.child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = rank.child.kill();
            panic!(
                "child {} did not exit within {BOUND:?}; stderr:\n{}",
                rank.child.id(),
                rank.stderr()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn assert_no_shm_left(pids: &[u32], when: &str) {
    for &pid in pids {
        let left = shm_entries_of(pid);
        assert!(
            left.is_empty(),
            "{when}: /dev/shm still holds {left:?} of pid {pid}"
        );
    }
}

fn exchange_processes(world: usize, transport: &str, bytes: usize) {
    exchange_processes_env(world, transport, bytes, &[]);
}

fn exchange_processes_env(world: usize, transport: &str, bytes: usize, extra: &[(&str, String)]) {
    let mut env = vec![
        ("CIERA_TRANSPORT", transport.to_string()),
        ("CIERA_TEST_BYTES", bytes.to_string()),
    ];
    env.extend_from_slice(extra);
    let mut ranks = launch("exchange", world, &env);
    let pids: Vec<u32> = ranks.iter().map(|r| r.child.id()).collect();
    // Every segment is mapped by both sides once connect_all returned: no names may remain.
    assert_no_shm_left(&pids, "after connect_all");
    for r in &ranks {
        r.expect("DONE");
    }
    for r in &mut ranks {
        let status = wait_exit(r);
        assert!(
            status.success(),
            "child {} exited {status}; stderr:\n{}",
            r.child.id(),
            r.stderr()
        );
    }
    assert_no_shm_left(&pids, "after a normal exit");
}

#[test]
fn two_processes_exchange_64_mib_over_shm() {
    exchange_processes(2, "shm", 64 << 20);
}

#[test]
fn two_processes_exchange_64_mib_over_tcp() {
    exchange_processes(2, "tcp", 64 << 20);
}

#[test]
fn three_processes_full_mesh_auto() {
    exchange_processes(3, "auto", (5 << 20) + 3);
}

#[test]
fn three_processes_full_mesh_over_small_shm_rings() {
    // 64 KiB rings: thousands of wrap-arounds and full-ring stalls per stream.
    let small = [("CIERA_SHM_RING_BYTES", "64K".to_string())];
    exchange_processes_env(3, "shm", (5 << 20) + 3, &small);
}

#[test]
fn three_processes_full_mesh_tcp() {
    exchange_processes(3, "tcp", (5 << 20) + 3);
}

/// Rank `victim` streams to the other rank; once bytes flow it is SIGKILLed, and the survivor
/// must report PeerClosed (after checking every byte it got) well before the bound.
fn sigkill(transport: &str, victim: usize) {
    let env = [("CIERA_TRANSPORT", transport.to_string())];
    // Both children run the same binary; pick the role by rank through a tiny wrapper role.
    let roles = if victim == 0 {
        ["stream", "survive"]
    } else {
        ["survive", "stream"]
    };
    let mut ranks = launch_roles(&roles, &env);
    let pids: Vec<u32> = ranks.iter().map(|r| r.child.id()).collect();
    assert_no_shm_left(&pids, "after connect_all");
    let survivor = 1 - victim;
    ranks[survivor].expect("STREAMING");
    ranks[victim].child.kill().unwrap(); // SIGKILL
    let _ = ranks[victim].child.wait();
    let closed = ranks[survivor].expect("CLOSED");
    assert!(closed.contains("peer closed"), "{closed}");
    eprintln!("survivor reported: {closed}");
    let status = wait_exit(&mut ranks[survivor]);
    assert!(
        status.success(),
        "survivor exited {status}; stderr:\n{}",
        ranks[survivor].stderr()
    );
    assert_no_shm_left(&pids, "after SIGKILL");
}

/// Like `launch`, but rank r runs `roles[r]`.
fn launch_roles(roles: &[&str], env: &[(&str, String)]) -> Vec<Rank> {
    let joined = roles.join(",");
    let mut env = env.to_vec();
    env.push(("CIERA_TEST_ROLES", joined));
    launch("by-rank", roles.len(), &env)
}

#[test]
fn sigkilled_shm_peer_yields_peer_closed() {
    sigkill("shm", 0);
}

#[test]
fn sigkilled_tcp_peer_yields_peer_closed() {
    sigkill("tcp", 1);
}
