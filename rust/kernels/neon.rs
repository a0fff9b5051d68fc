//! NEON integer row kernels (aarch64) for the block-quantized types: the structure of `dot::int_row`, with each
//! group's 32 codes decoded once into two signed 16-byte vectors and met by every activation row of a tile in
//! integer dot products against the activations' 8-bit codes (`q8`).
//!
//! - Every type's codes fit a signed byte as `Format::codes` gives them (re-centred for the symmetric types,
//!   0..=31 for the affine ones), so one signed multiply serves every type: no sign trick as on AVX2.
//! - The multiply is `sdot` (four 8-bit products into each 32-bit lane) where the CPU has the dot-product
//!   extension (FEAT_DotProd, detected at run time), else widening multiplies (`smull`, `smlal2`: two products
//!   summed in 16 bits, |q·x| ≤ 128·127 so two fit) and a pairwise add into 32 bits (`sadalp`).
//! - Each sub-block's integer sum is reduced across lanes (exact) and scaled in scalar float32 in `dot::int_row`'s
//!   order of operations: the results are the scalar kernel's bit for bit, with either multiply, so tokens do not
//!   depend on which aarch64 CPU computes them.
//!
//! NEON itself is part of every aarch64 CPU; only `sdot` needs the run-time check (`dotprod`), which `matmul`
//! makes before it hands out an `Sdot` kernel.

use std::arch::aarch64::*;
use std::arch::asm;

use super::blocks::{self, Format, GROUP, MAX_SUBS};
use super::rows::{in_tiles, Activations, RowKernel, MAX_T};

/// Whether this CPU has the dot-product instructions (`sdot`).
pub fn dotprod() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}

