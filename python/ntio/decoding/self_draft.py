"""Self-speculation: the target's own first E layers draft, through an exit head calibrated offline.

The exit head of layer E maps the residual stream after layer E, h_E [D], to an estimate of the stream after the
last layer, h_L ≈ h_E·W + b (then the model's own final norm and output head make logits). W and b are fitted by
ridge regression on a calibration text: W = I + Δ with Δ shrunk towards 0 (the prior "the remaining layers change
nothing"), one fit per calibrated layer, then distilled (`distill_heads`): trained from there to give the model's
own next-token distribution, which is what a draft is judged by. `ntio calibrate` writes a calibration file; a
drafter built on it runs the first E layers per drafted token from resident weights (the target's own when those
layers are resident, else a copy read once: E layers of RAM) and writes their K/V into the target's cache, which the
verify pass then rewrites.

Calibration file (torch.save of plain tensors and numbers; loaded with weights_only=True): format, version, the
model's fingerprint (architecture, sizes, vocabulary and output norm: a file calibrated for another model is
refused), and per layer E its W [D, D] and b [D] in float32.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ntio.decoding.generation import Sampler
from ntio.decoding.speculative import Draft, sample_chain
from ntio.errors import ModelFormatError, NtioError, OptionError
from ntio.files import replacing
from ntio.kernels import ops
from ntio.models.layers import LayerWeights
from ntio.runtime.engine import Engine, Segment

FORMAT, VERSION = "ntio-exit-heads", 1
# Ridge strength relative to the mean squared norm of h_E: small, the fits are well determined by a few thousand
# tokens, but it keeps W near I where a direction is rare in the calibration text.
RIDGE = 1e-3


def fingerprint(engine: Engine, vocabulary: str) -> str:
    """What identifies a model to its exit heads: architecture, sizes, vocabulary, and its output norm's values."""
    cfg = engine.cfg
    h = hashlib.sha256(f"{cfg.architecture}/{cfg.n_layers}/{cfg.d_model}/{cfg.vocab_size}/{vocabulary}".encode())
    h.update(engine.globals.output_norm.detach().cpu().float().numpy().tobytes())
    return h.hexdigest()[:32]


@dataclass
class Calibration:
    """Exit heads of several layers of one model: layer E -> (W [D, D], b [D]); and, when `ntio calibrate` measured
    it, the adaptive-depth profile (`depth`: plain tensors and numbers that ntio.policies.depth_profile reads)."""

    model: str  # fingerprint
    heads: dict[int, tuple[torch.Tensor, torch.Tensor]]
    n_tokens: int  # calibration tokens the fits saw
    depth: dict | None = None
    # When `ntio calibrate --ffn-predictors` fitted them, the sparse FFN's predictors (plain tensors and numbers
    # that ntio.policies.sparse_ffn.load_predictors reads).
    ffn: dict | None = None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Written whole or not at all (`ntio.files.replacing`)."""
        path = Path(path)
        payload = {"format": FORMAT, "version": VERSION, "model": self.model, "n_tokens": self.n_tokens,
                   "layers": sorted(self.heads),
                   "weights": {str(e): w.contiguous() for e, (w, _) in self.heads.items()},
                   "biases": {str(e): b.contiguous() for e, (_, b) in self.heads.items()}}
        if self.depth is not None:
            payload["depth"] = self.depth
        if self.ffn is not None:
            payload["ffn"] = self.ffn
        with replacing(path) as f:
            torch.save(payload, f)

    @staticmethod
    def load(path: str | os.PathLike[str], model: str, d_model: int) -> Calibration:
        """Read a calibration file and check it is this model's (`model`: its fingerprint)."""
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise NtioError(f"{path}: no such calibration file") from None
        except Exception as e:  # noqa: BLE001 - whatever the unpickler says, it is not our format
            raise ModelFormatError(f"{path}: not an ntio calibration file ({type(e).__name__})") from None
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise ModelFormatError(f"{path}: not an ntio calibration file")
        if payload.get("version") != VERSION:
            raise ModelFormatError(f"{path}: calibration format version {payload.get('version')}, not {VERSION}")
        if payload.get("model") != model:
            raise ModelFormatError(f"{path}: calibrated for another model (run `ntio calibrate` for this one)")
        heads = {}
        for e in payload["layers"]:
            w, b = payload["weights"][str(e)], payload["biases"][str(e)]
            if tuple(w.shape) != (d_model, d_model) or tuple(b.shape) != (d_model,):
                raise ModelFormatError(f"{path}: layer {e}'s exit head is {tuple(w.shape)}, not ({d_model}, {d_model})")
            heads[int(e)] = (w.float(), b.float())
        return Calibration(model, heads, int(payload["n_tokens"]), payload.get("depth"), payload.get("ffn"))


