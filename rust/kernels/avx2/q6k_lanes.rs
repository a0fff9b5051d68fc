//! Plain Q6_K rows, one weight row per 32-bit lane, for passes of several activation rows (a speculative verify
//! pass, prefill) without AMX's tiles: a group of eight rows in AVX2 vectors with any `IntDot`'s products, or two
//! groups in AVX-512 vectors with VNNI's (`Zmm`, lanes 8-15 the second group's rows).
//!
//! The row kernel (`int_row`) decodes a row's codes again for every tile of activation rows, and ends each span
//! of every (weight row, activation row) pair with a reduction across lanes. Here each block of the rows is
//! decoded once a call into scratch (`LaneBlock`), then met by every activation row while it is in L1: word w holds
//! codes 4w..4w + 4 of each row, so one product meets every row's four codes with four activation bytes in every
//! lane, and each pair's span sum stays in its lane. (Decoding a call's blocks first and then running its tiles
//! over them took 1.08 of the time at T = 5 to 16: benches/RESULTS.md, thirty-fifth session.)
//! That sum is the row kernel's exact integer I = Σ sc·Σ c·x̂ - 32·Σ sc·Σx̂ (stored codes c = q + 32): the 16-bit
//! pair-sums of byte products times the sub-scales, then the offset against the activations' sixteen-element
//! sums. Its float step is the row kernel's, tot += float(I)·(d·dx), lane by lane, so each output has the row
//! kernel's bits (`SuperBlock::SPAN_TOTALS`) whatever the number of activation rows.

use std::arch::x86_64::*;

use super::super::blocks::{self, Format};
use super::super::rows::{
    in_tiles, Activations, GroupKernel, Kernel, GROUP_ROWS, MAX_T, WIDE_ROWS,
};
use super::interleaved::{dpwssd, with_wide, words4, Lanes, Zmm};
use super::{int_entries, AvxVnni, IntDot, Madd, Prefetch, Products, Vnni};

type Q6K = blocks::Q6K;
/// Codes per sub-block (one int8 scale each), and sub-blocks per block.
const SUB: usize = 16;
const SUBS: usize = Q6K::BLOCK / SUB;
/// Code words (four codes of each row) per block.
const WORDS: usize = Q6K::BLOCK / 4;
/// Sub-blocks per activation span.
const SPAN_SUBS: usize = Q6K::SPAN / SUB;
/// Offsets of a block's sub-scales and of its d.
const SCALES_AT: usize = 192;
const D_AT: usize = 208;

/// Activation rows from which a pass decodes its rows into lanes; fewer run the row kernel. Decoding a call's rows
/// costs about what the row kernel spends on a few activation rows: Qwen2.5-Coder-1.5B's Q6_K matrices with lanes
/// from 2 rows against the row kernel (Sapphire Rapids class VM without AMX, 2 threads, cache-cold, medians of 15)
/// took 1.21 / 0.99 / 0.87 of its time at T = 2 / 3 / 4 (benches/RESULTS.md, thirty-fifth session). With AMX,
/// passes of Q6K_TILE_MIN_ROWS rows or more take its tiles instead (`tiles`).
pub const Q6K_LANES_MIN_ROWS: usize = 4;

/// One block of G groups of eight weight rows as the lane kernels read it: in each entry, 32 bytes per group, lane
/// r of part g (bytes 4r..4r + 4) for row r of group g.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct LaneBlock<const G: usize> {
    /// Word w: codes 4w..4w + 4 of each row, as stored (c = q + 32, 0..64).
    codes: [[[u8; 32]; G]; WORDS],
    /// Sub-block s: each row's sub-scale in both 16-bit halves of its lane (multipliers of `madd`).
    scales: [[[u8; 32]; G]; SUBS],
    /// Sub-block s: -32 · each row's sub-scale in the low 16 bits of its lane, 0 in the high (`madd` against the
    /// sub-block's Σx̂ as an i32).
    offsets: [[[u8; 32]; G]; SUBS],
    /// Each row's d.
    d: [[f32; GROUP_ROWS]; G],
}

