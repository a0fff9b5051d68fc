"""Figures, drawn with matplotlib (the `plot` extra): a decode step per layer (`ntio profile --plot`) and the
reader's bandwidth against request size and queue depth (`ntio-bench read --sweep --plot`).

Files are written as a temporary file beside the target, then renamed: never half a PNG."""

from __future__ import annotations

import os
from pathlib import Path

from ntio.errors import NtioError, OptionError

COLOURS = {"read": "#4c72b0", "copy": "#dd8452", "compute": "#55a868", "wait": "#c44e52"}


def pyplot(option: str):
    """matplotlib's pyplot on a file-only backend, or an error naming the option that asked for a figure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OptionError(option, "needs matplotlib: pip install 'ntio[plot]'") from None
    return plt


def check_figure_path(path: Path) -> None:
    """Before the work a figure draws: matplotlib is there, and the PNG's directory exists."""
    pyplot("plot")
    if not path.parent.is_dir():
        raise OptionError("plot", f"{path}: no directory {path.parent}")


def save_png(fig, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
        os.replace(tmp, path)
    except OSError as e:
        raise NtioError(f"{path}: cannot write the figure ({e.strerror or e})") from None
    finally:
        tmp.unlink(missing_ok=True)


def draw_step(report: dict, path: Path) -> None:
    """One forward of `ntio.runtime.timeline.forward_report` (with `title`): a lane per layer on a time axis, its
    read and host-to-device copy above, its wait then compute below; totals in the legend."""
    plt = pyplot("plot")
    from matplotlib.patches import Patch

    rows, totals = report["layers"], report["totals"]
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.2 * len(rows)))
    for y, row in enumerate(rows):
        for kind in ("read", "copy"):
            for start, end in row[kind]:
                ax.barh(y - 0.2, end - start, left=start, height=0.4, color=COLOURS[kind])
        for start, end in row["read_ahead"]:  # the next step's read of this layer, issued during this one
            ax.barh(y - 0.2, end - start, left=start, height=0.4, color=COLOURS["read"], alpha=0.4)
        waited = row["start_ms"] + row["wait_ms"]
        ax.barh(y + 0.2, row["wait_ms"], left=row["start_ms"], height=0.4, color=COLOURS["wait"])
        ax.barh(y + 0.2, row["end_ms"] - waited, left=waited, height=0.4, color=COLOURS["compute"])
    ax.set_yticks(range(len(rows)), [f"{r['layer']} {r['tier'] or ''}".strip() for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(0, color="grey", linewidth=0.5)
    ax.axvline(totals["wall_ms"], color="grey", linewidth=0.5)
    ax.set_xlabel("ms from the step's start (reads before 0 were issued during the step before; pale: the next "
                  "step's reads, issued during this one)")
    ax.set_ylabel("layer, tier")
    ax.set_title(f"{report['title']}: {totals['wall_ms']:.1f} ms, bound by {totals['bound_by']}", fontsize=9)
    ax.legend(handles=[
        Patch(color=COLOURS["read"], label=f"read: {totals['read_bytes'] / 1e6:.1f} MB, busy {totals['read_busy_ms']:.1f} ms"),
        Patch(color=COLOURS["copy"], label=f"copy: {totals['copy_bytes'] / 1e6:.1f} MB, busy {totals['copy_busy_ms']:.1f} ms"),
        Patch(color=COLOURS["compute"], label=f"compute: {totals['compute_ms']:.1f} ms"),
        Patch(color=COLOURS["wait"], label=f"waiting: {totals['wait_ms']:.1f} ms"),
    ], loc="upper center", bbox_to_anchor=(0.5, -0.45 / (1.6 + 0.2 * len(rows)) - 0.04), ncol=4, fontsize=8,
        frameon=False)
    save_png(fig, path)
    plt.close(fig)


def draw_read_sweep(result: dict, path: Path) -> None:
    """`ntio-bench read --sweep --json`'s object: GB/s against request size (log 2), a line per queue depth; fio's
    jobs, where given, as crosses in the colour of their queue depth."""
    plt = pyplot("plot")
    fig, ax = plt.subplots(figsize=(8, 5))
    depths = sorted({c["queue_depth"] for c in result["cells"]} | {f["queue_depth"] for f in result["fio"]})
    colour = dict(zip(depths, plt.get_cmap("viridis")([i / max(1, len(depths) - 1) for i in range(len(depths))])))
    for depth in depths:
        cells = sorted((c for c in result["cells"] if c["queue_depth"] == depth), key=lambda c: c["block_size"])
        if cells:
            ax.plot([c["block_size"] for c in cells], [c["gb_s"] for c in cells], "o-", color=colour[depth],
                    label=f"ntio QD {depth}")
        fio = [f for f in result["fio"] if f["queue_depth"] == depth]
        if fio:
            ax.plot([f["block_size"] for f in fio], [f["gb_s"] for f in fio], "x", markersize=10, mew=2,
                    color=colour[depth], label=f"fio QD {depth}")
    ax.set_xscale("log", base=2)
    sizes = sorted({c["block_size"] for c in result["cells"]} | {f["block_size"] for f in result["fio"]})
    ax.set_xticks(sizes, [f"{s >> 20} MiB" if s >= 1 << 20 else f"{s >> 10} KiB" if s >= 1024 else f"{s} B"
                          for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel("request size (bytes)")
    ax.set_ylabel("GB/s (1e9 B/s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    cache = "O_DIRECT" if result["cold"] else "page cache"
    per_point = min(c["bytes"] for c in result["cells"])
    ax.set_title(f"{Path(result['file']).name}: {result['pattern']} reads, {cache}, {per_point / 2**20:.0f} MiB "
                 f"per point", fontsize=9)
    ax.legend(fontsize=8)
    save_png(fig, path)
    plt.close(fig)
