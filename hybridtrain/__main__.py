"""``python -m hybridtrain +recipe=NAME key=value ...``: compose, validate, launch.

Hydra composes the config once, here; the plan is validated before any worker starts; the
resolved ``config.yaml`` and ``plan.json`` are written into the run directory, which the
workers (started by the deepspeed runner) read.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from hybridtrain.config import CONF_DIR, register_schema

register_schema()


def summary(plan, hf_config, params: int) -> str:
    """Derived numbers printed at start-up."""
    from hybridtrain.models.units import count_blocks

    lines = [
        f"model     {hf_config.model_type}: {params / 1e6:.2f}M parameters, {plan.num_layers} layers, "
        f"vocab {plan.vocab_size} (padded to {plan.padded_vocab_size})",
        f"plan      {plan.dims.product()} = {plan.world_size} rank(s), "
        f"ZeRO-{plan.zero_stage}, {plan.precision}",
        f"batch     global {plan.global_batch_size} = micro {plan.micro_batch_size} x accumulation "
        f"{plan.grad_accum} x dp {plan.dims.dp}; {plan.tokens_per_step} tokens/step "
        f"({plan.global_batch_size} x {plan.seq_len})",
    ]
    for s in range(plan.dims.pp):
        names = plan.stage_layers(s)
        blocks = count_blocks(names)
        lines.append(f"stage {s}   {blocks} block(s): {', '.join(names)}")
    if plan.dims.pp > 1:
        lines.append(f"pipeline  {plan.grad_accum} micro-batches per step, 1F1B bubble (pp-1)/(m+pp-1) = {plan.bubble:.1%}")
    return "\n".join("[hybridtrain] " + ln for ln in lines)


class Refusal(Exception):
    """A config refused before planning names its own key (a validation or cache-folder message)."""


def run(cfg: DictConfig) -> int:
    """Validate and launch one composed config; return the exit code.

    Every refusal before a worker starts (config, plan, resume, launcher, data) is a :class:`PlanError` or a
    :class:`Refusal` raised by one of the phases below, printed here as one ``config error`` line, exit code 2."""
    from hybridtrain.errors import PlanError

    try:
        checked = _checked(cfg)
    except (PlanError, Refusal) as err:
        print(f"[hybridtrain] config error: {err}", file=sys.stderr)
        return 2
    try:
        prepared = _prepared_data(*checked)
    except PlanError as err:
        print(f"[hybridtrain] config error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # prepare removed its temporary folder: nothing is cached, no rank started
        print("\n[hybridtrain] interrupted while preparing the data (Ctrl-C): nothing cached, no worker started",
              file=sys.stderr, flush=True)
        return 130
    return _launch(*checked, prepared)


def _checked(cfg: DictConfig):
    """The typed config, its validated plan, the HF config, the machine, the early preloader and the run
    directory, after every check that needs no data: raises :class:`PlanError` naming what to fix."""
    from hydra.core.hydra_config import HydraConfig

    from hybridtrain.config import to_config
    from hybridtrain.config.explain import message
    from hybridtrain.launch.cachedir import check_caches, matplotlib_dir
    from hybridtrain.launch.dispatch import check
    from hybridtrain.launch.local import early_preloader
    from hybridtrain.observe.checks import check_observe
    from hybridtrain.plan import PlanError, apply_pretrained_defaults, machine_facts, resolve

    try:
        typed = to_config(cfg)
    except Exception as err:  # noqa: BLE001 - OmegaConf validation errors (e.g. an appended unknown key)
        raise Refusal(message(err)) from None
    problem = check_caches(None if _deferred(typed) else typed.data.cache_dir)  # the planner writes the shapes
    if problem is not None:
        raise Refusal(problem)
    if (mpl := matplotlib_dir()) is not None:  # an unwritable HOME: the report's matplotlib would warn
        os.environ["MPLCONFIGDIR"] = str(mpl)
    preloader = early_preloader(typed.launcher, os.environ)  # before the planner first calls torch
    apply_pretrained_defaults(typed)
    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    typed.run_dir = str(run_dir)
    machine = machine_facts()
    plan, hf_config = resolve(typed, machine, announce=print)  # parallel=auto says what it chose
    check_observe(typed)  # profile steps, peak, logger package: before any worker starts
    if typed.trainer.resume:
        from hybridtrain.checkpoint.resume import resolve_resume

        found = resolve_resume(typed, plan, hf_config, run_dir)
        print(f"[hybridtrain] resume: {found or 'no checkpoint in ' + str(run_dir) + ', starting fresh'}")
        typed.trainer.resume = str(found) if found else None
    if typed.launcher.name == "local" and typed.launcher.nodes > 1 and not typed.launcher.dry_run:
        raise Refusal(f"launcher.nodes={typed.launcher.nodes}: the local launcher runs on one machine; use "
                        "launcher.nodes=1, launcher=slurm or launcher=multinode, or launcher.dry_run=true to "
                        "validate a multi-node plan here")
    check(typed.launcher, plan, machine)
    return typed, plan, hf_config, machine, preloader, run_dir


def _deferred(typed) -> bool:
    """A SLURM script written but not submitted: it prepares its data on the job's node, when it starts."""
    return typed.launcher.name == "slurm" and not typed.launcher.submit


