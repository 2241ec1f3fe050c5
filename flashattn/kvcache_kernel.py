"""The KV-cache append as one Triton kernel: a GPU call's new keys and values written into the cache in place by
one launch instead of a handful of torch ops (positions, a gather of page ids, two scatters).

Each program copies one new token (all its heads) of k and v to its cache slot: position ``at[b] + t`` of row
``batch_idx[b]`` (default b) of a dense cache, or of page ``block_table[b, p // page_size]`` of a paged one. A slot
outside the cache (a position past the capacity, a row or page id that does not exist) is not written: the values
are checked before (``flashattn.checks.on_device``), and whatever they hold, nothing is written outside the cache.
"""

from __future__ import annotations

import triton
import triton.language as tl

_INTS = ("stride_kb", "stride_kn", "stride_kh", "stride_kd", "stride_vb", "stride_vn", "stride_vh", "stride_vd",
         "stride_kcb", "stride_kcn", "stride_kch", "stride_kcd", "stride_vcb", "stride_vcn", "stride_vch",
         "stride_vcd", "stride_bt", "new", "heads", "head_dim", "head_dim_v", "capacity", "entries", "page_size")


@triton.jit
def _copy_rows(src, dst, o_h, o_d, m, stride_sh, stride_sd, stride_dh, stride_dd):
    x = tl.load(src + o_h[:, None] * stride_sh + o_d[None, :] * stride_sd, mask=m)
    tl.store(dst + o_h[:, None] * stride_dh + o_d[None, :] * stride_dd, x.to(dst.dtype.element_ty), mask=m)


