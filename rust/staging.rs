//! Staging buffers: a pool of aligned slots owned by Rust. A slot is acquired, read into, and
//! released; it can be neither released nor read into again while a read into it is in flight.
//! Slot handles carry a generation, so a stale handle (released, then the slot re-acquired by
//! someone else) cannot touch the new owner's slot.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Alignment of every slot (and of bounce regions): enough for O_DIRECT on any block device
/// with logical blocks of up to 4096 bytes, and a page, so slots can be registered with io_uring.
pub const SLOT_ALIGNMENT: usize = 4096;

/// Buffers of at least this size get a mapping of their own, aligned to and advised to use
/// (transparent) huge pages: see `AlignedBuf::new`.
pub const HUGE_PAGE: usize = 2 << 20;

/// A zero-initialised allocation with a power-of-two alignment.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    backing: Backing,
}

enum Backing {
    /// From the global allocator, with this layout.
    Heap(Layout),
    /// An anonymous mapping of `len` bytes at `base` (`ptr` is `base` rounded up to `HUGE_PAGE`).
    Mapped { base: *mut u8, len: usize },
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Box<[u8]>; no thread-local state.
unsafe impl Send for AlignedBuf {}
// SAFETY: &AlignedBuf only hands out the raw pointer; writers synchronise externally (slot state).
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Buffers of `HUGE_PAGE` bytes or more (staging pools) are mapped on their own, aligned to
    /// `HUGE_PAGE`, advised MADV_HUGEPAGE and faulted in at once: each 2 MiB is then one
    /// physically contiguous page where the kernel has transparent huge pages, so a 1 MiB read is
    /// one DMA segment instead of up to 256 scattered 4 KiB ones. What scattered pages cost depends
    /// on the device: on a virtio disk whose host serves each segment separately, reads into them
    /// ran at half the speed (benches/RESULTS.md). Without huge pages this is a plain mapping.
    pub fn new(len: usize, alignment: usize) -> Result<Self> {
        if len >= HUGE_PAGE && alignment <= HUGE_PAGE {
            return Self::mapped(len);
        }
        let layout = Layout::from_size_align(len.max(1), alignment)
            .map_err(|_| Error::InvalidArgument(format!("buffer of {len} bytes is too large")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(Error::System {
            what: "allocating an aligned buffer",
            errno: libc::ENOMEM,
        })?;
        Ok(Self {
            ptr,
            backing: Backing::Heap(layout),
        })
    }

    fn mapped(len: usize) -> Result<Self> {
        let used = len.div_ceil(HUGE_PAGE) * HUGE_PAGE;
        let map_len = used + HUGE_PAGE; // room to round the start up to a huge-page boundary
                                        // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches no
                                        // existing memory.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::System {
                what: "mapping a staging buffer",
                errno: crate::error::errno_of(&std::io::Error::last_os_error()),
            });
        }
        let base = base.cast::<u8>();
        let ptr = base.wrapping_add(base.align_offset(HUGE_PAGE));
        // SAFETY: [ptr, ptr + used) lies inside the mapping. The advice is only a hint: kernels
        // without transparent huge pages refuse it and the buffer keeps 4 KiB pages.
        unsafe { libc::madvise(ptr.cast(), used, libc::MADV_HUGEPAGE) };
        // Fault the pages in now (anonymous memory reads as zeros already), so the huge pages are
        // taken here and not one page at a time by the first read's DMA.
        // SAFETY: the range is writable memory of this mapping, not yet shared with anyone.
        unsafe { std::ptr::write_bytes(ptr, 0, used) };
        Ok(Self {
            ptr: NonNull::new(ptr).expect("mmap does not return null"),
            backing: Backing::Mapped { base, len: map_len },
        })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match self.backing {
            // SAFETY: ptr was returned by alloc_zeroed with exactly this layout.
            Backing::Heap(layout) => unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) },
            // SAFETY: base and len are the mapping made in `mapped`, unmapped only here.
            Backing::Mapped { base, len } => unsafe {
                libc::munmap(base.cast(), len);
            },
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct SlotState {
    acquired: bool,
    in_flight: bool,
    /// The slot's handle was dropped mid-read: the read's guard frees the slot when it ends.
    orphaned: bool,
    generation: u64,
}

struct PoolInner {
    memory: AlignedBuf,
    slot_size: usize,
    states: Mutex<Vec<SlotState>>,
    freed: Condvar,
}

/// A pool of `n_slots` aligned slots of `slot_size` bytes each, in one allocation.
/// Cloning gives another handle to the same pool; the memory lives until the last handle,
/// slot or in-flight read is gone.
#[derive(Clone)]
pub struct StagingPool {
    inner: Arc<PoolInner>,
}

