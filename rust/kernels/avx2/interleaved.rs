//! The AVX2 integer kernels of rows interleaved by eight (`interleave`: `QType::Q4_1X8`, `QType::Q4KX8`; those of
//! `QType::Q6KX8` are in `q6k_lanes`), for resident matrices: a group of eight weight rows is one linear stream,
//! and every 32-byte load gives the same word of the eight rows (lane r: row r), so their scales unpack once for
//! the eight and each row's products sum in its own lane, with nothing reduced across lanes. With AVX-512 VNNI,
//! Q4_1 takes two groups a call, one per half of a 512-bit vector (`wide_rows`); with AMX, Q4_K takes tiles over
//! two groups (`k_wide_rows`). Plain Q4_K rows (streamed layers) take the same kernel in passes of several
//! activation rows, each eight regrouped into the layout on the fly (`q4_k_plain`).
//!
//! Each gives the plain rows' kernel its bits. Per block (Q4_1) or span (Q4_K) and weight row, the plain kernel
//! reduces the products to exact integers, as these do (in another order, which integers do not see); the float
//! steps that follow are the same operations on the same values, lane by lane. A resident layer so computes what
//! the same layer streamed from disk (plain rows) computes.

use std::arch::x86_64::*;

use super::super::blocks::{self, Format, GROUP};
use super::super::q8::{PAIR_TILE_BYTES, PAIR_TILE_ROWS, PAIR_TOKENS};
use super::super::rows::{
    in_tiles, Activations, GroupKernel, Kernel, GROUP_ROWS, MAX_T, WIDE_ROWS,
};
use super::{
    amx, halves8, int_entries, prefetch, AvxVnni, IntDot, Madd, Prefetch, Products, Vnni,
    ROW_PREFETCH,
};

/// Q4_1: the plain rows' kernel is the group kernel `int_group_rows` (with AVX-512 VNNI `legacy_lanes::wide`, the
/// same steps), which reduces each block and weight row to one integer, Σ q·x̂ over its 32 codes; then acc +=
/// float(sum)·(d·dx), macc += m·Σx̂, and acc + macc at the end.
type Q4_1 = blocks::Q4_1;
/// Bytes of one block of a group's eight rows: word 0 (d and m) of each row, then words 1-4 (code bytes 0-15).
const GROUP_BLOCK: usize = GROUP_ROWS * Q4_1::BYTES;
/// Interleaved code words per block: word c holds code bytes 4c..4c + 4 of each row, whose low nibbles are the
/// block's elements 4c..4c + 4 and whose high nibbles are elements 16 + 4c..16 + 4c + 4.
const CODE_WORDS: usize = 4;

/// `pub fn $name(products: Products) -> Kernel`: `Kernel::Group($vector(products))`, or for the products that
/// match `$wide_products` the wide kernel `$wide` (no target features of its own, `#[inline(always)]`) compiled
/// inside an entry point with AVX-512 VNNI's features (which AMX's imply).
macro_rules! with_wide {
    ($(#[$doc:meta])* $name:ident => $vector:ident, $wide:path, $wide_products:pat) => {
        $(#[$doc])*
        pub fn $name(products: Products) -> Kernel {
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
            unsafe fn wide(a: &Activations, rows: &[u8], row_bytes: usize, y: &mut [[f32; WIDE_ROWS]; MAX_T]) {
                // SAFETY: the caller's contract is the body's, on a CPU with the products' features.
                unsafe { $wide(a, rows, row_bytes, y) }
            }

            if !matches!(products, $wide_products) {
                return Kernel::Group($vector(products));
            }
            // SAFETY: `matmul` asks for products only where `Products::available` says the CPU has their
            // features, and the wide products' include AVX-512 VNNI's.
            Kernel::Wide(|a, rows, row_bytes, y| unsafe { wide(a, rows, row_bytes, y) })
        }
    };
}
pub(super) use with_wide;

with_wide!(
    /// The integer kernel of interleaved Q4_1 rows (8-bit activations), with `products`: a group kernel of eight
    /// rows, or with AVX-512 VNNI's (or AMX's, which have no Q4_1 tiles) a wide one of sixteen (`wide_rows`).
    /// Call only if `products.available()`.
    q4_1_x8 => q4_1_x8_vector, wide_rows, Products::Avx512Vnni | Products::Amx
);

int_entries!(
    /// `q4_1_x8` with vector products on one group of eight rows.
    q4_1_x8_vector<> -> GroupKernel => rows(
        a: &Activations,
        group: &[u8],
        row_bytes: usize,
        y: &mut [[f32; GROUP_ROWS]; MAX_T]
    )
);

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
    let bases = [group.as_ptr(); 2];
    let ahead = Prefetch::after(group, a.k / GROUP);
    in_tiles!(a.t, y, |t0, out| tile::<D>(a, bases, ahead, t0, out));
}

/// Up to two interleaved groups of rows (`groups`: 8 or 16 rows), both at once in AVX-512 vectors (`Zmm`), in
/// tiles of up to 8 activation rows; y[t][j] for row j (`pair_bases`: a lone group is computed twice). Per
/// activation row and block, twice the rows an instruction of the eight-row kernel takes.
///
/// # Safety
/// `groups` must be whole groups; the caller runs with AVX-512 VNNI's features.
#[inline(always)]
unsafe fn wide_rows(
    a: &Activations,
    groups: &[u8],
    row_bytes: usize,
    y: &mut [[f32; WIDE_ROWS]; MAX_T],
) {
    debug_assert!(row_bytes == a.k / GROUP * Q4_1::BYTES);
    let bases = pair_bases(groups, row_bytes);
    let ahead = Prefetch::after(groups, a.k / GROUP);
    in_tiles!(a.t, y, |t0, out| tile::<Zmm>(a, bases, ahead, t0, out));
}

/// The first bytes of a wide call's two groups of rows (`groups`: one or two groups of eight rows of `row_bytes`):
/// a lone group twice, so that it is computed twice and its second copy's outputs are never stored.
fn pair_bases(groups: &[u8], row_bytes: usize) -> [*const u8; 2] {
    let group_bytes = GROUP_ROWS * row_bytes;
    debug_assert!(groups.len() == group_bytes || groups.len() == 2 * group_bytes);
    [
        groups.as_ptr(),
        groups[groups.len() - group_bytes..].as_ptr(),
    ]
}

/// The vectors of the kernels that keep one weight row per 32-bit lane (Q4_1's and Q4_K's interleaved rows, Q6_K's
/// decoded ones, the legacy formats' transposed plain rows in `legacy_lanes`): one group's eight rows in AVX2 vectors
/// with D's products (any `IntDot` D), or two groups' sixteen in AVX-512 vectors with VNNI's (`Zmm`, lanes 8-15 the
/// second group's rows). Each kernel's steps are the same operations lane by lane in both, so both give the plain rows'
/// bits.
pub(super) trait Lanes {
    type Int: Copy;
    type Float: Copy;
    /// One activation row's outputs, a float per lane.
    type Out: Default;
    #[inline(always)]
    fn zero_int() -> Self::Int {
        // SAFETY: a SIMD vector of integers: any bits are a value.
        unsafe { std::mem::zeroed() }
    }
    #[inline(always)]
    fn zero_float() -> Self::Float {
        // SAFETY: a SIMD vector of floats: any bits are a value (zeros are 0.0).
        unsafe { std::mem::zeroed() }
    }
    /// The interleaved code word at byte `at` of each group (`bases`) as (low nibbles, high nibbles).
    unsafe fn nibbles(bases: [*const u8; 2], at: usize) -> (Self::Int, Self::Int);
    /// `sum` + the products of codes `w` with the four activation bytes `x` in every lane (`IntDot::add_products`'
    /// running form).
    unsafe fn add_products(sum: Self::Int, w: Self::Int, x: i32) -> Self::Int;
    /// Two running sums as one (`IntDot::add_sums`).
    unsafe fn add_sums(a: Self::Int, b: Self::Int) -> Self::Int;
}

impl<D: IntDot> Lanes for D {
    type Int = __m256i;
    type Float = __m256;
    type Out = [f32; GROUP_ROWS];

    #[inline(always)]
    unsafe fn nibbles(bases: [*const u8; 2], at: usize) -> (__m256i, __m256i) {
        // SAFETY: the caller's word is inside its block.
        let word = unsafe { _mm256_loadu_si256(bases[0].add(at).cast()) };
        let low = _mm256_set1_epi8(0x0F);
        (
            _mm256_and_si256(word, low),
            _mm256_and_si256(_mm256_srli_epi16(word, 4), low),
        )
    }

    #[inline(always)]
    unsafe fn add_products(sum: __m256i, w: __m256i, x: i32) -> __m256i {
        // SAFETY: the caller runs with D's features.
        unsafe { D::add_products(sum, w, _mm256_set1_epi32(x)) }
    }

    #[inline(always)]
    unsafe fn add_sums(a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: the caller runs with D's features.
        unsafe { D::add_sums(a, b) }
    }
}

/// Two groups of eight rows in AVX-512 vectors with AVX-512 VNNI's products (`Lanes`). MULLO is how Q6_K's lanes
/// scale a sub-block's sum (`q6k_lanes`, `Q6Lanes for Zmm`): whole with `vpmulld` (true), or by halves with
/// `vpdpwssd`; the other kernels take `Zmm<false>`.
pub(super) struct Zmm<const MULLO: bool = false>;

impl Zmm {
    /// The interleaved code word at byte `at` of each group (`bases`): the first group's rows in lanes 0-7.
    ///
    /// # Safety
    /// Both words must be readable; the caller runs with AVX-512 F.
    #[inline(always)]
    unsafe fn word(bases: [*const u8; 2], at: usize) -> __m512i {
        // SAFETY: guaranteed by the caller.
        unsafe {
            join_si(
                _mm256_loadu_si256(bases[0].add(at).cast()),
                _mm256_loadu_si256(bases[1].add(at).cast()),
            )
        }
    }
}

impl<const MULLO: bool> Lanes for Zmm<MULLO> {
    type Int = __m512i;
    type Float = __m512;
    type Out = [f32; WIDE_ROWS];

    #[inline(always)]
    unsafe fn nibbles(bases: [*const u8; 2], at: usize) -> (__m512i, __m512i) {
        // SAFETY: the caller's words are inside their blocks, and it runs with AVX-512 F and BW.
        unsafe {
            let word = Zmm::word(bases, at);
            let low = _mm512_set1_epi8(0x0F);
            (
                _mm512_and_si512(word, low),
                _mm512_and_si512(_mm512_srli_epi16(word, 4), low),
            )
        }
    }

    #[inline(always)]
    unsafe fn add_products(sum: __m512i, w: __m512i, x: i32) -> __m512i {
        // SAFETY: the caller runs with AVX-512 VNNI.
        unsafe { _mm512_dpbusd_epi32(sum, w, _mm512_set1_epi32(x)) }
    }

    #[inline(always)]
    unsafe fn add_sums(a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: the caller runs with AVX-512 F.
        unsafe { _mm512_add_epi32(a, b) }
    }
}

/// The float steps of a legacy format's blocks in the lanes of `Lanes` (Q4_1's interleaved rows here, every legacy
/// format's plain rows transposed into lanes in `legacy_lanes`), the plain rows' group kernel's: per block and
/// activation row acc + float(sum)·(d·dx) and macc + m·sx, then acc + macc, lane by lane.
pub(super) trait LegacyLanes: Lanes {
    /// A running sum of `add_products` as i32 lanes (`IntDot::widen`).
    unsafe fn widen(sum: Self::Int) -> Self::Int;
    /// acc + float(sum)·(d·dx), lane by lane (`sum`: i32 lanes).
    unsafe fn add_scaled(acc: Self::Float, sum: Self::Int, d: Self::Float, dx: f32) -> Self::Float;
    /// macc + m·sx, lane by lane.
    unsafe fn add_offset(macc: Self::Float, m: Self::Float, sx: f32) -> Self::Float;
    /// acc + macc into `out`.
    unsafe fn store(acc: Self::Float, macc: Self::Float, out: &mut Self::Out);
}

impl<D: IntDot> LegacyLanes for D {
    #[inline(always)]
    unsafe fn widen(sum: __m256i) -> __m256i {
        // SAFETY: the caller runs with D's features.
        unsafe { D::widen(sum) }
    }

    #[inline(always)]
    unsafe fn add_scaled(acc: __m256, sum: __m256i, d: __m256, dx: f32) -> __m256 {
        _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(sum),
            _mm256_mul_ps(d, _mm256_set1_ps(dx)),
            acc,
        )
    }

    #[inline(always)]
    unsafe fn add_offset(macc: __m256, m: __m256, sx: f32) -> __m256 {
        _mm256_fmadd_ps(m, _mm256_set1_ps(sx), macc)
    }

    #[inline(always)]
    unsafe fn store(acc: __m256, macc: __m256, out: &mut [f32; GROUP_ROWS]) {
        // SAFETY: `out` holds a float per lane.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(acc, macc)) }
    }
}

