"""The layer loop: one forward pass over T >= 1 new tokens at explicit positions.

The engine owns the loop and the KV cache; weights come from a `LayerSource`, which decides where a block's
weights live (resident here; streamed from disk by the streaming engine). Model code (ntio.models.llama) is pure.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ntio.kernels import ops
from ntio.models.config import ModelConfig
from ntio.errors import ContextOverflowError
from ntio.models.llama import GlobalWeights, LayerWeights, causal_mask, output_logits, rope_tables, transformer_block


# Longer inputs run as several forward passes of at most this many tokens, which bounds activation memory.
PREFILL_CHUNK = 512


class LayerSource(Protocol):
    """Supplies each block's weights, ready to compute, in layer order (ntio.runtime.loader.LayerLoader)."""

    def begin_forward(self, n_tokens: int) -> None: ...

    def block(self, layer: int) -> LayerWeights: ...

    def end_forward(self) -> None: ...


class KVCache:
    """Preallocated keys and values for every layer: k, v: [n_layers, Hkv, capacity, hd].

    `length` is the number of valid positions; `crop(n)` forgets everything from position n on (speculative
    rollback, prompt-prefix reuse). Allocated with torch.empty: on CPU, pages are committed only when written.
    """

    def __init__(self, cfg: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (cfg.n_layers, cfg.n_kv_heads, capacity, cfg.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a KV cache of {self.length} positions to {length}")
        self.length = length


class Engine:
    def __init__(self, cfg: ModelConfig, globals_: GlobalWeights, layers: LayerSource, kv: KVCache) -> None:
        self.cfg = cfg
        self.globals = globals_
        self.layers = layers
        self.kv = kv
        self.device = globals_.output_norm.device

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int, *, all_logits: bool = False) -> torch.Tensor:
        """tokens: [T] int64 at positions start_pos..start_pos+T-1 -> logits [T, V] (all_logits) or [V] (last).

        start_pos may be below the cache length: the cache is cropped there first (the new tokens replace what
        was cached from start_pos on).
        """
        n_tokens = tokens.shape[0]
        end = start_pos + n_tokens
        if n_tokens == 0:
            raise ValueError("forward needs at least one token")
        if end > self.kv.capacity:
            raise ContextOverflowError(
                f"{end} tokens do not fit in the context of {self.kv.capacity} tokens "
                f"(use a shorter prompt or fewer new tokens)"
            )
        self.kv.crop(min(start_pos, self.kv.length))
        if start_pos != self.kv.length:
            raise ValueError(f"start_pos {start_pos} leaves a gap after the {self.kv.length} cached positions")
        if n_tokens > PREFILL_CHUNK:
            chunks = [
                self.forward(tokens[i : i + PREFILL_CHUNK], start_pos + i, all_logits=all_logits)
                for i in range(0, n_tokens, PREFILL_CHUNK)
            ]
            return torch.cat(chunks) if all_logits else chunks[-1]

        with ops.step_threads(self.device, n_tokens, self.cfg.n_heads * end * self.cfg.head_dim):
            return self._forward_chunk(tokens, start_pos, all_logits)

    def _forward_chunk(self, tokens: torch.Tensor, start_pos: int, all_logits: bool) -> torch.Tensor:
        cfg, n_tokens = self.cfg, tokens.shape[0]
        h = ops.embedding(tokens, self.globals.token_embd)  # [T, D]
        rope = rope_tables(self.globals.inv_freq, start_pos, n_tokens)
        mask = causal_mask(start_pos, n_tokens, h.device)
        self.layers.begin_forward(n_tokens)
        try:
            for layer in range(cfg.n_layers):
                w = self.layers.block(layer)
                h = transformer_block(h, w, self.kv.k[layer], self.kv.v[layer], start_pos, rope, mask, cfg)
        finally:
            self.layers.end_forward()
        self.kv.length = start_pos + n_tokens
        if not all_logits:
            return output_logits(h[-1:], self.globals, cfg)[0]
        return output_logits(h, self.globals, cfg)
