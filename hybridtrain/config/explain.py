"""One line for a config Hydra cannot compose, and the CLI wrapper that prints it with exit code 2.

OmegaConf finds a wrongly typed value (``parallel.tp=abc``), a value outside a fixed choice
(``trainer.precision=fp33``) or an unknown key (``parallel.tpp=2``) while Hydra composes, and
Hydra prints its exception over several lines with exit code 1. :func:`explain` turns it into
``KEY: what is wrong and what the key accepts``, from the schema's type of the key.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from enum import Enum
from typing import Any, Callable, Optional

from hybridtrain.config.schema import LAUNCHER_CONFIGS

_KINDS = {bool: ("true or false", "true or false"), int: ("an integer", "integers"),
          float: ("a number", "numbers"), str: ("a string", "strings")}


def accepts(hint: Any) -> str:
    """What a field of type ``hint`` accepts, in words (``an integer or null``, ``one of [fp32, bf16]``)."""
    if hint is Any:  # finetune.lora.target_modules: a string or a list (OmegaConf 2.3 has no such union)
        return "any value"
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union:
        if args == [bool]:
            return "true, false or null"
        return f"{accepts(args[0])} or null" if len(args) == 1 else "a value of " + " or ".join(map(accepts, args))
    if isinstance(hint, type) and issubclass(hint, Enum):
        return "one of [" + ", ".join(str(m.value) for m in hint) + "]"
    if typing.get_origin(hint) in (list, tuple):
        return f"a list of {_KINDS[args[0]][1]}" if args and args[0] in _KINDS else "a list"
    if typing.get_origin(hint) is dict or hint is dict:
        return "a mapping"
    return _KINDS.get(hint, (getattr(hint, "__name__", str(hint)),))[0]


def _fields(cls: Any) -> dict[str, Any]:
    """The fields of a schema dataclass with their resolved types; ``{}`` for anything else."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return {}
    return typing.get_type_hints(cls)


def _shown(value: Any) -> str:
    return "null" if value is None else repr(value) if isinstance(value, str) else str(value)


def _unknown(key: str, owner: Any) -> str:
    """Why ``key`` is not in the config, and what is."""
    parent, _, name = key.rpartition(".")
    if parent == "launcher":  # a key of another launcher (launcher.partition with launcher=local)
        hosts = [str(n) for n, cls in LAUNCHER_CONFIGS.items() if name in _fields(cls)]
        this = next((str(n) for n, cls in LAUNCHER_CONFIGS.items() if cls is owner), None)
        if hosts and this:
            return (f"a key of launcher={' or launcher='.join(hosts)}, not of launcher={this} (this run's); "
                    f"add launcher={hosts[0]}")
    known = sorted(_fields(owner))
    if not known:  # a free-form mapping (model.config): Hydra adds new keys only with a + prefix
        return f"not in the config; add it with +{key}=VALUE"
    close = difflib.get_close_matches(name, known, n=3)
    return f"{parent or 'the config'} has no key {name!r}; " + (
        f"did you mean {' or '.join(close)}?" if close else f"its keys are {known}")


def explain(err: BaseException) -> Optional[str]:
    """``KEY: message`` for an OmegaConf error met while composing or typing a config (raised directly
    or as the cause of Hydra's ``ConfigCompositionException``); ``None`` for any other error."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

    cause = err if isinstance(err, OmegaConfBaseException) else err.__cause__
    if not isinstance(cause, OmegaConfBaseException) or not getattr(cause, "full_key", None):
        return None
    key, owner = cause.full_key, cause.object_type
    name = key.rpartition(".")[2]
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and name not in _fields(owner):
        return f"{key}: {_unknown(key, owner)}"
    if isinstance(cause, MissingMandatoryValue):
        return f"{key}: needs a value; add {key}=VALUE"
    hint = _fields(owner).get(name)
    if hint is None:  # not a schema field (e.g. inside model.config): OmegaConf's own first line
        return f"{key}: {str(cause).splitlines()[0]}"
    return f"{key}: {_shown(cause.value)} is not {accepts(hint)}"


def message(err: BaseException) -> str:
    """The config error line for ``err``: :func:`explain`'s, else the first line of the error."""
    return explain(err) or (str(err).splitlines() or [type(err).__name__])[0]


def run_hydra(hydra_main: Callable[[], None]) -> None:
    """Run a ``@hydra.main`` entry point; a config OmegaConf rejects while Hydra composes it is
    ``[hybridtrain] config error: KEY: ...`` on one line and exit code 2.

    Hydra catches composition errors itself, prints them over several lines and exits with code 1,
    unless ``HYDRA_FULL_ERROR`` is set, when it raises them (its only hook for this); so the variable is
    set for the call. Hydra's other errors (an unknown recipe, a malformed override) are printed as
    Hydra prints them, exit code 1; anything else keeps its traceback.
    """
    from hydra.errors import CompactHydraException

    before = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        hydra_main()
    except Exception as err:  # noqa: BLE001 - sorted below; anything unexpected is re-raised
        line = explain(err)
        if line is not None:
            print(f"[hybridtrain] config error: {line}", file=sys.stderr, flush=True)
            sys.exit(2)
        if before == "1" or not isinstance(err, CompactHydraException):
            raise
        print(err, file=sys.stderr)  # as Hydra prints it
        if err.__cause__ is not None:
            print(err.__cause__, file=sys.stderr)
        sys.exit(1)
    finally:
        if before is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = before

