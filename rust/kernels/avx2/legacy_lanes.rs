//! The legacy formats' plain rows (blocks of 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) transposed into vector lanes, lane
//! j for weight row j: eight rows in AVX2 vectors with any `IntDot`'s products (the group kernel `int_group_rows`,
//! for tiles of two or more activation rows), or sixteen in AVX-512 vectors with VNNI's (`wide`, for every tile).
//!
//! Each block's code vectors are transposed by 4-byte words so that vector i holds codes 4i..4i + 4 of every row:
//! an activation row then meets the block in eight products whose activation operand is one 4-byte word broadcast,
//! and its row sums build up in their own lanes, with nothing reduced across lanes. The transposition (24 shuffles
//! a block and vector) is shared by the tile's activation rows. With eight rows it costs less than reducing eight
//! vectors per activation row from two rows on (SmolLM2's products in file layout, VNNI, 2 threads: 1.03x at T =
//! 2, 1.47x at T = 8, 1.87x at T = 16; forced on for one row as well, 0.92-0.99x at T = 1); with sixteen, where
//! each product and float step serves twice the rows, one activation row took 0.96-1.03 of the time of two
//! eight-row reductions (Q8_0, Q4_1, Q5_0, one thread, 2048 rows in cache; benches/RESULTS.md, thirty-sixth
//! session), so the wide kernel transposes for every tile. Signed codes (Q8_0) go in as w + 128, and 128·Σx
//! comes off each sum.
//!
//! Every lane does the plain rows' kernel's steps: the same exact integer block sum, then the same float steps
//! (`LegacyLanes`) in the same order, so the bits are the same at either width and whichever tile computes a row.

use std::arch::x86_64::*;

use super::super::blocks::GROUP;
use super::super::rows::{in_tiles, Activations, Kernel, GROUP_ROWS, MAX_T, WIDE_ROWS};
use super::interleaved::{join_ps, join_si, LegacyLanes, Zmm};
use super::{legacy_scales8, IntDot, Prefetch, SimdFormat};

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
    in_tiles!(a.t, y, |t0, out| tile::<F, Zmm>(a, &ptrs, t0, out, ahead));
}

/// y[0..R] (lane j: weight row j) for activation rows t0..t0 + R; returns R. The first tile of a call prefetches
/// the next call's rows (`ahead`), block for block.
///
/// # Safety
/// `ptrs` holds L::ROWS pointers, each at an encoded row of `a.k / 32` blocks of `F`; t0 + R <= a.t; L's running
/// sums hold a block's products (with AVX2's vectors, F::MAX_CODE <= `IntDot::LANES_MAX_CODE`; AVX-512's hold
/// any byte's); the caller runs with L's features.
#[inline(always)]
pub(super) unsafe fn tile<F: SimdFormat, L: GroupLanes, const R: usize>(
    a: &Activations,
    ptrs: &[*const u8],
    t0: usize,
    y: &mut [L::Out],
    ahead: Prefetch,
) -> usize {
    debug_assert_eq!(ptrs.len(), L::ROWS);
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
    let mut acc = [L::zero_float(); R];
    let mut macc = [L::zero_float(); R]; // offsets·Σx̂ (unsigned codes)
    for bi in 0..gs {
        if t0 == 0 {
            ahead.block(bi);
        }
        let off = bi * F::BYTES;
        // SAFETY (all in this block): block bi of every row is inside it (the caller's contract); the caller
        // runs with L's features.
        let (d, m) = unsafe { L::scales(ptrs, off) };
        let m = if F::OFFSET > 0 {
            unsafe { L::scale(d, -f32::from(F::OFFSET)) }
        } else {
            m
        };
        // A loop, not `from_fn`: a closure here is compiled without the entry's features, its intrinsics as calls.
        let mut w = [L::zero_int(); GROUP_ROWS];
        for (j, w) in w.iter_mut().enumerate() {
            *w = unsafe { L::codes::<F>(ptrs, off, j) };
        }
        let lanes = unsafe { L::transpose(w) };
        let mut int_sums = [L::zero_int(); R];
        for (i, &wl) in lanes.iter().enumerate() {
            for (r, sum) in int_sums.iter_mut().enumerate() {
                // SAFETY: group bi of activation row t0 + r holds 32 codes.
                let x = unsafe {
                    codes
                        .add((r * gs + bi) * GROUP + 4 * i)
                        .cast::<i32>()
                        .read_unaligned()
                };
                // SAFETY: the caller runs with L's features.
                *sum = unsafe { L::add_products(*sum, wl, x) };
            }
        }
        for (r, sum) in int_sums.into_iter().enumerate() {
            let at = r * gs + bi;
            // SAFETY: as for the codes; the caller runs with L's features.
            unsafe {
                let (dx, sx, cx) = (*scales.add(at), *sums.add(at), *code_sums.add(at));
                let sum = L::widen(sum);
                let sum = if unsigned { sum } else { L::sub(sum, cx << 7) };
                acc[r] = L::add_scaled(acc[r], sum, d, dx);
                if unsigned {
                    macc[r] = L::add_offset(macc[r], m, sx);
                }
            }
        }
    }
    for r in 0..R {
        // SAFETY: the caller runs with L's features.
        unsafe { L::store(acc[r], macc[r], &mut y[r]) };
    }
    R
}

