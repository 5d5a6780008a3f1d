"""Mixture-of-experts families train under dp x tp x pp exactly like plain transformers, router aux loss
included.

A tiny ``save_pretrained`` MoE twin (``tests/helpers/moe.py``: routers with a clear top-k margin,
``output_router_logits`` on, ``router_aux_loss_coef=0.02``) is fine-tuned through the real CLI and compared
step by step with the one-process oracle (transformers' ``from_pretrained`` + torch AdamW,
:func:`hybridtrain.reference.reference_run`, whose step takes the aux term as the mean over the step's eight
micro-batches, as hybridtrain does): losses within 1e-4, gradient norms within 1e-3. The CI layout
(tp = 2 x pp = 2) carries the router sums across a stage boundary and splits the experts over TP, and its
checkpoint (fused 3-D expert tensors in ``hf/``) exports to an HF folder whose transformers logits equal
hybridtrain's (``trainer.save_logits``, 1e-5); the plan's model-state estimate is within 10% of what rank 0
measured. The slow tier adds dp = 2, tp = 2 and pp = 2 alone and all three together, activation
checkpointing, and a resume under another layout (the fused expert tensors read back and re-split).

Expert parallelism (``parallel.ep``): in CI dp = 4 x ep = 2 under ZeRO-1 (each rank holds 4 of the 8 experts;
their gradients are reduced over the 2 ranks holding the same experts and their optimizer state partitioned
there, DeepSpeed's MoE groups), with the memory estimate; slow: ep = 2 with tp = 2, with pp = 2 (ZeRO-0, and
ZeRO-1 with an MoE block on every stage), and ep = 4 (2 experts a rank).
"""
from __future__ import annotations

import pytest

from helpers.config import compose
from helpers.launch import metrics, run_cli
from helpers.moe import make_moe_checkpoint, moe_overrides, twin_maker

STEPS = 3
CI_LAYOUT = (1, 2, 2)
SLOW_LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)]
CI_FAMILY_LAYOUT = {"mixtral": (2, 2, 1), "olmoe": (1, 2, 2), "qwen2_moe": (2, 1, 2), "gpt_oss": (1, 2, 2),
                    "deepseek_v3": (1, 2, 2), "qwen3_5_moe_text": (1, 2, 2), "qwen3_next": (2, 2, 1)}
"""One layout per further MoE family in CI (Qwen3-MoE runs the full set below)."""


@pytest.fixture(scope="module")
def moe_twins(tmp_path_factory):
    """Each MoE family's tiny checkpoint, made on first use."""
    return twin_maker(tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def qwen3_moe(moe_twins):
    return moe_twins("qwen3_moe")


def _common(folder) -> list[str]:
    return moe_overrides(folder, STEPS)


@pytest.fixture(scope="module")
def oracle(qwen3_moe):
    """The one-process transformers + AdamW records, computed once."""
    from hybridtrain.plan import apply_pretrained_defaults
    from hybridtrain.reference import reference_run

    cfg = compose(*_common(qwen3_moe))
    apply_pretrained_defaults(cfg)
    return reference_run(cfg)


def _check(layout, folder, oracle, run_dir, *extra: str) -> None:
    dp, tp, pp = layout
    given = {e.split("=")[0] for e in extra}  # a layout key in extra (the cp cases) replaces the layout's
    axes = [f"parallel.{k}={v}" for k, v in (("dp", dp), ("tp", tp), ("pp", pp)) if f"parallel.{k}" not in given]
    run_cli(run_dir, *_common(folder), *axes, *extra, timeout=600)
    got = metrics(run_dir)
    assert len(got) == len(oracle) == STEPS
    for g, w in zip(got, oracle):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4), f"{layout} step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-3), f"{layout} step {g['step']}"


