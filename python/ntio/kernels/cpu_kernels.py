"""Matrix-vector products straight from GGUF-encoded weights on CPU (Rust kernels in `ntio._core`).

For a few activation rows (decode, speculative verification: T <= 32) the product is memory-bound, so reading the
encoded blocks (~4.5-8.5 bits per weight) instead of dequantized float32 weights is several times faster, and each
weight block is decoded once per call for all T rows. Longer inputs go through in blocks of MAX_ROWS rows while each
weight row stays in L1 cache, the blocks in tiles that stay in L2 (ntio.kernels.ops uses them for any number of rows
with 8-bit activations, up to 64 with float32 ones; longer float32 passes dequantize for a dense matmul, which is
faster there).

Numerics. By default (`int8=True`) the activations of quantized types are quantized to 8 bits: per 32 elements
exactly as llama.cpp's Q8_0 (d = max|x|/127 as float16, q = round(x/d)) for the 32-element types, per 128 elements
with a float32 d for the K-quants (llama.cpp's Q8_K takes 256: 128 halves the perplexity cost at the same speed,
benches/RESULTS.md), per 256 for the ternary types (as llama.cpp; `_core.KERNEL_SPANS` by type). They meet the weight
codes in exact integer sums, scaled per span in float32: the result equals
`F.linear(x̂, W)` with x̂ the rounded activations to ~1e-6 relative, and differs from float32 activations by
~0.3-1% relative per product. `int8=False` keeps float32
activations (d * Σ q·x + m * Σ x in float32): `F.linear(x, dequantize(raw))` to ~1e-6, the reference path.
Dense types (F32/F16/BF16) always take float32 activations.

Layout. Resident Q4_1, Q4_K and (where AVX-512 VNNI's products run its passes) Q6_K matrices are interleaved at load,
eight rows at a time word by word (`ops.interleave_rows`), where AVX2's 8-bit kernels run
(`KernelChoice.interleaves_rows`): a group of eight rows is
then one linear stream whose scales unpack once for the eight and whose products sum each row in its own vector
lane. They give the plain rows' bits, so streamed layers (plain rows, as read from the file) and resident ones
compute the same.

Kernel sets: `best` (the widest this CPU runs), `amx`, `avx512`, `avxvnni`, `avx2`, `neon` (aarch64), `scalar`; the
environment variable NTIO_CPU_KERNELS forces one for an engine (`KernelChoice.from_env`), and a set the CPU lacks is
refused. On x86 the 8-bit kernels are AVX2's; `best` and `avx512` give them AVX-512 VNNI's products where the CPU has
them, `best` and `avxvnni` AVX-VNNI's (Intel client cores without AVX-512) where it has those instead, and `best` and
`amx` AMX tiles to passes of several rows (Q4_K's and Q6_K's of 5 or more, Q8_0's of 9) where the CPU has AMX,
all with the same results bit for bit (`avx2` forces the AVX2 products).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from ntio import _core
from ntio.errors import OptionError

T = gguf.GGMLQuantizationType

KERNEL_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset(T(i) for i in _core.KERNEL_TYPES)
# The types whose products meet 8-bit activations (dense weights always take float32 ones, in row kernels that a
# float32 GEMM beats for long passes).
QUANTIZED_KERNEL_TYPES = KERNEL_TYPES - {T.F32, T.F16, T.BF16}
# ntio's own ids of rows interleaved by eight (`_core.interleave`), beyond ggml's.
_INTERLEAVED_IDS = frozenset(_core.INTERLEAVED_TYPES.values())
MAX_ROWS: int = _core.KERNEL_MAX_T  # activation rows the kernels take at once (longer inputs run in such blocks)


ISA_ENV = "NTIO_CPU_KERNELS"
ACTIVATIONS = ("int8", "float32")  # what quantized weights meet: 8-bit codes (default) or float32 (reference)


@dataclass(frozen=True)
class KernelChoice:
    """Which CPU kernels an engine's products run: the instruction set and whether activations go to 8 bits."""

    isa: str = "best"
    int8: bool = True

    @classmethod
    def from_env(cls, activations: str = "int8") -> KernelChoice:
        """The set named by NTIO_CPU_KERNELS (default `best`) with `activations` ("int8" or "float32"); an
        unknown set, or one this CPU lacks, is an OptionError naming the variable."""
        if activations not in ACTIVATIONS:
            raise OptionError("cpu_activations", f"must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        isa = os.environ.get(ISA_ENV, "best").strip().lower() or "best"
        try:
            _core.check_kernel_isa(isa)
        except ValueError as e:
            raise OptionError(ISA_ENV, f"= {isa!r}: {e}") from None
        return cls(isa, activations == "int8")

    @functools.cached_property
    def takes_tiles(self) -> bool:
        """Whether passes of several rows take AMX tiles (8-bit activations under `amx`, or under `best` on a CPU with
        AMX), whose layouts of a product's activations take up to 3 bytes per element beside its 8-bit codes:
        Q4_K's by pair of groups (2), Q6_K's and Q8_0's by token (1)."""
        if not self.int8 or self.isa not in ("best", "amx"):
            return False
        try:
            _core.check_kernel_isa("amx")
        except ValueError:
            return False
        return True

    @functools.cached_property
    def takes_long_passes(self) -> bool:
        """Whether products of more than ops.KERNEL_ROWS rows with quantized matrices (QUANTIZED_KERNEL_TYPES) run on
        these kernels rather than dequantizing: with 8-bit activations and vector kernels (the scalar fallback is
        ~12x slower there than a float32 GEMM)."""
        return self.int8 and _core.vectorized_kernels(self.isa)

    @property
    def interleaves_rows(self) -> bool:
        """Whether resident matrices take the interleaved layout (`ops.interleave_rows`) under this choice: where
        its kernels run (AVX2's 8-bit kernels); elsewhere interleaved rows would be restored to rows at every
        product."""
        return _core.interleaved_kernels(self.isa, self.int8)


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


_DTYPES = {"x": torch.float32, "raw": torch.uint8, "out": torch.float32, "norm": torch.float32}  # what each must be


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
                     shape: tuple[int, int], out: torch.Tensor | None = None, *, isa: str = "best",
                     int8: bool = True) -> torch.Tensor:
    """x [T, K] float32 · Wᵀ -> [T, N] float32, with W of `shape` (N, K) given as its GGUF encoding `raw` (or as
    rows `_core.interleave` rewrote, with the id it returned).

    x: contiguous float32 CPU tensor, T >= 1. raw: contiguous 1-D uint8 CPU tensor of exactly the
    encoded size. out: optional contiguous float32 [T, N] CPU tensor, not overlapping x or raw.
    isa: the kernel set (`best`, `amx`, `avx512`, `avxvnni`, `avx2`, `neon`, `scalar`); int8: 8-bit activations (see the
    module's numerics).
    Errors: ValueError (`_core.BufferError` for a buffer of the wrong dtype, layout or overlap; a kernel set this
    CPU lacks) / TypeError naming the problem.
    """
    return fused_linear(x, [(raw, qtype, shape)], out, isa=isa, int8=int8)


