"""Activation memory, measured: the bytes of the tensors autograd keeps for the backward of one micro-batch.

    python -m bench.activations                  # every family's fitting rows, then the cp = 1 and cp = 2 rows
    python -m bench.activations --families llama --no-cp --no-ep
    python -m bench.activations --ep-only          # the ep = 2 rows alone (bench/results/activations-ep_DATE.json)

The count is exact and independent of machine load: ``torch.autograd.graph.saved_tensors_hooks`` sees every
tensor saved for the backward while hybridtrain's own layers (:func:`hybridtrain.models.stages.sequential_model`)
run ``model(inputs, labels)``; each is counted once per storage (views share one), parameters and buffers left out.
With activation checkpointing (``parallel.activation_checkpointing=true``) the checkpointed blocks save through
``torch.utils.checkpoint``'s own hooks instead; what they keep is each block's input (counted by a forward
pre-hook, the storage the checkpoint holds for the recomputation) and, during the backward, one block recomputed
at a time, whose saved tensors are those of the same block run without checkpointing (``block`` below).

Context parallelism (the cp rows, :data:`CP_CASES`) runs the same model on two gloo ranks (:func:`hybridtrain.parallel.spawn.run_world`),
each given whole rows (the embedding takes the rank's chunks); the count is per rank. Expert parallelism (the ep
rows, :data:`EP_CASES`) runs MoE models on two gloo ranks, each with its own tokens, and records per rank the pairs
its experts received against those its tokens sent.

What the plan estimates from these numbers (``hybridtrain/plan/memory.py``, :func:`activation_bytes`) is checked
against them in ``tests/unit/test_activation_memory.py``. Results go to ``bench/results/activations_DATE.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import functools
import json
import weakref
from pathlib import Path

import torch

SHAPES: dict[str, dict] = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=128),
    "mistral": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                    intermediate_size=128, sliding_window=4096),
    "qwen2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=128),
    "qwen3": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                  intermediate_size=128),
    "gemma": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                  intermediate_size=128, pad_token_id=0),
    "gemma2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                   intermediate_size=128, query_pre_attn_scalar=16, sliding_window=4096, pad_token_id=0),
    "phi3": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                 intermediate_size=128, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    "olmo2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=128, pad_token_id=1),
    "gpt_neox": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, intermediate_size=128,
                     use_parallel_residual=True, hidden_dropout=0.0, attention_dropout=0.0),
    "smollm3": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                    intermediate_size=128, pad_token_id=2),
    "olmo3": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=128, pad_token_id=1, sliding_window=4096),
    "gemma3_text": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                        intermediate_size=128, query_pre_attn_scalar=16, sliding_window=4096, pad_token_id=0),
}
"""Each family's small shape (HF names; MLP width 2 x hidden): two blocks, 8 query heads, 4 KV heads where the family
has grouped-query attention. Sliding windows (Mistral, Gemma 2) are longer than the rows: a window shorter than the
row makes sdpa keep a mask, which the plan does not count yet. SmolLM3's two blocks both take rotary (its NoPE blocks,
one in ``no_rope_layer_interval``, keep no more than these: the plan counts them as rotary blocks); OLMo 3's and
Gemma 3's are sliding blocks (the first of their patterns)."""

