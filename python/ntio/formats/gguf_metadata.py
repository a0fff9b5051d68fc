"""Copying a GGUF's metadata into a new file (gguf-py's reader and writer): what tests, benches and converters that
write a variant of a model (another tensor type, another architecture name, a new model with a real model's
tokenizer) share."""

from __future__ import annotations

from collections.abc import Callable

import gguf


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, *,
                  keep: Callable[[str], bool] = lambda key: True, rename: Callable[[str], str] = lambda key: key
                  ) -> None:
    """Every key-value pair of `reader` that `keep(key)` accepts, as `rename(key)`, into `writer`, with its type.
    The reader's own bookkeeping (GGUF.*) and general.architecture (the writer's own) are never copied."""
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or not keep(key):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(rename(key), field.contents())
        else:
            writer.add_key_value(rename(key), field.contents(), vtype)
