"""ntio (every layer resident, and every layer read from disk at each use) against llama.cpp on the same GGUF.

Each engine runs in a fresh process: load, then one greedy chat completion of `--tokens` tokens on the same prompt
(for ntio as plain text where the model has no chat template, as the synthetic ones: llama-cpp-python then applies
its default format), with the same thread count; decode and prefill tok/s come from each engine's own counters
(ntio's Completion, llama.cpp's perf context via ../shared/tools/llamacpp_decode.py). Engines alternate within every
round (the order rotates), and the result is one JSON object: per-round figures, medians, and median per-round
ratios to llama.cpp.

Each round also measures the roofline of resident decode: a step over resident weights reads every weight byte once
(every layer, the final norm and the output head; of the token embedding only a row), so it takes at least those
bytes / the rate the kernel threads read RAM (`ntio-bench memory`, measured in this process after the engines).
`*_decode_vs_memory_bound` is each engine's decode rate over that bound: 1.0 is a step that does nothing but read
its weights at the RAM's rate.

    python benches/decode_vs_llamacpp.py [--model NAME|PATH] [--rounds 3] [--tokens 64] [--threads 2]
                                         [--summarize FILE --ctx-size 4096]   (a long context)
                                         [--kv-dtype float32|float16|bfloat16]   (ntio's KV cache)
                                         [--llamacpp PYTHON]   (the peer's venv, built by build-llamacpp.sh)

`--summarize FILE` asks each engine to summarize FILE's text instead of the short question: decode then attends
over the whole text (tests/data/apache-2.0.txt is ~2,500 tokens). There the KV cache adds its own bytes to a step,
beyond the weights' memory bound below: llama.cpp's in float16 (its default), ntio's in `--kv-dtype` (float32 unless
told; float16 stores what llama.cpp stores).
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

from ntio import _core
from ntio.fetch import resolve_model
from ntio.formats.model_file import open_model_file
from ntio.plots import check_figure_path
from figures import decode_vs_llamacpp as draw

PROMPT = "Write a short paragraph about rivers."
PEER_SCRIPT = Path(__file__).resolve().parents[2] / "shared" / "tools" / "llamacpp_decode.py"
PEER_PYTHON = Path.home() / ".cache" / "ntio-peers" / "llamacpp-venv" / "bin" / "python"

_NTIO = r"""
import json, sys
import ntio
from ntio.formats.model_file import open_model_file
from ntio.kernels import cpu_kernels
path, tiers, prompt, kv_dtype = sys.argv[1], sys.argv[2], sys.argv[5], sys.argv[7]
tokens, threads, ctx = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[6])
cpu_kernels.set_threads(threads)
m = ntio.load(path, max_context=ctx, tiers=tiers, threads=threads, kv_dtype=kv_dtype)
chat = "tokenizer.chat_template" in open_model_file(path).metadata  # synthetic models have none: plain text
c = m.generate(prompt, chat=chat, max_new_tokens=tokens)
print(json.dumps({"decode_tok_s": c.decode_tok_s, "prefill_tok_s": c.prefill_tok_s,
                  "read_mb_per_token": m.stats.summary()["bytes_read_per_token"] / 1e6}))
"""


# RAM read per pass of the roofline probe: far beyond the caches.
MEMORY_PROBE_BYTES = 1 << 30


def _step_bytes(path: str) -> int:
    """The weight bytes a resident decode step reads: every layer's tensors, the final norm and the output head (the
    token embedding where the head is tied to it)."""
    tensors = open_model_file(path).tensors
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    return sum(t.nbytes for name, t in tensors.items()
               if name.startswith("blk.") or name in (head, "output_norm.weight"))


def _memory_gb_s(threads: int) -> float:
    """The kernel threads' RAM read rate, the median of 5 passes (`ntio-bench memory`)."""
    _core.set_kernel_threads(threads)
    return MEMORY_PROBE_BYTES / statistics.median(_core.memory_read_seconds(MEMORY_PROBE_BYTES, 5)) / 1e9


def _last_json(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path or name (default: smollm2-135m)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--summarize", type=Path, help="ask for a summary of this file's text (a long context)")
    ap.add_argument("--ctx-size", type=int, default=1024, help="both engines' context")
    ap.add_argument("--kv-dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                    help="ntio's KV cache dtype (llama.cpp's: float16)")
    ap.add_argument("--llamacpp", default=str(PEER_PYTHON), help="python of the llama-cpp-python venv")
    ap.add_argument("--plot", type=Path, help="draw the result into this PNG (benches/figures.py)")
    args = ap.parse_args()
    if args.plot:
        check_figure_path(args.plot)
    path = str(resolve_model(args.model))
    prompt = PROMPT if args.summarize is None else f"Summarize this text:\n\n{args.summarize.read_text()}"
    ntio_args = [str(args.tokens), str(args.threads), prompt, str(args.ctx_size), args.kv_dtype]
    runs = {
        "ntio_resident": lambda: _last_json([sys.executable, "-c", _NTIO, path, "A", *ntio_args]),
        "ntio_all_c": lambda: _last_json([sys.executable, "-c", _NTIO, path, "C", *ntio_args]),
        "llamacpp": lambda: _last_json([args.llamacpp, str(PEER_SCRIPT), path, str(args.tokens), prompt],
                                       env={**os.environ, "THREADS": str(args.threads), "NCTX": str(args.ctx_size)}),
    }
    names = list(runs)
    step_bytes = _step_bytes(path)
    rounds = []
    for r in range(args.rounds):
        row = {}
        for name in names[r % len(names):] + names[: r % len(names)]:
            result = runs[name]()
            row.update({f"{name}_{k}": v for k, v in result.items() if isinstance(v, float)})
        row["memory_gb_s"] = _memory_gb_s(args.threads)
        row["memory_bound_decode_tok_s"] = row["memory_gb_s"] * 1e9 / step_bytes
        rounds.append(row)
        print(json.dumps({"round": r, **row}), file=sys.stderr)
    summary = {"model": os.path.basename(path), "machine": platform.processor() or platform.machine(),
               "threads": args.threads, "tokens": args.tokens, "prompt": "question" if args.summarize is None else
               f"summarize {args.summarize.name}", "ctx_size": args.ctx_size, "ntio_kv_dtype": args.kv_dtype,
               "llamacpp_kv_dtype": "float16", "step_mb": step_bytes / 1e6,
               "rounds": rounds}
    for key in rounds[0]:
        summary[f"{key}_median"] = statistics.median(row[key] for row in rounds)
    for name in ("ntio_resident", "ntio_all_c"):
        for what in ("decode_tok_s", "prefill_tok_s"):
            ratios = [row[f"{name}_{what}"] / row[f"llamacpp_{what}"] for row in rounds]
            summary[f"{name}_{what}_vs_llamacpp"] = statistics.median(ratios)
    for name in ("ntio_resident", "llamacpp"):
        summary[f"{name}_decode_vs_memory_bound"] = statistics.median(
            row[f"{name}_decode_tok_s"] / row["memory_bound_decode_tok_s"] for row in rounds)
    print(json.dumps(summary))
    if args.plot:
        draw(summary, args.plot)


if __name__ == "__main__":
    main()
