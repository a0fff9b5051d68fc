//! Python bindings of the reader and its staging slots (`ntio._core.Reader`, `ReadHandle`, `StagingPool`,
//! `Slot`, the I/O exceptions): converts arguments, releases the GIL around blocking calls and maps `Error` to
//! Python exceptions. `ntio.io` is the Python facade.

use std::time::Duration;

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::backend::faults::Faults;
use crate::backend::Backend;
use crate::buffer_bindings::{BufferError, Lent};
use crate::buffers::Access;
use crate::destination::Destination;
use crate::error::Error;
use crate::extent::Extent;
use crate::reader::{Pending, Reader as CoreReader, ReaderOptions};
use crate::staging::{Slot as CoreSlot, StagingPool as CorePool};
use crate::verify::Check;

pyo3::create_exception!(
    ntio._core,
    ReadError,
    PyOSError,
    "A read or open failed: .path, .offset, .length, .errno."
);
pyo3::create_exception!(
    ntio._core,
    SlotBusyError,
    PyRuntimeError,
    "A staging slot is in flight, or no slot is free."
);
pyo3::create_exception!(
    ntio._core,
    BackendUnavailableError,
    PyOSError,
    "A forced I/O backend cannot work on this file or system."
);

impl From<Error> for PyErr {
    fn from(err: Error) -> PyErr {
        let message = err.to_string();
        match err {
            Error::Open { path, errno } => read_error(message, path, None, None, Some(errno)),
            Error::Io {
                path,
                offset,
                length,
                errno,
            } => read_error(message, path, Some(offset), Some(length), Some(errno)),
            Error::UnexpectedEof {
                path,
                offset,
                length,
                ..
            } => read_error(message, path, Some(offset), Some(length), None),
            Error::Corrupt {
                path,
                offset,
                length,
                ..
            } => read_error(message, path, Some(offset), Some(length), None),
            Error::DestinationTooSmall { .. } | Error::SlotNotAcquired { .. } => {
                BufferError::new_err(message)
            }
            Error::SlotBusy { .. } | Error::NoFreeSlot { .. } => SlotBusyError::new_err(message),
            Error::BackendUnavailable { .. } => BackendUnavailableError::new_err(message),
            Error::System { errno, .. } => PyOSError::new_err((errno, message)),
            Error::InvalidArgument(_) => PyValueError::new_err(message),
        }
    }
}

/// A `ReadError` whose message is the one-line description, with its context as attributes.
fn read_error(
    message: String,
    path: std::path::PathBuf,
    offset: Option<u64>,
    length: Option<u64>,
    errno: Option<i32>,
) -> PyErr {
    Python::attach(|py| {
        let err = ReadError::new_err(message);
        let value = err.value(py);
        // `strerror` and `filename` stay unset: OSError.__str__ would replace the message.
        let set = || -> PyResult<()> {
            value.setattr("path", path.display().to_string())?;
            value.setattr("offset", offset)?;
            value.setattr("length", length)?;
            value.setattr("errno", errno)
        };
        if let Err(failure) = set() {
            return failure;
        }
        err
    })
}

/// A checksum check as Python gives it: (tensor, file_offset, dest_offset, length, checksum).
type CheckTuple = (String, u64, usize, usize, u64);

fn to_checks(list: Option<Vec<CheckTuple>>) -> Vec<Check> {
    list.unwrap_or_default()
        .into_iter()
        .map(
            |(tensor, file_offset, dest_offset, length, checksum)| Check {
                tensor: tensor.into(),
                file_offset,
                dest_offset,
                length,
                checksum,
            },
        )
        .collect()
}

fn to_extents(list: Vec<(u64, usize, usize)>) -> Vec<Extent> {
    list.into_iter()
        .map(|(file_offset, length, dest_offset)| Extent {
            file_offset,
            length,
            dest_offset,
        })
        .collect()
}

