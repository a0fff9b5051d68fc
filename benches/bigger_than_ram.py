"""Bigger than RAM: ntio and llama.cpp decoding the same GGUF inside a memory cgroup, at several caps.

Every run is a fresh process in a fresh memory cgroup capped at the given size, the page cache dropped first
(../shared/tools/capped.sh, as root). The cap counts the process's memory and the page cache it fills, so llama.cpp's
memory-mapped weights compete with everything else under it. ntio derives its RAM budget from the cgroup (no
--ram-budget unless passed with --ntio-arg); llama.cpp (llama-cpp-python, ../shared/tools/llamacpp_decode.py) runs
with repacking off (weights stay in the mmap: the issue's peer) and with its defaults. All engines get the same chat
prompt (as plain text where the model has no chat template, as the synthetic ones; llama-cpp-python then applies its
fallback format), greedy tokens, threads and context (512); decode tok/s excludes prefill (ntio's from the first generated
token on, llama.cpp's from its perf counters). Engines alternate within every round (the order rotates by one each
round). Once per round per model, outside any cgroup, the disk's cold sequential O_DIRECT bandwidth over the model's
layer bytes is measured (1 GB, stream_bound.disk_gb_s), which gives ntio's bound for that round:
    disk GB/s / ntio's bytes read per token
and, with ntio among the engines, ntio's decode with every layer resident, uncapped (`--tiers A`): the rate of its
compute alone. A token can be no faster than its reads, nor than its compute: the second bound is
    min(disk bound, compute rate)
(reached when every read overlaps compute; the disk bound alone ignores that every layer, resident or read, computes).
A run's outcome is its decode tok/s, or "refused: <ntio's error line>", "oom-killed", "timeout" or "error: ...".
Prints one JSON object: per-round outcomes, cgroup peaks, ntio's bytes read per token and tiers, median tok/s over
the rounds that succeeded, per-round ratios ntio / llama.cpp (repacking off) and ntio / bound with their medians.
Progress and, at the end, a Markdown table for benches/RESULTS.md go to stderr.

    python benches/bigger_than_ram.py --model PATH|NAME:CAP[,CAP...] [--model ...] [--rounds 3] [--tokens 8]
                                      [--engines ntio,llamacpp-norepack,llamacpp-default] [--threads 2]
                                      [--timeout 600] [--ntio-arg=--OPTION]... [--out FILE]
Caps are decimal: 1.5G is 1.5e9 bytes, 900M is 9e8 (passed to the cgroup in bytes). Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from ntio.fetch import resolve_model
from ntio.formats.model_file import open_model_file
from ntio.plots import check_figure_path
from figures import bigger_than_ram as draw
from stream_bound import disk_gb_s, layer_span

PROMPT = "Write a short paragraph about rivers."
CTX = 512
DISK_BYTES = 10**9
TOOLS = Path(__file__).resolve().parents[2] / "shared" / "tools"
CAPPED = TOOLS / "capped.sh"
PEER_SCRIPT = TOOLS / "llamacpp_decode.py"
PEER_PYTHON = Path.home() / ".cache" / "ntio-peers" / "llamacpp-venv" / "bin" / "python"
NTIO = Path(sys.executable).with_name("ntio")
ENGINES = {"ntio": "ntio", "llamacpp-norepack": "llama.cpp (mmap, repacking off)",
           "llamacpp-default": "llama.cpp (mmap, defaults)"}
PEER = "llamacpp-norepack"  # the engine ntio's ratio is taken against


def parse_cap(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([GM])B?", text.strip(), re.IGNORECASE)
    if not match:
        raise SystemExit(f"bad cap {text!r}: expected e.g. 1.5G or 900M")
    return round(float(match[1]) * (1e9 if match[2].upper() == "G" else 1e6))


def parse_model(spec: str) -> tuple[Path, dict[str, int]]:
    """'PATH|NAME:CAP1,CAP2' -> (model file, {cap label: bytes})."""
    model, _, caps = spec.rpartition(":")
    if not model or not caps:
        raise SystemExit(f"bad --model {spec!r}: expected PATH|NAME:CAP[,CAP...]")
    return resolve_model(os.path.expanduser(model)), {label: parse_cap(label) for label in caps.split(",")}


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    field = lambda name: next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith(name)), "")
    flags = field("flags").split()
    mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    return {"cpu": field("model name") or platform.machine(), "cpus": os.cpu_count(), "avx2": "avx2" in flags,
            "avx512f": "avx512f" in flags, "mem_total_gb": round(mem_kb * 1024 / 1e9, 2),
            "kernel": platform.release()}


def reap_cgroup(pid: int) -> int | None:
    """After capped.sh (pid) was killed it cannot clean up: read its cgroup's peak and remove the cgroup."""
    for cgroup, peak in ((Path(f"/sys/fs/cgroup/memory/ntio-cap-{pid}"), "memory.max_usage_in_bytes"),
                         (Path(f"/sys/fs/cgroup/ntio-cap-{pid}"), "memory.peak")):
        if cgroup.is_dir():
            value = int((cgroup / peak).read_text())
            for _ in range(100):  # the killed processes leave the cgroup as they exit
                try:
                    cgroup.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
            return value
    return None


