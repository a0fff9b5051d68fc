"""Speculative decoding: greedy output identical to plain greedy decoding (prompt lookup on SmolLM2, the real
Qwen2.5-Coder 0.5B -> 1.5B draft pair with token trees; resident and streamed), token-tree passes against
decoding each branch token by token, the (multi-candidate) sampling acceptance rule against the target's own
distribution, statistics, and bad input."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import ntio
from ntio.cli import main
from ntio.decoding.generation import Sampler, SamplingParams
from ntio.decoding.speculative import (PREFERRED_LOOKUP, RETRY_PASSES, Draft, Drafters, DraftLength, DraftTree, Extra,
                                      PassCost, PromptLookup, grow, sample_chain, verify)
from ntio.errors import NtioError, OptionError
from ntio.kernels import ops
from ntio.models.layers import causal_mask, token_positions, tree_depths

PROMPTS = [
    "Rewrite this sentence in the past tense: 'The cat sits on the mat while the dog runs in the park.'",
    "Write a Python function that returns the sum of the squares of a list of numbers.",
    "List the days of the week, one per line.",
    "What is the capital of France? Answer in one sentence.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    "Explain in two sentences why the sky is blue.",
    "Fix the bug: def add(a, b): return a - b",
    "Count from 1 to 20, separated by commas.",
]
CODE_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a C function that reverses a singly linked list.",
    "Write a JavaScript function that debounces another function.",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return ntio.load(smollm2_path)


@pytest.mark.parametrize("tiers", ["auto", "C", "A:0-9,C:10-29"])
def test_greedy_with_prompt_lookup_is_token_for_token_plain_greedy(smollm2_path, tiers):
    m = ntio.load(smollm2_path, tiers=tiers)
    drafted = accepted = 0
    for prompt in PROMPTS if tiers == "auto" else PROMPTS[::3]:  # streamed tiers: the same drafts, fewer prompts
        ids = m.encode_prompt(prompt, chat=True)
        plain = m.generate(ids, 48)
        assert m.generate(ids, 48, lookup=True).token_ids == plain.token_ids, prompt
        fixed = m.generate(ids, 48, lookup=True, adaptive_draft=False)
        assert fixed.token_ids == plain.token_ids, prompt
        assert plain.speculation is None
        drafted += sum(fixed.speculation["drafted"].values())
        accepted += sum(fixed.speculation["accepted"].values())
    m.close()
    # The drafts were real: many tokens drafted, many accepted, some rejected (both verdicts were exercised). Counted
    # on the fixed-length drafts: the adaptive chooser's lengths follow measured pass times, so its counts vary.
    assert 0 < accepted < drafted
    if tiers == "auto":
        assert drafted > 40 and accepted > 20


@pytest.mark.parametrize("tiers", ["auto", "C"])
def test_greedy_with_the_qwen_draft_model_is_token_for_token_plain_greedy(qwen15_path, qwen05_path, tiers):
    m = ntio.load(qwen15_path, draft=qwen05_path, tiers=tiers)
    assert m.draft is not None and m.draft.tokenizer is m.tokenizer
    for prompt in CODE_PROMPTS[:1]:
        ids = m.encode_prompt(prompt, chat=True)
        plain = m.generate(ids, 40, use_draft=False)
        # Every pass drafts a tree (the model's chain, its next two choices per step, a short lookup match): all
        # paths exercised.
        spec = m.generate(ids, 40, lookup=True, adaptive_draft=False)
        assert spec.token_ids == plain.token_ids, prompt
        sp = spec.speculation
        assert sp["drafted"].get("model", 0) > 0 and sp["accepted"]["model"] <= sp["drafted"]["model"]
        assert 0 < sp["drafted"]["model-alt"] <= 2 * sp["drafted"]["model"]  # some merge with lookup nodes
        assert sp["tokens"] == sum(sp["accepted"].values()) + sp["passes"]
        assert m.generate(ids, 40, lookup=True, branches=0, adaptive_draft=False).token_ids == plain.token_ids
    m.close()


# A token tree under the root (node 0): parents[i] is node i's parent.
TREE = [-1, 0, 1, 2, 0, 4, 1, 6, 6, 3, 9, 5]
# As the bench's trees are: a chain of 8 and two more choices at each of its steps, as leaves.
LEAVES = [-1, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 1, 0, 3, 3, 2, 2, 4, 4, 5, 5, 6, 7, 7, 6]


def _branch(node: int, tree: list[int] = TREE) -> list[int]:
    """The nodes from the root's child down to `node` in `tree`."""
    return [] if node == 0 else _branch(tree[node], tree) + [node]


