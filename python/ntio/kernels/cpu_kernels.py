"""Matrix-vector products straight from GGUF-encoded weights on CPU (Rust kernels in `ntio._core`).

For a few activation rows (decode, speculative verification: T <= 16) the product is memory-bound, so reading the
encoded blocks (~4.5-8.5 bits per weight) instead of dequantized float32 weights is several times faster. The
activations stay float32 and sums are float32 (each block computes d * Σ q·x + m * Σ x), so results agree with
`F.linear(x, dequantize(raw))` to ~1e-6 relative. Larger batches: dequantize and use a dense matmul.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import gguf
import numpy as np
import torch

from ntio import _core

T = gguf.GGMLQuantizationType

KERNEL_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset(T(i) for i in _core.KERNEL_TYPES)
MAX_ROWS: int = _core.KERNEL_MAX_T  # most activation rows per call


def set_threads(n: int) -> None:
    """Use `n` kernel threads (0: one per available CPU). Results do not depend on the thread count."""
    if n < 0:
        raise ValueError(f"thread count must be >= 0, got {n}")
    _core.set_kernel_threads(n)


def threads() -> int:
    """Kernel threads in use."""
    return _core.kernel_threads()


@contextmanager
def using_threads(n: int | None) -> Iterator[None]:
    """Run with `n` kernel threads (None: as they are), then restore the count: one engine's setting never leaks
    into another's steps. The pool is rebuilt only when the count changes (engines of one count share it)."""
    before = threads()
    if n is None or n == before:
        yield
        return
    set_threads(n)
    try:
        yield
    finally:
        set_threads(before)


_DTYPES = {"x": torch.float32, "raw": torch.uint8, "out": torch.float32}  # what each argument must be


def _array(name: str, t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of CPU tensor `t` (the Rust binding checks its dtype, layout and size)."""
    try:
        return t.numpy()
    except AttributeError:
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}") from None
    except (TypeError, RuntimeError):  # not on the CPU, a dtype numpy lacks, or requires grad
        if not isinstance(t, torch.Tensor):
            raise
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {t.device}") from None
        if t.requires_grad:
            return t.detach().numpy()
        raise ValueError(f"{name} must be {_DTYPES[name]}, got {t.dtype}") from None


def quantized_linear(x: torch.Tensor, raw: torch.Tensor, qtype: gguf.GGMLQuantizationType | int,
                     shape: tuple[int, int], out: torch.Tensor | None = None, *, scalar: bool = False) -> torch.Tensor:
    """x [T, K] float32 · Wᵀ -> [T, N] float32, with W of `shape` (N, K) given as its GGUF encoding `raw`.

    x: contiguous float32 CPU tensor, 1 <= T <= MAX_ROWS. raw: contiguous 1-D uint8 CPU tensor of exactly the
    encoded size. out: optional contiguous float32 [T, N] CPU tensor, not overlapping x or raw.
    `scalar=True` forces the portable kernels (for tests). Errors: ValueError (`_core.BufferError` for a buffer
    of the wrong dtype, layout or overlap) / TypeError naming the problem.
    """
    try:
        qt = T(int(qtype))
    except ValueError:
        raise ValueError(f"ggml type {int(qtype)} is not a known ggml type") from None
    if qt not in KERNEL_TYPES:
        names = ", ".join(sorted(t.name for t in KERNEL_TYPES))
        raise ValueError(f"tensor type {qt.name} is not supported by the CPU kernels (supported: {names})")
    n, k = (int(s) for s in shape)
    xa, rawa = _array("x", x), _array("raw", raw)
    if xa.ndim != 2:
        raise ValueError(f"x must be 2-D, got shape {xa.shape}")
    if rawa.ndim != 1:
        raise ValueError(f"raw must be 1-D, got shape {rawa.shape}")
    t = xa.shape[0]
    if xa.shape[1] != k:
        raise ValueError(f"x has {xa.shape[1]} columns, the weights {tuple(shape)} need {k}")
    if not 1 <= t <= MAX_ROWS:
        raise ValueError(f"x has {t} rows; the CPU kernels take 1 to {MAX_ROWS} (dequantize for more)")
    if out is None:
        outa = np.empty((t, n), np.float32)
        out = torch.from_numpy(outa)  # ~1 us, vs ~4 us for torch.empty(...).numpy()
    else:
        outa = _array("out", out)
        if outa.shape != (t, n):
            raise ValueError(f"out must have shape {(t, n)}, got {tuple(outa.shape)}")
    # The Rust binding checks dtypes, C-contiguity, out writable and overlapping neither x nor raw, and sizes; the
    # arrays' buffer exports hold the tensors' memory until it returns.
    _core.quantized_matmul(xa, t, k, rawa, int(qt), n, outa, scalar=scalar)
    return out
