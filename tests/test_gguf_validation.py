"""GGUF headers: ntio's parser (rust/gguf.rs, through `GGUFFile`) reads valid files exactly as gguf-py's GGUFReader
does (the independent oracle), and every malformed header or hyper-parameter is one ModelFormatError line naming the
file and the key or tensor at fault, found quickly and before anything runs."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from ntio.errors import ModelFormatError
from ntio.formats.gguf_file import GGUFFile
from ntio.formats.model_file import open_model_file
from ntio.models.config import ModelConfig
from ntio.models.weights import WeightLayout
from ntio.synth import SynthSpec, write_synthetic_gguf
from test_cli import assert_user_error, ntio, tiny_model  # noqa: F401 (tiny_model is a fixture)

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType


# -- the oracle ----------------------------------------------------------------------------------------------


def _same(ours, theirs, where: str) -> None:
    """Equal values of the same Python types (an int is not a float, a bool not an int), lists element by element."""
    assert type(ours) is type(theirs), f"{where}: {type(ours).__name__} != {type(theirs).__name__}"
    if isinstance(ours, list):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, where


def assert_matches_gguf_reader(path: Path) -> GGUFFile:
    g = GGUFFile(path)
    reader = gguf.GGUFReader(path)
    assert g.version == int(reader.fields["GGUF.version"].parts[0][0])
    assert (g.alignment, g.data_offset) == (reader.alignment, reader.data_offset)
    fields = {key: field for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert list(g.metadata) == list(fields)  # file order
    for key, field in fields.items():
        _same(g.metadata[key], field.contents(), key)
    assert list(g.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        ours = g.tensors[t.name]
        assert ours.qtype == t.tensor_type, t.name
        assert ours.shape == tuple(reversed(t.shape.tolist())), t.name
        assert (ours.offset, ours.nbytes) == (t.data_offset, t.n_bytes), t.name
        assert g.tensor_bytes(t.name).tobytes() == t.data.tobytes(), t.name
    return g


def test_the_real_model_reads_as_gguf_py_reads_it(smollm2_path):
    g = assert_matches_gguf_reader(smollm2_path)
    assert len(g.metadata["tokenizer.ggml.tokens"]) == 49152 and len(g.metadata["tokenizer.ggml.merges"]) == 48900


@pytest.mark.qwen
def test_a_qwen_model_reads_as_gguf_py_reads_it(qwen05_path):
    assert_matches_gguf_reader(qwen05_path)


def test_synthetic_models_read_as_gguf_py_reads_them(tmp_path):
    spec = SynthSpec(n_layers=2, d_model=256, d_ff=512, n_heads=4, n_kv_heads=2, output_type=Q.Q6_K,
                     part_types={"attn_v": Q.Q8_0, "ffn_down": Q.F16}, rope_factors=(1.0,) * 32)
    assert_matches_gguf_reader(write_synthetic_gguf(tmp_path / "synth.gguf", spec))

    # Every value type, typed arrays, a custom alignment and tensors of 1 to 4 dimensions.
    path = tmp_path / "values.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 255)
    w.add_int8("t.i8", -128)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -32768)
    w.add_uint32("t.u32", 2**32 - 1)
    w.add_int32("t.i32", -(2**31))
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.str", "héllo wörld ✓")
    w.add_array("t.strs", ["a", "", "ü"])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_key_value("t.u8s", [1, 2, 255], V.ARRAY, sub_type=V.UINT8)
    w.add_key_value("t.i64s", [-1, 2**62], V.ARRAY, sub_type=V.INT64)
    w.add_key_value("t.f64s", [0.1, 1e300], V.ARRAY, sub_type=V.FLOAT64)
    w.add_tensor("v", np.arange(7, dtype=np.float32))
    w.add_tensor("m", np.ones((3, 5), dtype=np.float16))
    w.add_tensor("c", np.zeros((2, 3, 4), dtype=np.float32))
    w.add_tensor("h", np.zeros((1, 2, 3, 4), dtype=np.int8))
    w.add_tensor("q", np.zeros((2, 34), dtype=np.uint8), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = assert_matches_gguf_reader(path)
    assert g.alignment == 64 and all(t.offset % 64 == 0 for t in g.tensors.values())
    assert g.metadata["t.u64"] == 2**64 - 1 and g.metadata["t.true"] is True


def test_the_parsers_type_table_is_gguf_pys(tmp_path):
    """Every ggml type code gguf-py knows parses with its block and type size; every other code is refused."""
    path = tmp_path / "t.gguf"
    known = {t.value: t for t in Q}
    for code in range(64):
        qtype = known.get(code)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype] if qtype is not None else (256, 1)
        path.write_bytes(_assemble([], [_info("w", [block, 3], code, 0)], bytes(3 * type_size)))
        if qtype is None:
            with pytest.raises(ModelFormatError, match=f"tensor 'w' .* has unknown ggml type {code}$"):
                GGUFFile(path)
        else:
            assert GGUFFile(path).tensors["w"].nbytes == 3 * type_size, qtype.name
    assert set(gguf.GGML_QUANT_SIZES) == set(Q) and max(known) < 64


# -- crafting bad headers ------------------------------------------------------------------------------------


def _u32(v: int) -> bytes:
    return struct.pack("<I", v)


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return _u64(len(b)) + b


def _kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return _str(key) + _u32(vtype) + payload


def _info(name: str | bytes, dims: list[int], code: int, offset: int) -> bytes:
    return _str(name) + _u32(len(dims)) + b"".join(_u64(d) for d in dims) + _u32(code) + _u64(offset)


def _assemble(kvs: list[bytes], infos: list[bytes], data: bytes, version: int = 3, alignment: int = 32) -> bytes:
    head = b"GGUF" + _u32(version) + _u64(len(infos)) + _u64(len(kvs)) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % alignment) + data


class Pieces:
    """A valid GGUF cut into its encoded metadata pairs, tensor infos and data section (with gguf-py's reader), to
    be put back together with some pieces replaced."""

    def __init__(self, path: Path) -> None:
        reader = gguf.GGUFReader(path)
        raw = path.read_bytes()

        def piece(field) -> bytes:
            return raw[field.offset : field.offset + sum(int(p.nbytes) for p in field.parts)]

        self.kvs = {key: piece(f) for key, f in reader.fields.items() if not key.startswith("GGUF.")}
        self.infos = {t.name: piece(t.field) for t in reader.tensors}
        self.relative = {t.name: t.data_offset - reader.data_offset for t in reader.tensors}
        self.data = raw[reader.data_offset :]

    def build(self, path: Path, kvs: dict[str, bytes] | None = None, extra_kvs: tuple[bytes, ...] = (),
              infos: dict[str, bytes] | None = None, version: int = 3) -> Path:
        """Write a copy with pairs replaced (by key) or added, and tensor infos replaced (by name)."""
        pairs = [*{**self.kvs, **(kvs or {})}.values(), *extra_kvs]
        path.write_bytes(_assemble(pairs, list({**self.infos, **(infos or {})}.values()), self.data, version))
        return path

    def moved(self, name: str, offset: int) -> bytes:
        """Tensor `name`'s info with another data offset (the last 8 bytes of an info)."""
        return self.infos[name][:-8] + _u64(offset)


@pytest.fixture(scope="module")
def pieces(tiny_model) -> Pieces:
    return Pieces(tiny_model)


def _load(path: Path) -> None:
    """What `ntio info` does with a model file: parse it, read its config, check its tensor table."""
    g = open_model_file(path)
    WeightLayout(g, ModelConfig.from_gguf(g))


def _refused(path: Path, *needles: str) -> None:
    with pytest.raises(ModelFormatError) as e:
        _load(path)
    message = str(e.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    for needle in needles:
        assert needle in message, message


def test_the_valid_pieces_put_back_together_load(pieces, tmp_path):
    _load(pieces.build(tmp_path / "same.gguf"))


# -- structure -----------------------------------------------------------------------------------------------


def test_an_offset_that_would_wrap_around_is_refused(pieces, tmp_path):
    bad = pieces.build(tmp_path / "wrap.gguf", infos={"blk.0.attn_q.weight": pieces.moved("blk.0.attn_q.weight",
                                                                                          2**64 - 1)})
    _refused(bad, "tensor 'blk.0.attn_q.weight'", "data offset 18446744073709551615", "past the end of the file")


def test_a_misaligned_offset_is_refused(pieces, tmp_path):
    name = "blk.1.ffn_up.weight"
    bad = pieces.build(tmp_path / "misaligned.gguf", infos={name: pieces.moved(name, pieces.relative[name] + 1)})
    _refused(bad, f"tensor '{name}'", "not a multiple of the alignment 32")


def test_overlapping_tensors_are_refused(pieces, tmp_path):
    bad = pieces.build(tmp_path / "overlap.gguf", infos={
        "blk.0.attn_k.weight": pieces.moved("blk.0.attn_k.weight", pieces.relative["blk.0.attn_q.weight"])})
    _refused(bad, "tensors 'blk.0.attn_q.weight'", "'blk.0.attn_k.weight'", "overlap")


def test_an_array_count_of_2_to_the_40_fails_fast(pieces, tmp_path):
    bad = pieces.build(tmp_path / "count.gguf",
                       kvs={"tokenizer.ggml.token_type": _kv("tokenizer.ggml.token_type", V.ARRAY,
                                                             _u32(V.INT32) + _u64(2**40))})
    start = time.perf_counter()
    _refused(bad, "metadata key 'tokenizer.ggml.token_type'", "claims 1099511627776 elements")
    assert time.perf_counter() - start < 1.0
    strings = _kv("tokenizer.ggml.tokens", V.ARRAY, _u32(V.STRING) + _u64(2**40))
    big = pieces.build(tmp_path / "strings.gguf", kvs={"tokenizer.ggml.tokens": strings})
    _refused(big, "metadata key 'tokenizer.ggml.tokens'", "claims 1099511627776 elements")


def test_a_duplicate_key_is_refused(pieces, tmp_path):
    bad = pieces.build(tmp_path / "dup.gguf", extra_kvs=(pieces.kvs["llama.block_count"],))
    _refused(bad, "metadata key 'llama.block_count'", "appears twice")


def test_a_duplicate_tensor_name_is_refused(pieces, tmp_path):
    name = "blk.1.ffn_up.weight"
    renamed = _str("blk.1.ffn_gate.weight") + pieces.infos[name][len(_str(name)) :]
    bad = pieces.build(tmp_path / "dup.gguf", infos={name: renamed})
    _refused(bad, "tensor 'blk.1.ffn_gate.weight'", "appears twice")


def test_invalid_utf8_in_a_string_or_a_token_is_refused(pieces, tmp_path):
    bad = pieces.build(tmp_path / "name.gguf", kvs={"general.name": _kv("general.name", V.STRING, _str(b"caf\xe9"))})
    _refused(bad, "metadata key 'general.name'", "not valid UTF-8")
    raw_tokens = [t.encode() for t in GGUFFile(pieces.build(tmp_path / "ok.gguf")).metadata["tokenizer.ggml.tokens"]]
    raw_tokens[300] = b"\xff\xfe"
    payload = _u32(V.STRING) + _u64(len(raw_tokens)) + b"".join(_str(t) for t in raw_tokens)
    bad = pieces.build(tmp_path / "token.gguf", kvs={"tokenizer.ggml.tokens": _kv("tokenizer.ggml.tokens", V.ARRAY,
                                                                                   payload)})
    _refused(bad, "metadata key 'tokenizer.ggml.tokens'[300]", "not valid UTF-8")


def test_an_unknown_value_type_is_refused(pieces, tmp_path):
    bad = pieces.build(tmp_path / "vtype.gguf", extra_kvs=(_kv("general.extra", 13, _u64(0)),))
    _refused(bad, "metadata key 'general.extra'", "unknown value type 13")


def test_impossible_tensor_dimensions_are_refused(pieces, tmp_path):
    five = pieces.build(tmp_path / "dims5.gguf", infos={"output_norm.weight": _info("output_norm.weight",
                                                                                    [256, 1, 1, 1, 1], 0, 0)})
    _refused(five, "tensor 'output_norm.weight'", "has 5 dimensions")
    overflow = pieces.build(tmp_path / "overflow.gguf", infos={"output_norm.weight": _info("output_norm.weight",
                                                                                           [2**32, 2**32], 0, 0)})
    _refused(overflow, "tensor 'output_norm.weight'", "product overflows 64 bits")
    zero = pieces.build(tmp_path / "zero.gguf", infos={"output_norm.weight": _info("output_norm.weight", [256, 0], 0,
                                                                                   0)})
    _refused(zero, "tensor 'output_norm.weight'", "zero dimension")


def test_a_version_1_file_is_refused(pieces, tmp_path):
    _refused(pieces.build(tmp_path / "v1.gguf", version=1), "GGUF version 1 is not supported")


def test_a_header_cut_anywhere_is_refused_by_name(tiny_model, tmp_path):
    whole = tiny_model.read_bytes()
    header_end = GGUFFile(tiny_model).data_offset
    cut = tmp_path / "cut.gguf"
    for end in sorted({*range(0, header_end, 97), *range(header_end - 40, header_end + 1), 3, 4, 23, 24, 25}):
        cut.write_bytes(whole[:end])
        with pytest.raises(ModelFormatError) as e:
            GGUFFile(cut)
        message = str(e.value)
        assert message.startswith(f"{cut}: ") and "\n" not in message, message
        # Inside the header the field cut short is named; past it, the first tensor whose bytes are missing.
        assert "at offset" in message or "(truncated?)" in message or "not a GGUF file" in message, message


# -- hyper-parameters ----------------------------------------------------------------------------------------


def _with(pieces: Pieces, path: Path, key: str, vtype: int, payload: bytes) -> Path:
    return pieces.build(path, kvs={key: _kv(key, vtype, payload)})


@pytest.mark.parametrize(
    ("key", "vtype", "payload", "needle"),
    [
        ("llama.attention.head_count", V.UINT32, _u32(0), "must be a positive integer, got 0"),
        ("llama.block_count", V.UINT32, _u32(0), "must be a positive integer, got 0"),
        ("llama.block_count", V.STRING, _str("2"), "must be a positive integer, got the string '2'"),
        ("llama.block_count", V.BOOL, b"\x01", "must be a positive integer, got the bool True"),
        ("llama.block_count", V.FLOAT32, struct.pack("<f", 2.0), "must be a positive integer, got 2.0"),
        ("llama.embedding_length", V.ARRAY, _u32(V.UINT32) + _u64(1) + _u32(256),
         "must be a positive integer, got an array of 1 values"),
        ("llama.attention.head_count_kv", V.INT32, struct.pack("<i", -2), "must be a positive integer, got -2"),
        ("llama.feed_forward_length", V.UINT64, _u64(2**40), "must be at most 2147483648, got 1099511627776"),
        ("llama.context_length", V.UINT32, _u32(0), "must be a positive integer, got 0"),
        ("llama.context_length", V.UINT64, _u64(2**63), "must be at most 2147483648"),
        ("llama.rope.dimension_count", V.UINT32, _u32(0), "must be a positive integer, got 0"),
        ("llama.rope.dimension_count", V.UINT32, _u32(63), "must be even and at most the head dimension 64, got 63"),
        ("llama.rope.dimension_count", V.UINT32, _u32(128), "must be even and at most the head dimension 64, got 128"),
        ("llama.vocab_size", V.UINT32, _u32(0), "must be a positive integer, got 0"),
        ("llama.vocab_size", V.UINT32, _u32(500), "is 500, but tensor 'token_embd.weight' has 512 rows"),
        ("llama.attention.layer_norm_rms_epsilon", V.FLOAT32, struct.pack("<f", 0.0),
         "must be a positive finite number, got 0.0"),
        ("llama.attention.layer_norm_rms_epsilon", V.FLOAT32, struct.pack("<f", float("nan")),
         "must be a positive finite number, got nan"),
        ("llama.rope.freq_base", V.FLOAT32, struct.pack("<f", float("inf")),
         "must be a positive finite number, got inf"),
    ],
)
def test_a_bad_hyper_parameter_is_named(pieces, tmp_path, key, vtype, payload, needle):
    _refused(_with(pieces, tmp_path / "bad.gguf", key, vtype, payload), f"metadata key '{key}'", needle)


def test_heads_that_do_not_divide_the_width_are_named(pieces, tmp_path):
    bad = _with(pieces, tmp_path / "heads.gguf", "llama.attention.head_count_kv", V.UINT32, _u32(3))
    _refused(bad, "llama.attention.head_count_kv", "do not divide evenly")


def test_more_blocks_than_the_block_count_are_named(pieces, tmp_path):
    bad = _with(pieces, tmp_path / "blocks.gguf", "llama.block_count", V.UINT32, _u32(1))
    _refused(bad, "tensor 'blk.1.", "metadata key 'llama.block_count' is 1")


def test_a_tensor_shape_the_config_does_not_expect_is_named(pieces, tmp_path):
    # Shapes are WeightLayout's check (ntio.models.weights); a wider feed-forward than the tensors have:
    bad = _with(pieces, tmp_path / "ffn.gguf", "llama.feed_forward_length", V.UINT32, _u32(1024))
    _refused(bad, "tensor 'blk.0.ffn_gate.weight' has shape [512, 256], expected [1024, 256]")


# -- the command line ----------------------------------------------------------------------------------------


def test_info_on_a_corrupt_header_is_one_line(pieces, tmp_path):
    bad = pieces.build(tmp_path / "count.gguf",
                       kvs={"tokenizer.ggml.token_type": _kv("tokenizer.ggml.token_type", V.ARRAY,
                                                             _u32(V.INT32) + _u64(2**40))})
    proc = ntio("info", str(bad))
    assert proc.returncode == 1
    assert_user_error(proc, str(bad), "tokenizer.ggml.token_type", "1099511627776")


def test_info_on_a_bad_hyper_parameter_is_one_line(pieces, tmp_path):
    for key, payload in (("llama.block_count", _u32(0)), ("llama.attention.head_count", _u32(0))):
        bad = _with(pieces, tmp_path / "zero.gguf", key, V.UINT32, payload)
        proc = ntio("info", str(bad))
        assert proc.returncode == 1
        assert_user_error(proc, str(bad), f"metadata key '{key}' must be a positive integer, got 0")


@pytest.mark.parametrize("tensor, tiers", [("output_norm.weight", "A"), ("blk.1.attn_norm.weight", "C"),
                                           ("blk.0.ffn_norm.weight", "A")])
def test_a_norm_that_is_not_finite_is_named(tiny_model, tmp_path, tensor, tiers):  # noqa: F811 (the fixture)
    """A NaN or inf in a norm vector (gguf-py finds its bytes): one line naming the tensor and the element, whether
    the layer is resident or streamed. Unchecked, the 8-bit activations turned the NaN into 0s: logits of 0."""
    bad = tmp_path / "nan-norm.gguf"
    bad.write_bytes(tiny_model.read_bytes())
    info = next(t for t in gguf.GGUFReader(tiny_model).tensors if t.name == tensor)
    with open(bad, "r+b") as f:
        f.seek(info.data_offset + 4 * 5)
        f.write(np.float32(np.nan if tiers == "A" else np.inf).tobytes())
    proc = ntio("generate", "-m", str(bad), "-p", "a", "-n", "2", "--tiers", tiers)
    assert_user_error(proc, str(bad), repr(tensor), "element 5")
