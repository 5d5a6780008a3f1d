"""Config rules that had no test of their own (found while writing ``docs/errors.md``): each
changes one key of ``gpt_tiny`` and asserts the ``PlanError`` key and the message. And the errors
found while composing (a wrong type, a value outside a fixed choice, an unknown key): one line
naming the key and what it accepts."""
from __future__ import annotations

import pytest

from hydra.errors import ConfigCompositionException
from omegaconf.errors import OmegaConfBaseException

from helpers.config import cfg_of, compose
from hybridtrain.config.explain import message
from hybridtrain.plan import Machine, PlanError, resolve

CPU = Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=4)


def _with(changes: dict, base: tuple = ()):
    """A fresh ``gpt_tiny`` config (composed once per ``base``) with ``changes`` {"section.key": value}."""
    cfg = cfg_of("+recipe=gpt_tiny", *base)
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        setattr(getattr(cfg, section), key, value)
    return cfg


def _error(changes: dict, base: tuple = ()) -> PlanError:
    with pytest.raises(PlanError) as info:
        resolve(_with(changes, base), CPU)
    return info.value


CASES = {  # id -> (changes of gpt_tiny, key, fragments of the message)
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
    assert cfg_of("+recipe=gpt_tiny", "trainer.hang_timeout_s=600").trainer.hang_timeout_s == 600.0
    assert cfg_of("+recipe=gpt_tiny").trainer.hang_timeout_s is None  # off by default
    for value in (None, 0.5, 600.0):
        resolve(_with({"trainer.hang_timeout_s": value}), CPU)


COMPOSE_CASES = {  # id -> (overrides of gpt_tiny, the whole message after "[hybridtrain] config error: ")
    "wrong_type": (["parallel.tp=abc"], "parallel.tp: 'abc' is not an integer"),
    "wrong_type_or_null": (["parallel.dp=x"], "parallel.dp: 'x' is not an integer or null"),
    "wrong_type_number": (["optim.lr=fast"], "optim.lr: 'fast' is not a number"),
    "wrong_type_list": (["optim.betas=3"], "optim.betas: 3 is not a list of numbers"),
    "null_for_a_required_int": (["trainer.max_steps=null"], "trainer.max_steps: null is not an integer"),
    "precision_unknown": (["trainer.precision=fp33"], "trainer.precision: 'fp33' is not one of [fp32, bf16, fp16] or null"),
    "attn_implementation_unknown": (["model.attn_implementation=flash"],
                                    "model.attn_implementation: 'flash' is not one of [sdpa, eager, flash_attention_2] or null"),
    "partition_unknown": (["parallel.partition=random"],
                          "parallel.partition: 'random' is not one of [balanced, blocks, uniform, parameters]"),
    "data_source_unknown": (["data.source=openwebtext"],
                            "data.source: 'openwebtext' is not one of [embedded, files, disk, hf]"),
    "data_format_unknown": (["data.format=markdown"],
                            "data.format: 'markdown' is not one of [text, chat, prompt_completion, preference]"),
    "data_sample_by_unknown": (["data.sample_by=sentence"],
                               "data.sample_by: 'sentence' is not one of [document, paragraph, line]"),
    "launcher_name_unknown": (["launcher.name=kubernetes"],
                              "launcher.name: 'kubernetes' is not one of [local, slurm, multinode]"),
    "logger_name_unknown": (["logger.name=mlflow"], "logger.name: 'mlflow' is not one of [none, tensorboard, wandb]"),
    "slurm_key_with_local_launcher": (["launcher.partition=gpu"], "launcher.partition: a key of launcher=slurm, "
                                      "not of launcher=local (this run's); add launcher=slurm"),
    "appended_slurm_key_with_local_launcher": (["+launcher.partition=gpu"], "launcher.partition: a key of "
                                               "launcher=slurm, not of launcher=local (this run's); add launcher=slurm"),
    "multinode_key_with_slurm_launcher": (["launcher=slurm", "launcher.hostfile=hosts.txt"], "launcher.hostfile: a key "
                                          "of launcher=multinode, not of launcher=slurm (this run's); add launcher=multinode"),
    "launcher_name_without_its_group": (["launcher.name=slurm"], "launcher.name: the launcher is chosen with its "
                                        "group: use launcher=slurm instead of launcher.name=slurm"),
    "unknown_key": (["parallel.tpp=2"], "parallel.tpp: parallel has no key 'tpp'; did you mean tp or pp?"),
    "appended_unknown_key": (["+parallel.tpp=2"], "parallel.tpp: parallel has no key 'tpp'; did you mean tp or pp?"),
    "unknown_top_level_key": (["steps=3"], "steps: the config has no key 'steps'; its keys are ['data', 'finetune', "
                              "'launcher', 'logger', 'model', 'optim', 'parallel', 'plan', 'run_dir', 'trainer']"),
    "new_hf_key_without_plus": (["model.config.n_innerr=3"],
                                "model.config.n_innerr: not in the config; add it with +model.config.n_innerr=VALUE"),
}


@pytest.mark.parametrize("case", sorted(COMPOSE_CASES))
def test_compose_error_is_one_line_naming_the_key(case):
    overrides, expected = COMPOSE_CASES[case]
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException, PlanError)) as info:
        compose("+recipe=gpt_tiny", *overrides)  # composes and types the config, as the CLIs do
    assert message(info.value) == expected


def test_the_right_launcher_keys_compose():
    slurm = compose("+recipe=gpt_tiny", "launcher=slurm", "launcher.partition=gpu", "launcher.time=01:00:00")
    assert (slurm.launcher.name, slurm.launcher.partition, slurm.launcher.time) == ("slurm", "gpu", "01:00:00")
    multi = compose("+recipe=gpt_tiny", "launcher=multinode", "launcher.hostfile=hosts.txt")
    assert (multi.launcher.name, multi.launcher.hostfile, multi.launcher.nodes) == ("multinode", "hosts.txt", 2)
    local = compose("+recipe=gpt_tiny")
    assert local.launcher.name == "local" and not hasattr(local.launcher, "partition")
