"""The layer loader: each block's weights from its tier, streaming the non-resident ones group by group.

Tier A blocks are read once at start-up onto the compute device; tier B blocks once into host RAM (pinned when
CUDA). Tier C blocks are read from disk at every use through the Rust reader, a *group* of `group_size`
consecutive layers at a time, into staging slots: while group g computes, the next `prefetch_depth` streamed
groups are already being read into the other slots (depth 1 is double buffering; 0 reads each group when needed;
the default keeps about READ_AHEAD_BYTES in flight). On CPU the graph computes straight from
the slot's bytes (no copy, no dequantization for decode); on CUDA each group's B and C bytes are copied to a device
buffer on a copy stream, and the compute stream waits on that copy's event.

The output head streams like a layer when the plan says so (`plan.head == "C"`): it is cut into row chunks of at most
one layer group's bytes, each a streamed unit after the last layer (units n_layers, n_layers + 1, ...), read ahead
in the same order and slots; `head_chunks()` gives them to the engine. Token embedding rows are read on demand
(`disk_rows`) when the plan leaves the table on disk.

Every block, whatever its tier, is built from the same kind of buffer (one layer packed by `plan_layer_read`), so
all tiers run the same ops on the same bytes: streamed and resident results are bit-identical.

What each layer reads is its load policy's decision (ntio.policies), asked before the read is submitted: the whole
layer (`DensePolicy`, the default), nothing (skip), a subset of the FFN's gate/up rows, or the layer less some of its
FFN matrices, whose kept neuron groups the FFN reads once it has chosen them (a sparse FFN on a store with the FFN
layout: `_read_groups`). The policy's horizon is the read-ahead window, `prefetch_depth` groups of `group_size` layers. Stats count the bytes each layer really read.

Interface (SPEC-006 §4.2): load_group / evict_group / prefetch_async / sync, num_groups, layers_per_group; and
`block(layer)` for the engine. Reads that fail raise ModelFormatError (file truncated) or ModelIOError (EIO, ...),
naming file and offset (errors.read_error).

With `verify` (the default), every tensor of an ntio store that a read brings in whole, resident or streamed, is
checked against the store's xxh3-64 checksum on the reader's I/O thread: a mismatch fails the read
(ModelFormatError naming file, tensor and offset). Resident reads are checked before they are used. A streamed
group is computed on as soon as its bytes land, while they are hashed (hashing them first would put the hash
between the disk and the compute), and every read a forward computed on must have passed its checks before the
forward returns (`end_forward`) and before its slot is read into again: nothing computed from bad bytes is ever
returned, so no token comes from them. A "rows" read verifies the tensors it reads whole; its partly read gate/up
rows are not covered by a per-tensor checksum. A sparse FFN's groups are checked against the FFN layout's checksum
of each group, as a streamed layer's tensors are (settled by the forward). Tensors
read in pieces (head chunks, embedding rows) are read once whole at start-up, a window at a time, checked against
the store's checksum and hashed piece by piece; every later read of a piece is checked against its hash. GGUF files
record no checksums (their structure is validated when parsed).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ntio import _core
from ntio.errors import ModelFormatError, NtioError, OptionError, read_error
from ntio.formats.gguf_file import TensorInfo
from ntio.io import Check, HostArena, read_into, slot_array, submit_into
from ntio.formats.model_file import extent_index, plan_layer_read, plan_subset_read, row_extent, tensor_checks
from ntio.kernels.ops import EncodedMatrix
from ntio.models.layers import FFNGroups, GroupedFFN, LayerWeights
from ntio.policies.base import LOAD_ALL, LoadDecision, LoadPolicy, overrides
from ntio.policies.dense import DensePolicy
from ntio.runtime.disk_rows import DiskRows
from ntio.runtime.stats import ForwardStats, StreamStats
from ntio.runtime.timeline import Timeline
from ntio.runtime.tiers import TierPlan
from ntio.models.weights import BlockVectors, WeightLayout, decode_vectors, encoded_block

ALIGN = 4096  # staging offsets keep each layer's file alignment, so O_DIRECT lands in place
# A global tensor kept on the CPU takes an arena of its own in huge pages from this size (at most 1/8 of it wasted
# rounding up to a whole huge page); smaller ones are not worth a mapping.
_KEPT_HUGE_MIN = 8 * _core.HUGE_PAGE
_HASH_WINDOW = 32 << 20  # bytes read at a time when a tensor is verified whole to take its pieces' hashes

# Default read-ahead: enough streamed groups to keep about this many bytes in flight, so that small layers (SmolLM2:
# 2.2 MB) still keep the disk's queue full while one group computes and another completes. All-C SmolLM2 on this
# project's VM: 8 groups ahead reached 0.68-0.84 of the I/O bound, 12 reached 1.0 (benches/RESULTS.md). Layers of
# READ_AHEAD_BYTES or more (Qwen2.5-1.5B: 28 MB, an 8B layer: 123 MB) get double buffering: one group read while one
# computes, which keeps that many bytes in flight; a deeper read-ahead would only take RAM from resident layers.
READ_AHEAD_BYTES = 24 << 20
MIN_PREFETCH_DEPTH, MAX_PREFETCH_DEPTH = 1, 16


# With a drafter (a draft model, a self-draft), each verify pass waits while the draft drafts: a read-ahead of
# READ_AHEAD_BYTES lands in the first milliseconds of it and the disk then idles. Where the tiers are given (every
# streamed layer is read at every pass whatever the RAM), the default read-ahead keeps the disk reading through the
# drafting instead: this many bytes, or the whole of one pass's streamed groups where that is less. Measured
# (benches/RESULTS.md, twenty-fourth session, Sapphire Rapids VM): all-C Qwen2.5-Coder-1.5B with the 0.5B draft
# 3.63x plain at a read-ahead of 1 group, 5.06x at 8; SmolLM2 with its self-draft on prose 1.38x at 10, 1.72x at 29.
# Under an automatic plan the RAM is better spent on resident layers, which save their reads altogether.
DRAFTING_READ_AHEAD_BYTES = 256 << 20

# Requests in flight for a streamed layer read whose FFN groups are read once part of the layer has computed
# (`_GROUPS_AFTER_COMPUTE`), where the read alone fills them with whole requests (1 MiB): those groups' reads go to
# the disk behind whatever is in flight, the next layers' reads among them, and the layer waits for them; at the
# reader's default depth (32) that is up to 32 MiB ahead. Measured on the Sapphire Rapids class VM (virtio disk,
# 2026-11-29), all-C from stores with the FFN layout, tok/s in alternating rounds (benches/RESULTS.md, thirtieth
# session): Qwen2.5-Coder-1.5B (22 MB reads), 24 greedy tokens, four rounds: dense 2.62-2.82 (at depth 8:
# 2.53-2.71), the down rule at keep 0.5 2.33-2.69 at depth 32, 2.80-3.13 at 4, 3.00-3.09 at 8. SmolLM2 (1.7 MB
# reads, many layers in flight) lost at depth 8: the down rule at keep 0.5 went from 0.63x dense to 0.48x. The
# predicted rule ("ffn_later"), whose groups are read while the layer before computes, lost too: Qwen at keep
# 0.5, 1.45-1.63x dense at depth 32, 1.04-1.62x at 8.
GROUP_READ_QUEUE_DEPTH = 8


def aligned(nbytes: int) -> int:
    """nbytes rounded up to a multiple of ALIGN (where the loader places each layer in a slot or arena; the memory
    plan counts the same)."""
    return -(-nbytes // ALIGN) * ALIGN


def auto_prefetch_depth(group_bytes: int) -> int:
    """Streamed groups to read ahead by default, for groups of at most `group_bytes`."""
    return max(MIN_PREFETCH_DEPTH, min(MAX_PREFETCH_DEPTH, -(-READ_AHEAD_BYTES // max(group_bytes, 1))))


def drafting_prefetch_depth(group_bytes: int, streamed_groups: int) -> int:
    """Streamed groups to read ahead by default while a drafter drafts (`DRAFTING_READ_AHEAD_BYTES`), for
    `streamed_groups` groups of at most `group_bytes` a pass: never more than all but the one computing."""
    return max(MIN_PREFETCH_DEPTH, min(streamed_groups - 1, -(-DRAFTING_READ_AHEAD_BYTES // max(group_bytes, 1))))

# Callback for progress: (what, done, total), e.g. ("load", 3, 30) while resident layers load.
ProgressCallback = Callable[[str, int, int], None]


@dataclass
class _LayerRead:
    """How one layer is read: reader extents into a packed layer buffer, and where each tensor lands in it."""

    extents: list[tuple[int, int, int]]  # (file_offset, length, dest_offset within the layer buffer)
    nbytes: int
    tensor_offsets: dict[str, int]  # block part -> offset of its bytes in the layer buffer
    checks: dict[str, Check]  # block part -> its checksum check, dest_offset within the layer buffer (store only)


@dataclass
class _PendingRead:
    index: int  # staging slot
    handle: _core.ReadHandle
    submitted: float  # perf_counter at submit
    decisions: dict[int, LoadDecision]  # streamed layer -> what was read for it
    nbytes: dict[int, int]  # streamed layer -> bytes read for it


@dataclass
class _Group:
    layers: list[int]
    streamed: list[int]  # layers of this group that are not resident on the device (B on CUDA, C)
    offsets: dict[int, int]  # streamed layer -> offset of its packed buffer in the group's staging slot
    nbytes: int


# Block parts a "rows" decision reads in part (so their whole-tensor checksums cannot be checked).
_ROW_PARTS = ("ffn_gate", "ffn_up")
# The `_checking` keys of the reads into the two FFN group scratches, one for even layers and one for odd (staging
# slots are 0, 1, ...).
_GROUP_SCRATCH = (-1, -2)
# Block parts not read whole, by decision kind.
_PARTIAL_PARTS = {"all": (), "skip": (), "rows": _ROW_PARTS, "down_later": ("ffn_down",),
                  "up_later": ("ffn_up", "ffn_down"), "ffn_later": ("ffn_gate", "ffn_up", "ffn_down")}
# Decision kinds whose FFN groups are read once chosen, and the matrices of which each reads the groups' rows.
_GROUP_ROWS = {"down_later": (), "up_later": ("ffn_up",), "ffn_later": _ROW_PARTS}
# The decisions whose FFN groups are read once the layer has computed gate (and up): reads the layer waits for.
_GROUPS_AFTER_COMPUTE = ("down_later", "up_later")


def _plan_layer(layout: WeightLayout, layer: int, verify: bool) -> _LayerRead:
    extents, nbytes = plan_layer_read(layout.file, layer)
    offsets = {}
    for part, info in layout.blocks[layer].items():
        file_start, _, dest = next(e for e in extents if e[0] <= info.offset < e[0] + e[1])
        offsets[part] = dest + info.offset - file_start
    checks = {}
    if verify:
        part_of = {info.name: part for part, info in layout.blocks[layer].items()}
        placed = [(info.name, offsets[part]) for part, info in layout.blocks[layer].items()]
        checks = {part_of[check[0]]: check for check in tensor_checks(layout.file, placed)}
    return _LayerRead(extents, nbytes, offsets, checks)


class LayerLoader:
    def __init__(
        self,
        layout: WeightLayout,
        plan: TierPlan,
        device: torch.device,
        *,
        group_size: int = 1,
        prefetch_depth: int | None = None,
        backend: str | None = None,
        on_progress: ProgressCallback | None = None,
        policy: LoadPolicy | None = None,
        verify: bool = True,
        interleave: bool = False,
    ) -> None:
        cfg = layout.cfg
        if group_size < 1:
            raise OptionError("layer_group_size", f"must be >= 1, got {group_size}")
        if len(plan.tiers) != cfg.n_layers:
            raise NtioError(f"the tier plan has {len(plan.tiers)} layers, the model {cfg.n_layers}")
        self.layout, self.plan, self.device, self.verify = layout, plan, device, verify
        self.interleave = interleave
        self.cuda = device.type == "cuda"
        if prefetch_depth is not None and prefetch_depth < 0:
            raise OptionError("prefetch_depth", f"must be >= 0, got {prefetch_depth}")
        self.on_progress = on_progress
        self.policy = policy if policy is not None else DensePolicy()
        self.stats = StreamStats(layers_per_tier=plan.counts)
        self._forward: ForwardStats | None = None
        self.timeline: Timeline | None = None  # set by `ntio profile`: every forward's spans, layer by layer
        try:
            # The model's file or shards, at the reader's default request size and depth.
            self.reader = _core.Reader(layout.file.files, backend=backend)
        except OSError as e:
            raise read_error(e) from None
        except ValueError as e:  # what NTIO_IO_BACKEND or NTIO_INJECT_FAULTS names, which the message says
            raise NtioError(str(e)) from None
        self._reads = [_plan_layer(layout, i, verify) for i in range(cfg.n_layers)]
        # A "down_later", "up_later" or "ffn_later" layer's FFN groups land in the scratch of its layer's parity, so a
        # layer's groups can be read ahead while the layer before multiplies its own (grown to the most a read asks).
        self._group_neurons: int | None = None if self.cuda else getattr(layout.file, "ffn_group_neurons", None)
        self._group_scratch: list[np.ndarray | None] = [None, None]
        self._layers_before_groups: _core.Reader | None = None  # `_shallow_reader`
        self._groups_ahead: dict[int, _GroupRead] = {}  # layer -> its FFN groups' read, submitted ahead
        self._group_copies: dict[int, tuple[int, list[int]]] = {}  # layer -> `_group_copy`
        self._row_group_sums: dict[str, list[int]] = {}  # gate/up tensor -> its row groups' checksums
        # Their reads take a reader of their own: the layer reads ahead queue on the main one, first in first out,
        # and a layer waits on its down groups at once.
        self._group_reader: _core.Reader | None = None

        # Resident tiers, read once: A onto the device; B into host RAM (pinned on CUDA; on CPU B is just RAM).
        self._resident: dict[int, LayerWeights] = {}
        # Decoded norms and biases of streamed layers: their bytes are re-read at every use, but decoding them again
        # would only repeat work (the values cannot differ), so the few KB per layer are kept.
        self._vectors: dict[int, BlockVectors] = {}
        # (streamed layer, staging index) -> its LayerWeights viewing that slot: a layer lands at the same place in a
        # slot at every read, so the views (and the kernel arguments made from them, `LayerWeights.kernel_args`)
        # are made once per slot, not once per use (~0.1 ms of Python a SmolLM2 layer, after its kernels).
        self._slot_weights: dict[tuple[int, int], LayerWeights] = {}
        self._host: dict[int, torch.Tensor] = {}  # tier B layer buffers on CUDA
        resident = [i for i, t in enumerate(plan.tiers) if t == "A" or (t == "B" and not self.cuda)]
        host_only = [i for i, t in enumerate(plan.tiers) if t == "B" and self.cuda]
        # On the CPU the resident layers stay where they are read: one arena in huge pages (`HostArena`).
        arena = None if self.cuda else HostArena([self._reads[i].nbytes for i in resident])
        for n, layer in enumerate(resident + host_only, 1):
            read = self._reads[layer]
            into = None if arena is None else arena.take(read.nbytes)
            buf = self._read_now(read.extents, read.nbytes, list(read.checks.values()), into)
            if layer in host_only:
                self._host[layer] = buf.pin_memory()
            else:
                self._resident[layer] = self._resident_weights(layer, buf.to(device))
            self._progress("load", n, len(resident) + len(host_only))

        # Streamed groups and their staging slots; then the head's chunks, one unit and group each.
        self.groups: list[_Group] = []
        for start in range(0, cfg.n_layers, group_size):
            layers = list(range(start, min(start + group_size, cfg.n_layers)))
            streamed = [i for i in layers if i not in self._resident]
            offsets, end = {}, 0
            for layer in streamed:
                offsets[layer] = end
                end += aligned(self._reads[layer].nbytes)
            self.groups.append(_Group(layers, streamed, offsets, end))
        self._head_rows: dict[int, tuple[int, int]] = {}  # head unit -> its rows [start, stop) of the output head
        self._row_checksums: dict[str, list[int]] = {}  # tensor -> its rows' hashes, taken with the head's chunks
        if plan.head == "C":
            chunk = max(aligned(sum(self._reads[i].nbytes for i in g.layers)) for g in self.groups)
            self._plan_head(layout.head, chunk)
        self._group_of = [g for g, grp in enumerate(self.groups) for _ in grp.layers]
        self._streamed_groups = [g for g, grp in enumerate(self.groups) if grp.streamed]
        slot_size = max((grp.nbytes for grp in self.groups), default=0)
        self.prefetch_depth = auto_prefetch_depth(slot_size) if prefetch_depth is None else prefetch_depth
        # A policy decides a streamed layer's read at most this many streamed groups before it computes.
        self.policy.horizon = self.prefetch_depth if self._streamed_groups else 0
        # One slot for the group being computed and one per group being read ahead.
        n_slots = self.prefetch_depth + 1 if self._streamed_groups else 0
        self._pool = _core.StagingPool(n_slots, slot_size) if n_slots else None
        self._slots = [self._pool.acquire() for _ in range(n_slots)]
        self._slot_bytes = [torch.from_numpy(slot_array(s)) for s in self._slots]
        self._device_bytes: list[torch.Tensor] = []
        if self.cuda and self._slots:
            for t in self._slot_bytes:  # pin the Rust-owned slots so H2D copies run at full speed
                torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
            self._device_bytes = [torch.empty(slot_size, dtype=torch.uint8, device=device) for _ in self._slots]
            self._copy_stream = torch.cuda.Stream(device)
            self._copied = [torch.cuda.Event() for _ in self._slots]  # H2D of the slot's group done
            self._computed = [torch.cuda.Event() for _ in self._slots]  # compute on the slot's device bytes done
        self._current: tuple[int, int] | None = None  # (group, staging index) being computed
        self._pending: dict[int, _PendingRead] = {}  # group -> its read for the group's next use
        self._dropped: list[_PendingRead] = []  # reads the policy no longer wanted, still landing in their slots
        self._dropped_group: int | None = None  # group of the current forward whose read was dropped
        # Staging index -> the read computed on there, whose checks may still be running (see the module's text).
        self._checking: dict[int, _core.ReadHandle] = {}
        self._busy_until = 0.0  # end of the reads counted so far: reads overlap, so busy time is their union
        self._blocks: dict[int, LayerWeights] = {}  # streamed layers of the current group
        self._head: dict[int, EncodedMatrix] = {}  # the current group's head chunk, when it is one

    def _plan_head(self, info: TensorInfo, chunk_bytes: int) -> None:
        """Cut the output head into row chunks of at most `chunk_bytes` (one layer group), each a streamed unit with
        its own group, checked against chunk hashes taken from one verified read now (with a tied table left on disk,
        the same read hashes its rows for `disk_rows`)."""
        row_nbytes = info.nbytes // info.shape[0]
        # A chunk lands where its file offset falls in a 4 KiB block, as a layer's tensors do, so that O_DIRECT reads
        # it straight into the slot (at offset 0 of its slot it went through bounce windows and a copy: 1.8 GB/s
        # where layers read at 3.8, Qwen2.5-Coder-1.5B's 30 MB chunks). The margin keeps it within one slot.
        rows = max(1, (chunk_bytes - ALIGN + 1) // row_nbytes)
        tied_rows = self.plan.embedding == "C" and info is self.layout.token_embd
        hashed = self.piece_checksums(info, rows * row_nbytes, *([row_nbytes] if tied_rows else []))
        sums = None if hashed is None else hashed[0]
        if tied_rows and hashed is not None:
            self._row_checksums[info.name] = hashed[1]
        for k, start in enumerate(range(0, info.shape[0], rows)):
            stop, unit = min(start + rows, info.shape[0]), len(self._reads)
            nbytes = (stop - start) * row_nbytes
            offset = info.offset + start * row_nbytes
            at = offset % ALIGN
            checks = {} if sums is None else {"output": (info.name, offset, at, nbytes, sums[k])}
            self._reads.append(_LayerRead([(offset, nbytes, at)], at + nbytes, {"output": at}, checks))
            self._head_rows[unit] = (start, stop)
            self.groups.append(_Group([unit], [unit], {unit: 0}, aligned(at + nbytes)))

    def piece_checksums(self, info: TensorInfo, *sizes: int) -> list[list[int]] | None:
        """For each size, the xxh3-64 of every piece of that many bytes of tensor `info` (the last maybe shorter), all
        from one read of the whole tensor a window at a time, checked against the store's checksum of it; None
        without `verify` or a checksum (GGUF). Memory: one window, a multiple of the row size near _HASH_WINDOW.
        Sizes that divide the window are hashed there in one call; others (chunks of many rows) are streamed."""
        expected = extent_index(self.layout.file).checksum(info.name) if self.verify else None
        if expected is None:
            return None
        row_nbytes = info.nbytes // info.shape[0]
        window = max(1, _HASH_WINDOW // row_nbytes) * row_nbytes
        whole, sums = _core.Hasher(), [[] for _ in sizes]
        streams = [_core.Hasher() for _ in sizes]  # the piece being hashed, for sizes that do not divide the window
        for start in range(0, info.nbytes, window):
            n = min(window, info.nbytes - start)
            head = (info.offset + start) % ALIGN
            data = self._read_now([(info.offset + start, n, head)], head + n, [])[head:].numpy()
            whole.update(data)
            for i, size in enumerate(sizes):
                if window % size == 0:
                    sums[i] += _core.piece_checksums(data, size)
                    continue
                at = 0
                while at < n:  # feed the piece that [start + at, ...) belongs to, closing it at its end
                    take = min(n - at, size - (start + at) % size)
                    streams[i].update(data[at : at + take])
                    at += take
                    if (start + at) % size == 0 or start + at == info.nbytes:
                        sums[i].append(streams[i].digest())
                        streams[i] = _core.Hasher()
        if whole.digest() != expected:
            raise ModelFormatError(f"{self.layout.file.path}: checksum mismatch in tensor {info.name!r} (extent at "
                                   f"offset {info.offset}, {info.nbytes} bytes): the file is corrupt or was changed")
        return sums

    # -- SPEC-006 interface ----------------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        """Groups of layers (a streamed head's chunk groups come after them and are not counted)."""
        return len(self.groups) - len(self._head_rows)

    @property
    def layers_per_group(self) -> int:
        return len(self.groups[0].layers)

    @property
    def read_ahead_share(self) -> float:
        """The share of a pass's streamed groups its read-ahead holds: what can land before the pass begins (while a
        draft drafts, say); 0 when nothing streams."""
        streamed = len(self._streamed_groups)
        return min(1.0, self.prefetch_depth / streamed) if streamed else 0.0

    def prefetch_async(self, group: int, ahead: int = 0) -> bool:
        """Start reading `group`'s streamed layers for its next use into a free slot; False if none is free.

        ahead: streamed groups that compute before this one (0: it is needed now), as its policy is told.
        """
        if not self.groups[group].streamed or group in self._pending:
            return group in self._pending
        free = self._free_slots()
        if not free and self._dropped:
            self._drain_dropped()  # only now: a dropped read has almost always landed by the time its slot is needed
            free = self._free_slots()
        if not free:
            return False
        self._pending[group] = self._submit(group, free[0], ahead)
        return True

    def sync(self) -> None:
        """Wait for every pending read (their groups stay ready for their next use), every dropped one and the
        checks of those computed on."""
        for p in self._pending.values():
            self._wait(p.handle)
        self._drain_dropped()
        self._settle()

    def load_group(self, group: int) -> list[LayerWeights]:
        """Make `group` the current group (using its prefetched read, else reading it now); return its blocks.
        Their checks may still be running: `sync` (or `end_forward`) raises if they fail, and nothing computed from
        the blocks may be used before."""
        if self._current is not None:
            self.evict_group(self._current[0])
        grp = self.groups[group]
        if grp.streamed:
            if group not in self._pending:
                self.prefetch_async(group)
            pending = self._pending.pop(group)
            self._finish_read(group, pending)
            self._current = (group, pending.index)
        return [self._resident.get(layer) or self._blocks.get(layer) for layer in grp.layers]

    def evict_group(self, group: int) -> None:
        """Drop `group`'s streamed blocks; its staging slot may be overwritten from now on."""
        if self._current is None or self._current[0] != group:
            return
        if self.cuda:
            self._computed[self._current[1]].record()  # later H2D copies into these device bytes wait for this
        for layer in self.groups[group].streamed:
            self._blocks.pop(layer, None)
            self._head.pop(layer, None)
        self._current = None

    # -- LayerSource (the engine's side) ---------------------------------------------------------------------

    def begin_forward(self, n_tokens: int) -> None:
        self._forward = self.stats.begin(n_tokens)
        self._forward_start = time.perf_counter()
        if self.timeline is not None:
            self.timeline.begin(n_tokens)

    def end_forward(self) -> None:
        """Tier C is read at every use: the next forward reads its groups again (already prefetched, if async).
        Raises if a read this forward computed on failed its checks: its results must not be used."""
        if self._current is not None:
            self.evict_group(self._current[0])
        self._dropped_group = None
        for ahead in self._groups_ahead.values():  # read ahead for a layer that never computed: never used
            _wait_unused(ahead.handle)
        self._groups_ahead.clear()
        try:
            self._settle()
        finally:
            if self._forward is not None:
                self._forward.wall_s = time.perf_counter() - self._forward_start
                self._forward = None
            if self.timeline is not None:
                self.timeline.end()

    def block(self, layer: int) -> LayerWeights | None:
        """The layer's weights for this forward, or None when its policy skips it."""
        resident = self._resident.get(layer)
        if resident is not None:
            return self._resident_block(layer, resident)
        group = self._group_of[layer]
        if group == self._dropped_group:
            return None
        if self._current is None or self._current[0] != group:
            if self._drop_unwanted(group):
                return None
            self._make_current(group)
        return self._blocks.get(layer)  # None: skipped (by the decision at submit, or no longer wanted)

    def resident_blocks(self) -> list[LayerWeights] | None:
        """Every layer's weights in layer order when all are resident, else None."""
        n_layers = self.layout.cfg.n_layers  # (`_reads` also holds a streamed head's chunks)
        if len(self._resident) != n_layers:
            return None
        return [self._resident[layer] for layer in range(n_layers)]

    def resident_copies(self, n_layers: int) -> list[LayerWeights]:
        """The first n_layers' weights for as long as the caller keeps them: this loader's own for resident layers,
        else a copy read now (checked like any read); for a self-draft, which runs those layers for every token."""
        copies = []
        missing = [layer for layer in range(n_layers) if layer not in self._resident]
        arena = None if self.cuda or not missing else HostArena([self._reads[i].nbytes for i in missing])
        for layer in range(n_layers):
            weights = self._resident.get(layer)
            if weights is None:
                read = self._reads[layer]
                into = None if arena is None else arena.take(read.nbytes)
                buf = self._read_now(read.extents, read.nbytes, list(read.checks.values()), into)
                weights = self._resident_weights(layer, buf.to(self.device))
            copies.append(weights)
        return copies

    def head_chunks(self) -> Iterator[tuple[int, EncodedMatrix]]:
        """A streamed output head, chunk by chunk in row order: (first row, the chunk's rows [R, D]). Each chunk is
        valid until the next is asked for."""
        for unit, (start, _) in self._head_rows.items():
            group = self._group_of[unit]
            if self._current is None or self._current[0] != group:
                self._make_current(group)
            yield start, self._head[unit]

    def _make_current(self, group: int) -> None:
        self.load_group(group)
        if self.cuda:
            copied = self._copied[self._current[1]]
            if self.timeline is not None:  # profiling: waiting for the copy is waiting, not compute
                started = time.perf_counter()
                copied.synchronize()
                self.timeline.add("wait", self.groups[group].layers[0], started, time.perf_counter())
            torch.cuda.current_stream(self.device).wait_event(copied)
        # Read ahead the next streamed groups in use order, wrapping around to the next forward's first ones.
        order = [g for g in self._streamed_groups if g > group] + [g for g in self._streamed_groups if g <= group]
        holds = overrides(self.policy, "holds")
        for ahead, later in enumerate(order[: self.prefetch_depth], start=1):
            if holds and any(self.policy.holds(layer) for layer in self.groups[later].streamed):
                break  # read when needed: its decision waits on what the layers before it show
            if not self.prefetch_async(later, ahead):
                break

    def __del__(self) -> None:
        if getattr(self, "_slots", None):  # not closed yet (and construction got as far as the slots)
            self.close()

    def close(self) -> None:
        """Drain in-flight reads (also after Ctrl-C) and give the staging slots back (unpinned on CUDA)."""
        for handle in [p.handle for p in [*self._pending.values(), *self._dropped]] + [*self._checking.values()]:
            try:
                handle.wait()
            except OSError:
                pass
        self._pending.clear()
        self._dropped.clear()
        self._checking.clear()
        self._blocks.clear()
        self._slot_weights.clear()
        self._head.clear()
        self._current = None
        if self.cuda:
            for t in self._slot_bytes:
                torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        for slot in self._slots:
            slot.release()
        self._slots, self._slot_bytes = [], []

    # -- internals -------------------------------------------------------------------------------------------

    def _resident_block(self, layer: int, weights: LayerWeights) -> LayerWeights | None:
        """A resident layer under its policy: asked just before it computes (ahead = 0). Its down is in memory, so
        a "down_later" decision leaves it whole (the policy's mask alone applies)."""
        decision = self.policy.decide(layer, 0)
        if decision.kind == "skip":
            return None
        if decision.kind == "rows":
            return dataclasses.replace(weights, ffn_rows=decision.rows)
        return weights

    def _decide(self, layer: int, ahead: int) -> LoadDecision:
        """The policy's decision for a streamed layer's read: "down_later", "up_later" and "ffn_later" only where the
        file has the FFN layout and the layer computes on the CPU (else the whole layer)."""
        decision = self.policy.decide(layer, ahead)
        return LOAD_ALL if decision.kind in _GROUP_ROWS and self._group_neurons is None else decision

    def _group_copy(self, layer: int) -> tuple[int, list[int]]:
        """(stride, checksums) of `layer`'s down copy, asked of the index once: bytes between groups (a group in whole
        pages: the copy's groups are aligned) and each group's xxh3-64."""
        copy = self._group_copies.get(layer)
        if copy is None:
            (_, length), = self.layout.file.ffn_group_extents(layer, [0])
            copy = aligned(length), self.layout.file.index.ffn_group_checksums(layer)
            self._group_copies[layer] = copy
        return copy

    def _read_groups(self, layer: int, parts: tuple[str, ...], ids: list[int]) -> GroupedFFN:
        """Groups `ids` of `layer`'s FFN, valid until the next read into its scratch: each group's down [D, neurons]
        matrix from the store's group-major copy, and the rows of each run of consecutive groups of the matrices
        in `parts` from their dense tensors (each run read in whole pages around its rows). Read now, unless the policy
        chose them ahead and they were read while the layer before computed (`_read_ahead`). The next layer's
        groups, where the policy has chosen them, are submitted before this read is waited for, so that the disk
        always has the next layer's groups queued behind this layer's. Every group's bytes are checked against
        their checksum while they are multiplied, as a streamed layer's are: the forward raises at its end if one
        fails, and the next read into the scratch waits for them."""
        read = self._groups_ahead.pop(layer, None)
        if read is not None and read.ids != ids:  # chosen otherwise since: never used
            _wait_unused(read.handle)
            read = None
        if read is None:
            read = self._submit_groups(layer, parts, ids)
        # Submitted once the groups were known, not once this layer's landed: Qwen2.5-Coder-1.5B, predicted rule at
        # keep 0.5, all layers on disk, ten alternating rounds: 3.12-5.04 tok/s (median 4.44) against 2.68-4.77
        # (3.63) (benches/RESULTS.md, thirty-first session).
        self._read_ahead(layer + 1)
        t0 = time.perf_counter()
        self._wait(read.handle, landed=True)  # its checks run on while the groups are multiplied
        self._checking[_GROUP_SCRATCH[layer % 2]] = read.handle
        if self._forward is not None:
            waited = time.perf_counter() - t0
            self._forward.io_wait_s += waited
            self._forward.io_busy_s += waited
        return read.matrices()

    def _read_ahead(self, layer: int) -> None:
        """Submit `layer`'s FFN group read now, where it is a streamed "ffn_later" layer and the policy already knows
        its groups (`LoadPolicy.ahead_groups`)."""
        if layer >= len(self._reads) or layer in self._groups_ahead or layer in self._host:
            return
        ids = self.policy.ahead_groups(layer)
        if (ids is not None and layer in self.groups[self._group_of[layer]].streamed
                and self._decide(layer, 0).kind == "ffn_later"):
            self._groups_ahead[layer] = self._submit_groups(layer, _ROW_PARTS, ids)

    def _submit_groups(self, layer: int, parts: tuple[str, ...], ids: list[int]) -> _GroupRead:
        """Start reading groups `ids` of `layer` into the scratch of its parity (see `_read_groups`)."""
        n, blocks = self._group_neurons, self.layout.blocks[layer]
        pieces: list[tuple[int, int, int]] = []  # (file offset, length, offset in the scratch), whole pages
        checks: list[Check] = []
        runs = []  # per run: (first neuron, each part's rows (offset in the scratch, length, shape, type))
        used = 0  # bytes of the scratch the pieces so far fill
        for first, stop in _runs(ids) if parts else []:
            rows = []
            for part in parts:
                info = blocks[part]
                offset, length = row_extent(self.layout.file, info.name, first * n, stop * n)
                start = offset - offset % ALIGN
                span = aligned(offset + length) - start
                pieces.append((start, span, used))
                at = used + offset - start  # where the rows land
                used += span
                group_bytes = length // (stop - first)
                if self.verify:
                    sums = self._row_sums(info.name)
                    checks += [(f"{info.name} group {g}", offset + i * group_bytes, at + i * group_bytes,
                                group_bytes, sums[g]) for i, g in enumerate(range(first, stop))]
                rows.append((at, length, ((stop - first) * n, info.shape[1]), info.qtype))
            runs.append((first * n, rows))
        down = blocks["ffn_down"]
        stride, sums = self._group_copy(layer)
        extents = self.layout.file.ffn_group_extents(layer, ids)
        base = used
        pieces += [(offset, stride, base + i * stride) for i, (offset, _) in enumerate(extents)]
        if self.verify:
            checks += [(f"{down.name} group {g}", offset, base + i * stride, length, sums[g])
                       for i, (g, (offset, length)) in enumerate(zip(ids, extents))]
        nbytes = base + len(ids) * stride
        scratch = layer % 2
        self._settle(_GROUP_SCRATCH[scratch])  # its last groups' checks must pass before their bytes are overwritten
        if self._group_scratch[scratch] is None or len(self._group_scratch[scratch]) < nbytes + ALIGN:
            self._group_scratch[scratch] = np.empty(nbytes + ALIGN, dtype=np.uint8)
        buf = self._group_scratch[scratch]
        buf = buf[-buf.ctypes.data % ALIGN :][:nbytes]
        if self._group_reader is None:
            self._group_reader = _core.Reader(self.layout.file.files, backend=self.reader.backend)
        try:
            handle = submit_into(self._group_reader, pieces, buf, checks)
        except OSError as e:
            raise read_error(e) from None
        self._count_read({layer: nbytes})
        downs = [(base + i * stride, length, (down.shape[0], n), down.qtype) for i, (_, length) in enumerate(extents)]
        return _GroupRead(ids, handle, torch.from_numpy(buf), downs, runs)

    def _row_sums(self, name: str) -> list[int]:
        """The checksums of the row groups of gate/up tensor `name`, asked of the store once."""
        sums = self._row_group_sums.get(name)
        if sums is None:
            sums = self._row_group_sums[name] = self.layout.file.ffn_row_group_checksums(name)
        return sums

    def _drop_unwanted(self, group: int) -> bool:
        """If the policy no longer wants any layer of `group`'s pending read, skip the group without waiting."""
        pending = self._pending.get(group)
        if pending is None or any(layer in self._host for layer in self.groups[group].streamed):
            return False
        read = [layer for layer, d in pending.decisions.items() if d.kind != "skip"]
        if any(self.policy.still_wanted(layer, pending.decisions[layer]) for layer in read):
            return False
        self._dropped.append(self._pending.pop(group))
        self._dropped_group = group
        self._count_read(pending.nbytes)  # its bytes come off the disk all the same
        return True

    def _free_slots(self) -> list[int]:
        busy = {p.index for p in [*self._pending.values(), *self._dropped]}
        if self._current is not None:
            busy.add(self._current[1])
        return sorted(set(range(len(self._slots))) - busy)

    def _count_read(self, nbytes: dict[int, int]) -> None:
        if self._forward is not None:
            for layer, n in nbytes.items():
                if not n:
                    continue  # skipped: nothing read
                self._forward.bytes_read += n
                self._forward.bytes_per_layer[layer] = self._forward.bytes_per_layer.get(layer, 0) + n

    def _drain_dropped(self) -> None:
        """Wait for dropped reads (long since landed, as a rule) so their slots can be reused; errors do not matter:
        no byte of a dropped read is ever computed on."""
        for p in self._dropped:
            _wait_unused(p.handle)
        self._dropped.clear()

    def _layer_extents(self, layer: int, decision: LoadDecision) -> list[tuple[int, int, int]]:
        """Extents (file offset, length, offset in the layer buffer) that `decision` reads of `layer`."""
        read = self._reads[layer]
        if decision.kind == "all":
            return read.extents
        if decision.kind == "skip":
            return []
        tensors = self.layout.blocks[layer]
        if decision.kind in _GROUP_ROWS:
            return plan_subset_read(read.extents, [(info.offset, info.nbytes) for part, info in tensors.items()
                                                   if part not in _PARTIAL_PARTS[decision.kind]])
        if decision.rows[-1][1] > self.layout.cfg.d_ff:
            raise ValueError(
                f"load policy: FFN rows {list(decision.rows)} of layer {layer} exceed d_ff {self.layout.cfg.d_ff}"
            )
        ranges = [(info.offset, info.nbytes) for part, info in tensors.items() if part not in _ROW_PARTS]
        for part in _ROW_PARTS:
            name = next(t.name(layer) for t in self.layout.family.tensors if t.part == part)
            ranges += [row_extent(self.layout.file, name, start, stop) for start, stop in decision.rows]
        return plan_subset_read(read.extents, ranges)

    def _layer_checks(self, layer: int, decision: LoadDecision, base: int) -> list[Check]:
        """Checks of the tensors `decision` reads whole, for a layer buffer at `base` in the destination."""
        if decision.kind == "skip":
            return []
        return [
            (name, file_offset, base + dest, length, checksum)
            for part, (name, file_offset, dest, length, checksum) in self._reads[layer].checks.items()
            if part not in _PARTIAL_PARTS[decision.kind]
        ]

    def _submit(self, group: int, index: int, ahead: int) -> _PendingRead:
        grp = self.groups[group]
        extents, checks, decisions, nbytes = [], [], {}, {}
        for layer in grp.streamed:
            if layer in self._host:
                continue  # tier B on CUDA: in pinned host memory, nothing to read; decided when the group loads
            decisions[layer] = decision = LOAD_ALL if layer in self._head_rows else self._decide(layer, ahead)
            base = grp.offsets[layer]
            layer_extents = self._layer_extents(layer, decision)
            extents += [(off, length, base + dest) for off, length, dest in layer_extents]
            checks += self._layer_checks(layer, decision, base)
            nbytes[layer] = sum(length for _, length, _ in layer_extents)
        if self.cuda:
            self._copied[index].synchronize()  # the slot's previous H2D copy must be done before it is overwritten
        self._settle(index)  # the slot's previous bytes must be hashed before they are overwritten
        shallow = (any(d.kind in _GROUPS_AFTER_COMPUTE for d in decisions.values())
                   and sum(nbytes.values()) >= GROUP_READ_QUEUE_DEPTH * self.reader.request_size)
        try:
            handle = (self._shallow_reader() if shallow else self.reader).submit(extents, self._slots[index], checks)
        except OSError as e:
            raise read_error(e) from None
        return _PendingRead(index, handle, time.perf_counter(), decisions, nbytes)

    def _shallow_reader(self) -> _core.Reader:
        """The reader of large streamed layer reads whose FFN groups are read after part of the layer computes
        (GROUP_READ_QUEUE_DEPTH), made once."""
        if self._layers_before_groups is None:
            self._layers_before_groups = _core.Reader(self.layout.file.files, backend=self.reader.backend,
                                                      queue_depth=GROUP_READ_QUEUE_DEPTH)
        return self._layers_before_groups

    def _wait(self, handle: _core.ReadHandle, landed: bool = False) -> None:
        """Wait for the read to end (its checks passed), or with `landed` only for its bytes to be in."""
        try:
            handle.wait_landed() if landed else handle.wait()
        except OSError as e:  # truncated or vanished file: name it, never compute on partial bytes
            raise read_error(e) from None

    def _settle(self, index: int | None = None) -> None:
        """Wait for the checks of the read computed on in staging slot `index` (None: in every slot)."""
        for i in [index] if index is not None else list(self._checking):
            handle = self._checking.pop(i, None)
            if handle is not None:
                self._wait(handle)

    def _finish_read(self, group: int, pending: _PendingRead) -> None:
        t0 = time.perf_counter()
        self._wait(pending.handle, landed=True)
        self._checking[pending.index] = pending.handle
        grp = self.groups[group]
        submitted = pending.submitted
        end = submitted + (pending.handle.elapsed or 0.0)  # elapsed counts from submit; the reader's queue is FIFO
        busy = max(0.0, end - max(submitted, self._busy_until))
        self._busy_until = max(self._busy_until, end)
        waited = time.perf_counter()
        if self._forward is not None:
            self._forward.io_wait_s += waited - t0
            self._forward.io_busy_s += busy
        if self.timeline is not None:
            self.timeline.add("wait", grp.layers[0], t0, waited)
            for layer, nbytes in pending.nbytes.items():
                self.timeline.add("read", layer, submitted, end, nbytes)
        self._count_read(pending.nbytes)
        for layer in grp.streamed:
            if layer in self._host:
                pending.decisions[layer] = self._decide(layer, 0)
        decisions = pending.decisions
        wanted = [i for i in grp.streamed if i in self._head_rows or
                  (decisions[i].kind != "skip" and self.policy.still_wanted(i, decisions[i]))]
        source = self._to_device(group, pending.index, wanted) if self.cuda else self._slot_bytes[pending.index]
        for layer in wanted:
            decision = decisions[layer]
            base = grp.offsets[layer]
            if layer in self._head_rows:
                start, stop = self._head_rows[layer]
                info = self.layout.head
                at = base + self._reads[layer].tensor_offsets["output"]
                raw = source[at : at + (stop - start) * (info.nbytes // info.shape[0])]
                self._head[layer] = EncodedMatrix(raw, info.qtype, (stop - start, info.shape[1]))
                continue
            weights = self._slot_weights.get((layer, pending.index))
            if weights is None:
                weights = self._weights(layer, source[base : base + self._reads[layer].nbytes], keep_vectors=True)
                self._slot_weights[layer, pending.index] = weights
            if decision.kind == "rows":
                weights = dataclasses.replace(weights, ffn_rows=decision.rows)
            elif decision.kind in _GROUP_ROWS:
                parts = _GROUP_ROWS[decision.kind]
                weights = weights.choosing_ffn(ffn_groups=FFNGroups(
                    self._group_neurons, functools.partial(self._read_groups, layer, parts), parts))
            self._blocks[layer] = weights

    def _to_device(self, group: int, index: int, layers: list[int]) -> torch.Tensor:
        """Copy `layers` of the group (C from the slot, B from pinned RAM) to the device on the copy stream."""
        grp, dst = self.groups[group], self._device_bytes[index]
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(self._computed[index])  # compute on the old bytes must be finished
            for layer in layers:
                base, n = grp.offsets[layer], self._reads[layer].nbytes
                src = self._host[layer] if layer in self._host else self._slot_bytes[index][base : base + n]
                timed = self.timeline.copy_events(layer, n) if self.timeline is not None else None
                if timed:
                    timed[0].record(self._copy_stream)
                dst[base : base + n].copy_(src, non_blocking=True)
                if timed:
                    timed[1].record(self._copy_stream)
            self._copied[index].record(self._copy_stream)
        if self._forward is not None:
            self._forward.bytes_h2d += sum(self._reads[layer].nbytes for layer in layers)
        return dst

    def disk_rows(self, info: TensorInfo) -> DiskRows:
        """The encoded table `info` left on disk, its rows read on demand (with `verify`, checked against row hashes
        taken from one verified read of the whole table: now, or with the streamed head's when it is that table)."""
        sums = self._row_checksums.get(info.name)
        if sums is None:
            hashed = self.piece_checksums(info, info.nbytes // info.shape[0])
            sums = None if hashed is None else hashed[0]
        return DiskRows(self.reader, info, sums, self.device)

    def read_tensor(self, info: TensorInfo) -> torch.Tensor:
        """One tensor's encoded bytes, read now into host memory (for the always-resident globals)."""
        head = info.offset % ALIGN  # keep the file's alignment in memory so O_DIRECT reads land in place
        checks = tensor_checks(self.layout.file, [(info.name, head)]) if self.verify else []
        nbytes = head + info.nbytes
        # Kept on the CPU, in huge pages when that wastes little: each arena rounds up to whole huge pages.
        into = HostArena([nbytes]).take(nbytes) if not self.cuda and nbytes >= _KEPT_HUGE_MIN else None
        return self._read_now([(info.offset, info.nbytes, head)], nbytes, checks, into)[head:]

    def _read_now(self, extents: list[tuple[int, int, int]], nbytes: int, checks: list[Check],
                  into: np.ndarray | None = None) -> torch.Tensor:
        """Read `extents` (destination offsets into `nbytes` bytes, aligned to ALIGN) into `into`, or into new
        memory, and wait."""
        buf = into
        if buf is None:
            buf = np.empty(nbytes + ALIGN, dtype=np.uint8)
            buf = buf[-buf.ctypes.data % ALIGN :][:nbytes]
        try:
            read_into(self.reader, extents, buf, checks)
        except OSError as e:
            raise read_error(e) from None
        return torch.from_numpy(buf)

    def _resident_weights(self, layer: int, buf: torch.Tensor) -> LayerWeights:
        """`_weights` of a buffer read once and kept: with `interleave`, its matrices that pay for it interleaved
        in place (`LayerWeights.with_interleaved_rows`; streamed layers keep plain rows, the same bits)."""
        weights = self._weights(layer, buf)
        return weights.with_interleaved_rows() if self.interleave else weights

    def _weights(self, layer: int, buf: torch.Tensor, keep_vectors: bool = False) -> LayerWeights:
        """LayerWeights viewing one packed layer buffer (host or device); keep_vectors (streamed layers) keeps the
        decoded norms and biases for the layer's next use."""
        read, tensors = self._reads[layer], self.layout.blocks[layer]

        def raw(part: str) -> torch.Tensor:
            start = read.tensor_offsets[part]
            return buf[start : start + tensors[part].nbytes]

        vectors = self._vectors.get(layer)
        if vectors is None:  # the layer's first bytes in memory (a resident layer's only ones)
            self.layout.check_block(layer, raw)
            vectors = decode_vectors(tensors, raw)
            if keep_vectors:
                self._vectors[layer] = vectors
        return encoded_block(tensors, raw, vectors)

    def _progress(self, what: str, done: int, total: int) -> None:
        if self.on_progress is not None:
            self.on_progress(what, done, total)


@dataclass
class _GroupRead:
    """A read of some FFN groups of a layer into a group scratch (`LayerLoader._submit_groups`): where each matrix
    lands, as (offset in the scratch, length, shape, type)."""

    ids: list[int]
    handle: _core.ReadHandle
    raw: torch.Tensor  # the scratch's bytes
    downs: list[tuple[int, int, tuple[int, int], int]]  # each group's down [D, neurons]
    runs: list[tuple[int, list[tuple]]]  # per run of consecutive groups: (first neuron, each part's rows)

    def matrices(self) -> GroupedFFN:
        def matrix(at: int, length: int, shape: tuple[int, int], qtype: int) -> EncodedMatrix:
            return EncodedMatrix(self.raw[at : at + length], qtype, shape)

        return GroupedFFN(down=[matrix(*d) for d in self.downs],
                          runs=[(first, [matrix(*rows) for rows in parts]) for first, parts in self.runs])


def _wait_unused(handle: _core.ReadHandle) -> None:
    """Wait for a read no byte of which is computed on, so its buffer can be reused: its errors do not matter."""
    try:
        handle.wait()
    except OSError:
        pass


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted group ids -> their runs of consecutive ids [first, stop)."""
    runs: list[tuple[int, int]] = []
    for g in ids:
        if runs and runs[-1][1] == g:
            runs[-1] = (runs[-1][0], g + 1)
        else:
            runs.append((g, g + 1))
    return runs
