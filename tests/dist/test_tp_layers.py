"""Every tensor-parallel layer, and a decoder block of every model family, against its unsharded twin,
forward and backward, at tp=2 and tp=3.

All cases at both degrees run inside ONE spawned world of 3 gloo ranks (spawning and importing
torch, DeepSpeed and transformers dominate the cost): first on a TP group of ranks {0, 1, 2},
then on a TP group of ranks {0, 1} (a subgroup, as the pipeline grid's TP groups are). Each
case's checks come back as ``{check: (got, want)}`` per rank and are asserted here, in the
parent, one test per (tp, case). Every rank builds the same full
(unsharded) module and inputs from a fixed seed, shards a copy, runs both, and compares:

* outputs: the sharded output (gathered over ranks when it is split) vs the full output;
* gradients: the input gradient, and each sharded parameter's gradient vs the matching slice of
  the full parameter's gradient (replicated parameters vs the full gradient itself);
* DeepSpeed grad-norm tags: sharded parameters carry ``tensor_model_parallel`` and their split
  dimension, replicated ones carry no tag.

The upstream gradient is a fixed random tensor (``y.backward(g)``), not a loss, so every output
element is checked in the backward pass too.
"""
from __future__ import annotations

import copy
from functools import partial
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridtrain.parallel.spawn import WorldRun, run_world
from helpers.tp_checks import assert_rank_checks, run_cases_at_degrees

TP_DEGREES = (2, 3)
# fp32 throughout; sharded and full runs differ only in summation order. Tolerances are relative
# to each tensor's largest entry: a whole decoder block measured <= 6e-7 of it at tp=2, while a
# mis-sliced or missing term is off by O(1).
REL_TOL = 1e-6
BLOCK_REL_TOL = 1e-5  # a whole block's fp32 gradients sum over batch, sequence and heads in another order
B, S = 2, 5  # batch, sequence

Checks = Dict[str, Tuple[Any, Any]]
"""``{check name: (got, want)}``: tensors are compared with ``assert_close``, anything else with ``==``."""


# --------------------------------------------------------------------------------------------
# Cases: run inside every rank (see run_cases); each returns this rank's checks.
# --------------------------------------------------------------------------------------------

def _rows(n: int, tp) -> slice:
    """This rank's slice of ``n`` items, computed here independently of ``TPContext.shard``."""
    step = n // tp.size
    return slice(tp.rank * step, (tp.rank + 1) * step)


def _gather_last(x: torch.Tensor, tp) -> torch.Tensor:
    """All-gather ``[..., n/tp]`` shards into ``[..., n]`` (test-side oracle, plain torch.distributed)."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.detach().contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


def _tags(param: nn.Parameter) -> Tuple[bool, Any]:
    return getattr(param, "tensor_model_parallel", False), getattr(param, "partition_dim", None)


def case_column_linear(tp) -> Checks:
    from hybridtrain.parallel.layers import ColumnParallelLinear, copy_to_tp

    torch.manual_seed(1)
    full = nn.Linear(10, 12)  # out=12 splits over 2 and 3
    x = torch.randn(B, S, 10)
    g = torch.randn(B, S, 12)
    x_ref = x.clone().requires_grad_()
    y_ref = full(x_ref)
    y_ref.backward(g)

    rows = _rows(12, tp)
    layer = ColumnParallelLinear(full.weight.detach()[rows].clone(), full.bias.detach()[rows].clone())
    x_par = x.clone().requires_grad_()
    y = layer(copy_to_tp(x_par, tp))  # [B, S, 12/tp]
    y.backward(g[..., rows])
    return {
        "output gathered": (_gather_last(y, tp), y_ref.detach()),
        "input grad (all-reduced by copy_to_tp)": (x_par.grad, x_ref.grad),
        "weight grad rows": (layer.weight.grad, full.weight.grad[rows]),
        "bias grad rows": (layer.bias.grad, full.bias.grad[rows]),
        "weight tags": (_tags(layer.weight), (True, 0)),
        "bias tags": (_tags(layer.bias), (True, 0)),
    }


def case_row_linear(tp) -> Checks:
    from hybridtrain.parallel.layers import RowParallelLinear

    torch.manual_seed(2)
    full = nn.Linear(12, 10)  # in=12 splits over 2 and 3
    x = torch.randn(B, S, 12)
    g = torch.randn(B, S, 10)
    x_ref = x.clone().requires_grad_()
    y_ref = full(x_ref)
    y_ref.backward(g)

    cols = _rows(12, tp)
    layer = RowParallelLinear(full.weight.detach()[:, cols].clone(), full.bias.detach().clone(), tp)
    x_par = x[..., cols].clone().requires_grad_()
    y = layer(x_par)  # [B, S, 10], all-reduced
    y.backward(g)
    return {
        "output (all-reduced)": (y.detach(), y_ref.detach()),
        "input grad cols": (x_par.grad, x_ref.grad[..., cols]),
        "weight grad cols": (layer.weight.grad, full.weight.grad[:, cols]),
        "bias grad (replicated)": (layer.bias.grad, full.bias.grad),
        "weight tags": (_tags(layer.weight), (True, 1)),
        "bias tags": (_tags(layer.bias), (False, None)),
    }


def _padded_table(vocab: int, hidden: int, tp) -> Tuple[torch.Tensor, int, slice]:
    """A full ``[V, H]`` table, the padded vocabulary size and this rank's rows of it."""
    from hybridtrain.models.families import padded_vocab

    v_pad = padded_vocab(vocab, tp.size)
    assert v_pad % tp.size == 0 and vocab <= v_pad < vocab + tp.size, (vocab, tp.size, v_pad)
    return torch.randn(vocab, hidden), v_pad, _rows(v_pad, tp)