impl LegacyLanes for Zmm {
    #[inline(always)]
    unsafe fn widen(sum: __m512i) -> __m512i {
        sum
    }

    #[inline(always)]
    unsafe fn add_scaled(acc: __m512, sum: __m512i, d: __m512, dx: f32) -> __m512 {
        // SAFETY: the caller runs with AVX-512 F.
        unsafe {
            _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(sum),
                _mm512_mul_ps(d, _mm512_set1_ps(dx)),
                acc,
            )
        }
    }

    #[inline(always)]
    unsafe fn add_offset(macc: __m512, m: __m512, sx: f32) -> __m512 {
        // SAFETY: the caller runs with AVX-512 F.
        unsafe { _mm512_fmadd_ps(m, _mm512_set1_ps(sx), macc) }
    }

    #[inline(always)]
    unsafe fn store(acc: __m512, macc: __m512, out: &mut [f32; WIDE_ROWS]) {
        // SAFETY: `out` holds a float per lane; the caller runs with AVX-512 F.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(acc, macc)) }
    }
}

/// The scales of Q4_1's interleaved blocks in the lanes of `Lanes`.
trait Q4_1Lanes: LegacyLanes {
    /// (d, m) of each lane's row: word 0 of the block at byte `at` of each group (`bases`).
    unsafe fn scales(bases: [*const u8; 2], at: usize) -> (Self::Float, Self::Float);
}

impl<D: IntDot> Q4_1Lanes for D {
    #[inline(always)]
    unsafe fn scales(bases: [*const u8; 2], at: usize) -> (__m256, __m256) {
        // SAFETY: the caller's block is whole.
        halves8(unsafe { _mm256_loadu_si256(bases[0].add(at).cast()) })
    }
}

impl Q4_1Lanes for Zmm {
    #[inline(always)]
    unsafe fn scales(bases: [*const u8; 2], at: usize) -> (__m512, __m512) {
        // SAFETY: the caller's blocks are whole.
        let (d0, m0) = halves8(unsafe { _mm256_loadu_si256(bases[0].add(at).cast()) });
        let (d1, m1) = halves8(unsafe { _mm256_loadu_si256(bases[1].add(at).cast()) });
        // SAFETY: the caller runs with AVX-512 F.
        unsafe { (join_ps(d0, d1), join_ps(m0, m1)) }
    }
}

/// y[0..R] (a float per lane of L: its weight rows) for activation rows t0..t0 + R; returns R.
///
/// # Safety
/// `bases` must point at whole groups of `a.k / 32` blocks; t0 + R <= a.t; the caller runs with L's features.
#[inline(always)]
unsafe fn tile<L: Q4_1Lanes, const R: usize>(
    a: &Activations,
    bases: [*const u8; 2],
    ahead: Prefetch,
    t0: usize,
    y: &mut [L::Out],
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
    let mut acc = [L::zero_float(); R];
    let mut macc = [L::zero_float(); R];
    // The first tile of a call reads the next call's groups (`ahead`: the rows that follow these in a task) into
    // cache as it reads its own, block for block; past a matrix's end the hint lands on other bytes, which is
    // harmless. Resident SmolLM2's kernel pass (Sapphire Rapids class VM, in huge pages, three alternating
    // processes each) ran 9.1-10.7 / 13.8-14.5 / 17.8-20.8 ms at T = 1 / 8 / 16 with it, 10.8-11.0 / 16.3-17.4 /
    // 22.1-23.1 without; with AVX2's products 9.6-9.8 / 16.8-18.4 / 29.2-32.1 against 11.2-11.7 / 20.3-21.6 /
    // 30.1-33.9. Prefetching 2 KB ahead of each group's own stream, or two calls ahead, did as well.
    for bi in 0..gs {
        let block = bi * GROUP_BLOCK;
        if t0 == 0 {
            ahead.block(bi);
        }
        // SAFETY (both): block bi of each group is inside it (the caller's contract).
        let (d, m) = unsafe { L::scales(bases, block) };
        // One code word at a time, met by the R activation rows in turn: 2R independent running sums (each
        // row's low-nibble products and its high-nibble ones, added at the block's end), each a chain of four
        // products, which the CPU overlaps (row by row, one chain of eight waited on the last; one chain of
        // eight per row took 1.06-1.08x as long at T = 8 to 32, one thread on 4096 rows in L2 cache).
        let mut int_sums = [[L::zero_int(); R]; 2];
        for c in 0..CODE_WORDS {
            // Elements 4c..4c + 4 of each row (low nibbles), then 16 + 4c.. (high).
            let (low, high) = unsafe { L::nibbles(bases, block + 32 * (1 + c)) };
            for (h, (w, at)) in [(low, 4 * c), (high, 16 + 4 * c)].into_iter().enumerate() {
                for (r, sum) in int_sums[h].iter_mut().enumerate() {
                    // The activation bytes this code vector meets, in every lane.
                    // SAFETY: group bi of activation row t0 + r holds 32 codes.
                    let x = unsafe {
                        codes
                            .add((r * gs + bi) * GROUP + at)
                            .cast::<i32>()
                            .read_unaligned()
                    };
                    // SAFETY: the caller runs with L's features.
                    *sum = unsafe { L::add_products(*sum, w, x) };
                }
            }
        }
        for r in 0..R {
            // SAFETY: as for the codes; one scale and sum per group (Q4_1's span is a group). The caller runs
            // with L's features.
            unsafe {
                let sum = L::widen(L::add_sums(int_sums[0][r], int_sums[1][r]));
                let (dx, sx) = (*scales.add(r * gs + bi), *sums.add(r * gs + bi));
                acc[r] = L::add_scaled(acc[r], sum, d, dx);
                macc[r] = L::add_offset(macc[r], m, sx);
            }
        }
    }
    for r in 0..R {
        // SAFETY: the caller runs with L's features.
        unsafe { L::store(acc[r], macc[r], &mut y[r]) };
    }
    R
}

