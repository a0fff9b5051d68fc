"""GGUF tensor dequantization in PyTorch: one vectorized code path for CPU and CUDA.

Matches `gguf.quants.dequantize` (gguf-py) bit for bit: every type is computed with the same float32 operations in
the same order as the reference (e.g. Q4_1 is `d * q + m`, Q4_K is `(d * sc) * q - (dmin * m)`), and the integer
codes are unpacked exactly. No fused multiply-add is used, so CPU and CUDA give the same bits.

How the hot path works (the streaming engine calls `dequantize` for every streamed layer, every token):
  * the raw bytes are viewed as [n_blocks, block_bytes]; fp16 scales are `view(torch.float16)` on 2-byte columns;
  * packed codes are unpacked with integer ops on the widest word the block layout allows (int32 / int16 / uint8,
    so 4 nibble pairs per op instead of 1) into a small uint8 code buffer laid out in output order;
  * the codes are converted straight into `out` (`copy_`), then scaled in place (`mul_`, `add_` / `sub_`).
On CPU the work is done in chunks of blocks small enough that `out`'s chunk stays in L2 cache between those passes,
so the output is written to memory once; on CUDA the whole tensor is one chunk.

`random_quantized` builds well-formed random blocks (numpy, vectorized) for synthetic random-weight models.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import gguf
import numpy as np
import torch

from ntio.errors import ModelFormatError, UnsupportedModelError

T = gguf.GGMLQuantizationType
QK_K = 256  # elements in a K-quant super-block

# ----------------------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------------------

_BYTE_REPEAT = {torch.int32: 0x01010101, torch.int16: 0x0101, torch.uint8: 0x01}
_CONSTS: dict[tuple[torch.device, torch.dtype, tuple[int, ...]], torch.Tensor] = {}


def _const(values: tuple[int, ...], dtype: torch.dtype, device: torch.device, shape: tuple[int, ...]) -> torch.Tensor:
    """A small constant tensor (shift tables), cached per device so CUDA does not copy it every call."""
    key = (device, dtype, values)
    t = _CONSTS.get(key)
    if t is None:
        t = _CONSTS[key] = torch.tensor(values, dtype=dtype, device=device)
    return t.view(shape)


def _words(b: torch.Tensor) -> torch.Tensor:
    """View a uint8 column range [..., L] of the block table as the widest int words its alignment allows.

    Byte-wise masks then work on 4 (int32) or 2 (int16) bytes per element; `_rep` gives the matching mask.
    """
    offset = b.storage_offset()
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if b.shape[-1] % size == 0 and offset % size == 0 and all(s % size == 0 for s in b.stride()[:-1]):
            return b.view(dtype)
    return b


def _rep(byte: int, dtype: torch.dtype) -> int:
    """`byte` repeated in every byte of a `dtype` word (masks for `_words` views)."""
    return byte * _BYTE_REPEAT[dtype]


def _f16(b: torch.Tensor, offset: int) -> torch.Tensor:
    """fp16 field at byte `offset` of every block -> float32 [n_blocks, 1]."""
    return b[:, offset : offset + 2].view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int, planar: bool = False) -> torch.Tensor:
    """Unpack 4-bit codes: qs [nb, groups * L] bytes -> uint8 codes [nb, groups, 2, L] (per group of L bytes: the
    low nibbles, then the high nibbles: the element order of every nibble-packed ggml type).

    The bit ops run on int words (`_words`). Where a group is short and there are several per block (Q4_K/Q5_K:
    32 B = 8 int32 words), writing the interleaved order directly means very short inner loops; `planar=True` keeps
    the two nibble planes apart in memory ([2, nb, groups, L] storage, returned as a permuted view) so the bit ops
    run on whole blocks and `_scale` interleaves while converting. Measured faster for Q4_K, slower elsewhere.
    """
    nb, n = qs.shape
    src = _words(qs).view(nb, groups, -1)
    if planar:
        planes = torch.empty((2, nb, groups, n // groups), dtype=torch.uint8, device=qs.device)
        codes = planes.permute(1, 2, 0, 3)
    else:
        codes = torch.empty((nb, groups, 2, n // groups), dtype=torch.uint8, device=qs.device)
    dst = codes.view(src.dtype)
    mask = _rep(0x0F, src.dtype)
    torch.bitwise_and(src, mask, out=dst[:, :, 0])
    torch.bitwise_right_shift(src, 4, out=dst[:, :, 1])
    dst[:, :, 1].bitwise_and_(mask)
    return codes


def _or_high_bits(codes: torch.Tensor, qh: torch.Tensor, shifts: tuple[int, ...], shifts_shape: tuple[int, ...],
                  width: int) -> None:
    """codes |= ((qh >> shifts) & (2**width - 1)) << 4: adds bits 4.. of 5- and 6-bit codes.

    qh (int words or bytes) and the shift table broadcast to the plane layout [2 (nibble), nb, groups, L / word]
    of codes [nb, groups, 2, L].
    """
    high = qh >> _const(shifts, qh.dtype, qh.device, shifts_shape)
    high.bitwise_and_(_rep((1 << width) - 1, qh.dtype)).bitwise_left_shift_(4)
    codes.permute(2, 0, 1, 3).view(qh.dtype).view(high.shape).bitwise_or_(high)


def _signed(codes: torch.Tensor, offset: int) -> torch.Tensor:
    """Unsigned codes minus `offset`, as int8 (in place, wrapping in uint8: exact for codes < offset + 128)."""
    return codes.sub_(offset).view(torch.int8)


def _scale(out: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None,
           subtract: bool = False) -> None:
    """out = d * codes (+ m, or - m if `subtract`), in float32 with one rounding per operation like the reference.

    out [nb, block] float32; codes [nb, G, 2, L] integer codes from `_nibbles`; d and m [nb, S] float32, one value
    per sub-block of block / S consecutive elements.
    """
    nb, groups, _, n = codes.shape
    if codes.is_contiguous():
        out.copy_(codes.view(nb, -1))  # integer -> float32 is exact
    else:  # planar storage: one copy per plane keeps the inner loops long
        halves = out.view(nb, groups, 2, n)
        halves[:, :, 0].copy_(codes[:, :, 0])
        halves[:, :, 1].copy_(codes[:, :, 1])
    sub = out.view(nb, d.shape[1], -1)
    sub.mul_(d.unsqueeze(-1))
    if m is None:
        return
    if subtract:
        sub.sub_(m.unsqueeze(-1))
    else:
        sub.add_(m.unsqueeze(-1))


# ----------------------------------------------------------------------------------------------------------------
# Per-type dequantizers: blocks uint8 [nb, type_size] -> out float32 [nb, block_size]
# ----------------------------------------------------------------------------------------------------------------


def _dq_float(dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], None]:
    # F32 / F16 / BF16: one element per "block"; fp16 and bf16 widen to float32 exactly.
    def dq(b: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(b.view(dtype))

    return dq


def _dq_q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # Q8_0 block (34 B): d f16, qs 32 x int8.   x = d * q
    out.copy_(b[:, 2:].view(torch.int8))
    out.mul_(_f16(b, 0))


def _dq_q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # Q4_0 block (18 B): d f16, qs 16 B (element j < 16: low nibble of qs[j], j >= 16: high nibble of qs[j-16]).
    # x = d * (q - 8)
    _scale(out, _signed(_nibbles(b[:, 2:], 1), 8), _f16(b, 0))


def _dq_q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    # Q4_1 block (20 B): d f16, m f16, qs 16 B (nibbles as Q4_0).   x = d * q + m
    _scale(out, _nibbles(b[:, 4:], 1), _f16(b, 0), _f16(b, 2))


def _q5_codes(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    # Q5_0 / Q5_1 codes: low 4 bits as Q4_0, bit 4 of element j is bit j of the little-endian u32 qh (4 B).
    # In plane layout [2, nb, 1, 16]: plane h, element j takes bit j % 8 of qh byte 2h + j // 8.
    codes = _nibbles(b[:, qh_at + 4 :], 1)
    qh = b[:, qh_at : qh_at + 4].view(-1, 2, 2).permute(1, 0, 2).unsqueeze(-1)  # [2, nb, 2, 1] bytes
    _or_high_bits(codes, qh, tuple(range(8)), (8,), 1)
    return codes


def _dq_q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # Q5_0 block (22 B): d f16, qh 4 B, qs 16 B.   x = d * (q - 16)
    _scale(out, _signed(_q5_codes(b, 2), 16), _f16(b, 0))


def _dq_q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    # Q5_1 block (24 B): d f16, m f16, qh 4 B, qs 16 B.   x = d * q + m
    _scale(out, _q5_codes(b, 4), _f16(b, 0), _f16(b, 2))


def _k_scale_min(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte scales field at bytes 4..16 -> (sc, m) uint8 [nb, 8] each, 6 bits per value.

    Bytes 0-3: sc[0:4] low 6 bits, sc[4:8] bits 4-5 on top; bytes 4-7: the same for m;
    bytes 8-11: sc[4:8] bits 0-3 (low nibble) and m[4:8] bits 0-3 (high nibble).
    """
    nb = b.shape[0]
    w = _words(b[:, 4:16]).view(nb, 3, -1)
    dt = w.dtype
    lo, mlo, hi = w[:, 0], w[:, 1], w[:, 2]
    res = torch.empty((nb, 2, 2, w.shape[-1]), dtype=dt, device=b.device)  # [sc|m][first 4|last 4]
    torch.bitwise_and(lo, _rep(0x3F, dt), out=res[:, 0, 0])
    torch.bitwise_and(mlo, _rep(0x3F, dt), out=res[:, 1, 0])
    torch.bitwise_and(hi, _rep(0x0F, dt), out=res[:, 0, 1])
    torch.bitwise_right_shift(hi, 4, out=res[:, 1, 1])
    res[:, 1, 1].bitwise_and_(_rep(0x0F, dt))
    top = torch.stack((lo, mlo), 1).bitwise_right_shift_(2).bitwise_and_(_rep(0x30, dt))
    res[:, :, 1].bitwise_or_(top)
    res = res.view(torch.uint8).view(nb, 2, 8)
    return res[:, 0], res[:, 1]


