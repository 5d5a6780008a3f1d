"""The mixture-of-experts benchmark's plumbing (``bench/bench_moe.py``, ``bench/a2a_timer.py``): the all-to-all
timer records every call and splits them into steps, the plan's expert bytes per rank halve at ep = 2 and match
transformers' model, and the section's table and ratios come out of the runs; the real four-side run is slow."""
from __future__ import annotations

import pytest


def test_a2a_timer_records_every_call_of_the_rank(tmp_path, monkeypatch):
    import torch.distributed as dist

    from bench.a2a_timer import install, read

    calls = []
    monkeypatch.setattr(dist, "all_to_all_single", lambda *a, **k: calls.append((a, k)) or "done")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    install(tmp_path)
    assert dist.all_to_all_single("out", "in", group="g") == "done"
    dist.all_to_all_single("out", "in")
    install(tmp_path)  # installing twice does not time twice
    dist.all_to_all_single("out", "in")
    assert len(calls) == 3 and calls[0] == (("out", "in"), {"group": "g"})
    got = read(tmp_path)
    assert list(got) == [1] and len(got[1]) == 3 and all(0 <= s < 1 for s in got[1])


def test_a2a_calls_split_into_steps():
    from bench.a2a_timer import per_step

    assert per_step([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 3) == [3.0, 7.0, 11.0]
    with pytest.raises(ValueError, match="do not split evenly into 4 steps"):
        per_step([1.0] * 6, 4)


def test_expert_bytes_per_rank_are_the_plan_and_the_model_count(tmp_path):
    from bench.bench_moe import SHAPE, expert_bytes, make_model

    counted = make_model(tmp_path / "moe")
    e = SHAPE
    assert counted == e["num_hidden_layers"] * e["num_experts"] * 3 * e["hidden_size"] * e["moe_intermediate_size"]
    one, total = expert_bytes(tmp_path / "moe", 2, 1)
    two, _ = expert_bytes(tmp_path / "moe", 2, 2)
    assert total == counted and one == 4 * counted and two * 2 == one  # fp32, E / ep experts a rank


def test_section_reports_ratios_and_shares():
    from bench.bench_moe import GLOBAL_BATCH, SEQ, section

    def runs(step_s: float, **extra) -> list[dict]:
        return [{"step_s": step_s, "steps_s": [step_s], "final_loss": 9.0, **extra} for _ in range(2)]

    res = {"ht": runs(0.5, model_state_mib=30.0), "hf": runs(0.6),
           "ep2": runs(0.4, model_state_mib=20.0, a2a_share=[0.1, 0.2]), "ep1": runs(0.5, model_state_mib=25.0,
                                                                                      a2a_share=[])}
    sec = section(res, {"ht": 8 << 20, "hf": 8 << 20, "ep2": 4 << 20, "ep1": 8 << 20}, steps=6, skip=2)
    assert sec["ratios"]["tokens_per_sec_hybridtrain_over_transformers"] == pytest.approx(1.2)
    assert sec["ratios"]["tokens_per_sec_ep2_over_ep1"] == pytest.approx(1.25)
    assert sec["ratios"]["expert_bytes_per_rank_ep2_over_ep1"] == 0.5 and sec["a2a_share_ep2"] == [0.1, 0.2]
    rows = {r[0]: r for r in sec["table"][1:]}
    assert rows["C: dp=2, ep=2"][1:3] == ["2", f"{SEQ * GLOBAL_BATCH / 0.4:,.0f}"]
    assert rows["C: dp=2, ep=2"][5:] == ["4.00", "20.0", "10.0%, 20.0%"]
    assert rows["D: dp=2, ep=1"][-1].startswith("0") and rows["B: transformers + AdamW"][6] == "-"
    assert "**1.200x** (target >= 1.0)" in sec["summary"]


@pytest.mark.slow
def test_bench_moe_runs_every_side(tmp_path):
    """One round of the five sides (real runs, about three minutes on two busy cores): every side trains, ep = 2 times
    its all-to-alls on both ranks, ep = 1 makes none, and both layouts reach the same loss."""
    from bench.bench_moe import compare
    from bench.common import alternate

    sec = compare(tmp_path, 1, True, {}, alternate)
    raw = sec["raw"]
    assert len(raw["ep2"][0]["a2a_share"]) == 2 and all(0 < s < 1 for s in raw["ep2"][0]["a2a_share"])
    assert raw["ep1"][0]["a2a_share"] == []
    assert raw["ep2"][0]["final_loss"] == pytest.approx(raw["ep1"][0]["final_loss"], rel=1e-4)
    assert raw["ht"][0]["final_loss"] == pytest.approx(raw["hf"][0]["final_loss"], rel=1e-4)
