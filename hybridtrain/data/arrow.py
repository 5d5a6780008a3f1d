"""The memory-mapped Arrow columns of the datasets :mod:`hybridtrain.data.prepare` saved, read with pyarrow
alone and viewed as numpy arrays without copying (what the samplers of :mod:`hybridtrain.data.sampler` read)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def read_saved_table(folder: Path):
    """The Arrow table of a dataset folder written by ``Dataset.save_to_disk``, memory-mapped.

    Read as ``datasets.load_from_disk`` reads it (``state.json`` lists the Arrow stream files, each
    memory-mapped, concatenated; ``save_to_disk`` leaves no index mapping), with pyarrow alone:
    importing ``datasets`` would cost every rank about a second of start-up.
    """
    import pyarrow as pa

    state = json.loads((folder / "state.json").read_text())
    return pa.concat_tables([pa.ipc.open_stream(pa.memory_map(str(folder / f["filename"]))).read_all()
                             for f in state["_data_files"]])


def numpy_view(array) -> np.ndarray:
    """A read-only numpy view of a numeric pyarrow array without nulls, without copying.

    Why by hand: pyarrow's ``Array.to_numpy`` goes through its pandas conversion layer, which imports
    pandas in every rank (a forked rank also copies the pages that import touches), CPU time a job
    of many ranks on few cores pays many times over (``docs/benchmarks.md``). The values buffer of a
    numeric array is its numpy array (``buffers()[1]``, from ``offset``)."""
    import pyarrow as pa

    kind = array.type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise TypeError(f"expected a numeric Arrow array, got {kind}")
    if array.null_count:
        raise ValueError(f"the Arrow array has {array.null_count} missing value(s); hybridtrain's prepared "
                         "datasets have none (prepare it again)")
    dtype = np.dtype(kind.to_pandas_dtype())  # a numpy dtype for numeric types; pandas is not imported
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


class ArrowColumn:
    """One list column of a dataset saved with ``Dataset.save_to_disk``, read in place.

    The ``.arrow`` files are memory-mapped; each record batch's list values are
    viewed as a numpy array without copying (a variable-length column as one flat token stream,
    ``fixed_size_list`` as ``[rows, length]``). Reading a slice or a few rows touches only those pages,
    so no rank holds the tokenized dataset in memory. (``Dataset.__getitem__`` would convert rows
    through Python lists; these zero-copy views are what makes per-step reads cheap.)
    """

    def __init__(self, folder: str | Path, column: str):
        self.folder = Path(folder)
        table = read_saved_table(self.folder)
        views, lengths = [], []
        for chunk in table.column(column).chunks:
            if not hasattr(chunk, "flatten"):  # a scalar column (``num_labels``)
                views.append(numpy_view(chunk))
                continue
            flat = numpy_view(chunk.flatten())
            length = getattr(chunk.type, "list_size", None)
            views.append(flat.reshape(-1, length) if length else flat)
            if not length:
                lengths.append(np.diff(numpy_view(chunk.offsets)))
        self.views = [v for v in views if len(v)]
        self.starts = np.cumsum([0] + [len(v) for v in self.views])
        self.lengths = np.concatenate(lengths).astype(np.int64) if lengths else None
        """A variable-length list column's list lengths (its records in :meth:`__getitem__`'s flat stream)."""

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The whole column as one array (a copy: for tests and small data only)."""
        whole = np.concatenate(self.views) if self.views else np.empty(0, np.int64)
        return whole.astype(dtype) if dtype is not None else whole

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self),) + (self.views[0].shape[1:] if self.views else ())

    def __getitem__(self, key):
        if isinstance(key, slice):  # a contiguous range (packed blocks), possibly across record batches
            start, stop, _ = key.indices(len(self))
            first = int(np.searchsorted(self.starts, start, side="right")) - 1
            parts = []
            while start < stop:
                view, base = self.views[first], int(self.starts[first])
                take = view[start - base:min(stop - base, len(view))]
                parts.append(take)
                start += len(take)
                first += 1
            return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.empty(0, np.int64)
        idx = np.asarray(key, dtype=np.int64)  # rows
        which = np.searchsorted(self.starts, idx, side="right") - 1
        return np.stack([self.views[w][i - self.starts[w]] for w, i in zip(which, idx)])
