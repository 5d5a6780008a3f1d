"""``pip install .`` (not editable) ships the configs, the recipes and the SLURM job template: the
installed package trains ``+recipe=gpt_tiny`` from a directory that holds no checkout.

The virtual environment sees this machine's site-packages (``--system-site-packages``) for torch,
DeepSpeed and transformers (installing those afresh would download gigabytes); hybridtrain itself
is installed into it from a copy of the checkout (pip builds in the source folder, leaving ``build/``
there), and the test checks that the installed copy, not the checkout, is what runs.
"""
from __future__ import annotations

import pytest

import json
import os
import shutil
import subprocess
import venv
from pathlib import Path

from helpers.config import ROOT

SHIPPED = ("pyproject.toml", "README.md", "hybridtrain", "conf", "recipes", "slurm")
"""What the build reads: the package (with its links ``_conf`` and ``_slurm``) and the folders they point at."""


def _copy_project(dest: Path) -> Path:
    dest.mkdir()
    for name in SHIPPED:
        src = ROOT / name
        if src.is_dir():  # links kept as links: hybridtrain/_conf -> ../conf, conf/recipe -> ../recipes
            shutil.copytree(src, dest / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)
    return dest


@pytest.mark.slow  # a venv and a wheel build; CI installs the checkout as the README does
def test_wheel_install_trains_from_another_directory(tmp_path):
    source = _copy_project(tmp_path / "source")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)  # pip: the machine's, run with the venv's python
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HYBRIDTRAIN_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    # --no-build-isolation / --no-deps: setuptools and the dependencies come from the machine (offline, fast)
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--quiet",
                              str(source)], env=env, capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(python), "-c", "import hybridtrain.config as c, hybridtrain.launch.slurm as s; "
                            "print(c.__file__); print(c.CONF_DIR); print(s.TEMPLATE)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    module, conf, template = map(Path, where.stdout.split())
    site = env_dir / "lib"
    for path in (module, conf, template):  # the installed copy, not the checkout (or an editable install of another checkout)
        assert site in path.parents, f"{path} is not inside {env_dir}"
    assert (conf / "config.yaml").is_file() and (conf / "recipe" / "gpt_tiny.yaml").is_file() and template.is_file()
    assert not (conf / "recipe").is_symlink()  # the wheel holds the recipes themselves

    run_dir = tmp_path / "run"
    proc = subprocess.run([str(env_dir / "bin" / "hybridtrain"), "+recipe=gpt_tiny", "trainer.max_steps=2",
                           "trainer.save_final=false", "trainer.report=false", f"hydra.run.dir={run_dir}"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line and '"val_loss"' not in line]
    assert [r["step"] for r in steps] == [1, 2]

    # the SLURM launcher renders its job script from the template inside the wheel (no SLURM needed to write it)
    job_dir = tmp_path / "job"
    slurm = subprocess.run([str(python), "-m", "hybridtrain", "+recipe=gpt_tiny", "launcher=slurm",
                            "launcher.submit=false", f"hydra.run.dir={job_dir}"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert slurm.returncode == 0, slurm.stdout[-4000:] + slurm.stderr[-4000:]
    assert "srun" in (job_dir / "job.sbatch").read_text()
