"""Speculative decoding: drafted tokens verified by the target in one forward pass.

When weights stream, a pass over T tokens costs about what a pass over one does (the bytes dominate), so each pass
should settle as many tokens as it can. Drafters propose chains of tokens that may follow the history; they are
merged into a token tree under the history's last token (a `DraftTree`: a chain is the tree with one branch), with
extra leaves where a drafter's second or third choice is likely enough to be worth a row of the pass. The target
runs the tree in one forward (each node attends to the history and its ancestors), walks it from the root taking
the child its own choice agrees with, keeps that branch's K/V and adds one token of its own: the correction where
no child agrees, or the token after an accepted leaf. A pass therefore yields 1 to depth + 1 tokens.

Drafters:
  * `PromptLookup`: the tokens that followed the latest earlier occurrence of the history's last n tokens (n from
    `max_ngram` down to 1): free, strong on text that copies from its context (code edits, quotes, summaries);
  * `DraftModel`: a small model with the target's vocabulary, run greedily (or sampling, with temperature) for k
    steps on its own KV cache, which keeps what the target accepted;
  * `self_draft.SelfDraft`: the target's own first layers and a calibrated exit head (self-speculation).
A lookup match is taken alone (it costs nothing) where lookup has paid better than the model's drafting, and, until
lookup's acceptance is measured (or with a fixed draft length), where it is `PREFERRED_LOOKUP` tokens or more;
otherwise the model drafts, and the lookup match joins the tree. How deep to draft and which extra leaves to add
follow the measured cost of a pass and the sources' measured acceptance (`DraftLength`, `grow`).

Exactness. Greedy: every position is decided by the target's own sampler on the target's own logits, and a verify
pass's node i is bit for bit the logits a one-token decode step gives at its position after its ancestors (the CPU
kernels' arithmetic per row does not depend on how many rows share a pass, a verify pass stays within their
KERNEL_ROWS, and attention adds the allowed positions in slot order, skipping the others), so the output is token
for token that of plain greedy decoding. Sampling: at each node the children are tried in turn (Leviathan et al.
2023, Chen et al. 2023; several candidates as in SpecInfer, Miao et al. 2024): a child x drawn from q is accepted
with probability min(1, p(x) / q(x)), else p becomes max(p - q, 0), normalized; a deterministic child (lookup, or a
drafter's next choice: a point mass) is accepted with probability p(x), else p becomes p with x removed,
normalized; when no child is accepted the token is drawn from what p has become. Each step leaves the emitted
token distributed exactly as the target's p (after its temperature, top-k, top-p and repetition penalty).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from ntio.decoding.generation import Sampler, greedy_token
from ntio.kernels.ops import KERNEL_ROWS
from ntio.runtime.engine import Engine

if TYPE_CHECKING:
    from ntio.decoding.self_draft import SelfDraft

# A lookup match this long is used alone even when a draft model is there, until lookup's acceptance is measured:
# copying is that likely to go on.
PREFERRED_LOOKUP = 3
# A verify pass is at most this many tokens: beyond it attention leaves the CPU kernel for torch's SDPA (and float32
# products for dequantized weights), whose rounding differs from a decode step's (greedy exactness needs the same
# bits).
MAX_DRAFT = KERNEL_ROWS - 1


@dataclass
class Draft:
    """A proposed chain from one source: tokens [k] after the history; probs [k, V]: the distribution each token
    was drawn from (None: deterministic, a point mass at each token); alternatives[i]: the drafter's next choices
    at step i, as (token, the drafter's probability that it is the right token when tokens[i] is not), most likely
    first (none for lookup); step_s: seconds per drafted token past the first (None: not measured)."""

    tokens: list[int]
    source: str
    probs: torch.Tensor | None = None
    alternatives: list[list[tuple[int, float]]] = field(default_factory=list)
    step_s: float | None = None


class DraftTree:
    """Tokens verified in one pass. Node 0 is the history's last token (the root); every other node is a drafted
    token whose parent is an earlier node. The pass puts node i at position root + depth(i), in cache slot
    root + i (`Engine.forward(parents=...)`).

    A node's children are its candidates, in the order the acceptance rule tries them: sampled ones (with the
    distribution q they were drawn from) before deterministic ones (q None: point masses). A token proposed twice
    under one parent is one node, with the sampled proposal's entry first. `chances[i]`: the estimated probability
    that the target accepts node i (what sizing the tree weighs); `chains[source]`: the nodes of that source's chain,
    in order."""

    def __init__(self, root: int) -> None:
        self.tokens = [root]
        self.parents = [-1]
        self.sources = [""]
        self.chances = [1.0]
        self.candidates: list[list[tuple[int, torch.Tensor | None]]] = [[]]
        self.chains: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, parent: int, token: int) -> int | None:
        return next((c for c, _ in self.candidates[parent] if self.tokens[c] == token), None)

    def add(self, parent: int, token: int, source: str, chance: float, q: torch.Tensor | None = None) -> int:
        """Node `token` under `parent` (an existing child of that token when there is one); returns its index."""
        entries = self.candidates[parent]
        node = self.child(parent, token)
        if node is None:
            node = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.sources.append(source)
            self.chances.append(chance)
            self.candidates.append([])
        else:
            self.chances[node] = max(self.chances[node], chance)
            if q is None and any(c == node and e is None for c, e in entries):
                return node  # already a point-mass candidate: a second test could not accept what the first rejected
        sampled = sum(e is not None for _, e in entries)
        entries.insert(sampled if q is not None else len(entries), (node, q))
        return node

    def add_chain(self, draft: Draft, chances: Sequence[float], parent: int = 0) -> list[int]:
        """The draft's tokens as a chain under `parent`, node j with chance chances[j]; returns its nodes."""
        nodes = []
        for j, token in enumerate(draft.tokens):
            q = draft.probs[j] if draft.probs is not None else None
            parent = self.add(parent, token, draft.source, chances[j], q)
            nodes.append(parent)
        self.chains[draft.source] = nodes
        return nodes

    def branch_tokens(self, nodes: Sequence[int]) -> list[int]:
        return [self.tokens[i] for i in nodes]


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


