//! The core's one error type. Every variant carries the context a user needs to act on it
//! (file, offset, length, errno); `reader_bindings.rs` maps variants to a few Python exceptions.

use std::io;
use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The file could not be opened or inspected (not found, permission, bad descriptor).
    #[error("{}: cannot open: {}", path.display(), io::Error::from_raw_os_error(*errno))]
    Open { path: PathBuf, errno: i32 },

    /// A read failed with an errno (EIO, EBADF, EINVAL for a misaligned O_DIRECT read, ...).
    #[error("{}: read of {length} bytes at offset {offset} failed: {}",
            path.display(), io::Error::from_raw_os_error(*errno))]
    Io {
        path: PathBuf,
        offset: u64,
        length: u64,
        errno: i32,
    },

    /// An extent reaches past the end of the file (checked before reading, and again if a read
    /// returns 0 bytes early because the file shrank). Never zero-filled.
    #[error("{}: read of {length} bytes at offset {offset} hit end of file at {end_of_file}",
            path.display())]
    UnexpectedEof {
        path: PathBuf,
        offset: u64,
        length: u64,
        end_of_file: u64,
    },

    /// A tensor's bytes, as read, do not hash to the checksum its store records (a flipped bit, a
    /// file changed under the reader). The batch fails: nothing computes on those bytes.
    #[error("{}: checksum mismatch in tensor '{tensor}' (extent at offset {offset}, {length} bytes): \
             the file is corrupt or was changed while it was read", path.display())]
    Corrupt {
        path: PathBuf,
        tensor: String,
        offset: u64,
        length: u64,
    },

    /// An extent's destination range does not fit in the destination buffer.
    #[error(
        "destination of {capacity} bytes is too small for extent {index}: \
             {length} bytes at destination offset {dest_offset}"
    )]
    DestinationTooSmall {
        index: usize,
        dest_offset: u64,
        length: u64,
        capacity: u64,
    },

    /// The slot has a read in flight: it cannot be released or read into again until it completes.
    #[error("staging slot {index} is busy: a read into it is still in flight")]
    SlotBusy { index: usize },

    /// Every slot of the pool is acquired (and none came free within the timeout).
    #[error("no free staging slot among {n_slots}")]
    NoFreeSlot { n_slots: usize },

    /// The slot handle was released (or is stale: the slot was released and acquired again).
    #[error("staging slot {index} is not acquired by this handle")]
    SlotNotAcquired { index: usize },

    /// A backend was forced but cannot work here (io_uring blocked, O_DIRECT refused).
    #[error("{}: I/O backend {backend} is unavailable: {reason}", path.display())]
    BackendUnavailable {
        path: PathBuf,
        backend: &'static str,
        reason: String,
    },

    /// A system resource the reader needs could not be had (ring creation, thread spawn, memory).
    #[error("{what} failed: {}", io::Error::from_raw_os_error(*errno))]
    System { what: &'static str, errno: i32 },

    /// A bad option value (unknown backend name, zero queue depth, ...).
    #[error("{0}")]
    InvalidArgument(String),
}

/// The errno of an `io::Error`, or EIO for errors that carry none.
pub(crate) fn errno_of(err: &io::Error) -> i32 {
    err.raw_os_error().unwrap_or(libc::EIO)
}
