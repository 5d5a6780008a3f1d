"""Config rules that had no test of their own (found while writing ``docs/errors.md``): each
changes one key of ``gpt_tiny`` and asserts the ``PlanError`` key and the message."""
from __future__ import annotations

import copy
import functools

import pytest

from helpers_unit import compose_config
from hybridtrain.plan import Machine, PlanError, resolve

CPU = Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=4)


@functools.lru_cache(maxsize=None)
def _composed(*overrides: str):
    return compose_config("+recipe=gpt_tiny", *overrides)


def _with(changes: dict, base: tuple = ()):
    """A fresh ``gpt_tiny`` config (composed once per ``base``) with ``changes`` {"section.key": value}."""
    cfg = copy.deepcopy(_composed(*base))
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        setattr(getattr(cfg, section), key, value)
    return cfg


def _error(changes: dict, base: tuple = ()) -> PlanError:
    with pytest.raises(PlanError) as info:
        resolve(_with(changes, base), CPU)
    return info.value


CASES = {  # id -> (changes of gpt_tiny, key, fragments of the message)
    "data_format_unknown": ({"data.format": "markdown"}, "data.format", ["'markdown' is not one of", "chat"]),
    "data_sample_by_unknown": ({"data.sample_by": "sentence"}, "data.sample_by", ["'sentence' is not one of", "paragraph"]),
    "data_num_proc_zero": ({"data.num_proc": 0}, "data.num_proc", ["must be >= 1, got 0"]),
    "files_without_path": ({"data.source": "files"}, "data.path", ["data.source=files needs data.path"]),
    "hf_without_name": ({"data.source": "hf"}, "data.name", ["data.source=hf needs data.name"]),
    "val_fraction_out_of_range": ({"data.val_fraction": 1.0}, "data.val_fraction", ["must be in [0, 1), got 1.0"]),
    "val_path_with_embedded": ({"data.val_path": "val.jsonl"}, "data.val_path",
                               ["only for data.source=files or disk", "this run: embedded"]),
    "val_split_with_embedded": ({"data.val_split": "test"}, "data.val_split",
                                ["only for data.source=hf or disk", "this run: embedded"]),
    "two_validation_sources": ({"data.source": "files", "data.path": "a.jsonl", "data.val_fraction": 0.1,
                                "data.val_path": "b.jsonl"}, "data.val_fraction",
                               ["both define validation records; use one of them"]),
    "eval_every_negative": ({"trainer.eval_every": -1}, "trainer.eval_every", ["must be >= 0", "got -1"]),
    "eval_every_without_validation": ({"trainer.eval_every": 5}, "trainer.eval_every",
                                      ["5 needs validation records", "data.val_fraction"]),
    "epochs_not_positive": ({"trainer.epochs": 0.0}, "trainer.epochs", ["must be > 0 or null", "got 0.0"]),
    "hang_timeout_not_positive": ({"trainer.hang_timeout_s": 0.0}, "trainer.hang_timeout_s",
                                  ["must be > 0 seconds or null", "got 0.0"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_rule_names_the_key(case):
    changes, key, fragments = CASES[case]
    err = _error(changes)
    assert err.key == key, str(err)
    for fragment in fragments:
        assert fragment in str(err), (fragment, str(err))


def test_hang_timeout_s_from_the_command_line_is_typed_and_accepted():
    assert _composed("trainer.hang_timeout_s=600").trainer.hang_timeout_s == 600.0
    assert _composed().trainer.hang_timeout_s is None  # off by default
    for value in (None, 0.5, 600.0):
        resolve(_with({"trainer.hang_timeout_s": value}), CPU)
