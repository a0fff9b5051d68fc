//! The store's header page: the first 4096 bytes of the file, little-endian.
//!
//! ```text
//! offset  size  field
//!      0     8  magic  b"NTIOSTOR"
//!      8     4  format_version (u32)
//!     12     4  header_size (u32, 4096: where data may start)
//!     16     8  manifest_offset (u64)
//!     24     8  manifest_length (u64)
//!     32     8  manifest_checksum (u64, xxh3-64 of the manifest bytes)
//!     40     8  file_size (u64, = manifest_offset + manifest_length: a shorter file is truncated)
//!     48  4048  zero
//! ```
//! The manifest is written after the data, so data offsets never depend on its size.

use std::path::Path;

use super::error::{Result, StoreError};

pub const MAGIC: &[u8; 8] = b"NTIOSTOR";
pub const HEADER_SIZE: usize = 4096;
/// The newest format this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub format_version: u32,
    pub manifest_offset: u64,
    pub manifest_length: u64,
    pub manifest_checksum: u64,
}

impl Header {
    pub fn file_size(&self) -> u64 {
        self.manifest_offset + self.manifest_length
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut page = vec![0u8; HEADER_SIZE];
        page[0..8].copy_from_slice(MAGIC);
        page[8..12].copy_from_slice(&self.format_version.to_le_bytes());
        page[12..16].copy_from_slice(&(HEADER_SIZE as u32).to_le_bytes());
        page[16..24].copy_from_slice(&self.manifest_offset.to_le_bytes());
        page[24..32].copy_from_slice(&self.manifest_length.to_le_bytes());
        page[32..40].copy_from_slice(&self.manifest_checksum.to_le_bytes());
        page[40..48].copy_from_slice(&self.file_size().to_le_bytes());
        page
    }

    /// Parse the header page of a file of `file_size` bytes; `page` may be shorter than 4096
    /// bytes when the file is.
    pub fn decode(page: &[u8], path: &Path, file_size: u64) -> Result<Self> {
        if page.len() < 8 || &page[0..8] != MAGIC {
            return Err(StoreError::BadMagic {
                path: path.to_path_buf(),
                magic: String::from_utf8_lossy(&page[..page.len().min(8)]).into_owned(),
                expected: String::from_utf8_lossy(MAGIC).into_owned(),
            });
        }
        let truncated = |expected: u64| StoreError::Truncated {
            path: path.to_path_buf(),
            ends_at: file_size,
            expected,
        };
        if page.len() < HEADER_SIZE {
            return Err(truncated(HEADER_SIZE as u64));
        }
        let u32_at = |at: usize| u32::from_le_bytes(page[at..at + 4].try_into().unwrap());
        let u64_at = |at: usize| u64::from_le_bytes(page[at..at + 8].try_into().unwrap());
        let format_version = u32_at(8);
        if format_version > FORMAT_VERSION || format_version == 0 {
            return Err(StoreError::UnsupportedVersion {
                path: path.to_path_buf(),
                version: format_version,
                supported: FORMAT_VERSION,
            });
        }
        let header = Self {
            format_version,
            manifest_offset: u64_at(16),
            manifest_length: u64_at(24),
            manifest_checksum: u64_at(32),
        };
        let recorded_size = u64_at(40);
        let consistent = u32_at(12) as usize == HEADER_SIZE
            && header.manifest_offset >= HEADER_SIZE as u64
            && header.manifest_offset.checked_add(header.manifest_length) == Some(recorded_size);
        if !consistent {
            return Err(StoreError::BadManifest {
                path: path.to_path_buf(),
                reason: "inconsistent header page (manifest offset, length and file size disagree)"
                    .into(),
            });
        }
        if file_size < recorded_size {
            return Err(truncated(recorded_size));
        }
        Ok(header)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: Header = Header {
        format_version: 1,
        manifest_offset: 8192,
        manifest_length: 100,
        manifest_checksum: 0xDEAD_BEEF,
    };

    #[test]
    fn round_trips() {
        let page = HEADER.encode();
        assert_eq!(page.len(), 4096);
        assert_eq!(Header::decode(&page, Path::new("m.ntio"), 8292), Ok(HEADER));
    }

    #[test]
    fn bad_magic_future_version_and_truncation_are_named() {
        let p = Path::new("m.ntio");
        let gguf = Header::decode(b"GGUF\x03\0\0\0", p, 8).unwrap_err();
        assert!(matches!(gguf, StoreError::BadMagic { .. }), "{gguf}");
        let mut page = HEADER.encode();
        page[8..12].copy_from_slice(&2u32.to_le_bytes());
        let future = Header::decode(&page, p, 8292).unwrap_err();
        assert_eq!(
            future.to_string(),
            "m.ntio: ntio store format version 2 is newer than this ntio reads (up to 1); upgrade ntio"
        );
        let short = Header::decode(&HEADER.encode(), p, 8000).unwrap_err();
        assert_eq!(
            short.to_string(),
            "m.ntio: truncated ntio store: the file ends at offset 8000, but its header says 8292 bytes"
        );
        let cut = Header::decode(&HEADER.encode()[..100], p, 100).unwrap_err();
        assert!(matches!(cut, StoreError::Truncated { ends_at: 100, .. }));
        let mut bad = HEADER.encode();
        bad[40] ^= 1;
        assert!(matches!(
            Header::decode(&bad, p, 1 << 20),
            Err(StoreError::BadManifest { .. })
        ));
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// Any page and file size: an error of one line, or a header whose manifest lies
            /// after the header page and inside the file.
            #[test]
            fn any_page_decodes_to_a_consistent_header_or_one_line(
                words in proptest::collection::vec(any::<u64>(), 0..7),
                edit in any::<bool>(),
                file_size in any::<u64>(),
            ) {
                let mut page = if edit { HEADER.encode() } else { MAGIC.to_vec() };
                for (i, w) in words.iter().enumerate() {
                    let at = 8 + 8 * i;
                    if at + 8 <= page.len() {
                        page[at..at + 8].copy_from_slice(&w.to_le_bytes());
                    } else {
                        page.extend(w.to_le_bytes());
                    }
                }
                match Header::decode(&page, Path::new("s.ntio"), file_size) {
                    Ok(h) => {
                        let end = h.manifest_offset.checked_add(h.manifest_length);
                        prop_assert!(h.manifest_offset >= HEADER_SIZE as u64);
                        prop_assert!(end.is_some_and(|end| end <= file_size));
                    }
                    Err(e) => prop_assert!(!e.to_string().contains('\n')),
                }
            }
        }
    }
}
