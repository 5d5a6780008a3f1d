"""Disk space for a checkpoint: checked before a save writes anything, named when a write finds the
disk full (the partial folder is removed then, :func:`hybridtrain.checkpoint.save.save_checkpoint`)."""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Optional


def mount_point(path: Path) -> Path:
    """The mount point of the file system that holds ``path`` (or would, for a path not created yet)."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def gigabytes(n: float) -> str:
    """``n`` bytes as ``1.23 GB``."""
    return f"{n / 1e9:.2f} GB"


def space_problem(folder: Path, need: int) -> Optional[str]:
    """"no space left on DEVICE" when the file system of ``folder`` has less than ``need`` bytes free."""
    where = mount_point(folder)
    free = shutil.disk_usage(where).free
    if free >= need:
        return None
    return no_space(where, need, free)


def no_space(where: Path, need: int, free: Optional[int] = None, during: bool = False) -> str:
    """The message of a checkpoint that does not fit on the file system mounted at ``where``; ``during``:
    a write found the disk full after the check passed (the partial folder is removed by then)."""
    free = shutil.disk_usage(where).free if free is None else free
    now = (f"the disk filled up during the save; {gigabytes(free)} free again with the partial folder removed"
           if during else f"{gigabytes(free)} free")
    return (f"no space left on {where} (needs {gigabytes(need)} for the checkpoint, {now}): free space there, "
            "keep fewer checkpoints (trainer.keep_last) or put hydra.run.dir on a larger disk")


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is a write that found the disk full; torch's
    zip writer hides the errno in ``RuntimeError: ... unexpected pos``."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return True
        text = str(err)
        if "unexpected pos" in text or "No space left on device" in text or "file write failed" in text:
            return True
        err = err.__cause__ or err.__context__
    return False
