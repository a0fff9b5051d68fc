"""A short fuzz run over GGUF and store headers (tests/fuzzing.py; long runs: `python tests/fuzzing.py`), and every
input a fuzz run ever failed on, kept in tests/data/fuzz/ as a regression test."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.fuzzing import exercise, run_chunks

_FOUND_DIR = Path(__file__).parent / "data" / "fuzz"
FOUND = sorted([*_FOUND_DIR.glob("*.gguf"), *_FOUND_DIR.glob("*.ntio")])  # the .txt beside each says what it did


def test_short_fuzz_run_finds_no_crash_hang_or_foreign_exception(tmp_path):
    report = run_chunks(240, tmp_path, chunk=120, jobs=2)
    assert report.iterations == 240
    assert report.failures == [], report.outcomes
    assert report.outcomes.get("rejected", 0) > 100 and report.outcomes.get("ok", 0) > 0  # it reached both ends


@pytest.mark.parametrize("path", FOUND, ids=[p.name for p in FOUND])
def test_inputs_the_fuzzer_once_failed_on_are_rejected_cleanly(path):
    assert exercise(path, random.Random(0)) in ("ok", "rejected")
