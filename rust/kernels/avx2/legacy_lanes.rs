//! The group kernel of the legacy formats' plain rows (blocks of 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) with AVX-512
//! VNNI: sixteen weight rows a call, each block's codes transposed into the lanes of 512-bit vectors (lane j: row
//! j), so that an activation row meets sixteen rows' block in eight products and one float step, where the
//! eight-row kernel (`int_group_rows`) takes twice as many of each. Every lane does that kernel's steps: the same
//! exact integer block sum, then the same float operations in the same order, so the bits are the same.

use std::arch::x86_64::*;

use super::super::blocks::GROUP;
use super::super::rows::{in_tiles, Activations, Kernel, GROUP_ROWS, MAX_T, WIDE_ROWS};
use super::interleaved::{join_ps, join_si};
use super::{legacy_scales8, Prefetch, SimdFormat};

/// The integer kernel of F's plain rows with AVX-512 VNNI's products (`Products::Avx512Vnni`, or AMX's for a
/// format without AMX tiles), sixteen rows a call. Call only if those products are available.
pub(super) fn wide<F: SimdFormat>() -> Kernel {
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn entry<F: SimdFormat>(
        a: &Activations,
        rows: &[u8],
        row_bytes: usize,
        y: &mut [[f32; WIDE_ROWS]; MAX_T],
    ) {
        // SAFETY: the caller's contract is the body's, on a CPU with AVX-512 VNNI.
        unsafe { rows16::<F>(a, rows, row_bytes, y) }
    }
    // SAFETY: `matmul` asks for these products only where `Products::available` says the CPU has them.
    Kernel::Wide(|a, rows, row_bytes, y| unsafe { entry::<F>(a, rows, row_bytes, y) })
}

/// Up to sixteen rows of `row_bytes` (`rows`, k / 32 blocks each) for every activation row, in tiles of up to 8
/// (`in_tiles`); y[t][j] for row j.
///
/// # Safety
/// The caller runs with AVX-512 VNNI's features.
#[inline(always)]
unsafe fn rows16<F: SimdFormat>(
    a: &Activations,
    rows: &[u8],
    row_bytes: usize,
    y: &mut [[f32; WIDE_ROWS]; MAX_T],
) {
    debug_assert_eq!(F::BLOCK, GROUP, "the legacy formats' blocks are groups");
    let count = rows.len() / row_bytes;
    debug_assert!((1..=WIDE_ROWS).contains(&count) && rows.len() == count * row_bytes);
    // Lanes past `count` recompute the last row; their outputs are never stored.
    let ptrs: [*const u8; WIDE_ROWS] =
        std::array::from_fn(|j| rows[j.min(count - 1) * row_bytes..].as_ptr());
    let ahead = Prefetch::after(rows, a.k / GROUP);
    // The tiles' contract: `ptrs` point at rows of k / 32 blocks.
    in_tiles!(a.t, y, |t0, out| tile::<F>(a, &ptrs, t0, out, ahead));
}

