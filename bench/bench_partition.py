"""Partition benchmark: measured per-stage time imbalance of ``balanced`` against DeepSpeed's
``uniform`` and ``parameters`` methods (and hybridtrain's ``blocks``) on a model where counting
layers or parameters misjudges the work: a GPT-2 with a large vocabulary for its width.

    python -m bench.bench_partition [--pp 4] [--rounds 5]

For each method the plan's stage boundaries are taken from :func:`hybridtrain.plan.resolve`; the
real pipeline layers (:mod:`hybridtrain.models.stages`, seeded weights, tp = 1) are built once
in this process with one thread, and each stage's layers run forward + backward on one
micro-batch (the last stage through the loss), timed separately. Methods alternate A B C D per
round; each stage's time is the median over rounds. Imbalance = slowest stage / mean - 1 (what
the 1F1B pipeline loses to the slowest stage). Results go to ``bench/results/partition-<date>.md``
and ``.json`` with the load average, since the machine may be shared.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from pathlib import Path

from hybridtrain.cli import REPO as ROOT

METHODS = ("balanced", "uniform", "parameters", "blocks")
MODEL = ["+recipe=gpt_tiny", "model.config.n_layer=16", "model.config.n_embd=128", "model.config.n_head=4",
         "data.seq_len=64", "parallel.micro_batch_size=4", "trainer.global_batch_size=32"]
"""16 blocks of width 128 and the 8000-token vocabulary: the head and the loss weigh as much as
several blocks, the embedding's dense gradient as more than one; layer counts and parameter
counts both misjudge that."""


def build_layers(cfg, plan, hf_config):
    """Every pipeline layer of the model (tp = 1), as the workers build them, and the loss."""
    import torch

    from hybridtrain.engine.pipeline import layer_specs
    from hybridtrain.models.build import ModelBuilder
    from hybridtrain.models.hf_model import meta_model
    from hybridtrain.models.families import family_of
    from hybridtrain.models.stages import tied_head
    from hybridtrain.parallel.context import TPContext
    from hybridtrain.parallel.layers import VocabParallelLoss

    tp = TPContext()
    builder = ModelBuilder(family=family_of(cfg.model), hf_config=hf_config,
                           hf_model=meta_model(hf_config), seed=cfg.trainer.seed, tp=tp,
                           padded_vocab=plan.padded_vocab_size)
    layers = []
    for spec in layer_specs(builder):
        module = spec.build()
        if getattr(spec, "forward_fn", None) is tied_head:  # the tied head's copy on the last stage
            layers.append(lambda x, m=module: tied_head(m, x))
            layers[-1].params = list(module.parameters())
        else:
            layers.append(module)
    del torch
    return layers, VocabParallelLoss(plan.padded_vocab_size, tp)


def stage_inputs(layers, bounds, ids):
    """The input of each stage for one micro-batch (the previous stages' output, detached)."""
    import torch

    inputs, x = [], ids
    with torch.no_grad():
        for s in range(len(bounds) - 1):
            inputs.append(x)
            for layer in layers[bounds[s]:bounds[s + 1]]:
                x = layer(x)
    return inputs


def time_stage(layers, loss_fn, x, labels, last: bool) -> float:
    """Seconds of forward + backward of ``layers`` on ``x`` (the last stage: through the loss)."""
    import torch

    if x.is_floating_point():
        x = x.detach().requires_grad_(True)
    t0 = time.perf_counter()
    out = x
    for layer in layers:
        out = layer(out)
    if last:
        loss_fn(out, labels).backward()
    else:
        out.backward(torch.ones_like(out))
    elapsed = time.perf_counter() - t0
    for layer in layers:
        for p in getattr(layer, "params", None) or (layer.parameters() if hasattr(layer, "parameters") else []):
            p.grad = None
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    import torch

    from bench.bench_data import machine
    from hybridtrain.cli import compose
    from hybridtrain.plan import Machine, resolve
    from hybridtrain.models.families import family_of
    from hybridtrain.plan.costs import layer_time_costs, model_facts

    torch.set_num_threads(1)
    plans = {}
    for method in METHODS:
        cfg = compose(MODEL + [f"parallel.pp={args.pp}", f"parallel.partition={method}"])
        plans[method] = resolve(cfg, Machine())
    plan, hf_config = plans["balanced"]
    torch.manual_seed(0)
    layers, loss_fn = build_layers(cfg, plan, hf_config)
    facts = model_facts(family_of(cfg.model), hf_config, plan.seq_len, 1)
    costs = layer_time_costs(facts, plan.micro_batch_size, plan.dims)
    ids = torch.randint(0, 8000, (plan.micro_batch_size, plan.seq_len))
    labels = torch.randint(0, 8000, (plan.micro_batch_size, plan.seq_len))
    inputs = {m: stage_inputs(layers, plans[m][0].stage_bounds, ids) for m in METHODS}
    load_before = os.getloadavg()
    times = {m: [[] for _ in range(args.pp)] for m in METHODS}
    for _ in range(2):  # warm-up
        for m in METHODS:
            b = plans[m][0].stage_bounds
            for s in range(args.pp):
                time_stage(layers[b[s]:b[s + 1]], loss_fn, inputs[m][s], labels, s == args.pp - 1)
    for _ in range(args.rounds):
        for m in METHODS:  # A B C D, round after round
            b = plans[m][0].stage_bounds
            for s in range(args.pp):
                times[m][s].append(time_stage(layers[b[s]:b[s + 1]], loss_fn, inputs[m][s], labels, s == args.pp - 1))
    results = {}
    for m in METHODS:
        b = plans[m][0].stage_bounds
        med = [statistics.median(t) for t in times[m]]
        est = [sum(costs[b[s]:b[s + 1]]) for s in range(args.pp)]
        results[m] = {"bounds": b, "layers": [plans[m][0].stage_layers(s) for s in range(args.pp)],
                      "stage_seconds": med, "imbalance": max(med) / statistics.mean(med) - 1,
                      "slowest_stage_seconds": max(med),
                      "estimated_imbalance": max(est) / statistics.mean(est) - 1}
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    record = {"date": stamp, "machine": machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
              "model": MODEL, "pp": args.pp, "rounds": args.rounds, "threads": 1, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"partition-{stamp}.json").write_text(json.dumps(record, indent=1))
    lines = [f"# Partition benchmark {stamp}", "", f"Machine: {record['machine']}; load average before "
             f"{load_before[0]:.2f}, after {record['loadavg_after'][0]:.2f}. Model: `{' '.join(MODEL)}`, "
             f"pp={args.pp}, one thread, median of {args.rounds} alternating rounds.", "",
             "| method | stage bounds | stage fwd+bwd ms | measured imbalance | estimated imbalance | slowest stage vs balanced |",
             "|---|---|---|---|---|---|"]
    base = results["balanced"]["slowest_stage_seconds"]
    for m in METHODS:
        r = results[m]
        lines.append(f"| {m} | {r['bounds']} | {', '.join(f'{x * 1e3:.1f}' for x in r['stage_seconds'])} | "
                     f"{r['imbalance']:.1%} | {r['estimated_imbalance']:.1%} | {r['slowest_stage_seconds'] / base:.2f}x |")
    (args.out / f"partition-{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