def _shard_rows(full: torch.Tensor, v_pad: int, rows: slice) -> torch.Tensor:
    padded = torch.cat([full, full.new_zeros(v_pad - full.shape[0], full.shape[1])])  # [V_pad, H]
    return padded[rows].clone()


def _pad_rows(t: torch.Tensor, v_pad: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(v_pad - t.shape[0], *t.shape[1:])])


def case_embedding(tp, vocab: int) -> Checks:
    from hybridtrain.parallel.layers import VocabParallelEmbedding

    torch.manual_seed(3)
    weight, v_pad, rows = _padded_table(vocab, 8, tp)
    ids = torch.randint(0, vocab, (B, S))
    ids[0, :2] = torch.tensor([0, vocab - 1])  # both ends of the real vocabulary
    g = torch.randn(B, S, 8)
    full = nn.Embedding.from_pretrained(weight.clone(), freeze=False)
    y_ref = full(ids)
    y_ref.backward(g)

    layer = VocabParallelEmbedding(_shard_rows(weight, v_pad, rows), rows.start, vocab, tp)
    y = layer(ids)  # [B, S, H], all-reduced
    y.backward(g)
    return {
        "output (all-reduced)": (y.detach(), y_ref.detach()),
        "weight grad rows (padding rows zero)": (layer.weight.grad, _pad_rows(full.weight.grad, v_pad)[rows]),
        "weight tags": (_tags(layer.weight), (True, 0)),
    }


def _head_checks(tp, vocab: int, make_head: Callable, seed: int) -> Checks:
    torch.manual_seed(seed)
    weight, v_pad, rows = _padded_table(vocab, 8, tp)
    x = torch.randn(B, S, 8)
    g = torch.randn(B, S, v_pad)
    w_ref = weight.clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    logits_ref = x_ref @ w_ref.t()  # [B, S, V]
    logits_ref.backward(g[..., :vocab])

    head = make_head(_shard_rows(weight, v_pad, rows), rows.start, vocab, tp)
    x_par = x.clone().requires_grad_()
    logits = head(x_par)  # [B, S, V_pad/tp], padded columns -inf
    logits.backward(g[..., rows])  # the -inf columns must pass no gradient on
    gathered = _gather_last(logits, tp)  # [B, S, V_pad]
    return {
        "real logits gathered": (gathered[..., :vocab], logits_ref.detach()),
        "padded logits are -inf": (bool(torch.isneginf(gathered[..., vocab:]).all()), True),
        "input grad (all-reduced)": (x_par.grad, x_ref.grad),
        "weight grad rows (padding rows zero)": (head.weight.grad, _pad_rows(w_ref.grad, v_pad)[rows]),
        "weight tags": (_tags(head.weight), (True, 0)),
    }


def case_tied_head(tp, vocab: int) -> Checks:
    from hybridtrain.parallel.layers import VocabParallelEmbedding

    def make(weight, start, vocab_size, tp_):
        emb = VocabParallelEmbedding(weight, start, vocab_size, tp_)
        head = partial(emb, as_head=True)
        head.weight = emb.weight
        return head

    return _head_checks(tp, vocab, make, seed=4)


def case_untied_head(tp, vocab: int) -> Checks:
    from hybridtrain.parallel.layers import VocabParallelHead

    return _head_checks(tp, vocab, VocabParallelHead, seed=5)


