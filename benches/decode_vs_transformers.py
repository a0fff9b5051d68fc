"""Resident CPU decode speed: ntio vs Hugging Face transformers on the same GGUF, alternating in one run.

Both decode greedily 64 tokens after the same prompt with the same thread count. Decode tok/s is measured the
same way for both: (tokens - 1) / (time of the last token - time of the first token), i.e. prefill excluded.
Prints one JSON object: per-round rates, medians, and the median of the per-round ratios.

    python benches/decode_vs_transformers.py [--model PATH] [--rounds 5] [--threads 2] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

import ntio
from ntio.fetch import resolve_model

PROMPT = "Once upon a time, in a small village by the sea, there lived"


class _Timestamps(BaseStreamer):
    """Records when each generated token arrives (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.seen_prompt = False

    def put(self, value) -> None:
        if self.seen_prompt:
            self.times.append(time.perf_counter())
        self.seen_prompt = True

    def end(self) -> None:
        pass


def hf_decode_tok_s(model, ids: list[int], n_tokens: int) -> float:
    stamps = _Timestamps()
    with torch.inference_mode():
        model.generate(torch.tensor([ids]), max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False,
                       streamer=stamps, pad_token_id=0)
    return (len(stamps.times) - 1) / (stamps.times[-1] - stamps.times[0])


def ntio_decode_tok_s(llm: ntio.LLM, ids: list[int], n_tokens: int) -> float:
    stamps = []
    for _ in llm.stream(ids, n_tokens, stop=()):
        stamps.append(time.perf_counter())
    assert len(stamps) == n_tokens, "generation stopped early; use a prompt that does not reach EOS"
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)

    llm = ntio.load(path, max_context=512)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = llm.encode_prompt(PROMPT)
    # Warm up both (allocator, first-call dispatch), then alternate A B A B.
    ntio_decode_tok_s(llm, ids, 8)
    hf_decode_tok_s(hf, ids, 8)
    ours, theirs = [], []
    for _ in range(args.rounds):
        ours.append(ntio_decode_tok_s(llm, ids, args.tokens))
        theirs.append(hf_decode_tok_s(hf, ids, args.tokens))
    ratios = [a / b for a, b in zip(ours, theirs)]
    print(json.dumps({
        "benchmark": "resident_cpu_decode", "model": path.name, "tokens": args.tokens, "threads": args.threads,
        "rounds": args.rounds, "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__, "ntio_decode_tok_s": [round(x, 2) for x in ours],
        "transformers_decode_tok_s": [round(x, 2) for x in theirs],
        "ntio_median_tok_s": round(statistics.median(ours), 2),
        "transformers_median_tok_s": round(statistics.median(theirs), 2),
        "median_ratio": round(statistics.median(ratios), 3),
    }))


if __name__ == "__main__":
    main()
