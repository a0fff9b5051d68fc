"""Two ntio builds side by side on this machine: resident decode, all-C decode, and the reader's sustained rate.

The other build (e.g. the previous HEAD) is installed beside the working tree's with
`pip install --no-deps --target DIR WHEEL`; each measurement runs in a fresh interpreter, the builds alternate
within every round (A B, then B A), and the result is one JSON object with per-round figures, medians and the
median of per-round new/old ratios.

    python benches/compare_builds.py --old-site DIR [--new-site DIR] [--model NAME|PATH] [--rounds 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

from ntio.fetch import resolve_model

# Runs in a fresh interpreter for one build. Only API both builds have: ntio.load / generate, ntio.io.read_into.
_CHILD = r"""
import json, os, sys, time
import numpy as np, torch
path, mode, tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
if mode == "read":
    from ntio import _core
    from ntio.io import read_into
    chunk = 64 << 20
    size = min(os.path.getsize(path), 1 << 30) // chunk * chunk or os.path.getsize(path) // 4096 * 4096
    raw = np.empty(min(chunk, size) + 4096, dtype=np.uint8)
    buf = raw[-raw.ctypes.data % 4096:][: min(chunk, size)]
    reader = _core.Reader(path)  # O_DIRECT: every byte from the disk, not the page cache
    start = time.perf_counter()
    for offset in range(0, size, buf.size):
        read_into(reader, [(offset, min(buf.size, size - offset), 0)], buf)
    print(json.dumps({"value": size / (time.perf_counter() - start) / 1e9}))
else:
    import ntio
    m = ntio.load(path, max_context=512, tiers=mode)
    prompt = "Write a short paragraph about rivers."
    m.generate(prompt, chat=True, max_new_tokens=4)  # warm-up: first-touch pages, kernel thread pool
    print(json.dumps({"value": m.generate(prompt, chat=True, max_new_tokens=tokens).decode_tok_s}))
"""

MEASURES = {"resident_tok_s": "A", "all_c_tok_s": "C", "read_gb_s": "read"}


def _run(site: str | None, path: str, mode: str, tokens: int, threads: int) -> float:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = site
    out = subprocess.run([sys.executable, "-c", _CHILD, path, mode, str(tokens), str(threads)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["value"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-site", required=True, help="folder the other build is installed in (pip --target)")
    ap.add_argument("--new-site", default=None, help="the same for the new build (default: this interpreter's ntio)")
    ap.add_argument("--model", default=None, help="model path or name (default: smollm2-135m)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    path = str(resolve_model(args.model))
    builds = {"old": args.old_site, "new": args.new_site}
    rounds = []
    for r in range(args.rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        row = {}
        for measure, mode in MEASURES.items():
            for build in order:
                row[f"{measure}_{build}"] = _run(builds[build], path, mode, args.tokens, args.threads)
        rounds.append(row)
        print(json.dumps({"round": r, **row}), file=sys.stderr)
    result = {"model": os.path.basename(path), "machine": platform.processor() or platform.machine(),
              "threads": args.threads, "tokens": args.tokens, "rounds": rounds}
    for measure in MEASURES:
        result[f"{measure}_old_median"] = statistics.median(r[f"{measure}_old"] for r in rounds)
        result[f"{measure}_new_median"] = statistics.median(r[f"{measure}_new"] for r in rounds)
        result[f"{measure}_ratio_median"] = statistics.median(r[f"{measure}_new"] / r[f"{measure}_old"] for r in rounds)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
