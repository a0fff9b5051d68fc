//! Q6_K rows with AMX tiles, for passes of several activation rows (a speculative verify pass, prefill).
//!
//! Q6_K's weights are d · sc · q with an int8 scale sc per sub-block of 16 elements, so each sub-block's sums
//! must land in a place of their own before sc multiplies them. One `tdpbssd` takes 2F sub-blocks (F = 2 for up
//! to 8 tokens, else 1; `Q8Rows::columns`): the weight tile [16, 32F] holds each of the eight weight rows twice,
//! its first 16F codes in row j and its last 16F in row 8 + j (zeros elsewhere, `Span::codes`), and the
//! activation tile [8F, 16 · 4] holds the tokens' codes in F runs of columns, each run zero outside its 16
//! codes. So C [16, 16] i32 has each (weight row, sub-block, token) sum in its own element. Each weight row's
//! sums are multiplied by their sc and added over the span's eight sub-blocks (and F runs): I = Σ sc · Σ q·x̂,
//! the exact integer the row kernel (`int_row`, which reduces every span first, `SuperBlock::SPAN_TOTALS`) finds
//! with VNNI's products. The float steps that follow are the row kernel's, lane by lane (tot += float(I) · (d ·
//! dx)), so both give the same bits, and a token's logits do not depend on how many tokens share its pass.
//!
//! A span of eight rows takes 4 / F products. Tile registers are not renamed, and C reaches the vector registers
//! through memory, so the work runs as a pipeline over two scratch spans (as `interleaved::k_tile_amx`): at step
//! s, span s's products are issued, span s - 1's sums scaled, and span s + 1's codes decoded.

use std::arch::x86_64::*;

use super::super::blocks::{self, Format, K_SPAN};
use super::super::q8::{column_fold, Q8Rows, COLUMN_TOKENS};
use super::super::rows::{Activations, GroupKernel, GROUP_ROWS, MAX_T};
use super::{amx, prefetch, Products, SimdFormat, Vnni};

type Q6K = blocks::Q6K;
/// Elements per sub-block (one int8 scale each).
const SUB: usize = 16;
/// Sub-blocks per activation span.
const SUBS: usize = K_SPAN / SUB;

/// Activation rows from which a pass over Q6_K rows takes the tiles, where `Q8Rows::columns` are given
/// (`matmul` adds them from this many rows); fewer run the row kernel. Measured on Qwen2.5-Coder-1.5B (2 threads,
/// Sapphire Rapids class VM, ms, two runs; benches/RESULTS.md, twenty-fifth session), tiles against the row
/// kernel at T = 4 / 5 / 6: the layers' Q6_K matrices 17.7-17.9 / 18.1-18.4 / 17.8-18.5 against 16.1-16.4 /
/// 19.1-20.3 / 20.5-21.9; the output head 16.5-16.8 / 16.2-16.6 / 16.6-16.8 against 14.6-14.8 / 16.7-17.5 /
/// 19.7-20.6.
pub const TILE_MIN_ROWS: usize = 5;

/// The integer kernel of Q6_K rows with AMX's products: eight rows at a time in tiles from TILE_MIN_ROWS
/// activation rows, the row kernel (`int_row`, VNNI's products) below. Call only if `Products::Amx.available()`.
pub fn q6_k_tiles() -> GroupKernel {
    debug_assert!(Products::Amx.available());
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn entry(
        a: &Activations,
        rows: &[u8],
        row_bytes: usize,
        y: &mut [[f32; GROUP_ROWS]; MAX_T],
    ) {
        // SAFETY: the caller's contract is the body's, on a CPU with AMX and AVX-512 VNNI.
        unsafe { q6_k_rows(a, rows, row_bytes, y) }
    }
    // SAFETY: `matmul` asks for AMX's products only where `Products::Amx.available()`.
    |a, rows, row_bytes, y| unsafe { entry(a, rows, row_bytes, y) }
}

