"""The qwen2 family against Hugging Face transformers loading the same GGUF in float32 (the independent oracle), on
the two real models ntio fetches by name: Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct (Q4_K_M; q/k/v biases,
NeoX RoPE, the `qwen2` pre-tokenizer, ChatML). Downloads ~1.6 GB on first use (marked `qwen`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ntio
from references import hf_greedy, hf_model, hf_perplexity, rel_l2

pytest.importorskip("transformers")  # the oracle (tests/references.py)
pytestmark = pytest.mark.qwen

PROMPTS = [
    "def fibonacci(n):\n    ",
    "The capital of France is",
    "import numpy as np\n\ndef normalize(v):\n",
    "Once upon a time, in a small village by the sea,",
    "# Sort a list of dictionaries by the 'age' key\n",
    "SELECT name, COUNT(*) FROM users",
]
GREEDY_PROMPTS = ["def quicksort(arr):\n", "class Stack:\n    def __init__(self):\n"]
PPL_TEXT = Path(__file__).parent / "data" / "apache-2.0.txt"
# (characters, window) per size: ~520 tokens in two 256-token windows and a bit for 0.5B, which checks the windowing;
# ~300 tokens in part of one 512-token window for 1.5B, whose float32 reference costs ~40 s per full window here.
PPL = {"0.5b": (2600, 256), "1.5b": (1500, 512)}
# Greedy prompts per size: the 1.5B (the same graph at ~3x the reference's cost) runs one.
GREEDY = {"0.5b": GREEDY_PROMPTS, "1.5b": GREEDY_PROMPTS[:1]}
# A reference step whose top two logits are closer than this is a near-tie: float32 rounding may pick either.
NEAR_TIE = 1e-3


@pytest.fixture(scope="module", params=["qwen05_path", "qwen15_path"], ids=["0.5b", "1.5b"])
def pair(request):
    """(ntio model, transformers model) on the same file; one module-wide load of each per size."""
    path = request.getfixturevalue(request.param)
    ours = ntio.load(path, max_context=1024, cpu_activations="float32")
    yield ours, hf_model(path), {"qwen05_path": "0.5b", "qwen15_path": "1.5b"}[request.param]
    ours.close()


@torch.inference_mode()
def test_last_position_logits_match_transformers(pair):
    ours, ref, _ = pair
    assert ours.config.architecture == "qwen2" and ours.config.family.rope == "neox"
    for prompt in PROMPTS:
        ids = ours.encode_prompt(prompt)
        got = ours.engine.forward(torch.tensor(ids), 0)
        want = ref(torch.tensor([ids])).logits[0, -1]
        assert rel_l2(got, want) <= 1e-4, prompt


@torch.inference_mode()
def test_greedy_64_tokens_identical_up_to_a_near_tie(pair):
    """ntio's greedy tokens equal transformers' for 64 tokens, or up to the first step where the reference's top
    two logits are a near-tie (there, either token is right); at least 32 tokens are compared per prompt."""
    ours, ref, size = pair
    for prompt in GREEDY[size]:
        ids = ours.encode_prompt(prompt)
        got = ours.generate(ids, max_new_tokens=64, temperature=0.0).token_ids
        want, compared = hf_greedy(ref, ids, got, NEAR_TIE)
        assert compared >= 32, f"{prompt!r}: near-tie at step {compared}; pick another prompt"
        assert got[:compared] == want[:compared], prompt


def test_perplexity_within_half_percent(pair):
    """ntio's convention (one tokenization, non-overlapping windows, each window's first token unscored) computed
    with transformers' logits on ntio's token ids."""
    ours, ref, size = pair
    chars, ctx = PPL[size]
    text = PPL_TEXT.read_text()[:chars]
    got = ours.perplexity(text, ctx=ctx)
    want, count = hf_perplexity(ref, ours.tokenizer.encode(text), ctx)
    assert got.n_tokens == count
    assert abs(got.perplexity - want) / want <= 0.005


@torch.inference_mode()
def test_streamed_equals_resident_bit_exact(qwen05_path):
    """Layers read from disk at every use (tier C) give the same bits as layers resident (tier A)."""
    runs = []
    for tiers in ("A", "A:0-11,C:12-23"):
        m = ntio.load(qwen05_path, max_context=64, tiers=tiers)
        ids = torch.tensor(m.encode_prompt(PROMPTS[0]))
        logits = [m.engine.forward(ids, 0, all_logits=True)]
        for step in range(3):  # decode steps at T = 1 (the CPU kernels' path)
            logits.append(m.engine.forward(torch.tensor([100 + step]), len(ids) + step))
        runs.append(logits)
        m.close()
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_chat_template_and_tokenizer_from_the_file(qwen05_path):
    m = ntio.load(qwen05_path, max_context=256)
    ids = m.encode_prompt("Write hello world in Python.", chat=True)
    text = m.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    reply = m.generate("Write a Python function that returns the square of x.", chat=True, max_new_tokens=48)
    assert "def " in reply.text and "return" in reply.text


@torch.inference_mode()
def test_a_bf16_checkpoint_runs_as_transformers_runs_it(pair, tmp_path):
    """The 0.5B's weights as a Hugging Face checkpoint in BF16 (`save_pretrained`: q/k/v biases, the ChatML
    template, a tokenizer.json with the qwen2 split regex), run from the directory: logits as transformers' on the
    same directory (upcast to float32), tokens and chat prompt as its tokenizer's."""
    ours_gguf, ref, size = pair
    if size != "0.5b":
        pytest.skip("one size is enough for the checkpoint path")
    import transformers
    from tokenizers import Tokenizer as RustTokenizer
    from test_checkpoint import save_checkpoint

    # The tokenizer ntio builds from the GGUF, as a fast tokenizer (transformers' own GGUF conversion takes ~26 s
    # for this vocabulary, and drops the split regex).
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=RustTokenizer.from_str(ours_gguf.tokenizer._backend.to_str()), eos_token="<|im_end|>",
        pad_token="<|endoftext|>", chat_template=ours_gguf.file.metadata["tokenizer.chat_template"])
    directory = save_checkpoint(ref, tokenizer, tmp_path / "qwen-hf", dtype=torch.bfloat16)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    ours = ntio.load(directory, max_context=256, cpu_activations="float32")
    try:
        assert ours.config.family.rope == "neox" and ours.config.tied_embeddings == ours_gguf.config.tied_embeddings
        for prompt in PROMPTS[:3]:
            ids = ours.encode_prompt(prompt)
            assert ids == theirs.encode(prompt, add_special_tokens=False)
            assert rel_l2(ours.engine.forward(torch.tensor(ids), 0), oracle(torch.tensor([ids])).logits[0, -1]) <= 1e-4
        messages = [{"role": "user", "content": "Reverse a string in Python."}]
        assert ours.tokenizer.render_chat(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                                  add_generation_prompt=True)
    finally:
        ours.close()
