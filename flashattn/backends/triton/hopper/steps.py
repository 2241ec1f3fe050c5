"""The consumer warpgroups' steps in the Hopper forward (``forward.py``): the key ring's barriers, the ping-pong
turn, the two matmuls, the online softmax, and the two schedules that put a matmul under each softmax."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.constexpr_function
def _mma_layout(n, k=16):
    """The wgmma accumulator layout of a 64 x n tile over one warpgroup (instructions 64 x n x k: k is 16 for 16-bit
    operands, 32 for FP8)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, k])


@gluon.constexpr_function
def _instr_k(dtype):
    """The k of a wgmma instruction on operands of ``dtype``: 32 bytes of each row."""
    return 32 if dtype == gl.float8e4nv else 16


@gluon.jit
def _zero_padding(tile, HEAD_DIM: gl.constexpr):
    """Columns ``HEAD_DIM`` on of one warpgroup's shared ``tile`` (rows x the tile's head dim) set to zero, before a
    wgmma reads it. Below 64, 128 and 256 a head dim runs on tiles of the next of those (``hopper.tile_dim``): a
    TMA tile at column head * HEAD_DIM reads on into the next head's columns (zeros past the last head), so one
    operand of each product over the head dim is zeroed there, once a program: Q in the forward, K and V in the
    backward. What the padding adds to O, dK, dV and dQ lies in columns that are never stored. (The other operand's
    padding is the neighbour's data: an inf or NaN there reaches this head as 0 x inf, where unpadded it would stay
    in its own head.)"""
    if tile.shape[1] > HEAD_DIM:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # a warpgroup's 4 warps
        values = tile.load(layout)
        cols = gl.arange(0, tile.shape[1], layout=gl.SliceLayout(0, layout))
        tile.store(gl.where(cols[None, :] < HEAD_DIM, values, 0.0).to(tile.dtype))
        fence_async_shared()  # the stores, before wgmma (the async proxy) reads them
        gl.thread_barrier()  # every thread's, before any of the warpgroup's wgmmas


@gluon.jit
def _key_span(m0, seqlen_q, seqlen_k, band, LEFT: gl.constexpr, RIGHT: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr):
    """The key tiles the rows [m0, min(m0 + BLOCK_M, seqlen_q)) visit, (first, tiles, lead, plain): ``first`` the
    absolute index of the first, ``tiles`` how many (at least one: a program with no visible key still writes zeros
    and -inf), and, counted from ``first``, the tiles [lead, plain) that every row sees whole, so that need no mask
    (a left window's masked tiles come before them, the right edge's and the end of the keys' after; rows past the
    queries are never stored, so they bound nothing). ``band`` = (diagonal, left, right): row i sees key j iff
    -left <= j - i - diagonal <= right, a side bounded only where LEFT / RIGHT."""
    diagonal, left, right = band
    last = gl.minimum(m0 + BLOCK_M, seqlen_q) - 1
    lo = 0
    hi = seqlen_k
    plain_lo = 0
    plain_hi = seqlen_k // BLOCK_N
    if RIGHT:  # the last row sees the most keys on the right, the first row the fewest
        hi = gl.minimum(hi, gl.maximum(last + diagonal + right + 1, 0))
        plain_hi = gl.minimum(plain_hi, gl.maximum(m0 + diagonal + right + 1, 0) // BLOCK_N)
    if LEFT:  # the first row sees the most keys on the left, the last row the fewest
        lo = gl.maximum(m0 + diagonal - left, 0)
        plain_lo = gl.cdiv(gl.maximum(last + diagonal - left, 0), BLOCK_N)
    # An empty band (lo >= hi) still visits one tile, inside the keys: all of it masked.
    first = gl.minimum(lo // BLOCK_N, gl.maximum(gl.cdiv(seqlen_k, BLOCK_N) - 1, 0))
    tiles = gl.maximum(gl.cdiv(hi, BLOCK_N) - first, 1)
    lead = gl.minimum(gl.maximum(plain_lo - first, 0), tiles)
    return first, tiles, lead, gl.minimum(gl.maximum(plain_hi - first, lead), tiles)


@gluon.jit
def _visible(key, query, seqlen_k, band, LEFT: gl.constexpr, RIGHT: gl.constexpr):
    """Where key ``key`` exists and query ``query`` sees it (both broadcast to a tile either way round: the forward's
    queries x keys, the backward's keys x queries); ``band`` = (diagonal, left, right) as ``_key_span``'s."""
    keep = key < seqlen_k
    if LEFT or RIGHT:
        diagonal, left, right = band
        offset = key - query - diagonal
        if RIGHT:
            keep = keep & (offset <= right)
        if LEFT:
            keep = keep & (offset >= -left)
    return keep


@gluon.jit
def _segments(lo, hi, lead, plain, LEFT: gl.constexpr):
    """A schedule's loops over its tiles [lo, hi) (the rest peeled): masked [lo, begin), unmasked [begin, end),
    masked [end, hi), from ``_key_span``'s lead and plain: (begin, end). Without a left window no leading masked
    loop is compiled (begin = lo)."""
    begin = lo
    if LEFT:
        begin = gl.minimum(gl.maximum(lead, lo), hi)
    return begin, gl.minimum(gl.maximum(plain, begin), hi)


@gluon.jit
def _take_turn(turn, WG: gl.constexpr, parity, PINGPONG: gl.constexpr):
    # Turn k of a warpgroup waits for the k-th completion of its own barrier; the two alternate strictly, so a
    # barrier never completes twice ahead of its waiter and the parity alone names the completion.
    if PINGPONG:
        mbarrier.wait(turn.index(WG), parity)


@gluon.jit
def _pass_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG))


