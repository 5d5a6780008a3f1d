"""The plan's mixture-of-experts rules (``hybridtrain/plan/moe.py``): ``parallel.ep`` and what MoE models
cannot do yet are refused before anything starts, each naming its key."""
from __future__ import annotations

import pytest
import torch

from helpers.config import compose
from hybridtrain.parallel.context import TPContext
from hybridtrain.plan import Machine, PlanError, resolve

CPU = Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=4)

TINY_MOE = ("+recipe=llama_tiny", "model=qwen3_moe", "model.config.hidden_size=64", "model.config.num_hidden_layers=2",
            "model.config.num_attention_heads=8", "model.config.num_key_value_heads=4", "+model.config.head_dim=16",
            "+model.config.num_experts=8", "+model.config.moe_intermediate_size=32",
            "+model.config.num_experts_per_tok=2", "model.config.intermediate_size=128",
            "~model.config.tie_word_embeddings")
"""A two-block Qwen3-MoE (8 experts, top-2) on the llama_tiny recipe."""

TINY_DEEPSEEK = ("+recipe=llama_tiny", "model=deepseek_v3", "model.config.hidden_size=64",
                 "model.config.num_attention_heads=8", "model.config.num_key_value_heads=8",
                 "+model.config.q_lora_rank=32", "+model.config.kv_lora_rank=32", "+model.config.qk_nope_head_dim=16",
                 "+model.config.qk_rope_head_dim=8", "+model.config.v_head_dim=12", "model.config.intermediate_size=128",
                 "+model.config.moe_intermediate_size=32", "+model.config.n_routed_experts=8",
                 "+model.config.n_shared_experts=1", "+model.config.num_experts_per_tok=2", "+model.config.n_group=4",
                 "+model.config.topk_group=2", "+model.config.first_k_dense_replace=1",
                 "~model.config.tie_word_embeddings", "trainer.precision=fp32")
"""A four-block DeepSeek-V3 (block 0 dense, 8 experts in 4 groups, top-2) on the llama_tiny recipe."""


def _error(*overrides: str) -> PlanError:
    with pytest.raises(PlanError) as info:
        resolve(compose(*overrides), CPU)
    return info.value


CASES = {  # id -> (overrides, key, fragments of the message)
    "ep_on_a_dense_model": (("+recipe=llama_tiny", "parallel.dp=2", "parallel.ep=2"), "parallel.ep",
                            ["parallel.ep=2: llama is a dense model", "use parallel.ep=1"]),
    "ep_not_dividing_dp": ((*TINY_MOE, "parallel.dp=3", "parallel.ep=2", "trainer.global_batch_size=12"), "parallel.ep",
                           ["parallel.ep=2 must divide the data-parallel degree dp=3", "use ep in [1]"]),
    "ep_not_dividing_experts": ((*TINY_MOE, "parallel.dp=4", "parallel.ep=4", "model.config.num_experts=6"),
                                "parallel.ep", ["must divide the 6 experts", "use ep in [1, 2]"]),
    "ep_with_zero3": ((*TINY_MOE, "parallel.dp=2", "parallel.ep=2", "parallel.zero_stage=3"),
                      "parallel.zero_stage", ["zero_stage=3 with parallel.ep=2", "use parallel.zero_stage=2"]),
    "ep_stage_without_experts": ((*TINY_MOE, "parallel.dp=2", "parallel.ep=2", "parallel.pp=2",
                                  "parallel.stage_layers=[3,2]"), "parallel.stage_layers",
                                 ["stage 1 (final_norm, head) holds no MoE block", "parallel.zero_stage=0"]),
    "ep_below_one": ((*TINY_MOE, "parallel.ep=0"), "parallel.ep", ["must be >= 1, got 0"]),
    "fp32_modules_in_fp16": (("model=gpt_oss", "trainer.precision=fp16"), "trainer.precision",
                             ["transformers keeps post_attention_layernorm, input_layernorm, norm of gpt_oss in fp32 "
                              "in fp16 models", "use trainer.precision=fp32 or bf16"]),
    "ep_stage_with_dense_blocks_only": ((*TINY_MOE, "+model.config.mlp_only_layers=[0]", "parallel.dp=2",
                                         "parallel.ep=2", "parallel.pp=2", "parallel.stage_layers=[2,3]"),
                                        "parallel.stage_layers", ["stage 0 (embed, block.0) holds no MoE block"]),
    "packing_with_aux": ((*TINY_MOE, "+model.config.output_router_logits=true", "data.packing=documents"),
                         "data.packing", ["with the router aux loss on", "model.config.output_router_logits=false"]),
    "deepseek_v3_in_bf16": ((*TINY_DEEPSEEK, "trainer.precision=bf16"), "trainer.precision",
                            ["trainer.precision=bf16: transformers keeps e_score_correction_bias, gate.weight of deepseek_v3 in fp32",
                             "use trainer.precision=fp32"]),
    "deepseek_v3_with_cp": ((*TINY_DEEPSEEK, "parallel.cp=2"), "parallel.cp",
                            ["parallel.cp=2: deepseek_v3 cannot run with context parallelism", "value heads narrower",
                             "use parallel.cp=1"]),
    "tp_not_dividing_the_experts": ((*TINY_MOE, "model.config.moe_intermediate_size=36", "parallel.tp=8"), "parallel.tp",
                                    ["must divide model.config.moe_intermediate_size=36"]),
}


