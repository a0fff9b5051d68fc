"""`ntio serve` against real clients: the server is started by the test on a free loopback port (SmolLM2), driven by
the official `openai` client (streamed and not) and by raw HTTP for the error cases, loaded by 32 concurrent clients,
and stopped with SIGTERM. Every greedy answer is compared with what `LLM.generate` gives the same prompt alone:
batched passes compute each sequence's rows as its own pass would (tests/test_serve.py asserts equality, and names
the first request that differs)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

import ntio

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MODEL_ID = "smollm2-135m"
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Write a haiku about disks.",
    "What is 2 + 2?",
    "Give me a word that rhymes with cat.",
    "Say hello in Spanish.",
    "What is a prime number?",
    "List two fruits.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(*args: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`ntio serve` on a free loopback port: (base URL, process) once /health answers; SIGTERM at the end."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ntio.cli", "serve", "-m", MODEL_ID, "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"ntio serve exited {proc.returncode}: {proc.stderr.read()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise AssertionError("ntio serve did not come up in 120 s")
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
            if proc.poll() is None:
                proc.kill()


@pytest.fixture(scope="module")
def server():
    """With prompt lookup, drafting wherever it finds a match (`--fixed-draft`: whether a row pays would follow
    this machine's timings): greedy answers must still be the solo answers of plain decoding."""
    with _server("--parallel", "4", "--ctx-size", "2048", "--max-queue", "256", "--lookup", "--fixed-draft") as (
            url, proc):
        yield url
    assert proc.returncode == 0, proc.stderr.read()


@pytest.fixture(scope="module")
def solo(smollm2_path):
    """What `LLM.generate` gives each question alone (greedy, chat template, 8 tokens): text and token count."""
    with ntio.load(smollm2_path, max_context=512) as m:
        return {q: m.generate(q, max_new_tokens=8, chat=True, temperature=0.0) for q in QUESTIONS}


def _client(url: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120, **kwargs)


def _ask(client: openai.OpenAI, question: str, **kwargs):
    return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": question}],
                                          **{"max_tokens": 8, "temperature": 0, **kwargs})


def test_models_and_health(server):
    assert [m.id for m in _client(server).models.list().data] == [MODEL_ID]
    assert _client(server).models.retrieve(MODEL_ID).id == MODEL_ID
    _error(httpx.get(f"{server}/v1/models/gpt-9"), 404, "model")
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_chat_completion_is_the_solo_answer(server, solo):
    q = QUESTIONS[0]
    r = _ask(_client(server), q)
    want = solo[q]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == want.n_generated_tokens and r.usage.prompt_tokens == want.n_prompt_tokens