@gluon.jit
def _ready(ring, j):
    """Wait until tile j's stage of a K or V ring has landed (the TMA transaction count completes the barrier)."""
    STAGES: gl.constexpr = ring.shape[0]
    mbarrier.wait(ring.index(j % STAGES), (j // STAGES) & 1)


@gluon.jit
def _release(ring, j):
    STAGES: gl.constexpr = ring.shape[0]
    mbarrier.arrive(ring.index(j % STAGES))


@gluon.jit
def _qk(ctx, j):
    """S_j = Q K_j^T issued (async): 64 x BLOCK_N fp32, both operands in shared memory."""
    q, k_bufs, v_bufs, zero_s, cols, rows, scoring = ctx
    STAGES: gl.constexpr = k_bufs.shape[0]
    return warpgroup_mma(q, k_bufs.index(j % STAGES).permute((1, 0)), zero_s, use_acc=False, is_async=True)


@gluon.jit
def _pv(ctx, o, p, j):
    """O += P_j V_j issued (async): P from registers (``_to_p``'s), V from shared memory: a keys x d tile, or with
    FP8 a d x keys one (V^T: an FP8 wgmma reads B with its k dimension, the keys, contiguous). FP8's P arrives in
    fp32 and becomes the e4m3 operand here: carried across the loop's back edge as e4m3, its bytes were unpacked
    and repacked every trip (offline: 641 instructions a tile at d=128 against 460)."""
    q, k_bufs, v_bufs, zero_s, cols, rows, scoring = ctx
    STAGES: gl.constexpr = v_bufs.shape[0]
    v = v_bufs.index(j % STAGES)
    if v_bufs.dtype == gl.float8e4nv:
        v = v.permute((1, 0))
        HEAD_D: gl.constexpr = o.shape[1]
        p = gl.convert_layout(p.to(v_bufs.dtype), gl.DotOperandLayout(
            operand_index=0, parent=_mma_layout(HEAD_D, _instr_k(v_bufs.dtype)), k_width=4))
    return warpgroup_mma(p, v, o, is_async=True)


@gluon.jit
def _to_p(p, dtype: gl.constexpr, HEAD_D: gl.constexpr):
    """P (fp32, the accumulator's layout) as the P V wgmma takes it from ``_pv``: its 16-bit A operand, or with FP8
    P in fp32 with its keys in the order the values were stored (``attend.interleaved_values``: within each 32
    keys, key 16h + 8g + 2c + l at 16h + 4c + 2g + l), the order the FP8 operand wants them in a thread's registers,
    so that ``_pv``'s conversion moves no data between threads (FlashAttention-3's; the portable kernels'
    ``tiles.fp8_operand_order``)."""
    if dtype == gl.float8e4nv:
        rows: gl.constexpr = p.shape[0]
        keys: gl.constexpr = p.shape[1]
        p = gl.reshape(gl.permute(gl.reshape(p, [rows, keys // 32, 2, 2, 4, 2]), [0, 1, 2, 4, 3, 5]), [rows, keys])
    else:
        p = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=_mma_layout(HEAD_D),
                                                               k_width=2))
    return p


@gluon.jit
def _rescale(o, alpha):
    return o * gl.convert_layout(alpha, gl.SliceLayout(1, o.type.layout))[:, None]


@gluon.jit
def _capped(y):
    """The softcap's tanh(x) (y = 2 log2(e) x) as -1 / (2^y + 1) = (tanh(x) - 1) / 2: affine in tanh, so with the
    scale 2 c log2(e) it gives every score c log2(e) tanh(x) less the same c log2(e), which the softmax does not
    see and the lse adds back (``_store``). Two MUFU ops (``ex2.approx`` and ``rcp.approx``, each within about
    2^-22), saturating without overflow: within 1e-7 of the portable kernels' form, whose backward recomputes the
    probabilities from this forward's lse. (``tanh.approx``, FlashAttention-3's, is one op but about 2^-11 off:
    0.015 in a logit capped at 30, a 1.5 % bias in the recomputed P near saturation; IEEE division costs 9
    instructions a score.)"""
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [-1.0 - gl.exp2(y)], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _softmax(s, m, l, j, ctx, MASK: gl.constexpr, SCORES: gl.constexpr):
    """Online softmax of score tile j (``s`` = raw QK^T, 64 x BLOCK_N; j its ring slot, key tile ``first`` + j):
    (P fp32, alpha, new row max, new row sum), the row max in log2 units of the scaled scores. ``SCORES`` = (LEFT,
    RIGHT, SOFTCAP): which sides of the band bound the keys (masked on ``MASK`` tiles), and whether a softcap c
    applies: s scale becomes c tanh(s scale / c), so ``_capped(s cap_in)`` (cap_in = 2 log2(e) scale / c) takes
    the raw score's place and 2 cap_out (cap_out = c log2(e)) the scale's, every score cap_out short (masked after
    the softcap, as in the portable kernels: -inf, not -c)."""
    q, k_bufs, v_bufs, zero_s, cols, rows, scoring = ctx
    qk_scale, cap_in, cap_out, first, seqlen_k, diagonal, left, right = scoring
    LEFT: gl.constexpr = SCORES[0]
    RIGHT: gl.constexpr = SCORES[1]
    SOFTCAP: gl.constexpr = SCORES[2]
    BLOCK_N: gl.constexpr = s.shape[1]
    scale = qk_scale
    if SOFTCAP:
        s = _capped(s * cap_in)
        scale = 2.0 * cap_out
    if MASK:
        key = (first + j) * BLOCK_N + cols
        keep = _visible(key[None, :], rows[:, None], seqlen_k, (diagonal, left, right), LEFT, RIGHT)
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, axis=1) * scale)  # scale > 0: the max commutes with it
    # A row with no key yet gets p = 0, not NaN; an unmasked tile gives every row a finite score.
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new) if MASK else m_new
    alpha = gl.exp2(m - m_use)
    p = gl.exp2(s * scale - m_use[:, None])  # the scale folded into the exponent's one FFMA
    return p, alpha, m_new, l * alpha + gl.sum(p, axis=1)


# --- schedule "qk": S_{j+1} = Q K_{j+1}^T runs while the softmax of S_j does ------------------------------------


@gluon.jit
def _softmax_pv(s, o, m, l, j, ctx, bars, WG: gl.constexpr, TURN: gl.constexpr, MASK: gl.constexpr,  # noqa: PLR0913
                SCORES: gl.constexpr, PINGPONG: gl.constexpr):
    """The softmax of S_j, then O += P_j V_j issued in this warpgroup's ``TURN`` (left in flight)."""
    k_ready, v_ready, k_empty, v_empty, turn = bars
    p, alpha, m, l = _softmax(s, m, l, j, ctx, MASK, SCORES)
    o = _rescale(o, alpha)
    _ready(v_ready, j)
    _take_turn(turn, WG, TURN, PINGPONG)
    o = _pv(ctx, o, _to_p(p, ctx[2].dtype, o.shape[1]), j)
    _pass_turn(turn, WG, PINGPONG)
    return o, m, l


@gluon.jit
def _qk_step(j, state, ctx, bars, WG: gl.constexpr, MASK: gl.constexpr, SCORES: gl.constexpr,
             PINGPONG: gl.constexpr):
    """Tile j, state (S_j retired, O, m, l): S_{j+1} issued, softmax of S_j under it, PV_j issued, both retired."""
    s, o, m, l = state
    k_ready, v_ready, k_empty, v_empty, turn = bars
    _ready(k_ready, j + 1)
    _take_turn(turn, WG, 1, PINGPONG)
    s_next = _qk(ctx, j + 1)
    _pass_turn(turn, WG, PINGPONG)
    o, m, l = _softmax_pv(s, o, m, l, j, ctx, bars, WG, 0, MASK, SCORES, PINGPONG)
    # Nothing stays in flight across the back edge: with PV_j still in flight there (retired after the next
    # softmax), ptxas serialised every wgmma of the kernel (C7514, "non wgmma instructions reading accumulator
    # registers of a wgmma between start and end of the pipeline stage").
    s, o = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, o))
    _release(k_empty, j + 1)
    _release(v_empty, j)
    return s, o, m, l


