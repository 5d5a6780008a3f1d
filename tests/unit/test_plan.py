"""Every rule of the plan (``hybridtrain.plan``): one test per check, each asserting the key path,
the offending values and the fix in the message; then the numbers a valid plan derives."""
from __future__ import annotations

import copy
import functools

import pytest

from helpers.config import compose
from hybridtrain.config import Config
from hybridtrain.models.families import FAMILIES
from hybridtrain.plan import Machine, PlanError, build_plan, layer_params, model_config, resolve
from hybridtrain.plan.partition import balanced
from hybridtrain.plan.hf import check_hf_overrides

CPU = Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=4)
GPUS8 = Machine(gpus_per_node=8, fp16_supported=True, cpu_cores=16)


@functools.lru_cache(maxsize=None)
def _recipe(name: str) -> Config:
    return compose(f"+recipe={name}")


def tiny() -> Config:
    """A fresh copy of the ``gpt_tiny`` recipe (4 layers, 6 heads, MLP 384, 256 positions, batch 12)."""
    return copy.deepcopy(_recipe("gpt_tiny"))


def llama() -> Config:
    """A fresh copy of ``llama_tiny`` (4 layers, 12 heads, 6 KV heads, MLP 192, 256 positions)."""
    return copy.deepcopy(_recipe("llama_tiny"))


def plan_error(cfg: Config, key: str, *fragments: str, machine: Machine = CPU) -> str:
    """Resolve ``cfg``; assert it fails on ``key`` with every fragment in the message."""
    with pytest.raises(PlanError) as info:
        resolve(cfg, machine)
    err = info.value
    assert err.key == key, str(err)
    message = str(err)
    assert message.startswith(f"{key}: ")
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def test_base_configs_are_valid():
    # every negative test changes one field of these; they must resolve as they are
    for cfg in (tiny(), llama()):
        for machine in (CPU, Machine(gpus_per_node=2)):
            resolve(cfg, machine)


# --- model ---------------------------------------------------------------------------------------

def test_unsupported_model_type_in_model_config():
    cfg = tiny()
    cfg.model.model_type = "bert"
    plan_error(cfg, "model.model_type", "'bert'", str(sorted(FAMILIES)))


def test_unsupported_model_type_in_build_plan():
    cfg = tiny()
    hf_config = model_config(cfg)
    cfg.model.model_type = "bert"
    with pytest.raises(PlanError) as info:
        build_plan(cfg, hf_config, CPU, 8000)
    assert info.value.key == "model.model_type"
    assert "'bert'" in str(info.value) and str(sorted(FAMILIES)) in str(info.value)


def test_unknown_hf_override_names_the_closest_field():
    cfg = tiny()
    cfg.model.config["n_layers"] = 2
    plan_error(cfg, "model.config.n_layers", "'n_layers'", "gpt2", "did you mean", "'n_layer'")


def test_unknown_hf_override_without_close_match():
    with pytest.raises(PlanError) as info:
        check_hf_overrides("llama", {"hidden_size": 64, "zzzzqqq": 1})
    assert info.value.key == "model.config.zzzzqqq"
    assert "'zzzzqqq'" in str(info.value) and "did you mean" not in str(info.value)


def test_vocab_pad_multiple_positive():
    cfg = tiny()
    cfg.model.vocab_pad_multiple = 0
    plan_error(cfg, "model.vocab_pad_multiple", ">= 1", "got 0")


def test_data_name_needs_the_hf_source():
    cfg = tiny()
    cfg.data.name = "openwebtext"
    plan_error(cfg, "data.name", "'openwebtext'", "data=hf")


# --- degrees and devices -------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["tp", "pp", "micro_batch_size"])
def test_parallel_sizes_positive(key):
    cfg = tiny()
    setattr(cfg.parallel, key, 0)
    plan_error(cfg, f"parallel.{key}", ">= 1", "got 0")


def test_dp_positive_or_null():
    cfg = tiny()
    cfg.parallel.dp = 0
    plan_error(cfg, "parallel.dp", "got 0", "null")


def test_nodes_positive():
    cfg = tiny()
    cfg.launcher.nodes = 0
    plan_error(cfg, "launcher.nodes", ">= 1", "got 0")


def test_devices_positive_or_null():
    cfg = tiny()
    cfg.launcher.gpus_per_node = 0
    plan_error(cfg, "launcher.gpus_per_node", "got 0", "null")