def test_streamed_chat_with_usage(server, solo):
    q = QUESTIONS[1]
    chunks = list(_ask(_client(server), q, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == solo[q].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == solo[q].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == solo[q].n_generated_tokens


def test_completions_streamed_and_not(server, smollm2_path):
    with ntio.load(smollm2_path, max_context=512) as m:
        want = m.generate("The capital of France is", max_new_tokens=6, temperature=0.0)
    client = _client(server)
    r = client.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=6,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text


def test_stop_strings_and_seeded_sampling(server):
    client = _client(server)
    r = client.completions.create(model=MODEL_ID, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 7"])
    assert r.choices[0].finish_reason == "stop" and " 7" not in r.choices[0].text
    sampled = [client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                         top_p=0.9, seed=42).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]  # the same seed, the same draws


def _error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


def test_bad_requests_get_openai_errors(server):
    url = f"{server}/v1/chat/completions"
    ok = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    _error(httpx.post(url, content=b"{not json"), 400)
    _error(httpx.post(url, json=[1, 2]), 400)
    _error(httpx.post(url, json={**ok, "temperature": "hot"}), 400, "temperature")
    _error(httpx.post(url, json={**ok, "top_p": 2}), 400, "top_p")
    _error(httpx.post(url, json={**ok, "max_tokens": 0}), 400, "max_tokens")
    _error(httpx.post(url, json={**ok, "n": 2}), 400, "n")
    _error(httpx.post(url, json={**ok, "stop": ["a", "b", "c", "d", "e"]}), 400, "stop")
    _error(httpx.post(url, json={**ok, "messages": [{"role": "robot", "content": "hi"}]}), 400, "messages[0].role")
    _error(httpx.post(url, json={**ok, "model": "gpt-9"}), 404, "model")
    message = _error(httpx.post(url, json={**ok, "max_tokens": 600}), 400, "max_tokens")
    assert "600" in message and "512" in message  # the two numbers: 2048 tokens over 4 sequences
    _error(httpx.post(url, content=b" " * (5 << 20)), 413)
    _error(httpx.post(f"{server}/v1/completions", json={"model": MODEL_ID, "prompt": [10**9]}), 400, "prompt")
    _error(httpx.get(f"{server}/v1/nowhere"), 404)
    # Values that crashed the engine thread or a step's sampling before they were checked, or were ignored.
    _error(httpx.post(url, json={**ok, "seed": 2**64}), 400, "seed")
    _error(httpx.post(url, content=json.dumps({**ok, "temperature": float("nan")})), 400, "temperature")  # NaN
    _error(httpx.post(url, json={**ok, "logit_bias": {"42": -100}}), 400, "logit_bias")
    completions = f"{server}/v1/completions"
    for name, value in (("echo", True), ("suffix", "}"), ("best_of", 2)):
        _error(httpx.post(completions, json={"model": MODEL_ID, "prompt": "x", name: value}), 400, name)
    # Lone surrogates: JSON's escapes can write them; json.dumps escapes them so (httpx's json= cannot encode them).
    _error(httpx.post(completions, content=json.dumps({"model": MODEL_ID, "prompt": "\ud800"})), 400, "prompt")
    _error(httpx.post(url, content=json.dumps({**ok, "messages": [{"role": "user", "content": "a \udfff"}]})), 400,
           "messages")
    _error(httpx.post(url, content=b"[" * 100_000 + b"]" * 100_000), 400)
    long = {"model": MODEL_ID, "messages": [{"role": "user", "content": "word " * 600}]}  # over 512 tokens alone
    assert "no room" in _error(httpx.post(url, json=long), 400, "messages")
    assert _ask(_client(server), "hi").choices  # and it still serves


def test_tiny_temperatures_and_top_p_sample_the_greedy_token(server):
    """A temperature below GREEDY_BELOW decodes greedily (dividing float32 logits by it overflows), and a top_p
    that rounds to 0 keeps the likeliest token: the greedy answer, not a 500."""
    client = _client(server)
    kwargs = {"model": MODEL_ID, "prompt": "The capital of France is", "max_tokens": 6}
    greedy = client.completions.create(temperature=0, **kwargs).choices[0].text
    assert client.completions.create(temperature=1e-300, **kwargs).choices[0].text == greedy
    assert client.completions.create(temperature=1.0, top_p=1e-300, seed=3, **kwargs).choices[0].text == greedy


def test_a_stop_string_begun_when_the_model_ends_is_text(server, smollm2_path):
    """When the model ends its answer (a stop token) while the text's tail could still begin a stop string, that
    tail was held back; it is part of the answer, as `LLM.generate` gives it."""
    q = QUESTIONS[0]
    with ntio.load(smollm2_path, max_context=512) as m:
        want = m.generate(q, max_new_tokens=32, chat=True, temperature=0.0)
    assert want.finish_reason == "stop" and want.text.endswith("."), want  # the case: it ends on its own, on "."
    for stream in (False, True):
        r = _ask(_client(server), q, max_tokens=32, stop=[".X"], stream=stream)
        chunks = list(r) if stream else [r]
        text = "".join((c.choices[0].delta.content or "") if stream else c.choices[0].message.content
                       for c in chunks if c.choices)
        assert text == want.text


def test_32_clients_get_their_solo_answers(server, solo):
    """32 concurrent clients x 4 requests over 4 slots (the rest queue): every answer is the solo answer, nothing
    hangs, and no slot is left held."""
    answers: dict[tuple[int, int], str] = {}
    failures: list[str] = []

    def client_thread(c: int) -> None:
        client = _client(server)
        for i in range(4):
            q = QUESTIONS[(c + i) % len(QUESTIONS)]
            try:
                answers[(c, i)] = _ask(client, q).choices[0].message.content
            except Exception as e:  # noqa: BLE001 - reported below with the request
                failures.append(f"client {c} request {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client_thread, args=(c,)) for c in range(32)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, 300 - (time.monotonic() - t0)))
    assert not any(t.is_alive() for t in threads), "requests hung"
    assert not failures, failures[:3]
    differ = [(c, i) for (c, i), text in answers.items() if text != solo[QUESTIONS[(c + i) % len(QUESTIONS)]].text]
    assert not differ, f"{len(differ)} of 128 answers differ from the solo answer, first {differ[0]}"
    metrics = httpx.get(f"{server}/metrics").text
    assert "ntio_requests_active 0\n" in metrics and "ntio_requests_queued 0\n" in metrics
    counts = dict(line.split() for line in metrics.splitlines() if line.startswith("ntio_draft_tokens"))
    assert float(counts["ntio_draft_tokens_accepted_total"]) > 0, counts  # the lookup drafted, and was right


def test_full_server_refuses_and_a_disconnect_frees_the_slot():
    with _server("--parallel", "1", "--max-queue", "0", "--ctx-size", "512") as (url, _):
        body = {"model": MODEL_ID, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 400, "temperature": 0,
                "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=body) as long:
            assert long.status_code == 200
            lines = long.iter_lines()  # kept: a dropped line iterator closes the stream
            next(lines)  # the request holds the one slot
            _error(httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 2}), 429)
        # The long stream's client went away: its slot is free at the next step.
        deadline = time.monotonic() + 30
        while "ntio_requests_active 0\n" not in httpx.get(f"{url}/metrics").text:
            assert time.monotonic() < deadline, "the disconnected request kept its slot"
            time.sleep(0.1)
        assert httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 2}).status_code == 200