def test_the_kernels_find_a_tree_in_its_mask():
    """The tree a mask describes (`ops.tree_parents`), which the CPU kernels take to follow positions: a tree's
    parents; None for a sequence, and for a mask that hides a position from a token but not from its parent."""
    assert ops.tree_parents(causal_mask(5, len(TREE), "cpu", TREE), 5) == TREE
    assert ops.tree_parents(causal_mask(5, len(LEAVES), "cpu", LEAVES), 5) == LEAVES
    assert ops.tree_parents(causal_mask(5, 4, "cpu", [-1, 0, 1, 2]), 5) is None
    assert ops.tree_parents(causal_mask(5, 4, "cpu"), 5) is None
    skipped = causal_mask(5, len(TREE), "cpu", TREE).clone()
    skipped[10, 5 + 3] = False  # node 3, an ancestor of node 10 (and of its parent, 9), hidden from node 10 alone
    assert ops.tree_parents(skipped, 5) is None


def test_tree_positions_and_mask_follow_the_ancestry():
    assert token_positions(10, len(TREE), TREE, "cpu").tolist() == [10, 11, 12, 13, 11, 12, 12, 13, 13, 14, 15, 13]
    mask = causal_mask(3, len(TREE), "cpu", TREE)
    assert mask.shape == (len(TREE), 3 + len(TREE)) and mask[:, :3].all()
    for i in range(len(TREE)):
        assert {j for j in range(len(TREE)) if mask[i, 3 + j]} == {0, *_branch(i)}, i
    with pytest.raises(ValueError, match="parent"):
        causal_mask(0, 3, "cpu", [-1, 2, 0])


@pytest.mark.parametrize("tree, extra", [(TREE, 0), (TREE, 6), (LEAVES, 0), (LEAVES, 6)])
def test_a_tree_pass_gives_each_node_the_logits_of_decoding_its_branch(smollm2, tree, extra):
    """Each node of a tree, verified in one pass, gets bit for bit the logits that decoding the tokens of its
    branch one at a time gives, whichever cache slots it and its ancestors sit in (each at root + its index, not at
    its position). Roots at the prompt's end and `extra` tokens later."""
    e = smollm2.engine
    ids = smollm2.encode_prompt(PROMPTS[2], chat=True) + smollm2.encode_prompt(PROMPTS[0])[:extra]
    tokens = smollm2.encode_prompt(" ".join(PROMPTS))[: len(tree)]
    e.forward(torch.tensor(ids[:-1]), 0)
    root = len(ids) - 1
    tree_tokens = [ids[-1]] + tokens[1:]
    rows = e.forward(torch.tensor(tree_tokens), root, all_logits=True, parents=tree)
    assert e.kv.length == root + 1  # only the root is a valid position until a branch is kept
    for node in range(len(tree)):
        branch = [tree_tokens[i] for i in [0, *_branch(node, tree)]]
        sequential = [e.forward(torch.tensor([t]), root + i) for i, t in enumerate(branch)][-1]
        assert torch.equal(rows[node], sequential), f"node {node}"


