"""Shared layers of the decoder-only families, as pure functions of (activations, weights, KV cache).

Model code never knows where its weights come from: the engine hands each block its `LayerWeights`, which may be
resident or just streamed from disk. Matrices stay GGUF-encoded; `ntio.kernels.ops` decides how each product runs.
Compute is float32; KV caches may be fp32/fp16/bf16 and are upcast to float32 for attention.

Shapes: T = new tokens this step, D = d_model, Hq / Hkv = query / KV heads, hd = head_dim, F = d_ff,
L = cached positions after this step (start_pos + T).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from ntio import _core
from ntio.kernels import cpu_kernels, ops
from ntio.kernels.ops import EncodedMatrix, SequenceRows, rms_norm

if TYPE_CHECKING:
    from ntio.models.config import ModelConfig


@dataclass(frozen=True)
class GroupedFFN:
    """The FFN matrices of some of a layer's neuron groups, as `FFNGroups.read` gives them: each group's down
    [D, neurons] matrix, in the order asked; per run of consecutive groups, (first neuron, its rows [m, D] of each
    of `FFNGroups.parts` in turn)."""

    down: list[EncodedMatrix]
    runs: list[tuple[int, list[EncodedMatrix]]]


@dataclass(frozen=True)
class FFNGroups:
    """A layer's FFN matrices not read with it: its down matrix [D, F] and the matrices named in `parts`, read by
    rows ("ffn_gate", "ffn_up"): a load policy's "down_later" (no parts), "up_later" (up) or "ffn_later" (gate
    and up) decision. The FFN reads the groups of `neurons` consecutive neurons its tokens keep, once it knows
    them, and multiplies only those."""

    neurons: int
    read: Callable[[list[int]], GroupedFFN]  # sorted group ids -> their matrices
    parts: tuple[str, ...] = ()


@dataclass
class LayerWeights:
    """Weights of one transformer block on the compute device: float32 vectors, GGUF-encoded matrices.

    Q/K/V and gate/up are row-stacked groups; matrices of one type stored back to back are fused into one
    (ops.fuse_adjacent), so a decode step runs as few as 4 matrix-vector products per block instead of 7.
    Q and K rows are in GGUF order (llama.cpp's converter permutes Llama's for interleaved RoPE).
    """

    attn_norm: torch.Tensor  # [D] float32
    wqkv: list[EncodedMatrix]  # rows stack to [Hq*hd + 2*Hkv*hd, D]
    qkv_bias: torch.Tensor | None  # [Hq*hd + 2*Hkv*hd] float32 (Qwen2), or None
    wo: EncodedMatrix  # [D, Hq*hd]
    ffn_norm: torch.Tensor  # [D] float32
    w_gate_up: list[EncodedMatrix]  # rows stack to [2F, D]: gate rows then up rows
    w_down: EncodedMatrix  # [D, F]
    # BitNet's sub-norms: RMSNorm weights of the attention output before wo [Hq*hd] and of the gated activations
    # before w_down [F]; None for the other families.
    attn_sub_norm: torch.Tensor | None = None
    ffn_sub_norm: torch.Tensor | None = None
    # FFN neuron ranges [start, stop) whose gate/up rows were loaded (a load policy's "rows" decision); None: all.
    # w_gate_up then holds only the bytes of those rows: the others were never read.
    ffn_rows: tuple[tuple[int, int], ...] | None = None
    # (x [T, D] the FFN's normed input, gate and up pre-activations [T, F]) -> [T, F] bool: the neurons each token
    # keeps, the others counting as 0 in the down product (a load policy's sparse FFN, ntio.policies.sparse_ffn);
    # None: all.
    ffn_mask: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # Set where down (and the matrices in its `parts`) was not read (those matrices then view bytes never filled):
    # its groups are read on demand.
    ffn_groups: FFNGroups | None = None

    def with_interleaved_rows(self) -> LayerWeights:
        """These weights with every matrix that pays for it interleaved in place (`ops.interleave_rows`): a
        resident layer's, once at load. Same results, bit for bit."""
        return dataclasses.replace(self, wqkv=_interleaved(self.wqkv), wo=ops.interleave_rows(self.wo),
                                   w_gate_up=_interleaved(self.w_gate_up, cut=self.w_down.shape[1]),
                                   w_down=ops.interleave_rows(self.w_down))

    @property
    def whole_ffn(self) -> bool:
        """Whether the FFN multiplies every neuron with the resident or read down matrix (no mask, no groups)."""
        return self.ffn_mask is None and self.ffn_groups is None

    def choosing_ffn(self, **fields) -> LayerWeights:
        """These weights with `ffn_mask` or `ffn_groups` set, and the kernel arguments already made (which do not
        depend on them)."""
        chosen = dataclasses.replace(self, **fields)
        if "kernel_args" in self.__dict__:
            chosen.__dict__["kernel_args"] = self.__dict__["kernel_args"]
        return chosen

    @functools.cached_property
    def kernel_args(self) -> _core.Layer | None:
        """The block as one CPU kernel call takes it (`ops.decoder_stack`), made once; None where the block does not
        run as one call whatever its input (a type the kernels lack, weights off the CPU, an FFN row subset). A
        block whose FFN chooses its neurons (not `whole_ffn`) runs as one call up to its gate/up products."""
        matrices = [*self.wqkv, self.wo, *self.w_gate_up, self.w_down]
        if (self.ffn_rows is not None or self.attn_norm.device.type != "cpu"
                or not all(m.qtype in cpu_kernels.KERNEL_TYPES for m in matrices)):
            return None
        return (self.attn_norm.numpy(), [m.kernel_arg for m in self.wqkv], _numpy(self.qkv_bias), self.wo.kernel_arg,
                self.ffn_norm.numpy(), [m.kernel_arg for m in self.w_gate_up], self.w_down.kernel_arg,
                _numpy(self.attn_sub_norm), _numpy(self.ffn_sub_norm))


