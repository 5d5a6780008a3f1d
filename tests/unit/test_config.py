"""The real Hydra config: every recipe composes and validates; the schema rejects bad keys;
the resolved config round-trips; the CLI's dry run writes what workers read."""
from __future__ import annotations


import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf.errors import ConfigKeyError

from helpers.config import RECIPES, compose, compose_raw
from hybridtrain.config import CONF_DIR, Config, load_config, save_config, to_config
from hybridtrain.plan import Machine, resolve


def test_recipes_are_found():
    # guards the parametrisation below: an empty glob would make every recipe test vanish
    assert {"gpt_tiny", "gpt_small", "llama_tiny", "llama_7b"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_validates(recipe, hf_llama):
    cfg = compose(f"+recipe={recipe}")
    assert isinstance(cfg, Config)
    if cfg.model.pretrained is not None:  # a fine-tuning recipe: it needs the model folder
        cfg = compose(f"+recipe={recipe}", f"model.pretrained={hf_llama}")
        from hybridtrain.plan import apply_pretrained_defaults

        apply_pretrained_defaults(cfg)
    # the machine the recipe targets: CPU processes, unless it pins GPUs per node (llama_7b: 4 nodes x 8)
    gpus = cfg.launcher.gpus_per_node or 0
    plan, hf_config = resolve(cfg, Machine(gpus_per_node=gpus, fp16_supported=gpus > 0, cpu_cores=8))

    par = cfg.parallel
    assert (plan.dims.tp, plan.dims.pp) == (par.tp, par.pp)
    assert par.dp is None or plan.dims.dp == par.dp
    assert plan.world_size == plan.dims.world == plan.dims.dp * plan.dims.cp * plan.dims.tp * plan.dims.pp
    assert plan.global_batch_size == plan.micro_batch_size * plan.grad_accum * plan.dims.dp == cfg.trainer.global_batch_size
    assert plan.tokens_per_step == cfg.trainer.global_batch_size * cfg.data.seq_len
    assert plan.padded_vocab_size % (plan.dims.tp * cfg.model.vocab_pad_multiple) == 0
    assert plan.vocab_size <= plan.padded_vocab_size < plan.vocab_size + plan.dims.tp * cfg.model.vocab_pad_multiple
    bounds = plan.stage_bounds
    assert len(bounds) == plan.dims.pp + 1 and bounds[0] == 0 and bounds[-1] == len(plan.layer_names)
    assert all(a < b for a, b in zip(bounds, bounds[1:])), f"empty stage in {bounds}"
    for key, value in cfg.model.config.items():  # every recipe override reaches the HF config
        assert getattr(hf_config, key) == value, key


def test_llama_7b_recipe_arithmetic():
    """The numbers the recipe's header states: tp=2 x pp=2 with dp filling the devices (2 on one 8-GPU node,
    8 on 4 nodes, 16 on 8), 16 blocks per stage, 512k tokens per step (issue 29.7: it pinned 4 nodes and dp=1,
    so it exited 2 on one node and the README's 8-node sizing command exited 2 too)."""
    for nodes, dp in ((1, 2), (4, 8), (8, 16)):
        plan, _ = resolve(compose("+recipe=llama_7b", f"launcher.nodes={nodes}"), Machine())
        assert (plan.dims.dp, plan.dims.tp, plan.dims.pp, plan.world_size, plan.nodes) == (dp, 2, 2, 8 * nodes, nodes)
        assert plan.grad_accum == 128 // dp and plan.tokens_per_step == 128 * 4096
    assert plan.precision == "bf16"  # trainer.precision: null on GPUs (launcher.gpus=true)
    plan, _ = resolve(compose("+recipe=llama_7b"), Machine())
    assert [sum(n.startswith("block.") for n in plan.stage_layers(s)) for s in range(2)] == [16, 16]
    assert plan.stage_layers(0)[0] == "embed" and plan.stage_layers(1)[-2:] == ["final_norm", "head"]


def test_overrides_reach_the_typed_config():
    cfg = compose("+recipe=gpt_tiny", "parallel.tp=2", "trainer.precision=bf16", "model.config.n_layer=2")
    assert cfg.parallel.tp == 2 and cfg.trainer.precision == "bf16" and cfg.model.config["n_layer"] == 2
    assert cfg.data.seq_len == 32  # from the recipe, not conf/data/embedded.yaml's 128


def test_unknown_key_is_rejected():
    with pytest.raises(ConfigCompositionException, match="parallel.tpp"):
        compose_raw(["+recipe=gpt_tiny", "parallel.tpp=2"])


def test_appended_unknown_key_is_rejected_by_the_schema():
    # "+key=value" bypasses Hydra's struct check; the conversion to the typed Config must still refuse it
    raw = compose_raw(["+recipe=gpt_tiny", "+parallel.tpp=2"])
    with pytest.raises(ConfigKeyError, match="tpp"):
        to_config(raw)


def test_wrong_type_is_rejected():
    with pytest.raises(ConfigCompositionException) as info:
        compose_raw(["+recipe=gpt_tiny", "parallel.tp=two"])
    text = f"{info.value}\n{info.value.__cause__}"
    assert "parallel.tp" in text and "two" in text


def test_unknown_recipe_lists_the_available_ones():
    with pytest.raises(MissingConfigException) as info:
        compose_raw(["+recipe=nope"])
    text = str(info.value)
    assert "recipe/nope" in text
    for name in RECIPES:
        assert name in text


@pytest.mark.parametrize("recipe", RECIPES)
def test_save_load_round_trip(recipe, tmp_path):
    cfg = compose(f"+recipe={recipe}")
    cfg.run_dir = str(tmp_path)  # the optional field with a value, as the CLI saves it
    save_config(cfg, tmp_path / "config.yaml")
    back = load_config(tmp_path / "config.yaml")
    assert back == cfg and back != Config()
    assert isinstance(back.model.config, dict) and isinstance(back.optim.betas, list)


@pytest.mark.parametrize("launcher", ["local", "slurm", "multinode"])
def test_save_load_round_trip_keeps_the_launcher_and_the_choices(launcher, tmp_path):
    from hybridtrain.config.choices import Precision

    cfg = compose("+recipe=gpt_tiny", f"launcher={launcher}", "trainer.precision=bf16")
    save_config(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert f"  name: {launcher}\n" in text and "  precision: bf16\n" in text  # plain values, no enum tags
    back = load_config(tmp_path / "config.yaml")
    assert back == cfg and type(back.launcher) is type(cfg.launcher)
    assert back.trainer.precision is Precision.bf16


def test_choices_behave_as_their_values():
    import json

    from hybridtrain.config.choices import Precision

    bf16 = Precision.bf16
    assert bf16 == "bf16" and str(bf16) == f"{bf16}" == f"{bf16:>4}" == "bf16" and hash(bf16) == hash("bf16")
    assert {"bf16": 1}[bf16] == 1 and json.dumps({"p": bf16}) == '{"p": "bf16"}'


def test_every_field_says_what_it_accepts():
    """The wrong-type message describes every schema field in words (no raw type names)."""
    import dataclasses
    import typing

    from hybridtrain.config.explain import accepts
    from hybridtrain.config.schema import LAUNCHER_CONFIGS

    words = ("an integer", "a number", "a string", "true", "one of [", "a list of", "a mapping", "any value")
    sections = [t for t in typing.get_type_hints(Config).values() if dataclasses.is_dataclass(t)]
    assert len(sections) == 9
    nested = [t for s in sections for t in typing.get_type_hints(s).values() if dataclasses.is_dataclass(t)]
    assert [t.__name__ for t in nested] == ["LoraConfig", "DPOConfig", "CPOConfig", "ORPOConfig",
                                           "RewardConfig"]  # finetune.*
    for section in [*sections, *nested, *LAUNCHER_CONFIGS.values()]:
        for name, hint in typing.get_type_hints(section).items():
            if dataclasses.is_dataclass(hint):
                continue
            assert accepts(hint).startswith(words), (section.__name__, name, accepts(hint))


def _leaves(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


GROUP_FILES = sorted(p for p in CONF_DIR.glob("*/*.yaml") if p.parent.name != "recipe")
IDENTITY = {"model.model_type", "data.source", "launcher.name", "logger.name"}
"""The key that names a group option (``model_type: gpt2`` in ``model/gpt2.yaml``): stated even
where it equals the schema's default, so each option file says what it is."""


@pytest.mark.parametrize("path", GROUP_FILES, ids=[f"{p.parent.name}/{p.stem}" for p in GROUP_FILES])
def test_group_files_state_only_differences_from_the_schema(path):
    from omegaconf import OmegaConf

    from hybridtrain.config.schema import LAUNCHER_CONFIGS

    group = path.parent.name
    own = OmegaConf.to_container(OmegaConf.load(path)) or {}
    own.pop("defaults", None)
    schema = OmegaConf.structured(Config)
    if group == "launcher":
        schema.launcher = OmegaConf.structured(LAUNCHER_CONFIGS[path.stem])
    defaults = dict(_leaves(OmegaConf.to_container(schema[group], enum_to_str=True)))
    repeated = [k for k, v in _leaves(own) if f"{group}.{k}" not in IDENTITY and k in defaults and defaults[k] == v]
    assert not repeated, f"{path.relative_to(CONF_DIR)} repeats the schema's defaults of {repeated}"


def test_load_config_checks_the_schema(tmp_path):
    cfg = compose("+recipe=gpt_tiny")
    save_config(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    (tmp_path / "bad.yaml").write_text(text.replace("  tp: 1\n", "  tp: 1\n  tpp: 2\n"))
    assert "tpp: 2" in (tmp_path / "bad.yaml").read_text()
    with pytest.raises(ConfigKeyError, match="tpp"):
        load_config(tmp_path / "bad.yaml")




# --- the real CLI, in dry-run mode ---------------------------------------------------------------













def test_local_launcher_refuses_several_nodes(monkeypatch, tmp_path):
    import subprocess

    import hybridtrain.launch.local as local

    def no_workers(*args, **kwargs):
        raise AssertionError("the local launcher started workers for a 4-node plan")

    monkeypatch.setattr(subprocess, "Popen", no_workers)  # never start 32 ranks here
    cfg = compose("+recipe=llama_7b", "launcher.nodes=4")
    plan, _ = resolve(cfg, Machine())
    with pytest.raises(SystemExit) as info:
        local.launch(tmp_path, plan, cfg.launcher, Machine(cpu_cores=8))
    assert "launcher.nodes=4" in str(info.value.code) and "use launcher.nodes=1" in str(info.value.code)


@pytest.mark.parametrize("launcher", ["local", "slurm", "multinode"])
def test_verify_overrides_compose_under_every_launcher(launcher):
    """``python -m hybridtrain.verify`` re-composes the config from overrides and runs the twin here,
    with the local launcher, whatever launcher the plan is for (its slurm/multinode keys are left out)."""
    from hybridtrain.verify import overrides, shrink

    local = compose("+recipe=gpt_tiny")
    plan, hf_config = resolve(local, Machine())
    twin = shrink(local, plan, hf_config, steps=2)
    cfg = compose("+recipe=gpt_tiny", f"launcher={launcher}", "trainer.precision=bf16",
                  "parallel.partition=blocks")
    again = compose(*overrides(cfg, twin, {"dp": 1, "tp": 1, "pp": 1}))
    assert again.launcher.name == "local" and again.launcher.nodes == 1
    assert (again.trainer.precision, again.parallel.partition) == ("bf16", "blocks")
