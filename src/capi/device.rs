//! The device-memory Allgather behind `cieraAllGather` and `ncclAllGather` on device pointers,
//! with NCCL's semantics: the call checks its arguments, queues the work behind the caller's
//! stream and returns; the stream's later work sees the result.
//!
//! ```text
//!  caller's thread (LiveComm::all_gather_device)        proxy thread (one per communicator)
//!  ─ record event `ready` on the caller's stream        ─ wait until `ready` completes
//!  ─ queue "wait until flag >= seq" on that stream      ─ run the call on its own stream:
//!    (cuStreamWaitValue32 on a pinned counter;            CUDA IPC (every rank on this host)
//!     else a host function that blocks until done)        or host-staged (see below)
//!  ─ hand the job (seq) to the proxy, return            ─ set flag = seq: the stream goes on
//! ```
//!
//! - **Order.** Calls of a communicator run in the order they were made, device and host ones
//!   alike (a host call first waits for the device calls before it), on every rank the same.
//! - **CUDA IPC** (every rank on this host, the driver has legacy IPC, `CIERA_DEVICE_IPC` not
//!   0): each rank owns a staging buffer from cuMemAlloc (IPC-able, unlike stream-ordered
//!   pools), in two halves used by alternate calls; ranks swap its IPC handle once (and
//!   again when a call needs more room) over the communicator's authenticated links and map
//!   each other's. Per call: copy the own shard into the own half, one small exchange on the
//!   host (every rank's shard is staged; it also checks that the calls match), then copy
//!   every peer's shard out of its mapped half. Two halves make a second exchange needless: a
//!   rank writes a half again only two calls later, after every peer passed the exchange of
//!   the call in between, so after they finished reading it.
//! - **Host-staged** (otherwise): copy the own shard to pinned host memory, run the host
//!   Allgather there (compressed where it pays, with the caches, policy and repair of every
//!   host call), copy the result to the device.
//! - **Destroy** runs what is queued, then (IPC) one more exchange, so no peer still reads
//!   this rank's staging buffer when it is freed: every rank destroys the communicator, as
//!   with NCCL (a rank that never does keeps the others waiting up to `CIERA_TIMEOUT`).
//! - **Errors.** Arguments are checked before anything is queued and returned. A failure of
//!   the exchange (a peer died, a timeout, an abort, a CUDA error) becomes the communicator's
//!   async error (`cieraCommGetAsyncError`, naming the rank), the stream is released so
//!   nothing hangs, and every later call returns that error at once.
//!
//! Not yet here: the GPU codec in this path (frames are coded on the host after staging, so
//! PCIe carries raw bytes; the IPC path moves raw bytes), VMM (cuMemCreate) handles passed as
//! file descriptors, a pipelined (chunked) staging.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::abi::{Failure, ResultCode};
use super::live::{lock, CheckedBuffers, Core, GatherBuffers};
use crate::compress::GatherOptions;
use crate::gpu::driver;
use crate::gpu::stream::{
    self, copy_dtod, copy_dtoh, copy_htod, enqueue_host_fn, Context, CudaError, DeviceBuffer,
    Event, Flag, IpcMapping, Pinned, Stream, StreamRef,
};
use crate::mem::Location;
use crate::DType;

/// Whether an allgather's buffers are device memory (both) rather than host memory (both);
/// NULL buffers (allowed when nothing moves) take the other's kind. Mixed or unknown kinds
/// are an error naming the buffer.
pub fn on_device(send: *const c_void, recv: *const c_void) -> Result<bool, Failure> {
    let kind = |name: &str, p: *const c_void| -> Result<Option<bool>, Failure> {
        if p.is_null() {
            return Ok(None);
        }
        match driver::classify(p) {
            Location::Host => Ok(Some(false)),
            Location::Device => Ok(Some(true)),
            Location::Unknown => Err(Failure::invalid_argument(format!(
                "the CUDA driver could not say where {name} {p:p} lives"
            ))),
        }
    };
    match (kind("sendbuff", send)?, kind("recvbuff", recv)?) {
        (Some(a), Some(b)) if a != b => Err(Failure::invalid_argument(format!(
            "sendbuff {send:p} is {} memory but recvbuff {recv:p} is {} memory: both must be \
             device memory, or both host memory",
            if a { "CUDA device" } else { "host" },
            if b { "CUDA device" } else { "host" },
        ))),
        (Some(a), _) | (None, Some(a)) => Ok(a),
        (None, None) => Ok(false),
    }
}

