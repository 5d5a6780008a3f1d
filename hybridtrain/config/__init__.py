"""Config schema, Hydra registration and the resolved-config file workers read."""
from __future__ import annotations

from pathlib import Path

from hybridtrain.config.schema import (
    Config,
    DataConfig,
    LauncherConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PlanConfig,
    TrainerConfig,
)

__all__ = [
    "Config", "DataConfig", "LauncherConfig", "LoggerConfig", "ModelConfig", "OptimConfig", "ParallelConfig",
    "PlanConfig",
    "TrainerConfig", "CONF_DIR", "register_schema", "to_config", "save_config", "load_config",
]

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The Hydra config tree of this checkout (``conf/``; recipes are ``conf/recipe -> ../recipes``)."""


def register_schema() -> None:
    """Register :class:`Config` as the ``schema`` node that ``conf/config.yaml`` starts from."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="schema", node=Config)


def to_config(cfg) -> Config:
    """Convert a composed ``DictConfig`` (Hydra keys dropped) into a typed :class:`Config`."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(cfg, resolve=True)
    data.pop("hydra", None)
    merged = OmegaConf.merge(OmegaConf.structured(Config), data)
    return OmegaConf.to_object(merged)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (what workers and checkpoints read back)."""
    from omegaconf import OmegaConf

    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def load_config(path: str | Path) -> Config:
    """Read a resolved ``config.yaml`` back into a typed :class:`Config`, checking it against the schema."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(str(path)))
    return OmegaConf.to_object(merged)
