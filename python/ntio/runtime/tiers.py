"""Where each transformer block lives: the tier plan, computed from memory budgets or forced.

Tiers:  A  resident on the compute device (on CPU the device is host memory);
        B  host RAM (pinned when CUDA), copied to the device at every use;
        C  disk, read through the Rust reader at every use.
`plan_tiers` fills A, then B, then C, in layer order, after reserving what every plan needs (always-resident
globals, KV cache, activations, staging buffers). On CPU, A and B are the same memory, so the planner uses A; it then
spaces the resident layers evenly among the streamed ones (`spread_resident`), unless asked to keep them first.
Every streamed layer and the streamed output head cost their bytes at every token, so any order of them saves the
same per byte: the head goes first (one big unit), then layers in order; the token embedding, whose on-demand rows
cost a few KB per token, is resident only when every layer and the head are and it still fits.
A budget too small for the reserve plus one streamed group is an error that says the minimum.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ntio.errors import OptionError

TIERS = ("A", "B", "C")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int, option: str) -> int:
    """'64MB', '4GiB', '1.5g', '123' (bytes) -> bytes. Decimal units are powers of 1000, binary of 1024."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise OptionError(option, f"{text!r}: cannot read it as a size (examples: 512MB, 4GiB, 1.5G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def parse_tier_spec(spec: str, n_layers: int) -> list[str] | None:
    """'auto' -> None; 'A' / 'B' / 'C' -> every layer; 'A:0-9,C:10-29' or one letter per layer ('AACC...')."""
    text = spec.strip().upper()
    if text == "AUTO":
        return None
    if text in TIERS:
        return [text] * n_layers
    if re.fullmatch(r"[ABC]+", text):
        if len(text) != n_layers:
            raise OptionError("tiers", f"{text!r}: {len(text)} letters given for a model with {n_layers} layers")
        return list(text)
    tiers: list[str | None] = [None] * n_layers
    for part in text.split(","):
        m = re.fullmatch(r"([ABC]):(\d+)(?:-(\d+))?", part.strip())
        if not m:
            raise OptionError("tiers", f"{text!r}: cannot read {part.strip()!r} (expected e.g. A:0-9,C:10-{n_layers - 1})")
        first, last = int(m.group(2)), int(m.group(3) or m.group(2))
        if first > last:
            raise OptionError("tiers", f"{text!r}: layers {first}-{last} run backwards (write {last}-{first})")
        if not 0 <= first <= last < n_layers:
            raise OptionError("tiers", f"{text!r}: layers {first}-{last} are outside 0-{n_layers - 1}")
        for layer in range(first, last + 1):
            if tiers[layer] is not None:
                raise OptionError("tiers", f"{text!r}: layer {layer} is given a tier twice")
            tiers[layer] = m.group(1)
    missing = [i for i, t in enumerate(tiers) if t is None]
    if missing:
        raise OptionError("tiers", f"{text!r}: no tier given for layer {missing[0]} (every layer needs one)")
    return tiers  # type: ignore[return-value]


@dataclass(frozen=True)
class TierPlan:
    tiers: list[str]  # one of TIERS per layer
    device_budget: int | None  # bytes; None where the plan was forced
    ram_budget: int | None
    reserved_device: int  # bytes set aside before placing layers: globals, KV cache, activations, staging
    reserved_ram: int
    # The output head: "A" resident, "C" streamed at every forward (in row chunks, like layers).
    head: str = "A"
    # The token embedding: "A" resident, "C" on disk (the rows a forward needs are read on demand). With tied
    # embeddings it is the head's table, so it has the head's tier.
    embedding: str = "A"

    def layers(self, tier: str) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t == tier]

    @property
    def counts(self) -> dict[str, int]:
        return {t: self.tiers.count(t) for t in TIERS}

    def describe(self) -> str:
        runs, start = [], 0
        for i in range(1, len(self.tiers) + 1):
            if i == len(self.tiers) or self.tiers[i] != self.tiers[start]:
                runs.append(f"{self.tiers[start]}:{start}" + (f"-{i - 1}" if i - 1 > start else ""))
                start = i
        return ",".join(runs)