def test_a_kept_branch_leaves_what_decoding_it_writes(smollm2):
    """Keeping a branch of a verified tree leaves the K/V that decoding it writes, and the next step's logits are
    those of the sequential run."""
    e = smollm2.engine
    ids = smollm2.encode_prompt(PROMPTS[2], chat=True)
    tokens = smollm2.encode_prompt(" ".join(PROMPTS))[: len(TREE)]
    e.forward(torch.tensor(ids[:-1]), 0)
    root = len(ids) - 1
    tree_tokens = [ids[-1]] + tokens[1:]
    # Keep the branch to node 10 (nodes 1, 2, 3, 9, 10: slots move) and step once more.
    kept = _branch(10)
    e.forward(torch.tensor(tree_tokens), root, all_logits=True, parents=TREE)
    e.kv.keep_branch(root, kept, [tree_tokens[i] for i in kept])
    assert e.kv.ids == ids + [tree_tokens[i] for i in kept]
    end = e.kv.length
    k, v = e.kv.k[:, :, :end].clone(), e.kv.v[:, :, :end].clone()
    after_tree = e.forward(torch.tensor([tokens[0]]), end)
    e.forward(torch.tensor([tree_tokens[i] for i in [0, *kept]]), root)  # the branch decoded as a sequence
    assert torch.equal(e.kv.k[:, :, :end], k) and torch.equal(e.kv.v[:, :, :end], v)
    assert torch.equal(e.forward(torch.tensor([tokens[0]]), end), after_tree)
    with pytest.raises(ValueError, match="branch"):
        e.kv.keep_branch(root, [1], [tokens[1]])  # no tree pass since: nothing to keep


def test_a_pass_gives_each_token_a_decode_steps_logits_bit_for_bit(smollm2):
    """What greedy exactness rests on: the CPU kernels' rows do not depend on how many tokens share a pass (up to
    KERNEL_ROWS, attention included: 40 tokens here, beyond the kernels' 32-row blocks)."""
    e = smollm2.engine
    ids = smollm2.encode_prompt(PROMPTS[1], chat=True)
    follow = smollm2.encode_prompt(" ".join(PROMPTS[:5]))[:40]
    assert len(follow) == 40
    e.forward(torch.tensor(ids), 0)
    steps = [e.forward(torch.tensor([t]), len(ids) + i) for i, t in enumerate(follow)]
    e.forward(torch.tensor(ids), 0)
    rows = e.forward(torch.tensor(follow), len(ids), all_logits=True)
    for i, step in enumerate(steps):
        assert torch.equal(rows[i], step), f"row {i}"


def _first_token_frequencies(p_logits, trees, trials, seed):
    """Frequencies of the first token `verify` emits for the trees trees(generator) (each a root with children),
    against rows whose every row has logits p_logits."""
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=6, seed=seed))
    history = torch.tensor([1, 2, 3])
    counts = torch.zeros_like(p_logits)
    for _ in range(trials):
        tree = trees(sampler.generator)
        rows = p_logits.expand(len(tree), -1)
        branch, token = verify(rows, tree, sampler, history)
        counts[tree.tokens[branch[0]] if branch else token] += 1
    return counts / trials


def _tree(children):
    """A root (token 0) with children [(token, q or None)], in that order."""
    tree = DraftTree(0)
    for token, q in children:
        tree.add(0, token, "test", 1.0, q)
    return tree


def test_speculative_sampling_keeps_the_targets_distribution(smollm2):
    """SmolLM2's real next-token distribution p (temperature 1, top-k 6) and a draft distribution q that prefers
    what p finds unlikely: tokens emitted through the acceptance rule follow p, not q, within sampling noise (total
    variation over 20,000 draws) — for one sampled child, one deterministic child, and several candidates under
    one node (a sampled child, then deterministic next choices, one of which may repeat the sampled token). A rule
    that accepted every draft would give q."""
    e = smollm2.engine
    # The 64 largest logits only (top-k 6 keeps the same distribution): sampling over 64 tokens is quick.
    p_logits = e.forward(torch.tensor(smollm2.encode_prompt("My favourite colour is")), 0).topk(64).values
    p = Sampler(SamplingParams(temperature=1.0, top_k=6)).probabilities(p_logits, torch.tensor([1, 2, 3]))
    support = p.topk(6).indices
    q = torch.zeros_like(p)
    q[support] = p[support].flip(0)
    assert 0.5 * float((q - p).abs().sum()) > 0.2
    trials = 20_000

    def sampled(g):
        return int(torch.multinomial(q, 1, generator=g))

    second, last = int(support[1]), int(support[5])
    cases = {
        "one sampled child": lambda g: _tree([(sampled(g), q)]),
        "one deterministic child (prompt lookup: a point mass)": lambda g: _tree([(second, None)]),
        "a sampled child, then two deterministic ones": lambda g: _tree([(sampled(g), q), (second, None),
                                                                         (last, None)]),
        "deterministic children only": lambda g: _tree([(last, None), (second, None)]),
    }
    for seed, (case, trees) in enumerate(cases.items()):
        freq = _first_token_frequencies(p_logits, trees, trials, seed)
        assert 0.5 * float((freq - p).abs().sum()) < 0.02, case