impl<const G: usize> LaneBlock<G> {
    const EMPTY: Self = LaneBlock {
        codes: [[[0; 32]; G]; WORDS],
        scales: [[[0; 32]; G]; SUBS],
        offsets: [[[0; 32]; G]; SUBS],
        d: [[0.0; GROUP_ROWS]; G],
    };
}

thread_local! {
    /// Each kernel thread's decoded block (2.8 KB a group), kept from call to call: a call writes every entry it
    /// reads.
    static LANE: std::cell::Cell<Option<Box<LaneBlock<1>>>> = const { std::cell::Cell::new(None) };
    static WIDE_LANE: std::cell::Cell<Option<Box<LaneBlock<2>>>> = const { std::cell::Cell::new(None) };
}

with_wide!(
    /// The integer kernel of plain Q6_K rows (8-bit activations), with `products`: a group kernel of eight rows in
    /// lanes, or with AVX-512 VNNI's a wide one of sixteen (`wide_rows`). Passes of fewer than Q6K_LANES_MIN_ROWS
    /// activation rows, and groups of fewer than eight rows, run the row kernel (`int_row`); the same bits either
    /// way. Call only if `products.available()` (not for AMX's, whose Q6_K kernel is `tiles::tiled`).
    q6_k => q6_k_lanes, wide_rows, Products::Avx512Vnni
);

int_entries!(
    /// `q6_k` with vector products on one group of eight rows.
    q6_k_lanes<> -> GroupKernel => lane_rows(
        a: &Activations,
        rows: &[u8],
        row_bytes: usize,
        y: &mut [[f32; GROUP_ROWS]; MAX_T]
    )
);

/// `count` (1 to 8) plain Q6_K rows (`rows`: count · row_bytes bytes, row_bytes = k / 256 · 210), in lanes with D's
/// products (a whole group, from Q6K_LANES_MIN_ROWS activation rows) or with the row kernel; y[t][j] for row j.
///
/// # Safety
/// The caller runs with D's features; `matmul` checked the sizes.
#[inline(always)]
pub(super) unsafe fn lane_rows<D: IntDot>(
    a: &Activations,
    rows: &[u8],
    row_bytes: usize,
    y: &mut [[f32; GROUP_ROWS]; MAX_T],
) {
    debug_assert!(row_bytes == a.k / Q6K::BLOCK * Q6K::BYTES && rows.len() % row_bytes == 0);
    if rows.len() != GROUP_ROWS * row_bytes || a.t < Q6K_LANES_MIN_ROWS {
        let mut column = [0f32; MAX_T];
        for (j, row) in rows.chunks_exact(row_bytes).enumerate() {
            // SAFETY: the caller runs with D's features; `row` is one whole row.
            unsafe { super::int_row::<Q6K, D>(a, row, &mut column) };
            for (y, v) in y.iter_mut().zip(&column[..a.t]) {
                y[j] = *v;
            }
        }
        return;
    }
    let mut lane = LANE.take().unwrap_or_else(|| Box::new(LaneBlock::EMPTY));
    let ahead = Prefetch::after(rows, row_bytes / Q6K::BYTES);
    for bi in 0..row_bytes / Q6K::BYTES {
        // SAFETY: `rows` is one whole group; the caller runs with D's features, which include AVX2.
        unsafe { decode_block(rows, row_bytes, bi, &mut lane) };
        // The tiles' contract: `lane` holds the group's block bi.
        in_tiles!(a.t, y, |t0, out| tile::<D>(a, &lane, bi, ahead, t0, out));
    }
    LANE.set(Some(lane));
}