_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, num_experts_per_tok=2)
MOE_SHAPES: dict[str, dict] = {
    "qwen3_moe": dict(_MOE, head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8),
    "mixtral": dict(_MOE, intermediate_size=32, num_local_experts=8, sliding_window=4096),
    "olmoe": dict(_MOE, intermediate_size=32, num_experts=8, pad_token_id=1),
    "qwen2_moe": dict(_MOE, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      num_experts=8),
    "gpt_oss": dict(_MOE, head_dim=16, intermediate_size=32, num_local_experts=8, sliding_window=128,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "deepseek_v3": dict(_MOE, num_key_value_heads=8, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                        n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=0),
}
"""The mixture-of-experts families' small shapes (two MoE blocks, 8 experts of width 32, top-2; Qwen2-MoE with a
shared expert of width 64, DeepSeek-V3 with one of the experts' width). gpt-oss alternates a sliding window (128,
shorter than the rows, as in the real model) with full attention. DeepSeek-V3's MLA keeps the real model's ratios of
value to query/key head (2/3: 16 and 16 + 8) and one key-value head per query head; its blocks are all MoE here and
all dense in its dense rows (:data:`DENSE_OF`). Each family's attention constants are a dense fit's
(:data:`MOE_ATTENTION`); only the MoE MLP's are fitted over them (:func:`fit_moe`)."""
SHAPES.update(MOE_SHAPES)
MOE_ATTENTION = {"qwen3_moe": "qwen3", "mixtral": "mistral", "olmoe": "olmo2", "qwen2_moe": "qwen2",
                 "gpt_oss": "qwen2", "deepseek_v3": "deepseek_v3/dense"}
"""The dense fit whose block has the same attention as each MoE family's: a dense family's, gpt-oss's from Qwen2
(biased q, k, v, grouped-query heads; the sink column and o's bias keep nothing more per token, the rows show it),
DeepSeek-V3's from its own dense blocks (``first_k_dense_replace``: the fit group :data:`DENSE_OF`)."""
DENSE_OF = {"deepseek_v3/dense": ("deepseek_v3", dict(first_k_dense_replace=2))}
"""Fit groups of an MoE family's own dense blocks: the family and the shape that makes every block dense."""
EAGER_ONLY = {"gemma2", "gpt_oss"}
"""Families transformers gives no sdpa (gpt-oss: its sinks run in eager only)."""
MATH_SDPA = {"deepseek_v3"}
"""Families whose sdpa on CPU is torch's math kernel (value heads narrower than query heads,
:func:`hybridtrain.plan.memory.kernel_flags`): fitted from eager rows, like those without sdpa."""
FP32_ONLY = {"deepseek_v3"}
"""Families the plan runs in fp32 only (transformers keeps their router in fp32 in 16-bit models): no bf16 rows."""
MOE_KEYS = {"qwen3_moe": ("moe_intermediate_size", "num_experts"), "mixtral": ("intermediate_size", "num_local_experts"),
            "olmoe": ("intermediate_size", "num_experts"), "qwen2_moe": ("moe_intermediate_size", "num_experts"),
            "gpt_oss": ("intermediate_size", "num_local_experts"),
            "deepseek_v3": ("moe_intermediate_size", "n_routed_experts")}
"""HF config keys of each MoE family's expert width and number of experts."""
VOCAB = 2048
HIDDEN_KEYS = ("hidden_size", "n_embd")


def config(family: str, seq_len: int, *, attn: str = "sdpa", precision: str = "fp32", checkpointing: bool = False,
           packed: bool = False, shape: dict | None = None):
    """``(cfg, hf_config)`` of ``family``'s small shape (:data:`SHAPES` updated with ``shape``, HF names), composed
    as a run composes it (``++model.config.KEY=VALUE`` overrides, :func:`hybridtrain.plan.model_config`)."""
    from hybridtrain.cli import compose
    from hybridtrain.plan import model_config

    shape = {**SHAPES[family], **(shape or {})}
    shape["n_positions" if family == "gpt2" else "max_position_embeddings"] = max(2048, seq_len)
    overrides = [f"model={family}", f"model.attn_implementation={attn}", f"data.seq_len={seq_len}",
                 f"trainer.precision={precision}", f"parallel.activation_checkpointing={str(checkpointing).lower()}",
                 f"data.packing={'documents' if packed else 'none'}", f"++model.config.vocab_size={VOCAB}"]
    overrides += [f"++model.config.{k}={_override(v)}" for k, v in shape.items()]
    cfg = compose(overrides)
    return cfg, model_config(cfg)


def _override(value) -> str:
    """``value`` in Hydra's override grammar (lists and dicts, whose keys are bare names)."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_override(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override(v) for v in value) + "]"
    return f"'{value}'" if isinstance(value, str) else str(value)


def row_positions(seq_len: int, packed: bool) -> torch.Tensor:
    """Position ids of one row: ``arange``, or three packed records (restarts at 0) of 1/2, 1/4, 1/4 of the row."""
    if not packed:
        return torch.arange(seq_len)
    cuts = [seq_len // 2, seq_len // 4, seq_len - seq_len // 2 - seq_len // 4]
    return torch.cat([torch.arange(n) for n in cuts])


class SavedBytes:
    """Bytes of the distinct storages autograd saves while active and still holds when read, parameters and buffers
    excluded. A tensor saved by a node that is freed before the backward (a branch nothing differentiates, e.g. a
    router's choice of experts) is not counted: its memory is released, and may be reused by a later tensor."""

    def __init__(self, model: torch.nn.Module):
        self.skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.saved: list[tuple[weakref.ref, int, int]] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter) and t.device.type != "meta":
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.skip:
                self.saved.append((weakref.ref(t), storage.data_ptr(), storage.nbytes()))
        return t

    def add(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage too (a checkpointed block's input, held for the recomputation)."""
        self.pack(t)

    @property
    def total(self) -> int:
        live = {ptr: nbytes for ref, ptr, nbytes in self.saved if ref() is not None}  # views share a storage
        return sum(live.values())

    @contextlib.contextmanager
    def counting(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield self


def _count(model, inputs, labels, checkpointing: bool, after_forward=None) -> tuple[int, int]:
    """``(saved bytes of model(inputs, labels), saved bytes of its first block alone)``; runs the backward.
    ``after_forward()`` runs right after the whole model's forward (what an observer reads of it)."""
    from hybridtrain.models.stages import DecoderBlock

    counter = SavedBytes(model)
    blocks = [m for m in model.layers if isinstance(m, DecoderBlock)]
    hooks = []
    if checkpointing:  # the checkpoint holds each block's input for the recomputation
        hooks = [b.register_forward_pre_hook(lambda m, args: counter.add(args[0][0])) for b in blocks]
    first: dict[str, int] = {}

    def capture_first(module, args):
        first["input"] = args[0]

    hooks.append(blocks[0].register_forward_pre_hook(capture_first))
    with counter.counting():
        loss = model(inputs, labels)
    total = counter.total
    if after_forward is not None:
        after_forward()
    for h in hooks:
        h.remove()
    loss.backward()
    # the first block alone, without checkpointing: what a recomputation keeps during the backward
    x = first["input"]
    hidden = x[0].detach().requires_grad_(True)
    alone = SavedBytes(model)
    saved_flag = blocks[0].checkpointing
    blocks[0].checkpointing = False
    with alone.counting():
        out = blocks[0]((hidden, *x[1:]))
    blocks[0].checkpointing = saved_flag
    block = alone.total  # before the backward frees what the block saved
    out[0].float().sum().backward()
    return total, block


def _model(cfg, hf, cp=None, ep=None):
    from hybridtrain.models import moe
    from hybridtrain.models.build import ModelBuilder
    from hybridtrain.models.families.base import padded_vocab
    from hybridtrain.models.stages import sequential_model
    from hybridtrain.parallel.context import CPContext, TPContext
    from hybridtrain.parallel.layers import VocabParallelLoss

    tp, cp = TPContext(), cp or CPContext()
    padded = padded_vocab(int(hf.vocab_size), 1)
    builder = ModelBuilder.for_run(cfg, hf, tp, padded, cp=cp, ep=ep)
    model = sequential_model(builder, moe.loss_of(VocabParallelLoss(padded, tp, cp), builder.family, hf))
    if cfg.trainer.precision == "bf16":
        model = model.to(torch.bfloat16)
    return model.train(), padded


def measure(family: str, seq_len: int, *, batch: int = 1, attn: str = "sdpa", precision: str = "fp32",
            checkpointing: bool = False, packed: bool = False, shape: dict | None = None, cp=None, ep=None) -> dict:
    """Saved bytes of one micro-batch ``[batch, seq_len]`` (with labels) through ``family``'s model on this rank:
    ``total`` (the whole model, what the plan's :func:`activation_bytes` estimates) and ``block`` (one block run
    alone, without checkpointing). ``cp``: this rank's :class:`CPContext` in a context-parallel world; ``ep``: its
    :class:`EPContext` in an expert-parallel one, where each rank draws its own tokens (a data-parallel rank's
    batch) and the row records ``received``, the (token, slot) pairs its experts ran over all MoE blocks, and
    ``sent``, its own tokens' pairs (``received / sent`` is 1 with balanced routing)."""
    from hybridtrain.parallel.experts import ExpertDispatch

    cfg, hf = config(family, seq_len, attn=attn, precision=precision, checkpointing=checkpointing, packed=packed,
                     shape=shape)
    torch.manual_seed(0)
    model, padded = _model(cfg, hf, cp, ep)
    seed = 1 + (ep.rank if ep is not None else 0)
    ids = torch.randint(0, int(hf.vocab_size), (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    pos = row_positions(seq_len, packed).repeat(batch, 1)
    dispatchers = [m.forward for m in model.modules() if isinstance(getattr(m, "forward", None), ExpertDispatch)]
    routed: dict[str, int] = {}

    def after_forward():
        routed["received"] = sum(d.last_received for d in dispatchers)

    total, block = _count(model, (ids, pos), ids.clone(), checkpointing, after_forward if dispatchers else None)
    shapes = dims(cfg, hf)
    if dispatchers:
        routed["sent"] = batch * seq_len * shapes["top_k"] * len(dispatchers)
    return dict(family=family, seq_len=seq_len, batch=batch, attn=attn, precision=precision,
                checkpointing=checkpointing, packed=packed, shape=shape or {}, **shapes,
                padded_vocab=padded, cp=1 if cp is None else cp.size, ep=1 if ep is None else ep.size, **routed,
                total=total, block=block)


def dims(cfg, hf) -> dict:
    """The shape the plan reads (:class:`~hybridtrain.plan.costs.ModelFacts`): hidden, MLP width, query and
    key-value widths, MLA's low-rank widths, heads, blocks; an MoE model's experts per token, one expert's width,
    experts and the shared experts' width."""
    from hybridtrain.plan.costs import model_facts
    from hybridtrain.models.families import family_of

    f = model_facts(family_of(cfg.model), hf, int(cfg.data.seq_len))
    moe = dict(top_k=f.top_k, expert_width=f.expert_width, num_experts=f.num_experts,
               shared_width=f.shared_width) if f.top_k else {}
    return dict(hidden=f.hidden, intermediate=f.intermediate, q_dim=f.q_dim, kv_dim=f.kv_dim, heads=f.heads,
                blocks=f.num_layers, latent=f.latent_dim, **moe)


@functools.lru_cache(maxsize=None)
def _facts(family: str, shape: str):
    """The plan's :class:`~hybridtrain.plan.costs.ModelFacts` of a family's shape (JSON ``shape``) at s = 1024: kernel,
    dtype, packing and checkpointing do not change them, the sequence is set per row."""
    from hybridtrain.models.families import family_of
    from hybridtrain.plan.costs import model_facts

    from hybridtrain.plan import model_config

    cfg = copy.deepcopy(_composed(family))  # the shape's HF keys set on the typed config, as ++model.config.KEY does
    full = {**SHAPES[family], **json.loads(shape)}
    full["n_positions" if family == "gpt2" else "max_position_embeddings"] = 2048
    cfg.model.config.update(full)
    return model_facts(family_of(cfg.model), model_config(cfg), 1024)


@functools.lru_cache(maxsize=None)
def _composed(family: str):
    """:func:`config`'s typed config of ``family`` at s = 1024 (eager: every family has it, Gemma 2 no sdpa), composed
    once: composing with Hydra takes half a second, and the recorded rows hold about a hundred shapes."""
    return config(family, 1024, attn="eager")[0]


def estimate(row: dict, cp: int | None = None) -> int:
    """The plan's activation bytes (:func:`hybridtrain.plan.memory.activation_bytes`) of a measured row's model, all
    its units on one rank, at the row's cp (or ``cp``) and ep."""
    import dataclasses

    from hybridtrain.plan.memory import activation_bytes, kernel_flags

    facts = dataclasses.replace(_facts(row["family"], json.dumps(row["shape"], sort_keys=True)),
                                seq_len=row["seq_len"])
    flags = kernel_flags(row["attn"], row["packed"], facts, gpus=False)  # measured on CPU
    return activation_bytes(facts.units, facts, row["batch"], 1, row["precision"], row["checkpointing"], **flags,
                            cp=cp or row["cp"], ep=row.get("ep", 1))


def measured_peak(row: dict) -> int:
    """What a measured rank holds at its peak: the forward's saved tensors, plus, with checkpointing, one block
    recomputed during the backward (its saved tensors as it runs without checkpointing)."""
    return row["total"] + (row["block"] if row["checkpointing"] else 0)


def _world_rank(rank: int, world: int, emit) -> None:
    """A rank of the two-rank world: every case of ``HT_ACT_CASES`` (JSON) measured with ``HT_ACT_AXIS`` (``cp``
    or ``ep``) = ``world``."""
    import os

    import torch.distributed as dist

    from hybridtrain.parallel.context import CPContext, EPContext

    axis = os.environ["HT_ACT_AXIS"]
    context = (CPContext if axis == "cp" else EPContext)(group=dist.group.WORLD, rank=rank, size=world)
    for i, case in enumerate(json.loads(os.environ["HT_ACT_CASES"])):
        emit(str(i), measure(**case, **{axis: context}))


def measure_world(cases: list[dict], axis: str, size: int = 2, timeout_s: float = 300.0) -> list[list[dict]]:
    """:func:`measure` of each case (keyword dicts) on every rank of a ``size``-rank gloo world split over ``axis``
    (``cp`` or ``ep``): per case, the rows of ranks 0 .. size - 1."""
    import os

    from hybridtrain.parallel.spawn import run_world

    os.environ["HT_ACT_CASES"], os.environ["HT_ACT_AXIS"] = json.dumps(cases), axis
    run = run_world(_world_rank, size, timeout_s=timeout_s, deepspeed_comm=False)
    assert not run.problems, run.problem_report()
    return [[run.emitted[r][str(i)] for r in range(size)] for i in range(len(cases))]


def measure_cp(cases: list[dict], cp: int = 2, timeout_s: float = 300.0) -> list[dict]:
    """:func:`measure` of each case on rank 0 of a ``cp``-rank context-parallel world (the ranks alike)."""
    return [rows[0] for rows in measure_world(cases, "cp", cp, timeout_s)]


def measure_ep(cases: list[dict], ep: int = 2, timeout_s: float = 300.0) -> list[dict]:
    """:func:`measure` of each case on every rank of an ``ep``-rank expert-parallel world (one row per rank: the
    ranks route differently)."""
    return [row for rows in measure_world(cases, "ep", ep, timeout_s) for row in rows]


def structural(r: dict, attn: str | None = None) -> float:
    """Bytes of one block of row ``r`` that follow from the attention's shapes alone, no fitting: the keys and values
    repeated to every query head over the whole row (``2 w q s b``, what eager, and sdpa given a mask, keep in place
    of sdpa's own ``2 w k s/cp b``) and sdpa's mask in the activation dtype (``w`` per element of
    ``[b, 1, s/cp, s]``). Plain causal sdpa at cp = 1 gets no mask: 0. Eager's attention matrix is fitted
    (``scores``)."""
    w = 4 if r["precision"] == "fp32" else 2
    s, b, local = r["seq_len"], r["batch"], r["seq_len"] // r["cp"]
    attn = attn or r["attn"]
    masked = attn == "eager" or r["packed"] or r["cp"] > 1
    if not masked:
        return 0.0
    out = 2 * w * b * (r["q_dim"] * s - r["kv_dim"] * local)
    return out + (w * b * local * s if attn == "sdpa" else 0.0)


def _groups(rows: list[dict]) -> dict[tuple[str, str], dict[str, dict]]:
    """The rows by ``(fit group, precision)`` and then by tag (the group: the row's ``group``, else its family)."""
    by: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        by.setdefault((r.get("group") or r["family"], r["precision"]), {})[r["tag"]] = r
    return by


def eager_scores(a: dict, longer: dict) -> float:
    """Eager's bytes per element of the attention matrix from two eager rows, ``longer`` at twice ``a``'s sequence:
    what the longer row's block keeps beyond twice the shorter's (its token-wise terms, the MoE ones included,
    double) is the matrix's growth."""
    s, s2 = a["seq_len"], longer["seq_len"]
    extra = (longer["block"] - structural(longer)) - (s2 / s) * (a["block"] - structural(a))
    return extra / (a["heads"] * (s2 * s2 - (s2 / s) * s * s))


def fit(rows: list[dict]) -> dict:
    """Per ``(fit group, precision)`` (the group: the row's ``group``, else its family), the constants of
    :class:`hybridtrain.plan.memory.Activations` from the fitting rows (``tag``: A base, I wider MLP, H wider hidden,
    D wider heads, K more KV heads, L wider MLA low-rank projections, S twice the sequence, E eager, P packed): least
    squares of the block's bytes per token over the widths, eager's bytes per element of the attention matrix, the
    bytes outside the blocks per hidden unit and per vocabulary entry."""
    import numpy as np

    by = _groups(rows)
    out = {}
    for (family, precision), t in by.items():
        a, s = t["A"], t["A"]["seq_len"]
        scores = None
        if a["attn"] == "eager":  # no sdpa (Gemma 2): the s^2 term from twice the sequence
            scores = eager_scores(a, t["S"])
        elif "E" in t:
            e = t["E"]
            scores = (e["block"] - structural(e) - a["block"]) / (a["heads"] * s * s)

        def token_wise(r):  # the block's bytes per token without its s^2 and repeated-KV terms
            extra = structural(r) + (scores * r["heads"] * s * s if r["attn"] == "eager" else 0.0)
            return (r["block"] - extra) / r["seq_len"]

        heads_vary, latent = "D" in t, "L" in t
        tags = [k for k in "AIHDKL" if k in t]
        x = np.array([[t[k]["hidden"], t[k]["intermediate"]] + ([t[k]["q_dim"], t[k]["kv_dim"]] if heads_vary else [])
                      + ([t[k]["latent"]] if latent else []) for k in tags], float)
        y = np.array([token_wise(t[k]) for k in tags])
        coef = np.linalg.lstsq(x, y, rcond=None)[0]

        def outside(r):
            return (r["total"] - r["blocks"] * r["block"]) / r["seq_len"]

        h2 = t["H"]
        per_h = (outside(h2) - outside(a)) / (h2["hidden"] - a["hidden"])
        per_v = (outside(a) - per_h * a["hidden"]) / a["padded_vocab"]
        const = dict(hidden=coef[0], mlp=coef[1], query=coef[2] if heads_vary else 0.0,
                     kv=coef[3] if heads_vary else 0.0, scores=scores or 0.0, outside=per_h, vocab=per_v,
                     **({"latent": coef[-1]} if latent else {}))
        out[family, precision] = {k: round(float(v), 3) for k, v in const.items()}
        out[family, precision]["fit_error"] = round(float(np.max(np.abs(x @ coef / y - 1))), 4)
    return out


def fit_moe(rows: list[dict], dense: dict) -> dict:
    """Per ``(MoE family, precision)``, the MoE constants of :class:`hybridtrain.plan.memory.Activations` from its
    fitting rows (``tag`` A base, k top-4, W wider experts, N twice the experts), over its attention's fitted
    constants ``dense`` (``{(fit group, precision): constants}``, :func:`fit`, :data:`MOE_ATTENTION`), which the MoE
    family keeps: ``routed`` bytes per routed (token, slot) pair per hidden unit, ``expert`` per pair per unit of
    the expert's width, ``router`` per token per expert, and ``moe_hidden`` per token per hidden unit (what is left
    of the base row: the MLP's norm and input, a shared expert's gate). Shared experts as wide as the routed ones
    (DeepSeek-V3) widen with them in the W row: their ``mlp`` bytes are taken off first."""
    out = {}
    for (family, precision), t in _groups(rows).items():
        c = dense[MOE_ATTENTION[family], precision]
        a, k, w, n = t["A"], t["k"], t["W"], t["N"]
        if "S" in t:  # eager only (gpt-oss): its own matrix (its softmax keeps the model's dtype, Qwen2's fp32)
            c = {**c, "scores": eager_scores(a, t["S"])}

        def per_token(r):  # the block's bytes per token without eager's s^2 and repeated-KV terms
            s = r["seq_len"]
            extra = structural(r) + (c["scores"] * r["heads"] * s * s if r["attn"] == "eager" else 0.0)
            return (r["block"] - extra) / s

        shared = c["mlp"] * (w["shared_width"] - a["shared_width"])
        expert = (per_token(w) - per_token(a) - shared) / (a["top_k"] * (w["expert_width"] - a["expert_width"]))
        pair = (per_token(k) - per_token(a)) / (k["top_k"] - a["top_k"])
        routed = (pair - expert * a["expert_width"]) / a["hidden"]
        router = (per_token(n) - per_token(a)) / (n["num_experts"] - a["num_experts"])
        attention = (c["hidden"] * a["hidden"] + c["query"] * a["q_dim"] + c["kv"] * a["kv_dim"]
                     + c.get("latent", 0.0) * a.get("latent", 0))
        left = (per_token(a) - attention - c["mlp"] * a["shared_width"] - a["top_k"] * pair
                - router * a["num_experts"])
        consts = {**c, "routed": routed, "expert": expert, "router": router, "moe_hidden": left / a["hidden"]}
        out[family, precision] = {key: round(float(v), 3) for key, v in consts.items() if key != "fit_error"}
    return out


def fitting_cases(family: str) -> list[dict]:
    """The rows :func:`fit` (and :func:`fit_moe`) read for ``family`` in each precision (fp32 only for
    :data:`FP32_ONLY`): ``tag`` A the base shape at s = 256 (sdpa; eager for :data:`EAGER_ONLY` and
    :data:`MATH_SDPA`), I wider MLP, H wider hidden (head widths kept), S s = 512, D wider heads, K more KV heads
    (families with a ``head_dim``), L wider MLA low-rank projections, E eager, P packed, C activation
    checkpointing; an MoE family's k top-4, W wider experts, N twice the experts, S s = 512 (eager only: its own
    attention matrix), M sdpa (:data:`MATH_SDPA`: the math kernel's rows, checked, not fitted), and its dense
    blocks' rows (:data:`DENSE_OF`)."""
    precisions = ("fp32",) if family in FP32_ONLY else ("fp32", "bf16")
    base = "eager" if family in EAGER_ONLY | MATH_SDPA else "sdpa"
    out = [case for group, (of, _) in DENSE_OF.items() if of == family for case in _dense_cases(group)]
    if family in MOE_SHAPES:
        width, experts = MOE_KEYS[family]
        shape = MOE_SHAPES[family]
        tags = [("A", {}), ("k", dict(shape=dict(num_experts_per_tok=4))),
                ("W", dict(shape={width: 2 * shape[width]})), ("N", dict(shape={experts: 2 * shape[experts]})),
                ("H", dict(shape=dict(hidden_size=128))), ("C", dict(checkpointing=True))]
        tags += [("M", dict(attn="sdpa"))] if family in MATH_SDPA else []
        tags += [("S", dict(seq_len=512))] if family in EAGER_ONLY else []
        return out + [dict(tag=tag, family=family, precision=precision, **{"seq_len": 256, "attn": base, **kw})
                      for precision in precisions for tag, kw in tags]
    hd = SHAPES[family].get("head_dim", 8)
    heads_fixed = family in ("gpt2", "gpt_neox")  # head width = hidden / heads
    wider_mlp = dict(n_inner=128) if family == "gpt2" else dict(intermediate_size=256)
    wider = dict(n_embd=128) if family == "gpt2" else dict(hidden_size=128, **({} if heads_fixed else {"head_dim": hd}))
    for precision in precisions:
        tags = [("A", {}), ("I", dict(shape=wider_mlp)), ("H", dict(shape=wider)), ("S", dict(seq_len=512))]
        if not heads_fixed:
            tags += [("D", dict(shape=dict(head_dim=2 * hd))), ("K", dict(shape=dict(num_key_value_heads=8)))]
        if base == "sdpa":
            tags += [("E", dict(attn="eager")), ("P", dict(packed=True))]
        tags += [("C", dict(checkpointing=True))]
        out += [dict(tag=tag, family=family, precision=precision, **{"seq_len": 256, "attn": base, **kw})
                for tag, kw in tags]
    return out


def _dense_cases(group: str) -> list[dict]:
    """The rows of an MoE family's dense blocks (:data:`DENSE_OF`), fitted like a dense family's (MLA: D widens
    every head width, L the low-rank projections; eager, the family's sdpa being the math kernel on CPU)."""
    family, dense = DENSE_OF[group]
    shape = SHAPES[family]
    heads = {k: 2 * shape[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    latent = {k: 2 * shape[k] for k in ("q_lora_rank", "kv_lora_rank")}
    tags = [("A", {}), ("I", dict(intermediate_size=256)), ("H", dict(hidden_size=128)), ("D", heads),
            ("L", latent)]
    rows = [dict(tag=tag, shape={**dense, **kw}) for tag, kw in tags]
    rows += [dict(tag="S", shape=dense, seq_len=512), dict(tag="C", shape=dense, checkpointing=True)]
    return [dict(group=group, family=family, precision="fp32", **{"seq_len": 256, "attn": "eager", **r})
            for r in rows]


CP_CASES = [
    dict(family="llama", seq_len=1024, precision="bf16", attn="sdpa", packed=True),
    dict(family="llama", seq_len=1024, precision="bf16", attn="eager"),
    dict(family="gpt2", seq_len=1024, precision="bf16", attn="sdpa", packed=True),
    dict(family="llama", seq_len=1024, precision="bf16", attn="sdpa", shape=dict(hidden_size=256, head_dim=32)),
    dict(family="llama", seq_len=1024, precision="bf16", attn="sdpa"),
]
"""The cp = 2 rows (and their cp = 1 twins): packed Llama (sdpa keeps a mask at cp = 1 too), eager (the attention
matrix splits over cp), packed GPT-2, plain causal sdpa on a 256-wide Llama, and on the 64-wide one (the dense
cp mask's worst case)."""


EP_CASES = [
    dict(family="qwen3_moe", seq_len=256, precision="fp32"),
    dict(family="qwen2_moe", seq_len=256, precision="fp32"),
    dict(family="qwen3_moe", seq_len=256, precision="bf16"),
    dict(family="qwen3_moe", seq_len=256, precision="fp32", checkpointing=True),
    dict(family="gpt_oss", seq_len=256, precision="fp32", attn="eager"),
    dict(family="deepseek_v3", seq_len=256, precision="fp32"),
]
"""The ep = 2 rows (and their ep = 1 twins; gpt-oss in eager, its one kernel, DeepSeek-V3 in sdpa, torch's math
kernel on CPU): each rank draws its own tokens, so its experts receive more or fewer pairs than its tokens send
(the plan's :data:`~hybridtrain.plan.memory.EXPERT_LOAD_MARGIN` covers the heavier)."""


def _measure_tagged(case: dict) -> dict:
    """:func:`measure` of a fitting case, its ``tag`` and fit ``group`` kept in the row."""
    labels = {k: case[k] for k in ("tag", "group") if k in case}
    return {**measure(**{k: v for k, v in case.items() if k not in labels}), **labels}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="*", default=list(SHAPES))
    parser.add_argument("--no-cp", action="store_true", help="skip the two-rank cp = 2 rows")
    parser.add_argument("--no-ep", action="store_true", help="skip the two-rank ep = 2 rows")
    parser.add_argument("--ep-only", action="store_true",
                        help="only the ep = 2 rows and their ep = 1 twins, to bench/results/activations-ep_DATE.json")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.ep_only:
        result = {"torch": torch.__version__, "ep1": [measure(**c) for c in EP_CASES], "ep2": measure_ep(EP_CASES)}
    else:
        families = list(dict.fromkeys([*args.families,
                                       *(MOE_ATTENTION[f] for f in args.families if MOE_ATTENTION.get(f) in SHAPES)]))
        rows = [_measure_tagged(c) for f in families for c in fitting_cases(f)]
        dense = fit([r for r in rows if r["family"] not in MOE_SHAPES or r.get("group")])
        fitted = {**dense, **fit_moe([r for r in rows if r["family"] in MOE_SHAPES and not r.get("group")], dense)}
        result = {"torch": torch.__version__, "rows": rows, "fit": {f"{k[0]}/{k[1]}": v for k, v in fitted.items()}}
        if not args.no_cp:
            result["cp1"] = [measure(**c) for c in CP_CASES]
            result["cp2"] = measure_cp(CP_CASES)
        if not args.no_ep:
            result["ep1"] = [measure(**c) for c in EP_CASES]
            result["ep2"] = measure_ep(EP_CASES)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M%S")
    name = f"activations-ep_{stamp}.json" if args.ep_only else f"activations_{stamp}.json"
    out = Path(args.out or Path(__file__).parent / "results" / name)
    out.write_text(json.dumps(result, indent=1))
    for key, c in result.get("fit", {}).items():
        print(f"{key:14s} " + " ".join(f"{k}={v}" for k, v in c.items()))
    for a, b in zip(result.get("cp1", []), result.get("cp2", [])):
        print(f"{a['family']:6s} s={a['seq_len']} {a['attn']:5s} packed={a['packed']!s:5s} h={a['hidden']:4d} "
              f"cp1={a['total']:>10d} cp2={b['total']:>10d} ratio={b['total'] / a['total']:.3f}")
    for r in result.get("ep2", []):
        print(f"{r['family']:9s} {r['precision']} ckpt={r['checkpointing']!s:5s} ep2 received/sent="
              f"{r['received'] / r['sent']:.3f} measured={measured_peak(r):>9d} estimate={estimate(r):>9d} "
              f"ratio={estimate(r) / measured_peak(r):.3f}")
    print(out)


if __name__ == "__main__":
    main()
