//! Bootstrap, communicator and the executor that drives a schedule over the transport.
//!
//! - [`id`]: `UniqueId` (root address + job secret).
//! - [`bootstrap`]: the authenticated TCP rendezvous that exchanges transport addresses.
//! - [`env`](mod@env): `Communicator::from_env` — rank/size/root from mpirun, srun, torchrun, `ciera launch`.
//! - [`wire`]: message headers, segments, abort notices.
//! - [`payloads`]: where bytes live (raw user buffers, or codec frames: the [`FrameCodec`] hook).
//! - [`exec`]: the polling loop that moves a [`crate::algo::Progress`] forward over the links.

pub mod bootstrap;
pub mod env;
pub mod exec;
pub mod id;
pub mod payloads;
pub mod single_copy;
pub mod wire;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ciera_transport::{Endpoint, SingleCopy, TransportChoice, Waker};

use crate::algo::{self, Algo, AlgoChoice, Progress, Schedule};
use crate::error::{Error, Result};
use crate::DType;
use exec::{Exec, IdlePolicy, LinkRx, SendLane};
pub use id::UniqueId;
pub use payloads::{ChunkRef, FrameCodec};
use payloads::{FramedPayloads, Layout, Payloads, RawPayloads};
use single_copy::RefChooser;
use wire::{CallSig, Op};

pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
pub const DEFAULT_CHUNK_BYTES: usize = 1 << 20;
/// Last-level cache size assumed where sysfs does not say (see [`default_stream_min_bytes`]).
pub const DEFAULT_LLC_BYTES: usize = 32 << 20;

/// Default for [`Config::stream_min_bytes`]: the last-level cache divided among the ranks on
/// this host (their outputs share it), within 4 MiB to 256 MiB. Measured on the dev VM (32 MiB
/// L3, 2 CPUs, shm, 4 interleaved launches each): 2 ranks 8 MiB 266-404 µs plain vs 314-736
/// streamed, 16 MiB 963-1279 vs 675-1216, 32 MiB 2.77-3.49 vs 1.90-2.55 ms; 4 ranks 8 MiB
/// 1.96-2.27 ms plain vs 1.17-1.77 streamed. (A quarter of the cache whatever the rank count,
/// the earlier rule, streamed 2 ranks' 8 MiB calls.)
pub fn default_stream_min_bytes(local_ranks: usize) -> usize {
    static LLC: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let llc = *LLC.get_or_init(|| last_level_cache_bytes().unwrap_or(DEFAULT_LLC_BYTES));
    (llc / local_ranks.max(1)).clamp(4 << 20, 256 << 20)
}

/// The size of CPU 0's highest-level data or unified cache, from sysfs.
fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    let read = |p: &std::path::Path, f: &str| std::fs::read_to_string(p.join(f)).ok();
    dir.flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("index"))
        .filter_map(|e| {
            let p = e.path();
            if read(&p, "type")?.trim() == "Instruction" {
                return None;
            }
            let level: u32 = read(&p, "level")?.trim().parse().ok()?;
            Some((level, parse_cache_size(&read(&p, "size")?)?))
        })
        .max()
        .map(|(_, bytes)| bytes)
}

/// A sysfs cache size: `32768K`, `1M`, or plain bytes.
fn parse_cache_size(s: &str) -> Option<usize> {
    crate::cli::args::parse_size(s.trim())
}

