"""Resident Q4_1, Q4_K and (with AVX-512 VNNI) Q6_K matrices take an interleaved layout at load (`ops.interleave_rows`:
rows in groups of 8, word by word) whose kernels give the plain rows' bits. Checked here against the same matrix in
plain rows and against gguf-py's dequantizer: every path a matrix takes (the kernel product at every row count and
kernel set, the dense product of a long prefill, row slices inside and across groups), the layout's own errors, and a
model's resident layers against the same layers streamed (plain) from disk (SmolLM2: Q4_1; Qwen2.5-Coder-1.5B: Q4_K
and Q6_K)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as ref_dequantize

import ntio
from ntio import _core
from ntio.kernels import cpu_kernels, ops, quant

N, K = 48, 256


LAYOUTS = [T.Q4_1, T.Q4_K, T.Q6_K]  # the types with an interleaved layout (Q6_K's: 210-byte blocks, not whole words)


def pair(seed: int = 0, qtype: T = T.Q4_1) -> tuple[ops.EncodedMatrix, ops.EncodedMatrix]:
    """A random matrix [N, K] of `qtype` in plain rows and a copy interleaved in place (whether or not resident
    matrices of the type take the layout on this CPU: its kernels run everywhere)."""
    raw = torch.from_numpy(quant.random_quantized(qtype, (N, K), np.random.default_rng(seed)).reshape(-1).copy())
    plain = ops.EncodedMatrix(raw, qtype, (N, K))
    mixed = ops.EncodedMatrix(raw.clone(), qtype, (N, K), interleaved=True)
    assert _core.interleave(mixed.raw.numpy(), int(qtype), N, K) == mixed.kernel_type
    assert not torch.equal(mixed.raw, plain.raw)
    return plain, mixed


@pytest.mark.skipif(not _core.interleaved_kernels(), reason="the interleaved kernels need AVX2")
def test_resident_matrices_take_the_layout_where_it_pays() -> None:
    """Q4_1 and Q4_K wherever the interleaved kernels run; Q6_K where AVX-512 VNNI's products run its passes, not
    with AVX2's (its lanes cost more than the row kernel at one or two activation rows) nor where AMX's tiles do
    (they take plain rows). The CPU's flags as Linux reports them decide what is expected."""
    assert sorted(_core.INTERLEAVED_TYPES) == sorted(int(q) for q in LAYOUTS)
    with open("/proc/cpuinfo") as f:
        flags = next((set(line.split(":")[1].split()) for line in f if line.startswith("flags")), set())
    resident = set(_core.RESIDENT_INTERLEAVED_TYPES)
    assert {int(T.Q4_1), int(T.Q4_K)} <= resident <= {int(q) for q in LAYOUTS}
    if "amx_int8" not in flags:  # (with AMX flags, whether the OS grants the tiles decides)
        assert (int(T.Q6_K) in resident) == ("avx512_vnni" in flags)
    for qtype in LAYOUTS:
        raw = torch.from_numpy(quant.random_quantized(qtype, (N, K), np.random.default_rng(4)).reshape(-1).copy())
        w = ops.interleave_rows(ops.EncodedMatrix(raw, qtype, (N, K)))
        assert w.interleaved == (int(qtype) in _core.RESIDENT_INTERLEAVED_TYPES), qtype


