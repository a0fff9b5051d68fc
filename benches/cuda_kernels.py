"""CUDA products straight from GGUF blocks (ntio.kernels.cuda_kernels) against the engine's other CUDA path,
dequantizing into float32 then cuBLAS (what `ops.linear` does without CuPy, or for more than MAX_ROWS tokens), on one
GPU, side by side. Prints one JSON object (and writes it with --out).

    python benches/cuda_kernels.py [--model SmolLM2-135M-Instruct.Q4_1.gguf] [--rounds 3] [--out FILE.json]

Per type and T: the median time of one product with an 8B-shaped FFN matrix (14336 x 4096 and 4096 x 14336), both
ways, and the kernels' weight bytes per second (each weight byte is read once per product). With --model: resident
decode tok/s with and without the kernels, rounds alternating, and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import torch

import ntio
from ntio.kernels import cuda_kernels, ops, quant

T = gguf.GGMLQuantizationType
TYPES = (T.Q4_K, T.Q6_K, T.Q8_0, T.TQ2_0, T.TQ1_0)
SHAPES = {"up": (14336, 4096), "down": (4096, 14336)}
ROWS = (1, 8, 16)
PROMPT = "Streaming layers from disk lets a small machine run a model that does not fit in its memory, because"


@contextmanager
def kernels_off() -> Iterator[None]:
    """Every CUDA product dequantizes, as without CuPy."""
    available = cuda_kernels.available
    cuda_kernels.available = lambda: False
    try:
        yield
    finally:
        cuda_kernels.available = available


def median_ms(fn: Callable[[], object], repeats: int = 15, calls: int = 10) -> float:
    """Median over `repeats` samples of the time of one fn() by CUDA events, each sample `calls` calls back to back
    (so the device runs them queued, and launch latency on the host stays out), after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def products() -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for qtype in TYPES:
        for name, shape in SHAPES.items():
            raw = torch.from_numpy(quant.random_quantized(qtype, shape, rng).reshape(-1)).cuda()
            w = ops.EncodedMatrix(raw, qtype, shape)
            for t in ROWS:
                x = torch.randn((t, shape[1]), device="cuda")
                kernel = median_ms(lambda: ops.linear(x, w))
                with kernels_off():
                    dequantizing = median_ms(lambda: ops.linear(x, w))
                rows.append({"type": qtype.name, "matrix": name, "shape": list(shape), "tokens": t,
                             "kernel_ms": round(kernel, 4), "dequantize_ms": round(dequantizing, 4),
                             "speedup": round(dequantizing / kernel, 2),
                             "kernel_weight_gb_s": round(raw.numel() / kernel / 1e6, 1)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def decode(model: Path, rounds: int, tokens: int = 64) -> dict:
    m = ntio.load(model, device="cuda", max_context=512)
    try:
        runs: dict[str, list[float]] = {"kernels": [], "dequantize": []}
        for _ in range(rounds):
            runs["kernels"].append(m.generate(PROMPT, max_new_tokens=tokens, temperature=0.0).decode_tok_s)
            with kernels_off():
                runs["dequantize"].append(m.generate(PROMPT, max_new_tokens=tokens, temperature=0.0).decode_tok_s)
    finally:
        m.close()
    ratios = [a / b for a, b in zip(runs["kernels"], runs["dequantize"])]
    return {"model": model.name, "tokens": tokens, "tok_s": runs, "ratio_median": round(statistics.median(ratios), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "products": products()}
    if args.model:
        result["decode"] = decode(args.model, args.rounds)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
