"""Speculative decoding: greedy output identical to plain greedy decoding (prompt lookup on SmolLM2, the real
Qwen2.5-Coder 0.5B -> 1.5B draft pair; resident and streamed), the sampling acceptance rule against the target's
own distribution, statistics, and bad input."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import ntio
from ntio.cli import main
from ntio.decoding.generation import Sampler, SamplingParams
from ntio.decoding.speculative import Draft, PromptLookup, verify
from ntio.errors import NtioError, OptionError

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
    for prompt in PROMPTS:
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
    assert drafted > 40 and 20 < accepted < drafted


@pytest.mark.parametrize("tiers", ["auto", "C"])
def test_greedy_with_the_qwen_draft_model_is_token_for_token_plain_greedy(qwen15_path, qwen05_path, tiers):
    m = ntio.load(qwen15_path, draft=qwen05_path, tiers=tiers)
    assert m.draft is not None and m.draft.tokenizer is m.tokenizer
    for prompt in CODE_PROMPTS[: 3 if tiers == "auto" else 1]:
        ids = m.encode_prompt(prompt, chat=True)
        plain = m.generate(ids, 40, use_draft=False)
        spec = m.generate(ids, 40, lookup=True, adaptive_draft=False)  # every pass drafts: all paths exercised
        assert spec.token_ids == plain.token_ids, prompt
        sp = spec.speculation
        assert sp["drafted"].get("model", 0) > 0 and sp["accepted"]["model"] <= sp["drafted"]["model"]
        assert sp["tokens"] == sum(sp["accepted"].values()) + sp["passes"]
    m.close()


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


def _first_token_frequencies(p_logits, q, draft_token_of, trials, seed):
    """Frequencies of the first token `verify` emits for a one-token draft (drawn by draft_token_of(generator))
    against rows whose first row has logits p_logits."""
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=6, seed=seed))
    rows = torch.stack([p_logits, p_logits])
    history = torch.tensor([1, 2, 3])
    counts = torch.zeros_like(p_logits)
    for _ in range(trials):
        x = draft_token_of(sampler.generator)
        accepted, token = verify(rows, Draft([x], "test", None if q is None else q[None]), sampler, history)
        counts[x if accepted else token] += 1
    return counts / trials


def test_speculative_sampling_keeps_the_targets_distribution(smollm2):
    """SmolLM2's real next-token distribution p (temperature 1, top-k 6) and a draft distribution q that prefers
    what p finds unlikely: tokens emitted through the acceptance rule follow p, not q, within sampling noise (total
    variation over 20,000 draws); a rule that accepted every draft would give q."""
    e = smollm2.engine
    p_logits = e.forward(torch.tensor(smollm2.encode_prompt("My favourite colour is")), 0).clone()
    p = Sampler(SamplingParams(temperature=1.0, top_k=6)).probabilities(p_logits, torch.tensor([1, 2, 3]))
    support = p.topk(6).indices
    q = torch.zeros_like(p)
    q[support] = p[support].flip(0)
    assert 0.5 * float((q - p).abs().sum()) > 0.2
    trials = 20_000
    freq = _first_token_frequencies(p_logits, q, lambda g: int(torch.multinomial(q, 1, generator=g)), trials, 1)
    assert 0.5 * float((freq - p).abs().sum()) < 0.02
    # A deterministic draft (prompt lookup: a point mass) at p's second most likely token.
    second = int(support[1])
    freq = _first_token_frequencies(p_logits, None, lambda g: second, trials, 2)
    assert 0.5 * float((freq - p).abs().sum()) < 0.02


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
