"""Bad ``model.pretrained`` inputs: each one a clear error naming the key, before anything runs."""
from __future__ import annotations

import json

import pytest

from helpers.config import compose
from hybridtrain.models.families import FAMILIES
from hybridtrain.plan import Machine, PlanError, apply_pretrained_defaults, resolve

CPU = Machine(cpu_cores=2)


def _resolve(*overrides: str):
    cfg = compose(*overrides)
    apply_pretrained_defaults(cfg)
    return resolve(cfg, CPU)


def test_missing_folder(tmp_path):
    with pytest.raises(PlanError) as info:
        _resolve("model=llama", f"model.pretrained={tmp_path / 'nope'}")
    assert info.value.key == "model.pretrained" and "does not exist" in str(info.value)


def test_folder_that_is_not_an_hf_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(PlanError) as info:
        _resolve("model=llama", f"model.pretrained={tmp_path}")
    assert info.value.key == "model.pretrained" and "no config.json" in str(info.value)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("bert", vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64).save_pretrained(str(tmp_path))
    with pytest.raises(PlanError) as info:
        _resolve("model=llama", f"model.pretrained={tmp_path}")
    assert info.value.key == "model.pretrained"
    assert "'bert'" in str(info.value) and str(sorted(FAMILIES)) in str(info.value)


def test_family_mismatch_names_the_fix(hf_llama):
    with pytest.raises(PlanError) as info:
        _resolve("model=gpt2", f"model.pretrained={hf_llama}")
    assert info.value.key == "model.model_type" and "use model=llama" in str(info.value)


def test_shape_override_that_differs_from_the_checkpoint(hf_llama):
    with pytest.raises(PlanError) as info:
        _resolve("model=llama", f"model.pretrained={hf_llama}", "+model.config.num_hidden_layers=8")
    assert info.value.key == "model.config.num_hidden_layers" and "differs from the checkpoint" in str(info.value)


def test_remote_code_is_refused_unless_allowed(tmp_path):
    config = {"model_type": "my_custom_lm", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "configuration_custom.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(PlanError) as info:
        _resolve("model=llama", f"model.pretrained={tmp_path}")
    assert info.value.key == "model.pretrained" and "trust_remote_code" in str(info.value)


def test_truncated_safetensors_file_is_named(hf_llama, tmp_path):
    import shutil

    from hybridtrain.models.weights import CheckpointError, SafetensorsWeights

    broken = tmp_path / "broken"
    shutil.copytree(hf_llama, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as info:
        weights = SafetensorsWeights(broken)
        weights.get("model.layers.3.mlp.down_proj.weight")
    assert "model.safetensors" in str(info.value) and "truncated or corrupt" in str(info.value)


def test_weights_with_a_different_shape_are_rejected(hf_llama):
    import torch

    from hybridtrain.models.weights import CheckpointError, SafetensorsWeights, load_unit

    wrong = torch.nn.Linear(96, 10)  # the checkpoint's q_proj is [96, 96]
    with pytest.raises(CheckpointError) as info:
        load_unit(wrong, "model.layers.0.self_attn.q_proj", SafetensorsWeights(hf_llama), {})
    assert "shape" in str(info.value) and "does not match the checkpoint" in str(info.value)