/// The writable, C-contiguous memory of `dest` (any element type: extents are in bytes), held by `lent`.
///
/// # Safety
/// `lent` must outlive the read that uses the destination, and the caller's Python code must not touch the
/// memory until that read has ended.
unsafe fn external(lent: &Lent<u8>) -> Destination {
    // SAFETY: `lent` checked the export writable and C-contiguous, `len()` bytes long; it keeps the memory
    // allocated (the exporter cannot free or resize it while exported) and, by this function's contract, outlives
    // the read, with no other access meanwhile.
    unsafe { Destination::external(lent.as_mut_ptr(), lent.len()) }
}

/// What a reader reads: one file, or `(path, base)` pairs.
#[derive(FromPyObject)]
pub enum Source {
    File(std::path::PathBuf),
    Shards(Vec<(std::path::PathBuf, u64)>),
}

impl Source {
    /// `(path, base)` pairs, a single file at 0.
    pub fn shards(self) -> Vec<(std::path::PathBuf, u64)> {
        match self {
            Source::File(path) => vec![(path, 0)],
            Source::Shards(shards) => shards,
        }
    }
}

#[pyclass(frozen, module = "ntio._core")]
pub struct Reader {
    inner: CoreReader,
}

#[pymethods]
impl Reader {
    #[new]
    /// `path`: one file, or several as `[(path, base), ...]` in one offset space (a checkpoint's shards: the first at
    /// base 0, each next base a multiple of 4096 at or past the end of the file before it).
    /// `faults`: a fault-injection spec for tests (`backend/faults.rs`); None: `NTIO_INJECT_FAULTS`.
    #[pyo3(signature = (path, backend=None, queue_depth=32, request_size=1 << 20, faults=None))]
    fn new(
        py: Python<'_>,
        path: Source,
        backend: Option<&str>,
        queue_depth: usize,
        request_size: usize,
        faults: Option<&str>,
    ) -> PyResult<Self> {
        let backend = backend.map(Backend::parse).transpose()?;
        let options = ReaderOptions {
            backend,
            queue_depth,
            request_size,
            faults: faults.map(Faults::parse).transpose()?,
        };
        let shards = path.shards();
        Ok(Self {
            inner: py.detach(|| CoreReader::open_shards(&shards, options))?,
        })
    }

