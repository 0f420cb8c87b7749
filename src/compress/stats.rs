//! What the compressed Allgather reports: per call ([`CallReport`]), per tensor
//! ([`SlotStats`]) and per communicator ([`Stats`]).

use crate::DType;

/// Which cached tensor a call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotKey {
    /// The caller's key, or one inferred from the call.
    pub id: u64,
    pub inferred: bool,
    pub count: usize,
    pub dtype: DType,
}

/// How a call travelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallKind {
    /// Uncompressed (type, size, algorithm, budget, mode or back-off said so).
    Raw,
    /// Uncompressed, then every rank filled its caches of every source from the result (the
    /// first call of a tensor).
    Fill,
    /// Frames coded against last call's caches (a source whose cache held no copy of its
    /// shard, a *miss*, sends its values in FILL frames within the same call).
    Delta,
}

/// What one call of the compressed Allgather did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallReport {
    pub kind: CallKind,
    /// A frame failed to decode (or verify) on some rank: the call was redone raw, its
    /// result is exact, and the tensor's caches refill next call.
    pub repaired: bool,
    /// Sources that sent FILL frames in a delta call: their cache held no copy of the tensor
    /// (a buffer that moved, an evicted or reset cache). Costs a FILL, not a repair.
    pub misses: u64,
    /// Bytes of the gathered tensor (nranks x shard).
    pub raw_bytes: u64,
    /// Bytes that stood for them on the wire: frames, or the values for a raw call.
    pub wire_bytes: u64,
}

impl CallReport {
    pub(super) fn raw(bytes: u64) -> CallReport {
        CallReport {
            kind: CallKind::Raw,
            repaired: false,
            misses: 0,
            raw_bytes: bytes,
            wire_bytes: bytes,
        }
    }

    /// Whether the call sent frames.
    pub fn compressed(&self) -> bool {
        self.kind != CallKind::Raw
    }
}

/// What happened to the calls of one policy so far: one tensor (an explicit key), or every
/// tensor of one shape (keys inferred from buffer addresses).
#[derive(Clone, Debug, Default)]
pub struct SlotStats {
    pub calls: u64,
    pub raw_calls: u64,
    pub fill_calls: u64,
    pub delta_calls: u64,
    /// Bytes gathered by framed calls, and the frame bytes that carried them.
    pub framed_raw_bytes: u64,
    pub framed_wire_bytes: u64,
    /// Ratio of the last delta call (raw bytes / frame bytes).
    pub last_ratio: f64,
    /// Delta frames that decoded against a warm cache / all frames received.
    pub hits: u64,
    pub frames: u64,
    pub repairs: u64,
    /// Sources that sent FILL frames in delta calls (see [`CallReport::misses`]).
    pub misses: u64,
    /// Delta- and full-value-cache policies under `auto`: the frames the last compressed call
    /// allowed (`Exp` only, `NoDelta`: Exp or Hybrid, `Auto`: all the cache takes); None for
    /// other policies.
    pub frame_choice: Option<crate::codec::FrameChoice>,
    /// Frame levels (as `frame_choice`'s: Exp, NoDelta, Auto) the policy predicts cannot win
    /// on this link, so neither times nor probes: their wire alone, the raw baseline scaled by
    /// their estimated bytes, is longer than the best level's measured call.
    pub hopeless_levels: [bool; 3],
    /// Trials of an exponent cache not made for the same reason.
    pub trials_skipped: u64,
    /// Calls whose first prediction waited for another tensor of its size to measure the
    /// model's error (raw calls, `predict::TRIAL_WAITS`).
    pub trial_waits: u64,
    /// The least call time predicted before trying (see the `predict` module of `compress`)
    /// at each frame level, then on an exponent cache.
    pub predicted: [Option<std::time::Duration>; 4],
    /// Back-offs to raw decided by that prediction alone (nothing tried).
    pub predicted_raw: u64,
    /// Moves to smaller caches (or raw) because `CIERA_CACHE_MB` evicted this tensor's.
    pub budget_demotions: u64,
    /// Predictions made again because a frame level's measured wire moved more than
    /// `RECALIBRATE_DRIFT` from what it sent after the last one (a new training regime).
    pub recalibrations: u64,
}

/// Communicator-wide statistics.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub calls: u64,
    pub raw_calls: u64,
    pub fill_calls: u64,
    pub delta_calls: u64,
    /// Logical bytes gathered (nranks x shard) by all calls, and the bytes that stood for them
    /// on the wire (frames for framed calls, the values for raw calls), per gathered tensor.
    pub raw_bytes: u64,
    pub wire_bytes: u64,
    pub encode_ns: u64,
    pub decode_ns: u64,
    /// Wall time of framed calls minus their codec time on this rank.
    pub transfer_ns: u64,
    /// Calls redone raw because a frame failed to decode or verify on some rank.
    pub repairs: u64,
    /// Sources that sent FILL frames in delta calls (see [`CallReport::misses`]).
    pub misses: u64,
    pub cache_bytes: usize,
    /// Cache slots held (one per source rank and tensor).
    pub slots: usize,
    pub evictions: u64,
    /// How far this communicator's compressed calls fell short of their predicted least times,
    /// per size class: (log2 of the bytes a call gathers, rounded down; the smallest ratio
    /// measured at that size, at least 1), by class. Later predictions of that size are
    /// weighed by it. The same on every rank.
    pub model_error: Vec<(u32, f64)>,
}

impl Stats {
    pub fn ratio(&self) -> f64 {
        if self.wire_bytes == 0 {
            1.0
        } else {
            self.raw_bytes as f64 / self.wire_bytes as f64
        }
    }
}
