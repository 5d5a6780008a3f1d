"""GPU tier: packed records through FlashAttention 2's variable-length kernels (``data.packing=documents``
with ``model.attn_implementation=flash_attention_2``) give each record the loss it has alone, as the
CPU tier shows for sdpa and eager (tests/unit/test_packing.py). Needs CUDA and the flash-attn package;
bf16 (FlashAttention runs no fp32), so the tolerance is bf16's. Never run yet (docs/gpu.md)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers.families import SEQ, VOCAB, make_family_checkpoint, one_process_model_of

IGNORE = -100


def _need_flash() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("needs the flash-attn package (pip install flash-attn)")


def _model(folder, attn: str):
    model = one_process_model_of(folder, f"model.attn_implementation={attn}")
    return model.to(device="cuda", dtype=torch.bfloat16).eval()


def _records(lengths, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        out.append((ids, ids[1:] + [IGNORE]))  # next-token labels, the last one carries none
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_flash_varlen_packed_rows_give_each_record_its_loss(family, tmp_path):
    _need_flash()
    from hybridtrain.data.sampler import DocumentSamples

    recs = _records([11, 7, 9, 20, 12, 3, 25], seed=4)
    samples = DocumentSamples.from_records(recs, seq_len=SEQ, seed=1)
    assert samples.num_samples < len(recs)  # really packed
    idx = torch.arange(samples.num_samples).numpy()
    x, y = (torch.from_numpy(a).cuda() for a in samples.rows(idx))
    pos = torch.from_numpy(samples.positions(idx)).cuda()
    weight = torch.tensor(1.0 / int((y != IGNORE).sum()), device="cuda")
    model = _model(make_family_checkpoint(tmp_path / family, family), "flash_attention_2")
    with torch.no_grad():
        packed = float(model((x, pos), (y, weight)))
        alone = sum(float(model((torch.tensor([i], device="cuda"), torch.arange(len(i), device="cuda")[None]),
                                (torch.tensor([l], device="cuda"), weight))) for i, l in recs)
    assert abs(packed - alone) <= 2e-2 * abs(alone), (packed, alone)  # bf16 rounding, not attention across records
