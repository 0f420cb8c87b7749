//! The verbs RDMA links use, as `Result`s and owning types (the middle and top of the three
//! layers STYLE.md asks of a foreign API; the raw bindings are `ibverbs-sys`).
//!
//! Every error names the verb that failed and what it was for (the peer rank, via `who`).
//! Queue pairs and memory registrations are counted ([`live_resources`]) so that tests can
//! check that teardown released every one of them.

use std::ffi::CStr;
use std::io;
use std::os::raw::{c_int, c_void};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicUsize, Ordering};

use ibverbs_sys as ffi;

use crate::{Result, TransportError};

/// The port every link uses (rdma-core numbers ports from 1; one-port devices are the rule).
pub(crate) const PORT: u8 = 1;

static LIVE_QPS: AtomicUsize = AtomicUsize::new(0);
static LIVE_MRS: AtomicUsize = AtomicUsize::new(0);

/// Queue pairs and memory registrations this process holds right now (all RDMA links
/// together). Both are 0 once every endpoint with RDMA links has been dropped.
pub fn live_resources() -> (usize, usize) {
    (
        LIVE_QPS.load(Ordering::SeqCst),
        LIVE_MRS.load(Ordering::SeqCst),
    )
}

fn verb_error(verb: &'static str, who: &str, source: io::Error) -> TransportError {
    TransportError::io(verb, who, source)
}

/// A verb that returns an errno (0 on success).
fn check(verb: &'static str, who: &str, rc: c_int) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        // Some providers return -errno, some set errno and return -1.
        let errno = if rc > 0 {
            rc
        } else if rc == -1 {
            io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO)
        } else {
            -rc
        };
        Err(verb_error(verb, who, io::Error::from_raw_os_error(errno)))
    }
}

/// A verb that returns a pointer (NULL with errno on failure).
fn non_null<T>(verb: &'static str, who: &str, p: *mut T) -> Result<NonNull<T>> {
    NonNull::new(p).ok_or_else(|| verb_error(verb, who, io::Error::last_os_error()))
}

/// Names of the RDMA devices on this host. `Err` where the host has none (libibverbs answers
/// ENOSYS when the kernel has no RDMA support at all, rather than an empty list).
pub(crate) fn device_names() -> io::Result<Vec<String>> {
    let list = ibverbs::devices()?;
    Ok(list
        .iter()
        .filter_map(|d| Some(d.name()?.to_string_lossy().into_owned()))
        .collect())
}

/// An open device context (`ibv_open_device`), closed on drop.
pub(crate) struct Context {
    ctx: NonNull<ffi::ibv_context>,
    pub name: String,
}

// SAFETY: verbs objects may be used from any thread (rdma-core locks internally where needed);
// a link, and so its context, is used by one thread at a time.
unsafe impl Send for Context {}

