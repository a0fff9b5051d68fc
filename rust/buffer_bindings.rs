//! Python buffers lent to Rust: a buffer-protocol export (numpy array, `bytearray`, `memoryview`; torch tensors
//! through `Tensor.numpy()`), checked by `crate::buffers` for one named argument and held while Rust uses the
//! memory. Defines `ntio._core.BufferError`, the exception every refused buffer raises.

use std::marker::PhantomData;

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::buffers::{self, Access, Export, Item};

pyo3::create_exception!(
    ntio._core,
    BufferError,
    PyValueError,
    "A buffer cannot be used: wrong element type, not C-contiguous, read-only, wrong size, overlapping another, \
     or (for reads) too small for the extents or a slot not acquired."
);

impl From<buffers::BufferError> for PyErr {
    fn from(err: buffers::BufferError) -> PyErr {
        BufferError::new_err(err.to_string())
    }
}

/// The export of argument `name`, or a TypeError naming it where `obj` exports none.
fn export(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<PyUntypedBuffer> {
    PyUntypedBuffer::get(obj).map_err(|err| {
        if err.is_instance_of::<PyTypeError>(obj.py()) {
            PyTypeError::new_err(format!(
                "{name} must support the buffer protocol (a numpy array; torch tensors via .numpy()), got {}",
                obj.get_type().name().map_or_else(|_| "?".into(), |n| n.to_string())
            ))
        } else {
            err
        }
    })
}

/// What `buffer` says about its memory, for `crate::buffers`.
fn describe(buffer: &PyUntypedBuffer) -> Export<'_> {
    Export {
        address: buffer.buf_ptr() as usize,
        len_bytes: buffer.len_bytes(),
        item_size: buffer.item_size(),
        format: buffer.format().to_bytes(),
        readonly: buffer.readonly(),
        c_contiguous: buffer.is_c_contiguous(),
    }
}

/// A checked export of `len` elements of `T`, C-contiguous, aligned, writable if acquired for writing. The
/// export (and with it the exporter, which cannot resize or free the memory meanwhile) lives as long as this.
pub struct Lent<T> {
    buffer: PyUntypedBuffer,
    len: usize,
    access: Access,
    _item: PhantomData<T>,
}

impl<T: Item> Lent<T> {
    /// Argument `name`: `obj` holding `T` elements.
    pub fn typed(obj: &Bound<'_, PyAny>, name: &'static str, access: Access) -> PyResult<Self> {
        Self::acquire(obj, name, Some(T::ELEM), access)
    }
}

impl Lent<u8> {
    /// Argument `name`: `obj`'s memory as bytes, whatever its element type (a read destination).
    pub fn bytes(obj: &Bound<'_, PyAny>, name: &'static str, access: Access) -> PyResult<Self> {
        Self::acquire(obj, name, None, access)
    }
}

impl Lent<u16> {
    /// Argument `name`: `obj` holding 16-bit floats of type `elem` (`Elem::F16` or `Elem::Bf16`), as their bits.
    pub fn halves(
        obj: &Bound<'_, PyAny>,
        name: &'static str,
        elem: buffers::Elem,
        access: Access,
    ) -> PyResult<Self> {
        debug_assert_eq!(elem.size(), 2);
        Self::acquire(obj, name, Some(elem), access)
    }
}

impl<T> Lent<T> {
    fn acquire(
        obj: &Bound<'_, PyAny>,
        name: &'static str,
        elem: Option<buffers::Elem>,
        access: Access,
    ) -> PyResult<Self> {
        let buffer = export(obj, name)?;
        let len = buffers::check(name, &describe(&buffer), elem, access)?;
        Ok(Self {
            buffer,
            len,
            access,
            _item: PhantomData,
        })
    }

    /// Elements (bytes for `Lent::bytes`).
    pub fn len(&self) -> usize {
        self.len
    }

    /// (address, bytes) of the memory, for overlap checks.
    pub fn range(&self) -> (usize, usize) {
        (self.buffer.buf_ptr() as usize, self.len * size_of::<T>())
    }

    fn ptr(&self) -> *mut T {
        if self.len == 0 {
            // An empty export may report any address (even null); an empty slice needs an aligned non-null one.
            std::ptr::NonNull::dangling().as_ptr()
        } else {
            self.buffer.buf_ptr().cast()
        }
    }

    /// The memory as a slice.
    ///
    /// # Safety
    /// Nothing may write to the memory while the slice is used: the caller's contract with its own Python code
    /// (no thread writes an argument during the call), and no `as_mut_slice` of an overlapping `Lent`.
    pub unsafe fn as_slice(&self) -> &[T] {
        // SAFETY: `check` found `len` elements of `T`, C-contiguous from `ptr` and aligned for `T` (or none:
        // `ptr` is then dangling and aligned); the export keeps them allocated while `self` lives; the caller
        // rules out writers.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }

    /// The memory as a mutable slice.
    ///
    /// # Safety
    /// Nothing else may read or write the memory while the slice is used: the caller's contract with its own
    /// Python code, and no other slice of this or an overlapping `Lent` (check with `buffers::disjoint`).
    #[allow(clippy::mut_from_ref)] // the memory is Python's, not `self`'s; exclusivity is the caller's contract
    pub unsafe fn as_mut_slice(&self) -> &mut [T] {
        debug_assert_eq!(self.access, Access::Write);
        // SAFETY: as `as_slice`, and the export is writable (`check` with `Access::Write`, which every caller of
        // this method passes); the caller rules out every other access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }

    /// The start of the memory, for I/O that writes it later (`Destination::external`).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        debug_assert_eq!(self.access, Access::Write);
        self.ptr().cast()
    }

    /// The object whose memory this is.
    pub fn owner<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyAny>> {
        self.buffer.obj(py).cloned()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("BufferError", m.py().get_type::<BufferError>())
}
