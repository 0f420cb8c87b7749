//! `Endpoint`: one rank's listener, its links to every peer, and `wait`, which sleeps until a
//! link may be able to make progress.

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::config::{
    shm_ring_bytes, tcp_buffer_bytes, SingleCopy, TcpCongestion, DEFAULT_SHM_RING_BYTES,
};
use crate::doorbell::Doorbell;
use crate::peer::shm_domain;
use crate::setup::{self, SetupContext};
use crate::shared::SharedRegion;
use crate::shm::ShmLink;
use crate::sys::{self, random_hex, EventFd};
use crate::tcp::TcpLink;
use crate::{host_id, interface_ip, Kind, PeerInfo, Result, TransportChoice, TransportError};

/// How long `wait` spins on the doorbell before it sleeps.
const SPIN: Duration = Duration::from_micros(5);
/// Longest futex sleep between looks at the shm control sockets: a dead peer is noticed within
/// about this long even when nothing else happens.
const CONTROL_CHECK_INTERVAL: Duration = Duration::from_millis(50);
/// With both shm and TCP links, `wait` alternates a futex sleep of this length with a zero-time
/// poll of the sockets (a futex and a socket cannot be waited on in one system call).
const MIXED_SLICE: Duration = Duration::from_micros(200);

pub(crate) enum LinkInner {
    Shm(ShmLink),
    Tcp(TcpLink),
    #[cfg(feature = "rdma")]
    Rdma(Box<crate::rdma::RdmaLink>),
}

/// A bidirectional, non-blocking byte stream to one peer. Closed set of transports (enum
/// dispatch, no virtual calls on the hot path).
pub struct Link {
    peer: usize,
    inner: LinkInner,
}

impl Link {
    pub(crate) fn new(peer: usize, inner: LinkInner) -> Link {
        Link { peer, inner }
    }

    /// The transport this link runs over.
    pub fn kind(&self) -> Kind {
        match self.inner {
            LinkInner::Shm(_) => Kind::Shm,
            LinkInner::Tcp(_) => Kind::Tcp,
            #[cfg(feature = "rdma")]
            LinkInner::Rdma(_) => Kind::Rdma,
        }
    }

