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
