"""Observability: throughput and MFU, memory, per-stage times, the pipeline timeline, loggers.

The training loop talks to one :class:`~hybridtrain.observe.observer.Observer`; everything else
here is a small piece it uses: :mod:`.peak` (device peak FLOP/s), :mod:`.clock` (spans of one
step), :mod:`.pipe_timer` (DeepSpeed pipeline instructions timed), :mod:`.resources` (memory,
NVML), :mod:`.gather` (per-rank numbers to rank 0), :mod:`.timeline` (bubble, Chrome trace,
PNG) and :mod:`.loggers` (TensorBoard, W&B offline). Nothing here is imported by
``import hybridtrain``; torch, matplotlib and the logger packages are imported lazily.
"""