    /// The peer's rank.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// Copies as much of `data` as fits now; never blocks. `Ok(0)` means no room right now.
    /// `PeerClosed` once the peer is known to be gone.
    #[inline]
    pub fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        match &mut self.inner {
            LinkInner::Shm(l) => l.try_send(data),
            LinkInner::Tcp(l) => l.try_send(data),
            #[cfg(feature = "rdma")]
            LinkInner::Rdma(l) => l.try_send(data),
        }
    }

    /// As [`Link::try_send`] for the concatenation of `parts`. TCP hands them to the kernel in
    /// one call; shm and RDMA take only the first non-empty part (call again for the rest).
    #[inline]
    pub fn try_send_vectored(&mut self, parts: &[&[u8]]) -> Result<usize> {
        match &mut self.inner {
            #[cfg(feature = "rdma")]
            LinkInner::Rdma(l) => match parts.iter().find(|p| !p.is_empty()) {
                Some(first) => l.try_send(first),
                None => Ok(0),
            },
            LinkInner::Shm(l) => match parts.iter().find(|p| !p.is_empty()) {
                Some(first) => l.try_send(first),
                None => Ok(0),
            },
            LinkInner::Tcp(l) => l.try_send_vectored(parts),
        }
    }

    /// Copies up to `buf.len()` available bytes into `buf`; never blocks. `Ok(0)` means nothing
    /// yet. Bytes the peer sent before it went away are delivered first, then `PeerClosed`.
    #[inline]
    pub fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        match &mut self.inner {
            LinkInner::Shm(l) => l.try_recv(buf),
            LinkInner::Tcp(l) => l.try_recv(buf),
            #[cfg(feature = "rdma")]
            LinkInner::Rdma(l) => l.try_recv(buf),
        }
    }

    /// Registers a device buffer (a dma-buf) with this link, for as long as the link lives.
    /// `Unsupported` on links that do not run over RDMA, and where the device or its
    /// provider has no dma-buf support (the message names `ibv_reg_dmabuf_mr`, the device
    /// and why).
    #[cfg_attr(not(feature = "rdma"), allow(unused_variables))]
    pub fn register_dmabuf(&mut self, buf: &crate::DmaBuf) -> Result<()> {
        match &mut self.inner {
            #[cfg(feature = "rdma")]
            LinkInner::Rdma(l) => l.register_dmabuf(buf),
            _ => Err(TransportError::Unsupported {
                detail: format!(
                    "device buffers need dma-buf support (ibv_reg_dmabuf_mr): no RDMA device (the link to rank {} runs over {:?})",
                    self.peer,
                    self.kind()
                ),
            }),
        }
    }

    /// Whether [`Link::try_recv`] copies with non-temporal stores (shm only: see
    /// [`crate::copy`]); for calls whose output is much bigger than the caches.
    pub fn set_streaming(&mut self, on: bool) {
        if let LinkInner::Shm(l) = &mut self.inner {
            l.set_streaming(on);
        }
    }

    /// Whether the peer can copy large payloads straight out of this process's memory (shm
    /// single copy; see `shm/`): then [`Link::offer`] may replace sending the bytes.
    #[inline]
    pub fn can_offer(&self) -> bool {
        match &self.inner {
            LinkInner::Shm(l) => l.can_offer(),
            _ => false,
        }
    }

    /// Counts `n` bytes as offered by reference: the caller tells the peer their address on
    /// the stream and keeps them unchanged until [`Link::unclaimed`] is 0 (or it calls
    /// [`Link::withdraw_offers`]). Only after [`Link::can_offer`] said yes.
    #[inline]
    pub fn offer(&mut self, n: usize) {
        if let LinkInner::Shm(l) = &mut self.inner {
            l.offer(n);
        }
    }

    /// Bytes copied out of the peer's shared buffers through our mappings (0 over TCP).
    pub fn mapped_bytes(&self) -> u64 {
        match &self.inner {
            LinkInner::Shm(l) => l.mapped_copied(),
            _ => 0,
        }
    }

    /// Bytes ever offered by reference on this link (0 over TCP).
    pub fn offered_bytes(&self) -> u64 {
        match &self.inner {
            LinkInner::Shm(l) => l.offered(),
            _ => 0,
        }
    }

    /// Bytes offered that the peer has not copied yet; `PeerClosed` if some are outstanding
    /// and the peer is gone.
    #[inline]
    pub fn unclaimed(&mut self) -> Result<u64> {
        match &mut self.inner {
            LinkInner::Shm(l) => l.unclaimed(),
            _ => Ok(0),
        }
    }

    /// After a failed call: the peer must not copy what it has not copied yet (the memory is
    /// about to be reused); it will report the link closed if it tries. No-op when nothing is
    /// outstanding.
    pub fn withdraw_offers(&mut self) {
        if let LinkInner::Shm(l) = &mut self.inner {
            l.withdraw_offers();
        }
    }

    /// Copies bytes the peer offered at `remote` (an address in its memory, as it told us,
    /// in its shared buffer `region` if it named one) into `dst`; returns how many (at least
    /// 1 unless `dst` is empty). Over TCP, or a peer that cannot offer, this is a `Protocol`
    /// error: the stream said something impossible.
    #[inline]
    pub fn try_read_peer(
        &mut self,
        remote: u64,
        region: Option<SharedRegion>,
        dst: &mut [u8],
    ) -> Result<usize> {
        match &mut self.inner {
            LinkInner::Shm(l) => l.try_read_peer(remote, region, dst),
            _ => Err(TransportError::Protocol {
                detail: format!(
                    "rank {} offered {} bytes by reference over {}",
                    self.peer,
                    self.kind(),
                    dst.len()
                ),
            }),
        }
    }

    /// Whether the peer is already known to be gone (a later `try_*` will say why).
    pub fn is_closed(&self) -> bool {
        match &self.inner {
            LinkInner::Shm(l) => l.is_closed(),
            LinkInner::Tcp(l) => l.is_closed(),
            #[cfg(feature = "rdma")]
            LinkInner::Rdma(l) => l.is_closed(),
        }
    }
}

