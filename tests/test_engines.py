"""Engines that coexist: a second model beside the first (a draft beside its target) shares the tokenizer where
the vocabularies match and nothing mutable: KV cache, scratch, threads and loader are each engine's own. The oracle
for state that persists between steps (KV cache, positions, the loader's read-ahead) is each engine run alone:
interleaving their steps must not change a bit."""

from __future__ import annotations

import pytest
import torch

import ntio
from ntio.kernels import cpu_kernels, ops
from ntio.kernels.ops import SequenceRows
from ntio.models.layers import attend, attention, causal_mask, rope_tables
from ntio.runtime.engine import Engine, Segment
from ntio.runtime.kv_cache import KVCache
from ntio.synth import SynthSpec, write_synthetic_gguf
from references import rel_l2

PROMPT = "The three primary colors are"


def _steps(m, ids, n=3):
    """Logits of a prefill (T = len(ids) > the CPU kernels' rows with float32 activations: the
    dequantize-into-scratch path) then n decodes."""
    out = [m.engine.forward(torch.tensor(ids), 0, all_logits=True)]
    for i in range(n):
        out.append(m.engine.forward(torch.tensor([3 + i]), len(ids) + i))
    return out


@torch.inference_mode()
def test_interleaved_engines_equal_each_alone(smollm2_path, tmp_path):
    synth = write_synthetic_gguf(tmp_path / "s.gguf", SynthSpec(n_layers=2, d_model=256, d_ff=512, n_heads=4,
                                                                n_kv_heads=2, seed=3))
    # more tokens than the CPU kernels take with float32 activations: both models' prefill runs through their
    # scratch buffers
    ids, floats = list(range(40, 40 + ops.KERNEL_ROWS + 16)), {"cpu_activations": "float32"}
    alone = [_steps(ntio.load(p, max_context=128, **floats), ids) for p in (smollm2_path, synth)]
    a = ntio.load(smollm2_path, max_context=128, tiers="C", **floats)
    b = a.companion(synth, max_context=128, **floats)
    a_out = [a.engine.forward(torch.tensor(ids), 0, all_logits=True)]
    b_out = [b.engine.forward(torch.tensor(ids), 0, all_logits=True)]
    for i in range(3):
        a_out.append(a.engine.forward(torch.tensor([3 + i]), len(ids) + i))
        b_out.append(b.engine.forward(torch.tensor([3 + i]), len(ids) + i))
    assert all(torch.equal(x, y) for x, y in zip(alone[0], a_out))
    assert all(torch.equal(x, y) for x, y in zip(alone[1], b_out))
    assert a.engine.scratch is not b.engine.scratch and a.engine.kv is not b.engine.kv
    assert 0 < a.engine.scratch.nbytes <= ops.SCRATCH_BYTES and 0 < b.engine.scratch.nbytes <= ops.SCRATCH_BYTES
    assert b.tokenizer is not a.tokenizer  # different vocabularies: the companion built its own
    a.close()
    b.close()


@torch.inference_mode()
def test_engine_threads_are_its_own_and_restored(smollm2_path):
    """An engine of one thread in a process of two (set here: a pytest-xdist worker computes on one)."""
    process = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with cpu_kernels.using_threads(2):
            m = ntio.load(smollm2_path, max_context=256, threads=1)
            ids = m.encode_prompt(PROMPT * 5)
            seen = []
            real = ops.normed_linear

            def spy(*args):  # the output head's product, inside the step
                seen.append((torch.get_num_threads(), cpu_kernels.threads()))
                return real(*args)

            ops.normed_linear = spy
            try:
                m.engine.forward(torch.tensor(ids), 0)
            finally:
                ops.normed_linear = real
            m.close()
            assert set(seen) == {(1, 1)}
            assert torch.get_num_threads() == 2 and cpu_kernels.threads() == 2
    finally:
        torch.set_num_threads(process)


