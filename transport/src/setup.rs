//! Building the full mesh of links (`Endpoint::connect_all`).
//!
//! For every pair the higher rank connects to the lower rank's listener, so no two ranks ever
//! wait on each other in a cycle. Every connection runs in its own thread with blocking I/O
//! bounded by the deadline; the calling thread only accepts and collects results, so a stranger
//! that connects and never speaks holds one thread until the deadline and delays nobody.
//!
//! Each connection starts with the auth handshake (`auth.rs`): the connector is the client and
//! claims the identity `link rank <from> of <world> pid <pid>`, the acceptor the server with its
//! own; the connector expects exactly the identity its peer table gives the rank it dialled.
//! Then the connector sends a `LinkHello` frame; the acceptor checks it against the identity
//! the connection proved and against its own peer table, and answers:
//!
//! ```text
//! LinkHello (connector -> acceptor):
//!   "CIERALNK" | version u8 = 2 | kind u8 (0 tcp, 1 shm, 2 rdma) | from u32 | to u32 | world u32
//!   | pid u32 | host_id str | doorbell name str | doorbell fd u32        (shm; tcp: "", 0)
//! LinkReply (acceptor -> connector):
//!   0 | rank u32 | pid u32 | segment name str | segment fd u32
//!     | doorbell name str | doorbell fd u32                              (accepted)
//!   1 | message str                                                    (refused, says why)
//! ShmAck (connector -> acceptor, shm only; sent after mapping the segment and the doorbell):
//!   0 | ""   or   1 | message str
//! ```
//!
//! (`str` is a u16 length and UTF-8 bytes; each message travels in a u32-length frame.)
//! Shared memory is passed by descriptor, not by name: the creator's memory file is opened as
//! `/proc/<creator pid>/fd/<fd>` (the pid from the peer table), checked to be the named file,
//! and the creator closes its descriptor once the peer has it mapped. Nothing is ever named in
//! /dev/shm, so no failure, not even SIGKILL in the middle of setup, leaves anything there.
//! For TCP the connection then becomes the data link; for shm it stays as the control channel.
//! For RDMA both sides then exchange queue pair addresses over it (`rdma/`) and it stays as
//! the control channel too.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::auth::{self, Role};
use crate::config::{TcpBuffers, TcpCongestion};
use crate::doorbell::Doorbell;
use crate::endpoint::{Link, LinkInner};
use crate::peer::MAX_HOST_ID_BYTES;
use crate::shm::{self, ShmLink};
use crate::sys::random_hex;
use crate::tcp::{self, TcpLink};
use crate::wire::{recv_frame, send_frame, Dec, Enc};
use crate::{Kind, PeerInfo, Result, TransportError};

const LINK_MAGIC: &[u8; 8] = b"CIERALNK";
const LINK_VERSION: u8 = 2;
/// Longest shared memory name (memfd names stop at 249 bytes).
const MAX_NAME_BYTES: usize = 200;
const MAX_MESSAGE_BYTES: usize = 4096;
const OK: u8 = 0;
const REFUSED: u8 = 1;

pub(crate) struct SetupContext {
    pub my_rank: usize,
    pub peers: Vec<PeerInfo>,
    pub kinds: Vec<Kind>,
    pub secret: [u8; 32],
    pub deadline: Instant,
    pub ring_bytes: usize,
    pub tcp_buffers: TcpBuffers,
    pub tcp_congestion: TcpCongestion,
    /// Name and descriptor of this rank's shared doorbell, if any peer uses shm.
    pub bell: Option<(String, u32)>,
    /// Offer memory to, and read memory of, shm peers (`CIERA_SHM_SINGLE_COPY`).
    pub single_copy: bool,
}

enum Event {
    Linked {
        rank: usize,
        link: Link,
    },
    /// A connection that never authenticated: reported in a timeout message, otherwise ignored.
    Stranger {
        from: SocketAddr,
        error: TransportError,
    },
    /// An authenticated peer or our own connect attempt failed: setup fails.
    Failed(TransportError),
}

fn desc(rank: usize, info: &PeerInfo) -> String {
    format!("rank {rank} (pid {}, {})", info.pid, info.addr)
}

/// Who one end of a link is, as its auth handshake claims and proves it.
fn link_identity(rank: usize, world: usize, pid: u32) -> String {
    format!("link rank {rank} of {world} pid {pid}")
}

