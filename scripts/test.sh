#!/usr/bin/env bash
# The test command (README): build the Rust core into a fresh venv, install the test oracles, run every test; the
# wheel and sdist are built and the wheel is tried as users install it (scripts/wheel_smoke.sh). Where the aarch64
# cross tools are installed, the Rust tests also run on aarch64 under QEMU (scripts/test_aarch64.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# The Rust tests compile while pip downloads (~3 GB, mostly torch); cargo's lock on target/ keeps the two builds apart.
# No pip cache: a cached copy of those wheels would double the disk the install needs (a CI run once ran out).
PYO3_PYTHON="$PWD/.venv/bin/python" cargo test --release --quiet --no-run &
rust_tests=$!
.venv/bin/python -m pip install -q --no-cache-dir --upgrade pip
.venv/bin/python -m pip install -q --no-cache-dir -e '.[dev]'
wait "$rust_tests"
PYO3_PYTHON="$PWD/.venv/bin/python" cargo test --release --quiet
bash scripts/test_aarch64.sh --if-available
bash scripts/wheel_smoke.sh
# One pytest worker per CPU, at most four and one per 6 GiB of RAM (each holds its own models; the Qwen 1.5B oracle
# in transformers takes ~6 GB), each computing on one thread (tests/conftest.py); a module's tests stay in one worker,
# which builds its fixtures once.
workers=$(nproc)
by_memory=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / (6 << 20) ))
(( workers > by_memory )) && workers=$by_memory
(( workers > 4 )) && workers=4
(( workers < 1 )) && workers=1
.venv/bin/python -m pytest -q -n "$workers" --dist loadfile
