"""LoRA without processes: the ``finetune`` config, target modules resolved as peft resolves them for
every family, peft's names and adapter config, the merge, the memory model, and every bad input the
plan refuses (each a :class:`PlanError` naming the key and the fix)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.families import TINY, hf_config, make_family_checkpoint
from helpers.config import compose
from hybridtrain.models.families import get_family
from hybridtrain.models.lora import (ADAPTER_CONFIG, AdapterError, LoraSpec, adapter_config, hf_name_of, peft_name,
                                     resolve_targets)
from hybridtrain.plan import Machine, PlanError, apply_pretrained_defaults, resolve

CPU = Machine(cpu_cores=2)
FAMILIES = sorted(TINY)


def _resolve(*overrides: str):
    cfg = compose(*overrides)
    apply_pretrained_defaults(cfg)
    plan, hf = resolve(cfg, CPU)
    return cfg, plan, hf


def _model(family: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config(family))


def _peft_targets(model, target_modules) -> tuple[set, int]:
    """The modules peft adapts on ``model`` (HF paths) and its trainable parameter count."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    peft = get_peft_model(model, LoraConfig(r=4, target_modules=target_modules))
    adapted = {n[len("base_model.model."):] for n, m in peft.named_modules() if isinstance(m, LoraLayer)}
    return adapted, peft.get_nb_trainable_parameters()[0]


def _specs(family: str) -> list:
    """all-linear, one column- and one row-parallel leaf name, a qualified name, a regular expression."""
    fam = get_family(family)
    column = next(r for r, rule in fam.tp_plan.items() if rule.style == "column")
    row = next(r for r, rule in fam.tp_plan.items() if rule.style == "row")
    config = hf_config(family)  # the regular expression names block 1, or the first block of tp_plan's variant
    block = next(i for i in range(1, int(getattr(config, fam.n_layers))) if column in fam.block_plan(config, i))
    return ["all-linear", [column.rsplit(".", 1)[1], row.rsplit(".", 1)[1]], [row],
            rf".*\.{block}\.{column.replace('.', chr(92) + '.')}"]


# -- config -------------------------------------------------------------------------------------------

def test_finetune_group_composes_with_the_issue_keys():
    cfg = compose("finetune.method=lora", "finetune.lora.r=16", "finetune.lora.alpha=32",
                  "finetune.lora.target_modules=all-linear", "finetune.lora.rslora=true")
    lo = cfg.finetune.lora
    assert cfg.finetune.method == "lora" and (lo.r, lo.alpha, lo.target_modules, lo.rslora) == (16, 32.0, "all-linear", True)
    listed = compose("finetune.lora.target_modules=[q_proj,v_proj]").finetune.lora.target_modules
    assert listed == ["q_proj", "v_proj"]
    assert compose().finetune.method == "full"  # full fine-tuning unless asked


# -- target modules, exactly as peft --------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_targets_and_trainable_count_equal_peft(family):
    from hybridtrain.models.lora import lora_spec
    from hybridtrain.models.units import block_variants
    from hybridtrain.plan.lora import in_out, trainable_params

    fam = get_family(family)
    layers = int(getattr(hf_config(family), fam.n_layers))
    for spec in _specs(family):
        model = _model(family)
        names = [n for n, _ in model.named_modules()]
        ours = resolve_targets(fam, layers, names, spec, block_variants(fam, model.config))  # each block's plan
        theirs, count = _peft_targets(model, spec)
        assert set(ours) == theirs, (family, spec)
        lora = LoraSpec(r=4, alpha=8, dropout=0, rslora=False, targets=ours)
        assert trainable_params(lora, in_out(fam, model.config, model)) == count, (family, spec)
    cfg = compose(f"model={family}", "finetune.method=lora")  # the builder's path: the same resolution
    assert len(lora_spec(cfg.finetune.lora, fam, model.config, model).targets) == sum(
        r.style in ("column", "row") for i in range(layers) for r in fam.block_plan(model.config, i).values())


