"""Quantized matrix products on CUDA: CuPy RawKernels (`cuda_matmul.cu`) that read GGUF blocks straight from device
memory, for passes of up to MAX_ROWS tokens (decode, speculative verification).

Where they take a product, it costs one launch that reads each weight byte once, where dequantizing it in torch took
about ten elementwise launches per matrix and wrote and read a float32 copy four to eight times its size. Longer passes
(prefill) still dequantize into the engine's scratch and run cuBLAS (`ops.linear`), as does every product when CuPy
is not installed (`available`).

Numerics: each weight decodes to gguf-py's float32 value, and sums run in float32 in a fixed order (fused
multiply-adds over a chunk, a lane's chunks in turn, then a shuffle tree over the warp's lanes), so an output's bits
depend neither on T nor on the launch.

The kernels compile once per weight type (NVRTC, ~1 s), on first use; CuPy keeps the binaries in its kernel cache
(~/.cupy/kernel_cache) for later processes.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
import torch

from ntio.errors import NtioError

T = gguf.GGMLQuantizationType

# The types the kernels decode: cuda_matmul.cu names each by its gguf name.
KERNEL_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset({
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.TQ1_0, T.TQ2_0})

# The most activation rows a kernel takes; each type is compiled for these row counts, a pass using the next one up
# (its accumulators stay in registers: 16 floats a lane at most).
MAX_ROWS = 16
_ROW_BUCKETS = (1, 2, 4, 8, 16)

# Warps (output rows) per thread block: each block stages its activation tiles once for this many rows.
WARPS = 8
# Bytes of shared memory a block's activation tile takes per token (cuda_matmul.cu's TILE_FLOATS floats).
_TILE_BYTES_PER_TOKEN = 32 * 36 * 4

_SOURCE = Path(__file__).with_name("cuda_matmul.cu")


class KernelCompileError(NtioError):
    """A CUDA kernel did not compile (names the type and the compiler's first error)."""


@functools.cache
def available() -> bool:
    """Whether CuPy is installed (`pip install ntio[cuda12]` or `[cuda13]`) and sees a GPU. Without it every CUDA
    product dequantizes in torch, and the first CUDA engine of the process says why on stderr."""
    if importlib.util.find_spec("cupy") is None:
        why = "CuPy is not installed"
    else:
        try:
            import cupy

            if cupy.cuda.is_available():
                return True
            why = "CuPy sees no GPU"
        except Exception as e:  # a CuPy built for another CUDA, missing libraries: every way it fails to load
            why = f"CuPy does not load ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    print(f"ntio: {why}, so CUDA products dequantize in torch (many times slower); pip install ntio[cuda12] or "
          "ntio[cuda13] adds it", file=sys.stderr)
    return False


