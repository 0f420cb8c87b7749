//! `TcpTransport`: a link to a peer over one non-blocking TCP connection (the authenticated
//! setup connection itself). TCP_NODELAY, large socket buffers, keepalive so that a vanished
//! host is noticed even on an idle link.

use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};

use crate::config::{TcpBuffers, TcpCongestion, ENV_TCP_CONGESTION};
use crate::sys::{set_sockopt, set_tcp_congestion, tcp_congestion};
use crate::wire::is_disconnect;
use crate::{Result, TransportError};

/// Puts a connected stream into data mode.
pub(crate) fn configure(
    stream: &TcpStream,
    buffers: TcpBuffers,
    congestion: &TcpCongestion,
    desc: &str,
) -> Result<()> {
    stream
        .set_nonblocking(true)
        .map_err(|e| TransportError::io("set socket non-blocking", desc, e))?;
    stream
        .set_nodelay(true)
        .map_err(|e| TransportError::io("set TCP_NODELAY", desc, e))?;
    let fd = stream.as_raw_fd();
    if let Some(bytes) = buffers.send {
        let bytes = bytes.min(i32::MAX as usize) as i32;
        set_sockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            bytes,
            "set SO_SNDBUF",
            desc,
        )?;
    }
    if let Some(bytes) = buffers.recv {
        let bytes = bytes.min(i32::MAX as usize) as i32;
        set_sockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            bytes,
            "set SO_RCVBUF",
            desc,
        )?;
    }
    set_congestion(fd, congestion, desc)?;
    // Best effort: probe an idle connection after 10 s, give up after 3 unanswered probes.
    let _ = set_sockopt(
        fd,
        libc::SOL_SOCKET,
        libc::SO_KEEPALIVE,
        1,
        "set SO_KEEPALIVE",
        desc,
    );
    let _ = set_sockopt(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPIDLE,
        10,
        "set TCP_KEEPIDLE",
        desc,
    );
    let _ = set_sockopt(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPINTVL,
        5,
        "set TCP_KEEPINTVL",
        desc,
    );
    let _ = set_sockopt(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPCNT,
        3,
        "set TCP_KEEPCNT",
        desc,
    );
    Ok(())
}

/// Applies `CIERA_TCP_CONGESTION` to a socket (see [`TcpCongestion`]).
fn set_congestion(fd: RawFd, congestion: &TcpCongestion, desc: &str) -> Result<()> {
    match congestion {
        TcpCongestion::System => Ok(()),
        TcpCongestion::Auto => {
            if tcp_congestion(fd).as_deref() == Some("bbr") {
                // Best effort: keep bbr if neither may be set here.
                let _ = set_tcp_congestion(fd, "cubic").or_else(|_| set_tcp_congestion(fd, "reno"));
            }
            Ok(())
        }
        TcpCongestion::Named(name) => set_tcp_congestion(fd, name).map_err(|e| {
            let list = |what: &str| {
                std::fs::read_to_string(format!("/proc/sys/net/ipv4/tcp_{what}_congestion_control"))
                    .map(|s| s.trim().to_string())
                    .unwrap_or_else(|_| "?".into())
            };
            TransportError::Config {
                detail: format!(
                    "{ENV_TCP_CONGESTION}={name}: the kernel refused it for the link to {desc} ({e}); \
                     available here: {}; allowed without privileges: {}",
                    list("available"),
                    list("allowed")
                ),
            }
        }),
    }
}

pub(crate) struct TcpLink {
    stream: TcpStream,
    peer_desc: String,
    closed: Option<String>,
    /// The read side reached EOF or failed: nothing more will arrive. (A failed *send* does
    /// not set this: bytes the peer sent before it went away are still delivered.)
    read_done: bool,
    /// The last `try_recv` drained the socket (or none happened yet): `wait` watches POLLIN.
    pub want_read: bool,
    /// The last `try_send` was short: `wait` watches POLLOUT.
    pub want_write: bool,
}

impl TcpLink {
    pub fn new(stream: TcpStream, peer_desc: String) -> TcpLink {
        TcpLink {
            stream,
            peer_desc,
            closed: None,
            read_done: false,
            want_read: true,
            want_write: false,
        }
    }

    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    pub fn is_closed(&self) -> bool {
        self.closed.is_some()
    }

    fn closed_error(&self) -> TransportError {
        TransportError::PeerClosed {
            detail: self.closed.clone().unwrap_or_default(),
        }
    }

    fn fail(&mut self, op: &'static str, e: io::Error) -> TransportError {
        if is_disconnect(&e) {
            self.closed = Some(format!("{} went away: {op}: {e}", self.peer_desc));
            self.closed_error()
        } else {
            TransportError::io(op, &self.peer_desc, e)
        }
    }