    #[getter]
    fn backend(&self) -> &'static str {
        self.inner.backend().name()
    }

    #[getter]
    fn path(&self) -> String {
        self.inner.path().display().to_string()
    }

    #[getter]
    fn file_size(&self) -> u64 {
        self.inner.file_size()
    }

    #[getter]
    fn alignment(&self) -> usize {
        self.inner.alignment()
    }

    #[getter]
    fn queue_depth(&self) -> usize {
        self.inner.queue_depth()
    }

    #[getter]
    fn request_size(&self) -> usize {
        self.inner.request_size()
    }

    /// Read extents `(file_offset, length, dest_offset)` into `slot` and wait. Every method takes
    /// `checks`: (tensor, file_offset, dest_offset, length, xxh3-64) that the bytes read must match,
    /// verified on the I/O thread; a mismatch fails the read (a `ReadError` naming tensor and offset).
    #[pyo3(signature = (extents, slot, checks=None))]
    fn read(
        &self,
        py: Python<'_>,
        extents: Vec<(u64, usize, usize)>,
        slot: &Slot,
        checks: Option<Vec<CheckTuple>>,
    ) -> PyResult<()> {
        let (extents, dest) = (to_extents(extents), Destination::slot(&slot.inner)?);
        Ok(py.detach(|| self.inner.read(&extents, dest, to_checks(checks)))?)
    }

    /// Start reading extents into `slot`; returns a handle to poll or wait on.
    #[pyo3(signature = (extents, slot, checks=None))]
    fn submit(
        &self,
        extents: Vec<(u64, usize, usize)>,
        slot: &Slot,
        checks: Option<Vec<CheckTuple>>,
    ) -> PyResult<ReadHandle> {
        let pending = self.inner.submit(
            &to_extents(extents),
            Destination::slot(&slot.inner)?,
            to_checks(checks),
        )?;
        Ok(ReadHandle {
            pending,
            dest: None,
            owner: None,
        })
    }

    /// Read extents into `dest`, a writable C-contiguous buffer (numpy array, bytearray, ...), and wait.
    #[pyo3(signature = (extents, dest, checks=None))]
    fn read_into(
        &self,
        py: Python<'_>,
        extents: Vec<(u64, usize, usize)>,
        dest: &Bound<'_, PyAny>,
        checks: Option<Vec<CheckTuple>>,
    ) -> PyResult<()> {
        let extents = to_extents(extents);
        let lent = Lent::bytes(dest, "dest", Access::Write)?;
        // SAFETY: `lent` lives until this function returns, after the read has ended; the caller's frame holds
        // `dest` and it runs no Python code on it meanwhile.
        let dest = unsafe { external(&lent) };
        Ok(py.detach(|| self.inner.read(&extents, dest, to_checks(checks)))?)
    }

    /// Start reading extents into `dest` (as `read_into`); the handle holds `dest`'s buffer (and `owner`, the
    /// object to report as the handle's owner, e.g. the torch tensor `dest` views) until the read has ended.
    #[pyo3(signature = (extents, dest, owner=None, checks=None))]
    fn submit_into(
        &self,
        extents: Vec<(u64, usize, usize)>,
        dest: &Bound<'_, PyAny>,
        owner: Option<Py<PyAny>>,
        checks: Option<Vec<CheckTuple>>,
    ) -> PyResult<ReadHandle> {
        let lent = Lent::bytes(dest, "dest", Access::Write)?;
        // SAFETY: the handle below holds `lent` and drops it only after its `Pending` has ended (`ReadHandle`'s
        // `Drop` waits first); if submit fails, no read is in flight when `lent` drops here. The caller's Python
        // code leaves the memory alone until the handle is waited on (the documented contract of `submit_into`).
        let pending = self.inner.submit(
            &to_extents(extents),
            unsafe { external(&lent) },
            to_checks(checks),
        )?;
        Ok(ReadHandle {
            pending,
            dest: Some(lent),
            owner,
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "Reader({:?}, backend={:?}, alignment={})",
            self.inner.path(),
            self.inner.backend().name(),
            self.inner.alignment()
        )
    }
}

/// A submitted batch. Dropping it waits (without the GIL) for its I/O before its destination goes.
#[pyclass(frozen, module = "ntio._core")]
pub struct ReadHandle {
    pending: Pending,
    /// The caller's memory the batch reads into (None for slots), released only after the I/O has ended.
    dest: Option<Lent<u8>>,
    /// What `owner` reports, when the caller named it (else the object `dest` is exported from).
    owner: Option<Py<PyAny>>,
}

#[pymethods]
impl ReadHandle {
    /// True once the batch has ended (successfully or not).
    fn poll(&self) -> bool {
        self.pending.poll()
    }

    /// Wait for the batch to end; raises its error, if any (a failed check included).
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        Ok(py.detach(|| self.pending.wait())?)
    }

    /// Wait for the batch's bytes to land; raises its I/O error, if any. Its checks may still be
    /// running: nothing computed from the bytes may be shown before `wait` has returned.
    fn wait_landed(&self, py: Python<'_>) -> PyResult<()> {
        Ok(py.detach(|| self.pending.wait_landed())?)
    }

    /// Seconds from submit to the batch's last byte landing (time queued behind earlier batches
    /// included); None while in flight.
    #[getter]
    fn elapsed(&self) -> Option<f64> {
        self.pending.elapsed().map(|d| d.as_secs_f64())
    }

    /// The object whose memory is being read into (None for slots).
    #[getter]
    fn owner(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        match (&self.owner, &self.dest) {
            (Some(owner), _) => Some(owner.clone_ref(py)),
            (None, Some(dest)) => dest.owner(py).map(Bound::unbind),
            (None, None) => None,
        }
    }
}

