"""ntio.kernels.cpu_kernels against an independent reference: gguf-py's `gguf.quants.dequantize` (numpy) of the
weights, then a float64 matmul, on random well-formed blocks and on the real SmolLM2-135M-Instruct tensors, for every
type, shape, batch size and kernel set:
  * 8-bit activations (the default): against the float64 product with x rounded as the kernels see it: through
    gguf-py's own Q8_0 quantizer (`quantize` then `dequantize`) for the 32-element types, and in spans of 128 (the
    K-quants; llama.cpp's Q8_K takes 256) or 256 (the ternary types) with a float32 scale (`q8k_rounded`) for the
    256-element ones; the kernels' integer sums are
    exact, so relative L2 error <= 1e-5;
  * float32 activations (`int8=False`): against x itself, and against `F.linear` on ntio's dequantized weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as ref_dequantize

from ntio import _core
from ntio.kernels import cpu_kernels, quant
from ntio.formats.gguf_file import GGUFFile

TYPES = [T.Q4_1, T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K, T.Q5_K, T.Q5_0, T.Q5_1, T.TQ1_0, T.TQ2_0, T.F16, T.BF16, T.F32]
K_QUANTS = {T.Q4_K, T.Q5_K, T.Q6_K, T.TQ1_0, T.TQ2_0}  # blocks of 256: activations in spans of 128 or 256
TOL = 1e-5


def shapes(qtype: T) -> list[tuple[int, int]]:
    if qtype in K_QUANTS:
        return [(67, 256), (576, 512), (67, 1536)]
    return [(67, 64), (576, 96), (1536, 576), (67, 1536)]


def rel(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


DENSE = {T.F32, T.F16, T.BF16}  # always take float32 activations


def q8_rounded(x: np.ndarray) -> np.ndarray:
    """x [t, k] through gguf-py's Q8_0 quantizer and back: what the 8-bit kernels multiply the weights with."""
    return np.asarray(ref_dequantize(gguf.quants.quantize(x, T.Q8_0), T.Q8_0), np.float64).reshape(x.shape)


