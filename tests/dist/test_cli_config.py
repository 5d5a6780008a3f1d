"""The real CLI in dry-run mode: it writes what workers read, validates cluster recipes, exits 2 on a
bad plan or a config Hydra cannot compose (one line, also in a sweep and in ``python -m hybridtrain.plan``);
the plan and config code never import DeepSpeed (checked in a fresh interpreter)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.config import ROOT, compose
from hybridtrain.cli import Background
from hybridtrain.plan import machine_facts, resolve
from hybridtrain.rundir import RunDir


def test_plan_code_does_not_import_deepspeed():
    code = ("import hybridtrain, hybridtrain.plan, hybridtrain.plan.validate, hybridtrain.config, sys; "
            "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_harness_and_run_dir_import_neither_torch_nor_deepspeed():
    code = ("import hybridtrain.cli, hybridtrain.rundir, sys; "
            "assert not {'torch', 'deepspeed'} & set(sys.modules), sorted({'torch', 'deepspeed'} & set(sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


CLI_RUNS = {
    "gpt_tiny": ["+recipe=gpt_tiny", "launcher.dry_run=true"],
    "bad_tp": ["+recipe=gpt_tiny", "launcher.dry_run=true", "parallel.tp=5"],
    "llama_7b": ["+recipe=llama_7b", "launcher.dry_run=true"],
    **{name: ["+recipe=gpt_tiny", "launcher.dry_run=true", override] for name, override in {
        "wrong_type": "parallel.tp=abc", "batch_zero": "trainer.global_batch_size=0",
        "precision_unknown": "trainer.precision=fp33", "slurm_key_local": "launcher.partition=gpu",
        "attn_unknown": "model.attn_implementation=flash"}.items()},
    "sweep_with_a_bad_value": ["-m", "+recipe=gpt_tiny", "launcher.dry_run=true", "trainer.precision=fp32,fp33"],
}


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """The CLI runs of this module, started together; ``cli[name]`` is ``(run_dir, Background)``."""
    base = tmp_path_factory.mktemp("cli")
    runs = {}
    for name, overrides in CLI_RUNS.items():
        run_dir = base / name / "run"
        runs[name] = (run_dir, Background(run_dir, overrides, base / name, cwd=base / name,
                                          env={"HYBRIDTRAIN_CACHE": str(base / "token_cache")}))
    yield runs
    for _, run in runs.values():
        run.kill()


def test_cli_dry_run_writes_config_and_plan(cli):
    run_dir, run = cli["gpt_tiny"]
    proc = run.result()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dry run" in proc.stdout and "launching" not in proc.stdout
    assert "plan      dp=1 x tp=1 x pp=1 = 1 rank(s)" in proc.stdout

    saved = RunDir(run_dir).config()
    expected = compose(*CLI_RUNS["gpt_tiny"])
    expected.run_dir = str(run_dir.resolve())
    plan, _ = resolve(expected, machine_facts())  # fills the null keys (attention, vocabulary padding) as the run did
    assert saved == expected
    assert RunDir(run_dir).plan_record() == plan.to_dict()


def test_cli_dry_run_prepares_no_data(cli):
    # launcher.dry_run: "without preparing data or starting workers"
    for _, run in cli.values():
        run.result()
    run_dir, run = cli["gpt_tiny"]
    assert run.result().returncode == 0
    cache = run_dir.parents[1] / "token_cache"  # HYBRIDTRAIN_CACHE of every run
    # the planner's shapes (hybridtrain/models/shapes.py) are no data
    assert not cache.exists() or not [p for p in cache.iterdir() if p.name != "shapes"]


def test_cli_bad_plan_exits_2_before_writing_the_plan(cli):
    run_dir, run = cli["bad_tp"]
    proc = run.result()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "config error: parallel.tp" in proc.stderr and "n_head=6" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not RunDir(run_dir).plan_file.exists()


def test_cli_llama_7b_dry_run_validates_the_cluster_plan(cli):
    """The GPU recipe is validated and planned on any machine (one 8-GPU node: dp fills it); nothing is
    launched; activation checkpointing, null in the recipe, is resolved in config.yaml."""
    run_dir, run = cli["llama_7b"]
    proc = run.result()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dp=2 x tp=2 x pp=2 = 8 rank(s)" in proc.stdout and "launching" not in proc.stdout
    assert "activation checkpointing off (parallel.activation_checkpointing: null)" in proc.stdout
    plan = RunDir(run_dir).plan_record()
    assert (plan["world_size"], plan["nodes"], plan["stage_bounds"]) == (8, 1, [0, 17, 35])
    config = RunDir(run_dir).config()
    assert config.launcher.nodes == 1 and config.parallel.activation_checkpointing is False


CONFIG_ERRORS = {  # CLI run -> its whole stderr
    "wrong_type": "parallel.tp: 'abc' is not an integer",
    "batch_zero": "trainer.global_batch_size: must be >= 1, got 0",
    "precision_unknown": "trainer.precision: 'fp33' is not one of [fp32, bf16, fp16] or null",
    "slurm_key_local": "launcher.partition: a key of launcher=slurm, not of launcher=local (this run's); add launcher=slurm",
    "attn_unknown": "model.attn_implementation: 'flash' is not one of [sdpa, eager, flash_attention_2] or null",
    "sweep_with_a_bad_value": "trainer.precision: 'fp33' is not one of [fp32, bf16, fp16] or null",
}


@pytest.mark.parametrize("name", sorted(CONFIG_ERRORS))
def test_cli_config_error_is_one_line_and_exit_2(cli, name):
    run_dir, run = cli[name]
    proc = run.result()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [f"[hybridtrain] config error: {CONFIG_ERRORS[name]}"], proc.stderr
    assert not (run_dir / "plan.json").exists()


def test_cli_sweep_with_a_bad_value_starts_no_job(cli):
    """Hydra composes every job of a sweep before the first starts: the good fp32 job did not run."""
    run_dir, run = cli["sweep_with_a_bad_value"]
    assert run.result().returncode == 2
    assert not list(run_dir.parent.glob("**/config.yaml"))  # the sweep folder is under the working directory


def test_plan_cli_config_error_is_one_line_and_exit_2(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "hybridtrain.plan", "+recipe=gpt_tiny", "trainer.precision=fp33"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == "[hybridtrain] config error: trainer.precision: 'fp33' is not one of [fp32, bf16, fp16] or null"


@pytest.mark.parametrize("module", ["hybridtrain", "hybridtrain.plan"])
def test_an_untested_old_transformers_is_one_line_before_anything(tmp_path, module):
    """A metadata folder first on the path makes the interpreter report transformers 5.17.0 (its modules still
    import from site-packages): the command stops at once with the install line, exit 2."""
    info = tmp_path / "fake" / "transformers-5.17.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 5.17.0\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", module, "+recipe=gpt_tiny", "launcher.dry_run=true",
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "[hybridtrain] error: transformers 5.17.0 is older than hybridtrain supports (>= 5.24.0, the version CI "
        "tests); install it with: pip install 'transformers>=5.24.0,<5.26'"]
    assert not (tmp_path / "run").exists()
