"""`ntio profile`: a decode step per layer (reads, waits, compute) as JSON, text and a PNG, on the real SmolLM2."""

from __future__ import annotations

import json
import sys

import gguf
import pytest
from click.testing import CliRunner

from ntio.cli import main


def _profile(path, *args) -> dict:
    result = CliRunner().invoke(main, ["profile", "-m", str(path), "-p", "Once upon a time", "-n", "6", "--json",
                                       *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _layer_pages(path) -> list[int]:
    """The bytes of the 4 KiB pages holding each layer's tensors, as gguf-py places them (O_DIRECT reads whole
    pages)."""
    tensors = gguf.GGUFReader(path).tensors
    n_layers = 1 + max(int(t.name.split(".")[1]) for t in tensors if t.name.startswith("blk."))
    pages = [set() for _ in range(n_layers)]
    for t in tensors:
        if t.name.startswith("blk."):
            first, end = int(t.data_offset), int(t.data_offset) + int(t.n_bytes)
            pages[int(t.name.split(".")[1])].update(range(first // 4096, -(-end // 4096)))
    return [4096 * len(p) for p in pages]


def test_a_streamed_step_adds_up_and_reads_every_streamed_layer(smollm2_path, tmp_path):
    png = tmp_path / "step.png"
    report = _profile(smollm2_path, "--tiers", "A:0-9,C:10-29", "--plot", str(png))
    rows, totals = report["layers"], report["totals"]
    sizes = _layer_pages(smollm2_path)
    assert [r["layer"] for r in rows] == [*range(len(sizes)), "head"]
    assert [r["tier"] for r in rows[:-1]] == ["A"] * 10 + ["C"] * 20
    # What each layer read: nothing when resident, the pages of its own tensors when streamed.
    assert [r["read_bytes"] for r in rows[:-1]] == [0] * 10 + sizes[10:]
    assert all(r["read"] == [] for r in rows[:10]) and all(len(r["read"]) == 1 for r in rows[10:-1])
    # The layers' spans follow one another and, with the head, cover the step's wall time within 5%.
    assert all(a["end_ms"] <= b["start_ms"] for a, b in zip(rows, rows[1:]))
    assert all(r["compute_ms"] > 0 and r["wait_ms"] >= 0 for r in rows)
    assert totals["layers_ms"] == pytest.approx(totals["wall_ms"], rel=0.05)
    # A next step's read issued during this one (drawn pale) starts after this step's read of the layer has landed,
    # and before the step ended.
    for r in rows:
        assert all(r["read"][0][1] <= start < totals["wall_ms"] for start, _ in r["read_ahead"])
    assert totals["wall_ms"] == report["steps_wall_ms"][report["step"]]
    assert sorted(report["steps_wall_ms"]).index(totals["wall_ms"]) == len(report["steps_wall_ms"]) // 2
    assert totals["read_bytes"] == sum(sizes[10:]) and totals["bound_by"] in ("compute", "disk")
    _assert_drawn(png)


def test_a_resident_step_reads_nothing_and_is_bound_by_compute(smollm2_path):
    report = _profile(smollm2_path, "--tiers", "A")
    totals = report["totals"]
    assert totals["read_bytes"] == 0 and totals["wait_ms"] == 0 and totals["bound_by"] == "compute"
    assert totals["layers_ms"] == pytest.approx(totals["wall_ms"], rel=0.05)


def test_text_output_and_bad_plot_paths_are_one_line(smollm2_path, tmp_path, monkeypatch):
    result = CliRunner().invoke(main, ["profile", "-m", str(smollm2_path), "-p", "Hi", "-n", "3", "--tiers", "C"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["layer", "tier", "wait"] and lines[-2].split()[0] == "head"
    assert "bound by" in lines[-1]
    nowhere = tmp_path / "missing" / "step.png"
    result = CliRunner().invoke(main, ["profile", "-m", str(smollm2_path), "-p", "Hi", "--plot", str(nowhere)])
    assert result.exit_code == 1
    assert result.output.strip() == f"ntio: error: --plot {nowhere}: no directory {nowhere.parent}"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    png = tmp_path / "none.png"
    result = CliRunner().invoke(main, ["profile", "-m", str(smollm2_path), "-p", "Hi", "--plot", str(png)])
    assert result.exit_code == 1
    assert result.output.strip() == "ntio: error: --plot needs matplotlib: pip install 'ntio[plot]'"
    assert not png.exists()


def _assert_drawn(png) -> None:
    """A PNG that is not blank: its pixels vary."""
    import matplotlib.image

    pixels = matplotlib.image.imread(png)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 400
    assert pixels[..., :3].std() > 0.05
