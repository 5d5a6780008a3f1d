"""Mixture-of-experts benchmark (issue 30 point 8): hybridtrain against transformers at (1,1,1,1), and expert
parallelism ``ep=2`` against ``ep=1`` at ``dp=2``.

    python -m bench.bench_moe                     # 3 rounds of the five sides, alternating A B C D E
    python -m bench.bench_moe --rounds 2 --steps 8
    python -m bench.run --only moe                # the same comparison as a section of the suite

The model is a tiny Qwen3-MoE (:data:`SHAPE`) made with ``AutoConfig.for_model("qwen3_moe", ...)`` and
``save_pretrained`` in a temporary folder, fine-tuned with ``+recipe=finetune model.pretrained=FOLDER``: fp32,
global batch 8 of :data:`SEQ` tokens, micro-batch 1, torch's AdamW. Five sides, run alternately in one go:

* A: hybridtrain (1,1,1,1), one rank with :data:`THREADS` threads;
* B: transformers' own model of the same folder + ``torch.optim.AdamW`` (the overhead comparison's plain loop,
  :func:`hybridtrain.reference.reference_run` through ``bench/baselines.py``): same weights, batches,
  micro-batches, schedule and clipping, one process with as many threads;
* C: ``parallel.dp=2 parallel.ep=2`` (each rank holds ``E / ep`` experts), one thread per rank;
* D: ``parallel.dp=2 parallel.ep=1`` (every rank holds every expert), one thread per rank;
* E: B with the ``malloc`` setting of hybridtrain's CPU ranks (``launcher.keep_host_memory``), as the overhead
  comparison's side D: A / E is hybridtrain's own cost, E / B what the setting gains.

Step times are whole loop iterations (``bench/overhead.py``: consecutive ``elapsed_s`` of ``metrics.jsonl``,
the plain loop's ``step_time_s``), medians after the warm-up steps. Expert parameter bytes per rank come from
the plan (:class:`hybridtrain.plan.moe.ExpertFacts`: ``E / ep`` experts per rank) and are checked against the
transformers model's own expert tensors. C and D run with ``bench/a2a_timer.py`` installed (it times every
``all_to_all_single``, which only the dispatch calls): the share of a step in the dispatch's all-to-alls is each
rank's timed seconds of a step over that step's ``step_time_s``. Results: ``bench/results/moe_DATE.{md,json}``.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from hybridtrain.cli import REPO as ROOT

SHAPE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=16, num_experts=16, num_experts_per_tok=2,
             max_position_embeddings=256, norm_topk_prob=True, tie_word_embeddings=False)
"""The tiny Qwen3-MoE's HF config: 16 experts of width 128 in each of 4 blocks, top-2."""
SEQ = 128
GLOBAL_BATCH = 8
STEPS, SKIP = 10, 3
QUICK_STEPS, QUICK_SKIP = 6, 2
THREADS = 1
"""Threads of A and B (``--threads``), as many as each rank of C and D has: on a shared machine a process of
several OpenMP threads loses far more to other jobs than one of a single thread, which would hide the ratio."""
LABELS = {"ht": "A: hybridtrain (1,1,1,1)", "hf": "B: transformers + AdamW", "ep2": "C: dp=2, ep=2",
          "ep1": "D: dp=2, ep=1", "hf_keep": "E: B with hybridtrain's malloc setting"}
RANKS = {"ht": 1, "hf": 1, "ep2": 2, "ep1": 2, "hf_keep": 1}


