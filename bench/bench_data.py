"""Data benchmark: tokenization throughput of the hybridtrain pipeline against a plain batched
``tokenizer(...)`` loop over the same text, and the share of step time spent waiting for data.

    python -m bench.bench_data                       # tokenization, A B A B, 3 rounds
    python -m bench.bench_data --metrics RUN_DIR/metrics.jsonl   # also: data-wait share of a run

A = :func:`hybridtrain.data.prepare.prepare` on a jsonl copy of the embedded corpus (``data=files``,
a fresh cache folder each time: JSON -> Arrow, ``datasets.map`` tokenization, Arrow dataset saved).
B = read the same jsonl, ``tokenizer(batch, add_special_tokens=False)`` over batches of 1000
documents, EOS appended, one numpy array. Runs alternate A B A B so machine load hits both alike;
the medians and their ratio (target: pipeline >= 0.8x the plain loop) go to a dated Markdown table
and JSON under ``bench/results/``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from hybridtrain.cli import REPO as ROOT


def machine() -> str:
    """One line describing where the benchmark ran (bench/common.py, shared by every benchmark)."""
    from bench.common import machine as facts, machine_line

    return machine_line(facts())


def corpus(path: Path, copies: int) -> int:
    """The embedded corpus ``copies`` times as ``{"text": ...}`` jsonl; returns the document count."""
    from hybridtrain.data.embedded import documents

    docs = documents()
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(copies):
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
    return len(docs) * copies


def run_pipeline(path: Path, work: Path, num_proc: int) -> tuple[float, int]:
    from hybridtrain.config import DataConfig
    from hybridtrain.data.prepare import prepare

    cache = work / f"cache-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    p = prepare(DataConfig(source="files", path=str(path), cache_dir=str(cache), num_proc=num_proc), 0, log=lambda _: None)
    seconds = time.perf_counter() - t0
    shutil.rmtree(cache)
    return seconds, p.splits["train"]["num_tokens"]


def run_plain(path: Path, tokenizer) -> tuple[float, int]:
    import numpy as np

    t0 = time.perf_counter()
    texts = [json.loads(line)["text"] for line in open(path, encoding="utf-8")]
    eos = tokenizer.eos_token_id
    parts = []
    for i in range(0, len(texts), 1000):
        for ids in tokenizer(texts[i:i + 1000], add_special_tokens=False)["input_ids"]:
            parts.append(np.asarray(ids + [eos], dtype=np.uint16))
    tokens = np.concatenate(parts)
    return time.perf_counter() - t0, int(tokens.size)


def data_wait_share(metrics: Path) -> dict:
    """Sum of ``data_wait_s`` over the sum of ``step_time_s`` of a run's training records."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if "data_wait_s" in r]
    wait, total = sum(r["data_wait_s"] for r in steps), sum(r["step_time_s"] for r in steps)
    return {"metrics": str(metrics), "steps": len(steps), "data_wait_s": wait, "step_time_s": total,
            "share": wait / total if total else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="A B pairs")
    parser.add_argument("--copies", type=int, default=2, help="copies of the embedded corpus in the text")
    parser.add_argument("--num-proc", type=int, default=1, help="data.num_proc of the pipeline")
    parser.add_argument("--metrics", type=Path, help="a run's metrics.jsonl, for the data-wait share")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    import datasets

    from hybridtrain.config import DataConfig
    from hybridtrain.data.tokenizer import load_tokenizer

    datasets.disable_progress_bars()
    tokenizer = load_tokenizer(DataConfig())
    work = Path(tempfile.mkdtemp(prefix="bench_data_"))
    try:
        path = work / "corpus.jsonl"
        docs = corpus(path, args.copies)
        mb = path.stat().st_size / 2**20
        run_pipeline(path, work, args.num_proc)  # warm-up: imports, tokenizer load, page cache
        a, b, tokens = [], [], set()
        for _ in range(args.rounds):
            sa, na = run_pipeline(path, work, args.num_proc)
            sb, nb = run_plain(path, tokenizer)
            a.append(sa)
            b.append(sb)
            tokens |= {na, nb}
        assert len(tokens) == 1, f"the two paths produced different token counts {tokens}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = tokens.pop()
    ma, mb_ = statistics.median(a), statistics.median(b)
    result = {
        "date": dt.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
        "text": f"embedded corpus x{args.copies}: {docs} documents, {mb:.1f} MiB jsonl, {n} tokens",
        "num_proc": args.num_proc, "rounds": args.rounds,
        "pipeline_s": a, "plain_s": b, "pipeline_median_s": ma, "plain_median_s": mb_,
        "pipeline_tokens_per_s": n / ma, "plain_tokens_per_s": n / mb_, "ratio": mb_ / ma,
    }
    if args.metrics:
        result["data_wait"] = data_wait_share(args.metrics)
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"data_{stamp}.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Data benchmark, {result['date']}", "",
        f"Machine: {result['machine']}", "",
        f"Text: {result['text']}. Pipeline with data.num_proc={args.num_proc}; {args.rounds} rounds, alternating A B.", "",
        "| path | median s | tokens/s | runs (s) |", "|---|---|---|---|",
        f"| A: hybridtrain pipeline (load, map, save Arrow) | {ma:.2f} | {n / ma:,.0f} | {', '.join(f'{x:.2f}' for x in a)} |",
        f"| B: plain batched tokenizer(...) loop | {mb_:.2f} | {n / mb_:,.0f} | {', '.join(f'{x:.2f}' for x in b)} |",
        "", f"Pipeline throughput / plain throughput: **{result['ratio']:.2f}x** (target >= 0.8x).",
    ]
    if args.metrics:
        w = result["data_wait"]
        lines += ["", f"Data wait: {w['data_wait_s']:.3f} s of {w['step_time_s']:.1f} s step time over {w['steps']} "
                      f"steps = **{w['share']:.2%}** (target < 2%), from {w['metrics']}."]
    (args.out / f"data_{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
