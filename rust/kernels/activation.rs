//! The gate activation of a gated feed-forward network, act(g) · u over a row (the down projection's prologue).
//!
//! SiLU needs e^-g per element: 8960 of them per row and layer for Qwen2.5-1.5B, on the calling thread while the
//! team waits. libm's `expf`, called element by element, took ~25 µs of such a row. Here e^x is one
//! Cephes-style polynomial written with fused multiply-adds and ties-to-even rounding, plain IEEE steps that give
//! the same bits one element at a time or eight to a vector: the loop is compiled twice, portable and with
//! AVX2 + FMA (where LLVM vectorizes it), and the two agree bit for bit (tested), so a CPU's kernel set never
//! changes a product. Relative error against float64: below 2.5e-7 (tested).

/// The activation of a gated feed-forward network's gate: SwiGLU's SiLU, or squared ReLU (BitNet b1.58).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// silu(g) = g / (1 + exp(-g))
    Silu,
    /// relu(g)²
    Relu2,
}

impl Gate {
    /// The gate named `name` (`silu`, `relu2`), if there is one.
    pub fn from_name(name: &str) -> Option<Gate> {
        match name {
            "silu" => Some(Gate::Silu),
            "relu2" => Some(Gate::Relu2),
            _ => None,
        }
    }

    /// out[i] = act(g[i]) · u[i] over a row (all three the same length), in the order the reference computes
    /// it (transformers, llama.cpp): act first, then the product.
    pub fn apply(self, g: &[f32], u: &[f32], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if super::avx2::available() {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { gated_avx2(self, g, u, out) };
        }
        gated(self, g, u, out);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn gated_avx2(gate: Gate, g: &[f32], u: &[f32], out: &mut [f32]) {
    gated(gate, g, u, out);
}

#[inline(always)]
fn gated(gate: Gate, g: &[f32], u: &[f32], out: &mut [f32]) {
    let triples = out.iter_mut().zip(g).zip(u);
    match gate {
        Gate::Silu => triples.for_each(|((o, &g), &u)| *o = silu(g) * u),
        Gate::Relu2 => triples.for_each(|((o, &g), &u)| {
            let r = g.max(0.0);
            *o = r * r * u;
        }),
    }
}

/// g / (1 + e^-g).
#[inline(always)]
pub fn silu(g: f32) -> f32 {
    g / (1.0 + exp(-g))
}

/// e^x for x clamped to [-86, 88] (e^-86 ≈ 4e-38 is still a normal float; e^88 ≈ 1.7e38 is below the largest):
/// x = n ln2 + r with n = round(x log2 e) (ties to even) and |r| <= ln2 / 2, e^r by Cephes' `expf` polynomial,
/// then n added to the exponent bits. Every step is an IEEE operation (fused where written `mul_add`), so a lane
/// of a vector computes what a scalar call does.
#[inline(always)]
fn exp(x: f32) -> f32 {
    // ln 2 in two parts: n · LN2_HI is exact for |n| < 2^9, LN2_LO the rest.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
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
    // y is in [0.7, 1.5) and n in [-124, 127]: the sum of exponents stays a normal float.
    f32::from_bits(y.to_bits().wrapping_add((n as i32 as u32) << 23))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs over the whole range a gate meets, the clamp's edges, zeros and exact integers.
    fn inputs() -> Vec<f32> {
        let mut x: Vec<f32> = (0..200_003).map(|i| -100.0 + i as f32 * 1e-3).collect();
        x.extend([
            0.0,
            -0.0,
            86.0,
            -86.0,
            88.0,
            -88.0,
            1e-30,
            -1e-30,
            0.346_573_6,
            -0.346_573_6,
        ]);
        x.extend((0..64).map(|i| 2f32.powi(i - 32)));
        x
    }

    #[test]
    fn silu_is_within_float_rounding_of_float64() {
        let mut worst = 0f64;
        for g in inputs() {
            let want = f64::from(g) / (1.0 + (-f64::from(g)).exp());
            let got = f64::from(silu(g));
            if g > -80.0 {
                worst = worst.max(((got - want) / want.abs().max(f64::MIN_POSITIVE)).abs());
            } else {
                // Past the clamp e^-g stops growing: silu is then tiny, not exact (|error| < 1e-35).
                assert!(
                    (got - want).abs() < 1e-35,
                    "silu({g}) = {got}, float64 {want}"
                );
            }
        }
        assert!(worst < 2.5e-7, "relative error {worst:e}");
    }

    #[test]
    fn every_kernel_set_gives_the_same_bits() {
        let g = inputs();
        let u: Vec<f32> = (0..g.len()).map(|i| 1.0 - (i % 7) as f32 * 0.25).collect();
        for gate in [Gate::Silu, Gate::Relu2] {
            let mut portable = vec![0f32; g.len()];
            gated(gate, &g, &u, &mut portable);
            let mut chosen = vec![0f32; g.len()];
            gate.apply(&g, &u, &mut chosen);
            // Every element one call of its own: no vector lanes at all.
            let one_by_one: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(&g, &u)| {
                    let mut o = [0f32];
                    gated(gate, &[g], &[u], &mut o);
                    o[0]
                })
                .collect();
            for (i, ((a, b), c)) in portable.iter().zip(&chosen).zip(&one_by_one).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() && a.to_bits() == c.to_bits(),
                    "{gate:?} at g = {}: {a} {b} {c}",
                    g[i]
                );
            }
        }
    }

    #[test]
    fn silu_keeps_its_limits() {
        assert_eq!(silu(0.0), 0.0);
        assert_eq!(silu(100.0), 100.0);
        assert!(silu(-100.0) <= 0.0 && silu(-100.0) > -1e-35);
        assert!(silu(f32::NAN).is_nan());
    }
}
