//! How a communicator behaves: one [`Config`] for the transport, the engine and the
//! compression policy. `Config::default()` is what `from_env` gives with nothing set; the C ABI
//! overrides fields from its `cieraConfig_t`.

use std::time::Duration;

use ciera_transport::{SingleCopy, TransportChoice};

use super::env;
use crate::algo::AlgoChoice;
use crate::compress::CompressConfig;
use crate::engine::{idle_policy, IdlePolicy, Settings};
use crate::error::{Error, Result};
use crate::parse::{parse_seconds, parse_size, MAX_WAIT};

pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
pub const DEFAULT_CHUNK_BYTES: usize = 1 << 20;

/// How a communicator behaves.
#[derive(Clone, Debug)]
pub struct Config {
    /// How long any wait (a peer's data, a bootstrap step) may make no progress before it
    /// fails with `Error::Timeout` naming the rank waited for. `CIERA_TIMEOUT` (seconds, at
    /// most a year).
    pub timeout: Duration,
    /// `CIERA_TRANSPORT=auto|shm|tcp`.
    pub transport: TransportChoice,
    /// `CIERA_ALGO=auto|ring|rd|bruck|direct`.
    pub algo: AlgoChoice,
    /// Pipelining unit: a block is cut in chunks of this many bytes (rounded down to whole
    /// elements). `CIERA_CHUNK_BYTES` (K/M/G suffixes).
    pub chunk_bytes: usize,
    /// How long an idle rank spins, then yields, before sleeping in the transport. None: chosen
    /// from the number of ranks on this host versus its CPUs. `CIERA_SPIN_US`/`CIERA_YIELD_US`.
    pub idle: Option<IdlePolicy>,
    /// Calls whose output is at least this big copy into it with non-temporal stores (own
    /// shard, and out of the shm rings): see `ciera_transport::copy`.
    /// `CIERA_STREAM_MIN_BYTES` (K/M/G suffixes; 0 = always); None: the last-level cache
    /// divided by the ranks on this host.
    pub stream_min_bytes: Option<usize>,
    /// Large raw segments to shm peers: through the rings, by reference, or measured per call
    /// size (`CIERA_SHM_SINGLE_COPY=0|1|auto`; see `engine::single_copy`). `0` in the
    /// environment also keeps the transport from setting single copy up at all.
    pub single_copy: SingleCopy,
    /// The compression policy (`CIERA_COMPRESS`, `CIERA_CACHE_MB`, ...).
    pub compress: CompressConfig,
    /// `CIERA_RANKS_PER_HOST=L`: count every L consecutive ranks as one host, within what the
    /// machines say (ranks on different real hosts stay apart). For trying hierarchical
    /// schedules on one machine: ranks of different such hosts talk TCP. None: the hosts as
    /// they are.
    pub ranks_per_host: Option<usize>,
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
            compress: CompressConfig::default(),
            ranks_per_host: None,
        }
    }
}

impl Config {
    /// The defaults, overridden by every `CIERA_*` variable that is set. A value that does not
    /// parse is an `InvalidArgument` naming the variable and what it may be.
    pub fn from_env() -> Result<Config> {
        let mut c = Config::default();
        if let Some(v) = env::real_env("CIERA_TIMEOUT") {
            c.timeout = parse_seconds(&v).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "CIERA_TIMEOUT={v:?} is not a positive number of seconds (at most {})",
                    MAX_WAIT.as_secs()
                ))
            })?;
        }
        c.transport = TransportChoice::from_env()
            .map_err(|e| Error::InvalidArgument(format!("CIERA_TRANSPORT: {e}")))?;
        if let Some(v) = env::real_env("CIERA_ALGO") {
            c.algo = AlgoChoice::parse(&v).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "CIERA_ALGO={v:?}: expected {}",
                    AlgoChoice::SPELLINGS
                ))
            })?;
        }
        c.single_copy =
            SingleCopy::from_env().map_err(|e| Error::InvalidArgument(e.to_string()))?;
        if let Some(v) = env::real_env("CIERA_STREAM_MIN_BYTES") {
            c.stream_min_bytes = Some(parse_size(&v).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "CIERA_STREAM_MIN_BYTES={v:?} is not a size (e.g. 8M)"
                ))
            })?);
        }
        if let Some(v) = env::real_env("CIERA_CHUNK_BYTES") {
            c.chunk_bytes = parse_size(&v)
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
                        .ok()
                        .map(Duration::from_micros)
                        .filter(|d| *d <= MAX_WAIT)
                        .ok_or_else(|| {
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
        c.compress = CompressConfig::from_env()?;
        if let Some(v) = env::real_env("CIERA_RANKS_PER_HOST") {
            c.ranks_per_host = Some(
                v.trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|&l| l > 0)
                    .ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "CIERA_RANKS_PER_HOST={v:?} is not a positive number of ranks"
                        ))
                    })?,
            );
        }
        Ok(c)
    }

    /// What the engine takes of it.
    pub(super) fn engine_settings(&self) -> Settings {
        Settings {
            timeout: self.timeout,
            algo: self.algo,
            chunk_bytes: self.chunk_bytes,
            idle: self.idle,
            stream_min_bytes: self.stream_min_bytes,
            single_copy: self.single_copy,
        }
    }
}