/// Up to two groups of plain Q6_K rows (`rows`: up to 16 rows), two whole groups at once in AVX-512 vectors
/// (`Zmm`), else each group as `lane_rows` with VNNI's products; y[t][j] for row j.
///
/// # Safety
/// The caller runs with AVX-512 VNNI's features; `matmul` checked the sizes.
#[inline(always)]
unsafe fn wide_rows(
    a: &Activations,
    rows: &[u8],
    row_bytes: usize,
    y: &mut [[f32; WIDE_ROWS]; MAX_T],
) {
    if rows.len() != WIDE_ROWS * row_bytes || a.t < Q6K_LANES_MIN_ROWS {
        let mut lanes = [[0f32; GROUP_ROWS]; MAX_T];
        for (g, group) in rows.chunks(GROUP_ROWS * row_bytes).enumerate() {
            // SAFETY: the caller's contract.
            unsafe { lane_rows::<Vnni>(a, group, row_bytes, &mut lanes) };
            let count = group.len() / row_bytes;
            for (y, lanes) in y.iter_mut().zip(&lanes[..a.t]) {
                y[GROUP_ROWS * g..][..count].copy_from_slice(&lanes[..count]);
            }
        }
        return;
    }
    let mut lane = WIDE_LANE
        .take()
        .unwrap_or_else(|| Box::new(LaneBlock::EMPTY));
    let ahead = Prefetch::after(rows, row_bytes / Q6K::BYTES);
    for bi in 0..row_bytes / Q6K::BYTES {
        // SAFETY: `rows` is two whole groups; the caller runs with AVX-512 VNNI's features.
        unsafe { decode_block(rows, row_bytes, bi, &mut lane) };
        // The tiles' contract: `lane` holds both groups' block bi.
        in_tiles!(a.t, y, |t0, out| tile::<Zmm>(a, &lane, bi, ahead, t0, out));
    }
    WIDE_LANE.set(Some(lane));
}

/// Block bi of G whole groups of eight rows (`rows`) into `lane`.
///
/// # Safety
/// `rows` holds 8G rows of `row_bytes`, bi < row_bytes / 210; the caller runs with AVX2.
#[inline(always)]
unsafe fn decode_block<const G: usize>(
    rows: &[u8],
    row_bytes: usize,
    bi: usize,
    lane: &mut LaneBlock<G>,
) {
    debug_assert!(rows.len() == G * GROUP_ROWS * row_bytes);
    for g in 0..G {
        // SAFETY: block bi of group g's eight rows is inside `rows`; the caller runs with AVX2.
        unsafe {
            let b = rows
                .as_ptr()
                .add(g * GROUP_ROWS * row_bytes + bi * Q6K::BYTES);
            decode(b, row_bytes, g, lane);
        }
    }
}

