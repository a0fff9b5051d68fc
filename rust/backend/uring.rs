//! The io_uring backend: one long-lived I/O thread per reader owns a ring and a FIFO of
//! submitted batches. It keeps up to the queue depth requests in flight across batch boundaries
//! (filling from the next batch while the current one's last requests finish), reaps completions
//! (`user_data` names the in-flight entry), resubmits short reads, and ends each batch when its
//! own last request completes. Reads into a staging slot use READ_FIXED on the pool's registered
//! buffers.

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use io_uring::{opcode, squeue, types, IoUring};

use super::{advance, Batch, Completion, Files, Progress};
use crate::error::{Error, Result};
use crate::extent::Target;
use crate::staging::{AlignedBuf, StagingPool};
use crate::verify::Verifier;

/// A ring and the staging pool whose slots are registered with it as fixed buffers.
pub struct Ring {
    ring: IoUring,
    depth: usize,
    /// Keeps the registered pool's memory alive for as long as the kernel may use it.
    registered: Option<StagingPool>,
    /// The pool the kernel last refused to register: not tried again, since every attempt pins
    /// and unpins all of the pool's pages (milliseconds for a few MB) only to fail once more.
    refused: Option<StagingPool>,
}

impl Ring {
    pub fn new(depth: u32) -> io::Result<Self> {
        Ok(Self {
            ring: IoUring::new(depth)?,
            depth: depth as usize,
            registered: None,
            refused: None,
        })
    }

    /// Make `pool`'s slots this ring's fixed buffers; false if the kernel refuses
    /// (RLIMIT_MEMLOCK, too many or too large slots): plain reads are used then.
    /// Only called with nothing in flight, so the old buffers can go.
    fn register(&mut self, pool: &StagingPool) -> bool {
        if self.registered.as_ref().is_some_and(|p| p.same_pool(pool)) {
            return true;
        }
        if self.refused.as_ref().is_some_and(|p| p.same_pool(pool)) {
            return false;
        }
        if self.registered.take().is_some() {
            let _ = self.ring.submitter().unregister_buffers();
        }
        let iovecs: Vec<libc::iovec> = pool
            .slot_regions()
            .into_iter()
            .map(|(ptr, len)| libc::iovec {
                iov_base: ptr.cast(),
                iov_len: len,
            })
            .collect();
        // SAFETY: the iovecs describe the pool's allocation, which `self.registered` keeps alive
        // until the buffers are unregistered or the ring is dropped.
        let ok = unsafe { self.ring.submitter().register_buffers(&iovecs) }.is_ok();
        if ok {
            self.registered = Some(pool.clone());
        } else {
            self.refused = Some(pool.clone());
        }
        ok
    }

    /// The fixed-buffer index of `batch`'s destination, if its pool is the registered one.
    fn fixed_index(&self, batch: &Batch) -> Option<u16> {
        match batch.dest.slot_of_pool() {
            Some((pool, index)) if self.registered.as_ref().is_some_and(|p| p.same_pool(pool)) => {
                u16::try_from(index).ok()
            }
            _ => None,
        }
    }
}

/// A batch handed to the I/O thread, and how its submitter is told it landed and ended. Must have at
/// least one request.
pub struct Job {
    pub batch: Batch,
    pub done: Arc<Completion>,
}

/// The I/O thread of one reader. Dropping it lets the thread finish every queued batch, then
/// joins it.
pub struct Queue {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Default)]
struct State {
    incoming: VecDeque<Job>,
    closing: bool,
    /// Set when the ring broke and the thread ended: later jobs fail with it at once.
    broken: Option<Error>,
}