def test_companion_of_the_same_vocabulary_shares_the_tokenizer(smollm2_path):
    a = ntio.load(smollm2_path, max_context=64)
    b = a.companion("smollm2-135m", max_context=32, tiers="C")
    assert b.tokenizer is a.tokenizer and b.engine is not a.engine
    assert b.generate(PROMPT, max_new_tokens=8).token_ids == a.generate(PROMPT, max_new_tokens=8).token_ids


def test_companion_computes_as_its_model_unless_told(smollm2_path):
    a = ntio.load(smollm2_path, max_context=64, cpu_activations="float32", kv_dtype="float16")
    inherited = a.companion("smollm2-135m", max_context=32)
    told = a.companion("smollm2-135m", max_context=32, cpu_activations="int8")
    assert not inherited.engine.kernels.int8 and told.engine.kernels.int8
    assert inherited.engine.kv.k.dtype == told.engine.kv.k.dtype == torch.float16
    for m in (a, inherited, told):
        m.close()


@pytest.mark.qwen
def test_qwen_draft_beside_its_target_shares_the_tokenizer(qwen15_path, qwen05_path):
    target = ntio.load(qwen15_path, max_context=128)
    draft = target.companion(qwen05_path, max_context=128)
    assert draft.tokenizer is target.tokenizer
    ids = target.encode_prompt("def add(a, b):\n", chat=True)
    draft_logits = draft.engine.forward(torch.tensor(ids), 0)
    assert draft_logits.shape == target.engine.forward(torch.tensor(ids), 0).shape  # one vocabulary, one id space
    assert draft.engine.kv.ids == target.engine.kv.ids == ids


@pytest.mark.parametrize("cpu_activations, kv_dtype", [("int8", "float32"), ("float32", "float32"),
                                                       ("int8", "float16"), ("int8", "bfloat16")])
