//! Shared host buffers: memory that ranks on this host read straight out of each other, with
//! no kernel copy (the shm analogue of NCCL's `ncclMemAlloc` + buffer registration).
//!
//! A [`SharedBuffer`] is an anonymous memory file (`memfd_create`, named
//! `ciera-<pid>-<id>`) mapped shared into its process and entered in a process-wide registry.
//! When a collective offers a segment by reference (single copy, see `shm/`) whose bytes lie
//! in such a buffer, the offer also names the buffer (id, base address, descriptor number:
//! [`SharedRegion`]). The receiving rank opens `/proc/<pid>/fd/<fd>` of the sender once, checks
//! that what it opened is that very buffer (the memfd's name carries pid and id, so a
//! descriptor number reused after a free is caught), maps it read-only and keeps the mapping
//! ([`PeerMaps`]); from then on it copies with a plain `memcpy` from its mapping instead of
//! `process_vm_readv`, which pins every page in the kernel on every call (ARCHITECTURE.md,
//! "Shared buffers", has the comparison).
//!
//! Nothing changes in the protocol around it: the sender keeps its bytes unchanged until
//! they are claimed, withdraws on failure, and the receiver checks the withdrawal flag after
//! its copy exactly as after a `process_vm_readv`. If the buffer cannot be opened (another
//! user, no /proc, a freed buffer) the receiver falls back to `process_vm_readv` at the same
//! address, which is valid in either case; a region it failed to open is not tried again.
//!
//! Lifetime: memory files have no name in /dev/shm, so nothing leaks when a rank is killed.
//! A freed buffer's pages live on while a peer still maps them: so whenever a receiver maps a
//! new buffer it first drops its mappings of buffers the sender has freed (their descriptor
//! no longer names them), and it keeps at most [`MAX_PEER_MAPS`] per link (least recently
//! used out).

use std::ffi::CString;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::{Result, TransportError};

/// A buffer in a registered region, as named in an offer: the sender's buffer id, the
/// address its mapping starts at in the sender, and the sender's descriptor for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedRegion {
    pub id: u64,
    pub base: u64,
    pub fd: u32,
}

struct Entry {
    base: u64,
    len: u64,
    region: SharedRegion,
}

/// Every live [`SharedBuffer`] of this process, by base address.
static REGISTRY: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn registry() -> std::sync::MutexGuard<'static, Vec<Entry>> {
    // A panic while holding the lock cannot leave the Vec inconsistent (push/remove only).
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

/// The shared buffer of this process that holds all of `[addr, addr + len)`, if any.
pub fn shared_region_of(addr: u64, len: usize) -> Option<SharedRegion> {
    let end = addr.checked_add(len as u64)?;
    registry()
        .iter()
        .find(|e| addr >= e.base && end <= e.base + e.len)
        .map(|e| e.region)
}

/// The live shared buffer that holds all of `[addr, addr + len)`: its id, first byte and
/// mapped length. For registering the whole buffer once (RDMA links).
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) fn shared_extent_of(addr: u64, len: usize) -> Option<(u64, u64, u64)> {
    let end = addr.checked_add(len as u64)?;
    registry()
        .iter()
        .find(|e| addr >= e.base && end <= e.base + e.len)
        .map(|e| (e.region.id, e.base, e.len))
}

/// Whether the shared buffer `id` of this process is still allocated.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) fn shared_buffer_live(id: u64) -> bool {
    registry().iter().any(|e| e.region.id == id)
}

fn memfd_name(pid: u32, id: u64) -> String {
    format!("ciera-{pid}-{id}")
}

/// Host memory that peers on this host can map: allocate the buffers you pass to collectives
/// with it and shm single copy reads them with a plain memory copy. Zeroed on creation,
/// unmapped when dropped. Behaves as a `[u8]` (Deref).
pub struct SharedBuffer {
    ptr: NonNull<u8>,
    /// Bytes the caller asked for (the mapping is at least one page).
    len: usize,
    map_len: usize,
    _fd: OwnedFd,
    id: u64,
}

