//! Plain rows of Q6_K and Q8_0 with AMX tiles, eight weight rows a call, for passes of several activation rows
//! (a speculative verify pass, prefill).
//!
//! Both formats scale runs of codes: Q6_K has an int8 scale per sub-block of 16 codes, Q8_0 a float scale per
//! block of 32. Each run's sums must land in a place of their own before their scale, so one `tdpbssd` takes
//! PRODUCT codes of each weight row twice: the weight tile [16, PRODUCT] holds row j's even runs of PRODUCT / 2
//! codes in row j and its odd runs in row 8 + j (zeros elsewhere, `Step::codes`), and the activation tile
//! [PRODUCT / 4, 16 · 4] holds the tokens' codes by word (`Q8Rows::columns`), up to 8 tokens in F = 2 runs of
//! columns, each zero outside its 16 codes, more tokens in one run (F = 1). So C [16, 16] i32 has each (weight row,
//! run, token) sum in its own element:
//! - Q6_K: PRODUCT = 32F (a sub-block per run of the activation tile and half of the weight tile), 4 / F products
//!   a span of 128. Each weight row's sums are multiplied by their sub-scales and added over the span: I = Σ sc ·
//!   Σ q·x̂, the exact integer the row kernel (`int_row`, which reduces every span first,
//!   `SuperBlock::SPAN_TOTALS`) finds with VNNI's products; then tot += float(I) · (d · dx), its float steps.
//! - Q8_0: PRODUCT = 64 (a block per half of the weight tile), one product per two blocks; each block's sum (its F
//!   runs added) then takes the group kernel's float steps, acc += float(Σ q·x̂) · (d · dx), block by block.
//!
//! So both give their vector kernels' bits, lane by lane, and a token's logits do not depend on how many tokens
//! share its pass. Tile registers are not renamed, and C reaches the vector registers through memory, so the work
//! runs as a pipeline over two scratch steps (as `interleaved::k_tile_amx`): at step s, step s's products are
//! issued, step s - 1's sums scaled, and step s + 1's codes decoded.

use std::arch::x86_64::*;

use super::super::blocks::{self, Format, K_SPAN};
use super::super::q8::{column_fold, Q8Rows, COLUMN_TOKENS};
use super::super::rows::{Activations, GroupKernel, GROUP_ROWS, MAX_T};
use super::{amx, prefetch, Products, SimdFormat, Vnni};

type Q6K = blocks::Q6K;
type Q8_0 = blocks::Q8_0;
/// Codes per Q6_K sub-block (one int8 scale each), and per run of an activation tile's columns.
const SUB: usize = 16;
/// Q6_K sub-blocks per activation span.
const SUBS: usize = K_SPAN / SUB;
/// Most codes a step takes (a Q6_K span).
const MAX_STEP: usize = K_SPAN;

/// Activation rows from which a pass over Q6_K rows takes the tiles, where `Q8Rows::columns` are given
/// (`matmul` adds them from this many rows); fewer run the row kernel. Measured on Qwen2.5-Coder-1.5B (2 threads,
/// Sapphire Rapids class VM, ms, two runs; benches/RESULTS.md, twenty-fifth session), tiles against the row
/// kernel at T = 4 / 5 / 6: the layers' Q6_K matrices 17.7-17.9 / 18.1-18.4 / 17.8-18.5 against 16.1-16.4 /
/// 19.1-20.3 / 20.5-21.9; the output head 16.5-16.8 / 16.2-16.6 / 16.6-16.8 against 14.6-14.8 / 16.7-17.5 /
/// 19.7-20.6.
pub const Q6K_TILE_MIN_ROWS: usize = 5;
/// As Q6K_TILE_MIN_ROWS, for Q8_0 rows (fewer run the group kernel). Measured on SmolLM2-135M's Q8_0 output head
/// (28 MB, 2 threads, the quiet runs of a probe, ms): tiles 1.8-2.2 / 2.0-2.3 / 2.2-2.4 at T = 9 / 12 / 16, the
/// group kernel 2.3-3.6 / 2.6-2.8 / 3.4-4.4. Below 9 rows both ran at the memory's pace, too close to order.
pub const Q8_0_TILE_MIN_ROWS: usize = 9;

