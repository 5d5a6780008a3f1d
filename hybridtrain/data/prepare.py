"""Tokenize a run's data once, in the launching process, and cache it on disk.

:func:`prepare` loads the records (:mod:`hybridtrain.data.sources`), splits off validation
records, tokenizes with HF ``datasets.map(batched=True, num_proc=data.num_proc)`` into samples
(:mod:`hybridtrain.data.formats`) and saves each split with ``Dataset.save_to_disk``: Arrow files
that workers memory-map (:func:`hybridtrain.data.sampler.open_samples`). The output folder is named by a fingerprint of
everything the samples depend on, so a second run with the same inputs skips all of it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


from hybridtrain.config.choices import Packing
from hybridtrain.config.schema import DataConfig
from hybridtrain.data import formats, invalid, preference, sources
from hybridtrain.data.tokenizer import load_tokenizer, tokenizer_source
from hybridtrain.errors import PlanError

VERSION = 4
"""Bump when the written samples change for the same inputs (invalidates every cache entry)."""


def cache_root(cfg: DataConfig) -> Path:
    """``data.cache_dir``, else ``$HYBRIDTRAIN_CACHE``, else ``~/.cache/hybridtrain`` (:class:`hybridtrain.cache.CacheDir`)."""
    from hybridtrain.cache import CacheDir

    return CacheDir.from_env().data(cfg.cache_dir)


@dataclass
class Prepared:
    """Where a run's tokenized data is and what it holds (saved as the run's ``data.json``)."""

    dir: str
    """Cache folder holding one saved dataset (Arrow files) per split."""
    kind: str
    """``packed`` (a token stream per split), ``rows`` (padded ``input_ids`` / ``labels`` per split) or
    ``documents`` (unpadded ``input_ids`` / ``labels`` per record, packed into rows when read)."""
    seq_len: int
    splits: dict = field(default_factory=dict)
    """``{"train": {file names..., "num_samples": n}, "val": {...}}`` (``val`` only with validation), with
    what truncation did (``records``, ``dropped_records``, ``truncated_records``, ``cut_tokens``,
    ``split_records``) and for ``documents`` the rows of this run's seed (``num_samples``, ``fill``)."""
    skipped: dict = field(default_factory=dict)
    """With ``data.skip_invalid``: per source (``train``: ``data.path``, ``val``: ``data.val_path``) the
    records left out as invalid (``records``, ``of``, ``why``, ``where``: the first files and record
    numbers), see :mod:`hybridtrain.data.invalid`; ``{}`` when none was."""
    pad_id: int = 0
    """Token id that pads rows (``documents`` pads when the rows are read)."""
    fingerprint: str = ""
    inputs: dict = field(default_factory=dict)
    """What the records were read from, by content (:func:`inputs_of`): per split ``{file path: sha256}``
    for files and disk datasets, ``{"embedded": sha256}`` or ``{"hf": ...}`` otherwise; checkpoints record
    it (``meta.json`` ``data``) so a resume can say the data changed (:func:`data_changes`)."""
    cached: bool = False
    """Whether this run found the data already prepared (not saved)."""

    def num_samples(self, split: str) -> int:
        """Samples in ``split`` (0 if there is no such split)."""
        return self.splits.get(split, {}).get("num_samples", 0)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in self.__dict__.items() if k != "cached"}, indent=1)


def _hash_tokenizer(cfg: DataConfig, tokenizer) -> str:
    path = tokenizer_source(cfg)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + f.read_bytes())
    h.update(str(tokenizer.chat_template).encode())
    return h.hexdigest()


def chat_template(cfg: DataConfig) -> str | None:
    """``data.chat_template`` as a template string (read from the file it names, if it is a path)."""
    if cfg.chat_template is None:
        return None
    path = Path(cfg.chat_template).expanduser()
    return path.read_text() if "{" not in cfg.chat_template and path.is_file() else cfg.chat_template


def packing_of(cfg: DataConfig) -> Packing:
    """``data.packing`` resolved for ``data.format`` (:meth:`Packing.of`); a :class:`PlanError` if it is
    not a mode of that format."""
    try:
        return Packing.of(cfg.packing, cfg.format)
    except ValueError as err:
        raise PlanError("data.packing", str(err)) from None


def kind_of(cfg: DataConfig) -> str:
    """How the samples are stored: ``packed`` (``stream``), ``documents`` or ``rows`` (``none``); ``pairs``
    for ``data.format=preference`` (one pair per row, :mod:`hybridtrain.data.preference`)."""
    if cfg.format == "preference":
        return "pairs"
    return {Packing.stream: "packed", Packing.documents: "documents", Packing.none: "rows"}[packing_of(cfg)]


