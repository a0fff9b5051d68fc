"""`ntio-bench`: each subcommand prints exactly one JSON object with its keys, and counts bytes correctly."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ntio.bench import main as bench
from ntio.synth import preset, write_synthetic_gguf


def run(*args: str) -> dict:
    result = CliRunner().invoke(bench, [*args, "--json"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "data.bin"
    path.write_bytes(bytes(range(256)) * (4 << 12))  # 4 MiB
    return path


@pytest.mark.parametrize("pattern", ["seq", "random"])
def test_read_reports_bandwidth_iops_and_latency(data_file, pattern):
    r = run("read", str(data_file), "--block-size", "131072", "--queue-depth", "4", "--pattern", pattern,
            "--size", str(3 << 20))
    assert {"gb_s", "iops", "lat_p50_us", "lat_p99_us", "backend", "bytes", "requests"} <= r.keys()
    assert r["bytes"] == 3 << 20 and r["requests"] == 24  # one request per 128 KiB block
    assert r["gb_s"] > 0 and r["lat_p99_us"] >= r["lat_p50_us"] > 0
    assert r["backend"] in ("io_uring", "pread", "buffered")


def test_memory_reads_ram_on_the_threads_asked_for():
    from ntio import _core

    threads = _core.kernel_threads()
    try:
        r = run("memory", "--size", "64", "--repeats", "3", "--threads", "1")
    finally:
        _core.set_kernel_threads(threads)
    assert r["bytes"] == 64 << 20 and r["threads"] == 1 and len(r["passes_gb_s"]) == 3
    assert 0 < r["gb_s"] <= r["best_gb_s"] == max(r["passes_gb_s"])


def test_memory_beyond_the_ram_is_one_line():
    result = CliRunner().invoke(bench, ["memory", "--size", str(1 << 40)])
    assert result.exit_code == 1
    assert result.output.startswith(f"ntio-bench: error: --size {1 << 40} MiB is more than the ")
    assert len(result.output.strip().splitlines()) == 1


def test_buffered_read_is_not_cold(data_file):
    r = run("read", str(data_file), "--buffered")
    assert r["backend"] == "buffered" and r["cold"] is False and r["bytes"] == 4 << 20


def test_extents_reads_the_fraction_and_compares_with_sequential(data_file):
    r = run("extents", str(data_file), "--extent-size", "65536", "--fraction", "0.5")
    assert r["extents"] == 32 and r["bytes"] == 32 * 65536 and r["seq_bytes"] == 4 << 20
    assert r["gb_s"] > 0 and r["seq_gb_s"] > 0 and r["ratio"] == pytest.approx(r["gb_s"] / r["seq_gb_s"])


FIO_JSON = {  # the shape of fio's --output-format=json (fio-3.33): options as given, bandwidth in bytes per second
    "fio version": "fio-3.33", "global options": {"rw": "read", "direct": "1", "iodepth": "4"},
    "jobs": [{"jobname": "a", "job options": {"bs": "64k"}, "read": {"bw_bytes": 900_000_000}},
             {"jobname": "b", "job options": {"bs": "1M", "iodepth": "16"}, "read": {"bw_bytes": 2_100_000_000}}],
}


def test_read_sweep_covers_every_size_and_depth_and_draws_fio_beside(data_file, tmp_path):
    import matplotlib.image

    fio, png = tmp_path / "fio.json", tmp_path / "sweep.png"
    fio.write_text(json.dumps(FIO_JSON))
    r = run("read", str(data_file), "--sweep", "--sweep-sizes", "65536,262144", "--sweep-depths", "1,4",
            "--size", str(1 << 20), "--fio", str(fio), "--plot", str(png))
    assert [(c["block_size"], c["queue_depth"]) for c in r["cells"]] == [(65536, 1), (65536, 4), (262144, 1),
                                                                         (262144, 4)]
    assert all(c["bytes"] == 1 << 20 and c["gb_s"] > 0 for c in r["cells"])
    assert r["fio"] == [{"block_size": 65536, "queue_depth": 4, "gb_s": 0.9},
                        {"block_size": 1 << 20, "queue_depth": 16, "gb_s": 2.1}]
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[0] > 200 and pixels[..., :3].std() > 0.05  # drawn, not blank


def test_bad_sweep_input_is_one_line(data_file, tmp_path):
    bad = tmp_path / "fio.json"
    bad.write_text('{"jobs": [{"job options": {"bs": "64k"}}]}')  # no read figures
    result = CliRunner().invoke(bench, ["read", str(data_file), "--sweep", "--fio", str(bad)])
    assert result.exit_code == 1
    assert result.output.strip() == f"ntio-bench: error: {bad}: not fio's JSON output of read jobs (KeyError: 'read')"
    result = CliRunner().invoke(bench, ["read", str(data_file), "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "--plot and --fio draw a --sweep" in result.output
    result = CliRunner().invoke(bench, ["read", str(data_file), "--sweep", "--sweep-depths", "4,0"])
    assert result.exit_code == 2 and "'4,0': comma-separated positive integers" in result.output
    assert not (tmp_path / "x.png").exists()


def test_layers_of_a_gguf_and_its_store(tmp_path):
    from ntio.formats.store import convert

    gguf_path = write_synthetic_gguf(tmp_path / "tiny.gguf", preset("tiny"))
    for path in (gguf_path, convert(gguf_path, tmp_path / "tiny.ntio")):
        r = run("layers", str(path))
        assert r["n_layers"] == 2 and len(r["layers"]) == 2
        assert all(layer["gb_s"] > 0 and layer["seconds"] > 0 for layer in r["layers"])
        assert r["bytes"] == sum(layer["bytes"] for layer in r["layers"])
