"""What torch's sdpa keeps for the backward with multi-head latent attention's head widths (DeepSeek-V3: the
value head narrower than the query/key head), the fact ``hybridtrain.plan.memory.kernel_flags`` plans with: on a
CPU the math kernel, which keeps the attention matrix; on a GPU the memory-efficient kernel, which keeps none."""
from __future__ import annotations

import torch

HEADS, SEQ = 4, 256


def keeps_attention_matrix(device: str, qk_head: int, v_head: int, dtype=torch.float32) -> bool:
    """Whether causal sdpa on ``device`` saves a tensor with the ``[SEQ, SEQ]`` attention matrix's elements per head
    (queries and keys ``qk_head`` wide, values ``v_head``)."""
    shapes: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(t.shape)
        return t

    q, k = (torch.randn(1, HEADS, SEQ, qk_head, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(1, HEADS, SEQ, v_head, device=device, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.sum().backward()
    return any(s.numel() >= HEADS * SEQ * SEQ for s in shapes)