def _dq_q4_k_like(b: torch.Tensor, out: torch.Tensor, with_high: bool) -> None:
    nb = b.shape[0]
    sc, mn = _k_scale_min(b)
    dl = _f16(b, 0) * sc  # [nb, 8], exact (11-bit x 6-bit)
    ml = _f16(b, 2) * mn
    qs_at = 48 if with_high else 16
    codes = _nibbles(b[:, qs_at:], 4, planar=True)  # [nb, 4, 2, 32]: sub-block s = 2 * group + plane
    if with_high:  # bit 4 of sub-block s, element j: bit s of qh[j]; shift table [plane h][group g] = 2g + h
        qh = _words(b[:, 16:48])
        _or_high_bits(codes, qh.view(1, nb, 1, -1), (0, 2, 4, 6, 1, 3, 5, 7), (2, 1, 4, 1), 1)
    _scale(out, codes, dl, ml, subtract=True)


def _dq_q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # Q4_K block (144 B): d f16, dmin f16, scales 12 B (8 x 6-bit scale/min pairs), qs 128 B.
    # 8 sub-blocks of 32: qs byte group g (32 B) holds sub-block 2g (low nibbles) and 2g+1 (high nibbles).
    # x = (d * sc[s]) * q - (dmin * m[s])
    _dq_q4_k_like(b, out, with_high=False)


