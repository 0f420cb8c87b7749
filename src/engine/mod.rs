//! The engine: runs one collective call over a rank's links. It takes a schedule from
//! [`crate::algo`] (pure), the call's bytes from a [`Payloads`] (where they live: the user's
//! buffers, or codec frames made by [`FrameEncoder`] on the engine's encoder worker and decoded
//! by a [`FrameCodec`]), and moves them with one polling loop over the transport's links,
//! speaking the stream format of [`wire`].
//!
//! - [`layout`]: how a block is cut in chunks (the one place).
//! - [`payloads`]: the byte-placement trait and its raw and framed implementations.
//! - [`wire`]: message headers, segments, reference segments, abort notices.
//! - `rx`: the pure decoder of a link's stream (sans-IO, unit-tested without links).
//! - `exec` (the loop), `send`, `recv`, `abort`: the executor, in parts.
//! - [`single_copy`]: per call size, rings or references for shm peers.
//! - `host`: CPUs and cache of this host (idle policy, streaming threshold).
//!
//! The engine knows nothing of compression policy or caches: the communicator ([`crate::comm`])
//! decides raw or framed per call and hands the engine an encoder and a codec.
#![forbid(unsafe_code)]

mod abort;
mod exec;
mod host;
pub mod layout;
pub mod payloads;
mod recv;
mod rx;
mod send;
pub mod single_copy;
pub mod wire;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use ciera_transport::{Endpoint, SingleCopy, Waker};

use crate::algo::{Algo, AlgoChoice, Progress, Schedule, Topology, Unit};
use crate::error::{Error, Result};
use crate::mem::Location;
use crate::DType;
pub use exec::{transport_error, IdlePolicy};
use exec::{Exec, LinkRx};
pub use host::{
    cpu_share, default_stream_min_bytes, idle_policy, oversubscribed, DEFAULT_LLC_BYTES,
};
pub use layout::Layout;
pub use payloads::{ChunkRef, FrameCodec, FrameEncoder, Payloads};
use payloads::{FramedPayloads, RawPayloads};
use send::{SendLane, REF_MIN};
use single_copy::RefChooser;
use wire::{CallSig, Op};

/// Frames the encoder worker may have made and the executor not yet taken.
const OWN_FRAMES_AHEAD: usize = 4;

/// How the engine runs calls (the communicator's `Config` says; `None` fields are chosen from
/// this host when the engine is made).
#[derive(Clone, Debug)]
pub struct Settings {
    /// How long any wait may make no progress before the call fails naming the peer.
    pub timeout: Duration,
    pub algo: AlgoChoice,
    /// Pipelining unit: a block is cut in chunks of this many bytes (whole elements).
    pub chunk_bytes: usize,
    /// How an idle rank waits; None: from the ranks on this host versus its CPUs.
    pub idle: Option<IdlePolicy>,
    /// Calls with at least this much output copy into it with non-temporal stores; None:
    /// [`default_stream_min_bytes`] for the ranks on this host.
    pub stream_min_bytes: Option<usize>,
    /// Large raw segments to shm peers: rings, references, or measured per call size.
    pub single_copy: SingleCopy,
}

struct AbortShared {
    flag: AtomicBool,
    waker: Option<Waker>,
}

/// Aborts a communicator from any thread: a collective blocked in it (or the next one to
/// start) returns `Error::Aborted`, its peers get an abort notice, and the communicator stays
/// unusable.
#[derive(Clone)]
pub struct AbortHandle {
    shared: Arc<AbortShared>,
}

impl AbortHandle {
    pub fn abort(&self) {
        self.shared.flag.store(true, Ordering::SeqCst);
        if let Some(w) = &self.shared.waker {
            w.wake();
        }
    }

    pub fn is_aborted(&self) -> bool {
        self.shared.flag.load(Ordering::SeqCst)
    }
}

/// One rank's executor state for a communicator: its links, the receive state of every link,
/// send lanes, frame buffers and the encoder worker, all reused from call to call.
pub struct Engine {
    rank: usize,
    topology: Topology,
    timeout: Duration,
    algo: AlgoChoice,
    chunk_bytes: usize,
    /// None for a single rank, and after a failure that could not notify every peer.
    ep: Option<Endpoint>,
    rx: Vec<LinkRx>,
    lanes: Vec<SendLane>,
    frames: Vec<Vec<u8>>,
    /// Frame buffers kept for the next framed call (a few chunks' worth).
    spare_frames: Vec<Vec<u8>>,
    /// This rank's shard, copied for the encoder worker when a framed call is in place.
    own_copy: Vec<u8>,
    /// Encodes this rank's chunks while the executor moves frames; started by the first
    /// framed call.
    encoder: Option<Arc<rayon::ThreadPool>>,
    /// Schedules are cheap, but rebuilding one per call is wasted work for repeated shapes.
    cached: Option<(Algo, usize, Progress)>,
    seq: u64,
    broken: Option<String>,
    abort: Arc<AbortShared>,
    idle: IdlePolicy,
    /// `Settings::stream_min_bytes`, resolved.
    stream_min_bytes: usize,
    /// Whether each call's large raw segments go to shm peers by reference.
    refs: RefChooser,
}

