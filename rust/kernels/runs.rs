//! A call's chunks of work as one contiguous run per thread, with stealing at the end.
//!
//! Equal small tasks handed out in turn have the threads alternate along a matrix, so each thread starts cold on
//! every task: its next rows were the other thread's, and nothing streamed them in. Here each of `runs` runs (a
//! task each of `Team::run`, one a thread when none is late) owns a contiguous range of chunks and takes them from
//! its front, one stream from memory; a run that is done takes chunks from the back of the others, so a thread
//! that falls behind (preempted, or slower) leaves its rest to the others, as small tasks did. Against small tasks
//! in turn, Qwen2.5-Coder-1.5B's kernel pass took 0.95-1.04 / 0.93-1.04 / 0.96-1.04 of the time at T = 1 / 8 / 16
//! and SmolLM2's 0.83-0.97 / 0.92-0.98 / 0.90-0.95 (2 threads, cold; three and two runs, benches/RESULTS.md,
//! thirty-ninth session). A fixed long first task per thread (7/8 of the rows) did as well on that pass, but a
//! thread preempted in it would hold the call up.

use std::sync::atomic::{AtomicU64, Ordering};

/// Chunks 0..chunks in `runs` ranges of (nearly) equal length, claimed once each.
pub(super) struct Runs {
    /// Range r as (front << 32) | back, in chunks: its owner claims `front`, the others `back - 1`.
    ranges: Vec<AtomicU64>,
}

impl Runs {
    pub(super) fn new(chunks: usize, runs: usize) -> Runs {
        assert!(chunks < 1 << 32 && runs > 0);
        let ranges = (0..runs)
            .map(|r| {
                let (front, back) = (chunks * r / runs, chunks * (r + 1) / runs);
                AtomicU64::new(((front as u64) << 32) | back as u64)
            })
            .collect();
        Runs { ranges }
    }

    /// The next chunk for run r: the front of its own range, else the back of another's; None when all are taken.
    pub(super) fn next(&self, r: usize) -> Option<usize> {
        let runs = self.ranges.len();
        (0..runs).find_map(|i| self.claim((r + i) % runs, i == 0))
    }

    /// Claims the front (`own`) or the back chunk of range r, if it has one.
    fn claim(&self, r: usize, own: bool) -> Option<usize> {
        let range = &self.ranges[r];
        let mut cur = range.load(Ordering::Relaxed);
        loop {
            let (front, back) = (cur >> 32, cur & 0xFFFF_FFFF);
            if front >= back {
                return None;
            }
            let (new, chunk) = if own {
                (((front + 1) << 32) | back, front)
            } else {
                ((front << 32) | (back - 1), back - 1)
            };
            match range.compare_exchange_weak(cur, new, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(chunk as usize),
                Err(seen) => cur = seen,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One run alone takes its own chunks in order, then the others' from their backs, each chunk once.
    #[test]
    fn a_run_takes_its_range_in_order_then_the_others_from_their_backs() {
        let runs = Runs::new(10, 2);
        let taken: Vec<usize> = std::iter::from_fn(|| runs.next(1)).collect();
        assert_eq!(taken, [5, 6, 7, 8, 9, 4, 3, 2, 1, 0]);
        assert_eq!(runs.next(0), None);
    }

    /// Threads draining the runs at once take every chunk exactly once, whatever their speeds.
    #[test]
    fn threads_at_once_take_every_chunk_once() {
        for (chunks, threads) in [(1, 2), (7, 2), (100, 3), (1000, 4)] {
            let runs = Runs::new(chunks, threads);
            let taken: Vec<Vec<usize>> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..threads)
                    .map(|r| {
                        let runs = &runs;
                        s.spawn(move || {
                            let mut mine = Vec::new();
                            while let Some(c) = runs.next(r) {
                                if r == 0 {
                                    std::thread::yield_now();
                                }
                                mine.push(c);
                            }
                            mine
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let mut all: Vec<usize> = taken.concat();
            all.sort_unstable();
            assert_eq!(
                all,
                (0..chunks).collect::<Vec<_>>(),
                "{chunks} chunks, {threads} threads"
            );
        }
    }
}