def test_moe_layout_equals_transformers(qwen3_moe, oracle, tmp_path):
    from hybridtrain.export import check_logits, export
    from hybridtrain.plan.estimate import estimate_for_run

    _check(CI_LAYOUT, qwen3_moe, oracle, tmp_path, f"trainer.save_every={STEPS - 1}", "trainer.save_logits=true")
    checkpoint = tmp_path / "checkpoints" / f"step_{STEPS - 1}"
    export(checkpoint, tmp_path / "hf_export")
    diff, scale = check_logits(checkpoint, tmp_path / "hf_export")
    assert 0 < scale and diff <= 1e-5 * max(1.0, scale), f"export logits differ by {diff}"
    measured = metrics(tmp_path)[0]["model_state_bytes"]["total"]
    estimated = estimate_for_run(tmp_path, stage=0).model_state
    assert abs(estimated - measured) <= 0.1 * measured, f"estimate {estimated} vs measured {measured}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW_LAYOUTS, ids=lambda l: "dp{}_tp{}_pp{}".format(*l))
def test_every_moe_layout_equals_transformers(layout, qwen3_moe, oracle, tmp_path):
    _check(layout, qwen3_moe, oracle, tmp_path)


@pytest.mark.slow
def test_moe_with_activation_checkpointing_equals_transformers(qwen3_moe, oracle, tmp_path):
    _check((1, 2, 2), qwen3_moe, oracle, tmp_path, "parallel.activation_checkpointing=true")


@pytest.mark.slow
def test_moe_resume_under_another_layout_continues_the_losses(qwen3_moe, tmp_path):
    """Steps 1-2 at tp = 2 x pp = 2, a checkpoint, steps 3-4 at dp = 2: the oracle's four losses."""
    common = [*_common(qwen3_moe), "trainer.max_steps=4"]
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    run_cli(first, *common, "parallel.tp=2", "parallel.pp=2", "trainer.save_every=2")
    run_cli(resumed, *common, "parallel.dp=2", f"trainer.resume={first / 'checkpoints' / 'step_2'}")
    from hybridtrain.plan import apply_pretrained_defaults
    from hybridtrain.reference import reference_run

    cfg = compose(*common)
    apply_pretrained_defaults(cfg)
    want = [r["loss"] for r in reference_run(cfg)]
    got = [m["loss"] for m in metrics(first)][:2] + [m["loss"] for m in metrics(resumed)]
    assert got == pytest.approx(want, rel=1e-4)


NO_SAVE = ("trainer.save_final=false",)
"""The expert-parallel layouts here check training; their checkpoints are tested in test_moe_checkpoints.py."""
EP_SLOW = {
    "dp2_tp2_ep2": ((2, 2, 1), ("parallel.ep=2",)),
    "dp2_pp2_ep2_zero0": ((2, 1, 2), ("parallel.ep=2", "parallel.zero_stage=0")),
    "dp2_pp2_ep2_zero1": ((2, 1, 2), ("parallel.ep=2", "parallel.stage_layers=[3,4]")),
    "dp4_ep4": ((4, 1, 1), ("parallel.ep=4",)),
}


def test_expert_parallel_layout_equals_transformers(qwen3_moe, oracle, tmp_path):
    from hybridtrain.plan.estimate import estimate_for_run

    _check((4, 1, 1), qwen3_moe, oracle, tmp_path, "parallel.ep=2", *NO_SAVE)
    measured = metrics(tmp_path)[0]["model_state_bytes"]["total"]
    estimated = estimate_for_run(tmp_path, stage=0).model_state
    assert abs(estimated - measured) <= 0.1 * measured, f"estimate {estimated} vs measured {measured}"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(EP_SLOW))
def test_every_expert_parallel_layout_equals_transformers(case, qwen3_moe, oracle, tmp_path):
    layout, extra = EP_SLOW[case]
    _check(layout, qwen3_moe, oracle, tmp_path, *extra, *NO_SAVE)


