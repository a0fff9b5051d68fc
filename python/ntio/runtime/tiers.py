"""Where each transformer block lives: the tier plan, computed from memory budgets or forced.

Tiers:  A  resident on the compute device (on CPU the device is host memory);
        B  host RAM (pinned when CUDA), copied to the device at every use;
        C  disk, read through the Rust reader at every use.
`plan_tiers` fills A, then B, then C, in layer order, after reserving what every plan needs (always-resident
globals, KV cache, activations, staging buffers). On CPU, A and B are the same memory, so the planner uses A.
A budget too small for the reserve plus one streamed group is an error that says the minimum.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

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
        if not 0 <= first <= last < n_layers:
            raise OptionError("tiers", f"{text!r}: layers {first}-{last} are outside 0-{n_layers - 1}")
        for layer in range(first, last + 1):
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


def plan_tiers(
    layer_bytes: list[int],
    *,
    cuda: bool,
    device_budget: int,
    ram_budget: int,
    reserved_device: int,
    reserved_ram: int,
    staging_bytes: int,
) -> TierPlan:
    """Fill A, then B (CUDA only), then C in layer order.

    reserved_*: bytes every plan needs on the device / in host RAM (globals, KV cache, activations);
    staging_bytes: host (and on CUDA, device) memory for double-buffered streaming, needed only if a layer is
    streamed. On CPU the device is host memory: `device_budget` is ignored and A draws on `ram_budget`.
    """
    if not cuda:
        device_budget = ram_budget
        reserved_device = reserved_ram
    all_resident = reserved_device + sum(layer_bytes)
    if all_resident <= device_budget and (not cuda or reserved_ram <= ram_budget):
        return TierPlan(["A"] * len(layer_bytes), device_budget, ram_budget, reserved_device, reserved_ram)
    device_free = device_budget - reserved_device - staging_bytes if cuda else 0
    ram_free = ram_budget - reserved_ram - staging_bytes
    for option, budget, free in (("gpu_memory_budget", device_budget, device_free), ("ram_budget", ram_budget, ram_free)):
        if free < 0 and (cuda or option == "ram_budget"):
            raise OptionError(
                option,
                f"{format_size(budget)} is too small: streaming this model needs at least "
                f"{format_size(budget - free)} (always-resident weights, KV cache, activations and staging "
                f"slots; a smaller max_context shrinks the KV cache)",
            )
    tiers = []
    for nbytes in layer_bytes:
        if cuda and nbytes <= device_free:
            tiers.append("A")
            device_free -= nbytes
        elif nbytes <= ram_free:
            tiers.append("B" if cuda else "A")
            ram_free -= nbytes
        else:
            tiers.append("C")
    return TierPlan(tiers, device_budget, ram_budget, reserved_device, reserved_ram)


def available_ram() -> int:
    """Bytes this process may still use: MemAvailable, capped by its cgroup's memory.max (minus what it uses)."""
    available = None
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return min(available, _cgroup_memory_room())


def _cgroup_memory_room() -> int:
    """Limit minus the unreclaimable usage of this process's memory cgroup (v2 memory.max, or v1
    memory.limit_in_bytes). The cgroup's usage counts page cache, most of it reclaimable: `import torch` alone
    charges ~1.35 GB of which ~0.8 GB are its libraries' file pages, yet imports under a 500 MB cap
    (../shared/DESIGN.md). Inactive file pages are subtracted, as the kernel reclaims them first."""
    room = 1 << 62
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, group = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            base, limit_file, usage_file = Path("/sys/fs/cgroup") / group.lstrip("/"), "memory.max", "memory.current"
            inactive_key = "inactive_file"
        elif "memory" in controllers.split(","):
            base, limit_file, usage_file = (Path("/sys/fs/cgroup/memory") / group.lstrip("/"), "memory.limit_in_bytes",
                                            "memory.usage_in_bytes")
            inactive_key = "total_inactive_file"
        else:
            continue
        try:
            limit = (base / limit_file).read_text().strip()
            if limit != "max":
                usage = int((base / usage_file).read_text())
                room = min(room, int(limit) - max(0, usage - _memory_stat(base, inactive_key)))
        except (OSError, ValueError):
            pass  # no memory controller mounted for this hierarchy
    return room


def _memory_stat(cgroup: Path, key: str) -> int:
    """One counter of a cgroup's memory.stat (0 when absent)."""
    for line in (cgroup / "memory.stat").read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0
