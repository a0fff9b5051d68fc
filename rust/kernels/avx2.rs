//! AVX2 + FMA (+ F16C) row kernels: the structure of `dot.rs` with each group's 32 codes decoded once into one
//! 32-byte vector, then met by every activation row of a tile:
//! - integer row kernels (`int`, the K-quants): `maddubs` (u8 x i8 -> i16 pairs) and `madd` (-> i32, times the
//!   integer sub-scales) against the activations' 8-bit codes, one float conversion and FMA per activation span
//!   (128 elements) and row (Q4_K: each span reduced to exact integers first, `SuperBlock::SPAN_TOTALS`, the
//!   numerics of its interleaved layout's kernel; passes of several rows regroup its rows into that layout,
//!   `interleaved::q4_k_plain`);
//! - `interleaved`: the kernels of rows interleaved by eight (resident Q4_1 and Q4_K matrices), Q4_K's with AMX
//!   tiles (`amx`) in passes of several activation rows where the CPU has them; `tiles`: Q6_K's and Q8_0's with
//!   AMX tiles, eight plain rows at a time (Q6_K's row kernel also reduces each span to an exact integer first);
//! - integer group kernels (`int_group`, the legacy 32-element types): the same products for eight weight rows
//!   at once, each row's integer sum in its own lane (lane j: row j) so that the float work is shared by the
//!   eight rows: for one activation row, eight product vectors reduced across lanes; for tiles of two or more,
//!   each block's eight rows transposed into lanes once and met by every activation row (`legacy_lanes`); with
//!   AVX-512 VNNI's products, sixteen rows at once in 512-bit lanes, transposed for every tile (also with AMX's,
//!   but for Q8_0, whose AMX tiles take passes of Q8_0_TILE_MIN_ROWS or more and the eight-row kernel the rest);
//! - in both, affine types multiply their unsigned codes directly and add m·Σx̂; so do the symmetric types stored
//!   with an offset (Q4_0, Q5_0: c = q + 8 or 16, and m = -offset·d; Q6_K: c = q + 32, its -32·scale·Σx taken
//!   off each span's integer sum); Q8_0 goes through the sign trick (|w| times x with w's sign), two more
//!   instructions per 32 weights and row, or, transposed, in as w + 128 with 128·Σx taken off;
//! - float kernels (`quantized`, `dense`): codes widened to four 8-lane float32 vectors, FMAs against float32
//!   activations (the reference path for differential tests).
//!
//! The integer kernels take their byte products from an `IntDot` (`Products` names the three): AVX2's `maddubs` +
//! `madd` (`Madd`), or the fused forms of VNNI on the same 256-bit vectors (`vpdpwssd` is `madd` plus the add,
//! `vpdpbusd` the byte products summed straight into i32 lanes), in AVX-512 VNNI's encoding (`Vnni`) or in AVX-VNNI's
//! (`AvxVnni`: Intel's client cores from Alder Lake on, which lack AVX-512). The integer sums are the same (the
//! codes never saturate `maddubs`: |w| <= 128, |x| <= 127), so are the float steps: all three give the same bits.
//!
//! Everything here is `unsafe` with `#[target_feature]` (the integer kernels' generic bodies take theirs from
//! their entry points, `int_entries!`): `matmul` hands these kernels out only after `available()` (and
//! `Products::available`) has confirmed the CPU features at run time.

use std::arch::x86_64::*;

use super::blocks::{self, Dense, Format, GROUP, MAX_SUBS};
use super::rows::{in_tiles, Activations, GroupKernel, Kernel, RowKernel, GROUP_ROWS, MAX_T};

mod amx;
mod interleaved;
mod legacy_lanes;
mod q6k_lanes;
mod tiles;
pub use interleaved::{q4_1_x8, q4_k_x8, Q4K_TILE_MIN_ROWS};
#[cfg(test)]
pub use q6k_lanes::force_whole_sub_sums;
pub use q6k_lanes::{q6_k_x8, Q6K_LANES_MIN_ROWS};
pub use tiles::{Q6K_TILE_MIN_ROWS, Q8_0_TILE_MIN_ROWS};

/// Whether this CPU runs the kernels of this module.
pub fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Which instructions give the integer kernels their byte products (each an `IntDot`); `matmul` picks one from the
/// kernel set and the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Products {
    /// AVX2's `maddubs` + `madd` (`Madd`).
    Madd,
    /// AVX-VNNI's VEX-encoded `vpdpbusd` and `vpdpwssd` (`AvxVnni`).
    AvxVnni,
    /// AVX-512 VNNI's, on 256-bit vectors (`Vnni`).
    Avx512Vnni,
    /// AMX tiles (`amx`) where a kernel has them (Q4_K's, Q6_K's and Q8_0's, in passes of several activation
    /// rows), else AVX-512 VNNI's.
    Amx,
}

impl Products {
    /// Whether this CPU runs the kernels with these products.
    pub fn available(self) -> bool {
        available()
            && match self {
                Products::Madd => true,
                Products::AvxVnni => is_x86_feature_detected!("avxvnni"),
                Products::Avx512Vnni => {
                    is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl")
                }
                Products::Amx => Products::Avx512Vnni.available() && amx::available(),
            }
    }
}

/// How the integer kernels multiply 8-bit codes: unsigned weight bytes `wu` by signed activation bytes `x`.
pub trait IntDot {
    /// acc + `madd`(pairs, mv): each i32 lane grows by the products of its two i16 lanes of `pairs` and `mv`.
    unsafe fn madd_into(acc: __m256i, pairs: __m256i, mv: __m256i) -> __m256i;
    /// acc + Σ mv·(wu·x) over each i32 lane's two i16 pair-sums of byte products (`madd` with multipliers
    /// `mv`).
    #[inline(always)]
    unsafe fn scaled(acc: __m256i, wu: __m256i, x: __m256i, mv: __m256i) -> __m256i {
        // SAFETY: the caller runs with Self's features, which include AVX2's.
        unsafe { Self::madd_into(acc, _mm256_maddubs_epi16(wu, x), mv) }
    }
    /// `sum` with the byte products wu·x added, in the running form `widen` turns into i32 lanes (lane i: bytes
    /// 4i..4i + 4). The form holds the products of at most 8 groups whose pair-sums stay below 2^15 / 8.
    unsafe fn add_products(sum: __m256i, wu: __m256i, x: __m256i) -> __m256i;
    /// A running sum of `add_products` as i32 lanes.
    unsafe fn widen(sum: __m256i) -> __m256i;
    /// Two running sums of `add_products` as one, in the same form. The bound of `add_products` is on the total:
    /// the two may hold together no more than one running sum could (`Madd`: 8 groups' products of codes <= 15).
    #[inline(always)]
    unsafe fn add_sums(a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: the caller runs with Self's features, which include AVX2's.
        unsafe { _mm256_add_epi32(a, b) }
    }
    /// The largest weight code whose products a running sum of `add_products` holds over a whole block (32
    /// codes against 8-bit activations), as a group tile transposed into lanes (`legacy_lanes::tile`) adds
    /// them: any byte for 32-bit sums, 4-bit codes for `Madd`'s 16-bit pair-sums (8 · 2 · 15 · 127 < 2^15).
    const LANES_MAX_CODE: u8;
    /// Whether `add_products` sums whole i32 lanes (`vpdpbusd`), so that a running sum may start from any i32 and
    /// `widen` is the identity.
    const WHOLE_SUMS: bool;
}

/// AVX2: `maddubs` (u8 x i8 -> i16 pair-sums), then `madd` (-> i32 lanes); running sums are i16 pair-sums.
pub struct Madd;

