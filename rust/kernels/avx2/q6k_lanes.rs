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
//! That sum is the row kernel's exact integer I = Σ sc·Σ c·x̂ - 32·Σ sc·Σx̂ (stored codes c = q + 32): with
//! VNNI's products (AVX-VNNI, AVX-512 VNNI) each half sub-block's products summed whole from its offset, then
//! times its sub-scale (on AMD's cores, AVX-512's lanes sum each whole sub-block, then one `vpmulld`); with AVX2's
//! `madd` the 16-bit pair-sums of byte products times the sub-scales, then the
//! offset against the activations' sixteen-element sums (`Q6Lanes::WHOLE_SCALES`). Its float step is the row kernel's,
//! tot += float(I)·(d·dx), lane by lane, so each output has the row kernel's bits (`SuperBlock::SPAN_TOTALS`)
//! whatever the number of activation rows.
//!
//! Resident rows take the interleaved layout (`QType::Q6KX8`, `interleave`) where AVX-512 VNNI's products run their
//! passes, not AMX's (`QType::resident_interleaved`): there the words come transposed, so a block's decoding is only
//! the codes' assembly and the scales', and every pass takes the lanes, one activation row too.

use std::arch::x86_64::*;
use std::cell::Cell;
use std::thread::LocalKey;

use super::super::blocks::{self, Format};
use super::super::q8::Q8Rows;
use super::super::rows::{
    in_tiles, Activations, GroupKernel, Kernel, GROUP_ROWS, MAX_T, WIDE_ROWS,
};
use super::interleaved::{dpwssd, join_si, lane_bytes, with_wide, words4, Lanes, Zmm};
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
    /// Sub-block s: each row's sub-scale as the lanes' products take it (`Q6Lanes::WHOLE_SCALES`): in both 16-bit
    /// halves of its lane (multipliers of `madd`), or in the low half with a zero in the high (`vpdpwssd` against a
    /// half sub-block's sum, an i32 that fits in 16 bits; `Zmm<true>` sign-extends it to the lane for `vpmulld`).
    scales: [[[u8; 32]; G]; SUBS],
    /// Sub-block s, for the 16-bit multipliers only: -32 · each row's sub-scale in the low 16 bits of its lane, 0
    /// in the high (`madd` against the sub-block's Σx̂ as an i32).
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
    /// Each kernel thread's decoded block (3 KB a group), kept from call to call: a call writes every entry it
    /// reads.
    static LANE: Cell<Option<Box<LaneBlock<1>>>> = const { Cell::new(None) };
    static WIDE_LANE: Cell<Option<Box<LaneBlock<2>>>> = const { Cell::new(None) };
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

with_wide!(
    /// The integer kernel of interleaved Q6_K rows (`QType::Q6KX8`; 8-bit activations), with `products`: a group
    /// kernel of eight rows in lanes, or with AVX-512 VNNI's a wide one of sixteen (`x8_wide_rows`; AMX's too,
    /// though resident matrices keep plain rows there for its tiles: `QType::resident_interleaved`). Passes of any
    /// number of activation rows take the lanes. Call only if `products.available()`.
    q6_k_x8 => q6_k_x8_lanes, x8_wide_rows, Products::Avx512Vnni | Products::Amx
);

