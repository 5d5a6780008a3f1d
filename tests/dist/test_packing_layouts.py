"""Packed records (``data.packing=documents``, the default for prompt-completion data) through the real
command line: under (2, 2, 2) and (1, 1, 2) the step losses equal the oracle's, which runs every record
of every packed row alone, unpadded, in plain transformers (``hybridtrain.reference``); the position
ids that carry the record boundaries cross the pipeline stages with the hidden states. ``loss_tokens``
counts the global batch's loss tokens, the model-state estimate holds, the export reproduces the
packed logits in transformers, and a packed run resumes exactly, under its own layout and another.
Every layout of {1, 2}^3 against the oracle is in the ``slow`` tier."""
from __future__ import annotations

import itertools

import pytest

from helpers.data import skewed_prompt_completion, write_jsonl
from hybridtrain.rundir import RunDir
from helpers.config import compose
from helpers.launch import metrics, run_cli

STEPS = 4
SEQ = 64


def _train(records: list[dict]) -> list[dict]:
    return [m for m in records if "loss" in m]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The data, the common overrides, and a run per CI layout (saving every 2 steps)."""
    d = tmp_path_factory.mktemp("packing")
    write_jsonl(d / "train.jsonl", skewed_prompt_completion(300, SEQ, seed=3))
    common = ["data=files", f"data.path={d}/train.jsonl", f"data.cache_dir={d / 'cache'}", "data.format=prompt_completion", f"data.seq_len={SEQ}",
              f"trainer.max_steps={STEPS}"]
    runs = {}
    for recipe, (dp, tp, pp) in (("llama_tiny", (2, 2, 2)), ("gpt_tiny", (1, 1, 2))):
        run_dir = d / f"{recipe}_{dp}{tp}{pp}"
        run_cli(run_dir, f"+recipe={recipe}", *common, f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                "trainer.save_every=2", "trainer.save_logits=true")
        runs[(recipe, (dp, tp, pp))] = run_dir
    return {"dir": d, "common": common, "runs": runs}


def _oracle(packed, recipe: str) -> tuple[list[dict], object]:
    """``reference_run`` of the same config (records alone) and the run's training samples."""
    from hybridtrain.data.prepare import train_samples
    from hybridtrain.reference import reference_run

    cfg = compose(f"+recipe={recipe}", *packed["common"])
    return reference_run(cfg), train_samples(cfg.data, cfg.trainer.seed)


def _assert_matches_oracle(run_dir, oracle: list[dict], what: str) -> None:
    got = _train(metrics(run_dir))
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for g, o in zip(got, oracle, strict=True):
        assert g["loss"] == pytest.approx(o["loss"], rel=1e-5), (what, g["step"], g["loss"], o["loss"])
        assert g["grad_norm"] == pytest.approx(o["grad_norm"], rel=1e-3), (what, g["step"])  # reduction order


@pytest.mark.parametrize("recipe,layout", [("llama_tiny", (2, 2, 2)), ("gpt_tiny", (1, 1, 2))],
                         ids=["llama_222", "gpt_112"])
def test_packed_layout_matches_records_run_alone(recipe, layout, packed):
    from hybridtrain.data.sampler import DocumentSamples
    from hybridtrain.plan.estimate import estimate_for_run

    run_dir = packed["runs"][(recipe, layout)]
    oracle, samples = _oracle(packed, recipe)
    assert isinstance(samples, DocumentSamples) and samples.fill > 0.9
    _assert_matches_oracle(run_dir, oracle, f"{recipe} {layout}")
    gbs = compose(f"+recipe={recipe}").trainer.global_batch_size
    for m in _train(metrics(run_dir)):  # the loss-carrying tokens of the step's global batch
        assert m["loss_tokens"] == samples.step_loss_tokens(m["step"] - 1, gbs) > gbs
        assert m["loss_tokens_per_sec"] == pytest.approx(m["loss_tokens"] / m["step_time_s"], rel=1e-9)
    est, measured = estimate_for_run(run_dir), metrics(run_dir)[-1]["model_state_bytes"]
    assert abs(est.model_state - measured["total"]) <= 0.10 * measured["total"], (est, measured)


def test_export_reproduces_packed_logits_in_transformers(packed):
    """The checkpoint's saved micro-batch is a packed one (position ids restart); transformers, given the
    same position ids, masks the records apart too and gives the logits hybridtrain computed."""
    from safetensors.torch import load_file

    from hybridtrain.export import check_logits, export

    checkpoint = RunDir(packed["runs"][("llama_tiny", (2, 2, 2))]).checkpoints / "step_2"
    saved = load_file(str(checkpoint / "logits.safetensors"))
    assert int((saved["position_ids"][:, 1:] == 0).sum()) > 0  # records restart inside the rows
    out = export(checkpoint, checkpoint.parent / "hf_step_2")
    diff, scale = check_logits(checkpoint, out)
    assert 0 < scale and diff <= 1e-5 * max(1.0, scale), (diff, scale)


