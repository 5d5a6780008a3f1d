"""The plan's rules for context parallelism (``parallel.cp``, issue 31.2): each refusal names its key and the
fix; a valid layout plans the world, the data axis and ZeRO over dp x cp."""
from __future__ import annotations

import pytest

from helpers.config import compose
from hybridtrain.plan import Machine, PlanError, resolve

CPU = Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=4)
GPUS = Machine(gpus_per_node=8, gpu_type="H100", bf16_supported=True, fp16_supported=True)

CASES = {  # id -> (overrides, machine, key, fragments of the message)
    "cp_below_one": (("+recipe=llama_tiny", "parallel.cp=0"), CPU, "parallel.cp", ["must be >= 1", "got 0"]),
    "seq_len_not_divisible": (("+recipe=llama_tiny", "parallel.cp=3"), CPU, "data.seq_len",
                              ["data.seq_len=32 must be divisible by 2 x parallel.cp = 6", "parallel.cp in [1, 2, 4, 8, 16]"]),
    "gpt2_reordered_eager": (("+recipe=gpt_tiny", "parallel.cp=2", "model.attn_implementation=eager",
                              "+model.config.reorder_and_upcast_attn=true"), CPU,
                             "model.config.reorder_and_upcast_attn", ["bypasses transformers' attention functions"]),
    "more_ranks_than_gpus": (("+recipe=llama_tiny", "parallel.cp=4", "parallel.tp=4"), GPUS, "parallel.cp",
                             ["cp x tp x pp = 4 x 4 x 1 = 16 ranks exceed the 8 devices"]),
    "loss_chunk_below_one": (("+recipe=llama_tiny", "trainer.loss_chunk_tokens=0"), CPU, "trainer.loss_chunk_tokens",
                             ["must be >= 1 (tokens per piece of the LM head and loss), got 0"]),
    "dp_does_not_fit": (("+recipe=llama_tiny", "parallel.cp=2", "parallel.tp=2", "parallel.dp=4"), GPUS,
                        "parallel.dp", ["dp x cp x tp x pp = 4 x 2 x 2 x 1 = 16 does not fit the 8 devices",
                                        "use dp <= 2"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cp_rule_names_the_key(case):
    overrides, machine, key, fragments = CASES[case]
    with pytest.raises(PlanError) as info:
        resolve(compose(*overrides), machine)
    assert info.value.key == key, str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


@pytest.mark.parametrize("installed, refused", [((2, 0), True), ((2, 6), False)])
def test_cp_with_flash_needs_bottom_right_alignment(installed, refused, monkeypatch):
    """FlashAttention 2 under cp needs flash-attn >= 2.1 (causal masks of fewer queries than keys aligned at the
    bottom right, which the pieces rely on); checked on the rule itself, since without the flash-attn package here
    the plan refuses the kernel earlier."""
    import hybridtrain.plan.context as context
    from hybridtrain.models.families import family_of

    monkeypatch.setattr(context, "flash_attn_version", lambda: installed)
    cfg = compose("+recipe=llama_tiny", "parallel.cp=2")
    cfg.model.attn_implementation = "flash_attention_2"
    if not refused:
        assert context.check_context_parallel(cfg, family_of(cfg.model), None) == 2
        return
    with pytest.raises(PlanError) as info:
        context.check_context_parallel(cfg, family_of(cfg.model), None)
    assert info.value.key == "model.attn_implementation"
    assert "flash-attn 2.0 aligns the causal mask at the top left" in str(info.value)
    assert "install flash-attn >= 2.1" in str(info.value)


def test_a_context_parallel_layout_plans_over_dp_x_cp():
    plan, _ = resolve(compose("+recipe=llama_tiny", "parallel.dp=2", "parallel.cp=2", "parallel.tp=2"), CPU)
    assert plan.world_size == 8 and plan.dims.data == 4 and plan.dims.cp == 2
    assert plan.zero_stage == 1  # four ranks hold the same weights: ZeRO-1 partitions over them
    layout = plan.batch_layout()
    assert (layout.grad_accum, layout.averaged_over) == (6, 4)  # global 12 = micro 1 x 6 x dp 2; averaged over dp x cp
    assert plan.dims.product() == "dp=2 x cp=2 x tp=2 x pp=1"


def test_dp_fills_the_gpus_left_by_cp_tp_pp():
    plan, _ = resolve(compose("+recipe=llama_tiny", "parallel.cp=2", "parallel.tp=2", "trainer.global_batch_size=12"),
                      GPUS)
    assert plan.dims.dp == 2 and plan.world_size == 8


def test_cp_weight_counts_the_cp_ranks():
    """Each cp rank returns its tokens' summed loss x weight; DeepSpeed averages over dp x cp: the weight is
    accumulation x dp x cp / loss tokens."""
    import numpy as np

    from hybridtrain.data.sampler import RowSamples
    from hybridtrain.parallel.dims import ParallelDims

    ids = np.ones((8, 4), dtype=np.int64)
    samples = RowSamples(ids, ids.copy(), seed=0)
    for dp, cp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        layout = ParallelDims(dp=dp, cp=cp).batch_layout(8, 1)
        assert samples.batch_weight(np.arange(8), layout) == pytest.approx(layout.grad_accum * dp * cp / 32)
