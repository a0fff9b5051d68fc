"""The ntio store and the extent index, checked against independent truths: tensor bytes and metadata read by
gguf-py's own GGUFReader, dequantization by gguf-py, file bytes read with plain Python file reads."""

from __future__ import annotations

import json
import shutil
import struct

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

import ntio
from ntio import _core
from ntio.cli import main as cli
from ntio.models.config import ModelConfig
from ntio.errors import ModelFormatError, NtioError
from ntio.formats.gguf_file import GGUFFile
from ntio.formats.model_file import layer_extents, open_model_file, plan_layer_read, read_layer, row_extent, tensor_extent
from ntio.formats.store import DOWN_NORMS, DownNorms, StoreFile, convert
from ntio.synth import SynthSpec, write_synthetic_gguf

Q = gguf.GGMLQuantizationType

# Between them, every type ntio decodes (norms are F32).
ALL_TYPES_SPECS = [
    SynthSpec(n_layers=2, d_model=256, d_ff=512, n_heads=4, n_kv_heads=2, seed=3, part_types={
        "attn_q": Q.F16, "attn_k": Q.BF16, "attn_v": Q.Q8_0, "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_1,
        "ffn_up": Q.Q5_0, "ffn_down": Q.Q5_1}, embd_type=Q.Q4_K, output_type=Q.Q5_K),
    SynthSpec(n_layers=2, d_model=256, d_ff=512, n_heads=4, n_kv_heads=2, seed=4, matrix_type=Q.Q6_K,
              part_types={"attn_q": Q.F32}),
]


def file_bytes(path, offset: int, length: int) -> np.ndarray:
    """Bytes of the file, read with plain Python."""
    with open(path, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(length), dtype=np.uint8)


def reference_tensors(path) -> dict[str, np.ndarray]:
    """name -> encoded bytes, as gguf-py's reader sees them."""
    return {t.name: np.asarray(t.data).reshape(-1).view(np.uint8) for t in gguf.GGUFReader(path).tensors}


def reference_dequantized(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    return gguf.quants.dequantize(np.asarray(raw, dtype=np.uint8), qtype).reshape(shape)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> list[tuple]:
    """(gguf path, store path) for each all-types spec."""
    out = []
    for i, spec in enumerate(ALL_TYPES_SPECS):
        d = tmp_path_factory.mktemp(f"synth{i}")
        g = write_synthetic_gguf(d / "m.gguf", spec)
        out.append((g, convert(g, d / "m.ntio")))
    return out


@pytest.fixture(scope="module")
def smollm2_store(smollm2_path, tmp_path_factory):
    return convert(smollm2_path, tmp_path_factory.mktemp("smol") / "smollm2.ntio")


def test_smollm2_store_holds_every_tensor_and_metadata_of_the_gguf(smollm2_path, smollm2_store):
    store = open_model_file(smollm2_store)
    assert isinstance(store, StoreFile) and store.version == 1
    want = reference_tensors(smollm2_path)
    assert set(store.tensors) == set(want) and len(want) == 272
    source = GGUFFile(smollm2_path)
    for name, raw in want.items():
        info = store.tensor(name)
        assert info.offset % 4096 == 0
        assert np.array_equal(store.tensor_bytes(name), raw), name
        # Identical encoded bytes of the same type and shape: identical dequantized values.
        assert (info.qtype, info.shape) == (source.tensor(name).qtype, source.tensor(name).shape)
    reader = gguf.GGUFReader(smollm2_path)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            value = field.contents()
            assert store.metadata[key] == (value.item() if isinstance(value, np.generic) else value), key
    assert len(store.require("tokenizer.ggml.tokens")) == 49152
    assert "im_start" in store.require("tokenizer.chat_template")


def test_smollm2_generates_the_same_tokens_from_store_and_gguf(smollm2_path, smollm2_store):
    prompt = "The capital of France is"
    want = ntio.load(smollm2_path, max_context=64).generate(prompt, 16).token_ids
    got = ntio.load(smollm2_store, max_context=64).generate(prompt, 16).token_ids
    assert got == want and len(want) > 0


@pytest.mark.parametrize("which", range(len(ALL_TYPES_SPECS)))
def test_every_quant_type_round_trips_bit_exact(synthetic, which):
    gguf_path, store_path = synthetic[which]
    store = StoreFile(store_path)
    want = reference_tensors(gguf_path)
    types = set()
    for name, info in GGUFFile(gguf_path).tensors.items():
        s = store.tensor(name)
        assert (s.qtype, s.shape, s.nbytes) == (info.qtype, info.shape, info.nbytes)
        got = reference_dequantized(store.tensor_bytes(name), s.qtype, s.shape)
        ref = reference_dequantized(want[name], info.qtype, info.shape)
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), name
        types.add(s.qtype)
    assert which or types >= {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K}
    assert not which or Q.Q6_K in types


