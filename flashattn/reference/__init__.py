"""The algorithm ladder: exact attention, from the textbook softmax to FlashAttention-2, in NumPy.

Each rung is a small function whose docstring states the recurrence it implements:

* softmax: :func:`naive_softmax` -> :func:`safe_softmax` -> :func:`three_pass_softmax`
  -> :func:`online_softmax`;
* attention: :func:`standard_attention` (Algorithm 0) -> :func:`two_pass_attention`
  -> :func:`one_pass_attention`;
* FlashAttention: :func:`flash_attention_v1` (Algorithm 1) -> :func:`flash_attention_v2_forward`
  -> :func:`flash_attention_v2_backward`;
* HBM traffic: :class:`HBMCounter` / :class:`HBMArray` count what the tiled algorithms move,
  :func:`measure_traffic`, :func:`traffic_table`, :func:`crossover_sram` report it.

The modules, each importing only those above it:

* ``hbm``: the counting machinery (:class:`HBMArray`, :class:`HBMCounter`, :data:`DEFAULT_SRAM`);
* ``blocks``: what every rung shares (input checks, block ranges, the masked score block,
  the ``-inf``-safe statistics);
* ``softmax``, ``attention``, ``flash``: the rungs; each builds on ``blocks`` and ``hbm``, and
  the attention rungs on the online softmax they are derived from;
* ``traffic``: runs the rungs and reports the traffic they were counted to move.

Data arrays are positional; every option (``M``, ``scale``, ``causal``, ``hbm``, ...) is a keyword.
NumPy only; no torch.
"""

from flashattn.reference.attention import (
    one_pass_attention,
    standard_attention,
    standard_block_size,
    two_pass_attention,
)
from flashattn.reference.common import causal_mask
from flashattn.reference.flash import (
    fa1_block_sizes,
    fa2_block_sizes,
    flash_attention_v1,
    flash_attention_v2_backward,
    flash_attention_v2_forward,
)
from flashattn.reference.hbm import DEFAULT_SRAM, HBMArray, HBMCounter, NullCounter
from flashattn.reference.softmax import (
    logsumexp,
    naive_softmax,
    online_softmax,
    safe_softmax,
    three_pass_softmax,
)
from flashattn.reference.traffic import ALGORITHMS, asymptotic_scale, crossover_sram, measure_traffic, traffic_table

__all__ = [
    "ALGORITHMS",
    "DEFAULT_SRAM",
    "HBMArray",
    "HBMCounter",
    "NullCounter",
    "asymptotic_scale",
    "causal_mask",
    "crossover_sram",
    "fa1_block_sizes",
    "fa2_block_sizes",
    "flash_attention_v1",
    "flash_attention_v2_backward",
    "flash_attention_v2_forward",
    "logsumexp",
    "measure_traffic",
    "naive_softmax",
    "one_pass_attention",
    "online_softmax",
    "safe_softmax",
    "standard_attention",
    "standard_block_size",
    "three_pass_softmax",
    "traffic_table",
    "two_pass_attention",
]
