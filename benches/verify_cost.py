"""What checksum verification costs: all-C decode of an ntio store with `verify` on and off, side by side.

Every layer is read from disk at every token (O_DIRECT: the page cache plays no part), so this is decode at the
disk's bound, where verification must cost at most 5% (the hardening issue). Each run is a fresh interpreter; the two
settings alternate within every round (on off, then off on). Prints one JSON object: per-round tok/s and disk
GB/s, medians, and the median of per-round on/off ratios.

    python benches/verify_cost.py [--model NAME|PATH] [--rounds 6] [--tokens 32] [--prefetch-depth N]

A GGUF model is converted to a store first (kept beside it in the ntio cache, as MODEL.ntio).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from ntio.fetch import resolve_model
from ntio.formats.store import STORE_SUFFIX, convert

_CHILD = r"""
import json, sys
import torch
import ntio
path, verify, tokens, threads = sys.argv[1], sys.argv[2] == "on", int(sys.argv[3]), int(sys.argv[4])
depth = int(sys.argv[5]) if sys.argv[5] != "auto" else None
torch.set_num_threads(threads)
m = ntio.load(path, max_context=512, tiers="C", verify=verify, prefetch_depth=depth)
prompt = "Write a short paragraph about rivers."
m.generate(prompt, chat=True, max_new_tokens=4)  # warm-up: first-touch pages, kernel thread pool
before = len(m.stats.forwards)
c = m.generate(prompt, chat=True, max_new_tokens=tokens)
decode = [f for f in m.stats.forwards[before:] if f.n_tokens == 1]
busy = sum(f.io_busy_s for f in decode)
print(json.dumps({"tok_s": c.decode_tok_s, "disk_gb_s": sum(f.bytes_read for f in decode) / busy / 1e9,
                  "bytes_per_token": decode[-1].bytes_read}))
"""


def _run(path: str, verify: str, tokens: int, threads: int, depth: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, path, verify, str(tokens), str(threads), depth],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def store_of(model: str | None) -> Path:
    path = resolve_model(model)
    if path.suffix == STORE_SUFFIX:
        return path
    store = path.with_suffix(STORE_SUFFIX)
    if not store.exists():
        convert(path, store)
    return store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path or name (default: smollm2-135m)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefetch-depth", default="auto", help="streamed groups read ahead (default: the loader's)")
    args = ap.parse_args()
    path = str(store_of(args.model))
    rounds = []
    for r in range(args.rounds):
        row = {}
        for verify in (["on", "off"] if r % 2 == 0 else ["off", "on"]):
            for key, value in _run(path, verify, args.tokens, args.threads, args.prefetch_depth).items():
                row[f"{key}_{verify}"] = value
        rounds.append(row)
        print(json.dumps({"round": r, **row}), file=sys.stderr)
    result = {"model": os.path.basename(path), "machine": platform.processor() or platform.machine(),
              "threads": args.threads, "tokens": args.tokens, "prefetch_depth": args.prefetch_depth, "bytes_per_token": rounds[0]["bytes_per_token_on"],
              "rounds": rounds}
    for key in ("tok_s", "disk_gb_s"):
        for verify in ("on", "off"):
            result[f"{key}_{verify}_median"] = statistics.median(r[f"{key}_{verify}"] for r in rounds)
    result["tok_s_on_off_ratio_median"] = statistics.median(r["tok_s_on"] / r["tok_s_off"] for r in rounds)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
