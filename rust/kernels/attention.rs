//! Self-attention of a few new tokens over a KV cache, in one call: RoPE on the new queries and keys, the new keys
//! and values written into the cache, then grouped-query attention of every new query over the cached positions.
//! On the CPU this replaces ~15 small tensor ops per layer (a decode step's glue). The cache holds float32,
//! float16 or bfloat16 (`KvCache`); the arithmetic is float32 in every case.
//!
//! Shapes: T new tokens at positions start..start+T, L = start + T cached positions after the call, Hq / Hkv
//! query / KV heads, hd head size, R = rope_dim (even, <= hd).
//! - qkv [T, (Hq + 2 Hkv) hd]: queries, keys, values of the new tokens (queries and keys rotated in place);
//! - cache_k, cache_v [Hkv, capacity, hd], each of any `KvCache` type: new keys and values rounded to it;
//! - cos, sin [T, R/2]: the rotation of each new position;
//! - mask [T, L] (1: may attend), or none: every query attends to all L positions;
//! - parents [T], or none: the new tokens are a token tree (speculative verification): row i's parent is row
//!   parents[i] < i (-1 for row 0, the root, at slot start), and row i sits at position start + depth(i) but in
//!   cache slot start + i. Its positions start + 1 .. start + depth(i) are then its ancestors' slots and its own,
//!   and the arithmetic follows positions, not slots (`Visible`): a node gets the bits a one-token step at its
//!   position gets after its branch, whichever slot it and its ancestors sit in;
//! - out [T, Hq hd].
//!
//! Numerics: float32, scores scaled by 1/sqrt(hd), softmax with the row maximum subtracted (as torch's SDPA);
//! products fused (q · k in 16 lanes folded in halves, weighted values summed over even and odd positions apart).
//! A 16-bit cache's keys and values are widened to float32 (exactly) a block of positions at a time, in L1, so
//! the products and their bits are those of a float32 cache holding the same (rounded) values.

use super::exp::exp;
use super::halves::{bf16_value, f16_value};
use super::kv::{KvCache, KvRows};
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
    cache_k: &mut KvCache,
    cache_v: &mut KvCache,
    capacity: usize,
    start: usize,
    cos: &[f32],
    sin: &[f32],
    mask: Option<&[u8]>,
    parents: Option<&[i64]>,
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
            "positions {start}..{end} in caches of {} / {} elements, [{hkv}, {capacity}, {hd}] each",
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
    let visible = match parents {
        None => None,
        Some(parents) => Some(Visible::of_tree(parents, t, start)?),
    };
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
            cache_k.store(at, &row[(hq + h) * hd..][..hd]);
            cache_v.store(at, &row[(hq + hkv + h) * hd..][..hd]);
        }
    }
    let (qkv, cache_k, cache_v) = (&*qkv, cache_k.rows(), cache_v.rows());
    // Where keys or values are 16-bit, each task widens a block of them at a time into scratch of its own; so it
    // assembles a block that runs from the cache into a tree row's gathered positions.
    let scratch = match (cache_k, cache_v, &visible) {
        (KvRows::F32(_), KvRows::F32(_), None) => 0,
        _ => BLOCK * hd,
    };
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
        let keys = cache_k.part((kv * capacity + first) * hd, n * hd);
        let values = cache_v.part((kv * capacity + first) * hd, n * hd);
        let mut scores = vec![0f32; heads.len() * n];
        let mut block = vec![0f32; scratch];
        // A tree row's gathered positions of this chunk (`Visible`): keys, values and mask.
        let mut gathered = Gathered::default();
        for ti in 0..t {
            // SAFETY: the partials of (kv, c, ti) and these heads (inside the buffer's hkv * chunks * t * group *
            // part) are this task's alone.
            let out = unsafe {
                std::slice::from_raw_parts_mut(
                    parts_ptr.at(at(kv, c, ti) + heads.start * part),
                    heads.len() * part,
                )
            };
            let row_mask = mask.map(|m| &m[ti * end..][..end]);
            // Positions first.. of the row: the cache's slots up to `head`, then (a tree row off its first chain)
            // its ancestors' slots and its own, gathered.
            let (head, tail) = match &visible {
                None => (n, 0),
                Some(v) => v.split(ti, first, n),
            };
            let (tail_keys, tail_values, mask) = match &visible {
                Some(v) if tail > 0 => {
                    let slots = v.tail(ti, first, head, tail);
                    let heads_mask = row_mask.map(|m| (&m[first..][..head], m));
                    gathered.fill((cache_k, cache_v), kv * capacity, slots, hd, heads_mask);
                    let mask = row_mask.map(|_| &gathered.mask[..]);
                    (&gathered.keys[..], &gathered.values[..], mask)
                }
                _ => (&[][..], &[][..], row_mask.map(|m| &m[first..][..head])),
            };
            let x = Chunk {
                hd,
                queries: &qkv[ti * width + (kv * group + heads.start) * hd..][..heads.len() * hd],
                keys: keys.part(0, head * hd),
                values: values.part(0, head * hd),
                tail_keys,
                tail_values,
                mask,
                scores: &mut scores[..heads.len() * (head + tail)],
                block: &mut block,
                out,
            };
            chunk_query(x);
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

/// Where the rows of a token tree attend (`attend`'s parents): each row's slots of its positions start + 1 ..
/// start + depth (its ancestors' below the root, then its own), and whether those are the slots of the same
/// numbers (a row on the tree's first chain, rows 0, 1, 2, ... each the child of the last).
struct Visible {
    start: usize,
    /// Row i's slots at paths[offsets[i]..offsets[i + 1]].
    paths: Vec<usize>,
    offsets: Vec<usize>,
    in_place: Vec<bool>,
}

impl Visible {
    fn of_tree(parents: &[i64], t: usize, start: usize) -> Result<Visible, KernelError> {
        let bad = parents.len() != t
            || parents[0] != -1
            || parents[1..]
                .iter()
                .enumerate()
                .any(|(i, &p)| p < 0 || p > i as i64);
        if bad {
            return Err(KernelError::Mismatch(format!(
                "parents {parents:?}: T = {t} entries, -1 for row 0 and an earlier row for every other"
            )));
        }
        let (mut paths, mut offsets, mut in_place) = (vec![], vec![0, 0], vec![true]);
        for (i, &parent) in parents.iter().enumerate().skip(1) {
            let parent = parent as usize;
            let from = paths.len();
            paths.extend_from_within(offsets[parent]..offsets[parent + 1]);
            paths.push(start + i);
            offsets.push(paths.len());
            in_place.push(
                paths[from..]
                    .iter()
                    .enumerate()
                    .all(|(j, &slot)| slot == start + 1 + j),
            );
        }
        Ok(Visible {
            start,
            paths,
            offsets,
            in_place,
        })
    }

    /// Row ti's positions in the chunk of `n` cache slots from `first`: (head, tail), `head` of them the cache's
    /// own slots first.., then `tail` of the row's gathered ones. A row in place takes the chunk's slots as they
    /// are (the mask hides what is not its own).
    fn split(&self, ti: usize, first: usize, n: usize) -> (usize, usize) {
        if self.in_place[ti] {
            return (n, 0);
        }
        let end = self.start + 1 + self.offsets[ti + 1] - self.offsets[ti]; // the row's positions: 0..end
        let len = end.saturating_sub(first).min(n);
        let head = (self.start + 1).saturating_sub(first).min(len);
        (head, len - head)
    }

    /// The slots of row ti's positions first + head .. first + head + tail (`split`), all past start.
    fn tail(&self, ti: usize, first: usize, head: usize, tail: usize) -> &[usize] {
        &self.paths[self.offsets[ti] + first + head - self.start - 1..][..tail]
    }
}

/// A tree row's gathered positions in one chunk (`Visible`), as float32: keys and values [positions, hd], and the
/// mask of all the row's positions in the chunk where there is one.
#[derive(Default)]
struct Gathered {
    keys: Vec<f32>,
    values: Vec<f32>,
    mask: Vec<u8>,
}

impl Gathered {
    /// One KV head's (its rows from element base · hd) keys and values at `slots`, and with `mask` (the row's
    /// mask over the chunk's first `head` slots, and over all slots) the mask of those positions then of `slots`.
    fn fill(
        &mut self,
        (cache_k, cache_v): (KvRows, KvRows),
        base: usize,
        slots: &[usize],
        hd: usize,
        mask: Option<(&[u8], &[u8])>,
    ) {
        for (cache, dst) in [(cache_k, &mut self.keys), (cache_v, &mut self.values)] {
            dst.resize(slots.len() * hd, 0.0);
            for (&slot, row) in slots.iter().zip(dst.chunks_exact_mut(hd)) {
                // SAFETY: the portable build's widening runs anywhere.
                unsafe { widen_into::<Portable>(cache.part((base + slot) * hd, hd), row) };
            }
        }
        if let Some((head, row)) = mask {
            self.mask.clear();
            self.mask.extend_from_slice(head);
            self.mask.extend(slots.iter().map(|&slot| row[slot]));
        }
    }
}

/// One chunk of a KV head's cache [n positions] and the query heads of its group: queries [group, hd], the
/// chunk's keys and values [n, hd] (the cache's own slots, then a tree row's gathered ones), which of its positions
/// the queries may attend (mask [n], nonzero: may; none: all); `scores` [group, n] and `block` [BLOCK, hd] (empty
/// where keys and values are float32 and none are gathered) are scratch; `out` [group, hd + 2] receives each
/// head's partial softmax (see `chunk_query`).
struct Chunk<'a> {
    hd: usize,
    queries: &'a [f32],
    keys: KvRows<'a>,
    values: KvRows<'a>,
    /// Keys and values of the positions after those of `keys` and `values`, gathered (a tree row's, `Visible`).
    tail_keys: &'a [f32],
    tail_values: &'a [f32],
    mask: Option<&'a [u8]>,
    scores: &'a mut [f32],
    block: &'a mut [f32],
    out: &'a mut [f32],
}

