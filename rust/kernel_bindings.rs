//! Python bindings for the CPU kernels (`ntio._core.quantized_matmul`, `set_kernel_threads`, ...).
//! Tensors cross as raw addresses from torch `data_ptr()`; `ntio.cpu_kernels` checks them and keeps them alive.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::kernels::{self, Isa, KernelError, QType};

impl From<KernelError> for PyErr {
    fn from(err: KernelError) -> PyErr {
        match err {
            KernelError::Mismatch(_) => PyValueError::new_err(err.to_string()),
            KernelError::Threads { .. } => PyRuntimeError::new_err(err.to_string()),
        }
    }
}

/// out [t, n] = x [t, k] · Wᵀ with W [n, k] GGUF-encoded as ggml type `qtype`; float32 throughout.
///
/// x_address: t * k float32; w_address: w_nbytes bytes; out_address: t * n float32 (not overlapping x or w).
/// `scalar=True` forces the portable kernels (tests).
#[pyfunction]
#[pyo3(signature = (x_address, t, k, w_address, w_nbytes, qtype, n, out_address, *, scalar = false))]
#[allow(clippy::too_many_arguments)]
fn quantized_matmul(
    py: Python<'_>,
    x_address: usize,
    t: usize,
    k: usize,
    w_address: usize,
    w_nbytes: usize,
    qtype: u32,
    n: usize,
    out_address: usize,
    scalar: bool,
) -> PyResult<()> {
    let qt = QType::from_id(qtype).ok_or_else(|| {
        let ids: Vec<String> = QType::ALL
            .iter()
            .map(|q| format!("{q:?}={}", *q as u32))
            .collect();
        PyValueError::new_err(format!(
            "ggml type {qtype} is not supported by the CPU kernels (supported: {})",
            ids.join(", ")
        ))
    })?;
    let (block, bytes) = qt.block();
    if k % block != 0 || w_nbytes != n * (k / block) * bytes {
        // The exact check is in `kernels::quantized_matmul`; this one must precede building the slices.
        return Err(PyValueError::new_err(format!(
            "{qt:?} weights [{n}, {k}] take {} bytes (k a multiple of {block}), got w_nbytes = {w_nbytes}",
            n * (k / block) * bytes
        )));
    }
    for (name, address) in [("x", x_address), ("w", w_address), ("out", out_address)] {
        if address == 0 {
            return Err(PyValueError::new_err(format!("{name}_address is null")));
        }
    }
    if x_address % 4 != 0 || out_address % 4 != 0 {
        return Err(PyValueError::new_err(
            "x_address and out_address must be 4-byte aligned",
        ));
    }
    let isa = if scalar { Isa::Scalar } else { Isa::Best };
    py.detach(|| {
        // SAFETY: the caller (ntio.cpu_kernels) passes the data pointers of live, contiguous CPU tensors of at
        // least these sizes (t * k and t * n float32, w_nbytes bytes), aligned as checked above, with `out` not
        // aliasing the inputs, and keeps them alive and untouched until this call returns.
        let (x, w, out) = unsafe {
            (
                std::slice::from_raw_parts(x_address as *const f32, t * k),
                std::slice::from_raw_parts(w_address as *const u8, w_nbytes),
                std::slice::from_raw_parts_mut(out_address as *mut f32, t * n),
            )
        };
        kernels::quantized_matmul(x, w, qt, t, n, k, out, isa)
    })?;
    Ok(())
}

/// Use `n` kernel threads (0: one per available CPU).
#[pyfunction]
fn set_kernel_threads(n: usize) -> PyResult<()> {
    Ok(kernels::set_threads(n)?)
}

/// Kernel threads in use.
#[pyfunction]
fn kernel_threads() -> usize {
    kernels::threads()
}

pub fn register(m: &Bound<PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quantized_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(set_kernel_threads, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_threads, m)?)?;
    m.add("KERNEL_TYPES", QType::ALL.map(|q| q as u32).to_vec())?;
    m.add("KERNEL_MAX_T", kernels::MAX_T)?;
    Ok(())
}