/// Block `b` of eight rows (row r's at b + r · row_bytes) into part g of `lane`: its words transposed as read
/// (`words4`), then each code assembled in its lane.
///
/// # Safety
/// The eight blocks are readable; the caller runs with AVX2.
#[inline(always)]
unsafe fn decode<const G: usize>(
    b: *const u8,
    row_bytes: usize,
    g: usize,
    lane: &mut LaneBlock<G>,
) {
    let (nibble, two_bits) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    // Span h: byte l of ql[64h..] (A, l < 32) and of ql[64h + 32..] (B) hold elements 32t + l of groups t = 0, 1
    // in their low nibbles and t = 2, 3 in their high ones; byte l of qh[32h..] (H) holds their top two bits, 2t
    // up. Four words l / 4 at a time; 16-bit shifts, masked to the bits that stay in their byte.
    for h in 0..Q6K::BLOCK / Q6K::SPAN {
        for c0 in (0..8).step_by(4) {
            // SAFETY: bytes 0..192 of each row's block; the caller runs with AVX2.
            let (a, b, hi) = unsafe {
                (
                    words4(b.add(64 * h + 4 * c0), row_bytes),
                    words4(b.add(64 * h + 32 + 4 * c0), row_bytes),
                    words4(b.add(128 + 32 * h + 4 * c0), row_bytes),
                )
            };
            for c in 0..4 {
                let (a, b, hi) = (a[c], b[c], hi[c]);
                let groups = [
                    (_mm256_and_si256(a, nibble), _mm256_slli_epi16::<4>(hi)),
                    (_mm256_and_si256(b, nibble), _mm256_slli_epi16::<2>(hi)),
                    (_mm256_and_si256(_mm256_srli_epi16::<4>(a), nibble), hi),
                    (
                        _mm256_and_si256(_mm256_srli_epi16::<4>(b), nibble),
                        _mm256_srli_epi16::<2>(hi),
                    ),
                ];
                for (t, (low, top)) in groups.into_iter().enumerate() {
                    let codes = _mm256_or_si256(low, _mm256_and_si256(top, two_bits));
                    // SAFETY: word 32h + 8t + c0 + c < WORDS; part g of an entry is 32-byte aligned.
                    unsafe {
                        let word = &mut lane.codes[32 * h + 8 * t + c0 + c][g];
                        _mm256_store_si256(word.as_mut_ptr().cast(), codes);
                    }
                }
            }
        }
    }
    // Sub-block s = 4q + j's scale: byte j of word q of the scales, sign-extended.
    // SAFETY: bytes 192..208 of each row's block; the caller runs with AVX2.
    let words = unsafe { words4(b.add(SCALES_AT), row_bytes) };
    let low16 = _mm256_set1_epi32(0xFFFF);
    for s in 0..SUBS {
        let word = words[s / 4];
        let up = match s % 4 {
            0 => _mm256_slli_epi32::<24>(word),
            1 => _mm256_slli_epi32::<16>(word),
            2 => _mm256_slli_epi32::<8>(word),
            _ => word,
        };
        let sc = _mm256_srai_epi32::<24>(up);
        let both = _mm256_or_si256(_mm256_and_si256(sc, low16), _mm256_slli_epi32::<16>(sc));
        // -32·sc fits 16 bits (|sc| <= 128).
        let offset = _mm256_and_si256(
            _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<5>(sc)),
            low16,
        );
        // SAFETY: part g of an entry is 32-byte aligned.
        unsafe {
            _mm256_store_si256(lane.scales[s][g].as_mut_ptr().cast(), both);
            _mm256_store_si256(lane.offsets[s][g].as_mut_ptr().cast(), offset);
        }
    }
    // SAFETY: each row's d at byte 208 of its block; the caller runs with F16C (every kernel set here has it).
    unsafe {
        let d: [u16; GROUP_ROWS] =
            std::array::from_fn(|r| b.add(r * row_bytes + D_AT).cast::<u16>().read_unaligned());
        _mm256_store_ps(
            lane.d[g].as_mut_ptr(),
            _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().cast())),
        );
    }
}

/// The Q6_K lane kernel's steps in the lanes of `Lanes`: the row kernel's integers and float steps.
trait Q6Lanes: Lanes {
    /// The decoded blocks it reads.
    type Block;
    /// Word w (`Block::codes`), sub-block s's multipliers (`scales`) or offsets (`offsets`) of `block`.
    fn word(block: &Self::Block, w: usize) -> Self::Int;
    fn scales(block: &Self::Block, s: usize) -> Self::Int;
    fn offsets(block: &Self::Block, s: usize) -> Self::Int;
    /// `sum` + the 16-bit pair-sums of codes `w` times the four activation bytes `x` (in every lane), times the
    /// multipliers `mv`.
    unsafe fn scaled(sum: Self::Int, w: Self::Int, x: i32, mv: Self::Int) -> Self::Int;
    /// `sum` + the low 16 bits of `sx` (in every lane) times the multipliers `ov`.
    unsafe fn offset(sum: Self::Int, sx: i32, ov: Self::Int) -> Self::Int;
    unsafe fn add(a: Self::Int, b: Self::Int) -> Self::Int;
    /// out += float(i)·(d·dx), lane by lane, with `block`'s d.
    unsafe fn end_span(out: &mut Self::Out, i: Self::Int, block: &Self::Block, dx: f32);
}

impl<D: IntDot> Q6Lanes for D {
    type Block = LaneBlock<1>;

    #[inline(always)]
    fn word(block: &LaneBlock<1>, w: usize) -> __m256i {
        // SAFETY: 32 bytes, 32-byte aligned; every kernel set here has AVX2.
        unsafe { _mm256_load_si256(block.codes[w].as_ptr().cast()) }
    }

