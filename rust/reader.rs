//! The reader: one open file (or several in one offset space: a checkpoint's shards) and one
//! backend, reading batches of extents into a destination, either now (`read`) or in the
//! background (`submit`, which returns a `Pending`).
//! A `Reader` is `Send + Sync` and cheap to clone. With io_uring, every read of a reader (from
//! any thread) goes through one I/O thread and its ring, which keeps the queue full across
//! batches; pread and buffered reads run on their own threads, one batch at a time.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::backend::faults::Faults;
use crate::backend::{pread, uring, Backend, Batch, Completion, Files};
use crate::destination::Destination;
use crate::error::{Error, Result};
use crate::extent::{self, Extent, Geometry, Request};
use crate::verify::{self, Check};

/// Largest request: io_uring lengths are 32-bit, and bigger requests gain nothing.
const MAX_REQUEST_SIZE: usize = 1 << 30;
const MAX_QUEUE_DEPTH: usize = 4096;

#[derive(Debug, Clone)]
pub struct ReaderOptions {
    /// `None`: `NTIO_IO_BACKEND` if set, else probe.
    pub backend: Option<Backend>,
    /// Requests in flight: io_uring, per reader (one ring shared by all its batches); pread, per
    /// batch (threads).
    pub queue_depth: usize,
    /// Largest single read, rounded up to the alignment.
    pub request_size: usize,
    /// Faults to inject (tests); `None`: `NTIO_INJECT_FAULTS` if set, else none.
    pub faults: Option<Faults>,
}

impl Default for ReaderOptions {
    fn default() -> Self {
        Self {
            backend: None,
            queue_depth: 32,
            request_size: 1 << 20,
            faults: None,
        }
    }
}

#[derive(Clone)]
pub struct Reader {
    inner: Arc<Inner>,
}

struct Inner {
    files: Arc<Files>,
    backend: Backend,
    geometry: Geometry,
    queue_depth: usize,
    /// The io_uring thread (io_uring only). Dropped with the reader: it drains, then ends.
    queue: Option<uring::Queue>,
}

impl Reader {
    pub fn open(path: impl AsRef<Path>, options: ReaderOptions) -> Result<Self> {
        Self::open_shards(&[(path.as_ref().to_path_buf(), 0)], options)
    }

