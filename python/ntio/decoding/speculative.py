"""Speculative decoding: drafted tokens verified by the target in one forward pass.

When weights stream, a pass over T tokens costs about what a pass over one does (the bytes dominate), so each pass
should settle as many tokens as it can. A drafter proposes a chain of tokens that may follow the history; the
target runs [its last token] + the chain in one forward with every position's logits, keeps the longest prefix of
the chain its own choice agrees with, and adds one token of its own: the correction at the first disagreement, or
the token after a fully accepted chain. A pass therefore yields 1 to k + 1 tokens.

Drafters:
  * `PromptLookup`: the tokens that followed the latest earlier occurrence of the history's last n tokens (n from
    `max_ngram` down to 1): free, strong on text that copies from its context (code edits, quotes, summaries);
  * `DraftModel`: a small model with the target's vocabulary, run greedily (or sampling, with temperature) for k
    steps on its own KV cache, which keeps what the target accepted;
  * `self_draft.SelfDraft`: the target's own first layers and a calibrated exit head (self-speculation).
With both, a lookup match of `PREFERRED_LOOKUP` tokens or more is taken (it costs nothing), otherwise the model's.

Exactness. Greedy: every position is decided by the target's own sampler on the target's own logits, and a verify
pass's row i is bit for bit the logits a one-token decode step gives (the CPU kernels' arithmetic per row does not
depend on how many rows share a pass; a verify pass stays within their KERNEL_ROWS), so the output is token for token
that of plain greedy decoding. Sampling: the speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023)
accepts draft token x with probability min(1, p(x) / q(x)) and otherwise draws from max(p - q, 0), normalized, which
leaves each emitted token distributed exactly as the target's p (after its temperature, top-k, top-p and repetition
penalty); a lookup draft is a point mass q.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ntio.decoding.generation import Sampler
from ntio.kernels.ops import KERNEL_ROWS
from ntio.runtime.engine import Engine

if TYPE_CHECKING:
    from ntio.decoding.self_draft import SelfDraft

# A lookup match this long is used even when a draft model is there: copying is that likely to go on.
PREFERRED_LOOKUP = 3
# A verify pass is at most this many tokens: beyond it the CPU kernels hand over to dequantized prefill products,
# whose rounding differs from a decode step's (greedy exactness needs the same bits).
MAX_DRAFT = KERNEL_ROWS - 1


@dataclass
class Draft:
    """A proposed chain: tokens [k] after the history, from `source`; probs [k, V]: the distribution each token
    was drawn from (None: deterministic, a point mass at each token)."""

    tokens: list[int]
    source: str
    probs: torch.Tensor | None = None


@dataclass
class SpeculationStats:
    """What speculation did in one generation: target verify passes, tokens they settled, and per source the
    tokens drafted and accepted; seconds spent drafting and verifying."""

    passes: int = 0
    tokens: int = 0  # emitted by verify passes (accepted drafts plus the target's own token each pass)
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    draft_s: float = 0.0
    verify_s: float = 0.0

    def summary(self) -> dict:
        return {
            "passes": self.passes,
            "tokens": self.tokens,
            "tokens_per_pass": self.tokens / self.passes if self.passes else 0.0,
            "drafted": dict(self.drafted),
            "accepted": dict(self.accepted),
            "acceptance": {s: self.accepted.get(s, 0) / n for s, n in self.drafted.items() if n},
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
        }


class DraftLength:
    """How many tokens to draft: the k that maximizes expected tokens per second of a pass, from what passes and
    drafts have cost and how often each source's tokens were accepted.

    A pass over T tokens costs t1 + (T - 1)·t_row (fitted to measured verify passes: t_row is ~0 when weights stream
    and a sizable part of t1 on the CPU with resident weights) plus k times the source's drafting cost per token; a
    source's tokens are accepted with probability a each until the first rejection, so a pass settles
    1 + a + ... + a^k tokens in expectation. Estimates decay (DECAY per pass) towards a prior of a = 1/2, so a source
    found useless is tried again now and then. fixed=True: always the most tokens asked for."""

    DECAY = 0.8

    def __init__(self, *, fixed: bool = False) -> None:
        self.fixed = fixed
        self.counts: dict[str, list[float]] = {}  # source -> [accepted tokens, rejections], decayed
        self.draft_cost: dict[str, float] = {}  # source -> seconds per drafted token (EMA)
        self.fit = [0.0] * 5  # decayed sums of 1, T, T^2, s, T*s over verify passes

    def acceptance(self, source: str) -> float:
        accepted, rejected = self.counts.get(source, [0.0, 0.0])
        return (accepted + 1) / (accepted + rejected + 2)

    def pass_cost(self) -> tuple[float, float]:
        """(t1, t_row) of the fitted pass cost; (1, 0) before any pass (every draft then looks free)."""
        n, st, stt, ss, sts = self.fit
        if n == 0:
            return 1.0, 0.0
        var = stt / n - (st / n) ** 2
        slope = (sts / n - st / n * ss / n) / var if var > 1e-9 else 0.0
        slope = max(slope, 0.0)
        return max(ss / n - slope * (st / n - 1), 1e-9), slope

    def choose(self, source: str, most: int) -> int:
        if self.fixed:
            return most
        t1, t_row = self.pass_cost()
        a, per_token = self.acceptance(source), t_row + self.draft_cost.get(source, 0.0)
        rates = [sum(a**i for i in range(k + 1)) / (t1 + k * per_token) for k in range(most + 1)]
        return max(range(most + 1), key=rates.__getitem__)

    def observe(self, source: str | None, drafted: int, accepted: int, draft_s: float, tokens: int,
                verify_s: float) -> None:
        self.fit = [self.DECAY * v for v in self.fit]
        for i, v in enumerate((1.0, tokens, tokens * tokens, verify_s, tokens * verify_s)):
            self.fit[i] += v
        for counts in self.counts.values():
            counts[0] *= self.DECAY
            counts[1] *= self.DECAY
        if source is None or drafted == 0:
            return
        counts = self.counts.setdefault(source, [0.0, 0.0])
        counts[0] += accepted
        counts[1] += accepted < drafted
        cost = draft_s / drafted
        self.draft_cost[source] = cost if source not in self.draft_cost else 0.5 * (self.draft_cost[source] + cost)


class PromptLookup:
    """Drafts from the history itself: what followed the latest earlier occurrence of its last n tokens."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram

    def propose(self, history: Sequence[int], k: int, min_ngram: int = 1) -> Draft | None:
        n_hist = len(history)
        for n in range(min(self.max_ngram, n_hist - 1), min_ngram - 1, -1):
            tail = list(history[n_hist - n :])
            # Latest start i < n_hist - n with history[i : i + n] == tail and at least one token after it.
            for i in range(n_hist - n - 1, -1, -1):
                if history[i] == tail[0] and list(history[i : i + n]) == tail:
                    return Draft(list(history[i + n : i + n + k]), self.name)
        return None