/// Q4_K: the plain rows' kernel is the row kernel `int_row` with `SuperBlock::SPAN_TOTALS`: per span of 128
/// elements (4 groups) and weight row, I = Σ sc·Σ q·x̂ and M = Σ mn·Σ x̂ as exact integers, then acc +=
/// float(I)·(d·dx) and acc += float(M)·(-dmin·dx). Here a group's Σ q·x̂ is an i32 lane and I is summed in
/// float32 (convert, then an FMA by sc per group), exact as the plain kernel's integer: every partial sum is an
/// integer below 2^24 (`SPAN_TOTALS`).
type Q4K = blocks::Q4K;
/// Bytes of one block of a group's eight rows: word 0 (d and dmin), words 1-3 (the 12 packed scale bytes), words
/// 4-35 (code bytes 0-127: word 4 + 8h + c holds bytes 32h + 4c.. of each row, whose low nibbles are elements
/// 4c..4c + 4 of group 2h and whose high nibbles are those of group 2h + 1).
const K_GROUP_BLOCK: usize = GROUP_ROWS * Q4K::BYTES;
/// Groups of 32 per span.
const K_SPAN_GROUPS: usize = Q4K::SPAN / GROUP;

with_wide!(
    /// The integer kernel of interleaved Q4_K rows (8-bit activations), with `products`: a group kernel, or
    /// with AVX-512 VNNI's or AMX's a wide one of sixteen rows (`k_wide_rows`: AVX-512 vectors, or AMX tiles in
    /// passes of at least Q4K_TILE_MIN_ROWS activation rows). Call only if `products.available()`.
    q4_k_x8 => q4_k_x8_vector, x8_groups::<TwoGroups, WIDE_ROWS>, Products::Avx512Vnni | Products::Amx
);

with_wide!(
    /// The integer kernel of plain Q4_K rows (as read from the file; 8-bit activations), with `products`:
    /// passes of at least REGROUP_ROWS activation rows interleave each whole group of eight weight rows into
    /// scratch (`regroup`) and compute them as `q4_k_x8` does; shorter passes, and groups of fewer rows, run the
    /// row kernel (`int_row`). Both give the same bits (`SuperBlock::SPAN_TOTALS`). Call only if
    /// `products.available()`.
    q4_k_plain => q4_k_plain_vector, k_plain_rows::<Vnni, TwoGroups, WIDE_ROWS>, Products::Avx512Vnni | Products::Amx
);

int_entries!(
    /// `q4_k_x8` with vector products.
    q4_k_x8_vector<> -> GroupKernel => x8_rows_vector(
        a: &Activations,
        group: &[u8],
        row_bytes: usize,
        y: &mut [[f32; GROUP_ROWS]; MAX_T]
    )
);

int_entries!(
    /// `q4_k_plain` with vector products.
    q4_k_plain_vector<> -> GroupKernel => k_plain_rows_vector(
        a: &Activations,
        rows: &[u8],
        row_bytes: usize,
        y: &mut [[f32; GROUP_ROWS]; MAX_T]
    )
);

/// Activation rows from which a pass over plain Q4_K rows regroups them (`q4_k_plain`). Measured on Qwen2.5-Coder-
/// 1.5B's Q4_K matrices (Cascade Lake, 2 threads, against the row kernel): regrouped 0.8x at T = 1, about even at
/// T = 2 and 3, 1.5-1.6x at T = 8 (benches/RESULTS.md, nineteenth session).
const REGROUP_ROWS: usize = 2;

thread_local! {
    /// Each kernel thread's scratch for the regrouped groups of one call (`k_plain_rows`).
    static REGROUPED: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// `k_plain_rows` with vector products.
///
/// # Safety
/// The caller runs with D's features.
#[inline(always)]
unsafe fn k_plain_rows_vector<D: IntDot>(
    a: &Activations,
    rows: &[u8],
    row_bytes: usize,
    y: &mut [[f32; GROUP_ROWS]; MAX_T],
) {
    // SAFETY: the caller's contract.
    unsafe { k_plain_rows::<D, D, GROUP_ROWS>(a, rows, row_bytes, y) }
}

/// `count` (1 to W) plain Q4_K rows (`rows`: count · row_bytes bytes), whole groups of eight in the layout's
/// kernel K, or row by row (`int_row` with D's products); y[t][j] for row j.
///
/// # Safety
/// The caller runs with D's and K's features.
#[inline(always)]
unsafe fn k_plain_rows<D: IntDot, K: KGroups<W>, const W: usize>(
    a: &Activations,
    rows: &[u8],
    row_bytes: usize,
    y: &mut [[f32; W]; MAX_T],
) {
    let count = rows.len() / row_bytes;
    if count % GROUP_ROWS == 0 && a.t >= REGROUP_ROWS {
        let group_bytes = GROUP_ROWS * row_bytes;
        let mut mixed = REGROUPED.take();
        mixed.resize(rows.len(), 0);
        for (rows, mixed) in rows
            .chunks_exact(group_bytes)
            .zip(mixed.chunks_exact_mut(group_bytes))
        {
            // SAFETY: the caller runs with D's features, which include AVX2; `mixed` has the rows' size.
            unsafe { regroup(rows, row_bytes, mixed) };
        }
        // SAFETY: the caller's contract; `mixed` holds whole groups. Its products prefetch the rows after `rows`.
        unsafe {
            K::groups(
                a,
                &mixed,
                row_bytes,
                Prefetch::after(rows, a.k / Q4K::BLOCK),
                y,
            )
        };
        REGROUPED.set(mixed);
        return;
    }
    let mut column = [0f32; MAX_T];
    for (j, row) in rows.chunks_exact(row_bytes).enumerate() {
        // SAFETY: the caller runs with D's features; `row` is one whole row (`matmul` checked the sizes).
        unsafe { super::int_row::<Q4K, D>(a, row, &mut column) };
        for (y, v) in y.iter_mut().zip(&column[..a.t]) {
            y[j] = *v;
        }
    }
}

/// 16 bytes of row r (low half) and of row r + 4 (high half), from `at` (row r's bytes) and `at` + 4 · row_bytes.
///
/// # Safety
/// Both 16-byte runs must be readable; the caller runs with AVX2.
#[inline(always)]
unsafe fn row_pair(at: *const u8, row_bytes: usize, r: usize) -> __m256i {
    // SAFETY: guaranteed by the caller.
    unsafe {
        _mm256_set_m128i(
            _mm_loadu_si128(at.add((r + 4) * row_bytes).cast()),
            _mm_loadu_si128(at.add(r * row_bytes).cast()),
        )
    }
}

/// Eight plain rows (`rows`: 8 · row_bytes bytes, row_bytes a multiple of 16) into `out` (as many bytes) in the
/// interleaved layout (`interleave`): word w of row r at byte 32w + 4r, whatever the block size (a group's block
/// holds its rows' words in order), four words at a time (`words4`).
///
/// # Safety
/// The caller runs with AVX2; the sizes are as above.
#[inline(always)]
unsafe fn regroup(rows: &[u8], row_bytes: usize, out: &mut [u8]) {
    debug_assert!(
        row_bytes % 16 == 0 && rows.len() == GROUP_ROWS * row_bytes && out.len() == rows.len()
    );
    let (src, dst) = (rows.as_ptr(), out.as_mut_ptr());
    for at in (0..row_bytes).step_by(16) {
        // The eight rows are eight streams, which the hardware prefetchers follow poorly (`int_group_rows`' note):
        // the next group's bytes (the next eight rows, one run), as fast as this group's are read.
        prefetch(
            src.wrapping_add(GROUP_ROWS * (row_bytes + at)),
            GROUP_ROWS * 16,
        );
        // SAFETY: bytes at..at + 16 of each of the eight rows, and 128 bytes from 8·at of `out`, are inside.
        unsafe {
            for (w, v) in words4(src.add(at), row_bytes).into_iter().enumerate() {
                _mm256_storeu_si256(dst.add(8 * at + 32 * w).cast(), v);
            }
        }
    }
}

/// Words 0-3 (16 bytes) of eight rows `stride` bytes apart from `at`, transposed: vector w holds word w of row r
/// in lane r. A 4 x 4 transpose of 32-bit words in each 128-bit half (rows 0-3 in the low halves, 4-7 in the high
/// ones).
///
/// # Safety
/// The eight runs of 16 bytes are readable; the caller runs with AVX2.
#[inline(always)]
pub(super) unsafe fn words4(at: *const u8, stride: usize) -> [__m256i; 4] {
    // SAFETY: the caller's contract.
    let (p0, p1, p2, p3) = unsafe {
        (
            row_pair(at, stride, 0),
            row_pair(at, stride, 1),
            row_pair(at, stride, 2),
            row_pair(at, stride, 3),
        )
    };
    // Words 0-1 and 2-3 of rows (0, 1) and (2, 3), then each word of the four rows (in both halves).
    let (t0, t1) = (_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1));
    let (t2, t3) = (_mm256_unpacklo_epi32(p2, p3), _mm256_unpackhi_epi32(p2, p3));
    [
        _mm256_unpacklo_epi64(t0, t2),
        _mm256_unpackhi_epi64(t0, t2),
        _mm256_unpacklo_epi64(t1, t3),
        _mm256_unpackhi_epi64(t1, t3),
    ]
}