impl Context {
    /// Opens `wanted` (or, if `None`, the first device with an active port [`PORT`]).
    pub fn open(wanted: Option<&str>, who: &str) -> Result<Context> {
        let mut n: c_int = 0;
        // SAFETY: ibv_get_device_list writes the count through a valid pointer and returns an
        // array we free below with ibv_free_device_list.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(verb_error(
                "ibv_get_device_list",
                who,
                io::Error::last_os_error(),
            ));
        }
        let mut names = Vec::new();
        let mut chosen = None;
        for i in 0..n.max(0) as usize {
            // SAFETY: the array has `n` valid device pointers.
            let dev = unsafe { *list.add(i) };
            // SAFETY: dev is a valid device; the name is a C string owned by the list.
            let name_ptr = unsafe { ffi::ibv_get_device_name(dev) };
            if name_ptr.is_null() {
                continue;
            }
            // SAFETY: non-null NUL-terminated string that lives as long as the list.
            let name = unsafe { CStr::from_ptr(name_ptr) }
                .to_string_lossy()
                .into_owned();
            names.push(name.clone());
            if wanted.is_some_and(|w| w != name) {
                continue;
            }
            // SAFETY: dev is valid while the list is; the context outlives it (rdma-core
            // keeps the device alive for open contexts).
            let ctx = unsafe { ffi::ibv_open_device(dev) };
            let Some(ctx) = NonNull::new(ctx) else {
                continue;
            };
            let context = Context { ctx, name };
            if wanted.is_some() || context.port_active() {
                chosen = Some(context);
                break;
            }
        }
        // SAFETY: list came from ibv_get_device_list and is freed once.
        unsafe { ffi::ibv_free_device_list(list) };
        chosen.ok_or_else(|| TransportError::Unsupported {
            detail: match wanted {
                Some(w) => format!(
                    "{who}: RDMA device {w:?} ({}) not found or cannot be opened; devices here: {names:?}",
                    crate::config::ENV_IB_HCA
                ),
                None => format!(
                    "{who}: no RDMA device with an active port {PORT}; devices here: {names:?}"
                ),
            },
        })
    }

    pub fn raw(&self) -> *mut ffi::ibv_context {
        self.ctx.as_ptr()
    }

    pub fn query_port(&self, who: &str) -> Result<ffi::ibv_port_attr> {
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: the context is open; the exported ibv_query_port fills a prefix of
        // ibv_port_attr (its compat layout), which `attr` has room for.
        let rc = unsafe {
            ffi::ibv_query_port(
                self.raw(),
                PORT,
                (&mut attr as *mut ffi::ibv_port_attr).cast(),
            )
        };
        check("ibv_query_port", who, rc)?;
        Ok(attr)
    }

    fn port_active(&self) -> bool {
        self.query_port("")
            .is_ok_and(|a| a.state == ffi::ibv_port_state::IBV_PORT_ACTIVE)
    }

    pub fn query_gid(&self, index: i32, who: &str) -> Result<[u8; 16]> {
        let mut gid = ffi::ibv_gid::default();
        // SAFETY: open context, valid out pointer.
        let rc = unsafe { ffi::ibv_query_gid(self.raw(), PORT, index, &mut gid) };
        check("ibv_query_gid", who, rc)?;
        // SAFETY: every bit pattern of the union is a valid byte array.
        Ok(unsafe { gid.raw })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device; everything made from it was dropped first (the
        // link's field order).
        unsafe { ffi::ibv_close_device(self.raw()) };
    }
}

/// A protection domain.
pub(crate) struct Pd(NonNull<ffi::ibv_pd>);
// SAFETY: as for Context.
unsafe impl Send for Pd {}

impl Pd {
    pub fn new(ctx: &Context, who: &str) -> Result<Pd> {
        // SAFETY: open context.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.raw()) };
        non_null("ibv_alloc_pd", who, pd).map(Pd)
    }
    pub fn raw(&self) -> *mut ffi::ibv_pd {
        self.0.as_ptr()
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_pd; its QP and MRs were dropped first.
        unsafe { ffi::ibv_dealloc_pd(self.raw()) };
    }
}

/// A completion channel: its fd becomes readable when an armed CQ gets a completion.
pub(crate) struct Channel(NonNull<ffi::ibv_comp_channel>);
// SAFETY: as for Context.
unsafe impl Send for Channel {}

impl Channel {
    pub fn new(ctx: &Context, who: &str) -> Result<Channel> {
        // SAFETY: open context.
        let ch = unsafe { ffi::ibv_create_comp_channel(ctx.raw()) };
        let ch = Channel(non_null("ibv_create_comp_channel", who, ch)?);
        let fd = ch.fd();
        // SAFETY: fcntl on a descriptor the channel owns.
        let rc = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK)
        };
        if rc < 0 {
            return Err(TransportError::last_os(
                "fcntl(O_NONBLOCK) on the completion channel",
                who,
            ));
        }
        Ok(ch)
    }
    pub fn fd(&self) -> c_int {
        // SAFETY: the channel is valid; fd is a plain field.
        unsafe { (*self.0.as_ptr()).fd }
    }
    pub fn raw(&self) -> *mut ffi::ibv_comp_channel {
        self.0.as_ptr()
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_comp_channel; its CQ was destroyed first.
        unsafe { ffi::ibv_destroy_comp_channel(self.raw()) };
    }
}

/// A completion queue bound to a channel. Events taken from the channel are acknowledged
/// before it is destroyed (ibv_destroy_cq waits for that).
pub(crate) struct Cq {
    cq: NonNull<ffi::ibv_cq>,
    unacked: u32,
}
// SAFETY: as for Context.
unsafe impl Send for Cq {}

impl Cq {
    pub fn new(ctx: &Context, channel: &Channel, entries: i32, who: &str) -> Result<Cq> {
        // SAFETY: open context and channel of that context.
        let cq =
            unsafe { ffi::ibv_create_cq(ctx.raw(), entries, ptr::null_mut(), channel.raw(), 0) };
        Ok(Cq {
            cq: non_null("ibv_create_cq", who, cq)?,
            unacked: 0,
        })
    }
    pub fn raw(&self) -> *mut ffi::ibv_cq {
        self.cq.as_ptr()
    }

