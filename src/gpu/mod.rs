//! GPU support, all of it loaded at run time so the crate builds and runs with no CUDA:
//!
//! - [`driver`]: the CUDA driver probe, which tells device memory from host memory and waits
//!   for streams, using the driver only when the process has loaded it.
//! - [`nvrtc`]: finds NVRTC (a CUDA toolkit, or the `nvidia-cuda-nvrtc` wheel in a venv) and
//!   compiles the kernels of cuda/ to cubins, once per source and architecture, with each
//!   kernel's registers, spills and memory ([`cubin`] reads them).
//! - [`codec`]: the codec kernels on a GPU: the driver loaded only when a device is asked
//!   for, cuda/codec.cu compiled for it and launched per batch of chunks in device memory
//!   (caches, frames and scratch the caller's), each frame's length or refusal read back.
//!
//! These stay the only GPU code with `unsafe` ([`cubin`] needs none).

pub mod codec;
pub mod cubin;
pub mod driver;
pub mod nvrtc;
pub mod stream;
