"""GPU figures for issue 4: pinned H2D bandwidth of ntio's streaming path against a plain cudaMemcpyAsync, and the
overlap ratio while streaming a 70B-shaped synthetic model under a small device budget. Prints one JSON object.

    python benches/gpu_check.py [--layers 6] [--tokens 4] [--gpu-memory-budget 3GB]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import ntio
from ntio.synth import preset, write_synthetic_gguf


def memcpy_peak_gb_s(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """cudaMemcpyAsync (torch copy_ from pinned memory, non_blocking) of one large buffer, timed with events."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return statistics.median(rates)


def timed_decode(path: Path, tokens: int, **options) -> tuple[float, dict, str]:
    """(seconds for `tokens` greedy decode steps on CUDA, stream stats of those steps, tier plan)."""
    m = ntio.load(path, device="cuda", max_context=128, **options)
    try:
        logits = m.engine.forward(torch.tensor([1, 2, 3], device="cuda"), 0)
        m.stats.reset()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for step in range(tokens):
            logits = m.engine.forward(logits.argmax().view(1), 3 + step)
        torch.cuda.synchronize()
        return time.perf_counter() - start, m.stats.summary(), m.plan.describe()
    finally:
        m.close()


def streamed_h2d_gb_s(path: Path, tokens: int) -> dict:
    """Every layer in tier B (pinned host RAM): decode is bound by the copies, so bytes copied per second is the
    H2D bandwidth ntio's copy stream achieves (compute overlaps it)."""
    elapsed, s, _ = timed_decode(path, tokens, tiers="B")
    return {"tok_s": tokens / elapsed, "h2d_gb_s": s["bytes_h2d"] / elapsed / 1e9,
            "bytes_h2d_per_token": s["bytes_h2d_per_token"]}


def streamed_overlap(path: Path, tokens: int, budget: str) -> dict:
    elapsed, s, plan = timed_decode(path, tokens, gpu_memory_budget=budget, ram_budget="1GB")
    return {"tiers": plan, "tok_s": tokens / elapsed, "overlap_ratio": s["overlap_ratio"], "disk_gb_s": s["disk_gb_s"],
            "bytes_read_per_token": s["bytes_read_per_token"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--gpu-memory-budget", default="3GB")
    ap.add_argument("--dir", default="/var/tmp")
    args = ap.parse_args()
    path = Path(args.dir) / f"ntio-synth-70b-{args.layers}l.gguf"
    if not path.exists():
        write_synthetic_gguf(path, preset("70b", n_layers=args.layers, vocab_size=32000))
    peak = memcpy_peak_gb_s()
    h2d = streamed_h2d_gb_s(path, args.tokens)
    result = {
        "device": torch.cuda.get_device_name(), "model": path.name, "file_gb": path.stat().st_size / 1e9,
        "memcpy_peak_gb_s": peak, "streamed": h2d, "h2d_ratio_to_peak": h2d["h2d_gb_s"] / peak,
        "overlap": streamed_overlap(path, args.tokens, args.gpu_memory_budget),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
