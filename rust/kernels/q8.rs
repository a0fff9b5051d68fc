//! Activations quantized to 8 bits per span of elements, as llama.cpp quantizes them for its integer dot products:
//! - `Q8Rows::q8_0`: spans of 32, exactly llama.cpp's (and gguf-py's) Q8_0 blocks: d = max|x| / 127 rounded to
//!   float16, codes q = round(x / d') with d' the float32 d before rounding (ties away from zero);
//! - `Q8Rows::q8_k`: longer spans (`blocks::K_SPAN`: 128 for the K-quants, llama.cpp's Q8_K takes 256;
//!   `blocks::TERNARY_SPAN`: 256 for the ternary types) with a float32 d = max|x| / 127: a span's integer sums
//!   over several 32-element groups add up before any float work.
//! Either way x ≈ x̂ = d·q. The integer kernels multiply weight codes with these codes and scale each span's
//! integer sum once. Affine weight types (d·q + m) take Σx̂ = d·Σq per 32 elements, as llama.cpp's Q8_1 and
//! Q8_K's bsums, so every product is exactly W · x̂.

use super::blocks::GROUP;

/// x [t, k] as 8-bit codes with one scale per span.
pub struct Q8Rows {
    /// [t, k] codes in -127..=127, row-major.
    pub codes: Vec<i8>,
    /// [t, k / span] scales.
    pub scales: Vec<f32>,
    /// [t, k / GROUP] Σx̂ = scale · Σcodes of each 32 elements (what affine weights' offsets multiply).
    pub sums: Vec<f32>,
    /// [t, k / (span / 8)] Σcodes of each eighth of a span: per span, the integer Σx the ternary kernels take
    /// off their codes' sums, as one vector of 8 lanes (read by the AVX2 kernels only).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub lane_sums: Vec<i32>,
    span: usize,
    k: usize,
}

impl Q8Rows {
    /// x [t, k] in spans of `span` (k a multiple of it): `q8_0` for spans of 32, else `q8_k`.
    pub fn in_spans(x: &[f32], k: usize, span: usize) -> Q8Rows {
        if span == GROUP {
            Q8Rows::q8_0(x, k)
        } else {
            Q8Rows::q8_k(x, k, span)
        }
    }

    /// llama.cpp's Q8_0 of x [t, k] (k a multiple of 32).
    pub fn q8_0(x: &[f32], k: usize) -> Q8Rows {
        Q8Rows::quantize(x, k, GROUP, round_to_f16)
    }

    /// Spans of `span` elements with float32 scales, for the K-quants and ternary types (k a multiple of span).
    pub fn q8_k(x: &[f32], k: usize, span: usize) -> Q8Rows {
        Q8Rows::quantize(x, k, span, |d| d)
    }

    fn quantize(x: &[f32], k: usize, span: usize, stored: fn(f32) -> f32) -> Q8Rows {
        debug_assert!(k % span == 0 && x.len() % k == 0);
        let mut codes = vec![0i8; x.len()];
        let mut scales = Vec::with_capacity(x.len() / span);
        let mut sums = Vec::with_capacity(x.len() / GROUP);
        let encode = encoder();
        for (x, q) in x.chunks_exact(span).zip(codes.chunks_exact_mut(span)) {
            let d = stored(encode(x, q));
            scales.push(d);
            sums.extend(
                q.chunks_exact(GROUP)
                    .map(|g| d * g.iter().map(|&c| i32::from(c)).sum::<i32>() as f32),
            );
        }
        let lane_sums = codes
            .chunks_exact(span / 8)
            .map(|c| c.iter().map(|&c| i32::from(c)).sum())
            .collect();
        Q8Rows {
            codes,
            scales,
            sums,
            lane_sums,
            span,
            k,
        }
    }

    /// Elements per scale.
    pub fn span(&self) -> usize {
        self.span
    }

    /// Codes of group `gi` (32 elements) of activation row `ti`.
    pub fn group(&self, ti: usize, gi: usize) -> &[i8] {
        &self.codes[ti * self.k + gi * GROUP..][..GROUP]
    }

    /// Scale of the span holding group `gi` of activation row `ti`.
    pub fn scale(&self, ti: usize, gi: usize) -> f32 {
        self.scales[ti * (self.k / self.span) + gi * GROUP / self.span]
    }

    /// Σx̂ of group `gi` of activation row `ti`.
    pub fn sum(&self, ti: usize, gi: usize) -> f32 {
        self.sums[ti * (self.k / GROUP) + gi]
    }
}

