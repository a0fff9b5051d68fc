"""`ntio-bench`: raw read bandwidth, per-layer load time and sparse-extent bandwidth through ntio's Rust reader;
the RAM read rate of the kernel threads (`memory`), which bounds a decode step over resident weights.

Every read goes through `_core.timed_read`: the reader's own path (extent planning, io_uring or pread, O_DIRECT)
with per-request latency taken in Rust, into a scratch buffer. Reads are cold because they are O_DIRECT (no page
cache), except with `--buffered`, which reads through the page cache and does not drop it ("cold": false).
Bandwidth `gb_s` is 1e9 bytes per second. `--json` prints exactly one JSON object.

The reader sorts a batch by file offset and merges extents adjacent in both file and destination. `--pattern random`
places the blocks in shuffled order in the destination, so none merge: every block is its own request, issued in
ascending file order (the order a sparse layer load uses), not in seek-random order as fio's randread.
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
from collections.abc import Sequence
from pathlib import Path

import click
import numpy as np

from ntio import _core
from ntio.errors import NtioError, OptionError

# Extents land in a scratch buffer of at most this many bytes (wrapping around): the bytes are thrown away.
SCRATCH_BYTES = 64 << 20

SIZE = click.IntRange(min=1)


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except OptionError as e:
            click.echo(f"ntio-bench: error: --{e.option.replace('_', '-')} {e.problem}", err=True)
            raise SystemExit(1) from None
        except (NtioError, OSError, ValueError) as e:
            click.echo(f"ntio-bench: error: {e}", err=True)
            raise SystemExit(1) from None


@click.group(cls=_Group)
@click.version_option(_core.__version__, prog_name="ntio-bench")
def main() -> None:
    """Benchmarks of ntio's reader (O_DIRECT unless --buffered)."""


def _backend_option(f):
    f = click.option("--backend", type=click.Choice(["io_uring", "pread"]),
                     help="Reader backend (default: the best available); --buffered reads through the page cache")(f)
    f = click.option("--direct/--buffered", default=True, show_default=True, help="O_DIRECT or page-cache reads")(f)
    f = click.option("--queue-depth", type=SIZE, default=32, show_default=True, help="Requests in flight")(f)
    f = click.option("--json", "as_json", is_flag=True, help="Print one JSON object")(f)
    return f


def _backend(direct: bool, backend: str | None) -> str | None:
    if direct:
        return backend
    if backend:
        raise click.UsageError("--backend names an O_DIRECT backend; --buffered has its own")
    return "buffered"


def _scratch_extents(offsets: Sequence[int], length: int) -> tuple[list[tuple[int, int, int]], int]:
    """Reader extents for `length` bytes at each offset, packed in the given order into a wrapping scratch buffer
    (extents adjacent both in the file and in the buffer merge into one request)."""
    window = max(length, SCRATCH_BYTES // length * length)
    extents = [(offset, length, i * length % window) for i, offset in enumerate(offsets)]
    return extents, min(window, len(offsets) * length)


def _timed(path, extents, nbytes: int, backend: str | None, queue_depth: int, request_size: int) -> dict:
    """Read `path` (a file, or a model file's `files`) through `_core.timed_read`; bandwidth of the bytes the extents
    ask for."""
    name, seconds, latencies = _core.timed_read(path, extents, nbytes, backend=backend, queue_depth=queue_depth,
                                                request_size=request_size)
    requested = sum(length for _, length, _ in extents)
    lat = np.asarray(latencies) if latencies else np.zeros(1)
    return {
        "backend": name, "bytes": requested, "seconds": seconds, "gb_s": requested / seconds / 1e9,
        "requests": len(latencies), "iops": len(latencies) / seconds,
        "lat_p50_us": float(np.percentile(lat, 50)), "lat_p99_us": float(np.percentile(lat, 99)),
    }


def _emit(result: dict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(result))
        return
    for key, value in result.items():
        if isinstance(value, float):
            value = f"{value:,.3f}"
        elif isinstance(value, list):
            value = f"[{len(value)} entries]"
        click.echo(f"{key:14} {value}")


def _span(path: Path, block: int, limit: int | None) -> int:
    """Bytes of the file to use: whole blocks, at most `limit`."""
    size = os.path.getsize(path)
    usable = min(size, limit or size) // block * block
    if usable == 0:
        raise NtioError(f"{path}: {size} bytes hold no whole block of {block} bytes")
    return usable


def _int_list(ctx, param, value: str) -> list[int]:
    try:
        numbers = [int(v) for v in value.split(",")]
    except ValueError:
        numbers = []
    if not numbers or min(numbers) < 1:
        raise click.BadParameter(f"{value!r}: comma-separated positive integers", ctx, param)
    return numbers


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--block-size", type=SIZE, default=1 << 20, show_default=True, help="Bytes per request")
@click.option("--pattern", type=click.Choice(["seq", "random"]), default="seq", show_default=True)
@click.option("--size", "--limit", "limit", type=SIZE, help="Read at most this many bytes of FILE")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --pattern random")
@click.option("--sweep", is_flag=True,
              help="Every --sweep-sizes request size at every --sweep-depths queue depth (instead of --block-size "
                   "and --queue-depth), each over --size bytes (default 256 MiB)")
@click.option("--sweep-sizes", default=",".join(str(4096 << 2 * i) for i in range(6)), show_default=True,
              callback=_int_list, help="Request sizes of --sweep, in bytes")
@click.option("--sweep-depths", default="1,4,16,64", show_default=True, callback=_int_list,
              help="Queue depths of --sweep")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="With --sweep: draw bandwidth against request size, a line per queue depth, into this PNG "
                   "(needs ntio[plot])")
