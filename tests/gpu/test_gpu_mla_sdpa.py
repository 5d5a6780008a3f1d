"""GPU tier: the plan counts no attention matrix for DeepSeek-V3's sdpa on GPUs
(:func:`hybridtrain.plan.memory.kernel_flags` with ``gpus``): its value heads are narrower than its query/key heads,
which torch's CUDA memory-efficient kernel takes (fp32 and bf16), keeping only its log-sum-exp. On CPUs the same
shapes run the math kernel, which keeps the matrix (``tests/unit/test_activation_memory.py``)."""
from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_head_widths_keep_no_attention_matrix_on_the_gpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from helpers.sdpa_saved import keeps_attention_matrix

    assert not keeps_attention_matrix("cuda", 192 // 8, 128 // 8, dtype)  # DeepSeek-V3's 192 / 128, narrowed
    assert not keeps_attention_matrix("cuda", 192, 128, dtype)  # its real widths