/// Each query head's partial softmax over the chunk's allowed positions j: [Σ_j p_j · values[j], peak, Σ_j p_j]
/// with p_j = e^(q · keys[j] / sqrt(hd) - peak) and peak the largest such score (-inf, and zeros, where no
/// position is allowed). Each key and value is read once for all the heads of the group. Every build (portable,
/// AVX2, AVX-512) takes the same steps (`Products`), so gives the same bits.
fn chunk_query(x: Chunk) {
    #[cfg(target_arch = "x86_64")]
    {
        if super::avx512::available() && super::avx2::available() {
            // SAFETY: the CPU has AVX-512 F/BW/VL, AVX2, FMA and F16C.
            return unsafe { chunk_query_avx512(x) };
        }
        if super::avx2::available() {
            // SAFETY: the CPU has AVX2, FMA and F16C.
            return unsafe { chunk_query_avx2(x) };
        }
    }
    partial_softmax::<Portable, 0>(x);
}

/// `partial_softmax` with AVX2's products for the common head sizes, compiled for AVX2 + FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn chunk_query_avx2(x: Chunk) {
    by_head_size::<Avx2>(x);
}

/// `partial_softmax` with AVX-512's products for the common head sizes, compiled for AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn chunk_query_avx512(x: Chunk) {
    by_head_size::<Avx512>(x);
}

/// `partial_softmax` with P's products where hd is 64 or 128 (the common head sizes), the portable ones elsewhere.
#[inline(always)]
fn by_head_size<P: Products>(x: Chunk) {
    match x.hd {
        64 => partial_softmax::<P, 4>(x),
        128 => partial_softmax::<P, 8>(x),
        _ => partial_softmax::<Portable, 0>(x),
    }
}

