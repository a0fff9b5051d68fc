//! AVX-512 (F, BW, VL) row kernels. Each 32-element group of a weight block is decoded once into two 16-lane
//! float32 vectors of dequantized weights (`d·q + m`, one rounding), which then meet every activation row of a
//! tile with one FMA per 16 elements; there is no separate `m·Σx` term.
//!
//! 4- and 5-bit codes never go through integer-to-float conversion: per (sub-)block a table `d·i + m` of the
//! 16 (or 32) possible weights is built with one FMA (two), and `vpermps` (`vpermt2ps`) looks the codes up,
//! reading only the low 4 (5) bits of each index lane, so nibbles need no masking.
//!
//! Everything here is `unsafe` with `#[target_feature]`: `matmul` hands these kernels out only after
//! `available()` has confirmed the CPU features at run time.

use std::arch::x86_64::*;

use super::blocks::{self, Format, GROUP, MAX_SUBS};
use super::rows::{in_tiles, Activations, RowKernel, MAX_T};

/// Whether this CPU runs the kernels of this module.
pub fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
}

/// A block format whose groups decode to float32 weights with AVX-512.
pub trait Avx512Format: Format {
    /// What decoding the groups of one block needs besides the codes (weight tables or scales).
    type Scales;
    /// The scales of the block at `b` (`Self::BYTES` readable bytes).
    unsafe fn block_scales(b: *const u8) -> Self::Scales;
    /// Dequantized weights of group `g` of the block at `b`: elements 0..16 and 16..32.
    unsafe fn weights(b: *const u8, s: &Self::Scales, g: usize) -> [__m512; 2];
}

/// The row kernel for block format `F`. Call only if `available()`.
pub fn quantized<F: Avx512Format>() -> RowKernel {
    // SAFETY: `matmul` selects this kernel only when `available()` returned true.
    |a, row, y| unsafe { quantized_row::<F>(a, row, y) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn quantized_row<F: Avx512Format>(a: &Activations, row: &[u8], y: &mut [f32; MAX_T]) {
    // Tiles of R activation rows keep two accumulators each in registers (two, so that T = 1 is not bound by
    // FMA latency); the weight row (a few hundred bytes) is re-read from L1 cache for each tile.
    // The tiles' contract is this function's.
    in_tiles!(a.t, y, |t0, out| quantized_tile::<F>(a, row, t0, out));
}

/// y[0..R] for activation rows t0..t0 + R; returns R.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn quantized_tile<F: Avx512Format, const R: usize>(
    a: &Activations,
    row: &[u8],
    t0: usize,
    y: &mut [f32],
) -> usize {
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let groups = F::BLOCK / GROUP;
    let xs: [*const f32; R] = std::array::from_fn(|r| a.x[(t0 + r) * a.k..].as_ptr());
    for (bi, b) in row.chunks_exact(F::BYTES).enumerate() {
        // SAFETY: `b` holds F::BYTES bytes.
        let s = unsafe { F::block_scales(b.as_ptr()) };
        for g in 0..groups {
            // SAFETY: as above.
            let w = unsafe { F::weights(b.as_ptr(), &s, g) };
            let at = (bi * groups + g) * GROUP;
            for (acc, x) in acc.iter_mut().zip(xs) {
                // SAFETY: `matmul` checked x.len() == t * k and row.len() == k / BLOCK * BYTES, so group
                // bi * groups + g of activation row t0 + r (< t) lies inside x; loads are unaligned.
                let xv = unsafe { [_mm512_loadu_ps(x.add(at)), _mm512_loadu_ps(x.add(at + 16))] };
                acc[0] = _mm512_fmadd_ps(w[0], xv[0], acc[0]);
                acc[1] = _mm512_fmadd_ps(w[1], xv[1], acc[1]);
            }
        }
    }
    for (y, acc) in y.iter_mut().zip(acc) {
        *y = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
    }
    R
}

/// 16 unaligned bytes at `p`, zero-extended to 32-bit lanes.
///
/// # Safety
/// `p` must have 16 readable bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn bytes16(p: *const u8) -> __m512i {
    // SAFETY: guaranteed by the caller.
    _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(p.cast()) })
}

/// The f16 at `p` as float32, in every lane.
///
/// # Safety
/// `p` must have 2 readable bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn half(p: *const u8) -> __m512 {
    // SAFETY: guaranteed by the caller.
    let h = unsafe { p.cast::<i16>().read_unaligned() };
    _mm512_cvtph_ps(_mm256_set1_epi16(h))
}

/// The f16 pair (d, m) at `p` as float32, each in every lane.
///
/// # Safety
/// `p` must have 4 readable bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn half_pair(p: *const u8) -> (__m512, __m512) {
    // SAFETY: guaranteed by the caller.
    let dm = _mm512_cvtph_ps(_mm256_set1_epi32(unsafe {
        p.cast::<i32>().read_unaligned()
    }));
    (_mm512_moveldup_ps(dm), _mm512_movehdup_ps(dm))
}

