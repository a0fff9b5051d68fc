"""Sampling and the token-by-token generation loop.

`SamplingParams` is the user's choice (validated with the option named); `Sampler` turns last-position logits
into a token id; `generate_ids` runs prefill then decode, yielding each token as soon as it is chosen.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ntio.runtime.engine import Engine
from ntio.errors import OptionError, integer_option, number_option


# Seeds a torch generator takes: a signed or an unsigned 64-bit integer.
SEEDS = range(-(2**63), 2**64)
# Temperatures above 0 and below this sample as greedy decoding does (vLLM's rule): dividing float32 logits by
# them overflows, and their distribution is the argmax's anyway.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below GREEDY_BELOW) means greedy; top_k 0 and top_p 1 disable those filters;
    repetition_penalty 1 disables it; seed: an integer in SEEDS."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "repetition_penalty"):
            object.__setattr__(self, name, number_option(name, getattr(self, name)))
        object.__setattr__(self, "top_k", integer_option("top_k", self.top_k))
        if self.seed is not None:
            object.__setattr__(self, "seed", integer_option("seed", self.seed))
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise OptionError("temperature", f"must be finite and >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if self.top_k < 0:
            raise OptionError("top_k", f"must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise OptionError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise OptionError("repetition_penalty", f"must be finite and > 0, got {self.repetition_penalty}")
        if self.seed is not None and self.seed not in SEEDS:
            raise OptionError("seed", f"must be in [-2^63, 2^64), got {self.seed}")


def greedy_token(logits: torch.Tensor) -> int:
    """The id of the largest of logits [V] (the first, at a tie). On the CPU through numpy: torch's argmax takes
    ~0.2 ms over a 152k vocabulary, numpy's ~15 us."""
    if logits.device.type == "cpu":
        return int(np.argmax(logits.numpy()))
    return int(logits.argmax())


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.generator = torch.Generator(device=device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, history: torch.Tensor) -> int:
        """logits: [V] float; history: [n] int64 ids seen so far (prompt and generated) for the penalty."""
        if self.params.temperature == 0:
            return greedy_token(self.processed(logits, history))
        return int(torch.multinomial(self.probabilities(logits, history), 1, generator=self.generator))

    def probabilities(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """The distribution a sampled token is drawn from: [V] float32 (temperature > 0)."""
        return self.processed(logits, history).softmax(-1)

    def processed(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """The logits sampling draws from: repetition penalty, then temperature, top-k and top-p (-inf = removed)."""
        p = self.params
        logits = logits.float()
        if p.repetition_penalty != 1.0 and history.numel():
            # CTRL / transformers convention: shrink the logit of every seen token towards "less likely".
            seen = history.unique()
            scores = logits[seen]
            logits = logits.clone()
            logits[seen] = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
        if p.temperature == 0:
            return logits
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = logits.sort(descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            # Drop a token once the mass before it already reaches top_p; the most likely token always stays.
            drop = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p
            drop[0] = False  # (a top_p that rounds to 0 in float32 would drop it too)
            logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        return logits


def generate_ids(
    engine: Engine,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampler: Sampler,
    stop_ids: frozenset[int],
    cached_prefix: int = 0,
) -> Iterator[int]:
    """Prefill prompt_ids (reusing the first `cached_prefix` positions already in the KV cache), then decode.

    Yields each new token id; stops after a stop id (which is yielded), after max_new_tokens, or when the context
    is full.
    """
    device = engine.device
    history = torch.tensor(prompt_ids, dtype=torch.int64, device=device)
    logits = engine.forward(history[cached_prefix:], cached_prefix)
    position = len(prompt_ids)
    for step in range(max_new_tokens):
        token = sampler(logits, history)
        yield token
        if token in stop_ids or step == max_new_tokens - 1 or position >= engine.kv.capacity:
            return
        token_t = torch.tensor([token], dtype=torch.int64, device=device)
        history = torch.cat((history, token_t))
        logits = engine.forward(token_t, position)
        position += 1
