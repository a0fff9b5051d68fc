//! ntio's native core. The I/O logic lives in plain Rust modules that `cargo test` exercises;
//! pyo3 appears only in the binding module.

mod bindings;

pub use bindings::_core;