struct WakeShared {
    requested: AtomicBool,
    eventfd: EventFd,
    /// The doorbell `wait` currently sleeps on (replaced when connect_all makes it shared).
    bell: RwLock<Arc<Doorbell>>,
}

/// A handle another thread can use to make a current or the next [`Endpoint::wait`] return at
/// once (for abort).
#[derive(Clone)]
pub struct Waker {
    shared: Arc<WakeShared>,
}

impl Waker {
    /// Makes the current or next `wait` return promptly. Cheap; callable from any thread.
    pub fn wake(&self) {
        self.shared.requested.store(true, Ordering::SeqCst);
        let bell = self
            .shared
            .bell
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        bell.ring();
        self.shared.eventfd.signal();
    }
}

impl std::fmt::Debug for Waker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waker")
            .field("requested", &self.shared.requested.load(Ordering::Relaxed))
            .finish()
    }
}

/// What a pollfd entry stands for.
#[derive(Clone, Copy)]
enum PollTarget {
    Waker,
    Tcp(usize),
    Control(usize),
    /// An RDMA link's completion channel.
    #[cfg(feature = "rdma")]
    RdmaCq(usize),
    /// An RDMA link's setup connection (liveness).
    #[cfg(feature = "rdma")]
    RdmaControl(usize),
}

/// One rank's listener, its links to every peer, and the way it sleeps until progress is
/// possible.
pub struct Endpoint {
    listener: TcpListener,
    info: PeerInfo,
    my_rank: Option<usize>,
    links: Vec<Option<Link>>,
    bell: Arc<Doorbell>,
    /// Doorbell counter sampled at the end of the last `wait` (before the caller's checks).
    bell_seen: u32,
    wake: Arc<WakeShared>,
    last_control_check: Instant,
    poll_fds: Vec<libc::pollfd>,
    poll_targets: Vec<PollTarget>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("info", &self.info)
            .field("rank", &self.my_rank)
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    /// Binds the TCP listener on `ip` (any free port). Use [`interface_ip`] for the default.
    /// If `ip` is unspecified (0.0.0.0 / ::), [`Endpoint::local_info`] advertises
    /// `interface_ip()` instead.
    pub fn bind(ip: IpAddr) -> Result<Endpoint> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| TransportError::io("bind", format!("listener on {ip}"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| TransportError::io("getsockname", format!("listener on {ip}"), e))?;
        let addr = if ip.is_unspecified() {
            SocketAddr::new(interface_ip()?, local.port())
        } else {
            local
        };
        let bell = Arc::new(Doorbell::private());
        let wake = Arc::new(WakeShared {
            requested: AtomicBool::new(false),
            eventfd: EventFd::new()?,
            bell: RwLock::new(bell.clone()),
        });
        Ok(Endpoint {
            listener,
            info: PeerInfo {
                host_id: host_id(),
                addr,
                pid: std::process::id(),
                rdma: crate::rdma_available(),
            },
            my_rank: None,
            links: Vec::new(),
            bell_seen: bell.sample(),
            bell,
            wake,
            last_control_check: Instant::now(),
            poll_fds: Vec::new(),
            poll_targets: Vec::new(),
        })
    }

    /// Bytes this rank has offered by reference (single-copy shm) on all its links so far.
    pub fn offered_bytes(&self) -> u64 {
        self.links.iter().flatten().map(Link::offered_bytes).sum()
    }

    /// Bytes this rank has copied out of peers' shared buffers through its own mappings of
    /// them (single copy without process_vm_readv, see [`crate::SharedBuffer`]).
    pub fn mapped_bytes(&self) -> u64 {
        self.links.iter().flatten().map(Link::mapped_bytes).sum()
    }

    /// What to publish through bootstrap so others can reach this endpoint.
    pub fn local_info(&self) -> PeerInfo {
        self.info.clone()
    }

    /// This endpoint's rank, once `connect_all` succeeded.
    pub fn rank(&self) -> Option<usize> {
        self.my_rank
    }

    /// Number of ranks (0 before `connect_all` succeeded).
    pub fn world_size(&self) -> usize {
        self.links.len()
    }

