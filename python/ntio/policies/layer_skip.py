"""Predictive layer skip, decided before the load (seed 000, issue 14).

A small predictor reads the residual stream after layer `skip_after` and gives, for each later layer, the chance
that the layer would barely change the token (post-compute label: cos(h_in, h_out) > 0.98). A later layer whose
chance is above its threshold is skipped for that token: not read (for one-token steps), not computed, and its K/V
at the token's position never written (the cache marks it skipped and attention masks it out). At most
`max_consecutive` layers in a row are skipped.

Thresholds: one confidence for every layer, chosen from a bytes budget on the calibration's held-out tokens
(`SkipSetting.for_budget`), then raised per layer for the prompt being answered (the seed's strategy B): while a
prompt is prefilled every layer computes, the labels are measured, and a layer's threshold rises above the highest
chance the predictor gave a prompt token that the layer did change. Teacher-forced scoring (`ntio perplexity`) has
no prompt: every position is decided with the calibrated thresholds.

Predictions are known once layer `skip_after` has computed in the current pass. Reads of the layers past the first
it decides wait for them (`holds`); one submitted before (read ahead from the previous step, or the first layer,
read on the chance it is needed) is decided LOAD_ALL and dropped if the prediction skips it (`still_wanted`): its
bytes were read, its compute is saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ntio.policies.base import LOAD_ALL, SKIP, LoadDecision, LoadPolicy, Observation
from ntio.policies.depth_profile import SKIP_LABEL_COS, DepthProfile, bisect

HIDDEN = 256  # the seed's width
MAX_CONSECUTIVE = 5  # the seed's limit


def _features(h: torch.Tensor) -> torch.Tensor:
    """[n, D] residual stream -> RMS-normalised features (the stream's scale grows with depth and position)."""
    return h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + 1e-6)


class SkipPredictor(torch.nn.Module):
    """h [n, D] after layer skip_after -> [n, later] chance each later layer can be skipped: the seed's 2-layer MLP
    (D -> 256 -> later, ReLU, sigmoid)."""

    def __init__(self, d_model: int, n_later: int) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(d_model, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, n_later)

    @torch.no_grad()
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.out(F.relu(self.hidden(_features(h.float())))))

    @staticmethod
    def fit(h: torch.Tensor, labels: torch.Tensor, epochs: int = 40, seed: int = 0) -> SkipPredictor:
        """Binary cross-entropy on (h [n, D], labels [n, later] in {0, 1}), Adam, minibatches of 256."""
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        model = SkipPredictor(h.shape[1], labels.shape[1])
        x, y = _features(h.float()), labels.float()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
        with torch.enable_grad():
            for _ in range(epochs):
                for batch in torch.randperm(x.shape[0], generator=gen).split(256):
                    logits = model.out(F.relu(model.hidden(x[batch])))
                    loss = F.binary_cross_entropy_with_logits(logits, y[batch])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        return model.eval()

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.state_dict().items()}

    @staticmethod
    def from_state(state: dict[str, torch.Tensor]) -> SkipPredictor:
        model = SkipPredictor(state["hidden.weight"].shape[1], state["out.weight"].shape[0])
        model.load_state_dict(state)
        return model.eval()


def skip_mask(probs: torch.Tensor, thresholds: torch.Tensor, max_consecutive: int) -> torch.Tensor:
    """[n, later] chances and [later] thresholds -> [n, later] bool skips, at most max_consecutive in a row."""
    wanted = probs > thresholds
    skips = torch.zeros_like(wanted)
    run = torch.zeros(probs.shape[0], dtype=torch.int64)
    for j in range(probs.shape[1]):
        skips[:, j] = wanted[:, j] & (run < max_consecutive)
        run = torch.where(skips[:, j], run + 1, 0)
    return skips


@dataclass(frozen=True)
class SkipSetting:
    threshold: float  # confidence above which a layer is skipped
    max_consecutive: int = MAX_CONSECUTIVE

    @staticmethod
    def for_budget(profile: DepthProfile, budget: float, max_consecutive: int = MAX_CONSECUTIVE) -> SkipSetting:
        """The highest threshold whose skips on the held-out tokens read at most `budget` of the dense bytes."""
        threshold = bisect(lambda c: held_out_fraction(profile, c, max_consecutive), budget, rising=True,
                           what=f"predictive skip (at most {max_consecutive} layers in a row)")
        return SkipSetting(threshold, max_consecutive)

    def quality(self, profile: DepthProfile) -> dict[str, float]:
        """Precision and recall of its skips against the post-compute labels, and bytes, on the held-out tokens."""
        skips = skip_mask(profile.skip_probs, torch.full((profile.skip_probs.shape[1],), self.threshold),
                          self.max_consecutive)
        hits = int((skips & profile.skip_labels).sum())
        return {"precision": hits / max(int(skips.sum()), 1), "recall": hits / max(int(profile.skip_labels.sum()), 1),
                "skipped_share": float(skips.float().mean()),
                "bytes_fraction": held_out_fraction(profile, self.threshold, self.max_consecutive)}