/// The inner loops of `partial_softmax` as one build computes them, with the same bits in every build (`dot`,
/// `add_weighted`): for rows of V vectors of 16 floats (hd = 16 V), or of any length where V = 0 (`Portable`).
/// Measured against the previous kernel (8 lanes of separate products and sums, one head's loops over the whole
/// chunk at a time), a chunk of 256 positions, Sapphire Rapids VM, AVX-512: 11.6 -> 6.7 ns per (query head,
/// position) at hd = 64 and 3 heads, 20 -> 9.6 at hd = 128 and 6 heads.
trait Products {
    /// `dot(a, b)`.
    ///
    /// # Safety
    /// The CPU has the build's features; a and b hold 16 V floats (V > 0).
    unsafe fn dot<const V: usize>(a: &[f32], b: &[f32]) -> f32;
    /// `dot(q, key)` of every key [n, 16 V] into scores [n].
    ///
    /// # Safety
    /// As `dot`, for q and each key.
    #[inline(always)]
    unsafe fn scores<const V: usize>(q: &[f32], keys: &[f32], scores: &mut [f32]) {
        for (s, k) in scores.iter_mut().zip(keys.chunks_exact(q.len())) {
            // SAFETY: the caller's contract.
            *s = unsafe { Self::dot::<V>(q, k) };
        }
    }
    /// `add_weighted(p, values, even, odd)`.
    ///
    /// # Safety
    /// As `dot`, for `even`, `odd` and each row of `values`.
    unsafe fn add_weighted<const V: usize>(
        p: &[f32],
        values: &[f32],
        even: &mut [f32],
        odd: &mut [f32],
    );
    /// dst = the float16 values with bits `src` (exactly; as long as src).
    ///
    /// # Safety
    /// The CPU has the build's features.
    #[inline(always)]
    unsafe fn widen_f16(src: &[u16], dst: &mut [f32]) {
        for (d, &h) in dst.iter_mut().zip(src) {
            *d = f16_value(h);
        }
    }
}

/// Positions b..b + m of a chunk's keys or values as float32 rows: `head`'s (the cache's own elements where they
/// are float32, else widened into `scratch`, exactly, so every build reads the same floats), then `tail`'s (a tree
/// row's gathered positions, float32 already; a block that runs from one into the other is assembled in
/// `scratch`).
///
/// # Safety
/// The CPU has P's features.
#[inline(always)]
unsafe fn block_rows<'s, P: Products>(
    (head, tail): (KvRows<'s>, &'s [f32]),
    (b, m, hd): (usize, usize, usize),
    scratch: &'s mut [f32],
) -> &'s [f32] {
    let cached = head.len() / hd;
    if b >= cached {
        return &tail[(b - cached) * hd..][..m * hd];
    }
    let own = m.min(cached - b);
    if let (KvRows::F32(x), true) = (head, own == m) {
        return &x[b * hd..][..m * hd];
    }
    let (front, back) = scratch[..m * hd].split_at_mut(own * hd);
    // SAFETY: the caller's contract.
    unsafe { widen_into::<P>(head.part(b * hd, own * hd), front) };
    back.copy_from_slice(&tail[..(m - own) * hd]);
    &scratch[..m * hd]
}

/// `rows` as float32 into `dst` (as long), exactly.
///
/// # Safety
/// The CPU has P's features.
#[inline(always)]
unsafe fn widen_into<P: Products>(rows: KvRows, dst: &mut [f32]) {
    match rows {
        KvRows::F32(x) => dst.copy_from_slice(x),
        // SAFETY: the caller's contract.
        KvRows::F16(h) => unsafe { P::widen_f16(h, dst) },
        KvRows::Bf16(h) => {
            for (o, &b) in dst.iter_mut().zip(h) {
                *o = bf16_value(b);
            }
        }
    }
}

struct Portable;

impl Products for Portable {
    #[inline(always)]
    unsafe fn dot<const V: usize>(a: &[f32], b: &[f32]) -> f32 {
        dot(a, b)
    }
    #[inline(always)]
    unsafe fn add_weighted<const V: usize>(
        p: &[f32],
        values: &[f32],
        even: &mut [f32],
        odd: &mut [f32],
    ) {
        add_weighted(p, values, even, odd);
    }
}

