"""The ntio store: a GGUF model or Hugging Face checkpoint re-laid out for streaming, and `convert`, which writes one
(optionally encoding a checkpoint's float matrices as F16, BF16, Q8_0 or Q4_0).

Layout (the Rust core parses it: `rust/store/`):

    [0, 4096)        header page: magic b"NTIOSTOR", format version, manifest offset/length/checksum
    [4096, ...)      global tensors, then layer 0's tensors, layer 1's, ...; every tensor 4096-aligned,
                     each layer's tensors back to back, so one layer is one extent
    [..., manifest)  with `--layout ffn-groups`: each layer's FFN down matrix again, group-major (`ffn_groups`);
                     gate and up are read in place, a group a row range, checked by checksums of their row groups;
                     then the global tensor `ffn_down_norms` (`DOWN_NORMS`): the norm of each down column
    [manifest, end)  JSON manifest: all GGUF metadata (tokenizer arrays and chat template included), the tensor
                     table (name, ggml type, shape, offset, nbytes, rows, layer, xxh3-64 checksum), the layer table
                     and "layouts": where the re-laid-out copies are

`StoreFile` offers the interface of `GGUFFile`, with `tensor_bytes` verified against the tensor's checksum.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import gguf
import numpy as np
import torch

from ntio import _core
from ntio.errors import ModelFormatError, NtioError
from ntio.files import replacing, writable
from ntio.formats.checkpoint import Checkpoint, is_checkpoint
from ntio.formats.gguf_file import GGUFFile, ModelFileBase, TensorInfo
from ntio.kernels import quant

STORE_MAGIC: bytes = _core.STORE_MAGIC
STORE_SUFFIX = ".ntio"

# What `convert --type` may encode float matrices as.
MATRIX_TYPES = {t.name: t for t in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16,
                                    gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0)}
_FLOAT_TYPES = frozenset((gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                          gguf.GGMLQuantizationType.BF16))

# What `convert --layout` may add beside the dense tensors.
LAYOUTS = ("ffn-groups",)
# Neurons per FFN group where the down matrix's type has blocks of one value (F32, F16, BF16).
FLOAT_GROUP_NEURONS = 32
# The matrices whose rows are an FFN layer's neurons, read a group of rows at a time with the ffn-groups layout.
_ROW_GROUPED = (".ffn_gate.weight", ".ffn_up.weight")
# The ffn-groups layout's [L, F] float32 global tensor: row l holds ||down[:, i]|| of each neuron i of layer l's down
# matrix [D, F] (`down_column_norms`), which the sparse FFN's down rule weighs each neuron's activation by. Stored
# because computing them needs every down byte, which a sparse FFN never reads whole.
DOWN_NORMS = "ffn_down_norms"

# progress(bytes_done, bytes_total)
Progress = Callable[[int, int], None]


def layer_of(name: str) -> int | None:
    """The transformer block a tensor belongs to (`blk.N.*`), None for globals."""
    prefix, _, rest = name.partition(".")
    if prefix != "blk":
        return None
    number = rest.partition(".")[0]
    return int(number) if number.isdigit() else None


def tensor_rows(info: TensorInfo) -> int:
    """Rows of a tensor's row-major encoding: every dimension but the innermost (1 for a vector)."""
    return int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1


def checksum(array: np.ndarray) -> int:
    """xxh3-64 of a C-contiguous array's bytes (computed in Rust, without the GIL)."""
    return _core.checksum(array)


