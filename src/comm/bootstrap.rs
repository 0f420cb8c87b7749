//! Bootstrap: the rendezvous that turns (root address, job secret, nranks, rank) into the table
//! of every rank's transport address ([`PeerInfo`]).
//!
//! A root server listens on TCP, on the address the job named ([`bind_root`]). Each rank
//! connects and both sides run `auth::handshake` with the job secret (mutual HMAC challenge, the
//! rank as client claiming `bootstrap rank <rank> of <nranks>`, the root as server claiming
//! `bootstrap root`: a process without the secret learns nothing and is refused). The rank
//! sends a hello: nranks, rank, its PeerInfo. The root checks every field before it keeps or
//! sizes anything (1 <= nranks <= [`MAX_RANKS`], rank < nranks, the same rank and nranks as the
//! connection authenticated, a well-formed PeerInfo) and refuses a bad hello with the reason,
//! to that connection only. When all nranks ranks of a round have joined, the root sends every
//! rank the table. It refuses a round where ranks disagree on nranks or two processes claim one
//! rank — every joined rank gets the reason — and, after the timeout, tells the joined ranks
//! which ranks never came.
//!
//! ```text
//! hello  (rank -> root): "CIBS" u16 version=1 u16 kind=1  u32 nranks u32 rank u32 len, PeerInfo bytes
//! table  (root -> rank): "CIBS" u16 version=1 u16 kind=2  u32 nranks, then per rank: u32 len, PeerInfo bytes
//! refuse (root -> rank): "CIBS" u16 version=1 u16 kind=3  u32 len, UTF-8 reason
//! ```

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use ciera_transport::auth::{self, Role};
use ciera_transport::{PeerInfo, TransportError};

use crate::error::{Error, Result};

const MAGIC: &[u8; 4] = b"CIBS";
const VERSION: u16 = 1;
const KIND_HELLO: u16 = 1;
const KIND_TABLE: u16 = 2;
const KIND_REFUSE: u16 = 3;
/// Largest PeerInfo or reason we read (a hostile peer cannot make us allocate more).
const MAX_FIELD: usize = 64 * 1024;
/// How long the root gives one connection to authenticate and say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Most ranks one job may have; a hello claiming more is refused before anything is sized by it.
pub const MAX_RANKS: usize = 1 << 20;
/// The root's identity in the auth handshake.
const ROOT_IDENTITY: &str = "bootstrap root";

/// A rank's identity in the auth handshake with the root.
fn rank_identity(rank: usize, nranks: usize) -> String {
    format!("bootstrap rank {rank} of {nranks}")
}

/// Where rank 0 listens when it serves the root for `named` (`host:port` as CIERA_ROOT or
/// MASTER_ADDR gave it; `port` is the one to serve on): the address `named` has on this host,
/// so a root the job put on 127.0.0.1 is reachable from this host only. A name that resolves
/// to several addresses gives its first non-loopback one, else its first. A name (not an IP)
/// that resolves only to loopback in a job that may span hosts is an error: ranks elsewhere
/// would resolve it to another address, where nothing listens.
pub fn root_listen_addr(named: &str, port: u16, single_host: bool) -> Result<SocketAddr> {
    let all = super::env::resolve(named)?;
    let pick = all
        .iter()
        .find(|a| !a.ip().is_loopback())
        .or(all.first())
        .ok_or_else(|| {
            Error::Bootstrap(format!("the root address {named:?} resolves to nothing"))
        })?;
    let host = named.rsplit_once(':').map_or(named, |(h, _)| h);
    let literal = host.trim_matches(['[', ']']).parse::<IpAddr>().is_ok();
    if pick.ip().is_loopback() && !literal && !single_host {
        return Err(Error::Bootstrap(format!(
            "the root address {named} resolves to {} (loopback) on rank 0's host, so ranks on \
             other hosts could not reach the root there; name an address of this host that \
             the other hosts reach (CIERA_ROOT or MASTER_ADDR)",
            pick.ip()
        )));
    }
    Ok(SocketAddr::new(pick.ip(), port))
}