@pytest.mark.parametrize("target,fragment", [
    (["q_projj"], "'q_projj' matches no module of the llama model; the linear layers of a llama block are q_proj, "
                  "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (or use all-linear)"),
    (["lm_head"], "'lm_head' matches lm_head, which is not a linear layer of a decoder block"),
    (["input_layernorm"], "which is not a linear layer of a decoder block"),
    (["all-linear", "q_proj"], "all-linear must be given alone"),
    ([], "no target modules given"),
    ("(", "is not a regular expression"),
], ids=["typo", "lm_head", "norm", "all_linear_in_list", "empty", "bad_regex"])
def test_bad_target_names_the_family_modules(target, fragment):
    model = _model("llama")
    with pytest.raises(AdapterError) as info:
        resolve_targets(get_family("llama"), 2, [n for n, _ in model.named_modules()], target)
    assert fragment in str(info.value)


# -- peft's names and files ----------------------------------------------------------------------------

def test_peft_names_round_trip():
    hf = "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert peft_name(hf) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert hf_name_of(peft_name(hf)) == hf
    assert hf_name_of("base_model.model.transformer.h.1.attn.c_attn.lora_B.default.weight") == \
        "transformer.h.1.attn.c_attn.lora_B.weight"  # peft's in-model name (adapter "default")


def test_adapter_config_is_read_by_peft(tmp_path):
    from peft import LoraConfig, PeftConfig

    spec = LoraSpec(r=8, alpha=32.0, dropout=0.05, rslora=True,
                    targets=frozenset({"transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj"}))
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(spec, conv1d=True, base_model="/models/gpt2")))
    got = PeftConfig.from_pretrained(str(tmp_path))
    assert isinstance(got, LoraConfig)
    assert (got.r, got.lora_alpha, got.lora_dropout, got.use_rslora, got.fan_in_fan_out) == (8, 32, 0.05, True, True)
    assert set(got.target_modules) == set(spec.targets) and got.base_model_name_or_path == "/models/gpt2"