@click.option("--fio", "fio_json", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="fio's --output-format=json of sequential reads (jobs with bs and iodepth): drawn beside ntio")
@_backend_option
def read(file, block_size, pattern, limit, seed, sweep, sweep_sizes, sweep_depths, plot, fio_json, as_json,
         queue_depth, direct, backend) -> None:
    """Read FILE in requests of --block-size with --queue-depth in flight: bandwidth, IOPS, latency."""
    if not sweep and (plot or fio_json):
        raise click.UsageError("--plot and --fio draw a --sweep")
    if not sweep:
        _emit(_read_once(file, block_size, queue_depth, pattern, limit, seed, direct, backend), as_json)
        return
    from ntio.plots import check_figure_path, draw_read_sweep

    if plot is not None:
        check_figure_path(plot)
    fio = _fio_points(fio_json) if fio_json else []
    limit = limit or 256 << 20
    for size in sweep_sizes:
        _span(file, size, limit)  # every size fits before the first read
    cells = [_read_once(file, size, depth, pattern, limit, seed, direct, backend)
             for size in sweep_sizes for depth in sweep_depths]
    result = {"command": "read-sweep", "file": str(file), "pattern": pattern, "cold": direct,
              "cells": [{k: c[k] for k in ("block_size", "queue_depth", "backend", "bytes", "gb_s", "iops",
                                           "lat_p50_us", "lat_p99_us")} for c in cells], "fio": fio}
    if plot is not None:
        draw_read_sweep(result, plot)
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(f"GB/s reading {file} ({pattern}, {'O_DIRECT' if direct else 'page cache'}, {cells[0]['backend']})")
    click.echo(f"{'request':>10}" + "".join(f"{f'QD {d}':>9}" for d in sweep_depths))
    for size in sweep_sizes:
        row = [c["gb_s"] for c in result["cells"] if c["block_size"] == size]
        click.echo(f"{size:>10}" + "".join(f"{g:>9.3f}" for g in row))


def _read_once(file: Path, block_size: int, queue_depth: int, pattern: str, limit: int | None, seed: int,
               direct: bool, backend: str | None) -> dict:
    span = _span(file, block_size, limit)
    offsets = list(range(0, span, block_size))
    if pattern == "random":
        random.Random(seed).shuffle(offsets)
    extents, scratch = _scratch_extents(offsets, block_size)
    result = {"command": "read", "file": str(file), "pattern": pattern, "block_size": block_size,
              "queue_depth": queue_depth, "cold": direct}
    return result | _timed(file, extents, scratch, _backend(direct, backend), queue_depth, block_size)


def _fio_points(path: Path) -> list[dict]:
    """(block size, queue depth, GB/s) of each read job in fio's JSON output; bs and iodepth from the job's options,
    else the global ones; fio's size suffixes are powers of 1024."""
    try:
        report = json.loads(path.read_text())
        points = []
        for job in report["jobs"]:
            opts = {**report.get("global options", {}), **job.get("job options", {})}
            points.append({"block_size": _fio_size(opts.get("bs", "4k")), "queue_depth": int(opts.get("iodepth", 1)),
                           "gb_s": job["read"]["bw_bytes"] / 1e9})
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise NtioError(f"{path}: not fio's JSON output of read jobs ({type(e).__name__}: {e})") from None
    return points


