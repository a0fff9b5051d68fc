"""Speculative decoding against plain decoding of the same loaded model, side by side: tokens per target pass and
decode tok/s for each draft source, resident and all-C streamed. Greedy; every speculative run's tokens are checked
against the plain run's (`identical`).

Configurations alternate within each round (plain, then each source, per prompt); medians over rounds. Plain
decoding runs on a load without the drafter, as a user without one runs it (a drafter deepens the read-ahead of
given tiers: `read_ahead` in the report). Prints JSON.

    python benches/speculative.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --tiers auto C --branches 0 2
    python benches/speculative.py --model smollm2-135m --self-draft heads.exit --exit-layer 22 --tiers auto C

The self-draft's calibration file comes from `ntio calibrate MODEL --corpus FILE -o heads.exit`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import ntio
from ntio.fetch import resolve_model
from ntio.plots import check_figure_path
from figures import speculative as draw

# Chat prompts of three kinds: code, prose, and rewriting a given text (where prompt lookup has something to copy).
PROMPTS = {
    "code": [
        "Write a Python function that checks whether a string is a palindrome, with a docstring and two tests.",
        "Write a C function that reverses a singly linked list, with the struct definition.",
    ],
    "prose": [
        "Explain in a short paragraph why the sky is blue.",
        "Describe a quiet morning in a small fishing village.",
        "Explain in a short paragraph how a lighthouse guides ships.",
    ],
    "rewrite": [
        "Rewrite this function with type hints and a docstring, keeping its body:\n\ndef mean(values):\n    total = 0\n"
        "    for v in values:\n        total += v\n    return total / len(values) if values else 0.0\n",
        "Correct the spelling in this text and return it: 'The quick brwon fox jumpd over the lazy dgo while the "
        "farmer wacthed from his porch, drinking his mornign coffee.'",
    ],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", help="draft model (same vocabulary)")
    ap.add_argument("--self-draft", help="exit-head calibration file: self-speculation")
    ap.add_argument("--exit-layer", type=int)
    ap.add_argument("--tiers", nargs="+", default=["auto", "C"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--branches", type=int, nargs="+", default=[0, 2],
                    help="next choices per step as extra tree leaves (0: linear drafts); each value is a run")
    ap.add_argument("--plot", type=Path, help="draw the result into this PNG (benches/figures.py)")
    args = ap.parse_args()
    if args.plot:
        check_figure_path(args.plot)

    sources = {"lookup": dict(lookup=True, use_draft=False)}
    drafter = "model" if args.draft else "self" if args.self_draft else None
    if drafter:  # lookup drafts no next choices: one run of it is enough
        sources = {f"{drafter} b={b}": dict(use_draft=True, branches=b) for b in args.branches}
        sources["lookup"] = dict(lookup=True, use_draft=False)
        sources.update({f"{drafter}+lookup b={b}": dict(lookup=True, use_draft=True, branches=b)
                        for b in args.branches})
    report = {"model": str(resolve_model(args.model)), "draft": args.draft, "self_draft": args.self_draft,
              "exit_layer": args.exit_layer, "machine": platform.processor() or
              platform.machine(), "tokens": args.tokens, "rounds": args.rounds, "draft_tokens": args.draft_tokens,
              "branches": args.branches, "results": {}}
    for tiers in args.tiers:
        m = ntio.load(args.model, tiers=tiers, draft=args.draft, self_draft=args.self_draft,
                      exit_layer=args.exit_layer)
        # Plain decoding runs as without a drafter: a load of its own, whose read-ahead a drafter does not deepen
        # (`loader.drafting_prefetch_depth`; SmolLM2 all-C decoded ~8% slower at 29 groups ahead than at 12).
        plain_m = ntio.load(args.model, tiers=tiers) if drafter else m
        report.setdefault("read_ahead", {})[tiers] = {"plain": plain_m.loader.prefetch_depth,
                                                      "speculative": m.loader.prefetch_depth}
        runs: dict[str, dict[str, list]] = {}
        for _ in range(args.rounds):
            for kind, prompts in PROMPTS.items():
                for prompt in prompts:
                    ids = m.encode_prompt(prompt, chat=True)
                    # Every run prefills the whole prompt: a reused prefix would compute the prompt's last token
                    # in another pass shape than a full prefill (past KERNEL_ROWS tokens, other rounding).
                    plain_m.engine.kv.crop(0)
                    plain = plain_m.generate(ids, args.tokens, use_draft=False)
                    runs.setdefault(f"{kind}/plain", {}).setdefault("tok_s", []).append(plain.decode_tok_s)
                    for name, options in sources.items():
                        m.engine.kv.crop(0)
                        c = m.generate(ids, args.tokens, draft_tokens=args.draft_tokens, **options)
                        r = runs.setdefault(f"{kind}/{name}", {})
                        r.setdefault("tok_s", []).append(c.decode_tok_s)
                        r.setdefault("tokens_per_pass", []).append(c.speculation["tokens_per_pass"])
                        r.setdefault("identical", []).append(c.token_ids == plain.token_ids)
        m.close()
        if plain_m is not m:
            plain_m.close()
        table = {}
        for key, r in runs.items():
            kind = key.split("/")[0]
            entry = {"tok_s": round(statistics.median(r["tok_s"]), 2)}
            if "tokens_per_pass" in r:
                entry["tokens_per_pass"] = round(statistics.median(r["tokens_per_pass"]), 2)
                entry["identical"] = all(r["identical"])
                entry["vs_plain"] = round(entry["tok_s"] / statistics.median(runs[f"{kind}/plain"]["tok_s"]), 2)
            table[key] = entry
        report["results"][tiers] = table
    print(json.dumps(report, indent=1))
    if args.plot:
        draw(report, args.plot)


if __name__ == "__main__":
    main()
