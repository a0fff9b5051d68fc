//! How fast the kernel threads read RAM: the roofline of a decode step, which reads every resident weight once.
//!
//! At one token a step, the products read each weight byte once and do a few operations per byte, so a step's
//! time is bounded below by (bytes of the weights) ÷ (the rate the kernel threads can stream RAM). This measures
//! that rate on the same team, over a buffer far larger than the caches, so that a benchmark can state how close
//! a decode step comes to it.

use std::hint::black_box;
use std::time::Instant;

use super::matmul::{team, KernelError};

/// Bytes per task: large enough that a task's claim is noise beside its reads, small enough that the threads
/// share the tail evenly.
const TASK_BYTES: usize = 1 << 20;

/// Seconds each of `repeats` passes took to read a buffer of `nbytes` (rounded up to whole tasks) once, on the
/// kernel threads; the buffer is written first, so that no pass pays page faults. An allocation the allocator
/// refuses is an error, not an abort; under Linux's overcommit a size beyond the RAM may still be granted and then
/// killed while it is written, so callers check the size against the room first (`ntio-bench memory` does).
pub fn memory_read_seconds(nbytes: usize, repeats: usize) -> Result<Vec<f64>, KernelError> {
    let words_per_task = TASK_BYTES / 8;
    let tasks = nbytes.div_ceil(TASK_BYTES).max(1);
    let words = tasks.saturating_mul(words_per_task);
    let mut buffer: Vec<u64> = Vec::new();
    buffer
        .try_reserve_exact(words)
        .map_err(|_| KernelError::Memory {
            bytes: words.saturating_mul(8),
        })?;
    buffer.extend((0..words).map(|i| i as u64));
    let team = team()?;
    let mut seconds = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = Instant::now();
        let ok = team.run(tasks, &|task| {
            let words = &buffer[task * words_per_task..(task + 1) * words_per_task];
            // Four independent sums, so that the loads, not one chain of adds, set the pace.
            let mut sums = [0u64; 4];
            for quad in words.chunks_exact(4) {
                for (sum, &w) in sums.iter_mut().zip(quad) {
                    *sum = sum.wrapping_add(w);
                }
            }
            black_box(sums);
        });
        if !ok {
            return Err(KernelError::Panicked);
        }
        seconds.push(start.elapsed().as_secs_f64());
    }
    Ok(seconds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_each_pass() {
        let seconds = memory_read_seconds(3 * TASK_BYTES + 1, 3).unwrap();
        assert_eq!(seconds.len(), 3);
        assert!(seconds.iter().all(|&s| s > 0.0));
    }

    #[test]
    fn a_buffer_too_large_to_allocate_is_an_error() {
        let err = memory_read_seconds(usize::MAX / 2, 1).unwrap_err();
        assert!(err.to_string().contains("could not allocate"), "{err}");
    }
}
