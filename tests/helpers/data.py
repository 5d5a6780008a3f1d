"""Small corpora for the data tests, built from the embedded Bible in a temporary folder (no network)."""
from __future__ import annotations

import json
from pathlib import Path

from hybridtrain.data.embedded import documents


CHAT_PAIRS = [
    {"prompt": [{"role": "system", "content": "You recite scripture."},
                {"role": "user", "content": "Who made the light?"}],
     "chosen": [{"role": "assistant", "content": "God said, Let there be light."}],
     "rejected": [{"role": "assistant", "content": "Nobody at all"}]},
    {"prompt": [{"role": "user", "content": "And then?"}],
     "chosen": [{"role": "assistant", "content": "And there was light."}],
     "rejected": [{"role": "assistant", "content": "Darkness"}]}]
"""Two chat-format preference pairs, the first with a system turn."""


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


def save_samples(folder: Path, kind: str, rows, labels=None, num_shards: int = 1) -> Path:
    """A dataset folder in the format :mod:`hybridtrain.data.prepare` writes: ``packed`` takes a list of
    documents (token lists), ``rows`` a ``[N, seq_len]`` array of ids and one of labels, ``documents``
    lists of ids and of labels of any lengths. ``num_shards`` > 1 splits it over several Arrow files
    (reads then cross file boundaries)."""
    from datasets import Dataset

    from hybridtrain.data.prepare import features

    if kind == "packed":
        data = {"ids": [list(map(int, r)) for r in rows]}
        seq_len = 0
    else:
        data = {"input_ids": [list(map(int, r)) for r in rows], "labels": [list(map(int, r)) for r in labels],
                "num_labels": [sum(int(x) != -100 for x in r) for r in labels]}
        seq_len = len(data["input_ids"][0])
    feats = features(kind, seq_len, "uint16")
    if kind != "packed":  # what prepare reports and drops before saving
        del feats["record"], feats["cut"]
    Dataset.from_dict(data, features=feats).save_to_disk(str(folder), num_shards=num_shards)
    return folder


def skewed_prompt_completion(n: int, seq_len: int, seed: int = 0, start: int = 0) -> list[dict]:
    """``n`` prompt-completion records from chapters, of log-normal lengths: the median record about a
    tenth of ``seq_len`` tokens, a few longer than ``seq_len`` (truncated when prepared). The embedded
    tokenizer gives about one token per word of these texts plus punctuation."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = " ".join(chapters(40, start)).split()
    out = []
    for k in range(n):
        size = int(np.clip(rng.lognormal(np.log(seq_len / 10), 1.0), 3, 1.5 * seq_len))
        at = int(rng.integers(0, len(words) - size - 1))
        cut = max(1, size // 3)  # a third prompt, the rest completion
        out.append({"prompt": " ".join(words[at:at + cut]) + "\n", "completion": " ".join(words[at + cut:at + size])})
    return out