def test_expert_parallel_runs_save_and_their_layout_names_ep():
    """Checkpoints of an ep > 1 run are planned like any other (saved every step, logits, the final save), and
    its checkpoint layout carries ep, so a resume under another ep is a layout change; at ep = 1 it has no ep
    key, as the layouts saved before expert parallelism."""
    plan, _ = resolve(compose(*TINY_MOE, "parallel.dp=2", "parallel.ep=2", "trainer.save_every=1",
                              "trainer.save_logits=true"), CPU)
    assert plan.layout()["ep"] == 2
    plan, _ = resolve(compose(*TINY_MOE, "parallel.dp=2"), CPU)
    assert "ep" not in plan.layout()


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_rule_names_the_key(case):
    overrides, key, fragments = CASES[case]
    err = _error(*overrides)
    assert err.key == key, str(err)
    for fragment in fragments:
        assert fragment in str(err), (fragment, str(err))


def _moved_by_peft(hf_config, targets: list[str]) -> list[str]:
    """The full-path LoRA targets the installed peft rewrites when it loads an adapter on this model (asked on a
    real, meta-device transformers model)."""
    peft = pytest.importorskip("peft")
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    config = peft.LoraConfig(r=8, target_modules=list(targets))
    convert_peft_config_for_transformers(config, model, None)
    return sorted(set(targets) - set(config.target_modules))


