//! `ntio._core.timed_read`: the reader's read path with per-request timing, for `ntio-bench`.
//! It reads into a scratch buffer of its own, so Python times nothing but the I/O.

use std::time::Instant;

use pyo3::prelude::*;

use crate::backend::Backend;
use crate::destination::Destination;
use crate::extent::Extent;
use crate::reader::{Reader, ReaderOptions};
use crate::reader_bindings::Source;
use crate::staging::{AlignedBuf, SLOT_ALIGNMENT};

/// Read `extents` (file_offset, length, dest_offset) of `path` (one file or shards, as `Reader`
/// takes) into a fresh `nbytes` buffer
/// (extents may overlap there: the bytes are thrown away) through a new reader.
/// Returns (backend, wall seconds of the read, per-request latencies in µs).
#[pyfunction]
#[pyo3(signature = (path, extents, nbytes, backend=None, queue_depth=32, request_size=1 << 20))]
fn timed_read(
    py: Python<'_>,
    path: Source,
    extents: Vec<(u64, usize, usize)>,
    nbytes: usize,
    backend: Option<&str>,
    queue_depth: usize,
    request_size: usize,
) -> PyResult<(&'static str, f64, Vec<f64>)> {
    let options = ReaderOptions {
        backend: backend.map(Backend::parse).transpose()?,
        queue_depth,
        request_size,
        faults: None,
    };
    let extents: Vec<Extent> = extents
        .into_iter()
        .map(|(file_offset, length, dest_offset)| Extent {
            file_offset,
            length,
            dest_offset,
        })
        .collect();
    let timed = py.detach(|| -> crate::error::Result<_> {
        let reader = Reader::open_shards(&path.shards(), options)?;
        let buf = AlignedBuf::new(nbytes, SLOT_ALIGNMENT)?;
        // Touch every page first (as fio does its buffers), so page faults are not timed as I/O.
        // SAFETY: `buf` owns `nbytes` writable bytes (at least one) that nothing else uses.
        unsafe { std::ptr::write_bytes(buf.as_ptr(), 0xA5, nbytes) };
        // SAFETY: `buf` is ours alone and outlives the read, which completes before it returns.
        let dest = unsafe { Destination::external(buf.as_ptr(), nbytes) };
        let start = Instant::now();
        let latencies = reader.read_timed(&extents, dest)?;
        let seconds = start.elapsed().as_secs_f64();
        let micros = latencies.iter().map(|d| d.as_secs_f64() * 1e6).collect();
        Ok((reader.backend().name(), seconds, micros))
    })?;
    Ok(timed)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(timed_read, m)?)
}