/// Establishes a link to every other rank. Returns `links[rank]`, `None` at `my_rank`.
pub(crate) fn establish(listener: &TcpListener, ctx: SetupContext) -> Result<Vec<Option<Link>>> {
    let start = Instant::now();
    let ctx = Arc::new(ctx);
    let world = ctx.peers.len();
    let (tx, rx) = mpsc::channel::<Event>();
    for rank in 0..ctx.my_rank {
        let (ctx, tx) = (ctx.clone(), tx.clone());
        spawn(format!("ciera-connect-{rank}"), move || {
            let event = match connect_to(&ctx, rank) {
                Ok(link) => Event::Linked { rank, link },
                Err(e) => Event::Failed(e),
            };
            let _ = tx.send(event);
        })?;
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| TransportError::io("set listener non-blocking", "connect_all", e))?;

    let mut links: Vec<Option<Link>> = (0..world).map(|_| None).collect();
    let mut missing = world - 1;
    let mut strangers: Vec<String> = Vec::new();
    let mut stranger_count = 0usize;
    let accepting = ctx.my_rank + 1 < world;
    let mut final_drain = false;
    while missing > 0 {
        if accepting {
            accept_pending(listener, &ctx, &tx)?;
        }
        let now = Instant::now();
        if now >= ctx.deadline {
            if !final_drain {
                // Give the worker threads, which watch the same deadline, a moment to report
                // their more specific errors (connect refused, auth failure, ...).
                final_drain = true;
                if let Ok(event) = rx.recv_timeout(Duration::from_millis(100)) {
                    handle(
                        event,
                        &mut links,
                        &mut missing,
                        &mut strangers,
                        &mut stranger_count,
                    )?;
                }
                continue;
            }
            let waiting: Vec<usize> = (0..world)
                .filter(|&r| r != ctx.my_rank && links[r].is_none())
                .collect();
            let mut op = format!(
                "connect_all on rank {} of {world}: no link to rank(s) {waiting:?} after {:.1?}",
                ctx.my_rank,
                now - start
            );
            if stranger_count > 0 {
                op.push_str(&format!(
                    "; refused {stranger_count} connection(s) that failed authentication (a rank with \
                     another job secret?): {}",
                    strangers.join("; ")
                ));
            }
            return Err(TransportError::Timeout { op });
        }
        let slice = (ctx.deadline - now).min(Duration::from_millis(5));
        if let Ok(event) = rx.recv_timeout(slice) {
            handle(
                event,
                &mut links,
                &mut missing,
                &mut strangers,
                &mut stranger_count,
            )?;
        }
    }
    Ok(links)
}

/// Accepts every connection waiting in the listener's backlog, each into its own thread.
fn accept_pending(
    listener: &TcpListener,
    ctx: &Arc<SetupContext>,
    tx: &mpsc::Sender<Event>,
) -> Result<()> {
    loop {
        match listener.accept() {
            Ok((stream, from)) => {
                let (ctx, tx) = (ctx.clone(), tx.clone());
                spawn(format!("ciera-accept-{from}"), move || {
                    let _ = tx.send(accept_from(&ctx, stream, from));
                })?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => {}
            Err(e) => {
                return Err(TransportError::io(
                    "accept",
                    format!("rank {} listener", ctx.my_rank),
                    e,
                ))
            }
        }
    }
}

fn handle(
    event: Event,
    links: &mut [Option<Link>],
    missing: &mut usize,
    strangers: &mut Vec<String>,
    stranger_count: &mut usize,
) -> Result<()> {
    match event {
        Event::Linked { rank, link } => {
            if links[rank].is_some() {
                return Err(TransportError::Protocol {
                    detail: format!("rank {rank} connected twice (two processes claim that rank?)"),
                });
            }
            links[rank] = Some(link);
            *missing -= 1;
        }
        Event::Stranger { from, error } => {
            *stranger_count += 1;
            if strangers.len() < 3 {
                strangers.push(format!("{from}: {error}"));
            }
        }
        Event::Failed(e) => return Err(e),
    }
    Ok(())
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> Result<()> {
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(f)
        .map(|_| ())
        .map_err(|e| TransportError::io("spawn thread", name, e))
}

/// Connects, retrying refused or failed attempts until the deadline.
fn connect_retry(addr: SocketAddr, deadline: Instant, who: &str) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(5);
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(TransportError::Timeout {
                op: format!("connect to {who}: deadline passed before the first attempt"),
            });
        }
        match TcpStream::connect_timeout(&addr, (deadline - now).min(Duration::from_secs(10))) {
            Ok(stream) => return Ok(stream),
            Err(e) => {
                let now = Instant::now();
                if now + backoff >= deadline {
                    return Err(TransportError::io(
                        "connect",
                        format!("{who} (retried until the deadline)"),
                        e,
                    ));
                }
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
        }
    }
}

