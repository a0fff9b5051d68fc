"""User-facing errors.

Anything raised as an `NtioError` is the user's to fix (a bad file, a bad option, a prompt that does not fit):
the CLI prints its message as one line and exits non-zero, without a traceback. Its message must name the
file, tensor, key, offset or option at fault. Anything else escaping is a bug in ntio and keeps its traceback.
"""

from __future__ import annotations

import operator
import numbers


class NtioError(Exception):
    """A problem with the user's input, reported as one line."""


class ModelFormatError(NtioError):
    """The model file is not what it claims to be: bad magic, truncated, missing metadata, bad shapes."""


class UnsupportedModelError(NtioError):
    """A well-formed model that ntio cannot run: another architecture, or a tensor type it does not decode."""


class ContextOverflowError(NtioError):
    """More tokens than the model's context (or the KV cache) holds."""


class ModelIOError(NtioError):
    """Reading the model file failed at the OS level (EIO, a vanished device): names file and offset."""


class OptionError(NtioError):
    """An option has a value ntio cannot use. `option` is the library's parameter name (`top_p`), which the message
    starts with; the CLI shows its flag (`--top-p`) instead."""

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"{option} {problem}")
        self.option = option
        self.problem = problem


def integer_option(option: str, value: object) -> int:
    """`value` as an int (numpy's integers too), or an OptionError naming `option`: not a float, bool or string."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise OptionError(option, f"must be an integer, got {value!r}") from None


def number_option(option: str, value: object) -> float:
    """`value` as a float (any real number but a bool), or an OptionError naming `option`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptionError(option, f"must be a number, got {value!r}")
    return float(value)


def read_error(e: OSError) -> NtioError:
    """The one translation of a failed read (ntio._core.ReadError, or any OSError) into ntio's error kinds.

    A read past the end of the file (no errno: the file is shorter than its header says, or was truncated while
    running) is a malformed file; an error the OS reported (errno set: EIO, ENOENT, ...) is an I/O error. Both keep
    the reader's one-line message, which names the file and the offset.
    """
    message = str(e) if getattr(e, "path", None) else f"{e.filename or 'model file'}: {e.strerror or e}"
    return ModelFormatError(message) if getattr(e, "errno", None) is None else ModelIOError(message)
