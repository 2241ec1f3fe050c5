"""Arrival counters for split-KV's merge inside the forward launch.

With split-KV (flash-decoding) every program of a query block writes its split's partial O and lse, then takes a
ticket from its block's counter; the program that takes the last one merges the partials and sets the counter back
to zero (``kernels/forward.py``). So the merge costs no launch of its own, and counters that start a launch at zero
end it at zero: launches in one stream's order can share them. Launches on two streams could run at once, so each
stream has its own; a stream being captured into a CUDA graph gets counters of its own per launch, zeroed by a memset
the graph replays, so that a graph never shares counters with launches outside it (or with another graph replayed
at the same time on another stream).

Example::

    >>> import torch
    >>> counters = tickets(torch.device("cpu"), 6)
    >>> counters.dtype, bool((counters[:6] == 0).all()), tickets(torch.device("cpu"), 6) is counters
    (torch.int32, True, True)
"""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}
MIN_COUNTERS = 1024  # one per query block of a launch: a decode step's launch has batch x kv heads


def tickets(device: torch.device, count: int, stream: int | None = None) -> torch.Tensor:
    """At least ``count`` int32 counters at zero on ``device`` for one launch on ``stream`` (a CUDA stream handle;
    the device's current stream by default), every launch leaving them at zero."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(count, dtype=torch.int32, device=device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one device, two keys
        device = torch.device("cuda", torch.cuda.current_device())
    if stream is None:
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    found = _COUNTERS.get((device, stream))
    if found is None or found.numel() < count:
        # A new buffer for a larger launch: the old one may still be in use by a queued launch on this stream,
        # which the caching allocator keeps it for (its memory is reused in the stream's order).
        found = torch.zeros(max(count, MIN_COUNTERS, 2 * (0 if found is None else found.numel())),
                            dtype=torch.int32, device=device)
        _COUNTERS[(device, stream)] = found
    return found
