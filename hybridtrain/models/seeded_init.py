"""The seeded initial values of a unit, computed tile by tile so that a rank makes only its own shard.

HF's ``_init_weights`` decides how each parameter starts (``normal_(0, std)`` for matrices, ones and
zeros for norms and biases). Run as is, every random parameter is one ``normal_`` over the whole
tensor: a single stream of torch's CPU generator (mt19937), which has no way to skip ahead, so a
tensor-parallel rank would draw the whole tensor to keep 1/tp of it (tp-times redundant work, most of
it the generator itself, which discarding cannot avoid; ``docs/benchmarks.md`` has the cost).

So the random fills of a unit's parameters are made in tiles: the tensor, seen as ``[rows, columns]``
(``[d0, d1 x d2 ...]``; a vector is one column), is cut along each axis into at most
:data:`TILES_PER_AXIS` equal pieces of at least :data:`MIN_TILE` entries, and each tile is the same
torch operation (``normal_(mean, std)``, ``uniform_(a, b)``, with HF's arguments) on a generator
seeded from the unit's seed, the parameter's name, how many fills it had before, and the tile's
position. A tile's values therefore depend on nothing else: a rank that needs rows ``[a, b)`` (a
column-parallel shard, a vocabulary shard) or columns ``[a, b)`` (a row-parallel shard) fills only the
tiles that overlap them, and its shard is bit for bit the shard of the whole tensor filled tile by
tile (``tests/unit/test_seeded_init.py``). The single-process reference
(:func:`hybridtrain.models.hf_model.reference_model`) fills every tile, so (1, 1, 1) is still plain
transformers with the same weights. The distribution is HF's; only the random stream is laid out
differently from one ``normal_`` over the tensor.

:func:`init_unit` runs HF's ``_init_weights`` on one unit under these fills, seeded by
:func:`unit_seed` ``(seed, unit name)``.

The fills are intercepted below the Python API (a ``TorchDispatchMode`` on ``aten.normal_`` and
``aten.uniform_``), so whatever path ``_init_weights`` takes (``transformers.initialization``,
``torch.nn.init``, a tensor method) is covered; a fill of anything but a whole parameter of the unit
(a slice, a temporary) runs unchanged on the unit's seeded global generator, as before.
"""
from __future__ import annotations

import zlib
from typing import Mapping, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

TILES_PER_AXIS = 16
"""Most pieces an axis is cut into: 256 tiles of a large matrix (an overhead small against the
``normal_`` of the matrix itself), and shards of tp up to 16 that fall on tile edges."""
MIN_TILE = 64
"""Fewest entries of a tile along an axis (small tensors stay one tile)."""

Keep = Mapping[str, tuple[int, Sequence[tuple[int, int]]]]
"""``parameter name (in the unit) -> (dimension, [lo, hi) ranges)`` a rank keeps of it; parameters not
named are kept whole."""

FILLS = {torch.ops.aten.normal_.default: "normal_", torch.ops.aten.uniform_.default: "uniform_"}
"""The random in-place fills made tile by tile, and their tensor method."""