/// How a communicator behaves. `Config::default()` is what `from_env` gives with nothing set.
#[derive(Clone, Debug)]
pub struct Config {
    /// How long any wait (a peer's data, a bootstrap step) may make no progress before it
    /// fails with `Error::Timeout` naming the rank waited for. `CIERA_TIMEOUT` (seconds).
    pub timeout: Duration,
    /// `CIERA_TRANSPORT=auto|shm|tcp`.
    pub transport: TransportChoice,
    /// `CIERA_ALGO=auto|ring|rd|bruck`.
    pub algo: AlgoChoice,
    /// Pipelining unit: a block is cut in chunks of this many bytes (rounded down to whole
    /// elements). `CIERA_CHUNK_BYTES` (K/M/G suffixes).
    pub chunk_bytes: usize,
    /// How long an idle rank spins, then yields, before sleeping in the transport. None: chosen
    /// from the number of ranks on this host versus its CPUs. `CIERA_SPIN_US`/`CIERA_YIELD_US`.
    pub idle: Option<IdlePolicy>,
    /// Calls whose output is at least this big copy into it with non-temporal stores (own
    /// shard, and out of the shm rings): see `ciera_transport::copy`.
    /// `CIERA_STREAM_MIN_BYTES` (K/M/G suffixes; 0 = always); None:
    /// [`default_stream_min_bytes`] for the number of ranks on this host.
    pub stream_min_bytes: Option<usize>,
    /// Large raw segments to shm peers: through the rings, by reference, or measured per call
    /// size (`CIERA_SHM_SINGLE_COPY=0|1|auto`; see [`single_copy`]). `0` in the environment
    /// also keeps the transport from setting single copy up at all.
    pub single_copy: SingleCopy,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            timeout: DEFAULT_TIMEOUT,
            transport: TransportChoice::Auto,
            algo: AlgoChoice::Auto,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            idle: None,
            stream_min_bytes: None,
            single_copy: SingleCopy::Auto,
        }
    }
}

impl Config {
    pub fn from_env() -> Result<Config> {
        let mut c = Config::default();
        if let Some(v) = env::real_env("CIERA_TIMEOUT") {
            let secs: f64 = v
                .trim()
                .parse()
                .ok()
                .filter(|s: &f64| *s > 0.0 && s.is_finite())
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "CIERA_TIMEOUT={v:?} is not a positive number of seconds"
                    ))
                })?;
            c.timeout = Duration::from_secs_f64(secs);
        }
        c.transport = TransportChoice::from_env()
            .map_err(|e| Error::InvalidArgument(format!("CIERA_TRANSPORT: {e}")))?;
        if let Some(v) = env::real_env("CIERA_ALGO") {
            c.algo = AlgoChoice::parse(&v).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "CIERA_ALGO={v:?}: expected auto, ring, rd or bruck"
                ))
            })?;
        }
        c.single_copy =
            SingleCopy::from_env().map_err(|e| Error::InvalidArgument(e.to_string()))?;
        if let Some(v) = env::real_env("CIERA_STREAM_MIN_BYTES") {
            c.stream_min_bytes = Some(crate::cli::args::parse_size(&v).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "CIERA_STREAM_MIN_BYTES={v:?} is not a size (e.g. 8M)"
                ))
            })?);
        }
        if let Some(v) = env::real_env("CIERA_CHUNK_BYTES") {
            c.chunk_bytes = crate::cli::args::parse_size(&v)
                .filter(|&n| n > 0 && n <= u32::MAX as usize)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "CIERA_CHUNK_BYTES={v:?} is not a size (e.g. 512K, 1M)"
                    ))
                })?;
        }
        let us = |name: &str| -> Result<Option<Duration>> {
            env::real_env(name)
                .map(|v| {
                    v.trim()
                        .parse::<u64>()
                        .map(Duration::from_micros)
                        .map_err(|_| {
                            Error::InvalidArgument(format!(
                                "{name}={v:?} is not a number of microseconds"
                            ))
                        })
                })
                .transpose()
        };
        let (spin, yld) = (us("CIERA_SPIN_US")?, us("CIERA_YIELD_US")?);
        if spin.is_some() || yld.is_some() {
            let auto = idle_policy(false);
            c.idle = Some(IdlePolicy {
                spin: spin.unwrap_or(auto.spin),
                yield_while_spinning: auto.yield_while_spinning,
                yield_for: yld.unwrap_or(auto.yield_for),
                max_sleep: auto.max_sleep,
            });
        }
        Ok(c)
    }
}

