//! Transport selection and the environment variables that tune the transports.

use std::fmt;

use crate::{Result, TransportError};

/// Which transport a [`crate::Link`] runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Two SPSC byte rings in a POSIX shared-memory segment (peers on the same host).
    Shm,
    /// One TCP connection.
    Tcp,
    /// One reliable-connected RDMA queue pair (feature `rdma`; see `rdma/`).
    Rdma,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Shm => "shm",
            Kind::Tcp => "tcp",
            Kind::Rdma => "rdma",
        })
    }
}

/// Which transports `Endpoint::connect_all` may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportChoice {
    /// Shared memory between ranks on the same host; RDMA to ranks on other hosts where both
    /// ends have an RDMA device (and the `rdma` feature); TCP otherwise.
    Auto,
    /// Shared memory only; a peer on another host is an error.
    Shm,
    /// TCP for every peer, even on the same host.
    Tcp,
    /// RDMA for every peer, even on the same host; an error where this rank has no RDMA
    /// device or was built without the `rdma` feature.
    Rdma,
}

/// Environment variable read by [`TransportChoice::from_env`].
pub const ENV_TRANSPORT: &str = "CIERA_TRANSPORT";
/// The RDMA device to use (its verbs name, e.g. `mlx5_0` or `rxe0`); unset: the first one
/// with an active port.
pub const ENV_IB_HCA: &str = "CIERA_IB_HCA";
/// The GID table index RDMA links use on the chosen port; unset: the first IPv4-mapped GID
/// (RoCE v2 over IPv4), else the first non-zero one.
pub const ENV_IB_GID_INDEX: &str = "CIERA_IB_GID_INDEX";
/// Bytes per shm ring (one per direction); a power of two, at least 4096. Default 512 KiB.
pub const ENV_SHM_RING_BYTES: &str = "CIERA_SHM_RING_BYTES";
/// SO_SNDBUF/SO_RCVBUF for TCP links; `0` leaves the kernel's autotuning alone. Unset: each
/// direction can reach at least 4 MiB (autotuning where its ceiling allows that, else 4 MiB).
pub const ENV_TCP_BUF_BYTES: &str = "CIERA_TCP_BUF_BYTES";
/// `0`, `1` or `auto` (default): see [`SingleCopy`].
pub const ENV_SHM_SINGLE_COPY: &str = "CIERA_SHM_SINGLE_COPY";
/// Interface whose IPv4 address `interface_ip` returns.
pub const ENV_SOCKET_IFNAME: &str = "CIERA_SOCKET_IFNAME";
/// TCP congestion control for TCP links: `auto` (default), `system`, or an algorithm name;
/// see [`TcpCongestion`].
pub const ENV_TCP_CONGESTION: &str = "CIERA_TCP_CONGESTION";

/// 512 KiB: the data a sender copies in is still in cache when the receiver copies it out;
/// with much larger rings a sender runs so far ahead that it is not (ARCHITECTURE.md,
/// "Waiting (oversubscription) and placement", has the measurements).
pub(crate) const DEFAULT_SHM_RING_BYTES: usize = 512 << 10;
pub(crate) const DEFAULT_TCP_BUF_BYTES: usize = 4 << 20;
const MIN_SHM_RING_BYTES: usize = 4096;
pub(crate) const MAX_SHM_RING_BYTES: usize = 1 << 34;

impl TransportChoice {
    /// `CIERA_TRANSPORT=shm|tcp|rdma|auto` (case-insensitive); unset or empty means `Auto`.
    pub fn from_env() -> Result<TransportChoice> {
        match std::env::var(ENV_TRANSPORT) {
            Ok(value) => Self::parse(&value),
            Err(std::env::VarError::NotPresent) => Ok(TransportChoice::Auto),
            Err(std::env::VarError::NotUnicode(raw)) => Err(TransportError::Config {
                detail: format!("{ENV_TRANSPORT}={raw:?} is not one of shm, tcp, rdma, auto"),
            }),
        }
    }

    /// Parses the value of `CIERA_TRANSPORT`.
    pub fn parse(value: &str) -> Result<TransportChoice> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(TransportChoice::Auto),
            "shm" => Ok(TransportChoice::Shm),
            "tcp" => Ok(TransportChoice::Tcp),
            "rdma" => Ok(TransportChoice::Rdma),
            _ => Err(TransportError::Config {
                detail: format!("{ENV_TRANSPORT}={value:?} is not one of shm, tcp, rdma, auto"),
            }),
        }
    }
}

/// Parses a byte count: a decimal integer with an optional binary suffix (k, m, g; `KiB`, `MB`
/// and friends are read the same way).
pub(crate) fn parse_bytes(var: &str, value: &str) -> Result<usize> {
    let text = value.trim().to_ascii_lowercase();
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, suffix) = text.split_at(digits_end);
    let shift = match suffix.trim() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => u32::MAX,
    };
    let number: Option<usize> = digits.parse().ok();
    match (number, shift) {
        (Some(n), s) if s != u32::MAX => n.checked_mul(1usize << s).ok_or(()),
        _ => Err(()),
    }
    .map_err(|()| TransportError::Config {
        detail: format!("{var}={value:?} is not a byte count (e.g. 4194304 or 4M)"),
    })
}

