"""Error types every layer can raise without importing the planner (the bottom of the package)."""
from __future__ import annotations


class PlanError(ValueError):
    """A config that cannot run; the message names the key, the values and a fix.

    The CLIs print it as ``[hybridtrain] config error: KEY: MESSAGE`` and exit with code 2 before
    anything expensive starts.
    """

    def __init__(self, key: str, message: str):
        self.key = key
        self.detail = message
        super().__init__(f"{key}: {message}")

    def __reduce__(self):  # picklable, so it crosses process boundaries (datasets.map with num_proc)
        return (type(self), (self.key, self.detail))