#[inline(always)]
fn partial_softmax<P: Products, const V: usize>(x: Chunk) {
    let Chunk {
        hd,
        queries,
        keys,
        values,
        tail_keys,
        tail_values,
        mask,
        scores,
        block,
        out,
    } = x;
    let n = (keys.len() + tail_keys.len()) / hd;
    if n == 0 {
        // A tree row whose positions end before the chunk: nothing allowed.
        for o in out.chunks_exact_mut(hd + 2) {
            o.fill(0.0);
            o[hd] = f32::NEG_INFINITY;
        }
        return;
    }
    let scale = 1.0 / (hd as f32).sqrt();
    // Blocks of BLOCK positions, every head's products over one block before the next, so that its keys and values
    // are read from L1 (a chunk's are 64 KB each at hd = 64, past L1) once for all the heads.
    for b in (0..n).step_by(BLOCK) {
        let m = BLOCK.min(n - b);
        // SAFETY (both): `chunk_query` runs this build where the CPU has its features, with rows of hd = 16 V
        // floats.
        let keys = unsafe { block_rows::<P>((keys, tail_keys), (b, m, hd), block) };
        for (q, s) in queries.chunks_exact(hd).zip(scores.chunks_exact_mut(n)) {
            unsafe { P::scores::<V>(q, keys, &mut s[b..][..m]) };
        }
    }
    // Scaled, and -inf where masked: row by row, so that the loops vectorize.
    for s in scores.chunks_exact_mut(n) {
        match mask {
            None => s.iter_mut().for_each(|s| *s *= scale),
            Some(mask) => {
                for (s, &ok) in s.iter_mut().zip(mask) {
                    *s = if ok != 0 {
                        *s * scale
                    } else {
                        f32::NEG_INFINITY
                    };
                }
            }
        }
    }
    for (s, o) in scores.chunks_exact_mut(n).zip(out.chunks_exact_mut(hd + 2)) {
        let peak = peak_of(s);
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
    // Σ_j p_j · values[j] (`add_weighted`: the even and the odd positions apart, then added) and Σ_j p_j.
    let mut odd = vec![0f32; out.len()];
    for b in (0..n).step_by(BLOCK) {
        let m = BLOCK.min(n - b);
        // SAFETY: as for the keys.
        let values = unsafe { block_rows::<P>((values, tail_values), (b, m, hd), block) };
        for ((p, o), odd) in scores
            .chunks_exact(n)
            .zip(out.chunks_exact_mut(hd + 2))
            .zip(odd.chunks_exact_mut(hd + 2))
        {
            // SAFETY: as for `P::scores`.
            unsafe { P::add_weighted::<V>(&p[b..][..m], values, &mut o[..hd], &mut odd[..hd]) };
        }
    }
    for ((p, o), odd) in scores
        .chunks_exact(n)
        .zip(out.chunks_exact_mut(hd + 2))
        .zip(odd.chunks_exact(hd + 2))
    {
        for (a, &x) in o[..hd].iter_mut().zip(odd) {
            *a += x;
        }
        o[hd + 1] = lane_total(p);
    }
}

/// Positions per block of `partial_softmax` (even, so that a block starts at an even position).
const BLOCK: usize = 32;

/// p_j · values[j] (fused) added into `even` [hd] for the even positions j of a block that starts at an even
/// position, into `odd` for the odd ones, in order; positions with p_j = 0 add nothing. Two chains of sums, so that
/// they run side by side; `partial_softmax` adds them at the end.
#[inline(always)]
fn add_weighted(p: &[f32], values: &[f32], even: &mut [f32], odd: &mut [f32]) {
    for (j, (&p, v)) in p.iter().zip(values.chunks_exact(even.len())).enumerate() {
        if p == 0.0 {
            continue;
        }
        let acc = if j % 2 == 0 { &mut *even } else { &mut *odd };
        for (a, &x) in acc.iter_mut().zip(v) {
            *a = p.mul_add(x, *a);
        }
    }
}

/// Σ p in 16 lanes (lane i adds the p_j with j ≡ i mod 16, in order), folded in halves as `dot`'s lanes.
#[inline(always)]
fn lane_total(p: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    for c in p.chunks(16) {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += x;
        }
    }
    for width in [8, 4, 2, 1] {
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
    }
    lanes[0]
}

/// max of `scores` (-inf if there are none), in 16 lanes so that it vectorizes: the largest value whatever the order
/// (every `f32::max` skips NaN; which of ±0 wins does not change e^(s - peak)).
#[inline(always)]
fn peak_of(scores: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = scores.chunks_exact(16);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    for c in chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = m.max(x);
        }
    }
    lanes.into_iter().fold(tail, f32::max)
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

/// Σ a·b: lane i of 16 adds a[d]·b[d] for d ≡ i (mod 16) in order, fused; then the lanes fold in halves (lanes i
/// and i + 8 added, then i and i + 4, i + 2, i + 1), as a 512-bit register's sums reduce. Inlined into
/// `partial_softmax`, so that it is compiled with its target features.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let (ac, bc) = (a.chunks_exact(16), b.chunks_exact(16));
    for (l, (&x, &y)) in lanes
        .iter_mut()
        .zip(ac.remainder().iter().zip(bc.remainder()))
    {
        *l = x * y;
    }
    for (x, y) in ac.zip(bc) {
        for i in 0..16 {
            lanes[i] = x[i].mul_add(y[i], lanes[i]);
        }
    }
    for width in [8, 4, 2, 1] {
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
    }
    lanes[0]
}