def _interleaved(stack: list[EncodedMatrix], cut: int | None = None) -> list[EncodedMatrix]:
    """Row-stacked matrices, each interleaved (`ops.interleave_rows`) where its first row in the stack is a multiple
    of ops.INTERLEAVE_ROWS (a product takes interleaved rows at group-aligned output columns only) and so is `cut`
    where it falls inside it (gate/up are split at F: `ops.split_rows`)."""
    out, first = [], 0
    for m in stack:
        stop = first + m.shape[0]
        inside = cut is not None and first < cut < stop
        aligned = first % ops.INTERLEAVE_ROWS == 0 and not (inside and (cut - first) % ops.INTERLEAVE_ROWS)
        out.append(ops.interleave_rows(m) if aligned else m)
        first = stop
    return out


def _numpy(v: torch.Tensor | None) -> np.ndarray | None:
    return None if v is None else v.numpy()


@dataclass
class GlobalWeights:
    """Weights outside the blocks; always resident."""

    token_embd: ops.RowSource  # [V, D]: resident (an EncodedMatrix) or rows read on demand
    output_norm: torch.Tensor  # [D] float32
    output: EncodedMatrix | None  # [V, D] (token_embd itself when tied); None: streamed (LayerSource.head_chunks)
    inv_freq: torch.Tensor  # [rope_dim/2] RoPE inverse frequencies, scaling already applied


def rope_inverse_frequencies(cfg: ModelConfig, rope_freqs: torch.Tensor | None) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/rope_dim), divided by Llama-3's per-frequency factors when the file has them."""
    exponents = torch.arange(0, cfg.rope_dim, 2, dtype=torch.int64).float() / cfg.rope_dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    if rope_freqs is not None:
        inv_freq = inv_freq / rope_freqs.float()
    elif cfg.rope_scaling.divisors is not None:
        inv_freq = inv_freq / torch.tensor(cfg.rope_scaling.divisors, dtype=torch.float32)
    if cfg.rope_scaling.kind == "linear":
        inv_freq = inv_freq / cfg.rope_scaling.factor
    return inv_freq


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, rope_dim/2] for positions [T] (int64)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


