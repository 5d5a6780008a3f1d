"""Experiment loggers selected with ``logger=``: ``none``, ``tensorboard`` or ``wandb`` (offline).

Only global rank 0 creates one; it receives every record written to ``metrics.jsonl``. Lists
(per-stage and per-rank numbers) become one scalar each (``stage_forward_s/1``). Both packages
are optional (``pip install -e '.[loggers]'``); :func:`check_logger` tells the user before any
worker starts when the selected one is missing.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from hybridtrain.errors import PlanError
from hybridtrain.rundir import RunDir

NAMES = ("none", "tensorboard", "wandb")
"""Values of ``logger.name``."""

_PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_logger(name: str) -> None:
    """Raise :class:`PlanError` for an unknown logger or one whose package cannot be imported."""
    if name not in NAMES:
        raise PlanError("logger.name", f"logger.name={name!r} is not a logger; use logger=none, logger=tensorboard "
                        "or logger=wandb")
    package = _PACKAGE.get(name)
    if package is None:
        return
    try:
        __import__(package)
    except ImportError as err:
        raise PlanError("logger.name", f"logger={name} needs the {package} package, which cannot be imported here "
                        f"({err}); install it with `pip install {package}` (or `pip install -e '.[loggers]'`), "
                        "or use logger=none") from None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record under logger tags (lists flattened to ``key/i``; ``step`` dropped)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or value is None or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"{key}/{i}"] = float(v)
    return out


class Logger(Protocol):
    """What the observer calls on rank 0."""

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardLogger:
    """``torch.utils.tensorboard.SummaryWriter`` event files in ``dir`` (default ``RUN_DIR/tensorboard``)."""

    def __init__(self, log_dir: Path, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.writer.add_text("config", "```\n" + _yaml(config) + "\n```", 0)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run in offline mode under ``dir`` (default ``RUN_DIR``, which gets
    ``wandb/offline-run-*``); upload later with ``wandb sync``. It never touches the network: offline
    mode, and no system stats, git, code or machine metadata collection."""

    def __init__(self, log_dir: Path, project: str, name: str, config: dict[str, Any]):
        os.environ["WANDB_MODE"] = "offline"  # also for any wandb process this one starts
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(mode="offline", silent=True, console="off", disable_git=True, save_code=False,
                                  x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True)
        self.run = wandb.init(project=project, name=name, dir=str(log_dir), config=config, settings=settings)

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record.get("step", 0)))

    def close(self) -> None:
        self.run.finish()


def _yaml(config: dict[str, Any]) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(config))


def create(logger_cfg, run_dir: Path, config: dict[str, Any]) -> Logger | None:
    """The logger ``logger_cfg`` (a :class:`~hybridtrain.config.schema.LoggerConfig`) asks for, or ``None``."""
    name = logger_cfg.name
    if name == "none":
        return None
    check_logger(name)
    run_name = logger_cfg.run_name or run_dir.name
    if name == "tensorboard":
        return TensorBoardLogger(Path(logger_cfg.dir) if logger_cfg.dir else RunDir(run_dir).tensorboard_dir, config)
    return WandbLogger(Path(logger_cfg.dir) if logger_cfg.dir else run_dir, logger_cfg.project, run_name, config)
