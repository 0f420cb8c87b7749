//! Hostile and failing setups, with real processes and sockets: a process without the job
//! secret relaying the root's own proof between two connections, an insider's absurd hello,
//! the address rank 0's root listens on, and what a job killed during setup leaves in
//! /dev/shm.
//!
//! The attacker and insider here speak the bootstrap's bytes themselves or through
//! `bootstrap::join`; nothing is mocked.

#[path = "common/comm_harness.rs"]
mod harness;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::FromRawFd;
use std::process::{Child, ChildStdout, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ciera::comm::bootstrap::{self, RootMode};
use ciera::comm::{Communicator, Config, UniqueId};
use ciera_transport::{host_id, PeerInfo};
use harness::*;

/// Generous failure bound for anything a test waits for (never a performance threshold).
const BOUND: Duration = Duration::from_secs(60);
const TAG: &str = "CIERA-TEST:";

#[test]
fn rank_main() {
    let Ok(role) = std::env::var("CIERA_TEST_ROLE") else {
        return;
    };
    match role.as_str() {
        // A root server like `ciera launch`'s: serves rounds until stdin closes.
        "root" => {
            let secret = secret_from_env();
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr =
                bootstrap::spawn_root(listener, secret, RootMode::Forever, BOUND).expect("root");
            say(&format!("ROOT {addr}"));
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
        }
        "from_env" => {
            let r = Communicator::from_env(Config::from_env().unwrap()).map(|_| ());
            report(&describe(&r));
        }
        "init_only" => {
            let r = comm_from_test_env(Config::from_env().unwrap()).map(|_| ());
            report(&describe(&r));
        }
        // Rank 0 of a job that joins the bootstrap and then never runs connect_all: it takes
        // the other ranks' setup connections and holds them without a word.
        "absent_rank0" => {
            let id = id_from_env();
            let nranks: usize = std::env::var("CIERA_TEST_NRANKS").unwrap().parse().unwrap();
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let me = PeerInfo {
                host_id: host_id(),
                addr: listener.local_addr().unwrap(),
                pid: std::process::id(),
                rdma: false,
            };
            let (root, secret) = (id.root(), id.secret());
            let mut source = || Ok(Some((vec![root], secret)));
            bootstrap::join(&mut source, nranks, 0, &me, Instant::now() + BOUND)
                .expect("rank 0 joins the bootstrap");
            let held: Vec<TcpStream> = (1..nranks).map(|_| listener.accept().unwrap().0).collect();
            report(&format!("accepted {}", held.len()));
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        other => panic!("unknown role {other}"),
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{TAG}{line}").unwrap();
    out.flush().unwrap();
}

fn secret_from_env() -> [u8; 32] {
    ciera::comm::id::parse_hex_secret(&std::env::var("CIERA_TEST_SECRET").unwrap()).unwrap()
}

fn id_from_env() -> UniqueId {
    let s = std::env::var("CIERA_TEST_ID").unwrap();
    let b: Vec<u8> = (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect();
    UniqueId::from_bytes(&b.try_into().unwrap()).unwrap()
}

/// The next tagged stdout line of a child, or a panic naming what was awaited.
fn tagged_lines(stdout: ChildStdout) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            if let Some(at) = line.find(TAG) {
                let _ = tx.send(line[at + TAG.len()..].to_string());
            }
        }
    });
    rx
}

fn fake_info(pid: u32) -> PeerInfo {
    PeerInfo {
        host_id: host_id(),
        addr: "127.0.0.1:9".parse().unwrap(),
        pid,
        rdma: false,
    }
}

// ------------------------------------------------------------------ item 1: proof relay

/// A TCP connection to `to` from the local address `from` (port chosen by the kernel): the
/// attacker picks which end of each connection has the smaller address.
fn connect_from(from: Ipv4Addr, to: SocketAddrV4) -> TcpStream {
    let sin = |ip: Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(ip.octets()),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on a descriptor this function owns; the sockaddrs live on
    // this frame for each call; the descriptor is handed to TcpStream exactly once.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let src = sin(from, 0);
        let rc = libc::bind(fd, (&src as *const libc::sockaddr_in).cast(), len);
        assert_eq!(rc, 0, "bind {from}: {}", std::io::Error::last_os_error());
        let dst = sin(*to.ip(), to.port());
        let rc = libc::connect(fd, (&dst as *const libc::sockaddr_in).cast(), len);
        assert_eq!(rc, 0, "connect {to}: {}", std::io::Error::last_os_error());
        TcpStream::from_raw_fd(fd)
    }
}

fn v1_auth_hello(role: u8, nonce: &[u8]) -> Vec<u8> {
    let mut h = b"CIERAUTH".to_vec();
    h.extend_from_slice(&[1, role]);
    h.extend_from_slice(nonce);
    h
}

