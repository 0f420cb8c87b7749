//! `RdmaTransport` (feature `rdma`): a link to a peer over one reliable-connected queue pair.
//!
//! Each side registers a receive ring of [`RING_BYTES`] and a send staging buffer of the same
//! size. A sender copies bytes into its staging buffer at the offset they will have in the
//! peer's ring and posts an RDMA WRITE with immediate there; the immediate is the byte count,
//! so the peer learns that `n` more bytes follow the last ones when the matching receive
//! completes (writes on one RC queue pair land, and complete, in order). A message never wraps
//! the ring: a send that would is cut in two.
//!
//! Bytes that lie in a [`crate::SharedBuffer`] (memory that stays put for its life) skip
//! staging: the link registers the buffer's whole mapping once (cached by buffer id, at most
//! [`MAX_USER_MRS`], registrations of freed buffers dropped when a new one is made, the rest
//! with the link) and writes from the caller's bytes to the same ring offset. Since the
//! caller gets its bytes back when `try_send` returns, `try_send` polls until those writes
//! have completed; staged sends return at once. Device buffers (dma-buf) are registered
//! through [`RdmaLink::register_dmabuf`].
//!
//! Flow control is by credits. The receiver returns the bytes it has copied out with a
//! zero-length WRITE with immediate whose top bit is set (`CREDIT | bytes`). A sender never
//! has more than [`RING_BYTES`] bytes outstanding (so it never overwrites bytes the peer has
//! not read, nor reuses staging memory the device may still read) nor more than
//! [`MAX_MESSAGES`] messages (each consumes one posted receive at the peer, which keeps
//! [`RECV_DEPTH`] posted). Credits go back once a quarter of either is consumed, and always
//! before the endpoint sleeps, so a sender never waits on credits the receiver is sitting on.
//!
//! ```text
//! immediate (32 bits, big-endian on the wire):
//!   0 | n (31 bits)        n bytes follow in the ring (n >= 1)
//!   1 | n (31 bits)        credit: the receiver has copied out n more bytes
//! ```
//!
//! Setup runs over the authenticated setup connection (`setup.rs`): after the link hello and
//! reply both sides send an [`RdmaHello`] (queue pair number, PSN, LID, GID, ring address,
//! rkey and size), move their queue pair to RTS, and send one `ready` byte; nobody writes
//! before the peer's queue pair can receive. The setup connection then stays open as the
//! liveness channel, as for shm: its EOF says the peer is gone at once, where the queue pair
//! alone would take the retry timeout. Completions are polled by `try_send`/`try_recv`; the
//! endpoint's `wait` arms the CQ and sleeps on its completion channel's descriptor.

mod verbs;

use std::collections::VecDeque;
use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use ibverbs_sys as ffi;

use crate::config::{ENV_IB_GID_INDEX, ENV_IB_HCA};
use crate::sys::pid_alive;
use crate::wire::{recv_frame, send_frame, Dec, Enc};
use crate::{Result, TransportError};

pub use verbs::live_resources;
use verbs::{Channel, Context, Cq, Mr, Pd, Qp, QpAddress, RegisteredBuf};

/// Bytes of each side's receive ring (and send staging buffer).
pub(crate) const RING_BYTES: usize = 1 << 20;
/// Largest single RDMA WRITE: smaller pieces let the receiver start copying out earlier.
const MAX_WRITE: usize = 256 << 10;
/// Data messages a sender may have outstanding (each consumes one receive at the peer).
const MAX_MESSAGES: usize = 128;
/// Receives kept posted: every data message the peer may have outstanding, and as many
/// credits (at most one per message it consumed in full when idle, a few more per ring).
/// Running out only delays the peer (receiver-not-ready retries, forever), it loses nothing.
const RECV_DEPTH: u32 = 2 * MAX_MESSAGES as u32 + 32;
/// Send work requests: our data messages plus the credits we owe.
const SEND_DEPTH: u32 = 2 * MAX_MESSAGES as u32 + 32;
const CREDIT: u32 = 1 << 31;
/// wr_ids of send work requests (receives use 0).
const WR_DATA: u64 = 1;
const WR_CREDIT: u64 = 2;
/// A data write straight from a registered user buffer (no staging).
const WR_DATA_USER: u64 = 3;
/// User buffers one link keeps registered (least recently registered out).
const MAX_USER_MRS: usize = 64;
/// Idle `try_*` calls between looks at the setup connection (as shm does).
const IDLE_CALLS_PER_CONTROL_CHECK: u32 = 1024;
/// How long a dropped link waits for its last writes to be acknowledged.
const DRAIN_ON_DROP: Duration = Duration::from_secs(2);