#[cfg(target_arch = "x86_64")]
struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Products for Avx512 {
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn dot<const V: usize>(a: &[f32], b: &[f32]) -> f32 {
        use std::arch::x86_64::*;
        let mut acc = _mm512_setzero_ps();
        for c in 0..V {
            // SAFETY: 16 floats of each at 16 c < 16 V (the caller's contract).
            let (x, y) = unsafe {
                (
                    _mm512_loadu_ps(a.as_ptr().add(16 * c)),
                    _mm512_loadu_ps(b.as_ptr().add(16 * c)),
                )
            };
            acc = _mm512_fmadd_ps(x, y, acc);
        }
        let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
        fold_8(_mm256_add_ps(_mm512_castps512_ps256(acc), high))
    }

    /// Sixteen keys at a time: each key's 16 lanes in a register, then the 16 registers folded together in
    /// halves (lanes i and i + 8 of each key added, then i and i + 4, ...), which leaves the 16 dot products in
    /// one register, in the order that `KEY_OF_LANE` undoes.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn scores<const V: usize>(q: &[f32], keys: &[f32], scores: &mut [f32]) {
        use std::arch::x86_64::*;
        // After the folds, element e = 4 r + k % 4... holds key 4 (e % 4) + e / 4: this index puts key k at k.
        const KEY_OF_LANE: [i32; 16] = [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15];
        let row = 16 * V;
        let blocks = scores.len() / 16;
        let order = _mm512_loadu_si512(KEY_OF_LANE.as_ptr().cast());
        for b in 0..blocks {
            let mut acc = [_mm512_setzero_ps(); 16];
            for (k, acc) in acc.iter_mut().enumerate() {
                for c in 0..V {
                    // SAFETY: 16 floats of q and of key 16 b + k (< n) at 16 c < 16 V.
                    let (x, y) = unsafe {
                        (
                            _mm512_loadu_ps(q.as_ptr().add(16 * c)),
                            _mm512_loadu_ps(keys.as_ptr().add((16 * b + k) * row + 16 * c)),
                        )
                    };
                    *acc = _mm512_fmadd_ps(x, y, *acc);
                }
            }
            // Lanes i + 8: two keys a register, 8 lanes each.
            let mut halves = [_mm512_setzero_ps(); 8];
            for (h, pair) in halves.iter_mut().zip(acc.chunks_exact(2)) {
                *h = _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0x44>(pair[0], pair[1]),
                    _mm512_shuffle_f32x4::<0xEE>(pair[0], pair[1]),
                );
            }
            // Lanes i + 4: four keys a register, one per 128-bit lane.
            let mut quarters = [_mm512_setzero_ps(); 4];
            for (f, pair) in quarters.iter_mut().zip(halves.chunks_exact(2)) {
                *f = _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0x88>(pair[0], pair[1]),
                    _mm512_shuffle_f32x4::<0xDD>(pair[0], pair[1]),
                );
            }
            // Lanes i + 2, then i + 1.
            let mut eighths = [_mm512_setzero_ps(); 2];
            for (e, pair) in eighths.iter_mut().zip(quarters.chunks_exact(2)) {
                *e = _mm512_add_ps(
                    _mm512_shuffle_ps::<0x44>(pair[0], pair[1]),
                    _mm512_shuffle_ps::<0xEE>(pair[0], pair[1]),
                );
            }
            let sums = _mm512_add_ps(
                _mm512_shuffle_ps::<0x88>(eighths[0], eighths[1]),
                _mm512_shuffle_ps::<0xDD>(eighths[0], eighths[1]),
            );
            // SAFETY: 16 scores at 16 b < n.
            unsafe {
                _mm512_storeu_ps(
                    scores.as_mut_ptr().add(16 * b),
                    _mm512_permutexvar_ps(order, sums),
                )
            };
        }
        for (j, s) in scores.iter_mut().enumerate().skip(16 * blocks) {
            // SAFETY: key j < n.
            *s = unsafe { Self::dot::<V>(q, &keys[j * row..][..row]) };
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn add_weighted<const V: usize>(
        p: &[f32],
        values: &[f32],
        even: &mut [f32],
        odd: &mut [f32],
    ) {
        use std::arch::x86_64::*;
        // The sums so far, in registers (a loop, not a closure: a closure would not inline the loads).
        let (mut even_acc, mut odd_acc) = ([_mm512_setzero_ps(); V], [_mm512_setzero_ps(); V]);
        for c in 0..V {
            // SAFETY: 16 floats of each (16 V of them) at 16 c.
            unsafe {
                even_acc[c] = _mm512_loadu_ps(even.as_ptr().add(16 * c));
                odd_acc[c] = _mm512_loadu_ps(odd.as_ptr().add(16 * c));
            }
        }
        let (n, row) = (p.len(), 16 * V);
        for j in (0..n).step_by(2) {
            // SAFETY (both): this function's features; rows of 16 V floats.
            unsafe { add_weighted_avx512(&mut even_acc, p[j], &values[j * row..][..row]) };
            if j + 1 < n {
                unsafe {
                    add_weighted_avx512(&mut odd_acc, p[j + 1], &values[(j + 1) * row..][..row])
                };
            }
        }
        for c in 0..V {
            // SAFETY: 16 floats of each (16 V of them) at 16 c.
            unsafe {
                _mm512_storeu_ps(even.as_mut_ptr().add(16 * c), even_acc[c]);
                _mm512_storeu_ps(odd.as_mut_ptr().add(16 * c), odd_acc[c]);
            }
        }
    }

    /// AVX2's, 8 halves a step: a block of 32 positions at hd = 64 widened in 68-69 ns, against 104-105 ns 16 a
    /// step with AVX-512's conversion (Sapphire Rapids VM, in L1).
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn widen_f16(src: &[u16], dst: &mut [f32]) {
        // SAFETY: this function's features include AVX2's.
        unsafe { Avx2::widen_f16(src, dst) }
    }
}

