"""The Python API: `ntio.load(path)` returns an `LLM` that generates, streams, chats and scores text.

    >>> import ntio
    >>> m = ntio.load()                       # default model, fetched on first use
    >>> m.generate("The capital of France is", max_new_tokens=8).text
    >>> for piece in m.stream("Tell me a joke", chat=True): print(piece, end="")
    >>> m.perplexity(open("README.md").read()).perplexity
"""

from __future__ import annotations

import math
import numbers
import os
import threading
import time
from collections.abc import Iterator, Sequence
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ntio.models.config import ModelConfig
from ntio.runtime.budget import DEFAULT_CONTEXT, MemoryPlan, plan_memory, resident_plan
from ntio.runtime.engine import Engine
from ntio.runtime.kv_cache import KVCache
from ntio.errors import ContextOverflowError, NtioError, OptionError, integer_option
from ntio.fetch import resolve_model
from ntio.kernels.cpu_kernels import KernelChoice
from ntio.decoding.generation import Sampler, SamplingParams, generate_ids
from ntio.decoding.self_draft import Calibration, SelfDraft, default_exit_layer, fingerprint
from ntio.decoding.speculative import DraftLength, Drafters, DraftModel, PromptLookup, SpeculationStats, speculative_ids
from ntio.formats.model_file import open_model_file
from ntio.text.tokenizer import Tokenizer
from ntio.runtime.loader import LayerLoader, ProgressCallback
from ntio.policies.base import LoadPolicy, overrides
from ntio.runtime.stats import StreamStats
from ntio.models.weights import WeightLayout, load_global_weights

_log = logging.getLogger("ntio")

KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    n_prompt_tokens: int
    n_generated_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    finish_reason: str  # "stop" (a stop token or string), "length" (max_new_tokens or the context is full)
    speculation: dict | None = None  # SpeculationStats.summary() when drafts were verified, else None


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    n_tokens: int  # tokens scored (every token of each window but its first)
    ctx: int


class TokenStream:
    """Iterates over the text of each new token as it is generated; `.completion` is set when it ends."""

    def __init__(self, pieces: Iterator[str]) -> None:
        self._pieces = pieces
        self.completion: Completion | None = None

    def __iter__(self) -> Iterator[str]:
        self.completion = yield from self._pieces


