"""The one op module between the graph and the kernels: linear layers and embedding lookups on encoded weights.

Weights stay in their GGUF encoding (`EncodedMatrix`) wherever they live — resident, pinned, or just read into a
staging slot — and each product picks how to run:
  * CPU, a type the Rust kernels decode: products straight from the encoded blocks (decode is memory-bound:
    ~4.5-8.5 bits per weight read instead of 32), with the running engine's `KernelChoice` (`using_kernels`): by
    default 8-bit activations and integer sums, as llama.cpp, for any number of rows where the kernels are vector
    code; float32 activations (and the scalar fallback) for T <= KERNEL_ROWS;
  * CUDA, up to cuda_kernels.MAX_ROWS tokens (decode, speculative verification) where CuPy is installed: one
    RawKernel launch per product, straight from the encoded blocks in device memory, with float32 activations;
  * otherwise (long prefill chunks with float32 activations, scalar kernels or dense weights, long CUDA passes,
    other types): dequantize into a reusable float32 scratch buffer, then `F.linear`.
With float32 activations both agree to ~1e-6 relative and with transformers' float32 to 1e-4; with 8-bit ones the
CPU kernels' products move by ~0.3-1% relative (ntio.kernels.cpu_kernels states the numerics).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from ntio import _core
from ntio.kernels import cpu_kernels, cuda_kernels, quant


@dataclass(frozen=True)
class EncodedMatrix:
    """A weight matrix [N, K] in its GGUF encoding: N rows of K / block_size blocks each, row-major, or with
    `interleaved` in groups of 8 rows (`interleave_rows`); its products are multiplied by `scale` (a per-tensor
    weight scale, which only BitNet files carry)."""

    raw: torch.Tensor  # uint8 [encoded_nbytes(qtype, shape)], contiguous, on the compute device (or pinned host)
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, int]  # (N, K)
    scale: float = 1.0
    interleaved: bool = False  # rows in groups of 8, word by word (`interleave_rows`): the same bytes, reordered

    @property
    def row_nbytes(self) -> int:
        return self.raw.numel() // self.shape[0]

    @functools.cached_property
    def kernel_arg(self) -> tuple[np.ndarray, int, int, float]:
        """(raw as numpy, type id, N, scale): what the CPU kernels take, made once per matrix (CPU only). The id is
        ggml's, or its interleaved layout's."""
        return self.raw.numpy(), self.kernel_type, self.shape[0], self.scale

    @property
    def kernel_type(self) -> int:
        return _core.INTERLEAVED_TYPES[int(self.qtype)] if self.interleaved else int(self.qtype)

    def encoded_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the encoding: [T, row_nbytes] uint8, as the file has them (an interleaved matrix's from
        their groups of 8 restored: a tied embedding that is an interleaved output head)."""
        if not self.interleaved:
            return self.raw.view(self.shape[0], self.row_nbytes)[ids]
        groups = self.raw.view(-1, INTERLEAVE_ROWS * self.row_nbytes)[ids // INTERLEAVE_ROWS]  # [T, 8 rows' bytes]
        rows = _plain_rows(groups.reshape(-1), self.qtype, groups.shape[0] * INTERLEAVE_ROWS)
        return rows.view(-1, INTERLEAVE_ROWS, self.row_nbytes)[torch.arange(ids.shape[0]), ids % INTERLEAVE_ROWS]


def fuse_adjacent(matrices: list[EncodedMatrix]) -> list[EncodedMatrix]:
    """Merge consecutive matrices of one type whose bytes are adjacent in one buffer into one matrix (a view).

    Row-major block encodings concatenate row-wise, so q/k/v or gate/up stored back to back run as one product.
    Only adjacency decides, never a copy, so a layer gets the same products wherever its buffer lives.
    """
    fused: list[EncodedMatrix] = []
    for m in matrices:
        last = fused[-1] if fused else None
        if (
            last is not None
            and last.qtype == m.qtype
            and last.scale == m.scale
            and last.interleaved == m.interleaved
            and last.shape[1] == m.shape[1]
            and last.raw.device == m.raw.device
            and last.raw.untyped_storage().data_ptr() == m.raw.untyped_storage().data_ptr()
            and last.raw.storage_offset() + last.raw.numel() == m.raw.storage_offset()
        ):
            span = last.raw.as_strided((last.raw.numel() + m.raw.numel(),), (1,))
            fused[-1] = EncodedMatrix(span, m.qtype, (last.shape[0] + m.shape[0], m.shape[1]), m.scale, m.interleaved)
        else:
            fused.append(m)
    return fused


def row_slice(w: EncodedMatrix, start: int, stop: int) -> EncodedMatrix:
    """Rows [start, stop) of w, as a view (rows are whole blocks in a row-major encoding; interleaved rows whole
    groups of INTERLEAVE_ROWS, so their bounds must be multiples of it: `linear_rows` takes any)."""
    if w.interleaved and (start % INTERLEAVE_ROWS or stop % INTERLEAVE_ROWS):
        raise ValueError(f"rows [{start}, {stop}) of an interleaved matrix cut through its groups of "
                         f"{INTERLEAVE_ROWS}")
    return EncodedMatrix(w.raw[start * w.row_nbytes : stop * w.row_nbytes], w.qtype, (stop - start, w.shape[1]),
                         w.scale, w.interleaved)


def linear_rows(x: torch.Tensor, w: EncodedMatrix, start: int, stop: int) -> torch.Tensor:
    """x @ rows [start, stop) of w, transposed: [T, stop - start] (a sparse FFN's neuron range). Interleaved rows are
    computed in the whole groups around them and the outputs cut to the range: on the CPU kernels an output's
    arithmetic is its own row's, so the bits are those of the range alone."""
    if not w.interleaved:
        return linear(x, row_slice(w, start, stop))
    first, last = start // INTERLEAVE_ROWS * INTERLEAVE_ROWS, -(-stop // INTERLEAVE_ROWS) * INTERLEAVE_ROWS
    return linear(x, row_slice(w, first, last))[:, start - first : stop - first]


# Rows per group of an interleaved matrix.
INTERLEAVE_ROWS = 8


def interleave_rows(w: EncodedMatrix) -> EncodedMatrix:
    """w with its rows interleaved by eight in place (`_core.interleave`: one linear stream per 8 rows, whose
    kernel sums each row in its own vector lane), where that pays: a type whose resident matrices take the layout on
    this CPU (`_core.RESIDENT_INTERLEAVED_TYPES`: Q4_1, Q4_K, and Q6_K with AVX-512 VNNI), whole groups of rows, on the
    CPU; else w as it is. The products give the plain rows' bits (SmolLM2's Q4_1 products ran 1.37-1.68x faster from
    T = 1 to 32 rows; Qwen2.5-Coder-1.5B's Q4_K ones 1.1x at T = 1 and 1.6x at T = 8, its Q6_K ones 1.15x at T = 4 to
    16, benches/RESULTS.md), so resident and streamed layers still agree. The bytes are w's own (a resident layer's
    buffer): whatever else views them must take the new layout. Where w is part of a row stack, the caller keeps its
    first row a multiple of INTERLEAVE_ROWS (`LayerWeights`)."""
    if (w.interleaved or w.raw.device.type != "cpu" or int(w.qtype) not in _core.RESIDENT_INTERLEAVED_TYPES
            or w.shape[0] % INTERLEAVE_ROWS):
        return w
    _core.interleave(w.raw.numpy(), int(w.qtype), w.shape[0], w.shape[1])
    return dataclasses.replace(w, interleaved=True)


def split_rows(ws: list[EncodedMatrix], n_first: int) -> tuple[EncodedMatrix, EncodedMatrix]:
    """Two row-stacked matrices (e.g. gate then up, fused by fuse_adjacent or not) as (first n_first rows, rest)."""
    if len(ws) == 2 and ws[0].shape[0] == n_first:
        return ws[0], ws[1]
    (w,) = ws
    return row_slice(w, 0, n_first), row_slice(w, n_first, w.shape[0])


# Dequantized weights for a dense product never take more than this: big matrices go in row chunks.
SCRATCH_BYTES = 64 << 20


class Scratch:
    """Reused float32 buffers for dequantized weights, one per device, grown to the largest chunk asked for and
    never beyond SCRATCH_BYTES. Each engine owns one (`using_scratch`), so two engines never share or race on it."""

    def __init__(self) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}

    def take(self, device: torch.device, numel: int) -> torch.Tensor:
        """A float32 buffer of exactly `numel` elements (a view of the device's buffer)."""
        buf = self._buffers.get(device)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[device] = torch.empty(numel, dtype=torch.float32, device=device)
        return buf[:numel]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * 4 for b in self._buffers.values())