class StoreFile(ModelFileBase):
    """An ntio store, read like a `GGUFFile`. Tensor data stays on disk; `tensor_bytes` maps and verifies it."""

    def __init__(self, path: str | os.PathLike[str], verify: bool = True) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFormatError(f"{self.path}: no such file")
        try:
            version, metadata_json, table, index = _core.open_store(self.path)
        except _core.StoreFormatError as e:
            raise ModelFormatError(str(e)) from None
        self.version: int = version
        self.metadata: dict[str, Any] = json.loads(metadata_json)
        _check_text(self.metadata, self.path)
        self.tensors: dict[str, TensorInfo] = {
            name: TensorInfo(name, self._qtype(name, ggml_type), tuple(shape), offset, nbytes)
            for name, ggml_type, shape, offset, nbytes in table
        }
        self.index: _core.ExtentIndex = index
        self.verify = verify
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._verified: set[str] = set()

    def _qtype(self, name: str, code: int) -> gguf.GGMLQuantizationType:
        try:
            return gguf.GGMLQuantizationType(code)
        except ValueError:
            raise ModelFormatError(f"{self.path}: tensor {name!r} has unknown ggml type {code}") from None

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The encoded bytes of one tensor: a read-only uint8 view of the mapped file, checked against its
        checksum on first access (unless the store was opened with verify=False)."""
        info = self.tensor(name)
        data = self._data[info.offset : info.offset + info.nbytes]
        if self.verify and name not in self._verified:
            verify_tensor(self.index, name, data)
            self._verified.add(name)
        return data

    @property
    def ffn_group_neurons(self) -> int | None:
        """Neurons per FFN group of the store's group-major down copies (`convert --layout ffn-groups`), else None."""
        return self.index.ffn_group_neurons

    def ffn_group_extents(self, layer: int, groups: list[int]) -> list[tuple[int, int]]:
        """(file offset, length) of groups `groups` of `layer`'s down copy, one aligned extent each."""
        try:
            return self.index.ffn_group_extents(layer, groups)
        except LookupError as e:
            raise ModelFormatError(f"{e}; `ntio convert --layout ffn-groups` writes a store with one"
                                   if self.ffn_group_neurons is None else str(e)) from None

    def ffn_row_group_checksums(self, name: str) -> list[int]:
        """xxh3-64 of each row group of tensor `name` (a layer's dense gate or up matrix): rows [g·n, (g+1)·n), n =
        `ffn_group_neurons`, a contiguous run of the tensor's bytes."""
        try:
            return self.index.ffn_row_group_checksums(name)
        except LookupError as e:
            raise ModelFormatError(str(e)) from None

    def ffn_group_bytes(self, layer: int, group: int) -> np.ndarray:
        """Group `group` of `layer`'s down copy: the row-major encoding of the down matrix's columns
        [group·n, (group+1)·n), a read-only view checked against its checksum (unless opened with verify=False)."""
        (offset, length), = self.ffn_group_extents(layer, [group])
        data = self._data[offset : offset + length]
        if self.verify:
            try:
                self.index.verify_ffn_group(layer, group, data)
            except _core.StoreFormatError as e:
                raise ModelFormatError(str(e)) from None
        return data


def _check_text(value: Any, path: Path, key: str = "") -> None:
    """Every string of the manifest's metadata is text: JSON can escape a lone surrogate (\\udcff), which no
    tokenizer or template can encode. Lists of strings (vocabularies) are checked in one join."""
    try:
        if isinstance(value, str):
            value.encode()
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            "".join(value).encode()
        elif isinstance(value, (list, dict)):
            if isinstance(value, dict):
                "".join(value).encode()  # the keys
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                _check_text(v, path, f"{key}[{k!r}]" if key else str(k))
    except UnicodeEncodeError:
        raise ModelFormatError(f"{path}: metadata key {key!r} holds a string that is not valid Unicode") from None


def verify_tensor(index: _core.ExtentIndex, name: str, data: np.ndarray) -> None:
    """Check a tensor's bytes against the checksum its file records (a no-op for a GGUF)."""
    try:
        index.verify(name, data)
    except _core.StoreFormatError as e:
        raise ModelFormatError(str(e)) from None


def _target_type(t: TensorInfo, matrix_type: gguf.GGMLQuantizationType | None) -> gguf.GGMLQuantizationType:
    """What tensor `t` is written as: float matrices (2-D) as `matrix_type`, or as F16 where a row does not fill whole
    blocks of it (as llama.cpp's converter falls back); vectors and quantized tensors as they are. With Q4_0 the
    token embedding and output head take Q8_0, as llama-quantize keeps them wider: on SmolLM2 a Q4_0 head (tied
    to the embedding) alone raised perplexity by a third."""
    if matrix_type is None or t.qtype not in _FLOAT_TYPES or len(t.shape) != 2:
        return t.qtype
    if matrix_type == gguf.GGMLQuantizationType.Q4_0 and t.name in ("token_embd.weight", "output.weight"):
        matrix_type = gguf.GGMLQuantizationType.Q8_0
    block = gguf.GGML_QUANT_SIZES[matrix_type][0]
    return matrix_type if t.shape[-1] % block == 0 else gguf.GGMLQuantizationType.F16