Weight = tuple[torch.Tensor, "gguf.GGMLQuantizationType | int", tuple[int, int]]  # (raw, qtype, (N, K))


def fused_linear(x: torch.Tensor, weights: list[Weight], out: torch.Tensor | None = None, *,
                 norm: torch.Tensor | None = None, eps: float = 0.0, gate: str | None = None, isa: str = "best",
                 int8: bool = True) -> torch.Tensor:
    """prologue(x) [T, K] · [W1; W2; ...]ᵀ -> [T, ΣN]: several matrices of one input K, each (raw, qtype, (N, K))
    as in `quantized_linear`, in one call that prepares (and quantizes) the activations once.

    Prologue, in this order: `gate` ("silu" or "relu2") takes x [T, 2K] as [gate | up] rows and multiplies
    act(gate) · up; `norm` [K] float32 applies RMSNorm (x / sqrt(mean(x²) + eps) · norm) to each row. Errors as
    in `quantized_linear`.
    """
    xa = _array("x", x)
    if xa.ndim != 2:
        raise ValueError(f"x must be 2-D, got shape {xa.shape}")
    t = xa.shape[0]
    if t == 0:
        raise ValueError("x has no rows")
    k = weights[0][2][1]
    width = 2 * k if gate else k
    if xa.shape[1] != width:
        raise ValueError(f"x has {xa.shape[1]} columns, the weights [N, {k}] need {width}")
    matrices = []
    for raw, qtype, (n, kw) in weights:
        if kw != k:
            raise ValueError(f"fused matrices must share K: {kw} != {k}")
        rawa = _array("raw", raw)
        if rawa.ndim != 1:
            raise ValueError(f"raw must be 1-D, got shape {rawa.shape}")
        matrices.append((rawa, _kernel_type(qtype), n, 1.0))
    total = sum(m[2] for m in matrices)
    if out is None:
        outa = np.empty((t, total), np.float32)
        out = torch.from_numpy(outa)  # ~1 us, vs ~4 us for torch.empty(...).numpy()
    else:
        outa = _array("out", out)
        if outa.shape != (t, total):
            raise ValueError(f"out must have shape {(t, total)}, got {tuple(outa.shape)}")
    norma = None if norm is None else _array("norm", norm)
    # The Rust binding checks dtypes, C-contiguity, out writable and overlapping neither x nor any raw, and sizes;
    # the arrays' buffer exports hold the tensors' memory until it returns.
    _core.quantized_matmul(xa, t, k, matrices, outa, isa=isa, int8=int8, norm=norma, eps=eps, gate=gate)
    return out


