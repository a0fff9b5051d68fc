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
                                           ("top_p", {"top_p": 1.5}), ("repetition_penalty", {"repetition_penalty": 0}),
                                           ("temperature", {"temperature": "0.5"}), ("top_k", {"top_k": 2.5}),
                                           ("top_p", {"top_p": None}), ("seed", {"seed": 2.0}),
                                           ("seed", {"seed": 2**64})])
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


def test_a_seed_of_numpys_integers_is_an_integer_and_tiny_temperatures_are_greedy():
    import numpy as np

    assert SamplingParams(temperature=1.0, seed=np.int64(3)).seed == 3
    assert SamplingParams(temperature=1e-300).temperature == 0.0  # below GREEDY_BELOW: greedy, not an overflow


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    import ntio

    with ntio.load(smollm2_path, max_context=256) as m:
        yield m


def test_a_stream_overtaken_by_a_later_one_is_refused_not_mixed(smollm2):
    """Streams share the model's KV cache: an earlier stream, once a later generate has run, raises instead of
    continuing from the other prompt's cache; the later one gets the answer a fresh start gives."""
    from ntio.errors import NtioError

    m = smollm2
    want = m.generate("The capital of France is", max_new_tokens=6).token_ids
    first = iter(m.stream("Once upon a time", max_new_tokens=12))
    next(first)
    assert m.generate("The capital of France is", max_new_tokens=6).token_ids == want
    with pytest.raises(NtioError, match="overtaken by a later generate"):
        next(first)
    started = iter(m.stream("Once upon a time", max_new_tokens=12))
    next(started)
    m.perplexity("Some text to score, which writes over the cache.", ctx=32)
    with pytest.raises(NtioError, match="overtaken"):
        list(started)


def test_two_threads_on_one_model_get_one_answer_and_one_error(smollm2):
    import threading

    from ntio.errors import NtioError

    m = smollm2
    want = m.generate("The capital of France is", max_new_tokens=12).token_ids
    results: list = [None, None]

    def run(i: int) -> None:
        try:
            results[i] = m.generate("The capital of France is", max_new_tokens=12).token_ids
        except NtioError as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    answers = [r for r in results if isinstance(r, list)]
    assert answers and all(a == want for a in answers), results  # never a mix of the two
    assert all(isinstance(r, list) or "overtaken" in str(r) for r in results), results


@pytest.mark.parametrize("kwargs, needle", [
    ({"prompt": b"hello"}, "text or a sequence of token ids"),
    ({"prompt": [1.7, 2.2]}, "must be integers"),
    ({"prompt": torch.tensor([[1, 2]])}, "must be integers"),
    ({"prompt": "Hi", "max_new_tokens": 2.0}, "max_new_tokens must be an integer"),
    ({"prompt": "Hi", "stop": [1]}, "stop must be a string or a sequence of strings"),
])
def test_arguments_of_the_wrong_kind_are_ntio_errors(smollm2, kwargs, needle):
    from ntio.errors import NtioError

    with pytest.raises(NtioError, match=needle):
        smollm2.generate(**kwargs)


def test_a_stop_string_is_one_string_and_an_empty_system_message_is_sent(smollm2):
    m = smollm2
    whole = m.generate("The capital of France is", max_new_tokens=8).text
    cut = m.generate("The capital of France is", max_new_tokens=8, stop="Paris")
    assert cut.finish_reason == "stop" and cut.text == whole[: whole.index("Paris")], (whole, cut.text)
    assert m.encode_prompt("Hi", chat=True, system="") != m.encode_prompt("Hi", chat=True)  # not the default one


def test_a_closed_model_refuses_to_generate(smollm2_path):
    import ntio
    from ntio.errors import NtioError

    m = ntio.load(smollm2_path, max_context=64, tiers="C")
    m.close()
    for call in (lambda: m.generate("Hi", max_new_tokens=2), lambda: m.perplexity("Hello there, world")):
        with pytest.raises(NtioError, match="the model is closed"):
            call()