/// One device-memory allgather as the caller made it (arguments checked).
pub(crate) struct DeviceCall {
    pub send: u64,
    pub recv: u64,
    pub count: usize,
    pub dtype: DType,
    pub key: Option<u64>,
    pub checked: CheckedBuffers,
}

struct Job {
    call: DeviceCall,
    seq: u64,
    /// Completes when the caller's stream reached the call.
    ready: Event,
}

/// The last call the proxy finished, for host waits.
#[derive(Default)]
struct Progress {
    done: Mutex<u64>,
    cv: Condvar,
}

impl Progress {
    fn set(&self, seq: u64) {
        *lock(&self.done) = seq;
        self.cv.notify_all();
    }

    fn wait_for(&self, seq: u64) {
        let mut d = lock(&self.done);
        while *d < seq {
            d = self.cv.wait(d).unwrap_or_else(|p| p.into_inner());
        }
    }
}

fn cuda(rank: usize, e: CudaError) -> Failure {
    Failure {
        code: ResultCode::UnhandledCudaError,
        message: format!("rank {rank}: device-memory allgather: {e}"),
    }
}

/// A communicator's queue of device-memory calls and the proxy thread that runs them.
pub(crate) struct DeviceQueue {
    tx: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    progress: Arc<Progress>,
    flag: Arc<Flag>,
    issued: u64,
    rank: usize,
    /// The driver cannot wait on the flag (no stream memory operations): streams wait in a
    /// host function instead.
    host_fn_wait: bool,
}

impl DeviceQueue {
    /// Starts the proxy thread, in the calling thread's CUDA context.
    pub(super) fn start(core: Arc<Core>) -> Result<DeviceQueue, Failure> {
        let rank = core.rank();
        stream::available().map_err(|e| cuda(rank, e))?;
        let ctx = Context::current()
            .map_err(|e| cuda(rank, e))?
            .ok_or_else(|| {
                Failure::invalid_usage(
                    "no CUDA context is current on the calling thread (set a device first)",
                )
            })?;
        let flag = Arc::new(Flag::new().map_err(|e| cuda(rank, e))?);
        let progress = Arc::new(Progress::default());
        let (tx, rx) = mpsc::channel::<Job>();
        let (f, p) = (flag.clone(), progress.clone());
        let thread = std::thread::Builder::new()
            .name(format!("ciera-dev{rank}"))
            .spawn(move || Proxy::new(core, ctx).serve(rx, &f, &p))
            .map_err(|e| Failure {
                code: ResultCode::SystemError,
                message: format!("rank {rank}: starting the device proxy thread: {e}"),
            })?;
        Ok(DeviceQueue {
            tx: Some(tx),
            thread: Some(thread),
            progress,
            flag,
            issued: 0,
            rank,
            host_fn_wait: false,
        })
    }

    /// Queues `call` behind `stream`'s work, and `stream`'s later work behind the call.
    pub(super) fn enqueue(&mut self, call: DeviceCall, stream: StreamRef) -> Result<(), Failure> {
        let rank = self.rank;
        let ready = Event::new().map_err(|e| cuda(rank, e))?;
        ready.record(stream).map_err(|e| cuda(rank, e))?;
        self.issued += 1;
        let seq = self.issued;
        // The stream waits first, then the job goes: if ordering the stream fails, the call
        // still runs (the peers wait for it) and the caller hears why.
        let ordered = self.order_stream(stream, seq);
        let job = Job { call, seq, ready };
        if self.tx.as_ref().is_none_or(|tx| tx.send(job).is_err()) {
            return Err(Failure::internal(format!(
                "rank {rank}: the device proxy thread has stopped"
            )));
        }
        ordered
    }

    fn order_stream(&mut self, stream: StreamRef, seq: u64) -> Result<(), Failure> {
        if !self.host_fn_wait {
            // The flag is 32 bits; the wait compares cyclically, so wrapping is fine.
            match self.flag.enqueue_wait(stream, seq as u32) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::warn!(
                        "rank {}: {e}; streams wait for device allgathers in a host function instead",
                        self.rank
                    );
                    self.host_fn_wait = true;
                }
            }
        }
        let p = self.progress.clone();
        enqueue_host_fn(stream, Box::new(move || p.wait_for(seq))).map_err(|e| cuda(self.rank, e))
    }

    /// Waits on the host until every queued call has run.
    pub(super) fn wait_idle(&self) {
        self.progress.wait_for(self.issued);
    }
}

