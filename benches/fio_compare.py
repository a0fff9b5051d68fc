"""ntio's reader against fio on the same cold file: sequential O_DIRECT reads, same block size and queue depth.

Not a test. Installs fio with apt-get if it is missing, creates a test file of random bytes on the root disk
(`--file`, default /var/tmp/ntio-fio-test.bin; not tmpfs), then runs, for each (block size, queue depth) case,
fio (`--ioengine=io_uring --direct=1 --rw=read`) and `ntio-bench read` alternately (A B, B A, ...) for `--rounds`
rounds, and prints one JSON object: per-round GB/s (1e9 B/s) of each, and the median ratio ntio / fio per case.
Reads are cold because both use O_DIRECT (no page cache). Last, `ntio-bench extents`: random 64 KiB extents of
half the file, bandwidth on the bytes asked for divided by the sequential bandwidth of the same run.

    python benches/fio_compare.py [--file PATH] [--size-gib 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

CASES = [(128 << 10, 16), (1 << 20, 4), (1 << 20, 32)]


def ensure_fio() -> str:
    if shutil.which("fio") is None:
        subprocess.run(["apt-get", "install", "-y", "fio"], check=True, stdout=subprocess.DEVNULL)
    return subprocess.run(["fio", "--version"], capture_output=True, text=True, check=True).stdout.strip()


def make_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    chunk = 64 << 20
    with open(path, "wb") as f:
        for _ in range(size // chunk):
            f.write(os.urandom(chunk))
        f.flush()
        os.fsync(f.fileno())


def fio_gb_s(path: Path, size: int, block: int, depth: int) -> dict:
    out = subprocess.run(
        ["fio", "--name=seqread", f"--filename={path}", "--ioengine=io_uring", "--direct=1", "--rw=read",
         f"--bs={block}", f"--iodepth={depth}", f"--size={size}", "--numjobs=1", "--output-format=json"],
        capture_output=True, text=True, check=True).stdout
    job = json.loads(out)["jobs"][0]["read"]
    clat = job["clat_ns"]["percentile"]
    return {"gb_s": job["bw_bytes"] / 1e9, "lat_p50_us": clat["50.000000"] / 1e3, "lat_p99_us": clat["99.000000"] / 1e3}


def ntio_bench(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "ntio.bench", *args, "--json"], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, default=Path("/var/tmp/ntio-fio-test.bin"))
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    size = int(args.size_gib * (1 << 30)) // (64 << 20) * (64 << 20)
    fio_version = ensure_fio()
    make_file(args.file, size)
    report = {"file": str(args.file), "bytes": size, "fio": fio_version, "rounds": args.rounds, "cases": []}
    for block, depth in CASES:
        rounds = []
        for i in range(args.rounds):
            # A B B A ...: neither tool always runs right after the other.
            runs = {
                "fio": lambda: fio_gb_s(args.file, size, block, depth),
                "ntio": lambda: ntio_bench("read", str(args.file), "--block-size", str(block), "--queue-depth",
                                           str(depth), "--size", str(size)),
            }
            order = ["fio", "ntio"] if i % 2 == 0 else ["ntio", "fio"]
            got = {name: runs[name]() for name in order}
            fio, ntio = got["fio"], got["ntio"]
            rounds.append({"fio_gb_s": fio["gb_s"], "ntio_gb_s": ntio["gb_s"], "ratio": ntio["gb_s"] / fio["gb_s"],
                           "fio_lat_p50_us": fio["lat_p50_us"], "ntio_lat_p50_us": ntio["lat_p50_us"],
                           "fio_lat_p99_us": fio["lat_p99_us"], "ntio_lat_p99_us": ntio["lat_p99_us"]})
        report["cases"].append({
            "block_size": block, "queue_depth": depth, "backend": ntio["backend"], "rounds": rounds,
            "median_fio_gb_s": statistics.median(r["fio_gb_s"] for r in rounds),
            "median_ntio_gb_s": statistics.median(r["ntio_gb_s"] for r in rounds),
            "median_ratio": statistics.median(r["ratio"] for r in rounds),
        })
    sparse = [ntio_bench("extents", str(args.file), "--extent-size", "65536", "--fraction", "0.5", "--size",
                         str(size), "--seed", str(i)) for i in range(args.rounds)]
    report["extents_64k_half"] = {
        "rounds": [{"gb_s": s["gb_s"], "seq_gb_s": s["seq_gb_s"], "ratio": s["ratio"]} for s in sparse],
        "median_ratio": statistics.median(s["ratio"] for s in sparse),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