impl Engine {
    /// The engine of `rank` in `topology`, over `ep`'s links (None: a single rank).
    pub fn new(
        rank: usize,
        topology: Topology,
        settings: Settings,
        ep: Option<Endpoint>,
    ) -> Engine {
        let nranks = topology.nranks();
        let local_ranks = topology.ranks_on_host_of(rank);
        let oversubscribed = oversubscribed(local_ranks);
        let waker = ep.as_ref().map(|e| e.waker());
        Engine {
            rank,
            timeout: settings.timeout,
            algo: settings.algo,
            chunk_bytes: settings.chunk_bytes,
            stream_min_bytes: settings
                .stream_min_bytes
                .unwrap_or_else(|| default_stream_min_bytes(local_ranks)),
            idle: settings.idle.unwrap_or_else(|| idle_policy(oversubscribed)),
            // Auto measures only where every rank has a CPU: sharing CPUs, a receiver must be
            // scheduled before its sender's call can end, and references lose to the rings.
            refs: RefChooser::new(match settings.single_copy {
                SingleCopy::Auto if oversubscribed => SingleCopy::Off,
                policy => policy,
            }),
            topology,
            ep,
            rx: (0..nranks).map(|_| LinkRx::new()).collect(),
            lanes: Vec::new(),
            frames: Vec::new(),
            spare_frames: Vec::new(),
            own_copy: Vec::new(),
            encoder: None,
            cached: None,
            seq: 0,
            broken: None,
            abort: Arc::new(AbortShared {
                flag: AtomicBool::new(false),
                waker,
            }),
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.topology.nranks()
    }

    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            shared: self.abort.clone(),
        }
    }

    /// Payload bytes this rank let same-host peers copy straight out of its memory
    /// (single-copy shm, `CIERA_SHM_SINGLE_COPY`) instead of writing them into a ring.
    pub fn single_copy_bytes(&self) -> u64 {
        self.ep.as_ref().map_or(0, |ep| ep.offered_bytes())
    }

    /// Payload bytes this rank copied out of same-host peers' shared buffers through its own
    /// mappings of them (single copy with no system call).
    pub fn shared_read_bytes(&self) -> u64 {
        self.ep.as_ref().map_or(0, |ep| ep.mapped_bytes())
    }

    /// The algorithm a call gathering `count` elements of `dtype` per rank will use.
    pub fn algo_for(&self, count: usize, dtype: DType) -> Algo {
        let total = count
            .saturating_mul(dtype.size())
            .saturating_mul(self.size());
        self.algo.resolve(&self.topology, total)
    }

    /// Gather every rank's shard (`count` elements of `dtype`) into `recv`, rank r's at
    /// element r*count; `send` is this rank's shard, None when it is already in `recv`.
    pub fn all_gather(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        let Some(layout) = self.begin_all_gather(send, recv, count, dtype)? else {
            return Ok(());
        };
        let payloads = RawPayloads::new(layout, send, recv);
        self.execute(Op::AllGather, layout, dtype, payloads)
    }

    /// Allgather through a codec: this rank's chunks are encoded by `encoder` (on the engine's
    /// encoder worker, in chunk order, while the executor sends the frames already made),
    /// frames travel (and are forwarded unchanged) instead of raw bytes, and every received
    /// frame is decoded into `recv` by `codec`. `send` is None for in place. Every rank must use
    /// the same codec format (checked: `CallMismatch` otherwise).
    pub fn all_gather_framed(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        encoder: &mut dyn FrameEncoder,
        codec: &mut dyn FrameCodec,
    ) -> Result<()> {
        let Some(layout) = self.begin_all_gather(send, recv, count, dtype)? else {
            return Ok(());
        };
        let pool = self.encoder_worker()?;
        let mut own_copy = std::mem::take(&mut self.own_copy);
        let mut frames = std::mem::take(&mut self.frames);
        let mut spare = std::mem::take(&mut self.spare_frames);
        let own: &[u8] = match send {
            Some(s) => s,
            None => {
                // In place the executor writes into `recv` while the worker reads this rank's
                // block: the worker gets a copy.
                let block = layout.recv_range(Unit::new(self.rank, 0)).start
                    ..layout
                        .recv_range(Unit::new(self.rank, layout.nchunks - 1))
                        .end;
                own_copy.clear();
                own_copy.extend_from_slice(&recv[block]);
                &own_copy
            }
        };
        let caps: Vec<usize> = (0..layout.nchunks)
            .map(|c| codec.max_frame_len(layout.chunk_range(c).len()))
            .collect();
        let r = pool.in_place_scope(|scope| {
            // The worker stays at most this many frames ahead of the executor (their memory is
            // held until sent).
            let (tx, rx) = mpsc::sync_channel(OWN_FRAMES_AHEAD);
            scope.spawn(move |_| {
                for (chunk, cap) in caps.into_iter().enumerate() {
                    let c = ChunkRef::new(&layout, dtype, Unit::new(layout.rank, chunk));
                    let mut out = Vec::with_capacity(cap);
                    let r = encoder.encode(&c, &own[layout.chunk_range(chunk)], &mut out);
                    if tx.send((chunk, r.map(|()| out))).is_err() {
                        break; // the call failed: nobody waits for more frames
                    }
                }
            });
            let payloads = FramedPayloads::new(
                layout,
                dtype,
                send,
                recv,
                codec,
                &mut frames,
                &mut spare,
                rx,
            );
            self.execute(Op::AllGather, layout, dtype, payloads)
        });
        self.frames = frames;
        self.spare_frames = spare;
        self.own_copy = own_copy;
        r
    }

    /// The encoder worker: one thread, started by the first framed call and kept for the
    /// engine's life (its coding scratch stays warm from call to call).
    fn encoder_worker(&mut self) -> Result<Arc<rayon::ThreadPool>> {
        if let Some(p) = &self.encoder {
            return Ok(p.clone());
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .thread_name(|_| "ciera-encoder".into())
            .build()
            .map_err(|e| Error::Io {
                what: "starting the encoder worker thread".into(),
                source: std::io::Error::other(e.to_string()),
            })?;
        Ok(self.encoder.insert(Arc::new(pool)).clone())
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&mut self) -> Result<()> {
        self.start_call()?;
        if self.size() == 1 {
            return Ok(());
        }
        let layout = Layout::new(self.rank, self.size(), 0, DType::U8, self.chunk_bytes);
        let mut empty: [u8; 0] = [];
        let payloads = RawPayloads::new(layout, None, &mut empty);
        self.execute(Op::Barrier, layout, DType::U8, payloads)
    }

    /// The common start of an allgather: check the lengths, count the call, and finish it at
    /// once on a single rank (None); else the layout of this call's blocks.
    fn begin_all_gather(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
    ) -> Result<Option<Layout>> {
        check_lengths(send.map(|s| s.len()), recv.len(), count, dtype, self.size())?;
        self.start_call()?;
        if self.size() == 1 {
            if let Some(send) = send {
                recv.copy_from_slice(send);
            }
            return Ok(None);
        }
        Ok(Some(Layout::new(
            self.rank,
            self.size(),
            count,
            dtype,
            self.chunk_bytes,
        )))
    }

    fn start_call(&mut self) -> Result<()> {
        if let Some(why) = &self.broken {
            return Err(Error::Aborted {
                detail: format!("communicator unusable after an earlier error: {why}"),
            });
        }
        if self.abort.flag.load(Ordering::SeqCst) {
            self.broken = Some("abort() was called".into());
            return Err(Error::Aborted {
                detail: "abort() was called".into(),
            });
        }
        self.seq += 1;
        Ok(())
    }

    fn execute<P: Payloads>(
        &mut self,
        op: Op,
        layout: Layout,
        dtype: DType,
        mut payloads: P,
    ) -> Result<()> {
        if payloads.location() != Location::Host {
            return Err(Error::Unsupported(format!(
                "payloads in {:?} memory: this engine moves host memory",
                payloads.location()
            )));
        }
        let nranks = self.size();
        let total = layout.block_bytes() * nranks;
        let streaming = total >= self.stream_min_bytes;
        payloads.set_streaming(streaming);
        let algo = if op == Op::Barrier {
            self.algo.resolve(&self.topology, 0)
        } else {
            self.algo.resolve(&self.topology, total)
        };
        let own_ready = payloads.own_ready();
        let progress: &mut Progress = match &mut self.cached {
            Some((a, n, p)) if *a == algo && *n == layout.nchunks => {
                p.reset(own_ready);
                p
            }
            slot => {
                let s = Schedule::new(algo, self.rank, &self.topology, layout.nchunks);
                &mut slot
                    .insert((algo, layout.nchunks, Progress::new(&s, own_ready)))
                    .2
            }
        };
        payloads.start(&|u| progress.sends_of(u));
        let sig = CallSig {
            op,
            seq: self.seq,
            count: layout.count as u64,
            dtype,
            algo,
            format: payloads.format(),
            nchunks: layout.nchunks as u32,
        };
        let Some(ep) = self.ep.as_mut() else {
            return Err(Error::Aborted {
                detail: "communicator has no links (closed after an error)".into(),
            });
        };
        ep.set_streaming(streaming);
        // Only calls whose segments may go either way say anything about the two ways (the
        // chooser ignores records unless its policy is auto); segments in shared buffers
        // always go by reference (see `send::cut_segment`).
        let measured = payloads.peer_readable()
            && layout.block_bytes() >= REF_MIN
            && ep.can_offer_any()
            && !payloads.uses_shared_buffers();
        let started = Instant::now();
        let refs = self.refs.pick(total, started);
        let exec = Exec {
            ep,
            rx: &mut self.rx,
            lanes: &mut self.lanes,
            progress,
            payloads,
            sig,
            rank: self.rank,
            nranks,
            timeout: self.timeout,
            idle: self.idle,
            refs,
            abort: &self.abort.flag,
            relayed: None,
        };
        match exec.run() {
            Ok(()) => {
                if measured {
                    let now = Instant::now();
                    self.refs.record(total, refs, now - started, now);
                }
                Ok(())
            }
            Err(f) => {
                self.broken = Some(f.error.to_string());
                if !f.notified_all {
                    // Some peer could not be told; closing the links tells it.
                    self.ep = None;
                }
                Err(f.error)
            }
        }
    }
}