/// Spin while this host has a CPU for every local rank; when oversubscribed, never spin (a
/// spinning rank steals the CPU from the peer it waits for) but yield, which hands the CPU to
/// that peer when it shares our run queue; sleep in the transport once yielding has not helped
/// for a while. Measured on the 2-core dev VM, 4 ranks: spinning 20 us tripled the 8-byte
/// latency; going straight to a futex sleep made it 8x worse (wake-ups are slow in a VM).
/// A rank bound to one CPU (`ciera launch`, mpirun) spins without yielding: yielding there only
/// hands the CPU to other jobs. An unbound one yields every 20 us while spinning, in case the
/// scheduler stacked it on the CPU of the peer it waits for.
fn idle_policy(oversubscribed: bool) -> IdlePolicy {
    if !oversubscribed {
        IdlePolicy {
            spin: Duration::from_micros(500),
            yield_while_spinning: !bound_to_one_cpu(),
            yield_for: Duration::from_millis(2),
            max_sleep: Duration::from_millis(5),
        }
    } else {
        IdlePolicy {
            spin: Duration::ZERO,
            yield_while_spinning: true,
            yield_for: Duration::from_millis(1),
            max_sleep: Duration::from_millis(5),
        }
    }
}

/// Whether this host runs more of the job's ranks than the CPUs they may use. For a rank that
/// is free to move, `available_parallelism` (its CPU set, and the container's CPU quota); for a
/// rank bound to one CPU (a launcher gave each rank a CPU of its own) that says 1, so the CPUs
/// online count instead (until 2026-12-02 every bound 2-rank job counted as oversubscribed and
/// never spun). A job whose ranks all share one CPU by hand is the case this misjudges.
pub fn oversubscribed(local_ranks: usize) -> bool {
    let available = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cpus = if bound_to_one_cpu() {
        // SAFETY: sysconf has no memory-safety preconditions.
        let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        usize::try_from(online).unwrap_or(0).max(available)
    } else {
        available
    };
    local_ranks > cpus
}

/// Whether this process may run on one CPU only.
fn bound_to_one_cpu() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("Cpus_allowed_list:")
                    .map(|v| v.trim().to_string())
            })
        })
        .is_some_and(|list| !list.contains(',') && !list.contains('-'))
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

/// A group of `size()` ranks (processes) that run collectives together.
pub struct Communicator {
    rank: usize,
    nranks: usize,
    config: Config,
    /// None for a single rank, and after a failure that could not notify every peer.
    ep: Option<Endpoint>,
    rx: Vec<LinkRx>,
    lanes: Vec<SendLane>,
    frames: Vec<Vec<u8>>,
    /// Schedules are cheap, but rebuilding one per call is wasted work for repeated shapes.
    cached: Option<(Algo, usize, Progress)>,
    seq: u64,
    broken: Option<String>,
    abort: Arc<AbortShared>,
    idle: IdlePolicy,
    /// `Config::stream_min_bytes`, resolved.
    stream_min_bytes: usize,
    /// Below this many gathered bytes `Auto` picks RD/Bruck: lower when every link is shm.
    /// Every rank derives it the same way (all shm on one host; some TCP link on several).
    small_call_bytes: usize,
    /// Whether each call's large raw segments go to shm peers by reference.
    refs: RefChooser,
}

