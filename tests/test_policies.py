"""The load-policy seam: what a policy decides is exactly what is read and computed.

Oracles: the whole-layer read plan (`plan_layer_read`, what the loader read before the seam existed) for bytes,
and Hugging Face transformers on the same GGUF in float32, with the same layer removed or the same FFN neurons
zeroed, for logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import gguf
import pytest
import torch

import ntio
from ntio.formats.model_file import plan_layer_read
from ntio.policies.base import LOAD_ALL, SKIP, LoadDecision, LoadPolicy, Observation
from ntio.policies.dense import DensePolicy
from references import rel_l2

pytest.importorskip("transformers")  # the oracle (tests/references.py)

PROMPT = "The quick brown fox jumps over the lazy dog because"


class ReaderSpy:
    """Wraps the loader's Rust reader and records the extents of every read submitted."""

    def __init__(self, reader) -> None:
        self._reader, self.submitted = reader, []

    def submit(self, extents, slot, checks=None):
        self.submitted.append(list(extents))
        return self._reader.submit(extents, slot, checks)


@dataclass
class Scripted(LoadPolicy):
    """Decides from a table (layer -> decision); records every question and observation."""

    table: dict[int, LoadDecision] = field(default_factory=dict)
    unwanted: frozenset[int] = frozenset()  # layers it changes its mind about after the read was submitted
    asked: list[tuple[int, int]] = field(default_factory=list)
    seen: list[Observation] = field(default_factory=list)

    def decide(self, layer: int, ahead: int) -> LoadDecision:
        self.asked.append((layer, ahead))
        return self.table.get(layer, LOAD_ALL)

    def still_wanted(self, layer: int, decision: LoadDecision) -> bool:
        return layer not in self.unwanted

    def observe(self, obs: Observation) -> None:
        self.seen.append(obs)


@torch.inference_mode()
def test_dense_policy_reads_exactly_the_whole_layer_plans(smollm2_path):
    """Before the seam, the loader read each layer's `plan_layer_read` extents: DensePolicy reads exactly those, and
    they cover every byte of the layer's tensors as gguf-py's own parse of the file places them (the independent
    check), with at most alignment padding around them."""
    m = ntio.load(smollm2_path, max_context=64, tiers="C", prefetch_depth=2)
    assert isinstance(m.loader.policy, DensePolicy)
    spy = m.loader.reader = ReaderSpy(m.loader.reader)
    ids = torch.tensor(m.encode_prompt(PROMPT))
    m.stats.reset()
    m.engine.forward(ids, 0)
    n_layers = m.config.n_layers
    plans = [plan_layer_read(m.file, layer) for layer in range(n_layers)]
    # Reads in layer order, then the streamed head's chunks (wrapping into the next forward's read-ahead), each
    # exactly one layer's whole plan or one chunk of the head's rows.
    head = m.file.tensor("token_embd.weight")  # tied: the output head
    row = head.nbytes // head.shape[0]
    chunks = [[(head.offset + start * row, (stop - start) * row, 0)] for start, stop in m.loader._head_rows.values()]
    units = [plan[0] for plan in plans] + chunks
    assert sum(n for chunk in chunks for _, n, _ in chunk) == (head.nbytes if m.plan.head == "C" else 0)
    assert len(spy.submitted) == len(units) + m.loader.prefetch_depth
    for i, extents in enumerate(spy.submitted):
        assert extents == units[i % len(units)]
    per_unit = m.stats.summary()["bytes_read_per_layer"]
    assert per_unit == {unit: sum(n for _, n, _ in extents) for unit, extents in enumerate(units)}
    per_layer = {layer: per_unit[layer] for layer in range(n_layers)}
    reference = gguf.GGUFReader(smollm2_path)
    for layer in range(n_layers):
        tensors = [t for t in reference.tensors if t.name.startswith(f"blk.{layer}.")]
        extents = plans[layer][0]
        for t in tensors:
            start = int(t.data_offset)  # absolute file offset
            assert any(off <= start and start + int(t.n_bytes) <= off + n for off, n, _ in extents), t.name
        padding = per_layer[layer] - sum(int(t.n_bytes) for t in tensors)
        assert 0 <= padding < 2 * 4096 * len(extents)
    m.close()


@torch.inference_mode()
def test_skipped_layer_is_not_read_and_matches_transformers_without_it(smollm2_path, hf_smollm2):
    skip = 5
    policy = Scripted(table={skip: SKIP})
    m = ntio.load(smollm2_path, max_context=64, tiers="C", policy=policy, cpu_activations="float32")
    ids = m.encode_prompt(PROMPT)
    m.stats.reset()
    got = m.engine.forward(torch.tensor(ids), 0, all_logits=True)
    assert skip not in m.stats.summary()["bytes_read_per_layer"]
    assert bool(m.engine.kv.skipped[skip, : len(ids)].all()) and not bool(m.engine.kv.skipped[skip + 1].any())
    layers = hf_smollm2.model.layers
    try:
        hf_smollm2.model.layers = torch.nn.ModuleList([l for i, l in enumerate(layers) if i != skip])
        want = hf_smollm2(torch.tensor([ids]), use_cache=False).logits[0]
    finally:
        hf_smollm2.model.layers = layers
    assert rel_l2(got, want) <= 1e-4
    m.close()