def options(cfg: DataConfig, seed: int, pairs: str = "dpo") -> dict:
    """The format options the samples depend on (part of the fingerprint); ``pairs``: how preference pairs are
    tokenized (:data:`hybridtrain.data.preference.PAIRS`, named only where it is not ``dpo``).

    ``seq_len`` only matters for ``rows`` (packed blocks are cut when read), and the seed only
    when it splits off validation records.
    """
    opts = {"version": VERSION, "format": cfg.format, "kind": kind_of(cfg), "val_fraction": cfg.val_fraction}
    opts.update({"text": {"field": cfg.text_field}, "chat": {"field": cfg.messages_field},
                 "prompt_completion": {"fields": [cfg.prompt_field, cfg.completion_field]},
                 "preference": {"fields": list(preference.fields(cfg))}}[cfg.format])
    if cfg.format == "preference" and pairs != "dpo":  # DPO's caches keep their names
        opts["pairs"] = pairs
    if kind_of(cfg) != "packed":  # records are truncated (or split) to seq_len when written
        opts["seq_len"] = cfg.seq_len
    if cfg.val_fraction > 0:
        opts["seed"] = seed
    if cfg.skip_invalid:  # other records are kept; without it an invalid record is an error, not a cache entry
        opts["skip_invalid"] = True
    return opts