int_entries!(
    /// `q6_k_x8` with vector products on one interleaved group of eight rows.
    q6_k_x8_lanes<> -> GroupKernel => x8_lane_rows(
        a: &Activations,
        group: &[u8],
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
    let block = |bi| [Plain::block(rows, row_bytes, 0, bi)];
    // SAFETY: `rows` is one whole group; the caller runs with D's features, which include AVX2.
    unsafe { decode_and_multiply::<D, _, 1, 1>(a, rows, block, &LANE, y) };
}

/// One interleaved group of eight Q6_K rows (`group`: 8 · row_bytes bytes, row_bytes = k / 256 · 210) in lanes with
/// D's products, whatever the number of activation rows; y[t][r] for row r.
///
/// # Safety
/// The caller runs with D's features; `matmul` checked the sizes (interleaved rows come in whole groups).
#[inline(always)]
unsafe fn x8_lane_rows<D: IntDot>(
    a: &Activations,
    group: &[u8],
    row_bytes: usize,
    y: &mut [[f32; GROUP_ROWS]; MAX_T],
) {
    debug_assert!(
        row_bytes == a.k / Q6K::BLOCK * Q6K::BYTES && group.len() == GROUP_ROWS * row_bytes
    );
    let block = |bi| [Mixed::block(group, row_bytes, 0, bi)];
    // SAFETY: `group` is one whole group; the caller runs with D's features, which include AVX2.
    unsafe { decode_and_multiply::<D, _, 1, 1>(a, group, block, &LANE, y) };
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
    let block = |bi| [0, 1].map(|g| Plain::block(rows, row_bytes, g, bi));
    // SAFETY: `rows` is two whole groups; the caller runs with AVX-512 VNNI's features.
    unsafe { wide_decode_and_multiply(a, rows, block, y) };
}

/// One or two interleaved groups of Q6_K rows (`groups`: 8 or 16 rows), two at once in AVX-512 vectors (`Zmm`), a
/// lone one as `x8_lane_rows` with VNNI's products; y[t][j] for row j.
///
/// # Safety
/// The caller runs with AVX-512 VNNI's features; `matmul` checked the sizes.
#[inline(always)]
unsafe fn x8_wide_rows(
    a: &Activations,
    groups: &[u8],
    row_bytes: usize,
    y: &mut [[f32; WIDE_ROWS]; MAX_T],
) {
    if groups.len() != WIDE_ROWS * row_bytes {
        let mut lanes = [[0f32; GROUP_ROWS]; MAX_T];
        // SAFETY: the caller's contract; `groups` is one whole group.
        unsafe { x8_lane_rows::<Vnni>(a, groups, row_bytes, &mut lanes) };
        for (y, lanes) in y.iter_mut().zip(&lanes[..a.t]) {
            y[..GROUP_ROWS].copy_from_slice(lanes);
        }
        return;
    }
    let block = |bi| [MixedPair::block(groups, row_bytes, 0, bi)];
    // SAFETY: `groups` is two whole groups; the caller runs with AVX-512 VNNI's features.
    unsafe { wide_decode_and_multiply(a, groups, block, y) };
}

/// `decode_and_multiply` on two groups at once in AVX-512 vectors, each sub-block's sum times its sub-scale as
/// `whole_sub_sums` says (`Q6Lanes for Zmm`).
///
/// # Safety
/// As `decode_and_multiply`'s, with AVX-512 VNNI's features.
#[inline(always)]
unsafe fn wide_decode_and_multiply<B: RowBlock, const P: usize>(
    a: &Activations,
    rows: &[u8],
    block: impl Fn(usize) -> [B; P],
    y: &mut [[f32; WIDE_ROWS]; MAX_T],
) {
    // SAFETY (both): the caller's contract.
    if whole_sub_sums() {
        unsafe { decode_and_multiply::<Zmm<true>, _, 2, P>(a, rows, block, &WIDE_LANE, y) }
    } else {
        unsafe { decode_and_multiply::<Zmm<false>, _, 2, P>(a, rows, block, &WIDE_LANE, y) }
    }
}

/// Whether `Zmm`'s lanes sum each sub-block whole and multiply it by its sub-scale with `vpmulld` (`Zmm<true>`), as
/// on AMD's cores, or each half with `vpdpwssd` (`Zmm<false>`), as on Intel's (`Q6Lanes for Zmm`). Both give the
/// same integers; tests take either (`force_whole_sub_sums`).
fn whole_sub_sums() -> bool {
    #[cfg(test)]
    match FORCED_SUB_SUMS.load(std::sync::atomic::Ordering::Relaxed) {
        1 => return false,
        2 => return true,
        _ => {}
    }
    super::is_amd()
}

/// `whole_sub_sums` for tests: 0 the CPU's choice, 1 by halves, 2 whole.
#[cfg(test)]
static FORCED_SUB_SUMS: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Makes every thread's Q6_K lanes in AVX-512 vectors sum sub-blocks whole (`Some(true)`), by halves
/// (`Some(false)`), or as the CPU does best (`None`). Both give the same bits, so tests that run meanwhile are
/// unaffected.
#[cfg(test)]
pub fn force_whole_sub_sums(whole: Option<bool>) {
    let forced = match whole {
        None => 0,
        Some(false) => 1,
        Some(true) => 2,
    };
    FORCED_SUB_SUMS.store(forced, std::sync::atomic::Ordering::Relaxed);
}

/// The lane kernel on a call's rows (`rows`: G groups of eight): each block bi (`block(bi)`: the G groups' blocks, in
/// P parts of G / P groups each) decoded into the thread's `scratch`, then met by every tile of activation rows
/// while it is in L1, the first tile prefetching the next call's rows.
///
/// # Safety
/// `block(bi)` gives readable blocks for every bi < a.k / 256; the caller runs with L's features.
#[inline(always)]
unsafe fn decode_and_multiply<
    L: Q6Lanes<Block = LaneBlock<G>>,
    B: RowBlock,
    const G: usize,
    const P: usize,
>(
    a: &Activations,
    rows: &[u8],
    block: impl Fn(usize) -> [B; P],
    scratch: &'static LocalKey<Cell<Option<Box<LaneBlock<G>>>>>,
    y: &mut [L::Out; MAX_T],
) {
    // The tiles read OFFSETS_PER_SUB offset inputs per sub-block and row (`matmul` adds the halves' for VNNI).
    let offsets = L::offset_inputs(a.q8_for(Q6K::SPAN)).len();
    assert_eq!(
        offsets,
        a.t * a.k / SUB * L::OFFSETS_PER_SUB,
        "Q6_K offset inputs"
    );
    let mut lane = scratch.take().unwrap_or_else(|| Box::new(LaneBlock::EMPTY));
    let blocks = a.k / Q6K::BLOCK;
    let ahead = Prefetch::after(rows, blocks);
    for bi in 0..blocks {
        for (part, rows) in block(bi).into_iter().enumerate() {
            // SAFETY: the caller's contract.
            unsafe { decode(rows, part, L::WHOLE_SCALES, &mut lane) };
        }
        // The tiles' contract: `lane` holds the groups' block bi.
        in_tiles!(a.t, y, |t0, out| tile::<L>(a, &lane, bi, ahead, t0, out));
    }
    scratch.set(Some(lane));
}

/// Block bi of a group of eight rows, or of two groups (`MixedPair`), as `decode` reads it.
trait RowBlock: Copy {
    /// The vectors it decodes into: a lane per row.
    type V: DecodeVec;
    /// Block bi of group g of `rows` (rows of `row_bytes`).
    fn block(rows: &[u8], row_bytes: usize, g: usize, bi: usize) -> Self;
    /// Bytes at..at + 16 (at a multiple of 4, below 208) of the rows' block: vector w holds the word at at + 4w of
    /// each row, lane r for row r.
    ///
    /// # Safety
    /// The block is readable; the caller runs with V's features.
    unsafe fn words4(self, at: usize) -> [Self::V; 4];
    /// The rows' d as floats into `d`, row r's at d[r].
    ///
    /// # Safety
    /// As `words4`; `d` holds a float per row, 32-byte aligned.
    unsafe fn store_d(self, d: *mut f32);
}

/// Block bi of eight plain rows: row r's at `at` + r · row_bytes, its words transposed as read (`words4`).
#[derive(Clone, Copy)]
struct Plain {
    at: *const u8,
    row_bytes: usize,
}

impl RowBlock for Plain {
    type V = __m256i;

    #[inline(always)]
    fn block(rows: &[u8], row_bytes: usize, g: usize, bi: usize) -> Plain {
        Plain {
            at: rows
                .as_ptr()
                .wrapping_add(g * GROUP_ROWS * row_bytes + bi * Q6K::BYTES),
            row_bytes,
        }
    }

    #[inline(always)]
    unsafe fn words4(self, at: usize) -> [__m256i; 4] {
        // SAFETY: the caller's contract.
        unsafe { words4(self.at.add(at), self.row_bytes) }
    }

    #[inline(always)]
    unsafe fn store_d(self, d: *mut f32) {
        // SAFETY: each row's d at byte 208 of its block (the caller's contract); F16C is in every kernel set here.
        unsafe {
            let half: [u16; GROUP_ROWS] = std::array::from_fn(|r| {
                self.at
                    .add(r * self.row_bytes + D_AT)
                    .cast::<u16>()
                    .read_unaligned()
            });
            _mm256_store_ps(d, _mm256_cvtph_ps(_mm_loadu_si128(half.as_ptr().cast())));
        }
    }
}

/// Block bi of an interleaved group (`interleave`): word w of row r at `at` + 32w + 4r, then the rows' d.
#[derive(Clone, Copy)]
struct Mixed {
    at: *const u8,
}

impl RowBlock for Mixed {
    type V = __m256i;

    #[inline(always)]
    fn block(groups: &[u8], row_bytes: usize, g: usize, bi: usize) -> Mixed {
        Mixed {
            at: groups
                .as_ptr()
                .wrapping_add(g * GROUP_ROWS * row_bytes + bi * GROUP_ROWS * Q6K::BYTES),
        }
    }

    #[inline(always)]
    unsafe fn words4(self, at: usize) -> [__m256i; 4] {
        // (Loads written out, not an array's closure: a closure takes no target features, and its intrinsics
        // would become calls.)
        // SAFETY: the caller's contract: words at / 4 .. at / 4 + 4 of the group's block.
        unsafe {
            let word = self.at.add(GROUP_ROWS * at);
            [
                _mm256_loadu_si256(word.cast()),
                _mm256_loadu_si256(word.add(32).cast()),
                _mm256_loadu_si256(word.add(64).cast()),
                _mm256_loadu_si256(word.add(96).cast()),
            ]
        }
    }

    #[inline(always)]
    unsafe fn store_d(self, d: *mut f32) {
        // SAFETY: the rows' d after the block's 52 words of eight rows (the caller's contract).
        unsafe {
            _mm256_store_ps(
                d,
                _mm256_cvtph_ps(_mm_loadu_si128(self.at.add(GROUP_ROWS * D_AT).cast())),
            )
        }
    }
}

/// Block bi of two interleaved groups, decoded at once in AVX-512 vectors: each of `Mixed`'s words of the first
/// group in lanes 0-7 and of the second in lanes 8-15.
#[derive(Clone, Copy)]
struct MixedPair {
    at: [Mixed; 2],
}

impl RowBlock for MixedPair {
    type V = __m512i;

    #[inline(always)]
    fn block(groups: &[u8], row_bytes: usize, g: usize, bi: usize) -> MixedPair {
        MixedPair {
            at: [
                Mixed::block(groups, row_bytes, g, bi),
                Mixed::block(groups, row_bytes, g + 1, bi),
            ],
        }
    }

    #[inline(always)]
    unsafe fn words4(self, at: usize) -> [__m512i; 4] {
        // SAFETY: the caller's contract, for both groups; it runs with AVX-512 F.
        unsafe {
            let (first, second) = (self.at[0].words4(at), self.at[1].words4(at));
            [
                join_si(first[0], second[0]),
                join_si(first[1], second[1]),
                join_si(first[2], second[2]),
                join_si(first[3], second[3]),
            ]
        }
    }

    #[inline(always)]
    unsafe fn store_d(self, d: *mut f32) {
        // SAFETY: the caller's contract: sixteen floats at d, the first group's rows then the second's.
        unsafe {
            self.at[0].store_d(d);
            self.at[1].store_d(d.add(GROUP_ROWS));
        }
    }
}

/// The vectors a block of Q6_K rows is decoded in (`decode`): a group's eight rows (AVX2), or two groups' sixteen
/// (AVX-512), a lane per row. The same steps at either width.
trait DecodeVec: Copy {
    unsafe fn splat8(v: i8) -> Self;
    unsafe fn splat32(v: i32) -> Self;
    /// `lane_bytes(pick)` at this width.
    unsafe fn lane_bytes(pick: [u8; 4]) -> Self;
    unsafe fn and(a: Self, b: Self) -> Self;
    /// low | (top & mask).
    unsafe fn merge(low: Self, top: Self, mask: Self) -> Self;
    /// 16-bit lanes shifted left, right (logical) or right (arithmetic) by `n`; 32-bit lanes right by 16.
    unsafe fn shl16(a: Self, n: i32) -> Self;
    unsafe fn shr16(a: Self, n: i32) -> Self;
    unsafe fn sar16(a: Self, n: i32) -> Self;
    unsafe fn shr32_16(a: Self) -> Self;
    /// Each 16-bit lane the sum of its two bytes of `a` (signed) times those of `sel` (unsigned: `maddubs`).
    unsafe fn maddubs(sel: Self, a: Self) -> Self;
    /// -a in 16-bit lanes.
    unsafe fn neg16(a: Self) -> Self;
    /// `pshufb` within each 128-bit lane.
    unsafe fn shuffle(a: Self, idx: Self) -> Self;
    /// Stores at `to`, aligned to the vector's size.
    unsafe fn store(self, to: *mut u8);
    /// Loads from `from`, aligned to the vector's size.
    unsafe fn load(from: *const u8) -> Self;
}

impl DecodeVec for __m256i {
    #[inline(always)]
    unsafe fn splat8(v: i8) -> __m256i {
        _mm256_set1_epi8(v)
    }

    #[inline(always)]
    unsafe fn splat32(v: i32) -> __m256i {
        _mm256_set1_epi32(v)
    }

    #[inline(always)]
    unsafe fn lane_bytes(pick: [u8; 4]) -> __m256i {
        // SAFETY: the caller runs with AVX2.
        unsafe { lane_bytes(pick) }
    }

    #[inline(always)]
    unsafe fn and(a: __m256i, b: __m256i) -> __m256i {
        _mm256_and_si256(a, b)
    }

    #[inline(always)]
    unsafe fn merge(low: __m256i, top: __m256i, mask: __m256i) -> __m256i {
        _mm256_or_si256(low, _mm256_and_si256(top, mask))
    }

    #[inline(always)]
    unsafe fn shl16(a: __m256i, n: i32) -> __m256i {
        _mm256_sll_epi16(a, _mm_cvtsi32_si128(n))
    }

    #[inline(always)]
    unsafe fn shr16(a: __m256i, n: i32) -> __m256i {
        _mm256_srl_epi16(a, _mm_cvtsi32_si128(n))
    }

    #[inline(always)]
    unsafe fn sar16(a: __m256i, n: i32) -> __m256i {
        _mm256_sra_epi16(a, _mm_cvtsi32_si128(n))
    }

    #[inline(always)]
    unsafe fn shr32_16(a: __m256i) -> __m256i {
        _mm256_srli_epi32::<16>(a)
    }

    #[inline(always)]
    unsafe fn maddubs(sel: __m256i, a: __m256i) -> __m256i {
        _mm256_maddubs_epi16(sel, a)
    }

    #[inline(always)]
    unsafe fn neg16(a: __m256i) -> __m256i {
        _mm256_sub_epi16(_mm256_setzero_si256(), a)
    }

    #[inline(always)]
    unsafe fn shuffle(a: __m256i, idx: __m256i) -> __m256i {
        _mm256_shuffle_epi8(a, idx)
    }

    #[inline(always)]
    unsafe fn store(self, to: *mut u8) {
        // SAFETY: the caller's contract.
        unsafe { _mm256_store_si256(to.cast(), self) }
    }

    #[inline(always)]
    unsafe fn load(from: *const u8) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe { _mm256_load_si256(from.cast()) }
    }
}

