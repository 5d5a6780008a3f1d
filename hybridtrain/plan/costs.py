"""Per-pipeline-layer facts of a model: parameters per TP rank, FLOPs, activation bytes.

Everything is derived from the HF config and a meta model (each block from its variant's first block,
:mod:`hybridtrain.models.shapes`), so no weights are allocated, whatever the model's size. The balanced partition, the memory
estimate and the automatic plan search all read these numbers.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from hybridtrain.models.families import Family, padded_vocab
from hybridtrain.models.families.base import attention_head_dims, kv_heads_of, mlp_width_of
from hybridtrain.models.units import Kind, Unit, model_units
from hybridtrain.parallel.dims import ParallelDims
from hybridtrain.plan.flops import TRAIN_FACTOR, unit_forward_flops

ELEMENTWISE_COST = 8.0
"""Matmul-FLOP equivalents charged per element of element-wise training work that the model
FLOPs leave out but that takes time: the embedding's dense gradient rows, norms, and the
softmax cross-entropy over the vocabulary (exp, sum, log, the gradient). Memory-bound work runs
far below the matmul rate, hence more than one FLOP per element; checked by bench/bench_partition.py."""


@dataclass(frozen=True)
class UnitFacts:
    """One pipeline unit (:class:`~hybridtrain.models.units.Unit`) and its costs."""

    unit: Unit
    sharded: tuple[int, ...]
    """Element counts of the parameters split over TP (divided by tp on each rank)."""
    replicated: tuple[int, ...]
    """Element counts of the parameters every TP rank holds whole (norms, row-parallel biases)."""
    flops: float
    """Training FLOPs per token of the whole (unsharded) layer: model FLOPs (3 x forward)."""
    elementwise: float
    """Element-wise work per token (elements touched), for time only (see :data:`ELEMENTWISE_COST`)."""
    fixed_elementwise: float = 0.0
    """Element-wise work per micro-batch independent of tokens (the embedding's dense gradient)."""
    experts: tuple[int, ...] = ()
    """Element counts of the routed experts' parameters (an MoE block): split over tp and over ep, and
    data-parallel over ``dp / ep`` ranks only."""

    @property
    def name(self) -> str:
        return self.unit.name

    @property
    def kind(self) -> Kind:
        return self.unit.kind

    @property
    def tied(self) -> bool:
        """A tied LM head: the embedding's weight again (a copy on the last stage when pp > 1)."""
        return self.unit.tied

    def params(self, tp: int, ep: int = 1) -> int:
        """Parameters this layer puts on one rank of tp (and ep)."""
        return sum(n // tp for n in self.sharded) + sum(self.replicated) + sum(self.expert_sizes(tp, ep))

    def param_sizes(self, tp: int) -> list[int]:
        """Element counts of each parameter tensor on one TP rank, but the routed experts' (:meth:`expert_sizes`)."""
        return [n // tp for n in self.sharded] + list(self.replicated)

    def expert_sizes(self, tp: int, ep: int = 1) -> list[int]:
        """Element counts of the routed experts' parameter tensors on one rank of tp and ep."""
        return [n // (tp * ep) for n in self.experts]

    def time_cost(self, tokens: int, tp: int) -> float:
        """FLOP-equivalents of forward + backward of ``tokens`` tokens on one TP rank."""
        work = self.flops * tokens + ELEMENTWISE_COST * (self.elementwise * tokens + self.fixed_elementwise)
        return work / tp


LATENT_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim")
"""HF config keys of multi-head latent attention's per-token low-rank widths (DeepSeek-V3; ``q_lora_rank`` ``None``
when the queries are full rank): :attr:`ModelFacts.latent_dim`."""


@dataclass(frozen=True)
class ModelFacts:
    """All pipeline layers of a model, for a given sequence length and padded vocabulary."""

    family: Family
    hidden: int
    heads: int
    num_layers: int
    seq_len: int
    padded_vocab: int
    units: list[UnitFacts] = field(default_factory=list)
    intermediate: int = 0
    """The dense MLP's width (``config.intermediate_size``; GPT-2's ``n_inner`` or 4 x hidden)."""
    q_dim: int = 0
    """Query width, heads x head dimension (0: the hidden size)."""
    kv_dim: int = 0
    """Key (and value) width, key-value heads x head dimension (0: the hidden size)."""
    v_dim: int = 0
    """Value width, key-value heads x value head dimension: :attr:`kv_dim` but where a value head is narrower
    (DeepSeek-V3's ``v_head_dim``; 0: the hidden size)."""
    latent_dim: int = 0
    """Multi-head latent attention's low-rank widths per token, ``q_lora_rank + kv_lora_rank + qk_rope_head_dim``
    (the down-projections' outputs, DeepSeek-V3; 0: none)."""
    top_k: int = 0
    """An MoE model's experts per token (0: a dense model)."""
    expert_width: int = 0
    """One routed expert's MLP width (``moe_intermediate_size``)."""
    num_experts: int = 0
    """Routed experts per MoE block."""
    shared_width: int = 0
    """A shared expert's MLP width (Qwen2-MoE; DeepSeek-V3's shared experts together; 0: none)."""
    head_out: int = 0
    """The head's outputs per token: :attr:`padded_vocab` for the LM head (0 reads as that), 1 for a reward
    model's scalar ``score`` (``finetune.objective=reward``)."""

    @property
    def names(self) -> list[str]:
        return [u.name for u in self.units]

    def total_params(self) -> int:
        """Parameters of the model, a tied head counted once."""
        return sum(u.params(1) for u in self.units if not u.tied)


def _block_split(family: Family, shapes: dict[str, tuple[int, ...]],
                 variant: str = "") -> tuple[list[int], list[int], list[int]]:
    """Parameter element counts of one HF block of ``variant`` (name -> shape): (TP-sharded, replicated, routed
    experts), by the variant's TP plan (an MoE family's experts module: split over tp and ep)."""
    sharded, replicated, experts = [], [], []
    plan = family.plan_of(variant)
    for name, shape in shapes.items():
        module, _, leaf = name.rpartition(".")
        rule = plan.get(module)
        split = rule is not None and rule.tp_style.sharded(leaf)
        expert = family.moe is not None and module == family.moe.experts and split
        (experts if expert else sharded if split else replicated).append(math.prod(shape))
    return sharded, replicated, experts


def has_score_head(cfg) -> bool:
    """Whether ``cfg`` trains a reward model (``finetune.objective=reward``): its head is the scalar ``score``."""
    return getattr(cfg.finetune, "objective", "sft") == "reward"


def model_facts(family: Family, hf_config, seq_len: int, tp_for_padding: int = 1,
                vocab_pad_multiple: int = 1, score_head: bool = False) -> ModelFacts:
    """Facts of every pipeline layer of ``hf_config`` (each block from the shapes of its variant,
    :func:`hybridtrain.models.shapes.block_shapes`, no memory). ``score_head``: the model is a reward model
    (:func:`has_score_head`), whose head is ``score``, ``Linear(hidden, 1)`` replicated over tp and never tied
    (:mod:`hybridtrain.models.score`), in place of the LM head and its loss over the vocabulary."""
    from hybridtrain.models.shapes import block_shapes

    layers = int(getattr(hf_config, family.n_layers))
    shapes = block_shapes(family, hf_config)
    hidden = int(getattr(hf_config, family.hidden))
    vocab = padded_vocab(int(hf_config.vocab_size), tp_for_padding, vocab_pad_multiple)
    split = {variant: _block_split(family, block, variant) for variant, block in shapes.blocks.items()}
    norm = tuple(math.prod(shape) for shape in shapes.final_norm.values())
    units: list[UnitFacts] = []
    for unit in model_units(family, hf_config):
        fwd = unit_forward_flops(unit, family, hf_config, seq_len, 1 if score_head else vocab,
                                 shapes.linear_flops.get(unit.variant, 0.0))
        if unit.kind is Kind.EMBED:  # lookup; backward accumulates into a dense [V, H] gradient
            units.append(UnitFacts(unit, (vocab * hidden,), (), 0.0, hidden, vocab * hidden))
        elif unit.kind is Kind.POS_EMBED:
            n_pos = int(getattr(hf_config, family.max_positions))
            units.append(UnitFacts(unit, (), (n_pos * hidden,), 0.0, 2 * hidden))
        elif unit.kind is Kind.BLOCK:
            sharded, replicated, experts = split[unit.variant]
            units.append(UnitFacts(unit, tuple(sharded), tuple(replicated), TRAIN_FACTOR * fwd, 12 * hidden,
                                   experts=tuple(experts)))
        elif unit.kind is Kind.FINAL_NORM:
            units.append(UnitFacts(unit, (), norm, 0.0, 4 * hidden))
        elif score_head:  # one score per token, read at each sequence's last; no tied copy of the embedding
            units.append(UnitFacts(dataclasses.replace(unit, tied=False), (), (hidden,), TRAIN_FACTOR * fwd, 4))
        else:  # head + loss: logits, softmax cross-entropy forward and backward over the vocabulary
            units.append(UnitFacts(unit, (vocab * hidden,), (), TRAIN_FACTOR * fwd, 4 * vocab))
    heads, (head_dim, v_head) = int(getattr(hf_config, family.heads)), attention_head_dims(family, hf_config)
    width = mlp_width_of(family, hf_config)
    moe = family.moe
    routing = {} if moe is None else dict(
        top_k=int(getattr(hf_config, moe.top_k)), expert_width=int(getattr(hf_config, moe.width)),
        num_experts=int(getattr(hf_config, moe.num_experts)),
        shared_width=moe.shared_width_of(hf_config))
    kv_heads = kv_heads_of(family, hf_config)
    mla = getattr(hf_config, "kv_lora_rank", None)
    latent = sum(int(getattr(hf_config, key, None) or 0) for key in LATENT_KEYS) if mla else 0
    return ModelFacts(family=family, hidden=hidden, heads=heads, num_layers=layers, seq_len=seq_len,
                      padded_vocab=vocab, head_out=1 if score_head else vocab, units=units, intermediate=width, q_dim=heads * head_dim,
                      kv_dim=kv_heads * head_dim, v_dim=kv_heads * v_head, latent_dim=latent, **routing)


def stage_params(facts: ModelFacts, bounds: list[int], stage: int, tp: int, ep: int = 1) -> int:
    """Parameters one rank of ``stage`` holds at ``tp`` (and ``ep``) (a tied head on a stage that has the
    embedding is the same tensor; on another stage it is a copy)."""
    units = facts.units[bounds[stage]:bounds[stage + 1]]
    has_embed = any(u.kind is Kind.EMBED for u in units)
    return sum(u.params(tp, ep) for u in units if not (u.tied and has_embed))


def stage_flops(facts: ModelFacts, bounds: list[int], stage: int) -> float:
    """Model training FLOPs per token of ``stage`` (all TP ranks together)."""
    return sum(u.flops for u in facts.units[bounds[stage]:bounds[stage + 1]])


def layer_time_costs(facts: ModelFacts, micro_batch: int, dims: ParallelDims) -> list[float]:
    """Per-layer FLOP-equivalents of forward + backward of one micro-batch of ``micro_batch`` rows on one rank
    of the layout ``dims`` (its tensor-parallel shard of the tokens its context-parallel slice holds)."""
    tokens = micro_batch * facts.seq_len // dims.cp
    return [u.time_cost(tokens, dims.tp) for u in facts.units]
