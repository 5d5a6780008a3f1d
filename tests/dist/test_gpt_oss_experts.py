"""gpt-oss's experts split over tensor and expert parallelism (the ``experts_interleaved`` style,
``hybridtrain/parallel/experts.py``) against transformers' unsharded ``GptOssMLP``, forward and backward, in one
spawned world of 4 gloo ranks.

gpt-oss's experts are transposed (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``), carry biases
(``gate_up_proj_bias [E, 2I]``, ``down_proj_bias [E, H]``) and interleave gate and up along the last dimension;
the router has a bias. Every rank builds the same MLP (every weight and bias nonzero, the router scaled for a
clear top-k margin) and, as a data-parallel replica, its own tokens; a copy is split as a run splits it. Checked
per rank against the full MLP: the output (so the down projection's bias is added exactly once over tp, not tp
times), the input gradient, the router's weight and bias gradients, and each expert leaf's gradient, which must
be the full MLP's gradient of this rank's slice summed over the tokens of its expert-parallel group. Cases
(dp, tp, ep): (2, 2, 1), (2, 2, 2), (4, 1, 2).
"""
from __future__ import annotations

import copy

import pytest
import torch

from hybridtrain.parallel.spawn import WorldRun, run_world

WORLD = 4
E, K, H, I, T = 8, 2, 16, 8, 6  # experts, top-k, hidden, expert width, tokens per rank
CASES = {"dp2_tp2": (2, 2, 1), "dp2_tp2_ep2": (2, 2, 2), "dp4_ep2": (4, 1, 2)}
REL = 1e-5


def _mlp():
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = AutoConfig.for_model("gpt_oss", hidden_size=H, intermediate_size=I, num_local_experts=E,
                                  num_experts_per_tok=K, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                                  swiglu_limit=1.5)  # a limit the gate and up values cross: the clamps matter
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    mlp = GptOssMLP(config)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.5)
        mlp.router.weight.mul_(4.0)
    return mlp


def _tokens(dp_rank: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(100 + dp_rank))


def _upstream(dp_rank: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(7 + dp_rank))


def _run(rank: int, world: int, emit) -> None:
    import torch.distributed as dist

    from hybridtrain.parallel.context import EPContext, TPContext
    from hybridtrain.parallel.dims import ParallelDims
    from hybridtrain.parallel.experts import split_experts_over_ep
    from hybridtrain.parallel.slicing import local_part
    from hybridtrain.parallel.tensor import STYLES

    style = STYLES["experts_interleaved"]
    for name, (dp, tp, ep) in CASES.items():
        dims = ParallelDims(dp=dp, tp=tp, ep=ep)
        tp_ctx, ep_ctx = TPContext(rank=dims.coords(rank).tp, size=tp), EPContext(rank=dims.expert_rank(rank), size=ep)
        for ranks in dims.groups("tp"):  # every rank makes every group, in order
            group = dist.new_group(ranks)
            if rank in ranks:
                tp_ctx.group = group
        peers = [rank]
        for ranks in dims.expert_groups()[0]:
            group = dist.new_group(ranks)
            if rank in ranks:
                ep_ctx.group, peers = group, ranks
        full = _mlp()
        sharded = copy.deepcopy(full)
        style.shard(sharded.experts, None, 1, tp_ctx)
        if ep > 1:
            split_experts_over_ep(sharded.experts, ep_ctx)

        me = dims.coords(rank).dp
        x = _tokens(me).requires_grad_()
        y = sharded(x[None])[0][0]
        y.backward(_upstream(me))
        want_x = x.detach().clone().requires_grad_()
        want = full(want_x[None])[0][0]
        want.backward(_upstream(me))
        checks = {"output": (y.detach(), want.detach()), "input_grad": (x.grad, want_x.grad),
                  "router_weight_grad": (sharded.router.weight.grad, full.router.weight.grad),
                  "router_bias_grad": (sharded.router.bias.grad, full.router.bias.grad)}
        summed = _mlp()  # the owner's expert gradients: the full MLP's, summed over every EP peer's tokens
        for peer in peers:
            summed(_tokens(dims.coords(peer).dp)[None])[0].backward(_upstream(dims.coords(peer).dp)[None])
        start, stop = ep_ctx.shard(E)
        for leaf in (*style.LEAVES, *style.ONCE):
            want_grad = local_part(getattr(summed.experts, leaf).grad[start:stop], style.split(leaf), tp_ctx.rank, tp)
            checks[f"{leaf}_grad"] = (getattr(sharded.experts, leaf).grad, want_grad)
            checks[f"{leaf}_shape"] = tuple(getattr(sharded.experts, leaf).shape)
            checks[f"{leaf}_tagged"] = bool(getattr(getattr(sharded.experts, leaf), "tensor_model_parallel",
                                                             False))
        emit(name, checks)


@pytest.fixture(scope="module")
def world_run() -> WorldRun:
    return run_world(_run, WORLD, timeout_s=240)


@pytest.mark.parametrize("case", list(CASES))
def test_gpt_oss_experts_match_unsharded(world_run: WorldRun, case: str) -> None:
    assert not world_run.problems, world_run.problem_report()
    dp, tp, ep = CASES[case]
    for rank in range(WORLD):
        checks = world_run.emitted[rank][case]
        assert checks["gate_up_proj_shape"] == (E // ep, H, 2 * I // tp)
        assert checks["down_proj_shape"] == (E // ep, I // tp, H)
        assert checks["down_proj_bias_shape"] == (E // ep, H)  # replicated over tp
        # the gradient norm counts a tp-tagged parameter's shards on every rank: the replicated bias is not tagged
        assert not checks["down_proj_bias_tagged"]
        assert checks["down_proj_tagged"] == checks["gate_up_proj_bias_tagged"] == (tp > 1)
        for check, (got, want) in ((k, v) for k, v in checks.items() if k.endswith(("output", "_grad"))):
            scale = want.abs().max().item()
            assert scale > 0, (case, rank, check)
            assert got.shape == want.shape, (case, rank, check)
            assert (got - want).abs().max().item() <= REL * scale, (case, rank, check)


def test_interleaved_slices_keep_matching_gate_and_up_columns() -> None:
    """Rank ``r`` of tp keeps gate columns ``r`` and up columns ``r`` of every expert, still interleaved: its
    ``[..., ::2]`` is slice ``r`` of the full gate, its ``[..., 1::2]`` slice ``r`` of the full up (in-process)."""
    from hybridtrain.parallel.slicing import local_part
    from hybridtrain.parallel.tensor import STYLES

    style, full = STYLES["experts_interleaved"], _mlp().experts
    for tp in (2, 4):
        for r in range(tp):
            part = local_part(full.gate_up_proj.detach(), style.split("gate_up_proj"), r, tp)
            bias = local_part(full.gate_up_proj_bias.detach(), style.split("gate_up_proj_bias"), r, tp)
            cols = slice(r * I // tp, (r + 1) * I // tp)
            assert torch.equal(part[..., ::2], full.gate_up_proj[..., ::2][..., cols])
            assert torch.equal(part[..., 1::2], full.gate_up_proj[..., 1::2][..., cols])
            assert torch.equal(bias[..., 1::2], full.gate_up_proj_bias[..., 1::2][..., cols])