impl DecodeVec for __m512i {
    #[inline(always)]
    unsafe fn splat8(v: i8) -> __m512i {
        // SAFETY (each method): the caller runs with AVX-512 F, BW and VL.
        unsafe { _mm512_set1_epi8(v) }
    }

    #[inline(always)]
    unsafe fn splat32(v: i32) -> __m512i {
        unsafe { _mm512_set1_epi32(v) }
    }

    #[inline(always)]
    unsafe fn lane_bytes(pick: [u8; 4]) -> __m512i {
        unsafe { _mm512_broadcast_i64x4(lane_bytes(pick)) }
    }

    #[inline(always)]
    unsafe fn and(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_and_si512(a, b) }
    }

    #[inline(always)]
    unsafe fn merge(low: __m512i, top: __m512i, mask: __m512i) -> __m512i {
        // low | (top & mask): bit 4a + 2b + c of the table is a | (b & c), for bits a, b, c of low, top, mask.
        unsafe { _mm512_ternarylogic_epi32::<0xF8>(low, top, mask) }
    }

    #[inline(always)]
    unsafe fn shl16(a: __m512i, n: i32) -> __m512i {
        unsafe { _mm512_sll_epi16(a, _mm_cvtsi32_si128(n)) }
    }

    #[inline(always)]
    unsafe fn shr16(a: __m512i, n: i32) -> __m512i {
        unsafe { _mm512_srl_epi16(a, _mm_cvtsi32_si128(n)) }
    }

    #[inline(always)]
    unsafe fn sar16(a: __m512i, n: i32) -> __m512i {
        unsafe { _mm512_sra_epi16(a, _mm_cvtsi32_si128(n)) }
    }

    #[inline(always)]
    unsafe fn shr32_16(a: __m512i) -> __m512i {
        unsafe { _mm512_srli_epi32::<16>(a) }
    }

    #[inline(always)]
    unsafe fn maddubs(sel: __m512i, a: __m512i) -> __m512i {
        unsafe { _mm512_maddubs_epi16(sel, a) }
    }

    #[inline(always)]
    unsafe fn neg16(a: __m512i) -> __m512i {
        unsafe { _mm512_sub_epi16(_mm512_setzero_si512(), a) }
    }

    #[inline(always)]
    unsafe fn shuffle(a: __m512i, idx: __m512i) -> __m512i {
        unsafe { _mm512_shuffle_epi8(a, idx) }
    }

    #[inline(always)]
    unsafe fn store(self, to: *mut u8) {
        unsafe { _mm512_store_si512(to.cast(), self) }
    }

    #[inline(always)]
    unsafe fn load(from: *const u8) -> __m512i {
        unsafe { _mm512_load_si512(from.cast()) }
    }
}

