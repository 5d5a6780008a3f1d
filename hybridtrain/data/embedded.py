"""The embedded default data: the King James Bible and a BPE tokenizer trained on it.

Tokenization runs once, in the launching process, and is cached as a ``.npy`` token array
keyed by the hashes of the text and the tokenizer; workers memory-map that file.
"""
from __future__ import annotations

import gzip
import hashlib
import os
from pathlib import Path

import numpy as np

from hybridtrain.config.schema import DataConfig

ASSETS = Path(__file__).resolve().parents[1] / "assets"
CORPUS = ASSETS / "kjv.txt.gz"
"""King James Bible (public domain), one chapter per document: a title line then its text."""
TOKENIZER = ASSETS / "tokenizer.json"
"""Byte-level BPE, 8000 tokens, trained on :data:`CORPUS` with HF ``tokenizers``; EOS ``<|endoftext|>``."""
EOS = "<|endoftext|>"


def tokenizer_file(cfg: DataConfig) -> Path:
    """The ``tokenizer.json`` to use: ``data.tokenizer`` (a file or a folder holding one) or the embedded one."""
    if cfg.tokenizer is None:
        return TOKENIZER
    path = Path(cfg.tokenizer).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"data.tokenizer={cfg.tokenizer!r}: no tokenizer.json there; "
                                "give a tokenizer.json file or a folder holding one, or null for the embedded one")
    return path


def load_tokenizer(cfg: DataConfig):
    """The HF ``tokenizers.Tokenizer`` of this run."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_file(cfg)))


def vocab_size(cfg: DataConfig) -> int:
    """Size of the tokenizer's vocabulary, special tokens included."""
    return load_tokenizer(cfg).get_vocab_size(with_added_tokens=True)


def eos_id(cfg: DataConfig) -> int | None:
    """Id of the end-of-document token, or ``None`` if the tokenizer has none."""
    return load_tokenizer(cfg).token_to_id(EOS)


def cache_root(cfg: DataConfig) -> Path:
    """``data.cache_dir``, else ``$HYBRIDTRAIN_CACHE``, else ``~/.cache/hybridtrain``."""
    root = cfg.cache_dir or os.environ.get("HYBRIDTRAIN_CACHE") or Path.home() / ".cache" / "hybridtrain"
    return Path(root).expanduser()


def _documents(text: str) -> list[str]:
    lines = [ln for ln in text.split("\n") if ln.strip()]
    # chapters: a title line ("Genesis 1") followed by one line of verses
    return ["\n".join(lines[i:i + 2]) for i in range(0, len(lines), 2)]


def prepare_tokens(cfg: DataConfig) -> Path:
    """Tokenize the embedded corpus (documents joined by EOS) once; return the cached ``.npy`` path."""
    tok_path = tokenizer_file(cfg)
    digest = hashlib.sha256(CORPUS.read_bytes() + tok_path.read_bytes()).hexdigest()[:16]
    out = cache_root(cfg) / f"embedded-{digest}.npy"
    if out.exists():
        return out
    tokenizer = load_tokenizer(cfg)
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        raise ValueError(f"tokenizer {tok_path} has no {EOS!r} token to separate documents")
    text = gzip.open(CORPUS, "rt", encoding="utf-8").read()
    ids: list[int] = []
    for enc in tokenizer.encode_batch(_documents(text)):
        ids.extend(enc.ids)
        ids.append(eos)
    dtype = np.uint16 if tokenizer.get_vocab_size() < 2**16 else np.uint32
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp.npy")
    np.save(tmp, np.asarray(ids, dtype=dtype))
    os.replace(tmp, out)  # atomic: concurrent or interrupted runs never see a partial file
    return out