@pytest.mark.parametrize("qtype", LAYOUTS)
@pytest.mark.parametrize("isa", ["best", "avx2", "scalar"])
@pytest.mark.parametrize("int8", [True, False])
def test_products_give_the_plain_rows_bits(qtype: T, isa: str, int8: bool) -> None:
    """The layout's own kernels (AVX2's 8-bit ones), and elsewhere the plain kernels on each group restored."""
    try:
        _core.check_kernel_isa(isa)
    except ValueError:
        pytest.skip(f"this CPU has no {isa} kernels")
    plain, mixed = pair(0, qtype)
    for t in (1, 3, 8, 33, 64, 100):  # 100: the dense path (dequantize, then F.linear)
        x = torch.randn(t, K)
        with ops.using_kernels(cpu_kernels.KernelChoice(isa, int8)):
            assert torch.equal(ops.linear(x, plain), ops.linear(x, mixed)), (t, isa, int8)
        if t <= 64:  # the public entry point takes the layout's id too
            got = cpu_kernels.quantized_linear(x, mixed.raw, mixed.kernel_type, (N, K), isa=isa, int8=int8)
            assert torch.equal(got, cpu_kernels.quantized_linear(x, plain.raw, qtype, (N, K), isa=isa, int8=int8))


@pytest.mark.parametrize("qtype", LAYOUTS)
def test_a_dense_product_restores_the_plain_rows(qtype: T) -> None:
    """Past the kernels' rows `ops.linear` dequantizes: interleaved rows are first restored to the file's rows (one
    strided copy), whose values are gguf-py's; the kernels' dequantizer takes plain rows only."""
    plain, mixed = pair(1, qtype)
    restored = ops._plain_rows(mixed.raw, qtype, N)
    assert torch.equal(restored, plain.raw)
    shifted = torch.empty(mixed.raw.numel() + 1, dtype=torch.uint8)[1:]  # bytes that start off a word
    shifted.copy_(mixed.raw)
    assert torch.equal(ops._plain_rows(shifted, qtype, N), plain.raw)
    want = ref_dequantize(plain.raw.numpy().reshape(N, -1), qtype).astype(np.float32)
    got = ops._dequantized_rows(mixed, 0, N).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="rows interleaved for the products"):
        _core.dequantize(mixed.raw.numpy(), mixed.kernel_type, K, np.empty((N, K), np.float32))