impl IntDot for Madd {
    const LANES_MAX_CODE: u8 = 15;
    const WHOLE_SUMS: bool = false;

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn madd_into(acc: __m256i, pairs: __m256i, mv: __m256i) -> __m256i {
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, mv))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn add_products(sum: __m256i, wu: __m256i, x: __m256i) -> __m256i {
        _mm256_add_epi16(sum, _mm256_maddubs_epi16(wu, x))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn widen(sum: __m256i) -> __m256i {
        _mm256_madd_epi16(sum, _mm256_set1_epi16(1))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn add_sums(a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi16(a, b)
    }
}

/// AVX-512 VNNI on 256-bit vectors: `vpdpwssd` (`madd` and the add in one instruction) after `maddubs`, and
/// `vpdpbusd` (four byte products into each i32 lane, no i16 step); running sums are i32 lanes. Only entry
/// points compiled with its features (`int_entries!`) may use it.
pub struct Vnni;

impl IntDot for Vnni {
    const LANES_MAX_CODE: u8 = u8::MAX;
    const WHOLE_SUMS: bool = true;

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn madd_into(acc: __m256i, pairs: __m256i, mv: __m256i) -> __m256i {
        // Inline assembly, not `_mm256_dpwssd_epi32`: from the intrinsic, LLVM's x86 backend (tuning for a generic
        // CPU) emitted `vpmaddwd` + `vpaddd` for all but one of a K-quant tile's products, the AVX2 instructions.
        // `{evex}`: the AVX-512 VNNI encoding, never AVX-VNNI's VEX one, which this entry point does not check for.
        let mut acc = acc;
        // SAFETY: one register-to-register instruction of this function's features; no memory, stack or flags.
        unsafe {
            std::arch::asm!(
                "{{evex}} vpdpwssd {acc:y}, {pairs:y}, {mv:y}",
                acc = inout(zmm_reg) acc,
                pairs = in(zmm_reg) pairs,
                mv = in(zmm_reg) mv,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        acc
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn add_products(sum: __m256i, wu: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(sum, wu, x)
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn widen(sum: __m256i) -> __m256i {
        sum
    }
}

/// AVX-VNNI: `Vnni`'s two instructions in their VEX encoding, for CPUs that have it without AVX-512. Only entry
/// points compiled with its features (`int_entries!`) may use it.
pub struct AvxVnni;

impl IntDot for AvxVnni {
    const LANES_MAX_CODE: u8 = u8::MAX;
    const WHOLE_SUMS: bool = true;

    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    #[inline]
    unsafe fn madd_into(acc: __m256i, pairs: __m256i, mv: __m256i) -> __m256i {
        // Inline assembly: the AVX-VNNI intrinsics are not stable Rust.
        let mut acc = acc;
        // SAFETY: one register-to-register instruction of this function's features; no memory, stack or flags.
        unsafe {
            std::arch::asm!(
                "{{vex}} vpdpwssd {acc}, {pairs}, {mv}",
                acc = inout(ymm_reg) acc,
                pairs = in(ymm_reg) pairs,
                mv = in(ymm_reg) mv,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        acc
    }

    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    #[inline]
    unsafe fn add_products(sum: __m256i, wu: __m256i, x: __m256i) -> __m256i {
        let mut sum = sum;
        // SAFETY: as in `madd_into`.
        unsafe {
            std::arch::asm!(
                "{{vex}} vpdpbusd {sum}, {wu}, {x}",
                sum = inout(ymm_reg) sum,
                wu = in(ymm_reg) wu,
                x = in(ymm_reg) x,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        sum
    }

    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    #[inline]
    unsafe fn widen(sum: __m256i) -> __m256i {
        sum
    }
}

/// `fn $select<G..>(products: Products) -> $kernel`: the integer kernel body `$body::<G.., D>` compiled inside one
/// entry point per `Products` (D = `Madd`, `AvxVnni`, `Vnni`, each with its instructions' target features), and
/// the entry of `products`. The bodies (and their tiles) carry no target features of their own and are
/// `#[inline(always)]`, so each is compiled inside its entry point, with that entry's features: `IntDot`'s
/// instructions inline into the loops. (A body with AVX2's features, merely `#[inline]`, was at times left out of
/// line by LLVM, and its VNNI products then became calls.)
/// A helper the bodies call that has no target features of its own, as a trait's default method, must be
/// `#[inline(always)]` too: left out of line it runs its intrinsics without AVX2. A closure cannot take the
/// attribute: write it as a loop (closures in the group tiles once made the Q8_0 head 2.3-3.7× slower,
/// benches/RESULTS.md, seventeenth session).
macro_rules! int_entries {
    ($(#[$doc:meta])* $vis:vis $select:ident<$($g:ident: $bound:path),*> -> $kernel:ty
        => $body:ident($($arg:ident: $ty:ty),*)) => {
        $(#[$doc])*
        $vis fn $select<$($g: $bound),*>(products: Products) -> $kernel {
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn madd<$($g: $bound),*>($($arg: $ty),*) {
                // SAFETY: the caller's contract is the body's, on a CPU with AVX2.
                unsafe { $body::<$($g,)* Madd>($($arg),*) }
            }

            #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
            unsafe fn avx_vnni<$($g: $bound),*>($($arg: $ty),*) {
                // SAFETY: the caller's contract is the body's, on a CPU with AVX-VNNI.
                unsafe { $body::<$($g,)* AvxVnni>($($arg),*) }
            }

            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
            unsafe fn avx512_vnni<$($g: $bound),*>($($arg: $ty),*) {
                // SAFETY: the caller's contract is the body's, on a CPU with AVX-512 VNNI.
                unsafe { $body::<$($g,)* Vnni>($($arg),*) }
            }

            // SAFETY (all three): `matmul` asks for products only where `Products::available` says the CPU has
            // their features (AMX's include AVX-512 VNNI's, which kernels without tiles take).
            match products {
                Products::Madd => |$($arg),*| unsafe { madd::<$($g),*>($($arg),*) },
                Products::AvxVnni => |$($arg),*| unsafe { avx_vnni::<$($g),*>($($arg),*) },
                Products::Avx512Vnni | Products::Amx => |$($arg),*| unsafe { avx512_vnni::<$($g),*>($($arg),*) },
            }
        }
    };
}
pub(crate) use int_entries;

/// A block format whose group codes decode with AVX2.
pub trait SimdFormat: Format {
    /// Codes of group `g` of the block at `b` (`Self::BYTES` readable bytes), byte j = element j: re-centred
    /// int8 for symmetric types, uint8 for affine ones (as `Format::codes`).
    unsafe fn code_bytes(b: *const u8, g: usize) -> __m256i;

    /// The integer kernel (8-bit activations) of this format: a group kernel for the legacy formats (a wide one of
    /// sixteen rows with AVX-512 VNNI's products), the row kernel for the K-quants; with `products`. Call only if
    /// `products.available()`.
    fn int_kernel(products: Products) -> Kernel;

    /// For a symmetric type stored as unsigned c = q + OFFSET (Q4_0: 8, Q5_0: 16, Q6_K: 32), OFFSET: the integer
    /// kernels multiply c as they do an affine type's codes, and take OFFSET·d·Σx̂ off (Q6_K: OFFSET·scale·Σx per
    /// span, `SuperBlock::offset_multipliers`); 0: the sign trick.
    const OFFSET: u8 = 0;

    /// The largest code `group_codes` gives, as an unsigned byte (a signed type's codes count as w + 128).
    const MAX_CODE: u8 = u8::MAX;

    /// The 32 codes the group kernel multiplies, of the block at `b` (`Self::BYTES` readable bytes): c = q +
    /// OFFSET when OFFSET > 0, else `code_bytes`.
    #[inline(always)]
    unsafe fn group_codes(b: *const u8) -> __m256i {
        // SAFETY: the caller's contract is `code_bytes`'s.
        unsafe { Self::code_bytes(b, 0) }
    }
}

/// A K-quant (super-blocks of 256 in groups of 32, integer sub-scales): what the integer row kernel reads of
/// its scales.
///
/// Every K-quant's integer codes are unsigned, so that they go into `maddubs` as they are: an affine type's, or
/// a symmetric type's stored c = q + OFFSET (Q6_K: q + 32), whose OFFSET·Σ scale·x comes off each span in 32 bits
/// (`offset_multipliers` against `Q8Rows::lane_sums`).
pub trait SuperBlock: SimdFormat {
    type IntScales;
    /// The scales of the block at `b` (`Self::BYTES` readable bytes).
    unsafe fn int_scales(b: *const u8) -> Self::IntScales;
    /// The unsigned codes of group `g` of the block at `b` (`Self::BYTES` readable bytes): `code_bytes`, plus
    /// OFFSET for a symmetric type.
    #[inline(always)]
    unsafe fn unsigned_codes(b: *const u8, g: usize) -> __m256i {
        // SAFETY: the caller's contract is `code_bytes`'s.
        unsafe { Self::code_bytes(b, g) }
    }
    /// For a type with an OFFSET: i32 lane j = -OFFSET · the scale of sub-block j of span `sp` (16 elements, an
    /// eighth of the span, as `Q8Rows::lane_sums`), in its low 16 bits with the high 16 zero, so that `madd`
    /// against the span's lane sums Σx gives -OFFSET·scale·Σx. Unused when OFFSET is 0.
    #[inline(always)]
    unsafe fn offset_multipliers(_s: &Self::IntScales, _sp: usize) -> __m256i {
        _mm256_setzero_si256()
    }
    /// Whether the row kernel reduces each span to exact integers before any float work: I = Σ sub-scale·q·x̂
    /// and, for an affine type's offsets, M = Σ mn·Σx̂ (`min_multipliers` against `Q8Rows::code_sums`), then adds
    /// float(I)·(d·dx) (and float(M)·(-dmin·dx)) to one float32 accumulator per row, span after span. Kernels
    /// that find the same integers another way then give the same bits by the same float steps:
    /// - Q4_K: the interleaved layout's kernel (`interleaved::q4_k_x8`), lane by lane, so resident (interleaved)
    ///   and streamed (plain) rows agree. It sums a span in float32, exact because every partial sum is an
    ///   integer below 2^24 (4 groups · 32 · 15 · 127 · 63).
    /// - Q6_K: AMX tiles in passes of several activation rows (`tiles`), each sub-block's sums in a place of
    ///   their own.
    const SPAN_TOTALS: bool = false;
    /// For `SPAN_TOTALS`: i32 lane i = the offset multiplier mn of group i of span `sp` (4 groups), in its low
    /// 16 bits with the high 16 zero, so that `madd` against the groups' Σcodes gives mn·Σx̂ exactly; and
    /// -dmin.
    #[inline(always)]
    unsafe fn min_multipliers(_s: &Self::IntScales, _sp: usize) -> (__m128i, f32) {
        (_mm_setzero_si128(), 0.0)
    }
    /// i16 multipliers of group `g`'s 16 pair-sums in `madd`: its integer sub-scales.
    unsafe fn multipliers(s: &Self::IntScales, g: usize) -> __m256i;
    /// The float scale of the block's integer sum: weight = block_d · multiplier · q (+ m).
    fn block_d(s: &Self::IntScales) -> f32;
    /// The offsets m of a block's 8 groups as one vector (affine types only).
    unsafe fn group_ms(s: &Self::IntScales) -> __m256;
}

/// `F::code_bytes` as float32 elements 0..32.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_codes<F: SimdFormat>(b: *const u8, g: usize) -> [__m256; 4] {
    // SAFETY: the caller's contract is `code_bytes`'s.
    let q = unsafe { F::code_bytes(b, g) };
    if F::AFFINE {
        widen32::<false>(q)
    } else {
        widen32::<true>(q)
    }
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
    // The tiles' contract is this function's.
    in_tiles!(a.t, y, |t0, out| quantized_tile::<F>(a, row, t0, out));
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
            let c = unsafe { float_codes::<F>(b.as_ptr(), g) };
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

#[inline(always)]
unsafe fn int_row<F: SuperBlock, D: IntDot>(a: &Activations, row: &[u8], y: &mut [f32; MAX_T]) {
    // The groups of an activation span (`Format::SPAN`: 128 elements of a K-quant block) add their integer
    // sums (scaled by integer sub-scales inside `madd`) before any float work: one float scale per span.
    // Tiles of up to 8 activation rows (`in_tiles`) share each group's decoded codes; the weight row is re-read
    // from L1 cache for each tile. The tiles' contract is this function's.
    in_tiles!(a.t, y, |t0, out| int_rows::<F, D>(a, row, t0, out));
}

int_entries!(
    /// The integer row kernel for K-quant `F` (8-bit activations), with `products`. Call only if
    /// `products.available()`.
    int<F: SuperBlock> -> RowKernel => int_row(a: &Activations, row: &[u8], y: &mut [f32; MAX_T])
);

/// y[0..R] for activation rows t0..t0 + R (R = 1 to 8), one vector accumulator per row; returns R.
///
/// A row's arithmetic is the same for every R (each row has its own accumulators, summed in the same order):
/// its result does not depend on how many rows share the pass, so a speculative verify pass over T tokens gives
/// each token the logits a decode step gives it, bit for bit, and greedy speculation stays exact. (Tried: the R
/// rows' span sums reduced across lanes into one vector, lane r for row r, so that one convert, gather of the
/// activation scales and FMA did all R rows' float work, R = 1 reducing the same way to keep the bits. On the
/// AVX-512 EPYC VM it was no faster at T = 8 and 32, and 10-20% slower at T = 1.)
#[inline(always)]
unsafe fn int_rows<F: SuperBlock, D: IntDot, const R: usize>(
    a: &Activations,
    row: &[u8],
    t0: usize,
    y: &mut [f32],
) -> usize {
    const {
        assert!(
            F::AFFINE || F::OFFSET > 0,
            "K-quant codes go into maddubs unsigned (`SuperBlock`)"
        )
    };
    let q8 = a.q8_for(F::SPAN);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut mvec = [_mm256_setzero_ps(); R]; // offsets·Σx̂
    let mut totals = [0f32; R]; // SPAN_TOTALS' accumulators
    let span = F::SPAN;
    let (groups, per_block, per_span) = (F::BLOCK / GROUP, F::BLOCK / span, span / GROUP);
    let (spans, gs) = (a.k / span, a.k / GROUP);
    // Activation row t0's codes, scales, group sums (float and integer) and lane sums; row t0 + r's are r rows
    // further on. Each r steps one row from the last (a pointer per row was R registers, which spilled at R = 8).
    // SAFETY: `matmul` quantized t rows of k codes (spans scales, gs sums, 8 · spans lane sums each), t0 + R <= t.
    let (codes, scales, sums, code_sums, lane_sums) = unsafe {
        (
            q8.codes.as_ptr().add(t0 * a.k),
            q8.scales.as_ptr().add(t0 * spans),
            q8.sums.as_ptr().add(t0 * gs),
            q8.code_sums.as_ptr().add(t0 * gs),
            // Only types with an offset read lane sums (which spans of 32 have none of).
            q8.lane_sums.as_ptr().wrapping_add(t0 * 8 * spans),
        )
    };
    for (bi, b) in row.chunks_exact(F::BYTES).enumerate() {
        prefetch(b.as_ptr().wrapping_add(ROW_PREFETCH), F::BYTES);
        // SAFETY: `b` holds F::BYTES bytes.
        let s = unsafe { F::int_scales(b.as_ptr()) };
        for sp in 0..per_block {
            let mut isum = [_mm256_setzero_si256(); R];
            for g in sp * per_span..(sp + 1) * per_span {
                // SAFETY: `b` holds F::BYTES bytes.
                let (w, mv) = unsafe { (F::unsigned_codes(b.as_ptr(), g), F::multipliers(&s, g)) };
                // SAFETY: group bi · groups + g of row t0 (and, a.k codes on each time, of the next rows) is
                // inside the codes: `matmul` checked row.len() == k / BLOCK * BYTES.
                let mut x = unsafe { codes.add((bi * groups + g) * GROUP) };
                for sum in isum.iter_mut() {
                    // SAFETY: x is group bi · groups + g of a row below t0 + R; the caller runs with D's
                    // features.
                    *sum = unsafe { D::scaled(*sum, w, load32(x.cast()), mv) };
                    x = x.wrapping_add(a.k);
                }
            }
            let (d, si) = (F::block_d(&s), bi * per_block + sp);
            if F::OFFSET > 0 {
                // SAFETY: `s` is this block's scales; sp < per_block.
                let mv = unsafe { F::offset_multipliers(&s, sp) };
                for (r, sum) in isum.iter_mut().enumerate() {
                    // SAFETY: the row's lane sums hold 8 per span (`Q8Rows::q8_k`); the caller runs with D's
                    // features.
                    *sum = unsafe {
                        let sum_x = load32(lane_sums.add(8 * (r * spans + si)).cast());
                        D::madd_into(*sum, sum_x, mv)
                    };
                }
            }
            if F::SPAN_TOTALS {
                // SAFETY: `s` is this block's scales; sp < per_block.
                let (mn, neg_dmin) = unsafe { F::min_multipliers(&s, sp) };
                for (r, sum) in isum.into_iter().enumerate() {
                    // SAFETY: one scale per span and row.
                    let dx = unsafe { *scales.add(r * spans + si) };
                    let i4 = _mm_add_epi32(
                        _mm256_castsi256_si128(sum),
                        _mm256_extracti128_si256(sum, 1),
                    );
                    if !F::AFFINE {
                        let i = _mm_hadd_epi32(i4, i4);
                        let i = _mm_cvtss_f32(_mm_cvtepi32_ps(_mm_hadd_epi32(i, i)));
                        totals[r] = i.mul_add(d * dx, totals[r]);
                        continue;
                    }
                    // SAFETY: the row's integer group sums hold the span's 4 groups.
                    let group_sums = unsafe {
                        _mm_loadu_si128(
                            code_sums
                                .add(r * gs + (bi * per_block + sp) * per_span)
                                .cast(),
                        )
                    };
                    let im = _mm_hadd_epi32(i4, _mm_madd_epi16(group_sums, mn));
                    // Lanes 0 and 1: I and M (exact integers), as float32.
                    let im = _mm_cvtepi32_ps(_mm_hadd_epi32(im, im));
                    let (i, m) = (_mm_cvtss_f32(im), _mm_cvtss_f32(_mm_movehdup_ps(im)));
                    totals[r] = i.mul_add(d * dx, totals[r]);
                    totals[r] = m.mul_add(neg_dmin * dx, totals[r]);
                }
                continue;
            }
            for (r, sum) in isum.into_iter().enumerate() {
                // SAFETY: one scale per span and row.
                let scale = _mm256_set1_ps(d * unsafe { *scales.add(r * spans + si) });
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[r]);
            }
        }
        if F::AFFINE && !F::SPAN_TOTALS {
            // The K-quants' 8 offsets against the row's 8 group sums: one vector FMA per block and row.
            let m = F::group_ms(&s);
            for r in 0..R {
                // SAFETY: the row's group sums hold the block's 8 groups (k / GROUP per row, checked sizes).
                let sums = unsafe { _mm256_loadu_ps(sums.add(r * gs + bi * groups)) };
                mvec[r] = _mm256_fmadd_ps(m, sums, mvec[r]);
            }
        }
    }
    for r in 0..R {
        y[r] = if F::SPAN_TOTALS {
            totals[r]
        } else {
            hsum(_mm256_add_ps(acc[r], mvec[r]))
        };
    }
    R
}

/// The group kernel (`GroupKernel`) of a legacy format: tiles of up to 8 activation rows, as `int_row`.
///
/// A row kernel spends most of a 32-element block's instructions on one row's float work (convert, scale,
/// FMA, offset) and its FMA chain. Here a block's eight weight rows meet each activation row, their integer
/// sums end in one vector (lane j: weight row j; `int_group_tile`), and the float work is one convert, one
/// multiply and one FMA per block for all eight rows. An output's arithmetic is its lane's alone, the same for
/// every count and tile size.
#[inline(always)]
unsafe fn int_group_rows<F: SimdFormat, D: IntDot>(
    a: &Activations,
    rows: &[u8],
    row_bytes: usize,
    y: &mut [[f32; GROUP_ROWS]; MAX_T],
) {
    debug_assert_eq!(
        F::BLOCK,
        GROUP,
        "group kernels take the 32-element legacy formats"
    );
    let count = rows.len() / row_bytes;
    debug_assert!((1..=GROUP_ROWS).contains(&count) && rows.len() == count * row_bytes);
    // Lanes past `count` recompute the last row; their outputs are never stored.
    let ptrs: [*const u8; GROUP_ROWS] =
        std::array::from_fn(|j| rows[j.min(count - 1) * row_bytes..].as_ptr());
    // The eight rows are read as eight interleaved streams, which the hardware prefetchers follow poorly (the
    // rows are not in cache in a decode step): the first tile's iteration over each block prefetches its share of
    // the bytes after `rows`, where the next group's rows usually are.
    let ahead = Prefetch::after(rows, a.k / GROUP);
    // The tiles' contract: `ptrs` point at rows of row_bytes = k / 32 blocks.
    in_tiles!(a.t, y, |t0, out| int_group_tile::<F, D>(
        a, &ptrs, t0, out, ahead
    ));
}

int_entries!(
    /// The integer group kernel for legacy block format `F` (blocks of 32, 8-bit activations): eight weight rows
    /// at once, with `products`. Call only if `products.available()`.
    int_group<F: SimdFormat> -> GroupKernel => int_group_rows(
        a: &Activations,
        rows: &[u8],
        row_bytes: usize,
        y: &mut [[f32; GROUP_ROWS]; MAX_T]
    )
);

const CACHE_LINE: usize = 64;

/// How far ahead of the block it computes a row kernel prefetches the row's bytes. The hardware prefetchers
/// alone left Q4_K and Q6_K products at 16-21 GB/s from memory; with this, 23-25 (2026-11-24, AVX2 EPYC, 2
/// threads; 1024 and 4096 bytes did as well).
pub(super) const ROW_PREFETCH: usize = 2048;

/// Prefetches the cache lines of the `bytes` bytes at `p` into L1. A prefetch is a hint: it never faults or changes
/// memory, whatever the address.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn prefetch(p: *const u8, bytes: usize) {
    prefetch_lines::<_MM_HINT_T0>(p, bytes);
}

/// `prefetch` with `_mm_prefetch`'s hint HINT (the cache level the lines go to).
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch_lines<const HINT: i32>(p: *const u8, bytes: usize) {
    for line in (0..bytes).step_by(CACHE_LINE) {
        _mm_prefetch::<HINT>(p.wrapping_add(line).cast());
    }
}

/// Whether this CPU is AMD's (CPUID's vendor), asked once: where a kernel's best instructions differ between AMD's
/// cores and Intel's (`Prefetch`, `q6k_lanes`).
pub(super) fn is_amd() -> bool {
    static AMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AMD.get_or_init(|| {
        // Leaf 0 gives the vendor's name in ebx, edx, ecx: "Auth", "enti", "cAMD" for AMD.
        let vendor = __cpuid(0);
        [vendor.ebx, vendor.edx, vendor.ecx] == [0x6874_7541, 0x6974_6e65, 0x444d_4163]
    })
}

/// Bytes to prefetch while a call computes: `per_block` bytes from `from` per weight block of the call's rows. They
/// go to L1, or on AMD's cores to L2: on a Zen 4 VM (2 threads, cache-cold passes of Qwen2.5-Coder-1.5B's resident
/// matrices beside the L1 build in one process; benches/RESULTS.md, forty-third session) the pass with L1's hint took
/// 1.20-1.28x as long at T = 1 as with L2's (0.94-1.12x at T = 8 and 16), and resident decode went from 0.91x
/// llama.cpp to 1.04x; no software prefetch at all was no faster than L1's. The row kernels' prefetches
/// (`ROW_PREFETCH`, 2 KB ahead in the row being read) keep L1's: with L2's, the same model's plain rows took 1.22-1.30x
/// as long at T = 1. Intel's cores keep L1's everywhere, with which the prefetches were measured there.
#[derive(Clone, Copy)]
pub(super) struct Prefetch {
    from: *const u8,
    per_block: usize,
    /// L2's hint rather than L1's (`is_amd`, asked once a call rather than once a prefetch).
    into_l2: bool,
}

impl Prefetch {
    /// The bytes after `rows` (a call's rows, `blocks` weight blocks long), where the next call's rows usually are
    /// (a prefetch never faults, wherever it points): as many as `rows` has, a share per block.
    pub(super) fn after(rows: &[u8], blocks: usize) -> Prefetch {
        Prefetch {
            from: rows.as_ptr_range().end,
            per_block: rows.len().div_ceil(blocks).next_multiple_of(CACHE_LINE),
            into_l2: is_amd(),
        }
    }

    /// Prefetches the share of block `bi`.
    #[inline(always)]
    pub(super) fn block(self, bi: usize) {
        self.part(bi, 0, 1);
    }

    /// Prefetches part j of `parts` (whole cache lines) of block bi's share: a kernel whose block is many steps
    /// spreads its prefetches over them, so that a burst of them never stalls its loads.
    #[inline(always)]
    pub(super) fn part(self, bi: usize, j: usize, parts: usize) {
        let lines = self.per_block / CACHE_LINE;
        let (first, last) = (lines * j / parts, lines * (j + 1) / parts);
        let (at, bytes) = (
            self.from
                .wrapping_add(bi * self.per_block + first * CACHE_LINE),
            (last - first) * CACHE_LINE,
        );
        // SAFETY: a prefetch is a hint (`prefetch`); every kernel set here has AVX2.
        unsafe {
            if self.into_l2 {
                prefetch_lines::<_MM_HINT_T1>(at, bytes);
            } else {
                prefetch_lines::<_MM_HINT_T0>(at, bytes);
            }
        };
    }
}

/// y[0..R] (lane j: weight row j) for activation rows t0..t0 + R; returns R. Tiles of two or more rows transpose
/// each block's codes into lanes where D's sums hold F's codes (`legacy_lanes::tile`); the others reduce each
/// row's products across lanes (`int_group_reduced_tile`), which one row alone does at less cost. Both give every
/// row's block sum as the same exact integer and do the same float steps after it, so the choice never changes a
/// bit.
///
/// # Safety
/// Each of `ptrs` must point at an encoded row of `a.k / 32` blocks of `F`; t0 + R <= a.t.
#[inline(always)]
unsafe fn int_group_tile<F: SimdFormat, D: IntDot, const R: usize>(
    a: &Activations,
    ptrs: &[*const u8; GROUP_ROWS],
    t0: usize,
    y: &mut [[f32; GROUP_ROWS]],
    ahead: Prefetch,
) -> usize {
    // SAFETY (both): the caller's contract.
    if F::MAX_CODE <= D::LANES_MAX_CODE && R >= 2 {
        unsafe { legacy_lanes::tile::<F, D, R>(a, ptrs, t0, y, ahead) }
    } else {
        unsafe { int_group_reduced_tile::<F, D, R>(a, ptrs, t0, y, ahead) }
    }
}

/// `int_group_tile` reducing each activation row's eight product vectors across lanes (`reduce8`).
///
/// # Safety
/// As `int_group_tile`.
#[inline(always)]
unsafe fn int_group_reduced_tile<F: SimdFormat, D: IntDot, const R: usize>(
    a: &Activations,
    ptrs: &[*const u8; GROUP_ROWS],
    t0: usize,
    y: &mut [[f32; GROUP_ROWS]],
    ahead: Prefetch,
) -> usize {
    let q8 = a.q8_for(F::SPAN);
    let gs = a.k / GROUP;
    // Unsigned codes (affine types, and symmetric ones with an OFFSET) go into maddubs as they are; signed
    // ones (Q8_0) through the sign trick, two more instructions per block, weight row and activation row.
    let unsigned = F::AFFINE || F::OFFSET > 0;
    let mut acc = [_mm256_setzero_ps(); R];
    let mut macc = [_mm256_setzero_ps(); R]; // offsets·Σx̂ (unsigned codes)
    for bi in 0..gs {
        // The first tile of a call prefetches the next call's rows, as the lanes tile does.
        if t0 == 0 {
            ahead.block(bi);
        }
        let off = bi * F::BYTES;
        // SAFETY: block bi of every row is inside it (the caller's contract).
        let (d, m) = unsafe { legacy_scales8(ptrs, off) };
        let m = if F::OFFSET > 0 {
            _mm256_mul_ps(d, _mm256_set1_ps(-f32::from(F::OFFSET)))
        } else {
            m
        };
        let (mut w, mut wu) = (
            [_mm256_setzero_si256(); GROUP_ROWS],
            [_mm256_setzero_si256(); GROUP_ROWS],
        );
        for j in 0..GROUP_ROWS {
            // SAFETY: as above.
            w[j] = unsafe { F::group_codes(ptrs[j].add(off)) };
            wu[j] = if unsigned {
                w[j]
            } else {
                _mm256_sign_epi8(w[j], w[j])
            };
        }
        for r in 0..R {
            let row = (t0 + r) * gs + bi;
            // SAFETY: `matmul` quantized t * k codes and t0 + r < t.
            let x = unsafe { _mm256_loadu_si256(q8.codes.as_ptr().add(row * GROUP).cast()) };
            let mut dots = [_mm256_setzero_si256(); GROUP_ROWS];
            for j in 0..GROUP_ROWS {
                // The products take unsigned by signed bytes: symmetric codes go in as |w|, their sign onto x.
                let x = if unsigned {
                    x
                } else {
                    _mm256_sign_epi8(x, w[j])
                };
                // SAFETY: the caller runs with D's features.
                dots[j] = unsafe { D::widen(D::add_products(_mm256_setzero_si256(), wu[j], x)) };
            }
            let sums = _mm256_cvtepi32_ps(reduce8(dots));
            let scale = _mm256_mul_ps(d, _mm256_set1_ps(q8.scales[row]));
            acc[r] = _mm256_fmadd_ps(sums, scale, acc[r]);
            if unsigned {
                macc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(q8.sums[row]), macc[r]);
            }
        }
    }
    for r in 0..R {
        // SAFETY: y[r] holds GROUP_ROWS floats.
        unsafe { _mm256_storeu_ps(y[r].as_mut_ptr(), _mm256_add_ps(acc[r], macc[r])) };
    }
    R
}

/// Eight vectors of 8 i32 -> one vector whose lane j is the sum of v[j]'s lanes (integer: exact in any order).
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce8(v: [__m256i; GROUP_ROWS]) -> __m256i {
    let pairs = [0, 2, 4, 6].map(|j| _mm256_hadd_epi32(v[j], v[j + 1]));
    // Lanes of q0: v0..v3's low-half sums, then their high-half sums; q1 the same for v4..v7.
    let q0 = _mm256_hadd_epi32(pairs[0], pairs[1]);
    let q1 = _mm256_hadd_epi32(pairs[2], pairs[3]);
    _mm256_add_epi32(
        _mm256_blend_epi32(q0, q1, 0xF0),
        _mm256_permute2x128_si256(q0, q1, 0x21),
    )
}

/// The float16 d (and m) at the start of eight legacy blocks, as two 8-lane vectors (lane j: `ptrs[j] + off`).
/// Every legacy block starts with d, and affine ones follow it with m; for symmetric types the second vector
/// holds code bytes and is never used.
///
/// # Safety
/// Each `ptrs[j] + off` must have 4 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_scales8(ptrs: &[*const u8; GROUP_ROWS], off: usize) -> (__m256, __m256) {
    // SAFETY: guaranteed by the caller.
    let word = |j: usize| unsafe { ptrs[j].add(off).cast::<i32>().read_unaligned() };
    halves8(_mm256_setr_epi32(
        word(0),
        word(1),
        word(2),
        word(3),
        word(4),
        word(5),
        word(6),
        word(7),
    ))
}

/// Eight 32-bit words, each two float16 halves (low: a, high: b), as (a, b) float32 vectors (F16C: exact).
#[target_feature(enable = "avx2,fma,f16c")]
fn halves8(words: __m256i) -> (__m256, __m256) {
    // In each 128-bit half: the four low halves in the low 8 bytes, the four high halves in the high 8.
    let split = _mm256_shuffle_epi8(
        words,
        _mm256_setr_epi8(
            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3,
            6, 7, 10, 11, 14, 15,
        ),
    );
    // 64-bit quarters (a0-3, b0-3, a4-7, b4-7) -> (a0-3, a4-7, b0-3, b4-7).
    let v = _mm256_permute4x64_epi64(split, 0b11_01_10_00);
    (
        _mm256_cvtph_ps(_mm256_castsi256_si128(v)),
        _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1)),
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dense_row<D: SimdDense>(a: &Activations, row: &[u8], y: &mut [f32; MAX_T]) {
    // Two activation rows at a time: each weight chunk is decoded once per pair, and the pair's 8 accumulators
    // stay in registers. The tiles' contract is this function's.
    let mut t0 = 0;
    while t0 < a.t {
        t0 += if a.t - t0 >= 2 {
            unsafe { dense_tile::<D, 2>(a, row, t0, &mut y[t0..]) }
        } else {
            unsafe { dense_tile::<D, 1>(a, row, t0, &mut y[t0..]) }
        };
    }
}

/// y[0..R] for activation rows t0..t0 + R; returns R. Each row sums into four accumulators, one per 8-weight
/// quarter of every 32 weights, so four FMA chains run at once (one chain, bound by the FMA's latency, ran at a
/// third of the memory's rate: BF16 at ~6 GB/s). A row's arithmetic does not depend on R.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dense_tile<D: SimdDense, const R: usize>(
    a: &Activations,
    row: &[u8],
    t0: usize,
    y: &mut [f32],
) -> usize {
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let xs: [*const f32; R] = std::array::from_fn(|r| a.x[(t0 + r) * a.k..].as_ptr());
    let (k32, k8) = (a.k / 32 * 32, a.k / 8 * 8);
    let w_at = |i: usize| row.as_ptr().wrapping_add(i * D::BYTES);
    for i in (0..k32).step_by(32) {
        // SAFETY: the row holds k * D::BYTES bytes and i + 32 <= k; each activation row has k floats.
        let w = [0, 8, 16, 24].map(|o| unsafe { D::load8(w_at(i + o)) });
        for r in 0..R {
            for (j, wj) in w.iter().enumerate() {
                let x = unsafe { _mm256_loadu_ps(xs[r].add(i + 8 * j)) };
                acc[r][j] = _mm256_fmadd_ps(*wj, x, acc[r][j]);
            }
        }
    }
    for i in (k32..k8).step_by(8) {
        // SAFETY: as above, with i + 8 <= k.
        let w = unsafe { D::load8(w_at(i)) };
        for r in 0..R {
            acc[r][0] = _mm256_fmadd_ps(w, unsafe { _mm256_loadu_ps(xs[r].add(i)) }, acc[r][0]);
        }
    }
    for r in 0..R {
        let x = &a.x[(t0 + r) * a.k..][..a.k];
        let tail: f32 = (k8..a.k).map(|i| D::get(row, i) * x[i]).sum();
        let [q0, q1, q2, q3] = acc[r];
        y[r] = hsum(_mm256_add_ps(_mm256_add_ps(q0, q1), _mm256_add_ps(q2, q3))) + tail;
    }
    R
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

/// Q4_x/Q5_x codes of one block as 32 bytes: 16 bytes of nibbles at `qs` (element j < 16: low nibble of byte
/// j, else high nibble of byte j - 16), plus bit j of `qh` as bit 4 (Q5 types), minus `offset`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy(qs: *const u8, qh: Option<u32>, offset: i8) -> __m256i {
    // The 16 bytes in both 128-bit halves, the high half shifted right by 4: its low nibbles are the bytes'
    // high nibbles (elements 16..32).
    // SAFETY: the caller passes 16 readable bytes at `qs`.
    let v = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(qs.cast()) });
    let mut codes = _mm256_and_si256(
        _mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4)),
        _mm256_set1_epi8(0x0F),
    );
    if let Some(qh) = qh {
        // byte j gets byte j / 8 of qh, tested against bit j % 8
        let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let select = _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        );
        let spread = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), select);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits);
        codes = _mm256_or_si256(codes, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
    _mm256_sub_epi8(codes, _mm256_set1_epi8(offset))
}

