"""The numerical oracle: plain transformers + ``torch.optim.AdamW`` in one process.

Same initial weights (:func:`~hybridtrain.models.build.reference_model`, or the ``model.pretrained``
folder loaded by ``from_pretrained``), same global batches
(:mod:`hybridtrain.data.sampler`), same learning-rate schedule, weight-decay
groups and clipping as a hybridtrain run, but no DeepSpeed, no sharding, no pipeline: what the
parity tests and the overhead benchmark compare every parallel layout against.
"""
from __future__ import annotations

import time

from hybridtrain.config.schema import Config


def reference_run(cfg: Config, steps: int | None = None) -> list[dict]:
    """Train ``steps`` (default ``trainer.max_steps``) steps; return one record per step
    (``step``, ``loss``, ``grad_norm``, ``lr``, ``step_time_s``)."""
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    from hybridtrain.data.prepare import train_samples
    from hybridtrain.engine import lr_lambda, param_groups
    from hybridtrain.models.build import reference_model
    from hybridtrain.models.families import family_of
    from hybridtrain.plan import Machine, resolve

    plan, hf_config = resolve(cfg, Machine(cpu_cores=1))
    torch.manual_seed(cfg.trainer.seed)
    if cfg.model.pretrained:  # fine-tuning: transformers' own loading of the folder
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(cfg.model.pretrained, config=hf_config, dtype=torch.float32)
    else:
        model = reference_model(hf_config, family_of(cfg.model), cfg.trainer.seed)
    model.train()
    o = cfg.optim
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), o.weight_decay), lr=o.lr,
                            betas=tuple(o.betas), eps=o.eps, fused=o.fused)
    sched = LambdaLR(opt, lr_lambda(o, cfg.trainer.max_steps))
    samples = train_samples(cfg.data, cfg.trainer.seed)
    records = []
    for step in range(steps or cfg.trainer.max_steps):
        t0 = time.perf_counter()
        input_ids, labels = samples.rows(samples.global_indices(step, plan.global_batch_size))
        input_ids, labels = torch.from_numpy(input_ids), torch.from_numpy(labels)
        opt.zero_grad(set_to_none=True)
        loss = torch.zeros(())
        chunks = plan.global_batch_size // plan.micro_batch_size
        tokens = int((labels != -100).sum())  # the step's loss is the mean over all its loss tokens
        for x, y in zip(input_ids.chunk(chunks), labels.chunk(chunks)):  # micro-batches, summed grads
            # labels are already shifted (labels[t] = token t+1): HF's ``shift_labels``; transformers
            # divides the summed token loss by ``num_items_in_batch`` (its gradient-accumulation fix)
            micro = model(input_ids=x, labels=y, shift_labels=y, num_items_in_batch=tokens).loss
            micro.backward()
            loss += micro.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip if o.grad_clip > 0 else float("inf"))
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        records.append({"step": step + 1, "loss": float(loss), "grad_norm": float(norm), "lr": lr,
                        "step_time_s": time.perf_counter() - t0})
    return records
