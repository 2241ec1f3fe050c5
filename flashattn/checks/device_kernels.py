"""Triton kernels that check index values where they live: the lengths, offsets, rows and page ids of a GPU call are
checked on the GPU, in stream order before any kernel reads them, so a call never waits for a device-to-host copy.

Each kernel is one program that walks the batch in blocks. On a GPU a bad value fails a ``tl.device_assert`` (the
kernels are compiled with ``debug=True``): the process stops with the rule that was broken, as a bad index into a
PyTorch CUDA op does, and nothing after the check runs. Given an ``errors`` buffer (int64 (4,)), the kernels also
write the first broken rule there as (code, row, column, value): that is how the tests read them under Triton's
interpreter, where assertions are off. ``on_device.describe`` words a record.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Codes, in the order the host checks (``values.py``) report them: the lowest code, then the lowest row, is "first".
CODES = ("cache_length", "cache_leftpad", "cache_row", "cache_repeated_row", "pages_short", "page_id", "rotary_reach",
         "q_start", "q_order", "q_end", "k_start", "k_order", "k_end", "q_longest", "k_longest")
(CACHE_LENGTH, CACHE_LEFTPAD, CACHE_ROW, CACHE_REPEATED_ROW, PAGES_SHORT, PAGE_ID, ROTARY_REACH, Q_START, Q_ORDER,
 Q_END, K_START, K_ORDER, K_END, Q_LONGEST, K_LONGEST) = (tl.constexpr(i + 1) for i in range(len(CODES)))
# A failure's key: code, row and column in 14 + 24 + 24 bits, so the lowest key is the first failure.
_ROW = tl.constexpr(1 << 24)
_CODE = tl.constexpr(1 << 48)
_NONE = tl.constexpr(1 << 62)  # above every real key: no failure


@triton.jit
def _keep_first(first, code, row, column, value, mask):
    """``first`` (key, value) updated with this block's failures (``code`` > 0 where a rule is broken): the one of
    lowest code, then row, then column."""
    key = tl.where(mask & (code > 0), code.to(tl.int64) * _CODE + row.to(tl.int64) * _ROW + column, _NONE)
    low = tl.min(key, 0)
    return _better(first, low, tl.sum(tl.where(key == low, value.to(tl.int64), 0), 0))


@triton.jit
def _better(first, key, value):
    better = key < first[0]
    return tl.where(better, key, first[0]), tl.where(better, value, first[1])


@triton.jit
def _write_first(errors, first):
    if errors is not None:
        key, value = first
        found = key < _NONE
        tl.store(errors + 0, tl.where(found, key // _CODE, 0))
        tl.store(errors + 1, tl.where(found, key % _CODE // _ROW, 0))
        tl.store(errors + 2, tl.where(found, key % _ROW, 0))
        tl.store(errors + 3, tl.where(found, value, 0))


@triton.jit
def _pages_in_use(table, stride_bt, o_b, m_b, ends, first, num_pages, page_size, pages_per_seq, FN: tl.constexpr,
                  BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr):
    """The pages sequence b's positions 0..ends[b] - 1 need fit its row of ``table`` and name real pages (the
    pages beyond are not read: serving engines pad them with anything)."""
    needed = (ends + page_size - 1) // page_size
    short = m_b & (needed > pages_per_seq)
    tl.device_assert(~short, FN + ": a sequence needs more pages than block_table has per sequence")
    first = _keep_first(first, tl.where(short, PAGES_SHORT, 0), o_b, 0, needed, m_b)
    for p0 in range(0, pages_per_seq, BLOCK_P):
        o_p = p0 + tl.arange(0, BLOCK_P)
        m = m_b[:, None] & (o_p[None, :] < tl.minimum(needed, pages_per_seq)[:, None])
        page = tl.load(table + o_b[:, None].to(tl.int64) * stride_bt + o_p[None, :], mask=m, other=0)
        bad = m & ((page < 0) | (page >= num_pages))
        tl.device_assert(~bad, FN + ": block_table holds a page id in use outside the cache's pages")
        key = tl.where(bad, PAGE_ID * _CODE + o_b[:, None].to(tl.int64) * _ROW + o_p[None, :], _NONE)
        low = tl.min(tl.min(key, 1), 0)
        first = _better(first, low, tl.sum(tl.sum(tl.where(key == low, page.to(tl.int64), 0), 1), 0))
    return first


_CACHE_INTS = ("batch", "capacity", "new", "cache_rows", "num_pages", "page_size", "pages_per_seq", "stride_bt",
               "rotary_positions", "rotary_reach")


# Compiled once per absent-tensor pattern and constants: no specialization on values (``on_device._launch``).
@triton.jit(debug=True, do_not_specialize=_CACHE_INTS,
            do_not_specialize_on_alignment=("seqlens", "leftpad", "batch_idx", "table", "errors"))
def check_cache_kernel(seqlens, leftpad, batch_idx, table, errors, batch, capacity, new, cache_rows, num_pages,
                       page_size, pages_per_seq, stride_bt, rotary_positions, rotary_reach,
                       FN: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr):
    """``flash_attn_with_kvcache``'s rules (``values.check_cache_values``): 0 <= cache_seqlens[b] and
    cache_seqlens[b] + new <= capacity; 0 <= cache_leftpad[b] <= cache_seqlens[b]; cache_batch_idx in
    [0, cache_rows), distinct when appending; the pages in use real; the rotary table long enough
    (``rotary_positions`` < 0: no rotary)."""
    first = (tl.full([], _NONE, tl.int64), tl.full([], 0, tl.int64))
    for b0 in range(0, batch, BLOCK_B):
        o_b = b0 + tl.arange(0, BLOCK_B)
        m_b = o_b < batch
        n = tl.full([BLOCK_B], capacity - new, tl.int32)
        if seqlens is not None:
            n = tl.load(seqlens + o_b, mask=m_b, other=0)
        bad_length = m_b & ((n < 0) | (n > capacity - new))
        tl.device_assert(~bad_length, FN + ": cache_seqlens[b] plus the new keys does not fit the cache")
        code = tl.where(bad_length, CACHE_LENGTH, 0)
        value = n
        if leftpad is not None:
            pad = tl.load(leftpad + o_b, mask=m_b, other=0)
            bad_pad = m_b & ((pad < 0) | (pad > n))
            tl.device_assert(~bad_pad, FN + ": cache_leftpad[b] must be in [0, cache_seqlens[b]]")
            value = tl.where(bad_length | ~bad_pad, value, pad)
            code = tl.where(bad_length | ~bad_pad, code, CACHE_LEFTPAD)
        first = _keep_first(first, code, o_b, 0, value, m_b)
        if batch_idx is not None:
            row = tl.load(batch_idx + o_b, mask=m_b, other=0)
            bad_row = m_b & ((row < 0) | (row >= cache_rows))
            tl.device_assert(~bad_row, FN + ": cache_batch_idx must be in [0, k_cache.shape[0])")
            first = _keep_first(first, tl.where(bad_row, CACHE_ROW, 0), o_b, 0, row, m_b)
            if new > 0:
                for c0 in range(0, batch, BLOCK_B):
                    o_c = c0 + tl.arange(0, BLOCK_B)
                    other = tl.load(batch_idx + o_c, mask=o_c < batch, other=-1)
                    twice = (row[:, None] == other[None, :]) & (o_b[:, None] != o_c[None, :]) & (o_c < batch)[None, :]
                    repeated = m_b & (tl.max(twice.to(tl.int32), 1) > 0)
                    tl.device_assert(~repeated, FN + ": cache_batch_idx repeats a row that new keys are appended to")
                    first = _keep_first(first, tl.where(repeated, CACHE_REPEATED_ROW, 0), o_b, 0, row, m_b)
        if table is not None:
            first = _pages_in_use(table, stride_bt, o_b, m_b, n + new, first, num_pages, page_size, pages_per_seq,
                                  FN, BLOCK_B, BLOCK_P)
        if rotary_positions >= 0:
            short = m_b & (n + rotary_reach > rotary_positions)
            tl.device_assert(~short, FN + ": rotary_cos/rotary_sin cover fewer positions than this call reaches")
            first = _keep_first(first, tl.where(short, ROTARY_REACH, 0), o_b, 0, n + rotary_reach - 1, m_b)
    _write_first(errors, first)


@triton.jit
def _offsets(cu, o_b, batch, total, longest, first, START: tl.constexpr, ORDER: tl.constexpr, END: tl.constexpr,
             LONGEST: tl.constexpr, FN: tl.constexpr, NAME: tl.constexpr):
    """Offsets ``cu`` (batch + 1) start at 0, never decrease, end at ``total`` (< 0: any) and no sequence is
    longer than ``longest``; returns the sequences' lengths too."""
    m_b = o_b < batch
    lo = tl.load(cu + o_b, mask=m_b | (o_b == batch), other=0)
    hi = tl.load(cu + o_b + 1, mask=m_b, other=0)
    bad_start = (o_b == 0) & (lo != 0)
    tl.device_assert(~bad_start, FN + ": " + NAME + " must start at 0")
    first = _keep_first(first, tl.where(bad_start, START, 0), o_b, 0, lo, o_b == 0)
    drop = m_b & (hi < lo)
    tl.device_assert(~drop, FN + ": " + NAME + " must be non-decreasing")
    first = _keep_first(first, tl.where(drop, ORDER, 0), o_b + 1, 0, hi, m_b)
    if total >= 0:
        bad_end = (o_b == batch) & (lo != total)
        tl.device_assert(~bad_end, FN + ": " + NAME + "[-1] must equal the number of packed rows")
        first = _keep_first(first, tl.where(bad_end, END, 0), o_b, 0, lo, o_b == batch)
    too_long = m_b & (hi - lo > longest)
    tl.device_assert(~too_long, FN + ": a sequence is longer than its max_seqlen")
    first = _keep_first(first, tl.where(too_long, LONGEST, 0), o_b, 0, hi - lo, m_b)
    return first, tl.where(m_b, hi - lo, 0)