/// `(v >> shift) & mask` on every byte of 32.
#[target_feature(enable = "avx2,fma,f16c")]
fn bits32(v: __m256i, shift: usize, mask: i8) -> __m256i {
    _mm256_and_si256(
        _mm256_srl_epi16(v, _mm_cvtsi32_si128(shift as i32)),
        _mm256_set1_epi8(mask),
    )
}

/// The two little-endian halves at `p` (4 readable bytes), as float32 (F16C: exact).
///
/// # Safety
/// `p` must have 4 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn halves_at(p: *const u8) -> [f32; 2] {
    // SAFETY: guaranteed by the caller.
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(unsafe {
        p.cast::<i32>().read_unaligned()
    }));
    [_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v))]
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

/// The legacy formats (one block = one group of 32): codes from `$codes` (with the block at `$b`); their scales
/// are read eight blocks at a time by `legacy_scales8`. A symmetric type stored with an offset names it, and
/// its unsigned codes `$unsigned` (`SimdFormat::OFFSET`).
macro_rules! legacy_format {
    ($t:ty, max $max:expr, |$b:ident| $codes:expr $(, tiles $tiles:expr)?) => {
        legacy_format!($t, max $max, |$b| $codes, offset 0 => $codes $(, tiles $tiles)?);
    };
    ($t:ty, max $max:expr, |$b:ident| $codes:expr, offset $offset:literal => $unsigned:expr
     $(, tiles $tiles:expr)?) => {
        impl SimdFormat for $t {
            const OFFSET: u8 = $offset;
            const MAX_CODE: u8 = $max;

            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn code_bytes($b: *const u8, _g: usize) -> __m256i {
                // SAFETY: the caller passes `Self::BYTES` readable bytes; the offsets are the block layout's.
                unsafe { $codes }
            }

            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn group_codes($b: *const u8) -> __m256i {
                // SAFETY: as in `code_bytes`.
                unsafe { $unsigned }
            }

            fn int_kernel(products: Products) -> Kernel {
                $(if products == Products::Amx {
                    return Kernel::Group($tiles);
                })?
                if matches!(products, Products::Avx512Vnni | Products::Amx) {
                    return legacy_lanes::wide::<$t>();
                }
                Kernel::Group(int_group::<$t>(products))
            }
        }
    };
}