def q8k_rounded(x: np.ndarray, qtype: T) -> np.ndarray:
    """x [t, k] in spans of `qtype`'s KERNEL_SPANS: d = max|x| / 127 (float32), codes round(x · (1/d)), ties away
    from 0."""
    spans = x.reshape(-1, _core.KERNEL_SPANS[int(qtype)])
    d = np.abs(spans).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    codes = gguf.quants.np_roundf(spans * inv)
    return (codes.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def check(raw: np.ndarray, qtype: T, shape: tuple[int, int], t: int, rng: np.random.Generator, isa: str = "best"
          ) -> None:
    n, k = shape
    byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
    w64 = np.asarray(ref_dequantize(raw.reshape(byte_shape), qtype), np.float64).reshape(shape)
    x = rng.standard_normal((t, k), dtype=np.float32)
    raw_t = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1))
    y = cpu_kernels.quantized_linear(torch.from_numpy(x), raw_t, qtype, shape, isa=isa)
    assert y.shape == (t, n) and y.dtype == torch.float32
    x_seen = x.astype(np.float64) if qtype in DENSE else q8k_rounded(x, qtype) if qtype in K_QUANTS else q8_rounded(x)
    assert rel(y, x_seen @ w64.T) <= TOL
    y = cpu_kernels.quantized_linear(torch.from_numpy(x), raw_t, qtype, shape, isa=isa, int8=False)
    assert rel(y, x.astype(np.float64) @ w64.T) <= TOL
    assert rel(y, F.linear(torch.from_numpy(x), quant.dequantize(raw_t, qtype, shape))) <= TOL


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("t", [1, 2, 5, 16, 32, 77])  # 77: blocks of 32, 32 and 13 rows
def test_random_blocks_match_the_reference(qtype: T, t: int) -> None:
    rng = np.random.default_rng([int(qtype), t])
    for shape in shapes(qtype):
        check(quant.random_quantized(qtype, shape, rng), qtype, shape, t, rng)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_column_groups_give_the_reference_product_with_the_other_columns_zeroed(qtype: T) -> None:
    """A matrix's groups of columns as a store writes them (`store.ffn_groups`), some of them multiplied with
    `column_groups_linear`: float64 x · Wᵀ with W from gguf-py and x zeroed outside the groups taken (float32
    activations, so x is exact)."""
    from ntio.formats.store import ffn_groups, group_neurons

    rng = np.random.default_rng(int(qtype) + 100)
    n, k = 67, 1024
    raw = quant.random_quantized(qtype, (n, k), rng)
    w64 = np.asarray(ref_dequantize(raw.reshape(gguf.quants.quant_shape_to_byte_shape((n, k), qtype)), qtype),
                     np.float64).reshape(n, k)
    width = group_neurons(qtype)
    groups = torch.from_numpy(ffn_groups(raw.reshape(-1), (n, k), width))
    taken = [g for g in range(k // width) if g % 3 != 1][::-1]
    for t in (1, 9):
        x = rng.standard_normal((t, k), dtype=np.float32)
        y = cpu_kernels.column_groups_linear(torch.from_numpy(x), [(g * width, groups[g]) for g in taken], qtype,
                                             (n, k), width, int8=False)
        zeroed = np.zeros((t, k))
        for g in taken:
            zeroed[:, g * width:(g + 1) * width] = x[:, g * width:(g + 1) * width]
        assert y.shape == (t, n) and rel(y, zeroed @ w64.T) <= TOL


@pytest.mark.parametrize("isa", ["scalar", "avx2"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_each_kernel_set_matches_the_reference(qtype: T, isa: str) -> None:
    if isa == "avx2" and not has_isa("avx2"):
        pytest.skip("this CPU has no AVX2")
    rng = np.random.default_rng(int(qtype))
    shape = shapes(qtype)[0]
    for t in (1, 5, 9):
        check(quant.random_quantized(qtype, shape, rng), qtype, shape, t, rng, isa=isa)


def has_isa(name: str) -> bool:
    try:
        _core.check_kernel_isa(name)
    except ValueError:
        return False
    return True


def test_activation_codes_are_q8_0s_to_the_bit() -> None:
    """A Q8_0 weight row equal to e_j picks x̂_j: every activation the kernels see is gguf-py's Q8_0 rounding of x,
    including ties (x/d exactly halfway) and all-zero groups."""
    k = 64
    x = np.random.default_rng(9).standard_normal((3, k), dtype=np.float32)
    x[1, :32] = 0.0  # an all-zero group
    x[2, :32] = (np.arange(32, dtype=np.float32) - 15.5) / 8  # d = 1/8 exactly (max 127/8): x/d = c + 0.5, ties
    x[2, 0] = 127 / 8
    eye = gguf.quants.quantize(np.eye(k, dtype=np.float32), T.Q8_0)  # row j: 1.0 at j (d = 1/127 in f16, q 127)
    w = np.asarray(ref_dequantize(eye, T.Q8_0), np.float64).reshape(k, k)
    y = cpu_kernels.quantized_linear(torch.from_numpy(x), torch.from_numpy(eye.reshape(-1)), T.Q8_0, (k, k))
    np.testing.assert_allclose(y.numpy(), q8_rounded(x) @ w.T, rtol=1e-6, atol=0)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.TQ1_0, T.TQ2_0], ids=lambda q: q.name)
def test_gguf_py_quantized_blocks(qtype: T) -> None:
    rng = np.random.default_rng(7)
    shape = (67, 256 if qtype in K_QUANTS else 96)
    raw = gguf.quants.quantize(rng.standard_normal(shape, dtype=np.float32), qtype)
    check(raw, qtype, shape, 3, rng)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_0, T.Q8_0, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K],
                         ids=lambda q: q.name)
def test_every_batch_size_on_an_odd_row_count(qtype: T) -> None:
    # every activation-row tiling of the SIMD kernels (t = 1..32), with an odd number of output rows
    rng = np.random.default_rng([int(qtype), 99])
    shape = (331, 512)
    raw = quant.random_quantized(qtype, shape, rng)
    for t in range(1, cpu_kernels.MAX_ROWS + 1):
        check(raw, qtype, shape, t, rng)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda q: q.name)
def test_a_pass_over_t_rows_gives_each_row_what_a_pass_over_it_alone_gives(qtype: T) -> None:
    """Every tiling (tiles of 8 rows, then one of the 1-7 left) computes each row's exact integer sums; only float32
    summation order differs. (In a model this is not enough for equal logits: a 1e-7 difference in an activation can
    move one of its 8-bit codes, so a speculative verification pass and single steps differ at the 8-bit noise
    level.)"""
    rng = np.random.default_rng([int(qtype), 5])
    shape = shapes(qtype)[0]
    raw = torch.from_numpy(quant.random_quantized(qtype, shape, rng).reshape(-1))
    x = torch.from_numpy(rng.standard_normal((31, shape[1]), dtype=np.float32))
    rows = torch.cat([cpu_kernels.quantized_linear(x[i : i + 1], raw, qtype, shape) for i in range(31)])
    for t in (27, 29, 30, 31):  # tiles 8 + 8 + 8 and one of 3, 5, 6, 7
        assert rel(cpu_kernels.quantized_linear(x[:t], raw, qtype, shape), rows[:t]) <= 1e-6


