"""Model files: GGUF, the ntio store, and the extents their layers, tensors and row ranges occupy.

Imports nothing above it (no model graph, no runtime): a format module only parses, validates and plans reads.
"""