# Each pass multiplies what the estimates below remember by this: they follow what passes cost and drafts earn now.
DECAY = 0.8


class Acceptance:
    """How often each source's drafted tokens were accepted: a source's tokens are accepted with probability a each
    until the first rejection, estimated from decayed counts (DECAY per pass) with a prior of a = 1/2, so a source
    found useless is tried again now and then."""

    def __init__(self) -> None:
        self.counts: dict[str, list[float]] = {}  # source -> [accepted tokens, rejections], decayed

    def rate(self, source: str) -> float:
        accepted, rejected = self.counts.get(source, [0.0, 0.0])
        return (accepted + 1) / (accepted + rejected + 2)

    def measured(self, source: str) -> float | None:
        """The rate as measured, without the prior: accepted / (accepted + rejections), which the decay leaves as
        it is while a source goes unused; None before a pass verified any of its tokens."""
        accepted, rejected = self.counts.get(source, [0.0, 0.0])
        return accepted / (accepted + rejected) if accepted + rejected > 0 else None

    def measured_or_prior(self, source: str) -> float:
        """The rate as measured once there is one, else with its prior: what a chain joining another source's tree
        is priced at (at the prior's 1/2, slowly forgotten, a chain that is never right would keep taking rows)."""
        a = self.measured(source)
        return self.rate(source) if a is None else a

    def observe(self, verdicts: dict[str, tuple[int, int]]) -> None:
        """One pass's verdicts[source] = (tokens of its chain in the tree, how many of them were accepted)."""
        for counts in self.counts.values():
            counts[0] *= DECAY
            counts[1] *= DECAY
        for source, (drafted, accepted) in verdicts.items():
            if drafted:
                counts = self.counts.setdefault(source, [0.0, 0.0])
                counts[0] += accepted
                counts[1] += accepted < drafted

    def copy(self) -> Acceptance:
        record = Acceptance()
        record.counts = {source: list(counts) for source, counts in self.counts.items()}
        return record


