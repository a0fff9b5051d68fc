"""What a model needs in memory, and the tier plan that fits it into the user's budgets.

Budgets cover what ntio allocates for the model: always-resident weights (token embedding, output head, norms),
the KV cache, activations (bounded: prefill runs in chunks of `engine.PREFILL_CHUNK` tokens and dequantized
products in row chunks of `ops.SCRATCH_BYTES`), the staging slots when anything streams, and the tier A/B
layers. The Python interpreter and its libraries (about 0.5 GB with torch), the parsed metadata and the tokenizer
(about 30 MB for a 49k-token vocabulary) come on top.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ntio import _core
from ntio.kernels import ops
from ntio.models.config import ModelConfig
from ntio.runtime.engine import PREFILL_CHUNK
from ntio.errors import OptionError
from ntio.runtime.tiers import TierPlan, available_ram, format_size, parse_size, parse_tier_spec, plan_tiers
from ntio.models.weights import WeightLayout

_ALIGN = 4096


@dataclass(frozen=True)
class MemoryNeeds:
    globals: int  # encoded token embedding (+ untied head) and float32 norms
    kv_cache: int
    activations: int
    layers: list[int]  # bytes of each packed block buffer
    group_size: int
    staging_slots: int  # the group being computed + the groups read ahead

    def largest_group(self, tiers: list[str] | None = None) -> int:
        """Bytes of the largest group of streamed layers (every layer counts as streamed if tiers is None)."""
        largest = 0
        for start in range(0, len(self.layers), self.group_size):
            group = range(start, min(start + self.group_size, len(self.layers)))
            largest = max(largest, sum(_aligned(self.layers[i]) for i in group if tiers is None or tiers[i] != "A"))
        return largest

    def staging(self, tiers: list[str] | None = None) -> int:
        """The staging slots, each one largest group."""
        total = self.staging_slots * self.largest_group(tiers)
        huge = _core.HUGE_PAGE  # pools this large are mapped in whole huge pages
        return -(-total // huge) * huge if total >= huge else total


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def memory_needs(
    layout: WeightLayout, capacity: int, kv_dtype: torch.dtype, group_size: int, staging_slots: int
) -> MemoryNeeds:
    cfg: ModelConfig = layout.cfg
    globals_ = layout.token_embd.nbytes + layout.output_norm.n_elements * 4
    if layout.output is not None:
        globals_ += layout.output.nbytes
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * capacity * cfg.head_dim * torch.empty(0, dtype=kv_dtype).element_size()
    tokens = min(capacity, PREFILL_CHUNK)
    per_token = 3 * cfg.d_model + cfg.q_width + 2 * cfg.kv_width + 2 * cfg.d_ff + cfg.vocab_size
    activations = ops.SCRATCH_BYTES + 4 * tokens * per_token
    layers = [layout.block_nbytes(i) + len(layout.blocks[i]) * _ALIGN for i in range(cfg.n_layers)]
    return MemoryNeeds(globals_, kv, activations, layers, group_size, staging_slots)


def make_plan(
    needs: MemoryNeeds,
    *,
    cuda: bool,
    tiers: str = "auto",
    gpu_memory_budget: str | int | None = None,
    ram_budget: str | int | None = None,
) -> TierPlan:
    """The forced plan (--tiers A|B|C|spec), or the one `plan_tiers` computes from the budgets.

    Default budgets: 90% of free device memory; 90% of MemAvailable (capped by the cgroup's memory.max).
    """
    forced = parse_tier_spec(tiers, len(needs.layers))
    reserved = needs.globals + needs.kv_cache + needs.activations
    ram = parse_size(ram_budget, "ram_budget") if ram_budget is not None else int(0.9 * available_ram())
    if cuda:
        free = torch.cuda.mem_get_info()[0]
        device = parse_size(gpu_memory_budget, "gpu_memory_budget") if gpu_memory_budget is not None else int(0.9 * free)
    else:
        device = ram
    if forced is not None:
        if not cuda:
            forced = ["A" if t == "B" else t for t in forced]  # on CPU host RAM is the device
        _check_forced(needs, forced, tiers, cuda=cuda, device_budget=device, ram_budget=ram)
        return TierPlan(forced, None, None, reserved if cuda else 0, 0 if cuda else reserved)
    return plan_tiers(
        needs.layers,
        cuda=cuda,
        device_budget=device,
        ram_budget=ram,
        reserved_device=reserved if cuda else 0,
        reserved_ram=0 if cuda else reserved,
        staging_bytes=needs.staging(),
    )


def _check_forced(needs: MemoryNeeds, forced: list[str], spec: str, *, cuda: bool, device_budget: int,
                  ram_budget: int) -> None:
    """A forced plan must fit its budgets too: the reserve (globals, KV cache, activations), its resident layers
    and, when anything streams, the staging slots (on CUDA in host RAM and on the device)."""
    resident = sum(n for n, t in zip(needs.layers, forced) if t == "A")
    host_layers = sum(n for n, t in zip(needs.layers, forced) if t == "B")
    staging = needs.staging(forced) if any(t != "A" for t in forced) else 0
    reserved = needs.globals + needs.kv_cache + needs.activations
    demands = [("device memory", "gpu_memory_budget", reserved + resident + staging, device_budget),
               ("host memory", "ram_budget", host_layers + staging, ram_budget)] if cuda else [
              ("host memory", "ram_budget", reserved + resident + staging, ram_budget)]
    for memory, option, need, budget in demands:
        if need > budget:
            raise OptionError(
                "tiers",
                f"{spec!r} needs {format_size(need)} of {memory} but {option} is {format_size(budget)} "
                f"(KV cache {format_size(needs.kv_cache)}: a smaller max_context shrinks it; always-resident weights "
                f"{format_size(needs.globals)}, resident layers {format_size(resident + host_layers)}, staging "
                f"{format_size(staging)})",
            )
