"""Your own data through the real command line and the deepspeed runner: a jsonl corpus trains;
a chat dataset trains with loss on assistant tokens only; validation loss and perplexity are the
same under a pipelined + tensor-parallel layout as in one process."""
from __future__ import annotations

import json
import math

import pytest

from helpers.data import chat_records, text_corpus, write_jsonl
from hybridtrain import cli
from hybridtrain.rundir import RunDir
from helpers.launch import REPO, metrics, run_cli


def _split(records: list[dict]) -> tuple[list[dict], list[dict]]:
    train = [m for m in records if "loss" in m]
    val = [m for m in records if "val_loss" in m]
    return train, val


@pytest.mark.slow  # CI keeps a chat file end to end (below) and the text field's checks in tests/unit
def test_jsonl_corpus_with_a_content_field_trains(tmp_path):
    corpus = text_corpus(tmp_path / "corpus" / "part-0.jsonl", n=80)
    text_corpus(tmp_path / "corpus" / "part-1.jsonl", n=40, start=80)
    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, "+recipe=gpt_tiny", "data=files", f"data.path={corpus.parent}/*.jsonl",
                   "data.text_field=content", "trainer.max_steps=3", f"data.cache_dir={tmp_path / 'cache'}")
    assert "tokenized 120 records" in proc.stdout and "data      files text: train" in proc.stdout
    train, val = _split(metrics(run_dir))
    assert [m["step"] for m in train] == [1, 2, 3] and not val
    assert all(math.isfinite(m["loss"]) and m["data_wait_s"] >= 0 for m in train)
    assert train[-1]["loss"] < train[0]["loss"]
    data = json.loads(RunDir(run_dir).data_file.read_text())
    assert data["kind"] == "packed" and data["splits"]["train"]["num_documents"] == 120


@pytest.fixture(scope="module")
def chat_runs(tmp_path_factory):
    """llama_tiny on chats with a validation file, at (1,1,1), at dp=1 tp=2 pp=2, and at dp=2 pp=2
    with micro-batches of 3 instead of 1 (the same 12-sample global batch cut differently)."""
    d = tmp_path_factory.mktemp("chat")
    write_jsonl(d / "train.jsonl", chat_records(60))
    write_jsonl(d / "val.jsonl", chat_records(30, start=60))  # 30 // 12 = 2 validation batches
    common = ["+recipe=llama_tiny", "data=files", f"data.path={d}/train.jsonl", f"data.val_path={d}/val.jsonl",
              "data.format=chat", "data.seq_len=64", "trainer.max_steps=3", "trainer.eval_every=2",
              f"data.cache_dir={d / 'cache'}"]
    out = {}
    for layout in [(1, 1, 1), (1, 2, 2), (2, 1, 2, 3)]:
        run_dir = d / "run_{}".format("".join(map(str, layout)))
        dp, tp, pp, mbs = (*layout, 1)[:4]
        proc = run_cli(run_dir, *common, f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                       f"parallel.micro_batch_size={mbs}")
        out[layout] = (proc, metrics(run_dir))
    out["common"] = common
    return out


def test_chat_dataset_trains_on_assistant_tokens(chat_runs):
    proc, records = chat_runs[(1, 1, 1)]
    assert "data      files chat: train 60 samples" in proc.stdout and "validation 30 samples" in proc.stdout
    train, val = _split(records)
    assert [m["step"] for m in train] == [1, 2, 3]
    assert all(math.isfinite(m["loss"]) for m in train) and train[-1]["loss"] < train[0]["loss"]
    assert [m["step"] for m in val] == [2, 3]  # every eval_every steps and at the end
    for m in val:
        assert m["val_batches"] == 2 and m["val_ppl"] == pytest.approx(math.exp(m["val_loss"]), rel=1e-12)
    second = chat_runs[(1, 2, 2)][0]
    assert "tokenization skipped" in second.stdout  # the second run found the first one's cache


def test_validation_is_the_same_under_tp2_pp2(chat_runs):
    want_train, want_val = _split(chat_runs[(1, 1, 1)][1])
    got_train, got_val = _split(chat_runs[(1, 2, 2)][1])
    assert [m["step"] for m in got_val] == [m["step"] for m in want_val] == [2, 3]
    for g, w in zip(got_val, want_val):
        assert g["val_loss"] == pytest.approx(w["val_loss"], rel=1e-5), (g, w)
        assert g["val_ppl"] == pytest.approx(w["val_ppl"], rel=1e-5)
    for g, w in zip(got_train, want_train):  # masked labels train identically under the layout too
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4)


def test_masked_loss_is_the_mean_over_the_global_batch_tokens(chat_runs):
    """Chats carry different numbers of assistant tokens, so a mean of per-micro-batch means would
    change with the micro-batch size; the step loss is the mean over every loss token of the global
    batch instead: micro-batches of 3 (dp=2, pp=2) give the losses of micro-batches of 1, and both
    equal plain transformers with ``num_items_in_batch`` (its gradient-accumulation fix)."""
    from helpers.config import compose

    from hybridtrain.reference import reference_run

    want_train, want_val = _split(chat_runs[(1, 1, 1)][1])
    got_train, got_val = _split(chat_runs[(2, 1, 2, 3)][1])
    assert len(got_train) == len(want_train) == 3 and len(got_val) == len(want_val) == 2
    for g, w in zip(got_train + got_val, want_train + want_val):
        key = "loss" if "loss" in w else "val_loss"
        assert g[key] == pytest.approx(w[key], rel=1e-5), (g, w)
    oracle = reference_run(compose(*chat_runs["common"]))
    for o, w in zip(oracle, want_train, strict=True):
        assert o["loss"] == pytest.approx(w["loss"], rel=1e-5), (o, w)


def test_data_cache_dir_moves_the_tokens_only_and_every_other_cache_follows_hybridtrain_cache(tmp_path):
    """One cache root: with ``HYBRIDTRAIN_CACHE=ROOT`` and ``data.cache_dir=DATA``, DATA receives the
    tokenized data alone; the planner's shapes and the MFU peak probe go to ROOT (the peak had followed
    ``data.cache_dir``, the shapes not), and nothing to ``~/.cache``."""
    root, data = tmp_path / "root", tmp_path / "data"
    corpus = text_corpus(tmp_path / "corpus.jsonl", n=20)
    proc = cli.run(tmp_path / "run", ["+recipe=gpt_tiny", "data=files", f"data.path={corpus}", "data.text_field=content",
                                      f"data.cache_dir={data}", "trainer.max_steps=1", "optim.warmup_steps=1",
                                      "trainer.save_final=false", "trainer.report=false"],
                   env={"HYBRIDTRAIN_CACHE": str(root)}, cwd=REPO, timeout=300, check=True)
    assert {p.name[:5] for p in data.iterdir()} == {"data-"}, sorted(p.name for p in data.iterdir())
    assert (root / "shapes").is_dir() and (root / "peak_tflops.json").is_file(), sorted(p.name for p in root.iterdir())
    assert not any(p.name.startswith("data-") for p in root.iterdir())
    assert f"cached in {root / 'peak_tflops.json'}" in proc.stdout