def test_api_key():
    origin = "http://localhost:3000"
    with _server("--parallel", "1", "--ctx-size", "512", "--api-key", "s3cret", "--cors-origin", origin) as (url, _):
        # A browser's preflight (sent without the key) is answered for the origin given, and only for it.
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        allowed = httpx.options(f"{url}/v1/chat/completions", headers={"Origin": origin, **preflight})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == origin
        other = httpx.options(f"{url}/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight})
        assert "access-control-allow-origin" not in other.headers
        with_origin = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer s3cret", "Origin": origin})
        assert with_origin.headers["access-control-allow-origin"] == origin
        _error(httpx.get(f"{url}/v1/models"), 401)
        _error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "stream": True}
        _error(httpx.post(f"{url}/v1/completions", json=body), 401)
        streamed = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        assert httpx.get(f"{url}/health").status_code == 200  # health and metrics need no key


def test_sigterm_finishes_the_request_in_flight_and_exits_0():
    with _server("--parallel", "1", "--ctx-size", "512") as (url, proc):
        body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        events = [first, *rest]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(60) == 0, proc.stderr.read()


def test_a_disk_error_fails_the_request_and_the_server_goes_on(smollm2_path):
    """Every layer on disk, and reads of layer 10 failing with EIO: each request gets a 500 in OpenAI's shape naming
    the file and offset, and the server keeps answering, with no slot held."""
    from ntio.formats.gguf_file import GGUFFile

    offset = GGUFFile(smollm2_path).tensors["blk.10.ffn_up.weight"].offset
    with _server("--parallel", "2", "--ctx-size", "512", "--tiers", "C",
                 env={"NTIO_INJECT_FAULTS": f"eio@{offset}"}) as (url, _):
        body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        for _ in range(2):
            message = _error(httpx.post(f"{url}/v1/completions", json=body, timeout=60), 500)
            assert "SmolLM2" in message and "offset" in message, message
        assert httpx.get(f"{url}/health").status_code == 200
        assert "ntio_requests_active 0\n" in httpx.get(f"{url}/metrics").text


REPEAT = ["the quick brown fox jumps over the lazy dog, and then the quick brown fox sleeps",
          "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b",
          "What is the capital of France?"]


def _scheduled(m, prompts: list[list[int]], sampling: list, prepare=None, **options) -> tuple[list[list], object]:
    """Each prompt's events from a Scheduler over `m` answering them all at once (24 tokens each), and its metrics.
    prepare(scheduler): called before it starts."""
    from ntio.serving.scheduler import Request, Scheduler

    scheduler = Scheduler(m, parallel=len(prompts), max_queue=0, slot_context=256, **options)
    if prepare is not None:
        prepare(scheduler)
    done = [threading.Event() for _ in prompts]
    events: list[list] = [[] for _ in prompts]

    def emitter(i: int):
        def emit(kind, *args):
            events[i].append((kind, *args))
            if kind != "text":
                done[i].set()
        return emit

    scheduler.start()
    try:
        for i, (p, params) in enumerate(zip(prompts, sampling)):
            assert scheduler.submit(Request(p, 24, params, (), emitter(i)))
        assert all(d.wait(120) for d in done), "a request hung"
    finally:
        scheduler.shutdown(60)
    return events, scheduler.metrics