/// Whole interleaved groups of Q4_K rows (a resident matrix's: W / 8 groups, or fewer at its end) through K, whose
/// products prefetch the rows after them (the next call's); y[t][j] for row j.
///
/// # Safety
/// As `KGroups::groups`.
#[inline(always)]
unsafe fn x8_groups<K: KGroups<W>, const W: usize>(
    a: &Activations,
    groups: &[u8],
    row_bytes: usize,
    y: &mut [[f32; W]; MAX_T],
) {
    // SAFETY: the caller's contract.
    unsafe {
        K::groups(
            a,
            groups,
            row_bytes,
            Prefetch::after(groups, a.k / Q4K::BLOCK),
            y,
        )
    }
}

/// `x8_groups` on one group with D's vector products.
///
/// # Safety
/// As `KGroups::groups`, with D's features.
#[inline(always)]
unsafe fn x8_rows_vector<D: IntDot>(
    a: &Activations,
    group: &[u8],
    row_bytes: usize,
    y: &mut [[f32; GROUP_ROWS]; MAX_T],
) {
    // SAFETY: the caller's contract.
    unsafe { x8_groups::<D, GROUP_ROWS>(a, group, row_bytes, y) }
}

/// One interleaved group of eight Q4_K rows (`group`: 8 · row_bytes bytes, row_bytes = k / 256 · 144), in tiles
/// of up to 8 activation rows (`in_tiles`), prefetching `ahead`; y[t][r] for row r.
///
/// # Safety
/// `group` must be one whole group; the caller runs with D's features.
#[inline(always)]
unsafe fn k_rows<D: IntDot>(
    a: &Activations,
    group: &[u8],
    row_bytes: usize,
    ahead: Prefetch,
    y: &mut [[f32; GROUP_ROWS]; MAX_T],
) {
    debug_assert!(
        group.len() == GROUP_ROWS * row_bytes && row_bytes == a.k / Q4K::BLOCK * Q4K::BYTES
    );
    let bases = [group.as_ptr(); 2];
    in_tiles!(a.t, y, |t0, out| k_tile::<D>(a, bases, ahead, t0, out));
}

/// Word `w` of an interleaved block at `block`: the eight rows' word w, lane r for row r.
///
/// # Safety
/// The block must have 32 · (w + 1) readable bytes; the caller runs with AVX2.
#[inline(always)]
unsafe fn word(block: *const u8, w: usize) -> __m256i {
    // SAFETY: guaranteed by the caller.
    unsafe { _mm256_loadu_si256(block.add(32 * w).cast()) }
}

/// A `pshufb` index byte that gives zero.
const ZERO: u8 = 0x80;

/// `pshufb` indices (`_mm256_shuffle_epi8`) that give byte b of each 32-bit lane its lane's byte pick[b] (0..4), or
/// zero for ZERO.
///
/// # Safety
/// The caller runs with AVX2.
#[inline(always)]
pub(super) unsafe fn lane_bytes(pick: [u8; 4]) -> __m256i {
    // Index bytes count from each 128-bit half's start: lane i's bytes are 4i.. (ZERO + 12 keeps bit 7).
    let lanes = _mm256_setr_epi32(
        0,
        0x0404_0404,
        0x0808_0808,
        0x0C0C_0C0C,
        0,
        0x0404_0404,
        0x0808_0808,
        0x0C0C_0C0C,
    );
    _mm256_add_epi8(_mm256_set1_epi32(u32::from_le_bytes(pick) as i32), lanes)
}

/// Byte `i` (0..4) of every i32 lane of `v`, zero-extended.
///
/// # Safety
/// The caller runs with AVX2.
#[inline(always)]
unsafe fn byte_lanes(v: __m256i, i: usize) -> __m256i {
    // SAFETY (both intrinsics): guaranteed by the caller.
    unsafe {
        _mm256_and_si256(
            _mm256_srl_epi32(v, _mm_cvtsi32_si128(8 * i as i32)),
            _mm256_set1_epi32(0xFF),
        )
    }
}

/// The scales of an interleaved Q4_K block's eight rows, lane r for row r.
struct BlockScales {
    d: __m256,
    neg_dmin: __m256,
    /// The 6-bit sub-scales of groups 0-3 and 4-7, one byte each per lane.
    sc: [__m256i; 2],
    /// The 6-bit offset multipliers of groups 0-3 and 4-7, one byte each per lane.
    mn: [__m256i; 2],
}

impl BlockScales {
    /// Words 0-3 of the block at `block` unpacked (as `blocks::k_scales`, on all eight rows at once): for groups
    /// 4-7 bits 6-7 of the first bytes become bits 4-5.
    ///
    /// # Safety
    /// The block must have 128 readable bytes; the caller runs with AVX2.
    #[inline(always)]
    unsafe fn of(block: *const u8) -> BlockScales {
        const LOW6: i32 = 0x3F3F_3F3F;
        const LOW4: i32 = 0x0F0F_0F0F;
        const TOP2: i32 = 0x3030_3030; // bits 6-7 of each byte, shifted right by 2
                                       // SAFETY (every `word`): words 0..4 of the block; the caller runs with AVX2.
        unsafe {
            let (d, dmin) = halves8(word(block, 0));
            let (s0, s1, s2) = (word(block, 1), word(block, 2), word(block, 3));
            let top2 = _mm256_set1_epi32(TOP2);
            BlockScales {
                d,
                neg_dmin: _mm256_xor_ps(dmin, _mm256_set1_ps(-0.0)),
                sc: [
                    _mm256_and_si256(s0, _mm256_set1_epi32(LOW6)),
                    _mm256_or_si256(
                        _mm256_and_si256(s2, _mm256_set1_epi32(LOW4)),
                        _mm256_and_si256(_mm256_srli_epi32(s0, 2), top2),
                    ),
                ],
                mn: [
                    _mm256_and_si256(s1, _mm256_set1_epi32(LOW6)),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi32(s2, 4), _mm256_set1_epi32(LOW4)),
                        _mm256_and_si256(_mm256_srli_epi32(s1, 2), top2),
                    ),
                ],
            }
        }
    }

    /// Group g's sub-scales as float lanes.
    ///
    /// # Safety
    /// The caller runs with AVX2.
    #[inline(always)]
    unsafe fn scale(&self, g: usize) -> __m256 {
        // SAFETY: guaranteed by the caller.
        _mm256_cvtepi32_ps(unsafe { byte_lanes(self.sc[g / 4], g % 4) })
    }

    /// The offset multipliers of groups 2p and 2p + 1 in the low and high 16 bits of each lane (`madd`'s pairs,
    /// against `Q8Rows::code_sum_pairs`).
    ///
    /// # Safety
    /// The caller runs with AVX2.
    #[inline(always)]
    unsafe fn mn_pair(&self, p: usize) -> __m256i {
        // Bytes 2(p % 2) and 2(p % 2) + 1 of each lane to bytes 0 and 2, zeros elsewhere.
        let from = 2 * (p % 2) as u8;
        // SAFETY: guaranteed by the caller.
        unsafe { _mm256_shuffle_epi8(self.mn[p / 2], lane_bytes([from, ZERO, from + 1, ZERO])) }
    }
}

