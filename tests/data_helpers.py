"""Small corpora for the data tests, built from the embedded Bible in a temporary folder (no network)."""
from __future__ import annotations

import json
from pathlib import Path

from hybridtrain.data.embedded import documents


def chapters(n: int, start: int = 0) -> list[str]:
    """``n`` chapters of the embedded corpus (title line, then verses)."""
    return documents()[start:start + n]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    """One JSON object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def text_corpus(path: Path, n: int = 60, field: str = "content", start: int = 0) -> Path:
    """``n`` chapters as ``{field: text, "source": "kjv"}`` records."""
    return write_jsonl(path, [{field: c, "source": "kjv"} for c in chapters(n, start)])


def chat_records(n: int, start: int = 0) -> list[dict]:
    """Chats from chapters: the user gives a chapter's title, the assistant answers with its first verses."""
    out = []
    for c in chapters(n, start):
        title, text = c.split("\n", 1)
        out.append({"messages": [
            {"role": "system", "content": "You recite scripture."},
            {"role": "user", "content": f"Recite {title}."},
            {"role": "assistant", "content": text[:120]},
            {"role": "user", "content": "And then?"},
            {"role": "assistant", "content": text[120:200]},
        ]})
    return out