fn bootstrap_hello(nranks: u32, rank: u32, info: &PeerInfo) -> Vec<u8> {
    let info = info.to_bytes();
    let mut h = b"CIBS".to_vec();
    h.extend_from_slice(&1u16.to_le_bytes());
    h.extend_from_slice(&1u16.to_le_bytes());
    for v in [nranks, rank, info.len() as u32] {
        h.extend_from_slice(&v.to_le_bytes());
    }
    h.extend_from_slice(&info);
    h
}

fn read_n(s: &mut TcpStream, n: usize, step: &str) -> Result<Vec<u8>, String> {
    let mut b = vec![0u8; n];
    s.read_exact(&mut b).map_err(|e| format!("{step}: {e}"))?;
    Ok(b)
}

/// The attack of the hardening issue, without the secret: the root decided its role by
/// comparing addresses, so on connection `a` (root address smaller) it proved itself as
/// "connector" and on `b` (root address larger) it checked a "connector" proof over the same
/// two nonces. Relaying its proof from `a` to `b` authenticated `b`, which then joined as
/// rank 1. Returns what the attacker got on `b`.
fn relay_attack(root: SocketAddrV4) -> Result<String, String> {
    let mut a = connect_from(Ipv4Addr::new(127, 0, 0, 3), root);
    let mut b = connect_from(Ipv4Addr::new(127, 0, 0, 1), root);
    for s in [&a, &b] {
        s.set_read_timeout(Some(BOUND)).unwrap();
    }
    let hello_a = read_n(&mut a, 42, "root's hello on a")?;
    let hello_b = read_n(&mut b, 42, "root's hello on b")?;
    let version = hello_a[8];
    if version != 1 {
        // Another protocol: the version 1 hellos must just be refused, with nothing sent back.
        for s in [&mut a, &mut b] {
            s.write_all(&v1_auth_hello(0, &[7; 32])).unwrap();
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
        }
        return Err(format!(
            "the root speaks auth version {version} and hung up on the version 1 hellos"
        ));
    }
    let (nonce_a, nonce_b) = (&hello_a[10..42], &hello_b[10..42]);
    // a: play acceptor with b's nonce; the root answers with its connector proof.
    a.write_all(&v1_auth_hello(1, nonce_b)).unwrap();
    let proof = read_n(&mut a, 32, "root's proof on a")?;
    // b: play connector with a's nonce and hand the root its own proof.
    let _ = b.write_all(&v1_auth_hello(0, nonce_a));
    let _ = b.write_all(&proof);
    let verdict = read_n(&mut b, 33, "root's verdict on b")?;
    if verdict[0] != 0 {
        return Err(format!(
            "root refused the relayed proof (verdict {})",
            verdict[0]
        ));
    }
    let _ = b.write_all(&[0]);
    let _ = b.write_all(&bootstrap_hello(2, 1, &fake_info(4242)));
    let header = read_n(&mut b, 8, "root's answer to the hello")?;
    Ok(format!(
        "passed the handshake and got bootstrap message kind {} ({})",
        u16::from_le_bytes([header[6], header[7]]),
        if header[6] == 2 {
            "the peer table"
        } else {
            "not the table"
        }
    ))
}

#[test]
fn a_proof_relayed_between_two_root_connections_is_refused() {
    let secret = [0x5Au8; 32];
    let listener = TcpListener::bind("127.0.0.2:0").unwrap();
    let root = match bootstrap::spawn_root(listener, secret, RootMode::Once, BOUND).unwrap() {
        SocketAddr::V4(a) => a,
        other => panic!("root at {other}"),
    };
    let mut source = move || Ok(Some((vec![SocketAddr::V4(root)], secret)));
    let rank0 = std::thread::spawn(move || {
        let mut source = move || Ok(Some((vec![SocketAddr::V4(root)], secret)));
        bootstrap::join(&mut source, 2, 0, &fake_info(1000), Instant::now() + BOUND)
    });
    let attack = relay_attack(root);
    assert!(
        attack.is_err(),
        "a process without the secret {}",
        attack.unwrap()
    );
    eprintln!("the attacker got: {}", attack.unwrap_err());
    // The job goes on: the real rank 1 joins, and the table holds the two real ranks.
    let (table1, _) =
        bootstrap::join(&mut source, 2, 1, &fake_info(1001), Instant::now() + BOUND).unwrap();
    let (table0, _) = rank0.join().unwrap().unwrap();
    let pids: Vec<u32> = table0.iter().map(|p| p.pid).collect();
    assert_eq!(pids, vec![1000, 1001]);
    assert_eq!(table0, table1);
}

