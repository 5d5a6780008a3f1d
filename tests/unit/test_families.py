"""Family adapters (``hybridtrain.models.families``): every path and plan entry names a real HF
module, and applying the TP plan with tp=1 leaves a decoder block's outputs unchanged."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

from hybridtrain.models.build import shard_block
from hybridtrain.models.families import FAMILIES, GPT2, LLAMA, get_family, mlp_width_of, padded_vocab
from hybridtrain.models.hf_model import hf_config_of, meta_model
from hybridtrain.parallel.context import TPContext
from hybridtrain.parallel.layers import ColumnParallelLinear, RowParallelLinear

SMALL = {
    "gpt2": {"n_layer": 2, "n_embd": 48, "n_head": 4, "n_positions": 64},
    "llama": {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False},
}
VOCAB = 300


def small_config(model_type: str):
    return hf_config_of(model_type, dict(SMALL[model_type]), VOCAB, "sdpa", eos_token_id=0)


@pytest.fixture(params=sorted(SMALL))
def family(request):
    return FAMILIES[request.param]


def test_families_are_registered_once():
    assert {"gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "gpt_neox",
            "qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss", "deepseek_v3", "qwen3_5_text",
            "qwen3_5_moe_text", "qwen3_next", "smollm3", "olmo3", "gemma3_text"} == set(FAMILIES)
    assert get_family("llama") is LLAMA and get_family("gpt2") is GPT2
    assert all(get_family(k).model_type == k for k in FAMILIES)


def test_get_family_unknown_names_the_supported():
    with pytest.raises(KeyError, match=r"model.model_type='bert'.*'gpt2'.*'llama'"):
        get_family("bert")


def test_model_paths_exist_on_the_meta_model(family):
    hf_config = small_config(family.model_type)
    model = meta_model(hf_config)
    assert next(model.parameters()).device.type == "meta"
    for path in (family.embed, family.final_norm, family.head, family.position_embed, family.rotary_embed):
        if path is not None:
            model.get_submodule(path)  # raises AttributeError if the path is wrong
    blocks = model.get_submodule(family.blocks)
    assert isinstance(blocks, nn.ModuleList) and len(blocks) == getattr(hf_config, family.n_layers)


def test_config_key_names_exist(family):
    hf_config = small_config(family.model_type)
    small = SMALL[family.model_type]
    for key in (family.n_layers, family.hidden, family.heads, family.max_positions, family.kv_heads):
        if key is not None:
            assert getattr(hf_config, key) == small[key], key
    assert hasattr(hf_config, family.mlp_width)


def test_mlp_width_of():
    assert mlp_width_of(GPT2, small_config("gpt2")) == 4 * 48  # n_inner=None means 4 x n_embd
    assert mlp_width_of(GPT2, hf_config_of("gpt2", {**SMALL["gpt2"], "n_inner": 100}, VOCAB, "sdpa")) == 100
    assert mlp_width_of(LLAMA, small_config("llama")) == 96


def test_padded_vocab():
    assert padded_vocab(8000, 1) == 8000
    assert padded_vocab(8000, 3) == 8001
    assert padded_vocab(8000, 3, 16) == 8016
    assert padded_vocab(32000, 8, 16) == 32000


def test_tp_plan_entries_name_linears_of_a_block(family):
    block = meta_model(small_config(family.model_type)).get_submodule(f"{family.blocks}.0")
    assert family.tp_plan, "empty tensor-parallel plan"
    for name, rule in family.tp_plan.items():
        module = block.get_submodule(name)  # raises AttributeError if the name matches no module
        weight = module.weight
        assert weight.dim() == 2, name
        assert rule.style in ("column", "row"), name
        # HF Conv1D stores [in, out]; nn.Linear stores [out, in]
        assert rule.conv1d == (type(module).__name__ == "Conv1D"), name
    styles = [rule.style for rule in family.tp_plan.values()]
    assert "column" in styles and "row" in styles


def test_fused_qkv_is_three_equal_blocks():
    block = meta_model(small_config("gpt2")).get_submodule("transformer.h.0")
    rule = GPT2.tp_plan["attn.c_attn"]
    out_features = block.attn.c_attn.weight.shape[1]  # Conv1D: [in, out]
    assert rule.fused == 3 and out_features == 3 * 48


def test_input_copy_and_head_attributes_exist(family):
    block = meta_model(small_config(family.model_type)).get_submodule(f"{family.blocks}.0")
    for name in family.input_copy:
        block.get_submodule(name)
    # every column-parallel linear sits under an input-copy module, which runs Megatron's "f" for it
    for name, rule in family.tp_plan.items():
        if rule.style == "column":
            assert name.split(".")[0] in family.input_copy, name
    for path in family.heads_per_rank_attrs:
        owner, attr = path.rsplit(".", 1)
        assert isinstance(getattr(block.get_submodule(owner), attr), int), path


def _block_and_inputs(model_type: str):
    """A materialised (CPU) decoder block in eval mode and the arguments of its forward."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf_config = small_config(model_type)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa").eval()
    family = get_family(model_type)
    block = model.get_submodule(f"{family.blocks}.1")
    x = torch.randn(2, 7, 48)  # [B, S, H]
    kwargs = {}
    if family.rotary_embed:
        positions = torch.arange(7).expand(2, 7)  # [B, S]
        kwargs = {"position_ids": positions,
                  "position_embeddings": model.get_submodule(family.rotary_embed)(x, positions)}
    return block, x, kwargs


def _out(result):
    return result[0] if isinstance(result, tuple) else result


def test_shard_block_with_tp1_keeps_outputs(family):
    block, x, kwargs = _block_and_inputs(family.model_type)
    reference = copy.deepcopy(block)
    with torch.no_grad():
        expected = _out(reference(x, **kwargs))

    tp = TPContext()
    assert (tp.size, tp.rank, tp.group) == (1, 0, None)
    shard_block(block, family, small_config(family.model_type), tp)

    for name, rule in family.tp_plan.items():  # every planned linear was replaced
        layer = block.get_submodule(name)
        assert isinstance(layer, ColumnParallelLinear if rule.style == "column" else RowParallelLinear), name
        original = reference.get_submodule(name).weight
        torch.testing.assert_close(layer.weight, original.t() if rule.conv1d else original, rtol=0, atol=0)
    with torch.no_grad():
        actual = _out(block(x, **kwargs))
    assert actual.shape == expected.shape == x.shape
    torch.testing.assert_close(actual, expected)
    assert not torch.equal(actual, x)  # the block really ran


def test_plan_entry_without_module_is_an_error(family):
    block = meta_model(small_config(family.model_type)).get_submodule(f"{family.blocks}.0")
    rule = next(iter(family.tp_plan.values()))
    broken = dataclasses.replace(family, hf_config_class=None, tp_rules={"mlp.no_such_proj": rule, **family.tp_plan})
    with pytest.raises(ValueError, match=r"'mlp.no_such_proj'.*not a module"):
        shard_block(block, broken, small_config(family.model_type), TPContext())


def test_fused_shard_ranges_keep_matching_q_k_v_parts():
    from hybridtrain.parallel.slicing import shard_ranges, shard_tensor
    import torch

    # q | k | v of 4 rows each over tp=2: rank 1 takes rows 2-3 of each sub-block
    assert shard_ranges(12, 3, 1, 2) == [(2, 4), (6, 8), (10, 12)]
    t = torch.arange(12 * 2).reshape(12, 2)
    assert shard_tensor(t, 0, 3, 1, 2)[:, 0].tolist() == [4, 6, 12, 14, 20, 22]
    assert shard_tensor(t.t(), 1, 1, 0, 2).shape == (2, 6)
