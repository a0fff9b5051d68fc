"""Bigger than RAM: the lean parts of a plan give the same answers as the resident model, stay verified, and the
plan says what each part costs (`ntio plan`).

The output head streamed in row chunks and token-embedding rows read on demand must give bit-identical logits and
tokens (the same bytes through the same kernels); perplexity, scored through a running log-sum-exp over head chunks,
must agree with torch's cross-entropy over the whole logits. Oracles: the resident model, torch's cross_entropy."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ntio
from ntio import _core
from ntio.errors import ModelFormatError, OptionError
from ntio.formats.store import StoreFile, convert
from ntio.formats.model_file import open_model_file
from ntio.kernels.cpu_kernels import KernelChoice
from ntio.models.config import ModelConfig
from ntio.models.weights import WeightLayout
from ntio.kernels import ops
from ntio.runtime.budget import ROOMY_CONTEXT, memory_needs, minimum, plan_memory
from ntio.runtime.engine import MIN_PREFILL_CHUNK
from ntio.runtime.memory import (HEADROOM_MIN, LIBRARY_FLOOR, LIBRARY_ROOM, READ_AHEAD_WINDOWS, RamRoom,
                                 libraries_read_ahead)
from ntio.runtime.tiers import format_size, parse_tier_spec
from ntio.synth import SynthSpec, write_synthetic_gguf
from tests.test_cli import assert_user_error, ntio as run_cli

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """A small synthetic model with an untied head (Q6_K) and embedding (Q8_0): both can leave RAM."""
    spec = SynthSpec(n_layers=4, d_model=256, d_ff=512, n_heads=8, n_kv_heads=2, vocab_size=4096, seed=5,
                     output_type=gguf.GGMLQuantizationType.Q6_K)
    return write_synthetic_gguf(tmp_path_factory.mktemp("untied") / "untied.gguf", spec)


@pytest.fixture(scope="module")
def smollm2_store(smollm2_path, tmp_path_factory):
    return convert(smollm2_path, tmp_path_factory.mktemp("store") / "smollm2.ntio")


def lean(path, **options):
    """`options` (forced tiers) with the smallest RAM budget they fit in: the leanest plan's minimum plus the forced
    resident layers, which leaves no room for the output head or the token embedding."""
    g = open_model_file(path)
    layout = WeightLayout(g, ModelConfig.from_gguf(g))
    needs = plan_memory(layout, cuda=False, kv_dtype=torch.float32, max_context=128,
                        group_size=options.get("layer_group_size", 1), sync=options.get("sync", False)).needs
    tiers = parse_tier_spec(options["tiers"], layout.cfg.n_layers)
    resident = sum(n for n, t in zip(needs.layers, tiers) if t == "A")
    return {**options, "ram_budget": minimum(needs) + resident}


def _same_answers(path, ids, **lean):
    ref = ntio.load(path, max_context=128, tiers="A")
    m = ntio.load(path, max_context=128, **lean)
    try:
        assert torch.equal(m.engine.forward(ids, 0, all_logits=True), ref.engine.forward(ids, 0, all_logits=True))
        tokens = m.generate(ids.tolist(), max_new_tokens=8).token_ids
        assert tokens == ref.generate(ids.tolist(), max_new_tokens=8).token_ids
        return m
    finally:
        ref.close()


@pytest.mark.parametrize("options", [{"tiers": "C"}, {"tiers": "A:0-1,C:2-3", "layer_group_size": 2},
                                     {"tiers": "C", "sync": True}])
def test_untied_head_streamed_and_embedding_on_disk_equal_resident(untied, options):
    ids = torch.randint(0, 4096, (19,), generator=torch.Generator().manual_seed(1))
    m = _same_answers(untied, ids, **lean(untied, **options))
    assert (m.plan.head, m.plan.embedding) == ("C", "C")
    assert m.engine.globals.output is None and len(m.loader._head_rows) >= 1
    stats = m.stats.summary()
    head_units = list(m.loader._head_rows)
    assert all(stats["bytes_read_per_layer"][u] > 0 for u in head_units)  # the head was read at every forward
    m.close()


def test_tied_head_streams_with_the_embedding_rows_from_one_table(smollm2_path):
    m = ntio.load(smollm2_path, max_context=128, tiers="C")
    ids = torch.tensor(m.encode_prompt(PROMPT))
    m.close()
    m = _same_answers(smollm2_path, ids, **lean(smollm2_path, tiers="C"))
    assert (m.plan.head, m.plan.embedding) == ("C", "C") and len(m.loader._head_rows) > 1
    # Every chunk lands where its file offset falls in a 4 KiB block (O_DIRECT reads it in place, no bounce copy;
    # chunks start at 612-byte row boundaries, Q8_0 rows of 576), and fits a slot sized for the layers.
    loader = m.loader
    layer_slot = max(loader.groups[g].nbytes for g in range(loader.num_groups))
    for unit in loader._head_rows:
        (file_offset, length, dest), = loader._reads[unit].extents
        assert dest == file_offset % 4096 and dest + length <= loader.groups[loader._group_of[unit]].nbytes
        assert loader.groups[loader._group_of[unit]].nbytes <= layer_slot
    assert any(loader._reads[u].extents[0][0] % 4096 for u in loader._head_rows)  # some start unaligned
    m.close()


def test_forced_tiers_keep_the_head_and_embedding_resident_where_they_fit(untied):
    m = ntio.load(untied, max_context=128, tiers="C")
    assert (m.plan.head, m.plan.embedding) == ("A", "A") and not m.loader._head_rows
    m.close()
    budget = lean(untied, tiers="C")["ram_budget"]
    needs = m.memory.needs
    # Room for the head (and no staging for it), not the table: embedding rows read from disk beside a resident
    # head give the resident run's logits and tokens.
    ids = torch.randint(0, 4096, (19,), generator=torch.Generator().manual_seed(3))
    m = _same_answers(untied, ids, tiers="C", ram_budget=budget + needs.head + needs.largest_group())
    assert (m.plan.head, m.plan.embedding) == ("A", "C")
    m.close()


def test_auto_plan_streams_the_head_when_the_budget_is_lean(untied):
    """A budget just above the minimum: the head cannot stay, layers fill what is left."""
    probe = ntio.load(untied, max_context=128, tiers="A", prefetch_depth=1)  # staging: two layers, not the model
    budget = minimum(probe.memory.needs) + 2 * probe.memory.needs.layers[0]
    probe.close()
    m = ntio.load(untied, max_context=128, ram_budget=budget, prefetch_depth=1)
    assert m.plan.head == "C" and m.plan.embedding == "C" and m.plan.counts["A"] == 2
    report = m.memory.report()
    assert report["total"] <= budget and report["parts"]["output head"] == 0
    m.close()


def test_scoring_with_a_streamed_head_matches_cross_entropy(untied):
    ids = torch.randint(0, 4096, (40,), generator=torch.Generator().manual_seed(2))
    ref = ntio.load(untied, max_context=128, tiers="A")
    logits = ref.engine.forward(ids, 0, all_logits=True)
    want = F.cross_entropy(logits[:-1], ids[1:], reduction="none")
    for options in ({"tiers": "A"}, lean(untied, tiers="C")):
        m = ntio.load(untied, max_context=128, **options)
        assert m.plan.head == ("C" if options["tiers"] == "C" else "A")
        got = m.engine.nll(ids, 0)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        m.close()


def test_a_row_changed_after_load_is_caught_naming_the_table(smollm2_store, tmp_path):
    """Embedding rows and head chunks read later are checked against hashes taken when the store was opened."""
    bad = shutil.copy(smollm2_store, tmp_path / "bad.ntio")
    options = lean(bad, tiers="C")
    m = ntio.load(bad, max_context=128, **options)
    assert m.plan.embedding == "C"
    ids = m.encode_prompt(PROMPT)
    info = StoreFile(bad).tensor("token_embd.weight")
    row = info.nbytes // info.shape[0]
    with open(bad, "r+b") as f:  # flip a byte of the first prompt token's row
        f.seek(info.offset + ids[0] * row + 5)
        byte = f.read(1)[0]
        f.seek(info.offset + ids[0] * row + 5)
        f.write(bytes([byte ^ 0x20]))
    with pytest.raises(ModelFormatError, match=r"bad\.ntio: checksum mismatch in tensor 'token_embd\.weight'"):
        m.generate(ids, max_new_tokens=2)
    m.close()
    with pytest.raises(ModelFormatError, match=r"checksum mismatch in tensor 'token_embd\.weight'"):
        ntio.load(bad, max_context=128, **options)  # and at load: the whole table is checked first


def test_default_context_is_4096_and_shrinks_to_fit_with_a_notice(smollm2_path, caplog):
    m = ntio.load(smollm2_path)
    assert m.engine.kv.capacity == 4096 and m.config.context_length == 8192
    m.close()
    with caplog.at_level(logging.WARNING, logger="ntio"):
        m = ntio.load(smollm2_path, ram_budget="150MB")
    assert 0 < m.engine.kv.capacity < 4096
    assert any(f"the context is {m.engine.kv.capacity} tokens, not 4096" in r.message for r in caplog.records)
    m.close()


def test_plan_command_text_and_json(smollm2_path):
    out = run_cli("plan", str(smollm2_path), "--ctx-size", "512", "--ram-budget", "120MB", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["context"] == 512 and report["ram_budget"] == 120_000_000 and report["budget_source"] == "ram_budget"
    assert report["total"] <= 120_000_000 and report["minimum"] <= report["total"]
    assert report["total"] == sum(report["parts"].values())
    n_layers = sum(report["layers_per_tier"].values())
    assert n_layers == 30 and report["layers_per_tier"]["C"] > 0 and report["bytes_read_per_token"] > 0
    # float32 activations would dequantize 512-token passes into a scratch this budget cannot hold: the plan halves
    # the passes down to the kernels' rows, where nothing is dequantized
    floats = json.loads(run_cli("plan", str(smollm2_path), "--ctx-size", "512", "--ram-budget", "120MB",
                                "--cpu-activations", "float32", "--json").stdout)
    assert report["prefill_chunk"] == 512 and floats["prefill_chunk"] == ops.KERNEL_ROWS
    text = run_cli("plan", str(smollm2_path), "--ctx-size", "512", "--ram-budget", "120MB")
    assert text.returncode == 0 and "minimum, every layer streamed" in text.stdout and "kv cache" in text.stdout
    small = run_cli("plan", str(smollm2_path), "--ctx-size", "512", "--ram-budget", "20MB")
    # the minimum, and what to change as the CLI spells it, less what the plan already does
    assert_user_error(small, "--ram-budget 19.07 MiB is too small: streaming this model needs at least",
                      "a smaller --ctx-size or --kv-dtype float16 shrinks the KV cache, --sync reads into one staging "
                      "slot)")
    lean = run_cli("plan", str(smollm2_path), "--ctx-size", "512", "--ram-budget", "20MB", "--kv-dtype", "float16",
                   "--sync")
    assert_user_error(lean, "slots; a smaller --ctx-size shrinks the KV cache)")
    # --sync plans one staging slot: no read-ahead, a smaller minimum
    synced = json.loads(run_cli("plan", str(smollm2_path), "--ctx-size", "512", "--ram-budget", "120MB", "--sync",
                                "--json").stdout)
    assert synced["prefetch_depth"] == 0 and synced["minimum"] < report["minimum"]


def test_piece_hashes_match_the_file_bytes_in_one_pass(smollm2_store):
    """Chunk and row hashes taken while the table is verified whole agree with hashing the file's bytes directly,
    for chunk sizes that divide the hashing window and that do not; a tied table streamed as head chunks gets its
    row hashes from that same pass."""
    m = ntio.load(smollm2_store, max_context=128, **lean(smollm2_store, tiers="C"))
    info = m.loader.layout.token_embd
    assert set(m.loader._row_checksums) == {info.name}  # hashed with the head's chunks, not read again
    row = info.nbytes // info.shape[0]
    data = np.fromfile(smollm2_store, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    for chunk in (row * 7, row * 3571, row * 40000, info.nbytes):
        chunks, rows = m.loader.piece_checksums(info, chunk, row)
        assert chunks == [_core.checksum(data[i : i + chunk]) for i in range(0, data.size, chunk)]
        assert rows == [_core.checksum(data[i : i + row]) for i in range(0, data.size, row)]
    m.close()


def _layout(path):
    g = open_model_file(path)
    return WeightLayout(g, ModelConfig.from_gguf(g))


@pytest.mark.skipif(not KernelChoice(isa="best").takes_tiles, reason="needs a CPU with AMX")
def test_amx_tiles_layouts_of_the_ffn_input_are_budgeted(smollm2_path):
    """Under AMX tiles, a pass's 8-bit codes of the FFN's input are also laid out for them (Q4_K's by pair of groups,
    2 bytes an element; Q6_K's and Q8_0's by token, 1): 3 bytes per element of each token's d_ff more in the plan
    than under AVX-512's products, and the same with float32 activations, which take no tiles."""
    layout = _layout(smollm2_path)
    needs = {(isa, int8): memory_needs(layout, 512, torch.float32, 1, 2, 64, cuda=False,
                                       kernels=KernelChoice(isa=isa, int8=int8))
             for isa in ("amx", "avx512") for int8 in (True, False)}
    assert needs["amx", True].activations - needs["avx512", True].activations == 64 * 3 * layout.cfg.d_ff
    assert needs["amx", False].activations == needs["avx512", False].activations


