"""The BitNet b1.58 family (`bitnet`, llama.cpp's architecture name; transformers' `BitNetForCausalLM`): ternary
weights (TQ1_0/TQ2_0, or any type) in a Llama-shaped block with two sub-norms, RMSNorms of the attention output before
its projection and of the gated activations before the down projection:

    h += Wo · attn_sub_norm(attention(rms_norm(h)))
    h += Wdown · ffn_sub_norm(act(Wgate · x) · (Wup · x)),  x = rms_norm(h)

with NeoX-style RoPE on unpermuted q/k rows (llama.cpp's converter leaves them as transformers has them), act the
file's `bitnet.hidden_activation` (squared ReLU for microsoft/bitnet-b1.58-2B-4T; SiLU, llama.cpp's default, when
absent), and optional per-tensor weight scales (`blk.N.attn_q.scale`, ...: each product times its scale).
"""

from __future__ import annotations

from ntio.models.family import BlockTensor, Family
from ntio.models.llama import DENSE_TENSORS

SUB_NORMS = (
    BlockTensor("attn_sub_norm", lambda c: (c.q_width,), matrix=False),
    BlockTensor("ffn_sub_norm", lambda c: (c.d_ff,), matrix=False),
)
# Block parts whose products a per-tensor `.scale` may multiply.
SCALED = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
SCALES = tuple(BlockTensor(f"{part}.scale", lambda c: (1,), matrix=False, optional=True) for part in SCALED)

BITNET = Family(name="bitnet", tensors=DENSE_TENSORS + SUB_NORMS + SCALES, rope="neox", gates=("silu", "relu2"))
