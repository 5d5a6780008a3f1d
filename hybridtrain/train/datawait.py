"""How long the loop waits for data: ``data_wait_s`` of each step in ``metrics.jsonl``."""
from __future__ import annotations

import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


class DataTimer:
    """Adds up the seconds spent fetching micro-batches (reading rows, building tensors)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        """Total fetch time so far; a step's wait is the difference across it."""

    def wrap(self, batches: Iterable[T]) -> Iterator[T]:
        """``batches``, with the time of each fetch added to :attr:`seconds`."""
        it = iter(batches)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                self.seconds += time.perf_counter() - t0
            yield item
