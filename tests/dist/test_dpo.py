"""``finetune.objective=dpo`` equals TRL 1.16's ``DPOTrainer`` at (1,1,1,1), and every layout equals (1,1,1,1).

Per step: the loss, TRL's metrics (``rewards/*``, ``logps/*``) and the gradient norm, on the same tiny
``save_pretrained`` folder, records, order, batch, lr and seed, TRL with ``precompute_ref_log_probs=True``.
Tolerances: 1e-4 relative for the loss and the log-probabilities; the rewards are ``beta x`` differences of
log-probabilities near -100 summed in fp32 (about 1e-6 apart between two correct implementations), so they
get 1e-4 relative or 1e-5 absolute; gradient norms 1e-4 against TRL, 1e-3 across layouts.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers.dpo import METRICS, check_steps as steps_equal, make_adapter, overrides, pair_file, trl_run
from helpers.launch import metrics, run_cli

STEPS, BATCH, LR, SEED, BETA = 3, 4, 1e-4, 5, 0.1
ALL = ["sigmoid", "ipo", "hinge", "robust", "sigmoid_norm", "apo_zero", "sft"]
WEIGHTS = [1.0, 0.05, 1.0, 1.0, 1.0, 1.0, 0.1]  # each term of about the same size (ipo ~ (1 / 2 beta)^2, sft ~ 9)
SMOOTHING = 0.1  # robust's


def check_steps(ours: list[dict], theirs: list[dict], grad_rel: float) -> None:
    """Every step's loss, metrics and gradient norm of two runs (the tolerances of the module)."""
    steps_equal(ours, theirs, STEPS, grad_rel, {key: 1e-5 if key.startswith("rewards/") else 0.0 for key in METRICS})


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> tuple[list[dict], Path]:
    return pair_file(tmp_path_factory.mktemp("pairs"))


def _kw(loss_type=ALL, weights=WEIGHTS, smoothing=SMOOTHING) -> dict:
    return dict(steps=STEPS, batch=BATCH, lr=LR, seed=SEED, beta=BETA, loss_type=list(loss_type),
                loss_weights=list(weights) if weights else None, label_smoothing=smoothing)


def run(tmp: Path, family: str, folder: Path, pairs_file: Path, layout: tuple[int, int, int, int] = (1, 1, 1, 1),
        extra: tuple[str, ...] = (), **kw) -> list[dict]:
    """hybridtrain's per-step records under ``layout`` = (dp, tp, pp, cp); its own data and reference cache."""
    dp, tp, pp, cp = layout
    run_cli(tmp / "run", f"model={family}", *overrides(folder, pairs_file, **(kw or _kw())),
            f"data.cache_dir={tmp / 'cache'}", f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
            f"parallel.cp={cp}", *extra)
    return metrics(tmp / "run")


@pytest.fixture(scope="module")
def single(hf_checkpoints, pairs, tmp_path_factory) -> list[dict]:
    """The (1,1,1,1) run of every CI loss type at once (GPT-2, full fine-tune)."""
    return run(tmp_path_factory.mktemp("single"), "gpt2", hf_checkpoints["gpt2"], pairs[1])


def test_full_finetune_equals_trl(single, hf_checkpoints, pairs, tmp_path):
    """Seven of TRL's loss types summed with weights (each term wrong would move the loss past 1e-4)."""
    theirs = trl_run(hf_checkpoints["gpt2"], pairs[0], tmp_path / "trl", **_kw())
    check_steps(single, theirs, grad_rel=1e-4)
    assert single[-1]["loss"] != single[0]["loss"]  # it trains


def test_lora_equals_trl(hf_checkpoints, pairs, tmp_path):
    """LoRA on a frozen Llama from a peft adapter whose B is not 0 (so the adapter changes every log-probability):
    the reference is the initial policy on both sides (TRL's frozen ``ref`` copy of a pretrained adapter; a fresh
    one would start from peft's random A, which hybridtrain does not draw alike). TRL applies the adapter, so equal
    log-probabilities also show hybridtrain loaded it."""
    adapter = make_adapter(hf_checkpoints["llama"], tmp_path / "adapter")
    kw = _kw(["sigmoid"], None, 0.0)
    ours = run(tmp_path, "llama", hf_checkpoints["llama"], pairs[1],
               extra=("finetune.method=lora", f"finetune.lora.init_from={adapter}"), **kw)
    theirs = trl_run(hf_checkpoints["llama"], pairs[0], tmp_path / "trl", adapter=adapter, **kw)
    check_steps(ours, theirs, grad_rel=1e-4)


LAYOUTS = [(2, 2, 1, 1), (1, 2, 2, 1), (2, 1, 1, 1), (1, 1, 1, 2), (1, 2, 1, 2), (2, 1, 2, 1), (2, 2, 2, 1),
           (1, 2, 2, 2), (2, 1, 2, 2)]
