"""The HTTP side of `ntio serve`: an OpenAI-compatible API (FastAPI, run by uvicorn) over the scheduler.

Endpoints: GET /v1/models and /v1/models/ID, POST /v1/chat/completions and /v1/completions (streamed as server-sent
events ending in `data: [DONE]`, or whole), GET /health, GET /metrics (Prometheus text). Every error is OpenAI's
shape with a one-line message: 400 (bad JSON, a parameter of the wrong type or out of range, prompt + max_tokens
beyond the context), 401 (with --api-key: a missing or wrong bearer token), 404 (an unknown model or route), 413 (a
body over the limit), 429 (`parallel` requests active and `max_queue` waiting). A client that disconnects frees its
slot at the next step. SIGTERM (uvicorn's graceful shutdown) stops taking connections, lets the requests in flight
finish, then stops the engine thread; the process exits 0. With `cors_origins`, web pages of those origins may call
the API from a browser (CORS; preflights are answered before the key is checked, as browsers send them without it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response as HTTPResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ntio.serving.protocol import APIError, Parsed, Response, parse
from ntio.serving.scheduler import Request, Scheduler

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused (413) before it is parsed
# How often a waiting non-streamed request looks whether its client is still there.
DISCONNECT_POLL_S = 0.5


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def create_app(llm, scheduler: Scheduler, model_id: str, api_key: str | None = None,
               max_body: int = MAX_BODY_BYTES, cors_origins: tuple[str, ...] = ()) -> FastAPI:
    """The FastAPI app serving `llm` as `model_id` through `scheduler` (started and drained by the app's lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        try:
            yield
        finally:  # after uvicorn has let the requests in flight finish
            await asyncio.to_thread(scheduler.shutdown)

    app = FastAPI(title="ntio", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: HTTPRequest, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return _error(APIError(e.status_code, str(e.detail), kind=kind))

    if api_key is not None:
        app.add_middleware(_BearerKey, key=api_key)
    if cors_origins:  # added last: the outermost, so that it answers a preflight before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(_prometheus(scheduler), media_type="text/plain; version=0.0.4")

    card = {"id": model_id, "object": "model", "created": 0, "owned_by": "ntio"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> HTTPResponse:
        if name != model_id:
            return _error(APIError(404, f"The model '{name}' does not exist (this server serves '{model_id}')",
                                   param="model", code="model_not_found"))
        return JSONResponse(card)

    async def complete(http: HTTPRequest, chat: bool) -> HTTPResponse:
        try:
            body = await _json_body(http, max_body)
            parsed = parse(body, llm, chat=chat, model_id=model_id, context=scheduler.slot_context)
        except APIError as e:
            return _error(e)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        text: list[str] = []  # a whole answer's pieces, gathered on the engine thread

        def emit(*event) -> None:
            if event[0] == "text" and not parsed.stream:
                text.append(event[1])  # no wake-up of the event loop per token: it only needs the end
            else:
                loop.call_soon_threadsafe(events.put_nowait, event)

        request = Request(parsed.prompt_ids, parsed.max_tokens, parsed.sampling, parsed.stop, emit)
        if not scheduler.submit(request):
            return _error(APIError(429, f"the server is busy (it answers {len(scheduler.slots)} requests at once and "
                                        f"queues {scheduler.max_queue}); retry later", kind="rate_limit_error",
                                   code="server_busy"))
        response = Response(parsed, model_id)
        if parsed.stream:
            return StreamingResponse(_stream(events, request.cancelled, parsed, response),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(http, events, text, request.cancelled, response)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest) -> HTTPResponse:
        return await complete(http, chat=True)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest) -> HTTPResponse:
        return await complete(http, chat=False)

    return app


class _BearerKey:
    """ASGI middleware: a /v1/ request without `Authorization: Bearer KEY` gets 401. Plain ASGI, not Starlette's
    `BaseHTTPMiddleware`, which relays every chunk of a streamed answer through a task and a memory stream of its
    own: 0.14-0.30 ms more of the event loop's CPU time per streamed token (measured), on the cores the engine
    computes on."""

    def __init__(self, app, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode("ascii")  # `ntio serve` takes ASCII keys only

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):  # in constant time
                e = APIError(401, "a valid API key is required (Authorization: Bearer KEY)",
                             kind="authentication_error", code="invalid_api_key")
                await _error(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _json_body(http: HTTPRequest, max_body: int) -> Any:
    """The request's JSON, read no further than `max_body` bytes."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body:
        raise APIError(413, f"the request body is {declared} bytes; at most {max_body} are accepted")
    raw = bytearray()
    async for chunk in http.stream():
        raw += chunk
        if len(raw) > max_body:
            raise APIError(413, f"the request body is over {max_body} bytes")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON (nested too deeply)") from None


async def _whole(http: HTTPRequest, events: asyncio.Queue, text: list[str], cancelled: threading.Event,
                 response: Response) -> HTTPResponse:
    """Wait for the end of the answer whose pieces the engine thread gathers in `text`; a client gone meanwhile
    cancels the request."""
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await http.is_disconnected():
                    cancelled.set()
                    return HTTPResponse(status_code=499)
                continue
            if event[0] == "done":
                return JSONResponse(response.whole("".join(text), event[1], event[2]))
            else:
                return _error(APIError(500, f"the model failed: {event[1]}", kind="server_error"))
    finally:
        cancelled.set()  # a no-op once done; frees the slot if this handler was cancelled


async def _stream(events: asyncio.Queue, cancelled: threading.Event, parsed: Parsed,
                  response: Response) -> AsyncIterator[str]:
    """Server-sent events: the text as it is generated, the finish reason, the usage chunk if asked, [DONE]. A
    client that disconnects stops this generator, which cancels the request."""
    usage = parsed.include_usage
    try:
        if parsed.chat:
            yield _sse(response.chunk("", None, usage))  # the role first, as OpenAI does
        while True:
            event = await events.get()
            if event[0] == "text":
                yield _sse(response.chunk(event[1], None, usage))
            elif event[0] == "done":
                yield _sse(response.chunk(None if parsed.chat else "", event[1], usage))
                if usage:
                    yield _sse(response.usage_chunk(event[2]))
                break
            else:
                yield _sse(APIError(500, f"the model failed: {event[1]}", kind="server_error").body())
                break
        yield "data: [DONE]\n\n"
    finally:
        cancelled.set()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _prometheus(scheduler: Scheduler) -> str:
    m = scheduler.metrics
    rows = [
        ("ntio_requests_total", "counter", "Requests accepted", m.requests),
        ("ntio_requests_refused_total", "counter", "Requests refused because the server was full", m.refused),
        ("ntio_prompt_tokens_total", "counter", "Prompt tokens of accepted requests", m.prompt_tokens),
        ("ntio_generation_tokens_total", "counter", "Tokens generated", m.generated_tokens),
        ("ntio_steps_total", "counter", "Batched passes over the model", m.steps),
        ("ntio_draft_tokens_total", "counter", "Drafted tokens verified in passes (--lookup, --draft)",
         m.drafted_tokens),
        ("ntio_draft_tokens_accepted_total", "counter", "Drafted tokens the model agreed with", m.accepted_tokens),
        ("ntio_decode_tokens_per_second", "gauge", "Tokens decoded per second of decoding passes, all requests",
         m.decode_tok_s),
        ("ntio_bytes_read_per_token", "gauge", "Bytes read from disk per decoded token (shared by a pass's requests)",
         m.bytes_read_per_token),
        ("ntio_requests_active", "gauge", "Requests being answered", m.active),
        ("ntio_requests_queued", "gauge", "Requests waiting for a slot", m.queued),
    ]
    return "".join(f"# HELP {name} {text}\n# TYPE {name} {kind}\n{name} {value}\n" for name, kind, text, value in rows)