def test_a_tree_tries_sampled_candidates_first_and_merges_repeated_tokens():
    q = torch.full((8,), 1 / 8)
    tree = DraftTree(0)
    assert tree.add(0, 5, "lookup", 0.5) == 1
    assert tree.add(0, 5, "model", 0.7, q) == 1  # the same token: one node, its sampled entry tried first
    assert tree.add(0, 6, "model-alt", 0.1) == 2
    assert tree.add(0, 5, "lookup", 0.2) == 1
    assert [(c, e is not None) for c, e in tree.candidates[0]] == [(1, True), (1, False), (2, False)]
    assert tree.chances == [1.0, 0.7, 0.1] and tree_depths(tree.parents) == [0, 1, 1]
    assert tree.sources == ["", "lookup", "model-alt"]


def test_extra_leaves_are_kept_while_they_raise_the_expected_tokens_per_second():
    """A pass costing 0.2 s plus 0.01 s per row past the first: with a chain of two likely tokens (expected 2.71
    tokens a pass), a leaf pays when its chance exceeds 2.71 x 0.01 / the pass's cost, ~0.12: 0.5 does, 0.01 does
    not. Fixed drafting takes every leaf the room allows; a leaf under one not taken is not taken either."""
    length = DraftLength()
    for _ in range(4):
        length.observe(1, 0.2, {}, None)
        length.observe(11, 0.3, {}, None)
    assert length.passes.cost(1) == pytest.approx(0.2, rel=0.1)
    assert length.passes.row(1) == pytest.approx(0.01, rel=0.1)

    def tree_with(extras, room, length):
        tree = DraftTree(0)
        tree.add_chain(Draft([10, 11], "model"), [0.9, 0.81])
        grow(tree, extras, room, length)
        return sorted(tree.tokens[3:])

    extras = [Extra(0.01, 21, "model-alt", 1), Extra(0.5, 20, "model-alt"), Extra(0.005, 22, "lookup", after=0)]
    assert tree_with(extras, 8, length) == [20]
    assert tree_with(extras, 8, DraftLength(fixed=True)) == [20, 21, 22]
    assert tree_with(extras, 3, DraftLength(fixed=True)) == [20]
    assert tree_with([extras[1], Extra(0.9, 23, "lookup", after=0)], 8, DraftLength(fixed=True)) == [20, 23]


def test_a_streamed_pass_prices_rows_by_its_compute_above_its_reads():
    """Passes as Qwen2.5-Coder-1.5B all-C measured them on 2 vCPUs (wall, waited on reads, reads in flight): 1 row
    0.294 / 0.188 / 0.279 s, 16 rows 0.666 / 0.001 / 0.400 s. The compute (wall - waited) is 0.069 s + 37.3 ms a
    row; the reads take ~0.34 s: rows are free up to the crossing at ~7 rows and cost 37 ms each past it. A line
    through the wall times would price every row at 25 ms."""
    cost = PassCost()
    for _ in range(4):
        cost.observe(1, 0.294, 0.188, 0.279)
        cost.observe(16, 0.666, 0.001, 0.400)
    assert 0.34 < cost.cost(1) == cost.cost(4) < 0.36 and cost.row(1) == cost.row(4) == 0.0
    assert cost.cost(16) == pytest.approx(0.665, rel=0.02) and cost.row(16) == pytest.approx(0.0373, rel=0.05)
    # Resident passes read nothing: the compute alone.
    resident = PassCost()
    for _ in range(4):
        resident.observe(1, 0.05)
        resident.observe(9, 0.13)
    assert resident.cost(1) == pytest.approx(0.05, rel=0.05) and resident.row(3) == pytest.approx(0.01, rel=0.05)


