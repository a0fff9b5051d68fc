"""Every path through the memory check: forced tiers must fit too, and context sizes are checked against the model,
each with one line naming the option (the probe: `--ctx-size 1099511627776 --tiers A` died in torch's allocator)."""

from __future__ import annotations

import pytest

import ntio
from ntio.errors import OptionError
from ntio.runtime import memory
from tests.test_cli import assert_user_error, ntio as run_cli

HUGE = 1 << 40


@pytest.mark.parametrize("forced", ["A", "C", "A:0-14,C:15-29"])
def test_forced_tiers_check_the_kv_cache_fits(smollm2_path, forced):
    with pytest.raises(OptionError, match=rf"^tiers '{forced}' needs .* of host memory but ram_budget is .*KV cache"):
        ntio.load(smollm2_path, tiers=forced, max_context=8192, ram_budget="100MB")
    out = run_cli("generate", "-m", str(smollm2_path), "-p", "hi", "--tiers", forced, "--ctx-size", "8192",
                  "--ram-budget", "100MB")
    assert_user_error(out, f"--tiers '{forced}' needs", "--ram-budget is 95.37 MiB", "--ctx-size")


def test_forced_tiers_that_fit_still_load(smollm2_path):
    assert ntio.load(smollm2_path, tiers="C", max_context=256, ram_budget="200MB").plan.counts["C"] == 30


def test_context_beyond_the_model_is_refused_naming_the_flag(smollm2_path, tmp_path):
    for forced in ("A", "C", "auto"):
        out = run_cli("generate", "-m", str(smollm2_path), "-p", "hi", "--ctx-size", str(HUGE), "--tiers", forced)
        assert_user_error(out, f"--ctx-size {HUGE} is outside 1..8192")
    text = tmp_path / "t.txt"
    text.write_text("one two three four five six seven eight nine ten " * 10)
    out = run_cli("perplexity", "-m", str(smollm2_path), "-f", str(text), "--ctx", "100000")
    assert_user_error(out, "--ctx 100000 is outside 1..8192")


def _fake_system(tmp_path, monkeypatch, cgroup_line: str, hierarchies: dict[str, str], smaps_rollup: str) -> None:
    """ntio.runtime.memory reads files under tmp_path instead of /proc and /sys: this process's cgroup line,
    `hierarchies` (a /sys/fs/cgroup mount -> a folder of tmp_path), a MemAvailable of 16 GiB and `smaps_rollup`."""
    (tmp_path / "cgroup").write_text(cgroup_line + "\n")
    (tmp_path / "meminfo").write_text(f"MemTotal: {32 << 20} kB\nMemAvailable: {16 << 20} kB\n")
    (tmp_path / "smaps_rollup").write_text(smaps_rollup)
    fake = {"/proc/self/cgroup": "cgroup", "/proc/meminfo": "meminfo", "/proc/self/smaps_rollup": "smaps_rollup",
            **hierarchies}
    real_path = memory.Path
    monkeypatch.setattr(memory, "Path", lambda p, *rest: real_path(
        tmp_path / fake[str(p)] if str(p) in fake else p, *rest))


def test_reclaimable_page_cache_counts_as_room(tmp_path, monkeypatch):
    # A v1 memory cgroup whose usage is mostly file pages (as after `import torch`): only anonymous and kernel
    # memory (usage minus the file LRU lists) and this process's own resident file pages (up to a bound) are taken
    # from the limit.
    group = tmp_path / "memory" / "job"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(f"{1500 << 20}\n")
    (group / "memory.usage_in_bytes").write_text(f"{1400 << 20}\n")
    (group / "memory.stat").write_text(
        f"cache {900 << 20}\nrss {500 << 20}\ntotal_inactive_file {800 << 20}\ntotal_active_file {100 << 20}\n")
    _fake_system(tmp_path, monkeypatch, "4:memory:/job", {"/sys/fs/cgroup/memory": "memory"},
                 "Rss: 548180 kB\nPss_Anon: 305452 kB\nPss_File: 245760 kB\n")
    room = memory.ram_room()
    assert room.source == "cgroup v1 /job" and room.limit == 1500 << 20
    assert room.unreclaimable == (1400 - 900) << 20 and room.own_file_pages == memory.LIBRARY_WORKING_SET
    assert room.available == (1500 - 500) * 2**20 - memory.LIBRARY_WORKING_SET  # 240 MiB resident, 128 MiB kept
    assert room.default_budget == room.available - (64 << 20)  # 5% of 872 MiB is less than the 64 MiB floor


def test_a_limit_on_a_parent_cgroup_binds_the_process(tmp_path, monkeypatch):
    # cgroup v2: the process sits in /slice/job, which has no limit of its own; /slice has one, and its usage counts
    # a sibling's memory as well. The root has no limit files at all.
    for group, limit, usage, anon, files in (("slice", f"{1000 << 20}", 700 << 20, 600 << 20, 100 << 20),
                                             ("slice/job", "max", 300 << 20, 200 << 20, 100 << 20)):
        (tmp_path / "unified" / group).mkdir(parents=True)
        (tmp_path / "unified" / group / "memory.max").write_text(f"{limit}\n")
        (tmp_path / "unified" / group / "memory.current").write_text(f"{usage}\n")
        (tmp_path / "unified" / group / "memory.stat").write_text(
            f"anon {anon}\nfile {files}\nactive_file {files // 4}\ninactive_file {files - files // 4}\n")
    _fake_system(tmp_path, monkeypatch, "0::/slice/job", {"/sys/fs/cgroup": "unified"}, "Pss_File: 0 kB\n")
    room = memory.ram_room()
    assert room.source == "cgroup v2 /slice" and room.limit == 1000 << 20
    assert room.unreclaimable == 600 << 20 and room.available == 400 << 20
    # A tighter limit of the process's own binds first.
    (tmp_path / "unified" / "slice" / "job" / "memory.max").write_text(f"{350 << 20}\n")
    room = memory.ram_room()
    assert room.source == "cgroup v2 /slice/job" and room.available == 150 << 20


def test_a_v1_parent_that_does_not_account_its_children_does_not_bind_them(tmp_path, monkeypatch):
    # cgroup v1: the process sits in /slice/job (no limit); /slice has a 1000 MiB limit. With memory.use_hierarchy 0
    # (kernels before 5.16) /slice charges none of /slice/job's memory and its limit does not bind it: the room is
    # the machine's. With 1 the limit binds, as in v2.
    for group, limit, usage in (("slice", 1000 << 20, 900 << 20), ("slice/job", 1 << 62, 300 << 20)):
        (tmp_path / "memory" / group).mkdir(parents=True)
        (tmp_path / "memory" / group / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (tmp_path / "memory" / group / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (tmp_path / "memory" / group / "memory.stat").write_text("total_inactive_file 0\ntotal_active_file 0\n")
    _fake_system(tmp_path, monkeypatch, "4:memory:/slice/job", {"/sys/fs/cgroup/memory": "memory"},
                 "Pss_File: 0 kB\n")
    (tmp_path / "memory" / "slice" / "memory.use_hierarchy").write_text("0\n")
    room = memory.ram_room()
    assert room.source == "MemAvailable" and room.available == 16 << 30
    (tmp_path / "memory" / "slice" / "memory.use_hierarchy").write_text("1\n")
    room = memory.ram_room()
    assert room.source == "cgroup v1 /slice" and room.available == 100 << 20