def make_model(folder: Path, seed: int = 0) -> int:
    """``save_pretrained`` of a random tiny Qwen3-MoE (:data:`SHAPE`, the embedded tokenizer's vocabulary) into
    ``folder``; returns the parameters of its routed experts, counted from transformers' model."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridtrain.data.embedded import TOKENIZER

    vocab = Tokenizer.from_file(str(TOKENIZER)).get_vocab_size()
    config = AutoConfig.for_model("qwen3_moe", vocab_size=vocab, bos_token_id=0, eos_token_id=0, **SHAPE)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(folder))
    return sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)


def overrides(folder: Path, dp: int, ep: int, steps: int, threads: int) -> list[str]:
    """The ``python -m hybridtrain`` overrides of one side (the plain loop composes the same)."""
    return ["+recipe=finetune", f"model.pretrained={folder}", "model.model_type=qwen3_moe", f"data.seq_len={SEQ}",
            f"trainer.global_batch_size={GLOBAL_BATCH}", "parallel.micro_batch_size=1", "optim.warmup_steps=2",
            f"parallel.dp={dp}", f"parallel.ep={ep}", f"trainer.max_steps={steps}", "trainer.log_every=1",
            "trainer.save_final=false", "trainer.report=false", f"launcher.threads_per_rank={threads}"]


def expert_bytes(folder: Path, dp: int, ep: int) -> tuple[int, int]:
    """``(expert parameter bytes one rank holds, parameters of all experts)`` of a side, from the plan."""
    from hybridtrain import cli
    from hybridtrain.plan import Machine, apply_pretrained_defaults, resolve
    from hybridtrain.plan.report import build_report

    cfg = cli.compose(overrides(folder, dp, ep, STEPS, 1))
    apply_pretrained_defaults(cfg)
    plan, hf_config = resolve(cfg, Machine(gpus_per_node=0, fp16_supported=False, cpu_cores=2))
    e = build_report(cfg, plan, hf_config, 0).experts
    per_rank = e.expert_params * e.per_rank_experts // e.num_experts // plan.dims.tp
    return per_rank * {"fp32": 4, "bf16": 2, "fp16": 2}[plan.precision], e.expert_params


def run_side(work: Path, folder: Path, side: str, steps: int, skip: int, round_: int, threads: int = THREADS) -> dict:
    """One run of ``side`` (A and B with ``threads`` threads): median loop seconds after ``skip`` steps; for C
    and D the all-to-all share."""
    from bench.a2a_timer import ENV, per_step, read
    from bench.baselines import run_baseline
    from bench.common import check, run_hybridtrain
    from bench.overhead import loop_times

    if side in ("hf", "hf_keep"):
        records = run_baseline({"hf": "plain", "hf_keep": "plain_keep"}[side], overrides(folder, 1, 1, steps, threads), threads)
        times = [r["step_time_s"] for r in records if r["step"] > skip]
        return {"step_s": statistics.median(times), "steps_s": times, "final_loss": records[-1]["loss"]}
    dp, ep, per_rank = {"ht": (1, 1, threads), "ep2": (2, 2, 1), "ep1": (2, 1, 1)}[side]
    run_dir, timed = work / f"{side}_r{round_}", work / f"{side}_r{round_}_a2a"
    run = check(run_hybridtrain(run_dir, overrides(folder, dp, ep, steps, per_rank), env={ENV: str(timed)},
                                inject=True))
    records = [m for m in run.metrics() if "loss" in m]
    times = loop_times(records, skip)
    out = {"step_s": statistics.median(times), "steps_s": times, "final_loss": records[-1]["loss"],
           "model_state_mib": records[0]["model_state_bytes"]["total"] / 2**20}
    step_time = {r["step"]: r["step_time_s"] for r in records}
    shares = []
    for rank, calls in sorted(read(timed).items()):
        seconds = per_step(calls, len(records))
        shares.append(statistics.median(seconds[s - 1] / step_time[s] for s in step_time if s > skip))
    out["a2a_share"] = shares
    return out


def compare(work: Path, rounds: int, quick: bool, done: dict, alternate, steps: int | None = None,
            threads: int = THREADS) -> dict:
    """The comparison as a section of ``bench.run`` (``done`` unused: these runs are not the suite's model)."""
    steps, skip = (steps or (QUICK_STEPS if quick else STEPS)), (QUICK_SKIP if quick else SKIP)
    folder = work / "qwen3_moe_tiny"
    counted = make_model(folder)
    mem = {side: expert_bytes(folder, *{"ep2": (2, 2), "ep1": (2, 1)}.get(side, (1, 1)))
           for side in LABELS}
    if mem["ht"][1] != counted:
        raise RuntimeError(f"the plan counts {mem['ht'][1]} expert parameters, transformers' model {counted}")
    res = alternate({side: (lambda r, side=side: run_side(work, folder, side, steps, skip, r, threads)) for side in LABELS},
                    rounds)
    return section(res, {k: v[0] for k, v in mem.items()}, steps, skip, threads)


def section(res: dict[str, list[dict]], expert_bytes_per_rank: dict[str, int], steps: int, skip: int,
            threads: int = THREADS) -> dict:
    """The section (title, method, table, summary, ratios) of the four sides' runs ``res``."""
    tokens = SEQ * GLOBAL_BATCH

    def med(side: str, key: str = "step_s") -> float:
        return statistics.median(r[key] for r in res[side])

    tps = {side: tokens / med(side) for side in res}
    table = [["side", "ranks", "tokens/s", "median step s", "runs (median step s)", "expert parameters per rank (MiB)",
              "rank 0 model state, measured (MiB)", "all-to-all share of a step, per rank"]]
    for side, runs in res.items():
        share = ", ".join(f"{statistics.median(r['a2a_share'][i] for r in runs):.1%}"
                          for i in range(len(runs[0].get("a2a_share", []))))
        state = f"{med(side, 'model_state_mib'):.1f}" if "model_state_mib" in runs[0] else "-"
        table.append([LABELS[side], str(RANKS[side]), f"{tps[side]:,.0f}", f"{med(side):.4f}",
                      ", ".join(f"{r['step_s']:.4f}" for r in runs), f"{expert_bytes_per_rank[side] / 2**20:.2f}",
                      state, share or ("0 (no exchange at ep=1)" if side == "ep1" else "-")])
    ratios = {"tokens_per_sec_hybridtrain_over_transformers": tps["ht"] / tps["hf"],
              "tokens_per_sec_ep2_over_ep1": tps["ep2"] / tps["ep1"],
              "expert_bytes_per_rank_ep2_over_ep1": expert_bytes_per_rank["ep2"] / expert_bytes_per_rank["ep1"]}
    if "hf_keep" in tps:
        ratios["tokens_per_sec_hybridtrain_over_transformers_same_malloc"] = tps["ht"] / tps["hf_keep"]
    shares = [statistics.median(r["a2a_share"][i] for r in res["ep2"]) for i in range(len(res["ep2"][0]["a2a_share"]))]
    summary = (f"A / B tokens/s: **{ratios['tokens_per_sec_hybridtrain_over_transformers']:.3f}x** (target >= 1.0); "
               f"C / D tokens/s: **{ratios['tokens_per_sec_ep2_over_ep1']:.3f}x**; expert parameters per rank C / D "
               f"**{ratios['expert_bytes_per_rank_ep2_over_ep1']:.2f}x** (ideal 1 / ep = 0.5); the dispatch's "
               "all-to-alls take " + ", ".join(f"{s:.1%}" for s in shares) + " of a C step (per rank).")
    if "hf_keep" in tps:
        summary += (" A / E (the allocator setting equal): "
                    f"**{ratios['tokens_per_sec_hybridtrain_over_transformers_same_malloc']:.3f}x**.")
    e = SHAPE
    return {"title": "Mixture of experts: hybridtrain vs transformers at (1,1,1,1), ep=2 vs ep=1 at dp=2",
            "what": (f"Tiny Qwen3-MoE from `AutoConfig.for_model` + `save_pretrained` ({e['num_hidden_layers']} blocks, "
                     f"hidden {e['hidden_size']}, {e['num_experts']} experts of width {e['moe_intermediate_size']}, "
                     f"top-{e['num_experts_per_tok']}), `+recipe=finetune`, fp32, AdamW, global batch {GLOBAL_BATCH} "
                     f"x {SEQ} tokens, micro-batch 1; {steps} steps a run, median loop iteration after {skip}; sides "
                     f"alternate A B C D E. A and B: one process with {threads} thread(s) (B: transformers' model + torch "
                     "AdamW, `bench/baselines.py`; E: B with hybridtrain's `malloc` setting); C and D: 2 ranks, one thread each. Expert parameters per rank: the "
                     "plan's E / ep experts (fp32), checked against transformers' model. All-to-all share: each "
                     "rank's `all_to_all_single` seconds in a step (`bench/a2a_timer.py`, waiting for the peer "
                     "included) over the step's `step_time_s`, median over the measured steps and the rounds."),
            "table": table, "summary": summary, "ratio": ratios["tokens_per_sec_hybridtrain_over_transformers"],
            "target": 1.0, "ratios": ratios, "a2a_share_ep2": shares, "expert_bytes_per_rank": expert_bytes_per_rank,
            "raw": res, "steps": steps, "skip": skip, "shape": SHAPE,
            "plot": {"labels": [LABELS[k].split(":")[0] for k in res],
                     "values": [tps[k] for k in res], "ylabel": "tokens/s"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--threads", type=int, default=THREADS, help="threads of A and B")
    parser.add_argument("--work", type=Path, help="keep the model and run folders here")
    args = parser.parse_args()

    from bench.common import alternate, machine, machine_line, write_section

    facts = machine()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_moe_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"[bench] {machine_line(facts)}", flush=True)
    sec = compare(work, args.rounds, False, {}, alternate, args.steps, args.threads)
    write_section(args.out, "moe", sec, facts, args.rounds, f"python -m bench.bench_moe --rounds {args.rounds} --steps {args.steps} --threads {args.threads}")

if __name__ == "__main__":
    main()
