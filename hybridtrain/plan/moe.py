"""The plan's rules for mixture-of-experts models (``docs/moe.md``): what the model and the layout must
satisfy before anything starts, each a :class:`~hybridtrain.errors.PlanError` naming the key and the fix.
Imports neither torch nor deepspeed."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from hybridtrain.errors import PlanError


@dataclass(frozen=True)
class ExpertFacts:
    """The routed experts of an MoE model as the plan command shows them."""

    num_experts: int
    """Routed experts per MoE block (``E``)."""
    top_k: int
    """Experts each token runs."""
    moe_blocks: int
    """Blocks with routed experts (of all the model's blocks)."""
    width: int
    """One expert's MLP width (``I``)."""
    per_rank_experts: int
    """Experts one rank holds in each MoE block (``E / ep``)."""
    per_rank_width: int
    """Of each of them, the width one tensor-parallel rank holds (``I / tp``)."""
    expert_params: int
    """Parameters of every routed expert of the model (all blocks)."""
    total_params: int
    """Parameters of the whole model (a tied head once)."""

    @property
    def active_params(self) -> int:
        """Parameters a token runs through: all but the ``E - top_k`` experts it is not routed to."""
        return self.total_params - self.expert_params * (self.num_experts - self.top_k) // self.num_experts


def expert_facts(family: Any, hf_config: Any, dims: Any, total_params: int) -> Optional[ExpertFacts]:
    """The :class:`ExpertFacts` of ``hf_config`` under ``dims`` (``None`` for a dense model); ``total_params``:
    the model's parameters (:meth:`~hybridtrain.plan.costs.ModelFacts.total_params`)."""
    moe = family.moe
    if moe is None:
        return None
    from hybridtrain.models.shapes import block_shapes
    from hybridtrain.models.units import block_variants

    shapes = block_shapes(family, hf_config)
    per_variant = {v: sum(math.prod(s) for name, s in b.items() if name.startswith(f"{moe.experts}."))
                   for v, b in shapes.blocks.items()}
    variants = block_variants(family, hf_config)
    layers = int(getattr(hf_config, family.n_layers))
    experts, width = int(getattr(hf_config, moe.num_experts)), int(getattr(hf_config, moe.width))
    return ExpertFacts(num_experts=experts, top_k=int(getattr(hf_config, moe.top_k)),
                       moe_blocks=layers - len(moe.dense_blocks(hf_config)), width=width,
                       per_rank_experts=experts // getattr(dims, "ep", 1), per_rank_width=width // dims.tp,
                       expert_params=sum(per_variant[v] for v in variants), total_params=total_params)


def fp32_modules(hf_config: Any, precision: str) -> list[str]:
    """The modules transformers' causal-LM class of ``hf_config`` keeps in fp32 in a model of ``precision``
    (transformers' rule, ``PreTrainedModel._keep_in_fp32_modules``: ``_keep_in_fp32_modules_strict`` under bf16 and
    fp16, DeepSeek-V3's router weight and ``e_score_correction_bias``; ``_keep_in_fp32_modules`` under fp16 only,
    gpt-oss's norms)."""
    from transformers import AutoModelForCausalLM

    if precision not in ("bf16", "fp16"):
        return []
    cls = AutoModelForCausalLM._model_mapping.get(type(hf_config), None)
    names = list(getattr(cls, "_keep_in_fp32_modules_strict", None) or [])
    if precision == "fp16":
        names += getattr(cls, "_keep_in_fp32_modules", None) or []
    return list(dict.fromkeys(names))


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
    if moe.aux_enabled(hf_config) and cfg.data.packing == "documents":
        raise PlanError("data.packing", "data.packing=documents with the router aux loss on "
                        f"(model.config.{moe.aux_on}=true): transformers weights a packed row's router statistics "
                        "by an attention mask hybridtrain does not build; use unpacked rows, or "
                        f"model.config.{moe.aux_on}=false")


def check_moe_precision(cfg: Any, family: Any, hf_config: Any) -> None:
    """Refuse a 16-bit precision for an MoE model whose HF class keeps modules in fp32 at that precision
    (:func:`fp32_modules`: DeepSeek-V3's router weight and ``e_score_correction_bias`` in bf16 and fp16, gpt-oss's
    norms in fp16): DeepSpeed's 16-bit engine casts every parameter to the training dtype (its
    ``data_types.keep_in_fp32_modules`` keeps buffers only), so the model would no longer be transformers'.
    gpt-oss in bf16 is transformers' bf16 model (its norms follow the dtype there). ``cfg.trainer.precision`` as
    resolved (``null``: bf16 on GPUs, fp32 on CPUs), so this runs after
    :func:`~hybridtrain.plan.devices.precision_for`."""
    precision = str(cfg.trainer.precision)
    if family.moe is None:
        return
    kept = fp32_modules(hf_config, precision)
    if kept:
        raise PlanError("trainer.precision", f"trainer.precision={precision}: transformers keeps "
                        f"{', '.join(kept)} of {family.model_type} in fp32 in {precision} models, which DeepSpeed's "
                        f"{precision} engine does not (it keeps buffers in fp32, but casts every parameter to "
                        f"{precision}); use "
                        "trainer.precision=fp32" + (" or bf16" if not fp32_modules(hf_config, "bf16") else ""))


GROUPED_MM_ALIGN_BYTES = 16
"""CUDA's ``torch._grouped_mm`` checks that every operand's data pointer and leading stride is a multiple of 16
bytes (``GroupedMMUtils.h`` ``check_valid_strides_and_return_transposed``); the CPU path checks nothing."""


def check_grouped_mm_alignment(cfg: Any, family: Any, hf_config: Any, tp: int, gpus: bool) -> None:
    """Refuse, on a GPU plan, a layout whose experts' slices transformers' ``grouped_mm`` would reject on the first
    forward ("strides should be multiple of 16 bytes"): the rows of ``gate_up_proj [E, 2I/tp, H]`` are ``H`` wide and
    those of ``down_proj [E, H, I/tp]`` ``I/tp`` wide, so both must be whole multiples of 16 bytes in the training
    precision (8 elements in bf16 and fp16, 4 in fp32). GPU review 3, finding 10: gpt-oss at tp = 16 (2880 / 16 =
    180) and small custom configs. CPU plans pass (the CPU kernel has no such check)."""
    if family.moe is None or not gpus:
        return
    precision = str(cfg.trainer.precision)
    per = GROUPED_MM_ALIGN_BYTES // (4 if precision == "fp32" else 2)  # elements per 16 bytes
    hidden = int(getattr(hf_config, family.hidden))
    if hidden % per:
        raise PlanError("model.config." + family.hidden,
                        f"model.config.{family.hidden}={hidden} is not a multiple of {per}: on GPUs transformers' "
                        f"grouped_mm experts need rows of whole 16 bytes ({per} {precision} values); use a hidden "
                        f"size that {per} divides" + ("" if precision == "fp32" else ", or trainer.precision=fp32"))
    width = int(getattr(hf_config, family.moe.width))
    if (width // tp) % per:
        fits = [t for t in (1, 2, 4, 8, 16, 32, 64) if width % t == 0 and (width // t) % per == 0]
        raise PlanError("parallel.tp", f"parallel.tp={tp}: each expert's slice is model.config.{family.moe.width}/tp = "
                        f"{width}/{tp} = {width // tp} wide, not a multiple of {per}: on GPUs transformers' "
                        f"grouped_mm experts need rows of whole 16 bytes ({per} {precision} values); "
                        + (f"use tp in {fits}" if fits else f"no tp fits a width of {width}: use an expert width that "
                           f"{per} divides" + ("" if precision == "fp32" else ", or trainer.precision=fp32")))


def check_expert_parallel(cfg: Any, family: Any, hf_config: Any, dp: int, zero: int) -> int:
    """The checked ``parallel.ep`` of a run with ``dp`` data-parallel ranks and ZeRO stage ``zero``: it must
    divide dp and the experts, and ZeRO-3 is refused (DeepSpeed has no MoE parameter groups there, and
    partitioning each rank's own experts over all of dp would mix different experts). Checkpoints are allowed: the save gathers every expert into ``hf/`` and ``optim/`` and a resume
    reads them back through those (:mod:`hybridtrain.checkpoint.reshard`)."""
    ep = int(cfg.parallel.ep)
    if ep == 1:
        return ep
    experts = int(getattr(hf_config, family.moe.num_experts))
    if dp % ep:
        fits = [d for d in range(1, dp + 1) if dp % d == 0 and experts % d == 0]
        raise PlanError("parallel.ep", f"parallel.ep={ep} must divide the data-parallel degree dp={dp} (experts are "
                        f"split over ranks carved from dp); use ep in {fits}, or a dp that ep divides")
    if experts % ep:
        fits = [d for d in range(1, dp + 1) if dp % d == 0 and experts % d == 0]
        raise PlanError("parallel.ep", f"parallel.ep={ep} must divide the {experts} experts of each MoE layer "
                        f"(model.config.{family.moe.num_experts}); use ep in {fits}")
    if zero >= 3:
        raise PlanError("parallel.zero_stage", f"zero_stage={zero} with parallel.ep={ep}: DeepSpeed refuses its MoE "
                        "parameter groups under ZeRO-3 (\"Native DeepSpeed MoE is not supported with ZeRO Stage 3\"); "
                        "use parallel.zero_stage=2 (gradients and optimizer state sharded; the experts' over their own "
                        "data-parallel ranks) or parallel.ep=1")
    return ep


def expert_stage_needs(family: Any, hf_config: Any, dims: Any, zero: int, names: list[str],
                       lora: bool = False) -> Optional[list[bool]]:
    """Which pipeline layers (``names``) are MoE blocks, when every stage must hold one (:func:`check_expert_stages`:
    ``parallel.ep`` > 1, ZeRO-1 or 2, pp > 1, no LoRA); ``None`` when any split runs. The balanced partition takes
    it as its constraint (:func:`~hybridtrain.plan.partition.partition` ``needs``)."""
    if dims.ep == 1 or dims.pp == 1 or zero == 0 or lora or family.moe is None:
        return None
    from hybridtrain.models.units import block_index, kind_of, Kind

    dense = set(family.moe.dense_blocks(hf_config))
    return [kind_of(n) is Kind.BLOCK and block_index(n) not in dense for n in names]


def check_expert_stages(family: Any, hf_config: Any, dims: Any, zero: int, names: list[str], bounds: list[int],
                        key: str, lora: bool = False) -> None:
    """With ``parallel.ep`` > 1, ZeRO-1 and pp > 1 every pipeline stage must hold an MoE block: DeepSpeed's
    ZeRO-1 all-reduces one gradient norm per parameter group over the pipe x tensor ranks, and a stage
    without experts has fewer groups than one with them (the ranks would wait on each other forever).
    Under LoRA (``lora``) the experts are frozen and no stage has expert groups, so any split runs."""
    needs = expert_stage_needs(family, hf_config, dims, zero, names, lora)
    if needs is None:
        return
    for s in range(dims.pp):
        stage = names[bounds[s]:bounds[s + 1]]
        if not any(needs[bounds[s]:bounds[s + 1]]):
            raise PlanError(key, f"stage {s} ({', '.join(stage)}) holds no MoE block, which DeepSpeed's ZeRO-1 "
                            f"with parallel.ep={dims.ep} cannot run at pp > 1 (its gradient norm would hang); put an "
                            "MoE block on every stage (parallel.stage_layers) or use parallel.zero_stage=0")