def _dq_q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # Q5_K block (176 B): d f16, dmin f16, scales 12 B (as Q4_K), qh 32 B, qs 128 B (as Q4_K).
    # bit 4 of element j of sub-block s is bit s of qh[j].   x = (d * sc[s]) * q - (dmin * m[s])
    _dq_q4_k_like(b, out, with_high=True)


def _dq_q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # Q6_K block (210 B): ql 128 B, qh 64 B, scales 16 x int8, d f16 (at 208).
    # Two halves h of 128 elements: low 4 bits from ql[64h : 64h+64] (low nibbles, then high nibbles),
    # bits 4-5 of element 32t + j from (qh[32h + j] >> 2t) & 3.   x = (d * scales[e // 16]) * (q - 32)
    nb = b.shape[0]
    codes = _nibbles(b[:, :128], 2)  # [nb, 2 (half), 2 (nibble n), 64]: element 64n + p of the half
    # element 64n + 32u + j of half hh takes (qh[32hh + j] >> 2(2n + u)) & 3; shift table [n][u]
    qh = _words(b[:, 128:192])
    _or_high_bits(codes, qh.view(1, nb, 2, 1, -1), (0, 2, 4, 6), (2, 1, 1, 2, 1), 2)
    d = _f16(b, 208) * b[:, 192:208].view(torch.int8)  # [nb, 16], exact
    _scale(out, _signed(codes, 32), d)


