"""``finetune.objective=cpo`` (CPO, SimPO) and ``orpo`` equal TRL 1.16's ``CPOTrainer`` and ``ORPOTrainer`` at
(1,1,1,1), and every layout equals (1,1,1,1); no reference pass runs.

Per step: the loss, TRL's metrics (``rewards/*``, ``logps/*``, ``nll_loss``, ORPO's ``log_odds_*``) and the
gradient norm, on the same tiny ``save_pretrained`` folder, records, order, batch, lr and seed (TRL with the
whole batch in one micro-batch). Tolerances as ``tests/dist/test_dpo.py``'s: 1e-4 relative (the rewards and
ORPO's log-odds 1e-4 relative or 1e-5 absolute: differences of fp32 sums), gradient norms 1e-4 against TRL,
1e-3 across layouts.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers.data import write_jsonl
from helpers.dpo import check_steps as steps_equal, make_adapter, pair_file
from helpers.launch import metrics, run_cli
from helpers.reference_free import METRICS, overrides, trl_run

STEPS, BATCH, LR, SEED = 3, 4, 1e-4, 5
CASES = {
    "cpo": ("cpo", {"beta": 0.1, "loss_type": "sigmoid", "cpo_alpha": 1.0, "label_smoothing": 0.1}),
    "simpo": ("cpo", {"beta": 2.0, "loss_type": "simpo", "cpo_alpha": 0.0, "simpo_gamma": 0.5}),
    "cpo_ipo": ("cpo", {"beta": 0.1, "loss_type": "ipo", "cpo_alpha": 0.5}),
    "cpo_hinge": ("cpo", {"beta": 0.1, "loss_type": "hinge", "cpo_alpha": 1.0}),
    "alphapo": ("cpo", {"beta": 2.0, "loss_type": "simpo", "cpo_alpha": 0.0, "alpha": 0.25}),
    "orpo": ("orpo", {"beta": 0.1}),
}
"""TRL's keys per case; SimPO is CPO with ``loss_type=simpo`` and no NLL (the paper's beta 2.0, gamma / beta 0.25)."""
CI = ("cpo", "simpo", "orpo")


def check_steps(ours: list[dict], theirs: list[dict], names: tuple[str, ...], grad_rel: float) -> None:
    """Every step's loss, metrics and gradient norm of two runs (the tolerances of the module)."""
    floors = {key: 1e-5 if key.startswith(("rewards/", "log_odds")) else 0.0 for key in names}
    steps_equal(ours, theirs, STEPS, grad_rel, floors)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> tuple[list[dict], Path]:
    return pair_file(tmp_path_factory.mktemp("pairs"))


def run(tmp: Path, case: str, folder: Path, pairs_file: Path, layout: tuple[int, int, int, int] = (1, 1, 1, 1),
        family: str = "gpt2", extra: tuple[str, ...] = (), seq_len: int = 128) -> list[dict]:
    """hybridtrain's per-step records of ``case`` under ``layout`` = (dp, tp, pp, cp)."""
    objective, keys = CASES[case]
    dp, tp, pp, cp = layout
    proc = run_cli(tmp / "run", f"model={family}", *overrides(folder, pairs_file, objective, keys, steps=STEPS,
                                                               batch=BATCH, lr=LR, seed=SEED, seq_len=seq_len),
                   f"data.cache_dir={tmp / 'cache'}", f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                   f"parallel.cp={cp}", *extra)
    assert "reference log-probabilities" not in proc.stdout  # reference-free: no pass, no cache
    assert not list((tmp / "cache").glob("data-*/reference-*.npy"))
    return metrics(tmp / "run")


def theirs(tmp: Path, case: str, folder: Path, records: list[dict], adapter: Path | None = None,
           chat_template: str | None = None) -> list[dict]:
    objective, keys = CASES[case]
    return trl_run(folder, records, tmp / "trl", objective, keys, steps=STEPS, batch=BATCH, lr=LR, seed=SEED,
                   adapter=adapter, chat_template=chat_template)


@pytest.fixture(scope="module")
def single(hf_checkpoints, pairs, tmp_path_factory) -> dict:
    """The (1,1,1,1) run of each CI case (GPT-2, full fine-tune), made once."""
    made: dict = {}

    def get(case: str) -> list[dict]:
        if case not in made:
            made[case] = run(tmp_path_factory.mktemp(case), case, hf_checkpoints["gpt2"], pairs[1])
        return made[case]
    return get


