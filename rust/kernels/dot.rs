//! Portable scalar row kernels: one output row (all T activation rows) from one encoded weight row.
//! The reference structure the SIMD kernels follow; used where AVX2/FMA is not available.

use super::blocks::{Dense, Format, GROUP, MAX_SUBS};
use super::rows::{Activations, MAX_T};

/// y[t] = Σ_groups ( Σ_parts d[s]·Σ q·x  +  m[g]·Σx ) for a block-quantized row; the weights are decoded once
/// per group and used for every activation row.
pub fn quantized_row<F: Format>(a: &Activations, row: &[u8], y: &mut [f32; MAX_T]) {
    let (mut d, mut m) = ([0f32; MAX_SUBS], [0f32; MAX_SUBS]);
    let mut q = [0i32; GROUP];
    let mut acc = [0f32; MAX_T];
    let groups = F::BLOCK / GROUP;
    for (bi, b) in row.chunks_exact(F::BYTES).enumerate() {
        F::scales(b, &mut d, &mut m);
        for g in 0..groups {
            F::codes(b, g, &mut q);
            let gi = bi * groups + g;
            for (ti, acc) in acc[..a.t].iter_mut().enumerate() {
                let x = a.group(ti, gi);
                for (p, (q, x)) in q
                    .chunks_exact(F::SUB)
                    .zip(x.chunks_exact(F::SUB))
                    .enumerate()
                {
                    let dot: f32 = q.iter().zip(x).map(|(&q, &x)| q as f32 * x).sum();
                    *acc += d[g * GROUP / F::SUB + p] * dot;
                }
                if F::AFFINE {
                    *acc += m[g] * a.group_sum(ti, gi);
                }
            }
        }
    }
    *y = acc;
}

/// The integer kernels' reference: y[t] = Σ_groups ( Σ_parts d[s]·dx·Σ q·qx  +  m[g]·Σx̂ ), with qx, dx the
/// activations' 8-bit codes and the scale of their span (`q8`, spans of the format's block) and Σx̂ = dx·Σqx;
/// Σ q·qx is an exact integer sum.
pub fn int_row<F: Format>(a: &Activations, row: &[u8], y: &mut [f32; MAX_T]) {
    let (mut d, mut m) = ([0f32; MAX_SUBS], [0f32; MAX_SUBS]);
    let mut q = [0i32; GROUP];
    let mut acc = [0f32; MAX_T];
    let groups = F::BLOCK / GROUP;
    let q8 = a.q8_for(F::SPAN);
    for (bi, b) in row.chunks_exact(F::BYTES).enumerate() {
        F::scales(b, &mut d, &mut m);
        for g in 0..groups {
            F::codes(b, g, &mut q);
            let gi = bi * groups + g;
            for (ti, acc) in acc[..a.t].iter_mut().enumerate() {
                let (x, dx) = (q8.group(ti, gi), q8.scale(ti, gi));
                for (p, (q, x)) in q
                    .chunks_exact(F::SUB)
                    .zip(x.chunks_exact(F::SUB))
                    .enumerate()
                {
                    let dot: i32 = q.iter().zip(x).map(|(&q, &x)| q * i32::from(x)).sum();
                    *acc += d[g * GROUP / F::SUB + p] * dx * dot as f32;
                }
                if F::AFFINE {
                    *acc += m[g] * q8.sum(ti, gi);
                }
            }
        }
    }
    *y = acc;
}

/// y[t] = Σ_i w[i]·x[t, i] for a dense float row.
pub fn dense_row<D: Dense>(a: &Activations, row: &[u8], y: &mut [f32; MAX_T]) {
    let mut acc = [0f32; MAX_T];
    for i in 0..a.k {
        let w = D::get(row, i);
        for (ti, acc) in acc[..a.t].iter_mut().enumerate() {
            *acc += w * a.x[ti * a.k + i];
        }
    }
    *y = acc;
}
