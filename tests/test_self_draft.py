"""Self-speculation on SmolLM2: exit heads calibrated on real text (this repository's sources), greedy output identical
to plain greedy decoding with the model's own first layers drafting (resident and streamed), calibrated heads
drafting better than the uncalibrated identity, and bad calibration input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ntio
from ntio.cli import main
from ntio.decoding.self_draft import Calibration, SelfDraft, fingerprint
from ntio.errors import ModelFormatError, OptionError

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Write a Python function that returns the sum of the squares of a list of numbers.",
    "Explain in two sentences why the sky is blue.",
    "List the days of the week, one per line.",
    "Rewrite this sentence in the past tense: 'The cat sits on the mat while the dog runs in the park.'",
]


@pytest.mark.parametrize("tiers", ["auto", "A:0-9,C:10-29"])
def test_greedy_with_self_speculation_is_token_for_token_plain_greedy(smollm2_path, calibration_file, tiers):
    m = ntio.load(smollm2_path, self_draft=calibration_file, exit_layer=22, tiers=tiers)
    passes = tokens = 0
    for prompt in PROMPTS:
        ids = m.encode_prompt(prompt, chat=True)
        plain = m.generate(ids, 40, use_draft=False)
        spec = m.generate(ids, 40, adaptive_draft=False, draft_tokens=4)
        assert spec.token_ids == plain.token_ids, prompt
        passes += spec.speculation["passes"]
        tokens += spec.speculation["tokens"]
    m.close()
    assert tokens / passes > 1.4  # the exit head drafts right often (measured ~1.7 at layer 22, 4 drafted)


def test_calibrated_exit_heads_draft_better_than_the_identity(smollm2_path, calibration_file):
    m = ntio.load(smollm2_path, self_draft=calibration_file, exit_layer=22)
    d = m.config.d_model
    calibrated = m.self_draft
    identity = SelfDraft(m.engine, 22, (torch.eye(d), torch.zeros(d)), calibrated.blocks)

    def tokens_per_pass(drafter) -> float:
        m.self_draft = drafter
        rates = []
        for prompt in PROMPTS:
            m.engine.kv.crop(0)
            c = m.generate(m.encode_prompt(prompt, chat=True), 32, adaptive_draft=False, draft_tokens=4)
            rates.append(c.speculation["tokens_per_pass"])
        return sum(rates) / len(rates)

    assert tokens_per_pass(calibrated) > tokens_per_pass(identity) + 0.1  # measured 1.67 vs 1.46
    m.close()


def test_sampling_with_self_speculation_runs_and_reports(smollm2_path, calibration_file):
    m = ntio.load(smollm2_path, self_draft=calibration_file)
    c = m.generate(PROMPTS[0], 24, chat=True, temperature=0.8, seed=3, draft_tokens=3)
    assert c.n_generated_tokens >= 1 and c.speculation["drafted"].get("self", 0) > 0
    m.close()


def test_bad_calibration_input_is_one_line(smollm2_path, qwen05_path, calibration_file, tmp_path):
    with pytest.raises(ModelFormatError, match="calibrated for another model"):
        ntio.load(qwen05_path, self_draft=calibration_file)
    not_ours = tmp_path / "notes.txt"
    not_ours.write_text("hello")
    with pytest.raises(ModelFormatError, match="not an ntio calibration file"):
        ntio.load(smollm2_path, self_draft=not_ours)
    with pytest.raises(OptionError, match="exit_layer"):
        ntio.load(smollm2_path, self_draft=calibration_file, exit_layer=5)
    with pytest.raises(OptionError, match="two draft models"):
        ntio.load(smollm2_path, self_draft=calibration_file, draft=smollm2_path)


def test_cli_calibrates_and_drafts(smollm2_path, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((ROOT / "README.md").read_text())
    out = tmp_path / "heads.exit"
    runner = CliRunner()
    result = runner.invoke(main, ["calibrate", "-m", str(smollm2_path), "--corpus", str(corpus), "-o", str(out),
                                  "--layers", "20,24", "--tokens", "1024", "--ctx", "256"])
    assert result.exit_code == 0, result.output
    cal = Calibration.load(out, _fingerprint_of(smollm2_path), 576)
    assert sorted(cal.heads) == [20, 24] and cal.n_tokens <= 1024
    result = runner.invoke(main, ["generate", "-m", str(smollm2_path), "-p", "Hi", "--self-draft", str(out), "-n", "8",
                                  "--exit-layer", "24", "--json"])
    assert result.exit_code == 0, result.output
    assert '"self"' in result.output  # the source in the speculation stats
    result = runner.invoke(main, ["calibrate", "-m", str(smollm2_path), "--corpus", str(corpus), "-o", str(out),
                                  "--layers", "29"])
    assert result.exit_code == 1 and "--layers" in result.output and "\n" not in result.output.strip()


def _fingerprint_of(path: Path) -> str:
    m = ntio.load(path)
    try:
        return fingerprint(m.engine, m.tokenizer.vocabulary)
    finally:
        m.close()
