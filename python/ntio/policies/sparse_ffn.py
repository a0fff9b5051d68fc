"""Sparse FFN: which of its neurons each token's feed-forward keeps (seed 002, issue 20).

A SwiGLU FFN computes down · a with a = silu(gate · x) ⊙ (up · x): [T, F]. A neuron whose a_i is near 0 adds
nearly nothing, so the down product can drop it; the bytes saved are the dropped neurons' down weights (and, when
the choice comes before up or gate is read, theirs). Rules for the choice, per token:
  * "down": the neurons of largest |a| (gate and up computed whole: the exact activations);
  * "gate": the neurons of largest |silu(gate · x)| (the seed's rule: only gate computed whole);
  * "predicted": the neurons a small per-layer predictor scores highest from x alone (`NeuronPredictor`, fitted to
    the "down" rule's choices on a calibration text), so that no FFN byte need be read before the choice.
A selection keeps ceil(keep × G) of G units per token: single neurons, or groups of neurons (rows of `groups`).

Measured (benches/RESULTS.md, "Sparse FFN"): on these SwiGLU models the rule only pays per neuron. Keeping half of
SmolLM2's neurons by |a| costs x1.021 perplexity one by one, but x4.30 in groups of 32 consecutive neurons (one
Q4_1 block of its down matrix) and x2.15 in groups of 32 clustered by co-activation; which neurons matter changes
neuron by neuron. On Qwen2.5-Coder-1.5B, one by one: x1.006. A predictor does not come close on these models:
at keep 0.5 it recalls 62-65% of the "down" rule's neurons, x2.25 on SmolLM2 (rank 128) and x3.62 on Qwen
(rank 256), where the gate rule costs x1.39 and x1.13.

This module prices a rule in perplexity: the FFN computes exactly the kept neurons and the others count as 0. On a
model file as it is, every byte is still read. On a store with the ffn-groups layout (`ntio convert --layout
ffn-groups`: each down matrix also stored group-major, a group one quantization block of neurons, 32 or 256), the
units are those groups and the policy reads less: each streamed layer is read without its down matrix
(`DOWN_LATER`), and once gate and up are computed the FFN reads only the down groups its tokens keep. Kept neurons
of different tokens differ: a pass over T tokens computes each token with its own (as decoding it alone would) and
reads the union; `SparseFFNPolicy.union_fraction` reports the share of units at least one token of the pass kept.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ntio.policies.base import DOWN_LATER, LOAD_ALL, FFNMask, LoadDecision, LoadPolicy

RULES = ("down", "gate", "predicted")


@dataclass(frozen=True)
class NeuronSelection:
    """Keeps, per token, the `keep` share of units scoring highest under `rule`. groups: [G, g] int64 neuron ids,
    each row one unit (disjoint; neurons in no row are always kept); None: every neuron is its own unit. The
    "predicted" rule scores with a predictor's output, passed to `masks`."""

    rule: str
    keep: float
    groups: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"sparse FFN rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if not 0.0 < self.keep <= 1.0:
            raise ValueError(f"sparse FFN keep must be in (0, 1], got {self.keep}")

    def masks(self, gate: torch.Tensor, up: torch.Tensor, predicted: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """gate, up: [T, F] pre-activations; predicted: [T, F] a predictor's scores (the "predicted" rule) ->
        (neurons [T, F], units [T, G]): bool, True where a token keeps it."""
        if self.rule == "predicted":
            if predicted is None:
                raise ValueError("the predicted rule needs a predictor's scores")
            score = predicted
        else:
            score = F.silu(gate).abs() if self.rule == "gate" else (F.silu(gate) * up).abs()  # [T, F]
        if self.groups is not None:
            score = score[:, self.groups].sum(dim=-1)  # [T, G]
        units = _top_share(score, self.keep)
        if self.groups is None:
            return units, units
        neurons = torch.ones_like(gate, dtype=torch.bool)
        neurons[:, self.groups.reshape(-1)] = units.repeat_interleave(self.groups.shape[1], dim=1)
        return neurons, units


def consecutive_groups(d_ff: int, size: int) -> torch.Tensor | None:
    """[F / size, size] groups of consecutive neurons (a quantization block of the down matrix is 32 or 256);
    None for size 1."""
    if size < 1 or d_ff % size:
        raise ValueError(f"a group of {size} neurons does not divide the FFN's {d_ff}")
    return None if size == 1 else torch.arange(d_ff).view(-1, size)


class NeuronPredictor(torch.nn.Module):
    """One layer's neuron scores from the FFN's normed input (DejaVu's predictor): x [T, D] -> relu(x · A) · B + b
    [T, F], A [D, r], B [r, F]. Fitted to say which neurons the "down" rule keeps."""

    def __init__(self, d_model: int, d_ff: int, rank: int) -> None:
        super().__init__()
        self.down = torch.nn.Linear(d_model, rank, bias=False)
        self.up = torch.nn.Linear(rank, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(F.relu(self.down(x)))

    @classmethod
    def fit(cls, x: torch.Tensor, activations: torch.Tensor, keep: float, rank: int, epochs: int = 8,
            seed: int = 0) -> NeuronPredictor:
        """Trained on calibration tokens, x [N, D] and |a| [N, F]: binary cross-entropy against the neurons the
        "down" rule keeps at `keep` (each token's ceil(keep × F) largest |a|), Adam, batches of 256."""
        torch.manual_seed(seed)
        x, activations = x.float(), activations.float()
        kept = _top_share(activations, keep).float()
        predictor = cls(x.shape[1], activations.shape[1], rank)
        optimizer = torch.optim.Adam(predictor.parameters(), lr=2e-3)
        with torch.enable_grad():
            for _ in range(epochs):
                for batch in torch.randperm(x.shape[0]).split(256):
                    loss = F.binary_cross_entropy_with_logits(predictor(x[batch]), kept[batch])
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
        return predictor.eval().requires_grad_(False)


@functools.lru_cache(maxsize=8)
def _consecutive(d_ff: int, size: int) -> torch.Tensor | None:
    """`consecutive_groups`, made once per shape."""
    return consecutive_groups(d_ff, size)


def _top_share(score: torch.Tensor, keep: float) -> torch.Tensor:
    """[T, F] bool: each row's ceil(keep × F) largest scores."""
    top = score.topk(math.ceil(keep * score.shape[1]), dim=1, sorted=False).indices
    return torch.zeros_like(score, dtype=torch.bool).scatter_(1, top, True)


@dataclass
class SparseFFNPolicy(LoadPolicy):
    """Has the FFN keep `selection`'s neurons (`groups`: per layer, else the selection's own; `predictors`: per
    layer, for the "predicted" rule). With `group_reads` (neurons per group of a store's group-major down copies),
    the units are those groups and streamed layers are read without down, whose kept groups the FFN reads; without,
    every layer is read whole. Counts, per layer, the passes and the share of units the union of a pass's tokens
    kept; with predictors, how many of the "down" rule's neurons they kept."""

    selection: NeuronSelection
    groups: dict[int, torch.Tensor] = field(default_factory=dict)
    predictors: dict[int, NeuronPredictor] = field(default_factory=dict)
    group_reads: int | None = None
    # layer -> the share of units some token kept, per pass: 0-d tensors, read only by union_fraction (no host
    # synchronisation in the forward pass)
    union: dict[int, list[torch.Tensor]] = field(default_factory=dict, init=False)
    # per pass and layer (predicted rule): the share of the "down" rule's neurons kept, a 0-d tensor
    recall: list[torch.Tensor] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.group_reads is not None and self.selection.rule == "predicted":
            raise ValueError("the predicted rule reads layers whole: reading only its groups is not built")

    def decide(self, layer: int, ahead: int) -> LoadDecision:
        return DOWN_LATER if self.group_reads is not None else LOAD_ALL

    def ffn_mask(self, layer: int) -> FFNMask | None:
        selection = self.selection
        if layer in self.groups:
            selection = NeuronSelection(selection.rule, selection.keep, self.groups[layer])
        predictor = self.predictors.get(layer) if selection.rule == "predicted" else None
        if selection.rule == "predicted" and predictor is None:
            return None  # no predictor for this layer: it keeps every neuron

        def mask(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            chosen = selection
            if self.group_reads is not None and layer not in self.groups:
                chosen = NeuronSelection(selection.rule, selection.keep, _consecutive(gate.shape[1], self.group_reads))
            neurons, units = chosen.masks(gate, up, None if predictor is None else predictor(x))
            self.union.setdefault(layer, []).append(units.any(dim=0).float().mean())
            if predictor is not None:
                oracle = NeuronSelection("down", selection.keep).masks(gate, up)[0]
                self.recall.append((oracle & neurons).sum() / oracle.sum())
            return neurons

        return mask

    def union_fraction(self) -> float:
        """Mean over layers and passes of the share of units some token of the pass kept."""
        shares = [s for per_layer in self.union.values() for s in per_layer]
        return float(torch.stack(shares).mean()) if shares else 0.0

    def oracle_recall(self) -> float:
        """Mean over passes and layers of the share of the "down" rule's neurons the predictors kept."""
        return float(torch.stack(self.recall).mean()) if self.recall else 0.0
