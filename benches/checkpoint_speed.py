"""Hugging Face checkpoints read in place (issue 18): what it costs against the reader's raw bandwidth and against
the same weights converted to a store.

The checkpoint is written once, into the ntio cache, from a model ntio fetches: transformers reads the GGUF and
`save_pretrained` writes it in --dtype (bfloat16 or float16; tests/test_checkpoint.py's `save_checkpoint`). The
store is `ntio convert DIR` of it (same types). Rounds of reads, then rounds of decode, each in alternating
order; medians over rounds:

1. Reads, no compute: every layer read cold (O_DIRECT) through the loader's plan (`plan_layer_read`: a layer's
   tensor ranges widened to whole 4 KiB blocks), two layers in flight, into staging slots; against the reader's raw
   sequential bandwidth over the same file from its start (`stream_bound.disk_gb_s`, as many bytes), the mean of
   one run just before and one just after (this VM's disk changes speed from one minute to the next, and runs
   faster for a while after being idle). Ratio: checkpoint layers / raw. Target >= 0.9.
2. Resident decode (`--tiers A`, greedy, float32 activations as a float checkpoint's matrices take): tok/s from the
   directory and from the store. Ratio: checkpoint / store. Target >= 0.95.

    python benches/checkpoint_speed.py --model qwen2.5-coder-1.5b --dtype bfloat16 --rounds 3
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

from ntio.fetch import cache_dir, resolve_model
from ntio.formats.model_file import extent_index, open_model_file, plan_layer_read
from ntio.formats.store import convert
from stream_bound import decode_tok_s, disk_gb_s, layer_span, read_batches

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_checkpoint import save_checkpoint  # noqa: E402  (the tests' writer: one way to make a checkpoint)


def make_checkpoint(name: str, dtype: str) -> tuple[Path, Path]:
    """(checkpoint directory, its store), written on first use."""
    import transformers

    gguf_path = resolve_model(name)
    directory = cache_dir() / "checkpoints" / f"{gguf_path.stem}-{dtype}"
    if not (directory / "model.safetensors").is_file():
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                                  dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        save_checkpoint(model, tokenizer, directory, dtype=getattr(torch, dtype))
    store = directory.with_name(directory.name + ".ntio")
    if not store.is_file():
        convert(directory, store)
    return directory, store


def layer_reads_gb_s(model: Path) -> tuple[float, int]:
    """Every layer of `model` read through the loader's plan, two in flight: (GB/s, bytes read)."""
    f = open_model_file(model)
    plans = [plan_layer_read(f, layer) for layer in range(extent_index(f).n_layers)]
    nbytes = sum(length for extents, _ in plans for _, length, _ in extents)
    seconds = read_batches(f.files, [extents for extents, _ in plans], max(size for _, size in plans))
    return nbytes / seconds / 1e9, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="a model ntio fetches by name, or a GGUF path")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16, help="decode steps per resident run")
    args = p.parse_args()

    directory, store = make_checkpoint(args.model, args.dtype)
    # Reads first, in every round, then decode: a resident load maps the files, and O_DIRECT reads of a file whose
    # pages sit in the page cache measured slower here.
    rounds: list[dict] = [{} for _ in range(args.rounds)]
    for r, row in enumerate(rounds):
        for which in ("checkpoint", "store") if r % 2 == 0 else ("store", "checkpoint"):
            model = directory if which == "checkpoint" else store
            path = open_model_file(model).path
            whole = (0, path.stat().st_size // 4096 * 4096)
            nbytes = layer_span(model)[1]
            before = disk_gb_s(path, whole, nbytes)
            row[f"{which}_layers_gb_s"], _ = layer_reads_gb_s(model)
            row[f"raw_beside_{which}_gb_s"] = (before + disk_gb_s(path, whole, nbytes)) / 2
        row["read_ratio"] = row["checkpoint_layers_gb_s"] / row["raw_beside_checkpoint_gb_s"]
        print(json.dumps({"round": r, **row}), file=sys.stderr)
    for r, row in enumerate(rounds):
        for which in ("checkpoint", "store") if r % 2 == 0 else ("store", "checkpoint"):
            row[f"{which}_resident_tok_s"] = decode_tok_s(directory if which == "checkpoint" else store, "A",
                                                          args.tokens, cpu_activations="float32")[0]
        row["decode_ratio"] = row["checkpoint_resident_tok_s"] / row["store_resident_tok_s"]
        print(json.dumps({"round": r, **row}), file=sys.stderr)
    medians = {key: statistics.median(row[key] for row in rounds) for key in rounds[0]}
    print(json.dumps({"machine": platform.processor() or platform.machine(), "model": args.model,
                      "checkpoint": str(directory), "dtype": args.dtype,
                      "rounds": rounds, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
