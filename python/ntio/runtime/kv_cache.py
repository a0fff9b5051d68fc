"""The KV cache, and what it holds: the token id at each position and, per layer, which positions it computed.

k, v: [n_layers, Hkv, capacity, hd], preallocated (`kv_memory`): on a GPU with torch.empty; on the CPU a cache of
KV_HUGE_MIN bytes or more in transparent huge pages, committed at once as llama.cpp clears its cache at start, and a
smaller one with torch.empty, its pages committed only when written.
`partition(n, c)` lends that memory out as n caches of c positions (a server's slots), so that the KV memory the plan
counted once is allocated once, also on a GPU, where an allocation is committed at once.
`ids` are the tokens whose K/V the cache holds (positions 0 .. length-1); `crop(n)` forgets everything from
position n on (speculative rollback), `keep_branch` keeps one branch of a verified token tree, and
`reusable_prefix(ids)` says how many leading positions a new prompt can keep, by comparing token ids. A layer
skipped for a position (a load policy's SKIP, or a per-token policy leaving that token out of the layer) wrote no
K/V there: `skipped[layer, pos]` is True, and attention in that layer masks the position out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ntio.io import HostArena
from ntio.models.config import ModelConfig


# The least K + V bytes a CPU cache takes huge pages for (`kv_memory`).
KV_HUGE_MIN = 64 << 20


def kv_memory(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V memory of `shape`: on the CPU, from KV_HUGE_MIN bytes for both, one `HostArena` (huge pages, zeroed);
    else torch.empty.

    Attention reads every cached key and value of a layer at each step, so in 4 KiB pages a long context costs a TLB
    miss every 4 KiB; huge pages leave a handful. Measured on the Sapphire Rapids class VM (2 vCPU, 2026-11-29),
    SmolLM2 resident, a ~2,300-token prompt in a cache of 4096 positions (189 MB), 48 tokens: decode 37.9-49.1 tok/s
    with torch.empty's 4 KiB pages against 53.2-58.5 in huge pages, prefill 408-426 against 468-538 tok/s (four
    alternating pairs of processes). A small cache spans few pages either way, and committed as written it leaves a
    tight RAM budget the room its short prompts do not fill.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or 2 * nbytes < KV_HUGE_MIN:
        return torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
    arena = HostArena([nbytes, nbytes])
    return tuple(torch.from_numpy(arena.take(nbytes)).view(dtype).view(shape) for _ in range(2))


class KVCache:
    def __init__(self, cfg: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device | str,
                 memory: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """memory: the K and V tensors [n_layers, Hkv, capacity, hd] to use (views of another cache's), instead of
        new ones."""
        shape = (cfg.n_layers, cfg.n_kv_heads, capacity, cfg.head_dim)
        if memory is None:
            memory = kv_memory(shape, dtype, device)
        self.k, self.v = memory
        self.cfg, self.capacity = cfg, capacity
        self.ids: list[int] = []
        # Positions each layer holds K/V (or a skip mark) for: equal to `length` after a complete forward, and
        # ahead of it for the first layers when a forward stopped part-way (an I/O error): those are not trusted.
        self.layer_length = [0] * cfg.n_layers
        self.skipped = torch.zeros((cfg.n_layers, capacity), dtype=torch.bool, device=device)
        self._n_skipped = [0] * cfg.n_layers  # skipped positions below layer_length, per layer (avoids a tensor op)

    def partition(self, parts: int, capacity: int) -> list[KVCache]:
        """`parts` caches of `capacity` positions each, whose K/V lie in this cache's memory: consecutive pieces of it,
        each contiguous in its own shape (the attention kernels take a layer's [Hkv, capacity, hd] as one block), so
        not this cache's positions. This cache forgets what it held; it must not run a forward while they are in use."""
        if parts * capacity > self.capacity:
            raise ValueError(f"{parts} caches of {capacity} positions do not fit in a cache of {self.capacity}")
        self.crop(0)
        shape = (self.cfg.n_layers, self.cfg.n_kv_heads, capacity, self.cfg.head_dim)
        size = shape[0] * shape[1] * shape[2] * shape[3]
        k, v = self.k.view(-1), self.v.view(-1)
        return [KVCache(self.cfg, capacity, self.k.dtype, self.k.device,
                        memory=(k[i * size : (i + 1) * size].view(shape), v[i * size : (i + 1) * size].view(shape)))
                for i in range(parts)]

    @property
    def length(self) -> int:
        """Valid positions: those every layer has processed, with their token ids known."""
        return len(self.ids)

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a KV cache of {self.length} positions to {length}")
        del self.ids[length:]
        for layer, n in enumerate(self.layer_length):
            if n > length:
                if self._n_skipped[layer]:
                    self._n_skipped[layer] -= int(self.skipped[layer, length:n].sum())
                    self.skipped[layer, length:n] = False
                self.layer_length[layer] = length

    def reusable_prefix(self, ids: Sequence[int], limit: int) -> int:
        """Leading positions whose token ids equal `ids` (at most `limit`): a new prompt need not recompute them."""
        n = 0
        for cached, new in zip(self.ids, ids[:limit]):
            if cached != new:
                break
            n += 1
        return n

    def record(self, layer: int, start_pos: int, n_tokens: int, *, skipped: bool | torch.Tensor) -> None:
        """Layer `layer` processed positions start_pos .. start_pos+n_tokens-1 (wrote their K/V, or skipped them:
        all, or those where `skipped` [n_tokens] bool is True). Positions from start_pos on hold no marks yet (a
        forward crops the cache to its start first)."""
        end = start_pos + n_tokens
        if isinstance(skipped, torch.Tensor):
            self.skipped[layer, start_pos:end] = skipped
            self._n_skipped[layer] += int(skipped.sum())
        elif skipped:
            self.skipped[layer, start_pos:end] = True
            self._n_skipped[layer] += n_tokens
        self.layer_length[layer] = end

    @property
    def has_skips(self) -> bool:
        """Whether some layer skipped a cached position (its attention then masks it out)."""
        return any(self._n_skipped)

    def record_first(self, n_layers: int, start_pos: int, n_tokens: int) -> None:
        """Layers 0 .. n_layers-1 processed positions start_pos .. start_pos+n_tokens-1 (wrote their K/V)."""
        self.layer_length[:n_layers] = [start_pos + n_tokens] * n_layers

    def commit(self, start_pos: int, ids: Sequence[int]) -> None:
        """Every layer processed `ids` at start_pos..: they become valid positions."""
        del self.ids[start_pos:]
        self.ids.extend(ids)

    def keep_branch(self, root: int, nodes: Sequence[int], ids: Sequence[int]) -> None:
        """After a token-tree pass (`Engine.forward(parents=...)`) that wrote node i in slot root + i for every
        layer and made the root (slot root) the last valid position: keep the branch `nodes` (the root's child,
        its child, ...; node indices) with token ids `ids` as positions root + 1 .., and forget the other nodes."""
        end = self.layer_length[0]
        if (self.length != root + 1 or any(n != end for n in self.layer_length) or len(nodes) != len(ids)
                or any(not 0 < i < end - root for i in nodes)):
            raise ValueError(f"branch {list(nodes)} is not in a token tree after position {root} (cache: "
                             f"{self.length} valid positions, layers at {sorted(set(self.layer_length))})")
        new_end = root + 1 + len(nodes)
        if list(nodes) != list(range(1, len(nodes) + 1)):  # a chain's prefix is in place already
            slots = torch.tensor([root + i for i in nodes], device=self.k.device)
            # Advanced indexing reads a copy first: a source slot may be another node's destination.
            self.k[:, :, root + 1 : new_end] = self.k[:, :, slots]
            self.v[:, :, root + 1 : new_end] = self.v[:, :, slots]
            if any(self._n_skipped):
                self.skipped[:, root + 1 : new_end] = self.skipped[:, slots]
        if any(self._n_skipped):
            self.skipped[:, new_end:end] = False
            self._n_skipped = [int(n) for n in self.skipped[:, :new_end].sum(dim=1).tolist()]
        self.layer_length = [new_end] * len(self.layer_length)
        self.ids.extend(ids)

    def attention_mask(self, layer: int, causal: torch.Tensor | None, n_tokens: int, end: int) -> torch.Tensor | None:
        """The causal mask [T, L] (None: attend to all) with this layer's skipped positions masked out."""
        if not self._n_skipped[layer]:
            return causal
        present = ~self.skipped[layer, :end]  # [L]; a query's own position was just written (or it is skipped)
        if causal is None:
            return present.expand(n_tokens, end)
        return causal & present
