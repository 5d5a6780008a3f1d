"""The per-step expert-load watch of an expert-parallel run (``hybridtrain.train.expert_load``, GPU review 3,
finding 11 b), on the peaks the dispatch keeps (``ExpertDispatch.peak_load``, checked on real dispatches in
``tests/dist/test_moe_experts.py``); without a process group the world's max is this process's."""
from __future__ import annotations

from hybridtrain.parallel.experts import ExpertDispatch
from hybridtrain.train.expert_load import EXPERT_LOAD_METRIC, ExpertLoad


def _dispatch(peak: float) -> ExpertDispatch:
    d = ExpertDispatch.__new__(ExpertDispatch)
    d.peak_load = peak
    return d


def test_the_peak_between_log_steps_is_logged_and_said_once_above_the_margin():
    said: list[str] = []
    layers = [_dispatch(0.0), _dispatch(0.0)]
    load = ExpertLoad(layers, margin=1.25, say=lambda text, **_: said.append(text))
    layers[0].peak_load, layers[1].peak_load = 1.1, 0.9
    assert load.step(1, "cpu", log_now=False) == {}  # kept, not reduced
    layers[1].peak_load = 1.2
    assert load.step(2, "cpu", log_now=True) == {EXPERT_LOAD_METRIC: 1.2}  # the max of both steps and layers
    assert not said and all(d.peak_load == 0.0 for d in layers)  # taken
    layers[0].peak_load = 2.5
    assert load.step(3, "cpu", log_now=True) == {EXPERT_LOAD_METRIC: 2.5}
    assert len(said) == 1 and "at step 3 a rank's experts ran 2.50 times" in said[0] and "2.00 times the plan's" in said[0]
    layers[0].peak_load = 3.0
    assert load.step(4, "cpu", log_now=True) == {EXPERT_LOAD_METRIC: 3.0} and len(said) == 1  # said once
    assert load.step(5, "cpu", log_now=True) == {EXPERT_LOAD_METRIC: 0.0}  # reset after each log step


def test_a_run_without_expert_parallelism_has_no_watch():
    assert ExpertLoad.of(built=None, ep=1, is_rank0=True) is None
