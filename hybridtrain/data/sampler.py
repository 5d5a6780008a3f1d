"""Which samples make up each step: a pure function of (seed, samples consumed), whatever the plan.

Every sample is ``(input_ids [seq_len], labels [seq_len])`` int64, labels already shifted
(``labels[t]`` is the token after ``input_ids[t]``) and ``-100`` where no loss is taken. Two stores
hold them, both memory-mapped ``.npy`` files written by :mod:`hybridtrain.data.prepare`:

* :class:`PackedSamples`: one token stream cut into blocks of ``seq_len + 1`` tokens overlapping by
  one (inputs ``block[:-1]``, labels ``block[1:]``);
* :class:`RowSamples`: one row per record (``input_ids`` and ``labels`` arrays ``[N, seq_len]``).

Epoch ``e`` visits the samples in the order of a permutation seeded by ``(seed, e)``; the stream
of epochs is read ``global_batch_size`` samples per step, so the position in the data is just the
number of samples consumed (:class:`DataPosition`) and does not depend on dp, tp, pp or even the
batch size. A step's global batch is laid out ``[accumulation, dp, micro_batch]``: data-parallel
rank ``r`` takes column ``r`` of every accumulation row and reads only those rows. Tensor-parallel
peers and the first and last pipeline stages compute the same micro-batches independently.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np


@dataclass(frozen=True)
class BatchLayout:
    """How one global batch is divided (all counts in samples)."""

    global_batch_size: int
    micro_batch_size: int
    dp: int

    @property
    def grad_accum(self) -> int:
        """Micro-batches per step on each data-parallel rank."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def rank_rows(self, indices: np.ndarray, dp_rank: int) -> np.ndarray:
        """This rank's micro-batches of one global batch's sample indices: ``[grad_accum, micro]``."""
        return indices.reshape(self.grad_accum, self.dp, self.micro_batch_size)[:, dp_rank]  # [gas, dp, mbs] -> [gas, mbs]


@dataclass(frozen=True)
class DataPosition:
    """Where a run is in its training data: everything a checkpoint needs to continue the order.

    The order is a pure function of the seed and the count of samples consumed, so restoring this
    continues with exactly the next global batch under any dp, tp, pp (and micro-batch size).
    """

    samples_seen: int = 0
    """Training samples consumed so far (``steps x global_batch_size``)."""
    seed: int = 0
    """Shuffle seed (``trainer.seed``); restoring under another seed is refused."""

    def epoch_offset(self, num_samples: int) -> tuple[int, int]:
        """``(epoch, offset in that epoch)`` of the next sample."""
        return divmod(self.samples_seen, num_samples)

    def advanced(self, samples: int) -> "DataPosition":
        """The position after consuming ``samples`` more."""
        return DataPosition(self.samples_seen + samples, self.seed)

    def state_dict(self) -> dict[str, int]:
        """A JSON-serialisable dict (what a checkpoint stores)."""
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "DataPosition":
        """The position :meth:`state_dict` saved."""
        return cls(samples_seen=int(state["samples_seen"]), seed=int(state["seed"]))


