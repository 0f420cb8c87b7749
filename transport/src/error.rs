//! The one error type of `ciera-transport`. Every variant says which operation failed and with
//! whom (peer rank, address, pid) and, where it matters, the sizes involved.

use std::fmt;
use std::io;

/// Result type of this crate.
pub type Result<T, E = TransportError> = std::result::Result<T, E>;

/// What went wrong in the transport layer.
#[derive(Debug)]
#[non_exhaustive]
pub enum TransportError {
    /// A system call failed. `op` names the operation; the dynamic context (peer rank, address,
    /// segment name, sizes) is folded into the message of `source`, whose `kind()` is preserved.
    Io { op: &'static str, source: io::Error },
    /// The peer closed its end of the link, or its process died (EOF, ECONNRESET, dead pid).
    PeerClosed { detail: String },
    /// The peer failed the shared-secret challenge, or refused ours (different job secrets).
    Auth { detail: String },
    /// The peer sent something this protocol does not allow (malformed handshake, corrupt ring).
    Protocol { detail: String },
    /// A setup step passed its deadline; `op` says what was being waited for.
    Timeout { op: String },
    /// The request cannot be served here (e.g. shm forced between two hosts).
    Unsupported { detail: String },
    /// An environment variable or argument has a value this crate does not accept.
    Config { detail: String },
}

impl TransportError {
    /// An `Io` error whose message is prefixed with `context` (who/what was involved).
    pub(crate) fn io(op: &'static str, context: impl fmt::Display, source: io::Error) -> Self {
        let kind = source.kind();
        TransportError::Io {
            op,
            source: io::Error::new(kind, format!("{context}: {source}")),
        }
    }

    /// `Io` from the current `errno`.
    pub(crate) fn last_os(op: &'static str, context: impl fmt::Display) -> Self {
        Self::io(op, context, io::Error::last_os_error())
    }

    /// True for [`TransportError::PeerClosed`].
    pub fn is_peer_closed(&self) -> bool {
        matches!(self, TransportError::PeerClosed { .. })
    }
}

impl fmt::Display for TransportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransportError::Io { op, source } => write!(f, "{op} failed: {source}"),
            TransportError::PeerClosed { detail } => write!(f, "peer closed: {detail}"),
            TransportError::Auth { detail } => write!(f, "authentication failed: {detail}"),
            TransportError::Protocol { detail } => write!(f, "transport protocol error: {detail}"),
            TransportError::Timeout { op } => write!(f, "timed out: {op}"),
            TransportError::Unsupported { detail } => write!(f, "unsupported: {detail}"),
            TransportError::Config { detail } => write!(f, "bad transport configuration: {detail}"),
        }
    }
}

impl std::error::Error for TransportError {}