@gluon.jit
def _qk_schedule(state, span, ctx, bars, WG: gl.constexpr, SCORES: gl.constexpr, PINGPONG: gl.constexpr,
                 UNROLL: gl.constexpr):
    """Schedule "qk" from state (S_0 retired, O, m, l) over span (the ring slot of the first tile, r0, then
    ``_key_span``'s tiles, lead, plain: masked tiles [0, lead) under a left window, unmasked [lead, plain), masked up
    to tiles; tile i is ring slot r0 + i, the index the steps take); the last tile is peeled: no S_{j+1} to issue.
    Each tile takes 2 turns of ping-pong, so every program's count stays even: the parities are constants."""
    s, o, m, l = state
    r0, tiles, lead, plain = span
    k_ready, v_ready, k_empty, v_empty, turn = bars
    LEFT: gl.constexpr = SCORES[0]
    begin, plain = _segments(0, tiles - 1, lead, plain, LEFT)
    if LEFT:
        for j in range(r0, r0 + begin):
            s, o, m, l = _qk_step(j, (s, o, m, l), ctx, bars, WG, True, SCORES, PINGPONG)
    if UNROLL == 2:
        # S_j and S_{j+1} swap register sets instead of a 64-register copy closing every trip (the wgmma result
        # lands in the same registers each time). An odd plain tile goes to the masked loop.
        start = begin + (plain - begin) // 2 * 2
        for j in range(r0 + begin, r0 + start, 2):
            s, o, m, l = _qk_step(j, (s, o, m, l), ctx, bars, WG, False, SCORES, PINGPONG)
            s, o, m, l = _qk_step(j + 1, (s, o, m, l), ctx, bars, WG, False, SCORES, PINGPONG)
    else:
        start = plain
        for j in range(r0 + begin, r0 + plain):
            s, o, m, l = _qk_step(j, (s, o, m, l), ctx, bars, WG, False, SCORES, PINGPONG)
    for j in range(r0 + start, r0 + tiles - 1):
        s, o, m, l = _qk_step(j, (s, o, m, l), ctx, bars, WG, True, SCORES, PINGPONG)
    o, m, l = _softmax_pv(s, o, m, l, r0 + tiles - 1, ctx, bars, WG, 1, True, SCORES, PINGPONG)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
    return o, m, l