class LLM:
    """A loaded model. Layers live in tiers (A device / B host RAM / C disk) planned from the memory budgets, or
    forced with `tiers` ("A", "B", "C", or e.g. "A:0-9,C:10-29"); `stats` reports what streaming cost.

    verify (default True): every tensor of an ntio store is checked against its checksum each time it is read
    (resident layers once, streamed layers at every read, on the reader's I/O thread); a corrupt tensor is a
    ModelFormatError and no token is computed from it. GGUF files carry no checksums.

    cpu_activations (default "int8"): what quantized weights meet in the CPU kernels: activations quantized to 8
    bits per 32 elements and integer products, as llama.cpp (fast), or "float32" (the reference, ~1e-6 of
    transformers' float32). NTIO_CPU_KERNELS (best, amx, avx512, avxvnni, avx2, neon, scalar) forces a kernel set.

    draft: a small model with this one's vocabulary (a path or a name, e.g. qwen2.5-coder-0.5b for
    qwen2.5-coder-1.5b), loaded beside it as a companion (`companion`: resident in what memory is left) and used
    for speculative decoding by `stream` and `generate` (see ntio.decoding.speculative).

    self_draft: a calibration file of this model's exit heads (`ntio calibrate`): its own first exit_layer + 1
    layers draft instead (default exit layer: `self_draft.default_exit_layer`); those layers are kept resident
    (a copy when they stream; the plan then keeps its resident layers first), and the output head must be
    resident."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: str = "cpu",
        kv_dtype: str = "float32",
        max_context: int | None = None,
        tiers: str = "auto",
        gpu_memory_budget: str | int | None = None,
        ram_budget: str | int | None = None,
        layer_group_size: int = 1,
        sync: bool = False,
        prefetch_depth: int | None = None,
        io_backend: str | None = None,
        on_progress: ProgressCallback | None = None,
        policy: LoadPolicy | None = None,
        threads: int | None = None,
        tokenizer: Tokenizer | None = None,
        verify: bool = True,
        cpu_activations: str = "int8",
        draft: str | os.PathLike[str] | None = None,
        self_draft: str | os.PathLike[str] | None = None,
        exit_layer: int | None = None,
    ) -> None:
        # One generation (or perplexity) at a time: they share the KV cache. Each stream is numbered; a later one
        # makes it stale, and a step holds `_step_lock`, so that two threads are refused or serialized, not mixed.
        self._generation, self._step_lock, self._closed = 0, threading.Lock(), False
        kernels = KernelChoice.from_env(cpu_activations)
        # What a companion (`companion`) runs with unless told otherwise: where and how this model computes.
        self._companion_options = dict(device=device, kv_dtype=kv_dtype, threads=threads, io_backend=io_backend,
                                       verify=verify, cpu_activations=cpu_activations)
        if kv_dtype not in KV_DTYPES:
            raise OptionError("kv_dtype", f"must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        if draft is not None and self_draft is not None:
            raise OptionError("self_draft", "and draft are two draft models: give one")
        if exit_layer is not None and self_draft is None:
            raise OptionError("exit_layer", "picks an exit head of self_draft's calibration file: give one")
        if threads is not None and threads > (cpus := len(os.sched_getaffinity(0))):
            _log.warning(f"threads {threads} is more than the {cpus} CPUs this process may run on: the kernels' "
                         f"threads will wait on each other")
        self.path = Path(path)
        self.file = open_model_file(self.path)
        self.config = ModelConfig.from_gguf(self.file)
        # A tokenizer handed in (a companion's) is shared when it serves this file's vocabulary.
        shared = tokenizer is not None and tokenizer.serves(self.file)
        self.tokenizer = tokenizer if shared else Tokenizer.from_gguf(self.file)
        layout = WeightLayout(self.file, self.config)
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        # A draft model (of this model's vocabulary: checked first, its tokens must mean the same text) is planned
        # first, wholly resident with a KV cache as long as the target's, and its bytes come out of the target's
        # budget.
        if draft is not None and not self.tokenizer.serves(open_model_file(resolve_model(draft))):
            raise NtioError(f"draft model {resolve_model(draft)} has a different vocabulary from {self.path}: its "
                            f"tokens would mean other text (use a draft of the same model family)")
        self.draft_memory = None if draft is None else draft_plan(
            resolve_model(draft), cuda=cuda, kv_dtype=KV_DTYPES[kv_dtype],
            capacity=max_context or min(self.config.context_length, DEFAULT_CONTEXT), kernels=kernels)
        reserved = 0 if self.draft_memory is None else self.draft_memory.report()["total"]
        self.memory = plan_memory(layout, cuda=cuda, kv_dtype=KV_DTYPES[kv_dtype],
                                  max_context=max_context, tiers=tiers, gpu_memory_budget=gpu_memory_budget,
                                  ram_budget=ram_budget, group_size=layer_group_size, prefetch_depth=prefetch_depth,
                                  sync=sync, reserved=reserved, spread=self_draft is None, kernels=kernels,
                                  drafting=draft is not None or self_draft is not None)
        if self.memory.notice:
            _log.warning(self.memory.notice)
        self.plan, capacity, depth = self.memory.plan, self.memory.capacity, self.memory.prefetch_depth
        with torch.inference_mode():
            interleave = not cuda and kernels.interleaves_rows
            self.loader = LayerLoader(layout, self.plan, self.device, group_size=layer_group_size, prefetch_depth=depth,
                                      backend=io_backend, on_progress=on_progress, policy=policy, verify=verify,
                                      interleave=interleave)
            token_rows = self.loader.disk_rows(layout.token_embd) if self.plan.embedding == "C" else None
            globals_ = load_global_weights(layout, self.loader.read_tensor, self.device, token_rows,
                                           head_resident=self.plan.head == "A", interleave=interleave)
        kv = KVCache(self.config, capacity, KV_DTYPES[kv_dtype], self.device)
        self.engine = Engine(self.config, globals_, self.loader, kv, threads=threads,
                             prefill_chunk=self.memory.prefill_chunk, kernels=kernels)
        self.draft: LLM | None = None
        self.self_draft = self._load_self_draft(self_draft, exit_layer) if self_draft is not None else None
        # What passes cost and drafts earn, learnt across generations.
        self._draft_length = DraftLength(ahead=self.loader.read_ahead_share)
        if draft is not None:
            slice_ = {"gpu_memory_budget" if cuda else "ram_budget": reserved}
            self.draft = self.companion(draft, max_context=capacity, tiers="A", **slice_)

    def companion(self, model: str | os.PathLike[str], **options) -> LLM:
        """A second model that runs beside this one, e.g. a resident draft for speculative decoding.

        It shares this model's tokenizer (and so its chat template) when the two files have the same vocabulary,
        and has its own engine: KV cache, scratch buffers, threads, loader and policy. Its memory is its own slice:
        `ram_budget` / `gpu_memory_budget` as given, else what is still available once this model is loaded.
        Options as for `ntio.load`; device, kv_dtype, threads, io_backend, verify and cpu_activations default to
        this model's.
        """
        return LLM(resolve_model(model), tokenizer=self.tokenizer, **{**self._companion_options, **options})

    def _load_self_draft(self, path: str | os.PathLike[str], exit_layer: int | None) -> SelfDraft:
        calibration = Calibration.load(path, fingerprint(self.engine, self.tokenizer.vocabulary), self.config.d_model)
        if exit_layer is None:
            exit_layer = default_exit_layer(calibration, self.config.n_layers)
        if exit_layer not in calibration.heads:
            raise OptionError("exit_layer", f"{exit_layer} has no exit head in {path} (calibrated: "
                                            f"{', '.join(map(str, sorted(calibration.heads)))})")
        if self.engine.globals.output is None:
            raise NtioError("self-speculation needs the output head resident, and the memory budget streams it "
                            "(raise --ram-budget)")
        with torch.inference_mode():
            blocks = self.loader.resident_copies(exit_layer + 1)
        return SelfDraft(self.engine, exit_layer, calibration.heads[exit_layer], blocks)

    @property
    def stats(self) -> StreamStats:
        return self.loader.stats

    @property
    def policy(self) -> LoadPolicy:
        """What each layer reads and which tokens compute it (ntio.policies); dense unless set."""
        return self.loader.policy

    @policy.setter
    def policy(self, policy: LoadPolicy) -> None:
        policy.horizon = self.loader.policy.horizon
        self.loader.policy = policy

    def close(self) -> None:
        """Drain in-flight reads and release staging memory (also done when the object is collected); the model
        then refuses to generate."""
        self._closed = True
        self.loader.close()
        if self.draft is not None:
            self.draft.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- prompts ---------------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int], *, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids for a prompt: ids pass through; with chat=True text is wrapped in the model's chat template."""
        if isinstance(prompt, bytes | bytearray) or not isinstance(prompt, str | Sequence | torch.Tensor | np.ndarray):
            raise NtioError(f"the prompt must be text or a sequence of token ids, got {type(prompt).__name__}")
        if not isinstance(prompt, str):
            ids = []
            for t in prompt:
                if isinstance(t, bool) or not (isinstance(t, numbers.Integral) or isinstance(t, torch.Tensor)
                                               and t.dim() == 0 and not t.is_floating_point()):
                    raise NtioError(f"prompt token ids must be integers in a 1-D sequence, got {t!r:.60}")
                ids.append(integer_option("prompt", t))
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise NtioError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
            return ids
        if chat:
            messages = ([{"role": "system", "content": system}] if system is not None else []) + [
                {"role": "user", "content": prompt}]
            return self.encode_messages(messages)
        return self.tokenizer.encode(prompt)

    def encode_messages(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template, ready for the assistant's turn."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise NtioError(f"messages[{i}] must be a dict whose content is a string, got {m!r:.80}")
        return self.tokenizer.encode(self.tokenizer.render_chat(list(messages)), add_bos=False, special=True)

    # -- generation ------------------------------------------------------------------------------------------

    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        *,
        chat: bool = False,
        system: str | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        lookup: bool = False,
        use_draft: bool = True,
        draft_tokens: int = 8,
        adaptive_draft: bool = True,
        branches: int = 2,
    ) -> TokenStream:
        """Generate lazily: iterate for text pieces; the stream's `.completion` holds the result at the end.

        Speculative decoding verifies a tree of drafted tokens per target pass, at most `draft_tokens` deep:
        drafts from the loaded draft model (unless use_draft=False) and, with lookup=True, from n-gram matches in
        the context, with up to `branches` of the drafter's next choices per step as extra leaves (0: linear
        drafts). Each pass drafts as deep, and takes as many extra leaves, as its measured cost and the sources'
        acceptance make worthwhile (adaptive_draft=False: always draft_tokens deep, every extra leaf). Greedy output
        is the same as without drafts; sampled output has the same distribution."""
        self._check_open()
        params = SamplingParams(temperature, top_k, top_p, repetition_penalty, seed)
        max_new_tokens, draft_tokens, branches = (integer_option(name, value) for name, value in (
            ("max_new_tokens", max_new_tokens), ("draft_tokens", draft_tokens), ("branches", branches)))
        if max_new_tokens < 1:
            raise OptionError("max_new_tokens", f"must be >= 1, got {max_new_tokens}")
        if draft_tokens < 1:
            raise OptionError("draft_tokens", f"must be >= 1, got {draft_tokens}")
        if branches < 0:
            raise OptionError("branches", f"must be >= 0, got {branches}")
        stop = (stop,) if isinstance(stop, str) else tuple(stop if stop is not None else ())
        if not all(isinstance(s, str) for s in stop):
            raise OptionError("stop", f"must be a string or a sequence of strings, got {stop!r}")
        model = DraftModel(self.draft.engine) if self.draft is not None else self.self_draft
        drafters = Drafters(PromptLookup() if lookup else None, model if use_draft else None,
                            self._draft_length if adaptive_draft else DraftLength(fixed=True), branches)
        if drafters and overrides(self.policy, "tokens"):
            raise OptionError("adaptive", "does not combine with speculative decoding yet (a verify pass would need "
                                          "each drafted token's own depth)")
        prompt_ids = self.encode_prompt(prompt, chat=chat, system=system)
        if not prompt_ids:
            raise NtioError("the prompt is empty (no tokens)")
        if len(prompt_ids) >= self.engine.kv.capacity:
            fitted = (", all the memory budget fits; max_context (--ctx-size) asks for a longer one, which may decode "
                      "slower once it fills" if self.memory.context_fitted else "")
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens and the context holds {self.engine.kv.capacity}{fitted}: "
                f"generating takes at least {len(prompt_ids) + 1} (model context_length {self.config.context_length})"
            )
        self._generation += 1
        return TokenStream(self._generate(prompt_ids, max_new_tokens, Sampler(params, self.device), stop, drafters,
                                          draft_tokens, self._generation))

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128, **kwargs) -> Completion:
        """Generate and return the whole completion. Keyword arguments as for `stream`."""
        stream = self.stream(prompt, max_new_tokens, **kwargs)
        for _ in stream:
            pass
        assert stream.completion is not None
        return stream.completion

    def _check_open(self) -> None:
        if self._closed:
            raise NtioError(f"{self.path.name}: the model is closed")

    def _exclusive(self, steps: Iterator[int], generation: int) -> Iterator[int]:
        """`steps` (each one a forward pass) taken while `generation` is the model's latest, one thread at a time."""
        while True:
            with self._step_lock:
                if self._generation != generation or self._closed:
                    raise NtioError("this stream was overtaken by a later generate, stream or perplexity on the same "
                                    "model, or the model was closed (they share its KV cache)")
                token = next(steps, None)
            if token is None:
                return
            yield token

    def _generate(
        self, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler, stop: tuple[str, ...], drafters: Drafters,
        draft_tokens: int, generation: int,
    ) -> Iterator[str]:
        # Reuse the longest cached prefix, but always recompute at least the last prompt token for its logits.
        reuse = self.engine.kv.reusable_prefix(prompt_ids, limit=len(prompt_ids) - 1)
        speculation = SpeculationStats() if drafters else None
        if speculation is not None:
            ids = speculative_ids(self.engine, prompt_ids, max_new_tokens, sampler, self.tokenizer.stop_ids, drafters,
                                  draft_tokens, speculation, reuse)
        else:
            ids = generate_ids(self.engine, prompt_ids, max_new_tokens, sampler, self.tokenizer.stop_ids, reuse)
        detok = self.tokenizer.stream()
        stops = StopStrings(stop)
        text, generated, finish, hit = "", [], "length", False
        t0 = time.perf_counter()
        t_first = t0
        for token in self._exclusive(ids, generation):
            if not generated:
                t_first = time.perf_counter()
            generated.append(token)
            if token in self.tokenizer.stop_ids:
                finish = "stop"
                break
            piece, hit = stops.push(detok.push(token))
            text += piece
            if piece:
                yield piece
            if hit:
                finish = "stop"
                break
        if not hit:
            # Release what was held back: bytes of an unfinished character, a stop string that never completed.
            piece, _ = stops.push(detok.finish())
            if rest := piece + stops.flush():
                text += rest
                yield rest
        t_end = time.perf_counter()
        n_decoded = len(generated) - 1
        return Completion(
            text=text,
            token_ids=generated,
            n_prompt_tokens=len(prompt_ids),
            n_generated_tokens=len(generated),
            prefill_tok_s=(len(prompt_ids) - reuse) / max(t_first - t0, 1e-9),
            decode_tok_s=n_decoded / (t_end - t_first) if n_decoded > 0 else 0.0,
            finish_reason=finish,
            speculation=speculation.summary() if speculation is not None else None,
        )

    # -- scoring ---------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def perplexity(self, text: str, ctx: int = 512) -> Perplexity:
        """exp(mean NLL) over consecutive non-overlapping windows of `ctx` tokens.

        The text is tokenized as one string without special tokens (BOS only if the model's metadata asks for
        it); every token of a window except its first is scored, given the tokens before it in that window.
        """
        self._check_open()
        if not isinstance(text, str):
            raise NtioError(f"perplexity takes text, got {type(text).__name__}")
        ctx = integer_option("ctx", ctx)
        if ctx < 2:
            raise OptionError("ctx", f"must be >= 2, got {ctx}")
        if ctx > self.engine.kv.capacity:
            raise OptionError("ctx", f"{ctx} exceeds the context of {self.engine.kv.capacity} tokens")
        ids = torch.tensor(self.tokenizer.encode(text), dtype=torch.int64, device=self.device)
        if ids.numel() < 2:
            raise NtioError(f"the text has {ids.numel()} token(s); perplexity needs at least 2")
        total_nll, count = 0.0, 0
        with self._step_lock:  # it writes over the KV cache: a stream before it is stale
            self._generation += 1
            for start in range(0, ids.numel(), ctx):
                window = ids[start : start + ctx]
                if window.numel() < 2:
                    break
                total_nll += float(self.engine.nll(window, 0).sum())
                count += window.numel() - 1
        return Perplexity(perplexity=math.exp(total_nll / count), n_tokens=count, ctx=ctx)


