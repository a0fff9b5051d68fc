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

/// Cached positions per attention task. A task attends the query heads of one KV head (GQA's group, which share
/// its keys and values: each is read once for all of them) over one chunk of positions, and the chunks' partial
/// softmaxes are merged in order. Chunks start at fixed multiples of CHUNK, so a query's result depends on neither
/// the rows nor the threads beside it. Per query head, as before, a SmolLM2 step at 2,900 cached positions read each
/// KV head's 1.5 MB of keys and values (past the L2) once for each of its 3 query heads.
const CHUNK: usize = 256;
/// Attention tasks per kernel thread at least, where the cache is long enough for them (see `attend`).
const TASKS_PER_THREAD: usize = 2;

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
    // Tasks: (KV head, chunk of positions, part of its group of query heads). Each writes, for every new row and
    // each of its query heads, the chunk's partial softmax [acc (hd), peak, total]; they are merged below in chunk
    // order. A group is split only where there are too few (KV head, chunk) pairs to keep every thread busy (a
    // short cache): how heads are grouped changes no result, only how often a key is read.
    let team = team()?;
    let group = hq / hkv;
    let chunks = end.div_ceil(CHUNK);
    let parallel = t * hq * end * hd >= MIN_PARALLEL_WORK && team.threads() > 1;
    let splits = if parallel {
        group.min((TASKS_PER_THREAD * team.threads()).div_ceil(hkv * chunks))
    } else {
        1
    };
    let part = hd + 2;
    let mut partials = vec![0f32; hkv * chunks * t * group * part];
    let at = |kv: usize, c: usize, ti: usize| ((kv * chunks + c) * t + ti) * group * part;
    let parts_ptr = OutPtr(partials.as_mut_ptr());
    let task = |i: usize| {
        let (kv, c, split) = (i / (chunks * splits), i / splits % chunks, i % splits);
        let heads = split * group / splits..(split + 1) * group / splits;
        let first = c * CHUNK;
        let n = CHUNK.min(end - first);
        let keys = &cache_k[(kv * capacity + first) * hd..][..n * hd];
        let values = &cache_v[(kv * capacity + first) * hd..][..n * hd];
        let mut scores = vec![0f32; heads.len() * n];
        for ti in 0..t {
            let allowed = |j: usize| mask.is_none_or(|m| m[ti * end + first + j] != 0);
            // SAFETY: the partials of (kv, c, ti) and these heads (inside the buffer's hkv * chunks * t * group *
            // part) are this task's alone.
            let out = unsafe {
                std::slice::from_raw_parts_mut(
                    parts_ptr.at(at(kv, c, ti) + heads.start * part),
                    heads.len() * part,
                )
            };
            let x = Chunk {
                hd,
                queries: &qkv[ti * width + (kv * group + heads.start) * hd..][..heads.len() * hd],
                keys,
                values,
                scores: &mut scores,
                out,
            };
            chunk_query(x, allowed);
        }
    };
    let tasks = hkv * chunks * splits;
    if !parallel {
        (0..tasks).for_each(task);
    } else if !team.run(tasks, &task) {
        return Err(KernelError::Panicked);
    }
    for ti in 0..t {
        for h in 0..hq {
            let (kv, g) = (h / group, h % group);
            let parts = (0..chunks).map(|c| &partials[at(kv, c, ti) + g * part..][..part]);
            merge(parts, &mut out[(ti * hq + h) * hd..][..hd]);
        }
    }
    Ok(())
}

/// One chunk of a KV head's cache [n positions] and the query heads of its group: queries [group, hd], the
/// chunk's keys and values [n, hd]; `scores` [group, n] is scratch; `out` [group, hd + 2] receives each head's
/// partial softmax (see `chunk_query`).
struct Chunk<'a> {
    hd: usize,
    queries: &'a [f32],
    keys: &'a [f32],
    values: &'a [f32],
    scores: &'a mut [f32],
    out: &'a mut [f32],
}

