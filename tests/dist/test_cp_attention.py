"""Context parallelism's attention (``hybridtrain/parallel/context_parallel.py``) against one-process attention, in
outputs and gradients: real HF attention modules (Llama with grouped-query attention, sdpa and eager; Mistral with a
sliding window; Gemma 2 eager with logit soft-capping, a sliding and a full layer), on unpacked rows and on packed
rows whose documents cross chunk boundaries (each row packed differently), at cp = 2 and cp = 4. Unpacked rows
come without position ids, as the stages pass them: Llama's plain causal sdpa then runs mask-free
(``hybridtrain/parallel/causal_chunks.py``), the other cases with the global-index mask.

All cases run in ONE spawned world of 4 gloo ranks: on the cp group of ranks {0, 1}, then on all four. Every rank
builds the same module, inputs and upstream gradient from a fixed seed in float64 and computes the reference on the
full rows (transformers' own mask from ``create_causal_mask`` / ``create_sliding_window_causal_mask`` with the
position ids, its rotary embedding on the full-row positions); the cp run takes the local tokens ``x[:, idx]`` with
cos/sin sliced at ``idx``, ``config._attn_implementation = register_attention()`` on a copy of the config, and the
``cp_context`` keyword. Checked per rank: the local outputs and input gradients equal the reference's at ``idx``,
and each parameter's gradient summed over the cp group equals the reference gradient. The upstream gradient is a
fixed random tensor (``y.backward(g)``), so every output element is checked in the backward too.

A last case gathers over the strided groups {0, 2} and {1, 3} (the cp groups of a tp = 2 layout), where torch's own
autograd all-gather fails on gloo (see ``hybridtrain/parallel/collectives.py``)."""
from __future__ import annotations

import copy
import traceback
from typing import Any, Callable, Dict, Tuple

import pytest
import torch

from helpers.tp_checks import emitted_checks
from hybridtrain.parallel.spawn import WorldRun, run_world

CP_GROUPS = {2: [0, 1], 4: [0, 1, 2, 3]}
B, S, HIDDEN = 2, 16, 32
ATOL = 1e-12  # float64: the cp run differs from the reference only in summation order (measured: within 1e-12
# also for eager, whose softmax runs in float32: both runs round the same float64 logits)

ROWS = {
    "unpacked": [[S], [S]],
    # document lengths per row: boundaries inside the chunks of cp = 2 (4 tokens) and cp = 4 (2 tokens)
    "packed": [[5, 7, 4], [3, 9, 1, 3]],
}

_ATTN = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             max_position_embeddings=S, intermediate_size=64)
_GEMMA2 = dict(head_dim=8, query_pre_attn_scalar=8, attn_logit_softcapping=1.0, sliding_window=5)
MODULES = {  # case -> (model type, attention implementation, layer, sliding-window layer?, config overrides)
    "llama_gqa_sdpa": ("llama", "sdpa", 0, False, dict(attention_bias=True)),
    "llama_gqa_eager": ("llama", "eager", 0, False, {}),
    "mistral_sliding_sdpa": ("mistral", "sdpa", 0, True, dict(sliding_window=5)),
    "gemma2_softcap_sliding_eager": ("gemma2", "eager", 0, True, _GEMMA2),  # layer 0 of Gemma 2 slides, 1 is full
    "gemma2_softcap_full_eager": ("gemma2", "eager", 1, False, _GEMMA2),
}

Checks = Dict[str, Tuple[Any, Any]]


def _positions(rows) -> torch.Tensor:
    return torch.tensor([[p for n in docs for p in range(n)] for docs in rows])  # [B, S]


def _build(model_type: str, impl: str, layer: int, overrides: dict):
    """The family's attention module, its config and rotary embedding, float64, from a fixed seed."""
    import importlib

    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **_ATTN, **overrides, attn_implementation=impl)
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    prefix = {"llama": "Llama", "mistral": "Mistral", "gemma2": "Gemma2"}[model_type]
    torch.manual_seed(1)
    attn = getattr(modeling, f"{prefix}Attention")(config, layer).double()
    with torch.no_grad():  # zero biases would hide a dropped bias gradient
        for p in attn.parameters():
            p.add_(0.1 * torch.randn_like(p))
    rotary = getattr(modeling, f"{prefix}RotaryEmbedding")(config).double()
    return config, attn, rotary


