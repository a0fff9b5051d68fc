//! e^x in plain IEEE steps, for the loops that need many of them on the calling thread (the SiLU gate over a row,
//! the attention softmax): a Cephes-style polynomial written with fused multiply-adds and ties-to-even rounding,
//! which gives the same bits one element at a time or eight to a vector, so a loop compiled both portably and
//! with AVX2 + FMA (where LLVM vectorizes it) computes the same values either way.

/// e^x for x in [-86, 88] (e^-86 ≈ 4e-38 is still a normal float; e^88 ≈ 1.7e38 is below the largest), 0 below
/// and infinity above (NaN stays NaN): x = n ln2 + r with n = round(x log2 e) (ties to even) and |r| <= ln2 / 2,
/// e^r by Cephes' `expf` polynomial, then n added to the exponent bits. Every step is an IEEE operation (fused
/// where written `mul_add`) or a select, so a lane of a vector computes what a scalar call does.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // ln 2 in two parts: n · LN2_HI is exact for |n| < 2^9, LN2_LO the rest.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let (low, high) = (x < -86.0, x > 88.0);
    let x = x.clamp(-86.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let p = 1.987_569_2e-4f32
        .mul_add(r, 1.398_2e-3)
        .mul_add(r, 8.333_452e-3)
        .mul_add(r, 4.166_579_6e-2)
        .mul_add(r, 1.666_666_5e-1)
        .mul_add(r, 0.5);
    let y = p.mul_add(r * r, r) + 1.0;
    // y is in [0.7, 1.5) and n in [-124, 127]: the sum of exponents stays a normal float. n as an integer from the
    // low bits of n + 1.5 · 2^23 (exact for |n| < 2^22), not `n as i32`, whose saturating conversion LLVM turns
    // into one scalar conversion per lane.
    const ROUNDER: f32 = 12_582_912.0;
    let n_bits = (n + ROUNDER).to_bits().wrapping_sub(ROUNDER.to_bits());
    let e = f32::from_bits(y.to_bits().wrapping_add(n_bits << 23));
    if low {
        0.0
    } else if high {
        f32::INFINITY
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_float_rounding_of_float64_and_zero_or_infinite_outside() {
        let mut worst = 0f64;
        // -86 + i / 1000 as float32 stays at or below 88 up to i = 173_999.
        for i in 0..174_000 {
            let x = -86.0 + i as f32 * 1e-3;
            let want = f64::from(x).exp();
            worst = worst.max(((f64::from(exp(x)) - want) / want).abs());
        }
        assert!(worst < 2e-7, "relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(88.0).is_finite() && exp(-86.0) > 0.0);
        assert_eq!((exp(-86.01), exp(f32::NEG_INFINITY)), (0.0, 0.0));
        assert_eq!(
            (exp(88.01), exp(f32::INFINITY)),
            (f32::INFINITY, f32::INFINITY)
        );
        assert!(exp(f32::NAN).is_nan());
    }
}