impl StagingPool {
    /// `slot_size` is rounded up to `SLOT_ALIGNMENT`.
    pub fn new(n_slots: usize, slot_size: usize) -> Result<Self> {
        if n_slots == 0 || slot_size == 0 {
            return Err(Error::InvalidArgument(format!(
                "a staging pool needs at least one slot of at least one byte (got {n_slots} x {slot_size})"
            )));
        }
        let slot_size = slot_size.div_ceil(SLOT_ALIGNMENT) * SLOT_ALIGNMENT;
        let total = n_slots.checked_mul(slot_size).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "staging pool of {n_slots} x {slot_size} bytes is too large"
            ))
        })?;
        Ok(Self {
            inner: Arc::new(PoolInner {
                memory: AlignedBuf::new(total, SLOT_ALIGNMENT)?,
                slot_size,
                states: Mutex::new(vec![SlotState::default(); n_slots]),
                freed: Condvar::new(),
            }),
        })
    }

    pub fn n_slots(&self) -> usize {
        self.states().len()
    }

    pub fn slot_size(&self) -> usize {
        self.inner.slot_size
    }

    pub fn free_count(&self) -> usize {
        self.states().iter().filter(|s| !s.acquired).count()
    }

    /// Take a free slot. `timeout`: `Some(ZERO)` fails at once when none is free, `None` waits
    /// for as long as it takes.
    pub fn acquire(&self, timeout: Option<Duration>) -> Result<Slot> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut states = self.states();
        loop {
            if let Some(index) = states.iter().position(|s| !s.acquired) {
                let state = &mut states[index];
                state.acquired = true;
                state.generation += 1;
                return Ok(Slot {
                    pool: self.clone(),
                    index,
                    generation: state.generation,
                });
            }
            let n_slots = states.len();
            states = match deadline {
                None => self
                    .inner
                    .freed
                    .wait(states)
                    .unwrap_or_else(|e| e.into_inner()),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Error::NoFreeSlot { n_slots });
                    }
                    self.inner
                        .freed
                        .wait_timeout(states, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }

    /// One `(address, length)` pair per slot, in slot order (for io_uring buffer registration).
    pub fn slot_regions(&self) -> Vec<(*mut u8, usize)> {
        (0..self.n_slots())
            .map(|i| (self.slot_ptr(i), self.inner.slot_size))
            .collect()
    }

    pub fn same_pool(&self, other: &StagingPool) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    fn slot_ptr(&self, index: usize) -> *mut u8 {
        // SAFETY: index < n_slots, so the offset stays inside the pool's allocation.
        unsafe { self.inner.memory.as_ptr().add(index * self.inner.slot_size) }
    }

    fn states(&self) -> MutexGuard<'_, Vec<SlotState>> {
        // Slot states are plain flags, consistent even if a holder panicked.
        self.inner.states.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An acquired slot. Released explicitly, or on drop (once no read into it is in flight).
pub struct Slot {
    pool: StagingPool,
    index: usize,
    generation: u64,
}

impl Slot {
    pub fn index(&self) -> usize {
        self.index
    }

    pub fn size(&self) -> usize {
        self.pool.inner.slot_size
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.pool.slot_ptr(self.index)
    }

    pub fn pool(&self) -> &StagingPool {
        &self.pool
    }

    pub fn is_acquired(&self) -> bool {
        self.owned(&self.pool.states()[self.index])
    }

    pub fn in_flight(&self) -> bool {
        let state = self.pool.states()[self.index];
        self.owned(&state) && state.in_flight
    }

    /// Give the slot back to the pool. Fails while a read into it is in flight.
    pub fn release(&self) -> Result<()> {
        let mut states = self.pool.states();
        self.idle_state(&mut states)?.acquired = false;
        drop(states);
        self.pool.inner.freed.notify_one();
        Ok(())
    }

    /// Mark the slot as the target of a read; the returned guard clears the mark when dropped.
    pub fn begin_read(&self) -> Result<SlotGuard> {
        let mut states = self.pool.states();
        self.idle_state(&mut states)?.in_flight = true;
        Ok(SlotGuard {
            pool: self.pool.clone(),
            index: self.index,
            ptr: self.as_ptr(),
        })
    }

    /// This slot's state, if this handle still holds the slot and no read into it is in flight.
    fn idle_state<'a>(&self, states: &'a mut [SlotState]) -> Result<&'a mut SlotState> {
        let state = &mut states[self.index];
        if !self.owned(state) {
            return Err(Error::SlotNotAcquired { index: self.index });
        }
        if state.in_flight {
            return Err(Error::SlotBusy { index: self.index });
        }
        Ok(state)
    }

    fn owned(&self, state: &SlotState) -> bool {
        state.acquired && state.generation == self.generation
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // A slot dropped mid-read stays acquired until its SlotGuard goes away.
        let mut states = self.pool.states();
        let state = &mut states[self.index];
        if self.owned(state) {
            if state.in_flight {
                state.orphaned = true;
            } else {
                state.acquired = false;
                drop(states);
                self.pool.inner.freed.notify_one();
            }
        }
    }
}