    /// Full mesh: connects to every other rank in `peers` (indexed by rank; `peers[my_rank]` is
    /// this endpoint's `local_info()`).
    ///
    /// Every connection runs a mutual HMAC-SHA256 challenge-response with `secret` (see
    /// [`crate::auth`]); the secret never crosses the wire. A connection that fails it is
    /// dropped and otherwise ignored (it cannot disturb setup; a timeout names it). Peers whose
    /// `host_id` in `peers` equals `peers[my_rank].host_id` get shm links unless `choice` is
    /// `Tcp` or `Rdma`; others get RDMA where both ends published `rdma` (or `choice` is
    /// `Rdma`), else TCP; `choice == Shm` with a peer on another host is `Unsupported`. The higher rank of each pair connects,
    /// the lower accepts, each connection in its own thread, so setup cannot deadlock. Fails
    /// with `Timeout` naming the missing ranks if `deadline` passes. May be retried after a
    /// failure; a second call after success is an error.
    pub fn connect_all(
        &mut self,
        my_rank: usize,
        peers: &[PeerInfo],
        secret: &[u8; 32],
        choice: TransportChoice,
        deadline: Instant,
    ) -> Result<()> {
        if let Some(rank) = self.my_rank {
            return Err(TransportError::Unsupported {
                detail: format!("connect_all called twice on the endpoint of rank {rank}"),
            });
        }
        let world = peers.len();
        if my_rank >= world {
            return Err(TransportError::Config {
                detail: format!("connect_all: my_rank {my_rank} but only {world} peers"),
            });
        }
        let me = &peers[my_rank];
        if me.pid != self.info.pid || me.addr.port() != self.info.addr.port() {
            return Err(TransportError::Config {
                detail: format!(
                    "connect_all: peers[{my_rank}] is pid {} at {}, but this endpoint is pid {} at {}",
                    me.pid, me.addr, self.info.pid, self.info.addr
                ),
            });
        }
        let shm_possible = shm_domain().is_some();
        let mut kinds = Vec::with_capacity(world);
        for (rank, peer) in peers.iter().enumerate() {
            // Decided from the shared peer table only, so both ends of a pair agree.
            let same_host = peer.host_id == me.host_id;
            let kind = match choice {
                TransportChoice::Tcp => Kind::Tcp,
                TransportChoice::Auto if same_host && shm_possible => Kind::Shm,
                TransportChoice::Auto if !same_host && me.rdma && peer.rdma => Kind::Rdma,
                TransportChoice::Auto => Kind::Tcp,
                TransportChoice::Rdma if rank == my_rank => Kind::Rdma,
                TransportChoice::Rdma => match crate::rdma_unavailable_reason() {
                    None => Kind::Rdma,
                    Some(why) => {
                        return Err(TransportError::Unsupported {
                            detail: format!("CIERA_TRANSPORT=rdma on rank {my_rank}: {why}"),
                        })
                    }
                },
                TransportChoice::Shm if rank == my_rank => Kind::Shm,
                TransportChoice::Shm if !shm_possible => {
                    return Err(TransportError::Unsupported {
                        detail: "CIERA_TRANSPORT=shm, but this machine has no /dev/shm".into(),
                    })
                }
                TransportChoice::Shm if !same_host => {
                    return Err(TransportError::Unsupported {
                        detail: format!(
                            "CIERA_TRANSPORT=shm, but rank {rank} runs on host {:?} and rank {my_rank} on {:?} \
                             (use auto or tcp)",
                            peer.host_id, me.host_id
                        ),
                    })
                }
                TransportChoice::Shm => Kind::Shm,
            };
            kinds.push(kind);
        }
        let needs_shm = kinds
            .iter()
            .enumerate()
            .any(|(r, &k)| r != my_rank && k == Kind::Shm);
        let ring_bytes = if needs_shm {
            shm_ring_bytes()?
        } else {
            DEFAULT_SHM_RING_BYTES
        };
        let tcp_buffers = tcp_buffer_bytes()?;
        let tcp_congestion = TcpCongestion::from_env()?;
        let single_copy = needs_shm && SingleCopy::from_env()? != SingleCopy::Off;
        if needs_shm {
            // A fresh page per attempt: a failed earlier attempt has stopped sharing its own.
            let name = format!("ciera-{}-{}-bell", self.info.pid, random_hex(8));
            let bell = Arc::new(Doorbell::create_shared(&name)?);
            *self.wake.bell.write().unwrap_or_else(|e| e.into_inner()) = bell.clone();
            // A wake requested before the swap still counts: `requested` is checked by wait.
            self.bell = bell;
            self.bell_seen = self.bell.sample();
        }
        let ctx = SetupContext {
            my_rank,
            peers: peers.to_vec(),
            kinds,
            secret: *secret,
            deadline,
            ring_bytes,
            tcp_buffers,
            tcp_congestion,
            bell: self
                .bell
                .shared_ref()
                .map(|(name, fd)| (name.to_string(), fd)),
            single_copy,
        };
        let result = setup::establish(&self.listener, ctx);
        // Every peer that will ever map our doorbell has done so (or setup failed): close the
        // descriptor they open it by.
        self.bell.stop_sharing();
        let links = result?;
        self.links = links;
        self.my_rank = Some(my_rank);
        self.bell_seen = self.bell.sample();
        Ok(())
    }

