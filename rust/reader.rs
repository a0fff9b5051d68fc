//! The reader: one open file and one backend, reading batches of extents into a destination,
//! either now (`read`) or in the background (`submit`, which returns a `Pending`).
//! A `Reader` is `Send + Sync` and cheap to clone; concurrent reads each take their own ring.

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::backend::{self, pread, uring, Backend, Batch, OpenFile};
use crate::destination::Destination;
use crate::error::{Error, Result};
use crate::extent::{self, Extent, Geometry};

/// Largest request: io_uring lengths are 32-bit, and bigger requests gain nothing.
const MAX_REQUEST_SIZE: usize = 1 << 30;
const MAX_QUEUE_DEPTH: usize = 4096;

#[derive(Debug, Clone, Copy)]
pub struct ReaderOptions {
    /// `None`: `NTIO_IO_BACKEND` if set, else probe.
    pub backend: Option<Backend>,
    /// Requests in flight per batch (ring entries, or pread threads).
    pub queue_depth: usize,
    /// Largest single read, rounded up to the alignment.
    pub request_size: usize,
}

impl Default for ReaderOptions {
    fn default() -> Self {
        Self {
            backend: None,
            queue_depth: 32,
            request_size: 1 << 20,
        }
    }
}

#[derive(Clone)]
pub struct Reader {
    inner: Arc<Inner>,
}

struct Inner {
    file: OpenFile,
    backend: Backend,
    geometry: Geometry,
    queue_depth: usize,
    /// Idle rings (io_uring only): a read takes one, or makes one, and puts it back.
    rings: Mutex<Vec<uring::Ring>>,
}

impl Reader {
    pub fn open(path: impl AsRef<Path>, options: ReaderOptions) -> Result<Self> {
        let ReaderOptions {
            backend,
            queue_depth,
            request_size,
        } = options;
        if !(1..=MAX_QUEUE_DEPTH).contains(&queue_depth) {
            return Err(Error::InvalidArgument(format!(
                "queue_depth must be in 1..={MAX_QUEUE_DEPTH}, got {queue_depth}"
            )));
        }
        if !(1..=MAX_REQUEST_SIZE).contains(&request_size) {
            return Err(Error::InvalidArgument(format!(
                "request_size must be in 1..={MAX_REQUEST_SIZE}, got {request_size}"
            )));
        }
        let requested = match backend {
            Some(backend) => Some(backend),
            None => Backend::from_env()?,
        };
        let (file, backend, ring) = backend::open(path.as_ref(), requested, queue_depth as u32)?;
        let geometry = Geometry {
            alignment: file.alignment,
            request_size: request_size.next_multiple_of(file.alignment),
        };
        let rings = Mutex::new(ring.into_iter().collect());
        Ok(Self {
            inner: Arc::new(Inner {
                file,
                backend,
                geometry,
                queue_depth,
                rings,
            }),
        })
    }

    pub fn backend(&self) -> Backend {
        self.inner.backend
    }

    pub fn path(&self) -> &Path {
        &self.inner.file.path
    }

    pub fn file_size(&self) -> u64 {
        self.inner.file.size
    }

    pub fn alignment(&self) -> usize {
        self.inner.geometry.alignment
    }

    pub fn request_size(&self) -> usize {
        self.inner.geometry.request_size
    }

    pub fn queue_depth(&self) -> usize {
        self.inner.queue_depth
    }

    /// Read `extents` into `dest` and wait for them.
    pub fn read(&self, extents: &[Extent], dest: Destination) -> Result<()> {
        let batch = self.inner.prepare(extents, dest)?;
        self.inner.execute(&batch)
    }

    /// `read`, returning each request's latency (first read submitted → completed), in
    /// completion order: per-request timing for benchmarks, like fio's completion latency.
    pub fn read_timed(&self, extents: &[Extent], dest: Destination) -> Result<Vec<Duration>> {
        let batch = self.inner.prepare(extents, dest)?.timed();
        self.inner.execute(&batch)?;
        let latencies = batch.latencies.expect("a timed batch");
        Ok(latencies.into_inner().unwrap_or_else(|e| e.into_inner()))
    }