@pytest.mark.parametrize("layout,rel", [pytest.param((1, 1, 2), 1e-6, id="same_layout"),
                                        pytest.param((2, 1, 1), 1e-5, id="dp2_pp1", marks=pytest.mark.slow)])  # slow: CI time
def test_packed_run_resumes_exactly(layout, rel, packed, tmp_path):
    """The rows are fixed by the records, seq_len and the seed, and the data position counts rows, so
    the (1, 1, 2) run resumed from step 2, under its own layout or under (2, 1, 1), trains steps 3
    and 4 on the same rows with the same losses."""
    dp, tp, pp = layout
    full = packed["runs"][("gpt_tiny", (1, 1, 2))]
    run_cli(tmp_path, "+recipe=gpt_tiny", *packed["common"], f"parallel.dp={dp}", f"parallel.tp={tp}",
            f"parallel.pp={pp}", f"trainer.resume={RunDir(full).checkpoints / 'step_2'}")
    resumed, want = _train(metrics(tmp_path)), _train(metrics(full))[2:]
    assert [m["step"] for m in resumed] == [3, 4]
    assert [m["loss_tokens"] for m in resumed] == [m["loss_tokens"] for m in want]  # the same rows
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in want], rel=rel, abs=0)


SLOW_LAYOUTS = [l for l in itertools.product((1, 2), repeat=3)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW_LAYOUTS, ids=lambda l: "dp{}_tp{}_pp{}".format(*l))
def test_every_layout_trains_packed_records_like_the_oracle(layout, packed, tmp_path):
    dp, tp, pp = layout
    run_cli(tmp_path, "+recipe=llama_tiny", *packed["common"], f"parallel.dp={dp}", f"parallel.tp={tp}",
            f"parallel.pp={pp}", "trainer.save_final=false")
    oracle, _ = _oracle(packed, "llama_tiny")
    _assert_matches_oracle(tmp_path, oracle, f"llama_tiny {layout}")


GATED_DELTANET = {"dp1_tp2_pp2": ((1, 2, 2), ()), "dp2_tp2_pp2": ((2, 2, 2), ()),
                  "dp1_tp2_pp2_checkpointed": ((1, 2, 2), ("parallel.activation_checkpointing=true",))}
"""Qwen3.5's packed layouts: (1, 2, 2) in CI; dp = 2 x tp = 2 x pp = 2 and activation checkpointing (the blocks'
per-document mixer recomputed) in the slow tier."""


@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if c == "dp1_tp2_pp2" else [pytest.mark.slow])
                                  for c in GATED_DELTANET])
def test_packed_gated_deltanet_layout_matches_records_run_alone(case, family_folders, tmp_path):
    """Qwen3.5: Gated DeltaNet blocks on both pipeline stages, split over tp = 2, take packed rows (two per
    micro-batch, documents of many lengths) and reset their recurrent state and conv window at every record, so the
    step losses and gradient norms are those of every record run alone in transformers."""
    from hybridtrain.data.prepare import train_samples
    from hybridtrain.data.sampler import DocumentSamples
    from hybridtrain.plan import apply_pretrained_defaults
    from hybridtrain.reference import reference_run

    (dp, tp, pp), extra = GATED_DELTANET[case]
    write_jsonl(tmp_path / "train.jsonl", skewed_prompt_completion(60, SEQ, seed=5))
    common = ["+recipe=finetune", f"model.pretrained={family_folders['qwen3_5_text']}", "data=files",
              f"data.path={tmp_path}/train.jsonl", f"data.cache_dir={tmp_path / 'cache'}", "data.format=prompt_completion",
              f"data.seq_len={SEQ}", f"trainer.max_steps={STEPS}", "parallel.micro_batch_size=2",
              "trainer.global_batch_size=4", "optim.warmup_steps=1"]
    run_cli(tmp_path / "run", *common, f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}", *extra)
    cfg = compose(*common)
    apply_pretrained_defaults(cfg)
    samples = train_samples(cfg.data, cfg.trainer.seed)
    assert isinstance(samples, DocumentSamples) and samples.fill > 0.9  # rows hold several records
    _assert_matches_oracle(tmp_path / "run", reference_run(cfg), f"qwen3_5_text {case}")