/// The 8-bit activations of a call from row t0 on, in Q4_K's spans: row t0 + r's codes, scales (one per span)
/// and integer group sums start r rows on.
struct SpanRows {
    codes: *const i8,
    scales: *const f32,
    code_sums: *const i32,
    code_sum_pairs: *const i32,
    spans: usize,
    groups: usize,
}

impl SpanRows {
    /// # Safety
    /// t0 < a.t.
    #[inline(always)]
    unsafe fn from(a: &Activations, t0: usize) -> SpanRows {
        let q8 = a.q8_for(Q4K::SPAN);
        let (spans, groups) = (a.k / Q4K::SPAN, a.k / GROUP);
        // SAFETY: `matmul` quantized t rows of k codes (spans scales, groups sums each), and t0 < t.
        unsafe {
            SpanRows {
                codes: q8.codes.as_ptr().add(t0 * a.k),
                scales: q8.scales.as_ptr().add(t0 * spans),
                code_sums: q8.code_sums.as_ptr().add(t0 * groups),
                code_sum_pairs: q8.code_sum_pairs.as_ptr().add(t0 * groups / 2),
                spans,
                groups,
            }
        }
    }

    /// Row r's outputs after span sp of block bi: out += total·(d·dx) then M·(-dmin·dx), with total = Σ sc·Σ
    /// q·x̂ over the span's groups (exact integers in float32), M = Σ mn·Σ x̂ from the row's integer group sums
    /// (two groups to a `madd`: `Q8Rows::code_sum_pairs` against `BlockScales::mn_pair`), dx the row's scale for
    /// the span.
    ///
    /// # Safety
    /// Row t0 + r and block bi exist; the caller runs with L's features.
    #[inline(always)]
    unsafe fn end_span<L: KLanes>(
        &self,
        block: &KScales<L>,
        out: &mut L::Out,
        total: L::Float,
        (r, bi, sp): (usize, usize, usize),
    ) {
        // SAFETY: the caller's contract: one scale per span and row, 8 group sums per block and row.
        unsafe {
            let dx = L::set1_ps(*self.scales.add(r * self.spans + bi * 2 + sp));
            let pairs = self
                .code_sum_pairs
                .add((r * self.groups + bi * 8 + sp * K_SPAN_GROUPS) / 2);
            let acc = L::fmadd(total, L::mul(block.d, dx), L::load(out));
            let mut m = L::zero_int();
            for p in 0..K_SPAN_GROUPS / 2 {
                m = L::madd_into(m, *pairs.add(p), block.mn[sp * K_SPAN_GROUPS / 2 + p]);
            }
            L::store(out, L::fmadd(L::cvt(m), L::mul(block.neg_dmin, dx), acc));
        }
    }
}

/// A block's scales in the lanes of L, unpacked once for all activation rows: d, -dmin, each group's sub-scale (as
/// floats, the high groups' divided by 16 where `KLanes::code_words` gives their codes times 16) and each pair of
/// groups' offset multipliers mn (`BlockScales::mn_pair`).
struct KScales<L: KLanes> {
    d: L::Float,
    neg_dmin: L::Float,
    scale: [L::Float; Q4K::BLOCK / GROUP],
    mn: [L::Int; Q4K::BLOCK / GROUP / 2],
}

/// A Q4_K tile's steps in the lanes of `Lanes`: the integer sums and float steps of the plain rows' kernel.
trait KLanes: Lanes + Sized {
    /// The scales of the blocks at `blocks` (the same block of each group), those of the high groups (odd g)
    /// divided by 16 where `code_words` gives their codes times 16.
    unsafe fn scales(blocks: [*const u8; 2]) -> KScales<Self>;
    /// The interleaved code word at byte `at` of each group (`bases`) as (low nibbles, high nibbles). Where the
    /// running sums are whole i32 lanes (VNNI's), the high nibbles come as 16 times their codes, the byte's top
    /// four bits in place: one `and` where a shift and an `and` would be (products up to 240 · 127, far from any
    /// bound). Then float(16 · Σ q·x̂)·(sc / 16) is the exact integer sc·Σ q·x̂ that float(Σ q·x̂)·sc is, so an
    /// FMA of it gives the same bits.
    unsafe fn code_words(bases: [*const u8; 2], at: usize) -> (Self::Int, Self::Int);
    /// total + float(sum)·scale, with `sum` the running sums `sums[..chains]` added as i32 lanes.
    unsafe fn add_scaled(
        total: Self::Float,
        sums: [Self::Int; 2],
        chains: usize,
        scale: Self::Float,
    ) -> Self::Float;
    /// acc + the 16-bit halves of x (in every lane) times those of `mv`, both pairs added (`madd`).
    unsafe fn madd_into(acc: Self::Int, x: i32, mv: Self::Int) -> Self::Int;
    unsafe fn cvt(v: Self::Int) -> Self::Float;
    unsafe fn fmadd(a: Self::Float, b: Self::Float, c: Self::Float) -> Self::Float;
    unsafe fn mul(a: Self::Float, b: Self::Float) -> Self::Float;
    unsafe fn set1_ps(v: f32) -> Self::Float;
    unsafe fn load(out: &Self::Out) -> Self::Float;
    unsafe fn store(out: &mut Self::Out, v: Self::Float);
}

impl<D: IntDot> KLanes for D {
    #[inline(always)]
    unsafe fn scales(blocks: [*const u8; 2]) -> KScales<D> {
        // SAFETY: the caller's block is whole and it runs with D's features.
        unsafe {
            let s = BlockScales::of(blocks[0]);
            let mut scales = KScales {
                d: s.d,
                neg_dmin: s.neg_dmin,
                scale: [_mm256_setzero_ps(); Q4K::BLOCK / GROUP],
                mn: [_mm256_setzero_si256(); Q4K::BLOCK / GROUP / 2],
            };
            // (Loops, not closures: a closure takes no target features, and its intrinsics would become calls.)
            for g in 0..Q4K::BLOCK / GROUP {
                scales.scale[g] = s.scale(g);
                if D::WHOLE_SUMS && g % 2 == 1 {
                    scales.scale[g] = _mm256_mul_ps(scales.scale[g], _mm256_set1_ps(1.0 / 16.0));
                }
            }
            for p in 0..Q4K::BLOCK / GROUP / 2 {
                scales.mn[p] = s.mn_pair(p);
            }
            scales
        }
    }

    #[inline(always)]
    unsafe fn add_scaled(
        total: __m256,
        [even, odd]: [__m256i; 2],
        chains: usize,
        scale: __m256,
    ) -> __m256 {
        // SAFETY: the caller runs with D's features.
        let sum = unsafe {
            if chains == 2 {
                _mm256_add_epi32(D::widen(even), D::widen(odd))
            } else {
                D::widen(even)
            }
        };
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, total)
    }

    #[inline(always)]
    unsafe fn code_words(bases: [*const u8; 2], at: usize) -> (__m256i, __m256i) {
        if !D::WHOLE_SUMS {
            // SAFETY: the caller's contract.
            return unsafe { D::nibbles(bases, at) };
        }
        // SAFETY: the caller's word is inside its block, and it runs with D's features.
        let word = unsafe { _mm256_loadu_si256(bases[0].add(at).cast()) };
        (
            _mm256_and_si256(word, _mm256_set1_epi8(0x0F)),
            _mm256_and_si256(word, _mm256_set1_epi8(0xF0u8 as i8)),
        )
    }

    #[inline(always)]
    unsafe fn madd_into(acc: __m256i, x: i32, mv: __m256i) -> __m256i {
        // SAFETY: the caller runs with D's features.
        unsafe { D::madd_into(acc, _mm256_set1_epi32(x), mv) }
    }

    #[inline(always)]
    unsafe fn cvt(v: __m256i) -> __m256 {
        _mm256_cvtepi32_ps(v)
    }

    #[inline(always)]
    unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }

    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
    }

    #[inline(always)]
    unsafe fn set1_ps(v: f32) -> __m256 {
        _mm256_set1_ps(v)
    }

    #[inline(always)]
    unsafe fn load(out: &[f32; GROUP_ROWS]) -> __m256 {
        // SAFETY: a float per lane.
        unsafe { _mm256_loadu_ps(out.as_ptr()) }
    }

    #[inline(always)]
    unsafe fn store(out: &mut [f32; GROUP_ROWS], v: __m256) {
        // SAFETY: a float per lane.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) }
    }
}