    /// Start reading `extents` into `dest` on a background thread. Bad extents fail here;
    /// I/O errors surface at `Pending::wait`.
    pub fn submit(&self, extents: &[Extent], dest: Destination) -> Result<Pending> {
        let batch = self.inner.prepare(extents, dest)?;
        let completion = Arc::new(Completion::default());
        let (inner, done) = (Arc::clone(&self.inner), Arc::clone(&completion));
        std::thread::Builder::new()
            .name("ntio-submit".into())
            .spawn(move || {
                let started = Instant::now();
                let result = inner.execute(&batch);
                drop(batch); // frees the destination (slot) before anyone is told it is done
                done.finish(result, started.elapsed());
            })
            .map_err(|err| Error::System {
                what: "spawning a reader thread",
                errno: crate::error::errno_of(&err),
            })?;
        Ok(Pending { completion })
    }
}

impl Inner {
    fn prepare(&self, extents: &[Extent], dest: Destination) -> Result<Batch> {
        extent::validate(extents, &self.file.path, self.file.size, dest.capacity())?;
        let requests = extent::plan(extents, self.geometry, dest.as_ptr() as usize);
        Ok(Batch::new(requests, dest))
    }

    fn execute(&self, batch: &Batch) -> Result<()> {
        if batch.requests.is_empty() {
            return Ok(());
        }
        match self.backend {
            Backend::IoUring => {
                let idle = self.rings.lock().unwrap_or_else(|e| e.into_inner()).pop();
                let mut ring = match idle {
                    Some(ring) => ring,
                    None => {
                        uring::Ring::new(self.queue_depth as u32).map_err(|err| Error::System {
                            what: "creating an io_uring",
                            errno: crate::error::errno_of(&err),
                        })?
                    }
                };
                let result = uring::run(&mut ring, &self.file, batch);
                self.rings
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(ring);
                result
            }
            Backend::Pread | Backend::Buffered => pread::run(&self.file, batch, self.queue_depth),
        }
    }
}

#[derive(Default)]
struct Completion {
    result: Mutex<Option<Result<()>>>,
    /// How long the batch's I/O took on its thread; set just before `result`.
    elapsed: Mutex<Option<Duration>>,
    done: Condvar,
}

impl Completion {
    fn finish(&self, result: Result<()>, elapsed: Duration) {
        *self.elapsed.lock().unwrap_or_else(|e| e.into_inner()) = Some(elapsed);
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
        self.done.notify_all();
    }
}

/// A submitted batch. Dropping it waits for the batch's I/O to end, so memory it reads into
/// can be freed right after.
pub struct Pending {
    completion: Arc<Completion>,
}