/// Block `rows` (one group's, or `MixedPair`'s two) into part `part` of `lane` (32 bytes of each entry per group
/// from byte 32 · part): its words transposed (`RowBlock::words4`), then each code and scale assembled in its lane,
/// the scales as whole i32s or else as 16-bit multipliers and offsets (`whole_scales`: `Q6Lanes::WHOLE_SCALES`).
///
/// # Safety
/// The blocks are readable; the caller runs with the features of `rows`' vectors.
#[inline(always)]
unsafe fn decode<B: RowBlock, const G: usize>(
    rows: B,
    part: usize,
    whole_scales: bool,
    lane: &mut LaneBlock<G>,
) {
    type V<B> = <B as RowBlock>::V;
    // SAFETY (every vector step): the caller runs with V's features.
    let (nibble, two_bits) = unsafe { (V::<B>::splat8(0x0F), V::<B>::splat8(0x30)) };
    // Span h: byte l of ql[64h..] (A, l < 32) and of ql[64h + 32..] (B) hold elements 32t + l of groups t = 0, 1
    // in their low nibbles and t = 2, 3 in their high ones; byte l of qh[32h..] (H) holds their top two bits, 2t
    // up. Four words l / 4 at a time; 16-bit shifts, masked to the bits that stay in their byte.
    for h in 0..Q6K::BLOCK / Q6K::SPAN {
        for c0 in (0..8).step_by(4) {
            // SAFETY: bytes 0..192 of each row's block.
            let (a, b, hi) = unsafe {
                (
                    rows.words4(64 * h + 4 * c0),
                    rows.words4(64 * h + 32 + 4 * c0),
                    rows.words4(128 + 32 * h + 4 * c0),
                )
            };
            for c in 0..4 {
                let (a, b, hi) = (a[c], b[c], hi[c]);
                // SAFETY: as above.
                let groups = unsafe {
                    [
                        (V::<B>::and(a, nibble), V::<B>::shl16(hi, 4)),
                        (V::<B>::and(b, nibble), V::<B>::shl16(hi, 2)),
                        (V::<B>::and(V::<B>::shr16(a, 4), nibble), hi),
                        (
                            V::<B>::and(V::<B>::shr16(b, 4), nibble),
                            V::<B>::shr16(hi, 2),
                        ),
                    ]
                };
                for (t, (low, top)) in groups.into_iter().enumerate() {
                    // SAFETY: word 32h + 8t + c0 + c < WORDS; part `part` of an entry is aligned to V.
                    unsafe {
                        let word = lane.codes[32 * h + 8 * t + c0 + c]
                            .as_mut_ptr()
                            .cast::<u8>();
                        V::<B>::merge(low, top, two_bits).store(word.add(32 * part));
                    }
                }
            }
        }
    }
    // Sub-block s = 4q + j's scale: byte j of word q of the scales, sign-extended. Whole: byte j % 2 of the lane's
    // low half (j < 2) or of its high half moved down, picked by a `maddubs` with 1 against it and 0 against the
    // other bytes: the low 16 bits the scale, the high ones 0. Else per word, bytes 0 and 2 (even j) and bytes 1
    // and 3 (odd j) as the 16-bit halves of each lane, and -32 times them (|sc| <= 128: 16 bits).
    // SAFETY: bytes 192..208 of each row's block; as above.
    unsafe {
        let words = rows.words4(SCALES_AT);
        if whole_scales {
            let pick = [V::<B>::splat32(1), V::<B>::splat32(1 << 8)];
            for (q, word) in words.into_iter().enumerate() {
                let halves = [word, V::<B>::shr32_16(word)];
                for j in 0..4 {
                    let sc = V::<B>::maddubs(pick[j % 2], halves[j / 2]);
                    // (Pointers from the whole entry: a pair's vector spans both groups' parts.)
                    let scales = lane.scales[4 * q + j].as_mut_ptr().cast::<u8>();
                    sc.store(scales.add(32 * part));
                }
            }
        } else {
            // Half h of each lane into both halves (its bytes 2h and 2h + 1 to bytes 0-1 and 2-3).
            let spread = [
                V::<B>::lane_bytes([0, 1, 0, 1]),
                V::<B>::lane_bytes([2, 3, 2, 3]),
            ];
            let low16 = V::<B>::splat32(0xFFFF);
            for (q, word) in words.into_iter().enumerate() {
                let even = V::<B>::sar16(V::<B>::shl16(word, 8), 8);
                let odd = V::<B>::sar16(word, 8);
                let neg_even = V::<B>::neg16(V::<B>::shl16(even, 5));
                let neg_odd = V::<B>::neg16(V::<B>::shl16(odd, 5));
                for j in 0..4 {
                    let (sc, neg) = if j % 2 == 0 {
                        (even, neg_even)
                    } else {
                        (odd, neg_odd)
                    };
                    let offset = if j / 2 == 0 {
                        V::<B>::and(neg, low16)
                    } else {
                        V::<B>::shr32_16(neg)
                    };
                    let scales = lane.scales[4 * q + j].as_mut_ptr().cast::<u8>();
                    V::<B>::shuffle(sc, spread[j / 2]).store(scales.add(32 * part));
                    let offsets = lane.offsets[4 * q + j].as_mut_ptr().cast::<u8>();
                    offset.store(offsets.add(32 * part));
                }
            }
        }
        // The rows' d.
        rows.store_d(
            lane.d
                .as_flattened_mut()
                .as_mut_ptr()
                .add(GROUP_ROWS * part),
        );
    }
}

