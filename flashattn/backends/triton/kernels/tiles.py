"""The ``@triton.jit`` helpers every kernel shares: tile loads, the score tile, the band, dropout, and where a
sequence's queries and keys are.

Naming, in every kernel: pointer arguments are lowercase nouns (``q``, ``lse``, ``block_table``); ``b_*`` are
blocks held in registers, ``p_*`` pointer blocks, ``o_*`` offset vectors and ``m_*`` boolean masks;
``BLOCK_*`` and other constants are ``tl.constexpr``. An optional feature is an argument that may be None
(ALiBi slopes, a mask, the dropout seed, a window side, the softcap, varlen offsets, a block table): None is a
compile-time constant, so ``if x is not None`` costs nothing where the feature is off. Under the compiler a helper
cannot return None and a tuple cannot hold a None computed in the kernel (only an argument's own), so optional
values derived in a kernel (the ALiBi slope, the mask pointer, the dropout seed) are passed to helpers as
arguments of their own, never inside a tuple.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # scores are kept in log2 units, so exp is one MUFU.EX2: e^x = 2^(x log2 e)


@triton.jit
def fast_div(x, y):
    """x / y to 2 ulp (div.full.f32). IEEE division branches to a slow-path subroutine for extreme operands, and
    the call costs every kernel that divides a stack frame and registers saved around it."""
    return tl.math.fdiv(x, y)


@triton.jit
def tanh(x):
    # 1 - 2 / (e^{2x} + 1): saturates to +-1 for large |x| without overflow (inf -> 1, 0 -> -1).
    return 1.0 - fast_div(2.0, tl.math.exp2((2.0 * LOG2E) * x) + 1.0)


@triton.jit
def load_rows(base, o_rows, m_rows, o_cols, stride_col, n_cols, UPCAST: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Rows at ``base + o_rows`` (0 where not ``m_rows``), columns ``o_cols`` (0 past ``n_cols``): a
    (len(rows), len(cols)) tile, or its transpose (as K^T and V^T are used in matmuls)."""
    if TRANSPOSE:
        b_x = tl.load(base + o_rows[None, :] + o_cols[:, None] * stride_col,
                      mask=m_rows[None, :] & (o_cols[:, None] < n_cols), other=0.0)
    else:
        b_x = tl.load(base + o_rows[:, None] + o_cols[None, :] * stride_col,
                      mask=m_rows[:, None] & (o_cols[None, :] < n_cols), other=0.0)
    if UPCAST:
        b_x = b_x.to(tl.float32)
    return b_x


@triton.jit
def load_tile(base, o_rows, o_cols, strides, shape, UPCAST: tl.constexpr):
    """``base[rows, cols]`` as a (len(rows), len(cols)) tile, 0 outside [0, shape[0]) x [0, shape[1]);
    ``strides`` = (row stride, column stride). Row offsets are 64-bit: row x stride passes 2^31 on long
    sequences (256k tokens x 64 heads x 128)."""
    return load_rows(base, o_rows.to(tl.int64) * strides[0], o_rows < shape[0], o_cols, strides[1], shape[1],
                     UPCAST, False)


@triton.jit
def load_tile_t(base, o_rows, o_cols, strides, shape, UPCAST: tl.constexpr):
    """The transpose of ``load_tile``: a (len(cols), len(rows)) tile."""
    return load_rows(base, o_rows.to(tl.int64) * strides[0], o_rows < shape[0], o_cols, strides[1], shape[1],
                     UPCAST, True)


@triton.jit
def tma_origin(at, b, h, row):
    """(row, column) of row ``row`` of (batch ``b``, head ``h``) in a TMA descriptor whose ``at`` = (rows per
    batch, rows per head, columns per head), as ``flashattn.backends.triton.tma`` lays tensors out. TMA coordinates
    are 32-bit: the host refuses a descriptor whose rows would not fit."""
    return (b * at[0] + h * at[1] + row).to(tl.int32), (h * at[2]).to(tl.int32)


