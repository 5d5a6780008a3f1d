"""DPO against TRL's ``DPOTrainer``: training step time on the same model, records, order and batch, one process
(issue 43 point 9).

    python -m bench.dpo_trl [--rounds 3] [--steps 24] [--quick]

Each round runs hybridtrain (``python -m hybridtrain``, ``finetune.objective=dpo``, one rank) and TRL 1.16's
``DPOTrainer`` (in this process, ``precompute_ref_log_probs=True``), full fine-tuning then LoRA (r 16 on every
linear layer of the blocks, both sides from the same peft adapter), alternated. Both train the same pairs in the
same order (TRL's sampler replaced by hybridtrain's order), so each step carries the same loss tokens on both
sides (hybridtrain's ``loss_tokens``); the step time is the median after the warm-up steps (hybridtrain's
``step_time_s``; TRL's from ``on_step_begin`` to ``on_step_end``). Loss-carrying tokens per second follow from the
two. The job's wall time (start-up and the reference pass included) is reported beside it. Both sides' first
losses must agree (1e-4): the same training. Results: ``bench/results/dpo_trl_DATE.md`` and ``.json``.

Padding on both sides: TRL concatenates each batch's chosen and rejected sequences, each padded to the batch's
longest; hybridtrain puts a pair's two sequences in one row as two documents and pads the row to ``data.seq_len``
(here the records' longest pair row, :func:`_row_length`): one pair per row (``docs/preference.md``).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

from bench.common import ROOT, alternate, check, machine, machine_line, run_hybridtrain, steady_step_time

sys.path.insert(0, str(ROOT / "tests"))  # the DPO oracle's plumbing is the tests' (helpers.dpo): one copy of it

BATCH, LR, SEED, BETA = 8, 1e-4, 5, 0.1
SKIP = 3  # warm-up steps left out of the step time
MODEL = dict(vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=0,
             eos_token_id=0)
"""A 4-block Llama, 256 wide (MLP 768, 8 heads sharing 4 KV heads, untied 8000-token vocabulary): 7.2M parameters."""


def _model(folder: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers.finetune import save_tokenizer

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **MODEL))
    model.save_pretrained(str(folder))
    save_tokenizer(folder)
    return folder


def _kw(steps: int) -> dict:
    return dict(steps=steps, batch=BATCH, lr=LR, seed=SEED, beta=BETA, loss_type=["sigmoid"])


def _row_length(folder: Path, records: list[dict]) -> int:
    """``data.seq_len`` for the records: their longest pair row (prompt + chosen, prompt + rejected), rounded up to
    a multiple of 8. hybridtrain pads every pair's row to ``data.seq_len``, so a longer one would only add padding."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    longest = max(len(tok(r["prompt"] + r["chosen"]).input_ids) + len(tok(r["prompt"] + r["rejected"]).input_ids) + 2
                  for r in records)
    return -(-longest // 8) * 8


def _ours(work: Path, name: str, folder: Path, pairs: Path, steps: int, adapter: Path | None, seq: int) -> dict:
    from helpers.dpo import overrides

    extra = ["finetune.method=lora", f"finetune.lora.init_from={adapter}"] if adapter else []
    t0 = time.perf_counter()
    run = check(run_hybridtrain(work / name, ["model=llama", *overrides(folder, pairs, seq_len=seq, **_kw(steps)),
                                              f"data.cache_dir={work / 'cache'}", "trainer.report=false", *extra]))
    wall = time.perf_counter() - t0
    records = [r for r in run.metrics() if "loss" in r]
    return {"step_s": steady_step_time(records, SKIP), "wall_s": wall, "loss": records[0]["loss"],
            "loss_tokens": [r["loss_tokens"] for r in records]}


def _theirs(work: Path, name: str, folder: Path, records: list[dict], steps: int, adapter: Path | None) -> dict:
    from transformers import TrainerCallback

    import helpers.dpo as dpo

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.t)

    t0 = time.perf_counter()
    logs = dpo.trl_run(folder, records, work / name, adapter=adapter, callbacks=[Clock()], **_kw(steps))
    return {"step_s": statistics.median(times[SKIP:]), "wall_s": time.perf_counter() - t0, "loss": logs[0]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.dpo_trl", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--quick", action="store_true", help="1 round of 6 steps")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    import tempfile

    from helpers.dpo import make_adapter
    from helpers.data import write_jsonl
    from hybridtrain.data.embedded import preference_pairs

    rounds, steps = (1, 6) if args.quick else (args.rounds, args.steps)
    work = Path(tempfile.mkdtemp(prefix="hybridtrain_dpo_trl_"))
    folder = _model(work / "model")
    adapter = make_adapter(folder, work / "adapter")
    records = preference_pairs(steps * BATCH, seed=3)
    pairs = write_jsonl(work / "pairs.jsonl", records)
    seq = _row_length(folder, records)
    info = machine()
    print(f"[bench] {machine_line(info)}", flush=True)
    sides = {}
    for method, ad in (("full", None), ("lora", adapter)):
        sides[f"hybridtrain {method}"] = (lambda r, m=method, a=ad: _ours(work, f"ours_{m}_{r}", folder, pairs, steps, a, seq))
        sides[f"TRL {method}"] = (lambda r, m=method, a=ad: _theirs(work, f"trl_{m}_{r}", folder, records, steps, a))
    res = alternate(sides, rounds)
    info["loadavg_end"] = list(__import__("os").getloadavg())
    rows, summary = [], {}
    for method in ("full", "lora"):
        ours, theirs = res[f"hybridtrain {method}"], res[f"TRL {method}"]
        for a, b in zip(ours, theirs):
            assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), (method, a["loss"], b["loss"])
        tokens = statistics.median(ours[0]["loss_tokens"][SKIP:])
        ratio = statistics.median(b["step_s"] / a["step_s"] for a, b in zip(ours, theirs))
        summary[method] = {"tokens_per_step": tokens, "speedup_median": ratio}
        for side, runs in (("hybridtrain", ours), ("TRL", theirs)):
            step = statistics.median(r["step_s"] for r in runs)
            rows.append(f"| {method} | {side} | {step * 1000:.0f} ms | {tokens / step:,.0f} | "
                        f"{statistics.median(r['wall_s'] for r in runs):.1f} s | "
                        + ("**{:.2f}x**".format(ratio) if side == "hybridtrain" else "1") + " |")
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"dpo_trl_{stamp}.json").write_text(json.dumps(
        {"machine": info, "rounds": rounds, "steps": steps, "batch": BATCH, "seq_len": seq, "model": MODEL,
         "results": res, "summary": summary}, indent=1))
    lines = [f"# DPO against TRL's DPOTrainer ({stamp})", "", machine_line(info), "",
             f"`python -m bench.dpo_trl --rounds {rounds} --steps {steps}`: a 4-block Llama 256 wide (7.2M parameters), "
             f"{steps} steps of {BATCH} pairs (the embedded corpus's preference pairs; hybridtrain's rows {seq} tokens, "
             "the longest pair), sigmoid loss, one process, "
             f"{rounds} rounds alternated; step time the median after {SKIP} warm-up steps.", "",
             "| | | step time (median) | loss tokens / s | job wall time | speed-up (median of per-round ratios) |",
             "|---|---|---|---|---|---|", *rows, "",
             "Both sides' first losses agreed within 1e-4 in every round."]
    (args.out / f"dpo_trl_{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
