//! The kernel threads: a team that the calling thread joins for each call.
//!
//! A decode step makes ~4 kernel calls per layer, each 20-300 µs of work with ~50-100 µs of Python between them. A
//! pool whose caller hands the work over and sleeps (rayon's `install`) pays two context switches a call, and its
//! workers sleep between calls: on the project's 2-vCPU VM that was ~6-10% of decode time in the scheduler. Here
//! the caller publishes a job, takes tasks itself beside the workers, and spins until the last one is done; the
//! workers spin for `SPIN` after each job (the next call usually comes within it), then sleep on a condvar so that
//! an idle engine leaves the CPUs to the reader's threads.
//!
//! Tasks are claimed from one atomic word holding (job generation, next task index): a claim is a compare-exchange
//! that only succeeds for the current job, so a worker late from the previous job can never take (or lose) a
//! task of the next one.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps: longer than the Python between two kernel calls of a decode
/// step, short enough that a finished step soon frees the CPU.
const SPIN: Duration = Duration::from_micros(200);

/// One job: `run(i)` for every task index i < `tasks`. The pointer is only dereferenced while the job's caller
/// waits in `Team::run`, which outlives every claimed task.
#[derive(Clone, Copy)]
struct Job {
    run: *const (dyn Fn(usize) + Sync),
    tasks: usize,
}

// SAFETY: the closure behind `run` is `Sync`, and it is only called while `Team::run` keeps it alive.
unsafe impl Send for Job {}

struct Shared {
    /// (generation << 32) | next task index of the current job. Generations are u32 and wrap: one job in 2^32
    /// shares its number with the current one only after 2^32 jobs, long after the last claim of that job.
    claim: AtomicU64,
    /// Tasks of the current job that have finished (or panicked).
    done: AtomicUsize,
    panicked: AtomicBool,
    /// The current job and its generation; sleepers wait on `wake` for the generation to change.
    job: Mutex<(u32, Option<Job>)>,
    wake: Condvar,
    /// Workers waiting on `wake` (changed under `job`'s lock): a job published while none sleeps needs no
    /// wake-up call (a futex system call per product, most of them while the workers still spin).
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
}

impl Shared {
    /// Claims and runs tasks of job `generation` until none are left.
    fn work(&self, generation: u32, job: Job) {
        loop {
            let cur = self.claim.load(Ordering::Acquire);
            let index = (cur & 0xFFFF_FFFF) as usize;
            if (cur >> 32) as u32 != generation || index >= job.tasks {
                return;
            }
            if self
                .claim
                .compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            // SAFETY: the task was claimed for this generation, whose caller waits in `Team::run` until `done`
            // counts it, so the closure is alive.
            let run = unsafe { &*job.run };
            if catch_unwind(AssertUnwindSafe(|| run(index))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            self.done.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// `threads` threads in all: the caller of `run` and `threads - 1` workers.
pub struct Team {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    generation: Mutex<u32>,
}

impl Team {
    pub fn new(threads: usize) -> std::io::Result<Team> {
        let shared = Arc::new(Shared {
            claim: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            job: Mutex::new((0, None)),
            wake: Condvar::new(),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("ntio-kernel-{i}"))
                    .spawn(move || worker(&shared))
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Team {
            shared,
            workers,
            generation: Mutex::new(0),
        })
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(i)` for i in 0..tasks on the team (the caller included) and returns when all are done; false if a
    /// task panicked. One job at a time: concurrent callers take turns.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
        if tasks == 0 {
            return true;
        }
        let mut generation = self.generation.lock().unwrap_or_else(|e| e.into_inner());
        *generation = generation.wrapping_add(1);
        // SAFETY: the lifetime is erased for the workers; this function does not return before every claimed
        // task of this generation has finished (`done == tasks`), and later claims fail on the generation.
        let run: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(f) };
        let job = Job { run, tasks };
        let s = &self.shared;
        s.done.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        let sleeping = {
            let mut slot = s.job.lock().unwrap_or_else(|e| e.into_inner());
            *slot = (*generation, Some(job));
            s.claim
                .store(u64::from(*generation) << 32, Ordering::Release);
            s.sleepers.load(Ordering::Relaxed) > 0
        };
        if sleeping {
            s.wake.notify_all();
        }
        s.work(*generation, job);
        // The last tasks are a worker's: spin for them, then give the CPU away between looks, in case the worker
        // was preempted (by the reader's threads, say) and needs this core to finish.
        let waiting = Instant::now();
        while s.done.load(Ordering::Acquire) < tasks {
            if waiting.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        !s.panicked.load(Ordering::Relaxed)
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        {
            let _slot = self.shared.job.lock().unwrap_or_else(|e| e.into_inner());
        }
        self.shared.wake.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn worker(s: &Shared) {
    let mut seen = 0u32;
    loop {
        // Spin for the next job, then sleep until one is published.
        let start = Instant::now();
        while (s.claim.load(Ordering::Acquire) >> 32) as u32 == seen && start.elapsed() < SPIN {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            std::hint::spin_loop();
        }
        let (generation, job) = {
            let mut slot = s.job.lock().unwrap_or_else(|e| e.into_inner());
            while slot.0 == seen && !s.shutdown.load(Ordering::Acquire) {
                s.sleepers.fetch_add(1, Ordering::Relaxed);
                slot = s.wake.wait(slot).unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_sub(1, Ordering::Relaxed);
            }
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            *slot
        };
        seen = generation;
        if let Some(job) = job {
            s.work(generation, job);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_across_many_jobs() {
        let team = Team::new(3).unwrap();
        for tasks in [1usize, 2, 7, 64, 0, 5] {
            for _ in 0..200 {
                let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                assert!(team.run(tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                }));
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn a_panicking_task_is_reported_and_the_team_goes_on() {
        let team = Team::new(2).unwrap();
        let quiet = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let ok = team.run(4, &|i| assert!(i != 2));
        std::panic::set_hook(quiet);
        assert!(!ok);
        assert!(team.run(4, &|_| {}));
    }

    /// Job numbers wrap around u32 (the claim word keeps 32 bits of them): jobs on either side of the wrap run
    /// every task once.
    #[test]
    fn job_numbers_wrap() {
        let team = Team::new(2).unwrap();
        *team.generation.lock().unwrap() = u32::MAX - 3;
        for _ in 0..8 {
            let count = AtomicUsize::new(0);
            assert!(team.run(9, &|_| {
                count.fetch_add(1, Ordering::Relaxed);
            }));
            assert_eq!(count.load(Ordering::Relaxed), 9);
        }
        assert!(*team.generation.lock().unwrap() < 8);
    }

    #[test]
    fn sleeping_workers_wake_for_a_job() {
        let team = Team::new(2).unwrap();
        std::thread::sleep(SPIN * 5);
        let count = AtomicUsize::new(0);
        assert!(team.run(16, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        }));
        assert_eq!(count.load(Ordering::Relaxed), 16);
    }
}
