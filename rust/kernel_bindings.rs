//! Python bindings for the CPU kernels (`ntio._core.quantized_matmul`, `set_kernel_threads`, ...).
//! Tensors cross as buffer-protocol objects (numpy views of torch tensors, made by `ntio.kernels.cpu_kernels`),
//! checked for element type, layout, writability and overlap before any slice is formed.

use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::buffer_bindings::Lent;
use crate::buffers::{self, Access};
use crate::kernels::{
    self, Activations8, AttentionShape, BlockCache, BlockEnd, BlockSettings, BlockWeights,
    ColumnGroup, Gate, Isa, KernelError, KvCache, Matrix, Prologue, QType, RopeKind,
};

impl From<KernelError> for PyErr {
    fn from(err: KernelError) -> PyErr {
        match err {
            KernelError::Mismatch(_) => PyValueError::new_err(err.to_string()),
            KernelError::Threads { .. } | KernelError::Panicked => {
                PyRuntimeError::new_err(err.to_string())
            }
            KernelError::Memory { .. } => PyMemoryError::new_err(err.to_string()),
        }
    }
}

/// A matrix as Python gives it: (raw, ggml type id, n, scale).
type PyMatrix<'py> = (Bound<'py, PyAny>, u32, usize, f32);
/// A matrix whose bytes are lent for a call.
type LentMatrix = (Lent<u8>, QType, usize, f32);

/// Lends a matrix's bytes, checking its type.
fn lend_matrix(m: &PyMatrix) -> PyResult<LentMatrix> {
    Ok((
        Lent::<u8>::typed(&m.0, "raw", Access::Read)?,
        kernel_type(m.1)?,
        m.2,
        m.3,
    ))
}

/// The kernel's view of a lent matrix.
///
/// # Safety
/// The caller must keep the export alive and unwritten while the view is used.
unsafe fn matrix(m: &LentMatrix) -> Matrix<'_> {
    Matrix {
        // SAFETY: guaranteed by the caller.
        raw: unsafe { m.0.as_slice() },
        qtype: m.1,
        n: m.2,
        scale: m.3,
    }
}

/// A product's activations x (read) and output (written), lent and checked not to overlap.
fn lend_product(x: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<(Lent<f32>, Lent<f32>)> {
    let x = Lent::<f32>::typed(x, "x", Access::Read)?;
    let out = Lent::<f32>::typed(out, "out", Access::Write)?;
    buffers::disjoint(("out", out.range()), ("x", x.range()))?;
    Ok((x, out))
}

/// The gate activation named `name`, or a ValueError.
fn checked_gate(name: &str) -> PyResult<Gate> {
    Gate::from_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown gate activation {name:?} (known: silu, relu2)"
        ))
    })
}

