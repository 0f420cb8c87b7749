//! Thin, checked wrappers over the system calls the transports need: futex, shared memory
//! (memory files shared through /proc), poll, eventfd and socket options. All `unsafe` of the
//! shm path lives here and in `shm/`/`doorbell.rs`.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::Mutex;
use std::time::Duration;

use crate::{Result, TransportError};

fn timespec(d: Duration) -> libc::timespec {
    libc::timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64 / 2) as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    }
}

/// Sleeps while `*word == expected`, at most `timeout`. Returns early on a wake, a signal, or
/// immediately if the word already differs. Not private: the word may be in shared memory.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = timespec(timeout);
    // SAFETY: `word` is a live, aligned u32 for the duration of the call; FUTEX_WAIT only reads
    // it and `ts` outlives the call. Errors (EAGAIN: value changed, EINTR, ETIMEDOUT) all mean
    // "return to the caller", which re-checks its condition.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every thread sleeping in [`futex_wait`] on `word`.
pub(crate) fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a live, aligned u32; FUTEX_WAKE does not access memory beyond looking
    // up waiters keyed by its address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            0usize,
            0usize,
            0u32,
        );
    }
}

/// A mapping of shared memory that has no name anywhere: an anonymous memory file
/// (`memfd_create`) in its creator, which peers on this host open through
/// `/proc/<creator pid>/fd/<fd>` while the creator still shares it. Nothing can be left
/// behind in /dev/shm, whenever and however either process dies. Unmapped on drop.
pub(crate) struct ShmMapping {
    ptr: NonNull<u8>,
    len: usize,
    /// The memory file's name (`ciera-<creator pid>-...`), for messages and for checking that
    /// what a peer opened is this object.
    name: String,
    /// The creator's descriptor, kept until [`ShmMapping::stop_sharing`] (peers open it).
    shared_fd: Mutex<Option<OwnedFd>>,
}

// SAFETY: the mapping is plain shared memory; every access through it goes through atomics or
// through the SPSC ring discipline documented in shm/mod.rs, so moving or sharing the handle
// between threads is no different from moving a pointer to a static buffer.
unsafe impl Send for ShmMapping {}
// SAFETY: see Send; `&ShmMapping` only hands out atomics and raw pointers.
unsafe impl Sync for ShmMapping {}

/// What `/proc/<pid>/fd/<n>` shows for the memory file `name`.
fn memfd_link(name: &str) -> String {
    format!("/memfd:{name} (deleted)")
}