// SAFETY: the buffer is exclusively owned memory, like a Vec<u8>: `&SharedBuffer` hands out
// only `&[u8]`, `&mut` only `&mut [u8]`. Peers read it only while a collective holds a borrow
// of it (see the module documentation).
unsafe impl Send for SharedBuffer {}
// SAFETY: see Send.
unsafe impl Sync for SharedBuffer {}

impl SharedBuffer {
    /// A zeroed buffer of `len` bytes (`len` may be 0).
    pub fn new(len: usize) -> Result<SharedBuffer> {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let name = memfd_name(std::process::id(), id);
        let what = || format!("shared buffer {name} of {len} bytes");
        let cname = CString::new(name.clone()).expect("no NUL in a formatted name");
        // SAFETY: valid C string; the result is checked.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(TransportError::last_os("memfd_create", what()));
        }
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let page = 4096;
        let map_len = len.max(1).div_ceil(page) * page;
        // SAFETY: valid fd; only sets the file's size.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), map_len as libc::off_t) } != 0 {
            return Err(TransportError::last_os("ftruncate", what()));
        }
        // Reserve the pages now, so running out of memory is this error and not a SIGBUS.
        // SAFETY: valid fd, range within the size just set.
        let rc = unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, map_len as libc::off_t) };
        if rc != 0 && rc != libc::EOPNOTSUPP && rc != libc::EINVAL {
            return Err(TransportError::io(
                "posix_fallocate",
                what(),
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        // SAFETY: maps the file we just sized; the kernel picks the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(TransportError::last_os("mmap", what()));
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).expect("mmap never returns null on success");
        registry().push(Entry {
            base: ptr.as_ptr() as u64,
            len: map_len as u64,
            region: SharedRegion {
                id,
                base: ptr.as_ptr() as u64,
                fd: fd.as_raw_fd() as u32,
            },
        });
        Ok(SharedBuffer {
            ptr,
            len,
            map_len,
            _fd: fd,
            id,
        })
    }

    /// This buffer's id (unique in this process).
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Deref for SharedBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` maps at least `len` bytes for the life of `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for SharedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and `&mut self` makes the borrow exclusive in this process.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBuffer {{ id: {}, len: {} }}", self.id, self.len)
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        registry().retain(|e| e.region.id != self.id);
        // SAFETY: our own mapping; no borrow of it outlives `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.map_len) };
    }
}

/// Most peer buffers one link keeps mapped.
pub const MAX_PEER_MAPS: usize = 64;

struct PeerMap {
    id: u64,
    /// The sender's descriptor for it.
    fd: u32,
    /// The sender's address of the buffer's first byte.
    base: u64,
    ptr: NonNull<u8>,
    len: usize,
    last_use: u64,
}

