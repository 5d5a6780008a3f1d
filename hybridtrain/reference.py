"""The numerical oracle: plain transformers + ``torch.optim.AdamW`` in one process.

Same initial weights (:func:`~hybridtrain.models.hf_model.reference_model`, or the ``model.pretrained``
folder loaded by ``from_pretrained``), same global batches
(:mod:`hybridtrain.data.sampler`), same learning-rate schedule, weight-decay
groups and clipping as a hybridtrain run, but no DeepSpeed, no sharding, no pipeline: what the
parity tests and the overhead benchmark compare every parallel layout against.

Packed rows (``data.packing=documents``) are not run packed here: each record of a row runs alone,
as a batch of one without padding, so the oracle shares no masking code with what it checks.

With ``finetune.method=lora`` the model is wrapped by the real ``peft`` library (``get_peft_model`` with
the run's ``LoraConfig``, ``target_modules`` passed as the run was given them; on an MoE model the module
paths hybridtrain resolves them to, :func:`peft_model`) and its adapters start
from hybridtrain's initial ``A`` and ``B`` (or the ``finetune.lora.init_from`` adapter): the oracle of
hybridtrain's own LoRA layers. Needs ``peft`` (the ``lora`` extra).
"""
from __future__ import annotations

import time

from hybridtrain.config.schema import Config


