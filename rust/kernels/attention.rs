//! Self-attention of a few new tokens over a float32 KV cache, in one call: RoPE on the new queries and keys,
//! the new keys and values written into the cache, then grouped-query attention of every new query over the
//! cached positions. On the CPU this replaces ~15 small tensor ops per layer (a decode step's glue).
//!
//! Shapes: T new tokens at positions start..start+T, L = start + T cached positions after the call, Hq / Hkv
//! query / KV heads, hd head size, R = rope_dim (even, <= hd).
//! - qkv [T, (Hq + 2 Hkv) hd]: queries, keys, values of the new tokens (queries and keys rotated in place);
//! - cache_k, cache_v [Hkv, capacity, hd];
//! - cos, sin [T, R/2]: the rotation of each new position;
//! - mask [T, L] (1: may attend), or none: every query attends to all L positions;
//! - out [T, Hq hd].
//!
//! Numerics: float32, scores scaled by 1/sqrt(hd), softmax with the row maximum subtracted (as torch's SDPA).

use super::exp::exp;
use super::matmul::{team, KernelError, OutPtr};

/// How RoPE pairs the features of a head: (2i, 2i+1) (GPT-J, llama.cpp's Llama) or (i, i + R/2) (GPT-NeoX).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeKind {
    Interleaved,
    Neox,
}

/// The heads and rotation of one layer's attention.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub rope: RopeKind,
}

/// Least attention work (query heads x positions x hd, per new token) worth splitting across threads. In a decode
/// step the cached keys and values come from memory (the weights streamed through the caches since the last
/// step), so even a short cache pays to split: SmolLM2 steps at 30-130 cached positions (9 heads of 64) ran
/// 1.045x faster splitting from 2^13 than from 2^16 (Zen 4 VM, 2026-11-27, in-process A/B, 10 of 12 rounds).
const MIN_PARALLEL_WORK: usize = 1 << 13;

fn mismatch(message: String) -> Result<(), KernelError> {
    Err(KernelError::Mismatch(message))
}