@pytest.fixture(scope="module")
def family_oracle(moe_twins):
    """The one-process transformers + AdamW records of each MoE family, computed once."""
    from hybridtrain.plan import apply_pretrained_defaults
    from hybridtrain.reference import reference_run

    cache: dict[str, list[dict]] = {}

    def get(family: str) -> list[dict]:
        if family not in cache:
            cfg = compose(*_common(moe_twins(family)))
            apply_pretrained_defaults(cfg)
            cache[family] = reference_run(cfg)
        return cache[family]

    return get


@pytest.mark.parametrize("family", sorted(CI_FAMILY_LAYOUT))
def test_moe_family_layout_equals_transformers(family, moe_twins, family_oracle, tmp_path):
    """Mixtral (sliding window, its published checkpoint names), OLMoE (full-width q/k norm, sharded),
    Qwen2-MoE (the gated shared expert split over tp) and DeepSeek-V3 (MLA split by heads with its low-rank
    projections' gradients summed over tp, a dense block 0, the group-limited sigmoid router, whose routing bias
    the export carries), Qwen3.5-MoE (Gated DeltaNet blocks split by heads beside gated full attention, a gated
    shared expert) and Qwen3-Next (its fused q|k|v|z and b|a projections split by key-head groups, a dense block 1),
    with their export logits."""
    from hybridtrain.export import check_logits, export

    _check(CI_FAMILY_LAYOUT[family], moe_twins(family), family_oracle(family), tmp_path,
           f"trainer.save_every={STEPS - 1}", "trainer.save_logits=true")
    checkpoint = tmp_path / "checkpoints" / f"step_{STEPS - 1}"
    export(checkpoint, tmp_path / "hf_export")
    diff, scale = check_logits(checkpoint, tmp_path / "hf_export")
    assert 0 < scale and diff <= 1e-5 * max(1.0, scale), f"{family}: export logits differ by {diff}"


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(CI_FAMILY_LAYOUT))
def test_moe_family_expert_parallel_equals_transformers(family, moe_twins, family_oracle, tmp_path):
    _check((2, 1, 1), moe_twins(family), family_oracle(family), tmp_path, "parallel.ep=2", *NO_SAVE)


@pytest.mark.parametrize("extra", [
    pytest.param(("parallel.cp=2",), id="cp2"),
    pytest.param(("parallel.cp=2", "parallel.tp=2", "parallel.pp=2"), id="cp2_tp2_pp2", marks=pytest.mark.slow),
    pytest.param(("parallel.dp=2", "parallel.cp=2", "parallel.ep=2", "trainer.save_final=false"), id="dp2_cp2_ep2",
                 marks=pytest.mark.slow)])
def test_moe_context_parallel_equals_transformers(extra, qwen3_moe, oracle, tmp_path):
    """Context parallelism on an MoE model (issue 31.1): each cp rank routes its chunks of the rows, the router
    aux term is formed from the sums over the cp group; losses and gradient norms are transformers'."""
    _check((1, 1, 1), qwen3_moe, oracle, tmp_path, *extra)


GPT_OSS_SLOW = {"dp2_tp2_pp2": ((2, 2, 2), ()), "cp2": ((1, 1, 1), ("parallel.cp=2",)),
                "dp2_tp2_ep2": ((2, 2, 1), ("parallel.ep=2", *NO_SAVE)),
                "tp2_pp2_checkpointed": ((1, 2, 2), ("parallel.activation_checkpointing=true", *NO_SAVE))}
"""gpt-oss beyond its CI layout (its dp = 2 x ep = 2 runs in ``test_moe_family_expert_parallel_equals_transformers``):
all three axes, context parallelism (the eager attention with its sinks on the gathered keys, alternating sliding
and full layers), the interleaved experts split over tp and ep at once, and activation checkpointing at tp = 2 (the
recomputed experts add the down projection's bias once again)."""


