"""Sparse FFN: which of its neurons each token's feed-forward keeps (seed 002, issue 20).

A SwiGLU FFN computes down · a with a = silu(gate · x) ⊙ (up · x): [T, F]. A neuron whose a_i is near 0 adds
nearly nothing, so the down product can drop it; the bytes saved are the dropped neurons' down weights (and, when
the choice comes before up or gate is read, theirs). Rules for the choice, per token:
  * "down": the neurons of largest |a| (gate and up computed whole: the exact activations), each weighed by the
    norm of its column of down where the policy has them (`down_norms`): |a_i| · ||down[:, i]|| bounds what
    neuron i adds to the output;
  * "gate": the neurons of largest |silu(gate · x)| (the seed's rule: only gate computed whole);
  * "predicted": the units a small per-layer predictor scores highest from the layer before's x (the first
    layer's: its own; `UnitPredictor`, fitted by `ntio calibrate --ffn-predictors` to the order of the "down"
    rule's unit scores on a calibration text), so that no FFN byte need be read before the choice and a layer's
    choice is known while the layer before computes.
A selection keeps ceil(keep × G) of G units per token: single neurons, or groups of neurons (rows of `groups`).

Measured (benches/RESULTS.md, "Sparse FFN"): on these SwiGLU models the rule only pays per neuron. Keeping half of
SmolLM2's neurons by |a| costs x1.021 perplexity one by one, but x4.30 in groups of 32 consecutive neurons (one
Q4_1 block of its down matrix) and x2.15 in groups of 32 clustered by co-activation; which neurons matter changes
neuron by neuron. On Qwen2.5-Coder-1.5B, one by one: x1.006. A predictor does not come close on these models:
at keep 0.5 it recalls 62-65% of the "down" rule's neurons, x2.25 on SmolLM2 (rank 128) and x3.62 on Qwen
(rank 256), where the gate rule costs x1.39 and x1.13. In groups of one block of down (read a layer ahead), it
recalls 63-67% of the "down" rule's groups at keep 0.5 and costs x4.3 on Qwen, x8.3 on SmolLM2. Weighing each
neuron by its down column's norm reads nothing more and helps units of whole blocks: on Qwen in groups of
256 at keep 0.7 / 0.5 / 0.3, x1.41 / x2.60 / x14.5 unweighed, x1.36 / x2.37 / x9.0 weighed (same text).

This module prices a rule in perplexity: the FFN computes exactly the kept neurons and the others count as 0. On a
model file as it is, every byte is still read. On a store with the ffn-groups layout (`ntio convert --layout
ffn-groups`: each down matrix also stored group-major, a group one quantization block of neurons, 32 or 256), the
units are those groups and the policy reads less: each streamed layer is read without its down matrix
(`DOWN_LATER`), and once gate and up are computed the FFN reads only the down groups its tokens keep; under the gate
rule, without up and down (`UP_LATER`): gate computed whole chooses, then the kept groups' up rows and down groups
are read; under the predicted rule, without gate, up and down (`FFN_LATER`): the FFN reads only the kept groups'
gate and up rows (checked against the layout's checksum of each group's rows) and down groups, submitted as soon as
the layer before has chosen them (`ahead_groups`), so they come off the disk while that layer computes. Kept neurons
of different tokens differ: a pass over T tokens computes each token with its own (as decoding it alone would) and
reads the union; `SparseFFNPolicy.union_fraction` reports the share of units at least one token of the pass kept.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ntio.errors import ModelFormatError
from ntio.policies.base import DOWN_LATER, FFN_LATER, LOAD_ALL, UP_LATER, FFNMask, LoadDecision, LoadPolicy

RULES = ("down", "gate", "predicted")


@dataclass(frozen=True)
class NeuronSelection:
    """Keeps, per token, the `keep` share of units scoring highest under `rule`. groups: [G, g] int64 neuron ids,
    each row one unit (disjoint; neurons in no row are always kept); None: every neuron is its own unit. The
    "predicted" rule scores the units with a predictor's output, passed to `masks`."""

    rule: str
    keep: float
    groups: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"sparse FFN rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if not 0.0 < self.keep <= 1.0:
            raise ValueError(f"sparse FFN keep must be in (0, 1], got {self.keep}")

    def masks(self, gate: torch.Tensor | None, up: torch.Tensor | None, predicted: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """gate, up: [T, F] pre-activations (None for the predicted rule where they are not computed yet);
        predicted: [T, G] a predictor's scores of the units (the "predicted" rule) -> (neurons [T, F], units
        [T, G]): bool, True where a token keeps it."""
        if self.rule == "predicted":
            if predicted is None:
                raise ValueError("the predicted rule needs a predictor's scores")
            units = _top_share(predicted, self.keep)
        else:
            score = F.silu(gate).abs() if self.rule == "gate" else (F.silu(gate) * up).abs()  # [T, F]
            if self.groups is not None:
                score = score[:, self.groups].sum(dim=-1)  # [T, G]
            units = _top_share(score, self.keep)
        if self.groups is None:
            return units, units
        d_ff = gate.shape[1] if gate is not None else self.groups.numel()
        neurons = torch.ones((units.shape[0], d_ff), dtype=torch.bool)
        neurons[:, self.groups.reshape(-1)] = units.repeat_interleave(self.groups.shape[1], dim=1)
        return neurons, units


def consecutive_groups(d_ff: int, size: int) -> torch.Tensor | None:
    """[F / size, size] groups of consecutive neurons (a quantization block of the down matrix is 32 or 256);
    None for size 1."""
    if size < 1 or d_ff % size:
        raise ValueError(f"a group of {size} neurons does not divide the FFN's {d_ff}")
    return None if size == 1 else torch.arange(d_ff).view(-1, size)


def unit_scores(gate: torch.Tensor, up: torch.Tensor, neurons: int, norms: torch.Tensor | None = None
                ) -> torch.Tensor:
    """The "down" rule's score of each unit of `neurons` consecutive neurons: Σ |silu(gate) · up| · norms over it
    (norms [F]: the down matrix's column norms; None: 1), [T, G]."""
    return (F.silu(gate) * _weighed(up, norms)).abs().unflatten(1, (-1, neurons)).sum(dim=2)


def _weighed(up: torch.Tensor | None, norms: torch.Tensor | None) -> torch.Tensor | None:
    """up [T, F] with each neuron's column scaled by its down column's norm (norms [F]), so that the down rule's
    |silu(gate) · up| scores what the neuron adds to the output; up itself without norms (or up)."""
    return up if norms is None or up is None else up * norms


class UnitPredictor(torch.nn.Module):
    """One layer's unit scores before any of its FFN bytes is read (DejaVu's predictor), from an FFN's normed input:
    x [T, D] -> relu(x · A) · B + b [T, G], A [D, r], B [r, G]. `SparseFFNPolicy` gives layer l's predictor layer
    l - 1's input (the first layer's, its own), so that layer l's groups are read while layer l - 1 computes. A
    unit is a group of `neurons` consecutive neurons (1: single neurons). Fitted to the order of the "down" rule's
    unit scores, not to one keep share: a --keep keeps the top share of its scores."""

    def __init__(self, d_model: int, units: int, rank: int, neurons: int = 1) -> None:
        super().__init__()
        self.neurons = neurons
        self.down = torch.nn.Linear(d_model, rank, bias=False)
        self.up = torch.nn.Linear(rank, units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(F.relu(self.down(x)))

    @property
    def d_ff(self) -> int:
        return self.up.out_features * self.neurons

    @classmethod
    def fit(cls, x: torch.Tensor, scores: torch.Tensor, rank: int, neurons: int = 1, epochs: int = 8,
            seed: int = 0) -> UnitPredictor:
        """Trained on calibration tokens, x [N, D] and the "down" rule's unit scores [N, G] (`unit_scores`): least
        squares against each token's log-scores (floored at a hundredth of the token's mean: a unit of score 0 is
        not many times less wanted than one of 1e-9), centred and scaled token by token (the order within a token
        is what a keep share reads), Adam, batches of 256."""
        torch.manual_seed(seed)
        x, scores = x.float(), scores.float()
        target = (scores + 0.01 * scores.mean(dim=1, keepdim=True)).clamp_min(1e-30).log()
        target = (target - target.mean(dim=1, keepdim=True)) / target.std(dim=1, correction=0, keepdim=True
                                                                            ).clamp_min(1e-6)
        predictor = cls(x.shape[1], scores.shape[1], rank, neurons)
        optimizer = torch.optim.Adam(predictor.parameters(), lr=2e-3)
        with torch.enable_grad():
            for _ in range(epochs):
                for batch in torch.randperm(x.shape[0]).split(256):
                    loss = F.mse_loss(predictor(x[batch]), target[batch])
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
        return predictor.eval().requires_grad_(False)

    def state(self) -> dict[str, torch.Tensor]:
        """Plain tensors for a calibration file: A [r, D] as "down", B [G, r] as "up", b [G] as "bias"."""
        return {"down": self.down.weight.detach().clone(), "up": self.up.weight.detach().clone(),
                "bias": self.up.bias.detach().clone()}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], neurons: int) -> UnitPredictor:
        rank, d_model = state["down"].shape
        predictor = cls(d_model, state["up"].shape[0], rank, neurons)
        with torch.no_grad():
            predictor.down.weight.copy_(state["down"])
            predictor.up.weight.copy_(state["up"])
            predictor.up.bias.copy_(state["bias"])
        return predictor.eval().requires_grad_(False)