static ZERO_COPY_BYTES: AtomicU64 = AtomicU64::new(0);

/// Bytes sent straight from registered user buffers (no copy into staging), all links.
pub(crate) fn zero_copy_bytes() -> u64 {
    ZERO_COPY_BYTES.load(Ordering::Relaxed)
}

/// Whether this process can open an RDMA device (honouring `CIERA_IB_HCA`). Decided once.
/// A host without RDMA answers ENOSYS rather than an empty list: both mean no.
pub(crate) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| match verbs::device_names() {
        Ok(names) => match std::env::var(ENV_IB_HCA) {
            Ok(want) if !want.trim().is_empty() => names.iter().any(|n| n == want.trim()),
            _ => !names.is_empty(),
        },
        Err(_) => false,
    })
}

/// Why RDMA cannot be used here, for error messages and skipped tests; `None` if it can.
pub fn unavailable_reason() -> Option<String> {
    match verbs::device_names() {
        Err(e) => Some(format!("no RDMA device ({e})")),
        Ok(names) if names.is_empty() => Some("no RDMA device (the device list is empty)".into()),
        Ok(names) => match std::env::var(ENV_IB_HCA) {
            Ok(want) if !want.trim().is_empty() && !names.iter().any(|n| n == want.trim()) => {
                Some(format!("{ENV_IB_HCA}={want} is not one of {names:?}"))
            }
            _ => None,
        },
    }
}

/// What each side tells the other during setup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RdmaHello {
    qp: QpAddress,
    ring_addr: u64,
    ring_rkey: u32,
    ring_bytes: u32,
}

impl RdmaHello {
    fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.bytes(b"CIERARDM")
            .u32(self.qp.qpn)
            .u32(self.qp.psn)
            .u16(self.qp.lid)
            .bytes(&self.qp.gid)
            .u32(self.ring_addr as u32)
            .u32((self.ring_addr >> 32) as u32)
            .u32(self.ring_rkey)
            .u32(self.ring_bytes);
        e.0
    }

    fn decode(body: &[u8], what: &str) -> Result<RdmaHello> {
        let mut d = Dec::new(body, what);
        if &d.array::<8>("magic")? != b"CIERARDM" {
            return Err(TransportError::Protocol {
                detail: format!("{what}: bad magic"),
            });
        }
        let qpn = d.u32("queue pair number")?;
        let psn = d.u32("packet sequence number")?;
        let lid = d.u16("lid")?;
        let gid = d.array::<16>("gid")?;
        let lo = d.u32("ring address")? as u64;
        let hi = d.u32("ring address")? as u64;
        let ring_rkey = d.u32("ring rkey")?;
        let ring_bytes = d.u32("ring size")?;
        d.finish()?;
        Ok(RdmaHello {
            qp: QpAddress { qpn, psn, lid, gid },
            ring_addr: lo | (hi << 32),
            ring_rkey,
            ring_bytes,
        })
    }
}

/// The local half of a link before the peer's address is known.
pub(crate) struct Prepared {
    // Field order is drop order: the queue pair before the memory it uses, everything
    // before the protection domain and the context.
    qp: Qp,
    /// User buffers that stay put ([`crate::SharedBuffer`]s), registered on first use, by
    /// buffer id; `None` where registration failed (those bytes go through staging).
    user_mrs: Vec<(u64, Option<Mr>)>,
    /// Device buffers registered through [`RdmaLink::register_dmabuf`].
    device_mrs: Vec<Mr>,
    send_buf: RegisteredBuf,
    recv_buf: RegisteredBuf,
    cq: Cq,
    channel: Channel,
    pd: Pd,
    ctx: Context,
    gid_index: u8,
    mtu: ffi::ibv_mtu,
    hello: RdmaHello,
}

