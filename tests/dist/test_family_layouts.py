"""Every model family trains under 3D parallelism exactly like plain transformers.

Each family's tiny ``save_pretrained`` checkpoint (``tests/helpers/families.py``) is fine-tuned through
the real CLI (``+recipe=finetune model.pretrained=DIR``: the family comes from the folder) and
compared step by step with the one-process oracle (transformers' ``from_pretrained`` of the same
folder + torch AdamW, :func:`hybridtrain.reference.reference_run`): losses within 1e-4, gradient
norms within 1e-3 (fp32 reduction order). The run's checkpoint exports to an HF folder whose
transformers logits equal hybridtrain's element by element (``trainer.save_logits``, 1e-5), and the
plan's model-state estimate is within 10% of what rank 0 measured.

CI runs one multi-process layout per family (chosen so the families together cover tp, pp and dp);
the ``slow`` tier runs (1,2,2), (2,1,2), (2,2,1) and tp=4 for every family, the 8-rank (2,2,2) and (2,1,4) for
SmolLM3, OLMo 3 and Gemma 3, cp = 2 x tp = 2 for every family that takes cp, and resumes three families (Gemma 3
among them) under another layout.
"""
from __future__ import annotations

import pytest

from helpers.families import SEQ
from helpers.config import compose
from helpers.launch import metrics, run_cli

STEPS = 3
CI_LAYOUT = {  # (dp, tp, pp): every family splits heads; pipelines and replicas spread over them
    "mistral": (1, 2, 2), "qwen2": (2, 2, 1), "qwen3": (1, 2, 2), "gemma": (2, 1, 2), "gemma2": (1, 2, 2),
    "phi3": (1, 2, 2), "olmo2": (1, 2, 2), "gpt_neox": (2, 2, 1), "qwen3_5_text": (1, 2, 2),
    "smollm3": (2, 2, 1), "olmo3": (1, 2, 2), "gemma3_text": (1, 2, 2),
}
NEW = sorted(CI_LAYOUT)
"""The families added beside GPT-2 and Llama (those two run the full parity suite, test_parity.py)."""
CI_FAMILIES = {"gemma2", "phi3", "gpt_neox", "qwen3_5_text", "smollm3", "olmo3", "gemma3_text"}
"""Run through the CLI in CI: soft-capping with sliding windows and eager attention, fused projections,
a parallel residual, Gated DeltaNet blocks beside gated full attention, NoPE layers (SmolLM3), a rotary table per
layer type on both sides of a pipeline boundary (OLMo 3's sharded q/k norms, Gemma 3's 5:1 sliding and global
blocks). The other five run in the slow tier; in CI every family still has its
(1,1,1) logits against transformers (tests/unit/test_family_logits.py), its packed rows
(tests/unit/test_packing.py) and its block at tp = 2 and 3 (tests/dist/test_tp_layers.py)."""
SLOW_LAYOUTS = [(1, 2, 2), (2, 1, 2), (2, 2, 1), (1, 4, 1)]
EIGHT_RANKS = ["smollm3", "olmo3", "gemma3_text"]
"""Families whose slow tier also runs the 8-rank layouts (:data:`EIGHT_RANK_LAYOUTS`, issue 44)."""
EIGHT_RANK_LAYOUTS = [(2, 2, 2), (2, 1, 4)]


def _common(folder) -> list[str]:
    return ["+recipe=finetune", f"model.pretrained={folder}", f"data.seq_len={SEQ}", "trainer.global_batch_size=8",
            f"trainer.max_steps={STEPS}", "optim.lr=1e-3", "optim.warmup_steps=1"]


@pytest.fixture(scope="module")
def oracle(family_folders):
    """The one-process transformers + AdamW records of each family, computed once."""
    from hybridtrain.plan import apply_pretrained_defaults
    from hybridtrain.reference import reference_run

    cache: dict[str, list[dict]] = {}

    def get(family: str) -> list[dict]:
        if family not in cache:
            cfg = compose(*_common(family_folders[family]))
            apply_pretrained_defaults(cfg)
            cache[family] = reference_run(cfg)
        return cache[family]

    return get


