"""Sources (``hybridtrain.data.sources``) and the cache (``hybridtrain.data.prepare``), in process, no network."""
from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers.data import chapters, text_corpus, write_jsonl
from hybridtrain.config import DataConfig
from hybridtrain.data import prepare as prep
from hybridtrain.data.sampler import ArrowColumn, open_samples
from hybridtrain.plan import PlanError


def _cfg(tmp_path: Path, **kw) -> DataConfig:
    kw.setdefault("source", "files")
    return DataConfig(cache_dir=str(tmp_path / "cache"), seq_len=16, **kw)


def _stream(prepared, split: str = "train") -> np.ndarray:
    return np.asarray(ArrowColumn(Path(prepared.dir) / prepared.splits[split]["dataset"], "ids"))


def test_every_file_kind_gives_the_same_token_stream(tmp_path):
    import pandas as pd

    docs = chapters(5)
    write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in docs])
    (tmp_path / "b.json").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    pd.DataFrame({"text": docs}).to_csv(tmp_path / "c.csv", index=False)
    pd.DataFrame({"text": docs}).to_parquet(tmp_path / "d.parquet")
    streams = [_stream(prep.prepare(_cfg(tmp_path, path=str(tmp_path / name)), 0, log=lambda _: None))
               for name in ("a.jsonl", "b.json", "c.csv", "d.parquet")]
    for s in streams[1:]:
        assert np.array_equal(s, streams[0])
    # txt: one document per file by default
    for i, d in enumerate(docs):
        (tmp_path / "txt").mkdir(exist_ok=True)
        (tmp_path / "txt" / f"{i}.txt").write_text(d)
    from_txt = prep.prepare(_cfg(tmp_path, path=str(tmp_path / "txt" / "*.txt")), 0, log=lambda _: None)
    assert from_txt.splits["train"]["num_documents"] == 5
    assert np.array_equal(_stream(from_txt), streams[0])


@pytest.mark.parametrize("sample_by, records", [("document", 1), ("paragraph", 2), ("line", 4)])
def test_txt_sample_by(tmp_path, sample_by, records):
    (tmp_path / "t.txt").write_text("a b\nc d\n\ne f\ng h\n")
    p = prep.prepare(_cfg(tmp_path, path=str(tmp_path / "t.txt"), sample_by=sample_by), 0, log=lambda _: None)
    assert p.splits["train"]["num_documents"] == records


def test_several_globs_separated_by_commas(tmp_path):
    text_corpus(tmp_path / "x" / "1.jsonl", n=3, field="text")
    text_corpus(tmp_path / "y" / "2.jsonl", n=4, field="text", start=3)
    p = prep.prepare(_cfg(tmp_path, path=f"{tmp_path}/x/*.jsonl, {tmp_path}/y/*.jsonl"), 0, log=lambda _: None)
    assert p.splits["train"]["num_documents"] == 7


def test_save_to_disk_folder_with_splits(tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_dict({"text": chapters(6)}),
                 "test": Dataset.from_dict({"text": chapters(3, 6)})}).save_to_disk(str(tmp_path / "saved"))
    cfg = _cfg(tmp_path, source="disk", path=str(tmp_path / "saved"), val_split="test")
    p = prep.prepare(cfg, 0, log=lambda _: None)
    assert (p.splits["train"]["num_documents"], p.splits["val"]["num_documents"]) == (6, 3)
    # data=files given a save_to_disk folder loads it the same way
    files = prep.prepare(_cfg(tmp_path, path=str(tmp_path / "saved")), 0, log=lambda _: None)
    assert np.array_equal(_stream(files), _stream(p))
    with pytest.raises(PlanError) as info:
        prep.prepare(_cfg(tmp_path, source="disk", path=str(tmp_path / "saved"), split="nope"), 0)
    assert info.value.key == "data.split" and "['test', 'train']" in str(info.value)


def _fake_hub_cache(root: Path, name: str, docs: list[str]) -> None:
    """What ``load_dataset(name)`` leaves in ``HF_DATASETS_CACHE`` after a download, made offline."""
    import datasets

    src = root / "src.jsonl"
    write_jsonl(src, [{"text": d} for d in docs])
    datasets.load_dataset("json", data_files=str(src), split="train", cache_dir=str(root / "build"))
    built = Path(glob.glob(str(root / "build" / "json" / "*" / "*" / "*"))[0])
    org, ds_name = name.split("/")
    dst = root / "hub" / f"{org}___{ds_name}" / "default" / "0.0.0" / built.name
    shutil.copytree(built, dst)
    os.rename(dst / "json-train.arrow", dst / f"{ds_name}-train.arrow")


