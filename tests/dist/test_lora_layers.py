"""LoRA on the tensor-parallel layers against peft's LoRA on the unsharded module, at tp=2 and tp=3.

One spawned world of 3 gloo ranks runs every case at both degrees (TP group {0, 1, 2}, then the
subgroup {0, 1}), like ``test_tp_layers.py``. The unsharded twin is the real peft: its LoRA layers are
injected into a plain ``nn.Linear`` or a whole HF decoder block (``peft.inject_adapter_in_model``) and
given random, non-zero ``A`` and ``B``; the sharded module gets the same matrices through
hybridtrain's own ``add_lora`` (or the layer classes) and must give the same output, input gradient and
LoRA gradients (the matching slice of peft's). The base weights are frozen on both sides.

The slices the oracle compares with are computed here (``_fused_rows``), independently of
``hybridtrain.parallel.slicing``. Dropout: the sharded layers' masks must be those of one process drawing
for the whole input from the same RNG state (checked against masks drawn here).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Sequence, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridtrain.parallel.spawn import WorldRun, run_world
from helpers.tp_checks import assert_rank_checks, run_cases_at_degrees

TP_DEGREES = (2, 3)
REL_TOL = 1e-6
BLOCK_REL_TOL = 2e-6
B, S = 2, 5
R = 4

Checks = Dict[str, Tuple[Any, Any]]


def _fused_rows(sizes: Sequence[int], tp) -> torch.Tensor:
    """Rows this rank keeps of a dimension made of fused sub-blocks of ``sizes``: its chunk of each."""
    out, start = [], 0
    for n in sizes:
        chunk = n // tp.size
        out.append(torch.arange(start + tp.rank * chunk, start + (tp.rank + 1) * chunk))
        start += n
    return torch.cat(out)


def _gather_last(x: torch.Tensor, tp) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.detach().contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


def _tags(p: nn.Parameter) -> Tuple[bool, Any]:
    return getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", None)


def _peft(module: nn.Module, targets: list[str], seed: int, rslora: bool = False, alpha: float = 6.0,
          conv1d: bool = False, std: float = 0.3) -> nn.Module:
    """``module`` with peft's LoRA on ``targets`` (frozen base), ``A`` and ``B`` random and non-zero."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=R, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, fan_in_fan_out=conv1d)
    module = inject_adapter_in_model(config, module)
    torch.manual_seed(seed)
    for name, p in module.named_parameters():
        p.requires_grad_(".lora_" in name)
        if ".lora_" in name:
            with torch.no_grad():
                p.copy_(std * torch.randn_like(p))
    return module


def _ab(module: nn.Module, path: str) -> tuple[nn.Parameter, nn.Parameter]:
    layer = module.get_submodule(path)
    return layer.lora_A["default"].weight, layer.lora_B["default"].weight


class _Adapter:
    """What ``add_lora`` reads an adapter through: ``get(peft name)`` and ``folder``."""

    def __init__(self, tensors: dict):
        self.tensors, self.folder = tensors, "test"

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name].detach().clone()


# -- single layers ------------------------------------------------------------------------------

def _peft_linear_reference(n_in: int, n_out: int, seed: int, **lora):
    """peft's LoRA on one unsharded ``nn.Linear`` run forward and backward on random input:
    ``(peft module, lora_A, lora_B, base linear, x, output grad, x_ref with its grad, output)``."""
    torch.manual_seed(seed)
    full = _peft(nn.ModuleDict({"lin": nn.Linear(n_in, n_out)}), ["lin"], seed, **lora)
    a, b = _ab(full, "lin")
    x, g = torch.randn(B, S, n_in), torch.randn(B, S, n_out)
    x_ref = x.clone().requires_grad_()
    y_ref = full["lin"](x_ref)
    y_ref.backward(g)
    return full, a, b, full["lin"].base_layer, x, g, x_ref, y_ref


def _column_case(tp, sizes: Sequence[int], seed: int) -> Checks:
    from hybridtrain.parallel.layers import ColumnParallelLinear, copy_to_tp
    from hybridtrain.parallel.lora import LoraColumnParallelLinear

    full, a, b, base, x, g, x_ref, y_ref = _peft_linear_reference(10, sum(sizes), seed)

    rows = _fused_rows(sizes, tp)
    layer = LoraColumnParallelLinear(ColumnParallelLinear(base.weight.detach()[rows].clone(), base.bias.detach()[rows].clone()),
                                     a.detach().clone(), b.detach()[rows].clone(), full["lin"].scaling["default"], 0.0, tp)
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    x_par = x.clone().requires_grad_()
    y = layer(copy_to_tp(x_par, tp))
    y.backward(g[..., rows])
    gathered = _gather_last(y, tp)  # [.., rank 0's rows | rank 1's rows ...]: put back in HF order
    order = torch.cat([_fused_rows(sizes, type(tp)(group=tp.group, rank=r, size=tp.size)) for r in range(tp.size)])
    want = y_ref.detach()[..., order]
    return {
        "output (gathered)": (gathered, want),
        "input grad (A and W terms summed by f)": (x_par.grad, x_ref.grad),
        "lora_A grad (summed over TP)": (layer.lora_A.weight.grad, a.grad),
        "lora_B grad rows": (layer.lora_B.weight.grad, b.grad[rows]),
        "base weight frozen": (layer.weight.grad is None, True),
        "lora_A tags (replicated)": (_tags(layer.lora_A.weight), (False, None)),
        "lora_B tags": (_tags(layer.lora_B.weight), (True, 0)),
    }