/// Forwards every byte between the one connection it accepts and `to`, both ways.
fn forwarding_proxy(to: SocketAddr) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (c, _) = listener.accept().unwrap();
        let s = TcpStream::connect(to).unwrap();
        let pump = |mut from: TcpStream, mut to: TcpStream| {
            let mut buf = [0u8; 4096];
            while let Ok(n) = from.read(&mut buf) {
                if n == 0 || to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = to.shutdown(std::net::Shutdown::Both);
        };
        let (c2, s2) = (c.try_clone().unwrap(), s.try_clone().unwrap());
        std::thread::spawn(move || pump(c2, s2));
        pump(s, c);
    });
    addr
}

#[test]
fn a_rank_reaching_the_root_through_a_relay_is_refused() {
    // Someone without the secret puts itself between a rank and the root (here: the rank was
    // given the relay's address) and forwards every byte, to sit in the middle afterwards.
    let secret = [0x6Bu8; 32];
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let root = bootstrap::spawn_root(listener, secret, RootMode::Once, BOUND).unwrap();
    let relay = forwarding_proxy(root);
    let mut source = move || Ok(Some((vec![relay], secret)));
    let r = bootstrap::join(&mut source, 2, 1, &fake_info(3001), Instant::now() + BOUND);
    match r {
        Err(e) if e.to_string().contains("relays between two connections") => {
            eprintln!("the rank said: {e}")
        }
        other => panic!("through a relay the rank got {other:?}"),
    }
}

// ------------------------------------------------------------------ item 2: hostile hello

struct RootChild {
    child: Child,
    addr: SocketAddr,
    secret: [u8; 32],
}

impl RootChild {
    fn start() -> RootChild {
        let secret = ciera::comm::id::random_secret().unwrap();
        let mut child = self_cmd()
            .env("CIERA_TEST_ROLE", "root")
            .env("CIERA_TEST_SECRET", hex(&secret))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = tagged_lines(child.stdout.take().unwrap());
        let line = lines.recv_timeout(BOUND).expect("the root child's address");
        let addr = line.strip_prefix("ROOT ").unwrap().parse().unwrap();
        RootChild {
            child,
            addr,
            secret,
        }
    }

    fn join(&self, nranks: usize, rank: usize, me: &PeerInfo) -> ciera::Result<Vec<PeerInfo>> {
        let (addr, secret) = (self.addr, self.secret);
        let mut source = move || Ok(Some((vec![addr], secret)));
        bootstrap::join(&mut source, nranks, rank, me, Instant::now() + BOUND).map(|(t, _)| t)
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Everything the root printed, after it exits (closing its stdin asks it to); the exit
    /// status if it was still alive when asked.
    fn finish(mut self) -> (Option<std::process::ExitStatus>, String) {
        let alive = self.child.try_wait().unwrap().is_none();
        drop(self.child.stdin.take());
        if !alive {
            let _ = self.child.kill();
        }
        let status = self.child.wait().unwrap();
        let mut err = String::new();
        self.child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        (alive.then_some(status), err)
    }
}

#[test]
fn an_insiders_hostile_hellos_are_refused_and_the_root_keeps_serving() {
    let mut root = RootChild::start();
    let me = fake_info(std::process::id());
    let too_long = PeerInfo {
        host_id: "h".repeat(2000),
        ..me.clone()
    };
    // Each with the right secret: a buggy or hostile rank of the job itself.
    let hostile = [
        ("nranks = u32::MAX", u32::MAX as usize, 0, &me, "4294967295"),
        ("rank 7 of 2", 2, 7, &me, "rank 7"),
        ("a 2000-byte host id", 2, 1, &too_long, "host id"),
    ];
    for (what, nranks, rank, info, needle) in hostile {
        let text = match root.join(nranks, rank, info) {
            Ok(t) => format!("got a table of {} ranks", t.len()),
            Err(e) => e.to_string(),
        };
        if !(text.contains("refused") && text.contains(needle) && root.alive()) {
            let (status, stderr) = root.finish();
            panic!(
                "{what}: expected a refusal naming {needle:?}, got: {text}\nroot (alive: {}) \
                 stderr:\n{stderr}",
                status.is_some()
            );
        }
        eprintln!("{what}: {text}");
    }
    // The root still serves a real round of two.
    let r0 = {
        let (addr, secret) = (root.addr, root.secret);
        std::thread::spawn(move || {
            let mut source = move || Ok(Some((vec![addr], secret)));
            bootstrap::join(&mut source, 2, 0, &fake_info(2000), Instant::now() + BOUND)
        })
    };
    let table1 = root.join(2, 1, &fake_info(2001));
    let table0 = r0.join().unwrap();
    let (status, stderr) = root.finish();
    let table1 =
        table1.unwrap_or_else(|e| panic!("rank 1 after the hostile hellos: {e}\n{stderr}"));
    let (table0, _) = table0.unwrap();
    assert_eq!(table0, table1);
    assert_eq!(
        table0.iter().map(|p| p.pid).collect::<Vec<_>>(),
        vec![2000, 2001]
    );
    assert!(
        status.is_some_and(|s| s.success()),
        "root: {status:?}\n{stderr}"
    );
    // The root logged why, for each refusal.
    for needle in ["4294967295", "rank 7", "host id"] {
        assert!(
            stderr.contains(needle),
            "no {needle:?} in the root's log:\n{stderr}"
        );
    }
}

// ------------------------------------------------------------------ item 3: root address

/// Local addresses of listening TCP sockets on `port` (from /proc/net/tcp).
fn listeners_on(port: u16) -> Vec<Ipv4Addr> {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (ip, p) = f.get(1)?.split_once(':')?;
            let listening = f.get(3) == Some(&"0A");
            let ip = Ipv4Addr::from(u32::from_str_radix(ip, 16).ok()?.to_ne_bytes());
            (listening && u16::from_str_radix(p, 16).ok()? == port).then_some(ip)
        })
        .collect()
}

