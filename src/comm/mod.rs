//! The communicator: a group of ranks (processes) that run collectives together. It joins the
//! job (bootstrap), owns the engine that moves bytes over its links and the compression policy
//! that decides, per call, raw or compressed; every caller (the C ABI, the interposers, the
//! CLI) is a thin layer over [`Communicator`].
//!
//! - [`id`]: `UniqueId` (root address + job secret).
//! - [`bootstrap`]: the authenticated TCP rendezvous that exchanges transport addresses.
//! - [`env`](mod@env): `Communicator::from_env` — rank/size/root from mpirun, srun, torchrun,
//!   `ciera launch`.
//! - [`config`]: [`Config`], from the environment.
#![forbid(unsafe_code)]

pub mod bootstrap;
pub mod config;
pub mod env;
pub mod id;

use std::time::Instant;

use ciera_transport::Endpoint;

use crate::algo::{Algo, Topology};
use crate::codec::CacheMode;
use crate::compress::{
    CallReport, CompressMode, Compressor, GatherOptions, SlotKey, SlotStats, Stats,
};
use crate::engine::Engine;
pub use crate::engine::{oversubscribed, AbortHandle, ChunkRef, FrameCodec, FrameEncoder};
use crate::error::{Error, Result};
use crate::DType;
pub use config::{Config, DEFAULT_CHUNK_BYTES, DEFAULT_TIMEOUT};
pub use id::UniqueId;

/// A group of `size()` ranks (processes) that run collectives together.
pub struct Communicator {
    config: Config,
    engine: Engine,
    compress: Compressor,
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

    /// A communicator of one rank: every collective returns at once (an allgather copies).
    pub fn single(config: Config) -> Communicator {
        Communicator::assemble(0, Topology::single_host(1), config, None)
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
        let mut me = ep.local_info();
        if let Some(l) = config.ranks_per_host {
            // Simulated hosts: every rank says which one it is on; the table decides links.
            me.host_id = format!("{}/sim-host-{}", me.host_id, rank / l);
        }
        let (table, secret) = bootstrap::join(source, nranks, rank, &me, deadline)?;
        if nranks == 1 {
            return Ok(Communicator::single(config));
        }
        ep.connect_all(rank, &table, &secret, config.transport, deadline)
            .map_err(|e| {
                Error::Bootstrap(format!(
                    "rank {rank}: connecting to the other {} ranks: {e}",
                    nranks - 1
                ))
            })?;
        // Ranks on one host talk through shared memory unless the job asked for TCP (every
        // rank reads the same table and setting, so every rank builds the same topology).
        let shm_within_host = (0..nranks)
            .filter(|&p| p != rank && table[p].host_id == me.host_id)
            .all(|p| ep.link(p).kind() == ciera_transport::Kind::Shm);
        let tcp = (0..nranks).any(|p| p != rank && ep.link(p).kind() == ciera_transport::Kind::Tcp);
        let hosts: Vec<&str> = table.iter().map(|p| p.host_id.as_str()).collect();
        let topology = Topology::new(&hosts, shm_within_host);
        // After `assemble`: its compressor installs the CIERA_DEBUG subscriber.
        let comm = Communicator::assemble(rank, topology, config, Some(ep));
        if tcp {
            hint_tcp_slow_start(rank);
        }
        Ok(comm)
    }

    fn assemble(
        rank: usize,
        topology: Topology,
        config: Config,
        ep: Option<Endpoint>,
    ) -> Communicator {
        let engine = Engine::new(rank, topology, config.engine_settings(), ep);
        Communicator {
            compress: Compressor::new(config.compress.clone()),
            engine,
            config,
        }
    }

    pub fn rank(&self) -> usize {
        self.engine.rank()
    }

