"""Continuous batching: the requests being answered share each pass over the model's weights.

One thread owns the engine. Each step it runs one batched pass (`Engine.forward_batch`) over every active sequence:
one token for each sequence that is decoding, and prompt tokens for sequences still in their prefill, chunked so that
a long prompt never holds the others up for more than a step. Every layer is read once per step for all of them, so
when weights stream from disk the bytes read per generated token fall as the number of active requests rises.

Sequences live in slots, each with its own KV cache of `slot_context` positions. A request joins between steps, in
the free slot whose cached tokens share the longest prefix with its prompt (that prefix is not recomputed), and
leaves when it finishes or its client goes away. Past `parallel` active and `max_queue` waiting requests,
`submit` refuses.

A step's rows never exceed the CPU kernels' rows (`ops.KERNEL_ROWS`), where every row is computed as it is in a pass
of its own: a greedy request gets the tokens `LLM.generate` gives it, for prompts that `generate` also prefills
through the kernels (up to KERNEL_ROWS tokens; a longer prompt is prefilled in smaller chunks here, which can move
its logits by float rounding).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ntio.decoding.generation import Sampler, SamplingParams
from ntio.kernels import ops
from ntio.runtime.engine import Segment
from ntio.runtime.kv_cache import KVCache

# Prompt rows a step gives to prefills at least, however many sequences are decoding.
MIN_PREFILL_ROWS = 8


@dataclass
class Request:
    """What a client asked for. `emit` receives the request's events from the engine thread, in order:
    ("text", piece) for each piece of generated text, then ("done", finish_reason, usage) or ("error", message)."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    emit: Callable[..., None]
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Sequence:
    """An active request in its slot."""

    request: Request
    kv: KVCache
    sampler: Sampler
    detok: object  # the tokenizer's incremental decoder
    stops: object  # ntio.api.StopStrings
    fed: int  # prompt tokens in the cache
    history: list[int]  # prompt and generated ids (the sampler's repetition history)
    generated: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.request.prompt_ids)


@dataclass
class Metrics:
    """Counters since the server started, and the current load."""

    requests: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    decode_s: float = 0.0  # time in steps that decoded at least one token
    decoded_in_steps: int = 0  # tokens those steps decoded
    decode_bytes_read: int = 0  # bytes those steps read from disk
    active: int = 0
    queued: int = 0

    @property
    def decode_tok_s(self) -> float:
        """Tokens decoded per second of the steps that decoded (all sequences together)."""
        return self.decoded_in_steps / self.decode_s if self.decode_s else 0.0

    @property
    def bytes_read_per_token(self) -> float:
        """Bytes read from disk per decoded token: a step's bytes are shared by every sequence it decodes."""
        return self.decode_bytes_read / self.decoded_in_steps if self.decoded_in_steps else 0.0


