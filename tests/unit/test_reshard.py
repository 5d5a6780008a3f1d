"""Resharding reads only a rank's slice of a saved tensor: ``checkpoint.reshard.read_local``
equals slicing the whole tensor (``from_hf``) for every kind of split, TP size and rank."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from hybridtrain.checkpoint.reshard import from_hf, read_local
from hybridtrain.models.weights import SafetensorsWeights
from hybridtrain.parallel.context import TPContext
from hybridtrain.parallel.slicing import Split

VOCAB, PADDED = 10, 12  # 10 real rows, padded to a multiple of tp (2, 3, 4, 6 all divide 12)

CASES = {
    "replicated": (torch.randn(6), Split()),
    "column": (torch.randn(12, 5), Split(dim=0)),
    "row": (torch.randn(5, 12), Split(dim=1)),
    "conv1d_fused_qkv": (torch.randn(5, 36), Split(dim=0, fused=3, transpose=True)),  # GPT-2 c_attn [in, 3 x out]
    "conv1d_row": (torch.randn(12, 5), Split(dim=1, transpose=True)),  # GPT-2 c_proj [in, out]
    "vocab": (torch.randn(VOCAB, 4), Split(dim=0, vocab=VOCAB)),  # embedding / head rows
}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moments")
    save_file({name: t.contiguous() for name, (t, _) in CASES.items()}, str(folder / "optim-stage000.safetensors"))
    return SafetensorsWeights(folder)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("size", [1, 2, 3])
def test_sliced_read_equals_slicing_the_whole_tensor(weights, name, size):
    full, split = CASES[name]
    for rank in range(size):
        tp = TPContext(rank=rank, size=size)
        want = from_hf(full, split, tp, PADDED)
        got = read_local(weights, name, split, tp, PADDED)
        assert got.shape == want.shape and torch.equal(got, want), (name, size, rank)
    if split.vocab is not None and size > 1:  # the last rank's padding rows are zeros
        assert torch.count_nonzero(read_local(weights, name, split, TPContext(rank=size - 1, size=size), PADDED)[-2:]) == 0


E, I, H = 4, 6, 3  # experts, one expert's width, hidden size
EXPERT_CASES = {  # transformers' fused 3-D experts: dim 0 over ep, the width over tp (gate | up each on its own)
    "experts.gate_up_proj": (torch.randn(E, 2 * I, H), Split(dim=1, fused=2, experts=True)),
    "experts.down_proj": (torch.randn(E, H, I), Split(dim=2, experts=True)),
}


@pytest.fixture(scope="module")
def expert_weights(tmp_path_factory):
    folder = tmp_path_factory.mktemp("experts")
    tensors = {name: t.contiguous() for name, (t, _) in EXPERT_CASES.items()}
    save_file(tensors, str(folder / "optim-stage000.safetensors"))
    return SafetensorsWeights(folder)


@pytest.mark.parametrize("name", list(EXPERT_CASES))
@pytest.mark.parametrize("tp_size,ep_size", [(1, 2), (2, 2), (3, 4), (1, 1)])
def test_expert_read_gives_each_ep_rank_its_experts(expert_weights, name, tp_size, ep_size):
    """An expert-parallel rank reads experts ``[r E / ep, (r + 1) E / ep)`` of its TP slice; the ep ranks' reads
    joined along dim 0 (what the save's gather does) are the TP slice of all E experts."""
    from hybridtrain.parallel.context import EPContext

    full, split = EXPERT_CASES[name]
    for tp_rank in range(tp_size):
        tp = TPContext(rank=tp_rank, size=tp_size)
        want = from_hf(full, split, tp, PADDED)  # [E, ...] this TP rank's width
        parts = [read_local(expert_weights, name, split, tp, PADDED, EPContext(rank=r, size=ep_size))
                 for r in range(ep_size)]
        assert all(p.shape[0] == E // ep_size for p in parts)
        assert torch.equal(torch.cat(parts), want), (name, tp_size, ep_size, tp_rank)


def test_hf_shape_joins_the_experts_over_ep_and_the_width_over_tp():
    from hybridtrain.checkpoint.hf_state import hf_shape

    local = torch.nn.Parameter(torch.zeros(E // 2, 2 * I // 3, H))  # ep = 2, tp = 3
    assert hf_shape(local, EXPERT_CASES["experts.gate_up_proj"][1], 3, 2) == (E, 2 * I, H)
    assert hf_shape(local, Split(dim=1, fused=2), 3, 2) == (E // 2, 2 * I, H)  # not experts: ep does not apply


@pytest.mark.parametrize("saved,now_ep,through", [
    ({"dp": 2, "tp": 1}, 1, False),  # the same plan: DeepSpeed's ds/
    ({"dp": 2, "tp": 1, "ep": 2}, 2, True),  # the same plan at ep = 2: ds/ holds data rank 0's experts only
    ({"dp": 2, "tp": 1, "ep": 2}, 1, True),  # ep 2 -> 1
    ({"dp": 2, "tp": 1}, 2, True),  # ep 1 -> 2
])
def test_every_expert_parallel_resume_goes_through_hf(saved, now_ep, through):
    from types import SimpleNamespace

    from hybridtrain.worker import through_hf

    layout = {"dp": 2, "tp": 1, **({"ep": now_ep} if now_ep > 1 else {})}
    plan = SimpleNamespace(layout=lambda: layout, padded_vocab_size=PADDED, dims=SimpleNamespace(ep=now_ep))
    assert through_hf(saved, plan, PADDED) is through
    assert through_hf(saved, plan, PADDED + 2)  # another vocabulary padding: always


@pytest.mark.parametrize("leaf,dim,fused", [("gate_up_proj", 1, 2), ("down_proj", 2, 1)])
def test_each_ep_rank_reads_only_its_experts_from_per_expert_and_fused_tensors(tmp_path, leaf, dim, fused):
    """A ``save_pretrained`` folder (per-expert 2-D tensors) and a fused one (hybridtrain's ``hf/``): the ep ranks'
    reads (``experts=(rank, ep)``) joined along dim 0 are the TP slice of all experts."""
    from helpers.moe import make_moe_checkpoint
    from hybridtrain.models.weights import read_experts_shard

    folder = make_moe_checkpoint(tmp_path / "twin", "qwen3_moe")
    name = f"model.layers.1.mlp.experts.{leaf}"
    per_expert = SafetensorsWeights(folder)
    whole = read_experts_shard(per_expert, name, dim, fused, 1, 2, "qwen3_moe")  # tp rank 1 of 2, every expert
    save_file({name: whole.contiguous()}, str(tmp_path / "fused.safetensors"))  # a fused tensor (of the TP slice)
    fused_file = SafetensorsWeights(tmp_path)
    for ep in (2, 4):
        parts = [read_experts_shard(per_expert, name, dim, fused, 1, 2, "qwen3_moe", (r, ep)) for r in range(ep)]
        assert torch.equal(torch.cat(parts), whole), (leaf, ep)
        parts = [read_experts_shard(fused_file, name, dim, fused, 0, 1, "qwen3_moe", (r, ep)) for r in range(ep)]
        assert torch.equal(torch.cat(parts), whole), (leaf, ep)
