"""Config schema, Hydra registration and the resolved-config file workers read."""
from __future__ import annotations

from pathlib import Path

from hybridtrain.config.schema import (
    LAUNCHER_CONFIGS,
    Config,
    DataConfig,
    FinetuneConfig,
    LauncherConfig,
    LoggerConfig,
    LoraConfig,
    ModelConfig,
    MultinodeLauncherConfig,
    OptimConfig,
    ParallelConfig,
    PlanConfig,
    SlurmLauncherConfig,
    TrainerConfig,
)

__all__ = [
    "Config", "DataConfig", "FinetuneConfig", "LoraConfig", "LauncherConfig", "SlurmLauncherConfig", "MultinodeLauncherConfig", "LoggerConfig",
    "ModelConfig", "OptimConfig", "ParallelConfig", "PlanConfig", "TrainerConfig",
    "CONF_DIR", "register_schema", "to_config", "save_config", "load_config",
]

CONF_DIR = (Path(__file__).resolve().parents[1] / "_conf").resolve()
"""The Hydra config tree. ``hybridtrain/_conf`` is a link to the checkout's ``conf/`` (whose ``recipe``
is a link to ``recipes/``); a wheel holds a copy of both there (``pyproject.toml``'s package data)."""


def register_schema() -> None:
    """Register :class:`Config` as the ``schema`` node that ``conf/config.yaml`` starts from, and each
    launcher's schema as ``schema/launcher/NAME``, which ``conf/launcher/NAME.yaml`` starts from."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    for name, schema in LAUNCHER_CONFIGS.items():
        store.store(group="schema/launcher", name=str(name), node=schema)


def _typed(data) -> Config:
    """``data`` (a plain or ``DictConfig`` tree) checked against the schema, as a typed :class:`Config`.

    The launcher's keys are checked against the schema of the launcher ``launcher.name`` names
    (``launcher=slurm`` has keys ``launcher=local`` lacks)."""
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(Config)
    given = data.get("launcher") if data else None
    name = given.get("name") if hasattr(given, "get") else None
    launcher = LAUNCHER_CONFIGS.get(name) if isinstance(name, str) else None
    if launcher is not None:
        schema.launcher = OmegaConf.structured(launcher)
    typed = OmegaConf.to_object(OmegaConf.merge(schema, data))
    _resolve_packing(typed)
    return typed


def _resolve_packing(cfg: Config) -> None:
    """``data.packing`` as a :class:`~hybridtrain.config.choices.Packing` member: the key is typed as a
    string so that the old ``true`` / ``false`` still compose (OmegaConf's enum fields refuse booleans),
    and its value is checked here, once, like a fixed choice."""
    from hybridtrain.config.choices import Packing
    from hybridtrain.errors import PlanError

    try:
        cfg.data.packing = Packing.of(cfg.data.packing, cfg.data.format)
    except ValueError as err:
        raise PlanError("data.packing", str(err)) from None


def to_config(cfg) -> Config:
    """Convert a composed ``DictConfig`` (Hydra keys dropped) into a typed :class:`Config`."""
    from omegaconf import OmegaConf

    from hybridtrain.errors import PlanError

    data = OmegaConf.to_container(cfg, resolve=True)
    data.pop("hydra", None)
    typed = _typed(data)
    composed = OmegaConf.get_type(cfg, "launcher") if "launcher" in cfg else None
    if composed is not None and composed is not type(typed.launcher):
        name = typed.launcher.name
        raise PlanError("launcher.name", f"the launcher is chosen with its group: use launcher={name} "
                                         f"instead of launcher.name={name}")
    return typed


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (what workers and checkpoints read back)."""
    from omegaconf import OmegaConf

    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def load_config(path: str | Path) -> Config:
    """Read a resolved ``config.yaml`` back into a typed :class:`Config`, checking it against the schema."""
    from omegaconf import OmegaConf

    return _typed(OmegaConf.load(str(path)))