/// A block format the tiles take: its steps, its decoding and its float steps.
pub trait Tiled: Format + SimdFormat {
    /// Codes a pipeline step takes (Q6_K: a span; Q8_0: two blocks), a multiple of 64.
    const STEP: usize;
    /// Activation rows from which a pass takes the tiles.
    const MIN_ROWS: usize;
    /// Codes of one product for fold F (`Q8Rows::columns`): its weight tile's two halves, the even and the odd
    /// runs of PRODUCT / 2.
    fn product(fold: usize) -> usize;
    /// Step s of the row at `row`: its STEP codes as signed bytes, 64 a vector; its scales into row j of `step`.
    ///
    /// # Safety
    /// The step is inside the row; the caller runs with AVX-512 F and BW.
    unsafe fn decode(
        row: *const u8,
        s: usize,
        j: usize,
        step: &mut Step,
    ) -> [__m512i; MAX_STEP / 64];
    /// The step's float steps into tot (row j's, lane t: token t), from its products' sums; `dx`: the step's
    /// activation scales, one vector per span of the step (lane t: token t); `runs`: `runs::<F>`.
    ///
    /// # Safety
    /// The caller runs with AVX-512 F.
    unsafe fn scale<const F: usize>(
        step: &Step,
        runs: &[__m512i; SUBS],
        dx: &[__m512; 2],
        tot: &mut [__m512; GROUP_ROWS],
    );
    /// A row's result from its accumulator (the vector kernel's last step).
    ///
    /// # Safety
    /// The caller runs with AVX-512 F.
    unsafe fn finish(tot: __m512) -> __m512 {
        tot
    }
    /// `count` rows with the vector kernel (passes of fewer than MIN_ROWS).
    ///
    /// # Safety
    /// As `rows`.
    unsafe fn vector(
        a: &Activations,
        rows: &[u8],
        row_bytes: usize,
        y: &mut [[f32; GROUP_ROWS]; MAX_T],
    );
}

/// The integer group kernel of F's rows (Q6_K, Q8_0) with AMX's products: eight rows at a time in tiles from
/// `Tiled::MIN_ROWS` activation rows (where the row holds whole steps), the vector kernel (VNNI's products:
/// Q6_K's row kernel `int_row`, Q8_0's group kernel `int_group`) otherwise. Call only if
/// `Products::Amx.available()`.
pub fn tiled<F: Tiled>() -> GroupKernel {
    debug_assert!(Products::Amx.available());
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn entry<F: Tiled>(
        a: &Activations,
        rows: &[u8],
        row_bytes: usize,
        y: &mut [[f32; GROUP_ROWS]; MAX_T],
    ) {
        // SAFETY: the caller's contract is the body's, on a CPU with AMX and AVX-512 VNNI.
        unsafe { tiled_rows::<F>(a, rows, row_bytes, y) }
    }
    // SAFETY: `matmul` asks for AMX's products only where `Products::Amx.available()`.
    |a, rows, row_bytes, y| unsafe { entry::<F>(a, rows, row_bytes, y) }
}