    pub fn size(&self) -> usize {
        self.engine.size()
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Which host every rank is on, and the class of link between any two.
    pub fn topology(&self) -> &Topology {
        self.engine.topology()
    }

    pub fn abort_handle(&self) -> AbortHandle {
        self.engine.abort_handle()
    }

    /// Payload bytes this rank let same-host peers copy straight out of its memory
    /// (single-copy shm, `CIERA_SHM_SINGLE_COPY`) instead of writing them into a ring.
    pub fn single_copy_bytes(&self) -> u64 {
        self.engine.single_copy_bytes()
    }

    /// Payload bytes this rank copied out of same-host peers' [`SharedBuffer`]s through its
    /// own mappings of them (single copy with no system call).
    ///
    /// [`SharedBuffer`]: crate::mem::SharedBuffer
    pub fn shared_read_bytes(&self) -> u64 {
        self.engine.shared_read_bytes()
    }

    /// A zeroed [`SharedBuffer`] of `len` bytes (see [`crate::mem::alloc_shared`]).
    ///
    /// [`SharedBuffer`]: crate::mem::SharedBuffer
    pub fn alloc_shared(len: usize) -> Result<crate::mem::SharedBuffer> {
        crate::mem::alloc_shared(len)
    }

    /// The algorithm a call gathering `count` elements of `dtype` per rank will use.
    pub fn algo_for(&self, count: usize, dtype: DType) -> Algo {
        self.engine.algo_for(count, dtype)
    }

    // ---- the compressed Allgather -------------------------------------------------------

    /// The CIERA Allgather: every rank's shard (`count` elements of `dtype`) into `recv`, rank
    /// r's at element r*count, compressed against the caches where the policy says it pays
    /// (`Config::compress`). `send` is this rank's shard, None when it is already in `recv`
    /// (in place). `key` names the tensor (the same key every iteration for the same tensor)
    /// so the cache slot is chosen by name; None infers it from the buffer addresses. The
    /// result is bit for bit the same whatever the policy and the key decide.
    pub fn all_gather_keyed(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        key: Option<u64>,
    ) -> Result<CallReport> {
        self.all_gather_with(send, recv, count, dtype, &GatherOptions::keyed(key))
    }

    /// [`Communicator::all_gather_keyed`] with per-call options (the key, and this call's
    /// compression and cache mode instead of the communicator's). Every rank must pass the
    /// same options for a call.
    pub fn all_gather_with(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        opts: &GatherOptions,
    ) -> Result<CallReport> {
        self.compress
            .all_gather(&mut self.engine, send, recv, count, dtype, opts)
    }

    /// What the compressed Allgather did on this communicator so far.
    pub fn compress_stats(&self) -> Stats {
        self.compress.stats()
    }

    /// Per-tensor statistics, in no particular order.
    pub fn slot_stats(&self) -> Vec<(SlotKey, CacheMode, SlotStats)> {
        self.compress.slot_stats()
    }

    /// Forget every cache (e.g. after the application changed all weights out of band); the
    /// next call of each tensor refills. Every rank must do it at the same point.
    pub fn reset_caches(&mut self) {
        self.compress.reset();
    }

    /// The compression mode calls get unless their options say otherwise.
    pub fn compress_mode(&self) -> CompressMode {
        self.compress.config.mode
    }

    // ---- raw collectives -----------------------------------------------------------------

    /// Gather every rank's `send` (`count` elements of `dtype`) into `recv`, rank r's at
    /// element r*count, uncompressed (no cache is touched; checked end to end with
    /// `CIERA_VERIFY`). `send.len() == count*dtype.size()`, `recv.len() == size()*send.len()`.
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
        self.compress
            .all_gather_uncompressed(&mut self.engine, send, recv, count, dtype)
    }

    /// Allgather through a codec of the caller's (the engine's hook; the compressed Allgather
    /// above uses it with CIERA's frames): `encoder` encodes this rank's chunks on the
    /// engine's worker, frames travel and are forwarded unchanged, `codec` decodes every
    /// received frame into `recv`. Every rank must use the same codec format.
    pub fn all_gather_framed(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        encoder: &mut dyn FrameEncoder,
        codec: &mut dyn FrameCodec,
    ) -> Result<()> {
        self.engine
            .all_gather_framed(send, recv, count, dtype, encoder, codec)
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&mut self) -> Result<()> {
        self.engine.barrier()
    }
}

/// Linux restarts a TCP connection's congestion window from scratch after it has been idle for
/// a retransmission timeout (`net.ipv4.tcp_slow_start_after_idle`, on by default), so every
/// Allgather after a compute phase starts slow. Measured here (bench/netns_nodes.sh, 2 nodes x
/// 1 rank, 64 MiB raw at 2.5 Gbit/s): 167 ms with it on, 133 ms off. Says so once per process
/// at INFO.
fn hint_tcp_slow_start(rank: usize) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let on = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_slow_start_after_idle")
            .is_ok_and(|v| v.trim() == "1");
        if on {
            tracing::info!(
                rank,
                "TCP links restart slow after each idle gap (net.ipv4.tcp_slow_start_after_idle=1): \
                 `sysctl -w net.ipv4.tcp_slow_start_after_idle=0` (per network namespace) makes \
                 every Allgather start at full window"
            );
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_cross_threads() {
        fn send_sync<T: Send + Sync + Clone>() {}
        fn send<T: Send>() {}
        send_sync::<AbortHandle>();
        send::<Communicator>();
    }

    #[test]
    fn a_single_rank_gathers_through_the_policy_and_counts_the_call() {
        // The raw paths and the abort handle of one rank are the engine's tests.
        let mut c = Communicator::single(Config::default());
        let mut out = [0u8; 6];
        let r = c
            .all_gather_keyed(Some(&[6, 5, 4, 3, 2, 1]), &mut out, 3, DType::BF16, Some(7))
            .unwrap();
        assert_eq!(out, [6, 5, 4, 3, 2, 1]);
        assert_eq!((r.raw_bytes, r.wire_bytes, r.compressed()), (6, 6, false));
        let s = c.compress_stats();
        assert_eq!((s.calls, s.raw_calls, s.raw_bytes), (1, 1, 6));
    }
}
