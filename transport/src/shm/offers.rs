//! Single copy by reference over a shm link (see the module documentation of `shm`): offers
//! and claims on the sending side, reads out of the sender (a mapping of its shared buffer, or
//! process_vm_readv) on the receiving side, and withdrawing offers when a call fails.

use std::sync::atomic::Ordering;

use super::segment::{claimed_off, reads_ok_off, withdrawn_off};
use super::ShmLink;
use crate::copy::{copy_fast_raw, copy_streaming_raw};
use crate::shared::SharedRegion;
use crate::sys::process_vm_read;
use crate::{Result, TransportError};

impl ShmLink {
    /// Whether `try_recv` copies with non-temporal stores from now on.
    pub fn set_streaming(&mut self, on: bool) {
        self.streaming = on;
    }

    /// Whether the peer proved it can copy out of this process's memory (and we have not
    /// withdrawn offers on this link).
    pub fn can_offer(&self) -> bool {
        !self.withdrawn
            && self
                .seg
                .atomic_u32(reads_ok_off(1 - self.side))
                .load(Ordering::Acquire)
                != 0
    }

    /// Bytes copied from the peer's shared buffers through our mappings of them.
    pub fn mapped_copied(&self) -> u64 {
        self.maps.copied
    }

    /// Bytes ever offered by reference on this link.
    pub fn offered(&self) -> u64 {
        self.offered
    }

    /// Counts `n` more bytes offered by reference (the caller put their address on the
    /// stream, or is about to).
    pub fn offer(&mut self, n: usize) {
        self.offered += n as u64;
    }

    /// Bytes offered that the peer has not copied yet. `PeerClosed` if some are outstanding
    /// and the peer is gone (they never will be).
    pub fn unclaimed(&mut self) -> Result<u64> {
        if self.offered == 0 {
            return Ok(0);
        }
        let claimed = self
            .seg
            .atomic_u64(claimed_off(self.send_ring()))
            .load(Ordering::Acquire);
        let left = self.offered.wrapping_sub(claimed);
        if left > self.offered {
            return Err(self.corrupt("bytes offered vs claimed", self.offered, claimed));
        }
        if left > 0 {
            if self.closed.is_some() {
                return Err(self.closed_error());
            }
            if self.peer_closed_flag() {
                self.closed = Some(format!("{} closed the shm link", self.peer_desc));
                return Err(self.closed_error());
            }
            self.note_idle();
        }
        Ok(left)
    }

    /// After a failed call: takes back what the peer has not copied yet, so it cannot copy
    /// memory the caller is about to reuse (see the module documentation).
    pub fn withdraw_offers(&mut self) {
        if self.offered == 0 || self.withdrawn {
            return;
        }
        let claimed = self
            .seg
            .atomic_u64(claimed_off(self.send_ring()))
            .load(Ordering::SeqCst);
        if claimed == self.offered {
            return; // all copied: nothing to take back
        }
        self.withdrawn = true;
        self.seg
            .atomic_u32(withdrawn_off(self.side))
            .store(1, Ordering::SeqCst);
        self.peer_bell.ring();
    }

    /// Copies `dst.len()` bytes (or fewer) offered by the peer at address `remote` of its
    /// memory, and counts them as claimed. When the offer named one of the peer's shared
    /// buffers (`region`), the copy is a plain one out of our mapping of it (see `shared.rs`).
    pub fn try_read_peer(
        &mut self,
        remote: u64,
        region: Option<SharedRegion>,
        dst: &mut [u8],
    ) -> Result<usize> {
        if dst.is_empty() {
            return Ok(0);
        }
        if self.closed.is_some() {
            return Err(self.closed_error());
        }
        let mapped = match region {
            Some(r) => self
                .maps
                .resolve(self.peer_pid, r, remote, dst.len())
                .map_err(|e| match e {
                    TransportError::Protocol { detail } => TransportError::Protocol {
                        detail: format!("{}: {detail}", self.peer_desc),
                    },
                    e => e,
                })?,
            None => None,
        };
        let n = match mapped {
            Some(src) => {
                // SAFETY: `src` points at dst.len() readable bytes of our read-only mapping
                // of the peer's buffer (resolve checked the bounds); `dst` is ours and
                // exclusive. The peer keeps those bytes unchanged until we claim them, and
                // the withdrawal check below rejects a copy that raced with a withdrawal.
                unsafe {
                    if self.streaming {
                        copy_streaming_raw(dst.as_mut_ptr(), src, dst.len());
                    } else {
                        copy_fast_raw(dst.as_mut_ptr(), src, dst.len());
                    }
                }
                self.maps.copied += dst.len() as u64;
                Ok(dst.len())
            }
            None => process_vm_read(self.peer_pid, remote, dst),
        };
        let n = match n {
            Ok(0) => {
                return Err(TransportError::Protocol {
                    detail: format!(
                        "{} offered {} bytes at {remote:#x} that are not in its memory",
                        self.peer_desc,
                        dst.len()
                    ),
                })
            }
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                self.closed = Some(format!(
                    "{} went away: process {} has exited",
                    self.peer_desc, self.peer_pid
                ));
                return Err(self.closed_error());
            }
            Err(e) => {
                return Err(TransportError::io(
                    "process_vm_readv",
                    format!(
                        "copying {} bytes at {remote:#x} from {} (pid {})",
                        dst.len(),
                        self.peer_desc,
                        self.peer_pid
                    ),
                    e,
                ))
            }
        };
        // The copy is done; only now look at the flag (see "Single copy" above).
        std::sync::atomic::fence(Ordering::SeqCst);
        if self
            .seg
            .atomic_u32(withdrawn_off(1 - self.side))
            .load(Ordering::SeqCst)
            != 0
        {
            self.closed = Some(format!(
                "{} withdrew the memory it offered (its call failed)",
                self.peer_desc
            ));
            return Err(self.closed_error());
        }
        self.claimed += n as u64;
        self.seg
            .atomic_u64(claimed_off(self.recv_ring()))
            .store(self.claimed, Ordering::Release);
        self.peer_bell.ring();
        Ok(n)
    }
}