/// How 16 weight codes meet 16 activation codes: acc + four lanes whose sum is Σ w·x.
pub trait Multiply {
    /// # Safety
    /// `Sdot` only where `dotprod()` is true (its callers enable the feature).
    unsafe fn dot(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t;
}

/// `sdot` (FEAT_DotProd). Written as inline assembly: the intrinsic is not stable in Rust.
pub struct Sdot;
impl Multiply for Sdot {
    #[inline(always)]
    unsafe fn dot(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
        let mut acc = acc;
        // SAFETY: a register-only instruction; the caller guarantees the CPU has it.
        unsafe {
            asm!("sdot {acc:v}.4s, {w:v}.16b, {x:v}.16b", acc = inout(vreg) acc, w = in(vreg) w, x = in(vreg) x,
                 options(pure, nomem, nostack, preserves_flags));
        }
        acc
    }
}

/// Base NEON: 8-bit products widened to 16 bits, pairs added, then pairwise into 32 bits.
pub struct Widening;
impl Multiply for Widening {
    #[inline(always)]
    unsafe fn dot(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
        let p = vmull_s8(vget_low_s8(w), vget_low_s8(x));
        vpadalq_s16(acc, vmlal_high_s8(p, w, x))
    }
}

/// A block format whose group codes decode with NEON.
pub trait NeonFormat: Format {
    /// Codes of group `g` (< BLOCK / GROUP) of the block at `b` (`Self::BYTES` readable bytes) as
    /// `Format::codes` gives them: elements 0..16 and 16..32.
    unsafe fn code_bytes(b: *const u8, g: usize) -> (int8x16_t, int8x16_t);
}

/// The integer row kernel of format `F`: `sdot` if `prefer_sdot` and the CPU has it (`dotprod()`), else widening
/// multiplies.
pub fn int<F: NeonFormat>(prefer_sdot: bool) -> RowKernel {
    if prefer_sdot && dotprod() {
        // SAFETY: the CPU has the dot-product instructions (checked just above).
        |a, row, y| unsafe { int_row_sdot::<F>(a, row, y) }
    } else {
        // SAFETY: NEON is part of every aarch64 CPU.
        |a, row, y| unsafe { int_row::<F, Widening>(a, row, y) }
    }
}

#[target_feature(enable = "neon,dotprod")]
unsafe fn int_row_sdot<F: NeonFormat>(a: &Activations, row: &[u8], y: &mut [f32; MAX_T]) {
    // SAFETY: the caller's contract (the CPU has dotprod), which this function's features now assume.
    unsafe { int_row::<F, Sdot>(a, row, y) }
}

/// Tiles of up to 8 activation rows (`in_tiles`) share each group's decoded codes; the weight row (a few hundred
/// bytes) is re-read from L1 cache for each tile.
#[inline(always)]
unsafe fn int_row<F: NeonFormat, M: Multiply>(a: &Activations, row: &[u8], y: &mut [f32; MAX_T]) {
    // The tiles' contract is this function's.
    in_tiles!(a.t, y, |t0, out| int_tile::<F, M>(a, row, t0, out));
}

/// y[0..R] for activation rows t0..t0 + R; returns R.
#[inline(always)]
unsafe fn int_tile<F: NeonFormat, M: Multiply, const R: usize>(
    a: &Activations,
    row: &[u8],
    t0: usize,
    y: &mut [f32],
) -> usize {
    let (mut d, mut m) = ([0f32; MAX_SUBS], [0f32; MAX_SUBS]);
    let mut acc = [0f32; R];
    let groups = F::BLOCK / GROUP;
    let q8 = a.q8_for(F::SPAN);
    for (bi, b) in row.chunks_exact(F::BYTES).enumerate() {
        F::scales(b, &mut d, &mut m);
        for g in 0..groups {
            // SAFETY: `b` holds F::BYTES bytes.
            let (w0, w1) = unsafe { F::code_bytes(b.as_ptr(), g) };
            let gi = bi * groups + g;
            for r in 0..R {
                let (x, dx) = (q8.group(t0 + r, gi).as_ptr(), q8.scale(t0 + r, gi));
                // SAFETY: a group is 32 codes; `M` is the caller's choice (see `Multiply`).
                let (x0, x1) = unsafe { (vld1q_s8(x), vld1q_s8(x.add(16))) };
                let zero = vdupq_n_s32(0);
                if F::SUB == GROUP {
                    let s = vaddvq_s32(unsafe { M::dot(M::dot(zero, w0, x0), w1, x1) });
                    acc[r] += d[g] * dx * s as f32;
                } else {
                    let (s0, s1) = unsafe { (M::dot(zero, w0, x0), M::dot(zero, w1, x1)) };
                    acc[r] += d[2 * g] * dx * vaddvq_s32(s0) as f32;
                    acc[r] += d[2 * g + 1] * dx * vaddvq_s32(s1) as f32;
                }
                if F::AFFINE {
                    acc[r] += m[g] * q8.sum(t0 + r, gi);
                }
            }
        }
    }
    y[..R].copy_from_slice(&acc);
    R
}

/// Low and high nibbles of 16 bytes at `p`: elements j and 16 + j of a legacy block (`blocks::legacy_nibble`).
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> (uint8x16_t, uint8x16_t) {
    // SAFETY: the caller's block holds 16 bytes at p.
    let v = unsafe { vld1q_u8(p) };
    (vandq_u8(v, vdupq_n_u8(0x0F)), vshrq_n_u8::<4>(v))
}

/// 0x10 in byte j where bit j of the little-endian u32 at `p` is set: bit 4 of the Q5_0/Q5_1 codes, elements
/// 0..16 and 16..32.
#[inline(always)]
unsafe fn fifth_bits(p: *const u8) -> (uint8x16_t, uint8x16_t) {
    // SAFETY: the caller's block holds 4 bytes at p.
    let qh = unsafe { vreinterpretq_u8_u32(vdupq_n_u32(p.cast::<u32>().read_unaligned())) };
    // SAFETY: plain NEON on constant tables.
    let (first, bits) = unsafe { (vld1q_u8(QH_FIRST_HALF.as_ptr()), vld1q_u8(QH_BITS.as_ptr())) };
    let high = |index| vandq_u8(vtstq_u8(vqtbl1q_u8(qh, index), bits), vdupq_n_u8(0x10));
    (high(first), high(vaddq_u8(first, vdupq_n_u8(2))))
}

// Byte j of a half takes byte j / 8 of its two qh bytes (the second half's are 2 further on) and tests bit j % 8.
const QH_FIRST_HALF: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1];
const QH_BITS: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];