def test_hub_dataset_from_the_local_cache(tmp_path, monkeypatch):
    import datasets

    _fake_hub_cache(tmp_path, "my_org/my_set", chapters(4))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hub")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    p = prep.prepare(_cfg(tmp_path, source="hf", name="my_org/my_set"), 0, log=lambda _: None)
    assert p.splits["train"]["num_documents"] == 4
    assert os.environ["HF_DATASETS_OFFLINE"] == "1" and os.environ["HF_HUB_OFFLINE"] == "1"  # never a download


def test_hub_dataset_not_cached_fails_at_once_saying_how_to_fetch_it(tmp_path, monkeypatch):
    import time

    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty_hub")
    t0 = time.perf_counter()
    with pytest.raises(PlanError) as info:
        prep.prepare(_cfg(tmp_path, source="hf", name="nobody/nothing"), 0)
    assert time.perf_counter() - t0 < 30  # no network wait
    msg = str(info.value)
    assert info.value.key == "data.name" and "not in the local HF datasets cache" in msg
    assert "datasets.load_dataset('nobody/nothing', split='train')" in msg


# --- the cache ---------------------------------------------------------------------------------------

def test_second_run_skips_tokenization_and_says_so(tmp_path, monkeypatch):
    corpus = text_corpus(tmp_path / "c.jsonl", n=20)
    cfg = _cfg(tmp_path, path=str(corpus), text_field="content")
    logs: list[str] = []
    first = prep.prepare(cfg, 0, log=logs.append)
    assert "tokenized 20 records" in logs[-1] and not first.cached

    def no_loading(*_a, **_k):
        raise AssertionError("the records were loaded again")

    monkeypatch.setattr(prep.sources, "load_raw", no_loading)
    second = prep.prepare(cfg, 0, log=logs.append)
    assert second.cached and second.dir == first.dir and "tokenization skipped" in logs[-1]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [Path(first.dir).name]  # no temporary folders

    # packed blocks are cut when read: another seq_len reuses the same stream
    other = prep.prepare(DataConfig(**{**cfg.__dict__, "seq_len": 8}), 0, log=logs.append)
    assert other.cached and other.dir == first.dir
    assert other.num_samples("train") == (first.splits["train"]["num_tokens"] - 1) // 8


@pytest.mark.parametrize("change", ["file", "field", "tokenizer", "packing", "seed_with_val"])
def test_a_changed_input_is_tokenized_again(tmp_path, change):
    corpus = text_corpus(tmp_path / "c.jsonl", n=20)
    base = dict(path=str(corpus), text_field="content", val_fraction=0.2 if change == "seed_with_val" else 0.0)
    first = prep.prepare(_cfg(tmp_path, **base), 0, log=lambda _: None)
    seed = 0
    if change == "file":
        text_corpus(corpus, n=21)
    elif change == "field":
        write_jsonl(corpus, [{"body": d, "content": d} for d in chapters(20)])  # same content, re-written
        base["text_field"] = "body"
    elif change == "tokenizer":
        tok = tmp_path / "tok.json"
        spec = json.loads(Path(prep.tokenizer_source(DataConfig())).read_text())
        spec["added_tokens"][0]["content"] = "<|end|>"  # a different tokenizer file
        tok.write_text(json.dumps(spec))
        base["tokenizer"] = str(tok)
    elif change == "packing":
        base["packing"] = False
    else:
        seed = 1
    second = prep.prepare(_cfg(tmp_path, **base), seed, log=lambda _: None)
    assert not second.cached and second.dir != first.dir


def test_num_proc_gives_the_same_files(tmp_path):
    corpus = text_corpus(tmp_path / "c.jsonl", n=40)
    one = prep.prepare(_cfg(tmp_path, path=str(corpus), text_field="content", packing=False), 0, log=lambda _: None)
    shutil.rmtree(one.dir)
    two = prep.prepare(_cfg(tmp_path, path=str(corpus), text_field="content", packing=False, num_proc=2), 0,
                       log=lambda _: None)
    assert two.dir == one.dir and not two.cached  # num_proc is not part of the key: same output
    a = open_samples(json.loads(two.to_json()), "train", 0)
    assert a.num_samples == 40
    with pytest.raises(PlanError) as info:  # errors raised in worker processes arrive intact
        write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "x"}]}] * 8)
        prep.prepare(_cfg(tmp_path, path=str(tmp_path / "bad.jsonl"), format="chat", num_proc=2), 0)
    assert info.value.key == "data.messages_field"