/// Opens the device and creates everything one link needs; the queue pair is in INIT with
/// its receives posted.
fn prepare(who: &str) -> Result<Prepared> {
    let want = std::env::var(ENV_IB_HCA)
        .ok()
        .filter(|w| !w.trim().is_empty());
    let ctx = Context::open(want.as_deref().map(str::trim), who)?;
    let port = ctx.query_port(who)?;
    let gid_index = gid_index(&ctx, port.gid_tbl_len, who)?;
    let gid = ctx.query_gid(i32::from(gid_index), who)?;
    let pd = Pd::new(&ctx, who)?;
    let channel = Channel::new(&ctx, who)?;
    let cq = Cq::new(&ctx, &channel, (SEND_DEPTH + RECV_DEPTH + 16) as i32, who)?;
    let qp = Qp::new(&pd, &cq, SEND_DEPTH, RECV_DEPTH, who)?;
    let recv_buf = RegisteredBuf::new(&pd, RING_BYTES, true, who)?;
    let send_buf = RegisteredBuf::new(&pd, RING_BYTES, false, who)?;
    qp.init(who)?;
    for _ in 0..RECV_DEPTH {
        qp.post_recv(who)?;
    }
    let mut psn = [0u8; 4];
    let _ = crate::sys::fill_random(&mut psn);
    let hello = RdmaHello {
        qp: QpAddress {
            qpn: qp.qpn(),
            psn: u32::from_le_bytes(psn) & 0x00ff_ffff,
            lid: port.lid,
            gid,
        },
        ring_addr: recv_buf.addr(),
        ring_rkey: recv_buf.rkey(),
        ring_bytes: RING_BYTES as u32,
    };
    Ok(Prepared {
        qp,
        user_mrs: Vec::new(),
        device_mrs: Vec::new(),
        send_buf,
        recv_buf,
        cq,
        channel,
        pd,
        mtu: port.active_mtu.min(ffi::IBV_MTU_4096),
        ctx,
        gid_index,
        hello,
    })
}

/// `CIERA_IB_GID_INDEX`, else the first IPv4-mapped GID (RoCE v2 over IPv4), else the first
/// non-zero one, else 0 (InfiniBand with LIDs only).
fn gid_index(ctx: &Context, table_len: i32, who: &str) -> Result<u8> {
    if let Ok(v) = std::env::var(ENV_IB_GID_INDEX) {
        if !v.trim().is_empty() {
            return v
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|&i| i32::from(i) < table_len)
                .ok_or_else(|| TransportError::Config {
                    detail: format!(
                        "{ENV_IB_GID_INDEX}={v:?} is not an index into the {} entries of {}'s GID table",
                        table_len, ctx.name
                    ),
                });
        }
    }
    let mut first_nonzero = None;
    for i in 0..table_len.min(256) {
        let Ok(gid) = ctx.query_gid(i, who) else {
            continue;
        };
        if gid == [0; 16] {
            continue;
        }
        if gid[..10] == [0; 10] && gid[10..12] == [0xff, 0xff] {
            return Ok(i as u8);
        }
        first_nonzero.get_or_insert(i as u8);
    }
    Ok(first_nonzero.unwrap_or(0))
}

/// Both sides of setup, after the link reply: exchange addresses, connect, and confirm.
/// `stream` is the authenticated setup connection (blocking, bounded by `deadline`).
pub(crate) fn establish(
    mut stream: TcpStream,
    deadline: Instant,
    who: String,
    peer_pid: u32,
) -> Result<RdmaLink> {
    let step = format!("RDMA link setup with {who}");
    // A side that cannot prepare says why instead of its address, so the peer fails with the
    // reason rather than a timeout.
    let prepared = prepare(&who);
    let mut out = Enc::default();
    match &prepared {
        Ok(p) => out.u8(0).bytes(&p.hello.encode()),
        Err(e) => out
            .u8(1)
            .str(&e.to_string().chars().take(1000).collect::<String>()),
    };
    send_frame(&mut stream, &out.0, deadline, &step)?;
    let p = prepared?;
    let body = recv_frame(&mut stream, deadline, &step)?;
    let what = format!("RDMA hello from {who}");
    let remote = match body.first() {
        Some(0) => RdmaHello::decode(&body[1..], &what)?,
        Some(1) => {
            let mut d = Dec::new(&body[1..], &what);
            let message = d.str("message", 4096)?;
            return Err(TransportError::Unsupported {
                detail: format!("{who} could not set up its RDMA side: {message}"),
            });
        }
        _ => {
            return Err(TransportError::Protocol {
                detail: format!("{what}: bad status byte"),
            })
        }
    };
    if remote.ring_bytes as usize != RING_BYTES {
        return Err(TransportError::Protocol {
            detail: format!(
                "{who} has a {}-byte RDMA ring, this side {RING_BYTES} (different builds?)",
                remote.ring_bytes
            ),
        });
    }
    p.qp.connect(&remote.qp, p.hello.qp.psn, p.gid_index, p.mtu, &who)?;
    // Both queue pairs must be ready to receive before either writes.
    send_frame(&mut stream, &[0], deadline, &step)?;
    let ready = recv_frame(&mut stream, deadline, &step)?;
    if ready != [0] {
        return Err(TransportError::Protocol {
            detail: format!("{who}: bad RDMA ready message"),
        });
    }
    stream
        .set_nonblocking(true)
        .map_err(|e| TransportError::io("set socket non-blocking", &who, e))?;
    let control = stream;
    Ok(RdmaLink {
        res: p,
        remote_addr: remote.ring_addr,
        remote_rkey: remote.ring_rkey,
        control,
        peer_desc: who,
        peer_pid,
        closed: None,
        send_head: 0,
        send_acked: 0,
        send_ends: VecDeque::new(),
        sq_outstanding: 0,
        user_outstanding: 0,
        recv_head: 0,
        recv_tail: 0,
        recv_ends: VecDeque::new(),
        uncredited_bytes: 0,
        uncredited_msgs: 0,
        idle_calls: 0,
        wc: vec![ffi::ibv_wc::default(); 32],
    })
}

