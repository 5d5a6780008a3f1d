"""Record formats -> token ids and loss masks -> samples. Batched functions for ``datasets.map``.

A record becomes either a document of the packed ``text`` stream (its ids then EOS; ``stream``) or a
sample ``(input_ids, labels)`` built by :func:`to_record` from its ids and a per-token mask saying
which tokens are *targets* (carry loss): padded to ``seq_len`` (:func:`to_row`, ``packing=none``) or
left at its own length for the sampler to pack (``packing=documents``). Every sample function also
writes ``num_labels`` (its loss tokens), ``record`` (the source record's index) and ``cut`` (tokens
dropped past ``seq_len + 1``), so the preparation can report what truncation did. Everything is a
plain function of its arguments (the tokenizer is passed in), so ``map(num_proc=N)`` can pickle it.

A record longer than ``seq_len + 1`` tokens is truncated (its first ``seq_len + 1`` tokens kept),
except ``text`` records with ``split``: those are cut into pieces of ``seq_len + 1`` tokens that
overlap by one, each its own sample, so every token is still learned.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

from hybridtrain.errors import PlanError

ROLES = ("system", "user", "assistant", "tool")
IGNORE = -100
"""Label of a position that carries no loss (padding, prompt, non-assistant tokens)."""
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def to_record(ids: Sequence[int], targets: Sequence[int], seq_len: int) -> tuple[list[int], list[int]] | None:
    """One unpadded sample from a record's ``ids`` and its target mask (``targets[t] = 1``: token t carries loss).

    ``inputs = ids[:n]``, ``labels[t] = ids[t + 1]`` where token ``t + 1`` is a target, else :data:`IGNORE`,
    with ``n = min(len(ids) - 1, seq_len)``: tokens past ``seq_len + 1`` are cut. ``None`` when no
    label is left (nothing to learn from this record).
    """
    ids, targets = list(ids[:seq_len + 1]), list(targets[:seq_len + 1])
    labels = [ids[t + 1] if targets[t + 1] else IGNORE for t in range(len(ids) - 1)]
    if not any(label != IGNORE for label in labels):
        return None
    return ids[:-1], labels


def to_row(ids: Sequence[int], targets: Sequence[int], seq_len: int, pad_id: int) -> tuple[list[int], list[int]] | None:
    """:func:`to_record` right-padded to ``seq_len`` with ``pad_id`` (labels with :data:`IGNORE`, so
    padding carries no loss)."""
    record = to_record(ids, targets, seq_len)
    if record is None:
        return None
    inputs, labels = record
    pad = seq_len - len(inputs)
    return inputs + [pad_id] * pad, labels + [IGNORE] * pad


def _samples(records: list[tuple[list[int], list[int]]], indices: list[int], seq_len: int, pad_id: int | None,
             split: bool = False) -> dict[str, list]:
    """The sample columns of ``records`` (``(ids, targets)`` each): padded rows when ``pad_id`` is given,
    unpadded samples otherwise; with ``split`` a long record becomes several samples (see the module)."""
    out: dict[str, list] = {"input_ids": [], "labels": [], "num_labels": [], "record": [], "cut": []}
    for (ids, targets), index in zip(records, indices):
        starts = range(0, max(1, len(ids) - 1), seq_len) if split else (0,)
        for start in starts:  # pieces of seq_len + 1 tokens overlapping by one
            sample = to_record(ids[start:], targets[start:], seq_len)
            if sample is None:
                continue
            inputs, labels = sample
            if pad_id is not None:
                pad = seq_len - len(inputs)
                inputs, labels = inputs + [pad_id] * pad, labels + [IGNORE] * pad
            out["input_ids"].append(inputs)
            out["labels"].append(labels)
            out["num_labels"].append(sum(label != IGNORE for label in labels))
            out["record"].append(index)
            out["cut"].append(0 if split else max(0, len(ids) - seq_len - 1))
    return out


def _texts(batch: dict[str, list], field: str, indices: list[int]) -> list[str]:
    out = []
    for text, i in zip(batch[field], indices):  # prepare screens the records first (hybridtrain.data.invalid)
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


def text_rows(batch: dict[str, list], indices: list[int], *, tokenizer, field: str, eos_id: int,
              seq_len: int, pad_id: int | None, split: bool = False) -> dict[str, list]:
    """``text`` one document per sample: its ids then EOS; every token a target. Truncated (or with
    ``split`` cut into pieces) and, with ``pad_id``, padded."""
    ids = tokenizer(_texts(batch, field, indices), add_special_tokens=False)["input_ids"]
    return _samples([(doc + [eos_id], [1] * (len(doc) + 1)) for doc in ids], indices, seq_len, pad_id, split)


def prompt_completion_rows(batch: dict[str, list], indices: list[int], *, tokenizer, prompt_field: str,
                           completion_field: str, eos_id: int, seq_len: int, pad_id: int | None) -> dict[str, list]:
    """``prompt_completion``: prompt ids then completion ids then EOS; only completion and EOS are targets.

    Prompt and completion are tokenized separately, so the mask boundary is exact.
    """
    prompts = tokenizer(_texts(batch, prompt_field, indices), add_special_tokens=False)["input_ids"]
    completions = tokenizer(_texts(batch, completion_field, indices), add_special_tokens=False)["input_ids"]
    records = [(p + c + [eos_id], [0] * len(p) + [1] * (len(c) + 1)) for p, c in zip(prompts, completions)]
    return _samples(records, indices, seq_len, pad_id)


def message_problem(messages: Any) -> str | None:
    """What keeps ``messages`` from being a chat record (``None``: nothing): it must be a non-empty list
    of ``{role, content}`` with known roles, string contents and at least one assistant turn."""
    if not isinstance(messages, list) or not messages:
        return "missing or null" if messages is None else f"is {type(messages).__name__} {str(messages)[:80]!r}"
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return f"has message {str(m)[:120]!r}, which lacks a known role or string content"
    if not any(m["role"] == "assistant" for m in messages):
        return f"has no assistant message (roles {[m['role'] for m in messages]})"
    return None


def check_messages(messages: Any, index: int, field: str) -> None:
    """A chat record must be a list of ``{role, content}`` with known roles and at least one assistant turn
    (:func:`message_problem`); a :class:`PlanError` naming record ``index`` otherwise."""
    problem = message_problem(messages)
    if problem:
        raise PlanError("data.messages_field", f"record {index}: {field!r} {problem}; each record's {field!r} must be "
                                               "a list of {'role': ..., 'content': ...} messages with roles in "
                                               f"{list(ROLES)} and at least one 'assistant' turn")


def chat_rows(batch: dict[str, list], indices: list[int], *, tokenizer, field: str, seq_len: int,
              pad_id: int | None) -> dict[str, list]:
    """``chat``: the messages rendered with the tokenizer's chat template; the assistant tokens (the
    template's ``{% generation %}`` spans) are the targets."""
    records = []
    for messages, i in zip(batch[field], indices):
        check_messages(messages, i, field)
        out = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                            tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        records.append((list(out["input_ids"]), list(out["assistant_masks"])))
    return _samples(records, indices, seq_len, pad_id)