/// Rotates qkv's queries and keys, writes keys and values at positions start.. of the cache, and puts the
/// attention output in `out` (see the module for shapes).
#[allow(clippy::too_many_arguments)]
pub fn attend(
    qkv: &mut [f32],
    cache_k: &mut [f32],
    cache_v: &mut [f32],
    capacity: usize,
    start: usize,
    cos: &[f32],
    sin: &[f32],
    mask: Option<&[u8]>,
    out: &mut [f32],
    s: AttentionShape,
) -> Result<(), KernelError> {
    let (hq, hkv, hd, r) = (s.n_heads, s.n_kv_heads, s.head_dim, s.rope_dim);
    if hq == 0 || hkv == 0 || hq % hkv != 0 || hd == 0 || r % 2 != 0 || r > hd {
        return mismatch(format!(
            "heads {hq} / {hkv}, head_dim {hd}, rope_dim {r}: query heads must be a multiple of KV heads, rope_dim \
             even and at most head_dim"
        ));
    }
    let width = (hq + 2 * hkv) * hd;
    let t = qkv.len() / width;
    if t == 0 || qkv.len() != t * width {
        return mismatch(format!(
            "qkv has {} floats, not T rows of {width}",
            qkv.len()
        ));
    }
    let end = start + t;
    if end > capacity || cache_k.len() != hkv * capacity * hd || cache_v.len() != cache_k.len() {
        return mismatch(format!(
            "positions {start}..{end} in caches of {} / {} floats, [{hkv}, {capacity}, {hd}] each",
            cache_k.len(),
            cache_v.len()
        ));
    }
    if cos.len() != t * r / 2 || sin.len() != cos.len() {
        return mismatch(format!(
            "cos / sin have {} / {} floats, [{t}, {}] needs {}",
            cos.len(),
            sin.len(),
            r / 2,
            t * r / 2
        ));
    }
    if mask.is_some_and(|m| m.len() != t * end) {
        return mismatch(format!(
            "mask has {} entries, [{t}, {end}] needs {}",
            mask.map_or(0, <[u8]>::len),
            t * end
        ));
    }
    if out.len() != t * hq * hd {
        return mismatch(format!(
            "out has {} floats, [{t}, {}] needs {}",
            out.len(),
            hq * hd,
            t * hq * hd
        ));
    }
    for (ti, row) in qkv.chunks_exact_mut(width).enumerate() {
        let (cos, sin) = (&cos[ti * r / 2..][..r / 2], &sin[ti * r / 2..][..r / 2]);
        for head in row[..(hq + hkv) * hd].chunks_exact_mut(hd) {
            rotate(&mut head[..r], cos, sin, s.rope);
        }
        let pos = start + ti;
        for h in 0..hkv {
            let at = (h * capacity + pos) * hd;
            cache_k[at..at + hd].copy_from_slice(&row[(hq + h) * hd..][..hd]);
            cache_v[at..at + hd].copy_from_slice(&row[(hq + hkv + h) * hd..][..hd]);
        }
    }
    let (qkv, cache_k, cache_v) = (&*qkv, &*cache_k, &*cache_v);
    let out_ptr = OutPtr(out.as_mut_ptr());
    let head_fn = |h: usize| {
        let mut scores = vec![0f32; end];
        let kv = h / (hq / hkv);
        let keys = &cache_k[kv * capacity * hd..][..end * hd];
        let values = &cache_v[kv * capacity * hd..][..end * hd];
        let mut acc = vec![0f32; hd];
        for ti in 0..t {
            let q = &qkv[ti * width + h * hd..][..hd];
            let allowed = |j: usize| mask.is_none_or(|m| m[ti * end + j] != 0);
            let x = Query {
                q,
                keys,
                values,
                scores: &mut scores,
                acc: &mut acc,
            };
            one_query(x, allowed);
            // SAFETY: row ti, head h of `out` (checked size t * hq * hd) belongs to this task alone.
            let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.at((ti * hq + h) * hd), hd) };
            dst.copy_from_slice(&acc);
        }
    };
    let team = team()?;
    if t * hq * end * hd < MIN_PARALLEL_WORK || team.threads() == 1 {
        (0..hq).for_each(head_fn);
    } else if !team.run(hq, &head_fn) {
        return Err(KernelError::Panicked);
    }
    Ok(())
}

/// One query over a head's cache: q [hd], the cached keys and values [L, hd]; `scores` [L] is scratch and `acc`
/// [hd] receives the output.
struct Query<'a> {
    q: &'a [f32],
    keys: &'a [f32],
    values: &'a [f32],
    scores: &'a mut [f32],
    acc: &'a mut [f32],
}

/// acc = softmax(q · keys[j] / sqrt(hd) over allowed j) · values. With AVX2 + FMA compiled for them (the same
/// steps, so the same bits: no operation is fused or reordered by the compiler).
fn one_query(x: Query, allowed: impl Fn(usize) -> bool) {
    #[cfg(target_arch = "x86_64")]
    if super::avx2::available() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { one_query_avx2(x, allowed) };
    }
    query(x, allowed);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn one_query_avx2(x: Query, allowed: impl Fn(usize) -> bool) {
    query(x, allowed);
}

#[inline(always)]
fn query(x: Query, allowed: impl Fn(usize) -> bool) {
    let Query {
        q,
        keys,
        values,
        scores,
        acc,
    } = x;
    let hd = q.len();
    let scale = 1.0 / (hd as f32).sqrt();
    let mut peak = f32::NEG_INFINITY;
    for (j, (score, k)) in scores.iter_mut().zip(keys.chunks_exact(hd)).enumerate() {
        *score = if allowed(j) {
            dot(q, k) * scale
        } else {
            f32::NEG_INFINITY
        };
        peak = peak.max(*score);
    }
    acc.fill(0.0);
    if peak == f32::NEG_INFINITY {
        acc.fill(f32::NAN); // no position to attend to: what SDPA gives for an all-false mask row
        return;
    }
    // The weights e^(score - peak) in one pass that vectorizes (`exp`), 0 exactly where masked (`exp` never gives
    // 0: it clamps at e^-86).
    for p in scores.iter_mut() {
        *p = if *p == f32::NEG_INFINITY {
            0.0
        } else {
            exp(*p - peak)
        };
    }
    let mut total = 0f32;
    for (&p, v) in scores.iter().zip(values.chunks_exact(hd)) {
        if p == 0.0 {
            continue;
        }
        total += p;
        for (a, x) in acc.iter_mut().zip(v) {
            *a += p * x;
        }
    }
    for a in acc.iter_mut() {
        *a /= total;
    }
}

