"""The Hopper forward's work tiles (``forward.py``): which (sequence, head, 128 query rows) a program runs, and
the producer warp that loads each one's Q, K and V.

A work tile is t = row block x (batch x heads) + (batch x head): every head's block of a row before the next row's,
and under a right bound alone (causal) the row blocks reversed, so that the tiles that see the most keys come
first. A program runs one tile (grid (batch x heads, row blocks)) or, persistent, one program per SM runs the
tiles in waves of one per program, its i-th ``_serpentine``: on the way back in odd waves, so that a program that
took one of the longest tiles of a wave takes one of the shortest of the next. The mbarrier rings run on across
a persistent program's tiles: a K or V tile's ring slot counts every key tile the program loaded before it, the
Q barrier's phase every work tile, and Q is reloaded once both consumers have released it (``q_empty``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .steps import _key_span


@gluon.jit
def _serpentine(i):
    """The work tile of a persistent program's i-th wave (grid: one program per SM)."""
    p = gl.program_id(0)
    programs = gl.num_programs(0)
    return i * programs + p + (i % 2) * (programs - 1 - 2 * p)


@gluon.jit
def _waves(problem):
    """How many waves a persistent program walks (the last one's tiles past the end are skipped: ``_tile``)."""
    total = problem[14] * problem[15]  # batch_heads x m_blocks
    return gl.cdiv(total, gl.num_programs(0))


@gluon.jit
def _grid_tile():
    """The work tile of a program of the (batch x heads, row blocks) grid."""
    return gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)