def spread_resident(tiers: list[str], layer_bytes: list[int], room: int) -> list[str]:
    """As many resident (A) layers as `tiers` has, spaced evenly among the streamed (C) ones, within `room` bytes:
    resident layer i of m at floor((i + 1/2) n / m) of n layers. Where layers differ in size (Qwen2.5-Coder's
    Q4_K_M: 26.3 and 30.0 MB) and those positions take more than `room`, a resident layer moves to its nearest
    smaller streamed neighbour, the nearest move first, until they fit; `tiers` is kept if they never do.

    Why: the reader keeps a bounded read-ahead, so the disk idles while a long run of resident layers computes and
    the CPU waits through the streamed run after it; interleaved, every resident layer's compute overlaps reads.
    Measured on the 8B-shaped model in memory cgroups on this project's VM (2 vCPU, benches/RESULTS.md): +3% decode
    at 2 GB (3 of 20 layers resident), +7.5%, +15% and +7% in three paired runs at 3 GB (11 of 20), the same bytes
    per token."""
    n, m = len(tiers), tiers.count("A")
    resident = {(2 * i + 1) * n // (2 * m) for i in range(m)}
    total = sum(layer_bytes[i] for i in resident)
    while total > room:
        moves = [(abs(j - i), layer_bytes[j] - layer_bytes[i], i, j) for i in resident for j in range(n)
                 if j not in resident and layer_bytes[j] < layer_bytes[i]]
        if not moves:
            return tiers
        _, saved, i, j = min(moves)  # nearest, then the largest saving
        resident = resident - {i} | {j}
        total += saved
    return ["A" if i in resident else "C" for i in range(n)]


def plan_tiers(
    layer_bytes: list[int],
    *,
    cuda: bool,
    device_budget: int,
    ram_budget: int,
    reserved_device: int,
    reserved_ram: int,
    staging_bytes: int,
    head_bytes: int = 0,
    embedding_bytes: int = 0,
    spread: bool = True,
    shrink: str = "a smaller max_context shrinks the KV cache",
) -> TierPlan:
    """Fill A, then B (CUDA only), then C: the output head first, then layers in order; on CPU, with `spread`, the
    resident layers are then spaced evenly among the streamed ones within the same memory (`spread_resident`;
    spread=False keeps them first, as a self-draft running the first layers needs).

    reserved_*: bytes every plan needs on the device / in host RAM (norms, KV cache, activations);
    staging_bytes: host (and on CUDA, device) memory for double-buffered streaming, needed only if a layer or the
    head is streamed; head_bytes: the output head (0: resident, inside reserved_*); embedding_bytes: an untied token
    embedding, which may stay on disk (0: tied, it is the head). On CPU the device is host memory: `device_budget`
    is ignored and A draws on `ram_budget`. shrink: what the below-minimum error suggests changing.
    """
    if not cuda:
        device_budget = ram_budget
        reserved_device = reserved_ram
    budgets = (device_budget, ram_budget, reserved_device, reserved_ram)
    no_streaming = reserved_device + sum(layer_bytes) + head_bytes
    if no_streaming <= device_budget and (not cuda or reserved_ram <= ram_budget):
        embedding = "A" if no_streaming + embedding_bytes <= device_budget else "C"
        return TierPlan(["A"] * len(layer_bytes), *budgets, head="A", embedding=embedding)
    device_free = device_budget - reserved_device - staging_bytes if cuda else 0
    ram_free = ram_budget - reserved_ram - staging_bytes
    for option, budget, free in (("gpu_memory_budget", device_budget, device_free), ("ram_budget", ram_budget, ram_free)):
        if free < 0 and (cuda or option == "ram_budget"):
            raise OptionError(
                option,
                f"{format_size(budget)} is too small: streaming this model needs at least "
                f"{format_size(budget - free)} (norms, KV cache, activations and staging slots; {shrink})",
            )
    head = "C"
    if cuda and head_bytes <= device_free:
        head, device_free = "A", device_free - head_bytes
    elif not cuda and head_bytes <= ram_free:
        head, ram_free = "A", ram_free - head_bytes
    tiers, room = [], ram_free
    for nbytes in layer_bytes:
        if cuda and nbytes <= device_free:
            tiers.append("A")
            device_free -= nbytes
        elif nbytes <= ram_free:
            tiers.append("B" if cuda else "A")
            ram_free -= nbytes
        else:
            tiers.append("C")
    if spread and not cuda and "A" in tiers and "C" in tiers:
        tiers = spread_resident(tiers, layer_bytes, room)
    embedding = "C" if embedding_bytes else head
    return TierPlan(tiers, *budgets, head=head, embedding=embedding)