/// out [t, Σn] = prologue(x) [t, k] · [W1; W2; ...]ᵀ with each Wi [ni, k] GGUF-encoded as ggml type `qtype` in
/// `raw`, given as `matrices` [(raw, qtype, n, scale), ...] (each product times its scale); float32 in and out.
///
/// x: t * k float32 (t * 2k with `gate`); raw: exactly the encoded size of its matrix, uint8; out: t * Σn
/// float32, writable, overlapping neither x nor any raw; norm: k float32. All C-contiguous buffers (numpy arrays;
/// torch tensors via `.numpy()`), checked here, each refusal a `BufferError` (a ValueError) naming the argument.
/// Prologue, in this order: `gate` (`silu` or `relu2`: x = [gate | up] rows -> act(gate) · up), then `norm`
/// (RMSNorm with `eps`); either or both may be absent.
/// `isa`: `best`, `avx512`, `avx2` or `scalar` (a set this CPU lacks is a ValueError); `int8`: quantize
/// activations to 8 bits (quantized types), else float32.
#[pyfunction]
#[pyo3(signature = (x, t, k, matrices, out, *, isa = "best", int8 = true, norm = None, eps = 0.0, gate = None))]
#[allow(clippy::too_many_arguments)]
fn quantized_matmul(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    t: usize,
    k: usize,
    matrices: Vec<PyMatrix<'_>>,
    out: &Bound<'_, PyAny>,
    isa: &str,
    int8: bool,
    norm: Option<&Bound<'_, PyAny>>,
    eps: f32,
    gate: Option<&str>,
) -> PyResult<()> {
    let isa = checked_isa(isa)?;
    let gate = gate.map(checked_gate).transpose()?;
    let (x, out) = lend_product(x, out)?;
    let mut lent = Vec::with_capacity(matrices.len());
    for m in &matrices {
        let m = lend_matrix(m)?;
        buffers::disjoint(("out", out.range()), ("raw", m.0.range()))?;
        lent.push(m);
    }
    let norm = norm
        .map(|w| Lent::<f32>::typed(w, "norm", Access::Read))
        .transpose()?;
    let activations = activations(int8);
    py.detach(|| {
        // SAFETY: `out` shares no byte with `x` or any `raw` (checked above), so the one mutable slice aliases
        // nothing here; the exports live until this function returns; the caller (`ntio.kernels.cpu_kernels`)
        // runs no Python code on these tensors during the call. Sizes are the kernel's to check.
        let (x, out) = unsafe { (x.as_slice(), out.as_mut_slice()) };
        // SAFETY: as above.
        let matrices: Vec<Matrix> = lent.iter().map(|m| unsafe { matrix(m) }).collect();
        let prologue = Prologue {
            gate,
            // SAFETY: as above (read-only, overlapping is harmless).
            norm: norm
                .as_ref()
                .and_then(|w| Prologue::norm(unsafe { w.as_slice() }, eps).norm),
        };
        kernels::quantized_matmul(x, t, k, prologue, &matrices, out, isa, activations)
    })?;
    Ok(())
}