def test_threads_do_not_change_results() -> None:
    rng = np.random.default_rng(3)
    shape = (1536, 576)
    raw = torch.from_numpy(quant.random_quantized(T.Q4_1, shape, rng).reshape(-1))
    x = torch.from_numpy(rng.standard_normal((5, 576), dtype=np.float32))
    before = cpu_kernels.threads()
    try:
        cpu_kernels.set_threads(1)
        one = cpu_kernels.quantized_linear(x, raw, T.Q4_1, shape)
        cpu_kernels.set_threads(2)
        assert cpu_kernels.threads() == 2
        assert torch.equal(one, cpu_kernels.quantized_linear(x, raw, T.Q4_1, shape))
    finally:
        cpu_kernels.set_threads(before)


def test_small_decode_steps_run_torch_on_one_thread_and_restore_it() -> None:
    from ntio.kernels.ops import SERIAL_ATTENTION_WORK, step_threads

    before = torch.get_num_threads()
    cpu = torch.device("cpu")
    try:
        torch.set_num_threads(2)
        with step_threads(cpu, 1, 9 * 150 * 64):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with step_threads(cpu, cpu_kernels.MAX_ROWS + 1, 9 * 150 * 64):  # prefill keeps its threads
            assert torch.get_num_threads() == 2
        with step_threads(cpu, 1, SERIAL_ATTENTION_WORK + 1):  # so does attention over a long cache
            assert torch.get_num_threads() == 2
        with pytest.raises(KeyboardInterrupt), step_threads(cpu, 1, 64):
            raise KeyboardInterrupt
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_out_is_filled_and_returned() -> None:
    rng = np.random.default_rng(4)
    raw = torch.from_numpy(quant.random_quantized(T.Q8_0, (67, 64), rng).reshape(-1))
    x = torch.randn(2, 64)
    out = torch.full((2, 67), float("nan"))
    assert cpu_kernels.quantized_linear(x, raw, T.Q8_0, (67, 64), out=out) is out
    torch.testing.assert_close(out, cpu_kernels.quantized_linear(x, raw, T.Q8_0, (67, 64)), rtol=0, atol=0)


