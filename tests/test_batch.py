"""Batched passes (`Engine.forward_batch`, what `ntio serve` runs): several sequences, each in its own KV cache, in one
pass over the weights, against each sequence's own passes (`Engine.forward`): the same logits bit for bit, resident
and with every layer read from disk, when prefills and decode steps share a pass."""

from __future__ import annotations

import pytest
import torch

import ntio
from ntio.errors import NtioError
from ntio.policies.cosine_skip import CosineSkipPolicy
from ntio.runtime.engine import Segment
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


def test_batched_passes_refuse_policies_that_change_layers(smollm2_path):
    with ntio.load(smollm2_path, max_context=64) as m:
        m.policy = CosineSkipPolicy(0.99)
        kv = KVCache(m.config, 32, torch.float32, "cpu")
        with pytest.raises(NtioError, match="CosineSkipPolicy"):
            m.engine.forward_batch([Segment(torch.tensor([1, 2]), 0, kv)])