@gluon.jit
def _tile(t, problem, cu_seqlens_q, cu_seqlens_k, descale_ptr, LEFT: gl.constexpr,  # noqa: PLR0913
          RIGHT: gl.constexpr, HEAD_DIM: gl.constexpr, PERSISTENT: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr):
    """Work tile t: (active, geometry, out, coords, span). ``active``: the tile has queries (packed sequences: the
    grid is sized for the longest; persistent: the last wave runs past the tiles), a constexpr True where it always
    has. ``problem``: the kernel's scalars (``forward.attention_forward_ws_kernel``); ``span``: ``_key_span``'s."""
    (o_ptr, lse_ptr, seqlen_q, seqlen_k, lse_pitch, heads, group, qk_scale, diagonal_offset, bottom_right,
     window_left, window_right, softcap_in, softcap_out, batch_heads, m_blocks) = problem
    pid_bh = t % batch_heads
    pid_m = t // batch_heads
    if RIGHT and not LEFT:  # causal: the row blocks that see the most keys first
        pid_m = m_blocks - 1 - pid_m
    b = pid_bh // heads
    h = pid_bh % heads
    m0 = pid_m * BLOCK_M
    active = True
    if cu_seqlens_q is not None:  # packed: sequence b's rows of the (total, heads, d) views
        q_start = gl.load(cu_seqlens_q + b)
        k_start = gl.load(cu_seqlens_k + b)
        seqlen_q = gl.load(cu_seqlens_q + b + 1) - q_start
        seqlen_k = gl.load(cu_seqlens_k + b + 1) - k_start
        lse_row0 = h * lse_pitch + q_start
        active = m0 < seqlen_q
    else:
        q_start = b * seqlen_q
        k_start = b * seqlen_k
        lse_row0 = pid_bh * seqlen_q
    if PERSISTENT:  # the last wave runs past the tiles
        within = t < batch_heads * m_blocks
        active = within if cu_seqlens_q is None else active & within
    band = (diagonal_offset + bottom_right * (seqlen_k - seqlen_q), window_left, window_right)
    span = _key_span(m0, seqlen_q, seqlen_k, band, LEFT, RIGHT, BLOCK_M, BLOCK_N)
    hk = h // group
    if descale_ptr is not None:  # FP8: q's descale times k's, per (batch, kv head)
        descale = gl.load(descale_ptr + b * (heads // group) + hk)
        qk_scale = qk_scale * descale
        softcap_in = softcap_in * descale
    geometry = (m0, seqlen_q, seqlen_k, qk_scale, band, (softcap_in, softcap_out))
    out = (o_ptr, lse_ptr, q_start, h * HEAD_DIM, heads * HEAD_DIM, lse_row0)
    coords = (q_start + m0, k_start, h * HEAD_DIM, hk * HEAD_DIM, (b * (heads // group) + hk) * HEAD_DIM)
    return active, geometry, out, coords, span


@gluon.jit
def _load(desc, bufs, ready, empty, j, row, col):
    """Tile j (its ring slot) into its stage of a ring once both consumers have released the stage's previous
    tile."""
    STAGES: gl.constexpr = bufs.shape[0]
    stage = j % STAGES
    # A fresh mbarrier counts as having completed the phase before phase 0: the first lap does not wait.
    mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(stage), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], ready.index(stage), bufs.index(stage))


@gluon.jit
def _produce(t, ring0, done, descs, smem, bars, problem, cu_seqlens_q, cu_seqlens_k,  # noqa: PLR0913
             descale_ptr, LEFT: gl.constexpr, RIGHT: gl.constexpr, HEAD_DIM: gl.constexpr,
             PERSISTENT: gl.constexpr):
    """Work tile t's loads: Q (once both consumers released the last tile's), then K_j and V_j of every key tile
    it visits into ring slots ring0 + j; (ring0, done) after it (key tiles and work tiles loaded)."""
    q_desc, k_desc, v_desc = descs
    q_smem, k_bufs, v_bufs = smem
    q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, turn = bars
    WG_M: gl.constexpr = q_smem.shape[1]
    BLOCK_N: gl.constexpr = k_bufs.shape[1]
    active, geometry, out, coords, span = _tile(t, problem, cu_seqlens_q, cu_seqlens_k, descale_ptr, LEFT, RIGHT,
                                                HEAD_DIM, PERSISTENT, 2 * WG_M, BLOCK_N)
    if active:
        q_row, kv_row, q_col, kv_col, vt_row = coords
        first, tiles, lead, plain = span
        if PERSISTENT:
            mbarrier.wait(q_empty, (done & 1) ^ 1)
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem.index(0))
        tma.async_copy_global_to_shared(q_desc, [q_row + WG_M, q_col], q_bar, q_smem.index(1))
        for j in range(tiles):
            key = (first + j) * BLOCK_N
            _load(k_desc, k_bufs, k_ready, k_empty, ring0 + j, kv_row + key, kv_col)
            if v_bufs.dtype == gl.float8e4nv:  # V^T: the head's d rows, keys from key on
                _load(v_desc, v_bufs, v_ready, v_empty, ring0 + j, vt_row, key)
            else:
                _load(v_desc, v_bufs, v_ready, v_empty, ring0 + j, kv_row + key, kv_col)
        if PERSISTENT:  # (one work tile a program otherwise: the counts stay constants)
            ring0 = ring0 + tiles
            done = done + 1
    return ring0, done


@gluon.jit
def _producer(descs, smem, bars, problem, cu_seqlens_q, cu_seqlens_k, descale_ptr,  # noqa: PLR0913
              LEFT: gl.constexpr, RIGHT: gl.constexpr, HEAD_DIM: gl.constexpr, PERSISTENT: gl.constexpr):
    """One warp: each work tile's Q, K and V (``_produce``); a K or V stage is refilled once both consumers have
    released it (count 2)."""
    if PERSISTENT:
        ring0 = 0
        done = 0
        for i in range(_waves(problem)):
            ring0, done = _produce(_serpentine(i), ring0, done, descs, smem, bars, problem, cu_seqlens_q,
                                   cu_seqlens_k, descale_ptr, LEFT, RIGHT, HEAD_DIM, PERSISTENT)
    else:
        _produce(_grid_tile(), 0, 0, descs, smem, bars, problem, cu_seqlens_q, cu_seqlens_k, descale_ptr, LEFT,
                 RIGHT, HEAD_DIM, PERSISTENT)
