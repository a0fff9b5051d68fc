"""CPU decode-step cost of the kernel pass: every matrix of a model once, for T activation rows, through the
kernels' binding (`_core.quantized_matmul`, as `cpu_kernels.quantized_linear` calls it) with 8-bit activations (the
default), with float32 activations (the reference path), and (synthetic model only) as `F.linear` on dequantized
fp32 weights.

Cache-cold like a real decode step: before every timed pass a 128 MB buffer is written, so no pass finds the
weights the pass before it left in the last-level cache (a pass run right after the dense one, which evicts
everything, took ~40% longer at T = 8 than the same pass after another quantized one on the AVX-512 EPYC VM).

The model: `--model NAME|PATH` (a real GGUF: every layer matrix in file order, then the output head), or by
default a SmolLM2-135M-shaped synthetic one (30 layers of distinct Q4_1 matrices: fused q/k/v 960x576, o 576x576,
fused gate+up 3072x576, down 576x1536; then the Q8_0 49152x576 head). Passes
alternate A B C A B C; medians are reported, with each T's cost relative to T = 1 (`vs_t1`: what a speculative
verification pass of T tokens costs against one decode step). `--isa best avx2` adds the 8-bit pass of every further
kernel set named (`int8_avx2_ms`, and its time over the first set's, `int8_avx2_vs_int8`), alternating with the
rest. `--layout resident` (the default) gives each pass the matrices as the engine holds them resident: Q4_1, Q4_K
and (with AVX-512 VNNI, not AMX) Q6_K rows, a layer's or the output head's, interleaved by eight
(`ops.interleave_rows`) where the pass's kernel set takes that layout (`_core.interleaved_kernels`), the file's rows
elsewhere; `--layout file`: the file's rows everywhere, as streamed layers are read. `--against FILE` adds the 8-bit
pass (first `--isa`) of another build of the Rust core: its extension file, a copy of another commit's
`python/ntio/_core.abi3.so` with the same Python interface (kernel type ids, `quantized_matmul`), loaded beside this
one in the same process (`int8_against_ms`; this build's time over it, `int8_vs_against`): two builds side by side
without a process's noise between them. Each takes its own resident layout (`RESIDENT_INTERLEAVED_TYPES`; before
Q6_K's, every type of `INTERLEAVED_TYPES`), and both must give equal outputs (Q4_K's changed at ad3f836, when it
took the interleaved layout). `--types Q6_K ...` keeps only the matrices of those GGUF types: one type's share of
the pass. Prints JSON.

    python benches/cpu_kernels.py [--model NAME|PATH] [--threads 2] [--repeats 7] [--rows 1 8 16] [--isa best avx2]
                                  [--layout resident|file] [--against OTHER_CORE.so] [--types Q6_K ...]
"""

from __future__ import annotations

import os

# torch's OpenMP workers (libgomp) spin for milliseconds after each parallel op, here the cache-evicting write
# before every timed pass, and on a 2-vCPU machine they took a core from the pass's kernel threads: the cold
# two-thread passes of two identical builds differed by 20-70%, and every pass ran slower (100 Q4_1 matrices of
# 1536 x 576: 3.8-6.5 / 7.9-11.6 / 12.8-17.7 ms at T = 1 / 8 / 16; with the workers sleeping at once, 2.8-3.2 /
# 4.6-4.8 / 7.8-8.0, identical builds within 6%). Set before torch loads libgomp; the environment's setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402 (after the OpenMP setting)
import functools
import importlib.machinery
import importlib.util
import json
import statistics
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from ntio import _core
from ntio.io import HostArena
from ntio.kernels import cpu_kernels, ops, quant

LAYERS = 30
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (T.Q8_0, (49152, 576))


def build() -> list[tuple[T, tuple[int, int], torch.Tensor, torch.Tensor | None]]:
    """The synthetic SmolLM2-shaped matrices, each with its dequantized fp32 copy."""
    rng = np.random.default_rng(0)
    mats = [(T.Q4_1, s) for _ in range(LAYERS) for s in LAYER_SHAPES] + [HEAD]
    out = []
    for qtype, shape in mats:
        raw = torch.from_numpy(quant.random_quantized(qtype, shape, rng).reshape(-1))
        out.append((qtype, shape, raw, quant.dequantize(raw, qtype, shape)))
    return out


