"""Model files of either format (GGUF, ntio store) and reading their layers, tensors and row ranges as extents.

- `open_model_file(path)` → `GGUFFile | StoreFile`, by magic, or a `Checkpoint` for a Hugging Face checkpoint directory.
- `extent_index(model_file)` → the Rust `ExtentIndex`: `layer_extents(model_file, layer)`,
  `tensor_extent(model_file, name)` and `row_extent(model_file, name, start, stop)` give `(file_offset, length)`.
  A row of a row-major encoded tensor is `K / block * type_size` bytes, so an FFN neuron group (rows of gate and
  up) is one extent. For a GGUF the extents are the tensors' own (unaligned).
- `plan_layer_read(model_file, layer)` → reader extents packing a layer into one buffer, in whole 4 KiB blocks;
  `plan_subset_read(planned, ranges)` → the same for some byte ranges of it (a load policy's subset); `read_layer(reader,
  model_file, layer)` reads a whole layer through a `_core.Reader` into one buffer and returns
  a zero-copy uint8 view per tensor, verified against the store's checksums.
- `tensor_checks(model_file, placed)` → the reader's checksum checks for tensors read whole to given buffer offsets
  (a store's; a GGUF records no checksums): verified on the I/O thread before the read completes.
"""

from __future__ import annotations

import bisect
import os
import weakref
from pathlib import Path

import numpy as np

from ntio import _core
from ntio.errors import ModelFormatError, read_error
from ntio.formats.checkpoint import Checkpoint, is_checkpoint
from ntio.formats.gguf_file import GGUF_MAGIC, GGUFFile
from ntio.io import Check, read_into
from ntio.formats.store import STORE_MAGIC, StoreFile, layer_of, tensor_rows

ModelFile = GGUFFile | StoreFile | Checkpoint

# Layer reads cover whole blocks of this size, at offsets of this alignment in file and buffer: O_DIRECT lands them
# straight in the buffer.
_DEST_ALIGNMENT = 4096

_gguf_indexes: weakref.WeakKeyDictionary[GGUFFile | Checkpoint, _core.ExtentIndex] = weakref.WeakKeyDictionary()


