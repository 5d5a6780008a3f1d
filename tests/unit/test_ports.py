"""A job's rendezvous port (``hybridtrain.ports``) is drawn from below the kernel's ephemeral range, where
no outgoing connection of another job can take it before rank 0 listens, and is free when drawn."""
from __future__ import annotations

import socket

from hybridtrain.ports import LOWEST, ephemeral_range, free_port, is_free


def test_port_is_free_and_below_the_ephemeral_range():
    low, _ = ephemeral_range()
    for _ in range(20):
        port = free_port()
        if low - LOWEST >= 1000:  # room below this machine's range (Linux's default starts at 32768)
            assert LOWEST <= port < low
        assert is_free(port)


def test_a_port_taken_by_a_listener_is_not_free():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        assert not is_free(s.getsockname()[1])


def test_ranges_are_read_from_the_kernel_file_and_fall_back(tmp_path):
    file = tmp_path / "ip_local_port_range"
    file.write_text("40000\t50000\n")
    assert ephemeral_range(file) == (40000, 50000)
    assert LOWEST <= free_port(path=file) < 40000
    assert ephemeral_range(tmp_path / "missing") == (32768, 60999)
    # no room below the range: the kernel's own pick
    file.write_text("20500 60999\n")
    assert free_port(path=file) > 0