def run_capped(cmd: list[str], cap: int, timeout: float, env: dict[str, str]) -> dict:
    """One run in its own capped cgroup: {peak_bytes, seconds} and the command's JSON as `result` if it succeeded,
    else why not as `outcome`."""
    start = time.perf_counter()
    proc = subprocess.Popen([str(CAPPED), *cmd], env={**env, "CAP": str(cap)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"outcome": "timeout", "peak_bytes": reap_cgroup(proc.pid), "seconds": timeout}
    peak = re.search(r"^peak_bytes (\d+)$", err, re.MULTILINE)
    run = {"peak_bytes": int(peak[1]) if peak else None, "seconds": round(time.perf_counter() - start, 1)}
    if proc.returncode == 0:
        return {**run, "result": json.loads(out.strip().splitlines()[-1])}
    if proc.returncode in (137, -signal.SIGKILL):
        return {"outcome": "oom-killed", **run}
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("peak_bytes")]
    refusal = next((line for line in lines if line.startswith("ntio: error:")), None)
    if refusal:
        return {"outcome": f"refused: {refusal}", **run}
    return {"outcome": f"error: {lines[-1] if lines else f'exit {proc.returncode}'}", **run}


def run_engine(engine: str, path: Path, cap: int, args: argparse.Namespace) -> dict:
    """One decode of `engine` under `cap`: outcome (tok/s or why not), peak cgroup bytes, and for ntio its plan."""
    if engine == "ntio":
        chat = ["--chat"] if "tokenizer.chat_template" in open_model_file(path).metadata else []
        cmd = [str(NTIO), "generate", "-m", str(path), "-p", PROMPT, "-n", str(args.tokens), *chat,
               "--ctx-size", str(CTX), "--threads", str(args.threads), "--json", *args.ntio_arg]
        env = dict(os.environ)
    else:
        cmd = [str(PEER_PYTHON), str(PEER_SCRIPT), str(path), str(args.tokens), PROMPT]
        env = {k: v for k, v in os.environ.items() if k != "NO_REPACK"}
        env.update(THREADS=str(args.threads), NCTX=str(CTX), **({"NO_REPACK": "1"} if engine == PEER else {}))
    run = run_capped(cmd, cap, args.timeout, env)
    result = run.pop("result", None)
    if result is None:
        return run
    run = {"outcome": round(result["decode_tok_s"], 3), **run}
    if engine == "ntio":
        stats = result["stats"]
        run.update(tokens=result["n_generated_tokens"], tiers=result["tiers"],
                   bytes_read_per_token=stats["bytes_read_per_token"], ntio_disk_gb_s=round(stats["disk_gb_s"], 3),
                   io_wait_s=round(stats["io_wait_s"], 3), layers_per_tier=stats["layers_per_tier"])
    else:
        run["tokens"] = result["n_eval"]
    return run


