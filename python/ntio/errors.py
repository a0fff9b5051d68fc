"""User-facing errors.

Anything raised as an `NtioError` is the user's to fix (a bad file, a bad option, a prompt that does not fit):
the CLI prints its message as one line and exits non-zero, without a traceback. Its message must name the
file, tensor, key, offset or option at fault. Anything else escaping is a bug in ntio and keeps its traceback.
"""

from __future__ import annotations


class NtioError(Exception):
    """A problem with the user's input, reported as one line."""


class ModelFormatError(NtioError):
    """The model file is not what it claims to be: bad magic, truncated, missing metadata, bad shapes."""


class UnsupportedModelError(NtioError):
    """A well-formed model that ntio cannot run: another architecture, or a tensor type it does not decode."""


class ContextOverflowError(NtioError):
    """More tokens than the model's context (or the KV cache) holds."""
