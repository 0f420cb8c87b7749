//! `ciera._ciera`: the native half of the `ciera` Python package (the Python half,
//! python/ciera/, turns torch tensors into what these functions take and is the API users see).
//!
//! A [`Communicator`] is libciera's C-ABI communicator (`ciera::capi::LiveComm`: the
//! compressed Allgather, its statistics, abort and async errors), created from a unique id the
//! Python side hands around through torch.distributed's store. Buffers arrive as addresses and
//! lengths with their dtype; every check a C caller gets (sizes, overlap, NULL, host against
//! device memory) runs here too, and every failure is a Python exception naming the problem.
//! The GIL is released while a collective runs.

use std::ffi::c_void;
use std::sync::Arc;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use ciera::capi::{gather_buffers, on_device, Failure, LiveComm, ResultCode};
use ciera::comm::id::UNIQUE_ID_BYTES;
use ciera::comm::{Config, UniqueId};
use ciera::DType;

fn to_py(f: Failure) -> PyErr {
    match f.code {
        ResultCode::InvalidArgument => PyValueError::new_err(f.message),
        _ => PyRuntimeError::new_err(format!("{} ({:?})", f.message, f.code)),
    }
}

/// A fresh unique id (bytes): rank 0 makes it, every rank passes it to `Communicator`.
#[pyfunction]
fn unique_id(py: Python<'_>) -> PyResult<Py<PyBytes>> {
    let id = UniqueId::new().map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    Ok(PyBytes::new(py, id.as_bytes()).unbind())
}

/// The dtype of NCCL number `code`, or a TypeError naming it.
fn dtype_of(code: u8) -> PyResult<DType> {
    DType::from_code(code)
        .ok_or_else(|| PyTypeError::new_err(format!("dtype code {code} is not one CIERA knows")))
}

/// A CIERA communicator of `nranks` processes, this one `rank`.
#[pyclass(frozen, subclass, module = "ciera")]
struct Communicator {
    live: Arc<LiveComm>,
}

#[pymethods]
impl Communicator {
    /// Joins the job `unique_id` names (every rank passes the same id). Configuration comes
    /// from the environment (`CIERA_COMPRESS`, `CIERA_TRANSPORT`, ...), as for every CIERA
    /// communicator.
    #[new]
    fn new(py: Python<'_>, unique_id: &[u8], nranks: usize, rank: usize) -> PyResult<Self> {
        let bytes: &[u8; UNIQUE_ID_BYTES] = unique_id.try_into().map_err(|_| {
            PyValueError::new_err(format!(
                "a unique id has {UNIQUE_ID_BYTES} bytes, not {}",
                unique_id.len()
            ))
        })?;
        let id = UniqueId::from_bytes(bytes).map_err(|e| PyValueError::new_err(e.to_string()))?;
        if rank >= nranks {
            return Err(PyValueError::new_err(format!(
                "rank {rank} of {nranks} ranks"
            )));
        }
        let config = Config::from_env().map_err(|e| PyValueError::new_err(e.to_string()))?;
        let live = py
            .detach(|| LiveComm::init_rank(&id, nranks, rank, config))
            .map_err(to_py)?;
        Ok(Communicator { live })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.live.rank()
    }

    #[getter]
    fn size(&self) -> usize {
        self.live.size()
    }

    /// Gathers `count` elements of dtype `dtype` (NCCL's numbering) from every rank's `send`
    /// address into `recv` (rank r's at element r*count); in place when `send` is
    /// `recv + rank*count*size`. Host memory: returns when done. CUDA device memory: queued on
    /// `stream` (a CUstream as an integer, 0 the default stream), as NCCL. `key` names the
    /// tensor (the same key each iteration) for its cache.
    #[pyo3(signature = (send, recv, count, dtype, key=None, stream=0))]
    #[allow(clippy::too_many_arguments)]
    fn all_gather(
        &self,
        py: Python<'_>,
        send: usize,
        recv: usize,
        count: usize,
        dtype: u8,
        key: Option<u64>,
        stream: usize,
    ) -> PyResult<()> {
        let dtype = dtype_of(dtype)?;
        let (send, recv) = (send as *const c_void, recv as *mut c_void);
        let live = &self.live;
        let device = on_device(send, recv).map_err(to_py)?;
        // Addresses cross into the closure as integers (raw pointers are not Send).
        let (s, r) = (send as usize, recv as usize);
        py.detach(move || {
            let (send, recv) = (s as *const c_void, r as *mut c_void);
            if device {
                // SAFETY: the Python side passes a contiguous device tensor's address and
                // byte size (checked there and by check_buffers here), alive until the
                // stream's work is done (it keeps the tensors referenced); `stream` is the
                // tensor device's current stream.
                unsafe {
                    live.all_gather_device(send, recv, count, dtype, key, stream as *mut c_void)
                }
            } else {
                // SAFETY: contiguous host tensors of the sizes gather_buffers checks, which
                // the caller holds (and does not touch) for the call.
                unsafe { gather_buffers(send, recv, count, dtype, live.rank(), live.size()) }
                    .and_then(|bufs| live.all_gather(bufs, count, dtype, key))
            }
        })
        .map_err(to_py)
    }

    /// The statistics as a dict: calls by kind, bytes gathered and on the wire, their ratio,
    /// cache misses, frames received and the hit rate (those that decoded against a warm
    /// cache).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.live.stats();
        let c = &s.compress;
        let d = PyDict::new(py);
        d.set_item("calls", s.calls)?;
        d.set_item("in_place_calls", s.in_place_calls)?;
        d.set_item("failed_calls", s.failed_calls)?;
        d.set_item("raw_calls", c.raw_calls)?;
        d.set_item("fill_calls", c.fill_calls)?;
        d.set_item("delta_calls", c.delta_calls)?;
        d.set_item("raw_bytes", c.raw_bytes)?;
        d.set_item("wire_bytes", c.wire_bytes)?;
        d.set_item("ratio", c.ratio())?;
        d.set_item("repairs", c.repairs)?;
        d.set_item("misses", c.misses)?;
        // Frames received that decoded against a warm cache / all frames received.
        let (hits, frames) = self.live.frame_hits();
        d.set_item("frames", frames)?;
        d.set_item(
            "hit_rate",
            (frames > 0).then(|| hits as f64 / frames as f64),
        )?;
        d.set_item("cache_bytes", c.cache_bytes)?;
        d.set_item("encode_ns", c.encode_ns)?;
        d.set_item("decode_ns", c.decode_ns)?;
        Ok(d)
    }

    /// The failure that broke the communicator, or None while it is usable.
    fn async_error(&self) -> Option<String> {
        self.live.async_error().map(|(_, m)| m)
    }

    /// Aborts a collective in flight (from any thread); the communicator is then broken.
    fn abort(&self) {
        self.live.abort();
    }
}

#[pymodule]
fn _ciera(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(unique_id, m)?)?;
    m.add_class::<Communicator>()?;
    m.add("UNIQUE_ID_BYTES", UNIQUE_ID_BYTES)?;
    Ok(())
}
