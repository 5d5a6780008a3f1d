"""Full-vocabulary logits of one micro-batch from the sharded model: what an HF export must reproduce.

With ``trainer.save_logits`` every checkpoint also holds ``logits.safetensors``: the first
micro-batch of the next step (data-parallel rank 0's ``input_ids`` and ``position_ids``, which restart
at every record of a packed row) and hybridtrain's fp32 logits for
it, gathered over the tensor-parallel group with the vocabulary padding removed. ``python -m
hybridtrain.export CKPT OUT --check`` then loads the exported folder in transformers and compares
its logits element by element, so a conversion bug shows up as a number, not as a bad fine-tune.
"""
from __future__ import annotations

from pathlib import Path

LOGITS_FILE = "logits.safetensors"


def micro_batch_logits(built, plan, inputs, labels):
    """Logits ``[batch, seq, vocab]`` (fp32, unpadded) of one micro-batch (``inputs`` = ``(input_ids,
    position_ids)``) on the last pipeline stage, ``None`` on other stages. Every rank must call it
    (the pipeline forward is collective)."""
    import torch

    from hybridtrain.parallel import collectives

    engine = built.engine
    if plan.dims.pp > 1:
        try:  # DeepSpeed's inference schedule; return_logits keeps the last stage's outputs
            _, shard = engine.eval_batch(iter([(inputs, labels)]), return_logits=True, bcast_loss=False,
                                         num_micro_batches=1)
        finally:
            engine.train()  # eval_batch leaves the module in eval mode
        if built.stage != plan.dims.pp - 1:
            return None
        if built.head is not None:  # the head deferred to the loss: the last stage gave the head's input
            with torch.no_grad():
                shard = built.head(tuple(shard[:2]))
        if isinstance(shard, tuple):  # an MoE model's last stage also gives the router sums (models/moe.py)
            shard = shard[0]
    else:
        module = engine.module
        module.eval()
        try:
            with torch.no_grad():
                shard = module.logits(tuple(t.to(engine.device) for t in inputs))
        finally:
            module.train()
    shard = shard.detach().float()
    if plan.dims.cp > 1:  # this rank's chunks of every row -> whole rows (gathered over the cp group)
        from hybridtrain.parallel.context_parallel import gather_sequence

        shard = gather_sequence(shard, built.groups.cp, dim=1)
    if built.tp.size > 1:  # vocabulary-parallel shards -> full vocabulary (gathered on the device)
        shard = torch.cat(collectives.all_gather(shard, engine.device, group=built.tp.group), dim=-1)
    return shard[..., :plan.vocab_size].cpu()


def logits_writer(built, plan, samples, step: int):
    """The ``extra(tmp_dir)`` callback of :func:`~hybridtrain.checkpoint.save.save_checkpoint` that
    writes ``logits.safetensors`` for the first micro-batch of step ``step`` (0-based)."""

    def write(folder: Path) -> None:
        from hybridtrain.checkpoint.stream import save_tensors

        layout = plan.batch_layout()
        inputs, labels = next(iter(samples.micro_batches(step, layout, 0)))  # every replica: rank 0's
        logits = micro_batch_logits(built, plan, inputs, labels)
        if logits is not None and built.tp_rank == 0 and built.data_rank == 0:
            input_ids, position_ids = inputs
            save_tensors({"input_ids": input_ids.contiguous(), "position_ids": position_ids.contiguous(),
                          "logits": logits.contiguous()}, Path(folder) / LOGITS_FILE, {"step": str(step)})

    return write
