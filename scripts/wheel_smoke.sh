#!/usr/bin/env bash
# The package as users install it: build the abi3 wheel and the sdist with maturin, install the wheel into a fresh
# venv with no source tree on its path, and run the commands a user runs first (from a directory outside the tree).
# Run by scripts/test.sh after .venv exists (it supplies maturin and the wheel's dependencies).
#
# The wheel is installed without its dependencies: those come from .venv through a path file, as torch alone is ~3 GB
# and CI caches no wheels. What is under test is ntio's own wheel: its native module, its Python files, its metadata
# and its entry points; `import ntio` must resolve to the fresh venv.
set -euo pipefail
shopt -s nullglob
repo="$(cd "$(dirname "$0")/.." && pwd -P)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$repo"

.venv/bin/maturin build --release --quiet --interpreter .venv/bin/python --out "$work/dist"
.venv/bin/maturin sdist --out "$work/dist"
wheel=("$work"/dist/ntio-*-abi3-*.whl)
sdist=("$work"/dist/ntio-*.tar.gz)
[[ ${#wheel[@]} == 1 && ${#sdist[@]} == 1 ]] || { echo "wheel_smoke: expected one wheel and one sdist" >&2; exit 1; }
# The sdist builds anywhere: it holds the crate, the Python package, the README and the licence.
listing="$(tar -tzf "${sdist[0]}")"
for member in Cargo.toml Cargo.lock pyproject.toml README.md LICENSE rust/lib.rs python/ntio/__init__.py; do
    grep -q "^ntio-[^/]*/$member\$" <<<"$listing" || { echo "wheel_smoke: the sdist lacks $member" >&2; exit 1; }
done

python3 -m venv "$work/venv"
deps="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
site="$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
echo "$deps" >"$site/_ntio_dependencies.pth"
"$work/venv/bin/python" -m pip install --quiet --no-deps --no-index "${wheel[0]}"

cd "$work"
py="$work/venv/bin/python"
"$py" - "$repo" <<'EOF'
import importlib.metadata as md
import sys
from pathlib import Path

import ntio

repo = Path(sys.argv[1])
assert repo not in Path(ntio.__file__).resolve().parents, f"ntio imported from the source tree: {ntio.__file__}"
meta = md.metadata("ntio")
assert meta["Version"] == ntio.__version__, (meta["Version"], ntio.__version__)
assert meta["License-Expression"] == "Apache-2.0" and "LICENSE" in md.distribution("ntio").read_text("RECORD")
assert {"serve", "plot", "cuda12", "cuda13"} <= set(meta.get_all("Provides-Extra")), meta.get_all("Provides-Extra")
assert meta["Description-Content-Type"].startswith("text/markdown") and "# ntio" in meta.get_payload()
print(f"wheel_smoke: ntio {ntio.__version__} from {Path(ntio.__file__).parent}")
EOF
version="$("$work/venv/bin/ntio" --version)"
[[ "$version" == "$("$py" -m ntio --version)" ]] || { echo "wheel_smoke: python -m ntio differs" >&2; exit 1; }
"$work/venv/bin/ntio" synth tiny -o tiny.gguf
"$work/venv/bin/ntio" info tiny.gguf >/dev/null
"$work/venv/bin/ntio" generate -m tiny.gguf -p "hello" -n 8 --tiers C >/dev/null
"$work/venv/bin/ntio-bench" read tiny.gguf --block-size 65536 >/dev/null
echo "wheel_smoke: $version: wheel and sdist built, installed, info, generate (streamed) and ntio-bench ran"
