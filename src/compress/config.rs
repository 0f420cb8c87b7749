//! Compression settings: `CIERA_COMPRESS`, `CIERA_CACHE_MB`, `CIERA_CACHE_MODE`,
//! `CIERA_VERIFY`, `CIERA_COMPRESS_MIN_BYTES`, `CIERA_CODEC_THREADS`, and the per-call
//! overrides of [`GatherOptions`].

use crate::codec::CacheMode;
use crate::error::{Error, Result};
use crate::parse::{parse_size, parse_switch};

/// `CIERA_COMPRESS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompressMode {
    /// Compress where it pays (measured against raw calls of the same tensor).
    Auto,
    /// Always compress eligible calls.
    On,
    /// Never compress.
    Off,
}

impl CompressMode {
    /// How the modes are spelled, for messages.
    pub const SPELLINGS: &'static str = "auto, on or off";

    pub fn parse(s: &str) -> Option<CompressMode> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(CompressMode::Auto),
            "on" | "1" | "true" | "yes" => Some(CompressMode::On),
            "off" | "0" | "false" | "no" => Some(CompressMode::Off),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CompressMode::Auto => "auto",
            CompressMode::On => "on",
            CompressMode::Off => "off",
        }
    }
}

/// Compression settings of a communicator; [`CompressConfig::from_env`] reads the
/// environment.
#[derive(Clone, Debug)]
pub struct CompressConfig {
    pub mode: CompressMode,
    /// Memory all cache slots of a communicator may hold.
    pub cache_bytes: usize,
    /// Check a hash of every shard after decoding.
    pub verify: bool,
    /// Shards smaller than this go raw (latency-bound: nothing to win).
    pub min_shard_bytes: usize,
    /// Ask for one cache mode (`CIERA_CACHE_MODE=exp|full|delta`; it falls back to smaller
    /// caches when it does not fit the budget: delta, full values, exponents, raw); None
    /// (`auto`): the policy of `Compressor::mode_for` (delta caches when the ring crosses a
    /// network link, else full-value caches while they fit, else exponent caches).
    pub cache_mode: Option<CacheMode>,
    /// Threads that encode or decode one chunk's Delta frame (`CIERA_CODEC_THREADS`, 1 to
    /// `codec::MAX_CODEC_THREADS`); None (`auto`): this rank's share of the host's CPUs
    /// (`engine::cpu_share`), 1 where the ranks have a CPU or less each.
    pub codec_threads: Option<usize>,
}

pub const DEFAULT_CACHE_MB: usize = 4096;
pub const DEFAULT_MIN_SHARD_BYTES: usize = 64 << 10;

impl Default for CompressConfig {
    fn default() -> Self {
        CompressConfig {
            mode: CompressMode::Auto,
            cache_bytes: DEFAULT_CACHE_MB << 20,
            verify: false,
            min_shard_bytes: DEFAULT_MIN_SHARD_BYTES,
            cache_mode: None,
            codec_threads: None,
        }
    }
}

/// A cache budget of `mb` MiB in bytes, or None when that does not fit a `usize`.
pub fn cache_mb_to_bytes(mb: usize) -> Option<usize> {
    mb.checked_mul(1 << 20)
}

/// `CIERA_CACHE_MODE`: Some(None) for `auto`, Some(mode) for a mode, None if not a spelling.
fn parse_cache_mode(v: &str) -> Option<Option<CacheMode>> {
    match v.trim().to_ascii_lowercase().as_str() {
        "auto" => Some(None),
        "exp" | "exponent" => Some(Some(CacheMode::Exponent)),
        "full" | "value" | "full-value" => Some(Some(CacheMode::FullValue)),
        "delta" => Some(Some(CacheMode::Delta)),
        _ => None,
    }
}

/// `CIERA_CODEC_THREADS`: Some(None) for `auto`, Some(n) for 1..=MAX_CODEC_THREADS, None
/// otherwise.
fn parse_codec_threads(v: &str) -> Option<Option<usize>> {
    match v.trim().to_ascii_lowercase().as_str() {
        "auto" => Some(None),
        n => n
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=crate::codec::MAX_CODEC_THREADS).contains(n))
            .map(Some),
    }
}

fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

