"""Hugging Face checkpoints as input (`-m DIR`, `ntio convert DIR`), against transformers loading the same
directory. The checkpoint is real SmolLM2 weights: transformers reads the GGUF ntio fetches and `save_pretrained`
writes them (float32 safetensors, tokenizer.json, tokenizer_config.json, chat template), so no hub is needed. A
Llama checkpoint keeps Hugging Face's q/k row order, which llama.cpp's converter permutes: these tests are what
says ntio's NeoX-style RoPE on unpermuted rows is the same model."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import ntio
from ntio.errors import ModelFormatError, UnsupportedModelError
from ntio.formats.model_file import open_model_file
from ntio.formats.store import convert
from references import hf_greedy, hf_perplexity, rel_l2
from test_cli import assert_user_error, ntio as run_cli

transformers = pytest.importorskip("transformers")  # writes the checkpoint, and is the oracle

PPL_TEXT = Path(__file__).parent / "data" / "apache-2.0.txt"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "In 1492, 3 ships sailed 4,500 miles"]
NEAR_TIE = 1e-3


def save_checkpoint(model, tokenizer, directory: Path, dtype: torch.dtype = torch.float32, **save_options) -> Path:
    """`model`'s weights (and `tokenizer`'s files, unless None) as a plain checkpoint (a GGUF-loaded model refuses
    save_pretrained: it is copied into a fresh one of its config first)."""
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    with torch.device("meta"):  # no random initialization: the weights are assigned
        fresh = type(model)(type(model.config).from_dict(config))
    fresh.load_state_dict(model.state_dict(), assign=True)
    fresh.to(dtype).save_pretrained(directory, **save_options)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, hf_smollm2, smollm2_path) -> Path:
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    return save_checkpoint(hf_smollm2, tokenizer, tmp_path_factory.mktemp("smollm2-hf"))


@pytest.fixture(scope="module")
def oracle(checkpoint):
    """transformers on the checkpoint directory itself."""
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(checkpoint):
    m = ntio.load(checkpoint, max_context=1024, cpu_activations="float32")
    yield m
    m.close()


def test_checkpoint_reads_as_a_llama_with_neox_rope(checkpoint, ours):
    g = open_model_file(checkpoint)
    assert g.path == checkpoint / "model.safetensors"
    assert ours.config.architecture == "llama" and ours.config.family.rope == "neox"
    assert ours.config.tied_embeddings and "output.weight" not in g.tensors
    assert {t.qtype for t in g.tensors.values()} == {gguf.GGMLQuantizationType.F32}
    assert len(g.tensors) == 2 + 9 * ours.config.n_layers


def test_tokenizer_and_chat_template_match_transformers(checkpoint, ours):
    theirs = transformers.AutoTokenizer.from_pretrained(checkpoint)
    for text in [*PROMPTS, "naïve café — 日本語 😀\n\n\tindented", " leading space"]:
        assert ours.tokenizer.encode(text, add_bos=False) == theirs.encode(text, add_special_tokens=False), text
        assert ours.tokenizer.decode(theirs.encode(text, add_special_tokens=False)) == text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.tokenizer.render_chat(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                              add_generation_prompt=True)
    assert ours.tokenizer.eos_id == theirs.convert_tokens_to_ids(theirs.eos_token)


@torch.inference_mode()
def test_last_position_logits_match_transformers(ours, oracle):
    for prompt in PROMPTS:
        ids = ours.encode_prompt(prompt)
        assert rel_l2(ours.engine.forward(torch.tensor(ids), 0), oracle(torch.tensor([ids])).logits[0, -1]) <= 1e-4


def test_perplexity_within_a_tenth_of_a_percent(ours, oracle):
    text = PPL_TEXT.read_text()[:3000]
    got = ours.perplexity(text, ctx=256)
    want, count = hf_perplexity(oracle, ours.tokenizer.encode(text), 256)
    assert got.n_tokens == count > 512
    assert abs(got.perplexity - want) / want <= 0.001


def test_greedy_tokens_identical(ours, oracle):
    ids = ours.encode_prompt("Write a haiku about the sea.", chat=True)
    got = ours.generate(ids, max_new_tokens=32, temperature=0.0).token_ids  # ends early at end of turn
    want, compared = hf_greedy(oracle, ids, got, NEAR_TIE)
    assert compared == len(got) >= 16, f"near-tie at step {compared}; pick another prompt"
    assert got == want


@torch.inference_mode()
def test_streamed_and_converted_equal_resident_bit_exact(checkpoint, ours, tmp_path):
    """Every layer read from the safetensors file at each use (tier C), and the checkpoint converted to a store as
    it is, give the resident checkpoint's bits."""
    ids = torch.tensor(ours.encode_prompt(PROMPTS[1]))
    want = ours.engine.forward(ids, 0, all_logits=True)
    store = convert(checkpoint, tmp_path / "m.ntio")
    for source, tiers in ((checkpoint, "C"), (store, "A")):
        m = ntio.load(source, max_context=64, tiers=tiers, cpu_activations="float32")
        try:
            assert torch.equal(m.engine.forward(ids, 0, all_logits=True), want), (source, tiers)
            assert m.tokenizer.encode(PROMPTS[2]) == ours.tokenizer.encode(PROMPTS[2])
        finally:
            m.close()