def test_validation_split_is_a_function_of_the_seed(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": f"document {i} " + d} for i, d in enumerate(chapters(50))])
    kw = dict(path=str(corpus), packing=False, val_fraction=0.2)

    def split(seed: int, cache: str):
        p = prep.prepare(DataConfig(source="files", cache_dir=str(tmp_path / cache), seq_len=8, **kw), seed,
                         log=lambda _: None)
        meta = json.loads(p.to_json())
        first = {s: {tuple(r) for r in np.asarray(open_samples(meta, s, 0).input_ids).tolist()} for s in ("train", "val")}
        return first, p

    a, pa = split(3, "c1")
    b, _ = split(3, "c2")  # recomputed from scratch elsewhere
    c, _ = split(4, "c3")
    assert a == b and a != c
    assert len(a["val"]) == 10 and len(a["train"]) == 40 and not a["val"] & a["train"]  # documents, not tokens, split


# --- invalid records (missing, null, not text) ----------------------------------------------------------

def _with_holes(n: int, holes: tuple[int, ...], make, hole) -> list[dict]:
    return [hole(i) if i in holes else make(c) for i, c in enumerate(chapters(n))]


def test_records_without_their_field_are_an_error_naming_the_files_and_records(tmp_path):
    """9 of 60 records without the text field: an error naming each file and the records' numbers in
    it (the first few, then how many more), not 51 documents trained as if they were 60."""
    recs = _with_holes(60, (3, 7, 12, 20, 33, 40, 41, 50, 59), lambda c: {"text": c}, lambda i: {"body": "x"})
    write_jsonl(tmp_path / "a.jsonl", recs[:30])
    write_jsonl(tmp_path / "b.jsonl", recs[30:])
    with pytest.raises(PlanError) as info:
        prep.prepare(_cfg(tmp_path, path=f"{tmp_path}/*.jsonl"), 0, log=lambda _: None)
    msg = str(info.value)
    assert info.value.key == "data.text_field"
    assert "9 of 60 train records" in msg and "9: field 'text' missing or null" in msg
    assert f"{tmp_path}/a.jsonl records 3, 7, 12, 20, {tmp_path}/b.jsonl record 3 and 4 more (counting from 0)" in msg
    assert "data.skip_invalid=true" in msg
    assert not list((tmp_path / "cache").glob("data-*"))  # nothing cached


@pytest.mark.parametrize("kind", ["prompt_completion_missing", "prompt_null", "completion_int", "text_parquet_null",
                                  "text_csv_empty", "chat_null", "chat_no_assistant", "disk_null", "val_path_missing"])
def test_every_format_and_file_kind_refuses_an_invalid_record(tmp_path, kind):
    import pandas as pd
    from datasets import Dataset

    docs = chapters(12)
    pc = [{"prompt": d[:80], "completion": d[80:160]} for d in docs]
    extra: dict = {}
    if kind.startswith(("prompt", "completion")):
        field, key, fmt = {"prompt_completion_missing": ("completion", "data.completion_field", "missing or null"),
                           "prompt_null": ("prompt", "data.prompt_field", "missing or null"),
                           "completion_int": ("completion", "data.completion_field", "a int, not text")}[kind]
        if kind == "prompt_completion_missing":
            del pc[5]["completion"]
        else:
            pc[5][field] = None if kind == "prompt_null" else 17
        write_jsonl(tmp_path / "d.jsonl", pc)
        extra = dict(path=str(tmp_path / "d.jsonl"), format="prompt_completion")
    elif kind == "text_parquet_null":
        pd.DataFrame({"text": [None if i == 5 else d for i, d in enumerate(docs)]}).to_parquet(tmp_path / "d.parquet")
        field, key, fmt, extra = "text", "data.text_field", "missing or null", dict(path=str(tmp_path / "d.parquet"))
    elif kind == "text_csv_empty":
        pd.DataFrame({"text": [None if i == 5 else d for i, d in enumerate(docs)]}).to_csv(tmp_path / "d.csv", index=False)
        field, key, fmt, extra = "text", "data.text_field", "missing or null", dict(path=str(tmp_path / "d.csv"))
    elif kind.startswith("chat"):
        from helpers.data import chat_records

        chats = chat_records(12)
        chats[5] = ({"messages": None} if kind == "chat_null" else
                    {"messages": [{"role": "user", "content": "Hello?"}]})
        write_jsonl(tmp_path / "d.jsonl", chats)
        field, key = "messages", "data.messages_field"
        fmt = "missing or null" if kind == "chat_null" else "has no assistant message (roles ['user'])"
        extra = dict(path=str(tmp_path / "d.jsonl"), format="chat")
    elif kind == "disk_null":
        Dataset.from_dict({"text": [None if i == 5 else d for i, d in enumerate(docs)]}).save_to_disk(str(tmp_path / "d"))
        field, key, fmt, extra = "text", "data.text_field", "missing or null", dict(source="disk", path=str(tmp_path / "d"))
    else:
        write_jsonl(tmp_path / "t.jsonl", [{"text": d} for d in docs])
        write_jsonl(tmp_path / "d.jsonl", [{"body": d} if i == 5 else {"text": d} for i, d in enumerate(docs)])
        field, key, fmt = "text", "data.text_field", "missing or null"
        extra = dict(path=str(tmp_path / "t.jsonl"), val_path=str(tmp_path / "d.jsonl"))
    with pytest.raises(PlanError) as info:
        prep.prepare(_cfg(tmp_path, **extra), 0, log=lambda _: None)
    msg = str(info.value)
    assert info.value.key == key, msg
    source = "val" if kind == "val_path_missing" else "train"
    assert f"1 of 12 {source} records" in msg and f"1: field {field!r} {fmt}" in msg, msg
    assert f"{tmp_path}/d" in msg and " record 5 (counting from 0)" in msg, msg


@pytest.mark.parametrize("fmt", ["text", "prompt_completion"])
def test_skip_invalid_trains_on_exactly_the_valid_records_and_counts_the_others(tmp_path, fmt):
    """``data.skip_invalid=true``: the samples are those of a file without the invalid records, and
    the skipped ones are counted on the console, in the tokenized line and in data.json (also when
    the cache is hit)."""
    holes = (3, 7, 12, 20, 33, 40, 41, 50, 59)
    make = (lambda c: {"text": c}) if fmt == "text" else (lambda c: {"prompt": c[:60], "completion": c[60:200]})
    hole = (lambda i: {"body": "x"}) if fmt == "text" else (lambda i: {"prompt": "only a prompt"})
    recs = _with_holes(60, holes, make, hole)
    write_jsonl(tmp_path / "bad.jsonl", recs)
    write_jsonl(tmp_path / "clean" / "good.jsonl", [r for i, r in enumerate(recs) if i not in holes])
    logs: list[str] = []
    kw = dict(format=fmt)
    skipped = prep.prepare(_cfg(tmp_path, path=str(tmp_path / "bad.jsonl"), skip_invalid=True, **kw), 0, log=logs.append)
    clean = prep.prepare(DataConfig(source="files", path=str(tmp_path / "clean" / "good.jsonl"),
                                    cache_dir=str(tmp_path / "cache2"), seq_len=16, **kw), 0, log=lambda _: None)
    column = "ids" if fmt == "text" else "input_ids"
    ours, theirs = (np.asarray(ArrowColumn(Path(p.dir) / "train", column)) for p in (skipped, clean))
    assert np.array_equal(ours, theirs)
    field = "text" if fmt == "text" else "completion"
    assert skipped.skipped == {"train": {"records": 9, "of": 60, "why": f"9: field {field!r} missing or null",
                                         "where": f"{tmp_path}/bad.jsonl records 3, 7, 12, 20, 33 and 4 more "
                                                  "(counting from 0)"}}
    assert json.loads(skipped.to_json())["skipped"] == skipped.skipped  # the run's data.json
    tokenized = next(line for line in logs if "tokenized" in line)
    assert "tokenized 51 records (9 invalid skipped)" in tokenized
    assert any("skipped as invalid (data.skip_invalid=true): train 9 of 60 records" in line for line in logs)
    logs.clear()
    again = prep.prepare(_cfg(tmp_path, path=str(tmp_path / "bad.jsonl"), skip_invalid=True, **kw), 0, log=logs.append)
    assert again.cached and again.skipped == skipped.skipped
    assert any("skipped as invalid" in line for line in logs)
    with pytest.raises(PlanError):  # the cache of a skipping run never serves one that does not skip
        prep.prepare(_cfg(tmp_path, path=str(tmp_path / "bad.jsonl"), **kw), 0, log=lambda _: None)


def test_skip_invalid_with_no_valid_record_left_is_an_error(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"body": "x"}] * 4 + [{"text": None}])
    with pytest.raises(PlanError) as info:
        prep.prepare(_cfg(tmp_path, path=str(tmp_path / "d.jsonl"), skip_invalid=True), 0, log=lambda _: None)
    assert info.value.key == "data.skip_invalid" and "every one of the 5 train records is invalid" in str(info.value)


