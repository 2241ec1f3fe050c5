"""Context parallelism: one attention over a sequence sharded across the ranks of a ``torch.distributed`` group
(NCCL on GPUs, gloo on CPU), forward and backward, equal to what one device computes.

- ``ring_flash_attn_func``: K/V blocks travel around the ring, overlapped with compute (contiguous layout).
- ``zigzag_ring_flash_attn_func``: the same on the zigzag layout, which balances causal work.
- ``allgather_flash_attn_func``: K/V gathered a few heads at a time, gradients reduce-scattered.
- ``ulysses_flash_attn_func``: all-to-all from sequence shards to head shards and back.

``shard``/``unshard`` cut a full sequence into this rank's part for a layout and put it back together.
Partial results merge by log-sum-exp in float32. Refused: dropout (a per-block mask would not match one
device's), q/k of different lengths (cross-attention), shards of unequal length, varlen.

Example (on every rank)::

    q, k, v = (shard(t, "zigzag") for t in (q_full, k_full, v_full))
    out = zigzag_ring_flash_attn_func(q, k, v, causal=True)
    out_full = unshard(out, "zigzag")
"""

from .allgather import allgather_flash_attn_func
from .layout import LAYOUTS, segments, shard, unshard
from .ring import ring_flash_attn_func, zigzag_ring_flash_attn_func
from .ulysses import ulysses_flash_attn_func

__all__ = [
    "LAYOUTS",
    "allgather_flash_attn_func",
    "ring_flash_attn_func",
    "segments",
    "shard",
    "ulysses_flash_attn_func",
    "unshard",
    "zigzag_ring_flash_attn_func",
]