@pytest.mark.parametrize("threads", [0, -1])
def test_threads_per_rank_positive_or_null(threads):
    cfg = tiny()
    cfg.launcher.threads_per_rank = threads
    plan_error(cfg, "launcher.threads_per_rank", f"got {threads}", "or null")


def test_timeout_minutes_positive():
    cfg = tiny()
    cfg.launcher.timeout_minutes = 0
    plan_error(cfg, "launcher.timeout_minutes", "got 0")


@pytest.mark.parametrize("port", [80, 70000])
def test_master_port_in_range(port):
    cfg = tiny()
    cfg.launcher.master_port = port
    plan_error(cfg, "launcher.master_port", f"got {port}", "[1024, 65535]")


def test_missing_tokenizer_is_a_plan_error(tmp_path):
    cfg = tiny()
    cfg.data.tokenizer = str(tmp_path / "nowhere")
    plan_error(cfg, "data.tokenizer", "nowhere", "tokenizer.json")


def test_export_hf_needs_the_final_save():
    cfg = tiny()
    cfg.trainer.export_hf, cfg.trainer.save_final = True, False
    plan_error(cfg, "trainer.export_hf", "save_final=true")


def test_save_every_non_negative():
    cfg = tiny()
    cfg.trainer.save_every = -1
    plan_error(cfg, "trainer.save_every", "got -1")


def test_keep_last_positive_or_null():
    cfg = tiny()
    cfg.trainer.keep_last = 0
    plan_error(cfg, "trainer.keep_last", "got 0", "or null")


def test_finetune_recipe_requires_a_model_folder():
    cfg = compose("+recipe=finetune_llama")
    plan_error(cfg, "model.pretrained", "give-model.pretrained=DIR", "save_pretrained")


def test_cpu_ranks_spread_evenly_over_nodes():
    cfg = tiny()
    cfg.launcher.nodes, cfg.parallel.dp = 2, 3
    plan_error(cfg, "parallel.dp", "3 ranks", "launcher.nodes=2")


def test_tp_x_pp_exceeds_devices():
    cfg = tiny()
    cfg.parallel.tp, cfg.parallel.pp = 3, 2
    plan_error(cfg, "parallel.tp", "3 x 2 = 6", "4 devices", "launcher.gpus_per_node=4", "lower tp or pp",
               machine=Machine(gpus_per_node=4))


def test_null_dp_must_fill_the_devices():
    cfg = tiny()
    cfg.parallel.tp = 3  # 8 GPUs // 3 = dp 2: 6 ranks leave 2 GPUs idle
    plan_error(cfg, "parallel.dp", "2 x 3 x 1 = 6", "8 devices", "use dp <= 2", "tp x pp dividing 8",
               machine=GPUS8)


def test_explicit_dp_exceeds_devices():
    cfg = tiny()
    cfg.parallel.dp, cfg.parallel.tp = 4, 3
    message = plan_error(cfg, "parallel.dp", "4 x 3 x 1 = 12", "8 devices", "use dp <= 2", machine=GPUS8)
    assert "dividing" not in message  # that hint is for dp=null only


def test_launcher_devices_override_the_machine():
    cfg = tiny()
    cfg.launcher.gpus_per_node, cfg.parallel.tp = 2, 3
    plan_error(cfg, "parallel.tp", "3 x 1 = 3", "2 devices", machine=GPUS8)


# --- batch ---------------------------------------------------------------------------------------

def test_global_batch_divisible_by_micro_x_dp():
    cfg = tiny()
    cfg.parallel.dp, cfg.parallel.micro_batch_size = 5, 1
    plan_error(cfg, "trainer.global_batch_size", "12 is not divisible", "1 x 5 = 5", "multiple of 5", "e.g. 10")


def test_global_batch_positive():
    cfg = tiny()
    cfg.trainer.global_batch_size = 0
    plan_error(cfg, "trainer.global_batch_size", "must be >= 1, got 0")


# --- model shape ---------------------------------------------------------------------------------

def test_tp_divides_attention_heads():
    cfg = tiny()
    cfg.parallel.tp = 4
    plan_error(cfg, "parallel.tp", "parallel.tp=4", "model.config.n_head=6", "use tp in [1, 2, 3, 6]")


def test_tp_divides_kv_heads():
    cfg = llama()
    cfg.parallel.tp = 4  # divides the 12 query heads, not the 6 KV heads
    plan_error(cfg, "parallel.tp", "parallel.tp=4", "model.config.num_key_value_heads=6", "use tp in [1, 2, 3, 6]")