impl ShmMapping {
    /// Creates a memory file called `name` (only shown in `/proc/<pid>/fd` links), sizes it to
    /// `len` bytes, reserves the memory (so running out is an error now rather than SIGBUS
    /// later) and maps it. Peers can open it until [`ShmMapping::stop_sharing`].
    pub fn create(name: &str, len: usize) -> Result<ShmMapping> {
        let cname = CString::new(name).map_err(|_| TransportError::Protocol {
            detail: format!("shared memory name {name:?} contains a NUL byte"),
        })?;
        // SAFETY: `cname` is a valid NUL-terminated string; the returned fd is checked.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(TransportError::last_os(
                "memfd_create",
                format!("shared memory {name}"),
            ));
        }
        // SAFETY: `fd` is a fresh descriptor we own exclusively.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: valid fd; ftruncate only changes the object's size.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(TransportError::last_os(
                "ftruncate",
                format!("shared memory {name} to {len} bytes"),
            ));
        }
        // SAFETY: valid fd, range within the size just set.
        let rc = unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, len as libc::off_t) };
        if rc != 0 && rc != libc::EOPNOTSUPP && rc != libc::EINVAL {
            return Err(TransportError::io(
                "posix_fallocate",
                format!(
                    "shared memory {name} of {len} bytes (out of memory? lower \
                     CIERA_SHM_RING_BYTES or use CIERA_TRANSPORT=tcp)"
                ),
                io::Error::from_raw_os_error(rc),
            ));
        }
        let ptr = Self::map(&fd, len, name)?;
        Ok(ShmMapping {
            ptr,
            len,
            name: name.to_string(),
            shared_fd: Mutex::new(Some(fd)),
        })
    }

    /// Opens and maps the memory file `name` that process `pid` shares as its descriptor
    /// `fd`; its size must lie in `min_len..=max_len`. Fails if what that descriptor names now
    /// is not that file (the creator closed it, or the number was reused).
    pub fn open_peer(
        pid: u32,
        fd: u32,
        name: &str,
        min_len: usize,
        max_len: usize,
    ) -> Result<ShmMapping> {
        let path = format!("/proc/{pid}/fd/{fd}");
        let cpath = CString::new(path.as_str()).expect("no NUL in a formatted path");
        // SAFETY: valid C string; the fd is checked.
        let raw = unsafe { libc::open(cpath.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if raw < 0 {
            return Err(TransportError::last_os(
                "open",
                format!(
                    "{path}, shared memory {name} of process {pid} (ranks that share memory \
                     must run as the same user in the same pid namespace and be dumpable; \
                     else CIERA_TRANSPORT=tcp)"
                ),
            ));
        }
        // SAFETY: fresh descriptor we own.
        let own = unsafe { OwnedFd::from_raw_fd(raw) };
        let opened = std::fs::read_link(format!("/proc/self/fd/{}", own.as_raw_fd()))
            .map(|l| l.to_string_lossy().into_owned())
            .unwrap_or_default();
        if opened != memfd_link(name) {
            return Err(TransportError::Protocol {
                detail: format!(
                    "{path} is {opened:?}, not shared memory {name} (process {pid} closed it?)"
                ),
            });
        }
        // SAFETY: zeroed stat is a valid out-parameter for fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: valid fd and out-pointer.
        if unsafe { libc::fstat(own.as_raw_fd(), &mut st) } != 0 {
            return Err(TransportError::last_os(
                "fstat",
                format!("shared memory {name}"),
            ));
        }
        let len = st.st_size.max(0) as usize;
        if len < min_len || len > max_len {
            return Err(TransportError::Protocol {
                detail: format!(
                    "shared memory {name} of process {pid} is {len} bytes, expected \
                     {min_len}..={max_len}"
                ),
            });
        }
        let ptr = Self::map(&own, len, name)?;
        Ok(ShmMapping {
            ptr,
            len,
            name: name.to_string(),
            shared_fd: Mutex::new(None),
        })
    }

    fn map(fd: &OwnedFd, len: usize, name: &str) -> Result<NonNull<u8>> {
        // SAFETY: mapping a shared object we hold an fd to; the kernel picks the address, so no
        // existing memory is affected. MAP_POPULATE pre-faults the pages (one-time cost at setup).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(TransportError::last_os(
                "mmap",
                format!("shared memory {name} of {len} bytes"),
            ));
        }
        Ok(NonNull::new(ptr.cast()).expect("mmap never returns null on success"))
    }

    /// The descriptor peers open, while this process shares the memory.
    pub fn shared_fd(&self) -> Option<u32> {
        self.shared_fd
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|fd| fd.as_raw_fd() as u32)
    }

    /// Closes the descriptor peers open (the mapping stays valid): once every peer that will
    /// map this memory has done so. Idempotent.
    pub fn stop_sharing(&self) {
        self.shared_fd
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The `AtomicU32` at byte `offset`.
    pub fn atomic_u32(&self, offset: usize) -> &AtomicU32 {
        assert!(
            offset.is_multiple_of(4) && offset + 4 <= self.len,
            "atomic_u32 at {offset} in {} bytes",
            self.len
        );
        // SAFETY: in bounds and 4-aligned (the mapping is page-aligned); the memory lives as
        // long as `self`, and AtomicU32 has the layout of u32 and tolerates concurrent access.
        unsafe { &*(self.ptr.as_ptr().add(offset) as *const AtomicU32) }
    }

    /// The `AtomicU64` at byte `offset`.
    pub fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        assert!(
            offset.is_multiple_of(8) && offset + 8 <= self.len,
            "atomic_u64 at {offset} in {} bytes",
            self.len
        );
        // SAFETY: as for atomic_u32, with 8-byte alignment.
        unsafe { &*(self.ptr.as_ptr().add(offset) as *const AtomicU64) }
    }
}