def _prepared_data(typed, plan, hf_config, machine, preloader, run_dir):
    """Print the run's summary, then tokenize once, here (none for a dry run or a deferred SLURM script):
    every input problem is a :class:`PlanError` before any worker starts."""
    from hybridtrain.data.preference import tokenization_of
    from hybridtrain.data.prepare import prepare
    from hybridtrain.launch.interrupt import delivered
    from hybridtrain.models.families import family_of
    from hybridtrain.plan.costs import has_score_head, model_facts
    from hybridtrain.plan.data import check_data_counts

    params = model_facts(family_of(typed.model), hf_config, plan.seq_len,
                         score_head=has_score_head(typed)).total_params()  # one meta block
    print(summary(plan, hf_config, params), flush=True)
    if typed.finetune.method == "lora":
        from hybridtrain.models.hf_model import meta_model
        from hybridtrain.plan.lora import describe

        print(f"[hybridtrain] {describe(typed, hf_config, meta_model(hf_config))}", flush=True)
    if typed.launcher.dry_run or _deferred(typed):
        return None
    with delivered():  # a Ctrl-C in a weakref callback still interrupts
        prepared = prepare(typed.data, typed.trainer.seed, pairs=tokenization_of(typed.finetune.objective))
    n_train, n_val = prepared.num_samples("train"), prepared.num_samples("val")
    typed.trainer.max_steps = check_data_counts(typed, plan, n_train, n_val)
    print(f"[hybridtrain] data      {typed.data.source} {typed.data.format}: train {n_train} samples"
          f" ({typed.trainer.max_steps} steps = {typed.trainer.max_steps * plan.global_batch_size / n_train:.2f} epochs)"
          + (f", validation {n_val} samples" if n_val else ""), flush=True)
    if typed.trainer.resume:  # the checkpoint's meta.json records its data by content
        from hybridtrain.checkpoint.resume import data_note

        note = data_note(Path(typed.trainer.resume), prepared)
        if note:
            print(f"[hybridtrain] {note}", flush=True)
    return prepared


def _launch(typed, plan, hf_config, machine, preloader, run_dir, prepared) -> int:
    """Write the run directory's config, plan and data, then start the workers (or stop, for a dry run)."""
    from hybridtrain.launch.dispatch import start
    from hybridtrain.rundir import RunDir

    run_dir.mkdir(parents=True, exist_ok=True)
    files = RunDir(run_dir)  # written atomically: with launcher.no_ssh every node's controller writes them
    files.write_config(typed)
    files.write_plan(plan)
    if typed.launcher.dry_run:
        print(f"[hybridtrain] dry run: plan valid, {files.config_file} written, no worker started", flush=True)
        return 0
    if prepared is not None:  # where the workers memory-map the samples
        files.write_data(prepared)
    code = start(run_dir, plan, typed.launcher, machine, preloader)
    if code != 0 and typed.launcher.name != "slurm":  # the slurm launcher names the job's log itself
        from hybridtrain.launch.output import LOG_NAME

        log = "" if typed.launcher.verbose else f", DeepSpeed's log is {run_dir / LOG_NAME}"
        print(f"[hybridtrain] training failed (exit code {code}); the worker output is above{log}, "
              f"the run directory is {run_dir}", file=sys.stderr)
    return code


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    code = run(cfg)
    if code:
        sys.exit(code)


def main() -> None:
    """Console-script entry point (``hybridtrain ...``); a config Hydra cannot compose exits with code 2."""
    from hybridtrain.config.explain import run_hydra
    from hybridtrain.versions import require_tested_versions

    require_tested_versions()
    try:
        run_hydra(_hydra_main)
        code = 0
    except SystemExit as stop:
        code = stop.code
    _leave(code)


def _leave(code) -> None:
    """Exit with ``code`` (as ``sys.exit`` takes it) without the interpreter's teardown: with torch
    loaded that takes a while after the job already ended; output is flushed and log files closed first.
    An exception other than ``SystemExit`` never gets here: it keeps Python's traceback and exit."""
    import logging

    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    main()
