//! CIERA: a lossless, cross-iteration compressed Allgather for sharded training.
//!
//! The data path, in one read, is in ARCHITECTURE.md. Modules:
//! - [`codec`]: the frame format (docs/WIRE.md) and the exponent / full-value caches.
//! - [`algo`]: allgather schedules as pure state machines (no I/O).
//! - [`comm`]: bootstrap, communicator, the executor that drives a schedule over transports.
//! - [`safetensors`]: a small reader for the trace checkpoints.
//! - [`cli`]: the `ciera` command (`analyze`, `perf`, `launch`).

pub mod algo;
pub mod capi;
pub mod cli;
pub mod codec;
pub mod comm;
pub mod compress;
pub mod dtype;
pub mod error;
pub mod logging;
pub mod safetensors;

pub use ciera_transport::SharedBuffer;
pub use dtype::DType;
pub use error::{Error, Result};
