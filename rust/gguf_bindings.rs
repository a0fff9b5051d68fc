//! Python binding of the GGUF header parser (`ntio._core.parse_gguf`, `GGUFFormatError`);
//! `ntio.formats.gguf_file` is the Python facade.

use std::path::PathBuf;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};

use crate::buffer_bindings::Lent;
use crate::buffers::Access;
use crate::gguf::{self, Array, GgufError, Value};

pyo3::create_exception!(
    ntio._core,
    GGUFFormatError,
    PyValueError,
    "A GGUF file is malformed: bad magic, unsupported version, truncated or corrupt header, \
     duplicate or invalid keys, tensors misaligned, outside the file or overlapping."
);

impl From<GgufError> for PyErr {
    fn from(err: GgufError) -> PyErr {
        GGUFFormatError::new_err(err.to_string())
    }
}

/// Integers become int, floats float, bools bool, strings str (copied out of the file here) and
/// arrays list.
impl<'py> IntoPyObject<'py> for &Value<'_> {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(match self {
            Value::U8(v) => v.into_pyobject(py)?.into_any(),
            Value::I8(v) => v.into_pyobject(py)?.into_any(),
            Value::U16(v) => v.into_pyobject(py)?.into_any(),
            Value::I16(v) => v.into_pyobject(py)?.into_any(),
            Value::U32(v) => v.into_pyobject(py)?.into_any(),
            Value::I32(v) => v.into_pyobject(py)?.into_any(),
            Value::F32(v) => v.into_pyobject(py)?.into_any(),
            Value::Bool(v) => v.into_pyobject(py)?.to_owned().into_any(),
            Value::U64(v) => v.into_pyobject(py)?.into_any(),
            Value::I64(v) => v.into_pyobject(py)?.into_any(),
            Value::F64(v) => v.into_pyobject(py)?.into_any(),
            Value::String(s) => PyString::new(py, s).into_any(),
            Value::Array(a) => a.into_pyobject(py)?.into_any(),
        })
    }
}

impl<'py> IntoPyObject<'py> for &Array<'_> {
    type Target = PyList;
    type Output = Bound<'py, PyList>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        match self {
            Array::Scalars(values) => {
                let items = values
                    .iter()
                    .map(|v| (&v).into_pyobject(py))
                    .collect::<PyResult<Vec<_>>>()?;
                PyList::new(py, items)
            }
            Array::Strings(items) => PyList::new(py, items.iter().map(|s| PyString::new(py, s))),
            Array::Arrays(items) => PyList::new(py, items),
        }
    }
}

/// Parse and validate the GGUF header of the file `path` whose bytes are buffer `data` (the
/// whole file, mapped; GIL released while parsing). Returns (version, alignment, data_offset,
/// metadata as [(key, value)] in file order, tensors as [(name, ggml_type, dims in ne[] order,
/// absolute offset, nbytes)] in file order); raises GGUFFormatError naming file, key or tensor
/// and offset.
#[pyfunction]
fn parse_gguf<'py>(
    py: Python<'py>,
    path: PathBuf,
    data: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyTuple>> {
    let lent = Lent::bytes(data, "data", Access::Read)?;
    // SAFETY: the caller's contract with its own Python code: nothing writes `data` during the call
    // (it is a read-only map of the file).
    let bytes = unsafe { lent.as_slice() };
    let header = py.detach(|| gguf::parse(bytes, &path))?;
    let metadata: Vec<(&str, &Value)> = header.metadata.iter().map(|(k, v)| (*k, v)).collect();
    let tensors: Vec<(&str, u32, &[u64], u64, u64)> = header
        .tensors
        .iter()
        .map(|t| {
            (
                t.name,
                t.ggml_type.code,
                t.dims.as_slice(),
                t.offset,
                t.nbytes,
            )
        })
        .collect();
    (
        header.version,
        header.alignment,
        header.data_offset,
        metadata,
        tensors,
    )
        .into_pyobject(py)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("GGUFFormatError", m.py().get_type::<GGUFFormatError>())?;
    m.add_function(wrap_pyfunction!(parse_gguf, m)?)?;
    Ok(())
}
