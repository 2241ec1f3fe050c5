"""What the Hopper tier's two one-pass backward kernels share (``backward.py`` at head dims 64 and 128,
``backward_wide.py`` at 256): a program's keys and the query tiles that see them, its shared memory and barriers,
the producer that fills the Q and dO ring, the walk over the group's query heads and tiles, P and dS from a tile's
scores, dQ's atomic adds and the stores of dK and dV."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .steps import _capped, _visible


@gluon.jit
def _probs_and_grads(s, dp, stats, at, scoring, MASK: gl.constexpr, SCORES: gl.constexpr):
    """(P, dS / scale) of a tile from its raw scores S and dP (keys x queries here, queries x keys in the wide
    kernel: ``stats`` = (-lse in log2 units, delta) and ``at`` = (key, query index) broadcast to the tile either
    way). ``SCORES`` = (LEFT, RIGHT, SOFTCAP) as the forward's (``steps._softmax``): on ``MASK`` tiles, keys past
    the sequence and outside the band give P = dS = 0; a softcap c recomputes the forward's scores from r =
    ``steps._capped(s cap_in)`` (the capped score is cap_out (1 + 2 r)) and multiplies dS by its derivative,
    1 - tanh^2 = -4 r (1 + r)."""
    neg_lse2, delta = stats
    qk_scale, seqlen_k, band, cap = scoring  # (band and cap empty where unused: ``_program``)
    LEFT: gl.constexpr = SCORES[0]
    RIGHT: gl.constexpr = SCORES[1]
    SOFTCAP: gl.constexpr = SCORES[2]
    if SOFTCAP:
        cap_in, cap_out = cap
        r = _capped(s * cap_in)
        p = gl.exp2(r * (2.0 * cap_out) + (cap_out + neg_lse2))
    else:
        p = gl.exp2(s * qk_scale + neg_lse2)
    if MASK:  # keys past the sequence read whatever follows: P = 0 there, so dS = 0 and nothing reaches dK or dQ
        key, query = at
        p = gl.where(_visible(key, query, seqlen_k, band, LEFT, RIGHT), p, 0.0)
    ds = p * (dp - delta)
    if SOFTCAP:
        ds = ds * (-4.0 * r * (1.0 + r))
    return p, ds


@gluon.jit
def _add_dq(dq, dq_ptr, row0, col0, rows_left, DQ_PITCH: gl.constexpr, COLS_LEFT: gl.constexpr, looked):
    """dQ's tile (its rows from ``row0``, columns from ``col0``; rows past ``rows_left`` not in the sequence, columns
    past ``COLS_LEFT`` not in the head: a padded head dim's) added into the fp32 sum with atomics, in its turn where
    ``looked`` (``_look_at_turn``'s) says one. The tile's first row and column are one scalar pointer and the
    elements' offsets from it constants (the row pitch a constexpr): the atomics take them as immediates, where a
    tensor of addresses, hoisted out of the loop, spilled."""
    if len(looked) > 0:
        _wait_turn(looked[0], looked[1], looked[3])
    layout: gl.constexpr = dq.type.layout
    tile_ptr = dq_ptr + row0.to(gl.int64) * DQ_PITCH + col0
    rows = gl.arange(0, dq.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, dq.shape[1], layout=gl.SliceLayout(0, layout))
    keep = rows[:, None] < rows_left
    if dq.shape[1] > COLS_LEFT:
        keep = keep & (cols[None, :] < COLS_LEFT)
    gl.atomic_add(tile_ptr + rows[:, None] * DQ_PITCH + cols[None, :], dq, mask=keep, sem="relaxed")
    if len(looked) > 0:
        _end_turn(looked[0], looked[1], looked[2])


@gluon.jit
def _key_block(dq_turns, RIGHT: gl.constexpr):
    """The program's key block: the grid's second index, reversed where dQ's adds are ordered under a right bound
    (``dq_turns`` not None: see ``_dq_turn``), so that every block a program waits for started before it."""
    n_block = gl.program_id(1)
    if dq_turns is not None and RIGHT:
        n_block = gl.num_programs(1) - 1 - n_block
    return n_block


@gluon.jit
def _dq_turn(order, j, SCORES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(rank, count): this program's key block's place among the ``count`` blocks that add into query tile j's dQ,
    in the order they add (``deterministic``): under a right bound from the last block that sees the tile down
    (started together, the blocks reach a tile in that order: a later block's first tile is a later one), else from
    the first up. The blocks that see a tile are consecutive (``_query_tiles``' bounds grow with the block), from the
    first whose last key the tile's first row sees to the last whose first key its last row sees. ``order`` =
    ``_program``'s (semaphores, block, diagonal, left, right, seqlen_k)."""
    n_block = order[1]
    diagonal, left, right, seqlen_k = order[2], order[3], order[4], order[5]
    first = 0
    last = gl.cdiv(seqlen_k, BLOCK_N) - 1
    if SCORES[0]:
        first = gl.maximum(j * BLOCK_M + diagonal - left, 0) // BLOCK_N
    if SCORES[1]:
        last = gl.minimum(gl.maximum((j + 1) * BLOCK_M + diagonal + right - 1, 0) // BLOCK_N, last)
        rank = last - n_block
    else:
        rank = n_block - first
    return rank, last - first + 1


@gluon.jit
def _look_at_turn(order, j, SCORES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,  # noqa: PLR0913
                  SLOT: gl.constexpr, TURNS: gl.constexpr, WG: gl.constexpr):
    """Deterministic (``order`` not empty): (counter, turn, final turn, the counter read with acquire) of query tile
    j's dQ adds, for ``_add_dq``; read while the tile's products run, so that the read's latency hides under them.
    ``SLOT``: the tile's counter (one per warpgroup where each adds its own columns); ``TURNS``: adds a block (two
    where both warpgroups add every column, warpgroup 0 first). Not deterministic: ()."""
    if len(order) > 0:
        sem = order[0] + 2 * j + SLOT
        rank, count = _dq_turn(order, j, SCORES, BLOCK_M, BLOCK_N)
        turn = TURNS * rank + WG % TURNS
        looked = (sem, turn, TURNS * count - 1, gl.atomic_add(sem, 0, sem="acquire"))
    else:
        looked = ()
    return looked


@gluon.jit
def _wait_turn(sem_ptr, turn, seen):
    """Until the semaphore reads ``turn``: ``seen`` (``_look_at_turn``'s) did, or a relaxed poll does (an acquire
    invalidates L1 each time), then one acquire: the adds it counts come before this warpgroup's."""
    while seen != turn:  # (the acquire's value tested, so that it is not dropped as unused)
        while gl.atomic_add(sem_ptr, 0, sem="relaxed") != turn:
            pass
        seen = gl.atomic_add(sem_ptr, 0, sem="acquire")


@gluon.jit
def _end_turn(sem_ptr, turn, final):
    """The next add's turn, once every thread of the warpgroup has issued its adds (release: they come first); after
    the ``final`` one, zero again: semaphores leave a launch as they came (``tickets``)."""
    gl.thread_barrier()
    gl.atomic_add(sem_ptr, 1 - (turn == final).to(gl.int32) * (turn + 1), sem="release")


@gluon.jit
def _group_tiles(TILE: gl.constexpr, grads, ctx, geometry, heads, SCORES: gl.constexpr,  # noqa: PLR0913
                 HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, WG: gl.constexpr):
    """(dK, dV) after ``TILE`` (``_tile`` or the wide kernel's) ran over every query tile that sees the program's
    keys, for each query head of the key/value head's group in turn: the tiles on the band's edges or past either
    sequence's end take the mask, those between none. ``HEAD_DIM``: the heads' own dim (the tiles' is padded up)."""
    dk, dv = grads
    n0, lo, full_lo, full_hi, hi, seqlen_q, scale, scoring = geometry
    neg_lse2_ptr, delta_ptr, dq_ptr, q_start, stats_row0, stats_pitch, h0, group, order = heads
    for g in range(group):
        h = h0 + g
        at = stats_row0 + h * stats_pitch  # this head's rows of neg_lse2 and delta
        if len(order) > 0:  # this head's semaphores
            head_order = (order[0] + h * order[6], order[1], order[2], order[3], order[4], order[5])
        else:
            head_order = order
        stats = (neg_lse2_ptr + at, delta_ptr + at, dq_ptr, q_start, h * HEAD_DIM, head_order)
        first = g * (hi - lo) - lo  # ring slot of tile j: first + j, counted across the group's heads
        for j in range(lo, full_lo):
            dk, dv = TILE(j, first + j, (dk, dv), ctx, stats, True, SCORES, HEADS * HEAD_DIM, WG, HEAD_DIM)
        for j in range(full_lo, full_hi):
            dk, dv = TILE(j, first + j, (dk, dv), ctx, stats, False, SCORES, HEADS * HEAD_DIM, WG, HEAD_DIM)
        for j in range(full_hi, hi):
            dk, dv = TILE(j, first + j, (dk, dv), ctx, stats, True, SCORES, HEADS * HEAD_DIM, WG, HEAD_DIM)
    return dk, dv


@gluon.jit
def _store_grads(dk, dv, outs, key0, col0, seqlen_k, HEAD_DIM: gl.constexpr):
    """dK and dV of keys ``key0`` on (columns ``col0`` on of the head's), stored where the keys and the columns (the
    head's ``HEAD_DIM``) exist."""
    heads, dk_ptr, dv_ptr, kv_row0, kv_pitch, kv_col0 = outs
    layout: gl.constexpr = dk.type.layout
    out_rows = key0 + gl.arange(0, dk.shape[0], layout=gl.SliceLayout(1, layout))
    out_cols = col0 + gl.arange(0, dk.shape[1], layout=gl.SliceLayout(0, layout))
    offsets = (kv_row0 + out_rows).to(gl.int64)[:, None] * kv_pitch + (kv_col0 + out_cols)[None, :]
    keep = out_rows[:, None] < seqlen_k
    if col0 + dk.shape[1] > HEAD_DIM:  # (col0 a constexpr: 0, or a wide warpgroup's half)
        keep = keep & (out_cols[None, :] < HEAD_DIM)
    gl.store(dk_ptr + offsets, dk.to(dk_ptr.dtype.element_ty), mask=keep)
    gl.store(dv_ptr + offsets, dv.to(dv_ptr.dtype.element_ty), mask=keep)


@gluon.jit
def _producer(descs, smem, bars, coords, span):
    """One warp: K and V once, then Q_j and dO_j of every query tile of each query head of the group in turn into
    the ring; a stage is refilled once both consumers have released it (count 2)."""
    q_desc, k_desc, v_desc, do_desc = descs
    k_smem, v_smem, q_bufs, do_bufs = smem
    kv_bar, q_ready, q_empty = bars
    q_row0, kv_row0, q_col0, kv_col, group, head_step = coords
    lo, hi = span
    WG_N: gl.constexpr = k_smem.shape[1]
    STAGES: gl.constexpr = q_bufs.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.shape[1]
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [kv_row0 + w * WG_N, kv_col], kv_bar, k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [kv_row0 + w * WG_N, kv_col], kv_bar, v_smem.index(w))
    for g in range(group):
        col = q_col0 + g * head_step
        for j in range(lo, hi):
            i = g * (hi - lo) + j - lo
            stage = i % STAGES
            # A fresh mbarrier counts as having completed the phase before phase 0: the first lap does not wait.
            mbarrier.wait(q_empty.index(stage), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            row = q_row0 + j * BLOCK_M
            tma.async_copy_global_to_shared(q_desc, [row, col], q_ready.index(stage), q_bufs.index(stage))
            tma.async_copy_global_to_shared(do_desc, [row, col], q_ready.index(stage), do_bufs.index(stage))


@gluon.jit
def _query_tiles(n0, seqlen_q, seqlen_k, band, LEFT: gl.constexpr, RIGHT: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr):
    """(lo, full_lo, full_hi, hi): the query tiles [lo, hi) that see keys [n0, n0 + BLOCK_N), of which those in
    [full_lo, full_hi) see all of them and lie inside both sequences (no mask). ``band`` = (diagonal, left, right):
    query i sees key j iff -left <= j - i - diagonal <= right, a side bounded only where LEFT / RIGHT."""
    diagonal, left, right = band
    hi = gl.cdiv(seqlen_q, BLOCK_M)
    lo = 0
    full_lo = 0
    full_hi = seqlen_q // BLOCK_M
    if RIGHT:  # i >= j - diagonal - right: the block's first key bounds the first tile, its last the first whole one
        lo = gl.maximum(n0 - diagonal - right, 0) // BLOCK_M
        full_lo = gl.cdiv(gl.maximum(n0 + BLOCK_N - 1 - diagonal - right, 0), BLOCK_M)
    if LEFT:  # i <= j - diagonal + left: the block's last key bounds the last tile, its first the last whole one
        last = gl.minimum(n0 + BLOCK_N, seqlen_k) - 1  # (keys past the sequence bound nothing)
        hi = gl.minimum(hi, gl.cdiv(gl.maximum(last + 1 - diagonal + left, 0), BLOCK_M))
        full_hi = gl.minimum(full_hi, gl.maximum(n0 - diagonal + left + 1, 0) // BLOCK_M)
    lo = gl.minimum(lo, hi)
    full_lo = gl.minimum(gl.maximum(full_lo, lo), hi)
    if n0 + BLOCK_N > seqlen_k:  # keys past the sequence in every tile: all masked
        full_hi = full_lo
    full_hi = gl.minimum(gl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@gluon.jit
def _sequence(cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, lse_pitch, HEADS: gl.constexpr, group):
    """The program's sequence: (its first query row, first key row, lengths, its rows of the statistics, their
    pitch a head), dense ((batch, seqlen, heads, d), statistics (batch, heads, seqlen_q)) or packed (offsets
    ``cu_seqlens_q`` and ``_k``; (total, heads, d), statistics (heads, ``lse_pitch`` = total queries))."""
    b = gl.program_id(0) // (HEADS // group)
    if cu_seqlens_q is not None:
        q_start = gl.load(cu_seqlens_q + b)
        k_start = gl.load(cu_seqlens_k + b)
        seqlen_q = gl.load(cu_seqlens_q + b + 1) - q_start
        seqlen_k = gl.load(cu_seqlens_k + b + 1) - k_start
        stats_row0 = q_start
        stats_pitch = lse_pitch
    else:
        q_start = b * seqlen_q
        k_start = b * seqlen_k
        stats_row0 = b * HEADS * seqlen_q
        stats_pitch = seqlen_q
    return q_start, k_start, seqlen_q, seqlen_k, stats_row0, stats_pitch


@gluon.jit
def _program(descs, pointers, sequence, group, scale, scoring, dq_turns, HEADS: gl.constexpr,  # noqa: PLR0913
             LEFT: gl.constexpr, RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, STAGES: gl.constexpr,
             HEAD_DIM: gl.constexpr):
    """What both backward kernels share (this one and ``backward_wide.py``'s): the program's keys, the query tiles
    that see them, K, V and the Q/dO ring in shared memory with their barriers, and the partitions' arguments:
    (smem, bars, geometry, outs, coords, span). ``sequence``: ``_sequence``'s; ``dq_turns``: (semaphores, their
    pitch a head) where dQ's adds are ordered (the tiles' ``order``; ``_dq_turn``), else (None, 0); ``HEAD_DIM``:
    the heads' own dim, the tiles' that or padded up (``hopper.tile_dim``)."""
    q_desc, k_desc, v_desc, do_desc = descs
    dq_ptr, dk_ptr, dv_ptr, neg_lse2_ptr, delta_ptr = pointers
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    WG_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    kv_heads = HEADS // group
    hk = gl.program_id(0) % kv_heads
    n_block = _key_block(dq_turns[0], RIGHT)
    n0 = n_block * (2 * WG_N)
    q_start, k_start, seqlen_q, seqlen_k, stats_row0, stats_pitch = sequence
    qk_scale, cap_in, cap_out, diagonal_offset, bottom_right, left, right = scoring
    diagonal = diagonal_offset + bottom_right * (seqlen_k - seqlen_q)
    lo, full_lo, full_hi, hi = _query_tiles(n0, seqlen_q, seqlen_k, (diagonal, left, right), LEFT, RIGHT, BLOCK_M,
                                            2 * WG_N)
    k_smem = gl.allocate_shared_memory(dtype, [2, WG_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, WG_N, HEAD_D], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer warpgroup
    smem = (k_smem, v_smem, q_bufs, do_bufs)
    bars = (kv_bar, q_ready, q_empty)
    # _probs_and_grads's, with only the values it reads: every one is handed to both consumers, and at d=256 three
    # unused ones cost a spill in the key loop.
    band = (diagonal, left, right) if LEFT or RIGHT else ()
    cap = (cap_in, cap_out) if SOFTCAP else ()
    scores = (qk_scale, seqlen_k, band, cap)
    geometry = (n0, lo, full_lo, full_hi, hi, seqlen_q, scale, scores)
    sems, sem_pitch = dq_turns
    if sems is not None:  # a query tile's semaphores: its sequence's number plus its first row over BLOCK_M (distinct
        # across packed sequences without their longest length), two a tile (``backward.py``'s ``_tile``)
        tile0 = gl.program_id(0) // kv_heads + q_start // BLOCK_M
        order = (sems + 2 * tile0, n_block, diagonal, left, right, seqlen_k, 2 * sem_pitch)
    else:
        order = ()  # (a None in a returned tuple would not compile)
    query_heads = (neg_lse2_ptr, delta_ptr, dq_ptr, q_start, stats_row0, stats_pitch, hk * group, group, order)
    outs = (query_heads, dk_ptr, dv_ptr, k_start, kv_heads * HEAD_DIM, hk * HEAD_DIM)
    coords = (q_start, k_start + n0, hk * group * HEAD_DIM, hk * HEAD_DIM, group, HEAD_DIM)
    return smem, bars, geometry, outs, coords, (lo, hi)