class PassCost:
    """What a round costs: drafting for some seconds, then a pass over T rows, which takes the larger of its compute,
    c0 + c_row·T, and the time its reads still take.

    The compute is a line fitted to the passes timed less the time they waited on reads (`compute_line`), decayed
    (DECAY per pass); the reads' time is the decayed mean of the time reads were in flight. With resident weights
    there are no reads and a row costs c_row, a sizable part of a 1-row pass on the CPU. When weights stream, rows
    are free until the compute outlasts the reads, and cost c_row each past that (Qwen2.5-Coder-1.5B all-C on 2
    vCPUs: reads ~0.3 s a pass, the compute ~0.1 s at 1 row, crossing them at ~8 rows, ~30 ms a row past them). A
    line fitted to the passes' wall times cannot price a row at both ends.

    The reads go on while the draft drafts, as far as the loader's read-ahead holds them: `ahead`, the share of a
    pass's reads that can land before it begins (read-ahead groups over streamed groups, at most 1). Drafting then
    shortens what the pass waits for, and rows cost c_row where the compute outlasts the rest. (Counted as free
    beside the whole of the reads, the rows of leaves that were almost never accepted, lookup's chains on prose,
    took SmolLM2's all-C passes from 1.8x plain to 1.6x once its read-ahead covered the drafting.)"""

    def __init__(self, ahead: float = 0.0) -> None:
        self.ahead = ahead
        self.fit = [0.0] * 5  # decayed sums of 1, T, T^2, c, T*c over the passes, c = the pass's compute
        self.reads = 0.0  # decayed sum of the passes' read times (divided by fit[0], their mean)

    def observe(self, rows: int, seconds: float, waited: float = 0.0, reads: float = 0.0) -> None:
        """A pass over `rows` rows took `seconds`, of which the compute waited `waited` on reads that were in flight
        for `reads` seconds (the loader's io_wait_s and io_busy_s)."""
        compute = max(seconds - waited, 0.0)
        self.fit = [DECAY * v for v in self.fit]
        for i, v in enumerate((1.0, rows, rows * rows, compute, rows * compute)):
            self.fit[i] += v
        self.reads = DECAY * self.reads + reads

    def cost(self, rows: int, drafting: float = 0.0) -> float:
        """Seconds for `drafting` seconds of drafting, then a pass over `rows` rows; drafting + 1 before any pass,
        whatever the rows (every draft then looks free)."""
        if self.fit[0] == 0:
            return drafting + 1.0
        c0, c_row = self.compute_line
        reads = self.reads / self.fit[0]
        return drafting + max(c0 + c_row * rows, reads - min(drafting, self.ahead * reads), 1e-9)

    def row(self, rows: int, drafting: float = 0.0) -> float:
        """What one more row adds to a round of `drafting` seconds and a pass over `rows` rows."""
        return self.cost(rows + 1, drafting) - self.cost(rows, drafting)

    @property
    def compute_line(self) -> tuple[float, float]:
        """(c0, c_row): a pass's compute is c0 + c_row·T, both >= 0, fitted with c0 drawn towards 0 as if one more
        pass had computed nothing over no rows (ridge, RIDGE passes' weight). Passes of one length, or of lengths
        too close to tell a fixed cost from a row's, then give compute proportional to the rows, nearly right for
        the wide passes of a prompt, where a plain fit read an intercept of a second out of noise between 56- and
        64-row passes and so priced rows at almost nothing."""
        n, st, stt, sc, stc = self.fit
        det = (n + RIDGE) * stt - st * st
        if det <= 0:  # no rows in any pass
            return sc / (n + RIDGE), 0.0
        c0, c_row = (sc * stt - st * stc) / det, ((n + RIDGE) * stc - st * sc) / det
        if c0 < 0:
            return 0.0, stc / stt
        if c_row < 0:
            return sc / (n + RIDGE), 0.0
        return c0, c_row