/// `count` (1 to 8) rows of F (`rows`: count · row_bytes bytes); y[t][j] for row j.
///
/// # Safety
/// The caller runs with AVX-512 VNNI's features on a CPU with AMX; `matmul` checked the sizes.
#[inline(always)]
unsafe fn tiled_rows<F: Tiled>(
    a: &Activations,
    rows: &[u8],
    row_bytes: usize,
    y: &mut [[f32; GROUP_ROWS]; MAX_T],
) {
    let q8 = a.q8_for(F::SPAN);
    if a.t < F::MIN_ROWS || q8.columns.is_empty() || a.k % F::STEP != 0 {
        // SAFETY: the caller's contract.
        return unsafe { F::vector(a, rows, row_bytes, y) };
    }
    let count = rows.len() / row_bytes;
    debug_assert!((1..=GROUP_ROWS).contains(&count) && row_bytes == a.k / F::BLOCK * F::BYTES);
    // The eight rows are eight streams, which the hardware prefetchers follow poorly: each step prefetches its
    // share of the bytes after `rows`, where the next group's rows usually are (a prefetch never faults).
    let ahead = (
        rows.as_ptr_range().end,
        (GROUP_ROWS * row_bytes).div_ceil(a.k / F::STEP),
    );
    // Rows past `count` recompute the last row; their outputs are never stored.
    let ptrs: [*const u8; GROUP_ROWS] =
        std::array::from_fn(|j| rows[j.min(count - 1) * row_bytes..].as_ptr());
    let mut t0 = 0;
    while t0 < a.t {
        let n = (a.t - t0).min(COLUMN_TOKENS);
        // SAFETY: the caller's contract, with t0 + n <= t; `matmul` made the columns in tiles of COLUMN_TOKENS.
        unsafe {
            if column_fold(n) == 2 {
                tile::<F, 2>(q8, a.k, &ptrs, ahead, t0, n, &mut y[t0..]);
            } else {
                tile::<F, 1>(q8, a.k, &ptrs, ahead, t0, n, &mut y[t0..]);
            }
        }
        t0 += n;
    }
}

/// One step of eight weight rows, as the pipeline holds it between its stages.
#[repr(C, align(64))]
pub struct Step {
    /// The weight tiles of the step's products: row j (< 8) holds weight row j's codes in the even runs of
    /// PRODUCT / 2, zeros in the odd ones; row 8 + j the odd runs. Product p takes columns PRODUCT · p...
    codes: [[i8; MAX_STEP]; 2 * GROUP_ROWS],
    /// Product p's sums: sums[p][i][c] for row i of its weight tile and column c of the activation tile.
    sums: [[[i32; COLUMN_TOKENS]; 2 * GROUP_ROWS]; 4],
    /// Q6_K: row j's sub-scales of the span.
    scales: [[i32; SUBS]; GROUP_ROWS],
    /// Row j's block scales d (Q6_K: its block's; Q8_0: its two blocks').
    d: [[f32; 2]; GROUP_ROWS],
}

impl Step {
    fn new() -> Step {
        Step {
            codes: [[0; MAX_STEP]; 2 * GROUP_ROWS],
            sums: [[[0; COLUMN_TOKENS]; 2 * GROUP_ROWS]; 4],
            scales: [[0; SUBS]; GROUP_ROWS],
            d: [[0.0; 2]; GROUP_ROWS],
        }
    }
}

thread_local! {
    /// Each kernel thread's two pipeline steps (`tile`), kept from call to call: every field a step's stages read
    /// is written first, so they need no clearing (11 KB a call; Qwen2.5-Coder-1.5B's output head's calls have
    /// 12 steps each). Clearing them at every call took that head's pass at 8 tokens from 24.8 to 26.8 ms, once.
    static PIPELINE: std::cell::Cell<Option<Box<[Step; 2]>>> = const { std::cell::Cell::new(None) };
}

/// The float16 at `p` as float32.
///
/// # Safety
/// Two readable bytes; the caller runs with F16C.
#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller's contract.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

impl Tiled for Q6K {
    const STEP: usize = K_SPAN;
    const MIN_ROWS: usize = Q6K_TILE_MIN_ROWS;

    fn product(fold: usize) -> usize {
        2 * SUB * fold
    }

