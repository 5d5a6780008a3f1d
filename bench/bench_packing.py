"""Packing benchmark: ``data.packing=documents`` against ``none`` on length-skewed prompt-completion data.

    python -m bench.bench_packing                  # 3 rounds, alternating documents / none
    python -m bench.bench_packing --picture docs/images/packed_row.png   # only the picture of a packed row

The data: prompt-completion records cut from the embedded corpus with log-normal lengths (median about
a tenth of ``data.seq_len`` tokens, a few past it, truncated), and a separate set of held-out records.
Both sides train ``llama_tiny`` for the same number of optimizer steps (as many as one pass over the
records allows on both) with about the same records per step: ``documents`` takes ``--rows`` packed
rows per step, ``none`` as many records (one per row) as those rows hold on average; same schedule.
Each round uses its own seed (data order, packing), the same for both sides, and the sides alternate
so that machine load hits both alike. Reported: loss-carrying tokens per second (median over the steps
after the first two, then over rounds; target: documents at least 2x), the records each side trained
on, and the final loss: the exported model's mean token loss over every held-out record, each run
alone in plain transformers, the same measurement for both sides (the same within noise: the paired
differences against the round-to-round spread). Results go to ``bench/results/packing_DATE.{md,json}``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import tempfile
from pathlib import Path

from hybridtrain.cli import REPO as ROOT


def skewed_prompt_completion(n: int, seq_len: int, seed: int) -> list[dict]:
    """``n`` prompt-completion records from the embedded corpus, log-normal in length: median about
    ``seq_len / 13`` words, which the embedded tokenizer turns into about ``seq_len / 10`` tokens, a few
    past ``seq_len``; a third prompt, the rest completion."""
    import numpy as np

    from hybridtrain.data.embedded import documents

    rng = np.random.default_rng(seed)
    words = " ".join(documents()[:200]).split()
    out = []
    for _ in range(n):
        size = int(np.clip(rng.lognormal(np.log(seq_len / 13), 0.9), 4, 1.1 * seq_len))
        at = int(rng.integers(0, len(words) - size - 1))
        cut = max(1, size // 3)
        out.append({"prompt": " ".join(words[at:at + cut]) + "\n", "completion": " ".join(words[at + cut:at + size])})
    return out


def _overrides(data: Path, seq_len: int, packing: str, rows: int, micro: int, seed: int, steps: int) -> list[str]:
    return ["+recipe=llama_tiny", "data=files", f"data.path={data}", "data.format=prompt_completion",
            f"data.packing={packing}", f"data.seq_len={seq_len}", f"trainer.max_steps={steps}",
            f"trainer.global_batch_size={rows}", f"parallel.micro_batch_size={micro}", f"trainer.seed={seed}",
            "trainer.save_final=true", "trainer.export_hf=true", "trainer.log_every=1", "optim.warmup_steps=2"]


def held_out(path: Path, seq_len: int, cache: Path) -> list[tuple]:
    """The held-out records as ``(input_ids, labels)`` tensors ``[1, n]``, prepared as training prepares them."""
    import numpy as np
    import torch

    from hybridtrain.config import DataConfig
    from hybridtrain.data.prepare import prepare
    from hybridtrain.data.sampler import open_samples

    cfg = DataConfig(source="files", path=str(path), format="prompt_completion", packing="documents",
                     seq_len=seq_len, cache_dir=str(cache))
    samples = open_samples(json.loads(prepare(cfg, 0, log=lambda _: None).to_json()), "train", 0)
    out = []
    for r in range(len(samples.lengths)):
        a, b = int(samples.offsets[r]), int(samples.offsets[r + 1])
        out.append((torch.from_numpy(np.asarray(samples.input_ids[a:b], dtype=np.int64))[None],
                    torch.from_numpy(np.asarray(samples.labels[a:b], dtype=np.int64))[None]))
    return out


def held_out_loss(model_dir: Path, records: list[tuple]) -> float:
    """Mean token loss of the exported model over every held-out record, each alone (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in records:
            logits = model(input_ids=x, use_cache=False).logits.float()
            total += float(torch.nn.functional.cross_entropy(logits[0], y[0], ignore_index=-100, reduction="sum"))
            count += int((y != -100).sum())
    return total / count


def record_stats(data: Path, seq_len: int, cache: Path) -> dict:
    """Token lengths of the training records as prepared (after truncation to ``seq_len + 1``) and how
    ``documents`` packs them (seed 0)."""
    import numpy as np

    from hybridtrain.config import DataConfig
    from hybridtrain.data.prepare import prepare
    from hybridtrain.data.sampler import open_samples

    cfg = DataConfig(source="files", path=str(data), format="prompt_completion", seq_len=seq_len,
                     cache_dir=str(cache))
    prepared = json.loads(prepare(cfg, 0, log=lambda _: None).to_json())
    samples = open_samples(prepared, "train", 0)
    lengths = samples.lengths + 1  # a record of n tokens is n - 1 inputs: its last token is only a label
    train = prepared["splits"]["train"]
    return {"records": train["records"], "rows": samples.num_samples,
            "records_per_row": train["num_records"] / samples.num_samples, "fill": samples.fill,
            "median_tokens": float(np.median(lengths)), "p95_tokens": float(np.percentile(lengths, 95)),
            "max_tokens": int(lengths.max()), "at_seq_len": int((samples.lengths == seq_len).sum()),
            "truncated": train["truncated_records"], "dropped": train["dropped_records"]}


def records_trained(data: Path, seq_len: int, packing: str, rows: int, seed: int, steps: int, cache: Path) -> int:
    """Records in the first ``steps`` global batches of ``rows`` rows of a run (from its sampler)."""
    from hybridtrain.config import DataConfig
    from hybridtrain.data.prepare import prepare
    from hybridtrain.data.sampler import DocumentSamples, open_samples

    cfg = DataConfig(source="files", path=str(data), format="prompt_completion", packing=packing, seq_len=seq_len,
                     cache_dir=str(cache))
    samples = open_samples(json.loads(prepare(cfg, seed, log=lambda _: None).to_json()), "train", seed)
    if not isinstance(samples, DocumentSamples):
        return steps * rows
    return sum(len(samples.records(r)) for step in range(steps) for r in samples.global_indices(step, rows))


def run_side(work: Path, data: Path, seq_len: int, packing: str, rows: int, micro: int, seed: int, steps: int,
             cache: Path, held: list[tuple]) -> dict:
    """One training run: its throughput, the records it trained on and its final held-out loss."""
    from bench.common import check, run_hybridtrain

    run_dir = work / f"{packing}_seed{seed}"
    run = check(run_hybridtrain(run_dir, _overrides(data, seq_len, packing, rows, micro, seed, steps),
                                env={"HYBRIDTRAIN_CACHE": str(cache)}))
    train = [m for m in run.metrics() if "loss" in m]
    steady = [m for m in train if m["step"] > 2]
    return {"seed": seed, "steps": len(train), "records": records_trained(data, seq_len, packing, rows, seed, steps, cache),
            "loss_tokens_per_sec": statistics.median(m["loss_tokens_per_sec"] for m in steady),
            "tokens_per_sec": statistics.median(m["tokens_per_sec"] for m in steady),
            "step_time_s": statistics.median(m["step_time_s"] for m in steady),
            "loss_tokens": sum(m["loss_tokens"] for m in train), "final_train_loss": train[-1]["loss"],
            "held_out_loss": held_out_loss(run_dir / "hf", held), "run_dir": str(run_dir)}


def picture(path: Path, seq_len: int = 32) -> Path:
    """A packed row and its attention mask, drawn from the real code: four prompt-completion records
    packed by :class:`~hybridtrain.data.sampler.DocumentSamples`, and the mask transformers builds from
    the row's position ids (``create_causal_mask``, as every ``DecoderBlock`` calls it), next to the
    causal mask the same tokens get as one stream (``data.packing=stream``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import torch
    from matplotlib.colors import ListedColormap
    from transformers import AutoConfig
    from transformers.masking_utils import create_causal_mask

    from hybridtrain.data.sampler import DocumentSamples

    lengths, prompts = [11, 8, 6, 4], [4, 3, 2, 2]  # tokens, of which prompt (no loss)
    records, base = [], 100
    for n, p in zip(lengths, prompts):
        ids = list(range(base, base + n))
        records.append((ids, [-100] * (p - 1) + ids[p:] + [base + n]))
        base += 100
    samples = DocumentSamples.from_records(records, seq_len=seq_len, seed=0)
    assert samples.num_samples == 1
    ids, labels = samples.rows(np.array([0]))
    pos = samples.positions(np.array([0]))
    record_of = np.full(seq_len, -1)
    at = 0
    for k, r in enumerate(samples.records(0)):
        record_of[at:at + lengths[r]] = k
        at += lengths[r]
    config = AutoConfig.for_model("llama", hidden_size=8, num_attention_heads=1, num_hidden_layers=1)
    config._attn_implementation = "sdpa"
    embeds = torch.zeros(1, seq_len, 8)
    documents = create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, cache=None,
                                   position_ids=torch.from_numpy(pos))[0, 0].numpy()
    stream = np.tril(np.ones((seq_len, seq_len), dtype=bool))  # what is_causal computes: no mask is built

    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    fig = plt.figure(figsize=(11, 6.6))
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 4.2], hspace=0.35, wspace=0.15)
    row = fig.add_subplot(grid[0, :])
    for t in range(seq_len):
        k = record_of[t]
        face = colors[k] if k >= 0 else "#dddddd"
        loss = labels[0, t] != -100
        row.add_patch(plt.Rectangle((t, 0), 0.95, 1, facecolor=face, alpha=1.0 if loss else 0.45,
                                    hatch=None if loss or k < 0 else "///", edgecolor="white"))
        row.text(t + 0.47, 0.5, str(pos[0, t]), ha="center", va="center", fontsize=7,
                 color="white" if k >= 0 else "#777777")
    row.set_xlim(0, seq_len)
    row.set_ylim(0, 1)
    row.set_yticks([])
    row.set_xticks(range(0, seq_len + 1, 4))
    row.set_title(f"one packed row of seq_len={seq_len}: four records (colours) then padding (grey); the number is "
                  "the position id; pale hatched: label -100 (prompt), solid: loss token", fontsize=9)
    cmap = ListedColormap(["#f4f4f4", "#333333"])
    for col, (mask, title) in enumerate([(documents, "data.packing=documents: the block-causal mask\n"
                                          "(transformers' create_causal_mask from the position ids)"),
                                         (stream, "the same tokens as one stream (data.packing=stream):\n"
                                          "causal, every token sees the records before it")]):
        ax = fig.add_subplot(grid[1, col])
        ax.imshow(mask, cmap=cmap, interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("key position in the row (dark: the query attends to it)")
        if col == 0:
            ax.set_ylabel("query position in the row")
        bounds = np.flatnonzero(np.diff(record_of)) + 0.5
        for b in bounds:
            ax.axhline(b, color="#c44e52", lw=0.6, alpha=0.6)
            ax.axvline(b, color="#c44e52", lw=0.6, alpha=0.6)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--records", type=int, default=640, help="training records")
    parser.add_argument("--held-out", type=int, default=160, help="held-out records for the final loss")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rows", type=int, default=4, help="global batch of the documents side (packed rows per step)")
    parser.add_argument("--micro", type=int, default=4, help="micro-batch size (rows) of both sides")
    parser.add_argument("--picture", type=Path, help="only draw the packed-row picture to this PNG")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--work", type=Path, help="keep the run folders here")
    args = parser.parse_args()
    if args.picture:
        print(picture(args.picture))
        return

    import os

    from bench.common import alternate, machine, machine_line

    facts = machine()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_packing_"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    data, held_path = work / "sft.jsonl", work / "held_out.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in skewed_prompt_completion(args.records, args.seq_len, 0)))
    held_path.write_text("".join(json.dumps(r) + "\n" for r in skewed_prompt_completion(args.held_out, args.seq_len, 1)))
    held = held_out(held_path, args.seq_len, cache)
    stats = record_stats(data, args.seq_len, cache)
    per_row = stats["records_per_row"]
    doc_rows, doc_micro = args.rows, min(args.micro, args.rows)
    none_rows = max(args.micro, round(doc_rows * per_row / args.micro) * args.micro)  # about as many records
    steps = min((stats["rows"] - 2) // doc_rows, args.records // none_rows)  # one pass on both (rows vary by seed)
    print(f"records: {stats}; documents: {doc_rows} rows per step (~{doc_rows * per_row:.1f} records); none: "
          f"{none_rows} rows (= records) per step; {steps} steps each", flush=True)
    sides = {
        "documents": lambda r: run_side(work, data, args.seq_len, "documents", doc_rows, doc_micro, r, steps, cache, held),
        "none": lambda r: run_side(work, data, args.seq_len, "none", none_rows, args.micro, r, steps, cache, held),
    }
    results = alternate(sides, args.rounds)
    facts["loadavg_end"] = os.getloadavg()

    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in results[side])

    speedup = med("documents", "loss_tokens_per_sec") / med("none", "loss_tokens_per_sec")
    diffs = [d["held_out_loss"] - n["held_out_loss"] for d, n in zip(results["documents"], results["none"])]
    spread = {s: (max(r["held_out_loss"] for r in results[s]) - min(r["held_out_loss"] for r in results[s]))
              for s in results}
    summary = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": machine_line(facts),
               "seq_len": args.seq_len, "records": stats, "rows_per_step": {"documents": doc_rows, "none": none_rows},
               "micro_batch_size": {"documents": doc_micro, "none": args.micro}, "rounds": args.rounds, "results": results,
               "steps": steps, "held_out_records": len(held),
               "speedup_loss_tokens_per_sec": speedup, "held_out_loss_diffs": diffs, "held_out_loss_spread": spread}
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"packing_{stamp}.json").write_text(json.dumps(summary, indent=1))
    s = stats
    lines = [
        f"# Packing benchmark, {summary['date']}", "",
        f"Machine: {summary['machine']}", "",
        f"Data: {s['records']} prompt-completion training records and {len(held)} held-out ones, token lengths median "
        f"{s['median_tokens']:.0f}, 95th percentile {s['p95_tokens']:.0f}, max {s['max_tokens']} "
        f"({s['at_seq_len']} at seq_len={args.seq_len}, {s['truncated']} truncated). `documents` packs them into "
        f"{s['rows']} rows ({s['records_per_row']:.1f} records per row, {100 * s['fill']:.0f}% of the tokens real).", "",
        f"llama_tiny, {steps} steps on both sides, (1,1,1); `none`: {none_rows} rows (= records) per step in "
        f"micro-batches of {args.micro}, `documents`: {doc_rows} rows (~{doc_rows * s['records_per_row']:.0f} records) "
        f"per step in micro-batches of {doc_micro}. {args.rounds} rounds "
        "alternating documents / none, round r with trainer.seed=r on both sides.", "",
        "| packing | loss tokens/s (median) | tokens/s incl. padding | step time | records trained | final held-out loss per round |",
        "|---|---|---|---|---|---|",
    ]
    for side in ("documents", "none"):
        rs = results[side]
        losses = ", ".join(f"{r['held_out_loss']:.4f}" for r in rs)
        trained = ", ".join(str(r["records"]) for r in rs)
        lines.append(f"| {side} | {med(side, 'loss_tokens_per_sec'):,.0f} | {med(side, 'tokens_per_sec'):,.0f} | "
                     f"{med(side, 'step_time_s'):.3f} s | {trained} | {losses} |")
    lines += ["", f"Loss-carrying tokens per second, documents / none: **{speedup:.1f}x** (target >= 2x).", "",
              f"Final held-out loss (mean token loss of the exported model over the {len(held)} held-out records, each "
              f"alone in transformers), documents - none per round: {', '.join(f'{d:+.4f}' for d in diffs)}; "
              f"round-to-round spread (seed): documents {spread['documents']:.4f}, none {spread['none']:.4f}."]
    (args.out / f"packing_{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
