"""Continuous batching: the requests being answered share each pass over the model's weights.

One thread owns the engine. Each step it runs one batched pass (`Engine.forward_batch`) over every active sequence:
one token for each sequence that is decoding, and prompt tokens for sequences still in their prefill, chunked so that
a long prompt never holds the others up for more than a step. Every layer is read once per step for all of them, so
when weights stream from disk the bytes read per generated token fall as the number of active requests rises.

Speculative decoding: with prompt lookup on (`lookup`), a decoding sequence whose history has an n-gram match brings the
tokens that followed it as a draft; with a drafting model, it proposes a chain for every decoding sequence at once, in
batched passes, and its next choices along the chain as extra leaves (`branches`). The drafting model is a draft model
(`llm.draft`: its own engine over per-slot caches of its own) or the model's own first layers with an exit head
(`llm.self_draft`: batched early exits over the slots' own caches, which already hold those layers' K/V of every
history, so that a self-draft never catches up on a prompt). A sequence's rows of the pass are then its last token and
its draft tree (a tree mask in the batched pass), and the pass's logits after each node verify the tree
(`speculative.verify`), so one pass can settle several of its tokens; the cache keeps the accepted branch. Drafts take
only the rows the step has spare, and only while they raise the pass's expected tokens per second for all its
sequences together: their chance of acceptance (the sequence's own record per source, `Acceptance`, which starts from
the server's record of the passes before it) against the measured cost of a row of the pass (`PassCost`: free while
the pass waits on its reads anyway, its compute once the compute outlasts them or prompt rows fill the pass), which
every sequence waits for, and of a draft pass. So drafts run deep for a lone request and not at all when many share a
compute-bound pass. Before a request's first draft, the draft model must catch up on its prompt, a prefill that every
sequence waits for: it is paid only where the tokens the request is expected to generate (the mean answer so far) win
it back at the rate drafting saves. Greedy answers stay token for token those of plain decoding; sampled ones keep the
model's distribution. A request sampled with a seed gets no drafts, so that its seed keeps giving the same draws.

Sequences live in slots, each with its own KV cache of `slot_context` positions, a part of the engine's own cache
(which the scheduler takes over). A request joins between steps, in the free slot whose cached tokens share the
longest prefix with its prompt (that prefix is not recomputed), and leaves when it finishes or its client goes away.
Past `parallel` active and `max_queue` waiting requests, `submit` refuses.

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
from ntio.decoding.self_draft import SelfDraft
from ntio.decoding.speculative import (MAX_DRAFT, PREFERRED_LOOKUP, Acceptance, Draft, DraftModel, DraftTree,
                                      PassCost, PromptLookup, draw, verdicts, verify)
from ntio.kernels import ops
from ntio.runtime.engine import Segment
from ntio.runtime.kv_cache import KVCache

# Prompt rows a step gives to prefills at least, however many sequences are decoding.
MIN_PREFILL_ROWS = 8
# Rows of the catch-up pass that prices the drafting model's rows before its first draft (`Scheduler._time_draft`).
DRAFT_TIMING_ROWS = 32


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
    acceptance: Acceptance | None  # how often its drafted tokens were accepted, per source; None: no drafts
    draft_kv: KVCache | None  # the drafting model's cache for it (a self-draft's: the slot's own)
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
    decode_s: float = 0.0  # time in steps that decoded at least one token (their drafting included)
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
                 draft_tokens: int = 8, fixed_draft: bool = False, branches: int = 2) -> None:
        """lookup: prompt lookup drafts; a drafting model (`llm.draft`, a draft model loaded with the model, or
        `llm.self_draft`), when there is one, drafts too, for all the requests of a step in batched passes of its
        own, with up to `branches` of its next choices per drafted token as extra leaves of the request's tree.
        fixed_draft: every draft as deep and wide as it can go (draft_tokens, branches, the rows spare), whatever
        it costs."""
        from ntio.api import StopStrings

        if parallel < 1 or parallel > ops.KERNEL_ROWS - MIN_PREFILL_ROWS:
            raise ValueError(f"parallel must be in 1..{ops.KERNEL_ROWS - MIN_PREFILL_ROWS}, got {parallel}")
        self.llm = llm
        self.engine = llm.engine
        self.max_queue = max_queue
        self.slot_context = slot_context
        self.lookup, self.draft_tokens, self.fixed_draft, self.branches = lookup, draft_tokens, fixed_draft, branches
        self.pass_cost = PassCost()
        # Every sequence's verdicts, per source: where a new request's acceptance record starts (a request's own
        # record decays towards it within a few passes).
        self.acceptance = Acceptance()
        self._stop_strings = StopStrings
        # The slots' K/V are the engine's own cache, cut in `parallel` (the memory the plan counted for it).
        self.slots = self.engine.kv.partition(parallel, slot_context)
        # The drafting model's batched pass (segments -> each one's next-token logits), its source name and its cache
        # per slot: a draft model's engine over caches of its own, or a self-draft (the model's own first layers and
        # an exit head) over the slots' caches, which hold those layers' K/V of every history already.
        self.draft: Callable[[list[Segment]], list[torch.Tensor]] | None = None
        self.draft_name, self.draft_slots = DraftModel.name, []
        if llm.draft is not None:
            self.draft = llm.draft.engine.forward_batch
            self.draft_slots = llm.draft.engine.kv.partition(parallel, slot_context)
        elif llm.self_draft is not None:
            self.draft, self.draft_name, self.draft_slots = llm.self_draft.batch_logits, SelfDraft.name, self.slots
        # Seconds per batched draft pass (EMA): 0 until a draft of several tokens is timed, so that the first
        # draft goes as deep as the pass's cost allows and its verdicts teach the acceptance (a greedy depth rule
        # starting from acceptance 1/2 and a priced step drafts 2 tokens, and learns slowly).
        self.draft_step_s = 0.0
        self.draft_row_s = 0.0  # seconds per prompt row in a draft catch-up pass (EMA; first timed by `_time_draft`)
        # A self-draft drafts over the slots' own caches, which are never behind: it has no catch-up to price.
        self._draft_timed = llm.draft is None
        self.answer_tokens: float | None = None  # tokens per finished answer (EMA); None before the first
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
                        self._fail(slot, seq.request, e)

    def _admit(self) -> None:
        """Move queued requests into free slots (caller holds the lock), each into the slot whose cache shares the
        longest prefix with its prompt."""
        while self._queue and self._free:
            request = self._queue.popleft()
            try:
                sampler = Sampler(request.sampling, self.engine.device)
            except Exception as e:  # what the checks before it let through: this request fails, not the thread
                request.emit("error", f"{type(e).__name__}: {e}")
                continue
            prompt = request.prompt_ids
            slot = max(self._free, key=lambda s: self.slots[s].reusable_prefix(prompt, len(prompt) - 1))
            self._free.remove(slot)
            kv = self.slots[slot]
            reuse = kv.reusable_prefix(prompt, len(prompt) - 1)
            kv.crop(reuse)
            # A seeded sampled request gets no drafts: how many draws a pass makes would follow the drafts, whose
            # depth follows measured timings, and the seed must give the same draws every time.
            sampling = request.sampling
            drafts = (self.lookup is not None or self.draft is not None) and (sampling.temperature == 0
                                                                              or sampling.seed is None)
            self._active[slot] = _Sequence(request, kv, sampler, self.llm.tokenizer.stream(),
                                           self._stop_strings(request.stop), reuse, list(prompt),
                                           self._acceptance_record() if drafts else None,
                                           self.draft_slots[slot] if self.draft is not None else None)
            self.metrics.prompt_tokens += len(prompt)
        self.metrics.active, self.metrics.queued = len(self._active), len(self._queue)

    def _acceptance_record(self) -> Acceptance:
        """A new request's record of its drafts' acceptance, starting from the server's: the same model drafting for
        the same traffic is accepted about as often (a fresh record would start at 1/2 and take passes to learn)."""
        return self.acceptance.copy()

    def _drop_cancelled(self) -> None:
        for slot, seq in list(self._active.items()):
            if seq.request.cancelled.is_set():
                self._release(slot)

    def _fail(self, slot: int, request: Request, e: Exception) -> None:
        request.emit("error", f"{type(e).__name__}: {e}")
        self._release(slot)

    def _release(self, slot: int) -> None:
        with self._wake:
            del self._active[slot]
            self._free.append(slot)
            self.metrics.active = len(self._active)

    def _step(self) -> None:
        """One batched pass: a token for each decoding sequence, with the chain it drafted in the rows spare, then
        prompt chunks in the rows left."""
        started = time.perf_counter()
        decoding = [(slot, seq) for slot, seq in self._active.items() if not seq.prefilling]
        prefilling = len(decoding) < len(self._active)
        spare = ops.KERNEL_ROWS - len(decoding) - (MIN_PREFILL_ROWS if prefilling else 0)
        batch: list[tuple[int, _Sequence, DraftTree | None]] = []  # (slot, sequence, its tree; None: a prompt chunk)
        segments: list[Segment] = []
        for (slot, seq), tree in zip(decoding, self._drafts([seq for _, seq in decoding], spare)):
            drafted = len(tree) > 1
            segments.append(Segment(torch.tensor(tree.tokens), seq.kv.length, seq.kv, all_logits=drafted,
                                    parents=tree.parents if drafted else None))
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
        figures = self.llm.stats.last()
        self.llm.stats.reset()  # a server runs for days: keep the step's figures here, not a list of every step
        self.metrics.steps += 1
        n_rows = sum(s.tokens.shape[0] for s in segments)
        self.pass_cost.observe(n_rows, elapsed, figures.io_wait_s, figures.io_busy_s)
        decoded = 0
        for (slot, seq, tree), out in zip(batch, logits):
            try:
                if tree is None:  # a prompt chunk: the last one's logits give the first token
                    if not seq.prefilling:
                        self._advance(slot, seq, seq.sampler(out, torch.tensor(seq.history)))
                    continue
                for token in self._settle(seq, tree, out):
                    decoded += 1
                    if self._advance(slot, seq, token):
                        break
            except Exception as e:  # its sampling or its text failed (a bug): this request fails, not the others
                self._fail(slot, seq.request, e)
        if decoding:
            self.metrics.decode_s += time.perf_counter() - started  # drafting included
            self.metrics.decoded_in_steps += decoded
            self.metrics.decode_bytes_read += figures.bytes_read

    def _drafts(self, decoding: list[_Sequence], spare: int) -> list[DraftTree]:
        """The tree each decoding sequence brings to the pass: its last token and what was drafted for it, within the
        tokens it still wants, its context and `spare` rows in all. A sequence whose lookup match pays better alone
        takes it alone (`_lookup_alone`); the others draft with the drafting model, if there is one (a chain each,
        all to one depth, in batched passes: `_model_depth`), and their lookup matches join their trees. Then the
        offers take rows likeliest first: lookup tokens (in chain order; one already in the tree costs no row) and
        the drafting model's next choices as extra leaves (its token at step j is right with chance a^j, and where
        it is not, a next choice r is with the draft's q(r) / (1 - q(token)): chance a^j (1 - a) q(r) /
        (1 - q(token))). Each takes its row while its chance c pays for it: c · (the pass's cost) >= (the cost of a
        row) · (the tokens the pass is expected to settle), the condition for a row to raise the pass's tokens per
        second for all its sequences, which all wait for it."""
        trees = [DraftTree(seq.history[-1]) for seq in decoding]
        most = [0 if seq.acceptance is None else
                min(self.draft_tokens, MAX_DRAFT, seq.request.max_tokens - seq.generated - 1,
                    seq.kv.capacity - len(seq.history)) for seq in decoding]
        matches = {i: self.lookup.match(seq.history, most[i]) for i, seq in enumerate(decoding)
                   if self.lookup is not None and most[i] > 0}
        matches = {i: found for i, found in matches.items() if found is not None}
        by_model = [i for i in range(len(decoding)) if self.draft is not None and most[i] > 0
                    and not (i in matches and self._lookup_alone(decoding[i], *matches[i], min(most[i], spare)))]
        expected, drafted = float(len(decoding)), 0
        chances = {i: decoding[i].acceptance.rate(self.draft_name) for i in by_model}
        # Per drafting sequence: the positions of its draft cache that its history still has.
        cached = {i: decoding[i].draft_kv.reusable_prefix(decoding[i].history, len(decoding[i].history) - 1)
                  for i in by_model}
        if by_model and not self.fixed_draft:
            if not self._draft_timed:
                self._time_draft()
            by_model = self._catch_up_pays(decoding, by_model, cached, chances, most, spare)
        # (chance, sequence, place in its lookup chain, None) or (chance, sequence, step, (parent node, token)).
        offers: list[tuple[float, int, int, tuple[int, int] | None]] = []
        if by_model:
            depth = self._model_depth([(min(most[i], spare // len(by_model)), chances[i]) for i in by_model],
                                      len(decoding))
            for i, draft in zip(by_model, self._model_chains([decoding[i] for i in by_model],
                                                             [min(depth, most[i]) for i in by_model],
                                                             [cached[i] for i in by_model])):
                a = chances[i]
                chance = [a ** (j + 1) for j in range(len(draft.tokens))]
                nodes = trees[i].add_chain(draft, chance)
                expected, drafted = expected + sum(chance), drafted + len(draft.tokens)
                offers += [(a ** j * (1 - a) * r, i, j, (nodes[j - 1] if j else 0, token))
                           for j, choices in enumerate(draft.alternatives) for token, r in choices]
        for i, (_, tokens) in matches.items():
            # Lookup's chance per token: beside a model's chain, at its rate as measured once there is one.
            record = decoding[i].acceptance
            a = record.measured_or_prior(self.lookup.name) if len(trees[i]) > 1 else record.rate(self.lookup.name)
            offers += [(a ** (j + 1), i, j, None) for j in range(len(tokens))]
        # Each lookup chain's nodes: its tokens join the tree as they are taken, a token the tree already holds (the
        # model drafted it too) at no row's cost.
        chain: dict[int, list[int]] = {i: [] for i in matches}
        for chance, i, j, leaf in sorted(offers, key=lambda o: (-o[0], o[2])):  # a chain's tokens in order
            if leaf is None and j != len(chain[i]):
                continue  # a token of a lookup chain whose earlier token was not taken
            parent, token = leaf if leaf is not None else (chain[i][-1] if chain[i] else 0, matches[i][1][j])
            if trees[i].child(parent, token) is None:
                rows = len(decoding) + drafted
                cost = self._decode_cost(len(decoding), rows)
                if drafted >= spare or not self.fixed_draft and (
                        chance * cost < (self._decode_cost(len(decoding), rows + 1) - cost) * expected):
                    break  # later offers are no likelier, and each row taken raises the bar
                drafted += 1
                expected += chance
            node = trees[i].add(parent, token, self.draft_name + "-alt" if leaf is not None else self.lookup.name,
                                chance)
            if leaf is None:
                chain[i].append(node)
        for i, nodes in chain.items():
            if nodes:
                trees[i].chains[self.lookup.name] = nodes
        return trees

    def _lookup_alone(self, seq: _Sequence, n: int, tokens: list[int], most: int) -> bool:
        """Whether a sequence takes its lookup match (the last n tokens matched, then `tokens`) alone instead of
        the drafting model's chain, at most `most` deep: as `Drafters._lookup_wins` decides for `generate`. Until
        lookup's acceptance is measured (or with fixed drafts), a match of PREFERRED_LOOKUP tokens or more is taken
        alone; then where its chain, free, promises as many tokens per second of a pass as the model's chain at its
        cost per drafted token (each priced as if the sequence were alone in the pass)."""
        a = seq.acceptance.measured(self.lookup.name)
        if a is None or self.fixed_draft:
            return n >= PREFERRED_LOOKUP
        n_alone = min(len(tokens), most)
        alone = max(self._pass_rate([(n_alone, a)], 1, k, draft_step_s=0.0) for k in range(n_alone + 1))
        model = [(most, seq.acceptance.rate(self.draft_name))]
        return alone >= max(self._pass_rate(model, 1, k) for k in range(most + 1))

    def _catch_up_pays(self, decoding: list[_Sequence], by_model: list[int], cached: dict[int, int],
                       chances: dict[int, float], most: list[int], spare: int) -> list[int]:
        """Those of `by_model` (indices into decoding) whose draft cache is worth catching up (cached[i]: the positions
        it holds of the sequence's history). A sequence c tokens behind costs c · draft_row_s of draft prefill, which
        every sequence waits for; drafting saves 1 / rate(0) - 1 / rate(K) seconds per token of the pass (`_pass_rate`,
        K the chosen depth), over the E tokens the sequence is still expected to generate (the mean answer so far, less
        what it has, within what it may still generate). It catches up where c · draft_row_s <= E · that saving."""
        limits = [(min(most[i], spare // len(by_model)), chances[i]) for i in by_model]
        depth = self._model_depth(limits, len(decoding))
        saving = 1 / self._pass_rate(limits, len(decoding), 0) - 1 / self._pass_rate(limits, len(decoding), depth)
        kept = []
        for i in by_model:
            seq = decoding[i]
            behind = len(seq.history) - 1 - cached[i]
            expected = seq.request.max_tokens - seq.generated
            if self.answer_tokens is not None:
                expected = min(expected, max(self.answer_tokens - seq.generated, 1.0))
            if behind * self.draft_row_s <= expected * saving:
                kept.append(i)
        return kept

    def _model_depth(self, limits: list[tuple[int, float]], n_decoding: int) -> int:
        """How many batched draft passes to run: the depth K that maximizes the pass's expected tokens per second
        (`_pass_rate`); limits: (the sequence's limit, its acceptance) per drafting sequence."""
        deepest = max(n for n, _ in limits)
        return deepest if self.fixed_draft else max(
            range(deepest + 1), key=lambda k: self._pass_rate(limits, n_decoding, k))

    def _pass_rate(self, limits: list[tuple[int, float]], n_decoding: int, k: int,
                   draft_step_s: float | None = None) -> float:
        """A pass's expected tokens per second with K = k draft passes: (n_decoding + Σ_s Σ_{j<=K_s} a_s^j) /
        (the pass over n_decoding + Σ_s K_s rows + K · draft pass), where K_s = min(K, the sequence's limit) and
        a_s its acceptance; a draft pass takes draft_step_s (default: the drafting model's, as measured)."""
        tokens = n_decoding + sum(sum(a ** j for j in range(1, min(k, n) + 1)) for n, a in limits)
        rows = n_decoding + sum(min(k, n) for n, _ in limits)
        step = self.draft_step_s if draft_step_s is None else draft_step_s
        return tokens / (self._decode_cost(n_decoding, rows) + k * step)

    def _decode_cost(self, n_decoding: int, rows: int) -> float:
        """The seconds of a step's pass that its decode rows account for: `rows` rows, the n_decoding sequences'
        last tokens and their drafts. Alone in the pass, or beside prompt rows that leave it waiting on its reads,
        they cost the pass. Where prompt rows (which take the rows the decode rows leave) make the pass
        compute-bound, each decode row accounts for its compute, which it adds to the pass (a prompt row that a
        draft displaces is computed in a later pass). There a drafted token, accepted with chance < 1, costs as
        much as the decode row that would otherwise give it, and drafting never pays."""
        prompt_left = sum(len(seq.request.prompt_ids) - seq.fed for seq in self._active.values() if seq.prefilling)

        def with_prompts(decode_rows: int) -> float:
            prompt = min(prompt_left, ops.KERNEL_ROWS - decode_rows)
            return self.pass_cost.cost(decode_rows + prompt) + (prompt_left - prompt) * self.pass_cost.compute_line[1]

        if prompt_left and with_prompts(n_decoding) > with_prompts(0):
            return with_prompts(rows) - with_prompts(0)
        return self.pass_cost.cost(rows)

    def _time_draft(self) -> None:
        """Prices the draft model's catch-up rows before its first draft, on a cache of its own: a pass over
        DRAFT_TIMING_ROWS rows less a 1-row pass after it (both after a 1-row pass that warms it up). Unpriced, the
        first catch-up would look free, and a server's first drafts would catch every sequence up on its history at
        once (seconds that every sequence waits for)."""
        kv = self.llm.draft.engine.kv
        scratch = KVCache(self.llm.draft.config, DRAFT_TIMING_ROWS + 2, kv.k.dtype, kv.k.device)
        self.draft([Segment(torch.zeros(1, dtype=torch.int64), 0, scratch)])
        t0 = time.perf_counter()
        self.draft([Segment(torch.zeros(DRAFT_TIMING_ROWS, dtype=torch.int64), 0, scratch)])
        t1 = time.perf_counter()
        self.draft([Segment(torch.zeros(1, dtype=torch.int64), DRAFT_TIMING_ROWS, scratch)])
        step = time.perf_counter() - t1
        self.draft_row_s = max(t1 - t0 - step, 0.0) / (DRAFT_TIMING_ROWS - 1)
        self._draft_timed = True

    def _model_chains(self, seqs: list[_Sequence], depths: list[int], cached: list[int]) -> list[Draft]:
        """Each sequence's chain from the drafting model, depths[i] tokens deep, drawn with its own sampler, with up
        to `branches` next choices per step (`Draft.alternatives`): one batched pass of the drafting model per drafted
        token for all of them. The first pass catches each sequence's draft cache up on its history (a draft model's
        cache, after a new request, on its whole prompt; a self-draft's is the slot's own, never behind), and its
        rows past one per sequence are timed for `_catch_up_pays`; the passes after it are timed for
        `_model_depth`."""
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        alternatives: list[list[list[tuple[int, float]]]] = [[] for _ in seqs]
        # Per sequence: (tokens to feed, their first position); cached[i]: the positions its draft cache holds.
        feeds = [(seq.history[keep:], keep) for seq, keep in zip(seqs, cached)]
        for step in range(max(depths, default=0)):
            live = [i for i, depth in enumerate(depths) if step < depth]
            fed = sum(len(feeds[i][0]) for i in live)
            t0 = time.perf_counter()
            rows = self.draft([Segment(torch.tensor(feeds[i][0]), feeds[i][1], seqs[i].draft_kv) for i in live])
            for i, logits in zip(live, rows):
                token, p, choices = draw(seqs[i].sampler, logits, torch.tensor(seqs[i].history + tokens[i]),
                                         self.branches)
                if p is not None:
                    probs[i].append(p)
                if self.branches:
                    alternatives[i].append(choices)
                tokens[i].append(token)
                feeds[i] = ([token], len(seqs[i].history) + step)
            spent = time.perf_counter() - t0
            if step:
                self.draft_step_s = spent if self.draft_step_s == 0 else 0.5 * (self.draft_step_s + spent)
            elif fed - len(live) >= MIN_PREFILL_ROWS:  # a catch-up: price its rows past one per sequence
                row_s = max(spent - self.draft_step_s, 0.0) / (fed - len(live))
                self.draft_row_s = row_s if self.draft_row_s == 0 else 0.5 * (self.draft_row_s + row_s)
        return [Draft(t, self.draft_name, torch.stack(p) if p else None, alts)
                for t, p, alts in zip(tokens, probs, alternatives)]

    def _settle(self, seq: _Sequence, tree: DraftTree, out: torch.Tensor) -> list[int]:
        """The tokens a decoding sequence's rows settle: the next one sampled, or its drafted tree verified (the
        accepted branch and the model's own token after it, the cache keeping that branch)."""
        history = torch.tensor(seq.history)
        if len(tree) == 1:
            return [seq.sampler(out, history)]
        root = len(seq.history) - 1
        branch, token = verify(out, tree, seq.sampler, history)
        seq.kv.keep_branch(root, branch, tree.branch_tokens(branch))
        for record in (seq.acceptance, self.acceptance):
            record.observe(verdicts(tree, branch))
        self.metrics.drafted_tokens += len(tree) - 1
        self.metrics.accepted_tokens += len(branch)
        return tree.branch_tokens(branch) + [token]

    def _advance(self, slot: int, seq: _Sequence, token: int) -> bool:
        """Append the sequence's next token, emit its text, and finish the sequence if it is done (True)."""
        request = seq.request
        seq.history.append(token)
        seq.generated += 1
        self.metrics.generated_tokens += 1
        finish, hit = None, False
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
        if finish is not None and not hit:
            # Release what was held back (as `LLM.generate` does): an unfinished character, a stop string that
            # never completed.
            piece, _ = seq.stops.push(seq.detok.finish())
            if rest := piece + seq.stops.flush():
                request.emit("text", rest)
        if finish is None:
            return False
        self.answer_tokens = seq.generated if self.answer_tokens is None else (
            0.75 * self.answer_tokens + 0.25 * seq.generated)
        prompt = len(request.prompt_ids)
        request.emit("done", finish, {"prompt_tokens": prompt, "completion_tokens": seq.generated,
                                      "total_tokens": prompt + seq.generated})
        self._release(slot)
        return True
