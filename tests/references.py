"""The independent oracle shared by the differential tests: Hugging Face transformers loading the same GGUF on CPU
in float32 (it dequantizes with gguf-py), and the distance the tests compare logits by."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_model(path: Path, **config):
    """transformers' float32 model of a GGUF file (`config` overrides its config, e.g. rope_scaling)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **config
    ).eval()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@torch.inference_mode()
def hf_perplexity(model, ids: list[int], ctx: int) -> tuple[float, int]:
    """(perplexity, tokens scored) under ntio's convention, with the reference's logits on the given token ids:
    non-overlapping windows of `ctx` tokens, every token of a window scored but its first."""
    nll, count = 0.0, 0
    for start in range(0, len(ids), ctx):
        window = ids[start : start + ctx]
        if len(window) < 2:
            break
        logits = model(torch.tensor([window])).logits[0]
        nll += float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(window[1:]), reduction="sum"))
        count += len(window) - 1
    return float(torch.tensor(nll / count).exp()), count
