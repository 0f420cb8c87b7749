//! Blocking, deadline-bounded I/O for connection setup, and the little-endian encoding used by
//! setup messages and [`crate::PeerInfo`]. Only setup uses these; data links are non-blocking.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::{Result, TransportError};

/// Largest setup frame accepted from a peer (names, host ids and error messages are short).
pub(crate) const MAX_FRAME_BYTES: usize = 64 << 10;

fn remaining(deadline: Instant, what: &str) -> Result<Duration> {
    let now = Instant::now();
    if now >= deadline {
        return Err(TransportError::Timeout {
            op: what.to_string(),
        });
    }
    // A zero socket timeout means "block forever"; never hand one to the kernel.
    Ok((deadline - now).max(Duration::from_millis(1)))
}

fn peer_of(stream: &TcpStream) -> String {
    stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "unknown peer".into())
}

/// Errors that mean the other side went away.
pub(crate) fn is_disconnect(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
            | io::ErrorKind::NotConnected
    )
}

/// A failed blocking read or write step: Ok to try again (interrupted, or the per-step socket
/// timeout expired before the overall deadline), `PeerClosed` if the other side went away,
/// else an `Io` error naming the step and the peer.
fn retry_or_fail(stream: &TcpStream, op: &'static str, what: &str, e: io::Error) -> Result<()> {
    match e.kind() {
        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Ok(()),
        _ if is_disconnect(&e) => Err(TransportError::PeerClosed {
            detail: format!("{what}: {}: {e}", peer_of(stream)),
        }),
        _ => Err(TransportError::io(
            op,
            format!("{what} ({})", peer_of(stream)),
            e,
        )),
    }
}

/// Reads exactly `buf.len()` bytes before `deadline`. `what` describes the step for errors.
pub(crate) fn read_exact_by(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    what: &str,
) -> Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let left = remaining(deadline, what)?;
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| TransportError::io("set socket read timeout", what, e))?;
        match stream.read(&mut buf[done..]) {
            Ok(0) => {
                return Err(TransportError::PeerClosed {
                    detail: format!(
                        "{what}: {} closed the connection after {done} of {} bytes",
                        peer_of(stream),
                        buf.len()
                    ),
                })
            }
            Ok(n) => done += n,
            Err(e) => retry_or_fail(stream, "read", what, e)?,
        }
    }
    Ok(())
}

/// Writes all of `data` before `deadline`.
pub(crate) fn write_all_by(
    stream: &mut TcpStream,
    data: &[u8],
    deadline: Instant,
    what: &str,
) -> Result<()> {
    let mut done = 0;
    while done < data.len() {
        let left = remaining(deadline, what)?;
        stream
            .set_write_timeout(Some(left))
            .map_err(|e| TransportError::io("set socket write timeout", what, e))?;
        match stream.write(&data[done..]) {
            Ok(0) => {
                return Err(TransportError::PeerClosed {
                    detail: format!("{what}: {} stopped accepting data", peer_of(stream)),
                })
            }
            Ok(n) => done += n,
            Err(e) => retry_or_fail(stream, "write", what, e)?,
        }
    }
    Ok(())
}

/// Sends one frame: a u32 little-endian length, then `body`.
pub(crate) fn send_frame(
    stream: &mut TcpStream,
    body: &[u8],
    deadline: Instant,
    what: &str,
) -> Result<()> {
    debug_assert!(body.len() <= MAX_FRAME_BYTES);
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    write_all_by(stream, &frame, deadline, what)
}

/// Receives one frame sent by [`send_frame`].
pub(crate) fn recv_frame(stream: &mut TcpStream, deadline: Instant, what: &str) -> Result<Vec<u8>> {
    let mut len = [0u8; 4];
    read_exact_by(stream, &mut len, deadline, what)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(TransportError::Protocol {
            detail: format!(
                "{what}: {} announced a {len}-byte frame (limit {MAX_FRAME_BYTES})",
                peer_of(stream)
            ),
        });
    }
    let mut body = vec![0u8; len];
    read_exact_by(stream, &mut body, deadline, what)?;
    Ok(body)
}

/// Little-endian encoder.
#[derive(Default)]
pub(crate) struct Enc(pub Vec<u8>);

impl Enc {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.0.extend_from_slice(v);
        self
    }
    /// A string of at most `u16::MAX` bytes, length-prefixed (callers bound their strings).
    pub fn str(&mut self, v: &str) -> &mut Self {
        let v = &v.as_bytes()[..v.len().min(u16::MAX as usize)];
        self.u16(v.len() as u16).bytes(v)
    }
}

/// Little-endian decoder over one message; every short read is a `Protocol` error naming
/// `what` (the message) and the field.
pub(crate) struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'a str,
}

impl<'a> Dec<'a> {
    pub fn new(buf: &'a [u8], what: &'a str) -> Self {
        Dec { buf, pos: 0, what }
    }
    fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8]> {
        if self.buf.len() - self.pos < n {
            return Err(TransportError::Protocol {
                detail: format!(
                    "{}: truncated at {field} (needs {n} bytes at offset {}, message has {})",
                    self.what,
                    self.pos,
                    self.buf.len()
                ),
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub fn array<const N: usize>(&mut self, field: &str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, field)?);
        Ok(out)
    }
    pub fn u8(&mut self, field: &str) -> Result<u8> {
        Ok(self.array::<1>(field)?[0])
    }
    pub fn u16(&mut self, field: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(field)?))
    }
    pub fn u32(&mut self, field: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }
    pub fn str(&mut self, field: &str, max: usize) -> Result<String> {
        let len = self.u16(field)? as usize;
        if len > max {
            return Err(TransportError::Protocol {
                detail: format!("{}: {field} is {len} bytes (limit {max})", self.what),
            });
        }
        let raw = self.take(len, field)?;
        String::from_utf8(raw.to_vec()).map_err(|_| TransportError::Protocol {
            detail: format!("{}: {field} is not UTF-8", self.what),
        })
    }
    /// Errors if bytes are left over.
    pub fn finish(&self) -> Result<()> {
        if self.pos != self.buf.len() {
            return Err(TransportError::Protocol {
                detail: format!(
                    "{}: {} trailing bytes after offset {}",
                    self.what,
                    self.buf.len() - self.pos,
                    self.pos
                ),
            });
        }
        Ok(())
    }
}