def _dq_tq2_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # TQ2_0 block (66 B): qs 64 B, d f16 (at 64). Two halves h of 128 elements: element 32l + j of half h is bits
    # 2l..2l+2 of qs[32h + j].   x = d * (q - 1): ternary codes 0..2 (a stray 3 decodes as +2, as in ggml)
    nb = b.shape[0]
    qs = _words(b[:, :64]).view(nb, 2, 1, -1)  # [nb, half, 1, 32 B as words]
    codes = torch.empty((nb, 2, 4, 32), dtype=torch.uint8, device=b.device)  # [nb, half, l, j]
    dst = codes.view(qs.dtype)
    torch.bitwise_right_shift(qs, _const((0, 2, 4, 6), qs.dtype, qs.device, (4, 1)), out=dst)
    dst.bitwise_and_(_rep(0x03, qs.dtype))
    _scale(out, _signed(codes, 1).view(nb, 1, 1, -1), _f16(b, 64))


_POW3 = (1, 3, 9, 27, 81)


def _trits(q: torch.Tensor, count: int) -> torch.Tensor:
    """TQ1_0 bytes [nb, 1, L] -> trits [nb, count, L] uint8: trit n of a byte is ((byte · 3ⁿ mod 256) · 3) >> 8
    (ggml packs a byte's trits as a base-3 fraction of 256, most significant first)."""
    top = q * _const(_POW3[:count], torch.uint8, q.device, (count, 1))  # uint8: wraps mod 256
    return (top.to(torch.int16) * 3).bitwise_right_shift_(8).to(torch.uint8)


def _dq_tq1_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # TQ1_0 block (54 B): qs 48 B (5 trits a byte), qh 4 B (4 trits a byte), d f16 (at 52). Elements 32n + j: trit
    # n of qs[j] (j < 32); 160 + 16n + j: trit n of qs[32 + j]; 240 + 4n + j: trit n of qh[j].   x = d * (q - 1)
    nb = b.shape[0]
    codes = torch.cat([_trits(b[:, None, :32], 5).view(nb, -1), _trits(b[:, None, 32:48], 5).view(nb, -1),
                       _trits(b[:, None, 48:52], 4).view(nb, -1)], dim=1)
    _scale(out, _signed(codes, 1).view(nb, 1, 1, -1), _f16(b, 52))


_DEQUANTIZERS: dict[T, Callable[[torch.Tensor, torch.Tensor], None]] = {
    T.F32: _dq_float(torch.float32),
    T.F16: _dq_float(torch.float16),
    T.BF16: _dq_float(torch.bfloat16),
    T.Q8_0: _dq_q8_0,
    T.Q4_0: _dq_q4_0,
    T.Q4_1: _dq_q4_1,
    T.Q5_0: _dq_q5_0,
    T.Q5_1: _dq_q5_1,
    T.Q4_K: _dq_q4_k,
    T.Q5_K: _dq_q5_k,
    T.Q6_K: _dq_q6_k,
    T.TQ1_0: _dq_tq1_0,
    T.TQ2_0: _dq_tq2_0,
}

TERNARY_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset({T.TQ1_0, T.TQ2_0})
_TERNARY_SCALE_AT = {T.TQ1_0: 52, T.TQ2_0: 64}  # byte offset of the float16 d in a block


def check_scales(raw: torch.Tensor, qtype: gguf.GGMLQuantizationType | int, where: str, file_offset: int) -> None:
    """A ModelFormatError naming `where` (file and tensor) and the block's file offset if a block of a ternary tensor
    has an inf or NaN scale d; nothing for other types. raw: the tensor's encoded bytes, 1-D uint8, on any device,
    starting at `file_offset` in its file.

    Ternary blocks are d · {-1, 0, +1}: a non-finite d would spread through every product it meets, so a model's
    ternary tensors are checked once, when their bytes are first in memory (and before a store is written)."""
    qt = _qtype(qtype)
    if qt not in TERNARY_TYPES or raw.numel() == 0:
        return
    type_size = gguf.GGML_QUANT_SIZES[qt][1]
    at = _TERNARY_SCALE_AT[qt]
    d = raw.view(-1, type_size)[:, at : at + 2].contiguous().view(torch.float16)[:, 0]
    bad = (~torch.isfinite(d)).nonzero()
    if bad.numel():
        block = int(bad[0, 0])
        raise ModelFormatError(f"{where}: block {block} (file offset {file_offset + block * type_size}) has a "
                               f"non-finite scale ({float(d[block])})")

SUPPORTED_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset(_DEQUANTIZERS)

# CPU: elements per chunk, so that a chunk of `out` (8 MiB) stays in the L3 cache across the convert/scale passes
# (measured: smaller chunks lose to per-op overhead, larger ones to memory traffic).
_CPU_CHUNK_ELEMENTS = 1 << 21


# ----------------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------------


