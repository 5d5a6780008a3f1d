"""A rendezvous port for a job on this machine.

The usual trick (bind port 0, read the port, release it) hands back a port from the kernel's
ephemeral range, the range it also gives every outgoing connection: between the pick and the moment
rank 0's ``TCPStore`` listens, a connection of another job (gloo opens many) can take that port and
the job dies with ``EADDRINUSE``. Seen with two test workers running jobs side by side. So the port
is drawn from below that range, where only listeners go, and checked free; torch and DeepSpeed have
no helper for this (``torchrun`` binds port 0 as above).
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000  # below this, well-known services (and SLURM's default ports, 6817-6819) live
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range(path: Path = _RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for outgoing connections' ports (Linux ``ip_local_port_range``); where it
    cannot be read, Linux's default ``(32768, 60999)``."""
    try:
        low, high = (int(v) for v in path.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def is_free(port: int) -> bool:
    """Whether a listener could bind ``port`` on every interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(tries: int = 64, path: Path = _RANGE_FILE) -> int:
    """A TCP port free on this machine now, below the ephemeral range when there is room there
    (``[20000, ephemeral start)``), else one the kernel picks (port 0)."""
    low, _ = ephemeral_range(path)
    if low - LOWEST >= 1000:
        draw = random.Random()  # a private generator: the training seed must not pick ports, nor ports move it
        for _ in range(tries):
            port = draw.randrange(LOWEST, low)
            if is_free(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
