"""What a model needs in memory, and the tier plan that fits it into the user's budgets.

Budgets cover what ntio allocates for the model: the norms, the output head (resident, or streamed in row chunks
like a layer), the token embedding (resident, or its rows read on demand), the KV cache, activations (bounded:
prefill runs in chunks of `engine.PREFILL_CHUNK` tokens or fewer, dequantized products in row chunks of
`ops.SCRATCH_BYTES`, on CPU only where `ops.dequantizes` (types the kernels lack; chunks of more than
`ops.KERNEL_ROWS` tokens with float32 activations, scalar kernels or dense weights), logits for the one position
generation samples or `engine.LOGITS_BYTES` of scored positions at a time), the staging slots when anything streams
(with a store's FFN layout, on the CPU, the two scratches a sparse FFN reads its groups into beside them), and the
tier A/B layers. The Python interpreter and its libraries,
the parsed metadata and the tokenizer are already allocated when the default budget is measured
(ntio.runtime.memory), so they are not in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ntio import _core
from ntio.kernels import ops
from ntio.kernels.cpu_kernels import KernelChoice
from ntio.models.config import ModelConfig
from ntio.runtime.engine import LOGITS_BYTES, MIN_PREFILL_CHUNK, PREFILL_CHUNK
from ntio.errors import OptionError
from ntio.runtime.memory import ram_room
from ntio.runtime.tiers import TierPlan, format_size, parse_size, parse_tier_spec, plan_tiers
from ntio.models.weights import WeightLayout
from ntio.runtime.loader import ALIGN, aligned, auto_prefetch_depth, drafting_prefetch_depth

# The KV cache's capacity when none is asked for: the model's context up to this many tokens (a 128k-context model's
# full cache would take more than its weights), fewer when the budget cannot hold it.
DEFAULT_CONTEXT = 4096
# When a tight budget grows into the libraries' pages, the smallest context the plan chooses for itself (none asked
# for) with them keeping `RamRoom.library_room`; where only a smaller one fits, they keep LIBRARY_FLOOR instead.
ROOMY_CONTEXT = 512


@dataclass(frozen=True)
class MemoryNeeds:
    globals: int  # float32 norms: always resident
    head: int  # the output head (with tied embeddings, the one table that is also the token embedding)
    token_embd: int  # an untied token embedding, resident or on disk (0 when tied: it is the head)
    kv_cache: int
    activations: int
    layers: list[int]  # bytes of each packed block buffer
    group_size: int
    staging_slots: int  # the group being computed + the groups read ahead
    # The two FFN group scratches of a streamed sparse FFN (`loader.LayerLoader._submit_groups`): a store with the
    # FFN layout is made for that, so they are planned whenever layers stream on the CPU from one (0: no layout)
    group_scratch: int = 0

    def largest_group(self, tiers: list[str] | None = None) -> int:
        """Bytes of the largest group of streamed layers (every layer counts as streamed if tiers is None)."""
        largest = 0
        for start in range(0, len(self.layers), self.group_size):
            group = range(start, min(start + self.group_size, len(self.layers)))
            largest = max(largest, sum(aligned(self.layers[i]) for i in group if tiers is None or tiers[i] != "A"))
        return largest

    def staging(self, tiers: list[str] | None = None, head_streamed: bool = True) -> int:
        """The staging slots, each one largest group or head chunk (at most the largest group of all layers:
        `loader.LayerLoader` cuts the head so)."""
        head_chunk = min(aligned(self.head), self.largest_group()) if head_streamed else 0
        total = self.staging_slots * max(self.largest_group(tiers), head_chunk)
        total += self.group_scratch if self.largest_group(tiers) else 0
        huge = _core.HUGE_PAGE  # pools this large are mapped in whole huge pages
        return -(-total // huge) * huge if total >= huge else total


def memory_needs(
    layout: WeightLayout, capacity: int, kv_dtype: torch.dtype, group_size: int, staging_slots: int,
    prefill_chunk: int = PREFILL_CHUNK, *, cuda: bool, kernels: KernelChoice = KernelChoice(),
) -> MemoryNeeds:
    cfg: ModelConfig = layout.cfg
    token_embd = 0 if layout.output is None else layout.token_embd.nbytes
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * capacity * cfg.head_dim * torch.empty(0, dtype=kv_dtype).element_size()
    tokens = min(capacity, prefill_chunk)
    # Floats a pass holds per token at its peak: the residual stream, the layer's input and its normed copy (the
    # kernels' prologue), attention's q/k/v, rotated q/k and outputs; in the FFN gate|up [2F], the gated copy [F] and
    # its 8-bit codes [F/4], and where the kernels take AMX tiles those codes laid out for them [3F/4]. Measured: a
    # 480-token pass of SmolLM2 grew the RSS by ~38 KB a token beside its KV cache (this formula without the tiles'
    # layouts: 36 KB).
    tiles = 0 if cuda or not kernels.takes_tiles else 3 * cfg.d_ff // 4
    per_token = 4 * cfg.d_model + 2 * cfg.q_width + 3 * cfg.kv_width + 13 * cfg.d_ff // 4 + tiles
    logits = max(4 * cfg.vocab_size, LOGITS_BYTES)
    # On CPU the kernels multiply on the encoded weights (with float32 activations, passes of up to KERNEL_ROWS
    # tokens): nothing is dequantized.
    scratch = ops.SCRATCH_BYTES if ops.dequantizes(tokens, layout.matrix_types(), kernels, cuda=cuda) else 0
    activations = scratch + 4 * tokens * per_token + logits
    layers = [layout.block_nbytes(i) + len(layout.blocks[i]) * ALIGN for i in range(cfg.n_layers)]
    norms = layout.output_norm.n_elements * 4
    neurons = None if cuda else getattr(layout.file, "ffn_group_neurons", None)
    scratch = 0 if neurons is None else 2 * max(_group_read_bound(layout, i, neurons) for i in range(cfg.n_layers))
    return MemoryNeeds(norms, layout.head.nbytes, token_embd, kv, activations, layers, group_size, staging_slots,
                       scratch)


def _group_read_bound(layout: WeightLayout, layer: int, neurons: int) -> int:
    """The most one read of `layer`'s FFN groups takes in a group scratch: every group's down copy, and the gate and up
    rows of at most one run per two groups (kept and dropped alternating), each run widened by up to a page at
    either end."""
    blocks, groups = layout.blocks[layer], layout.cfg.d_ff // neurons
    (_, length), = layout.file.ffn_group_extents(layer, [0])
    rows = sum(blocks[part].nbytes + 2 * ALIGN * -(-groups // 2) for part in ("ffn_gate", "ffn_up") if part in blocks)
    return groups * aligned(length) + rows


@dataclass(frozen=True)
class Budgets:
    device: int  # bytes for tier A (on CPU the device is host RAM: the RAM budget)
    ram: int
    ram_source: str  # "ram_budget" when given, else what bounded the measured room (ntio.runtime.memory)
    ram_tight: int = 0  # what a default RAM budget may grow to for the leanest plan (`RamRoom.tight_budget`)
    ram_roomy: int = 0  # the same where the context may shrink instead (libraries keep `RamRoom.library_room`)


def budgets(*, cuda: bool, gpu_memory_budget: str | int | None = None, ram_budget: str | int | None = None) -> Budgets:
    """The budgets given, or the defaults: 90% of free device memory; the RAM this process can still use, less a
    little headroom (`memory.RamRoom.default_budget`)."""
    if ram_budget is not None:
        ram, source = parse_size(ram_budget, "ram_budget"), "ram_budget"
        tight = roomy = ram
    else:
        room = ram_room()
        ram, source = room.default_budget, room.source
        tight, roomy = room.tight_budget(), room.tight_budget(room.library_room)
    device = None if gpu_memory_budget is None else parse_size(gpu_memory_budget, "gpu_memory_budget")
    if not cuda:  # (a device budget is checked all the same: a typo is an error, not ignored)
        return Budgets(ram, ram, source, tight, roomy)
    if device is not None:
        return Budgets(device, ram, source)
    return Budgets(int(0.9 * torch.cuda.mem_get_info()[0]), ram, source)


def minimum(needs: MemoryNeeds) -> int:
    """Bytes the leanest plan needs on the compute device (on CPU: in RAM): every layer and the head streamed, the
    token embedding on disk."""
    return needs.globals + needs.kv_cache + needs.activations + needs.staging()


def fitted_context(needs_at: Callable[[int], MemoryNeeds], capacity: int, budget: int) -> int:
    """The largest KV capacity <= `capacity` whose leanest plan fits in `budget` (0: not even one position)."""
    low, high = 0, capacity
    while low < high:
        mid = (low + high + 1) // 2
        if minimum(needs_at(mid)) <= budget:
            low = mid
        else:
            high = mid - 1
    return low


def make_plan(needs: MemoryNeeds, budget: Budgets, *, cuda: bool, tiers: str, spread: bool, shrink: str) -> TierPlan:
    """The forced plan (--tiers A|B|C|spec), or the one `plan_tiers` computes from the budgets (`spread`, `shrink`:
    as there). A forced plan places the layers as told; the output head, then the token embedding, stay resident where
    they fit beside them."""
    forced = parse_tier_spec(tiers, len(needs.layers))
    reserved = needs.globals + needs.kv_cache + needs.activations
    if forced is not None:
        if not cuda:
            forced = ["A" if t == "B" else t for t in forced]  # on CPU host RAM is the device
        head, embedding = _place_globals(needs, forced, budget.device)
        _check_forced(needs, forced, head, embedding, tiers, cuda=cuda, device_budget=budget.device,
                      ram_budget=budget.ram)
        return TierPlan(forced, None, None, reserved if cuda else 0, 0 if cuda else reserved, head, embedding)
    return plan_tiers(
        needs.layers,
        cuda=cuda,
        device_budget=budget.device,
        ram_budget=budget.ram,
        reserved_device=reserved if cuda else 0,
        reserved_ram=0 if cuda else reserved,
        staging_bytes=needs.staging(),
        head_bytes=needs.head,
        embedding_bytes=needs.token_embd,
        spread=spread,
        shrink=shrink,
    )


def _place_globals(needs: MemoryNeeds, forced: list[str], device_budget: int) -> tuple[str, str]:
    """Tiers of the output head and the token embedding beside forced layer tiers: resident (head first) while the
    device budget holds them, else streamed / on disk (a tied table goes where the head goes)."""
    resident = sum(n for n, t in zip(needs.layers, forced) if t == "A")
    used = needs.globals + needs.kv_cache + needs.activations + resident
    if any(t != "A" for t in forced):
        used += needs.staging(forced, head_streamed=False)
    if used + needs.head > device_budget:
        return "C", "C"
    return "A", "A" if used + needs.head + needs.token_embd <= device_budget else "C"


def _check_forced(needs: MemoryNeeds, forced: list[str], head: str, embedding: str, spec: str, *, cuda: bool,
                  device_budget: int, ram_budget: int) -> None:
    """A forced plan must fit its budgets too: the reserve (norms, KV cache, activations), a resident head and
    embedding, its resident layers and, when anything streams, the staging slots (on CUDA in host RAM and on the
    device)."""
    resident = sum(n for n, t in zip(needs.layers, forced) if t == "A")
    host_layers = sum(n for n, t in zip(needs.layers, forced) if t == "B")
    streams = any(t != "A" for t in forced) or head == "C"
    staging = needs.staging(forced, head_streamed=head == "C") if streams else 0
    globals_ = (needs.head if head == "A" else 0) + (needs.token_embd if embedding == "A" else 0)
    reserved = needs.globals + globals_ + needs.kv_cache + needs.activations
    demands = [("device memory", "gpu_memory_budget", reserved + resident + staging, device_budget),
               ("host memory", "ram_budget", host_layers + staging, ram_budget)] if cuda else [
              ("host memory", "ram_budget", reserved + resident + staging, ram_budget)]
    for memory, option, need, budget in demands:
        if need > budget:
            raise OptionError(
                "tiers",
                f"{spec!r} needs {format_size(need)} of {memory} but {option} is {format_size(budget)} "
                f"(KV cache {format_size(needs.kv_cache)}: a smaller max_context shrinks it; always-resident weights "
                f"{format_size(needs.globals + globals_)}, resident layers {format_size(resident + host_layers)}, "
                f"staging {format_size(staging)})",
            )


@dataclass(frozen=True)
class MemoryPlan:
    """Everything decided about memory before a weight is read: budgets, context, read-ahead and the tier plan."""

    needs: MemoryNeeds
    budget: Budgets
    plan: TierPlan
    capacity: int  # KV cache positions
    prefill_chunk: int  # the most tokens one forward pass takes
    prefetch_depth: int  # streamed groups read ahead (0: each group read when needed)
    notice: str | None  # said once to the user: the default context was shrunk to fit
    context_fitted: bool = False  # the context is the most the budget holds, short of the default one

    def report(self) -> dict:
        """What each part costs and where it lives (`ntio plan`, `--json`); bytes."""
        needs, plan = self.needs, self.plan
        resident = [n for n, t in zip(needs.layers, plan.tiers) if t != "C"]
        streamed = [n for n, t in zip(needs.layers, plan.tiers) if t == "C"]
        head_streamed = plan.head == "C"
        staging = needs.staging(plan.tiers, head_streamed) if streamed or head_streamed else 0
        embedding = needs.token_embd if plan.embedding == "A" else 0
        parts = {"norms": needs.globals, "output head": 0 if head_streamed else needs.head,
                 "token embedding": embedding, "kv cache": needs.kv_cache, "activations": needs.activations,
                 "staging": staging, "resident layers": sum(resident)}
        return {
            "tiers": plan.describe(), "layers_per_tier": plan.counts, "output_head": plan.head,
            "token_embedding": plan.embedding, "context": self.capacity, "prefill_chunk": self.prefill_chunk,
            "prefetch_depth": self.prefetch_depth if streamed or head_streamed else 0,
            "ram_budget": self.budget.ram, "device_budget": self.budget.device,
            "budget_source": self.budget.ram_source,
            "parts": parts, "total": sum(parts.values()), "minimum": minimum(needs),
            # and, with the embedding on disk, one row (a few KB) per token
            "bytes_read_per_token": sum(streamed) + (needs.head if head_streamed else 0),
            "model_bytes": sum(needs.layers) + needs.globals + needs.head + needs.token_embd,
        }


def plan_memory(layout: WeightLayout, *, cuda: bool, kv_dtype: torch.dtype, max_context: int | None = None,
                tiers: str = "auto", gpu_memory_budget: str | int | None = None, ram_budget: str | int | None = None,
                group_size: int = 1, prefetch_depth: int | None = None, sync: bool = False, reserved: int = 0,
                spread: bool = True, kernels: KernelChoice = KernelChoice(), drafting: bool = False) -> MemoryPlan:
    """Budgets (less `reserved` bytes of the compute device's: a draft model's), KV capacity, read-ahead and tier
    plan for a model, in that order (`spread`: as for `tiers.plan_tiers`; `kernels`: the CPU kernels the engine
    runs, which decide whether passes need a dequantization scratch).

    When the leanest plan does not fit an automatic plan's budget, the prefill chunk is halved (down to
    MIN_PREFILL_CHUNK); then, on CPU, a measured RAM budget grows up to `RamRoom.tight_budget` (this process's own
    library pages given up, with a notice: down to `library_room` where a context of ROOMY_CONTEXT or more fits,
    unless `max_context` is given, else to LIBRARY_FLOOR); then the context, unless `max_context` set it, shrinks
    (with a notice) from the model's up to DEFAULT_CONTEXT. The read-ahead is `prefetch_depth`, or
    `loader.auto_prefetch_depth` of the largest group; with `drafting` (the engine will have a drafter) and tiers
    given, on CPU, `loader.drafting_prefetch_depth` where its slots fit the budget beside the same plan."""
    cfg = layout.cfg
    if max_context is not None and not 1 <= max_context <= cfg.context_length:
        raise OptionError("max_context",
                          f"{max_context} is outside 1..{cfg.context_length}, the model's context length")
    if group_size < 1:
        raise OptionError("layer_group_size", f"must be >= 1, got {group_size}")
    if prefetch_depth is not None:
        groups = -(-cfg.n_layers // group_size) + 1  # a pass's layer groups and the head: all that can be ahead
        if not 1 <= prefetch_depth <= groups:
            raise OptionError("prefetch_depth", f"must be in 1..{groups} (the groups of a pass), got {prefetch_depth}")
        if sync:
            raise OptionError("prefetch_depth", "reads ahead, which sync=True turns off: give one of them")
    budget = budgets(cuda=cuda, gpu_memory_budget=gpu_memory_budget, ram_budget=ram_budget)
    if reserved:
        budget = less_reserved(budget, reserved, cuda)
    if sync:
        depth = 0
    elif prefetch_depth is None:
        depth = auto_prefetch_depth(memory_needs(layout, 1, kv_dtype, group_size, 1, cuda=cuda,
                                                 kernels=kernels).largest_group())
    else:
        depth = prefetch_depth

    capacity, chunk = max_context or min(cfg.context_length, DEFAULT_CONTEXT), PREFILL_CHUNK

    def needs_at(capacity: int) -> MemoryNeeds:
        return memory_needs(layout, capacity, kv_dtype, group_size, depth + 1, chunk, cuda=cuda, kernels=kernels)

    while tiers == "auto" and chunk > MIN_PREFILL_CHUNK and minimum(needs_at(capacity)) > budget.device:
        chunk //= 2
    notices = []
    lean = minimum(needs_at(capacity))
    if tiers == "auto" and not cuda and budget.ram < lean and budget.ram < budget.ram_tight:
        # The libraries keep `library_room` where a context the plan chooses, of at least ROOMY_CONTEXT, fits beside
        # it; only a context asked for, or one that would not fit, takes them down to LIBRARY_FLOOR.
        roomy = (max_context is None
                 and fitted_context(needs_at, capacity, budget.ram_roomy) >= min(capacity, ROOMY_CONTEXT))
        grown = min(lean, budget.ram_roomy if roomy else budget.ram_tight)
        notices.append(f"memory is tight: the RAM budget is {format_size(grown)}, not the {format_size(budget.ram)} "
                       f"the measured room leaves, taken from the page cache of the interpreter's own libraries "
                       f"(decode slows if they are paged out); --ram-budget sets it")
        budget = Budgets(grown, grown, budget.ram_source, budget.ram_tight, budget.ram_roomy)
    context_fitted = False
    if max_context is None and tiers == "auto":
        fitted = fitted_context(needs_at, capacity, budget.device)
        if 0 < fitted < capacity:
            context_fitted = True
            notices.append(f"the context is {fitted} tokens, not {capacity}: a KV cache of {capacity} does not fit in "
                           f"the memory budget ({format_size(budget.device)}); max_context (--ctx-size) asks for a "
                           f"size")
            capacity = fitted
    needs = needs_at(capacity)
    plan = make_plan(needs, budget, cuda=cuda, tiers=tiers, spread=spread, shrink=_shrink_advice(kv_dtype, sync))
    if drafting and tiers != "auto" and prefetch_depth is None and not sync and not cuda:
        depth, needs, plan = _drafting_read_ahead(depth, needs, plan, budget, lambda depth: memory_needs(
            layout, capacity, kv_dtype, group_size, depth + 1, chunk, cuda=cuda, kernels=kernels), tiers)
    return MemoryPlan(needs, budget, plan, capacity, chunk, depth, "; ".join(notices) or None, context_fitted)


def _drafting_read_ahead(depth: int, needs: MemoryNeeds, plan: TierPlan, budget: Budgets,
                         needs_with: Callable[[int], MemoryNeeds], tiers: str) -> tuple[int, MemoryNeeds, TierPlan]:
    """(read-ahead, needs, plan) of a forced CPU plan with the read-ahead deepened towards `drafting_prefetch_depth`
    (needs_with(depth): the needs with that read-ahead): the deepest whose slots fit the budget and leave the output
    head and the token embedding where they were; else as given."""
    streamed = {i // needs.group_size for i, tier in enumerate(plan.tiers) if tier != "A"}
    deepest = drafting_prefetch_depth(needs.largest_group(plan.tiers), len(streamed)) if streamed else depth
    for deeper in range(deepest, depth, -1):
        deep_needs = needs_with(deeper)
        try:
            deep_plan = make_plan(deep_needs, budget, cuda=False, tiers=tiers, spread=True, shrink="")
        except OptionError:
            continue
        if (deep_plan.head, deep_plan.embedding) == (plan.head, plan.embedding):
            return deeper, deep_needs, deep_plan
    return depth, needs, plan


def _shrink_advice(kv_dtype: torch.dtype, sync: bool) -> str:
    """What a budget below the minimum may change, leaving out what the plan already does."""
    kv = "a smaller max_context" + (" or kv_dtype float16" if kv_dtype == torch.float32 else "")
    return f"{kv} shrinks the KV cache" + ("" if sync else ", sync=True reads into one staging slot")


def resident_plan(layout: WeightLayout, *, cuda: bool, kv_dtype: torch.dtype, capacity: int,
                  kernels: KernelChoice = KernelChoice()) -> MemoryPlan:
    """A model planned wholly resident with a KV cache of `capacity` (at most its context), whatever the budgets: what
    a draft model takes beside its target (`report()["total"]` is reserved out of the target's budget)."""
    unbounded = 1 << 62
    return plan_memory(layout, cuda=cuda, kv_dtype=kv_dtype, max_context=min(capacity, layout.cfg.context_length),
                       tiers="A", gpu_memory_budget=unbounded, ram_budget=unbounded, kernels=kernels)


def less_reserved(budget: Budgets, reserved: int, cuda: bool) -> Budgets:
    """`budget` with `reserved` bytes taken out of the compute device's share (RAM on CPU): the target's budget once
    its draft is placed. An error naming the budget when nothing would be left."""
    option, room = ("gpu_memory_budget", budget.device) if cuda else ("ram_budget", budget.ram)
    if reserved >= room:
        raise OptionError(option, f"{format_size(room)} cannot hold the draft model ({format_size(reserved)} "
                                  f"resident) and the target beside it")
    if cuda:
        return Budgets(budget.device - reserved, budget.ram, budget.ram_source)
    return Budgets(budget.ram - reserved, budget.ram - reserved, budget.ram_source, max(0, budget.ram_tight - reserved),
                   max(0, budget.ram_roomy - reserved))
