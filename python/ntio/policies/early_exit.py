"""Early exit (issue 14): a token leaves the model at a probe layer when a cheap estimate of a signal there is below
that layer's target; the layers past its exit are not read. Signals (ntio.policies.depth_profile):
  * "entropy": EMAD (seed 004, entropy-matched adaptive depth), the entropy of the exit head's distribution;
  * "kl": log KL(final layer's || exit head's distribution), how far the exit is from what the whole model says,
    one target for every probe. With every K/V computed it would cost far less perplexity than entropy at the same
    bytes (SmolLM2: x1.08 against x1.26 at 0.95-0.97 of the bytes): low entropy does not mean the deeper layers
    agree. But its exits are shallower, and the K/V holes they leave cost more (x2.6 per token): see
    benches/RESULTS.md, "Adaptive depth".

Per token t, its depth D_t (layers computed) is one of the levels: a probe layer p's exit (D = p + 1, read out
through p's exit head, ntio.decoding.self_draft) or the full depth L.
  * Proxy: a linear read of the signal from the final norm of the exit head's map of h_p
    (ntio.policies.depth_profile). A token exits at p when proxy ≤ τ_p − m_p.
  * Targets, entropy: τ_p is the q-quantile of the exit head's true entropy at p over the held-out calibration
    tokens, made non-increasing in p (isotonic regression); margins m_p = α·MAD(proxy − entropy) at p. KL: one
    target, the q-quantile of the proxy's estimates over every held-out token and probe, no margin (the budget
    sets it). q comes from a bytes budget by bisection, simulating this module's schedule on the held-out tokens
    (`ExitSetting.for_budget`).
  * Schedule (KV-consistent): D_t ≤ D_{t-1}, so every K/V a token attends to at a layer it computes exists; the
    first token of a sequence has D = L. Floors: a token may exit only at a level ≥ F_t, F_t falling linearly from
    L to `floor` over the first `floor_tokens` positions. Windowed refresh: every `refresh_every` positions the cap
    rises by `refresh_levels` levels; a token then computes layers its predecessors skipped, and attends there only
    to the positions that have K/V (the cache masks the others: no backfill). refresh_every = 1 with
    refresh_levels = len(levels) frees every token from its predecessor (per-token exits).

A pass over T tokens computes each as decoding it alone would: at each layer only the tokens still running, the
others passing through with no K/V written. Generation's prefill computes every layer (`prompt_full_depth`).
Streamed layers more than one past a probe that may still stop a token are read only once it has decided
(`holds`): reads ahead of an exit would come off the disk all the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ntio.policies.base import LOAD_ALL, SKIP, LoadDecision, LoadPolicy, Observation
from ntio.policies.depth_profile import DepthProfile, bisect, proxy_features

MARGIN_ALPHA = 1.5  # the seed's default


@dataclass(frozen=True)
class ExitSchedule:
    levels: tuple[int, ...]  # allowed depths, ascending: each probe + 1, then L
    floor: int  # the lowest depth a token may exit at once the floors have tapered
    floor_tokens: int = 0  # positions over which the floor falls from L to `floor` (0: `floor` from the start)
    refresh_every: int = 0  # W (0: never)
    refresh_levels: int = 1  # R

    @staticmethod
    def for_profile(profile: DepthProfile, floor: int | None = None, floor_tokens: int = 0, refresh_every: int = 0,
                    refresh_levels: int = 1) -> ExitSchedule:
        """floor: default the shallowest exit."""
        levels = tuple(p + 1 for p in profile.probes) + (profile.n_layers,)
        return ExitSchedule(levels, levels[0] if floor is None else floor, floor_tokens, refresh_every,
                            refresh_levels)

    def floor_at(self, pos: int) -> int:
        top = self.levels[-1]
        if pos >= self.floor_tokens:
            return self.floor
        return max(self.floor, math.ceil(top - (top - self.floor) * pos / self.floor_tokens))

    def cap(self, prev: int, pos: int) -> int:
        """The deepest level a token at `pos` may compute after a token of depth `prev`."""
        if self.refresh_every and pos % self.refresh_every == 0:
            return self.levels[min(self.levels.index(prev) + self.refresh_levels, len(self.levels) - 1)]
        return prev


def stop_depths(exits: Sequence[Sequence[bool]], positions: Sequence[int], prev: int, schedule: ExitSchedule
                ) -> list[int]:
    """Each token's depth under the schedule. exits[t][j]: token t's proxy is under probe j's target; prev: the
    depth of the token before the first (L at a sequence's start). A token stops at the first level that is its
    cap, or an exit at or above its floor."""
    depths = []
    for t, pos in enumerate(positions):
        cap, floor = schedule.cap(prev, pos), schedule.floor_at(pos)
        depth = cap
        for j, level in enumerate(schedule.levels[:-1]):
            if level >= cap:
                break
            if level >= floor and exits[t][j]:
                depth = level
                break
        depths.append(depth)
        prev = depth
    return depths


def isotonic_non_increasing(y: Sequence[float]) -> list[float]:
    """The least-squares non-increasing fit of y (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight]
    for v in y:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return [m for m, w in blocks for _ in range(int(w))]


@dataclass(frozen=True)
class ExitSetting:
    schedule: ExitSchedule
    signal: str  # one of depth_profile.SIGNALS
    quantile: float
    targets: tuple[float, ...]  # τ_p − m_p per probe: exit when the proxy is at most this

    @staticmethod
    def at_quantile(profile: DepthProfile, schedule: ExitSchedule, signal: str, q: float,
                    alpha: float = MARGIN_ALPHA) -> ExitSetting:
        proxy = profile.proxies[signal]  # [N, P]
        if signal == "kl":
            return ExitSetting(schedule, signal, q, (float(torch.quantile(proxy.flatten(), q)),) * proxy.shape[1])
        values = profile.signals[signal]
        tau = isotonic_non_increasing(torch.quantile(values, q, dim=0).tolist())
        error = proxy - values
        margin = alpha * (error - error.median(dim=0).values).abs().median(dim=0).values
        return ExitSetting(schedule, signal, q, tuple(t - float(m) for t, m in zip(tau, margin)))

    @staticmethod
    def for_budget(profile: DepthProfile, schedule: ExitSchedule, signal: str, budget: float) -> ExitSetting:
        """The most conservative quantile whose exits on the held-out tokens read at most `budget` of the dense
        bytes per token."""
        q = bisect(lambda q: ExitSetting.at_quantile(profile, schedule, signal, q).held_out_fraction(profile),
                   budget, rising=False, what="early exit with these floors")
        return ExitSetting.at_quantile(profile, schedule, signal, q)

    def held_out_depths(self, profile: DepthProfile) -> torch.Tensor:
        """[N] depths the schedule gives the held-out tokens (each window a sequence)."""
        exits = (profile.proxies[self.signal] <= torch.tensor(self.targets)).tolist()
        positions = profile.positions.tolist()
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        depths: list[int] = []
        for a, b in zip(starts, starts[1:]):
            depths += stop_depths(exits[a:b], positions[a:b], self.schedule.levels[-1], self.schedule)
        return torch.tensor(depths)

    def held_out_fraction(self, profile: DepthProfile) -> float:
        return profile.bytes_fraction(self.held_out_depths(profile))


@dataclass
class EarlyExitPolicy(LoadPolicy):
    """EMAD over an engine (see the module's doc). heads: probe layer -> its exit head (W [D, D], b [D]);
    final_norm: the engine's (`Engine.final_norm`)."""

    profile: DepthProfile
    setting: ExitSetting
    heads: dict[int, tuple[torch.Tensor, torch.Tensor]]
    final_norm: object
    prompt_full_depth: bool = True
    depths: list[int] = field(default_factory=list, init=False)  # every decided token's depth, in order
    _prev: int = field(default=0, init=False)  # the depth of the last token decided
    _decided: int = field(default=0, init=False)  # tokens decided since the sequence (or its prompt) ran whole
    _positions: list[int] = field(default_factory=list, init=False)  # the current pass's, counted as _decided
    _exits: list[list[bool]] = field(default_factory=list, init=False)  # [T][P] of the current pass
    _stopped: list[int] = field(default_factory=list, init=False)  # [T] depth, or L while running
    _running: torch.Tensor | None = field(default=None, init=False)  # [T] bool
    _reach: int = field(default=0, init=False)  # no token of the current pass computes a layer from here on
    _last_layer: int = field(default=-1, init=False)
    _full: bool = field(default=False, init=False)  # the current forward is a prompt's: it computes every layer
    _device: torch.device = field(default=torch.device("cpu"), init=False)
    _device_copies: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self._top = self.profile.n_layers
        self._prev = self._top
        self._probe_index = {p: j for j, p in enumerate(self.profile.probes)}

    def begin_forward(self, start_pos: int, n_tokens: int) -> None:
        # A forward over several tokens is a prompt's, all of whose chunks compute whole (a last chunk of 1 too).
        self._full = self.prompt_full_depth and n_tokens > 1

    def begin_pass(self, start_pos: int, n_tokens: int) -> None:
        if start_pos == 0 or self._full:
            self._prev, self._decided = self._top, 0  # a new sequence, or a prompt computed whole
        self._positions = list(range(self._decided, self._decided + n_tokens))
        self._exits = [[False] * len(self.profile.probes) for _ in self._positions]
        self._last_layer = -1
        self._running = None
        self._update()

    def _update(self) -> None:
        """Depths under the exits known so far: tokens whose depth is at most the next layer have stopped."""
        if self._full:
            self._stopped, self._reach = [self._top] * len(self._positions), self._top
            return
        self._stopped = stop_depths(self._exits, self._positions, self._prev, self.setting.schedule)
        self._reach = max(self._stopped)
        running = torch.tensor([d > self._last_layer + 1 for d in self._stopped])
        self._running = None if bool(running.all()) else running

    def decide(self, layer: int, ahead: int) -> LoadDecision:
        # A layer of the next pass (read ahead) loads: that pass may start a new sequence or a prompt.
        return SKIP if layer > self._last_layer and layer >= self._reach else LOAD_ALL

    def still_wanted(self, layer: int, decision: LoadDecision) -> bool:
        return layer < self._reach

    def holds(self, layer: int) -> bool:
        """Reads more than one layer past a probe that may still stop a token wait for it: the layer right after
        is read on the chance it is needed (waiting for it would stall every step at every probe)."""
        if self._full or layer <= self._last_layer:
            return False  # a prompt's pass, or the next pass
        return any(self._last_layer < p and p + 1 < layer and p + 1 < self._reach for p in self.profile.probes)

    def tokens(self, layer: int) -> torch.Tensor | None:
        return None if self._running is None else self._running.to(self._device)

    def observe(self, obs: Observation) -> None:
        self._last_layer = obs.layer
        self._device = obs.h_out.device
        j = self._probe_index.get(obs.layer)
        if j is not None and not self._full:
            running = [t for t, d in enumerate(self._stopped) if d > obs.layer]
            w, b, proxy = self._on_device(obs.layer)
            x = proxy_features(self.final_norm(obs.h_out[running] @ w + b))  # [n, D + 1]
            estimate = x @ proxy  # [n] entropies
            for t, below in zip(running, (estimate <= self.setting.targets[j]).tolist()):
                self._exits[t][j] = below
            self._update()  # the running set changes only after a probe
        if obs.layer == self._top - 1:  # the pass is over: its tokens' depths are final
            if self._full:
                self._decided = 0  # floors and refreshes count from the first token decided after a prompt
            else:
                self.depths += self._stopped
                self._prev = self._stopped[-1]
                self._decided += len(self._positions)

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """Tokens that exited at probe p read out through p's exit head."""
        if self._full:
            return h
        out = h
        for p in self.heads:
            rows = [t for t, d in enumerate(self._stopped) if d == p + 1]
            if rows:
                w, b, _ = self._on_device(p)
                idx = torch.tensor(rows, device=h.device)
                out = out.index_copy(0, idx, h[idx] @ w + b)
        return out

    def _on_device(self, probe: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Probe layer -> its exit head's W [D, D], b [D] and proxy weights [D + 1], on the compute device (copied
        once)."""
        cached = self._device_copies.get(probe)
        if cached is None or cached[0].device != self._device:
            w, b = self.heads[probe]
            proxy = self.profile.proxy_weights[self.setting.signal][self._probe_index[probe]]
            cached = self._device_copies[probe] = tuple(t.to(self._device) for t in (w, b, proxy))
        return cached

    def bytes_fraction(self) -> float:
        """Mean bytes per decided token over the dense bytes (what decoding each alone reads)."""
        return self.profile.bytes_fraction(torch.tensor(self.depths)) if self.depths else 1.0
