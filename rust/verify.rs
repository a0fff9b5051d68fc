//! Checksum checks that travel with a batch: "destination bytes [dest_offset, dest_offset + length)
//! must hash to `checksum`", one per store tensor a batch reads whole. The backend runs them after
//! the batch's last byte has landed and before the batch ends: a corrupt tensor fails the batch. They
//! run off the caller's thread, overlapping its compute like the read itself: on the batch's own
//! thread (pread), or on a `Verifier` thread beside the io_uring thread, which keeps reaping and
//! submitting while a batch is hashed. A caller may compute on landed bytes while they are hashed
//! (`Pending::wait_landed`) if it shows nothing computed from them before the batch ends well.

use std::path::Path;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use crate::error::{Error, Result};
use crate::extent::Extent;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// The tensor, for the error message.
    pub tensor: Arc<str>,
    /// Where the tensor starts in the file, for the error message.
    pub file_offset: u64,
    pub dest_offset: usize,
    pub length: usize,
    /// xxh3-64 of the bytes (the store manifest's).
    pub checksum: u64,
}

/// Every check must lie in bytes that `extents` write (so it never hashes stale memory).
pub fn validate(checks: &[Check], extents: &[Extent]) -> Result<()> {
    if checks.is_empty() {
        return Ok(());
    }
    // Destination ranges written by the batch, merged: [start, end).
    let mut written: Vec<(usize, usize)> = extents
        .iter()
        .filter(|e| e.length > 0)
        .map(|e| (e.dest_offset, e.dest_offset.saturating_add(e.length)))
        .collect();
    written.sort_unstable();
    let mut merged: Vec<(usize, usize)> = Vec::with_capacity(written.len());
    for (start, end) in written {
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    for check in checks.iter().filter(|c| c.length > 0) {
        let end = check.dest_offset.checked_add(check.length);
        let covered = end.is_some_and(|end| {
            let i = merged.partition_point(|&(start, _)| start <= check.dest_offset);
            i > 0 && merged[i - 1].1 >= end
        });
        if !covered {
            return Err(Error::InvalidArgument(format!(
                "checksum check of tensor {:?} covers destination bytes {}..{} that the batch does not read",
                check.tensor,
                check.dest_offset,
                check.dest_offset as u128 + check.length as u128
            )));
        }
    }
    Ok(())
}

/// Hash each checked range of `dest` and compare; the first mismatch is `Error::Corrupt`.
///
/// # Safety
/// `dest` must point to memory holding every checked range (`validate` against the batch's
/// extents, which `extent::validate` kept inside the destination), fully written and not being
/// written by anyone while this runs.
pub unsafe fn verify(checks: &[Check], dest: *const u8, path: &Path) -> Result<()> {
    for check in checks {
        // SAFETY: the caller's contract: the range is inside the destination, written and stable.
        let bytes =
            unsafe { std::slice::from_raw_parts(dest.add(check.dest_offset), check.length) };
        if crate::store::checksum(bytes) != check.checksum {
            return Err(Error::Corrupt {
                path: path.to_path_buf(),
                tensor: check.tensor.to_string(),
                offset: check.file_offset,
                length: check.length as u64,
            });
        }
    }
    Ok(())
}

type Task = Box<dyn FnOnce() + Send>;

/// A thread that runs tasks (a batch's checks, then its completion) in the order they are given.
/// Dropping it runs every task already given, then joins the thread.
pub struct Verifier {
    tasks: Option<mpsc::Sender<Task>>,
    thread: Option<JoinHandle<()>>,
}

impl Verifier {
    pub fn start() -> Result<Self> {
        let (tasks, queue) = mpsc::channel::<Task>();
        let thread = std::thread::Builder::new()
            .name("ntio-verify".into())
            .spawn(move || queue.into_iter().for_each(|task| task()))
            .map_err(|err| Error::System {
                what: "spawning the checksum thread",
                errno: crate::error::errno_of(&err),
            })?;
        Ok(Self {
            tasks: Some(tasks),
            thread: Some(thread),
        })
    }

    /// Run `task` on the verifier thread (or here, should that thread be gone).
    pub fn run(&self, task: impl FnOnce() + Send + 'static) {
        let sent = match &self.tasks {
            Some(tasks) => tasks.send(Box::new(task)),
            None => Err(mpsc::SendError(Box::new(task) as Task)),
        };
        if let Err(mpsc::SendError(task)) = sent {
            task();
        }
    }
}

impl Drop for Verifier {
    fn drop(&mut self) {
        drop(self.tasks.take()); // the thread ends once it has run every task given
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(dest_offset: usize, length: usize, checksum: u64) -> Check {
        Check {
            tensor: "blk.0.ffn_up.weight".into(),
            file_offset: 8192,
            dest_offset,
            length,
            checksum,
        }
    }

    fn extent(dest_offset: usize, length: usize) -> Extent {
        Extent {
            file_offset: 0,
            length,
            dest_offset,
        }
    }

    #[test]
    fn checks_must_lie_in_bytes_the_batch_writes() {
        let extents = [extent(0, 100), extent(100, 50), extent(300, 10)];
        assert!(validate(&[check(10, 140, 0), check(300, 10, 0)], &extents).is_ok());
        for bad in [
            check(140, 20, 0),
            check(200, 1, 0),
            check(305, 6, 0),
            check(usize::MAX, 2, 0),
        ] {
            assert!(matches!(
                validate(&[bad], &extents),
                Err(Error::InvalidArgument(_))
            ));
        }
    }

    #[test]
    fn a_flipped_bit_is_a_corrupt_error_naming_tensor_and_offset() {
        let mut data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let good = crate::store::checksum(&data[100..600]);
        let path = Path::new("/models/m.ntio");
        // SAFETY: data holds bytes 100..600 and nothing writes them meanwhile.
        assert!(unsafe { verify(&[check(100, 500, good)], data.as_ptr(), path) }.is_ok());
        data[599] ^= 0x10;
        // SAFETY: as above.
        let err = unsafe { verify(&[check(100, 500, good)], data.as_ptr(), path) }.unwrap_err();
        let message = err.to_string();
        assert!(
            matches!(
                err,
                Error::Corrupt {
                    offset: 8192,
                    length: 500,
                    ..
                }
            ),
            "{message}"
        );
        assert!(
            message
                .starts_with("/models/m.ntio: checksum mismatch in tensor 'blk.0.ffn_up.weight'"),
            "{message}"
        );
    }
}