impl KLanes for Zmm {
    #[inline(always)]
    unsafe fn scales(blocks: [*const u8; 2]) -> KScales<Zmm> {
        // SAFETY: the caller's blocks are whole and it runs with AVX-512 VNNI's features.
        unsafe {
            let (first, second) = (BlockScales::of(blocks[0]), BlockScales::of(blocks[1]));
            let mut scales = KScales {
                d: join_ps(first.d, second.d),
                neg_dmin: join_ps(first.neg_dmin, second.neg_dmin),
                scale: [_mm512_setzero_ps(); Q4K::BLOCK / GROUP],
                mn: [_mm512_setzero_si512(); Q4K::BLOCK / GROUP / 2],
            };
            // (Loops, not closures, as for eight rows.)
            for g in 0..Q4K::BLOCK / GROUP {
                scales.scale[g] = join_ps(first.scale(g), second.scale(g));
                if g % 2 == 1 {
                    scales.scale[g] = _mm512_mul_ps(scales.scale[g], _mm512_set1_ps(1.0 / 16.0));
                }
            }
            for p in 0..Q4K::BLOCK / GROUP / 2 {
                scales.mn[p] = join_si(first.mn_pair(p), second.mn_pair(p));
            }
            scales
        }
    }

    #[inline(always)]
    unsafe fn add_scaled(
        total: __m512,
        [even, odd]: [__m512i; 2],
        chains: usize,
        scale: __m512,
    ) -> __m512 {
        // SAFETY: the caller runs with AVX-512 F.
        unsafe {
            let sum = if chains == 2 {
                _mm512_add_epi32(even, odd)
            } else {
                even
            };
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, total)
        }
    }

    #[inline(always)]
    unsafe fn code_words(bases: [*const u8; 2], at: usize) -> (__m512i, __m512i) {
        // SAFETY: the caller's words are inside their blocks, and it runs with AVX-512 F and BW.
        unsafe {
            let word = Zmm::word(bases, at);
            (
                _mm512_and_si512(word, _mm512_set1_epi8(0x0F)),
                _mm512_and_si512(word, _mm512_set1_epi8(0xF0u8 as i8)),
            )
        }
    }

    #[inline(always)]
    unsafe fn madd_into(acc: __m512i, x: i32, mv: __m512i) -> __m512i {
        // SAFETY: the caller runs with AVX-512 VNNI.
        unsafe { dpwssd(acc, _mm512_set1_epi32(x), mv) }
    }

    #[inline(always)]
    unsafe fn cvt(v: __m512i) -> __m512 {
        // SAFETY: the caller runs with AVX-512 F.
        unsafe { _mm512_cvtepi32_ps(v) }
    }

    #[inline(always)]
    unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: the caller runs with AVX-512 F.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }

    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        // SAFETY: the caller runs with AVX-512 F.
        unsafe { _mm512_mul_ps(a, b) }
    }

    #[inline(always)]
    unsafe fn set1_ps(v: f32) -> __m512 {
        // SAFETY: the caller runs with AVX-512 F.
        unsafe { _mm512_set1_ps(v) }
    }

    #[inline(always)]
    unsafe fn load(out: &[f32; WIDE_ROWS]) -> __m512 {
        // SAFETY: a float per lane; the caller runs with AVX-512 F.
        unsafe { _mm512_loadu_ps(out.as_ptr()) }
    }

    #[inline(always)]
    unsafe fn store(out: &mut [f32; WIDE_ROWS], v: __m512) {
        // SAFETY: a float per lane; the caller runs with AVX-512 F.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v) }
    }
}

/// y[0..R] (a float per lane of L: its weight rows) for activation rows t0..t0 + R; returns R. The first tile of
/// a call prefetches `ahead` (the next call's rows), a quarter of a block's share per pair of groups: the bytes
/// come while the products run, and a burst of prefetches never stalls their loads. Qwen2.5-Coder-1.5B's Q4_K
/// matrices took 0.86 / 0.92 of the time they had taken at T = 8 / 16 when each block prefetched 2 KB ahead in its
/// group's own stream (resident rows; plain ones, regrouped: 0.94 / 0.98; benches/RESULTS.md, thirty-fifth
/// session).
///
/// # Safety
/// `bases` must point at whole groups of `a.k / 256` blocks (`pair_bases`); t0 + R <= a.t; the caller runs with
/// L's features.
#[inline(always)]
unsafe fn k_tile<L: KLanes, const R: usize>(
    a: &Activations,
    bases: [*const u8; 2],
    ahead: Prefetch,
    t0: usize,
    y: &mut [L::Out],
) -> usize {
    // SAFETY: t0 + R <= t.
    let rows = unsafe { SpanRows::from(a, t0) };
    let (codes, gs) = (rows.codes, a.k / GROUP);
    // Each row's accumulator lives in y (touched twice a span), leaving the registers to the span's sums.
    for out in y[..R].iter_mut() {
        // SAFETY: the caller runs with L's features.
        unsafe { L::store(out, L::zero_float()) };
    }
    for bi in 0..a.k / Q4K::BLOCK {
        // SAFETY: block bi of each group is inside it (the caller's contract).
        let blocks = bases.map(|base| unsafe { base.add(bi * K_GROUP_BLOCK) });
        // SAFETY: the blocks' words 0-3; the caller runs with L's features.
        let scales_of_block = unsafe { L::scales(blocks) };
        for sp in 0..Q4K::BLOCK / Q4K::SPAN {
            // Σ sc·Σ q·x̂ over the span's groups, per row: exact integers in float32.
            let mut totals = [L::zero_float(); R];
            // Two groups at a time, g = 2h and 2h + 1: the low and high nibbles (`code_words`) of words 4 + 8h + c
            // (c = 0..8), each word met by the R activation rows in turn: 2R independent running sums, which the
            // CPU overlaps (a row's eight products depend on each other). One group at a time ran at 0.7x: LLVM
            // sank the last row's chain of eight to the end of each group (benches/RESULTS.md, nineteenth
            // session).
            for h in sp * K_SPAN_GROUPS / 2..(sp + 1) * K_SPAN_GROUPS / 2 {
                if t0 == 0 {
                    ahead.part(bi, h, Q4K::BLOCK / GROUP / 2);
                }
                // With few rows, each row's eight products go into two chains (even and odd c), so that the
                // latency of one chain of eight does not bound the group.
                let chains = if R < 4 { 2 } else { 1 };
                let mut sums = [[[L::zero_int(); 2]; R]; 2];
                for c in 0..8 {
                    // SAFETY: word 4 + 8h + c < 36 of the blocks.
                    let (low, high) = unsafe { L::code_words(blocks, 32 * (4 + 8 * h + c)) };
                    let w = [low, high];
                    for r in 0..R {
                        for (half, sums) in sums.iter_mut().enumerate() {
                            // Elements 4c..4c + 4 of group 2h + half of activation row t0 + r, in every lane.
                            // SAFETY: group bi · 8 + 2h + half of the row holds 32 codes.
                            let x = unsafe {
                                codes
                                    .add((r * gs + bi * 8 + 2 * h + half) * GROUP + 4 * c)
                                    .cast::<i32>()
                                    .read_unaligned()
                            };
                            // SAFETY: the caller runs with L's features.
                            let sum = &mut sums[r][c % chains];
                            *sum = unsafe { L::add_products(*sum, w[half], x) };
                        }
                    }
                }
                for (half, sums) in sums.into_iter().enumerate() {
                    let scale = scales_of_block.scale[2 * h + half];
                    for (sums, total) in sums.into_iter().zip(&mut totals) {
                        // SAFETY: the caller runs with L's features.
                        *total = unsafe { L::add_scaled(*total, sums, chains, scale) };
                    }
                }
            }
            for (r, total) in totals.into_iter().enumerate() {
                // SAFETY: r < R; the caller runs with L's features.
                unsafe { rows.end_span::<L>(&scales_of_block, &mut y[r], total, (r, bi, sp)) };
            }
        }
    }
    R
}

/// Activation rows from which a pass over Q4_K rows takes AMX tiles (`Products::Amx`, `k_wide_rows`); fewer run
/// `k_rows` with VNNI's products, a group of eight rows at a time. Measured on one 1536 x 1536 matrix of
/// Qwen2.5-Coder-1.5B in cache (one thread, Sapphire Rapids class VM, µs, two runs each; benches/RESULTS.md,
/// twenty-eighth session): tiles 120-130 / 133-135 / 142-151 at T = 4 / 5 / 6, VNNI 117-121 / 134-147 / 156-166.
pub const Q4K_TILE_MIN_ROWS: usize = 5;

/// A kernel over whole interleaved groups of Q4_K rows, W rows a call (`groups`: W / 8 groups, or fewer at a
/// matrix's end): y[t][j] for row j.
trait KGroups<const W: usize> {
    /// `ahead`: the bytes its products prefetch (the next call's rows).
    ///
    /// # Safety
    /// `groups` holds whole groups of `a.k / 256` blocks; the caller runs with the kernel's features.
    unsafe fn groups(
        a: &Activations,
        groups: &[u8],
        row_bytes: usize,
        ahead: Prefetch,
        y: &mut [[f32; W]; MAX_T],
    );
}

