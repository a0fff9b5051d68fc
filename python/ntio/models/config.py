"""Model hyper-parameters read from GGUF metadata (a checkpoint's config.json offers them under GGUF's keys).

`ModelConfig` is computed once per file; derived fields (head_dim, q/kv widths) are properties so nothing is stored
twice. Which architectures are supported is the family registry's word (`ntio.models.registry`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

from ntio.errors import ModelFormatError, UnsupportedModelError
from ntio.formats.checkpoint import ROPE_KIND_KEY
from ntio.formats.gguf_file import GGUFFile
from ntio.formats.store import layer_of
from ntio.models.family import Family
from ntio.models.registry import FAMILIES

# Larger layer counts, widths, head counts or contexts are corruption, not ambition: the largest public models are
# orders of magnitude below (Llama 3.1 405B: 126 layers, width 16384, 128 heads, 131072 positions), and products of
# two such values must stay far from int64 and from any allocation a machine could make.
_LARGEST = 2**31


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (per-frequency divisors: a GGUF's `rope_freqs.weight`, or `divisors` computed
    from a checkpoint's parameters) or linear scaling."""

    kind: str  # "none" | "linear" | "llama3"
    factor: float = 1.0
    divisors: tuple[float, ...] | None = None  # llama3 without a rope_freqs tensor: one per rotated pair


