//! CIERA: a lossless, cross-iteration compressed Allgather for sharded training.
//!
//! The layers, from the bottom (ARCHITECTURE.md has the picture and the allowed arrows, which
//! `tests/layering.rs` checks against the imports):
//! - leaves: [`dtype`], [`parse`], `coded_enum`, [`error`], [`logging`], [`safetensors`];
//! - [`codec`]: the frame format (docs/WIRE.md) and the exponent / full-value caches (pure);
//! - [`algo`]: allgather schedules as pure state machines over a [`algo::Topology`] (no I/O);
//! - [`mem`]: where bytes live (host or device) and the regions a peer may read directly;
//!   [`gpu`]: the CUDA driver probe (device support lands here);
//! - [`engine`]: runs one call of a schedule over the transport's links (`ciera-transport`);
//! - [`compress`]: the compression policy (raw, fill or delta per call), over the engine;
//! - [`sim`]: the cost model behind `ciera sim` (pure arithmetic, no I/O);
//! - [`comm`]: the communicator: bootstrap, configuration, the engine and the policy;
//! - [`capi`] (the C ABI, shared with the interposers) and [`cli`] (the `ciera` command):
//!   thin callers of the communicator.

pub mod algo;
pub mod capi;
pub mod cli;
pub mod codec;
mod coded_enum;
pub mod comm;
pub mod compress;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod gpu;
pub mod logging;
pub mod mem;
pub mod parse;
pub mod safetensors;
pub mod sim;

pub use dtype::DType;
pub use error::{Error, Result};
pub use mem::SharedBuffer;