# The weight of the pass of no rows and no compute that `PassCost` adds to its fit (DECAY keeps ~5 passes' weight):
# enough to settle 56- against 64-row passes (c_row 23 ms where a plain fit reads 12.5), while a fit of passes of
# well-spread lengths moves little (1- and 11-row passes of 0.2 and 0.3 s: 0.19 s for 1 row).
RIDGE = 0.05


# A drafter whose drafting has not paid for this many passes drafts two tokens, to time its drafting again (what
# it costs changes with what else the machine runs). A retry costs about a pass where drafting does not pay (Qwen2.5-
# Coder-1.5B resident beside its 0.5B draft): an earlier state retrying every 16 passes ran such decoding 5-11% below
# plain where this one is 1-6% below (benches/RESULTS.md, twenty-fourth session).
RETRY_PASSES = 64


class DraftLength:
    """How deep to draft: the chain length k that maximizes expected tokens per second of a pass, from what verify
    passes cost (`passes`), what drafting a token costs each source, and how often each source's tokens were
    accepted (`accepted`). A pass with k drafted tokens costs k times the source's cost per drafted token, then
    the pass over k + 1 rows (`PassCost.cost`, whose reads go on meanwhile), and settles 1 + a + ... + a^k tokens
    in expectation. `grow` sizes a tree's extra leaves with the same pass cost. fixed=True: always the most tokens
    asked for; ahead: as `PassCost` takes it. A source's cost per drafted token is the median of its last three
    timings; one priced out for RETRY_PASSES passes drafts two tokens to be timed again."""

    def __init__(self, *, fixed: bool = False, ahead: float = 0.0) -> None:
        self.fixed = fixed
        self.passes = PassCost(ahead)
        self.accepted = Acceptance()
        self.draft_times: dict[str, list[float]] = {}  # source -> its last three timings, seconds per drafted token
        self.idle: dict[str, int] = {}  # source -> passes since its drafting was last timed

    def draft_cost(self, source: str) -> float:
        """Seconds per token `source` drafts: the median of its last three timings (0 before any)."""
        times = self.draft_times.get(source)
        return statistics.median(times) if times else 0.0

    def choose(self, source: str, most: int) -> int:
        if self.fixed:
            return most
        rates = self._rates(source, most)
        k = max(range(most + 1), key=rates.__getitem__)
        if k == 0 and self.idle.get(source, 0) >= RETRY_PASSES:
            return min(2, most)  # priced out long enough: measure again what its drafting costs (two steps)
        return k

    def rate(self, source: str, most: int, a: float | None = None) -> float:
        """The expected tokens per second of a pass whose chain `source` drafts, as deep as pays, at most `most`
        (a: its acceptance, if not the source's record with its prior)."""
        return max(self._rates(source, most, a))

    def _rates(self, source: str, most: int, a: float | None = None) -> list[float]:
        """Expected tokens per second of a pass with k = 0..most tokens drafted by `source`."""
        a = self.accepted.rate(source) if a is None else a
        per_token = self.draft_cost(source)
        return [sum(a**i for i in range(k + 1)) / self.passes.cost(k + 1, k * per_token) for k in range(most + 1)]

    def observe(self, tokens: int, verify_s: float, verdicts: dict[str, tuple[int, int]],
                draft: tuple[str, int, float] | None, waited: float = 0.0, reads: float = 0.0) -> None:
        """A verify pass over `tokens` tokens took verify_s (waited and reads as `PassCost.observe` takes them);
        verdicts as `Acceptance.observe` takes them; draft = (the drafting source, tokens it drafted, seconds it
        took)."""
        self.passes.observe(tokens, verify_s, waited, reads)
        self.accepted.observe(verdicts)
        drafting = draft[0] if draft is not None and draft[1] else None
        if drafting is not None:
            # The median of the last three timings: one slow round (a garbage collection, the OS) does not move it,
            # where an even running mean took one 106 ms step among 11 ms ones as 58 ms and priced SmolLM2's
            # self-draft out of every later pass; a retry's timing replaces the stale ones.
            times = [] if self.idle.get(drafting, 0) >= RETRY_PASSES else self.draft_times.get(drafting, [])
            self.draft_times[drafting] = [*times[-2:], draft[2] / draft[1]]
        for source in self.draft_times:
            self.idle[source] = 0 if source == drafting else self.idle.get(source, 0) + 1


