"""The DPO oracle: TRL 1.16's ``DPOTrainer`` on the same model folder, records, order, batch, lr and seed as a
hybridtrain run (``finetune.objective=dpo``), and the overrides that make the two runs the same training."""
from __future__ import annotations

from pathlib import Path

from hybridtrain.data.sampler import Samples

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
"""TRL's names, which hybridtrain's ``metrics.jsonl`` uses too."""


def order(num_records: int, steps: int, batch: int, seed: int) -> list[int]:
    """The record indices hybridtrain's steps take, in order (the sampler's seeded permutation: a pair per row,
    a sample index is a record's index when nothing is skipped)."""
    return Samples(num_records, 1, seed).indices_at(0, steps * batch).tolist()


def close(got: float, want: float, rel: float, abs_: float = 0.0) -> bool:
    """``got`` within ``rel`` of ``want`` (relative), or within ``abs_``."""
    return abs(got - want) <= max(rel * abs(want), abs_)


def check_steps(ours: list[dict], theirs: list[dict], steps: int, grad_rel: float,
                floors: dict[str, float | None]) -> None:
    """Every step's loss (1e-4 relative), gradient norm (``grad_rel``) and metrics of two runs: ``floors`` maps
    each metric to its absolute floor beside 1e-4 relative, ``None`` for a metric that must be equal (a count)."""
    assert len(ours) == len(theirs) == steps
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        assert close(a["loss"], b["loss"], 1e-4), (step, "loss", a["loss"], b["loss"])
        assert close(a["grad_norm"], b["grad_norm"], grad_rel), (step, "grad_norm", a["grad_norm"], b["grad_norm"])
        for key, floor in floors.items():
            ok = a[key] == b[key] if floor is None else close(a[key], b[key], 1e-4, floor)
            assert ok, (step, key, a[key], b[key])


def pair_file(folder: Path) -> tuple[list[dict], Path]:
    """The preference tests' 16 pairs and their JSONL file in ``folder``."""
    from hybridtrain.data.embedded import preference_pairs

    from helpers.data import write_jsonl

    records = preference_pairs(16, seed=3)
    return records, write_jsonl(folder / "pairs.jsonl", records)


def in_order(trainer: type) -> type:
    """``trainer`` (a TRL trainer class) taking its dataset in order, so that :func:`order` decides the batches."""
    from torch.utils.data import SequentialSampler

    class InOrder(trainer):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    return InOrder


def policy(folder: Path, adapter: Path | None = None):
    """The fp32 model of ``folder`` for a TRL trainer; with ``adapter``, that peft adapter on it, trainable."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    return model


def overrides(folder: Path, pairs: Path, *, steps: int, batch: int, lr: float, seed: int, beta: float,
              loss_type: list[str], loss_weights: list[float] | None = None, label_smoothing: float = 0.0,
              seq_len: int = 128) -> list[str]:
    """A hybridtrain run that trains as :func:`trl_run` does: constant lr (no warmup, no decay), AdamW with
    TRL's betas 0.9/0.999 and no weight decay, gradients clipped to norm 1."""
    return [f"model.pretrained={folder}", "data=files", f"data.path={pairs}", "data.format=preference",
            f"data.seq_len={seq_len}", "finetune.objective=dpo", f"finetune.dpo.beta={beta}",
            f"finetune.dpo.loss_type=[{','.join(loss_type)}]",
            *([f"finetune.dpo.loss_weights=[{','.join(map(str, loss_weights))}]"] if loss_weights else []),
            f"finetune.dpo.label_smoothing={label_smoothing}", f"trainer.global_batch_size={batch}",
            f"trainer.max_steps={steps}", f"trainer.seed={seed}", f"optim.lr={lr}", "optim.warmup_steps=0",
            "optim.min_lr_ratio=1.0", "optim.weight_decay=0.0", "optim.betas=[0.9,0.999]", "optim.grad_clip=1.0",
            "trainer.save_final=false"]


def trl_run(folder: Path, records: list[dict], out: Path, *, steps: int, batch: int, lr: float, seed: int,
            beta: float, loss_type: list[str], loss_weights: list[float] | None = None, label_smoothing: float = 0.0,
            adapter: Path | None = None, callbacks: list | None = None, **config) -> list[dict]:
    """TRL's per-step log records (``loss``, ``grad_norm`` and :data:`METRICS`) of ``DPOTrainer`` on ``records``
    taken in :func:`order` (TRL's shuffling replaced by that order), one process, ``precompute_ref_log_probs=True``;
    with ``adapter`` a peft adapter folder trained on the frozen base (the reference: adapters disabled); ``config``:
    more ``DPOConfig`` fields; ``callbacks``: the trainer's (``transformers.TrainerCallback``)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    ordered = [records[i] for i in order(len(records), steps, batch, seed)]
    model = policy(folder, adapter)
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                     max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
                     weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                     logging_steps=1, save_strategy="no", report_to=[], bf16=False, use_cpu=True, seed=seed,
                     data_seed=seed, precompute_ref_log_probs=True, beta=beta, loss_type=list(loss_type),
                     loss_weights=loss_weights, label_smoothing=label_smoothing, max_length=None,
                     dataloader_num_workers=0, disable_tqdm=True, **config)
    trainer = in_order(DPOTrainer)(model=model, args=args, train_dataset=Dataset.from_list(ordered),
                                   processing_class=AutoTokenizer.from_pretrained(str(folder)), callbacks=callbacks)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]


def make_adapter(folder: Path, out: Path, seed: int = 11) -> Path:
    """A peft LoRA adapter (r 4, alpha 8, every linear layer of the blocks) for the model in ``folder``, its
    ``B`` matrices random (peft starts them at 0): the policy then differs from the base model, the
    reference, from the first step on."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(out))
    return out
