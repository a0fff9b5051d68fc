"""Chat templates: the Jinja template a GGUF stores under `tokenizer.chat_template`, rendered as transformers does.

Templates come from model files found on the internet, so they are untrusted code: they run in jinja2's immutable
sandbox. The environment mirrors transformers' `apply_chat_template` (trim_blocks, lstrip_blocks, loop controls,
a `tojson` that does not HTML-escape, `raise_exception`, `strftime_now`) so that a prompt rendered here is the
prompt the model's authors tested.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ntio.errors import NtioError


class _TemplateRaised(Exception):
    """A template called `raise_exception`: the conversation breaks one of the template's rules."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes `<`, `>`, `&` and `'`, which would change tool schemas in the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template. `source` names where it came from (the model file) in error messages."""

    def __init__(self, template: str, *, source: str, special_tokens: dict[str, str]) -> None:
        self.text = template
        self._source = source
        # bos_token, eos_token, unk_token, pad_token: the strings templates splice in ("" where the model has none).
        self._special_tokens = dict(special_tokens)
        try:
            self._compiled = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise NtioError(f"{source}: chat template does not parse (line {e.lineno}: {e.message})") from None

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        try:
            return self._compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self._special_tokens,
            )
        except _TemplateRaised as e:
            raise NtioError(f"{self._source}: the chat template rejects this conversation: {e}") from None
        except jinja2.TemplateError as e:
            raise NtioError(f"{self._source}: chat template failed to render: {e}") from None
