"""Bad input through the real command line: each case exits 2 before any worker starts, with
``[hybridtrain] config error: KEY: ...`` naming the key and the fix. The runs fail during data
preparation in the controller, so they are cheap; they start together and are read as they end."""
from __future__ import annotations

import subprocess

import pytest

from helpers.data import chapters, chat_records, text_corpus, write_jsonl
from hybridtrain.cli import Background
from hybridtrain.rundir import RunDir

BASE = ["+recipe=gpt_tiny", "data=files"]


def _inputs(d) -> dict[str, list[str]]:
    """Each case's overrides; the files they name are written into ``d``."""
    corpus = text_corpus(d / "corpus.jsonl", n=40)
    (d / "empty.jsonl").write_text("")
    (d / "latin1.txt").write_bytes("In the beginning God created the heaven.\n".encode() + b"Gen\xe8se\n")
    write_jsonl(d / "two.jsonl", [{"content": c[:200]} for c in chapters(2)])
    write_jsonl(d / "long_prompts.jsonl", [{"prompt": c, "completion": "Amen."} for c in chapters(30)])
    write_jsonl(d / "empty_docs.jsonl", [{"text": ""} for _ in range(30)])
    bad_chat = chat_records(30)
    bad_chat[17] = {"messages": [{"role": "user", "content": "Hello?"}, {"role": "user", "content": "Anyone?"}]}
    write_jsonl(d / "chats.jsonl", bad_chat)
    holes = (3, 7, 12, 20, 33, 40, 41, 50, 59)  # 9 of 60 records without the text field
    write_jsonl(d / "holes.jsonl", [{"body": "x"} if i in holes else {"content": c} for i, c in enumerate(chapters(60))])
    write_jsonl(d / "no_completion.jsonl", [{"prompt": c[:80]} if i == 4 else {"prompt": c[:80], "completion": c[80:200]}
                                            for i, c in enumerate(chapters(30))])
    return {
        "glob_matches_nothing": [f"data.path={d}/nowhere/*.jsonl"],
        "empty_dataset": [f"data.path={d}/empty.jsonl"],
        "missing_field": [f"data.path={corpus}", "data.text_field=body"],
        "not_utf8": [f"data.path={d}/latin1.txt"],
        "smaller_than_a_global_batch": [f"data.path={d}/two.jsonl", "data.text_field=content"],
        "nothing_to_learn_unpacked": [f"data.path={d}/long_prompts.jsonl", "data.format=prompt_completion"],
        "empty_documents_unpacked": [f"data.path={d}/empty_docs.jsonl", "data.packing=false"],
        "tokenizer_larger_than_vocab": [f"data.path={corpus}", "data.text_field=content",
                                        "+model.config.vocab_size=1000"],
        "chat_without_roles": [f"data.path={d}/chats.jsonl", "data.format=chat"],
        "hub_not_cached": ["data=hf", "data.name=nobody/no_such_set"],
        "records_without_the_field": [f"data.path={d}/holes.jsonl", "data.text_field=content"],
        "prompt_without_completion": [f"data.path={d}/no_completion.jsonl", "data.format=prompt_completion"],
        "validation_smaller_than_a_batch": [f"data.path={corpus}", "data.text_field=content", "data.packing=false",
                                            "data.val_fraction=0.1"],
    }


