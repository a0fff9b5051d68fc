"""The layer loop: one forward pass over T >= 1 new tokens at explicit positions.

The engine owns the loop, the KV cache, its scratch memory and its RoPE table; weights come from a `LayerSource` (the
layer loader), which asks its load policy before each read what to load. The family's block function (ntio.models) is
pure.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ntio.errors import ContextOverflowError, NtioError
from ntio.kernels import cpu_kernels, ops
from ntio.models.config import ModelConfig
from ntio.kernels.ops import EncodedMatrix, SequenceRows, rms_norm
from ntio.models.layers import GlobalWeights, LayerWeights, RopeTable, batched_block, causal_mask
from ntio.policies.base import LOAD_ALL, SKIP, LoadDecision, LoadPolicy, Observation, overrides
from ntio.runtime.kv_cache import KVCache
from ntio.runtime.stats import StreamStats
from ntio.runtime.timeline import Timeline

# Longer inputs run as several forward passes of at most this many tokens, which bounds activation memory (an 8B
# model's take ~190 KB per token). A tight memory budget lowers it, down to MIN_PREFILL_CHUNK (ntio.runtime.budget):
# a chunk is one pass over every streamed weight, so smaller chunks make long prompts read more.
PREFILL_CHUNK, MIN_PREFILL_CHUNK = 512, 64
# Scoring (`Engine.nll`) makes logits for this many bytes of positions at a time, never [T, V] at once: a 512-token
# window of a 128k vocabulary would take 262 MB.
LOGITS_BYTES = 16 << 20


class LayerSource(Protocol):
    """Supplies each block's weights, ready to compute, in layer order (ntio.runtime.loader.LayerLoader)."""

    policy: LoadPolicy
    timeline: Timeline | None  # when set, the engine records each layer's span in it
    stats: StreamStats  # one record per forward: bytes read, time waited on reads

    def begin_forward(self, n_tokens: int) -> None: ...

    def block(self, layer: int) -> LayerWeights | None:
        """The layer's weights, or None when the policy skips it."""

    def resident_blocks(self) -> Sequence[LayerWeights] | None:
        """Every layer's weights in layer order when all are resident (as `block` gives them under a policy that
        loads everything), else None."""

    def end_forward(self) -> None: ...

    def head_chunks(self) -> Iterator[tuple[int, EncodedMatrix]]:
        """A streamed output head in row chunks (first row, rows [R, D]); used when the head is not resident."""


@dataclass(frozen=True)
class Segment:
    """One sequence's part of a batched pass (`Engine.forward_batch`): new tokens at positions start_pos.. of kv;
    all_logits: the logits after every one of them (a draft to verify), else after the last. parents: the tokens
    are a token tree, as in `Engine.forward` (only its root becomes a cached position; `KVCache.keep_branch` then
    keeps one branch of the others)."""

    tokens: torch.Tensor  # [T] int64
    start_pos: int
    kv: KVCache
    all_logits: bool = False
    parents: Sequence[int] | None = None


def _decision(w: LayerWeights | None) -> LoadDecision:
    if w is None:
        return SKIP
    return LOAD_ALL if w.ffn_rows is None else LoadDecision("rows", w.ffn_rows)


