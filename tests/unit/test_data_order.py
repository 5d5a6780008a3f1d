"""Order, sharding, position, epochs and validation batches of the data (``hybridtrain.data.sampler``,
``hybridtrain.plan.data``): pure CPU, no processes."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from helpers.config import compose
from helpers.data import save_samples
from hybridtrain.data.sampler import ArrowColumn, DataPosition, PackedSamples, RowSamples, open_samples
from hybridtrain.parallel.dims import BatchLayout
from hybridtrain.plan import PlanError, resolve
from hybridtrain.plan.data import check_data_counts
from hybridtrain.plan.types import Machine

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)]  # (dp, micro_batch_size) for a global batch of 8


def rows_store(n: int, seq: int = 3, seed: int = 5) -> RowSamples:
    """Rows whose first token is the row index, labels its negation (distinguishable)."""
    ids = np.arange(n)[:, None] * 100 + np.arange(seq)[None, :]
    return RowSamples(ids.astype(np.int32), (-ids).astype(np.int32), seed)


def gathered(stream, layout: BatchLayout, dp_rank: int, steps: int) -> list[torch.Tensor]:
    """``steps`` steps of one rank's micro-batches, as ``[accum, micro]`` first-token ids per step."""
    out = []
    for _ in range(steps):
        out.append(torch.stack([next(stream)[0][0][:, 0] for _ in range(layout.grad_accum)]))  # input_ids[:, 0]
    return out


def global_batches(samples, position: DataPosition, dp: int, micro: int, steps: int) -> list[list[int]]:
    """The global batches (first tokens, in ``[accum, dp, micro]`` order) after ``position`` under a layout."""
    layout = BatchLayout(8, micro, dp)
    per_rank = [gathered(samples.stream_from(position, layout, r), layout, r, steps) for r in range(dp)]
    return [torch.stack([per_rank[r][s] for r in range(dp)], dim=1).reshape(-1).tolist() for s in range(steps)]


def test_rows_store_same_global_batch_for_every_layout():
    samples = rows_store(20)
    want = [(samples.global_indices(s, 8) * 100).tolist() for s in range(6)]  # crosses 2 epochs
    for dp, micro in LAYOUTS:
        assert global_batches(samples, DataPosition(0, 5), dp, micro, 6) == want, (dp, micro)


@pytest.mark.parametrize("before, after", [((1, 1), (2, 1)), ((2, 2), (1, 1)), ((4, 1), (2, 2)), ((1, 4), (4, 1))])
def test_resuming_a_position_under_another_dp_gives_the_next_global_batch(before, after):
    samples = rows_store(21)
    uninterrupted = global_batches(samples, DataPosition(0, 5), *before, steps=7)
    position = DataPosition(0, 5).advanced(4 * 8)  # after 4 steps of 8 samples
    saved = json.loads(json.dumps(position.state_dict()))  # what a checkpoint stores
    assert saved == {"samples_seen": 32, "seed": 5}
    restored = DataPosition.from_state_dict(saved)
    assert restored.epoch_offset(samples.num_samples) == (1, 11)
    assert global_batches(samples, restored, *after, steps=3) == uninterrupted[4:]


def test_position_under_another_seed_is_refused():
    with pytest.raises(ValueError, match="trainer.seed"):
        next(rows_store(8).stream_from(DataPosition(8, seed=6), BatchLayout(8, 1, 1), 0))


def test_stream_from_a_position_equals_stream_from_a_step():
    samples = PackedSamples(np.arange(400), 4, seed=2)
    layout = BatchLayout(8, 2, 2)
    a = samples.stream(3, layout, 1)
    b = samples.stream_from(DataPosition(24, 2), layout, 1)
    for _ in range(10):
        ((xa, pa), ya), ((xb, pb), yb) = next(a), next(b)
        assert torch.equal(xa, xb) and torch.equal(pa, pb) and torch.equal(ya, yb)


class SpyArray:
    """Wraps an array and records every index a reader asks for."""

    def __init__(self, array):
        self.array, self.requests = array, []
        self.shape = array.shape

    def __getitem__(self, key):
        self.requests.append(key if isinstance(key, slice) else np.asarray(key).tolist())
        return self.array[key]


def test_a_rank_reads_only_its_rows(tmp_path):
    ids = np.arange(40 * 4, dtype=np.uint16).reshape(40, 4)
    samples = RowSamples(save_samples(tmp_path / "ds", "rows", ids, ids, num_shards=2), None, seed=1)
    for column in (samples.input_ids, samples.labels):  # views of the mapped Arrow files, not copies
        assert isinstance(column, ArrowColumn) and not any(v.flags.owndata for v in column.views)
    assert np.array_equal(samples.input_ids[np.arange(40)], ids)
    samples.input_ids, samples.labels = SpyArray(samples.input_ids), SpyArray(samples.labels)
    layout = BatchLayout(8, 2, 2)
    got = [x for (x, _), _ in samples.micro_batches(0, layout, dp_rank=1)]
    mine = layout.rank_rows(samples.global_indices(0, 8), 1)  # [accum, micro]
    assert samples.input_ids.requests == mine.tolist() == samples.labels.requests
    assert [g[:, 0].tolist() for g in got] == (mine * 4).tolist()
    assert got[0].dtype == torch.int64


def test_packed_store_reads_only_its_blocks(tmp_path):
    samples = PackedSamples(save_samples(tmp_path / "ds", "packed", [np.arange(101)]), 4, seed=1)
    assert isinstance(samples.tokens, ArrowColumn)
    spy = samples.tokens = SpyArray(samples.tokens)
    samples.rows(np.array([3, 7]))
    assert spy.requests == [slice(12, 17), slice(28, 33)]  # the two blocks of seq_len + 1 tokens, no more


