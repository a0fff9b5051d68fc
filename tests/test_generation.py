"""Sampling against transformers' logits processors (the independent reference), stop strings, seeds."""

from __future__ import annotations

import pytest
import torch

from ntio.api import StopStrings
from ntio.errors import OptionError
from ntio.decoding.generation import Sampler, SamplingParams

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def reference(logits, history, temperature, top_k, top_p, penalty):
    ids, scores = history[None], logits[None].clone()
    if penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(penalty)(ids, scores)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores[0]


@pytest.mark.parametrize("temperature,top_k,top_p,penalty", [
    (1.0, 0, 1.0, 1.3), (0.7, 40, 1.0, 1.0), (1.0, 0, 0.9, 1.0), (0.8, 50, 0.95, 1.1), (1.5, 5, 0.5, 1.2),
])
def test_processed_logits_match_transformers(temperature, top_k, top_p, penalty):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=g) * 3
    history = torch.randint(0, 1000, (50,), generator=g)
    ours = Sampler(SamplingParams(temperature, top_k, top_p, penalty)).processed(logits, history)
    ref = reference(logits, history, temperature, top_k, top_p, penalty)
    kept = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(ours), kept)
    torch.testing.assert_close(ours[kept], ref[kept])


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(temperature=1.0, seed=123)
    a = [Sampler(params)(logits, torch.empty(0, dtype=torch.int64)) for _ in range(3)]
    s = Sampler(params)
    draws = torch.tensor([s(logits, torch.empty(0, dtype=torch.int64)) for _ in range(4000)])
    assert len(set(a)) == 1  # same seed, same first draw
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    torch.testing.assert_close(freq, logits.softmax(-1), atol=0.03, rtol=0)


def test_greedy_ignores_seed_and_top_filters_keep_the_argmax():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1))
    for params in (SamplingParams(), SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        assert Sampler(params)(logits, torch.empty(0, dtype=torch.int64)) == int(logits.argmax())


@pytest.mark.parametrize("option,kwargs", [("temperature", {"temperature": -1}), ("top_k", {"top_k": -2}),
                                           ("top_p", {"top_p": 1.5}), ("repetition_penalty", {"repetition_penalty": 0})])
def test_bad_sampling_values_name_the_parameter(option, kwargs):
    """The library names its parameter (the CLI maps it to the flag: tests/test_cli.py)."""
    with pytest.raises(OptionError, match=f"^{option} must be") as e:
        SamplingParams(**kwargs)
    assert e.value.option == option


def test_stop_strings_cut_across_pieces_and_hold_back_prefixes():
    stops = StopStrings(("\n\nUser:", "END"))
    out = []
    for piece in ["Hello", " wor", "ld\n", "\nUs", "er: more"]:
        text, hit = stops.push(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "Hello world" and hit
    stops = StopStrings(("END",))
    assert stops.push("abcE") == ("abc", False)  # "E" might start "END": held back
    assert stops.push("x") == ("Ex", False)
    assert stops.flush() == ""