class Samples:
    """Shuffled, epoch-aware order over ``num_samples`` samples; subclasses read the rows."""

    num_samples: int
    seq_len: int
    seed: int

    def __init__(self, num_samples: int, seq_len: int, seed: int):
        self.num_samples, self.seq_len, self.seed = num_samples, seq_len, seed
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, labels)``, each ``[len(indices), seq_len]`` int64; reads only those rows."""
        raise NotImplementedError

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def indices_at(self, position: DataPosition | int, count: int) -> np.ndarray:
        """Sample indices of the ``count`` samples after ``position``, in order; crosses epoch boundaries."""
        start = position.samples_seen if isinstance(position, DataPosition) else position
        out = np.empty(count, dtype=np.int64)
        for k in range(count):
            epoch, offset = divmod(start + k, self.num_samples)
            out[k] = self._permutation(epoch)[offset]
        return out

    def global_indices(self, step: int, global_batch_size: int) -> np.ndarray:
        """Sample indices of step ``step`` (0-based), in order."""
        return self.indices_at(step * global_batch_size, global_batch_size)

    def _tensors(self, rows: np.ndarray) -> Iterator[tuple]:
        import torch

        for row in rows:
            inputs, labels = self.rows(row)
            yield torch.from_numpy(inputs), torch.from_numpy(labels)

    def micro_batches(self, step: int, layout: BatchLayout, dp_rank: int) -> Iterator[tuple]:
        """This data-parallel rank's ``grad_accum`` micro-batches of ``step`` as torch tensors."""
        idx = self.global_indices(step, layout.global_batch_size)
        return self._tensors(layout.rank_rows(idx, dp_rank))

    def stream_from(self, position: DataPosition, layout: BatchLayout, dp_rank: int) -> Iterator[tuple]:
        """Endless micro-batches of the global batches after ``position`` (what the pipeline engine pulls)."""
        if position.seed != self.seed:
            raise ValueError(f"data position was saved with seed {position.seed}, this run uses trainer.seed="
                             f"{self.seed}; resume with the same trainer.seed to continue the same order")
        start = position.samples_seen
        while True:
            idx = self.indices_at(start, layout.global_batch_size)
            yield from self._tensors(layout.rank_rows(idx, dp_rank))
            start += layout.global_batch_size

    def stream(self, start_step: int, layout: BatchLayout, dp_rank: int) -> Iterator[tuple]:
        """Endless micro-batches from ``start_step`` on."""
        return self.stream_from(DataPosition(start_step * layout.global_batch_size, self.seed), layout, dp_rank)

    def eval_batches(self, layout: BatchLayout, dp_rank: int) -> Iterator[list[tuple]]:
        """Validation order: consecutive global batches of samples ``0, 1, 2, ...`` unshuffled, each as
        this rank's list of micro-batches; the last ``num_samples % global_batch_size`` samples are dropped."""
        gbs = layout.global_batch_size
        for b in range(self.num_samples // gbs):
            yield list(self._tensors(layout.rank_rows(np.arange(b * gbs, (b + 1) * gbs), dp_rank)))


class PackedSamples(Samples):
    """Fixed-length samples cut from one (memory-mapped) token stream."""

    def __init__(self, tokens: np.ndarray | str | Path, seq_len: int, seed: int):
        self.tokens = np.load(tokens, mmap_mode="r") if isinstance(tokens, (str, Path)) else tokens
        super().__init__(max(0, (len(self.tokens) - 1) // seq_len), seq_len, seed)

    def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = self.seq_len
        blocks = np.stack([np.asarray(self.tokens[i * s:i * s + s + 1], dtype=np.int64) for i in indices])
        return np.ascontiguousarray(blocks[:, :-1]), np.ascontiguousarray(blocks[:, 1:])


class RowSamples(Samples):
    """One sample per record: ``input_ids`` and ``labels`` arrays ``[N, seq_len]`` (memory-mapped)."""

    def __init__(self, input_ids: np.ndarray | str | Path, labels: np.ndarray | str | Path, seed: int):
        load = lambda a: np.load(a, mmap_mode="r") if isinstance(a, (str, Path)) else a  # noqa: E731
        self.input_ids, self.labels = load(input_ids), load(labels)
        assert self.input_ids.shape == self.labels.shape, (self.input_ids.shape, self.labels.shape)
        super().__init__(self.input_ids.shape[0], self.input_ids.shape[1], seed)

    def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64)
        # fancy indexing a memmap copies just these rows out of the file
        return self.input_ids[idx].astype(np.int64), self.labels[idx].astype(np.int64)


def open_samples(data_json: str | Path | dict, split: str, seed: int) -> Samples | None:
    """The ``split`` (``train`` or ``val``) of the prepared data described by ``data_json`` (the run's
    ``data.json``, or its content as a dict), memory-mapped; ``None`` when the run has no such split."""
    meta = data_json if isinstance(data_json, dict) else json.loads(Path(data_json).read_text())
    files = meta["splits"].get(split)
    if files is None:
        return None
    folder = Path(meta["dir"])
    if meta["kind"] == "packed":
        samples: Samples = PackedSamples(folder / files["tokens"], meta["seq_len"], seed)
    else:
        samples = RowSamples(folder / files["input_ids"], folder / files["labels"], seed)
    assert samples.seq_len == meta["seq_len"]
    return samples