/// The root's listener, bound to exactly `addr` (the IP the job named, not every interface).
pub fn bind_root(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr).map_err(|e| {
        let hint = if e.kind() == ErrorKind::AddrNotAvailable {
            " (that address is not one of this host's: rank 0 must run where the root address \
             points)"
        } else {
            ""
        };
        Error::Bootstrap(format!(
            "rank 0 binding the root listener on {addr}: {e}{hint}"
        ))
    })
}

/// How many rounds a root server serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RootMode {
    /// One job (a `UniqueId`): the thread ends when the round is done or has failed.
    Once,
    /// Rounds one after another for as long as the process lives (`ciera launch`).
    Forever,
}

/// Start a root server on `listener` in a background thread. `round_timeout` bounds how long
/// a round waits for its last rank after the first one joined.
pub fn spawn_root(
    listener: TcpListener,
    secret: [u8; 32],
    mode: RootMode,
    round_timeout: Duration,
) -> Result<SocketAddr> {
    let addr = listener
        .local_addr()
        .map_err(|e| Error::Bootstrap(format!("root listener address: {e}")))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::Bootstrap(format!("root listener on {addr}: {e}")))?;
    thread::Builder::new()
        .name("ciera-root".into())
        .spawn(move || root_main(listener, secret, mode, round_timeout))
        .map_err(|e| Error::Bootstrap(format!("starting the root thread: {e}")))?;
    Ok(addr)
}

struct Joined {
    rank: usize,
    nranks: usize,
    info: Vec<u8>,
    stream: TcpStream,
    from: SocketAddr,
}

impl Joined {
    fn who(&self) -> String {
        match PeerInfo::from_bytes(&self.info) {
            Ok(p) => format!("pid {} on {} ({})", p.pid, p.host_id, self.from),
            Err(_) => format!("{}", self.from),
        }
    }
}

#[derive(Default)]
struct Round {
    nranks: Option<usize>,
    first_rank: usize,
    /// By rank: grows with the ranks that joined, never with what a hello claims.
    members: BTreeMap<usize, Joined>,
    started: Option<Instant>,
    failed: Option<(String, Instant)>,
}

impl Round {
    fn add(&mut self, j: Joined) {
        if let Some((reason, _)) = &self.failed {
            refuse(j.stream, reason);
            return;
        }
        // greet checked these; a hello that gets here unchecked must not size anything.
        if let Some(reason) = hello_problem(j.nranks, j.rank) {
            refuse(j.stream, &reason);
            return;
        }
        match self.nranks {
            None => {
                self.nranks = Some(j.nranks);
                self.first_rank = j.rank;
                self.started = Some(Instant::now());
            }
            Some(n) if n != j.nranks => {
                let reason = format!(
                    "ranks disagree on the number of ranks: rank {} ({}) says nranks={}, rank {} \
                     said nranks={n}",
                    j.rank,
                    j.who(),
                    j.nranks,
                    self.first_rank
                );
                self.fail(reason, Some(j));
                return;
            }
            Some(_) => {}
        }
        if let Some(prev) = self.members.get(&j.rank) {
            let reason = format!(
                "two processes claim rank {}: {} and {}",
                j.rank,
                prev.who(),
                j.who()
            );
            self.fail(reason, Some(j));
            return;
        }
        self.members.insert(j.rank, j);
    }

    fn complete(&self) -> bool {
        self.nranks == Some(self.members.len())
    }

    fn send_table(&mut self) {
        let mut msg = header(KIND_TABLE);
        msg.extend_from_slice(&(self.members.len() as u32).to_le_bytes());
        for m in self.members.values() {
            msg.extend_from_slice(&(m.info.len() as u32).to_le_bytes());
            msg.extend_from_slice(&m.info);
        }
        for m in self.members.values_mut() {
            // A rank that left already learns nothing; the others proceed, and its peers will
            // find its links dead.
            let _ = m.stream.write_all(&msg);
        }
        self.members.clear();
    }