def _check_run(family: str, layout: tuple[int, int, int], family_folders, oracle, run_dir, *extra: str) -> None:
    from hybridtrain.export import check_logits, export
    from hybridtrain.plan.estimate import estimate_for_run

    dp, tp, pp = layout
    run_cli(run_dir, *_common(family_folders[family]), f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
            f"trainer.save_every={STEPS - 1}", "trainer.save_logits=true", *extra)
    got, want = metrics(run_dir), oracle(family)
    assert len(got) == len(want) == STEPS
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4), f"{family} {layout} step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-3), f"{family} {layout} step {g['step']}"
    checkpoint = run_dir / "checkpoints" / f"step_{STEPS - 1}"
    export(checkpoint, run_dir / "hf_export")
    diff, scale = check_logits(checkpoint, run_dir / "hf_export")
    assert 0 < scale and diff <= 1e-5 * max(1.0, scale), f"{family} {layout}: export logits differ by {diff}"
    measured = got[0]["model_state_bytes"]["total"]
    estimated = estimate_for_run(run_dir, stage=0).model_state
    assert abs(estimated - measured) <= 0.1 * measured, f"{family}: estimate {estimated} vs measured {measured}"


@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f in CI_FAMILIES else [pytest.mark.slow]) for f in NEW])
def test_family_layout_equals_transformers(family, family_folders, oracle, tmp_path):
    _check_run(family, CI_LAYOUT[family], family_folders, oracle, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW_LAYOUTS, ids=lambda l: "dp{}_tp{}_pp{}".format(*l))
@pytest.mark.parametrize("family", NEW)
def test_every_layout_equals_transformers(family, layout, family_folders, oracle, tmp_path):
    _check_run(family, layout, family_folders, oracle, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("layout", EIGHT_RANK_LAYOUTS, ids=lambda l: "dp{}_tp{}_pp{}".format(*l))
@pytest.mark.parametrize("family", EIGHT_RANKS)
def test_eight_rank_layouts_equal_transformers(family, layout, family_folders, oracle, tmp_path):
    _check_run(family, layout, family_folders, oracle, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family,before,after", [("qwen2", (1, 2, 2), (2, 1, 1)), ("phi3", (2, 1, 2), (1, 2, 1)),
                                                ("gemma3_text", (1, 2, 2), (2, 1, 1))],
                         ids=["qwen2", "phi3", "gemma3_text"])
def test_resume_under_another_layout_continues_the_losses(family, before, after, family_folders, oracle, tmp_path):
    """Steps 1-2 under one layout, a checkpoint, steps 3-4 under another: the oracle's four losses."""
    common = [*_common(family_folders[family]), "trainer.max_steps=4"]
    first = tmp_path / "first"
    run_cli(first, *common, *(f"parallel.{k}={v}" for k, v in zip(("dp", "tp", "pp"), before)),
            "trainer.save_every=2")
    resumed = tmp_path / "resumed"
    run_cli(resumed, *common, *(f"parallel.{k}={v}" for k, v in zip(("dp", "tp", "pp"), after)),
            f"trainer.resume={first / 'checkpoints' / 'step_2'}")
    from hybridtrain.plan import apply_pretrained_defaults
    from hybridtrain.reference import reference_run

    cfg = compose(*common)
    apply_pretrained_defaults(cfg)
    want = [r["loss"] for r in reference_run(cfg)]
    got = [m["loss"] for m in metrics(first)][:2] + [m["loss"] for m in metrics(resumed)]
    assert got == pytest.approx(want, rel=1e-4)


CP_CI = {"gemma2"}
"""Context parallelism in CI: Gemma 2 (eager soft-capped attention alternating sliding and full layers, the
embedding scale, the logit soft-cap); every other family in the slow tier."""


@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f in CP_CI else [pytest.mark.slow])
                                    for f in NEW])
def test_family_context_parallel_equals_transformers(family, family_folders, oracle, tmp_path):
    """cp = 2 x tp = 2 (issue 31.1): each rank's chunks of every row, the attention over the gathered keys and
    values (Qwen3.5's Gated DeltaNet blocks pass their state between the cp ranks, issue 42.4); transformers'
    losses and gradient norms, and the export's logits gathered over cp and tp."""
    _check_run(family, (1, 2, 1), family_folders, oracle, tmp_path, "parallel.cp=2")