/// One group of eight rows with D's vector products (`k_rows`).
impl<D: IntDot> KGroups<GROUP_ROWS> for D {
    #[inline(always)]
    unsafe fn groups(
        a: &Activations,
        groups: &[u8],
        row_bytes: usize,
        ahead: Prefetch,
        y: &mut [[f32; GROUP_ROWS]; MAX_T],
    ) {
        // SAFETY: the caller's contract.
        unsafe { k_rows::<D>(a, groups, row_bytes, ahead, y) }
    }
}

/// Two groups of eight rows at once (`k_wide_rows`).
struct TwoGroups;

impl KGroups<WIDE_ROWS> for TwoGroups {
    #[inline(always)]
    unsafe fn groups(
        a: &Activations,
        groups: &[u8],
        row_bytes: usize,
        ahead: Prefetch,
        y: &mut [[f32; WIDE_ROWS]; MAX_T],
    ) {
        // SAFETY: the caller's contract (AVX-512 VNNI's features).
        unsafe { k_wide_rows(a, groups, row_bytes, ahead, y) }
    }
}

/// Up to two interleaved groups of Q4_K rows (`groups`: 8 or 16 rows; `pair_bases`: a lone group is computed
/// twice), both at once: with AMX's products (where `matmul` laid out the activations for the tiles,
/// `Q8Rows::pairs`) passes of Q4K_TILE_MIN_ROWS or more activation rows take AMX tiles (`k_tile_amx`, up to 2 ·
/// PAIR_TOKENS activation rows a tile pass), other passes AVX-512 vectors (`k_tile` with `Zmm`). The same bits
/// either way.
///
/// # Safety
/// As `k_rows`, for each group, with AVX-512 VNNI's features (on a CPU with AMX where the tiles are taken).
#[inline(always)]
unsafe fn k_wide_rows(
    a: &Activations,
    groups: &[u8],
    row_bytes: usize,
    ahead: Prefetch,
    y: &mut [[f32; WIDE_ROWS]; MAX_T],
) {
    debug_assert!(row_bytes == a.k / Q4K::BLOCK * Q4K::BYTES);
    let bases = pair_bases(groups, row_bytes);
    if a.t < Q4K_TILE_MIN_ROWS || a.q8_for(Q4K::SPAN).pairs.is_empty() {
        // The tiles' contract: `bases` point at whole groups.
        in_tiles!(a.t, y, |t0, out| k_tile::<Zmm>(a, bases, ahead, t0, out));
        return;
    }
    for t0 in (0..a.t).step_by(2 * PAIR_TOKENS) {
        let rows = (a.t - t0).min(2 * PAIR_TOKENS);
        // SAFETY: the caller's contract, with t0 + rows <= t; `matmul` made the pairs for this pass.
        unsafe { k_tile_amx(a, bases, t0, rows, &mut y[t0..]) };
    }
}

/// One span's tiles in memory: the weight codes of its four groups, two groups to a product (`codes[hh]`: groups
/// 2h and 2h + 1, h = 2sp + hh, of both groups of rows as one [16, 64]-byte tile: row c < 8 holds group 2h's
/// elements 4c..4c + 4 of each of the sixteen weight rows, a code word's low nibbles, and row 8 + c those of group
/// 2h + 1, its high nibbles), and the products' integer sums ([chunk][hh][activation tile row][weight row]: row
/// r < n of a chunk of n activation rows is row r's group 2h, row n + r its group 2h + 1; `Q8Rows::pairs`).
#[repr(C, align(64))]
struct SpanTiles {
    codes: [[[u8; 64]; 16]; 2],
    sums: [[[[i32; WIDE_ROWS]; PAIR_TILE_ROWS]; 2]; 2],
}

thread_local! {
    /// Each kernel thread's two pipeline spans (`k_tile_amx`), kept from call to call rather than cleared at
    /// every call (12 KB; a call over a 1536-long row has 12 spans): every byte a step reads is written first.
    static SPAN_TILES: std::cell::Cell<Option<Box<[SpanTiles; 2]>>> = const { std::cell::Cell::new(None) };
}

/// Two float vectors of eight lanes as one of sixteen (`low` in lanes 0-7).
///
/// # Safety
/// The caller runs with AVX-512 F.
#[inline(always)]
pub(super) unsafe fn join_ps(low: __m256, high: __m256) -> __m512 {
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(
        _mm512_castpd256_pd512(_mm256_castps_pd(low)),
        _mm256_castps_pd(high),
    ))
}

