"""Streaming: every tier mix, group size, sync/async mode and source (GGUF or ntio store) gives bit-identical
logits and tokens to resident generation on CPU float32; budgets are honoured; failures are clean."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import gguf
import pytest
import torch

import ntio
from ntio import _core
from ntio.errors import ModelFormatError, NtioError
from ntio.runtime.budget import plan_memory
from ntio.runtime.loader import auto_prefetch_depth, drafting_prefetch_depth
from ntio.formats.model_file import open_model_file
from ntio.formats.store import convert
from ntio.models.config import ModelConfig
from ntio.models.weights import WeightLayout
from ntio.synth import SynthSpec, write_synthetic_gguf
from ntio.runtime.tiers import parse_size, parse_tier_spec, plan_tiers, spread_resident

PROMPT = "Streaming layers from disk lets a small machine run a model that does not fit in its memory, because"


@pytest.fixture(scope="module")
def resident(smollm2_path):
    m = ntio.load(smollm2_path, max_context=256)
    ids = m.encode_prompt(PROMPT)
    assert len(ids) > 16  # the prompt pass takes the dequantize+matmul path, decode the CPU kernel path
    logits = m.engine.forward(torch.tensor(ids), 0, all_logits=True)
    tokens = m.generate(ids, max_new_tokens=8).token_ids
    return ids, logits, tokens


@pytest.fixture(scope="module")
def smollm2_store(smollm2_path, tmp_path_factory):
    return convert(smollm2_path, tmp_path_factory.mktemp("store") / "smollm2.ntio")


@pytest.mark.parametrize(
    "source,options",
    [
        ("gguf", {"tiers": "C"}),
        ("gguf", {"tiers": "C", "sync": True}),
        ("gguf", {"tiers": "C", "layer_group_size": 4}),
        ("gguf", {"tiers": "C", "layer_group_size": 30}),
        ("gguf", {"tiers": "A:0-9,C:10-29", "layer_group_size": 3}),
        ("gguf", {"tiers": "C:0-4,A:5-24,C:25-29", "layer_group_size": 2, "sync": True}),
        ("gguf", {"tiers": "B"}),
        ("gguf", {"tiers": "C", "io_backend": "pread"}),
        ("gguf", {"tiers": "C", "io_backend": "buffered", "layer_group_size": 7}),
        ("store", {"tiers": "A"}),
        ("store", {"tiers": "C"}),
        ("store", {"tiers": "A:0-14,C:15-29", "layer_group_size": 5, "sync": True}),
    ],
)
def test_streamed_equals_resident(resident, smollm2_path, smollm2_store, source, options):
    ids, want_logits, want_tokens = resident
    m = ntio.load(smollm2_path if source == "gguf" else smollm2_store, max_context=256, **options)
    try:
        logits = m.engine.forward(torch.tensor(ids), 0, all_logits=True)
        assert torch.equal(logits, want_logits)
        assert m.generate(ids, max_new_tokens=8).token_ids == want_tokens
        stats = m.stats.summary()
        n_c = m.plan.counts["C"]
        assert stats["layers_per_tier"]["C"] == n_c
        # Tier C is read at every use: a decode step reads exactly the C layers' bytes, and a streamed head's.
        streamed = m.plan.layers("C") + list(m.loader._head_rows)
        assert bool(m.loader._head_rows) == (m.plan.head == "C")
        want = sum(m.loader._reads[i].nbytes for i in streamed)
        assert stats["bytes_read_per_token"] == want
    finally:
        m.close()


def test_synthetic_mixed_types_streamed_equals_resident(tmp_path):
    spec = SynthSpec(n_layers=4, d_model=256, d_ff=512, n_heads=8, n_kv_heads=2, seed=3, part_types={
        "attn_q": gguf.GGMLQuantizationType.Q4_K, "attn_v": gguf.GGMLQuantizationType.Q6_K,
        "ffn_down": gguf.GGMLQuantizationType.Q5_K, "ffn_up": gguf.GGMLQuantizationType.Q8_0},
        output_type=gguf.GGMLQuantizationType.Q5_0)
    path = write_synthetic_gguf(tmp_path / "mixed.gguf", spec)
    ids = torch.randint(0, spec.vocab_size, (21,), generator=torch.Generator().manual_seed(0))
    want = ntio.load(path, max_context=64).engine.forward(ids, 0, all_logits=True)
    for options in ({"tiers": "C"}, {"tiers": "A:0-1,C:2-3", "layer_group_size": 2, "sync": True}):
        m = ntio.load(path, max_context=64, **options)
        assert torch.equal(m.engine.forward(ids, 0, all_logits=True), want)
        m.close()


def test_spec_interface_load_evict_prefetch(smollm2_path):
    m = ntio.load(smollm2_path, max_context=64, tiers="C", layer_group_size=3)
    ref = ntio.load(smollm2_path, max_context=64, tiers="A")
    loader = m.loader
    assert loader.num_groups == 10 and loader.layers_per_group == 3
    loader.prefetch_async(4)
    loader.sync()
    blocks = loader.load_group(4)
    assert [b.w_down.raw.numel() for b in blocks] == [ref.loader.block(i).w_down.raw.numel() for i in (12, 13, 14)]
    for layer, block in zip((12, 13, 14), blocks):
        resident = ref.loader.block(layer).w_down
        plain = resident.raw.clone()  # resident Q4_1 rows may be interleaved (ops.interleave_rows): back to rows
        if resident.interleaved:
            _core.interleave(plain.numpy(), resident.kernel_type, *resident.shape, inverse=True)
        assert not block.w_down.interleaved and torch.equal(block.w_down.raw, plain)
    loader.evict_group(4)
    m.close()


def test_default_read_ahead_keeps_bytes_in_flight(smollm2_path):
    # Groups of 2,220,032 bytes (a 2,216,448-byte layer, 4 KiB-aligned): ceil(24 MiB / that) = 12 read ahead.
    assert auto_prefetch_depth(2_220_032) == 12
    assert auto_prefetch_depth(123 << 20) == 1  # large layers: double buffering
    assert auto_prefetch_depth(64 << 10) == 16  # tiny layers: capped
    m = ntio.load(smollm2_path, max_context=64, tiers="C")
    assert m.loader.prefetch_depth == 12 and len(m.loader._slots) == 13
    m.close()
    m = ntio.load(smollm2_path, max_context=64, tiers="C", layer_group_size=6)
    assert m.loader.prefetch_depth == 2  # 13.3 MB groups
    m.close()
    for depth in (0, 32):  # 30 layers and the head: 31 groups
        with pytest.raises(NtioError, match=rf"^prefetch_depth must be in 1\.\.31 \(the groups of a pass\), got "
                                            rf"{depth}"):
            ntio.load(smollm2_path, max_context=64, tiers="C", prefetch_depth=depth)
    with pytest.raises(NtioError, match="^prefetch_depth reads ahead, which sync=True turns off"):
        ntio.load(smollm2_path, max_context=64, tiers="C", prefetch_depth=2, sync=True)


def test_a_drafter_reads_ahead_through_its_drafting_where_the_tiers_are_given(smollm2_path):
    """With a drafter and tiers given, the default read-ahead covers DRAFTING_READ_AHEAD_BYTES, at most every
    streamed group but the one computing; the deepest that fits the budget, the head staying resident; an automatic
    plan and a read-ahead asked for keep theirs."""
    layout = WeightLayout(open_model_file(smollm2_path), ModelConfig.from_gguf(open_model_file(smollm2_path)))
    plan = lambda **options: plan_memory(layout, cuda=False, kv_dtype=torch.float32, max_context=64, **options)
    assert drafting_prefetch_depth(2_220_032, 30) == 29  # 256 MiB would be 121 groups: all 29 others
    assert drafting_prefetch_depth(123 << 20, 28) == 3 and drafting_prefetch_depth(123 << 20, 1) == 1
    assert plan(tiers="C", drafting=True).prefetch_depth == 29
    assert plan(tiers="A:0-9,C:10-29", drafting=True).prefetch_depth == 19  # twenty streamed groups
    assert plan(tiers="A:0-19,C:20-29", drafting=True).prefetch_depth == 12  # never shallower than the default
    assert plan(tiers="C").prefetch_depth == plan(tiers="C", drafting=True, prefetch_depth=12).prefetch_depth == 12
    assert plan(tiers="C", drafting=True, sync=True).prefetch_depth == 0
    assert plan(drafting=True).prefetch_depth == 12  # auto: the RAM goes to resident layers
    # A budget 10 slots short of the deepest read-ahead: 19 groups ahead, the output head still resident.
    deepest = plan(tiers="C", drafting=True).report()["total"]
    tight = plan(tiers="C", drafting=True, ram_budget=deepest - 10 * 2_220_032)
    assert tight.prefetch_depth == 19 and tight.plan.head == "A"
    with ntio.load(smollm2_path, max_context=64, tiers="C", draft=smollm2_path) as m:
        assert m.loader.prefetch_depth == 29 and len(m.loader._slots) == 30
        # What lands before a verify pass: 29 of its 30 groups (the round's cost, `PassCost`, counts it).
        assert m.loader.read_ahead_share == m._draft_length.passes.ahead == pytest.approx(29 / 30)


def test_streamed_decode_allocates_nothing_weight_sized(smollm2_path):
    """Steady-state decode reads each layer into a reused staging slot and computes from its bytes: per token, the
    only allocations are activations, none bigger than the logits, a few MB in all (the token reads 66 MB)."""
    from torch.profiler import ProfilerActivity, profile

    m = ntio.load(smollm2_path, max_context=64, tiers="C")
    ids = m.encode_prompt(PROMPT)[:8]
    logits, pos = m.engine.forward(torch.tensor(ids), 0), len(ids)
    for _ in range(2):  # the first decode steps create the kernels' and prefetches' state
        logits, pos = m.engine.forward(torch.tensor([int(logits.argmax())]), pos), pos + 1
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(4):
            logits, pos = m.engine.forward(torch.tensor([int(logits.argmax())]), pos), pos + 1
    m.close()
    sizes = [abs(e.cpu_memory_usage) for e in prof.events() if e.name == "[memory]"]
    assert len(sizes) > 100  # the profiler saw the activations
    assert max(sizes) <= m.config.vocab_size * 4  # the smallest dequantized matrix (k: 192x576 fp32) is 442 KB
    assert sum(sizes) / 4 < 0.1 * m.stats.summary()["bytes_read_per_token"]


def test_budget_too_small_says_minimum(smollm2_path):
    with pytest.raises(NtioError, match=r"^ram_budget .* too small: .* at least [0-9.]+ MiB"):
        ntio.load(smollm2_path, max_context=256, ram_budget="20MB")


def test_budget_picks_tiers(smollm2_path):
    m = ntio.load(smollm2_path, max_context=256, ram_budget="110MB")
    counts = m.plan.counts
    assert counts["A"] > 0 and counts["C"] > 0 and counts["B"] == 0  # partly resident, the rest streamed
    resident = m.plan.layers("A")
    gaps = [b - a for a, b in zip(resident, resident[1:])]
    assert max(gaps) - min(gaps) <= 1 and resident[0] < 30 / counts["A"]  # spaced evenly among the streamed ones
    m.close()


def test_resident_layers_are_spaced_evenly_among_streamed_ones():
    def spread(tiers: str, sizes: list[int] | None = None, room: int = 1 << 40) -> str:
        return "".join(spread_resident(list(tiers), sizes or [1] * len(tiers), room))

    assert spread("AAACCCCCCCCCCCCCCCCC") == "CCCACCCCCCACCCCCACCC"
    assert spread("AAAAAAAAAAACCCCCCCCC") == "ACACACACACAACACACACA"
    assert spread("AC") == "CA" and spread("AAA") == "AAA"
    # Layers of two sizes, as the greedy fill left them (100 + 90 = the room): the even positions 2 and 6 would take
    # 200, so the first moves to its smaller neighbour 1; if nothing smaller is near enough, the plan stays.
    sizes = [100, 90, 100, 100, 100, 90, 100, 100]
    assert spread("AACCCCCC", sizes, 190) == "CACCCCAC"
    assert spread("AACCCCCC", sizes, 200) == "CCACCCAC"
    assert spread("AACCCCCC", [100, 100] + [100] * 6, 199) == "AACCCCCC"


_PEAK_SCRIPT = """
import gc, json, sys, torch, ntio
from ntio.formats.gguf_file import GGUFFile
from ntio.text.tokenizer import Tokenizer
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
Tokenizer.from_gguf(GGUFFile(sys.argv[1]))  # warm every import and lazy init before the baseline
gc.collect()
base = status('VmRSS:')
meta = (GGUFFile(sys.argv[1]), )
meta += (Tokenizer.from_gguf(meta[0]), )
metadata = status('VmRSS:') - base  # parsed metadata and tokenizer: outside the budget, like the interpreter
del meta
gc.collect()
m = ntio.load(sys.argv[1], max_context=256, ram_budget=sys.argv[2])
m.generate('The capital of France is', max_new_tokens=8)
print(json.dumps({'base': base, 'metadata': metadata, 'peak': status('VmHWM:'), 'tiers': m.plan.describe(),
                  'head': m.plan.head}))