@pytest.mark.parametrize("family, key, tp", [("llama", "intermediate_size", 3), ("gpt2", "n_inner", 2)])
def test_tp_divides_mlp_width(family, key, tp):
    cfg = llama() if family == "llama" else tiny()
    cfg.model.config[key] = 200 if family == "llama" else 385
    cfg.parallel.tp = tp
    # the valid degrees divide every constrained size: llama's 12 heads, 6 KV heads and 200; gpt2's 6 heads and 385
    hint = "use tp in [1, 2]" if family == "llama" else "use tp in [1]"
    plan_error(cfg, "parallel.tp", f"parallel.tp={tp}", f"model.config.{key}={cfg.model.config[key]}", hint)


def test_config_transformers_refuses_names_the_override():
    cfg = tiny()
    cfg.model.config["n_head"] = 7  # 96 is not divisible by 7: GPT2Attention raises ValueError
    message = plan_error(cfg, "model.config.n_head", "transformers refuses this gpt2 config", "n_head=7",
                         "change the override")
    assert "Traceback" not in message


def test_tp_must_divide_every_familys_heads():
    from hybridtrain.models.families import FAMILIES

    for name in sorted(FAMILIES):
        cfg = llama() if name != "gpt2" else tiny()
        cfg.model.model_type = name
        heads_key = "n_head" if name == "gpt2" else "num_attention_heads"
        cfg.model.config = {heads_key: 6} if name == "gpt2" else {
            "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 4, "num_attention_heads": 12,
            "max_position_embeddings": 256, **({"num_key_value_heads": 6} if name != "gpt_neox" else {})}
        if name == "qwen3_5_moe_text":  # its config has no dense MLP width
            cfg.model.config.pop("intermediate_size")
        cfg.model.attn_implementation = None
        cfg.parallel.tp = 5
        valid = "[1, 2, 3, 4, 6, 12]" if name == "gpt_neox" else "[1, 2, 3, 6]"  # no KV heads to divide there
        linear = name in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")  # Gated DeltaNet heads (defaults) too
        if FAMILIES[name].moe is not None or linear:  # the experts' widths (their defaults here) limit tp further
            plan_error(cfg, "parallel.tp", "parallel.tp=5 must divide model.config.", "use tp in [1")
            continue
        plan_error(cfg, "parallel.tp", "parallel.tp=5 must divide model.config.", f"use tp in {valid}")


def test_attention_kernel_the_family_cannot_run():
    cfg = llama()
    cfg.model.model_type = "gemma2"
    cfg.model.config = {"hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 4, "num_attention_heads": 12,
                        "num_key_value_heads": 6, "head_dim": 8, "max_position_embeddings": 256}
    cfg.model.attn_implementation = "sdpa"
    plan_error(cfg, "model.attn_implementation", "transformers runs gemma2 only with ['eager']",
               "use model.attn_implementation=eager")
    cfg.model.attn_implementation = None  # the family's own kernel
    assert resolve(cfg, CPU)[1]._attn_implementation == "eager"


def test_pp_at_most_layers():
    cfg = tiny()
    cfg.parallel.pp = 5
    plan_error(cfg, "parallel.pp", "parallel.pp=5", "4 layers", "model.config.n_layer", "use pp <= 4")


def test_seq_len_within_positions():
    cfg = tiny()
    cfg.data.seq_len = 257
    plan_error(cfg, "data.seq_len", "257 must be in [1, model.config.n_positions=256]")


def test_seq_len_positive():
    cfg = tiny()
    cfg.data.seq_len = 0
    plan_error(cfg, "data.seq_len", "must be >= 1, got 0")


def test_seq_len_within_llama_positions():
    cfg = llama()
    cfg.data.seq_len = 300
    plan_error(cfg, "data.seq_len", "300", "model.config.max_position_embeddings=256")


def test_model_vocab_holds_the_tokenizer():
    cfg = tiny()
    cfg.model.config["vocab_size"] = 100
    plan_error(cfg, "model.config.vocab_size", "8000 tokens", "only 100", "model.config.vocab_size >= 8000")


# --- DeepSpeed limits ----------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [-1, 4])
def test_zero_stage_range(stage):
    cfg = tiny()
    cfg.parallel.zero_stage = stage
    plan_error(cfg, "parallel.zero_stage", "0, 1, 2 or 3", f"got {stage}")


