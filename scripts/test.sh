#!/usr/bin/env bash
# The test command (README): build the Rust core into a fresh venv, install the test oracles, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
PYO3_PYTHON="$PWD/.venv/bin/python" cargo test --release --quiet
.venv/bin/python -m pytest -q
