"""A token embedding left on disk: a forward reads the rows of its token ids (a few KB each) instead of keeping the
[V, D] table resident (295 MB for a 128k vocabulary at Q4_K, more than two 8B layers).

Verification: a store records one checksum per tensor, which no row read can check. When the table is opened, it is
read once whole (a window at a time), checked against that checksum, and hashed row by row (xxh3-64, 8 bytes per
row: `LayerLoader.piece_checksums`); every row read later is checked against its row hash on the reader's I/O
thread. A row that changes on disk after that is a ModelFormatError naming the tensor and the row's offset, never an
embedding: as strong as the per-tensor check.
"""

from __future__ import annotations

import numpy as np
import torch

from ntio import _core
from ntio.errors import read_error
from ntio.formats.gguf_file import TensorInfo
from ntio.io import read_into


class DiskRows:
    """An encoded [V, D] table on disk; `encoded_rows(ids)` reads the rows asked for (an `ops.RowSource`)."""

    def __init__(self, reader: _core.Reader, info: TensorInfo, row_checksums: list[int] | None,
                 device: torch.device) -> None:
        self.reader, self.info, self.row_checksums, self.device = reader, info, row_checksums, device
        self.qtype = info.qtype
        self.shape: tuple[int, int] = (info.shape[0], info.shape[1])
        self.row_nbytes = info.nbytes // info.shape[0]

    def encoded_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the encoding, read now: [T, row_nbytes] uint8 on the table's device."""
        unique, inverse = torch.unique(ids.cpu(), return_inverse=True)
        n, size = unique.numel(), self.row_nbytes
        rows = unique.tolist()
        extents = [(self.info.offset + row * size, size, i * size) for i, row in enumerate(rows)]
        checks = [] if self.row_checksums is None else [
            (self.info.name, self.info.offset + row * size, i * size, size, self.row_checksums[row])
            for i, row in enumerate(rows)
        ]
        buf = np.empty(n * size, dtype=np.uint8)
        try:
            read_into(self.reader, extents, buf, checks)
        except OSError as e:
            raise read_error(e) from None
        return torch.from_numpy(buf).view(n, size)[inverse].to(self.device)
