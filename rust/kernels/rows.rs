//! What every row kernel (scalar, AVX2, AVX-512, NEON) shares: the activations of a call, the row-kernel
//! signature and the most activation rows per call. `matmul` builds these and hands them to the kernels; the
//! kernels import them from here, never from `matmul`, so imports go one way (kernels → rows, matmul → kernels).

use super::blocks::GROUP;
use super::q8::Q8Rows;

/// Most activation rows a row kernel takes at once (a speculative verification pass of up to 31 drafts plus one);
/// `matmul` runs longer inputs (prefill) through it in blocks while each weight row stays in L1 cache.
pub const MAX_T: usize = 32;

/// One output row for every activation row: `y[t]` for t < `a.t`, from the encoded weight row `row`.
pub type RowKernel = fn(&Activations, &[u8], &mut [f32; MAX_T]);

/// Weight rows a group kernel computes at once: one per 32-bit lane of an AVX2 vector.
pub const GROUP_ROWS: usize = 8;

/// Up to `GROUP_ROWS` consecutive weight rows at once: `rows` holds `count` encoded rows of `row_bytes` each
/// (1 <= count <= GROUP_ROWS), and `y[t][j]` receives row j's output for activation row t < `a.t` (j < count).
/// Each output's arithmetic is its own lane's: it does not depend on count or on the other rows.
pub type GroupKernel = fn(&Activations, &[u8], usize, &mut [[f32; GROUP_ROWS]; MAX_T]);

/// Weight rows a wide group kernel computes at once: two groups, one per half of an AVX-512 vector's lanes.
pub const WIDE_ROWS: usize = 2 * GROUP_ROWS;

/// As `GroupKernel`, up to `WIDE_ROWS` rows at once (1 <= count <= WIDE_ROWS).
pub type WideKernel = fn(&Activations, &[u8], usize, &mut [[f32; WIDE_ROWS]; MAX_T]);

/// How a matrix's output columns are computed: one weight row per call, or `GROUP_ROWS` or `WIDE_ROWS` of them.
#[derive(Clone, Copy)]
pub enum Kernel {
    Row(RowKernel),
    /// Only the AVX2 kernels have group kernels so far.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Group(GroupKernel),
    /// Sixteen rows a call, with AVX-512 VNNI's products (or AMX's): interleaved Q4_1 and Q4_K (`avx2::interleaved`),
    /// Q6_K's lanes, and the legacy formats' plain rows (`avx2::legacy_lanes`).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Wide(WideKernel),
    /// Rows stored interleaved by `GROUP_ROWS` (`interleave`): each group is restored to plain rows, then computed
    /// by the row kernel, so its outputs are the plain rows' bits.
    Interleaved(RowKernel),
}

/// The activations of a call: x [t, k] row-major, for affine types Σx of every 32-element group, and for the
/// integer kernels x quantized in the spans the call's weight formats take (`Format::SPAN`).
pub struct Activations<'a> {
    pub x: &'a [f32],
    /// [t, k / GROUP] group sums Σx for the float kernels of affine types (else empty).
    pub sums: Vec<f32>,
    /// x as 8-bit codes, once per span a matrix of the call needs (integer kernels only).
    pub q8: Vec<Q8Rows>,
    pub t: usize,
    pub k: usize,
}

impl Activations<'_> {
    /// Elements of group `gi` of activation row `ti`.
    pub fn group(&self, ti: usize, gi: usize) -> &[f32] {
        &self.x[ti * self.k + gi * GROUP..][..GROUP]
    }

    /// The quantized activations in spans of `span` (a format's `SPAN`); only the integer kernels call this, and
    /// `matmul` quantizes for them.
    pub fn q8_for(&self, span: usize) -> &Q8Rows {
        self.q8
            .iter()
            .find(|q| q.span() == span)
            .expect("integer kernels are given quantized activations")
    }

    /// Σx over group `gi` of activation row `ti`.
    pub fn group_sum(&self, ti: usize, gi: usize) -> f32 {
        self.sums[ti * (self.k / GROUP) + gi]
    }
}

