"""Matrix-vector products straight from GGUF-encoded weights on CPU (Rust kernels in `ntio._core`).

For a few activation rows (decode, speculative verification: T <= 16) the product is memory-bound, so reading the
encoded blocks (~4.5-8.5 bits per weight) instead of dequantized float32 weights is several times faster. The
activations stay float32 and sums are float32 (each block computes d * Σ q·x + m * Σ x), so results agree with
`F.linear(x, dequantize(raw))` to ~1e-6 relative. Larger batches: dequantize and use a dense matmul.
"""

from __future__ import annotations

import gguf
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


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")


def quantized_linear(x: torch.Tensor, raw: torch.Tensor, qtype: gguf.GGMLQuantizationType | int,
                     shape: tuple[int, int], out: torch.Tensor | None = None, *, scalar: bool = False) -> torch.Tensor:
    """x [T, K] float32 · Wᵀ -> [T, N] float32, with W of `shape` (N, K) given as its GGUF encoding `raw`.

    x: contiguous float32 CPU tensor, 1 <= T <= MAX_ROWS. raw: contiguous 1-D uint8 CPU tensor of exactly the
    encoded size. out: optional contiguous float32 [T, N] CPU tensor, not overlapping x or raw.
    `scalar=True` forces the portable kernels (for tests). Errors: ValueError / TypeError naming the problem.
    """
    try:
        qt = T(int(qtype))
    except ValueError:
        raise ValueError(f"ggml type {int(qtype)} is not a known ggml type") from None
    if qt not in KERNEL_TYPES:
        names = ", ".join(sorted(t.name for t in KERNEL_TYPES))
        raise ValueError(f"tensor type {qt.name} is not supported by the CPU kernels (supported: {names})")
    n, k = (int(s) for s in shape)
    _check("x", x, torch.float32, 2)
    _check("raw", raw, torch.uint8, 1)
    t = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weights {tuple(shape)} need {k}")
    if not 1 <= t <= MAX_ROWS:
        raise ValueError(f"x has {t} rows; the CPU kernels take 1 to {MAX_ROWS} (dequantize for more)")
    if out is None:
        out = torch.empty((t, n), dtype=torch.float32)
    else:
        _check("out", out, torch.float32, 2)
        if tuple(out.shape) != (t, n):
            raise ValueError(f"out must have shape {(t, n)}, got {tuple(out.shape)}")
    # x, raw and out are referenced here until the call returns, which keeps their memory alive.
    _core.quantized_matmul(x.data_ptr(), t, k, raw.data_ptr(), raw.numel(), int(qt), n, out.data_ptr(), scalar=scalar)
    return out
