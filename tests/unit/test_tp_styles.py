"""The tensor-parallel styles (``parallel/tensor.py``) agree with themselves: what a rank keeps at
initialisation, the checkpoint split and the LoRA counts are one definition each."""
from __future__ import annotations

import math

import pytest
import torch.nn as nn

from hybridtrain.models.families import TPRule
from hybridtrain.parallel.slicing import Split
from hybridtrain.parallel.tensor import STYLES, hf_dim, style_of


def test_a_rule_names_its_style_object():
    assert TPRule("row").tp_style is STYLES["row"] is style_of("row")
    assert sorted(STYLES) == ["channels", "column", "experts", "experts_interleaved", "grad_sum", "grad_sum_linear", "heads", "norm",
                              "replicated", "row"]
    with pytest.raises(ValueError, match="unknown tensor-parallel style 'rowwise'; use one of"):
        style_of("rowwise")


@pytest.mark.parametrize("conv1d", [False, True])
def test_keep_follows_the_checkpoint_split(conv1d):
    linear = nn.Linear(8, 12)  # weight [12, 8] (read as HF [in, out] when conv1d)
    for name in ("column", "row"):
        style = STYLES[name]
        keep = style.keep(linear, conv1d, 1, rank=1, size=2)
        for leaf, param in linear.named_parameters():
            split = style.split(leaf, conv1d)
            if split.dim is None:
                assert leaf not in keep
            else:
                dim = hf_dim(split)
                assert keep[leaf] == (dim, [(param.shape[dim] // 2, param.shape[dim])])
    assert STYLES["grad_sum"].keep(linear, conv1d, 1, 0, 2) == {}


def test_sharded_leaves():
    assert [s.sharded("weight") for s in STYLES.values()] == [True, True, True, False, False, False, False, False, True, True]
    assert [s.sharded("bias") for s in STYLES.values()] == [True, False, True, False, False, False, False, False, True,
                                                            True]
    assert [s.reads_shards() for s in STYLES.values()] == [True, True, True, False, False, False, True, True, True, True]
    assert STYLES["replicated"].lora and STYLES["replicated"].lora_numel(4, 8, 1, tp=2) == (32, 4)  # A, B whole
    assert STYLES["grad_sum_linear"].lora and STYLES["grad_sum_linear"].lora_numel(4, 8, 2, tp=2) == (32, 8)
    assert not STYLES["grad_sum"].lora  # a norm: no adapter
    assert STYLES["experts"].sharded("gate_up_proj") and STYLES["experts"].sharded("down_proj")
    interleaved = STYLES["experts_interleaved"]  # gpt-oss: every leaf per expert, all but the down bias split over tp
    assert all(interleaved.sharded(leaf) for leaf in ("gate_up_proj", "gate_up_proj_bias", "down_proj"))
    assert not interleaved.sharded("down_proj_bias") and interleaved.split("down_proj_bias").experts
    assert STYLES["heads"].sharded("sinks")


def test_experts_keep_gate_and_up_halves_and_down_columns():
    """The 3-D experts: ``gate_up_proj [E, 2I, H]`` keeps rank r's slice of gate and of up (dim 1),
    ``down_proj [E, H, I]`` rank r's columns (dim 2), every expert alike."""
    import torch

    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(torch.zeros(4, 2 * 8, 6))  # E = 4, I = 8, H = 6
    experts.down_proj = nn.Parameter(torch.zeros(4, 6, 8))
    keep = STYLES["experts"].keep(experts, False, 1, rank=1, size=2)
    assert keep == {"gate_up_proj": (1, [(4, 8), (12, 16)]), "down_proj": (2, [(4, 8)])}


def test_lora_counts_match_the_lora_splits():
    r, n_in, n_out, tp = 4, 16, 24, 2
    for name in ("column", "row"):
        style = STYLES[name]
        local = []
        for shape, split in zip(((r, n_in), (n_out, r)), style.lora_splits()):
            shape = list(shape)
            if split.dim is not None:
                shape[split.dim] //= tp
            local.append(math.prod(shape))
        assert list(style.lora_numel(r, n_in, n_out, tp)) == local
    assert STYLES["column"].lora_splits(3) == (Split(), Split(dim=0, fused=3))
    with pytest.raises(ValueError, match="carries no LoRA adapter"):
        STYLES["norm"].lora_splits()