/// `count` (1 to 8) Q6_K rows (`rows`: count · row_bytes bytes); y[t][j] for row j.
///
/// # Safety
/// The caller runs with AVX-512 VNNI's features on a CPU with AMX; `matmul` checked the sizes.
#[inline(always)]
unsafe fn q6_k_rows(
    a: &Activations,
    rows: &[u8],
    row_bytes: usize,
    y: &mut [[f32; GROUP_ROWS]; MAX_T],
) {
    let q8 = a.q8_for(K_SPAN);
    if a.t < TILE_MIN_ROWS || q8.columns.is_empty() {
        let mut column = [0f32; MAX_T];
        for (j, row) in rows.chunks_exact(row_bytes).enumerate() {
            // SAFETY: the caller runs with VNNI's features; `row` is one whole row.
            unsafe { super::int_row::<Q6K, Vnni>(a, row, &mut column) };
            for (y, v) in y.iter_mut().zip(&column[..a.t]) {
                y[j] = *v;
            }
        }
        return;
    }
    let count = rows.len() / row_bytes;
    debug_assert!((1..=GROUP_ROWS).contains(&count) && row_bytes == a.k / Q6K::BLOCK * Q6K::BYTES);
    // Rows past `count` recompute the last row; their outputs are never stored.
    // The eight rows are eight streams, which the hardware prefetchers follow poorly: each step prefetches its
    // share of the bytes after `rows`, where the next group's rows usually are (a prefetch never faults).
    let ahead = (
        rows.as_ptr_range().end,
        (GROUP_ROWS * row_bytes).div_ceil(a.k / K_SPAN),
    );
    let ptrs: [*const u8; GROUP_ROWS] =
        std::array::from_fn(|j| rows[j.min(count - 1) * row_bytes..].as_ptr());
    let mut t0 = 0;
    while t0 < a.t {
        let n = (a.t - t0).min(COLUMN_TOKENS);
        // SAFETY: the caller's contract, with t0 + n <= t; `matmul` made the columns in tiles of COLUMN_TOKENS.
        unsafe {
            if column_fold(n) == 2 {
                tile::<2>(q8, a.k, &ptrs, ahead, t0, n, &mut y[t0..]);
            } else {
                tile::<1>(q8, a.k, &ptrs, ahead, t0, n, &mut y[t0..]);
            }
        }
        t0 += n;
    }
}

/// One span of eight weight rows, as the pipeline holds it between its steps, for products of 2F sub-blocks
/// each (F: `Q8Rows::columns`' fold).
#[repr(C, align(64))]
struct Span {
    /// The weight tiles of the span's products: row j (< 8) holds weight row j's 128 codes q (-32..32) in the
    /// even runs of 16F codes, zeros in the odd ones; row 8 + j the odd runs. A product over 32F codes (its
    /// columns 32F·p..) so gives row j the sums of its first 16F codes, row 8 + j those of the last 16F: with the
    /// activation tile's F runs, each of 2F sub-blocks in a place of its own.
    codes: [[i8; K_SPAN]; 2 * GROUP_ROWS],
    /// Product p's sums: sums[p][i][c] for row i of its weight tile and column c of the activation tile (SUBS /
    /// (2F) products).
    sums: [[[i32; COLUMN_TOKENS]; 2 * GROUP_ROWS]; SUBS / 2],
    /// Row j's sub-scales of the span.
    scales: [[i32; SUBS]; GROUP_ROWS],
    /// Row j's block scale d.
    d: [f32; GROUP_ROWS],
}

impl Span {
    fn new() -> Span {
        Span {
            codes: [[0; K_SPAN]; 2 * GROUP_ROWS],
            sums: [[[0; COLUMN_TOKENS]; 2 * GROUP_ROWS]; SUBS / 2],
            scales: [[0; SUBS]; GROUP_ROWS],
            d: [0.0; GROUP_ROWS],
        }
    }
}

thread_local! {
    /// Each kernel thread's two pipeline spans (`tile`), kept from call to call: every field a span's steps read
    /// is written first, so they need no clearing (10 KB a call; the output head's calls have 12 spans each).
    /// Clearing them at every call took the Q6_K output head's pass at 8 tokens from 24.8 to 26.8 ms, once.
    static PIPELINE: std::cell::Cell<Option<Box<[Span; 2]>>> = const { std::cell::Cell::new(None) };
}

/// Span `sp` of block `bi` of the eight rows at `ptrs` into `span` (codes in runs of 16F, sub-scales, d).
///
/// # Safety
/// Block bi is inside every row; the caller runs with AVX-512 F and BW.
#[inline(always)]
unsafe fn decode<const F: usize>(
    ptrs: &[*const u8; GROUP_ROWS],
    bi: usize,
    sp: usize,
    span: &mut Span,
) {
    // The even runs of 16F bytes of 64 (F = 1 or 2).
    let even: __mmask64 = if F == 1 {
        0x0000_FFFF_0000_FFFF
    } else {
        0x0000_0000_FFFF_FFFF
    };
    for (j, &row) in ptrs.iter().enumerate() {
        // SAFETY: the caller's contract: the block's 210 bytes are readable; `span`'s rows hold 128 codes and 8
        // scales each.
        unsafe {
            let b = row.add(bi * Q6K::BYTES);
            // The span's low 4 bits: ql[64sp..], groups 0 and 1 in its low nibbles, 2 and 3 in its high ones; its
            // high 2 bits: qh[32sp..] (`blocks::Q6K`), bits 2t of group t, as two 64-byte halves of the span.
            let ql = _mm512_loadu_si512(b.add(64 * sp).cast());
            let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(b.add(128 + 32 * sp).cast()));
            let (nibble, two_bits) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(3));
            let low = [
                _mm512_and_si512(ql, nibble),
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), nibble),
            ];
            for (half, low) in low.into_iter().enumerate() {
                // Groups 2·half and 2·half + 1: qh shifted by 4·half, then 2 more in the upper 32 bytes.
                let shift = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
                let shift = _mm512_add_epi64(shift, _mm512_set1_epi64(4 * half as i64));
                let high = _mm512_and_si512(_mm512_srlv_epi64(qh, shift), two_bits);
                let codes = _mm512_or_si512(low, _mm512_slli_epi16::<4>(high));
                let codes = _mm512_sub_epi8(codes, _mm512_set1_epi8(Q6K::OFFSET as i8));
                let (runs, at) = (_mm512_maskz_mov_epi8(even, codes), 64 * half);
                _mm512_store_si512(span.codes[j][at..].as_mut_ptr().cast(), runs);
                let runs = _mm512_maskz_mov_epi8(!even, codes);
                _mm512_store_si512(span.codes[GROUP_ROWS + j][at..].as_mut_ptr().cast(), runs);
            }
            let sc = _mm_loadl_epi64(b.add(192 + SUBS * sp).cast());
            _mm256_store_si256(span.scales[j].as_mut_ptr().cast(), _mm256_cvtepi8_epi32(sc));
            let d = b.add(208).cast::<u16>().read_unaligned();
            span.d[j] = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(d))));
        }
    }
}