def reference_run(cfg: Config, steps: int | None = None, adapters: dict | None = None) -> list[dict]:
    """Train ``steps`` (default ``trainer.max_steps``) steps; return one record per step
    (``step``, ``loss``, ``grad_norm``, ``lr``, ``step_time_s``). A LoRA run's trained adapters go into
    ``adapters`` when given (peft's names, as in ``adapter_model.safetensors``)."""
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    from hybridtrain.data.prepare import train_samples
    from hybridtrain.engine import lr_lambda, param_groups
    from hybridtrain.models.hf_model import reference_model
    from hybridtrain.models.families import family_of
    from hybridtrain.plan import Machine, resolve

    plan, hf_config = resolve(cfg, Machine(cpu_cores=1))
    torch.manual_seed(cfg.trainer.seed)
    family = family_of(cfg.model)
    if cfg.model.pretrained:  # fine-tuning: transformers' own loading of the folder
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(cfg.model.pretrained, config=hf_config, dtype=torch.float32)
    else:
        model = reference_model(hf_config, family, cfg.trainer.seed)
    if cfg.finetune.method == "lora":
        model = peft_model(model, cfg, family)
    model.train()
    o = cfg.optim
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), o.weight_decay), lr=o.lr,
                            betas=tuple(o.betas), eps=o.eps, fused=o.fused)
    sched = LambdaLR(opt, lr_lambda(o, cfg.trainer.max_steps))
    samples = train_samples(cfg.data, cfg.trainer.seed)
    records = []
    for step in range(steps or cfg.trainer.max_steps):
        t0 = time.perf_counter()
        idx = samples.global_indices(step, plan.global_batch_size)
        input_ids, labels = (torch.from_numpy(a) for a in samples.rows(idx))
        positions = torch.from_numpy(samples.positions(idx))
        opt.zero_grad(set_to_none=True)
        loss = torch.zeros(())
        tokens = int((labels != -100).sum())  # the step's loss is the mean over all its loss tokens
        micro_batches = list(_batches(input_ids, labels, positions, plan.global_batch_size // plan.micro_batch_size))
        for x, y in micro_batches:
            # labels are already shifted (labels[t] = token t+1): HF's ``shift_labels``; transformers
            # divides the summed token loss by ``num_items_in_batch`` (its gradient-accumulation fix)
            out = model(input_ids=x, labels=y, shift_labels=y, num_items_in_batch=tokens)
            micro = out.loss - _aux_excess(out, hf_config, len(micro_batches))
            micro.backward()  # summed gradients
            loss += micro.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip if o.grad_clip > 0 else float("inf"))
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        records.append({"step": step + 1, "loss": float(loss), "grad_norm": float(norm), "lr": lr,
                        "step_time_s": time.perf_counter() - t0})
    if adapters is not None and cfg.finetune.method == "lora":
        from peft import get_peft_model_state_dict

        adapters.update({k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()})
    return records


def _aux_excess(out, hf_config, micro_batches: int):
    """What a mixture-of-experts model's loss holds beyond the step's definition of its router aux term.

    transformers adds ``router_aux_loss_coef x aux_loss`` to every forward's loss (so summing micro-batch
    losses, as its Trainer does, scales the term with their number); hybridtrain's step takes the **mean**
    over the step's micro-batches (:mod:`hybridtrain.models.moe`, ``docs/moe.md``): each micro-batch keeps
    ``1 / micro_batches`` of its term. 0 for a dense model."""
    aux = getattr(out, "aux_loss", None)
    if aux is None:
        return 0.0
    return float(hf_config.router_aux_loss_coef) * aux * (1.0 - 1.0 / micro_batches)


def _batches(input_ids, labels, positions, chunks: int):
    """What the oracle runs: the micro-batches ``[micro, S]`` of one sequence per row, or, where the
    position ids restart (packed records), every record with a loss token alone as ``[1, length]``."""
    import torch

    if bool((positions == torch.arange(positions.shape[1])).all()):
        yield from zip(input_ids.chunk(chunks), labels.chunk(chunks))
        return
    for x, y, pos in zip(input_ids, labels, positions):
        starts = torch.nonzero(pos == 0).flatten().tolist() + [len(pos)]
        for a, b in zip(starts[:-1], starts[1:]):
            if bool((y[a:b] != -100).any()):  # the row's padding is a segment without labels
                yield x[None, a:b], y[None, a:b]


def peft_model(model, cfg: Config, family):
    """``model`` wrapped by peft's ``get_peft_model`` with the run's LoRA settings, its adapters set to the
    ones a hybridtrain run starts from: the ``finetune.lora.init_from`` adapter, else ``A`` drawn exactly as
    :func:`hybridtrain.models.build.add_lora` draws it and ``B`` zero (peft's own init of ``B``)."""
    import torch
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    from hybridtrain.models.seeded_init import unit_seed
    from hybridtrain.models.lora import ADAPTER_WEIGHTS, LORA_A, PEFT_PREFIX
    from hybridtrain.parallel.lora import initial_a

    lo = cfg.finetune.lora
    targets = lo.target_modules
    if family.moe is not None:
        # An MoE model gets the modules hybridtrain adapts, by path (what its exported adapter_config.json names):
        # peft >= 0.18 under transformers 5 maps the names of a target string onto the fused experts and the
        # router (LoRA on 3-D parameters), which hybridtrain keeps frozen (docs/moe.md#lora)
        from hybridtrain.models.lora import resolve_targets
        from hybridtrain.models.units import block_variants

        layers = int(getattr(model.config, family.n_layers))
        targets = sorted(resolve_targets(family, layers, (n for n, _ in model.named_modules()), lo.target_modules,
                                         block_variants(family, model.config)))  # a dense block's MLP by its plan
    config = LoraConfig(r=lo.r, lora_alpha=lo.alpha, lora_dropout=lo.dropout, target_modules=targets,
                        use_rslora=lo.rslora, fan_in_fan_out=any(r.conv1d for r in family.tp_plan.values()),
                        bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    if lo.init_from:
        from pathlib import Path

        from safetensors.torch import load_file

        result = set_peft_model_state_dict(model, load_file(str(Path(lo.init_from).expanduser() / ADAPTER_WEIGHTS)))
        assert not result.unexpected_keys, result.unexpected_keys
        return model
    with torch.no_grad():
        for name, layer in model.named_modules():
            if isinstance(layer, LoraLayer):
                path = name[len(PEFT_PREFIX):]
                a = layer.lora_A["default"].weight
                a.copy_(initial_a(unit_seed(cfg.trainer.seed, f"{path}.{LORA_A}"), a.shape[0], a.shape[1]))
    return model
