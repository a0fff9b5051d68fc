"""ntio against Hugging Face transformers loading the same GGUF on CPU in float32 (the independent oracle).

Covers the real default model (SmolLM2-135M-Instruct Q4_1) and a synthetic model with the tensor types, an
untied output head and GQA ratios SmolLM2 lacks. These run the float32-activation kernels (`cpu_activations=
"float32"`), where the model graph must match transformers to 1e-4; the default 8-bit activations are priced
against the same oracle in test_int8_activations.py.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

import ntio
from references import hf_greedy, hf_model, hf_perplexity, rel_l2
from ntio.synth import SynthSpec, write_synthetic_gguf

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first humans landed on",
]
PPL_TEXT = Path(__file__).parent / "data" / "apache-2.0.txt"


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return ntio.load(smollm2_path, max_context=1024, cpu_activations="float32")


@torch.inference_mode()
def test_last_position_logits_match_transformers(smollm2, hf_smollm2):
    for prompt in PROMPTS:
        ids = smollm2.encode_prompt(prompt)
        ours = smollm2.engine.forward(torch.tensor(ids), 0)
        ref = hf_smollm2(torch.tensor([ids])).logits[0, -1]
        assert rel_l2(ours, ref) <= 1e-4, prompt


@torch.inference_mode()
def test_all_position_logits_match_in_chunks(smollm2, hf_smollm2):
    """Prefill split into chunks at explicit positions (T > 1 on a warm cache) equals one full pass."""
    ids = smollm2.encode_prompt(PROMPTS[2] + " " + PROMPTS[3])
    ref = hf_smollm2(torch.tensor([ids])).logits[0]
    a = smollm2.engine.forward(torch.tensor(ids[:5]), 0, all_logits=True)
    b = smollm2.engine.forward(torch.tensor(ids[5:9]), 5, all_logits=True)
    c = smollm2.engine.forward(torch.tensor(ids[9:]), 9, all_logits=True)
    assert rel_l2(torch.cat((a, b, c)), ref) <= 1e-4


@torch.inference_mode()
def test_kv_crop_then_recompute_matches(smollm2, hf_smollm2):
    ids = smollm2.encode_prompt(PROMPTS[0])
    smollm2.engine.forward(torch.tensor(ids + [42, 43, 44]), 0)
    smollm2.engine.kv.crop(len(ids) - 1)
    ours = smollm2.engine.forward(torch.tensor(ids[-1:]), len(ids) - 1)
    ref = hf_smollm2(torch.tensor([ids])).logits[0, -1]
    assert rel_l2(ours, ref) <= 1e-4


@torch.inference_mode()
def test_greedy_64_tokens_identical(smollm2, hf_smollm2):
    for prompt in (PROMPTS[0], PROMPTS[2]):
        ids = smollm2.encode_prompt(prompt)
        ours = smollm2.generate(ids, max_new_tokens=64, temperature=0.0)
        want, compared = hf_greedy(hf_smollm2, ids, ours.token_ids, 1e-3)
        # The comparison is only meaningful without near-ties along the trajectory.
        assert compared == len(ours.token_ids), f"{prompt!r} has a near-tie; pick another prompt"
        assert ours.token_ids == want
        assert len(ours.token_ids) == 64 or ours.finish_reason == "stop"


def test_perplexity_within_half_percent(smollm2, hf_smollm2):
    text = PPL_TEXT.read_text()[:6000]  # ~1,300 tokens: two full windows and part of a third
    ctx = 512
    ours = smollm2.perplexity(text, ctx=ctx)
    # Same convention with the reference: one tokenization, no special tokens, non-overlapping windows, every
    # token of a window scored but its first. The reference scores ntio's token ids: transformers' GGUF tokenizer
    # ignores the `smollm` pre-tokenizer (digits split first, as in SmolLM2's tokenizer.json and llama.cpp), so
    # on this text it tokenizes runs of spaces before digits differently; tokenization has its own tests.
    ref, count = hf_perplexity(hf_smollm2, smollm2.tokenizer.encode(text), ctx)
    assert ours.n_tokens == count
    assert abs(ours.perplexity - ref) / ref <= 0.005


def test_chat_answers_paris(smollm2):
    reply = smollm2.generate("What is the capital of France?", chat=True, max_new_tokens=32)
    assert "Paris" in reply.text


SYNTH_TYPES = {
    "attn_q": gguf.GGMLQuantizationType.Q4_K,
    "attn_k": gguf.GGMLQuantizationType.Q5_K,
    "attn_v": gguf.GGMLQuantizationType.Q6_K,
    "attn_output": gguf.GGMLQuantizationType.Q5_0,
    "ffn_gate": gguf.GGMLQuantizationType.Q4_0,
    "ffn_up": gguf.GGMLQuantizationType.Q5_1,
    "ffn_down": gguf.GGMLQuantizationType.Q8_0,
}


@pytest.mark.parametrize(
    "name,spec",
    [
        ("mixed-quant", SynthSpec(n_layers=3, d_model=256, d_ff=512, n_heads=8, n_kv_heads=2, part_types=SYNTH_TYPES,
                                  embd_type=gguf.GGMLQuantizationType.Q6_K,
                                  output_type=gguf.GGMLQuantizationType.Q4_K, seed=1)),
        ("float", SynthSpec(n_layers=2, d_model=128, d_ff=256, n_heads=4, n_kv_heads=4,
                            matrix_type=gguf.GGMLQuantizationType.F16, part_types={
                                "ffn_down": gguf.GGMLQuantizationType.BF16, "attn_q": gguf.GGMLQuantizationType.F32},
                            embd_type=gguf.GGMLQuantizationType.F16, output_type=gguf.GGMLQuantizationType.BF16,
                            seed=2)),
    ],
)
@torch.inference_mode()
def test_synthetic_model_logits_match_transformers(tmp_path, name, spec):
    path = write_synthetic_gguf(tmp_path / f"{name}.gguf", spec)
    ours = ntio.load(path, max_context=64, cpu_activations="float32")
    ref = hf_model(path)
    ids = torch.randint(0, spec.vocab_size, (17,), generator=torch.Generator().manual_seed(0))
    got = ours.engine.forward(ids, 0, all_logits=True)
    want = ref(ids[None]).logits[0]
    assert rel_l2(got, want) <= 1e-4


@torch.inference_mode()
def test_llama3_rope_scaling_matches_transformers(tmp_path):
    """A file carrying `rope_freqs.weight` (llama.cpp's encoding of Llama-3 rope scaling) against transformers
    loading the same weights with the equivalent llama3 rope_scaling config, at positions past the original
    context where the scaling matters."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    d_model, n_heads, theta = 128, 4, 500000.0
    hf_cfg = LlamaConfig(hidden_size=d_model, num_attention_heads=n_heads, rope_theta=theta, rope_scaling=scaling)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    plain = 1.0 / theta ** (torch.arange(0, d_model // n_heads, 2).float() / (d_model // n_heads))
    spec = SynthSpec(n_layers=2, d_model=d_model, d_ff=256, n_heads=n_heads, n_kv_heads=2, rope_theta=theta,
                     matrix_type=gguf.GGMLQuantizationType.Q8_0, rope_factors=tuple((plain / scaled).tolist()), seed=5)
    path = write_synthetic_gguf(tmp_path / "llama3.gguf", spec)
    ours = ntio.load(path, max_context=128, cpu_activations="float32")
    assert ours.config.rope_scaling.kind == "llama3"
    ref = hf_model(path, rope_scaling=scaling)
    ids = torch.randint(0, spec.vocab_size, (100,), generator=torch.Generator().manual_seed(1))
    assert rel_l2(ours.engine.forward(ids, 0, all_logits=True), ref(ids[None]).logits[0]) <= 1e-4