/// y[0..R] (lane j: weight row j) for activation rows t0..t0 + R; returns R. Signed codes (Q8_0) go in as w + 128,
/// and 128·Σx comes off each sum, as in `int_group_lanes_tile`.
///
/// # Safety
/// Each of `ptrs` must point at an encoded row of `a.k / 32` blocks of `F`; t0 + R <= a.t; the caller runs with
/// AVX-512 VNNI's features.
#[inline(always)]
unsafe fn tile<F: SimdFormat, const R: usize>(
    a: &Activations,
    ptrs: &[*const u8; WIDE_ROWS],
    t0: usize,
    y: &mut [[f32; WIDE_ROWS]],
    ahead: Prefetch,
) -> usize {
    let q8 = a.q8_for(F::SPAN);
    let gs = a.k / GROUP;
    let unsigned = F::AFFINE || F::OFFSET > 0;
    // Activation row t0 + r's codes (gs groups of 32), and its scales, sums and code sums (one per group), start
    // r · gs groups on.
    // SAFETY: `matmul` quantized t rows of k codes (gs of the others each) in spans of 32, and t0 + R <= t.
    let (codes, scales, sums, code_sums) = unsafe {
        (
            q8.codes.as_ptr().add(t0 * a.k),
            q8.scales.as_ptr().add(t0 * gs),
            q8.sums.as_ptr().add(t0 * gs),
            q8.code_sums.as_ptr().add(t0 * gs),
        )
    };
    let halves: [&[*const u8; GROUP_ROWS]; 2] = [
        ptrs[..GROUP_ROWS].try_into().expect("eight rows"),
        ptrs[GROUP_ROWS..].try_into().expect("eight rows"),
    ];
    let mut acc = [_mm512_setzero_ps(); R];
    let mut macc = [_mm512_setzero_ps(); R]; // offsets·Σx̂ (unsigned codes)
    for bi in 0..gs {
        // The first tile of a call reads the next call's rows into cache as it reads its own, block for block.
        if t0 == 0 {
            ahead.block(bi);
        }
        let off = bi * F::BYTES;
        // SAFETY (all three): block bi of every row is inside it (the caller's contract).
        let (d, m) = unsafe {
            let ((d0, m0), (d1, m1)) = (
                legacy_scales8(halves[0], off),
                legacy_scales8(halves[1], off),
            );
            (join_ps(d0, d1), join_ps(m0, m1))
        };
        let m = if F::OFFSET > 0 {
            _mm512_mul_ps(d, _mm512_set1_ps(-f32::from(F::OFFSET)))
        } else {
            m
        };
        // w[j]: row j's codes in the low half, row 8 + j's in the high half (a loop, not a closure: a closure
        // here is compiled without the entry's features, its intrinsics as calls).
        let mut w = [_mm512_setzero_si512(); GROUP_ROWS];
        for (j, w) in w.iter_mut().enumerate() {
            // SAFETY: as above.
            let codes = unsafe {
                join_si(
                    F::group_codes(ptrs[j].add(off)),
                    F::group_codes(ptrs[GROUP_ROWS + j].add(off)),
                )
            };
            *w = if unsigned {
                codes
            } else {
                _mm512_xor_si512(codes, _mm512_set1_epi8(i8::MIN))
            };
        }
        // SAFETY: the caller runs with AVX-512 F.
        let lanes = unsafe { lanes16(w) };
        let mut int_sums = [_mm512_setzero_si512(); R];
        for (i, &wl) in lanes.iter().enumerate() {
            for (r, sum) in int_sums.iter_mut().enumerate() {
                // SAFETY: group bi of activation row t0 + r holds 32 codes.
                let x = unsafe {
                    codes
                        .add((r * gs + bi) * GROUP + 4 * i)
                        .cast::<i32>()
                        .read_unaligned()
                };
                *sum = _mm512_dpbusd_epi32(*sum, wl, _mm512_set1_epi32(x));
            }
        }
        for (r, sum) in int_sums.into_iter().enumerate() {
            let at = r * gs + bi;
            // SAFETY: as for the codes.
            let (dx, sx, cx) = unsafe { (*scales.add(at), *sums.add(at), *code_sums.add(at)) };
            let sum = if unsigned {
                sum
            } else {
                _mm512_sub_epi32(sum, _mm512_set1_epi32(cx << 7))
            };
            acc[r] = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(sum),
                _mm512_mul_ps(d, _mm512_set1_ps(dx)),
                acc[r],
            );
            if unsigned {
                macc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx), macc[r]);
            }
        }
    }
    for r in 0..R {
        // SAFETY: y[r] holds WIDE_ROWS floats.
        unsafe { _mm512_storeu_ps(y[r].as_mut_ptr(), _mm512_add_ps(acc[r], macc[r])) };
    }
    R
}

/// `lanes8` in each 256-bit half: sixteen rows' 32 codes (w[j]: row j in the low half, row 8 + j in the high
/// half, 4-byte word i = codes 4i..4i + 4) transposed by 4-byte words, vector i of the result holding word i of
/// every row (lane j: row j).
#[target_feature(enable = "avx2,avx512f")]
#[inline]
fn lanes16(w: [__m512i; GROUP_ROWS]) -> [__m512i; GROUP_ROWS] {
    {
        // Within each 128-bit quarter, as `lanes8`: lo32[p] holds words 0, 1 (4, 5) of rows 2p, 2p + 1 (and of
        // 8 + 2p, 9 + 2p in the high half); hi32[p] words 2, 3 (6, 7).
        let lo32 = [0, 2, 4, 6].map(|j| _mm512_unpacklo_epi32(w[j], w[j + 1]));
        let hi32 = [0, 2, 4, 6].map(|j| _mm512_unpackhi_epi32(w[j], w[j + 1]));
        let quad = [0, 2].map(|p| {
            [
                _mm512_unpacklo_epi64(lo32[p], lo32[p + 1]),
                _mm512_unpackhi_epi64(lo32[p], lo32[p + 1]),
                _mm512_unpacklo_epi64(hi32[p], hi32[p + 1]),
                _mm512_unpackhi_epi64(hi32[p], hi32[p + 1]),
            ]
        });
        // In each 256-bit half, the low 128 bits of a and of b (words 0-3), or their high ones (words 4-7).
        let low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
        let high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
        std::array::from_fn(|i| {
            let (a, b) = (quad[0][i % 4], quad[1][i % 4]);
            _mm512_permutex2var_epi64(a, if i < 4 { low } else { high }, b)
        })
    }
}