def load(model: str) -> list[tuple[T, tuple[int, int], torch.Tensor, torch.Tensor | None]]:
    """Every 2-D layer matrix of a real model file (GGUF, store or checkpoint) in file order, then the output head (the
    embedding when tied)."""
    from ntio.fetch import resolve_model
    from ntio.formats.model_file import open_model_file

    g = open_model_file(resolve_model(model))
    names = [n for n, info in g.tensors.items() if n.startswith("blk.") and len(info.shape) == 2]
    names.append("output.weight" if "output.weight" in g.tensors else "token_embd.weight")
    return [(T(g.tensors[n].qtype), tuple(g.tensors[n].shape), torch.from_numpy(np.array(g.tensor_bytes(n))), None)
            for n in names]


def in_huge_pages(raws: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `raws` in one `HostArena`: in huge pages, as the engine keeps resident layers (and reads streamed
    ones into its staging slots). In 4 KiB pages a pass ran ~10% slower at every T (SmolLM2, 2026-11-29)."""
    arena = HostArena([raw.numel() for raw in raws])
    copies = []
    for raw in raws:
        copy = torch.from_numpy(arena.take(raw.numel()))
        copy.copy_(raw)
        copies.append(copy)
    return copies


def interleaved(mats: list, core: ModuleType) -> list[tuple[int, tuple[int, int], torch.Tensor]]:
    """(kernel type id, shape, bytes) of each matrix as the engine keeps it resident under build `core`'s interleaving
    kernels, on a copy in huge pages: a matrix (a layer's, or the output head) of a type whose resident matrices take
    the interleaved layout there (`ops.interleave_rows`, `RESIDENT_INTERLEAVED_TYPES`) in that layout, the rest in
    the file's rows."""
    types = getattr(core, "RESIDENT_INTERLEAVED_TYPES", core.INTERLEAVED_TYPES)  # builds before Q6_K's layout: all
    out = []
    for (qtype, shape, _, _), copy in zip(mats, in_huge_pages([m[2] for m in mats])):
        kind = int(qtype)
        if kind in types and shape[0] % ops.INTERLEAVE_ROWS == 0:  # (the layouts are the same in every build)
            kind = _core.interleave(copy.numpy(), kind, *shape)
        out.append((kind, shape, copy))
    return out


def other_build(path: Path) -> ModuleType:
    """Another build of ntio._core from its extension file, beside this one: its own code and kernel threads."""
    loader = importlib.machinery.ExtensionFileLoader("ntio._core", str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("ntio._core", loader))
    loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--model", help="a real GGUF (name or path) instead of the synthetic SmolLM2-shaped matrices")
    ap.add_argument("--isa", nargs="+", default=["best"],
                    help="kernel sets of the 8-bit passes (best, avx512, avx2, neon, scalar); the first is `int8`")
    ap.add_argument("--layout", choices=["resident", "file"], default="resident",
                    help="resident: Q4_1 and Q4_K rows interleaved by eight where the kernel set takes it; "
                         "file: as read")
    ap.add_argument("--against", type=Path,
                    help="another build's _core extension file: its 8-bit pass beside this one's")
    ap.add_argument("--types", nargs="+", metavar="TYPE",
                    help="only the matrices of these GGUF types (e.g. Q6_K): one type's share of the pass")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu_kernels.set_threads(args.threads)
    this = _core
    against = other_build(args.against) if args.against else None
    if against is not None:
        if against is this or args.against.resolve() == Path(this.__file__).resolve():
            raise SystemExit(f"--against {args.against}: that is this build")
        if against.interleaved_kernels(args.isa[0], True) != this.interleaved_kernels(args.isa[0], True):
            raise SystemExit(f"--against {args.against}: its kernels take another layout of resident rows")
        against.set_kernel_threads(args.threads)
    mats = load(args.model) if args.model else build()
    if args.types:
        mats = [m for m in mats if m[0].name in args.types]
        if not mats:
            raise SystemExit(f"--types {' '.join(args.types)}: the model has no matrix of these types")
    plain = [(q, shape, raw) for (q, shape, _, _), raw in zip(mats, in_huge_pages([m[2] for m in mats]))]
    # The matrices each build's passes take: its resident layout, or (`--layout file`, or kernels without the layout)
    # the file's rows.
    layouts = {core: interleaved(mats, core) if args.layout == "resident" else plain
               for core in (this, against) if core is not None}
    evict = torch.zeros(128 << 20, dtype=torch.uint8)  # written before each pass: last-level caches hold <= 32 MB
    result = {"model": args.model or "synthetic SmolLM2-shaped Q4_1", "threads": args.threads, "isa": args.isa,
              "repeats": args.repeats, "layout": args.layout, "against": args.against and str(args.against),
              "types": args.types, "matrices": len(mats),
              "encoded_mb": round(sum(m[2].numel() for m in mats) / 1e6, 1), "rows": {}}
    for t in args.rows:
        xs = {k: torch.randn(t, k) for k in {s[1] for _, s, _, _ in mats}}
        outs = [torch.empty(t, s[0]) for _, s, _, _ in mats]  # kernel outputs (F.linear allocates its own)
        against_outs = [torch.empty_like(out) for out in outs]
        x_arrays = {k: x.numpy() for k, x in xs.items()}

        @functools.cache
        def arguments(core: ModuleType, resident: bool) -> list[tuple[np.ndarray, int, int, np.ndarray, np.ndarray]]:
            """(x, kernel type id, N, raw, out) of each matrix as build `core` takes it: in its resident layout, or
            (`--layout file`, or kernels without that layout) in the file's rows."""
            matrices = layouts[core] if resident else plain
            return [(x_arrays[shape[1]], int(kind), shape[0], raw.numpy(), out.numpy())
                    for (kind, shape, raw), out in zip(matrices, against_outs if core is against else outs)]

        def kernel_pass(int8: bool, isa: str = args.isa[0], core: ModuleType = this) -> None:
            # Straight into the binding that `cpu_kernels.fused_linear` ends in, one call per matrix: the engine's
            # layers call the kernels from Rust (`decoder_stack`), so the wrapper's ~4 us of Python checks per
            # matrix (~0.9 ms of SmolLM2's pass at every T, ~15% of its T = 1 pass) are no part of a pass.
            for x, kind, n, raw, out in arguments(core, core.interleaved_kernels(isa, int8)):
                core.quantized_matmul(x, t, x.shape[1], [(raw, kind, n, 1.0)], out, isa=isa, int8=int8, norm=None,
                                      eps=0.0, gate=None)

        def dense_pass() -> None:
            for _, shape, _, w in mats:
                F.linear(xs[shape[1]], w)

        passes = {"int8": lambda: kernel_pass(True), "float32_activations": lambda: kernel_pass(False)}
        for isa in args.isa[1:]:
            passes[f"int8_{isa}"] = lambda isa=isa: kernel_pass(True, isa)
        if against is not None:
            passes["int8_against"] = lambda: kernel_pass(True, core=against)
        if mats[0][3] is not None:
            passes["dense_fp32"] = dense_pass
        times: dict[str, list[float]] = {name: [] for name in passes}
        for fn in passes.values():
            fn()  # warm-up
        for _ in range(args.repeats):
            for name, fn in passes.items():
                evict.add_(1)
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        result["rows"][str(t)] = {f"{name}_ms": round(statistics.median(v), 2) for name, v in times.items()}
        result["rows"][str(t)]["all_ms"] = {name: [round(x, 2) for x in v] for name, v in times.items()}
        for isa in args.isa[1:]:
            row = result["rows"][str(t)]
            row[f"int8_{isa}_vs_int8"] = round(row[f"int8_{isa}_ms"] / row["int8_ms"], 3)
        if against is not None:
            # `outs` last held another pass (float32 activations, another --isa): this build's 8-bit pass again, on
            # the inputs the other build's last pass took.
            kernel_pass(True)
            if not all(torch.equal(a, b) for a, b in zip(outs, against_outs)):
                raise SystemExit(f"{args.against}: its outputs differ from this build's at T = {t}")
            row = result["rows"][str(t)]
            row["int8_vs_against"] = round(row["int8_ms"] / row["int8_against_ms"], 3)
    one = result["rows"].get("1")
    if one:
        for t, row in result["rows"].items():
            row["int8_vs_t1"] = round(row["int8_ms"] / one["int8_ms"], 2)
    # sanity: the 8-bit and float32-activation passes compute nearly the same thing
    qtype, shape, raw, _ = mats[min(2, len(mats) - 1)]
    x = torch.randn(1, shape[1])
    want = cpu_kernels.quantized_linear(x, raw, qtype, shape, int8=False)
    result["int8_vs_float_rel_err"] = float((cpu_kernels.quantized_linear(x, raw, qtype, shape) - want).norm()
                                            / want.norm())
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
