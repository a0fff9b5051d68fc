"""ntio: run LLMs bigger than memory by streaming transformer layers from disk.

    import ntio
    m = ntio.load()   # or ntio.load("model.gguf")
    print(m.generate("What is the capital of France?", chat=True).text)
"""

from ntio._core import __version__
from ntio.api import LLM, Completion, Perplexity, TokenStream, load
from ntio.errors import (
    ContextOverflowError, ModelFormatError, ModelIOError, NtioError, OptionError, UnsupportedModelError,
)

__all__ = [
    "LLM", "Completion", "Perplexity", "TokenStream", "load", "__version__",
    "NtioError", "ModelFormatError", "ModelIOError", "UnsupportedModelError", "ContextOverflowError", "OptionError",
]