    fn fail(&mut self, reason: String, newcomer: Option<Joined>) {
        for m in std::mem::take(&mut self.members).into_values() {
            refuse(m.stream, &reason);
        }
        if let Some(j) = newcomer {
            refuse(j.stream, &reason);
        }
        self.failed = Some((reason, Instant::now()));
    }

    /// The ranks that have not joined, as text: the first few of them and how many there are.
    fn missing(&self) -> (usize, String) {
        const SHOWN: usize = 32;
        let n = self.nranks.unwrap_or(0);
        let count = n - self.members.len();
        let first: Vec<usize> = (0..n)
            .filter(|r| !self.members.contains_key(r))
            .take(SHOWN)
            .collect();
        let more = if count > first.len() {
            format!(" and {} more", count - first.len())
        } else {
            String::new()
        };
        (count, format!("{first:?}{more}"))
    }
}

/// Why a hello's rank and nranks cannot be part of any job, or `None`.
fn hello_problem(nranks: usize, rank: usize) -> Option<String> {
    if nranks == 0 || nranks > MAX_RANKS {
        Some(format!(
            "nranks={nranks} is outside 1..={MAX_RANKS} (rank {rank})"
        ))
    } else if rank >= nranks {
        Some(format!("rank {rank} is out of range for nranks={nranks}"))
    } else {
        None
    }
}

fn header(kind: u16) -> Vec<u8> {
    let mut v = Vec::with_capacity(64);
    v.extend_from_slice(MAGIC);
    v.extend_from_slice(&VERSION.to_le_bytes());
    v.extend_from_slice(&kind.to_le_bytes());
    v
}

fn refuse(mut stream: TcpStream, reason: &str) {
    let mut msg = header(KIND_REFUSE);
    msg.extend_from_slice(&(reason.len() as u32).to_le_bytes());
    msg.extend_from_slice(reason.as_bytes());
    let _ = stream.write_all(&msg);
}