impl Queue {
    pub fn start(ring: Ring, files: Arc<Files>) -> Result<Self> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
        });
        let thread_shared = Arc::clone(&shared);
        let verifier = Verifier::start()?;
        let thread = std::thread::Builder::new()
            .name("ntio-uring".into())
            .spawn(move || serve(ring, &files, &thread_shared, verifier))
            .map_err(|err| Error::System {
                what: "spawning the io_uring thread",
                errno: crate::error::errno_of(&err),
            })?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Queue `job` behind every batch submitted before it.
    pub fn push(&self, job: Job) {
        let mut state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(err) = state.broken.clone() {
            drop(state);
            drop(job.batch);
            job.done.end(Err(err));
            return;
        }
        state.incoming.push_back(job);
        drop(state);
        self.shared.wake.notify_one();
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        self.shared
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .closing = true;
        self.shared.wake.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A batch being read: its next request to start, its requests in flight, its bounce regions.
struct Active {
    job: Job,
    next: usize,
    in_flight: usize,
    failure: Option<Error>,
    /// One region of `bounce_len` bytes per bounce request that can be in flight at once.
    bounce: Option<AlignedBuf>,
    free_regions: Vec<usize>,
}

impl Active {
    fn new(job: Job, depth: usize, alignment: usize) -> Self {
        let bouncing = job
            .batch
            .requests
            .iter()
            .filter(|r| matches!(r.target, Target::Bounce { .. }))
            .count();
        let regions = depth.min(bouncing);
        let (bounce, failure) = match job.batch.bounce_regions(regions, alignment) {
            Ok(buf) => (buf, None),
            Err(err) => (None, Some(err)),
        };
        Self {
            job,
            next: 0,
            in_flight: 0,
            failure,
            bounce,
            free_regions: (0..regions).rev().collect(),
        }
    }

    fn startable(&self) -> bool {
        self.failure.is_none() && self.next < self.job.batch.requests.len()
    }

    fn finished(&self) -> bool {
        self.in_flight == 0 && !self.startable()
    }

    fn region_ptr(&self, region: Option<usize>) -> *mut u8 {
        match (region, &self.bounce) {
            // SAFETY: region < the number of regions the allocation holds, of bounce_len bytes each.
            (Some(i), Some(buf)) => unsafe { buf.as_ptr().add(i * self.job.batch.bounce_len) },
            _ => std::ptr::null_mut(),
        }
    }

    /// Drop the batch (freeing its destination), then tell the submitter. A batch with checks is
    /// told it landed now and is hashed on the verifier thread, which ends it (and drops it after
    /// the tasks that hashed its requests as they landed).
    fn finish(self, files: &Files, verifier: &Verifier) {
        let Active {
            job: Job { batch, done },
            failure,
            bounce,
            ..
        } = self;
        drop(bounce);
        if !batch.has_checks() {
            drop(batch);
            return done.end(failure.map_or(Ok(()), Err));
        }
        if failure.is_none() {
            done.land();
        }
        let path = files.first().path.clone();
        verifier.run(move || {
            let outcome = batch.outcome(failure.map_or(Ok(()), Err), &path);
            drop(batch);
            done.end(outcome);
        });
    }
}

/// In-flight entry: request `request` of batch `job`, `done` bytes in, bouncing through the
/// batch's region `region`; its first read was submitted at `started`.
#[derive(Clone, Copy)]
struct Entry {
    job: u64,
    request: usize,
    done: usize,
    region: Option<usize>,
    started: Instant,
}

fn sqe(
    files: &Files,
    fixed: Option<u16>,
    active: &Active,
    entry: &Entry,
    index: usize,
) -> squeue::Entry {
    let batch = &active.job.batch;
    let req = &batch.requests[entry.request];
    let ptr = batch.read_ptr(req, active.region_ptr(entry.region), entry.done);
    let len = (req.len - entry.done) as u32;
    let offset = req.file_offset + entry.done as u64;
    let fd = types::Fd(files.get(req.file).file.as_raw_fd());
    let read = match (req.target, fixed) {
        (Target::Direct { .. }, Some(buf_index)) => opcode::ReadFixed::new(fd, ptr, len, buf_index)
            .offset(offset)
            .build(),
        _ => opcode::Read::new(fd, ptr, len).offset(offset).build(),
    };
    read.user_data(index as u64)
}

/// The I/O thread: admit queued batches, start their requests in FIFO order while entries are
/// free, wait for completions, finish batches (checks go to `verifier`); on `closing`, drain
/// everything, then return (dropping `verifier` runs the checks still queued).
fn serve(mut ring: Ring, files: &Files, shared: &Shared, verifier: Verifier) {
    let depth = ring.depth;
    let mut entries: Vec<Option<Entry>> = vec![None; depth];
    let mut free: Vec<usize> = (0..depth).rev().collect();
    let mut jobs: BTreeMap<u64, Active> = BTreeMap::new();
    let mut next_id = 0u64;
    let mut completions: Vec<(usize, i32)> = Vec::with_capacity(depth);
    loop {
        // Admit new batches; sleep only when there is nothing to start and nothing in flight.
        {
            let mut state = shared.state.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                for job in state.incoming.drain(..) {
                    jobs.insert(next_id, Active::new(job, depth, files.alignment()));
                    next_id += 1;
                }
                if !jobs.is_empty() {
                    break;
                }
                if state.closing {
                    return;
                }
                state = shared.wake.wait(state).unwrap_or_else(|e| e.into_inner());
            }
        }

        // Start requests, oldest batch first, while entries are free.
        for (&id, active) in jobs.iter_mut() {
            while active.startable() && !free.is_empty() {
                let request = active.next;
                let region = match active.job.batch.requests[request].target {
                    Target::Direct { .. } => None,
                    Target::Bounce { .. } => match active.free_regions.pop() {
                        Some(region) => Some(region),
                        None => break, // every region of this batch is in flight
                    },
                };
                if free.len() == depth {
                    // Nothing in flight: a new pool's slots can be registered now.
                    if let Some((pool, _)) = active.job.batch.dest.slot_of_pool() {
                        ring.register(pool);
                    }
                }
                let index = free.pop().expect("a free entry");
                let entry = Entry {
                    job: id,
                    request,
                    done: 0,
                    region,
                    started: Instant::now(),
                };
                let fixed = ring.fixed_index(&active.job.batch);
                push(&mut ring, &sqe(files, fixed, active, &entry, index));
                entries[index] = Some(entry);
                active.next += 1;
                active.in_flight += 1;
            }
            if free.is_empty() {
                break;
            }
        }

        if free.len() < depth {
            if let Err(err) = submit_and_wait(&mut ring) {
                return abandon(files, &verifier, shared, jobs, err);
            }
            completions.extend(
                ring.ring
                    .completion()
                    .map(|cqe| (cqe.user_data() as usize, cqe.result())),
            );
            for (index, res) in completions.drain(..) {
                let entry = entries[index]
                    .as_mut()
                    .expect("a completion names an in-flight entry");
                let active = jobs
                    .get_mut(&entry.job)
                    .expect("an in-flight entry's batch");
                let req = &active.job.batch.requests[entry.request];
                let result = if res < 0 { Err(-res) } else { Ok(res as usize) };
                match advance(files.get(req.file), req, &mut entry.done, result) {
                    Ok(Progress::Again) if active.failure.is_none() => {
                        let fixed = ring.fixed_index(&active.job.batch);
                        let again = sqe(files, fixed, active, entry, index);
                        push(&mut ring, &again);
                        continue;
                    }
                    Ok(Progress::Finished) => {
                        // SAFETY: the request's completion is reaped: its bounce region holds its bytes.
                        unsafe {
                            active
                                .job
                                .batch
                                .complete(req, active.region_ptr(entry.region))
                        };
                        active.job.batch.record_latency(entry.started);
                        if active.job.batch.has_checks() {
                            // SAFETY: this request's completion is reaped (landed ones were before), and
                            // the batch is dropped on the verifier thread after the task (`finish`).
                            verifier.run(unsafe { active.job.batch.landed(entry.request) });
                        }
                    }
                    Ok(Progress::Again) => {} // abandoned: the batch has already failed
                    Err(err) => {
                        active.failure.get_or_insert(err);
                    }
                }
                if let Some(region) = entry.region {
                    active.free_regions.push(region);
                }
                active.in_flight -= 1;
                entries[index] = None;
                free.push(index);
            }
        }

        // End every batch whose last request has completed.
        let ended: Vec<u64> = jobs
            .iter()
            .filter(|(_, a)| a.finished())
            .map(|(&id, _)| id)
            .collect();
        for id in ended {
            jobs.remove(&id)
                .expect("a finished batch")
                .finish(files, &verifier);
        }
    }
}