fn refuse(stream: &mut TcpStream, deadline: Instant, message: &str) {
    let mut e = Enc::default();
    e.u8(REFUSED)
        .str(&message[..message.len().min(MAX_MESSAGE_BYTES)]);
    let _ = send_frame(stream, &e.0, deadline, "link setup: sending refusal");
}

/// Connector side of one pair (this rank is the higher one).
fn connect_to(ctx: &SetupContext, rank: usize) -> Result<Link> {
    let peer = &ctx.peers[rank];
    let who = desc(rank, peer);
    let me = &ctx.peers[ctx.my_rank];
    let kind = ctx.kinds[rank];
    let mut stream = connect_retry(peer.addr, ctx.deadline, &who)?;
    let world = ctx.peers.len();
    auth::handshake(
        &mut stream,
        Role::Client,
        &ctx.secret,
        &link_identity(ctx.my_rank, world, me.pid),
        Some(&link_identity(rank, world, peer.pid)),
        ctx.deadline,
    )?;

    let mut hello = Enc::default();
    hello
        .bytes(LINK_MAGIC)
        .u8(LINK_VERSION)
        .u8(kind_code(kind))
        .u32(ctx.my_rank as u32)
        .u32(rank as u32)
        .u32(world as u32)
        .u32(me.pid)
        .str(&me.host_id);
    match (&ctx.bell, kind) {
        (Some((name, fd)), Kind::Shm) => hello.str(name).u32(*fd),
        _ => hello.str("").u32(0),
    };
    let step = format!("link setup with {who}");
    send_frame(&mut stream, &hello.0, ctx.deadline, &step)?;
    let reply = recv_frame(&mut stream, ctx.deadline, &step)?;
    let what = format!("link reply from {who}");
    let mut d = Dec::new(&reply, &what);
    if d.u8("status")? != OK {
        let message = d.str("message", MAX_MESSAGE_BYTES)?;
        return Err(TransportError::Protocol {
            detail: format!("{who} refused the {kind} link: {message}"),
        });
    }
    let (their_rank, their_pid) = (d.u32("rank")?, d.u32("pid")?);
    let seg_name = d.str("segment name", MAX_NAME_BYTES)?;
    let seg_fd = d.u32("segment fd")?;
    let bell_name = d.str("doorbell name", MAX_NAME_BYTES)?;
    let bell_fd = d.u32("doorbell fd")?;
    d.finish()?;
    if their_rank as usize != rank || their_pid != peer.pid {
        return Err(TransportError::Protocol {
            detail: format!(
                "connected to {} expecting {who}, but it is rank {their_rank} pid {their_pid} (inconsistent peer tables?)",
                peer.addr
            ),
        });
    }
    match kind {
        Kind::Tcp => {
            tcp::configure(&stream, ctx.tcp_buffers, &ctx.tcp_congestion, &who)?;
            Ok(Link::new(rank, LinkInner::Tcp(TcpLink::new(stream, who))))
        }
        Kind::Rdma => rdma_link(stream, ctx.deadline, rank, who, peer.pid),
        Kind::Shm => {
            let mapped = (|| -> Result<_> {
                check_shm_name(&seg_name, peer.pid, &who)?;
                check_shm_name(&bell_name, peer.pid, &who)?;
                let (seg, _) = shm::open_segment(peer.pid, seg_fd, &seg_name)?;
                // Single copy: try the acceptor's probe, publish ours (it tries it on our ack).
                shm::probe_peer(&seg, 1, peer.pid, ctx.single_copy);
                shm::publish_probe(&seg, 1, ctx.single_copy);
                let bell = Doorbell::open_shared(peer.pid, bell_fd, &bell_name)?;
                Ok((seg, bell))
            })();
            let mut ack = Enc::default();
            match &mapped {
                Ok(_) => ack.u8(OK).str(""),
                Err(e) => ack.u8(REFUSED).str(&e.to_string()),
            };
            send_frame(&mut stream, &ack.0, ctx.deadline, &step)?;
            let (seg, bell) = mapped?;
            let link = ShmLink::new(seg, 1, bell, stream, who, peer.pid)?;
            Ok(Link::new(rank, LinkInner::Shm(link)))
        }
    }
}

