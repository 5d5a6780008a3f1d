"""The plan's rules for mixture-of-experts models (``docs/moe.md``): what the model and the layout must
satisfy before anything starts, each a :class:`~hybridtrain.errors.PlanError` naming the key and the fix.
Imports neither torch nor deepspeed."""
from __future__ import annotations

from typing import Any

from hybridtrain.errors import PlanError


def check_moe(cfg: Any, family: Any, hf_config: Any) -> None:
    """Refuse what an MoE run (or ``parallel.ep`` on a dense one) cannot do yet."""
    ep = int(cfg.parallel.ep)
    if ep < 1:
        raise PlanError("parallel.ep", f"must be >= 1, got {ep}")
    moe = family.moe
    if moe is None:
        if ep > 1:
            raise PlanError("parallel.ep", f"parallel.ep={ep}: {family.model_type} is a dense model (no experts "
                            "to split); use parallel.ep=1")
        return
    if ep > 1:
        raise PlanError("parallel.ep", f"parallel.ep={ep}: expert parallelism is not supported yet; experts are "
                        "split over parallel.tp (docs/moe.md); use parallel.ep=1")
    dense = moe.dense_blocks(hf_config)
    if dense:
        key = "mlp_only_layers" if getattr(hf_config, "mlp_only_layers", None) else "decoder_sparse_step"
        raise PlanError(f"model.config.{key}", f"blocks {dense} of this {family.model_type} model have a dense MLP; "
                        "models mixing dense and MoE blocks are not supported yet (docs/moe.md)")
    if moe.aux_enabled(hf_config) and cfg.data.packing == "documents":
        raise PlanError("data.packing", "data.packing=documents with the router aux loss on "
                        f"(model.config.{moe.aux_on}=true): transformers weights a packed row's router statistics "
                        "by an attention mask hybridtrain does not build; use unpacked rows, or "
                        f"model.config.{moe.aux_on}=false")
