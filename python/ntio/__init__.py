"""ntio: run LLMs bigger than memory by streaming transformer layers from disk.

    import ntio
    m = ntio.load()   # or ntio.load("model.gguf")
    print(m.generate("What is the capital of France?", chat=True).text)
"""

from ntio._core import __version__
from ntio.errors import (
    ContextOverflowError, ModelFormatError, ModelIOError, NtioError, OptionError, UnsupportedModelError,
)

# The API imports torch (seconds): it is imported on first use, so that `ntio --version`, `--help` and the commands
# that need no model start at once.
_API = ("LLM", "Completion", "Perplexity", "TokenStream", "load")

__all__ = [
    *_API, "__version__",
    "NtioError", "ModelFormatError", "ModelIOError", "UnsupportedModelError", "ContextOverflowError", "OptionError",
]


def __getattr__(name: str):
    if name in _API:
        from ntio import api

        return getattr(api, name)
    raise AttributeError(f"module 'ntio' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