impl Drop for PeerMap {
    fn drop(&mut self) {
        // SAFETY: a read-only mapping made by `PeerMaps::open`, used by nobody after this.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A receiver's mappings of one peer's shared buffers.
#[derive(Default)]
pub(crate) struct PeerMaps {
    maps: Vec<PeerMap>,
    /// Buffers that could not be opened (read those with process_vm_readv).
    failed: Vec<u64>,
    uses: u64,
    /// Bytes copied through mappings.
    pub copied: u64,
}

// SAFETY: the mappings are read-only views owned by this value; moving it moves ownership.
unsafe impl Send for PeerMaps {}

impl PeerMaps {
    /// Where `[remote, remote + n)` of the peer's memory is in ours, if it lies in the peer's
    /// shared buffer `region` and that could be mapped. `Err` only for a region whose bounds
    /// contradict the offer (a corrupt stream).
    pub fn resolve(
        &mut self,
        pid: u32,
        region: SharedRegion,
        remote: u64,
        n: usize,
    ) -> Result<Option<*const u8>> {
        if self.failed.contains(&region.id) {
            return Ok(None);
        }
        self.uses += 1;
        let i = match self.maps.iter().position(|m| m.id == region.id) {
            Some(i) => i,
            None => match open_peer(pid, region) {
                Some(map) => {
                    // Buffers the peer has freed since: their pages go when we unmap them.
                    self.maps.retain(|m| names_buffer(pid, m.fd, m.id));
                    if self.maps.len() >= MAX_PEER_MAPS {
                        let lru = (0..self.maps.len())
                            .min_by_key(|&i| self.maps[i].last_use)
                            .expect("full, so not empty");
                        self.maps.swap_remove(lru);
                    }
                    self.maps.push(map);
                    self.maps.len() - 1
                }
                None => {
                    self.failed.push(region.id);
                    return Ok(None);
                }
            },
        };
        let m = &mut self.maps[i];
        m.last_use = self.uses;
        let off = remote.wrapping_sub(m.base);
        if m.base != region.base || remote < m.base || off + n as u64 > m.len as u64 {
            return Err(TransportError::Protocol {
                detail: format!(
                    "an offer of {n} bytes at {remote:#x} names shared buffer {} at {:#x} \
                     ({} bytes, mapped at {:#x} when first seen)",
                    region.id, region.base, m.len, m.base
                ),
            });
        }
        // SAFETY: off + n <= m.len, checked above.
        Ok(Some(unsafe { m.ptr.as_ptr().add(off as usize) }))
    }
}

/// Whether the /proc descriptor link `link` names process `pid`'s shared buffer `id` (a memfd
/// shows as "/memfd:NAME (deleted)").
fn links_to_buffer(link: &str, pid: u32, id: u64) -> bool {
    std::fs::read_link(link).is_ok_and(|l| {
        l.to_str() == Some(format!("/memfd:{} (deleted)", memfd_name(pid, id)).as_str())
    })
}

/// Whether descriptor `fd` of process `pid` is (still) its shared buffer `id`.
fn names_buffer(pid: u32, fd: u32, id: u64) -> bool {
    links_to_buffer(&format!("/proc/{pid}/fd/{fd}"), pid, id)
}

/// Opens and maps peer `pid`'s buffer `region`, or None if that is not possible (or what the
/// descriptor names now is not that buffer).
fn open_peer(pid: u32, region: SharedRegion) -> Option<PeerMap> {
    let path = CString::new(format!("/proc/{pid}/fd/{}", region.fd)).ok()?;
    // SAFETY: valid C string; the result is checked.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    if !links_to_buffer(&format!("/proc/self/fd/{}", fd.as_raw_fd()), pid, region.id) {
        return None;
    }
    // SAFETY: zeroed stat is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and out-pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 || st.st_size <= 0 {
        return None;
    }
    let len = st.st_size as usize;
    // SAFETY: maps the file read-only at an address the kernel picks; MAP_POPULATE so that
    // the first copy does not take a fault per page.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            fd.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return None;
    }
    Some(PeerMap {
        id: region.id,
        fd: region.fd,
        base: region.base,
        ptr: NonNull::new(ptr.cast())?,
        len,
        last_use: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_registered_zeroed_and_unregistered_on_drop() {
        let mut a = SharedBuffer::new(10_000).unwrap();
        assert_eq!(a.len(), 10_000);
        assert!(a.iter().all(|&b| b == 0));
        a[9_999] = 7;
        let base = a.as_ptr() as u64;
        let r = shared_region_of(base + 100, 9_900).expect("inside");
        assert_eq!((r.id, r.base), (a.id(), base));
        // Up to the end of the mapping (3 pages) is inside, beyond is not.
        assert!(shared_region_of(base, 3 * 4096).is_some());
        assert!(shared_region_of(base, 3 * 4096 + 1).is_none());
        assert!(shared_region_of(base - 1, 2).is_none());
        let empty = SharedBuffer::new(0).unwrap();
        assert_eq!(empty.len(), 0);
        let id = a.id();
        drop(a);
        assert!(shared_region_of(base + 100, 1).map(|r| r.id) != Some(id));
    }

    #[test]
    fn a_peer_map_reads_the_buffer_and_refuses_impostors() {
        // This process plays both sides: it opens its own buffer through /proc.
        let mut buf = SharedBuffer::new(3 * 4096 + 5).unwrap();
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i * 31 % 251) as u8;
        }
        let pid = std::process::id();
        let base = buf.as_ptr() as u64;
        let region = shared_region_of(base, buf.len()).unwrap();
        let mut maps = PeerMaps::default();
        let p = maps
            .resolve(pid, region, base + 4000, 500)
            .unwrap()
            .expect("mapped");
        // SAFETY: resolve returned a pointer to 500 readable bytes.
        let got = unsafe { std::slice::from_raw_parts(p, 500) };
        assert_eq!(got, &buf[4000..4500]);
        // A later write shows through the same mapping (it is shared, not a snapshot).
        buf[4000] = 0xEE;
        let p = maps.resolve(pid, region, base + 4000, 1).unwrap().unwrap();
        // SAFETY: one readable byte.
        assert_eq!(unsafe { *p }, 0xEE);
        // Beyond the buffer: a protocol error, not a read out of bounds.
        assert!(maps.resolve(pid, region, base + 4 * 4096, 1).is_err());
        // Another id on the same descriptor (a reused fd number): refused, remembered.
        let wrong = SharedRegion {
            id: region.id + 1000,
            ..region
        };
        assert!(maps.resolve(pid, wrong, base, 1).unwrap().is_none());
        assert!(maps.failed.contains(&wrong.id));
        // A descriptor that is not a shared buffer at all (stdin or nothing): refused.
        let none = SharedRegion {
            id: 99_999,
            base,
            fd: 0,
        };
        assert!(maps.resolve(pid, none, base, 1).unwrap().is_none());
    }

    #[test]
    fn peer_maps_keep_at_most_max_peer_maps() {
        let bufs: Vec<SharedBuffer> = (0..MAX_PEER_MAPS + 3)
            .map(|_| SharedBuffer::new(64).unwrap())
            .collect();
        let mut maps = PeerMaps::default();
        for b in &bufs {
            let base = b.as_ptr() as u64;
            let r = shared_region_of(base, 64).unwrap();
            assert!(maps
                .resolve(std::process::id(), r, base, 64)
                .unwrap()
                .is_some());
        }
        assert_eq!(maps.maps.len(), MAX_PEER_MAPS);
        // The first ones (least recently used) went.
        assert!(maps.maps.iter().all(|m| m.id != bufs[0].id()));
    }

    #[test]
    fn mappings_of_freed_buffers_go_when_a_new_buffer_is_mapped() {
        let pid = std::process::id();
        let mut maps = PeerMaps::default();
        let map = |maps: &mut PeerMaps, b: &SharedBuffer| {
            let base = b.as_ptr() as u64;
            let r = shared_region_of(base, b.len()).unwrap();
            assert!(maps.resolve(pid, r, base, b.len()).unwrap().is_some());
        };
        let a = SharedBuffer::new(4096).unwrap();
        let kept = SharedBuffer::new(4096).unwrap();
        map(&mut maps, &a);
        map(&mut maps, &kept);
        let a_id = a.id();
        drop(a); // the "sender" frees it
        let b = SharedBuffer::new(4096).unwrap();
        map(&mut maps, &b);
        let ids: Vec<u64> = maps.maps.iter().map(|m| m.id).collect();
        assert!(!ids.contains(&a_id), "{ids:?}");
        assert!(ids.contains(&kept.id()) && ids.contains(&b.id()), "{ids:?}");
    }
}
