"""The named bundles the kernels hand their helpers, and the block-mask lists the launcher hands the kernels.

A bundle is a ``typing.NamedTuple`` read by field name. Inside a ``@triton.jit`` function one is built by calling
its class (``Band(window_left, window_right, diagonal)``) and passed to helpers whole; Triton flattens it into its
fields, so a bundle costs nothing at run time, and a field that is None stays a compile-time constant (``if
scoring.b_slope is not None`` is decided when compiling). Unlike a tuple written as ``(a, b)`` in a kernel, a
bundle may hold a None computed there (``tl.load(alibi) if alibi is not None else None``).

Fields follow the kernels' naming (``tiles``): ``b_*`` blocks in registers, ``p_*`` pointers, ``o_*`` offsets,
``m_*`` masks, ``stride_*`` element strides. Only ``BlockLists`` is built on the host (``launch.sparse_blocks``);
the others are built in the kernels. Bundles used by one kernel only live next to it (``forward``, ``backward``).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class BlockLists(NamedTuple):
    """A block mask's tile lists, as the kernels walk them (``tiles.walk_listed``). A row-block is a query block
    listing key blocks (forward, dQ) or a key block listing query blocks (dK/dV); each (batch, head, row-block) lists
    its full blocks (no element mask) and its partial blocks (with one). Broadcast batch or head dims have stride 0;
    the lists' last dim has stride 1."""

    full_counts: Any  # int32 (B, H, row-blocks): how many full blocks each row-block lists
    full_index: Any  # int32 (B, H, row-blocks, blocks): the full blocks' indices first, in order
    partial_counts: Any  # int32, as full_counts: how many partial blocks
    partial_index: Any  # int32, as full_index: the partial blocks' indices first
    partial_ids: Any  # int32 (B, H, query blocks, key blocks): a partial block's tile in partial_masks
    partial_masks: Any  # uint8 (tiles, q_block, kv_block): the partial blocks' element masks, nonzero = may attend
    stride_count_b: Any  # batch, head and row-block strides of full_counts and partial_counts
    stride_count_h: Any
    stride_count_x: Any
    stride_index_b: Any  # batch, head and row-block strides of full_index and partial_index
    stride_index_h: Any
    stride_index_x: Any
    stride_id_b: Any  # batch, head, query-block and key-block strides of partial_ids
    stride_id_h: Any
    stride_id_q: Any
    stride_id_k: Any
    q_block: Any  # queries per mask block
    kv_block: Any  # keys per mask block


class Span(NamedTuple):
    """The query rows or keys [lo, hi) a walk covers."""

    lo: Any
    hi: Any


class Band(NamedTuple):
    """Which keys a query sees: key j is in query i's band when -window_left <= j - i - diagonal <= window_right."""

    window_left: Any  # None: unbounded on the left
    window_right: Any  # None: unbounded on the right (0, with diagonal 0 top-left aligned, is causal)
    diagonal: Any  # key i + diagonal is query i's diagonal: (nk - nq) when bottom-right aligned, plus the offset


class Scoring(NamedTuple):
    """What ``tiles.score_tile`` applies to q.k: scale, softcap, ALiBi, a mask, the band and the end of the keys."""

    nq: Any  # this sequence's queries (a user mask is read only inside nq x nk)
    nk: Any  # this sequence's keys: key tiles are masked from nk on
    band: Any  # Band
    scale: Any  # the softmax scale
    softcap: Any  # None without a softcap
    b_slope: Any  # ALiBi slope of this (batch, head); None without ALiBi
    p_mask: Any  # user mask at this (batch, head), or a partial block's element mask; None without (uint8: boolean)
    stride_mq: Any  # the mask's query stride
    stride_mk: Any  # the mask's key stride


class Dropout(NamedTuple):
    """Where a tile's dropout draws come from: element (row0 + i, j) of the seed's stream (``dropout.dropout_keep``,
    ``flashattn.backends.philox``); p = 0 drops nothing."""

    b_seed: Any  # the Philox seed; None without dropout
    p: Any  # the dropout probability
    row0: Any  # counter row of this head's query 0: (b * H + h) * NQ, NQ the (maximum) query length
    seqlen_k: Any  # NK, counters per query row: the (maximum) key length


class Origin(NamedTuple):
    """Where a tile starts in a TMA descriptor: 32-bit (row, column) coordinates (``tiles.tma_origin``)."""

    row: Any
    column: Any


class Operand(NamedTuple):
    """One tensor's rows of one head, loaded tile by tile with ``tiles.load_block``: through the TMA descriptor
    when there is one, else through pointers."""

    desc: Any  # TMA descriptor; None: pointer loads
    at: Any  # Origin of the head's first row (or of the program's block) in desc; unused without one
    base: Any  # pointer to the head's first row (a paged cache: to the cache's first page, at this head)
    stride_row: Any  # element stride of a row
    stride_col: Any  # element stride of a column (head dim)
    n_cols: Any  # the head dim: columns from it on read 0
    stride_page: Any  # the forward's keys: stride of the page or batch entry ``tiles.key_slots`` finds; else None


class KeySlots(NamedTuple):
    """Where the forward finds a sequence's keys (``tiles.key_slots``): dense, packed or in a KV cache, paged or not."""

    k0: Any  # the sequence's first key: its row in packed keys, its position in a cache
    kb: Any  # the batch entry (cache row) the keys are in
    nk: Any  # the sequence's keys
    block_table: Any  # the paged cache's block table (batch entry, page -> physical page); None when not paged
    entries: Any  # the cache's batch entries (dense) or pages (paged): where ``kb`` and page ids are clamped
    stride_bt: Any  # the block table's row stride
    page_size: Any  # keys per page
    value_rows: Any  # values interleaved for FP8 P (``tiles.fp8_operand_order``): the rows they fill; else None