legacy_format!(blocks::Q8_0, max u8::MAX, |b| load32(b.add(2)), tiles tiles::tiled::<blocks::Q8_0>());
legacy_format!(blocks::Q4_0, max 15, |b| legacy(b.add(2), None, 8), offset 8 => legacy(b.add(2), None, 0));
legacy_format!(blocks::Q4_1, max 15, |b| legacy(b.add(4), None, 0));
legacy_format!(blocks::Q5_0, max 31, |b| legacy(
    b.add(6),
    Some(b.add(2).cast::<u32>().read_unaligned()),
    16
), offset 16 => legacy(
    b.add(6),
    Some(b.add(2).cast::<u32>().read_unaligned()),
    0
));
legacy_format!(blocks::Q5_1, max 31, |b| legacy(
    b.add(8),
    Some(b.add(4).cast::<u32>().read_unaligned()),
    0
));

/// Q4_K/Q5_K block scales: d, dmin, the 6-bit sub-scales sc[0..8] (multipliers) and offset multipliers mn[0..8]
/// (group g's offset is -dmin·mn[g]).
pub struct KScales {
    d: f32,
    dmin: f32,
    sc: [u8; 8],
    mn: [u8; 8],
}

/// Q4_K/Q5_K scales (d, dmin at 0..4, twelve 6-bit-packed bytes at 4..16: see `blocks::k_scales`), unpacked by
/// 32-bit word operations into sc[0..8] | mn[0..8].
///
/// # Safety
/// `b` must have 16 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k_scales(b: *const u8) -> KScales {
    const LOW6: u32 = 0x3F3F_3F3F;
    const LOW4: u32 = 0x0F0F_0F0F;
    const LOW2: u32 = 0x0303_0303;
    // SAFETY: guaranteed by the caller.
    let ([d, dmin], s) = unsafe {
        (
            halves_at(b),
            [0, 1, 2].map(|i| b.add(4 + 4 * i).cast::<u32>().read_unaligned()),
        )
    };
    // Word i of s holds bytes 4i..4i+4 of the packed field.
    let sc = [s[0] & LOW6, (s[2] & LOW4) | ((s[0] >> 6) & LOW2) << 4];
    let mn = [
        s[1] & LOW6,
        ((s[2] >> 4) & LOW4) | ((s[1] >> 6) & LOW2) << 4,
    ];
    let bytes = |w: [u32; 2]| {
        let [a, b] = w.map(u32::to_le_bytes);
        [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
    };
    KScales {
        d,
        dmin,
        sc: bytes(sc),
        mn: bytes(mn),
    }
}

