//! Python bindings of the store and the extent index (`ntio._core`): `open_store`, `ExtentIndex`,
//! `store_header`, `plan_store_layout`, `checksum`, `piece_checksums`, `Hasher`. `ntio.formats.store` is the Python facade.

use std::path::PathBuf;

use pyo3::exceptions::{PyLookupError, PyOSError, PyValueError};
use pyo3::prelude::*;

use crate::buffer_bindings::Lent;
use crate::buffers::Access;
use crate::store::{self, ExtentIndex as CoreIndex, Header, StoreError, TensorSpan};

pyo3::create_exception!(
    ntio._core,
    StoreFormatError,
    PyValueError,
    "A store is malformed (bad magic, future version, truncated, bad manifest, checksum mismatch)."
);

impl From<StoreError> for PyErr {
    fn from(err: StoreError) -> PyErr {
        let message = err.to_string();
        match err {
            StoreError::NotFound { .. } => PyLookupError::new_err(message),
            StoreError::Io { errno, .. } => PyOSError::new_err((errno, message)),
            _ => StoreFormatError::new_err(message),
        }
    }
}

/// Where each layer, tensor and row range of a model file is; built by `open_store` for a store,
/// or from a GGUF's tensor table by `ExtentIndex(path, tensors)`.
#[pyclass(frozen, module = "ntio._core")]
pub struct ExtentIndex {
    inner: CoreIndex,
}

#[pymethods]
impl ExtentIndex {
    /// `tensors`: (name, offset, nbytes, rows, layer or None) in any order; no checksums.
    #[new]
    fn new(path: PathBuf, tensors: Vec<(String, u64, u64, u64, Option<usize>)>) -> PyResult<Self> {
        let spans = tensors
            .into_iter()
            .map(|(name, offset, nbytes, rows, layer)| TensorSpan {
                name,
                offset,
                nbytes,
                rows,
                layer,
                checksum: None,
            })
            .collect();
        Ok(Self {
            inner: CoreIndex::new(&path, spans)?,
        })
    }

    #[getter]
    fn n_layers(&self) -> usize {
        self.inner.n_layers()
    }

    /// Names of the tensors of `layer`, in file order.
    fn layer_tensors(&self, layer: usize) -> PyResult<Vec<String>> {
        Ok(self
            .inner
            .layer_tensors(layer)?
            .into_iter()
            .map(|t| t.name.clone())
            .collect())
    }

    /// (file_offset, length) extents covering all of `layer`'s tensors.
    fn layer_extents(&self, layer: usize) -> PyResult<Vec<(u64, u64)>> {
        Ok(self.inner.layer_extents(layer)?)
    }

    fn tensor_extent(&self, name: &str) -> PyResult<(u64, u64)> {
        Ok(self.inner.tensor_extent(name)?)
    }

    /// The extent of rows [start, stop) of tensor `name`.
    fn row_extent(&self, name: &str, start: u64, stop: u64) -> PyResult<(u64, u64)> {
        Ok(self.inner.row_extent(name, start, stop)?)
    }

    /// Neurons per FFN group where the store holds group-major copies of its down matrices, else None.
    #[getter]
    fn ffn_group_neurons(&self) -> Option<u64> {
        self.inner.ffn_group_neurons()
    }

    /// (file_offset, length) of groups `groups` (in that order) of `layer`'s group-major down copy.
    fn ffn_group_extents(&self, layer: usize, groups: Vec<u64>) -> PyResult<Vec<(u64, u64)>> {
        Ok(self.inner.ffn_group_extents(layer, &groups)?)
    }

    /// The xxh3-64 checksum of each group of `layer`'s down copy.
    fn ffn_group_checksums(&self, layer: usize) -> PyResult<Vec<u64>> {
        Ok(self.inner.ffn_group_checksums(layer)?.to_vec())
    }

    /// The xxh3-64 checksum of each row group (rows [g·n, (g+1)·n)) of dense tensor `tensor` (a layer's gate or up).
    fn ffn_row_group_checksums(&self, tensor: &str) -> PyResult<Vec<u64>> {
        Ok(self.inner.ffn_row_group_checksums(tensor)?.to_vec())
    }

    /// Check the bytes of buffer `data`, group `group` of `layer`'s down copy, against its checksum.
    fn verify_ffn_group(
        &self,
        py: Python<'_>,
        layer: usize,
        group: u64,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let lent = Lent::bytes(data, "data", Access::Read)?;
        // SAFETY: the caller's contract with its own Python code: nothing writes `data` during the call.
        let bytes = unsafe { lent.as_slice() };
        Ok(py.detach(|| self.inner.verify_ffn_group(layer, group, bytes))?)
    }

    /// The xxh3-64 checksum the file records for tensor `name` (None in a GGUF).
    fn checksum(&self, name: &str) -> PyResult<Option<u64>> {
        Ok(self.inner.tensor(name)?.checksum)
    }