def case_column(tp) -> Checks:
    return _column_case(tp, [12], seed=1)


def case_column_fused_unequal(tp) -> Checks:
    return _column_case(tp, [12, 6, 6], seed=2)  # Phi-3's q | k | v with half as many KV heads


def case_row_rslora(tp) -> Checks:
    from hybridtrain.parallel.layers import RowParallelLinear
    from hybridtrain.parallel.lora import LoraRowParallelLinear

    n_in = 12
    full, a, b, base, x, g, x_ref, y_ref = _peft_linear_reference(n_in, 10, 3, rslora=True)

    cols = _fused_rows([n_in], tp)
    layer = LoraRowParallelLinear(RowParallelLinear(base.weight.detach()[:, cols].clone(), base.bias.detach().clone(), tp),
                                  a.detach()[:, cols].clone(), b.detach().clone(), full["lin"].scaling["default"], 0.0, tp)
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    x_par = x[..., cols].clone().requires_grad_()
    y = layer(x_par)
    y.backward(g)
    return {
        "rslora scaling alpha / sqrt(r)": (full["lin"].scaling["default"], 6.0 / R ** 0.5),
        "output (one all-reduce)": (y.detach(), y_ref.detach()),
        "input grad cols": (x_par.grad, x_ref.grad[..., cols]),
        "lora_A grad cols": (layer.lora_A.weight.grad, a.grad[:, cols]),
        "lora_B grad (replicated)": (layer.lora_B.weight.grad, b.grad),
        "lora_A tags": (_tags(layer.lora_A.weight), (True, 1)),
        "lora_B tags (replicated)": (_tags(layer.lora_B.weight), (False, None)),
    }


def case_dropout(tp) -> Checks:
    """With p > 0 each layer's mask is the one a single process draws for the whole input from the same
    RNG state: shared by column-parallel peers, and the full input's columns for a row-parallel layer."""
    from hybridtrain.parallel.layers import ColumnParallelLinear, RowParallelLinear, copy_to_tp
    from hybridtrain.parallel.lora import LoraColumnParallelLinear, LoraRowParallelLinear

    p, n = 0.5, 12
    torch.manual_seed(4)
    w, a, b = torch.randn(n, n), torch.randn(R, n), torch.randn(n, R)
    x = torch.randn(B, S, n)
    part = _fused_rows([n], tp)

    def masked(x_full: torch.Tensor, seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return x_full * torch.empty_like(x_full).bernoulli_(1 - p) / (1 - p)

    col = LoraColumnParallelLinear(ColumnParallelLinear(w[part].clone(), None), a.clone(), b[part].clone(), 1.0, p, tp)
    torch.manual_seed(11)
    y_col = col(copy_to_tp(x, tp)) - F.linear(x, w[part])
    want_col = F.linear(F.linear(masked(x, 11), a), b)  # [B, S, n]
    row = LoraRowParallelLinear(RowParallelLinear(w[:, part].clone(), None, tp), a[:, part].clone(), b.clone(), 1.0, p, tp)
    torch.manual_seed(12)
    y_row = row(x[..., part].clone()) - F.linear(x, w)
    want_row = F.linear(F.linear(masked(x, 12), a), b)
    col.eval()
    return {
        "column: adapter term with the full input's mask": (_gather_last(y_col, tp), want_col),
        "row: adapter term with the full input's mask": (y_row.detach(), want_row),
        "no dropout in eval": (col(copy_to_tp(x, tp)).detach(), F.linear(x, w[part]) + F.linear(F.linear(x, a), b[part])),
    }


# -- whole HF decoder blocks ------------------------------------------------------------------------

_BLOCKS = {
    "gpt2": dict(n_embd=96, n_head=12, n_layer=1, n_positions=16, resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0),
    "llama": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, intermediate_size=192,
                  num_hidden_layers=1, max_position_embeddings=16),
    "phi3": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, intermediate_size=192,
                 num_hidden_layers=1, max_position_embeddings=16, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                 attention_dropout=0.0),
}


