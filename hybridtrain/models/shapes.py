"""The shapes the planner reads from the decoder blocks (one per block variant) and the final norm, from
transformers' own meta model, remembered on disk by the model's config.

The planner needs only numbers from the model: every parameter's shape (counts, which tensors a TP
rank splits) and each block variant's linear FLOPs. Building even a meta model imports the family's
HF modeling code: ``transformers.modeling_utils`` with its loss utilities (scipy), activations and
masking, a noticeable part of the controller's start-up before any rank starts (``docs/benchmarks.md``;
``bench/startup_ab.py`` measures the whole start-up). So the numbers of
a config that was built once are kept in ``$HYBRIDTRAIN_CACHE/shapes/<key>.json`` (or
``~/.cache/hybridtrain``; :mod:`hybridtrain.cache`), keyed by the config's full JSON, its attention kernel, the family's paths and
the transformers version; the same model trained again, resumed or swept over other keys is not
built again. An entry is written only after the build succeeded, so it also stands for transformers'
own validation of that config (:func:`hybridtrain.plan.hf.model_config`).

Why by hand: neither transformers nor DeepSpeed offers parameter shapes of a config without
building (and so importing) the model; the cache is a few JSON files. Writing the shapes of each
family down instead (one table per family) would be a second description of every architecture.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple

Shapes = Dict[str, Tuple[int, ...]]
"""HF parameter name relative to its module (``attn.c_attn.weight``) -> shape."""

VERSION = 3
"""Bumped when what an entry holds changes: older entries are then never read."""


@dataclass(frozen=True)
class BlockShapes:
    """Each block variant's and the final norm's parameter shapes, and each variant's linear FLOPs."""

    blocks: Dict[str, Shapes]
    """Block variant (:func:`hybridtrain.models.units.block_variants`) -> the parameters of its first block, HF's
    order (every block of the variant has the same)."""
    final_norm: Shapes
    """Parameters of the final norm."""
    linear_flops: Dict[str, float]
    """Block variant -> forward matmul FLOPs per token of the block's linears (:func:`linear_flops`)."""


def cache_dir() -> Path:
    """``$HYBRIDTRAIN_CACHE/shapes``, or ``~/.cache/hybridtrain/shapes`` (:class:`hybridtrain.cache.CacheDir`)."""
    from hybridtrain.cache import CacheDir

    return CacheDir.from_env().shapes


def cache_key(family, hf_config) -> str:
    """The entry of ``hf_config`` for ``family``: a hash of everything the built blocks depend on."""
    import transformers

    from hybridtrain.models.units import block_variants

    what = {"config": hf_config.to_dict(), "attn": str(getattr(hf_config, "_attn_implementation", None)),
            "family": [family.model_type, family.blocks, family.final_norm, family.n_layers],
            "variants": block_variants(family, hf_config),
            "transformers": transformers.__version__, "version": VERSION}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


def block_shapes(family, hf_config) -> BlockShapes:
    """The shapes of ``hf_config``'s block variants and final norm: from the cache, else from a meta model
    (a config transformers refuses raises its ``ValueError`` here, and nothing is cached)."""
    path = cache_dir() / f"{cache_key(family, hf_config)}.json"
    try:
        data = json.loads(path.read_text())
        return BlockShapes({v: {k: tuple(x) for k, x in b.items()} for v, b in data["blocks"].items()},
                           {k: tuple(x) for k, x in data["final_norm"].items()},
                           {v: float(f) for v, f in data["linear_flops"].items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # not built before (or an unreadable entry): build it
    shapes = built_shapes(family, hf_config)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"blocks": shapes.blocks, "final_norm": shapes.final_norm,
                                   "linear_flops": shapes.linear_flops}))
        tmp.replace(path)  # readers never see half an entry
    except OSError:
        pass  # a read-only cache only costs the next start-up the build
    return shapes


def linear_flops(block, moe=None, hf_config=None) -> float:
    """Forward matmul FLOPs per token of every linear of ``block`` (an unsharded HF module, usually on
    the meta device): ``2 x in x out`` for each ``nn.Linear`` and HF ``Conv1D`` (weight ``[in, out]``).
    Read from the module itself, so fused, gated, biased and grouped-query projections of every
    family count as they are (a shared expert, made of ``nn.Linear``, among them).

    A mixture-of-experts block (``moe``: the family's :class:`~hybridtrain.models.families.MoE`) counts its
    *active* work: the router (``2 x H x E``) and, of the fused 3-D experts (``[E, out, in]`` each), the
    ``top_k`` experts a token runs (``top_k x 2 x out x in`` per 3-D weight), not all ``E``."""
    total = 0
    for module in block.modules():
        weight = getattr(module, "weight", None)
        kind = type(module).__name__
        if weight is not None and weight.dim() == 2 and (kind == "Conv1D" or hasattr(module, "in_features")):
            total += 2 * weight.shape[0] * weight.shape[1]
    if moe is not None:
        try:
            router, experts = block.get_submodule(moe.router), block.get_submodule(moe.experts)
        except AttributeError:  # a dense block of an MoE model
            return float(total)
        top_k = int(getattr(hf_config, moe.top_k))
        if not hasattr(router, "in_features"):  # an nn.Linear router is counted above already
            total += 2 * router.weight.shape[0] * router.weight.shape[1]  # [E, H]
        total += sum(top_k * 2 * p.shape[1] * p.shape[2] for p in experts.parameters(recurse=False) if p.dim() == 3)
    return float(total)


def built_shapes(family, hf_config) -> BlockShapes:
    """:class:`BlockShapes` read from a meta model of ``hf_config`` (no memory is allocated): every block is
    built and compared with its variant's first block, so blocks the variants call alike but transformers
    builds differently are an error (the family then needs a ``block_variants`` rule), never a silent
    estimate of the wrong block."""
    from hybridtrain.errors import PlanError
    from hybridtrain.models.hf_model import meta_model
    from hybridtrain.models.units import block_variants

    model = meta_model(hf_config)

    def shapes(module) -> Shapes:
        return {n: tuple(p.shape) for n, p in module.named_parameters()}

    blocks: Dict[str, Shapes] = {}
    flops: Dict[str, float] = {}
    first: Dict[str, int] = {}
    for i, variant in enumerate(block_variants(family, hf_config)):
        block = model.get_submodule(f"{family.blocks}.{i}")
        if variant not in blocks:
            blocks[variant], flops[variant], first[variant] = shapes(block), linear_flops(block, family.moe, hf_config), i
        elif shapes(block) != blocks[variant]:
            raise PlanError("model.family", f"{family.model_type}: blocks {first[variant]} and {i} are both "
                            f"variant {variant!r} but transformers builds them with different parameters; the "
                            "family needs a block_variants rule (hybridtrain/models/families/base.py)")
    return BlockShapes(blocks, shapes(model.get_submodule(family.final_norm)), flops)