/// The Q6_K lane kernel's steps in the lanes of `Lanes`: the row kernel's integers and float steps.
trait Q6Lanes: Lanes {
    /// The decoded blocks it reads.
    type Block;
    /// A sub-block's four code words and multipliers, loaded once for every activation row.
    type Sub;
    /// Whether a sub-block's sums of byte products are whole i32 lanes, each half's multiplied once by the
    /// sub-scale (`LaneBlock::scales`), else 16-bit pair-sums, each pair multiplied (`madd`).
    const WHOLE_SCALES: bool;
    /// Sub-block s of `block`.
    fn sub_block(block: &Self::Block, s: usize) -> Self::Sub;
    /// What `add_sub_block` takes for each activation row's sub-block, OFFSETS_PER_SUB values: its Σx̂
    /// (`Q8Rows::lane_sums`), or with whole scales -32 · Σx̂ of each half (`Q8Rows::neg32_eight_sums`).
    fn offset_inputs(q8: &Q8Rows) -> &[i32];
    const OFFSETS_PER_SUB: usize = if Self::WHOLE_SCALES { 2 } else { 1 };
    /// `sums` + sc·Σ (c - 32)·x̂ over a sub-block's sixteen codes c (stored q + 32) for one activation row, each
    /// lane's exact integer: the row's codes `x` (four words) and its `offset_inputs` entries at `offsets`. With
    /// whole scales each half's products go into a sum of their own (sums[0], sums[1]), so that two chains of
    /// `vpdpwssd` share the latency; else all into sums[0].
    ///
    /// # Safety
    /// `x` points at 16 readable codes, `offsets` at OFFSETS_PER_SUB values; the caller runs with the lanes'
    /// features.
    unsafe fn add_sub_block(
        sums: &mut [Self::Int; 2],
        sub: &Self::Sub,
        x: *const i8,
        offsets: *const i32,
    );
    unsafe fn add(a: Self::Int, b: Self::Int) -> Self::Int;
    /// out += float(i)·(d·dx), lane by lane, with `block`'s d.
    unsafe fn end_span(out: &mut Self::Out, i: Self::Int, block: &Self::Block, dx: f32);
}

