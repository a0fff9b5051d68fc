//! Python bindings (`ntio._core`). The only module that knows about pyo3.

use pyo3::prelude::*;

#[pymodule]
pub fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