/// Q4_K and Q5_K: codes from `$codes` (with the block at `$b` and the group at `$g`), scales from `k_scales`;
/// `SuperBlock::SPAN_TOTALS` as given, the integer kernel from `$kernel(products)`.
macro_rules! k_format {
    ($t:ty, span_totals $totals:literal, int_kernel $kernel:expr, |$b:ident, $g:ident| $codes:expr) => {
        impl SimdFormat for $t {
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn code_bytes($b: *const u8, $g: usize) -> __m256i {
                // SAFETY: the caller passes `Self::BYTES` readable bytes; the offsets are the block layout's.
                unsafe { $codes }
            }

            fn int_kernel(products: Products) -> Kernel {
                $kernel(products)
            }
        }

        impl SuperBlock for $t {
            type IntScales = KScales;
            const SPAN_TOTALS: bool = $totals;

            #[inline(always)]
            unsafe fn min_multipliers(s: &KScales, sp: usize) -> (__m128i, f32) {
                // SAFETY: `mn` holds 8 bytes, the span's 4 from 4·sp (sp < 2).
                let mn = unsafe { s.mn.as_ptr().add(4 * sp).cast::<i32>().read_unaligned() };
                (_mm_cvtepu8_epi32(_mm_cvtsi32_si128(mn)), -s.dmin)
            }

            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn int_scales(b: *const u8) -> KScales {
                // SAFETY: the block has `Self::BYTES` >= 16 bytes.
                unsafe { k_scales(b) }
            }

            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn multipliers(s: &KScales, g: usize) -> __m256i {
                _mm256_set1_epi16(i16::from(s.sc[g]))
            }

            fn block_d(s: &KScales) -> f32 {
                s.d
            }

            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn group_ms(s: &KScales) -> __m256 {
                // SAFETY: `mn` holds 8 bytes.
                let mn = unsafe { _mm_loadl_epi64(s.mn.as_ptr().cast()) };
                _mm256_mul_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)),
                    _mm256_set1_ps(-s.dmin),
                )
            }
        }
    };
}

