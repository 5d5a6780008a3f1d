"""The single-process baselines of the overhead comparison, each run in a fresh process:

* ``plain``: transformers + ``torch.optim.AdamW`` (:func:`hybridtrain.reference.reference_run`);
* ``trainer``: the HF ``Trainer`` with its defaults (``adamw_torch_fused``, its data loader, its
  gradient accumulation and clipping), fed the same samples in the same order;
* ``plain_keep``: ``plain`` with the ``malloc`` setting of hybridtrain's CPU ranks
  (``launcher.keep_host_memory``, :mod:`hybridtrain.host_memory`), which separates what that setting
  gains from what hybridtrain's own code costs.

Both take the same config as the hybridtrain side (``hybridtrain.cli.compose`` of the same
overrides): same model and initial weights (:func:`hybridtrain.models.hf_model.reference_model`), same
global batch, micro-batch size, accumulation, threads and precision (fp32).

    python -m bench.baselines trainer|plain|plain_keep THREADS OVERRIDES_JSON    # prints "RECORDS [...]"

Each record is one optimizer step: ``step``, ``loss``, ``step_time_s`` (wall seconds of the step,
everything the loop does per step included).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from bench.common import ROOT


def run_baseline(kind: str, overrides: list[str], threads: int) -> list[dict]:
    """Run baseline ``kind`` in a fresh process with ``threads`` threads; its per-step records."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "bench.baselines", kind, str(threads), json.dumps(overrides)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or "RECORDS " not in proc.stdout:
        raise RuntimeError(f"{kind} baseline failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.split("RECORDS ", 1)[1])


def trainer_run(cfg) -> list[dict]:
    """``trainer.max_steps`` steps of the HF ``Trainer`` on ``cfg``'s model and samples."""
    import torch
    from torch.utils.data import Dataset, SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hybridtrain.data.prepare import train_samples
    from hybridtrain.models.hf_model import reference_model
    from hybridtrain.models.families import family_of
    from hybridtrain.plan import Machine, resolve

    plan, hf_config = resolve(cfg, Machine(cpu_cores=1))
    steps, gbs = cfg.trainer.max_steps, plan.global_batch_size
    torch.manual_seed(cfg.trainer.seed)
    model = reference_model(hf_config, family_of(cfg.model), cfg.trainer.seed)
    samples = train_samples(cfg.data, cfg.trainer.seed)

    class InOrder(Dataset):
        """hybridtrain's global batches of steps 0 .. steps-1, one sample per item, in order."""

        def __init__(self):
            self.order = [int(i) for s in range(steps) for i in samples.global_indices(s, gbs)]

        def __len__(self) -> int:
            return len(self.order)

        def __getitem__(self, k: int) -> dict:
            ids, labels = samples.rows([self.order[k]])
            labels = torch.from_numpy(labels[0])
            # labels are already shifted (labels[t] = token t+1): transformers' ``shift_labels``
            return {"input_ids": torch.from_numpy(ids[0]), "labels": labels, "shift_labels": labels}

    class InOrderTrainer(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.last, self.records = 0.0, []

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.records.append({"step": state.global_step, "step_time_s": now - self.last})
            self.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and self.records:
                self.records[-1]["loss"] = logs["loss"]

    o = cfg.optim
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=plan.micro_batch_size, gradient_accumulation_steps=plan.grad_accum,
            max_steps=steps, learning_rate=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0],
            adam_beta2=o.betas[1], adam_epsilon=o.eps, max_grad_norm=o.grad_clip, lr_scheduler_type="cosine",
            warmup_steps=o.warmup_steps, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
            seed=cfg.trainer.seed, disable_tqdm=True, dataloader_pin_memory=False,
            remove_unused_columns=False)  # keep ``shift_labels``, which the forward takes as a loss kwarg
        timer = StepTimes()
        InOrderTrainer(model=model, args=args, train_dataset=InOrder(), callbacks=[timer]).train()
    return timer.records


def main() -> None:
    kind, threads, overrides = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    import torch

    torch.set_num_threads(threads)
    from hybridtrain.cli import compose

    cfg = compose(overrides)
    if kind == "plain_keep":
        from hybridtrain.host_memory import keep_freed_memory

        if not keep_freed_memory():
            raise SystemExit("plain_keep needs glibc's mallopt")
        kind = "plain"
    if kind == "plain":
        from hybridtrain.reference import reference_run

        records = reference_run(cfg)
    elif kind == "trainer":
        records = trainer_run(cfg)
    else:
        raise SystemExit(f"unknown baseline {kind!r}: plain, plain_keep or trainer")
    print("RECORDS " + json.dumps(records), flush=True)


if __name__ == "__main__":
    main()