def _fio_size(text: str) -> int:
    """fio's size ('4k', '1M', '128KiB', '65536') in bytes: its suffixes are powers of 1024."""
    m = re.fullmatch(r"(\d+)([kmg]?)(i?b)?", text.strip().lower())
    if m is None:
        raise ValueError(f"bs {text!r}")
    return int(m[1]) * 1024 ** " kmg".index(m[2] or " ")


@main.command()
@click.option("--size", "size_mib", type=SIZE, default=1024, show_default=True,
              help="MiB of RAM read per pass (far beyond the caches)")
@click.option("--repeats", type=SIZE, default=5, show_default=True, help="Passes over it")
@click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
              help="Kernel threads (0: one per CPU)")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object")
def memory(size_mib, repeats, threads, as_json) -> None:
    """How fast the kernel threads read RAM. A decode step over resident weights reads each weight byte once, so
    it takes at least (the weights' bytes) / this rate: the roofline that `benches/decode_vs_llamacpp.py` reports
    each engine against. `gb_s`: the median pass."""
    from ntio.runtime.memory import ram_room

    nbytes = size_mib << 20
    room = ram_room()
    if nbytes > room.available:
        raise OptionError("size", f"{size_mib} MiB is more than the {room.available >> 20} MiB of RAM this process "
                                  f"may use ({room.source})")
    _core.set_kernel_threads(threads)
    seconds = _core.memory_read_seconds(nbytes, repeats)
    rates = [nbytes / s / 1e9 for s in seconds]
    _emit({"command": "memory", "bytes": nbytes, "threads": _core.kernel_threads(), "gb_s": statistics.median(rates),
           "best_gb_s": max(rates), "passes_gb_s": rates}, as_json)


@main.command()
@click.argument("model", type=click.Path())
@click.option("--request-size", type=SIZE, default=1 << 20, show_default=True)
@_backend_option
def layers(model, request_size, as_json, queue_depth, direct, backend) -> None:
    """Load every layer of MODEL (GGUF, ntio store or checkpoint directory, or a name from `ntio fetch --list`)
    cold: time and bandwidth per layer."""
    from ntio.fetch import resolve_model
    from ntio.formats.model_file import extent_index, open_model_file, plan_layer_read

    model = resolve_model(model)
    model_file = open_model_file(model)
    per_layer = []
    for layer in range(extent_index(model_file).n_layers):
        extents, size = plan_layer_read(model_file, layer)
        r = _timed(model_file.files, extents, size, _backend(direct, backend), queue_depth, request_size)
        per_layer.append({"layer": layer, "bytes": r["bytes"], "extents": len(extents), "seconds": r["seconds"],
                          "gb_s": r["gb_s"], "backend": r["backend"]})
    total_bytes = sum(p["bytes"] for p in per_layer)
    total_seconds = sum(p["seconds"] for p in per_layer)
    _emit({"command": "layers", "file": str(model), "format": type(model_file).__name__, "cold": direct,
           "queue_depth": queue_depth, "n_layers": len(per_layer), "bytes": total_bytes, "seconds": total_seconds,
           "gb_s": total_bytes / total_seconds / 1e9 if total_seconds else 0.0,
           "backend": per_layer[0]["backend"] if per_layer else None, "layers": per_layer}, as_json)


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--extent-size", type=SIZE, default=65536, show_default=True)
@click.option("--fraction", type=click.FloatRange(0, 1, min_open=True), default=0.5, show_default=True,
              help="Share of the file's extents to read")
@click.option("--size", "--limit", "limit", type=SIZE, help="Use at most this many bytes of FILE")
@click.option("--request-size", type=SIZE, default=1 << 20, show_default=True,
              help="Largest request (adjacent chosen extents merge up to this)")
