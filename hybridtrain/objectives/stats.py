"""The per-step metric sums a preference or reward loss keeps on its rank (float64, summed over the step's
micro-batches), which :func:`hybridtrain.train.preference.step_metrics` takes and all-reduces on log steps."""
from __future__ import annotations

import torch


class StepSums:
    """Sums of ``width`` values, added once per micro-batch's loss and taken (and reset) once per step."""

    def __init__(self, width: int):
        self.width = width
        self.sums: torch.Tensor | None = None

    def add(self, sums: torch.Tensor) -> None:
        """Add one micro-batch's ``[width]`` sums."""
        sums = sums.double()
        self.sums = sums if self.sums is None else self.sums + sums

    def take(self, device) -> torch.Tensor:
        """The sums since the last call on ``device`` (zeros on a rank that computed no loss), reset."""
        out = self.sums if self.sums is not None else torch.zeros(self.width, dtype=torch.float64)
        self.sums = None
        return out.to(device)
