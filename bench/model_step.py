"""The model alone: forward + backward of hybridtrain's (1,1,1) model against the transformers model of
the same config, in one process, without the training loop, DeepSpeed's engine or the optimizer.

    python -m bench.model_step [--models llama_192,qwen2_192,phi3_192] [--rounds 15] [--reps 8]

The end-to-end overhead comparison (``bench/overhead.py``) runs each side in its own process; there,
one side's runs spread 10-15% on a 2-core machine, which hides a few percent. This one isolates the
part that differs per family (the blocks hybridtrain builds from transformers' modules, its
vocabulary-parallel head and loss, the shared mask and rotary table) and alternates the two models in
one process: each round runs ``--reps`` micro-batches (1 x 128 tokens) through each model, forward
and backward, and the result is the median over rounds and the median of the per-round ratios.
Results: ``bench/results/model_step_<date>.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from pathlib import Path

from bench.common import ROOT, machine, machine_line
from bench.models import FAMILIES, MODELS

SEQ = 128


def _models(name: str):
    """``(hybridtrain's one-process model, transformers' model, vocabulary)`` of a bench model."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybridtrain.cli import compose
    from hybridtrain.models.stages import one_process_model
    from hybridtrain.plan import model_config

    cfg = compose(MODELS[name].overrides)
    hf_config = model_config(cfg)
    vocab = int(hf_config.vocab_size)
    ours = one_process_model(cfg, hf_config)
    torch.manual_seed(cfg.trainer.seed)
    theirs = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return ours.train(), theirs.train(), vocab


def measure(name: str, rounds: int, reps: int, log=print) -> dict:
    """Seconds per micro-batch (forward + backward) of each model, alternated round by round."""
    import torch

    ours, theirs, vocab = _models(name)
    ids = torch.randint(1, vocab, (1, SEQ), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(SEQ).expand_as(ids)

    def hybridtrain_step() -> None:
        ours((ids, pos), ids).backward()

    def transformers_step() -> None:
        theirs(input_ids=ids, labels=ids).loss.backward()

    sides = {"hybridtrain": hybridtrain_step, "transformers": transformers_step}
    for step in sides.values():  # warm-up: allocator, first-call paths
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(rounds):
        for side, step in sides.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                step()
            times[side].append((time.perf_counter() - t0) / reps)
        log(f"  {name} round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.4f}s" for k, v in times.items()), flush=True)
    ratios = [t / h for h, t in zip(times["hybridtrain"], times["transformers"])]
    return {"seconds": times, "median": {k: statistics.median(v) for k, v in times.items()},
            "ratio_of_medians": statistics.median(times["transformers"]) / statistics.median(times["hybridtrain"]),
            "median_ratio": statistics.median(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(FAMILIES))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=8, help="micro-batches per side and round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    m = machine()
    print(f"[bench] {machine_line(m)}", flush=True)
    results = {name: measure(name, args.rounds, args.reps) for name in args.models.split(",")}
    m["loadavg_end"] = os.getloadavg()
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    out = ROOT / "bench" / "results" / f"model_step_{stamp}"
    lines = [f"# Model alone: hybridtrain (1,1,1) vs transformers, forward + backward, {stamp}", "",
             f"Machine: {machine_line(m)}", "",
             f"Command: `python -m bench.model_step --models {args.models} --rounds {args.rounds} --reps {args.reps} "
             f"--threads {args.threads}`; one process, {args.threads} threads, fp32, micro-batches of 1 x {SEQ} "
             "tokens, the two models alternated round by round (`bench/model_step.py`).", "",
             "| model | hybridtrain s / micro-batch | transformers s / micro-batch | transformers / hybridtrain time "
             "(ratio of medians; median of per-round ratios) |", "|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| `{name}` | {r['median']['hybridtrain']:.4f} | {r['median']['transformers']:.4f} | "
                     f"**{r['ratio_of_medians']:.3f}x**; {r['median_ratio']:.3f}x |")
    lines += ["", "Above 1.0x: hybridtrain's model is the faster of the two."]
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    Path(f"{out}.json").write_text(json.dumps({"machine": m, "args": vars(args), "results": results}, indent=1))
    print("\n".join(lines))
    print(f"[bench] wrote {out}.md", flush=True)


if __name__ == "__main__":
    main()