class ExitHeadFit:
    """Normal equations of [h_E, 1] -> h_L - h_E per layer E, accumulated in float64 over windows; `heads()` solves
    them with the ridge prior W = I."""

    def __init__(self, layers: Sequence[int], d_model: int) -> None:
        d = d_model
        self.gram = {e: torch.zeros(d + 1, d + 1, dtype=torch.float64) for e in layers}
        self.cross = {e: torch.zeros(d + 1, d, dtype=torch.float64) for e in layers}

    def add(self, seen: dict[int, torch.Tensor], final: torch.Tensor) -> None:
        """seen: layer E -> h_E [T, D]; final: h_L [T, D] of the same tokens."""
        final = final.double().cpu()
        for e in self.gram:
            h = seen[e].double().cpu()
            x = torch.cat((h, torch.ones(h.shape[0], 1, dtype=torch.float64)), 1)
            self.gram[e] += x.T @ x
            self.cross[e] += x.T @ (final - h)

    def heads(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        heads = {}
        for e, gram in self.gram.items():
            d = gram.shape[0] - 1
            g = gram.clone()
            strength = RIDGE * float(g.diagonal()[:d].sum()) / d
            g.diagonal()[:d] += strength  # the bias is not shrunk
            solution = torch.linalg.solve(g, self.cross[e])  # [D + 1, D]: Δ then b
            heads[e] = ((torch.eye(d, dtype=torch.float64) + solution[:d]).float(), solution[d].float())
        return heads


# Distillation (`distill_heads`): Adam's step size, and the logits one step may hold ([tokens, V] float32, about
# five buffers of it with the gradients): 256 tokens a step for SmolLM2's 49k vocabulary, 110 for Qwen's 152k.
# In a prototype (SmolLM2's layer-27 head, 11k tokens of its own answers), one pass raised its top-1 agreement with
# the model on held-out prose from 0.67 to 0.72 and further passes did not raise it.
DISTILL_LR = 1e-4
DISTILL_LOGITS_BYTES = 64 << 20
DISTILL_MAX_TOKENS = 256


def distill_heads(engine: Engine, heads: dict[int, tuple[torch.Tensor, torch.Tensor]], seen: dict[int, torch.Tensor],
                  final: torch.Tensor, epochs: int, on_progress: Callable[[int, int], None] | None = None
                  ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The heads (layer E -> (W, b), from the ridge fit) trained further, each by Adam from where it is, to minimise
    the cross-entropy of its next-token distribution (the final norm and the output head after it) against the
    model's own, over the fit tokens in `epochs` shuffled passes. The ridge fit weighs every direction of h_L alike;
    a draft is judged by the tokens it gives. seen: layer E -> h_E [N, D] of the fit tokens; final: their h_L [N, D].
    The output head is held in float32 meanwhile ([V, D]: 0.9 GB for Qwen2.5-1.5B). on_progress(steps done, steps)."""
    with torch.inference_mode(False), torch.enable_grad():  # the engine's tensors are inference tensors: copies
        output = ops.dequantized(engine.globals.output)  # [V, D]
        device = output.device
        norm, eps = engine.globals.output_norm.to(device, torch.float32, copy=True), engine.cfg.rms_eps
        final = final.to(device, torch.float32, copy=True)
        order = torch.Generator().manual_seed(0)
        batch = max(1, min(DISTILL_MAX_TOKENS, DISTILL_LOGITS_BYTES // (4 * output.shape[0])))
        steps, done = len(heads) * epochs * math.ceil(final.shape[0] / batch), 0

        def logits(h: torch.Tensor) -> torch.Tensor:
            return ops.rms_norm(h, norm, eps) @ output.T

        distilled = {}
        for e, (w0, b0) in heads.items():
            h = seen[e].to(device, torch.float32, copy=True)
            w, b = w0.to(device, copy=True).requires_grad_(), b0.to(device, copy=True).requires_grad_()
            adam = torch.optim.Adam([w, b], lr=DISTILL_LR)
            for _ in range(epochs):
                for rows in torch.randperm(h.shape[0], generator=order).to(device).split(batch):
                    with torch.no_grad():
                        target = torch.softmax(logits(final[rows]), dim=-1)
                    loss = -(target * torch.log_softmax(logits(h[rows] @ w + b), dim=-1)).sum(-1).mean()
                    adam.zero_grad()
                    loss.backward()
                    adam.step()
                    done += 1
                    if on_progress is not None:
                        on_progress(done, steps)
            distilled[e] = (w.detach().cpu(), b.detach().cpu())
    return distilled


def check_exit_layers(layers: Sequence[int], n_layers: int) -> None:
    bad = [e for e in layers if not 0 <= e < n_layers - 1]
    if not layers or bad:
        raise OptionError("layers", f"must be layers 0..{n_layers - 2} (after which the head exits), got "
                                    f"{bad or 'none'}")


class SelfDraft:
    """Drafts with the target's first `exit_layer + 1` layers and that layer's exit head: per token, those layers
    (weights from `blocks`), the head's affine map, the final norm and the output head; greedy, or sampling with
    the target's sampler (the proposal distribution goes with the draft)."""

    name = "self"

    def __init__(self, engine: Engine, exit_layer: int, head: tuple[torch.Tensor, torch.Tensor],
                 blocks: Sequence[LayerWeights]) -> None:
        self.engine, self.exit_layer, self.blocks = engine, exit_layer, blocks
        self.w, self.b = (t.to(engine.device) for t in head)

    def propose(self, history: Sequence[int], k: int, sampler: Sampler, branches: int = 0) -> Draft | None:
        engine, device = self.engine, self.engine.device
        k = min(k, engine.kv.capacity - len(history))
        if k < 1:
            return None
        # Positions before the last history token are cached (accepted); anything after them is a rejected draft.
        engine.kv.crop(min(engine.kv.length, len(history) - 1))

        def logits_after(i: int, token: int) -> torch.Tensor:
            token_ids = torch.tensor([token], dtype=torch.int64, device=device)
            return self.batch_logits([Segment(token_ids, len(history) - 1 + i, engine.kv)])[0]

        return sample_chain(history, k, sampler, logits_after, self.name, branches)

    def batch_logits(self, segments: Sequence[Segment]) -> list[torch.Tensor]:
        """Each segment's draft logits [V] after its last token: one batched pass of the first layers over the
        segments' caches (`Engine.early_exit_batch`: a server's slots, or the engine's own cache), then the exit
        head, the final norm and the output head."""
        last = torch.cat([h[-1:] for h in self.engine.early_exit_batch(segments, self.blocks)])
        return list(self.engine.head_logits(last @ self.w + self.b))


def default_exit_layer(calibration: Calibration, n_layers: int) -> int:
    """The shallowest calibrated layer at or past the middle (cheap enough to draft, deep enough to agree), else
    the deepest calibrated one."""
    deep = [e for e in sorted(calibration.heads) if e >= math.ceil(n_layers / 2) - 1]
    return deep[0] if deep else max(calibration.heads)
