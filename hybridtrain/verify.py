"""``python -m hybridtrain.verify [RUN_DIR | overrides...]``: does this architecture train correctly
under this plan? A small twin of the model, a few steps, against one process.

The model keeps its family, its head to KV-head ratio, its MLP to hidden ratio, tied or untied
embeddings and tp divisibility, but gets few layers (at least one per stage) and small width.
Then two real runs through ``python -m hybridtrain`` on the same batches: the requested layout
(dp, tp, pp, ZeRO, micro-batch size, partition, precision, activation checkpointing) and
(1, 1, 1). Losses and gradient norms must agree step by step (fp32: 1e-4 and 1e-3 relative as in
``tests/dist/test_parity.py``; bf16/fp16: 3e-2); the exit code is 1 when they do not, 2 on a config error.

Options (before or after the overrides): ``--steps N`` (3), ``--out DIR`` (``runs/verify/<time>``).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TOLERANCE = {"fp32": (1e-4, 1e-3), "bf16": (3e-2, 3e-2), "fp16": (3e-2, 3e-2)}
"""(loss, grad norm) relative tolerance by ``trainer.precision``."""


@dataclass
class Verdict:
    """The comparison of two runs' metrics."""

    ok: bool
    lines: list[str]


def compare(got: list[dict], want: list[dict], precision: str) -> Verdict:
    """Step-by-step comparison of ``metrics.jsonl`` records (plan run vs one-process run)."""
    rel_loss, rel_norm = TOLERANCE[precision]
    lines, ok = [], len(got) == len(want) and len(want) > 0
    if not ok:
        lines.append(f"different numbers of steps: {len(got)} vs {len(want)}")
    for g, w in zip(got, want):
        dl = abs(g["loss"] - w["loss"]) / max(abs(w["loss"]), 1e-12)
        gn, wn = g.get("grad_norm"), w.get("grad_norm")
        dn = 0.0 if gn is None and wn is None else (
            math.inf if gn is None or wn is None else abs(gn - wn) / max(abs(wn), 1e-12))
        good = dl <= rel_loss and dn <= rel_norm and math.isfinite(g["loss"])
        ok &= good
        lines.append(f"step {g['step']}: loss {g['loss']:.6f} vs {w['loss']:.6f} (rel {dl:.1e}), grad norm "
                     f"{gn if gn is None else f'{gn:.6f}'} vs {wn if wn is None else f'{wn:.6f}'} (rel {dn:.1e})"
                     f"{'' if good else '  <-- differs'}")
    return Verdict(ok, lines)


