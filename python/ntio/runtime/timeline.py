"""Where a forward's time goes, layer by layer: the spans `ntio profile` reports and draws.

A `Timeline` set on the loader (`LayerLoader.timeline`; None, the default, records nothing) collects, per forward, spans
in `time.perf_counter` seconds:
- layer: from the engine asking for a layer's weights to its block's output (the output head is layer n_layers);
- wait: the compute thread blocked on a streamed read, inside some layer's span;
- read: a streamed layer's read, from submit to the reader's end; read ahead, it may start in the forward before;
- copy: its host-to-device copy on CUDA, timed by events on the copy stream.
A layer's compute is its span less the waits in it, so a forward's layers (and head) add up to its wall time less
the embedding and the bookkeeping around the loop. On CUDA each layer synchronizes the device so that its span is the
GPU's time: profiling serializes what would otherwise overlap with the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

KINDS = ("layer", "wait", "read", "copy")


@dataclass
class Span:
    kind: str  # one of KINDS
    layer: int
    start: float
    end: float
    nbytes: int = 0


@dataclass
class Forward:
    n_tokens: int
    start: float
    end: float = 0.0
    spans: list[Span] = field(default_factory=list)


class Timeline:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.forwards: list[Forward] = []
        self._copies: list[tuple[int, int, torch.cuda.Event, torch.cuda.Event]] = []  # (layer, bytes, start, end)
        self._origin: tuple[float, torch.cuda.Event] | None = None  # host time of a device event, to place copies

    def begin(self, n_tokens: int) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            origin = torch.cuda.Event(enable_timing=True)
            origin.record()
            torch.cuda.synchronize()
            self._origin = (time.perf_counter(), origin)
        self.forwards.append(Forward(n_tokens, time.perf_counter()))

    def end(self) -> None:
        forward = self.forwards[-1]
        if self._copies:
            torch.cuda.synchronize()
            host, origin = self._origin
            for layer, nbytes, start, end in self._copies:
                forward.spans.append(Span("copy", layer, host + origin.elapsed_time(start) / 1e3,
                                          host + origin.elapsed_time(end) / 1e3, nbytes))
            self._copies.clear()
        forward.end = time.perf_counter()

    def add(self, kind: str, layer: int, start: float, end: float, nbytes: int = 0) -> None:
        self.forwards[-1].spans.append(Span(kind, layer, start, end, nbytes))

    def layer_done(self, layer: int, start: float) -> None:
        """The layer's span ends now (on CUDA, once the device has finished its work)."""
        if self.cuda:
            torch.cuda.synchronize()
        self.add("layer", layer, start, time.perf_counter())

    def copy_events(self, layer: int, nbytes: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Events to record on the copy stream around the layer's host-to-device copy."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._copies.append((layer, nbytes, start, end))
        return start, end


def forward_report(forward: Forward, n_layers: int, tiers: list[str]) -> dict:
    """One forward's figures per layer (the head is the row with layer "head"), in ms from its start, and totals.

    compute_ms = the layer's span less the waits in it; read/copy figures are the layer's own bytes and the span of
    the read that carried them (layers of one group share it)."""

    def ms(t: float) -> float:
        return round((t - forward.start) * 1e3, 4)

    def of_layer(kind: str, layer: int) -> list[Span]:
        return [s for s in forward.spans if s.kind == kind and s.layer == layer]

    rows = []
    for span in sorted((s for s in forward.spans if s.kind == "layer"), key=lambda s: s.start):
        wait = sum(s.end - s.start for s in forward.spans if s.kind == "wait" and span.start <= s.start < span.end)
        reads, copies = of_layer("read", span.layer), of_layer("copy", span.layer)
        head = span.layer == n_layers
        rows.append({
            "layer": "head" if head else span.layer, "tier": None if head else tiers[span.layer],
            "start_ms": ms(span.start), "end_ms": ms(span.end),
            "wait_ms": round(wait * 1e3, 4), "compute_ms": round((span.end - span.start - wait) * 1e3, 4),
            "read": [[ms(s.start), ms(s.end)] for s in reads], "read_bytes": sum(s.nbytes for s in reads),
            "copy": [[ms(s.start), ms(s.end)] for s in copies], "copy_bytes": sum(s.nbytes for s in copies),
        })
    totals = {
        "wall_ms": round((forward.end - forward.start) * 1e3, 4),
        "layers_ms": round(sum(r["end_ms"] - r["start_ms"] for r in rows), 4),
        "wait_ms": round(sum(r["wait_ms"] for r in rows), 4),
        "compute_ms": round(sum(r["compute_ms"] for r in rows), 4),
        "read_busy_ms": round(_union_ms(forward, "read"), 4),
        "read_bytes": sum(r["read_bytes"] for r in rows),
        "copy_busy_ms": round(_union_ms(forward, "copy"), 4),
        "copy_bytes": sum(r["copy_bytes"] for r in rows),
    }
    totals["bound_by"] = _bound(totals)
    return {"tokens": forward.n_tokens, "layers": rows, "totals": totals}


def _union_ms(forward: Forward, kind: str) -> float:
    """Time within the forward covered by at least one span of this kind (reads overlap: a group's layers share
    one, and the reader keeps several groups in flight); what was read ahead during the forward before is not
    counted."""
    total, reach = 0.0, forward.start
    for s in sorted((s for s in forward.spans if s.kind == kind), key=lambda s: s.start):
        end = min(s.end, forward.end)
        if end > reach:
            total += end - max(s.start, reach)
            reach = end
    return total * 1e3


def _bound(totals: dict) -> str:
    """What bounds the step: compute unless the compute thread waited for most of it, then the slower of the disk
    and the copy."""
    if totals["wait_ms"] <= totals["compute_ms"]:
        return "compute"
    return "copy" if totals["copy_busy_ms"] > totals["read_busy_ms"] else "disk"