/// Whether an allgather's buffers fit its count: `send` (if any) one shard, `recv` all.
fn check_lengths(
    send: Option<usize>,
    recv: usize,
    count: usize,
    dtype: DType,
    nranks: usize,
) -> Result<()> {
    let block = count.checked_mul(dtype.size()).ok_or_else(|| {
        Error::InvalidArgument(format!("count {count} of {dtype} overflows a byte length"))
    })?;
    if let Some(send) = send {
        if send != block {
            return Err(Error::LengthMismatch {
                what: "all_gather send buffer bytes (count * dtype size)",
                expected: block,
                found: send,
            });
        }
    }
    let total = block.checked_mul(nranks).ok_or_else(|| {
        Error::InvalidArgument(format!("count {count} x {nranks} ranks overflows"))
    })?;
    if recv != total {
        return Err(Error::LengthMismatch {
            what: "all_gather recv buffer bytes (nranks * count * dtype size)",
            expected: total,
            found: recv,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn single() -> Engine {
        Engine::new(
            0,
            Topology::single_host(1),
            Settings {
                timeout: Duration::from_secs(1),
                algo: AlgoChoice::Auto,
                chunk_bytes: 1 << 20,
                idle: None,
                stream_min_bytes: None,
                single_copy: SingleCopy::Auto,
            },
            None,
        )
    }

    #[test]
    fn single_rank_gathers_its_own_shard_and_aborts_for_good() {
        let mut e = single();
        let mut out = [0u8; 6];
        e.all_gather(Some(&[1, 2, 3, 4, 5, 6]), &mut out, 3, DType::BF16)
            .unwrap();
        assert_eq!(out, [1, 2, 3, 4, 5, 6]);
        e.all_gather(None, &mut out, 3, DType::BF16).unwrap();
        e.barrier().unwrap();
        // Wrong lengths are refused, naming the sizes.
        let err = e
            .all_gather(Some(&[1, 2, 3]), &mut out, 3, DType::BF16)
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::LengthMismatch {
                    expected: 6,
                    found: 3,
                    ..
                }
            ),
            "{err}"
        );
        let err = e
            .all_gather(None, &mut out, usize::MAX / 2 + 1, DType::BF16)
            .unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("overflows")),
            "{err}"
        );
        e.abort_handle().abort();
        assert!(matches!(e.barrier(), Err(Error::Aborted { .. })));
        assert!(matches!(e.barrier(), Err(Error::Aborted { .. })));
    }
}