def test_the_tokenized_line_counts_the_empty_documents_a_stream_skips(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"text": "" if i % 4 == 0 else d} for i, d in enumerate(chapters(20))])
    logs: list[str] = []
    p = prep.prepare(_cfg(tmp_path, path=str(tmp_path / "d.jsonl")), 0, log=logs.append)
    assert p.splits["train"]["num_documents"] == 15
    assert "tokenized 20 records (5 empty documents skipped)" in logs[-1]


def test_a_later_json_file_with_values_that_are_not_text_is_refused_not_quoted(tmp_path):
    """Given several files at once, HF's json builder types the columns by the first file and JSON-encodes
    a later file's mixed values, so that file's text would train quoted ('"c"'): refused, naming it."""
    docs = chapters(6)
    write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in docs[:3]])
    write_jsonl(tmp_path / "b.jsonl", [{"text": docs[3]}, {"text": 5}, {"text": docs[4]}])
    for skip in (False, True):
        with pytest.raises(PlanError) as info:
            prep.prepare(_cfg(tmp_path, path=f"{tmp_path}/*.jsonl", skip_invalid=skip), 0, log=lambda _: None)
        msg = str(info.value)
        assert info.value.key == "data.path" and f"1 of the 3 records of {tmp_path}/b.jsonl are not text" in msg, msg
        assert "field 'text' a int, not text" in msg and "b.jsonl record 1 (counting from 0)" in msg, msg
    write_jsonl(tmp_path / "b.jsonl", [{"text": docs[3]}, {"text": None}, {"text": docs[4]}, {"text": None}])
    p = prep.prepare(_cfg(tmp_path, path=f"{tmp_path}/*.jsonl", skip_invalid=True), 0, log=lambda _: None)
    assert p.skipped["train"]["records"] == 2 and "b.jsonl records 1, 3" in p.skipped["train"]["where"]
    one = prep.prepare(DataConfig(source="files", path=str(write_jsonl(tmp_path / "one" / "c.jsonl",
                                                                      [{"text": d} for d in docs[:5]])),
                                  cache_dir=str(tmp_path / "c2"), seq_len=16), 0, log=lambda _: None)
    assert np.array_equal(_stream(p), _stream(one))  # the text arrives as written, unquoted