fn env_bytes(var: &str) -> Result<Option<usize>> {
    match std::env::var(var) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => parse_bytes(var, &v).map(Some),
        Err(_) => Ok(None),
    }
}

/// Ring size for shm segments this rank creates.
pub(crate) fn shm_ring_bytes() -> Result<usize> {
    let bytes = env_bytes(ENV_SHM_RING_BYTES)?.unwrap_or(DEFAULT_SHM_RING_BYTES);
    check_ring_bytes(bytes).map_err(|why| TransportError::Config {
        detail: format!("{ENV_SHM_RING_BYTES}={bytes}: {why}"),
    })?;
    Ok(bytes)
}

/// `CIERA_SHM_SINGLE_COPY`: whether same-host ranks may copy large payloads straight out of
/// each other's memory (process_vm_readv) instead of through the rings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SingleCopy {
    /// `0`: every byte goes through the rings; the transport does not probe.
    Off,
    /// `1`: every large raw segment goes by reference where the peer proved it can read us.
    On,
    /// `auto` (default): the transport probes, and the communicator picks rings or references
    /// per call size by measuring both (see `ciera::engine::single_copy`). Neither wins
    /// everywhere: the rings are faster while two ranks share a cache and slower while they
    /// run on cores that do not (every cache line written by one rank then costs the other a
    /// round trip), and a hypervisor can change that from one second to the next.
    Auto,
}

impl SingleCopy {
    /// From `CIERA_SHM_SINGLE_COPY` (unset: auto).
    pub fn from_env() -> Result<SingleCopy> {
        SingleCopy::parse(&std::env::var(ENV_SHM_SINGLE_COPY).unwrap_or_default())
    }

    /// A `CIERA_SHM_SINGLE_COPY` value: `auto` or empty, `0`/`off`/`no`/`false`,
    /// `1`/`on`/`yes`/`true` (any case, surrounding blanks ignored).
    pub fn parse(value: &str) -> Result<SingleCopy> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(SingleCopy::Auto),
            "0" | "off" | "no" | "false" => Ok(SingleCopy::Off),
            "1" | "on" | "yes" | "true" => Ok(SingleCopy::On),
            _ => Err(TransportError::Config {
                detail: format!("{ENV_SHM_SINGLE_COPY}={value:?} is not 0, 1 or auto"),
            }),
        }
    }
}

pub(crate) fn check_ring_bytes(bytes: usize) -> std::result::Result<(), String> {
    if !bytes.is_power_of_two() {
        return Err("ring size must be a power of two".into());
    }
    if !(MIN_SHM_RING_BYTES..=MAX_SHM_RING_BYTES).contains(&bytes) {
        return Err(format!(
            "ring size must lie in {MIN_SHM_RING_BYTES}..={MAX_SHM_RING_BYTES}"
        ));
    }
    Ok(())
}

/// SO_SNDBUF and SO_RCVBUF to set on TCP links; `None` keeps the kernel's autotuning.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TcpBuffers {
    pub send: Option<usize>,
    pub recv: Option<usize>,
}

