"""Model hyper-parameters read from GGUF metadata.

`ModelConfig` is computed once per file; derived fields (head_dim, q/kv widths) are properties so nothing is stored
twice. Which architectures are supported is the family registry's word (`ntio.models.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ntio.errors import ModelFormatError, UnsupportedModelError
from ntio.formats.gguf_file import GGUFFile
from ntio.models.family import Family
from ntio.models.registry import FAMILIES


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_freqs.weight` holds the per-frequency divisors) or linear scaling."""

    kind: str  # "none" | "linear" | "llama3"
    factor: float = 1.0


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

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

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
        arch = g.architecture
        if arch not in FAMILIES:
            raise UnsupportedModelError(
                f"{g.path}: architecture {arch!r} is not supported (supported: {', '.join(FAMILIES)})"
            )

        def key(name: str) -> str:
            return f"{arch}.{name}"

        n_heads = int(g.require(key("attention.head_count")))
        d_model = int(g.require(key("embedding_length")))
        n_kv_heads = int(g.metadata.get(key("attention.head_count_kv"), n_heads))
        if d_model % n_heads or n_heads % n_kv_heads:
            raise ModelFormatError(
                f"{g.path}: {d_model} embedding width, {n_heads} heads and {n_kv_heads} KV heads do not divide evenly"
            )
        embd = g.tensor("token_embd.weight")
        scaling_type = str(g.metadata.get(key("rope.scaling.type"), "none"))
        if "rope_freqs.weight" in g.tensors:
            scaling = RopeScaling("llama3")
        elif scaling_type == "linear":
            scaling = RopeScaling("linear", float(g.require(key("rope.scaling.factor"))))
        elif scaling_type in ("none", ""):
            scaling = RopeScaling("none")
        else:
            raise UnsupportedModelError(f"{g.path}: rope scaling {scaling_type!r} is not supported")
        return cls(
            architecture=arch,
            n_layers=int(g.require(key("block_count"))),
            d_model=d_model,
            d_ff=int(g.require(key("feed_forward_length"))),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            vocab_size=int(g.metadata.get(key("vocab_size"), embd.shape[0])),
            context_length=int(g.require(key("context_length"))),
            rope_theta=float(g.metadata.get(key("rope.freq_base"), 10000.0)),
            rope_dim=int(g.metadata.get(key("rope.dimension_count"), d_model // n_heads)),
            rms_eps=float(g.require(key("attention.layer_norm_rms_epsilon"))),
            rope_scaling=scaling,
            tied_embeddings="output.weight" not in g.tensors,
        )
