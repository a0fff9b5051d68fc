//! The ntio store: a model file laid out for streaming, written by `ntio convert` from a GGUF.
//!
//! ```text
//! [0, 4096)            header page (`header.rs`): magic, format version, where the manifest is
//! [4096, ...)          global tensors, then layer 0's tensors, layer 1's, ...: every tensor
//!                      4096-aligned, each layer's tensors back to back (one extent per layer)
//! [manifest_offset, end)  manifest (`manifest.rs`): JSON metadata, tensor table with xxh3-64
//!                      checksums, layer table, reserved re-layouts
//! ```
//! `index.rs` maps layers, tensors and row ranges to extents, for stores and GGUF files alike.

pub mod error;
pub mod header;
pub mod index;
pub mod manifest;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

pub use error::{Result, StoreError};
pub use header::{Header, FORMAT_VERSION, HEADER_SIZE, MAGIC};
pub use index::{plan_layout, ExtentIndex, FileExtent, TensorSpan, STORE_ALIGNMENT};
pub use manifest::{LayerRecord, Manifest, TensorRecord};

/// The checksum of every store tensor: xxh3-64, seed 0.
pub fn checksum(bytes: &[u8]) -> u64 {
    crate::checksum::xxh3_64(bytes)
}

/// Open a store: check its header and manifest (checksum included) and index its tensors.
pub fn open(path: &Path) -> Result<(Manifest, ExtentIndex)> {
    let io_error = |err: std::io::Error| StoreError::Io {
        path: path.to_path_buf(),
        errno: err.raw_os_error().unwrap_or(libc::EIO),
    };
    let file = File::open(path).map_err(io_error)?;
    let file_size = file.metadata().map_err(io_error)?.len();
    let mut page = vec![0u8; HEADER_SIZE.min(file_size as usize)];
    file.read_exact_at(&mut page, 0).map_err(io_error)?;
    let header = Header::decode(&page, path, file_size)?;
    let mut manifest = vec![0u8; header.manifest_length as usize];
    file.read_exact_at(&mut manifest, header.manifest_offset)
        .map_err(io_error)?;
    if checksum(&manifest) != header.manifest_checksum {
        return Err(StoreError::ChecksumMismatch {
            path: path.to_path_buf(),
            tensor: "<manifest>".into(),
            offset: header.manifest_offset,
            length: header.manifest_length,
        });
    }
    Manifest::parse(&manifest, &header, path)
}
