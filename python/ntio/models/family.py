"""What makes a model family: its block's tensor table, its RoPE kind, and its block function.

A family is data plus one function built from the shared layers (`ntio.models.layers`): everything else (loading,
streaming, the layer loop, the KV cache) is common. `ntio.models.registry` maps a GGUF `general.architecture` to
its family.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ntio.models.layers import pre_norm_block, pre_norm_stack

if TYPE_CHECKING:
    import torch

    from ntio.models.config import ModelConfig


@dataclass(frozen=True)
class BlockTensor:
    """One tensor of a transformer block: `part` is how the block's code names it ("attn_q", "attn_q.bias")."""

    part: str
    shape: Callable[[ModelConfig], tuple[int, ...]]  # PyTorch-order shape, from the config
    matrix: bool  # a matrix stays in its GGUF encoding; a vector (norm, bias, scale) is decoded to float32 once
    optional: bool = False  # a file may leave it out (BitNet's per-tensor scales)

    def name(self, layer: int) -> str:
        """GGUF tensor name: blk.{layer}.attn_q.weight, blk.{layer}.attn_q.bias."""
        return f"blk.{layer}.{self.part}" if "." in self.part else f"blk.{layer}.{self.part}.weight"


# Block function: (h [T, D], weights, k_cache, v_cache [Hkv, capacity, hd], start_pos, rope (cos, sin), mask, cfg,
# *, taps) -> h [T, D], after writing K/V for positions start_pos .. start_pos+T-1; taps (a dict, or None) receives
# observations a load policy asked for ("ffn_gate": [T, F]).
BlockFunction = Callable[..., "torch.Tensor"]
# Stack function: (h [ΣT, D], blocks, sequences (`SequenceRows`, caches [len(blocks), Hkv, capacity, hd]), cfg)
# -> h [ΣT, D] after every block, or None where the blocks do not run as one call.
StackFunction = Callable[..., "torch.Tensor | None"]


@dataclass(frozen=True)
class Family:
    name: str  # GGUF general.architecture
    tensors: tuple[BlockTensor, ...]  # every tensor of one block, required unless marked optional
    rope: str  # "interleaved" (pairs 2i, 2i+1: llama.cpp permutes Llama's q/k rows for it) | "neox" (i, i + d/2)
    # The FFN gate activations a file may name in `{arch}.hidden_activation` (ntio.kernels.ops.GATES); the first
    # is the family's default, and a family with one ignores the key, as llama.cpp does.
    gates: tuple[str, ...] = ("silu",)

    @functools.cached_property
    def block(self) -> BlockFunction:
        """The pre-norm block of the shared layers with this family's RoPE; q/k/v biases come with the weights."""
        return functools.partial(pre_norm_block, rope_kind=self.rope)

    @functools.cached_property
    def stack(self) -> StackFunction:
        """A stack of those blocks over one or several sequences in one CPU kernel call, or None where they do not
        run as one (`pre_norm_stack`)."""
        return functools.partial(pre_norm_stack, rope_kind=self.rope)

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(t.part for t in self.tensors)