    /// Whether every shm link copies out of its receive ring with non-temporal stores (see
    /// [`crate::copy`]); set per call, for calls whose output is much bigger than the caches.
    pub fn set_streaming(&mut self, on: bool) {
        for link in self.links.iter_mut().flatten() {
            link.set_streaming(on);
        }
    }

    /// Registers a device buffer (a dma-buf: GPUDirect RDMA) with every RDMA link, for as
    /// long as the links live; returns how many links registered it. `Unsupported` with the
    /// reason when no link runs over RDMA (no RDMA device, built without the `rdma` feature,
    /// or not connected yet) and when the device has no dma-buf support: "device buffers
    /// need dma-buf support (ibv_reg_dmabuf_mr): ...". Nothing stays registered on error.
    pub fn register_dmabuf(&mut self, buf: &crate::DmaBuf) -> Result<usize> {
        let rdma: Vec<&mut Link> = self
            .links
            .iter_mut()
            .flatten()
            .filter(|l| l.kind() == Kind::Rdma)
            .collect();
        if rdma.is_empty() {
            let why = crate::rdma_unavailable_reason()
                .unwrap_or_else(|| "no link of this endpoint runs over RDMA".into());
            return Err(TransportError::Unsupported {
                detail: format!(
                    "device buffers need dma-buf support (ibv_reg_dmabuf_mr): no RDMA device ({why})"
                ),
            });
        }
        let mut done = 0;
        for link in rdma {
            // A failure leaves earlier links' registrations until they drop; all links share
            // one device, so the first one fails whenever any does.
            link.register_dmabuf(buf)?;
            done += 1;
        }
        Ok(done)
    }

    /// Whether some link can offer memory by reference ([`Link::can_offer`]).
    pub fn can_offer_any(&self) -> bool {
        self.links.iter().flatten().any(Link::can_offer)
    }

    fn check_peer(&self, peer: usize) -> usize {
        let me = self
            .my_rank
            .expect("Endpoint::link called before connect_all succeeded");
        assert!(
            peer != me && peer < self.links.len(),
            "Endpoint::link({peer}) on rank {me} of {}: no link to itself or beyond the world",
            self.links.len()
        );
        me
    }

    /// The link to `peer`. Panics only on `peer == my_rank`, `peer >= world` or before
    /// `connect_all` (caller bugs).
    pub fn link(&mut self, peer: usize) -> &mut Link {
        self.check_peer(peer);
        self.links[peer]
            .as_mut()
            .expect("connect_all links every other rank")
    }

    /// Two distinct links at once (ring: receive from the left, send to the right). Panics if
    /// `a == b` or either is invalid for [`Endpoint::link`].
    pub fn link_pair(&mut self, a: usize, b: usize) -> (&mut Link, &mut Link) {
        assert!(
            a != b,
            "Endpoint::link_pair({a}, {b}): the two links must differ"
        );
        self.check_peer(a);
        self.check_peer(b);
        let (lo, hi) = (a.min(b), a.max(b));
        let (left, right) = self.links.split_at_mut(hi);
        let low = left[lo]
            .as_mut()
            .expect("connect_all links every other rank");
        let high = right[0]
            .as_mut()
            .expect("connect_all links every other rank");
        if a < b {
            (low, high)
        } else {
            (high, low)
        }
    }