/// acc += p · v (fused) for a row v of 16 V floats, unless p = 0.
///
/// # Safety
/// The CPU has AVX-512F; v holds 16 V floats.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn add_weighted_avx512<const V: usize>(
    acc: &mut [std::arch::x86_64::__m512; V],
    p: f32,
    v: &[f32],
) {
    use std::arch::x86_64::*;
    if p != 0.0 {
        let weight = _mm512_set1_ps(p);
        for (c, acc) in acc.iter_mut().enumerate() {
            // SAFETY: 16 floats of the row at 16 c < 16 V.
            *acc = _mm512_fmadd_ps(
                weight,
                unsafe { _mm512_loadu_ps(v.as_ptr().add(16 * c)) },
                *acc,
            );
        }
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Products for Avx2 {
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot<const V: usize>(a: &[f32], b: &[f32]) -> f32 {
        use std::arch::x86_64::*;
        // Lanes 0-7 and 8-15 of `dot` in two registers.
        let (mut low, mut high) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for c in 0..V {
            // SAFETY: 16 floats of each at 16 c < 16 V (the caller's contract).
            unsafe {
                let (x, y) = (a.as_ptr().add(16 * c), b.as_ptr().add(16 * c));
                low = _mm256_fmadd_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(y), low);
                high = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(8)), _mm256_loadu_ps(y.add(8)), high);
            }
        }
        fold_8(_mm256_add_ps(low, high))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn add_weighted<const V: usize>(
        p: &[f32],
        values: &[f32],
        even: &mut [f32],
        odd: &mut [f32],
    ) {
        // The sums stay in memory here (2 · 2 V registers are more than AVX2 has for hd = 128); in L1.
        let row = 16 * V;
        for (j, (&p, v)) in p.iter().zip(values.chunks_exact(row)).enumerate() {
            if p != 0.0 {
                let acc = if j % 2 == 0 { &mut *even } else { &mut *odd };
                // SAFETY: this function's features; 16 V floats each.
                unsafe { add_weighted_avx2::<V>(acc, p, v) };
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen_f16(src: &[u16], dst: &mut [f32]) {
        use std::arch::x86_64::*;
        let whole = src.len() / 8 * 8;
        for i in (0..whole).step_by(8) {
            // SAFETY: 8 halves of src and 8 floats of dst (as long as src) at i < whole.
            unsafe {
                let halves = _mm_loadu_si128(src.as_ptr().add(i).cast());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(halves));
            }
        }
        for (d, &h) in dst[whole..].iter_mut().zip(&src[whole..]) {
            *d = f16_value(h);
        }
    }
}

/// acc += p · v (fused) for rows of 16 V floats.
///
/// # Safety
/// The CPU has AVX2 and FMA; both hold 16 V floats.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn add_weighted_avx2<const V: usize>(acc: &mut [f32], p: f32, v: &[f32]) {
    use std::arch::x86_64::*;
    let weight = _mm256_set1_ps(p);
    for c in 0..2 * V {
        // SAFETY: 8 floats of each at 8 c < 16 V.
        unsafe {
            let a = acc.as_mut_ptr().add(8 * c);
            _mm256_storeu_ps(
                a,
                _mm256_fmadd_ps(
                    weight,
                    _mm256_loadu_ps(v.as_ptr().add(8 * c)),
                    _mm256_loadu_ps(a),
                ),
            );
        }
    }
}

/// The last folds of `dot`'s lanes: 8 lanes (i and i + 8 already added) to one, halving.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn fold_8(x: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let four = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
    let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps::<1>(two, two)))
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
    /// not a multiple of 8, a chunk with nothing allowed, no mask; float32, float16 and bfloat16 caches.
    #[test]
    fn a_chunk_gives_the_portable_builds_bits() {
        let mut rnd = uniform(11);
        for ((hd, len, group), dtype) in [(64, 37, 3), (128, 130, 2), (8, 1, 1)]
            .into_iter()
            .flat_map(|shape| [Dtype::F32, Dtype::F16, Dtype::Bf16].map(|d| (shape, d)))
        {
            let queries: Vec<f32> = (0..group * hd).map(|_| 30.0 * rnd()).collect();
            let mut keys = Stored::new((0..len * hd).map(|_| rnd()).collect(), dtype);
            let mut values = Stored::new((0..len * hd).map(|_| rnd()).collect(), dtype);
            let (keys, values) = (keys.cache(), values.cache());
            let some: Vec<u8> = (0..len).map(|j| u8::from(j % 5 != 3)).collect();
            for mask in [Some(&some[..]), Some(&vec![0; len][..]), None] {
                let mut scores = vec![0f32; group * len];
                let mut block = vec![0f32; BLOCK * hd];
                let (mut out, mut portable) =
                    (vec![0f32; group * (hd + 2)], vec![1f32; group * (hd + 2)]);
                for (out, portable) in [(&mut out, false), (&mut portable, true)] {
                    let x = Chunk {
                        hd,
                        queries: &queries,
                        keys: keys.rows(),
                        values: values.rows(),
                        tail_keys: &[],
                        tail_values: &[],
                        mask,
                        scores: &mut scores,
                        block: &mut block,
                        out,
                    };
                    if portable {
                        partial_softmax::<Portable, 0>(x);
                    } else {
                        chunk_query(x);
                    }
                }
                assert!(
                    out.iter()
                        .zip(&portable)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "hd {hd}, {len} positions, group {group}, {dtype:?}"
                );
                assert!(out.iter().all(|a| !a.is_nan()));
            }
        }
    }

    /// A KV cache's element type.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Dtype {
        F32,
        F16,
        Bf16,
    }

    /// Keys or values in one of the types, converted by the half crate (independent of `halves`).
    #[derive(Clone)]
    struct Stored {
        dtype: Dtype,
        floats: Vec<f32>,
        bits: Vec<u16>,
    }

    impl Stored {
        /// x rounded to `dtype`.
        fn new(x: Vec<f32>, dtype: Dtype) -> Stored {
            let bits = match dtype {
                Dtype::F32 => vec![],
                Dtype::F16 => x
                    .iter()
                    .map(|&v| half::f16::from_f32(v).to_bits())
                    .collect(),
                Dtype::Bf16 => x
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect(),
            };
            let floats = if dtype == Dtype::F32 { x } else { vec![] };
            Stored {
                dtype,
                floats,
                bits,
            }
        }

        fn cache(&mut self) -> KvCache<'_> {
            match self.dtype {
                Dtype::F32 => KvCache::F32(&mut self.floats),
                Dtype::F16 => KvCache::F16(&mut self.bits),
                Dtype::Bf16 => KvCache::Bf16(&mut self.bits),
            }
        }

        /// Element i's value.
        fn get(&self, i: usize) -> f64 {
            f64::from(match self.dtype {
                Dtype::F32 => self.floats[i],
                Dtype::F16 => half::f16::from_bits(self.bits[i]).to_f32(),
                Dtype::Bf16 => half::bf16::from_bits(self.bits[i]).to_f32(),
            })
        }

        /// How far a written element may be from the float64 value it rounds (values within ±2 here): the type's
        /// half unit in the last place, relative, and float32 RoPE's own error.
        fn tolerance(&self, want: f64) -> f64 {
            let unit = match self.dtype {
                Dtype::F32 => 0.0,
                Dtype::F16 => 2f64.powi(-11),
                Dtype::Bf16 => 2f64.powi(-8),
            };
            unit * want.abs() + 1e-6
        }
    }

    /// Random new rows [t, (Hq + 2 Hkv) hd], caches [Hkv, capacity, hd] and rotations [t, R/2].
    struct Inputs {
        qkv: Vec<f32>,
        cache_k: Stored,
        cache_v: Stored,
        cos: Vec<f32>,
        sin: Vec<f32>,
    }

    impl Inputs {
        fn draw(s: AttentionShape, t: usize, capacity: usize, seed: u64, dtype: Dtype) -> Inputs {
            let (hkv, hd) = (s.n_kv_heads, s.head_dim);
            let mut rnd = uniform(seed);
            let qkv = (0..t * (s.n_heads + 2 * hkv) * hd).map(|_| rnd()).collect();
            let cache_k = Stored::new((0..hkv * capacity * hd).map(|_| rnd()).collect(), dtype);
            let cache_v = Stored::new((0..hkv * capacity * hd).map(|_| rnd()).collect(), dtype);
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

    /// Runs `attend` for t new rows at `start` (causal, with position 1 hidden from row 0) on random caches of
    /// `dtype` and checks every written key and value against its rotation (in float64) and its row, within the
    /// type's rounding, and every output against attention written the plain way in float64 over the cache's
    /// contents (rotate, then softmax over allowed positions). Returns out.
    fn check_against_float64(
        s: AttentionShape,
        t: usize,
        start: usize,
        capacity: usize,
        seed: u64,
        dtype: Dtype,
    ) -> Vec<f32> {
        let (hq, hkv, hd, half) = (s.n_heads, s.n_kv_heads, s.head_dim, s.rope_dim / 2);
        let width = (hq + 2 * hkv) * hd;
        let Inputs {
            qkv,
            mut cache_k,
            mut cache_v,
            cos,
            sin,
        } = Inputs::draw(s, t, capacity, seed, dtype);
        let end = start + t;
        let mask: Vec<u8> = (0..t * end)
            .map(|i| u8::from(i % end <= start + i / end && i != 1))
            .collect();
        let mut rotated = qkv.clone();
        let mut out = vec![0f32; t * hq * hd];
        attend(
            &mut rotated,
            &mut cache_k.cache(),
            &mut cache_v.cache(),
            capacity,
            start,
            &cos,
            &sin,
            Some(&mask),
            None,
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
        let row = |cache: &Stored, h: usize, j: usize| -> Vec<f64> {
            (0..hd)
                .map(|d| cache.get((h * capacity + j) * hd + d))
                .collect()
        };
        for ti in 0..t {
            for h in 0..hkv {
                let pos = start + ti;
                let want_k = rot(&qkv[ti * width + (hq + h) * hd..][..hd], ti);
                let want_v = qkv[ti * width + (hq + hkv + h) * hd..][..hd]
                    .iter()
                    .map(|&f| f64::from(f));
                for (cache, want) in [(&cache_k, want_k), (&cache_v, want_v.collect())] {
                    let got = row(cache, h, pos);
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| (a - b).abs() <= cache.tolerance(*b)),
                        "row {ti}, KV head {h}, {dtype:?}"
                    );
                }
            }
            for h in 0..hq {
                let q = rot(&qkv[ti * width + h * hd..][..hd], ti);
                let kv = h / (hq / hkv);
                let scores: Vec<f64> = (0..end)
                    .map(|j| {
                        if mask[ti * end + j] == 0 {
                            f64::NEG_INFINITY
                        } else {
                            let dot: f64 =
                                q.iter().zip(row(&cache_k, kv, j)).map(|(a, b)| a * b).sum();
                            dot / (hd as f64).sqrt()
                        }
                    })
                    .collect();
                let peak = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = scores.iter().map(|s| (s - peak).exp()).collect();
                let total: f64 = p.iter().sum();
                let values: Vec<Vec<f64>> = (0..end).map(|j| row(&cache_v, kv, j)).collect();
                for d in 0..hd {
                    let want: f64 = (0..end).map(|j| p[j] * values[j][d]).sum::<f64>() / total;
                    let got = f64::from(out[(ti * hq + h) * hd + d]);
                    assert!(
                        (got - want).abs() < 1e-5,
                        "t {ti} head {h} d {d}, {dtype:?}: {got} vs {want}"
                    );
                }
            }
        }
        out
    }

    const SHAPE: AttentionShape = AttentionShape {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        rope_dim: 6,
        rope: RopeKind::Neox,
    };

    const DTYPES: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::Bf16];

    #[test]
    fn matches_a_float64_reference_with_gqa_partial_rope_and_a_mask() {
        for dtype in DTYPES {
            check_against_float64(SHAPE, 3, 2, 8, 3, dtype);
        }
    }

    /// Past one chunk of positions: the chunks' partial softmaxes merged (three query heads a KV head); at head
    /// sizes 64 and 128 through this CPU's vector products (`Products`), at 16 through the portable ones; caches
    /// of each type.
    #[test]
    fn matches_a_float64_reference_over_several_chunks() {
        for (head_dim, dtype) in [16, 64, 128]
            .into_iter()
            .flat_map(|hd| DTYPES.map(|d| (hd, d)))
        {
            let s = AttentionShape {
                n_heads: 6,
                n_kv_heads: 2,
                head_dim,
                rope_dim: 16,
                rope: RopeKind::Neox,
            };
            check_against_float64(s, 3, 2 * CHUNK + 37, 3 * CHUNK, 5, dtype);
        }
    }

    /// A row's output does not depend on the rows beside it: three rows at once past two chunks give, bit for bit,
    /// what each gives alone at its position after the rows before it (as decode steps would), with caches of
    /// each type.
    #[test]
    fn a_rows_output_is_the_same_alone_and_among_others() {
        let (t, start, capacity) = (3, 2 * CHUNK - 2, 3 * CHUNK);
        for dtype in DTYPES {
            let together = check_against_float64(SHAPE, t, start, capacity, 9, dtype);
            let (hq, hkv, hd, half) = (
                SHAPE.n_heads,
                SHAPE.n_kv_heads,
                SHAPE.head_dim,
                SHAPE.rope_dim / 2,
            );
            let width = (hq + 2 * hkv) * hd;
            // The same inputs, fed one row at a time.
            let mut x = Inputs::draw(SHAPE, t, capacity, 9, dtype);
            for ti in 0..t {
                let end = start + ti + 1;
                let mask: Vec<u8> = (0..end)
                    .map(|j| u8::from(ti * (start + t) + j != 1))
                    .collect();
                let mut row = x.qkv[ti * width..][..width].to_vec();
                let mut alone = vec![0f32; hq * hd];
                attend(
                    &mut row,
                    &mut x.cache_k.cache(),
                    &mut x.cache_v.cache(),
                    capacity,
                    start + ti,
                    &x.cos[ti * half..][..half],
                    &x.sin[ti * half..][..half],
                    Some(&mask),
                    None,
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
                    "row {ti}, {dtype:?}"
                );
            }
        }
    }

    /// A token tree's rows in one call (`parents`) each get the bits of decoding its branch one token at a time
    /// (each step a call of its own, at its position, no mask): trees with branches off the first chain at every
    /// depth, roots where the tree's slots cross a block of 32 and a chunk, head sizes the vector builds take and
    /// one they do not, caches of each type. Without `parents` (the mask alone) rows off the first chain differ.
    #[test]
    fn a_tree_row_gets_the_bits_of_decoding_its_branch() {
        let trees: [&[i64]; 2] = [
            &[-1, 0, 1, 2, 0, 4, 1, 6, 6, 3, 9, 5],
            &[
                -1, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 1, 0, 3, 3, 2, 2, 4, 4, 5, 5, 6, 7, 7, 6,
            ],
        ];
        let depth = |parents: &[i64], mut i: usize| {
            let mut d = 0;
            while parents[i] >= 0 {
                (i, d) = (parents[i] as usize, d + 1);
            }
            d
        };
        let mut differ = 0;
        for (head_dim, start, dtype) in [
            (64, 40, Dtype::F32),
            (128, 250, Dtype::F16),
            (8, 29, Dtype::Bf16),
        ] {
            let s = AttentionShape {
                n_heads: 6,
                n_kv_heads: 2,
                head_dim,
                rope_dim: head_dim.min(16),
                rope: RopeKind::Neox,
            };
            let (hq, half) = (s.n_heads, s.rope_dim / 2);
            let width = (hq + 2 * s.n_kv_heads) * head_dim;
            // The rotation of position p.
            let angles = |p: usize| (0..half).map(move |k| 0.01 * p as f32 * (k + 1) as f32);
            for (tree, parents) in trees.iter().enumerate() {
                let t = parents.len();
                let capacity = start + t + 3;
                let x = Inputs::draw(s, t, capacity, 21 + tree as u64, dtype);
                let rotation = |rows: &mut dyn Iterator<Item = usize>| -> (Vec<f32>, Vec<f32>) {
                    rows.flat_map(|i| angles(start + depth(parents, i)))
                        .map(|a| (a.cos(), a.sin()))
                        .unzip()
                };
                let (cos, sin) = rotation(&mut (0..t));
                let ancestry = |i: usize, j: usize| {
                    let mut a = i as i64;
                    while a > j as i64 {
                        a = parents[a as usize];
                    }
                    a == j as i64
                };
                let mask: Vec<u8> = (0..t * (start + t))
                    .map(|e| {
                        let (i, slot) = (e / (start + t), e % (start + t));
                        u8::from(slot < start || ancestry(i, slot - start))
                    })
                    .collect();
                let tree_pass = |with_parents: bool| {
                    let (mut qkv, mut k, mut v) =
                        (x.qkv.clone(), x.cache_k.clone(), x.cache_v.clone());
                    let mut out = vec![0f32; t * hq * head_dim];
                    let parents = with_parents.then_some(*parents);
                    let (mut k, mut v) = (k.cache(), v.cache());
                    attend(
                        &mut qkv,
                        &mut k,
                        &mut v,
                        capacity,
                        start,
                        &cos,
                        &sin,
                        Some(&mask),
                        parents,
                        &mut out,
                        s,
                    )
                    .unwrap();
                    out
                };
                let (with, without) = (tree_pass(true), tree_pass(false));
                for i in 0..t {
                    // The branch from the root to row i, one call a token, on a fresh copy of the cache.
                    let mut branch = vec![i];
                    while let Some(&b) = branch.last().filter(|&&b| b != 0) {
                        branch.push(parents[b] as usize);
                    }
                    branch.reverse();
                    let (mut k, mut v) = (x.cache_k.clone(), x.cache_v.clone());
                    let mut alone = vec![0f32; hq * head_dim];
                    for (d, &node) in branch.iter().enumerate() {
                        let mut row = x.qkv[node * width..][..width].to_vec();
                        let (cos, sin) = rotation(&mut std::iter::once(node));
                        let (mut k, mut v) = (k.cache(), v.cache());
                        attend(
                            &mut row,
                            &mut k,
                            &mut v,
                            capacity,
                            start + d,
                            &cos,
                            &sin,
                            None,
                            None,
                            &mut alone,
                            s,
                        )
                        .unwrap();
                    }
                    let bits = |out: &[f32]| -> Vec<u32> {
                        out[i * hq * head_dim..][..hq * head_dim]
                            .iter()
                            .map(|a| a.to_bits())
                            .collect()
                    };
                    let alone: Vec<u32> = alone.iter().map(|a| a.to_bits()).collect();
                    assert_eq!(
                        bits(&with),
                        alone,
                        "tree {tree}, row {i}, hd {head_dim}, start {start}, {dtype:?}"
                    );
                    differ += usize::from(bits(&without) != alone);
                }
            }
        }
        assert!(differ > 0, "the mask alone gave every row its bits too");
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
                .map(|(start, t)| check_against_float64(s, t, start, 3 * CHUNK, 13, Dtype::F32))
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
        let (mut k, mut v) = (KvCache::F32(&mut k), KvCache::F32(&mut v));
        let mut qkv = vec![0f32; 16];
        let mut out = vec![0f32; 8];
        let c = [1f32, 1.0];
        assert!(attend(&mut qkv, &mut k, &mut v, 4, 3, &c, &c, None, None, &mut out, s).is_ok());
        let bad = attend(
            &mut qkv, &mut k, &mut v, 4, 4, &c, &c, None, None, &mut out, s,
        ); // past capacity
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
            None,
            &mut out,
            s,
        ); // mask [1, 1]
        assert!(matches!(bad, Err(KernelError::Mismatch(_))));
        // One new row: its parents must be [-1]; two rows' can be [-1, 0] only.
        for parents in [&[0][..], &[-1, -1], &[-1, 1], &[-1]] {
            let two = parents.len() == 2;
            let (mut qkv, mut out) = (
                vec![0f32; 16 * (1 + usize::from(two))],
                vec![0f32; 8 * (1 + usize::from(two))],
            );
            let c = vec![1f32; 2 * (1 + usize::from(two))];
            let got = attend(
                &mut qkv,
                &mut k,
                &mut v,
                4,
                2,
                &c,
                &c,
                None,
                Some(parents),
                &mut out,
                s,
            );
            assert_eq!(got.is_ok(), parents == [-1], "{parents:?}");
        }
    }
}