@pytest.mark.parametrize("stage", [2, 3])
def test_pipeline_allows_zero_0_and_1_only(stage):
    cfg = tiny()
    cfg.parallel.pp, cfg.parallel.zero_stage = 2, stage
    plan_error(cfg, "parallel.zero_stage", f"zero_stage={stage}", "parallel.pp=2",
               "use parallel.zero_stage=1", "pp=1 for ZeRO-2/3")


def test_fp16_needs_support():
    cfg = tiny()
    cfg.trainer.precision = "fp16"
    plan_error(cfg, "trainer.precision", "fp16 is not supported", "use bf16 or fp32",
               machine=Machine(fp16_supported=False))


# --- loop and optimizer --------------------------------------------------------------------------

def test_max_steps_positive():
    cfg = tiny()
    cfg.trainer.max_steps = 0
    plan_error(cfg, "trainer.max_steps", ">= 1", "got 0")


def test_log_every_positive():
    cfg = tiny()
    cfg.trainer.log_every = 0
    plan_error(cfg, "trainer.log_every", ">= 1", "got 0")


@pytest.mark.parametrize("warmup", [-1, 21])
def test_warmup_within_max_steps(warmup):
    cfg = tiny()
    cfg.optim.warmup_steps = warmup
    plan_error(cfg, "optim.warmup_steps", f"{warmup} must be in [0, trainer.max_steps=20]")


def test_lr_positive():
    cfg = tiny()
    cfg.optim.lr = 0.0
    plan_error(cfg, "optim.lr", "> 0", "got 0.0")


@pytest.mark.parametrize("betas", [[0.9], [0.9, 1.0], [-0.1, 0.95], [0.9, 0.95, 0.99]])
def test_betas_two_in_unit_interval(betas):
    cfg = tiny()
    cfg.optim.betas = betas
    plan_error(cfg, "optim.betas", "two numbers in [0, 1)", f"got {betas}")


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_min_lr_ratio_in_unit_interval(ratio):
    cfg = tiny()
    cfg.optim.min_lr_ratio = ratio
    plan_error(cfg, "optim.min_lr_ratio", "[0, 1]", f"got {ratio}")


def test_grad_clip_non_negative():
    cfg = tiny()
    cfg.optim.grad_clip = -1.0
    plan_error(cfg, "optim.grad_clip", ">= 0", "0 disables", "got -1.0")


# --- what a valid plan derives -------------------------------------------------------------------

def test_null_dp_fills_the_gpus():
    cfg = tiny()
    cfg.parallel.tp, cfg.parallel.pp = 2, 2
    plan, _ = resolve(cfg, GPUS8)
    assert (plan.dims.dp, plan.world_size) == (2, 8)
    assert plan.grad_accum == 12 // (1 * 2)


def test_null_dp_fills_launcher_devices_without_gpus():
    cfg = tiny()
    cfg.launcher.gpus_per_node, cfg.parallel.tp = 4, 2
    plan, _ = resolve(cfg, CPU)
    assert (plan.dims.dp, plan.world_size) == (2, 4)


def test_null_dp_on_cpu_is_one():
    cfg = tiny()
    cfg.parallel.tp, cfg.parallel.pp = 3, 2
    plan, _ = resolve(cfg, CPU)
    assert (plan.dims.dp, plan.world_size, plan.grad_accum) == (1, 6, 12)


def test_explicit_dp_may_leave_devices_idle():
    cfg = tiny()
    cfg.parallel.dp = 2
    plan, _ = resolve(cfg, GPUS8)
    assert (plan.dims.dp, plan.world_size) == (2, 2)


def test_grad_accum_derived():
    cfg = tiny()
    cfg.parallel.dp, cfg.parallel.micro_batch_size = 3, 2
    plan, _ = resolve(cfg, CPU)
    assert plan.grad_accum == 2  # 12 = micro 2 x accumulation 2 x dp 3
    assert plan.tokens_per_step == 12 * 32


def test_vocab_padded_to_a_multiple_of_tp():
    cfg = tiny()
    cfg.parallel.tp = 3
    plan, hf_config = resolve(cfg, CPU)
    assert (plan.vocab_size, plan.padded_vocab_size) == (8000, 8001)
    assert hf_config.vocab_size == 8000  # the HF model keeps the real vocabulary; only shards are padded