class PromptLookup:
    """Drafts from the history itself: what followed the latest earlier occurrence of its last n tokens."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram

    def match(self, history: Sequence[int], k: int) -> tuple[int, list[int]] | None:
        """(n, up to k tokens that followed the latest earlier occurrence of the history's last n tokens) for the
        largest n <= max_ngram that occurs; None when not even the last token does."""
        n_hist = len(history)
        for n in range(min(self.max_ngram, n_hist - 1), 0, -1):
            tail = list(history[n_hist - n :])
            # Latest start i < n_hist - n with history[i : i + n] == tail and at least one token after it.
            for i in range(n_hist - n - 1, -1, -1):
                if history[i] == tail[0] and list(history[i : i + n]) == tail:
                    return n, list(history[i + n : i + n + k])
        return None

    def propose(self, history: Sequence[int], k: int, min_ngram: int = 1) -> Draft | None:
        """The match's tokens as a draft, if its n is at least min_ngram."""
        found = self.match(history, k)
        return Draft(found[1], self.name) if found is not None and found[0] >= min_ngram else None


class DraftModel:
    """A small model's chain: k steps of its own sampler on its own engine (which must share the target's
    vocabulary). Its KV cache keeps the positions whose tokens the history still has."""

    name = "model"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def room(self, n_history: int) -> int:
        """Tokens the draft can still propose after a history of n_history (its context)."""
        return self.engine.kv.capacity + 1 - n_history  # the history, then k - 1 drafted tokens, in its cache

    def propose(self, history: Sequence[int], k: int, sampler: Sampler, branches: int = 0) -> Draft | None:
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

        return sample_chain(history, k, sampler, logits_after, self.name, branches)


def sample_chain(history: Sequence[int], k: int, sampler: Sampler,
                 logits_after: Callable[[int, int], torch.Tensor], source: str, branches: int = 0) -> Draft:
    """k tokens drawn one after another with the target's sampler: logits_after(i, t) [V] are the drafter's logits
    for token i, t being the token before it (the history's last for i = 0). Sampling records each distribution;
    `branches` > 0 records that many next choices per step (`Draft.alternatives`). The step time is measured on
    the steps after the first: the first also catches the drafter up on the history (after a new prompt, its whole
    prefill), which says nothing about what more steps cost."""
    seen = torch.tensor(history, dtype=torch.int64, device=sampler.generator.device)
    tokens, probs, alternatives = [], [], []
    sampling = sampler.params.temperature > 0
    token = history[-1]
    started = time.perf_counter()
    for i in range(k):
        if i == 1:
            started = time.perf_counter()
        token, p, choices = draw(sampler, logits_after(i, token), seen, branches)
        if sampling:
            probs.append(p)
        if branches:
            alternatives.append(choices)
        tokens.append(token)
        seen = torch.cat((seen, torch.tensor([token], dtype=torch.int64, device=seen.device)))
    step_s = (time.perf_counter() - started) / (k - 1) if k > 1 else None
    return Draft(tokens, source, torch.stack(probs) if sampling else None, alternatives, step_s)


def draw(sampler: Sampler, logits: torch.Tensor, seen: torch.Tensor, branches: int
         ) -> tuple[int, torch.Tensor | None, list[tuple[int, float]]]:
    """A drafter's next token from its logits [V] with the target's sampler (`seen`: the ids its repetition penalty
    counts): (the token, the distribution it was drawn from (None when greedy: a point mass), its `branches` next
    choices (`next_choices`; [] for none)). Greedy, the token is the sampler's own choice, bit for bit."""
    if sampler.params.temperature > 0:
        p = q = sampler.probabilities(logits, seen)
        token = int(torch.multinomial(p, 1, generator=sampler.generator))
    else:
        processed = sampler.processed(logits, seen)  # once: the argmax and the next choices come from it
        p, token = None, greedy_token(processed)
        q = processed.softmax(-1) if branches else None
    return token, p, next_choices(q, token, branches) if branches else []


def next_choices(q: torch.Tensor, chosen: int, n: int) -> list[tuple[int, float]]:
    """The n most likely tokens of q [V] besides `chosen`, each with q's probability that it is the right one when
    `chosen` is not: q(t) / (1 - q(chosen))."""
    rest = max(1.0 - float(q[chosen]), 1e-9)
    picks = [(t, min(1.0, v / rest)) for t, v in _largest(q, n + 1) if t != chosen and v > 0]
    return picks[:n]


def _largest(q: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The n largest entries of q [V] as (index, value), largest first. On the CPU as n argmax passes over a numpy
    copy: torch's topk(3) took ~160 us over a 49k vocabulary, three passes ~20 us."""
    if q.device.type != "cpu":
        values, indices = q.topk(n)
        return [(int(t), float(v)) for v, t in zip(values, indices)]
    left = q.numpy().copy()
    picks = []
    for _ in range(min(n, left.shape[0])):
        t = int(np.argmax(left))
        picks.append((t, float(left[t])))
        left[t] = -np.inf
    return picks


@dataclass
class Extra:
    """A leaf a tree may take: `token` from `source` under node `parent`, or under the node that extra number
    `after` (of the same list) became; `chance`: the estimated probability that the target accepts it."""

    chance: float
    token: int
    source: str
    parent: int = 0
    after: int | None = None


class Drafters:
    """The sources of one generation, merged into one tree per pass (`propose`): chains as deep as `length` finds
    worth a pass, and up to `branches` of a drafter's next choices per step as extra leaves, kept while they pay
    (`grow`)."""

    def __init__(self, lookup: PromptLookup | None, model: DraftModel | SelfDraft | None, length: DraftLength,
                 branches: int = 0) -> None:
        self.lookup, self.model, self.length, self.branches = lookup, model, length, branches

    def __bool__(self) -> bool:
        return self.lookup is not None or self.model is not None

    def propose(self, history: Sequence[int], most: int, room: int, sampler: Sampler
                ) -> tuple[DraftTree, tuple[str, int, float] | None]:
        """A tree under history[-1] at most `most` deep with at most `room` nodes besides the root, and (the
        source that drafted at a cost, tokens it drafted, seconds its steps took) for the cost estimates."""
        tree = DraftTree(history[-1])
        most = min(most, room)
        if most < 1:
            return tree, None
        found = self.lookup.match(history, most) if self.lookup is not None else None
        lookup = Draft(found[1], self.lookup.name) if found is not None else None
        if lookup is not None and (self.model is None
                                   or self._lookup_wins(lookup, most, long=found[0] >= PREFERRED_LOOKUP)):
            # Taken alone: it costs nothing, and has paid better than the model (or is long, before any measure).
            chain = lookup.tokens[: self.length.choose(lookup.source, len(lookup.tokens))]
            tree.add_chain(Draft(chain, lookup.source), self._chances(lookup.source, len(chain)))
            return tree, None
        k = self.length.choose(self.model.name, most) if self.model is not None else 0
        t0 = time.perf_counter()
        draft = self.model.propose(history, k, sampler, self.branches) if k else None
        spent = time.perf_counter() - t0  # this round's drafting, catching up included
        if draft is None:
            return tree, None
        a = self.length.accepted.rate(draft.source)
        nodes = tree.add_chain(draft, self._chances(draft.source, len(draft.tokens)))
        extras = []
        for j, choices in enumerate(draft.alternatives):
            reach = a**j * (1 - a)  # the chain reaches step j and its token there is rejected
            extras += [Extra(reach * r, t, draft.source + "-alt", nodes[j - 1] if j else 0) for t, r in choices]
        if lookup is not None:  # a match not taken alone: its chain may be right where the model's is not
            first = len(extras)
            chances = self._chances(lookup.source, len(lookup.tokens), measured=True)
            extras += [Extra(c, t, lookup.source, after=first + j - 1 if j else None)
                       for j, (c, t) in enumerate(zip(chances, lookup.tokens))]
        grow(tree, extras, room, self.length, spent)
        if draft.step_s is None:
            return tree, None
        return tree, (draft.source, len(draft.tokens), draft.step_s * len(draft.tokens))

    def _lookup_wins(self, lookup: Draft, most: int, long: bool) -> bool:
        """Whether a lookup match, alone, promises more tokens per second than the model's chain, by the model's
        cost per drafted token, its acceptance, and lookup's acceptance as measured: on text that copies its
        prompt, lookup chains are accepted as often as the model's and cost nothing, and drafting with the model
        beside them only adds its time (SmolLM2 all-C, rewrite prompts: lookup alone 3.6-4.1x plain, with
        self-speculation beside it 2.7-3.4x). Lookup's prior (1/2) does not count: free and accepted half the time,
        it would beat a model costing about a pass per chain, and on prose, where its chains are mostly wrong,
        take pass after pass from the model. Before any measure (or with a fixed length) a `long` match wins. Long
        matches are measured too: on code, SmolLM2's identifiers and indentation repeat, and matches of 3+ tokens
        taken alone were accepted so rarely (lookup alone: 1.19 tokens a pass) that self-speculation beside lookup
        made 3.0 tokens a pass against 3.9 alone."""
        measured = self.length.accepted.measured(lookup.source)
        if self.length.fixed or measured is None:
            return long
        return self.length.rate(lookup.source, len(lookup.tokens), measured) >= self.length.rate(self.model.name, most)

    def _chances(self, source: str, n: int, measured: bool = False) -> list[float]:
        """The chance that each of a chain's n tokens is accepted: by the source's rate with its prior, or with
        `measured`, by the rate measured once there is one. Lookup's chains joining a model's tree take the latter:
        at its prior's 1/2, slowly forgotten, a lookup chain that is never right (SmolLM2 on prose) kept taking
        rows, the trees grew from 7-10 rows to 12-17 and the model's chains shrank."""
        accepted = self.length.accepted
        a = accepted.measured_or_prior(source) if measured else accepted.rate(source)
        return [a ** (j + 1) for j in range(n)]


def grow(tree: DraftTree, extras: Sequence[Extra], room: int, length: DraftLength, spent: float = 0.0) -> None:
    """Adds extra leaves to the tree, likeliest first, each while it raises the round's expected tokens per second:
    (1 + the tree's summed chances) / (spent drafting, then the pass over its rows), the cost fitted by `length`
    (every extra, with length.fixed); at most `room` nodes besides the root. An extra whose `after` was not
    taken is not either; one already in the tree costs nothing."""
    # Likeliest first, but never before the extra it follows (`after` is an earlier index).
    rank: list[float] = []
    for extra in extras:
        rank.append(extra.chance if extra.after is None else min(extra.chance, rank[extra.after]))
    placed: dict[int, int] = {}  # extra's index -> its node
    for i in sorted(range(len(extras)), key=lambda i: -rank[i]):
        extra = extras[i]
        parent = extra.parent if extra.after is None else placed.get(extra.after)
        if parent is None:
            continue
        if tree.child(parent, extra.token) is None:
            cost, row = length.passes.cost(len(tree), spent), length.passes.row(len(tree), spent)
            if len(tree) > room or not length.fixed and extra.chance * cost < sum(tree.chances) * row:
                continue
        placed[i] = tree.add(parent, extra.token, extra.source, extra.chance)


def verify(rows: torch.Tensor, tree: DraftTree, sampler: Sampler, history: torch.Tensor) -> tuple[list[int], int]:
    """The target's verdict on a tree: rows [len(tree), V] are its logits after each node; returns (the accepted
    branch: nodes from the root's child down, the target's own next token after it)."""
    greedy = sampler.params.temperature == 0
    branch: list[int] = []
    node = 0
    while True:
        seen = torch.cat((history, torch.tensor(tree.branch_tokens(branch), dtype=torch.int64, device=history.device)))
        entries = tree.candidates[node]
        if greedy:
            token = sampler(rows[node], seen)
            child = next((c for c, _ in entries if tree.tokens[c] == token), None)
            if child is None:
                return branch, token
            branch.append(child)
            node = child
            continue
        p = sampler.probabilities(rows[node], seen)
        for child, q in entries:
            x = tree.tokens[child]
            q_x = float(q[x]) if q is not None else 1.0
            if float(torch.rand((), generator=sampler.generator)) * q_x < float(p[x]):
                break  # accepted with probability min(1, p(x) / q(x))
            residual = (p - q).clamp_min(0) if q is not None else p.clone()
            if q is None:
                residual[x] = 0.0
            total = float(residual.sum())
            if total > 0:  # else p <= q everywhere: only when p == q, where rejection has probability 0
                p = residual / total
        else:
            return branch, int(torch.multinomial(p, 1, generator=sampler.generator))
        branch.append(child)
        node = child


def verdicts(tree: DraftTree, branch: Sequence[int]) -> dict[str, tuple[int, int]]:
    """Per source: (tokens of its chain in the tree, how many of them lead the accepted branch), for
    `DraftLength.observe`."""
    accepted = set(branch)
    return {source: (len(nodes), next((j for j, n in enumerate(nodes) if n not in accepted), len(nodes)))
            for source, nodes in tree.chains.items()}


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
    """As `generation.generate_ids`, with each target pass verifying a tree at most `draft_tokens` deep (clipped to
    what is still wanted) of at most MAX_DRAFT tokens besides the root (clipped to the context left)."""
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
        # The pass puts history[-1] and the tree in slots len(history) - 1 ..: all must fit the context.
        root = len(history) - 1
        room = min(MAX_DRAFT, engine.kv.capacity - len(history))
        t0 = time.perf_counter()
        tree, drafted = drafters.propose(history, min(draft_tokens, max_new_tokens - generated - 1), room, sampler)
        t1 = time.perf_counter()
        rows = engine.forward(torch.tensor(tree.tokens, dtype=torch.int64, device=device), root, all_logits=True,
                              parents=tree.parents)
        history_ids = torch.tensor(history, dtype=torch.int64, device=device)
        branch, token = verify(rows, tree, sampler, history_ids)
        engine.kv.keep_branch(root, branch, tree.branch_tokens(branch))
        t2 = time.perf_counter()
        accepted = set(branch)
        # The pass's own figures from the loader (whose last record is this forward: the tree is one chunk).
        figures = engine.layers.stats.last()
        drafters.length.observe(len(tree), t2 - t1, verdicts(tree, branch), drafted, figures.io_wait_s,
                                figures.io_busy_s)
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.passes += 1
        stats.tokens += len(branch) + 1
        for node, source in enumerate(tree.sources[1:], 1):
            stats.drafted[source] = stats.drafted.get(source, 0) + 1
            stats.accepted[source] = stats.accepted.get(source, 0) + (node in accepted)
        pending = tree.branch_tokens(branch) + [token]