def open_model_file(path: str | os.PathLike[str]) -> ModelFile:
    path = Path(path)
    if is_checkpoint(path):
        return Checkpoint(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(len(STORE_MAGIC))
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ModelFormatError(f"{path}: is a directory without a config.json, not a model file or checkpoint") from None
    if magic.startswith(GGUF_MAGIC):
        return GGUFFile(path)
    if magic == STORE_MAGIC:
        return StoreFile(path)
    raise ModelFormatError(f"{path}: not a GGUF file or ntio store (magic {magic!r})")


def extent_index(model_file: ModelFile) -> _core.ExtentIndex:
    """The index of a model file's tensors (a GGUF's or a checkpoint's is built on first use and cached)."""
    if isinstance(model_file, StoreFile):
        return model_file.index
    index = _gguf_indexes.get(model_file)
    if index is None:
        table = [(t.name, t.offset, t.nbytes, tensor_rows(t), layer_of(t.name)) for t in model_file.tensors.values()]
        index = _gguf_indexes[model_file] = _core.ExtentIndex(model_file.path, table)
    return index


def _lookup(model_file: ModelFile, method: str, *args):
    try:
        return getattr(extent_index(model_file), method)(*args)
    except LookupError as e:
        raise ModelFormatError(str(e)) from None


def layer_extents(model_file: ModelFile, layer: int) -> list[tuple[int, int]]:
    """(file_offset, length) extents covering every tensor of `layer` (one for a store)."""
    return _lookup(model_file, "layer_extents", layer)


def tensor_extent(model_file: ModelFile, name: str) -> tuple[int, int]:
    return _lookup(model_file, "tensor_extent", name)


def row_extent(model_file: ModelFile, name: str, start: int, stop: int) -> tuple[int, int]:
    """The extent of rows [start, stop) of tensor `name` (rows in PyTorch order: output features)."""
    return _lookup(model_file, "row_extent", name, start, stop)


def tensor_checks(model_file: ModelFile, placed: list[tuple[str, int]]) -> list[Check]:
    """Checks `(tensor, file_offset, dest_offset, length, checksum)` for tensors read whole, each to its
    `(name, dest_offset)` in a buffer; empty for a GGUF, which records no checksums."""
    index = extent_index(model_file)
    checks = []
    for name, dest in placed:
        expected = index.checksum(name)
        if expected is not None:
            offset, nbytes = index.tensor_extent(name)
            checks.append((name, offset, dest, nbytes, expected))
    return checks


def _aligned_empty(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + _DEST_ALIGNMENT, dtype=np.uint8)
    skip = -raw.ctypes.data % _DEST_ALIGNMENT
    return raw[skip : skip + nbytes]


def plan_layer_read(model_file: ModelFile, layer: int) -> tuple[list[tuple[int, int, int]], int]:
    """Reader extents (file_offset, length, dest_offset) packing `layer`'s extents into one buffer, and its size.

    Each extent is widened to whole _DEST_ALIGNMENT blocks (up to the end of its file) and packed at an aligned
    offset, so an O_DIRECT read lands every byte in place: a GGUF layer's unaligned head and tail would otherwise
    be two small extra reads through a bounce buffer (SmolLM2: 2 of 11 requests per layer; reading the whole
    blocks made all-C reads 15% faster on this project's VM, benches/RESULTS.md session 3). The few extra bytes
    are padding around the tensors.
    """
    files = model_file.files
    bases = [base for _, base in files]
    file_ends = [base + Path(path).stat().st_size for path, base in files]
    planned: list[tuple[int, int, int]] = []
    end = 0
    for offset, length in layer_extents(model_file, layer):
        start = offset - offset % _DEST_ALIGNMENT
        file_end = file_ends[bisect.bisect_right(bases, offset) - 1]  # the end of the file holding the extent
        stop = min(-(-(offset + length) // _DEST_ALIGNMENT) * _DEST_ALIGNMENT, file_end)
        if planned and start < planned[-1][0] + planned[-1][1]:  # shares a block with the previous extent
            prev_start, _, prev_dest = planned.pop()
            start, end = prev_start, prev_dest
        else:
            end = -(-end // _DEST_ALIGNMENT) * _DEST_ALIGNMENT
        planned.append((start, stop - start, end))
        end += stop - start
    return planned, end


def plan_subset_read(
    planned: list[tuple[int, int, int]], ranges: list[tuple[int, int]]
) -> list[tuple[int, int, int]]:
    """Reader extents for only the file byte ranges (offset, length) of a layer planned by `plan_layer_read`.

    Each range lands where the whole-layer plan would put it (so tensor offsets in the layer buffer hold), widened
    to whole _DEST_ALIGNMENT blocks inside its planned extent; overlapping or touching pieces merge.
    """
    pieces: list[tuple[int, int, int]] = []
    for offset, length in sorted(ranges):
        home = [p for p in planned if p[0] <= offset and offset + length <= p[0] + p[1]]
        if not home:
            raise ValueError(f"bytes {offset}..{offset + length} are not inside one extent of the layer's read plan")
        file_start, span, dest = home[0]
        start = max(file_start, offset - offset % _DEST_ALIGNMENT)
        stop = min(file_start + span, -(-(offset + length) // _DEST_ALIGNMENT) * _DEST_ALIGNMENT)
        piece = (start, stop - start, dest + start - file_start)
        last = pieces[-1] if pieces else None
        if last is not None and start <= last[0] + last[1] and piece[2] - start == last[2] - last[0]:
            pieces[-1] = (last[0], max(last[1], stop - last[0]), last[2])
        else:
            pieces.append(piece)
    return pieces


def read_layer(reader: _core.Reader, model_file: ModelFile, layer: int, verify: bool = True) -> dict[str, np.ndarray]:
    """Read all of `layer` through `reader` (opened on the same file) into one fresh buffer.

    Returns tensor name → uint8 view of its encoded bytes in that buffer; with `verify`, the read fails
    (ModelFormatError naming the tensor) unless each matches the store's checksum (GGUF files record none).
    """
    index = extent_index(model_file)
    planned, size = plan_layer_read(model_file, layer)
    placed = {}
    for name in index.layer_tensors(layer):
        offset, nbytes = index.tensor_extent(name)
        file_start, _, dest = next(p for p in planned if p[0] <= offset < p[0] + p[1])
        placed[name] = (dest + offset - file_start, nbytes)
    buffer = _aligned_empty(size)
    checks = tensor_checks(model_file, [(name, dest) for name, (dest, _) in placed.items()]) if verify else []
    try:
        read_into(reader, planned, buffer, checks)
    except OSError as e:
        raise read_error(e) from None
    return {name: buffer[dest : dest + nbytes] for name, (dest, nbytes) in placed.items()}