/// Each query head's partial softmax over the chunk's allowed positions j: [Σ_j p_j · values[j], peak, Σ_j p_j]
/// with p_j = e^(q · keys[j] / sqrt(hd) - peak) and peak the largest such score (-inf, and zeros, where no
/// position is allowed). Each key and value is read once for all the heads of the group. With AVX2 + FMA
/// compiled for them (the same steps, so the same bits: no operation is fused or reordered by the compiler).
fn chunk_query(x: Chunk, allowed: impl Fn(usize) -> bool) {
    #[cfg(target_arch = "x86_64")]
    if super::avx2::available() {
        // SAFETY: the CPU has AVX2 and FMA.
        return unsafe { chunk_query_avx2(x, allowed) };
    }
    partial_softmax(x, allowed);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn chunk_query_avx2(x: Chunk, allowed: impl Fn(usize) -> bool) {
    partial_softmax(x, allowed);
}

#[inline(always)]
fn partial_softmax(x: Chunk, allowed: impl Fn(usize) -> bool) {
    let Chunk {
        hd,
        queries,
        keys,
        values,
        scores,
        out,
    } = x;
    let n = keys.len() / hd;
    let scale = 1.0 / (hd as f32).sqrt();
    for (j, k) in keys.chunks_exact(hd).enumerate() {
        let ok = allowed(j);
        for (g, q) in queries.chunks_exact(hd).enumerate() {
            scores[g * n + j] = if ok {
                dot(q, k) * scale
            } else {
                f32::NEG_INFINITY
            };
        }
    }
    for (s, o) in scores.chunks_exact_mut(n).zip(out.chunks_exact_mut(hd + 2)) {
        let peak = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        o.fill(0.0);
        o[hd] = peak;
        if peak == f32::NEG_INFINITY {
            s.fill(0.0); // nothing allowed: no weight
            continue;
        }
        // The weights e^(score - peak) in one pass that vectorizes (`exp`), 0 exactly where masked (`exp` never
        // gives 0: it clamps at e^-86).
        for p in s.iter_mut() {
            *p = if *p == f32::NEG_INFINITY {
                0.0
            } else {
                exp(*p - peak)
            };
        }
    }
    for (j, v) in values.chunks_exact(hd).enumerate() {
        for (g, o) in out.chunks_exact_mut(hd + 2).enumerate() {
            let p = scores[g * n + j];
            if p == 0.0 {
                continue;
            }
            o[hd + 1] += p;
            for (a, x) in o[..hd].iter_mut().zip(v) {
                *a += p * x;
            }
        }
    }
}

/// A query head's attention output from its chunks' partial softmaxes [acc (hd), peak, total], in chunk order:
/// Σ_c acc_c · e^(peak_c - peak) / Σ_c total_c · e^(peak_c - peak) over the chunks with an allowed position, the
/// factor exactly 1 for the chunk holding the peak (so that one chunk gives acc / total, bit for bit). NaN where no
/// position is allowed, as SDPA gives for an all-false mask row.
fn merge<'a>(parts: impl Iterator<Item = &'a [f32]> + Clone, dst: &mut [f32]) {
    let hd = dst.len();
    let peak = parts.clone().fold(f32::NEG_INFINITY, |m, p| m.max(p[hd]));
    if peak == f32::NEG_INFINITY {
        dst.fill(f32::NAN);
        return;
    }
    dst.fill(0.0);
    let mut total = 0f32;
    for p in parts.filter(|p| p[hd] != f32::NEG_INFINITY) {
        let factor = if p[hd] == peak {
            1.0
        } else {
            exp(p[hd] - peak)
        };
        total += p[hd + 1] * factor;
        for (d, a) in dst.iter_mut().zip(&p[..hd]) {
            *d += a * factor;
        }
    }
    for d in dst.iter_mut() {
        *d /= total;
    }
}

