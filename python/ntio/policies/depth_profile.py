"""What `ntio calibrate` measures for adaptive depth (issue 14), and a user's budget turned into a setting.

One pass over a calibration text, split in two: the first 60% fit, the last 40% (HELD_OUT) is held out.
  * Fit: the exit heads of the probe layers (ntio.decoding.self_draft: h_L ≈ h_E·W + b, then distilled) and the
    skip predictor (ntio.policies.layer_skip), whose labels are the post-compute ones: layer l could have been
    skipped for a token when cos(h_in, h_out) > SKIP_LABEL_COS.
  * Held out: per token and probe layer, two signals of the exit head's next-token distribution (full head):
    its entropy (EMAD's) and log KL(final layer's || exit head's), how far the exit is from what the whole model
    says. Their first half fits the cheap proxies that decide at run time: a linear read of each signal from the
    exit head's normed estimate of h_L, by ridge regression. On their second half the profile keeps, per token, the
    signals, the proxies' estimates, the predictor's probabilities and the labels: targets, margins, budgets and
    the predictor's precision and recall all come from these samples, so any budget can be asked for without
    calibrating again.

The seed's proxy, entropy through a rank-r factor of the output head, is not used: on SmolLM2 (README.md, probes 6,
10, ..., 26) it correlates with the exit head's true entropy at 0.11-0.26 for r = 32, 128 and 256, the linear read
at 0.68-0.82, for D multiply-adds instead of (D + V)·r (`benches/adaptive_depth.py --proxy-ranks`, RESULTS.md
"Adaptive depth").

Bytes per token are the file's: a layer's encoded bytes when it is computed, the output head's always (the token
embedding's one row is left out). `dense_bytes` is what a token reads with every layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ntio.decoding.self_draft import Calibration, ExitHeadFit, check_exit_layers, distill_heads, fingerprint
from ntio.errors import ModelFormatError, NtioError, OptionError
from ntio.formats.store import DownNorms
from ntio.policies.base import LoadPolicy, Observation
from ntio.policies.sparse_ffn import fit_predictors, unit_recall, unit_scores

# A corpus shorter than this cannot be split into a fit and a held-out part that say anything; the held-out part
# also needs two windows (one fits the proxies, one is the profile's samples): `min_calibration_tokens`.
MIN_TOKENS = 1024
HELD_OUT = 0.4
PROXY_RIDGE = 1e-1  # relative to the mean squared feature (features are normed: ~1 each)
SIGNALS = ("kl", "entropy")  # log KL(final || exit) in nats, and the exit distribution's entropy in nats
SKIP_LABEL_COS = 0.98
# The sparse FFN's predictors (`ffn_neurons`): the most tokens per layer they are fitted on and the most held-out
# tokens their recall is measured on, spread evenly over the windows (the inputs are kept in memory until the fit:
# 4,096 tokens of Qwen2.5-Coder-1.5B's 28 layers are 350 MB); their rank; the keep shares whose recall is reported.
FFN_FIT_TOKENS = 4096
FFN_HELD_TOKENS = 1024
FFN_RANK = 128
FFN_RECALL_KEEPS = (0.3, 0.5, 0.7)


@dataclass
class DepthProfile:
    """One model's adaptive-depth calibration (a `Calibration`'s `depth` payload)."""

    layer_bytes: list[int]  # encoded bytes of each layer
    head_bytes: int
    probes: list[int]  # layers after which a token may exit (the exit heads' layers), ascending
    positions: torch.Tensor  # [N] int64: held-out tokens' positions in their windows (0 starts a window)
    signals: dict[str, torch.Tensor]  # SIGNALS -> [N, P] their values at each probe (full head)
    proxies: dict[str, torch.Tensor]  # SIGNALS -> [N, P] the proxies' estimates
    proxy_weights: dict[str, torch.Tensor]  # SIGNALS -> [P, D + 1]: signal ≈ [final_norm(exit's h_L), 1] · w_p
    skip_after: int  # the predictor reads the residual stream after this layer
    predictor: dict[str, torch.Tensor]  # ntio.policies.layer_skip.SkipPredictor's state
    skip_probs: torch.Tensor  # [N, L - skip_after - 1] held-out predicted skip probabilities of the later layers
    skip_labels: torch.Tensor  # [N, L - skip_after - 1] bool: cos(h_in, h_out) > SKIP_LABEL_COS there

    @property
    def n_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def dense_bytes(self) -> int:
        return sum(self.layer_bytes) + self.head_bytes

    def bytes_fraction(self, depths: torch.Tensor) -> float:
        """Mean bytes per token over dense bytes for tokens computing layers 0..depth-1 ([N] depths)."""
        prefix = torch.tensor([0, *self.layer_bytes], dtype=torch.float64).cumsum(0)  # [L + 1]
        return float((prefix[depths] + self.head_bytes).mean()) / self.dense_bytes

    def payload(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @staticmethod
    def from_calibration(calibration: Calibration, path: str, n_layers: int, d_model: int) -> DepthProfile:
        """The profile in a calibration file, checked against the model's shapes."""
        payload = calibration.depth
        if payload is None:
            raise NtioError(f"{path}: has exit heads but no adaptive-depth profile (calibrated by an older ntio; "
                            f"run `ntio calibrate` again)")
        try:
            profile = DepthProfile(**payload)
        except TypeError as e:
            raise ModelFormatError(f"{path}: adaptive-depth profile is malformed ({e})") from None
        n, n_probes, later = profile.positions.shape[0], len(profile.probes), n_layers - profile.skip_after - 1
        expected = {"skip_probs": (n, later), "skip_labels": (n, later)}
        for signal in SIGNALS:
            expected |= {f"{signal} signal": (n, n_probes), f"{signal} proxy": (n, n_probes),
                         f"{signal} proxy weights": (n_probes, d_model + 1)}
        found = {"skip_probs": profile.skip_probs, "skip_labels": profile.skip_labels}
        for signal in SIGNALS:
            found |= {f"{signal} signal": profile.signals.get(signal), f"{signal} proxy": profile.proxies.get(signal),
                      f"{signal} proxy weights": profile.proxy_weights.get(signal)}
        for name, shape in expected.items():
            got = None if found[name] is None else tuple(found[name].shape)
            if got != shape:
                raise ModelFormatError(f"{path}: adaptive-depth {name} is {got}, not {shape}")
        if profile.n_layers != n_layers or sorted(profile.probes) != profile.probes or \
                set(profile.probes) - set(calibration.heads):
            raise ModelFormatError(f"{path}: adaptive-depth probes {profile.probes} do not match the exit heads")
        return profile


