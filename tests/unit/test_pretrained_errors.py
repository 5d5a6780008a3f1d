"""Bad ``model.pretrained`` inputs: each one a clear error naming the key, before anything runs."""
from __future__ import annotations

import json

import pytest
import torch

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


# --- the weights' headers, checked in the plan (before tokenizing or launching) ---------------------------

def _finetune(folder):
    return _resolve("+recipe=finetune", f"model.pretrained={folder}")


def _broken(hf_llama, tmp_path, name: str = "broken"):
    import shutil

    return shutil.copytree(hf_llama, tmp_path / name)


def test_missing_folder_says_it_does_not_exist_not_that_none_is_set(tmp_path):
    with pytest.raises(PlanError) as info:
        _finetune(tmp_path / "nope")  # +recipe=finetune: the family comes from the folder
    assert info.value.key == "model.pretrained" and "does not exist" in str(info.value)
    assert "no model.pretrained is set" not in str(info.value)


def test_folder_with_only_config_json(hf_llama, tmp_path):
    (tmp_path / "cfg_only").mkdir()
    (tmp_path / "cfg_only" / "config.json").write_text((hf_llama / "config.json").read_text())
    with pytest.raises(PlanError) as info:
        _finetune(tmp_path / "cfg_only")
    assert info.value.key == "model.pretrained" and "has config.json but no weights" in str(info.value)


def test_pickle_weights_only_are_refused_with_how_to_convert(hf_llama, tmp_path):
    folder = _broken(hf_llama, tmp_path)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"never unpickled")  # not even a valid pickle: it is never opened
    with pytest.raises(PlanError) as info:
        _finetune(folder)
    msg = str(info.value)
    assert info.value.key == "model.pretrained" and "holds pytorch_model.bin, not safetensors" in msg
    assert "never a pickle" in msg and f"M.from_pretrained('{folder}').save_pretrained('{folder}-safetensors')" in msg


@pytest.mark.parametrize("damage", ["truncated", "garbage", "header_only"])
def test_truncated_or_garbage_safetensors_is_refused_in_the_plan(hf_llama, tmp_path, damage):
    import struct

    folder = _broken(hf_llama, tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    header = 8 + struct.unpack("<Q", data[:8])[0]
    (folder / "model.safetensors").write_bytes({"truncated": data[: len(data) - 100], "garbage": b"\x13\x37" * 500,
                                                "header_only": data[:header]}[damage])
    with pytest.raises(PlanError) as info:
        _finetune(folder)
    msg = str(info.value)
    assert info.value.key == "model.pretrained" and "model.safetensors is not a readable safetensors file" in msg, msg
    assert "truncated or corrupt" in msg and "\n" not in msg


def test_sharded_index_naming_a_missing_shard(hf_checkpoints, tmp_path):
    import json
    import shutil

    folder = shutil.copytree(hf_checkpoints["llama"], tmp_path / "sharded")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (folder / shard).unlink()
    with pytest.raises(PlanError) as info:
        _finetune(folder)
    assert info.value.key == "model.pretrained" and f"{shard} is named by" in str(info.value)
    assert "does not exist" in str(info.value)


def test_weights_of_another_shape_or_fewer_layers_are_refused(hf_llama, tmp_path):
    import json

    folder = _broken(hf_llama, tmp_path, "wide")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    with pytest.raises(PlanError) as info:
        _finetune(folder)
    assert "model.layers.0.mlp.gate_proj.weight has shape [192, 96] but the model expects [256, 96]" in str(info.value)
    folder = _broken(hf_llama, tmp_path, "deep")
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 6}))
    with pytest.raises(PlanError) as info:
        _finetune(folder)
    assert "of the llama model's tensors are missing" in str(info.value)
    assert "model.layers.4." in str(info.value)


def test_a_base_model_checkpoint_without_the_prefix_loads_through_transformers_mapping(hf_llama, tmp_path):
    """Tensors saved without the ``model.`` prefix (a base-model checkpoint): transformers' key mapping
    finds them, for the plan's check and for the loader alike."""
    import torch
    from safetensors.torch import load_file, save_file

    from hybridtrain.models.hf_model import meta_model
    from hybridtrain.models.weights import SafetensorsWeights

    folder = _broken(hf_llama, tmp_path, "no_prefix")
    state = load_file(str(folder / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    _, hf_config = _finetune(folder)  # the plan accepts it
    weights = SafetensorsWeights(folder).for_model(meta_model(hf_config))
    name = "model.layers.3.mlp.down_proj.weight"
    assert name in weights and torch.equal(weights.get(name), state[name].float())


@pytest.fixture(scope="module")
def gpt_oss_twin(tmp_path_factory):
    from helpers.moe import make_moe_checkpoint

    return make_moe_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "twin", "gpt_oss")


def _copy(folder, into):
    import shutil

    return shutil.copytree(folder, into)


def _mxfp4(folder) -> None:
    """Make the twin ``folder`` an MXFP4 checkpoint as the published gpt-oss ones are: each expert weight as random
    FP4 ``*_blocks [E, out, in / 32, 16]`` (two values a byte) and E8M0 ``*_scales [E, out, in / 32]``, and a
    ``quantization_config`` naming the method."""
    from safetensors.torch import load_file, save_file

    (path,) = folder.glob("*.safetensors")
    tensors, gen = load_file(str(path)), torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, n_in, n_out = tensors.pop(name).shape  # transposed: [E, in, out]
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, n_out, n_in // 32, 16), dtype=torch.uint8,
                                                  generator=gen)
        tensors[f"{name}_scales"] = torch.randint(120, 128, (experts, n_out, n_in // 32), dtype=torch.uint8,
                                                  generator=gen)
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))


