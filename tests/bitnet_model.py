"""A small BitNet b1.58 model for the differential tests, and the same model as a GGUF (the tests' converter).

transformers' BitNetForCausalLM in float32 (no quantization config: its projections are plain nn.Linear layers)
with random weights, its projections ternarised as BitNet trains them: W = s · clamp(round(W / s), -1, 1) with
s = mean|W| per tensor, rounded to a float16 value. `write_gguf` writes it as llama.cpp's `bitnet` architecture: q/k
rows as transformers holds them (NeoX RoPE), the two sub-norms, the head tied to an F16 token embedding, matrices in
TQ1_0 or TQ2_0 (gguf-py's quantizer: each block's d is max|W| = s exactly, its codes W / s), or with `scales_apart`
codes whose d is 1 beside `blk.N.*.scale` tensors holding s. The vocabulary, tokenizer and chat template are
SmolLM2's, so real text tokenizes as it would for a real model.
"""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
import torch

from ntio.formats.gguf_metadata import copy_metadata
from ntio.synth import SynthSpec, write_hyperparameters

# HF name in a layer -> GGUF part (ternarised projections first, then the norms).
PROJECTIONS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
NORMS = {
    "input_layernorm": "attn_norm", "self_attn.attn_sub_norm": "attn_sub_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.ffn_sub_norm": "ffn_sub_norm",
}


@torch.no_grad()
def ternarised_model(vocab_size: int, *, gate: str = "relu2", layers: int = 2, hidden: int = 256, heads: int = 4,
                     kv_heads: int = 2, intermediate: int = 512, seed: int = 0):
    """A float32 BitNetForCausalLM with ternarised projections, random norm weights around 1 and an embedding whose
    values are float16 numbers (what the GGUF stores)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.BitNetConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_act=gate, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
        initializer_range=0.05, bos_token_id=None, eos_token_id=None,
    )
    model = transformers.BitNetForCausalLM(config).float().eval()
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif any(f"{hf}.weight" in name for hf in PROJECTIONS):
            s = p.abs().mean().half().float()
            p.copy_(s * (p / s).round().clamp(-1, 1))
    emb = model.model.embed_tokens.weight
    emb.copy_(emb.half().float())
    return model


@functools.cache
def _reader(path: Path) -> gguf.GGUFReader:
    """One parse per file (SmolLM2's 49k-token vocabulary takes seconds)."""
    return gguf.GGUFReader(path)


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).contiguous().numpy()


def write_gguf(model, path: Path, qtype: gguf.GGMLQuantizationType, tokenizer_from: Path, *,
               scales_apart: bool = False) -> Path:
    """`model` (from `ternarised_model`) as a `bitnet` GGUF at `path`, its matrices in `qtype`, its tokenizer
    metadata copied from the GGUF `tokenizer_from` (whose vocabulary must be the model's size)."""
    cfg = model.config
    assert cfg.rms_norm_eps == 1e-5  # write_hyperparameters' epsilon
    w = gguf.GGUFWriter(path, "bitnet")
    w.add_name("ntio test BitNet b1.58 (random ternary weights)")
    write_hyperparameters(w, SynthSpec(
        n_layers=cfg.num_hidden_layers, d_model=cfg.hidden_size, d_ff=cfg.intermediate_size,
        n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads, vocab_size=cfg.vocab_size,
        context_length=cfg.max_position_embeddings, rope_theta=cfg.rope_parameters["rope_theta"]))
    if cfg.hidden_act != "silu":  # llama.cpp's default
        w.add_string("bitnet.hidden_activation", cfg.hidden_act)
    copy_metadata(_reader(tokenizer_from), w, keep=lambda key: key.startswith("tokenizer."))
    w.add_tensor("token_embd.weight", model.model.embed_tokens.weight.detach().half().numpy())
    w.add_tensor("output_norm.weight", _f32(model.model.norm.weight))
    for i, layer in enumerate(model.model.layers):
        modules = dict(layer.named_modules())
        for hf, part in NORMS.items():
            w.add_tensor(f"blk.{i}.{part}.weight", _f32(modules[hf].weight))
        for hf, part in PROJECTIONS.items():
            weight = _f32(modules[hf].weight)
            if scales_apart:
                s = np.abs(weight).max()
                w.add_tensor(f"blk.{i}.{part}.scale", np.array([s], np.float32))
                weight = weight / s  # the codes: exact (s is the only magnitude)
            w.add_tensor(f"blk.{i}.{part}.weight", gguf.quants.quantize(weight, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