@pytest.fixture(scope="module")
def float32_perplexity(ours) -> float:
    return ours.perplexity(PPL_TEXT.read_text()[:1500], ctx=256).perplexity


@pytest.mark.parametrize("matrix_type", ["F16", "BF16", "Q8_0", "Q4_0"])
def test_convert_encodes_float_matrices(checkpoint, float32_perplexity, tmp_path, matrix_type):
    """Each matrix of the store decodes (gguf-py's dequantizer) to the checkpoint's within its type's rounding; norms
    stay float32; a quantized store runs, its perplexity near the float32 checkpoint's."""
    qtype = gguf.GGMLQuantizationType[matrix_type]
    store = open_model_file(convert(checkpoint, tmp_path / "m.ntio", matrix_type=qtype))
    source = open_model_file(checkpoint)
    tolerance = {"F16": 1e-3, "BF16": 5e-3, "Q8_0": 1e-2, "Q4_0": 0.15}[matrix_type]
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight", "blk.3.attn_norm.weight"):
        want = source.tensor_bytes(name).view(np.float32).reshape(source.tensor(name).shape)
        info = store.tensor(name)
        wide = gguf.GGMLQuantizationType.Q8_0 if matrix_type == "Q4_0" and name == "token_embd.weight" else qtype
        assert info.qtype == (wide if want.ndim == 2 else gguf.GGMLQuantizationType.F32), name
        got = gguf.quants.dequantize(np.asarray(store.tensor_bytes(name)), info.qtype).reshape(want.shape)
        assert rel_l2(torch.from_numpy(got.copy()), torch.from_numpy(want.copy())) <= tolerance, name
    if matrix_type in ("Q8_0", "Q4_0"):  # the quantized stores run
        m = ntio.load(store.path, max_context=256)
        try:
            ppl = m.perplexity(PPL_TEXT.read_text()[:1500], ctx=256).perplexity
        finally:
            m.close()
        # Q4_0 rounds the 135M model's matrices to 16 levels per 32 weights (round-to-nearest, as llama.cpp's
        # reference quantizer): +18% perplexity here; Q8_0 stays within 2%.
        assert abs(ppl / float32_perplexity - 1) <= {"Q4_0": 0.25, "Q8_0": 0.02}[matrix_type]


# --- bad input: one line naming the file and the tensor or key -----------------------------------------------------

