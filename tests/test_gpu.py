"""CUDA paths: the same answers as on CPU, and streamed equals resident on the device. Skipped without a GPU;
`benches/gpu_check.sh` runs them on a machine that has one."""

from __future__ import annotations

import pytest
import torch

import ntio

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = "Streaming layers from disk lets a small machine run a model that does not fit in its memory, because"


@pytest.fixture(scope="module")
def cpu_logits(smollm2_path):
    m = ntio.load(smollm2_path, max_context=256, cpu_activations="float32")  # CUDA's products take float32 ones
    ids = m.encode_prompt(PROMPT)
    return ids, m.engine.forward(torch.tensor(ids), 0, all_logits=True)


def test_cuda_matches_cpu(smollm2_path, cpu_logits):
    ids, want = cpu_logits
    m = ntio.load(smollm2_path, max_context=256, device="cuda")
    got = m.engine.forward(torch.tensor(ids, device="cuda"), 0, all_logits=True).cpu()
    assert float((got - want).norm() / want.norm()) <= 1e-4


@pytest.mark.parametrize("options", [{"tiers": "B"}, {"tiers": "C"}, {"tiers": "A:0-9,B:10-19,C:20-29", "layer_group_size": 3},
                                     {"tiers": "C", "sync": True}])
def test_cuda_streamed_equals_resident(smollm2_path, options):
    ref = ntio.load(smollm2_path, max_context=256, device="cuda", tiers="A")
    ids = torch.tensor(ref.encode_prompt(PROMPT), device="cuda")
    want = ref.engine.forward(ids, 0, all_logits=True)
    want_tokens = ref.generate(ids.tolist(), max_new_tokens=8).token_ids
    m = ntio.load(smollm2_path, max_context=256, device="cuda", **options)
    try:
        assert torch.equal(m.engine.forward(ids, 0, all_logits=True), want)
        assert m.generate(ids.tolist(), max_new_tokens=8).token_ids == want_tokens
        assert m.stats.summary()["bytes_h2d_per_token"] > 0
    finally:
        m.close()


def test_gpu_budget_too_small_says_minimum(smollm2_path):
    with pytest.raises(ntio.NtioError, match="^gpu_memory_budget .* at least"):
        ntio.load(smollm2_path, max_context=256, device="cuda", gpu_memory_budget="10MB")


def test_peak_device_memory_stays_under_budget(smollm2_path):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    budget = 200_000_000  # above the 185.56 MiB minimum ntio computes for this model and context
    m = ntio.load(smollm2_path, max_context=256, device="cuda", gpu_memory_budget=budget)
    assert m.plan.counts["A"] < 30  # the budget forces streaming
    m.generate("The capital of France is", max_new_tokens=8)
    assert torch.cuda.max_memory_allocated() - base <= budget
    m.close()
