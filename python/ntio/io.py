"""Reading extents from a model file into memory: a small facade over `ntio._core`.

- `open_reader(path, ...)` → `_core.Reader`; backend chosen by `backend=`, else `NTIO_IO_BACKEND`, else a probe
  (io_uring + O_DIRECT, pread + O_DIRECT, buffered).
- `slot_array(slot)` → a zero-copy `uint8` numpy view of a staging slot (`torch.from_numpy` for torch); the view
  keeps the slot object alive.
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

__all__ = ["Check", "Extent", "open_reader", "read_into", "slot_array", "submit_into"]


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
