"""Raw records from each ``data.source``, as HF ``datasets.Dataset`` objects, checked before tokenizing.

Everything here runs in the launching process with the HF libraries in offline mode: a hub
dataset must already be in the local cache, and nothing ever waits on the network.
Every problem with the input raises :class:`~hybridtrain.plan.PlanError` naming the key and the fix.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

from hybridtrain.config.schema import DataConfig
from hybridtrain.errors import PlanError

BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
"""File extension -> HF packaged builder of ``load_dataset``."""
TEXT_BUILDERS = ("text", "json", "csv")
"""Builders whose files are text, checked for UTF-8 before loading."""


@dataclass
class Raw:
    """The records of one run, before tokenization."""

    train: object
    """``datasets.Dataset`` of training records."""
    val: object | None
    """``datasets.Dataset`` of validation records given as a separate source, or ``None``."""
    identity: dict
    """What the records depend on (file sizes and mtimes, dataset fingerprints): part of the cache key."""
    origins: dict
    """``{"train": [(file or dataset, records), ...], "val": [...]}``: where each record comes from, in
    order, so that a message can name a record's file and its number there."""


def offline() -> None:
    """Put the HF libraries in offline mode (before and after they are imported): no network attempt.

    A library imported later reads the variables; one already imported gets its flag set. Nothing
    is imported here (``datasets`` takes about a second, which a cached run never needs)."""
    import sys

    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    if "datasets.config" in sys.modules:
        sys.modules["datasets.config"].HF_HUB_OFFLINE = True
        sys.modules["datasets.config"].HF_DATASETS_OFFLINE = True
    if "huggingface_hub.constants" in sys.modules:
        sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = True


def expand(pattern: str, key: str) -> list[Path]:
    """The files a path or glob (several separated by commas) names; an error when it names none."""
    files: list[Path] = []
    for part in (p.strip() for p in pattern.split(",")):
        hits = sorted(glob.glob(os.path.expanduser(part), recursive=True))
        if not hits:
            raise PlanError(key, f"{part!r} matches no file (working directory {os.getcwd()}); "
                                 "give an existing path or a glob such as 'corpus/*.jsonl'")
        files += [Path(h) for h in hits]
    return files


