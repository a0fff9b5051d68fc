"""How much RAM this process can still use, measured rather than guessed.

The room is the machine's MemAvailable or, inside memory cgroups (v1 or v2: this process's own and its ancestors,
which may hold the limit), each limited cgroup's limit minus what the kernel cannot reclaim there (anonymous
memory, kernel memory, shmem: the usage minus the file pages on its LRU lists), whichever is smallest; then minus
the file-backed pages this process keeps resident (its libraries' code), which count as reclaimable but some of
which it needs, up to LIBRARY_WORKING_SET. Page cache is room, not use:
`import torch` alone charges ~1.35 GB to a cgroup, ~1 GB of it inactive file pages (../shared/DESIGN.md), and
counting those as used once left a 1.5 GB cap with a 129 MiB budget.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

# The default RAM budget leaves this share of the room (at least HEADROOM_MIN bytes) to the allocator's slack, the
# interpreter's growth and the page cache of the files being read.
HEADROOM_SHARE, HEADROOM_MIN = 0.05, 64 << 20
# Of this process's resident file pages, at most this many are kept out of the room. After `import torch, ntio`
# they are ~240 MB (Pss_File), most of them touched once while importing: the import itself runs in a 500 MB cgroup
# with ~300 MB of that anonymous (../shared/DESIGN.md), and a decode step runs a small part of the libraries' code.
LIBRARY_WORKING_SET = 128 << 20
# When the default budget cannot hold even the leanest plan, it may take that much from this process's own library
# pages (clean file pages: the kernel drops them and reads them again when they run, slower but never an OOM kill),
# leaving them at least `RamRoom.library_room` where the plan may shrink the context instead (none was asked for), and
# at least LIBRARY_FLOOR for a context asked for. A decode step runs only ~6 MB of the libraries' code, but a page
# fault in a library reads the disk's whole read-ahead window around it (read_ahead_kb; MADV_RANDOM on the mappings did
# not help on Linux 6.18), so the pages a step needs lie in windows that evict one another when the room holds few.
# Measured on Qwen2.5-Coder-1.5B streamed in 600-650 MiB cgroups, its KV cache filled, on a disk with 8 MiB of
# read-ahead (2026-11-28), the cgroup's file pages during decode (~9 MiB below what the plan left them): 43-54 MiB
# thrashed at 0.04-0.08 tok/s, 88 MiB decoded at 0.99, 96 MiB at 1.45 (~1.8 uncapped). An earlier VM (2026-11-24):
# ~25 MB left gave 1.8 tok/s where ~75 MB gave 3.6. LIBRARY_FLOOR keeps the plans that fit at all with it (Qwen 1.5B
# in 0.6 GB at a context of 512) and decodes near the disk's rate while their KV cache is mostly unwritten.
# That room is LIBRARY_FLOOR and READ_AHEAD_WINDOWS of the libraries' disk's read-ahead, at most LIBRARY_ROOM (also
# where the read-ahead is unknown): the plan that decoded at 0.05 tok/s with 8 MiB of read-ahead decoded at 1.31
# with 128 KiB (the same VM, read_ahead_kb set to 128; the cgroup's file pages 50 MiB, 49 of them mapped). Only
# those two read-aheads were measured; between them the windows are a straight line.
LIBRARY_ROOM = 96 << 20
LIBRARY_FLOOR = 48 << 20
READ_AHEAD_WINDOWS = 6


@dataclass(frozen=True)
class RamRoom:
    available: int  # bytes this process may still allocate
    source: str  # what bounds it: "MemAvailable" or "cgroup v1 /path" / "cgroup v2 /path"
    limit: int | None  # the cgroup's limit (None when no cgroup limit applies)
    unreclaimable: int  # the cgroup's anonymous + kernel memory (0 without a cgroup limit)
    own_file_pages: int  # this process's resident file-backed pages (up to LIBRARY_WORKING_SET leave the room)
    read_ahead: int | None = None  # bytes a page fault in the libraries reads (their disk's read-ahead); None: unknown

    @property
    def default_budget(self) -> int:
        return max(0, self.available - max(HEADROOM_MIN, int(HEADROOM_SHARE * self.available)))

    @property
    def library_room(self) -> int:
        """What this process's library pages keep where a plan may shrink its context instead of taking them: at
        least LIBRARY_FLOOR, and READ_AHEAD_WINDOWS of their disk's read-ahead above it, at most LIBRARY_ROOM."""
        if self.read_ahead is None:
            return LIBRARY_ROOM
        return min(LIBRARY_ROOM, LIBRARY_FLOOR + READ_AHEAD_WINDOWS * self.read_ahead)

    def tight_budget(self, keep: int = LIBRARY_FLOOR) -> int:
        """The most a default budget may grow to when the leanest plan needs it: the room with this process's own
        library pages given up down to `keep` bytes (at least the default budget)."""
        return max(self.default_budget, self.available + self.own_file_pages - keep)


