"""Per-pipeline-layer facts of a model: parameters per TP rank, FLOPs, activation bytes.

Everything is derived from the HF config: parameter shapes from :mod:`hybridtrain.models.shapes`
(a one-block meta model for a family not written down there; blocks are identical), so a 70B
model costs the same milliseconds as a tiny one. The balanced partition, the memory
estimate and the automatic plan search all read these numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridtrain.models.families import Family, get_family, padded_vocab
from hybridtrain.plan.flops import TRAIN_FACTOR, unit_forward_flops
from hybridtrain.plan.validate import layer_names

ELEMENTWISE_COST = 8.0
"""Matmul-FLOP equivalents charged per element of element-wise training work that the model
FLOPs leave out but that takes time: the embedding's dense gradient rows, norms, and the
softmax cross-entropy over the vocabulary (exp, sum, log, the gradient). Memory-bound work runs
far below the matmul rate, hence more than one FLOP per element; checked by bench/bench_partition.py."""


@dataclass(frozen=True)
class UnitFacts:
    """One pipeline layer (``embed``, ``pos_embed``, ``block.N``, ``final_norm``, ``head``)."""

    name: str
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
    tied: bool = False
    """A tied LM head: the embedding's weight again (a copy on the last stage when pp > 1)."""

    def params(self, tp: int) -> int:
        """Parameters this layer puts on one TP rank."""
        return sum(n // tp for n in self.sharded) + sum(self.replicated)

    def param_sizes(self, tp: int) -> list[int]:
        """Element counts of each parameter tensor on one TP rank."""
        return [n // tp for n in self.sharded] + list(self.replicated)

    def time_cost(self, tokens: int, tp: int) -> float:
        """FLOP-equivalents of forward + backward of ``tokens`` tokens on one TP rank."""
        work = self.flops * tokens + ELEMENTWISE_COST * (self.elementwise * tokens + self.fixed_elementwise)
        return work / tp


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

    @property
    def names(self) -> list[str]:
        return [u.name for u in self.units]

    def total_params(self) -> int:
        """Parameters of the model, a tied head counted once."""
        return sum(u.params(1) for u in self.units if not u.tied)


def _block_split(family: Family, shapes: dict[str, tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """Parameter element counts of one HF block (name -> shape): (TP-sharded, replicated), by the family's TP plan."""
    sharded, replicated = [], []
    for name, shape in shapes.items():
        module, _, leaf = name.rpartition(".")
        rule = family.tp_plan.get(module)
        split = rule is not None and (rule.style == "column" or leaf == "weight")  # row bias: replicated
        (sharded if split else replicated).append(math.prod(shape))
    return sharded, replicated


def _meta_shapes(hf_config, family: Family) -> tuple[dict, dict]:
    """Shapes of one block and of the final norm from a one-block HF meta model (families that
    :mod:`hybridtrain.models.shapes` does not cover)."""
    import copy

    from hybridtrain.models.build import meta_model

    one = copy.deepcopy(hf_config)
    setattr(one, family.n_layers, 1)
    model = meta_model(one)

    def shapes(path: str) -> dict:
        return {n: tuple(p.shape) for n, p in model.get_submodule(path).named_parameters()}

    return shapes(f"{family.blocks}.0"), shapes(family.final_norm)


def model_facts(model_type: str, hf_config, seq_len: int, tp_for_padding: int = 1,
                vocab_pad_multiple: int = 1) -> ModelFacts:
    """Facts of every pipeline layer of ``hf_config`` (parameter shapes from the config, no model)."""
    from hybridtrain.models.shapes import block_shapes, final_norm_shapes

    family = get_family(model_type)
    layers = int(getattr(hf_config, family.n_layers))
    block, final = block_shapes(model_type, hf_config), final_norm_shapes(model_type, hf_config)
    if block is None or final is None:
        block, final = _meta_shapes(hf_config, family)
    hidden = int(getattr(hf_config, family.hidden))
    vocab = padded_vocab(int(hf_config.vocab_size), tp_for_padding, vocab_pad_multiple)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    sharded, replicated = _block_split(family, block)
    norm = tuple(math.prod(shape) for shape in final.values())
    units: list[UnitFacts] = []
    for name in layer_names(family, layers):
        fwd = unit_forward_flops(name, family, hf_config, seq_len, vocab)
        if name == "embed":  # lookup; backward accumulates into a dense [V, H] gradient
            units.append(UnitFacts(name, (vocab * hidden,), (), 0.0, hidden, vocab * hidden))
        elif name == "pos_embed":
            n_pos = int(getattr(hf_config, family.max_positions))
            units.append(UnitFacts(name, (), (n_pos * hidden,), 0.0, 2 * hidden))
        elif name.startswith("block."):
            units.append(UnitFacts(name, tuple(sharded), tuple(replicated), TRAIN_FACTOR * fwd, 12 * hidden))
        elif name == "final_norm":
            units.append(UnitFacts(name, (), norm, 0.0, 4 * hidden))
        else:  # head + loss: logits, softmax cross-entropy forward and backward over the vocabulary
            units.append(UnitFacts(name, (vocab * hidden,), (), TRAIN_FACTOR * fwd, 4 * vocab, tied=tied))
    return ModelFacts(family=family, hidden=hidden, heads=int(getattr(hf_config, family.heads)),
                      num_layers=layers, seq_len=seq_len, padded_vocab=vocab, units=units)


def stage_params(facts: ModelFacts, bounds: list[int], stage: int, tp: int) -> int:
    """Parameters one TP rank of ``stage`` holds (a tied head on a stage that has the embedding
    is the same tensor; on another stage it is a copy)."""
    units = facts.units[bounds[stage]:bounds[stage + 1]]
    has_embed = any(u.name == "embed" for u in units)
    return sum(u.params(tp) for u in units if not (u.tied and has_embed))


def stage_flops(facts: ModelFacts, bounds: list[int], stage: int) -> float:
    """Model training FLOPs per token of ``stage`` (all TP ranks together)."""
    return sum(u.flops for u in facts.units[bounds[stage]:bounds[stage + 1]])


def layer_time_costs(facts: ModelFacts, tokens: int, tp: int) -> list[float]:
    """Per-layer FLOP-equivalents of forward + backward of one micro-batch of ``tokens`` tokens."""
    return [u.time_cost(tokens, tp) for u in facts.units]
