"""ntio: run LLMs bigger than memory by streaming transformer layers from disk."""
from ntio._core import __version__