/// out [t, n] = Σ_j x[:, first_j .. first_j + width] · G_jᵀ over `groups` [(first_j, raw_j), ...]: column groups
/// of a matrix [n, k] of ggml type `qtype`, each the encoding of its [n, width] columns (a store's group-major
/// FFN down copy; `kernels::column_groups`). Buffers as in `quantized_matmul`; a ValueError names the group or
/// argument at fault.
#[pyfunction]
#[pyo3(signature = (x, t, k, width, groups, qtype, n, out, *, isa = "best", int8 = true))]
#[allow(clippy::too_many_arguments)]
fn column_groups_matmul(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    t: usize,
    k: usize,
    width: usize,
    groups: Vec<(usize, Bound<'_, PyAny>)>,
    qtype: u32,
    n: usize,
    out: &Bound<'_, PyAny>,
    isa: &str,
    int8: bool,
) -> PyResult<()> {
    let isa = checked_isa(isa)?;
    let qtype = kernel_type(qtype)?;
    let (x, out) = lend_product(x, out)?;
    let mut lent = Vec::with_capacity(groups.len());
    for (first, raw) in &groups {
        let raw = Lent::<u8>::typed(raw, "raw", Access::Read)?;
        buffers::disjoint(("out", out.range()), ("raw", raw.range()))?;
        lent.push((*first, raw));
    }
    let activations = activations(int8);
    py.detach(|| {
        // SAFETY: as in `quantized_matmul`: `out` overlaps no input, the exports live until this returns, and the
        // caller runs no Python code on these buffers meanwhile.
        let (x, out) = unsafe { (x.as_slice(), out.as_mut_slice()) };
        let groups: Vec<ColumnGroup> = lent
            .iter()
            // SAFETY: as above.
            .map(|(first, raw)| ColumnGroup {
                first: *first,
                raw: unsafe { raw.as_slice() },
            })
            .collect();
        kernels::column_groups_matmul(x, t, k, width, &groups, qtype, n, out, isa, activations)
    })?;
    Ok(())
}

/// Rewrites the n rows of `raw` (GGUF type `qtype`, rows of k elements; uint8, C-contiguous, writable) in place
/// into the type's interleaved layout (`rust/kernels/interleave.rs`: rows in groups of 8, word by word; the same
/// bytes, reordered) and returns that layout's type id, which `quantized_matmul` takes in place of `qtype`
/// (`dequantize` refuses it: restore the plain rows first); with `inverse`, `qtype` is an interleaved layout's id,
/// whose rows go back to plain, and the plain type's id is returned. A ValueError names what does not fit: a type
/// without an interleaved layout, n not a multiple of 8, k not whole blocks, or the size.
#[pyfunction]
#[pyo3(signature = (raw, qtype, n, k, *, inverse = false))]
fn interleave(
    py: Python<'_>,
    raw: &Bound<'_, PyAny>,
    qtype: u32,
    n: usize,
    k: usize,
    inverse: bool,
) -> PyResult<u32> {
    let given = kernel_type(qtype)?;
    let plain = given.plain();
    let (mixed, block_bytes) = match plain.interleaved() {
        Some(layout) if inverse == given.interleaved_rows() => layout,
        _ => {
            return Err(PyValueError::new_err(format!(
                "{given:?} has no {} layout (Q4_1, Q4_K, Q6_K and their interleaved layouts have)",
                if inverse { "plain" } else { "interleaved" }
            )))
        }
    };
    let (block, _) = plain.block();
    if n % 8 != 0 || k == 0 || k % block != 0 {
        return Err(PyValueError::new_err(format!(
            "{given:?} [{n}, {k}]: interleaved rows come in groups of 8 and k in whole blocks of {block}"
        )));
    }
    let row_bytes = k / block * block_bytes;
    let raw = Lent::<u8>::typed(raw, "raw", Access::Write)?;
    if raw.len() != n * row_bytes {
        return Err(PyValueError::new_err(format!(
            "{given:?} [{n}, {k}] takes {} bytes: raw has {}",
            n * row_bytes,
            raw.len()
        )));
    }
    py.detach(|| {
        // SAFETY: the export lives until this function returns and the caller runs no Python code on it meanwhile.
        let raw = unsafe { raw.as_mut_slice() };
        kernels::permute_in_place(raw, row_bytes, block_bytes, inverse);
    });
    Ok(if inverse { plain } else { mixed } as u32)
}

/// Whether interleaved rows (`interleave`) have kernels of their own under kernel set `isa` and `int8` (else they
/// are restored to rows group by group, slower than plain rows).
#[pyfunction]
#[pyo3(signature = (isa = "best", int8 = true))]
fn interleaved_kernels(isa: &str, int8: bool) -> PyResult<bool> {
    Ok(kernels::interleaved_kernels(
        checked_isa(isa)?,
        activations(int8),
    ))
}

/// Rows of `k` elements of ggml type `qtype`, encoded back to back in `raw` (uint8), decoded into out [rows, k]
/// float32 (`rust/kernels/dequant.rs`: gguf-py's values, bit for bit). Both C-contiguous and sharing no memory; a
/// size that is not whole rows is a ValueError.
#[pyfunction]
fn dequantize(
    py: Python<'_>,
    raw: &Bound<'_, PyAny>,
    qtype: u32,
    k: usize,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let qtype = kernel_type(qtype)?;
    let raw = Lent::<u8>::typed(raw, "raw", Access::Read)?;
    let out = Lent::<f32>::typed(out, "out", Access::Write)?;
    buffers::disjoint(("out", out.range()), ("raw", raw.range()))?;
    py.detach(|| {
        // SAFETY: `out` shares no byte with `raw` (checked above); the exports live until this function returns and
        // the caller runs no Python code on them meanwhile.
        let (raw, out) = unsafe { (raw.as_slice(), out.as_mut_slice()) };
        kernels::dequantize(raw, qtype, k, out)
    })?;
    Ok(())
}

/// Attention of T new tokens over one layer's KV cache (`rust/kernels/attention.rs`): rotates the queries and keys
/// of qkv [T, (Hq + 2 Hkv) hd] in place with cos, sin [T, rope_dim / 2], writes keys and values at positions
/// start.. of cache_k, cache_v [Hkv, capacity, hd], and puts softmax(q·kᵀ / sqrt(hd)) · v in out [T, Hq hd].
/// mask: [T, start + T] uint8 (nonzero: may attend), or None (all positions). parents: the new tokens' token tree
/// (a list of T ints: -1 for the root, then each token's parent, an earlier one), or None (a sequence): each token
/// then gets the bits a one-token step at its position after its branch gets. The caches hold `kv_dtype`
/// (`float32`, `float16`, or `bfloat16` as int16 bits), the rest float32. qkv, the caches and out must share no
/// memory; each refusal names the buffer.
#[pyfunction]
#[pyo3(signature = (qkv, cache_k, cache_v, capacity, start, cos, sin, mask, out, *, n_heads, n_kv_heads, head_dim,
                    rope_dim, neox, kv_dtype = "float32", parents = None))]
