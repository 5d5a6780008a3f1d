"""Build the local pieces of an HF causal LM: meta model, seeded init, TP sharding.

The whole HF model is created on the meta device (no memory). Each pipeline layer then
materialises only the HF unit it owns (one decoder block, the embedding, ...) on the CPU,
initialises it with HF's own ``_init_weights`` under an RNG seeded by ``(seed, unit name)``
(so every plan, and a plain single-process HF model, gets identical weights), and keeps only
this rank's tensor shard. The full unit exists only transiently while it is sliced.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Dict

import torch
import torch.nn as nn

from hybridtrain.models.families import Family, TPRule, padded_vocab  # noqa: F401  (re-export)
from hybridtrain.models.units import Kind, model_units
from hybridtrain.parallel.context import TPContext
from hybridtrain.parallel.layers import ColumnParallelLinear, RowParallelLinear, copy_to_tp
from hybridtrain.parallel.slicing import shard_tensor


def hf_config_of(model_type: str, overrides: Dict[str, Any], vocab_size: int,
                 attn_implementation: str, eos_token_id: int | None = None):
    """The HF ``PretrainedConfig`` for ``model_type`` with ``overrides`` applied.

    ``vocab_size`` and the BOS/EOS ids (the tokenizer's) are used unless the overrides set them.
    """
    from transformers import AutoConfig

    special = {} if eos_token_id is None else {"bos_token_id": eos_token_id, "eos_token_id": eos_token_id}
    kwargs = {"vocab_size": vocab_size, **special, **overrides}
    cfg = AutoConfig.for_model(model_type, **kwargs)
    cfg._attn_implementation = attn_implementation
    cfg.use_cache = False
    return cfg


def meta_model(hf_config) -> nn.Module:
    """The full HF causal LM on the meta device (parameters have shapes, no storage)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, attn_implementation=hf_config._attn_implementation)


def unit_seed(seed: int, name: str) -> int:
    """Seed of HF unit ``name`` (e.g. ``transformer.h.3``): independent of plan and rank."""
    return zlib.crc32(f"{seed}:{name}".encode()) & 0x7FFFFFFF