fn root_main(listener: TcpListener, secret: [u8; 32], mode: RootMode, round_timeout: Duration) {
    let (tx, rx) = mpsc::channel::<Joined>();
    let mut round = Round::default();
    loop {
        match listener.accept() {
            Ok((stream, from)) => {
                let tx = tx.clone();
                let _ = thread::Builder::new()
                    .name("ciera-root-conn".into())
                    .spawn(move || greet(stream, from, secret, tx));
                continue;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {}
            Err(e) => {
                eprintln!("ciera: bootstrap root: accept failed: {e}");
                thread::sleep(Duration::from_millis(50));
            }
        }
        while let Ok(j) = rx.try_recv() {
            round.add(j);
        }
        if round.complete() {
            round.send_table();
            if mode == RootMode::Once {
                return;
            }
            round = Round::default();
        }
        if let (Some(started), None) = (round.started, &round.failed) {
            if started.elapsed() > round_timeout {
                let (count, missing) = round.missing();
                let n = round.nranks.unwrap_or(0);
                let reason = format!(
                    "timed out after {round_timeout:?}: {} of {n} ranks joined; rank(s) {missing} \
                     never did (not started, crashed, or pointed at another root)",
                    n - count
                );
                round.fail(reason, None);
            }
        }
        if let Some((_, at)) = &round.failed {
            // Keep answering late joiners with the reason for a while, then start afresh (or
            // stop, for a one-job root).
            let linger = if mode == RootMode::Once {
                round_timeout
            } else {
                Duration::from_secs(5)
            };
            if at.elapsed() > linger {
                if mode == RootMode::Once {
                    return;
                }
                round = Round::default();
            }
        }
        thread::sleep(Duration::from_millis(2));
    }
}

/// Authenticate one connection and read its hello; hand it to the coordinator if every field
/// is sound, else refuse the connection with the reason (and log it).
fn greet(mut stream: TcpStream, from: SocketAddr, secret: [u8; 32], tx: mpsc::Sender<Joined>) {
    let deadline = Instant::now() + HELLO_TIMEOUT;
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let identity = match auth::handshake(
        &mut stream,
        Role::Server,
        &secret,
        ROOT_IDENTITY,
        None,
        deadline,
    ) {
        Ok(id) => id,
        Err(e) => {
            eprintln!("ciera: bootstrap root: refused a connection from {from}: {e}");
            return;
        }
    };
    let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
    match read_hello(&mut stream, &identity) {
        Ok((nranks, rank, info)) => {
            let _ = stream.set_read_timeout(None);
            let _ = tx.send(Joined {
                rank,
                nranks,
                info,
                stream,
                from,
            });
        }
        Err(reason) => {
            eprintln!(
                "ciera: bootstrap root: refused the hello from {from} ({identity}): {reason}"
            );
            refuse(stream, &format!("bad hello: {reason}"));
        }
    }
}

/// Reads and checks a hello on a connection that authenticated as `identity`: each field is
/// checked before anything is sized by it.
fn read_hello(
    stream: &mut TcpStream,
    identity: &str,
) -> std::result::Result<(usize, usize, Vec<u8>), String> {
    let kind = read_header(stream).map_err(|e| e.to_string())?;
    if kind != KIND_HELLO {
        return Err(format!("message kind {kind}, expected a hello"));
    }
    let nranks = read_u32(stream).map_err(|e| format!("reading nranks: {e}"))? as usize;
    let rank = read_u32(stream).map_err(|e| format!("reading the rank: {e}"))? as usize;
    if let Some(problem) = hello_problem(nranks, rank) {
        return Err(problem);
    }
    if identity != rank_identity(rank, nranks) {
        return Err(format!(
            "it says rank {rank} of {nranks}, but the connection authenticated as {identity:?}"
        ));
    }
    let info = read_field(stream).map_err(|e| format!("reading its PeerInfo: {e}"))?;
    PeerInfo::from_bytes(&info).map_err(|e| format!("rank {rank}'s PeerInfo: {e}"))?;
    Ok((nranks, rank, info))
}

fn read_header(s: &mut TcpStream) -> std::io::Result<u16> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    if &b[..4] != MAGIC {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "not a CIERA bootstrap message",
        ));
    }
    let version = u16::from_le_bytes([b[4], b[5]]);
    if version != VERSION {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("bootstrap version {version}, this build speaks {VERSION}"),
        ));
    }
    Ok(u16::from_le_bytes([b[6], b[7]]))
}

fn read_u32(s: &mut TcpStream) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_field(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let len = read_u32(s)? as usize;
    if len > MAX_FIELD {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("a {len}-byte field (limit {MAX_FIELD})"),
        ));
    }
    let mut v = vec![0u8; len];
    s.read_exact(&mut v)?;
    Ok(v)
}

/// Where a rank finds the root and the job secret. Called again after a failed connection:
/// a rendezvous file may be rewritten by a new root.
pub type RootSource<'a> = dyn FnMut() -> Result<Option<(Vec<SocketAddr>, [u8; 32])>> + 'a;

