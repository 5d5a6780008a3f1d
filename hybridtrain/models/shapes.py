"""The shapes the planner reads from one decoder block and the final norm, from transformers' own
one-block meta model, remembered on disk by the model's config.

The planner needs only numbers from the model: every parameter's shape (counts, which tensors a TP
rank splits) and the block's linear FLOPs. Building even a one-block meta model imports the family's
HF modeling code: ``transformers.modeling_utils`` with its loss utilities (scipy), activations and
masking, about 1.5 s of the controller's start-up on a 2-core CPU before any rank starts (measured
with ``python -X importtime``; ``bench/startup_ab.py`` measures the whole start-up). So the numbers of
a config that was built once are kept in ``$HYBRIDTRAIN_CACHE/shapes/<key>.json`` (or
``~/.cache/hybridtrain``), keyed by the config's full JSON, its attention kernel, the family's paths and
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

VERSION = 1
"""Bumped when what an entry holds changes: older entries are then never read."""


@dataclass(frozen=True)
class BlockShapes:
    """One decoder block's and the final norm's parameter shapes, and the block's linear FLOPs."""

    block: Shapes
    """Parameters of decoder block 0 (blocks are alike), HF's order."""
    final_norm: Shapes
    """Parameters of the final norm."""
    linear_flops: float
    """Forward matmul FLOPs per token of the block's linears (:func:`linear_flops`)."""


def cache_dir() -> Path:
    """``$HYBRIDTRAIN_CACHE/shapes``, or ``~/.cache/hybridtrain/shapes``."""
    root = os.environ.get("HYBRIDTRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hybridtrain")
    return Path(root) / "shapes"


def cache_key(family, hf_config) -> str:
    """The entry of ``hf_config`` for ``family``: a hash of everything the built block depends on."""
    import transformers

    what = {"config": hf_config.to_dict(), "attn": str(getattr(hf_config, "_attn_implementation", None)),
            "family": [family.model_type, family.blocks, family.final_norm, family.n_layers],
            "transformers": transformers.__version__, "version": VERSION}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


def block_shapes(family, hf_config) -> BlockShapes:
    """The shapes of ``hf_config``'s block and final norm: from the cache, else from a one-block meta model
    (a config transformers refuses raises its ``ValueError`` here, and nothing is cached)."""
    path = cache_dir() / f"{cache_key(family, hf_config)}.json"
    try:
        data = json.loads(path.read_text())
        return BlockShapes({k: tuple(v) for k, v in data["block"].items()},
                           {k: tuple(v) for k, v in data["final_norm"].items()}, float(data["linear_flops"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not built before (or an unreadable entry): build it
    shapes = built_shapes(family, hf_config)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"block": shapes.block, "final_norm": shapes.final_norm,
                                   "linear_flops": shapes.linear_flops}))
        tmp.replace(path)  # readers never see half an entry
    except OSError:
        pass  # a read-only cache only costs the next start-up the build
    return shapes


def linear_flops(block) -> float:
    """Forward matmul FLOPs per token of every linear of ``block`` (an unsharded HF module, usually on
    the meta device): ``2 x in x out`` for each ``nn.Linear`` and HF ``Conv1D`` (weight ``[in, out]``).
    Read from the module itself, so fused, gated, biased and grouped-query projections of every
    family count as they are."""
    total = 0
    for module in block.modules():
        weight = getattr(module, "weight", None)
        kind = type(module).__name__
        if weight is not None and weight.dim() == 2 and (kind == "Conv1D" or hasattr(module, "in_features")):
            total += 2 * weight.shape[0] * weight.shape[1]
    return float(total)


def built_shapes(family, hf_config) -> BlockShapes:
    """:class:`BlockShapes` read from a one-block meta model of ``hf_config`` (no memory is allocated)."""
    from hybridtrain.models.hf_model import one_layer_model

    model = one_layer_model(family, hf_config)
    block = model.get_submodule(f"{family.blocks}.0")

    def shapes(module) -> Shapes:
        return {n: tuple(p.shape) for n, p in module.named_parameters()}

    return BlockShapes(shapes(block), shapes(model.get_submodule(family.final_norm)), linear_flops(block))