    /// A reader over several files in one offset space, each `(path, base)` (see `backend::Files`):
    /// an extent lies inside one file; a batch's extents may come from any of them.
    pub fn open_shards(shards: &[(PathBuf, u64)], options: ReaderOptions) -> Result<Self> {
        let ReaderOptions {
            backend,
            queue_depth,
            request_size,
            faults,
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
        let faults = match faults {
            Some(faults) => faults,
            None => Faults::from_env()?,
        };
        let (files, backend, ring) = Files::open(shards, requested, queue_depth as u32, &faults)?;
        let geometry = Geometry {
            alignment: files.alignment(),
            request_size: request_size.next_multiple_of(files.alignment()),
        };
        let files = Arc::new(files);
        let queue = match ring {
            Some(ring) => Some(uring::Queue::start(ring, Arc::clone(&files))?),
            None => None,
        };
        Ok(Self {
            inner: Arc::new(Inner {
                files,
                backend,
                geometry,
                queue_depth,
                queue,
            }),
        })
    }

    pub fn backend(&self) -> Backend {
        self.inner.backend
    }

    /// The (first) file's path.
    pub fn path(&self) -> &Path {
        &self.inner.files.first().path
    }

    /// The end of the (last) file in the reader's offset space.
    pub fn file_size(&self) -> u64 {
        self.inner.files.end()
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

    /// Read `extents` into `dest` and wait for them (and for `checks` on the bytes read).
    pub fn read(&self, extents: &[Extent], dest: Destination, checks: Vec<Check>) -> Result<()> {
        let batch = self.inner.prepare(extents, dest, checks)?;
        self.inner.execute(batch)
    }

    /// `read`, returning each request's latency (first read submitted → completed), in
    /// completion order: per-request timing for benchmarks, like fio's completion latency.
    pub fn read_timed(&self, extents: &[Extent], dest: Destination) -> Result<Vec<Duration>> {
        let batch = self.inner.prepare(extents, dest, Vec::new())?.timed();
        let latencies = Arc::clone(batch.latencies.as_ref().expect("a timed batch"));
        self.inner.execute(batch)?;
        let mut latencies = latencies.lock().unwrap_or_else(|e| e.into_inner());
        Ok(std::mem::take(&mut *latencies))
    }

    /// Start reading `extents` into `dest` in the background (behind earlier batches on the
    /// io_uring thread, else on a thread of its own), then run `checks` on the bytes read, on that
    /// thread. Bad extents or checks fail here; I/O errors and failed checks surface at
    /// `Pending::wait`.
    pub fn submit(
        &self,
        extents: &[Extent],
        dest: Destination,
        checks: Vec<Check>,
    ) -> Result<Pending> {
        let batch = self.inner.prepare(extents, dest, checks)?;
        Ok(Pending {
            completion: self.inner.start(batch)?,
        })
    }
}

impl Inner {
    /// Validate a batch and plan its requests, file by file: each extent, moved into the file its offset falls in,
    /// must end inside that file.
    fn prepare(&self, extents: &[Extent], dest: Destination, checks: Vec<Check>) -> Result<Batch> {
        let mut per_file: Vec<Vec<Extent>> = vec![Vec::new(); self.files.count()];
        for e in extents {
            let (file, file_offset) = self.files.locate(e.file_offset);
            per_file[file].push(Extent { file_offset, ..*e });
        }
        let mut requests = Vec::new();
        for (index, local) in per_file.iter().enumerate() {
            let file = self.files.get(index);
            extent::validate(local, &file.path, file.size, dest.capacity())?;
            let planned = extent::plan(local, self.geometry, dest.as_ptr() as usize);
            requests.extend(planned.into_iter().map(|r| Request { file: index, ..r }));
        }
        verify::validate(&checks, extents)?;
        Ok(Batch::new(requests, dest, checks))
    }

    /// Read `batch` now and wait for it.
    fn execute(self: &Arc<Self>, batch: Batch) -> Result<()> {
        match self.backend {
            Backend::IoUring => {
                let completion = self.start(batch)?;
                completion.wait()
            }
            Backend::Pread | Backend::Buffered => {
                if batch.requests.is_empty() {
                    return Ok(());
                }
                batch.outcome(
                    pread::run(&self.files, &batch, self.queue_depth),
                    self.files.first().path.as_path(),
                )
            }
        }
    }

    /// Start `batch` in the background; its `elapsed` counts from now.
    fn start(self: &Arc<Self>, batch: Batch) -> Result<Arc<Completion>> {
        let completion = Arc::new(Completion::submitted_now());
        if batch.requests.is_empty() {
            completion.end(Ok(()));
            return Ok(completion);
        }
        let done = Arc::clone(&completion);
        match &self.queue {
            Some(queue) => queue.push(uring::Job { batch, done }),
            None => {
                let inner = Arc::clone(self);
                std::thread::Builder::new()
                    .name("ntio-submit".into())
                    .spawn(move || {
                        let io = pread::run(&inner.files, &batch, inner.queue_depth);
                        if io.is_ok() {
                            done.land();
                        }
                        let result = batch.outcome(io, &inner.files.first().path);
                        drop(batch); // frees the destination (slot) before anyone is told it is done
                        done.end(result);
                    })
                    .map_err(|err| Error::System {
                        what: "spawning a reader thread",
                        errno: crate::error::errno_of(&err),
                    })?;
            }
        }
        Ok(completion)
    }
}

/// A submitted batch. Dropping it waits for the batch to end, so memory it reads into can be
/// freed right after.
pub struct Pending {
    completion: Arc<Completion>,
}

impl Pending {
    /// Whether the batch has ended (successfully or not).
    pub fn poll(&self) -> bool {
        self.completion.ended()
    }

    /// How long the batch's I/O took (its submission to its last byte landing); None while in flight.
    /// Callers compare it with how long they were blocked in `wait` to measure overlap.
    pub fn elapsed(&self) -> Option<Duration> {
        self.completion.elapsed()
    }

    /// Wait for the batch's bytes to land; its I/O error, if any. Its checks may still be running:
    /// nothing computed from the bytes may be shown before `wait` has returned Ok.
    pub fn wait_landed(&self) -> Result<()> {
        self.completion.wait_landed()
    }

    /// Wait for the batch to end; its error, checks included (every call returns the same outcome).
    pub fn wait(&self) -> Result<()> {
        self.completion.wait()
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
        readers_with_faults(path, Faults::default())
    }

    /// How many requests `reader` splits a read of `extents` into `dest` (which depends on the
    /// file's alignment and on the destination's address modulo it).
    fn planned_requests(reader: &Reader, extents: &[Extent], dest: &[u8]) -> usize {
        extent::plan(extents, reader.inner.geometry, dest.as_ptr() as usize).len()
    }

    /// A reader per backend that works here, with small requests and `faults` injected.
    fn readers_with_faults(path: &Path, faults: Faults) -> Vec<Reader> {
        Backend::ALL
            .into_iter()
            .filter_map(|b| {
                let options = ReaderOptions {
                    backend: Some(b),
                    request_size: 8192,
                    queue_depth: 4,
                    faults: Some(faults.clone()),
                };
                Reader::open(path, options).ok()
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
                .read(&extents, Destination::slot(&slot).unwrap(), Vec::new())
                .unwrap();
            let mut external = vec![0u8; 80_000];
            // SAFETY: `external` outlives the wait below and is not touched until then.
            let dest = unsafe { Destination::external(external.as_mut_ptr(), external.len()) };
            reader
                .submit(&extents, dest, Vec::new())
                .unwrap()
                .wait()
                .unwrap();
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
            // 8192-byte requests: 13 when the alignment is 4096 or 1; with 512-byte blocks and a
            // destination congruent to the file, 13 direct requests and the bounced tail.
            let requests = planned_requests(&reader, &[extent], &dest);
            assert_eq!(latencies.len(), requests, "{:?}", reader.backend());
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
                    Vec::new(),
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
    fn many_batches_from_several_threads_each_complete_with_their_own_bytes() {
        // More batches in flight than the queue depth, unaligned pieces, submitted from four
        // threads, some handles dropped unwaited and the reader dropped before the last waits.
        let (path, bytes) = temp_file("many", 300_007);
        for reader in readers(&path) {
            std::thread::scope(|scope| {
                for t in 0..4usize {
                    let (reader, bytes) = (reader.clone(), &bytes);
                    scope.spawn(move || {
                        let mut bufs: Vec<Vec<u8>> = (0..12).map(|_| vec![0u8; 40_000]).collect();
                        let mut pending = Vec::new();
                        for (i, buf) in bufs.iter_mut().enumerate() {
                            let offset = (t * 12 + i) * 5_003;
                            let extent = Extent {
                                file_offset: offset as u64,
                                length: 40_000 - i,
                                dest_offset: i,
                            };
                            // SAFETY: `bufs` outlives every handle, each waited or dropped below.
                            let dest =
                                unsafe { Destination::external(buf.as_mut_ptr(), buf.len()) };
                            pending.push(reader.submit(&[extent], dest, Vec::new()).unwrap());
                        }
                        drop(reader);
                        for (i, p) in pending.into_iter().enumerate() {
                            if i % 3 == 0 {
                                drop(p); // waits
                            } else {
                                p.wait().unwrap();
                                assert!(p.elapsed().is_some());
                            }
                        }
                        for (i, buf) in bufs.iter().enumerate() {
                            let offset = (t * 12 + i) * 5_003;
                            assert_eq!(&buf[i..], &bytes[offset..offset + 40_000 - i]);
                        }
                    });
                }
            });
        }
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_refused_batch_leaves_queued_batches_alone() {
        let (path, bytes) = temp_file("eof", 50_000);
        for reader in readers(&path) {
            let mut good = vec![0u8; 20_000];
            // SAFETY: `good` outlives the wait below.
            let dest = unsafe { Destination::external(good.as_mut_ptr(), good.len()) };
            let extent = Extent {
                file_offset: 100,
                length: 20_000,
                dest_offset: 0,
            };
            let first = reader.submit(&[extent], dest, Vec::new()).unwrap();
            // Past the end: refused at submission, the queued batch is unaffected.
            let mut bad = vec![0u8; 10];
            // SAFETY: nothing is read into `bad`.
            let dest = unsafe { Destination::external(bad.as_mut_ptr(), bad.len()) };
            let past = Extent {
                file_offset: 49_995,
                length: 10,
                dest_offset: 0,
            };
            assert!(matches!(
                reader.submit(&[past], dest, Vec::new()),
                Err(Error::UnexpectedEof { .. })
            ));
            first.wait().unwrap();
            assert_eq!(good, &bytes[100..20_100]);
        }
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn checked_bytes_pass_and_a_mismatch_fails_the_batch_naming_the_tensor() {
        let (path, bytes) = temp_file("checks", 60_000);
        let extents = [Extent {
            file_offset: 4096,
            length: 50_000,
            dest_offset: 0,
        }];
        let check = |checksum| Check {
            tensor: "blk.2.attn_q.weight".into(),
            file_offset: 4096 + 1000,
            dest_offset: 1000,
            length: 20_000,
            checksum,
        };
        let good = crate::store::checksum(&bytes[5096..25_096]);
        for reader in readers(&path) {
            let mut dest = vec![0u8; 50_000];
            let (ptr, len) = (dest.as_mut_ptr(), dest.len());
            // SAFETY: `dest` outlives each batch, which has ended when `read` (or `wait`) returns.
            let external = || unsafe { Destination::external(ptr, len) };
            reader
                .read(&extents, external(), vec![check(good)])
                .unwrap();
            let err = reader
                .read(&extents, external(), vec![check(good ^ 1)])
                .unwrap_err();
            assert!(
                matches!(&err, Error::Corrupt { tensor, offset: 5096, length: 20_000, .. } if tensor == "blk.2.attn_q.weight"),
                "{:?}: {err}",
                reader.backend()
            );
            // In the background the bytes land first (they are all in: a caller may compute on them),
            // and the batch ends with the failed check.
            let pending = reader
                .submit(&extents, external(), vec![check(good ^ 1)])
                .unwrap();
            pending.wait_landed().unwrap();
            assert!(pending.elapsed().is_some());
            // SAFETY: the batch's I/O is over (landed): nothing writes `dest` any more.
            let landed = unsafe { std::slice::from_raw_parts(ptr, len) };
            assert_eq!(landed[1000..21_000], bytes[5096..25_096]);
            assert!(matches!(pending.wait(), Err(Error::Corrupt { .. })));
            assert!(pending.poll());
            // A check outside the bytes the batch writes is refused before anything is read.
            let mut outside = check(good);
            outside.dest_offset = 45_000;
            assert!(matches!(
                reader.read(&extents, external(), vec![outside]),
                Err(Error::InvalidArgument(_))
            ));
        }
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn injected_eio_names_file_and_offset_and_short_reads_still_deliver_every_byte() {
        let (path, bytes) = temp_file("faults", 100_000);
        let whole = [Extent {
            file_offset: 0,
            length: 100_000,
            dest_offset: 0,
        }];
        let eio = Faults::parse("eio@70000").unwrap();
        for reader in readers_with_faults(&path, eio) {
            let mut dest = vec![0u8; 100_000];
            // SAFETY: `dest` outlives the read, which has ended when `read` returns.
            let external = unsafe { Destination::external(dest.as_mut_ptr(), dest.len()) };
            let err = reader.read(&whole, external, Vec::new()).unwrap_err();
            assert!(
                matches!(err, Error::Io { offset, errno: libc::EIO, .. } if offset <= 70_000 && 70_000 - offset < 8192),
                "{:?}: {err}",
                reader.backend()
            );
            assert!(err.to_string().starts_with(&path.display().to_string()));
            // In the background an I/O error is the landing's outcome too: nothing landed to compute on.
            let mut dest = vec![0u8; 100_000];
            // SAFETY: `dest` outlives the batch, which has ended when `wait` returns.
            let external = unsafe { Destination::external(dest.as_mut_ptr(), dest.len()) };
            let pending = reader.submit(&whole, external, Vec::new()).unwrap();
            assert!(matches!(
                pending.wait_landed(),
                Err(Error::Io {
                    errno: libc::EIO,
                    ..
                })
            ));
            assert!(matches!(
                pending.wait(),
                Err(Error::Io {
                    errno: libc::EIO,
                    ..
                })
            ));
        }
        let short = Faults::parse("short").unwrap();
        for reader in readers_with_faults(&path, short) {
            let mut dest = vec![0u8; 100_000];
            // SAFETY: as above.
            let external = unsafe { Destination::external(dest.as_mut_ptr(), dest.len()) };
            let latencies = reader.read_timed(&whole, external).unwrap();
            assert_eq!(dest, bytes, "{:?}", reader.backend());
            assert_eq!(latencies.len(), planned_requests(&reader, &whole, &dest));
        }
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn shards_read_as_one_offset_space_and_an_extent_stays_inside_one_file() {
        // Two files of unaligned sizes; the second at the first 4 KiB boundary past the first's end.
        let (first, first_bytes) = temp_file("shard-1", 10_001);
        let (second, second_bytes) = temp_file("shard-2", 30_000);
        let base = 12_288;
        let shards = [(first.clone(), 0), (second.clone(), base)];
        // Both files in one batch, across the gap, out of order, and up to each file's last byte.
        let extents = [
            Extent {
                file_offset: base + 100,
                length: 29_900,
                dest_offset: 0,
            },
            Extent {
                file_offset: 3,
                length: 9_998,
                dest_offset: 30_000,
            },
            Extent {
                file_offset: base,
                length: 100,
                dest_offset: 40_000,
            },
        ];
        let mut opened = 0;
        for backend in Backend::ALL {
            let options = ReaderOptions {
                backend: Some(backend),
                request_size: 8192,
                queue_depth: 4,
                faults: Some(Faults::default()),
            };
            let Ok(reader) = Reader::open_shards(&shards, options) else {
                continue;
            };
            opened += 1;
            assert_eq!(reader.file_size(), base + 30_000);
            assert_eq!(reader.path(), first.as_path());
            let mut dest = vec![0u8; 40_100];
            // SAFETY: `dest` outlives the wait below and is not touched until then.
            let external = unsafe { Destination::external(dest.as_mut_ptr(), dest.len()) };
            reader
                .submit(&extents, external, Vec::new())
                .unwrap()
                .wait()
                .unwrap();
            assert_eq!(&dest[..29_900], &second_bytes[100..], "{backend:?}");
            assert_eq!(&dest[30_000..39_998], &first_bytes[3..], "{backend:?}");
            assert_eq!(&dest[40_000..], &second_bytes[..100], "{backend:?}");
            // An extent running past the first file's end (into the gap) names that file, in its own offsets.
            let past = [Extent {
                file_offset: 10_000,
                length: 2,
                dest_offset: 0,
            }];
            // SAFETY: as above; the batch is refused before any read.
            let external = unsafe { Destination::external(dest.as_mut_ptr(), dest.len()) };
            match reader.read(&past, external, Vec::new()) {
                Err(Error::UnexpectedEof {
                    path,
                    offset: 10_000,
                    end_of_file: 10_001,
                    ..
                }) => assert_eq!(path, first),
                other => panic!("{backend:?}: {other:?}"),
            }
        }
        assert!(opened >= 1);
        // Bases that are unaligned, overlap the previous file, or do not start at 0 are refused.
        for bad in [
            [(first.clone(), 0), (second.clone(), 12_289)],
            [(first.clone(), 0), (second.clone(), 8_192)],
            [(first.clone(), 4_096), (second.clone(), 16_384)],
        ] {
            let options = ReaderOptions {
                backend: Some(Backend::Buffered),
                ..Default::default()
            };
            let refused = Reader::open_shards(&bad, options).err();
            assert!(
                matches!(refused, Some(Error::InvalidArgument(_))),
                "{bad:?}"
            );
        }
        std::fs::remove_file(first).unwrap();
        std::fs::remove_file(second).unwrap();
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