def test_a_cpu_forward_through_the_kernels_dequantizes_nothing_so_its_plan_holds_no_scratch(smollm2_path,
                                                                                            monkeypatch):
    """8-bit activations take any number of rows through the vector kernels; float32 ones, and the scalar fallback's
    8-bit ones, up to KERNEL_ROWS."""
    layout = _layout(smollm2_path)
    rows = ops.KERNEL_ROWS
    choices = {"int8": KernelChoice(), "float32": KernelChoice(int8=False), "scalar": KernelChoice(isa="scalar")}
    needs = {(chunk, cuda, name): memory_needs(layout, 512, torch.float32, 1, 2, chunk, cuda=cuda, kernels=choice)
             for chunk in (rows, 2 * rows) for cuda in (False, True) for name, choice in choices.items()}
    # (what AMX tiles' layouts of the FFN's input take per token, on CPU only: see the next test)
    tiles = {name: 3 * layout.cfg.d_ff if choice.takes_tiles else 0 for name, choice in choices.items()}
    for name in choices:
        assert (needs[rows, True, name].activations - needs[rows, False, name].activations
                == ops.SCRATCH_BYTES - rows * tiles[name])
    assert (needs[2 * rows, True, "int8"].activations - needs[2 * rows, False, "int8"].activations
            == ops.SCRATCH_BYTES - 2 * rows * tiles["int8"])
    for name in ("float32", "scalar"):  # longer chunks dequantize
        assert needs[2 * rows, True, name].activations == needs[2 * rows, False, name].activations
    # and so do dense weights' (float32 activations in row kernels, which a GEMM beats)
    dense = gguf.GGMLQuantizationType.F16
    assert ops.dequantizes(2 * rows, [dense], choices["int8"], cuda=False)
    assert not ops.dequantizes(rows, [dense], choices["int8"], cuda=False)
    # The claim itself: such prompts and decode steps leave the engine's scratch untouched, and longer prompts with
    # float32 activations or scalar kernels use it.
    for isa, activations, prompt, scratch_used in (("best", "int8", 2 * rows + 5, False),
                                                   ("best", "float32", rows, False),
                                                   ("best", "float32", rows + 1, True),
                                                   ("scalar", "int8", rows + 1, True)):
        monkeypatch.setenv("NTIO_CPU_KERNELS", isa)
        with ntio.load(smollm2_path, max_context=256, tiers="C", cpu_activations=activations) as m:
            m.generate(list(range(100, 100 + prompt)), max_new_tokens=3)
            assert (m.engine.scratch.nbytes > 0) == scratch_used, (isa, activations, prompt)


