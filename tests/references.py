"""The independent oracle shared by the differential tests: Hugging Face transformers loading the same GGUF on CPU
in float32 (it dequantizes with gguf-py), and the distance the tests compare logits by."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch


def hf_model(path: Path, **config):
    """transformers' float32 model of a GGUF file (`config` overrides its config, e.g. rope_scaling)."""
    import transformers

    with _gguf_parsed_once():
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, **config
        ).eval()


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF's metadata twice per load (for the config, then for the weights) and builds gguf-py's
    tensor name map once per module, all in Python: 30 s for SmolLM2 here, most of it repeated. Within this block both
    parses get one reader (its bytes are a read-only memory map) and the name map is built once per architecture."""
    import gguf

    readers, parse, name_map = {}, gguf.GGUFReader, gguf.get_tensor_name_map

    def shared_reader(path, *args, **kwargs):
        key = str(path)
        readers[key] = readers.get(key) or parse(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = parse, name_map


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


@torch.inference_mode()
def hf_greedy(model, ids: list[int], got: list[int], near_tie: float) -> tuple[list[int], int]:
    """(the reference's greedy choice after `ids` and each prefix of `got`, how many of them to compare): the
    reference's greedy output equals the engine's tokens `got` exactly when its choice after every prefix of `got`
    is the next token of `got`, so one teacher-forced forward over ids + got stands for len(got) decode steps.
    Compared up to the first step whose top two logits are closer than `near_tie`, where float rounding may pick
    either token."""
    top2 = model(torch.tensor([ids + got[:-1]])).logits[0, len(ids) - 1 :].topk(2)
    margins = (top2.values[:, 0] - top2.values[:, 1]).tolist()
    return top2.indices[:, 0].tolist(), next((i for i, m in enumerate(margins) if m < near_tie), len(got))