def test_open_samples_memory_maps_both_kinds(tmp_path):
    save_samples(tmp_path / "train", "packed", [np.arange(50)])
    save_samples(tmp_path / "val", "rows", np.zeros((3, 4)), np.full((3, 4), -100))
    packed = {"dir": str(tmp_path), "kind": "packed", "seq_len": 7, "splits": {"train": {"dataset": "train"}}}
    rows = {"dir": str(tmp_path), "kind": "rows", "seq_len": 4, "splits": {"val": {"dataset": "val"}}}
    assert open_samples(packed, "train", 0).num_samples == 7 and open_samples(packed, "val", 0) is None
    (tmp_path / "data.json").write_text(json.dumps(rows))
    val = open_samples(tmp_path / "data.json", "val", 0)
    assert isinstance(val.labels, ArrowColumn) and val.rows(np.array([2]))[1].tolist() == [[-100] * 4]


def test_numpy_view_is_the_arrow_values_without_a_copy():
    import pyarrow as pa

    from hybridtrain.data.sampler import numpy_view

    lists = pa.array([[1, 2], [3], [], [4, 5, 6]], type=pa.list_(pa.uint16()))[1:]  # a slice: offset 1
    flat = numpy_view(lists.flatten())
    assert flat.tolist() == [3, 4, 5, 6] and flat.dtype == np.uint16 and not flat.flags.owndata
    assert np.diff(numpy_view(lists.offsets)).tolist() == [1, 0, 3]
    assert numpy_view(pa.array([7.5, 8.5], type=pa.float32())[1:]).tolist() == [8.5]
    with pytest.raises(ValueError, match="missing"):
        numpy_view(pa.array([1, None], type=pa.int32()))
    with pytest.raises(TypeError, match="numeric"):
        numpy_view(pa.array([True]))


def test_reading_a_saved_column_imports_no_pandas(tmp_path):
    """pyarrow's ``to_numpy`` imports pandas (CPU time in every rank): the ranks' reads must not."""
    import subprocess
    import sys

    save_samples(tmp_path / "ds", "rows", np.arange(12).reshape(3, 4), np.arange(12).reshape(3, 4))
    code = ("import sys; from hybridtrain.data.sampler import ArrowColumn; "
            f"c = ArrowColumn({str(tmp_path / 'ds')!r}, 'input_ids'); "
            "print(int(c[[2]][0, 3]), 'pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["11", "False"]


def test_validation_batches_are_fixed_unshuffled_and_drop_the_remainder():
    samples = rows_store(27, seed=9)
    want = [list(range(b * 8, b * 8 + 8)) for b in range(3)]  # 27 // 8 = 3 batches, 3 samples dropped
    for dp, micro in LAYOUTS:
        layout = BatchLayout(8, micro, dp)
        per_rank = [list(samples.eval_batches(layout, r)) for r in range(dp)]
        assert all(len(p) == 3 and all(len(b) == layout.grad_accum for b in p) for p in per_rank)
        got = []
        for b in range(3):
            stacked = torch.stack([torch.stack([x[:, 0] for (x, _), _ in per_rank[r][b]]) for r in range(dp)], dim=1)
            got.append((stacked.reshape(-1) // 100).tolist())  # [accum, dp, micro] -> global order
        assert got == want, (dp, micro)


# --- epochs and counts (hybridtrain.plan.data) ---------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    cfg = compose("+recipe=gpt_tiny")
    plan, _ = resolve(cfg, Machine())
    return cfg, plan


def test_max_steps_derived_from_epochs(tiny):
    cfg, plan = copy.deepcopy(tiny[0]), tiny[1]  # global batch 12, warmup 2
    assert check_data_counts(cfg, plan, 100, 0) == cfg.trainer.max_steps  # epochs unset: max_steps as given
    cfg.trainer.epochs = 2
    assert check_data_counts(cfg, plan, 100, 0) == 16  # floor(2 x 100 / 12)
    cfg.trainer.epochs = 0.5
    assert check_data_counts(cfg, plan, 100, 0) == 4


def test_epochs_too_few_for_the_warmup_or_a_step(tiny):
    cfg, plan = copy.deepcopy(tiny[0]), tiny[1]
    cfg.trainer.epochs = 0.1
    with pytest.raises(PlanError) as info:
        check_data_counts(cfg, plan, 100, 0)
    assert info.value.key == "trainer.epochs" and "raise trainer.epochs" in str(info.value)
    cfg.trainer.epochs = 0.3  # 2 steps: warmup 2 still fits
    assert check_data_counts(cfg, plan, 100, 0) == 2
    cfg.optim.warmup_steps = 3
    with pytest.raises(PlanError) as info:
        check_data_counts(cfg, plan, 100, 0)
    assert info.value.key == "optim.warmup_steps"


def test_validation_must_hold_one_global_batch(tiny):
    cfg, plan = copy.deepcopy(tiny[0]), tiny[1]
    cfg.data.val_fraction = 0.05
    with pytest.raises(PlanError) as info:
        check_data_counts(cfg, plan, 1000, 11)
    assert info.value.key == "data.val_fraction" and "11 samples" in str(info.value) and "global batch of 12" in str(info.value)
    check_data_counts(cfg, plan, 1000, 12)


def test_epoch_boundaries_are_crossed_inside_a_step():
    samples = rows_store(10)
    order = np.concatenate([samples.global_indices(s, 4) for s in range(5)])  # 20 samples = 2 epochs
    assert sorted(order[:10].tolist()) == sorted(order[10:].tolist()) == list(range(10))
    assert not np.array_equal(order[:10], order[10:])  # a new permutation per epoch