# --- schedule "pv" (FlashAttention-3's Algorithm 2): O += P_{j-1} V_{j-1} runs while the softmax of S_j does ------


@gluon.jit
def _pv_step(j, state, ctx, bars, walk, WG: gl.constexpr, MASK: gl.constexpr,  # noqa: PLR0913
             SCORES: gl.constexpr, PINGPONG: gl.constexpr):
    """Tile j (a ring slot), state (P_{j-1} in operand registers, its alpha, O retired, m, l): S_j and PV_{j-1}
    issued back to back (one turn), S_j retired, its softmax under PV_{j-1}, then PV_{j-1} retired and P_j
    converted. ``walk`` = (r0, flip): the slot of the work tile's first key tile, and what turns the ping-pong
    parity (``_pv_schedule``)."""
    p, alpha, o, m, l = state
    k_ready, v_ready, k_empty, v_empty, turn = bars
    r0, flip = walk
    STAGES: gl.constexpr = v_empty.shape[0]
    _ready(k_ready, j)
    _take_turn(turn, WG, (j & 1) ^ flip, PINGPONG)
    s = _qk(ctx, j)
    o = _rescale(o, alpha)
    _ready(v_ready, j - 1)
    o = _pv(ctx, o, p, j - 1)
    _pass_turn(turn, WG, PINGPONG)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
    _release(k_empty, j)
    # V_{j-2}, not V_{j-1}: an arrive that must follow PV_{j-1}'s retirement lets ptxas hoist that wait above the
    # softmax (measured: 33 instructions left under PV instead of about 200). Hence V's deeper ring.
    mbarrier.arrive(v_empty.index((j + STAGES - 2) % STAGES), pred=j >= r0 + 2)
    p, alpha, m, l = _softmax(s, m, l, j, ctx, MASK, SCORES)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
    # Converted only now: P_{j-1}'s registers are wgmma inputs until PV_{j-1} retires.
    return _to_p(p, ctx[2].dtype, o.shape[1]), alpha, o, m, l