@torch.inference_mode()
def test_one_call_blocks_equal_the_per_op_path(smollm2_path, qwen05_path, cpu_activations, kv_dtype, monkeypatch):
    """A resident model's layers as one kernel call (ops.decoder_stack), each decoder block as one kernel call
    (a stack of one) and the per-op path give the same logits bit for bit: the same products, bias add,
    attention and residual adds in the same order, over KV caches of each dtype. Llama (interleaved RoPE) and Qwen2
    (NeoX RoPE, q/k/v bias), a prefill of 7 tokens then single steps."""
    for path in (smollm2_path, qwen05_path):
        m = ntio.load(path, max_context=64, cpu_activations=cpu_activations, kv_dtype=kv_dtype)
        ids = m.encode_prompt("The capital of France is")[:7]

        def run() -> list[torch.Tensor]:
            m.engine.kv.crop(0)
            out = [m.engine.forward(torch.tensor(ids), 0, all_logits=True)]
            out += [m.engine.forward(torch.tensor([t]), len(ids) + i) for i, t in enumerate((11, 12, 13))]
            return out

        real_stack, stacks = ops.decoder_stack, []

        def counted_stack(*args, **kwargs):
            stacks.append(args)
            return real_stack(*args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(ops, "decoder_stack", counted_stack)
            stack = run()
        assert len(stacks) == 4  # every forward ran as one stack
        with monkeypatch.context() as patch:
            patch.setattr(Engine, "_whole_stack", lambda *args: None)
            per_block = run()
            patch.setattr(ops, "uses_cpu_block", lambda *args: False)
            per_op = run()
        assert all(torch.equal(a, b) for a, b in zip(stack, per_block)), path
        assert all(torch.equal(a, b) for a, b in zip(stack, per_op)), path
        m.close()


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@torch.inference_mode()
def test_attention_over_a_16_bit_cache_is_torchs(smollm2_path, kv_dtype, monkeypatch):
    """The CPU kernel's attention over a float16 / bfloat16 cache (`ops.cached_attention`, which widens it to
    float32 a block at a time) against torch's ops over the same cache (assignment rounds the new keys and values,
    SDPA reads the cache cast to float32): the caches afterwards are the same bits, the outputs the same within
    float32 rounding. Three new rows after 300 cached positions (two of the kernel's chunks), causal."""
    with ntio.load(smollm2_path, max_context=64) as m:
        cfg, start, t = m.config, 300, 3
        gen = torch.Generator().manual_seed(1)
        qkv = torch.randn(t, cfg.q_width + 2 * cfg.kv_width, generator=gen)
        cache = torch.randn(2, cfg.n_kv_heads, start + t + 5, cfg.head_dim, generator=gen).to(kv_dtype)
        rope = rope_tables(m.engine.globals.inv_freq, torch.arange(start, start + t))
        mask = causal_mask(start, t, qkv.device)

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            k, v = cache.clone()
            out = attend(qkv.clone(), k, v, start, rope, mask, cfg, cfg.family.rope)
            return out, torch.stack([k, v])

        assert ops.uses_cpu_attention(qkv, cache[0])
        kernel, kernel_cache = run()
        monkeypatch.setattr(ops, "uses_cpu_attention", lambda *args: False)
        torchs, torchs_cache = run()
        assert torch.equal(kernel_cache.view(torch.int16), torchs_cache.view(torch.int16))
        assert not torch.equal(kernel_cache, cache)  # the new rows were written
        assert rel_l2(kernel, torchs) <= 1e-6


def test_the_attention_binding_refuses_a_cache_of_another_dtype(smollm2_path):
    """`_core.attend` takes the caches in the kv_dtype it is told, and names the cache that is not, or the dtype it
    does not know; nothing is computed."""
    from ntio import _core

    hq, hkv, hd = 2, 1, 4
    qkv, out = torch.zeros(1, (hq + 2 * hkv) * hd), torch.zeros(1, hq * hd)
    cos = sin = torch.ones(1, hd // 2)

    def call(k: torch.Tensor, v: torch.Tensor, kv_dtype: str) -> None:
        _core.attend(qkv.numpy(), k, v, 4, 0, cos.numpy(), sin.numpy(), None, out.numpy(), n_heads=hq,
                     n_kv_heads=hkv, head_dim=hd, rope_dim=hd, neox=False, kv_dtype=kv_dtype)

    halves, floats = torch.zeros(hkv, 4, hd, dtype=torch.float16), torch.zeros(hkv, 4, hd)
    call(halves.numpy(), halves.clone().numpy(), "float16")
    call(halves.view(torch.int16).numpy(), halves.clone().view(torch.int16).numpy(), "bfloat16")
    with pytest.raises(ValueError, match='cache_k must hold float16 elements, got buffer format "f"'):
        call(floats.numpy(), floats.clone().numpy(), "float16")
    with pytest.raises(ValueError, match=r"cache_v must hold bfloat16 \(as int16 bits"):
        call(halves.view(torch.int16).numpy(), halves.numpy(), "bfloat16")
    with pytest.raises(ValueError, match="unknown kv_dtype 'float8' \\(choose float32, float16 or bfloat16\\)"):
        call(floats.numpy(), floats.clone().numpy(), "float8")


@torch.inference_mode()
def test_a_stack_refuses_caches_of_another_depth_and_leaves_them_as_they_were(smollm2_path):
    """`ops.decoder_stack` takes one cache per block, [L, Hkv, capacity, hd]: other caches are refused with their
    sizes and nothing is written; the right ones take each block's keys in its own layer."""
    with ntio.load(smollm2_path, max_context=64) as m:
        cfg, blocks = m.config, m.engine.layers.resident_blocks()
        kv = KVCache(cfg, 16, torch.float32, "cpu")
        before = kv.k.view(torch.int32).clone()  # bits: the empty cache may hold NaNs
        rope = rope_tables(m.engine.globals.inv_freq, torch.arange(1))

        def stack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return ops.decoder_stack(torch.randn(1, cfg.d_model), [w.kernel_args for w in blocks[:2]],
                                     [SequenceRows(slice(0, 1), k, v, 0, rope, None)], cfg.rms_eps,
                                     (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim), neox=False)

        with pytest.raises(ValueError,
                           match=rf"caches of \d+ and \d+ elements for 2 layers of \[{cfg.n_kv_heads}, 16,"):
            stack(kv.k, kv.v)
        assert torch.equal(kv.k.view(torch.int32), before)
        stack(kv.k[:2], kv.v[:2])
        written = (kv.k.view(torch.int32) != before)[:, :, 0].any(dim=(1, 2))  # per layer, position 0
        assert written.tolist() == [True, True] + [False] * (cfg.n_layers - 2)


@torch.inference_mode()
def test_a_stack_stops_its_last_block_after_attention_or_after_gate_and_up(smollm2_path):
    """The ends of `ops.decoder_stack`'s last block: after its attention (`attention_only`) and after its gate/up
    products (`gate_up`) h is the same residual stream, bit for bit, and the per-op path's attention within float
    rounding; the gate/up products are the per-op path's too; both ends at once are refused."""
    with ntio.load(smollm2_path, max_context=64) as m:
        cfg, block = m.config, m.engine.layers.resident_blocks()[3]
        rope = rope_tables(m.engine.globals.inv_freq, torch.arange(4))
        h = torch.randn(4, cfg.d_model, generator=torch.Generator().manual_seed(0))

        def stack(**end) -> torch.Tensor:
            kv = KVCache(cfg, 16, torch.float32, "cpu")
            rows = SequenceRows(slice(0, 4), kv.k[3], kv.v[3], 0, rope, causal_mask(0, 4, h.device))
            return ops.decoder_stack(h, [block.kernel_args], [rows], cfg.rms_eps,
                                     (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim), neox=cfg.family.rope == "neox",
                                     **end)

        gate_up = torch.empty(4, 2 * cfg.d_ff)
        attended, before_ffn = stack(attention_only=True), stack(gate_up=gate_up)
        assert torch.equal(attended, before_ffn) and not torch.equal(attended, stack())
        kv = KVCache(cfg, 16, torch.float32, "cpu")
        want = h + attention(h, block, kv.k[3], kv.v[3], 0, rope, causal_mask(0, 4, h.device), cfg, cfg.family.rope)
        assert rel_l2(attended, want) <= 1e-5
        assert rel_l2(gate_up, ops.normed_linear(attended, block.ffn_norm, cfg.rms_eps, block.w_gate_up)) <= 1e-5
        with pytest.raises(ValueError, match="gate_up and attention_only are two ends of a block: give one"):
            stack(attention_only=True, gate_up=gate_up)


@torch.inference_mode()
def test_early_exits_as_one_stack_equal_the_layer_loop(smollm2_path, monkeypatch):
    """A self-draft's early exit (`Engine.early_exit_batch`: the first E blocks as one stack call) gives the layer
    loop's hidden states and the same keys and values in each chain's cache, bit for bit: two chains, E = 6."""
    with ntio.load(smollm2_path, max_context=64) as m:
        blocks = m.loader.resident_copies(6)
        prompts = [m.encode_prompt(p) for p in ("The capital of France is", "def add(a, b):")]

        def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            kvs = [KVCache(m.config, 32, torch.float32, "cpu") for _ in prompts]
            for kv, ids in zip(kvs, prompts):
                m.engine.forward_batch([Segment(torch.tensor(ids), 0, kv)])
            chains = [Segment(torch.tensor([11, 12]), len(ids), kv) for kv, ids in zip(kvs, prompts)]
            h = m.engine.early_exit_batch(chains, blocks)
            return h, [kv.k[:6, :, : len(ids) + 2].clone() for kv, ids in zip(kvs, prompts)]

        real_stack, stacks = ops.decoder_stack, []

        def counted_stack(*args, **kwargs):
            stacks.append(len(args[1]))
            return real_stack(*args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(ops, "decoder_stack", counted_stack)
            stacked = run()
        assert 6 in stacks  # the early exit ran as one stack of its 6 blocks
        with monkeypatch.context() as patch:
            patch.setattr(Engine, "_stacked", lambda *args: None)
            looped = run()
        assert all(torch.equal(a, b) for a, b in zip(stacked[0], looped[0]))
        assert all(torch.equal(a, b) for a, b in zip(stacked[1], looped[1]))
