//! Transports for CIERA: non-blocking, polled byte-stream links between ranks, over POSIX
//! shared memory (same host) and TCP (any host), with authenticated connection setup.
//!
//! * [`Endpoint`] owns a rank's TCP listener and, after [`Endpoint::connect_all`], one
//!   [`Link`] to every other rank. Links never block: [`Link::try_send`] and
//!   [`Link::try_recv`] move what they can and return `Ok(0)` otherwise;
//!   [`Endpoint::wait`] sleeps until some link may make progress.
//! * Shared memory (`shm/`: the rings in `mod.rs`, the segment layout in `segment.rs`, single copy in `offers.rs`): one segment per pair with two SPSC byte rings (and a single-copy
//!   path: large payloads offered by address and copied by the receiver with
//!   process_vm_readv, see [`Link::can_offer`], or with a plain copy out of a mapping when the
//!   bytes lie in a [`SharedBuffer`], `shared.rs`), a futex doorbell
//!   per rank (`doorbell.rs`, with the argument why no wake-up is lost), and the setup TCP
//!   connection kept as a liveness channel. Segments and doorbells are anonymous memory files
//!   that peers open through `/proc/<pid>/fd`: nothing is ever named in /dev/shm, so nothing
//!   can be left there, even if a rank is SIGKILLed during setup.
//! * TCP (`tcp.rs`): one non-blocking connection per pair, TCP_NODELAY, large buffers.
//! * RDMA (`rdma/`, feature `rdma`): one reliable-connected queue pair per pair, bytes
//!   written into the peer's registered ring by RDMA WRITE with immediate, credit-based flow
//!   control, the setup TCP connection kept as a liveness channel. Each link registers its
//!   ring and a send staging buffer; bytes are copied into staging, except bytes in a
//!   [`SharedBuffer`], which the link registers once and writes from where they lie
//!   ([`rdma_zero_copy_bytes`] counts them; `try_send` waits for those writes to complete).
//!   [`Endpoint::register_dmabuf`] registers a device buffer ([`DmaBuf`]) through
//!   `ibv_reg_dmabuf_mr`, or says why it cannot ("device buffers need dma-buf support
//!   (ibv_reg_dmabuf_mr): ...", `Unsupported`).
//! * Authentication (`auth.rs`): mutual HMAC-SHA256 challenge-response with the job secret on
//!   every connection, each proof bound to its direction, the connection and both parties.
//!
//! Environment: `CIERA_TRANSPORT` (shm|tcp|rdma|auto), `CIERA_IB_HCA` (RDMA device name),
//! `CIERA_IB_GID_INDEX`, `CIERA_SHM_RING_BYTES` (power of two,
//! default 512 KiB per direction), `CIERA_SHM_SINGLE_COPY` (0|1|auto: process_vm_readv single
//! copy of large payloads; auto by default: the transport probes, the caller chooses per call),
//! `CIERA_TCP_BUF_BYTES` (0 = kernel autotuning), `CIERA_TCP_CONGESTION` (auto|system|name:
//! auto leaves the kernel's default unless it is bbr, whose pacing delays a collective's bursts),
//! `CIERA_SOCKET_IFNAME`.
//!
//! Typical use (the communicator's bootstrap moves the `PeerInfo`s around):
//!
//! ```no_run
//! # use std::time::{Duration, Instant};
//! # use ciera_transport::*;
//! # fn exchange_through_bootstrap(_: PeerInfo) -> Vec<PeerInfo> { unimplemented!() }
//! # fn main() -> Result<()> {
//! let mut ep = Endpoint::bind(interface_ip()?)?;
//! let peers = exchange_through_bootstrap(ep.local_info());
//! let deadline = Instant::now() + Duration::from_secs(60);
//! ep.connect_all(0, &peers, &[7; 32], TransportChoice::from_env()?, deadline)?;
//! let msg = b"hello";
//! let mut sent = 0;
//! while sent < msg.len() {
//!     match ep.link(1).try_send(&msg[sent..])? {
//!         0 => ep.wait(Duration::from_millis(10))?,
//!         n => sent += n,
//!     }
//! }
//! # Ok(()) }
//! ```

pub mod auth;
mod config;
pub mod copy;
mod doorbell;
mod endpoint;
mod error;
mod iface;
mod peer;
#[cfg(feature = "rdma")]
mod rdma;
mod setup;
mod shared;
mod shm;
mod sys;
mod tcp;
mod wire;

pub use config::{
    Kind, SingleCopy, TcpCongestion, TransportChoice, ENV_IB_GID_INDEX, ENV_IB_HCA,
    ENV_SHM_RING_BYTES, ENV_SHM_SINGLE_COPY, ENV_SOCKET_IFNAME, ENV_TCP_BUF_BYTES,
    ENV_TCP_CONGESTION, ENV_TRANSPORT,
};
pub use endpoint::{Endpoint, Link, Waker};
pub use error::{Result, TransportError};
pub use iface::{interface_ip, ipv4_interfaces, InterfaceAddr};
pub use peer::{host_id, PeerInfo};
pub use shared::{shared_region_of, SharedBuffer, SharedRegion};

/// A device buffer exported as a dma-buf (GPUDirect RDMA through the kernel's dma-buf
/// interface), to register with RDMA links ([`Endpoint::register_dmabuf`]): `len` bytes at
/// `offset` of the dma-buf descriptor `fd`, addressed as `iova` in work requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DmaBuf {
    pub fd: std::os::fd::RawFd,
    pub offset: u64,
    pub len: usize,
    pub iova: u64,
}

/// Bytes RDMA links sent straight from registered user buffers ([`SharedBuffer`]s), with no
/// copy into the send staging buffer, by this process so far (always 0 without the feature).
pub fn rdma_zero_copy_bytes() -> u64 {
    #[cfg(feature = "rdma")]
    {
        rdma::zero_copy_bytes()
    }
    #[cfg(not(feature = "rdma"))]
    {
        0
    }
}

/// Whether this process can use RDMA links: built with the `rdma` feature and an RDMA device
/// present (`CIERA_IB_HCA`'s, if set). Decided once per process.
pub fn rdma_available() -> bool {
    #[cfg(feature = "rdma")]
    {
        rdma::available()
    }
    #[cfg(not(feature = "rdma"))]
    {
        false
    }
}

/// Why this process cannot use RDMA links, or `None` if it can.
pub fn rdma_unavailable_reason() -> Option<String> {
    #[cfg(feature = "rdma")]
    {
        rdma::unavailable_reason()
    }
    #[cfg(not(feature = "rdma"))]
    {
        Some("built without the rdma feature (cargo build --features rdma)".into())
    }
}

/// RDMA queue pairs and memory registrations this process holds now, over all endpoints;
/// `(0, 0)` once every endpoint with RDMA links is dropped (and always without the feature).
pub fn rdma_live_resources() -> (usize, usize) {
    #[cfg(feature = "rdma")]
    {
        rdma::live_resources()
    }
    #[cfg(not(feature = "rdma"))]
    {
        (0, 0)
    }
}
