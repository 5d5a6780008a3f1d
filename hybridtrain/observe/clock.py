"""Where one rank's step time goes: spans of forward, backward, communication, optimizer work.

:class:`StepClock` is filled by :mod:`.pipe_timer` (pp > 1, one span per DeepSpeed pipeline
instruction) or by the sequential loop (pp = 1). It adds up seconds per category for the
metrics and, on profiled steps, keeps every span with its micro-batch number for the timeline.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

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

    On the CPU a span is host time (``time.perf_counter``). On a GPU the host only queues the
    work, so a span is measured on the device instead: ``events`` (``torch.cuda.Event`` with
    timing) are recorded at both ends of the span on the current stream, and :meth:`stop` waits for
    the last one once per measured step and reads every span's device times, relative to an event
    recorded at :meth:`start`. No span synchronises the GPU, so measuring a step does not stall it.
    """

    def __init__(self, events: Callable[[], Any] | None = None):
        self.events_factory = events
        self.active = False
        """Spans are measured only between :meth:`start` and :meth:`stop` (logged or profiled steps)."""
        self.recording = False
        self.origin = 0.0
        self.totals: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
        self.events: list[tuple[str, int, float, float]] = []
        """``(kind, micro_batch, start_s, end_s)`` relative to :attr:`origin`, when recording."""
        self._counts: dict[str, int] = {}
        self._origin_event: Any = None
        self._pending: list[tuple[str, int, Any, Any]] = []

    def start(self, record: bool = False, origin: float | None = None) -> None:
        """Begin a measured step; keep spans for the timeline when ``record``."""
        self.active, self.recording = True, record
        self.origin = time.perf_counter() if origin is None else origin
        self.totals = dict.fromkeys(CATEGORIES, 0.0)
        self.events, self._counts, self._pending = [], {}, []
        if self.events_factory is not None:
            self._origin_event = self.events_factory()
            self._origin_event.record()

    def stop(self) -> None:
        """End the measured step (spans in between, e.g. evaluation, are not counted); on a GPU,
        wait for the step's last span and read the device times of all of them."""
        self.active = False
        if self._pending:
            self._pending[-1][3].synchronize()
            at = self._origin_event.elapsed_time  # milliseconds from the origin event
            for kind, mb, begin, end in self._pending:
                self._record(kind, mb, at(begin) / 1e3, at(end) / 1e3)
            self._pending = []

    def next_index(self, kind: str) -> int:
        """The micro-batch number of the next ``kind`` span: in 1F1B every stage runs the forwards,
        the backwards and each kind of send and receive in micro-batch order."""
        i = self._counts.get(kind, 0)
        self._counts[kind] = i + 1
        return i

    def add(self, kind: str, micro_batch: int, t0: float, t1: float) -> None:
        """Record a span of ``kind`` from ``t0`` to ``t1`` (``time.perf_counter`` seconds)."""
        self._record(kind, micro_batch, t0 - self.origin, t1 - self.origin)

    def _record(self, kind: str, micro_batch: int, start: float, end: float) -> None:
        cat = CATEGORY.get(kind)
        if cat is not None:
            self.totals[cat] += end - start
        if self.recording:
            self.events.append((kind, micro_batch, start, end))

    def open(self, kind: str, micro_batch: int | None = None) -> Any:
        """Begin a ``kind`` span now; hand the result to :meth:`close` (``None`` while inactive)."""
        if not self.active:
            return None
        mb = self.next_index(kind) if micro_batch is None else micro_batch
        if self.events_factory is None:
            return kind, mb, time.perf_counter()
        begin = self.events_factory()
        begin.record()
        return kind, mb, begin

    def close(self, span: Any) -> None:
        """End a span :meth:`open` began."""
        if span is None:
            return
        kind, mb, begin = span
        if self.events_factory is None:
            self.add(kind, mb, begin, time.perf_counter())
            return
        end = self.events_factory()
        end.record()
        self._pending.append((kind, mb, begin, end))

    @contextmanager
    def span(self, kind: str, micro_batch: int | None = None) -> Iterator[None]:
        """Time the body as one ``kind`` span (a no-op while the clock is inactive)."""
        opened = self.open(kind, micro_batch)
        try:
            yield
        finally:
            self.close(opened)