@pytest.mark.parametrize("fmt", ["gguf", "store"])
def test_row_range_extents_hold_the_rows_of_the_dequantized_tensor(synthetic, fmt):
    gguf_path, store_path = synthetic[0]
    path = gguf_path if fmt == "gguf" else store_path
    model_file = open_model_file(path)
    for part in ("attn_q", "attn_v", "ffn_gate", "ffn_up", "ffn_down"):
        info = model_file.tensor(f"blk.1.{part}.weight")
        full = reference_dequantized(file_bytes(path, info.offset, info.nbytes), info.qtype, info.shape)
        rows = info.shape[0]
        assert row_extent(model_file, info.name, 5, 5)[1] == 0
        for start, stop in [(0, 1), (3, 17), (rows // 2, rows)]:
            offset, length = row_extent(model_file, info.name, start, stop)
            got = reference_dequantized(file_bytes(path, offset, length), info.qtype, (stop - start, info.shape[1]))
            assert np.array_equal(got, full[start:stop]), (part, start, stop)
        assert tensor_extent(model_file, info.name) == (info.offset, info.nbytes)
    with pytest.raises(ModelFormatError, match="outside tensor"):
        row_extent(model_file, "blk.0.ffn_up.weight", 0, 10_000)


@pytest.mark.parametrize("backend", _core.BACKENDS)
@pytest.mark.parametrize("fmt", ["gguf", "store"])
def test_layer_reads_through_every_backend_equal_the_file_bytes(synthetic, fmt, backend):
    gguf_path, store_path = synthetic[1]
    path = gguf_path if fmt == "gguf" else store_path
    model_file = open_model_file(path)
    try:
        reader = _core.Reader(path, backend=backend, request_size=8192)
    except _core.BackendUnavailableError as e:
        pytest.skip(str(e))
    extents = layer_extents(model_file, 1)
    if fmt == "store":
        assert len(extents) == 1 and extents[0][0] % 4096 == 0
    for layer in range(2):
        views = read_layer(reader, model_file, layer)
        assert sorted(views) == sorted(f"blk.{layer}.{p}.weight" for p in ntio.models.llama.BLOCK_TENSORS)
        for name, view in views.items():
            info = model_file.tensor(name)
            assert np.array_equal(view, file_bytes(path, info.offset, info.nbytes)), (name, backend)


def test_layer_reads_are_whole_aligned_blocks_covering_every_tensor(synthetic, smollm2_path):
    """O_DIRECT lands every byte in place: no unaligned head or tail to bounce (model_file.plan_layer_read)."""
    for path in (synthetic[1][0], smollm2_path):
        model_file = open_model_file(path)
        size = path.stat().st_size
        for layer in range(ModelConfig.from_gguf(model_file).n_layers):
            planned, nbytes = plan_layer_read(model_file, layer)
            for start, length, dest in planned:
                assert start % 4096 == 0 and dest % 4096 == 0 and dest + length <= nbytes
                assert length % 4096 == 0 or start + length == size
            for part in ntio.models.llama.BLOCK_TENSORS:
                info = model_file.tensor(f"blk.{layer}.{part}.weight")
                assert any(s <= info.offset and info.offset + info.nbytes <= s + n for s, n, _ in planned)


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_flipped_byte_is_a_checksum_error_naming_tensor_and_offset(synthetic, tmp_path):
    bad = shutil.copy(synthetic[0][1], tmp_path / "bad.ntio")
    info = StoreFile(bad).tensor("blk.1.ffn_up.weight")
    flip_byte(bad, info.offset + 100)
    message = f"checksum mismatch in tensor 'blk.1.ffn_up.weight' (extent at offset {info.offset}, {info.nbytes} bytes)"
    store = StoreFile(bad)
    store.tensor_bytes("blk.1.ffn_down.weight")  # others are intact
    with pytest.raises(ModelFormatError, match=r"bad\.ntio: " + message.replace("(", r"\(").replace(")", r"\)")):
        store.tensor_bytes("blk.1.ffn_up.weight")
    with pytest.raises(ModelFormatError, match="blk.1.ffn_up.weight"):
        read_layer(_core.Reader(bad), store, 1)
    assert StoreFile(bad, verify=False).tensor_bytes("blk.1.ffn_up.weight").nbytes == info.nbytes


def test_truncated_store_names_where_it_ends(synthetic, tmp_path):
    bad = shutil.copy(synthetic[0][1], tmp_path / "cut.ntio")
    size = bad.stat().st_size
    with open(bad, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(ModelFormatError, match=f"cut.ntio: truncated ntio store: the file ends at offset {size - 10}, "
                                               f"but its header says {size} bytes"):
        open_model_file(bad)


def test_bad_magic_and_future_version_are_clear_errors(synthetic, tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelFormatError, match=r"junk.bin: not a GGUF file or ntio store \(magic b'PK"):
        open_model_file(junk)
    future = shutil.copy(synthetic[0][1], tmp_path / "future.ntio")
    with open(future, "r+b") as f:
        f.seek(8)
        f.write((2).to_bytes(4, "little"))
    with pytest.raises(ModelFormatError, match="format version 2 is newer than this ntio reads"):
        open_model_file(future)
    with pytest.raises(ModelFormatError, match="not an ntio store"):
        StoreFile(synthetic[0][0])


def test_manifest_corruption_is_detected(synthetic, tmp_path):
    bad = shutil.copy(synthetic[0][1], tmp_path / "manifest.ntio")
    flip_byte(bad, bad.stat().st_size - 2)
    with pytest.raises(ModelFormatError, match="checksum mismatch in tensor '<manifest>'"):
        open_model_file(bad)


def test_failed_convert_leaves_no_temp_file(synthetic, tmp_path, monkeypatch):
    gguf_path = synthetic[0][0]
    with pytest.raises(NtioError, match="cannot write"):
        convert(gguf_path, tmp_path / "missing-dir" / "m.ntio")
    result = CliRunner().invoke(cli, ["convert", str(gguf_path), "-o", str(tmp_path / "missing-dir" / "m.ntio")])
    assert result.exit_code == 1 and "cannot write" in result.output

    calls = []

    def failing_checksum(array):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("disk on fire")
        return 0

    monkeypatch.setattr("ntio.formats.store.checksum", failing_checksum)
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert(gguf_path, tmp_path / "m.ntio")
    assert list(tmp_path.iterdir()) == []


def test_cli_convert_writes_a_store_that_info_reads(synthetic, tmp_path):
    gguf_path = synthetic[0][0]
    out = tmp_path / "cli.ntio"
    result = CliRunner().invoke(cli, ["convert", str(gguf_path), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"NTIOSTOR"
    info = CliRunner().invoke(cli, ["info", str(out), "--json"])
    assert info.exit_code == 0 and '"n_layers": 2' in info.output


def test_checksums_take_checked_buffers_not_addresses():
    data = np.arange(4096, dtype=np.uint8)
    assert _core.checksum(data) == _core.checksum(data.tobytes()) == _core.checksum(bytearray(data.tobytes()))
    with pytest.raises(_core.BufferError, match="data must be C-contiguous"):
        _core.checksum(data[::2])
    with pytest.raises(TypeError):
        _core.checksum(data.ctypes.data)  # an address is refused


# Down matrix types for the ffn-groups layout: blocks of 1 (floats: groups of 32 neurons), 32 and 256.
GROUPED_DOWN_TYPES = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.fixture(scope="module")
def grouped(tmp_path_factory) -> list[tuple]:
    """(gguf path, store, store with the ffn-groups layout) for each down type in GROUPED_DOWN_TYPES."""
    out = []
    for i, qtype in enumerate(GROUPED_DOWN_TYPES):
        d = tmp_path_factory.mktemp(f"grouped{i}")
        spec = SynthSpec(n_layers=2, d_model=256, d_ff=768, n_heads=4, n_kv_heads=2, seed=5 + i,
                         part_types={"ffn_down": qtype})
        g = write_synthetic_gguf(d / "m.gguf", spec)
        out.append((g, convert(g, d / "dense.ntio"), convert(g, d / "grouped.ntio", layout="ffn-groups")))
    return out


def test_ffn_groups_hold_the_down_columns_as_whole_blocks(grouped):
    """Each group, read at its extent with plain file reads and dequantized by gguf-py, is exactly those columns of
    the GGUF's dequantized down matrix; the dense tensors and layer extents are those of a store without it."""
    for (gguf_path, dense_path, grouped_path), qtype in zip(grouped, GROUPED_DOWN_TYPES):
        dense, store, want = StoreFile(dense_path), StoreFile(grouped_path), reference_tensors(gguf_path)
        neurons = 32 if qtype in (Q.F16, Q.BF16) else gguf.GGML_QUANT_SIZES[qtype][0]
        assert store.ffn_group_neurons == neurons and dense.ffn_group_neurons is None
        assert {n: t for n, t in store.tensors.items() if n != DOWN_NORMS} == dense.tensors
        data_end = max(t.offset + t.nbytes for t in dense.tensors.values())
        for layer in range(2):
            assert store.index.layer_extents(layer) == dense.index.layer_extents(layer)
            down = store.tensor(f"blk.{layer}.ffn_down.weight")
            assert down.qtype == qtype
            full = reference_dequantized(want[down.name], qtype, down.shape)
            groups = down.shape[1] // neurons
            extents = store.ffn_group_extents(layer, list(range(groups)))
            for g, (offset, length) in enumerate(extents):
                assert offset % 4096 == 0 and offset >= data_end  # after every dense tensor
                got = reference_dequantized(file_bytes(grouped_path, offset, length), qtype, (down.shape[0], neurons))
                assert np.array_equal(got, full[:, g * neurons:(g + 1) * neurons]), (qtype, layer, g)
                assert np.array_equal(store.ffn_group_bytes(layer, g), file_bytes(grouped_path, offset, length))
            with pytest.raises(ModelFormatError, match=f"no FFN group {groups} in layer {layer}"):
                store.ffn_group_extents(layer, [groups])


def test_the_ffn_layout_records_each_down_columns_norm(grouped, tmp_path):
    """DOWN_NORMS holds, per layer, the L2 norm of each column of the down matrix as gguf-py dequantizes it, after
    the group copies; `DownNorms` reads them from such a store and computes the same from a GGUF or a store
    without them; a flipped byte in them is a checksum error naming the tensor."""
    for (gguf_path, dense_path, grouped_path), qtype in zip(grouped, GROUPED_DOWN_TYPES):
        store, want = StoreFile(grouped_path), reference_tensors(gguf_path)
        info = store.tensor(DOWN_NORMS)
        assert info.qtype == Q.F32 and info.shape == (2, 768) and DOWN_NORMS not in StoreFile(dense_path).tensors
        (offset, length), = store.ffn_group_extents(1, [768 // store.ffn_group_neurons - 1])  # the last group
        assert info.offset >= offset + length
        stored = np.frombuffer(file_bytes(grouped_path, info.offset, info.nbytes), "<f4").reshape(2, 768)
        for layer in range(2):
            down = store.tensor(f"blk.{layer}.ffn_down.weight")
            columns = np.linalg.norm(reference_dequantized(want[down.name], qtype, down.shape).astype(np.float64),
                                     axis=0)
            np.testing.assert_allclose(stored[layer], columns, rtol=1e-6)
            for source in (store, StoreFile(dense_path), GGUFFile(gguf_path)):
                np.testing.assert_allclose(DownNorms(source)(layer).numpy(), columns, rtol=1e-6)
    bad = shutil.copy(grouped[0][2], tmp_path / "bad.ntio")
    info = StoreFile(bad).tensor(DOWN_NORMS)
    flip_byte(bad, info.offset + 5)
    with pytest.raises(ModelFormatError, match=rf"bad\.ntio: checksum mismatch in tensor '{DOWN_NORMS}'"):
        DownNorms(StoreFile(bad))(0)
    # The same bytes as [768, 2]: sound as a tensor, not as a row of norms per layer.
    turned = shutil.copy(grouped[0][2], tmp_path / "turned.ntio")
    rewrite_manifest(turned, lambda m: next(t for t in m["tensors"] if t["name"] == DOWN_NORMS).update(
        shape=[768, 2], rows=768))
    with pytest.raises(ModelFormatError, match=rf"turned\.ntio: tensor '{DOWN_NORMS}' is F32 of shape \[768, 2\], "
                                               r"not F32 with a row of 768 norms for layer 0's down matrix"):
        DownNorms(StoreFile(turned))(0)


def test_ffn_group_corruption_names_the_group_and_a_store_without_groups_says_how(grouped, tmp_path):
    bad = shutil.copy(grouped[-1][2], tmp_path / "bad.ntio")
    (offset, length), = StoreFile(bad).ffn_group_extents(1, [1])
    flip_byte(bad, offset + length - 1)
    store = StoreFile(bad)
    store.ffn_group_bytes(1, 0)  # the others are intact
    with pytest.raises(ModelFormatError, match=rf"bad\.ntio: checksum mismatch in tensor 'blk\.1\.ffn_down\.weight "
                                               rf"group 1' \(extent at offset {offset}, {length} bytes\)"):
        store.ffn_group_bytes(1, 1)
    with pytest.raises(ModelFormatError, match=r"dense\.ntio: no FFN group layout for layer 0; `ntio convert "
                                               r"--layout ffn-groups` writes a store with one"):
        StoreFile(grouped[0][1]).ffn_group_extents(0, [0])


def test_ffn_row_group_checksums_are_those_of_the_gguf_gate_and_up_rows(grouped):
    """Each layer's gate and up have one checksum per group of rows [g·n, (g+1)·n): that of those rows' bytes as
    gguf-py reads them from the GGUF, which are also the bytes of the rows' extent in the store."""
    for gguf_path, dense_path, grouped_path in grouped:
        store, want = StoreFile(grouped_path), reference_tensors(gguf_path)
        neurons = store.ffn_group_neurons
        for layer in range(2):
            for part in ("ffn_gate", "ffn_up"):
                info = store.tensor(f"blk.{layer}.{part}.weight")
                rows = want[info.name].reshape(info.shape[0] // neurons, -1)  # a row group a line
                assert info.shape[0] == 768 and len(rows) == 768 // neurons
                got = store.ffn_row_group_checksums(info.name)
                assert got == [_core.checksum(np.ascontiguousarray(r)) for r in rows], (gguf_path, info.name)
                for g, expected in enumerate(got):
                    offset, length = row_extent(store, info.name, g * neurons, (g + 1) * neurons)
                    assert _core.checksum(file_bytes(grouped_path, offset, length)) == expected
        with pytest.raises(ModelFormatError, match=r"grouped\.ntio: no FFN row group checksums for tensor "
                                                   r"\"blk\.0\.ffn_down\.weight\""):
            store.ffn_row_group_checksums("blk.0.ffn_down.weight")
        with pytest.raises(ModelFormatError, match=r"dense\.ntio: no FFN row group checksums for tensor \"blk\.0\."
                                                   r"ffn_gate\.weight\"; write the store again with `ntio convert "
                                                   r"--layout ffn-groups` to record them"):
            StoreFile(dense_path).ffn_row_group_checksums("blk.0.ffn_gate.weight")


def rewrite_manifest(path, edit) -> None:
    """Replace store `path`'s manifest with what `edit` makes of it (a dict, in place), the header made anew."""
    data = path.read_bytes()
    offset, length = struct.unpack_from("<QQ", data, 16)
    manifest = json.loads(data[offset : offset + length])
    edit(manifest)
    body = json.dumps(manifest).encode()
    path.write_bytes(bytes(_core.store_header(offset, body)) + data[4096:offset] + body)


def test_a_store_from_before_row_groups_opens_and_bad_row_groups_are_refused(grouped, tmp_path):
    old = shutil.copy(grouped[2][2], tmp_path / "old.ntio")
    rewrite_manifest(old, lambda m: m["layouts"]["ffn_down_groups"].pop("row_groups"))
    store = StoreFile(old)
    assert store.ffn_group_neurons == 32 and len(store.ffn_group_bytes(1, 1)) > 0  # the down copies still read
    with pytest.raises(ModelFormatError, match=r"old\.ntio: no FFN row group checksums for tensor \"blk\.1\.ffn_up"
                                               r"\.weight\"; write the store again with `ntio convert --layout "
                                               r"ffn-groups` to record them"):
        store.ffn_row_group_checksums("blk.1.ffn_up.weight")

    def drop_a_checksum(m):
        row_groups = m["layouts"]["ffn_down_groups"]["row_groups"]
        next(r for r in row_groups if r["tensor"] == "blk.1.ffn_up.weight")["checksums"].pop()

    def list_twice(m):
        row_groups = m["layouts"]["ffn_down_groups"]["row_groups"]
        row_groups.append(next(r for r in row_groups if r["tensor"] == "blk.0.ffn_gate.weight"))

    bad = tmp_path / "bad.ntio"
    for edit, reason in [(drop_a_checksum, r"FFN row groups of \"blk\.1\.ffn_up\.weight\": 23 checksums for its 24 "
                                           r"groups"),
                         (list_twice, r"FFN row groups of \"blk\.0\.ffn_gate\.weight\" listed twice")]:
        shutil.copy(grouped[2][2], bad)
        rewrite_manifest(bad, edit)
        with pytest.raises(ModelFormatError, match=r"bad\.ntio: bad ntio store manifest: " + reason):
            StoreFile(bad)


def test_cli_convert_writes_the_ffn_groups_layout(grouped, tmp_path):
    out = tmp_path / "cli.ntio"
    result = CliRunner().invoke(cli, ["convert", str(grouped[0][0]), "-o", str(out), "--layout", "ffn-groups"])
    assert result.exit_code == 0, result.output
    assert StoreFile(out).ffn_group_neurons == 32
    info = CliRunner().invoke(cli, ["info", str(out), "--json"])
    assert info.exit_code == 0 and '"ffn_group_neurons": 32' in info.output
    result = CliRunner().invoke(cli, ["convert", str(grouped[0][0]), "-o", str(out), "--layout", "bundles"])
    assert result.exit_code == 2 and "'bundles' is not 'ffn-groups'" in result.output