def _assert_solo(m, events: list, ids: list[int]) -> None:
    kind, *rest = events[-1]
    assert kind == "done", events[-1]
    text = "".join(piece for k, piece in events[:-1])
    shown = ids[:-1] if ids[-1] in m.tokenizer.stop_ids else ids  # a stop token counts but is not text
    assert text == m.tokenizer.decode(shown), text
    assert rest[1]["completion_tokens"] == len(ids)


def test_a_request_whose_sampling_fails_fails_alone(smollm2_path):
    """Sampling parameters that slip past the checks (set here behind SamplingParams' back): a seed torch refuses
    fails its request at admission, a temperature that makes the probabilities NaN fails its request in the step
    it shares with the others; the engine thread goes on, and the greedy request beside them gets its solo answer."""
    from ntio.decoding.generation import SamplingParams

    unseedable, overflowing = SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0)
    object.__setattr__(unseedable, "seed", 2**70)
    object.__setattr__(overflowing, "temperature", 1e-300)
    with ntio.load(smollm2_path, max_context=768) as m:
        prompts = [m.encode_prompt(q, chat=True) for q in QUESTIONS[:3]]
        solo = m.generate(prompts[0], max_new_tokens=24, temperature=0.0).token_ids
        events, metrics = _scheduled(m, prompts, [SamplingParams(), unseedable, overflowing])
    assert events[1] == [("error", events[1][0][1])] and "Overflow" in events[1][0][1], events[1]
    assert events[2][-1][0] == "error", events[2]
    _assert_solo(m, events[0], solo)
    assert metrics.active == 0


def test_the_slots_are_the_engines_cache_and_generate_after_them_recomputes(smollm2_path):
    """The slots' K/V are views of the engine's own cache (the KV memory is allocated once, as the plan counts it),
    and the engine's cache forgets what it held when they take it over: `generate` after the scheduler wrote over its
    positions gives the answer it gave before, where a reused prefix would have read the slots' K/V."""
    from ntio.decoding.generation import SamplingParams

    with ntio.load(smollm2_path, max_context=512) as m:
        prompt = m.encode_prompt("What is the capital of France?", chat=True)
        before = m.generate(prompt, max_new_tokens=16, temperature=0.0).token_ids
        kv = m.engine.kv

        def shares_the_engines_cache(scheduler) -> None:
            for i, slot in enumerate(scheduler.slots):  # the first and second half of the engine's K and V
                assert slot.capacity == 256 and slot.k.is_contiguous() and slot.v.is_contiguous()
                assert slot.k.data_ptr() == kv.k.data_ptr() + i * kv.k.nbytes // 2
                assert slot.v.data_ptr() == kv.v.data_ptr() + i * kv.v.nbytes // 2

        others = [m.encode_prompt(f"Repeat exactly: {t}", chat=True) for t in REPEAT[:2]]
        events, _ = _scheduled(m, others, [SamplingParams()] * 2, prepare=shares_the_engines_cache)
        assert all(got[-1][0] == "done" for got in events)
        assert m.generate(prompt, max_new_tokens=16, temperature=0.0).token_ids == before


def test_lookup_drafts_are_verified_in_the_shared_pass(smollm2_path):
    """The scheduler itself with prompt lookup, 3 requests at once, drafts forced (priced, a resident SmolLM2's rows
    cost about what the tokens they may settle save, so whether they are drafted turns on timing noise): answers
    that copy their prompts get drafted tokens accepted (several tokens settled per pass), and every greedy answer
    is token for token what plain decoding gives the prompt alone."""
    from ntio.decoding.generation import SamplingParams
    from ntio.decoding.speculative import PromptLookup

    with ntio.load(smollm2_path, max_context=1024) as m:
        prompts = [m.encode_prompt(f"Repeat exactly: {t}", chat=True) for t in REPEAT]
        solo = [m.generate(p, max_new_tokens=24, temperature=0.0).token_ids for p in prompts]
        events, metrics = _scheduled(m, prompts, [SamplingParams()] * 3, lookup=PromptLookup(), fixed_draft=True)
    for got, ids in zip(events, solo):
        _assert_solo(m, got, ids)
    assert metrics.accepted_tokens >= 10, (metrics.drafted_tokens, metrics.accepted_tokens)
    # Without drafts a pass settles at most one token of a request: the longest answer alone would take more passes.
    assert metrics.steps < max(len(ids) for ids in solo), metrics.steps