def test_passes_of_nearly_one_length_price_a_row_at_its_share_of_the_pass():
    """Prompt chunks fill a server's passes: 64 rows, then 56, 1.6 s and 1.5 s. A straight line through them reads
    12.5 ms a row and 0.8 s for a pass over none, so 8 rows would look almost free; the fit draws the fixed cost
    towards 0 and prices a row near 1.6 s / 64 = 25 ms."""
    cost = PassCost()
    for seconds in (1.6, 1.55, 1.65, 1.6):
        cost.observe(64, seconds)
    cost.observe(56, 1.5)
    assert cost.row(8) == pytest.approx(0.025, rel=0.1) and cost.cost(8) < 0.4  # a plain fit: 0.9 s


def test_a_streamed_pass_takes_the_leaves_its_reads_leave_free():
    """Below the reads' time a leaf costs nothing, so a tree takes even unlikely ones (while it has room); once the
    compute outlasts the reads, a leaf must pay for its row as with resident weights."""
    streamed = DraftLength()
    streamed.observe(1, 0.30, {}, None, waited=0.25, reads=0.3)
    streamed.observe(11, 0.40, {}, None, waited=0.0, reads=0.3)  # compute 0.05 s + 0.035 s a row
    tree = DraftTree(0)
    tree.add_chain(Draft([10, 11], "model"), [0.9, 0.81])
    grow(tree, [Extra(0.01, 20 + i, "model-alt", 2) for i in range(12)], 12, streamed)
    # The crossing: 0.05 + 0.035 (T - 1) = 0.3 at T ~ 8; rows up to 8 are free, past it 0.01 does not pay.
    assert len(tree) == 8


def test_reads_that_go_on_while_the_draft_drafts_leave_the_pass_the_rest():
    """Where the read-ahead holds the whole pass (ahead 1), 0.25 s of drafting leaves 0.05 s of the 0.3 s of reads,
    which the compute outlasts: a round costs the drafting plus the compute, and every row costs its compute. Where
    it holds a fifth of the pass, 0.06 s of the reads land early and rows are free up to a compute of 0.24 s.
    Without read-ahead (ahead 0) the drafting comes on top of all the reads."""
    rounds = {}
    for ahead in (1.0, 0.2, 0.0):
        rounds[ahead] = length = DraftLength(ahead=ahead)
        length.observe(1, 0.30, {}, None, waited=0.25, reads=0.3)
        length.observe(11, 0.40, {}, None, waited=0.0, reads=0.3)  # compute 0.05 s + 0.035 s a row
    whole, fifth, none = (rounds[a].passes for a in (1.0, 0.2, 0.0))
    assert whole.cost(3, 0.25) == pytest.approx(0.25 + 0.05 + 0.035 * 2, rel=0.05)
    assert whole.row(3, 0.25) == pytest.approx(0.035, rel=0.05)
    assert fifth.cost(3, 0.25) == pytest.approx(0.25 + 0.24, rel=0.02) and fifth.row(3, 0.25) == 0.0
    assert none.cost(3, 0.25) == pytest.approx(0.25 + 0.3, rel=0.02) == none.cost(3) + 0.25
    tree = DraftTree(0)
    tree.add_chain(Draft([10, 11], "model"), [0.9, 0.81])
    grow(tree, [Extra(0.01, 20 + i, "model-alt", 2) for i in range(12)], 12, rounds[1.0], spent=0.25)
    assert len(tree) == 3  # no unlikely leaf pays for its row


