"""The Qwen2 family (`qwen2`: Qwen2, Qwen2.5, Qwen2.5-Coder): Llama's block plus q/k/v biases, with NeoX-style
RoPE (rotating feature i with i + d/2, as llama.cpp's LLAMA_ROPE_TYPE_NEOX). Its GGUFs carry the `qwen2`
pre-tokenizer and a ChatML template (ntio.text)."""

from __future__ import annotations

from ntio.models.family import BlockTensor, Family
from ntio.models.llama import DENSE_TENSORS

QKV_BIASES = (
    BlockTensor("attn_q.bias", lambda c: (c.q_width,), matrix=False),
    BlockTensor("attn_k.bias", lambda c: (c.kv_width,), matrix=False),
    BlockTensor("attn_v.bias", lambda c: (c.kv_width,), matrix=False),
)
QWEN2 = Family(name="qwen2", tensors=DENSE_TENSORS + QKV_BIASES, rope="neox")