    #[inline(always)]
    fn scales(block: &LaneBlock<1>, s: usize) -> __m256i {
        // SAFETY: as `word`.
        unsafe { _mm256_load_si256(block.scales[s].as_ptr().cast()) }
    }

    #[inline(always)]
    fn offsets(block: &LaneBlock<1>, s: usize) -> __m256i {
        // SAFETY: as `word`.
        unsafe { _mm256_load_si256(block.offsets[s].as_ptr().cast()) }
    }

    #[inline(always)]
    unsafe fn scaled(sum: __m256i, w: __m256i, x: i32, mv: __m256i) -> __m256i {
        // SAFETY: the caller runs with D's features.
        unsafe { D::scaled(sum, w, _mm256_set1_epi32(x), mv) }
    }

    #[inline(always)]
    unsafe fn offset(sum: __m256i, sx: i32, ov: __m256i) -> __m256i {
        // SAFETY: the caller runs with D's features.
        unsafe { D::madd_into(sum, _mm256_set1_epi32(sx), ov) }
    }

    #[inline(always)]
    unsafe fn add(a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi32(a, b)
    }

    #[inline(always)]
    unsafe fn end_span(out: &mut [f32; GROUP_ROWS], i: __m256i, block: &LaneBlock<1>, dx: f32) {
        // SAFETY: a float per lane in `out` and in d (32-byte aligned); the caller runs with D's features.
        unsafe {
            let d = _mm256_load_ps(block.d[0].as_ptr());
            let acc = _mm256_loadu_ps(out.as_ptr());
            let acc = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(i),
                _mm256_mul_ps(d, _mm256_set1_ps(dx)),
                acc,
            );
            _mm256_storeu_ps(out.as_mut_ptr(), acc);
        }
    }
}

impl Q6Lanes for Zmm {
    type Block = LaneBlock<2>;

    #[inline(always)]
    fn word(block: &LaneBlock<2>, w: usize) -> __m512i {
        // SAFETY: 64 bytes, 64-byte aligned; the caller runs with AVX-512 F.
        unsafe { _mm512_load_si512(block.codes[w].as_ptr().cast()) }
    }

    #[inline(always)]
    fn scales(block: &LaneBlock<2>, s: usize) -> __m512i {
        // SAFETY: as `word`.
        unsafe { _mm512_load_si512(block.scales[s].as_ptr().cast()) }
    }

    #[inline(always)]
    fn offsets(block: &LaneBlock<2>, s: usize) -> __m512i {
        // SAFETY: as `word`.
        unsafe { _mm512_load_si512(block.offsets[s].as_ptr().cast()) }
    }

    #[inline(always)]
    unsafe fn scaled(sum: __m512i, w: __m512i, x: i32, mv: __m512i) -> __m512i {
        // SAFETY: the caller runs with AVX-512 BW and VNNI.
        unsafe { dpwssd(sum, _mm512_maddubs_epi16(w, _mm512_set1_epi32(x)), mv) }
    }

    #[inline(always)]
    unsafe fn offset(sum: __m512i, sx: i32, ov: __m512i) -> __m512i {
        // SAFETY: the caller runs with AVX-512 VNNI.
        unsafe { dpwssd(sum, _mm512_set1_epi32(sx), ov) }
    }

    #[inline(always)]
    unsafe fn add(a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: the caller runs with AVX-512 F.
        unsafe { _mm512_add_epi32(a, b) }
    }

    #[inline(always)]
    unsafe fn end_span(out: &mut [f32; WIDE_ROWS], i: __m512i, block: &LaneBlock<2>, dx: f32) {
        // SAFETY: a float per lane in `out` and in d (64-byte aligned); the caller runs with AVX-512 F.
        unsafe {
            let d = _mm512_load_ps(block.d.as_flattened().as_ptr());
            let acc = _mm512_loadu_ps(out.as_ptr());
            let acc = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(i),
                _mm512_mul_ps(d, _mm512_set1_ps(dx)),
                acc,
            );
            _mm512_storeu_ps(out.as_mut_ptr(), acc);
        }
    }
}