def test_a_draft_model_drafts_for_every_request_in_batched_passes(smollm2_path):
    """A draft model (SmolLM2 drafting for itself: the same vocabulary, so every greedy draft is right; drafts forced,
    as such a draft costs what the target does and the sizing rule would rightly decline it) drafts for every
    decoding request in batched passes over its per-slot caches: greedy answers are the solo answers, drafted tokens
    are accepted, and a sampled request (its draws tested against the draft's distribution) still finishes."""
    from ntio.decoding.generation import SamplingParams

    with ntio.load(smollm2_path, max_context=1024, draft=smollm2_path) as m:
        prompts = [m.encode_prompt(t, chat=True) for t in REPEAT]
        solo = [m.generate(p, max_new_tokens=24, temperature=0.0, use_draft=False).token_ids for p in prompts[:2]]
        sampling = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.8)]
        schedulers = []
        events, metrics = _scheduled(m, prompts, sampling, prepare=schedulers.append, fixed_draft=True)
    for got, ids in zip(events, solo):
        _assert_solo(m, got, ids)
    assert events[2][-1][0] == "done"
    assert metrics.accepted_tokens >= 20, (metrics.drafted_tokens, metrics.accepted_tokens)
    assert metrics.steps < max(len(ids) for ids in solo), metrics.steps
    # A new request's acceptance record starts from the server's (here nearly every draft was right), not from 1/2.
    assert schedulers[0]._acceptance_record().rate(schedulers[0].draft_name) > 0.8


def test_draft_trees_keep_the_branch_the_model_accepts(smollm2_path):
    """Draft trees in the shared passes: SmolLM2 drafting for itself, with each chain's first token swapped for the
    draft's next choice, so that the right token is the extra leaf beside the chain. Every pass then accepts a leaf
    off the chain (the cache keeps that branch, not the chain's slots), and the greedy answers are the solo answers."""
    from ntio.decoding.generation import SamplingParams

    def swap_first_choice(scheduler) -> None:
        chains = scheduler._model_chains

        def swapped(seqs, depths, cached):
            drafts = chains(seqs, depths, cached)
            for draft in drafts:
                if draft.tokens:
                    (alternative, chance), *rest = draft.alternatives[0]
                    draft.alternatives[0] = [(draft.tokens[0], chance), *rest]
                    draft.tokens[0] = alternative
            return drafts
        scheduler._model_chains = swapped

    with ntio.load(smollm2_path, max_context=1024, draft=smollm2_path) as m:
        prompts = [m.encode_prompt(t, chat=True) for t in REPEAT[:2]]
        solo = [m.generate(p, max_new_tokens=24, temperature=0.0, use_draft=False).token_ids for p in prompts]
        events, metrics = _scheduled(m, prompts, [SamplingParams()] * 2, prepare=swap_first_choice, fixed_draft=True)
    for got, ids in zip(events, solo):
        _assert_solo(m, got, ids)
    assert metrics.accepted_tokens >= 16, (metrics.drafted_tokens, metrics.accepted_tokens)
    assert metrics.steps < max(len(ids) for ids in solo), metrics.steps


def test_a_self_draft_drafts_for_every_request_from_the_slots_own_caches(smollm2_path, calibration_file):
    """Self-speculation in the shared passes: SmolLM2's first 23 layers and the exit head after layer 22 draft for
    every decoding request in batched early exits over the slots' own caches (no catch-up: they hold those layers'
    K/V already), drafts forced: the greedy answers are the solo answers, and drafted tokens are accepted."""
    from ntio.decoding.generation import SamplingParams

    with ntio.load(smollm2_path, max_context=1024, self_draft=calibration_file, exit_layer=22) as m:
        prompts = [m.encode_prompt(t, chat=True) for t in REPEAT]
        solo = [m.generate(p, max_new_tokens=24, temperature=0.0, use_draft=False).token_ids for p in prompts]
        schedulers = []
        events, metrics = _scheduled(m, prompts, [SamplingParams()] * 3, prepare=schedulers.append, fixed_draft=True)
    for got, ids in zip(events, solo):
        _assert_solo(m, got, ids)
    assert schedulers[0].draft_name == "self" and schedulers[0].draft_row_s == 0.0  # never caught up
    assert metrics.accepted_tokens >= 10, (metrics.drafted_tokens, metrics.accepted_tokens)