// Q4_K's plain rows: passes over several activation rows regroup each eight rows into the interleaved layout
// (`interleaved::q4_k_plain`).
k_format!(blocks::Q4K, span_totals true, int_kernel interleaved::q4_k_plain, |b, g| bits32(
    load32(b.add(16 + 32 * (g / 2))),
    4 * (g % 2),
    0x0F
));
k_format!(blocks::Q5K, span_totals false, int_kernel |p| Kernel::Row(int::<blocks::Q5K>(p)), |b, g| {
    let (qs, qh) = (load32(b.add(48 + 32 * (g / 2))), load32(b.add(16)));
    let high = _mm256_slli_epi16(bits32(qh, g, 1), 4);
    _mm256_or_si256(bits32(qs, 4 * (g % 2), 0x0F), high)
});

/// Q6_K block scales: d, the sixteen int8 sub-scales as i16 lanes, the first eight in both 128-bit halves of
/// `low`, the last eight in both halves of `high` (so that `multipliers` picks a group's two with one shuffle),
/// and each span's `offset_multipliers`.
pub struct Q6Scales {
    d: f32,
    low: __m256i,
    high: __m256i,
    offsets: [__m256i; 2],
}

/// `_mm256_shuffle_epi8` controls: for j in 0..4, i16 lane 2j of a 128-bit half into all 8 lanes of the low half,
/// lane 2j + 1 into all 8 of the high half.
const Q6_PICK: [[u8; 32]; 4] = {
    let mut c = [[0u8; 32]; 4];
    let mut j = 0;
    while j < 4 {
        let mut i = 0;
        while i < 16 {
            let lane = if i < 8 { 2 * j } else { 2 * j + 1 };
            c[j][2 * i] = (2 * lane) as u8;
            c[j][2 * i + 1] = (2 * lane + 1) as u8;
            i += 1;
        }
        j += 1;
    }
    c
};

