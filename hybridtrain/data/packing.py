"""Which records share a row (``data.packing=documents``): best-fit decreasing, seeded, plan independent.

Rows are filled once per run, from the records' lengths, ``seq_len`` and ``trainer.seed`` only, so
every (dp, tp, pp, micro-batch size) sees the same rows, and a resumed run the same rows again; each
epoch then visits the rows in its own seeded order (:class:`~hybridtrain.data.sampler.Samples`).

Why best-fit decreasing: records are placed longest first, each into the open row with the least room
that still holds it, else into a new row. On length-skewed fine-tuning data (many short records, a
few near ``seq_len``) this fills rows almost completely (the short records fill the gaps the long
ones leave), where a greedy pass in shuffled order closes a row whenever the next record does not
fit. Records of equal length are taken in an order seeded by ``trainer.seed``, so the seed decides
which records share a row. trl's ``pack_dataset(strategy="bfd")`` packs the same way, but hybridtrain
does not depend on trl and needs the plan as indices into the memory-mapped records (the dataset is
written once per ``seq_len``; the rows are derived per run), so it is written here: a loop over a
sorted list of the free capacities, ``O(N log seq_len)``.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

PACK_STREAM = 0x5041434B
"""Second seed word of the tie-breaking order (``"PACK"``); epochs use ``[seed, epoch]``."""


@dataclass(frozen=True)
class RowPlan:
    """Records grouped into rows: row ``r`` holds records ``order[starts[r]:starts[r + 1]]``."""

    order: np.ndarray
    """Record indices, row after row (``int64``)."""
    starts: np.ndarray
    """``[rows + 1]`` offsets into :attr:`order`."""

    def __len__(self) -> int:
        return len(self.starts) - 1

    def records(self, row: int) -> np.ndarray:
        """The record indices of ``row``, in the order they sit in it."""
        return self.order[self.starts[row]:self.starts[row + 1]]

    def per_row(self, values: np.ndarray) -> np.ndarray:
        """``values[record]`` summed over each row's records (e.g. loss tokens per row)."""
        if len(self) == 0:
            return np.zeros(0, dtype=np.int64)
        return np.add.reduceat(np.asarray(values, dtype=np.int64)[self.order], self.starts[:-1])


def pack(lengths: np.ndarray, capacity: int, seed: int) -> RowPlan:
    """Best-fit decreasing of records of ``lengths`` tokens into rows of ``capacity`` tokens.

    Every record is placed exactly once; a record longer than ``capacity`` is a :class:`ValueError`
    (the preparation truncates or splits records to ``seq_len`` before this runs).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.max() > capacity or lengths.min() < 1):
        raise ValueError(f"record lengths must be in [1, {capacity}], got [{lengths.min()}, {lengths.max()}]")
    tie = np.random.default_rng([seed, PACK_STREAM]).permutation(len(lengths))
    rows: list[list[int]] = []
    free: dict[int, list[int]] = {}  # room left -> rows with exactly that much room
    rooms: list[int] = []  # sorted keys of ``free``
    for record in np.lexsort((tie, -lengths)).tolist():  # longest first, equal lengths in seeded order
        n = int(lengths[record])
        j = bisect.bisect_left(rooms, n)
        if j < len(rooms):  # the fullest row that still holds it
            room = rooms[j]
            row = free[room].pop()
            if not free[room]:
                del free[room], rooms[j]
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(record)
        left = room - n
        if left:
            if left not in free:
                free[left] = []
                bisect.insort(rooms, left)
            free[left].append(row)
    order = np.fromiter((r for row in rows for r in row), dtype=np.int64, count=len(lengths))
    starts = np.concatenate([[0], np.cumsum([len(row) for row in rows], dtype=np.int64)]).astype(np.int64)
    return RowPlan(order=order, starts=starts)


def row_positions(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Position ids ``[seq_len]`` of a row holding records of ``lengths`` then padding: ``0, 1, ...``
    restarting at every record, and at the padding, which is a segment of its own (it attends to
    nothing real and carries no loss)."""
    out = np.empty(seq_len, dtype=np.int64)
    at = 0
    for n in list(map(int, lengths)) + [seq_len - int(np.sum(lengths))]:
        out[at:at + n] = np.arange(n)
        at += n
    return out
