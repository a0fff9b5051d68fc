"""The CUDA kernels (ntio.kernels.cuda_kernels) against an independent reference: gguf-py's dequantizer times a
float64 product. Skipped without a GPU or CuPy (but the fallback without CuPy); `benches/gpu_check.sh` runs them on
a machine that has both.

Tolerance: the kernels sum float32 products, each lane 32 at a time over its chunks, then a 5-level shuffle tree;
with K <= 8192 no sum has more than ~45 terms in sequence, so each output is within 45 · 2⁻²⁴ ≈ 2.7e-6 of the exact
sum relative to Σ|x||w|. The tests allow 1e-5 of Σ|x||w|.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from ntio.kernels import cuda_kernels, ops, quant

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and cuda_kernels.available()),
                               reason="needs a CUDA device and CuPy")

T = gguf.GGMLQuantizationType
TYPES = sorted(cuda_kernels.KERNEL_TYPES)
RELATIVE = 1e-5


def dense(raw: np.ndarray, qtype: T, shape: tuple[int, int]) -> np.ndarray:
    return gguf.quants.dequantize(raw.reshape(-1), qtype).reshape(shape).astype(np.float64)


def assert_close(got: torch.Tensor, x: np.ndarray, w: np.ndarray, scale: float) -> None:
    """got [T, N] against scale · x @ wᵀ in float64, within RELATIVE of scale · |x| @ |w|ᵀ per output."""
    x64 = x.astype(np.float64)
    want = scale * x64 @ w.T
    bound = RELATIVE * abs(scale) * np.abs(x64) @ np.abs(w).T + 1e-30
    err = np.abs(got.double().cpu().numpy() - want)
    assert np.all(err <= bound), f"worst error {float((err / bound).max()):.2f}x the bound"


@needs_gpu
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_matches_gguf_py(qtype, rows):
    rng = np.random.default_rng(int(qtype) * 100 + rows)
    n, k = 37, 1536  # a thread block of 8 rows left part-full; 48 chunks a row: a whole activation tile, then part
    raw = quant.random_quantized(qtype, (n, k), rng)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    got = cuda_kernels.matmul(torch.from_numpy(x).cuda(), torch.from_numpy(raw.reshape(-1)).cuda(), qtype, (n, k),
                              scale=0.75)
    assert got.shape == (rows, n)
    assert_close(got, x, dense(raw, qtype, (n, k)), 0.75)


@needs_gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_row_of_a_pass_has_the_bits_of_a_one_token_pass(qtype):
    """Sums do not depend on T: speculative verification gives each token the bits a decode step gives it. 256 chunks
    a row: eight activation tiles."""
    rng = np.random.default_rng(7)
    n, k = 64, 8192
    encoded = quant.random_quantized(qtype, (n, k), rng)
    raw = torch.from_numpy(encoded.reshape(-1)).cuda()
    x = rng.standard_normal((16, k)).astype(np.float32)
    whole = cuda_kernels.matmul(torch.from_numpy(x).cuda(), raw, qtype, (n, k))
    assert_close(whole, x, dense(encoded, qtype, (n, k)), 1.0)
    for t in (0, 5, 15):
        assert torch.equal(cuda_kernels.matmul(torch.from_numpy(x[t : t + 1]).cuda(), raw, qtype, (n, k))[0], whole[t])


@needs_gpu
@pytest.mark.parametrize("qtype", [T.TQ1_0, T.TQ2_0], ids=lambda t: t.name)
def test_ternary_edge_blocks(qtype):
    """Rows of all -1, all 0, all +1 and mixed codes (gguf-py's quantizer: d = max|w|), and mixed codes whose blocks'
    scale d is 0."""
    k = 512
    mixed = np.tile(np.array([-1.0, 0.0, 1.0, 1.0], np.float32), k // 4)
    values = np.stack([np.full(k, -1.0), np.zeros(k), np.full(k, 1.0), 0.5 * mixed, mixed]).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    raw[4].reshape(2, -1)[:, -2:] = 0  # row 4's two blocks: their float16 d (each block's last 2 bytes) 0.0
    values[4] = 0
    x = np.random.default_rng(3).standard_normal((4, k)).astype(np.float32)
    got = cuda_kernels.matmul(torch.from_numpy(x).cuda(), torch.from_numpy(raw.reshape(-1)).cuda(), qtype,
                              values.shape)
    w = dense(raw, qtype, values.shape)
    np.testing.assert_array_equal(w, values)
    assert_close(got, x, w, 1.0)


@needs_gpu
@pytest.mark.parametrize("blocks", [1, 2], ids=["one-block-groups", "two-block-groups"])
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_column_groups_equal_the_dense_product_with_other_columns_zeroed(qtype, rows, blocks):
    """Groups laid out one after another in one buffer, as a store's group-major down copy, in no particular order;
    a group one block of its type wide (32 or 256 columns) or two (a store's groups of 256 neurons hold 8 blocks of a
    32-element type)."""
    rng = np.random.default_rng(int(qtype) + 11 * rows + 101 * blocks)
    width = blocks * (256 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 32)
    count = 4096 // width
    n, k = 45, 4096
    ids = [int(g) for g in rng.permutation(count)[: count * 5 // 8]]  # 80 chunks a row: more than two tiles
    groups = [quant.random_quantized(qtype, (n, width), rng) for _ in ids]
    buffer = torch.from_numpy(np.concatenate([g.reshape(-1) for g in groups])).cuda()
    size = groups[0].size
    views = [(g * width, buffer[i * size : (i + 1) * size]) for i, g in enumerate(ids)]
    x = rng.standard_normal((rows, k)).astype(np.float32)
    got = cuda_kernels.column_groups_matmul(torch.from_numpy(x).cuda(), views, qtype, n, width, scale=1.5)
    w = np.zeros((n, k))
    for g, raw in zip(ids, groups):
        w[:, g * width : (g + 1) * width] = dense(raw, qtype, (n, width))
    assert_close(got, x, w, 1.5)


@needs_gpu
def test_activation_rows_of_any_stride_and_offset():
    """x a view whose rows start off the 16-byte alignment the kernels load at, or are not contiguous: copied first."""
    rng = np.random.default_rng(9)
    n, k = 24, 512
    raw = quant.random_quantized(T.Q8_0, (n, k), rng)
    big = torch.from_numpy(rng.standard_normal((4, k + 3)).astype(np.float32)).cuda()
    w = dense(raw, T.Q8_0, (n, k))
    for x in (big[:, 1 : k + 1], big.reshape(-1)[1 : 1 + 3 * k].view(3, k), big[:, :k].t().contiguous().t()):
        got = cuda_kernels.matmul(x, torch.from_numpy(raw.reshape(-1)).cuda(), T.Q8_0, (n, k))
        assert_close(got, x.cpu().numpy(), w, 1.0)


@needs_gpu
def test_ops_take_the_kernels_up_to_max_rows_and_dequantize_beyond(monkeypatch):
    rng = np.random.default_rng(5)
    n, k = 40, 256
    raw = quant.random_quantized(T.Q4_K, (n, k), rng)
    w = ops.EncodedMatrix(torch.from_numpy(raw.reshape(-1)).cuda(), T.Q4_K, (n, k), scale=2.0)
    x = rng.standard_normal((cuda_kernels.MAX_ROWS + 1, k)).astype(np.float32)
    want = dense(raw, T.Q4_K, (n, k))
    long_pass = ops.linear(torch.from_numpy(x).cuda(), w)
    assert_close(long_pass, x, want, 2.0)

    def no_dequantizing(*args, **kwargs):
        raise AssertionError("dequantized")

    monkeypatch.setattr(quant, "dequantize", no_dequantizing)
    short = x[: cuda_kernels.MAX_ROWS]
    assert_close(ops.linear(torch.from_numpy(short).cuda(), w), short, want, 2.0)
    assert not ops.dequantizes(cuda_kernels.MAX_ROWS, [T.Q4_K, T.TQ1_0], ops.cpu_kernels.KernelChoice(), cuda=True)
    assert ops.dequantizes(cuda_kernels.MAX_ROWS + 1, [T.Q4_K], ops.cpu_kernels.KernelChoice(), cuda=True)


def test_without_cupy_cuda_products_dequantize_and_the_engine_says_so_once(monkeypatch, capsys):
    """No CuPy (as on this project's CI): the plan keeps the dequantizing scratch, and one stderr line says why and
    what to install."""
    monkeypatch.setattr(cuda_kernels.importlib.util, "find_spec", lambda name: None)
    cuda_kernels.available.cache_clear()
    try:
        assert ops.dequantizes(1, [T.Q4_K], ops.cpu_kernels.KernelChoice(), cuda=True)
        assert not cuda_kernels.takes(1, T.TQ2_0)
    finally:
        cuda_kernels.available.cache_clear()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ntio: CuPy is not installed, so CUDA products dequantize")
    assert "pip install ntio[cuda12]" in err