    /// Span s % 2 of block s / 2.
    #[inline(always)]
    unsafe fn decode(
        row: *const u8,
        s: usize,
        j: usize,
        step: &mut Step,
    ) -> [__m512i; MAX_STEP / 64] {
        let sp = s % 2;
        // SAFETY (all): the caller's contract: the block's 210 bytes are readable.
        unsafe {
            let b = row.add(s / 2 * Q6K::BYTES);
            // The span's low 4 bits: ql[64sp..], groups 0 and 1 in its low nibbles, 2 and 3 in its high ones; its
            // high 2 bits: qh[32sp..] (`blocks::Q6K`), bits 2t of group t, as two 64-byte halves of the span.
            let ql = _mm512_loadu_si512(b.add(64 * sp).cast());
            let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(b.add(128 + 32 * sp).cast()));
            let (nibble, two_bits) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(3));
            let low = [
                _mm512_and_si512(ql, nibble),
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), nibble),
            ];
            let sc = _mm_loadl_epi64(b.add(192 + SUBS * sp).cast());
            _mm256_store_si256(step.scales[j].as_mut_ptr().cast(), _mm256_cvtepi8_epi32(sc));
            step.d[j][0] = f16_at(b.add(208));
            // (A loop, not a closure: a closure takes no target features, and its intrinsics would become calls.)
            let mut codes = [_mm512_setzero_si512(); MAX_STEP / 64];
            for (half, codes) in codes.iter_mut().enumerate() {
                // Groups 2·half and 2·half + 1: qh shifted by 4·half, then 2 more in the upper 32 bytes.
                let shift = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
                let shift = _mm512_add_epi64(shift, _mm512_set1_epi64(4 * half as i64));
                let high = _mm512_and_si512(_mm512_srlv_epi64(qh, shift), two_bits);
                let q = _mm512_or_si512(low[half], _mm512_slli_epi16::<4>(high));
                *codes = _mm512_sub_epi8(q, _mm512_set1_epi8(Q6K::OFFSET as i8));
            }
            codes
        }
    }

    /// For each row j, I = Σ sc·sums (exact; the F runs of a column's lanes added), then tot[j] += float(I) · (d ·
    /// dx).
    #[inline(always)]
    unsafe fn scale<const F: usize>(
        step: &Step,
        runs: &[__m512i; SUBS],
        dx: &[__m512; 2],
        tot: &mut [__m512; GROUP_ROWS],
    ) {
        let dx = dx[0];
        for (j, tot) in tot.iter_mut().enumerate() {
            let mut i = _mm512_setzero_si512();
            // SAFETY: 8 i32, 32-byte aligned.
            let scales = _mm512_castsi256_si512(unsafe {
                _mm256_load_si256(step.scales[j].as_ptr().cast())
            });
            // Sub-blocks F·q.. (q < SUBS / F): product q / 2, the weight tile's row j or 8 + j.
            for (q, runs) in runs[..SUBS / F].iter().enumerate() {
                // Each lane's sub-scale: one for all lanes if F = 1.
                let m = if F == 1 {
                    _mm512_set1_epi32(step.scales[j][q])
                } else {
                    _mm512_permutexvar_epi32(*runs, scales)
                };
                // SAFETY: 16 i32, 64-byte aligned.
                let s = unsafe {
                    _mm512_load_si512(step.sums[q / 2][j + GROUP_ROWS * (q % 2)].as_ptr().cast())
                };
                i = _mm512_add_epi32(i, _mm512_mullo_epi32(s, m));
            }
            let scale = _mm512_mul_ps(_mm512_set1_ps(step.d[j][0]), dx);
            // SAFETY: the caller's contract.
            let i = unsafe { fold::<F>(i) };
            *tot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), scale, *tot);
        }
    }

    #[inline(always)]
    unsafe fn vector(
        a: &Activations,
        rows: &[u8],
        row_bytes: usize,
        y: &mut [[f32; GROUP_ROWS]; MAX_T],
    ) {
        // SAFETY: the caller runs with VNNI's features; `matmul` checked the sizes.
        unsafe { super::q6k_lanes::lane_rows::<Vnni>(a, rows, row_bytes, y) }
    }
}