def fit_predictors(inputs: dict[int, torch.Tensor], scores: dict[int, torch.Tensor], neurons: int, rank: int,
                   epochs: int = 8) -> dict[int, UnitPredictor]:
    """One predictor per layer of `scores` (layer -> the "down" rule's unit scores [N, G] of N calibration tokens),
    each fitted to them from the layer before's FFN inputs (layer -> [N, D], the same tokens; the first layer's:
    its own), as `SparseFFNPolicy` asks them."""
    return {layer: UnitPredictor.fit(inputs[max(layer - 1, 0)], scores[layer], rank, neurons, epochs)
            for layer in sorted(scores)}


def unit_recall(predicted: torch.Tensor, oracle: torch.Tensor, keep: float) -> float:
    """The share of the units the "down" rule keeps (top `keep` of oracle [N, G], its unit scores) that the top
    `keep` of the predicted scores [N, G] keeps too."""
    want, kept = _top_share(oracle, keep), _top_share(predicted, keep)
    return float((want & kept).sum() / want.sum())


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
    layer, for the "predicted" rule, whose units are their groups). With `group_reads` (neurons per group of a
    store's FFN layout) the units are those groups and streamed layers are read in part: without down, whose kept
    groups the FFN reads once gate and up are known ("down"); without up and down, whose kept groups' rows and
    columns it reads once gate is known ("gate"); or without gate, up and down, whose kept groups' rows and
    columns it reads once the predictor has chosen them from its input ("predicted").
    Without, every layer is read whole. Counts, per layer, the passes and the share of units the union of a
    pass's tokens kept; where gate and up are computed whole, how many of the "down" rule's units the predictors
    kept."""

    selection: NeuronSelection
    groups: dict[int, torch.Tensor] = field(default_factory=dict)
    predictors: dict[int, UnitPredictor] = field(default_factory=dict)
    group_reads: int | None = None
    # layer -> the norms of its down matrix's columns [F] (ntio.formats.store.DownNorms), which the down rule and
    # the predictors' recall of it weigh each neuron by; None: every neuron weighs 1
    down_norms: Callable[[int], torch.Tensor] | None = None
    # The predictors' recall of the "down" rule's units on held-out text, per keep share, as `ntio calibrate`
    # measured it (the reads of the predicted rule leave the oracle unknown at run time).
    calibrated_recall: dict[float, float] | None = None
    # layer -> the share of units some token kept, per pass: 0-d tensors, read only by union_fraction (no host
    # synchronisation in the forward pass)
    union: dict[int, list[torch.Tensor]] = field(default_factory=dict, init=False)
    # per pass and layer (predicted rule, gate and up computed): the share of the "down" rule's units kept, 0-d
    recall: list[torch.Tensor] = field(default_factory=list, init=False)
    # layer -> its predictor's unit scores [T, G], from the layer before's FFN input (the predicted rule's
    # look-ahead): made when that layer chose, used when this one does
    _ahead: dict[int, torch.Tensor] = field(default_factory=dict, init=False)
    # layer -> down_norms(layer) on the device the FFN runs on, made at its first use
    _norms: dict[int, torch.Tensor] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.group_reads is not None and self.selection.rule == "predicted":
            for layer, predictor in self.predictors.items():
                if predictor.neurons != self.group_reads:
                    raise ValueError(f"layer {layer}'s predictor scores groups of {predictor.neurons} neurons, the "
                                     f"store's FFN groups have {self.group_reads}")

    def decide(self, layer: int, ahead: int) -> LoadDecision:
        if self.group_reads is None:
            return LOAD_ALL
        if self.selection.rule == "down":
            return DOWN_LATER
        if self.selection.rule == "gate":
            return UP_LATER
        return FFN_LATER if layer in self.predictors else LOAD_ALL

    def ffn_mask(self, layer: int) -> FFNMask | None:
        selection = self.selection
        predictor = self.predictors.get(layer) if selection.rule == "predicted" else None
        if selection.rule == "predicted":
            if predictor is None:
                return None  # no predictor for this layer: it keeps every neuron
            selection = NeuronSelection("predicted", selection.keep, _consecutive(predictor.d_ff, predictor.neurons))
        elif layer in self.groups:
            selection = NeuronSelection(selection.rule, selection.keep, self.groups[layer])

        def mask(x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor | None) -> torch.Tensor:
            chosen, scores = selection, None
            if self.group_reads is not None and predictor is None and layer not in self.groups:
                chosen = NeuronSelection(selection.rule, selection.keep, _consecutive(gate.shape[1], self.group_reads))
            if predictor is not None:
                # Scored from the layer before's input where it had a predictor (the look-ahead), else from this
                # one's (the first layer); then the next layer's scores from this input.
                scores = self._ahead.pop(layer, None)
                if scores is None:
                    scores = predictor(x)
                if (following := self.predictors.get(layer + 1)) is not None:
                    self._ahead[layer + 1] = following(x)
            weighed = up is not None and (selection.rule == "down" or predictor is not None)  # the down rule's scores
            norms = self._down_norms(layer, x.device) if weighed else None
            neurons, units = chosen.masks(gate, _weighed(up, norms), scores)
            self.union.setdefault(layer, []).append(units.any(dim=0).float().mean())
            if predictor is not None and gate is not None:
                oracle = _top_share(unit_scores(gate, up, predictor.neurons, norms), selection.keep)
                self.recall.append((oracle & units).sum() / oracle.sum())
            return neurons

        return mask

    def _down_norms(self, layer: int, device: torch.device) -> torch.Tensor | None:
        if self.down_norms is None:
            return None
        if layer not in self._norms:
            self._norms[layer] = self.down_norms(layer).to(device)
        return self._norms[layer]

    def begin_pass(self, start_pos: int, n_tokens: int) -> None:
        self._ahead.clear()

    def ahead_groups(self, layer: int) -> list[int] | None:
        """The predicted rule's look-ahead: the groups some token of the pass keeps in `layer`, known once the layer
        before has chosen (its predictor reads that layer's FFN input), sorted; None where not known yet."""
        scores = self._ahead.get(layer)
        if scores is None:
            return None
        return _top_share(scores, self.selection.keep).any(dim=0).nonzero().flatten().tolist()

    def union_fraction(self) -> float:
        """Mean over layers and passes of the share of units some token of the pass kept."""
        shares = [s for per_layer in self.union.values() for s in per_layer]
        return float(torch.stack(shares).mean()) if shares else 0.0

    def oracle_recall(self) -> float | None:
        """Mean over passes and layers of the share of the "down" rule's units the predictors kept; None where no
        pass computed gate and up whole (the predicted rule's reads leave the others unread)."""
        return float(torch.stack(self.recall).mean()) if self.recall else None


def load_predictors(ffn: dict | None, path: str, d_model: int, d_ff: int) -> tuple[dict[int, UnitPredictor], dict]:
    """A calibration file's sparse FFN predictors (its `ffn` payload; `path` names the file in errors), checked
    against this model's sizes -> (layer -> predictor, the held-out recall per keep share)."""
    if ffn is None:
        raise ModelFormatError(f"{path}: no sparse FFN predictors in it (`ntio calibrate --ffn-predictors` fits them)")
    neurons, predictors = int(ffn["neurons"]), {}
    if not ffn["layers"]:
        raise ModelFormatError(f"{path}: its sparse FFN payload holds no predictor")
    for layer, state in ffn["layers"].items():
        rank = state["down"].shape[0]
        if (tuple(state["down"].shape) != (rank, d_model) or tuple(state["up"].shape) != (d_ff // neurons, rank)
                or d_ff % neurons):
            raise ModelFormatError(f"{path}: layer {layer}'s FFN predictor maps {tuple(state['down'].shape[1:])} "
                                   f"to {tuple(state['up'].shape[:1])} units of {neurons}, not ({d_model},) to "
                                   f"this model's {d_ff} neurons")
        predictors[int(layer)] = UnitPredictor.from_state(state, neurons)
    return predictors, {float(k): float(v) for k, v in ffn["recall"].items()}