def init_unit(hf_model: nn.Module, name: str, seed: int) -> nn.Module:
    """Initialise HF unit ``name`` of ``hf_model`` in place with HF's ``_init_weights``.

    Runs under a forked RNG seeded by :func:`unit_seed`, so the values do not depend on what
    else this process initialised before. Used both by workers and by the single-process
    reference model of the tests.
    """
    unit = hf_model.get_submodule(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(unit_seed(seed, name))
        unit.apply(hf_model._init_weights)  # children first, as HF's own post-order init
    return unit


def reference_model(hf_config, family: Family, seed: int) -> nn.Module:
    """A plain, unsharded HF model with exactly the weights hybridtrain's workers start from."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=hf_config._attn_implementation)
    for name in unit_names(family, hf_config):
        init_unit(model, name, seed)
    return model


def unit_names(family: Family, hf_config) -> list[str]:
    """The HF units hybridtrain initialises separately, in pipeline order (a tied head has no
    weight of its own)."""
    return [u.hf_path for u in model_units(family, hf_config) if not (u.kind is Kind.HEAD and u.tied)]


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

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def tied(self) -> bool:
        return bool(self.hf_config.tie_word_embeddings)

    def materialize(self, name: str, skip: tuple[str, ...] = ()) -> nn.Module:
        """Give HF unit ``name`` real CPU storage: its seeded initial values, or the pretrained
        weights when the builder has ``weights``."""
        unit = self.hf_model.get_submodule(name)
        unit.to_empty(device="cpu")
        init_unit(self.hf_model, name, self.seed)  # also gives buffers their values
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

            tensor = f"{name}.weight"
            if tensor not in self.weights and name == self.family.head:  # tied: save_pretrained omits it
                tensor = f"{self.family.embed}.weight"
            rows, shape = read_rows(self.weights, tensor, start, stop)
            want = (self.vocab_size, int(self.hf_model.get_submodule(name).weight.shape[1]))
            if shape != want:
                raise CheckpointError(f"{self.weights.folder}: {tensor} has shape {shape} but the configured model "
                                      f"expects {want}; the model config does not match the checkpoint")
            return torch.cat([rows, rows.new_zeros(stop - start - rows.shape[0], want[1])]), start
        unit = self.materialize(name)
        full = unit.weight.detach()
        pad = self.padded_vocab - full.shape[0]
        if pad:
            full = torch.cat([full, full.new_zeros(pad, full.shape[1])])
        start, stop = self.tp.shard(self.padded_vocab)
        shard = full[start:stop].clone()
        unit.to("meta")  # drop the full matrix: only the shard stays in memory
        return shard, start

    def block(self, index: int) -> nn.Module:
        """Decoder block ``index`` with its linears replaced by this rank's TP shards."""
        prefix = f"{self.family.blocks}.{index}"
        tp_linears = tuple(f"{path}." for path in self.family.tp_plan)
        block = self.materialize(prefix, skip=tp_linears if self.weights is not None else ())
        read = None
        if self.weights is not None:  # pretrained: read only this rank's shard of each split linear
            from hybridtrain.models.weights import read_shard

            def read(path: str, dim: int | None, fused: int) -> torch.Tensor:
                if dim is None:  # replicated (a row-parallel bias)
                    return self.weights.get(f"{prefix}.{path}")
                return read_shard(self.weights, f"{prefix}.{path}", dim, fused, self.tp.rank, self.tp.size)
        shard_block(block, self.family, self.tp, read)
        return block


def shard_block(block: nn.Module, family: Family, tp: TPContext, read=None) -> None:
    """Apply ``family.tp_plan`` to ``block`` in place (see :class:`~hybridtrain.models.families.TPRule`).

    Shards are cut from the block's own (full) linears, or, with ``read(path, hf_dim, fused)``,
    read directly from a checkpoint (``path`` like ``attn.c_attn.weight``, HF layout).
    """
    for name, rule in family.tp_plan.items():
        try:
            linear = block.get_submodule(name)
        except AttributeError:
            raise ValueError(f"tensor-parallel plan of {family.model_type!r} names {name!r}, "
                             f"which is not a module of {type(block).__name__}") from None
        block.set_submodule(name, _shard_linear(linear, rule, tp, _reader(read, name, rule)))
    if tp.size == 1:
        return
    for name in family.input_copy:
        block.get_submodule(name).register_forward_pre_hook(_CopyInput(tp), with_kwargs=True)
    for path in family.heads_per_rank_attrs:
        owner, attr = path.rsplit(".", 1)
        module = block.get_submodule(owner)
        setattr(module, attr, getattr(module, attr) // tp.size)


def _reader(read, name: str, rule: TPRule):
    """``(weight, bias)`` shards in local ``[out, in]`` layout from ``read``, or ``None`` without one."""
    if read is None:
        return None

    def shards(has_bias: bool):
        out_dim = 1 if rule.conv1d else 0  # HF dimension of the output features
        if rule.style == "column":
            w = read(f"{name}.weight", out_dim, rule.fused)
            b = read(f"{name}.bias", 0, rule.fused) if has_bias else None
        else:
            w = read(f"{name}.weight", 1 - out_dim, 1)
            b = read(f"{name}.bias", None, 1) if has_bias else None  # replicated
        return (w.t().contiguous() if rule.conv1d else w), b

    return shards


def _shard_linear(linear: nn.Module, rule: TPRule, tp: TPContext, shards=None) -> nn.Module:
    has_bias = getattr(linear, "bias", None) is not None
    if shards is not None:
        w, b = shards(has_bias)
        full = tuple(linear.weight.t().shape if rule.conv1d else linear.weight.shape)  # [out, in]
        want = (full[0] // tp.size, full[1]) if rule.style == "column" else (full[0], full[1] // tp.size)
        if tuple(w.shape) != want:
            raise ValueError(f"checkpoint shard of shape {tuple(w.shape)} does not fit the configured model's "
                             f"{want}; the model config does not match the checkpoint")
        return ColumnParallelLinear(w, b) if rule.style == "column" else RowParallelLinear(w, b, tp)
    weight = linear.weight.detach()
    weight = weight.t() if rule.conv1d else weight  # -> [out, in]
    bias = linear.bias.detach() if getattr(linear, "bias", None) is not None else None
    if rule.style == "column":  # output dim, each fused sub-block (q | k | v) split on its own
        w = shard_tensor(weight, 0, rule.fused, tp.rank, tp.size)
        b = shard_tensor(bias, 0, rule.fused, tp.rank, tp.size) if bias is not None else None
        return ColumnParallelLinear(w, b)
    if rule.style == "row":
        w = shard_tensor(weight, 1, 1, tp.rank, tp.size)  # [out, in/tp]
        return RowParallelLinear(w, bias.clone() if bias is not None else None, tp)
    raise ValueError(f"unknown tensor-parallel style {rule.style!r}; use 'column' or 'row'")


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