#[allow(clippy::too_many_arguments)]
fn attend(
    py: Python<'_>,
    qkv: &Bound<'_, PyAny>,
    cache_k: &Bound<'_, PyAny>,
    cache_v: &Bound<'_, PyAny>,
    capacity: usize,
    start: usize,
    cos: &Bound<'_, PyAny>,
    sin: &Bound<'_, PyAny>,
    mask: Option<&Bound<'_, PyAny>>,
    out: &Bound<'_, PyAny>,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    rope_dim: usize,
    neox: bool,
    kv_dtype: &str,
    parents: Option<Vec<i64>>,
) -> PyResult<()> {
    let qkv = Lent::<f32>::typed(qkv, "qkv", Access::Write)?;
    let cache_k = LentCache::lend(cache_k, "cache_k", kv_dtype)?;
    let cache_v = LentCache::lend(cache_v, "cache_v", kv_dtype)?;
    let out = Lent::<f32>::typed(out, "out", Access::Write)?;
    let cos = Lent::<f32>::typed(cos, "cos", Access::Read)?;
    let sin = Lent::<f32>::typed(sin, "sin", Access::Read)?;
    let mask = mask
        .map(|m| Lent::<u8>::typed(m, "mask", Access::Read))
        .transpose()?;
    let written = [
        ("qkv", qkv.range()),
        ("cache_k", cache_k.range()),
        ("cache_v", cache_v.range()),
        ("out", out.range()),
    ];
    disjoint_writes(&written, &[])?;
    let shape = attention_shape(n_heads, n_kv_heads, head_dim, rope_dim, neox);
    py.detach(|| {
        // SAFETY: the four written buffers share no byte (checked above), the read ones are only read; the
        // exports live until this function returns and the caller runs no Python code on them meanwhile.
        let (qkv, mut k, mut v, out) = unsafe {
            (
                qkv.as_mut_slice(),
                cache_k.cache(),
                cache_v.cache(),
                out.as_mut_slice(),
            )
        };
        // SAFETY: as above.
        let (cos, sin, mask) = unsafe {
            (
                cos.as_slice(),
                sin.as_slice(),
                mask.as_ref().map(|m| m.as_slice()),
            )
        };
        kernels::attend(
            qkv,
            &mut k,
            &mut v,
            capacity,
            start,
            cos,
            sin,
            mask,
            parents.as_deref(),
            out,
            shape,
        )
    })?;
    Ok(())
}

/// A stack of pre-norm decoder blocks (Llama / Qwen2 / BitNet shape) over T new tokens of one or several
/// sequences (`rust/kernels/block.rs`): h [T, D] float32 updated in place, block after block with no return to
/// Python between them, each block
/// h += Wo · attn_sub_norm(attention(rope(Wqkv · rms_norm(h) + qkv_bias))), then
/// h += Wdown · ffn_sub_norm(act(Wgate · x) · (Wup · x)), x = rms_norm(h); the sub-norms are optional (BitNet's),
/// `gate` names act (`silu` or `relu2`). layers: (attn_norm, qkv, qkv_bias, wo, ffn_norm, gate_up, down,
/// attn_sub_norm, ffn_sub_norm) per block, matrices as in `quantized_matmul`. sequences: (cache_k, cache_v,
/// capacity, start, cos, sin, mask or None, parents or None, rows) each, in row order: the next `rows` rows of h,
/// whose caches [L, Hkv, capacity, hd] hold every block's, block i's the i-th (one block: [Hkv, capacity, hd]); the
/// rotation, mask, parents and `kv_dtype` (every sequence's) as in `attend`. h and the caches are written and must
/// share no memory with each other or any other buffer. With `gate_up` (float32 [T, 2F], written, sharing no memory
/// either), the last block stops after its FFN's gate/up products, written there: h then holds the residual stream
/// after its attention. With `attention_only`, the last block stops after its attention (its FFN matrices are not
/// read).
#[pyfunction]
#[pyo3(signature = (h, d, layers, sequences, *, eps, n_heads, n_kv_heads, head_dim, rope_dim, neox, gate = "silu",
                    isa = "best", int8 = true, gate_up = None, attention_only = false, kv_dtype = "float32"))]