impl CompressConfig {
    pub fn from_env() -> Result<CompressConfig> {
        let mut c = CompressConfig::default();
        if let Some(v) = env_var("CIERA_COMPRESS") {
            c.mode = CompressMode::parse(&v).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "CIERA_COMPRESS={v:?}: expected {}",
                    CompressMode::SPELLINGS
                ))
            })?;
        }
        if let Some(v) = env_var("CIERA_CACHE_MB") {
            c.cache_bytes = v
                .trim()
                .parse::<usize>()
                .ok()
                .and_then(cache_mb_to_bytes)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "CIERA_CACHE_MB={v:?} is not a number of MiB this machine can address"
                    ))
                })?;
        }
        if let Some(v) = env_var("CIERA_VERIFY") {
            c.verify = parse_switch(&v).ok_or_else(|| {
                Error::InvalidArgument(format!("CIERA_VERIFY={v:?}: expected 0 or 1"))
            })?;
        }
        if let Some(v) = env_var("CIERA_CACHE_MODE") {
            c.cache_mode = parse_cache_mode(&v).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "CIERA_CACHE_MODE={v:?}: expected auto, exp, full or delta"
                ))
            })?;
        }
        if let Some(v) = env_var("CIERA_CODEC_THREADS") {
            c.codec_threads = parse_codec_threads(&v).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "CIERA_CODEC_THREADS={v:?}: expected auto or 1 to {}",
                    crate::codec::MAX_CODEC_THREADS
                ))
            })?;
        }
        if let Some(v) = env_var("CIERA_COMPRESS_MIN_BYTES") {
            c.min_shard_bytes = parse_size(&v).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "CIERA_COMPRESS_MIN_BYTES={v:?} is not a size (e.g. 64K)"
                ))
            })?;
        }
        Ok(c)
    }
}

/// How one call of the compressed Allgather runs ([`crate::comm::Communicator::all_gather_with`]).
/// Every rank must pass the same options for a call (like the count and type).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GatherOptions {
    /// Names the tensor (the same key every iteration for the same tensor), so the cache slot
    /// it compresses against is chosen by name; None: inferred from the buffer addresses.
    /// Results never depend on it.
    pub key: Option<u64>,
    /// This call's compression mode instead of the communicator's.
    pub compress: Option<CompressMode>,
    /// The cache mode of the slots this call creates, instead of the communicator's
    /// (a tensor keeps the mode it was first cached with).
    pub cache_mode: Option<CacheMode>,
    /// Where the caller's tensor really lives, when `send`/`recv` are staging copies of it
    /// (device memory staged through host buffers): an inferred key is taken from this
    /// address instead of the staging buffer's, so two tensors staged through the same host
    /// buffer keep their own caches.
    pub infer_addr: Option<u64>,
}

impl GatherOptions {
    /// Options that name the tensor `key` and change nothing else.
    pub fn keyed(key: Option<u64>) -> GatherOptions {
        GatherOptions {
            key,
            ..GatherOptions::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_cache_budgets_do_not_wrap() {
        assert_eq!(CompressMode::parse("ON"), Some(CompressMode::On));
        assert_eq!(CompressMode::parse("0"), Some(CompressMode::Off));
        assert_eq!(CompressMode::parse(""), Some(CompressMode::Auto));
        assert_eq!(CompressMode::parse("maybe"), None);
        assert_eq!(cache_mb_to_bytes(4096), Some(4096 << 20));
        assert_eq!(cache_mb_to_bytes(usize::MAX >> 10), None);
    }

    #[test]
    fn cache_modes_parse() {
        assert_eq!(parse_cache_mode("auto"), Some(None));
        assert_eq!(parse_cache_mode("exp"), Some(Some(CacheMode::Exponent)));
        assert_eq!(parse_cache_mode("Full"), Some(Some(CacheMode::FullValue)));
        assert_eq!(parse_cache_mode(" delta "), Some(Some(CacheMode::Delta)));
        assert_eq!(parse_cache_mode("zstd"), None);
    }

    #[test]
    fn codec_threads_parse() {
        assert_eq!(parse_codec_threads("auto"), Some(None));
        assert_eq!(parse_codec_threads(" 1 "), Some(Some(1)));
        assert_eq!(parse_codec_threads("8"), Some(Some(8)));
        assert_eq!(parse_codec_threads("0"), None);
        assert_eq!(parse_codec_threads("9"), None);
        assert_eq!(parse_codec_threads("many"), None);
    }
}
