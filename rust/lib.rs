//! ntio's native core. The I/O logic lives in plain Rust modules that `cargo test` exercises;
//! pyo3 appears only in the binding module.
//!
//! - `extent`: validating, coalescing, aligning and splitting extents into requests;
//! - `staging`: the pool of aligned slots reads land in;
//! - `destination`: a slot or caller-owned memory;
//! - `backend`: io_uring / pread / buffered execution of a batch, chosen by a run-time probe;
//! - `reader`: the public reader (read now, or submit and wait later);
//! - `error`: the error type;
//! - `store`: the ntio store format and the extent index (layer / tensor / rows → extents).

pub mod backend;
pub mod destination;
pub mod error;
pub mod extent;
pub mod kernels;
pub mod reader;
pub mod staging;
pub mod store;

mod bench_bindings;
mod bindings;
mod kernel_bindings;
mod store_bindings;

pub use bindings::_core;