def _qtype(qtype: gguf.GGMLQuantizationType | int) -> gguf.GGMLQuantizationType:
    try:
        return T(int(qtype))
    except ValueError:
        raise UnsupportedModelError(f"tensor type {int(qtype)} is not a known ggml type") from None


def _supported(qtype: gguf.GGMLQuantizationType | int) -> gguf.GGMLQuantizationType:
    qt = _qtype(qtype)
    if qt not in _DEQUANTIZERS:
        names = ", ".join(t.name for t in _DEQUANTIZERS)
        raise UnsupportedModelError(f"tensor type {qt.name} is not supported (supported: {names})")
    return qt


def encoded_nbytes(qtype: gguf.GGMLQuantizationType | int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` (PyTorch order) encoded as `qtype`.

    ValueError if the last dimension is not a multiple of the type's block size (or the shape is malformed).
    """
    qt = _qtype(qtype)
    block, type_size = gguf.GGML_QUANT_SIZES[qt]
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 0 for s in shape):
        raise ValueError(f"bad tensor shape {shape} for {qt.name}")
    if shape[-1] % block:
        raise ValueError(f"{qt.name} tensor of shape {shape}: last dimension {shape[-1]} is not a multiple "
                         f"of the block size {block}")
    return math.prod(shape) // block * type_size


def dequantize(raw: torch.Tensor, qtype: gguf.GGMLQuantizationType | int, shape: tuple[int, ...], *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a GGUF tensor: raw 1-D uint8 bytes (CPU or CUDA) -> float32 tensor of `shape` on raw's device.

    With `out` (float32, `shape`, raw's device) the result is written into it and `out` is returned.
    Unsupported type -> UnsupportedModelError; wrong byte count -> ValueError.
    """
    qt = _supported(qtype)
    shape = tuple(int(s) for s in shape)
    expected = encoded_nbytes(qt, shape)
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.dim() != 1:
        what = f"{raw.dtype} tensor of shape {tuple(raw.shape)}" if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise ValueError(f"{qt.name} tensor {shape}: raw data must be a 1-D uint8 tensor, got {what}")
    if raw.numel() != expected:
        raise ValueError(f"{qt.name} tensor {shape}: expected {expected} bytes of encoded data, got {raw.numel()}")
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=raw.device)
    elif out.dtype != torch.float32 or tuple(out.shape) != shape or out.device != raw.device:
        raise ValueError(f"{qt.name} tensor {shape}: out must be float32 of that shape on {raw.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if expected == 0:
        return out
    # Column views of the block table need a 4-byte aligned start (ggml data always is; a slice might not be).
    if not raw.is_contiguous() or raw.storage_offset() % 4:
        raw = raw.clone()
    target = out if out.is_contiguous() else torch.empty(shape, dtype=torch.float32, device=raw.device)

    block, type_size = gguf.GGML_QUANT_SIZES[qt]
    nb = expected // type_size
    blocks = raw.view(nb, type_size)
    flat = target.view(nb, block)
    fn = _DEQUANTIZERS[qt]
    chunk = nb if raw.device.type != "cpu" else max(1, _CPU_CHUNK_ELEMENTS // block)
    for start in range(0, nb, chunk):
        fn(blocks[start : start + chunk], flat[start : start + chunk])
    if target is not out:
        out.copy_(target)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Random well-formed blocks for synthetic models
# ----------------------------------------------------------------------------------------------------------------

_WEIGHT_STD = 0.02


def _put_f16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset : offset + 2] = values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _jitter(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.uniform(0.5, 1.5, n).astype(np.float32)


def _rand_legacy(d_at: int, m_at: int | None, code_std: float, code_mean: float):
    """Q8_0 / Q4_x / Q5_x: random codes; d ~ std / code_std; m (if any) centres the codes around 0."""

    def fill(blocks: np.ndarray, rng: np.random.Generator) -> None:
        d = _jitter(rng, blocks.shape[0]) * np.float32(_WEIGHT_STD / code_std)
        _put_f16(blocks, d_at, d)
        if m_at is not None:
            _put_f16(blocks, m_at, -code_mean * d)

    return fill


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(sc, m) uint8 [nb, 8] 6-bit values -> the 12-byte Q4_K/Q5_K scales field (inverse of `_k_scale_min`)."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _rand_k(code_std: float, code_mean: float):
    """Q4_K / Q5_K: 6-bit scales and mins in 32..63; dmin chosen so each sub-block is roughly centred at 0."""

    def fill(blocks: np.ndarray, rng: np.random.Generator) -> None:
        nb = blocks.shape[0]
        sc = rng.integers(32, 64, (nb, 8), dtype=np.uint8)
        mn = rng.integers(32, 64, (nb, 8), dtype=np.uint8)
        d = _jitter(rng, nb) * np.float32(_WEIGHT_STD / (code_std * 47.5))
        _put_f16(blocks, 0, d)
        _put_f16(blocks, 2, d * np.float32(code_mean))
        blocks[:, 4:16] = _pack_k_scales(sc, mn)

    return fill


def _rand_q6_k(blocks: np.ndarray, rng: np.random.Generator) -> None:
    # int8 sub-block scales of either sign, |scale| in 4..15; codes q - 32 have std ~18.5
    nb = blocks.shape[0]
    scales = rng.integers(4, 16, (nb, 16), dtype=np.int8) * rng.choice(np.array([-1, 1], np.int8), (nb, 16))
    blocks[:, 192:208] = scales.view(np.uint8)
    _put_f16(blocks, 208, _jitter(rng, nb) * np.float32(_WEIGHT_STD / (18.5 * 9.5)))


def _rand_tq2_0(blocks: np.ndarray, rng: np.random.Generator) -> None:
    # codes 0..2 in every 2-bit field (no stray 3s); ternary codes have std sqrt(2/3)
    trits = rng.integers(0, 3, (blocks.shape[0], 64, 4), dtype=np.uint8)
    blocks[:, :64] = trits[..., 0] | trits[..., 1] << 2 | trits[..., 2] << 4 | trits[..., 3] << 6
    _put_f16(blocks, 64, _jitter(rng, blocks.shape[0]) * np.float32(_WEIGHT_STD / 0.816))


def _rand_tq1_0(blocks: np.ndarray, rng: np.random.Generator) -> None:
    # valid packings, as ggml writes them: 5 trits (value v < 243) as ceil(v · 256 / 243); qh's 4 trits as a 5-trit
    # value whose last trit is 0
    nb = blocks.shape[0]
    values = rng.integers(0, 243, (nb, 52), dtype=np.uint16)
    values[:, 48:] = values[:, 48:] // 3 * 3
    blocks[:, :52] = ((values * 256 + 242) // 243).astype(np.uint8)
    _put_f16(blocks, 52, _jitter(rng, nb) * np.float32(_WEIGHT_STD / 0.816))


_RANDOM_FILL = {
    T.Q8_0: _rand_legacy(0, None, 73.9, 0.0),
    T.Q4_0: _rand_legacy(0, None, 4.61, 0.0),
    T.Q4_1: _rand_legacy(0, 2, 4.61, 7.5),
    T.Q5_0: _rand_legacy(0, None, 9.23, 0.0),
    T.Q5_1: _rand_legacy(0, 2, 9.23, 15.5),
    T.Q4_K: _rand_k(4.61, 7.5),
    T.Q5_K: _rand_k(9.23, 15.5),
    T.Q6_K: _rand_q6_k,
    T.TQ1_0: _rand_tq1_0,
    T.TQ2_0: _rand_tq2_0,
}


def bf16_bytes(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).view(np.uint8)  # round to nearest even


def random_quantized(qtype: gguf.GGMLQuantizationType | int, shape: tuple[int, ...],
                     rng: np.random.Generator) -> np.ndarray:
    """Random well-formed encoded data for a tensor of `shape`: uint8 array of byte shape (*shape[:-1], row bytes).

    Dequantized, the weights look like a real model's (mean ~0, std ~0.02, all finite). `.reshape(-1)` gives the
    raw bytes `dequantize` takes. Vectorized: a 28672x8192 matrix takes seconds.
    """
    qt = _supported(qtype)
    shape = tuple(int(s) for s in shape)
    nbytes = encoded_nbytes(qt, shape)
    block, type_size = gguf.GGML_QUANT_SIZES[qt]
    byte_shape = (*shape[:-1], shape[-1] // block * type_size)
    if qt in (T.F32, T.F16, T.BF16):
        x = rng.standard_normal(math.prod(shape), dtype=np.float32)
        x *= np.float32(_WEIGHT_STD)
        raw = {T.F32: lambda: x.view(np.uint8), T.F16: lambda: x.astype(np.float16).view(np.uint8),
               T.BF16: lambda: bf16_bytes(x)}[qt]()
        return raw.reshape(byte_shape)
    blocks = rng.integers(0, 256, nbytes, dtype=np.uint8).reshape(-1, type_size)
    _RANDOM_FILL[qt](blocks, rng)
    return blocks.reshape(byte_shape)
