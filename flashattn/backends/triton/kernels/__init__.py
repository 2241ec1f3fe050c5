"""FlashAttention-2 forward and backward as Triton kernels.

One program owns one (query block, batch x head) pair in the forward and the dQ pass, one (key block, batch x
key/value head) pair in the dK/dV pass. Every kernel builds its score tiles with ``tiles.score_tile``, the single
place where scale, softcap, the causal/window band, ALiBi and a user mask are applied; a feature whose argument
is None is compiled out, and the band is applied only on tiles that straddle it.

Dropout draws element (r, j), r = (b * H + h) * Nq + i, from ``tl.randint4x(seed, r * ceil(Nk / 8) + (j >> 3))``
(a 16-bit half of one of its four words): the same numbers as ``flashattn.backends.philox``, so this backend and
the CPU path drop exactly the same weights.

Values travel between the kernels' helpers in named bundles (``bundles``); ``BlockLists``, a block mask's tile
lists, is the one the launcher builds.
"""

from .backward import (
    attention_backward_dkdv_kernel,
    attention_backward_dq_convert_kernel,
    attention_backward_dq_kernel,
    attention_backward_preprocess_kernel,
)
from .bundles import BlockLists
from .forward import attention_forward_kernel

__all__ = [
    "BlockLists",
    "attention_backward_dkdv_kernel",
    "attention_backward_dq_convert_kernel",
    "attention_backward_dq_kernel",
    "attention_backward_preprocess_kernel",
    "attention_forward_kernel",
]