/// Proof that a read into a slot is in flight; keeps the pool's memory alive until it is dropped.
pub struct SlotGuard {
    pool: StagingPool,
    index: usize,
    ptr: *mut u8,
}

// SAFETY: ptr points into the pool's allocation, which the guard keeps alive; the in-flight
// flag gives the guard's holder exclusive use of the slot's bytes.
unsafe impl Send for SlotGuard {}
// SAFETY: as above; &SlotGuard exposes only the pointer and immutable metadata.
unsafe impl Sync for SlotGuard {}

impl SlotGuard {
    pub fn index(&self) -> usize {
        self.index
    }

    pub fn pool(&self) -> &StagingPool {
        &self.pool
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn size(&self) -> usize {
        self.pool.inner.slot_size
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let mut states = self.pool.states();
        let state = &mut states[self.index];
        state.in_flight = false;
        if state.orphaned {
            state.orphaned = false;
            state.acquired = false;
            drop(states);
            self.pool.inner.freed.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_aligned_rounded_and_distinct() {
        let pool = StagingPool::new(3, 5000).unwrap();
        assert_eq!(pool.slot_size(), 8192);
        let a = pool.acquire(Some(Duration::ZERO)).unwrap();
        let b = pool.acquire(Some(Duration::ZERO)).unwrap();
        assert_eq!(a.as_ptr() as usize % SLOT_ALIGNMENT, 0);
        assert_eq!(b.as_ptr() as usize - a.as_ptr() as usize, 8192);
        assert_eq!(pool.free_count(), 1);
    }

    #[test]
    fn large_pools_are_huge_page_aligned_and_zeroed() {
        let pool = StagingPool::new(3, 3 << 20).unwrap();
        let first = pool.slot_regions()[0].0;
        assert_eq!(first as usize % HUGE_PAGE, 0);
        let total = 3 * pool.slot_size();
        // SAFETY: the pool's allocation holds its slots, contiguous from the first.
        let bytes = unsafe { std::slice::from_raw_parts(first, total) };
        assert!(bytes.iter().all(|&b| b == 0));
    }

    #[test]
    fn acquire_fails_or_times_out_when_all_slots_are_taken() {
        let pool = StagingPool::new(1, 4096).unwrap();
        let slot = pool.acquire(None).unwrap();
        assert!(matches!(
            pool.acquire(Some(Duration::ZERO)),
            Err(Error::NoFreeSlot { n_slots: 1 })
        ));
        assert!(matches!(
            pool.acquire(Some(Duration::from_millis(20))),
            Err(Error::NoFreeSlot { .. })
        ));
        let waiter = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.acquire(None).map(|s| s.index()))
        };
        std::thread::sleep(Duration::from_millis(20));
        slot.release().unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), 0);
    }

    #[test]
    fn in_flight_slot_cannot_be_released_or_read_into_twice() {
        let pool = StagingPool::new(1, 4096).unwrap();
        let slot = pool.acquire(None).unwrap();
        let guard = slot.begin_read().unwrap();
        assert!(slot.in_flight());
        assert!(matches!(slot.release(), Err(Error::SlotBusy { index: 0 })));
        assert!(matches!(
            slot.begin_read(),
            Err(Error::SlotBusy { index: 0 })
        ));
        drop(guard);
        slot.release().unwrap();
        assert!(matches!(
            slot.release(),
            Err(Error::SlotNotAcquired { index: 0 })
        ));
    }

    #[test]
    fn stale_handle_cannot_touch_a_reacquired_slot() {
        let pool = StagingPool::new(1, 4096).unwrap();
        let old = pool.acquire(None).unwrap();
        old.release().unwrap();
        let new = pool.acquire(None).unwrap();
        assert!(matches!(
            old.begin_read(),
            Err(Error::SlotNotAcquired { .. })
        ));
        assert!(matches!(old.release(), Err(Error::SlotNotAcquired { .. })));
        drop(old);
        assert!(new.is_acquired());
    }

    #[test]
    fn dropping_a_slot_mid_read_frees_it_when_the_read_ends() {
        let pool = StagingPool::new(1, 4096).unwrap();
        let slot = pool.acquire(None).unwrap();
        let guard = slot.begin_read().unwrap();
        drop(slot);
        assert_eq!(pool.free_count(), 0);
        drop(guard);
        assert_eq!(pool.free_count(), 1);
    }

    #[test]
    fn guard_keeps_pool_memory_alive() {
        let pool = StagingPool::new(1, 4096).unwrap();
        let slot = pool.acquire(None).unwrap();
        let guard = slot.begin_read().unwrap();
        drop(slot);
        drop(pool);
        // SAFETY: the guard owns a pool handle, so its slot's memory is still allocated.
        unsafe { guard.as_ptr().write_bytes(7, guard.size()) };
    }
}
