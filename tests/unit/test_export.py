"""``python -m hybridtrain.export`` refuses, in one line and exit 2 with nothing written, a target that is
not a new or empty folder (unless ``--overwrite``) and a checkpoint whose files are truncated. The
checkpoint is a hand-made ``step_N`` folder (``hf/`` part, ``config.json``, ``meta.json`` with file sizes)."""
from __future__ import annotations

import json

import pytest
import torch

from hybridtrain.checkpoint.io import CheckpointDir, file_sizes
from hybridtrain.export import main


@pytest.fixture
def checkpoint(tmp_path):
    """A one-stage checkpoint of a tiny GPT-2 whose meta.json records its files' sizes."""
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = GPT2LMHeadModel(config)
    ckpt = CheckpointDir(tmp_path / "step_1")
    ckpt.hf.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(ckpt.hf_part(0)), metadata={"format": "pt"})
    config.save_pretrained(str(ckpt.hf))
    ckpt.meta_file.write_text(json.dumps({"step": 1, "files": file_sizes(ckpt.path)}))
    return ckpt


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("[hybridtrain] export error: "), err
    return err


def test_a_folder_that_is_not_empty_is_refused_unless_overwrite(checkpoint, tmp_path, capsys):
    out = tmp_path / "my_model"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    assert main([str(checkpoint.path), str(out)]) == 2
    err = _one_line_error(capsys)
    assert f"{out} is not empty (it holds config.json)" in err and "--overwrite" in err
    assert (out / "config.json").read_text() == '{"mine": true}' and sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert main([str(checkpoint.path), str(out), "--overwrite"]) == 0
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(out)).config.n_layer == 1  # replaced by the export


def test_an_empty_folder_or_a_new_path_is_exported_into(checkpoint, tmp_path):
    (tmp_path / "empty").mkdir()
    assert main([str(checkpoint.path), str(tmp_path / "empty")]) == 0
    assert main([str(checkpoint.path), str(tmp_path / "new" / "model")]) == 0
    assert (tmp_path / "empty" / "model.safetensors").is_file() and (tmp_path / "new" / "model" / "config.json").is_file()


def test_a_file_as_target_is_refused(checkpoint, tmp_path, capsys):
    target = tmp_path / "model.bin"
    target.write_bytes(b"keep me")
    assert main([str(checkpoint.path), str(target), "--overwrite"]) == 2
    assert f"{target} is a file, not a folder" in _one_line_error(capsys)
    assert target.read_bytes() == b"keep me"


def test_a_truncated_shard_is_refused_and_no_folder_is_left(checkpoint, tmp_path, capsys):
    part = checkpoint.hf_part(0)
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    assert main([str(checkpoint.path), str(out)]) == 2
    err = _one_line_error(capsys)
    assert f"{part} is {len(data) // 2} bytes but was saved with {len(data)} (meta.json): truncated or corrupt" in err
    assert not out.exists()


def test_an_unreadable_shard_without_recorded_sizes_leaves_no_folder(checkpoint, tmp_path, capsys):
    checkpoint.meta_file.write_text(json.dumps({"step": 1}))  # a checkpoint saved before sizes were recorded
    checkpoint.hf_part(0).write_bytes(b"\x00" * 64)
    out = tmp_path / "out"
    assert main([str(checkpoint.path), str(out)]) == 2
    assert "is not a readable safetensors file" in _one_line_error(capsys)
    assert not out.exists()


def test_a_shard_corrupted_at_the_same_size_is_refused_by_its_digest(checkpoint, tmp_path, capsys):
    """Same size, other bytes (a flipped byte inside a weight): with digests in meta.json the export refuses it
    instead of writing a silently wrong model."""
    from hybridtrain.checkpoint.io import DIGESTS, file_digests

    meta = json.loads(checkpoint.meta_file.read_text())
    checkpoint.meta_file.write_text(json.dumps({**meta, DIGESTS: file_digests(checkpoint.path)}))
    part = checkpoint.hf_part(0)
    data = bytearray(part.read_bytes())
    data[-5] ^= 0xFF  # the last tensor's bytes: the header still parses
    part.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert main([str(checkpoint.path), str(out)]) == 2
    assert f"{part} does not match its sha256 digest in meta.json" in _one_line_error(capsys)
    assert not out.exists()