/// A call's plain rows of a legacy format in the lanes of `LegacyLanes`: eight rows in AVX2 vectors with D's
/// products, or sixteen in AVX-512 vectors with VNNI's (`Zmm`: rows j and 8 + j in the two 256-bit halves).
pub(super) trait GroupLanes: LegacyLanes {
    /// Weight rows a call computes, one a lane.
    const ROWS: usize;
    /// (d, m) of each lane's row: the first four bytes of the block at byte `off` of each row (`legacy_scales8`).
    unsafe fn scales(ptrs: &[*const u8], off: usize) -> (Self::Float, Self::Float);
    /// The codes of the block at byte `off` of row j (in the high half: row 8 + j) as the products take them:
    /// F's `group_codes`, a signed type's plus 128.
    unsafe fn codes<F: SimdFormat>(ptrs: &[*const u8], off: usize, j: usize) -> Self::Int;
    /// Eight code vectors (w[j]: row j's, 4-byte word i = codes 4i..4i + 4) transposed by 4-byte words in each
    /// 256-bit half: vector i of the result holds word i of every row.
    unsafe fn transpose(w: [Self::Int; GROUP_ROWS]) -> [Self::Int; GROUP_ROWS];
    /// sum − c, lane by lane (i32 lanes).
    unsafe fn sub(sum: Self::Int, c: i32) -> Self::Int;
    /// d·v, lane by lane.
    unsafe fn scale(d: Self::Float, v: f32) -> Self::Float;
}

impl<D: IntDot> GroupLanes for D {
    const ROWS: usize = GROUP_ROWS;

    #[inline(always)]
    unsafe fn scales(ptrs: &[*const u8], off: usize) -> (__m256, __m256) {
        // SAFETY: the caller's contract.
        unsafe { legacy_scales8(ptrs.try_into().expect("eight rows"), off) }
    }

    #[inline(always)]
    unsafe fn codes<F: SimdFormat>(ptrs: &[*const u8], off: usize, j: usize) -> __m256i {
        // SAFETY: the caller's contract.
        let codes = unsafe { F::group_codes(ptrs[j].add(off)) };
        if F::AFFINE || F::OFFSET > 0 {
            codes
        } else {
            _mm256_xor_si256(codes, _mm256_set1_epi8(i8::MIN))
        }
    }

    #[inline(always)]
    unsafe fn transpose(w: [__m256i; GROUP_ROWS]) -> [__m256i; GROUP_ROWS] {
        // SAFETY: every kernel set here has AVX2.
        unsafe { lanes8(w) }
    }

    #[inline(always)]
    unsafe fn sub(sum: __m256i, c: i32) -> __m256i {
        _mm256_sub_epi32(sum, _mm256_set1_epi32(c))
    }

    #[inline(always)]
    unsafe fn scale(d: __m256, v: f32) -> __m256 {
        _mm256_mul_ps(d, _mm256_set1_ps(v))
    }
}

impl GroupLanes for Zmm {
    const ROWS: usize = WIDE_ROWS;

    #[inline(always)]
    unsafe fn scales(ptrs: &[*const u8], off: usize) -> (__m512, __m512) {
        // SAFETY: the caller's contract; it runs with AVX-512 F.
        unsafe {
            let (d0, m0) = legacy_scales8(ptrs[..GROUP_ROWS].try_into().expect("eight rows"), off);
            let (d1, m1) = legacy_scales8(ptrs[GROUP_ROWS..].try_into().expect("eight rows"), off);
            (join_ps(d0, d1), join_ps(m0, m1))
        }
    }

    #[inline(always)]
    unsafe fn codes<F: SimdFormat>(ptrs: &[*const u8], off: usize, j: usize) -> __m512i {
        // SAFETY: the caller's contract; it runs with AVX-512 F.
        unsafe {
            let codes = join_si(
                F::group_codes(ptrs[j].add(off)),
                F::group_codes(ptrs[GROUP_ROWS + j].add(off)),
            );
            if F::AFFINE || F::OFFSET > 0 {
                codes
            } else {
                _mm512_xor_si512(codes, _mm512_set1_epi8(i8::MIN))
            }
        }
    }