EXPECT = {  # case -> (key, fragments of the message)
    "glob_matches_nothing": ("data.path", ["nowhere/*.jsonl", "matches no file"]),
    "empty_dataset": ("data.path", ["no records"]),
    "missing_field": ("data.text_field", ["no field 'body'", "['content', 'source']", "data.text_field=<one of them>"]),
    "not_utf8": ("data.path", ["latin1.txt is not UTF-8", "byte offset 44", "0xe8", "convert the file to UTF-8"]),
    "smaller_than_a_global_batch": ("trainer.global_batch_size", ["fewer than one global batch of 12"]),
    "nothing_to_learn_unpacked": ("data.seq_len", ["no train record leaves a token to learn from", "raise data.seq_len"]),
    "empty_documents_unpacked": ("data.seq_len", ["no train record leaves a token to learn from"]),
    "tokenizer_larger_than_vocab": ("model.config.vocab_size", ["8000 tokens", "only 1000"]),
    "chat_without_roles": ("data.messages_field", ["record 17", "no assistant message", "['user', 'user']"]),
    "hub_not_cached": ("data.name", ["'nobody/no_such_set'", "not in the local HF datasets cache", "load_dataset("]),
    "records_without_the_field": ("data.text_field", ["9 of 60 train records", "field 'content' missing or null",
                                                      "holes.jsonl records 3, 7, 12, 20, 33 and 4 more (counting from 0)",
                                                      "data.skip_invalid=true"]),
    "prompt_without_completion": ("data.completion_field", ["1 of 30 train records", "field 'completion' missing or null",
                                                            "no_completion.jsonl record 4 (counting from 0)"]),
    "validation_smaller_than_a_batch": ("data.val_fraction", ["4 samples", "fewer than one global batch of 12"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("data_errors")
    inputs = _inputs(base / "inputs")
    started = {}
    for name, overrides in inputs.items():
        run_dir = base / name / "run"
        started[name] = (run_dir, Background(run_dir, [*BASE, f"data.cache_dir={base / 'cache'}", *overrides],
                                             base / name, cwd=base / name))
    yield started
    for _, run in started.values():
        run.kill()


@pytest.mark.parametrize("case", sorted(EXPECT))
def test_bad_input_exits_2_naming_the_key(runs, case):
    run_dir, run = runs[case]
    proc = run.result(timeout=300)
    key, fragments = EXPECT[case]
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"[hybridtrain] config error: {key}: " in proc.stderr, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in proc.stderr, (fragment, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "launching" not in proc.stdout
    assert not RunDir(run_dir).config_file.exists()  # nothing written, no worker started


def test_ctrl_c_while_tokenizing_is_one_line_exit_130_and_leaves_nothing(tmp_path):
    """n54: SIGINT to the process group (a terminal's Ctrl-C) in the middle of ``tokenizing train``: exit 130,
    one line and no traceback, no cache entry (not even a temporary one), no process left."""
    import os
    import signal
    import time

    import psutil

    from hybridtrain.cli import start

    write_jsonl(tmp_path / "big.jsonl", [{"text": c} for c in chapters(1189)] * 2)  # ~10 s of tokenizing here
    cache, err = tmp_path / "cache", tmp_path / "stderr.txt"
    with open(err, "w") as stderr:
        proc = start(tmp_path / "run", [*BASE, f"data.path={tmp_path}/big.jsonl", f"data.cache_dir={cache}"],
                     stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,  # its own process group
                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # not ignored, as in a shell's `&`
    try:
        deadline = time.monotonic() + 120
        while "tokenizing train" not in err.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, err.read_text()[-2000:]
        time.sleep(0.5)
        family = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = err.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert text.rstrip().splitlines()[-1] == ("[hybridtrain] interrupted while preparing the data (Ctrl-C): "
                                              "nothing cached, no worker started")
    assert not list(cache.iterdir())
    time.sleep(1)
    assert [p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE] == []


def test_an_unwritable_cache_folder_is_one_line_before_the_plan_also_in_a_dry_run(tmp_path):
    """n67 (``data.cache_dir=/proc/qa-cache``) and n66 (``HOME=/proc/nohome`` with the default cache root):
    exit 2, one line naming the key or variable, before the plan (so before tokenizing and any rank)."""
    dry = ["+recipe=gpt_tiny", "launcher.dry_run=true"]  # the embedded data: nothing else to refuse
    runs = {"n67": Background(tmp_path / "n67", [*dry, "data.cache_dir=/proc/qa-cache"], tmp_path / "o67"),
            "n66": Background(tmp_path / "n66", dry, tmp_path / "o66",
                              env={"HOME": "/proc/nohome", "XDG_CACHE_HOME": "", "HYBRIDTRAIN_CACHE": ""})}
    for name, key in (("n67", "data.cache_dir"), ("n66", "HOME")):
        proc = runs[name].result(timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.splitlines() == [f"[hybridtrain] config error: {key}: cannot write the cache folder "
                                            + proc.stderr.split("cannot write the cache folder ", 1)[1].rstrip()]
        assert "model     gpt2" not in proc.stdout  # refused before the plan
