"""The benches' figures, drawn from their JSON results (the `plot` extra: matplotlib).

Each bench draws its own with `--plot OUT.png`; a result saved earlier is drawn with

    python benches/figures.py KIND RESULT.json OUT.png

KIND: bigger-than-ram (bigger_than_ram.py), serve-load (serve_load.py), decode-vs-llamacpp (decode_vs_llamacpp.py),
speculative (speculative.py).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from ntio.plots import pyplot, save_png


def _bars(ax, groups: list[str], series: dict[str, list[float | None]], *, missing: str = "–") -> None:
    """Grouped bars: one group per x label, one bar per series (a None bar is drawn as `missing` text)."""
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [i - 0.4 + width * (k + 0.5) for i in range(len(groups))]
        ax.bar(xs, [v or 0 for v in values], width, label=name, color=f"C{k}")
        for x, v in zip(xs, values):
            ax.annotate(missing if v is None else f"{v:.3g}", (x, v or 0), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), groups)
    ax.grid(axis="y", alpha=0.3)


def _keyed(result: dict, pattern: str) -> dict[str, dict[str, float]]:
    """The values of `result`'s keys that match `pattern`, by its two groups (`ntio_4_aggregate_tok_s` ->
    {"ntio": {"4": value}})."""
    table: dict[str, dict[str, float]] = {}
    for key, value in result.items():
        m = re.fullmatch(pattern, key)
        if m:
            table.setdefault(m[1], {})[m[2]] = value
    return table


def bigger_than_ram(result: dict, path: Path) -> None:
    """A panel per model: decode tok/s per memory cap, a bar per engine (median over rounds; "OOM" where no run
    finished), with ntio's median ratio to its disk bound under each cap."""
    plt = pyplot("plot")
    models = result["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        caps = model["caps"]
        engines = list(dict.fromkeys(e for cap in caps for e in cap["engines"]))
        labels = {e: next(c["engines"][e]["label"] for c in caps if e in c["engines"]) for e in engines}
        series = {labels[e]: [c["engines"].get(e, {}).get("median_tok_s") for c in caps] for e in engines}
        groups = [f"{c['cap']}\nntio / bound {c['median_ntio_ratio_to_bound']:.2f}"
                  if c.get("median_ntio_ratio_to_bound") else c["cap"] for c in caps]
        _bars(ax, groups, series, missing="OOM")
        ax.set(title=f"{model['model']} ({model['file_gb']:.2f} GB)", xlabel="memory cap (cgroup)",
               ylabel="decode tok/s")
        ax.legend(fontsize=8)
    fig.suptitle(f"Bigger than RAM: {result.get('date', '')} {result['machine'].get('cpu', '')}", fontsize=9)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def serve_load(result: dict, path: Path) -> None:
    """Aggregate tok/s against concurrent clients, a line per engine."""
    plt = pyplot("plot")
    points = {engine: {int(c): v for c, v in by.items()}
              for engine, by in _keyed(result, r"(.+)_(\d+)_aggregate_tok_s").items()}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (engine, by_clients) in enumerate(points.items()):
        clients = sorted(by_clients)
        ax.plot(clients, [by_clients[c] for c in clients], "o-", color=f"C{k}", label=engine)
    ax.set_xscale("log", base=2)
    ticks = sorted({c for by_clients in points.values() for c in by_clients})
    ax.set_xticks(ticks, [str(c) for c in ticks])
    ax.minorticks_off()
    ax.set(xlabel="concurrent clients", ylabel="aggregate decode tok/s", ylim=(0, None),
           title=f"{Path(result['model']).name}, tiers {result['tiers']}, {result['tokens']} tokens per request")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_png(fig, path)
    plt.close(fig)


def decode_vs_llamacpp(result: dict, path: Path) -> None:
    """Median decode and prefill tok/s, a bar per engine or ntio mode."""
    plt = pyplot("plot")
    rates = _keyed(result, r"(.+)_(decode|prefill)_tok_s_median")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, phase in zip(axes, ("decode", "prefill")):
        names = [n for n in rates if phase in rates[n]]
        _bars(ax, names, {phase: [rates[n][phase] for n in names]})
        ax.set(title=f"{phase} (median of {len(result.get('rounds', []))} rounds)", ylabel="tok/s")
    fig.suptitle(f"{Path(result['model']).name}, {result['threads']} threads, {result['tokens']} tokens", fontsize=9)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def speculative(result: dict, path: Path) -> None:
    """A panel per tier plan: decode tok/s against plain decoding per draft source, a bar per kind of prompt, with
    tokens per target pass under each source."""
    plt = pyplot("plot")
    plans = result["results"]
    fig, axes = plt.subplots(1, len(plans), figsize=(7 * len(plans), 4.5), squeeze=False)
    for ax, (tiers, table) in zip(axes[0], plans.items()):
        kinds = list(dict.fromkeys(key.split("/")[0] for key in table))
        sources = [s for s in dict.fromkeys(key.split("/", 1)[1] for key in table) if s != "plain"]
        _bars(ax, [f"{s}\n{' / '.join(str(table.get(f'{k}/{s}', {}).get('tokens_per_pass', '–')) for k in kinds)}"
                   for s in sources],
              {k: [table.get(f"{k}/{s}", {}).get("vs_plain") for s in sources] for k in kinds})
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(title=f"tiers {tiers}", ylabel="decode tok/s / plain", xlabel="draft source (tokens per pass: "
                                                                                + " / ".join(kinds) + ")")
        ax.legend(fontsize=8)
    fig.suptitle(f"{Path(result['model']).name}: speculative decoding, greedy, {result['tokens']} tokens", fontsize=9)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


FIGURES = {"bigger-than-ram": bigger_than_ram, "serve-load": serve_load, "decode-vs-llamacpp": decode_vs_llamacpp,
           "speculative": speculative}


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] not in FIGURES:
        sys.exit(f"usage: figures.py {{{','.join(FIGURES)}}} RESULT.json OUT.png")
    FIGURES[sys.argv[1]](json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3]))


if __name__ == "__main__":
    main()
