"""From encoded tensors in a model file to the `LayerWeights` / `GlobalWeights` the graph takes.

`WeightLayout` checks, once at load time, that every tensor the graph needs exists with the right shape and a
supported type, so a bad file fails before any compute with the tensor named. `encoded_block` wraps one block's
encoded bytes (wherever they were read into) as `LayerWeights`; matrices are never dequantized here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ntio.kernels import ops, quant
from ntio.models.config import ModelConfig
from ntio.errors import ModelFormatError, UnsupportedModelError
from ntio.formats.gguf_file import TensorInfo
from ntio.models.llama import BLOCK_TENSORS, GlobalWeights, LayerWeights, block_tensor_name, rope_inverse_frequencies
from ntio.formats.model_file import ModelFile
from ntio.kernels.ops import EncodedMatrix

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

    def __init__(self, g: ModelFile, cfg: ModelConfig) -> None:
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


def encoded_block(
    cfg: ModelConfig,
    tensors: dict[str, TensorInfo],
    raw: Callable[[str], RawTensor],
    norms: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> LayerWeights:
    """One block's `LayerWeights`. raw(part) gives the encoded bytes of tensors[part] on the target device.

    Norms are decoded to float32 (a few KB), unless `norms` (attn_norm, ffn_norm) already holds them; matrices keep
    their encoding, as views of the bytes given. q/k/v and gate/up that are adjacent and of one type in that buffer
    are fused into single products (ops.fuse_adjacent).
    """

    def matrix(part: str) -> EncodedMatrix:
        info = tensors[part]
        return EncodedMatrix(raw(part), info.qtype, info.shape)

    def norm(part: str) -> torch.Tensor:
        info = tensors[part]
        return quant.dequantize(raw(part), info.qtype, info.shape)

    attn_norm, ffn_norm = norms if norms is not None else (norm("attn_norm"), norm("ffn_norm"))
    return LayerWeights(
        attn_norm=attn_norm,
        wqkv=ops.fuse_adjacent([matrix("attn_q"), matrix("attn_k"), matrix("attn_v")]),
        wo=matrix("attn_output"),
        ffn_norm=ffn_norm,
        w_gate_up=ops.fuse_adjacent([matrix("ffn_gate"), matrix("ffn_up")]),
        w_down=matrix("ffn_down"),
    )


def load_global_weights(
    layout: WeightLayout, read: Callable[[TensorInfo], RawTensor], device: torch.device | str = "cpu"
) -> GlobalWeights:
    """The always-resident weights; read(info) gives a tensor's encoded bytes in host memory."""

    def matrix(info: TensorInfo) -> EncodedMatrix:
        return EncodedMatrix(read(info).to(device), info.qtype, info.shape)

    def decoded(info: TensorInfo) -> torch.Tensor:
        return quant.dequantize(read(info).to(device), info.qtype, info.shape)

    token_embd = matrix(layout.token_embd)
    return GlobalWeights(
        token_embd=token_embd,
        output_norm=decoded(layout.output_norm),
        output=token_embd if layout.output is None else matrix(layout.output),
        inv_freq=rope_inverse_frequencies(
            layout.cfg, decoded(layout.rope_freqs) if layout.rope_freqs is not None else None
        ).to(device),
    )
