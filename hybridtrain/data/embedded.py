"""The embedded default data: the King James Bible and a BPE tokenizer trained on it.

The corpus is one more source of records (``data.source=embedded``): each chapter is a document
in a ``text`` field, tokenized and cached by :mod:`hybridtrain.data.prepare` like any other source.
"""
from __future__ import annotations

import gzip
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets"
CORPUS = ASSETS / "kjv.txt.gz"
"""King James Bible (public domain), one chapter per document: a title line then its text."""
TOKENIZER = ASSETS / "tokenizer.json"
"""Byte-level BPE, 8000 tokens, trained on :data:`CORPUS` with HF ``tokenizers``; EOS ``<|endoftext|>``."""
EOS = "<|endoftext|>"


def documents(text: str | None = None) -> list[str]:
    """The corpus as documents: one chapter each, its title line (``Genesis 1``) then its verses."""
    if text is None:
        text = gzip.open(CORPUS, "rt", encoding="utf-8").read()
    lines = [ln for ln in text.split("\n") if ln.strip()]
    return ["\n".join(lines[i:i + 2]) for i in range(0, len(lines), 2)]


PAIRS = 256
"""Preference pairs :func:`preference_pairs` derives from the corpus."""


def preference_pairs(count: int = PAIRS, seed: int = 0) -> list[dict[str, str]]:
    """Preference records derived from the corpus (``data.source=embedded data.format=preference``): sentences of
    6 to 30 words, the prompt a sentence's first half, ``chosen`` its true second half, ``rejected`` the second
    half of another sentence picked at random. Fixed by ``seed`` (not ``trainer.seed``): the same records every run."""
    import random
    import re

    sentences = [s for doc in documents() for s in re.split(r"(?<=[.?!])\s+", doc.split("\n", 1)[1])]
    verses = [s for s in sentences if 6 <= len(s.split()) <= 30]
    rng = random.Random(seed)
    picked = rng.sample(range(len(verses)), count)
    out = []
    for i in picked:
        words = verses[i].split()
        other = verses[rng.randrange(len(verses))].split()
        cut, other_cut = len(words) // 2, len(other) // 2
        out.append({"prompt": " ".join(words[:cut]), "chosen": " " + " ".join(words[cut:]),
                    "rejected": " " + " ".join(other[other_cut:])})
    return out