    /// Up to `wc.len()` completions; returns how many.
    pub fn poll(&mut self, wc: &mut [ffi::ibv_wc], who: &str) -> Result<usize> {
        let cq = self.raw();
        // SAFETY: the CQ is valid; its context's op table is filled in by the provider;
        // `wc` has room for `wc.len()` entries.
        let n = unsafe {
            let poll = (*(*cq).context).ops.poll_cq.expect("provider has poll_cq");
            poll(cq, wc.len() as c_int, wc.as_mut_ptr())
        };
        if n < 0 {
            return Err(verb_error(
                "ibv_poll_cq",
                who,
                io::Error::from_raw_os_error(-n),
            ));
        }
        Ok(n as usize)
    }

    /// Asks for an event on the channel at the next completion (`ibv_req_notify_cq`).
    pub fn arm(&mut self, who: &str) -> Result<()> {
        let cq = self.raw();
        // SAFETY: as in poll.
        let rc = unsafe {
            let notify = (*(*cq).context)
                .ops
                .req_notify_cq
                .expect("provider has req_notify_cq");
            notify(cq, 0)
        };
        check("ibv_req_notify_cq", who, rc)
    }

    /// Takes every pending event off the (non-blocking) channel; returns whether there was one.
    pub fn drain_events(&mut self, channel: &Channel) -> bool {
        let mut any = false;
        loop {
            let mut cq: *mut ffi::ibv_cq = ptr::null_mut();
            let mut context: *mut c_void = ptr::null_mut();
            // SAFETY: the channel is valid and non-blocking; both out pointers are valid.
            let rc = unsafe { ffi::ibv_get_cq_event(channel.raw(), &mut cq, &mut context) };
            if rc != 0 {
                break;
            }
            any = true;
            self.unacked += 1;
        }
        if self.unacked >= 64 {
            self.ack();
        }
        any
    }

    fn ack(&mut self) {
        if self.unacked > 0 {
            // SAFETY: acknowledges exactly the events taken by drain_events.
            unsafe { ffi::ibv_ack_cq_events(self.raw(), self.unacked) };
            self.unacked = 0;
        }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        self.ack();
        // SAFETY: created by ibv_create_cq; its QP was destroyed first; every event acked.
        unsafe { ffi::ibv_destroy_cq(self.raw()) };
    }
}

/// Page-aligned, zeroed memory registered with a protection domain (`ibv_reg_mr`).
pub(crate) struct RegisteredBuf {
    mr: NonNull<ffi::ibv_mr>,
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}
// SAFETY: the buffer is owned; the registration is usable from any thread.
unsafe impl Send for RegisteredBuf {}

impl RegisteredBuf {
    pub fn new(pd: &Pd, len: usize, remote_write: bool, who: &str) -> Result<RegisteredBuf> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096).map_err(|_| {
            TransportError::Config {
                detail: format!("{who}: RDMA buffer of {len} bytes"),
            }
        })?;
        // SAFETY: layout has non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).ok_or_else(|| {
            TransportError::io(
                "allocate RDMA buffer",
                format!("{who}: {len} bytes"),
                io::ErrorKind::OutOfMemory.into(),
            )
        })?;
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote_write {
            access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        }
        // SAFETY: [ptr, ptr + len) is memory this value owns until drop, which deregisters
        // it before freeing it.
        let mr = unsafe { ffi::ibv_reg_mr(pd.raw(), ptr.as_ptr().cast(), len, access.0 as c_int) };
        let mr = match non_null("ibv_reg_mr", who, mr) {
            Ok(mr) => mr,
            Err(e) => {
                // SAFETY: allocated above with this layout.
                unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
                return Err(e);
            }
        };
        LIVE_MRS.fetch_add(1, Ordering::SeqCst);
        Ok(RegisteredBuf { mr, ptr, layout })
    }
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
    pub fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    pub fn lkey(&self) -> u32 {
        // SAFETY: valid registration; plain field.
        unsafe { (*self.mr.as_ptr()).lkey }
    }
    pub fn rkey(&self) -> u32 {
        // SAFETY: valid registration; plain field.
        unsafe { (*self.mr.as_ptr()).rkey }
    }
}

