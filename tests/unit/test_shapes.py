"""The planner's shapes (hybridtrain/models/shapes.py): what the disk cache returns equals what the
one-block meta model gives, for every family; a config transformers refuses is never cached; an
unwritable or corrupt cache only costs a rebuild; a cache hit imports no modeling code."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.families import TINY
from hybridtrain.models.families import FAMILIES, get_family
from hybridtrain.models.shapes import block_shapes, built_shapes, cache_dir, cache_key


def _config(model_type: str):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **TINY[model_type])
    cfg._attn_implementation = get_family(model_type).attn_implementations[0]
    return cfg


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_cached_shapes_equal_the_meta_model(model_type, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDTRAIN_CACHE", str(tmp_path))
    family, cfg = get_family(model_type), _config(model_type)
    first = block_shapes(family, cfg)  # built, then written
    assert (cache_dir() / f"{cache_key(family, cfg)}.json").is_file()
    assert block_shapes(family, cfg) == first == built_shapes(family, cfg)  # read back: the same numbers
    assert first.linear_flops > 0 and first.block and first.final_norm


def test_another_config_is_another_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDTRAIN_CACHE", str(tmp_path))
    family, a = get_family("llama"), _config("llama")
    b = _config("llama")
    b.intermediate_size = a.intermediate_size * 2
    assert cache_key(family, a) != cache_key(family, b)
    assert block_shapes(family, b).linear_flops > block_shapes(family, a).linear_flops
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
