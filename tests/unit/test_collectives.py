"""The collective rule (``hybridtrain/parallel/collectives.py``): a tensor enters a collective on the
communication device, never on the host by accident, and nothing else in the package calls a
``torch.distributed`` collective directly.

NCCL cannot be run here, so the device rule is pinned with a recording stand-in for the
collective: the helper must hand it a tensor on the device it was told, whatever device the
caller's tensor is on (the ``meta`` device stands in for ``cuda``: neither is the host)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybridtrain.parallel import collectives

PACKAGE = Path(__file__).resolve().parents[2] / "hybridtrain"
COLLECTIVE = re.compile(r"\b(?:dist|torch\.distributed|deepspeed\.comm|comm)\.(all_reduce|all_gather\w*|reduce_scatter\w*|"
                        r"broadcast\w*|barrier|reduce|gather|scatter|send|recv|isend|irecv|all_to_all\w*)\s*\(")
ALLOWED = {
    "parallel/collectives.py": "the helper itself",
    "plan/calibrate.py": "the link probe: its own process group, tensors created on cuda:rank / cpu",
}


@pytest.fixture
def recorded(monkeypatch):
    """Pretend to be rank 0 of 2 and record the device of every tensor handed to torch.distributed."""
    seen: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(collectives, "_world", lambda group: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: seen.append(("all_reduce", t.device)))

    def fake_gather(out, t, group=None):
        seen.append(("all_gather", t.device))
        seen.extend(("output", o.device) for o in out)

    monkeypatch.setattr(dist, "all_gather", fake_gather)
    return seen


def test_all_reduce_moves_a_host_tensor_to_the_communication_device(recorded):
    host = torch.zeros(())  # what get_total_norm([]) returns: a CPU tensor
    out = collectives.all_reduce(host, torch.device("meta"), op="max")
    assert recorded == [("all_reduce", torch.device("meta"))]
    assert out.device.type == "meta"


def test_all_gather_runs_on_the_communication_device(recorded):
    shards = collectives.all_gather(torch.ones(3, 2).t(), torch.device("meta"))  # non-contiguous, on the host
    assert [d for _, d in recorded] == [torch.device("meta")] * 3
    assert len(shards) == 2 and all(s.device.type == "meta" for s in shards)


def test_a_tensor_on_the_device_is_reduced_in_place(recorded):
    t = torch.ones(4)
    assert collectives.all_reduce(t, t.device) is t


def test_without_a_process_group_tensors_pass_through():
    t = torch.arange(3.0)
    assert collectives.all_reduce(t, "cpu") is t
    assert [x.tolist() for x in collectives.all_gather(t, "cpu")] == [[0.0, 1.0, 2.0]]
    assert collectives.all_gather_autograd(t, None) == [t]
    collectives.barrier("cpu")  # nothing to wait for
    assert collectives.comm_device() == torch.device("cpu")


def test_empty_gradient_list_norm_is_reduced_on_the_device(recorded):
    """engine/clip.py: a TP rank > 0 of a stage holding only replicated or tied parameters has no
    gradient to count; its zero must still enter the all-reduce on the engine's device."""
    from hybridtrain.engine.clip import global_grad_norm

    replicated = torch.nn.Parameter(torch.ones(2))
    replicated.grad = torch.ones(2)
    norm = global_grad_norm([replicated], tp_rank=1, group=object(), device=torch.device("meta"))
    assert recorded == [("all_reduce", torch.device("meta"))] and norm.device.type == "meta"


def test_no_collective_outside_the_helper():
    """Every collective hybridtrain calls goes through parallel/collectives.py (or is listed above, with why)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ALLOWED:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if COLLECTIVE.search(code):
                offenders.append(f"hybridtrain/{rel}:{n}: {line.strip()}")
    assert not offenders, "call hybridtrain.parallel.collectives instead:\n" + "\n".join(offenders)
    assert COLLECTIVE.search("dist.all_gather(out, t)") and COLLECTIVE.search("torch.distributed.barrier()")


def test_gather_runs_on_the_communication_device_and_only_the_first_rank_receives(recorded, monkeypatch):
    def fake_gather(t, out=None, group=None, group_dst=None):
        recorded.append(("gather", t.device))
        recorded.extend(("output", o.device) for o in out or [])

    monkeypatch.setattr(dist, "gather", fake_gather)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    shards = collectives.gather(torch.ones(3, 2).t(), torch.device("meta"))  # non-contiguous, on the host
    assert [d for _, d in recorded] == [torch.device("meta")] * 3 and len(shards) == 2
    recorded.clear()
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    assert collectives.gather(torch.ones(3), torch.device("meta")) is None  # no copy of the others' tensors
    assert recorded == [("gather", torch.device("meta"))]
