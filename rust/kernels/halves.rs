//! 16-bit floats as their bits (`u16`): IEEE float16 and bfloat16 to float32 (exact) and from float32 (rounded to
//! nearest, ties to even, as torch's `.to(dtype)` and numpy's `astype` round). Used by the 16-bit KV caches
//! (`kv`) and the float16 scales of the block formats (`blocks`).

/// The float16 with bits `h`, exactly, as float32 (no branch but the select for inf / NaN).
#[inline(always)]
pub fn f16_value(h: u16) -> f32 {
    let h = u32::from(h);
    let (sign, em) = ((h & 0x8000) << 16, h & 0x7FFF);
    // Normals and subnormals: the half's bits in float32's exponent/mantissa place, times 2^112 to rebias the
    // exponent from 15 to 127 (exact: subnormal halves land on normal floats).
    let finite = (f32::from_bits(em << 13) * f32::from_bits((127 + 112) << 23)).to_bits();
    let magnitude = if em >= 0x7C00 {
        em << 13 | 0x7F80_0000 // inf / NaN: exponent all ones, payload kept
    } else {
        finite
    };
    f32::from_bits(sign | magnitude)
}

/// The bits of `x` rounded to float16: to nearest, ties to even; ±inf from 65520 up (the tie between 65504, the
/// largest half, and 2^16); a quiet NaN for a NaN.
#[inline]
pub fn f16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = (bits >> 16) as u16 & 0x8000;
    let a = bits & 0x7FFF_FFFF;
    if a > 0x7F80_0000 {
        return sign | 0x7E00 | (a >> 13) as u16 & 0x01FF;
    }
    if a >= 0x477F_F000 {
        return sign | 0x7C00;
    }
    if a < 0x3880_0000 {
        // Below 2^-14, the smallest normal half: a subnormal half is a multiple of 2^-24, and |x| · 2^24 < 2^10 is
        // exact, so is rounding it (a carry to 2^10 is the smallest normal's bits).
        return sign | (f32::from_bits(a) * 16_777_216.0).round_ties_even() as u16;
    }
    // Normal: keep 10 of the 23 mantissa bits, ties to even (a carry moves into the exponent), and rebias the
    // exponent from 127 to 15.
    let rem = a & 0x1FFF;
    let base = a - rem;
    let up = rem > 0x1000 || (rem == 0x1000 && base & 0x2000 != 0);
    let rounded = if up { base + 0x2000 } else { base };
    sign | ((rounded - (112 << 23)) >> 13) as u16
}

/// The bfloat16 with bits `h` as float32 (its upper half, exactly).
#[inline(always)]
pub fn bf16_value(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// The bits of `x` rounded to bfloat16: to nearest, ties to even (past the largest finite value: ±inf); a quiet
/// NaN for a NaN.
#[inline]
pub fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return (bits >> 16) as u16 | 0x0040;
    }
    let tie_to_even = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(tie_to_even) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same(ours: f32, theirs: f32) -> bool {
        ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan())
    }

    #[test]
    fn halves_widen_as_the_half_crate_does_for_every_value() {
        for h in 0..=u16::MAX {
            assert!(
                same(f16_value(h), half::f16::from_bits(h).to_f32()),
                "{h:#06x}"
            );
            assert!(
                same(bf16_value(h), half::bf16::from_bits(h).to_f32()),
                "{h:#06x}"
            );
        }
    }

    /// Every float16 and bfloat16 value, the ties between neighbours and the floats either side of them, random
    /// floats of every magnitude, the overflow boundaries and NaN round as the half crate rounds them.
    #[test]
    fn floats_round_to_halves_as_the_half_crate_rounds_them() {
        let mut xs: Vec<f32> = vec![
            65504.0,
            65519.996,
            65520.0,
            3.4e38,
            f32::INFINITY,
            0.0,
            f32::MIN_POSITIVE,
        ];
        for h in 0..=u16::MAX {
            for v in [f16_value(h), bf16_value(h)] {
                if v.is_finite() {
                    let next = f32::from_bits(v.to_bits() + 0x1000); // a float16 tie where v is a normal half
                    xs.extend([
                        v,
                        next,
                        f32::from_bits(next.to_bits() - 1),
                        f32::from_bits(next.to_bits() + 1),
                    ]);
                }
            }
            // Ties between neighbouring bfloat16 values and their neighbours.
            let tie = (u32::from(h) << 16) | 0x8000;
            xs.extend([tie - 1, tie, tie + 1].map(f32::from_bits));
        }
        let mut s = 3u64;
        for i in 0..200_000u32 {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            xs.push(f32::from_bits(
                ((s >> 40) as u32 & 0x007F_FFFF) | ((90 + i % 60) << 23),
            ));
        }
        for x in xs.iter().flat_map(|&x| [x, -x]) {
            let (want16, want_bf) = (half::f16::from_f32(x), half::bf16::from_f32(x));
            assert_eq!(f16_bits(x), want16.to_bits(), "{x:e}");
            assert_eq!(bf16_bits(x), want_bf.to_bits(), "{x:e}");
        }
        for nan in [f32::NAN, -f32::NAN, f32::from_bits(0x7F80_0001)] {
            assert!(f16_value(f16_bits(nan)).is_nan() && bf16_value(bf16_bits(nan)).is_nan());
        }
    }
}