class DraftModel:
    """A small model's chain: k steps of its own sampler on its own engine (which must share the target's
    vocabulary). Its KV cache keeps the positions whose tokens the history still has."""

    name = "model"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def room(self, n_history: int) -> int:
        """Tokens the draft can still propose after a history of n_history (its context)."""
        return self.engine.kv.capacity + 1 - n_history  # the history, then k - 1 drafted tokens, in its cache

    def propose(self, history: Sequence[int], k: int, sampler: Sampler) -> Draft | None:
        k = min(k, self.room(len(history)))
        if k < 1:
            return None
        engine, device = self.engine, self.engine.device
        # Reuse the cached positions the history still has; always recompute the last token for its logits.
        keep = engine.kv.reusable_prefix(history, limit=len(history) - 1)
        first = engine.forward(torch.tensor(history[keep:], dtype=torch.int64, device=device), keep)

        def logits_after(i: int, token: int) -> torch.Tensor:
            if i == 0:
                return first
            return engine.forward(torch.tensor([token], dtype=torch.int64, device=device), len(history) + i - 1)

        return sample_chain(history, k, sampler, logits_after, self.name)


def sample_chain(history: Sequence[int], k: int, sampler: Sampler,
                 logits_after: Callable[[int, int], torch.Tensor], source: str) -> Draft:
    """k tokens drawn one after another with the target's sampler: logits_after(i, t) [V] are the drafter's logits
    for token i, t being the token before it (the history's last for i = 0). Sampling records each distribution."""
    seen = torch.tensor(history, dtype=torch.int64, device=sampler.generator.device)
    tokens, probs = [], []
    sampling = sampler.params.temperature > 0
    token = history[-1]
    for i in range(k):
        logits = logits_after(i, token)
        if sampling:
            p = sampler.probabilities(logits, seen)
            token = int(torch.multinomial(p, 1, generator=sampler.generator))
            probs.append(p)
        else:
            token = sampler(logits, seen)
        tokens.append(token)
        seen = torch.cat((seen, torch.tensor([token], dtype=torch.int64, device=seen.device)))
    return Draft(tokens, source, torch.stack(probs) if sampling else None)