def _encoded(data: np.ndarray, t: TensorInfo, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """A float tensor's bytes re-encoded as `qtype` (uint8)."""
    if qtype == t.qtype:
        return data
    values = quant.dequantize(torch.from_numpy(np.array(data)), t.qtype, t.shape).numpy()
    if qtype == gguf.GGMLQuantizationType.F16:
        return values.astype(np.float16).view(np.uint8).reshape(-1)
    if qtype == gguf.GGMLQuantizationType.BF16:
        return quant.bf16_bytes(values).reshape(-1)
    return gguf.quants.quantize(values, qtype).reshape(-1)


def group_neurons(qtype: gguf.GGMLQuantizationType) -> int:
    """Neurons per FFN group for a down matrix of `qtype`: one quantization block along the neuron axis (32, or 256
    for the K-quants and ternary types), the smallest unit of its bytes that reads alone without quantizing again."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return FLOAT_GROUP_NEURONS if block == 1 else block


def widest_group_neurons(down_types: Iterable[gguf.GGMLQuantizationType]) -> int:
    """The one group size of a model's FFN layout: the widest block among its down matrices' types (`group_neurons`),
    so that every layer's groups are whole blocks; 0 for none."""
    return max((group_neurons(qtype) for qtype in down_types), default=0)


def ffn_groups(data: np.ndarray, shape: tuple[int, ...], neurons: int) -> np.ndarray:
    """A down matrix's encoded bytes (row-major [D, F]) -> [G, group_bytes] uint8: group g holds neurons
    [g·n, (g+1)·n) of every row (n = `neurons`, whole blocks of its type), each row's blocks of them in turn, so each
    group is the row-major encoding of the [D, n] matrix of those columns. Blocks are moved, never re-encoded."""
    rows, width = shape
    if width % neurons:
        raise ValueError(f"{width} neurons are not whole groups of {neurons}")
    groups = width // neurons
    return np.ascontiguousarray(np.asarray(data).reshape(rows, groups, -1).transpose(1, 0, 2)).reshape(groups, -1)


def convert(source: str | os.PathLike[str], target: str | os.PathLike[str], progress: Progress | None = None,
            matrix_type: gguf.GGMLQuantizationType | None = None, layout: str | None = None) -> Path:
    """Write the GGUF or Hugging Face checkpoint `source` as a store at `target`, float matrices encoded as
    `matrix_type` when given (a key of MATRIX_TYPES). With `layout` "ffn-groups", each layer's FFN down matrix is
    also written group-major after all layers (`ffn_groups`; the dense tensors and their extents are unchanged),
    so that a sparse FFN reads the groups it keeps as one aligned extent each; and the manifest records the checksum
    of each group of rows of every layer's gate and up matrices (`row_groups`), which it reads in place.

    The store is written to a temporary file in the target's directory and renamed into place at the end: an
    interrupted or failed conversion leaves no partial file behind.
    """
    g = Checkpoint(source) if is_checkpoint(Path(source)) else GGUFFile(source)
    target = writable(Path(target))
    inputs = sorted(Path(source).iterdir()) if Path(source).is_dir() else [Path(source)]
    if target.exists() and any(f.is_file() and os.path.samefile(f, target) for f in inputs):
        raise NtioError(f"cannot write {target}: it is the input {source}: name another output")
    types = {t.name: _target_type(t, matrix_type) for t in g.tensors.values()}
    sizes = {t.name: quant.encoded_nbytes(types[t.name], t.shape) if types[t.name] != t.qtype else t.nbytes
             for t in g.tensors.values()}
    globals_ = [t for t in g.tensors.values() if layer_of(t.name) is None]
    n_layers = max((layer_of(name) + 1 for name in g.tensors if layer_of(name) is not None), default=0)
    layers: list[list[TensorInfo]] = [[] for _ in range(n_layers)]
    for t in g.tensors.values():
        if (layer := layer_of(t.name)) is not None:
            layers[layer].append(t)
    groups = [globals_, *layers]
    downs = _down_matrices(layers, g.path) if layout == "ffn-groups" else []
    # One group size for every layer: the widest block of their down types (blocks of 1, 32 or 256 elements).
    neurons = widest_group_neurons(types[t.name] for t in downs)
    copies = {t.name: _group_bytes(t, types[t.name], neurons) for t in downs}  # name -> (groups, group_bytes)
    norms_nbytes = 4 * len(downs) * downs[0].shape[1] if downs else 0  # DOWN_NORMS: [L, F] float32
    # Gate and up are read in place (a group is a row range): the manifest records a checksum of each row group.
    gate_up = {t.name for layer in layers for t in layer if downs and t.name.endswith(_ROW_GROUPED)}
    plan = [[sizes[t.name] for t in group] for group in groups]
    after = [[size for n, size in copies.values() for _ in range(n)], [norms_nbytes]]
    offsets = _core.plan_store_layout(plan + after)
    norms_offset, = offsets.pop()
    copy_offsets = iter(offsets.pop())
    total = sum(t.nbytes for t in g.tensors.values())
    with replacing(target) as f:
        records, row_groups, done = [], [], 0
        for group_index, (group, group_offsets) in enumerate(zip(groups, offsets)):
            for t, offset in zip(group, group_offsets):
                data = _encoded(g.tensor_bytes(t.name), t, types[t.name])
                if t.qtype in quant.TERNARY_TYPES:  # a store is written from sound blocks only
                    quant.check_scales(torch.from_numpy(np.array(data)), t.qtype, f"{g.path}: tensor {t.name!r}",
                                       t.offset)
                f.seek(offset)
                f.write(data)
                records.append({
                    "name": t.name, "ggml_type": int(types[t.name]), "shape": list(t.shape), "offset": offset,
                    "nbytes": sizes[t.name], "rows": tensor_rows(t), "layer": group_index - 1 if group_index else None,
                    "checksum": checksum(data),
                })
                if t.name in gate_up:
                    row_groups.append(_row_groups(data, t, neurons))
                done += t.nbytes
                if progress:
                    progress(done, total)
        # The copies after every layer, written in file order once the layers are (the file grows front to back),
        # then the norms of the down columns they hold.
        grouped, norms = [], []
        for t in downs:
            data = _encoded(g.tensor_bytes(t.name), t, types[t.name])
            grouped.append(_write_groups(f, data, t, neurons, [next(copy_offsets) for _ in range(copies[t.name][0])]))
            norms.append(down_column_norms(data, types[t.name], t.shape))
        if downs:
            records.append(_write_norms(f, np.stack(norms), norms_offset))
        layer_table = []
        for layer_offsets, group in zip(offsets[1:], layers):
            end = layer_offsets[-1] + sizes[group[-1].name]
            layer_table.append({"offset": layer_offsets[0], "length": end - layer_offsets[0]})
        manifest = json.dumps({
            "format_version": _core.STORE_FORMAT_VERSION, "metadata": g.metadata, "tensors": records,
            "layers": layer_table,
            "layouts": {"ffn_down_groups": {"neurons": neurons, "copies": grouped, "row_groups": row_groups}}
            if downs else {},
        }, allow_nan=False).encode()
        f.seek(0, os.SEEK_END)  # past the last byte written: the group copies end after the last layer
        manifest_offset = -(-f.tell() // _core.STORE_ALIGNMENT) * _core.STORE_ALIGNMENT
        f.seek(manifest_offset)
        f.write(manifest)
        f.seek(0)
        f.write(_core.store_header(manifest_offset, manifest))
    return target


def _down_matrices(layers: list[list[TensorInfo]], path: Path) -> list[TensorInfo]:
    """Each layer's FFN down matrix, for the ffn-groups layout (every layer must have one, of one type)."""
    downs = [next((t for t in layer if t.name.endswith(".ffn_down.weight")), None) for layer in layers]
    if not downs or None in downs:
        raise ModelFormatError(f"{path}: the ffn-groups layout needs an FFN down matrix in every layer")
    return downs


def _group_bytes(t: TensorInfo, qtype: gguf.GGMLQuantizationType, neurons: int) -> tuple[int, int]:
    """(groups, bytes per group) of down matrix `t` written as `qtype`, in groups of `neurons`."""
    rows, width = t.shape
    if width % neurons:
        raise ModelFormatError(f"tensor {t.name!r}: {width} neurons are not whole groups of {neurons}")
    return width // neurons, quant.encoded_nbytes(qtype, (rows, neurons))


def _write_groups(f: BinaryIO, data: np.ndarray, t: TensorInfo, neurons: int, offsets: list[int]) -> dict[str, Any]:
    """Write down matrix `t`'s groups (`ffn_groups`) at `offsets` (aligned, one a group): its manifest record."""
    groups = ffn_groups(data, t.shape, neurons)
    for group, offset in zip(groups, offsets):
        f.seek(offset)
        f.write(group)
    stride = -(-groups.shape[1] // _core.STORE_ALIGNMENT) * _core.STORE_ALIGNMENT  # plan_store_layout's spacing
    return {"tensor": t.name, "offset": offsets[0], "group_bytes": groups.shape[1], "stride": stride,
            "checksums": [checksum(group) for group in groups]}


def down_column_norms(data: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """A down matrix's encoded bytes (`qtype`, `shape` [D, F]) -> [F] float32: the L2 norm of each column, the
    largest output a neuron of activation 1 adds (taken over its values as decoded, in float64)."""
    values = quant.dequantize(torch.from_numpy(np.array(data)), qtype, shape).double()
    return values.norm(dim=0).float().numpy()


def _write_norms(f: BinaryIO, norms: np.ndarray, offset: int) -> dict[str, Any]:
    """Write the [L, F] float32 `DOWN_NORMS` at `offset`: its record in the tensor table (a global)."""
    data = norms.astype("<f4").view(np.uint8).reshape(-1)
    f.seek(offset)
    f.write(data)
    return {"name": DOWN_NORMS, "ggml_type": int(gguf.GGMLQuantizationType.F32), "shape": list(norms.shape),
            "offset": offset, "nbytes": data.nbytes, "rows": norms.shape[0], "layer": None,
            "checksum": checksum(data)}


class DownNorms:
    """Per layer, the norm of each column of its FFN down matrix (`down_column_norms`): [F] float32 on the CPU. A
    store with the ffn-groups layout holds them (`DOWN_NORMS`, read once and checked against its checksum); for
    any other model file a layer's are computed from its down matrix the first time they are asked for (every
    down byte read once more: fine where every byte is read anyway)."""

    def __init__(self, model_file: ModelFileBase) -> None:
        self.file = model_file
        self._norms: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int) -> torch.Tensor:
        if layer not in self._norms:
            down = self.file.tensor(f"blk.{layer}.ffn_down.weight")
            if DOWN_NORMS in self.file.tensors:
                info = self.file.tensor(DOWN_NORMS)
                if info.qtype != gguf.GGMLQuantizationType.F32 or len(info.shape) != 2 or layer >= info.shape[0] or (
                        info.shape[1] != down.shape[1]):
                    raise ModelFormatError(f"{self.file.path}: tensor {DOWN_NORMS!r} is {info.qtype.name} of shape "
                                           f"{list(info.shape)}, not F32 with a row of {down.shape[1]} norms for "
                                           f"layer {layer}'s down matrix")
                # One copy out of the read-only map, as native float32 (the file's are little-endian).
                stored = np.array(self.file.tensor_bytes(DOWN_NORMS)).view("<f4").astype(np.float32, copy=False)
                self._norms.update(enumerate(torch.from_numpy(stored.reshape(info.shape))))
            else:
                self._norms[layer] = torch.from_numpy(down_column_norms(self.file.tensor_bytes(down.name), down.qtype,
                                                                        down.shape))
        return self._norms[layer]


def _row_groups(data: np.ndarray, t: TensorInfo, neurons: int) -> dict[str, Any]:
    """The manifest record of the row groups of gate or up matrix `t` (encoded bytes `data`): rows [g·n, (g+1)·n),
    n = `neurons`, each a contiguous run of its bytes, and their checksums."""
    rows = tensor_rows(t)
    if len(t.shape) != 2:
        raise ModelFormatError(f"tensor {t.name!r}: shape {t.shape} is not a matrix of neurons")
    if rows % neurons:
        raise ModelFormatError(f"tensor {t.name!r}: {rows} neurons are not whole groups of {neurons}")
    groups = np.ascontiguousarray(data).reshape(rows // neurons, -1)
    return {"tensor": t.name, "checksums": [checksum(group) for group in groups]}