#[allow(clippy::too_many_arguments)]
fn decoder_stack(
    py: Python<'_>,
    h: &Bound<'_, PyAny>,
    d: usize,
    layers: Vec<PyLayer<'_>>,
    sequences: Vec<PySequence<'_>>,
    eps: f32,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    rope_dim: usize,
    neox: bool,
    gate: &str,
    isa: &str,
    int8: bool,
    gate_up: Option<&Bound<'_, PyAny>>,
    attention_only: bool,
    kv_dtype: &str,
) -> PyResult<()> {
    if attention_only && gate_up.is_some() {
        return Err(PyValueError::new_err(
            "decoder_stack: gate_up and attention_only are two ends of a block: give one",
        ));
    }
    let settings = BlockSettings {
        eps,
        attention: attention_shape(n_heads, n_kv_heads, head_dim, rope_dim, neox),
        gate: checked_gate(gate)?,
        isa: checked_isa(isa)?,
        activations: activations(int8),
    };
    let h = Lent::<f32>::typed(h, "h", Access::Write)?;
    let layers = layers
        .iter()
        .map(LentLayer::lend)
        .collect::<PyResult<Vec<_>>>()?;
    let sequences = sequences
        .iter()
        .map(|seq| lend_sequence(seq, kv_dtype))
        .collect::<PyResult<Vec<_>>>()?;
    let gate_up = gate_up
        .map(|g| Lent::<f32>::typed(g, "gate_up", Access::Write))
        .transpose()?;
    let mut written = vec![("h", h.range())];
    written.extend(gate_up.iter().map(|g| ("gate_up", g.range())));
    let mut read = Vec::new();
    for layer in &layers {
        layer.read_ranges(&mut read);
    }
    for seq in &sequences {
        written.extend([("cache_k", seq.k.range()), ("cache_v", seq.v.range())]);
        read.extend([("cos", seq.cos.range()), ("sin", seq.sin.range())]);
        read.extend(seq.mask.iter().map(|m| ("mask", m.range())));
    }
    disjoint_writes(&written, &read)?;
    py.detach(|| {
        // SAFETY: the written buffers (h, every sequence's caches) share no byte with each other or with any
        // read buffer (checked above); the exports live until this function returns, and the caller runs no
        // Python code on these tensors meanwhile.
        unsafe {
            let weights: Vec<BlockWeights> = layers.iter().map(|l| l.weights()).collect();
            let mut caches: Vec<BlockCache> = sequences
                .iter()
                .map(|seq| BlockCache {
                    rows: seq.rows,
                    k: seq.k.cache(),
                    v: seq.v.cache(),
                    capacity: seq.capacity,
                    start: seq.start,
                    cos: seq.cos.as_slice(),
                    sin: seq.sin.as_slice(),
                    mask: seq.mask.as_ref().map(|m| m.as_slice()),
                    parents: seq.parents.as_deref(),
                })
                .collect();
            let end = match &gate_up {
                Some(g) => BlockEnd::GateUp(g.as_mut_slice()),
                None if attention_only => BlockEnd::Attention,
                None => BlockEnd::Whole,
            };
            kernels::decoder_stack(h.as_mut_slice(), d, &weights, &mut caches, settings, end)
        }
    })?;
    Ok(())
}

