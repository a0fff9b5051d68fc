"""Every path through the memory check: forced tiers must fit too, and context sizes are checked against the model,
each with one line naming the option (the probe: `--ctx-size 1099511627776 --tiers A` died in torch's allocator)."""

from __future__ import annotations

import pytest

import ntio
from ntio.errors import OptionError
from ntio.runtime import tiers
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


def test_reclaimable_page_cache_counts_as_room(tmp_path, monkeypatch):
    # A v1 memory cgroup whose usage is mostly inactive file pages (as after `import torch`).
    group = tmp_path / "memory" / "job"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(f"{1500 << 20}\n")
    (group / "memory.usage_in_bytes").write_text(f"{1400 << 20}\n")
    (group / "memory.stat").write_text(f"cache {900 << 20}\ntotal_inactive_file {800 << 20}\nrss {500 << 20}\n")
    real_path = tiers.Path

    def fake_path(p, *rest):
        mapped = {"/proc/self/cgroup": tmp_path / "cgroup", "/sys/fs/cgroup/memory": tmp_path / "memory"}
        return real_path(mapped.get(str(p), p), *rest)

    (tmp_path / "cgroup").write_text("4:memory:/job\n")
    monkeypatch.setattr(tiers, "Path", fake_path)
    assert tiers._cgroup_memory_room() == (1500 - (1400 - 800)) << 20