/// This CPU's encoder of one span's codes into `q`: q = round(x / d) with d = max|x| / 127 (0 when x is all zeros), ties away from
/// zero; returns d. The same bits on every CPU; with AVX2 the loops vectorize (the activations of a decode step are
/// quantized on one thread before every product, so this is on the critical path).
fn encoder() -> fn(&[f32], &mut [i8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return |x, q| unsafe { encode_avx2(x, q) };
    }
    encode_any
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn encode_avx2(x: &[f32], q: &mut [i8]) -> f32 {
    encode_any(x, q)
}

#[inline(always)]
fn encode_any(x: &[f32], q: &mut [i8]) -> f32 {
    // max|x| over 8 lanes, so that the loop vectorizes (max is exact: the order does not matter).
    let mut lanes = [0f32; 8];
    for chunk in x.chunks_exact(8) {
        for (m, v) in lanes.iter_mut().zip(chunk) {
            *m = m.max(v.abs());
        }
    }
    let amax = x
        .chunks_exact(8)
        .remainder()
        .iter()
        .fold(lanes.into_iter().fold(0f32, f32::max), |m, v| {
            m.max(v.abs())
        });
    let d = amax / 127.0;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    for (q, &v) in q.iter_mut().zip(x) {
        // f32::round (ties away from zero) in a form that vectorizes: y - trunc(y) is exact.
        let y = v * id;
        let t = y.trunc();
        let r = if (y - t).abs() >= 0.5 {
            t + 1f32.copysign(y)
        } else {
            t
        };
        // |y| <= 127 (+ rounding), except where 1/d overflows to inf (max|x| below ~3.7e-37): the clamp keeps
        // codes in -127..=127 there too, which the kernels' 16-bit pair sums rely on (a NaN casts to 0).
        *q = r.clamp(-127.0, 127.0) as i8;
    }
    d
}

/// `v` (finite, >= 0, below 65520) rounded to the nearest float16 value, ties to even, as float32: the scale
/// llama.cpp stores in a Q8_0 block.
pub fn round_to_f16(v: f32) -> f32 {
    const TWO_POW_24: f32 = 16_777_216.0;
    if v < 1.0 / 16384.0 {
        // Below 2^-14, the smallest normal float16: subnormals are multiples of 2^-24, and v * 2^24 < 2^10 is
        // exact, so is rounding it.
        return (v * TWO_POW_24).round_ties_even() / TWO_POW_24;
    }
    // Normal float16: keep 10 of float32's 23 mantissa bits, ties to even (a carry moves into the exponent).
    let bits = v.to_bits();
    let rem = bits & 0x1FFF;
    let base = bits - rem;
    let up = rem > 0x1000 || (rem == 0x1000 && base & 0x2000 != 0);
    f32::from_bits(if up { base + 0x2000 } else { base })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_rounding_matches_the_half_crate() {
        let mut s = 7u64;
        for i in 0..200_000u32 {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // magnitudes from 2^-30 to 2^15, every mantissa pattern
            let v = f32::from_bits(((s >> 40) as u32 & 0x007F_FFFF) | ((97 + i % 45) << 23));
            let want = half::f16::from_f32(v).to_f32();
            assert_eq!(round_to_f16(v).to_bits(), want.to_bits(), "{v:e}");
        }
        assert_eq!(round_to_f16(0.0), 0.0);
    }

    /// The vectorized rounding is `f32::round`'s, ties and near-ties included.
    #[test]
    fn codes_round_half_away_from_zero() {
        let mut x: Vec<f32> = (-254..=254).map(|i| i as f32 * 0.5).collect(); // every tie, max 127
        x.extend([
            0.5 - f32::EPSILON / 4.0,
            -(0.5 - f32::EPSILON / 4.0),
            126.49999,
            -1.4999999,
        ]);
        x.resize(x.len().next_multiple_of(32), 0.0);
        let mut q = vec![0i8; x.len()];
        let d = encoder()(&x, &mut q);
        assert_eq!(d, 127.0 / 127.0);
        for (c, v) in q.iter().zip(&x) {
            assert_eq!(i32::from(*c), v.round() as i32, "{v}");
        }
        let mut plain = vec![0i8; x.len()];
        assert_eq!(encode_any(&x, &mut plain), d);
        assert_eq!(plain, q);
    }

    #[test]
    fn codes_and_scales_reconstruct_the_group() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 64) as f32 - 31.5) * 0.1)
            .collect();
        let q = Q8Rows::q8_0(&x, 64);
        for gi in 0..2 {
            let d = q.scale(0, gi);
            assert!(q.group(0, gi).iter().any(|&c| c.abs() == 127));
            for (c, v) in q.group(0, gi).iter().zip(&x[gi * 32..]) {
                assert!((f32::from(*c) * d - v).abs() <= d * 0.51 + v.abs() * 1e-3);
            }
        }
        let zero = Q8Rows::q8_0(&[0.0; 32], 32);
        assert!(zero.codes.iter().all(|&c| c == 0) && zero.scales == [0.0]);
    }

    /// A span so small that 1/d overflows to inf still gets codes in -127..=127 (the kernels' 16-bit pair sums
    /// rely on it): no -128, and zeros stay 0.
    #[test]
    fn codes_stay_within_127_when_the_scale_is_tiny() {
        let mut x = [0f32; 32];
        x[..4].copy_from_slice(&[1e-38, -1e-38, -4e-39, 0.0]);
        let mut q = [0i8; 32];
        let d = encoder()(&x, &mut q);
        assert!(d > 0.0 && (1.0 / d).is_infinite());
        assert_eq!(q[..4], [127, -127, -127, 0]);
    }
}
