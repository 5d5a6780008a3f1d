"""From plan to DeepSpeed engine: the DeepSpeed config, the model pieces, ``deepspeed.initialize``.

pp > 1: a :class:`HybridPipelineModule` (DeepSpeed ``PipelineModule``, 1F1B) whose stage
boundaries come from the plan and whose TP group is the pipeline grid's slice group.
pp = 1: a :class:`~hybridtrain.models.stages.SequentialLM` in DeepSpeed's ordinary engine
(ZeRO 0-3), with a ``PipelineParallelGrid`` of one stage as ``mpu``, so both paths use the same
rank layout (``rank = pipe * dp * tp + data * tp + model``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from hybridtrain.config.schema import Config
from hybridtrain.parallel.groups import ParallelGroups
from hybridtrain.plan.types import Plan


def lr_lambda(optim, max_steps: int) -> Callable[[int], float]:
    """Learning-rate multiplier of optimizer step ``s`` (0-based): linear warmup, then cosine.

    Written here instead of DeepSpeed's ``WarmupCosineLR`` because that one trains its first
    step at learning rate 0; the single-process reference loop uses this same function.
    """
    warmup, floor = optim.warmup_steps, optim.min_lr_ratio

    def ratio(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return ratio


def param_groups(named_params, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on matrices and embeddings (``ndim >= 2``), none on biases and norms. A parameter
    ZeRO-3 has partitioned already (:func:`zero3_partitioner`) counts by its full shape (``ds_shape``)."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            ndim = len(p.ds_shape) if hasattr(p, "ds_shape") else p.ndim
            (decay if ndim >= 2 else no_decay).append(p)
    # named: DeepSpeed splits named groups into their expert and non-expert parts (an MoE model at ep > 1)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def ds_config(cfg: Config, plan: Plan, trainable: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config of a run, derived from the typed config and plan (never hand-written).

    ``trainable``: the parameters this rank trains when only some do (LoRA); ZeRO-2/3's gradient bucket,
    which DeepSpeed allocates whole (5e8 elements by default), is then no larger than them."""
    o = cfg.optim
    # torch.optim.AdamW through DeepSpeed's torch_adam (engine.py get_optimizer_configuration passes the
    # params on, "fused" included): optim.fused, torch's fused kernel on CUDA and CPU alike.
    conf: dict[str, Any] = {
        # DeepSpeed counts micro x accumulation x its data axis (dp x cp); the cp ranks of a replica share the
        # same rows (each its chunks of them), so its "samples" are cp times the global batch
        "train_batch_size": plan.global_batch_size * plan.dims.cp,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        # ZeRO-0 in fp32: hybridtrain clips itself (DeepSpeed's norm is wrong there, engine/clip.py)
        "gradient_clipping": 0.0 if _own_clipping(plan) else o.grad_clip,
        "optimizer": {"type": "AdamW", "params": {
            "lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
            "torch_adam": True, "fused": o.fused}},  # DeepSpeed passes "fused" on to torch.optim.AdamW
        "zero_optimization": {"stage": plan.zero_stage, **(
            {"reduce_bucket_size": bucket_size(trainable)} if trainable is not None and plan.zero_stage >= 2 else {})},
        "bf16": {"enabled": plan.precision == "bf16"},
        "fp16": {"enabled": plan.precision == "fp16"},
        # bf16 keeps 8 bits of mantissa: summing many micro-batch gradients in it loses the small
        # ones (llama_7b accumulates 256). fp32 accumulation makes DeepSpeed train ZeRO-1 through
        # its BF16 optimizer (an fp32 gradient buffer, reduced in fp32; engine.py
        # _do_optimizer_sanity_check) and ZeRO-2/3 with fp32 gradient partitions.
        # fp16 likewise: ZeRO-1/2/3 (fp16 ZeRO-0 is refused) keep a separate fp32 accumulation
        # (stage_1_and_2.py use_separate_grad_accum, stage3.py gradient_accumulation_dtype).
        **({"data_types": {"grad_accum_dtype": "fp32"}} if plan.precision != "fp32" else {}),
        # DeepSpeed's default communication type is the model's dtype (engine.py communication_data_type):
        # it would round the fp32-accumulated gradients to bf16/fp16 before the all-reduce and copy the
        # rounded sums back. Reduce in fp32 (ZeRO-2/3 then reduce-scatter their 16-bit gradients in fp32).
        "communication_data_type": "fp32",
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (printed every steps_per_print, i.e. never) synchronizes the
        # device at every micro-batch's forward and step; hybridtrain measures steps itself (observe/).
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
    }
    if plan.dims.pp > 1:
        # Only the hidden states cross stages; partitioning them over TP is Megatron-specific.
        conf["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    return conf


def bucket_size(trainable: int) -> int:
    """ZeRO-2/3's ``reduce_bucket_size`` for a rank training ``trainable`` parameters: DeepSpeed's 5e8, or
    fewer when fewer train (a LoRA run's gradients fill a bucket of their own size)."""
    from hybridtrain.plan.memory import REDUCE_BUCKET_SIZE

    return max(1, min(REDUCE_BUCKET_SIZE, int(trainable)))


def reduces_gradients(plan: Plan) -> bool:
    """Whether DeepSpeed's data-parallel gradient reduction runs. Not for one replica (``dims.data`` = dp x cp
    = 1) when the reduction is a plain all-reduce of every gradient: ZeRO-0, and bf16 ZeRO-1, which
    DeepSpeed runs through its BF16 optimizer (``buffered_allreduce_fallback`` of its fp32 gradients,
    nothing else). DeepSpeed's ZeRO optimizers (fp32/fp16 ZeRO-1, ZeRO-2/3) also move the gradients into
    their partitions while reducing, so theirs runs even then."""
    plain_all_reduce = plan.zero_stage == 0 or (plan.zero_stage == 1 and plan.precision == "bf16")
    return not (plan.dims.data == 1 and plain_all_reduce)


def zero3_partitioner(conf: dict[str, Any], groups: ParallelGroups, precision: str) -> Callable[[Any], None]:
    """ZeRO-3 at pp = 1: partition each layer's parameters over its data-parallel group as soon as the
    layer is built, instead of building the whole (TP-sharded) model on every rank and letting
    ``deepspeed.initialize`` partition it (a 70B model at tp = 8: 35 GB of fp32 per rank on the host).

    It is what DeepSpeed does to a model it receives unpartitioned (``DeepSpeedZeRoOffload.
    _convert_to_zero_parameters``: ``zero.Init(module=...)`` with the data-parallel group of ``mpu``, the
    engine's dtype and config), done layer by layer, after what the engine does first
    (``_configure_distributed_model``: parameters cast to the training dtype, buffers such as RoPE's
    ``inv_freq`` kept in fp32, the module moved to the device). The engine then finds a ZeRO-Init model
    and casts and moves nothing."""
    import deepspeed
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    device = deepspeed.get_accelerator().current_device_name()

    def partition(layer) -> None:
        for p in layer.parameters():  # parameters only, as the engine casts them
            p.data = p.data.to(dtype)
        layer.to(device)
        deepspeed.zero.Init(module=layer, data_parallel_group=groups.data_group, dtype=dtype,
                            config_dict_or_path=conf, mpu=groups)

    return partition


def _own_clipping(plan: Plan) -> bool:
    """Whether :mod:`hybridtrain.engine.clip` computes the gradient norm and clips (ZeRO-0, fp32)."""
    return plan.zero_stage == 0 and plan.precision == "fp32"


@dataclass
class Built:
    """An initialised engine and the facts the loop needs about this rank."""

    engine: Any
    groups: ParallelGroups
    """This rank's coordinates and process groups (:mod:`hybridtrain.parallel.groups`)."""
    lora: Any = None
    """The run's :class:`~hybridtrain.models.lora.LoraSpec` (``finetune.method=lora``), else ``None``."""
    head: Any = None
    """With the head deferred to the loss (``trainer.loss_chunk_tokens``): the callable making logits from the
    last layer's output (:func:`head_caller`); else ``None`` (the last layer gives logits)."""
    objective: Any = None
    """With ``finetune.objective=dpo``: the :class:`~hybridtrain.objectives.dpo.PreferenceLoss` (its reference
    mode and per-step metrics, :mod:`hybridtrain.train.preference`); ``reward``: the
    :class:`~hybridtrain.objectives.reward.RewardLoss` (its per-step metrics); with ``cpo`` / ``orpo`` the
    :class:`~hybridtrain.objectives.reference_free.ReferenceFreeLoss`; else ``None``."""
    at_step: dict = field(default_factory=dict)
    """Largest model-state bytes measured so far (filled by :meth:`watch_model_state`)."""
    _unwatch: list = field(default_factory=list)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel coordinate: which rows of each global batch it reads."""
        return self.groups.coords.dp

    @property
    def data_rank(self) -> int:
        """This rank's place on DeepSpeed's data axis (``dp x cp``): 0 on the one replica that writes what every
        replica holds (the context-parallel ranks of data-parallel rank 0 hold the same weights too)."""
        return self.groups.coords.dp * self.groups.dims.cp + self.groups.coords.cp

    @property
    def tp_rank(self) -> int:
        return self.groups.coords.tp

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (``pp`` coordinate)."""
        return self.groups.coords.pp

    @property
    def tp(self) -> Any:
        """This rank's :class:`~hybridtrain.parallel.context.TPContext`."""
        return self.groups.tp

    @property
    def ep(self) -> Any:
        """This rank's :class:`~hybridtrain.parallel.context.EPContext` (size 1 without expert parallelism).
        Data ranks ``0 .. ep - 1`` form the expert-parallel group of the rank that writes checkpoints."""
        return self.groups.ep

    @property
    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, measured from the engine: ``params``, ``grads``, ``optim``
        (master copies, AdamW moments) and ``total``. After the first step: the peaks measured
        during it; before: what is held now (no gradients yet)."""
        from hybridtrain.engine.memory import model_state_bytes

        return dict(self.at_step) or model_state_bytes(self.engine.module, self.engine.optimizer)

    def watch_model_state(self) -> None:
        """Measure the model state at its peaks of a step, on entry to the gradient reduction (all
        gradients present) and around the wrapped torch optimizer's step (partitions, moments),
        keeping the largest value of each part, until :meth:`stop_watching`.

        The loop stops watching after its first step: the model state has the same size every
        step, and measuring walks every parameter, which costs 4% of a step on a small model."""
        from hybridtrain.engine.memory import model_state_bytes, torch_optimizer

        def measure(*_):  # ZeRO steps each parameter group separately: keep the largest of each part
            now = model_state_bytes(self.engine.module, self.engine.optimizer)
            for key in ("params", "grads", "optim"):
                self.at_step[key] = max(self.at_step.get(key, 0), now[key])
            self.at_step["total"] = sum(self.at_step[k] for k in ("params", "grads", "optim"))

        inner = torch_optimizer(self.engine.optimizer)
        # before its step: gradients and master partitions; after: the AdamW moments as well (torch
        # creates them in the first step unless ZeRO did at start), gradients not yet freed
        handles = [inner.register_step_pre_hook(measure), inner.register_step_post_hook(measure)]
        # DeepSpeed has no hook API for the other peak: after the backward, before the gradient
        # reduction (which frees the gradients ZeRO does not keep); wrap that method on this engine.
        reduce = self.engine.allreduce_gradients

        def reduce_measured(*args, **kwargs):
            measure()
            return reduce(*args, **kwargs)

        self.engine.allreduce_gradients = reduce_measured
        self._unwatch[:] = [h.remove for h in handles] + [lambda: delattr(self.engine, "allreduce_gradients")]

    def stop_watching(self) -> None:
        """Remove the measuring hooks of :meth:`watch_model_state` (keeping what they measured)."""
        for undo in self._unwatch:
            undo()
        self._unwatch.clear()


def objective_loss(cfg: Config, token_loss: Any) -> Any:
    """The loss of ``finetune.objective`` over ``token_loss`` (a :class:`~hybridtrain.parallel.layers.
    VocabParallelLoss`): ``None`` for ``sft`` (the token loss itself), the preference loss for ``dpo``, the
    Bradley-Terry loss over the scalar head's scores for ``reward``, the reference-free one for ``cpo`` and
    ``orpo``."""
    if cfg.finetune.objective == "reward":
        from hybridtrain.objectives.reward import RewardLoss

        return RewardLoss(token_loss.cp, cfg.finetune.reward)
    if cfg.finetune.objective in ("cpo", "orpo"):
        from hybridtrain.objectives.reference_free import ReferenceFreeLoss

        return ReferenceFreeLoss(token_loss, cfg.finetune.objective, getattr(cfg.finetune, str(cfg.finetune.objective)))
    if cfg.finetune.objective != "dpo":
        return None
    from hybridtrain.objectives.dpo import PreferenceLoss

    return PreferenceLoss(token_loss, cfg.finetune.dpo)


def head_caller(model: Any, pp: int) -> Callable[[tuple], Any]:
    """The head of ``model`` as a callable making logits (``compute=True``) from ``(hidden, position_ids)``:
    a pipeline's last layer function (the LM head, or DeepSpeed's partial of the tied head on the embedding
    module), or the sequential model's head. On a pipeline stage without the head it is never called."""
    if pp > 1:
        last = model.forward_funcs[-1]
        return lambda x: last(x, compute=True)
    return lambda x: model.head_of(x, compute=True)


