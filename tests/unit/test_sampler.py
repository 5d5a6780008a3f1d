"""Sample order (``hybridtrain.data.sampler``) is a function of (seed, step) only: every batch
layout sees the same global batch; plus the embedded corpus' token cache."""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

import hybridtrain.data.embedded as embedded
import hybridtrain.data.prepare as prepare
from hybridtrain.config import DataConfig
from hybridtrain.data.sampler import ArrowColumn, PackedSamples
from hybridtrain.parallel.dims import BatchLayout
from hybridtrain.data.tokenizer import load_tokenizer, tokenizer_source

SEQ = 4
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]  # (dp, micro_batch_size)


def synthetic(num_samples: int, seq_len: int = SEQ, seed: int = 7) -> PackedSamples:
    """Samples over ``np.arange``: a token's value is its position, so every row can be checked."""
    return PackedSamples(np.arange(num_samples * seq_len + 1, dtype=np.int64), seq_len, seed)


def global_batch(samples: PackedSamples, step: int, layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Reassemble every data-parallel rank's micro-batches of ``step`` as ``[global_batch, seq]``."""
    inputs, labels = [], []
    for rank in range(layout.dp):
        micro = list(samples.micro_batches(step, layout, rank))
        assert len(micro) == layout.grad_accum
        for (x, pos), y in micro:
            assert x.shape == pos.shape == y.shape == (layout.micro_batch_size, samples.seq_len)
            assert x.dtype == pos.dtype == y.dtype == torch.int64
            assert torch.equal(pos, torch.arange(samples.seq_len).expand_as(pos))  # one sequence per row
        inputs.append(torch.stack([x for (x, _), _ in micro]))  # [accum, micro, seq]
        labels.append(torch.stack([y for _, y in micro]))
    # [dp, accum, micro, seq] -> [accum, dp, micro, seq] -> [global, seq]
    def to_global(parts):
        return torch.stack(parts).transpose(0, 1).reshape(layout.global_batch_size, samples.seq_len)
    return to_global(inputs), to_global(labels)


def test_grad_accum():
    assert [BatchLayout(8, micro, dp).grad_accum for dp, micro in LAYOUTS] == [8, 4, 4, 2, 2]


def test_every_layout_sees_the_same_global_batch():
    samples = synthetic(num_samples=20)  # 8 per step: step 2 crosses into the second epoch
    for step in range(6):
        idx = samples.global_indices(step, 8)
        expected_inputs, expected_labels = (torch.from_numpy(a) for a in samples.rows(idx))
        for dp, micro in LAYOUTS:
            inputs, labels = global_batch(samples, step, BatchLayout(8, micro, dp))
            assert torch.equal(inputs, expected_inputs), (step, dp, micro)
            assert torch.equal(labels, expected_labels), (step, dp, micro)


def test_data_parallel_ranks_take_disjoint_samples():
    samples = synthetic(num_samples=40)
    layout = BatchLayout(8, 1, 4)
    starts = [set(x[:, 0].tolist()) for rank in range(4) for (x, _), _ in samples.micro_batches(0, layout, rank)]
    assert len(set().union(*starts)) == 8  # 4 ranks x 2 micro-batches x 1 sample, all different


def test_rows_are_contiguous_and_labels_shift_by_one():
    samples = synthetic(num_samples=12)
    idx = samples.global_indices(0, 12)
    inputs, labels = samples.rows(idx)
    assert inputs.shape == labels.shape == (12, SEQ)
    for row, i in zip(inputs, idx):
        assert row.tolist() == list(range(i * SEQ, i * SEQ + SEQ))  # block i of the token stream
    assert np.array_equal(labels[:, :-1], inputs[:, 1:])
    assert np.array_equal(labels, inputs + 1)  # the next token, also past the block's end


def test_samples_overlap_by_one_token_and_cover_the_stream():
    samples = PackedSamples(np.arange(43), 4, seed=0)
    assert samples.num_samples == 10  # (43 - 1) // 4; the last 2 tokens cannot form a full sample
    inputs, labels = samples.rows(np.array([9]))
    assert inputs.tolist() == [[36, 37, 38, 39]] and labels.tolist() == [[37, 38, 39, 40]]


def test_epochs_wrap_with_a_new_permutation():
    samples = synthetic(num_samples=10)
    order = np.concatenate([samples.global_indices(step, 4) for step in range(10)])  # 40 = 4 epochs
    epochs = order.reshape(4, 10)
    for epoch in epochs:  # every sample exactly once per epoch
        assert sorted(epoch.tolist()) == list(range(10))
    assert len({tuple(e) for e in epochs}) == 4  # each epoch reshuffled
    assert not np.array_equal(epochs[0], np.arange(10))  # shuffled at all
    # step 2 reads positions 8..11: the end of epoch 0 then the start of epoch 1
    assert samples.global_indices(2, 4).tolist() == [*epochs[0][8:], *epochs[1][:2]]


def test_order_is_a_function_of_seed_and_step():
    a, b, other = synthetic(50, seed=3), synthetic(50, seed=3), synthetic(50, seed=4)
    steps = [0, 5, 1, 13, 2]  # out of order, across epochs: no hidden iteration state
    first = [a.global_indices(s, 8).tolist() for s in steps]
    assert first == [b.global_indices(s, 8).tolist() for s in reversed(steps)][::-1]
    assert first == [a.global_indices(s, 8).tolist() for s in steps]
    assert first != [other.global_indices(s, 8).tolist() for s in steps]


def test_stream_resumes_at_any_step():
    samples = synthetic(num_samples=30)
    layout = BatchLayout(12, 2, 2)  # 3 micro-batches per step and rank
    stream = samples.stream(4, layout, dp_rank=1)
    got = [next(stream) for _ in range(2 * layout.grad_accum)]
    expected = list(samples.micro_batches(4, layout, 1)) + list(samples.micro_batches(5, layout, 1))
    for ((x, pos), y), ((ex, epos), ey) in zip(got, expected, strict=True):
        assert torch.equal(x, ex) and torch.equal(pos, epos) and torch.equal(y, ey)


def test_memory_mapped_file_gives_the_same_samples(tmp_path):
    from helpers.data import save_samples

    tokens = np.arange(81, dtype=np.uint16)
    documents = [tokens[:10], tokens[10:11], tokens[11:50], tokens[50:]]  # blocks span documents and files
    from_file = PackedSamples(save_samples(tmp_path / "ds", "packed", documents, num_shards=3), 8, seed=1)
    in_memory = PackedSamples(tokens, 8, seed=1)
    assert len(from_file.tokens.views) == 3 and not any(v.flags.owndata for v in from_file.tokens.views)  # mapped
    assert np.array_equal(from_file.tokens[0:81], tokens) and from_file.num_samples == in_memory.num_samples
    x, y = from_file.rows(from_file.global_indices(3, 4))
    ex, ey = in_memory.rows(in_memory.global_indices(3, 4))
    assert x.dtype == np.int64 and np.array_equal(x, ex) and np.array_equal(y, ey)


# --- the embedded corpus -------------------------------------------------------------------------

def test_cache_root_falls_back_to_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDTRAIN_CACHE", str(tmp_path / "env"))
    assert prepare.cache_root(DataConfig()) == tmp_path / "env"
    assert prepare.cache_root(DataConfig(cache_dir=str(tmp_path / "cfg"))) == tmp_path / "cfg"


def test_one_cache_root_that_every_cache_honours(monkeypatch, tmp_path):
    """``$HYBRIDTRAIN_CACHE`` is the root of every cache; ``data.cache_dir`` moves the tokenized data only
    (``hybridtrain/cache.py``); without the variable, ``~/.cache/hybridtrain``."""
    from hybridtrain.cache import CacheDir
    from hybridtrain.models import shapes
    from hybridtrain.plan import calibrate

    monkeypatch.setenv("HYBRIDTRAIN_CACHE", str(tmp_path / "env"))
    caches = CacheDir.from_env()
    assert (caches.shapes, caches.calibration, caches.peak_file) == (
        tmp_path / "env" / "shapes", tmp_path / "env" / "calibration", tmp_path / "env" / "peak_tflops.json")
    assert shapes.cache_dir() == caches.shapes and calibrate.cache_dir() == caches.calibration
    assert prepare.cache_root(DataConfig(cache_dir=str(tmp_path / "cfg"))) == caches.data(str(tmp_path / "cfg"))
    monkeypatch.delenv("HYBRIDTRAIN_CACHE")
    home = Path.home() / ".cache" / "hybridtrain"
    assert CacheDir.from_env().root == home and shapes.cache_dir() == home / "shapes"
    assert CacheDir.from_env({"HYBRIDTRAIN_CACHE": "~/c"}).root == Path.home() / "c"


def test_embedded_corpus_is_cached_with_documents_separated(monkeypatch, tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"))
    prepared = prepare.prepare(cfg, seed=1234)
    path = Path(prepared.dir) / prepared.splits["train"]["dataset"]
    assert path.parent.parent == tmp_path / "cache" and path.parent.name.startswith("data-")
    assert [p.name for p in path.parent.parent.iterdir()] == [path.parent.name]  # no temporary folder left behind
    assert sorted(p.suffix for p in path.iterdir()) == [".arrow", ".json", ".json"]  # Dataset.save_to_disk

    tokens = np.asarray(ArrowColumn(path, "ids"))
    tokenizer = load_tokenizer(cfg)
    eos = tokenizer.eos_token_id
    assert eos is not None and tokens.dtype == np.uint16 and int(tokens.max()) < len(tokenizer)
    documents = embedded.documents(gzip.open(embedded.CORPUS, "rt", encoding="utf-8").read())
    ends = np.flatnonzero(tokens == eos)
    assert len(ends) == len(documents) > 1000 and ends[-1] == len(tokens) - 1  # one EOS after each document
    starts = np.concatenate([[0], ends[:-1] + 1])
    for k in (0, 1, len(documents) - 1):
        text = tokenizer.decode(tokens[starts[k]:ends[k]].tolist())
        assert text == documents[k]
    assert documents[0].startswith("Genesis 1\n") and documents[-1].startswith("Revelation 22\n")

    # second call: the cached folder, untouched, and no tokenizer work at all
    mtime = (path / "state.json").stat().st_mtime_ns

    def no_tokenizing(*_args, **_kwargs):
        raise AssertionError("prepare re-tokenized a cached corpus")

    monkeypatch.setattr(prepare.sources, "load_raw", no_tokenizing)
    assert prepare.prepare(cfg, seed=1234).dir == prepared.dir
    assert (path / "state.json").stat().st_mtime_ns == mtime

    samples = PackedSamples(path, 32, seed=1234)
    assert samples.num_samples == (len(tokens) - 1) // 32
    x, y = samples.rows(samples.global_indices(0, 4))
    assert np.array_equal(x[:, 1:], y[:, :-1])


def test_train_samples_opens_the_prepared_stream(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), seq_len=32)
    samples = prepare.train_samples(cfg, seed=1234)
    assert isinstance(samples, PackedSamples) and isinstance(samples.tokens, ArrowColumn) and samples.seq_len == 32


def test_unknown_tokenizer_path_is_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.tokenizer=.*no tokenizer.json"):
        tokenizer_source(DataConfig(tokenizer=str(tmp_path / "missing")))
