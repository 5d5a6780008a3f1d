"""Fine-tuning a local HF model: shards read from the checkpoint equal slices of the full tensors."""
from __future__ import annotations

import pytest

STEPS = 2


def test_sharded_checkpoint_is_read_through_its_index(hf_checkpoints):
    from hybridtrain.models.weights import SafetensorsWeights

    folder = hf_checkpoints["llama"]
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    weights = SafetensorsWeights(folder)
    assert "model.layers.3.self_attn.k_proj.weight" in weights
    assert tuple(weights.get("model.layers.3.self_attn.k_proj.weight").shape) == (48, 96)  # 6 KV heads x 8


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("rank", [0, 1])
def test_shards_read_from_the_checkpoint_equal_slices_of_the_full_block(family, rank, hf_checkpoints):
    """Pretrained blocks read only this rank's slices (safetensors get_slice); they must equal
    what slicing the fully loaded block gives."""
    import torch
    from transformers import AutoConfig

    from hybridtrain.models.build import ModelBuilder, shard_block
    from hybridtrain.models.hf_model import meta_model
    from hybridtrain.models.families import get_family
    from hybridtrain.models.weights import SafetensorsWeights
    from hybridtrain.parallel.context import TPContext

    folder, fam = hf_checkpoints[family], get_family(family)
    cfg = AutoConfig.from_pretrained(str(folder))
    cfg._attn_implementation = "sdpa"
    tp = TPContext(None, rank, 2)
    read = ModelBuilder(fam, cfg, meta_model(cfg), 1, tp, 8000, weights=SafetensorsWeights(folder)).block(2)
    full = ModelBuilder(fam, cfg, meta_model(cfg), 1, TPContext(), 8000,
                        weights=SafetensorsWeights(folder)).materialize(f"{fam.blocks}.2")
    shard_block(full, fam, cfg, tp)
    got, want = read.state_dict(), full.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("tp_size", [2, 3])
def test_vocab_rows_read_from_the_checkpoint_equal_the_padded_slices(family, tp_size, hf_checkpoints):
    """Embedding and head rows are read per rank; padded rows are zero; tied heads use the embedding."""
    import torch
    from transformers import AutoConfig

    from hybridtrain.models.build import ModelBuilder
    from hybridtrain.models.hf_model import meta_model
    from hybridtrain.models.families import get_family, padded_vocab
    from hybridtrain.models.weights import SafetensorsWeights
    from hybridtrain.parallel.context import TPContext

    folder, fam = hf_checkpoints[family], get_family(family)
    cfg = AutoConfig.from_pretrained(str(folder))
    weights = SafetensorsWeights(folder)
    vp = padded_vocab(cfg.vocab_size, tp_size)
    for name in (fam.embed, fam.head):
        src = f"{name}.weight" if f"{name}.weight" in weights else f"{fam.embed}.weight"
        full = torch.cat([weights.get(src), torch.zeros(vp - cfg.vocab_size, weights.get(src).shape[1])])
        for rank in range(tp_size):
            builder = ModelBuilder(fam, cfg, meta_model(cfg), 1, TPContext(None, rank, tp_size), vp, weights=weights)
            shard, start = builder.vocab_shard(name)
            assert start == rank * vp // tp_size
            assert torch.equal(shard, full[start:start + vp // tp_size])