/// The ring broke (io_uring_enter failed for good): fail every batch, queued or active, and
/// every later one. As before this design, reads still in the kernel are not waited for.
fn abandon(
    files: &Files,
    verifier: &Verifier,
    shared: &Shared,
    jobs: BTreeMap<u64, Active>,
    err: Error,
) {
    let queued: Vec<Job> = {
        let mut state = shared.state.lock().unwrap_or_else(|e| e.into_inner());
        state.broken = Some(err.clone());
        state.incoming.drain(..).collect()
    };
    for mut active in jobs.into_values() {
        active.failure.get_or_insert(err.clone());
        active.finish(files, verifier);
    }
    for job in queued {
        drop(job.batch);
        job.done.end(Err(err.clone()));
    }
}

fn push(ring: &mut Ring, sqe: &squeue::Entry) {
    // SAFETY: the buffer an SQE names stays valid until its completion is reaped: a batch (which
    // owns its destination and bounce regions) is dropped only once none of its reads is in flight.
    let pushed = unsafe { ring.ring.submission().push(sqe) };
    // At most `depth` entries are in flight and each submit empties the queue, which has
    // `depth` or more places: a full queue is a bug.
    pushed.expect("io_uring submission queue overflow");
}

fn submit_and_wait(ring: &mut Ring) -> Result<()> {
    loop {
        match ring.ring.submit_and_wait(1) {
            Ok(_) => return Ok(()),
            Err(err)
                if matches!(
                    err.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) =>
            {
                continue
            }
            // Other errors (EBADF, EFAULT, ENXIO) mean a broken ring, which one we own and keep open is not.
            Err(err) => {
                return Err(Error::System {
                    what: "io_uring_enter",
                    errno: crate::error::errno_of(&err),
                })
            }
        }
    }
}