/// A block's weights as Python passes them: (attn_norm, qkv, qkv_bias, wo, ffn_norm, gate_up, down, attn_sub_norm,
/// ffn_sub_norm); matrices as in `quantized_matmul`.
type PyLayer<'py> = (
    Bound<'py, PyAny>,
    Vec<PyMatrix<'py>>,
    Option<Bound<'py, PyAny>>,
    PyMatrix<'py>,
    Bound<'py, PyAny>,
    Vec<PyMatrix<'py>>,
    PyMatrix<'py>,
    Option<Bound<'py, PyAny>>,
    Option<Bound<'py, PyAny>>,
);

/// A block's weights, exported.
struct LentLayer {
    attn_norm: Lent<f32>,
    qkv: Vec<LentMatrix>,
    qkv_bias: Option<Lent<f32>>,
    wo: LentMatrix,
    ffn_norm: Lent<f32>,
    gate_up: Vec<LentMatrix>,
    down: LentMatrix,
    attn_sub_norm: Option<Lent<f32>>,
    ffn_sub_norm: Option<Lent<f32>>,
}

impl LentLayer {
    fn lend(layer: &PyLayer<'_>) -> PyResult<LentLayer> {
        let (attn_norm, qkv, qkv_bias, wo, ffn_norm, gate_up, down, attn_sub_norm, ffn_sub_norm) =
            layer;
        let floats = |obj: &Bound<'_, PyAny>, name: &'static str| {
            Lent::<f32>::typed(obj, name, Access::Read)
        };
        let optional = |obj: &Option<Bound<'_, PyAny>>, name| {
            obj.as_ref().map(|b| floats(b, name)).transpose()
        };
        let matrices = |ms: &[PyMatrix]| ms.iter().map(lend_matrix).collect::<PyResult<Vec<_>>>();
        Ok(LentLayer {
            attn_norm: floats(attn_norm, "attn_norm")?,
            qkv: matrices(qkv)?,
            qkv_bias: optional(qkv_bias, "qkv_bias")?,
            wo: lend_matrix(wo)?,
            ffn_norm: floats(ffn_norm, "ffn_norm")?,
            gate_up: matrices(gate_up)?,
            down: lend_matrix(down)?,
            attn_sub_norm: optional(attn_sub_norm, "attn_sub_norm")?,
            ffn_sub_norm: optional(ffn_sub_norm, "ffn_sub_norm")?,
        })
    }

    /// Adds the named ranges of every buffer the block reads to `read`.
    fn read_ranges(&self, read: &mut Vec<(&'static str, (usize, usize))>) {
        read.extend([
            ("attn_norm", self.attn_norm.range()),
            ("ffn_norm", self.ffn_norm.range()),
        ]);
        let matrices = self
            .qkv
            .iter()
            .chain(&self.gate_up)
            .chain([&self.wo, &self.down]);
        read.extend(matrices.map(|m| ("raw", m.0.range())));
        read.extend(self.qkv_bias.iter().map(|b| ("qkv_bias", b.range())));
        read.extend(
            self.attn_sub_norm
                .iter()
                .map(|b| ("attn_sub_norm", b.range())),
        );
        read.extend(
            self.ffn_sub_norm
                .iter()
                .map(|b| ("ffn_sub_norm", b.range())),
        );
    }

    /// The kernels' view of the block.
    ///
    /// # Safety
    /// The caller must keep the exports alive and unwritten while the view is used.
    unsafe fn weights(&self) -> BlockWeights<'_> {
        // SAFETY (all): guaranteed by the caller.
        unsafe {
            BlockWeights {
                attn_norm: self.attn_norm.as_slice(),
                qkv: self.qkv.iter().map(|m| matrix(m)).collect(),
                qkv_bias: self.qkv_bias.as_ref().map(|b| b.as_slice()),
                attn_sub_norm: self.attn_sub_norm.as_ref().map(|b| b.as_slice()),
                wo: matrix(&self.wo),
                ffn_norm: self.ffn_norm.as_slice(),
                gate_up: self.gate_up.iter().map(|m| matrix(m)).collect(),
                ffn_sub_norm: self.ffn_sub_norm.as_ref().map(|b| b.as_slice()),
                down: matrix(&self.down),
            }
        }
    }
}

