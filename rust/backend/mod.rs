//! I/O backends and what they share: opening the file (O_DIRECT or not), probing which backend
//! works here, the batch being executed, and the per-request bookkeeping of short reads.
//!
//! - `io_uring`: O_DIRECT reads through a ring (`uring.rs`), READ_FIXED into registered slots;
//! - `pread`: O_DIRECT `pread` from a few threads (`pread.rs`), where io_uring is unavailable;
//! - `buffered`: the same threads without O_DIRECT, where the filesystem refuses it (tmpfs).

pub mod faults;
pub mod pread;
pub mod uring;

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::destination::Destination;
use crate::error::{Error, Result};
use crate::extent::{Request, Target};
use crate::staging::{AlignedBuf, SLOT_ALIGNMENT};
use crate::verify::{Check, Checks};
use faults::Faults;

/// Environment variable that forces a backend when the caller does not name one.
pub const BACKEND_ENV: &str = "NTIO_IO_BACKEND";

/// Alignment assumed for O_DIRECT when the kernel does not report one.
const DEFAULT_DIRECT_ALIGNMENT: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    IoUring,
    Pread,
    Buffered,
}

impl Backend {
    pub const ALL: [Backend; 3] = [Backend::IoUring, Backend::Pread, Backend::Buffered];

    pub fn name(self) -> &'static str {
        match self {
            Backend::IoUring => "io_uring",
            Backend::Pread => "pread",
            Backend::Buffered => "buffered",
        }
    }

    pub fn parse(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|b| b.name() == name)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown I/O backend {name:?} (expected io_uring, pread or buffered)"
                ))
            })
    }

    /// The backend named by `NTIO_IO_BACKEND`, if set and not empty.
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var(BACKEND_ENV) {
            Ok(name) if !name.is_empty() => Self::parse(&name)
                .map(Some)
                .map_err(|e| Error::InvalidArgument(format!("{BACKEND_ENV}: {e}"))),
            _ => Ok(None),
        }
    }
}

/// The file being read, with what the backends need to know about it.
pub struct OpenFile {
    pub file: File,
    pub path: PathBuf,
    pub size: u64,
    /// Offsets, lengths and memory of O_DIRECT reads must be multiples of this; 1 when buffered.
    pub alignment: usize,
    /// Injected faults (tests only; none by default).
    pub faults: Faults,
}

impl OpenFile {
    fn open(path: &Path, direct: bool, faults: &Faults) -> Result<Self> {
        let open_error = |err: std::io::Error| Error::Open {
            path: path.to_path_buf(),
            errno: crate::error::errno_of(&err),
        };
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(if direct { libc::O_DIRECT } else { 0 })
            .open(path)
            .map_err(open_error)?;
        let size = file.metadata().map_err(open_error)?.len();
        let alignment = if direct {
            direct_io_alignment(&file)
        } else {
            1
        };
        Ok(Self {
            file,
            path: path.to_path_buf(),
            size,
            alignment,
            faults: faults.clone(),
        })
    }
}

/// The files one reader reads, in one offset space: file `i`'s bytes start at `bases[i]`. One file sits at 0; a
/// checkpoint's shards sit one after another, each base a multiple of 4096 (and of the alignment) at or past the end
/// of the file before it, so an aligned request never spans two files and every offset keeps its alignment within
/// its file.
pub struct Files {
    files: Vec<OpenFile>,
    bases: Vec<u64>,
}

impl Files {
    /// Open `shards` (path, base), the first for the `requested` backend as `open` does and the others the same
    /// way. All are read at the alignment the strictest of them needs.
    pub fn open(
        shards: &[(PathBuf, u64)],
        requested: Option<Backend>,
        queue_depth: u32,
        faults: &Faults,
    ) -> Result<(Self, Backend, Option<uring::Ring>)> {
        let Some(((first_path, first_base), others)) = shards.split_first() else {
            return Err(Error::InvalidArgument(
                "a reader needs at least one file".into(),
            ));
        };
        if *first_base != 0 {
            return Err(Error::InvalidArgument(format!(
                "{}: the first file's base must be 0, got {first_base}",
                first_path.display()
            )));
        }
        let (first, backend, ring) = open(first_path, requested, queue_depth, faults)?;
        let mut files = vec![first];
        for (path, _) in others {
            files.push(OpenFile::open(path, backend != Backend::Buffered, faults)?);
        }
        let alignment = files.iter().map(|f| f.alignment).max().expect("one file");
        let bases: Vec<u64> = shards.iter().map(|&(_, base)| base).collect();
        for file in &mut files {
            file.alignment = alignment;
        }
        // Bases on DEFAULT_DIRECT_ALIGNMENT boundaries whatever the backend, so offsets never depend on it.
        let boundary = alignment.max(DEFAULT_DIRECT_ALIGNMENT) as u64;
        for i in 1..files.len() {
            let previous_end = bases[i - 1] + files[i - 1].size;
            if !bases[i].is_multiple_of(boundary) || bases[i] < previous_end {
                return Err(Error::InvalidArgument(format!(
                    "{}: base {} must be a multiple of {boundary} at or past the previous file's end ({previous_end})",
                    files[i].path.display(),
                    bases[i]
                )));
            }
        }
        Ok((Self { files, bases }, backend, ring))
    }

