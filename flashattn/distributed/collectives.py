"""Collectives that older backends lack, by another route: gloo in torch 2.7 has neither ``reduce_scatter`` nor
(before 2.12) ``all_to_all``. Each is tried once per backend; a backend that says it has none ("does not support
alltoall" / "reduce_scatter") is remembered and served by pairwise sends and receives or an all-reduce, with the
same results and more traffic.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_MISSING: dict[str, set[str]] = {"all_to_all": set(), "reduce_scatter": set()}  # collective -> backends without it


def _missing(collective: str, group, run) -> bool:
    """Run ``run()`` unless ``group``'s backend is known to lack ``collective``; True when it lacks it."""
    backend = str(dist.get_backend(group))
    if backend in _MISSING[collective]:
        return True
    try:
        run()
        return False
    except RuntimeError as err:
        if collective.replace("_", "") not in str(err).replace("_", "").lower():
            raise
        _MISSING[collective].add(backend)
        return True


def _peer(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def all_to_all(received: list[torch.Tensor], sends: list[torch.Tensor], group) -> None:
    """``dist.all_to_all(received, sends)``: chunk j to rank j, rank j's chunk into ``received[j]``."""
    if not _missing("all_to_all", group, lambda: dist.all_to_all(received, sends, group=group)):
        return
    rank = dist.get_rank(group)
    received[rank].copy_(sends[rank])
    ops = []
    for j in range(dist.get_world_size(group)):
        if j != rank:
            ops += [dist.P2POp(dist.isend, sends[j], _peer(group, j), group),
                    dist.P2POp(dist.irecv, received[j], _peer(group, j), group)]
    for request in dist.batch_isend_irecv(ops) if ops else ():  # one rank: nothing to exchange
        request.wait()


def reduce_scatter(part: torch.Tensor, chunks: list[torch.Tensor], group) -> None:
    """``dist.reduce_scatter(part, chunks)``: the sum over ranks of ``chunks[rank]`` into ``part``."""
    if not _missing("reduce_scatter", group, lambda: dist.reduce_scatter(part, chunks, group=group)):
        return
    total = torch.stack(chunks)
    dist.all_reduce(total, group=group)
    part.copy_(total[dist.get_rank(group)])
