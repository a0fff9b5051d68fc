//! AVX2 + FMA (+ F16C) row kernels: the structure of `dot.rs` with codes decoded 32 at a time into four
//! 8-lane float32 vectors and one vector accumulator per activation row.
//!
//! Everything here is `unsafe` with `#[target_feature]`: `matmul` hands these kernels out only after
//! `available()` has confirmed the CPU features at run time.

use std::arch::x86_64::*;

use super::blocks::{self, Dense, Format, GROUP, MAX_SUBS};
use super::rows::{Activations, RowKernel, MAX_T};

/// Whether this CPU runs the kernels of this module.
pub fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// A block format whose group codes decode with AVX2.
pub trait SimdFormat: Format {
    /// Codes of group `g` of the block at `b` (`Self::BYTES` readable bytes), as float32 elements 0..32.
    unsafe fn simd_codes(b: *const u8, g: usize) -> [__m256; 4];
}

/// A dense float type loadable 8 elements at a time.
pub trait SimdDense: Dense {
    /// Elements 0..8 at `p` (8 * `Self::BYTES` readable bytes) as float32.
    unsafe fn load8(p: *const u8) -> __m256;
}

/// The row kernel for block format `F`. Call only if `available()`.
pub fn quantized<F: SimdFormat>() -> RowKernel {
    // SAFETY: `matmul` selects this kernel only when `available()` returned true.
    |a, row, y| unsafe { quantized_row::<F>(a, row, y) }
}