/// Socket buffer sizes for TCP links. `CIERA_TCP_BUF_BYTES=n` sets both to n (0: autotuning).
/// Unset, each direction gets at least 4 MiB: setting a size turns the kernel's autotuning off
/// for that socket, and autotuning is faster wherever its ceiling (net.ipv4.tcp_rmem/tcp_wmem,
/// third field) already reaches 4 MiB, so the size is only set where the ceiling is lower.
pub(crate) fn tcp_buffer_bytes() -> Result<TcpBuffers> {
    match env_bytes(ENV_TCP_BUF_BYTES)? {
        Some(0) => Ok(TcpBuffers::default()),
        Some(n) => Ok(TcpBuffers {
            send: Some(n),
            recv: Some(n),
        }),
        None => {
            let ceiling = |path: &str| -> Option<usize> {
                std::fs::read_to_string(path)
                    .ok()?
                    .split_whitespace()
                    .nth(2)?
                    .parse()
                    .ok()
            };
            let pick = |path: &str| match ceiling(path) {
                Some(max) if max >= DEFAULT_TCP_BUF_BYTES => None,
                _ => Some(DEFAULT_TCP_BUF_BYTES),
            };
            Ok(TcpBuffers {
                send: pick("/proc/sys/net/ipv4/tcp_wmem"),
                recv: pick("/proc/sys/net/ipv4/tcp_rmem"),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_congestion_values_parse() {
        assert_eq!(TcpCongestion::parse("").unwrap(), TcpCongestion::Auto);
        assert_eq!(TcpCongestion::parse(" AUTO ").unwrap(), TcpCongestion::Auto);
        assert_eq!(
            TcpCongestion::parse("system").unwrap(),
            TcpCongestion::System
        );
        assert_eq!(
            TcpCongestion::parse("Cubic").unwrap(),
            TcpCongestion::Named("cubic".into())
        );
        for bad in ["a b", "x".repeat(16).as_str(), "bbr;", "/etc"] {
            let e = TcpCongestion::parse(bad).unwrap_err().to_string();
            assert!(e.contains("CIERA_TCP_CONGESTION"), "{bad}: {e}");
        }
    }

    #[test]
    fn single_copy_parses_known_values_and_names_bad_ones() {
        for (v, want) in [
            ("", SingleCopy::Auto),
            (" Auto ", SingleCopy::Auto),
            ("0", SingleCopy::Off),
            ("off", SingleCopy::Off),
            ("1", SingleCopy::On),
            ("TRUE", SingleCopy::On),
        ] {
            assert_eq!(SingleCopy::parse(v).unwrap(), want, "{v:?}");
        }
        let err = SingleCopy::parse("2").unwrap_err().to_string();
        assert!(
            err.contains("CIERA_SHM_SINGLE_COPY=\"2\" is not 0, 1 or auto"),
            "{err}"
        );
    }

    #[test]
    fn choice_parses_known_values_and_names_bad_ones() {
        assert_eq!(TransportChoice::parse("shm").unwrap(), TransportChoice::Shm);
        assert_eq!(
            TransportChoice::parse(" TCP ").unwrap(),
            TransportChoice::Tcp
        );
        assert_eq!(
            TransportChoice::parse("auto").unwrap(),
            TransportChoice::Auto
        );
        assert_eq!(TransportChoice::parse("").unwrap(), TransportChoice::Auto);
        let err = TransportChoice::parse("infiniband")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("CIERA_TRANSPORT") && err.contains("infiniband"),
            "{err}"
        );
    }

    #[test]
    fn byte_counts_parse_with_suffixes() {
        assert_eq!(parse_bytes("X", "4096").unwrap(), 4096);
        assert_eq!(parse_bytes("X", "4M").unwrap(), 4 << 20);
        assert_eq!(parse_bytes("X", "64kib").unwrap(), 64 << 10);
        assert_eq!(parse_bytes("X", "1G").unwrap(), 1 << 30);
        assert!(parse_bytes("X", "4Q")
            .unwrap_err()
            .to_string()
            .contains("X=\"4Q\""));
        assert!(parse_bytes("X", "-1").is_err());
        assert!(parse_bytes("X", "99999999999999999999999G").is_err());
    }

    #[test]
    fn ring_sizes_must_be_powers_of_two_in_range() {
        assert!(check_ring_bytes(4 << 20).is_ok());
        assert!(check_ring_bytes(4096).is_ok());
        assert!(check_ring_bytes(3 << 20).is_err());
        assert!(check_ring_bytes(2048).is_err());
    }
}

/// `CIERA_TCP_CONGESTION`: the congestion control of this rank's TCP links (each side picks
/// it for what it sends).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TcpCongestion {
    /// `auto` (default): the kernel's default, unless that is `bbr`: then `cubic`, or `reno`
    /// where unprivileged processes may not pick cubic. BBR paces every flow to its estimate
    /// of the path's bandwidth, so a collective's bursts wait for the pacer (ARCHITECTURE.md,
    /// "Transports", has the measurements).
    #[default]
    Auto,
    /// `system`: whatever the kernel's default is.
    System,
    /// That algorithm (as in /proc/sys/net/ipv4/tcp_available_congestion_control); a link
    /// whose kernel refuses it fails to set up, naming it.
    Named(String),
}

impl TcpCongestion {
    /// From `CIERA_TCP_CONGESTION` (unset: auto).
    pub fn from_env() -> Result<TcpCongestion> {
        TcpCongestion::parse(&std::env::var(ENV_TCP_CONGESTION).unwrap_or_default())
    }

    /// `auto` or empty, `system`, or an algorithm name (1-15 of `a-z 0-9 _ -`).
    pub fn parse(value: &str) -> Result<TcpCongestion> {
        let v = value.trim().to_ascii_lowercase();
        match v.as_str() {
            "" | "auto" => Ok(TcpCongestion::Auto),
            "system" => Ok(TcpCongestion::System),
            name if (1..16).contains(&name.len())
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') =>
            {
                Ok(TcpCongestion::Named(name.to_string()))
            }
            _ => Err(TransportError::Config {
                detail: format!(
                    "{ENV_TCP_CONGESTION}={value:?} is not auto, system or a congestion control \
                     name (see /proc/sys/net/ipv4/tcp_available_congestion_control)"
                ),
            }),
        }
    }
}