/// Runs a tile kernel over activation rows 0..`rows` in tiles of 8 rows, then one tile of the 1 to 7 rows left:
/// `in_tiles!(rows, y, |t0, out| tile::<F, ...>(args...))` calls `tile::<F, ..., R>(args...)` with `t0` the
/// tile's first row and `out` = `&mut y[t0..]`; the tile returns R. Every tile kernel computes each row with its own
/// accumulators, so a row's result does not depend on the tile it falls in.
///
/// One tile for the rest, not tiles of 4, 2 and 1: every tile decodes the weight row again, so 7 rows as 4 + 2 + 1
/// decoded it three times. Measured with those tiles (`benches/cpu_kernels.py`, Xeon Cascade Lake, 2 threads, 8-bit
/// activations, kernel pass ms at T = 3 / 4 / 7 / 8; `benches/cpu_kernels_*_tiles_8421.json`): Qwen2.5-Coder-1.5B
/// (K-quant row kernels) 175 / 147 / 273 / 317, a 3-row pass dearer than 4; SmolLM2 (Q4_1 group kernels) 13.7 /
/// 13.5 / 20.7 / 17.7, a 7-row pass dearer than 8.
///
/// One row (a decode step) goes straight to its tile, outside the loop: with the loop alone, Qwen2.5-Coder-1.5B's
/// T = 1 pass ran 3% slower (31 alternating passes) once the loop had a tile for every remainder (the K-quant row
/// kernel's code doubled); with this branch no slower than before (0.97-0.98, within the VM's noise;
/// `cpu_kernels.py --against`, Cascade Lake).
macro_rules! in_tiles {
    ($rows:expr, $y:expr, |$t0:ident, $out:ident| $tile:ident::<$($f:ty),+>($($arg:expr),* $(,)?)) => {{
        let mut $t0 = 0;
        if $rows == 1 {
            let $out = &mut $y[..];
            // SAFETY: the tile's contract is the calling kernel's (given at the call), with t0 + 1 <= rows.
            unsafe { $tile::<$($f),+, 1>($($arg),*) };
            $t0 = 1;
        }
        while $t0 < $rows {
            let $out = &mut $y[$t0..];
            // SAFETY: (all eight) the tile's contract is the calling kernel's (given at the call), with
            // t0 + R <= rows.
            $t0 += match $rows - $t0 {
                8.. => unsafe { $tile::<$($f),+, 8>($($arg),*) },
                7 => unsafe { $tile::<$($f),+, 7>($($arg),*) },
                6 => unsafe { $tile::<$($f),+, 6>($($arg),*) },
                5 => unsafe { $tile::<$($f),+, 5>($($arg),*) },
                4 => unsafe { $tile::<$($f),+, 4>($($arg),*) },
                3 => unsafe { $tile::<$($f),+, 3>($($arg),*) },
                2 => unsafe { $tile::<$($f),+, 2>($($arg),*) },
                _ => unsafe { $tile::<$($f),+, 1>($($arg),*) },
            };
        }
    }};
}
pub(crate) use in_tiles;

/// Pseudo-random bytes for the kernels' tests, bit 6 clear in every odd byte: every (little-endian)
/// f16/bf16/f32 field they form has the top exponent bit clear, so it is finite and below 2 in magnitude; codes
/// still take every value.
#[cfg(test)]
pub(crate) fn test_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed;
    (0..len)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u8 & if i % 2 == 1 { 0xBF } else { 0xFF }
        })
        .collect()
}

/// (‖want - got‖₂, ‖want‖₂): the tests' relative error measure, as floats of the kernels' precision.
#[cfg(test)]
pub(crate) fn test_l2(want: &[f32], got: &[f32]) -> (f32, f32) {
    let norm = want.iter().map(|v| v * v).sum::<f32>().sqrt();
    let diff = want
        .iter()
        .zip(got)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f32>()
        .sqrt();
    (diff, norm)
}
