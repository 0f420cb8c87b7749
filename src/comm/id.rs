//! `UniqueId`: what every rank of a job must be handed (like `ncclUniqueId`): the root's
//! address and the job secret, in 128 opaque bytes.
//!
//! ```text
//! off len field
//!   0   8 magic "CIERAUID"
//!   8   2 version (1), little-endian
//!  10   1 address family: 4 or 6
//!  11   1 reserved, zero
//!  12   2 root port, little-endian
//!  14  16 root IP (IPv4 in the first 4 bytes)
//!  30   2 reserved, zero
//!  32  32 job secret (random; authenticates every bootstrap and transport connection)
//!  64  64 reserved, zero
//! ```
//! The id is a credential: whoever holds it can join the job. Its `Debug` shows only the root.

use std::fmt;
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::time::Duration;

use super::bootstrap::{self, RootMode};
use crate::error::{Error, Result};

pub const UNIQUE_ID_BYTES: usize = 128;
const MAGIC: &[u8; 8] = b"CIERAUID";
const VERSION: u16 = 1;

#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    bytes: [u8; UNIQUE_ID_BYTES],
}

impl UniqueId {
    /// A new job: a random secret and a root server (a thread of this process) listening on
    /// this host's interface address (`CIERA_SOCKET_IFNAME` picks the interface). The root
    /// serves one job and waits at most `CIERA_TIMEOUT` (default 300 s) for its last rank.
    pub fn new() -> Result<UniqueId> {
        UniqueId::with_secret(random_secret()?)
    }

    /// As [`UniqueId::new`] with a given secret.
    pub fn with_secret(secret: [u8; 32]) -> Result<UniqueId> {
        let ip = ciera_transport::interface_ip()
            .map_err(|e| Error::Bootstrap(format!("choosing the root's interface: {e}")))?;
        let listener = TcpListener::bind((ip, 0))
            .map_err(|e| Error::Bootstrap(format!("binding the root listener on {ip}: {e}")))?;
        let timeout = super::Config::from_env()
            .map(|c| c.timeout)
            .unwrap_or(super::DEFAULT_TIMEOUT);
        let addr = bootstrap::spawn_root(listener, secret, RootMode::Once, round_timeout(timeout))?;
        Ok(UniqueId::from_parts(addr, &secret))
    }

    /// An id naming a root that someone else runs (for `ciera launch`'s ranks and tests).
    pub fn from_parts(root: SocketAddr, secret: &[u8; 32]) -> UniqueId {
        let mut b = [0u8; UNIQUE_ID_BYTES];
        b[..8].copy_from_slice(MAGIC);
        b[8..10].copy_from_slice(&VERSION.to_le_bytes());
        match root.ip() {
            IpAddr::V4(v4) => {
                b[10] = 4;
                b[14..18].copy_from_slice(&v4.octets());
            }
            IpAddr::V6(v6) => {
                b[10] = 6;
                b[14..30].copy_from_slice(&v6.octets());
            }
        }
        b[12..14].copy_from_slice(&root.port().to_le_bytes());
        b[32..64].copy_from_slice(secret);
        UniqueId { bytes: b }
    }

    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.bytes
    }

    pub fn from_bytes(b: &[u8; UNIQUE_ID_BYTES]) -> Result<UniqueId> {
        let bad = |what: String| {
            Err(Error::InvalidArgument(format!(
                "not a CIERA unique id: {what}"
            )))
        };
        if &b[..8] != MAGIC {
            return bad("wrong magic (not made by UniqueId::new, or corrupted in transit)".into());
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        if version != VERSION {
            return bad(format!(
                "version {version}; this build reads version {VERSION}"
            ));
        }
        if b[10] != 4 && b[10] != 6 {
            return bad(format!("address family {}", b[10]));
        }
        Ok(UniqueId { bytes: *b })
    }

    /// The root server's address.
    pub fn root(&self) -> SocketAddr {
        let b = &self.bytes;
        let port = u16::from_le_bytes([b[12], b[13]]);
        let ip = if b[10] == 4 {
            IpAddr::V4(Ipv4Addr::new(b[14], b[15], b[16], b[17]))
        } else {
            let mut o = [0u8; 16];
            o.copy_from_slice(&b[14..30]);
            IpAddr::V6(Ipv6Addr::from(o))
        };
        SocketAddr::new(ip, port)
    }

    pub fn secret(&self) -> [u8; 32] {
        let mut s = [0u8; 32];
        s.copy_from_slice(&self.bytes[32..64]);
        s
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UniqueId {{ root: {}, secret: <hidden> }}", self.root())
    }
}

/// 32 random bytes from the kernel.
pub fn random_secret() -> Result<[u8; 32]> {
    let mut s = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut s))
        .map_err(|e| Error::Io {
            what: "reading /dev/urandom for the job secret".into(),
            source: e,
        })?;
    Ok(s)
}

/// The root gives up on a round a little before the ranks' own deadline, so the joined ranks
/// hear which ranks are missing instead of timing out blind.
pub fn round_timeout(timeout: Duration) -> Duration {
    timeout.mul_f64(0.9)
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn parse_hex_secret(s: &str) -> Result<[u8; 32]> {
    let s = s.trim();
    if s.len() != 64 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err(Error::InvalidArgument(format!(
            "CIERA_SECRET must be 64 hex digits (32 bytes), got {} characters",
            s.len()
        )));
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("checked hex");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_round_trips_and_hides_its_secret() {
        let secret = [7u8; 32];
        let id = UniqueId::from_parts("10.1.2.3:4567".parse().unwrap(), &secret);
        let back = UniqueId::from_bytes(id.as_bytes()).unwrap();
        assert_eq!(back.root(), "10.1.2.3:4567".parse().unwrap());
        assert_eq!(back.secret(), secret);
        assert!(!format!("{id:?}").contains("0707"));
        let v6 = UniqueId::from_parts("[::1]:9".parse().unwrap(), &secret);
        assert_eq!(v6.root(), "[::1]:9".parse().unwrap());
        let mut bad = *id.as_bytes();
        bad[0] = b'X';
        assert!(UniqueId::from_bytes(&bad).is_err());
    }

    #[test]
    fn secret_hex_round_trips() {
        let s = random_secret().unwrap();
        assert_eq!(parse_hex_secret(&hex(&s)).unwrap(), s);
        assert!(parse_hex_secret("abc").is_err());
        assert!(parse_hex_secret(&"g".repeat(64)).is_err());
    }
}
