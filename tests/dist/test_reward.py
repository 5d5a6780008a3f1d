"""``finetune.objective=reward`` equals TRL 1.16's ``RewardTrainer`` at (1,1,1,1), every layout equals (1,1,1,1), and
the export is a folder ``AutoModelForSequenceClassification`` loads with TRL's scores.

Per step: the loss, TRL's ``accuracy``, ``margin`` and ``mean_reward`` and the gradient norm, on the same tiny
``save_pretrained`` folder, records, order, batch, lr and seed (TRL's new ``score`` head is hybridtrain's: both
draw it from ``trainer.seed``, ``tests/unit/test_reward_model.py``). Tolerances: 1e-4 relative for the loss and the
gradient norm against TRL, 1e-3 for the gradient norm across layouts; the rewards are scores near 0.1, compared
to 1e-4 relative or 1e-6 absolute; the accuracy exactly.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.dpo import check_steps as steps_equal, close, pair_file
from helpers.launch import metrics, run_cli
from helpers.reward import METRICS, overrides, scores, trl_steps, trl_trainer
from hybridtrain.rundir import RunDir

STEPS, BATCH, LR, SEED, CENTER = 3, 4, 1e-4, 5, 0.1
KW = dict(steps=STEPS, batch=BATCH, lr=LR, seed=SEED, center=CENTER)


def check_steps(ours: list[dict], theirs: list[dict], grad_rel: float) -> None:
    """Every step's loss, metrics and gradient norm of two runs (the tolerances of the module)."""
    steps_equal(ours, theirs, STEPS, grad_rel, {key: None if key == "accuracy" else 1e-6 for key in METRICS})


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> tuple[list[dict], Path]:
    return pair_file(tmp_path_factory.mktemp("pairs"))


def run(tmp: Path, family: str, folder: Path, pairs_file: Path, layout: tuple[int, int, int, int] = (1, 1, 1, 1),
        extra: tuple[str, ...] = (), **kw) -> list[dict]:
    """hybridtrain's per-step records under ``layout`` = (dp, tp, pp, cp), in ``tmp / "run"``."""
    dp, tp, pp, cp = layout
    run_cli(tmp / "run", f"model={family}", *overrides(folder, pairs_file, **(kw or KW)),
            f"data.cache_dir={tmp / 'cache'}", f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
            f"parallel.cp={cp}", *extra)
    return metrics(tmp / "run")


@pytest.fixture(scope="module")
def single(hf_checkpoints, pairs, tmp_path_factory) -> tuple[list[dict], Path]:
    """The (1,1,1,1) run (Llama, full fine-tune, the centring term on) and its run folder (final checkpoint saved)."""
    tmp = tmp_path_factory.mktemp("single")
    return run(tmp, "llama", hf_checkpoints["llama"], pairs[1], save=True, **KW), tmp / "run"


@pytest.fixture(scope="module")
def trl(hf_checkpoints, pairs, tmp_path_factory):
    """TRL's ``RewardTrainer`` trained on the same records: its per-step records, its model and tokenizer."""
    trainer = trl_trainer(hf_checkpoints["llama"], pairs[0], tmp_path_factory.mktemp("trl"), **KW)
    return trl_steps(trainer), trainer.model.eval(), trainer.processing_class


def test_reward_model_equals_trl(single, trl):
    """Loss (Bradley-Terry plus the centring term), accuracy, margin, mean reward and gradient norm per step."""
    check_steps(single[0], trl[0], grad_rel=1e-4)
    assert single[0][-1]["loss"] != single[0][0]["loss"]  # it trains


def test_the_plans_model_state_is_the_reward_models(single, hf_checkpoints):
    """The plan sizes a reward model with its ``score`` head (``Linear(hidden, 1)``), not the LM head it replaces
    (8000 x 96 of this model's 1.1M parameters): the estimate is within 10% of what rank 0 measured (the LM
    head's was 70% over), and the MFU line counts the score's FLOPs."""
    from hybridtrain.plan.costs import model_facts
    from hybridtrain.plan.estimate import estimate_for_run
    from hybridtrain.plan.hf import model_config
    from hybridtrain.models.families import family_of
    from hybridtrain.rundir import RunDir

    records, run_dir = single
    measured = records[-1]["model_state_bytes"]["total"]
    est = estimate_for_run(run_dir)
    assert abs(est.model_state - measured) <= 0.10 * measured, (est, measured)
    cfg = RunDir(run_dir).config()
    hf = model_config(cfg)
    lm, score = (model_facts(family_of(cfg.model), hf, 32, score_head=s).total_params() for s in (False, True))
    assert lm - score == int(hf.vocab_size) * int(hf.hidden_size) - int(hf.hidden_size)  # untied: its own head
    import json

    from hybridtrain.plan.flops import model_flops_per_token

    observe = json.loads((run_dir / "observe.json").read_text())  # MFU's FLOPs per token: the score's, not logits'
    assert observe["model_flops_per_token"] == model_flops_per_token(family_of(cfg.model), hf,
                                                                     RunDir(run_dir).plan().seq_len, 1)