/// The span's COUNT products (COUNT = 4 / F), each over 2F sub-blocks (32F codes): into C tiles 2.., then
/// stored to `span.sums`. `x`: the tile's activation words from the span's first element (`Q8Rows::columns`).
///
/// # Safety
/// A configuration of `tile`'s shapes for F is loaded; `x` has the span's 32 words of 16 columns.
#[inline(always)]
unsafe fn products<const F: usize, const COUNT: usize>(span: &mut Span, x: *const i32) {
    let codes = span.codes.as_ptr().cast::<u8>();
    // Product p's weight codes (columns 32F·p.. of the weight tiles) and activation words (8F·p.. of the span).
    let weights = |p: usize| codes.wrapping_add(2 * SUB * F * p);
    let activations = |p: usize| {
        x.wrapping_add(2 * SUB / 4 * F * p * COLUMN_TOKENS)
            .cast::<u8>()
    };
    const ROW: usize = 4 * COLUMN_TOKENS;
    // SAFETY (all): the caller's contract; the operands lie in `span` and the activation columns.
    unsafe {
        amx::load::<0>(weights(0), K_SPAN);
        amx::load::<1>(activations(0), ROW);
        amx::zero::<2>();
        amx::dot_signed::<2, 0, 1>();
        amx::load::<6>(weights(1), K_SPAN);
        amx::load::<7>(activations(1), ROW);
        amx::zero::<3>();
        amx::dot_signed::<3, 6, 7>();
        if COUNT == 4 {
            amx::load::<0>(weights(2), K_SPAN);
            amx::load::<1>(activations(2), ROW);
            amx::zero::<4>();
            amx::dot_signed::<4, 0, 1>();
            amx::load::<6>(weights(3), K_SPAN);
            amx::load::<7>(activations(3), ROW);
            amx::zero::<5>();
            amx::dot_signed::<5, 6, 7>();
        }
        amx::store::<2>(span.sums[0].as_mut_ptr().cast(), ROW);
        amx::store::<3>(span.sums[1].as_mut_ptr().cast(), ROW);
        if COUNT == 4 {
            amx::store::<4>(span.sums[2].as_mut_ptr().cast(), ROW);
            amx::store::<5>(span.sums[3].as_mut_ptr().cast(), ROW);
        }
    }
}

/// Lane c of product p's sums: sub-block p·F + c / (16 / F) of the span (`Q8Rows::columns`), for each p.
///
/// # Safety
/// The caller runs with AVX-512 F.
#[inline(always)]
unsafe fn runs<const F: usize>() -> [__m512i; SUBS] {
    std::array::from_fn(|p| {
        let lanes: [i32; COLUMN_TOKENS] =
            std::array::from_fn(|c| (p * F + c / (COLUMN_TOKENS / F)) as i32);
        // SAFETY: 16 i32; the caller's contract.
        unsafe { _mm512_loadu_si512(lanes.as_ptr().cast()) }
    })
}

