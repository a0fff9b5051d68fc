"""Models bigger than memory: streamed decode next to its I/O bound, and against plain mmap under a memory limit.

Part 1 (per model, alternating in rounds, medians): the disk's sustained sequential O_DIRECT bandwidth over the
model's layer bytes (`_core` reader, 1 MiB requests, QD 32, as many bytes as the streamed run reads; the mean of one
such run just before and one just after the streamed run), resident decode tok/s (all layers tier A) where it
fits, and streamed decode with every layer on disk (tier C, read at every token, default read-ahead). The bound is
    min(resident decode tok/s, disk GB/s / bytes read per token)
and the ratio is streamed tok/s / bound, per round.

Part 2: both run inside one memory cgroup (v1 or v2) whose limit is below the model's size: ntio with the budget it
derives from the cgroup (tiers auto) and the same graph reading weights straight from a read-only memory map of the
file (the page cache under the limit decides what stays: llama.cpp's default). Needs root for the cgroup.

    python benches/stream_bound.py [--model PATH]... [--synth 8b:20] [--rounds 3] [--tokens 8] [--limit 1.5GB]
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import ntio
from ntio import _core
from ntio.models.config import ModelConfig
from ntio.fetch import resolve_model
from ntio.formats.model_file import layer_extents, open_model_file
from ntio.runtime.memory import ram_room
from ntio.runtime.tiers import parse_size

CGROUP_NAME = "ntio-stream-bound"


DISK_CHUNK = 64 << 20  # one batch of the disk measurement


def layer_span(path: Path) -> tuple[int, int]:
    """(start, length) of the file's layer bytes, from the first layer's first tensor (4096-aligned) to the end of
    the last layer's: what an all-C token reads, give or take the gaps between layers."""
    f = open_model_file(path)
    n_layers = ModelConfig.from_gguf(f).n_layers
    first = layer_extents(f, 0)[0][0] // 4096 * 4096
    last_off, last_len = layer_extents(f, n_layers - 1)[-1]
    return first, last_off + last_len - first


def read_batches(path, batches: list[list[tuple[int, int, int]]], slot_size: int) -> float:
    """Seconds to read `batches` (reader extents: file offset, length, offset in the slot) of `path` (a file, or a
    model file's `files`) cold
    (O_DIRECT, 1 MiB requests, QD 32), two batches in flight, into staging slots of `slot_size` bytes of the kind the
    loader reads into (huge-page backed)."""
    reader = _core.Reader(path, request_size=1 << 20, queue_depth=32)
    pool = _core.StagingPool(2, slot_size)
    slots = [pool.acquire() for _ in range(2)]
    pending: list = [None, None]  # per slot: its batch in flight
    start = time.perf_counter()
    for i, extents in enumerate(batches):
        if pending[i % 2] is not None:
            pending[i % 2].wait()
        pending[i % 2] = reader.submit(extents, slots[i % 2])
    for handle in pending:
        if handle is not None:
            handle.wait()
    seconds = time.perf_counter() - start
    for slot in slots:
        slot.release()
    return seconds


def disk_gb_s(path: Path, layers: tuple[int, int], nbytes: int) -> float:
    """The disk's sustained cold (O_DIRECT) sequential bandwidth over the model's layer bytes (`layers`, from
    `layer_span`): 64 MiB batches, two in flight (`read_batches`), cycling through the layers until `nbytes` are
    read. `nbytes` is the streamed run's volume: single reads of tens of MB on this VM's disk vary by +-25% from one
    to the next, 1 GB runs by +-5%."""
    first, span = layers
    batches, done, at = [], 0, 0
    while done < nbytes:
        n = min(DISK_CHUNK, span - at, nbytes - done)
        batches.append([(first + at, n, 0)])
        done, at = done + n, (at + n) % span // 4096 * 4096
    return done / read_batches(path, batches, min(DISK_CHUNK, span)) / 1e9


def decode_tok_s(path: Path, tiers: str, tokens: int, **options) -> tuple[float, float]:
    """Greedy decode steps per second and bytes read per step."""
    m = ntio.load(path, max_context=256, tiers=tiers, **options)
    try:
        ids = m.tokenizer.encode("Once upon a time") or [0]
        logits = m.engine.forward(torch.tensor(ids), 0)
        m.stats.reset()
        start = time.perf_counter()
        for step in range(tokens):
            logits = m.engine.forward(torch.tensor([int(logits.argmax())]), len(ids) + step)
        rate = tokens / (time.perf_counter() - start)
        return rate, m.stats.summary()["bytes_read_per_token"]
    finally:
        m.close()


def bound_rounds(path: Path, rounds: int, tokens: int, resident: bool) -> dict:
    """Per round: disk, resident decode, disk, streamed decode, disk. The disk of a streamed run is the mean of the
    reads just before and after it (this VM's disk changes speed from one minute to the next)."""
    disk, res, streamed, per_token, ratios = [], [], [], 0.0, []
    layers = layer_span(path)
    volume = layers[1] * tokens
    for _ in range(rounds):
        if resident:
            res.append(decode_tok_s(path, "A", tokens)[0])
        before = disk_gb_s(path, layers, volume)
        rate, per_token = decode_tok_s(path, "C", tokens)
        disk.append((before + disk_gb_s(path, layers, volume)) / 2)
        streamed.append(rate)
        bound = disk[-1] * 1e9 / per_token
        if resident:
            bound = min(bound, res[-1])
        ratios.append(rate / bound)
    return {
        "model": path.name, "file_gb": path.stat().st_size / 1e9, "bytes_read_per_token": per_token,
        "disk_gb_s": [round(x, 3) for x in disk], "resident_tok_s": [round(x, 2) for x in res],
        "streamed_tok_s": [round(x, 3) for x in streamed], "ratio_to_bound": [round(x, 3) for x in ratios],
        "median_ratio_to_bound": round(statistics.median(ratios), 3),
    }