impl Drop for ReadHandle {
    fn drop(&mut self) {
        // Fields drop after this: `dest` (the export of the destination's memory) only once I/O has ended.
        Python::attach(|py| py.detach(|| self.pending.wait().ok()));
    }
}

#[pyclass(frozen, module = "ntio._core")]
pub struct StagingPool {
    inner: CorePool,
}

#[pymethods]
impl StagingPool {
    #[new]
    fn new(n_slots: usize, slot_size: usize) -> PyResult<Self> {
        Ok(Self {
            inner: CorePool::new(n_slots, slot_size)?,
        })
    }

    /// Take a free slot. `timeout` in seconds: 0 raises SlotBusyError at once when none is
    /// free, None waits as long as it takes.
    #[pyo3(signature = (timeout=0.0))]
    fn acquire(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Slot> {
        let timeout = timeout
            .map(|t| {
                Duration::try_from_secs_f64(t)
                    .map_err(|_| PyValueError::new_err(format!("bad timeout {t}")))
            })
            .transpose()?;
        Ok(Slot {
            inner: py.detach(|| self.inner.acquire(timeout))?,
        })
    }

    fn release(&self, slot: &Slot) -> PyResult<()> {
        if !slot.inner.pool().same_pool(&self.inner) {
            return Err(BufferError::new_err(format!(
                "staging slot {} belongs to another pool",
                slot.inner.index()
            )));
        }
        Ok(slot.inner.release()?)
    }

    #[getter]
    fn n_slots(&self) -> usize {
        self.inner.n_slots()
    }

    #[getter]
    fn slot_size(&self) -> usize {
        self.inner.slot_size()
    }

    #[getter]
    fn free_count(&self) -> usize {
        self.inner.free_count()
    }

    fn __len__(&self) -> usize {
        self.inner.n_slots()
    }
}

/// An acquired staging slot: `size` bytes at `address`, owned by the pool. Released by
/// `release()` or when the last reference goes (after any read into it has ended).
#[pyclass(frozen, module = "ntio._core")]
pub struct Slot {
    inner: CoreSlot,
}

#[pymethods]
impl Slot {
    #[getter]
    fn address(&self) -> usize {
        self.inner.as_ptr() as usize
    }

    #[getter]
    fn size(&self) -> usize {
        self.inner.size()
    }

    #[getter]
    fn index(&self) -> usize {
        self.inner.index()
    }

    #[getter]
    fn acquired(&self) -> bool {
        self.inner.is_acquired()
    }

    #[getter]
    fn in_flight(&self) -> bool {
        self.inner.in_flight()
    }

    fn release(&self) -> PyResult<()> {
        Ok(self.inner.release()?)
    }

    fn __repr__(&self) -> String {
        format!(
            "Slot(index={}, size={}, acquired={})",
            self.inner.index(),
            self.inner.size(),
            self.inner.is_acquired()
        )
    }
}

/// Registers the reader, its handles, staging pools and slots, the I/O exceptions and constants.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("BACKENDS", Backend::ALL.map(Backend::name).to_vec())?;
    m.add("HUGE_PAGE", crate::staging::HUGE_PAGE)?;
    m.add("ReadError", py.get_type::<ReadError>())?;
    m.add("SlotBusyError", py.get_type::<SlotBusyError>())?;
    m.add(
        "BackendUnavailableError",
        py.get_type::<BackendUnavailableError>(),
    )?;
    m.add_class::<Reader>()?;
    m.add_class::<ReadHandle>()?;
    m.add_class::<StagingPool>()?;
    m.add_class::<Slot>()?;
    Ok(())
}
