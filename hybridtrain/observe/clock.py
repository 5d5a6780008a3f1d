"""Where one rank's step time goes: spans of forward, backward, communication, optimizer work.

:class:`StepClock` is filled by :mod:`.pipe_timer` (pp > 1, one span per DeepSpeed pipeline
instruction) or by the sequential loop (pp = 1). It adds up seconds per category for the
metrics and, on profiled steps, keeps every span with its micro-batch number for the timeline.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

KINDS = ("load", "forward", "backward", "send_act", "recv_act", "send_grad", "recv_grad",
         "reduce_grads", "reduce_tied", "optimizer")
"""Span kinds, one per DeepSpeed pipeline instruction (``load`` = ``LoadMicroBatch``)."""

CATEGORY = {"forward": "forward", "backward": "backward",
            "send_act": "comm", "recv_act": "comm", "send_grad": "comm", "recv_grad": "comm",
            "reduce_grads": "optimizer", "reduce_tied": "optimizer", "optimizer": "optimizer"}
"""Kind -> metrics category. ``comm`` is the time blocked in pipeline send/receive (waiting for the
neighbour stage included); ``optimizer`` includes the data-parallel and tied-weight gradient
reductions. ``load`` is not a category: fetching data is ``data_wait_s``."""

CATEGORIES = ("forward", "backward", "comm", "optimizer")


class StepClock:
    """Seconds per category in the current step and, when recording, every span of it.

    ``sync`` (``torch.cuda.synchronize`` on a GPU) runs at the end of each span while the clock is
    active, so a span measures the device work it launched rather than the launch.
    """

    def __init__(self, sync: Callable[[], None] | None = None):
        self.sync = sync
        self.active = False
        """Spans are measured only between :meth:`start` and :meth:`stop` (logged or profiled steps)."""
        self.recording = False
        self.origin = 0.0
        self.totals: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
        self.events: list[tuple[str, int, float, float]] = []
        """``(kind, micro_batch, start_s, end_s)`` relative to :attr:`origin`, when recording."""
        self._counts: dict[str, int] = {}

    def start(self, record: bool = False, origin: float | None = None) -> None:
        """Begin a measured step; keep spans for the timeline when ``record``."""
        self.active, self.recording = True, record
        self.origin = time.perf_counter() if origin is None else origin
        self.totals = dict.fromkeys(CATEGORIES, 0.0)
        self.events, self._counts = [], {}

    def stop(self) -> None:
        """End the measured step (spans in between, e.g. evaluation, are not counted)."""
        self.active = False

    def next_index(self, kind: str) -> int:
        """The micro-batch number of the next ``kind`` span: in 1F1B every stage runs the forwards,
        the backwards and each kind of send and receive in micro-batch order."""
        i = self._counts.get(kind, 0)
        self._counts[kind] = i + 1
        return i

    def add(self, kind: str, micro_batch: int, t0: float, t1: float) -> None:
        """Record a span of ``kind`` from ``t0`` to ``t1`` (``time.perf_counter`` seconds)."""
        cat = CATEGORY.get(kind)
        if cat is not None:
            self.totals[cat] += t1 - t0
        if self.recording:
            self.events.append((kind, micro_batch, t0 - self.origin, t1 - self.origin))

    @contextmanager
    def span(self, kind: str, micro_batch: int | None = None) -> Iterator[None]:
        """Time the body as one ``kind`` span (a no-op while the clock is inactive)."""
        if not self.active:
            yield
            return
        mb = self.next_index(kind) if micro_batch is None else micro_batch
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self.add(kind, mb, t0, time.perf_counter())