    /// A handle another thread can use to interrupt [`Endpoint::wait`].
    pub fn waker(&self) -> Waker {
        Waker {
            shared: self.wake.clone(),
        }
    }

    /// Sleeps until some link may be able to make progress (data arrived, room freed, a peer
    /// closed or died), a [`Waker`] fired, or `timeout` passed, whichever comes first. Spurious
    /// returns are possible; call `try_send`/`try_recv` again after it returns.
    ///
    /// Spins for a few microseconds on this rank's doorbell, then sleeps on it (futex) when all
    /// links are shm, in `poll` when all are TCP, and alternates short futex sleeps with
    /// zero-time polls when both kinds exist. The shm control sockets are checked at least every
    /// 50 ms, so a dead shm peer is noticed within about that long. For TCP links `wait` watches
    /// readability on links whose last `try_recv` drained the socket and writability on links
    /// whose last `try_send` was short, so bytes the caller is deliberately not reading yet do
    /// not turn waiting into spinning.
    pub fn wait(&mut self, timeout: Duration) -> Result<()> {
        let result = self.wait_inner(timeout);
        self.bell_seen = self.bell.sample();
        result
    }

    fn take_wake(&self) -> bool {
        self.wake.requested.swap(false, Ordering::SeqCst)
    }

    fn bell_moved(&self) -> bool {
        self.bell.sample() != self.bell_seen
    }

    fn wait_inner(&mut self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let deadline = start.checked_add(timeout);
        if self.take_wake() {
            return Ok(());
        }
        let mut has_shm = false;
        let mut has_tcp = false;
        for link in self.links.iter().flatten() {
            match &link.inner {
                LinkInner::Shm(l) if !l.is_closed() => has_shm = true,
                LinkInner::Tcp(l) if !l.is_closed() => has_tcp = true,
                // Waited on in poll like TCP: the completion channel and the setup connection.
                #[cfg(feature = "rdma")]
                LinkInner::Rdma(l) if !l.is_closed() => has_tcp = true,
                _ => {}
            }
        }
        if has_shm {
            // A peer that is mid-transfer usually rings within microseconds; catching that
            // spinning is much cheaper than a futex sleep and wake-up.
            while start.elapsed() < SPIN.min(timeout) {
                if self.bell_moved() || self.wake.requested.load(Ordering::Relaxed) {
                    self.take_wake();
                    return Ok(());
                }
                std::hint::spin_loop();
            }
        }
        loop {
            let now = Instant::now();
            let remaining = match deadline {
                Some(d) => d.saturating_duration_since(now),
                None => Duration::from_secs(3600),
            };
            if has_tcp && !has_shm {
                if self.poll_sockets(remaining)? || self.take_wake() {
                    return Ok(());
                }
            } else {
                let slice = if has_tcp {
                    MIXED_SLICE
                } else if has_shm {
                    CONTROL_CHECK_INTERVAL
                } else {
                    remaining
                };
                self.bell.sleep(self.bell_seen, remaining.min(slice));
                if self.take_wake() {
                    return Ok(());
                }
                if self.bell_moved() {
                    if has_tcp || self.last_control_check.elapsed() >= CONTROL_CHECK_INTERVAL {
                        self.poll_sockets(Duration::ZERO)?;
                    }
                    return Ok(());
                }
                if (has_tcp || has_shm) && self.poll_sockets(Duration::ZERO)? {
                    return Ok(());
                }
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(());
            }
        }
    }