impl Pending {
    /// Whether the batch has finished (successfully or not).
    pub fn poll(&self) -> bool {
        self.completion
            .result
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// How long the batch's I/O took (its thread's start to its end); None while in flight.
    /// Callers compare it with how long they were blocked in `wait` to measure overlap.
    pub fn elapsed(&self) -> Option<Duration> {
        *self
            .completion
            .elapsed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Wait for the batch; its error, if any (every call returns the same outcome).
    pub fn wait(&self) -> Result<()> {
        let mut result = self
            .completion
            .result
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(outcome) = result.as_ref() {
                return outcome.clone();
            }
            result = self
                .completion
                .done
                .wait(result)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let _ = self.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::staging::StagingPool;

    /// A file of `len` pseudo-random bytes in the system temp dir (disk-backed on Linux CI).
    fn temp_file(name: &str, len: usize) -> (std::path::PathBuf, Vec<u8>) {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let path =
            std::env::temp_dir().join(format!("ntio-reader-test-{}-{name}", std::process::id()));
        std::fs::write(&path, &bytes).unwrap();
        (path, bytes)
    }

    fn readers(path: &Path) -> Vec<Reader> {
        let options = ReaderOptions {
            request_size: 8192,
            queue_depth: 4,
            ..Default::default()
        };
        Backend::ALL
            .into_iter()
            .filter_map(|b| {
                Reader::open(
                    path,
                    ReaderOptions {
                        backend: Some(b),
                        ..options
                    },
                )
                .ok()
            })
            .collect()
    }

    #[test]
    fn every_backend_reads_unaligned_extents_into_slots_and_external_memory() {
        let (path, bytes) = temp_file("extents", 100_003);
        let extents = [
            Extent {
                file_offset: 0,
                length: 4096,
                dest_offset: 0,
            },
            Extent {
                file_offset: 5,
                length: 30_000,
                dest_offset: 4096,
            },
            Extent {
                file_offset: 70_000,
                length: 30_003,
                dest_offset: 40_001,
            },
            Extent {
                file_offset: 99_999,
                length: 0,
                dest_offset: 0,
            },
        ];
        let pool = StagingPool::new(1, 80_000).unwrap();
        let readers = readers(&path);
        assert!(readers.iter().any(|r| r.backend() == Backend::Buffered));
        for reader in readers {
            let slot = pool.acquire(Some(Duration::ZERO)).unwrap();
            reader
                .read(&extents, Destination::slot(&slot).unwrap())
                .unwrap();
            let mut external = vec![0u8; 80_000];
            // SAFETY: `external` outlives the wait below and is not touched until then.
            let dest = unsafe { Destination::external(external.as_mut_ptr(), external.len()) };
            reader.submit(&extents, dest).unwrap().wait().unwrap();
            // SAFETY: the read into the slot has completed; nothing else writes it.
            let in_slot = unsafe { std::slice::from_raw_parts(slot.as_ptr(), 80_000) };
            for e in extents {
                let want = &bytes[e.file_offset as usize..e.file_offset as usize + e.length];
                assert_eq!(
                    &in_slot[e.dest_offset..e.dest_offset + e.length],
                    want,
                    "{:?} {e:?}",
                    reader.backend()
                );
                assert_eq!(
                    &external[e.dest_offset..e.dest_offset + e.length],
                    want,
                    "{:?} {e:?}",
                    reader.backend()
                );
            }
            slot.release().unwrap();
        }
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn timed_reads_report_one_latency_per_request() {
        let (path, bytes) = temp_file("timed", 100_000);
        for reader in readers(&path) {
            let mut dest = vec![0u8; 100_000];
            // SAFETY: `dest` outlives the read, which has completed when read_timed returns.
            let external = unsafe { Destination::external(dest.as_mut_ptr(), dest.len()) };
            let extent = Extent {
                file_offset: 0,
                length: 100_000,
                dest_offset: 0,
            };
            let latencies = reader.read_timed(&[extent], external).unwrap();
            // 8192-byte requests: 13 (the last one bounces its unaligned tail, or is short when buffered).
            assert_eq!(latencies.len(), 13, "{:?}", reader.backend());
            assert!(latencies.iter().all(|d| !d.is_zero()));
            assert_eq!(dest, bytes);
        }
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn slot_stays_busy_until_a_submitted_read_is_waited() {
        let (path, _) = temp_file("busy", 1 << 20);
        let pool = StagingPool::new(1, 1 << 20).unwrap();
        let slot = pool.acquire(None).unwrap();
        for reader in readers(&path) {
            let pending = reader
                .submit(
                    &[Extent {
                        file_offset: 0,
                        length: 1 << 20,
                        dest_offset: 0,
                    }],
                    Destination::slot(&slot).unwrap(),
                )
                .unwrap();
            assert!(
                matches!(Destination::slot(&slot), Err(Error::SlotBusy { .. })) || pending.poll()
            );
            pending.wait().unwrap();
            assert!(pending.poll() && !slot.in_flight());
        }
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn bad_options_and_missing_files_are_errors() {
        let missing = Reader::open("/nonexistent/model.gguf", ReaderOptions::default())
            .err()
            .unwrap();
        assert!(
            matches!(
                missing,
                Error::Open {
                    errno: libc::ENOENT,
                    ..
                }
            ),
            "{missing}"
        );
        let (path, _) = temp_file("options", 10);
        let zero_depth = ReaderOptions {
            queue_depth: 0,
            ..Default::default()
        };
        assert!(matches!(
            Reader::open(&path, zero_depth),
            Err(Error::InvalidArgument(_))
        ));
        std::fs::remove_file(path).unwrap();
    }
}
