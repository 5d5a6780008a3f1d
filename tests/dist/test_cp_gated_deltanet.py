"""Context parallelism's Gated DeltaNet (``hybridtrain/parallel/state_pass.py``, ``models/linear_attention.py``)
against the unsharded layer, in the output, the input gradient and every parameter's gradient (issue 42.4).

transformers' own ``Qwen3_5GatedDeltaNet`` and ``Qwen3NextGatedDeltaNet`` (float64, perturbed weights), on unpacked
rows and on packed rows whose documents cross the chunk boundaries, one of them starting exactly at a boundary and
one shorter than the conv window across a boundary, and one whose conv window at cp = 4 (chunks of 2 tokens, a
window of 3 earlier inputs) reaches two chunks back. The reference is the one-process layer on the whole rows, each packed
document run alone (:func:`~hybridtrain.models.linear_attention.split_documents`, itself transformers' forward per
document); the cp run is the rank's two chunks with the carry passed between the ranks in sequence order. A last
variant runs the cp layer under non-reentrant activation checkpointing, whose recomputation replays the received
carries (:class:`~hybridtrain.parallel.state_pass.CarryLog`).

CI runs Qwen3.5's layer on packed rows at cp = 2 (plain and checkpointed) in a world of 2 gloo ranks; the slow
tier every case in ONE spawned world of 4: on the cp group {0, 1}, then on all four. Checked per rank: the
local outputs and input gradients equal the reference's at the rank's tokens, and each parameter's gradient summed
over the cp group equals the reference's."""
from __future__ import annotations

import copy
import traceback
from typing import Any, Callable, Dict, Tuple

import pytest
import torch

from helpers.tp_checks import emitted_checks
from hybridtrain.parallel.spawn import WorldRun, run_world

CP_GROUPS = {2: [0, 1], 4: [0, 1, 2, 3]}
B, S, HIDDEN = 3, 16, 32
ATOL = 1e-10
"""float64 throughout: transformers' delta rule and its gated norm cast their inputs to float32, so the cases run
them in float64 (:func:`_delta_rule_in_float64`, :func:`_gated_norm_in_float64`); what is left is summation order (a chunk's pieces pad to the rule's 64-token
blocks differently from whole documents). A carry that is lost or misplaced moves outputs by 1e-2 and more."""
FLOAT32 = {"A_log": 1e-5}
"""Checks whose gradient runs through transformers' own float32 cast (``-self.A_log.float().exp()``): summed
over the tokens in float32 in another order, so float32's relative tolerance."""

ROWS = {
    "unpacked": [[S]] * B,
    # document lengths per row. Row 0: a start at token 8, a chunk boundary at cp = 2 and 4. Row 1: a document of 9
    # over several chunks (at cp = 4 the window of token 10 reaches back two chunks, to token 7), a one-token
    # document at 12 (a boundary), one across the boundary at 14. Row 2: starts at 6 (a cp = 4 boundary), a
    # two-token document (shorter than the window) across the boundary at 10.
    "packed": [[5, 3, 8], [3, 9, 1, 3], [6, 3, 2, 5]],
}

_GDN = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=4, linear_conv_kernel_dim=4, intermediate_size=64,
            max_position_embeddings=S)
MODULES = {  # case -> (model type, class)
    "qwen3_5": ("qwen3_5_text", "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet"),
    "qwen3_next": ("qwen3_next", "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet"),
}

Checks = Dict[str, Tuple[Any, Any]]


def _positions(rows) -> torch.Tensor:
    return torch.tensor([[p for n in docs for p in range(n)] for docs in rows])  # [B, S]


def _delta_rule_in_float64(modeling) -> None:
    """Replace ``modeling``'s two torch delta rules (``torch_chunk_gated_delta_rule``, and
    ``torch_recurrent_gated_delta_rule`` for one-token pieces) by their own source with the float32 cast made
    float64, in this (spawned test) process only."""
    source = open(modeling.__file__).read()
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        start = source.index(f"def {name}(")
        body = source[start:source.index("\n\n\n", start)]
        assert body.count("torch.float32") == 1, f"{modeling.__name__}.{name} changed: update this test's patch"
        namespace = dict(vars(modeling))
        exec(compile(body.replace("torch.float32", "torch.float64"), modeling.__file__, "exec"), namespace)
        setattr(modeling, name, namespace[name])


def _gated_norm_in_float64(norm) -> None:
    """Give ``norm`` (transformers' ``RMSNormGated``, which computes in float32 whatever its input) its own
    forward's source with the float32 casts made float64: in float32 the two runs' float64 inputs, equal but for
    summation order, round apart by one float32 ulp here and there (about 1e-7 relative)."""
    import inspect
    import sys
    import textwrap
    import types

    source = textwrap.dedent(inspect.getsource(type(norm).forward))
    assert source.count("torch.float32") == 2, f"{type(norm).__name__}.forward changed: update this test's patch"
    namespace = dict(vars(sys.modules[type(norm).__module__]))
    exec(compile(source.replace("torch.float32", "torch.float64"), type(norm).__module__, "exec"), namespace)
    norm.forward = types.MethodType(namespace["forward"], norm)