pub(crate) struct RdmaLink {
    res: Prepared,
    remote_addr: u64,
    remote_rkey: u32,
    /// The setup connection, kept open: EOF means the peer is gone.
    control: TcpStream,
    peer_desc: String,
    peer_pid: u32,
    closed: Option<String>,
    /// Bytes ever written to the peer, and how many of those it has copied out (credits).
    send_head: u64,
    send_acked: u64,
    /// Stream offsets where our outstanding messages end.
    send_ends: VecDeque<u64>,
    /// Send work requests whose completion has not been polled.
    sq_outstanding: u32,
    /// Of those, writes straight from a user buffer: `try_send` returns only once this is 0
    /// again, so the caller's bytes are never read after it got them back.
    user_outstanding: u32,
    /// Bytes ever arrived in our ring, and copied out of it.
    recv_head: u64,
    recv_tail: u64,
    /// Stream offsets where arrived messages end (to count those fully copied out).
    recv_ends: VecDeque<u64>,
    /// Copied out but not yet credited back: bytes and whole messages.
    uncredited_bytes: u64,
    uncredited_msgs: usize,
    idle_calls: u32,
    wc: Vec<ffi::ibv_wc>,
}

impl RdmaLink {
    pub fn is_closed(&self) -> bool {
        self.closed.is_some()
    }

    /// The completion channel's descriptor (readable after [`RdmaLink::arm`] once a
    /// completion arrives).
    pub fn channel_fd(&self) -> RawFd {
        self.res.channel.fd()
    }

    pub fn control_fd(&self) -> RawFd {
        self.control.as_raw_fd()
    }

    fn closed_error(&self) -> TransportError {
        TransportError::PeerClosed {
            detail: self
                .closed
                .clone()
                .unwrap_or_else(|| format!("{} closed the RDMA link", self.peer_desc)),
        }
    }

