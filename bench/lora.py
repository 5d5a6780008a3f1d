"""LoRA against full fine-tuning: model state per rank and step time, same model, same layout.

    python -m bench.lora [--rounds 3] [--quick] [--layouts 111,122,211]

For each layout, a full fine-tuning run (``finetune.method=full``) and a LoRA run (``finetune.method=lora``,
``all-linear``, r=16) of the same model and batches alternate (full, LoRA, full, LoRA, ...). Per side:
rank 0's measured model state (``model_state_bytes`` of ``metrics.jsonl``: parameters, gradients and
optimizer state at their peaks during a step; rank 0 is pipeline stage 0 and TP rank 0, so it holds the
embedding), the plan command's estimate of it (``hybridtrain.plan.memory``), and the median step time
after warm-up. Both sides start from the same seeded weights. The layouts run the default ZeRO stage
(0 with one replica in fp32, else 1). Results: ``bench/results/lora-<date>.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
from pathlib import Path

from bench.common import ROOT, alternate, check, machine, machine_line, run_hybridtrain, steady_step_time

MODEL = ["+recipe=llama_tiny", "model.config.hidden_size=256", "model.config.intermediate_size=768",
         "model.config.num_attention_heads=8", "model.config.num_key_value_heads=4", "model.config.tie_word_embeddings=false",
         "data.seq_len=64", "trainer.global_batch_size=8", "optim.warmup_steps=2", "trainer.save_final=false",
         "trainer.report=false"]
"""A 4-block Llama, 256 wide (MLP 768, 8 heads sharing 4 KV heads, untied 8000-token vocabulary): 7.2M
parameters, of which the blocks' linear layers (what LoRA adapts) are 3.1M."""
QUICK_MODEL = ["+recipe=llama_tiny", "data.seq_len=32", "trainer.global_batch_size=8", "optim.warmup_steps=2",
               "trainer.save_final=false", "trainer.report=false"]
LORA = ["finetune.method=lora", "finetune.lora.r=16", "finetune.lora.alpha=32", "finetune.lora.target_modules=all-linear"]
SKIP = 3  # warm-up steps left out of the step time


def _run(work: Path, name: str, overrides: list[str], steps: int) -> dict:
    from hybridtrain.plan.estimate import estimate_for_run

    run = check(run_hybridtrain(work / name, overrides + [f"trainer.max_steps={steps}"]))
    records = [r for r in run.metrics() if "loss" in r]
    return {"step_s": steady_step_time(records, SKIP), "state": records[-1]["model_state_bytes"],
            "estimate": estimate_for_run(run.run_dir).model_state, "run_dir": str(run.run_dir)}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="llama_tiny, 8 steps, 1 round")
    parser.add_argument("--layouts", default="111,122,211", help="dp tp pp digits, comma separated")
    parser.add_argument("--work", type=Path, default=None, help="keep the run folders here")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    import tempfile

    rounds = 1 if args.quick else args.rounds
    steps = 8 if args.quick else 20
    model = QUICK_MODEL if args.quick else MODEL
    layouts = [tuple(int(c) for c in s) for s in args.layouts.split(",")]
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_lora_"))
    info = machine()
    results = []
    for dp, tp, pp in layouts:
        layout = [f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}", "launcher.threads_per_rank=1"]
        tag = f"{dp}{tp}{pp}"
        print(f"[bench.lora] layout dp={dp} tp={tp} pp={pp}", flush=True)
        sides = {"full": lambda r: _run(work, f"full_{tag}_{r}", model + layout, steps),
                 "lora": lambda r: _run(work, f"lora_{tag}_{r}", model + layout + LORA, steps)}
        runs = alternate(sides, rounds)
        results.append({"layout": [dp, tp, pp], "runs": runs,
                        "step_s": {k: statistics.median(x["step_s"] for x in v) for k, v in runs.items()}})
    info["loadavg_end"] = os.getloadavg()
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"date": stamp, "machine": info, "model": model, "lora": LORA, "rounds": rounds, "steps": steps,
              "results": results}
    (args.out / f"lora-{stamp}.json").write_text(json.dumps(record, indent=1, default=str))
    lines = [f"# LoRA against full fine-tuning, {stamp}", "", f"Machine: {machine_line(info)}", "",
             f"Model: `{' '.join(model)}`; LoRA: `{' '.join(LORA)}`; {steps} steps per run, {rounds} round(s), "
             f"sides alternate; step time: median after {SKIP} warm-up steps. Model state: rank 0's peaks during a "
             "step (MiB), and the plan command's estimate.", "",
             "| dp x tp x pp | side | rank 0 model state | params / grads / optimizer | plan estimate | step s |",
             "|---|---|---|---|---|---|"]
    for res in results:
        d, t, p = res["layout"]
        for side in ("full", "lora"):
            s = res["runs"][side][-1]
            st = s["state"]
            lines.append(f"| {d} x {t} x {p} | {side} | {_mib(st['total'])} MiB | "
                         f"{' / '.join(_mib(st[k]) for k in ('params', 'grads', 'optim'))} | {_mib(s['estimate'])} MiB | "
                         f"{res['step_s'][side]:.4f} |")
        full, lora = res["runs"]["full"][-1]["state"]["total"], res["runs"]["lora"][-1]["state"]["total"]
        lines.append(f"| | LoRA / full | {lora / full:.3f} | | | {res['step_s']['lora'] / res['step_s']['full']:.3f} |")
    (args.out / f"lora-{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