def shrink(cfg, plan, hf_config, steps: int) -> dict:
    """Overrides of the small twin of ``cfg`` under its resolved ``plan`` (see the module docstring)."""
    from hybridtrain.models.families import family_of, mlp_width_of

    family = family_of(cfg.model)
    heads = int(getattr(hf_config, family.heads))
    kv = int(getattr(hf_config, family.kv_heads, None) or heads) if family.kv_heads else heads
    hidden = int(getattr(hf_config, family.hidden))
    width = mlp_width_of(family, hf_config)
    tp = plan.dims.tp
    kv_small = tp  # the fewest KV heads tp divides; heads keep their ratio to them
    heads_small = kv_small * (heads // kv)
    head_dim = 8
    hidden_small = heads_small * head_dim
    width_small = -(-max(tp, round(hidden_small * width / hidden)) // tp) * tp
    layers = max(2, plan.dims.pp)
    seq = min(plan.seq_len, 32)
    config = {k: v for k, v in cfg.model.config.items() if k not in ("vocab_size",)}
    config.update({family.n_layers: layers, family.hidden: hidden_small, family.heads: heads_small,
                   family.mlp_width: width_small, family.max_positions: max(seq, 64),
                   "tie_word_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False))})
    if family.kv_heads:
        config[family.kv_heads] = kv_small
    if "head_dim" in config or getattr(hf_config, "head_dim", None):
        config["head_dim"] = head_dim
    for key in family.dropout_keys:  # 0 in the twin: masks depend on the layout, so would any comparison
        if hasattr(hf_config, key):
            config[key] = 0.0
    micro_batches = max(2, plan.dims.pp)  # the pipeline runs more than one micro-batch
    return {"model": config, "seq_len": seq, "layers": layers,
            "global_batch_size": plan.micro_batch_size * plan.dims.dp * micro_batches, "steps": steps}


def fit_devices(plan, gpus: int) -> tuple[int, bool]:
    """``(dp, on_cpu)`` of the twin on this machine, which has ``gpus`` CUDA devices (0: CPU
    processes). The twin keeps tp, pp and ZeRO (what the check is about) and drops replicas until
    it fits the local GPUs; when even one replica (tp x pp ranks) needs more GPUs than there are,
    both runs use CPU processes (the twin is small; fp16 then needs CPU fp16 kernels)."""
    if gpus == 0 or plan.world_size <= gpus:
        return plan.dims.dp, False
    model_ranks = plan.dims.tp * plan.dims.pp
    if model_ranks <= gpus:
        return gpus // model_ranks, False
    return plan.dims.dp, True


def _value(v) -> str:
    """A Hydra override value."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_value(x)}" for k, x in v.items()) + "}"
    return "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"


def overrides(cfg, twin: dict, layout: dict, on_cpu: bool = False) -> list[str]:
    """Hydra overrides reproducing ``cfg`` with the twin model and ``layout`` (every leaf spelled out),
    run here by the local launcher (``on_cpu``: as CPU processes)."""
    from dataclasses import asdict

    # one ``++`` per HF key: the config dict is open (struct) only to keys that exist, ``++`` adds them
    from dataclasses import fields

    from hybridtrain.config.schema import LauncherConfig

    # the twin runs here, by the local launcher: only the keys every launcher has
    out = [f"model={cfg.model.model_type}", "launcher=local"]
    out += [f"++model.config.{k}={_value(v)}" for k, v in twin["model"].items()]
    tree = asdict(cfg)
    tree.pop("run_dir", None)
    common = {f.name for f in fields(LauncherConfig)} - {"name"}
    tree["launcher"] = {k: v for k, v in tree["launcher"].items() if k in common}
    tree["model"].pop("config")
    tree["model"]["pretrained"] = None  # the twin has other shapes: seeded weights
    tree["parallel"].update(layout, auto=False)
    tree["data"]["seq_len"] = twin["seq_len"]
    tree["trainer"].update(max_steps=twin["steps"], global_batch_size=twin["global_batch_size"], log_every=1,
                           eval_every=0, epochs=None, save_every=0, save_final=False, export_hf=False, resume=None)
    tree["data"]["val_fraction"] = 0.0
    tree["data"]["val_path"] = tree["data"]["val_split"] = None
    tree["optim"]["warmup_steps"] = min(tree["optim"]["warmup_steps"], twin["steps"])
    tree["launcher"].update(nodes=1, gpus_per_node=None, dry_run=False, master_port=None,
                            gpus=False if on_cpu else None)
    tree["plan"]["world_size"] = None
    for group, values in tree.items():
        for key, value in values.items():
            out.append(f"{group}.{key}={_value(value)}")
    return out


def _parse(argv: list[str]) -> tuple[list[str], int, Path | None]:
    args, steps, out = [], 3, None
    it = iter(argv)
    for a in it:
        if a in ("--steps", "--out"):
            value = next(it, None)
            if value is None:
                raise SystemExit(f"{a} needs a value")
            steps, out = (int(value), out) if a == "--steps" else (steps, Path(value))
        elif a.startswith("--steps="):
            steps = int(a.split("=", 1)[1])
        elif a.startswith("--out="):
            out = Path(a.split("=", 1)[1])
        else:
            args.append(a)
    return args, steps, out


def load(args: list[str]):
    """The typed config: a run directory's ``config.yaml`` or the composed overrides."""
    from hybridtrain.cli import compose
    from hybridtrain.rundir import RunDir

    if len(args) == 1 and Path(args[0]).is_dir():
        files = RunDir(Path(args[0]))
        if not files.config_file.is_file():
            raise SystemExit(f"{args[0]} has no {files.config_file.name}; give a run directory or overrides")
        return files.config()
    return compose(args)


def main(argv: list[str] | None = None) -> int:
    """Verify one config; return 0 (agree), 1 (differ or a run failed) or 2 (config error)."""
    import dataclasses

    from hybridtrain import cli
    from hybridtrain.config.explain import explain
    from hybridtrain.plan import PlanError, apply_pretrained_defaults, machine_facts, resolve
    from hybridtrain.rundir import RunDir
    from hybridtrain.versions import require_tested_versions

    require_tested_versions()
    args, steps, out = _parse(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load(args)
        apply_pretrained_defaults(cfg)
        plan, hf_config = resolve(cfg, announce=print)
    except PlanError as err:
        print(f"[hybridtrain] config error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - a config OmegaConf rejects is a config error; others keep their traceback
        if explain(err) is None:
            raise
        print(f"[hybridtrain] config error: {explain(err)}", file=sys.stderr)
        return 2
    dp, on_cpu = fit_devices(plan, machine_facts().gpus_per_node)  # the plan may be for a bigger cluster
    if dp != plan.dims.dp or on_cpu:
        print(f"[hybridtrain] verify: the plan's {plan.world_size} ranks do not fit this machine's GPUs: the twin "
              + ("runs as CPU processes" if on_cpu else f"runs dp={dp}"), flush=True)
    env = {"CUDA_VISIBLE_DEVICES": ""} if on_cpu else None
    twin = shrink(cfg, dataclasses.replace(plan, dims=dataclasses.replace(plan.dims, dp=dp)), hf_config, steps)
    layout = {"dp": dp, "tp": plan.dims.tp, "pp": plan.dims.pp, "micro_batch_size": plan.micro_batch_size,
              "zero_stage": plan.zero_stage}
    base = {"dp": 1, "tp": 1, "pp": 1, "micro_batch_size": plan.micro_batch_size, "zero_stage": None,
            "stage_layers": None, "activation_checkpointing": False}
    if cfg.parallel.stage_layers is not None:  # the twin has other layers: let the partition method cut
        layout["stage_layers"] = None
    out = (out or Path("runs") / "verify" / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    print(f"[hybridtrain] verify: {cfg.model.model_type} twin with {twin['layers']} layers, "
          f"{twin['model']}, seq {twin['seq_len']}, global batch {twin['global_batch_size']}, {steps} steps; "
          f"plan dp={dp} tp={plan.dims.tp} pp={plan.dims.pp} ZeRO-{plan.zero_stage} {plan.precision} against (1, 1, 1); "
          f"runs in {out}", flush=True)
    records = {}
    for name, lay in (("plan", layout), ("single", base)):
        run_dir = out / name
        proc = cli.run(run_dir, overrides(cfg, twin, lay, on_cpu), env=env, check=False)
        if proc.returncode != 0:
            print(proc.stdout[-4000:] + proc.stderr[-4000:], file=sys.stderr)
            print(f"[hybridtrain] verify: the {name} run failed (exit {proc.returncode}); its output is above",
                  file=sys.stderr)
            return 2 if proc.returncode == 2 else 1
        records[name] = [r for r in RunDir(run_dir).metrics() if "loss" in r and "step" in r]
    verdict = compare(records["plan"], records["single"], plan.precision)
    for line in verdict.lines:
        print(f"[hybridtrain] verify: {line}")
    print(f"[hybridtrain] verify: {'OK, the plan trains like one process' if verdict.ok else 'FAILED: the plan differs from one process'}",
          flush=True)
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
