//! One pre-norm decoder block (Llama / Qwen2 / BitNet shape) for a few tokens of one or several sequences, each
//! over its own KV cache (float32, float16 or bfloat16), in one call:
//!
//!   h += Wo · sub_norm(attention(rope(Wqkv · rms_norm(h) + bias)))
//!   h += Wdown · sub_norm(act(Wgate · x) · (Wup · x)),  x = rms_norm(h)
//!
//! (act: SiLU, or BitNet's squared ReLU; the sub-norms are BitNet's, absent elsewhere; every product is scaled by
//! its matrix's `scale`.)
//! The same products (`quantized_matmul` with its norm and SwiGLU prologues) and attention (`attend`) as the
//! Python layer runs them one call at a time, in the same order, so the result is bit for bit the same; what goes
//! is ~6 crossings into Python per layer, the cost of a decode step of a small model. Several sequences (a batched
//! pass: `ntio serve`'s requests, a draft model's chains) share every product, each row's arithmetic the same as
//! in a pass of its own, and attend one after another, each over its own cache. `decoder_stack` runs a resident
//! model's blocks one after another in one call, so a decode step crosses into Python once, not once per layer.

use super::attention::{attend, AttentionShape};
use super::kv::KvCache;
use super::matmul::{quantized_matmul, Activations8, Gate, Isa, KernelError, Matrix, Prologue};

/// A block's weights: norms [D], row-stacked matrices, Qwen2's q/k/v bias and BitNet's sub-norms.
pub struct BlockWeights<'a> {
    pub attn_norm: &'a [f32],
    /// Rows stack to [(Hq + 2 Hkv) hd, D].
    pub qkv: Vec<Matrix<'a>>,
    /// [(Hq + 2 Hkv) hd], or none.
    pub qkv_bias: Option<&'a [f32]>,
    /// [Hq hd]: RMSNorm of the attention's output before Wo, or none.
    pub attn_sub_norm: Option<&'a [f32]>,
    /// [D, Hq hd].
    pub wo: Matrix<'a>,
    pub ffn_norm: &'a [f32],
    /// Rows stack to [2F, D]: gate rows, then up rows.
    pub gate_up: Vec<Matrix<'a>>,
    /// [F]: RMSNorm of the gated activations before Wdown, or none.
    pub ffn_sub_norm: Option<&'a [f32]>,
    /// [D, F].
    pub down: Matrix<'a>,
}

/// The block's kernel settings: RMSNorm epsilon, attention shape, the FFN's gate activation, kernel set and
/// activation path.
#[derive(Clone, Copy)]
pub struct BlockSettings {
    pub eps: f32,
    pub attention: AttentionShape,
    pub gate: Gate,
    pub isa: Isa,
    pub activations: Activations8,
}

/// One sequence's KV cache of the block's layer and where its tokens go (see `attend`): the next `rows` rows of h.
pub struct BlockCache<'a> {
    pub rows: usize,
    pub k: KvCache<'a>,
    pub v: KvCache<'a>,
    pub capacity: usize,
    pub start: usize,
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub mask: Option<&'a [u8]>,
    pub parents: Option<&'a [i64]>,
}

/// Where a block stops (`decoder_stack`'s last one).
pub enum BlockEnd<'o> {
    /// After its FFN: the whole block.
    Whole,
    /// After its FFN's gate/up products, written here ([T, 2F]): h holds the residual stream after the attention,
    /// and the rest of the FFN is the caller's (a sparse FFN's choice of neurons comes next).
    GateUp(&'o mut [f32]),
    /// After its attention: h holds the residual stream after it, and the FFN is the caller's (an FFN whose
    /// matrices are read once its neurons are chosen).
    Attention,
}

