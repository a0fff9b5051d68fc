"""Serving under load: aggregate tok/s of `ntio serve` and llama.cpp's `llama-server` at 1, 2, 4, 8 concurrent clients.

Each engine runs as a server in its own process with the same slots (`--parallel`), context per slot, threads and
model file; engines alternate within every round (the order rotates). At each concurrency c, c client threads each
send `--requests` streamed chat completions one after another (greedy, `--tokens` tokens, each client its own
questions) as raw server-sent events (httpx); the aggregate is the completion tokens of all of them over the wall time
from the first request to the last answer. Once per round, `ntio generate` decodes one question alone in a fresh
process: the single-client HTTP decode rate (from the first streamed token to the last) is compared with it.

    python benches/serve_load.py [--model NAME|PATH] [--tiers A] [--clients 1 2 4 8] [--requests 2] [--tokens 64]
                                 [--rounds 3] [--parallel 8] [--slot-context 512] [--threads 2]
                                 [--engines ntio,ntio-lookup,ntio-draft,ntio-draft-chains,ntio-self,ntio-self-lookup,
                                            llama-server]
                                 [--draft NAME|PATH] [--self-draft CALIBRATION]
                                 [--prompts questions|rewrite]
                                 [--llama-server PATH] [--out FILE]

Prints one JSON object (per-round figures, medians, ratios); a Markdown table for benches/RESULTS.md on stderr.
llama-server comes from ../shared/tools/build-llama-server.sh.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from ntio.fetch import resolve_model
from ntio.plots import check_figure_path
from figures import serve_load as draw

QUESTIONS = [
    "Write a short paragraph about rivers.", "Explain what a hash table is.", "Describe a sunrise over the sea.",
    "Give three tips for learning to code.", "What makes a good cup of tea?", "Summarize the water cycle.",
    "Describe a busy market.", "Why do leaves change colour in autumn?",
]
# Rewrite-this-text prompts: answers that copy their prompts, where prompt lookup drafts well (engine ntio-lookup).
REWRITES = [f"Rewrite this text with its spelling fixed, and change nothing else:\n\n{text}" for text in (
    "The river flows thru the vally and past the old mill, wher children play on warm sumer evenings.",
    "A hash tabel stores keys and values; it finds a key by hashing it to a bucket and serching that bucket.",
    "The sun rose slowy over the sea, and the fishing boats set out one by one into the golden mornning light.",
    "To lern to code, write small programs evry day, read other peoples code, and fix your own mistaks.",
    "A good cup of tea needs fresh water, a warmed pot, and paitence while the leafs steep for three minuts.",
    "Water evaporates from the sea, forms clouds, falls as rain, and flows bak to the sea in rivers and streems.",
    "The market was bussy: traders called out prices, and the smell of bread and spices filed the narow streets.",
    "In autum the days grow shorter, trees stop making clorophyll, and the leaves turn red, orange and yelow.",
)]
# Code prompts: long answers, on which a code model's smaller sibling agrees with it most (engine ntio-draft).
CODE = [f"Write a Python function that {task}. Reply with the code only." for task in (
    "returns the n-th Fibonacci number iteratively", "checks whether a string is a palindrome",
    "merges two sorted lists into one sorted list", "counts the words in a text file",
    "returns the prime numbers below n with a sieve", "flattens a nested list of lists",
    "parses a CSV line into fields, honouring quotes", "computes the median of a list of numbers",
)]
PROMPTS = {"questions": QUESTIONS, "rewrite": REWRITES, "code": CODE}
NTIO = Path(sys.executable).with_name("ntio")
LLAMA_SERVER = Path.home() / ".cache/ntio-peers/llama-server-0.3.36/build/bin/llama-server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serving(cmd: list[str], url: str, health: str):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + health, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} did not come up")
            time.sleep(0.3)
        yield
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        if proc.poll() is None:
            proc.kill()


def _server_cmd(engine: str, model: str, port: int, args: argparse.Namespace) -> tuple[list[str], str]:
    ctx = args.parallel * args.slot_context
    if engine.startswith("ntio"):
        speculation = {"ntio": [], "ntio-lookup": ["--lookup"], "ntio-draft": ["--draft", str(args.draft)],
                       "ntio-draft-chains": ["--draft", str(args.draft), "--branches", "0"],
                       "ntio-self": ["--self-draft", str(args.self_draft)],
                       "ntio-self-lookup": ["--self-draft", str(args.self_draft), "--lookup"]}[engine]
        return ([str(NTIO), "serve", "-m", model, "--port", str(port), "--parallel", str(args.parallel),
                 "--ctx-size", str(ctx), "--threads", str(args.threads), "--tiers", args.tiers,
                 "--max-queue", "64", "--model-id", "m", *speculation], "/health")
    return ([args.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "--parallel",
             str(args.parallel), "-c", str(ctx), "-t", str(args.threads), "-tb", str(args.threads), "--alias", "m",
             "--no-webui", "-np", str(args.parallel)], "/health")


def _one(client: httpx.Client, url: str, question: str, tokens: int) -> tuple[int, float | None]:
    """One streamed chat completion: (completion tokens, decode tok/s from the first token to the last). Raw
    server-sent events through httpx: a light client, so that the client's own CPU time (on the same machine)
    weighs little on the servers measured."""
    stamps, usage = [], None
    body = {"model": "m", "messages": [{"role": "user", "content": question}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # a failure after the 200: an answer that must not count
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    n = usage if usage is not None else len(stamps)
    rate = (n - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else None
    return n, rate


def _load(url: str, clients: int, args: argparse.Namespace) -> dict:
    counts, rates, errors = [], [], []

    def run(c: int) -> None:
        client = httpx.Client(timeout=1800)
        for i in range(args.requests):
            try:
                prompts = PROMPTS[args.prompts]
                n, rate = _one(client, url, prompts[(c + i) % len(prompts)], args.tokens)
                counts.append(n)
                if rate is not None:
                    rates.append(rate)
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"aggregate_tok_s": sum(counts) / wall, "tokens": sum(counts), "wall_s": wall,
            "request_decode_tok_s": statistics.median(rates) if rates else None, "errors": errors[:3]}


def _generate(model: str, args: argparse.Namespace) -> float:
    out = subprocess.run([str(NTIO), "generate", "-m", model, "--chat", "-p", PROMPTS[args.prompts][0],
                          "-n", str(args.tokens), "--threads", str(args.threads), "--tiers", args.tiers, "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["decode_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tiers", default="A", help="ntio's tiers (A: resident; C: every layer read from disk)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--slot-context", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="ntio,llama-server",
                    help="of ntio, ntio-lookup (ntio serve --lookup), ntio-draft (--draft DRAFT: draft trees), "
                         "ntio-draft-chains (--draft DRAFT --branches 0: linear drafts), ntio-self (--self-draft "
                         "CALIBRATION), ntio-self-lookup (both) and llama-server")
    ap.add_argument("--draft", help="the draft model of engines ntio-draft and ntio-draft-chains (a name or path)")
    ap.add_argument("--self-draft",
                    help="the exit-head file (`ntio calibrate`) of engines ntio-self and ntio-self-lookup")
    ap.add_argument("--prompts", choices=sorted(PROMPTS), default="questions")
    ap.add_argument("--llama-server", default=str(LLAMA_SERVER))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path, help="draw the result into this PNG (benches/figures.py)")
    args = ap.parse_args()
    if args.plot:
        check_figure_path(args.plot)
    model = str(resolve_model(args.model))
    engines = args.engines.split(",")
    rounds = []
    for r in range(args.rounds):
        row: dict = {"ntio_generate_decode_tok_s": _generate(model, args)} if "ntio" in engines else {}
        for engine in engines[r % len(engines):] + engines[: r % len(engines)]:
            port = _free_port()
            cmd, health = _server_cmd(engine, model, port, args)
            url = f"http://127.0.0.1:{port}"
            with _serving(cmd, url, health):
                for c in args.clients:
                    row[f"{engine}_{c}"] = result = _load(url, c, args)
                    print(json.dumps({"round": r, "engine": engine, "clients": c, **result}), file=sys.stderr)
        rounds.append(row)
    summary: dict = {"model": os.path.basename(model), "tiers": args.tiers, "machine": platform.processor() or
                     platform.machine(), "threads": args.threads, "parallel": args.parallel, "tokens": args.tokens,
                     "requests_per_client": args.requests, "rounds": rounds}
    med = lambda key, what="aggregate_tok_s": statistics.median(row[key][what] for row in rounds)  # noqa: E731
    for engine in engines:
        for c in args.clients:
            summary[f"{engine}_{c}_aggregate_tok_s"] = med(f"{engine}_{c}")
    if "ntio" in engines:
        one = args.clients[0]
        summary["ntio_scaling"] = {c: statistics.median(row[f"ntio_{c}"]["aggregate_tok_s"] /
                                                        row[f"ntio_{one}"]["aggregate_tok_s"] for row in rounds)
                                   for c in args.clients}
        summary["ntio_generate_decode_tok_s"] = statistics.median(row["ntio_generate_decode_tok_s"] for row in rounds)
        summary["http_1_client_vs_generate"] = statistics.median(
            row[f"ntio_{one}"]["request_decode_tok_s"] / row["ntio_generate_decode_tok_s"] for row in rounds)
    for speculative in ("ntio-lookup", "ntio-draft", "ntio-draft-chains", "ntio-self", "ntio-self-lookup"):
        if "ntio" in engines and speculative in engines:
            summary[f"{speculative.removeprefix('ntio-')}_vs_plain"] = {c: statistics.median(
                row[f"{speculative}_{c}"]["aggregate_tok_s"] / row[f"ntio_{c}"]["aggregate_tok_s"] for row in rounds)
                for c in args.clients}
    if "ntio" in engines and "llama-server" in engines:
        summary["ntio_vs_llama_server"] = {c: statistics.median(
            row[f"ntio_{c}"]["aggregate_tok_s"] / row[f"llama-server_{c}"]["aggregate_tok_s"] for row in rounds)
            for c in args.clients}
    text = json.dumps(summary, indent=1)
    if args.plot:
        draw(summary, args.plot)
    if args.out:
        args.out.write_text(text)
    print(text)
    print("| clients | " + " | ".join(f"{e} aggregate tok/s" for e in engines) + " |", file=sys.stderr)
    print("|---" * (len(engines) + 1) + "|", file=sys.stderr)
    for c in args.clients:
        print(f"| {c} | " + " | ".join(f"{summary[f'{e}_{c}_aggregate_tok_s']:.1f}" for e in engines) + " |",
              file=sys.stderr)


if __name__ == "__main__":
    main()