def _room(default_budget: int, own_file_pages: int) -> RamRoom:
    """A cgroup's room whose default budget is `default_budget` (HEADROOM_MIN below what is available)."""
    available = default_budget + HEADROOM_MIN
    return RamRoom(available, "cgroup v1 /fake", 600_000_000, 400_000_000, own_file_pages)


def test_a_tight_default_budget_takes_library_pages_for_the_leanest_plan_with_a_notice(smollm2_path, monkeypatch):
    layout = _layout(smollm2_path)
    plan = lambda **budget: plan_memory(layout, cuda=False, kv_dtype=torch.float32, max_context=512, **budget)
    # The measured room leaves 10 MB, but this process's own library pages (500 MB) can be given up.
    monkeypatch.setattr("ntio.runtime.budget.ram_room", lambda: _room(10_000_000, 500_000_000))
    tight = plan()
    lean = tight.report()["minimum"]
    assert 10_000_000 < lean == tight.budget.ram == tight.report()["total"]  # the least it needs, no more
    assert tight.prefill_chunk == MIN_PREFILL_CHUNK and tight.report()["layers_per_tier"]["C"] == 30
    assert tight.notice.startswith(f"memory is tight: the RAM budget is {format_size(lean)}, not the 9.54 MiB")
    # No library pages to give up (they keep LIBRARY_FLOOR): the one-line refusal with the minimum.
    monkeypatch.setattr("ntio.runtime.budget.ram_room", lambda: _room(10_000_000, 0))
    with pytest.raises(OptionError, match=rf"ram_budget .* is too small: streaming this model needs at least "
                                          rf"{format_size(lean)}"):
        plan()
    # A budget the user gives is never grown.
    with pytest.raises(OptionError, match=r"ram_budget 9.54 MiB is too small"):
        plan(ram_budget=10_000_000)


