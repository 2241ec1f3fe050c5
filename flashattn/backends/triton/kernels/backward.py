"""The FlashAttention-2 backward: a preprocess (delta), dK/dV per key block, dQ per query block.

No atomics: the dK/dV program of a key block sums over the query heads of its GQA group itself, and dQ is its own
pass over the keys, so gradients are bitwise reproducible.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (
    LOG2E,
    dot,
    dot_acc,
    dropout_keep,
    dropped,
    full_key_range,
    full_query_range,
    key_range,
    load_tile,
    load_tile_t,
    program_tile,
    query_range,
    score_grads,
    score_tile,
    sequence,
    tma_origin,
    walk_listed,
)


@triton.jit
def attention_backward_preprocess_kernel(
    out, dout, dlse, delta,
    stride_ob, stride_on, stride_oh, stride_od,
    stride_dob, stride_don, stride_doh, stride_dod,
    num_heads, seqlen_q, head_dim_v,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """delta_i = rowsum(dO_i * O_i) - dlse_i, in fp32 (the dlse term is the gradient of the returned lse; ``dlse``
    None when it has none)."""
    start_m, bh = program_tile(seqlen_q, BLOCK_M, False)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_dv = tl.arange(0, BLOCK_DV)
    shape = (seqlen_q, head_dim_v)
    b_o = load_tile(out + b * stride_ob + h * stride_oh, o_m, o_dv, (stride_on, stride_od), shape, True)
    b_do = load_tile(dout + b * stride_dob + h * stride_doh, o_m, o_dv, (stride_don, stride_dod), shape, True)
    b_delta = tl.sum(b_o * b_do, 1)
    o_rows = bh.to(tl.int64) * seqlen_q + o_m
    if dlse is not None:
        b_delta = b_delta - tl.load(dlse + o_rows, mask=o_m < seqlen_q, other=0.0).to(tl.float32)
    tl.store(delta + o_rows, b_delta, mask=o_m < seqlen_q)


@triton.jit
def _key_grads(b_k, b_v, grads, o_n, span, queries, descriptors, scoring, b_slope, p_mask, b_seed, dropout,
               BLOCK_M: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr, PLAIN: tl.constexpr):
    """dK and dV of one key block (``grads`` = (dk, dv) in, updated out) over the query tiles in ``span``, on the
    transposed tile S^T = K Q^T (BLOCK_N keys x BLOCK_M queries), so all four matmuls have the key block as their
    M dimension: wgmma-sized with 64 or more keys.

    ``queries`` = (q, dO pointers at this head, their (row, dim) strides, lse, delta at this head's rows, nq, head
    dims); ``descriptors`` = (q, dO TMA descriptors, None for pointer loads, and the (row, column) of this head's
    first query in each); the others as in the forward's ``_attend``.
    """
    b_dk, b_dv = grads
    p_q, p_do, q_strides, do_strides, p_lse, p_delta, nq, head_dims = queries
    q_desc, do_desc, q_at, do_at = descriptors
    seqlens, band, scale, softcap, mask_strides = scoring
    counter_row0, layout, dropout_p = dropout
    s_scale = scale * LOG2E if PLAIN else 1.0
    o_d = tl.arange(0, b_k.shape[1])
    o_dv = tl.arange(0, b_v.shape[1])
    for start_m in range(span[0], span[1], BLOCK_M):
        o_m = start_m + tl.arange(0, BLOCK_M)
        # With a descriptor, rows past the sequence read another's queries: their lse is +inf, so P = 0.
        if q_desc is not None:
            b_qt = tl.trans(q_desc.load([q_at[0] + start_m, q_at[1]]))
            b_qt = b_qt.to(tl.float32) if UPCAST else b_qt
        else:
            b_qt = load_tile_t(p_q, o_m, o_d, q_strides, (nq, head_dims[0]), UPCAST)
        if do_desc is not None:
            b_do = do_desc.load([do_at[0] + start_m, do_at[1]])
            b_do = b_do.to(tl.float32) if UPCAST else b_do
        else:
            b_do = load_tile(p_do, o_m, o_dv, do_strides, (nq, head_dims[1]), UPCAST)
        # Rows past the sequence or that see no key have lse = -inf: read +inf, so their P is 0.
        b_lse = tl.load(p_lse + o_m, mask=o_m < nq, other=float("inf"))
        b_lse2 = tl.where(b_lse == float("-inf"), float("inf"), b_lse) * LOG2E
        b_delta = tl.load(p_delta + o_m, mask=o_m < nq, other=0.0)
        b_st, b_tt = score_tile(b_k, b_qt, o_m, o_n, seqlens, band, scale, softcap, b_slope, p_mask, mask_strides,
                                MASKED, PLAIN, True)
        b_pt = tl.math.exp2(b_st * s_scale - b_lse2[None, :])
        b_dpt = dot(b_v, tl.trans(b_do))
        b_pt_kept = b_pt
        if b_seed is not None:
            m_keep = dropout_keep(b_seed, counter_row0, o_m[None, :], o_n[:, None], layout, dropout_p)
            b_pt_kept = dropped(b_pt, m_keep, dropout_p)
            b_dpt = dropped(b_dpt, m_keep, dropout_p)
        b_dst = score_grads(b_pt, b_dpt, b_delta[None, :], b_tt, softcap)
        b_dv = dot_acc(b_pt_kept.to(b_do.dtype), b_do, b_dv)
        b_dk = dot_acc(b_dst.to(b_qt.dtype), tl.trans(b_qt), b_dk)
    return b_dk, b_dv


@triton.jit
def _key_grads_span(grads, args, span, scoring, b_slope, p_mask, b_seed, BLOCK_M: tl.constexpr,
                    UPCAST: tl.constexpr, PLAIN: tl.constexpr):
    """``_key_grads`` over one listed query block (``walk_listed``'s visit)."""
    b_k, b_v, o_n, queries, descriptors, dropout = args
    return _key_grads(b_k, b_v, grads, o_n, span, queries, descriptors, scoring, b_slope, p_mask, b_seed, dropout,
                      BLOCK_M, UPCAST, True, PLAIN)


@triton.jit
def attention_backward_dkdv_kernel(
    q, k, v, dout, lse, delta, dk, dv, alibi, mask, seed, blocks, cu_seqlens_q, cu_seqlens_k,
    q_desc, q_tma, k_desc, k_tma, v_desc, v_tma, do_desc, do_tma,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_don, stride_doh, stride_dod,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    stride_lb, stride_lh,
    stride_ab, stride_ah,
    stride_mb, stride_mh, stride_mq, stride_mk,
    num_heads, num_heads_k, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v,
    bottom_right, diagonal_offset, window_left, window_right, scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, PLAIN: tl.constexpr,
):
    """dK_j, dV_j for one key block of one key/value head, summed over the G query heads of its group inside
    the program (no atomics, so the result is deterministic). The query tiles that see the whole key block run
    without mask code; those on the band's edges apply it."""
    start_n, bhk = program_tile(seqlen_k, BLOCK_N, False)  # the first key blocks see the most queries (causal)
    b = (bhk // num_heads_k).to(tl.int64)
    hk = (bhk % num_heads_k).to(tl.int64)
    q0, nq, k0, nk = sequence(b, cu_seqlens_q, cu_seqlens_k, None, (seqlen_q, seqlen_k))
    band = (window_left, window_right, (nk - nq) * bottom_right + diagonal_offset)
    o_n = start_n + tl.arange(0, BLOCK_N)
    o_d, o_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    if k_desc is not None:
        b_k = k_desc.load(tma_origin(k_tma, b, hk, k0 + start_n))
        b_k = b_k.to(tl.float32) if UPCAST else b_k
    else:
        b_k = load_tile(k + b * stride_kb + k0 * stride_kn + hk * stride_kh, o_n, o_d, (stride_kn, stride_kd),
                        (nk, head_dim), UPCAST)
    if v_desc is not None:
        b_v = v_desc.load(tma_origin(v_tma, b, hk, k0 + start_n))
        b_v = b_v.to(tl.float32) if UPCAST else b_v
    else:
        b_v = load_tile(v + b * stride_vb + k0 * stride_vn + hk * stride_vh, o_n, o_dv, (stride_vn, stride_vd),
                        (nk, head_dim_v), UPCAST)
    b_seed = tl.load(seed) if seed is not None else None
    grads = (tl.zeros([BLOCK_N, BLOCK_D], tl.float32), tl.zeros([BLOCK_N, BLOCK_DV], tl.float32))
    lo, hi = query_range(start_n, nq, band, BLOCK_M, BLOCK_N)
    hi = tl.where(start_n < nk, hi, 0)  # a varlen program past its sequence's keys has nothing to do
    full_lo, full_hi = full_query_range(start_n, nq, nk, band, BLOCK_M, BLOCK_N)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    for g in range(0, group_size):
        h = hk * group_size + g
        o_stats = b * stride_lb + h * stride_lh + q0  # lse and delta of this head's queries
        queries = (q + b * stride_qb + q0 * stride_qn + h * stride_qh,
                   dout + b * stride_dob + q0 * stride_don + h * stride_doh,
                   (stride_qn, stride_qd), (stride_don, stride_dod), lse + o_stats, delta + o_stats, nq,
                   (head_dim, head_dim_v))
        descriptors = (q_desc, do_desc,
                       tma_origin(q_tma, b, h, q0), tma_origin(do_tma, b, h, q0))
        b_slope = tl.load(alibi + b * stride_ab + h * stride_ah) if alibi is not None else None
        p_mask = mask + b * stride_mb + h * stride_mh if mask is not None else None
        scoring = ((nq, nk), band, scale, softcap, (stride_mq, stride_mk))
        dropout = ((b * num_heads + h) * seqlen_q, (seqlen_q, seqlen_k), dropout_p)
        if blocks is not None:  # a block mask (BLOCK_N divides its key block): its listed query blocks only
            grads = walk_listed(_key_grads_span, grads, (b_k, b_v, o_n, queries, descriptors, dropout), b_slope,
                                b_seed, (lo, hi), start_n // blocks[9][1], (b, h), blocks, scoring, True, BLOCK_M,
                                UPCAST, PLAIN)
        else:
            grads = _key_grads(b_k, b_v, grads, o_n, (lo, full_lo), queries, descriptors, scoring, b_slope, p_mask,
                               b_seed, dropout, BLOCK_M, UPCAST, True, PLAIN)
            grads = _key_grads(b_k, b_v, grads, o_n, (full_lo, full_hi), queries, descriptors, scoring, b_slope,
                               p_mask, b_seed, dropout, BLOCK_M, UPCAST, False, PLAIN)
            grads = _key_grads(b_k, b_v, grads, o_n, (full_hi, hi), queries, descriptors, scoring, b_slope, p_mask,
                               b_seed, dropout, BLOCK_M, UPCAST, True, PLAIN)
    b_dk, b_dv = grads
    b_dk = b_dk * scale
    o_rows = k0 + o_n[:, None].to(tl.int64)
    m_rows = o_n[:, None] < nk
    tl.store(dk + b * stride_dkb + o_rows * stride_dkn + hk * stride_dkh + o_d[None, :] * stride_dkd,
             b_dk.to(dk.dtype.element_ty), mask=m_rows & (o_d[None, :] < head_dim))
    tl.store(dv + b * stride_dvb + o_rows * stride_dvn + hk * stride_dvh + o_dv[None, :] * stride_dvd,
             b_dv.to(dv.dtype.element_ty), mask=m_rows & (o_dv[None, :] < head_dim_v))


@triton.jit
def _query_grads(b_q, b_do, b_dq, o_m, span, stats, keys, descriptors, scoring, b_slope, p_mask, b_seed, dropout,
                 BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr, PLAIN: tl.constexpr):
    """dQ of one query block (``b_dq`` in, updated out) over the key tiles in ``span``; ``stats`` = (lse in log2
    units, delta) of its rows, ``keys`` = (k, v pointers at this head, their (row, dim) strides, nk, head dims),
    ``descriptors`` = (k, v TMA descriptors or None, and the (row, column) of this head's first key in each)."""
    b_lse2, b_delta = stats
    p_k, p_v, k_strides, v_strides, nk, head_dims = keys
    k_desc, v_desc, k_at, v_at = descriptors
    seqlens, band, scale, softcap, mask_strides = scoring
    counter_row0, layout, dropout_p = dropout
    s_scale = scale * LOG2E if PLAIN else 1.0
    o_d = tl.arange(0, b_q.shape[1])
    o_dv = tl.arange(0, b_do.shape[1])
    for start_n in range(span[0], span[1], BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        # With a descriptor, rows past the keys hold another sequence's: they are masked (P = 0).
        if k_desc is not None:
            b_kt = tl.trans(k_desc.load([k_at[0] + start_n, k_at[1]]))
            b_kt = b_kt.to(tl.float32) if UPCAST else b_kt
        else:
            b_kt = load_tile_t(p_k, o_n, o_d, k_strides, (nk, head_dims[0]), UPCAST)
        if v_desc is not None:
            b_vt = tl.trans(v_desc.load([v_at[0] + start_n, v_at[1]]))
            b_vt = b_vt.to(tl.float32) if UPCAST else b_vt
        else:
            b_vt = load_tile_t(p_v, o_n, o_dv, v_strides, (nk, head_dims[1]), UPCAST)
        b_s, b_t = score_tile(b_q, b_kt, o_m, o_n, seqlens, band, scale, softcap, b_slope, p_mask, mask_strides,
                              MASKED, PLAIN)
        b_p = tl.math.exp2(b_s * s_scale - b_lse2[:, None])
        b_dp = dot(b_do, b_vt)
        if b_seed is not None:
            b_dp = dropped(b_dp, dropout_keep(b_seed, counter_row0, o_m[:, None], o_n[None, :], layout, dropout_p),
                           dropout_p)
        b_ds = score_grads(b_p, b_dp, b_delta[:, None], b_t, softcap)
        b_dq = dot_acc(b_ds.to(b_kt.dtype), tl.trans(b_kt), b_dq)
    return b_dq


@triton.jit
def _query_grads_span(b_dq, args, span, scoring, b_slope, p_mask, b_seed, BLOCK_N: tl.constexpr,
                      UPCAST: tl.constexpr, PLAIN: tl.constexpr):
    """``_query_grads`` over one listed key block (``walk_listed``'s visit)."""
    b_q, b_do, o_m, stats, keys, descriptors, dropout = args
    return _query_grads(b_q, b_do, b_dq, o_m, span, stats, keys, descriptors, scoring, b_slope, p_mask, b_seed,
                        dropout, BLOCK_N, UPCAST, True, PLAIN)


@triton.jit
def attention_backward_dq_kernel(
    q, k, v, dout, lse, delta, dq, alibi, mask, seed, blocks, cu_seqlens_q, cu_seqlens_k,
    q_desc, q_tma, k_desc, k_tma, v_desc, v_tma, do_desc, do_tma,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_don, stride_doh, stride_dod,
    stride_dqb, stride_dqn, stride_dqh, stride_dqd,
    stride_lb, stride_lh,
    stride_ab, stride_ah,
    stride_mb, stride_mh, stride_mq, stride_mk,
    num_heads, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v,
    bottom_right, diagonal_offset, window_left, window_right, scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, PLAIN: tl.constexpr,
):
    """dQ_i for one query block of one head: its own pass over the keys, so dQ needs no atomics. The key tiles
    the whole query block sees run without mask code, as in the forward."""
    start_m, bh = program_tile(seqlen_q, BLOCK_M, True)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    hk = h // group_size
    q0, nq, k0, nk = sequence(b, cu_seqlens_q, cu_seqlens_k, None, (seqlen_q, seqlen_k))
    band = (window_left, window_right, (nk - nq) * bottom_right + diagonal_offset)
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d, o_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    if q_desc is not None:
        b_q = q_desc.load(tma_origin(q_tma, b, h, q0 + start_m))
        b_q = b_q.to(tl.float32) if UPCAST else b_q
    else:
        b_q = load_tile(q + b * stride_qb + q0 * stride_qn + h * stride_qh, o_m, o_d, (stride_qn, stride_qd),
                        (nq, head_dim), UPCAST)
    if do_desc is not None:
        b_do = do_desc.load(tma_origin(do_tma, b, h, q0 + start_m))
        b_do = b_do.to(tl.float32) if UPCAST else b_do
    else:
        b_do = load_tile(dout + b * stride_dob + q0 * stride_don + h * stride_doh, o_m, o_dv,
                         (stride_don, stride_dod), (nq, head_dim_v), UPCAST)
    o_stats = b * stride_lb + h * stride_lh + q0
    b_lse = tl.load(lse + o_stats + o_m, mask=o_m < nq, other=float("inf"))
    b_lse2 = tl.where(b_lse == float("-inf"), float("inf"), b_lse) * LOG2E
    b_delta = tl.load(delta + o_stats + o_m, mask=o_m < nq, other=0.0)
    b_slope = tl.load(alibi + b * stride_ab + h * stride_ah) if alibi is not None else None
    p_mask = mask + b * stride_mb + h * stride_mh if mask is not None else None
    b_seed = tl.load(seed) if seed is not None else None
    keys = (k + b * stride_kb + k0 * stride_kn + hk * stride_kh, v + b * stride_vb + k0 * stride_vn + hk * stride_vh,
            (stride_kn, stride_kd), (stride_vn, stride_vd), nk, (head_dim, head_dim_v))
    scoring = ((nq, nk), band, scale, softcap, (stride_mq, stride_mk))
    dropout = (bh.to(tl.int64) * seqlen_q, (seqlen_q, seqlen_k), dropout_p)
    descriptors = (k_desc, v_desc, tma_origin(k_tma, b, hk, k0), tma_origin(v_tma, b, hk, k0))
    lo, hi = key_range(start_m, nk, band, BLOCK_M, BLOCK_N)
    hi = tl.where(start_m < nq, hi, 0)
    full_lo, full_hi = full_key_range(start_m, nk, band, BLOCK_M, BLOCK_N)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    stats = (b_lse2, b_delta)
    if blocks is not None:  # a block mask: its listed key blocks only, as in the forward
        b_dq = walk_listed(_query_grads_span, b_dq, (b_q, b_do, o_m, stats, keys, descriptors, dropout), b_slope,
                           b_seed, (lo, hi), start_m // blocks[9][0], (b, h), blocks, scoring, False, BLOCK_N, UPCAST,
                           PLAIN)
    else:
        if window_left is not None:
            b_dq = _query_grads(b_q, b_do, b_dq, o_m, (lo, full_lo), stats, keys, descriptors, scoring, b_slope,
                                p_mask, b_seed, dropout, BLOCK_N, UPCAST, True, PLAIN)
        else:
            full_lo = lo
        b_dq = _query_grads(b_q, b_do, b_dq, o_m, (full_lo, full_hi), stats, keys, descriptors, scoring, b_slope,
                            p_mask, b_seed, dropout, BLOCK_N, UPCAST, False, PLAIN)
        b_dq = _query_grads(b_q, b_do, b_dq, o_m, (full_hi, hi), stats, keys, descriptors, scoring, b_slope, p_mask,
                            b_seed, dropout, BLOCK_N, UPCAST, True, PLAIN)
    b_dq = b_dq * scale
    o_rows = q0 + o_m[:, None].to(tl.int64)
    tl.store(dq + b * stride_dqb + o_rows * stride_dqn + h * stride_dqh + o_d[None, :] * stride_dqd,
             b_dq.to(dq.dtype.element_ty), mask=(o_m[:, None] < nq) & (o_d[None, :] < head_dim))
