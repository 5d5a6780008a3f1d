"""``trainer.keep_last`` prunes only the checkpoints a run wrote (the probe's n71, kept pinned)."""
from __future__ import annotations

from hybridtrain.checkpoint.io import finalize
from hybridtrain.rundir import RunDir


def test_keep_last_never_follows_a_symlinked_step_folder(tmp_path):
    """``checkpoints/step_1`` a symlink to a folder of the user's (with a ``meta.json`` of its own):
    pruning with ``keep_last=1`` removes the real old checkpoints, leaves the link, and never touches
    the folder it points to or its files."""
    root = RunDir(tmp_path / "run").checkpoints
    root.mkdir(parents=True)
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep me")
    (user / "meta.json").write_text("{}")
    (root / "step_1").symlink_to(user, target_is_directory=True)
    for step in (2, 3):
        tmp = root / f".tmp-step_{step}"
        tmp.mkdir()
        (tmp / "meta.json").write_text("{}")
        finalize(tmp, root / f"step_{step}", keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_3"]
    assert (root / "step_1").is_symlink() and (root / "latest").read_text() == "step_3"
    assert sorted(p.name for p in user.iterdir()) == ["meta.json", "notes.txt"]
    assert (user / "notes.txt").read_text() == "keep me"