def compute_rate(path: Path, args: argparse.Namespace) -> float | None:
    """ntio's decode tok/s with every layer and the head resident, uncapped: its compute alone."""
    cmd = [str(NTIO), "generate", "-m", str(path), "-p", PROMPT, "-n", str(args.tokens), "--ctx-size", str(CTX),
           "--threads", str(args.threads), "--tiers", "A", "--json"]
    if "tokenizer.chat_template" in open_model_file(path).metadata:
        cmd.append("--chat")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    return round(json.loads(done.stdout.strip().splitlines()[-1])["decode_tok_s"], 3) if done.returncode == 0 else None


def tok_s(run: dict) -> float | None:
    return run["outcome"] if isinstance(run["outcome"], float) else None


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def summarize_cap(label: str, cap: int, runs: dict[str, list[dict]], disk: list[float], compute: list[float | None]
                  ) -> dict:
    """Medians per engine; per-round ratios ntio / llama.cpp (repacking off), ntio / its disk bound and ntio / the
    lower of the disk bound and its compute rate."""
    entry = {"cap": label, "cap_bytes": cap, "engines": {}}
    for engine, rows in runs.items():
        peaks = [row["peak_bytes"] for row in rows if row["peak_bytes"] is not None]
        entry["engines"][engine] = {"label": ENGINES[engine], "runs": rows,
                                    "median_tok_s": median([tok_s(row) for row in rows]),
                                    "max_peak_bytes": max(peaks, default=None)}
    ntio, peer = runs.get("ntio"), runs.get(PEER)
    if ntio and peer:
        ratios = [tok_s(a) / tok_s(b) if tok_s(a) and tok_s(b) else None for a, b in zip(ntio, peer)]
        entry["ratio_vs_llamacpp_norepack"] = [None if x is None else round(x, 3) for x in ratios]
        entry["median_ratio_vs_llamacpp_norepack"] = median(ratios)
    if ntio:
        bounds = [gb_s * 1e9 / row["bytes_read_per_token"] if tok_s(row) and row["bytes_read_per_token"] else None
                  for row, gb_s in zip(ntio, disk)]
        ratios = [tok_s(row) / bound if bound else None for row, bound in zip(ntio, bounds)]
        entry["ntio_bound_tok_s"] = [None if x is None else round(x, 3) for x in bounds]
        entry["ntio_ratio_to_bound"] = [None if x is None else round(x, 3) for x in ratios]
        entry["median_ntio_ratio_to_bound"] = median(ratios)
        both = [min(bound, rate) if bound and rate else None for bound, rate in zip(bounds, compute)]
        ratios = [tok_s(row) / b if b else None for row, b in zip(ntio, both)]
        entry["ntio_ratio_to_disk_and_compute_bound"] = [None if x is None else round(x, 3) for x in ratios]
        entry["median_ntio_ratio_to_disk_and_compute_bound"] = median(ratios)
    return entry


