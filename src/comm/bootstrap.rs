//! Bootstrap: the rendezvous that turns (root address, job secret, nranks, rank) into the table
//! of every rank's transport address ([`PeerInfo`]).
//!
//! A root server listens on TCP. Each rank connects and both sides run `auth::handshake` with
//! the job secret (mutual HMAC challenge, the rank as client claiming
//! `bootstrap rank <rank> of <nranks>`, the root as server claiming `bootstrap root`: a process
//! without the secret learns nothing and is refused). The rank sends a hello: nranks, rank, its
//! PeerInfo, which must name the rank the connection authenticated as. When all nranks ranks of a
//! round have joined, the root sends every rank the table. It refuses a round where ranks
//! disagree on nranks or two processes claim one rank — every joined rank gets the reason —
//! and, after the timeout, tells the joined ranks which ranks never came.
//!
//! ```text
//! hello  (rank -> root): "CIBS" u16 version=1 u16 kind=1  u32 nranks u32 rank u32 len, PeerInfo bytes
//! table  (root -> rank): "CIBS" u16 version=1 u16 kind=2  u32 nranks, then per rank: u32 len, PeerInfo bytes
//! refuse (root -> rank): "CIBS" u16 version=1 u16 kind=3  u32 len, UTF-8 reason
//! ```

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
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
/// The root's identity in the auth handshake.
const ROOT_IDENTITY: &str = "bootstrap root";

/// A rank's identity in the auth handshake with the root.
fn rank_identity(rank: usize, nranks: usize) -> String {
    format!("bootstrap rank {rank} of {nranks}")
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
    members: Vec<Option<Joined>>,
    started: Option<Instant>,
    failed: Option<(String, Instant)>,
}

impl Round {
    fn add(&mut self, j: Joined) {
        if let Some((reason, _)) = &self.failed {
            refuse(j.stream, reason);
            return;
        }
        if j.nranks == 0 || j.rank >= j.nranks {
            let reason = format!("rank {} is out of range for nranks={}", j.rank, j.nranks);
            refuse(j.stream, &reason);
            return;
        }
        match self.nranks {
            None => {
                self.nranks = Some(j.nranks);
                self.first_rank = j.rank;
                self.members = (0..j.nranks).map(|_| None).collect();
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
        if let Some(prev) = &self.members[j.rank] {
            let reason = format!(
                "two processes claim rank {}: {} and {}",
                j.rank,
                prev.who(),
                j.who()
            );
            self.fail(reason, Some(j));
            return;
        }
        let r = j.rank;
        self.members[r] = Some(j);
    }

    fn complete(&self) -> bool {
        self.nranks.is_some() && self.members.iter().all(|m| m.is_some())
    }

    fn send_table(&mut self) {
        let mut msg = header(KIND_TABLE);
        msg.extend_from_slice(&(self.members.len() as u32).to_le_bytes());
        for m in self.members.iter().flatten() {
            msg.extend_from_slice(&(m.info.len() as u32).to_le_bytes());
            msg.extend_from_slice(&m.info);
        }
        for m in self.members.iter_mut().flatten() {
            // A rank that left already learns nothing; the others proceed, and its peers will
            // find its links dead.
            let _ = m.stream.write_all(&msg);
        }
        self.members.clear();
    }

    fn fail(&mut self, reason: String, newcomer: Option<Joined>) {
        for m in self.members.drain(..).flatten() {
            refuse(m.stream, &reason);
        }
        if let Some(j) = newcomer {
            refuse(j.stream, &reason);
        }
        self.failed = Some((reason, Instant::now()));
    }

    fn missing(&self) -> Vec<usize> {
        self.members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.is_none())
            .map(|(r, _)| r)
            .collect()
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
                let missing = round.missing();
                let n = round.nranks.unwrap_or(0);
                let reason = format!(
                    "timed out after {round_timeout:?}: {} of {n} ranks joined; rank(s) {missing:?} \
                     never did (not started, crashed, or pointed at another root)",
                    n - missing.len()
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

/// Authenticate one connection and read its hello; hand it to the coordinator.
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
    let hello = (|| -> std::io::Result<(usize, usize, Vec<u8>)> {
        let kind = read_header(&mut stream)?;
        if kind != KIND_HELLO {
            return Err(std::io::Error::new(
                ErrorKind::InvalidData,
                format!("message kind {kind}"),
            ));
        }
        let nranks = read_u32(&mut stream)? as usize;
        let rank = read_u32(&mut stream)? as usize;
        let info = read_field(&mut stream)?;
        Ok((nranks, rank, info))
    })();
    match hello {
        Ok((nranks, rank, _)) if identity != rank_identity(rank, nranks) => {
            let reason = format!(
                "it says rank {rank} of {nranks}, but the connection authenticated as {identity:?}"
            );
            eprintln!("ciera: bootstrap root: refused the hello from {from}: {reason}");
            refuse(stream, &format!("bad hello: {reason}"));
        }
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
        Err(e) => eprintln!("ciera: bootstrap root: bad hello from {from}: {e}"),
    }
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
            format!("{len}-byte field"),
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
