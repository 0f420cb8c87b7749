//! The error type of the communicator and everything above it. Every variant names the
//! operation and, where there is one, the peer rank, the cache slot and the sizes involved. The
//! codec's errors come wrapped whole (`Error::Codec`), the transport's with the operation and the
//! peer (`Error::Transport`); the C ABI
//! maps every variant to its result codes (`capi::result_code`).
#![forbid(unsafe_code)]

use std::fmt;
use std::time::Duration;

use crate::codec::CodecError;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A frame or cache slot the codec refused (see [`CodecError`]).
    Codec(CodecError),
    /// A length that must agree does not (buffer sizes of a call).
    LengthMismatch {
        what: &'static str,
        expected: usize,
        found: usize,
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

impl From<CodecError> for Error {
    fn from(e: CodecError) -> Error {
        Error::Codec(e)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Codec(e) => e.fmt(f),
            Error::LengthMismatch {
                what,
                expected,
                found,
            } => write!(f, "{what}: expected {expected}, found {found}"),
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
            Error::Codec(e) => Some(e),
            Error::Io { source, .. } => Some(source),
            Error::Transport { source, .. } => Some(source),
            _ => None,
        }
    }
}
