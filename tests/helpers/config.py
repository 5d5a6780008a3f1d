"""Helpers shared by the CPU unit tests (no worker processes, no deepspeed import).

Kept out of ``conftest.py`` on purpose: these are plain functions the unit-test modules import.
"""
from __future__ import annotations

from pathlib import Path

from hybridtrain.cli import compose, compose_raw  # noqa: F401  (compose_raw re-exported for the tests)
from hybridtrain.config import Config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
"""Every shipped recipe; globbed so a new recipe is covered without editing the tests."""

LLAMA_70B = ["+recipe=llama_7b", "model.config.num_hidden_layers=80", "model.config.hidden_size=8192",
             "model.config.intermediate_size=28672", "model.config.num_attention_heads=64",
             "model.config.num_key_value_heads=8"]
"""A Llama-2-70B shape on top of the ``llama_7b`` recipe (80 layers, GQA 64/8 heads)."""


def compose_config(*overrides: str) -> Config:
    """The typed :class:`Config` of ``overrides`` (e.g. ``"+recipe=gpt_tiny"``)."""
    return compose(overrides)
