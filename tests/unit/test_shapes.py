"""The planner's shapes (hybridtrain/models/shapes.py): what the disk cache returns equals what the
one-block meta model gives, for every family; a config transformers refuses is never cached; an
unwritable or corrupt cache only costs a rebuild; a cache hit imports no modeling code."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.families import TINY
from helpers.moe import MOE_TINY
from hybridtrain.models.families import FAMILIES, get_family
from hybridtrain.models.shapes import block_shapes, built_shapes, cache_dir, cache_key
from hybridtrain.models.units import block_variants


def _config(model_type: str):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **{**TINY, **MOE_TINY}[model_type])
    cfg._attn_implementation = get_family(model_type).attn_implementations[0]
    return cfg


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_cached_shapes_equal_the_meta_model(model_type, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDTRAIN_CACHE", str(tmp_path))
    family, cfg = get_family(model_type), _config(model_type)
    first = block_shapes(family, cfg)  # built, then written
    assert (cache_dir() / f"{cache_key(family, cfg)}.json").is_file()
    assert block_shapes(family, cfg) == first == built_shapes(family, cfg)  # read back: the same numbers
    assert all(f > 0 for f in first.linear_flops.values()) and first.blocks and first.final_norm
    assert set(first.blocks) == set(first.linear_flops) == set(block_variants(family, cfg))


def test_another_config_is_another_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDTRAIN_CACHE", str(tmp_path))
    family, a = get_family("llama"), _config("llama")
    b = _config("llama")
    b.intermediate_size = a.intermediate_size * 2
    assert cache_key(family, a) != cache_key(family, b)
    assert block_shapes(family, b).linear_flops["block"] > block_shapes(family, a).linear_flops["block"]
    b._attn_implementation = "eager"  # the kernel is part of the key too
    assert cache_key(family, a) != cache_key(family, b)


def test_a_refused_config_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDTRAIN_CACHE", str(tmp_path))
    family, cfg = get_family("gpt2"), _config("gpt2")
    cfg.n_embd, cfg.n_head = 30, 4  # GPT-2's attention refuses a width its heads do not divide
    with pytest.raises(ValueError):
        block_shapes(family, cfg)
    assert not list(cache_dir().glob("*.json"))


def test_corrupt_or_unwritable_cache_rebuilds(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDTRAIN_CACHE", str(tmp_path))
    family, cfg = get_family("gpt2"), _config("gpt2")
    cache_dir().mkdir(parents=True)
    (cache_dir() / f"{cache_key(family, cfg)}.json").write_text("{not json")
    assert block_shapes(family, cfg) == built_shapes(family, cfg)
    monkeypatch.setenv("HYBRIDTRAIN_CACHE", "/proc/not-writable")
    assert block_shapes(family, cfg) == built_shapes(family, cfg)


def test_a_cache_hit_imports_no_modeling_code(tmp_path):
    code = ("import sys; from transformers import AutoConfig; from hybridtrain.models.families import get_family; "
            "from hybridtrain.models.shapes import block_shapes; c = AutoConfig.for_model('llama', num_hidden_layers=2, "
            "hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2); "
            "c._attn_implementation = 'sdpa'; block_shapes(get_family('llama'), c); "
            "print(sorted(m for m in sys.modules if m.startswith('transformers.models.llama.modeling')))")
    env = {"HYBRIDTRAIN_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    run = lambda: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,  # noqa: E731
                                 env=env, cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    assert run() == "['transformers.models.llama.modeling_llama']"  # first time: built
    assert run() == "[]"  # then read from the cache


def _moe_with_a_dense_first_block(variants=None):
    """A Qwen3-MoE config whose block 0 is dense (``mlp_only_layers``), with Qwen3's paths; the planner's
    facts only (no TP plan: every parameter counts as replicated)."""
    import dataclasses

    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen3_moe", num_hidden_layers=3, hidden_size=32, intermediate_size=64,
                               moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, vocab_size=100, mlp_only_layers=[0])
    cfg._attn_implementation = "sdpa"
    family = dataclasses.replace(get_family("qwen3"), model_type="qwen3_moe", hf_config_class=None, tp_rules={},
                                 block_variants=variants)
    return family, cfg


def test_blocks_of_other_variants_get_their_own_shapes(tmp_path, monkeypatch):
    """An MoE model with a leading dense block: each block's parameters and FLOPs are its own variant's."""
    import math

    from transformers import AutoModelForCausalLM

    from hybridtrain.plan.costs import model_facts
    from hybridtrain.plan.flops import model_flops_per_token

    monkeypatch.setenv("HYBRIDTRAIN_CACHE", str(tmp_path))
    family, cfg = _moe_with_a_dense_first_block(
        lambda c: ["dense" if i in c.mlp_only_layers else "moe" for i in range(c.num_hidden_layers)])
    shapes = block_shapes(family, cfg)
    assert set(shapes.blocks) == {"dense", "moe"} and block_shapes(family, cfg) == shapes  # cached as built
    facts = model_facts(family, cfg, seq_len=16)
    blocks = [u for u in facts.units if u.kind.value == "block"]
    model = AutoModelForCausalLM.from_config(cfg)  # the real model, each block counted as transformers builds it
    for u in blocks:
        real = sum(p.numel() for p in model.get_submodule(u.unit.hf_path).parameters())
        assert u.params(1) == real, u.name
    assert blocks[0].params(1) != blocks[1].params(1) == blocks[2].params(1)
    assert blocks[0].unit.variant == "dense" and blocks[1].unit.variant == "moe"
    assert model_flops_per_token(family, cfg, 16, 100) == pytest.approx(sum(u.flops for u in facts.units))
    assert math.isclose(sum(u.flops for u in blocks), blocks[0].flops + 2 * blocks[1].flops)


def test_blocks_the_variants_call_alike_but_differ_are_refused(tmp_path, monkeypatch):
    """Without a rule that tells the dense block from the MoE ones, the planner refuses instead of
    estimating every block as block 0."""
    from hybridtrain.errors import PlanError

    monkeypatch.setenv("HYBRIDTRAIN_CACHE", str(tmp_path))
    family, cfg = _moe_with_a_dense_first_block()
    with pytest.raises(PlanError, match="blocks 0 and 1 are both variant 'block'.*block_variants rule"):
        block_shapes(family, cfg)
    assert not list(cache_dir().glob("*.json"))