@triton.jit
def _slot(at, batch_idx, table, b, t, stride_bt, capacity, entries, page_size):
    """(cache row or page, slot in it, whether it is inside the cache, the position) of new token t of entry b."""
    position = tl.load(at + b) + t
    ok = (position >= 0) & (position < capacity)
    if table is not None:
        row = tl.load(table + b.to(tl.int64) * stride_bt + position // page_size, mask=ok, other=-1)
        slot = position % page_size
    else:
        row = b
        if batch_idx is not None:
            row = tl.load(batch_idx + b)
        slot = position
    ok = ok & (row >= 0) & (row < entries)
    return row.to(tl.int64), slot.to(tl.int64), ok, position  # row x stride passes 2^31 in a large cache


@triton.jit(do_not_specialize=_INTS, do_not_specialize_on_alignment=("k", "v", "k_cache", "v_cache", "at",
                                                                     "batch_idx", "table"))
def append_kernel(k, v, k_cache, v_cache, at, batch_idx, table,
                  stride_kb, stride_kn, stride_kh, stride_kd, stride_vb, stride_vn, stride_vh, stride_vd,
                  stride_kcb, stride_kcn, stride_kch, stride_kcd, stride_vcb, stride_vcn, stride_vch, stride_vcd,
                  stride_bt, new, heads, head_dim, head_dim_v, capacity, entries, page_size,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Token ``program_id(0) % new`` of batch entry ``program_id(0) // new``: k, v (B, new, Hk, D) into k_cache,
    v_cache ((B_cache, capacity, Hk, D), or (pages, page_size, Hk, D) with ``table``) at ``at[b] + t``."""
    pid = tl.program_id(0)
    b = (pid // new).to(tl.int64)  # b x a batch stride passes 2^31 in a large q or k
    t = pid % new
    row, slot, ok, _ = _slot(at, batch_idx, table, b, t, stride_bt, capacity, entries, page_size)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < tl.where(ok, heads, 0)  # (a scalar & a vector mask: not a mask to Triton 3.9's interpreter)
    o_d, o_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    _copy_rows(k + b * stride_kb + t * stride_kn, k_cache + row * stride_kcb + slot * stride_kcn, o_h, o_d,
               m_h[:, None] & (o_d < head_dim)[None, :], stride_kh, stride_kd, stride_kch, stride_kcd)
    _copy_rows(v + b * stride_vb + t * stride_vn, v_cache + row * stride_vcb + slot * stride_vcn, o_h, o_dv,
               m_h[:, None] & (o_dv < head_dim_v)[None, :], stride_vh, stride_vd, stride_vch, stride_vcd)


@triton.jit
def _rotated(x, o_h, o_d, m, stride_h, stride_d, cos, sin, position, stride_c, positions, half,
             INTERLEAVED: tl.constexpr):
    """The heads of x at one position, float32, their first 2 * half dims rotated as ``rotary.apply_rotary``
    rotates them: pair (a, b) -> (a cos - b sin, a sin + b cos), the pairs (2i, 2i + 1) or (i, i + half)."""
    if INTERLEAVED:
        partner, angle, first = o_d ^ 1, o_d // 2, (o_d % 2) == 0
    else:
        partner = tl.where(o_d < half, o_d + half, o_d - half)
        angle, first = tl.where(o_d < half, o_d, o_d - half), o_d < half
    turned = o_d < 2 * half
    row = tl.minimum(tl.maximum(position, 0), positions - 1).to(tl.int64) * stride_c  # checked; never outside
    c = tl.load(cos + row + angle, mask=turned, other=1.0).to(tl.float32)
    s = tl.load(sin + row + angle, mask=turned, other=0.0).to(tl.float32)
    s = tl.where(first, -s, s)
    a = tl.load(x + o_h[:, None] * stride_h + o_d[None, :] * stride_d, mask=m).to(tl.float32)
    b = tl.load(x + o_h[:, None] * stride_h + partner[None, :] * stride_d, mask=m & turned[None, :],
                other=0.0).to(tl.float32)
    return a * c[None, :] + b * s[None, :]


_ROTARY_INTS = ("stride_qb", "stride_qn", "stride_qh", "stride_qd", "stride_rb", "stride_rn", "stride_rh",
                "stride_rd", "stride_c", "batch", "nq", "heads_q", "positions", "half")


@triton.jit(do_not_specialize=_ROTARY_INTS + _INTS,
            do_not_specialize_on_alignment=("q", "rotated", "k", "v", "k_cache", "v_cache", "at", "batch_idx", "table",
                                            "cos", "sin"))
def rotary_append_kernel(q, rotated, k, v, k_cache, v_cache, at, batch_idx, table, cos, sin,
                         stride_qb, stride_qn, stride_qh, stride_qd, stride_rb, stride_rn, stride_rh, stride_rd,
                         stride_c, batch, nq, heads_q, positions, half,
                         stride_kb, stride_kn, stride_kh, stride_kd, stride_vb, stride_vn, stride_vh, stride_vd,
                         stride_kcb, stride_kcn, stride_kch, stride_kcd, stride_vcb, stride_vcn, stride_vch, stride_vcd,
                         stride_bt, new, heads, head_dim, head_dim_v, capacity, entries, page_size,
                         Q_ADVANCE: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_HQ: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Rotary and append in one launch (``flash_attn_with_kvcache`` with rotary_cos/sin): the first batch x new
    programs append new token t of entry b (k rotated at position at[b] + t, v as it is, as ``append_kernel``),
    the next batch x nq rotate query t of entry b (at position at[b] + t with ``Q_ADVANCE``, else at[b]) from q
    into ``rotated`` (B, nq, H, D). cos, sin: (positions, half) tables."""
    pid = tl.program_id(0)
    o_d = tl.arange(0, BLOCK_D)
    first_query = 0
    if k is not None:  # (a None k: no program appends)
        first_query = batch * new
        if pid < first_query:
            b, t = (pid // new).to(tl.int64), pid % new
            row, slot, ok, position = _slot(at, batch_idx, table, b, t, stride_bt, capacity, entries, page_size)
            o_h = tl.arange(0, BLOCK_H)
            m_h = o_h < tl.where(ok, heads, 0)
            m = m_h[:, None] & (o_d < head_dim)[None, :]
            x = _rotated(k + b * stride_kb + t * stride_kn, o_h, o_d, m, stride_kh, stride_kd, cos, sin, position,
                         stride_c, positions, half, INTERLEAVED)
            dst = k_cache + row * stride_kcb + slot * stride_kcn
            tl.store(dst + o_h[:, None] * stride_kch + o_d[None, :] * stride_kcd, x.to(k_cache.dtype.element_ty),
                     mask=m)
            o_dv = tl.arange(0, BLOCK_DV)
            _copy_rows(v + b * stride_vb + t * stride_vn, v_cache + row * stride_vcb + slot * stride_vcn, o_h, o_dv,
                       m_h[:, None] & (o_dv < head_dim_v)[None, :], stride_vh, stride_vd, stride_vch, stride_vcd)
    if pid >= first_query:
        index = pid - first_query
        b, t = (index // nq).to(tl.int64), index % nq
        position = tl.load(at + b)
        if Q_ADVANCE:
            position += t
        o_h = tl.arange(0, BLOCK_HQ)
        m = (o_h < heads_q)[:, None] & (o_d < head_dim)[None, :]
        x = _rotated(q + b * stride_qb + t * stride_qn, o_h, o_d, m, stride_qh, stride_qd, cos, sin, position,
                     stride_c, positions, half, INTERLEAVED)
        dst = rotated + b * stride_rb + t * stride_rn
        tl.store(dst + o_h[:, None] * stride_rh + o_d[None, :] * stride_rd, x.to(rotated.dtype.element_ty), mask=m)