/// One sequence of a `decoder_stack` call as Python passes it: (cache_k, cache_v, capacity, start, cos, sin, mask or
/// None, parents or None, rows).
type PySequence<'py> = (
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    usize,
    usize,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Option<Bound<'py, PyAny>>,
    Option<Vec<i64>>,
    usize,
);

/// A `decoder_stack` sequence's buffers, exported.
struct LentSequence {
    k: LentCache,
    v: LentCache,
    capacity: usize,
    start: usize,
    cos: Lent<f32>,
    sin: Lent<f32>,
    mask: Option<Lent<u8>>,
    parents: Option<Vec<i64>>,
    rows: usize,
}

fn lend_sequence(seq: &PySequence<'_>, kv_dtype: &str) -> PyResult<LentSequence> {
    let (k, v, capacity, start, cos, sin, mask, parents, rows) = seq;
    Ok(LentSequence {
        k: LentCache::lend(k, "cache_k", kv_dtype)?,
        v: LentCache::lend(v, "cache_v", kv_dtype)?,
        capacity: *capacity,
        start: *start,
        cos: Lent::typed(cos, "cos", Access::Read)?,
        sin: Lent::typed(sin, "sin", Access::Read)?,
        mask: mask
            .as_ref()
            .map(|m| Lent::typed(m, "mask", Access::Read))
            .transpose()?,
        parents: parents.clone(),
        rows: *rows,
    })
}

/// Keys or values of a KV cache, lent for writing, in the cache's element type.
enum LentCache {
    F32(Lent<f32>),
    F16(Lent<u16>),
    Bf16(Lent<u16>),
}

impl LentCache {
    /// Argument `name`, a cache of `kv_dtype` (`float32`, `float16`, or `bfloat16` as int16 bits).
    fn lend(obj: &Bound<'_, PyAny>, name: &'static str, kv_dtype: &str) -> PyResult<LentCache> {
        Ok(match kv_dtype {
            "float32" => LentCache::F32(Lent::typed(obj, name, Access::Write)?),
            "float16" => {
                LentCache::F16(Lent::halves(obj, name, buffers::Elem::F16, Access::Write)?)
            }
            "bfloat16" => {
                LentCache::Bf16(Lent::halves(obj, name, buffers::Elem::Bf16, Access::Write)?)
            }
            _ => {
                return Err(PyValueError::new_err(format!(
                    "unknown kv_dtype '{kv_dtype}' (choose float32, float16 or bfloat16)"
                )))
            }
        })
    }

    /// (address, bytes) of the memory, for overlap checks.
    fn range(&self) -> (usize, usize) {
        match self {
            LentCache::F32(c) => c.range(),
            LentCache::F16(c) | LentCache::Bf16(c) => c.range(),
        }
    }

    /// The memory as a cache to write.
    ///
    /// # Safety
    /// As `Lent::as_mut_slice`.
    unsafe fn cache(&self) -> KvCache<'_> {
        // SAFETY: the caller's contract.
        unsafe {
            match self {
                LentCache::F32(c) => KvCache::F32(c.as_mut_slice()),
                LentCache::F16(c) => KvCache::F16(c.as_mut_slice()),
                LentCache::Bf16(c) => KvCache::Bf16(c.as_mut_slice()),
            }
        }
    }
}

/// 8-bit activations (integer products) or float32 ones.
fn activations(int8: bool) -> Activations8 {
    if int8 {
        Activations8::Int8
    } else {
        Activations8::Float
    }
}

/// The attention shape the bindings' keyword arguments describe.
fn attention_shape(
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    rope_dim: usize,
    neox: bool,
) -> AttentionShape {
    AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
        rope_dim,
        rope: if neox {
            RopeKind::Neox
        } else {
            RopeKind::Interleaved
        },
    }
}