def test_a_same_size_edit_with_its_mtime_put_back_is_tokenized_again(tmp_path):
    """n56: the cache key holds each file's sha256, not only its path, size and mtime (rsync -a, cp -p)."""
    corpus = tmp_path / "same.jsonl"
    write_jsonl(corpus, [{"text": "the lord of the rings"}] * 20)
    cfg = _cfg(tmp_path, path=str(corpus))
    first = prep.prepare(cfg, 0, log=lambda _: None)
    stat = corpus.stat()
    corpus.write_text(corpus.read_text().replace("lord", "LORD"))
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # touch -r: the same size and mtime
    assert corpus.stat().st_size == stat.st_size and corpus.stat().st_mtime_ns == stat.st_mtime_ns
    second = prep.prepare(cfg, 0, log=lambda _: None)
    assert not second.cached and second.dir != first.dir
    assert not np.array_equal(_stream(second), _stream(first))
    assert second.inputs == {"train": {str(corpus.resolve()): prep.sha256_file(corpus)}}


# --- the cache folders can be written ----------------------------------------------------------------

def test_an_unwritable_data_cache_dir_is_one_config_error_naming_the_key(tmp_path):
    """n67: data.cache_dir=/proc/qa-cache; the probe is the run directory's (launch.outdir.check_writable)."""
    from hybridtrain.launch.cachedir import check_caches

    message = check_caches("/proc/qa-cache", {"HYBRIDTRAIN_CACHE": str(tmp_path / "root")})
    assert message.startswith("data.cache_dir: cannot write the cache folder /proc/qa-cache (")
    assert "set data.cache_dir=<a writable folder>" in message and "\n" not in message
    (tmp_path / "file").write_text("")
    assert "is a file, not a folder" in check_caches(str(tmp_path / "file"), {"HYBRIDTRAIN_CACHE": str(tmp_path)})
    assert check_caches(str(tmp_path / "new"), {"HYBRIDTRAIN_CACHE": str(tmp_path / "root")}) is None
    assert (tmp_path / "new").is_dir() and not list((tmp_path / "new").iterdir())  # the probe file is gone


