"""Records a format cannot train on: its field missing, null, or not of the format's type.

Checked on each source's raw records (:class:`~hybridtrain.data.sources.Raw`), before validation
records are split off and before tokenizing, so a record's number is its place in its own file
(counting from 0). Without ``data.skip_invalid`` one such record is a
:class:`~hybridtrain.errors.PlanError` naming the files, the first record numbers and the count;
with it the records are removed and counted (:func:`screen` returns what it skipped, which the run
prints and keeps in ``data.json``). Nothing is dropped silently: a ``text`` record whose field is
missing used to become an empty document, a ``prompt_completion`` record without its completion a
prompt -> EOS sample.
"""
from __future__ import annotations

from typing import Any, Sequence

from hybridtrain.config.schema import DataConfig
from hybridtrain.errors import PlanError
from hybridtrain.data.formats import ROLES, message_problem

SHOWN = 5
"""Record numbers named in a message (the rest are counted)."""
BATCH = 65536


def fields_of(cfg: DataConfig) -> list[tuple[str, str]]:
    """``(field, key)`` of every field ``data.format`` reads, e.g. ``[("text", "data.text_field")]``."""
    return {"text": [(cfg.text_field, "data.text_field")], "chat": [(cfg.messages_field, "data.messages_field")],
            "prompt_completion": [(cfg.prompt_field, "data.prompt_field"),
                                  (cfg.completion_field, "data.completion_field")],
            "preference": [(cfg.prompt_field, "data.prompt_field"), (cfg.chosen_field, "data.chosen_field"),
                           (cfg.rejected_field, "data.rejected_field")]}[str(cfg.format)]


def _type_name(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def preference_problem(value: Any, completion: bool) -> str | None:
    """What keeps one field of a ``preference`` record from training (``None``: nothing): text, or a list of
    ``{role, content}`` messages (TRL's conversational form); a completion (``chosen``, ``rejected``) must
    not be empty. The prompt may be empty text (TRL's convention)."""
    if isinstance(value, str):
        return "is empty" if completion and not value else None
    if value is None:
        return "missing or null"
    if not isinstance(value, list):
        return f"{_type_name(value)}, not text or a list of messages"
    if not value:
        return "is an empty list of messages" if completion else None
    for m in value:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return f"has message {str(m)[:120]!r}, which lacks a known role or string content"
    return None


def _column_problems(ds, field: str, chat: bool, completion: bool | None = None) -> dict[int, str]:
    """``record -> problem`` of field ``field`` over ``ds``: Arrow's null mask for a string column,
    else (mixed types, which HF stores as JSON, numbers, lists; every chat record) value by value."""
    import pyarrow as pa

    arrow_type = ds.data.table.schema.field(field).type if ds._indices is None else None
    out: dict[int, str] = {}
    string = arrow_type is not None and (pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type))
    if completion is None and not chat and string:
        column = ds.data.table.column(field)
        if column.null_count:
            import numpy as np

            nulls = np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))
            out = {int(i): "missing or null" for i in nulls}
        return out
    start = 0
    for batch in ds.select_columns([field]).iter(batch_size=BATCH):
        for offset, value in enumerate(batch[field]):
            if completion is not None:  # data.format=preference
                problem = preference_problem(value, completion)
            elif chat:
                problem = message_problem(value)
            else:
                problem = None if isinstance(value, str) else ("missing or null" if value is None else
                                                                f"{_type_name(value)}, not text")
            if problem:
                out[start + offset] = problem
        start += len(batch[field])
    return out


def where(records: Sequence[int], origins: Sequence[tuple[str, int]]) -> str:
    """``corpus.jsonl records 3, 7 and 12, extra.jsonl record 0`` for the first :data:`SHOWN` of
    ``records`` (indices into the concatenated ``origins``: ``(file, records)`` in order), and how many more."""
    groups: list[tuple[str, list[int]]] = []
    bounds, at = [], 0
    for name, count in origins:
        bounds.append((at, at + count, name))
        at += count
    for r in records[:SHOWN]:
        lo, _, name = next(b for b in bounds if b[0] <= r < b[1])
        if groups and groups[-1][0] == name:
            groups[-1][1].append(r - lo)
        else:
            groups.append((name, [r - lo]))
    text = ", ".join(f"{name} record{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}" for name, rs in groups)
    more = len(records) - SHOWN
    return text + (f" and {more} more" if more > 0 else "") + " (counting from 0)"


def problems(ds, cfg: DataConfig) -> dict[int, str]:
    """``record -> "field 'text' missing or null"`` for every record of ``ds`` that ``data.format`` cannot train on."""
    found: dict[int, str] = {}
    preference = str(cfg.format) == "preference"
    for name, key in fields_of(cfg):
        completion = key != "data.prompt_field" if preference else None
        for record, problem in _column_problems(ds, name, str(cfg.format) == "chat", completion).items():
            found.setdefault(record, f"field {name!r} {problem}")
    return found


def screen(ds, origins: Sequence[tuple[str, int]], cfg: DataConfig, source: str):
    """``ds`` less the records it cannot train on, and what was skipped (``{}``: nothing).

    ``origins``: ``(file or dataset, records)`` in the order of ``ds``'s records; ``source``: ``train``
    or ``val`` (the source, ``data.path`` or ``data.val_path``). Without ``data.skip_invalid`` an
    invalid record is a :class:`PlanError` keyed by the field's key.
    """
    found = problems(ds, cfg)
    if not found:
        return ds, {}
    records = sorted(found)
    reasons: dict[str, int] = {}
    for r in records:
        reasons[found[r]] = reasons.get(found[r], 0) + 1
    why = "; ".join(f"{n}: {reason}" for reason, n in reasons.items())
    where_ = where(records, origins)
    if not cfg.skip_invalid:
        field = found[records[0]].split("'")[1]
        key = next(k for f, k in fields_of(cfg) if f == field)
        raise PlanError(key, f"{len(records)} of {len(ds)} {source} records cannot be trained on ({why}): {where_}; "
                             "fix or remove them, or set data.skip_invalid=true to skip them (counted on the "
                             "console and in data.json)")
    if len(records) == len(ds):
        raise PlanError("data.skip_invalid", f"every one of the {len(ds)} {source} records is invalid ({why}): "
                                             f"{where_}; check the data.format and its field names")
    bad = set(records)
    kept = ds.select([i for i in range(len(ds)) if i not in bad])
    return kept, {"records": len(records), "of": len(ds), "why": why, "where": where_}


def describe(skipped: dict) -> str:
    """The console line of :func:`screen`'s ``skipped`` per source (``""`` when nothing was skipped)."""
    parts = [f"{source} {s['records']} of {s['of']} records ({s['why']}): {s['where']}" for source, s in skipped.items()]
    return ("[hybridtrain] data      skipped as invalid (data.skip_invalid=true): " + "; ".join(parts)) if parts else ""