@click.option("--seed", type=int, default=0, show_default=True)
@_backend_option
def extents(file, extent_size, fraction, limit, request_size, seed, as_json, queue_depth, direct, backend) -> None:
    """Read a random FRACTION of FILE's --extent-size extents; compare with reading all of it sequentially.

    gb_s counts only the bytes asked for; seq_gb_s is a sequential read of the same span in the same run, and
    ratio = gb_s / seq_gb_s (1.0: sparse reads cost no more per byte than dense ones).
    """
    span = _span(file, extent_size, limit)
    all_offsets = list(range(0, span, extent_size))
    chosen = sorted(random.Random(seed).sample(all_offsets, max(1, round(fraction * len(all_offsets)))))
    kind = _backend(direct, backend)
    sparse = _timed(file, *_scratch_extents(chosen, extent_size), kind, queue_depth, request_size)
    dense = _timed(file, *_scratch_extents(all_offsets, extent_size), kind, queue_depth, request_size)
    _emit({"command": "extents", "file": str(file), "extent_size": extent_size, "fraction": fraction,
           "queue_depth": queue_depth, "cold": direct, "backend": sparse["backend"], "extents": len(chosen),
           "bytes": sparse["bytes"], "seconds": sparse["seconds"], "gb_s": sparse["gb_s"],
           "requests": sparse["requests"], "lat_p50_us": sparse["lat_p50_us"], "lat_p99_us": sparse["lat_p99_us"],
           "seq_bytes": dense["bytes"], "seq_gb_s": dense["gb_s"], "ratio": sparse["gb_s"] / dense["gb_s"]}, as_json)



@main.command()
@click.argument("model", type=click.Path())
@click.option("--tiers", "tier_specs", multiple=True, default=("A", "C"), show_default=True,
              help="Tier mixes to compare (repeatable): auto, A, B, C or a per-layer spec such as A:0-9,C:10-29")
@click.option("--tokens", type=click.IntRange(min=1), default=16, show_default=True, help="Decode steps per mix")
@click.option("--ctx-size", type=click.IntRange(min=32), default=256, show_default=True)
@click.option("--ram-budget", help="RAM budget for --tiers auto (e.g. 1GB)")
@click.option("--layer-group-size", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--sync", is_flag=True, help="No prefetch: read each group when it is needed")
@click.option("--prefetch-depth", type=click.IntRange(min=1), help="Groups read ahead (default: ntio.load's)")
@click.option("--io-backend", type=click.Choice(_core.BACKENDS))
@click.option("--json", "as_json", is_flag=True)
def stream(model, tier_specs, tokens, ctx_size, ram_budget, layer_group_size, sync, prefetch_depth, io_backend,
           as_json) -> None:
    """Decode MODEL (a file, or a name from `ntio fetch --list`) greedily under each tier mix: tok/s, bytes read per
    token, achieved GB/s, overlap ratio."""
    import time

    import torch

    import ntio
    from ntio.decoding.generation import greedy_token
    from ntio.fetch import resolve_model

    model = resolve_model(model)
    runs = []
    for spec in tier_specs:
        m = ntio.load(model, max_context=ctx_size, tiers=spec, ram_budget=ram_budget,
                      layer_group_size=layer_group_size, sync=sync, prefetch_depth=prefetch_depth,
                      io_backend=io_backend)
        try:
            ids = m.tokenizer.encode("Once upon a time") or [0]
            logits = m.engine.forward(torch.tensor(ids), 0)
            m.stats.reset()
            start = time.perf_counter()
            for step in range(tokens):  # fixed step count: no stop tokens
                token = torch.tensor([greedy_token(logits)])
                logits = m.engine.forward(token, len(ids) + step)
            elapsed = time.perf_counter() - start
            s = m.stats.summary()
            runs.append({"tiers": m.plan.describe(), "prefetch_depth": m.loader.prefetch_depth,
                         "decode_tok_s": tokens / elapsed,
                         **{k: s[k] for k in ("bytes_read_per_token", "disk_gb_s", "overlap_ratio", "io_wait_s",
                                              "compute_s", "layers_per_tier")}})
        finally:
            m.close()
    result = {"benchmark": "stream", "model": str(model), "tokens": tokens, "layer_group_size": layer_group_size,
              "sync": sync, "runs": runs}
    if as_json:
        click.echo(json.dumps(result))
    else:
        for r in runs:
            click.echo(f"{r['tiers']:>24}  {r['decode_tok_s']:7.2f} tok/s  {r['bytes_read_per_token'] / 1e6:8.1f} MB/token"
                       f"  {r['disk_gb_s']:5.2f} GB/s  overlap {r['overlap_ratio']:.0%}")


if __name__ == "__main__":
    main()