/// h [T, D] through the block, in place (see the module), up to `end`; `caches` in row order, their rows adding
/// up to T.
fn decoder_block<'a>(
    h: &mut [f32],
    d: usize,
    w: &BlockWeights<'a>,
    caches: &mut [BlockCache],
    s: BlockSettings,
    end: BlockEnd,
) -> Result<(), KernelError> {
    if d == 0 || h.is_empty() || h.len() % d != 0 {
        return Err(KernelError::Mismatch(format!(
            "h has {} floats, not T rows of D = {d}",
            h.len()
        )));
    }
    let t = h.len() / d;
    let rows: usize = caches.iter().map(|c| c.rows).sum();
    if rows != t || caches.iter().any(|c| c.rows == 0) {
        return Err(KernelError::Mismatch(format!(
            "the sequences' rows {:?} do not split h's {t} rows",
            caches.iter().map(|c| c.rows).collect::<Vec<_>>()
        )));
    }
    let a = s.attention;
    let product = |x: &[f32], k: usize, prologue: Prologue, ms: &[Matrix], out: &mut [f32]| {
        quantized_matmul(x, t, k, prologue, ms, out, s.isa, s.activations)
    };
    let width: usize = w.qkv.iter().map(|m| m.n).sum();
    let mut qkv = vec![0f32; t * width];
    let norm = |weight| Prologue::norm(weight, s.eps);
    product(h, d, norm(w.attn_norm), &w.qkv, &mut qkv)?;
    if let Some(bias) = w.qkv_bias {
        if bias.len() != width {
            return Err(KernelError::Mismatch(format!(
                "qkv_bias has {} floats, the q/k/v rows {width}",
                bias.len()
            )));
        }
        for row in qkv.chunks_exact_mut(width) {
            for (v, b) in row.iter_mut().zip(bias) {
                *v += b;
            }
        }
    }
    let attn_width = a.n_heads * a.head_dim;
    let mut attn = vec![0f32; t * attn_width];
    let (mut qkv_rows, mut attn_rows) = (&mut qkv[..], &mut attn[..]);
    for cache in caches.iter_mut() {
        let (qkv_seq, qkv_rest) = qkv_rows.split_at_mut(cache.rows * width);
        let (attn_seq, attn_rest) = attn_rows.split_at_mut(cache.rows * attn_width);
        attend(
            qkv_seq,
            &mut cache.k,
            &mut cache.v,
            cache.capacity,
            cache.start,
            cache.cos,
            cache.sin,
            cache.mask,
            cache.parents,
            attn_seq,
            a,
        )?;
        (qkv_rows, attn_rows) = (qkv_rest, attn_rest);
    }
    let mut update = vec![0f32; t * d];
    let sub_norm = |weight: Option<&'a [f32]>| weight.and_then(|weight| norm(weight).norm);
    let attn_out = Prologue {
        gate: None,
        norm: sub_norm(w.attn_sub_norm),
    };
    product(&attn, attn_width, attn_out, &[w.wo], &mut update)?;
    add(h, &update);
    let d_ff = w.gate_up.iter().map(|m| m.n).sum::<usize>() / 2;
    match end {
        BlockEnd::Whole => {}
        BlockEnd::GateUp(out) => return product(h, d, norm(w.ffn_norm), &w.gate_up, out),
        BlockEnd::Attention => return Ok(()),
    }
    let mut gate_up = vec![0f32; t * 2 * d_ff];
    product(h, d, norm(w.ffn_norm), &w.gate_up, &mut gate_up)?;
    let gated = Prologue {
        gate: Some(s.gate),
        norm: sub_norm(w.ffn_sub_norm),
    };
    product(&gate_up, d_ff, gated, &[w.down], &mut update)?;
    add(h, &update);
    Ok(())
}

/// h [T, D] through `layers` in order, in place: `decoder_block` layer after layer, without a return to the caller
/// between layers (a resident model's whole step in one call). Each of `caches` is a sequence's as in
/// `decoder_block`, but its k and v hold every layer's cache, [L, Hkv, capacity, hd]: layer i takes the i-th.
/// The last layer stops at `end`, the others run whole.
pub fn decoder_stack(
    h: &mut [f32],
    d: usize,
    layers: &[BlockWeights],
    caches: &mut [BlockCache],
    s: BlockSettings,
    mut end: BlockEnd,
) -> Result<(), KernelError> {
    let a = s.attention;
    if layers.is_empty() {
        return Err(KernelError::Mismatch("a stack of no blocks".to_string()));
    }
    for c in caches.iter() {
        if c.start + c.rows > c.capacity {
            return Err(KernelError::Mismatch(format!(
                "positions {}..{} past a cache of {} positions",
                c.start,
                c.start + c.rows,
                c.capacity
            )));
        }
        let per_layer = a.n_kv_heads * c.capacity * a.head_dim;
        if c.k.len() != layers.len() * per_layer || c.v.len() != c.k.len() {
            return Err(KernelError::Mismatch(format!(
                "caches of {} and {} elements for {} layers of [{}, {}, {}]",
                c.k.len(),
                c.v.len(),
                layers.len(),
                a.n_kv_heads,
                c.capacity,
                a.head_dim
            )));
        }
    }
    for (i, w) in layers.iter().enumerate() {
        let mut layer_caches: Vec<BlockCache> = caches
            .iter_mut()
            .map(|c| {
                let per_layer = c.k.len() / layers.len();
                BlockCache {
                    rows: c.rows,
                    k: c.k.part(i * per_layer, per_layer),
                    v: c.v.part(i * per_layer, per_layer),
                    capacity: c.capacity,
                    start: c.start,
                    cos: c.cos,
                    sin: c.sin,
                    mask: c.mask,
                    parents: c.parents,
                }
            })
            .collect();
        let last = i + 1 == layers.len();
        decoder_block(
            h,
            d,
            w,
            &mut layer_caches,
            s,
            if last {
                std::mem::replace(&mut end, BlockEnd::Whole)
            } else {
                BlockEnd::Whole
            },
        )?;
    }
    Ok(())
}

/// h += u, element by element (the residual add).
fn add(h: &mut [f32], u: &[f32]) {
    for (h, u) in h.iter_mut().zip(u) {
        *h += u;
    }
}
