"""FlashAttention-2 forward and backward as Triton kernels.

One program owns one (query block, batch x head) pair in the forward and the dQ pass, one (key block, batch x
key/value head) pair in the dK/dV pass. Every kernel builds its score tiles with ``_score_tile``, the single
place where scale, softcap, the causal/window band, ALiBi and a user mask are applied; a ``tl.constexpr`` switch
turns each feature off at compile time, and masks are applied only on tiles that straddle a boundary.

The forward also reads keys from a KV cache (per-sequence bounds, a cache row index, or a paged block table with
any page size) and can split the keys of one query block across programs (flash-decoding): each split writes a
partial O and lse and ``merge_splits_kernel`` combines them.

Dropout draws ``tl.rand(seed, ((b * H + h) * Nq + i) * Nk + j)``: the same numbers as
``flashattn.backends.philox``, so this backend and the CPU path drop exactly the same weights.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Kinds of user mask (SDPA's attn_mask). Globals read inside @jit code must be tl.constexpr instances.
MASK_NONE = tl.constexpr(0)
MASK_BOOL = tl.constexpr(1)
MASK_ADD = tl.constexpr(2)


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^{2x} + 1): saturates to +-1 for large |x| without overflow (inf -> 1, 0 -> -1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _load_rows(base, row_offsets, row_ok, cols, stride_c, n_cols, UPCAST: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Rows at ``base + row_offsets`` (0 where not ``row_ok``), columns ``cols`` (0 past ``n_cols``): a
    (len(rows), len(cols)) tile, or its transpose (as K^T and V^T are used in matmuls)."""
    if TRANSPOSE:
        x = tl.load(base + row_offsets[None, :] + cols[:, None] * stride_c,
                    mask=row_ok[None, :] & (cols[:, None] < n_cols), other=0.0)
    else:
        x = tl.load(base + row_offsets[:, None] + cols[None, :] * stride_c,
                    mask=row_ok[:, None] & (cols[None, :] < n_cols), other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _load_tile(base, rows, cols, stride_r, stride_c, n_rows, n_cols, UPCAST: tl.constexpr):
    """``base[rows, cols]`` as a (len(rows), len(cols)) tile, 0 outside [0, n_rows) x [0, n_cols)."""
    return _load_rows(base, rows * stride_r, rows < n_rows, cols, stride_c, n_cols, UPCAST, False)


@triton.jit
def _load_tile_t(base, rows, cols, stride_r, stride_c, n_rows, n_cols, UPCAST: tl.constexpr):
    """The transpose of ``_load_tile``: a (len(cols), len(rows)) tile."""
    return _load_rows(base, rows * stride_r, rows < n_rows, cols, stride_c, n_cols, UPCAST, True)


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    """a @ b accumulated in fp32; fp32 operands in IEEE precision (TF32 would cost fp32 inputs 3 digits)."""
    if FP32_DOT:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _tile_needs_mask(start_m, start_n, NQ, NK, shift, window_left, window_right,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """True unless every (i, j) of the tile is inside the sequences and inside the band."""
    need = (start_m + BLOCK_M > NQ) | (start_n + BLOCK_N > NK)
    if HAS_RIGHT:
        need = need | ((start_n + BLOCK_N - 1) - start_m - shift > window_right)
    if HAS_LEFT:
        need = need | (start_n - (start_m + BLOCK_M - 1) - shift < -window_left)
    return need


@triton.jit
def _score_tile(
    q, k, offs_m, offs_n, start_m, start_n, b, h,
    NQ, NK, shift, window_left, window_right, scale, softcap, slope,
    Mask, stride_mb, stride_mh, stride_mq, stride_mk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK_KIND: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """Scores of q (BLOCK_M, D) against k^T (D, BLOCK_N), fp32, -inf where masked.

    Returns (scores, capped): ``capped`` is the softcapped value before ALiBi and the user mask, which the
    backward needs for d tanh (equal to scores when there is no softcap).
    """
    s = _dot(q, k, FP32_DOT) * scale
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    capped = s
    if HAS_ALIBI:
        dist = offs_m[:, None] + shift - offs_n[None, :]
        s = s - slope * tl.abs(dist).to(tl.float32)
    if MASK_KIND != MASK_NONE:
        ptrs = Mask + b * stride_mb + h * stride_mh + offs_m[:, None] * stride_mq + offs_n[None, :] * stride_mk
        inside = (offs_m[:, None] < NQ) & (offs_n[None, :] < NK)
        if MASK_KIND == MASK_BOOL:
            allowed = tl.load(ptrs, mask=inside, other=0)
            s = tl.where(allowed != 0, s, float("-inf"))
        else:
            s = s + tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
    if _tile_needs_mask(start_m, start_n, NQ, NK, shift, window_left, window_right,
                        BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT):
        d = offs_n[None, :] - offs_m[:, None] - shift
        keep = (offs_m[:, None] < NQ) & (offs_n[None, :] < NK)
        if HAS_RIGHT:
            keep = keep & (d <= window_right)
        if HAS_LEFT:
            keep = keep & (d >= -window_left)
        s = tl.where(keep, s, float("-inf"))
    return s, capped


@triton.jit
def _dropout_keep(seed, b, h, H, NQ, NK, offs_m, offs_n, dropout_p):
    row = (b * H + h).to(tl.int64) * NQ + offs_m.to(tl.int64)
    return tl.rand(seed, row[:, None] * NK + offs_n[None, :].to(tl.int64)) >= dropout_p


@triton.jit
def _sequence(b, CuQ, KStart, KEnd, NQ, NK, Q_PACKED: tl.constexpr, K_RANGE: tl.constexpr):
    """(q start, q length, k start, k length) of batch entry ``b``.

    Queries: rows ``CuQ[b]:CuQ[b + 1]`` of a packed (varlen) q, else all NQ rows of entry b. Keys: positions
    ``KStart[b]:KEnd[b]`` (varlen offsets, or a KV cache's per-sequence bounds), else all NK. Starts are int64
    so that start * stride cannot overflow on long packed batches.
    """
    q0 = 0
    nq = NQ
    k0 = 0
    nk = NK
    if Q_PACKED:
        q0 = tl.load(CuQ + b).to(tl.int64)
        nq = tl.load(CuQ + b + 1) - tl.load(CuQ + b)
    if K_RANGE:
        k0 = tl.load(KStart + b).to(tl.int64)
        nk = tl.load(KEnd + b) - tl.load(KStart + b)
    return q0, nq, k0, nk


@triton.jit
def _key_slots(offs_n, nk, k0, kb, BlockTable, stride_bt, page_size, PAGED: tl.constexpr):
    """Where logical keys ``offs_n`` (cache positions k0 + offs_n) live, as (page, row, exists): the memory
    offset of a key is ``page * stride_page + row * stride_row``.

    Dense: page 0 and row offs_n, from a base that already points at row k0 of the batch entry. Paged: row
    ``p % page_size`` of page ``BlockTable[kb, p // page_size]``, from the cache's start; any page size.
    """
    ok = offs_n < nk
    if PAGED:
        pos = k0 + offs_n
        page = tl.load(BlockTable + kb * stride_bt + pos // page_size, mask=ok, other=0).to(tl.int64)
        row = pos % page_size
    else:
        page = 0
        row = offs_n
    return page, row, ok


@triton.jit
def _key_range(start_m, NK, shift, window_left, window_right,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """[lo, hi) of key blocks any row of the query block may see, lo aligned to BLOCK_N; skips hidden blocks."""
    lo = 0
    hi = NK
    if HAS_LEFT:
        lo = tl.maximum(start_m + shift - window_left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(start_m + BLOCK_M - 1 + shift + window_right + 1, NK)
    return lo, hi


@triton.jit
def _query_range(start_n, NQ, shift, window_left, window_right,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """[lo, hi) of query blocks that may see any key of the key block, lo aligned to BLOCK_M."""
    lo = 0
    hi = NQ
    if HAS_RIGHT:
        lo = tl.maximum(start_n - shift - window_right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(start_n + BLOCK_N - 1 - shift + window_left + 1, NQ)
    return lo, hi


@triton.jit
def attention_forward_kernel(
    Q, K, V, Out, Lse, Probs, Alibi, Mask, Seed, CuQ, KStart, KEnd, KBatch, BlockTable,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_os, stride_ob, stride_on, stride_oh, stride_od,
    stride_ls, stride_lb, stride_lh,
    stride_ab, stride_ah,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_bt, page_size, split_keys,
    H, G, NQ, NK, D, DV, align_br, diag_offset, window_left, window_right,
    scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr, WRITE_PROBS: tl.constexpr, UPCAST: tl.constexpr,
    FP32_DOT: tl.constexpr, Q_PACKED: tl.constexpr, K_RANGE: tl.constexpr, K_BATCH: tl.constexpr,
    PAGED: tl.constexpr,
):
    """O and lse of one query block of one head over the keys of split ``program_id(2)``.

    Keys come from dense K/V, a packed varlen batch (K_RANGE with offsets), or a KV cache (K_RANGE with per-entry
    bounds, K_BATCH to pick the cache entry, PAGED for a block table). With split-KV, split s sees only keys
    [s * split_keys, (s + 1) * split_keys) and writes its partial O and lse at ``s * stride_os``/``stride_ls``
    for ``merge_splits_kernel``; one split (``split_keys`` >= NK) is plain FlashAttention-2.
    """
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    split = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = h // G
    # NQ, NK lay out the dropout counters and Probs; nq, nk are this sequence's lengths (equal unless varlen).
    q0, nq, k0, nk = _sequence(b, CuQ, KStart, KEnd, NQ, NK, Q_PACKED, K_RANGE)
    kb = b
    if K_BATCH:
        kb = tl.load(KBatch + b).to(tl.int64)
    shift = (nk - nq) * align_br + diag_offset
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q = _load_tile(Q + b * stride_qb + q0 * stride_qn + h * stride_qh, offs_m, offs_d, stride_qn, stride_qd, nq,
                   D, UPCAST)
    # Paged keys are addressed from the cache's start; others from row k0 of their batch entry.
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh
    if not PAGED:
        k_base += kb * stride_kb + k0 * stride_kn
        v_base += kb * stride_vb + k0 * stride_vn
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + b * stride_ab + h * stride_ah)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(Seed)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, hi = _key_range(start_m, nk, shift, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    lo = tl.maximum(lo, split * split_keys)  # split_keys is a multiple of BLOCK_N: lo stays aligned
    hi = tl.minimum(hi, (split + 1) * split_keys)
    hi = tl.where(start_m < nq, hi, 0)  # a varlen program past its sequence's end has nothing to do
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        page, row, ok = _key_slots(offs_n, nk, k0, kb, BlockTable, stride_bt, page_size, PAGED)
        k = _load_rows(k_base, page * stride_kb + row * stride_kn, ok, offs_d, stride_kd, D, UPCAST, True)
        v = _load_rows(v_base, page * stride_vb + row * stride_vn, ok, offs_dv, stride_vd, DV, UPCAST, False)
        s, _ = _score_tile(q, k, offs_m, offs_n, start_m, start_n, b, h, nq, nk, shift, window_left,
                           window_right, scale, softcap, slope, Mask, stride_mb, stride_mh, stride_mq, stride_mk,
                           BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, FP32_DOT)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen only masked keys keep max -inf: shift by 0 there so exp gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, b, h, H, NQ, NK, offs_m, offs_n, dropout_p)
            p = tl.where(keep, p / (1.0 - dropout_p), 0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32_DOT)
        m_i = m_new

    # Deferred normalisation: one division per row; a row that saw no key outputs 0 with lse = -inf.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    o_ptrs = (Out + split * stride_os + b * stride_ob + (q0 + offs_m[:, None]) * stride_on + h * stride_oh
              + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m[:, None] < nq) & (offs_dv[None, :] < DV))
    tl.store(Lse + split * stride_ls + b * stride_lb + h * stride_lh + q0 + offs_m, lse, mask=offs_m < nq)

    if WRITE_PROBS:
        # Testing aid (return_attn_probs): P = exp(S - lse) recomputed, dropped entries negated. Probs was
        # zero-filled by the launcher, so hidden key blocks need no store. Never with a cache or splits.
        lse_safe = tl.where(empty, float("inf"), lse)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            k = _load_tile_t(k_base, offs_n, offs_d, stride_kn, stride_kd, nk, D, UPCAST)
            s, _ = _score_tile(q, k, offs_m, offs_n, start_m, start_n, b, h, nq, nk, shift, window_left,
                               window_right, scale, softcap, slope, Mask, stride_mb, stride_mh, stride_mq,
                               stride_mk, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND,
                               FP32_DOT)
            p = tl.exp(s - lse_safe[:, None])
            if HAS_DROPOUT:
                keep = _dropout_keep(seed, b, h, H, NQ, NK, offs_m, offs_n, dropout_p)
                p = tl.where(keep, p, -p)
            p_ptrs = Probs + (bh * NQ + offs_m[:, None]).to(tl.int64) * NK + offs_n[None, :]
            tl.store(p_ptrs, p.to(Probs.dtype.element_ty), mask=(offs_m[:, None] < nq) & (offs_n[None, :] < nk))


@triton.jit
def merge_splits_kernel(
    OutAcc, LseAcc, Out, Lse,
    stride_as, stride_ab, stride_an, stride_ah, stride_ad,
    stride_ls, stride_lb, stride_lh,
    stride_ob, stride_on, stride_oh, stride_od,
    stride_rb, stride_rh,
    H, NQ, DV, n_splits,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Combine the partial (O_s, lse_s) of every split: lse = log sum_s exp(lse_s), O = sum_s exp(lse_s - lse) O_s.

    Weights are taken relative to the largest lse_s, so nothing overflows; splits that saw no key (lse_s = -inf)
    weigh 0, and a row no split saw gets O = 0, lse = -inf. Query positions have unit stride in LseAcc and Lse.
    """
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = offs_m < NQ
    lse_rows = LseAcc + b * stride_lb + h * stride_lh + offs_m
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(0, n_splits):
        top = tl.maximum(top, tl.load(lse_rows + s * stride_ls, mask=rows, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    tile = OutAcc + b * stride_ab + h * stride_ah + offs_m[:, None] * stride_an + offs_dv[None, :] * stride_ad
    inside = rows[:, None] & (offs_dv[None, :] < DV)
    for s in range(0, n_splits):
        w = tl.exp(tl.load(lse_rows + s * stride_ls, mask=rows, other=float("-inf")) - top)
        total += w
        acc += w[:, None] * tl.load(tile + s * stride_as, mask=inside, other=0.0)
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)[:, None]
    lse = tl.where(empty, float("-inf"), top + tl.log(tl.where(empty, 1.0, total)))
    tl.store(Out + b * stride_ob + offs_m[:, None] * stride_on + h * stride_oh + offs_dv[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=inside)
    tl.store(Lse + b * stride_rb + h * stride_rh + offs_m, lse, mask=rows)


@triton.jit
def attention_backward_preprocess_kernel(
    Out, DOut, DLse, Delta,
    stride_ob, stride_on, stride_oh, stride_od,
    stride_db, stride_dn, stride_dh, stride_dd,
    H, NQ, DV,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """delta_i = rowsum(dO_i * O_i) - dlse_i, in fp32 (the dlse term is the gradient of the returned lse)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    o = _load_tile(Out + b * stride_ob + h * stride_oh, offs_m, offs_dv, stride_on, stride_od, NQ, DV, True)
    do = _load_tile(DOut + b * stride_db + h * stride_dh, offs_m, offs_dv, stride_dn, stride_dd, NQ, DV, True)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta = delta - tl.load(DLse + bh * NQ + offs_m, mask=offs_m < NQ, other=0.0).to(tl.float32)
    tl.store(Delta + bh * NQ + offs_m, delta, mask=offs_m < NQ)


@triton.jit
def attention_backward_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV_, Alibi, Mask, Seed, CuQ, CuK,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_db, stride_dn, stride_dh, stride_dd,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    stride_lb, stride_lh,
    stride_ab, stride_ah,
    stride_mb, stride_mh, stride_mq, stride_mk,
    H, HK, G, NQ, NK, D, DV, align_br, diag_offset, window_left, window_right,
    scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, FP32_DOT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """dK_j, dV_j for one key block of one key/value head, summed over the G query heads of its group inside
    the program (no atomics, so the result is deterministic)."""
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    b = bhk // HK
    hk = bhk % HK
    q0, nq, k0, nk = _sequence(b, CuQ, CuK, CuK + 1, NQ, NK, IS_VARLEN, IS_VARLEN)
    shift = (nk - nq) * align_br + diag_offset
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # k^T (D, BLOCK_N) for the score tile, v^T (DV, BLOCK_N) for dP = dO V^T.
    kt = _load_tile_t(K + b * stride_kb + k0 * stride_kn + hk * stride_kh, offs_n, offs_d, stride_kn, stride_kd,
                      nk, D, UPCAST)
    vt = _load_tile_t(V + b * stride_vb + k0 * stride_vn + hk * stride_vh, offs_n, offs_dv, stride_vn, stride_vd,
                      nk, DV, UPCAST)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(Seed)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo, hi = _query_range(start_n, nq, shift, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    hi = tl.where(start_n < nk, hi, 0)  # a varlen program past its sequence's keys has nothing to do
    for g in range(0, G):
        h = hk * G + g
        row_stats = b * stride_lb + h * stride_lh + q0  # lse and delta of this head's queries
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Alibi + b * stride_ab + h * stride_ah)
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            q = _load_tile(Q + b * stride_qb + q0 * stride_qn + h * stride_qh, offs_m, offs_d, stride_qn, stride_qd,
                           nq, D, UPCAST)
            do = _load_tile(DOut + b * stride_db + q0 * stride_dn + h * stride_dh, offs_m, offs_dv, stride_dn,
                            stride_dd, nq, DV, UPCAST)
            lse = tl.load(Lse + row_stats + offs_m, mask=offs_m < nq, other=float("inf"))
            lse = tl.where(lse == float("-inf"), float("inf"), lse)  # rows that see no key: P = 0
            delta = tl.load(Delta + row_stats + offs_m, mask=offs_m < nq, other=0.0)
            s, capped = _score_tile(q, kt, offs_m, offs_n, start_m, start_n, b, h, nq, nk, shift, window_left,
                                    window_right, scale, softcap, slope, Mask, stride_mb, stride_mh, stride_mq,
                                    stride_mk, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                                    MASK_KIND, FP32_DOT)
            p = tl.exp(s - lse[:, None])
            dp = _dot(do, vt, FP32_DOT)
            pd = p
            if HAS_DROPOUT:
                keep = _dropout_keep(seed, b, h, H, NQ, NK, offs_m, offs_n, dropout_p)
                pd = tl.where(keep, p / (1.0 - dropout_p), 0.0)
                dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
            ds = p * (dp - delta[:, None])
            if HAS_SOFTCAP:
                t = capped / softcap
                ds = ds * (1.0 - t * t)
            dv += _dot(tl.trans(pd).to(do.dtype), do, FP32_DOT)
            dk += _dot(tl.trans(ds).to(q.dtype), q, FP32_DOT)
    dk = dk * scale
    rows = k0 + offs_n[:, None]
    tl.store(DK + b * stride_dkb + rows * stride_dkn + hk * stride_dkh + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=(offs_n[:, None] < nk) & (offs_d[None, :] < D))
    tl.store(DV_ + b * stride_dvb + rows * stride_dvn + hk * stride_dvh + offs_dv[None, :] * stride_dvd,
             dv.to(DV_.dtype.element_ty), mask=(offs_n[:, None] < nk) & (offs_dv[None, :] < DV))


@triton.jit
def attention_backward_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, Alibi, Mask, Seed, CuQ, CuK,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_db, stride_dn, stride_dh, stride_dd,
    stride_dqb, stride_dqn, stride_dqh, stride_dqd,
    stride_lb, stride_lh,
    stride_ab, stride_ah,
    stride_mb, stride_mh, stride_mq, stride_mk,
    H, G, NQ, NK, D, DV, align_br, diag_offset, window_left, window_right,
    scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr, UPCAST: tl.constexpr, FP32_DOT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """dQ_i for one query block of one head: its own pass over the keys, so dQ needs no atomics."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    q0, nq, k0, nk = _sequence(b, CuQ, CuK, CuK + 1, NQ, NK, IS_VARLEN, IS_VARLEN)
    shift = (nk - nq) * align_br + diag_offset
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_tile(Q + b * stride_qb + q0 * stride_qn + h * stride_qh, offs_m, offs_d, stride_qn, stride_qd, nq,
                   D, UPCAST)
    do = _load_tile(DOut + b * stride_db + q0 * stride_dn + h * stride_dh, offs_m, offs_dv, stride_dn, stride_dd,
                    nq, DV, UPCAST)
    row_stats = b * stride_lb + h * stride_lh + q0
    lse = tl.load(Lse + row_stats + offs_m, mask=offs_m < nq, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(Delta + row_stats + offs_m, mask=offs_m < nq, other=0.0)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + b * stride_ab + h * stride_ah)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(Seed)
    k_base = K + b * stride_kb + k0 * stride_kn + hk * stride_kh
    v_base = V + b * stride_vb + k0 * stride_vn + hk * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(start_m, nk, shift, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    hi = tl.where(start_m < nq, hi, 0)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        kt = _load_tile_t(k_base, offs_n, offs_d, stride_kn, stride_kd, nk, D, UPCAST)
        vt = _load_tile_t(v_base, offs_n, offs_dv, stride_vn, stride_vd, nk, DV, UPCAST)
        s, capped = _score_tile(q, kt, offs_m, offs_n, start_m, start_n, b, h, nq, nk, shift, window_left,
                                window_right, scale, softcap, slope, Mask, stride_mb, stride_mh, stride_mq, stride_mk,
                                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, MASK_KIND, FP32_DOT)
        p = tl.exp(s - lse[:, None])
        dp = _dot(do, vt, FP32_DOT)
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, b, h, H, NQ, NK, offs_m, offs_n, dropout_p)
            dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            t = capped / softcap
            ds = ds * (1.0 - t * t)
        dq += _dot(ds.to(kt.dtype), tl.trans(kt), FP32_DOT)
    dq = dq * scale
    tl.store(DQ + b * stride_dqb + (q0 + offs_m[:, None]) * stride_dqn + h * stride_dqh + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=(offs_m[:, None] < nq) & (offs_d[None, :] < D))
