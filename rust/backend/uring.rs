//! The io_uring backend: fill the submission queue up to the queue depth, submit, reap
//! completions (`user_data` names the in-flight entry), resubmit short reads, repeat until every
//! request is done. Reads into a staging slot use READ_FIXED on the pool's registered buffers.

use std::io;
use std::os::fd::AsRawFd;
use std::time::Instant;

use io_uring::{opcode, squeue, types, IoUring};

use super::{advance, Batch, OpenFile, Progress};
use crate::error::{Error, Result};
use crate::extent::Target;
use crate::staging::StagingPool;

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
    fn register(&mut self, pool: &StagingPool) -> bool {
        if self.registered.as_ref().is_some_and(|p| p.same_pool(pool)) {
            return true;
        }
        if self.refused.as_ref().is_some_and(|p| p.same_pool(pool)) {
            return false;
        }
        if self.registered.take().is_some() {
            // Nothing is in flight between batches, so the old buffers can go.
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
}

/// In-flight entry `i` reads request `request`, `done` bytes in, into bounce region `i`;
/// its first read was submitted at `started`.
#[derive(Clone, Copy)]
struct Entry {
    request: usize,
    done: usize,
    started: Instant,
}

pub fn run(ring: &mut Ring, file: &OpenFile, batch: &Batch) -> Result<()> {
    let fixed_index = match batch.dest.slot_of_pool() {
        Some((pool, index)) if ring.register(pool) => u16::try_from(index).ok(),
        _ => None,
    };
    let depth = ring.depth.min(batch.requests.len());
    let bounce = batch.bounce_regions(depth, file.alignment)?;
    let region = |entry: usize| match &bounce {
        // SAFETY: entry < depth, and the allocation holds depth regions of bounce_len bytes.
        Some(buf) => unsafe { buf.as_ptr().add(entry * batch.bounce_len) },
        None => std::ptr::null_mut(),
    };
    let sqe = |index: usize, entry: Entry| -> squeue::Entry {
        let req = &batch.requests[entry.request];
        let ptr = batch.read_ptr(req, region(index), entry.done);
        let len = (req.len - entry.done) as u32;
        let fd = types::Fd(file.file.as_raw_fd());
        let read = match (req.target, fixed_index) {
            (Target::Direct { .. }, Some(buf_index)) => {
                opcode::ReadFixed::new(fd, ptr, len, buf_index)
                    .offset(req.file_offset + entry.done as u64)
                    .build()
            }
            _ => opcode::Read::new(fd, ptr, len)
                .offset(req.file_offset + entry.done as u64)
                .build(),
        };
        read.user_data(index as u64)
    };

    let idle = Entry {
        request: 0,
        done: 0,
        started: Instant::now(),
    };
    let mut entries = vec![idle; depth];
    let mut free: Vec<usize> = (0..depth).rev().collect();
    let mut completions: Vec<(usize, i32)> = Vec::with_capacity(depth);
    let mut next = 0;
    let mut in_flight = 0;
    let mut failure: Option<Error> = None;
    loop {
        while failure.is_none() && next < batch.requests.len() {
            let Some(index) = free.pop() else { break };
            entries[index] = Entry {
                request: next,
                done: 0,
                started: Instant::now(),
            };
            push(ring, &sqe(index, entries[index]));
            next += 1;
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        submit_and_wait(ring)?;
        completions.extend(
            ring.ring
                .completion()
                .map(|cqe| (cqe.user_data() as usize, cqe.result())),
        );
        for (index, res) in completions.drain(..) {
            let entry = &mut entries[index];
            let req = &batch.requests[entry.request];
            let result = if res < 0 { Err(-res) } else { Ok(res as usize) };
            match advance(file, req, &mut entry.done, result) {
                Ok(Progress::Again) if failure.is_none() => {
                    push(ring, &sqe(index, *entry));
                    continue;
                }
                Ok(Progress::Finished) => {
                    // SAFETY: the request's completion is reaped: its bounce region holds its bytes.
                    unsafe { batch.complete(req, region(index)) };
                    batch.record_latency(entry.started);
                }
                Ok(Progress::Again) => {} // abandoned: the batch has already failed
                Err(err) => {
                    failure.get_or_insert(err);
                }
            }
            free.push(index);
            in_flight -= 1;
        }
    }
    failure.map_or(Ok(()), Err)
}

fn push(ring: &mut Ring, sqe: &squeue::Entry) {
    // SAFETY: the buffer an SQE names stays valid until its completion is reaped: run() returns
    // only once nothing is in flight, and the batch owns the destination until then.
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
