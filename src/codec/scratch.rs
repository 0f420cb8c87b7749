//! The coding temporaries of a thread, reused call after call.

/// Reusable buffers for the coding temporaries: tensors are coded every iteration, and fresh
/// multi-megabyte allocations would page-fault their way through every call. Each thread has
/// one (the engine's encoder worker lives as long as its communicator, so its scratch stays
/// warm from call to call).
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) masks: Vec<u64>,
    pub(super) exps: Vec<u8>,
    pub(super) changed: Vec<u64>,
    pub(super) exp_changed: Vec<u64>,
    pub(super) exp_sub: Vec<u64>,
    pub(super) vals: Vec<u32>,
    pub(super) delta: super::delta::DeltaScratch,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

pub(super) fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    let mut s = SCRATCH.with(|c| c.take());
    let r = f(&mut s);
    SCRATCH.with(|c| c.replace(s));
    r
}