    /// Polls the waker's eventfd, the watched TCP links and the shm control sockets for up to
    /// `timeout`. Marks shm links whose control socket shows EOF/error as closed. Returns
    /// whether anything was ready.
    fn poll_sockets(&mut self, timeout: Duration) -> Result<bool> {
        self.poll_fds.clear();
        self.poll_targets.clear();
        let push =
            |fds: &mut Vec<libc::pollfd>, targets: &mut Vec<PollTarget>, fd, events, target| {
                fds.push(libc::pollfd {
                    fd,
                    events,
                    revents: 0,
                });
                targets.push(target);
            };
        push(
            &mut self.poll_fds,
            &mut self.poll_targets,
            self.wake.eventfd.raw(),
            libc::POLLIN,
            PollTarget::Waker,
        );
        let mut has_control = false;
        // RDMA links can shorten the sleep (completions already there) and report progress.
        #[cfg_attr(not(feature = "rdma"), allow(unused_mut))]
        let mut timeout = timeout;
        #[cfg_attr(not(feature = "rdma"), allow(unused_mut))]
        let mut news = false;
        for (rank, link) in self.links.iter_mut().enumerate() {
            let Some(link) = link else { continue };
            match &mut link.inner {
                #[cfg(feature = "rdma")]
                LinkInner::Rdma(l) if !l.is_closed() => {
                    // Completions that arrived while arming: progress, do not sleep.
                    if l.arm()? {
                        timeout = Duration::ZERO;
                        news = true;
                    }
                    push(
                        &mut self.poll_fds,
                        &mut self.poll_targets,
                        l.channel_fd(),
                        libc::POLLIN,
                        PollTarget::RdmaCq(rank),
                    );
                    push(
                        &mut self.poll_fds,
                        &mut self.poll_targets,
                        l.control_fd(),
                        libc::POLLIN | libc::POLLRDHUP,
                        PollTarget::RdmaControl(rank),
                    );
                }
                LinkInner::Tcp(l) if !l.is_closed() => {
                    let mut events = 0;
                    if l.want_read {
                        events |= libc::POLLIN;
                    }
                    if l.want_write {
                        events |= libc::POLLOUT;
                    }
                    if events != 0 {
                        push(
                            &mut self.poll_fds,
                            &mut self.poll_targets,
                            l.fd(),
                            events,
                            PollTarget::Tcp(rank),
                        );
                    }
                }
                LinkInner::Shm(l) if !l.is_closed() => {
                    has_control = true;
                    push(
                        &mut self.poll_fds,
                        &mut self.poll_targets,
                        l.control_fd(),
                        libc::POLLIN | libc::POLLRDHUP,
                        PollTarget::Control(rank),
                    );
                }
                _ => {}
            }
        }
        let ready = sys::poll(&mut self.poll_fds, timeout)?;
        if has_control {
            self.last_control_check = Instant::now();
        }
        if ready == 0 {
            return Ok(news);
        }
        let mut progress = false;
        for (pfd, target) in self.poll_fds.iter().zip(&self.poll_targets) {
            if pfd.revents == 0 {
                continue;
            }
            match *target {
                PollTarget::Waker => {
                    self.wake.eventfd.drain();
                    progress |= self.wake.requested.load(Ordering::SeqCst);
                }
                PollTarget::Tcp(rank) => {
                    if pfd.revents & libc::POLLOUT != 0 {
                        progress = true;
                    }
                    if pfd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                        if let Some(Link {
                            inner: LinkInner::Tcp(l),
                            ..
                        }) = self.links[rank].as_mut()
                        {
                            progress |= l.check_readable();
                        }
                    }
                }
                PollTarget::Control(rank) => {
                    if let Some(Link {
                        inner: LinkInner::Shm(l),
                        ..
                    }) = self.links[rank].as_mut()
                    {
                        progress |= l.check_control();
                    }
                }
                #[cfg(feature = "rdma")]
                PollTarget::RdmaCq(rank) => {
                    if let Some(Link {
                        inner: LinkInner::Rdma(l),
                        ..
                    }) = self.links[rank].as_mut()
                    {
                        l.on_channel();
                        progress = true;
                    }
                }
                #[cfg(feature = "rdma")]
                PollTarget::RdmaControl(rank) => {
                    if let Some(Link {
                        inner: LinkInner::Rdma(l),
                        ..
                    }) = self.links[rank].as_mut()
                    {
                        progress |= l.check_control();
                    }
                }
            }
        }
        Ok(progress || news)
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // Wakers may keep the doorbell mapped; nobody may open it after the endpoint is gone.
        self.bell.stop_sharing();
    }
}
