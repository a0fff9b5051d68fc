"""Adaptive depth priced (issue 14): perplexity ratio, greedy agreement, bytes per token and streamed tok/s of each
method at a sweep of its knob, against the dense model.

Methods: the post-compute cosine skip (baseline: reads and computes everything), predictive skip before the load,
early exit on the predicted KL to the final layer and on the entropy (EMAD), per token, and EMAD's monotone
schedule; and the bound on any exit rule over the same exit heads (`exit oracle`: a token exits where its exit head
is within a KL of the final layer, known by computing every layer, and every K/V is computed). `exit ..., every
K/V` is a diagnostic, scored only: the per-token exits read out at the exit while every token still computes every
layer, which prices the exits apart from the K/V holes they leave (it saves no bytes). Calibration:
`ntio calibrate` on the package's longer docstrings (benches/sparse_ffn.py's text); evaluation: README.md, so the
budgets (met on the calibration's held-out tokens) are checked on text the calibration never saw.

Per setting:
  * perplexity ratio to dense (windows of 512) and the bytes a decode of each scored token would read, over the
    dense bytes (`bytes_fraction`: every position decided as if decoded alone);
  * greedy generation of --tokens tokens per chat prompt, all-C streamed (every layer read from disk at each step;
    page cache bypassed by O_DIRECT), alternating with the dense model prompt by prompt: agreement with the dense
    tokens (share of positions before the first difference), bytes read per token (the reader's own count) and
    the tok/s ratio, median over prompts.
Prints one JSON object per setting, writes them all to --json, and plots perplexity ratio against bytes per token
(one line per method) to --plot.

    cd benches && python adaptive_depth.py --model smollm2-135m qwen2.5-coder-1.5b --cosine 0.98 0.95 \
        --budgets 0.97 0.93 0.85 --calib-tokens 8192 --json adaptive_depth.json --plot adaptive_depth.png

(matplotlib for --plot: `pip install ntio[plot]`; the benchmark imports `sparse_ffn` beside it: run it from benches/.)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path

import torch

import ntio
from ntio.decoding.self_draft import Calibration, fingerprint
from ntio.fetch import resolve_model
from ntio.policies.adaptive import adaptive_policy, adaptive_report
from ntio.policies.cosine_skip import CosineSkipPolicy
from ntio.policies.base import LOAD_ALL, LoadDecision, Observation
from ntio.policies.dense import DensePolicy
from ntio.policies.early_exit import EarlyExitPolicy
from ntio.kernels.quant import dequantize
from ntio.policies.depth_profile import (SKIP_LABEL_COS, DepthProfile, LayerRecorder, calibrate_depth,
                                        proxy_features)
from ntio.policies.layer_skip import PredictedSkipPolicy, skip_mask
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
    out += [("exit kl", {"budget": b, "schedule": "per-token", "signal": "kl"}) for b in args.budgets]
    out += [("exit entropy", {"budget": b, "schedule": "per-token", "signal": "entropy"}) for b in args.budgets]
    out += [("exit entropy monotone", {"budget": b, "schedule": "monotone", "signal": "entropy"})
            for b in args.budgets[:1]]
    out += [(f"exit {signal}, every K/V", {"budget": b, "schedule": "per-token", "signal": signal})
            for signal in ("kl", "entropy") for b in args.budgets]
    return [(method, knob) for method, knob in out if args.methods is None or method in args.methods]


def make_policy(m: ntio.LLM, calib: Path, method: str, knob: dict, scoring: bool):
    if method == "cosine":
        return CosineSkipPolicy(knob["threshold"])
    if method == "skip":
        return adaptive_policy(m, calib, knob["budget"], "skip", prompt_full_depth=not scoring)
    policy = adaptive_policy(m, calib, knob["budget"], "exit", knob["schedule"], prompt_full_depth=not scoring,
                             signal=knob["signal"])
    return ExitKeepingKV(**{f: getattr(policy, f) for f in ("profile", "setting", "heads", "final_norm",
                                                            "prompt_full_depth")}) if "every K/V" in method else policy


class ExitKeepingKV(EarlyExitPolicy):
    """Diagnostic (scoring only): the same exits, read out at the exit, but every token still computes every layer,
    so no later token misses a K/V. It reads everything; it prices the exits apart from the holes they leave."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._at_exit: dict[int, torch.Tensor] = {}  # token -> its hidden state [D] after its exit layer

    def begin_pass(self, start_pos: int, n_tokens: int) -> None:
        super().begin_pass(start_pos, n_tokens)
        self._at_exit = {}

    def decide(self, layer: int, ahead: int) -> LoadDecision:
        return LOAD_ALL

    def still_wanted(self, layer: int, decision: LoadDecision) -> bool:
        return True

    def holds(self, layer: int) -> bool:
        return False

    def tokens(self, layer: int) -> None:
        return None

    def observe(self, obs: Observation) -> None:
        super().observe(obs)
        for t, depth in enumerate(self._stopped):
            if depth == obs.layer + 1 < self.profile.n_layers and t not in self._at_exit:
                self._at_exit[t] = obs.h_out[t]

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        h = h.clone()
        for t, at_exit in self._at_exit.items():
            h[t] = at_exit
        return super().readout(h)


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


