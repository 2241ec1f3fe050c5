"""How a sequence is cut across the ranks of a process group, and the helpers that shard and unshard it.

``contiguous`` (ring, all-gather, Ulysses): rank r holds tokens [r c, (r + 1) c) with c = N / world.
``zigzag`` (causal load balance): the sequence is cut in 2 world chunks of c = N / (2 world) and rank r holds chunks
r and 2 world - 1 - r, one early and one late, so every rank has the same amount of causal work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import checks

LAYOUTS = ("contiguous", "zigzag")


def _world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _pieces(fn: str, layout: str, world: int) -> int:
    checks.check_choice(fn, "layout", layout, LAYOUTS)
    return world * (2 if layout == "zigzag" else 1)


def segments(layout: str, rank: int, world: int, local_len: int) -> list[tuple[int, int, int]]:
    """(global start, local start, length) of each contiguous run of tokens that ``rank`` holds.

    Example::

        >>> segments("zigzag", rank=0, world=2, local_len=4)  # chunks 0 and 3 of a 8-token sequence
        [(0, 0, 2), (6, 2, 2)]
    """
    if layout == "contiguous":
        return [(rank * local_len, 0, local_len)]
    c = local_len // 2
    return [(rank * c, 0, c), ((2 * world - 1 - rank) * c, c, c)]


def shard(x: torch.Tensor, layout: str = "contiguous", group=None, dim: int = 1) -> torch.Tensor:
    """This rank's part of a full sequence ``x`` (the same on every rank), sequence along ``dim``.

    Raises ValueError when the length does not divide evenly (world chunks, or 2 world for zigzag).
    """
    world, rank = _world(group)
    pieces = _pieces("shard", layout, world)
    n = x.shape[dim]
    checks.check_divisible("shard", tokens=n, pieces=pieces, why=f"{layout} layout, world size {world}")
    local = n // world
    return torch.cat([x.narrow(dim, g, length) for g, _, length in segments(layout, rank, world, local)], dim)


def unshard(x: torch.Tensor, layout: str = "contiguous", group=None, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's part ``x`` (an all-gather; the inverse of ``shard``)."""
    world, _ = _world(group)
    full = [None] * _pieces("unshard", layout, world)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    local = x.shape[dim]
    for r, part in enumerate(parts):
        for g, start, length in segments(layout, r, world, local):
            full[g // length] = part.narrow(dim, start, length)
    return torch.cat(full, dim)