/// The four code words of sub-block s of `block`, every group's part (G · 32 bytes) in one vector.
///
/// # Safety
/// V spans the G parts of an entry; the caller runs with V's features.
#[inline(always)]
unsafe fn sub_words<V: DecodeVec, const G: usize>(block: &LaneBlock<G>, s: usize) -> [V; SUB / 4] {
    let w = SUB / 4 * s;
    // (Loads written out, not an array's closure: a closure takes no target features, and its intrinsics would
    // become calls.)
    // SAFETY: each entry is aligned to 64 bytes and holds G · 32; guaranteed by the caller.
    unsafe {
        [
            V::load(block.codes[w].as_ptr().cast()),
            V::load(block.codes[w + 1].as_ptr().cast()),
            V::load(block.codes[w + 2].as_ptr().cast()),
            V::load(block.codes[w + 3].as_ptr().cast()),
        ]
    }
}

/// Activation word c (codes 4c..4c + 4) of the sixteen at `x`.
///
/// # Safety
/// `x` points at 16 readable codes.
#[inline(always)]
unsafe fn x_word(x: *const i8, c: usize) -> i32 {
    // SAFETY: the caller's contract.
    unsafe { x.add(4 * c).cast::<i32>().read_unaligned() }
}

/// A sub-block's words and scales, with the offsets of 16-bit multipliers (zero with whole scales; a group's lanes
/// in AVX2 vectors).
struct GroupSub {
    words: [__m256i; SUB / 4],
    scales: __m256i,
    offsets: __m256i,
}

