"""Reading extents from a model file into memory: a small facade over `ntio._core`.

- `open_reader(path, ...)` → `_core.Reader`; backend chosen by `backend=`, else `NTIO_IO_BACKEND`, else a probe
  (io_uring + O_DIRECT, pread + O_DIRECT, buffered).
- `slot_array(slot)` → a zero-copy `uint8` numpy view of a staging slot (`torch.from_numpy` for torch); the view
  keeps the slot object alive.
- `HostArena(pieces)` → host memory in transparent huge pages for bytes kept for a run (resident layers), handed out
  in aligned pieces (`take`).
- `read_into(reader, extents, dest)` / `submit_into(reader, extents, dest)` read into memory Python owns: a
  C-contiguous, writable numpy array or CPU torch tensor (pinned or not), or another buffer-protocol object
  (`bytearray`, ...). The buffer itself crosses into Rust, which checks it (`_core.BufferError` naming `dest`);
  torch tensors go as zero-copy `.numpy()` views. `submit_into`'s handle holds the buffer until the read has ended,
  and dropping the handle waits for the I/O first.

An extent is `(file_offset, length, dest_offset)` in bytes: file bytes `[file_offset, file_offset + length)` go to
destination bytes `[dest_offset, dest_offset + length)`. A check is `(tensor, file_offset, dest_offset, length,
xxh3-64)`: once the batch's bytes have landed, the I/O thread hashes destination bytes `[dest_offset, dest_offset +
length)` and fails the read (`_core.ReadError` naming tensor and offset) if they differ from the checksum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ntio import _core

Extent = tuple[int, int, int]
Check = tuple[str, int, int, int, int]

__all__ = ["Check", "Extent", "HostArena", "open_reader", "read_into", "slot_array", "submit_into"]


def open_reader(path: Any, backend: str | None = None, queue_depth: int = 32,
                request_size: int = 1 << 20) -> _core.Reader:
    return _core.Reader(path, backend=backend, queue_depth=queue_depth, request_size=request_size)


class _SlotView:
    """Numpy's `__array_interface__` for a slot; becomes the array's `.base`, so the array keeps the slot alive."""

    def __init__(self, slot: _core.Slot) -> None:
        self.slot = slot
        self.__array_interface__ = {
            "shape": (slot.size,), "typestr": "|u1", "data": (slot.address, False), "version": 3,
        }


def slot_array(slot: _core.Slot) -> np.ndarray:
    """A writable zero-copy `uint8` view of the whole slot."""
    return np.asarray(_SlotView(slot))


class HostArena:
    """Host memory for bytes read once and kept (resident layers, global tensors), in transparent huge
    pages where the kernel has them: the memory of a one-slot `_core.StagingPool` (2 MiB-aligned, advised
    MADV_HUGEPAGE, faulted in at once; 4 KiB pages otherwise), handed out in pieces aligned to `align` bytes.

    Why: a decode step reads every resident byte, and in 4 KiB pages a SmolLM2 step touches ~24,000 of them, far more
    than the TLB holds (a 2 MiB page covers 512). numpy advises huge pages only for its arrays of 4 MiB or more, and
    a SmolLM2 layer is 2.2 MB. Measured on the Sapphire Rapids class VM (2 vCPU, THP on madvise, 2026-11-29), resident
    decode with each layer in its own numpy array against the layers in one arena, three alternating pairs of
    processes: SmolLM2 133-177 against 173-208 tok/s (each pair 12-35% faster in the arena), Qwen2.5-Coder-1.5B (its
    35 MB layers already mostly in huge pages) 15.4-16.7 against 16.1-18.7 in two pairs. SmolLM2's kernel pass alone,
    in one process: 11.1 against 9.9 ms at T = 1, 20.8 against 18.5 at T = 16. One arena for many pieces, because
    each mapping rounds up to whole huge pages. Pieces keep the arena alive.
    """

    def __init__(self, pieces: Sequence[int], align: int = 4096) -> None:
        """An arena that holds pieces of these sizes (in bytes), taken in this order."""
        nbytes = sum(-(-n // align) * align for n in pieces)
        self._memory = slot_array(_core.StagingPool(1, max(nbytes, 1)).acquire())
        self._align = align
        self._used = 0

    def take(self, nbytes: int) -> np.ndarray:
        """The next `nbytes` of the arena, at an `align` boundary."""
        start = -(-self._used // self._align) * self._align
        if start + nbytes > len(self._memory):
            raise ValueError(f"host arena of {len(self._memory)} bytes: {nbytes} more at {start} do not fit")
        self._used = start + nbytes
        return self._memory[start:start + nbytes]


def _buffer_of(dest: Any) -> Any:
    """`dest` as a buffer-protocol object over the same memory: torch tensors (CPU, pinned or not) as numpy views;
    anything else as is (Rust checks it is a writable, C-contiguous buffer)."""
    if hasattr(dest, "data_ptr") and hasattr(dest, "numpy"):  # a torch.Tensor, without importing torch
        if dest.device.type != "cpu":
            raise _core.BufferError(f"dest must be in host memory, not on {dest.device}")
        dest = dest.detach()
        try:
            return dest.numpy()
        except TypeError:  # a dtype numpy lacks (bfloat16): the same bytes as uint8; extents are in bytes anyway
            import torch

            if not dest.is_contiguous():
                raise _core.BufferError("dest must be C-contiguous (a strided or transposed view is not)") from None
            return dest.view(torch.uint8).numpy()
    return dest


def read_into(reader: _core.Reader, extents: Sequence[Extent], dest: Any, checks: Sequence[Check] = ()) -> None:
    """Read `extents` into `dest` (numpy array or CPU/pinned torch tensor, as raw bytes), verify `checks`, wait."""
    reader.read_into(list(extents), _buffer_of(dest), checks=list(checks))


def submit_into(reader: _core.Reader, extents: Sequence[Extent], dest: Any,
                checks: Sequence[Check] = ()) -> _core.ReadHandle:
    """Start reading `extents` into `dest`; `handle.wait()` raises any error (a failed check included). The handle
    keeps `dest` alive."""
    return reader.submit_into(list(extents), _buffer_of(dest), owner=dest, checks=list(checks))