impl Tiled for Q8_0 {
    const STEP: usize = 2 * Q8_0::BLOCK;
    const MIN_ROWS: usize = Q8_0_TILE_MIN_ROWS;

    fn product(_fold: usize) -> usize {
        Self::STEP
    }

    /// Blocks 2s and 2s + 1.
    #[inline(always)]
    unsafe fn decode(
        row: *const u8,
        s: usize,
        j: usize,
        step: &mut Step,
    ) -> [__m512i; MAX_STEP / 64] {
        // SAFETY (all): the caller's contract: the blocks' 68 bytes are readable.
        unsafe {
            let b = row.add(2 * s * Q8_0::BYTES);
            step.d[j] = [f16_at(b), f16_at(b.add(Q8_0::BYTES))];
            let codes = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(b.add(2).cast())),
                _mm256_loadu_si256(b.add(Q8_0::BYTES + 2).cast()),
            );
            [codes, _mm512_setzero_si512()]
        }
    }

    /// For each row j and block b of the two: tot[j] += float(Σ q·x̂) · (d · dx), block by block.
    #[inline(always)]
    unsafe fn scale<const F: usize>(
        step: &Step,
        _runs: &[__m512i; SUBS],
        dx: &[__m512; 2],
        tot: &mut [__m512; GROUP_ROWS],
    ) {
        for (j, tot) in tot.iter_mut().enumerate() {
            for (block, &dx) in dx.iter().enumerate() {
                // SAFETY: 16 i32, 64-byte aligned.
                let s = unsafe {
                    _mm512_load_si512(step.sums[0][j + GROUP_ROWS * block].as_ptr().cast())
                };
                let scale = _mm512_mul_ps(_mm512_set1_ps(step.d[j][block]), dx);
                // SAFETY: the caller's contract.
                let s = unsafe { fold::<F>(s) };
                *tot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, *tot);
            }
        }
    }

    /// The group kernel ends with acc + macc, macc being 0 for a symmetric type.
    #[inline(always)]
    unsafe fn finish(tot: __m512) -> __m512 {
        _mm512_add_ps(tot, _mm512_setzero_ps())
    }

    #[inline(always)]
    unsafe fn vector(
        a: &Activations,
        rows: &[u8],
        row_bytes: usize,
        y: &mut [[f32; GROUP_ROWS]; MAX_T],
    ) {
        // SAFETY: the caller runs with VNNI's features.
        unsafe { super::int_group_rows::<Q8_0, Vnni>(a, rows, row_bytes, y) }
    }
}

/// Lanes 0-7 (tokens) + lanes 8-15 (the second run's) for F = 2; F = 1: as it is.
///
/// # Safety
/// The caller runs with AVX-512 F.
#[inline(always)]
unsafe fn fold<const F: usize>(i: __m512i) -> __m512i {
    if F == 2 {
        _mm512_add_epi32(i, _mm512_shuffle_i64x2::<0b01_00_11_10>(i, i))
    } else {
        i
    }
}

/// Step s of the eight rows at `ptrs` into `step`: codes in runs of PRODUCT / 2, scales.
///
/// # Safety
/// Step s is inside every row; the caller runs with AVX-512 F and BW.
#[inline(always)]
unsafe fn decode<F: Tiled, const FOLD: usize>(
    ptrs: &[*const u8; GROUP_ROWS],
    s: usize,
    step: &mut Step,
) {
    // The even runs of PRODUCT / 2 bytes of 64 (16 or 32).
    let even: __mmask64 = if F::product(FOLD) == 32 {
        0x0000_FFFF_0000_FFFF
    } else {
        0x0000_0000_FFFF_FFFF
    };
    for (j, &row) in ptrs.iter().enumerate() {
        // SAFETY: the caller's contract.
        let codes = unsafe { F::decode(row, s, j, step) };
        for (at, codes) in (0..F::STEP).step_by(64).zip(codes) {
            // SAFETY: rows of MAX_STEP >= STEP bytes, 64-byte aligned.
            unsafe {
                _mm512_store_si512(
                    step.codes[j][at..].as_mut_ptr().cast(),
                    _mm512_maskz_mov_epi8(even, codes),
                );
                let odd = _mm512_maskz_mov_epi8(!even, codes);
                _mm512_store_si512(step.codes[GROUP_ROWS + j][at..].as_mut_ptr().cast(), odd);
            }
        }
    }
}