def case_loss(tp, vocab: int) -> Checks:
    from hybridtrain.parallel.layers import VocabParallelLoss

    torch.manual_seed(6)
    _, v_pad, rows = _padded_table(vocab, 1, tp)
    logits = torch.randn(B, S, vocab) * 3
    labels = torch.randint(0, vocab, (B, S))
    labels[0, :3] = torch.tensor([0, vocab - 1, -100])
    labels[1, -1] = -100
    full = logits.clone().requires_grad_()
    loss_ref = F.cross_entropy(full.view(-1, vocab), labels.view(-1), ignore_index=-100)
    loss_ref.backward()

    # What the head hands the loss: padded vocabulary columns at -inf.
    padded = torch.cat([logits, logits.new_full((B, S, v_pad - vocab), float("-inf"))], dim=-1)
    local = padded[..., rows].clone().requires_grad_()  # [B, S, V_pad/tp]
    syncs = []  # host reads of a tensor's value: on a GPU each waits for the device (one per micro-batch before)
    item, as_bool = torch.Tensor.item, torch.Tensor.__bool__
    torch.Tensor.item = lambda self: (syncs.append("item"), item(self))[1]
    torch.Tensor.__bool__ = lambda self: (syncs.append("bool"), as_bool(self))[1]
    try:
        loss = VocabParallelLoss(v_pad, tp)(local, labels)
        loss.backward()
    finally:
        torch.Tensor.item, torch.Tensor.__bool__ = item, as_bool
    grad_ref = torch.cat([full.grad, full.grad.new_zeros(B, S, v_pad - vocab)], dim=-1)[..., rows]
    return {
        "loss": (loss.detach(), loss_ref.detach()),
        "logits grad cols": (local.grad, grad_ref),
        "host syncs": (syncs, []),
    }


# -- whole HF decoder blocks ------------------------------------------------------------------

_BLOCK_CONFIGS = {  # 12 query heads (6 KV heads with grouped-query attention): tp=2 and tp=3 divide them
    "gpt2": dict(n_embd=96, n_head=12, n_layer=1, n_positions=16,
                 resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0),
    "llama": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, intermediate_size=192,
                  num_hidden_layers=1, max_position_embeddings=16, attention_bias=True),
    "mistral": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, intermediate_size=192,
                    num_hidden_layers=1, max_position_embeddings=16, sliding_window=4),
    "qwen2": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, intermediate_size=192,
                  num_hidden_layers=1, max_position_embeddings=16),  # biases on q, k, v
    "qwen3": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, head_dim=16, intermediate_size=192,
                  num_hidden_layers=1, max_position_embeddings=16, attention_bias=True),  # per-head q/k norms
    "gemma": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, head_dim=16, intermediate_size=192,
                  num_hidden_layers=1, max_position_embeddings=16),
    "gemma2": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, head_dim=16, intermediate_size=192,
                   num_hidden_layers=1, max_position_embeddings=16, query_pre_attn_scalar=24,
                   attn_logit_softcapping=1.0),
    "phi3": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, intermediate_size=192,
                 num_hidden_layers=1, max_position_embeddings=16, partial_rotary_factor=0.5, resid_pdrop=0.0),
    "olmo2": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, intermediate_size=192,
                  num_hidden_layers=1, max_position_embeddings=16),  # q/k norm over the full width
    "gpt_neox": dict(hidden_size=96, num_attention_heads=12, intermediate_size=192, num_hidden_layers=1,
                     max_position_embeddings=16, rotary_pct=0.25, hidden_dropout=0.0, attention_dropout=0.0),
    # Gated DeltaNet (block 0: 6 key heads of 16, 12 value heads of 8) and gated full attention (block 1)
    "qwen3_5_text": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, head_dim=16,
                         intermediate_size=192, num_hidden_layers=2, max_position_embeddings=16,
                         layer_types=["linear_attention", "full_attention"], linear_num_key_heads=6,
                         linear_num_value_heads=12, linear_key_head_dim=16, linear_value_head_dim=8),
    # Qwen3-Next: fused in_proj_qkvz / in_proj_ba laid out by key-head groups; dense MLPs (mlp_only_layers) here
    "qwen3_next": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, head_dim=16,
                       intermediate_size=192, num_hidden_layers=2, max_position_embeddings=16,
                       layer_types=["linear_attention", "full_attention"], mlp_only_layers=[0, 1],
                       linear_num_key_heads=6, linear_num_value_heads=12, linear_key_head_dim=16,
                       linear_value_head_dim=8),
    # SmolLM3: block 1 NoPE (no_rope_layer_interval=2); OLMo 3: block 0 sliding, its own rotary base, full-width
    # q/k norms; Gemma 3: block 0 sliding, per-head q/k norms, query_pre_attn_scalar apart from head_dim
    "smollm3": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, intermediate_size=192,
                    num_hidden_layers=2, max_position_embeddings=16, no_rope_layer_interval=2, pad_token_id=0),
    "olmo3": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, intermediate_size=192,
                  num_hidden_layers=1, max_position_embeddings=16, sliding_window=4, pad_token_id=0),
    "gemma3_text": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, head_dim=16,
                        intermediate_size=192, num_hidden_layers=1, max_position_embeddings=16,
                        query_pre_attn_scalar=24, sliding_window=4),
}
_BLOCKS = {"qwen3_5_text": (0, 1), "qwen3_next": (0,), "smollm3": (0, 1)}
"""The blocks checked where they differ (default: block 0)."""
_EAGER = {"gemma2"}  # attention soft-capping runs only in its eager kernel