class RopeTable:
    """An engine's rotations, cos and sin [P, rope_dim/2] of positions 0..P-1, made (`rope_tables`) in blocks of
    BLOCK positions as the positions asked for reach them, so that a position's values never depend on which
    positions were asked for first. A step's rotation is then a slice of the table: making it took four torch ops
    and ~0.1 ms of a decode step, run right after the layers have flushed the caches."""

    BLOCK = 256

    def __init__(self, inv_freq: torch.Tensor, capacity: int) -> None:
        self.inv_freq, self.capacity = inv_freq, capacity  # positions it may be asked for: a KV cache's
        self.cos = self.sin = inv_freq.new_empty((0, inv_freq.shape[0]))

    def rows(self, start_pos: int, n_tokens: int, parents: Sequence[int] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rope_dim/2] of the new tokens' positions (`token_positions`)."""
        if parents is None:
            self._reach(start_pos + n_tokens)
            return self.cos[start_pos : start_pos + n_tokens], self.sin[start_pos : start_pos + n_tokens]
        positions = token_positions(start_pos, n_tokens, parents, self.inv_freq.device)
        self._reach(int(positions.max()) + 1)
        return self.cos[positions], self.sin[positions]

    def _reach(self, end: int) -> None:
        """Grows the table past position end - 1, at least doubling it (up to the capacity): O(P) copying in all."""
        have = self.cos.shape[0]
        if end <= have:
            return
        stop = -(-max(end, min(2 * have, self.capacity)) // self.BLOCK) * self.BLOCK
        blocks = [rope_tables(self.inv_freq, torch.arange(b, b + self.BLOCK, device=self.inv_freq.device))
                  for b in range(have, stop, self.BLOCK)]
        self.cos = torch.cat([self.cos] + [c for c, _ in blocks])
        self.sin = torch.cat([self.sin] + [s for _, s in blocks])


def _rotated(x0: torch.Tensor, x1: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, rope_dim/2] against x0, x1: [T, H, rope_dim/2]
    return x0 * c - x1 * s, x0 * s + x1 * c


def _with_tail(rotated: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Features past rope_dim pass through unrotated (partial RoPE)."""
    rope_dim = rotated.shape[-1]
    return rotated if rope_dim == x.shape[-1] else torch.cat((rotated, x[..., rope_dim:]), dim=-1)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x: [T, H, hd] rotating pairs (x[2i], x[2i+1]) of the first rope_dim features (GPT-J style), as one
    complex product (x[2i] + i·x[2i+1]) · (cos + i·sin): three tensor ops where real arithmetic takes ten."""
    rope_dim = 2 * cos.shape[-1]
    pairs = x[..., :rope_dim].unflatten(-1, (-1, 2))  # [T, H, rope_dim/2, 2], a view
    if pairs.storage_offset() % 2 or any(st % 2 for st in pairs.stride()[:-1]):
        pairs = pairs.contiguous()  # view_as_complex needs whole complex numbers in place
    rotated = torch.view_as_real(torch.view_as_complex(pairs) * torch.complex(cos, sin)[:, None, :]).flatten(-2)
    return _with_tail(rotated, x)


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x: [T, H, hd] rotating pairs (x[i], x[i + rope_dim/2]) of the first rope_dim features (GPT-NeoX)."""
    half = cos.shape[-1]
    rotated = torch.cat(_rotated(x[..., :half], x[..., half : 2 * half], cos, sin), dim=-1)
    return _with_tail(rotated, x)


RopeFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ROPE_KINDS: dict[str, RopeFunction] = {"interleaved": rope_interleaved, "neox": rope_neox}


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth in a token tree: parents[i] is node i's parent (an earlier node), -1 for node 0, the root
    (depth 0). Raises ValueError for anything else."""
    depths: list[int] = []
    for i, parent in enumerate(parents):
        if (parent != -1) if i == 0 else not 0 <= parent < i:
            raise ValueError(f"token tree parents {list(parents)}: node 0 must be the root (-1), every other node's "
                             f"parent an earlier node")
        depths.append(0 if i == 0 else depths[parent] + 1)
    return depths


def token_positions(start_pos: int, n_tokens: int, parents: Sequence[int] | None, device: torch.device
                    ) -> torch.Tensor:
    """[T] int64: the positions of new tokens in cache slots start_pos..: consecutive for a sequence, start_pos +
    depth for a token tree's nodes (`parents`, as in tree_depths)."""
    if parents is None:
        return torch.arange(start_pos, start_pos + n_tokens, device=device)
    return start_pos + torch.tensor(tree_depths(parents), dtype=torch.int64, device=device)


def causal_mask(start_pos: int, n_tokens: int, device: torch.device, parents: Sequence[int] | None = None
                ) -> torch.Tensor | None:
    """[T, L] boolean mask, True where new token t may attend key j: every cached position (j < start_pos) and,
    among the new tokens (slot start_pos + i for token i), itself and those before it, which in a token tree
    (`parents`, as in tree_depths) are its ancestors. None for one token (it attends to all)."""
    if n_tokens == 1:
        return None
    if parents is None:
        q_pos = torch.arange(start_pos, start_pos + n_tokens, device=device)
        k_pos = torch.arange(start_pos + n_tokens, device=device)
        return k_pos[None, :] <= q_pos[:, None]
    tree_depths(parents)  # checks the shape
    ancestry = torch.eye(n_tokens, dtype=torch.bool)  # [T, T]: row i marks i and its ancestors
    for i in range(1, n_tokens):
        ancestry[i] |= ancestry[parents[i]]
    cached = torch.ones((n_tokens, start_pos), dtype=torch.bool)
    return torch.cat((cached, ancestry), dim=1).to(device)


def attention(
    h: torch.Tensor,
    w: LayerWeights,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start_pos: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    cfg: ModelConfig,
    rope_kind: str,
) -> torch.Tensor:
    """Grouped-query self-attention of rms_norm(h). h: [T, D] -> [T, D]; writes K/V for start_pos..start_pos+T-1.

    k_cache, v_cache: [Hkv, capacity, hd] for this layer; rope_kind: a key of ROPE_KINDS. A few tokens on the CPU
    take one kernel call (ops.cached_attention) for RoPE, the cache writes and attention.
    """
    attn = attend(_qkv(h, w, cfg), k_cache, v_cache, start_pos, rope, mask, cfg, rope_kind)
    return _attention_output(attn, w, cfg.rms_eps)


def _qkv(h: torch.Tensor, w: LayerWeights, cfg: ModelConfig) -> torch.Tensor:
    """The queries, keys and values of rms_norm(h): [T, D] -> [T, Q + 2 KV] (with the biases, where any)."""
    qkv = ops.normed_linear(h, w.attn_norm, cfg.rms_eps, w.wqkv)
    return qkv if w.qkv_bias is None else qkv + w.qkv_bias


def attend(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start_pos: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    cfg: ModelConfig,
    rope_kind: str,
) -> torch.Tensor:
    """RoPE on one sequence's new queries and keys, their K/V written at start_pos.. of its layer cache, and
    attention over the cache: qkv [T, Q + 2 KV] -> [T, Hq hd]. A few tokens on the CPU take one kernel call
    (ops.cached_attention); elsewhere torch's ops, in the queries' dtype over the cache's contents."""
    n_tokens, end, hd = qkv.shape[0], start_pos + qkv.shape[0], cfg.head_dim
    if ops.uses_cpu_attention(qkv, k_cache):
        return ops.cached_attention(qkv, k_cache, v_cache, start_pos, rope, mask, (cfg.n_heads, cfg.n_kv_heads, hd),
                                    neox=rope_kind == "neox")
    qk_width = cfg.q_width + cfg.kv_width
    # Query and key heads rotated together: [T, Hq + Hkv, hd]
    qk = ROPE_KINDS[rope_kind](qkv[:, :qk_width].view(n_tokens, cfg.n_heads + cfg.n_kv_heads, hd), *rope)
    q, k = qk.split((cfg.n_heads, cfg.n_kv_heads), dim=1)
    k_cache[:, start_pos:end] = k.transpose(0, 1)
    v_cache[:, start_pos:end] = qkv[:, qk_width:].view(n_tokens, cfg.n_kv_heads, hd).transpose(0, 1)
    keys = k_cache[:, :end].to(q.dtype)  # [Hkv, L, hd]; a no-op view when the cache is in the compute dtype
    values = v_cache[:, :end].to(q.dtype)
    attn = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=cfg.n_heads != cfg.n_kv_heads
    )  # [Hq, T, hd]
    return attn.transpose(0, 1).reshape(n_tokens, cfg.q_width)


def _attention_output(attn: torch.Tensor, w: LayerWeights, eps: float) -> torch.Tensor:
    """wo · attn [T, Hq hd] -> [T, D], through BitNet's sub-norm first where the block has one."""
    if w.attn_sub_norm is None:
        return ops.linear(attn, w.wo)
    return ops.normed_linear(attn, w.attn_sub_norm, eps, [w.wo])


def gated_ffn(h: torch.Tensor, w: LayerWeights, cfg: ModelConfig, taps: dict[str, torch.Tensor] | None = None
              ) -> torch.Tensor:
    """Gated feed-forward of x = rms_norm(h): [T, D] -> down(sub_norm(act(gate x) * up x)): [T, D], act being
    cfg.ffn_gate (SiLU: SwiGLU; BitNet's squared ReLU) and sub_norm BitNet's (absent in the other families).

    With `w.ffn_rows`, only those neurons are computed and the others count as 0 (the down projection is whole);
    with `w.ffn_mask`, each token's down product takes only the neurons it keeps; with `w.ffn_groups`, the groups
    of down that some token keeps are read then, and the product runs over them alone (`ops.column_groups_linear`);
    with `w.ffn_groups.parts`, only the kept groups' rows of those matrices are read and computed too, the mask
    choosing before they are (`_ffn_of_groups`). taps["ffn_gate"] receives the gate pre-activations [T, F] (zeros
    for neurons not computed) when taps is given.
    """
    eps = cfg.rms_eps
    if w.ffn_groups is not None and w.ffn_groups.parts:
        return _ffn_of_groups(rms_norm(h, w.ffn_norm, eps), w, cfg, taps)
    if w.ffn_rows is None:
        gate_up = ops.normed_linear(h, w.ffn_norm, eps, w.w_gate_up)  # [T, 2F]: gate | up
    else:
        gate_up = torch.cat(_sparse_gate_up(rms_norm(h, w.ffn_norm, eps), w), dim=-1)
    if taps is not None:
        taps["ffn_gate"] = gate_up[:, : w.w_down.shape[1]]
    return _ffn_from_gate_up(h, gate_up, w, cfg)


def _ffn_from_gate_up(h: torch.Tensor, gate_up: torch.Tensor, w: LayerWeights, cfg: ModelConfig) -> torch.Tensor:
    """The rest of `gated_ffn` once its gate and up pre-activations gate_up [T, 2F] are known (h [T, D]: its input
    before the norm, which `w.ffn_mask` reads normed) -> [T, D]."""
    eps, d_ff = cfg.rms_eps, w.w_down.shape[1]
    if w.whole_ffn:
        return ops.gated_linear(gate_up, w.w_down, cfg.ffn_gate, w.ffn_sub_norm, eps)
    gate, up = gate_up[:, :d_ff], gate_up[:, d_ff:]
    keep = None if w.ffn_mask is None else w.ffn_mask(rms_norm(h, w.ffn_norm, eps), gate, up)  # [T, F] bool
    gated = ops.GATES[cfg.ffn_gate](gate) * up
    if keep is not None:
        gated = gated * keep
    if w.ffn_sub_norm is not None:
        gated = rms_norm(gated, w.ffn_sub_norm, eps)
    if w.ffn_groups is None:
        return ops.linear(gated, w.w_down)
    ids = _kept_groups(keep, d_ff, w.ffn_groups.neurons)
    return _grouped_down(gated, ids, w.ffn_groups.neurons, w.ffn_groups.read(ids))


def _kept_groups(keep: torch.Tensor | None, d_ff: int, neurons: int) -> list[int]:
    """The groups of `neurons` consecutive neurons that some token keeps (keep [T, F] bool; None: all), sorted."""
    if keep is None:
        return list(range(d_ff // neurons))
    return keep.view(keep.shape[0], d_ff // neurons, neurons).any(dim=2).any(dim=0).nonzero().flatten().tolist()


def _grouped_down(gated: torch.Tensor, ids: list[int], neurons: int, read: GroupedFFN) -> torch.Tensor:
    """gated [T, F] · W_downᵀ over the groups `ids` of down alone (zero elsewhere in gated), read as `read`."""
    return ops.column_groups_linear(gated, [(g * neurons, m) for g, m in zip(ids, read.down)])


def _ffn_of_groups(x: torch.Tensor, w: LayerWeights, cfg: ModelConfig, taps: dict[str, torch.Tensor] | None
                   ) -> torch.Tensor:
    """The FFN of a layer read without up and down, or without gate, up and down (`w.ffn_groups.parts`), from its
    normed input x [T, D]: `w.ffn_mask` chooses each token's neurons from x (and the gate products where gate was
    read), the groups some token keeps are read, and each token computes its kept neurons (the others count as 0,
    as `gated_ffn` with the same mask computes them)."""
    n_tokens, d_ff, groups = x.shape[0], w.w_down.shape[1], w.ffn_groups
    gate = up = None
    if "ffn_gate" not in groups.parts:  # read with the layer
        gate = ops.linear(x, ops.split_rows(w.w_gate_up, d_ff)[0])
    keep = None if w.ffn_mask is None else w.ffn_mask(x, gate, None)  # [T, F] bool
    ids = _kept_groups(keep, d_ff, groups.neurons)
    read = groups.read(ids)
    products = {part: x.new_zeros((n_tokens, d_ff)) for part in groups.parts}
    # Every run's rows of every part read, in one product (one kernel call on the CPU): [T, parts · kept].
    together = ops.linear_concat(x, [m for _, matrices in read.runs for m in matrices])
    at = 0
    for first, matrices in read.runs:
        for part, m in zip(groups.parts, matrices):
            products[part][:, first : first + m.shape[0]] = together[:, at : at + m.shape[0]]
            at += m.shape[0]
    gate, up = products.get("ffn_gate", gate), products["ffn_up"]
    if taps is not None:
        taps["ffn_gate"] = gate
    gated = ops.GATES[cfg.ffn_gate](gate) * up
    if keep is not None:
        gated = gated * keep
    if w.ffn_sub_norm is not None:
        gated = rms_norm(gated, w.ffn_sub_norm, cfg.rms_eps)
    return _grouped_down(gated, ids, groups.neurons, read)


def _sparse_gate_up(x: torch.Tensor, w: LayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up pre-activations [T, F] of the neurons in w.ffn_rows; 0 elsewhere (silu(0) * 0 = 0)."""
    gate_m, up_m = ops.split_rows(w.w_gate_up, w.w_down.shape[1])
    d_ff = gate_m.shape[0]
    gate = x.new_zeros((x.shape[0], d_ff))
    up = x.new_zeros((x.shape[0], d_ff))
    for start, stop in w.ffn_rows:
        gate[:, start:stop] = ops.linear_rows(x, gate_m, start, stop)
        up[:, start:stop] = ops.linear_rows(x, up_m, start, stop)
    return gate, up


def pre_norm_block(
    h: torch.Tensor,
    w: LayerWeights,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start_pos: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    cfg: ModelConfig,
    rope_kind: str,
    taps: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """h + attention(norm(h)), then + gated_ffn(norm(.)): [T, D] -> [T, D]. A few tokens on the CPU run the whole
    block as one kernel call (`_one_call`) unless taps are asked for; a block whose FFN chooses its neurons, up to
    its gate/up products."""
    if taps is None:
        rows = [SequenceRows(slice(0, h.shape[0]), k_cache, v_cache, start_pos, rope, mask)]
        if w.ffn_groups is not None and w.ffn_groups.parts:
            attended = _one_call_attention(h, w, rows, cfg, rope_kind)
            if attended is not None:
                return attended + _ffn_of_groups(rms_norm(attended, w.ffn_norm, cfg.rms_eps), w, cfg, None)
        if not w.whole_ffn:
            split = _one_call_to_gate_up(h, w, rows, cfg, rope_kind)
            if split is not None:
                h, gate_up = split
                return h + _ffn_from_gate_up(h, gate_up, w, cfg)
        fused = _one_call(h, w, rows, cfg, rope_kind)
        if fused is not None:
            return fused
    h = h + attention(h, w, k_cache, v_cache, start_pos, rope, mask, cfg, rope_kind)
    return h + gated_ffn(h, w, cfg, taps)


def pre_norm_stack(h: torch.Tensor, ws: Sequence[LayerWeights], sequences: Sequence[SequenceRows], cfg: ModelConfig,
                   rope_kind: str) -> torch.Tensor | None:
    """h [ΣT, D] of one or several sequences through the blocks ws in order as one CPU kernel call
    (`ops.decoder_stack`: each block what `batched_block` computes, bit for bit), or None where they do not run as
    one call. Each sequence's caches [len(ws), Hkv, capacity, hd] hold the blocks' in order."""
    args = [w.kernel_args for w in ws]
    if not ops.uses_cpu_block(h, sequences[0].k_cache) or any(a is None for a in args) or not all(
            w.whole_ffn for w in ws):
        return None
    return ops.decoder_stack(h, args, sequences, cfg.rms_eps, (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim),
                             neox=rope_kind == "neox", gate=cfg.ffn_gate)


def batched_block(h: torch.Tensor, w: LayerWeights, sequences: Sequence[SequenceRows], cfg: ModelConfig,
                  rope_kind: str) -> torch.Tensor:
    """h [ΣT, D] of several sequences through one block: every product over all their rows at once (the layer's
    weights are read once for the batch), attention per sequence over its own KV cache. Each row's products are
    the ones it gets alone (the CPU kernels compute rows independently), and so is its attention. On the CPU a few
    rows in all run as one kernel call (`_one_call`)."""
    fused = _one_call(h, w, sequences, cfg, rope_kind)
    if fused is not None:
        return fused
    qkv = _qkv(h, w, cfg)
    attn = torch.cat([attend(qkv[s.rows], s.k_cache, s.v_cache, s.start_pos, s.rope, s.mask, cfg, rope_kind)
                      for s in sequences])
    h = h + _attention_output(attn, w, cfg.rms_eps)
    return h + gated_ffn(h, w, cfg)


def _one_call_to_gate_up(h: torch.Tensor, w: LayerWeights, sequences: Sequence[SequenceRows], cfg: ModelConfig,
                         rope_kind: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The block's attention and its FFN's gate/up products as one CPU kernel call: (h after the attention [T, D],
    gate_up [T, 2F]), or None where it does not run as one."""
    if not ops.uses_cpu_block(h, sequences[0].k_cache) or w.kernel_args is None:
        return None
    gate_up = torch.empty((h.shape[0], 2 * w.w_down.shape[1]), dtype=torch.float32)
    h = ops.decoder_stack(h, [w.kernel_args], sequences, cfg.rms_eps, (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim),
                          neox=rope_kind == "neox", gate=cfg.ffn_gate, gate_up=gate_up)
    return h, gate_up


def _one_call_attention(h: torch.Tensor, w: LayerWeights, sequences: Sequence[SequenceRows], cfg: ModelConfig,
                        rope_kind: str) -> torch.Tensor | None:
    """h after the block's attention [T, D], as one CPU kernel call, or None where it does not run as one (its FFN
    matrices are not all read: `LayerWeights.ffn_groups.parts`)."""
    if not ops.uses_cpu_block(h, sequences[0].k_cache) or w.kernel_args is None:
        return None
    return ops.decoder_stack(h, [w.kernel_args], sequences, cfg.rms_eps, (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim),
                             neox=rope_kind == "neox", gate=cfg.ffn_gate, attention_only=True)


def _one_call(h: torch.Tensor, w: LayerWeights, sequences: Sequence[SequenceRows], cfg: ModelConfig,
              rope_kind: str) -> torch.Tensor | None:
    """The block over the sequences' rows as one CPU kernel call (a stack of one: `pre_norm_stack`), or None where
    it does not run as one."""
    return pre_norm_stack(h, [w], sequences, cfg, rope_kind)
