"""A safetensors file written one tensor at a time, so the writer never holds all of its tensors.

``safetensors.torch.save_file`` takes a dict of every tensor of the file: for a pipeline stage's fp32
weights and AdamW moments that is the stage's whole state on the host at once (about 40 GB for a
7B stage). The format is a little-endian ``u64`` header length, a JSON header naming each tensor's
dtype, shape and byte range, and the tensors' bytes; the shapes are known before any tensor is
gathered, so the header is written first and each tensor lands at its offset as it arrives.

The file is byte for byte what ``save_file`` writes for the same tensors and metadata (the tensors'
data ordered by name, the header compact JSON padded with spaces to a multiple of 8 bytes), which
``tests/unit/test_checkpoint_files.py`` compares: every reader (``safe_open``, the export, resume)
reads it unchanged.

:func:`save_tensors` is ``save_file`` for a dict that is small enough to hold, with the file's mode set from the
umask: ``save_file`` (safetensors 0.8) writes a temporary file of mode 0600 and renames it, so a checkpoint's RNG
states or an export's ``model.safetensors`` could not be read by a teammate where the umask (022) says they can.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Optional

import torch

_DTYPES = {torch.float32: ("F32", 4)}
"""The dtypes hybridtrain streams (the checkpoint's HF tensors are fp32) and their safetensors names."""


class StreamedSafetensors:
    """``path``, a safetensors file of the tensors ``specs`` (``name -> (shape, dtype)``) written with
    :meth:`write` one at a time, in any order; :meth:`close` checks that every one arrived.

    Use as a context manager; the file is complete only when :meth:`close` returned."""

    def __init__(self, path: Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 metadata: Optional[dict[str, str]] = None):
        self.path = Path(path)
        self._where: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for name in sorted(specs):  # save_file's order for tensors of one dtype
            shape, dtype = tuple(int(n) for n in specs[name][0]), specs[name][1]
            if dtype not in _DTYPES:
                raise ValueError(f"{name}: streaming writes {list(_DTYPES)} tensors, not {dtype}")
            code, size = _DTYPES[dtype]
            nbytes = math.prod(shape) * size
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._where[name] = (offset, shape, dtype)
            offset += nbytes
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)  # padded: the data starts 8-byte aligned
        self._start = 8 + len(text)
        self._size = offset
        self._left = set(specs)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(text)) + text)
        self._file.truncate(self._start + offset)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Put tensor ``name`` (a host tensor of the declared shape and dtype) at its place in the file."""
        offset, shape, dtype = self._where[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or name not in self._left:
            raise ValueError(f"{self.path}: tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}"
                             f"{'' if name in self._left else ', written twice'}; the header declares {shape} {dtype}")
        self._left.discard(name)
        if tensor.numel():
            self._file.seek(self._start + offset)
            self._file.write(memoryview(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()))

    def close(self) -> None:
        """Finish the file; every declared tensor must have been written."""
        self._file.close()
        if self._left:
            raise ValueError(f"{self.path}: tensors {sorted(self._left)[:3]} were declared but never written")

    def __enter__(self) -> "StreamedSafetensors":
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()


def new_file_mode() -> int:
    """The mode ``open()`` gives a new file in this process: ``0o666`` less the umask. The umask is read from
    ``/proc/self/status`` (Linux), which changes nothing; elsewhere by setting and restoring it at once."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
        mask = next(int(line.split()[1], 8) for line in lines if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o077)  # the strictest value for the moment it is set
        os.umask(mask)
    return 0o666 & ~mask


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: Optional[dict[str, str]] = None) -> None:
    """``safetensors.torch.save_file(tensors, path, metadata)``, the file then given :func:`new_file_mode`."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, new_file_mode())