@gluon.jit
def _pv_schedule(state, span, ctx, bars, WG: gl.constexpr, SCORES: gl.constexpr, PINGPONG: gl.constexpr):
    """Schedule "pv" from state (S_0 retired, O, m, l) over span (as ``_qk_schedule``'s, and ``flip``; tile 0 is
    masked here whatever it is); the last PV is issued after the loops. A work tile of n key tiles takes n + 1 turns
    of ping-pong: turn i of one whose first slot is r0 has the parity (r0 + i) ^ flip, flip the parity of the work
    tiles the program ran before (``forward._consume``)."""
    s, o, m, l = state
    r0, tiles, lead, plain, flip = span
    k_ready, v_ready, k_empty, v_empty, turn = bars
    LEFT: gl.constexpr = SCORES[0]
    walk = (r0, flip)
    p, alpha, m, l = _softmax(s, m, l, r0, ctx, True, SCORES)
    p = _to_p(p, ctx[2].dtype, o.shape[1])
    begin, plain = _segments(1, tiles, lead, plain, LEFT)
    if LEFT:
        for j in range(r0 + 1, r0 + begin):
            p, alpha, o, m, l = _pv_step(j, (p, alpha, o, m, l), ctx, bars, walk, WG, True, SCORES, PINGPONG)
    for j in range(r0 + begin, r0 + plain):
        p, alpha, o, m, l = _pv_step(j, (p, alpha, o, m, l), ctx, bars, walk, WG, False, SCORES, PINGPONG)
    for j in range(r0 + plain, r0 + tiles):
        p, alpha, o, m, l = _pv_step(j, (p, alpha, o, m, l), ctx, bars, walk, WG, True, SCORES, PINGPONG)
    last = r0 + tiles - 1
    o = _rescale(o, alpha)
    _ready(v_ready, last)
    _take_turn(turn, WG, ((last + 1) & 1) ^ flip, PINGPONG)
    o = _pv(ctx, o, p, last)
    _pass_turn(turn, WG, PINGPONG)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
    return o, m, l
