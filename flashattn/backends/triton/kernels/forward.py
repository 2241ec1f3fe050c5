"""The FlashAttention-2 forward kernel, with split-KV's merge of partial results in its last split's programs.

One program owns one (query block, batch x head) pair and, with split-KV (flash-decoding), one split of the keys.
Keys come from dense K/V, a packed varlen batch, or a KV cache (per-sequence bounds, a cache row index, or a
paged block table with any page size).

The key loop is cut in three (``_attend``): the tiles left of the band's full part and right of it (the diagonal,
the end of the keys) apply the mask; the tiles between, all of them in a long non-causal call and all but the
diagonal ones in a causal call, run without any mask code. Scores are kept in log2 units (``LOG2E``) so each
softmax weight is a single MUFU.EX2, and in a plain call (no softcap, ALiBi or user mask) the scale is folded into
that exponent's FFMA.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl

from .bundles import Band, Dropout, KeySlots, Operand, Scoring, Span
from .dropout import dropout_keep
from .tiles import (
    LOG2E,
    VALUE_GROUP,
    dot_acc,
    e4m3_rounded,
    fast_div,
    fp8_operand_order,
    full_key_range,
    key_range,
    key_slots,
    load_block,
    load_block_at,
    program_tile,
    score_tile,
    sequence,
    tma_origin,
    walk_band,
    walk_listed,
    widened,
)

LN2 = tl.constexpr(0.6931471805599453)


class Softmax(NamedTuple):
    """The online softmax of a query block over the keys seen so far (``_attend``'s carry); m in log2 units."""

    b_acc: Any  # (BLOCK_M, BLOCK_DV) fp32: sum over keys of 2^(s - m) v, not yet divided by l
    b_l: Any  # (BLOCK_M,) fp32: sum over keys of 2^(s - m)
    b_m: Any  # (BLOCK_M,) fp32: the largest score so far, -inf before any key


class Attend(NamedTuple):
    """What ``_attend`` walks the keys with, besides their ``Scoring``."""

    b_q: Any  # the query block
    o_m: Any  # its query indices
    k: Any  # Operand: the keys at this head (``stride_page`` set: loaded through ``key_slots``)
    v: Any  # Operand: the values at this head
    keys: Any  # KeySlots: where the sequence's keys are
    dropout: Any  # Dropout


class Probs(NamedTuple):
    """What ``_store_probs`` recomputes P with, besides its ``Scoring``."""

    b_q: Any  # the query block
    o_m: Any  # its query indices
    k: Any  # Operand: the keys at this head, read through pointers
    dropout: Any  # Dropout
    p_rows: Any  # pointers to each query row's first probability (key 0)


@triton.jit
def _attend(state, args, span, scoring, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr,
            PLAIN: tl.constexpr):
    """The online softmax over the key tiles in the ``Span`` ``span``: ``state`` (a ``Softmax``) in, updated out;
    ``args`` an ``Attend``, ``scoring`` a ``Scoring`` (``walk_band``'s and ``walk_listed``'s visit).
    ``MASKED`` tiles apply the band and the end of the keys; the others are whole.
    """
    b_acc, b_l, b_m = state.b_acc, state.b_l, state.b_m
    b_q, o_m, k, v, dropout = args.b_q, args.o_m, args.k, args.v, args.dropout
    s_scale = scoring.scale * LOG2E if PLAIN else 1.0  # what turns the tile's scores into log2 units
    o_d = tl.arange(0, b_q.shape[1])
    o_dv = tl.arange(0, b_acc.shape[1])
    for start_n in range(span.lo, span.hi, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        # A descriptor copies the tile in one instruction; rows past the keys are masked or get P = 0.
        o_page, o_row, m_keys = key_slots(o_n, args.keys)
        b_kt = load_block_at(k, start_n, o_page * k.stride_page + o_row * k.stride_row, m_keys, o_d, UPCAST, True)
        m_values = m_keys
        if args.keys.value_rows is not None:  # interleaved values: the last group's keys are anywhere in it
            m_values = o_n < args.keys.value_rows
        b_v = load_block_at(v, start_n, o_page * v.stride_page + o_row * v.stride_row, m_values, o_dv, UPCAST)
        # FP8 keys and values (a KV cache) are widened to q's dtype in registers, tile by tile: exact, and free
        # (no instruction) when they already have it.
        b_kt, b_v = widened(b_kt, b_q.dtype), widened(b_v, b_q.dtype)
        b_s, _ = score_tile(b_q, b_kt, o_m, o_n, scoring, MASKED, PLAIN)
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1) * s_scale)  # PLAIN: raw q.k, whose max scales with the scale
        b_m_use = b_m_new
        if MASKED or scoring.p_mask is not None:
            # A row that has seen only masked keys keeps max -inf: shift by 0 there so 2^x gives 0, not NaN.
            b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p = tl.math.exp2(b_s * s_scale - b_m_use[:, None])
        b_alpha = tl.math.exp2(b_m - b_m_use)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        if dropout.b_seed is not None:  # the 1 / (1 - p) of the kept weights is applied once, at the end
            b_p = tl.where(dropout_keep(dropout, o_m[:, None], o_n[None, :]), b_p, 0.0)
        if UPCAST and b_v.dtype == tl.float8e4nv:  # FP8 matmuls under the interpreter (see e4m3_rounded)
            b_p = e4m3_rounded(b_p)
        b_p = b_p.to(b_v.dtype)
        if args.keys.value_rows is not None:
            b_p = fp8_operand_order(b_p)
        b_acc = dot_acc(b_p, b_v, b_acc * b_alpha[:, None])
        b_m = b_m_new
    return Softmax(b_acc, b_l, b_m)