def llama3_divisors(theta: float, rope_dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_context: int) -> tuple[float, ...]:
    """Llama 3's RoPE frequency divisors (transformers' `_compute_llama3_parameters`, llama.cpp's converter): long
    wavelengths are divided by `factor`, short ones kept, those between blended smoothly."""
    low_wavelen, high_wavelen = original_context / low_freq_factor, original_context / high_freq_factor
    divisors = []
    for i in range(0, rope_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / rope_dim)
        if wavelen < high_wavelen:
            divisors.append(1.0)
        elif wavelen > low_wavelen:
            divisors.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(divisors)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rope_dim: int
    rms_eps: float
    rope_scaling: RopeScaling
    tied_embeddings: bool
    ffn_gate: str = "silu"  # the FFN's gate activation (a key of ntio.kernels.ops.GATES)
    rope_kind: str | None = None  # the file's RoPE pairing where it is not its family's (a Llama checkpoint: "neox")

    @property
    def family(self) -> Family:
        return _family(self.architecture, self.rope_kind)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> ModelConfig:
        """The hyper-parameters of `g`, each checked (type, range, consistency with the others and with the token
        embedding); a bad one is a one-line ModelFormatError naming file and key. The shapes of the block and global
        tensors are checked against the result by `ntio.models.weights.WeightLayout`."""
        arch = g.architecture
        if arch not in FAMILIES:
            raise UnsupportedModelError(
                f"{g.path}: architecture {arch!r} is not supported (supported: {', '.join(FAMILIES)})"
            )

        def key(name: str) -> str:
            return f"{arch}.{name}"

        n_layers = _count(g, key("block_count"))
        d_model = _count(g, key("embedding_length"))
        n_heads = _count(g, key("attention.head_count"))
        n_kv_heads = _count(g, key("attention.head_count_kv"), default=n_heads)
        if d_model % n_heads or n_heads % n_kv_heads:
            raise ModelFormatError(
                f"{g.path}: metadata keys {key('embedding_length')!r} ({d_model}), {key('attention.head_count')!r} "
                f"({n_heads}) and {key('attention.head_count_kv')!r} ({n_kv_heads}) do not divide evenly"
            )
        head_dim = d_model // n_heads
        rope_dim = _count(g, key("rope.dimension_count"), default=head_dim)
        if rope_dim % 2 or rope_dim > head_dim:
            raise ModelFormatError(
                f"{g.path}: metadata key {key('rope.dimension_count')!r} must be even and at most the head "
                f"dimension {head_dim}, got {rope_dim}"
            )
        embd = g.tensor("token_embd.weight")
        vocab_size = _count(g, key("vocab_size"), default=embd.shape[0])
        if vocab_size != embd.shape[0]:
            raise ModelFormatError(
                f"{g.path}: metadata key {key('vocab_size')!r} is {vocab_size}, but tensor 'token_embd.weight' has "
                f"{embd.shape[0]} rows"
            )
        scaling_type = str(g.metadata.get(key("rope.scaling.type"), "none"))
        if "rope_freqs.weight" in g.tensors:
            scaling = RopeScaling("llama3")
        elif scaling_type == "linear":
            scaling = RopeScaling("linear", _positive(g, key("rope.scaling.factor")))
        elif scaling_type == "llama3":
            low, high = _positive(g, key("rope.scaling.low_freq_factor")), _positive(g, key("rope.scaling.high_freq_factor"))
            if high <= low:
                raise ModelFormatError(f"{g.path}: metadata key {key('rope.scaling.high_freq_factor')!r} ({high}) must "
                                       f"exceed {key('rope.scaling.low_freq_factor')!r} ({low})")
            scaling = RopeScaling("llama3", divisors=llama3_divisors(
                _positive(g, key("rope.freq_base"), default=10000.0), rope_dim, _positive(g, key("rope.scaling.factor")),
                low, high, _count(g, key("rope.scaling.original_context_length"))))
        elif scaling_type in ("none", ""):
            scaling = RopeScaling("none")
        else:
            raise UnsupportedModelError(f"{g.path}: rope scaling {scaling_type!r} is not supported")
        _check_layers(g, n_layers, key("block_count"))
        gates = FAMILIES[arch].gates
        ffn_gate = str(g.metadata.get(key("hidden_activation"), gates[0])) if len(gates) > 1 else gates[0]
        if ffn_gate not in gates:
            raise UnsupportedModelError(f"{g.path}: metadata key {key('hidden_activation')!r} is {ffn_gate[:40]!r}; "
                                        f"ntio runs {arch} models with {' or '.join(gates)}")
        return cls(
            architecture=arch,
            n_layers=n_layers,
            d_model=d_model,
            d_ff=_count(g, key("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            vocab_size=vocab_size,
            context_length=_count(g, key("context_length")),
            rope_theta=_positive(g, key("rope.freq_base"), default=10000.0),
            rope_dim=rope_dim,
            rms_eps=_positive(g, key("attention.layer_norm_rms_epsilon")),
            rope_scaling=scaling,
            tied_embeddings="output.weight" not in g.tensors,
            ffn_gate=ffn_gate,
            rope_kind=_rope_kind(g),
        )


@functools.cache
def _family(architecture: str, rope_kind: str | None) -> Family:
    family = FAMILIES[architecture]
    return family if rope_kind in (None, family.rope) else dataclasses.replace(family, rope=rope_kind)


def _rope_kind(g: GGUFFile) -> str | None:
    kind = g.metadata.get(ROPE_KIND_KEY)
    if kind is not None and kind not in ("interleaved", "neox"):
        raise ModelFormatError(f"{g.path}: metadata key {ROPE_KIND_KEY!r} must be 'interleaved' or 'neox', "
                               f"got {str(kind)[:40]!r}")
    return kind


def _value(g: GGUFFile, key: str, default: Any) -> Any:
    """The value of `key`, which is required where there is no default."""
    return g.require(key) if default is None else g.metadata.get(key, default)


def _shown(value: Any) -> str:
    """A metadata value for a one-line message: its type where that is the problem, never a whole array."""
    if isinstance(value, bool):
        return f"the bool {value}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}" + ("..." if len(value) > 40 else "")
    if isinstance(value, list):
        return f"an array of {len(value)} values"
    return repr(value)


def _count(g: GGUFFile, key: str, default: int | None = None) -> int:
    """A positive integer hyper-parameter (a bool is not one), at most _LARGEST."""
    value = _value(g, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelFormatError(f"{g.path}: metadata key {key!r} must be a positive integer, got {_shown(value)}")
    if value > _LARGEST:
        raise ModelFormatError(f"{g.path}: metadata key {key!r} must be at most {_LARGEST}, got {value}")
    return value


def _positive(g: GGUFFile, key: str, default: float | None = None) -> float:
    """A positive finite number hyper-parameter (an integer is accepted, a bool is not)."""
    value = _value(g, key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value and math.isfinite(value)):
        raise ModelFormatError(f"{g.path}: metadata key {key!r} must be a positive finite number, got {_shown(value)}")
    return float(value)


def _check_layers(g: GGUFFile, n_layers: int, key: str) -> None:
    """Every block tensor belongs to a layer below the layer count: the extent index sizes its layer table by the
    highest block number it sees, and a block the config does not run is a file that disagrees with itself."""
    for name in g.tensors:
        layer = layer_of(name)
        if layer is not None and layer >= n_layers:
            raise ModelFormatError(
                f"{g.path}: tensor {name!r} belongs to block {layer}, but metadata key {key!r} is {n_layers}"
            )
