//! GPU support. Today: the CUDA driver probe ([`driver`]), which tells device memory from host
//! memory and waits for streams, using the driver only when the process has loaded it. The
//! codec kernels (cuda/, compiled at run time with NVRTC) and device memory for caches and
//! frames land here next; like [`driver`], they stay the only GPU code with `unsafe`.

pub mod driver;
