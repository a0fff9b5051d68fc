"""Adaptive depth priced (issue 14): perplexity ratio, greedy agreement, bytes per token and streamed tok/s of each
method at a sweep of its knob, against the dense model.

Methods: the post-compute cosine skip (baseline: reads and computes everything), predictive skip before the load,
EMAD early exit with the per-token and the monotone schedule. Calibration: `ntio calibrate` on the package's longer
docstrings (benches/sparse_ffn.py's text); evaluation: README.md, so the budgets (met on the calibration's held-out
tokens) are checked on text the calibration never saw.

Per setting:
  * perplexity ratio to dense (windows of 512) and the bytes a decode of each scored token would read, over the
    dense bytes (`bytes_fraction`: every position decided as if decoded alone);
  * greedy generation of --tokens tokens per chat prompt, all-C streamed (every layer read from disk at each step;
    page cache bypassed by O_DIRECT), alternating with the dense model prompt by prompt: agreement with the dense
    tokens (share of positions before the first difference), bytes read per token (the reader's own count) and
    the tok/s ratio, median over prompts.
Prints one JSON object per setting, writes them all to --json, and plots perplexity ratio against bytes per token
(one line per method) to --plot.

    python benches/adaptive_depth.py --model smollm2-135m qwen2.5-coder-1.5b --json benches/adaptive_depth.json \
        --plot benches/adaptive_depth.png
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path

import ntio
from ntio.fetch import resolve_model
from ntio.policies.adaptive import adaptive_policy, adaptive_report
from ntio.policies.cosine_skip import CosineSkipPolicy
from ntio.policies.dense import DensePolicy
from ntio.policies.depth_profile import calibrate_depth
from sparse_ffn import calibration_text

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Explain in three sentences what a page cache is.",
    "Write a Python function that merges two sorted lists.",
    "Summarise the plot of Romeo and Juliet in four sentences.",
]


def settings(args) -> list[tuple[str, dict]]:
    out = [("cosine", {"threshold": t}) for t in args.cosine]
    out += [("skip", {"budget": b}) for b in args.budgets]
    out += [("exit per-token", {"budget": b, "schedule": "per-token"}) for b in args.budgets]
    out += [("exit monotone", {"budget": b, "schedule": "monotone"}) for b in args.budgets[:1]]
    return out


def make_policy(m: ntio.LLM, calib: Path, method: str, knob: dict, scoring: bool):
    if method == "cosine":
        return CosineSkipPolicy(knob["threshold"])
    if method == "skip":
        return adaptive_policy(m, calib, knob["budget"], "skip", prompt_full_depth=not scoring)
    return adaptive_policy(m, calib, knob["budget"], "exit", knob["schedule"], prompt_full_depth=not scoring)


def report(policy) -> dict:
    if isinstance(policy, CosineSkipPolicy):
        return {"reverted_share": policy.reverted_share(), "bytes_fraction": 1.0}
    return adaptive_report(policy)


def generate(m: ntio.LLM, policy, prompt: str, tokens: int) -> tuple[list[int], float, float]:
    m.policy = policy
    m.engine.kv.crop(0)
    first = len(m.stats.forwards)
    c = m.generate(prompt, tokens, chat=True)
    steps = [f for f in m.stats.forwards[first:] if f.n_tokens == 1]  # decode steps (the prompt's pass reads all)
    return c.token_ids, c.decode_tok_s, sum(f.bytes_read for f in steps) / max(len(steps), 1)


def agreement(a: list[int], b: list[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(len(a), 1)


def bench_model(name: str, args) -> list[dict]:
    path = resolve_model(name)
    m = ntio.load(path)
    calib = Path(tempfile.mkdtemp()) / "depth.calib"
    calibrate_depth(m, calibration_text(), sorted(set(range(m.config.n_layers // 4 - 1, m.config.n_layers - 1, 4))),
                    n_tokens=args.calib_tokens).save(calib)
    readme = (ROOT / "README.md").read_text()
    m.policy = DensePolicy()
    dense = m.perplexity(readme).perplexity
    m.close()
    streamed = ntio.load(path, tiers="C")
    scorer = ntio.load(path)
    rows = []
    for method, knob in settings(args):
        row = {"model": name, "method": method, **knob}
        try:
            scorer.policy = make_policy(scorer, calib, method, knob, scoring=True)
        except ntio.NtioError as e:
            row["error"] = str(e)
            print(json.dumps(row), flush=True)
            rows.append(row)
            continue
        row["perplexity_ratio"] = scorer.perplexity(readme).perplexity / dense
        row["scoring"] = report(scorer.policy)
        agree, speed, reads = [], [], []
        for prompt in PROMPTS:
            base_ids, base_speed, base_read = generate(streamed, DensePolicy(), prompt, args.tokens)
            policy = make_policy(streamed, calib, method, knob, scoring=False)
            ids, tok_s, read = generate(streamed, policy, prompt, args.tokens)
            agree.append(agreement(base_ids, ids))
            speed.append(tok_s / base_speed)
            reads.append(read / base_read)
        row.update({"greedy_agreement": statistics.mean(agree), "all_c_tok_s_ratio": statistics.median(speed),
                    "all_c_bytes_read_ratio": statistics.median(reads)})
        print(json.dumps(row), flush=True)
        rows.append(row)
    streamed.close()
    scorer.close()
    return [{"model": name, "method": "dense", "perplexity": dense}, *rows]


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        ax.scatter([1.0], [1.0], marker="*", s=120, color="black", label="dense")
        for method in ("cosine", "skip", "exit per-token", "exit monotone"):
            pts = sorted((r["scoring"]["bytes_fraction"], r["perplexity_ratio"]) for r in rows
                         if r["model"] == model and r["method"] == method and "perplexity_ratio" in r)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method)
        ax.set(title=model, xlabel="bytes read per token / dense", ylabel="perplexity / dense", yscale="log")
        ax.axhline(1.02, color="grey", linestyle=":", linewidth=1)
        ax.axvline(0.85, color="grey", linestyle=":", linewidth=1)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--cosine", nargs="+", type=float, default=[0.99, 0.98, 0.95])
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.97, 0.93, 0.85])
    ap.add_argument("--tokens", type=int, default=48, help="Greedy tokens per prompt")
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    rows = [r for name in args.model for r in bench_model(name, args)]
    summary = {"machine": platform.processor() or platform.machine(), "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot([r for r in rows if r["method"] != "dense"], args.plot)


if __name__ == "__main__":
    main()