impl Drop for DeviceQueue {
    fn drop(&mut self) {
        // The proxy runs what is queued, then ends and frees its memory and handles.
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Whether this rank may use CUDA IPC (`CIERA_DEVICE_IPC`: auto (default), 1, 0).
fn ipc_wanted(core: &Core) -> bool {
    let setting = std::env::var("CIERA_DEVICE_IPC").unwrap_or_default();
    let allowed = !matches!(setting.trim(), "0" | "off" | "false" | "no");
    allowed && core.size() > 1 && core.single_host() && stream::has_ipc()
}

/// This rank's staging buffer and its peers' mappings.
struct Ipc {
    /// Bytes per half.
    cap: usize,
    buf: DeviceBuffer,
    /// Per rank (None for this one).
    peers: Vec<Option<IpcMapping>>,
    calls: u64,
}

/// The proxy thread's state: its stream, staging memory, IPC mappings.
struct Proxy {
    core: Arc<Core>,
    ctx: Context,
    stream: Option<Stream>,
    staging: Option<Pinned>,
    /// None until the first call decided; Some(false): host-staged for good.
    use_ipc: Option<bool>,
    ipc: Option<Ipc>,
    reported: AtomicBool,
}

impl Proxy {
    fn new(core: Arc<Core>, ctx: Context) -> Proxy {
        Proxy {
            core,
            ctx,
            stream: None,
            staging: None,
            use_ipc: None,
            ipc: None,
            reported: AtomicBool::new(false),
        }
    }

    fn serve(mut self, rx: mpsc::Receiver<Job>, flag: &Flag, progress: &Progress) {
        let rank = self.core.rank();
        let current = self.ctx.make_current().map_err(|e| cuda(rank, e));
        for job in rx {
            let r = match (&current, self.core.async_error()) {
                (Err(f), _) => Err(f.clone()),
                (Ok(()), Some((code, message))) => Err(Failure {
                    code,
                    message: format!("the communicator failed earlier: {message}"),
                }),
                (Ok(()), None) => self.run(&job),
            };
            if let Err(f) = r {
                self.core.fail(&f);
                if !self.reported.swap(true, Ordering::Relaxed) {
                    // One line in one write, so ranks sharing a terminal do not interleave.
                    let line = format!(
                        "ciera: rank {rank}: device-memory allgather {} failed: {} (the \
                         communicator is broken; cieraCommGetAsyncError reports it)\n",
                        job.seq, f.message
                    );
                    let _ =
                        std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
                }
            }
            // Release the caller's stream whatever happened: it must not hang.
            flag.set(job.seq as u32);
            progress.set(job.seq);
        }
        if let Some(s) = &self.stream {
            let _ = s.synchronize();
        }
        // Peers may still be copying out of this rank's staging buffer (their last call's
        // reads): one last exchange before it is freed, as NCCL's destroy finalizes
        // collectively. A broken communicator skips it (its peers may be gone).
        if self.ipc.is_some() && self.core.async_error().is_none() {
            let _ = self.core.exchange(&[0]);
        }
    }

    fn stream(&mut self) -> Result<StreamRef, Failure> {
        if self.stream.is_none() {
            let s = Stream::new().map_err(|e| cuda(self.core.rank(), e))?;
            self.stream = Some(s);
        }
        Ok(self.stream.as_ref().expect("made above").as_ref())
    }

    fn sync(&self) -> Result<(), Failure> {
        match &self.stream {
            Some(s) => s.synchronize().map_err(|e| cuda(self.core.rank(), e)),
            None => Ok(()),
        }
    }

    /// Waits until the caller's stream reached the call (polling, so an abort ends it).
    fn wait_ready(&self, ev: &Event) -> Result<(), Failure> {
        let rank = self.core.rank();
        let mut polls = 0u32;
        while !ev.done().map_err(|e| cuda(rank, e))? {
            if self.core.aborted() {
                return Err(Failure {
                    code: ResultCode::RemoteError,
                    message: format!(
                        "rank {rank}: aborted while waiting for the stream's earlier work"
                    ),
                });
            }
            polls += 1;
            if polls < 2000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        Ok(())
    }

    fn run(&mut self, job: &Job) -> Result<(), Failure> {
        self.wait_ready(&job.ready)?;
        let st = self.stream()?;
        if self.use_ipc.is_none() {
            // Every rank's first device call: agree on the path (any rank that cannot use
            // IPC sends them all host-staged).
            let all = self.core.exchange(&[ipc_wanted(&self.core) as u8])?;
            self.use_ipc = Some(all.iter().all(|&b| b == 1));
        }
        if self.use_ipc == Some(true) {
            self.ensure_ipc(job.call.checked.block, st)?;
        }
        match self.ipc.is_some() && self.use_ipc == Some(true) {
            true => self.run_ipc(&job.call, st),
            false => self.run_staged(&job.call, st),
        }
    }

    /// Makes the staging buffers hold `block` bytes per half on every rank (collective).
    fn ensure_ipc(&mut self, block: usize, st: StreamRef) -> Result<(), Failure> {
        if self.ipc.as_ref().is_some_and(|i| i.cap >= block) {
            return Ok(());
        }
        let (rank, n) = (self.core.rank(), self.core.size());
        // Round up, so a model's layers of slightly different sizes share one buffer.
        let cap = block.max(1).next_power_of_two().max(1 << 20);
        let made = DeviceBuffer::new(2 * cap).and_then(|b| b.ipc_handle().map(|h| (b, h)));
        // Record: ok, 7 reserved, cap, handle.
        let mut rec = [0u8; 80];
        let mut fresh = None;
        match made {
            Ok((b, h)) => {
                rec[0] = 1;
                rec[8..16].copy_from_slice(&(cap as u64).to_le_bytes());
                rec[16..80].copy_from_slice(&h);
                fresh = Some(b);
            }
            Err(e) => tracing::warn!("rank {rank}: {e}; device allgathers go host-staged"),
        }
        let all = self.core.exchange(&rec)?;
        let recs: Vec<&[u8]> = all.chunks(80).collect();
        let caps: Vec<u64> = recs
            .iter()
            .map(|r| u64::from_le_bytes(r[8..16].try_into().expect("8 bytes")))
            .collect();
        if recs.iter().all(|r| r[0] == 1) && caps.iter().any(|&c| c != cap as u64) {
            let differ: Vec<usize> = (0..n).filter(|&r| caps[r] != cap as u64).collect();
            return Err(Failure {
                code: ResultCode::InvalidUsage,
                message: format!(
                    "rank {rank}: device allgather of {block} bytes per rank, but rank(s) \
                     {differ:?} called with another size"
                ),
            });
        }
        let mut peers: Vec<Option<IpcMapping>> = Vec::with_capacity(n);
        let mut opened = recs.iter().all(|r| r[0] == 1);
        for (p, r) in recs.iter().enumerate() {
            if p == rank || !opened {
                peers.push(None);
                continue;
            }
            let h: [u8; 64] = r[16..80].try_into().expect("64 bytes");
            match IpcMapping::open(&h) {
                Ok(m) => peers.push(Some(m)),
                Err(e) => {
                    tracing::warn!(
                        "rank {rank}: mapping rank {p}'s staging buffer: {e}; device \
                         allgathers go host-staged"
                    );
                    opened = false;
                    peers.push(None);
                }
            }
        }
        let all_open = self.core.exchange(&[opened as u8])?;
        // Every rank is past the calls that used the old buffers (the exchanges above were
        // collective), so they may go.
        let _ = self.sync();
        let _ = st;
        if all_open.iter().all(|&b| b == 1) {
            let calls = self.ipc.as_ref().map_or(0, |i| i.calls);
            self.ipc = Some(Ipc {
                cap,
                buf: fresh.expect("every rank, this one too, made its buffer"),
                peers,
                calls,
            });
        } else {
            self.ipc = None;
            self.use_ipc = Some(false);
        }
        Ok(())
    }

    fn run_ipc(&mut self, call: &DeviceCall, st: StreamRef) -> Result<(), Failure> {
        let (rank, n) = (self.core.rank(), self.core.size());
        let ipc = self.ipc.as_mut().expect("ensured");
        let c = call.checked;
        let half = (ipc.calls % 2) as usize;
        ipc.calls += 1;
        let own = ipc.buf.addr() + (half * ipc.cap) as u64;
        let err = |e| cuda(rank, e);
        // SAFETY: `send` holds `block` device bytes (the caller's contract, sizes checked);
        // `own` is a half of our staging buffer, `cap >= block` bytes; recv's own block lies
        // inside recv, which is disjoint from send out of place (checked).
        unsafe {
            copy_dtod(own, call.send, c.block, st).map_err(err)?;
            if !c.in_place {
                copy_dtod(call.recv + (rank * c.block) as u64, call.send, c.block, st)
                    .map_err(err)?;
            }
        }
        self.sync()?;
        // Every rank's shard is staged once this exchange returns; it also checks the calls
        // match (the count of IPC calls and the block size).
        let ipc = self.ipc.as_ref().expect("ensured");
        let mut rec = [0u8; 16];
        rec[..8].copy_from_slice(&ipc.calls.to_le_bytes());
        rec[8..].copy_from_slice(&(c.block as u64).to_le_bytes());
        let all = self.core.exchange(&rec)?;
        let differ: Vec<usize> = (0..n)
            .filter(|&p| all[16 * p..16 * p + 16] != rec)
            .collect();
        if !differ.is_empty() {
            return Err(Failure {
                code: ResultCode::InvalidUsage,
                message: format!(
                    "rank {rank}: device allgather {} of {} bytes per rank does not match \
                     rank(s) {differ:?}'s call",
                    ipc.calls, c.block
                ),
            });
        }
        for (p, m) in ipc.peers.iter().enumerate() {
            let Some(m) = m else { continue };
            let src = m.addr() + (half * ipc.cap) as u64;
            // SAFETY: the peer's half holds its staged `block` bytes (the exchange above
            // says it finished staging, and it writes this half again only after the next
            // exchange); recv's block `p` lies inside recv.
            unsafe { copy_dtod(call.recv + (p * c.block) as u64, src, c.block, st) }
                .map_err(err)?;
        }
        self.sync()?;
        self.core.count_call(c.in_place);
        Ok(())
    }

    fn run_staged(&mut self, call: &DeviceCall, st: StreamRef) -> Result<(), Failure> {
        let rank = self.core.rank();
        let c = call.checked;
        if self.staging.as_ref().is_none_or(|s| s.len() < c.total) {
            self.staging = None;
            let p = Pinned::new(c.total).map_err(|e| cuda(rank, e))?;
            self.staging = Some(p);
        }
        let staging = self.staging.as_mut().expect("made above");
        let err = |e| cuda(rank, e);
        let base = staging.as_mut_slice().as_mut_ptr();
        let own = rank * c.block;
        // SAFETY: `send` holds `block` device bytes; the staging buffer has `total` bytes, of
        // which this rank's block is [own, own + block); the stream is synchronized before
        // the host touches them.
        unsafe { copy_dtoh(base.add(own), call.send, c.block, st) }.map_err(err)?;
        self.sync()?;
        let staging = self.staging.as_mut().expect("made above");
        let opts = GatherOptions {
            key: call.key,
            // The device buffer's address names the tensor, not the staging buffer's.
            infer_addr: Some(if c.in_place { call.recv ^ 1 } else { call.send }),
            ..GatherOptions::default()
        };
        let recv = &mut staging.as_mut_slice()[..c.total];
        self.core.gather(
            GatherBuffers::InPlace { recv },
            call.count,
            call.dtype,
            &opts,
            c.in_place,
        )?;
        let base = staging.as_slice().as_ptr();
        // In place, the own block is already in recv; out of place it goes too.
        let pieces: [(usize, usize); 2] = if c.in_place {
            [(0, own), (own + c.block, c.total)]
        } else {
            [(0, c.total), (0, 0)]
        };
        for (a, b) in pieces {
            if b > a {
                // SAFETY: [a, b) lies inside both the staging buffer and recv (`total`
                // bytes each); the staging buffer is not touched until the sync below.
                unsafe { copy_htod(call.recv + a as u64, base.add(a), b - a, st) }.map_err(err)?;
            }
        }
        self.sync()
    }
}
