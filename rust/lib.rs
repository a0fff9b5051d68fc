//! ntio's native core. The I/O logic lives in plain Rust modules that `cargo test` exercises;
//! pyo3 appears only in the `*_bindings` modules and in `_core` below, which registers them all.
//!
//! - `extent`: validating, coalescing, aligning and splitting extents into requests;
//! - `staging`: the pool of aligned slots reads land in;
//! - `destination`: a slot or caller-owned memory;
//! - `backend`: io_uring / pread / buffered execution of a batch, chosen by a run-time probe;
//! - `reader`: the public reader (read now, or submit and wait later);
//! - `error`: the error type;
//! - `buffers`: checks on caller-lent memory (element type, layout, writability, overlap);
//! - `checksum`: the store's checksum (xxh3-64), hashed as a buffer fills, AVX2 where the CPU has it;
//! - `verify`: checksum checks that a batch's bytes must pass before it ends;
//! - `store`: the ntio store format and the extent index (layer / tensor / rows → extents);
//! - `gguf`: the validating GGUF header parser;
//! - `kernels`: CPU matrix-vector products over GGUF-encoded weights.

pub mod backend;
pub mod buffers;
pub mod checksum;
pub mod destination;
pub mod error;
pub mod extent;
pub mod gguf;
pub mod kernels;
pub mod reader;
pub mod staging;
pub mod store;
pub mod verify;

mod bench_bindings;
mod buffer_bindings;
mod gguf_bindings;
mod kernel_bindings;
mod reader_bindings;
mod store_bindings;

use pyo3::prelude::*;

/// `ntio._core`: every binding module registers its classes, functions, exceptions and constants here.
#[pymodule]
pub fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    buffer_bindings::register(m)?; // BufferError
    reader_bindings::register(m)?; // Reader, ReadHandle, StagingPool, Slot, I/O errors
    store_bindings::register(m)?; // open_store, ExtentIndex, StoreFormatError, ...
    kernel_bindings::register(m)?; // quantized_matmul, kernel threads
    bench_bindings::register(m)?; // timed_read
    gguf_bindings::register(m)?; // parse_gguf, GGUFFormatError
    Ok(())
}