# -- part 2: inside a memory cgroup ----------------------------------------------------------------------------


def _cgroup_dir() -> tuple[Path, str, str]:
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.exists() and "memory" in v2.read_text():
        return Path("/sys/fs/cgroup") / CGROUP_NAME, "memory.max", "cgroup.procs"
    return Path("/sys/fs/cgroup/memory") / CGROUP_NAME, "memory.limit_in_bytes", "cgroup.procs"


def drop_file_cache(path: Path) -> None:
    """Evict the file's clean pages from the page cache, so a run inside the cgroup starts cold and does not use
    pages charged to this (parent) process."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_in_cgroup(limit: int, path: Path, args: list[str]) -> dict:
    drop_file_cache(path)
    base, limit_file, procs = _cgroup_dir()
    base.mkdir(exist_ok=True)
    (base / limit_file).write_text(str(limit))

    def enter() -> None:
        (base / procs).write_text(str(os.getpid()))

    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, preexec_fn=enter,
                         timeout=1800)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


class MappedLayers:
    """LayerSource over a read-only memory map of the file: no reads of ntio's own, the page cache decides."""

    def __init__(self, layout) -> None:
        from ntio.models.weights import encoded_block
        from ntio.policies.dense import DensePolicy

        def raw(info):
            return torch.from_numpy(layout.file.tensor_bytes(info.name))

        self._blocks = [encoded_block(t, lambda part, t=t: raw(t[part])) for t in layout.blocks]
        self.stats = None
        self.policy = DensePolicy()
        self.timeline = None

    def begin_forward(self, n_tokens: int) -> None:
        pass

    def block(self, layer: int):
        return self._blocks[layer]

    def resident_blocks(self):
        return self._blocks  # every block is a view of the map

    def end_forward(self) -> None:
        pass


def mapped_decode_tok_s(path: Path, tokens: int) -> float:
    import warnings

    from ntio.runtime.engine import Engine
    from ntio.runtime.kv_cache import KVCache
    from ntio.text.tokenizer import Tokenizer
    from ntio.models.weights import WeightLayout, load_global_weights

    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    f = open_model_file(path)
    cfg = ModelConfig.from_gguf(f)
    layout = WeightLayout(f, cfg)
    engine = Engine(cfg, load_global_weights(layout, lambda info: torch.from_numpy(f.tensor_bytes(info.name))),
                    MappedLayers(layout), KVCache(cfg, 256, torch.float32, "cpu"))
    ids = Tokenizer.from_gguf(f).encode("Once upon a time") or [0]
    logits = engine.forward(torch.tensor(ids), 0)
    start = time.perf_counter()
    for step in range(tokens):
        logits = engine.forward(torch.tensor([int(logits.argmax())]), len(ids) + step)
    return tokens / (time.perf_counter() - start)


def worker(mode: str, path: Path, tokens: int) -> None:
    """Runs inside the cgroup; prints one JSON line."""
    def peak() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    if mode == "mmap":
        rate = mapped_decode_tok_s(path, tokens)
        print(json.dumps({"mode": "mmap", "tok_s": rate, "peak_rss": peak()}))
    else:
        m = ntio.load(path, max_context=256)
        tiers = m.plan.describe()
        m.close()
        del m
        rate, per_token = decode_tok_s(path, "auto", tokens)
        print(json.dumps({"mode": "ntio", "tiers": tiers, "tok_s": rate, "bytes_read_per_token": per_token,
                          "peak_rss": peak()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", default=[], help="GGUF or store (repeatable; default SmolLM2)")
    ap.add_argument("--synth", action="append", default=[], help="PRESET:LAYERS synthetic model, e.g. 8b:20")
    ap.add_argument("--synth-dir", default="/var/tmp", help="Where synthetic models are written (disk, not tmpfs)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--limit", help="cgroup memory limit for part 2 (e.g. 1.5GB); part 2 is skipped without it")
    ap.add_argument("--worker", choices=["ntio", "mmap"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, Path(args.model[0]), args.tokens)
        return

    models = [resolve_model(m) for m in args.model] or [resolve_model(None)]
    for item in args.synth:
        from ntio.synth import preset, write_synthetic_gguf

        name, layers = item.split(":")
        path = Path(args.synth_dir) / f"ntio-synth-{name}-{layers}l.gguf"
        if not path.exists():
            write_synthetic_gguf(path, preset(name, n_layers=int(layers), vocab_size=32000))
        models.append(path)
    result = {"benchmark": "stream_bound", "tokens": args.tokens, "rounds": args.rounds, "models": []}
    for path in models:
        fits = path.stat().st_size < 0.5 * ram_room().available
        entry = bound_rounds(path, args.rounds, args.tokens, resident=fits)
        limit = parse_size(args.limit, "--limit") if args.limit else 0
        if limit and path.stat().st_size > limit:  # only a model bigger than the limit shows what tiers buy
            entry["cgroup_limit"] = limit
            entry["in_cgroup"] = [run_in_cgroup(limit, path, ["--worker", mode, "--model", str(path), "--tokens",
                                                              str(args.tokens)]) for mode in ("ntio", "mmap")]
        result["models"].append(entry)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