impl Drop for ShmMapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe a mapping we created and nobody uses after drop (all
        // references handed out borrow `self`).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// An eventfd used to interrupt `poll` from another thread.
pub(crate) struct EventFd(OwnedFd);

impl EventFd {
    pub fn new() -> Result<EventFd> {
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(TransportError::last_os("eventfd", "endpoint waker"));
        }
        // SAFETY: fresh descriptor we own.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd; EAGAIN (counter saturated)
        // still leaves it readable, which is all we need.
        unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    pub fn drain(&self) {
        let mut value: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64; non-blocking, EAGAIN is fine.
        unsafe { libc::read(self.0.as_raw_fd(), (&mut value as *mut u64).cast(), 8) };
    }

    pub fn raw(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// `ppoll` with microsecond resolution, retrying on EINTR only if no time is left to lose.
/// Returns the number of ready descriptors (0 on timeout or signal).
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout: Duration) -> Result<usize> {
    let ts = timespec(timeout);
    // SAFETY: `fds` is a valid, exclusively borrowed array of pollfd of the given length; `ts`
    // outlives the call; no signal mask is passed.
    let rc = unsafe {
        libc::ppoll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            &ts,
            std::ptr::null(),
        )
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(TransportError::io(
            "poll",
            format!("{} sockets", fds.len()),
            e,
        ));
    }
    Ok(rc as usize)
}

/// Sets an integer socket option; `what` names the socket for the error.
pub(crate) fn set_sockopt(
    fd: RawFd,
    level: i32,
    name: i32,
    value: i32,
    op: &'static str,
    what: &str,
) -> Result<()> {
    // SAFETY: passes a pointer to a live c_int and its size; the kernel copies it.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(TransportError::last_os(
            op,
            format!("{what} (value {value})"),
        ));
    }
    Ok(())
}

/// A socket's TCP congestion control algorithm (TCP_CONGESTION), if the kernel says.
pub(crate) fn tcp_congestion(fd: RawFd) -> Option<String> {
    let mut buf = [0u8; 16];
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: `buf` and `len` are live and describe a 16-byte buffer the kernel fills.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return None;
    }
    let b = &buf[..(len as usize).min(buf.len())];
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    Some(String::from_utf8_lossy(&b[..end]).into_owned())
}

/// Sets a socket's TCP congestion control algorithm.
pub(crate) fn set_tcp_congestion(fd: RawFd, name: &str) -> io::Result<()> {
    // SAFETY: passes a pointer to `name`'s bytes and their length; the kernel copies them.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            name.as_ptr().cast(),
            name.len() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether a process with this pid exists (in our pid namespace).
pub(crate) fn pid_alive(pid: u32) -> bool {
    if pid == 0 || pid > i32::MAX as u32 {
        return false;
    }
    // SAFETY: signal 0 performs only the existence/permission check.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Fills `buf` from the kernel's CSPRNG (getrandom(2), blocking only until it is seeded at boot).
pub(crate) fn fill_random(buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: writes at most `buf.len() - done` bytes into the exclusively borrowed tail
        // of `buf`.
        let rc = unsafe { libc::getrandom(buf[done..].as_mut_ptr().cast(), buf.len() - done, 0) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += rc as usize;
    }
    Ok(())
}

/// A random lowercase hex string of `bytes` random bytes (for shared memory names).
pub(crate) fn random_hex(bytes: usize) -> String {
    let mut raw = vec![0u8; bytes];
    if fill_random(&mut raw).is_err() {
        // Names only need to be unlikely to collide; fall back to time and address entropy.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let mix = t.as_nanos() as u64 ^ (&raw as *const _ as u64).rotate_left(17);
        for (i, b) in raw.iter_mut().enumerate() {
            *b = (mix >> ((i % 8) * 8)) as u8;
        }
    }
    raw.iter().map(|b| format!("{b:02x}")).collect()
}

/// Copies up to `dst.len()` bytes at address `remote` of process `pid` into `dst`
/// (process_vm_readv(2), "cross-memory attach": one copy, done by the kernel). Returns the bytes
/// copied, which may be fewer than asked only if the remote range crosses into unmapped
/// memory. Needs the same permission as ptrace attach (same user, not made undumpable).
pub(crate) fn process_vm_read(pid: u32, remote: u64, dst: &mut [u8]) -> io::Result<usize> {
    if dst.is_empty() {
        return Ok(0);
    }
    let local = libc::iovec {
        iov_base: dst.as_mut_ptr().cast(),
        iov_len: dst.len(),
    };
    let remote = libc::iovec {
        iov_base: remote as usize as *mut libc::c_void,
        iov_len: dst.len(),
    };
    loop {
        // SAFETY: `local` describes `dst`, exclusively borrowed and valid for `dst.len()`
        // bytes, which is all the kernel writes. `remote` names memory of *another* process,
        // which the kernel validates (EFAULT if unmapped); nothing in this process is read
        // through it. Both iovec arrays live on this stack frame for the call.
        let rc = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
        if rc >= 0 {
            return Ok(rc as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