/// Join a round at the root: authenticate, say hello, wait for the table. Returns the table
/// and the job secret that authenticated (the transport's handshakes use it too).
pub fn join(
    source: &mut RootSource<'_>,
    nranks: usize,
    rank: usize,
    me: &PeerInfo,
    deadline: Instant,
) -> Result<(Vec<PeerInfo>, [u8; 32])> {
    let started = Instant::now();
    if nranks > u32::MAX as usize || rank > u32::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} of {nranks} does not fit the bootstrap's 32-bit fields"
        )));
    }
    let (mut stream, addr, secret) = connect_root(source, deadline)?;
    let me_id = rank_identity(rank, nranks);
    if let Err(e) = auth::handshake(
        &mut stream,
        Role::Client,
        &secret,
        &me_id,
        Some(ROOT_IDENTITY),
        deadline,
    ) {
        let hint = match &e {
            TransportError::Auth { detail } if detail.contains("secret") => {
                " (do all ranks have the same CIERA_SECRET / UniqueId?)"
            }
            _ => "",
        };
        return Err(Error::Bootstrap(format!(
            "rank {rank}: authenticating with the root at {addr} failed: {e}{hint}"
        )));
    }
    let io = |e: std::io::Error, what: &str| -> Error {
        if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut {
            Error::Timeout {
                op: format!(
                    "bootstrap: rank {rank} waiting for the root at {addr} to hear from all \
                     {nranks} ranks ({what})"
                ),
                peer: None,
                after: started.elapsed(),
            }
        } else {
            Error::Bootstrap(format!("rank {rank}: {what} with the root at {addr}: {e}"))
        }
    };
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    let _ = stream.set_read_timeout(Some(left));
    let _ = stream.set_write_timeout(Some(left));
    let info = me.to_bytes();
    let mut hello = header(KIND_HELLO);
    hello.extend_from_slice(&(nranks as u32).to_le_bytes());
    hello.extend_from_slice(&(rank as u32).to_le_bytes());
    hello.extend_from_slice(&(info.len() as u32).to_le_bytes());
    hello.extend_from_slice(&info);
    stream
        .write_all(&hello)
        .map_err(|e| io(e, "sending hello"))?;
    let kind = read_header(&mut stream).map_err(|e| io(e, "reading the table"))?;
    match kind {
        KIND_TABLE => {
            let n = read_u32(&mut stream).map_err(|e| io(e, "reading the table"))? as usize;
            if n != nranks {
                return Err(Error::Bootstrap(format!(
                    "rank {rank}: the root sent a table of {n} ranks, expected {nranks}"
                )));
            }
            let mut table = Vec::with_capacity(n);
            for r in 0..n {
                let b = read_field(&mut stream).map_err(|e| io(e, "reading the table"))?;
                let p = PeerInfo::from_bytes(&b).map_err(|e| {
                    Error::Bootstrap(format!("rank {rank}: rank {r}'s address in the table: {e}"))
                })?;
                table.push(p);
            }
            Ok((table, secret))
        }
        KIND_REFUSE => {
            let b = read_field(&mut stream).map_err(|e| io(e, "reading the root's answer"))?;
            Err(Error::Bootstrap(format!(
                "rank {rank}: the root at {addr} refused the job: {}",
                String::from_utf8_lossy(&b)
            )))
        }
        k => Err(Error::Bootstrap(format!(
            "rank {rank}: unexpected message kind {k} from the root"
        ))),
    }
}