    pub fn get(&self, index: usize) -> &OpenFile {
        &self.files[index]
    }

    /// The first file: the one a reader is named after.
    pub fn first(&self) -> &OpenFile {
        &self.files[0]
    }

    /// How many files.
    pub fn count(&self) -> usize {
        self.files.len()
    }

    pub fn alignment(&self) -> usize {
        self.files[0].alignment
    }

    /// The end of the last file in the offset space.
    pub fn end(&self) -> u64 {
        self.bases[self.files.len() - 1] + self.files[self.files.len() - 1].size
    }

    /// Where `offset` falls: the last file whose base is at or below it, and the offset within that file (past its
    /// end where `offset` lies in the gap before the next file or past the last).
    pub fn locate(&self, offset: u64) -> (usize, u64) {
        let index = self.bases.partition_point(|&base| base <= offset) - 1;
        (index, offset - self.bases[index])
    }
}

/// The file's O_DIRECT alignment from statx (STATX_DIOALIGN, Linux 6.1+), else 4096.
fn direct_io_alignment(file: &File) -> usize {
    // SAFETY: statx is plain old data; all-zero is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the descriptor is open, the empty C string with AT_EMPTY_PATH names that
    // descriptor, and stx is a writable statx buffer.
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    let reported = stx.stx_dio_offset_align.max(stx.stx_dio_mem_align) as usize;
    if rc == 0 && stx.stx_mask & libc::STATX_DIOALIGN != 0 && reported.is_power_of_two() {
        reported
    } else {
        DEFAULT_DIRECT_ALIGNMENT
    }
}

/// Open `path` for the `requested` backend, or for the best one that works here:
/// io_uring if a ring can be created, else pread; buffered where O_DIRECT is refused.
/// A requested backend that cannot work is an error, never a silent fallback.
/// Returns the probe's ring when io_uring is chosen, so it is not created twice.
pub fn open(
    path: &Path,
    requested: Option<Backend>,
    queue_depth: u32,
    faults: &Faults,
) -> Result<(OpenFile, Backend, Option<uring::Ring>)> {
    let unavailable = |backend: Backend, reason: String| Error::BackendUnavailable {
        path: path.to_path_buf(),
        backend: backend.name(),
        reason,
    };
    if requested == Some(Backend::Buffered) {
        return Ok((
            OpenFile::open(path, false, faults)?,
            Backend::Buffered,
            None,
        ));
    }
    let file = match OpenFile::open(path, true, faults) {
        Err(Error::Open {
            errno: libc::EINVAL,
            ..
        }) => match requested {
            Some(backend) => {
                return Err(unavailable(
                    backend,
                    "the filesystem refuses O_DIRECT".into(),
                ))
            }
            None => {
                return Ok((
                    OpenFile::open(path, false, faults)?,
                    Backend::Buffered,
                    None,
                ))
            }
        },
        opened => opened?,
    };
    if requested == Some(Backend::Pread) {
        return Ok((file, Backend::Pread, None));
    }
    match uring::Ring::new(queue_depth) {
        Ok(ring) => Ok((file, Backend::IoUring, Some(ring))),
        Err(err) if requested == Some(Backend::IoUring) => Err(unavailable(
            Backend::IoUring,
            format!("cannot create a ring: {err}"),
        )),
        Err(_) => Ok((file, Backend::Pread, None)),
    }
}