    /// Check the whole encoded tensor `name`, the bytes of buffer `data`, against its checksum
    /// (raises StoreFormatError naming tensor and offset); a no-op where the file records none.
    fn verify(&self, py: Python<'_>, name: &str, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let lent = Lent::bytes(data, "data", Access::Read)?;
        // SAFETY: the caller's contract with its own Python code: nothing writes `data` during the call.
        let bytes = unsafe { lent.as_slice() };
        Ok(py.detach(|| self.inner.verify(name, bytes))?)
    }
}

/// Open a store: (format_version, metadata JSON, tensor table, index). The tensor table rows are
/// (name, ggml_type, shape, offset, nbytes).
#[pyfunction]
#[allow(clippy::type_complexity)]
fn open_store(
    py: Python<'_>,
    path: PathBuf,
) -> PyResult<(
    u32,
    String,
    Vec<(String, u32, Vec<u64>, u64, u64)>,
    ExtentIndex,
)> {
    let (manifest, index) = py.detach(|| store::open(&path))?;
    let tensors = manifest
        .tensors
        .into_iter()
        .map(|t| (t.name, t.ggml_type, t.shape, t.offset, t.nbytes))
        .collect();
    Ok((
        manifest.format_version,
        manifest.metadata.get().to_owned(),
        tensors,
        ExtentIndex { inner: index },
    ))
}

/// The 4096-byte header page of a store whose manifest is at `manifest_offset`.
#[pyfunction]
fn store_header(manifest_offset: u64, manifest: &[u8]) -> Vec<u8> {
    Header {
        format_version: store::FORMAT_VERSION,
        manifest_offset,
        manifest_length: manifest.len() as u64,
        manifest_checksum: store::checksum(manifest),
    }
    .encode()
}

/// Offsets of a new store's tensors: `groups` (globals, layer 0, layer 1, ...) of tensor sizes.
#[pyfunction]
fn plan_store_layout(groups: Vec<Vec<u64>>) -> Vec<Vec<u64>> {
    store::plan_layout(store::HEADER_SIZE as u64, &groups)
}

/// xxh3-64 of the bytes of buffer `data` (GIL released).
#[pyfunction]
fn checksum(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<u64> {
    let lent = Lent::bytes(data, "data", Access::Read)?;
    // SAFETY: the caller's contract with its own Python code: nothing writes `data` during the call.
    let bytes = unsafe { lent.as_slice() };
    Ok(py.detach(|| store::checksum(bytes)))
}

/// xxh3-64 of each `piece_nbytes` piece of buffer `data`, in order, the last one possibly shorter (a
/// table's rows, a tensor's chunks; GIL released).
#[pyfunction]
fn piece_checksums(
    py: Python<'_>,
    data: &Bound<'_, PyAny>,
    piece_nbytes: usize,
) -> PyResult<Vec<u64>> {
    let lent = Lent::bytes(data, "data", Access::Read)?;
    // SAFETY: the caller's contract with its own Python code: nothing writes `data` during the call.
    let bytes = unsafe { lent.as_slice() };
    if piece_nbytes == 0 {
        return Err(PyValueError::new_err(
            "piece_checksums: piece_nbytes must be > 0",
        ));
    }
    Ok(py.detach(|| bytes.chunks(piece_nbytes).map(store::checksum).collect()))
}

/// xxh3-64 of bytes given piece by piece: `update(buffer)` in order, then `digest()` equals `checksum` of
/// their concatenation (a tensor verified a window at a time, never held whole).
#[pyclass(module = "ntio._core")]
struct Hasher {
    state: xxhash_rust::xxh3::Xxh3,
}

#[pymethods]
impl Hasher {
    #[new]
    fn new() -> Self {
        Self {
            state: xxhash_rust::xxh3::Xxh3::new(),
        }
    }

    fn update(&mut self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let lent = Lent::bytes(data, "data", Access::Read)?;
        // SAFETY: the caller's contract with its own Python code: nothing writes `data` during the call.
        let bytes = unsafe { lent.as_slice() };
        let state = &mut self.state;
        py.detach(|| state.update(bytes));
        Ok(())
    }

    fn digest(&self) -> u64 {
        self.state.digest()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("StoreFormatError", py.get_type::<StoreFormatError>())?;
    m.add("STORE_MAGIC", pyo3::types::PyBytes::new(py, store::MAGIC))?;
    m.add("STORE_FORMAT_VERSION", store::FORMAT_VERSION)?;
    m.add("STORE_ALIGNMENT", store::STORE_ALIGNMENT)?;
    m.add_class::<ExtentIndex>()?;
    m.add_function(wrap_pyfunction!(open_store, m)?)?;
    m.add_function(wrap_pyfunction!(store_header, m)?)?;
    m.add_function(wrap_pyfunction!(plan_store_layout, m)?)?;
    m.add_function(wrap_pyfunction!(checksum, m)?)?;
    m.add_function(wrap_pyfunction!(piece_checksums, m)?)?;
    m.add_class::<Hasher>()?;
    Ok(())
}