def build(cfg: Config, plan: Plan, hf_config, weights_dir: str | None = None, adapter_dir: str | None = None) -> Built:
    """Build this rank's model pieces and the DeepSpeed engine (``torch.distributed`` must be up).

    Weights come from ``weights_dir`` (HF names, e.g. a checkpoint's ``hf/``), else from
    ``model.pretrained``, else from the seeded initialisation. With ``finetune.method=lora`` the blocks
    get adapters (from ``adapter_dir``, a checkpoint's ``adapter/``, else ``finetune.lora.init_from``,
    else fresh) and every other parameter is frozen before DeepSpeed sees the model, so only the
    adapters get gradients, optimizer state and ZeRO partitions.
    """
    import deepspeed
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    from hybridtrain.engine.pipeline import HybridPipelineModule, layer_specs
    from hybridtrain.models.stages import sequential_model
    from hybridtrain.models.build import ModelBuilder
    from hybridtrain.models.moe import loss_of
    from hybridtrain.parallel.context import CPContext, EPContext, TPContext
    from hybridtrain.parallel.groups import pipeline_groups, sequential_groups
    from hybridtrain.parallel.layers import VocabParallelLoss

    dims = plan.dims
    tp = TPContext()
    rank = torch.distributed.get_rank()
    ep = EPContext(rank=dims.expert_rank(rank), size=dims.ep)  # groups bound with the groups
    cp = CPContext(rank=dims.coords(rank).cp, size=dims.cp)
    builder = ModelBuilder.for_run(cfg, hf_config, tp, plan.padded_vocab_size, weights_dir, adapter_dir, ep, cp)
    token_loss = VocabParallelLoss(plan.padded_vocab_size, tp, cp, chunk_tokens=cfg.trainer.loss_chunk_tokens)
    objective = objective_loss(cfg, token_loss)
    loss_fn = loss_of(objective or token_loss, builder.family, hf_config)  # + MoE aux term
    scheduler = lambda opt: LambdaLR(opt, lr_lambda(cfg.optim, cfg.trainer.max_steps))  # noqa: E731
    with torch.no_grad():  # tied-weight broadcast at construction must not record autograd
        if plan.dims.pp > 1:
            model = HybridPipelineModule(layers=layer_specs(builder), dims=dims, loss_fn=loss_fn,
                                         tp=tp, stage_bounds=plan.stage_bounds)
            groups, mpu = pipeline_groups(dims, model, tp, ep, cp), None  # the pipeline engine takes its grid from the module
        else:
            groups = sequential_groups(dims, tp, ep, cp)  # before the layers are built: they read the TP group
            partition = None
            if plan.zero_stage == 3 and builder.lora is None:  # LoRA: DeepSpeed partitions the frozen model whole
                partition = zero3_partitioner(ds_config(cfg, plan), groups, plan.precision)
            model, mpu = sequential_model(builder, loss_fn, partition), groups
    if builder.defer_head:  # the loss makes the logits piece by piece through the head module's own call
        token_loss.head = head_caller(model, dims.pp)
    if builder.lora is not None:
        from hybridtrain.parallel.lora import freeze_base

        freeze_base(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) if builder.lora is not None else None
    conf = ds_config(cfg, plan, trainable=trainable)
    engine, *_ = deepspeed.initialize(model=model, config=conf, mpu=mpu, lr_scheduler=scheduler,
                                      model_parameters=param_groups(model.named_parameters(), cfg.optim.weight_decay))
    if not reduces_gradients(plan):
        # DeepSpeed would still flatten every gradient into one buffer, "all-reduce" it over a
        # data-parallel group of one and copy it back at each step: two passes over the gradients
        # for nothing (docs/benchmarks.md: its share of a step, from py-spy).
        if plan.dims.pp > 1:
            engine.pipeline_enable_backward_allreduce = False  # PipelineEngine's own flag
        else:
            engine.enable_backward_allreduce = False
    built = Built(engine=engine, groups=groups, lora=builder.lora, head=token_loss.head, objective=objective)
    from hybridtrain.engine.clip import guard_empty_norm, install_fp32_clipping

    if _own_clipping(plan):
        install_fp32_clipping(engine, tp.rank, groups.model_group, cfg.optim.grad_clip, groups.ep.group)
    guard_empty_norm(engine.optimizer, engine.device)
    built.watch_model_state()
    return built