/// `v - offset` as signed bytes: the byte difference wraps, but the code it stands for (0..=63 minus at most 32)
/// fits an i8, so reading the byte as signed gives it exactly.
#[inline]
#[target_feature(enable = "neon")]
fn centred(v: uint8x16_t, offset: u8) -> int8x16_t {
    vreinterpretq_s8_u8(vsubq_u8(v, vdupq_n_u8(offset)))
}

impl NeonFormat for blocks::Q8_0 {
    unsafe fn code_bytes(b: *const u8, _g: usize) -> (int8x16_t, int8x16_t) {
        // SAFETY: qs are bytes 2..34 of the block.
        unsafe { (vld1q_s8(b.add(2).cast()), vld1q_s8(b.add(18).cast())) }
    }
}

impl NeonFormat for blocks::Q4_0 {
    unsafe fn code_bytes(b: *const u8, _g: usize) -> (int8x16_t, int8x16_t) {
        // SAFETY: qs are bytes 2..18 of the block.
        let (lo, hi) = unsafe { nibbles(b.add(2)) };
        (centred(lo, 8), centred(hi, 8))
    }
}

impl NeonFormat for blocks::Q4_1 {
    unsafe fn code_bytes(b: *const u8, _g: usize) -> (int8x16_t, int8x16_t) {
        // SAFETY: qs are bytes 4..20 of the block.
        let (lo, hi) = unsafe { nibbles(b.add(4)) };
        (centred(lo, 0), centred(hi, 0))
    }
}

impl NeonFormat for blocks::Q5_0 {
    unsafe fn code_bytes(b: *const u8, _g: usize) -> (int8x16_t, int8x16_t) {
        // SAFETY: qh are bytes 2..6, qs 6..22 of the block.
        let ((lo, hi), (h0, h1)) = unsafe { (nibbles(b.add(6)), fifth_bits(b.add(2))) };
        (centred(vorrq_u8(lo, h0), 16), centred(vorrq_u8(hi, h1), 16))
    }
}

impl NeonFormat for blocks::Q5_1 {
    unsafe fn code_bytes(b: *const u8, _g: usize) -> (int8x16_t, int8x16_t) {
        // SAFETY: qh are bytes 4..8, qs 8..24 of the block.
        let ((lo, hi), (h0, h1)) = unsafe { (nibbles(b.add(8)), fifth_bits(b.add(4))) };
        (centred(vorrq_u8(lo, h0), 0), centred(vorrq_u8(hi, h1), 0))
    }
}

/// The 32 bytes at `p` shifted right by `shift` and masked with `mask`.
#[inline(always)]
unsafe fn field(p: *const u8, shift: usize, mask: u8) -> (uint8x16_t, uint8x16_t) {
    let (count, mask) = (vdupq_n_s8(-(shift as i8)), vdupq_n_u8(mask));
    // SAFETY: the caller's block holds 32 bytes at p; a negative count shifts right.
    let f = |o: usize| unsafe { vandq_u8(vshlq_u8(vld1q_u8(p.add(o)), count), mask) };
    (f(0), f(16))
}

/// Q4_K/Q5_K low 4 bits of group g from the 128-byte qs at `qs` (`blocks::k_nibble`).
#[inline(always)]
unsafe fn k_nibbles(qs: *const u8, g: usize) -> (uint8x16_t, uint8x16_t) {
    // SAFETY: qs holds 128 bytes.
    unsafe { field(qs.add(32 * (g / 2)), 4 * (g % 2), 0x0F) }
}