/// The row kernel for dense type `D`. Call only if `available()`.
pub fn dense<D: SimdDense>() -> RowKernel {
    // SAFETY: as in `quantized`.
    |a, row, y| unsafe { dense_row::<D>(a, row, y) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantized_row<F: SimdFormat>(a: &Activations, row: &[u8], y: &mut [f32; MAX_T]) {
    // Tiles of R activation rows keep their accumulators in registers; the weight row (a few hundred bytes)
    // is re-read from L1 cache for each tile, so memory traffic stays one pass.
    let mut t0 = 0;
    while t0 < a.t {
        let left = a.t - t0;
        let out = &mut y[t0..];
        // SAFETY: (all four) same contract as this function; t0 + R <= a.t.
        t0 += match left {
            8.. => unsafe { quantized_tile::<F, 8>(a, row, t0, out) },
            4..=7 => unsafe { quantized_tile::<F, 4>(a, row, t0, out) },
            2..=3 => unsafe { quantized_tile::<F, 2>(a, row, t0, out) },
            _ => unsafe { quantized_tile::<F, 1>(a, row, t0, out) },
        };
    }
}

/// y[0..R] for activation rows t0..t0 + R; returns R.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantized_tile<F: SimdFormat, const R: usize>(
    a: &Activations,
    row: &[u8],
    t0: usize,
    y: &mut [f32],
) -> usize {
    let (mut d, mut m) = ([0f32; MAX_SUBS], [0f32; MAX_SUBS]);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut macc = [0f32; R];
    let groups = F::BLOCK / GROUP;
    // Row starts of the tile's activations and group sums (the latter only dereferenced for affine types).
    let xs: [*const f32; R] = std::array::from_fn(|r| a.x[(t0 + r) * a.k..].as_ptr());
    let sums: [*const f32; R] =
        std::array::from_fn(|r| a.sums.as_ptr().wrapping_add((t0 + r) * (a.k / GROUP)));
    for (bi, b) in row.chunks_exact(F::BYTES).enumerate() {
        F::scales(b, &mut d, &mut m);
        for g in 0..groups {
            // SAFETY: `b` holds F::BYTES bytes.
            let c = unsafe { F::simd_codes(b.as_ptr(), g) };
            let gi = bi * groups + g;
            for r in 0..R {
                // SAFETY: `matmul` checked x.len() == t * k and row.len() == k / BLOCK * BYTES, so group gi of
                // activation row t0 + r (t0 + r < t) lies inside x; loads are unaligned.
                let xv =
                    unsafe { [0, 8, 16, 24].map(|o| _mm256_loadu_ps(xs[r].add(gi * GROUP + o))) };
                let lo = _mm256_fmadd_ps(c[1], xv[1], _mm256_mul_ps(c[0], xv[0]));
                let hi = _mm256_fmadd_ps(c[3], xv[3], _mm256_mul_ps(c[2], xv[2]));
                acc[r] = if F::SUB == GROUP {
                    _mm256_fmadd_ps(_mm256_set1_ps(d[g]), _mm256_add_ps(lo, hi), acc[r])
                } else {
                    let acc = _mm256_fmadd_ps(_mm256_set1_ps(d[2 * g]), lo, acc[r]);
                    _mm256_fmadd_ps(_mm256_set1_ps(d[2 * g + 1]), hi, acc)
                };
                if F::AFFINE {
                    // SAFETY: for affine types `sums` holds t * k / GROUP floats, so this index is inside it.
                    macc[r] += m[g] * unsafe { *sums[r].add(gi) };
                }
            }
        }
    }
    for r in 0..R {
        y[r] = hsum(acc[r]) + macc[r];
    }
    R
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dense_row<D: SimdDense>(a: &Activations, row: &[u8], y: &mut [f32; MAX_T]) {
    let mut acc = [_mm256_setzero_ps(); MAX_T];
    let mut tail = [0f32; MAX_T];
    let k8 = a.k / 8 * 8;
    for i in (0..k8).step_by(8) {
        // SAFETY: the row holds k * D::BYTES bytes and i + 8 <= k.
        let w = unsafe { D::load8(row.as_ptr().add(i * D::BYTES)) };
        for ti in 0..a.t {
            let x = &a.x[ti * a.k + i..][..8];
            // SAFETY: `x` has 8 floats.
            acc[ti] = _mm256_fmadd_ps(w, unsafe { _mm256_loadu_ps(x.as_ptr()) }, acc[ti]);
        }
    }
    for i in k8..a.k {
        let w = D::get(row, i);
        for ti in 0..a.t {
            tail[ti] += w * a.x[ti * a.k + i];
        }
    }
    for ti in 0..a.t {
        y[ti] = hsum(acc[ti]) + tail[ti];
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// 16 byte codes -> 2 x 8 float32 (as int8 if `SIGNED`, else as uint8).
#[target_feature(enable = "avx2,fma,f16c")]
fn widen16<const SIGNED: bool>(v: __m128i) -> [__m256; 2] {
    [v, _mm_srli_si128(v, 8)].map(|h| {
        let i = if SIGNED {
            _mm256_cvtepi8_epi32(h)
        } else {
            _mm256_cvtepu8_epi32(h)
        };
        _mm256_cvtepi32_ps(i)
    })
}

/// 32 byte codes -> 4 x 8 float32.
#[target_feature(enable = "avx2,fma,f16c")]
fn widen32<const SIGNED: bool>(v: __m256i) -> [__m256; 4] {
    let [a, b] = widen16::<SIGNED>(_mm256_castsi256_si128(v));
    let [c, e] = widen16::<SIGNED>(_mm256_extracti128_si256(v, 1));
    [a, b, c, e]
}

/// Q4_x/Q5_x codes of one block: 16 bytes of nibbles at `qs` (element j < 16: low nibble of byte j, else high
/// nibble of byte j - 16), plus bit j of `qh` as bit 4 (Q5 types), minus `offset`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy<const SIGNED: bool>(qs: *const u8, qh: Option<u32>, offset: i8) -> [__m256; 4] {
    // SAFETY: the caller passes 16 readable bytes at `qs`.
    let v = unsafe { _mm_loadu_si128(qs.cast()) };
    let nib = _mm_set1_epi8(0x0F);
    let mut halves = [
        _mm_and_si128(v, nib),
        _mm_and_si128(_mm_srli_epi16(v, 4), nib),
    ];
    if let Some(qh) = qh {
        // byte j of half h gets byte 2h + j/8 of qh, tested against bit j % 8
        let bits = _mm_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let all = _mm_set1_epi32(qh as i32);
        let select = [
            _mm_set_epi64x(0x0101_0101_0101_0101, 0),
            _mm_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202),
        ];
        for (half, sel) in halves.iter_mut().zip(select) {
            let set = _mm_cmpeq_epi8(_mm_and_si128(_mm_shuffle_epi8(all, sel), bits), bits);
            *half = _mm_or_si128(*half, _mm_and_si128(set, _mm_set1_epi8(0x10)));
        }
    }
    let [a, b] = widen16::<SIGNED>(_mm_sub_epi8(halves[0], _mm_set1_epi8(offset)));
    let [c, e] = widen16::<SIGNED>(_mm_sub_epi8(halves[1], _mm_set1_epi8(offset)));
    [a, b, c, e]
}

/// `(v >> shift) & mask` on every byte of 32.
#[target_feature(enable = "avx2,fma,f16c")]
fn bits32(v: __m256i, shift: usize, mask: i8) -> __m256i {
    _mm256_and_si256(
        _mm256_srl_epi16(v, _mm_cvtsi32_si128(shift as i32)),
        _mm256_set1_epi8(mask),
    )
}

/// 32 unaligned bytes at `p`.
///
/// # Safety
/// `p` must have 32 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load32(p: *const u8) -> __m256i {
    // SAFETY: guaranteed by the caller.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

// SAFETY (all `codes` below): the caller passes `Self::BYTES` readable bytes at `b`; every offset read is within
// the block layout documented in `blocks.rs`.
impl SimdFormat for blocks::Q8_0 {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn simd_codes(b: *const u8, _g: usize) -> [__m256; 4] {
        unsafe { widen32::<true>(load32(b.add(2))) }
    }
}

impl SimdFormat for blocks::Q4_0 {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn simd_codes(b: *const u8, _g: usize) -> [__m256; 4] {
        unsafe { legacy::<true>(b.add(2), None, 8) }
    }
}

impl SimdFormat for blocks::Q4_1 {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn simd_codes(b: *const u8, _g: usize) -> [__m256; 4] {
        unsafe { legacy::<false>(b.add(4), None, 0) }
    }
}

impl SimdFormat for blocks::Q5_0 {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn simd_codes(b: *const u8, _g: usize) -> [__m256; 4] {
        unsafe { legacy::<true>(b.add(6), Some(b.add(2).cast::<u32>().read_unaligned()), 16) }
    }
}

impl SimdFormat for blocks::Q5_1 {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn simd_codes(b: *const u8, _g: usize) -> [__m256; 4] {
        unsafe { legacy::<false>(b.add(8), Some(b.add(4).cast::<u32>().read_unaligned()), 0) }
    }
}

impl SimdFormat for blocks::Q4K {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn simd_codes(b: *const u8, g: usize) -> [__m256; 4] {
        let qs = unsafe { load32(b.add(16 + 32 * (g / 2))) };
        widen32::<false>(bits32(qs, 4 * (g % 2), 0x0F))
    }
}

impl SimdFormat for blocks::Q5K {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn simd_codes(b: *const u8, g: usize) -> [__m256; 4] {
        let (qs, qh) = unsafe { (load32(b.add(48 + 32 * (g / 2))), load32(b.add(16))) };
        let high = _mm256_slli_epi16(bits32(qh, g, 1), 4);
        widen32::<false>(_mm256_or_si256(bits32(qs, 4 * (g % 2), 0x0F), high))
    }
}

impl SimdFormat for blocks::Q6K {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn simd_codes(b: *const u8, g: usize) -> [__m256; 4] {
        let (h, t) = (g / 4, g % 4);
        let (ql, qh) = unsafe {
            (
                load32(b.add(64 * h + 32 * (t % 2))),
                load32(b.add(128 + 32 * h)),
            )
        };
        let high = _mm256_slli_epi16(bits32(qh, 2 * t, 3), 4);
        let q = _mm256_or_si256(bits32(ql, 4 * (t / 2), 0x0F), high);
        widen32::<true>(_mm256_sub_epi8(q, _mm256_set1_epi8(32)))
    }
}

// SAFETY (all `load8` below): the caller passes 8 * `Self::BYTES` readable bytes at `p`.
impl SimdDense for blocks::F32 {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        unsafe { _mm256_loadu_ps(p.cast()) }
    }
}

impl SimdDense for blocks::F16 {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

impl SimdDense for blocks::BF16 {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        let bits = unsafe { _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())) };
        _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16))
    }
}
