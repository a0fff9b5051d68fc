"""The Llama-family graph as pure functions of (activations, weights, KV cache).

Model code never knows where its weights come from: the engine hands each block its `LayerWeights`, which may be
resident or just streamed from disk. Matrices stay GGUF-encoded; `ntio.kernels.ops` decides how each product runs.
Compute is float32; KV caches may be fp32/fp16/bf16 and are upcast to float32 for attention.

Shapes: T = new tokens this step, D = d_model, Hq / Hkv = query / KV heads, hd = head_dim, F = d_ff,
L = cached positions after this step (start_pos + T).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ntio.kernels import ops
from ntio.models.config import ModelConfig
from ntio.kernels.ops import EncodedMatrix

# GGUF tensor names of one transformer block, in the order ntio fuses them.
BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def block_tensor_name(layer: int, part: str) -> str:
    return f"blk.{layer}.{part}.weight"


@dataclass
class LayerWeights:
    """Weights of one transformer block on the compute device: float32 norms, GGUF-encoded matrices.

    Q/K/V and gate/up are row-stacked groups; matrices of one type stored back to back are fused into one (ops.fuse_adjacent), so a
    decode step runs as few as 4 matrix-vector products per block instead of 7.
    Q and K rows are in GGUF order: llama.cpp's converter permutes them for interleaved (GPT-J style) RoPE.
    """

    attn_norm: torch.Tensor  # [D] float32
    wqkv: list[EncodedMatrix]  # rows stack to [Hq*hd + 2*Hkv*hd, D]
    wo: EncodedMatrix  # [D, Hq*hd]
    ffn_norm: torch.Tensor  # [D] float32
    w_gate_up: list[EncodedMatrix]  # rows stack to [2F, D]: gate rows then up rows
    w_down: EncodedMatrix  # [D, F]


@dataclass
class GlobalWeights:
    """Weights outside the blocks; always resident."""

    token_embd: EncodedMatrix  # [V, D]
    output_norm: torch.Tensor  # [D] float32
    output: EncodedMatrix  # [V, D]; the same matrix as token_embd when embeddings are tied
    inv_freq: torch.Tensor  # [rope_dim/2] RoPE inverse frequencies, scaling already applied


def rope_inverse_frequencies(cfg: ModelConfig, rope_freqs: torch.Tensor | None) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/rope_dim), divided by Llama-3's per-frequency factors when the file has them."""
    exponents = torch.arange(0, cfg.rope_dim, 2, dtype=torch.int64).float() / cfg.rope_dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    if rope_freqs is not None:
        inv_freq = inv_freq / rope_freqs.float()
    if cfg.rope_scaling.kind == "linear":
        inv_freq = inv_freq / cfg.rope_scaling.factor
    return inv_freq


def rope_tables(inv_freq: torch.Tensor, start_pos: int, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, rope_dim/2] for positions start_pos .. start_pos+T-1."""
    positions = torch.arange(start_pos, start_pos + n_tokens, device=inv_freq.device, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on x: [T, H, hd]; rotates pairs (x[2i], x[2i+1]) of the first rope_dim features."""
    rope_dim = 2 * cos.shape[-1]
    rot = x[..., :rope_dim].unflatten(-1, (-1, 2))  # [T, H, rope_dim/2, 2]
    x0, x1 = rot[..., 0], rot[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    if rope_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rope_dim:]), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def causal_mask(start_pos: int, n_tokens: int, device: torch.device) -> torch.Tensor | None:
    """[T, L] boolean mask, True where query t may attend key j (j <= start_pos + t); None for one token."""
    if n_tokens == 1:
        return None
    q_pos = torch.arange(start_pos, start_pos + n_tokens, device=device)
    k_pos = torch.arange(start_pos + n_tokens, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def transformer_block(
    h: torch.Tensor,
    w: LayerWeights,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start_pos: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    cfg: ModelConfig,
) -> torch.Tensor:
    """One pre-norm Llama block. h: [T, D] -> [T, D]; writes K/V for positions start_pos..start_pos+T-1.

    k_cache, v_cache: [Hkv, max_len, hd] for this layer.
    """
    n_tokens = h.shape[0]
    end = start_pos + n_tokens
    hd = cfg.head_dim

    x = rms_norm(h, w.attn_norm, cfg.rms_eps)
    q, k, v = ops.linear_concat(x, w.wqkv).split((cfg.q_width, cfg.kv_width, cfg.kv_width), dim=-1)
    q = apply_rope(q.view(n_tokens, cfg.n_heads, hd), *rope)
    k = apply_rope(k.view(n_tokens, cfg.n_kv_heads, hd), *rope)
    k_cache[:, start_pos:end] = k.transpose(0, 1)
    v_cache[:, start_pos:end] = v.view(n_tokens, cfg.n_kv_heads, hd).transpose(0, 1)
    keys = k_cache[:, :end].to(q.dtype)  # [Hkv, L, hd]; a no-op view when the cache is in the compute dtype
    values = v_cache[:, :end].to(q.dtype)
    attn = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=cfg.n_heads != cfg.n_kv_heads
    )  # [Hq, T, hd]
    h = h + ops.linear(attn.transpose(0, 1).reshape(n_tokens, cfg.q_width), w.wo)

    x = rms_norm(h, w.ffn_norm, cfg.rms_eps)
    gate, up = ops.linear_concat(x, w.w_gate_up).chunk(2, dim=-1)
    return h + ops.linear(F.silu(gate) * up, w.w_down)


def output_logits(h: torch.Tensor, g: GlobalWeights, cfg: ModelConfig) -> torch.Tensor:
    """h: [T, D] -> logits [T, V]."""
    return ops.linear(rms_norm(h, g.output_norm, cfg.rms_eps), g.output)
