//! What both LD_PRELOAD interposers (interpose/nccl, interpose/mpi) share.

use std::sync::{Mutex, OnceLock};

/// Whether an environment variable is set to 1 / true / yes.
pub fn env_flag(name: &str) -> bool {
    std::env::var(name)
        .map(|v| v == "1" || v.eq_ignore_ascii_case("true") || v.eq_ignore_ascii_case("yes"))
        .unwrap_or(false)
}

/// `CIERA_DISABLE=1`: the interposer passes every call through (read once per process).
pub fn disabled() -> bool {
    static DISABLED: OnceLock<bool> = OnceLock::new();
    *DISABLED.get_or_init(|| env_flag("CIERA_DISABLE"))
}

/// Print `prefix: msg` to stderr, as one write, the first time `reason` comes up in this
/// process.
pub fn log_once(prefix: &str, reason: &'static str, msg: impl FnOnce() -> String) {
    static SEEN: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if !seen.contains(&reason) {
        seen.push(reason);
        let line = format!("{prefix}: {}\n", msg());
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }
}

/// What an interposer knows about one communicator of the real library.
pub enum Twin {
    /// The CIERA communicator serving it.
    Serving(std::sync::Arc<super::live::LiveComm>),
    /// CIERA could not come up on every rank (the reason): all calls go to the real library.
    PassThrough(String),
}

/// Join the CIERA job whose unique id rank 0 broadcast through the real library: the
/// environment's configuration, this rank of `nranks`. Err: why not (every rank then agrees to
/// pass through).
pub fn join(
    id: &[u8; crate::comm::id::UNIQUE_ID_BYTES],
    nranks: usize,
    rank: usize,
) -> Result<std::sync::Arc<super::live::LiveComm>, String> {
    let id = crate::comm::UniqueId::from_bytes(id).map_err(|e| e.to_string())?;
    let config = crate::comm::Config::from_env().map_err(|e| e.to_string())?;
    super::live::LiveComm::init_rank(&id, nranks, rank, config).map_err(|f| f.message)
}