@pytest.mark.parametrize("qtype", LAYOUTS)
def test_rows_by_id_and_the_whole_dequantized_are_the_plain_rows(qtype: T) -> None:
    """A tied embedding that is an interleaved output head fetches its rows by id from their groups
    (`EncodedMatrix.encoded_rows`), and work outside the forward pass dequantizes the head whole (`ops.dequantized`):
    both as the file's rows give them."""
    plain, mixed = pair(5, qtype)
    ids = torch.tensor([0, 7, 8, 13, 13, 47, 21])
    assert torch.equal(mixed.encoded_rows(ids), plain.encoded_rows(ids))
    assert torch.equal(ops.embedding(ids, mixed), ops.embedding(ids, plain))
    want = ref_dequantize(plain.raw.numpy().reshape(N, -1), qtype).astype(np.float32)
    assert np.array_equal(ops.dequantized(mixed).numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", LAYOUTS)
@pytest.mark.parametrize(("start", "stop"), [(8, 24), (3, 21), (0, 5), (40, 48)])
def test_row_ranges_give_the_plain_rows_products(qtype: T, start: int, stop: int) -> None:
    """A sparse FFN's neuron range (`ops.linear_rows`): interleaved rows are computed in the groups around it, and
    the range's outputs are the plain rows' bits. A slice itself takes whole groups only."""
    plain, mixed = pair(2, qtype)
    x = torch.randn(2, K)
    assert torch.equal(ops.linear_rows(x, plain, start, stop), ops.linear_rows(x, mixed, start, stop))
    if start % 8 or stop % 8:
        with pytest.raises(ValueError, match=rf"rows \[{start}, {stop}\) of an interleaved matrix cut through"):
            ops.row_slice(mixed, start, stop)
    else:
        assert ops.row_slice(mixed, start, stop).interleaved


def test_the_layout_refuses_what_it_cannot_hold() -> None:
    plain, mixed = pair(3)
    raw = plain.raw.numpy()
    with pytest.raises(ValueError, match="has no interleaved layout"):
        _core.interleave(raw[: 34 * 8].copy(), int(T.Q8_0), 8, 32)
    with pytest.raises(ValueError, match="groups of 8"):
        _core.interleave(raw[: 12 * 160].copy(), int(T.Q4_1), 12, K)
    with pytest.raises(ValueError, match="takes 7680 bytes: raw has 7600"):
        _core.interleave(raw[:7600].copy(), int(T.Q4_1), N, K)
    with pytest.raises(ValueError, match="has no plain layout"):
        _core.interleave(raw.copy(), int(T.Q4_1), N, K, inverse=True)
    odd = ops.EncodedMatrix(plain.raw[: 12 * 160].clone(), T.Q4_1, (12, K))
    assert ops.interleave_rows(odd) is odd  # 12 rows: not whole groups, left as they are
    with pytest.raises(ValueError, match="interleaved rows come in groups of 8"):  # a product given part of a group
        ops.linear(torch.randn(1, K), dataclasses.replace(odd, interleaved=True))


@pytest.mark.skipif(not _core.interleaved_kernels(), reason="the interleaved kernels need AVX2")
@pytest.mark.parametrize("model", ["smollm2_path", "qwen15_path"])
def test_resident_layers_compute_what_streamed_ones_do(model: str, request: pytest.FixtureRequest) -> None:
    """SmolLM2 (Q4_1) and Qwen2.5-Coder-1.5B (Q4_K, and Q6_K where it takes the layout): resident layers and output
    heads take the layout, streamed ones keep plain rows; a prefill and decode steps give the same logits, bit for
    bit."""
    path = request.getfixturevalue(model)
    with ntio.load(path, max_context=64, tiers="A") as resident, \
            ntio.load(path, max_context=64, tiers="C") as streamed:
        blocks = resident.loader.resident_blocks()
        w = blocks[3]  # Qwen's block 3 is all Q4_K
        assert w.w_down.interleaved and all(m.interleaved for m in w.w_gate_up)
        # Qwen's Q6_K: half the layers' down projections, and the output head (the tied embedding), which the
        # prompt's and the decode steps' tokens are fetched from.
        head = resident.engine.globals.output
        assert head.qtype == (T.Q6_K if model == "qwen15_path" else T.Q8_0)
        q6_k = [b.w_down for b in blocks if b.w_down.qtype == T.Q6_K] + [head]
        assert all(m.interleaved == (int(m.qtype) in _core.RESIDENT_INTERLEAVED_TYPES) for m in q6_k)
        ids = torch.tensor(resident.encode_prompt("Name three rivers in Europe.", chat=True))

        def run(m: ntio.LLM) -> list[torch.Tensor]:
            logits = [m.engine.forward(ids, 0, all_logits=True)]  # the prefill, then three decode steps
            return logits + [m.engine.forward(torch.tensor([t]), len(ids) + i) for i, t in enumerate([300, 301, 302])]

        assert all(torch.equal(a, b) for a, b in zip(run(resident), run(streamed)))


def test_a_row_stack_interleaves_only_group_aligned_matrices() -> None:
    """In a row stack (q/k/v, gate/up) a matrix takes the layout only where its first row is a multiple of 8 (a
    product takes interleaved rows at group-aligned output columns) and so is the gate/up cut inside it."""
    from ntio.models.layers import _interleaved

    def q4_1(n: int) -> ops.EncodedMatrix:
        raw = quant.random_quantized(T.Q4_1, (n, K), np.random.default_rng(n)).reshape(-1).copy()
        return ops.EncodedMatrix(torch.from_numpy(raw), T.Q4_1, (n, K))

    assert [m.interleaved for m in _interleaved([q4_1(8), q4_1(3), q4_1(8)])] == [True, False, False]
    assert [m.interleaved for m in _interleaved([q4_1(16), q4_1(16)])] == [True, True]
    assert [m.interleaved for m in _interleaved([q4_1(24)], cut=12)] == [False]  # gate/up of F = 12 fused
    assert [m.interleaved for m in _interleaved([q4_1(32)], cut=16)] == [True]
