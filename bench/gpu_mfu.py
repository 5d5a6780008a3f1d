"""Single-GPU MFU of a ~1B-parameter Llama in bf16: hybridtrain against a plain transformers loop.

    python -m bench.gpu_mfu                  # on a machine with a CUDA GPU: ~3-4 minutes
    python -m bench.gpu_mfu --cpu-smoke      # the same code paths on CPU with a tiny Llama (no MFU claim)

Without a GPU (and without ``--cpu-smoke``) it says so and exits 0 without measuring.

The model is built from a config, never downloaded: Llama, hidden 2048, 16 layers, 16 heads with
8 KV heads, MLP 5632, vocabulary 32000, untied (0.89B parameters). Both sides train it on the same
sequence length (2048), micro-batch (4) and global batch (8 = 2 micro-batches accumulated) with
AdamW, alternately (A B A B), measuring the median step time after 3 warm-up steps.

- A: ``python -m hybridtrain model=llama ... trainer.precision=bf16`` at dp = tp = pp = 1 (DeepSpeed's
  bf16 mode: bf16 weights and activations, fp32 master weights in the optimizer); step time from
  metrics.jsonl (the loop reads the loss, so the GPU is synchronised each step).
- B: ``LlamaForCausalLM`` (sdpa attention) with fp32 weights under ``torch.autocast(bfloat16)`` and
  ``torch.optim.AdamW(fused=True)``, ``torch.cuda.synchronize()`` around each step, random tokens.

MFU = tokens/s x model FLOPs per token (``hybridtrain.plan.flops.model_flops_per_token``: 6 x
parameters of the matmuls plus attention, no recomputation) / the GPU's dense bf16 peak (the table
of ``hybridtrain/observe/peak.py``, as training reports it, or ``--peak-tflops``). Results go to ``bench/results/gpu_mfu_DATE.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, alternate, check, machine, machine_line, run_hybridtrain, steady_step_time

SKIP = 3

LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16,
            "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 2048,
            "tie_word_embeddings": False}
LLAMA_SMOKE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 8000, "max_position_embeddings": 256,
               "tie_word_embeddings": False}


def hybridtrain_side(work: Path, r: int, shape: dict, seq: int, micro: int, batch: int, steps: int, gpu: bool) -> dict:
    overrides = ["model=llama", *[f"+model.config.{k}={v}" for k, v in shape.items()],
                 f"data.seq_len={seq}", "parallel.dp=1", "parallel.tp=1", "parallel.pp=1",
                 f"parallel.micro_batch_size={micro}", f"trainer.global_batch_size={batch}", "trainer.precision=bf16",
                 f"trainer.max_steps={steps}", "trainer.save_final=false", "optim.warmup_steps=1"]
    overrides += ["launcher.gpus_per_node=1"] if gpu else ["launcher.threads_per_rank=" + str(os.cpu_count() or 1)]
    run = check(run_hybridtrain(work / f"ht_{r}", overrides))
    losses = [m["loss"] for m in run.metrics() if "loss" in m]
    return {"step_s": steady_step_time(run.metrics(), SKIP), "losses_finite": _finite(losses, steps)}


def plain_side(shape: dict, seq: int, micro: int, batch: int, steps: int, gpu: bool) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if gpu else "cpu"
    torch.manual_seed(0)
    cfg = LlamaConfig(**shape)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):  # initialise on the GPU: seconds, not the minute a CPU init of 0.9B takes
        model = LlamaForCausalLM(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=gpu)
    g = torch.Generator(device="cpu").manual_seed(0)
    times, losses = [], []
    for step in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(device)
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for x in ids.split(micro):  # gradient accumulation over micro-batches
            inputs, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()  # labels already shifted
            with torch.autocast(device_type=device, dtype=torch.bfloat16):
                loss = model(input_ids=inputs, labels=labels, shift_labels=labels).loss / (batch // micro)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss))
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del model, opt
    if gpu:
        torch.cuda.empty_cache()
    return {"step_s": statistics.median(times[SKIP:]), "losses_finite": _finite(losses, steps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny Llama on CPU: checks the script, no MFU claim")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="measured steps per run (after 3 warm-up steps)")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, if not in the table")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    import torch

    gpu = torch.cuda.is_available()
    if not gpu and not args.cpu_smoke:
        print("bench/gpu_mfu.py needs a CUDA GPU and there is none here: nothing measured. "
              "(--cpu-smoke runs the same code on CPU with a tiny model.)")
        return 0
    shape, seq, micro, batch = (LLAMA_1B, 2048, 4, 8) if gpu and not args.cpu_smoke else (LLAMA_SMOKE, 64, 2, 4)
    steps = args.steps + SKIP
    from hybridtrain.models.families import get_family
    from hybridtrain.plan.flops import model_flops_per_token
    from transformers import LlamaConfig

    hf = LlamaConfig(**shape)
    flops_per_token = model_flops_per_token(get_family("llama"), hf, seq, shape["vocab_size"])
    params = _params(shape)
    info = machine()
    name = info["gpu"]
    from hybridtrain.observe.peak import gpu_peak_tflops  # the table training's MFU uses

    hit = gpu_peak_tflops(name, "bf16") if name else None
    peak = args.peak_tflops or (hit[1] if hit else None)
    os.environ.setdefault("HYBRIDTRAIN_CACHE", str(Path(tempfile.gettempdir()) / "hybridtrain-bench-cache"))
    work = Path(tempfile.mkdtemp(prefix="gpu_mfu_"))
    use_gpu = gpu and not args.cpu_smoke
    try:
        res = alternate({"hybridtrain": lambda r: hybridtrain_side(work, r, shape, seq, micro, batch, steps, use_gpu),
                         "plain": lambda r: plain_side(shape, seq, micro, batch, steps, use_gpu)}, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens = batch * seq
    rows = []
    out = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": info, "shape": shape, "seq_len": seq,
           "micro_batch": micro, "global_batch": batch, "params": params, "flops_per_token": flops_per_token,
           "peak_tflops": peak, "cpu_smoke": args.cpu_smoke, "raw": res}
    for side in ("hybridtrain", "plain"):
        step = statistics.median(x["step_s"] for x in res[side])
        achieved = tokens / step * flops_per_token / 1e12
        mfu = achieved / peak if peak and use_gpu else None
        out[side] = {"step_s": step, "tokens_per_s": tokens / step, "tflops": achieved, "mfu": mfu,
                     "losses_finite": all(x["losses_finite"] for x in res[side])}
        runs = ", ".join(f"{x['step_s']:.4f}" for x in res[side])
        rows.append(f"| {side} | {step:.4f} | {tokens / step:,.0f} | {achieved:.3g} | "
                    f"{'n/a' if mfu is None else f'{mfu:.1%}'} | {'yes' if out[side]['losses_finite'] else 'NO'} "
                    f"| {runs} |")
    ratio = out["plain"]["step_s"] / out["hybridtrain"]["step_s"]
    info["loadavg_end"] = os.getloadavg()
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    label = "gpu_mfu_cpu_smoke" if args.cpu_smoke else "gpu_mfu"
    lines = [f"# GPU MFU{' (CPU smoke run: no MFU claim)' if args.cpu_smoke else ''}, {out['date']}", "",
             f"Machine: {machine_line(info)}", "",
             f"Llama {params / 1e6:,.1f}M parameters ({json.dumps(shape)}), sequence {seq}, micro-batch {micro}, global "
             f"batch {batch}; {flops_per_token / 1e9:.2f} GFLOP per token; bf16 peak "
             f"{peak if peak else 'unknown'} TFLOP/s; {args.rounds} rounds A B, median step after {SKIP} warm-up steps.", "",
             "| side | median step s | tokens/s | TFLOP/s | MFU | finite losses | runs (step s) |",
             "|---|---|---|---|---|---|---|", *rows, "",
             f"hybridtrain throughput / plain loop throughput: **{ratio:.3f}x**."]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{label}_{stamp}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{label}_{stamp}.json").write_text(json.dumps(out, indent=1, default=str))
    print("\n".join(lines))
    return 0


def _finite(losses: list[float], steps: int) -> bool:
    """Whether a run logged ``steps`` losses, all finite (a NaN step would still have a step time)."""
    return len(losses) == steps and all(math.isfinite(x) for x in losses)


def _params(shape: dict) -> int:
    """Parameter count of the Llama of ``shape`` (built on the meta device: no memory)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**shape))
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    sys.exit(main())
