"""The reward-model oracle: TRL 1.16's ``RewardTrainer`` on the same model folder, records, order, batch, lr and
seed as a hybridtrain run (``finetune.objective=reward``), and the overrides that make the two runs the same
training. TRL loads the folder with ``AutoModelForSequenceClassification(num_labels=1)`` after
``set_seed(seed)``, so its new ``score`` head is the one hybridtrain starts from (``hybridtrain.models.score``)."""
from __future__ import annotations

from pathlib import Path

from helpers.dpo import in_order, order

METRICS = ("accuracy", "margin", "mean_reward")
"""TRL's names, which hybridtrain's ``metrics.jsonl`` uses too."""


def overrides(folder: Path, pairs: Path, *, steps: int, batch: int, lr: float, seed: int,
              center: float | None = None, seq_len: int = 128, save: bool = False) -> list[str]:
    """A hybridtrain run that trains as :func:`trl_run` does: constant lr (no warmup, no decay), AdamW with
    TRL's betas 0.9/0.999 and no weight decay, gradients clipped to norm 1."""
    return [f"model.pretrained={folder}", "data=files", f"data.path={pairs}", "data.format=preference",
            f"data.seq_len={seq_len}", "finetune.objective=reward",
            *([f"finetune.reward.center_rewards_coefficient={center}"] if center is not None else []),
            f"trainer.global_batch_size={batch}", f"trainer.max_steps={steps}", f"trainer.seed={seed}",
            f"optim.lr={lr}", "optim.warmup_steps=0", "optim.min_lr_ratio=1.0", "optim.weight_decay=0.0",
            "optim.betas=[0.9,0.999]", "optim.grad_clip=1.0", f"trainer.save_final={str(save).lower()}"]


def trl_trainer(folder: Path, records: list[dict], out: Path, *, steps: int, batch: int, lr: float, seed: int,
                center: float | None = None):
    """TRL's ``RewardTrainer`` on ``records`` taken in :func:`~helpers.dpo.order` (its shuffling replaced by
    that order), one process, trained; its per-step log records are ``trainer.state.log_history``."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    ordered = [records[i] for i in order(len(records), steps, batch, seed)]
    args = RewardConfig(output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                        max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
                        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                        logging_steps=1, save_strategy="no", report_to=[], bf16=False, use_cpu=True, seed=seed,
                        data_seed=seed, center_rewards_coefficient=center, max_length=None,
                        dataloader_num_workers=0, disable_tqdm=True, model_init_kwargs={"dtype": "float32"})
    trainer = in_order(RewardTrainer)(model=str(folder), args=args, train_dataset=Dataset.from_list(ordered),
                                      processing_class=AutoTokenizer.from_pretrained(str(folder)))
    trainer.train()
    return trainer


def trl_steps(trainer) -> list[dict]:
    """The per-step log records (``loss``, ``grad_norm``, :data:`METRICS`) of a trained :func:`trl_trainer`."""
    return [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]


def scores(model, tokenizer, records: list[dict]):
    """``[len(records), 2]`` rewards of each record's chosen and rejected sequence (``prompt + completion`` +
    EOS, as TRL tokenizes text records) by ``model`` (a ``...ForSequenceClassification``), one padded batch."""
    import torch

    texts = []
    for which in ("chosen", "rejected"):
        for r in records:
            completion = r[which] if r[which].endswith(tokenizer.eos_token) else r[which] + tokenizer.eos_token
            texts.append(r["prompt"] + completion)
    ids = [tokenizer(text=t)["input_ids"] for t in texts]
    pad = model.config.pad_token_id
    width = max(len(i) for i in ids)
    input_ids = torch.tensor([i + [pad] * (width - len(i)) for i in ids])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=mask).logits.squeeze(-1)  # [2N]
    return torch.stack(out.chunk(2), dim=-1)