impl SimdFormat for blocks::Q6K {
    /// Stored as c = q + 32 in 0..64.
    const OFFSET: u8 = 32;

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn code_bytes(b: *const u8, g: usize) -> __m256i {
        // SAFETY: the caller's contract is `unsigned_codes`'.
        let c = unsafe { Self::unsigned_codes(b, g) };
        _mm256_sub_epi8(c, _mm256_set1_epi8(Self::OFFSET as i8))
    }

    fn int_kernel(products: Products) -> Kernel {
        if products == Products::Amx {
            return Kernel::Group(tiles::tiled::<blocks::Q6K>());
        }
        q6k_lanes::q6_k(products)
    }
}

impl SuperBlock for blocks::Q6K {
    type IntScales = Q6Scales;
    const SPAN_TOTALS: bool = true;

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int_scales(b: *const u8) -> Q6Scales {
        // SAFETY: the block has 210 bytes: scales at 192..208, d at 208.
        let (sc, d) = unsafe {
            (
                _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192).cast())),
                b.add(208).cast::<u16>().read_unaligned(),
            )
        };
        // -OFFSET·scale fits 16 bits (|scale| <= 128); zero-extended, each i32 lane's high half is 0.
        let offsets = _mm256_mullo_epi16(sc, _mm256_set1_epi16(-i16::from(Self::OFFSET)));
        Q6Scales {
            d: _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(d)))),
            low: _mm256_permute2x128_si256(sc, sc, 0x00),
            high: _mm256_permute2x128_si256(sc, sc, 0x11),
            offsets: [
                _mm256_cvtepu16_epi32(_mm256_castsi256_si128(offsets)),
                _mm256_cvtepu16_epi32(_mm256_extracti128_si256(offsets, 1)),
            ],
        }
    }

    /// Codes 0..64 (q + 32), as stored: group g = 4h + t takes its 4 low bits at bit 4·(t / 2) of ql[64h + 32·(t
    /// % 2)..], its 2 high bits at bit 2t of qh[32h..].
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unsigned_codes(b: *const u8, g: usize) -> __m256i {
        let (h, t) = (g / 4, g % 4);
        // SAFETY: the caller passes `Self::BYTES` readable bytes; the offsets are the block layout's.
        let (ql, qh) = unsafe {
            (
                load32(b.add(64 * h + 32 * (t % 2))),
                load32(b.add(128 + 32 * h)),
            )
        };
        let high = _mm256_slli_epi16(bits32(qh, 2 * t, 3), 4);
        _mm256_or_si256(bits32(ql, 4 * (t / 2), 0x0F), high)
    }

    #[inline(always)]
    unsafe fn offset_multipliers(s: &Q6Scales, sp: usize) -> __m256i {
        s.offsets[sp]
    }

    /// Two sub-blocks of 16 per group: their int8 scales multiply the pair-sums of elements 0..16 (i16 lanes
    /// 0-7) and 16..32 (lanes 8-15) inside `madd`. (|pair-sum| <= 2·63·127 < 2^15 and |scale| <= 128: an i32
    /// lane stays below 2^22 per group, below 2^24 over a span of 4 groups; the offset's -32·scale·Σx, |Σx| <=
    /// 16·127, adds at most 2^23. The integer sums are exact, and so is the span's total over its 8 lanes (below
    /// 2^27, `SPAN_TOTALS`); its conversion to float32 rounds only above 2^24, which only codes and activations
    /// at their extremes together could pass, and then the same way in every kernel.)
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn multipliers(s: &Q6Scales, g: usize) -> __m256i {
        let source = if g < 4 { s.low } else { s.high };
        // SAFETY: each control is 32 bytes.
        _mm256_shuffle_epi8(source, unsafe {
            _mm256_loadu_si256(Q6_PICK[g % 4].as_ptr().cast())
        })
    }

    fn block_d(s: &Q6Scales) -> f32 {
        s.d
    }

    /// Q6_K is symmetric: no offsets.
    #[inline(always)]
    unsafe fn group_ms(_s: &Q6Scales) -> __m256 {
        _mm256_setzero_ps()
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

/// TQ1_0/TQ2_0: ternary codes c (0..=2; TQ2_0's 2-bit field may hold a stray 3) with one float16 scale d per
/// block of 256 (at byte `D_AT`): weight = d · (c - 1).
trait Ternary: Format {
    const D_AT: usize;
    /// Codes c of group `g` of the block at `b` (`Self::BYTES` readable bytes), byte j = element j.
    unsafe fn unsigned_codes(b: *const u8, g: usize) -> __m256i;
}

impl<F: Ternary> SimdFormat for F {
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn code_bytes(b: *const u8, g: usize) -> __m256i {
        // SAFETY: the caller's contract is `unsigned_codes`'.
        _mm256_sub_epi8(unsafe { F::unsigned_codes(b, g) }, _mm256_set1_epi8(1))
    }

    fn int_kernel(products: Products) -> Kernel {
        Kernel::Row(ternary::<F>(products))
    }
}

#[inline(always)]
unsafe fn ternary_row<F: Ternary, D: IntDot>(a: &Activations, row: &[u8], y: &mut [f32; MAX_T]) {
    // Tiles of up to 8 activation rows (`in_tiles`) share each group's decoded codes, as in `int_row`. The tiles'
    // contract is this function's.
    in_tiles!(a.t, y, |t0, out| ternary_rows::<F, D>(a, row, t0, out));
}

int_entries!(
    /// The integer row kernel for ternary format `F`, with `products`. Call only if `products.available()`.
    ternary<F: Ternary> -> RowKernel => ternary_row(a: &Activations, row: &[u8], y: &mut [f32; MAX_T])
);

/// y[0..R] for activation rows t0..t0 + R; returns R.
///
/// Σ (c - 1)·x = Σ c·x - Σ x over an activation span (a whole block, `TERNARY_SPAN`): the unsigned codes go
/// straight into the products (no sign trick), whose sums over the span's 8 groups stay small (pair-sums
/// |c·x + c'·x'| <= 2·3·127, <= 6096 over the span: `IntDot::add_products`' bound); one `widen` per span, and
/// the span's Σx (`Q8Rows::lane_sums`, 8 lanes) comes off in 32 bits. The integer sum is exact; each row has its
/// own accumulators, so its result does not depend on R.
#[inline(always)]
unsafe fn ternary_rows<F: Ternary, D: IntDot, const R: usize>(
    a: &Activations,
    row: &[u8],
    t0: usize,
    y: &mut [f32],
) -> usize {
    let q8 = a.q8_for(F::SPAN);
    let span = F::SPAN;
    let (groups, per_block, per_span) = (F::BLOCK / GROUP, F::BLOCK / span, span / GROUP);
    let spans = a.k / span;
    let mut acc = [_mm256_setzero_ps(); R];
    for (bi, b) in row.chunks_exact(F::BYTES).enumerate() {
        prefetch(b.as_ptr().wrapping_add(ROW_PREFETCH), F::BYTES);
        // SAFETY: the block holds its d at D_AT..D_AT + 2.
        let d = unsafe { b.as_ptr().add(F::D_AT).cast::<u16>().read_unaligned() };
        let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(d))));
        for sp in 0..per_block {
            let mut products = [_mm256_setzero_si256(); R];
            for g in sp * per_span..(sp + 1) * per_span {
                // SAFETY: `b` holds F::BYTES bytes.
                let c = unsafe { F::unsigned_codes(b.as_ptr(), g) };
                let gi = bi * groups + g;
                for r in 0..R {
                    // SAFETY: `matmul` quantized t * k codes (t0 + r < t) and checked row.len() == k / BLOCK *
                    // BYTES, so group gi of row t0 + r is inside them.
                    let x = unsafe {
                        load32(q8.codes.as_ptr().add((t0 + r) * a.k + gi * GROUP).cast())
                    };
                    // SAFETY: the caller runs with D's features.
                    products[r] = unsafe { D::add_products(products[r], c, x) };
                }
            }
            let si = bi * per_block + sp;
            for r in 0..R {
                // SAFETY: the row's lane sums hold 8 per span, `spans` spans (`Q8Rows::q8_k`).
                let sum_x = unsafe {
                    load32(
                        q8.lane_sums
                            .as_ptr()
                            .add(8 * ((t0 + r) * spans + si))
                            .cast(),
                    )
                };
                // SAFETY: the caller runs with D's features.
                let isum = _mm256_sub_epi32(unsafe { D::widen(products[r]) }, sum_x);
                let scale = _mm256_set1_ps(d * q8.scales[(t0 + r) * spans + si]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r]);
            }
        }
    }
    for r in 0..R {
        y[r] = hsum(acc[r]);
    }
    R
}

