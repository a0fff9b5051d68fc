#!/usr/bin/env bash
# The test command (README): build the Rust core into a fresh venv, install the test oracles, run every test; the
# wheel and sdist are built and the wheel is tried as users install it (scripts/wheel_smoke.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
PYO3_PYTHON="$PWD/.venv/bin/python" cargo test --release --quiet
bash scripts/wheel_smoke.sh
.venv/bin/python -m pytest -q