def test_an_unwritable_home_or_hybridtrain_cache_names_the_variable(tmp_path):
    """n66: HOME=/proc/nohome with the default cache root (the planner's shapes go there even with data.cache_dir)."""
    from hybridtrain.launch.cachedir import check_caches

    message = check_caches(str(tmp_path / "data"), {"HOME": "/proc/nohome"})
    assert message.startswith("HOME: cannot write the cache folder /proc/nohome/.cache/hybridtrain (HOME=/proc/nohome")
    assert "set HYBRIDTRAIN_CACHE=<a writable folder>" in message
    message = check_caches(None, {"HOME": str(tmp_path), "HYBRIDTRAIN_CACHE": "/proc/hc"})
    assert message.startswith("HYBRIDTRAIN_CACHE: cannot write the cache folder /proc/hc (HYBRIDTRAIN_CACHE=/proc/hc;")
    assert check_caches(None, {"HOME": str(tmp_path)}) is None


# --- the data of a checkpoint ------------------------------------------------------------------------

def test_a_resume_notes_data_changed_since_the_checkpoint(tmp_path):
    """n55: meta.json records the data by content (checkpoint.save.data_record); a resume on changed data
    gets one note naming the file (checkpoint.resume.data_note); a checkpoint without the record, none."""
    from hybridtrain.checkpoint.io import CheckpointDir
    from hybridtrain.checkpoint.resume import data_note
    from hybridtrain.checkpoint.save import data_record
    from hybridtrain.rundir import RunDir

    corpus = text_corpus(tmp_path / "chg.jsonl", n=20)
    cfg = _cfg(tmp_path, path=str(corpus), text_field="content")
    run = RunDir(tmp_path / "run")
    run.data_file.parent.mkdir(parents=True)
    run.write_data(prep.prepare(cfg, 0, log=lambda _: None))
    ckpt = CheckpointDir(tmp_path / "run" / "checkpoints" / "step_3")
    ckpt.path.mkdir(parents=True)
    ckpt.meta_file.write_text(json.dumps({"step": 3, "data": data_record(run)}))
    assert data_note(ckpt.path, prep.prepare(cfg, 0, log=lambda _: None)) is None  # the same data: silent

    text_corpus(corpus, n=20, start=5)  # other records
    note = data_note(ckpt.path, prep.prepare(cfg, 0, log=lambda _: None))
    assert note == (f"note: the training data changed since {ckpt.path} (train: chg.jsonl changed); training "
                    "continues from its data position, which now refers to other samples")
    ckpt.meta_file.write_text(json.dumps({"step": 3}))  # saved before meta.json held the data: as before
    assert data_note(ckpt.path, prep.prepare(cfg, 0, log=lambda _: None)) is None


def test_matplotlib_keeps_its_config_under_the_cache_root_when_home_is_unwritable(tmp_path):
    """n66 with HYBRIDTRAIN_CACHE set: the report's matplotlib would warn about HOME over two lines."""
    from hybridtrain.launch.cachedir import matplotlib_dir

    env = {"HOME": "/proc/nohome", "HYBRIDTRAIN_CACHE": str(tmp_path / "root")}
    assert matplotlib_dir(env) == tmp_path / "root" / "matplotlib"
    assert matplotlib_dir({**env, "MPLCONFIGDIR": str(tmp_path)}) is None
    assert matplotlib_dir({**env, "HOME": str(tmp_path)}) is None
