"""The KV cache knows what it holds: token ids, per-layer progress, and positions a layer skipped."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import ntio
from ntio.policies.base import LOAD_ALL, SKIP, LoadDecision, LoadPolicy

PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def model(smollm2_path):
    return ntio.load(smollm2_path, max_context=128)


@torch.inference_mode()
def test_ids_follow_forward_crop_and_generation(model):
    kv = model.engine.kv
    ids = model.encode_prompt(PROMPT)
    model.engine.forward(torch.tensor(ids), 0)
    assert kv.ids == ids and kv.layer_length == [len(ids)] * model.config.n_layers
    model.engine.kv.crop(4)
    assert kv.ids == ids[:4] and set(kv.layer_length) == {4}
    assert kv.reusable_prefix(ids, limit=len(ids) - 1) == 4
    assert kv.reusable_prefix([ids[0], ids[1] + 1] + ids[2:], limit=len(ids)) == 1
    out = model.generate(ids, max_new_tokens=5)
    assert kv.ids == ids + out.token_ids[:-1]  # every token but the last went back through forward()
    with pytest.raises(ValueError, match="cannot crop"):
        kv.crop(kv.length + 1)


@torch.inference_mode()
def test_prefix_reuse_is_checked_by_ids_and_exact(model):
    """A second prompt sharing a prefix reuses it (fewer positions computed) and gives the same tokens as a fresh
    model; a prompt that differs early recomputes from there."""
    fresh = ntio.load(model.path, max_context=128)
    base = model.encode_prompt(PROMPT)
    model.generate(base, max_new_tokens=4)
    longer = base + model.encode_prompt(" there lived an old fisherman")
    assert model.engine.kv.reusable_prefix(longer, limit=len(longer) - 1) >= len(base)
    assert model.generate(longer, max_new_tokens=8).token_ids == fresh.generate(longer, max_new_tokens=8).token_ids
    changed = [base[0] + 1] + base[1:]
    assert model.engine.kv.reusable_prefix(changed, limit=len(changed) - 1) == 0


@dataclass
class FailAt(LoadPolicy):
    layer: int = 10
    armed: bool = False

    def decide(self, layer: int, ahead: int) -> LoadDecision:
        if self.armed and layer == self.layer:
            raise RuntimeError("injected")
        return LOAD_ALL


@torch.inference_mode()
def test_a_forward_that_stops_part_way_leaves_the_cache_valid(smollm2_path, model):
    policy = FailAt()
    m = ntio.load(smollm2_path, max_context=128, policy=policy)
    ids = model.encode_prompt(PROMPT)
    m.engine.forward(torch.tensor(ids[:5]), 0)
    policy.armed = True
    with pytest.raises(RuntimeError, match="injected"):
        m.engine.forward(torch.tensor(ids[5:]), 5)
    kv = m.engine.kv
    assert kv.length == 5 and kv.layer_length[:10] == [len(ids)] * 10 and kv.layer_length[10:] == [5] * 20
    policy.armed = False
    got = m.engine.forward(torch.tensor(ids[5:]), 5)
    assert set(kv.layer_length) == {len(ids)}
    model.engine.forward(torch.tensor(ids[:5]), 0)  # the same steps in a model that never failed
    assert torch.equal(got, model.engine.forward(torch.tensor(ids[5:]), 5))


@dataclass
class SkipPrompt(LoadPolicy):
    """Skips `layer` while the prompt runs, computes it afterwards."""

    layer: int = 3
    prompt_done: bool = False

    def decide(self, layer: int, ahead: int) -> LoadDecision:
        return SKIP if layer == self.layer and not self.prompt_done else LOAD_ALL


@torch.inference_mode()
def test_positions_a_layer_skipped_are_masked_out_of_its_attention(smollm2_path):
    """After the prompt skipped layer 3, a decode step in layer 3 attends only to positions it computed: whatever
    the cache holds at the skipped positions cannot change the result."""
    results = []
    for garbage in (0.0, 1e4):
        policy = SkipPrompt()
        m = ntio.load(smollm2_path, max_context=64, policy=policy)  # resident: decided just before each layer
        ids = m.encode_prompt(PROMPT)
        m.engine.forward(torch.tensor(ids), 0)
        kv = m.engine.kv
        assert bool(kv.skipped[3, : len(ids)].all()) and not bool(kv.skipped[4].any())
        kv.k[3, :, : len(ids)] = garbage
        kv.v[3, :, : len(ids)] = garbage
        policy.prompt_done = True
        decoded = m.engine.forward(torch.tensor([41]), len(ids))  # T = 1: no causal mask, only the skip mask
        results.append(torch.cat((decoded[None], m.engine.forward(torch.tensor([42, 43]), len(ids) + 1, all_logits=True))))
        assert not bool(kv.skipped[3, len(ids) :].any())
        kv.crop(2)
        assert bool(kv.skipped[3, :2].all()) and not bool(kv.skipped[:, 2:].any())  # marks go with their positions
    assert torch.equal(results[0], results[1])


@torch.inference_mode()
def test_a_partition_is_pieces_of_the_caches_memory_that_do_not_overlap(model):
    """A server's slots: caches over the engine cache's own K/V memory, each contiguous, none overlapping another;
    the engine's cache forgets what it held, and asking for more positions than it has is refused."""
    kv = model.engine.kv
    model.engine.forward(torch.tensor(model.encode_prompt(PROMPT)), 0)
    pieces = kv.partition(3, 40)
    assert kv.length == 0 and [p.capacity for p in pieces] == [40] * 3
    for whole, part in ((kv.k, lambda p: p.k), (kv.v, lambda p: p.v)):
        spans = sorted((part(p).data_ptr(), part(p).data_ptr() + part(p).nbytes) for p in pieces)
        assert all(part(p).is_contiguous() for p in pieces)
        assert whole.data_ptr() <= spans[0][0] and spans[-1][1] <= whole.data_ptr() + whole.nbytes
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    with pytest.raises(ValueError, match="do not fit"):
        kv.partition(3, 43)


def test_cpu_memory_is_huge_page_aligned_zeros_and_kept_by_the_model(model):
    """On the CPU, K and V of KV_HUGE_MIN bytes are pieces of one huge-page arena (`kv_memory`): a 2 MiB-aligned
    start, zeros before any write, the shape and dtype asked; and the loader's resident layers share one arena too."""
    from ntio import _core
    from ntio.runtime.kv_cache import kv_memory

    shape = (4, 8, 4096, 128)  # KV_HUGE_MIN bytes in float16
    k, v = kv_memory(shape, torch.float16, "cpu")
    assert k.shape == v.shape == shape and k.dtype == v.dtype == torch.float16
    assert k.data_ptr() % _core.HUGE_PAGE == 0 and v.data_ptr() == k.data_ptr() + k.numel() * 2
    assert not k.any() and not v.any()
    k[3, 7, 4095, 127] = 1.0  # writable, and not v's memory
    assert not v.any()
    # The layers' bytes lie back to back in the arena, each at a 4096 boundary.
    reads = model.loader._reads
    starts = [model.loader._resident[i].w_down.raw.data_ptr() - reads[i].tensor_offsets["ffn_down"]
              for i in range(model.config.n_layers)]
    assert [b - a for a, b in zip(starts, starts[1:])] == [-(-r.nbytes // 4096) * 4096 for r in reads[:-1]]
