"""`ntio` command line: generate, chat, perplexity, info, convert, fetch.

User errors (`NtioError`) print one line on stderr and exit 1; click's usage errors exit 2; Ctrl-C exits 130.
`--json` prints exactly one JSON object on stdout and nothing else there.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import click

from ntio.errors import NtioError

MODEL_HELP = "GGUF model file (default: SmolLM2-135M-Instruct Q4_1, fetched on first use)"


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except NtioError as e:
            click.echo(f"ntio: error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("\nntio: interrupted", err=True)
            sys.exit(130)


def _model_options(f):
    f = click.option("--threads", type=click.IntRange(min=1), help="CPU threads for compute (default: torch's)")(f)
    f = click.option("--kv-dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32",
                     show_default=True, help="KV cache dtype")(f)
    f = click.option("--ctx-size", type=click.IntRange(min=1), help="KV cache capacity in tokens (default: the model's context length)")(f)
    f = click.option("-m", "--model", type=click.Path(dir_okay=False, path_type=Path), help=MODEL_HELP)(f)
    return f


def _load(model, ctx_size, kv_dtype, threads):
    import torch

    from ntio.api import load

    if threads:
        torch.set_num_threads(threads)
    return load(model, kv_dtype=kv_dtype, max_context=ctx_size)


def _sampling_options(f):
    f = click.option("--stop", multiple=True, help="Stop when this text is generated (repeatable)")(f)
    f = click.option("--seed", type=int, help="Random seed for sampling")(f)
    f = click.option("--repetition-penalty", type=float, default=1.0, show_default=True)(f)
    f = click.option("--top-p", type=float, default=1.0, show_default=True)(f)
    f = click.option("--top-k", type=int, default=0, show_default=True, help="0 disables")(f)
    f = click.option("--temperature", "-t", type=float, default=0.0, show_default=True, help="0 is greedy")(f)
    return f


@click.group(cls=_Group)
@click.version_option(package_name="ntio")
def main() -> None:
    """ntio: run LLMs bigger than memory by streaming transformer layers from disk."""


@main.command()
@_model_options
@click.option("-p", "--prompt", required=True, help="Prompt text")
@click.option("-n", "--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template")
@click.option("--system", help="System message (with --chat)")
@_sampling_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text")
def generate(model, ctx_size, kv_dtype, threads, prompt, max_new_tokens, chat, system, temperature, top_k, top_p,
             repetition_penalty, seed, stop, as_json) -> None:
    """Generate a continuation of PROMPT."""
    m = _load(model, ctx_size, kv_dtype, threads)
    stream = m.stream(prompt, max_new_tokens, chat=chat, system=system, temperature=temperature, top_k=top_k,
                      top_p=top_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop)
    for piece in stream:
        if not as_json:
            click.echo(piece, nl=False)
    c = stream.completion
    if as_json:
        click.echo(json.dumps({
            "model": str(m.path), "text": c.text, "token_ids": c.token_ids, "n_prompt_tokens": c.n_prompt_tokens,
            "n_generated_tokens": c.n_generated_tokens, "prefill_tok_s": round(c.prefill_tok_s, 3),
            "decode_tok_s": round(c.decode_tok_s, 3), "finish_reason": c.finish_reason,
        }))
    else:
        click.echo()
        click.echo(f"[{c.n_prompt_tokens} prompt tokens at {c.prefill_tok_s:.1f} tok/s, {c.n_generated_tokens} "
                   f"generated at {c.decode_tok_s:.1f} tok/s, {c.finish_reason}]", err=True)


@main.command()
@_model_options
@click.option("--system", help="System message")
@click.option("-n", "--max-new-tokens", type=click.IntRange(min=1), default=512, show_default=True)
@_sampling_options
def chat(model, ctx_size, kv_dtype, threads, system, max_new_tokens, temperature, top_k, top_p, repetition_penalty,
         seed, stop) -> None:
    """Chat interactively; replies stream as they are generated. /reset clears the history, /exit quits."""
    m = _load(model, ctx_size, kv_dtype, threads)
    messages = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            click.echo(click.style("> ", bold=True), nl=False)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return
        user = line.rstrip("\n")
        if user.strip() == "/reset":
            messages = messages[:1] if system else []
            continue
        if not user.strip():
            continue
        messages.append({"role": "user", "content": user})
        stream = m.stream(m.encode_messages(messages), max_new_tokens, temperature=temperature, top_k=top_k,
                          top_p=top_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop)
        for piece in stream:
            click.echo(piece, nl=False)
        click.echo()
        messages.append({"role": "assistant", "content": stream.completion.text})


@main.command()
@_model_options
@click.option("-f", "--file", "text_file", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Text file to score")
@click.option("--ctx", type=click.IntRange(min=2), default=512, show_default=True, help="Window length in tokens")
@click.option("--json", "as_json", is_flag=True)
def perplexity(model, ctx_size, kv_dtype, threads, text_file, ctx, as_json) -> None:
    """Perplexity of FILE: non-overlapping windows of --ctx tokens, each token scored but a window's first."""
    try:
        text = text_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise NtioError(f"{text_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    m = _load(model, ctx_size or ctx, kv_dtype, threads)
    r = m.perplexity(text, ctx=ctx)
    if as_json:
        click.echo(json.dumps({"model": str(m.path), "file": str(text_file), "perplexity": r.perplexity,
                               "n_tokens": r.n_tokens, "ctx": r.ctx}))
    else:
        click.echo(f"perplexity {r.perplexity:.4f} over {r.n_tokens} scored tokens (windows of {r.ctx})")


@main.command()
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def info(model, as_json) -> None:
    """Architecture, tensors, types and bytes per layer of MODEL."""
    from ntio.config import ModelConfig
    from ntio.model_file import open_model_file
    from ntio.weights import WeightLayout

    g = open_model_file(model)
    cfg = ModelConfig.from_gguf(g)
    layout = WeightLayout(g, cfg)
    layer_bytes = [layout.block_nbytes(i) for i in range(cfg.n_layers)]
    types = Counter(t.qtype.name for t in g.tensors.values())
    summary = {
        "file": str(g.path), "gguf_version": g.version, "architecture": cfg.architecture,
        "name": g.metadata.get("general.name"), "n_layers": cfg.n_layers, "d_model": cfg.d_model, "d_ff": cfg.d_ff,
        "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "vocab_size": cfg.vocab_size,
        "context_length": cfg.context_length, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling.kind,
        "tied_embeddings": cfg.tied_embeddings, "tokenizer": g.metadata.get("tokenizer.ggml.model"),
        "n_tensors": len(g.tensors), "tensor_types": dict(types.most_common()),
        "bytes_per_layer": layer_bytes, "layer_bytes_total": sum(layer_bytes),
        "tensor_bytes_total": sum(t.nbytes for t in g.tensors.values()),
    }
    if as_json:
        click.echo(json.dumps(summary))
        return
    for key, value in summary.items():
        if key == "bytes_per_layer":
            uniq = sorted(set(value))
            value = f"{uniq[0]:,}" if len(uniq) == 1 else f"{min(value):,} .. {max(value):,}"
            key = "bytes_per_layer (each)"
        elif key == "tensor_types":
            value = ", ".join(f"{k}×{n}" for k, n in value.items())
        click.echo(f"{key:24} {value}")


@main.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Store to write (default: MODEL with the suffix .ntio)")
def convert(model, output) -> None:
    """Convert the GGUF MODEL into an ntio store (layers contiguous and 4096-aligned, checksummed)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from ntio.store import STORE_SUFFIX, convert as convert_to_store

    output = output or model.with_suffix(STORE_SUFFIX)
    columns = ("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"converting {model.name}", total=None)
        convert_to_store(model, output, progress=lambda done, total: bar.update(task, completed=done, total=total))
    click.echo(str(output))


@main.command()
def fetch() -> None:
    """Download the default model (SmolLM2-135M-Instruct Q4_1) into the cache and print its path."""
    from ntio.fetch import fetch_default_model

    click.echo(str(fetch_default_model()))


if __name__ == "__main__":
    main()