impl Drop for RegisteredBuf {
    fn drop(&mut self) {
        // SAFETY: registered in new; the QP that used it is already destroyed (field order),
        // so the device touches the memory no more once this returns.
        unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        LIVE_MRS.fetch_sub(1, Ordering::SeqCst);
        // SAFETY: allocated in new with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// A registration of memory this value does not own: a user buffer that stays put
/// (`ibv_reg_mr`) or a device buffer (`ibv_reg_dmabuf_mr`). Deregistered on drop, which must
/// come before the protection domain's (the link's field order).
pub(crate) struct Mr(NonNull<ffi::ibv_mr>);
// SAFETY: as for RegisteredBuf.
unsafe impl Send for Mr {}

impl Mr {
    /// Registers `[addr, addr + len)` for the device to read (the source of RDMA WRITEs).
    ///
    /// # Safety
    ///
    /// The range must be memory mapped in this process now. The registration pins its pages,
    /// so the device never touches freed memory even if the range is unmapped later; but
    /// callers must only post requests on it while the owner keeps the bytes unchanged.
    pub unsafe fn register_user(pd: &Pd, addr: u64, len: usize, who: &str) -> Result<Mr> {
        // SAFETY: the caller guarantees the range is mapped; read-only access (flags 0) lets
        // the device read it as a send source and nothing else.
        let mr = unsafe { ffi::ibv_reg_mr(pd.raw(), addr as *mut c_void, len, 0) };
        let mr = non_null("ibv_reg_mr (user buffer)", who, mr)?;
        LIVE_MRS.fetch_add(1, Ordering::SeqCst);
        Ok(Mr(mr))
    }

    /// Registers `len` bytes at `offset` of the dma-buf `fd` (device memory exported by its
    /// driver), seen by work requests at address `iova`. A provider without dma-buf support
    /// (soft-RoCE among them) answers EOPNOTSUPP: the error says so, naming the verb and the
    /// device.
    pub fn register_dmabuf(pd: &Pd, device: &str, buf: &crate::DmaBuf, who: &str) -> Result<Mr> {
        let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        // SAFETY: a valid PD; libibverbs checks the descriptor itself (a non-dma-buf fd is
        // an error return, not undefined behaviour) and a provider without the verb returns
        // NULL with EOPNOTSUPP. No memory of this process is named.
        let mr = unsafe {
            ffi::ibv_reg_dmabuf_mr(
                pd.raw(),
                buf.offset,
                buf.len,
                buf.iova,
                buf.fd,
                access.0 as c_int,
            )
        };
        match NonNull::new(mr) {
            Some(mr) => {
                LIVE_MRS.fetch_add(1, Ordering::SeqCst);
                Ok(Mr(mr))
            }
            None => {
                let e = io::Error::last_os_error();
                let why = match e.raw_os_error() {
                    Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => format!(
                        "device {device} does not support it (its provider or kernel driver answers: {e})"
                    ),
                    _ => format!("device {device} refused the buffer (fd {}, offset {}, {} bytes): {e}", buf.fd, buf.offset, buf.len),
                };
                Err(TransportError::Unsupported {
                    detail: format!(
                        "{who}: device buffers need dma-buf support (ibv_reg_dmabuf_mr): {why}"
                    ),
                })
            }
        }
    }

    pub fn lkey(&self) -> u32 {
        // SAFETY: valid registration; plain field.
        unsafe { (*self.0.as_ptr()).lkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered by register_*; dropped once, after the QP whose requests used it
        // (field order) or with none of its requests outstanding.
        unsafe { ffi::ibv_dereg_mr(self.0.as_ptr()) };
        LIVE_MRS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Where a queue pair is reached: exchanged over the authenticated setup connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct QpAddress {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
}

/// A reliable-connected queue pair whose send and receive completions go to one CQ.
pub(crate) struct Qp(NonNull<ffi::ibv_qp>);
// SAFETY: as for Context.
unsafe impl Send for Qp {}

impl Qp {
    pub fn new(pd: &Pd, cq: &Cq, send_wr: u32, recv_wr: u32, who: &str) -> Result<Qp> {
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: cq.raw(),
            recv_cq: cq.raw(),
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: send_wr,
                max_recv_wr: recv_wr,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: valid PD and CQ of one context; init is fully initialized.
        let qp = unsafe { ffi::ibv_create_qp(pd.raw(), &mut init) };
        let qp = Qp(non_null("ibv_create_qp", who, qp)?);
        LIVE_QPS.fetch_add(1, Ordering::SeqCst);
        Ok(qp)
    }

    pub fn raw(&self) -> *mut ffi::ibv_qp {
        self.0.as_ptr()
    }

    pub fn qpn(&self) -> u32 {
        // SAFETY: valid QP; plain field.
        unsafe { (*self.raw()).qp_num }
    }

    fn modify(
        &self,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
        verb: &'static str,
        who: &str,
    ) -> Result<()> {
        // SAFETY: valid QP; attr initialized for every field the mask names.
        let rc = unsafe { ffi::ibv_modify_qp(self.raw(), attr, mask.0 as c_int) };
        check(verb, who, rc)
    }

    /// RESET -> INIT (receives may be posted from here on).
    pub fn init(&self, who: &str) -> Result<()> {
        use ffi::ibv_qp_attr_mask as M;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: PORT,
            qp_access_flags: (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
                .0,
            ..Default::default()
        };
        self.modify(
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp to INIT",
            who,
        )
    }

    /// INIT -> RTR -> RTS against `remote`, using our GID at `gid_index`.
    pub fn connect(
        &self,
        remote: &QpAddress,
        local_psn: u32,
        gid_index: u8,
        mtu: ffi::ibv_mtu,
        who: &str,
    ) -> Result<()> {
        use ffi::ibv_qp_attr_mask as M;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: mtu,
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ..Default::default()
        };
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = 0;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = PORT;
        if remote.gid != [0; 16] {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid };
            a.ah_attr.grh.sgid_index = gid_index;
            a.ah_attr.grh.hop_limit = 64;
        }
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
            "ibv_modify_qp to RTR",
            who,
        )?;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            sq_psn: local_psn,
            // 4.096 us * 2^14 = 67 ms per try, 7 tries: a dead peer is an error in about half
            // a second even without the setup connection's EOF.
            timeout: 14,
            retry_cnt: 7,
            // Receiver not ready: retry forever (flow control keeps receives posted; this is
            // only the backstop).
            rnr_retry: 7,
            max_rd_atomic: 1,
            ..Default::default()
        };
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
            "ibv_modify_qp to RTS",
            who,
        )
    }