def cuts(n: int) -> list[int]:
    """Tile edges along an axis of ``n`` entries: ``[0, ..., n]``, at most :data:`TILES_PER_AXIS` pieces
    of at least :data:`MIN_TILE` entries (a function of ``n`` only, so every rank cuts alike)."""
    parts = max(1, min(TILES_PER_AXIS, n // MIN_TILE))
    return [i * n // parts for i in range(parts + 1)]


def tile_seed(unit_seed: int, name: str, fill: int, row: int, col: int) -> int:
    """The generator seed of tile (``row``, ``col``) of the ``fill``-th random fill of parameter ``name``."""
    return zlib.crc32(f"{unit_seed}:{name}:{fill}:{row}:{col}".encode()) & 0x7FFFFFFF


def _overlaps(lo: int, hi: int, ranges: Sequence[tuple[int, int]]) -> bool:
    return any(a < hi and lo < b for a, b in ranges)


def fill_tiles(tensor: torch.Tensor, method: str, args: tuple, kwargs: dict, seed_of,
               keep: tuple[int, Sequence] | None) -> None:
    """Fill ``tensor`` in place with ``method(*args, **kwargs)`` tile by tile, ``seed_of(row, col)`` seeding
    each tile; with ``keep = (dim, ranges)`` only the tiles overlapping those ranges of ``dim`` (the rest
    of the tensor is left as it was)."""
    grid = tensor.view(tensor.shape[0], -1) if tensor.dim() > 1 else tensor.view(-1, 1)  # [rows, columns]
    rows, cols = cuts(grid.shape[0]), cuts(grid.shape[1])
    want = {0: [(0, grid.shape[0])], 1: [(0, grid.shape[1])]}
    if keep is not None and (tensor.dim() <= 2 or keep[0] == 0):
        want[keep[0]] = list(keep[1])
    generator = torch.Generator()
    for i, (r0, r1) in enumerate(zip(rows, rows[1:])):
        if not _overlaps(r0, r1, want[0]):
            continue
        for j, (c0, c1) in enumerate(zip(cols, cols[1:])):
            if not _overlaps(c0, c1, want[1]):
                continue
            generator.manual_seed(seed_of(i, j))
            tile = torch.empty(r1 - r0, c1 - c0, dtype=tensor.dtype, device=tensor.device)
            getattr(tile, method)(*args, **kwargs, generator=generator)
            grid[r0:r1, c0:c1].copy_(tile)


class TiledFills(TorchDispatchMode):
    """Within it, random fills of ``params`` (``name -> parameter`` of one unit) are made tile by tile
    (:func:`fill_tiles`), seeded from ``unit_seed``; ``keep`` names the parts this rank needs."""

    def __init__(self, params: Mapping[str, torch.Tensor], unit_seed: int, keep: Keep | None = None):
        super().__init__()
        self.by_storage = {(p.data_ptr(), tuple(p.shape)): name for name, p in params.items() if p.numel()}
        self.unit_seed = unit_seed
        self.keep = dict(keep or {})
        self.fills: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        method = FILLS.get(func)
        if method is not None and kwargs.get("generator") is None:
            target = args[0]
            name = self.by_storage.get((target.data_ptr(), tuple(target.shape))) if target.is_contiguous() else None
            if name is not None:
                fill = self.fills.get(name, 0)
                self.fills[name] = fill + 1
                rest = {k: v for k, v in kwargs.items() if k != "generator"}
                fill_tiles(target, method, tuple(args[1:]), rest,
                           lambda i, j: tile_seed(self.unit_seed, name, fill, i, j), self.keep.get(name))
                return target
        return func(*args, **kwargs)


def unit_seed(seed: int, name: str) -> int:
    """Seed of HF unit ``name`` (e.g. ``transformer.h.3``): independent of plan and rank."""
    return zlib.crc32(f"{seed}:{name}".encode()) & 0x7FFFFFFF


def init_unit(hf_model: nn.Module, name: str, seed: int, keep: Keep | None = None) -> nn.Module:
    """Initialise HF unit ``name`` of ``hf_model`` in place with HF's ``_init_weights``.

    Runs under a forked RNG seeded by :func:`unit_seed`, so the values do not depend on what
    else this process initialised before; the random fills of its parameters are made tile by tile
    (:class:`TiledFills`), and with ``keep`` (``parameter -> (dim,
    ranges)``) only the tiles of those parts, which come out exactly as in a whole fill. Used both by
    workers and by the single-process reference model of the tests.
    """
    unit = hf_model.get_submodule(name)
    base = unit_seed(seed, name)
    with torch.random.fork_rng(devices=[]), TiledFills(dict(unit.named_parameters()), base, keep):
        torch.manual_seed(base)
        unit.apply(hf_model._init_weights)  # children first, as HF's own post-order init
    return unit