/// The 16 weights `d·(first + i) + m`, i = 0..16 (exact for the GGUF scales: f16 x small integer).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn table(d: __m512, m: __m512, first: f32) -> __m512 {
    let codes = _mm512_add_ps(
        _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        ),
        _mm512_set1_ps(first),
    );
    _mm512_fmadd_ps(d, codes, m)
}

/// Weights of 32 elements whose 4-bit codes are in the low 4 bits of the lanes of `idx` (bits above ignored).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn lookup16(idx: [__m512i; 2], table: __m512) -> [__m512; 2] {
    idx.map(|i| _mm512_permutexvar_ps(i, table))
}

/// Weights of 32 elements whose codes are the low 4 bits of the lanes of `idx` plus bit 4 from `high`
/// (bit j: element j), looked up in the 32-entry table `tables`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn lookup32(idx: [__m512i; 2], high: u32, tables: &[__m512; 2]) -> [__m512; 2] {
    let (nib, bit4) = (_mm512_set1_epi32(0x0F), _mm512_set1_epi32(0x10));
    let [lo, hi] = idx.map(|i| _mm512_and_si512(i, nib));
    let masks = [high as __mmask16, (high >> 16) as __mmask16];
    [(lo, masks[0]), (hi, masks[1])].map(|(i, k)| {
        _mm512_permutex2var_ps(tables[0], _mm512_mask_or_epi32(i, k, i, bit4), tables[1])
    })
}

/// The nibble-packed 16 bytes at `qs` of the legacy types as index lanes: element j < 16 is the low nibble of
/// byte j, element j >= 16 the high nibble of byte j - 16.
///
/// # Safety
/// `qs` must have 16 readable bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn legacy_nibbles(qs: *const u8) -> [__m512i; 2] {
    // SAFETY: guaranteed by the caller.
    let z = unsafe { bytes16(qs) };
    [z, _mm512_srli_epi32(z, 4)]
}

/// 32 signed byte codes times d0 (elements 0..16) and d1 (16..32).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn scaled_i8(v: __m256i, d0: __m512, d1: __m512) -> [__m512; 2] {
    let widen = |h: __m128i| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(h));
    [
        _mm512_mul_ps(widen(_mm256_castsi256_si128(v)), d0),
        _mm512_mul_ps(widen(_mm256_extracti128_si256(v, 1)), d1),
    ]
}

/// 32 unaligned bytes at `p`.
///
/// # Safety
/// `p` must have 32 readable bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn load32(p: *const u8) -> __m256i {
    // SAFETY: guaranteed by the caller.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// The little-endian u32 at `p`.
///
/// # Safety
/// `p` must have 4 readable bytes.
unsafe fn u32_at(p: *const u8) -> u32 {
    // SAFETY: guaranteed by the caller.
    u32::from_le(unsafe { p.cast::<u32>().read_unaligned() })
}

/// Per-sub-block scales decoded by the scalar `Format::scales` (the K types: done once per 256 elements).
pub struct SubScales {
    d: [f32; MAX_SUBS],
    m: [f32; MAX_SUBS],
}

impl SubScales {
    /// The scales of the `F` block at `b`.
    ///
    /// # Safety
    /// `b` must have `F::BYTES` readable bytes.
    unsafe fn of<F: Format>(b: *const u8) -> SubScales {
        let mut s = SubScales {
            d: [0.0; MAX_SUBS],
            m: [0.0; MAX_SUBS],
        };
        // SAFETY: guaranteed by the caller.
        F::scales(
            unsafe { std::slice::from_raw_parts(b, F::BYTES) },
            &mut s.d,
            &mut s.m,
        );
        s
    }
}

