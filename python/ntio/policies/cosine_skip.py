"""Post-compute cosine skip, the ntransformer baseline (issue 14): a layer whose output is nearly its input is replaced
by its input for that token.

Per token and layer, after the layer has computed: when cos(h_in, h_out) > threshold, the token keeps h_in. Its K/V
for the layer were written and stay. Every byte is read and every layer computed, so it saves nothing on its own; it
is the baseline the policies that decide before the load (ntio.policies.layer_skip, early_exit) are priced against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ntio.policies.base import LoadPolicy


@dataclass
class CosineSkipPolicy(LoadPolicy):
    """Reads everything; discards a token's update by a layer when cos(h_in, h_out) > threshold."""

    threshold: float = 0.98
    # (token, layer) pairs seen and reverted, the latter a 0-d tensor on the compute device until `reverted_share`
    # reads it (no host sync per layer)
    _seen: int = field(default=0, init=False)
    _reverted: torch.Tensor | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"cosine skip threshold must be in [-1, 1], got {self.threshold}")

    def revert(self, layer: int, h_in: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
        back = F.cosine_similarity(h_in, h_out, dim=-1) > self.threshold  # [T]
        self._seen += back.shape[0]
        self._reverted = back.sum() if self._reverted is None else self._reverted + back.sum()
        return back

    def reverted_share(self) -> float:
        """The share of (token, layer) pairs whose update was discarded."""
        return float(self._reverted) / self._seen if self._seen else 0.0
