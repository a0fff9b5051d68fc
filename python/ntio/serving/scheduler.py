"""Continuous batching: the requests being answered share each pass over the model's weights.

One thread owns the engine. Each step it runs one batched pass (`Engine.forward_batch`) over every active sequence:
one token for each sequence that is decoding, and prompt tokens for sequences still in their prefill, chunked so that
a long prompt never holds the others up for more than a step. Every layer is read once per step for all of them, so
when weights stream from disk the bytes read per generated token fall as the number of active requests rises.

With prompt lookup on (`lookup`), a decoding sequence whose history has an n-gram match brings the tokens that
followed it as a draft: its rows of the pass are its last token and that chain, and the pass's logits after each
verify the chain (`speculative.verify`), so one pass can settle several of its tokens. Drafts take only the rows
the step has spare, and a drafted token takes a row only while it raises the pass's expected tokens per second for
all its sequences together: its chance of acceptance (the sequence's own record, `DraftLength.acceptance`) against
the measured cost of a row (`DraftLength.pass_cost`), which every sequence of the pass waits for. So drafts run
deep for a lone request and shallow when many share a compute-bound pass. Greedy answers stay token for token those
of plain decoding; sampled ones keep the model's distribution. A request sampled with a seed gets no drafts, so that
its seed keeps giving the same draws.

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
from ntio.decoding.speculative import MAX_DRAFT, Draft, DraftLength, DraftTree, PromptLookup, verdicts, verify
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
    acceptance: DraftLength | None  # how often its drafted tokens were accepted; None: it gets no drafts
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
    drafted_tokens: int = 0  # drafted tokens verified in passes
    accepted_tokens: int = 0  # of those, the ones the model agreed with
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

    def __init__(self, llm, parallel: int, max_queue: int, slot_context: int, lookup: PromptLookup | None = None,
                 draft_tokens: int = 8) -> None:
        from ntio.api import StopStrings

        if parallel < 1 or parallel > ops.KERNEL_ROWS - MIN_PREFILL_ROWS:
            raise ValueError(f"parallel must be in 1..{ops.KERNEL_ROWS - MIN_PREFILL_ROWS}, got {parallel}")
        self.llm = llm
        self.engine = llm.engine
        self.max_queue = max_queue
        self.slot_context = slot_context
        self.lookup, self.draft_tokens = lookup, draft_tokens
        self.pass_cost = DraftLength()  # the fitted cost of a pass against its rows
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
            # A seeded sampled request gets no drafts: how many draws a pass makes would follow the drafts, whose
            # depth follows measured timings, and the seed must give the same draws every time.
            sampling = request.sampling
            drafts = self.lookup is not None and (sampling.temperature == 0 or sampling.seed is None)
            self._active[slot] = _Sequence(request, kv, Sampler(request.sampling, self.engine.device),
                                           self.llm.tokenizer.stream(), self._stop_strings(request.stop), reuse,
                                           list(prompt), DraftLength() if drafts else None)
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
        """One batched pass: a token for each decoding sequence, with the chain it drafted in the rows spare, then
        prompt chunks in the rows left."""
        decoding = [(slot, seq) for slot, seq in self._active.items() if not seq.prefilling]
        prefilling = len(decoding) < len(self._active)
        spare = ops.KERNEL_ROWS - len(decoding) - (MIN_PREFILL_ROWS if prefilling else 0)
        batch: list[tuple[int, _Sequence, DraftTree | None]] = []  # (slot, sequence, its tree; None: a prompt chunk)
        segments: list[Segment] = []
        for (slot, seq), tree in zip(decoding, self._drafts([seq for _, seq in decoding], spare)):
            segments.append(Segment(torch.tensor(tree.tokens), seq.kv.length, seq.kv, all_logits=len(tree) > 1))
            batch.append((slot, seq, tree))
        rows = ops.KERNEL_ROWS - sum(s.tokens.shape[0] for s in segments)
        for slot, seq in self._active.items():
            if not seq.prefilling or rows == 0:
                continue
            prompt = seq.request.prompt_ids
            chunk = prompt[seq.fed : seq.fed + rows]
            segments.append(Segment(torch.tensor(chunk), seq.fed, seq.kv))
            seq.fed += len(chunk)
            rows -= len(chunk)
            batch.append((slot, seq, None))
        t0 = time.perf_counter()
        logits = self.engine.forward_batch(segments)
        elapsed = time.perf_counter() - t0
        read = self.llm.stats.last().get("bytes_read", 0)
        self.llm.stats.reset()  # a server runs for days: keep the step's figures here, not a list of every step
        self.metrics.steps += 1
        n_rows = sum(s.tokens.shape[0] for s in segments)
        self.pass_cost.observe(n_rows, elapsed, {}, None)
        decoded = 0
        for (slot, seq, tree), out in zip(batch, logits):
            if tree is None:  # a prompt chunk: the last one's logits give the first token
                if not seq.prefilling:
                    self._advance(slot, seq, seq.sampler(out, torch.tensor(seq.history)))
                continue
            tokens = self._settle(seq, tree, out)
            for token in tokens:
                decoded += 1
                if self._advance(slot, seq, token):
                    break
        if decoding:
            self.metrics.decode_s += elapsed
            self.metrics.decoded_in_steps += decoded
            self.metrics.decode_bytes_read += read

    def _drafts(self, decoding: list[_Sequence], spare: int) -> list[DraftTree]:
        """The tree each decoding sequence brings to the pass: its last token and a prefix of its lookup match (within
        the tokens it still wants and its context), drafted tokens taking at most `spare` rows, likeliest first,
        each while its chance c of acceptance pays for the row it takes: c · (the pass's cost) >= (the cost of a
        row) · (the tokens the pass is expected to settle), the condition for a row to raise the pass's tokens per
        second."""
        trees = [DraftTree(seq.history[-1]) for seq in decoding]
        chains: dict[int, list[int]] = {}
        offers: list[tuple[float, int, int]] = []  # (chance, sequence, place in its chain)
        for i, seq in enumerate(decoding):
            most = min(self.draft_tokens, MAX_DRAFT, seq.request.max_tokens - seq.generated - 1,
                       seq.kv.capacity - len(seq.history))
            found = self.lookup.match(seq.history, most) if seq.acceptance is not None and most > 0 else None
            if found is not None:
                chains[i] = found[1]
                a = seq.acceptance.acceptance(self.lookup.name)
                offers += [(a ** (j + 1), i, j) for j in range(len(found[1]))]
        t1, t_row = self.pass_cost.pass_cost()
        taken = dict.fromkeys(chains, 0)
        expected, drafted = float(len(decoding)), 0
        for chance, i, j in sorted(offers, key=lambda o: (-o[0], o[2])):  # a chain's tokens in order
            if drafted == spare or chance * (t1 + (len(decoding) - 1 + drafted) * t_row) < t_row * expected:
                break  # later offers are no likelier, and each row taken raises the bar
            if j == taken[i]:
                taken[i] += 1
                drafted += 1
                expected += chance
        for i, k in taken.items():
            if k:
                a = decoding[i].acceptance.acceptance(self.lookup.name)
                trees[i].add_chain(Draft(chains[i][:k], self.lookup.name), [a ** (j + 1) for j in range(k)])
        return trees

    def _settle(self, seq: _Sequence, tree: DraftTree, out: torch.Tensor) -> list[int]:
        """The tokens a decoding sequence's rows settle: the next one sampled, or its drafted chain verified (the
        accepted tokens and the model's own after them, the cache kept up to the last accepted)."""
        history = torch.tensor(seq.history)
        if len(tree) == 1:
            return [seq.sampler(out, history)]
        root = len(seq.history) - 1
        branch, token = verify(out, tree, seq.sampler, history)
        seq.kv.crop(root + 1 + len(branch))
        seq.acceptance.observe(len(tree), 0.0, verdicts(tree, branch), None)
        self.metrics.drafted_tokens += len(tree) - 1
        self.metrics.accepted_tokens += len(branch)
        return tree.branch_tokens(branch) + [token]

    def _advance(self, slot: int, seq: _Sequence, token: int) -> bool:
        """Append the sequence's next token, emit its text, and finish the sequence if it is done (True)."""
        request = seq.request
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
            elif seq.generated >= request.max_tokens or len(seq.history) > seq.kv.capacity:
                finish = "length"
            if finish == "length":  # release what was held back: an unfinished character, a partial stop string
                piece, _ = seq.stops.push(seq.detok.finish())
                if rest := piece + seq.stops.flush():
                    request.emit("text", rest)
        if finish is None:
            return False
        prompt = len(request.prompt_ids)
        request.emit("done", finish, {"prompt_tokens": prompt, "completion_tokens": seq.generated,
                                      "total_tokens": prompt + seq.generated})
        self._release(slot)
        return True
