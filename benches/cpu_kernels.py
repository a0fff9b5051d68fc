"""CPU decode-step cost: `cpu_kernels.quantized_linear` on GGUF blocks vs `F.linear` on dequantized fp32 weights.

Cache-cold like a real decode step: one pass runs every matrix of a SmolLM2-135M-shaped model once (30 layers of
distinct Q4_1 matrices: fused q/k/v 960x576, o 576x576, fused gate+up 3072x576, down 576x1536; then the Q8_0
49152x576 head), for T activation rows. Passes alternate A B A B; medians are reported. Prints JSON.

    python benches/cpu_kernels.py [--threads 2] [--repeats 7] [--rows 1 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from ntio.kernels import cpu_kernels, quant

LAYERS = 30
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (T.Q8_0, (49152, 576))


def build() -> list[tuple[T, tuple[int, int], torch.Tensor, torch.Tensor]]:
    rng = np.random.default_rng(0)
    mats = [(T.Q4_1, s) for _ in range(LAYERS) for s in LAYER_SHAPES] + [HEAD]
    out = []
    for qtype, shape in mats:
        raw = torch.from_numpy(quant.random_quantized(qtype, shape, rng).reshape(-1))
        out.append((qtype, shape, raw, quant.dequantize(raw, qtype, shape)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu_kernels.set_threads(args.threads)
    mats = build()
    result = {"threads": args.threads, "repeats": args.repeats, "matrices": len(mats),
              "encoded_mb": round(sum(m[2].numel() for m in mats) / 1e6, 1),
              "fp32_mb": round(sum(m[3].numel() * 4 for m in mats) / 1e6, 1), "rows": {}}
    for t in args.rows:
        xs = {k: torch.randn(t, k) for k in {s[1] for _, s, _, _ in mats}}
        outs = [torch.empty(t, s[0]) for _, s, _, _ in mats]  # kernel outputs (F.linear allocates its own)

        def kernel_pass() -> None:
            for (qtype, shape, raw, _), out in zip(mats, outs):
                cpu_kernels.quantized_linear(xs[shape[1]], raw, qtype, shape, out)

        def dense_pass() -> None:
            for _, shape, _, w in mats:
                F.linear(xs[shape[1]], w)

        times: dict[str, list[float]] = {"kernel": [], "dense": []}
        kernel_pass(), dense_pass()  # warm-up
        for _ in range(args.repeats):
            for name, fn in (("kernel", kernel_pass), ("dense", dense_pass)):
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        kernel_ms, dense_ms = statistics.median(times["kernel"]), statistics.median(times["dense"])
        result["rows"][str(t)] = {"kernel_ms": round(kernel_ms, 2), "dense_fp32_ms": round(dense_ms, 2),
                                  "speedup": round(dense_ms / kernel_ms, 2),
                                  "kernel_ms_all": [round(v, 2) for v in times["kernel"]],
                                  "dense_ms_all": [round(v, 2) for v in times["dense"]]}
    # sanity: both passes compute the same thing
    x = torch.randn(1, 576)
    qtype, shape, raw, w = mats[2]
    err = (cpu_kernels.quantized_linear(x, raw, qtype, shape) - F.linear(x, w)).norm() / F.linear(x, w).norm()
    result["check_rel_err"] = float(err)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
