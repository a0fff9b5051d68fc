"""Batched passes (`Engine.forward_batch`, what `ntio serve` runs): several sequences, each in its own KV cache, in one
pass over the weights, against each sequence's own passes (`Engine.forward`): the same logits bit for bit, resident
and with every layer read from disk, when prefills and decode steps share a pass."""

from __future__ import annotations

import pytest
import torch

import ntio
from ntio.errors import NtioError
from ntio.kernels import ops
from ntio.kernels.ops import SequenceRows
from ntio.models.layers import causal_mask, rope_tables
from ntio.policies.cosine_skip import CosineSkipPolicy
from ntio.runtime.engine import Engine, Segment
from ntio.runtime.kv_cache import KVCache

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a small village"]


@pytest.mark.parametrize("tiers", ["A", "C"])
@torch.inference_mode()
def test_a_batched_pass_gives_each_sequence_its_own_logits(smollm2_path, tiers):
    with ntio.load(smollm2_path, max_context=256, tiers=tiers) as m:
        ids = [m.encode_prompt(p) for p in PROMPTS]
        # Alone: each prompt's prefill, then two decode steps, each logits' argmax fed back.
        alone = []
        for p in ids:
            logits = [m.engine.forward(torch.tensor(p), 0)]
            for _ in range(2):
                logits.append(m.engine.forward(torch.tensor([int(logits[-1].argmax())]), m.engine.kv.length))
            alone.append(logits)
        # Together: sequence 0 prefills first; then it decodes while 1 and 2 prefill in the same pass; then all decode.
        kvs = [KVCache(m.config, 128, torch.float32, "cpu") for _ in ids]
        together = [[] for _ in ids]
        (first,) = m.engine.forward_batch([Segment(torch.tensor(ids[0]), 0, kvs[0])])
        together[0].append(first)
        step = [Segment(torch.tensor([int(first.argmax())]), kvs[0].length, kvs[0])]
        step += [Segment(torch.tensor(ids[i]), 0, kvs[i]) for i in (1, 2)]
        for i, logits in enumerate(m.engine.forward_batch(step)):
            together[i].append(logits)
        for _ in range(2):
            live = [i for i in range(3) if len(together[i]) < 3]
            out = m.engine.forward_batch([Segment(torch.tensor([int(together[i][-1].argmax())]), kvs[i].length, kvs[i])
                                          for i in live])
            for i, logits in zip(live, out):
                together[i].append(logits)
        for i in range(3):
            assert len(together[i]) == 3
            for a, b in zip(alone[i], together[i]):
                assert torch.equal(a, b), f"sequence {i}"
            assert kvs[i].ids[: len(ids[i])] == ids[i]


@torch.inference_mode()
def test_a_token_tree_in_a_batched_pass_gets_the_logits_of_a_pass_of_its_own(smollm2_path):
    """A draft tree (node i's parent parents[i]) verified in a batched pass beside another sequence's prefill gets the
    logits `Engine.forward(parents=...)` gives it alone, bit for bit; keeping a branch that leaves the first chain
    (nodes 3, 4) then decodes the same next step."""
    tree, parents, branch = [0, 11, 22, 33, 44], [-1, 0, 1, 0, 3], [3, 4]
    with ntio.load(smollm2_path, max_context=256) as m:
        a, b = (m.encode_prompt(p) for p in PROMPTS[:2])
        tree[0] = a[-1]
        root = len(a) - 1
        m.engine.forward(torch.tensor(a[:-1]), 0)
        alone = m.engine.forward(torch.tensor(tree), root, all_logits=True, parents=parents)
        m.engine.kv.keep_branch(root, branch, [33, 44])
        next_alone = m.engine.forward(torch.tensor([55]), m.engine.kv.length)

        kva, kvb = (KVCache(m.config, 128, torch.float32, "cpu") for _ in range(2))
        m.engine.forward_batch([Segment(torch.tensor(a[:-1]), 0, kva)])
        together, _ = m.engine.forward_batch([Segment(torch.tensor(tree), root, kva, all_logits=True, parents=parents),
                                              Segment(torch.tensor(b), 0, kvb)])
        assert kva.length == root + 1  # only the root is a cached position until a branch is kept
        kva.keep_branch(root, branch, [33, 44])
        (next_together,) = m.engine.forward_batch([Segment(torch.tensor([55]), kva.length, kva)])
    assert torch.equal(alone, together)
    assert torch.equal(next_alone, next_together)
    assert kva.ids == a + [33, 44, 55]