def column_groups_linear(x: torch.Tensor, groups: list[tuple[int, torch.Tensor]],
                         qtype: gguf.GGMLQuantizationType | int, shape: tuple[int, int], width: int,
                         out: torch.Tensor | None = None, *, isa: str = "best", int8: bool = True) -> torch.Tensor:
    """x [T, K] · Wᵀ over some column groups of W (N, K) = `shape`: Σ_j x[:, first_j:first_j + width] · G_jᵀ
    -> [T, N], each group (first_j, raw_j) the encoding of W's columns [first_j, first_j + width) as an [N, width]
    matrix (a store's group-major FFN down copy). The dense product with every other column of x zeroed, up to
    float rounding. Buffers and errors as in `quantized_linear`."""
    xa = _array("x", x)
    if xa.ndim != 2 or xa.shape[1] != shape[1]:
        raise ValueError(f"x must be [T, {shape[1]}], got shape {xa.shape}")
    n = shape[0]
    if out is None:
        out = torch.from_numpy(np.empty((xa.shape[0], n), np.float32))
    outa = _array("out", out)
    if outa.shape != (xa.shape[0], n):
        raise ValueError(f"out must have shape {(xa.shape[0], n)}, got {tuple(outa.shape)}")
    _core.column_groups_matmul(xa, xa.shape[0], shape[1], width, [(first, _array("raw", raw)) for first, raw in groups],
                               _kernel_type(qtype), n, outa, isa=isa, int8=int8)
    return out


def _kernel_type(qtype: gguf.GGMLQuantizationType | int) -> int:
    """The id of a type the kernels decode (a ggml type, or the layout `_core.interleave` returned), else a
    ValueError naming it."""
    if qtype in KERNEL_TYPES or int(qtype) in _INTERLEAVED_IDS:
        return int(qtype)
    try:
        qt = T(int(qtype))
    except ValueError:
        raise ValueError(f"ggml type {int(qtype)} is not a known ggml type") from None
    names = ", ".join(sorted(t.name for t in KERNEL_TYPES))
    raise ValueError(f"tensor type {qt.name} is not supported by the CPU kernels (supported: {names})")
