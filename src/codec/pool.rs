//! The codec's threads: one process-wide rayon pool that a chunk's Delta groups are split over,
//! to encode or to decode, when its slot allows more than one thread
//! (`CacheSlot::set_codec_threads`). The thread that codes the chunk takes the first part
//! itself; the pool's threads sleep while nothing is asked of them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The most threads one encode or decode uses, its own included.
pub const MAX_CODEC_THREADS: usize = 8;

/// The pool: as many threads as this process may run at once (its CPU affinity), less the
/// caller's, at most `MAX_CODEC_THREADS - 1` and at least one.
pub(super) fn coders() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        rayon::ThreadPoolBuilder::new()
            .num_threads(cores.clamp(2, MAX_CODEC_THREADS) - 1)
            .thread_name(|i| format!("ciera-coder-{i}"))
            .build()
            .expect("the codec's threads")
    })
}

static SPLIT: AtomicU64 = AtomicU64::new(0);

/// One chunk's Delta frame was encoded or decoded on more than one thread.
pub(super) fn count_split() {
    SPLIT.fetch_add(1, Ordering::Relaxed);
}

/// How many chunks' Delta frames this process encoded or decoded on more than one thread.
pub fn split_codings() -> u64 {
    SPLIT.load(Ordering::Relaxed)
}
