"""The Hopper tier's one-pass backward on 256-column tiles (head dims above 128, padded up: ``hopper.tile_dim``;
Gluon, sm_90): ``backward.py``'s producer and ring, with the work split between the two consumer warpgroups the
other way (FlashAttention-3's at d=256).

At d=256 a warpgroup cannot hold dK and dV of 64 keys (256 registers a thread). Here a program owns 64 keys and
each consumer warpgroup holds dK and dV of all of them for half of the head dim (64 x 128 each: 128 registers a
thread). Per 64-query tile:

- warpgroup w computes S and dP for its 32 of the keys (S_w = Q K_w^T, dP_w = dO V_w^T: 64 x 32, the reduction
  over the whole head dim), then P_w and dS_w with the rows' lse and delta (two a thread: queries are rows here);
- each stores P_w^T and dS_w^T into its 32 rows of two shared 64-key x 64-query tiles, and waits for the other's
  (a "full" mbarrier, count 2; an "empty" one, count 2, before the next tile rewrites them);
- then, for its 128 columns: dV_w += P^T dO_w, dK_w += dS^T Q_w (A: the shared tiles, B: dO's and Q's column
  halves) and dQ_w = dS K_w (A: the dS^T tile transposed, B: K's column half, over both 32-key tiles), and adds
  dQ_w (times the scale) into the fp32 sum with atomics.

Five matmuls a tile, none repeated; shared memory: K and V (32 KiB each), two ring stages of Q and dO (128 KiB),
the two exchanged tiles (16 KiB). Inputs, outputs and routing as ``backward.py``'s, whose ``launch_arguments``
chooses this kernel at d=256.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

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
from .steps import _mma_layout, _zero_padding

WG_N = 32  # keys of a warpgroup's S and dP (their N)
BLOCK_N = 2 * WG_N  # keys per program
BLOCK_M = 64  # queries per step
STAGES = 2  # Q and dO ring depth
HEAD_DIMS = (256,)  # the tiles' head dims


@gluon.jit
def _wide_tile(j, i, grads, ctx, stats, MASK: gl.constexpr, SCORES: gl.constexpr,  # noqa: PLR0913
               DQ_PITCH: gl.constexpr, WG: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Query tile j (ring slot i): warpgroup WG's dK and dV columns updated, its dQ columns added into the sum. The
    switches are arguments of their own: inside a tuple they would arrive as tensors."""
    dk, dv = grads
    k_smem, v_smem, q_bufs, do_bufs, q_ready, q_empty, exchange, keys, limits = ctx
    p_t, ds_t, pds_full, pds_empty = exchange
    neg_lse2_ptr, delta_ptr, dq_ptr, dq_row0, dq_col0, order = stats
    seqlen_q, scale, scoring = limits
    STAGES: gl.constexpr = q_bufs.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.shape[1]
    HEAD_D: gl.constexpr = q_bufs.shape[2]
    WG_N: gl.constexpr = k_smem.shape[1]
    HALF_D: gl.constexpr = HEAD_D // 2
    s_layout: gl.constexpr = _mma_layout(WG_N)
    h_layout: gl.constexpr = _mma_layout(HALF_D)
    dtype: gl.constexpr = q_bufs.dtype
    stage = i % STAGES
    q_s = q_bufs.index(stage)
    do_s = do_bufs.index(stage)
    mbarrier.wait(q_ready.index(stage), (i // STAGES) & 1)
    zero_s = gl.zeros([BLOCK_M, WG_N], gl.float32, s_layout)
    s = warpgroup_mma(q_s, k_smem.index(WG).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dp = warpgroup_mma(do_s, v_smem.index(WG).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    queries = j * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    if MASK:  # rows past the sequence read -inf: P = 0 there, so dS = 0 and nothing of theirs reaches dK, dV or dQ
        neg_lse2 = gl.load(neg_lse2_ptr + queries, mask=queries < seqlen_q, other=float("-inf"))
        delta = gl.load(delta_ptr + queries, mask=queries < seqlen_q, other=0.0)
    else:
        neg_lse2 = gl.load(neg_lse2_ptr + queries)
        delta = gl.load(delta_ptr + queries)
    s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
    p, ds = _probs_and_grads(s, dp, (neg_lse2[:, None], delta[:, None]), (keys[None, :], queries[:, None]), scoring,
                             MASK, SCORES)
    # Both halves of P^T and dS^T, one tile deep: rewritten once both warpgroups' products of the last tile retired.
    mbarrier.wait(pds_empty, (i & 1) ^ 1)
    p_t.slice(WG * WG_N, WG_N, 0).permute((1, 0)).store(p.to(dtype))
    ds_t.slice(WG * WG_N, WG_N, 0).permute((1, 0)).store(ds.to(dtype))
    fence_async_shared()  # the stores, before either warpgroup's wgmma reads them
    gl.thread_barrier()  # every thread's, before the one arrival
    mbarrier.arrive(pds_full)
    mbarrier.wait(pds_full, i & 1)
    q_cols = q_s.slice(WG * HALF_D, HALF_D, 1)
    do_cols = do_s.slice(WG * HALF_D, HALF_D, 1)
    dv = warpgroup_mma(p_t, do_cols, dv, is_async=True)
    dk = warpgroup_mma(ds_t, q_cols, dk, is_async=True)
    zero_dq = gl.zeros([BLOCK_M, HALF_D], gl.float32, h_layout)
    dq = warpgroup_mma(ds_t.slice(0, WG_N, 0).permute((1, 0)), k_smem.index(0).slice(WG * HALF_D, HALF_D, 1),
                       zero_dq, use_acc=False, is_async=True)
    dq = warpgroup_mma(ds_t.slice(WG_N, WG_N, 0).permute((1, 0)), k_smem.index(1).slice(WG * HALF_D, HALF_D, 1),
                       dq, is_async=True)
    # deterministic: each warpgroup's columns in the key blocks' order, on a counter of its own
    looked = _look_at_turn(order, j, SCORES, BLOCK_M, 2 * WG_N, WG, 1, WG)
    dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
    mbarrier.arrive(pds_empty)
    mbarrier.arrive(q_empty.index(stage))
    _add_dq(dq * scale, dq_ptr, dq_row0 + j * BLOCK_M, dq_col0 + WG * HALF_D, seqlen_q - j * BLOCK_M, DQ_PITCH,
            HEAD_DIM - WG * HALF_D, looked)
    return dk, dv


@gluon.jit
def _wide_consumer(WG: gl.constexpr, smem, bars, exchange, geometry, outs, LEFT: gl.constexpr,  # noqa: PLR0913
                   RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Consumer warpgroup WG: S and dP of keys n0 + 32 WG .. + 31, dK and dV of all 64 keys for head-dim columns
    128 WG .. + 127, against every query tile that sees the keys, of each query head of the group in turn; dK
    (times the scale) and dV, summed over the group, stored."""
    k_smem, v_smem, q_bufs, do_bufs = smem
    kv_bar, q_ready, q_empty = bars
    n0, lo, full_lo, full_hi, hi, seqlen_q, scale, scoring = geometry
    SCORES: gl.constexpr = (LEFT, RIGHT, SOFTCAP)
    heads = outs[0]  # (the group's statistics and dQ: _group_tiles)
    WG_N: gl.constexpr = k_smem.shape[1]
    HEAD_D: gl.constexpr = k_smem.shape[2]
    HALF_D: gl.constexpr = HEAD_D // 2
    s_layout: gl.constexpr = _mma_layout(WG_N)
    h_layout: gl.constexpr = _mma_layout(HALF_D)
    keys = n0 + WG * WG_N + gl.arange(0, WG_N, layout=gl.SliceLayout(0, s_layout))
    ctx = (k_smem, v_smem, q_bufs, do_bufs, q_ready, q_empty, exchange, keys, (seqlen_q, scale, scoring))
    dk = gl.zeros([2 * WG_N, HALF_D], gl.float32, h_layout)
    dv = gl.zeros([2 * WG_N, HALF_D], gl.float32, h_layout)
    mbarrier.wait(kv_bar, 0)
    _zero_padding(k_smem.index(WG), HEAD_DIM)  # (S and dP read this warpgroup's keys; dQ's padding is not stored)
    _zero_padding(v_smem.index(WG), HEAD_DIM)
    dk, dv = _group_tiles(_wide_tile, (dk, dv), ctx, geometry, heads, SCORES, HEADS, HEAD_DIM, WG)
    _store_grads(dk * scale, dv, outs, n0, WG * HALF_D, scoring[1], HEAD_DIM)


@gluon.jit
def attention_backward_wide_kernel(  # noqa: PLR0913 -- a kernel takes every descriptor, pointer, size and switch
        q_desc, k_desc, v_desc, do_desc, dq_ptr, dk_ptr, dv_ptr, neg_lse2_ptr, delta_ptr, cu_seqlens_q,
        cu_seqlens_k, seqlen_q, seqlen_k, lse_pitch, group, qk_scale, scale, diagonal_offset, bottom_right,
        window_left, window_right, softcap_in, softcap_out, dq_semaphores, semaphore_pitch,
        HEADS: gl.constexpr, LEFT: gl.constexpr, RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Grid (batch * kv_heads, cdiv(seqlen_k, 64)); num_warps=4 (the default partition, the producer); the
    arguments as ``attention_backward_ws_kernel``'s."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
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
    t_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * WG_N, BLOCK_M], dtype)
    p_t = gl.allocate_shared_memory(dtype, [2 * WG_N, BLOCK_M], t_layout)  # P^T: keys x queries
    ds_t = gl.allocate_shared_memory(dtype, [2 * WG_N, BLOCK_M], t_layout)
    pds_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    pds_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(pds_full, count=2)
    mbarrier.init(pds_empty, count=2)
    exchange = (p_t, ds_t, pds_full, pds_empty)
    gl.warp_specialize([
        (_producer, (descs, smem, bars, coords, span)),
        (_wide_consumer, (0, smem, bars, exchange, geometry, outs, LEFT, RIGHT, SOFTCAP, HEADS, HEAD_DIM)),
        (_wide_consumer, (1, smem, bars, exchange, geometry, outs, LEFT, RIGHT, SOFTCAP, HEADS, HEAD_DIM)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