def _column_index(out: int, fused, tp) -> torch.Tensor:
    """Output rows of a column-parallel weight kept by this rank: its slice of each fused sub-block
    (``fused``: n equal blocks or the block sizes)."""
    sizes = [out // fused] * fused if isinstance(fused, int) else list(fused)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return torch.cat([torch.arange(s, s + n)[_rows(n, tp)] for s, n in zip(starts, sizes)])


def case_block(tp, model_type: str, index: int = 0) -> Checks:
    from hybridtrain.models.build import shard_block
    from hybridtrain.models.hf_model import hf_config_of, reference_model
    from hybridtrain.models.families import fused_sizes, get_family
    from hybridtrain.models.stages import rotary_layer_type

    family = get_family(model_type)
    cfg = hf_config_of(model_type, _BLOCK_CONFIGS[model_type], vocab_size=10,
                       attn_implementation="eager" if model_type in _EAGER else "sdpa", eos_token_id=0)
    model = reference_model(cfg, family, seed=7)
    full = model.get_submodule(f"{family.blocks}.{index}")
    torch.manual_seed(8)
    with torch.no_grad():  # unit norms and zero biases would hide a mis-sliced or dropped term
        for p in full.parameters():
            p.add_(0.1 * torch.randn_like(p))
    sharded = copy.deepcopy(full)
    variant = family.variant_of(cfg, index)
    shard_block(sharded, family, cfg, tp, variant=variant)
    plan = family.plan_of(variant)

    hidden = int(getattr(cfg, family.hidden))
    x = torch.randn(B, S, hidden)
    g = torch.randn(B, S, hidden)
    kwargs: Dict[str, Any] = {"attention_mask": None}  # sdpa + no mask: causal; eager: none (the same for both)
    if family.rotary_embed:  # (cos, sin) from the model's own rotary embedding
        pos = torch.arange(S).unsqueeze(0)  # [1, S]
        rotary = model.get_submodule(family.rotary_embed)
        layer_type = rotary_layer_type(rotary, cfg, index)  # Gemma 3, OLMo 3: one table per layer type
        table = rotary(x, position_ids=pos, **({"layer_type": layer_type} if layer_type else {}))
        kwargs.update(position_ids=pos, position_embeddings=table)

    x_ref = x.clone().requires_grad_()
    y_ref = full(x_ref, **kwargs)
    y_ref = y_ref[0] if isinstance(y_ref, tuple) else y_ref
    y_ref.backward(g)
    x_par = x.clone().requires_grad_()
    y = sharded(x_par, **kwargs)
    y = y[0] if isinstance(y, tuple) else y
    y.backward(g)

    checks: Checks = {"output": (y.detach(), y_ref.detach()), "input grad": (x_par.grad, x_ref.grad)}
    full_params = dict(full.named_parameters())
    seen = set()
    for module_name, rule in plan.items():
        if rule.style == "grad_sum":  # replicated: checked with the others below (summed over TP)
            continue
        module = sharded.get_submodule(module_name)
        if rule.style in ("heads", "channels"):  # own parameters split along dim 0 (fused blocks for channels)
            for leaf, param in module.named_parameters(recurse=False):
                grad = full_params[f"{module_name}.{leaf}"].grad
                idx = _column_index(grad.shape[0], fused_sizes(rule, family, cfg, grad.shape[0]), tp)
                checks[f"{module_name}.{leaf} grad rows"] = (param.grad, grad[idx])
                checks[f"{module_name}.{leaf} tags"] = (_tags(param), (True, 0))
                seen.add(f"{module_name}.{leaf}")
            continue
        w_grad = full_params[f"{module_name}.weight"].grad
        if rule.style == "norm":  # weight split like the column rows it normalises
            rows = _rows(w_grad.shape[0], tp)
            checks[f"{module_name}.weight grad rows"] = (module.weight.grad, w_grad[rows])
            checks[f"{module_name}.weight tags"] = (_tags(module.weight), (True, 0))
            seen.add(f"{module_name}.weight")
            continue
        w_grad = w_grad.t() if rule.conv1d else w_grad  # HF Conv1D stores [in, out]
        out_features, in_features = w_grad.shape
        if rule.style == "column":
            idx = _column_index(out_features, fused_sizes(rule, family, cfg, out_features), tp)
            checks[f"{module_name}.weight grad rows"] = (module.weight.grad, w_grad[idx])
            checks[f"{module_name}.weight tags"] = (_tags(module.weight), (True, 0))
        else:
            cols = _rows(in_features, tp)
            checks[f"{module_name}.weight grad cols"] = (module.weight.grad, w_grad[:, cols])
            checks[f"{module_name}.weight tags"] = (_tags(module.weight), (True, 1))
        seen.add(f"{module_name}.weight")
        if module.bias is not None:
            b_grad = full_params[f"{module_name}.bias"].grad
            if rule.style == "column":
                checks[f"{module_name}.bias grad rows"] = (module.bias.grad, b_grad[idx])
                checks[f"{module_name}.bias tags"] = (_tags(module.bias), (True, 0))
            else:
                checks[f"{module_name}.bias grad (replicated)"] = (module.bias.grad, b_grad)
                checks[f"{module_name}.bias tags"] = (_tags(module.bias), (False, None))
            seen.add(f"{module_name}.bias")
    replicated = [name for name, _ in sharded.named_parameters() if name not in seen]
    for name, p in sharded.named_parameters():
        if name not in seen:
            checks[f"{name} grad (replicated)"] = (p.grad, full_params[name].grad)
            checks[f"{name} tags"] = (_tags(p), (False, None))
    checks["has replicated norm params"] = (len(replicated) >= 2, True)
    checks["parameter names unchanged"] = (sorted(dict(sharded.named_parameters())), sorted(full_params))
    return checks


CASES: Dict[str, Callable] = {
    "column_linear": case_column_linear,
    "row_linear": case_row_linear,
    **{f"embedding_V{v}": partial(case_embedding, vocab=v) for v in (10, 11)},
    **{f"tied_head_V{v}": partial(case_tied_head, vocab=v) for v in (10, 11)},
    **{f"untied_head_V{v}": partial(case_untied_head, vocab=v) for v in (10, 11)},
    **{f"loss_V{v}": partial(case_loss, vocab=v) for v in (10, 11)},
    **{f"block_{m}" + (f"_{i}" if m in _BLOCKS else ""): partial(case_block, model_type=m, index=i)
       for m in _BLOCK_CONFIGS for i in _BLOCKS.get(m, (0,))},
}
"""V=10 is unpadded at tp=2 and padded to 12 at tp=3; V=11 is padded to 12 at both."""



def run_cases(rank: int, world: int, emit) -> None:
    """Child entry: every case at every degree in ``TP_DEGREES`` (:func:`helpers.tp_checks.run_cases_at_degrees`)."""
    assert world == max(TP_DEGREES), world
    run_cases_at_degrees(CASES, TP_DEGREES, rank, emit)


# --------------------------------------------------------------------------------------------
# Tests (parent process)
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def world_run() -> WorldRun:
    """All cases at all degrees, run once for the module in one world of spawned gloo ranks."""
    return run_world(run_cases, max(TP_DEGREES), timeout_s=120)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tp", TP_DEGREES, ids=lambda n: f"tp{n}")
def test_tp_layer_matches_unsharded(world_run: WorldRun, tp: int, case: str) -> None:
    assert_rank_checks(world_run, tp, case, BLOCK_REL_TOL if case.startswith("block_") else REL_TOL)
    assert not world_run.problems, world_run.problem_report()


def _raise_on_last_rank(rank: int, world: int, emit) -> None:
    """Harness self-test target: the last rank raises, the others emit and then hang."""
    import time

    if rank == world - 1:
        raise ValueError("boom from the last rank")
    emit("before", {"rank": rank})
    time.sleep(3600)  # a hung rank (gloo would notice a dead peer inside a collective)


def test_harness_reports_child_traceback_and_kills_hung_peer() -> None:
    """The contract every test above relies on: no hang, and the failing rank's own traceback."""
    run = run_world(_raise_on_last_rank, 2, timeout_s=60, grace_s=1.0, deepspeed_comm=False)
    report = run.problem_report()
    assert "ValueError: boom from the last rank" in report and "in _raise_on_last_rank" in report, report
    assert "rank 0 killed" in report, report
    assert run.emitted == [{"before": {"rank": 0}}, {}]
