"""The Llama family (`llama`: Llama 1/2/3, SmolLM, TinyLlama, Mistral-as-llama): pre-norm blocks, grouped-query
attention with interleaved RoPE (llama.cpp's converter permutes q/k rows for it), SwiGLU, no biases."""

from __future__ import annotations

from ntio.models.family import BlockTensor, Family

# The tensors every family here shares: two norms, q/k/v/o, gate/up/down.
DENSE_TENSORS = (
    BlockTensor("attn_norm", lambda c: (c.d_model,), matrix=False),
    BlockTensor("attn_q", lambda c: (c.q_width, c.d_model), matrix=True),
    BlockTensor("attn_k", lambda c: (c.kv_width, c.d_model), matrix=True),
    BlockTensor("attn_v", lambda c: (c.kv_width, c.d_model), matrix=True),
    BlockTensor("attn_output", lambda c: (c.d_model, c.q_width), matrix=True),
    BlockTensor("ffn_norm", lambda c: (c.d_model,), matrix=False),
    BlockTensor("ffn_gate", lambda c: (c.d_ff, c.d_model), matrix=True),
    BlockTensor("ffn_up", lambda c: (c.d_ff, c.d_model), matrix=True),
    BlockTensor("ffn_down", lambda c: (c.d_model, c.d_ff), matrix=True),
)

LLAMA = Family(name="llama", tensors=DENSE_TENSORS, rope="interleaved")

# GGUF part names of one Llama block, in file order (synthetic files are written this way).
BLOCK_TENSORS = LLAMA.parts
