"""The Hopper tier's forward: FlashAttention-3's structure for sm_90, written in Gluon (``triton.experimental.gluon``,
Triton 3.6), which expresses what ``tl`` cannot there (on sm_90 ``tl`` waits for each QK^T at once). One program
(CTA) owns 128 query rows of one (batch, head) and runs three partitions (``gl.warp_specialize``):

- **producer**, 1 warp (its warpgroup padded to 4 by the compiler), ``setmaxnreg`` down to 24 registers: TMA loads
  of the two 64-row Q tiles once, then K_j and V_j into two rings (``STAGES``); every stage has a "ready" mbarrier
  (completed by the TMA transaction count) and an "empty" one both consumers arrive on;
- **two consumer warpgroups**, 4 warps each, ``setmaxnreg`` up to 240: each owns 64 of the 128 rows and walks every
  key tile with async wgmma so that a matmul runs under each softmax. Two schedules (``Schedule.overlap``):

  "qk"  issue S_{j+1} = Q K_{j+1}^T; softmax of S_j under it; O *= alpha; issue O += P_j V_j; retire both
  "pv"  issue S_j = Q K_j^T and O += P_{j-1} V_{j-1}; retire S_j; softmax of S_j under PV_{j-1}; retire PV_{j-1}
        (FlashAttention-3's Algorithm 2)

  With ``pingpong`` the two consumers take turns issuing their wgmmas (two mbarriers pass the turn).

Scores stay in log2 units: ``p = 2^(s * scale * log2(e) - m)`` (with a softcap c, ``2^(c log2(e) tanh(s scale / c)
- m)``). A program visits only the key tiles its rows' band reaches (causal, or a sliding window: ``window_left`` and
``window_right`` around a diagonal, bottom-right aligned by default); keys past the sequence and outside the band are
masked only in the tiles that need it (a left window's masked loop, an unmasked one, then a masked one).

Layout: q (batch, seqlen_q, heads, d), k and v (batch, seqlen_k, kv_heads, d) with kv_heads dividing heads (GQA,
MQA: query head h reads kv head h // (heads / kv_heads)), contiguous, d a multiple of 8 up to 256, bf16 or fp16,
read through 2-D TMA descriptors over the (batch * seqlen, heads * d) views: a tile is rows x ``tile_dim(d)`` (64,
128 or 256) at column head * d. A tile running past a sequence reads the next sequence's rows; those keys are masked
and those queries never stored. One running past a head (a padded d) reads the next head's columns; Q's are zeroed
(``steps._zero_padding``) and O's never stored. out has q's
shape; lse is (batch, heads, seqlen_q) float32, natural log. Which calls it serves: the tier's
``__init__.py``. Its correctness and speed on a GPU: ``python -m tools.gluon.gpu_run``; its SASS offline:
``python -m tools.gluon.profile`` (``benchmarks/NOTES.md`` has both).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import TILE_DIMS, tile_dim  # (re-exported: the tools and tests name them here)
from .steps import (
    _instr_k,
    _mma_layout,
    _pass_turn,
    _pv_schedule,
    _qk,
    _qk_schedule,
    _ready,
    _release,
    _take_turn,
    _zero_padding,
)
from .walk import _grid_tile, _producer, _serpentine, _tile, _waves

LOG2E = 1.4426950408889634
WG_M = 64  # query rows per consumer warpgroup: S (64 x 128 fp32) is 64 registers a thread, so two fit
BLOCK_M = 2 * WG_M  # query rows per program: two consumer warpgroups
# Keys per tile by head dim. At d=256 O alone is 128 registers a thread (64 x 256 fp32 over a warpgroup), so S
# takes 64 keys (32 registers), as FlashAttention-3 narrows its key tile there (to 80).
BLOCK_N = {64: 128, 128: 128, 256: 64}
# (K, V) ring depths: at d=128 a tile is 32 KiB, and Q 32 KiB + 2 K + 3 V tiles = 192 KiB of the 227 KiB; at d=256
# Q is 64 KiB and a 64-key tile 32 KiB: 2 + 2 make 192 KiB. V gets the deeper ring where it fits because schedule
# "pv" frees V_{j-1} late (see _pv_step).
STAGES = {64: (4, 4), 128: (2, 3), 256: (2, 2)}


@dataclass(frozen=True)
class Schedule:
    """How a consumer warpgroup overlaps its matmuls with its softmax: ``overlap`` "qk" (S_{j+1} = Q K_{j+1}^T runs
    under the softmax of S_j) or "pv" (FlashAttention-3's Algorithm 2: O += P_{j-1} V_{j-1} runs under it);
    ``pingpong``: the two consumers take turns issuing; ``unroll`` (schedule "qk"): 2 saves S's 64-register copy;
    ``persistent``: a program an SM runs work tiles one after another (``walk.py``), the next tile's Q and first
    K and V tiles loading under the last one's softmax and store."""

    overlap: str = "qk"
    pingpong: bool = True
    unroll: int = 1
    persistent: bool = False

    def __str__(self) -> str:
        return (f"{self.overlap}{'+pingpong' if self.pingpong else ''}{f' x{self.unroll}' if self.unroll > 1 else ''}"
                f"{' persistent' if self.persistent else ''}")


OFFLINE_SMS = 132  # a persistent grid's programs off a GPU (an H100 SXM's SMs): compiled, emulated
CONSUMER_REGS = 240  # FA3's split of 64K registers over 3 warpgroups: 240 + 240 + 24 (x 128 threads) <= 65536
PRODUCER_REGS = 24  # the least setmaxnreg allows; the producer only holds scalars
# The schedule tools/gluon/profile.py measures by default: the fewest instructions per score with a QK^T under every
# softmax (offline, NOTES.md). What the tier launches was chosen on an H200 instead (``launch_forward``).
# At d=256 the unrolled "qk" spills (O's 128 registers beside two S tiles): FlashAttention-3's "pv", 0.41.
SCHEDULES = {64: Schedule("qk", True, 2), 128: Schedule("qk", True, 2), 256: Schedule("pv", False)}
VARIANTS = (Schedule("qk", False), Schedule("qk", True), Schedule("qk", True, 2), Schedule("pv", False),
            Schedule("pv", True), Schedule("pv", False, persistent=True), Schedule("pv", True, persistent=True))
# What the tier launches (``launch_forward``): the fastest correct schedule on an H200 at 1k and 8k tokens
# (benchmarks/NOTES.md): FlashAttention-3's (P V under the softmax), with ping-pong at d=64 (1.36-1.40x the portable
# forward at 8k), without at d=128 (and at d=256, not yet timed: the fewest instructions a score offline).
LAUNCHED = {64: Schedule("pv", True), 128: Schedule("pv", False), 256: Schedule("pv", False)}


@gluon.jit
def _store(o, m, l, out, rows, limits, HEAD_DIM: gl.constexpr):
    """O / l and lse stored for the real rows and the head's ``HEAD_DIM`` columns (of the tile's, padded);
    ``limits`` = (seqlen_q, lse_shift): what the scores' maximum m (log2 units) lacks (a softcap's c log2(e):
    ``steps._capped``)."""
    o_ptr, lse_ptr, o_row0, o_col0, o_pitch, lse_row0 = out
    seqlen_q, lse_shift = limits
    HEAD_D: gl.constexpr = o.shape[1]
    o_layout: gl.constexpr = o.type.layout
    lse = (m + lse_shift + gl.log2(l)) * 0.6931471805599453  # log2 units to natural log; -inf for a row with no key
    gl.store(lse_ptr + lse_row0 + rows, lse, mask=rows < seqlen_q)

    inv = 1.0 / gl.where(l == 0.0, 1.0, l)
    o = o * gl.convert_layout(inv, gl.SliceLayout(1, o_layout))[:, None]
    o_rows = gl.convert_layout(rows, gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    offsets = (o_row0 + o_rows).to(gl.int64)[:, None] * o_pitch + (o_col0 + o_cols)[None, :]
    # Pointer stores, not TMA: a tile's last rows may belong to the next sequence of the flat view.
    keep = o_rows[:, None] < seqlen_q
    if HEAD_DIM < HEAD_D:
        keep = keep & (o_cols[None, :] < HEAD_DIM)
    gl.store(o_ptr + offsets, o.to(o_ptr.dtype.element_ty), mask=keep)


@gluon.jit
def _consume(t, ring0, done, WG: gl.constexpr, smem, bars, problem, cu_seqlens_q, cu_seqlens_k,  # noqa: PLR0913
             descale_ptr, LEFT: gl.constexpr, RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, QK_AHEAD: gl.constexpr,
             PINGPONG: gl.constexpr, UNROLL: gl.constexpr, HEAD_DIM: gl.constexpr, PERSISTENT: gl.constexpr):
    """Work tile t (``walk._tile``) for consumer warpgroup WG (0 or 1): its query rows m0 + 64 WG .. + 63 against
    every key tile they see, O and lse stored; (ring0, done) after it: the ring slots and the work tiles this
    program consumed (``walk.py``). ``HEAD_DIM``: the heads' own dim, the tiles' padded up. The switches are
    arguments of their own: inside a tuple, warp_specialize hands constexprs over as tensors."""
    q_smem, k_bufs, v_bufs = smem
    q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, turn = bars
    SCORES: gl.constexpr = (LEFT, RIGHT, SOFTCAP)
    WG_M: gl.constexpr = q_smem.shape[1]
    HEAD_D: gl.constexpr = q_smem.shape[2]
    BLOCK_N: gl.constexpr = k_bufs.shape[1]
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, _instr_k(q_smem.dtype))
    active, geometry, out, coords, span = _tile(t, problem, cu_seqlens_q, cu_seqlens_k, descale_ptr, LEFT, RIGHT,
                                                HEAD_DIM, PERSISTENT, 2 * WG_M, BLOCK_N)
    if active:
        m0, seqlen_q, seqlen_k, qk_scale, band, softcap = geometry
        first, tiles, lead, plain = span
        limits = (seqlen_q, softcap[1] if SOFTCAP else 0.0)
        diagonal, left, right = band
        cap_in, cap_out = softcap
        rows = m0 + WG * WG_M + gl.arange(0, WG_M, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        zero_s = gl.zeros([WG_M, BLOCK_N], gl.float32, s_layout)  # never read: use_acc=False
        # Key tile first + i is ring slot ring0 + i: the steps take slots, the softmax's mask finds the keys.
        scoring = (qk_scale, cap_in, cap_out, first - ring0, seqlen_k, diagonal, left, right)
        ctx = (q_smem.index(WG), k_bufs, v_bufs, zero_s, cols, rows, scoring)
        loop_bars = (k_ready, v_ready, k_empty, v_empty, turn)
        flip = done & 1  # schedule "pv": n + 1 turns a work tile of n key tiles (``steps._pv_schedule``)

        mbarrier.wait(q_bar, done & 1)
        _zero_padding(q_smem.index(WG), HEAD_DIM)
        _ready(k_ready, ring0)
        _take_turn(turn, WG, 0 if QK_AHEAD else (ring0 & 1) ^ flip, PINGPONG)
        s = _qk(ctx, ring0)
        _pass_turn(turn, WG, PINGPONG)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        _release(k_empty, ring0)
        m = gl.full([WG_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l = gl.zeros([WG_M], gl.float32, gl.SliceLayout(1, s_layout))
        o = gl.zeros([WG_M, HEAD_D], gl.float32, _mma_layout(HEAD_D, _instr_k(q_smem.dtype)))
        if QK_AHEAD:
            o, m, l = _qk_schedule((s, o, m, l), (ring0, tiles, lead, plain), ctx, loop_bars, WG, SCORES, PINGPONG,
                                   UNROLL)
        else:
            o, m, l = _pv_schedule((s, o, m, l), (ring0, tiles, lead, plain, flip), ctx, loop_bars, WG, SCORES,
                                   PINGPONG)
        last = ring0 + tiles - 1
        if PERSISTENT:  # every wgmma retired: Q and the V stages the schedule kept go back to the producer
            mbarrier.arrive(q_empty)
            if not QK_AHEAD:  # ("pv" releases V_{j-2} at tile j)
                V_STAGES: gl.constexpr = v_empty.shape[0]
                mbarrier.arrive(v_empty.index((last + V_STAGES - 1) % V_STAGES), pred=tiles >= 2)
            _release(v_empty, last)
        _store(o, m, l, out, rows, limits, HEAD_DIM)
        if PERSISTENT:  # (one work tile a program otherwise: the counts stay constants)
            ring0 = last + 1
            done = done + 1
    return ring0, done


@gluon.jit
def _consumer(WG: gl.constexpr, smem, bars, problem, cu_seqlens_q, cu_seqlens_k, descale_ptr,  # noqa: PLR0913
              LEFT: gl.constexpr, RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, QK_AHEAD: gl.constexpr,
              PINGPONG: gl.constexpr, UNROLL: gl.constexpr, HEAD_DIM: gl.constexpr, PERSISTENT: gl.constexpr):
    """Consumer warpgroup WG: its program's work tiles, one after another (``_consume``)."""
    turn = bars[6]
    if PINGPONG and WG == 1:
        mbarrier.arrive(turn.index(0))  # warpgroup 0 takes the first turn
    if PERSISTENT:
        ring0 = 0
        done = 0
        for i in range(_waves(problem)):
            ring0, done = _consume(_serpentine(i), ring0, done, WG, smem, bars, problem, cu_seqlens_q, cu_seqlens_k,
                                   descale_ptr, LEFT, RIGHT, SOFTCAP, QK_AHEAD, PINGPONG, UNROLL, HEAD_DIM,
                                   PERSISTENT)
    else:
        _consume(_grid_tile(), 0, 0, WG, smem, bars, problem, cu_seqlens_q, cu_seqlens_k, descale_ptr, LEFT, RIGHT,
                 SOFTCAP, QK_AHEAD, PINGPONG, UNROLL, HEAD_DIM, PERSISTENT)


@gluon.jit
def attention_forward_ws_kernel(  # noqa: PLR0913 -- a kernel takes every descriptor, pointer, size and switch
        q_desc, k_desc, v_desc, o_ptr, lse_ptr, descale_ptr, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
        lse_pitch, heads, group, qk_scale, diagonal_offset, bottom_right, window_left, window_right, softcap_in,
        softcap_out, batch_heads, m_blocks,
        LEFT: gl.constexpr, RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, OVERLAP: gl.constexpr,
        PINGPONG: gl.constexpr, UNROLL: gl.constexpr,
        K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
        HEAD_DIM: gl.constexpr, PERSISTENT: gl.constexpr):
    """``batch_heads`` x ``m_blocks`` (128 query rows) work tiles: grid (batch_heads, m_blocks), a tile a program,
    or with PERSISTENT a program an SM, each running its tiles one after another (``walk.py``); num_warps=4 (the
    default partition, consumer 0). ``HEAD_DIM``: the heads' dim, the descriptors' tiles that or padded up
    (``tile_dim``). ``group``: query heads per key/value head (query head h reads kv head h // group). Packed sequences
    (``cu_seqlens_q`` and ``_k``, int32 (batch + 1,)): sequence b is rows [cu[b], cu[b + 1]) of (total, heads, d)
    tensors, lse (heads, ``lse_pitch`` = total queries), seqlen_q the longest (the grid's), and the work tiles
    past a sequence's queries are skipped. Query i sees key j iff j - i - diagonal is at least -``window_left``
    (where LEFT) and at most ``window_right`` (where RIGHT), the diagonal ``diagonal_offset`` plus, where
    ``bottom_right`` (0 or 1), the sequence's seqlen_k - seqlen_q: causal is RIGHT with window_right 0,
    bottom-right. SOFTCAP: the scores s scale become c tanh(s scale / c), ``softcap_in`` = 2 log2(e) scale / c and
    ``softcap_out`` = c log2(e). OVERLAP is "qk" or "pv" (the schedule), UNROLL 1 or 2 (schedule "qk" only). Work
    tiles go every head's block of a row before the next row's: under a right bound alone (causal) the row order
    is reversed, so the query blocks that see the most keys start first and the short ones fill the last wave.
    FP8 (e4m3 q, k and v): ``v_desc`` reads V^T (see ``launch_arguments``) and ``descale_ptr`` (batch, kv_heads)
    float32 multiplies the scores; out is float32 then, P rounded to e4m3 for P V."""
    WG_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, WG_M, HEAD_D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [K_STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [V_STAGES, v_desc.block_type.shape[0], v_desc.block_type.shape[1]],
                                       v_desc.layout)  # keys x d, or FP8's d x keys
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=2)  # one arrival per consumer warpgroup (persistent programs)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)

    smem = (q_smem, k_bufs, v_bufs)
    bars = (q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, turn)
    problem = (o_ptr, lse_ptr, seqlen_q, seqlen_k, lse_pitch, heads, group, qk_scale, diagonal_offset, bottom_right,
               window_left, window_right, softcap_in, softcap_out, batch_heads, m_blocks)
    qk = OVERLAP == "qk"
    # (The offsets and the descales are arguments of their own: either may be None.)
    gl.warp_specialize([
        (_consumer, (0, smem, bars, problem, cu_seqlens_q, cu_seqlens_k, descale_ptr, LEFT, RIGHT, SOFTCAP, qk,
                     PINGPONG, UNROLL, HEAD_DIM, PERSISTENT)),
        (_consumer, (1, smem, bars, problem, cu_seqlens_q, cu_seqlens_k, descale_ptr, LEFT, RIGHT, SOFTCAP, qk,
                     PINGPONG, UNROLL, HEAD_DIM, PERSISTENT)),
        (_producer, ((q_desc, k_desc, v_desc), smem, bars, problem, cu_seqlens_q, cu_seqlens_k, descale_ptr, LEFT,
                     RIGHT, HEAD_DIM, PERSISTENT)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}


def tma_descriptor(flat: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A 2-D TMA descriptor of ``flat`` in ``block`` tiles, in the swizzled layout wgmma reads (the tier's forward
    and backward kernels)."""
    layout = gl.NVMMASharedLayout.get_default_for(block, GL_DTYPES[flat.dtype])
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), block, layout)


def head_tiles(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """``tma_descriptor`` of (batch, seqlen, heads, d) ``t`` viewed as (batch * seqlen, heads * d), ``rows`` x
    ``tile_dim(d)`` tiles: one head's rows of a tile, at column head * d (a padded tile reads on into the next
    head's columns, zeros past the last)."""
    d = t.shape[3]
    return tma_descriptor(t.reshape(t.shape[0] * t.shape[1], t.shape[2] * d), [rows, tile_dim(d)])


def _descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Q in 64-row tiles, K and V in ``BLOCK_N[tile_dim(d)]``-row ones (``head_tiles``). FP8 (d 64, 128 or 256):
    V^T over the (batch * kv_heads * d, keys) view of ``attend.interleaved_values``'s v (keys contiguous), d x
    BLOCK_N tiles."""
    d = q.shape[-1]
    keys = BLOCK_N[tile_dim(d)]
    if q.dtype == torch.float8_e4m3fn:
        values = tma_descriptor(v.permute(0, 2, 3, 1).reshape(-1, v.shape[1]), [d, keys])
    else:
        values = head_tiles(v, keys)
    return head_tiles(q, WG_M), head_tiles(k, keys), values


def _packed_views(q, k, v, cu_seqlens, longest: tuple[str, int]):
    """Packed q (total_q, heads, d), k and v (total_k, kv_heads, d) as one-batch views for the checks and the
    descriptors, with their sequence count; ``cu_seqlens`` (q's, k's) int32 (sequences + 1,) on their device;
    ``longest``: (name, value) of the length the grid is sized by (the forward's max_seqlen_q, the backward's
    max_seqlen_k)."""
    cu_q, cu_k = cu_seqlens
    if q.dtype == torch.float8_e4m3fn:
        raise ValueError("packed sequences take 16-bit q, k and v (FP8's interleaved v starts groups per batch)")
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError("packed q, k, v must be (total, heads, d)")
    if (cu_q.dtype, cu_k.dtype) != (torch.int32, torch.int32) or cu_q.shape != cu_k.shape or cu_q.ndim != 1 or (
            len(cu_q) < 2 or not cu_q.is_contiguous() or not cu_k.is_contiguous()):
        raise ValueError("cu_seqlens must be two contiguous int32 (sequences + 1,) tensors")
    if not longest[1] > 0:
        raise ValueError(f"{longest[0]} must be positive, got {longest[1]}")
    return q[None], k[None], v[None], len(cu_q) - 1


def _check_tensors(q, k, v, out, descale) -> None:
    """What ``launch_arguments`` refuses of the tensors (dense views: packed ones as one batch)."""
    batch, _, heads, d = q.shape
    fp8 = q.dtype == torch.float8_e4m3fn
    if fp8 and d not in TILE_DIMS:
        raise ValueError(f"FP8 takes head dims {', '.join(map(str, TILE_DIMS))}, got {d}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn) or not (q.dtype == k.dtype == v.dtype):
        raise ValueError("q, k, v must share one dtype, bf16, fp16 or float8_e4m3fn")
    kv_heads = k.shape[2]
    if k.shape[0] != batch or k.shape[3] != d or not kv_heads or heads % kv_heads:
        raise ValueError("k must be (batch, seqlen_k, kv_heads, d) with q's batch and d, kv_heads dividing q's heads")
    if fp8 and (v.shape[0] != batch or v.shape[2:] != k.shape[2:] or v.shape[1] % 32 or v.shape[1] < k.shape[1]
                or not v.permute(0, 2, 3, 1).is_contiguous()):
        raise ValueError("FP8 v must be attend.interleaved_values's: keys contiguous, padded to groups of 32")
    if not fp8 and (v.shape != k.shape or not v.is_contiguous()):
        raise ValueError("v must have k's shape and be contiguous")
    if not (q.is_contiguous() and k.is_contiguous()):
        raise ValueError("q, k, v must be contiguous (batch, seqlen, heads, d)")
    if fp8 != (descale is not None) or (fp8 and (descale.dtype != torch.float32 or descale.shape != (batch, kv_heads)
                                                or not descale.is_contiguous())):
        raise ValueError("FP8 takes descale, (batch, kv_heads) float32 contiguous; 16-bit inputs none")
    if fp8 and out.dtype != torch.float32:
        raise ValueError("FP8's out is float32 (v's descale and the rounding follow)")


def launch_arguments(q, k, v, out, lse, *, causal: bool, scale: float, schedule: Schedule,  # noqa: PLR0913
                     descale: torch.Tensor | None = None, window: tuple[int, int] = (-1, -1), top_left: bool = False,
                     diagonal_offset: int = 0, softcap: float = 0.0, cu_seqlens: tuple | None = None,
                     max_seqlen_q: int = 0, programs: int | None = None) -> tuple[tuple, dict]:
    """(grid, keyword arguments) of ``attention_forward_ws_kernel`` for q (batch, seqlen_q, heads, d), k and v (batch,
    seqlen_k, kv_heads, d), kv_heads dividing heads, d a multiple of 8 up to 256 (``tile_dim``), out (q's shape) and lse
    (batch, heads, seqlen_q) float32: ``kernel[grid](**kwargs)``; packed sequences (``cu_seqlens`` = (q's, k's) offsets,
    int32, and ``max_seqlen_q``): q, out (total_q, heads, d), k and v (total_k, kv_heads, d), lse (heads, total_q). FP8
    (q, k, v float8_e4m3fn, not packed, d 64, 128 or 256): v as ``attend.interleaved_values`` returns it (keys
    contiguous, padded to whole groups of 32), ``descale`` (batch, kv_heads) float32 the scores' scale (q's descale
    times k's), out float32 (v's descale and the rounding come after). ``window`` = (left, right), -1 for an unbounded
    side, around a diagonal aligned bottom-right (flash_attn's; ``top_left``: SDPA's) and moved by ``diagonal_offset``:
    query i sees key j iff -left <= j - i - diagonal <= right; ``causal`` is right = 0. ``softcap`` > 0: flash_attn's
    softcap. ``schedule.persistent``: a grid of ``programs`` (default: the device's SMs) that walk the work tiles.
    The tier's ``declines`` says which calls may come here; this refuses the rest, in case one comes another
    way."""
    packed = cu_seqlens is not None
    sequences = 0
    if packed:
        q, k, v, sequences = _packed_views(q, k, v, cu_seqlens, ("max_seqlen_q", max_seqlen_q))
    batch, seqlen_q, heads, d = q.shape
    tile = tile_dim(d)
    _check_tensors(q, k, v, out, descale)
    kv_heads = k.shape[2]
    if not scale > 0:
        raise ValueError("scale must be positive (the row max is taken before scaling)")
    left, right = window
    right = 0 if causal else right
    if left < -1 or right < -1 or not softcap >= 0:
        raise ValueError(f"window sides are -1 (unbounded) or >= 0 and softcap >= 0, got {window} and {softcap}")
    q_desc, k_desc, v_desc = _descriptors(q, k, v)
    kwargs = dict(q_desc=q_desc, k_desc=k_desc, v_desc=v_desc, o_ptr=out, lse_ptr=lse, descale_ptr=descale,
                  cu_seqlens_q=cu_seqlens[0] if packed else None, cu_seqlens_k=cu_seqlens[1] if packed else None,
                  seqlen_q=max_seqlen_q if packed else seqlen_q, seqlen_k=0 if packed else k.shape[1],
                  lse_pitch=seqlen_q if packed else 0, heads=heads, group=heads // kv_heads, qk_scale=scale * LOG2E,
                  diagonal_offset=diagonal_offset, bottom_right=0 if top_left else 1,
                  window_left=max(left, 0), window_right=max(right, 0),
                  softcap_in=2 * LOG2E * scale / softcap if softcap else 0.0, softcap_out=softcap * LOG2E,
                  LEFT=left >= 0, RIGHT=right >= 0, SOFTCAP=softcap > 0, OVERLAP=schedule.overlap,
                  PINGPONG=schedule.pingpong, UNROLL=schedule.unroll, K_STAGES=STAGES[tile][0],
                  V_STAGES=STAGES[tile][1], CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, HEAD_DIM=d,
                  PERSISTENT=schedule.persistent, num_warps=4)
    batch_heads = (sequences if packed else batch) * heads
    m_blocks = triton.cdiv(max_seqlen_q if packed else seqlen_q, BLOCK_M)
    kwargs.update(batch_heads=batch_heads, m_blocks=m_blocks)
    if schedule.persistent:
        return (min(batch_heads * m_blocks, programs or _multiprocessors(q.device)),), kwargs
    return (batch_heads, m_blocks), kwargs


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """A persistent grid's programs: one per SM (a program's shared memory leaves room for no second); asked of
    the driver once a device."""
    if device.type != "cuda":
        return OFFLINE_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