def markdown_table(models: list[dict]) -> str:
    """One row per (model, cap, engine); the ratio, bytes and bound columns are ntio's."""
    fmt = lambda x, spec: "–" if x is None else format(x, spec)
    lines = ["| model | cap | engine | median decode tok/s | ntio / llama.cpp (repack off) | MB read/token "
             "| ntio / bound | ntio / min(bound, compute) | peak GB |", "|---|---|---|---|---|---|---|---|---|"]
    for model in models:
        for entry in model["caps"]:
            for engine, e in entry["engines"].items():
                ok = [row for row in e["runs"] if tok_s(row)]
                speed = (f"{e['median_tok_s']:.2f} ({len(ok)}/{len(e['runs'])} ok)" if ok
                         else e["runs"][-1]["outcome"].split(":")[0])
                ratio, per_token, bound, both = None, None, None, None
                if engine == "ntio":
                    ratio, bound = entry.get("median_ratio_vs_llamacpp_norepack"), entry["median_ntio_ratio_to_bound"]
                    both = entry["median_ntio_ratio_to_disk_and_compute_bound"]
                    per_token = statistics.median(row["bytes_read_per_token"] for row in ok) / 1e6 if ok else None
                peak = e["max_peak_bytes"] / 1e9 if e["max_peak_bytes"] is not None else None
                lines.append(f"| {model['model']} | {entry['cap']} | {e['label']} | {speed} | {fmt(ratio, '.2f')} "
                             f"| {fmt(per_token, '.0f')} | {fmt(bound, '.2f')} | {fmt(both, '.2f')} "
                             f"| {fmt(peak, '.2f')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True, metavar="PATH|NAME:CAP[,CAP...]",
                    help="model and its cgroup caps, e.g. ~/.cache/ntio/synth/8b-20L-q4k.gguf:1.5G,2G,3G (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8, help="greedy tokens generated per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {', '.join(ENGINES)}")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run before it is killed")
    ap.add_argument("--ntio-arg", action="append", default=[], help="extra option for ntio generate (repeatable; "
                                                                     "write --ntio-arg=--sync for a leading dash)")
    ap.add_argument("--out", type=Path, help="also write the JSON object to this file")
    ap.add_argument("--plot", type=Path, help="draw the result into this PNG (benches/figures.py)")
    args = ap.parse_args()
    if args.plot:
        check_figure_path(args.plot)
    engines = args.engines.split(",")
    if unknown := set(engines) - set(ENGINES):
        raise SystemExit(f"unknown engines {sorted(unknown)}: choose from {', '.join(ENGINES)}")
    models = [parse_model(spec) for spec in args.model]
    spans = {path: layer_span(path) for path, _ in models}
    disk = {path: [] for path, _ in models}
    compute: dict[Path, list[float | None]] = {path: [] for path, _ in models}
    runs = {(path, label): {engine: [] for engine in engines} for path, caps in models for label in caps}
    for r in range(args.rounds):
        order = engines[r % len(engines):] + engines[: r % len(engines)]
        for path, caps in models:
            disk[path].append(round(disk_gb_s(path, spans[path], DISK_BYTES), 3))
            compute[path].append(compute_rate(path, args) if "ntio" in engines else None)
            print(f"round {r} {path.name}: disk {disk[path][-1]} GB/s, ntio resident {compute[path][-1]} tok/s",
                  file=sys.stderr)
            for label, cap in caps.items():
                for engine in order:
                    run = {"round": r, **run_engine(engine, path, cap, args)}
                    runs[path, label][engine].append(run)
                    print(f"round {r} {path.name} cap {label} {engine}: {run['outcome']}, peak "
                          f"{run['peak_bytes']}, {run.get('tiers', '')} ({run['seconds']} s)", file=sys.stderr)
    result = {"benchmark": "bigger_than_ram", "date": datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": shlex.join(["python", *sys.argv]), "machine": machine(), "prompt": PROMPT,
              "tokens": args.tokens, "threads": args.threads, "ctx_size": CTX, "rounds": args.rounds,
              "engines": {engine: ENGINES[engine] for engine in engines}, "ntio_args": args.ntio_arg, "models": []}
    for path, caps in models:
        result["models"].append({
            "model": path.name, "path": str(path), "file_gb": round(path.stat().st_size / 1e9, 3),
            "disk_gb_s": disk[path], "ntio_resident_tok_s": compute[path],
            "caps": [summarize_cap(label, cap, runs[path, label], disk[path], compute[path])
                     for label, cap in caps.items()]})
    text = json.dumps(result)
    if args.out:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.out)
    print(text)
    print(markdown_table(result["models"]), file=sys.stderr)
    if args.plot:
        draw(result, args.plot)


if __name__ == "__main__":
    main()