    #[inline(always)]
    unsafe fn transpose(w: [__m512i; GROUP_ROWS]) -> [__m512i; GROUP_ROWS] {
        // SAFETY: the caller runs with AVX-512 F.
        unsafe { lanes16(w) }
    }

    #[inline(always)]
    unsafe fn sub(sum: __m512i, c: i32) -> __m512i {
        // SAFETY: the caller runs with AVX-512 F.
        unsafe { _mm512_sub_epi32(sum, _mm512_set1_epi32(c)) }
    }

    #[inline(always)]
    unsafe fn scale(d: __m512, v: f32) -> __m512 {
        // SAFETY: the caller runs with AVX-512 F.
        unsafe { _mm512_mul_ps(d, _mm512_set1_ps(v)) }
    }
}

/// Eight rows' 32 codes (w[j]: row j, 4-byte word i = codes 4i..4i + 4) transposed by 4-byte words: vector i of
/// the result holds word i of every row (lane j: row j). Loops, not closures, and no target features of its own, so
/// that it inlines into its callers' entry points (with AVX2's features as a `#[target_feature]` function, LLVM
/// left it out of line once the tile became generic: its vectors went through memory, and the AVX2 tiles took
/// 1.15-1.21x as long).
///
/// # Safety
/// The caller runs with AVX2.
#[inline(always)]
unsafe fn lanes8(w: [__m256i; GROUP_ROWS]) -> [__m256i; GROUP_ROWS] {
    // Within each 128-bit half: pairs of rows by words, then quads of rows by pairs of words. lo32[p]: words 0, 1
    // (and 4, 5) of rows 2p, 2p + 1; hi32[p]: words 2, 3 (6, 7). quad[q][h]: word h (and h + 4 in the high half)
    // of rows 4q..4q + 4.
    let (mut lo32, mut hi32) = ([w[0]; 4], [w[0]; 4]);
    for p in 0..4 {
        lo32[p] = _mm256_unpacklo_epi32(w[2 * p], w[2 * p + 1]);
        hi32[p] = _mm256_unpackhi_epi32(w[2 * p], w[2 * p + 1]);
    }
    let mut quad = [[w[0]; 4]; 2];
    for (q, quad) in quad.iter_mut().enumerate() {
        let (lo, hi) = (
            (lo32[2 * q], lo32[2 * q + 1]),
            (hi32[2 * q], hi32[2 * q + 1]),
        );
        *quad = [
            _mm256_unpacklo_epi64(lo.0, lo.1),
            _mm256_unpackhi_epi64(lo.0, lo.1),
            _mm256_unpacklo_epi64(hi.0, hi.1),
            _mm256_unpackhi_epi64(hi.0, hi.1),
        ];
    }
    let mut out = w;
    for h in 0..4 {
        out[h] = _mm256_permute2x128_si256(quad[0][h], quad[1][h], 0x20);
        out[4 + h] = _mm256_permute2x128_si256(quad[0][h], quad[1][h], 0x31);
    }
    out
}

/// `lanes8` in each 256-bit half: sixteen rows' codes (w[j]: row j in the low half, row 8 + j in the high) by
/// 4-byte words, the last step one `vpermt2q` where `lanes8` has a `vperm2i128`.
///
/// # Safety
/// The caller runs with AVX-512 F.
#[inline(always)]
unsafe fn lanes16(w: [__m512i; GROUP_ROWS]) -> [__m512i; GROUP_ROWS] {
    let (mut lo32, mut hi32) = ([w[0]; 4], [w[0]; 4]);
    for p in 0..4 {
        lo32[p] = _mm512_unpacklo_epi32(w[2 * p], w[2 * p + 1]);
        hi32[p] = _mm512_unpackhi_epi32(w[2 * p], w[2 * p + 1]);
    }
    let mut quad = [[w[0]; 4]; 2];
    for (q, quad) in quad.iter_mut().enumerate() {
        let (lo, hi) = (
            (lo32[2 * q], lo32[2 * q + 1]),
            (hi32[2 * q], hi32[2 * q + 1]),
        );
        *quad = [
            _mm512_unpacklo_epi64(lo.0, lo.1),
            _mm512_unpackhi_epi64(lo.0, lo.1),
            _mm512_unpacklo_epi64(hi.0, hi.1),
            _mm512_unpackhi_epi64(hi.0, hi.1),
        ];
    }
    // In each 256-bit half, the low 128 bits of a and of b (words 0-3), or their high ones (words 4-7).
    let low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    let high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    let mut out = w;
    for h in 0..4 {
        out[h] = _mm512_permutex2var_epi64(quad[0][h], low, quad[1][h]);
        out[4 + h] = _mm512_permutex2var_epi64(quad[0][h], high, quad[1][h]);
    }
    out
}