def check_utf8(path: Path, key: str, chunk: int = 1 << 24) -> None:
    """Fail naming the file and the byte offset of the first byte that is not UTF-8."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as err:
                raise PlanError(key, f"{path} is not UTF-8 text: invalid byte 0x{block[err.start]:02x} at byte offset "
                                     f"{offset + err.start}; convert the file to UTF-8 "
                                     "(e.g. iconv -f latin1 -t utf-8) or remove it from the glob") from None
            if not block:
                return
            offset += len(block)


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def _stat(files: list[Path]) -> list:
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def load_files(pattern: str, key: str, cfg: DataConfig, cache: Path):
    """Records of local files (one builder for all), after the UTF-8 check; their identity; and their
    origins (each file and its record count, in the order of the records)."""
    from datasets import concatenate_datasets, load_dataset

    files = expand(pattern, key)
    if len(files) == 1 and is_saved_dataset(files[0]):
        ds, ident = load_disk(str(files[0]), key, cfg.split)
        return ds, ident, [(str(files[0]), len(ds))]
    folder = next((f for f in files if f.is_dir()), None)
    if folder is not None:
        raise PlanError(key, f"{folder} is a folder; give a glob of its files (e.g. '{folder}/*.jsonl'), "
                             "or for a save_to_disk folder data=disk")
    files = [f for f in files if f.stat().st_size > 0]  # HF's builders fail on empty files
    if not files:
        raise PlanError(key, f"{pattern!r} names only empty files: the dataset holds no records; give files with data")
    builders = {BUILDERS.get(f.suffix.lower()) for f in files}
    if None in builders:
        bad = next(f for f in files if f.suffix.lower() not in BUILDERS)
        raise PlanError(key, f"{bad} has an unsupported extension; use {sorted(BUILDERS)} files "
                             "or a save_to_disk folder (data=disk)")
    if len(builders) > 1:
        raise PlanError(key, f"the files mix kinds {sorted(builders)}; give files of one kind per run")
    builder = builders.pop()
    if builder in TEXT_BUILDERS:
        for f in files:
            check_utf8(f, key)
    kwargs = {"sample_by": cfg.sample_by} if builder == "text" else {}
    names = {f"file{i}": [str(f)] for i, f in enumerate(files)}  # one split per file: its record count
    try:
        if builder == "json" and len(files) > 1:  # each file's own column types first (see _check_json_types)
            parts = [load_dataset(builder, data_files=[str(f)], split="train", cache_dir=str(cache)) for f in files]
            if len({json.dumps(p.features.to_dict(), sort_keys=True) for p in parts}) > 1:
                _check_json_types(parts, files, cfg, key)
                parts = None
        else:
            parts = None
        if parts is None:  # HF aligns the files' columns (a column one file lacks is null there)
            loaded = load_dataset(builder, data_files=names, cache_dir=str(cache), **kwargs)
            parts = [loaded[name] for name in names]
    except PlanError:
        raise
    except Exception as err:  # noqa: BLE001 - malformed JSON/CSV surfaces as DatasetGenerationError
        cause = err.__cause__ or err
        raise PlanError(key, f"could not read the {builder} files {[str(f) for f in files][:5]}: "
                             f"{type(cause).__name__}: {str(cause)[:300]}; fix or remove the file") from None
    ds = concatenate_datasets(parts)  # the files' records in order, as one split
    return ds, {"files": _stat(files), "builder": builder, **kwargs}, [(str(f), len(p)) for f, p in zip(files, parts)]


def _check_json_types(parts: list, files: list[Path], cfg: DataConfig, key: str) -> None:
    """Refuse a JSON file whose text field is not text throughout. Given several files at once, HF's
    ``json`` builder takes the column types from the first file and casts the others to them; a file
    whose field mixes strings with numbers or lists is read as JSON values and cast to strings by
    encoding them, so all of that file's text would arrive quoted (``"c"`` as ``'"c"'``). Such records
    cannot be skipped (``data.skip_invalid``): the file's other records are changed too."""
    from hybridtrain.data import invalid

    if str(cfg.format) == "chat":
        return
    for part, f in zip(parts, files):
        for name, _ in invalid.fields_of(cfg):
            feature = part.features.get(name)
            if feature is None or getattr(feature, "dtype", None) in ("string", "large_string"):
                continue
            found = {r: why for r, why in invalid.problems(part, cfg).items() if not why.endswith("missing or null")}
            if found:  # nulls are kept as nulls (and screened later); other values mangle the file
                records = sorted(found)
                raise PlanError(key, f"{len(records)} of the {len(part)} records of {f} are not text "
                                     f"({'; '.join(sorted(set(found.values())))}): "
                                     f"{invalid.where(records, [(f.name, len(part))])}; read with the other files, this "
                                     "file's text would all be turned into JSON strings (quotes included), so these "
                                     "records cannot be skipped: fix them or remove the file")


def load_disk(path: str, key: str, split: str | None):
    """Records of a ``save_to_disk`` folder (a ``DatasetDict``: the split ``split``); and their identity."""
    from datasets import DatasetDict, load_from_disk

    folder = Path(path).expanduser()
    if not is_saved_dataset(folder):
        raise PlanError(key, f"{path!r} is not a folder written by datasets' save_to_disk (no state.json or "
                             "dataset_dict.json); use data=files for plain files")
    ds = load_from_disk(str(folder))
    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise PlanError("data.split" if key == "data.path" else "data.val_split",
                            f"{split!r} is not a split of {path}; it has {sorted(ds)}")
        ds = ds[split]
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return ds, {"disk": _stat(files), "split": split}