/// The step's COUNT products (COUNT = STEP / PRODUCT, `Tiled::product`) of PRODUCT codes each: into C tiles 2..,
/// then stored to `step.sums`. `x`: the tile's activation words from the step's first element (`Q8Rows::columns`).
///
/// # Safety
/// A configuration of `tile`'s shapes is loaded; `x` has the step's STEP / 4 words of 16 columns.
#[inline(always)]
unsafe fn products<const PRODUCT: usize, const COUNT: usize>(step: &mut Step, x: *const i32) {
    let codes = step.codes.as_ptr().cast::<u8>();
    // Product p's weight codes (columns PRODUCT · p.. of the weight tiles) and activation words.
    let weights = |p: usize| codes.wrapping_add(PRODUCT * p);
    let activations = |p: usize| x.wrapping_add(PRODUCT / 4 * p * COLUMN_TOKENS).cast::<u8>();
    const ROW: usize = 4 * COLUMN_TOKENS;
    // SAFETY (all): the caller's contract; the operands lie in `step` and the activation columns.
    unsafe {
        amx::load::<0>(weights(0), MAX_STEP);
        amx::load::<1>(activations(0), ROW);
        amx::zero::<2>();
        amx::dot_signed::<2, 0, 1>();
        if COUNT >= 2 {
            amx::load::<6>(weights(1), MAX_STEP);
            amx::load::<7>(activations(1), ROW);
            amx::zero::<3>();
            amx::dot_signed::<3, 6, 7>();
        }
        if COUNT == 4 {
            amx::load::<0>(weights(2), MAX_STEP);
            amx::load::<1>(activations(2), ROW);
            amx::zero::<4>();
            amx::dot_signed::<4, 0, 1>();
            amx::load::<6>(weights(3), MAX_STEP);
            amx::load::<7>(activations(3), ROW);
            amx::zero::<5>();
            amx::dot_signed::<5, 6, 7>();
        }
        amx::store::<2>(step.sums[0].as_mut_ptr().cast(), ROW);
        if COUNT >= 2 {
            amx::store::<3>(step.sums[1].as_mut_ptr().cast(), ROW);
        }
        if COUNT == 4 {
            amx::store::<4>(step.sums[2].as_mut_ptr().cast(), ROW);
            amx::store::<5>(step.sums[3].as_mut_ptr().cast(), ROW);
        }
    }
}

/// Lane c of Q6_K's sums for sub-blocks F·q..: sub-block q·F + c / (16 / F) of the span (`Q8Rows::columns`),
/// for each q.
///
/// # Safety
/// The caller runs with AVX-512 F.
#[inline(always)]
unsafe fn runs<const F: usize>() -> [__m512i; SUBS] {
    let mut runs = [_mm512_setzero_si512(); SUBS];
    for (q, runs) in runs.iter_mut().enumerate() {
        let mut lanes = [0i32; COLUMN_TOKENS];
        for (c, lane) in lanes.iter_mut().enumerate() {
            *lane = (q * F + c / (COLUMN_TOKENS / F)) as i32;
        }
        // SAFETY: 16 i32; the caller's contract.
        *runs = unsafe { _mm512_loadu_si512(lanes.as_ptr().cast()) };
    }
    runs
}