/// The span's float steps: for each row j, I = Σ sc·sums (exact; the F runs of a column's lanes added), then
/// tot[j] += float(I) · (d · dx), lane t for token t (`dx`: the span's activation scales; `runs`: `runs::<F>`).
///
/// # Safety
/// The caller runs with AVX-512 F.
#[inline(always)]
unsafe fn scale<const F: usize>(
    span: &Span,
    runs: &[__m512i; SUBS],
    dx: __m512,
    tot: &mut [__m512; GROUP_ROWS],
) {
    for (j, tot) in tot.iter_mut().enumerate() {
        let mut i = _mm512_setzero_si512();
        // SAFETY: 8 i32, 32-byte aligned.
        let scales =
            _mm512_castsi256_si512(unsafe { _mm256_load_si256(span.scales[j].as_ptr().cast()) });
        // Sub-blocks F·q.. (q < SUBS / F): product q / 2, the weight tile's row j or 8 + j.
        for (q, runs) in runs[..SUBS / F].iter().enumerate() {
            // Each lane's sub-scale: one for all lanes if F = 1.
            let m = if F == 1 {
                _mm512_set1_epi32(span.scales[j][q])
            } else {
                _mm512_permutexvar_epi32(*runs, scales)
            };
            // SAFETY: 16 i32, 64-byte aligned.
            let s = unsafe {
                _mm512_load_si512(span.sums[q / 2][j + GROUP_ROWS * (q % 2)].as_ptr().cast())
            };
            i = _mm512_add_epi32(i, _mm512_mullo_epi32(s, m));
        }
        if F == 2 {
            // Lanes 0-7 (tokens) += lanes 8-15 (the second run's).
            i = _mm512_add_epi32(i, _mm512_shuffle_i64x2::<0b01_00_11_10>(i, i));
        }
        let scale = _mm512_mul_ps(_mm512_set1_ps(span.d[j]), dx);
        *tot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), scale, *tot);
    }
}

/// y[0..n] (lane j: weight row j) for activation rows t0..t0 + n (n <= 16 / F, F = `column_fold(n)`) of the
/// eight rows at `ptrs` (each k / 256 blocks); at each span, `ahead` = (from, bytes) prefetches its share of the
/// bytes from `from`.
///
/// # Safety
/// t0 + n <= the rows `q8` holds, and its columns are made; the caller runs with AVX-512 VNNI's features on a
/// CPU with AMX.
#[inline(always)]
unsafe fn tile<const F: usize>(
    q8: &Q8Rows,
    k: usize,
    ptrs: &[*const u8; GROUP_ROWS],
    ahead: (*const u8, usize),
    t0: usize,
    n: usize,
    y: &mut [[f32; GROUP_ROWS]],
) {
    let (words, spans) = (k / 4, k / K_SPAN);
    let x = q8.columns[t0 * words..][..COLUMN_TOKENS * words].as_ptr();
    let scales = &q8.column_scales[t0 * spans..][..n * spans];
    // Tiles 0 and 6: a product's weight codes [8, 16F]; 1 and 7: its activation words [4F, 64 bytes]; 2-5:
    // four products' sums [8, 64 bytes]. Two pairs of operand tiles, so that loading one pair does not wait on
    // the product of the other.
    let (weights, activations, sums) = (
        (2 * GROUP_ROWS, 2 * SUB * F),
        (2 * SUB / 4 * F, 64),
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
        .unwrap_or_else(|| Box::new([Span::new(), Span::new()]));
    let pipeline = &mut *scratch;
    let mut tot = [_mm512_setzero_ps(); GROUP_ROWS];
    // SAFETY: the caller runs with AVX-512 F.
    let runs = unsafe { runs::<F>() };
    let lanes: __mmask16 = ((1u32 << n) - 1) as __mmask16;
    // SAFETY (all below): the caller's contract; span s is span s % 2 of block s / 2, inside every row.
    unsafe {
        config.load();
        decode::<F>(ptrs, 0, 0, &mut pipeline[0]);
        for step in 0..=spans {
            if step < spans {
                prefetch(ahead.0.wrapping_add(step * ahead.1), ahead.1);
                let span = &mut pipeline[step % 2];
                let x = x.add(step * K_SPAN / 4 * COLUMN_TOKENS);
                if F == 1 {
                    products::<F, 4>(span, x);
                } else {
                    products::<F, 2>(span, x);
                }
            }
            if step > 0 {
                let dx = _mm512_maskz_loadu_ps(lanes, scales[(step - 1) * n..].as_ptr());
                scale::<F>(&pipeline[(step - 1) % 2], &runs, dx, &mut tot);
            }
            if step + 1 < spans {
                decode::<F>(
                    ptrs,
                    (step + 1) / 2,
                    (step + 1) % 2,
                    &mut pipeline[(step + 1) % 2],
                );
            }
        }
        amx::release();
    }
    PIPELINE.set(Some(scratch));
    let mut lanes_of_rows = [[0f32; COLUMN_TOKENS]; GROUP_ROWS];
    for (out, tot) in lanes_of_rows.iter_mut().zip(tot) {
        // SAFETY: 16 floats.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), tot) };
    }
    for (t, y) in y[..n].iter_mut().enumerate() {
        for (j, y) in y.iter_mut().enumerate() {
            *y = lanes_of_rows[j][t];
        }
    }
}