def test_an_mxfp4_gpt_oss_checkpoint_is_refused_and_its_dequantisation_loads(gpt_oss_twin, tmp_path):
    """The published gpt-oss layout (MXFP4 experts, ``quantization_config``) is refused with a command; that command,
    run as the message gives it, writes a bf16 folder that loads, with transformers' logits of it."""
    import re

    from transformers import AutoModelForCausalLM

    from helpers.families import SEQ, VOCAB, one_process_model_of

    folder = _copy(gpt_oss_twin, tmp_path / "mxfp4")
    _mxfp4(folder)
    with pytest.raises(PlanError) as info:
        _resolve("+recipe=finetune", f"model.pretrained={folder}")
    message = str(info.value)
    assert info.value.key == "model.pretrained" and "quant_method=mxfp4" in message
    assert "Mxfp4Config(dequantize=True)" in message and f"from_pretrained('{folder}'" in message
    out = tmp_path / "bf16"
    (code,) = re.findall(r'python -c "(.+?)"', message)
    exec(code.replace("'OUT'", repr(str(out))), {})  # the message's command, as written
    _copy_tokenizer(gpt_oss_twin, out)
    _resolve("+recipe=finetune", f"model.pretrained={out}")
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()(input_ids=ids).logits
        got = one_process_model_of(out).eval().logits(ids)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_mxfp4_expert_tensors_without_a_quantization_config_are_named(gpt_oss_twin, tmp_path):
    """``*_blocks`` / ``*_scales`` tensors instead of the float experts: the same advice, not "wrong weights"."""
    from safetensors.torch import load_file, save_file

    folder = _copy(gpt_oss_twin, tmp_path / "blocks")
    (path,) = folder.glob("*.safetensors")
    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj")]:
        weight = tensors.pop(name)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = weight.to(torch.uint8), weight[..., :1].to(torch.uint8)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(PlanError) as info:
        _resolve("+recipe=finetune", f"model.pretrained={folder}")
    assert info.value.key == "model.pretrained" and "MXFP4 tensors such as" in str(info.value)
    assert "Mxfp4Config(dequantize=True)" in str(info.value)


def _copy_tokenizer(src, dst) -> None:
    import shutil

    for f in src.iterdir():
        if "token" in f.name:
            shutil.copy(f, dst / f.name)


def test_a_tokenizer_larger_than_the_pretrained_embedding_names_the_fixes_that_work(hf_llama, tmp_path):
    """Fault probe n35: a folder whose tokenizer has 200 added tokens more than its embedding has rows got "set
    model.config.vocab_size >= N or leave it unset" (it was unset, and an override is refused for a pretrained
    model). The message says the tokenizer and the weights disagree and gives data.tokenizer and the resize."""
    import shutil

    from transformers import AutoTokenizer

    folder = shutil.copytree(hf_llama, tmp_path / "bigtok")
    tok = AutoTokenizer.from_pretrained(str(folder))
    rows = json.loads((folder / "config.json").read_text())["vocab_size"]
    tok.add_tokens([f"<extra_{i}>" for i in range(rows - len(tok) + 200)])
    tok.save_pretrained(str(folder))
    with pytest.raises(PlanError) as info:
        _resolve("model=llama", f"model.pretrained={folder}")
    assert info.value.key == "data.tokenizer"
    assert f"the tokenizer has {len(tok)} tokens but the embedding of {folder} only {rows} rows" in str(info.value)
    assert "model.resize_token_embeddings(len(tokenizer))" in str(info.value)
    assert "model.config.vocab_size" not in str(info.value)


def test_an_moe_folder_missing_one_experts_tensors_names_the_first_one(tmp_path):
    """Fault probe n32: a Qwen3-MoE folder (experts stored one by one, as save_pretrained writes them) without
    layer 1's expert 3 passed the controller's check (it looked for expert 0 only) and failed in a rank with a
    misleading shape error; now a config error naming the missing tensor, before anything runs."""
    from safetensors.torch import load_file, save_file

    from helpers.moe import make_moe_checkpoint

    folder = make_moe_checkpoint(tmp_path / "moe", "qwen3_moe")
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    gone = sorted(k for k in tensors if k.startswith("model.layers.1.mlp.experts.3."))
    assert len(gone) == 3
    save_file({k: v for k, v in tensors.items() if k not in gone}, str(weights), metadata={"format": "pt"})
    with pytest.raises(PlanError) as info:
        _resolve("+recipe=finetune", f"model.pretrained={folder}", "data.seq_len=32", "trainer.global_batch_size=8")
    assert info.value.key == "model.pretrained"
    assert str(info.value).startswith(f"model.pretrained: {folder} has no {gone[0]}: its MoE layers are stored expert "
                                      "by expert and this one is missing")
