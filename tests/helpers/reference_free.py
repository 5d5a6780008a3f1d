"""The CPO / SimPO / ORPO oracle: TRL 1.16's ``CPOTrainer`` and ``ORPOTrainer`` (``trl.experimental``) on the same
model folder, records, order, batch, lr and seed as a hybridtrain run (``finetune.objective=cpo`` / ``orpo``), and
the overrides that make the two runs the same training (:mod:`helpers.dpo`'s, with the objective's own keys)."""
from __future__ import annotations

from pathlib import Path

from helpers.dpo import in_order, order, policy
from hybridtrain.objectives import CPO_STATS, ORPO_STATS

METRICS = {"cpo": CPO_STATS, "orpo": ORPO_STATS}
"""TRL's names per objective, which hybridtrain's ``metrics.jsonl`` uses too (TRL's ``logits/*`` not among them)."""


def overrides(folder: Path, pairs: Path, objective: str, keys: dict, *, steps: int, batch: int, lr: float,
              seed: int, seq_len: int = 128) -> list[str]:
    """A hybridtrain run that trains as :func:`trl_run` does: constant lr, AdamW betas 0.9/0.999 without weight
    decay, clipping at 1; ``keys``: ``finetune.OBJECTIVE.*`` values (TRL's config names)."""
    return [f"model.pretrained={folder}", "data=files", f"data.path={pairs}", "data.format=preference",
            f"data.seq_len={seq_len}", f"finetune.objective={objective}",
            *(f"finetune.{objective}.{k}={v}" for k, v in keys.items()), f"trainer.global_batch_size={batch}",
            f"trainer.max_steps={steps}", f"trainer.seed={seed}", f"optim.lr={lr}", "optim.warmup_steps=0",
            "optim.min_lr_ratio=1.0", "optim.weight_decay=0.0", "optim.betas=[0.9,0.999]", "optim.grad_clip=1.0",
            "trainer.save_final=false"]


def trl_run(folder: Path, records: list[dict], out: Path, objective: str, keys: dict, *, steps: int, batch: int,
            lr: float, seed: int, adapter: Path | None = None, chat_template: str | None = None) -> list[dict]:
    """TRL's per-step log records (``loss``, ``grad_norm`` and :data:`METRICS`) of ``CPOTrainer`` (``cpo``) or
    ``ORPOTrainer`` (``orpo``) on ``records`` taken in :func:`~helpers.dpo.order` (TRL's shuffling replaced by
    it), one process, the whole batch in one micro-batch, no truncation (``max_length`` past every pair); with
    ``adapter`` a peft adapter folder trained on the frozen base; ``chat_template`` replaces the tokenizer's."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    if objective == "cpo":
        from trl.experimental.cpo import CPOConfig as Config, CPOTrainer as Trainer
    else:
        from trl.experimental.orpo import ORPOConfig as Config, ORPOTrainer as Trainer

    ordered = [records[i] for i in order(len(records), steps, batch, seed)]
    model = policy(folder, adapter)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if tokenizer.pad_token is None:  # CPOTrainer does this itself; ORPOTrainer pads with pad_token_id
        tokenizer.pad_token = tokenizer.eos_token
    args = Config(output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                  max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                  adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1,
                  save_strategy="no", report_to=[], bf16=False, use_cpu=True, seed=seed, data_seed=seed,
                  max_length=100_000, gradient_checkpointing=False, dataloader_num_workers=0, disable_tqdm=True,
                  **keys)
    trainer = in_order(Trainer)(model=model, args=args, train_dataset=Dataset.from_list(ordered), processing_class=tokenizer)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