impl NeonFormat for blocks::Q4K {
    unsafe fn code_bytes(b: *const u8, g: usize) -> (int8x16_t, int8x16_t) {
        // SAFETY: qs are bytes 16..144 of the block.
        let (lo, hi) = unsafe { k_nibbles(b.add(16), g) };
        (centred(lo, 0), centred(hi, 0))
    }
}

impl NeonFormat for blocks::Q5K {
    unsafe fn code_bytes(b: *const u8, g: usize) -> (int8x16_t, int8x16_t) {
        // SAFETY: qh are bytes 16..48, qs 48..176 of the block; bit g of qh[j] is bit 4 of element j.
        let ((lo, hi), (h0, h1)) = unsafe { (k_nibbles(b.add(48), g), field(b.add(16), g, 1)) };
        let code = |lo, high| centred(vorrq_u8(lo, vshlq_n_u8::<4>(high)), 0);
        (code(lo, h0), code(hi, h1))
    }
}

impl NeonFormat for blocks::Q6K {
    unsafe fn code_bytes(b: *const u8, g: usize) -> (int8x16_t, int8x16_t) {
        let (h, t) = (g / 4, g % 4);
        // SAFETY: ql are bytes 0..128, qh 128..192 of the block (layout in `blocks::Q6K`).
        let ((l0, l1), (h0, h1)) = unsafe {
            (
                field(b.add(64 * h + 32 * (t % 2)), 4 * (t / 2), 0x0F),
                field(b.add(128 + 32 * h), 2 * t, 3),
            )
        };
        let code = |lo, high| centred(vorrq_u8(lo, vshlq_n_u8::<4>(high)), 32);
        (code(l0, h0), code(l1, h1))
    }
}

impl NeonFormat for blocks::TQ2_0 {
    unsafe fn code_bytes(b: *const u8, g: usize) -> (int8x16_t, int8x16_t) {
        let (h, l) = (g / 4, g % 4);
        // SAFETY: qs are bytes 0..64 of the block.
        let (c0, c1) = unsafe { field(b.add(32 * h), 2 * l, 3) };
        (centred(c0, 1), centred(c1, 1))
    }
}

/// Trit n of each byte of `v`, n given per lane as 3ⁿ in `pow` (`blocks::tq1_trit`): (byte·3ⁿ mod 256)·3 >> 8.
#[inline]
#[target_feature(enable = "neon")]
fn trits(v: uint8x16_t, pow: uint8x16_t) -> uint8x16_t {
    let (p, three) = (vmulq_u8(v, pow), vdup_n_u8(3));
    let lo = vshrn_n_u16::<8>(vmull_u8(vget_low_u8(p), three));
    let hi = vshrn_n_u16::<8>(vmull_u8(vget_high_u8(p), three));
    vcombine_u8(lo, hi)
}

// Byte 4n + j of the qh vector (qh[j], repeated) is multiplied by 3^n to bring trit n to the top.
const QH_TRIT_POW: [u8; 16] = {
    let mut pow = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        pow[i] = blocks::POW3[i / 4];
        i += 1;
    }
    pow
};

impl NeonFormat for blocks::TQ1_0 {
    unsafe fn code_bytes(b: *const u8, g: usize) -> (int8x16_t, int8x16_t) {
        // Element order as `blocks::tq1_place`: groups 0..5 are trit g of qs[0..32]; groups 5 and 6 are trits
        // 0-1 and 2-3 of qs[32..48]; group 7 is trit 4 of qs[32..48], then the 4 trits of the 4 qh bytes
        // (element 240 + 4n + j: trit n of qh[j]).
        let pow = |n: usize| vdupq_n_u8(blocks::POW3[n]);
        // SAFETY: qs are bytes 0..48 and qh 48..52 of the block.
        let (c0, c1) = unsafe {
            match g {
                0..5 => (
                    trits(vld1q_u8(b), pow(g)),
                    trits(vld1q_u8(b.add(16)), pow(g)),
                ),
                5 | 6 => {
                    let v = vld1q_u8(b.add(32));
                    (trits(v, pow(2 * (g - 5))), trits(v, pow(2 * (g - 5) + 1)))
                }
                _ => {
                    let qh =
                        vreinterpretq_u8_u32(vdupq_n_u32(b.add(48).cast::<u32>().read_unaligned()));
                    (
                        trits(vld1q_u8(b.add(32)), pow(4)),
                        trits(qh, vld1q_u8(QH_TRIT_POW.as_ptr())),
                    )
                }
            }
        };
        (centred(c0, 1), centred(c1, 1))
    }
}