/// acc + `vpdpwssd`(pairs, mv) on 512-bit vectors: each i32 lane grows by the products of its two i16 lanes. Inline
/// assembly, as `Vnni::madd_into`: from `_mm512_dpwssd_epi32`, LLVM's x86 backend (tuning for a generic CPU) emitted
/// `vpmaddwd` + `vpaddd`, one instruction more, for most of the Q4_K tiles' (`Zmm`) offset products.
///
/// # Safety
/// The caller runs with AVX-512 VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(super) unsafe fn dpwssd(acc: __m512i, pairs: __m512i, mv: __m512i) -> __m512i {
    let mut acc = acc;
    // SAFETY: one register-to-register instruction of this function's features; no memory, stack or flags.
    unsafe {
        std::arch::asm!(
            "vpdpwssd {acc}, {pairs}, {mv}",
            acc = inout(zmm_reg) acc,
            pairs = in(zmm_reg) pairs,
            mv = in(zmm_reg) mv,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// Two integer vectors of eight lanes as one of sixteen (`low` in lanes 0-7).
///
/// # Safety
/// The caller runs with AVX-512 F.
#[inline(always)]
pub(super) unsafe fn join_si(low: __m256i, high: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high)
}

/// Span `sp` of the interleaved blocks at `blocks` (the same block of both groups of rows) as its two products'
/// weight tiles in `codes` (`SpanTiles`): the low and the high nibbles of code words 4 + 8h + c, h = 2sp + hh,
/// of both groups side by side, rows c and 8 + c of tile hh.
///
/// # Safety
/// The blocks must be whole; the caller runs with AVX-512 F and BW.
#[inline(always)]
unsafe fn unpack_span(blocks: [*const u8; 2], sp: usize, codes: &mut [[[u8; 64]; 16]; 2]) {
    if sp == 0 {
        // Once per block, 2 KB ahead in each group's stream (AMX machines have not measured `k_tile`'s prefetch of
        // the next call's rows).
        for block in blocks {
            prefetch(block.wrapping_add(ROW_PREFETCH), K_GROUP_BLOCK);
        }
    }
    let low = _mm512_set1_epi8(0x0F);
    for (hh, tile) in codes.iter_mut().enumerate() {
        for c in 0..8 {
            let w = 4 + 8 * (2 * sp + hh) + c;
            // SAFETY: word w < 36 of both blocks; rows c and 8 + c of the tile, 64-byte aligned.
            unsafe {
                let v = join_si(word(blocks[0], w), word(blocks[1], w));
                _mm512_store_si512(tile[c].as_mut_ptr().cast(), _mm512_and_si512(v, low));
                let high = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                _mm512_store_si512(tile[8 + c].as_mut_ptr().cast(), high);
            }
        }
    }
}

/// y[0..rows] (lanes 0-7: the rows of `bases[0]`'s group, 8-15: `bases[1]`'s) for activation rows t0..t0 + rows
/// (rows <= 2 · PAIR_TOKENS, in chunks of PAIR_TOKENS), as `k_tile` computes them: for each pair of a span's
/// groups, all sixteen weight rows' sums of both groups for a chunk of activation rows in one `tdpbsud` (activation
/// codes block-diagonal [2n, 64] signed, `Q8Rows::pairs`; weight codes [16, 16 · 4] unsigned, `SpanTiles`), then
/// the same float steps as `k_tile` on the same exact integers, so the same bits.
///
/// Every product's sums are whole: two groups of eight weight rows meet both groups of a chunk of activation
/// rows, where one group of weight rows left half of each product's columns zero. Products and the stores of
/// their sums cost about the same whatever the tile's rows (Sapphire Rapids class VM, ~5 ns and ~4.6 ns), so a
/// pass of 8 activation rows takes half the tile instructions.
///
/// Tile registers are not renamed: a span's products wait on the span before, its weight codes reach the tiles
/// through memory (vector stores, then `tileloadd`) and so do its sums (`tilestored`, then vector loads). So the
/// work is a pipeline over two scratch buffers: at step s, span s + 1's codes are unpacked, span s's tile
/// instructions issued, and span s - 1's float steps run.
///
/// # Safety
/// `bases` must point at whole groups of `a.k / 256` blocks; t0 + rows <= a.t, t0 a multiple of PAIR_TOKENS, and
/// the activations' pairs are made; the caller runs with AVX-512 VNNI's features on a CPU with AMX.
#[inline(always)]
unsafe fn k_tile_amx(
    a: &Activations,
    bases: [*const u8; 2],
    t0: usize,
    rows: usize,
    y: &mut [[f32; WIDE_ROWS]],
) {
    // SAFETY: t0 + rows <= t.
    let inputs = unsafe { SpanRows::from(a, t0) };
    let q8 = a.q8_for(Q4K::SPAN);
    let pairs_per_row = a.k / (2 * GROUP);
    // The chunks' activation rows: one chunk, or two.
    let n = [rows.min(PAIR_TOKENS), rows.saturating_sub(PAIR_TOKENS)];
    let chunks = if n[1] > 0 { 2 } else { 1 };
    // Tiles 0 and 1: the span's two products' weight codes; 2 and 3: activation codes (one chunk: its pairs hh =
    // 0 and 1; two chunks: chunk 0's and chunk 1's); 4 and 5: chunk 0's sums (hh = 0, 1), 6 and 7 chunk 1's.
    // Activation codes and sums are [2n, 64] for a chunk of n rows; an unused tile has no shape.
    let (weights, chunk) = (
        (16, 64),
        |n: usize| if n > 0 { (2 * n, 64) } else { (0, 0) },
    );
    let config = amx::Config::new([
        weights,
        weights,
        chunk(n[0]),
        chunk(n[chunks - 1]),
        chunk(n[0]),
        chunk(n[0]),
        chunk(n[1]),
        chunk(n[1]),
    ]);
    let mut scratch = SPAN_TILES.take().unwrap_or_else(|| {
        let blank = || SpanTiles {
            codes: [[[0; 64]; 16]; 2],
            sums: [[[[0; WIDE_ROWS]; PAIR_TILE_ROWS]; 2]; 2],
        };
        Box::new([blank(), blank()])
    });
    let tiles = &mut *scratch;
    const TILE_ROW: usize = 64;
    for out in y[..rows].iter_mut() {
        *out = [0.0; WIDE_ROWS];
    }
    // Chunk c's activation tile of pair h (`Q8Rows::pairs`).
    let pair_tile = |c: usize, h: usize| {
        let at = ((t0 / PAIR_TOKENS + c) * pairs_per_row + h) * PAIR_TILE_BYTES;
        q8.pairs[at..][..PAIR_TILE_BYTES].as_ptr().cast::<u8>()
    };
    let block = |bi: usize| bases.map(|base| base.wrapping_add(bi * K_GROUP_BLOCK));
    // SAFETY (every tile instruction below): the caller's CPU has AMX; this configuration's shapes; the operands'
    // bytes are inside the pairs' tiles and `tiles`.
    unsafe { config.load() };
    // Span i: i % 2 of block i / 2; its codes unpacked at step i - 1, its tile instructions at step i, its float
    // steps at step i + 1.
    let steps = a.k / Q4K::BLOCK * 2;
    // SAFETY: step 0's blocks are the groups' first.
    unsafe { unpack_span(block(0), 0, &mut tiles[0].codes) };
    for step in 0..=steps {
        if step < steps {
            if step + 1 < steps {
                let next = step + 1;
                // SAFETY: block next / 2 of the groups is inside them (the caller's contract).
                unsafe { unpack_span(block(next / 2), next % 2, &mut tiles[next % 2].codes) };
            }
            let tiles = &mut tiles[step % 2];
            // The span's first pair of groups.
            let h = step * K_SPAN_GROUPS / 2;
            let first_sums = tiles.sums.as_mut_ptr().cast::<u8>();
            let sums = |c: usize, hh: usize| {
                first_sums.wrapping_add((2 * c + hh) * PAIR_TILE_ROWS * TILE_ROW)
            };
            // SAFETY: see above.
            unsafe {
                amx::load::<0>(tiles.codes[0].as_ptr().cast(), TILE_ROW);
                amx::load::<1>(tiles.codes[1].as_ptr().cast(), TILE_ROW);
                if chunks == 1 {
                    amx::load::<2>(pair_tile(0, h), TILE_ROW);
                    amx::load::<3>(pair_tile(0, h + 1), TILE_ROW);
                    amx::zero::<4>();
                    amx::dot_signed_unsigned::<4, 2, 0>();
                    amx::zero::<5>();
                    amx::dot_signed_unsigned::<5, 3, 1>();
                    amx::store::<4>(sums(0, 0), TILE_ROW);
                    amx::store::<5>(sums(0, 1), TILE_ROW);
                } else {
                    amx::load::<2>(pair_tile(0, h), TILE_ROW);
                    amx::load::<3>(pair_tile(1, h), TILE_ROW);
                    amx::zero::<4>();
                    amx::dot_signed_unsigned::<4, 2, 0>();
                    amx::zero::<6>();
                    amx::dot_signed_unsigned::<6, 3, 0>();
                    amx::load::<2>(pair_tile(0, h + 1), TILE_ROW);
                    amx::load::<3>(pair_tile(1, h + 1), TILE_ROW);
                    amx::zero::<5>();
                    amx::dot_signed_unsigned::<5, 2, 1>();
                    amx::zero::<7>();
                    amx::dot_signed_unsigned::<7, 3, 1>();
                    amx::store::<4>(sums(0, 0), TILE_ROW);
                    amx::store::<5>(sums(0, 1), TILE_ROW);
                    amx::store::<6>(sums(1, 0), TILE_ROW);
                    amx::store::<7>(sums(1, 1), TILE_ROW);
                }
            }
        }
        if step > 0 {
            let (bi, sp) = ((step - 1) / 2, (step - 1) % 2);
            let tiles = &tiles[(step - 1) % 2];
            // SAFETY (this block): block bi's words 0-3 of both groups (the caller's contract); the caller runs
            // with AVX-512 VNNI's features.
            unsafe {
                // (Not in a closure: a closure takes no target features, and its intrinsics would become calls.)
                let [first, second] = block(bi);
                let (first, second) = (BlockScales::of(first), BlockScales::of(second));
                let (d, neg_dmin) = (
                    join_ps(first.d, second.d),
                    join_ps(first.neg_dmin, second.neg_dmin),
                );
                // The span's four groups' sub-scales and offset multipliers, sixteen weight rows each.
                let mut scale = [_mm512_setzero_ps(); K_SPAN_GROUPS];
                let mut mn = [_mm512_setzero_si512(); K_SPAN_GROUPS];
                for j in 0..K_SPAN_GROUPS {
                    let g = sp * K_SPAN_GROUPS + j;
                    scale[j] = join_ps(first.scale(g), second.scale(g));
                    mn[j] = join_si(
                        byte_lanes(first.mn[g / 4], g % 4),
                        byte_lanes(second.mn[g / 4], g % 4),
                    );
                }
                for (c, &n) in n[..chunks].iter().enumerate() {
                    for r in 0..n {
                        let t = PAIR_TOKENS * c + r;
                        // Σ sc·Σ q·x̂ over the span's groups, per weight row: exact integers in float32.
                        let mut total = _mm512_setzero_ps();
                        for (hh, sums) in tiles.sums[c].iter().enumerate() {
                            for half in 0..2 {
                                let sum = _mm512_load_si512(sums[half * n + r].as_ptr().cast());
                                total = _mm512_fmadd_ps(
                                    _mm512_cvtepi32_ps(sum),
                                    scale[2 * hh + half],
                                    total,
                                );
                            }
                        }
                        // M = Σ mn·Σ x̂ (mn in the low 16 bits of each lane, |Σ codes| < 2^15).
                        let code_sums = inputs
                            .code_sums
                            .add(t * inputs.groups + bi * 8 + sp * K_SPAN_GROUPS);
                        let mut m = _mm512_setzero_si512();
                        for (j, &mn) in mn.iter().enumerate() {
                            m = _mm512_dpwssd_epi32(m, _mm512_set1_epi32(*code_sums.add(j)), mn);
                        }
                        let dx = _mm512_set1_ps(*inputs.scales.add(t * inputs.spans + bi * 2 + sp));
                        // As `BlockScales::end_span`, on sixteen lanes.
                        let out = y[t].as_mut_ptr();
                        let acc = _mm512_loadu_ps(out);
                        let acc = _mm512_fmadd_ps(total, _mm512_mul_ps(d, dx), acc);
                        let acc = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(m),
                            _mm512_mul_ps(neg_dmin, dx),
                            acc,
                        );
                        _mm512_storeu_ps(out, acc);
                    }
                }
            }
        }
    }
    // SAFETY: the caller's CPU has AMX.
    unsafe { amx::release() };
    SPAN_TILES.set(Some(scratch));
}
