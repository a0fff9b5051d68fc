//! The AVX2 integer kernel of Q4_1 rows interleaved by eight (`interleave`, `QType::Q4_1X8`), for resident
//! matrices: a group of eight weight rows is one linear stream, and every 32-byte load gives the same word of the
//! eight rows (lane r: row r), so their scales unpack with one load and each row's products sum in its own lane,
//! with nothing reduced across lanes.
//!
//! It gives the plain rows' group kernel (`int_group_rows` of `blocks::Q4_1`) its bits: per block and weight row
//! that kernel reduces the products to one exact integer, Σ q·x̂ over the block's 32 codes, as this one does (in
//! another order, which integers do not see); the float steps that follow are the same operations on the same
//! values, lane by lane: acc += float(sum)·(d·dx), macc += m·Σx̂, and acc + macc at the end. A resident layer so
//! computes what the same layer streamed from disk (plain rows) computes.

use std::arch::x86_64::*;

use super::super::blocks::{self, Format, GROUP};
use super::super::rows::{in_tiles, Activations, GroupKernel, GROUP_ROWS, MAX_T};
use super::{halves8, IntDot, Madd, Vnni};

/// Q4_1.
type Q4_1 = blocks::Q4_1;
/// Bytes of one block of a group's eight rows: word 0 (d and m) of each row, then words 1-4 (code bytes 0-15).
const GROUP_BLOCK: usize = GROUP_ROWS * Q4_1::BYTES;
/// Interleaved code words per block: word c holds code bytes 4c..4c + 4 of each row, whose low nibbles are the
/// block's elements 4c..4c + 4 and whose high nibbles are elements 16 + 4c..16 + 4c + 4.
const CODE_WORDS: usize = 4;

/// The integer group kernel of interleaved Q4_1 rows (8-bit activations), with VNNI products if `vnni`. Call
/// only if `available()` (and `vnni_available()` for `vnni`).
pub fn q4_1_x8(vnni: bool) -> GroupKernel {
    // SAFETY (both): `matmul` selects these kernels only where the CPU has their features, and hands them one
    // whole group (`rows`' contract).
    if vnni {
        |a, rows, row_bytes, y| unsafe { rows_vnni(a, rows, row_bytes, y) }
    } else {
        |a, rows, row_bytes, y| unsafe { rows_avx2(a, rows, row_bytes, y) }
    }
}

/// `rows`'s AVX2 entry point.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_avx2(
    a: &Activations,
    group: &[u8],
    row_bytes: usize,
    y: &mut [[f32; GROUP_ROWS]; MAX_T],
) {
    // SAFETY: the caller's contract is `rows`', on a CPU with AVX2.
    unsafe { rows::<Madd>(a, group, row_bytes, y) }
}

/// `rows`'s entry point with AVX-512 VNNI products.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn rows_vnni(
    a: &Activations,
    group: &[u8],
    row_bytes: usize,
    y: &mut [[f32; GROUP_ROWS]; MAX_T],
) {
    // SAFETY: the caller's contract is `rows`', on a CPU with VNNI.
    unsafe { rows::<Vnni>(a, group, row_bytes, y) }
}

/// One interleaved group of eight rows (`group`: 8 · row_bytes bytes, row_bytes = k / 32 · 20), in tiles of up to 8
/// activation rows (`in_tiles`); y[t][r] for row r.
///
/// # Safety
/// `group` must be one whole group; the caller runs with D's features.
#[inline(always)]
unsafe fn rows<D: IntDot>(
    a: &Activations,
    group: &[u8],
    row_bytes: usize,
    y: &mut [[f32; GROUP_ROWS]; MAX_T],
) {
    debug_assert!(group.len() == GROUP_ROWS * row_bytes && row_bytes == a.k / GROUP * Q4_1::BYTES);
    let base = group.as_ptr();
    in_tiles!(a.t, y, |t0, out| tile::<D>(a, base, t0, out));
}

/// y[0..R] (lane r: weight row r) for activation rows t0..t0 + R; returns R.
///
/// # Safety
/// `base` must point at one whole group of `a.k / 32` blocks; t0 + R <= a.t; the caller runs with D's features.
#[inline(always)]
unsafe fn tile<D: IntDot, const R: usize>(
    a: &Activations,
    base: *const u8,
    t0: usize,
    y: &mut [[f32; GROUP_ROWS]],
) -> usize {
    let q8 = a.q8_for(Q4_1::SPAN);
    let gs = a.k / GROUP;
    // Activation row t0 + r's codes (gs groups of 32), scales and sums (one per group) start r · gs groups on.
    // SAFETY: `matmul` quantized t rows of k codes (gs scales and sums each), and t0 + R <= t.
    let (codes, scales, sums) = unsafe {
        (
            q8.codes.as_ptr().add(t0 * a.k),
            q8.scales.as_ptr().add(t0 * gs),
            q8.sums.as_ptr().add(t0 * gs),
        )
    };
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut macc = [_mm256_setzero_ps(); R];
    for bi in 0..gs {
        // SAFETY: block bi of the group is inside it (the caller's contract).
        let block = unsafe { base.add(bi * GROUP_BLOCK) };
        let (d, m) = halves8(unsafe { _mm256_loadu_si256(block.cast()) });
        // One code word at a time, met by the R activation rows in turn: R independent running sums, each
        // with its own chain of products, which the CPU overlaps (row by row, one chain of eight waited on
        // the last).
        let mut int_sums = [_mm256_setzero_si256(); R];
        for c in 0..CODE_WORDS {
            // SAFETY: word 1 + c of the block.
            let word = unsafe { _mm256_loadu_si256(block.add(32 * (1 + c)).cast()) };
            // Elements 4c..4c + 4 of each row (low nibbles), then 16 + 4c.. (high).
            let halves = [
                (_mm256_and_si256(word, low), 4 * c),
                (
                    _mm256_and_si256(_mm256_srli_epi16(word, 4), low),
                    16 + 4 * c,
                ),
            ];
            for (w, at) in halves {
                for (r, sum) in int_sums.iter_mut().enumerate() {
                    // The activation bytes this code vector meets, in every lane.
                    // SAFETY: group bi of activation row t0 + r holds 32 codes.
                    let x = unsafe {
                        codes
                            .add((r * gs + bi) * GROUP + at)
                            .cast::<i32>()
                            .read_unaligned()
                    };
                    // SAFETY: the caller runs with D's features.
                    *sum = unsafe { D::add_products(*sum, w, _mm256_set1_epi32(x)) };
                }
            }
        }
        for (r, sum) in int_sums.into_iter().enumerate() {
            // SAFETY: as for the codes; one scale and sum per group (Q4_1's span is a group).
            let (dx, sx) = unsafe { (*scales.add(r * gs + bi), *sums.add(r * gs + bi)) };
            let sum = _mm256_cvtepi32_ps(unsafe { D::widen(sum) });
            acc[r] = _mm256_fmadd_ps(sum, _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[r]);
            macc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx), macc[r]);
        }
    }
    for r in 0..R {
        // SAFETY: y[r] holds GROUP_ROWS floats.
        unsafe { _mm256_storeu_ps(y[r].as_mut_ptr(), _mm256_add_ps(acc[r], macc[r])) };
    }
    R
}
