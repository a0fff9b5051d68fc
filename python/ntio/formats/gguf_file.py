"""GGUF model files: metadata, tensor table and raw tensor bytes.

Parsing is done by the `gguf` package (v2 and v3). This module adds what ntio needs on top: every tensor's
extent in the file (absolute offset, byte length) checked against the file size, so a truncated file is
reported by tensor name and offset instead of failing somewhere inside numpy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

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


class _CheckedReader(gguf.GGUFReader):
    """GGUFReader that validates each tensor's extent before the base class maps it."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:  # type: ignore[override]
        file_size = len(self.data)
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise _UnknownTensorType(name, int(raw_dtype[0])) from None
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_elements = int(np.prod(dims.astype(np.int64)))
            if n_elements % block:
                raise _BadTensor(name, f"has {n_elements} elements, not a multiple of the {qtype.name} block ({block})")
            offset = int(start_offs + offset_tensor[0])
            end = offset + n_elements // block * type_size
            if end > file_size:
                raise _BadTensor(name, f"needs bytes {offset}..{end} but the file ends at {file_size} (truncated?)")
        super()._build_tensors(start_offs, fields)


class _BadTensor(Exception):
    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"tensor {name!r} {problem}")


class _UnknownTensorType(Exception):
    def __init__(self, name: str, code: int) -> None:
        super().__init__(f"tensor {name!r} has unknown ggml type {code}")


def _field_value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value


class GGUFFile(ModelFileBase):
    """A parsed GGUF file. Tensor data stays on disk; `tensor_bytes` maps it lazily."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFormatError(f"{self.path}: no such file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ModelFormatError(f"{self.path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        try:
            reader = _CheckedReader(self.path, "r")
        except (_BadTensor, _UnknownTensorType) as e:
            raise ModelFormatError(f"{self.path}: {e}") from None
        except (ValueError, IndexError, OverflowError, UnicodeDecodeError) as e:
            # The header itself is cut short or corrupt: numpy fails on a short read or a bad length.
            raise ModelFormatError(f"{self.path}: corrupt or truncated GGUF header ({e})") from None
        # Keep the values and the file mapping, not the reader: it holds a numpy array for every part of every
        # field (~150 MB of small objects for a 49k-token vocabulary).
        self._data = reader.data
        self.version: int = int(reader.fields["GGUF.version"].parts[0][0])
        self.data_offset: int = int(reader.data_offset)
        self.alignment: int = int(reader.alignment)
        self.metadata: dict[str, Any] = {
            key: _field_value(field) for key, field in reader.fields.items() if not key.startswith("GGUF.")
        }
        self.tensors: dict[str, TensorInfo] = {}
        for t in reader.tensors:
            self.tensors[t.name] = TensorInfo(
                name=t.name,
                qtype=t.tensor_type,
                shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                offset=int(t.data_offset),
                nbytes=int(t.n_bytes),
            )

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The encoded bytes of one tensor as a read-only uint8 view of the memory-mapped file."""
        info = self.tensor(name)
        return self._data[info.offset : info.offset + info.nbytes]