# The scratch products use: the running engine's (set by `using_scratch`), else one for callers outside an engine.
_scratch: contextvars.ContextVar[Scratch] = contextvars.ContextVar("ntio_scratch", default=Scratch())


@contextmanager
def using_scratch(scratch: Scratch) -> Iterator[None]:
    token = _scratch.set(scratch)
    try:
        yield
    finally:
        _scratch.reset(token)


# The CPU kernels products use: the running engine's (set by `using_kernels`), else the defaults.
_kernels: contextvars.ContextVar[cpu_kernels.KernelChoice] = contextvars.ContextVar(
    "ntio_kernels", default=cpu_kernels.KernelChoice())


@contextmanager
def using_kernels(choice: cpu_kernels.KernelChoice) -> Iterator[None]:
    token = _kernels.set(choice)
    try:
        yield
    finally:
        _kernels.reset(token)


def _dequantized_rows(w: EncodedMatrix, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of w as float32 [stop - start, K] in the active scratch buffer."""
    k = w.shape[1]
    buf = _scratch.get().take(w.raw.device, (stop - start) * k)
    raw = w.raw[start * w.row_nbytes : stop * w.row_nbytes]
    if w.interleaved:  # whole groups (`linear`): restored to rows in one strided copy, then decoded as plain rows
        raw = _plain_rows(raw, w.qtype, stop - start)
    return quant.dequantize(raw, w.qtype, (stop - start, k), out=buf.view(stop - start, k))


def dequantized(w: EncodedMatrix) -> torch.Tensor:
    """The whole of w as a new float32 tensor [N, K] (its scale applied), for work outside the forward pass: the
    output head's (interleaved rows restored first)."""
    raw = _plain_rows(w.raw, w.qtype, w.shape[0]) if w.interleaved else w.raw
    dense = quant.dequantize(raw, w.qtype, w.shape)
    return dense * w.scale if w.scale != 1.0 else dense


def _plain_rows(raw: torch.Tensor, qtype: gguf.GGMLQuantizationType, n: int) -> torch.Tensor:
    """The plain rows of n interleaved ones (`_core.interleave`'s layout: in a group's block, word w of row r at
    byte 4 (8w + r), then, for a block of 4·words + tail bytes (Q6_K's 210), row r's tail at 32·words + tail·r), as a
    new tensor: one strided copy (and with a tail, a copy of the words and one joining the tails), on torch's
    threads."""
    words, tail = divmod(gguf.GGML_QUANT_SIZES[qtype][1], 4)
    groups = n // INTERLEAVE_ROWS
    mixed = raw.view(groups, -1, INTERLEAVE_ROWS * (4 * words + tail))  # [group, block, the group's block bytes]
    head = mixed[..., : INTERLEAVE_ROWS * 4 * words]
    if tail or head.storage_offset() % 4:
        head = head.clone()  # whole words from offset 0, for the int32 view
    head = head.view(torch.int32).view(groups, -1, words, INTERLEAVE_ROWS)  # [group, block, word, row]
    rows = head.permute(0, 3, 1, 2).contiguous().view(torch.uint8)  # [group, row, block, 4·words]
    if tail:
        tails = mixed[..., INTERLEAVE_ROWS * 4 * words :].view(groups, -1, INTERLEAVE_ROWS, tail).permute(0, 2, 1, 3)
        rows = torch.cat([rows, tails], dim=-1)
    return rows.reshape(-1)


# Attention work (query heads x cached positions x head_dim) below which one torch thread beats two: SDPA for one
# query measured on this project's VM, 9 heads x 150 positions x 64: 17 us on 1 thread, 16-72 us on 2; 9 x 2000 x 64:
# 184 us on 1, 113 on 2.
SERIAL_ATTENTION_WORK = 1 << 19


@contextmanager
def step_threads(device: torch.device, n_tokens: int, attention_work: int, threads: int | None = None) -> Iterator[None]:
    """Run a CPU step with torch's intra-op threads at `threads` (None: as they are), or at 1 for a small decode
    step, then restore them: an engine's thread setting never leaks into the process or into another engine.

    Small: T <= cpu_kernels.MAX_ROWS and attention_work (Hq * cached positions * hd) <= SERIAL_ATTENTION_WORK. Such
    a step's matrix products run on the Rust kernels' own thread pool. What is left for torch is tiny ops (norms,
    RoPE, attention over a short cache), where OpenMP's fork/join costs more than it saves. Its workers also spin
    between ops and take CPU that streamed reads need (benches/RESULTS.md, session 3). Prefill and attention over
    long caches keep every thread.
    """
    small = n_tokens <= cpu_kernels.MAX_ROWS and attention_work <= SERIAL_ATTENTION_WORK
    before = torch.get_num_threads()
    wanted = 1 if small else (threads or before)
    if device.type != "cpu" or wanted == before:
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# Rows up to which the CPU kernels with float32 activations beat dequantizing for a dense matmul (prefill of a
# 512-token prompt, measured 2026-11-24 on the project's VM, tok/s kernels vs dequantize: SmolLM2 64 rows 302 vs 334,
# 128: 223 vs 446, 512: 287 vs 585; Qwen2.5-Coder-1.5B 64 rows 34.6 vs 25.5, 128: 36.0 vs 35.3). With 8-bit
# activations the kernels take any number of rows: 512-token prefill passes ran 1.5x (SmolLM2 Q4_1) and 1.65x
# (Qwen2.5-Coder-1.5B Q4_K_M) faster than dequantizing (Zen 4 VM, 2026-11-27, one process, alternating). Also the
# most tokens the attention kernel and the one-call decoder stack take (`uses_cpu_attention`).
KERNEL_ROWS = 64


def _kernels_take(rows: int, qtypes: Iterable[gguf.GGMLQuantizationType], choice: cpu_kernels.KernelChoice) -> bool:
    """Whether the CPU kernels multiply `rows` activation rows with matrices of `qtypes` under `choice`: up to
    KERNEL_ROWS rows, every type one they decode; more, every type quantized and `choice.takes_long_passes`."""
    if rows <= KERNEL_ROWS:
        return all(q in cpu_kernels.KERNEL_TYPES for q in qtypes)
    return choice.takes_long_passes and all(q in cpu_kernels.QUANTIZED_KERNEL_TYPES for q in qtypes)


def uses_cpu_kernel(x: torch.Tensor, ws: list[EncodedMatrix]) -> bool:
    """Whether x @ wsᵀ runs on the CPU kernels (with the running engine's choice), not dequantized."""
    return x.device.type == "cpu" and _kernels_take(x.shape[0], (w.qtype for w in ws), _kernels.get())


def dequantizes(rows: int, qtypes: Iterable[gguf.GGMLQuantizationType], choice: cpu_kernels.KernelChoice, *,
                cuda: bool) -> bool:
    """Whether passes of `rows` tokens dequantize matrices of `qtypes` (into a `Scratch` of up to SCRATCH_BYTES):
    on CUDA where the CUDA kernels lack a type or take fewer rows; on CPU where `uses_cpu_kernel` would say no."""
    if cuda:
        return not all(cuda_kernels.takes(rows, q) for q in qtypes)
    return not _kernels_take(rows, qtypes, choice)


def uses_cuda_kernel(x: torch.Tensor, w: EncodedMatrix) -> bool:
    """Whether x @ wᵀ runs on the CUDA kernels (`cuda_kernels.takes`: float32 activations), not dequantized."""
    return (x.device.type == "cuda" and x.dtype == torch.float32 and not w.interleaved and w.shape[1] % 32 == 0
            and cuda_kernels.takes(x.shape[0], w.qtype))


def _kernel_product(x: torch.Tensor, ws: list[EncodedMatrix], norm: torch.Tensor | None = None, eps: float = 0.0,
                    gate: str | None = None) -> torch.Tensor:
    """The CPU kernels' product of x with the row-stacked ws (`cpu_kernels.fused_linear`'s prologues), with the
    running engine's kernel choice. The hot path of a decode step: straight to the binding, which checks every
    buffer and size itself."""
    choice = _kernels.get()
    out = np.empty((x.shape[0], sum(w.shape[0] for w in ws)), np.float32)
    _core.quantized_matmul(x.contiguous().numpy(), x.shape[0], ws[0].shape[1], [w.kernel_arg for w in ws], out,
                           isa=choice.isa, int8=choice.int8, norm=None if norm is None else norm.numpy(), eps=eps,
                           gate=gate)
    return torch.from_numpy(out)


def linear(x: torch.Tensor, w: EncodedMatrix) -> torch.Tensor:
    """x: [T, K] float32 -> x @ Wᵀ: [T, N]."""
    if uses_cpu_kernel(x, [w]):
        return _kernel_product(x, [w])
    if uses_cuda_kernel(x, w):
        return cuda_kernels.matmul(x, w.raw, w.qtype, w.shape, w.scale)
    n, k = w.shape
    rows = max(1, SCRATCH_BYTES // (4 * k))
    if w.interleaved:
        rows = max(INTERLEAVE_ROWS, rows // INTERLEAVE_ROWS * INTERLEAVE_ROWS)
    if rows >= n:
        out = F.linear(x, _dequantized_rows(w, 0, n))
    else:
        out = torch.empty((x.shape[0], n), dtype=torch.float32, device=x.device)
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            out[:, start:stop] = F.linear(x, _dequantized_rows(w, start, stop))
    return out if w.scale == 1.0 else out.mul_(w.scale)


def column_groups_linear(x: torch.Tensor, groups: Sequence[tuple[int, EncodedMatrix]]) -> torch.Tensor:
    """x [T, K] times some column groups of a matrix W [N, K]: Σ_j x[:, first_j:first_j + width] · G_jᵀ -> [T, N],
    each (first_j, G_j) the matrix [N, width] of W's columns from first_j (a store's group-major FFN down copy), all
    of one type, width and scale. The product of W with every other column of x zeroed."""
    if not groups:
        raise ValueError("column_groups_linear needs at least one group")
    w0 = groups[0][1]
    n, width = w0.shape
    if uses_cpu_kernel(x, [w0]):
        choice = _kernels.get()
        out = np.empty((x.shape[0], n), np.float32)
        _core.column_groups_matmul(x.contiguous().numpy(), x.shape[0], x.shape[1], width,
                                   [(first, g.raw.numpy()) for first, g in groups], int(w0.qtype), n, out,
                                   isa=choice.isa, int8=choice.int8)
        product = torch.from_numpy(out)
        return product if w0.scale == 1.0 else product.mul_(w0.scale)
    if uses_cuda_kernel(x, w0):
        return cuda_kernels.column_groups_matmul(x, [(first, g.raw) for first, g in groups], w0.qtype, n, width,
                                                 w0.scale)
    out = torch.zeros((x.shape[0], n), dtype=torch.float32, device=x.device)
    for first, g in groups:
        out += linear(x[:, first : first + width], g)
    return out


def linear_concat(x: torch.Tensor, ws: list[EncodedMatrix]) -> torch.Tensor:
    """x @ [W1; W2; ...]ᵀ for row-stacked matrices: [T, ΣN] (one kernel call on CPU)."""
    if len(ws) == 1:
        return linear(x, ws[0])
    if uses_cpu_kernel(x, ws):
        return _kernel_product(x, ws)
    return torch.cat([linear(x, w) for w in ws], dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, D] -> x / sqrt(mean(x²) + eps) · weight [D]."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def normed_linear(x: torch.Tensor, weight: torch.Tensor, eps: float, ws: list[EncodedMatrix]) -> torch.Tensor:
    """rms_norm(x, weight, eps) @ [W1; W2; ...]ᵀ: [T, ΣN]. On the CPU kernels the norm runs in the same call as the
    products (no normed tensor is made)."""
    if uses_cpu_kernel(x, ws):
        return _kernel_product(x, ws, norm=weight, eps=eps)
    return linear_concat(rms_norm(x, weight, eps), ws)


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


# The gate activations of gated feed-forward networks, by the names the kernels take.
GATES = {"silu": F.silu, "relu2": _relu2}


def gated_linear(gate_up: torch.Tensor, w: EncodedMatrix, gate: str = "silu", norm: torch.Tensor | None = None,
                 eps: float = 0.0) -> torch.Tensor:
    """gate_up [T, 2F] = [gate | up] -> rms_norm(act(gate) · up) @ Wᵀ: [T, N], with act one of GATES and the norm
    only where a weight `norm` [F] is given (BitNet's sub-norm). On the CPU kernels the gating and norm run in the
    same call as the product."""
    if uses_cpu_kernel(gate_up, [w]):
        return _kernel_product(gate_up, [w], norm=norm, eps=eps, gate=gate)
    g, up = gate_up.chunk(2, dim=-1)
    gated = GATES[gate](g) * up
    return linear(gated if norm is None else rms_norm(gated, norm, eps), w)


# The KV cache types the CPU attention kernel takes, by the names its binding takes. A 16-bit cache is widened to
# float32 a block of positions at a time inside the kernel: SmolLM2 decoding after a 2,250-token prompt with a
# float16 cache ran 26-29 tok/s through torch's ops, 79-80 through the kernel (2026-11-30, benches/RESULTS.md).
_KERNEL_KV_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def uses_cpu_attention(qkv: torch.Tensor, k_cache: torch.Tensor) -> bool:
    # Up to KERNEL_ROWS, with the products: a pass of that many tokens then gives each the bits a one-token
    # step gives it (the kernels' rows do not depend on T), which speculative verify passes and prefix reuse need.
    return qkv.device.type == "cpu" and qkv.shape[0] <= KERNEL_ROWS and k_cache.dtype in _KERNEL_KV_DTYPES


def _cache_array(cache: torch.Tensor) -> np.ndarray:
    """A KV cache as the kernels take it: its numpy view, bfloat16 (which numpy lacks) as its int16 bits."""
    return (cache.view(torch.int16) if cache.dtype == torch.bfloat16 else cache).numpy()


def cached_attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start_pos: int,
                     rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                     heads: tuple[int, int, int], *, neox: bool) -> torch.Tensor:
    """One CPU kernel call (ntio._core.attend): RoPE on qkv's queries and keys (in place), their keys and values
    written at start_pos.. of the caches (rounded to their dtype, one of `_KERNEL_KV_DTYPES`), and attention of each
    new query over the cache (in float32).

    qkv: [T, (Hq + 2 Hkv) hd]; k_cache, v_cache: [Hkv, capacity, hd]; rope: cos, sin [T, rope_dim/2]; mask: [T, L]
    bool or None (all L = start_pos + T positions); heads: (Hq, Hkv, hd). Returns [T, Hq hd]."""
    n_heads, n_kv_heads, hd = heads
    cos, sin = rope
    out = torch.from_numpy(np.empty((qkv.shape[0], n_heads * hd), np.float32))
    mask_u8 = None if mask is None else mask.contiguous().view(torch.uint8).numpy()
    _core.attend(qkv.numpy(), _cache_array(k_cache), _cache_array(v_cache), k_cache.shape[1], start_pos,
                 cos.contiguous().numpy(), sin.contiguous().numpy(), mask_u8, out.numpy(), n_heads=n_heads,
                 n_kv_heads=n_kv_heads, head_dim=hd, rope_dim=2 * cos.shape[-1], neox=neox,
                 kv_dtype=_KERNEL_KV_DTYPES[k_cache.dtype], parents=tree_parents(mask, start_pos))
    return out


def tree_parents(mask: torch.Tensor | None, start_pos: int) -> list[int] | None:
    """The token tree that a mask [T, start_pos + T] of new tokens describes (`layers.causal_mask` with parents):
    each token's parent, the last earlier new token it attends (-1 for the root). None where the new tokens are a
    sequence (each attends every earlier one), or where the mask is no tree's (a position hidden from a token but
    not from its parent: a skipped layer's).

    The kernels then give each tree token the bits that decoding its branch one token at a time gives: its keys and
    values sit in slot start_pos + i, not at its position, and the kernels' sums follow positions
    (`rust/kernels/attention.rs`). A token's parent hidden from it alone (its layer skipped, adaptive depth) reads
    as no ancestor: that token then attends what it should, but its sums count one position fewer than decoding's
    and round differently."""
    if mask is None or mask.shape[0] < 2:
        return None
    region = mask[:, start_pos:]  # [T, T]
    n = region.shape[0]
    order = torch.arange(n, device=mask.device)
    earlier = region & (order[None, :] < order[:, None])
    if torch.equal(earlier, order[None, :] < order[:, None]):
        return None  # a sequence
    parents = torch.where(earlier, order[None, :], -1).amax(dim=1)
    own = region[order, order]
    inherited = torch.cat((region[:1], region[parents[1:]]))  # row 0: its own row (it has no parent)
    inherited[order, order] = True
    if parents[0] != -1 or not bool(own.all()) or not torch.equal(region, inherited):
        return None
    return parents.tolist()


def uses_cpu_block(h: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether decoder blocks over h run as one CPU kernel call (`decoder_stack`), as far as the input decides (the
    weights decide in `LayerWeights.kernel_args`)."""
    return uses_cpu_attention(h, k_cache)


@dataclass
class SequenceRows:
    """One sequence's part of a block's pass: its rows of h, its layer's KV cache, and where its tokens go."""

    rows: slice  # of h [ΣT, D]
    k_cache: torch.Tensor  # [Hkv, capacity, hd]: this layer's (a stack's: [L, Hkv, capacity, hd], its L layers')
    v_cache: torch.Tensor
    start_pos: int
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, rope_dim/2]
    mask: torch.Tensor | None  # [T, start_pos + T]


def decoder_stack(h: torch.Tensor, layers: list[_core.Layer], sequences: Sequence[SequenceRows], eps: float,
                  heads: tuple[int, int, int], *, neox: bool, gate: str = "silu",
                  gate_up: torch.Tensor | None = None, attention_only: bool = False) -> torch.Tensor:
    """h [T, D] (not modified) through a stack of pre-norm blocks in one CPU kernel call (ntio._core.decoder_stack)
    -> [T, D]: each block h + attention(rms_norm(h)), then + gated FFN(rms_norm(.)), with the same products and
    attention as the per-op path, bit for bit, and no return to Python between blocks. layers: each block's
    `LayerWeights.kernel_args`; sequences: the rows of one or several sequences (their `rows` in order, tiling h),
    each attending over its own cache [L, Hkv, capacity, hd], the stack's L layers in order (one block: [Hkv,
    capacity, hd]); the other arguments as in `normed_linear` and `cached_attention`. With `gate_up` (float32 [T, 2F],
    contiguous), the last block stops after its FFN's gate/up products, written there: the result is then the
    residual stream after that block's attention; with `attention_only`, the last block stops after its attention
    (its FFN matrices are not read: they may view bytes never filled)."""
    choice = _kernels.get()
    n_heads, n_kv_heads, hd = heads
    out = h.clone(memory_format=torch.contiguous_format)
    caches = [(_cache_array(s.k_cache), _cache_array(s.v_cache), s.k_cache.shape[-2], s.start_pos,
               s.rope[0].contiguous().numpy(), s.rope[1].contiguous().numpy(),
               None if s.mask is None else s.mask.contiguous().view(torch.uint8).numpy(),
               tree_parents(s.mask, s.start_pos), s.rows.stop - s.rows.start)
              for s in sequences]
    _core.decoder_stack(out.numpy(), h.shape[1], layers, caches, eps=eps, n_heads=n_heads, n_kv_heads=n_kv_heads,
                        head_dim=hd, rope_dim=2 * sequences[0].rope[0].shape[-1], neox=neox, gate=gate,
                        isa=choice.isa, int8=choice.int8, gate_up=None if gate_up is None else gate_up.numpy(),
                        attention_only=attention_only, kv_dtype=_KERNEL_KV_DTYPES[sequences[0].k_cache.dtype])
    return out


class RowSource(Protocol):
    """An encoded [V, D] table whose rows are fetched by id: an `EncodedMatrix`, or rows read from disk on demand
    (ntio.runtime.disk_rows)."""

    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, int]

    def encoded_rows(self, ids: torch.Tensor) -> torch.Tensor: ...


def embedding(ids: torch.Tensor, table: RowSource) -> torch.Tensor:
    """Rows `ids` [T] of an encoded [V, D] table, dequantized: [T, D] float32. Only the T rows are decoded: on the
    CPU in one kernel call (a decode step's ~15 torch ops of `quant.dequantize` took ~0.45 ms of a Qwen 1.5B token),
    elsewhere by `quant.dequantize`; both give gguf-py's values."""
    rows = table.encoded_rows(ids)
    if rows.device.type == "cpu" and table.qtype in cpu_kernels.KERNEL_TYPES:
        out = np.empty((ids.shape[0], table.shape[1]), np.float32)
        _core.dequantize(rows.contiguous().numpy(), int(table.qtype), table.shape[1], out)
        return torch.from_numpy(out)
    return quant.dequantize(rows.reshape(-1), table.qtype, (ids.shape[0], table.shape[1]))
