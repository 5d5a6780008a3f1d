"""Composing the real ``conf/`` tree from the tests: one :func:`compose`, and the recipes and shapes
several tests share. No worker processes, no deepspeed import."""
from __future__ import annotations

import copy
import functools
from pathlib import Path

from hybridtrain import cli
from hybridtrain.cli import compose_raw  # noqa: F401  (re-exported for the tests)
from hybridtrain.config import Config

ROOT = Path(__file__).resolve().parents[2]
"""The checkout these tests live in (its ``recipes/``, ``conf/``, ``scripts/``)."""

RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
"""Every shipped recipe; globbed so a new recipe is covered without editing the tests."""

LLAMA_70B = ["+recipe=llama_7b", "model.config.num_hidden_layers=80", "model.config.hidden_size=8192",
             "model.config.intermediate_size=28672", "model.config.num_attention_heads=64",
             "model.config.num_key_value_heads=8"]
"""A Llama-2-70B shape on top of the ``llama_7b`` recipe (80 layers, GQA 64/8 heads)."""


def compose(*overrides: str) -> Config:
    """The typed :class:`Config` of ``overrides`` (e.g. ``compose("+recipe=gpt_tiny", "parallel.tp=2")``):
    :func:`hybridtrain.cli.compose` of them; nothing is launched."""
    return cli.compose(overrides)


@functools.lru_cache(maxsize=None)
def _composed(*overrides: str) -> Config:
    return compose(*overrides)


def cfg_of(*overrides: str) -> Config:
    """:func:`compose` once per test process: a fresh deep copy of the cached config of ``overrides``
    (for tests that compose the same few configs many times and change the copy)."""
    return copy.deepcopy(_composed(*overrides))