def ram_room() -> RamRoom:
    """The RAM this process may still use, from /proc/meminfo and its memory cgroup (see the module's notes)."""
    own, read_ahead = min(_own_file_pages(), LIBRARY_WORKING_SET), libraries_read_ahead()
    best = RamRoom(max(0, _mem_available() - own), "MemAvailable", None, 0, own, read_ahead)
    for source, limit, usage, file_pages in _cgroup_limits():
        unreclaimable = max(0, usage - file_pages)
        room = max(0, limit - unreclaimable - own)
        if room < best.available:
            best = RamRoom(room, source, limit, unreclaimable, own, read_ahead)
    return best


def libraries_read_ahead() -> int | None:
    """The read-ahead (bytes) of the block device that holds torch's libraries, which a page fault in their code
    reads around it: from sysfs, the device's own queue or, for a partition, its disk's. None where the file system
    has no block device of its own (overlay, tmpfs) or torch is not installed."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        dev = os.stat(spec.origin).st_dev
        device = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve(strict=True)
    except OSError:
        return None
    for queue in (device / "queue", device.parent / "queue"):
        try:
            return int((queue / "read_ahead_kb").read_text()) << 10
        except (OSError, ValueError):
            continue
    return None


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_limits() -> list[tuple[str, int, int, int]]:
    """(source, limit, usage, file pages on the LRU lists) of each memory cgroup that has a limit and holds this
    process: its own and every ancestor's (a limit set on a parent, as a systemd slice or a container runtime does,
    binds this process too, and the parent's usage counts its siblings' memory), up to a v1 ancestor that does not
    account its children (`_v1_counts_children`)."""
    found = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, group = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            version, root = "v2", Path("/sys/fs/cgroup")
            limit_file, usage_file, file_keys = "memory.max", "memory.current", ("active_file", "inactive_file")
        elif "memory" in controllers.split(","):
            version, root = "v1", Path("/sys/fs/cgroup/memory")
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
            file_keys = ("total_active_file", "total_inactive_file")
        else:
            continue
        own = PurePosixPath(group)
        for cgroup in (own, *own.parents):
            base = root / str(cgroup).lstrip("/")
            if version == "v1" and cgroup != own and not _v1_counts_children(base):
                break  # neither this ancestor's limit nor any above it sees this process's memory
            try:
                limit = (base / limit_file).read_text().strip()
                if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a huge number
                    continue
                stat = _memory_stat(base)
                found.append((f"cgroup {version} {cgroup}", int(limit), int((base / usage_file).read_text()),
                              sum(stat.get(key, 0) for key in file_keys)))
            except (OSError, ValueError):
                pass  # no memory controller mounted for this hierarchy, or a root without limit files
    return found


def _v1_counts_children(cgroup: Path) -> bool:
    """Whether a v1 memory cgroup charges its children's memory to itself (`memory.use_hierarchy` 1), so that its
    limit binds them: with 0 (possible before Linux 5.16, which made hierarchy the only mode) a parent's limit and
    usage leave its children out. Unreadable: as the newer kernels do."""
    try:
        return (cgroup / "memory.use_hierarchy").read_text().strip() != "0"
    except OSError:
        return True


def _memory_stat(cgroup: Path) -> dict[str, int]:
    stat = {}
    for line in (cgroup / "memory.stat").read_text().splitlines():
        name, _, value = line.partition(" ")
        stat[name] = int(value)
    return stat


def _own_file_pages() -> int:
    """Resident file-backed pages of this process (Pss_File of /proc/self/smaps_rollup; 0 where it is missing)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss_File:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