@torch.inference_mode()
@pytest.mark.parametrize("tiers", ["A", "C"])
def test_ffn_row_subset_reads_less_and_matches_transformers_with_neurons_zeroed(smollm2_path, hf_smollm2, tiers):
    layer, d_ff = 7, 1536
    rows = ((0, 256), (512, 1024), (1400, 1536))
    policy = Scripted(table={layer: LoadDecision.ffn_rows(rows)})
    m = ntio.load(smollm2_path, max_context=64, tiers=tiers, policy=policy, cpu_activations="float32")
    ids = m.encode_prompt(PROMPT)
    m.stats.reset()
    got = m.engine.forward(torch.tensor(ids), 0, all_logits=True)
    decode = m.engine.forward(torch.tensor([11]), len(ids))  # T = 1 (the CPU kernels' path)
    if tiers == "C":
        read = m.stats.summary()["bytes_read_per_layer"]
        kept = sum(b - a for a, b in rows) / d_ff
        gate_up = 2 * m.loader.layout.blocks[layer]["ffn_gate"].nbytes
        assert read[layer] < read[layer + 1] - (1 - kept) * gate_up * 2 * 0.9  # two forwards' reads
    up = hf_smollm2.model.layers[layer].mlp.up_proj.weight
    saved = up.clone()
    keep = torch.zeros(d_ff, dtype=torch.bool)
    for a, b in rows:
        keep[a:b] = True
    try:
        up[~keep] = 0  # silu(gate) * 0: the neurons not loaded contribute nothing
        want = hf_smollm2(torch.tensor([ids + [11]]), use_cache=False).logits[0]
    finally:
        up.copy_(saved)
    assert rel_l2(got, want[:-1]) <= 1e-4
    assert rel_l2(decode, want[-1]) <= 1e-4
    m.close()


@torch.inference_mode()
def test_a_read_no_longer_wanted_is_skipped_like_a_skip(smollm2_path):
    """A policy that changes its mind after layer 9's read was submitted gets the same bits as one that skipped it
    from the start; the read itself did happen (its bytes are counted), but nothing waited on it or used it."""
    ids = torch.tensor(ntio.load(smollm2_path, max_context=64).encode_prompt(PROMPT))
    skipped = ntio.load(smollm2_path, max_context=64, tiers="C", policy=Scripted(table={9: SKIP}))
    dropped = ntio.load(smollm2_path, max_context=64, tiers="C", policy=Scripted(unwanted=frozenset({9})))
    waited = []
    real_wait = dropped.loader._wait
    # The waits for bytes to compute on (a read's later wait for its checks does not count: no bytes are used then).
    dropped.loader._wait = lambda handle, landed=False: (landed and waited.append(handle), real_wait(handle, landed))[1]
    for step in range(3):  # the dropped slot is reused by later reads
        a = skipped.engine.forward(ids, 0) if step == 0 else skipped.engine.forward(torch.tensor([7]), len(ids) + step - 1)
        b = dropped.engine.forward(ids, 0) if step == 0 else dropped.engine.forward(torch.tensor([7]), len(ids) + step - 1)
        assert torch.equal(a, b)
    assert bool(dropped.engine.kv.skipped[9, : len(ids) + 2].all())
    assert 9 in dropped.stats.summary()["bytes_read_per_layer"] and 9 not in skipped.stats.summary()["bytes_read_per_layer"]
    n_head_chunks = len(dropped.loader._head_rows)  # tiers C streams the head too
    assert len(waited) == 3 * (dropped.config.n_layers - 1 + n_head_chunks)  # every streamed read but layer 9's


@torch.inference_mode()
def test_decisions_come_within_the_horizon_and_observations_follow_the_residual_stream(smollm2_path):
    policy = Scripted()
    policy.wants_ffn_gate = True
    m = ntio.load(smollm2_path, max_context=64, tiers="A:0-9,C:10-29", prefetch_depth=3, policy=policy)
    assert policy.horizon == 3
    ids = torch.tensor(m.encode_prompt(PROMPT))
    m.engine.forward(ids, 0)
    m.engine.forward(torch.tensor([5]), len(ids))
    assert policy.asked and all(0 <= ahead <= policy.horizon for _, ahead in policy.asked)
    assert {layer for layer, _ in policy.asked} == set(range(m.config.n_layers))
    first = policy.seen[: m.config.n_layers]
    assert [o.layer for o in first] == list(range(m.config.n_layers))
    assert all(o.decision == LOAD_ALL and o.ffn_gate.shape == (ids.numel(), m.config.d_ff) for o in first)
    assert all(not torch.equal(o.h_in, o.h_out) for o in first)
    m.close()


def test_row_ranges_are_validated():
    with pytest.raises(ValueError, match="disjoint"):
        LoadDecision.ffn_rows([(0, 10), (5, 20)])
    with pytest.raises(ValueError, match="non-empty"):
        LoadDecision.ffn_rows([(3, 3)])


def test_subset_plans_land_where_the_whole_layer_plan_puts_them():
    from ntio.formats.model_file import plan_subset_read

    planned = [(8192, 16384, 0), (40960, 8192, 16384)]  # two aligned extents of a layer, packed back to back
    # Two ranges in one 4 KiB block merge; a range in the second extent keeps its offset within that extent.
    assert plan_subset_read(planned, [(9000, 100), (9500, 100), (45000, 10)]) == [(8192, 4096, 0),
                                                                                 (40960, 4096, 16384)]
    assert plan_subset_read(planned, [(20480, 4096)]) == [(20480, 4096, 12288)]
    for extent in plan_subset_read(planned, [(12000, 5000), (42000, 1)]):
        assert extent[0] % 4096 == 0 and extent[2] % 4096 == 0 and extent[2] - extent[0] in (-8192, 16384 - 40960)
    with pytest.raises(ValueError, match="not inside one extent"):
        plan_subset_read(planned, [(24000, 1000)])  # runs past the first extent's end
