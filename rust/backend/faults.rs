//! Fault injection, for tests of what users see when a disk fails: a reader opened with faults
//! (`ReaderOptions::faults`, or `NTIO_INJECT_FAULTS` in the environment) alters what its reads
//! return, at the one place every backend accounts for a read (`advance`).
//!
//! Spec: comma-separated items, e.g. `eio@1048576,short`:
//! - `eio@OFFSET`: any read that covers file byte OFFSET fails with EIO;
//! - `short`: every read that returned more than one alignment unit reports only half of it
//!   (rounded down to the alignment), so the backend reads the rest again: short reads everywhere.

use crate::error::{Error, Result};

/// Environment variable holding a fault spec, for readers opened without explicit faults.
pub const FAULTS_ENV: &str = "NTIO_INJECT_FAULTS";

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Faults {
    /// File offsets whose reads fail with EIO.
    pub eio_at: Vec<u64>,
    pub short_reads: bool,
}

impl Faults {
    pub fn parse(spec: &str) -> Result<Self> {
        let mut faults = Self::default();
        for item in spec.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            if item == "short" {
                faults.short_reads = true;
            } else if let Some(offset) = item.strip_prefix("eio@") {
                faults
                    .eio_at
                    .push(offset.parse().map_err(|_| bad(spec, item))?);
            } else {
                return Err(bad(spec, item));
            }
        }
        Ok(faults)
    }

    /// The faults named by `NTIO_INJECT_FAULTS`; none when it is unset or empty.
    pub fn from_env() -> Result<Self> {
        match std::env::var(FAULTS_ENV) {
            Ok(spec) => Self::parse(&spec),
            Err(_) => Ok(Self::default()),
        }
    }

    /// What a read of `asked` bytes at `file_offset` returns with these faults, given what it
    /// really returned (`result`: bytes, or an errno). `alignment` keeps a shortened read's end
    /// where the next O_DIRECT read may start.
    pub fn apply(
        &self,
        file_offset: u64,
        asked: usize,
        alignment: usize,
        result: Result<usize, i32>,
    ) -> Result<usize, i32> {
        let end = file_offset.saturating_add(asked as u64);
        if self
            .eio_at
            .iter()
            .any(|&at| (file_offset..end).contains(&at))
        {
            return Err(libc::EIO);
        }
        match result {
            Ok(n) if self.short_reads && n > alignment => {
                Ok((n / 2).max(alignment) / alignment * alignment)
            }
            other => other,
        }
    }
}

fn bad(spec: &str, item: &str) -> Error {
    Error::InvalidArgument(format!(
        "{FAULTS_ENV}={spec:?}: cannot parse {item:?} (expected eio@OFFSET or short)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_bad_ones_name_the_item() {
        let faults = Faults::parse("eio@4096, short").unwrap();
        assert_eq!(
            faults,
            Faults {
                eio_at: vec![4096],
                short_reads: true
            }
        );
        assert_eq!(Faults::parse("").unwrap(), Faults::default());
        let err = Faults::parse("eio@x").unwrap_err().to_string();
        assert!(err.contains("\"eio@x\""), "{err}");
    }

    #[test]
    fn eio_hits_reads_covering_the_offset_and_short_reads_stay_aligned() {
        let faults = Faults::parse("eio@10000,short").unwrap();
        assert_eq!(faults.apply(8192, 4096, 4096, Ok(4096)), Err(libc::EIO));
        assert_eq!(faults.apply(12288, 4096, 4096, Ok(4096)), Ok(4096));
        assert_eq!(faults.apply(16384, 1 << 20, 4096, Ok(1 << 20)), Ok(1 << 19));
        assert_eq!(
            faults.apply(16384, 1 << 20, 4096, Ok(3 * 4096 + 5)),
            Ok(4096)
        );
        assert_eq!(faults.apply(16384, 100, 1, Ok(100)), Ok(50));
        assert_eq!(
            faults.apply(16384, 100, 1, Err(libc::EINTR)),
            Err(libc::EINTR)
        );
    }
}
