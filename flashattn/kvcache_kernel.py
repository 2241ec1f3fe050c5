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
    b = pid // new
    t = pid % new
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
    row, slot = row.to(tl.int64), slot.to(tl.int64)  # row x stride passes 2^31 in a large cache
    o_h = tl.arange(0, BLOCK_H)
    m_h = (o_h < heads) & ok
    o_d, o_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    _copy_rows(k + b * stride_kb + t * stride_kn, k_cache + row * stride_kcb + slot * stride_kcn, o_h, o_d,
               m_h[:, None] & (o_d < head_dim)[None, :], stride_kh, stride_kd, stride_kch, stride_kcd)
    _copy_rows(v + b * stride_vb + t * stride_vn, v_cache + row * stride_vcb + slot * stride_vcn, o_h, o_dv,
               m_h[:, None] & (o_dv < head_dim_v)[None, :], stride_vh, stride_vd, stride_vch, stride_vcd)