def test_errors() -> None:
    rng = np.random.default_rng(5)
    raw = torch.from_numpy(quant.random_quantized(T.Q4_1, (8, 64), rng).reshape(-1))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="take 320 bytes"):
        cpu_kernels.quantized_linear(x, raw[:-1], T.Q4_1, (8, 64))
    with pytest.raises(ValueError, match="Q2_K is not supported"):
        cpu_kernels.quantized_linear(x, raw, T.Q2_K, (8, 64))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernels.quantized_linear(torch.randn(64, 2).t(), raw, T.Q4_1, (8, 64))
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.quantized_linear(x.double(), raw, T.Q4_1, (8, 64))
    with pytest.raises(ValueError, match="x has no rows"):
        cpu_kernels.quantized_linear(torch.randn(0, 64), raw, T.Q4_1, (8, 64))
    with pytest.raises(ValueError, match="unknown CPU kernel set 'sse9'"):
        cpu_kernels.quantized_linear(x, raw, T.Q4_1, (8, 64), isa="sse9")
    with pytest.raises(ValueError, match="columns"):
        cpu_kernels.quantized_linear(torch.randn(2, 32), raw, T.Q4_1, (8, 64))
    with pytest.raises(ValueError, match="out must have shape"):
        cpu_kernels.quantized_linear(x, raw, T.Q4_1, (8, 64), out=torch.empty(2, 7))
    with pytest.raises(ValueError, match="x must be torch.float32, got torch.bfloat16"):
        cpu_kernels.quantized_linear(x.bfloat16(), raw, T.Q4_1, (8, 64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        cpu_kernels.quantized_linear(x.tolist(), raw, T.Q4_1, (8, 64))
    with pytest.raises(_core.BufferError, match="out overlaps x"):  # out a view of x's memory
        cpu_kernels.quantized_linear(x, raw, T.Q4_1, (8, 64), out=x.view(-1)[:16].view(2, 8))
    with pytest.raises(_core.BufferError, match="out overlaps raw"):
        cpu_kernels.quantized_linear(x, raw, T.Q4_1, (8, 64), out=raw[:64].view(torch.float32).view(2, 8))
    assert cpu_kernels.quantized_linear(x.requires_grad_(), raw, T.Q4_1, (8, 64)).shape == (2, 8)


def test_the_binding_refuses_wrong_buffers() -> None:
    """`_core.quantized_matmul` takes buffers, not addresses, and checks each before the kernels see it: element
    type, C-contiguity, writability, alignment, size and overlap, naming the argument (every matrix's raw, the
    norm)."""
    raw = quant.random_quantized(T.Q4_1, (8, 64), np.random.default_rng(7)).reshape(-1)  # 320 bytes
    x = np.random.default_rng(8).standard_normal((2, 64), dtype=np.float32)
    out = np.full((2, 8), np.nan, np.float32)
    q = int(T.Q4_1)
    _core.quantized_matmul(x, 2, 64, [(raw, q, 8, 1.0)], out)
    expected = cpu_kernels.quantized_linear(torch.from_numpy(x), torch.from_numpy(raw), T.Q4_1, (8, 64))
    np.testing.assert_array_equal(out, expected.numpy())

    def refused(match: str, exc: type[Exception] = _core.BufferError, **args: object) -> None:
        call = {"x": x, "raw": raw, "out": out} | args
        with pytest.raises(exc, match=match):
            _core.quantized_matmul(call["x"], 2, 64, [(call["raw"], q, 8, 1.0)], call["out"])

    refused(r'x must hold float32 elements, got buffer format "d" \(8-byte items\)', x=x.astype(np.float64))
    refused("x must hold float32 elements", x=x.view(np.int32))
    refused("raw must hold uint8 elements", raw=raw.view(np.int8))
    refused("out must hold float32 elements", out=out.astype(np.float16))
    refused("x must be C-contiguous", x=np.asfortranarray(x))
    refused("out must be C-contiguous", out=np.empty((8, 2), np.float32).T)
    refused("raw must be C-contiguous", raw=np.repeat(raw, 2)[::2])
    read_only = out.copy()
    read_only.flags.writeable = False
    refused("out is read-only", out=read_only)
    refused("x must be 4-byte aligned", x=np.frombuffer(bytearray(4 * 128 + 1), np.float32, 128, offset=1))
    refused(r"raw has 319 bytes; Q4_1 weights \[8, 64\] take 320 bytes", ValueError, raw=raw[:-1])
    refused(r"x has 64 floats, \[2, 64\] needs 128", ValueError, x=x[:1])
    refused(r"out has 8 floats, \[2, 8\] needs 16", ValueError, out=out[:1])
    shared = np.zeros(200, np.float32)
    refused("out overlaps x", x=shared[:128], out=shared[120:136])
    refused("out overlaps x", x=out, out=out)
    memory = np.zeros(400, np.uint8)
    refused("out overlaps raw", raw=memory[:320], out=memory[316:380].view(np.float32))
    refused("x must support the buffer protocol", TypeError, x=x.tolist())
    with pytest.raises(_core.BufferError, match="norm must hold float32 elements"):
        _core.quantized_matmul(x, 2, 64, [(raw, q, 8, 1.0)], out, norm=np.ones(64))
    with pytest.raises(ValueError, match="norm has 32 floats, not k = 64"):
        _core.quantized_matmul(x, 2, 64, [(raw, q, 8, 1.0)], out, norm=np.ones(32, np.float32))
    with pytest.raises(_core.BufferError, match="out overlaps raw"):  # the second matrix's raw
        _core.quantized_matmul(x, 2, 64, [(raw[:160], q, 4, 1.0), (memory[:160], q, 4, 1.0)], memory[156:220].view(np.float32))
    with pytest.raises(ValueError, match="ggml type 10 is not supported"):
        _core.quantized_matmul(x, 2, 64, [(raw, 10, 8, 1.0)], out)
    with pytest.raises(ValueError, match='unknown gate activation "gelu"'):
        _core.quantized_matmul(x, 2, 64, [(raw, q, 8, 1.0)], out, gate="gelu")
    np.testing.assert_array_equal(out, expected.numpy())  # no refused call wrote to out


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.ffn_up.weight",
                                  "token_embd.weight"])
def test_smollm2_tensors(smollm2_path, name: str) -> None:
    g = GGUFFile(smollm2_path)
    info = g.tensors[name]
    raw = np.array(g.tensor_bytes(name), np.uint8)
    qtype, shape = T(info.qtype), tuple(info.shape)
    rng = np.random.default_rng(6)
    for t in (1, 5):
        check(raw, qtype, shape, t, rng)
