//! Where a collective's bytes live, and how a peer may read them without their passing through
//! the link.
//!
//! - [`Location`]: host or device memory (the CUDA driver says which:
//!   [`crate::gpu::driver::classify`]). The engine moves host memory today; a device engine
//!   plugs in behind the same payload trait (`engine::Payloads` reports its location).
//! - [`PeerRegion`] / [`PeerSpan`]: memory a peer process on this host can read directly, as a
//!   reference segment names it on the wire (`engine::wire`, tag 'R'): any address of the
//!   sender (read with process_vm_readv), or an address inside one of its [`SharedBuffer`]s
//!   (a memfd the peer maps). CUDA IPC / VMM handles and RDMA keys are the next kinds: each is
//!   a variant here, an encoding in the reference header and a read in the transport.
#![forbid(unsafe_code)]

pub use ciera_transport::{shared_region_of, SharedBuffer, SharedRegion};

use crate::error::{Error, Result};

/// Where a buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// Pageable or pinned host memory: the CPU may read and write it.
    Host,
    /// Device or managed memory.
    Device,
    /// The CUDA driver answered with an error that says neither.
    Unknown,
}

/// Memory of a sender that a peer on its host may copy out of by itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerRegion {
    /// Any address of the sender's process: the peer reads it with process_vm_readv, which it
    /// proved it may at link setup.
    Process,
    /// An address inside the sender's [`SharedBuffer`] `0`: the peer copies out of its own
    /// read-only mapping of that memfd, without a system call.
    Shared(SharedRegion),
}

/// `addr` in the sender's address space, within `region`: where a reference segment's bytes
/// are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerSpan {
    pub addr: u64,
    pub region: PeerRegion,
}

impl PeerSpan {
    /// The span of host bytes `b` of this process: inside a shared buffer if it lies in one.
    pub fn of_host(b: &[u8]) -> PeerSpan {
        let addr = b.as_ptr() as u64;
        PeerSpan {
            addr,
            region: match shared_region_of(addr, b.len()) {
                Some(r) => PeerRegion::Shared(r),
                None => PeerRegion::Process,
            },
        }
    }

    /// The same span `n` bytes further on.
    pub fn advanced(self, n: usize) -> PeerSpan {
        PeerSpan {
            addr: self.addr + n as u64,
            ..self
        }
    }

    /// The shared buffer holding the span, if any (what the transport's reader takes).
    pub fn shared(&self) -> Option<SharedRegion> {
        match self.region {
            PeerRegion::Shared(r) => Some(r),
            PeerRegion::Process => None,
        }
    }

    /// Whether a peer reads it without a system call (a mapping, not process_vm_readv).
    pub fn is_shared(&self) -> bool {
        matches!(self.region, PeerRegion::Shared(_))
    }
}

/// A zeroed [`SharedBuffer`] of `len` bytes: memory same-host peers copy out of without a
/// system call when it is a collective's send (or in-place) buffer. An allocation failure is
/// [`Error::Io`] naming the size.
pub fn alloc_shared(len: usize) -> Result<SharedBuffer> {
    SharedBuffer::new(len).map_err(|e| Error::Io {
        what: format!("allocating a shared buffer of {len} bytes"),
        source: match e {
            ciera_transport::TransportError::Io { source, .. } => source,
            other => std::io::Error::other(other.to_string()),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_name_the_shared_buffer_they_lie_in() {
        let heap = vec![0u8; 4096];
        let s = PeerSpan::of_host(&heap);
        assert_eq!(s.region, PeerRegion::Process);
        assert_eq!(s.addr, heap.as_ptr() as u64);
        assert!(!s.is_shared());
        let buf = alloc_shared(1 << 16).expect("a shared buffer");
        let inside = &buf[100..200];
        let s = PeerSpan::of_host(inside);
        let r = s.shared().expect("inside a shared buffer");
        assert_eq!(r.base, buf.as_ptr() as u64);
        assert_eq!(s.addr, r.base + 100);
        assert_eq!(s.advanced(7).addr, s.addr + 7);
        assert_eq!(s.advanced(7).region, s.region);
    }
}
