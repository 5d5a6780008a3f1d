"""Write a suite's results: ``NAME.md`` (tables), ``NAME.json`` (everything) and ``NAME.png`` (plots)."""
from __future__ import annotations

import json
from pathlib import Path

from bench.common import machine_line


def _table(rows: list[list[str]]) -> list[str]:
    head, *body = rows
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]


def write_report(results: dict, out: Path, name: str) -> str:
    """Write the three files under ``out``; return the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# hybridtrain benchmark suite, {results['date']}", "",
             f"Machine: {machine_line(results['machine'])}", "",
             f"Model: `{results.get('model', '')}` (and per comparison the layout below).", "",
             f"Command: `{results['command']}`; {results['rounds']} rounds per comparison, sides run alternately "
             "(A B A B ...); medians. Plots: " + f"`{name}.png`; all numbers: `{name}.json`.", ""]
    for key, sec in results["sections"].items():
        lines += [f"## {sec['title']}", "", sec["what"], ""] + _table(sec["table"]) + ["", sec["summary"],
                                                                                     f"({sec['seconds']:.0f} s)", ""]
    md = "\n".join(lines)
    (out / f"{name}.md").write_text(md)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1, default=str))
    _plot(results, out / f"{name}.png")
    return md


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = [(k, s) for k, s in results["sections"].items() if "plot" in s]
    if not sections:
        return
    cols = min(3, len(sections))
    rows = (len(sections) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (key, sec) in zip(axes.flat, sections):
        p = sec["plot"]
        if "series" in p:
            for label, pts in p["series"].items():
                ax.plot([s for s, _ in pts], [m for _, m in pts], label=label)
            ax.set_xlabel(p["xlabel"])
            ax.legend(fontsize=8)
        else:
            ax.bar(range(len(p["values"])), p["values"], color="tab:blue")
            if "values2" in p:
                ax.plot(range(len(p["values2"])), p["values2"], "o-", color="tab:orange", label="ideal")
                ax.legend(fontsize=8)
            ax.set_xticks(range(len(p["labels"])), p["labels"], fontsize=8, rotation=20)
        ax.set_ylabel(p["ylabel"], fontsize=8)
        ax.set_title(key, fontsize=10)
    for ax in list(axes.flat)[len(sections):]:
        ax.axis("off")
    fig.suptitle(f"hybridtrain bench {results['date']} ({results['machine']['cores']} cores, "
                 f"load {results['machine']['loadavg_start'][0]:.1f})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