/// Block bi's products added into y[0..R] (a float per lane of L: its weight rows; set to zero at block 0) for
/// activation rows t0..t0 + R; returns R. The first tile prefetches the next call's rows (`ahead`), a sixteenth of
/// a block's share per sub-block: the rows are 8G streams, which the hardware prefetchers follow poorly, and their
/// bytes come while the products run. Qwen2.5-Coder-1.5B's Q6_K matrices took 0.85 / 0.80 / 0.85 of the time they
/// had taken at T = 6 / 8 / 16 when the decoding of each block prefetched its share at once (benches/RESULTS.md,
/// thirty-fifth session).
///
/// # Safety
/// `block` holds the rows' block bi; t0 + R <= a.t; the caller runs with L's features.
#[inline(always)]
unsafe fn tile<L: Q6Lanes, const R: usize>(
    a: &Activations,
    block: &L::Block,
    bi: usize,
    ahead: Prefetch,
    t0: usize,
    y: &mut [L::Out],
) -> usize {
    let q8 = a.q8_for(Q6K::SPAN);
    let (k, spans, subs) = (a.k, a.k / Q6K::SPAN, a.k / SUB);
    // Activation row t0's codes, span scales and sixteen-element sums; row t0 + r's are r rows further on.
    // SAFETY: `matmul` quantized t rows of k codes (spans scales and k / 16 lane sums each), and t0 < t.
    let (codes, scales, sub_sums) = unsafe {
        (
            q8.codes.as_ptr().add(t0 * k),
            q8.scales.as_ptr().add(t0 * spans),
            q8.lane_sums.as_ptr().add(t0 * subs),
        )
    };
    // Each row's accumulator lives in y (touched once a span), leaving the registers to the span's sums.
    if bi == 0 {
        for out in y[..R].iter_mut() {
            *out = L::Out::default();
        }
    }
    // With few rows, each row's products go into two chains (even and odd words), so that one chain's latency
    // does not bound the span.
    let chains = if R < 4 { 2 } else { 1 };
    for sp in 0..Q6K::BLOCK / Q6K::SPAN {
        let mut sums = [[L::zero_int(); 2]; R];
        for s in sp * SPAN_SUBS..(sp + 1) * SPAN_SUBS {
            if t0 == 0 {
                ahead.part(bi, s, SUBS);
            }
            let mv = L::scales(block, s);
            for c in 0..SUB / 4 {
                let w = SUB / 4 * s + c;
                let wv = L::word(block, w);
                for (r, sums) in sums.iter_mut().enumerate() {
                    // Activation bytes 4w..4w + 4 of block bi of row t0 + r, in every lane.
                    // SAFETY: inside row t0 + r's k codes.
                    let x = unsafe {
                        codes
                            .add(r * k + bi * Q6K::BLOCK + 4 * w)
                            .cast::<i32>()
                            .read_unaligned()
                    };
                    let sum = &mut sums[c % chains];
                    // SAFETY: the caller runs with L's features.
                    *sum = unsafe { L::scaled(*sum, wv, x, mv) };
                }
            }
        }
        for s in sp * SPAN_SUBS..(sp + 1) * SPAN_SUBS {
            let ov = L::offsets(block, s);
            for (r, [sum, _]) in sums.iter_mut().enumerate() {
                // SAFETY: sub-block bi · 16 + s of row t0 + r's k / 16 sums; the caller runs with L's features.
                *sum = unsafe { L::offset(*sum, *sub_sums.add(r * subs + bi * SUBS + s), ov) };
            }
        }
        for (r, [even, odd]) in sums.into_iter().enumerate() {
            // SAFETY: one scale per span and row; the caller runs with L's features.
            unsafe {
                let i = if chains == 2 { L::add(even, odd) } else { even };
                L::end_span(&mut y[r], i, block, *scales.add(r * spans + bi * 2 + sp));
            }
        }
    }
    R
}