@pytest.mark.parametrize("family,rslora", [("gpt2", False), ("phi3", True)], ids=["gpt2_conv1d", "phi3_rslora"])
def test_merge_equals_peft_merge_and_unload(family, rslora):
    """export --merge's tensor arithmetic against peft's own merge (GPT-2: Conv1D, fan_in_fan_out)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from hybridtrain.export import _merge_adapters

    model = _model(family)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    original = {k: v.clone() for k, v in base.items()}
    conv1d = family == "gpt2"
    config = LoraConfig(r=4, lora_alpha=12, target_modules="all-linear", use_rslora=rslora, fan_in_fan_out=conv1d)
    peft = get_peft_model(model, config)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.1)
    adapters = get_peft_model_state_dict(peft)
    fam = get_family(family)
    spec = LoraSpec(r=4, alpha=12, dropout=0, rslora=rslora,
                    targets=frozenset(hf_name_of(k).rsplit(".", 2)[0] for k in adapters))
    _merge_adapters(base, adapters, adapter_config(spec, conv1d, None))
    merged = peft.merge_and_unload().state_dict()
    assert set(merged) == set(base)
    for name, tensor in merged.items():
        torch.testing.assert_close(base[name], tensor, rtol=1e-6, atol=1e-6)
    changed = {n.rsplit(".", 1)[0] for n in base if not torch.equal(base[n], original[n])}
    assert changed == set(spec.targets)  # every adapted weight moved, nothing else
    assert len(spec.targets) == int(getattr(hf_config(family), fam.n_layers)) * sum(
        r.style in ("column", "row") for r in fam.tp_plan.values())


# -- the memory model -------------------------------------------------------------------------------------

def test_frozen_base_costs_parameters_only():
    from hybridtrain.plan.memory import REDUCE_BUCKET_SIZE, model_state

    trained, frozen = [1000, 3000], [10**6]
    assert model_state(trained, 0, 1, "fp32", frozen) == (4 * (4000 + 10**6), 4 * 4000, 8 * 4000)
    # bf16 ZeRO-1: bf16 gradients and the fp32 accumulation buffer of the trained parameters (engine.ds_config)
    assert model_state(trained, 1, 2, "bf16", frozen) == (2 * (4000 + 10**6), 6 * 4000, 12 * 2000)
    p, g, o = model_state(trained, 2, 2, "fp32", frozen)  # the bucket holds the adapters' gradients only
    assert g == 4 * 4000 + 4 * 2000 and g < 4 * REDUCE_BUCKET_SIZE
    assert model_state(trained, 2, 2, "fp32")[1] == 4 * REDUCE_BUCKET_SIZE + 4 * 2000  # full fine-tuning: 5e8


def test_lora_partition_keeps_a_block_in_every_stage():
    from hybridtrain.plan.partition import partition

    costs = [1.0] + [1.0] * 4 + [0.1, 30.0]  # embed, 4 blocks, norm, a heavy head
    assert partition("balanced", 1, 4, 2, 2, layer_costs=costs) == [0, 5, 7]  # norm + head alone
    assert partition("balanced", 1, 4, 2, 2, layer_costs=costs, block_per_stage=True)[1] < 5


def test_plan_memory_estimate_counts_only_the_adapters():
    from hybridtrain.plan.report import build_report

    full_cfg, plan, hf = _resolve("+recipe=llama_tiny", "parallel.dp=2", "parallel.zero_stage=1")
    lora_cfg, lora_plan, _ = _resolve("+recipe=llama_tiny", "parallel.dp=2", "parallel.zero_stage=1",
                                      "finetune.method=lora")
    full = build_report(full_cfg, plan, hf, 0).stages[0].memory
    lora = build_report(lora_cfg, lora_plan, hf, 0).stages[0].memory
    assert lora.params == full.params + lora.grads  # the same model, in fp32, plus the adapters (4 bytes each)
    assert lora.optim < full.optim / 20 and lora.grads < full.grads / 20  # 4% of the parameters train


# -- bad input: plan errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,key,fragment", [
    (["finetune.lora.r=0"], "finetune.lora.r", "must be >= 1"),
    (["finetune.lora.alpha=0"], "finetune.lora.alpha", "must be > 0"),
    (["finetune.lora.dropout=1.0"], "finetune.lora.dropout", "must be in [0, 1)"),
    (["finetune.lora.target_modules=[q_projj]"], "finetune.lora.target_modules", "matches no module of the llama model"),
    (["trainer.precision=bf16", "parallel.zero_stage=0"], "parallel.zero_stage",
     "16-bit ZeRO-0 with an unpartitioned optimizer whose checkpoints cannot be saved"),
    (["parallel.pp=2", "finetune.lora.target_modules=[model.layers.0.self_attn.q_proj]"],
     "finetune.lora.target_modules", "holds no adapted module, and a stage with nothing to train cannot run"),
], ids=["r", "alpha", "dropout", "target_typo", "zero0_bf16", "stage_without_adapter"])
def test_plan_refuses(overrides, key, fragment):
    with pytest.raises(PlanError) as info:
        _resolve("+recipe=llama_tiny", "finetune.method=lora", *overrides)
    assert info.value.key == key and fragment in str(info.value), str(info.value)


def test_init_from_needs_lora(tmp_path):
    with pytest.raises(PlanError) as info:
        _resolve("+recipe=llama_tiny", f"finetune.lora.init_from={tmp_path}")
    assert info.value.key == "finetune.lora.init_from" and "set finetune.method=lora" in str(info.value)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Llama checkpoint, a peft adapter trained on it, and one trained on a wider Llama."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora")
    base = make_family_checkpoint(root / "llama", "llama")
    wide = make_family_checkpoint(root / "wide", "llama", hidden_size=128)
    out = {"base": base, "wide": wide}
    for name, folder in (("adapter", base), ("wide_adapter", wide)):
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(folder)),
                               LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], use_rslora=True))
        model.save_pretrained(str(root / name))
        out[name] = root / name
    return out


def test_init_from_takes_the_adapter_settings(folders):
    cfg, _, _ = _resolve("+recipe=finetune", f"model.pretrained={folders['base']}", "finetune.method=lora",
                         f"finetune.lora.init_from={folders['adapter']}", "finetune.lora.r=16")
    lo = cfg.finetune.lora
    assert (lo.r, lo.alpha, lo.rslora) == (4, 8.0, True)  # the adapter's, recorded in config.yaml
    assert lo.target_modules == sorted(f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "mlp.down_proj"))


def test_init_from_refuses_an_adapter_of_another_base(folders, tmp_path):
    with pytest.raises(PlanError) as info:  # the adapter's base folder has another hidden_size
        _resolve("+recipe=finetune", f"model.pretrained={folders['base']}", "finetune.method=lora",
                 f"finetune.lora.init_from={folders['wide_adapter']}")
    assert info.value.key == "finetune.lora.init_from"
    assert "whose hidden_size=128, but this run's model has hidden_size=64" in str(info.value)
    moved = tmp_path / "moved"  # the base folder gone: the shapes still tell
    moved.mkdir()
    for f in Path(folders["wide_adapter"]).iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    config = json.loads((moved / ADAPTER_CONFIG).read_text())
    (moved / ADAPTER_CONFIG).write_text(json.dumps({**config, "base_model_name_or_path": "org/some-hub-model"}))
    with pytest.raises(PlanError) as info:
        _resolve("+recipe=finetune", f"model.pretrained={folders['base']}", "finetune.method=lora",
                 f"finetune.lora.init_from={moved}")
    assert "model.layers.0.mlp.down_proj has 128 inputs and 64 outputs (expected (4, 128) and (64, 4)); the " \
           "adapter was made for another base model" in str(info.value)


@pytest.mark.parametrize("change,fragment", [
    ({"peft_type": "IA3"}, "holds a 'IA3' adapter; only LoRA adapters load"),
    ({"use_dora": True}, "asks for DoRA"),
    ({"modules_to_save": ["lm_head"]}, "asks for modules_to_save"),
], ids=["not_lora", "dora", "modules_to_save"])
def test_init_from_refuses_what_lora_here_does_not_do(folders, tmp_path, change, fragment):
    folder = tmp_path / "adapter"
    folder.mkdir()
    for f in Path(folders["adapter"]).iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    (folder / ADAPTER_CONFIG).write_text(json.dumps({**config, **change}))
    with pytest.raises(PlanError) as info:
        _resolve("+recipe=finetune", f"model.pretrained={folders['base']}", "finetune.method=lora",
                 f"finetune.lora.init_from={folder}")
    assert info.value.key == "finetune.lora.init_from" and fragment in str(info.value)


def test_init_from_a_folder_without_an_adapter(folders):
    with pytest.raises(PlanError) as info:
        _resolve("+recipe=finetune", f"model.pretrained={folders['base']}", "finetune.method=lora",
                 f"finetune.lora.init_from={folders['base']}")
    assert "is not a peft adapter folder (it needs adapter_config.json and adapter_model.safetensors" in str(info.value)


def test_merge_refuses_a_checkpoint_without_adapters(tmp_path):
    from safetensors.torch import save_file

    from hybridtrain.checkpoint.io import CheckpointDir
    from hybridtrain.export import ExportError, export

    ckpt = CheckpointDir(tmp_path / "step_1")
    ckpt.hf.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(ckpt.hf_part(0)))
    ckpt.meta_file.write_text("{}")
    with pytest.raises(ExportError) as info:
        export(ckpt.path, tmp_path / "out", merge=True)
    assert "holds no LoRA adapters (adapter/): --merge is for finetune.method=lora checkpoints" in str(info.value)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])  # DeepSeek-V3: the plan refuses all-linear
def test_moe_all_linear_is_every_linear_of_the_blocks_and_peft_adapts_exactly_those(family):
    """On an MoE model ``all-linear`` is every ``nn.Linear`` of the decoder blocks (none silently left out: the
    Qwen2-MoE ``shared_expert_gate`` is one), never the fused experts or the router; and peft, given those paths
    (what the exported ``adapter_config.json`` names), adapts exactly them, with the trainable count the plan
    computes (peft's own MoE conversion, which maps target names onto the experts, does not touch paths)."""
    from helpers.moe import moe_config
    from transformers import AutoModelForCausalLM

    from hybridtrain.models.units import block_variants
    from hybridtrain.plan.lora import in_out, trainable_params

    fam = get_family(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config(family))
    layers = int(getattr(model.config, fam.n_layers))
    ours = resolve_targets(fam, layers, [n for n, _ in model.named_modules()], "all-linear",
                           block_variants(fam, model.config))  # each block by its variant's plan
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(f"{fam.blocks}.")}
    assert set(ours) == linear and not any(".experts" in n or n.endswith(".mlp.gate") for n in ours)
    theirs, count = _peft_targets(model, sorted(ours))
    assert theirs == set(ours), sorted(set(ours) ^ theirs)[:4]
    assert trainable_params(LoraSpec(r=4, alpha=8, dropout=0, rslora=False, targets=ours),
                            in_out(fam, model.config, model)) == count
