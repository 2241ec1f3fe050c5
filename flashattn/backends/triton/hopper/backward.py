"""The Hopper tier's one-pass backward: dK and dV of a key block held by two consumer warpgroups beside a TMA
producer warp, dQ added up in fp32 with atomics (FlashAttention-3's structure), in Gluon for sm_90.

One program (CTA) owns 128 keys of one (batch, key/value head); three partitions (``gl.warp_specialize``):

- **producer**, the default partition (4 warps, one of which issues the copies; the compiler reallocates its
  registers down to 24): K and V of the block once (a 64-row tile per consumer), then Q_j and dO_j of every query
  tile that sees the block into a ring (``STAGES``); a stage's "ready" mbarrier completes with both copies' bytes,
  its "empty" one when both consumers have released it;
- **two consumer warpgroups**, each owning 64 of the keys: per query tile (64 rows) S^T = K Q_j^T and
  dP^T = V dO_j^T (async wgmma, both operands in shared memory), P^T = 2^(S^T scale log2(e) - lse_j) and
  dS^T = P^T (dP^T - delta_j) in registers, then dV += P^T dO_j, dK += dS^T Q_j and the tile's dQ = dS K issued
  together, and dQ (times the scale) added into the fp32 sum with atomics. Five matmuls a tile, where the portable
  two-pass backward runs seven. Deterministic calls order those adds: a warpgroup waits on a counter per (query
  head, tile) for its key block's turn (``backward_parts._dq_turn``), so every call sums dQ in the same order.

At d=128 dK and dV take 128 registers a thread, and a 64 x 128 dQ beside them would not fit (288 in all): there,
as FlashAttention-3 does, each warpgroup stores its dS^T into shared memory (two tiles deep, a "full" and an
"empty" barrier per depth, both warpgroups arriving on each) and computes dQ over all 128 keys for half of the
columns (dS from both buffers, A transposed from shared memory). The consumers are both worker partitions so that
both compile alike (as the default partition, consumer 0 had kept its loop invariants in registers and consumer 1
spilled them).

Inputs as the tier's forward takes them: q, dO (batch, seqlen_q, heads, d), k, v (batch, seqlen_k, kv_heads, d),
contiguous, bf16 or fp16, d a multiple of 8 up to 128 (tiles of 64 or 128 columns: ``hopper.tile_dim``; the
padding's columns of K and V zeroed, those of dK, dV and dQ not stored), kv_heads dividing
heads (GQA, MQA: a program sums dK and dV over its key/value head's query heads, one after another); ``neg_lse2``
(-lse in log2 units, -inf for rows that see no key) and ``delta`` (rowsum(dO O)) as the portable preprocess writes
them, (batch, heads, seqlen_q); ``dq_sum`` fp32 of q's shape, zeroed. Causal is bottom-right aligned, as the forward's.
The tier's ``__init__.py`` says which calls come here.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import tile_dim
from .backward_parts import (
    _add_dq,
    _group_tiles,
    _key_block,
    _look_at_turn,
    _probs_and_grads,
    _producer,
    _program,
    _sequence,
    _store_grads,
)
from .forward import LOG2E, head_tiles
from .steps import _mma_layout, _zero_padding

WG_N = 64  # keys per consumer warpgroup: the M of its wgmmas
BLOCK_N = 2 * WG_N  # keys per program
BLOCK_M = 64  # queries per step: the M of dQ's wgmma
STAGES = 2  # Q and dO ring depth: K, V and two stages of Q and dO are 64 KiB at d=64, 128 at d=128
HEAD_DIMS = (64, 128)  # the tiles' head dims (``hopper.tile_dim``)
CONSUMER_REGS = 240


@gluon.jit
def _tile(j, i, grads, ctx, stats, MASK: gl.constexpr, SCORES: gl.constexpr, DQ_PITCH: gl.constexpr,  # noqa: PLR0913
          WG: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Query tile j (ring slot i) of the query head ``stats`` points at: dK and dV updated, the tile's dQ added
    into the sum (rows ``DQ_PITCH`` elements apart). The switches are arguments of their own: inside a tuple
    they would arrive as tensors. (``WG`` is in ``ctx`` here; ``_group_tiles`` calls both kernels' tiles alike.)"""
    dk, dv = grads
    k_t, v_t, q_bufs, do_bufs, q_ready, q_empty, rows_k, cols, limits, shared_ds = ctx
    neg_lse2_ptr, delta_ptr, dq_ptr, dq_row0, dq_col0, order = stats
    seqlen_q, scale, scoring = limits
    STAGES: gl.constexpr = q_bufs.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.shape[1]
    HEAD_D: gl.constexpr = q_bufs.shape[2]
    WG_N: gl.constexpr = k_t.shape[0]
    SHARED_DS: gl.constexpr = HEAD_D > 64
    s_layout: gl.constexpr = _mma_layout(BLOCK_M)
    d_layout: gl.constexpr = _mma_layout(HEAD_D)
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    stage = i % STAGES
    q_s = q_bufs.index(stage)
    do_s = do_bufs.index(stage)
    mbarrier.wait(q_ready.index(stage), (i // STAGES) & 1)
    zero_s = gl.zeros([WG_N, BLOCK_M], gl.float32, s_layout)
    s = warpgroup_mma(k_t, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dp = warpgroup_mma(v_t, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    queries = j * BLOCK_M + cols
    if MASK:  # rows past the sequence read -inf: P = 0 there, so dS = 0 and nothing of theirs reaches dK, dV or dQ
        neg_lse2 = gl.load(neg_lse2_ptr + queries, mask=queries < seqlen_q, other=float("-inf"))
        delta = gl.load(delta_ptr + queries, mask=queries < seqlen_q, other=0.0)
    else:  # (an unmasked tile lies inside both sequences: no compare, no registers for it)
        neg_lse2 = gl.load(neg_lse2_ptr + queries)
        delta = gl.load(delta_ptr + queries)
    s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
    p, ds = _probs_and_grads(s, dp, (neg_lse2[None, :], delta[None, :]), (rows_k[:, None], queries[None, :]),
                             scoring, MASK, SCORES)
    dtype: gl.constexpr = q_s.dtype
    dv = warpgroup_mma(gl.convert_layout(p.to(dtype), operand), do_s, dv, is_async=True)
    dk = warpgroup_mma(gl.convert_layout(ds.to(dtype), operand), q_s, dk, is_async=True)
    if SHARED_DS:
        # dQ over both warpgroups' keys, this warpgroup's half of the columns (FlashAttention-3's split at
        # d=128: a 64 x 128 dQ beside dK and dV would not fit the registers). Each stores its dS^T in buffer
        # i % 2 and waits for the other's; a buffer is rewritten once both dQ products that read it are done.
        ds_bufs, ds_full, ds_empty, k_cols, wg = shared_ds  # (K's keys of each warpgroup, this one's columns)
        HALF_D: gl.constexpr = HEAD_D // 2
        h_layout: gl.constexpr = _mma_layout(HALF_D)
        buf = i % 2
        mbarrier.wait(ds_empty.index(buf), ((i // 2) & 1) ^ 1)
        ds_bufs.index(2 * buf + wg).store(ds.to(dtype))
        fence_async_shared()  # the stores, before the other warpgroup's wgmma reads them
        gl.thread_barrier()  # every thread's, before the one arrival
        mbarrier.arrive(ds_full.index(buf))
        mbarrier.wait(ds_full.index(buf), (i // 2) & 1)
        zero_dq = gl.zeros([BLOCK_M, HALF_D], gl.float32, h_layout)
        dq = warpgroup_mma(ds_bufs.index(2 * buf).permute((1, 0)), k_cols[0], zero_dq, use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_bufs.index(2 * buf + 1).permute((1, 0)), k_cols[1], dq, is_async=True)
        # deterministic: each warpgroup's columns in the key blocks' order, on a counter of its own
        looked = _look_at_turn(order, j, SCORES, BLOCK_M, 2 * WG_N, WG, 1, WG)
        dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
        mbarrier.arrive(ds_empty.index(buf))
        col0 = dq_col0 + wg * HALF_D
        cols_left: gl.constexpr = HEAD_DIM - WG * HALF_D
    else:
        zero_dq = gl.zeros([BLOCK_M, HEAD_D], gl.float32, d_layout)
        ds_rows = gl.convert_layout(gl.permute(ds.to(dtype), (1, 0)), operand)  # dS: queries x keys, dQ's A
        dq = warpgroup_mma(ds_rows, k_t, zero_dq, use_acc=False, is_async=True)
        # deterministic: both warpgroups add every column, in the key blocks' order, warpgroup 0 first
        looked = _look_at_turn(order, j, SCORES, BLOCK_M, 2 * WG_N, 0, 2, WG)
        dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
        col0 = dq_col0
        cols_left: gl.constexpr = HEAD_DIM
    mbarrier.arrive(q_empty.index(stage))
    _add_dq(dq * scale, dq_ptr, dq_row0 + j * BLOCK_M, col0, seqlen_q - j * BLOCK_M, DQ_PITCH, cols_left, looked)
    return dk, dv


@gluon.jit
def _consumer(WG: gl.constexpr, smem, bars, ds_shared, geometry, outs, LEFT: gl.constexpr,  # noqa: PLR0913
              RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Consumer warpgroup WG: keys n0 + 64 WG .. + 63 against every query tile that sees them, of each query head of
    the key/value head's group in turn; dK (times the scale) and dV, summed over the group, stored. ``ds_shared``:
    (dS^T buffers, their full and empty barriers) where dQ's columns are split between the two (d > 64), else ()."""
    k_smem, v_smem, q_bufs, do_bufs = smem
    kv_bar, q_ready, q_empty = bars
    n0, lo, full_lo, full_hi, hi, seqlen_q, scale, scoring = geometry
    SCORES: gl.constexpr = (LEFT, RIGHT, SOFTCAP)
    heads = outs[0]  # (the group's statistics and dQ: _group_tiles)
    WG_N: gl.constexpr = k_smem.shape[1]
    HEAD_D: gl.constexpr = k_smem.shape[2]
    BLOCK_M: gl.constexpr = q_bufs.shape[1]
    s_layout: gl.constexpr = _mma_layout(BLOCK_M)
    d_layout: gl.constexpr = _mma_layout(HEAD_D)
    rows_k = n0 + WG * WG_N + gl.arange(0, WG_N, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    if HEAD_D > 64:
        ds_bufs, ds_full, ds_empty = ds_shared
        HALF_D: gl.constexpr = HEAD_D // 2
        k_cols = (k_smem.index(0).slice(WG * HALF_D, HALF_D, 1), k_smem.index(1).slice(WG * HALF_D, HALF_D, 1))
        shared = (ds_bufs, ds_full, ds_empty, k_cols, WG)
    else:
        shared = ds_shared  # (empty)
    ctx = (k_smem.index(WG), v_smem.index(WG), q_bufs, do_bufs, q_ready, q_empty, rows_k, cols,
           (seqlen_q, scale, scoring), shared)
    dk = gl.zeros([WG_N, HEAD_D], gl.float32, d_layout)
    dv = gl.zeros([WG_N, HEAD_D], gl.float32, d_layout)
    mbarrier.wait(kv_bar, 0)
    _zero_padding(k_smem.index(WG), HEAD_DIM)  # (S^T and dP^T read this warpgroup's keys; dQ's padding is not stored)
    _zero_padding(v_smem.index(WG), HEAD_DIM)
    dk, dv = _group_tiles(_tile, (dk, dv), ctx, geometry, heads, SCORES, HEADS, HEAD_DIM, WG)
    _store_grads(dk * scale, dv, outs, n0 + WG * WG_N, 0, scoring[1], HEAD_DIM)


@gluon.jit
def attention_backward_ws_kernel(  # noqa: PLR0913 -- a kernel takes every descriptor, pointer, size and switch
        q_desc, k_desc, v_desc, do_desc, dq_ptr, dk_ptr, dv_ptr, neg_lse2_ptr, delta_ptr, cu_seqlens_q,
        cu_seqlens_k, seqlen_q, seqlen_k, lse_pitch, group, qk_scale, scale, diagonal_offset, bottom_right,
        window_left, window_right, softcap_in, softcap_out, dq_semaphores, semaphore_pitch,
        HEADS: gl.constexpr, LEFT: gl.constexpr, RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Grid (batch * kv_heads, cdiv(seqlen_k, 128)); num_warps=4 (the default partition, the producer). ``group``:
    query heads per key/value head (query head h reads kv head h // group); ``HEADS`` (query heads) a constexpr,
    so that dQ's row pitch is one and the atomics' offsets immediates (a compilation per head count). The band, the
    softcap and packed sequences as the forward's (``forward.attention_forward_ws_kernel``; packed: a program per
    128 keys of the longest sequence, returning at once past its own). Programs start in grid order, every
    head's first key block first: causal, those see the most queries. ``dq_semaphores`` (int32, zeroed; None:
    unordered) and ``semaphore_pitch`` (tiles a head): deterministic, dQ's adds into a tile in a fixed order
    (``backward_parts._dq_turn``), the key blocks reversed under a right bound (``_key_block``)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    WG_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    descs = (q_desc, k_desc, v_desc, do_desc)
    scoring = (qk_scale, softcap_in, softcap_out, diagonal_offset, bottom_right, window_left, window_right)
    sequence = _sequence(cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, lse_pitch, HEADS, group)
    if cu_seqlens_q is not None:  # noqa: SIM102 -- resolved at compile time, the inner test at run time
        if _key_block(dq_semaphores, RIGHT) * (2 * WG_N) >= sequence[3]:  # the grid is sized for the longest
            return
    smem, bars, geometry, outs, coords, span = _program(
        descs, (dq_ptr, dk_ptr, dv_ptr, neg_lse2_ptr, delta_ptr), sequence, group, scale, scoring,
        (dq_semaphores, semaphore_pitch), HEADS, LEFT, RIGHT, SOFTCAP, STAGES, HEAD_DIM)
    if HEAD_D > 64:  # dS^T of each warpgroup, two tiles deep (buffer 2 * (tile % 2) + warpgroup)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_N, BLOCK_M], dtype)
        ds_bufs = gl.allocate_shared_memory(dtype, [4, WG_N, BLOCK_M], ds_layout)
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ds_full.index(i), count=2)
            mbarrier.init(ds_empty.index(i), count=2)
        ds_shared = (ds_bufs, ds_full, ds_empty)
    else:
        ds_shared = ()
    gl.warp_specialize([
        (_producer, (descs, smem, bars, coords, span)),
        (_consumer, (0, smem, bars, ds_shared, geometry, outs, LEFT, RIGHT, SOFTCAP, HEADS, HEAD_DIM)),
        (_consumer, (1, smem, bars, ds_shared, geometry, outs, LEFT, RIGHT, SOFTCAP, HEADS, HEAD_DIM)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def _check_arguments(q, k, v, dout, stats, grads, *, scale: float) -> None:
    """Refuses what neither backward kernel reads (the tier's ``backward_declines`` keeps such calls away; this
    is for one that comes another way)."""
    (neg_lse2, delta), (dq_sum, dk, dv) = stats, grads
    batch, _, heads, d = q.shape
    kv_heads = k.shape[2]
    if q.dtype not in (torch.bfloat16, torch.float16) or not q.dtype == k.dtype == v.dtype == dout.dtype:
        raise ValueError("q, k, v and dout must share one dtype, bf16 or fp16")
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != d or not kv_heads or heads % kv_heads:
        raise ValueError("k and v must be (batch, seqlen_k, kv_heads, d) with q's batch and d, kv_heads dividing "
                         "q's heads")
    if dout.shape != q.shape or dk.shape != k.shape or dv.shape != v.shape:
        raise ValueError("dout must have q's shape, dk and dv k's")
    if not all(t.is_contiguous() for t in (q, k, v, dout, dk, dv, dq_sum, neg_lse2, delta)):
        raise ValueError("every tensor must be contiguous")
    if any(t.data_ptr() % 16 for t in (q, k, v, dout)):
        raise ValueError("q, k, v and dout must be 16-byte aligned (TMA)")
    if dq_sum.dtype != torch.float32 or dq_sum.shape != q.shape:
        raise ValueError("dq_sum must be float32 of q's shape")
    if any(t.dtype != torch.float32 or t.shape != (batch, heads, q.shape[1]) for t in (neg_lse2, delta)):
        raise ValueError("neg_lse2 and delta must be float32 (batch, heads, seqlen_q)")
    if not scale > 0:
        raise ValueError("scale must be positive")


def launch_arguments(q, k, v, dout, stats, grads, *, causal: bool, scale: float,  # noqa: PLR0913
                     window: tuple[int, int] = (-1, -1), top_left: bool = False, diagonal_offset: int = 0,
                     softcap: float = 0.0, cu_seqlens: tuple | None = None, max_seqlen_k: int = 0,
                     dq_semaphores: torch.Tensor | None = None) -> tuple:
    """(kernel, grid, keyword arguments) of the tier's backward for this call: ``attention_backward_ws_kernel`` at tiles
    of 64 or 128 columns, ``backward_wide.attention_backward_wide_kernel`` at 256 (``hopper.tile_dim``: d a multiple of
    8 up to 256, padded up). q, k, v, dout (batch, seqlen, heads, d) contiguous, one dtype (bf16 or fp16), key/value
    heads dividing the query heads; ``stats`` = (neg_lse2, delta), (batch, heads, seqlen_q) float32 dense; ``grads`` =
    (dq_sum, float32 of q's shape, zeroed; dk, dv of k's shape); the band and softcap as the forward's
    ``launch_arguments``. Packed sequences (``cu_seqlens`` = (q's, k's) int32 offsets, ``max_seqlen_k``): q, dout,
    dq_sum (total_q, heads, d), k, v, dk, dv (total_k, kv_heads, d), the statistics (heads, total_q).
    ``dq_semaphores``: deterministic, dQ's adds in a fixed order (``backward_parts._dq_turn``), on these int32
    counters, at least ``semaphores_needed`` of them at zero (the launch leaves them at zero)."""
    from . import backward_wide
    from .forward import _packed_views

    packed = cu_seqlens is not None
    sequences = 0
    if packed:  # one-batch views for the checks and the descriptors (the kernel reads each sequence's offsets)
        q, k, v, sequences = _packed_views(q, k, v, cu_seqlens, ("max_seqlen_k", max_seqlen_k))
        dout, stats, grads = dout[None], tuple(t[None] for t in stats), tuple(t[None] for t in grads)
    _check_arguments(q, k, v, dout, stats, grads, scale=scale)
    (neg_lse2, delta), (dq_sum, dk, dv) = stats, grads
    batch, seqlen_q, heads, d = q.shape
    kv_heads = k.shape[2]
    left, right = window[0], 0 if causal else window[1]
    if left < -1 or right < -1 or not softcap >= 0:
        raise ValueError(f"window sides are -1 (unbounded) or >= 0 and softcap >= 0, got {window} and {softcap}")
    tile = tile_dim(d)
    if tile in backward_wide.HEAD_DIMS:
        wide = backward_wide
        kernel, block_m, wg_n, block_n, stages = (wide.attention_backward_wide_kernel, wide.BLOCK_M, wide.WG_N,
                                                  wide.BLOCK_N, wide.STAGES)
    else:
        kernel, block_m, wg_n, block_n, stages = attention_backward_ws_kernel, BLOCK_M, WG_N, BLOCK_N, STAGES
    pitch = _tiles_a_head(batch * seqlen_q, sequences if packed else batch, block_m)
    if dq_semaphores is not None and (dq_semaphores.dtype != torch.int32 or dq_semaphores.numel() < 2 * heads * pitch
                                      or dq_semaphores.device != q.device):
        raise ValueError(f"dq_semaphores must be int32 on q's device with at least {2 * heads * pitch} elements")
    kwargs = dict(q_desc=head_tiles(q, block_m), k_desc=head_tiles(k, wg_n), v_desc=head_tiles(v, wg_n),
                  do_desc=head_tiles(dout, block_m), dq_ptr=dq_sum,
                  dk_ptr=dk, dv_ptr=dv, neg_lse2_ptr=neg_lse2, delta_ptr=delta,
                  cu_seqlens_q=cu_seqlens[0] if packed else None, cu_seqlens_k=cu_seqlens[1] if packed else None,
                  seqlen_q=0 if packed else seqlen_q, seqlen_k=0 if packed else k.shape[1],
                  lse_pitch=seqlen_q if packed else 0, HEADS=heads, group=heads // kv_heads, qk_scale=scale * LOG2E,
                  scale=scale,
                  diagonal_offset=diagonal_offset, bottom_right=0 if top_left else 1, window_left=max(left, 0),
                  window_right=max(right, 0), softcap_in=2 * LOG2E * scale / softcap if softcap else 0.0,
                  softcap_out=softcap * LOG2E, dq_semaphores=dq_semaphores,
                  semaphore_pitch=0 if dq_semaphores is None else pitch, LEFT=left >= 0, RIGHT=right >= 0,
                  SOFTCAP=softcap > 0, STAGES=stages, CONSUMER_REGS=CONSUMER_REGS, HEAD_DIM=d, num_warps=4)
    keys = max_seqlen_k if packed else k.shape[1]
    return kernel, ((sequences if packed else batch) * kv_heads, triton.cdiv(keys, block_n)), kwargs


def _tiles_a_head(rows: int, sequences: int, block_m: int = BLOCK_M) -> int:
    """The query tiles' counter indices a head spans (``_program``'s ``tile0`` + j: a tile's sequence number plus
    its first row over ``block_m``)."""
    return sequences + triton.cdiv(rows, block_m)


def semaphores_needed(q, *, sequences: int = 0) -> int:
    """How many counters a deterministic launch of q (dense (batch, seqlen_q, heads, d), or packed (total_q, heads,
    d) of ``sequences``) orders dQ's adds on: two per (query head, 64-row query tile), and one per head a sequence."""
    rows, heads = (q.shape[0], q.shape[1]) if sequences else (q.shape[0] * q.shape[1], q.shape[2])
    return 2 * heads * _tiles_a_head(rows, sequences or q.shape[0])