impl Ternary for blocks::TQ2_0 {
    const D_AT: usize = 64;

    /// Group g = 4h + l: bits 2l..2l+2 of qs[32h..32h + 32].
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unsigned_codes(b: *const u8, g: usize) -> __m256i {
        // SAFETY: the caller passes 66 readable bytes; qs is 0..64.
        bits32(unsafe { load32(b.add(32 * (g / 4))) }, 2 * (g % 4), 3)
    }
}

/// Trit n of each of 32 TQ1_0 bytes (`blocks::tq1_trit`), with 3ⁿ in `pow3`'s 16-bit lanes (a lane's two bytes
/// share it): the bytes times 3ⁿ mod 256, each moved to the high byte of its lane, then (· 3) >> 8 by `mulhi`.
#[target_feature(enable = "avx2,fma,f16c")]
fn trits(bytes: __m256i, pow3: __m256i) -> __m256i {
    // (low byte · 3ⁿ mod 256) << 8: the product's high byte is shifted out.
    let low = _mm256_slli_epi16(_mm256_mullo_epi16(bytes, pow3), 8);
    // (high byte · 256 · 3ⁿ) mod 2¹⁶ = (high byte · 3ⁿ mod 256) << 8.
    let high = _mm256_mullo_epi16(
        _mm256_and_si256(bytes, _mm256_set1_epi16(0xFF00u16 as i16)),
        pow3,
    );
    let three = _mm256_set1_epi16(3);
    _mm256_or_si256(
        _mm256_mulhi_epu16(low, three),
        _mm256_slli_epi16(_mm256_mulhi_epu16(high, three), 8),
    )
}

impl Ternary for blocks::TQ1_0 {
    const D_AT: usize = 52;

    /// Groups 0-4: trit g of qs[0..32]; 5 and 6: trits 2(g - 5) and 2(g - 5) + 1 of qs[32..48] (one per 128-bit
    /// half); 7: trit 4 of qs[32..48], then the 4 bytes of qh four times with trits 0, 1, 2, 3 (`blocks::tq1_place`).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unsigned_codes(b: *const u8, g: usize) -> __m256i {
        let pow = |n: usize| _mm_set1_epi16(i16::from(blocks::POW3[n]));
        // SAFETY (all loads): the caller passes 54 readable bytes; qs is 0..48, qh 48..52.
        let (bytes, pow3) = unsafe {
            match g {
                0..=4 => (load32(b), _mm256_set1_epi16(i16::from(blocks::POW3[g]))),
                5 | 6 => (
                    _mm256_broadcastsi128_si256(_mm_loadu_si128(b.add(32).cast())),
                    _mm256_set_m128i(pow(2 * g - 9), pow(2 * g - 10)),
                ),
                _ => (
                    _mm256_set_m128i(
                        _mm_set1_epi32(b.add(48).cast::<i32>().read_unaligned()),
                        _mm_loadu_si128(b.add(32).cast()),
                    ),
                    _mm256_set_m128i(_mm_setr_epi16(1, 1, 3, 3, 9, 9, 27, 27), pow(4)),
                ),
            }
        };
        trits(bytes, pow3)
    }
}
