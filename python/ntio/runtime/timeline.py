"""Where a forward's time goes, layer by layer: the spans `ntio profile` reports and draws.

A `Timeline` set on the loader (`LayerLoader.timeline`; None, the default, records nothing) collects, per forward, spans
in `time.perf_counter` seconds:
- layer: from the engine asking for a layer's weights to its block's output (the output head is layer n_layers);
- wait: the compute thread blocked on a streamed read, inside some layer's span;
- read: a streamed layer's read, from submit to the reader's end, kept with the forward that computes on it; read
  ahead, it starts in the forward before, whose report counts it too (`forward_report`'s `next_forward`);
- copy: its host-to-device copy on CUDA, timed by events on the copy stream.
A layer's compute is its span less the waits in it. A forward's wall time runs from the loader's begin_forward to its
end_forward (the embedding comes before, the sampling after); its layers and head cover all of it but the loop's
bookkeeping. On CUDA each layer synchronizes the device so that its span is the GPU's time, and a wait for a
layer's host-to-device copy is a wait: profiling serializes what would otherwise overlap with the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

@dataclass
class Span:
    kind: str  # layer, wait, read or copy
    layer: int  # the output head's chunks count from n_layers
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
        self.device, self.cuda = device, device.type == "cuda"
        self.forwards: list[Forward] = []
        self._copies: list[tuple[int, int, torch.cuda.Event, torch.cuda.Event]] = []  # (layer, bytes, start, end)
        self._origin: tuple[float, torch.cuda.Event] | None = None  # host time of a device event, to place copies

    def begin(self, n_tokens: int) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            origin = torch.cuda.Event(enable_timing=True)
            origin.record(torch.cuda.current_stream(self.device))
            torch.cuda.synchronize(self.device)
            self._origin = (time.perf_counter(), origin)
        self.forwards.append(Forward(n_tokens, time.perf_counter()))

    def end(self) -> None:
        forward = self.forwards[-1]
        forward.end = time.perf_counter()
        if self._copies:
            torch.cuda.synchronize(self.device)
            host, origin = self._origin
            for layer, nbytes, start, end in self._copies:
                forward.spans.append(Span("copy", layer, host + origin.elapsed_time(start) / 1e3,
                                          host + origin.elapsed_time(end) / 1e3, nbytes))
            self._copies.clear()

    def add(self, kind: str, layer: int, start: float, end: float, nbytes: int = 0) -> None:
        self.forwards[-1].spans.append(Span(kind, layer, start, end, nbytes))

    def layer_done(self, layer: int, start: float) -> None:
        """The layer's span ends now (on CUDA, once the device has finished its work)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.add("layer", layer, start, time.perf_counter())

    def copy_events(self, layer: int, nbytes: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Events to record on the copy stream around the layer's host-to-device copy."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._copies.append((layer, nbytes, start, end))
        return start, end


def forward_report(forward: Forward, n_layers: int, tiers: list[str], next_forward: Forward | None = None) -> dict:
    """One forward's figures per layer (the head is the row with layer "head"), in ms from its start, and totals.

    compute_ms = the layer's span less the waits in it. read/copy: the layer's own bytes and the span of the read
    that carried them (layers of one group share it); read_ahead: the next forward's read of the layer where it
    started before this forward ended (busy figures count it, clipped to this forward)."""

    def ms(t: float) -> float:
        return round((t - forward.start) * 1e3, 4)

    def of_row(spans: list[Span], kind: str, layer: int) -> list[Span]:
        head = layer == n_layers  # the head's chunks are units n_layers, n_layers + 1, ...
        return [s for s in spans if s.kind == kind and (s.layer >= n_layers if head else s.layer == layer)]

    ahead = [s for s in (next_forward.spans if next_forward else []) if s.kind == "read" and s.start < forward.end]
    rows = []
    for span in sorted((s for s in forward.spans if s.kind == "layer"), key=lambda s: s.start):
        wait = sum(s.end - s.start for s in forward.spans if s.kind == "wait" and span.start <= s.start < span.end)
        reads, copies = of_row(forward.spans, "read", span.layer), of_row(forward.spans, "copy", span.layer)
        head = span.layer == n_layers
        rows.append({
            "layer": "head" if head else span.layer, "tier": None if head else tiers[span.layer],
            "start_ms": ms(span.start), "end_ms": ms(span.end),
            "wait_ms": round(wait * 1e3, 4), "compute_ms": round((span.end - span.start - wait) * 1e3, 4),
            "read": [[ms(s.start), ms(s.end)] for s in reads], "read_bytes": sum(s.nbytes for s in reads),
            "read_ahead": [[ms(s.start), ms(s.end)] for s in of_row(ahead, "read", span.layer)],
            "copy": [[ms(s.start), ms(s.end)] for s in copies], "copy_bytes": sum(s.nbytes for s in copies),
        })
    reads = [s for s in forward.spans if s.kind == "read"] + ahead
    totals = {
        "wall_ms": round((forward.end - forward.start) * 1e3, 4),
        "layers_ms": round(sum(r["end_ms"] - r["start_ms"] for r in rows), 4),
        "wait_ms": round(sum(r["wait_ms"] for r in rows), 4),
        "compute_ms": round(sum(r["compute_ms"] for r in rows), 4),
        "read_busy_ms": round(_busy_ms(forward, reads), 4),
        "read_bytes": sum(r["read_bytes"] for r in rows),
        "copy_busy_ms": round(_busy_ms(forward, [s for s in forward.spans if s.kind == "copy"]), 4),
        "copy_bytes": sum(r["copy_bytes"] for r in rows),
    }
    totals["bound_by"] = _bound(totals)
    return {"tokens": forward.n_tokens, "layers": rows, "totals": totals}


def _busy_ms(forward: Forward, spans: list[Span]) -> float:
    """Time within the forward covered by at least one of the spans (reads overlap: a group's layers share one, and
    the reader keeps several groups in flight)."""
    total, reach = 0.0, forward.start
    for s in sorted(spans, key=lambda s: s.start):
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
