"""The seeded initialisation made tile by tile (``hybridtrain/models/seeded_init.py``): a rank that fills only
the tiles of its shard gets exactly the values the single-process reference has there, for every family,
tp and rank; and HF's init (its distributions, its zeros and ones) is what fills the tiles."""
from __future__ import annotations

import pytest
import torch

from helpers.families import TINY, hf_config
from hybridtrain.models.build import ModelBuilder, shard_block
from hybridtrain.models.families import get_family, padded_vocab
from hybridtrain.models.hf_model import meta_model, reference_model, unit_names
from hybridtrain.models.seeded_init import TiledFills, cuts, fill_tiles, tile_seed
from hybridtrain.parallel.context import TPContext

SEED = 1234


@pytest.mark.parametrize("shape", [(1000,), (7, 5), (300, 130), (257, 3, 65), (130, 1000)])
def test_a_part_filled_alone_equals_the_whole_fill(shape):
    """Every tile a keep range overlaps is filled as in the whole fill; with ranges on either dimension,
    tensors whose sizes are not multiples of the tile edges, and vectors."""
    whole = torch.empty(shape)
    fill_tiles(whole, "normal_", (0.0, 0.02), {}, lambda i, j: tile_seed(7, "w", 0, i, j), None)
    assert 0.015 < float(whole.std()) < 0.025 and abs(float(whole.mean())) < 0.005
    for dim in range(2 if len(shape) == 2 else 1):  # beyond 2-D only rows are kept apart (columns: whole)
        n = whole.view(shape[0], -1).shape[dim] if len(shape) > 1 else shape[0]
        for lo, hi in [(0, n // 3), (n // 3, n // 2 + 1), (n - 1, n)]:
            part = torch.full(shape, float("nan"))
            fill_tiles(part, "normal_", (0.0, 0.02), {}, lambda i, j: tile_seed(7, "w", 0, i, j), (dim, [(lo, hi)]))
            grid, want = part.view(shape[0], -1), whole.view(shape[0], -1)
            if len(shape) == 1:
                grid, want = part.view(-1, 1), whole.view(-1, 1)
            got, ref = grid.narrow(dim, lo, hi - lo), want.narrow(dim, lo, hi - lo)
            assert torch.equal(got, ref), (shape, dim, lo, hi)
            edges = cuts(grid.shape[dim])  # the tiles along dim that miss [lo, hi) are never written
            skipped = sum(b - a for a, b in zip(edges, edges[1:]) if not (a < hi and lo < b))
            assert int(torch.isnan(grid).sum()) == skipped * grid.shape[1 - dim], (shape, dim, lo, hi)


def test_tiles_are_cut_by_the_shape_alone():
    assert cuts(10) == [0, 10] and cuts(64) == [0, 64] and cuts(4096) == [256 * i for i in range(17)]
    assert cuts(11008)[-1] == 11008 and len(cuts(11008)) == 17 and cuts(200) == [0, 66, 133, 200]


def _reference_shards(family, config, tp: TPContext, index: int = 0):
    """Block ``index`` of the reference model (every tile filled), copied and sharded as a rank shards a block."""
    import copy

    model = reference_model(config, family, SEED)
    block = copy.deepcopy(model.get_submodule(f"{family.blocks}.{index}"))
    shard_block(block, family, config, tp, variant=family.variant_of(config, index))
    embed = model.get_submodule(family.embed).weight.detach()
    return model, block, embed


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_every_rank_starts_from_the_reference_weights(model_type):
    """For every family, tp in {2, 4} and every rank: the block a rank builds filling only its tiles, and
    its rows of the padded embedding, equal the reference model's, sharded by the same rules."""
    family = get_family(model_type)
    config = hf_config(model_type)
    config._attn_implementation = "eager"
    variants = [family.variant_of(config, i) for i in range(int(getattr(config, family.n_layers)))]
    firsts = sorted({variants.index(v) for v in variants})  # the first block of each variant (Qwen3.5: 0 and 3)
    for size, index in ((size, index) for size in (2, 4) for index in firsts):
        padded = padded_vocab(int(config.vocab_size), size, 16)
        for rank in range(size):
            tp = TPContext(rank=rank, size=size)
            model, want, embed = _reference_shards(family, config, tp, index)
            builder = ModelBuilder(family=family, hf_config=config, hf_model=meta_model(config), seed=SEED, tp=tp,
                                   padded_vocab=padded)
            got = builder.block(index)
            params = dict(got.named_parameters())
            assert params.keys() == dict(want.named_parameters()).keys()
            for name, p in want.named_parameters():
                assert torch.equal(params[name], p), (model_type, size, rank, name)
            rows, start = builder.vocab_shard(family.embed)
            stop = start + padded // size
            full = torch.cat([embed, embed.new_zeros(padded - embed.shape[0], embed.shape[1])])
            assert torch.equal(rows, full[start:stop]), (model_type, size, rank)


def test_tp_1_builds_the_reference_units_whole():
    family, config = get_family("llama"), hf_config("llama")
    config._attn_implementation = "eager"
    model = reference_model(config, family, SEED)
    builder = ModelBuilder(family=family, hf_config=config, hf_model=meta_model(config), seed=SEED, tp=TPContext(),
                           padded_vocab=int(config.vocab_size))
    for name in unit_names(family, config):
        unit = builder.materialize(name)
        for key, p in model.get_submodule(name).named_parameters():
            assert torch.equal(dict(unit.named_parameters())[key], p), (name, key)


def test_hf_init_decides_the_values_and_fills_elsewhere_are_untouched():
    """Zeros and ones stay HF's; GPT-2's second, scaled fill of c_proj wins; a fill of a tensor that is not a
    parameter of the unit runs unchanged on the seeded global generator."""
    family, config = get_family("gpt2"), hf_config("gpt2")
    config._attn_implementation = "eager"
    model = reference_model(config, family, SEED)
    block = model.get_submodule("transformer.h.0")
    assert torch.equal(block.ln_1.weight, torch.ones_like(block.ln_1.weight))
    assert torch.count_nonzero(block.attn.c_attn.bias) == 0
    scaled = config.initializer_range / (2 * config.n_layer) ** 0.5
    assert float(block.attn.c_proj.weight.detach().std()) == pytest.approx(scaled, rel=0.05)
    assert float(block.attn.c_attn.weight.detach().std()) == pytest.approx(config.initializer_range, rel=0.05)
    other = torch.nn.Linear(4, 4)
    with TiledFills(dict(block.named_parameters()), 1):
        torch.manual_seed(5)
        other.weight.data.normal_()
    torch.manual_seed(5)
    assert torch.equal(other.weight.data, torch.empty(4, 4).normal_())


def test_zero3_partitions_each_layer_before_the_next_is_built():
    """ZeRO-3 at pp = 1 (``engine.zero3_partitioner``): ``sequential_model`` hands every layer to the partition
    callback as soon as it is built, so a rank never holds more than one full layer beside the partitions."""
    from hybridtrain.models.stages import sequential_model
    from hybridtrain.parallel.layers import VocabParallelLoss

    family, config = get_family("gpt2"), hf_config("gpt2")
    config._attn_implementation = "eager"
    padded = int(config.vocab_size)
    builder = ModelBuilder(family=family, hf_config=config, hf_model=meta_model(config), seed=SEED, tp=TPContext(),
                           padded_vocab=padded)
    events: list[str] = []
    materialize = builder.materialize

    def traced(name, *args, **kwargs):
        events.append(f"build {name}")
        return materialize(name, *args, **kwargs)

    builder.materialize = traced
    whole = []

    def partition(layer):
        events.append(f"partition {type(layer).__name__}")
        whole.extend(p for p in layer.parameters() if p.numel())  # full until partitioned
        for p in layer.parameters():
            p.data = torch.empty(0)  # what ZeRO-3 leaves on a rank: its partition

    model = sequential_model(builder, VocabParallelLoss(padded, TPContext()), partition)
    assert events == ["build transformer.wte", "partition TokenEmbedding", "build transformer.wpe",
                      "partition PositionEmbedding", "build transformer.h.0", "partition DecoderBlock",
                      "build transformer.h.1", "partition DecoderBlock", "build transformer.ln_f", "partition FinalNorm"]
    assert all(p.numel() == 0 for p in model.parameters()) and whole
