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
def hf_greedy(model, ids: list[int], n: int, near_tie: float) -> tuple[list[int], int]:
    """(the reference's n greedy tokens after `ids`, how many of them to compare): up to the first step whose top
    two logits are closer than `near_tie`, where float rounding may pick either token."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    want = out.sequences[0, len(ids):].tolist()
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return want, next((i for i, m in enumerate(margins) if m < near_tie), len(want))
