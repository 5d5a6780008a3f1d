"""``launcher.keep_host_memory``: a CPU rank's large tensors come from malloc's heap (kept and reused)
instead of a fresh ``mmap`` each (faulted in again every micro-batch), and it is on by default."""
from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest

from helpers.config import compose

# A fresh interpreter allocates a 64 MiB tensor and reads glibc's mallinfo2: ``hblkhd`` is the bytes held
# in mmap'ed blocks, ``uordblks`` the bytes in use from the heap; then it frees the tensor.
_PROBE = r"""
import ctypes, json, sys
import torch
from hybridtrain.host_memory import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
before = libc.mallinfo2()
t = torch.ones(16 * 2**20)  # 64 MiB
during = libc.mallinfo2()
del t
after = libc.mallinfo2()
print(json.dumps({"kept": kept, "mmap": during.hblkhd - before.hblkhd, "heap": during.uordblks - before.uordblks,
                  "heap_after": after.uordblks - before.uordblks, "arena_after": after.arena - before.arena}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _has_mallinfo2() -> bool:
    try:
        ctypes.CDLL(None).mallinfo2
    except AttributeError:
        return False
    return True


@pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc >= 2.33 (mallopt and mallinfo2)")
def test_large_blocks_come_from_the_kept_heap():
    MiB = 2**20
    default = _probe("default")
    assert default["mmap"] >= 64 * MiB and default["heap"] < MiB  # glibc's default: its own mmap, unmapped on free
    kept = _probe("keep")
    assert kept["kept"] is True
    assert kept["mmap"] < MiB and kept["heap"] >= 64 * MiB  # from the heap
    assert kept["heap_after"] < MiB and kept["arena_after"] >= 64 * MiB  # freed, and the heap keeps the pages


def test_keep_host_memory_is_on_by_default():
    assert compose("+recipe=gpt_tiny").launcher.keep_host_memory is True
