"""Adaptive depth (issue 14) on SmolLM2: per-token depth in one pass equals decoding token by token, attention never
reads K/V a skipped position did not write, the schedules' rules, budgets, early exit reading fewer bytes when
streamed, and bad input."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ntio
from ntio.cli import main
from ntio.errors import NtioError, OptionError
from ntio.policies.adaptive import adaptive_policy
from ntio.policies.base import LOAD_ALL, SKIP, LoadDecision, LoadPolicy
from ntio.policies.cosine_skip import CosineSkipPolicy
from ntio.policies.depth_profile import SKIP_LABEL_COS, LayerRecorder, calibrate_depth
from ntio.policies.early_exit import ExitSchedule, isotonic_non_increasing, stop_depths
from ntio.policies.layer_skip import SkipSetting, skip_mask

ROOT = Path(__file__).resolve().parent.parent
TEXT = "The quick brown fox jumps over the lazy dog because it was in a hurry to get home before the rain."


@pytest.fixture(scope="module")
def depth_file(smollm2_path, tmp_path_factory) -> Path:
    corpus = "".join(p.read_text() for p in sorted((ROOT / "python" / "ntio").rglob("*.py")))
    m = ntio.load(smollm2_path)
    path = tmp_path_factory.mktemp("depth") / "smollm2.calib"
    calibrate_depth(m, corpus, [10, 18, 26], n_tokens=3072).save(path)
    m.close()
    return path


@dataclass
class PerToken(LoadPolicy):
    """Token t computes layer l unless (t, l) is in `skip` (tokens counted from position 0)."""

    skip: set[tuple[int, int]]
    _start: int = field(default=0, init=False)
    _n: int = field(default=0, init=False)

    def begin_pass(self, start_pos: int, n_tokens: int) -> None:
        self._start, self._n = start_pos, n_tokens

    def decide(self, layer: int, ahead: int) -> LoadDecision:
        if self._n == 1 and (self._start, layer) in self.skip:
            return SKIP
        return LOAD_ALL

    def still_wanted(self, layer: int, decision: LoadDecision) -> bool:
        return self.decide(layer, 0).kind != "skip"

    def tokens(self, layer: int) -> torch.Tensor:
        return torch.tensor([(self._start + t, layer) not in self.skip for t in range(self._n)])


SKIPS = {(3, 5), (3, 6), (4, 5), (7, 12), (8, 20), (8, 21), (2, 29), (9, 0)}


def test_per_token_depth_in_one_pass_equals_decoding_token_by_token(smollm2_path):
    m = ntio.load(smollm2_path)
    ids = torch.tensor(m.tokenizer.encode(TEXT)[:12])
    m.policy = PerToken(SKIPS)
    batched = m.engine.forward(ids, 0, all_logits=True)
    sequential = torch.stack([m.engine.forward(ids[i : i + 1], i) for i in range(ids.shape[0])])
    m.policy = PerToken(set())
    dense = m.engine.forward(ids, 0, all_logits=True)
    m.close()
    torch.testing.assert_close(batched, sequential, rtol=1e-4, atol=1e-4)
    assert (batched[:2] - dense[:2]).abs().max() < 1e-4  # nothing skipped before position 2's layer 29 ...
    assert (batched[3:] - dense[3:]).abs().max() > 1e-2  # ... and the skips change what follows


def test_attention_never_reads_kv_a_skipped_position_did_not_write(smollm2_path):
    m = ntio.load(smollm2_path)
    ids = torch.tensor(m.tokenizer.encode(TEXT)[:14])
    skips = SKIPS | {(pos, 16) for pos in range(10)}  # layer 16: every token of the first pass passes through it
    m.policy = PerToken(skips)
    m.engine.forward(ids[:10], 0)
    clean = m.engine.forward(ids[10:], 10, all_logits=True)
    m.engine.forward(ids[:10], 0)
    kv = m.engine.kv
    for pos, layer in skips:
        assert kv.skipped[layer, pos]
        kv.k[layer, :, pos] = float("nan")
        kv.v[layer, :, pos] = float("nan")
    poisoned = m.engine.forward(ids[10:], 10, all_logits=True)
    m.close()
    assert torch.isfinite(poisoned).all()
    torch.testing.assert_close(poisoned, clean, rtol=0, atol=0)


def test_a_policy_that_selects_every_token_is_bit_identical_to_dense(smollm2_path):
    m = ntio.load(smollm2_path)
    ids = torch.tensor(m.tokenizer.encode(TEXT)[:10])
    dense = m.engine.forward(ids, 0, all_logits=True)
    m.policy = PerToken(set())
    same = m.engine.forward(ids, 0, all_logits=True)
    m.close()
    assert torch.equal(dense, same)


def test_cosine_skip_reverts_exactly_the_nearly_unchanged_tokens(smollm2_path):
    h_in = torch.ones(2, 4)
    h_out = torch.tensor([[1.0, 1, 1, 1.1], [1.0, -1, 1, 1]])  # cos 0.998 and 0.48
    assert CosineSkipPolicy(0.98).revert(0, h_in, h_out).tolist() == [True, False]
    m = ntio.load(smollm2_path)
    dense = m.perplexity(TEXT).perplexity
    m.policy = policy = CosineSkipPolicy(0.98)
    skipped = m.perplexity(TEXT).perplexity
    m.close()
    assert 0.02 < policy.reverted_share() < 0.5  # measured ~0.09 on README.md
    assert skipped != dense


def test_schedules_follow_their_rules():
    sched = ExitSchedule(levels=(7, 11, 30), floor=7)
    never, at_first, at_second = [False, False], [True, True], [False, True]
    # Monotone: one exit caps every later token.
    assert stop_depths([never, at_second, never, never], [0, 1, 2, 3], 30, sched) == [30, 11, 11, 11]
    assert stop_depths([never, at_second, at_first], [0, 1, 2], 30, sched) == [30, 11, 7]
    # Floors fall from 30 to 11 over 4 positions: an exit at 7 waits until the floor is 7 or less.
    floors = ExitSchedule(levels=(7, 11, 30), floor=11, floor_tokens=4)
    assert [floors.floor_at(p) for p in range(6)] == [30, 26, 21, 16, 11, 11]
    assert stop_depths([at_first] * 6, range(6), 30, floors) == [30, 30, 30, 30, 11, 11]
    # A refresh every 2 positions raises the cap one level.
    refresh = ExitSchedule(levels=(7, 11, 30), floor=7, refresh_every=2, refresh_levels=1)
    assert stop_depths([at_first, never, never, never, never], range(5), 30, refresh) == [7, 7, 11, 11, 30]
    # Per-token: every token is free of the one before.
    free = ExitSchedule(levels=(7, 11, 30), floor=7, refresh_every=1, refresh_levels=2)
    assert stop_depths([at_first, never, at_second], range(3), 30, free) == [7, 30, 11]
    assert isotonic_non_increasing([3.0, 1.0, 2.0, 0.5]) == [3.0, 1.5, 1.5, 0.5]
    assert skip_mask(torch.tensor([[0.9, 0.9, 0.9, 0.1]]), torch.full((4,), 0.5), 2).tolist() == [[True, True, False,
                                                                                                   False]]


@pytest.mark.parametrize("sync, signal", [(True, "kl"), (False, "entropy")])
def test_budgets_are_met_on_held_out_tokens_and_early_exit_reads_only_the_layers_computed(smollm2_path, depth_file,
                                                                                          sync, signal):
    # Read when needed, a decode step reads exactly the layers its token computes; with read-ahead, at most one more
    # (the layer after a probe is read on the chance it is needed, the rest wait for the probe: `holds`).
    m = ntio.load(smollm2_path, tiers="C", sync=sync)
    policy = adaptive_policy(m, depth_file, 0.8, "exit", "per-token", signal=signal)
    assert policy.setting.held_out_fraction(policy.profile) <= 0.8
    m.policy = policy
    first = len(m.stats.forwards)
    m.generate("Write a haiku about the sea.", 24, chat=True)
    steps = [f.bytes_read for f in m.stats.forwards[first:] if f.n_tokens == 1]
    m.close()
    layers, extra = policy.profile.layer_bytes, 0 if sync else 1
    assert len(steps) == len(policy.depths) and min(policy.depths) < 30  # tokens exited (measured: 15 of 23)
    for read, depth in zip(steps, policy.depths):  # extents are whole 4 KiB pages: a little more than the tensors
        assert sum(layers[:depth]) <= read < sum(layers[: depth + 1 + extra]) if depth < 30 else read >= sum(layers)
    skip = adaptive_policy(m, depth_file, 0.95, "skip")
    quality = skip.setting.quality(skip.profile)
    assert quality["bytes_fraction"] <= 0.95 and 0 < quality["recall"] <= 1
    base_rate = float(skip.profile.skip_labels.float().mean())
    assert SkipSetting(0.5).quality(skip.profile)["precision"] > base_rate  # the predictor beats guessing


def test_bad_adaptive_input_is_one_line(smollm2_path, depth_file, tmp_path):
    m = ntio.load(smollm2_path)
    with pytest.raises(OptionError, match=r"budget 0.1 cannot be met .* at least 0\.\d+"):
        adaptive_policy(m, depth_file, 0.1, "exit", "per-token")
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(NtioError, match="the calibration text has 2 tokens; .* needs at least 1285"):
        calibrate_depth(m, short.read_text(), [10])  # windows of 512: the held-out 40% spans two
    with pytest.raises(OptionError, match="tokens must be at least 1285 .* got 1024"):
        calibrate_depth(m, (ROOT / "README.md").read_text(), [10], n_tokens=1024)
    payload = torch.load(depth_file, weights_only=True)
    for name, change, message in [("other.calib", {"model": "0" * 32}, "calibrated for another model"),
                                  ("heads-only.calib", {"depth": None}, "no adaptive-depth profile")]:
        torch.save({**payload, **change}, tmp_path / name)
        with pytest.raises(NtioError, match=message):
            adaptive_policy(m, tmp_path / name, 0.9)
    m.close()
    runner = CliRunner()
    base = ["-m", str(smollm2_path)]
    result = runner.invoke(main, ["perplexity", *base, "-f", str(ROOT / "README.md"), "--budget", "0.9"])
    assert result.exit_code == 1 and "--budget needs --adaptive" in result.output
    result = runner.invoke(main, ["perplexity", *base, "-f", str(ROOT / "README.md"), "--adaptive", str(depth_file),
                                  "--adaptive-method", "skip", "--exit-signal", "kl"])
    assert result.exit_code == 1 and "--exit-signal needs --adaptive with --adaptive-method exit" in result.output
    result = runner.invoke(main, ["generate", *base, "-p", "Hi", "--adaptive", str(depth_file), "--lookup"])
    assert result.exit_code == 1 and "--adaptive does not combine with speculative" in result.output
    result = runner.invoke(main, ["calibrate", *base, "--corpus", str(short), "-o", str(tmp_path / "x.calib")])
    assert result.exit_code == 1 and f"{short} has 2 tokens" in result.output and "at least 1285" in result.output
    assert "\n" not in result.output.strip() and not (tmp_path / "x.calib").exists()


def test_cli_prices_early_exit_in_perplexity(smollm2_path, depth_file, tmp_path):
    text = tmp_path / "eval.txt"
    text.write_text((ROOT / "README.md").read_text()[:6000])
    runner = CliRunner()
    args = ["perplexity", "-m", str(smollm2_path), "-f", str(text), "--json"]
    dense = runner.invoke(main, args)
    exited = runner.invoke(main, [*args, "--adaptive", str(depth_file), "--budget", "0.9"])
    assert dense.exit_code == 0 and exited.exit_code == 0, exited.output
    import json

    d, e = json.loads(dense.output), json.loads(exited.output)
    assert e["adaptive_depth"]["method"] == "exit" and e["adaptive_depth"]["bytes_fraction"] < 1.0
    assert e["perplexity"] > d["perplexity"]  # lossy, priced


def test_prompt_adaptive_thresholds_leave_no_false_skip_on_the_prompt(smollm2_path, depth_file):
    m = ntio.load(smollm2_path)
    m.policy = policy = adaptive_policy(m, depth_file, 0.8, "skip")
    ids = torch.tensor(m.tokenizer.encode(TEXT))
    m.engine.forward(ids, 0)  # the prompt's prefill: every layer computes, and the thresholds adapt to it
    adapted, base = policy.thresholds.clone(), policy.setting.threshold
    # The post-compute labels of the prompt (every layer computed), and what the predictor says of it
    m.policy = recorder = LayerRecorder([policy.profile.skip_after])
    m.engine.forward(ids, 0)
    m.close()
    probs = policy.predictor(recorder.seen[policy.profile.skip_after])
    labels = torch.stack([recorder.cos[l] > SKIP_LABEL_COS for l in range(policy.first, 30)], dim=1)
    unadapted = skip_mask(probs, torch.full_like(adapted, base), policy.setting.max_consecutive)
    assert (unadapted & ~labels).any()  # the calibrated threshold would skip layers this prompt needs ...
    assert not (skip_mask(probs, adapted, policy.setting.max_consecutive) & ~labels).any()  # ... the adapted ones not
    assert (adapted >= base).all()


@pytest.mark.parametrize("method", ["exit", "skip"])
def test_a_prompt_computes_every_layer_in_each_chunk_even_a_last_one_of_one_token(smollm2_path, depth_file, method):
    m = ntio.load(smollm2_path)
    m.engine.prefill_chunk = 8
    m.policy = policy = adaptive_policy(m, depth_file, 0.8, method)
    decided = (lambda: policy.depths) if method == "exit" else (lambda: policy.layer_bytes_read)
    ids = torch.tensor(m.tokenizer.encode(TEXT)[:10])
    m.engine.forward(ids[:9], 0)  # a prompt of 9 tokens: chunks of 8 and 1
    assert decided() == []
    m.engine.forward(ids[9:], 9)  # a decode step is decided
    m.close()
    assert len(decided()) == 1