def takes(rows: int, qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether the kernels multiply `rows` activation rows with matrices of `qtype` (whose rows are whole chunks of
    32 elements: every quantized type's are)."""
    return rows <= MAX_ROWS and qtype in KERNEL_TYPES and available()


@functools.cache
def _kernels(qtype: gguf.GGMLQuantizationType, device: int) -> dict[int, object]:
    """The kernels of one type on one device, by the row count they hold ({bucket: cupy.RawKernel}): CuPy loads a
    module, and sets a kernel's attributes, per device."""
    import cupy

    names = {rows: f"quantized_matmul<{qtype.name}, {rows}>" for rows in _ROW_BUCKETS}
    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=_SOURCE.read_text(), options=("-std=c++17", "--fmad=false"),
                                name_expressions=list(names.values()))
        try:
            kernels = {rows: module.get_function(name) for rows, name in names.items()}
        except Exception as e:  # the compiler's errors, or NVRTC itself missing
            lines = str(e).splitlines() or [type(e).__name__]
            first = next((line for line in lines if "error" in line), lines[0])
            raise KernelCompileError(f"CUDA kernel for {qtype.name} did not compile: {first.strip()}") from None
        for rows, kernel in kernels.items():
            kernel.max_dynamic_shared_size_bytes = rows * _TILE_BYTES_PER_TOKEN  # over the default 48 KB from 11 rows
    return kernels


@functools.cache
def _stream(pointer: int, device: int) -> object:
    """CuPy's handle on a torch stream. ExternalStream is the one CuPy 13 has; CuPy 14 deprecates it."""
    import cupy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(pointer, device)


def _launch(qtype: gguf.GGMLQuantizationType, x: torch.Tensor, out: torch.Tensor, n: int, args: tuple) -> None:
    """One kernel launch on x's device and torch's current stream there: x [T, K] float32 (rows 16-byte aligned),
    out [T, >= n]."""
    import cupy

    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"the CUDA kernels take at most {MAX_ROWS} activation rows, not {x.shape[0]}")
    bucket = next(b for b in _ROW_BUCKETS if b >= x.shape[0])
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    kernel = _kernels(qtype, device)[bucket]
    with cupy.cuda.Device(device), _stream(torch.cuda.current_stream(x.device).cuda_stream, device):
        kernel(((n + WARPS - 1) // WARPS,), (32 * WARPS,), args, shared_mem=x.shape[0] * _TILE_BYTES_PER_TOKEN)


def _aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] float32 with contiguous rows whose starts are 16-byte aligned (the kernels load float4)."""
    if x.stride(-1) != 1 or x.stride(0) % 4 or x.data_ptr() % 16:
        x = x.contiguous()
        if x.data_ptr() % 16:
            x = x.clone()
    return x


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int],
           scale: float = 1.0) -> torch.Tensor:
    """x [T, K] float32 (T <= MAX_ROWS) times the [N, K] matrix encoded in raw (uint8, its rows back to back, on x's
    device), transposed and times `scale`: [T, N] float32."""
    n, k = shape
    out = torch.empty((x.shape[0], n), dtype=torch.float32, device=x.device)
    if n == 0:
        return out
    x = _aligned_rows(x)
    row_bytes = raw.numel() // n
    _launch(qtype, x, out, n, (
        np.uint64(raw.data_ptr()), np.int64(row_bytes), np.int32(n), np.int32(k), np.uint64(x.data_ptr()),
        np.int64(x.stride(0)), np.int32(x.shape[0]), np.uint64(out.data_ptr()), np.int64(n), np.float32(scale),
        np.uint64(0), np.uint64(0), np.int32(0), np.int32(0)))
    return out


def column_groups_matmul(x: torch.Tensor, groups: Sequence[tuple[int, torch.Tensor]],
                         qtype: gguf.GGMLQuantizationType, n: int, width: int, scale: float = 1.0) -> torch.Tensor:
    """x [T, K] float32 (T <= MAX_ROWS) times column groups of a matrix W [N, K]: Σ_j x[:, first_j:first_j + width] ·
    G_jᵀ · scale -> [T, N], each (first_j, raw_j) the encoded [N, width] matrix of W's columns from first_j (on x's
    device). One launch over every group: the product of W with x's other columns zeroed. Groups are whole blocks
    of their type, and start at multiples of 32 columns (chunks: the kernels load x 4 floats at a time)."""
    x = _aligned_rows(x)
    out = torch.empty((x.shape[0], n), dtype=torch.float32, device=x.device)
    table = np.array([g.data_ptr() for _, g in groups], np.uint64)
    firsts = np.array([first for first, _ in groups], np.int32)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if width % block or width % 32 or (firsts % 32).any() or (firsts + width > x.shape[1]).any():
        raise ValueError(f"column groups of {width} {qtype.name} columns from {firsts.tolist()} are not whole chunks "
                         f"of x's {x.shape[1]} columns")
    pointers = torch.from_numpy(table.view(np.int64)).to(x.device)
    starts = torch.from_numpy(firsts).to(x.device)
    _launch(qtype, x, out, n, (
        np.uint64(0), np.int64(0), np.int32(n), np.int32(x.shape[1]), np.uint64(x.data_ptr()), np.int64(x.stride(0)),
        np.int32(x.shape[0]), np.uint64(out.data_ptr()), np.int64(n), np.float32(scale),
        np.uint64(pointers.data_ptr()), np.uint64(starts.data_ptr()), np.int32(len(groups)), np.int32(width)))
    return out