def held_out_fraction(profile: DepthProfile, threshold: float, max_consecutive: int) -> float:
    later = profile.skip_probs.shape[1]
    skips = skip_mask(profile.skip_probs, torch.full((later,), threshold), max_consecutive)
    saved = (skips.double() @ torch.tensor(profile.layer_bytes[-later:], dtype=torch.float64)).mean()
    return 1.0 - float(saved) / profile.dense_bytes


@dataclass
class PredictedSkipPolicy(LoadPolicy):
    """Skips, per token, the later layers its predictor is confident about (see the module's doc).
    prompt_full_depth: forwards over more than one token compute every layer and adapt the thresholds (generation's
    prefill); False: every pass is decided token by token (teacher-forced scoring)."""

    profile: DepthProfile
    setting: SkipSetting
    prompt_full_depth: bool = True
    predictor: SkipPredictor = field(init=False)
    thresholds: torch.Tensor = field(init=False)  # [later]: this prompt's
    layer_bytes_read: list[int] = field(default_factory=list, init=False)  # per token decided: bytes it needed
    _skips: torch.Tensor | None = field(default=None, init=False)  # [T, later] bool for the current pass
    _probs: torch.Tensor | None = field(default=None, init=False)  # [T, later] of a prompt's prefill
    _full: bool = field(default=False, init=False)  # the current forward is a prompt's: it computes every layer
    _last_layer: int = field(default=-1, init=False)  # the last layer the current pass computed
    _device: torch.device = field(default=torch.device("cpu"), init=False)

    def __post_init__(self) -> None:
        self.predictor = SkipPredictor.from_state(self.profile.predictor)
        self.thresholds = torch.full((self.profile.n_layers - self.first,), self.setting.threshold)

    @property
    def first(self) -> int:
        """The first layer the predictor decides."""
        return self.profile.skip_after + 1

    def begin_forward(self, start_pos: int, n_tokens: int) -> None:
        # A forward over several tokens is a prompt's, all of whose chunks compute whole (a last chunk of 1 too).
        self._full = self.prompt_full_depth and n_tokens > 1

    def begin_pass(self, start_pos: int, n_tokens: int) -> None:
        if self._full and start_pos == 0:
            self.thresholds = torch.full_like(self.thresholds, self.setting.threshold)  # a new prompt
        self._skips, self._last_layer, self._probs = None, -1, None

    def decide(self, layer: int, ahead: int) -> LoadDecision:
        if self._skips is not None and layer > self._last_layer and layer >= self.first:
            return SKIP if bool(self._skips[:, layer - self.first].all()) else LOAD_ALL
        return LOAD_ALL  # not predicted yet (or for the next pass)

    def still_wanted(self, layer: int, decision: LoadDecision) -> bool:
        return self.decide(layer, 0).kind != "skip"

    def holds(self, layer: int) -> bool:
        """Reads of later layers (but the first, read on the chance it is needed) wait for the prediction."""
        return not self._full and self._skips is None and self._last_layer < layer and layer > self.first

    def tokens(self, layer: int) -> torch.Tensor | None:
        if self._skips is None or layer < self.first:
            return None
        skips = self._skips[:, layer - self.first]  # [T] on the host: no device sync to see that none skip
        return (~skips).to(self._device) if bool(skips.any()) else None

    def observe(self, obs: Observation) -> None:
        self._last_layer = obs.layer
        if obs.layer == self.profile.skip_after:
            self._device = obs.h_out.device
            probs = self.predictor(obs.h_out.cpu())  # [T, later]
            if self._full:
                self._probs = probs
                return
            self._skips = skip_mask(probs, self.thresholds, self.setting.max_consecutive)
            skipped = self._skips.double() @ torch.tensor(self.profile.layer_bytes[self.first:], dtype=torch.float64)
            self.layer_bytes_read += [self.profile.dense_bytes - int(s) for s in skipped]
        elif self._full and self._probs is not None and obs.layer >= self.first:
            # Strategy B: above the highest chance given to a prompt token this layer changed
            changed = F.cosine_similarity(obs.h_in, obs.h_out, dim=-1).cpu() <= SKIP_LABEL_COS
            j = obs.layer - self.first
            if changed.any():
                worst = float(self._probs[changed, j].max())
                self.thresholds[j] = max(float(self.thresholds[j]), min(worst + 1e-6, 1.0))

    def bytes_fraction(self) -> float:
        """Mean bytes per decided token over the dense bytes (what decoding each alone reads)."""
        n = len(self.layer_bytes_read)
        return sum(self.layer_bytes_read) / (n * self.profile.dense_bytes) if n else 1.0
