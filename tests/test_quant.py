"""ntio.kernels.quant against the independent reference gguf-py (`gguf.quants.dequantize`): bit-exact float32 results.

Inputs come from gguf-py's quantizer (non-K types), from raw random bytes with the fp16 scale fields overwritten
by small finite values (every type; the only way to get K-quant blocks without llama.cpp), from `random_quantized`,
and from the real SmolLM2-135M-Instruct Q4_1 model.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize as ref_quantize

from ntio import _core
from ntio.kernels import ops, quant
from ntio.errors import UnsupportedModelError
from ntio.formats.gguf_file import GGUFFile

ALL_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.TQ1_0, T.TQ2_0]
QUANTIZED = [t for t in ALL_TYPES if t not in (T.F32, T.F16, T.BF16)]
# Byte offsets of the fp16 fields in each block (llama.cpp block_* structs), written independently of ntio.kernels.quant.
F16_FIELDS = {
    T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2),
    T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.TQ1_0: (52,), T.TQ2_0: (64,),
}


def byte_shape(qtype: T, shape: tuple[int, ...]) -> tuple[int, ...]:
    return gguf.quants.quant_shape_to_byte_shape(shape, qtype)


def reference(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    out = ref_dequantize(np.ascontiguousarray(raw).view(np.uint8).reshape(byte_shape(qtype, shape)), qtype)
    return np.asarray(out, dtype=np.float32).reshape(shape)


def ours(raw: np.ndarray, qtype: T, shape: tuple[int, ...], **kw) -> torch.Tensor:
    return quant.dequantize(torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy()),
                            qtype, shape, **kw)


def assert_bit_exact(actual: torch.Tensor, expected: np.ndarray) -> None:
    assert actual.dtype == torch.float32
    a = actual.detach().cpu().contiguous().numpy()
    assert a.shape == expected.shape
    bad = a.view(np.uint32) != expected.view(np.uint32)
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.size} values differ, first at {np.argwhere(bad)[0]}: "
        f"{a[bad][:4]} vs reference {expected[bad][:4]}"
    )


def random_blocks(qtype: T, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random bytes for every field, then the fp16 scales replaced by small finite values of either sign
    (including zeros and fp16 subnormals), so the reference gives no NaN/inf."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    nb = int(np.prod(shape)) // block
    blocks = rng.integers(0, 256, (nb, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        v = rng.uniform(1e-3, 2e-2, nb) * rng.choice([-1.0, 1.0], nb)
        v[rng.random(nb) < 0.05] = 0.0
        v[rng.random(nb) < 0.05] = 3e-6  # fp16 subnormal
        blocks[:, off : off + 2] = v.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return blocks


SHAPES = {
    "single_block": lambda block: (block,),
    "rows": lambda block: (5, 3 * block),
    "3d": lambda block: (2, 3, 2 * block),
}


# ------------------------------------------------------------------------------------------- reference agreement


@pytest.mark.parametrize("shape_kind", list(SHAPES))
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_random_blocks_match_reference(qtype: T, shape_kind: str) -> None:
    rng = np.random.default_rng(1000 + int(qtype))
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    shape = SHAPES[shape_kind](max(block, 32))
    raw = random_blocks(qtype, shape, rng)
    assert_bit_exact(ours(raw, qtype, shape), reference(raw, qtype, shape))


@pytest.mark.parametrize("shape_kind", list(SHAPES))
@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1],
                         ids=lambda t: t.name)
def test_gguf_quantized_data_matches_reference(qtype: T, shape_kind: str) -> None:
    rng = np.random.default_rng(int(qtype))
    shape = SHAPES[shape_kind](32)
    data = (rng.standard_normal(shape) * rng.uniform(0.01, 3.0, shape[:-1] + (1,))).astype(np.float32)
    data.reshape(-1)[:4] = [0.0, -0.0, 1e-7, -65504.0]  # zeros, an fp16 subnormal, fp16 max
    raw = ref_quantize(data, qtype)
    assert_bit_exact(ours(raw, qtype, shape), reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", [T.TQ1_0, T.TQ2_0], ids=lambda t: t.name)
@pytest.mark.parametrize("edge", ["all -1", "all 0", "all +1", "mixed", "scale 0"])
def test_ternary_edge_blocks_match_reference(qtype: T, edge: str) -> None:
    """gguf-py's own ternary quantizer on blocks of one value (every code 0, 1 or 2: the packing's extremes, e.g. a
    TQ1_0 byte of five 2s is 255), on a mix, and on a block whose scale is 0."""
    rng = np.random.default_rng(int(qtype))
    shape = (3, 512)
    values = {"all -1": -0.25, "all 0": 0.0, "all +1": 0.25}
    data = (np.full(shape, values[edge], np.float32) if edge in values
            else rng.choice(np.array([-0.5, 0.0, 0.5], np.float32), shape))
    raw = ref_quantize(data, qtype)
    if edge == "scale 0":
        d_at = F16_FIELDS[qtype][0]
        raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])[:, d_at : d_at + 2] = 0
    expected = reference(raw, qtype, shape)
    if edge in values:
        assert (expected == values[edge]).all()
    assert_bit_exact(ours(raw, qtype, shape), expected)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_many_chunks_with_ragged_tail(qtype: T, monkeypatch: pytest.MonkeyPatch) -> None:
    # The CPU path works in chunks of blocks; force many small chunks and a partial last one.
    monkeypatch.setattr(quant, "_CPU_CHUNK_ELEMENTS", 768)
    rng = np.random.default_rng(7)
    shape = (3, 7 * 256)
    raw = quant.random_quantized(qtype, shape, rng) if qtype in (T.F32, T.F16, T.BF16) else random_blocks(
        qtype, shape, rng)
    assert_bit_exact(ours(raw, qtype, shape), reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_random_quantized_matches_reference_and_looks_like_weights(qtype: T) -> None:
    rng = np.random.default_rng(42)
    shape = (64, 1024)
    raw = quant.random_quantized(qtype, shape, rng)
    assert raw.dtype == np.uint8
    assert raw.shape == byte_shape(qtype, shape)
    assert raw.size == quant.encoded_nbytes(qtype, shape)
    expected = reference(raw, qtype, shape)
    assert np.isfinite(expected).all()
    assert 0.01 < expected.std() < 0.04, expected.std()
    assert abs(expected.mean()) < 0.005, expected.mean()
    assert len(np.unique(expected)) > 100  # not degenerate
    assert_bit_exact(ours(raw, qtype, shape), expected)


def test_random_quantized_is_reproducible_and_3d() -> None:
    a = quant.random_quantized(T.Q4_K, (2, 3, 256), np.random.default_rng(5))
    b = quant.random_quantized(T.Q4_K, (2, 3, 256), np.random.default_rng(5))
    assert a.shape == (2, 3, 144)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_embedding_rows_decoded_by_the_kernels_match_reference(qtype: T) -> None:
    """`ops.embedding` on the CPU decodes its rows in Rust (`_core.dequantize`), not in `quant.dequantize`: the
    rows it picks must be gguf-py's, bit for bit, repeated ids and the last row included."""
    rng = np.random.default_rng(300 + int(qtype))
    shape = (9, 2 * 256)
    raw = quant.random_quantized(qtype, shape, rng) if qtype in (T.F32, T.F16, T.BF16) else random_blocks(
        qtype, shape, rng)
    table = ops.EncodedMatrix(torch.from_numpy(np.ascontiguousarray(raw).reshape(-1)), qtype, shape)
    ids = torch.tensor([8, 0, 3, 3])
    assert_bit_exact(ops.embedding(ids, table), reference(raw, qtype, shape)[ids.numpy()])


