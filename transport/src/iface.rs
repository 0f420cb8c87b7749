//! Picking the IP address a rank's listener binds to.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr};

use crate::config::ENV_SOCKET_IFNAME;
use crate::{Result, TransportError};

/// One IPv4 address of one network interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterfaceAddr {
    /// Interface name, e.g. `eth0`.
    pub name: String,
    /// Its IPv4 address.
    pub ip: Ipv4Addr,
    /// `IFF_UP` is set.
    pub up: bool,
    /// `IFF_LOOPBACK` is set.
    pub loopback: bool,
}

/// The IPv4 addresses of this machine's interfaces, in `getifaddrs` order.
pub fn ipv4_interfaces() -> Result<Vec<InterfaceAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `head` is a valid out-pointer; on success getifaddrs stores a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(TransportError::last_os(
            "getifaddrs",
            "listing network interfaces",
        ));
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a non-null node of the list getifaddrs returned, which stays valid
        // until freeifaddrs; we only read it.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_addr is non-null and points to a sockaddr whose family field is valid.
        let family = unsafe { (*ifa.ifa_addr).sa_family };
        if i32::from(family) != libc::AF_INET {
            continue;
        }
        // SAFETY: the family is AF_INET, so the sockaddr is a sockaddr_in.
        let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
        let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
        // SAFETY: ifa_name is a non-null NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        let flags = ifa.ifa_flags as i32;
        out.push(InterfaceAddr {
            name,
            ip,
            up: flags & libc::IFF_UP != 0,
            loopback: flags & libc::IFF_LOOPBACK != 0,
        });
    }
    // SAFETY: `head` came from a successful getifaddrs and is freed exactly once; no reference
    // into the list outlives this point (names were copied).
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The IP to bind: `CIERA_SOCKET_IFNAME=<ifname>` picks that interface's IPv4 address (an error
/// naming the interface and the ones that exist if it has none); unset, the first up,
/// non-loopback IPv4 interface, else 127.0.0.1.
pub fn interface_ip() -> Result<IpAddr> {
    let wanted = std::env::var(ENV_SOCKET_IFNAME)
        .ok()
        .filter(|s| !s.trim().is_empty());
    let interfaces = ipv4_interfaces()?;
    pick_interface(&interfaces, wanted.as_deref().map(str::trim))
}

fn pick_interface(interfaces: &[InterfaceAddr], wanted: Option<&str>) -> Result<IpAddr> {
    match wanted {
        Some(name) => interfaces
            .iter()
            .find(|i| i.name == name)
            .map(|i| IpAddr::V4(i.ip))
            .ok_or_else(|| {
                let have: Vec<String> = interfaces
                    .iter()
                    .map(|i| format!("{} ({})", i.name, i.ip))
                    .collect();
                TransportError::Config {
                    detail: format!(
                        "{ENV_SOCKET_IFNAME}={name}: no IPv4 address on that interface; \
                         interfaces with one: [{}]",
                        have.join(", ")
                    ),
                }
            }),
        None => Ok(interfaces
            .iter()
            .find(|i| i.up && !i.loopback)
            .map(|i| IpAddr::V4(i.ip))
            .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iface(name: &str, ip: [u8; 4], up: bool, loopback: bool) -> InterfaceAddr {
        InterfaceAddr {
            name: name.into(),
            ip: Ipv4Addr::from(ip),
            up,
            loopback,
        }
    }

    #[test]
    fn default_skips_loopback_and_down_interfaces() {
        let list = [
            iface("lo", [127, 0, 0, 1], true, true),
            iface("eth1", [10, 0, 0, 9], false, false),
            iface("eth0", [10, 0, 0, 2], true, false),
        ];
        assert_eq!(
            pick_interface(&list, None).unwrap(),
            IpAddr::from([10, 0, 0, 2])
        );
        assert_eq!(
            pick_interface(&list[..1], None).unwrap(),
            IpAddr::from([127, 0, 0, 1])
        );
        assert_eq!(
            pick_interface(&list, Some("eth1")).unwrap(),
            IpAddr::from([10, 0, 0, 9])
        );
    }

    #[test]
    fn missing_interface_is_named_in_the_error() {
        let list = [iface("lo", [127, 0, 0, 1], true, true)];
        let err = pick_interface(&list, Some("ib0")).unwrap_err().to_string();
        assert!(
            err.contains("ib0") && err.contains("lo (127.0.0.1)"),
            "{err}"
        );
    }

    #[test]
    fn this_machine_has_a_loopback_address() {
        let list = ipv4_interfaces().unwrap();
        assert!(list.iter().any(|i| i.ip == Ipv4Addr::LOCALHOST), "{list:?}");
        interface_ip().unwrap();
    }
}