#[cfg(test)]
mod tests {
    use super::super::dot;
    use super::super::q8::Q8Rows;
    use super::super::rows::test_bytes as bytes;
    use super::*;

    /// Each group's NEON codes are `Format::codes`, bit for bit, for every group of random blocks (bit 6 of
    /// every byte random too: no scale is read here).
    fn codes_match<F: NeonFormat>() {
        let raw: Vec<u8> = bytes(F::BYTES * 256, 7)
            .into_iter()
            .zip(bytes(F::BYTES * 256, 8))
            .map(|(a, b)| a ^ (b << 1 & 0x40))
            .collect();
        for b in raw.chunks_exact(F::BYTES) {
            for g in 0..F::BLOCK / GROUP {
                let mut want = [0i32; GROUP];
                F::codes(b, g, &mut want);
                let (mut got, (lo, hi)) = ([0i8; GROUP], unsafe { F::code_bytes(b.as_ptr(), g) });
                unsafe {
                    (
                        vst1q_s8(got.as_mut_ptr(), lo),
                        vst1q_s8(got.as_mut_ptr().add(16), hi),
                    )
                };
                assert_eq!(
                    got.map(i32::from),
                    want,
                    "{} group {g}",
                    std::any::type_name::<F>()
                );
            }
        }
    }

    /// Both multiplies give `dot::int_row`'s results bit for bit, for t = 1..=11 activation rows (one tile of
    /// each size 1..=8, then 8 and 1..=3).
    fn rows_match<F: NeonFormat>() {
        let k = 512;
        let row = bytes(k / F::BLOCK * F::BYTES, 3);
        let x: Vec<f32> = bytes(11 * k, 4)
            .iter()
            .map(|&b| f32::from(b) / 127.0 - 1.0)
            .collect();
        let kernels: &[(&str, RowKernel)] = if dotprod() {
            &[("sdot", int::<F>(true)), ("widening", int::<F>(false))]
        } else {
            &[("widening", int::<F>(false))]
        };
        for t in 1..=11 {
            let x = &x[..t * k];
            let a = Activations {
                x,
                sums: Vec::new(),
                q8: vec![Q8Rows::in_spans(x, k, F::SPAN)],
                t,
                k,
            };
            let mut want = [0f32; MAX_T];
            dot::int_row::<F>(&a, &row, &mut want);
            for (name, kernel) in kernels {
                let mut got = [0f32; MAX_T];
                kernel(&a, &row, &mut got);
                // Rows past t stay 0 in both.
                assert_eq!(
                    got.map(f32::to_bits),
                    want.map(f32::to_bits),
                    "{} {name} t={t}",
                    std::any::type_name::<F>()
                );
            }
        }
    }

    #[test]
    fn neon_codes_and_products_are_the_scalar_kernels_for_every_type() {
        fn check<F: NeonFormat>() {
            codes_match::<F>();
            rows_match::<F>();
        }
        check::<blocks::Q8_0>();
        check::<blocks::Q4_0>();
        check::<blocks::Q4_1>();
        check::<blocks::Q5_0>();
        check::<blocks::Q5_1>();
        check::<blocks::Q4K>();
        check::<blocks::Q5K>();
        check::<blocks::Q6K>();
        check::<blocks::TQ1_0>();
        check::<blocks::TQ2_0>();
    }
}