/// Refuses a written buffer that shares a byte with another written one or with a read one (named ranges).
fn disjoint_writes(
    written: &[(&'static str, (usize, usize))],
    read: &[(&'static str, (usize, usize))],
) -> PyResult<()> {
    for (i, a) in written.iter().enumerate() {
        for b in written[i + 1..].iter().chain(read) {
            buffers::disjoint(*a, *b)?;
        }
    }
    Ok(())
}

/// The kernels' type for ggml type id `qtype`, or a ValueError listing the supported ones.
fn kernel_type(qtype: u32) -> PyResult<QType> {
    QType::from_id(qtype).ok_or_else(|| {
        let ids: Vec<String> = QType::ALL
            .iter()
            .map(|q| format!("{q:?}={}", *q as u32))
            .collect();
        PyValueError::new_err(format!(
            "ggml type {qtype} is not supported by the CPU kernels (supported: {})",
            ids.join(", ")
        ))
    })
}

/// The kernel set `name`, refused when unknown or when this CPU lacks it (never a SIGILL later).
fn checked_isa(name: &str) -> PyResult<Isa> {
    let isa = Isa::from_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown CPU kernel set '{name}' (choose best, amx, avx512, avxvnni, avx2, neon or scalar)"
        ))
    })?;
    if !isa.available() {
        return Err(PyValueError::new_err(format!(
            "this CPU lacks the instructions of the '{name}' kernels"
        )));
    }
    Ok(isa)
}

/// Checks kernel set `name` (`best`, `amx`, `avx512`, `avxvnni`, `avx2`, `neon`, `scalar`): a ValueError saying why
/// it cannot run here.
#[pyfunction]
fn check_kernel_isa(name: &str) -> PyResult<()> {
    checked_isa(name).map(|_| ())
}

/// Whether kernel set `name`'s 8-bit kernels are vector code on this CPU, not the scalar fallback.
#[pyfunction]
fn vectorized_kernels(name: &str) -> PyResult<bool> {
    Ok(checked_isa(name)?.vectorized())
}

/// Use `n` kernel threads (0: one per available CPU).
#[pyfunction]
fn set_kernel_threads(n: usize) -> PyResult<()> {
    Ok(kernels::set_threads(n)?)
}

/// Kernel threads in use.
#[pyfunction]
fn kernel_threads() -> usize {
    kernels::threads()
}

/// Seconds each of `repeats` passes of the kernel threads took to read `nbytes` of RAM once: the rate that bounds
/// a decode step, which reads every resident weight once (`ntio-bench memory`).
#[pyfunction]
#[pyo3(signature = (nbytes, repeats=5))]
fn memory_read_seconds(py: Python<'_>, nbytes: usize, repeats: usize) -> PyResult<Vec<f64>> {
    Ok(py.detach(|| kernels::memory_read_seconds(nbytes, repeats))?)
}

pub fn register(m: &Bound<PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quantized_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(column_groups_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(vectorized_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(set_kernel_threads, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_threads, m)?)?;
    m.add_function(wrap_pyfunction!(memory_read_seconds, m)?)?;
    m.add_function(wrap_pyfunction!(check_kernel_isa, m)?)?;
    m.add_function(wrap_pyfunction!(attend, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(interleave, m)?)?;
    m.add_function(wrap_pyfunction!(interleaved_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(decoder_stack, m)?)?;
    m.add("KERNEL_TYPES", QType::ALL.map(|q| q as u32).to_vec())?;
    let interleaved: std::collections::HashMap<u32, u32> = QType::ALL
        .into_iter()
        .filter_map(|q| q.interleaved().map(|(x8, _)| (q as u32, x8 as u32)))
        .collect();
    m.add("INTERLEAVED_TYPES", interleaved)?;
    let resident: Vec<u32> = QType::ALL
        .into_iter()
        .filter(|q| q.resident_interleaved())
        .map(|q| q as u32)
        .collect();
    m.add("RESIDENT_INTERLEAVED_TYPES", resident)?;
    m.add("KERNEL_MAX_T", kernels::MAX_T)?;
    let spans: std::collections::HashMap<u32, usize> = QType::ALL
        .iter()
        .filter_map(|q| q.span().map(|s| (*q as u32, s)))
        .collect();
    m.add("KERNEL_SPANS", spans)?;
    Ok(())
}