@pytest.mark.parametrize("objective", ["cpo", "orpo"])
def test_the_plan_shows_no_reference_pass(objective, tmp_path):
    """A dry run's plan report of a reference-free objective names no reference pass (a DPO plan may)."""
    proc = run_cli(tmp_path / "run", "+recipe=dpo", f"finetune.objective={objective}", "launcher.dry_run=true")
    assert "dry run: plan valid" in proc.stdout and "reference" not in (proc.stdout + proc.stderr).lower()


@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if c in CI else [pytest.mark.slow]) for c in CASES])
def test_full_finetune_equals_trl(case, single, hf_checkpoints, pairs, tmp_path):
    """CPO (sigmoid with label smoothing and the NLL term), SimPO (length-normalised, margin gamma, no NLL) and
    ORPO (NLL over the whole chosen sequence + beta x odds-ratio term) in CI; ipo, hinge and AlphaPO slow."""
    objective = CASES[case][0]
    ours = single(case) if case in CI else run(tmp_path, case, hf_checkpoints["gpt2"], pairs[1])
    check_steps(ours, theirs(tmp_path, case, hf_checkpoints["gpt2"], pairs[0]), METRICS[objective], grad_rel=1e-4)
    assert ours[-1]["loss"] != ours[0]["loss"]  # it trains


@pytest.mark.parametrize("case", [pytest.param("simpo", marks=[pytest.mark.slow]), "orpo"])  # CI time: orpo alone
def test_lora_equals_trl(case, hf_checkpoints, pairs, tmp_path):
    """LoRA on a frozen Llama from a peft adapter whose B is not 0 (TRL applies it, so equal log-probabilities also
    show hybridtrain loaded it)."""
    adapter = make_adapter(hf_checkpoints["llama"], tmp_path / "adapter")
    ours = run(tmp_path, case, hf_checkpoints["llama"], pairs[1], family="llama",
               extra=("finetune.method=lora", f"finetune.lora.init_from={adapter}"))
    check_steps(ours, theirs(tmp_path, case, hf_checkpoints["llama"], pairs[0], adapter), METRICS[CASES[case][0]],
                grad_rel=1e-4)


def _as_chat(records: list[dict]) -> list[dict]:
    """The text pairs as TRL's conversational form: a user turn, two assistant turns."""
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"].strip()}],
             "rejected": [{"role": "assistant", "content": r["rejected"].strip()}]} for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["cpo", "orpo"])
def test_chat_records_equal_trl(case, hf_checkpoints, pairs, tmp_path):
    """Message records, rendered by a chat template (the embedded one; the folder's tokenizer has none) as TRL's
    ``maybe_apply_chat_template`` renders them."""
    from hybridtrain.data.tokenizer import EMBEDDED_CHAT_TEMPLATE

    records = _as_chat(pairs[0])
    (tmp_path / "template.jinja").write_text(EMBEDDED_CHAT_TEMPLATE)
    ours = run(tmp_path, case, hf_checkpoints["gpt2"], write_jsonl(tmp_path / "chat.jsonl", records), seq_len=256,
               extra=(f"data.chat_template={tmp_path / 'template.jinja'}",))
    check_steps(ours, theirs(tmp_path, case, hf_checkpoints["gpt2"], records, chat_template=EMBEDDED_CHAT_TEMPLATE),
                METRICS[CASES[case][0]], grad_rel=1e-4)


LAYOUTS = [(1, 2, 2, 1), (2, 2, 1, 1), (2, 1, 1, 1), (1, 1, 1, 2), (1, 2, 1, 2), (2, 1, 2, 1), (1, 2, 2, 2)]
"""(dp, tp, pp, cp): tp2 x pp2 in CI for ORPO (SimPO's in the slow tier; the last stage's loss, the vocabulary-parallel
log-probabilities, the per-token means), the rest under ``slow``, cp among them (the sums and counts all-reduced
before the means)."""


def _layout_case(layout: tuple[int, int, int, int], case: str):
    ci = layout == (1, 2, 2, 1) and case == "orpo"  # CI time (docs/testing.md): SimPO's the same path, slow
    return pytest.param(layout, case, id="{}-dp{}_tp{}_pp{}_cp{}".format(case, *layout),
                        marks=[] if ci else [pytest.mark.slow])


@pytest.mark.parametrize("layout,case", [_layout_case(l, c) for l in LAYOUTS for c in ("simpo", "orpo", "cpo")])
def test_every_layout_equals_one_process(layout, case, single, hf_checkpoints, pairs, tmp_path):
    ours = run(tmp_path, case, hf_checkpoints["gpt2"], pairs[1], layout)
    check_steps(ours, single(case), METRICS[CASES[case][0]], grad_rel=1e-3)
