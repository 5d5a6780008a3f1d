"""Launch-time checks of the observability keys (raise :class:`PlanError` naming the key and the fix)."""
from __future__ import annotations

from hybridtrain.config.schema import Config
from hybridtrain.observe.loggers import check_logger
from hybridtrain.errors import PlanError


def check_observe(cfg: Config) -> None:
    """``trainer.profile_steps``, ``trainer.peak_tflops`` and ``logger`` (its package must import)."""
    t = cfg.trainer
    bad = [s for s in t.profile_steps if s < 1 or (t.epochs is None and s > t.max_steps)]
    if bad:
        raise PlanError("trainer.profile_steps", f"trainer.profile_steps={list(t.profile_steps)}: step(s) {bad} are "
                        f"outside the run's steps 1..{t.max_steps}; pick steps in that range (after the first, "
                        "e.g. [5,6], so start-up does not count)")
    if t.peak_tflops is not None and t.peak_tflops <= 0:
        raise PlanError("trainer.peak_tflops", f"trainer.peak_tflops={t.peak_tflops} must be positive (TFLOP/s of "
                        "one device), or null to use the GPU table or the CPU probe")
    check_logger(cfg.logger.name)