/// How a background batch ends, in two stages: its bytes land (its I/O is over), then it ends (its checks have
/// run and its destination is released). A batch without checks, or whose I/O failed, lands and ends at once.
/// Landed bytes may be computed on while they are hashed, as long as nothing computed from them is shown to
/// anyone before the batch has ended well: that keeps hashing off the path from read to compute.
pub struct Completion {
    started: Instant,
    stage: Mutex<Stage>,
    changed: Condvar,
}

#[derive(Default)]
struct Stage {
    /// Submission to the end of the I/O; set when the bytes land (or the batch ends, whichever comes first).
    elapsed: Option<Duration>,
    /// The I/O's outcome; set when the bytes land.
    landed: Option<Result<()>>,
    /// The batch's outcome, checks included; set once its destination is released.
    ended: Option<Result<()>>,
}

impl Completion {
    /// A batch submitted now.
    pub fn submitted_now() -> Self {
        Self {
            started: Instant::now(),
            stage: Mutex::new(Stage::default()),
            changed: Condvar::new(),
        }
    }

    fn update(&self, set: impl FnOnce(&mut Stage)) {
        let mut stage = self.stage.lock().unwrap_or_else(|e| e.into_inner());
        stage.elapsed.get_or_insert_with(|| self.started.elapsed());
        set(&mut stage);
        self.changed.notify_all();
    }

    /// Every byte of the batch is in; its checks are still to run.
    pub fn land(&self) {
        self.update(|stage| stage.landed = Some(Ok(())));
    }

    /// The batch is over (its destination dropped): `outcome` is final.
    pub fn end(&self, outcome: Result<()>) {
        self.update(|stage| {
            stage.landed.get_or_insert_with(|| outcome.clone());
            stage.ended = Some(outcome);
        });
    }

    fn wait_for(&self, outcome: impl Fn(&Stage) -> Option<Result<()>>) -> Result<()> {
        let mut stage = self.stage.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(outcome) = outcome(&stage) {
                return outcome;
            }
            stage = self.changed.wait(stage).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Wait for the bytes to land: the I/O's outcome (checks may still be running).
    pub fn wait_landed(&self) -> Result<()> {
        self.wait_for(|stage| stage.landed.clone())
    }

    /// Wait for the batch to end: its outcome, checks included (every call returns the same one).
    pub fn wait(&self) -> Result<()> {
        self.wait_for(|stage| stage.ended.clone())
    }

    /// Whether the batch has ended (successfully or not).
    pub fn ended(&self) -> bool {
        self.stage
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .ended
            .is_some()
    }

    /// Submission to the end of the batch's I/O; None while in flight.
    pub fn elapsed(&self) -> Option<Duration> {
        self.stage.lock().unwrap_or_else(|e| e.into_inner()).elapsed
    }
}

/// Planned requests, the destination they fill and the checksums it must match once filled.
/// Owning the destination ties a slot's in-flight mark to the batch: it is cleared only when the
/// batch is dropped, after all I/O and every check.
pub struct Batch {
    pub requests: Vec<Request>,
    pub dest: Destination,
    /// Shared with the tasks that hash landed requests on the verifier thread (`landed`).
    pub checks: Arc<Mutex<Checks>>,
    /// Whether `checks` has any (known without the lock, which a hashing task may hold).
    has_checks: bool,
    /// Size of one bounce region: the longest bounce request, 0 when nothing bounces.
    pub bounce_len: usize,
    /// Each request's latency (its first read submitted → its last completed), when timed.
    pub latencies: Option<Arc<Mutex<Vec<Duration>>>>,
}

impl Batch {
    pub fn new(requests: Vec<Request>, dest: Destination, checks: Vec<Check>) -> Self {
        let bounce_len = requests
            .iter()
            .filter(|r| matches!(r.target, Target::Bounce { .. }))
            .map(|r| r.len)
            .max()
            .unwrap_or(0);
        let starts = requests
            .iter()
            .map(|r| match r.target {
                Target::Direct { dest_offset } | Target::Bounce { dest_offset, .. } => dest_offset,
            })
            .collect();
        Self {
            has_checks: !checks.is_empty(),
            checks: Arc::new(Mutex::new(Checks::new(checks, starts))),
            requests,
            dest,
            bounce_len,
            latencies: None,
        }
    }

    /// The batch's outcome once its I/O has ended with `io`: that, or the first failed check.
    pub fn outcome(&self, io: Result<()>, path: &Path) -> Result<()> {
        io?;
        let checks = self.checks.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: every request has completed (no read is writing the destination), and the checks
        // were validated to lie in bytes the batch's extents wrote, inside the destination.
        unsafe { checks.verify(self.dest.as_ptr(), path) }
    }

