//! What a rank publishes so that others can reach it, and the host identity that decides
//! whether two ranks can share memory.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};
use std::sync::OnceLock;

use crate::wire::{Dec, Enc};
use crate::{Result, TransportError};

/// What a rank publishes through bootstrap so others can reach it.
///
/// Wire format of [`PeerInfo::to_bytes`] (little-endian):
///
/// | bytes | field                                            |
/// |-------|--------------------------------------------------|
/// | 4     | magic `CPI1`                                     |
/// | 4     | pid                                              |
/// | 1     | address family: 4 or 6                           |
/// | 4/16  | IP address                                       |
/// | 2     | port                                             |
/// | 4     | (family 6 only) scope id                         |
/// | 2 + n | host id, UTF-8, n <= 1024                        |
/// | 1     | flags: bit 0 = the rank can open an RDMA device  |
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// [`host_id`] of the rank's machine.
    pub host_id: String,
    /// Where the rank's listener accepts connections.
    pub addr: SocketAddr,
    /// The rank's process id (for error messages and liveness checks).
    pub pid: u32,
    /// The rank can open an RDMA device (feature `rdma` built, a device present): with
    /// `CIERA_TRANSPORT=auto` two ranks on different hosts that both can get an RDMA link.
    /// Published, so that both ends of a pair make the same choice.
    pub rdma: bool,
}

const PEER_INFO_MAGIC: &[u8; 4] = b"CPI1";
pub(crate) const MAX_HOST_ID_BYTES: usize = 1024;

impl PeerInfo {
    /// Serializes for bootstrap (see the type's documentation for the format).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.bytes(PEER_INFO_MAGIC).u32(self.pid);
        match self.addr {
            SocketAddr::V4(a) => {
                e.u8(4).bytes(&a.ip().octets()).u16(a.port());
            }
            SocketAddr::V6(a) => {
                e.u8(6)
                    .bytes(&a.ip().octets())
                    .u16(a.port())
                    .u32(a.scope_id());
            }
        }
        e.str(&self.host_id).u8(u8::from(self.rdma));
        e.0
    }

    /// Parses [`PeerInfo::to_bytes`] output; anything else is a `Protocol` error.
    pub fn from_bytes(b: &[u8]) -> Result<PeerInfo> {
        let mut d = Dec::new(b, "PeerInfo");
        if &d.array::<4>("magic")? != PEER_INFO_MAGIC {
            return Err(TransportError::Protocol {
                detail: format!(
                    "PeerInfo: bad magic in {} bytes (not from PeerInfo::to_bytes)",
                    b.len()
                ),
            });
        }
        let pid = d.u32("pid")?;
        let addr = match d.u8("address family")? {
            4 => {
                let ip = Ipv4Addr::from(d.array::<4>("IPv4 address")?);
                SocketAddr::new(IpAddr::V4(ip), d.u16("port")?)
            }
            6 => {
                let ip = Ipv6Addr::from(d.array::<16>("IPv6 address")?);
                let port = d.u16("port")?;
                let scope = d.u32("scope id")?;
                SocketAddr::V6(SocketAddrV6::new(ip, port, 0, scope))
            }
            other => {
                return Err(TransportError::Protocol {
                    detail: format!("PeerInfo: address family {other} (expected 4 or 6)"),
                })
            }
        };
        let host_id = d.str("host id", MAX_HOST_ID_BYTES)?;
        let flags = d.u8("flags")?;
        if flags > 1 {
            return Err(TransportError::Protocol {
                detail: format!("PeerInfo: unknown flags {flags:#x}"),
            });
        }
        d.finish()?;
        Ok(PeerInfo {
            host_id,
            addr,
            pid,
            rdma: flags == 1,
        })
    }
}

/// Identifies the machine *and* the shared-memory domain this process lives in:
/// `<hostname>/<boot id>/shm-<device of /dev/shm>/pidns-<pid namespace>`. Two ranks with equal
/// host ids can map each other's memory (a rank opens a peer's memory files as
/// `/proc/<peer pid>/fd/<fd>`, so both must see each other's pids); containers on one machine
/// with separate `/dev/shm` mounts or pid namespaces get different ids (and so talk TCP).
/// Stable for the life of the machine's boot.
pub fn host_id() -> String {
    static HOST_ID: OnceLock<String> = OnceLock::new();
    HOST_ID
        .get_or_init(|| {
            let read = |path: &str| {
                std::fs::read_to_string(path)
                    .ok()
                    .map(|s| s.trim().to_string())
            };
            let hostname = read("/proc/sys/kernel/hostname")
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "unknown-host".into());
            let boot_id =
                read("/proc/sys/kernel/random/boot_id").unwrap_or_else(|| "no-boot-id".into());
            let shm = shm_domain()
                .map(|dev| format!("shm-{dev:x}"))
                .unwrap_or_else(|| "no-shm".into());
            let pidns = std::fs::read_link("/proc/self/ns/pid")
                .ok()
                .and_then(|l| {
                    let l = l.to_string_lossy().into_owned();
                    l.strip_prefix("pid:[")?
                        .strip_suffix(']')
                        .map(str::to_string)
                })
                .map(|n| format!("pidns-{n}"))
                .unwrap_or_else(|| "no-pidns".into());
            let mut id = format!("{hostname}/{boot_id}/{shm}/{pidns}");
            id.truncate(MAX_HOST_ID_BYTES);
            id
        })
        .clone()
}

/// Device number of the tmpfs behind `/dev/shm` (two containers with their own `/dev/shm`
/// are kept apart even where they could share memory files).
pub(crate) fn shm_domain() -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata("/dev/shm").ok()?;
    meta.is_dir().then(|| meta.dev())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_info_round_trips_v4_and_v6() {
        for addr in ["10.0.0.2:4711", "[fe80::1%3]:9", "127.0.0.1:0"] {
            let mut addr: SocketAddr = match addr.parse() {
                Ok(a) => a,
                Err(_) => SocketAddr::V6(SocketAddrV6::new("fe80::1".parse().unwrap(), 9, 0, 3)),
            };
            if let SocketAddr::V6(a) = &mut addr {
                a.set_scope_id(3);
            }
            let info = PeerInfo {
                host_id: "node7/abc/shm-1f".into(),
                addr,
                pid: 4242,
                rdma: true,
            };
            let bytes = info.to_bytes();
            assert_eq!(PeerInfo::from_bytes(&bytes).unwrap(), info);
        }
    }

    #[test]
    fn peer_info_rejects_every_truncation_and_trailing_bytes() {
        let info = PeerInfo {
            host_id: "h".into(),
            addr: "1.2.3.4:5".parse().unwrap(),
            pid: 7,
            rdma: false,
        };
        let bytes = info.to_bytes();
        for len in 0..bytes.len() {
            let err = PeerInfo::from_bytes(&bytes[..len]).unwrap_err();
            assert!(
                matches!(err, TransportError::Protocol { .. }),
                "{len}: {err}"
            );
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(PeerInfo::from_bytes(&long)
            .unwrap_err()
            .to_string()
            .contains("trailing"));
        let mut bad_family = bytes.clone();
        bad_family[8] = 5;
        assert!(PeerInfo::from_bytes(&bad_family)
            .unwrap_err()
            .to_string()
            .contains("family 5"));
    }

    #[test]
    fn host_id_is_stable_and_names_the_host() {
        let id = host_id();
        assert_eq!(id, host_id());
        assert!(id.split('/').count() >= 4, "{id}");
        assert!(id.contains("/pidns-"), "{id}");
    }
}
