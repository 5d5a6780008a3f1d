"""Keep freed host memory in a CPU rank for reuse, the way GPU caching allocators keep device memory.

glibc's ``malloc`` serves every block above its mmap threshold (128 KiB, adapting up to 32 MiB)
with a fresh ``mmap`` and returns it with ``munmap`` when freed, and trims the heap's free top
above 128 KiB. A training step allocates and frees the same large tensors every micro-batch
(activations, logits of ``[tokens, vocab]``, gradients), so each one costs the kernel a page
fault and a zeroed page per 4 KiB, every time: on the bench's 135M model (``bench/models.py``,
``smollm2_135m``) millions of page faults and a large share of the step in system time
(``docs/benchmarks.md``, "Page faults"). Raising both
thresholds makes freed blocks stay in the process and be handed out again, page faults gone.

PyTorch's CPU allocator is ``malloc`` itself (aligned to 64 bytes either way) and has no caching
mode; jemalloc or tcmalloc would do the same through ``LD_PRELOAD``, which must be set before the
process starts (CPU ranks are forked from the preload process, ``hybridtrain/launch/preload.py``)
and is not installed everywhere. ``mallopt`` changes glibc's policy at run time, so it is used here.
The cost: the rank's resident memory stays near its peak instead of falling between micro-batches.
"""
from __future__ import annotations

M_TRIM_THRESHOLD = -1
"""glibc's ``mallopt`` parameter: free heap top above this many bytes goes back to the OS."""
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter: blocks of at least this many bytes get their own ``mmap``."""

KEEP_BYTES = 1 << 30
"""Both thresholds: blocks under 1 GiB come from the heap, and up to 1 GiB of free heap top is kept."""


def keep_freed_memory() -> bool:
    """Make this process's ``malloc`` reuse freed blocks under :data:`KEEP_BYTES` instead of unmapping
    them. Returns whether it took effect: ``False`` where the C library is not glibc (no
    ``mallopt``), which only leaves the default policy (slower, never different numbers)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, KEEP_BYTES) == 1 for param in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))