def test_the_kernels_dequantizer_refuses_partial_rows() -> None:
    raw = np.zeros(2 * 20, np.uint8)  # two Q4_1 blocks
    with pytest.raises(ValueError, match="not a positive multiple"):
        _core.dequantize(raw, int(T.Q4_1), 48, np.empty(48, np.float32))
    with pytest.raises(ValueError, match="rows of 32 take 20 bytes"):
        _core.dequantize(raw[:30], int(T.Q4_1), 32, np.empty(32, np.float32))
    with pytest.raises(ValueError, match="rows of 32 take 20 bytes"):
        _core.dequantize(raw, int(T.Q4_1), 32, np.empty(63, np.float32))


# ------------------------------------------------------------------------------------------------ real model


@pytest.fixture(scope="module")
def smollm2(smollm2_path) -> GGUFFile:
    return GGUFFile(smollm2_path)  # parsing the 49k-token vocabulary takes seconds: open once


def load(g: GGUFFile, name: str) -> tuple[np.ndarray, T, tuple[int, ...]]:
    info = g.tensors[name]
    return np.array(g.tensor_bytes(name)), info.qtype, info.shape


@pytest.mark.parametrize(
    ("name", "qtype"),
    [
        ("token_embd.weight", T.Q8_0),
        ("blk.0.attn_q.weight", T.Q4_1),
        ("blk.0.ffn_down.weight", T.Q4_1),
        ("blk.29.ffn_gate.weight", T.Q4_1),
        ("blk.0.attn_norm.weight", T.F32),
        ("output_norm.weight", T.F32),
    ],
)
def test_real_model_tensors_match_reference(smollm2: GGUFFile, name: str, qtype: T) -> None:
    raw, qt, shape = load(smollm2, name)
    assert qt == qtype
    expected = reference(raw, qt, shape)
    assert_bit_exact(quant.dequantize(torch.from_numpy(raw), qt, shape), expected)


