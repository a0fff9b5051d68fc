"""The benches' figures (benches/figures.py) drawn from their saved JSON results: each PNG is written and not blank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_profile import _assert_drawn

pytest.importorskip("matplotlib")
BENCHES = Path(__file__).resolve().parent.parent / "benches"
sys.path.insert(0, str(BENCHES))
import figures  # noqa: E402

# speculative.py's report, as it prints it (two prompt kinds, one tier plan; no run of it is saved in benches/).
SPECULATIVE = {
    "model": "/cache/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tokens": 64,
    "results": {"C": {
        "code/plain": {"tok_s": 3.1}, "prose/plain": {"tok_s": 3.0},
        "code/model b=2": {"tok_s": 8.7, "tokens_per_pass": 5.9, "identical": True, "vs_plain": 2.8},
        "prose/model b=2": {"tok_s": 5.1, "tokens_per_pass": 3.2, "identical": True, "vs_plain": 1.7},
        "code/lookup": {"tok_s": 3.6, "tokens_per_pass": 1.4, "identical": True, "vs_plain": 1.16},
        "prose/lookup": {"tok_s": 3.2, "tokens_per_pass": 1.1, "identical": True, "vs_plain": 1.07},
    }},
}


@pytest.mark.parametrize("kind, result", [
    ("bigger-than-ram", "bigger_than_ram_ternary70b.json"),
    ("serve-load", "serve_load_smollm2.json"),
    ("decode-vs-llamacpp", "decode_vs_llamacpp_8b_tq2_0.json"),
    ("speculative", SPECULATIVE),
])
def test_a_bench_result_is_drawn(kind, result, tmp_path):
    if isinstance(result, str):
        result = json.loads((BENCHES / result).read_text())
    png = tmp_path / "figure.png"
    figures.FIGURES[kind](result, png)
    _assert_drawn(png)
