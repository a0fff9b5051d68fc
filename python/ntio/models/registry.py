"""The supported families by GGUF `general.architecture`."""

from __future__ import annotations

from ntio.models.bitnet import BITNET
from ntio.models.family import Family
from ntio.models.llama import LLAMA
from ntio.models.qwen2 import QWEN2

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN2, BITNET)}
