"""From encoded tensors in a model file to the `LayerWeights` / `GlobalWeights` the graph takes.

`WeightLayout` checks, once at load time, that every tensor the family's block needs exists with the right shape
and a supported type, so a bad file fails before any compute with the tensor named. `encoded_block` wraps one
block's encoded bytes (wherever they were read into) as `LayerWeights`; matrices are never dequantized here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ntio.errors import ModelFormatError, UnsupportedModelError
from ntio.formats.gguf_file import TensorInfo
from ntio.formats.model_file import ModelFile
from ntio.kernels import ops, quant
from ntio.kernels.ops import EncodedMatrix
from ntio.models.config import ModelConfig
from ntio.models.layers import GlobalWeights, LayerWeights, rope_inverse_frequencies

# Encoded bytes of one tensor as a 1-D uint8 tensor (CPU or device).
RawTensor = torch.Tensor


class WeightLayout:
    """The validated tensor table of a model file: where each block's and global tensor is.

    blocks[layer] maps the family's part names ("attn_q", "attn_q.bias", ...) to the tensors of that layer.
    """

    def __init__(self, g: ModelFile, cfg: ModelConfig) -> None:
        self.file = g
        self.cfg = cfg
        self.family = cfg.family
        self.blocks: list[dict[str, TensorInfo]] = [
            {t.part: self._checked(t.name(layer), t.shape(cfg)) for t in self.family.tensors
             if not t.optional or t.name(layer) in g.tensors}
            for layer in range(cfg.n_layers)
        ]
        self.token_embd = self._checked("token_embd.weight", (cfg.vocab_size, cfg.d_model))
        self.output_norm = self._checked("output_norm.weight", (cfg.d_model,))
        self.output = None if cfg.tied_embeddings else self._checked("output.weight", (cfg.vocab_size, cfg.d_model))
        self.rope_freqs = (
            self._checked("rope_freqs.weight", (cfg.rope_dim // 2,))
            if cfg.rope_scaling.kind == "llama3" and cfg.rope_scaling.divisors is None else None
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

    @property
    def head(self) -> TensorInfo:
        """The output head's tensor: `output`, or the token embedding when they are tied."""
        return self.output if self.output is not None else self.token_embd

    def matrix_types(self) -> set:
        """The encodings of the products' matrices: the blocks' 2-D tensors and the output head."""
        return {info.qtype for block in self.blocks for info in block.values() if len(info.shape) == 2} | {
            self.head.qtype}

    def block_nbytes(self, layer: int) -> int:
        return sum(info.nbytes for info in self.blocks[layer].values())

    def check_values(self, info: TensorInfo, raw: RawTensor) -> None:
        """A ModelFormatError naming file, tensor and offset if `info` (its encoded bytes `raw`, on any device) is a
        ternary tensor with a block whose scale is inf or NaN (quant.check_scales), a per-tensor weight scale that
        is not a finite number, or a vector (a norm, a bias: a few KB) with an element that is not; nothing for
        other tensors. Each tensor is checked once, when its bytes are first in memory (a store's bytes are also
        covered by its checksums from then on). A NaN in a norm would otherwise pass the 8-bit activations as 0s
        (their scale skips it) and give logits of 0, not an error."""
        where = f"{self.file.path}: tensor {info.name!r}"
        if info.name.endswith(".scale"):
            value = float(quant.dequantize(raw, info.qtype, info.shape)[0])
            if not math.isfinite(value):
                raise ModelFormatError(f"{where} (file offset {info.offset}): the weight scale is {value}")
            return
        if len(info.shape) == 1:
            values = quant.dequantize(raw, info.qtype, info.shape)
            bad = (~torch.isfinite(values)).nonzero()
            if bad.numel():
                i = int(bad[0])
                raise ModelFormatError(f"{where} (file offset {info.offset}): element {i} is {float(values[i])}")
            return
        quant.check_scales(raw, info.qtype, where, info.offset)

    def check_block(self, layer: int, raw: Callable[[str], RawTensor]) -> None:
        """`check_values` on every tensor of block `layer`; raw(part) gives a tensor's bytes."""
        for part, info in self.blocks[layer].items():
            self.check_values(info, raw(part))