@triton.jit(debug=True, do_not_specialize=("batch", "total_q", "total_k", "max_q", "max_k", "num_pages", "page_size",
                                           "pages_per_seq", "stride_bt"),
            do_not_specialize_on_alignment=("cu_q", "cu_k", "table", "errors"))
def check_varlen_kernel(cu_q, cu_k, table, errors, batch, total_q, total_k, max_q, max_k, num_pages, page_size,
                        pages_per_seq, stride_bt, FN: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr):
    """A varlen call's rules (``values.check_varlen_values``): each of cu_seqlens_q/k starts at 0, never decreases
    and ends at the packed rows (``total_k`` < 0: paged keys, any); no sequence longer than max_seqlen_q/k; a
    paged K/V's pages in use real."""
    first = (tl.full([], _NONE, tl.int64), tl.full([], 0, tl.int64))
    for b0 in range(0, batch + 1, BLOCK_B):
        o_b = b0 + tl.arange(0, BLOCK_B)
        first, _ = _offsets(cu_q, o_b, batch, total_q, max_q, first, Q_START, Q_ORDER, Q_END, Q_LONGEST, FN,
                            "cu_seqlens_q")
        first, lengths_k = _offsets(cu_k, o_b, batch, total_k, max_k, first, K_START, K_ORDER, K_END, K_LONGEST,
                                    FN, "cu_seqlens_k")
        if table is not None:
            first = _pages_in_use(table, stride_bt, o_b, o_b < batch, tl.maximum(lengths_k, 0), first, num_pages,
                                  page_size, pages_per_seq, FN, BLOCK_B, BLOCK_P)
    _write_first(errors, first)