def case_attention(cp, case: str, rows: str) -> Checks:
    import torch.distributed as dist
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    from hybridtrain.parallel.context_parallel import CPAttention, register_attention

    model_type, impl, layer, sliding, overrides = MODULES[case]
    config, full, rotary = _build(model_type, impl, layer, overrides)
    positions = _positions(ROWS[rows])
    torch.manual_seed(2)
    x = torch.randn(B, S, HIDDEN, dtype=torch.float64)
    g = torch.randn(B, S, HIDDEN, dtype=torch.float64)
    rope = rotary(x, position_ids=positions)  # (cos, sin), each [B, S, D]
    window = 5 if sliding else None
    assert getattr(full, "sliding_window", window) == window, (case, full.sliding_window)  # Gemma 2's layer kinds
    make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
    mask = make_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions)

    local = copy.deepcopy(full)
    local.config = copy.deepcopy(config)
    local.config._attn_implementation = register_attention()

    x_ref = x.clone().requires_grad_()
    y_ref, _ = full(x_ref, position_embeddings=rope, attention_mask=mask, position_ids=positions)
    y_ref.backward(g)

    idx = cp.indices(S)  # this rank's tokens
    x_loc = x[:, idx].clone().requires_grad_()  # [B, S/cp, hidden]
    packed = rows == "packed"
    ctx = CPAttention(cp, impl, positions if packed else None)  # as the stages pass them: None for unpacked rows
    y, _ = local(x_loc, position_embeddings=(rope[0][:, idx], rope[1][:, idx]), attention_mask=None,
                 position_ids=positions[:, idx], cp_context=ctx)
    if impl == "sdpa" and not (packed or sliding):  # plain causal sdpa runs mask-free (causal_chunks.py)
        assert not ctx.masks, f"plain causal sdpa made masks {list(ctx.masks)}"
    else:
        assert ctx.masks or impl == "flash_attention_2", "a masked case made no mask"
    y.backward(g[:, idx])

    checks: Checks = {"output": (y.detach(), y_ref.detach()[:, idx]), "input grad": (x_loc.grad, x_ref.grad[:, idx])}
    reference = dict(full.named_parameters())
    for name, p in local.named_parameters():
        summed = p.grad.clone()
        dist.all_reduce(summed, group=cp.group)  # each rank's grad covers its own queries' share
        checks[f"{name} grad summed over cp"] = (summed, reference[name].grad)
    return checks


def case_strided_gather(cp) -> Checks:
    """gather_sequence over a group that is not ranks 0..n-1: global order, and the gradient summed to the owner."""
    from hybridtrain.parallel.context_parallel import gather_sequence

    idx = cp.indices(S)
    local = idx.double()[None, :, None].repeat(B, 1, 3).requires_grad_()  # [B, S/cp, 3], values = global index
    full = gather_sequence(local, cp, dim=1)  # [B, S, 3]
    weight = torch.arange(S, dtype=torch.float64)[None, :, None] + 1
    (full * weight).sum().backward()
    return {"gathered": (full.detach(), torch.arange(S).double()[None, :, None].expand(B, S, 3)),
            "grad": (local.grad, (cp.size * weight[:, idx]).expand(B, S // cp.size, 3))}


CASES: Dict[str, Callable] = {f"{case}-{rows}": (lambda cp, c=case, r=rows: case_attention(cp, c, r))
                              for case in MODULES for rows in ROWS}


def run_cases(rank: int, world: int, emit) -> None:
    """Child entry: every case on the cp groups of :data:`CP_GROUPS`, then the strided gather."""
    import torch.distributed as dist

    from hybridtrain.parallel.context import CPContext

    groups = {n: dist.new_group(ranks) for n, ranks in CP_GROUPS.items()}  # every rank calls new_group, in order
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    for n, ranks in sorted(CP_GROUPS.items()):
        if rank not in ranks:
            continue
        cp = CPContext(group=groups[n], rank=ranks.index(rank), size=n)
        for name, case in CASES.items():
            try:
                emit(f"cp{n}-{name}", case(cp))
            except Exception:
                emit(f"cp{n}-{name}", f"cp={n} rank {rank}, case {name} raised:\n{traceback.format_exc()}")
    cp = CPContext(group=strided[rank % 2], rank=rank // 2, size=2)
    emit("strided_gather", case_strided_gather(cp))


@pytest.fixture(scope="module")
def world_run() -> WorldRun:
    """All cases at both degrees, once for the module, in one world of 4 spawned gloo ranks."""
    return run_world(run_cases, 4, timeout_s=180, deepspeed_comm=False)


def _assert_checks(world_run: WorldRun, ranks, key: str, atol: float) -> None:
    for rank in ranks:
        for check, (got, want) in emitted_checks(world_run, rank, key).items():
            assert got is not None, f"rank {rank} {key}: {check}: no gradient"
            torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=lambda m: f"rank {rank} {key}: {check}\n{m}")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cp", sorted(CP_GROUPS), ids=lambda n: f"cp{n}")
def test_cp_attention_matches_one_process(world_run: WorldRun, cp: int, case: str) -> None:
    _assert_checks(world_run, CP_GROUPS[cp], f"cp{cp}-{case}", ATOL)
    assert not world_run.problems, world_run.problem_report()


def test_gather_over_strided_groups(world_run: WorldRun) -> None:
    _assert_checks(world_run, range(4), "strided_gather", 0.0)