def write_safetensors(path: Path, header: dict, data: bytes = b"", header_len: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


@pytest.fixture
def tiny_dir(checkpoint, tmp_path) -> Path:
    """A directory with the real checkpoint's config and tokenizer files (weights written by each test)."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    return tmp_path


def f32(shape: list[int], begin: int) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, begin + 4 * int(np.prod(shape))]}


@pytest.mark.parametrize("header, data, header_len, message", [
    ({}, b"", 1 << 20, "header of 1048576 bytes is longer than the file"),
    (None, b"", None, "header is not JSON"),
    ({"model.norm.weight": f32([576], 0), "model.embed_tokens.weight": f32([4, 576], 1000)}, bytes(4 * 576 * 5),
     None, "'model.norm.weight' and 'model.embed_tokens.weight' overlap"),
    ({"model.norm.weight": f32([576], 0)}, bytes(100), None, "'model.norm.weight' data_offsets [0, 2304] fall outside"),
    ({"model.norm.weight": {"dtype": "I8", "shape": [4], "data_offsets": [0, 4]}}, bytes(4), None, "dtype 'I8'"),
    ({"model.norm.weight": {"dtype": "F32", "shape": [576], "data_offsets": [0, 8]}}, bytes(8), None,
     "has 8 bytes, but F32 [576] takes 2304"),
    ({"model.layers.0.mlp.experts.weight": f32([4], 0)}, bytes(16), None, "'model.layers.0.mlp.experts.weight' is not "
     "part of a llama model"),
], ids=["header-too-long", "header-not-json", "overlap", "outside-file", "dtype", "size", "unknown-tensor"])
def test_bad_safetensors_is_one_line(tiny_dir, header, data, header_len, message):
    shard = tiny_dir / "model.safetensors"
    if header is None:
        shard.write_bytes(struct.pack("<Q", 8) + b"{nope   ")
    else:
        write_safetensors(shard, header, data, header_len)
    with pytest.raises((ModelFormatError, UnsupportedModelError), match=re.escape(message)) as e:
        open_model_file(tiny_dir)
    assert str(shard) in str(e.value)


def test_missing_parts_are_named(tiny_dir, checkpoint):
    with pytest.raises(ModelFormatError, match="no model.safetensors or model.safetensors.index.json"):
        open_model_file(tiny_dir)
    (tiny_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002"
                                                                                            ".safetensors"}}))
    with pytest.raises(ModelFormatError, match="shard 'model-00001-of-00002.safetensors' is named in the index but "
                                               "missing"):
        open_model_file(tiny_dir)
    (tiny_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../elsewhere.bin"}}))
    with pytest.raises(ModelFormatError, match="shard '../elsewhere.bin' is not a file name in the checkpoint"):
        open_model_file(tiny_dir)
    (tiny_dir / "model.safetensors.index.json").unlink()
    (tiny_dir / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    config = json.loads((tiny_dir / "config.json").read_text())
    (tiny_dir / "config.json").write_text(json.dumps({**config, "model_type": "mixtral"}))
    with pytest.raises(UnsupportedModelError, match="config.json: model_type 'mixtral' is not supported"):
        open_model_file(tiny_dir)
    (tiny_dir / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(UnsupportedModelError, match="names a quantized checkpoint \\('gptq'\\)"):
        open_model_file(tiny_dir)
    (tiny_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 1024}))
    with pytest.raises(ModelFormatError, match="blk.0.ffn_gate.weight"):
        ntio.load(tiny_dir)
    (tiny_dir / "config.json").write_text(json.dumps(config))
    (tiny_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelFormatError, match="tokenizer.json: missing"):
        open_model_file(tiny_dir)


def test_a_tensor_the_family_needs_is_named(tiny_dir, checkpoint):
    source = open_model_file(checkpoint)
    header, blobs, offset = {}, [], 0
    for hf_name in ("model.embed_tokens.weight", "model.norm.weight"):
        name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[hf_name]
        blob = bytes(source.tensor_bytes(name))
        header[hf_name] = {"dtype": "F32", "shape": list(source.tensor(name).shape),
                           "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    write_safetensors(tiny_dir / "model.safetensors", header, b"".join(blobs))
    with pytest.raises(ModelFormatError, match=r"model.safetensors: missing tensor 'blk.0.attn_norm.weight'"):
        ntio.load(tiny_dir)


@torch.inference_mode()
def test_a_sharded_checkpoint_runs_directly_and_converts(hf_smollm2, checkpoint, ours, tmp_path):
    """Shards named by model.safetensors.index.json: one reader reads them all, in one offset space (every layer
    streamed, a layer whose tensors lie in two shards among them); the logits are the single file's, bit for bit.
    `convert` joins the shards into a store that runs with the same bits."""
    sharded = save_checkpoint(hf_smollm2, None, tmp_path / "smollm2.v2-sharded", max_shard_size="200MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((checkpoint / name).read_bytes())
    g = open_model_file(sharded)
    assert len(g.shards) >= 2
    layers_per_shard = [{int(n.split(".")[1]) for n, f in g.tensor_files.items() if f == s and n.startswith("blk.")}
                        for s in g.shards]
    assert any(a & b for a, b in zip(layers_per_shard, layers_per_shard[1:])), "no layer straddles two shards"
    ids = torch.tensor(ours.encode_prompt(PROMPTS[0]))
    want = ours.engine.forward(ids, 0)
    m = ntio.load(sharded, max_context=64, cpu_activations="float32", tiers="C")
    try:
        assert torch.equal(m.engine.forward(ids, 0), want)
    finally:
        m.close()
    proc = run_cli("convert", str(sharded))  # the store is named after the directory, dots and all
    assert proc.returncode == 0 and proc.stdout.strip() == str(tmp_path / "smollm2.v2-sharded.ntio"), proc.stderr
    m = ntio.load(tmp_path / "smollm2.v2-sharded.ntio", max_context=64, cpu_activations="float32")
    try:
        assert torch.equal(m.engine.forward(ids, 0), want)
    finally:
        m.close()


@torch.inference_mode()
def test_llama3_rope_scaling_matches_transformers(checkpoint, tmp_path):
    """Llama 3's RoPE scaling from config.json's parameters (a GGUF carries the result as rope_freqs.weight): a small
    random-weight Llama checkpoint's logits at every position of 96 tokens, past its original context of 32, as
    transformers'; the same weights without the scaling give other logits."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    shape = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    scaled = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, rope_scaling=scaling)).eval()
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()
    plain.load_state_dict(scaled.state_dict())
    scaled.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    m = ntio.load(tmp_path, max_context=128, cpu_activations="float32")
    try:
        assert m.config.rope_scaling.kind == "llama3"
        ids = torch.arange(1000, 1096)
        got = m.engine.forward(ids, 0, all_logits=True)
    finally:
        m.close()
    assert rel_l2(got, scaled(ids[None]).logits[0]) <= 1e-4
    assert rel_l2(got, plain(ids[None]).logits[0]) > 1e-3
