//! The error type of the communicator and everything above it. Every variant names the
//! operation and, where there is one, the peer rank, the cache slot and the sizes involved. The
//! transport's errors come wrapped with the operation and peer (`Error::Transport`); the C ABI
//! maps every variant to its result codes (`capi::result_code`).
#![forbid(unsafe_code)]

use std::fmt;
use std::time::Duration;

use crate::DType;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    // ---- codec -------------------------------------------------------------------------
    /// A frame could not be parsed: `what` names the field or section, `detail` the numbers.
    CorruptFrame {
        what: &'static str,
        detail: String,
    },
    /// The frame's checksum does not match its bytes.
    Checksum {
        expected: u64,
        actual: u64,
    },
    /// The frame was encoded against another version of the cache slot.
    VersionMismatch {
        slot_version: u64,
        frame_version: u64,
    },
    /// The frame is for another element type than the caller or the slot expects.
    DTypeMismatch {
        expected: DType,
        found: DType,
    },
    /// A length that must agree does not (elements, bytes, offsets).
    LengthMismatch {
        what: &'static str,
        expected: usize,
        found: usize,
    },
    /// The cache slot cannot decode this frame (cold, poisoned, or in the other mode).
    SlotState {
        detail: String,
    },

    // ---- arguments and files -------------------------------------------------------------
    InvalidArgument(String),
    /// An I/O error on a file or device; `what` names it.
    Io {
        what: String,
        source: std::io::Error,
    },
    /// A file is not what it should be (not safetensors, shapes that disagree, ...).
    Format {
        path: String,
        detail: String,
    },

    // ---- communication -------------------------------------------------------------------
    /// A transport operation with `peer` failed.
    Transport {
        op: &'static str,
        peer: usize,
        source: ciera_transport::TransportError,
    },
    /// A peer rank died, closed its link, or reported an error of its own.
    PeerFailed {
        peer: usize,
        detail: String,
    },
    /// A wait passed its deadline; `op` says what was being waited for and from whom.
    Timeout {
        op: String,
        peer: Option<usize>,
        after: Duration,
    },
    /// Shards from these source ranks arrived different from what they sent (`CIERA_VERIFY`),
    /// again after the call was redone: the output is not to be trusted.
    Corrupted {
        sources: Vec<usize>,
        detail: String,
    },
    /// Ranks called the collective with different arguments.
    CallMismatch {
        detail: String,
    },
    /// The communicator was aborted (by `abort`, or after an earlier fatal error).
    Aborted {
        detail: String,
    },
    /// Bootstrap (rendezvous, authentication, address exchange) failed.
    Bootstrap(String),
    /// Something this build or this machine does not support.
    Unsupported(String),
}

impl Error {
    pub(crate) fn corrupt(what: &'static str, detail: impl Into<String>) -> Error {
        Error::CorruptFrame {
            what,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::CorruptFrame { what, detail } => write!(f, "corrupt frame: {what}: {detail}"),
            Error::Checksum { expected, actual } => write!(
                f,
                "frame checksum mismatch: header says {expected:#018x}, bytes hash to {actual:#018x}"
            ),
            Error::VersionMismatch { slot_version, frame_version } => write!(
                f,
                "cache slot is at version {slot_version} but the frame was encoded against version \
                 {frame_version}; refusing to decode (the sender must resend raw)"
            ),
            Error::DTypeMismatch { expected, found } => {
                write!(f, "element type mismatch: expected {expected}, found {found}")
            }
            Error::LengthMismatch { what, expected, found } => {
                write!(f, "{what}: expected {expected}, found {found}")
            }
            Error::SlotState { detail } => write!(f, "cache slot: {detail}"),
            Error::InvalidArgument(s) => write!(f, "invalid argument: {s}"),
            Error::Io { what, source } => write!(f, "{what}: {source}"),
            Error::Format { path, detail } => write!(f, "{path}: {detail}"),
            Error::Transport { op, peer, source } => write!(f, "{op} with rank {peer}: {source}"),
            Error::PeerFailed { peer, detail } => write!(f, "rank {peer} failed: {detail}"),
            Error::Timeout { op, peer, after } => match peer {
                Some(p) => write!(f, "timed out after {after:?} in {op}, waiting for rank {p}"),
                None => write!(f, "timed out after {after:?} in {op}"),
            },
            Error::Corrupted { sources, detail } => write!(
                f,
                "data from rank(s) {sources:?} arrived corrupted ({detail})"
            ),
            Error::CallMismatch { detail } => write!(f, "mismatched collective calls: {detail}"),
            Error::Aborted { detail } => write!(f, "communicator aborted: {detail}"),
            Error::Bootstrap(s) => write!(f, "bootstrap: {s}"),
            Error::Unsupported(s) => write!(f, "unsupported: {s}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            Error::Transport { source, .. } => Some(source),
            _ => None,
        }
    }
}
