"""Random-weight Llama-shaped GGUF files, for tests of types a real small model lacks and for I/O/scale benchmarks.

Ternary matrix types (TQ1_0/TQ2_0) make a BitNet file (`bitnet`: the Llama block plus its two sub-norms, the head
tied to a Q4_K token embedding, as llama.cpp's quantizer types a ternary model's embedding), since ternary weights
are what BitNet models are trained for; every other type makes a `llama` file.

Never for quality claims: the weights are noise. Files are written tensor by tensor (memory stays at one tensor,
so a 70B-shaped layer stack can be written on a small machine), to a temporary name renamed at the end.
The tokenizer is a minimal byte-level BPE (256 byte symbols, a few merges) plus BOS/EOS, padded to vocab_size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np

from ntio.errors import NtioError
from ntio.kernels import quant
from ntio.models.bitnet import BITNET
from ntio.models.family import Family
from ntio.models.llama import LLAMA

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class SynthSpec:
    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int = 512
    context_length: int = 2048
    rope_theta: float = 10000.0
    # Type of each block tensor by GGUF part name (attn_q, ffn_down, ...); parts not listed use `matrix_type`.
    matrix_type: gguf.GGMLQuantizationType = Q.Q4_K
    part_types: dict[str, gguf.GGMLQuantizationType] = field(default_factory=dict)
    embd_type: gguf.GGMLQuantizationType = Q.Q8_0
    output_type: gguf.GGMLQuantizationType | None = None  # None: tied to the token embedding
    # Llama-3 rope scaling as llama.cpp stores it: one divisor per rotary frequency (`rope_freqs.weight`).
    rope_factors: tuple[float, ...] | None = None
    seed: int = 0


# Shapes of public models (layer count can be cut with --layers for benchmarks).
PRESETS: dict[str, SynthSpec] = {
    "tiny": SynthSpec(n_layers=2, d_model=256, d_ff=512, n_heads=4, n_kv_heads=2),
    "1b": SynthSpec(n_layers=16, d_model=2048, d_ff=8192, n_heads=32, n_kv_heads=8, vocab_size=128256,
                    context_length=8192, rope_theta=500000.0, output_type=None),
    "8b": SynthSpec(n_layers=32, d_model=4096, d_ff=14336, n_heads=32, n_kv_heads=8, vocab_size=128256,
                    context_length=8192, rope_theta=500000.0, output_type=Q.Q6_K),
    "70b": SynthSpec(n_layers=80, d_model=8192, d_ff=28672, n_heads=64, n_kv_heads=8, vocab_size=128256,
                     context_length=8192, rope_theta=500000.0, output_type=Q.Q6_K),
}


def preset(name: str, **overrides) -> SynthSpec:
    """The preset `name` with `overrides`; a ternary matrix type (BitNet) ties the head to a Q4_K embedding."""
    spec = replace(PRESETS[name], **overrides)
    if spec.matrix_type in quant.TERNARY_TYPES and "output_type" not in overrides:
        spec = replace(spec, output_type=None, embd_type=overrides.get("embd_type", Q.Q4_K))
    return spec


def _family(spec: SynthSpec) -> Family:
    return BITNET if spec.matrix_type in quant.TERNARY_TYPES else LLAMA


def _tensor_table(spec: SynthSpec) -> list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType]]:
    """(name, PyTorch-order shape, type) of every tensor, in file order: globals, then each block contiguously."""
    D, F, V = spec.d_model, spec.d_ff, spec.vocab_size
    hd = D // spec.n_heads
    Qw, KV = spec.n_heads * hd, spec.n_kv_heads * hd
    shapes = {
        "attn_norm": (D,), "attn_q": (Qw, D), "attn_k": (KV, D), "attn_v": (KV, D), "attn_output": (D, Qw),
        "ffn_norm": (D,), "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F),
        "attn_sub_norm": (Qw,), "ffn_sub_norm": (F,),
    }
    table = [("token_embd.weight", (V, D), spec.embd_type), ("output_norm.weight", (D,), Q.F32)]
    if spec.rope_factors is not None:
        table.append(("rope_freqs.weight", (len(spec.rope_factors),), Q.F32))
    if spec.output_type is not None:
        table.append(("output.weight", (V, D), spec.output_type))
    family = _family(spec)
    if family is BITNET and spec.output_type is not None:
        raise ValueError("a BitNet file's head is its token embedding (llama.cpp reads no output.weight for it)")
    for layer in range(spec.n_layers):
        for t in (t for t in family.tensors if not t.optional):
            qtype = spec.part_types.get(t.part, spec.matrix_type) if t.matrix else Q.F32
            table.append((t.name(layer), shapes[t.part], qtype))
    return table


# A few merges so the file carries a real (non-empty) merge list; "Ġ" is the byte-level symbol for a space.
_MERGES = ["Ġ t", "h e", "i n", "Ġ a", "e r"]


@dataclass(frozen=True)
class _Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int


def _byte_level_vocab(vocab_size: int) -> _Vocab:
    """GPT-2 byte-to-unicode symbols for the 256 bytes, a few merged tokens, BOS/EOS, then unused padding."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    tokens = [symbols[b] for b in range(256)] + [m.replace(" ", "") for m in _MERGES]
    bos_id = len(tokens)
    tokens += ["<|bos|>", "<|eos|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size must be at least {len(tokens)}")
    tokens += [f"<|unused_{i}|>" for i in range(vocab_size - len(tokens))]
    types += [5] * (vocab_size - len(types))
    return _Vocab(tokens, types, list(_MERGES), bos_id, bos_id + 1)


def write_hyperparameters(w: gguf.GGUFWriter, spec: SynthSpec) -> None:
    """The shape keys of `spec` (layers, widths, heads, context, RoPE base, RMSNorm epsilon 1e-5, vocabulary)."""
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.d_model)
    w.add_feed_forward_length(spec.d_ff)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_rope_dimension_count(spec.d_model // spec.n_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(spec.vocab_size)


def write_synthetic_gguf(path: str | os.PathLike[str], spec: SynthSpec) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rng = np.random.default_rng(spec.seed)
    table = _tensor_table(spec)
    w = gguf.GGUFWriter(tmp, _family(spec).name)
    try:
        w.add_name("ntio synthetic (random weights)")
        write_hyperparameters(w, spec)
        vocab = _byte_level_vocab(spec.vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(vocab.tokens)
        w.add_token_types(vocab.types)
        w.add_token_merges(vocab.merges)
        w.add_bos_token_id(vocab.bos_id)
        w.add_eos_token_id(vocab.eos_id)
        w.add_add_bos_token(False)
        for name, shape, qtype in table:
            nbytes = quant.encoded_nbytes(qtype, shape)
            # GGUFWriter takes the byte shape of quantized data: [rows, bytes per row].
            w.add_tensor_info(name, (*shape[:-1], nbytes // max(1, int(np.prod(shape[:-1])))), np.dtype(np.uint8),
                              nbytes, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, shape, qtype in table:
            if name == "rope_freqs.weight":
                data = np.asarray(spec.rope_factors, dtype=np.float32).view(np.uint8)
            elif name.endswith("norm.weight"):
                data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32).view(np.uint8)
            else:
                data = quant.random_quantized(qtype, shape, rng)
            w.write_tensor_data(data.reshape(-1))
        w.close()
        os.replace(tmp, path)
    except OSError as e:
        raise NtioError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        w.close()
        tmp.unlink(missing_ok=True)
    return path
