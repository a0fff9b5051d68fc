"""From encoded tensors in a model file to the dequantized `LayerWeights` / `GlobalWeights` the graph takes.

`WeightLayout` checks, once at load time, that every tensor the graph needs exists with the right shape and a
supported type, so a bad file fails before any compute with the tensor named. `dequantize_block` turns one
block's encoded bytes (wherever they were read into) into `LayerWeights`, writing into reusable buffers when given.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ntio import quant
from ntio.config import ModelConfig
from ntio.errors import ModelFormatError, UnsupportedModelError
from ntio.gguf_file import GGUFFile, TensorInfo
from ntio.model import BLOCK_TENSORS, GlobalWeights, LayerWeights, block_tensor_name, rope_inverse_frequencies

# Encoded bytes of one tensor as a 1-D uint8 tensor (CPU or device).
RawTensor = torch.Tensor


def block_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected PyTorch-order shape of each block tensor."""
    D, F, Q, KV = cfg.d_model, cfg.d_ff, cfg.q_width, cfg.kv_width
    return {
        "attn_norm": (D,),
        "attn_q": (Q, D),
        "attn_k": (KV, D),
        "attn_v": (KV, D),
        "attn_output": (D, Q),
        "ffn_norm": (D,),
        "ffn_gate": (F, D),
        "ffn_up": (F, D),
        "ffn_down": (D, F),
    }


class WeightLayout:
    """The validated tensor table of a Llama-family file: where each block's and global tensor is."""

    def __init__(self, g: GGUFFile, cfg: ModelConfig) -> None:
        self.file = g
        self.cfg = cfg
        shapes = block_shapes(cfg)
        self.blocks: list[dict[str, TensorInfo]] = []
        for layer in range(cfg.n_layers):
            self.blocks.append(
                {part: self._checked(block_tensor_name(layer, part), shapes[part]) for part in BLOCK_TENSORS}
            )
        self.token_embd = self._checked("token_embd.weight", (cfg.vocab_size, cfg.d_model))
        self.output_norm = self._checked("output_norm.weight", (cfg.d_model,))
        self.output = None if cfg.tied_embeddings else self._checked("output.weight", (cfg.vocab_size, cfg.d_model))
        self.rope_freqs = (
            self._checked("rope_freqs.weight", (cfg.rope_dim // 2,)) if cfg.rope_scaling.kind == "llama3" else None
        )

    def _checked(self, name: str, shape: tuple[int, ...]) -> TensorInfo:
        info = self.file.tensor(name)
        if info.shape != shape:
            raise ModelFormatError(f"{self.file.path}: tensor {name!r} has shape {list(info.shape)}, expected {list(shape)}")
        if info.qtype not in quant.SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"{self.file.path}: tensor {name!r} has type {info.qtype.name}, which ntio does not decode "
                f"(supported: {', '.join(sorted(t.name for t in quant.SUPPORTED_TYPES))})"
            )
        return info

    def block_nbytes(self, layer: int) -> int:
        return sum(info.nbytes for info in self.blocks[layer].values())


def dequantize_block(
    cfg: ModelConfig,
    tensors: dict[str, TensorInfo],
    raw: Callable[[str], RawTensor],
    out: LayerWeights | None = None,
    device: torch.device | str = "cpu",
) -> LayerWeights:
    """Dequantize one block. raw(part) gives the encoded bytes of tensors[part] on the target device.

    With `out`, every weight is written into its buffers (no allocation); otherwise new tensors are made.
    """
    if out is None:
        out = empty_layer_weights(cfg, device)
    D, F, Q, KV = cfg.d_model, cfg.d_ff, cfg.q_width, cfg.kv_width
    targets = {
        "attn_norm": out.attn_norm,
        "attn_q": out.wqkv[:Q],
        "attn_k": out.wqkv[Q : Q + KV],
        "attn_v": out.wqkv[Q + KV :],
        "attn_output": out.wo,
        "ffn_norm": out.ffn_norm,
        "ffn_gate": out.w_gate_up[:F],
        "ffn_up": out.w_gate_up[F:],
        "ffn_down": out.w_down,
    }
    for part, target in targets.items():
        info = tensors[part]
        quant.dequantize(raw(part), info.qtype, info.shape, out=target)
    return out


def empty_layer_weights(cfg: ModelConfig, device: torch.device | str) -> LayerWeights:
    D, F, Q, KV = cfg.d_model, cfg.d_ff, cfg.q_width, cfg.kv_width
    kw = {"dtype": torch.float32, "device": device}
    return LayerWeights(
        attn_norm=torch.empty(D, **kw),
        wqkv=torch.empty(Q + 2 * KV, D, **kw),
        wo=torch.empty(D, Q, **kw),
        ffn_norm=torch.empty(D, **kw),
        w_gate_up=torch.empty(2 * F, D, **kw),
        w_down=torch.empty(D, F, **kw),
    )


def mapped_raw(g: GGUFFile, info: TensorInfo, device: torch.device | str = "cpu") -> RawTensor:
    """Encoded bytes of a tensor copied out of the memory-mapped file (used for resident loading)."""
    return torch.from_numpy(np.array(g.tensor_bytes(info.name))).to(device)


def load_global_weights(layout: WeightLayout, device: torch.device | str = "cpu") -> GlobalWeights:
    def load(info: TensorInfo) -> torch.Tensor:
        return quant.dequantize(mapped_raw(layout.file, info, device), info.qtype, info.shape)

    token_embd = load(layout.token_embd)
    rope_freqs = load(layout.rope_freqs) if layout.rope_freqs is not None else None
    return GlobalWeights(
        token_embd=token_embd,
        output_norm=load(layout.output_norm),
        output=token_embd if layout.output is None else load(layout.output),
        inv_freq=rope_inverse_frequencies(layout.cfg, rope_freqs).to(device),
    )


def load_resident_block(layout: WeightLayout, layer: int, device: torch.device | str = "cpu") -> LayerWeights:
    tensors = layout.blocks[layer]
    return dequantize_block(
        layout.cfg, tensors, lambda part: mapped_raw(layout.file, tensors[part], device), device=device
    )