// SAFETY (all `block_scales` and `weights` below): the caller passes `Self::BYTES` readable bytes at `b`; every
// offset read is within the block layout documented in `blocks.rs`.
impl Avx512Format for blocks::Q8_0 {
    type Scales = __m512;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn block_scales(b: *const u8) -> __m512 {
        unsafe { half(b) }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn weights(b: *const u8, d: &__m512, _g: usize) -> [__m512; 2] {
        scaled_i8(unsafe { load32(b.add(2)) }, *d, *d)
    }
}

impl Avx512Format for blocks::Q4_0 {
    type Scales = __m512;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn block_scales(b: *const u8) -> __m512 {
        table(unsafe { half(b) }, _mm512_setzero_ps(), -8.0)
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn weights(b: *const u8, t: &__m512, _g: usize) -> [__m512; 2] {
        lookup16(unsafe { legacy_nibbles(b.add(2)) }, *t)
    }
}

impl Avx512Format for blocks::Q4_1 {
    type Scales = __m512;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn block_scales(b: *const u8) -> __m512 {
        let (d, m) = unsafe { half_pair(b) };
        table(d, m, 0.0)
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn weights(b: *const u8, t: &__m512, _g: usize) -> [__m512; 2] {
        lookup16(unsafe { legacy_nibbles(b.add(4)) }, *t)
    }
}

impl Avx512Format for blocks::Q5_0 {
    type Scales = [__m512; 2];
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn block_scales(b: *const u8) -> [__m512; 2] {
        let d = unsafe { half(b) };
        [-16.0, 0.0].map(|first| table(d, _mm512_setzero_ps(), first))
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn weights(b: *const u8, t: &[__m512; 2], _g: usize) -> [__m512; 2] {
        unsafe { lookup32(legacy_nibbles(b.add(6)), u32_at(b.add(2)), t) }
    }
}

impl Avx512Format for blocks::Q5_1 {
    type Scales = [__m512; 2];
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn block_scales(b: *const u8) -> [__m512; 2] {
        let (d, m) = unsafe { half_pair(b) };
        [0.0, 16.0].map(|first| table(d, m, first))
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn weights(b: *const u8, t: &[__m512; 2], _g: usize) -> [__m512; 2] {
        unsafe { lookup32(legacy_nibbles(b.add(8)), u32_at(b.add(4)), t) }
    }
}

/// Q4_K/Q5_K low 4 bits of group g as index lanes (bits above 3 not cleared): nibble g % 2 of the 32 bytes at
/// `qs + 32 * (g / 2)`.
///
/// # Safety
/// `qs` must have 128 readable bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn k_nibbles(qs: *const u8, g: usize) -> [__m512i; 2] {
    let shift = _mm_cvtsi32_si128(4 * (g % 2) as i32);
    // SAFETY: 32 * (g / 2) + 32 <= 128 for the 8 groups of a K block.
    [0, 16].map(|o| _mm512_srl_epi32(unsafe { bytes16(qs.add(32 * (g / 2) + o)) }, shift))
}

impl Avx512Format for blocks::Q4K {
    type Scales = SubScales;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn block_scales(b: *const u8) -> SubScales {
        unsafe { SubScales::of::<Self>(b) }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn weights(b: *const u8, s: &SubScales, g: usize) -> [__m512; 2] {
        let t = table(_mm512_set1_ps(s.d[g]), _mm512_set1_ps(s.m[g]), 0.0);
        lookup16(unsafe { k_nibbles(b.add(16), g) }, t)
    }
}

impl Avx512Format for blocks::Q5K {
    type Scales = SubScales;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn block_scales(b: *const u8) -> SubScales {
        unsafe { SubScales::of::<Self>(b) }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn weights(b: *const u8, s: &SubScales, g: usize) -> [__m512; 2] {
        let (d, m) = (_mm512_set1_ps(s.d[g]), _mm512_set1_ps(s.m[g]));
        let tables = [table(d, m, 0.0), table(d, m, 16.0)];
        // bit 4 of element j is bit g of qh[j]
        let high = _mm256_test_epi8_mask(unsafe { load32(b.add(16)) }, _mm256_set1_epi8(1 << g));
        lookup32(unsafe { k_nibbles(b.add(48), g) }, high, &tables)
    }
}

impl Avx512Format for blocks::Q6K {
    type Scales = SubScales;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn block_scales(b: *const u8) -> SubScales {
        unsafe { SubScales::of::<Self>(b) }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn weights(b: *const u8, s: &SubScales, g: usize) -> [__m512; 2] {
        let (h, t) = (g / 4, g % 4);
        let (ql, qh) = unsafe {
            (
                load32(b.add(64 * h + 32 * (t % 2))),
                load32(b.add(128 + 32 * h)),
            )
        };
        let bits = |v: __m256i, shift: usize, mask: i8| {
            _mm256_and_si256(
                _mm256_srl_epi16(v, _mm_cvtsi32_si128(shift as i32)),
                _mm256_set1_epi8(mask),
            )
        };
        let q = _mm256_or_si256(
            bits(ql, 4 * (t / 2), 0x0F),
            _mm256_slli_epi16(bits(qh, 2 * t, 3), 4),
        );
        let (d0, d1) = (_mm512_set1_ps(s.d[2 * g]), _mm512_set1_ps(s.d[2 * g + 1]));
        scaled_i8(_mm256_sub_epi8(q, _mm256_set1_epi8(32)), d0, d1)
    }
}

/// The ternary types: codes as the AVX2 decoder gives them (-1..=2 as int8), times the block's d.
macro_rules! ternary_format {
    ($t:ty, $d_at:expr) => {
        impl Avx512Format for $t {
            type Scales = __m512;
            #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
            unsafe fn block_scales(b: *const u8) -> __m512 {
                unsafe { half(b.add($d_at)) }
            }
            #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
            unsafe fn weights(b: *const u8, d: &__m512, g: usize) -> [__m512; 2] {
                // SAFETY: AVX-512 F implies the AVX2, FMA and F16C the decoder needs; `b` holds the block.
                let codes = unsafe { <$t as super::avx2::SimdFormat>::code_bytes(b, g) };
                scaled_i8(codes, *d, *d)
            }
        }
    };
}

ternary_format!(blocks::TQ1_0, 52);
ternary_format!(blocks::TQ2_0, 64);