/// Σ a·b in 8 independent partial sums (so the compiler keeps them in vector lanes); inlined into
/// `partial_softmax`, so that it is compiled with its target features.
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

    /// `chunk_query` as this CPU runs it (compiled for AVX2 + FMA where it has them) against the portable build,
    /// bit for bit: groups of 1-3 query heads, masked and unmasked positions, scores far below the peak, lengths
    /// not a multiple of 8, a chunk with nothing allowed.
    #[test]
    fn a_chunk_gives_the_portable_builds_bits() {
        let mut rnd = uniform(11);
        for (hd, len, group) in [(64, 37, 3), (128, 130, 2), (8, 1, 1)] {
            let queries: Vec<f32> = (0..group * hd).map(|_| 30.0 * rnd()).collect();
            let keys: Vec<f32> = (0..len * hd).map(|_| rnd()).collect();
            let values: Vec<f32> = (0..len * hd).map(|_| rnd()).collect();
            for allowed in [|j: usize| j % 5 != 3, |_: usize| false] {
                let mut scores = vec![0f32; group * len];
                let (mut out, mut portable) =
                    (vec![0f32; group * (hd + 2)], vec![1f32; group * (hd + 2)]);
                for (out, portable) in [(&mut out, false), (&mut portable, true)] {
                    let x = Chunk {
                        hd,
                        queries: &queries,
                        keys: &keys,
                        values: &values,
                        scores: &mut scores,
                        out,
                    };
                    if portable {
                        partial_softmax(x, allowed);
                    } else {
                        chunk_query(x, allowed);
                    }
                }
                assert!(
                    out.iter()
                        .zip(&portable)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "hd {hd}, {len} positions, group {group}"
                );
                assert!(out.iter().all(|a| !a.is_nan()));
            }
        }
    }

    /// Random new rows [t, (Hq + 2 Hkv) hd], caches [Hkv, capacity, hd] and rotations [t, R/2].
    struct Inputs {
        qkv: Vec<f32>,
        cache_k: Vec<f32>,
        cache_v: Vec<f32>,
        cos: Vec<f32>,
        sin: Vec<f32>,
    }

    impl Inputs {
        fn draw(s: AttentionShape, t: usize, capacity: usize, seed: u64) -> Inputs {
            let (hkv, hd) = (s.n_kv_heads, s.head_dim);
            let mut rnd = uniform(seed);
            let qkv = (0..t * (s.n_heads + 2 * hkv) * hd).map(|_| rnd()).collect();
            let cache_k = (0..hkv * capacity * hd).map(|_| rnd()).collect();
            let cache_v = (0..hkv * capacity * hd).map(|_| rnd()).collect();
            let angles: Vec<f32> = (0..t * s.rope_dim / 2).map(|i| 0.3 * i as f32).collect();
            let (cos, sin) = angles.iter().map(|a| (a.cos(), a.sin())).unzip();
            Inputs {
                qkv,
                cache_k,
                cache_v,
                cos,
                sin,
            }
        }
    }

    /// Runs `attend` for t new rows at `start` (causal, with position 1 hidden from row 0) on random caches and
    /// checks every output against attention written the plain way in float64 (rotate, then softmax over allowed
    /// positions) and every written key against its rotation. Returns (out, the caches after the call).
    fn check_against_float64(
        s: AttentionShape,
        t: usize,
        start: usize,
        capacity: usize,
        seed: u64,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (hq, hkv, hd, half) = (s.n_heads, s.n_kv_heads, s.head_dim, s.rope_dim / 2);
        let width = (hq + 2 * hkv) * hd;
        let Inputs {
            qkv,
            mut cache_k,
            mut cache_v,
            cos,
            sin,
        } = Inputs::draw(s, t, capacity, seed);
        let end = start + t;
        let mask: Vec<u8> = (0..t * end)
            .map(|i| u8::from(i % end <= start + i / end && i != 1))
            .collect();
        let (ref_k, ref_v) = (cache_k.clone(), cache_v.clone());
        let mut rotated = qkv.clone();
        let mut out = vec![0f32; t * hq * hd];
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
        // The rotation in float64 (neox pairs (i, i + R/2) of the first R features).
        let rot = |v: &[f32], ti: usize| -> Vec<f64> {
            let mut x: Vec<f64> = v.iter().map(|&f| f64::from(f)).collect();
            for i in 0..half {
                let (c, sn) = (f64::from(cos[ti * half + i]), f64::from(sin[ti * half + i]));
                let (a, b) = (x[i], x[i + half]);
                x[i] = a * c - b * sn;
                x[i + half] = a * sn + b * c;
            }
            x
        };
        let key = |h: usize, j: usize| -> Vec<f64> {
            if j >= start {
                rot(&qkv[(j - start) * width + (hq + h) * hd..][..hd], j - start)
            } else {
                ref_k[(h * capacity + j) * hd..][..hd]
                    .iter()
                    .map(|&f| f64::from(f))
                    .collect()
            }
        };
        let value = |h: usize, j: usize| -> Vec<f64> {
            let src = if j >= start {
                &qkv[(j - start) * width + (hq + hkv + h) * hd..]
            } else {
                &ref_v[(h * capacity + j) * hd..]
            };
            src[..hd].iter().map(|&f| f64::from(f)).collect()
        };
        for ti in 0..t {
            for h in 0..hq {
                let q = rot(&qkv[ti * width + h * hd..][..hd], ti);
                let kv = h / (hq / hkv);
                let scores: Vec<f64> = (0..end)
                    .map(|j| {
                        if mask[ti * end + j] == 0 {
                            f64::NEG_INFINITY
                        } else {
                            let dot: f64 = q.iter().zip(key(kv, j)).map(|(a, b)| a * b).sum();
                            dot / (hd as f64).sqrt()
                        }
                    })
                    .collect();
                let peak = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = scores.iter().map(|s| (s - peak).exp()).collect();
                let total: f64 = p.iter().sum();
                let values: Vec<Vec<f64>> = (0..end).map(|j| value(kv, j)).collect();
                for d in 0..hd {
                    let want: f64 = (0..end).map(|j| p[j] * values[j][d]).sum::<f64>() / total;
                    let got = f64::from(out[(ti * hq + h) * hd + d]);
                    assert!(
                        (got - want).abs() < 1e-5,
                        "t {ti} head {h} d {d}: {got} vs {want}"
                    );
                }
            }
            for h in 0..hkv {
                let pos = start + ti;
                let k: Vec<f64> = cache_k[(h * capacity + pos) * hd..][..hd]
                    .iter()
                    .map(|&f| f64::from(f))
                    .collect();
                assert!(k.iter().zip(key(h, pos)).all(|(a, b)| (a - b).abs() < 1e-6));
            }
        }
        (out, cache_k, cache_v)
    }

    const SHAPE: AttentionShape = AttentionShape {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        rope_dim: 6,
        rope: RopeKind::Neox,
    };

    #[test]
    fn matches_a_float64_reference_with_gqa_partial_rope_and_a_mask() {
        check_against_float64(SHAPE, 3, 2, 8, 3);
    }

    /// Past one chunk of positions: the chunks' partial softmaxes merged (three query heads a KV head).
    #[test]
    fn matches_a_float64_reference_over_several_chunks() {
        let s = AttentionShape {
            n_heads: 6,
            n_kv_heads: 2,
            head_dim: 16,
            rope_dim: 16,
            rope: RopeKind::Neox,
        };
        check_against_float64(s, 3, 2 * CHUNK + 37, 3 * CHUNK, 5);
    }

    /// A row's output does not depend on the rows beside it: three rows at once past two chunks give, bit for bit,
    /// what each gives alone at its position after the rows before it (as decode steps would).
    #[test]
    fn a_rows_output_is_the_same_alone_and_among_others() {
        let (t, start, capacity) = (3, 2 * CHUNK - 2, 3 * CHUNK);
        let (together, ..) = check_against_float64(SHAPE, t, start, capacity, 9);
        let (hq, hkv, hd, half) = (
            SHAPE.n_heads,
            SHAPE.n_kv_heads,
            SHAPE.head_dim,
            SHAPE.rope_dim / 2,
        );
        let width = (hq + 2 * hkv) * hd;
        // The same inputs, fed one row at a time.
        let mut x = Inputs::draw(SHAPE, t, capacity, 9);
        for ti in 0..t {
            let end = start + ti + 1;
            let mask: Vec<u8> = (0..end)
                .map(|j| u8::from(ti * (start + t) + j != 1))
                .collect();
            let mut row = x.qkv[ti * width..][..width].to_vec();
            let mut alone = vec![0f32; hq * hd];
            attend(
                &mut row,
                &mut x.cache_k,
                &mut x.cache_v,
                capacity,
                start + ti,
                &x.cos[ti * half..][..half],
                &x.sin[ti * half..][..half],
                Some(&mask),
                &mut alone,
                SHAPE,
            )
            .unwrap();
            let among = &together[ti * hq * hd..][..hq * hd];
            assert!(
                alone
                    .iter()
                    .zip(among)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "row {ti}"
            );
        }
    }

    /// How the tasks fall to threads changes nothing: one thread and three give the same bits, over a cache of
    /// several chunks and a short one (where a group's heads are split across tasks).
    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let s = AttentionShape {
            n_heads: 12,
            n_kv_heads: 4,
            head_dim: 32,
            rope_dim: 32,
            rope: RopeKind::Neox,
        };
        let runs = |threads: usize| {
            super::super::matmul::set_threads(threads).unwrap();
            [(2 * CHUNK + 5, 4), (3, 2)]
                .map(|(start, t)| check_against_float64(s, t, start, 3 * CHUNK, 13).0)
        };
        let one = runs(1);
        let three = runs(3);
        super::super::matmul::set_threads(0).unwrap();
        assert!(one
            .iter()
            .flatten()
            .zip(three.iter().flatten())
            .all(|(a, b)| a.to_bits() == b.to_bits()));
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
