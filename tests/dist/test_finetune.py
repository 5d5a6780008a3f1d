"""Fine-tuning a local HF model: the first-step loss equals transformers' own at every plan."""
from __future__ import annotations

import pytest

from helpers.finetune import hf_loss
from helpers.config import compose
from helpers.launch import metrics, run_cli

STEPS = 2


def _first_batch(overrides: list[str]):
    from hybridtrain.data.prepare import train_samples
    from hybridtrain.plan import apply_pretrained_defaults

    cfg = compose(*overrides)
    apply_pretrained_defaults(cfg)
    samples = train_samples(cfg.data, cfg.trainer.seed)
    return samples.rows(samples.global_indices(0, cfg.trainer.global_batch_size))


CASES = [("llama", (1, 1, 1)), ("llama", (2, 2, 2)), ("gpt2", (1, 1, 1)), ("gpt2", (1, 2, 2))]


@pytest.mark.parametrize("family,layout", [  # (1,1,1) from a pretrained folder: every family's logits in tests/unit
    pytest.param(f, l, id=f"{f}_dp{l[0]}_tp{l[1]}_pp{l[2]}", marks=[pytest.mark.slow] if l == (1, 1, 1) else [])
    for f, l in CASES])
def test_first_step_loss_equals_transformers(family, layout, hf_checkpoints, tmp_path):
    dp, tp, pp = layout
    overrides = [f"model={family}", f"model.pretrained={hf_checkpoints[family]}", "data.seq_len=32",
                 "trainer.global_batch_size=4", f"trainer.max_steps={STEPS}", "optim.warmup_steps=1"]
    run_cli(tmp_path, *overrides, f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}")
    got = metrics(tmp_path)
    want = hf_loss(hf_checkpoints[family], *_first_batch(overrides))
    assert got[0]["loss"] == pytest.approx(want, rel=1e-5)
    assert got[1]["loss"] < got[0]["loss"] + 1.0  # trains on