class Engine:
    """One model's forward pass. `threads`: its CPU threads (None: the process's), both torch's intra-op threads
    for its prefill steps and the Rust kernels' pool, set for each step and restored after it; `scratch`: its own
    dequantization buffers; `prefill_chunk`: the most tokens one pass takes; `kernels`: which CPU kernels its
    products run (default: the best this CPU has, 8-bit activations)."""

    def __init__(self, cfg: ModelConfig, globals_: GlobalWeights, layers: LayerSource, kv: KVCache,
                 *, threads: int | None = None, prefill_chunk: int = PREFILL_CHUNK,
                 kernels: cpu_kernels.KernelChoice = cpu_kernels.KernelChoice()) -> None:
        self.cfg = cfg
        self.globals = globals_
        self.layers = layers
        self.kv = kv
        self.device = globals_.output_norm.device
        self.threads = threads
        self.prefill_chunk = prefill_chunk
        self.scratch = ops.Scratch()
        self.rope = RopeTable(globals_.inv_freq, kv.capacity)
        self.kernels = kernels

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int, *, all_logits: bool = False,
                parents: Sequence[int] | None = None) -> torch.Tensor:
        """tokens: [T] int64 at positions start_pos..start_pos+T-1 -> logits [T, V] (all_logits) or [V] (last).

        start_pos may be below the cache length: the cache is cropped there first (the new tokens replace what
        was cached from start_pos on).

        parents: the tokens are a token tree instead (speculative verification, at most one chunk): token i is
        the child of token parents[i] (-1 for token 0, the root, which follows the cache), at position start_pos
        + its depth, in cache slot start_pos + i, attending to the cache and its ancestors. Only the root becomes
        a valid cached position; `KVCache.keep_branch` then keeps one branch of the others.
        """
        if all_logits:
            # One chunk needs no torch.cat (whose intra-op threads would then spin against the CPU kernels').
            parts = self._run(tokens, start_pos, lambda h, _: self._logits(h), parents)
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        return self._run(tokens, start_pos, lambda h, _: self._logits(h[-1:])[0], parents)[-1]

    @torch.inference_mode()
    def forward_batch(self, segments: Sequence[Segment]) -> list[torch.Tensor]:
        """Several sequences in one pass: segment i's tokens [T_i] at positions start_pos.. of its own KV cache
        (not this engine's) -> its last-position logits [V] (with `all_logits`, [T_i, V]). Each layer is read once
        for the whole batch and its products run over all ΣT_i rows; attention runs per sequence
        (`layers.batched_block`, or every layer in one call where all are resident: `_stacked`). Every row gets what
        it gets in a pass of its own (the CPU kernels compute rows independently) as long as ΣT_i <= the kernels'
        rows (`ops.KERNEL_ROWS`). Dense load policies only; caches are cropped to their start first, as in
        `forward`."""
        if not segments:
            raise ValueError("a batched pass needs at least one sequence")
        policy = self.layers.policy
        if any(overrides(policy, hook) for hook in ("tokens", "ffn_mask", "observe", "revert", "begin_pass")):
            raise NtioError(f"batched passes run dense layers only, not the {type(policy).__name__} load policy")
        for s in segments:
            end = s.start_pos + s.tokens.shape[0]
            if s.parents is not None and len(s.parents) != s.tokens.shape[0]:
                raise ValueError(f"a token tree of {len(s.parents)} parents for {s.tokens.shape[0]} tokens")
            if s.tokens.shape[0] == 0 or end > s.kv.capacity:
                raise ContextOverflowError(f"{end} tokens do not fit in a sequence's context of {s.kv.capacity}")
            s.kv.crop(min(s.start_pos, s.kv.length))
            if s.start_pos != s.kv.length:
                raise ValueError(f"start_pos {s.start_pos} leaves a gap after the {s.kv.length} cached positions")
        rows = [s.tokens.shape[0] for s in segments]
        ends = [sum(rows[: i + 1]) for i in range(len(rows))]
        longest = max(s.start_pos + n for s, n in zip(segments, rows))
        with self._step(ends[-1], longest):
            h, tables = self._batch_inputs(segments)
            self.layers.begin_forward(ends[-1])
            try:
                blocks = self._whole_stack(ends[-1])
                fused = None if blocks is None else self._stacked(h, blocks, self._stack_parts(segments, tables))
                if fused is not None:
                    h = fused
                else:
                    for layer in range(self.cfg.n_layers):
                        w = self.layers.block(layer)
                        if w is None:
                            raise NtioError(f"the load policy skipped layer {layer}: batched passes run every layer")
                        h = self._batched_layer(h, layer, w, segments, tables)
                wanted = [range(end - n if s.all_logits else end - 1, end) for s, n, end in zip(segments, rows, ends)]
                picked = [i for r in wanted for i in r]
                # Every row wanted (decode steps: one token per sequence): no gather.
                logits = self._logits(h if len(picked) == ends[-1] else h[picked])  # [rows wanted, V]
            finally:
                self.layers.end_forward()
        for s in segments:
            ids = s.tokens.tolist()
            s.kv.commit(s.start_pos, ids if s.parents is None else ids[:1])
        if not any(s.all_logits for s in segments):
            return list(logits.unbind())  # one row each: views, without split's sizes
        parts = logits.split([len(r) for r in wanted])
        return [part if s.all_logits else part[0] for s, part in zip(segments, parts)]

    @torch.inference_mode()
    def nll(self, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        """-log p(tokens[i+1] | tokens[:i+1]) for i in 0..T-2: [T-1] float32, with the forward as in `forward`.

        Logits are made for LOGITS_BYTES at a time (positions x one chunk of the head's rows) and folded into a
        running log-sum-exp, so memory stays small for any vocabulary, and a streamed head is read once per pass."""
        targets = tokens[1:]
        norm, eps = self.globals.output_norm, self.cfg.rms_eps

        def score(h: torch.Tensor, first: int) -> torch.Tensor:  # h: [t, D] of positions first .. first+t-1
            x = h[: targets.shape[0] - first]  # [n, D]: the last position has no target
            target = targets[first : first + x.shape[0]]
            peak = torch.full((x.shape[0],), -torch.inf, device=x.device)  # running max logit per position
            total = torch.zeros_like(peak)  # running sum of exp(logit - peak)
            picked = torch.zeros_like(peak)  # the target's logit
            for row0, chunk in self._head():  # every chunk, even with no position to score: the stream reads them
                rows = max(1, LOGITS_BYTES // (4 * chunk.shape[0]))
                for i in range(0, x.shape[0], rows):
                    logits = ops.normed_linear(x[i : i + rows], norm, eps, [chunk])  # [r, R], as `_logits`
                    new_peak = torch.maximum(peak[i : i + rows], logits.max(dim=1).values)
                    total[i : i + rows] = (total[i : i + rows] * (peak[i : i + rows] - new_peak).exp()
                                           + (logits - new_peak[:, None]).exp().sum(dim=1))
                    peak[i : i + rows] = new_peak
                    local = target[i : i + rows] - row0
                    inside = (local >= 0) & (local < chunk.shape[0])
                    picked[i : i + rows] += torch.where(
                        inside, logits.gather(1, local.clamp(0, chunk.shape[0] - 1)[:, None])[:, 0], 0.0)
            return peak + total.log() - picked

        return torch.cat(self._run(tokens, start_pos, score))

    def _run(self, tokens: torch.Tensor, start_pos: int, project: Callable[[torch.Tensor, int], torch.Tensor],
             parents: Sequence[int] | None = None) -> list[torch.Tensor]:
        """The layers over tokens [T] in chunks of at most `prefill_chunk`; project(h, i) maps each chunk's final
        hidden states [t, D] (of tokens i .. i+t-1) to what the caller keeps, inside the step's thread and scratch
        settings. parents: a token tree (`forward`)."""
        n_tokens = tokens.shape[0]
        end = start_pos + n_tokens
        if n_tokens == 0:
            raise ValueError("forward needs at least one token")
        if parents is not None and (len(parents) != n_tokens or n_tokens > self.prefill_chunk):
            raise ValueError(f"a token tree of {len(parents)} parents for {n_tokens} tokens (at most one chunk, "
                             f"{self.prefill_chunk})")
        if end > self.kv.capacity:
            raise ContextOverflowError(
                f"{end} tokens do not fit in the context of {self.kv.capacity} tokens "
                f"(use a shorter prompt or fewer new tokens)"
            )
        self.kv.crop(min(start_pos, self.kv.length))
        if start_pos != self.kv.length:
            raise ValueError(f"start_pos {start_pos} leaves a gap after the {self.kv.length} cached positions")
        if overrides(self.layers.policy, "begin_forward"):
            self.layers.policy.begin_forward(start_pos, n_tokens)
        out = []
        for first in range(0, n_tokens, self.prefill_chunk):
            chunk, pos = tokens[first : first + self.prefill_chunk], start_pos + first
            ids = chunk.tolist()  # before any compute is queued: no wait on the device
            with self._step(chunk.shape[0], pos + chunk.shape[0]):
                out.append(self._forward_chunk(chunk, pos, lambda h: project(h, first), parents))
            self.kv.commit(pos, ids if parents is None else ids[:1])
        return out

    @contextlib.contextmanager
    def _step(self, n_tokens: int, end: int) -> Iterator[None]:
        """This engine's threads, scratch and kernels for a step over n_tokens new tokens ending at position end."""
        attention_work = self.cfg.n_heads * end * self.cfg.head_dim
        with (
            ops.step_threads(self.device, n_tokens, attention_work, self.threads),
            cpu_kernels.using_threads(self.threads),
            ops.using_scratch(self.scratch),
            ops.using_kernels(self.kernels),
        ):
            yield

    def _batch_inputs(self, segments: Sequence[Segment]) -> tuple[torch.Tensor, list[tuple]]:
        """The segments' token embeddings [ΣT, D] and each one's (RoPE tables, mask) for `_batched_layer`."""
        tokens = segments[0].tokens if len(segments) == 1 else torch.cat([s.tokens for s in segments])
        h = ops.embedding(tokens, self.globals.token_embd)
        tables = []
        for s in segments:
            n = s.tokens.shape[0]
            tables.append((self.rope.rows(s.start_pos, n, s.parents),
                           causal_mask(s.start_pos, n, h.device, s.parents)))
        return h, tables

    def _batched_layer(self, h: torch.Tensor, layer: int, w: LayerWeights, segments: Sequence[Segment],
                       tables: list[tuple]) -> torch.Tensor:
        """h [ΣT, D] of the segments through layer `layer` with weights w (`layers.batched_block`), each segment's K/V
        written in its own cache."""
        sequences, end = [], 0
        for s, (rope, mask) in zip(segments, tables):
            n = s.tokens.shape[0]
            end += n
            sequences.append(SequenceRows(slice(end - n, end), s.kv.k[layer], s.kv.v[layer], s.start_pos, rope,
                                          s.kv.attention_mask(layer, mask, n, s.start_pos + n)))
        h = batched_block(h, w, sequences, self.cfg, self.cfg.family.rope)
        for s in segments:
            s.kv.record(layer, s.start_pos, s.tokens.shape[0], skipped=False)
        return h

    @torch.inference_mode()
    def early_exit_batch(self, segments: Sequence[Segment], blocks: Sequence[LayerWeights]) -> list[torch.Tensor]:
        """Several sequences, each in its own cache (chains only), through the first len(blocks) layers only, with
        these weights (a self-draft's), in one batched pass as `forward_batch` runs: their K/V are written for those
        layers, and each segment's hidden states after the last [T_i, D] returned. The caches' valid lengths do not
        change: the next full forward at these positions rewrites them."""
        for s in segments:
            n, kv = s.tokens.shape[0], s.kv
            if s.parents is not None:
                raise ValueError("early exits run chains, not token trees")
            if s.start_pos + n > kv.capacity:
                raise ContextOverflowError(f"{s.start_pos + n} tokens do not fit in the context of {kv.capacity} "
                                           f"tokens")
            if s.start_pos < kv.length or any(kv.layer_length[i] != s.start_pos for i in range(len(blocks))):
                raise ValueError(f"early exit at {s.start_pos} does not continue the first {len(blocks)} layers' "
                                 f"cache")
        rows = [s.tokens.shape[0] for s in segments]
        with self._step(sum(rows), max(s.start_pos + n for s, n in zip(segments, rows))):
            h, tables = self._batch_inputs(segments)
            fused = self._stacked(h, blocks, self._stack_parts(segments, tables))
            if fused is not None:
                return list(fused.split(rows))
            for layer, w in enumerate(blocks):
                h = self._batched_layer(h, layer, w, segments, tables)
        return list(h.split(rows))

    @torch.inference_mode()
    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states [t, D] (before the final norm) -> logits [t, V], with a resident output head."""
        if self.globals.output is None:
            raise NtioError("the output head streams: logits outside a forward pass need it resident")
        with self._step(h.shape[0], self.kv.length):
            return self._logits(h)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The final RMS norm of hidden states [t, D]."""
        return rms_norm(h, self.globals.output_norm, self.cfg.rms_eps)

    @staticmethod
    def _stack_parts(segments: Sequence[Segment], tables: list[tuple]) -> list[tuple]:
        """The segments as `_stacked` takes them: (cache, start_pos, tokens, RoPE tables, mask) each."""
        return [(s.kv, s.start_pos, s.tokens.shape[0], rope, mask) for s, (rope, mask) in zip(segments, tables)]

    def _stacked(self, h: torch.Tensor, blocks: Sequence[LayerWeights], parts: list[tuple]) -> torch.Tensor | None:
        """h [ΣT, D] of one or several sequences through `blocks` (layers 0 .. len(blocks)-1) as one stack
        (`Family.stack`), each part (cache, start_pos, tokens, RoPE tables, mask) in row order writing its own
        cache, or None (nothing computed) where they do not run as one: no blocks, a cache with skipped positions
        to mask, or what `pre_norm_stack` refuses (off the CPU kernels: device, cache dtype, rows, matrix types)."""
        if not blocks or any(kv.has_skips for kv, *_ in parts):
            return None
        sequences, end, n_layers = [], 0, len(blocks)
        for kv, start_pos, n, rope, mask in parts:
            end += n
            sequences.append(SequenceRows(slice(end - n, end), kv.k[:n_layers], kv.v[:n_layers], start_pos, rope,
                                          mask))
        out = self.cfg.family.stack(h, blocks, sequences, self.cfg)
        if out is not None:
            for kv, start_pos, n, *_ in parts:
                kv.record_first(n_layers, start_pos, n)
        return out

    def _whole_stack(self, n_tokens: int) -> Sequence[LayerWeights] | None:
        """Every layer's weights when a pass over n_tokens may run them as one stack (`_stacked`): all resident, a
        policy with no say per layer, no timeline to record layer by layer, and a few tokens in all (decode steps,
        short verify passes: within the CPU kernels' rows)."""
        policy = self.layers.policy
        if (self.layers.timeline is not None or n_tokens > ops.KERNEL_ROWS or policy.wants_ffn_gate
                or any(overrides(policy, hook) for hook in _PER_LAYER_HOOKS)):
            return None
        return self.layers.resident_blocks()

    def _head(self) -> Iterator[tuple[int, EncodedMatrix]]:
        """The output head in row chunks (first row, rows [R, D]): itself when resident, else streamed chunks
        (`LayerSource.head_chunks`, all of which a forward must take)."""
        if self.globals.output is not None:
            return iter([(0, self.globals.output)])
        return self.layers.head_chunks()

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [t, D] final hidden states, before the final norm -> logits [t, V]. The norm goes with each head chunk's
        product (`ops.normed_linear`): on the CPU kernels it is the product's prologue, which saves a decode step
        the ~0.2 ms that its torch ops take right after the layers have flushed the caches."""
        norm, eps = self.globals.output_norm, self.cfg.rms_eps
        parts = [ops.normed_linear(h, norm, eps, [chunk]) for _, chunk in self._head()]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _forward_chunk(self, tokens: torch.Tensor, start_pos: int, project: Callable[[torch.Tensor], torch.Tensor],
                       parents: Sequence[int] | None) -> torch.Tensor:
        """tokens [T] (T <= prefill_chunk; a token tree with `parents`) through every layer, then project(final
        hidden states [T, D]) while the forward's reads are still open (a streamed head is read in it)."""
        cfg, n_tokens, kv = self.cfg, tokens.shape[0], self.kv
        end = start_pos + n_tokens
        block = cfg.family.block
        policy = self.layers.policy
        observed = overrides(policy, "observe")
        masks_ffn = overrides(policy, "ffn_mask")
        per_token, reverts = overrides(policy, "tokens"), overrides(policy, "revert")
        h = ops.embedding(tokens, self.globals.token_embd)  # [T, D]
        rope = self.rope.rows(start_pos, n_tokens, parents)
        mask = causal_mask(start_pos, n_tokens, h.device, parents)
        if overrides(policy, "begin_pass"):
            policy.begin_pass(start_pos, n_tokens)
        timeline = self.layers.timeline
        self.layers.begin_forward(n_tokens)
        try:
            blocks = self._whole_stack(n_tokens)
            fused = None if blocks is None else self._stacked(h, blocks, [(kv, start_pos, n_tokens, rope, mask)])
            if fused is not None:
                h = fused
            else:
                for layer in range(cfg.n_layers):
                    began = time.perf_counter() if timeline is not None else 0.0
                    w = self.layers.block(layer)
                    if masks_ffn and w is not None and (ffn_mask := policy.ffn_mask(layer)) is not None:
                        w = w.choosing_ffn(ffn_mask=ffn_mask)
                    active = _some_tokens(policy.tokens(layer)) if per_token and w is not None else None
                    if active is not None and not active.any():
                        w, active = None, None  # no token computes it: a skip of the whole layer
                    h_in, taps = h, ({} if policy.wants_ffn_gate else None)
                    if w is not None:
                        if active is not None:
                            kv.record(layer, start_pos, n_tokens, skipped=~active)  # before: attention masks them
                        layer_mask = kv.attention_mask(layer, mask, n_tokens, end)
                        if active is not None:
                            layer_mask = _own_position_kept(layer_mask, start_pos, ~active)
                        h = block(h, w, kv.k[layer], kv.v[layer], start_pos, rope, layer_mask, cfg, taps=taps)
                        if active is not None:
                            h = torch.where(active[:, None], h, h_in)
                        if reverts and (back := policy.revert(layer, h_in, h)) is not None:
                            h = torch.where(back[:, None], h_in, h)
                    if active is None:
                        kv.record(layer, start_pos, n_tokens, skipped=w is None)
                    if observed:
                        gate = taps.get("ffn_gate") if taps is not None else None
                        policy.observe(Observation(layer, start_pos, h_in, h, _decision(w), gate))
                    if timeline is not None:
                        timeline.layer_done(layer, began)
            began = time.perf_counter() if timeline is not None else 0.0
            out = project(policy.readout(h))
            if timeline is not None:
                timeline.layer_done(cfg.n_layers, began)  # the output head
            return out
        finally:
            self.layers.end_forward()


# Load-policy hooks the layer loop serves (per layer, or per pass as `begin_pass`): a policy overriding any of them
# needs the loop, not one stack.
_PER_LAYER_HOOKS = ("decide", "ffn_mask", "observe", "tokens", "revert", "begin_pass")


def _some_tokens(active: torch.Tensor | None) -> torch.Tensor | None:
    """A policy's [T] bool tokens for a layer, None when all of them compute it."""
    return None if active is None or bool(active.all()) else active


def _own_position_kept(mask: torch.Tensor, start_pos: int, passing: torch.Tensor) -> torch.Tensor:
    """mask [T, L] with each passing token's own position allowed again: its row is computed and thrown away, and
    a row with every key masked would make NaNs (a row of T = 1 is never passing: the layer is skipped whole)."""
    rows = passing.nonzero()[:, 0]
    mask = mask.clone()
    mask[rows, start_pos + rows] = True
    return mask