impl Communicator {
    /// Join the job `id` as `rank` of `nranks` (every rank passes the same id and nranks).
    pub fn init_rank(
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        config: Config,
    ) -> Result<Communicator> {
        if nranks == 0 || rank >= nranks {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} is out of range for nranks={nranks}"
            )));
        }
        let root = id.root();
        let secret = id.secret();
        let mut source = || Ok(Some((vec![root], secret)));
        Communicator::bootstrap(&mut source, nranks, rank, config, Instant::now())
    }

    /// Rank, size and rendezvous from the launcher's environment; see [`env`](mod@env) for what is
    /// read and what happens when the secret or root address is absent.
    pub fn from_env(config: Config) -> Result<Communicator> {
        let launch = env::LaunchEnv::detect(&env::real_env)?;
        if launch.nranks == 1 {
            return Ok(Communicator::single(config));
        }
        let started = Instant::now();
        let deadline = started + config.timeout;
        match env::rendezvous(&env::real_env, &launch)? {
            env::Rendezvous::Address {
                addr,
                secret,
                serve_port,
            } => {
                if let Some(port) = serve_port {
                    let at = bootstrap::root_listen_addr(&addr, port, launch.single_host)?;
                    let listener = bootstrap::bind_root(at)?;
                    bootstrap::spawn_root(
                        listener,
                        secret,
                        bootstrap::RootMode::Once,
                        id::round_timeout(config.timeout),
                    )?;
                }
                let mut source = || Ok(Some((env::resolve(&addr)?, secret)));
                Communicator::bootstrap(&mut source, launch.nranks, launch.rank, config, started)
            }
            env::Rendezvous::File { path, secret } => {
                if launch.rank == 0 {
                    let secret = match secret {
                        Some(s) => s,
                        None => id::random_secret()?,
                    };
                    let uid = UniqueId::with_secret(secret)?;
                    env::publish_id(&path, &uid)?;
                    let result = Communicator::init_rank(&uid, launch.nranks, 0, config);
                    let _ = std::fs::remove_file(&path);
                    result
                } else {
                    let mut source = || -> Result<Option<(Vec<std::net::SocketAddr>, [u8; 32])>> {
                        Ok(env::read_id(&path)?.map(|id| (vec![id.root()], id.secret())))
                    };
                    // Wait for the file first so the error says what was missing.
                    env::wait_for_id(&path, deadline)?;
                    Communicator::bootstrap(
                        &mut source,
                        launch.nranks,
                        launch.rank,
                        config,
                        started,
                    )
                }
            }
        }
    }

    fn single(config: Config) -> Communicator {
        Communicator::assemble(0, 1, config, None, 1, None)
    }

    fn bootstrap(
        source: &mut bootstrap::RootSource<'_>,
        nranks: usize,
        rank: usize,
        config: Config,
        started: Instant,
    ) -> Result<Communicator> {
        let deadline = started + config.timeout;
        let ip = ciera_transport::interface_ip().map_err(|e| {
            Error::Bootstrap(format!("rank {rank}: choosing a network interface: {e}"))
        })?;
        let mut ep = Endpoint::bind(ip).map_err(|e| {
            Error::Bootstrap(format!(
                "rank {rank}: binding the transport endpoint on {ip}: {e}"
            ))
        })?;
        let me = ep.local_info();
        let (table, secret) = bootstrap::join(source, nranks, rank, &me, deadline)?;
        if nranks == 1 {
            return Ok(Communicator::assemble(rank, nranks, config, None, 1, None));
        }
        ep.connect_all(rank, &table, &secret, config.transport, deadline)
            .map_err(|e| {
                Error::Bootstrap(format!(
                    "rank {rank}: connecting to the other {} ranks: {e}",
                    nranks - 1
                ))
            })?;
        let local = table.iter().filter(|p| p.host_id == me.host_id).count();
        let waker = ep.waker();
        Ok(Communicator::assemble(
            rank,
            nranks,
            config,
            Some(ep),
            local,
            Some(waker),
        ))
    }

    fn assemble(
        rank: usize,
        nranks: usize,
        config: Config,
        mut ep: Option<Endpoint>,
        local_ranks: usize,
        waker: Option<Waker>,
    ) -> Communicator {
        let oversubscribed = oversubscribed(local_ranks);
        let stream_min_bytes = config
            .stream_min_bytes
            .unwrap_or_else(|| default_stream_min_bytes(local_ranks));
        let idle = config.idle.unwrap_or_else(|| idle_policy(oversubscribed));
        let all_shm = match &mut ep {
            Some(ep) => (0..nranks)
                .filter(|&p| p != rank)
                .all(|p| ep.link(p).kind() == ciera_transport::Kind::Shm),
            None => false,
        };
        Communicator {
            rank,
            nranks,
            // Auto measures only where every rank has a CPU: sharing CPUs, a receiver must be
            // scheduled before its sender's call can end, and references measured 0.8x of the
            // rings (4 ranks on the 2-core VM; same-run alternation, 1-64 MiB).
            refs: RefChooser::new(match config.single_copy {
                SingleCopy::Auto if oversubscribed => SingleCopy::Off,
                policy => policy,
            }),
            config,
            ep,
            rx: (0..nranks).map(|_| LinkRx::new()).collect(),
            lanes: Vec::new(),
            frames: Vec::new(),
            cached: None,
            seq: 0,
            broken: None,
            abort: Arc::new(AbortShared {
                flag: AtomicBool::new(false),
                waker,
            }),
            idle,
            stream_min_bytes,
            small_call_bytes: if all_shm {
                algo::SMALL_CALL_BYTES_SHM
            } else {
                algo::SMALL_CALL_BYTES
            },
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.nranks
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Payload bytes this rank let same-host peers copy straight out of its memory
    /// (single-copy shm, `CIERA_SHM_SINGLE_COPY`) instead of writing them into a ring.
    pub fn single_copy_bytes(&self) -> u64 {
        self.ep.as_ref().map_or(0, |ep| ep.offered_bytes())
    }

    /// A zeroed [`SharedBuffer`] of `len` bytes: memory same-host peers copy out of without
    /// a system call when it is a collective's send (or in-place) buffer. An allocation
    /// failure is [`Error::Io`] naming the size.
    ///
    /// [`SharedBuffer`]: crate::SharedBuffer
    pub fn alloc_shared(len: usize) -> Result<crate::SharedBuffer> {
        crate::SharedBuffer::new(len).map_err(|e| Error::Io {
            what: format!("allocating a shared buffer of {len} bytes"),
            source: match e {
                ciera_transport::TransportError::Io { source, .. } => source,
                other => std::io::Error::other(other.to_string()),
            },
        })
    }

    /// Payload bytes this rank copied out of same-host peers' [`SharedBuffer`]s through its
    /// own mappings of them (single copy with no system call).
    ///
    /// [`SharedBuffer`]: crate::SharedBuffer
    pub fn shared_read_bytes(&self) -> u64 {
        self.ep.as_ref().map_or(0, |ep| ep.mapped_bytes())
    }

    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            shared: self.abort.clone(),
        }
    }

    /// The algorithm a call gathering `count` elements of `dtype` per rank will use.
    pub fn algo_for(&self, count: usize, dtype: DType) -> Algo {
        self.config.algo.resolve_with(
            self.nranks,
            count * dtype.size() * self.nranks,
            self.small_call_bytes,
        )
    }

    /// Gather every rank's `send` (`count` elements of `dtype`) into `recv`, rank r's at
    /// element r*count. `send.len() == count*dtype.size()`, `recv.len() == size()*send.len()`.
    pub fn all_gather(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        self.all_gather_raw(Some(send), recv, count, dtype)
    }

    /// As [`Communicator::all_gather`], in place: this rank's shard is already at
    /// `recv[rank*count*size..]`.
    pub fn all_gather_in_place(
        &mut self,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        self.all_gather_raw(None, recv, count, dtype)
    }

    /// [`Communicator::all_gather`] (`send` Some) or [`Communicator::all_gather_in_place`]
    /// (`send` None).
    pub fn all_gather_raw(
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

    /// Allgather through a frame codec: this rank's chunks are encoded by `codec` into frames
    /// of any length, frames travel (and are forwarded unchanged) instead of raw bytes, and
    /// every received frame is decoded into `recv`. `send` is None for in place. Every rank
    /// must use the same codec format (checked: `CallMismatch` otherwise).
    pub fn all_gather_framed(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        codec: &mut dyn FrameCodec,
    ) -> Result<()> {
        let Some(layout) = self.begin_all_gather(send, recv, count, dtype)? else {
            return Ok(());
        };
        let mut frames = std::mem::take(&mut self.frames);
        let payloads = FramedPayloads::new(layout, dtype, send, recv, codec, &mut frames);
        let r = self.execute(Op::AllGather, layout, dtype, payloads);
        self.frames = frames;
        r
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&mut self) -> Result<()> {
        self.start_call()?;
        if self.nranks == 1 {
            return Ok(());
        }
        let layout = Layout::new(
            self.rank,
            self.nranks,
            0,
            DType::U8,
            self.config.chunk_bytes,
        );
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
        self.check_lengths(send.map(|s| s.len()), recv.len(), count, dtype)?;
        self.start_call()?;
        if self.nranks == 1 {
            if let Some(send) = send {
                recv.copy_from_slice(send);
            }
            return Ok(None);
        }
        Ok(Some(Layout::new(
            self.rank,
            self.nranks,
            count,
            dtype,
            self.config.chunk_bytes,
        )))
    }

    fn check_lengths(
        &self,
        send: Option<usize>,
        recv: usize,
        count: usize,
        dtype: DType,
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
        let total = block.checked_mul(self.nranks).ok_or_else(|| {
            Error::InvalidArgument(format!("count {count} x {} ranks overflows", self.nranks))
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
        let total = layout.block_bytes() * self.nranks;
        let streaming = total >= self.stream_min_bytes;
        payloads.set_streaming(streaming);
        let algo = if op == Op::Barrier {
            self.config
                .algo
                .resolve_with(self.nranks, 0, self.small_call_bytes)
        } else {
            self.config
                .algo
                .resolve_with(self.nranks, total, self.small_call_bytes)
        };
        let own_ready = payloads.own_ready();
        let progress = match &mut self.cached {
            Some((a, n, p)) if *a == algo && *n == layout.nchunks => {
                p.reset(own_ready);
                p
            }
            slot => {
                let s = Schedule::new(algo, self.rank, self.nranks, layout.nchunks);
                &mut slot
                    .insert((algo, layout.nchunks, Progress::new(&s, own_ready)))
                    .2
            }
        };
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
        // always go by reference (see `exec::cut_segment`).
        let measured = payloads.stable_bytes()
            && layout.block_bytes() >= exec::REF_MIN
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
            nranks: self.nranks,
            timeout: self.config.timeout,
            idle: self.idle,
            refs,
            abort: &self.abort.flag,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sizes_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("1M"), Some(1 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size(""), None);
        assert_eq!(parse_cache_size("x12K"), None);
        for local in [0, 1, 2, 4, 1000] {
            let d = default_stream_min_bytes(local);
            assert!((4 << 20..=256 << 20).contains(&d), "{local} ranks: {d}");
        }
        // More ranks sharing the cache: never a higher threshold.
        assert!(default_stream_min_bytes(4) <= default_stream_min_bytes(2));
    }

    #[test]
    fn handles_cross_threads() {
        fn send_sync<T: Send + Sync + Clone>() {}
        fn send<T: Send>() {}
        send_sync::<AbortHandle>();
        send::<Communicator>();
    }

    #[test]
    fn single_rank_gathers_its_own_shard() {
        let mut c = Communicator::single(Config::default());
        let mut out = [0u8; 6];
        c.all_gather(&[1, 2, 3, 4, 5, 6], &mut out, 3, DType::BF16)
            .unwrap();
        assert_eq!(out, [1, 2, 3, 4, 5, 6]);
        c.all_gather_in_place(&mut out, 3, DType::BF16).unwrap();
        c.barrier().unwrap();
        // Wrong lengths are refused, naming the sizes.
        let e = c
            .all_gather(&[1, 2, 3], &mut out, 3, DType::BF16)
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::LengthMismatch {
                    expected: 6,
                    found: 3,
                    ..
                }
            ),
            "{e}"
        );
        c.abort_handle().abort();
        assert!(matches!(c.barrier(), Err(Error::Aborted { .. })));
        assert!(matches!(c.barrier(), Err(Error::Aborted { .. })));
    }
}