@triton.jit
def attention_forward_kernel(
    q, k, v, out, lse, probs, descale, alibi, mask, seed, sink, blocks, cu_seqlens_q, cu_seqlens_k, k_start, k_end,
    k_batch, block_table, q_desc, q_tma, k_desc, k_tma, v_desc, v_tma, merged_out, merged_lse, tickets,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_os, stride_ob, stride_on, stride_oh, stride_od,
    stride_ls, stride_lb, stride_lh,
    stride_mob, stride_mon, stride_moh, stride_mod, stride_mlb, stride_mlh,
    stride_ab, stride_ah,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_sh, stride_sm,
    stride_bt, page_size, split_keys, rows_q, rows_k, cache_entries,
    num_heads, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v,
    bottom_right, diagonal_offset, window_left, window_right, scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, PLAIN: tl.constexpr, VALUES_INTERLEAVED: tl.constexpr,
):
    """O and lse of one query block of one head over the keys of split ``program_id(2)``.

    ``seqlen_q``/``seqlen_k`` lay out the dropout counters and ``probs`` (the maxima with varlen); the lengths of this
    program's sequence come from ``sequence``. With split-KV, split s sees only keys [s * split_keys, (s + 1) *
    split_keys) and writes its partial O and lse at ``s * stride_os``/``stride_ls``; then it takes a ticket
    (``tickets``, one counter per query block, zero before the launch) and the program that arrives last merges every
    split's partials into ``merged_out``/``merged_lse`` (strides ``stride_mo*``, ``stride_ml*``) and sets the counter
    back to zero (``_last_split_merges``). One split (``split_keys`` >= seqlen_k, ``tickets`` None) is plain
    FlashAttention-2. ``probs`` (None unless asked for) receives P = exp(S - lse), dropped entries negated: a testing
    aid, never with a cache or splits. ``sink`` (None without): the learnable sink logit of query head ``h *
    stride_sh + row * stride_sm`` joins the denominator in the epilogue (with splits, in the merge). ``blocks``
    (None without): a block mask's lists (``BlockLists``). ``descale`` (None without): (B, Hk), what multiplies
    the scores of FP8 q and k multiplied as they are; P is then rounded to v's FP8 type for P V, as
    FlashAttention-3 does. ``VALUES_INTERLEAVED``: v's keys permuted within groups of 32 and
    padded with zero keys to whole groups (``attend.interleaved_values``), P's columns permuted alike.
    ``PLAIN``: no softcap, ALiBi or user mask and a positive scale (see ``score_tile``).
    ``*_desc`` are TMA descriptors (None: pointer loads), ``*_tma`` where a head's rows are in them
    (``tiles.tma_origin``, ``flashattn.backends.triton.tma``).
    """
    start_m, bh = program_tile(seqlen_q, BLOCK_M, True)
    split = tl.program_id(2)
    b = (bh // num_heads).to(tl.int64)
    h = (bh % num_heads).to(tl.int64)
    hk = h // group_size
    if descale is not None:
        scale = scale * tl.load(descale + b * (num_heads // group_size) + hk)
    q0, nq, k0, nk = sequence(b, cu_seqlens_q, cu_seqlens_k, k_start, k_end, seqlen_q, seqlen_k, rows_q, rows_k)
    kb = b
    if k_batch is not None:  # clamped like the bounds (``sequence``): a bad row reads a real one
        kb = tl.minimum(tl.maximum(tl.load(k_batch + b), 0), cache_entries - 1).to(tl.int64)
    band = Band(window_left, window_right, (nk - nq) * bottom_right + diagonal_offset)
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d, o_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)

    q_block = Operand(q_desc, tma_origin(q_tma, b, h, q0 + start_m), q + b * stride_qb + q0 * stride_qn + h * stride_qh,
                      stride_qn, stride_qd, head_dim, None)
    b_q = load_block(q_block, 0, o_m, nq, o_d, UPCAST)
    k_at, v_at = tma_origin(k_tma, kb, hk, k0), tma_origin(v_tma, kb, hk, k0)
    # Paged keys are addressed from the cache's start; others from row k0 of their batch entry.
    p_k = k + hk * stride_kh
    p_v = v + hk * stride_vh
    if block_table is None:
        p_k += kb * stride_kb + k0 * stride_kn
        p_v += kb * stride_vb + k0 * stride_vn
    b_slope = tl.load(alibi + b * stride_ab + h * stride_ah) if alibi is not None else None
    p_mask = mask + b * stride_mb + h * stride_mh if mask is not None else None
    b_seed = tl.load(seed) if seed is not None else None
    value_rows = None
    if VALUES_INTERLEAVED:
        value_rows = tl.cdiv(nk, VALUE_GROUP) * VALUE_GROUP
    counter_row0 = bh.to(tl.int64) * seqlen_q  # dropout counters and probs rows: ((b * H + h) * NQ + i) * NK + j
    scoring = Scoring(nq, nk, band, scale, softcap, b_slope, p_mask, stride_mq, stride_mk)
    dropout = Dropout(b_seed, dropout_p, counter_row0, seqlen_k)
    args = Attend(b_q, o_m, Operand(k_desc, k_at, p_k, stride_kn, stride_kd, head_dim, stride_kb),
                  Operand(v_desc, v_at, p_v, stride_vn, stride_vd, head_dim_v, stride_vb),
                  KeySlots(k0, kb, nk, block_table, cache_entries, stride_bt, page_size, value_rows), dropout)

    # The keys this split sees, cut into the masked tiles around the band's whole tiles (``walk_band``).
    lo, hi = key_range(start_m, nk, band, BLOCK_M, BLOCK_N)
    lo = tl.maximum(lo, split * split_keys)  # split_keys is a multiple of BLOCK_N: lo stays aligned
    hi = tl.minimum(hi, (split + 1) * split_keys)
    hi = tl.where(start_m < nq, hi, 0)  # a varlen program past its sequence's end has nothing to do
    span = Span(lo, hi)
    full = full_key_range(start_m, nk, band, span, BLOCK_M, BLOCK_N)
    state = Softmax(tl.zeros([BLOCK_M, BLOCK_DV], tl.float32), tl.zeros([BLOCK_M], tl.float32),
                    tl.full([BLOCK_M], float("-inf"), tl.float32))
    if blocks is not None:  # a block mask: its listed key blocks only (BLOCK_M divides its query block)
        state = walk_listed(_attend, state, args, span, start_m // blocks.q_block, b, h, blocks, scoring, False,
                            BLOCK_N, UPCAST, PLAIN)
    else:
        state = walk_band(_attend, state, args, span, full, scoring, window_left is not None, BLOCK_N, UPCAST, PLAIN)
    b_acc, b_l, b_m = state.b_acc, state.b_l, state.b_m

    # Deferred normalisation: one division per row; a row that saw no key outputs 0 with lse = -inf (the sink
    # with one: it is one more score in the denominator, with no value, so only l and the output's scale move).
    b_kept = tl.full([BLOCK_M], 1.0, tl.float32)
    if sink is not None and tickets is None:
        b_sink = tl.load(sink + h * stride_sh + o_m * stride_sm, mask=o_m < nq, other=0.0) * LOG2E
        b_top = tl.maximum(b_m, b_sink)
        b_top = tl.where(b_top == float("-inf"), 0.0, b_top)
        b_kept = tl.math.exp2(b_m - b_top)
        b_l = b_l * b_kept + tl.math.exp2(b_sink - b_top)
        b_m = b_top
    m_empty = b_l == 0.0
    b_norm = tl.where(m_empty, 1.0, b_l)
    if b_seed is not None:
        b_norm = b_norm * (1.0 - dropout_p)
    b_out = b_acc * fast_div(b_kept, b_norm)[:, None]
    b_lse = tl.where(m_empty, float("-inf"), (b_m + tl.math.log2(tl.where(m_empty, 1.0, b_l))) * LN2)
    p_out = (out + split.to(tl.int64) * stride_os + b * stride_ob + (q0 + o_m[:, None].to(tl.int64)) * stride_on
             + h * stride_oh + o_dv[None, :] * stride_od)
    tl.store(p_out, b_out.to(out.dtype.element_ty), mask=(o_m[:, None] < nq) & (o_dv[None, :] < head_dim_v))
    tl.store(lse + split.to(tl.int64) * stride_ls + b * stride_lb + h * stride_lh + q0 + o_m, b_lse, mask=o_m < nq)

    if tickets is not None:  # split-KV: the last of the query block's splits to arrive merges them
        p_merged = (merged_out + b * stride_mob + (q0 + o_m[:, None].to(tl.int64)) * stride_mon + h * stride_moh
                    + o_dv[None, :] * stride_mod)
        _last_split_merges(tickets + tl.program_id(0), p_out - split.to(tl.int64) * stride_os,
                           lse + b * stride_lb + h * stride_lh + q0 + o_m, stride_os, stride_ls, p_merged,
                           merged_lse + b * stride_mlb + h * stride_mlh + q0 + o_m, sink,
                           h * stride_sh + o_m * stride_sm, o_m < nq, o_dv < head_dim_v)

    if probs is not None:
        # P = exp(S - lse) recomputed, dropped entries negated. probs was zero-filled by the launcher, so hidden
        # key blocks (and a block mask's empty ones) need no store.
        b_lse2 = tl.where(m_empty, float("inf"), b_lse * LOG2E)
        p_rows = probs + (counter_row0 + o_m[:, None]) * seqlen_k
        probs_args = Probs(b_q, o_m, Operand(None, None, p_k, stride_kn, stride_kd, head_dim, None), dropout, p_rows)
        if blocks is not None:
            walk_listed(_store_probs, b_lse2, probs_args, span, start_m // blocks.q_block, b, h, blocks, scoring,
                        False, BLOCK_N, UPCAST, False)
        else:
            _store_probs(b_lse2, probs_args, span, scoring, BLOCK_N, UPCAST, True, False)


@triton.jit
def _store_probs(b_lse2, args, span, scoring, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr,
                 PLAIN: tl.constexpr):
    """``return_attn_probs``'s P = exp(S - lse) (``b_lse2`` in log2 units, the carry, passed through) for the key
    tiles in ``span``, dropped entries negated, stored at ``args.p_rows`` (``args`` a ``Probs``) plus the key index;
    ``walk_listed``'s visit, or called once over the band."""
    b_q, o_m, dropout = args.b_q, args.o_m, args.dropout
    o_d = tl.arange(0, b_q.shape[1])
    for start_n in range(span.lo, span.hi, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        b_kt = load_block(args.k, start_n, o_n, scoring.nk, o_d, UPCAST, True)
        b_s, _ = score_tile(b_q, b_kt, o_m, o_n, scoring, MASKED, PLAIN)
        b_p = tl.math.exp2(b_s - b_lse2[:, None])
        if dropout.b_seed is not None:
            b_p = tl.where(dropout_keep(dropout, o_m[:, None], o_n[None, :]), b_p, -b_p)
        tl.store(args.p_rows + o_n[None, :], b_p.to(args.p_rows.dtype.element_ty),
                 mask=(o_m[:, None] < scoring.nq) & (o_n[None, :] < scoring.nk))
    return b_lse2


@triton.jit
def _last_split_merges(p_ticket, p_out, p_lse, stride_os, stride_ls, p_merged, p_merged_lse, sink, o_sink, m_rows,
                       m_cols):
    """Take this program's ticket at ``p_ticket``; the program that takes the last of the query block's splits
    merges every split's partials (``_merge_splits``: ``p_out``, ``p_lse`` at split 0) into ``p_merged`` and
    ``p_merged_lse`` (the sink, None without, at ``sink + o_sink``) and sets the counter back to zero."""
    # Each thread's partial stores come before the CTA barrier, which comes before the ticket's release: the program
    # that takes the last ticket (an acquire) reads every split's partials.
    tl.debug_barrier()
    arrived = tl.atomic_add(p_ticket, 1, sem="acq_rel")
    if arrived == tl.num_programs(2) - 1:
        tl.atomic_xchg(p_ticket, 0)  # zero again for the stream's next launch
        b_sink = None
        if sink is not None:
            b_sink = tl.load(sink + o_sink, mask=m_rows, other=float("-inf"))
        b_out, b_lse = _merge_splits(p_out, p_lse, stride_os, stride_ls, tl.num_programs(2), m_rows, m_cols, b_sink)
        tl.store(p_merged, b_out.to(p_merged.dtype.element_ty), mask=m_rows[:, None] & m_cols[None, :])
        tl.store(p_merged_lse, b_lse, mask=m_rows)


@triton.jit
def _merge_splits(p_out, p_lse, stride_os, stride_ls, splits, m_rows, m_cols, b_sink):
    """(O, lse) of a query block over every split's partial (O_s, lse_s), read at ``p_out`` (a block of pointers to
    split 0's rows) and ``p_lse`` plus s x ``stride_os``/``stride_ls``: lse = log sum_s exp(lse_s), O = sum_s
    exp(lse_s - lse) O_s.

    Weights are taken relative to the largest lse_s, so nothing overflows; splits that saw no key (lse_s = -inf)
    weigh 0, and a row no split saw gets O = 0, lse = -inf. ``b_sink`` (None without: the rows' learnable sink
    logits) is one more split, of value 0 and lse the sink. The partials come from other programs of the launch:
    read past L1 (``.cg``), which is not coherent across multiprocessors.
    """
    b_top = tl.full(m_rows.shape, float("-inf"), tl.float32)
    # Pointers step split by split (64-bit), where split x stride could pass 2^31.
    p_lse_s = p_lse
    for _ in range(0, splits):
        b_top = tl.maximum(b_top, tl.load(p_lse_s, mask=m_rows, other=float("-inf"), cache_modifier=".cg"))
        p_lse_s += stride_ls
    if b_sink is not None:
        b_top = tl.maximum(b_top, b_sink)
    b_top = tl.where(b_top == float("-inf"), 0.0, b_top)
    b_total = tl.zeros(m_rows.shape, tl.float32)
    if b_sink is not None:
        b_total = tl.exp(b_sink - b_top)
    b_acc = tl.zeros(p_out.shape, tl.float32)
    m_inside = m_rows[:, None] & m_cols[None, :]
    for _ in range(0, splits):
        b_w = tl.exp(tl.load(p_lse, mask=m_rows, other=float("-inf"), cache_modifier=".cg") - b_top)
        b_total += b_w
        b_acc += b_w[:, None] * tl.load(p_out, mask=m_inside, other=0.0, cache_modifier=".cg")
        p_lse += stride_ls
        p_out += stride_os
    m_empty = b_total == 0.0
    b_out = b_acc * fast_div(1.0, tl.where(m_empty, 1.0, b_total))[:, None]
    b_lse = tl.where(m_empty, float("-inf"), b_top + tl.log(tl.where(m_empty, 1.0, b_total)))
    return b_out, b_lse