def calibrate(m: ntio.LLM, args) -> Path:
    """`ntio calibrate`'s profile on the calibration text, probes every fourth layer from a quarter deep."""
    calib = Path(tempfile.mkdtemp()) / "depth.calib"
    calibrate_depth(m, calibration_text(), sorted(set(range(m.config.n_layers // 4 - 1, m.config.n_layers - 1, 4))),
                    n_tokens=args.calib_tokens).save(calib)
    return calib


def bench_model(name: str, args) -> list[dict]:
    path = resolve_model(name)
    m = ntio.load(path)
    calib = calibrate(m, args)
    readme = (ROOT / "README.md").read_text()
    m.policy = DensePolicy()
    dense = m.perplexity(readme).perplexity
    oracle = [{**r, "model": name} for r in exit_oracle(m, calib, readme, args.oracle_kl)]
    for r in oracle:
        print(json.dumps(r), flush=True)
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
        policy = scorer.policy
        row["perplexity_ratio"] = scorer.perplexity(readme).perplexity / dense
        row["scoring"] = adaptive_report(policy)
        if isinstance(policy, PredictedSkipPolicy):
            row["scoring"]["eval_text"] = skip_on_text(scorer, policy, readme)
        if "every K/V" in method:  # reads everything: nothing to generate streamed
            print(json.dumps(row), flush=True)
            rows.append(row)
            continue
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
    return [{"model": name, "method": "dense", "perplexity": dense}, *oracle, *rows]


def skip_on_text(m: ntio.LLM, policy: PredictedSkipPolicy, text: str) -> dict:
    """The predictor's precision and recall at the policy's threshold against the post-compute labels of `text`
    (every layer computed), as on the calibration's held-out tokens."""
    profile, setting = policy.profile, policy.setting
    recorder = LayerRecorder([profile.skip_after])
    m.policy = recorder
    ids, skips, labels = m.tokenizer.encode(text), [], []
    for a in range(0, len(ids), 512):
        m.engine.forward(torch.tensor(ids[a : a + 512]), 0)
        probs = policy.predictor(recorder.seen[profile.skip_after])
        skips.append(skip_mask(probs, torch.full((probs.shape[1],), setting.threshold), setting.max_consecutive))
        labels.append(torch.stack([recorder.cos[l] > SKIP_LABEL_COS
                                   for l in range(policy.first, m.config.n_layers)], dim=1))
    m.policy = DensePolicy()
    s, y = torch.cat(skips), torch.cat(labels)
    hits = int((s & y).sum())
    return {"precision": hits / max(int(s.sum()), 1), "recall": hits / max(int(y.sum()), 1)}


def exit_oracle(m: ntio.LLM, calib: Path, text: str, deltas: list[float]) -> list[dict]:
    """The best any exit rule on these exit heads could do: a token exits at the shallowest probe whose exit head's
    distribution is within KL(final || exit) <= delta of the final layer's (known only by computing every layer),
    with every layer's K/V computed (no token after it misses anything). Perplexity ratio and bytes per token."""
    cal = Calibration.load(calib, fingerprint(m.engine, m.tokenizer.vocabulary), m.config.d_model)
    probes, last = sorted(cal.heads), m.config.n_layers - 1
    recorder = LayerRecorder([*probes, last])
    m.policy = recorder
    ids = m.tokenizer.encode(text)
    kl, nll = [], []  # per window: [P, n] KL to the final distribution; [P + 1, n] NLL of the next token (final last)
    for a in range(0, len(ids), 512):
        window = ids[a : a + 512]
        if len(window) < 2:
            break
        m.engine.forward(torch.tensor(window), 0)
        target = torch.tensor(window[1:])
        final = torch.log_softmax(m.engine.head_logits(recorder.seen[last][:-1]), dim=-1)
        window_kl, window_nll = [], []
        for p in probes:
            w, b = cal.heads[p]
            logp = torch.log_softmax(m.engine.head_logits(recorder.seen[p][:-1] @ w + b), dim=-1)
            window_kl.append((final.exp() * (final - logp)).sum(dim=-1))
            window_nll.append(-logp.gather(1, target[:, None])[:, 0])
        kl.append(torch.stack(window_kl))
        nll.append(torch.stack([*window_nll, -final.gather(1, target[:, None])[:, 0]]))
    kl_all, nll_all = torch.cat(kl, dim=1), torch.cat(nll, dim=1)
    m.policy = DensePolicy()
    profile = DepthProfile.from_calibration(cal, str(calib), m.config.n_layers, m.config.d_model)
    levels = torch.tensor([p + 1 for p in probes] + [m.config.n_layers])
    rows = []
    for delta in deltas:
        ok = torch.cat([kl_all <= delta, torch.ones(1, kl_all.shape[1], dtype=torch.bool)])  # [P + 1, n]
        choice = ok.float().argmax(dim=0)  # the first probe within delta, else the final layer
        depth = levels[choice]
        rows.append({"model": m.path.name, "method": "exit oracle", "kl": delta,
                     "perplexity_ratio": float(torch.exp(nll_all.gather(0, choice[None])[0].mean()
                                                         - nll_all[-1].mean())),
                     "scoring": {"bytes_fraction": profile.bytes_fraction(depth),
                                 "mean_depth": float(depth.float().mean())}})
    return rows


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """[n, V] logits -> [n] entropy of their distribution, in nats."""
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def proxy_check(m: ntio.LLM, calib: Path, text: str, ranks: list[int]) -> dict:
    """Why the proxy is a linear read: per probe, the correlation with the exit head's true entropy on `text` of
    (a) the calibrated linear read (`--adaptive`'s) and (b) the seed's proxy, the entropy of logits through a rank-r
    factor of the output head (truncated SVD), from the same normed exit estimate of h_L."""
    cal = Calibration.load(calib, fingerprint(m.engine, m.tokenizer.vocabulary), m.config.d_model)
    profile = DepthProfile.from_calibration(cal, str(calib), m.config.n_layers, m.config.d_model)
    head = m.engine.globals.output
    u, sv, vh = torch.linalg.svd(dequantize(head.raw, head.qtype, head.shape).float(), full_matrices=False)
    m.policy = recorder = LayerRecorder(profile.probes)  # u [V, D], sv [D], vh [D, D]
    ids = m.tokenizer.encode(text)
    true, linear, low = [], [], {r: [] for r in ranks}  # per window: [n, P]
    for a in range(0, len(ids), 512):
        m.engine.forward(torch.tensor(ids[a : a + 512]), 0)
        x = {p: m.engine.final_norm(recorder.seen[p] @ cal.heads[p][0] + cal.heads[p][1]) for p in profile.probes}
        true.append(torch.stack([entropy(m.engine.head_logits(recorder.seen[p] @ cal.heads[p][0] + cal.heads[p][1]))
                                 for p in profile.probes], 1))
        linear.append(torch.stack([proxy_features(x[p]) @ profile.proxy_weights["entropy"][j]
                                   for j, p in enumerate(profile.probes)], 1))
        for r in ranks:
            low[r].append(torch.stack([entropy((x[p] @ vh[:r].T * sv[:r]) @ u[:, :r].T) for p in profile.probes], 1))
    m.policy = DensePolicy()
    y = torch.cat(true)
    corr = lambda e: [round(float(torch.corrcoef(torch.stack([e[:, j], y[:, j]]))[0, 1]), 3)
                      for j in range(y.shape[1])]
    return {"probes": profile.probes, "linear read": corr(torch.cat(linear)),
            **{f"rank {r} head": corr(torch.cat(low[r])) for r in ranks}}


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        ax.scatter([1.0], [1.0], marker="*", s=120, color="black", label="dense")
        for color, method in enumerate(("cosine", "skip", "exit kl", "exit entropy", "exit entropy monotone",
                                        "exit kl, every K/V", "exit entropy, every K/V", "exit oracle")):
            pts = sorted((r["scoring"]["bytes_fraction"], r["perplexity_ratio"]) for r in rows
                         if r["model"] == model and r["method"] == method and "perplexity_ratio" in r)
            if pts:  # one colour per method in every panel
                ax.plot(*zip(*pts), marker="o", color=f"C{color}", label=method)
        ax.set(title=model, xlabel="bytes read per token / dense", ylabel="perplexity / dense", yscale="log")
        ax.axhline(1.02, color="grey", linestyle=":", linewidth=1)
        ax.axvline(0.85, color="grey", linestyle=":", linewidth=1)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--cosine", nargs="+", type=float, default=[0.99, 0.98, 0.95])
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.97, 0.93, 0.85])
    ap.add_argument("--methods", nargs="+", help="Only these methods (cosine, skip, 'exit kl', 'exit entropy', "
                                                 "'exit entropy monotone', 'exit kl, every K/V', 'exit entropy, "
                                                 "every K/V'; default all)")
    ap.add_argument("--oracle-kl", nargs="+", type=float, default=[0.03, 0.1, 0.3, 1.0])
    ap.add_argument("--tokens", type=int, default=64, help="Greedy tokens per prompt")
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--proxy-ranks", nargs="+", type=int, help="Instead of the price list: how well the linear "
                                                                "entropy read and rank-r head factors predict the "
                                                                "exit heads' entropy on README.md, per probe")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    if args.proxy_ranks:
        for name in args.model:
            m = ntio.load(resolve_model(name))
            calib = calibrate(m, args)
            print(json.dumps({"model": name, **proxy_check(m, calib, (ROOT / "README.md").read_text(),
                                                           args.proxy_ranks)}), flush=True)
            m.close()
        return
    rows = [r for name in args.model for r in bench_model(name, args)]
    summary = {"machine": platform.processor() or platform.machine(), "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot([r for r in rows if r["method"] != "dense"], args.plot)


if __name__ == "__main__":
    main()