    /// Posts one zero-length receive (RDMA WRITE with immediate consumes one per message).
    pub fn post_recv(&self, who: &str) -> Result<()> {
        let mut wr = ffi::ibv_recv_wr {
            wr_id: 0,
            next: ptr::null_mut(),
            sg_list: ptr::null_mut(),
            num_sge: 0,
        };
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        let qp = self.raw();
        // SAFETY: valid QP; the WR names no memory.
        let rc = unsafe {
            let post = (*(*qp).context)
                .ops
                .post_recv
                .expect("provider has post_recv");
            post(qp, &mut wr, &mut bad)
        };
        check("ibv_post_recv", who, rc)
    }

    /// Posts a signaled RDMA WRITE with immediate of `len` bytes at `local` (lkey `lkey`; no
    /// bytes if `len` is 0) to `remote_addr`/`rkey` in the peer.
    ///
    /// # Safety
    ///
    /// `[local, local + len)` must lie in memory registered as `lkey` and stay unchanged
    /// until the completion of this request has been polled (or the QP destroyed).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn post_write_imm(
        &self,
        wr_id: u64,
        local: *const u8,
        len: u32,
        lkey: u32,
        remote_addr: u64,
        rkey: u32,
        imm: u32,
        who: &str,
    ) -> Result<()> {
        let mut sge = ffi::ibv_sge {
            addr: local as u64,
            length: len,
            lkey,
        };
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: if len > 0 { &mut sge } else { ptr::null_mut() },
            num_sge: c_int::from(len > 0),
            opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.__bindgen_anon_1.imm_data = imm.to_be();
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        let qp = self.raw();
        // SAFETY: valid QP; the caller keeps the memory valid (this function's contract).
        let rc = unsafe {
            let post = (*(*qp).context)
                .ops
                .post_send
                .expect("provider has post_send");
            post(qp, &mut wr, &mut bad)
        };
        check("ibv_post_send (RDMA WRITE with immediate)", who, rc)
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_qp, destroyed once; the MRs and CQ it used are
        // dropped after it (field order).
        unsafe { ffi::ibv_destroy_qp(self.raw()) };
        LIVE_QPS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The text rdma-core gives a completion status.
pub(crate) fn status_text(status: ffi::ibv_wc_status::Type) -> String {
    // SAFETY: ibv_wc_status_str returns a static string for any value.
    let s = unsafe { ffi::ibv_wc_status_str(status) };
    if s.is_null() {
        format!("status {status}")
    } else {
        // SAFETY: non-null static C string.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }
}