fn accept_from(ctx: &SetupContext, mut stream: TcpStream, from: SocketAddr) -> Event {
    let me = link_identity(ctx.my_rank, ctx.peers.len(), ctx.peers[ctx.my_rank].pid);
    let proved = match auth::handshake(
        &mut stream,
        Role::Server,
        &ctx.secret,
        &me,
        None,
        ctx.deadline,
    ) {
        Ok(identity) => identity,
        Err(error) => return Event::Stranger { from, error },
    };
    match accept_link(ctx, stream, from, &proved) {
        Ok((rank, link)) => Event::Linked { rank, link },
        Err(e) => Event::Failed(e),
    }
}

struct LinkHello {
    kind: Kind,
    from: usize,
    to: usize,
    world: usize,
    pid: u32,
    host_id: String,
    bell_name: String,
    bell_fd: u32,
}

fn parse_hello(body: &[u8], what: &str) -> Result<LinkHello> {
    let mut d = Dec::new(body, what);
    if &d.array::<8>("magic")? != LINK_MAGIC {
        return Err(TransportError::Protocol {
            detail: format!("{what}: bad magic"),
        });
    }
    let version = d.u8("version")?;
    if version != LINK_VERSION {
        return Err(TransportError::Protocol {
            detail: format!("{what}: version {version}, this side speaks {LINK_VERSION}"),
        });
    }
    let kind = match d.u8("kind")? {
        0 => Kind::Tcp,
        1 => Kind::Shm,
        2 => Kind::Rdma,
        k => {
            return Err(TransportError::Protocol {
                detail: format!("{what}: unknown link kind {k}"),
            })
        }
    };
    let hello = LinkHello {
        kind,
        from: d.u32("from rank")? as usize,
        to: d.u32("to rank")? as usize,
        world: d.u32("world size")? as usize,
        pid: d.u32("pid")?,
        host_id: d.str("host id", MAX_HOST_ID_BYTES)?,
        bell_name: d.str("doorbell name", MAX_NAME_BYTES)?,
        bell_fd: d.u32("doorbell fd")?,
    };
    d.finish()?;
    Ok(hello)
}

/// Why this rank will not take `hello` on a connection that proved `proved`, or `None` if it
/// will.
fn check_hello(ctx: &SetupContext, h: &LinkHello, proved: &str) -> Option<String> {
    let world = ctx.peers.len();
    let me = ctx.my_rank;
    let claimed = link_identity(h.from, h.world, h.pid);
    if claimed != proved {
        return Some(format!(
            "the link hello says {claimed:?}, but the connection authenticated as {proved:?}"
        ));
    }
    if h.world != world {
        return Some(format!(
            "rank {} thinks the world has {} ranks, rank {me} has {world}",
            h.from, h.world
        ));
    }
    if h.to != me {
        return Some(format!(
            "rank {} meant to reach rank {}, but this is rank {me}",
            h.from, h.to
        ));
    }
    if h.from <= me || h.from >= world {
        return Some(format!(
            "rank {me} accepts links only from ranks {}..{world}, not {}",
            me + 1,
            h.from
        ));
    }
    let expected = &ctx.peers[h.from];
    if h.pid != expected.pid || h.host_id != expected.host_id {
        return Some(format!(
            "the connection claims rank {} with pid {} on {:?}, but peers[{}] has pid {} on {:?}",
            h.from, h.pid, h.host_id, h.from, expected.pid, expected.host_id
        ));
    }
    let mine = ctx.kinds[h.from];
    if h.kind != mine {
        return Some(format!(
            "rank {} wants a {} link, rank {me} chose {mine} (do the ranks have different CIERA_TRANSPORT?)",
            h.from, h.kind
        ));
    }
    None
}

/// Shared memory of process `pid` is called `ciera-<pid>-...` (letters, digits, dashes).
fn check_shm_name(name: &str, pid: u32, who: &str) -> Result<()> {
    let prefix = format!("ciera-{pid}-");
    let ok = name.len() > prefix.len()
        && name.starts_with(&prefix)
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(TransportError::Protocol {
            detail: format!("{who} named shm object {name:?}, which is not a CIERA name"),
        })
    }
}

