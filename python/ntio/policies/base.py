"""The load-policy seam: what the loader reads for each layer, decided before the read is submitted.

The loader asks `decide(layer, ahead)` when it is about to submit a layer's read: for a streamed layer, `ahead`
streamed groups (of the loader's `group_size` layers) compute before it, at most the read-ahead depth; for a resident
layer, or a streamed one needed at once, ahead = 0 and the layer computes next. The answer is one of:
  * `LOAD_ALL`: the whole layer (dense streaming);
  * `SKIP`: nothing; the layer is not computed, the residual stream passes through, and the KV cache marks the
    positions as skipped for that layer;
  * `LoadDecision.ffn_rows(ranges)`: the whole layer except the FFN gate/up matrices, of which only the neuron
    (row) ranges given are read; the FFN computes only those neurons (exact for them: the others count as 0);
  * `DOWN_LATER`: the whole layer except its FFN down matrix. Once gate and up are computed and `ffn_mask` has
    chosen each token's neurons, the FFN reads the groups of down its tokens keep from the store's group-major copy
    (`convert --layout ffn-groups`) and multiplies only those. The loader reads a resident layer whole whatever
    the answer (its down is in memory: the mask alone applies), and so where the file has no group copy.
  * `UP_LATER`: the whole layer except its FFN up and down matrices. Once the attention and the gate products
    are computed, `ffn_mask` chooses each token's groups from them (called with up = None), and the FFN reads the
    up rows and the down groups of the groups its tokens keep (seed 002's order of reads).
  * `FFN_LATER`: the whole layer except its FFN gate, up and down matrices. Once the attention is computed,
    `ffn_mask` chooses each token's groups without them (called with gate = up = None), and the FFN reads the gate
    and up rows and the down groups of the groups its tokens keep, and computes only those. Where the policy knows
    them earlier (`ahead_groups`), the loader reads them while the layer before computes. As for
    `DOWN_LATER`, a resident layer and a file without the FFN layout read the layer whole.
The horizon is explicit: the loader sets `horizon` to the largest `ahead` it will ever pass (its prefetch depth), so
a policy knows how stale its observations may be when it decides. After a layer computes, the engine calls `observe(...)` with what it saw
(the hidden state in and out; the FFN gate pre-activations [T, F] when `wants_ffn_gate`).

When a layer is about to compute, the loader asks `still_wanted(layer, decision)`: a policy that has changed its
mind about a prefetched read answers False, and the layer is skipped without waiting for that read. The engine then
asks `ffn_mask(layer)`: a function from the FFN's input and its gate and up pre-activations to the neurons each token
keeps (ntio.policies.sparse_ffn), or None to keep all.

Per-token depth (ntio.policies.layer_skip, early_exit, cosine_skip). A pass over T tokens reads a layer once for all
of them, but each token may take its own path, as decoding it alone would:
  * `begin_forward(start_pos, n_tokens)` opens each forward (a prompt's, a decode step's), `begin_pass(start_pos,
    n_tokens)` each of its passes (chunks of at most the engine's prefill_chunk tokens);
  * `tokens(layer)`: [T] bool, the tokens that compute a layer that loads; the others pass through it and leave no
    K/V there (the cache marks them skipped and attention masks them out, as for a layer skipped whole);
  * `revert(layer, h_in, h_out)`: [T] bool, tokens whose update by the layer just computed is discarded (their
    K/V stay): a post-compute skip, which saves no bytes;
  * `readout(h)`: the final hidden states [T, D] -> what the final norm and output head read (an exit head's map
    for a token that left early).
The engine asks each only of a policy that overrides it. Such a policy may also hold reads ahead (`holds(layer)`):
a read submitted before the decision it depends on is known comes off the disk even when the layer is then
skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LoadDecision:
    kind: str  # "all" | "skip" | "rows" | "down_later" | "up_later" | "ffn_later"
    rows: tuple[tuple[int, int], ...] = ()  # "rows": sorted, disjoint [start, stop) FFN neuron ranges

    @staticmethod
    def ffn_rows(ranges: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> LoadDecision:
        rows = tuple(sorted((int(a), int(b)) for a, b in ranges))
        for (a, b), nxt in zip(rows, rows[1:] + ((None, None),)):
            if not 0 <= a < b or (nxt[0] is not None and nxt[0] < b):
                raise ValueError(f"FFN row ranges must be non-empty, sorted and disjoint, got {list(rows)}")
        return LoadDecision("rows", rows)


# (x, gate, up): the FFN's input [T, D] (after its norm) and its gate and up pre-activations [T, F] -> [T, F] bool,
# the FFN neurons each token keeps; the others count as 0.
FFNMask = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

LOAD_ALL = LoadDecision("all")
SKIP = LoadDecision("skip")
DOWN_LATER = LoadDecision("down_later")
UP_LATER = LoadDecision("up_later")
FFN_LATER = LoadDecision("ffn_later")


@dataclass
class Observation:
    layer: int
    start_pos: int  # positions start_pos .. start_pos+T-1
    h_in: torch.Tensor  # [T, D] residual stream entering the layer
    h_out: torch.Tensor  # [T, D] leaving it (h_in itself when the layer was skipped)
    decision: LoadDecision
    ffn_gate: torch.Tensor | None = None  # [T, F] gate pre-activations, when the policy wants them and the FFN ran


@dataclass
class LoadPolicy:
    """Base policy: loads everything (subclasses override decide / observe). `horizon` is set by the loader."""

    horizon: int = field(default=0, init=False)
    wants_ffn_gate: bool = field(default=False, init=False)

    def decide(self, layer: int, ahead: int) -> LoadDecision:
        return LOAD_ALL

    def still_wanted(self, layer: int, decision: LoadDecision) -> bool:
        return True

    def ffn_mask(self, layer: int) -> FFNMask | None:
        return None

    def observe(self, obs: Observation) -> None:
        pass

    def ahead_groups(self, layer: int) -> list[int] | None:
        """The FFN groups of `layer` (a streamed "ffn_later" layer) that some token of the pass will keep, where the
        policy knows them before the layer computes: the loader reads them ahead. None: not known yet."""
        return None

    def holds(self, layer: int) -> bool:
        """Whether a read of `layer` ahead of its need should wait: its decision depends on an observation not made
        yet (an exit or a prediction in the current pass). A held read is submitted when the layer is needed."""
        return False

    def begin_forward(self, start_pos: int, n_tokens: int) -> None:
        pass

    def begin_pass(self, start_pos: int, n_tokens: int) -> None:
        pass

    def tokens(self, layer: int) -> torch.Tensor | None:
        return None

    def revert(self, layer: int, h_in: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor | None:
        return None

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        return h


def overrides(policy: LoadPolicy, method: str) -> bool:
    """Whether `policy` overrides the base policy's `method` (the engine asks only then: no work per layer else)."""
    return getattr(type(policy), method) is not getattr(LoadPolicy, method)