def test_a_self_draft_priced_as_it_goes_answers_as_the_model_alone(smollm2_path, calibration_file):
    """Self-speculation with its drafts priced (the server's default, not forced): the first draft needs no timing
    of a catch-up (the slots' caches are the draft's, never behind; timing one on a scratch cache failed every
    request of `ntio serve --self-draft`), and the greedy answers are the solo answers."""
    from ntio.decoding.generation import SamplingParams

    with ntio.load(smollm2_path, max_context=1024, self_draft=calibration_file, exit_layer=22) as m:
        prompts = [m.encode_prompt(t, chat=True) for t in REPEAT[:2]]
        solo = [m.generate(p, max_new_tokens=24, temperature=0.0, use_draft=False).token_ids for p in prompts]
        events, metrics = _scheduled(m, prompts, [SamplingParams()] * 2)
    for got, ids in zip(events, solo):
        _assert_solo(m, got, ids)
    assert metrics.drafted_tokens > 0


def _sequence(history: list[int], acceptance):
    """What `Scheduler._drafts` reads of an active sequence: a decoding request with room for its drafts."""
    from types import SimpleNamespace

    return SimpleNamespace(acceptance=acceptance, request=SimpleNamespace(max_tokens=100), generated=0,
                           kv=SimpleNamespace(capacity=256), history=history,
                           draft_kv=SimpleNamespace(reusable_prefix=lambda tokens, limit: limit))


def test_a_lookup_match_is_taken_alone_only_while_it_pays(smollm2_path):
    """The server's rule for a sequence with both a lookup match and a drafting model, as `generate`'s: before
    lookup's acceptance is measured, a match of 3 tokens or more is taken alone and a shorter one is not; once it
    is measured, a long match that is rarely right leaves the sequence to the model (lookup alone on code: 1.19
    tokens a pass), and one that is nearly always right is taken alone even when the model's drafts are good."""
    from ntio.decoding.speculative import Acceptance, PromptLookup
    from ntio.serving.scheduler import Scheduler

    with ntio.load(smollm2_path, max_context=1024, draft=smollm2_path) as m:
        scheduler = Scheduler(m, parallel=1, max_queue=0, slot_context=256, lookup=PromptLookup())
        for rows, seconds in ((1, 0.010), (8, 0.016)):  # resident: a row costs ~1 ms beside a 10 ms pass
            for _ in range(3):
                scheduler.pass_cost.observe(rows, seconds)
        scheduler.draft_step_s = 0.004
        record = Acceptance()
        assert scheduler._lookup_alone(_sequence([], record), 3, [1, 2, 3], 8)
        assert not scheduler._lookup_alone(_sequence([], record), 2, [1, 2, 3], 8)
        record.counts = {"lookup": [1.0, 9.0], scheduler.draft_name: [8.0, 2.0]}
        assert not scheduler._lookup_alone(_sequence([], record), 3, [1, 2, 3], 8)
        record.counts["lookup"] = [19.0, 1.0]
        assert scheduler._lookup_alone(_sequence([], record), 1, [1, 2, 3, 4, 5, 6], 8)


def test_a_lookup_match_joins_the_models_tree_and_what_they_share_takes_no_row(smollm2_path):
    """A short lookup match beside the drafting model's chain joins its tree: where it drafted what the model did,
    it costs no row, so with 4 rows to spare after the model's 3-token chain, the lookup token that leaves the
    chain still finds its row."""
    from ntio.decoding.speculative import Acceptance, Draft, PromptLookup
    from ntio.serving.scheduler import Scheduler

    with ntio.load(smollm2_path, max_context=1024, draft=smollm2_path) as m:
        scheduler = Scheduler(m, parallel=1, max_queue=0, slot_context=256, lookup=PromptLookup(), draft_tokens=3,
                              fixed_draft=True)
        scheduler._model_chains = lambda seqs, depths, cached: [
            Draft([5, 6, 7][:d], scheduler.draft_name, None, [[] for _ in range(d)]) for d in depths]
        # The last token, 3, follows 3 5 6 9 earlier: lookup drafts 5 6 9 (a 1-token match: the model drafts too).
        (tree,) = scheduler._drafts([_sequence([3, 5, 6, 9, 4, 3], Acceptance())], spare=4)
    assert tree.tokens == [3, 5, 6, 7, 9] and tree.parents == [-1, 0, 1, 2, 2], (tree.tokens, tree.parents)