def test_one_slow_draft_does_not_price_a_drafter_out_for_good():
    """Passes of 30 ms + 1 ms a row, drafts accepted 9 times in 10, 10 ms a drafted token: a chain of 5 pays best.
    One round at 1 s a token (a collection, say) leaves the estimate (the median of three timings) where it was, not
    at the 0.5 s an even mean gives, and two such rounds move it; a drafter priced out anyway drafts two tokens again
    after RETRY_PASSES passes, and chains once those are timed at 10 ms a token (the stale timings replaced)."""
    length = DraftLength()
    for _ in range(6):
        length.observe(1, 0.031, {"model": (8, 8)}, ("model", 4, 0.04))
        length.observe(9, 0.039, {"model": (10, 9)}, ("model", 4, 0.04))
    assert length.draft_cost("model") == pytest.approx(0.01) and length.choose("model", 8) == 5
    length.observe(9, 0.039, {"model": (10, 9)}, ("model", 4, 4.0))
    assert length.draft_cost("model") == pytest.approx(0.01) and length.choose("model", 8) == 5
    length.observe(9, 0.039, {"model": (10, 9)}, ("model", 4, 8.0))
    assert length.draft_cost("model") == 1.0 and length.choose("model", 8) == 0
    for _ in range(RETRY_PASSES):
        assert length.choose("model", 8) == 0
        length.observe(1, 0.031, {}, None)
    assert length.choose("model", 8) == 2
    length.observe(3, 0.033, {"model": (2, 2)}, ("model", 2, 0.02))
    assert length.draft_cost("model") == pytest.approx(0.01) and length.idle["model"] == 0
    assert length.choose("model", 8) >= 2  # on its price, no longer a retry


def test_a_drafts_step_cost_leaves_out_catching_up_on_the_history():
    """The first step of a draft also runs the drafter over what it has not seen (a new prompt's prefill): the
    cost per drafted token that sizes drafts comes from the later steps only."""
    import time

    def logits_after(i, token):
        time.sleep(0.3 if i == 0 else 0.01)
        return torch.tensor([0.0, 1.0, 0.0])

    draft = sample_chain([0], 3, Sampler(SamplingParams()), logits_after, "model")
    assert draft.tokens == [1, 1, 1] and 0.01 <= draft.step_s < 0.1
    assert sample_chain([0], 1, Sampler(SamplingParams()), logits_after, "model").step_s is None


class _CountingModel:
    """A drafting model that proposes token 7, k times, and counts its calls."""

    name = "model"

    def __init__(self):
        self.calls = 0

    def propose(self, history, k, sampler, branches=0):
        self.calls += 1
        return Draft([7] * k, self.name)


def _lookup_or_model(records: dict[str, tuple[int, int]], history: list[int],
                     lookup_passes: int = 6) -> tuple[list[str], int]:
    """(The sources of the tree drafted after `history`, the model's calls) by lookup beside a model drafting at 20 ms
    a token, passes at 30 ms + 5 ms a row, after six passes with verdicts `records` (source: (drafted, accepted)),
    lookup's only in the first `lookup_passes`."""
    length = DraftLength()
    for i in range(6):
        verdicts = {s: r for s, r in records.items() if s != "lookup" or i < lookup_passes}
        length.observe(1, 0.035, verdicts, ("model", 4, 0.08))
        length.observe(9, 0.075, {}, None)
    model = _CountingModel()
    tree, _ = Drafters(PromptLookup(), model, length).propose(history, 8, 8, Sampler(SamplingParams()))
    return tree.sources[1:], model.calls


def test_a_short_lookup_match_is_taken_alone_where_lookup_pays_better_than_the_model():
    """A lookup match of a 2-gram (shorter than PREFERRED_LOOKUP). Where lookup's chains have been accepted and the
    model's not, the match alone promises more tokens per second: it is drafted alone and the model is not run. Where
    the records are the other way round, the model drafts, and the match joins its tree where its measured rate
    pays for the rows."""
    history = [1, 2, 3, 9, 9, 1, 2]
    sources, calls = _lookup_or_model({"lookup": (4, 4), "model": (4, 0)}, history)
    assert sources and set(sources) == {"lookup"} and calls == 0
    sources, calls = _lookup_or_model({"lookup": (4, 0), "model": (4, 4)}, history)
    assert calls == 1 and sources[0] == "model"
    # One lookup token verified, and wrong: its chains take no rows beside the model's (priced by the measured rate,
    # 0, not by the prior's, ~1/3).
    sources, calls = _lookup_or_model({"lookup": (1, 0), "model": (4, 4)}, history, lookup_passes=1)
    assert calls == 1 and sources[0] == "model" and "lookup" not in sources


