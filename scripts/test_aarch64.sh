#!/usr/bin/env bash
# The Rust tests on aarch64 under QEMU's user-mode emulation: the NEON kernels against the scalar ones, every type,
# twice: on an emulated CPU with the dot-product extension (`-cpu max`: the `sdot` kernels) and on one without it
# (`-cpu cortex-a53`: the widening kernels). Emulation says nothing about speed.
#
# Needs (Debian/Ubuntu, as root): `rustup target add aarch64-unknown-linux-gnu`;
#   apt-get install qemu-user-static gcc-aarch64-linux-gnu
#   dpkg --add-architecture arm64 && apt-get update && apt-get install libpython3.11:arm64
# The test binary links the aarch64 libpython (pyo3) and runs on the multiarch aarch64 glibc in /lib: QEMU's
# `-L /usr/aarch64-linux-gnu` (the cross glibc) hangs in the first thread creation.
#
# `--if-available` (scripts/test.sh): skip, saying what is missing, where these tools are not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYO3_PYTHON:-$PWD/.venv/bin/python}"
version=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
libpython="/usr/lib/aarch64-linux-gnu/libpython$version.so.1.0"
missing=()
command -v qemu-aarch64-static > /dev/null || missing+=(qemu-user-static)
command -v aarch64-linux-gnu-gcc > /dev/null || missing+=(gcc-aarch64-linux-gnu)
[[ -e "$libpython" ]] || missing+=("libpython$version:arm64")
rustup target list --installed 2> /dev/null | grep -qx aarch64-unknown-linux-gnu || missing+=("rustup target aarch64-unknown-linux-gnu")
if (( ${#missing[@]} )); then
    echo "aarch64 tests: missing ${missing[*]}" >&2
    [[ "${1:-}" == --if-available ]] && { echo "aarch64 tests skipped" >&2; exit 0; }
    exit 1
fi
[[ "${1:-}" == --if-available ]] && shift
# pyo3 links `-lpython3.X`: an unversioned name for the linker to find.
links=$(mktemp -d)
trap 'rm -rf "$links"' EXIT
ln -s "$libpython" "$links/libpython$version.so"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-L $links"
binary=$(PYO3_PYTHON="$python" cargo test --release --quiet --no-run --lib --target aarch64-unknown-linux-gnu \
    --message-format=json | "$python" -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["executable"])')
for cpu in max cortex-a53; do
    echo "aarch64 ($cpu):"
    RUST_BACKTRACE=0 qemu-aarch64-static -cpu "$cpu" "$binary" --quiet "$@"
done
