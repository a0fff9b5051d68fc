"""GGUF model files: metadata, tensor table and raw tensor bytes.

The header is parsed and validated in Rust (`_core.parse_gguf`, rust/gguf.rs): every count and length is checked
against the bytes left before anything is allocated, keys and tensor names must be unique valid UTF-8, and every
tensor's extent must be aligned, inside the file and disjoint from the others. A bad file is one line naming the
file, the key or tensor, and the offset. gguf-py is used for its type enum only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ntio import _core
from ntio.errors import ModelFormatError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a model file.

    shape is in PyTorch order (outermost first): a weight matrix is [out_features, in_features], the reverse of
    GGUF's ne[] order. offset is absolute in the file; nbytes is the exact length of the encoded data.
    """

    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class ModelFileBase:
    """What every model file format offers: metadata and tensor lookups whose errors name the file."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    @property
    def files(self) -> list[tuple[Path, int]]:
        """The files holding the tensors, each `(path, base)` at its base in the offset space of the tensors'
        offsets, as `_core.Reader` opens them: this one file at 0."""
        return [(self.path, 0)]

    def require(self, key: str) -> Any:
        """A metadata value that must be present."""
        try:
            return self.metadata[key]
        except KeyError:
            raise ModelFormatError(f"{self.path}: missing metadata key {key!r}") from None

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFormatError(f"{self.path}: missing tensor {name!r}") from None


class GGUFFile(ModelFileBase):
    """A parsed GGUF file. Tensor data stays on disk; `tensor_bytes` maps it lazily."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFormatError(f"{self.path}: no such file")
        # numpy cannot map an empty file; the parser reports the empty buffer as a bad magic.
        empty = self.path.stat().st_size == 0
        self._data = np.empty(0, np.uint8) if empty else np.memmap(self.path, dtype=np.uint8, mode="r")
        try:
            version, alignment, data_offset, metadata, tensors = _core.parse_gguf(self.path, self._data)
        except _core.GGUFFormatError as e:
            raise ModelFormatError(str(e)) from None
        self.version: int = version
        self.data_offset: int = data_offset
        self.alignment: int = alignment
        self.metadata: dict[str, Any] = dict(metadata)
        self.tensors: dict[str, TensorInfo] = {}
        for name, code, dims, offset, nbytes in tensors:
            try:
                qtype = gguf.GGMLQuantizationType(code)
            except ValueError:
                # The parser knows the types of the gguf-py it was checked against; an older gguf-py may lack some.
                raise ModelFormatError(
                    f"{self.path}: tensor {name!r} has ggml type {code}, which the installed gguf package does not know"
                ) from None
            self.tensors[name] = TensorInfo(name=name, qtype=qtype, shape=tuple(reversed(dims)), offset=offset,
                                            nbytes=nbytes)

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The encoded bytes of one tensor as a read-only uint8 view of the memory-mapped file."""
        info = self.tensor(name)
        return self._data[info.offset : info.offset + info.nbytes]
