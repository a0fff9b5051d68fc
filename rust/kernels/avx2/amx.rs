//! Intel AMX (Advanced Matrix Extensions) for the integer kernels' byte products: whether this process may use
//! the tiles, their configuration, and the few tile instructions the kernels take, as inline assembly (Rust's AMX
//! intrinsics are not stable). A tile is a 2-D register of up to 16 rows of 64 bytes; `tdpbsud` multiplies an
//! [M, 4K] tile of signed bytes by a [K, 4N] tile of unsigned bytes (row k holding N groups of 4 bytes: column n's
//! elements 4k..4k + 4) into an [M, N] tile of i32 sums, exact: one instruction for what takes the 256-bit VNNI
//! products M·K·N/8 instructions.
//!
//! The compiler never allocates tile registers, so the assembly names them by number and declares no clobbers.

use std::arch::asm;
use std::sync::OnceLock;

/// Whether this CPU has AMX-TILE and AMX-INT8, and Linux has given this process the tile state (each process asks
/// for it once: `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; the first tile instruction without it
/// faults). Asked once, on the first call.
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        // CPUID leaf 7, sub-leaf 0, EDX: bit 24 AMX-TILE, bit 25 AMX-INT8 (leaf 7 exists on every CPU with AVX2,
        // checked first).
        let amx = super::available() && {
            let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
            edx >> 24 & 1 == 1 && edx >> 25 & 1 == 1
        };
        amx && tile_state_granted()
    })
}

#[cfg(target_os = "linux")]
fn tile_state_granted() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a system call with integer arguments; it changes only this process's permitted register state.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn tile_state_granted() -> bool {
    false
}

/// A tile configuration (`ldtilecfg`'s 64-byte operand, palette 1): rows and bytes per row of each tile.
#[repr(C, align(64))]
pub struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

impl Config {
    /// Tile i: `shapes[i]` = (rows <= 16, bytes per row <= 64); the other tiles unused.
    pub fn new(shapes: [(usize, usize); 8]) -> Config {
        let mut config = Config {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            bytes_per_row: [0; 16],
            rows: [0; 16],
        };
        for (i, (rows, bytes)) in shapes.into_iter().enumerate() {
            assert!(
                rows <= 16 && bytes <= 64,
                "an AMX tile holds 16 rows of 64 bytes"
            );
            config.rows[i] = rows as u8;
            config.bytes_per_row[i] = bytes as u16;
        }
        config
    }

    /// Configures the tiles of the calling thread (and zeroes them).
    ///
    /// # Safety
    /// Only if `available()`.
    #[inline(always)]
    pub unsafe fn load(&self) {
        // SAFETY: the caller's contract; the operand is 64 readable bytes.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) self, options(nostack, readonly, preserves_flags))
        };
    }
}

/// Returns the calling thread's tiles to their initial state (no tile data for context switches to save).
///
/// # Safety
/// Only if `available()`.
#[inline(always)]
pub unsafe fn release() {
    // SAFETY: the caller's contract.
    unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
}

/// Tile T's rows from `at`, `stride` bytes apart.
///
/// # Safety
/// A configuration is loaded; the tile's rows · stride bytes from `at` are readable.
#[inline(always)]
pub unsafe fn load<const T: u8>(at: *const u8, stride: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        asm!("tileloadd tmm{t}, [{at} + {stride} * 1]", t = const T, at = in(reg) at, stride = in(reg) stride,
             options(nostack, readonly, preserves_flags))
    };
}

/// Tile T's rows to `at`, `stride` bytes apart.
///
/// # Safety
/// A configuration is loaded; the tile's rows · stride bytes from `at` are writable.
#[inline(always)]
pub unsafe fn store<const T: u8>(at: *mut u8, stride: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        asm!("tilestored [{at} + {stride} * 1], tmm{t}", t = const T, at = in(reg) at, stride = in(reg) stride,
             options(nostack, preserves_flags))
    };
}

/// Tile T = 0.
///
/// # Safety
/// A configuration is loaded.
#[inline(always)]
pub unsafe fn zero<const T: u8>() {
    // SAFETY: the caller's contract.
    unsafe { asm!("tilezero tmm{t}", t = const T, options(nostack, nomem, preserves_flags)) };
}

/// Tile C += tile A (signed bytes) · tile B (unsigned bytes, 4 per column and row), as i32 sums.
///
/// # Safety
/// A configuration is loaded whose shapes agree: A [M, 4K], B [K, 4N], C [M, 4N] bytes.
#[inline(always)]
pub unsafe fn dot_signed_unsigned<const C: u8, const A: u8, const B: u8>() {
    // SAFETY: the caller's contract.
    unsafe {
        asm!("tdpbsud tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
             options(nostack, nomem, preserves_flags))
    };
}

/// Tile C += tile A (signed bytes) · tile B (signed bytes, 4 per column and row), as i32 sums.
///
/// # Safety
/// As `dot_signed_unsigned`.
#[inline(always)]
pub unsafe fn dot_signed<const C: u8, const A: u8, const B: u8>() {
    // SAFETY: the caller's contract.
    unsafe {
        asm!("tdpbssd tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
             options(nostack, nomem, preserves_flags))
    };
}
