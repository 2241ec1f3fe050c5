"""The ``@triton.jit`` helpers every kernel shares: tile loads, the score tile, the band, dropout, and where a
sequence's queries and keys are.

Naming, in every kernel: pointer arguments are lowercase nouns (``q``, ``lse``, ``block_table``); ``b_*`` are
blocks held in registers, ``p_*`` pointer blocks, ``o_*`` offset vectors and ``m_*`` boolean masks;
``BLOCK_*`` and other constants are ``tl.constexpr``. An optional feature is an argument that may be None
(ALiBi slopes, a mask, the dropout seed, a window side, the softcap, varlen offsets, a block table): None is a
compile-time constant, so ``if x is not None`` costs nothing where the feature is off. (A helper cannot return
None under the compiler, so optional values are derived in the kernels: ``x = f(p) if p is not None else None``.)
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    # 1 - 2 / (e^{2x} + 1): saturates to +-1 for large |x| without overflow (inf -> 1, 0 -> -1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


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
    ``strides`` = (row stride, column stride)."""
    return load_rows(base, o_rows * strides[0], o_rows < shape[0], o_cols, strides[1], shape[1], UPCAST, False)


@triton.jit
def load_tile_t(base, o_rows, o_cols, strides, shape, UPCAST: tl.constexpr):
    """The transpose of ``load_tile``: a (len(cols), len(rows)) tile."""
    return load_rows(base, o_rows * strides[0], o_rows < shape[0], o_cols, strides[1], shape[1], UPCAST, True)


@triton.jit
def dot(a, b):
    """a @ b accumulated in fp32; fp32 operands in IEEE precision (TF32 would cost fp32 inputs 3 digits)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def tile_needs_mask(start_m, start_n, seqlens, band, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """True unless every (i, j) of the tile is inside the sequences (``seqlens`` = (nq, nk)) and inside the band
    (``band`` = (window_left, window_right, diagonal), a side None when unbounded, as ``Band`` orders them)."""
    window_left, window_right, diagonal = band
    need = (start_m + BLOCK_M > seqlens[0]) | (start_n + BLOCK_N > seqlens[1])
    if window_right is not None:
        need = need | ((start_n + BLOCK_N - 1) - start_m - diagonal > window_right)
    if window_left is not None:
        need = need | (start_n - (start_m + BLOCK_M - 1) - diagonal < -window_left)
    return need


@triton.jit
def score_tile(b_q, b_kt, o_m, o_n, starts, seqlens, band, scale, softcap, slope, p_mask, mask_strides):
    """Scores of q (BLOCK_M, D) against k^T (D, BLOCK_N), fp32, -inf where masked: scale, then softcap, then
    ALiBi (``slope`` None without), then the user mask (``p_mask`` None without; a uint8 mask is boolean, True =
    may attend, anything else is added), then the band and the sequence ends, on tiles that straddle them.
    ``starts`` = (first row, first column) of the tile, ``seqlens`` = (nq, nk), ``band`` as in ``tile_needs_mask``.

    Returns (scores, capped): ``capped`` is the softcapped value before ALiBi and the user mask, which the
    backward needs for d tanh (equal to scores when there is no softcap).
    """
    BLOCK_M: tl.constexpr = o_m.shape[0]
    BLOCK_N: tl.constexpr = o_n.shape[0]
    window_left, window_right, diagonal = band
    b_s = dot(b_q, b_kt) * scale
    if softcap is not None:
        b_s = softcap * tanh(b_s / softcap)
    b_capped = b_s
    if slope is not None:
        b_s = b_s - slope * tl.abs(o_m[:, None] + diagonal - o_n[None, :]).to(tl.float32)
    if p_mask is not None:
        p_tile = p_mask + o_m[:, None] * mask_strides[0] + o_n[None, :] * mask_strides[1]
        m_inside = (o_m[:, None] < seqlens[0]) & (o_n[None, :] < seqlens[1])
        if p_mask.dtype.element_ty == tl.uint8:
            b_s = tl.where(tl.load(p_tile, mask=m_inside, other=0) != 0, b_s, float("-inf"))
        else:
            b_s = b_s + tl.load(p_tile, mask=m_inside, other=0.0).to(tl.float32)
    if tile_needs_mask(starts[0], starts[1], seqlens, band, BLOCK_M, BLOCK_N):
        b_d = o_n[None, :] - o_m[:, None] - diagonal
        m_keep = (o_m[:, None] < seqlens[0]) & (o_n[None, :] < seqlens[1])
        if window_right is not None:
            m_keep = m_keep & (b_d <= window_right)
        if window_left is not None:
            m_keep = m_keep & (b_d >= -window_left)
        b_s = tl.where(m_keep, b_s, float("-inf"))
    return b_s, b_capped


@triton.jit
def dropped(b_x, m_keep, dropout_p):
    """``b_x`` where dropout keeps, scaled by 1 / (1 - p), else 0."""
    return tl.where(m_keep, b_x / (1.0 - dropout_p), 0.0)


@triton.jit
def score_grads(b_p, b_dp, b_delta, b_capped, softcap):
    """dS = P * (dP - delta), through the softcap's tanh when there is one: d(c tanh(s / c)) / ds = 1 - tanh^2."""
    b_ds = b_p * (b_dp - b_delta[:, None])
    if softcap is not None:
        b_t = b_capped / softcap
        b_ds = b_ds * (1.0 - b_t * b_t)
    return b_ds


@triton.jit
def dropout_keep(seed, row0, o_m, o_n, seqlens, dropout_p):
    """Keep-mask of the tile: ``tl.rand(seed, (row0 + i) * NK + j)`` >= p, where ``row0`` = (b * H + h) * NQ and
    ``seqlens`` = (NQ, NK) lay out the counters (the maxima for varlen), as ``flashattn.backends.philox`` does."""
    o_row = row0 + o_m.to(tl.int64)
    return tl.rand(seed, o_row[:, None] * seqlens[1] + o_n[None, :].to(tl.int64)) >= dropout_p


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
        o_pos = k0 + o_n
        o_page = tl.load(block_table + kb * stride_bt + o_pos // page_size, mask=m_keys, other=0).to(tl.int64)
        o_row = o_pos % page_size
    else:
        o_page = 0
        o_row = o_n
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