/// Acceptor side of one pair, after authentication.
fn accept_link(
    ctx: &SetupContext,
    mut stream: TcpStream,
    from: SocketAddr,
    proved: &str,
) -> Result<(usize, Link)> {
    let step = format!("link setup with {from}");
    let body = recv_frame(&mut stream, ctx.deadline, &step)?;
    let hello = match parse_hello(&body, &format!("link hello from {from}")) {
        Ok(h) => h,
        Err(e) => {
            refuse(&mut stream, ctx.deadline, &e.to_string());
            return Err(e);
        }
    };
    if let Some(why) = check_hello(ctx, &hello, proved) {
        refuse(&mut stream, ctx.deadline, &why);
        return Err(TransportError::Protocol {
            detail: format!("link from {from} refused: {why}"),
        });
    }
    let rank = hello.from;
    let who = desc(rank, &ctx.peers[rank]);
    let step = format!("link setup with {who}");
    let me = &ctx.peers[ctx.my_rank];
    match hello.kind {
        Kind::Tcp | Kind::Rdma => {
            let mut reply = Enc::default();
            reply
                .u8(OK)
                .u32(ctx.my_rank as u32)
                .u32(me.pid)
                .str("")
                .u32(0)
                .str("")
                .u32(0);
            send_frame(&mut stream, &reply.0, ctx.deadline, &step)?;
            if hello.kind == Kind::Rdma {
                let link = rdma_link(stream, ctx.deadline, rank, who, hello.pid)?;
                return Ok((rank, link));
            }
            tcp::configure(&stream, ctx.tcp_buffers, &ctx.tcp_congestion, &who)?;
            Ok((
                rank,
                Link::new(rank, LinkInner::Tcp(TcpLink::new(stream, who))),
            ))
        }
        Kind::Shm => {
            let seg_name = format!(
                "ciera-{}-{}-{}-{}",
                me.pid,
                random_hex(8),
                ctx.my_rank,
                rank
            );
            let prepared = (|| -> Result<_> {
                check_shm_name(&hello.bell_name, hello.pid, &who)?;
                let bell = Doorbell::open_shared(hello.pid, hello.bell_fd, &hello.bell_name)?;
                let seg = shm::create_segment(&seg_name, ctx.ring_bytes)?;
                shm::publish_probe(&seg, 0, ctx.single_copy);
                Ok((bell, seg))
            })();
            let (bell, seg) = match prepared {
                Ok(p) => p,
                Err(e) => {
                    refuse(
                        &mut stream,
                        ctx.deadline,
                        &format!("rank {} could not set up shm: {e}", ctx.my_rank),
                    );
                    return Err(e);
                }
            };
            let (my_bell, my_bell_fd) = match &ctx.bell {
                Some((name, fd)) => (name.as_str(), *fd),
                None => ("", 0),
            };
            let seg_fd = seg.shared_fd().expect("a new segment is shared");
            let mut reply = Enc::default();
            reply
                .u8(OK)
                .u32(ctx.my_rank as u32)
                .u32(me.pid)
                .str(&seg_name)
                .u32(seg_fd)
                .str(my_bell)
                .u32(my_bell_fd);
            send_frame(&mut stream, &reply.0, ctx.deadline, &step)?;
            let ack = recv_frame(&mut stream, ctx.deadline, &step)?;
            let what = format!("shm ack from {who}");
            let mut d = Dec::new(&ack, &what);
            let status = d.u8("status")?;
            let message = d.str("message", MAX_MESSAGE_BYTES)?;
            d.finish()?;
            // The peer has mapped it (or failed to): nobody needs to open it any more.
            seg.stop_sharing();
            if status != OK {
                return Err(TransportError::Protocol {
                    detail: format!("{who} could not map the shm segment: {message}"),
                });
            }
            shm::probe_peer(&seg, 0, hello.pid, ctx.single_copy);
            let link = ShmLink::new(seg, 0, bell, stream, who, hello.pid)?;
            Ok((rank, Link::new(rank, LinkInner::Shm(link))))
        }
    }
}

fn kind_code(kind: Kind) -> u8 {
    match kind {
        Kind::Tcp => 0,
        Kind::Shm => 1,
        Kind::Rdma => 2,
    }
}

/// Both sides, after the link reply: the RDMA queue pair set up over the setup connection.
#[cfg(feature = "rdma")]
fn rdma_link(
    stream: TcpStream,
    deadline: Instant,
    rank: usize,
    who: String,
    pid: u32,
) -> Result<Link> {
    let link = crate::rdma::establish(stream, deadline, who, pid)?;
    Ok(Link::new(rank, LinkInner::Rdma(Box::new(link))))
}

/// Without the feature `connect_all` never chooses RDMA, and a peer that asks is refused by
/// `check_hello`; this is unreachable in practice.
#[cfg(not(feature = "rdma"))]
fn rdma_link(
    _stream: TcpStream,
    _deadline: Instant,
    _rank: usize,
    who: String,
    _pid: u32,
) -> Result<Link> {
    Err(TransportError::Unsupported {
        detail: format!("an RDMA link with {who}: built without the rdma feature"),
    })
}