def fingerprint(identity: dict, tokenizer_hash: str, opts: dict) -> str:
    """16 hex digits naming the cache folder of these inputs."""
    blob = json.dumps({"data": identity, "tokenizer": tokenizer_hash, "options": opts}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """The sha256 of a file's bytes, read in 1 MiB pieces (docs/data.md#caching has its cost)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def identify(cfg: DataConfig) -> dict:
    """What the records depend on, computed without loading them: for files each file's path, size,
    mtime and sha256 (the content: a same-size edit with its mtime put back is still noticed), else hashes."""
    sources.offline()
    if cfg.source == "embedded":
        return {"train": sources.embedded_identity()}
    if cfg.source == "hf":
        ident = {"train": sources.load_hub(cfg, cfg.split, "data.split")[1]}
        if cfg.val_split:
            ident["val"] = sources.load_hub(cfg, cfg.val_split, "data.val_split")[1]
        return ident
    ident = {}
    for split, pattern, key in (("train", cfg.path, "data.path"), ("val", cfg.val_path, "data.val_path")):
        if pattern:
            files = sources.expand(pattern, key)
            listed = [p for f in files for p in (sorted(f.rglob("*")) if f.is_dir() else [f]) if p.is_file()]
            ident[split] = {"files": [[*stat, sha256_file(f)] for stat, f in zip(sources._stat(listed), listed)],
                            "split": cfg.split, "val_split": cfg.val_split, "sample_by": cfg.sample_by}
    return ident


def inputs_of(identity: dict) -> dict:
    """Per split, what the records were read from by content: ``{file path: sha256}`` for files (from
    :func:`identify`), else the source's own identity digest under its kind (``embedded``, ``hf``)."""
    out = {}
    for split, ident in identity.items():
        if "files" in ident:
            out[split] = {entry[0]: entry[-1] for entry in ident["files"]}
        else:
            blob = json.dumps(ident, sort_keys=True, default=str).encode()
            out[split] = {"embedded" if "embedded" in ident else "hf": hashlib.sha256(blob).hexdigest()}
    return out


def data_changes(saved: dict, now: dict) -> list[str]:
    """What differs between two :func:`inputs_of` records, e.g. ``['train: corpus.jsonl changed',
    'val: b.jsonl added']`` (file names only); ``[]`` when they are the same."""
    changes = []
    for split in sorted(set(saved) | set(now)):
        old, new = saved.get(split, {}), now.get(split, {})
        if split not in now or split not in saved:
            changes.append(f"{split} split {'removed' if split not in now else 'added'}")
            continue
        for path in sorted(set(old) | set(new)):
            if old.get(path) != new.get(path):
                how = "removed" if path not in new else "added" if path not in old else "changed"
                changes.append(f"{split}: {Path(path).name} {how}")
    return changes


def _refuse_margins(cfg: DataConfig, *splits) -> None:
    """A reward model's records must not hold TRL's ``margin`` field: ``RewardTrainer`` subtracts it from each
    pair's reward difference, which ``finetune.objective=reward`` does not (yet), so it would train another model."""
    if any("margin" in ds.column_names for ds in splits):
        raise PlanError("data.name" if str(cfg.source) == "hf" else "data.path",
                        "the records have a 'margin' field, which TRL's RewardTrainer subtracts from each pair's reward "
                        "difference; finetune.objective=reward does not read it yet (it would train another model "
                        "than TRL's); remove the field")


def _check_field(ds, name: str, key: str) -> None:
    if name not in ds.column_names:
        raise PlanError(key, f"the records have no field {name!r}; their fields are {ds.column_names}; "
                             f"set {key}=<one of them>")


def _pad_id(tokenizer) -> int:
    """The padding token: the tokenizer's, else EOS, else 0 (padding never carries loss)."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0


def _map_fn(cfg: DataConfig, tokenizer, pairs: str = "dpo") -> tuple[Callable, dict]:
    eos = tokenizer.eos_token_id
    if eos is None and cfg.format != "chat":
        raise PlanError("data.tokenizer", "the tokenizer has no EOS token to end documents; use a tokenizer "
                                          "with an eos_token (or an <|endoftext|> token)")
    mode = packing_of(cfg)
    pad = _pad_id(tokenizer) if mode is Packing.none else None  # documents: padded when packed
    if cfg.format == "text":
        if mode is Packing.stream:
            return formats.text_stream, {"field": cfg.text_field, "eos_id": eos}
        return formats.text_rows, {"field": cfg.text_field, "eos_id": eos, "seq_len": cfg.seq_len, "pad_id": pad,
                                   "split": mode is Packing.documents}
    if cfg.format == "preference":
        if pairs == "scored":  # finetune.objective=reward: whole sequences, scored at their last token
            return preference.scored_rows, {"fields": preference.fields(cfg), "seq_len": cfg.seq_len,
                                            "pad_id": _pad_id(tokenizer)}
        return preference.pair_rows, {"fields": preference.fields(cfg), "seq_len": cfg.seq_len,
                                      "pad_id": _pad_id(tokenizer), "pairs": pairs}
    if cfg.format == "prompt_completion":
        return formats.prompt_completion_rows, {"prompt_field": cfg.prompt_field, "completion_field":
                                                cfg.completion_field, "eos_id": eos, "seq_len": cfg.seq_len, "pad_id": pad}
    template = tokenizer.chat_template or ""
    if not formats.GENERATION_TAG.search(template if isinstance(template, str) else json.dumps(template)):
        raise PlanError("data.chat_template", "the tokenizer's chat template has no {% generation %} ... "
                                              "{% endgeneration %} markers, so the assistant tokens cannot be found; "
                                              "give data.chat_template=FILE with a template that wraps assistant "
                                              "content in them (see docs/data.md)")
    return formats.chat_rows, {"field": cfg.messages_field, "seq_len": cfg.seq_len, "pad_id": pad}


def features(kind: str, seq_len: int, dtype: str):
    """The Arrow schema samples are written with: token ids as ``dtype`` (``uint16`` for vocabularies
    under 65536), labels as ``int32`` (``-100`` marks tokens without loss); rows of fixed length
    (``rows``) or one record each (``documents``), with their loss-token count and, until
    :func:`_write` reports and drops them, the source record and the tokens truncation cut."""
    from datasets import Features, List, Value

    if kind == "packed":
        return Features({"ids": List(Value(dtype))})
    if kind == "pairs":
        return preference.features(seq_len, dtype)
    length = seq_len if kind == "rows" else -1
    return Features({"input_ids": List(Value(dtype), length=length), "labels": List(Value("int32"), length=length),
                     "num_labels": Value("int32"), "record": Value("int64"), "cut": Value("int32")})


def _truncation(ds, records: int) -> dict:
    """What cutting the ``records`` source records to ``seq_len`` did: records dropped (no loss token
    left), truncated (and the tokens cut), split into several samples."""
    import numpy as np

    record = np.asarray(ds.data.table.column("record").to_numpy(), dtype=np.int64)
    cut = np.asarray(ds.data.table.column("cut").to_numpy(), dtype=np.int64)
    kept, pieces = np.unique(record, return_counts=True)
    return {"records": records, "dropped_records": records - len(kept), "truncated_records": int((cut > 0).sum()),
            "cut_tokens": int(cut.sum()), "split_records": int((pieces > 1).sum())}


def _write(ds, kind: str, seq_len: int, out: Path, split: str, records: int) -> dict:
    """Save the mapped split ``ds`` (of ``records`` source records) as a dataset folder under ``out``;
    return its ``splits`` entry."""
    import pyarrow.compute as pc

    entry: dict = {"dataset": split}
    if kind != "packed":
        entry.update(_truncation(ds, records))
        ds = ds.remove_columns(["record", "cut"])
    ds.save_to_disk(str(out / split))
    if kind == "packed":
        total = sum(int(pc.sum(pc.list_value_length(chunk)).as_py() or 0) for chunk in ds.data.table.column("ids").chunks)
        return {**entry, "num_tokens": total, "num_samples": max(0, (total - 1) // seq_len), "num_documents": len(ds)}
    if kind == "pairs":  # a row per pair; fill: the share of row tokens that are the pairs' own
        lengths = ds.data.table.column("pair_len")
        tokens = float(pc.sum(lengths).as_py() or 0)
        entry["num_samples"], entry["fill"] = len(ds), round(tokens / max(1, len(ds) * seq_len), 4)
    elif kind == "documents":
        entry["num_records"] = len(ds)  # samples to pack; num_samples (rows) depends on the seed
    else:
        entry["num_samples"] = len(ds)
    return entry


def _pack_rows(prepared: Prepared, seed: int) -> None:
    """``documents``: each split's rows under ``seed`` (``num_samples``) and how full they are (``fill``)."""
    from hybridtrain.data.sampler import DocumentSamples

    for split, entry in prepared.splits.items():
        samples = DocumentSamples.from_folder(Path(prepared.dir) / entry["dataset"], prepared.seq_len, seed)
        entry["num_samples"], entry["fill"] = samples.num_samples, round(samples.fill, 4)


def _describe(prepared: Prepared, mode: Packing) -> str:
    """One line on what truncation and packing did, e.g. ``packing documents: train 600 records in 74 rows ...``."""
    parts = []
    for split, e in prepared.splits.items():
        if "records" not in e:
            continue
        text = f"{split} {e['records']} records"
        if mode is Packing.documents:
            text += f" in {e['num_samples']} rows of {prepared.seq_len} tokens ({100 * e['fill']:.0f}% filled)"
        notes = [f"{e['truncated_records']} truncated ({e['cut_tokens']} tokens cut)" if e["truncated_records"] else "",
                 f"{e['split_records']} split into pieces of {prepared.seq_len}" if e["split_records"] else "",
                 f"{e['dropped_records']} with no loss token dropped" if e["dropped_records"] else ""]
        notes = [n for n in notes if n]
        parts.append(text + (" (" + ", ".join(notes) + ")" if notes else ""))
    return f"[hybridtrain] data      packing {mode}: " + "; ".join(parts) if parts else ""


def _tokenized(prepared: Prepared, records: int, seconds: float, num_proc: int, final: Path) -> str:
    """The ``tokenized N records`` line: the records tokenized (the invalid ones skipped are not among
    them, and are counted), the empty ``text`` documents a stream skips, the samples per split."""
    unit = "rows" if prepared.kind == "documents" else "samples"
    counts = ", ".join(f"{s} {v['num_samples']} {unit}" for s, v in prepared.splits.items())
    notes = [f"{sum(s['records'] for s in prepared.skipped.values())} invalid skipped" if prepared.skipped else ""]
    if prepared.kind == "packed":
        empty = records - sum(v["num_documents"] for v in prepared.splits.values())
        notes.append(f"{empty} empty document{'s' if empty != 1 else ''} skipped" if empty else "")
    notes = [n for n in notes if n]
    return (f"[hybridtrain] data      tokenized {records} records" + (f" ({', '.join(notes)})" if notes else "") +
            f" in {seconds:.1f}s (num_proc={num_proc}): {counts}; cached in {final}")


def prepare(cfg: DataConfig, seed: int, log: Callable[[str], None] = print, pairs: str = "dpo") -> Prepared:
    """Tokenize ``data`` into samples once (or find them cached); return where they are. ``pairs``: how
    ``format=preference`` pairs are tokenized, as ``finetune.objective``'s TRL trainer does
    (:func:`hybridtrain.data.preference.tokenization_of`).

    Raises :class:`~hybridtrain.plan.PlanError` for every problem with the input, before any worker runs.
    """
    tokenizer = load_tokenizer(cfg)
    template = chat_template(cfg)
    if template is not None:
        tokenizer.chat_template = template
    kind = kind_of(cfg)
    opts = options(cfg, seed, pairs)
    identity = identify(cfg)
    fp = fingerprint(identity, _hash_tokenizer(cfg, tokenizer), opts)
    root = cache_root(cfg)
    final = root / f"data-{fp}"
    if (final / "data.json").is_file():
        found = Prepared(**json.loads((final / "data.json").read_text()), cached=True)
        found.inputs = inputs_of(identity)  # an entry written before data.json held them
        if kind == "packed":  # packed blocks are cut when read: the same stream serves every seq_len
            found.seq_len = cfg.seq_len
            for entry in found.splits.values():
                entry["num_samples"] = max(0, (entry["num_tokens"] - 1) // cfg.seq_len)
        if kind == "documents":  # the rows depend on this run's seed
            _pack_rows(found, seed)
        log(f"[hybridtrain] data      cached tokens found in {final}: tokenization skipped (same source, "
            f"tokenizer and options)")
        if found.skipped:
            log(invalid.describe(found.skipped))
        if kind != "packed":
            log(_describe(found, packing_of(cfg)))
        return found

    t0 = time.perf_counter()
    work = root / f"tmp-{fp}-{os.getpid()}"
    out = work / "out"
    out.mkdir(parents=True, exist_ok=True)
    try:
        raw = sources.load_raw(cfg, work / "hf")
        for name, key in invalid.fields_of(cfg):
            _check_field(raw.train, name, key)
            if raw.val is not None:
                _check_field(raw.val, name, key)
        if pairs == "scored":  # finetune.objective=reward
            _refuse_margins(cfg, *(ds for ds in (raw.train, raw.val) if ds is not None))
        skipped = {}
        train, skipped["train"] = invalid.screen(raw.train, raw.origins["train"], cfg, "train")
        val = raw.val
        if val is not None:
            val, skipped["val"] = invalid.screen(val, raw.origins["val"], cfg, "val")
        if cfg.format == "preference":  # pairs that do not fit data.seq_len, completions of no token
            train, more = preference.screen(train, raw.origins["train"], cfg, tokenizer, "train", pairs)
            skipped["train"] = preference.merge_skipped(skipped["train"], more)
            if val is not None:
                val, more = preference.screen(val, raw.origins["val"], cfg, tokenizer, "val", pairs)
                skipped["val"] = preference.merge_skipped(skipped["val"], more)
        skipped = {source: s for source, s in skipped.items() if s}
        if cfg.val_fraction > 0:
            try:
                parts = train.train_test_split(test_size=cfg.val_fraction, seed=seed, shuffle=True,
                                               train_indices_cache_file_name=str(work / "split-train.arrow"),
                                               test_indices_cache_file_name=str(work / "split-val.arrow"))
            except ValueError as err:
                raise PlanError("data.val_fraction", f"{cfg.val_fraction} of {len(train)} records leaves an empty "
                                                     f"split ({err}); use a fraction that keeps records on both sides") from None
            train, val = parts["train"], parts["test"]
        fn, kwargs = _map_fn(cfg, tokenizer, pairs)
        dtype = "uint16" if len(tokenizer) < 2**16 else "uint32"
        splits = {}
        for split, ds in (("train", train), ("val", val)):
            if ds is None:
                continue
            mapped = ds.map(fn, batched=True, with_indices=True, remove_columns=ds.column_names,
                            fn_kwargs={"tokenizer": tokenizer, **kwargs}, num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
                            features=features(kind, cfg.seq_len, dtype),
                            cache_file_name=str(work / f"map-{split}.arrow"), desc=f"tokenizing {split}")
            if kind != "packed" and len(mapped) == 0:
                raise PlanError("data.seq_len", f"no {split} record leaves a token to learn from within data.seq_len="
                                                f"{cfg.seq_len} (empty documents, prompts that fill seq_len, or assistant "
                                                "turns past it); raise data.seq_len or check the records")
            splits[split] = _write(mapped, kind, cfg.seq_len, out, split, len(ds))
            if kind == "packed" and splits[split]["num_tokens"] == 0:
                raise PlanError("data.text_field", f"every {split} document is empty; check data.text_field")
        prepared = Prepared(dir=str(out), kind=kind, seq_len=cfg.seq_len, splits=splits, fingerprint=fp,
                            pad_id=_pad_id(tokenizer), skipped=skipped, inputs=inputs_of(identity))
        if kind == "documents":
            _pack_rows(prepared, seed)
        prepared.dir = str(final)
        (out / "data.json").write_text(prepared.to_json())
        try:
            os.replace(out, final)  # atomic: a concurrent or interrupted run never sees a partial folder
        except OSError:  # another run finished the same folder first; theirs is identical
            pass
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(_tokenized(prepared, len(train) + (len(val) if val is not None else 0), time.perf_counter() - t0,
                   cfg.num_proc, final))
    if skipped:
        log(invalid.describe(skipped))
    if kind != "packed":
        log(_describe(prepared, packing_of(cfg)))
    return prepared


def train_samples(cfg: DataConfig, seed: int, split: str = "train"):
    """Prepare (or find cached) and open one split in this process: for the reference loop and tests."""
    from hybridtrain.data.sampler import open_samples

    return open_samples(json.loads(prepare(cfg, seed, log=lambda _: None).to_json()), split, seed)