    pub fn has_checks(&self) -> bool {
        self.has_checks
    }

    /// Record each request's latency (for benchmarks: `Reader::read_timed`).
    pub fn timed(mut self) -> Self {
        self.latencies = Some(Arc::new(Mutex::new(Vec::with_capacity(
            self.requests.len(),
        ))));
        self
    }

    /// A request that started at `started` has finished.
    pub fn record_latency(&self, started: Instant) {
        if let Some(latencies) = &self.latencies {
            let elapsed = started.elapsed();
            latencies
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(elapsed);
        }
    }

    /// `n` bounce regions of `bounce_len` bytes, aligned for O_DIRECT; `None` if nothing bounces.
    pub fn bounce_regions(&self, n: usize, alignment: usize) -> Result<Option<AlignedBuf>> {
        if self.bounce_len == 0 {
            return Ok(None);
        }
        AlignedBuf::new(n * self.bounce_len, alignment.max(SLOT_ALIGNMENT)).map(Some)
    }

    /// Where the next byte of `req` goes after `done` bytes; `region` is its bounce region.
    pub fn read_ptr(&self, req: &Request, region: *mut u8, done: usize) -> *mut u8 {
        let base = match req.target {
            // SAFETY: validate() and plan() keep dest_offset + len within the destination.
            Target::Direct { dest_offset } => unsafe { self.dest.as_ptr().add(dest_offset) },
            Target::Bounce { .. } => region,
        };
        // SAFETY: done < req.len, and the region or destination range holds req.len bytes.
        unsafe { base.add(done) }
    }

    /// Finish a fully read request: copy its wanted bytes out of the bounce region.
    ///
    /// # Safety
    /// For a bounce request, `region` must hold the request's first `needed` bytes, read by the
    /// kernel, and no read may still be writing to it.
    pub unsafe fn complete(&self, req: &Request, region: *const u8) {
        if let Target::Bounce { skip, dest_offset } = req.target {
            // SAFETY: region[..needed] is initialised (caller); dest_offset + (needed - skip) lies in
            // the destination (validated); a bounce region never overlaps the destination.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    region.add(skip),
                    self.dest.as_ptr().add(dest_offset),
                    req.needed - skip,
                )
            }
        }
    }

    /// Request `request` has landed (after `complete`): a task that lets the checks take what has
    /// landed so far, while it is in cache. Run off the I/O thread (hashing there slows the reads),
    /// before the batch's outcome and on the thread that then drops the batch.
    ///
    /// # Safety
    /// Every request marked landed must have completed (no read is still writing its bytes), and the
    /// task must run before the batch (its destination) is dropped.
    pub unsafe fn landed(&self, request: usize) -> impl FnOnce() + Send + 'static {
        let checks = Arc::clone(&self.checks);
        let dest = self.dest.as_ptr() as usize;
        move || {
            let mut checks = checks.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the checks were validated to lie in bytes the batch's extents write, inside the
            // destination, which is alive and whose landed requests' reads are over (caller).
            unsafe { checks.landed(request, dest as *const u8) }
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum Progress {
    /// The request has all the bytes it needs.
    Finished,
    /// Read again from `file_offset + done` (short read, EINTR, EAGAIN).
    Again,
}

/// Account for one read of `req` that returned `result` (bytes, or an errno) after `done` bytes.
pub fn advance(
    file: &OpenFile,
    req: &Request,
    done: &mut usize,
    result: Result<usize, i32>,
) -> Result<Progress> {
    let at = req.file_offset + *done as u64;
    match file
        .faults
        .apply(at, req.len - *done, file.alignment, result)
    {
        Ok(0) => Err(Error::UnexpectedEof {
            path: file.path.clone(),
            offset: req.file_offset,
            length: req.needed as u64,
            end_of_file: req.file_offset + *done as u64,
        }),
        Ok(n) => {
            *done += n;
            Ok(if *done >= req.needed {
                Progress::Finished
            } else {
                Progress::Again
            })
        }
        Err(libc::EINTR | libc::EAGAIN) => Ok(Progress::Again),
        Err(errno) => Err(Error::Io {
            path: file.path.clone(),
            offset: req.file_offset + *done as u64,
            length: (req.len - *done) as u64,
            errno,
        }),
    }
}
