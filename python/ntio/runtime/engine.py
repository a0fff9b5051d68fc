"""The layer loop: one forward pass over T >= 1 new tokens at explicit positions.

The engine owns the loop, the KV cache and its scratch memory; weights come from a `LayerSource` (the layer loader),
which asks its load policy before each read what to load. The family's block function (ntio.models) is pure.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ntio.errors import ContextOverflowError
from ntio.kernels import cpu_kernels, ops
from ntio.models.config import ModelConfig
from ntio.models.layers import GlobalWeights, LayerWeights, causal_mask, output_logits, rope_tables
from ntio.policies.base import LOAD_ALL, SKIP, LoadDecision, LoadPolicy, Observation
from ntio.runtime.kv_cache import KVCache

# Longer inputs run as several forward passes of at most this many tokens, which bounds activation memory.
PREFILL_CHUNK = 512


class LayerSource(Protocol):
    """Supplies each block's weights, ready to compute, in layer order (ntio.runtime.loader.LayerLoader)."""

    policy: LoadPolicy

    def begin_forward(self, n_tokens: int) -> None: ...

    def block(self, layer: int) -> LayerWeights | None:
        """The layer's weights, or None when the policy skips it."""

    def end_forward(self) -> None: ...


def _decision(w: LayerWeights | None) -> LoadDecision:
    if w is None:
        return SKIP
    return LOAD_ALL if w.ffn_rows is None else LoadDecision("rows", w.ffn_rows)


class Engine:
    """One model's forward pass. `threads`: its CPU threads (None: the process's), both torch's intra-op threads
    for its prefill steps and the Rust kernels' pool, set for each step and restored after it; `scratch`: its own
    dequantization buffers."""

    def __init__(self, cfg: ModelConfig, globals_: GlobalWeights, layers: LayerSource, kv: KVCache,
                 *, threads: int | None = None) -> None:
        self.cfg = cfg
        self.globals = globals_
        self.layers = layers
        self.kv = kv
        self.device = globals_.output_norm.device
        self.threads = threads
        self.scratch = ops.Scratch()

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

        ids = tokens.tolist()  # before any compute is queued: no wait on the device
        attention_work = self.cfg.n_heads * end * self.cfg.head_dim
        with (
            ops.step_threads(self.device, n_tokens, attention_work, self.threads),
            cpu_kernels.using_threads(self.threads),
            ops.using_scratch(self.scratch),
        ):
            logits = self._forward_chunk(tokens, start_pos, all_logits)
        self.kv.commit(start_pos, ids)
        return logits

    def _forward_chunk(self, tokens: torch.Tensor, start_pos: int, all_logits: bool) -> torch.Tensor:
        cfg, n_tokens, kv = self.cfg, tokens.shape[0], self.kv
        end = start_pos + n_tokens
        block = cfg.family.block
        policy = self.layers.policy
        observed = type(policy).observe is not LoadPolicy.observe  # the base policy ignores observations
        h = ops.embedding(tokens, self.globals.token_embd)  # [T, D]
        rope = rope_tables(self.globals.inv_freq, start_pos, n_tokens)
        mask = causal_mask(start_pos, n_tokens, h.device)
        self.layers.begin_forward(n_tokens)
        try:
            for layer in range(cfg.n_layers):
                w = self.layers.block(layer)
                h_in, taps = h, ({} if policy.wants_ffn_gate else None)
                if w is not None:
                    layer_mask = kv.attention_mask(layer, mask, n_tokens, end)
                    h = block(h, w, kv.k[layer], kv.v[layer], start_pos, rope, layer_mask, cfg, taps=taps)
                kv.record(layer, start_pos, n_tokens, skipped=w is None)
                if observed:
                    gate = taps.get("ffn_gate") if taps is not None else None
                    policy.observe(Observation(layer, start_pos, h_in, h, _decision(w), gate))
        finally:
            self.layers.end_forward()
        if not all_logits:
            return output_logits(h[-1:], self.globals, cfg)[0]
        return output_logits(h, self.globals, cfg)