def case_block(tp, model_type: str) -> Checks:
    """A whole decoder block with LoRA on every linear layer (``all-linear``): peft on the HF block
    against ``shard_block`` + ``add_lora`` (GPT-2: fused Conv1D ``c_attn``; Phi-3: unequal fused
    ``qkv_proj`` and fused ``gate_up_proj``)."""
    from hybridtrain.models.build import add_lora, shard_block
    from hybridtrain.models.hf_model import hf_config_of, reference_model
    from hybridtrain.models.families import fused_sizes, get_family
    from hybridtrain.models.lora import LoraSpec, peft_name

    family = get_family(model_type)
    cfg = hf_config_of(model_type, _BLOCKS[model_type], vocab_size=10, attn_implementation="sdpa", eos_token_id=0)
    model = reference_model(cfg, family, seed=7)
    prefix = f"{family.blocks}.0"
    block = model.get_submodule(prefix)
    torch.manual_seed(8)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))
    sharded = copy.deepcopy(block)
    targets = [rel for rel, rule in family.tp_plan.items() if rule.style in ("column", "row")]
    conv1d = any(family.tp_plan[t].conv1d for t in targets)
    full = _peft(block, targets, seed=9, alpha=8.0, conv1d=conv1d, std=0.1)
    adapter = {}
    for rel in targets:
        a, b = _ab(full, rel)
        adapter[peft_name(f"{prefix}.{rel}.lora_A.weight")] = a
        adapter[peft_name(f"{prefix}.{rel}.lora_B.weight")] = b
    shard_block(sharded, family, cfg, tp)
    spec = LoraSpec(r=R, alpha=8.0, dropout=0.0, rslora=False, targets=frozenset(f"{prefix}.{t}" for t in targets))
    add_lora(sharded, prefix, family, cfg, tp, spec, seed=0, adapter=_Adapter(adapter))
    for name, p in sharded.named_parameters():
        p.requires_grad_(".lora_" in f".{name}")

    hidden = int(getattr(cfg, family.hidden))
    x, g = torch.randn(B, S, hidden), torch.randn(B, S, hidden)
    kwargs: Dict[str, Any] = {"attention_mask": None}
    if family.rotary_embed:
        pos = torch.arange(S).unsqueeze(0)
        kwargs.update(position_ids=pos, position_embeddings=model.get_submodule(family.rotary_embed)(x, position_ids=pos))
    x_ref = x.clone().requires_grad_()
    y_ref = full(x_ref, **kwargs)
    y_ref = y_ref[0] if isinstance(y_ref, tuple) else y_ref
    y_ref.backward(g)
    x_par = x.clone().requires_grad_()
    y = sharded(x_par, **kwargs)
    y = y[0] if isinstance(y, tuple) else y
    y.backward(g)

    checks: Checks = {"output": (y.detach(), y_ref.detach()), "input grad": (x_par.grad, x_ref.grad)}
    for rel in targets:
        rule, layer = family.tp_plan[rel], sharded.get_submodule(rel)
        a, b = _ab(full, rel)
        if rule.style == "column":
            sizes = fused_sizes(rule, family, cfg, b.shape[0])
            rows = _fused_rows([b.shape[0] // sizes] * sizes if isinstance(sizes, int) else list(sizes), tp)
            checks[f"{rel}.lora_A grad"] = (layer.lora_A.weight.grad, a.grad)
            checks[f"{rel}.lora_B grad rows"] = (layer.lora_B.weight.grad, b.grad[rows])
        else:
            cols = _fused_rows([a.shape[1]], tp)
            checks[f"{rel}.lora_A grad cols"] = (layer.lora_A.weight.grad, a.grad[:, cols])
            checks[f"{rel}.lora_B grad"] = (layer.lora_B.weight.grad, b.grad)
        checks[f"{rel} base frozen"] = (layer.weight.grad is None, True)
    checks["adapted modules"] = (len(targets), sum(1 for m in sharded.modules() if hasattr(m, "lora_A")))
    return checks


CASES: Dict[str, Callable] = {
    "column": case_column,
    "column_fused_unequal": case_column_fused_unequal,
    "row_rslora": case_row_rslora,
    "dropout": case_dropout,
    **{f"block_{m}": (lambda tp, m=m: case_block(tp, m)) for m in _BLOCKS},
}



def run_cases(rank: int, world: int, emit) -> None:
    """Child entry: every case at every degree (:func:`helpers.tp_checks.run_cases_at_degrees`)."""
    run_cases_at_degrees(CASES, TP_DEGREES, rank, emit)


@pytest.fixture(scope="module")
def world_run() -> WorldRun:
    return run_world(run_cases, max(TP_DEGREES), timeout_s=180)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tp", TP_DEGREES, ids=lambda n: f"tp{n}")
def test_lora_layer_matches_peft(world_run: WorldRun, tp: int, case: str) -> None:
    assert_rank_checks(world_run, tp, case, BLOCK_REL_TOL if case.startswith("block_") else REL_TOL, approx_floats=True)
    assert not world_run.problems, world_run.problem_report()