fn connect_root(
    source: &mut RootSource<'_>,
    deadline: Instant,
) -> Result<(TcpStream, SocketAddr, [u8; 32])> {
    let mut last_err = String::from("no root address yet");
    loop {
        if let Some((addrs, secret)) = source()? {
            for addr in addrs {
                let left = deadline.saturating_duration_since(Instant::now());
                let attempt = left
                    .min(Duration::from_secs(5))
                    .max(Duration::from_millis(10));
                match TcpStream::connect_timeout(&addr, attempt) {
                    Ok(s) => {
                        let _ = s.set_nodelay(true);
                        return Ok((s, addr, secret));
                    }
                    Err(e) => last_err = format!("{addr}: {e}"),
                }
            }
        }
        if Instant::now() >= deadline {
            return Err(Error::Bootstrap(format!(
                "could not reach the root: {last_err}"
            )));
        }
        thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: [u8; 32] = [0x42; 32];

    fn deadline() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

    /// A root of its own, and an authenticated connection to it claiming `identity`.
    fn connect_as(identity: &str) -> TcpStream {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let root = spawn_root(listener, SECRET, RootMode::Once, Duration::from_secs(30)).unwrap();
        let mut s = TcpStream::connect(root).unwrap();
        let who = auth::handshake(
            &mut s,
            Role::Client,
            &SECRET,
            identity,
            Some(ROOT_IDENTITY),
            deadline(),
        )
        .unwrap();
        assert_eq!(who, ROOT_IDENTITY);
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s
    }

    /// The root's answer: its refusal reason, or a panic if it sent anything else.
    fn refusal(s: &mut TcpStream) -> String {
        let kind = read_header(s).unwrap();
        assert_eq!(kind, KIND_REFUSE);
        String::from_utf8(read_field(s).unwrap()).unwrap()
    }

    fn hello(nranks: u32, rank: u32, len: u32, info: &[u8]) -> Vec<u8> {
        let mut h = header(KIND_HELLO);
        for v in [nranks, rank, len] {
            h.extend_from_slice(&v.to_le_bytes());
        }
        h.extend_from_slice(info);
        h
    }

    fn info() -> Vec<u8> {
        PeerInfo {
            host_id: "h".into(),
            addr: "127.0.0.1:9".parse().unwrap(),
            pid: 7,
            rdma: false,
        }
        .to_bytes()
    }

    #[test]
    fn an_absurd_length_is_refused_before_it_is_allocated() {
        let mut s = connect_as(&rank_identity(0, 2));
        s.write_all(&hello(2, 0, u32::MAX, b"")).unwrap();
        let why = refusal(&mut s);
        assert!(why.contains("4294967295-byte field (limit 65536)"), "{why}");
    }

    #[test]
    fn a_hello_must_name_the_rank_the_connection_authenticated_as() {
        let mut s = connect_as(&rank_identity(0, 2));
        let info = info();
        s.write_all(&hello(2, 1, info.len() as u32, &info)).unwrap();
        let why = refusal(&mut s);
        assert!(
            why.contains("says rank 1 of 2")
                && why.contains("authenticated as \"bootstrap rank 0 of 2\""),
            "{why}"
        );
    }

    #[test]
    fn counts_ranks_and_kinds_are_checked_first() {
        let info = info();
        let cases: [(u32, u32, &str); 3] = [
            (0, 0, "nranks=0 is outside 1..=1048576"),
            (MAX_RANKS as u32 + 1, 0, "nranks=1048577 is outside"),
            (3, 3, "rank 3 is out of range for nranks=3"),
        ];
        for (nranks, rank, needle) in cases {
            let mut s = connect_as(&rank_identity(rank as usize, nranks as usize));
            s.write_all(&hello(nranks, rank, info.len() as u32, &info))
                .unwrap();
            let why = refusal(&mut s);
            assert!(why.contains(needle), "{why}");
        }
        let mut s = connect_as(&rank_identity(0, 1));
        s.write_all(&header(KIND_TABLE)).unwrap();
        assert!(refusal(&mut s).contains("message kind 2, expected a hello"));
    }

    #[test]
    fn the_root_listens_where_the_job_named_it() {
        let at = |named: &str, single: bool| root_listen_addr(named, 5000, single);
        assert_eq!(
            at("127.0.0.1:5000", false).unwrap(),
            "127.0.0.1:5000".parse().unwrap()
        );
        assert_eq!(
            at("[::1]:5000", false).unwrap(),
            "[::1]:5000".parse().unwrap()
        );
        assert!(at("localhost:5000", true).unwrap().ip().is_loopback());
        let err = at("localhost:5000", false).unwrap_err().to_string();
        assert!(
            err.contains("loopback") && err.contains("other hosts"),
            "{err}"
        );
        let l = bind_root("127.0.0.1:0".parse().unwrap()).unwrap();
        assert_eq!(l.local_addr().unwrap().ip(), IpAddr::from([127, 0, 0, 1]));
        // TEST-NET-1: never an address of this host.
        let err = bind_root("192.0.2.1:0".parse().unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("192.0.2.1") && err.contains("not one of this host's"),
            "{err}"
        );
    }
}
