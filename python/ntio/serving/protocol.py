"""OpenAI's request and response shapes for `/v1/chat/completions` and `/v1/completions`, without the web framework:
bodies (parsed JSON) in, a `Request` for the scheduler and response objects out, and `APIError` for everything a
client can get wrong, each naming the parameter at fault in OpenAI's error shape.

What is taken: messages (roles system, developer, user, assistant; content as a string or a list of text parts) or a
prompt (a string, one string in a list, or a list of token ids); max_tokens / max_completion_tokens (chat: the context
left when absent; completions: 16, as OpenAI), temperature (0-2), top_p, seed, stop (a string or up to 4), n = 1,
stream, stream_options.include_usage. Parameters ntio does not implement are refused when they would change the
result (presence or frequency penalties other than 0, logprobs, logit_bias, tools, a response format other than
text; on completions echo, suffix and best_of other than 1) and ignored otherwise (user, metadata, ...).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ntio.decoding.generation import SEEDS, SamplingParams
from ntio.errors import NtioError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    """A request that gets an error response: HTTP status and OpenAI's {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _bad(param: str, problem: str) -> APIError:
    return APIError(400, f"'{param}' {problem}", param=param)


def _number(body: dict, name: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(name, f"must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        raise _bad(name, f"must be in {'(' if low_open else '['}{low}, {high}], got {value}")
    return float(value)


def _integer(body: dict, name: str, minimum: int, maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise _bad(name, f"must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise _bad(name, f"must be at most {maximum}, got {value}")
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, f"must be a boolean, got {type(value).__name__}")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value) or len(value) > 4:
        raise _bad("stop", "must be a string or a list of at most 4 strings")
    return tuple(value)


def _refuse_unimplemented(body: dict) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value not in (None, 0, 0.0):
            raise _bad(name, "is not supported by this server (only 0)")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise _bad("logprobs", "is not supported by this server")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "is not supported by this server")
    if body.get("echo") not in (None, False):
        raise _bad("echo", "is not supported by this server")
    if body.get("suffix"):
        raise _bad("suffix", "is not supported by this server")
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of", f"must be 1 on this server, got {body.get('best_of')!r}")
    if body.get("tools"):
        raise _bad("tools", "is not supported by this server")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _bad("response_format", "is not supported by this server (only {\"type\": \"text\"})")
    if body.get("n") not in (None, 1):
        raise _bad("n", f"must be 1 on this server, got {body.get('n')!r}")


@dataclass(frozen=True)
class Parsed:
    """A valid request, ready for the scheduler."""

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def parse(body: Any, llm, *, chat: bool, model_id: str, context: int) -> Parsed:
    """The request `body` (parsed JSON) for a chat (messages) or a completion (prompt) against `llm`, whose
    sequences hold `context` positions. APIError for anything a client got wrong."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model", "is required (a string)")
    if model != model_id:
        raise APIError(404, f"The model '{model}' does not exist (this server serves '{model_id}')", param="model",
                       code="model_not_found")
    _refuse_unimplemented(body)
    prompt_ids = _chat_prompt(body, llm) if chat else _completion_prompt(body, llm)
    if not prompt_ids:
        raise _bad("messages" if chat else "prompt", "encodes to no tokens")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise _bad("stream_options", "must be an object, and only with stream")
    include_usage = bool(options and options.get("include_usage"))
    max_tokens = _integer(body, "max_completion_tokens", 1) if chat else None
    name = "max_completion_tokens" if max_tokens is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    left = context - len(prompt_ids)
    if left < 1:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens: no room to generate in the {context} tokens a "
                            f"sequence holds on this server", param="messages" if chat else "prompt",
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = max(left, 1) if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    if len(prompt_ids) + max_tokens > context:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens and '{name}' is {max_tokens}: together more "
                            f"than the {context} tokens a sequence holds on this server", param=name,
                       code="context_length_exceeded")
    try:
        sampling = SamplingParams(temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                                  top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                                  seed=_integer(body, "seed", SEEDS.start, SEEDS.stop - 1))
    except NtioError as e:  # not reached with the checks above; keeps the shape if SamplingParams tightens
        raise APIError(400, str(e)) from None
    return Parsed(chat, prompt_ids, max_tokens, sampling, _stop(body), stream, include_usage)


def _chat_prompt(body: dict, llm) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "must be an object")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "developer", "user", "assistant"):
            raise _bad(f"messages[{i}].role", f"must be system, developer, user or assistant, got {role!r}")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _bad(f"messages[{i}].content", "parts must be text parts ({\"type\": \"text\", \"text\": ...})")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "must be a string or a list of text parts")
        rendered.append({"role": "system" if role == "developer" else role, "content": content})
    try:
        return llm.encode_messages(rendered)
    except NtioError as e:  # no chat template in the model file, a template error
        raise APIError(400, str(e), param="messages") from None


def _completion_prompt(body: dict, llm) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) and not (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        raise _bad("prompt", "must be a string, a list of one string, or a non-empty list of token ids")
    try:
        return llm.encode_prompt(prompt)
    except NtioError as e:  # a token id outside the vocabulary, a lone surrogate
        raise _bad("prompt", str(e)) from None


class Response:
    """The response objects of one request (ids, timestamps, the model's name)."""

    def __init__(self, parsed: Parsed, model_id: str) -> None:
        self.chat = parsed.chat
        self.id = ("chatcmpl-" if parsed.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model_id
        self.object = "chat.completion" if parsed.chat else "text_completion"

    def _choice(self, text: str | None, finish: str | None, delta: bool) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        key = "delta" if delta else "message"
        content = {} if text is None else {"content": text}
        message = ({"role": "assistant", **content} if not delta or text == "" else content)
        return {"index": 0, key: message, "logprobs": None, "finish_reason": finish}

    def whole(self, text: str, finish: str, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [self._choice(text, finish, delta=False)], "usage": usage}

    def chunk(self, text: str | None, finish: str | None, with_usage: bool) -> dict[str, Any]:
        """A streamed chunk: `text` new text ("" opens a chat reply with its role; None: none), `finish` on the
        last; `usage` is null on every chunk when the client asked for the usage chunk."""
        out = {"id": self.id, "object": self.object + ("" if not self.chat else ".chunk"), "created": self.created,
               "model": self.model, "choices": [self._choice(text, finish, delta=True)]}
        if with_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object + ("" if not self.chat else ".chunk"), "created": self.created,
                "model": self.model, "choices": [], "usage": usage}