impl<D: IntDot> Q6Lanes for D {
    type Block = LaneBlock<1>;
    type Sub = GroupSub;
    /// Whole scales where D's products sum whole i32 lanes (AVX-VNNI's and AVX-512 VNNI's `vpdpbusd`), as with
    /// `Zmm`; 16-bit multipliers with AVX2's `madd`, whose running sums are 16-bit pair-sums. With AVX-VNNI's
    /// products on plain rows, against 16-bit multipliers, the whole sub-blocks' sums with `vpmulld` took 0.91-0.95
    /// / 0.87-0.91 / 0.85-0.91 of the time on Qwen2.5-Coder-1.5B's Q6_K matrices at T = 4 / 8 / 16 (2 threads,
    /// cold, two runs, a Sapphire Rapids class VM; thirty-eighth session), and the halves' sums since then 0.87 /
    /// 0.97 / 1.00 of theirs (one 1536 x 8960 matrix in cache, one thread; benches/RESULTS.md, thirty-ninth).
    const WHOLE_SCALES: bool = D::WHOLE_SUMS;

    #[inline(always)]
    fn sub_block(block: &LaneBlock<1>, s: usize) -> GroupSub {
        // SAFETY (each load): 32 bytes, 32-byte aligned; every kernel set here has AVX2.
        unsafe {
            GroupSub {
                words: sub_words(block, s),
                scales: __m256i::load(block.scales[s].as_ptr().cast()),
                // (Whole scales take their offsets from the activations; `decode` wrote none.)
                offsets: if D::WHOLE_SUMS {
                    _mm256_setzero_si256()
                } else {
                    _mm256_load_si256(block.offsets[s].as_ptr().cast())
                },
            }
        }
    }

    #[inline(always)]
    fn offset_inputs(q8: &Q8Rows) -> &[i32] {
        if D::WHOLE_SUMS {
            &q8.neg32_eight_sums
        } else {
            &q8.lane_sums
        }
    }

    #[inline(always)]
    unsafe fn add_sub_block(
        sums: &mut [__m256i; 2],
        sub: &GroupSub,
        x: *const i8,
        offsets: *const i32,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            if D::WHOLE_SUMS {
                // As `Zmm`'s.
                let mut halves = [
                    _mm256_set1_epi32(*offsets),
                    _mm256_set1_epi32(*offsets.add(1)),
                ];
                for (c, &w) in sub.words.iter().enumerate() {
                    halves[c / 2] =
                        D::add_products(halves[c / 2], w, _mm256_set1_epi32(x_word(x, c)));
                }
                for (sum, half) in sums.iter_mut().zip(halves) {
                    *sum = D::madd_into(*sum, half, sub.scales);
                }
                return;
            }
            for (c, &w) in sub.words.iter().enumerate() {
                sums[0] = D::scaled(sums[0], w, _mm256_set1_epi32(x_word(x, c)), sub.scales);
            }
            sums[0] = D::madd_into(sums[0], _mm256_set1_epi32(*offsets), sub.offsets);
        }
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

/// A sub-block's words and whole sub-scales (two groups' lanes in AVX-512 vectors).
struct WholeSub {
    words: [__m512i; SUB / 4],
    scales: __m512i,
}

impl<const MULLO: bool> Q6Lanes for Zmm<MULLO> {
    type Block = LaneBlock<2>;
    type Sub = WholeSub;
    /// Per sub-block and activation row: four `vpdpbusd`, two for each half from its -32 · Σx̂ (a broadcast
    /// load), then one `vpdpwssd` a half against the sub-scale in the low 16 bits of each lane, six operations
    /// where four `vpmaddubsw`, four `vpdpwssd` and a fifth for the offset were with 16-bit multipliers, and seven
    /// with a `vpmulld` (two operations; ~1 a cycle, against 2 for `vpdpwssd`) of the whole sub-block's sum.
    /// Every sum is exact: a half's |Σ (c - 32)·x̂| <= 8 · 32 · 127 < 2^15 (activation codes never -128: `q8`'s
    /// encoders clamp to ±127), so its i32 lane's low 16 bits are the sum and the high ones meet a zero multiplier;
    /// times |sc| <= 128. The whole sums with `vpmulld` had taken
    /// 0.94-0.99 / 0.91-0.96 / 0.94-0.96 / 0.93-0.94 of the 16-bit multipliers' time on Qwen2.5-Coder-1.5B's Q6_K
    /// matrices at T = 1 / 4 / 8 / 16 (2 threads, cold, two runs; benches/RESULTS.md, thirty-eighth session).
    ///
    /// `Zmm<true>` (AMD's cores, `whole_sub_sums`) sums each sub-block whole from its -32 · Σx̂ (the halves' two
    /// offsets added), four `vpdpbusd`, then multiplies it by its sign-extended sub-scale with one `vpmulld`:
    /// |Σ (c - 32)·x̂| <= 16 · 32 · 127, times |sc| <= 128, fits an i32, and the span's sum is the same integer. On
    /// Zen 4, where `vpmulld` is one operation, Qwen2.5-Coder-1.5B's Q6_K matrices took 1.04 / 1.20 / 1.26x as long
    /// by halves at T = 1 / 8 / 16 (2 threads, cold, one process; benches/RESULTS.md, forty-third session).
    const WHOLE_SCALES: bool = true;