def _build(case: str):
    import importlib

    from transformers import AutoConfig

    model_type, path = MODULES[case]
    extra = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                 shared_expert_intermediate_size=16) if model_type == "qwen3_next" else {}
    config = AutoConfig.for_model(model_type, **_GDN, **extra)
    module_name, cls = path.rsplit(".", 1)
    modeling = importlib.import_module(module_name)
    _delta_rule_in_float64(modeling)
    torch.manual_seed(1)
    layer = getattr(modeling, cls)(config, 0).double()
    _gated_norm_in_float64(layer.norm)
    with torch.no_grad():  # an untrained norm at 1 would hide a dropped gradient
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def case_layer(cp, case: str, rows: str, checkpointed: bool = False) -> Checks:
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    from hybridtrain.models.linear_attention import Documents, RankChunks, split_documents
    from hybridtrain.parallel.state_pass import CarryLog

    full = _build(case)
    local = copy.deepcopy(full)
    split_documents(full)
    split_documents(local)
    positions = _positions(ROWS[rows])
    torch.manual_seed(2)
    x = torch.randn(B, S, HIDDEN, dtype=torch.float64)
    g = torch.randn(B, S, HIDDEN, dtype=torch.float64)

    x_ref = x.clone().requires_grad_()
    y_ref = full(hidden_states=x_ref, documents=Documents.of(positions))
    y_ref.backward(g)

    idx = cp.indices(S)  # this rank's tokens: its two chunks
    x_loc = x[:, idx].clone().requires_grad_()  # [B, S/cp, hidden]
    chunks = RankChunks.of(positions, cp, packed=rows == "packed")
    if checkpointed:
        log = CarryLog()
        y = checkpoint(lambda h: local(hidden_states=h, documents=chunks, carry_log=log), x_loc, use_reentrant=False)
    else:
        y = local(hidden_states=x_loc, documents=chunks)
    y.backward(g[:, idx])

    checks: Checks = {"output": (y.detach(), y_ref.detach()[:, idx]), "input grad": (x_loc.grad, x_ref.grad[:, idx])}
    reference = dict(full.named_parameters())
    for name, p in local.named_parameters():
        assert p.grad is not None, f"{name}: no gradient"
        summed = p.grad.clone()
        dist.all_reduce(summed, group=cp.group)  # each rank's grad covers its own tokens' share
        checks[f"{name} grad summed over cp"] = (summed, reference[name].grad)
    return checks


CASES: Dict[str, Callable] = {f"{case}-{rows}": (lambda cp, c=case, r=rows: case_layer(cp, c, r))
                              for case in MODULES for rows in ROWS}
CASES["qwen3_5-packed-checkpointed"] = lambda cp: case_layer(cp, "qwen3_5", "packed", checkpointed=True)


CI = {(2, "qwen3_5-packed"), (2, "qwen3_5-packed-checkpointed")}
"""What CI runs, in a world of 2 ranks: Qwen3.5's layer on packed rows at cp = 2, plain and checkpointed; every
case at cp = 2 and 4 runs in the slow tier (a world of 4 ranks)."""


def run_cases(rank: int, world: int, emit) -> None:
    """Child entry: on a world of 2, the :data:`CI` cases at cp = 2; on a world of 4, every case on the cp groups
    of :data:`CP_GROUPS`."""
    import torch.distributed as dist

    from hybridtrain.parallel.context import CPContext

    degrees = {n: ranks for n, ranks in CP_GROUPS.items() if n <= world}
    groups = {n: dist.new_group(ranks) for n, ranks in degrees.items()}  # every rank calls new_group, in order
    for n, ranks in sorted(degrees.items()):
        if rank not in ranks:
            continue
        cp = CPContext(group=groups[n], rank=ranks.index(rank), size=n)
        for name, case in CASES.items():
            if world == 2 and (n, name) not in CI:
                continue
            try:
                emit(f"cp{n}-{name}", case(cp))
            except Exception:
                emit(f"cp{n}-{name}", f"cp={n} rank {rank}, case {name} raised:\n{traceback.format_exc()}")


@pytest.fixture(scope="module")
def ci_world() -> WorldRun:
    """The CI cases, once for the module, in one world of 2 spawned gloo ranks."""
    return run_world(run_cases, 2, timeout_s=180, deepspeed_comm=False)


@pytest.fixture(scope="module")
def full_world() -> WorldRun:
    """All cases at both degrees, once for the module, in one world of 4 spawned gloo ranks."""
    return run_world(run_cases, 4, timeout_s=300, deepspeed_comm=False)


def _assert_case(world_run: WorldRun, cp: int, case: str) -> None:
    key = f"cp{cp}-{case}"
    for rank in CP_GROUPS[cp]:
        for check, (got, want) in emitted_checks(world_run, rank, key).items():
            rtol = next((tol for name, tol in FLOAT32.items() if check.startswith(name)), 0.0)
            torch.testing.assert_close(got, want, rtol=rtol, atol=ATOL,
                                       msg=lambda m: f"rank {rank} {key}: {check}\n{m}")
    assert not world_run.problems, world_run.problem_report()


@pytest.mark.parametrize("cp,case", sorted(CI), ids=[f"cp{n}-{c}" for n, c in sorted(CI)])
def test_cp_gated_deltanet_matches_one_process(ci_world: WorldRun, cp: int, case: str) -> None:
    _assert_case(ci_world, cp, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cp", sorted(CP_GROUPS), ids=lambda n: f"cp{n}")
def test_cp_gated_deltanet_every_case_matches_one_process(full_world: WorldRun, cp: int, case: str) -> None:
    _assert_case(full_world, cp, case)
