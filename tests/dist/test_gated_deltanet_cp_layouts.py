"""Context parallelism on the Gated DeltaNet hybrids (issue 42.4) through the real command line: every (dp, cp, tp,
pp) layout gives the step losses and gradient norms of transformers + AdamW run in one process
(:func:`hybridtrain.reference.reference_run`, 1e-4 / 1e-3).

Qwen3.5 (``qwen3_5_text``) on packed prompt-completion records (``data.packing=documents``, 64-token rows, two per
micro-batch): at cp = 2 a row is cut in four chunks of 16 tokens and at cp = 4 in eight of 8, most records cross a
chunk boundary, so each Gated DeltaNet block passes the state of a record that spans ranks to the next rank in
sequence order and resets it at every record start; the oracle runs every record alone. CI runs (1, 2, 1, 1);
the slow tier cp = 2 with tp = 2, pp = 2, dp = 2 and all of them up to 8 ranks, cp = 4, activation checkpointing
(the blocks recomputed, their carries replayed), ZeRO-2, and whole rows of the embedded corpus. The MoE hybrids
(Qwen3.5-MoE, Qwen3-Next: experts, the shared expert and the router aux loss) run cp = 2 alone and with tp = 2 x
pp = 2 in the slow tier. The layer itself at cp = 2 and 4 is tested against the unsharded one in
``tests/dist/test_cp_gated_deltanet.py`` (CI)."""
from __future__ import annotations

import pytest

from helpers.config import compose
from helpers.data import skewed_prompt_completion, write_jsonl
from helpers.launch import metrics, run_cli
from helpers.moe import moe_overrides, twin_maker

STEPS = 3
SEQ = 64

LAYOUTS = {  # id -> ((dp, cp, tp, pp), extra overrides)
    "cp2": ((1, 2, 1, 1), ()),
    "cp2_tp2": ((1, 2, 2, 1), ()),
    "cp2_pp2": ((1, 2, 1, 2), ()),
    "dp2_cp2": ((2, 2, 1, 1), ()),
    "cp4": ((1, 4, 1, 1), ()),
    "cp2_tp2_pp2": ((1, 2, 2, 2), ()),
    "dp2_cp2_tp2": ((2, 2, 2, 1), ()),
    "dp2_cp2_pp2": ((2, 2, 1, 2), ()),
    "cp2_tp2_checkpointed": ((1, 2, 2, 1), ("parallel.activation_checkpointing=true",)),
    "dp2_cp2_zero2": ((2, 2, 1, 1), ("parallel.zero_stage=2",)),
}
CI = {"cp2"}
"""The layout CI runs (about a minute); the rest are slow-tier."""


def _axes(layout: tuple[int, int, int, int]) -> list[str]:
    return [f"parallel.{k}={v}" for k, v in zip(("dp", "cp", "tp", "pp"), layout)]


def _assert_matches(run_dir, oracle: list[dict], what: str) -> None:
    got = [m for m in metrics(run_dir) if "loss" in m]
    assert len(got) == len(oracle) == STEPS, what
    for g, w in zip(got, oracle):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4), f"{what} step {g['step']}: {g['loss']} vs {w['loss']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-3), f"{what} step {g['step']}"


@pytest.fixture(scope="module")
def packed(family_folders, tmp_path_factory):
    """The packed Qwen3.5 fine-tune's common overrides and its oracle (every record alone), made once."""
    from hybridtrain.data.prepare import train_samples
    from hybridtrain.data.sampler import DocumentSamples
    from hybridtrain.plan import apply_pretrained_defaults
    from hybridtrain.reference import reference_run

    d = tmp_path_factory.mktemp("gdn_cp")
    write_jsonl(d / "train.jsonl", skewed_prompt_completion(60, SEQ, seed=5))
    common = ["+recipe=finetune", f"model.pretrained={family_folders['qwen3_5_text']}", "data=files",
              f"data.path={d}/train.jsonl", f"data.cache_dir={d / 'cache'}", "data.format=prompt_completion",
              f"data.seq_len={SEQ}", f"trainer.max_steps={STEPS}", "parallel.micro_batch_size=2",
              "trainer.global_batch_size=4", "optim.lr=1e-3", "optim.warmup_steps=1", "trainer.save_final=false"]
    cfg = compose(*common)
    apply_pretrained_defaults(cfg)
    samples = train_samples(cfg.data, cfg.trainer.seed)
    assert isinstance(samples, DocumentSamples) and samples.fill > 0.9  # rows hold several records
    return common, reference_run(cfg)


@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if c in CI else [pytest.mark.slow]) for c in LAYOUTS])
def test_packed_qwen3_5_context_parallel_equals_transformers(case, packed, tmp_path):
    common, oracle = packed
    layout, extra = LAYOUTS[case]
    run_cli(tmp_path, *common, *_axes(layout), *extra)
    _assert_matches(tmp_path, oracle, f"qwen3_5_text {case}")


@pytest.mark.slow
def test_whole_rows_qwen3_5_context_parallel_equals_transformers(family_folders, tmp_path):
    """Rows of the embedded corpus, one stream each (no document starts: every chunk continues the one before)."""
    from hybridtrain.plan import apply_pretrained_defaults
    from hybridtrain.reference import reference_run

    common = ["+recipe=finetune", f"model.pretrained={family_folders['qwen3_5_text']}", "data.seq_len=32",
              "trainer.global_batch_size=8", f"trainer.max_steps={STEPS}", "optim.lr=1e-3", "optim.warmup_steps=1",
              "trainer.save_final=false"]
    cfg = compose(*common)
    apply_pretrained_defaults(cfg)
    run_cli(tmp_path, *common, *_axes((1, 2, 2, 1)))
    _assert_matches(tmp_path, reference_run(cfg), "qwen3_5_text whole rows cp2_tp2")


@pytest.fixture(scope="module")
def hybrid_twins(tmp_path_factory):
    return twin_maker(tmp_path_factory.mktemp("gdn_moe"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(1, 2, 1, 1), (1, 2, 2, 2)], ids=["cp2", "cp2_tp2_pp2"])
@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "qwen3_next"])
def test_moe_hybrid_context_parallel_equals_transformers(family, layout, hybrid_twins, tmp_path):
    """The MoE hybrids (router aux loss included) at cp = 2, and with tp = 2 x pp = 2."""
    from hybridtrain.plan import apply_pretrained_defaults
    from hybridtrain.reference import reference_run

    common = moe_overrides(hybrid_twins(family), STEPS, "trainer.save_final=false")
    cfg = compose(*common)
    apply_pretrained_defaults(cfg)
    run_cli(tmp_path, *common, *_axes(layout), timeout=600)
    _assert_matches(tmp_path, reference_run(cfg), f"{family} {layout}")
