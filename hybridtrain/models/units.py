"""The pipeline units of a model: one typed list, built once from the family and the HF config.

A unit is what one pipeline layer holds: the token embedding, GPT-2's position embedding, one
decoder block, the final norm, or the LM head (tied to the embedding or not). Everything that
walks the model in pipeline order (the DeepSpeed layer specs, the one-process model, the planner's
costs and memory, the partition rules, the plan report, the seeded initialisation) takes this
list; code that holds only the names saved in ``plan.json`` (``embed``, ``block.3``, ...) reads
them back with :func:`kind_of`. Nothing else spells a unit name.

Imports neither torch nor deepspeed.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence


class Kind(Enum):
    """What a pipeline unit is."""

    EMBED = "embed"
    POS_EMBED = "pos_embed"
    BLOCK = "block"
    FINAL_NORM = "final_norm"
    HEAD = "head"


@dataclass(frozen=True)
class Unit:
    """One pipeline unit (layer) of the model."""

    kind: Kind
    hf_path: str
    """Module path in the HF causal-LM model (``model.layers.3``; a tied head: ``lm_head``, whose
    weight is the embedding's)."""
    index: int = -1
    """Decoder-block index (``Kind.BLOCK`` only)."""
    tied: bool = False
    """The LM head reuses the embedding weight (``tie_word_embeddings``)."""
    variant: str = ""
    """The block's variant (``Kind.BLOCK`` only; :func:`block_variants`): blocks of one variant have the same
    parameters and FLOPs, which the planner reads from the variant's first block."""

    @property
    def name(self) -> str:
        """The name ``plan.json`` lists: ``embed``, ``pos_embed``, ``block.N``, ``final_norm``, ``head``."""
        return f"block.{self.index}" if self.kind is Kind.BLOCK else self.kind.value

    @property
    def is_block(self) -> bool:
        return self.kind is Kind.BLOCK


def model_units(family: Any, hf_config: Any) -> list[Unit]:
    """The units of ``hf_config``'s model in pipeline order:
    embed, [pos_embed], block.0 .. block.{L-1}, final_norm, head."""
    units = [Unit(Kind.EMBED, family.embed)]
    if family.position_embed:
        units.append(Unit(Kind.POS_EMBED, family.position_embed))
    units += [Unit(Kind.BLOCK, f"{family.blocks}.{i}", index=i, variant=v)
              for i, v in enumerate(block_variants(family, hf_config))]
    units.append(Unit(Kind.FINAL_NORM, family.final_norm))
    units.append(Unit(Kind.HEAD, family.head, tied=bool(getattr(hf_config, "tie_word_embeddings", False))))
    return units


def block_variants(family: Any, hf_config: Any) -> list[str]:
    """Each decoder block's variant, in block order: the family's rule (``Family.block_variants``, e.g. an
    MoE model's leading dense blocks) when it has one, else transformers' ``layer_types`` (models alternating
    layer kinds, e.g. Gemma 2's sliding and full attention), else one variant, ``block``, for all.
    :func:`hybridtrain.models.shapes.block_shapes` checks the variants against the built model: blocks of
    one variant whose parameters differ are refused."""
    layers = int(getattr(hf_config, family.n_layers))
    if family.block_variants is not None:
        variants = [str(v) for v in family.block_variants(hf_config)]
    else:
        types = getattr(hf_config, "layer_types", None)
        variants = [str(t) for t in types] if types is not None and len(types) == layers else ["block"] * layers
    if len(variants) != layers:
        raise ValueError(f"{family.model_type}: {len(variants)} block variants for {layers} blocks")
    return variants


def names(units: Sequence[Unit]) -> list[str]:
    """The units' names in order (``plan.layer_names``)."""
    return [u.name for u in units]


def kind_of(name: str) -> Kind:
    """The kind of a unit name from ``plan.json`` (``block.7`` -> ``Kind.BLOCK``)."""
    if name.startswith("block."):
        return Kind.BLOCK
    return Kind(name)


def block_index(name: str) -> int:
    """The decoder-block index of a ``block.N`` name."""
    if kind_of(name) is not Kind.BLOCK:
        raise ValueError(f"{name!r} is not a decoder block")
    return int(name.split(".", 1)[1])


def count_blocks(unit_names: Sequence[str]) -> int:
    """How many of ``unit_names`` are decoder blocks."""
    return sum(kind_of(n) is Kind.BLOCK for n in unit_names)


def split_around_blocks(unit_names: Sequence[str]) -> tuple[int, int, int]:
    """``(units before the first block, blocks, units after the last block)``."""
    blocks = [i for i, n in enumerate(unit_names) if kind_of(n) is Kind.BLOCK]
    if not blocks:
        return len(unit_names), 0, 0
    return blocks[0], len(blocks), len(unit_names) - blocks[-1] - 1