def test_export_loads_as_sequence_classifier_with_trls_scores(single, trl, pairs, tmp_path):
    """The final checkpoint's export is a ``LlamaForSequenceClassification`` folder (``num_labels=1``, the pad
    token that pools); its scores of every pair equal those of TRL's model after the same steps."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from hybridtrain.export import export

    out = export(RunDir(single[1]).checkpoints / f"step_{STEPS}", tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["pad_token_id"] == 0
    model = AutoModelForSequenceClassification.from_pretrained(str(out), dtype=torch.float32).eval()
    assert model.num_labels == 1
    theirs, ours = scores(trl[1], trl[2], pairs[0]), scores(model, trl[2], pairs[0])  # [16, 2]
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-6), (ours - theirs).abs().max()


LAYOUTS = [(1, 2, 2, 1), (2, 1, 1, 1), (1, 1, 1, 2), (2, 2, 1, 1), (2, 1, 2, 1), (1, 2, 1, 2), (2, 2, 2, 1),
           (1, 2, 2, 2), (2, 1, 2, 2)]
"""(dp, tp, pp, cp): tp2 x pp2 in CI (the head on the last stage, replicated over tp), the rest up to 8 ranks
under ``slow``."""


@pytest.mark.parametrize("layout", [pytest.param(l, id="dp{}_tp{}_pp{}_cp{}".format(*l),
                                                 marks=[] if l == (1, 2, 2, 1) else [pytest.mark.slow])
                                    for l in LAYOUTS])
def test_every_layout_equals_one_process(layout, single, hf_checkpoints, pairs, tmp_path):
    check_steps(run(tmp_path, "llama", hf_checkpoints["llama"], pairs[1], layout), single[0], grad_rel=1e-3)


@pytest.mark.slow
def test_tied_gpt2_equals_trl_and_under_pp2(hf_checkpoints, pairs, tmp_path):
    """GPT-2 ties its LM head to the embedding; a reward model has no LM head, so the embedding is not tied to
    the last stage: (1,1,1,1) equals TRL, dp2 x tp2 x pp2 equals (1,1,1,1)."""
    kw = dict(KW, center=None)
    one = run(tmp_path / "one", "gpt2", hf_checkpoints["gpt2"], pairs[1], **kw)
    check_steps(one, trl_steps(trl_trainer(hf_checkpoints["gpt2"], pairs[0], tmp_path / "trl", **kw)), grad_rel=1e-4)
    check_steps(run(tmp_path / "eight", "gpt2", hf_checkpoints["gpt2"], pairs[1], (2, 2, 2, 1), **kw), one,
                grad_rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_equal_one_process(stage, single, hf_checkpoints, pairs, tmp_path):
    """ZeRO partitions the optimizer (1), the gradients (2) and the parameters (3, the head's too) over dp = 2."""
    ours = run(tmp_path, "llama", hf_checkpoints["llama"], pairs[1], (2, 1, 1, 1), (f"parallel.zero_stage={stage}",))
    check_steps(ours, single[0], grad_rel=1e-3)


@pytest.mark.slow
def test_resume_under_another_layout_trains_the_same_steps(hf_checkpoints, pairs, tmp_path):
    """A checkpoint of step 2 at (1,1,1,1), resumed at tp = 2 (the head and its AdamW moments read back by HF
    name): steps 3 and 4 are the uninterrupted run's."""
    kw = dict(KW, steps=4)
    base = ("model=llama", *overrides(hf_checkpoints["llama"], pairs[1], **kw), f"data.cache_dir={tmp_path / 'cache'}")
    run_cli(tmp_path / "full", *base, "trainer.save_every=2")
    run_cli(tmp_path / "resumed", *base, "parallel.tp=2",
            f"trainer.resume={RunDir(tmp_path / 'full').checkpoints / 'step_2'}")
    full, resumed = metrics(tmp_path / "full"), metrics(tmp_path / "resumed")
    assert [m["step"] for m in resumed] == [3, 4]
    for a, b in zip(resumed, full[2:]):
        assert close(a["loss"], b["loss"], 1e-4) and close(a["grad_norm"], b["grad_norm"], 1e-3), (a, b)
        assert close(a["margin"], b["margin"], 1e-4, 1e-6), (a, b)
