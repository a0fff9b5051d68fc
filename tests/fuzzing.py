"""Fuzzing of model files: mutated GGUF headers and ntio store headers/manifests, opened the way users open them.

Every input is a mutation of a small valid seed (a synthetic llama GGUF, and the store converted from it):
- GGUF: a header field found by walking the seed's header (a count, a string length, a value type, a tensor's
  dimensions, type or offset, the key/tensor counts) set to an interesting integer; random bit flips and byte
  overwrites in the header; truncation; a chunk of the header deleted or repeated;
- store: a manifest value replaced (huge, negative, wrong type, missing) with the manifest checksum recomputed so
  the mutation reaches the parser, or a header page field / byte changed.
`exercise` opens the file, builds the config, the tokenizer and the weight layout, and, when all of that passes,
loads the model (tiers A or C) and generates two tokens. An `NtioError` is the right answer to a bad file; any other
exception is a failure, and so is a hang or memory growing past a limit.

Inputs run in worker subprocesses, in chunks, under a watchdog (`run_chunks`) that kills a worker that stops making
progress or whose RSS passes the limit, and saves the input that did it. Short runs are a test
(tests/test_fuzz.py); long runs are this script:

    python tests/fuzzing.py --iterations 100000 --jobs 2 [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

INTERESTING = [0, 1, 2, 3, 7, 255, 256, 4095, 4096, 65535, 1 << 31, (1 << 31) - 1, (1 << 32) - 1, 1 << 32, 1 << 40,
               (1 << 63) - 1, 1 << 63, (1 << 64) - 1, (1 << 64) - 2, 13, 12]

# GGUF value types and the byte size of the fixed-size ones (8 = string, 9 = array).
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass
class HeaderFields:
    """Offsets and widths of the integer fields of a GGUF header, found by walking a valid file."""

    fields: list[tuple[int, int]] = field(default_factory=list)  # (offset, width in bytes)
    end: int = 0  # end of the tensor infos


def walk_gguf(data: bytes) -> HeaderFields:
    out = HeaderFields()
    pos = 8  # magic, version
    out.fields.append((4, 4))
    n_tensors, n_kv = struct.unpack_from("<QQ", data, pos)
    out.fields += [(8, 8), (16, 8)]
    pos = 24

    def string(pos: int) -> int:
        (n,) = struct.unpack_from("<Q", data, pos)
        out.fields.append((pos, 8))
        return pos + 8 + n

    def value(pos: int, vtype: int) -> int:
        if vtype == 8:
            return string(pos)
        if vtype == 9:
            (etype, count) = struct.unpack_from("<IQ", data, pos)
            out.fields += [(pos, 4), (pos + 4, 8)]
            pos += 12
            if etype in _SIZES:
                return pos + count * _SIZES[etype]
            for _ in range(count):
                pos = value(pos, etype)
            return pos
        if _SIZES[vtype] >= 4:
            out.fields.append((pos, _SIZES[vtype]))
        return pos + _SIZES[vtype]

    for _ in range(n_kv):
        pos = string(pos)
        (vtype,) = struct.unpack_from("<I", data, pos)
        out.fields.append((pos, 4))
        pos = value(pos + 4, vtype)
    for _ in range(n_tensors):
        pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", data, pos)
        out.fields.append((pos, 4))
        pos += 4
        for _ in range(n_dims):
            out.fields.append((pos, 8))
            pos += 8
        out.fields += [(pos, 4), (pos + 4, 8)]  # type, offset
        pos += 12
    out.end = pos
    return out


def mutate_gguf(seed: bytes, fields: HeaderFields, rng: random.Random) -> bytes:
    data = bytearray(seed)
    kind = rng.choice(["field", "field", "field", "flip", "bytes", "truncate", "delete", "repeat"])
    if kind == "field":
        offset, width = rng.choice(fields.fields)
        value = rng.choice(INTERESTING + [rng.getrandbits(width * 8)])
        if rng.random() < 0.3:  # near the original: off by a little
            value = int.from_bytes(data[offset : offset + width], "little") + rng.choice([-2, -1, 1, 2, 32, 4096])
        data[offset : offset + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    elif kind == "flip":
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(fields.end)
            data[at] ^= 1 << rng.randrange(8)
    elif kind == "bytes":
        at = rng.randrange(fields.end)
        data[at : at + 4] = bytes(rng.getrandbits(8) for _ in range(4))
    elif kind == "truncate":
        del data[rng.randrange(len(data)) :]
    else:
        start = rng.randrange(fields.end)
        stop = min(fields.end, start + rng.randint(1, 64))
        if kind == "delete":
            del data[start:stop]
        else:
            data[stop:stop] = data[start:stop]
    return bytes(data)


def _json_paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _json_paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node[:8]):  # the first elements of long arrays are enough
            yield from _json_paths(v, (*path, i))


def mutate_store(seed: bytes, rng: random.Random) -> bytes:
    from ntio import _core

    header = bytearray(seed[:4096])
    manifest_offset, manifest_length = struct.unpack_from("<QQ", header, 16)
    data = bytearray(seed)
    kind = rng.choice(["manifest", "manifest", "manifest", "header", "truncate"])
    if kind == "header":
        at = rng.randrange(48)
        data[at] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == "truncate":
        return bytes(data[: rng.randrange(len(data))])
    manifest = json.loads(seed[manifest_offset : manifest_offset + manifest_length])
    paths = [p for p in _json_paths(manifest) if p]
    target = rng.choice(paths)
    parent = manifest
    for key in target[:-1]:
        parent = parent[key]
    replacement = rng.choice([None, -1, 0, 1, 1 << 40, (1 << 64) - 1, 1 << 64, "x", [], {}, 1.5, True, "\udcff"])
    if rng.random() < 0.15 and isinstance(parent, dict):
        del parent[target[-1]]
    else:
        parent[target[-1]] = replacement
    body = json.dumps(manifest).encode()
    return bytes(_core.store_header(manifest_offset, body)) + bytes(data[4096:manifest_offset]) + body


def exercise(path: Path, rng: random.Random) -> str:
    """Open `path` as ntio does; 'ok' or 'rejected' (an NtioError). Any other exception propagates."""
    import ntio
    from ntio.errors import NtioError
    from ntio.formats.model_file import open_model_file
    from ntio.models.config import ModelConfig
    from ntio.models.weights import WeightLayout
    from ntio.text.tokenizer import Tokenizer

    try:
        f = open_model_file(path)
        cfg = ModelConfig.from_gguf(f)
        Tokenizer.from_gguf(f).encode("hello world")
        WeightLayout(f, cfg)
        m = ntio.load(path, tiers=rng.choice(["A", "C"]), max_context=min(32, cfg.context_length))
        m.generate([1, 2, 3], 2)
        m.close()
        return "ok"
    except NtioError:
        return "rejected"


def make_seeds(directory: Path) -> list[Path]:
    from ntio.formats.store import convert
    from ntio.synth import SynthSpec, write_synthetic_gguf

    spec = SynthSpec(n_layers=2, d_model=256, d_ff=256, n_heads=2, n_kv_heads=1, vocab_size=300, context_length=64)
    g = write_synthetic_gguf(directory / "seed.gguf", spec)
    return [g, convert(g, directory / "seed.ntio")]


def worker(seed_paths: list[Path], start: int, count: int, work: Path, failures: Path) -> None:
    """Run inputs `start .. start + count` (input i is fully determined by i); print one line per input."""
    seeds = [p.read_bytes() for p in seed_paths]
    gguf_fields = walk_gguf(seeds[0])
    current = work / "current"
    for i in range(start, start + count):
        rng = random.Random(i)
        is_store = i % 4 == 3
        data = mutate_store(seeds[1], rng) if is_store else mutate_gguf(seeds[0], gguf_fields, rng)
        current.write_bytes(data)
        (work / "current.index").write_text(str(i))
        try:
            outcome = exercise(current, rng)
        except Exception:  # noqa: BLE001 - anything but NtioError is what the fuzzer looks for
            saved = failures / f"input-{i}{'.ntio' if is_store else '.gguf'}"
            shutil.copy(current, saved)
            saved.with_suffix(".txt").write_text(traceback.format_exc())
            outcome = "FAIL"
        print(i, outcome, flush=True)


@dataclass
class Report:
    iterations: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # saved inputs: exceptions, hangs, memory blow-ups


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_chunks(iterations: int, out: Path, *, start: int = 0, chunk: int = 500, jobs: int = 1,
               stall_s: float = 60.0, rss_limit: int = 3 << 30) -> Report:
    """Run inputs start .. start + iterations in worker subprocesses of `chunk` inputs, `jobs` at a time.

    A worker that reports nothing for `stall_s` (a hang) or whose RSS passes `rss_limit` (unbounded allocation) is
    killed; its current input is saved as a failure and the chunk resumes after it.
    """
    out.mkdir(parents=True, exist_ok=True)
    failures = out / "failures"
    failures.mkdir(exist_ok=True)
    seeds = make_seeds(out)
    report = Report()
    todo = [(s, min(chunk, start + iterations - s)) for s in range(start, start + iterations, chunk)]
    running: list[tuple[subprocess.Popen, Path, float, int, int]] = []
    pending: dict[int, bytes] = {}  # worker pid -> the part of its output after the last full line
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}

    def launch(first: int, count: int) -> None:
        work = Path(tempfile.mkdtemp(prefix="ntio-fuzz-", dir=out))
        args = [sys.executable, __file__, "--worker", str(first), str(count), str(work), str(failures),
                *map(str, seeds)]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        os.set_blocking(proc.stdout.fileno(), False)
        running.append((proc, work, time.monotonic(), first, first + count))
        pending[proc.pid] = b""

    while todo or running:
        while todo and len(running) < jobs:
            launch(*todo.pop(0))
        time.sleep(0.05)
        for entry in list(running):
            proc, work, last, first, stop = entry
            try:
                pending[proc.pid] += os.read(proc.stdout.fileno(), 1 << 16)
            except BlockingIOError:
                pass
            *lines, pending[proc.pid] = pending[proc.pid].split(b"\n")
            for line in lines:
                index, outcome = line.decode().split()
                report.iterations += 1
                report.outcomes[outcome] = report.outcomes.get(outcome, 0) + 1
                if outcome == "FAIL":
                    report.failures.append(str(failures / f"input-{index}"))
                last, first = time.monotonic(), int(index) + 1
            running[running.index(entry)] = entry = (proc, work, last, first, stop)
            done = proc.poll() is not None
            stalled = time.monotonic() - last > stall_s
            bloated = _rss_bytes(proc.pid) > rss_limit
            if done and first >= stop:
                running.remove(entry)
                shutil.rmtree(work, ignore_errors=True)
                continue
            if done or stalled or bloated:  # the input at `first` crashed, hung or blew up memory
                proc.kill()
                proc.wait()
                why = "crash" if done else "hang" if stalled else "memory"
                saved = failures / f"input-{first}.{why}"
                if (work / "current").exists():
                    shutil.copy(work / "current", saved)
                report.iterations += 1
                report.outcomes[why] = report.outcomes.get(why, 0) + 1
                report.failures.append(str(saved))
                running.remove(entry)
                shutil.rmtree(work, ignore_errors=True)
                if first + 1 < stop:
                    todo.insert(0, (first + 1, stop - first - 1))
    return report


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        first, count, work, failures, *seeds = sys.argv[2:]
        worker([Path(s) for s in seeds], int(first), int(count), Path(work), Path(failures))
        return
    ap = argparse.ArgumentParser(description="Fuzz ntio's model-file parsers (GGUF and store).")
    ap.add_argument("--iterations", type=int, default=100_000)
    ap.add_argument("--start", type=int, default=0, help="first input index (inputs are determined by index)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--chunk", type=int, default=500)
    ap.add_argument("--out", type=Path, default=Path("fuzz-out"))
    args = ap.parse_args()
    started = time.monotonic()
    report = run_chunks(args.iterations, args.out, start=args.start, chunk=args.chunk, jobs=args.jobs)
    print(json.dumps({"iterations": report.iterations, "outcomes": report.outcomes, "failures": report.failures,
                      "seconds": round(time.monotonic() - started, 1)}))
    sys.exit(1 if report.failures else 0)


if __name__ == "__main__":
    main()