    /// Reads the setup connection without blocking; EOF, an error or stray bytes mark the
    /// peer as gone. Returns true if this call discovered that.
    pub fn check_control(&mut self) -> bool {
        if self.closed.is_some() {
            return false;
        }
        let mut byte = [0u8; 1];
        let what = loop {
            match self.control.read(&mut byte) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(0) => break "its setup connection reached EOF".to_string(),
                Ok(_) => break "it sent unexpected bytes on the setup connection".to_string(),
                Err(e) => break format!("its setup connection failed: {e}"),
            }
        };
        self.closed = Some(format!(
            "{} went away: {what}{}",
            self.peer_desc,
            self.exited()
        ));
        true
    }

    fn exited(&self) -> &'static str {
        if pid_alive(self.peer_pid) {
            ""
        } else {
            "; its process has exited"
        }
    }

    fn note_idle(&mut self) {
        self.idle_calls = self.idle_calls.wrapping_add(1);
        if self.idle_calls.is_multiple_of(IDLE_CALLS_PER_CONTROL_CHECK) {
            self.check_control();
        }
    }

    /// Takes every completion off the CQ and applies it. Returns whether any arrived.
    fn poll(&mut self) -> Result<bool> {
        let mut any = false;
        loop {
            let n = self.res.cq.poll(&mut self.wc, &self.peer_desc)?;
            for i in 0..n {
                let wc = self.wc[i];
                self.complete(&wc)?;
            }
            any |= n > 0;
            if n < self.wc.len() {
                return Ok(any);
            }
        }
    }

    fn complete(&mut self, wc: &ffi::ibv_wc) -> Result<()> {
        if let Some((status, vendor)) = wc.error() {
            let what = match wc.wr_id() {
                WR_DATA => "RDMA WRITE with immediate (data)",
                WR_CREDIT => "RDMA WRITE with immediate (credit)",
                WR_DATA_USER => "RDMA WRITE with immediate (data from a user buffer)",
                _ => "receive",
            };
            // The setup connection usually knows better why (the process died).
            self.check_control();
            let why = format!(
                "ibv_poll_cq: {what} with {} completed with {} (vendor error {vendor:#x}){}",
                self.peer_desc,
                verbs::status_text(status),
                self.exited()
            );
            if self.closed.is_none() {
                self.closed = Some(why);
            } else if let Some(c) = self.closed.as_mut() {
                if status != ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR && !c.contains("ibv_poll_cq") {
                    c.push_str(&format!("; {why}"));
                }
            }
            if wc.wr_id() != 0 {
                self.sq_outstanding = self.sq_outstanding.saturating_sub(1);
            }
            if wc.wr_id() == WR_DATA_USER {
                self.user_outstanding = self.user_outstanding.saturating_sub(1);
            }
            return Ok(());
        }
        match wc.opcode() {
            ffi::ibv_wc_opcode::IBV_WC_RDMA_WRITE => {
                self.sq_outstanding = self.sq_outstanding.saturating_sub(1);
                if wc.wr_id() == WR_DATA_USER {
                    self.user_outstanding = self.user_outstanding.saturating_sub(1);
                }
            }
            ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => {
                let imm = u32::from_be(
                    wc.imm_data()
                        .ok_or_else(|| self.corrupt("a receive without immediate"))?,
                );
                if self.closed.is_none() {
                    self.res.qp.post_recv(&self.peer_desc)?;
                }
                let n = u64::from(imm & !CREDIT);
                if imm & CREDIT != 0 {
                    self.send_acked += n;
                    if self.send_acked > self.send_head {
                        return Err(self.corrupt("credit for bytes never sent"));
                    }
                    while self
                        .send_ends
                        .front()
                        .is_some_and(|&e| e <= self.send_acked)
                    {
                        self.send_ends.pop_front();
                    }
                } else {
                    // (Providers report the write's length in byte_len; 0 is tolerated.)
                    if n == 0 || (wc.len() != 0 && wc.len() as u64 != n) {
                        return Err(self.corrupt("a data write whose immediate is not its length"));
                    }
                    self.recv_head += n;
                    if self.recv_head - self.recv_tail > RING_BYTES as u64 {
                        return Err(self.corrupt("more bytes than the ring holds"));
                    }
                    self.recv_ends.push_back(self.recv_head);
                }
            }
            other => {
                return Err(self.corrupt(&format!("unexpected completion opcode {other}")));
            }
        }
        Ok(())
    }

    fn corrupt(&self, what: &str) -> TransportError {
        TransportError::Protocol {
            detail: format!("RDMA link with {}: {what}", self.peer_desc),
        }
    }

    /// Returns credits if enough are owed, or any at all with `force`.
    fn return_credits(&mut self, force: bool) -> Result<()> {
        let due = self.uncredited_bytes >= (RING_BYTES / 4) as u64
            || self.uncredited_msgs >= MAX_MESSAGES / 4
            || (force && self.uncredited_bytes > 0);
        if !due || self.closed.is_some() || self.sq_outstanding >= SEND_DEPTH {
            return Ok(());
        }
        let n = self.uncredited_bytes.min(u64::from(!CREDIT)) as u32;
        // SAFETY: a zero-length write names no local memory.
        unsafe {
            self.res.qp.post_write_imm(
                WR_CREDIT,
                std::ptr::null(),
                0,
                0,
                self.remote_addr,
                self.remote_rkey,
                CREDIT | n,
                &self.peer_desc,
            )?;
        }
        self.sq_outstanding += 1;
        self.uncredited_bytes -= u64::from(n);
        self.uncredited_msgs = 0;
        Ok(())
    }

    /// The local key under which `data` may be written straight from where it lies: when it
    /// lies in a live [`crate::SharedBuffer`], whose whole mapping is registered with this
    /// link's protection domain on first use and kept (the buffer stays put for its life).
    /// Registrations of buffers since freed are dropped whenever a new one is made.
    fn user_lkey(&mut self, data: &[u8]) -> Option<u32> {
        let (id, base, len) = crate::shared::shared_extent_of(data.as_ptr() as u64, data.len())?;
        if let Some((_, mr)) = self.res.user_mrs.iter().find(|(i, _)| *i == id) {
            return mr.as_ref().map(Mr::lkey);
        }
        // No write from a user buffer is outstanding here (try_send waits for them), so
        // dropping registrations is safe.
        self.res
            .user_mrs
            .retain(|(i, _)| crate::shared::shared_buffer_live(*i));
        if self.res.user_mrs.len() >= MAX_USER_MRS {
            self.res.user_mrs.remove(0);
        }
        // SAFETY: [base, base + len) is the mapping of a live SharedBuffer, which `data`
        // borrows from for this call.
        let mr =
            unsafe { Mr::register_user(&self.res.pd, base, len as usize, &self.peer_desc) }.ok();
        let lkey = mr.as_ref().map(Mr::lkey);
        self.res.user_mrs.push((id, mr));
        lkey
    }

    /// Writes as much of `data` to the peer as the credits allow. Bytes in a registered user
    /// buffer ([`crate::SharedBuffer`]) are written from where they lie, and then this call
    /// returns only once the device has read them (their completions polled: a round trip to
    /// the peer's adapter, not to its CPU); other bytes are copied into staging first.
    pub fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        if self.closed.is_none() {
            self.poll()?;
        }
        if self.closed.is_some() {
            return Err(self.closed_error());
        }
        let user = if data.is_empty() {
            None
        } else {
            self.user_lkey(data)
        };
        let mut taken = 0;
        while taken < data.len() {
            let outstanding = self.send_head - self.send_acked;
            let room = RING_BYTES as u64 - outstanding;
            // Keep two send slots for credits.
            if room == 0
                || self.send_ends.len() >= MAX_MESSAGES
                || self.sq_outstanding + 2 >= SEND_DEPTH
            {
                break;
            }
            let offset = (self.send_head % RING_BYTES as u64) as usize;
            let n = (data.len() - taken)
                .min(room as usize)
                .min(MAX_WRITE)
                .min(RING_BYTES - offset);
            let src = &data[taken..taken + n];
            let (wr_id, local, lkey) = match user {
                Some(lkey) => (WR_DATA_USER, src.as_ptr(), lkey),
                None => {
                    // SAFETY: offset + n <= RING_BYTES, the staging buffer's size. These
                    // bytes of staging last carried stream bytes send_head + k - RING_BYTES,
                    // which the peer has credited (room), so the device no longer reads them.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            src.as_ptr(),
                            self.res.send_buf.ptr().add(offset),
                            n,
                        );
                    }
                    // SAFETY: offset < RING_BYTES, inside the staging buffer.
                    let at = unsafe { self.res.send_buf.ptr().add(offset) };
                    (WR_DATA, at.cast_const(), self.res.send_buf.lkey())
                }
            };
            // SAFETY: staged bytes lie in the registered staging buffer and stay unchanged
            // until the peer credits them, which is after the write completed. User bytes lie
            // in the registration `lkey` covers (the whole SharedBuffer) and `data` is
            // borrowed until this call returns, which waits for the write's completion.
            unsafe {
                self.res.qp.post_write_imm(
                    wr_id,
                    local,
                    n as u32,
                    lkey,
                    self.remote_addr + offset as u64,
                    self.remote_rkey,
                    n as u32,
                    &self.peer_desc,
                )?;
            }
            self.sq_outstanding += 1;
            if user.is_some() {
                self.user_outstanding += 1;
                ZERO_COPY_BYTES.fetch_add(n as u64, Ordering::Relaxed);
            }
            self.send_head += n as u64;
            self.send_ends.push_back(self.send_head);
            taken += n;
        }
        if self.user_outstanding > 0 {
            self.finish_user_writes()?;
        }
        if taken == 0 && !data.is_empty() {
            self.note_idle();
        } else {
            self.idle_calls = 0;
        }
        Ok(taken)
    }

    /// Polls until every write from a user buffer has completed: the caller may change or
    /// free its bytes once `try_send` returns. If the peer goes away meanwhile, the queue pair
    /// flushes the writes in error, which completes them too (bounded by [`DRAIN_ON_DROP`]).
    fn finish_user_writes(&mut self) -> Result<()> {
        let mut idle = 0u32;
        let mut closed_at: Option<Instant> = None;
        while self.user_outstanding > 0 {
            if self.poll()? {
                idle = 0;
                continue;
            }
            idle = idle.wrapping_add(1);
            if idle.is_multiple_of(IDLE_CALLS_PER_CONTROL_CHECK) {
                self.check_control();
            }
            if self.closed.is_some() {
                let since = *closed_at.get_or_insert_with(Instant::now);
                if since.elapsed() > DRAIN_ON_DROP {
                    break;
                }
                std::thread::sleep(Duration::from_micros(50));
            } else if idle > 64 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        if self.closed.is_some() {
            return Err(self.closed_error());
        }
        Ok(())
    }

    /// Registers a device buffer given as a dma-buf with this link's protection domain
    /// (`ibv_reg_dmabuf_mr`); kept until the link is dropped. A device or provider without
    /// dma-buf support is an `Unsupported` error naming the verb, the device and the reason.
    pub fn register_dmabuf(&mut self, buf: &crate::DmaBuf) -> Result<()> {
        let mr = Mr::register_dmabuf(&self.res.pd, &self.res.ctx.name, buf, &self.peer_desc)?;
        self.res.device_mrs.push(mr);
        Ok(())
    }

    /// Copies up to `buf.len()` arrived bytes out of the ring. Bytes that arrived before the
    /// peer went away are delivered first, then `PeerClosed`.
    pub fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        self.poll()?;
        if self.recv_head == self.recv_tail {
            if self.closed.is_some() {
                return Err(self.closed_error());
            }
            self.return_credits(true)?;
            self.note_idle();
            return Ok(0);
        }
        self.idle_calls = 0;
        let avail = (self.recv_head - self.recv_tail) as usize;
        let n = avail.min(buf.len());
        let offset = (self.recv_tail % RING_BYTES as u64) as usize;
        let first = n.min(RING_BYTES - offset);
        let base = self.res.recv_buf.ptr();
        // SAFETY: [recv_tail, recv_tail + n) arrived (their completions were polled) and the
        // peer will not overwrite them before we credit them; both copies stay inside the
        // ring, and `buf` is separate memory of at least n bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(base.add(offset), buf.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(base, buf.as_mut_ptr().add(first), n - first);
        }
        self.recv_tail += n as u64;
        self.uncredited_bytes += n as u64;
        while self.recv_ends.front().is_some_and(|&e| e <= self.recv_tail) {
            self.recv_ends.pop_front();
            self.uncredited_msgs += 1;
        }
        self.return_credits(false)?;
        Ok(n)
    }

    /// Before the endpoint sleeps: owed credits go out, pending channel events are taken, the
    /// CQ is armed, and completions that raced the arming are applied. Returns true if there
    /// was something new (the caller should not sleep).
    pub fn arm(&mut self) -> Result<bool> {
        if self.closed.is_some() {
            return Ok(false);
        }
        self.return_credits(true)?;
        let mut news = self.res.cq.drain_events(&self.res.channel);
        self.res.cq.arm(&self.peer_desc)?;
        news |= self.poll()?;
        Ok(news)
    }

    /// The completion channel became readable.
    pub fn on_channel(&mut self) -> bool {
        self.res.cq.drain_events(&self.res.channel)
    }
}

impl Drop for RdmaLink {
    fn drop(&mut self) {
        // Let the last writes reach the peer before the queue pair goes: bytes sent before a
        // clean close are delivered.
        let deadline = Instant::now() + DRAIN_ON_DROP;
        while self.sq_outstanding > 0 && self.closed.is_none() && Instant::now() < deadline {
            match self.poll() {
                Ok(true) => {}
                Ok(false) => std::thread::sleep(Duration::from_micros(50)),
                Err(_) => break,
            }
        }
        let _ = self.control.shutdown(std::net::Shutdown::Both);
        // The resources go in field order (see `Prepared`).
    }
}