class Drafters:
    """The sources of one generation, asked in turn (`propose`), each drafting as many tokens as `length` finds
    worth a pass."""

    def __init__(self, lookup: PromptLookup | None, model: DraftModel | SelfDraft | None, length: DraftLength
                 ) -> None:
        self.lookup, self.model, self.length = lookup, model, length

    def __bool__(self) -> bool:
        return self.lookup is not None or self.model is not None

    def propose(self, history: Sequence[int], most: int, sampler: Sampler) -> Draft | None:
        if self.lookup is not None:
            least = PREFERRED_LOOKUP if self.model is not None else 1
            draft = self.lookup.propose(history, most, min_ngram=least)
            if draft is not None:
                draft.tokens = draft.tokens[: self.length.choose(draft.source, len(draft.tokens))]
                if draft.tokens:
                    return draft
        if self.model is not None:
            k = self.length.choose(self.model.name, most)
            return self.model.propose(history, k, sampler) if k else None
        return None


def verify(rows: torch.Tensor, draft: Draft | None, sampler: Sampler, history: torch.Tensor) -> tuple[int, int]:
    """The target's verdict on a draft: rows [1 + k, V] are its logits after the history and after each drafted
    token; returns (drafted tokens accepted, the target's own next token)."""
    tokens = draft.tokens if draft is not None else []
    greedy = sampler.params.temperature == 0
    for i, x in enumerate(tokens):
        seen = torch.cat((history, torch.tensor(tokens[:i], dtype=torch.int64, device=history.device)))
        if greedy:
            token = sampler(rows[i], seen)
            if token != x:
                return i, token
            continue
        p = sampler.probabilities(rows[i], seen)
        q = draft.probs[i] if draft.probs is not None else None
        q_x = float(q[x]) if q is not None else 1.0
        if float(torch.rand((), generator=sampler.generator)) * q_x < float(p[x]):
            continue  # accepted with probability min(1, p(x) / q(x))
        if q is not None:
            residual = (p - q).clamp_min(0)
        else:
            residual = p.clone()
            residual[x] = 0.0
        if float(residual.sum()) <= 0:  # p <= q everywhere: only when p == q, where rejection has probability 0
            residual = p
        return i, int(torch.multinomial(residual, 1, generator=sampler.generator))
    seen = torch.cat((history, torch.tensor(tokens, dtype=torch.int64, device=history.device)))
    return len(tokens), sampler(rows[len(tokens)], seen)


def speculative_ids(
    engine: Engine,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampler: Sampler,
    stop_ids: frozenset[int],
    drafters: Drafters,
    draft_tokens: int,
    stats: SpeculationStats,
    cached_prefix: int = 0,
) -> Iterator[int]:
    """As `generation.generate_ids`, with each target pass verifying a draft of up to `draft_tokens` tokens
    (clipped to what is still wanted, to the context left and to MAX_DRAFT)."""
    device = engine.device
    history = list(prompt_ids)
    logits = engine.forward(torch.tensor(prompt_ids[cached_prefix:], dtype=torch.int64, device=device), cached_prefix)
    token = sampler(logits, torch.tensor(history, dtype=torch.int64, device=device))
    pending = [token]  # decided tokens not yet yielded
    generated = 0
    while True:
        for token in pending:
            yield token
            generated += 1
            history.append(token)
            if token in stop_ids or generated == max_new_tokens or len(history) > engine.kv.capacity:
                return
        # The pass puts history[-1] and the draft at positions len(history) - 1 ..: both must fit the context.
        k = min(draft_tokens, MAX_DRAFT, max_new_tokens - generated - 1, engine.kv.capacity - len(history))
        t0 = time.perf_counter()
        draft = drafters.propose(history, k, sampler) if k > 0 else None
        if draft is not None:
            draft.tokens = draft.tokens[:k]
        t1 = time.perf_counter()
        run = [history[-1]] + (draft.tokens if draft is not None else [])
        rows = engine.forward(torch.tensor(run, dtype=torch.int64, device=device), len(history) - 1, all_logits=True)
        accepted, token = verify(rows, draft, sampler, torch.tensor(history, dtype=torch.int64, device=device))
        t2 = time.perf_counter()
        drafters.length.observe(draft.source if draft is not None else None, len(run) - 1, accepted, t1 - t0,
                                len(run), t2 - t1)
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.passes += 1
        stats.tokens += accepted + 1
        if draft is not None:
            stats.drafted[draft.source] = stats.drafted.get(draft.source, 0) + len(draft.tokens)
            stats.accepted[draft.source] = stats.accepted.get(draft.source, 0) + accepted
        pending = (draft.tokens[:accepted] if draft is not None else []) + [token]
