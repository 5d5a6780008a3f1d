"""Record formats -> token ids and loss masks -> samples. Batched functions for ``datasets.map``.

A record becomes either a document of the packed ``text`` stream (its ids then EOS) or one row
``(input_ids [seq_len], labels [seq_len])`` built by :func:`to_row` from its ids and a per-token
mask saying which tokens are *targets* (carry loss). Everything is a plain function of its
arguments (the tokenizer is passed in), so ``map(num_proc=N)`` can pickle it.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

from hybridtrain.errors import PlanError

ROLES = ("system", "user", "assistant", "tool")
IGNORE = -100
"""Label of a position that carries no loss (padding, prompt, non-assistant tokens)."""
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def to_row(ids: Sequence[int], targets: Sequence[int], seq_len: int, pad_id: int) -> tuple[list[int], list[int]] | None:
    """One sample from a record's ``ids`` and its target mask (``targets[t] = 1``: token t carries loss).

    ``input_ids = ids[:seq_len]`` right-padded with ``pad_id``; ``labels[t] = ids[t + 1]`` where token
    ``t + 1`` is a target, else :data:`IGNORE` (so padding and masked tokens carry no loss). Tokens past
    ``seq_len + 1`` are cut. ``None`` when no label is left (nothing to learn from this record).
    """
    ids, targets = list(ids[:seq_len + 1]), list(targets[:seq_len + 1])
    labels = [ids[t + 1] if targets[t + 1] else IGNORE for t in range(len(ids) - 1)]
    if not any(label != IGNORE for label in labels):
        return None
    inputs = ids[:-1]
    pad = seq_len - len(inputs)
    return inputs + [pad_id] * pad, labels + [IGNORE] * pad


def _texts(batch: dict[str, list], field: str, indices: list[int]) -> list[str]:
    out = []
    for text, i in zip(batch[field], indices):
        if text is None:
            text = ""
        if not isinstance(text, str):
            raise PlanError("data.text_field", f"record {i}: field {field!r} holds a {type(text).__name__}, not text; "
                                               "point data.text_field at a string field")
        out.append(text)
    return out


def text_stream(batch: dict[str, list], indices: list[int], *, tokenizer, field: str, eos_id: int) -> dict[str, list]:
    """Packed ``text``: each non-empty document's ids followed by EOS (column ``ids``)."""
    texts = [t for t in _texts(batch, field, indices) if t]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return {"ids": [doc + [eos_id] for doc in ids]}


def _rows(pairs: list[tuple[list[int], list[int]] | None]) -> dict[str, list]:
    kept = [p for p in pairs if p is not None]
    return {"input_ids": [p[0] for p in kept], "labels": [p[1] for p in kept]}


def text_rows(batch: dict[str, list], indices: list[int], *, tokenizer, field: str, eos_id: int,
              seq_len: int, pad_id: int) -> dict[str, list]:
    """Unpacked ``text``: one document per sample (its ids then EOS), truncated and padded; every token a target."""
    ids = tokenizer(_texts(batch, field, indices), add_special_tokens=False)["input_ids"]
    return _rows([to_row(doc + [eos_id], [1] * (len(doc) + 1), seq_len, pad_id) for doc in ids])


def prompt_completion_rows(batch: dict[str, list], indices: list[int], *, tokenizer, prompt_field: str,
                           completion_field: str, eos_id: int, seq_len: int, pad_id: int) -> dict[str, list]:
    """``prompt_completion``: prompt ids then completion ids then EOS; only completion and EOS are targets.

    Prompt and completion are tokenized separately, so the mask boundary is exact.
    """
    prompts = tokenizer(_texts(batch, prompt_field, indices), add_special_tokens=False)["input_ids"]
    completions = tokenizer(_texts(batch, completion_field, indices), add_special_tokens=False)["input_ids"]
    pairs = []
    for p, c in zip(prompts, completions):
        c = c + [eos_id]
        pairs.append(to_row(p + c, [0] * len(p) + [1] * len(c), seq_len, pad_id))
    return _rows(pairs)


def check_messages(messages: Any, index: int, field: str) -> None:
    """A chat record must be a list of ``{role, content}`` with known roles and at least one assistant turn."""
    fix = (f"each record's {field!r} must be a list of {{'role': ..., 'content': ...}} messages with roles in "
           f"{list(ROLES)} and at least one 'assistant' turn")
    if not isinstance(messages, list) or not messages:
        raise PlanError("data.messages_field", f"record {index}: {field!r} is {type(messages).__name__} "
                                               f"{str(messages)[:80]!r}; {fix}")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise PlanError("data.messages_field", f"record {index}: message {str(m)[:120]!r} lacks a known role "
                                                   f"or string content; {fix}")
    if not any(m["role"] == "assistant" for m in messages):
        raise PlanError("data.messages_field", f"record {index}: no assistant message (roles "
                                               f"{[m['role'] for m in messages]}); {fix}")


def chat_rows(batch: dict[str, list], indices: list[int], *, tokenizer, field: str, seq_len: int,
              pad_id: int) -> dict[str, list]:
    """``chat``: the messages rendered with the tokenizer's chat template; the assistant tokens (the
    template's ``{% generation %}`` spans) are the targets."""
    pairs = []
    for messages, i in zip(batch[field], indices):
        check_messages(messages, i, field)
        out = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                            tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        pairs.append(to_row(out["input_ids"], out["assistant_masks"], seq_len, pad_id))
    return _rows(pairs)
