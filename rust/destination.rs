//! Where a batch of extents lands: a staging slot (Rust-owned, registrable with io_uring) or
//! external memory the caller owns (a numpy array, a CPU or pinned torch tensor).

use crate::error::Result;
use crate::staging::{Slot, SlotGuard, StagingPool};

pub enum Destination {
    Slot(SlotGuard),
    External { ptr: *mut u8, len: usize },
}

// SAFETY: a slot's bytes are kept alive and reserved by its guard; external memory is the
// caller's promise (see `Destination::external`). Nothing here is tied to a thread.
unsafe impl Send for Destination {}
// SAFETY: as above; shared references only read the pointer and length.
unsafe impl Sync for Destination {}

impl Destination {
    /// Read into `slot`; fails if it is not acquired by this handle or already has a read in flight.
    pub fn slot(slot: &Slot) -> Result<Self> {
        Ok(Self::Slot(slot.begin_read()?))
    }

    /// Read into `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be valid for writes, and not read or written by anyone else,
    /// until the read that uses this destination has completed (its `Pending` waited or dropped).
    pub unsafe fn external(ptr: *mut u8, len: usize) -> Self {
        Self::External { ptr, len }
    }

    pub fn as_ptr(&self) -> *mut u8 {
        match self {
            Self::Slot(guard) => guard.as_ptr(),
            Self::External { ptr, .. } => *ptr,
        }
    }

    pub fn capacity(&self) -> usize {
        match self {
            Self::Slot(guard) => guard.size(),
            Self::External { len, .. } => *len,
        }
    }

    /// The pool and slot index, when the destination is a slot (for io_uring fixed buffers).
    pub fn slot_of_pool(&self) -> Option<(&StagingPool, usize)> {
        match self {
            Self::Slot(guard) => Some((guard.pool(), guard.index())),
            Self::External { .. } => None,
        }
    }
}
