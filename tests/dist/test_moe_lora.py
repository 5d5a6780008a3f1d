"""LoRA on mixture-of-experts models (issue 30.6), through the real command line, against the real peft.

The adapters go where peft's ``all-linear`` puts them on transformers' MoE blocks: the attention projections
and Qwen2-MoE's shared expert (its ``gate_proj`` / ``up_proj`` / ``down_proj``, split Megatron-style over tp);
the fused 3-D experts are not ``nn.Linear`` modules, so they stay frozen (as in peft), and so do the routers.
Each run is checked as the dense LoRA runs are (:func:`helpers.lora_checks.check_lora_run`: losses 1e-4 against
peft's one-process run with the router aux term, the adapters equal peft's, the base bit for bit unchanged,
the memory estimate, and the exported adapter loaded by ``PeftModel.from_pretrained`` giving hybridtrain's
logits). With ``parallel.ep`` > 1 the frozen experts are still split over ep and dispatched by all-to-all; no
expert gradient exists, so no DeepSpeed expert group is made (``hybridtrain/models/stages.py``).

CI: Qwen2-MoE at dp = 2 x ep = 2 x pp = 2 (the shared expert adapted, experts over ep, a stage boundary).
Slow: Qwen2-MoE at (1, 1, 1) and at tp = 2 x ep = 2, Qwen3-MoE (attention only) at dp = 2 x ep = 2 under ZeRO-2,
DeepSeek-V3 with MLA's projections as targets (:data:`DEEPSEEK_TARGETS`) at tp = 2 x pp = 2 (the replicated
low-rank q_a_proj / kv_a_proj_with_mqa adapted, their adapters' gradients summed over tp) and at dp = 2 x ep = 2.
"""
from __future__ import annotations

import pytest

from helpers.launch import run_cli
from hybridtrain.errors import PlanError
from helpers.lora_checks import check_lora_run, peft_reference
from helpers.moe import twin_maker

STEPS = 4


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """Each MoE family's tiny checkpoint (router margins, aux loss on), made on first use."""
    return twin_maker(tmp_path_factory.mktemp("moe_lora"))


def _overrides(folder, *extra: str) -> list[str]:
    # a checkpoint at step STEPS-1 with the logits of step STEPS's first micro-batch, and one at STEPS
    return ["+recipe=finetune", f"model.pretrained={folder}", "finetune.method=lora", "finetune.lora.r=8",
            "finetune.lora.alpha=16", "data.seq_len=32", "trainer.global_batch_size=4", f"trainer.max_steps={STEPS}",
            "optim.lr=5e-3", "optim.warmup_steps=1", f"trainer.save_every={STEPS - 1}", "trainer.save_logits=true",
            *extra]


DEEPSEEK_TARGETS = "finetune.lora.target_modules=[kv_a_proj_with_mqa,kv_b_proj,o_proj,q_a_proj,q_b_proj]"
"""MLA's projections: peft 0.21 moves ``gate_proj`` / ``up_proj`` / ``down_proj`` targets of a DeepSeek-V3 model onto
its fused experts, so the plan refuses ``all-linear`` there under it (docs/errors.md); these load as written under any
peft."""


SHARED = {"qwen2_moe", "qwen3_5_moe_text"}
"""The families whose adapted targets include their shared expert's MLP."""


TARGETS = {
    "deepseek_v3": DEEPSEEK_TARGETS,
    "qwen3_5_moe_text": "finetune.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
}
"""The targets of the families where ``all-linear`` is refused (under some peft releases, for DeepSeek-V3)."""


def _check(family: str, twins, tmp_path, *layout: str, all_linear: bool = False) -> None:
    folder = twins(family)
    common = _overrides(folder, *((TARGETS[family],) if family in TARGETS and not all_linear else ()))
    try:
        want, adapters = peft_reference(tuple(common))
    except PlanError as err:
        if all_linear and "onto its fused experts" in str(err):
            pytest.skip(f"the installed peft would not load these targets as trained: {err}")
        raise
    shared = family in SHARED or all_linear
    assert any(".shared_expert" in name for name in adapters) == shared, sorted(adapters)
    assert not any(".experts." in name or ".mlp.gate." in name for name in adapters), sorted(adapters)
    run_cli(tmp_path / "run", *common, *layout, timeout=600)
    check_lora_run(tmp_path / "run", folder, want, adapters, tmp_path, STEPS)


def test_lora_on_an_moe_model_with_expert_parallelism_matches_peft(twins, tmp_path):
    _check("qwen2_moe", twins, tmp_path, "parallel.dp=2", "parallel.ep=2", "parallel.pp=2")


SLOW = {
    "qwen2_moe_1_1_1": ("qwen2_moe", ()),
    "qwen2_moe_tp2_ep2": ("qwen2_moe", ("parallel.dp=2", "parallel.tp=2", "parallel.ep=2")),
    "qwen3_moe_dp2_ep2_zero2": ("qwen3_moe", ("parallel.dp=2", "parallel.ep=2", "parallel.zero_stage=2")),
    "deepseek_v3_tp2_pp2": ("deepseek_v3", ("parallel.tp=2", "parallel.pp=2")),
    "deepseek_v3_dp2_ep2": ("deepseek_v3", ("parallel.dp=2", "parallel.ep=2")),
    "qwen3_5_moe_text_tp2_pp2": ("qwen3_5_moe_text", ("parallel.tp=2", "parallel.pp=2")),
}
"""Qwen3.5-MoE with the targets of :data:`TARGETS` (the plan refuses LoRA on its Gated DeltaNet ``linear_attn``: not
yet proven against peft, ``docs/errors.md``). Qwen3-Next has no slow case: without ``linear_attn`` and the MLP names
(which peft 0.21 would move onto its fused experts) only one attention block in four would train."""


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW))
def test_lora_on_moe_models_matches_peft_every_layout(case, twins, tmp_path):
    family, layout = SLOW[case]
    _check(family, twins, tmp_path, *layout)


@pytest.mark.slow
def test_all_linear_lora_on_deepseek_v3_matches_peft_where_peft_loads_it(twins, tmp_path):
    """``all-linear`` on DeepSeek-V3 (MLA's projections, the dense block's MLP and the shared experts) at tp = 2 x
    pp = 2, where the installed peft loads those paths as written (0.22; under 0.21 the plan refuses them and
    this test is skipped, saying so)."""
    _check("deepseek_v3", twins, tmp_path, "parallel.tp=2", "parallel.pp=2", all_linear=True)
