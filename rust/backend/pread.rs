//! The `pread` and `buffered` backends: up to `threads` scoped threads take requests from a
//! shared counter and `pread` them (the file was opened with or without O_DIRECT).

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::Instant;

use super::{advance, Batch, Files, Progress};
use crate::error::{Error, Result};
use crate::extent::{Request, Target};
use crate::staging::AlignedBuf;

pub fn run(files: &Files, batch: &Batch, threads: usize) -> Result<()> {
    let next = AtomicUsize::new(0);
    let failure: Mutex<Option<Error>> = Mutex::new(None);
    let worker = || {
        let mut bounce: Option<AlignedBuf> = None;
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= batch.requests.len() {
                return;
            }
            if let Err(err) = read_one(files, batch, &batch.requests[i], &mut bounce) {
                failure
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(err);
                next.store(batch.requests.len(), Ordering::Relaxed); // stop the other workers
                return;
            }
        }
    };
    thread::scope(|scope| {
        for _ in 1..threads.min(batch.requests.len()) {
            // A thread that cannot be spawned just means fewer workers.
            let _ = thread::Builder::new()
                .name("ntio-pread".into())
                .spawn_scoped(scope, worker);
        }
        worker();
    });
    failure
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .map_or(Ok(()), Err)
}

fn read_one(
    files: &Files,
    batch: &Batch,
    req: &Request,
    bounce: &mut Option<AlignedBuf>,
) -> Result<()> {
    let file = files.get(req.file);
    let region = match req.target {
        Target::Direct { .. } => std::ptr::null_mut(),
        Target::Bounce { .. } => match bounce {
            Some(buf) => buf.as_ptr(),
            None => bounce
                .insert(
                    batch
                        .bounce_regions(1, file.alignment)?
                        .expect("a bounce request"),
                )
                .as_ptr(),
        },
    };
    let started = Instant::now();
    let mut done = 0;
    loop {
        let ptr = batch.read_ptr(req, region, done);
        // SAFETY: ptr is valid for req.len - done bytes (Batch::read_ptr), which nobody else
        // touches while this request is being read.
        let n = unsafe {
            libc::pread(
                file.file.as_raw_fd(),
                ptr.cast(),
                req.len - done,
                (req.file_offset + done as u64) as libc::off_t,
            )
        };
        let result = if n < 0 {
            Err(std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO))
        } else {
            Ok(n as usize)
        };
        if advance(file, req, &mut done, result)? == Progress::Finished {
            // SAFETY: the request is fully read into `region` (when it bounces), this thread's own.
            unsafe { batch.complete(req, region) };
            batch.record_latency(started);
            return Ok(());
        }
    }
}
