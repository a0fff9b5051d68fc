"""What streaming cost: bytes read and copied, time blocked on I/O, and how much of the I/O compute hid.

One `ForwardStats` per forward pass (a decode step is one token); `StreamStats` keeps them and the totals.
overlap_ratio = 1 - (time the compute thread waited for reads) / (time any read was in flight):
1.0 when every read finished behind compute, 0.0 when compute waited for all of it (sync mode).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ForwardStats:
    n_tokens: int = 0
    bytes_read: int = 0  # from disk (tier C)
    bytes_h2d: int = 0  # host -> device copies (tiers B and C on CUDA)
    io_wait_s: float = 0.0  # compute thread blocked on reads
    io_busy_s: float = 0.0  # time at least one read was in flight (union of the reads' Rust-measured spans)
    wall_s: float = 0.0
    bytes_per_layer: dict[int, int] = field(default_factory=dict)  # streamed layer -> bytes read for it


@dataclass
class StreamStats:
    layers_per_tier: dict[str, int]
    forwards: list[ForwardStats] = field(default_factory=list)

    def begin(self, n_tokens: int) -> ForwardStats:
        self.forwards.append(ForwardStats(n_tokens=n_tokens))
        return self.forwards[-1]

    def reset(self) -> None:
        self.forwards.clear()

    def summary(self) -> dict:
        """Totals, plus per-token figures over the decode steps (single-token forwards) when there are any."""
        fs = self.forwards
        decode = [f for f in fs if f.n_tokens == 1] or fs
        total = {k: sum(getattr(f, k) for f in fs) for k in ("n_tokens", "bytes_read", "bytes_h2d", "io_wait_s",
                                                             "io_busy_s", "wall_s")}
        busy = total["io_busy_s"]
        return {
            "forwards": len(fs),
            "tokens": total["n_tokens"],
            "bytes_read": total["bytes_read"],
            "bytes_h2d": total["bytes_h2d"],
            "bytes_read_per_token": sum(f.bytes_read for f in decode) / len(decode) if decode else 0.0,
            "bytes_h2d_per_token": sum(f.bytes_h2d for f in decode) / len(decode) if decode else 0.0,
            "disk_gb_s": total["bytes_read"] / busy / 1e9 if busy > 0 else 0.0,
            "io_wait_s": total["io_wait_s"],
            "io_busy_s": busy,
            "compute_s": total["wall_s"] - total["io_wait_s"],
            "overlap_ratio": max(0.0, 1.0 - total["io_wait_s"] / busy) if busy > 0 else 1.0,
            "layers_per_tier": dict(self.layers_per_tier),
            "bytes_read_per_layer": _per_layer_totals(fs),
        }

    def last(self) -> ForwardStats:
        """The last forward's figures (zeros before the first), as recorded: no copy per step."""
        return self.forwards[-1] if self.forwards else ForwardStats()


def _per_layer_totals(forwards: list[ForwardStats]) -> dict[int, int]:
    totals: dict[int, int] = {}
    for f in forwards:
        for layer, n in f.bytes_per_layer.items():
            totals[layer] = totals.get(layer, 0) + n
    return dict(sorted(totals.items()))