def test_a_long_lookup_match_is_taken_alone_until_lookup_is_measured_to_lose():
    """A match of a 3-gram (PREFERRED_LOOKUP) is drafted alone while lookup's acceptance is unmeasured; once lookup's
    chains have been rejected and the model's accepted (as on code, where repeated identifiers match often and the
    continuation rarely), the model drafts (and the match joins its tree only where it pays). Where lookup's chains
    were accepted, the long match is still taken alone."""
    history = [1, 2, 3, 4, 5, 9, 1, 2, 3]  # the last 3-gram occurred before
    assert PromptLookup().match(history, 8)[0] >= PREFERRED_LOOKUP
    sources, calls = _lookup_or_model({"model": (4, 4)}, history)  # lookup unmeasured
    assert set(sources) == {"lookup"} and calls == 0
    sources, calls = _lookup_or_model({"lookup": (4, 0), "model": (4, 4)}, history)
    assert calls == 1 and sources[0] == "model"
    sources, calls = _lookup_or_model({"lookup": (4, 4), "model": (4, 1)}, history)
    assert set(sources) == {"lookup"} and calls == 0


def test_prompt_lookup_drafts_what_followed_the_latest_match():
    lookup = PromptLookup(max_ngram=3)
    history = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7]
    # The latest earlier occurrence of (5, 6, 7) is at 6: what followed it was 2, 3, 5, ...
    assert lookup.propose(history, 4).tokens == [2, 3, 5, 6]
    assert lookup.propose([1, 2, 3, 4], 4) is None
    assert lookup.propose([4, 1, 2, 4], 2).tokens == [1, 2]  # a 1-gram match
    assert lookup.propose([4, 1, 2, 4], 2, min_ngram=2) is None


def test_drafts_are_clipped_to_the_context_and_stop_where_plain_decoding_stops(smollm2_path):
    m = ntio.load(smollm2_path, max_context=96)
    ids = m.encode_prompt(PROMPTS[7], chat=True)
    plain = m.generate(ids, 200)
    spec = m.generate(ids, 200, lookup=True, draft_tokens=60)
    assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason
    assert len(ids) + len(spec.token_ids) <= 96 + 1  # the last token is emitted, never written to the cache
    m.close()


def test_bad_speculation_input_is_one_line(smollm2, smollm2_path, qwen05_path):
    with pytest.raises(OptionError, match="draft_tokens"):
        smollm2.generate("Hello", 4, draft_tokens=0)
    with pytest.raises(OptionError, match="branches"):
        smollm2.generate("Hello", 4, branches=-1)
    with pytest.raises(NtioError, match="different vocabulary") as err:
        ntio.load(smollm2_path, draft=qwen05_path)
    assert "\n" not in str(err.value)


def test_cli_reports_speculation(smollm2_path):
    result = CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), "-p", PROMPTS[0], "--chat", "--lookup",
                                       "-n", "24", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["speculation"]["passes"] >= 1 and out["speculation"]["tokens_per_pass"] >= 1
    result = CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), "-p", "Hi", "--draft-tokens", "0"])
    assert result.exit_code == 2 and "--draft-tokens" in result.output


def test_the_draft_is_planned_first_and_resident_out_of_the_targets_budget(qwen15_path, qwen05_path):
    m = ntio.load(qwen15_path, draft=qwen05_path, ram_budget="1.5GB", max_context=1024)
    reserved = m.draft_memory.report()["total"]
    assert m.draft.plan.describe() == "A:0-23" and m.draft.engine.kv.capacity == 1024
    assert m.memory.budget.ram == 1_500_000_000 - reserved
    assert m.memory.report()["total"] <= m.memory.budget.ram  # the target fits what the draft left
    m.close()
    result = CliRunner().invoke(main, ["plan", str(qwen15_path), "--draft", str(qwen05_path), "--ram-budget", "500MB"])
    assert result.exit_code == 1 and "cannot hold the draft model" in result.output
    result = CliRunner().invoke(main, ["plan", str(qwen15_path), "--draft", str(qwen05_path), "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["draft"]["tiers"] == "A:0-23"
