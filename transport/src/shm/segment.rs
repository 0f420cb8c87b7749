//! The shared-memory segment of one link: its layout (the table in the module documentation of
//! `shm`), creating and opening it, and the single-copy probe each side publishes in it.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::{check_ring_bytes, MAX_SHM_RING_BYTES};
use crate::sys::{fill_random, process_vm_read, ShmMapping};
use crate::{Result, TransportError};

pub(crate) const HEADER_BYTES: usize = 4096;
pub(super) const MAGIC: u64 = u64::from_le_bytes(*b"CIERASHM");
pub(super) const VERSION: u32 = 2;
pub(super) const MAGIC_OFF: usize = 0;
pub(super) const VERSION_OFF: usize = 8;
pub(super) const RING_BYTES_OFF: usize = 16;
pub(super) const CREATOR_PID_OFF: usize = 24;

pub(super) const fn head_off(ring: usize) -> usize {
    64 + 128 * ring
}
pub(super) const fn tail_off(ring: usize) -> usize {
    128 + 128 * ring
}
pub(super) const fn closed_off(side: usize) -> usize {
    320 + 64 * side
}
pub(super) const fn claimed_off(ring: usize) -> usize {
    448 + 64 * ring
}
pub(super) const fn withdrawn_off(side: usize) -> usize {
    576 + 64 * side
}
pub(super) const fn probe_off(side: usize) -> usize {
    704 + 64 * side
}
pub(super) const fn reads_ok_off(side: usize) -> usize {
    832 + 64 * side
}

/// The u64 whose address and value a process publishes as its single-copy probe (see the
/// module documentation). A static, so its address is fixed for the life of the process.
static PROBE_WORD: AtomicU64 = AtomicU64::new(0);

fn probe_value() -> u64 {
    let v = PROBE_WORD.load(Ordering::Relaxed);
    if v != 0 {
        return v;
    }
    let mut raw = [0u8; 8];
    let _ = fill_random(&mut raw);
    let fresh = u64::from_le_bytes(raw) | 1; // never 0: 0 means "no probe"
    match PROBE_WORD.compare_exchange(0, fresh, Ordering::Relaxed, Ordering::Relaxed) {
        Ok(_) => fresh,
        Err(existing) => existing,
    }
}

/// Publishes this process's probe in `seg` for side `side` (nothing unless `enabled`).
pub(crate) fn publish_probe(seg: &ShmMapping, side: usize, enabled: bool) {
    if !enabled {
        return;
    }
    let value = probe_value();
    seg.atomic_u64(probe_off(side) + 8)
        .store(value, Ordering::Relaxed);
    seg.atomic_u64(probe_off(side))
        .store(PROBE_WORD.as_ptr() as usize as u64, Ordering::Release);
}

/// Side `side` tries to read its peer's probe out of process `peer_pid`; on a match it sets
/// `reads_ok[side]`, which tells the peer it may offer by reference. A failure only means the
/// link copies through the ring. Does nothing unless `enabled`.
pub(crate) fn probe_peer(seg: &ShmMapping, side: usize, peer_pid: u32, enabled: bool) -> bool {
    if !enabled {
        return false;
    }
    let addr = seg.atomic_u64(probe_off(1 - side)).load(Ordering::Acquire);
    let want = seg
        .atomic_u64(probe_off(1 - side) + 8)
        .load(Ordering::Relaxed);
    if addr == 0 {
        return false;
    }
    let mut got = [0u8; 8];
    let ok = matches!(process_vm_read(peer_pid, addr, &mut got), Ok(8))
        && u64::from_le_bytes(got) == want;
    if ok {
        seg.atomic_u32(reads_ok_off(side))
            .store(1, Ordering::Release);
    }
    ok
}

/// Total segment size for rings of `ring_bytes`.
fn segment_len(ring_bytes: usize) -> usize {
    HEADER_BYTES + 2 * ring_bytes
}

/// Creates and initializes a segment (both rings empty). The peer opens it through this
/// process's descriptor; the caller stops sharing it once the peer has mapped it (or failed).
pub(crate) fn create_segment(name: &str, ring_bytes: usize) -> Result<ShmMapping> {
    check_ring_bytes(ring_bytes).map_err(|why| TransportError::Config {
        detail: format!("shm ring of {ring_bytes} bytes: {why}"),
    })?;
    let seg = ShmMapping::create(name, segment_len(ring_bytes))?;
    seg.atomic_u64(RING_BYTES_OFF)
        .store(ring_bytes as u64, Ordering::Relaxed);
    seg.atomic_u32(CREATOR_PID_OFF)
        .store(std::process::id(), Ordering::Relaxed);
    seg.atomic_u32(VERSION_OFF)
        .store(VERSION, Ordering::Relaxed);
    seg.atomic_u64(MAGIC_OFF).store(MAGIC, Ordering::Release);
    Ok(seg)
}

/// Maps the segment `name` that process `pid` shares as descriptor `fd` and checks its
/// header. Returns the ring size.
pub(crate) fn open_segment(pid: u32, fd: u32, name: &str) -> Result<(ShmMapping, usize)> {
    let most = segment_len(MAX_SHM_RING_BYTES);
    let seg = ShmMapping::open_peer(pid, fd, name, HEADER_BYTES, most)?;
    let magic = seg.atomic_u64(MAGIC_OFF).load(Ordering::Acquire);
    let version = seg.atomic_u32(VERSION_OFF).load(Ordering::Relaxed);
    if magic != MAGIC || version != VERSION {
        return Err(TransportError::Protocol {
            detail: format!("shm segment {name}: magic {magic:#x} version {version} (expected {MAGIC:#x} v{VERSION})"),
        });
    }
    let ring_bytes = seg.atomic_u64(RING_BYTES_OFF).load(Ordering::Relaxed) as usize;
    if check_ring_bytes(ring_bytes).is_err() || seg.len() != segment_len(ring_bytes) {
        return Err(TransportError::Protocol {
            detail: format!(
                "shm segment {name}: {} bytes cannot hold two rings of {ring_bytes} bytes",
                seg.len()
            ),
        });
    }
    Ok((seg, ring_bytes))
}