/// y[0..n] (lane j: weight row j) for activation rows t0..t0 + n (n <= 16 / FOLD, FOLD = `column_fold(n)`) of
/// the eight rows of F at `ptrs` (each k / BLOCK blocks); at each step, `ahead` = (from, bytes) prefetches its
/// share of the bytes from `from`.
///
/// # Safety
/// t0 + n <= the rows `q8` holds, and its columns are made; k is a multiple of F::STEP; the caller runs with
/// AVX-512 VNNI's features on a CPU with AMX.
#[inline(always)]
unsafe fn tile<F: Tiled, const FOLD: usize>(
    q8: &Q8Rows,
    k: usize,
    ptrs: &[*const u8; GROUP_ROWS],
    ahead: (*const u8, usize),
    t0: usize,
    n: usize,
    y: &mut [[f32; GROUP_ROWS]],
) {
    let (words, spans, steps) = (k / 4, k / F::SPAN, k / F::STEP);
    let spans_per_step = F::STEP / F::SPAN;
    let x = q8.columns[t0 * words..][..COLUMN_TOKENS * words].as_ptr();
    let scales = &q8.column_scales[t0 * spans..][..n * spans];
    let product = F::product(FOLD);
    // Tiles 0 and 6: a product's weight codes [16, PRODUCT]; 1 and 7: its activation words [PRODUCT / 4, 64
    // bytes]; 2-5: four products' sums [16, 64 bytes]. Two pairs of operand tiles, so that loading one pair does
    // not wait on the product of the other.
    let (weights, activations, sums) = (
        (2 * GROUP_ROWS, product),
        (product / 4, 64),
        (2 * GROUP_ROWS, 64),
    );
    let config = amx::Config::new([
        weights,
        activations,
        sums,
        sums,
        sums,
        sums,
        weights,
        activations,
    ]);
    let mut scratch = PIPELINE
        .take()
        .unwrap_or_else(|| Box::new([Step::new(), Step::new()]));
    let pipeline = &mut *scratch;
    let mut tot = [_mm512_setzero_ps(); GROUP_ROWS];
    // SAFETY: the caller runs with AVX-512 F.
    let runs = unsafe { runs::<FOLD>() };
    let lanes: __mmask16 = ((1u32 << n) - 1) as __mmask16;
    // SAFETY (all below): the caller's contract; every step s < steps is inside every row.
    unsafe {
        config.load();
        decode::<F, FOLD>(ptrs, 0, &mut pipeline[0]);
        for s in 0..=steps {
            if s < steps {
                prefetch(ahead.0.wrapping_add(s * ahead.1), ahead.1);
                let step = &mut pipeline[s % 2];
                let x = x.add(s * F::STEP / 4 * COLUMN_TOKENS);
                match F::STEP / product {
                    4 => products::<32, 4>(step, x),
                    2 => products::<64, 2>(step, x),
                    _ => products::<64, 1>(step, x),
                }
            }
            if s > 0 {
                let mut dx = [_mm512_setzero_ps(); 2];
                for (i, dx) in dx[..spans_per_step].iter_mut().enumerate() {
                    let at = ((s - 1) * spans_per_step + i) * n;
                    *dx = _mm512_maskz_loadu_ps(lanes, scales[at..][..n].as_ptr());
                }
                F::scale::<FOLD>(&pipeline[(s - 1) % 2], &runs, &dx, &mut tot);
            }
            if s + 1 < steps {
                decode::<F, FOLD>(ptrs, s + 1, &mut pipeline[(s + 1) % 2]);
            }
        }
        amx::release();
    }
    PIPELINE.set(Some(scratch));
    let mut lanes_of_rows = [[0f32; COLUMN_TOKENS]; GROUP_ROWS];
    for (out, tot) in lanes_of_rows.iter_mut().zip(tot) {
        // SAFETY: 16 floats; the caller runs with AVX-512 F.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), F::finish(tot)) };
    }
    for (t, y) in y[..n].iter_mut().enumerate() {
        for (j, y) in y.iter_mut().enumerate() {
            *y = lanes_of_rows[j][t];
        }
    }
}
