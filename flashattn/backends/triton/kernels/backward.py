"""The FlashAttention-2 backward: a preprocess (delta), dK/dV per key block, dQ per query block.

Two ways to dQ. The two-pass backward (the default, and every ``deterministic=True`` call) uses no atomics: the
dK/dV program of a key block sums over the query heads of its GQA group itself, and dQ is its own pass over the
keys, so gradients are bitwise reproducible, at the cost of S, P and dP computed twice (7 matmuls a tile). The
one-pass backward (``dq`` given to the dK/dV kernel: an fp32 accumulator the preprocess zeroes) adds each tile's
dS K into it with atomics, as FlashAttention-2's CUDA backward does: 5 matmuls a tile, dQ summed in an order the
scheduler picks (then rounded by ``attention_backward_dq_convert_kernel`` for 16-bit q).

FP8 inputs (the training mode's e4m3 q, k, v; ``descale`` their (B, Hk, 3) scales): the two matmuls of the scores'
side, S = Q K^T and dP = dO V^T, run on FP8 tensor cores, dO quantized to e4m3 (``dout8``) by the preprocess with
a scale per (sequence, head) (``do_descale``, in lse's layout; delta is taken from the same quantized dO, so dS
stays consistent); dV = P^T dO, dK = dS^T Q and dQ = dS K multiply 16-bit tiles (dO as given, q and k widened), since P
and dS have no scale before they are computed (bf16 tiles: e4m3 is exact in them). Each scale multiplies the fp32
result it belongs to.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl

from .bundles import Band, Dropout, Operand, Scoring, Span
from .dropout import dropout_keep
from .tiles import (
    LOG2E,
    dot,
    dot_acc,
    dropped,
    e4m3_quantized,
    full_key_range,
    full_query_range,
    key_range,
    load_block,
    program_tile,
    query_range,
    score_grads,
    score_tile,
    sequence,
    tma_origin,
    walk_band,
    walk_listed,
    widened,
)


class Grads(NamedTuple):
    """dK and dV of a key block, summed so far (``_key_grads``'s carry)."""

    b_dk: Any  # (BLOCK_N, BLOCK_D) fp32, not yet scaled by the softmax scale
    b_dv: Any  # (BLOCK_N, BLOCK_DV) fp32


class KeyBlock(NamedTuple):
    """What ``_key_grads`` walks one query head's queries with, besides their ``Scoring``."""

    b_k: Any  # the key block
    b_v: Any  # its values
    o_n: Any  # its key indices
    q: Any  # Operand: the queries at this head
    do: Any  # Operand: dO at this head
    p_neg_lse2: Any  # -lse in log2 units (-inf for rows without keys) at this head's first query (unit stride)
    p_delta: Any  # delta at this head's first query, as p_neg_lse2
    dropout: Any  # Dropout
    do8: Any  # FP8 inputs: Operand, dO in e4m3 at this head; else None
    p_do_scale: Any  # FP8 inputs: dO's descale at this head's first query, as p_neg_lse2; else None
    dp_scale: Any  # FP8 inputs: v's descale (dP's factor besides dO's); else None
    dq: Any  # one-pass: Operand, the fp32 dQ accumulator at this head, and the factor of its sums; else None
    dq_scale: Any  # (both None otherwise; the compiler tests the scalar, not the tuple)
    q_cols: Any  # split head dim: Operands, the queries' and dO's columns this program's dK and dV cover, and
    do_cols: Any  # the first of them (``first_col``); else all three None
    first_col: Any


class QueryBlock(NamedTuple):
    """What ``_query_grads`` walks the keys with, besides their ``Scoring``."""

    b_q: Any  # the query block
    b_do: Any  # its dO
    o_m: Any  # its query indices
    b_neg_lse2: Any  # its -lse in log2 units (-inf where a row has no key: P = 0)
    b_delta: Any  # its delta
    k: Any  # Operand: the keys at this key/value head
    v: Any  # Operand: the values at this key/value head
    dropout: Any  # Dropout
    b_dp_scale: Any  # FP8 inputs: dP's factor per query row (v's descale times dO's, b_do in e4m3); else None


@triton.jit
def attention_backward_preprocess_kernel(
    out, dout, dlse, lse, delta, neg_lse2, do_descale, dout8, dq,
    stride_ob, stride_on, stride_oh, stride_od,
    stride_dob, stride_don, stride_doh, stride_dod,
    stride_d8b, stride_d8n, stride_d8h,
    stride_dqb, stride_dqn, stride_dqh, stride_dqd,
    num_heads, seqlen_q, head_dim, head_dim_v,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr,
):
    """delta_i = rowsum(dO_i * O_i) - dlse_i, in fp32 (the dlse term is the gradient of the returned lse; ``dlse``
    None when it has none; with ``do_descale``, in lse's layout, dO as the FP8 kernels see it: in e4m3, written to
    ``dout8``, (B, Nq, H, Dv) with unit last stride, for them), and
    neg_lse2_i: -lse_i in log2 units, -inf where a row sees no key (lse -inf), so that 2^(s + neg_lse2) is P, and 0
    for such rows, with one FFMA and no select or negation in the backward's loops. ``dq`` (the one-pass backward's
    fp32 accumulator): its rows zeroed, so that a replayed call allocates it uninitialized."""
    start_m, bh = program_tile(seqlen_q, BLOCK_M, False)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_dv = tl.arange(0, BLOCK_DV)
    out_block = Operand(None, None, out + b * stride_ob + h * stride_oh, stride_on, stride_od, head_dim_v, None)
    b_o = load_block(out_block, 0, o_m, seqlen_q, o_dv, True)
    do_block = Operand(None, None, dout + b * stride_dob + h * stride_doh, stride_don, stride_dod, head_dim_v, None)
    b_do = load_block(do_block, 0, o_m, seqlen_q, o_dv, True)
    o_rows = bh.to(tl.int64) * seqlen_q + o_m
    if do_descale is not None:
        b_do_scale = tl.load(do_descale + o_rows, mask=o_m < seqlen_q, other=1.0)
        b_do8 = e4m3_quantized(b_do, (1.0 / b_do_scale)[:, None], UPCAST)
        tl.store(dout8 + b * stride_d8b + o_m[:, None].to(tl.int64) * stride_d8n + h * stride_d8h + o_dv[None, :],
                 b_do8, mask=(o_m[:, None] < seqlen_q) & (o_dv[None, :] < head_dim_v))
        b_do = b_do8.to(tl.float32) * b_do_scale[:, None]
    b_delta = tl.sum(b_o * b_do, 1)
    if dlse is not None:
        b_delta = b_delta - tl.load(dlse + o_rows, mask=o_m < seqlen_q, other=0.0).to(tl.float32)
    tl.store(delta + o_rows, b_delta, mask=o_m < seqlen_q)
    b_lse = tl.load(lse + o_rows, mask=o_m < seqlen_q, other=0.0)
    b_neg_lse2 = tl.where(b_lse == float("-inf"), float("-inf"), -b_lse * LOG2E)
    tl.store(neg_lse2 + o_rows, b_neg_lse2, mask=o_m < seqlen_q)
    if dq is not None:
        o_d = tl.arange(0, BLOCK_D)
        p_dq = dq + b * stride_dqb + o_m[:, None].to(tl.int64) * stride_dqn + h * stride_dqh + o_d[None, :] * stride_dqd
        m_dq = (o_m[:, None] < seqlen_q) & (o_d[None, :] < head_dim)
        tl.store(p_dq, tl.zeros([BLOCK_M, BLOCK_D], tl.float32), mask=m_dq)


@triton.jit
def attention_backward_dq_convert_kernel(dq_sum, dq, numel, BLOCK: tl.constexpr):
    """dq = dq_sum rounded to dq's dtype, both dense and of one shape: the one-pass backward's last step."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dq + o, tl.load(dq_sum + o, mask=o < numel).to(dq.dtype.element_ty), mask=o < numel)


@triton.jit
def _key_grads(grads, args, span, scoring, BLOCK_M: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr,
               PLAIN: tl.constexpr):
    """dK and dV of one key block (``grads``, a ``Grads``, in, updated out) over the query tiles in ``span``, on the
    transposed tile S^T = K Q^T (BLOCK_N keys x BLOCK_M queries), so all four matmuls have the key block as their
    M dimension: wgmma-sized with 64 or more keys. ``args`` is a ``KeyBlock``; ``walk_band``'s and ``walk_listed``'s
    visit, as the forward's ``_attend``.
    """
    b_dk, b_dv = grads.b_dk, grads.b_dv
    b_k, b_v, o_n, dropout = args.b_k, args.b_v, args.o_n, args.dropout
    nq = scoring.nq
    s_scale = scoring.scale * LOG2E if PLAIN else 1.0
    o_d = tl.arange(0, b_k.shape[1])
    o_dv = tl.arange(0, b_v.shape[1])
    o_dk_cols = tl.arange(0, b_dk.shape[1])  # the columns of dK and dV this program sums (all, unless split)
    o_dv_cols = tl.arange(0, b_dv.shape[1])
    for start_m in range(span.lo, span.hi, BLOCK_M):
        o_m = start_m + tl.arange(0, BLOCK_M)
        # With a descriptor, rows past the sequence read another's queries: their -lse is -inf, so P = 0.
        b_qt = load_block(args.q, start_m, o_m, nq, o_d, UPCAST, True)
        b_do = load_block(args.do, start_m, o_m, nq, o_dv, UPCAST)
        if MASKED:  # rows past the sequence read -inf, as rows that see no key hold: their P is 0
            b_neg_lse2 = tl.load(args.p_neg_lse2 + o_m, mask=o_m < nq, other=float("-inf"))
            b_delta = tl.load(args.p_delta + o_m, mask=o_m < nq, other=0.0)
        else:  # whole query tiles only (``full_query_range``): no compare and select per column
            b_neg_lse2 = tl.load(args.p_neg_lse2 + o_m)
            b_delta = tl.load(args.p_delta + o_m)
        b_st, b_tt = score_tile(b_k, b_qt, o_m, o_n, scoring, MASKED, PLAIN, True)
        b_pt = tl.math.exp2(b_st * s_scale + b_neg_lse2[None, :])
        if args.dp_scale is not None:  # FP8: dO in e4m3 for dP^T = V dO^T, both scales on the result
            b_do8 = load_block(args.do8, start_m, o_m, nq, o_dv, UPCAST)
            b_do_scale = tl.load(args.p_do_scale + o_m, mask=o_m < nq, other=1.0)
            b_dpt = dot(b_v, tl.trans(b_do8)) * (args.dp_scale * b_do_scale[None, :])
            b_qt = widened(b_qt, tl.float32 if UPCAST else tl.bfloat16)  # for dK: 16-bit, exact
        else:
            b_dpt = dot(b_v, tl.trans(b_do))
        b_pt_kept = b_pt
        if dropout.b_seed is not None:
            m_keep = dropout_keep(dropout, o_m[None, :], o_n[:, None])
            b_pt_kept = dropped(b_pt, m_keep, dropout.p)
            b_dpt = dropped(b_dpt, m_keep, dropout.p)
        b_dst = score_grads(b_pt, b_dpt, b_delta[None, :], b_tt, scoring.softcap)
        b_dst = b_dst.to(b_qt.dtype)
        if args.first_col is not None:  # split head dim: S^T and dP^T over every column, dK and dV over some
            b_dv = dot_acc(b_pt_kept.to(b_do.dtype), load_block(args.do_cols, start_m, o_m, nq, o_dv_cols, UPCAST),
                           b_dv)
            b_q_cols = load_block(args.q_cols, start_m, o_m, nq, o_dk_cols, UPCAST)
            if args.dp_scale is not None:  # FP8 q: widened for dK, as b_qt is
                b_q_cols = widened(b_q_cols, tl.float32 if UPCAST else tl.bfloat16)
            b_dk = dot_acc(b_dst, b_q_cols, b_dk)
        else:
            b_dv = dot_acc(b_pt_kept.to(b_do.dtype), b_do, b_dv)
            b_dk = dot_acc(b_dst, tl.trans(b_qt), b_dk)
        if args.dq_scale is not None:  # one pass: this tile's dS K into the queries' dQ (rows past nq are dropped)
            b_dq = dot(tl.trans(b_dst), b_k) * args.dq_scale
            p_dq = args.dq.base + o_m[:, None].to(tl.int64) * args.dq.stride_row + o_d[None, :] * args.dq.stride_col
            tl.atomic_add(p_dq, b_dq, mask=(o_m[:, None] < nq) & (o_d[None, :] < args.dq.n_cols), sem="relaxed")
    return Grads(b_dk, b_dv)


@triton.jit
def attention_backward_dkdv_kernel(
    q, k, v, dout, neg_lse2, delta, dk, dv, dq, alibi, mask, seed, blocks, cu_seqlens_q, cu_seqlens_k, descale,
    do_descale, dout8, q_desc, q_tma, k_desc, k_tma, v_desc, v_tma, do_desc, do_tma,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_don, stride_doh, stride_dod,
    stride_d8b, stride_d8n, stride_d8h,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    stride_dqb, stride_dqn, stride_dqh, stride_dqd,
    stride_lb, stride_lh,
    stride_ab, stride_ah,
    stride_mb, stride_mh, stride_mq, stride_mk,
    num_heads, num_heads_k, group_size, seqlen_q, seqlen_k, rows_q, rows_k, head_dim, head_dim_v,
    bottom_right, diagonal_offset, window_left, window_right, scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, PLAIN: tl.constexpr, SPLIT_D: tl.constexpr = 1,
):
    """dK_j, dV_j for one key block of one key/value head, summed over the G query heads of its group inside
    the program (no atomics, so the result is deterministic). The query tiles that see the whole key block run
    without mask code; those on the band's edges apply it. ``dq`` (the one-pass backward, 16-bit inputs only): each
    tile's dS K, times the scale, added into this fp32 accumulator of q's shape. ``SPLIT_D`` > 1: SPLIT_D programs
    per key block, each summing dK and dV over 1 / SPLIT_D of the head dim (S^T and dP^T, over all of it, computed by
    each): at head dim 256 a 64-key block's dK and dV no longer fit one warpgroup's registers, its halves do. FP8
    inputs: see the module's docstring."""
    start_n, bhk = program_tile(seqlen_k, BLOCK_N, False)  # the first key blocks see the most queries (causal)
    BLOCK_DK_OUT: tl.constexpr = BLOCK_D // SPLIT_D
    BLOCK_DV_OUT: tl.constexpr = BLOCK_DV // SPLIT_D
    col = 0
    if SPLIT_D > 1:
        tl.static_assert(dq is None, "the one-pass backward's dQ needs each tile's dS once")
        col = bhk % SPLIT_D
        bhk = bhk // SPLIT_D
    b = (bhk // num_heads_k).to(tl.int64)
    hk = (bhk % num_heads_k).to(tl.int64)
    dk_scale = scale
    dq_scale = scale
    v_scale = None
    if descale is not None:  # (B, Hk, 3): q's, k's and v's descales
        q_scale = tl.load(descale + bhk * 3)
        scale = scale * q_scale * tl.load(descale + bhk * 3 + 1)
        dk_scale = dk_scale * q_scale
        v_scale = tl.load(descale + bhk * 3 + 2)
    q0, nq, k0, nk = sequence(b, cu_seqlens_q, cu_seqlens_k, None, None, seqlen_q, seqlen_k, rows_q, rows_k)
    band = Band(window_left, window_right, (nk - nq) * bottom_right + diagonal_offset)
    o_n = start_n + tl.arange(0, BLOCK_N)
    o_d, o_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    k_block = Operand(k_desc, tma_origin(k_tma, b, hk, k0 + start_n), k + b * stride_kb + k0 * stride_kn
                      + hk * stride_kh, stride_kn, stride_kd, head_dim, None)
    b_k = load_block(k_block, 0, o_n, nk, o_d, UPCAST)
    v_block = Operand(v_desc, tma_origin(v_tma, b, hk, k0 + start_n), v + b * stride_vb + k0 * stride_vn
                      + hk * stride_vh, stride_vn, stride_vd, head_dim_v, None)
    b_v = load_block(v_block, 0, o_n, nk, o_dv, UPCAST)
    b_seed = tl.load(seed) if seed is not None else None
    grads = Grads(tl.zeros([BLOCK_N, BLOCK_DK_OUT], tl.float32), tl.zeros([BLOCK_N, BLOCK_DV_OUT], tl.float32))
    lo, hi = query_range(start_n, nq, band, BLOCK_M, BLOCK_N)
    hi = tl.where(start_n < nk, hi, 0)  # a varlen program past its sequence's keys has nothing to do
    span = Span(lo, hi)
    full = full_query_range(start_n, nq, nk, band, span, BLOCK_M, BLOCK_N)
    for g in range(0, group_size):
        h = hk * group_size + g
        o_stats = b * stride_lb + h * stride_lh + q0  # neg_lse2 and delta of this head's queries
        p_q = q + b * stride_qb + q0 * stride_qn + h * stride_qh
        p_do = dout + b * stride_dob + q0 * stride_don + h * stride_doh
        p_neg_lse2, p_delta = neg_lse2 + o_stats, delta + o_stats
        p_do_scale, do8 = None, None
        if do_descale is not None:
            p_do_scale = do_descale + o_stats
            do8 = Operand(None, None, dout8 + b * stride_d8b + q0 * stride_d8n + h * stride_d8h, stride_d8n, 1,
                          head_dim_v, None)
        q_at, do_at = tma_origin(q_tma, b, h, q0), tma_origin(do_tma, b, h, q0)
        b_slope = tl.load(alibi + b * stride_ab + h * stride_ah) if alibi is not None else None
        p_mask = mask + b * stride_mb + h * stride_mh if mask is not None else None
        scoring = Scoring(nq, nk, band, scale, softcap, b_slope, p_mask, stride_mq, stride_mk)
        dropout = Dropout(b_seed, dropout_p, (b * num_heads + h) * seqlen_q, seqlen_k)
        dq_at, dq_factor = None, None
        if dq is not None:
            dq_at = Operand(None, None, dq + b * stride_dqb + q0 * stride_dqn + h * stride_dqh, stride_dqn, stride_dqd,
                            head_dim, None)
            dq_factor = dq_scale
        q_cols, do_cols, first_col = None, None, None
        if SPLIT_D > 1:
            first_col = col * BLOCK_DK_OUT
            q_cols = Operand(None, None, p_q + first_col * stride_qd, stride_qn, stride_qd, head_dim - first_col, None)
            first_v = col * BLOCK_DV_OUT
            do_cols = Operand(None, None, p_do + first_v * stride_dod, stride_don, stride_dod, head_dim_v - first_v,
                              None)
        args = KeyBlock(b_k, b_v, o_n, Operand(q_desc, q_at, p_q, stride_qn, stride_qd, head_dim, None),
                        Operand(do_desc, do_at, p_do, stride_don, stride_dod, head_dim_v, None), p_neg_lse2, p_delta,
                        dropout, do8, p_do_scale, v_scale, dq_at, dq_factor, q_cols, do_cols, first_col)
        if blocks is not None:  # a block mask (BLOCK_N divides its key block): its listed query blocks only
            grads = walk_listed(_key_grads, grads, args, span, start_n // blocks.kv_block, b, h, blocks, scoring,
                                True, BLOCK_M, UPCAST, PLAIN)
        else:  # three walks: without a right window the first is empty, but compiled all the same
            grads = walk_band(_key_grads, grads, args, span, full, scoring, True, BLOCK_M, UPCAST, PLAIN, True)
    b_dk = grads.b_dk * dk_scale
    b_dv = grads.b_dv
    o_d = col * BLOCK_DK_OUT + tl.arange(0, BLOCK_DK_OUT)  # the columns this program sums
    o_dv = col * BLOCK_DV_OUT + tl.arange(0, BLOCK_DV_OUT)
    o_rows = k0 + o_n[:, None].to(tl.int64)
    m_rows = o_n[:, None] < nk
    tl.store(dk + b * stride_dkb + o_rows * stride_dkn + hk * stride_dkh + o_d[None, :] * stride_dkd,
             b_dk.to(dk.dtype.element_ty), mask=m_rows & (o_d[None, :] < head_dim))
    tl.store(dv + b * stride_dvb + o_rows * stride_dvn + hk * stride_dvh + o_dv[None, :] * stride_dvd,
             b_dv.to(dv.dtype.element_ty), mask=m_rows & (o_dv[None, :] < head_dim_v))


@triton.jit
def _query_grads(b_dq, args, span, scoring, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr,
                 PLAIN: tl.constexpr):
    """dQ of one query block (``b_dq`` in, updated out) over the key tiles in ``span``; ``args`` is a
    ``QueryBlock``; ``walk_band``'s and ``walk_listed``'s visit, as the forward's ``_attend``."""
    b_q, b_do, o_m, dropout = args.b_q, args.b_do, args.o_m, args.dropout
    s_scale = scoring.scale * LOG2E if PLAIN else 1.0
    o_d = tl.arange(0, b_q.shape[1])
    o_dv = tl.arange(0, b_do.shape[1])
    for start_n in range(span.lo, span.hi, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        # With a descriptor, rows past the keys hold another sequence's: they are masked (P = 0).
        b_kt = load_block(args.k, start_n, o_n, scoring.nk, o_d, UPCAST, True)
        b_vt = load_block(args.v, start_n, o_n, scoring.nk, o_dv, UPCAST, True)
        b_s, b_t = score_tile(b_q, b_kt, o_m, o_n, scoring, MASKED, PLAIN)
        b_p = tl.math.exp2(b_s * s_scale + args.b_neg_lse2[:, None])
        b_dp = dot(b_do, b_vt)
        if dropout.b_seed is not None:
            b_dp = dropped(b_dp, dropout_keep(dropout, o_m[:, None], o_n[None, :]), dropout.p)
        if args.b_dp_scale is not None:  # FP8: b_do is in e4m3; k widened for dQ (16-bit, exact)
            b_dp = b_dp * args.b_dp_scale[:, None]
            b_kt = widened(b_kt, tl.float32 if UPCAST else tl.bfloat16)
        b_ds = score_grads(b_p, b_dp, args.b_delta[:, None], b_t, scoring.softcap)
        b_dq = dot_acc(b_ds.to(b_kt.dtype), tl.trans(b_kt), b_dq)
    return b_dq


@triton.jit
def attention_backward_dq_kernel(
    q, k, v, dout, neg_lse2, delta, dq, alibi, mask, seed, blocks, cu_seqlens_q, cu_seqlens_k, descale, do_descale,
    dout8, q_desc, q_tma, k_desc, k_tma, v_desc, v_tma, do_desc, do_tma,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_don, stride_doh, stride_dod,
    stride_d8b, stride_d8n, stride_d8h,
    stride_dqb, stride_dqn, stride_dqh, stride_dqd,
    stride_lb, stride_lh,
    stride_ab, stride_ah,
    stride_mb, stride_mh, stride_mq, stride_mk,
    num_heads, group_size, seqlen_q, seqlen_k, rows_q, rows_k, head_dim, head_dim_v,
    bottom_right, diagonal_offset, window_left, window_right, scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, PLAIN: tl.constexpr,
):
    """dQ_i for one query block of one head: its own pass over the keys, so dQ needs no atomics. The key tiles
    the whole query block sees run without mask code, as in the forward. FP8 inputs: see the module's docstring."""
    start_m, bh = program_tile(seqlen_q, BLOCK_M, True)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    hk = h // group_size
    dq_scale = scale
    if descale is not None:  # (B, Hk, 3): q's, k's and v's descales
        p_scales = descale + (b * (num_heads // group_size) + hk) * 3
        k_scale = tl.load(p_scales + 1)
        scale = scale * tl.load(p_scales) * k_scale
        dq_scale = dq_scale * k_scale
    q0, nq, k0, nk = sequence(b, cu_seqlens_q, cu_seqlens_k, None, None, seqlen_q, seqlen_k, rows_q, rows_k)
    band = Band(window_left, window_right, (nk - nq) * bottom_right + diagonal_offset)
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d, o_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q_block = Operand(q_desc, tma_origin(q_tma, b, h, q0 + start_m), q + b * stride_qb + q0 * stride_qn
                      + h * stride_qh, stride_qn, stride_qd, head_dim, None)
    b_q = load_block(q_block, 0, o_m, nq, o_d, UPCAST)
    do_block = Operand(do_desc, tma_origin(do_tma, b, h, q0 + start_m), dout + b * stride_dob + q0 * stride_don
                       + h * stride_doh, stride_don, stride_dod, head_dim_v, None)
    b_do = load_block(do_block, 0, o_m, nq, o_dv, UPCAST)
    o_stats = b * stride_lb + h * stride_lh + q0
    b_neg_lse2 = tl.load(neg_lse2 + o_stats + o_m, mask=o_m < nq, other=float("-inf"))
    b_delta = tl.load(delta + o_stats + o_m, mask=o_m < nq, other=0.0)
    b_dp_scale = None
    if descale is not None:  # dO in e4m3 for dP = dO V^T (the preprocess's)
        b_do_scale = tl.load(do_descale + o_stats + o_m, mask=o_m < nq, other=1.0)
        do8 = Operand(None, None, dout8 + b * stride_d8b + q0 * stride_d8n + h * stride_d8h, stride_d8n, 1,
                      head_dim_v, None)
        b_do = load_block(do8, start_m, o_m, nq, o_dv, UPCAST)
        b_dp_scale = tl.load(p_scales + 2) * b_do_scale
    b_slope = tl.load(alibi + b * stride_ab + h * stride_ah) if alibi is not None else None
    p_mask = mask + b * stride_mb + h * stride_mh if mask is not None else None
    b_seed = tl.load(seed) if seed is not None else None
    p_k = k + b * stride_kb + k0 * stride_kn + hk * stride_kh
    p_v = v + b * stride_vb + k0 * stride_vn + hk * stride_vh
    scoring = Scoring(nq, nk, band, scale, softcap, b_slope, p_mask, stride_mq, stride_mk)
    dropout = Dropout(b_seed, dropout_p, bh.to(tl.int64) * seqlen_q, seqlen_k)
    k_at, v_at = tma_origin(k_tma, b, hk, k0), tma_origin(v_tma, b, hk, k0)
    lo, hi = key_range(start_m, nk, band, BLOCK_M, BLOCK_N)
    hi = tl.where(start_m < nq, hi, 0)
    span = Span(lo, hi)
    full = full_key_range(start_m, nk, band, span, BLOCK_M, BLOCK_N)
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    args = QueryBlock(b_q, b_do, o_m, b_neg_lse2, b_delta,
                      Operand(k_desc, k_at, p_k, stride_kn, stride_kd, head_dim, None),
                      Operand(v_desc, v_at, p_v, stride_vn, stride_vd, head_dim_v, None), dropout, b_dp_scale)
    if blocks is not None:  # a block mask: its listed key blocks only, as in the forward
        b_dq = walk_listed(_query_grads, b_dq, args, span, start_m // blocks.q_block, b, h, blocks, scoring, False,
                           BLOCK_N, UPCAST, PLAIN)
    else:
        b_dq = walk_band(_query_grads, b_dq, args, span, full, scoring, window_left is not None, BLOCK_N, UPCAST,
                         PLAIN)
    b_dq = b_dq * dq_scale
    o_rows = q0 + o_m[:, None].to(tl.int64)
    tl.store(dq + b * stride_dqb + o_rows * stride_dqn + h * stride_dqh + o_d[None, :] * stride_dqd,
             b_dq.to(dq.dtype.element_ty), mask=(o_m[:, None] < nq) & (o_d[None, :] < head_dim))