def test_decode_rows_beside_a_pass_full_of_prompt_rows_cost_their_compute(smollm2_path):
    """Timings as a streamed 1.5B model gives them: reads 0.3 s a pass, compute 0.1 s for 1 row and 2 s for 64. Two
    decoding sequences alone: their rows, with drafts of up to 2 tokens, cost the pass, which waits on its reads
    anyway, so the depth rule drafts both tokens. Beside 200 prompt rows that fill the pass, each row costs its compute (~30 ms), so a draft, accepted with
    chance < 1, lowers the step's tokens per second and the depth rule drafts nothing. Before its first draft, the
    drafting model's catch-up rows are priced (its steps are timed on its first chain)."""
    from types import SimpleNamespace

    from ntio.serving.scheduler import Scheduler

    with ntio.load(smollm2_path, max_context=1024, draft=smollm2_path) as m:
        scheduler = Scheduler(m, parallel=4, max_queue=0, slot_context=256)
        for _ in range(4):
            scheduler.pass_cost.observe(1, 0.35, 0.25, 0.3)
            scheduler.pass_cost.observe(64, 2.0, 0.0, 0.3)
        c_row = scheduler.pass_cost.compute_line[1]
        assert 0.029 < c_row < 0.031
        assert scheduler._decode_cost(2, 4) == scheduler.pass_cost.cost(4) == pytest.approx(0.3)
        limits = [(2, 0.9), (2, 0.9)]
        assert scheduler._model_depth(limits, 2) == 2  # rows free, draft passes free before they are timed
        prompt = SimpleNamespace(request=SimpleNamespace(prompt_ids=list(range(200))), fed=0, prefilling=True)
        scheduler._active[3] = prompt
        assert scheduler._decode_cost(2, 4) == pytest.approx(4 * c_row)
        assert scheduler._model_depth(limits, 2) == 0
        scheduler._time_draft()
        assert scheduler.draft_row_s > 0 and scheduler.draft_step_s == 0


def test_a_draft_catches_up_on_a_prompt_only_where_the_answer_wins_it_back(smollm2_path):
    """Before a request's first draft the draft model prefills its prompt while every request waits. Priced at 1 s a
    row against answers expected to be 2 tokens long, no catch-up pays and nothing is drafted; at 1 µs a row against
    answers as long as allowed, the first request to decode drafts a full chain. (Costs set before the start and
    kept: SmolLM2 drafts for itself, at 1 µs a draft pass, and a pass costs 1 s whatever its rows, so the depth rule
    alone would draft from the first step.)"""
    from ntio.decoding.generation import SamplingParams
    from ntio.decoding.speculative import PassCost

    class Flat(PassCost):
        compute_line = (1.0, 0.0)

        def observe(self, *timings) -> None:
            pass

        def cost(self, rows: int) -> float:
            return 1.0

    with ntio.load(smollm2_path, max_context=1024, draft=smollm2_path) as m:
        prompts = [m.encode_prompt(t, chat=True) for t in REPEAT[:2]]
        solo = [m.generate(p, max_new_tokens=24, temperature=0.0, use_draft=False).token_ids for p in prompts]

        def priced(row_s: float, answer_tokens: float | None):
            def prepare(scheduler) -> None:
                scheduler.draft_row_s, scheduler.answer_tokens = row_s, answer_tokens
                scheduler._draft_timed, scheduler.draft_step_s, scheduler.pass_cost = True, 1e-6, Flat()
            return _scheduled(m, prompts, [SamplingParams()] * 2, prepare=prepare)

        declined = priced(1.0, 2.0)
        paid = priced(1e-6, None)
    for events, metrics in (declined, paid):
        for got, ids in zip(events, solo):
            _assert_solo(m, got, ids)
    assert declined[1].drafted_tokens == 0, declined[1]
    assert paid[1].drafted_tokens >= 8 and paid[1].accepted_tokens > 0, paid[1]