def test_a_tight_budget_leaves_the_libraries_more_where_the_context_can_shrink_instead(smollm2_path, monkeypatch):
    """With no context asked for, a budget grows into the libraries' pages only down to LIBRARY_ROOM, and the context
    shrinks to fit, down to ROOMY_CONTEXT; where less fits, or for a context asked for, down to LIBRARY_FLOOR (a
    streamed decode whose KV cache had filled thrashed on the libraries' code there)."""
    layout = _layout(smollm2_path)
    plan = lambda **options: plan_memory(layout, cuda=False, kv_dtype=torch.float32, **options)
    monkeypatch.setattr("ntio.runtime.budget.ram_room", lambda: _room(10_000_000, 500_000_000))
    lean = {c: plan(max_context=c).report()["minimum"] for c in (ROOMY_CONTEXT // 2, 2 * ROOMY_CONTEXT,
                                                                 4 * ROOMY_CONTEXT)}

    def libraries_keeping_room_leave(budget: int) -> None:  # own library pages that, down to LIBRARY_ROOM, give that
        own = budget + LIBRARY_ROOM - (10_000_000 + HEADROOM_MIN)
        monkeypatch.setattr("ntio.runtime.budget.ram_room", lambda: _room(10_000_000, own))

    libraries_keeping_room_leave(lean[2 * ROOMY_CONTEXT])
    auto = plan()
    assert (auto.capacity, auto.budget.ram) == (2 * ROOMY_CONTEXT, lean[2 * ROOMY_CONTEXT])
    assert auto.notice.startswith("memory is tight") and f"the context is {2 * ROOMY_CONTEXT} tokens" in auto.notice
    # A prompt longer than that context is refused, naming the budget as what set it and how to ask for more.
    with ntio.load(smollm2_path, kv_dtype="float32") as m, pytest.raises(
            ntio.ContextOverflowError, match=rf"^the prompt has {2 * ROOMY_CONTEXT} tokens and the context holds "
                                             rf"{2 * ROOMY_CONTEXT}, all the memory budget fits; max_context \(--ctx"):
        m.generate([1] * (2 * ROOMY_CONTEXT), max_new_tokens=1)
    asked = plan(max_context=4 * ROOMY_CONTEXT)  # LIBRARY_ROOM - LIBRARY_FLOOR more, enough for it
    assert lean[4 * ROOMY_CONTEXT] <= lean[2 * ROOMY_CONTEXT] + LIBRARY_ROOM - LIBRARY_FLOOR
    assert (asked.capacity, asked.budget.ram) == (4 * ROOMY_CONTEXT, lean[4 * ROOMY_CONTEXT])
    # Keeping LIBRARY_ROOM, only half of ROOMY_CONTEXT would fit: the libraries keep LIBRARY_FLOOR, for a longer one.
    libraries_keeping_room_leave(lean[ROOMY_CONTEXT // 2])
    floor = plan()
    assert floor.budget.ram == lean[ROOMY_CONTEXT // 2] + LIBRARY_ROOM - LIBRARY_FLOOR
    assert floor.capacity > ROOMY_CONTEXT


def test_the_libraries_room_follows_their_disks_read_ahead():
    """A page fault in the libraries reads their disk's read-ahead window around it: they keep LIBRARY_FLOOR and
    READ_AHEAD_WINDOWS windows above it, at most LIBRARY_ROOM, which also stands for a read-ahead not known."""
    room = lambda read_ahead: RamRoom(10 << 20, "cgroup v1 /fake", 600 << 20, 400 << 20, 200 << 20, read_ahead)
    assert room(128 << 10).library_room == LIBRARY_FLOOR + READ_AHEAD_WINDOWS * (128 << 10) < LIBRARY_ROOM
    assert room(8 << 20).library_room == room(None).library_room == LIBRARY_ROOM
    assert room(128 << 10).tight_budget(room(128 << 10).library_room) > room(8 << 20).tight_budget(LIBRARY_ROOM)


def test_the_libraries_read_ahead_is_their_block_devices_as_lsblk_reads_it():
    """The read-ahead found from torch's file through sysfs is the one util-linux reports for the block device its
    file system is mounted from (skipped where that is no block device, as in an overlay)."""
    where = subprocess.run(["findmnt", "-no", "SOURCE", "-T", torch.__file__], capture_output=True, text=True)
    source = where.stdout.strip()
    if where.returncode != 0 or not source.startswith("/dev/"):
        pytest.skip(f"torch's file system is mounted from {source or 'nothing findmnt names'}, not a block device")
    read_ahead_kb = subprocess.run(["lsblk", "-ndo", "RA", source], capture_output=True, text=True, check=True)
    assert libraries_read_ahead() == int(read_ahead_kb.stdout) << 10


# A process that loads a model, says so, waits for a line on stdin, then generates: the test lowers its cgroup's
# limit in between.
_LOAD_THEN_GENERATE = """
import json, sys
import ntio
m = ntio.load(sys.argv[1], max_context=256)
print("loaded", flush=True)
sys.stdin.readline()
print(json.dumps(m.generate(sys.argv[2], max_new_tokens=int(sys.argv[3])).token_ids), flush=True)
"""


# What a generation may add to the memory a loaded model holds (Python objects, a step's temporaries).
GROWTH_ROOM = 32 << 20


def _memory_cgroup(limit: int) -> tuple[Path, str, str] | None:
    """A fresh memory cgroup (v1 or v2) limited to `limit` bytes: (its directory, limit file, usage file); None
    where this process cannot make one (not root, no memory controller)."""
    for base, limit_file, usage_file in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes",
                                          "memory.usage_in_bytes"),
                                         (Path("/sys/fs/cgroup"), "memory.max", "memory.current")):
        cgroup = base / f"ntio-test-{os.getpid()}"
        try:
            cgroup.mkdir()
        except OSError:
            continue
        try:
            (cgroup / limit_file).write_text(str(limit))
            return cgroup, limit_file, usage_file
        except OSError:
            cgroup.rmdir()
    return None


def test_a_cgroup_limit_lowered_mid_run_neither_kills_nor_changes_the_tokens(smollm2_path):
    """The issue's bad input "a cgroup limit that changes mid-run": once the model has loaded, its cgroup's limit
    drops to what the process then uses plus GROWTH_ROOM. ntio plans its memory up front (weights, KV cache,
    buffers) and a decode step makes only small temporaries, so generation fits: the run ends normally with the
    tokens of an unconstrained run, where growing after the plan would have been an OOM kill."""
    made = _memory_cgroup(2_000_000_000)
    if made is None:
        pytest.skip("needs a writable memory cgroup (root)")
    cgroup, limit_file, usage_file = made
    child = None
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", _LOAD_THEN_GENERATE, str(smollm2_path), PROMPT, "16"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid())))
        assert child.stdout.readline().strip() == "loaded", child.stderr.read()
        (cgroup / limit_file).write_text(str(int((cgroup / usage_file).read_text()) + GROWTH_ROOM))
        out, err = child.communicate("go\n", timeout=300)
        assert child.returncode == 0, err
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        cgroup.rmdir()
    reference = ntio.load(smollm2_path, max_context=256)
    assert json.loads(out) == reference.generate(PROMPT, max_new_tokens=16).token_ids
    reference.close()