/// Σ a·b in 8 independent partial sums (so the compiler keeps them in vector lanes); inlined into `query`, so
/// that it is compiled with its target features.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// RoPE on one head's first R features x [R] with the position's cos, sin [R/2].
fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32], kind: RopeKind) {
    let half = x.len() / 2;
    for i in 0..half {
        let (a, b) = match kind {
            RopeKind::Interleaved => (2 * i, 2 * i + 1),
            RopeKind::Neox => (i, i + half),
        };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * cos[i] - x1 * sin[i];
        x[b] = x0 * sin[i] + x1 * cos[i];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pseudo-random floats in [-1, 1).
    fn uniform(mut seed: u64) -> impl FnMut() -> f32 {
        move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    /// `one_query` as this CPU runs it (compiled for AVX2 + FMA where it has them) against the portable build,
    /// bit for bit: masked and unmasked positions, scores far below the peak, lengths not a multiple of 8.
    #[test]
    fn a_query_gives_the_portable_builds_bits() {
        let mut rnd = uniform(11);
        for (hd, len) in [(64, 37), (128, 130), (8, 1)] {
            let q: Vec<f32> = (0..hd).map(|_| 30.0 * rnd()).collect();
            let keys: Vec<f32> = (0..len * hd).map(|_| rnd()).collect();
            let values: Vec<f32> = (0..len * hd).map(|_| rnd()).collect();
            let allowed = |j: usize| j % 5 != 3;
            let (mut scores, mut acc, mut portable) =
                (vec![0f32; len], vec![0f32; hd], vec![0f32; hd]);
            let (q, keys, values) = (&q[..], &keys[..], &values[..]);
            let scores = &mut scores[..];
            let x = Query {
                q,
                keys,
                values,
                scores,
                acc: &mut acc,
            };
            one_query(x, allowed);
            let x = Query {
                q,
                keys,
                values,
                scores,
                acc: &mut portable,
            };
            query(x, allowed);
            assert!(
                acc.iter()
                    .zip(&portable)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "hd {hd}, {len} positions"
            );
            assert!(acc.iter().all(|a| a.is_finite()));
        }
    }

    /// Attention written the plain way, in float64: rotate, then softmax over allowed positions.
    #[test]
    fn matches_a_float64_reference_with_gqa_partial_rope_and_a_mask() {
        let s = AttentionShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            rope_dim: 6,
            rope: RopeKind::Neox,
        };
        let (t, start, capacity) = (3, 2, 8);
        let width = (4 + 4) * 8;
        let mut rnd = uniform(3);
        let qkv: Vec<f32> = (0..t * width).map(|_| rnd()).collect();
        let mut cache_k: Vec<f32> = (0..2 * capacity * 8).map(|_| rnd()).collect();
        let mut cache_v: Vec<f32> = (0..2 * capacity * 8).map(|_| rnd()).collect();
        let angles: Vec<f32> = (0..t * 3).map(|i| 0.3 * i as f32).collect();
        let (cos, sin): (Vec<f32>, Vec<f32>) = angles.iter().map(|a| (a.cos(), a.sin())).unzip();
        let end = start + t;
        let mask: Vec<u8> = (0..t * end)
            .map(|i| u8::from(i % end <= start + i / end && i != 1))
            .collect();
        let (ref_k, ref_v) = (cache_k.clone(), cache_v.clone());
        let mut rotated = qkv.clone();
        let mut out = vec![0f32; t * 4 * 8];
        attend(
            &mut rotated,
            &mut cache_k,
            &mut cache_v,
            capacity,
            start,
            &cos,
            &sin,
            Some(&mask),
            &mut out,
            s,
        )
        .unwrap();
        // reference: rotate in float64 (neox pairs (i, i + 3) of the first 6 features)
        let rot = |v: &[f32], ti: usize| -> Vec<f64> {
            let mut x: Vec<f64> = v.iter().map(|&f| f64::from(f)).collect();
            for i in 0..3 {
                let (c, sn) = (f64::from(cos[ti * 3 + i]), f64::from(sin[ti * 3 + i]));
                let (a, b) = (x[i], x[i + 3]);
                x[i] = a * c - b * sn;
                x[i + 3] = a * sn + b * c;
            }
            x
        };
        let key = |h: usize, j: usize| -> Vec<f64> {
            if j >= start {
                rot(&qkv[(j - start) * width + (4 + h) * 8..][..8], j - start)
            } else {
                ref_k[(h * capacity + j) * 8..][..8]
                    .iter()
                    .map(|&f| f64::from(f))
                    .collect()
            }
        };
        let value = |h: usize, j: usize| -> Vec<f64> {
            let src = if j >= start {
                &qkv[(j - start) * width + (6 + h) * 8..]
            } else {
                &ref_v[(h * capacity + j) * 8..]
            };
            src[..8].iter().map(|&f| f64::from(f)).collect()
        };
        for ti in 0..t {
            for h in 0..4 {
                let q = rot(&qkv[ti * width + h * 8..][..8], ti);
                let kv = h / 2;
                let scores: Vec<f64> = (0..end)
                    .map(|j| {
                        if mask[ti * end + j] == 0 {
                            f64::NEG_INFINITY
                        } else {
                            q.iter().zip(key(kv, j)).map(|(a, b)| a * b).sum::<f64>() / 8f64.sqrt()
                        }
                    })
                    .collect();
                let peak = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = scores.iter().map(|s| (s - peak).exp()).collect();
                let total: f64 = p.iter().sum();
                for d in 0..8 {
                    let want: f64 = (0..end).map(|j| p[j] * value(kv, j)[d]).sum::<f64>() / total;
                    let got = f64::from(out[(ti * 4 + h) * 8 + d]);
                    assert!(
                        (got - want).abs() < 1e-5,
                        "t {ti} head {h} d {d}: {got} vs {want}"
                    );
                }
            }
            for h in 0..2 {
                let pos = start + ti;
                let k: Vec<f64> = cache_k[(h * capacity + pos) * 8..][..8]
                    .iter()
                    .map(|&f| f64::from(f))
                    .collect();
                assert!(k.iter().zip(key(h, pos)).all(|(a, b)| (a - b).abs() < 1e-6));
            }
        }
    }

    #[test]
    fn mismatched_sizes_are_errors() {
        let s = AttentionShape {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 4,
            rope_dim: 4,
            rope: RopeKind::Interleaved,
        };
        let (mut k, mut v) = (vec![0f32; 16], vec![0f32; 16]);
        let mut qkv = vec![0f32; 16];
        let mut out = vec![0f32; 8];
        let c = [1f32, 1.0];
        assert!(attend(&mut qkv, &mut k, &mut v, 4, 3, &c, &c, None, &mut out, s).is_ok());
        let bad = attend(&mut qkv, &mut k, &mut v, 4, 4, &c, &c, None, &mut out, s); // past capacity
        assert!(matches!(bad, Err(KernelError::Mismatch(_))));
        let bad = attend(
            &mut qkv,
            &mut k,
            &mut v,
            4,
            0,
            &c,
            &c,
            Some(&[1, 1]),
            &mut out,
            s,
        ); // mask [1, 1]
        assert!(matches!(bad, Err(KernelError::Mismatch(_))));
    }
}
