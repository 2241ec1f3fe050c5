"""The FlashAttention-2 forward kernel and the merge of split-KV partial results.

One program owns one (query block, batch x head) pair and, with split-KV (flash-decoding), one split of the keys.
Keys come from dense K/V, a packed varlen batch, or a KV cache (per-sequence bounds, a cache row index, or a
paged block table with any page size).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (
    dot,
    dropout_keep,
    dropped,
    key_range,
    key_slots,
    load_rows,
    load_tile,
    load_tile_t,
    score_tile,
    sequence,
)


@triton.jit
def attention_forward_kernel(
    q, k, v, out, lse, probs, alibi, mask, seed, cu_seqlens_q, cu_seqlens_k, k_start, k_end, k_batch, block_table,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_os, stride_ob, stride_on, stride_oh, stride_od,
    stride_ls, stride_lb, stride_lh,
    stride_ab, stride_ah,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_bt, page_size, split_keys,
    num_heads, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v,
    bottom_right, diagonal_offset, window_left, window_right, scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """O and lse of one query block of one head over the keys of split ``program_id(2)``.

    ``seqlen_q``/``seqlen_k`` lay out the dropout counters and ``probs`` (the maxima with varlen); the lengths of
    this program's sequence come from ``sequence``. With split-KV, split s sees only keys
    [s * split_keys, (s + 1) * split_keys) and writes its partial O and lse at ``s * stride_os``/``stride_ls``
    for ``merge_splits_kernel``; one split (``split_keys`` >= seqlen_k) is plain FlashAttention-2. ``probs``
    (None unless asked for) receives P = exp(S - lse), dropped entries negated: a testing aid, never with a cache
    or splits.
    """
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    split = tl.program_id(2)
    b = (bh // num_heads).to(tl.int64)
    h = bh % num_heads
    hk = h // group_size
    q0, nq, k0, nk = sequence(b, cu_seqlens_q, cu_seqlens_k, (k_start, k_end) if k_start is not None else None,
                              (seqlen_q, seqlen_k))
    kb = b
    if k_batch is not None:
        kb = tl.load(k_batch + b).to(tl.int64)
    band = (window_left, window_right, (nk - nq) * bottom_right + diagonal_offset)
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_n0 = tl.arange(0, BLOCK_N)
    o_d, o_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)

    b_q = load_tile(q + b * stride_qb + q0 * stride_qn + h * stride_qh, o_m, o_d, (stride_qn, stride_qd),
                    (nq, head_dim), UPCAST)
    # Paged keys are addressed from the cache's start; others from row k0 of their batch entry.
    p_k = k + hk * stride_kh
    p_v = v + hk * stride_vh
    if block_table is None:
        p_k += kb * stride_kb + k0 * stride_kn
        p_v += kb * stride_vb + k0 * stride_vn
    b_slope = tl.load(alibi + b * stride_ab + h * stride_ah) if alibi is not None else None
    p_mask = mask + b * stride_mb + h * stride_mh if mask is not None else None
    b_seed = tl.load(seed) if seed is not None else None
    counter_row0 = bh.to(tl.int64) * seqlen_q  # dropout counters and probs rows: ((b * H + h) * NQ + i) * NK + j

    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, hi = key_range(start_m, nk, band, BLOCK_M, BLOCK_N)
    lo = tl.maximum(lo, split * split_keys)  # split_keys is a multiple of BLOCK_N: lo stays aligned
    hi = tl.minimum(hi, (split + 1) * split_keys)
    hi = tl.where(start_m < nq, hi, 0)  # a varlen program past its sequence's end has nothing to do
    for start_n in range(lo, hi, BLOCK_N):
        o_n = start_n + o_n0
        o_page, o_row, m_keys = key_slots(o_n, nk, k0, kb, block_table, stride_bt, page_size)
        b_kt = load_rows(p_k, o_page * stride_kb + o_row * stride_kn, m_keys, o_d, stride_kd, head_dim, UPCAST, True)
        b_v = load_rows(p_v, o_page * stride_vb + o_row * stride_vn, m_keys, o_dv, stride_vd, head_dim_v, UPCAST,
                        False)
        b_s, _ = score_tile(b_q, b_kt, o_m, o_n, (start_m, start_n), (nq, nk), band, scale, softcap, b_slope, p_mask,
                            (stride_mq, stride_mk))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        # Rows that have seen only masked keys keep max -inf: shift by 0 there so exp gives 0, not NaN.
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p = tl.exp(b_s - b_m_safe[:, None])
        b_alpha = tl.exp(b_m - b_m_safe)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        if b_seed is not None:
            m_keep = dropout_keep(b_seed, counter_row0, o_m, o_n, (seqlen_q, seqlen_k), dropout_p)
            b_p = dropped(b_p, m_keep, dropout_p)
        b_acc = b_acc * b_alpha[:, None] + dot(b_p.to(b_v.dtype), b_v)
        b_m = b_m_new

    # Deferred normalisation: one division per row; a row that saw no key outputs 0 with lse = -inf.
    m_empty = b_l == 0.0
    b_out = b_acc / tl.where(m_empty, 1.0, b_l)[:, None]
    b_lse = tl.where(m_empty, float("-inf"), b_m + tl.log(tl.where(m_empty, 1.0, b_l)))
    p_out = (out + split * stride_os + b * stride_ob + (q0 + o_m[:, None]) * stride_on + h * stride_oh
             + o_dv[None, :] * stride_od)
    tl.store(p_out, b_out.to(out.dtype.element_ty), mask=(o_m[:, None] < nq) & (o_dv[None, :] < head_dim_v))
    tl.store(lse + split * stride_ls + b * stride_lb + h * stride_lh + q0 + o_m, b_lse, mask=o_m < nq)

    if probs is not None:
        # P = exp(S - lse) recomputed, dropped entries negated. probs was zero-filled by the launcher, so hidden
        # key blocks need no store.
        b_lse_safe = tl.where(m_empty, float("inf"), b_lse)
        for start_n in range(lo, hi, BLOCK_N):
            o_n = start_n + o_n0
            b_kt = load_tile_t(p_k, o_n, o_d, (stride_kn, stride_kd), (nk, head_dim), UPCAST)
            b_s, _ = score_tile(b_q, b_kt, o_m, o_n, (start_m, start_n), (nq, nk), band, scale, softcap, b_slope,
                                p_mask, (stride_mq, stride_mk))
            b_p = tl.exp(b_s - b_lse_safe[:, None])
            if b_seed is not None:
                m_keep = dropout_keep(b_seed, counter_row0, o_m, o_n, (seqlen_q, seqlen_k), dropout_p)
                b_p = tl.where(m_keep, b_p, -b_p)
            p_probs = probs + (counter_row0 + o_m[:, None]) * seqlen_k + o_n[None, :]
            tl.store(p_probs, b_p.to(probs.dtype.element_ty), mask=(o_m[:, None] < nq) & (o_n[None, :] < nk))


@triton.jit
def merge_splits_kernel(
    out_splits, lse_splits, out, lse,
    stride_pos, stride_pob, stride_pon, stride_poh, stride_pod,
    stride_pls, stride_plb, stride_plh,
    stride_ob, stride_on, stride_oh, stride_od,
    stride_lb, stride_lh,
    num_heads, seqlen_q, head_dim_v, n_splits,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Merge the partial (O_s, lse_s) of every split (strides ``stride_po*`` and ``stride_pl*`` of the partials,
    ``stride_o*`` and ``stride_l*`` of the results): lse = log sum_s exp(lse_s), O = sum_s exp(lse_s - lse) O_s.

    Weights are taken relative to the largest lse_s, so nothing overflows; splits that saw no key (lse_s = -inf)
    weigh 0, and a row no split saw gets O = 0, lse = -inf. Query positions have unit stride in ``lse_splits``
    and ``lse``.
    """
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // num_heads).to(tl.int64)
    h = bh % num_heads
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_dv = tl.arange(0, BLOCK_DV)
    m_rows = o_m < seqlen_q
    p_lse = lse_splits + b * stride_plb + h * stride_plh + o_m
    b_top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(0, n_splits):
        b_top = tl.maximum(b_top, tl.load(p_lse + s * stride_pls, mask=m_rows, other=float("-inf")))
    b_top = tl.where(b_top == float("-inf"), 0.0, b_top)
    b_total = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    p_tile = out_splits + b * stride_pob + h * stride_poh + o_m[:, None] * stride_pon + o_dv[None, :] * stride_pod
    m_inside = m_rows[:, None] & (o_dv[None, :] < head_dim_v)
    for s in range(0, n_splits):
        b_w = tl.exp(tl.load(p_lse + s * stride_pls, mask=m_rows, other=float("-inf")) - b_top)
        b_total += b_w
        b_acc += b_w[:, None] * tl.load(p_tile + s * stride_pos, mask=m_inside, other=0.0)
    m_empty = b_total == 0.0
    b_out = b_acc / tl.where(m_empty, 1.0, b_total)[:, None]
    b_lse = tl.where(m_empty, float("-inf"), b_top + tl.log(tl.where(m_empty, 1.0, b_total)))
    tl.store(out + b * stride_ob + o_m[:, None] * stride_on + h * stride_oh + o_dv[None, :] * stride_od,
             b_out.to(out.dtype.element_ty), mask=m_inside)
    tl.store(lse + b * stride_lb + h * stride_lh + o_m, b_lse, mask=m_rows)
