//! Errors of the store and of the extent index. Each names the file and, where one is at fault,
//! the tensor, offset and length, so the user sees one actionable line.

use std::path::PathBuf;

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StoreError {
    #[error("{}: not an ntio store (magic {magic:?}, expected {expected:?})", path.display())]
    BadMagic {
        path: PathBuf,
        magic: String,
        expected: String,
    },

    #[error("{}: ntio store format version {version} is newer than this ntio reads \
             (up to {supported}); upgrade ntio", path.display())]
    UnsupportedVersion {
        path: PathBuf,
        version: u32,
        supported: u32,
    },

    #[error("{}: truncated ntio store: the file ends at offset {ends_at}, \
             but its header says {expected} bytes", path.display())]
    Truncated {
        path: PathBuf,
        ends_at: u64,
        expected: u64,
    },

    #[error("{}: bad ntio store manifest: {reason}", path.display())]
    BadManifest { path: PathBuf, reason: String },

    #[error("{}: checksum mismatch in tensor '{tensor}' (extent at offset {offset}, {length} bytes)",
            path.display())]
    ChecksumMismatch {
        path: PathBuf,
        tensor: String,
        offset: u64,
        length: u64,
    },

    /// A lookup in the index asked for something the file does not have.
    #[error("{}: {what}", path.display())]
    NotFound { path: PathBuf, what: String },

    #[error("{}: cannot read: {}", path.display(), std::io::Error::from_raw_os_error(*errno))]
    Io { path: PathBuf, errno: i32 },
}