@triton.jit
def program_tile(n, BLOCK: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    """(first row of this program's tile, its batch x head index) on a flat grid of cdiv(n, BLOCK) tiles
    per batch x head, all on axis 0 (axes 1 and 2 stop at 65535 programs; axis 0 at 2^31 - 1). A head's tiles are
    neighbours, so the programs running together share its K/V in L2. ``LONGEST_FIRST`` walks a head's tiles from
    the last, which under a causal mask sees the most keys: the longest programs start first and the short ones
    fill the tail of the launch."""
    tiles = tl.cdiv(n, BLOCK)
    pid = tl.program_id(0)
    tile = pid % tiles
    if LONGEST_FIRST:
        tile = tiles - 1 - tile
    return tile * BLOCK, pid // tiles


@triton.jit
def dot(a, b):
    """a @ b accumulated in fp32; fp32 operands in IEEE precision (TF32 would cost fp32 inputs 3 digits)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def dot_acc(a, b, acc):
    """acc + a @ b, accumulated in place (one wgmma chain, no separate add); fp32 operands in IEEE precision."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def band_mask(i, j, nk, band):
    """True where key ``j`` exists (< nk) and is inside the band for query ``i`` (``band`` = (window_left,
    window_right, diagonal), a side None when unbounded, as ``Band`` orders them). ``i`` and ``j`` broadcast to the
    tile: (rows, 1) and (1, cols), or the other way round for a transposed tile. Rows past the sequence need no
    mask: nothing reads their results."""
    window_left, window_right, diagonal = band
    m_keep = j < nk
    b_d = j - i - diagonal
    if window_right is not None:
        m_keep = m_keep & (b_d <= window_right)
    if window_left is not None:
        m_keep = m_keep & (b_d >= -window_left)
    return m_keep


@triton.jit
def score_tile(b_a, b_b, o_m, o_n, seqlens, band, scale, softcap, slope, p_mask, mask_strides,
               MASKED: tl.constexpr, PLAIN: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """Scores of q (BLOCK_M, D) against k^T (D, BLOCK_N), or with ``TRANSPOSED`` of k (BLOCK_N, D) against q^T
    (D, BLOCK_M) (S^T, as the dK/dV pass wants it), in log2 units (S log2 e), fp32, -inf where masked: scale, then
    softcap, then ALiBi (``slope`` None without), then the user mask (``p_mask`` None without; a uint8 mask is
    boolean, True = may attend, anything else is added), then, on ``MASKED`` tiles, the band and the end of the
    keys (``seqlens`` = (nq, nk)). ``o_m``/``o_n`` are the tile's query and key indices.

    ``PLAIN`` (no softcap, ALiBi or user mask, and a positive scale): the raw q.k is returned unscaled, so the
    caller folds the scale into the exponent's one FFMA: 2^(s * scale log2 e - m).

    Returns (scores, t): ``t`` = tanh(S / softcap), which the softcap's gradient needs (the scores themselves
    without softcap: a helper cannot return None under the compiler).
    """
    i = o_m[None, :] if TRANSPOSED else o_m[:, None]
    j = o_n[:, None] if TRANSPOSED else o_n[None, :]
    b_s = dot(b_a, b_b)
    b_t = b_s
    if not PLAIN:
        if softcap is not None:
            b_t = tanh(b_s * fast_div(scale, softcap))
            b_s = b_t * (softcap * LOG2E)
        else:
            b_s = b_s * (scale * LOG2E)
        if slope is not None:
            b_s = b_s - (slope * LOG2E) * tl.abs(i + band[2] - j).to(tl.float32)
        if p_mask is not None:
            m_inside = (i < seqlens[0]) & (j < seqlens[1])
            p_tile = p_mask + i.to(tl.int64) * mask_strides[0] + j.to(tl.int64) * mask_strides[1]
            if p_mask.dtype.element_ty == tl.uint8:
                b_s = tl.where(tl.load(p_tile, mask=m_inside, other=0) != 0, b_s, float("-inf"))
            else:
                b_s = b_s + tl.load(p_tile, mask=m_inside, other=0.0).to(tl.float32) * LOG2E
    if MASKED:
        b_s = tl.where(band_mask(i, j, seqlens[1], band), b_s, float("-inf"))
    return b_s, b_t


@triton.jit
def dropped(b_x, m_keep, dropout_p):
    """``b_x`` where dropout keeps, scaled by 1 / (1 - p), else 0."""
    return tl.where(m_keep, b_x * fast_div(1.0, 1.0 - dropout_p), 0.0)


@triton.jit
def score_grads(b_p, b_dp, b_delta, b_t, softcap):
    """dS = P * (dP - delta), through the softcap's tanh when there is one (``b_t`` = tanh(S / softcap) from
    ``score_tile``): d(c tanh(s / c)) / ds = 1 - tanh^2. ``b_delta`` is broadcast to the tile already."""
    b_ds = b_p * (b_dp - b_delta)
    if softcap is not None:
        b_ds = b_ds * (1.0 - b_t * b_t)
    return b_ds


@triton.jit
def dropout_keep(seed, row0, i, j, seqlens, dropout_p):
    """Keep-mask of the tile: ``tl.rand(seed, (row0 + i) * NK + j)`` >= p, where ``row0`` = (b * H + h) * NQ and
    ``seqlens`` = (NQ, NK) lay out the counters (the maxima for varlen), as ``flashattn.backends.philox`` does.
    ``i`` and ``j`` broadcast to the tile, as in ``band_mask``."""
    return tl.rand(seed, (row0 + i.to(tl.int64)) * seqlens[1] + j.to(tl.int64)) >= dropout_p


@triton.jit
def sequence(b, cu_seqlens_q, cu_seqlens_k, k_bounds, seqlens):
    """(q start, q length, k start, k length) of batch entry ``b``.

    Queries: rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of a packed (varlen) q, else all NQ = seqlens[0] rows of
    entry b. Keys: rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of packed (varlen) keys, or positions
    ``k_start[b]:k_end[b]`` of a KV cache (``k_bounds`` = (k_start, k_end), None without a cache), else all
    NK = seqlens[1]. Starts are int64 so that start * stride cannot overflow on long packed batches.
    """
    q0 = 0
    nq = seqlens[0]
    k0 = 0
    nk = seqlens[1]
    if cu_seqlens_q is not None:
        q0 = tl.load(cu_seqlens_q + b).to(tl.int64)
        nq = tl.load(cu_seqlens_q + b + 1) - tl.load(cu_seqlens_q + b)
    if cu_seqlens_k is not None:
        k0 = tl.load(cu_seqlens_k + b).to(tl.int64)
        nk = tl.load(cu_seqlens_k + b + 1) - tl.load(cu_seqlens_k + b)
    if k_bounds is not None:
        k_start, k_end = k_bounds
        k0 = tl.load(k_start + b).to(tl.int64)
        nk = tl.load(k_end + b) - tl.load(k_start + b)
    return q0, nq, k0, nk


@triton.jit
def key_slots(o_n, nk, k0, kb, block_table, stride_bt, page_size):
    """Where logical keys ``o_n`` (cache positions k0 + o_n) live, as (page, row, exists): the memory offset of a
    key is ``page * stride_page + row * stride_row``.

    Dense (``block_table`` None): page 0 and row o_n, from a base that already points at row k0 of the batch
    entry. Paged: row ``p % page_size`` of page ``block_table[kb, p // page_size]``, from the cache's start.
    """
    m_keys = o_n < nk
    if block_table is not None:
        o_pos = (k0 + o_n).to(tl.int32)  # cache positions fit; a 64-bit division would be a subroutine call
        o_page = tl.load(block_table + kb * stride_bt + o_pos // page_size, mask=m_keys, other=0).to(tl.int64)
        o_row = (o_pos % page_size).to(tl.int64)  # row x stride stays 64-bit like every address term
    else:
        o_page = 0
        o_row = o_n.to(tl.int64)  # row x stride passes 2^31 on long sequences
    return o_page, o_row, m_keys


@triton.jit
def key_range(start_m, nk, band, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi) of keys any row of the query block may see, lo aligned to BLOCK_N: skips hidden key blocks."""
    window_left, window_right, diagonal = band
    lo = 0
    hi = nk
    if window_left is not None:
        lo = tl.maximum(start_m + diagonal - window_left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if window_right is not None:
        hi = tl.minimum(start_m + BLOCK_M - 1 + diagonal + window_right + 1, nk)
    return lo, hi


@triton.jit
def full_key_range(start_m, nk, band, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi), aligned to BLOCK_N, of the key blocks that every row of the query block sees whole: no band, no
    end of the keys, so they need no mask (hi < lo when there are none)."""
    window_left, window_right, diagonal = band
    lo = 0
    hi = (nk // BLOCK_N) * BLOCK_N
    if window_right is not None:  # row start_m sees the fewest keys on the right: up to start_m + diagonal + right
        hi = tl.minimum(hi, (tl.maximum(start_m + diagonal + window_right + 1, 0) // BLOCK_N) * BLOCK_N)
    if window_left is not None:  # the last row sees the fewest on the left: from start_m + BLOCK_M - 1 + diag - left
        lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + diagonal - window_left, 0), BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def full_query_range(start_n, nq, nk, band, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi), aligned to BLOCK_M, of the query blocks that see the whole key block [start_n, start_n +
    BLOCK_N): no mask needed (none when the key block runs past the keys' end; hi < lo when there are none)."""
    window_left, window_right, diagonal = band
    lo = 0
    hi = tl.where(start_n + BLOCK_N <= nk, tl.cdiv(nq, BLOCK_M) * BLOCK_M, 0)
    if window_right is not None:  # query i sees key j iff i >= j - diagonal - right: the last key is the bound
        lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diagonal - window_right, 0), BLOCK_M) * BLOCK_M
    if window_left is not None:  # and i <= j - diagonal + left: the first key is the bound
        hi = tl.minimum(hi, (tl.maximum(start_n - diagonal + window_left + 1, 0) // BLOCK_M) * BLOCK_M)
    return lo, hi


@triton.jit
def query_range(start_n, nq, band, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi) of queries that may see any key of the key block, lo aligned to BLOCK_M."""
    window_left, window_right, diagonal = band
    lo = 0
    hi = nq
    if window_right is not None:
        lo = tl.maximum(start_n - diagonal - window_right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if window_left is not None:
        hi = tl.minimum(start_n + BLOCK_N - 1 - diagonal + window_left + 1, nq)
    return lo, hi


@triton.jit
def sparse_lists(blocks, b, h, x):
    """A block mask's lists for row-block ``x`` of (batch b, head h): (full count, pointer to the full blocks'
    indices, partial count, pointer to the partial blocks' indices). ``blocks`` = (full counts, full indices,
    partial counts, partial indices, partial ids, partial masks, count strides (b, h, x), index strides (b, h, x),
    id strides (b, h, query block, key block), (query block, key block) sizes); a row-block is a query block for
    the forward and dQ (listing key blocks) and a key block for dK/dV (listing query blocks)."""
    counts_full, index_full, counts_part, index_part = blocks[0], blocks[1], blocks[2], blocks[3]
    sc, si = blocks[6], blocks[7]
    at_count = b * sc[0] + h * sc[1] + x * sc[2]
    at_index = b * si[0] + h * si[1] + x * si[2]
    return (tl.load(counts_full + at_count), index_full + at_index, tl.load(counts_part + at_count),
            index_part + at_index)


@triton.jit
def partial_tile(blocks, b, h, qi, kj):
    """The element mask of partial block (qi, kj) of (b, h) as ``score_tile`` reads a user mask: a uint8 pointer
    that ``+ i * kv_block + j`` takes to the element of query i, key j (strides (kv_block, 1))."""
    ids, masks, sp, sizes = blocks[4], blocks[5], blocks[8], blocks[9]
    tile = tl.load(ids + b * sp[0] + h * sp[1] + qi * sp[2] + kj * sp[3]).to(tl.int64)
    return masks + (tile * sizes[0] - qi * sizes[0]) * sizes[1] - kj * sizes[1]


@triton.jit
def listed_span(p_list, t, size, span):
    """Entry t of a block list: (the block's index, the rows or keys [lo, hi) it covers, clipped to ``span``)."""
    x = tl.load(p_list + t)
    return x, (tl.maximum(x * size, span[0]), tl.minimum(x * size + size, span[1]))


@triton.jit
def walk_listed(visit: tl.constexpr, carry, args, b_slope, b_seed, span, x, bh, blocks, scoring,
                BY_KEYS: tl.constexpr, BLOCK: tl.constexpr, UPCAST: tl.constexpr, PLAIN: tl.constexpr):
    """``visit`` over the blocks a block mask lists for row-block ``x`` of (batch, head) ``bh``, each clipped to
    ``span`` (the band): full blocks with no element mask, partial ones with theirs (and general scoring); empty
    blocks are never visited. ``BY_KEYS``: x is a key block listing query blocks (dK/dV), else a query block
    listing key blocks. ``visit(carry, args, span, scoring, b_slope, p_mask, b_seed, BLOCK, UPCAST, PLAIN)``
    returns the new carry; the slope, mask and seed come apart from ``args`` (a tuple cannot hold a derived None)."""
    b, h = bh
    n_full, p_full, n_part, p_part = sparse_lists(blocks, b, h, x)
    size = blocks[9][0] if BY_KEYS else blocks[9][1]
    seqlens, band, scale, softcap, _ = scoring
    for t in range(0, n_full):
        piece = listed_span(p_full, t, size, span)[1]
        carry = visit(carry, args, piece, scoring, b_slope, None, b_seed, BLOCK, UPCAST, PLAIN)
    tile_scoring = (seqlens, band, scale, softcap, (blocks[9][1], 1))
    for t in range(0, n_part):
        y, piece = listed_span(p_part, t, size, span)
        p_mask = partial_tile(blocks, b, h, y, x) if BY_KEYS else partial_tile(blocks, b, h, x, y)
        carry = visit(carry, args, piece, tile_scoring, b_slope, p_mask, b_seed, BLOCK, UPCAST, False)
    return carry