def test_real_model_layer_into_reused_buffers(smollm2: GGUFFile) -> None:
    # The streaming engine's pattern: one layer's matrices dequantized into row slices of fused buffers.
    g = smollm2
    names = ["blk.3.attn_q.weight", "blk.3.attn_k.weight", "blk.3.attn_v.weight"]
    parts = [load(g, n) for n in names]
    rows = sum(shape[0] for _, _, shape in parts)
    fused = torch.full((rows, parts[0][2][1]), float("nan"))
    for layer in (3, 4):  # second pass overwrites the same buffer with another layer
        parts = [load(g, n.replace("blk.3", f"blk.{layer}")) for n in names]
        start = 0
        for raw, qt, shape in parts:
            target = fused[start : start + shape[0]]
            assert quant.dequantize(torch.from_numpy(raw), qt, shape, out=target) is target
            start += shape[0]
        assert_bit_exact(fused, np.concatenate([reference(r, q, s) for r, q, s in parts]))


# ------------------------------------------------------------------------------------------------- API edges


def test_out_is_filled_and_returned() -> None:
    rng = np.random.default_rng(3)
    shape = (4, 512)
    out = torch.full(shape, float("nan"))
    for qtype in (T.Q4_K, T.Q8_0, T.Q6_K):  # the same buffer, reused across types
        raw = random_blocks(qtype, shape, rng)
        assert ours(raw, qtype, shape, out=out) is out
        assert_bit_exact(out, reference(raw, qtype, shape))


def test_non_contiguous_out_gets_the_values() -> None:
    rng = np.random.default_rng(4)
    shape = (64, 32)
    raw = random_blocks(T.Q4_0, shape, rng)
    out = torch.zeros(32, 64).t()  # transposed view
    assert ours(raw, T.Q4_0, shape, out=out) is out
    assert_bit_exact(out, reference(raw, T.Q4_0, shape))


def test_unaligned_raw_slice() -> None:
    rng = np.random.default_rng(5)
    shape = (2, 256)
    raw = random_blocks(T.Q5_K, shape, rng).reshape(-1)
    padded = torch.zeros(raw.size + 3, dtype=torch.uint8)
    padded[3:] = torch.from_numpy(raw)
    assert_bit_exact(quant.dequantize(padded[3:], T.Q5_K, shape), reference(raw, T.Q5_K, shape))


def test_empty_tensor() -> None:
    assert quant.dequantize(torch.empty(0, dtype=torch.uint8), T.Q4_K, (0, 256)).shape == (0, 256)


@pytest.mark.parametrize("qtype", ALL_TYPES + [T.Q2_K, T.IQ2_XXS], ids=lambda t: t.name)
def test_encoded_nbytes_matches_gguf(qtype: T) -> None:
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    for shape in [(block,), (3, 4 * block), (2, 5, 2 * block)]:
        assert quant.encoded_nbytes(qtype, shape) == int(np.prod(byte_shape(qtype, shape)))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_encoded_nbytes_rejects_partial_block(qtype: T) -> None:
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    with pytest.raises(ValueError, match=str(block)):
        quant.encoded_nbytes(qtype, (4, block + 16))


@pytest.mark.parametrize("delta", [-1, 1, -18])
def test_wrong_raw_length(delta: int) -> None:
    shape = (2, 64)
    expected = quant.encoded_nbytes(T.Q4_0, shape)
    assert expected == 2 * 2 * 18
    raw = torch.zeros(expected + delta, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"expected {expected} bytes.*got {expected + delta}"):
        quant.dequantize(raw, T.Q4_0, shape)


def test_bad_out_rejected() -> None:
    raw = torch.zeros(quant.encoded_nbytes(T.Q8_0, (2, 32)), dtype=torch.uint8)
    for bad in (torch.empty(2, 32, dtype=torch.float16), torch.empty(2, 64), torch.empty(64)):
        with pytest.raises(ValueError, match="out"):
            quant.dequantize(raw, T.Q8_0, (2, 32), out=bad)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.IQ2_XXS, T.Q8_1, T.IQ4_NL], ids=lambda t: t.name)
def test_unsupported_types(qtype: T) -> None:
    assert qtype not in quant.SUPPORTED_TYPES
    shape = (1, 256)
    raw = torch.zeros(quant.encoded_nbytes(qtype, shape), dtype=torch.uint8)
    with pytest.raises(UnsupportedModelError, match=rf"tensor type {qtype.name} is not supported \(supported: .*Q4_K"):
        quant.dequantize(raw, qtype, shape)
    with pytest.raises(UnsupportedModelError, match=qtype.name):
        quant.random_quantized(qtype, shape, np.random.default_rng(0))


def test_supported_types() -> None:
    assert quant.SUPPORTED_TYPES == frozenset(ALL_TYPES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_matches_reference(qtype: T) -> None:
    rng = np.random.default_rng(11)
    shape = (6, 2048)
    raw = quant.random_quantized(qtype, shape, rng) if qtype in (T.F32, T.F16, T.BF16) else random_blocks(
        qtype, shape, rng)
    dev = torch.from_numpy(raw.reshape(-1).copy()).cuda()
    out = torch.empty(shape, device="cuda")
    assert quant.dequantize(dev, qtype, shape, out=out) is out
    assert_bit_exact(out, reference(raw, qtype, shape))
