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