def test_recorded_sizes_reads_sizes_with_or_without_digests():
    from hybridtrain.export import recorded_sizes

    assert recorded_sizes({"files": {"hf/a": 3, "ds/b": {"size": 5, "sha256": "00"}}}) == {"hf/a": 3, "ds/b": 5}
    assert recorded_sizes({"step": 1}) == {}


def _with_digests(checkpoint, *extra_files: str) -> None:
    """Write the side files a save writes (``extra_files``) and seal meta.json with sizes and sha256 digests."""
    from hybridtrain.checkpoint.io import DIGESTS, file_digests

    for name in extra_files:
        (checkpoint.hf / name).write_text('{"model_max_length": 16}')
    checkpoint.meta_file.write_text(json.dumps({"step": 1, "files": file_sizes(checkpoint.path),
                                                DIGESTS: file_digests(checkpoint.path)}))


def test_a_side_file_linked_out_of_the_checkpoint_is_refused(checkpoint, tmp_path, capsys):
    """n46: hf/tokenizer_config.json replaced by a symbolic link to a file outside the checkpoint (a key, a
    token) is refused, even with meta.json rewritten to match the target; no folder is left, nothing copied."""
    from hybridtrain.checkpoint.io import DIGESTS, sha256

    _with_digests(checkpoint, "tokenizer_config.json")
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    link = checkpoint.hf / "tokenizer_config.json"
    link.unlink()
    link.symlink_to(secret)
    for rewritten in (False, True):
        if rewritten:  # a sender who rewrites meta.json for the link's target
            meta = json.loads(checkpoint.meta_file.read_text())
            meta["files"]["hf/tokenizer_config.json"] = secret.stat().st_size
            meta[DIGESTS]["hf/tokenizer_config.json"] = sha256(secret)
            checkpoint.meta_file.write_text(json.dumps(meta))
        out = tmp_path / "out"
        assert main([str(checkpoint.path), str(out)]) == 2
        assert f"{link} is a symbolic link (to {secret}), not a file the save wrote" in _one_line_error(capsys)
        assert not out.exists()


def test_a_side_file_edited_at_the_same_size_is_refused(checkpoint, tmp_path, capsys):
    """An hf/config.json edited after the save at the same size (auto_map for a later trust_remote_code load,
    here a changed width): its sha256 in meta.json tells, and nothing is written."""
    _with_digests(checkpoint)
    config = checkpoint.hf / "config.json"
    text = config.read_text()
    edited = text.replace('"n_embd": 16', '"n_embd": 61')
    assert edited != text and len(edited) == len(text)
    config.write_text(edited)
    out = tmp_path / "out"
    assert main([str(checkpoint.path), str(out)]) == 2
    assert f"{config} does not match its sha256 digest in meta.json" in _one_line_error(capsys)
    assert not out.exists()


def test_a_file_added_to_hf_is_refused(checkpoint, tmp_path, capsys):
    _with_digests(checkpoint)
    added = checkpoint.hf / "modeling_evil.py"
    added.write_text("import os\n")
    out = tmp_path / "out"
    assert main([str(checkpoint.path), str(out)]) == 2
    assert f"{added} is not listed in meta.json: it was added after the save" in _one_line_error(capsys)
    assert not out.exists()


def test_a_folder_in_hf_is_refused(checkpoint, tmp_path, capsys):
    _with_digests(checkpoint)
    (checkpoint.hf / "extra").mkdir()
    out = tmp_path / "out"
    assert main([str(checkpoint.path), str(out)]) == 2
    assert f"{checkpoint.hf / 'extra'} is not a regular file: the save writes none there" in _one_line_error(capsys)
    assert not out.exists()


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600)], ids=["umask_022", "umask_077"])
def test_written_files_have_the_umasks_mode(checkpoint, tmp_path, umask, mode):
    """safetensors' save_file makes its files 0600; hybridtrain's (an export's model.safetensors, a checkpoint's
    rng/rank_*.safetensors) get the mode the umask gives a new file, like every other file of the export."""
    import os

    from hybridtrain.checkpoint.save import save_rng
    from hybridtrain.checkpoint.stream import new_file_mode

    old = os.umask(umask)
    try:
        assert new_file_mode() == mode
        assert main([str(checkpoint.path), str(tmp_path / "out")]) == 0
        save_rng(tmp_path / "rank_00000.safetensors")
    finally:
        os.umask(old)
    files = [*sorted((tmp_path / "out").iterdir()), tmp_path / "rank_00000.safetensors"]
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: oct(mode) for f in files}
