"""The real Hydra config: every recipe composes and validates; the schema rejects bad keys;
the resolved config round-trips; the CLI's dry run writes what workers read."""
from __future__ import annotations


import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf.errors import ConfigKeyError

from helpers_unit import RECIPES, compose_config, compose_raw
from hybridtrain.config import Config, load_config, save_config, to_config
from hybridtrain.plan import Machine, resolve


def test_recipes_are_found():
    # guards the parametrisation below: an empty glob would make every recipe test vanish
    assert {"gpt_tiny", "gpt_small", "llama_tiny", "llama_7b"} <= set(RECIPES)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny save_pretrained Llama, for recipes that fine-tune one (``model.pretrained``)."""
    from finetune_helpers import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("hf") / "llama", "llama")


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_validates(recipe, hf_llama):
    cfg = compose_config(f"+recipe={recipe}")
    assert isinstance(cfg, Config)
    if cfg.model.pretrained is not None:  # a fine-tuning recipe: it needs the model folder
        cfg = compose_config(f"+recipe={recipe}", f"model.pretrained={hf_llama}")
        from hybridtrain.plan import apply_pretrained_defaults

        apply_pretrained_defaults(cfg)
    # the machine the recipe targets: CPU processes, unless it pins GPUs per node (llama_7b: 4 nodes x 8)
    gpus = cfg.launcher.gpus_per_node or 0
    plan, hf_config = resolve(cfg, Machine(gpus_per_node=gpus, fp16_supported=gpus > 0, cpu_cores=8))

    par = cfg.parallel
    assert (plan.tp, plan.pp) == (par.tp, par.pp)
    assert par.dp is None or plan.dp == par.dp
    assert plan.world_size == plan.dp * plan.tp * plan.pp
    assert plan.global_batch_size == plan.micro_batch_size * plan.grad_accum * plan.dp == cfg.trainer.global_batch_size
    assert plan.tokens_per_step == cfg.trainer.global_batch_size * cfg.data.seq_len
    assert plan.padded_vocab_size % (plan.tp * cfg.model.vocab_pad_multiple) == 0
    assert plan.vocab_size <= plan.padded_vocab_size < plan.vocab_size + plan.tp * cfg.model.vocab_pad_multiple
    bounds = plan.stage_bounds
    assert len(bounds) == plan.pp + 1 and bounds[0] == 0 and bounds[-1] == len(plan.layer_names)
    assert all(a < b for a, b in zip(bounds, bounds[1:])), f"empty stage in {bounds}"
    for key, value in cfg.model.config.items():  # every recipe override reaches the HF config
        assert getattr(hf_config, key) == value, key


def test_llama_7b_recipe_arithmetic():
    """The numbers the recipe's header states: 32 ranks, 8 blocks per stage, 1M tokens per step."""
    plan, _ = resolve(compose_config("+recipe=llama_7b"), Machine())
    assert (plan.dp, plan.tp, plan.pp, plan.world_size, plan.nodes) == (1, 8, 4, 32, 4)
    assert plan.grad_accum == 256 and plan.tokens_per_step == 256 * 4096
    assert [sum(n.startswith("block.") for n in plan.stage_layers(s)) for s in range(4)] == [8, 8, 8, 8]
    assert plan.stage_layers(0)[0] == "embed" and plan.stage_layers(3)[-2:] == ["final_norm", "head"]


def test_overrides_reach_the_typed_config():
    cfg = compose_config("+recipe=gpt_tiny", "parallel.tp=2", "trainer.precision=bf16", "model.config.n_layer=2")
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
    cfg = compose_config(f"+recipe={recipe}")
    cfg.run_dir = str(tmp_path)  # the optional field with a value, as the CLI saves it
    save_config(cfg, tmp_path / "config.yaml")
    back = load_config(tmp_path / "config.yaml")
    assert back == cfg and back != Config()
    assert isinstance(back.model.config, dict) and isinstance(back.optim.betas, list)


def test_load_config_checks_the_schema(tmp_path):
    cfg = compose_config("+recipe=gpt_tiny")
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
    cfg = compose_config("+recipe=llama_7b")
    plan, _ = resolve(cfg, Machine())
    with pytest.raises(SystemExit) as info:
        local.launch(tmp_path, plan, cfg.launcher, Machine(cpu_cores=8))
    assert "launcher.nodes=4" in str(info.value.code) and "use launcher.nodes=1" in str(info.value.code)