class StopStrings:
    """Cuts generated text at the first stop string, holding back any tail that could still begin one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """Add new text; return (text safe to emit, whether a stop string was reached)."""
        self.pending += piece
        hits = [i for s in self.stops if (i := self.pending.find(s)) != -1]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def draft_plan(path: Path, *, cuda: bool, kv_dtype: torch.dtype, capacity: int,
               kernels: KernelChoice) -> MemoryPlan:
    """A draft model's memory beside its target: wholly resident, with a KV cache of the target's `capacity`, running
    the target's CPU `kernels`."""
    g = open_model_file(path)
    cfg = ModelConfig.from_gguf(g)
    if capacity > cfg.context_length:
        raise OptionError("max_context", f"{capacity} (the context) is more than the {cfg.context_length} tokens of "
                                         f"draft model {path}: give max_context {cfg.context_length} or less")
    return resident_plan(WeightLayout(g, cfg), cuda=cuda, kv_dtype=kv_dtype, capacity=capacity, kernels=kernels)


def load(model: str | os.PathLike[str] | None = None, **options) -> LLM:
    """Load a GGUF model or ntio store (the default SmolLM2-135M-Instruct when `model` is None).

    Options as for `LLM`: device, kv_dtype, max_context, tiers, gpu_memory_budget, ram_budget, layer_group_size,
    sync, prefetch_depth, io_backend, on_progress, policy (a `ntio.policies.base.LoadPolicy`; default dense),
    threads (torch threads for this model's prefill steps; default the process's), tokenizer (one to share, used
    when it serves the file's vocabulary; see `LLM.companion`), verify (check a store's tensors against their
    checksums whenever they are read; default True), cpu_activations, draft (a draft model for speculative
    decoding).
    """
    return LLM(resolve_model(model), **options)
