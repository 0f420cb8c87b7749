//! The codec's own error: what is wrong with a frame or a cache slot, naming the field or
//! section and the numbers. It knows nothing of ranks or links; the communicator wraps it
//! (`crate::Error::Codec`) with the source rank where one is involved.

use std::fmt;

use crate::DType;

pub type Result<T, E = CodecError> = std::result::Result<T, E>;

#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CodecError {
    /// A frame could not be parsed: `what` names the field or section, `detail` the numbers.
    CorruptFrame { what: &'static str, detail: String },
    /// The frame's checksum does not match its bytes.
    Checksum { expected: u64, actual: u64 },
    /// The frame was encoded against another version of the cache slot.
    VersionMismatch {
        slot_version: u64,
        frame_version: u64,
    },
    /// The frame is for another element type than the caller or the slot expects.
    DTypeMismatch { expected: DType, found: DType },
    /// A length that must agree does not (elements, bytes, offsets).
    LengthMismatch {
        what: &'static str,
        expected: usize,
        found: usize,
    },
    /// The cache slot cannot decode this frame (cold, poisoned, or in the other mode).
    SlotState { detail: String },
}

impl CodecError {
    pub(crate) fn corrupt(what: &'static str, detail: impl Into<String>) -> CodecError {
        CodecError::CorruptFrame {
            what,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CodecError::CorruptFrame { what, detail } => {
                write!(f, "corrupt frame: {what}: {detail}")
            }
            CodecError::Checksum { expected, actual } => write!(
                f,
                "frame checksum mismatch: header says {expected:#018x}, bytes hash to {actual:#018x}"
            ),
            CodecError::VersionMismatch {
                slot_version,
                frame_version,
            } => write!(
                f,
                "cache slot is at version {slot_version} but the frame was encoded against version \
                 {frame_version}; refusing to decode (the sender must resend raw)"
            ),
            CodecError::DTypeMismatch { expected, found } => {
                write!(f, "element type mismatch: expected {expected}, found {found}")
            }
            CodecError::LengthMismatch {
                what,
                expected,
                found,
            } => write!(f, "{what}: expected {expected}, found {found}"),
            CodecError::SlotState { detail } => write!(f, "cache slot: {detail}"),
        }
    }
}

impl std::error::Error for CodecError {}