class Scheduler:
    """Runs `llm`'s engine for many requests at once (see the module). `start()` launches the engine thread;
    `submit` is safe from any thread; `shutdown()` finishes what is in flight and stops the thread."""

    def __init__(self, llm, parallel: int, max_queue: int, slot_context: int) -> None:
        from ntio.api import StopStrings

        if parallel < 1 or parallel > ops.KERNEL_ROWS - MIN_PREFILL_ROWS:
            raise ValueError(f"parallel must be in 1..{ops.KERNEL_ROWS - MIN_PREFILL_ROWS}, got {parallel}")
        self.llm = llm
        self.engine = llm.engine
        self.max_queue = max_queue
        self.slot_context = slot_context
        self._stop_strings = StopStrings
        kv = self.engine.kv
        self.slots = [KVCache(llm.config, slot_context, kv.k.dtype, kv.k.device) for _ in range(parallel)]
        self._free = list(range(parallel))
        self._active: dict[int, _Sequence] = {}  # slot -> sequence
        self._queue: collections.deque[Request] = collections.deque()
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="ntio-engine", daemon=True)
        self.metrics = Metrics()

    # -- client side ----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> bool:
        """Queue a request; False (nothing queued) when `parallel` requests are active and `max_queue` wait, or
        the scheduler is shutting down."""
        with self._wake:
            busy = len(self._active) + len(self._queue)
            if self._closing or busy >= len(self.slots) + self.max_queue:
                self.metrics.refused += 1
                return False
            self._queue.append(request)
            self.metrics.requests += 1
            self.metrics.queued = len(self._queue)
            self._wake.notify()
        return True

    def shutdown(self, timeout: float | None = None) -> None:
        """Refuse new requests, finish the active and queued ones, then stop the engine thread."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout)

    # -- engine thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._active and not self._queue and not self._closing:
                    self._wake.wait()
                if self._closing and not self._active and not self._queue:
                    return
                self._admit()
            self._drop_cancelled()
            if self._active:
                try:
                    self._step()
                except Exception as e:  # an I/O error, a bug: the step's requests fail, the server goes on
                    for slot, seq in list(self._active.items()):
                        seq.request.emit("error", f"{type(e).__name__}: {e}")
                        self._release(slot)

    def _admit(self) -> None:
        """Move queued requests into free slots (caller holds the lock), each into the slot whose cache shares the
        longest prefix with its prompt."""
        while self._queue and self._free:
            request = self._queue.popleft()
            prompt = request.prompt_ids
            slot = max(self._free, key=lambda s: self.slots[s].reusable_prefix(prompt, len(prompt) - 1))
            self._free.remove(slot)
            kv = self.slots[slot]
            reuse = kv.reusable_prefix(prompt, len(prompt) - 1)
            kv.crop(reuse)
            self._active[slot] = _Sequence(request, kv, Sampler(request.sampling, self.engine.device),
                                           self.llm.tokenizer.stream(), self._stop_strings(request.stop), reuse,
                                           list(prompt))
            self.metrics.prompt_tokens += len(prompt)
        self.metrics.active, self.metrics.queued = len(self._active), len(self._queue)

    def _drop_cancelled(self) -> None:
        for slot, seq in list(self._active.items()):
            if seq.request.cancelled.is_set():
                self._release(slot)

    def _release(self, slot: int) -> None:
        with self._wake:
            del self._active[slot]
            self._free.append(slot)
            self.metrics.active = len(self._active)

    def _step(self) -> None:
        """One batched pass: a token for each decoding sequence, then prompt chunks in the rows left."""
        decoding = [(slot, seq) for slot, seq in self._active.items() if not seq.prefilling]
        rows = max(MIN_PREFILL_ROWS, ops.KERNEL_ROWS - len(decoding))
        batch: list[tuple[int, _Sequence, bool]] = []  # (slot, sequence, whether this pass gives it logits to use)
        segments: list[Segment] = []
        for slot, seq in decoding:
            segments.append(Segment(torch.tensor(seq.history[-1:]), seq.kv.length, seq.kv))
            batch.append((slot, seq, True))
        for slot, seq in self._active.items():
            if not seq.prefilling or rows == 0:
                continue
            prompt = seq.request.prompt_ids
            chunk = prompt[seq.fed : seq.fed + rows]
            segments.append(Segment(torch.tensor(chunk), seq.fed, seq.kv))
            seq.fed += len(chunk)
            rows -= len(chunk)
            batch.append((slot, seq, not seq.prefilling))
        t0 = time.perf_counter()
        logits = self.engine.forward_batch(segments)
        elapsed = time.perf_counter() - t0
        read = self.llm.stats.last().get("bytes_read", 0)
        self.llm.stats.reset()  # a server runs for days: keep the step's figures here, not a list of every step
        self.metrics.steps += 1
        if decoding:
            self.metrics.decode_s += elapsed
            self.metrics.decoded_in_steps += len(decoding)
            self.metrics.decode_bytes_read += read
        for (slot, seq, ready), row in zip(batch, logits):
            if ready:
                self._advance(slot, seq, row)

    def _advance(self, slot: int, seq: _Sequence, logits: torch.Tensor) -> None:
        """Sample the sequence's next token from its logits, emit its text, and finish it if it is done."""
        request = seq.request
        token = seq.sampler(logits, torch.tensor(seq.history))
        seq.history.append(token)
        seq.generated += 1
        self.metrics.generated_tokens += 1
        finish = None
        if token in self.llm.tokenizer.stop_ids:
            finish = "stop"
        else:
            piece, hit = seq.stops.push(seq.detok.push(token))
            if piece:
                request.emit("text", piece)
            if hit:
                finish = "stop"
            elif seq.generated >= request.max_tokens or seq.kv.length >= seq.kv.capacity:
                finish = "length"
            if finish == "length":  # release what was held back: an unfinished character, a partial stop string
                piece, _ = seq.stops.push(seq.detok.finish())
                if rest := piece + seq.stops.flush():
                    request.emit("text", rest)
        if finish is not None:
            prompt = len(request.prompt_ids)
            request.emit("done", finish, {"prompt_tokens": prompt, "completion_tokens": seq.generated,
                                          "total_tokens": prompt + seq.generated})
            self._release(slot)