    /// After poll reported the socket readable (or hung up): true if bytes are waiting or the
    /// peer's end just turned out to be closed. An EOF with nothing left to read marks the link
    /// closed right away, so `wait` stops watching a socket that will stay readable forever
    /// (a peer that finished and exited while this rank still waits for others).
    pub fn check_readable(&mut self) -> bool {
        if self.read_done {
            return false;
        }
        let mut byte = [0u8; 1];
        loop {
            match self.stream.peek(&mut byte) {
                Ok(0) => {
                    self.mark_eof();
                    return true;
                }
                Ok(_) => return true,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.read_done = true;
                    let _ = self.fail("recv", e);
                    return true;
                }
            }
        }
    }

    fn mark_eof(&mut self) {
        self.read_done = true;
        if self.closed.is_none() {
            self.closed = Some(format!(
                "{} closed the TCP connection (EOF)",
                self.peer_desc
            ));
        }
    }

    pub fn try_send(&mut self, data: &[u8]) -> Result<usize> {
        self.try_send_vectored(&[data])
    }

    /// Sends what the socket takes of `parts`, in order as one stream, in one system call (a
    /// header and the payload behind it leave as one TCP segment, not two); never blocks.
    /// `Ok(0)`: no room now (or nothing to send).
    pub fn try_send_vectored(&mut self, parts: &[&[u8]]) -> Result<usize> {
        if self.closed.is_some() {
            return Err(self.closed_error());
        }
        const MAX_PARTS: usize = 4;
        assert!(
            parts.len() <= MAX_PARTS,
            "try_send_vectored: at most {MAX_PARTS} parts"
        );
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; MAX_PARTS];
        let mut used = 0;
        for p in parts.iter().filter(|p| !p.is_empty()) {
            iov[used] = libc::iovec {
                iov_base: p.as_ptr() as *mut libc::c_void,
                iov_len: p.len(),
            };
            used += 1;
        }
        let total: usize = iov[..used].iter().map(|v| v.iov_len).sum();
        if total == 0 {
            return Ok(0);
        }
        // SAFETY: a zeroed msghdr is valid; the iovecs point into `parts`, alive for the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = used as _;
        loop {
            // MSG_NOSIGNAL: a dead peer is EPIPE, not SIGPIPE (writev would raise it).
            // SAFETY: the descriptor is ours; msg is valid as above.
            let n = unsafe {
                libc::sendmsg(
                    self.stream.as_raw_fd(),
                    &msg,
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                )
            };
            if n >= 0 {
                let n = n as usize;
                self.want_write = n < total;
                return Ok(n);
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => {
                    self.want_write = true;
                    return Ok(0);
                }
                io::ErrorKind::Interrupted => continue,
                _ => return Err(self.fail("send", e)),
            }
        }
    }

    /// Reads what has arrived. A link whose *send* side already failed still delivers what the
    /// peer sent before it went away (an abort notice, say); `PeerClosed` comes after that.
    pub fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        if self.read_done {
            return Err(self.closed_error());
        }
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            match self.stream.read(buf) {
                Ok(0) => {
                    self.mark_eof();
                    return Err(self.closed_error());
                }
                Ok(n) => {
                    self.want_read = n < buf.len();
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.want_read = true;
                    return Ok(0);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.read_done = true;
                    return Err(self.fail("recv", e));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (TcpLink, TcpLink) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let b = listener.accept().unwrap().0;
        configure(
            &a,
            TcpBuffers {
                send: Some(1 << 20),
                recv: Some(1 << 20),
            },
            &TcpCongestion::Auto,
            "a",
        )
        .unwrap();
        configure(&b, TcpBuffers::default(), &TcpCongestion::System, "b").unwrap();
        (
            TcpLink::new(a, "rank 1".into()),
            TcpLink::new(b, "rank 0".into()),
        )
    }

    #[test]
    fn congestion_control_is_set_as_asked() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let connect = || {
            let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let _b = listener.accept().unwrap().0;
            a
        };
        let system = tcp_congestion(connect().as_raw_fd()).expect("TCP_CONGESTION readable");
        // system: untouched.
        let s = connect();
        configure(&s, TcpBuffers::default(), &TcpCongestion::System, "s").unwrap();
        assert_eq!(
            tcp_congestion(s.as_raw_fd()).as_deref(),
            Some(system.as_str())
        );
        // auto: anything but bbr stays; bbr becomes cubic or reno (unless neither may be set).
        let s = connect();
        configure(&s, TcpBuffers::default(), &TcpCongestion::Auto, "s").unwrap();
        let got = tcp_congestion(s.as_raw_fd()).unwrap();
        if system == "bbr" {
            let could = set_tcp_congestion(connect().as_raw_fd(), "reno").is_ok();
            assert!(
                !could || got == "cubic" || got == "reno",
                "auto on bbr gave {got}"
            );
        } else {
            assert_eq!(got, system);
        }
        // A name: that algorithm (reno is always built in and allowed), or a clear error.
        let s = connect();
        configure(
            &s,
            TcpBuffers::default(),
            &TcpCongestion::Named("reno".into()),
            "s",
        )
        .unwrap();
        assert_eq!(tcp_congestion(s.as_raw_fd()).as_deref(), Some("reno"));
        let e = configure(
            &connect(),
            TcpBuffers::default(),
            &TcpCongestion::Named("nosuchcc".into()),
            "rank 7",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("CIERA_TCP_CONGESTION=nosuchcc")
                && e.contains("rank 7")
                && e.contains("available here"),
            "{e}"
        );
    }

    #[test]
    fn send_never_blocks_and_eof_is_peer_closed() {
        let (mut a, mut b) = pair();
        let big = vec![9u8; 64 << 20];
        let mut sent = 0;
        // Nobody reads: eventually the socket buffers fill and try_send returns 0.
        loop {
            let n = a.try_send(&big[sent..]).unwrap();
            if n == 0 {
                break;
            }
            sent += n;
        }
        assert!(a.want_write);
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0;
        drop(a);
        loop {
            match b.try_recv(&mut buf) {
                Ok(n) => {
                    assert!(buf[..n].iter().all(|&x| x == 9));
                    got += n;
                }
                Err(e) => {
                    assert!(e.is_peer_closed(), "{e}");
                    assert!(e.to_string().contains("rank 0"), "{e}");
                    break;
                }
            }
        }
        assert_eq!(got, sent);
    }

    #[test]
    fn bytes_sent_before_a_close_are_read_even_after_our_send_failed() {
        let (mut a, mut b) = pair();
        assert_eq!(b.try_send(b"last words").unwrap(), 10);
        // b closes its write side; a's sends then fail (EPIPE once b is gone entirely)...
        drop(b);
        let mut failed = false;
        for _ in 0..1000 {
            match a.try_send(&[1u8; 4096]) {
                Err(e) => {
                    assert!(e.is_peer_closed(), "{e}");
                    failed = true;
                    break;
                }
                Ok(_) => std::thread::sleep(std::time::Duration::from_millis(1)),
            }
        }
        assert!(failed, "sending to a closed peer never failed");
        assert!(a.is_closed());
        // ...but what b said before it closed is still delivered, then EOF.
        let mut buf = [0u8; 64];
        let n = a.try_recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"last words");
        assert!(a.try_recv(&mut buf).unwrap_err().is_peer_closed());
    }
    #[test]
    fn vectored_send_is_the_parts_in_order_and_short_when_full() {
        let (mut a, mut b) = pair();
        // Distinct bytes per part, so a reordered or skipped part shows.
        let head: Vec<u8> = (0..37u32).map(|i| (i * 7 + 1) as u8).collect();
        let body: Vec<u8> = (0..(48u32 << 20)).map(|i| (i % 251) as u8).collect();
        let want: Vec<u8> = head.iter().chain(body.iter()).copied().collect();
        let (mut off, mut got) = (0usize, Vec::with_capacity(want.len()));
        let mut buf = vec![0u8; 1 << 20];
        let mut short = false;
        while got.len() < want.len() {
            if off < want.len() {
                // Resume where the last call stopped: inside the head, or inside the body.
                let (h, b_) = if off < head.len() {
                    (&head[off..], &body[..])
                } else {
                    (&[][..], &body[off - head.len()..])
                };
                let n = a.try_send_vectored(&[h, &[], b_]).unwrap();
                short |= n < h.len() + b_.len();
                off += n;
            }
            let n = b.try_recv(&mut buf).unwrap();
            got.extend_from_slice(&buf[..n]);
        }
        assert!(
            short,
            "48 MiB never filled the socket: the short-send path went untested"
        );
        assert!(
            got == want,
            "the peer read other bytes than the parts in order"
        );
        assert_eq!(a.try_send_vectored(&[&[], &[]]).unwrap(), 0);
        // A closed peer: a peer-closed error naming it.
        drop(b);
        let mut failed = false;
        for _ in 0..1000 {
            match a.try_send_vectored(&[b"hdr", &[5u8; 4096]]) {
                Err(e) => {
                    assert!(e.is_peer_closed(), "{e}");
                    assert!(e.to_string().contains("rank 1"), "{e}");
                    failed = true;
                    break;
                }
                Ok(_) => std::thread::sleep(std::time::Duration::from_millis(1)),
            }
        }
        assert!(failed, "sending to a closed peer never failed");
    }
}
