"""The plan's memory estimate for an existing run directory: what a worker's measured
``model_state_bytes`` (``metrics.jsonl``) is compared with in the tests and ``bench/``."""
from __future__ import annotations

from hybridtrain.models.families import family_of
from hybridtrain.plan.costs import has_score_head, model_facts
from hybridtrain.plan.hf import model_config
from hybridtrain.plan.lora import lora_memory
from hybridtrain.plan.memory import RankMemory, memory_flags, rank_memory
from hybridtrain.rundir import RunDir


def estimate_for_run(run_dir, stage: int = 0) -> RankMemory:
    """The estimate for a rank of ``stage`` of the run in ``run_dir`` (its ``config.yaml`` and
    ``plan.json``): what the worker's measured ``model_state_bytes`` is compared with."""
    files = RunDir(run_dir)
    cfg, plan = files.config(), files.plan()
    hf_config = model_config(cfg)
    facts = model_facts(family_of(cfg.model), hf_config, plan.seq_len, plan.dims.tp, cfg.model.vocab_pad_multiple,
                        score_head=has_score_head(cfg))
    return rank_memory(facts, plan.stage_bounds, stage, plan.dims, zero=plan.zero_stage,
                       precision=plan.precision, micro_batch=plan.micro_batch_size, micro_batches=plan.grad_accum,
                       checkpointing=cfg.parallel.activation_checkpointing, lora=lora_memory(cfg, hf_config, plan),
                       **memory_flags(cfg, facts, plan.gpus))