#[test]
fn rank0_serves_the_root_on_the_address_ciera_root_names() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let secret = hex(&[0x33u8; 32]);
    let root = format!("127.0.0.1:{port}");
    let rank = |r: usize| {
        let r = r.to_string();
        let env = [
            ("CIERA_RANK", r.as_str()),
            ("CIERA_NRANKS", "2"),
            ("CIERA_ROOT", root.as_str()),
            ("CIERA_SECRET", secret.as_str()),
            ("CIERA_TIMEOUT", "60"),
        ];
        let mut c = self_cmd();
        c.env("CIERA_TEST_ROLE", "from_env")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in env {
            c.env(k, v);
        }
        c.spawn().unwrap()
    };
    let rank0 = rank(0);
    let start = Instant::now();
    let bound = loop {
        let found = listeners_on(port);
        if !found.is_empty() {
            break found;
        }
        assert!(
            start.elapsed() < BOUND,
            "rank 0 never listened on port {port}"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let rank1 = rank(1);
    let results: Vec<(std::process::ExitStatus, String)> =
        [rank0, rank1].into_iter().map(stderr_of).collect();
    assert_eq!(
        bound,
        vec![Ipv4Addr::LOCALHOST],
        "CIERA_ROOT={root}: rank 0's root listens on {bound:?}"
    );
    for (r, (status, err)) in results.iter().enumerate() {
        assert!(status.success(), "rank {r}: {err}");
        assert_eq!(result_lines(err), vec!["ok"], "rank {r}: {err}");
    }
}

// ------------------------------------------------------------------ item 7: /dev/shm

/// /dev/shm entries named by a CIERA process `pid` (`ciera-<pid>-...`).
fn shm_entries_of(pid: u32) -> Vec<String> {
    let prefix = format!("ciera-{pid}-");
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn ranks_killed_during_setup_leave_nothing_in_dev_shm() {
    if !std::path::Path::new("/dev/shm").is_dir() {
        eprintln!("skipped: this machine has no /dev/shm");
        return;
    }
    // Rank 0 never runs connect_all; ranks 1 and 2 set up their shm link to each other and
    // wait for rank 0 until they are SIGKILLed, as a launcher does after its timeout.
    let id = UniqueId::new().unwrap();
    let env = [("CIERA_TIMEOUT", "120"), ("CIERA_TRANSPORT", "shm")];
    let mut absent = spawn_rank(&id, 3, 0, "absent_rank0", &env);
    let mut ranks: Vec<Child> = (1..3)
        .map(|r| spawn_rank(&id, 3, r, "init_only", &env))
        .collect();
    let pids: Vec<u32> = ranks.iter().map(Child::id).collect();
    let (tx, rx) = mpsc::channel();
    let stderr = absent.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
            let _ = tx.send(line);
        }
    });
    let seen = loop {
        match rx.recv_timeout(BOUND) {
            Ok(l) if l.starts_with("RESULT ") => break l,
            Ok(_) => {}
            Err(e) => panic!("rank 0 never saw the other ranks connect: {e}"),
        }
    };
    assert_eq!(seen, "RESULT accepted 2");
    // Both are inside connect_all now (they connected to rank 0 from there).
    for r in &mut ranks {
        r.kill().unwrap();
        r.wait().unwrap();
    }
    absent.kill().unwrap();
    absent.wait().unwrap();
    let left: Vec<(u32, Vec<String>)> = pids.iter().map(|&p| (p, shm_entries_of(p))).collect();
    for name in left.iter().flat_map(|(_, names)| names) {
        let _ = std::fs::remove_file(format!("/dev/shm/{name}"));
    }
    for (pid, names) in left {
        assert!(
            names.is_empty(),
            "rank pid {pid} was SIGKILLed during setup and left {names:?} in /dev/shm"
        );
    }
}