@pytest.mark.slow
@pytest.mark.parametrize("case", list(GPT_OSS_SLOW))
def test_gpt_oss_layout_equals_transformers(case, moe_twins, family_oracle, tmp_path):
    layout, extra = GPT_OSS_SLOW[case]
    _check(layout, moe_twins("gpt_oss"), family_oracle("gpt_oss"), tmp_path, *extra)


MIXED = {"mlp_only_layers": [0]}
"""Qwen3-MoE whose block 0 has a dense MLP (``mlp_only_layers``) and blocks 1-3 routed experts."""


@pytest.fixture(scope="module")
def mixed_twin(tmp_path_factory):
    """The Qwen3-MoE twin with a dense block 0, and its one-process transformers + AdamW records."""
    from hybridtrain.plan import apply_pretrained_defaults
    from hybridtrain.reference import reference_run

    folder = make_moe_checkpoint(tmp_path_factory.mktemp("moe_mixed") / "qwen3_moe", "qwen3_moe", **MIXED)
    cfg = compose(*_common(folder))
    apply_pretrained_defaults(cfg)
    return folder, reference_run(cfg)


def test_dense_and_moe_blocks_equal_transformers(mixed_twin, tmp_path):
    """A model mixing a dense block and MoE blocks at tp = 2 x pp = 2: the dense block's MLP split Megatron-style
    ("f" on the MLP), the MoE blocks' experts by the experts style, the router sums counted over the MoE blocks
    only; its checkpoint exports to an HF folder whose transformers logits equal hybridtrain's."""
    from hybridtrain.export import check_logits, export

    folder, records = mixed_twin
    _check((1, 2, 2), folder, records, tmp_path, f"trainer.save_every={STEPS - 1}", "trainer.save_logits=true")
    checkpoint = tmp_path / "checkpoints" / f"step_{STEPS - 1}"
    export(checkpoint, tmp_path / "hf_export")
    diff, scale = check_logits(checkpoint, tmp_path / "hf_export")
    assert 0 < scale and diff <= 1e-5 * max(1.0, scale), f"export logits differ by {diff}"


@pytest.mark.slow
def test_dense_and_moe_blocks_expert_parallel_equals_transformers(mixed_twin, tmp_path):
    """The same model at dp = 2 x ep = 2: the dense block holds no experts (no expert group, marker or dispatch),
    its parameters are data-parallel over dp; the gradient norm counts the MoE blocks' experts once."""
    folder, records = mixed_twin
    _check((2, 1, 1), folder, records, tmp_path, "parallel.ep=2", *NO_SAVE)


@pytest.mark.slow
def test_deepseek_v3_dp_tp_pp_equals_transformers(moe_twins, family_oracle, tmp_path):
    """DeepSeek-V3 at dp = 2 x tp = 2 x pp = 2."""
    _check((2, 2, 2), moe_twins("deepseek_v3"), family_oracle("deepseek_v3"), tmp_path)



@pytest.mark.slow
def test_deepseek_v3_resume_under_another_layout_continues_the_losses(moe_twins, tmp_path):
    """Steps 1-2 at tp = 2 x pp = 2, a checkpoint, steps 3-4 at dp = 2 (re-sharded from ``hf/``, the routing bias
    read back from it): the oracle's four losses."""
    folder = moe_twins("deepseek_v3")
    common = [*_common(folder), "trainer.max_steps=4"]
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    run_cli(first, *common, "parallel.tp=2", "parallel.pp=2", "trainer.save_every=2")
    run_cli(resumed, *common, "parallel.dp=2", f"trainer.resume={first / 'checkpoints' / 'step_2'}")
    from hybridtrain.plan import apply_pretrained_defaults
    from hybridtrain.reference import reference_run

    cfg = compose(*common)
    apply_pretrained_defaults(cfg)
    want = [r["loss"] for r in reference_run(cfg)]
    got = [m["loss"] for m in metrics(first)][:2] + [m["loss"] for m in metrics(resumed)]
    assert got == pytest.approx(want, rel=1e-4)
