//! Python bindings for the CPU kernels (`ntio._core.quantized_matmul`, `set_kernel_threads`, ...).
//! Tensors cross as buffer-protocol objects (numpy views of torch tensors, made by `ntio.kernels.cpu_kernels`),
//! checked for element type, layout, writability and overlap before any slice is formed.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::buffer_bindings::Lent;
use crate::buffers::{self, Access};
use crate::kernels::{self, Activations8, Isa, KernelError, QType};

impl From<KernelError> for PyErr {
    fn from(err: KernelError) -> PyErr {
        match err {
            KernelError::Mismatch(_) => PyValueError::new_err(err.to_string()),
            KernelError::Threads { .. } => PyRuntimeError::new_err(err.to_string()),
        }
    }
}

/// out [t, n] = x [t, k] · Wᵀ with W [n, k] GGUF-encoded as ggml type `qtype` in `raw`, float32 in and out.
///
/// x: t * k float32; raw: exactly the encoded size of W, uint8; out: t * n float32, writable, overlapping neither
/// x nor raw. All C-contiguous buffers (numpy arrays; torch tensors via `.numpy()`), checked here, each refusal
/// a `BufferError` (a ValueError) naming the argument. `isa`: `best`, `avx512`, `avx2` or `scalar` (a set
/// this CPU lacks is a ValueError); `int8`: quantize activations to 8 bits (quantized types), else float32.
#[pyfunction]
#[pyo3(signature = (x, t, k, raw, qtype, n, out, *, isa = "best", int8 = true))]
#[allow(clippy::too_many_arguments)]
fn quantized_matmul(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    t: usize,
    k: usize,
    raw: &Bound<'_, PyAny>,
    qtype: u32,
    n: usize,
    out: &Bound<'_, PyAny>,
    isa: &str,
    int8: bool,
) -> PyResult<()> {
    let isa = checked_isa(isa)?;
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
    let x = Lent::<f32>::typed(x, "x", Access::Read)?;
    let raw = Lent::<u8>::typed(raw, "raw", Access::Read)?;
    let out = Lent::<f32>::typed(out, "out", Access::Write)?;
    buffers::disjoint(("out", out.range()), ("x", x.range()))?;
    buffers::disjoint(("out", out.range()), ("raw", raw.range()))?;
    let activations = if int8 {
        Activations8::Int8
    } else {
        Activations8::Float
    };
    py.detach(|| {
        // SAFETY: `out` shares no byte with `x` or `raw` (checked above), so the one mutable slice aliases
        // nothing here; the exports live until this function returns; the caller (`ntio.kernels.cpu_kernels`)
        // runs no Python code on these tensors during the call. Sizes are the kernel's to check.
        let (x, raw, out) = unsafe { (x.as_slice(), raw.as_slice(), out.as_mut_slice()) };
        kernels::quantized_matmul(x, raw, qt, t, n, k, out, isa, activations)
    })?;
    Ok(())
}

/// The kernel set `name`, refused when unknown or when this CPU lacks it (never a SIGILL later).
fn checked_isa(name: &str) -> PyResult<Isa> {
    let isa = Isa::from_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown CPU kernel set '{name}' (choose best, avx512, avx2 or scalar)"
        ))
    })?;
    if !isa.available() {
        return Err(PyValueError::new_err(format!(
            "this CPU lacks the instructions of the '{name}' kernels"
        )));
    }
    Ok(isa)
}

/// Checks kernel set `name` (`best`, `avx512`, `avx2`, `scalar`): a ValueError saying why it cannot run here.
#[pyfunction]
fn check_kernel_isa(name: &str) -> PyResult<()> {
    checked_isa(name).map(|_| ())
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
    m.add_function(wrap_pyfunction!(check_kernel_isa, m)?)?;
    m.add("KERNEL_TYPES", QType::ALL.map(|q| q as u32).to_vec())?;
    m.add("KERNEL_MAX_T", kernels::MAX_T)?;
    Ok(())
}