"""


@pytest.mark.parametrize("size, head", [("110MB", "A"), ("80MB", "C")])
def test_peak_host_memory_stays_under_budget(smollm2_path, size, head):
    """The process's peak RSS grows by at most the budget (plus the parsed metadata and tokenizer), with the output
    head resident or, in the leaner budget, streamed (and the embedding rows read on demand)."""
    budget = parse_size(size, "--ram-budget")
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(smollm2_path), size], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert "C" in r["tiers"] and r["head"] == head
    assert r["metadata"] < 64e6
    grown = r["peak"] - r["base"] - r["metadata"]
    assert grown <= budget, f"peak grew by {grown / 1e6:.1f} MB over the {budget / 1e6} MB budget"


def test_truncated_mid_run_names_file_and_offset(smollm2_path, tmp_path):
    path = tmp_path / "shrinking.gguf"
    shutil.copy(smollm2_path, path)
    m = ntio.load(path, max_context=64, tiers="C", sync=True)
    ids = m.encode_prompt("Hello")
    m.generate(ids, max_new_tokens=2)
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(ModelFormatError, match=rf"{path.name}.*offset \d+"):
        m.generate(ids, max_new_tokens=2)
    m.close()


def test_deleted_mid_run_still_exact(smollm2_path, tmp_path, resident):
    ids, _, want_tokens = resident
    path = tmp_path / "vanishing.gguf"
    shutil.copy(smollm2_path, path)
    m = ntio.load(path, max_context=256, tiers="C")
    path.unlink()  # the reader holds the file open: reads keep returning the right bytes
    assert m.generate(ids, max_new_tokens=8).token_ids == want_tokens
    m.close()


def test_ctrl_c_drains_and_exits_cleanly(smollm2_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "ntio.cli", "generate", "-m", str(smollm2_path), "-p", "Once upon a time, in a small village by the sea,",
         "-n", "400", "--tiers", "C", "--ctx-size", "512"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # A suite started in the background of a shell without job control inherits SIGINT ignored; a user's
        # terminal does not.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Wait for the first generated text, then interrupt mid-generation.
    first = proc.stdout.read(1)
    assert first
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err


def test_tier_spec_and_sizes():
    assert parse_tier_spec("auto", 4) is None
    assert parse_tier_spec("c", 3) == ["C", "C", "C"]
    assert parse_tier_spec("AACB", 4) == ["A", "A", "C", "B"]
    assert parse_tier_spec("A:0-1,C:2-3", 4) == ["A", "A", "C", "C"]
    for bad, message in (("A:0-1", "layer 2"), ("AAC", "3 letters"), ("A:0-9", "outside"), ("X", "cannot read"),
                         ("A:0-2,C:2-3", "layer 2 is given a tier twice"), ("A:1-0,C:2-3", "run backwards")):
        with pytest.raises(NtioError, match=message):
            parse_tier_spec(bad, 4)
    assert parse_size("64MB", "--x") == 64_000_000 and parse_size("4GiB", "--x") == 4 << 30
    assert parse_size("1.5g", "--x") == 1_500_000_000
    with pytest.raises(NtioError, match="^ram_budget 'lots': cannot read"):
        parse_size("lots", "ram_budget")


def test_plan_fills_device_then_host_then_disk():
    layers = [100] * 6
    cpu = plan_tiers(layers, cuda=False, device_budget=0, ram_budget=650, reserved_device=0, reserved_ram=200,
                     staging_bytes=200, spread=False)
    assert cpu.tiers == ["A", "A"] + ["C"] * 4
    spread = plan_tiers(layers, cuda=False, device_budget=0, ram_budget=650, reserved_device=0, reserved_ram=200,
                        staging_bytes=200)
    assert spread.tiers == ["C", "A", "C", "C", "A", "C"]
    uneven = plan_tiers([100] * 5 + [90], cuda=False, device_budget=0, ram_budget=650, reserved_device=0,
                        reserved_ram=200, staging_bytes=200)
    assert uneven.tiers == ["C", "A", "C", "C", "A", "C"]  # spaced within the same room (spread_resident)
    gpu = plan_tiers(layers, cuda=True, device_budget=450, ram_budget=400, reserved_device=100, reserved_ram=0,
                     staging_bytes=150)
    assert gpu.tiers == ["A", "A", "B", "B", "C", "C"]
    assert plan_tiers(layers, cuda=False, device_budget=0, ram_budget=800, reserved_device=0, reserved_ram=200,
                      staging_bytes=200).tiers == ["A"] * 6