def test_lora_on_deepseek_v3_mlp_names_is_refused_exactly_where_the_installed_peft_moves_them():
    """DeepSeek-V3's dense blocks' MLP and its shared experts carry the names (``gate_proj``, ``up_proj``,
    ``down_proj``) peft's transformers-5 conversion may rewrite onto the fused experts; peft 0.21 did for any
    target ending in them, 0.22 keeps a target naming only ``nn.Linear`` modules. The plan refuses ``all-linear``
    (naming the key, the names and the targets that load as written) exactly when the installed peft moves one,
    and otherwise plans the dense MLP and the shared experts as targets."""
    _, hf_config = resolve(compose(*TINY_DEEPSEEK), CPU)
    mlp = [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")] + [
        f"model.layers.{i}.mlp.shared_experts.{p}" for i in (1, 2, 3) for p in ("gate_proj", "up_proj", "down_proj")]
    attention = [f"model.layers.{i}.self_attn.{p}" for i in range(4)
                 for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")]
    moved = _moved_by_peft(hf_config, mlp + attention)
    assert set(moved) <= set(mlp), moved  # MLA's projections load as written under any peft
    cfg = compose(*TINY_DEEPSEEK, "finetune.method=lora")
    if moved:
        err = _error(*TINY_DEEPSEEK, "finetune.method=lora")
        assert err.key == "finetune.lora.target_modules", str(err)
        for fragment in ("of a deepseek_v3 model onto its fused experts",
                         "target_modules=[kv_a_proj_with_mqa,kv_b_proj,o_proj,q_a_proj,q_b_proj]"):
            assert fragment in str(err), (fragment, str(err))
        return
    from hybridtrain.plan.lora import check_lora

    plan, hf_config = resolve(cfg, CPU)
    spec = check_lora(cfg, hf_config, plan)
    assert set(mlp + attention) <= spec.targets, sorted(set(mlp + attention) - spec.targets)


def test_an_moe_model_plans():
    plan, hf_config = resolve(compose(*TINY_MOE, "parallel.tp=2", "parallel.pp=2"), CPU)
    assert plan.dims.tp == 2 and plan.dims.pp == 2 and hf_config.num_experts == 8


def test_fp32_kept_models_plan_with_the_default_precision_on_cpus():
    """gpt-oss and DeepSeek-V3 (modules transformers keeps in fp32) plan with ``trainer.precision`` left null on a
    CPU machine: the 16-bit refusal reads the resolved precision (fp32 there), not the null."""
    for model in (("model=gpt_oss",), tuple(o for o in TINY_DEEPSEEK if o != "trainer.precision=fp32")):
        cfg = compose(*model)
        assert cfg.trainer.precision is None
        plan, _ = resolve(cfg, CPU)
        assert str(cfg.trainer.precision) == "fp32", model


def _tiny_moe_config():
    from helpers.moe import moe_config

    config = moe_config("qwen3_moe")
    config._attn_implementation = "sdpa"
    return config


def test_block_flops_count_the_router_and_the_top_k_experts_only(tmp_path, monkeypatch):
    """An MoE block's linear FLOPs per token: attention's linears, the router (2 H E) and top_k of the E
    experts (2 x 2I x H + 2 x H x I each), by hand; a dense count of all E experts would be 4x that."""
    from hybridtrain.models.families import get_family
    from hybridtrain.models.shapes import block_shapes

    monkeypatch.setenv("HYBRIDTRAIN_CACHE", str(tmp_path))
    cfg = _tiny_moe_config()
    h, heads, kv, hd, e, k, i = 64, 8, 4, 16, 8, 2, 32
    attention = 2 * h * (heads * hd) + 2 * 2 * h * (kv * hd) + 2 * (heads * hd) * h  # q, k, v, o
    want = attention + 2 * h * e + k * (2 * (2 * i) * h + 2 * h * i)
    assert block_shapes(get_family("qwen3_moe"), cfg).linear_flops == {"moe": float(want)}


def test_the_plan_command_shows_the_experts_per_rank():
    from hybridtrain.plan.report import build_report, format_report

    cfg = compose(*TINY_MOE, "parallel.tp=2")
    plan, hf_config = resolve(cfg, CPU)
    report = build_report(cfg, plan, hf_config, device_memory=0)
    e = report.experts
    assert (e.num_experts, e.top_k, e.moe_blocks, e.per_rank_experts, e.per_rank_width) == (8, 2, 2, 8, 16)
    assert e.expert_params == 2 * 8 * (2 * 32 * 64 + 64 * 32)
    assert e.active_params == e.total_params - e.expert_params * 6 // 8
    assert "8 routed experts in each of 2 MoE blocks, top-2, width 32; per rank 8 experts x width 16" in format_report(report)
    dense = compose("+recipe=llama_tiny")
    plan, hf_config = resolve(dense, CPU)
    assert build_report(dense, plan, hf_config, device_memory=0).experts is None


def test_expert_parallel_memory_counts_experts_per_rank():
    """At ep = 2 a rank holds half the experts (and ZeRO-1 partitions their state over dp / ep = 2 ranks), the
    rest of the model as at ep = 1; the plan shows the layout with its expert view."""
    from hybridtrain.plan.costs import model_facts, stage_params
    from hybridtrain.plan.memory import rank_memory
    from hybridtrain.models.families import get_family

    plans = {ep: resolve(compose(*TINY_MOE, "parallel.dp=4", f"parallel.ep={ep}", "parallel.zero_stage=0"), CPU)
             for ep in (1, 2)}
    (p1, hf), (p2, _) = plans[1], plans[2]
    assert p2.dims.ep == 2 and p2.dims.product() == "dp=4 x tp=1 x pp=1 (experts over ep=2 of the dp ranks)"
    facts = model_facts(get_family("qwen3_moe"), hf, p1.seq_len)
    experts = 2 * 8 * (2 * 32 * 64 + 64 * 32)  # 2 blocks x 8 experts x (gate_up + down)
    assert stage_params(facts, p1.stage_bounds, 0, 1, 1) - stage_params(facts, p2.stage_bounds, 0, 1, 2) == experts // 2
    mem = {ep: rank_memory(facts, p.stage_bounds, 0, p.dims, zero=0, precision="fp32", micro_batch=1, micro_batches=3,
                           checkpointing=False) for ep, (p, _) in plans.items()}
    assert mem[1].params - mem[2].params == 4 * experts // 2  # fp32 weights of the experts this rank no longer holds
    assert mem[1].optim - mem[2].optim == 8 * experts // 2


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_dense_blocks_of_an_moe_model_have_the_dense_mlp_plan(model_type):
    """``mlp_only_layers=[0]``: block 0 is the ``dense`` variant, whose plan splits a plain MLP (gate and up
    column-wise, down row-wise, "f" on ``mlp``) and names no experts (nor a shared expert); the other blocks keep
    the experts' plan ("f" on the experts' inputs only). Each plan names modules of its own blocks only, every
    column-parallel linear sits under an input-copy module, and sharding each variant's block (tp = 1) replaces
    exactly its planned modules and keeps its output."""
    from transformers import AutoModelForCausalLM

    from helpers.moe import moe_config
    from hybridtrain.models.build import shard_block
    from hybridtrain.models.families import get_family
    from hybridtrain.models.units import block_variants
    from hybridtrain.parallel.context import TPContext

    family = get_family(model_type)
    hf = moe_config(model_type, mlp_only_layers=[0])
    assert block_variants(family, hf) == ["dense", "moe", "moe", "moe"]
    dense, routed = family.block_plan(hf, 0), family.block_plan(hf, 1)
    assert {n: r.style for n, r in dense.items() if n.startswith("mlp")} == {
        "mlp.gate_proj": "column", "mlp.up_proj": "column", "mlp.down_proj": "row"}
    assert routed["mlp.experts"].style == "experts" and "mlp.gate_proj" not in routed
    assert family.input_copy_of("dense") == ("self_attn", "mlp") and "mlp" not in family.input_copy_of("moe")
    assert routed == family.tp_plan  # the routed blocks' plan is the family's default
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa").eval()
    x = torch.randn(2, 5, int(hf.hidden_size))  # [B, S, H]
    positions = torch.arange(5).expand(2, 5)
    kwargs = {"position_ids": positions, "position_embeddings": model.model.rotary_emb(x, positions)}
    for index in (0, 1):
        variant = family.variant_of(hf, index)
        plan, copies = family.plan_of(variant), family.input_copy_of(variant)
        for name, rule in plan.items():
            if rule.style == "column":
                assert any(name == c or name.startswith(f"{c}.") for c in copies), (variant, name)
        block = model.model.layers[index]
        with torch.no_grad():
            want = block(x, **kwargs)
        before = {name: type(block.get_submodule(name)) for name in plan}
        shard_block(block, family, hf, TPContext(), variant=variant)
        replaced = {name for name in plan if type(block.get_submodule(name)) is not before[name]}
        assert replaced == {n for n, r in plan.items() if r.style in ("column", "row")}, variant
        with torch.no_grad():
            got = block(x, **kwargs)
        torch.testing.assert_close(got, want)


def test_a_model_mixing_dense_and_moe_blocks_plans_each_variant():
    """A dense block 0 and three MoE blocks at tp = 2 x pp = 2: the plan resolves; the experts are those of the
    MoE blocks only (one in the plan's two-block twin), the dense block's MLP is split over tp (its sharded
    parameters are the MLP's and attention's), and its FLOPs are the dense MLP's."""
    from hybridtrain.models.families import get_family
    from hybridtrain.plan.costs import model_facts
    from hybridtrain.plan.report import build_report

    cfg = compose(*TINY_MOE, "+model.config.mlp_only_layers=[0]", "parallel.tp=2", "parallel.pp=2")
    plan, hf = resolve(cfg, CPU)
    assert plan.dims.tp == 2 and plan.dims.pp == 2
    e = build_report(cfg, plan, hf, device_memory=0).experts
    assert e.moe_blocks == 1 and e.expert_params == 8 * (2 * 32 * 64 + 64 * 32)
    facts = model_facts(get_family("qwen3_moe"), hf, plan.seq_len)
    dense, routed = (next(u for u in facts.units if u.unit.name == f"block.{i}") for i in (0, 1))
    h, q, kv, mlp = 64, 8 * 16, 4 * 16, 128
    attention = h * q + 2 * h * kv + q * h  # q, k, v, o (no biases)
    assert sum(dense.experts) == 0 and sum(dense.sharded) == attention + 3 * h * mlp
    assert sum(routed.experts) == e.expert_params and sum(routed.sharded) == attention
    assert dense.flops != routed.flops


def test_deepseek_v3_plans_mla_split_by_heads_and_its_dense_block():
    """DeepSeek-V3 at tp = 2 x pp = 2: MLA's low-rank projections and their norms replicated with their gradients
    summed over tp, the up-projections column-parallel (``q_b_proj``; ``q_proj`` only without a ``q_lora_rank``),
    ``o_proj`` row-parallel; block 0 (``first_k_dense_replace``) the dense variant (its MLP split, no experts or
    shared experts), the others the experts and shared experts; the router aux term never on (transformers' loss
    has none), ``e_score_correction_bias`` among the buffers a checkpoint keeps."""
    from hybridtrain.models.families import get_family
    from hybridtrain.models.moe import carries_aux
    from hybridtrain.models.units import block_variants

    cfg = compose(*TINY_DEEPSEEK, "parallel.tp=2", "parallel.pp=2", "+model.config.output_router_logits=true")
    plan, hf = resolve(cfg, CPU)
    family = get_family("deepseek_v3")
    assert plan.dims.tp == 2 and block_variants(family, hf) == ["dense", "moe", "moe", "moe"]
    dense, routed = family.block_plan(hf, 0), family.block_plan(hf, 1)
    for p in (dense, routed):
        assert {n: p[n].style for n in p if n.startswith("self_attn.")} == {
            "self_attn.q_proj": "column", "self_attn.q_a_proj": "grad_sum_linear", "self_attn.q_a_layernorm": "grad_sum",
            "self_attn.q_b_proj": "column", "self_attn.kv_a_proj_with_mqa": "grad_sum_linear",
            "self_attn.kv_a_layernorm": "grad_sum", "self_attn.kv_b_proj": "column", "self_attn.o_proj": "row"}
    assert {n: r.style for n, r in dense.items() if n.startswith("mlp.")} == {
        "mlp.gate_proj": "column", "mlp.up_proj": "column", "mlp.down_proj": "row"}
    assert {n: r.style for n, r in routed.items() if n.startswith("mlp.")} == {
        "mlp.experts": "experts", "mlp.shared_experts.gate_proj": "column", "mlp.shared_experts.up_proj": "column",
        "mlp.shared_experts.down_proj": "row"}
    assert family.input_copy_of("moe") == ("self_attn", "mlp.shared_experts")
    assert family.input_copy_of("dense") == ("self_attn", "mlp")
    assert not carries_aux(family, hf) and hf.output_router_logits
    assert family.saved_buffers == ("mlp.gate.e_score_correction_bias",)
    from hybridtrain.plan.report import build_report

    e = build_report(cfg, plan, hf, device_memory=0).experts
    assert (e.num_experts, e.top_k, e.moe_blocks, e.per_rank_width) == (8, 2, 3, 16)
    from hybridtrain.plan.flops import block_forward_flops

    # scores over query/key heads of 16 + 8 and the weighted sum over value heads of 12 (not head_dim = 8, the rope part)
    assert block_forward_flops(family, hf, 32, 0.0) == 2 * 32 * 8 * (24 + 12)


def test_deepseek_v3_shards_only_the_modules_its_config_builds():
    """With a ``q_lora_rank`` transformers builds no ``q_proj`` (the attribute is ``None``), without one no
    ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``: the plan's entries for what is absent are skipped, and an
    entry naming no attribute at all is still an error."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from helpers.moe import moe_config
    from hybridtrain.models.build import shard_block
    from hybridtrain.models.families import TPRule, get_family
    from hybridtrain.parallel.context import TPContext
    from hybridtrain.parallel.layers import ColumnParallelLinear

    family = get_family("deepseek_v3")
    for rank, present, absent in ((32, "q_b_proj", "q_proj"), (None, "q_proj", "q_b_proj")):
        hf = moe_config("deepseek_v3", q_lora_rank=rank)
        block = AutoModelForCausalLM.from_config(hf).model.layers[1]
        shard_block(block, family, hf, TPContext(), variant="moe")
        assert isinstance(getattr(block.self_attn, present), ColumnParallelLinear)
        assert getattr(block.self_attn, absent) is None
    broken = dataclasses.replace(family, tp_rules={**family.tp_rules, "self_attn.no_such_proj": TPRule("column")})
    broken.__dict__.pop("tp_plan", None)
    with pytest.raises(ValueError, match="'self_attn.no_such_proj'.*not a module"):
        shard_block(AutoModelForCausalLM.from_config(hf).model.layers[1], broken, hf, TPContext(), variant="moe")


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe"])
def test_every_rank_of_an_moe_model_starts_from_the_reference_weights(model_type):
    """From scratch (no checkpoint), the seeded initialisation of a dense block 0 and an MoE block 1 (the router, its
    DeepSeek-V3 routing bias, the experts, MLA's low-rank projections) at tp = 2, each rank filling only its tiles,
    equals the one-process reference model sharded by the block's variant plan."""
    import copy

    from helpers.moe import moe_config
    from hybridtrain.models.build import ModelBuilder, shard_block
    from hybridtrain.models.families import get_family, padded_vocab
    from hybridtrain.models.hf_model import meta_model, reference_model

    family = get_family(model_type)
    config = moe_config(model_type, **({"mlp_only_layers": [0]} if model_type == "qwen3_moe" else {}))
    config._attn_implementation = "eager"
    model = reference_model(config, family, 1234)
    for rank in range(2):
        tp = TPContext(rank=rank, size=2)
        builder = ModelBuilder(family=family, hf_config=config, hf_model=meta_model(config), seed=1234, tp=tp,
                               padded_vocab=padded_vocab(int(config.vocab_size), 2, 16))
        for index in (0, 1):
            want = copy.deepcopy(model.get_submodule(f"{family.blocks}.{index}"))
            shard_block(want, family, config, tp, variant=family.variant_of(config, index))
            got = builder.block(index)
            state, ref = got.state_dict(), want.state_dict()
            assert state.keys() == ref.keys(), (index, sorted(set(state) ^ set(ref)))
            for name, value in ref.items():
                assert torch.equal(state[name], value), (model_type, rank, index, name)


def test_gpt_oss_plans_in_bf16_as_transformers_keeps_its_norms_in_fp32_under_fp16_only():
    """transformers keeps gpt-oss's norms (``_keep_in_fp32_modules``) in fp32 in fp16 models only: a bf16 gpt-oss is
    all bf16 there, so the plan takes it (and refuses fp16, above); DeepSeek-V3's strict list holds in bf16 too."""
    from hybridtrain.plan.moe import fp32_modules

    cfg = compose("model=gpt_oss", "trainer.precision=bf16")
    plan, hf = resolve(cfg, CPU)
    assert plan.precision == "bf16"
    assert fp32_modules(hf, "bf16") == [] and fp32_modules(hf, "fp32") == []
    assert fp32_modules(hf, "fp16") == ["post_attention_layernorm", "input_layernorm", "norm"]
    _, deepseek = resolve(compose(*TINY_DEEPSEEK), CPU)
    assert set(fp32_modules(deepseek, "bf16")) == {"e_score_correction_bias", "gate.weight"}


@pytest.mark.parametrize("blocks,extra", [(4, ()), (4, ("+model.config.mlp_only_layers=[3]",)), (3, ())],
                         ids=["four_moe_blocks", "last_block_dense", "three_blocks"])
def test_the_balanced_partition_puts_an_moe_block_on_every_stage_at_ep_2(blocks, extra):
    """Fault probe 41.6: at dp = 2 x ep = 2 x pp = 2 with ZeRO-1 the balanced partition put every block on stage 0
    (the head's cost) and the plan then refused its own choice ("stage 1 (final_norm, head) holds no MoE block").
    The partitioner takes the rule as its constraint: each stage holds an MoE block, a dense one not counting."""
    from hybridtrain.models.units import block_index, kind_of, Kind

    plan, hf = resolve(compose(*TINY_MOE, f"model.config.num_hidden_layers={blocks}", *extra, "parallel.dp=2",
                               "parallel.ep=2", "parallel.pp=2"), CPU)
    dense = set(getattr(hf, "mlp_only_layers", None) or [])
    b = plan.stage_bounds
    for s in range(2):
        names = plan.layer_names[b[s]:b[s + 1]]
        assert any(kind_of(n) is Kind.BLOCK and block_index(n) not in dense for n in names), (s, names)


GPU1 = Machine(gpus_per_node=8, fp16_supported=True, cpu_cores=64, device_memory_bytes=80 * 2**30)
"""A node of eight 80 GB GPUs (the plan rules that hold only where CUDA's kernels run)."""


@pytest.mark.parametrize("overrides,key,fragments", [
    (("model.config.moe_intermediate_size=36", "parallel.tp=2"), "parallel.tp",
     ["expert's slice is model.config.moe_intermediate_size/tp = 36/2 = 18 wide, not a multiple of 8",
      "no tp fits a width of 36: use an expert width that 8 divides, or trainer.precision=fp32"]),
    (("model.config.moe_intermediate_size=48", "parallel.tp=4"), "parallel.tp",
     ["48/4 = 12 wide, not a multiple of 8", "use tp in [1, 2]"]),
    (("model.config.hidden_size=68",), "model.config.hidden_size",
     ["hidden_size=68 is not a multiple of 8", "or trainer.precision=fp32"]),
], ids=["tp2_bf16", "tp4_bf16", "hidden"])
def test_a_gpu_plan_refuses_expert_slices_grouped_mm_cannot_take(overrides, key, fragments):
    """GPU review 3, finding 10: CUDA's grouped_mm wants 16-byte rows (8 bf16 values, 4 fp32 ones) of the experts'
    H-wide and I/tp-wide weights; a CPU plan of the same config plans (its kernel checks nothing)."""
    base = (*TINY_MOE, "trainer.precision=bf16", "parallel.zero_stage=1", *overrides)
    with pytest.raises(PlanError) as info:
        resolve(compose(*base), GPU1)
    assert info.value.key == key
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    resolve(compose(*(*TINY_MOE, *overrides)), CPU)  # the CPU's kernel takes it
    if key == "parallel.tp":  # 4 fp32 values are 16 bytes: the 12-wide slice is aligned there
        fp32 = (*TINY_MOE, "trainer.precision=fp32", "parallel.zero_stage=1", "model.config.moe_intermediate_size=48", "parallel.tp=4")
        resolve(compose(*fp32), GPU1)


@pytest.mark.parametrize("ep,crosses", [(2, False), (4, True)])
def test_the_plan_warns_where_expert_groups_cross_nodes(ep, crosses):
    """GPU review 3, finding 15: two nodes of 2 GPUs at dp = 4: ep = 2 keeps each expert group on a node (dp
    still crosses), ep = 4 sends every MoE layer's all-to-all over the network, which the plan report says."""
    from hybridtrain.plan.report import build_report

    cfg = compose(*TINY_MOE, "launcher=slurm", "launcher.nodes=2", "launcher.gpus_per_node=2",
                  "launcher.gpu_type=h100-80gb", "parallel.zero_stage=1", f"parallel.ep={ep}",
                  "trainer.global_batch_size=8")
    plan, hf = resolve(cfg, CPU)
    assert "dp" in plan.dims.crossing(plan.nodes)
    warned = [w for w in build_report(cfg, plan, hf, 0).warnings if "expert groups cross nodes" in w]
    assert bool(warned) == crosses, warned
