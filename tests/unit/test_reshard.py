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
