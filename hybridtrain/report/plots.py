"""The report's PNG plots, one function per figure (matplotlib, Agg backend, no display needed)."""
from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def loss(train: list[dict], val: list[dict], path: Path) -> Path:
    """Training loss per step, and validation loss at its steps when present."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1.2)
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation", lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def series(train: list[dict], key: str, ylabel: str, path: Path, scale: float = 1.0) -> Path:
    """One metric per step (``None`` values skipped)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    pts = [(r["step"], r[key] * scale) for r in train if r.get(key) is not None]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], ".-", lw=1.0)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def memory(last: dict, path: Path) -> Path:
    """Per-rank memory of the last logged step: resident memory, model state and GPU peak."""
    plt = _plt()
    bars = [("resident (RSS)", last.get("rank_rss_bytes")), ("model state", last.get("rank_model_state_bytes")),
            ("GPU peak allocated", last.get("rank_gpu_peak_bytes"))]
    bars = [(name, vals) for name, vals in bars if vals]
    ranks = len(bars[0][1]) if bars else 0
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * ranks + 2), 3.5))
    width = 0.8 / max(1, len(bars))
    for i, (name, vals) in enumerate(bars):
        ax.bar([r + i * width for r in range(ranks)], [(v or 0) / 2**20 for v in vals], width, label=name)
    ax.set_xticks([r + width * (len(bars) - 1) / 2 for r in range(ranks)])
    ax.set_xticklabels([f"rank {r}" for r in range(ranks)])
    ax.set_ylabel("MiB")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def stages(times: dict[str, list[float]], path: Path) -> Path:
    """Per-stage median seconds per step, stacked: forward, backward, send/receive, optimizer, other."""
    plt = _plt()
    pp = len(times["forward"])
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * pp + 2) + 2.5, 3.5))
    bottom = [0.0] * pp
    parts = [("forward", times["forward"]), ("backward", times["backward"]), ("send/receive", times["comm"]),
             ("optimizer", times["optimizer"])]
    other = [max(0.0, s - sum(p[1][i] for p in parts)) for i, s in enumerate(times["step"])]
    for name, vals in parts + [("other (data, idle, bookkeeping)", other)]:
        ax.bar(range(pp), [v * 1e3 for v in vals], bottom=[b * 1e3 for b in bottom], label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(pp))
    ax.set_xticklabels([f"stage {s}" for s in range(pp)])
    ax.set_ylabel("ms per step (median)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)