@dataclass(frozen=True)
class BlockVectors:
    """A block's small tensors decoded to float32 (a few KB): its bytes are re-read with a streamed layer, but
    decoding them again would only repeat work, so a loader may keep these per layer."""

    attn_norm: torch.Tensor  # [D]
    ffn_norm: torch.Tensor  # [D]
    qkv_bias: torch.Tensor | None  # [Q + 2 KV], q/k/v biases concatenated; None for families without them
    attn_sub_norm: torch.Tensor | None = None  # [Q] (BitNet)
    ffn_sub_norm: torch.Tensor | None = None  # [F] (BitNet)
    scales: dict[str, float] = field(default_factory=dict)  # matrix part -> its per-tensor scale (BitNet), if any


def decode_vectors(tensors: dict[str, TensorInfo], raw: Callable[[str], RawTensor]) -> BlockVectors:
    """The vectors of a block whose tensors are `tensors` (part -> info); raw(part) gives a tensor's bytes."""

    def vector(part: str) -> torch.Tensor | None:
        info = tensors.get(part)
        return None if info is None else quant.dequantize(raw(part), info.qtype, info.shape)

    bias_parts = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
    qkv_bias = torch.cat([vector(p) for p in bias_parts]) if bias_parts[0] in tensors else None
    scales = {part.removesuffix(".scale"): float(vector(part)[0]) for part in tensors if part.endswith(".scale")}
    return BlockVectors(vector("attn_norm"), vector("ffn_norm"), qkv_bias, vector("attn_sub_norm"),
                        vector("ffn_sub_norm"), scales)


def encoded_block(
    tensors: dict[str, TensorInfo], raw: Callable[[str], RawTensor], vectors: BlockVectors | None = None
) -> LayerWeights:
    """One block's `LayerWeights`. raw(part) gives the encoded bytes of tensors[part] on the target device.

    Vectors (norms, biases) are decoded to float32 unless `vectors` already holds them; matrices keep their
    encoding, as views of the bytes given. q/k/v and gate/up that are adjacent and of one type in that buffer are
    fused into single products (ops.fuse_adjacent).
    """

    v = vectors if vectors is not None else decode_vectors(tensors, raw)

    def matrix(part: str) -> EncodedMatrix:
        info = tensors[part]
        return EncodedMatrix(raw(part), info.qtype, info.shape, v.scales.get(part, 1.0))

    return LayerWeights(
        attn_norm=v.attn_norm,
        wqkv=ops.fuse_adjacent([matrix("attn_q"), matrix("attn_k"), matrix("attn_v")]),
        qkv_bias=v.qkv_bias,
        wo=matrix("attn_output"),
        ffn_norm=v.ffn_norm,
        w_gate_up=ops.fuse_adjacent([matrix("ffn_gate"), matrix("ffn_up")]),
        w_down=matrix("ffn_down"),
        attn_sub_norm=v.attn_sub_norm,
        ffn_sub_norm=v.ffn_sub_norm,
    )


def load_global_weights(
    layout: WeightLayout, read: Callable[[TensorInfo], RawTensor], device: torch.device | str = "cpu",
    token_embd: ops.RowSource | None = None, head_resident: bool = True, interleave: bool = False,
) -> GlobalWeights:
    """The weights outside the blocks; read(info) gives a tensor's encoded bytes in host memory.

    token_embd: the embedding's rows from elsewhere (read on demand) instead of the resident table; head_resident
    False: the output head streams (GlobalWeights.output is None), and a tied table must then come as token_embd.
    interleave: a resident head takes the interleaved layout where its type does (`ops.interleave_rows`), as
    resident layers do: a pass over several tokens (a draft's verification) spends less on it. A tied embedding then
    fetches its rows from that layout (`EncodedMatrix.encoded_rows`)."""

    def matrix(info: TensorInfo) -> EncodedMatrix:
        raw = read(info)
        layout.check_values(info, raw)
        return EncodedMatrix(raw.to(device), info.qtype, info.shape)

    def decoded(info: TensorInfo) -> torch.Tensor:
        raw = read(info)
        layout.check_values(info, raw)
        return quant.dequantize(raw.to(device), info.qtype, info.shape)

    tied = layout.output is None
    if tied and (token_embd is None) != head_resident:
        raise ValueError("a tied token embedding is the output head: both resident, or both read from disk")
    output = matrix(layout.head) if head_resident else None
    if interleave and output is not None:
        output = ops.interleave_rows(output)
    if token_embd is None:
        token_embd = output if tied else matrix(layout.token_embd)
    return GlobalWeights(
        token_embd=token_embd,
        output_norm=decoded(layout.output_norm),
        output=output,
        inv_freq=rope_inverse_frequencies(
            layout.cfg, decoded(layout.rope_freqs) if layout.rope_freqs is not None else None
        ).to(device),
    )