    #[inline(always)]
    fn sub_block(block: &LaneBlock<2>, s: usize) -> WholeSub {
        // SAFETY (each load): 64 bytes, 64-byte aligned; the caller runs with AVX-512 F.
        unsafe {
            WholeSub {
                words: sub_words(block, s),
                scales: if MULLO {
                    _mm512_srai_epi32(
                        _mm512_slli_epi32(__m512i::load(block.scales[s].as_ptr().cast()), 16),
                        16,
                    )
                } else {
                    __m512i::load(block.scales[s].as_ptr().cast())
                },
            }
        }
    }

    #[inline(always)]
    fn offset_inputs(q8: &Q8Rows) -> &[i32] {
        &q8.neg32_eight_sums
    }

    #[inline(always)]
    unsafe fn add_sub_block(
        sums: &mut [__m512i; 2],
        sub: &WholeSub,
        x: *const i8,
        offsets: *const i32,
    ) {
        // SAFETY: the caller's contract; it runs with AVX-512 F and VNNI.
        unsafe {
            if MULLO {
                let mut whole = _mm512_set1_epi32(*offsets + *offsets.add(1));
                for (c, &w) in sub.words.iter().enumerate() {
                    whole = _mm512_dpbusd_epi32(whole, w, _mm512_set1_epi32(x_word(x, c)));
                }
                sums[0] = _mm512_add_epi32(sums[0], _mm512_mullo_epi32(whole, sub.scales));
                return;
            }
            let mut halves = [
                _mm512_set1_epi32(*offsets),
                _mm512_set1_epi32(*offsets.add(1)),
            ];
            for (c, &w) in sub.words.iter().enumerate() {
                halves[c / 2] =
                    _mm512_dpbusd_epi32(halves[c / 2], w, _mm512_set1_epi32(x_word(x, c)));
            }
            for (sum, half) in sums.iter_mut().zip(halves) {
                *sum = dpwssd(*sum, half, sub.scales);
            }
        }
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
    // Activation row t0's codes, span scales and sub-blocks' offset inputs; row t0 + r's are r rows further on.
    let row_offsets = subs * L::OFFSETS_PER_SUB;
    // SAFETY: `matmul` quantized t rows of k codes (spans scales and row_offsets offset inputs each), and t0 < t.
    let (codes, scales, offsets) = unsafe {
        (
            q8.codes.as_ptr().add(t0 * k),
            q8.scales.as_ptr().add(t0 * spans),
            L::offset_inputs(q8).as_ptr().add(t0 * row_offsets),
        )
    };
    // Each row's accumulator lives in y (touched once a span), leaving the registers to the span's sums.
    if bi == 0 {
        for out in y[..R].iter_mut() {
            *out = L::Out::default();
        }
    }
    // With few rows and 16-bit multipliers, each row's sub-blocks go into two chains (even and odd), so that one
    // chain's latency does not bound the span. (With whole scales the halves' sums are two chains already,
    // `Q6Lanes::add_sub_block`; splitting them again took 1.02x the time at T = 1, a 1536 x 8960 matrix in cache.)
    let chains = if R < 4 && !L::WHOLE_SCALES { 2 } else { 1 };
    for sp in 0..Q6K::BLOCK / Q6K::SPAN {
        let mut sums = [[[L::zero_int(); 2]; 2]; R];
        for s in sp * SPAN_SUBS..(sp + 1) * SPAN_SUBS {
            if t0 == 0 {
                ahead.part(bi, s, SUBS);
            }
            let sub = L::sub_block(block, s);
            for (r, sums) in sums.iter_mut().enumerate() {
                // SAFETY: sub-block bi · 16 + s of row t0 + r's k codes and its offset inputs; the caller runs
                // with L's features.
                unsafe {
                    let x = codes.add(r * k + bi * Q6K::BLOCK + SUB * s);
                    let at = r * row_offsets + (bi * SUBS + s) * L::OFFSETS_PER_SUB;
                    L::add_sub_block(&mut sums[s % chains], &sub, x, offsets.add(at));
                }
            }
        }
        for (r, [even, odd]) in sums.into_iter().enumerate() {
            // SAFETY: one scale per span and row; the caller runs with L's features.
            unsafe {
                let even = L::add(even[0], even[1]);
                let i = if chains == 2 {
                    L::add(even, L::add(odd[0], odd[1]))
                } else {
                    even
                };
                L::end_span(&mut y[r], i, block, *scales.add(r * spans + bi * 2 + sp));
            }
        }
    }
    R
}
