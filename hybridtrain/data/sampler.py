"""Which samples make up each step: a pure function of (seed, step), whatever the plan.

The token stream is cut into blocks of ``seq_len + 1`` tokens overlapping by one
(inputs ``block[:-1]``, labels ``block[1:]``). Epoch ``e`` visits the blocks in the order of a
permutation seeded by ``(seed, e)``; the stream of epochs is read ``global_batch_size`` samples
per step. A step's global batch is laid out ``[accumulation, dp, micro_batch]``: data-parallel
rank ``r`` takes column ``r`` of every accumulation row. Tensor-parallel peers and the first and
last pipeline stages compute the same micro-batches independently, with no communication.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

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


class PackedSamples:
    """Fixed-length samples over a memory-mapped token array."""

    def __init__(self, tokens: np.ndarray | str | Path, seq_len: int, seed: int):
        self.tokens = np.load(tokens, mmap_mode="r") if isinstance(tokens, (str, Path)) else tokens
        self.seq_len = seq_len
        self.seed = seed
        self.num_samples = (len(self.tokens) - 1) // seq_len
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def global_indices(self, step: int, global_batch_size: int) -> np.ndarray:
        """Sample indices of step ``step`` (0-based), in order; crosses epoch boundaries."""
        out = np.empty(global_batch_size, dtype=np.int64)
        for k in range(global_batch_size):
            pos = step * global_batch_size + k
            epoch, offset = divmod(pos, self.num_samples)
            out[k] = self._permutation(epoch)[offset]
        return out

    def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, labels)``, each ``[len(indices), seq_len]`` int64."""
        s = self.seq_len
        blocks = np.stack([np.asarray(self.tokens[i * s:i * s + s + 1], dtype=np.int64) for i in indices])
        return np.ascontiguousarray(blocks[:, :-1]), np.ascontiguousarray(blocks[:, 1:])

    def micro_batches(self, step: int, layout: BatchLayout, dp_rank: int) -> Iterator[tuple]:
        """This data-parallel rank's ``grad_accum`` micro-batches of ``step`` as torch tensors."""
        import torch

        idx = self.global_indices(step, layout.global_batch_size)
        idx = idx.reshape(layout.grad_accum, layout.dp, layout.micro_batch_size)  # [gas, dp, mbs]
        for row in idx[:, dp_rank]:
            inputs, labels = self.rows(row)
            yield torch.from_numpy(inputs), torch.from_numpy(labels)

    def stream(self, start_step: int, layout: BatchLayout, dp_rank: int) -> Iterator[tuple]:
        """Endless micro-batches from ``start_step`` on (what DeepSpeed's pipeline engine pulls)."""
        step = start_step
        while True:
            yield from self.micro_batches(step, layout, dp_rank)
            step += 1