class LayerRecorder(LoadPolicy):
    """Loads everything; keeps cos(h_in, h_out) of every layer [T], and the residual stream after `keep` layers."""

    def __init__(self, keep: Sequence[int]) -> None:
        super().__init__()
        self.keep = set(keep)
        self.cos: dict[int, torch.Tensor] = {}
        self.seen: dict[int, torch.Tensor] = {}

    def observe(self, obs: Observation) -> None:
        self.cos[obs.layer] = torch.nn.functional.cosine_similarity(obs.h_in, obs.h_out, dim=-1).cpu()
        if obs.layer in self.keep:
            self.seen[obs.layer] = obs.h_out.detach().clone()


class FFNRecorder(LayerRecorder):
    """A LayerRecorder that also keeps, for every layer, the FFN's normed input [T, D] (bfloat16) and the "down"
    rule's scores of its units of `neurons` neurons [T, G] (ntio.policies.sparse_ffn.unit_scores, each neuron
    weighed by its down column's norm, layer -> [F]: `down_norms`): what the sparse FFN's predictors are fitted
    to. Every neuron is kept."""

    def __init__(self, keep: Sequence[int], neurons: int, down_norms: Callable[[int], torch.Tensor]) -> None:
        super().__init__(keep)
        self.neurons, self.down_norms = neurons, down_norms
        self.ffn: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def ffn_mask(self, layer: int):
        def record(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            norms = self.down_norms(layer).to(up.device)
            self.ffn[layer] = x.to(torch.bfloat16).cpu(), unit_scores(gate, up, self.neurons, norms).cpu()
            return torch.ones_like(gate, dtype=torch.bool)

        return record


def proxy_features(x: torch.Tensor) -> torch.Tensor:
    """[n, D] normed estimates of h_L -> [n, D + 1] the proxy's features (a constant last)."""
    return torch.cat((x, x.new_ones(x.shape[0], 1)), dim=1)


def exit_signals(engine, exits: dict[int, torch.Tensor], final: torch.Tensor, rows: int = 64
                 ) -> dict[str, torch.Tensor]:
    """exits: probe -> the exit head's estimates of h_L [T, D]; final: h_L itself [T, D] -> SIGNALS -> [T, P]:
    entropy of each exit's next-token distribution and log KL(final's || exit's), `rows` positions at a time."""
    out: dict[str, list[torch.Tensor]] = {"entropy": [], "kl": []}
    for i in range(0, final.shape[0], rows):
        logp_final = torch.log_softmax(engine.head_logits(final[i : i + rows]), dim=-1)  # [r, V]
        ent, kl = [], []
        for x in exits.values():
            logp = torch.log_softmax(engine.head_logits(x[i : i + rows]), dim=-1)
            ent.append(-(logp.exp() * logp).sum(dim=-1))
            kl.append((logp_final.exp() * (logp_final - logp)).sum(dim=-1).clamp_min(1e-8).log())
        out["entropy"].append(torch.stack(ent, dim=1))
        out["kl"].append(torch.stack(kl, dim=1))
    return {s: torch.cat(v) for s, v in out.items()}


def fit_proxy(features: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Ridge regression of a signal y [n] on proxy features [n, D + 1] -> weights [D + 1]."""
    f = features.double()
    gram = f.T @ f
    gram.diagonal()[:-1] += PROXY_RIDGE * f.shape[0]
    return torch.linalg.solve(gram, f.T @ y.double()).float()


def min_calibration_tokens(ctx: int) -> int:
    """The fewest tokens whose held-out part spans two windows of ctx tokens (the second of at least 2)."""
    n = max(MIN_TOKENS, math.ceil((ctx + 2) / HELD_OUT))
    while int(n * HELD_OUT) < ctx + 2:  # float rounding
        n += 1
    return n


def check_calibration(llm, n_tokens: int, ctx: int) -> int:
    """Whether `llm` can calibrate on n_tokens tokens in windows of ctx (an error if not, before any work); returns
    the window length, at most the context."""
    if llm.engine.globals.output is None:
        raise NtioError("calibration needs the output head resident (raise --ram-budget)")
    ctx = min(ctx, llm.engine.kv.capacity)
    minimum = min_calibration_tokens(ctx)
    if n_tokens < minimum:
        raise OptionError("tokens", f"must be at least {minimum} to calibrate in windows of {ctx} (the held-out "
                                    f"{HELD_OUT:.0%} spans two windows), got {n_tokens}")
    return ctx


def calibrate_depth(llm, text: str, probes: Sequence[int], n_tokens: int = 16384, ctx: int = 512,
                    skip_after: int | None = None, on_progress: Callable[[int, int], None] | None = None,
                    source: str = "the calibration text", distill_epochs: int = 0,
                    ffn_neurons: int | None = None) -> Calibration:
    """Exit heads for `probes` and the adaptive-depth profile, from up to n_tokens tokens of `text` in windows of
    ctx tokens (see the module's doc). skip_after: the layer the skip predictor reads (default: a quarter deep);
    source: what names the text in errors (its file); distill_epochs: passes of `distill_heads` over the fit tokens
    after the ridge fit (0: the ridge fit alone); ffn_neurons: also fit the sparse FFN's predictors of every layer
    (`UnitPredictor`, units of ffn_neurons neurons) on the fit tokens, their recall of the "down" rule's units
    measured on the held-out ones (the calibration's `ffn`)."""
    from ntio.policies.layer_skip import SkipPredictor

    cfg, engine = llm.config, llm.engine
    probes = sorted(set(probes))
    check_exit_layers(probes, cfg.n_layers)
    skip_after = cfg.n_layers // 4 - 1 if skip_after is None else skip_after
    if not 0 <= skip_after < cfg.n_layers - 1:
        raise OptionError("skip_after", f"must be a layer in 0..{cfg.n_layers - 2}, got {skip_after}")
    ctx = check_calibration(llm, n_tokens, ctx)
    minimum = min_calibration_tokens(ctx)
    ids = llm.tokenizer.encode(text)
    if len(ids) < minimum:
        raise NtioError(f"{source} has {len(ids)} tokens; calibrating in windows of {ctx} needs at least {minimum} "
                        f"(a few thousand fit well)")
    ids = ids[:n_tokens]
    n_fit = len(ids) - max(int(len(ids) * HELD_OUT), 1)
    windows = [(a, min(a + ctx, n_fit)) for a in range(0, n_fit, ctx)]
    windows += [(a, min(a + ctx, len(ids))) for a in range(n_fit, len(ids), ctx)]
    windows = [(a, b) for a, b in windows if b - a >= 2]
    kept_layers = [*probes, skip_after, cfg.n_layers - 1]
    recorder = (LayerRecorder(kept_layers) if ffn_neurons is None
                else FFNRecorder(kept_layers, ffn_neurons, DownNorms(llm.file)))
    n_held = len(ids) - n_fit
    ffn_fit: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    ffn_held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    sampler = torch.Generator().manual_seed(0)
    later = range(skip_after + 1, cfg.n_layers)
    heads_fit = ExitHeadFit(probes, cfg.d_model)
    fit_x, fit_y, held = [], [], []
    fit_seen: dict[int, list[torch.Tensor]] = {p: [] for p in probes}  # the fit tokens' h_E and h_L, to distill
    fit_final: list[torch.Tensor] = []
    policy, llm.loader.policy = llm.loader.policy, recorder

    def labels() -> torch.Tensor:
        return torch.stack([recorder.cos[l] > SKIP_LABEL_COS for l in later], dim=1)  # [T, later]

    try:
        for n, (a, b) in enumerate(windows, 1):
            engine.forward(torch.tensor(ids[a:b], dtype=torch.int64, device=llm.device), 0)
            if ffn_neurons is not None:
                share = FFN_FIT_TOKENS / n_fit if a < n_fit else FFN_HELD_TOKENS / n_held
                rows = torch.randperm(b - a, generator=sampler)[: math.ceil(share * (b - a))]
                for layer, (x, score) in recorder.ffn.items():
                    (ffn_fit if a < n_fit else ffn_held).setdefault(layer, []).append((x[rows], score[rows]))
            if a < n_fit:
                heads_fit.add(recorder.seen, recorder.seen[cfg.n_layers - 1])
                if distill_epochs:
                    for p in probes:
                        fit_seen[p].append(recorder.seen[p].cpu())
                    fit_final.append(recorder.seen[cfg.n_layers - 1].cpu())
                fit_x.append(recorder.seen[skip_after].cpu())
                fit_y.append(labels())
            else:
                held.append(({p: recorder.seen[p].cpu() for p in probes}, recorder.seen[skip_after].cpu(),
                             labels(), torch.arange(b - a), recorder.seen[cfg.n_layers - 1].cpu()))
            if on_progress is not None:
                on_progress(n, len(windows) + 1)
    finally:
        llm.loader.policy = policy
        engine.kv.crop(0)
    heads = heads_fit.heads()
    total = len(windows) + 1  # progress: the windows, the heads' distillation, the profile

    def distilling(done: int, steps: int) -> None:
        nonlocal total
        total = len(windows) + steps + 1
        if on_progress is not None:
            on_progress(len(windows) + done, total)

    if distill_epochs:
        heads = distill_heads(engine, heads, {p: torch.cat(v) for p, v in fit_seen.items()}, torch.cat(fit_final),
                              distill_epochs, on_progress=distilling)
    predictor = SkipPredictor.fit(torch.cat(fit_x), torch.cat(fit_y).float())
    exits = [{p: seen[p] @ heads[p][0] + heads[p][1] for p in probes} for seen, *_ in held]  # estimates of h_L
    values = [exit_signals(engine, x, final) for x, (*_, final) in zip(exits, held)]  # per window: signal -> [T, P]
    if on_progress is not None:
        on_progress(total, total)
    half = len(held) // 2  # windows (at least 2): the first fit the proxies, the others are the profile's samples
    features = [{p: proxy_features(engine.final_norm(x[p])) for p in probes} for x in exits]  # [T, D + 1] each
    weights = {s: torch.stack([fit_proxy(torch.cat([f[p] for f in features[:half]]),
                                         torch.cat([v[s][:, j] for v in values[:half]]))
                               for j, p in enumerate(probes)]) for s in SIGNALS}  # [P, D + 1]
    kept = slice(half, None)
    layout = llm.loader.layout
    depth = DepthProfile(
        layer_bytes=[layout.block_nbytes(i) for i in range(cfg.n_layers)], head_bytes=layout.head.nbytes,
        probes=probes, positions=torch.cat([h[3] for h in held[kept]]),
        signals={s: torch.cat([v[s] for v in values[kept]]) for s in SIGNALS},
        proxies={s: torch.cat([torch.stack([f[p] @ weights[s][j] for j, p in enumerate(probes)], dim=1)
                               for f in features[kept]]) for s in SIGNALS},
        proxy_weights=weights, skip_after=skip_after, predictor=predictor.state(),
        skip_probs=torch.cat([predictor(h[1]) for h in held[kept]]),
        skip_labels=torch.cat([h[2] for h in held[kept]]))
    ffn = None if ffn_neurons is None else fit_ffn_predictors(ffn_fit, ffn_held, ffn_neurons)
    return Calibration(fingerprint(engine, llm.tokenizer.vocabulary), heads, len(ids), depth.payload(), ffn)


def fit_ffn_predictors(fit: dict[int, list[tuple[torch.Tensor, torch.Tensor]]],
                       held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], neurons: int) -> dict:
    """The sparse FFN's predictors, one per layer, fitted on `fit` (layer -> per window: the FFN's normed inputs
    [t, D] and the "down" rule's unit scores [t, G], the same tokens in every layer), and their recall of the "down"
    rule's units at each of FFN_RECALL_KEEPS, averaged over layers, on `held` -> a calibration's `ffn` payload.
    Layer l's predictor reads layer l - 1's FFN input (the first layer's, its own): its groups are known while
    layer l - 1 computes, so their reads go on meanwhile (ntio.policies.sparse_ffn)."""
    def joined(windows: dict) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        return ({layer: torch.cat([x for x, _ in parts]).float() for layer, parts in windows.items()},
                {layer: torch.cat([score for _, score in parts]) for layer, parts in windows.items()})

    predictors = fit_predictors(*joined(fit), neurons, FFN_RANK)
    inputs, scores = joined(held)
    recall = {keep: [] for keep in FFN_RECALL_KEEPS}
    for layer, predictor in predictors.items():
        predicted = predictor(inputs[max(layer - 1, 0)])
        for keep in FFN_RECALL_KEEPS:
            recall[keep].append(unit_recall(predicted, scores[layer], keep))
    return {"neurons": neurons, "rank": FFN_RANK, "layers": {str(layer): p.state() for layer, p in predictors.items()},
            "recall": {str(keep): sum(v) / len(v) for keep, v in recall.items()}}


def bisect(fraction: Callable[[float], float], budget: float, *, rising: bool, what: str) -> float:
    """The knob k in [0, 1] whose bytes fraction(k) is the largest not above `budget` (fraction non-increasing in
    k when not `rising`: the smallest such k; non-decreasing when `rising`: the largest). A budget below every
    reachable fraction is a one-line error with the smallest reachable one."""
    if not 0.0 < budget <= 1.0:
        raise OptionError("budget", f"must be a fraction of the dense bytes per token in (0, 1], got {budget}")
    lo, hi = 0.0, 1.0
    reachable = fraction(lo if rising else hi)
    if reachable > budget:
        raise OptionError("budget", f"{budget:g} cannot be met by {what}: it reads at least "
                                    f"{math.ceil(reachable * 1000) / 1000:g} of the dense bytes per token")
    for _ in range(30):
        mid = (lo + hi) / 2
        if (fraction(mid) <= budget) == rising:
            lo = mid
        else:
            hi = mid
    return lo if rising else hi
