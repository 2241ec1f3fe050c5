"""The FlashAttention-2 backward: a preprocess (delta), dK/dV per key block, dQ per query block.

No atomics: the dK/dV program of a key block sums over the query heads of its GQA group itself, and dQ is its own
pass over the keys, so gradients are bitwise reproducible.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (
    dot,
    dropout_keep,
    dropped,
    key_range,
    load_tile,
    load_tile_t,
    query_range,
    score_grads,
    score_tile,
    sequence,
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
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = bh % num_heads
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
def attention_backward_dkdv_kernel(
    q, k, v, dout, lse, delta, dk, dv, alibi, mask, seed, cu_seqlens_q, cu_seqlens_k,
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
    UPCAST: tl.constexpr,
):
    """dK_j, dV_j for one key block of one key/value head, summed over the G query heads of its group inside
    the program (no atomics, so the result is deterministic)."""
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    b = (bhk // num_heads_k).to(tl.int64)
    hk = bhk % num_heads_k
    q0, nq, k0, nk = sequence(b, cu_seqlens_q, cu_seqlens_k, None, (seqlen_q, seqlen_k))
    band = (window_left, window_right, (nk - nq) * bottom_right + diagonal_offset)
    o_n = start_n + tl.arange(0, BLOCK_N)
    o_m0 = tl.arange(0, BLOCK_M)
    o_d, o_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    # k^T (D, BLOCK_N) for the score tile, v^T (DV, BLOCK_N) for dP = dO V^T.
    b_kt = load_tile_t(k + b * stride_kb + k0 * stride_kn + hk * stride_kh, o_n, o_d, (stride_kn, stride_kd),
                       (nk, head_dim), UPCAST)
    b_vt = load_tile_t(v + b * stride_vb + k0 * stride_vn + hk * stride_vh, o_n, o_dv, (stride_vn, stride_vd),
                       (nk, head_dim_v), UPCAST)
    b_seed = tl.load(seed) if seed is not None else None
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo, hi = query_range(start_n, nq, band, BLOCK_M, BLOCK_N)
    hi = tl.where(start_n < nk, hi, 0)  # a varlen program past its sequence's keys has nothing to do
    for g in range(0, group_size):
        h = hk * group_size + g
        o_stats = b * stride_lb + h * stride_lh + q0  # lse and delta of this head's queries
        counter_row0 = (b * num_heads + h) * seqlen_q
        b_slope = tl.load(alibi + b * stride_ab + h * stride_ah) if alibi is not None else None
        p_mask = mask + b * stride_mb + h * stride_mh if mask is not None else None
        p_q = q + b * stride_qb + q0 * stride_qn + h * stride_qh
        p_do = dout + b * stride_dob + q0 * stride_don + h * stride_doh
        for start_m in range(lo, hi, BLOCK_M):
            o_m = start_m + o_m0
            b_q = load_tile(p_q, o_m, o_d, (stride_qn, stride_qd), (nq, head_dim), UPCAST)
            b_do = load_tile(p_do, o_m, o_dv, (stride_don, stride_dod), (nq, head_dim_v), UPCAST)
            b_lse = tl.load(lse + o_stats + o_m, mask=o_m < nq, other=float("inf"))
            b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse)  # rows that see no key: P = 0
            b_delta = tl.load(delta + o_stats + o_m, mask=o_m < nq, other=0.0)
            b_s, b_capped = score_tile(b_q, b_kt, o_m, o_n, (start_m, start_n), (nq, nk), band, scale, softcap,
                                       b_slope, p_mask, (stride_mq, stride_mk))
            b_p = tl.exp(b_s - b_lse[:, None])
            b_dp = dot(b_do, b_vt)
            b_pd = b_p
            if b_seed is not None:
                m_keep = dropout_keep(b_seed, counter_row0, o_m, o_n, (seqlen_q, seqlen_k), dropout_p)
                b_pd = dropped(b_p, m_keep, dropout_p)
                b_dp = dropped(b_dp, m_keep, dropout_p)
            b_ds = score_grads(b_p, b_dp, b_delta, b_capped, softcap)
            b_dv += dot(tl.trans(b_pd).to(b_do.dtype), b_do)
            b_dk += dot(tl.trans(b_ds).to(b_q.dtype), b_q)
    b_dk = b_dk * scale
    o_rows = k0 + o_n[:, None]
    m_rows = o_n[:, None] < nk
    tl.store(dk + b * stride_dkb + o_rows * stride_dkn + hk * stride_dkh + o_d[None, :] * stride_dkd,
             b_dk.to(dk.dtype.element_ty), mask=m_rows & (o_d[None, :] < head_dim))
    tl.store(dv + b * stride_dvb + o_rows * stride_dvn + hk * stride_dvh + o_dv[None, :] * stride_dvd,
             b_dv.to(dv.dtype.element_ty), mask=m_rows & (o_dv[None, :] < head_dim_v))


@triton.jit
def attention_backward_dq_kernel(
    q, k, v, dout, lse, delta, dq, alibi, mask, seed, cu_seqlens_q, cu_seqlens_k,
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
    UPCAST: tl.constexpr,
):
    """dQ_i for one query block of one head: its own pass over the keys, so dQ needs no atomics."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = bh % num_heads
    hk = h // group_size
    q0, nq, k0, nk = sequence(b, cu_seqlens_q, cu_seqlens_k, None, (seqlen_q, seqlen_k))
    band = (window_left, window_right, (nk - nq) * bottom_right + diagonal_offset)
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_n0 = tl.arange(0, BLOCK_N)
    o_d, o_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    b_q = load_tile(q + b * stride_qb + q0 * stride_qn + h * stride_qh, o_m, o_d, (stride_qn, stride_qd),
                    (nq, head_dim), UPCAST)
    b_do = load_tile(dout + b * stride_dob + q0 * stride_don + h * stride_doh, o_m, o_dv, (stride_don, stride_dod),
                     (nq, head_dim_v), UPCAST)
    o_stats = b * stride_lb + h * stride_lh + q0
    b_lse = tl.load(lse + o_stats + o_m, mask=o_m < nq, other=float("inf"))
    b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse)
    b_delta = tl.load(delta + o_stats + o_m, mask=o_m < nq, other=0.0)
    b_slope = tl.load(alibi + b * stride_ab + h * stride_ah) if alibi is not None else None
    p_mask = mask + b * stride_mb + h * stride_mh if mask is not None else None
    b_seed = tl.load(seed) if seed is not None else None
    counter_row0 = bh.to(tl.int64) * seqlen_q
    p_k = k + b * stride_kb + k0 * stride_kn + hk * stride_kh
    p_v = v + b * stride_vb + k0 * stride_vn + hk * stride_vh
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = key_range(start_m, nk, band, BLOCK_M, BLOCK_N)
    hi = tl.where(start_m < nq, hi, 0)
    for start_n in range(lo, hi, BLOCK_N):
        o_n = start_n + o_n0
        b_kt = load_tile_t(p_k, o_n, o_d, (stride_kn, stride_kd), (nk, head_dim), UPCAST)
        b_vt = load_tile_t(p_v, o_n, o_dv, (stride_vn, stride_vd), (nk, head_dim_v), UPCAST)
        b_s, b_capped = score_tile(b_q, b_kt, o_m, o_n, (start_m, start_n), (nq, nk), band, scale, softcap, b_slope,
                                   p_mask, (stride_mq, stride_mk))
        b_p = tl.exp(b_s - b_lse[:, None])
        b_dp = dot(b_do, b_vt)
        if b_seed is not None:
            m_keep = dropout_keep(b_seed, counter_row0, o_m, o_n, (seqlen_q, seqlen_k), dropout_p)
            b_dp = dropped(b_dp, m_keep, dropout_p)
        b_ds = score_grads(b_p, b_dp, b_delta, b_capped, softcap)
        b_dq += dot(b_ds.to(b_kt.dtype), tl.trans(b_kt))
    b_dq = b_dq * scale
    tl.store(dq + b * stride_dqb + (q0 + o_m[:, None]) * stride_dqn + h * stride_dqh + o_d[None, :] * stride_dqd,
             b_dq.to(dq.dtype.element_ty), mask=(o_m[:, None] < nq) & (o_d[None, :] < head_dim))