def load_hub(cfg: DataConfig, split: str, key: str):
    """Records of a hub dataset from the local HF cache only; an error saying how to fetch it otherwise."""
    import datasets

    try:
        ds = datasets.load_dataset(cfg.name, cfg.subset, split=split)
    except Exception as err:  # noqa: BLE001 - offline misses surface as ConnectionError, FileNotFoundError...
        subset = f", {cfg.subset!r}" if cfg.subset else ""
        if "split" in str(err).lower() and "unknown" in str(err).lower():
            raise PlanError(key, f"{split!r} is not a split of the cached {cfg.name!r}: {err}") from None
        raise PlanError("data.name", f"{cfg.name!r} (split {split!r}) is not in the local HF datasets cache "
                                     f"({datasets.config.HF_DATASETS_CACHE}); hybridtrain never downloads at run time. "
                                     f"Fetch it once, with network and the same HF_HOME: python -c \"import datasets; "
                                     f"datasets.load_dataset({cfg.name!r}{subset}, split={split!r})\", or save it with "
                                     f"save_to_disk and use data=disk ({type(err).__name__}: {err})") from None
    return ds, {"hub": cfg.name, "subset": cfg.subset, "split": split, "fingerprint": ds._fingerprint}


def embedded_identity() -> dict:
    """The identity of the embedded corpus: its hash."""
    import hashlib

    from hybridtrain.data.embedded import CORPUS

    return {"embedded": hashlib.sha256(CORPUS.read_bytes()).hexdigest()}


def load_embedded():
    """The embedded corpus: one record per chapter in a ``text`` field; identity = the corpus hash."""
    from datasets import Dataset

    from hybridtrain.data.embedded import documents

    return Dataset.from_dict({"text": documents()}), embedded_identity()


def load_embedded_pairs():
    """Preference pairs derived from the embedded corpus (:func:`hybridtrain.data.embedded.preference_pairs`)."""
    from datasets import Dataset

    from hybridtrain.data.embedded import preference_pairs

    return Dataset.from_list(preference_pairs()), embedded_identity()


def load_raw(cfg: DataConfig, cache: Path) -> Raw:
    """The training (and given validation) records of ``data``; ``cache`` holds HF's intermediate Arrow files."""
    offline()
    origins: dict = {}
    if cfg.source == "embedded":
        train, ident = load_embedded_pairs() if cfg.format == "preference" else load_embedded()
        val, val_ident = None, None
    elif cfg.source == "files":
        train, ident, origins["train"] = load_files(cfg.path, "data.path", cfg, cache)
        val, val_ident, origins["val"] = (load_files(cfg.val_path, "data.val_path", cfg, cache) if cfg.val_path
                                          else (None, None, []))
    elif cfg.source == "disk":
        train, ident = load_disk(cfg.path, "data.path", cfg.split)
        if cfg.val_path:
            val, val_ident = load_disk(cfg.val_path, "data.val_path", cfg.val_split or cfg.split)
        elif cfg.val_split:
            val, val_ident = load_disk(cfg.path, "data.path", cfg.val_split)
        else:
            val, val_ident = None, None
    else:
        train, ident = load_hub(cfg, cfg.split, "data.split")
        val, val_ident = load_hub(cfg, cfg.val_split, "data.val_split") if cfg.val_split else (None, None)
    where = {"embedded": "data.source", "hf": "data.name"}.get(cfg.source, "data.path")
    if len(train) == 0:
        raise PlanError(where, "the dataset holds no records; check the path/name and data.split")
    if val is not None and len(val) == 0:
        raise PlanError("data.val_split" if cfg.source == "hf" else "data.val_path",
                        "the validation dataset holds no records")
    origins.setdefault("train", [(cfg.path or cfg.name or "the embedded corpus", len(train))])
    if val is not None:
        origins.setdefault("val", [(cfg.val_path or cfg.path or cfg.name, len(val))])
    return Raw(train=train, val=val, identity=json.loads(json.dumps({"train": ident, "val": val_ident})),
               origins=origins)
