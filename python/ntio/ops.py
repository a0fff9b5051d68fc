"""The one op module between the graph and the kernels: linear layers and embedding lookups on encoded weights.

Weights stay in their GGUF encoding (`EncodedMatrix`) wherever they live — resident, pinned, or just read into a
staging slot — and each product picks how to run:
  * CPU, T <= cpu_kernels.MAX_ROWS, a type the Rust kernels decode: matrix-vector products straight from the
    encoded blocks (decode is memory-bound: ~4.5-8.5 bits per weight read instead of 32);
  * otherwise (prefill, CUDA, other types): dequantize into a reusable float32 scratch buffer, then `F.linear`.
Both compute in float32 with float32 sums, so they agree to ~1e-6 relative and with transformers' float32 to 1e-4.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch
import torch.nn.functional as F

from ntio import cpu_kernels, quant


@dataclass(frozen=True)
class EncodedMatrix:
    """A weight matrix [N, K] in its GGUF encoding: N rows of K / block_size blocks each, row-major."""

    raw: torch.Tensor  # uint8 [encoded_nbytes(qtype, shape)], contiguous, on the compute device (or pinned host)
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, int]  # (N, K)

    @property
    def row_nbytes(self) -> int:
        return self.raw.numel() // self.shape[0]


def concat_rows(matrices: list[EncodedMatrix]) -> list[EncodedMatrix]:
    """Fuse consecutive matrices of one type into one (their rows concatenated); keep the rest apart.

    Row-major block encodings concatenate row-wise, so q/k/v or gate/up of one type become a single product.
    """
    fused: list[EncodedMatrix] = []
    for m in matrices:
        if fused and fused[-1].qtype == m.qtype and fused[-1].shape[1] == m.shape[1]:
            last = fused.pop()
            m = EncodedMatrix(torch.cat((last.raw, m.raw)), m.qtype, (last.shape[0] + m.shape[0], m.shape[1]))
        fused.append(m)
    return fused


# Dequantization scratch, reused across calls (keyed by device and size) so steady state allocates nothing.
_scratch: dict[tuple[torch.device, int], torch.Tensor] = {}


def _dequantized(w: EncodedMatrix) -> torch.Tensor:
    n, k = w.shape
    key = (w.raw.device, n * k)
    buf = _scratch.get(key)
    if buf is None:
        buf = _scratch[key] = torch.empty(n * k, dtype=torch.float32, device=w.raw.device)
    return quant.dequantize(w.raw, w.qtype, w.shape, out=buf.view(n, k))


def uses_cpu_kernel(x: torch.Tensor, w: EncodedMatrix) -> bool:
    return x.device.type == "cpu" and x.shape[0] <= cpu_kernels.MAX_ROWS and w.qtype in cpu_kernels.KERNEL_TYPES


def linear(x: torch.Tensor, w: EncodedMatrix) -> torch.Tensor:
    """x: [T, K] float32 -> x @ Wᵀ: [T, N]."""
    if uses_cpu_kernel(x, w):
        return cpu_kernels.quantized_linear(x.contiguous(), w.raw, w.qtype, w.shape)
    return F.linear(x, _dequantized(w))


def linear_concat(x: torch.Tensor, ws: list[EncodedMatrix]) -> torch.Tensor:
    """x @ [W1; W2; ...]ᵀ for row-stacked matrices: [T, ΣN]."""
    if len(ws) == 1:
        return linear(x, ws[0])
    return torch.cat([linear(x, w) for w in ws], dim=-1)


def embedding(ids: torch.Tensor, table: EncodedMatrix) -> torch.Tensor:
    """Rows `ids` [T] of an encoded [V, D] table, dequantized: [T, D] float32. Only the T rows are decoded."""
    rows = table.raw.view(table.shape[0], table.row_nbytes)[ids]
    return quant.dequantize(rows.reshape(-1), table.qtype, (ids.shape[0], table.shape[1]))
