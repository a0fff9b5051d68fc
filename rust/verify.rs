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

use crate::checksum::Progressive;
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

/// A batch's checks, hashed as its bytes land: each request that lands moves the "landed up to" mark
/// to the first destination byte of the first request (in destination order) still in flight, and
/// every check takes the whole 1 KiB blocks below that mark while they are still in cache. `verify`
/// hashes the rest once the batch's I/O is over, and compares.
pub struct Checks {
    checks: Vec<Check>,
    hashes: Vec<Progressive>,
    /// Each request's first destination byte.
    request_starts: Vec<usize>,
    /// Request indices by `request_starts`; `order[..landed_prefix]` have all landed.
    order: Vec<usize>,
    landed: Vec<bool>,
    landed_prefix: usize,
}

impl Checks {
    /// `checks` on a batch whose requests write from `request_starts` on (one per request).
    pub fn new(checks: Vec<Check>, request_starts: Vec<usize>) -> Self {
        let mut order: Vec<usize> = (0..request_starts.len()).collect();
        order.sort_by_key(|&i| request_starts[i]);
        Self {
            hashes: checks.iter().map(|c| Progressive::new(c.length)).collect(),
            checks,
            landed: vec![false; request_starts.len()],
            request_starts,
            order,
            landed_prefix: 0,
        }
    }

    /// Request `request` has landed (its bytes, bounce copies included, are in `dest`).
    ///
    /// # Safety
    /// `dest` must hold every checked range (`validate`d against the batch's extents, which
    /// `extent::validate` kept inside the destination); every request marked landed must have ended.
    pub unsafe fn landed(&mut self, request: usize, dest: *const u8) {
        self.landed[request] = true;
        while self.landed_prefix < self.order.len() && self.landed[self.order[self.landed_prefix]] {
            self.landed_prefix += 1;
        }
        // Bytes below `mark` that any request writes were written by landed requests only: every request
        // still in flight starts at or above it.
        let mark = match self.order.get(self.landed_prefix) {
            Some(&first_in_flight) => self.request_starts[first_in_flight],
            None => usize::MAX,
        };
        for (check, hash) in self.checks.iter().zip(&mut self.hashes) {
            let landed = mark.saturating_sub(check.dest_offset).min(check.length);
            if landed > 0 {
                // SAFETY: the range is inside the destination (caller) and its bytes have all landed.
                hash.advance(unsafe {
                    std::slice::from_raw_parts(dest.add(check.dest_offset), landed)
                });
            }
        }
    }

    /// Hash what is left of each check and compare; the first mismatch is `Error::Corrupt`.
    ///
    /// # Safety
    /// As `landed`, and the batch's I/O must be over: nothing writes `dest` any more.
    pub unsafe fn verify(&self, dest: *const u8, path: &Path) -> Result<()> {
        for (check, hash) in self.checks.iter().zip(self.hashes.iter().cloned()) {
            // SAFETY: the caller's contract: the range is inside the destination, written and stable.
            let bytes =
                unsafe { std::slice::from_raw_parts(dest.add(check.dest_offset), check.length) };
            if hash.finish(bytes) != check.checksum {
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

    /// `Checks` over `data` for `checks`, requests of `request_len` bytes from 0 landing in `order`: each
    /// request's bytes are copied into a zeroed destination only as it lands, so a hash of bytes that had
    /// not landed yet would not match.
    fn land_and_verify(
        data: &[u8],
        checks: Vec<Check>,
        request_len: usize,
        order: &[usize],
    ) -> Result<()> {
        let starts: Vec<usize> = (0..data.len()).step_by(request_len).collect();
        let mut dest = vec![0u8; data.len()];
        let mut batch = Checks::new(checks, starts.clone());
        for &r in order {
            let range = starts[r]..(starts[r] + request_len).min(data.len());
            dest[range.clone()].copy_from_slice(&data[range]);
            // SAFETY: dest holds every checked range; request r's bytes are in.
            unsafe { batch.landed(r, dest.as_ptr()) };
        }
        // SAFETY: every request has landed and nothing writes dest.
        unsafe { batch.verify(dest.as_ptr(), Path::new("/models/m.ntio")) }
    }

    #[test]
    fn checks_hashed_as_requests_land_in_any_order_match_and_catch_a_flip() {
        let data: Vec<u8> = (0..50_000u32).map(|i| (i * 7 + i / 255) as u8).collect();
        let checks = || {
            vec![
                check(100, 20_000, crate::store::checksum(&data[100..20_100])),
                check(
                    20_100,
                    29_000,
                    crate::store::checksum(&data[20_100..49_100]),
                ),
                check(49_100, 200, crate::store::checksum(&data[49_100..49_300])),
            ]
        };
        for order in [
            vec![0, 1, 2, 3, 4, 5, 6],
            vec![3, 0, 6, 2, 1, 5, 4],
            vec![6, 5, 4, 3, 2, 1, 0],
        ] {
            land_and_verify(&data, checks(), 8192, &order).unwrap();
            let mut flipped = data.clone();
            flipped[30_000] ^= 0x10;
            let err = land_and_verify(&flipped, checks(), 8192, &order).unwrap_err();
            assert!(
                matches!(&err, Error::Corrupt { tensor, offset: 8192, length: 29_000, .. } if &**tensor == "blk.0.ffn_up.weight"),
                "{err}"
            );
            assert!(err
                .to_string()
                .starts_with("/models/m.ntio: checksum mismatch in tensor 'blk.0.ffn_up.weight'"));
        }
    }
}