"""(dp, tp, pp, cp): tp2 x pp2 in CI (the pipeline's last-stage loss, the reference pass through eval_batch,
the vocabulary-parallel log-probabilities), the rest up to 8 ranks under ``slow``."""


@pytest.mark.parametrize("layout", [pytest.param(l, id="dp{}_tp{}_pp{}_cp{}".format(*l),
                                                 marks=[] if l == (1, 2, 2, 1) else [pytest.mark.slow])
                                    for l in LAYOUTS])
def test_every_layout_equals_one_process(layout, single, hf_checkpoints, pairs, tmp_path):
    ours = run(tmp_path, "gpt2", hf_checkpoints["gpt2"], pairs[1], layout)
    check_steps(ours, single, grad_rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust", "sigmoid_norm", "apo_zero", "apo_down",
                                       "nca_pair", "bco_pair", "sppo_hard", "exo_pair", "discopop", "sft"])
def test_each_loss_type_equals_trl(loss_type, hf_checkpoints, pairs, tmp_path):
    kw = _kw([loss_type], None, 1e-3 if loss_type == "exo_pair" else SMOOTHING if loss_type == "robust" else 0.0)
    ours = run(tmp_path, "gpt2", hf_checkpoints["gpt2"], pairs[1], **kw)
    check_steps(ours, trl_run(hf_checkpoints["gpt2"], pairs[0], tmp_path / "trl", **kw), grad_rel=1e-4)


@pytest.mark.slow
def test_lora_under_tp2_pp2_equals_one_process(hf_checkpoints, pairs, tmp_path):
    adapter = make_adapter(hf_checkpoints["llama"], tmp_path / "adapter")
    extra = ("finetune.method=lora", f"finetune.lora.init_from={adapter}")
    kw = _kw(["sigmoid"], None, 0.0)
    one = run(tmp_path / "one", "llama", hf_checkpoints["llama"], pairs[1], extra=extra, **kw)
    check_steps(run(tmp_path / "four", "llama", hf_checkpoints["llama"], pairs[1], (1, 2, 2, 1), extra, **kw), one,
                grad_rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_equal_one_process(stage, single, hf_checkpoints, pairs, tmp_path):
    """ZeRO partitions the optimizer (1), the gradients (2) and the parameters (3) over dp = 2; ZeRO-3 also runs
    the reference pass with its parameters gathered layer by layer."""
    ours = run(tmp_path, "gpt2", hf_checkpoints["gpt2"], pairs[1], (2, 1, 1, 1), (f"parallel.zero_stage={stage}",))
    check_steps(ours, single, grad_rel=1e-3)


@pytest.mark.slow
def test_the_reference_is_cached_beside_the_data(single, hf_checkpoints, pairs, tmp_path):
    """A second run of the same model on the same data reads the reference of the first (under another layout
    too) and trains the same steps."""
    first = run(tmp_path, "gpt2", hf_checkpoints["gpt2"], pairs[1])
    cached = sorted((tmp_path / "cache").glob("data-*/reference-*.npy"))
    assert len(cached) == 1
    proc = run_cli(tmp_path / "again", "model=gpt2", *overrides(hf_checkpoints["gpt2"], pairs[1], **_kw()),
                   f"data.cache_dir={tmp_path / 'cache'}", "parallel.dp=2")
    assert f"reference log-probabilities read from {cached[0]}" in proc.stdout
    check_steps(metrics(tmp_path / "again"), first, grad_rel=1e-3)
    check_steps(first, single, grad_rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(1, 1, 1, 1), (2, 1, 2, 1)], ids=["one_process", "dp2_pp2_ep2"])
def test_an_moe_model_equals_trl(layout, pairs, tmp_path):
    """Qwen3-MoE (8 experts, top-2, routers with clear margins) without the router aux loss (packed pair rows
    refuse it; TRL's ``router_aux_loss_coef=0``): (1,1,1,1) equals TRL, dp2 x pp2 with the experts split over
    ep = 2 equals TRL too."""
    from helpers.moe import make_moe_checkpoint

    folder = make_moe_checkpoint(tmp_path / "moe", "qwen3_moe", output_router_logits=False)
    kw = _kw(["sigmoid"], None, 0.0)
    extra = ("parallel.ep=2",) if layout[0] > 1 else ()
    ours = run(tmp_path, "qwen3_moe", folder, pairs[1], layout, extra=extra, **kw)
    theirs = trl_run(folder, pairs[0], tmp_path / "trl", router_aux_loss_coef=0.0, **kw)
    check_steps(ours, theirs, grad_rel=1e-4 if layout == (1, 1, 1, 1) else 1e-3)
