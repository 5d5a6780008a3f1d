"""Every command the documentation shows runs as written (issue 28.13).

The commands come from the fenced code blocks of ``README.md`` and ``docs/*.md``
(:mod:`helpers.doc_commands`). Each is either run, or listed in :data:`NOT_RUN` with the reason it cannot run
here; :func:`test_every_documented_command_is_run_or_listed` fails when a page shows a command that is
neither (and when a listed one is no longer shown).

How a command is run (:func:`prepare`), page by page, from a fresh folder of the page (``PAGE``) that stands
for the repository root: it holds the files the pages name (:func:`make_page_folder`) and links to the
repository's ``tests/`` and ``scripts/``; ``PYTHONPATH`` puts this checkout's package first. The text is
changed only as follows, each change documented at the rule that makes it:

- absolute ``/tmp/...`` and ``/shared/...`` paths move into ``PAGE`` (``PAGE/tmp/...``), so tests never share
  a folder;
- a training command without ``hydra.run.dir`` gets its own (a run directory refuses a
  second run; two commands started in the same second would get the same dated folder), ``runs/PAGE-L<line>``,
  a sweep ``hydra.sweep.dir=sweeps/PAGE-L<line>``; ``RUN_DIR`` stands for the run directory of the page's previous
  training command;
- ``trainer.report=false`` on training runs (the end-of-run report's plots cost CPU time;
  ``helpers.launch.NO_REPORT``);
- ``+recipe=gpt_small`` (92M parameters) is shrunk to 4 layers 96 wide for 6 steps (its warmup is 5; the
  profiled steps 5 and 6 exist);
- cluster commands: ``launcher=slurm`` writes its script without submitting (``launcher.submit=false``;
  ``launcher.wait`` needs a submission), ``launcher=multinode`` and the default 6.5B ``model=llama`` are
  dry runs (``launcher.dry_run=true``).

The exit code must be the one the page implies: 2 where its shown output is a config or export error,
else 0. CI runs the quick commands (plans, dry runs, scripts written, ``--help``-like commands, config
errors), one test each; the slow tier runs each page's other commands in page order, since later ones
read what earlier ones wrote (a run, then its resume, then its export); a "Worked example" section, which
starts from an empty folder, runs in one of its own.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.doc_commands import Command, extract

REPO = Path(__file__).resolve().parents[2]
COMMANDS = extract(REPO)

NETWORK = "installs packages from the package index (network; CI runs the installer itself)"
SUITE = "runs (part of) this test suite: CI and the slow tier run it themselves"
NOT_RUN: dict[str, str] = {
    "bash scripts/install.sh && python -m hybridtrain +recipe=gpt_small": NETWORK,
    "bash scripts/install.sh --dev && python -m pytest -q -n 2 --dist loadfile": NETWORK,
    "bash scripts/install.sh --cuda 12.4": NETWORK + " and a CUDA build of torch",
    "bash scripts/install.sh --cuda 12.8 --dev": NETWORK + " and a CUDA build of torch",
    "bash scripts/install.sh": NETWORK,
    "bash scripts/install.sh --dev": NETWORK,
    "python -m pytest -q -n 2 --dist loadfile": SUITE,
    "python -m pytest -q": SUITE,
    "python -m pytest -q tests/unit": SUITE,
    "python -m pytest -q tests/dist": SUITE,
    "python -m pytest -q -m slow -n 2 --dist loadfile": SUITE,
    "python -m pytest -q tests/unit/test_plan.py": SUITE,
    'python -m pytest -q tests/dist/test_parity.py -k "gpt_tiny and dp2_tp2_pp2"': SUITE,
    "HYBRIDTRAIN_TEST_GPU=1 python -m pytest -q tests/gpu": "needs a GPU (the GPU tier; on a CPU every test skips)",
    "bash scripts/gpu_check.sh": "needs a GPU (the prepared GPU check)",
    "bash scripts/gpu_check.sh --dry-run": "the whole GPU check on a CPU, minutes: tests/dist/test_gpu_check_script.py runs it (slow)",
    "bash scripts/gpu_wheels.sh": NETWORK + " (downloads and builds the GPU image's missing wheels)",
    "python -m bench.run --quick": "the benchmark suite: many minutes on a quiet machine (bench/ results)",
    "python -m bench.run": "the benchmark suite: an hour or more on a quiet machine",
    "python -m bench.run --soak": "2000 steps per layout: a soak test of many minutes",
    "python -m bench.lora": "a benchmark of minutes (LoRA against full fine-tuning), results in bench/results",
    "python -m bench.dpo_trl": "a benchmark of minutes (DPO against TRL's DPOTrainer), results in bench/results",
    "python -m hybridtrain +recipe=gpt_small data=hf data.name=my_org/my_set data.split=train":
        "reads a dataset from the Hugging Face Hub (network; tests/dist/test_data_e2e.py reads a local one)",
    "python -m hybridtrain.export CHECKPOINT OUT_DIR [--max-shard-size 5GB] [--overwrite]":
        "a synopsis (placeholders in capitals, optional parts in brackets), not a command",
    "bash scripts/slurm_up.sh": "brings up the test SLURM cluster (root, apt): tests/dist/test_slurm.py runs it",
    "bash scripts/slurm_down.sh": "stops the test SLURM cluster: tests/dist/test_slurm.py runs it",
    "python -m hybridtrain +recipe=gpt_tiny parallel.dp=2 parallel.pp=2 launcher=slurm launcher.nodes=2 "
    "launcher.gpus_per_node=2 launcher.threads_per_rank=1 launcher.wait=true":
        "a job on the test SLURM cluster: tests/dist/test_slurm.py runs this job (dp=2 x pp=2 on 2 nodes x 2 ranks)",
}
"""Documented commands that do not run here, with the reason (exact text, as extracted)."""

GPT_SMALL_SHRUNK = {"model.config.n_layer": "4", "model.config.n_embd": "96", "trainer.max_steps": "6"}
"""``+recipe=gpt_small`` in the slow tier: GPT-2 small's 12 x 768 blocks take minutes per command on a
2-core CPU; 4 x 96 blocks (its 12 heads of 8) run the same code; 6 steps cover its warmup of 5 and the
profiled steps 5 and 6 of docs/observability.md."""


@dataclass
class Prepared:
    """How one documented command runs: its tier (``quick``: CI; ``slow``), the shell text to run, the
    exit code it must end with and, for a training run, its run directory (for ``RUN_DIR``)."""

    command: Command
    tier: str
    text: str
    expected: int
    run_dir: str | None = None


def _keys(text: str) -> dict[str, str]:
    """The ``key=value`` overrides of a command (``+``/``~`` prefixes dropped)."""
    out = {}
    for token in shlex.split(text):
        if "=" in token and not token.startswith("-"):
            key, value = token.split("=", 1)
            out[key.lstrip("+~")] = value
    return out


def with_overrides(text: str, values: dict[str, str]) -> str:
    """``text`` with each ``key=value`` of ``values`` replacing the command's own value of that key, or
    appended (Hydra refuses a key given twice)."""
    for key, value in values.items():
        pattern = re.compile(rf"(?<!\S)(\+?){re.escape(key)}=\S+")
        if pattern.search(text):
            text = pattern.sub(lambda m: f"{m.group(1)}{key}={value}", text, count=1)
        else:
            text = f"{text} {key}={value}"
    return text


def is_training(text: str) -> bool:
    """Whether ``text`` is a ``python -m hybridtrain`` (or ``hybridtrain``) run of the trainer."""
    return bool(re.match(r"^(python -m hybridtrain|hybridtrain)( |$)", text))


def prepare(cmd: Command, previous_run: str | None = None) -> Prepared | None:
    """The :class:`Prepared` run of ``cmd`` (None: listed in :data:`NOT_RUN`). Raises ``LookupError`` for a
    command no rule covers."""
    if cmd.text in NOT_RUN:
        return None
    text = re.sub(r"(?<![\w.])/(tmp|shared)/", r"PAGE/\1/", cmd.text)
    expected = cmd.expected_exit
    if re.match(r"^python -m hybridtrain\.plan ", text):  # a plan: no processes
        return Prepared(cmd, "quick", text, expected)
    if text.startswith("bash scripts/install.sh --dry-run"):  # prints the pip commands only
        return Prepared(cmd, "quick", text, expected)
    if text == "python -m bench.gpu_mfu":  # exits 0 without a GPU, saying so
        return Prepared(cmd, "quick", text, expected)
    if re.match(r"^python -m hybridtrain\.(export|report|verify) ", text) or re.match(
            r"^(python -c |python generate\.py$|ls )", text):
        text = text.replace("RUN_DIR", previous_run or "RUN_DIR")
        return Prepared(cmd, "slow", text, expected)  # reads or trains: in page order
    if not is_training(text):
        raise LookupError(cmd.where)
    keys = _keys(text)
    args = re.sub(r"^(python -m hybridtrain|hybridtrain)", "", text)
    sweep = bool(re.search(r"(?<!\S)(-m|--multirun)(?!\S)", args))
    own = {}
    if sweep and "hydra.sweep.dir" not in keys:
        own["hydra.sweep.dir"] = f"sweeps/{Path(cmd.page).stem}-L{cmd.line}"
    elif not sweep and "hydra.run.dir" not in keys:
        own["hydra.run.dir"] = f"runs/{Path(cmd.page).stem}-L{cmd.line}"
    run_dir = own.get("hydra.run.dir", keys.get("hydra.run.dir"))
    launcher = keys.get("launcher")
    if launcher == "slurm":  # the script is written and shown, not submitted (no cluster here)
        text = re.sub(r" launcher\.wait=\S+", "", text)
        return Prepared(cmd, "quick", with_overrides(text, {"launcher.submit": "false", **own}), expected, run_dir)
    if launcher == "multinode" or (keys.get("model") == "llama" and "recipe" not in keys):
        # other hosts over ssh / node 1 of two; the default LlamaConfig is 6.5B parameters: validated here
        return Prepared(cmd, "quick", with_overrides(text, {"launcher.dry_run": "true", **own}), expected, run_dir)
    if "--cfg" in text:  # Hydra prints the composed config and exits: no run directory
        return Prepared(cmd, "quick", text, expected)
    if keys.get("launcher.dry_run") == "true" or expected == 2:
        return Prepared(cmd, "quick", with_overrides(text, own), expected, run_dir)
    extra = {**own, "trainer.report": "false"}
    if keys.get("recipe") == "gpt_small":
        extra.update(GPT_SMALL_SHRUNK)
    return Prepared(cmd, "slow", with_overrides(text, extra), expected, run_dir)


def folder_of(cmd: Command) -> str:
    """The folder a slow command runs in: its page's, or for a "Worked example" section (which says it
    starts from nothing, "run in /tmp/docs_demo") a fresh one of its own."""
    worked = "worked example" in cmd.heading.lower()
    return f"{cmd.page}#{cmd.heading}" if worked else cmd.page


def prepared_pages() -> dict[str, list[Prepared]]:
    """Every runnable command, page by page in page order (``RUN_DIR`` resolved to the run before it)."""
    pages: dict[str, list[Prepared]] = {}
    previous: dict[str, str] = {}
    for cmd in COMMANDS:
        p = prepare(cmd, previous.get(cmd.page))
        if p is None:
            continue
        if p.run_dir and p.tier == "slow":
            previous[cmd.page] = p.run_dir
        pages.setdefault(cmd.page, []).append(p)
    return pages


PAGES = prepared_pages()
QUICK = list({p.command.text: p for ps in reversed(PAGES.values()) for p in reversed(ps)
              if p.tier == "quick"}.values())[::-1]
"""The quick commands, each text once (the same dry run shown on three pages runs once)."""
SLOW_PAGES: dict[str, list[Prepared]] = {}
for _p in (p for ps in PAGES.values() for p in ps if p.tier == "slow"):
    SLOW_PAGES.setdefault(folder_of(_p.command), []).append(_p)

SCRIPTURE = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And God said, Let there be light: and there was light.",
    "And God saw the light, that it was good: and God divided the light from the darkness.",
]


def _records(n: int) -> list[str]:
    return [" ".join(SCRIPTURE[(i + j) % len(SCRIPTURE)] for j in range(6)) for i in range(n)]


def make_page_folder(page_dir: Path) -> None:
    """The files the pages' commands name, in the folder that stands for the repository root: data files
    (``my_texts.jsonl``, ``corpus/*.jsonl`` with a ``content`` field, ``chats.jsonl``/``chat.jsonl``,
    ``sft.jsonl``/``qa.parquet`` prompt-completion records, ``pairs.jsonl`` preference pairs,
    ``my_saved_dataset`` saved with ``datasets``), tiny
    ``save_pretrained`` model folders for ``path/to/hf_model``, ``path/to/llama``, ``path/to/gpt2``,
    ``path/to/qwen2.5-0.5b`` (a tiny Qwen2), ``path/to/qwen3-moe`` (a tiny Qwen3-MoE) and ``DIR``, a DeepSpeed hostfile ``hosts.txt``, and
    ``generate.py``, the transformers snippet of docs/checkpoints.md."""
    from helpers.families import make_family_checkpoint
    from helpers.finetune import make_checkpoint

    page_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tests", "scripts"):
        (page_dir / name).symlink_to(REPO / name)
    (page_dir / "tmp").mkdir()
    (page_dir / "shared").mkdir()
    texts = _records(120)
    (page_dir / "my_texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (page_dir / "corpus").mkdir()
    (page_dir / "corpus" / "a.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in texts))
    chats = [{"messages": [{"role": "user", "content": f"Recite verse {i}."},
                           {"role": "assistant", "content": t}]} for i, t in enumerate(texts)]
    for name in ("chats.jsonl", "chat.jsonl"):
        (page_dir / name).write_text("".join(json.dumps(c) + "\n" for c in chats))
    pairs = [{"prompt": f"Recite verse {i}.\n", "completion": t} for i, t in enumerate(texts)]
    (page_dir / "sft.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    import datasets

    datasets.Dataset.from_list(pairs).to_parquet(str(page_dir / "qa.parquet"))
    from hybridtrain.data.embedded import preference_pairs

    (page_dir / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in preference_pairs(64)))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(
        str(page_dir / "my_saved_dataset"))
    for rel, family in (("path/to/hf_model", "llama"), ("path/to/llama", "llama"), ("path/to/gpt2", "gpt2"),
                        ("DIR", "llama")):
        make_checkpoint(page_dir / rel, family)
    make_family_checkpoint(page_dir / "path/to/qwen2.5-0.5b", "qwen2")
    from helpers.moe import make_moe_checkpoint

    make_moe_checkpoint(page_dir / "path/to/qwen3-moe", "qwen3_moe")
    (page_dir / "hosts.txt").write_text("worker-1 slots=8\nworker-2 slots=8\n")
    page = (REPO / "docs" / "checkpoints.md").read_text()
    snippet = re.search(r"```python\n(from transformers import .*?)```", page, re.S)
    (page_dir / "generate.py").write_text(snippet.group(1) if snippet else "raise SystemExit('no snippet')\n")


def run_prepared(p: Prepared, page_dir: Path, timeout: float = 900) -> None:
    """Run one prepared command in ``page_dir``; fail with the end of its output on the wrong exit code
    (``AssertionError``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    text = p.text.replace("PAGE/", f"{page_dir}/")
    proc = subprocess.run(["bash", "-c", text], cwd=page_dir, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    out = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == p.expected, (f"{p.command.where}: `{p.command.text}` ran as `{text}` and exited "
                                           f"{proc.returncode}, the page implies {p.expected}:\n{out}")


def test_every_documented_command_is_run_or_listed():
    """A command a page shows is run by a rule of :func:`prepare` or listed in :data:`NOT_RUN` with its reason;
    a listed command that no page shows any more is dropped from the list."""
    uncovered = []
    for cmd in COMMANDS:
        try:
            prepare(cmd)
        except LookupError:
            uncovered.append(f"{cmd.where}: {cmd.text}")
    assert not uncovered, "documented commands neither run nor listed in NOT_RUN:\n" + "\n".join(uncovered)
    shown = {c.text for c in COMMANDS}
    assert not [t for t in NOT_RUN if t not in shown], "NOT_RUN lists commands no page shows"
    assert len(QUICK) >= 20 and sum(map(len, SLOW_PAGES.values())) >= 50  # the rules run most commands


@pytest.fixture(scope="module")
def quick_folder(tmp_path_factory) -> Path:
    """One folder for the quick commands (each writes into its own run directory there)."""
    folder = tmp_path_factory.mktemp("docs") / "page"
    make_page_folder(folder)
    return folder


@pytest.mark.parametrize("p", QUICK, ids=[f"{p.command.page}:{p.command.line}" for p in QUICK])
def test_quick_documented_command_runs(p, quick_folder):
    """A plan, a dry run, a script written, a config error: each documented one, as written."""
    run_prepared(p, quick_folder)


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(SLOW_PAGES))
def test_documented_commands_of_a_page_run_in_order(page, tmp_path):
    """The page's training runs, resumes, exports and the commands reading them, in page order (each is run
    even after one failed, so that one test names every failing command of the page)."""
    make_page_folder(tmp_path / "page")
    failed = []
    for p in SLOW_PAGES[page]:
        try:
            run_prepared(p, tmp_path / "page")
        except AssertionError as err:
            failed.append(str(err))
    assert not failed, "\n\n".join(failed)