def test_vocab_pad_multiple_scales_with_tp():
    cfg = tiny()
    cfg.parallel.tp, cfg.model.vocab_pad_multiple = 3, 16
    plan, _ = resolve(cfg, CPU)
    assert plan.padded_vocab_size == 8016  # next multiple of 16 x 3 = 48


def test_stage_bounds_gpt_tiny_pp2():
    cfg = tiny()
    cfg.parallel.pp, cfg.parallel.partition = 2, "blocks"
    plan, _ = resolve(cfg, CPU)
    assert plan.layer_names == ["embed", "pos_embed", "block.0", "block.1", "block.2", "block.3", "final_norm", "head"]
    assert plan.stage_bounds == [0, 4, 8]
    assert plan.stage_layers(0) == ["embed", "pos_embed", "block.0", "block.1"]
    assert plan.stage_layers(1) == ["block.2", "block.3", "final_norm", "head"]


def test_llama_has_no_position_layer():
    cfg = llama()
    cfg.parallel.pp, cfg.parallel.partition = 3, "blocks"
    plan, _ = resolve(cfg, CPU)
    assert plan.layer_names[:2] == ["embed", "block.0"]
    assert plan.stage_bounds == [0, 2, 3, 7]  # 4 blocks over 3 stages: the extra block goes last


def test_parameter_partition_balances_layer_parameters():
    cfg = llama()
    cfg.parallel.pp, cfg.parallel.partition = 2, "parameters"
    plan, hf_config = resolve(cfg, CPU)
    params = layer_params(cfg, hf_config)
    assert len(params) == len(plan.layer_names)
    assert plan.stage_bounds == balanced([float(p) for p in params], 2)


def test_fp16_accepted_where_supported():
    cfg = tiny()
    cfg.trainer.precision = "fp16"
    plan, _ = resolve(cfg, Machine(fp16_supported=True))
    assert plan.precision == "fp16"


def test_zero3_without_pipeline_accepted():
    cfg = tiny()
    cfg.parallel.zero_stage = 3
    plan, _ = resolve(cfg, CPU)
    assert plan.zero_stage == 3


@pytest.mark.parametrize("dp,precision,asked,used", [(1, "fp32", None, 0), (2, "fp32", None, 1), (1, "bf16", None, 1),
                                                     (1, "fp32", 1, 1), (2, "fp32", 0, 0), (1, "fp32", 2, 2)])
def test_zero_stage_default_follows_dp_and_precision(dp, precision, asked, used):
    cfg = tiny()
    cfg.parallel.dp, cfg.parallel.zero_stage, cfg.trainer.precision = dp, asked, precision
    plan, _ = resolve(cfg, CPU)
    assert plan.zero_stage == used  # null: none over a single fp32 replica, else ZeRO-1; asked: as asked


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_zero_0_in_half_precision_is_refused(precision, tp, pp):
    cfg = tiny()
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.zero_stage, cfg.trainer.precision = tp, pp, 0, precision
    plan_error(cfg, "parallel.zero_stage", "zero_stage=0", f"trainer.precision={precision}",
               "cannot be saved, resumed or re-sharded", "use parallel.zero_stage=1", machine=Machine(fp16_supported=True))
    cfg.parallel.zero_stage = None  # the default of 16-bit runs: ZeRO-1
    assert resolve(cfg, Machine(fp16_supported=True))[0].zero_stage == 1
    cfg.parallel.zero_stage, cfg.trainer.precision = 0, "fp32"
    assert resolve(cfg, Machine(fp16_supported=True))[0].zero_stage == 0


@pytest.mark.parametrize("stage", [0, 1])
def test_pipeline_with_zero_0_or_1_accepted(stage):
    cfg = tiny()
    cfg.parallel.pp, cfg.parallel.zero_stage = 2, stage
    plan, _ = resolve(cfg, CPU)
    assert (plan.dims.pp, plan.zero_stage) == (2, stage)


def test_plan_round_trips_as_dict():
    plan, _ = resolve(tiny(), CPU)
    data = plan.to_dict()
    assert type(plan).from_dict(data) == plan
    assert {k: data[k] for k in ("pp", "dp", "cp", "tp")} == plan.dims.degrees()  # plan.json's top-level degrees
    old = {k: v for k, v in data.items() if k != "cp"}  # a plan.json written before the cp axis existed
    assert type(plan).from_dict(old) == plan