@torch.inference_mode()
def test_a_batched_pass_runs_each_block_as_one_kernel_call_with_the_per_op_bits(smollm2_path, qwen05_path,
                                                                                  monkeypatch):
    """Several sequences' rows through every block in one kernel call (`ops.decoder_stack`, every sequence attending
    over its own cache), through each block in one call (a stack of one) and per op give the same logits bit for
    bit: a token tree beside a prefill, then three sequences' decode steps. Llama (interleaved RoPE) and Qwen2 (NeoX
    RoPE, q/k/v bias)."""
    tree, parents = [0, 11, 22, 33, 44], [-1, 0, 1, 0, 3]
    calls = []
    decoder_stack = ops.decoder_stack
    monkeypatch.setattr(ops, "decoder_stack", lambda *a, **k: calls.append((len(a[1]), len(a[2]))) or
                        decoder_stack(*a, **k))
    for path in (smollm2_path, qwen05_path):
        with ntio.load(path, max_context=128) as m:
            a, b, c = (m.encode_prompt(p) for p in PROMPTS)
            tree[0] = a[-1]

            def run() -> list[torch.Tensor]:
                kvs = [KVCache(m.config, 64, torch.float32, "cpu") for _ in range(3)]
                m.engine.forward_batch([Segment(torch.tensor(a[:-1]), 0, kvs[0]),
                                        Segment(torch.tensor(c), 0, kvs[2])])
                out = m.engine.forward_batch([Segment(torch.tensor(tree), len(a) - 1, kvs[0], all_logits=True,
                                                      parents=parents), Segment(torch.tensor(b), 0, kvs[1])])
                kvs[0].keep_branch(len(a) - 1, [3, 4], [33, 44])
                return out + m.engine.forward_batch([Segment(torch.tensor([55 + i]), kv.length, kv)
                                                     for i, kv in enumerate(kvs)])

            calls.clear()
            stacked = run()
            n_layers = m.config.n_layers
            assert calls == [(n_layers, 2), (n_layers, 2), (n_layers, 3)], path  # (blocks, sequences): one a pass
            with monkeypatch.context() as patch:
                patch.setattr(Engine, "_whole_stack", lambda *args: None)
                calls.clear()
                per_block = run()
                assert calls == [(1, 2)] * n_layers * 2 + [(1, 3)] * n_layers, path  # one a block and pass
                patch.setattr(ops, "uses_cpu_block", lambda *args: False)
                per_op = run()
            assert all(torch.equal(x, y) for x, y in zip(stacked, per_block)), path
            assert all(torch.equal(x, y) for x, y in zip(stacked, per_op)), path


@torch.inference_mode()
def test_a_batched_block_refuses_rows_that_do_not_tile_h_and_a_cache_two_sequences_share(smollm2_path):
    """A block in one call (`ops.decoder_stack` of one) over several sequences: their rows must split h's rows, and
    no two may write one cache; each refusal names what is wrong and leaves the caches as they were."""
    with ntio.load(smollm2_path, max_context=64) as m:
        cfg, w = m.config, m.engine.layers.block(0)
        kvs = [KVCache(cfg, 16, torch.float32, "cpu") for _ in range(2)]
        h = torch.randn(3, cfg.d_model)
        before = [kv.k.view(torch.int32).clone() for kv in kvs]  # bits: the empty caches may hold NaNs

        def rows(start: int, stop: int, kv: KVCache) -> SequenceRows:
            cos, sin = rope_tables(m.engine.globals.inv_freq, torch.arange(stop - start))
            mask = causal_mask(0, stop - start, "cpu")
            return SequenceRows(slice(start, stop), kv.k[0], kv.v[0], 0, (cos, sin), mask)

        def block(sequences: list[SequenceRows]) -> torch.Tensor:
            return ops.decoder_stack(h, [w.kernel_args], sequences, cfg.rms_eps,
                                     (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim), neox=False)

        with pytest.raises(ValueError, match=r"the sequences' rows \[1, 1\] do not split h's 3 rows"):
            block([rows(0, 1, kvs[0]), rows(1, 2, kvs[1])])
        with pytest.raises(ValueError, match="cache_k overlaps cache_k"):
            block([rows(0, 1, kvs[0]), rows(1, 3, kvs[0])])
        assert all(torch.equal(kv.k.view(torch.int32), k) for kv, k in zip(kvs, before))
        block([rows(0, 1, kvs[0]), rows(1, 3, kvs[1])])
        written = [(kv.k.view(torch.int32)[0] != k[0]).any(dim=(0, 2)) for kv, k in zip(kvs, before)]  # per position
        assert written[0].tolist()[:2] == [True, False] and written[1].tolist()[:3] == [True, True, False]


def test_batched_passes_refuse_policies_that_change_layers(smollm2_path):
    with ntio.load(smollm2_path, max_context=64) as m:
        m.policy = CosineSkipPolicy(0.99)
        kv = KVCache(m.config, 32, torch.float32, "cpu")
        with pytest.raises(NtioError, match="CosineSkipPolicy"):
            m.engine.forward_batch([Segment(torch.tensor([1, 2]), 0, kv)])
