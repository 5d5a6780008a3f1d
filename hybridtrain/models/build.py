"""Build the local pieces of an HF causal LM: one HF unit at a time, seeded or loaded, TP-sharded.

The whole HF model exists on the meta device (no memory, :func:`hybridtrain.models.hf_model.meta_model`).
Each pipeline layer then materialises only the HF unit it owns (one decoder block, the embedding, ...)
on the CPU, initialises it with HF's own ``_init_weights`` under an RNG seeded by ``(seed, unit name)``
(:func:`hybridtrain.models.seeded_init.init_unit`, so every plan, and a plain single-process HF model,
gets identical weights), and keeps only this rank's tensor shard (each module as its tensor-parallel
style cuts it, :mod:`hybridtrain.parallel.tensor`). The random fills are made tile by tile, so a rank
computes only the tiles of its own shard; the rest of the full unit is allocated but never written
(untouched pages cost no memory) and is dropped when the unit is sliced.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

from hybridtrain.models.families import Family, TPRule, fused_sizes
from hybridtrain.models.hf_model import meta_model
from hybridtrain.models.lora import LORA_A, LORA_B, LoraSpec, lora_spec, peft_name
from hybridtrain.models.seeded_init import Keep, init_unit, unit_seed
from hybridtrain.parallel.context import CPContext, EPContext, TPContext
from hybridtrain.parallel.layers import copy_to_tp
from hybridtrain.parallel.slicing import Fused, local_part


@dataclass
class ModelBuilder:
    """What every pipeline layer of one rank needs to build its piece of the model."""

    family: Family
    hf_config: Any
    hf_model: nn.Module
    """The meta-device HF model; units are materialised from it one at a time."""
    seed: int
    tp: TPContext
    padded_vocab: int
    activation_checkpointing: bool = False
    weights: Any = None
    """A :class:`~hybridtrain.models.weights.SafetensorsWeights` to load units from (fine-tuning),
    or ``None`` for the seeded initialisation."""
    lora: Optional[LoraSpec] = None
    """The LoRA adapters to add to the blocks (``finetune.method=lora``), or ``None``."""
    adapter: Any = None
    """A ``SafetensorsWeights`` of peft-named adapter tensors to start the adapters from (``finetune.lora.init_from``,
    or a checkpoint's ``adapter/``), or ``None`` for fresh ones (seeded ``A``, zero ``B``)."""
    ep: EPContext = field(default_factory=EPContext)
    """This rank's expert-parallel slice and group (``parallel.ep``; size 1: every expert here)."""
    cp: CPContext = field(default_factory=CPContext)
    """This rank's context-parallel chunks and group (``parallel.cp``; size 1: whole rows)."""
    cp_base: str = "sdpa"
    """At cp > 1: the attention implementation the context-parallel attention runs on the gathered keys and
    values (the run's ``model.attn_implementation``; the config itself then names ``hybridtrain_cp``)."""
    defer_head: bool = False
    """The head hands its input to the loss, which makes the logits piece by piece (``trainer.loss_chunk_tokens``
    below a rank's tokens per micro-batch; :class:`~hybridtrain.parallel.layers.VocabParallelLoss`)."""
    packed: bool = True
    """Whether rows may hold several records (``data.packing=documents``: position ids restart inside a row).
    False lets the blocks skip the test for restarts, a GPU-to-CPU sync per stage and micro-batch (transformers'
    ``find_packed_sequence_indices``, the varlen offsets of FlashAttention 2); True is always right, only slower."""
    score_head: bool = False
    """The head is a reward model's scalar ``score`` (``finetune.objective=reward``,
    :class:`~hybridtrain.models.score.ScoreHead`), not the LM head: no logits, no tied copy of the embedding."""
    stage_shared: dict = field(default_factory=dict)
    """Modules the layers built from this builder (one rank's stage) share, by name
    (:class:`~hybridtrain.models.stages.BlockInputs`)."""

    @classmethod
    def for_run(cls, cfg, hf_config, tp: TPContext, padded_vocab: int, weights_dir: str | None = None,
                adapter_dir: str | None = None, ep: EPContext | None = None,
                cp: CPContext | None = None) -> "ModelBuilder":
        """The builder of a run's rank: weights from ``weights_dir`` (HF names, e.g. a checkpoint's
        ``hf/``), else from ``model.pretrained``, else the seeded initialisation (``trainer.seed``); LoRA
        adapters (``finetune.method=lora``) from ``adapter_dir`` (a checkpoint's ``adapter/``), else from
        ``finetune.lora.init_from``, else fresh. At cp > 1 the attention modules of ``hf_config`` are switched to
        the context-parallel attention (:func:`~hybridtrain.parallel.context_parallel.register_attention`), which
        runs the configured implementation on the gathered keys and values."""
        from hybridtrain.config.choices import Packing
        from hybridtrain.models.families import family_of
        from hybridtrain.models.weights import SafetensorsWeights, checkpoint_renames

        folder = weights_dir or cfg.model.pretrained
        cp = cp or CPContext()
        reward = str(cfg.finetune.objective) == "reward"
        cp_base = hf_config._attn_implementation
        if cp.size > 1:  # before the modules exist: every attention module looks its function up by this name
            from hybridtrain.parallel.context_parallel import register_attention

            hf_config._attn_implementation = register_attention()
        family, hf_model = family_of(cfg.model), meta_model(hf_config)
        renames = checkpoint_renames(family.model_type) if family.moe is not None else ()  # Mixtral's legacy names
        weights = SafetensorsWeights(folder, renames).for_model(hf_model) if folder is not None else None
        lora = adapter = None
        if cfg.finetune.method == "lora":
            lora = lora_spec(cfg.finetune.lora, family, hf_config, hf_model)
            source = adapter_dir or cfg.finetune.lora.init_from
            adapter = SafetensorsWeights(source) if source else None
        return cls(family=family, hf_config=hf_config, hf_model=hf_model,
                   seed=cfg.trainer.seed, tp=tp, padded_vocab=padded_vocab,
                   activation_checkpointing=cfg.parallel.activation_checkpointing, weights=weights,
                   lora=lora, adapter=adapter, ep=ep or EPContext(), cp=cp, cp_base=cp_base,
                   packed=Packing.of(cfg.data.packing, cfg.data.format) is Packing.documents,
                   score_head=reward, defer_head=not reward and (
                       cfg.parallel.micro_batch_size * cfg.data.seq_len // cp.size > cfg.trainer.loss_chunk_tokens))

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def tied(self) -> bool:
        """Whether the embedding is also the head (never with a :attr:`score_head`)."""
        return bool(self.hf_config.tie_word_embeddings) and not self.score_head

    def materialize(self, name: str, skip: tuple[str, ...] = (), keep: Keep | None = None) -> nn.Module:
        """Give HF unit ``name`` real CPU storage: its seeded initial values, or the pretrained
        weights when the builder has ``weights``. ``keep``: the parts of its parameters this rank
        keeps (the others are not initialised, :func:`~hybridtrain.models.seeded_init.init_unit`)."""
        unit = self.hf_model.get_submodule(name)
        unit.to_empty(device="cpu")
        init_unit(self.hf_model, name, self.seed, keep)  # also gives buffers their values
        if self.weights is not None:
            from hybridtrain.models.weights import load_unit

            tied = {f"{self.family.head}.weight": f"{self.family.embed}.weight"}
            load_unit(unit, name, self.weights, tied, skip)
        return unit

    def vocab_shard(self, name: str) -> tuple[torch.Tensor, int]:
        """This rank's rows ``[start, start + V_pad/tp)`` of the padded ``[V, H]`` matrix ``name``
        (read as rows from a pretrained checkpoint, without loading the whole matrix)."""
        start, stop = self.tp.shard(self.padded_vocab)
        if self.weights is not None:
            from hybridtrain.models.weights import CheckpointError, read_rows

            tensor = self.family.checkpoint_name(f"{name}.weight")
            if tensor not in self.weights and name == self.family.head:  # tied: save_pretrained omits it
                tensor = self.family.checkpoint_name(f"{self.family.embed}.weight")
            rows, shape = read_rows(self.weights, tensor, start, stop)
            want = (self.vocab_size, int(self.hf_model.get_submodule(name).weight.shape[1]))
            if shape != want:
                raise CheckpointError(f"{self.weights.folder}: {tensor} has shape {shape} but the configured model "
                                      f"expects {want}; the model config does not match the checkpoint")
            return torch.cat([rows, rows.new_zeros(stop - start - rows.shape[0], want[1])]), start
        real = min(stop, self.vocab_size)  # rows past the vocabulary are zero padding
        unit = self.materialize(name, keep={"weight": (0, [(start, real)] if start < real else [])})
        rows = unit.weight.detach()[start:real]  # [rows of this rank, H]
        shard = torch.cat([rows, rows.new_zeros(stop - start - rows.shape[0], rows.shape[1])])
        unit.to("meta")  # drop the full matrix: only the shard stays in memory
        return shard, start

    def block(self, index: int) -> nn.Module:
        """Decoder block ``index`` with its planned modules replaced by this rank's TP shards (and, at ep > 1, its
        MoE layer's experts by this rank's ``E / ep``, the only ones read from a checkpoint)."""
        prefix = f"{self.family.blocks}.{index}"
        variant = self.family.variant_of(self.hf_config, index)
        plan = self.family.plan_of(variant)
        meta_block = self.hf_model.get_submodule(prefix)
        # the parameters the styles read themselves, shard by shard: each planned module's own (not its children's,
        # which have rules of their own: a Gated DeltaNet's per-head A_log beside its replicated gated norm)
        split = tuple(f"{path}.{leaf}" for path, rule in plan.items() if rule.tp_style.reads_shards()
                      if (module := planned_module(meta_block, path, self.family)) is not None
                      for leaf, _ in module.named_parameters(recurse=False))
        keep = tp_keep(meta_block, self.family, self.hf_config, self.tp, variant)
        block = self.materialize(prefix, skip=split if self.weights is not None else (), keep=keep)
        ep_split = self.ep.size > 1 and index not in self.family.moe.dense_blocks(self.hf_config)
        read = None
        if self.weights is not None:  # pretrained: read only this rank's shard of each split module
            from hybridtrain.models.weights import read_expert_rows, read_experts_shard, read_shard

            experts = (self.ep.rank, self.ep.size) if ep_split else None  # and only this ep rank's experts

            def read(path: str, dim: int | None, fused) -> torch.Tensor:
                expert = self.family.moe is not None and path.startswith(f"{self.family.moe.experts}.")
                if dim is None and expert and experts is not None:  # replicated over tp: this ep rank's experts
                    return read_expert_rows(self.weights, f"{prefix}.{path}", *experts)
                if dim is None:  # replicated (a row-parallel bias)
                    return self.weights.get(f"{prefix}.{path}")
                if expert:
                    return read_experts_shard(self.weights, f"{prefix}.{path}", dim, fused, self.tp.rank,
                                              self.tp.size, self.family.model_type, experts)
                return read_shard(self.weights, f"{prefix}.{path}", dim, fused, self.tp.rank, self.tp.size)
            if ep_split:
                from hybridtrain.parallel.experts import keep_expert_rows

                keep_expert_rows(block.get_submodule(self.family.moe.experts), self.ep)  # read as [E / ep, ...]
        shard_block(block, self.family, self.hf_config, self.tp, read, variant)
        if ep_split:
            from hybridtrain.parallel.experts import split_experts_over_ep

            split_experts_over_ep(block.get_submodule(self.family.moe.experts), self.ep, sliced=read is not None)
        if self.lora is not None:
            add_lora(block, prefix, self.family, self.hf_config, self.tp, self.lora, self.seed, self.adapter, variant)
        return block


def shard_block(block: nn.Module, family: Family, hf_config, tp: TPContext, read=None,
                variant: Optional[str] = None) -> None:
    """Apply the tensor-parallel plan of a block of ``variant`` (``family.plan_of``, see
    :class:`~hybridtrain.models.families.TPRule`) to ``block`` in place.

    Shards are cut from the block's own (full) modules, or, with ``read(path, hf_dim, fused)``,
    read directly from a checkpoint (``path`` like ``attn.c_attn.weight``, HF layout). With tp > 1 the
    Megatron "f" goes on the variant's ``input_copy`` modules, and per-rank head counts replace the full ones
    (``heads_per_rank_attrs``; ``per_rank_config`` in a copy of the attention's config).
    """
    for name, rule in family.plan_of(variant).items():
        module = planned_module(block, name, family)
        if module is None:  # left out by this config (DeepSeek-V3's q_proj when q_lora_rank is set)
            continue
        fused = _fused(module, rule, family, hf_config)
        new = rule.tp_style.shard(module, rule, fused, tp, _reader(read, name))
        if new is not module:
            block.set_submodule(name, new)
    if tp.size == 1:
        return
    for name in family.input_copy_of(variant):
        block.get_submodule(name).register_forward_pre_hook(_CopyInput(tp), with_kwargs=True)
    for path in family.heads_per_rank_attrs_of(variant):
        owner, attr = path.rsplit(".", 1)
        module = block.get_submodule(owner)
        setattr(module, attr, getattr(module, attr) // tp.size)
    if family.per_rank_config:  # the attention reads these from its config at forward time
        attention = block.get_submodule(family.attention)
        attention.config = copy.copy(attention.config)  # shallow: the other blocks keep theirs
        for key in family.per_rank_config:
            setattr(attention.config, key, getattr(attention.config, key) // tp.size)


def planned_module(block: nn.Module, name: str, family: Family) -> Optional[nn.Module]:
    """The submodule ``name`` of ``block`` that a plan entry splits; ``None`` where transformers leaves it out for
    this config (the attribute is there and ``None``: DeepSeek-V3's ``q_proj`` with a ``q_lora_rank``, its
    ``q_a_proj`` ... without); ``ValueError`` where ``block`` has no such attribute (a plan naming the wrong module)."""
    owner_path, _, leaf = name.rpartition(".")
    try:
        owner = block.get_submodule(owner_path) if owner_path else block
    except AttributeError:
        owner = None
    if owner is not None and getattr(owner, leaf, 0) is None:
        return None
    try:
        return block.get_submodule(name)
    except AttributeError:
        raise ValueError(f"tensor-parallel plan of {family.model_type!r} names {name!r}, "
                         f"which is not a module of {type(block).__name__}") from None


def tp_keep(block: nn.Module, family: Family, hf_config, tp: TPContext, variant: Optional[str] = None) -> Keep:
    """The parts of ``block``'s parameters this TP rank keeps, as ``parameter -> (HF dim, ranges)``: what
    :func:`shard_block` slices (each style's :meth:`~hybridtrain.parallel.tensor.TPStyle.keep`); replicated
    parameters are not named (kept whole)."""
    if tp.size == 1:
        return {}
    keep = {}
    for name, rule in family.plan_of(variant).items():
        module = planned_module(block, name, family)
        if module is None:
            continue
        parts = rule.tp_style.keep(module, rule.conv1d, _fused(module, rule, family, hf_config), tp.rank, tp.size)
        keep.update({f"{name}.{leaf}": part for leaf, part in parts.items()})
    return keep


def _fused(module: nn.Module, rule: TPRule, family: Family, hf_config) -> Fused:
    """The fused sub-blocks of ``module``'s outputs (:func:`fused_sizes`, checked against its width)."""
    if isinstance(rule.fused, int):
        return rule.fused
    return fused_sizes(rule, family, hf_config, int(module.weight.shape[1 if rule.conv1d else 0]))


def _reader(read, name: str):
    """``read`` (block-relative paths) for the parameters of module ``name`` (leaf names), or ``None``."""
    if read is None:
        return None
    return lambda leaf, dim, fused: read(f"{name}.{leaf}", dim, fused)


def add_lora(block: nn.Module, prefix: str, family: Family, hf_config, tp: TPContext, lora: LoraSpec, seed: int,
             adapter=None, variant: Optional[str] = None) -> None:
    """Wrap the sharded linear layers of block ``prefix`` that ``lora`` targets with LoRA adapters
    (:mod:`hybridtrain.parallel.lora`), their matrices cut like the layer's weight: a column-parallel
    layer's ``B`` rows fused-aware, a row-parallel layer's ``A`` columns.

    The full ``A`` and ``B`` come from ``adapter`` (peft names) or are fresh: ``A`` seeded by
    :func:`~hybridtrain.models.seeded_init.unit_seed` of ``"{module path}.lora_A"`` (the same under every layout), ``B`` zero.
    """
    from hybridtrain.parallel.lora import initial_a

    plan = family.plan_of(variant)
    for rel in lora.in_block(prefix):
        layer, rule, path = block.get_submodule(rel), plan[rel], f"{prefix}.{rel}"
        style, full = rule.tp_style, list(layer.weight.shape)  # local layout [out, in]
        dim = style.split("weight").dim
        if dim is not None:  # a replicated layer (outside the TP region) holds its whole weight
            full[dim] *= tp.size
        n_out, n_in = full
        if adapter is not None:
            a, b = (adapter.get(peft_name(f"{path}.{m}.weight")) for m in (LORA_A, LORA_B))
            if tuple(a.shape) != (lora.r, n_in) or tuple(b.shape) != (n_out, lora.r):
                raise ValueError(f"{adapter.folder}: the adapter of {path} has shapes {tuple(a.shape)} and "
                                 f"{tuple(b.shape)}; this model needs {(lora.r, n_in)} and {(n_out, lora.r)}")
        else:
            a, b = initial_a(unit_seed(seed, f"{path}.{LORA_A}"), lora.r, n_in), torch.zeros(n_out, lora.r)
        # cut like the weight: a column layer's B rows fused-aware (q | k | v), a row layer's A columns
        splits = style.lora_splits(fused_sizes(rule, family, hf_config, n_out))
        a, b = (local_part(t, s, tp.rank, tp.size) for t, s in zip((a, b), splits))
        new = style.lora_layer(layer, a, b, lora.scaling, lora.dropout, tp)
        block.set_submodule(rel, new)


class _CopyInput:
    """Forward pre-hook: Megatron "f" on a module's hidden-state input (positional or keyword)."""

    def __init__(self, tp: TPContext):
        self.tp = tp

    def __call__(self, module, args, kwargs):
        if args:
            return (copy_to_tp(args[0], self.tp), *args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = copy_to_tp(kwargs["hidden_states"], self.tp)
        return args, kwargs
