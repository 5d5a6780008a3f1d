"""Which samples make up each step: a pure function of (seed, samples consumed), whatever the plan.

Every sample is ``(input_ids [seq_len], labels [seq_len])`` int64, labels already shifted
(``labels[t]`` is the token after ``input_ids[t]``) and ``-100`` where no loss is taken. Three stores
hold them, each read from the memory-mapped Arrow files of the HF ``datasets`` that
:mod:`hybridtrain.data.prepare` saved (:class:`ArrowColumn`; in-memory arrays work too, for tests):

* :class:`PackedSamples`: one token stream cut into blocks of ``seq_len + 1`` tokens overlapping by
  one (inputs ``block[:-1]``, labels ``block[1:]``; ``data.packing=stream``);
* :class:`RowSamples`: one row per record (``input_ids`` and ``labels`` arrays ``[N, seq_len]``;
  ``data.packing=none``);
* :class:`DocumentSamples`: whole records packed into rows (:mod:`hybridtrain.data.packing`;
  ``data.packing=documents``), with position ids that restart at every record.

The model takes ``(input_ids, position_ids)``, both ``[B, seq_len]`` int64: position ids count
``0, 1, ...`` from the start of each record, so transformers' masking builds a block-causal mask from
them (a token attends only to the earlier tokens of its own record); for unpacked rows and stream
blocks they are ``0 .. seq_len - 1``, the plain causal case.

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

from hybridtrain.data.arrow import ArrowColumn, numpy_view, read_saved_table  # noqa: F401  (their old home)
from hybridtrain.data.packing import pack, row_positions
from hybridtrain.parallel.dims import BatchLayout


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

    def positions(self, indices: np.ndarray) -> np.ndarray:
        """Position ids ``[len(indices), seq_len]`` int64 of those rows: ``0 .. seq_len - 1`` (one
        sequence per row); :class:`DocumentSamples` restarts them at every record."""
        return np.tile(np.arange(self.seq_len, dtype=np.int64), (len(indices), 1))

    def label_counts(self, indices: np.ndarray) -> np.ndarray:
        """Loss-carrying tokens (labels other than ``-100``) of each sample in ``indices``."""
        raise NotImplementedError

    def batch_weight(self, indices: np.ndarray, layout: BatchLayout) -> float:
        """The factor that turns a micro-batch's summed token loss into its share of the global batch's
        mean token loss: ``grad_accum x dp x cp / loss tokens of the global batch``.

        DeepSpeed averages micro-batch losses over accumulation steps and the data axis (``dp x cp``: each
        context-parallel rank returns the summed loss of its own tokens of the rows), so
        each micro-batch returning ``sum x weight`` makes the step's loss (and gradient) the mean over
        every loss token of the global batch, whatever the micro-batch size: with masked labels
        (chat, prompt_completion, unpacked text) a mean of per-micro-batch means would depend on how
        the batch is cut.
        """
        return layout.grad_accum * layout.averaged_over / max(1, int(self.label_counts(indices).sum()))

    def step_loss_tokens(self, step: int, global_batch_size: int) -> int:
        """Loss-carrying tokens of step ``step``'s global batch (``loss_tokens`` in ``metrics.jsonl``)."""
        return int(self.label_counts(self.global_indices(step, global_batch_size)).sum())

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

    def _tensors(self, idx: np.ndarray, layout: BatchLayout, dp_rank: int, weighted: bool) -> Iterator[tuple]:
        """This rank's micro-batches of the global batch ``idx``: ``((input_ids, position_ids), labels)``,
        or with ``weighted`` ``((input_ids, position_ids), (labels, weight))`` (see :meth:`batch_weight`).
        The model input is a tuple because that is what DeepSpeed's pipeline feeds its first stage."""
        import torch

        weight = torch.tensor(self.batch_weight(idx, layout), dtype=torch.float32) if weighted else None
        for row in layout.rank_rows(idx, dp_rank):
            inputs, labels = self.rows(row)
            labels = torch.from_numpy(labels)
            model_inputs = (torch.from_numpy(inputs), torch.from_numpy(self.positions(row)))
            yield model_inputs, (labels, weight) if weighted else labels

    def micro_batches(self, step: int, layout: BatchLayout, dp_rank: int, weighted: bool = False) -> Iterator[tuple]:
        """This data-parallel rank's ``grad_accum`` micro-batches of ``step`` as torch tensors."""
        return self._tensors(self.global_indices(step, layout.global_batch_size), layout, dp_rank, weighted)

    def stream_from(self, position: DataPosition, layout: BatchLayout, dp_rank: int,
                    weighted: bool = False) -> Iterator[tuple]:
        """Endless micro-batches of the global batches after ``position`` (what the pipeline engine pulls)."""
        if position.seed != self.seed:
            raise ValueError(f"data position was saved with seed {position.seed}, this run uses trainer.seed="
                             f"{self.seed}; resume with the same trainer.seed to continue the same order")
        start = position.samples_seen
        while True:
            yield from self._tensors(self.indices_at(start, layout.global_batch_size), layout, dp_rank, weighted)
            start += layout.global_batch_size

    def stream(self, start_step: int, layout: BatchLayout, dp_rank: int, weighted: bool = False) -> Iterator[tuple]:
        """Endless micro-batches from ``start_step`` on."""
        position = DataPosition(start_step * layout.global_batch_size, self.seed)
        return self.stream_from(position, layout, dp_rank, weighted)

    def eval_batches(self, layout: BatchLayout, dp_rank: int, weighted: bool = False) -> Iterator[list[tuple]]:
        """Validation order: consecutive global batches of samples ``0, 1, 2, ...`` unshuffled, each as
        this rank's list of micro-batches; the last ``num_samples % global_batch_size`` samples are dropped."""
        gbs = layout.global_batch_size
        for b in range(self.num_samples // gbs):
            yield list(self._tensors(np.arange(b * gbs, (b + 1) * gbs), layout, dp_rank, weighted))


class PackedSamples(Samples):
    """Fixed-length samples cut from one (memory-mapped) token stream."""

    def __init__(self, tokens: np.ndarray | ArrowColumn | str | Path, seq_len: int, seed: int):
        self.tokens = ArrowColumn(tokens, "ids") if isinstance(tokens, (str, Path)) else tokens
        super().__init__(max(0, (len(self.tokens) - 1) // seq_len), seq_len, seed)

    def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = self.seq_len
        blocks = np.stack([np.asarray(self.tokens[i * s:i * s + s + 1], dtype=np.int64) for i in indices])
        return np.ascontiguousarray(blocks[:, :-1]), np.ascontiguousarray(blocks[:, 1:])

    def label_counts(self, indices: np.ndarray) -> np.ndarray:
        return np.full(len(indices), self.seq_len, dtype=np.int64)  # every packed token has a label


class RowSamples(Samples):
    """One sample per record: ``input_ids`` and ``labels`` ``[N, seq_len]``, arrays or the columns of a
    saved dataset folder (memory-mapped)."""

    def __init__(self, input_ids: np.ndarray | str | Path, labels: np.ndarray | str | Path | None, seed: int):
        if isinstance(input_ids, (str, Path)):  # one dataset folder holds both columns and the counts
            folder = input_ids
            input_ids, labels = ArrowColumn(folder, "input_ids"), ArrowColumn(folder, "labels")
            self.num_labels = ArrowColumn(folder, "num_labels")
        else:
            self.num_labels = (np.asarray(labels) != -100).sum(axis=1)
        self.input_ids, self.labels = input_ids, labels
        assert self.input_ids.shape == self.labels.shape, (self.input_ids.shape, self.labels.shape)
        super().__init__(self.input_ids.shape[0], self.input_ids.shape[1], seed)

    def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64)
        # fancy indexing copies just these rows out of the mapped file
        return self.input_ids[idx].astype(np.int64), self.labels[idx].astype(np.int64)

    def label_counts(self, indices: np.ndarray) -> np.ndarray:
        return np.asarray(self.num_labels[np.asarray(indices, dtype=np.int64)], dtype=np.int64)


class DocumentSamples(Samples):
    """Records packed whole into rows of ``seq_len`` tokens (``data.packing=documents``).

    Each record is its unpadded ``input_ids`` and ``labels`` (at most ``seq_len`` each); the rows are
    :func:`~hybridtrain.data.packing.pack`'s plan, fixed for the run by the records' lengths and the
    seed. A row is its records one after the other, then ``pad_id`` up to ``seq_len`` (labels
    ``-100``); its position ids restart at every record and at the padding
    (:func:`~hybridtrain.data.packing.row_positions`). A sample index is a row.
    """

    def __init__(self, input_ids, labels, num_labels, lengths: np.ndarray, seq_len: int, seed: int,
                 pad_id: int = 0):
        self.input_ids, self.labels, self.pad_id = input_ids, labels, pad_id  # flat token streams
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.plan = pack(self.lengths, seq_len, seed)
        self.row_labels = self.plan.per_row(np.asarray(num_labels, dtype=np.int64))
        super().__init__(len(self.plan), seq_len, seed)

    @classmethod
    def from_folder(cls, folder: str | Path, seq_len: int, seed: int, pad_id: int = 0) -> "DocumentSamples":
        """The records of a saved dataset folder (``input_ids``, ``labels``, ``num_labels``), memory-mapped."""
        ids = ArrowColumn(folder, "input_ids")
        return cls(ids, ArrowColumn(folder, "labels"), ArrowColumn(folder, "num_labels"), ids.lengths, seq_len,
                   seed, pad_id)

    @classmethod
    def from_records(cls, records: list[tuple[list[int], list[int]]], seq_len: int, seed: int,
                     pad_id: int = 0) -> "DocumentSamples":
        """In-memory records ``(input_ids, labels)`` (for tests and benchmarks)."""
        ids = np.array([t for r, _ in records for t in r], dtype=np.int64)
        labels = np.array([t for _, r in records for t in r], dtype=np.int64)
        counts = [sum(t != -100 for t in r) for _, r in records]
        return cls(ids, labels, counts, [len(r) for r, _ in records], seq_len, seed, pad_id)

    @property
    def fill(self) -> float:
        """The share of the rows' tokens that are record tokens (the rest is padding)."""
        return float(self.lengths.sum()) / max(1, self.num_samples * self.seq_len)

    def records(self, row: int) -> np.ndarray:
        """The record indices packed into ``row``."""
        return self.plan.records(int(row))

    def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = len(indices)
        inputs = np.full((n, self.seq_len), self.pad_id, dtype=np.int64)
        labels = np.full((n, self.seq_len), -100, dtype=np.int64)
        for k, row in enumerate(indices):
            at = 0
            for record in self.records(row):
                start, stop = int(self.offsets[record]), int(self.offsets[record + 1])
                inputs[k, at:at + stop - start] = self.input_ids[start:stop]
                labels[k, at:at + stop - start] = self.labels[start:stop]
                at += stop - start
        return inputs, labels

    def positions(self, indices: np.ndarray) -> np.ndarray:
        out = np.empty((len(indices), self.seq_len), dtype=np.int64)
        for k, row in enumerate(indices):
            out[k] = row_positions(self.lengths[self.records(row)], self.seq_len)
        return out

    def label_counts(self, indices: np.ndarray) -> np.ndarray:
        return self.row_labels[np.asarray(indices, dtype=np.int64)]


class PairSamples(RowSamples):
    """Preference pairs, one per row (``data.format=preference``, :mod:`hybridtrain.data.preference`): the
    chosen sequence's ``chosen_len`` tokens, then the rejected sequence's, then padding. A sample index is a pair.

    A micro-batch's target is ``(labels, weights, segments, reference, index)``: ``weights`` ``[2]`` turn the
    micro-batch's summed pair losses and summed chosen-token NLL into their shares of the global batch's means
    (:meth:`batch_weight` for pairs and for chosen tokens), ``segments [B, S]`` say which sequence a token is in
    (0 chosen, 1 rejected, -1 padding; 2 the chosen prompt under :attr:`prompt_nll`), ``reference [B, 2]`` the pairs' reference log-probabilities (chosen,
    rejected; zeros until :attr:`reference` is set) and ``index [B]`` the pairs' indices.
    """

    def __init__(self, folder: str | Path, seed: int):
        super().__init__(folder, None, seed)
        self.chosen_len = np.asarray(ArrowColumn(folder, "chosen_len"), dtype=np.int64)
        self.pair_len = np.asarray(ArrowColumn(folder, "pair_len"), dtype=np.int64)
        self.chosen_labels = np.asarray(ArrowColumn(folder, "chosen_labels"), dtype=np.int64)
        self.reference: np.ndarray | None = None
        """``[num_samples, 2]`` float64 log-probabilities of each pair under the reference model, once computed
        (:mod:`hybridtrain.train.preference`)."""
        self.prompt_nll = False
        """ORPO (``finetune.objective=orpo``): the chosen sequence's prompt tokens carry labels too (the next
        token), with segment 2, and the per-chosen-token weight counts them: TRL's ``ORPOTrainer`` takes the
        NLL over the whole chosen sequence."""

    def positions(self, indices: np.ndarray) -> np.ndarray:
        out = np.empty((len(indices), self.seq_len), dtype=np.int64)
        for k, i in enumerate(indices):
            c, n = int(self.chosen_len[i]), int(self.pair_len[i])
            out[k] = row_positions(np.array([c, n - c]), self.seq_len)
        return out

    def segments(self, indices: np.ndarray) -> np.ndarray:
        """``[len(indices), seq_len]`` int64: 0 on the chosen sequence, 1 on the rejected one, -1 on padding."""
        t = np.arange(self.seq_len)[None, :]
        c, n = self.chosen_len[indices][:, None], self.pair_len[indices][:, None]
        return np.where(t < c, 0, np.where(t < n, 1, -1)).astype(np.int64)

    def batch_weights(self, indices: np.ndarray, layout: BatchLayout) -> np.ndarray:
        """``[per pair, per chosen token]``: what :meth:`Samples.batch_weight` is for tokens, for the global
        batch's pairs and for its chosen completions' loss tokens (TRL's ``sft`` loss type)."""
        scale = layout.grad_accum * layout.averaged_over
        chosen = self.chosen_len if self.prompt_nll else self.chosen_labels  # every chosen token is labelled
        return np.array([scale / max(1, len(indices)), scale / max(1, int(chosen[indices].sum()))])

    def _prompt_labelled(self, inputs: np.ndarray, labels: np.ndarray, segments: np.ndarray,
                         row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:attr:`prompt_nll`'s labels and segments: the chosen sequence's unlabelled (prompt) tokens get the
        next input token as label and segment 2. Within a sequence the label of token ``t`` is token
        ``t + 1``, which a prompt token always has (a completion follows it)."""
        t = np.arange(self.seq_len)[None, :]
        prompt = (t < self.chosen_len[row][:, None]) & (labels == -100)  # [B, S]
        following = np.concatenate([inputs[:, 1:], inputs[:, -1:]], axis=1)
        return np.where(prompt, following, labels), np.where(prompt, 2, segments)

    def reference_batches(self, layout: BatchLayout, dp_rank: int) -> Iterator[list[tuple]]:
        """Every pair once, in index order, as this rank's micro-batches of consecutive global batches; the last
        batch filled up with pairs from the start (recorded twice, counted once:
        :mod:`hybridtrain.train.preference`)."""
        gbs = layout.global_batch_size
        for start in range(0, self.num_samples, gbs):
            yield list(self._tensors(np.arange(start, start + gbs) % self.num_samples, layout, dp_rank, True))

    def _tensors(self, idx: np.ndarray, layout: BatchLayout, dp_rank: int, weighted: bool) -> Iterator[tuple]:
        import torch

        weights = torch.tensor(self.batch_weights(idx, layout), dtype=torch.float32)
        for row in layout.rank_rows(idx, dp_rank):
            inputs, labels = self.rows(row)
            segments = self.segments(row)
            if self.prompt_nll:
                labels, segments = self._prompt_labelled(inputs, labels, segments, row)
            reference = self.reference[row] if self.reference is not None else np.zeros((len(row), 2))
            model_inputs = (torch.from_numpy(inputs), torch.from_numpy(self.positions(row)))
            yield model_inputs, (torch.from_numpy(labels), weights, torch.from_numpy(segments),
                                 torch.from_numpy(np.ascontiguousarray(reference, dtype=np.float64)),
                                 torch.from_numpy(np.asarray(row, dtype=np.int64)))


def open_samples(data_json: str | Path | dict, split: str, seed: int) -> Samples | None:
    """The ``split`` (``train`` or ``val``) of the prepared data described by ``data_json`` (the run's
    ``data.json``, or its content as a dict), memory-mapped; ``None`` when the run has no such split."""
    meta = data_json if isinstance(data_json, dict) else json.loads(Path(data_json).read_text())
    files = meta["splits"].get(split)
    if files is None:
        return None
    folder = Path(meta["dir"])
    if meta["kind"] == "packed":
        samples: Samples = PackedSamples(folder / files["dataset"], meta["seq_len"], seed)
    elif meta["kind"] == "pairs":
        samples = PairSamples(folder / files["dataset"], seed)
    elif meta["kind"] == "documents":
        samples = DocumentSamples.from_folder(folder / files["dataset"], meta["seq_len"], seed, meta.get("pad_id") or 0)
    else:
        samples = RowSamples(folder / files["dataset"], None, seed)
    assert samples.seq_len == meta["seq_len"]
    return samples
