"""The parameter shapes the planner reads from the config (``hybridtrain.models.shapes``) are HF's:
for every family and shape option, exactly the names and shapes of HF's meta model, in its order."""
from __future__ import annotations

import pytest

from hybridtrain.models.build import hf_config_of, meta_model
from hybridtrain.models.families import FAMILIES, get_family
from hybridtrain.models.shapes import BLOCKS, block_shapes, final_norm_shapes

CASES = [
    ("gpt2", {"n_layer": 2, "n_embd": 48, "n_head": 4, "n_positions": 64}),
    ("gpt2", {"n_layer": 2, "n_embd": 48, "n_head": 4, "n_positions": 64, "n_inner": 100}),
    ("llama", {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 64}),
    ("llama", {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 4, "head_dim": 16, "attention_bias": True, "mlp_bias": True,
               "tie_word_embeddings": True}),
]


def _hf(model_type: str, overrides: dict):
    return hf_config_of(model_type, dict(overrides), 300, "sdpa", eos_token_id=0)


def test_every_family_has_its_shapes_written_down():
    assert sorted(BLOCKS) == sorted(FAMILIES)


@pytest.mark.parametrize("model_type,overrides", CASES)
def test_block_and_final_norm_shapes_are_hf_meta_model_shapes(model_type, overrides):
    hf_config = _hf(model_type, overrides)
    family = get_family(model_type)
    model = meta_model(hf_config)

    def hf_shapes(path: str) -> list:
        return [(n, tuple(p.shape)) for n, p in model.get_submodule(path).named_parameters()]

    assert list(block_shapes(model_type, hf_config).items()) == hf_shapes(f"{family.blocks}.1")
    assert list(final_norm_shapes(model_type, hf_config).items()) == hf_shapes(family.final_norm)


@pytest.mark.parametrize("model_type,overrides", CASES)
def test_layer_params_and_total_equal_the_meta_model_counts(model_type, overrides):
    from hybridtrain.plan import layer_params
    from hybridtrain.plan.costs import model_facts

    from helpers_unit import compose_config

    hf_config = _hf(model_type, overrides)
    family = get_family(model_type)
    model = meta_model(hf_config)
    cfg = compose_config("+recipe=gpt_tiny")  # layer_params reads only model.model_type and data.seq_len

    def count(path: str) -> int:
        return sum(p.numel() for p in model.get_submodule(path).parameters())

    want = [count(family.embed)] + ([count(family.position_embed)] if family.position_embed else [])
    want += [count(f"{family.blocks}.{i}") for i in range(2)]
    want += [count(family.final_norm), count(family.embed if hf_config.tie_word_embeddings else family.head)]
    cfg.model.model_type = model_type
    assert layer_params(cfg, hf_config) == want
    total = sum(p.numel() for p in model.parameters())  # a tied head is the embedding's tensor
    assert model_facts(model_type, hf_config, 32).total_params() == total


def test_a_config_not_written_down_falls_back_to_none():
    class CrossAttention:
        n_embd, add_cross_attention = 48, True

    assert block_shapes("gpt2", CrossAttention()) is None
    assert block_shapes("bert", CrossAttention()) is None and final_norm_shapes("bert", CrossAttention()) is None
