"""The ``@triton.jit`` helpers every kernel shares: tile loads, the score tile, the band, dropout, where a
sequence's queries and keys are, and the two walks over tiles (``walk_band``, ``walk_listed``).

Naming, in every kernel: pointer arguments are lowercase nouns (``q``, ``lse``, ``block_table``); ``b_*`` are
blocks held in registers, ``p_*`` pointer blocks, ``o_*`` offset vectors and ``m_*`` boolean masks;
``BLOCK_*`` and other constants are ``tl.constexpr``. An optional feature is an argument that may be None
(ALiBi slopes, a mask, the dropout seed, a window side, the softcap, varlen offsets, a block table): None is a
compile-time constant, so ``if x is not None`` costs nothing where the feature is off. Values travel between
helpers in named bundles (``bundles``: ``Scoring``, ``Band``, ``Dropout``, ``Operand``, ...), read by field name;
a bundle may hold a None derived in the kernel (the ALiBi slope, the mask pointer, the dropout seed), which a tuple
written as ``(a, b)`` in a kernel cannot. Under the compiler a helper cannot return None.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bundles import Origin, Scoring, Span

LOG2E = tl.constexpr(1.4426950408889634)  # scores are kept in log2 units, so exp is one MUFU.EX2: e^x = 2^(x log2 e)


@triton.jit
def fast_div(x, y):
    """x / y to 2 ulp (div.full.f32). IEEE division branches to a slow-path subroutine for extreme operands, and
    the call costs every kernel that divides a stack frame and registers saved around it."""
    return tl.math.fdiv(x, y)


@triton.jit
def tanh(x):
    # 1 - 2 / (e^{2x} + 1): saturates to +-1 for large |x| without overflow (inf -> 1, 0 -> -1). The constant is
    # on the right: Triton 3.9's interpreter turns constexpr * tensor into a constexpr that tl.math refuses.
    return 1.0 - fast_div(2.0, tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def load_rows(base, o_rows, m_rows, o_cols, stride_col, n_cols, UPCAST: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Rows at ``base + o_rows`` (0 where not ``m_rows``), columns ``o_cols`` (0 past ``n_cols``): a
    (len(rows), len(cols)) tile, or its transpose (as K^T and V^T are used in matmuls)."""
    if TRANSPOSE:
        b_x = tl.load(base + o_rows[None, :] + o_cols[:, None] * stride_col,
                      mask=m_rows[None, :] & (o_cols[:, None] < n_cols), other=0.0)
    else:
        b_x = tl.load(base + o_rows[:, None] + o_cols[None, :] * stride_col,
                      mask=m_rows[:, None] & (o_cols[None, :] < n_cols), other=0.0)
    return upcast(b_x, UPCAST)


@triton.jit
def upcast(b_x, UPCAST: tl.constexpr):
    """A 16-bit tile in fp32 with ``UPCAST`` (the interpreter's bf16 matmuls are wrong); FP8 tiles and bytes stay
    as they are, so the interpreter widens them and rounds P to FP8 as a GPU does."""
    if UPCAST and b_x.dtype.primitive_bitwidth == 16:
        b_x = b_x.to(tl.float32)
    return b_x


@triton.jit
def load_block_at(src, row, o_rows, m_rows, o_cols, UPCAST: tl.constexpr, TRANSPOSE: tl.constexpr = False):
    """A tile of ``src`` (an ``Operand``), or with ``TRANSPOSE`` its transpose (as K^T, Q^T and V^T enter matmuls),
    in fp32 with ``UPCAST``. Through ``src``'s TMA descriptor when it has one: one copy of the block ``row`` rows
    past ``src.at`` (``o_rows`` and ``m_rows`` unused). Else through pointers: rows at element offsets ``o_rows``
    from ``src.base`` (0 where not ``m_rows``), columns ``o_cols`` (0 from ``src.n_cols`` on)."""
    if src.desc is not None:
        b_x = src.desc.load([src.at.row + row, src.at.column])
        if TRANSPOSE:
            b_x = tl.trans(b_x)
        b_x = upcast(b_x, UPCAST)
    else:
        b_x = load_rows(src.base, o_rows, m_rows, o_cols, src.stride_col, src.n_cols, UPCAST, TRANSPOSE)
    return b_x


@triton.jit
def load_block(src, row, o_rows, n_rows, o_cols, UPCAST: tl.constexpr, TRANSPOSE: tl.constexpr = False):
    """``load_block_at`` of the sequence rows ``o_rows`` of ``src`` (indices from ``src.base``; rows from ``n_rows``
    on read 0). Their offsets are 64-bit (row x stride passes 2^31 on long sequences: 256k tokens x 64 heads x 128)
    and, with their mask, computed only where pointers read them."""
    o_offsets = None
    m_rows = None
    if src.desc is None:
        o_offsets = o_rows.to(tl.int64) * src.stride_row
        m_rows = o_rows < n_rows
    return load_block_at(src, row, o_offsets, m_rows, o_cols, UPCAST, TRANSPOSE)


@triton.jit
def tma_origin(at, b, h, row):
    """The ``Origin`` of row ``row`` of (batch ``b``, head ``h``) in a TMA descriptor laid out as
    ``flashattn.backends.triton.tma`` lays tensors out; ``at`` is the descriptor's ``*_tma`` kernel argument, the
    host's layout triple (``tma.kernel_args``), unpacked here by name. TMA coordinates are 32-bit: the host refuses a
    descriptor whose rows would not fit."""
    rows_per_batch, rows_per_head, columns_per_head = at
    return Origin((b * rows_per_batch + h * rows_per_head + row).to(tl.int32), (h * columns_per_head).to(tl.int32))


@triton.jit
def program_tile(n, BLOCK: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    """(first row of this program's tile, its batch x head index) on a flat grid of cdiv(n, BLOCK) tiles
    per batch x head, all on axis 0 (axes 1 and 2 stop at 65535 programs; axis 0 at 2^31 - 1). A head's tiles are
    neighbours, so the programs running together share its K/V in L2. ``LONGEST_FIRST`` walks a head's tiles from
    the last, which under a causal mask sees the most keys: the longest programs start first and the short ones
    fill the tail of the launch."""
    tiles = tl.cdiv(n, BLOCK)
    pid = tl.program_id(0)
    tile = pid % tiles
    if LONGEST_FIRST:
        tile = tiles - 1 - tile
    return tile * BLOCK, pid // tiles


@triton.jit
def dot(a, b):
    """a @ b accumulated in fp32; fp32 operands in IEEE precision (TF32 would cost fp32 inputs 3 digits)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def dot_acc(a, b, acc):
    """acc + a @ b, accumulated in place (one wgmma chain, no separate add); fp32 operands in IEEE precision."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def band_mask(i, j, nk, band):
    """True where key ``j`` exists (< nk) and is inside the ``Band`` of query ``i``. ``i`` and ``j`` broadcast to the
    tile: (rows, 1) and (1, cols), or the other way round for a transposed tile. Rows past the sequence need no
    mask: nothing reads their results."""
    m_keep = j < nk
    b_d = j - i - band.diagonal
    if band.window_right is not None:
        m_keep = m_keep & (b_d <= band.window_right)
    if band.window_left is not None:
        m_keep = m_keep & (b_d >= -band.window_left)
    return m_keep


@triton.jit
def score_tile(b_a, b_b, o_m, o_n, scoring, MASKED: tl.constexpr, PLAIN: tl.constexpr,
               TRANSPOSED: tl.constexpr = False):
    """Scores of q (BLOCK_M, D) against k^T (D, BLOCK_N), or with ``TRANSPOSED`` of k (BLOCK_N, D) against q^T
    (D, BLOCK_M) (S^T, as the dK/dV pass wants it), in log2 units (S log2 e), fp32, -inf where masked, as
    ``scoring`` (a ``Scoring``) says: scale, then softcap, then ALiBi, then the user mask (a uint8 mask is boolean,
    True = may attend, anything else is added), then, on ``MASKED`` tiles, the band and the end of the keys.
    ``o_m``/``o_n`` are the tile's query and key indices.

    ``PLAIN`` (no softcap, ALiBi or user mask, and a positive scale): the raw q.k is returned unscaled, so the
    caller folds the scale into the exponent's one FFMA: 2^(s * scale log2 e - m).

    Returns (scores, t): ``t`` = tanh(S / softcap), which the softcap's gradient needs (the scores themselves
    without softcap: a helper cannot return None under the compiler).
    """
    i = o_m[None, :] if TRANSPOSED else o_m[:, None]
    j = o_n[:, None] if TRANSPOSED else o_n[None, :]
    b_s = dot(b_a, b_b)
    b_t = b_s
    if not PLAIN:
        if scoring.softcap is not None:
            b_t = tanh(b_s * fast_div(scoring.scale, scoring.softcap))
            b_s = b_t * (scoring.softcap * LOG2E)
        else:
            b_s = b_s * (scoring.scale * LOG2E)
        if scoring.b_slope is not None:
            b_s = b_s - (scoring.b_slope * LOG2E) * tl.abs(i + scoring.band.diagonal - j).to(tl.float32)
        if scoring.p_mask is not None:
            m_inside = (i < scoring.nq) & (j < scoring.nk)
            p_tile = scoring.p_mask + i.to(tl.int64) * scoring.stride_mq + j.to(tl.int64) * scoring.stride_mk
            if scoring.p_mask.dtype.element_ty == tl.uint8:
                b_s = tl.where(tl.load(p_tile, mask=m_inside, other=0) != 0, b_s, float("-inf"))
            else:
                b_s = b_s + tl.load(p_tile, mask=m_inside, other=0.0).to(tl.float32) * LOG2E
    if MASKED:
        b_s = tl.where(band_mask(i, j, scoring.nk, scoring.band), b_s, float("-inf"))
    return b_s, b_t


@triton.jit
def dropped(b_x, m_keep, dropout_p):
    """``b_x`` where dropout keeps, scaled by 1 / (1 - p), else 0."""
    return tl.where(m_keep, b_x * fast_div(1.0, 1.0 - dropout_p), 0.0)


@triton.jit
def score_grads(b_p, b_dp, b_delta, b_t, softcap):
    """dS = P * (dP - delta), through the softcap's tanh when there is one (``b_t`` = tanh(S / softcap) from
    ``score_tile``): d(c tanh(s / c)) / ds = 1 - tanh^2. ``b_delta`` is broadcast to the tile already."""
    b_ds = b_p * (b_dp - b_delta)
    if softcap is not None:
        b_ds = b_ds * (1.0 - b_t * b_t)
    return b_ds


@triton.jit
def sequence(b, cu_seqlens_q, cu_seqlens_k, k_start, k_end, seqlen_q, seqlen_k, rows_q, rows_k):
    """(q start, q length, k start, k length) of batch entry ``b``.

    Queries: rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of a packed (varlen) q, else all ``seqlen_q`` rows of entry
    b. Keys: rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of packed (varlen) keys, or positions ``k_start[b]:k_end[b]``
    of a KV cache (k_start None: 0; k_end None: no cache), else all ``seqlen_k``. Starts are int64 (start * stride
    cannot overflow). Bounds are clamped to the rows that exist (``rows_q``; ``rows_k``: packed keys, or a cache
    entry's positions), lengths to ``seqlen_q``/``seqlen_k``: whatever values the checks let through
    (``flashattn.checks.on_device``), no program reads or writes outside its tensors."""
    q0 = 0
    nq = seqlen_q
    k0 = 0
    nk = seqlen_k
    if cu_seqlens_q is not None:
        q_lo = tl.minimum(tl.maximum(tl.load(cu_seqlens_q + b), 0), rows_q)
        q_hi = tl.minimum(tl.maximum(tl.load(cu_seqlens_q + b + 1), q_lo), rows_q)
        q0 = q_lo.to(tl.int64)
        nq = tl.minimum(q_hi - q_lo, seqlen_q)
    if cu_seqlens_k is not None:
        k_lo = tl.minimum(tl.maximum(tl.load(cu_seqlens_k + b), 0), rows_k)
        k_hi = tl.minimum(tl.maximum(tl.load(cu_seqlens_k + b + 1), k_lo), rows_k)
        k0 = k_lo.to(tl.int64)
        nk = tl.minimum(k_hi - k_lo, seqlen_k)
    if k_end is not None:
        k_hi = tl.minimum(tl.maximum(tl.load(k_end + b), 0), rows_k)
        k_lo = tl.minimum(tl.maximum(tl.load(k_start + b), 0), k_hi) if k_start is not None else 0 * k_hi
        k0 = k_lo.to(tl.int64)
        nk = tl.minimum(k_hi - k_lo, seqlen_k)
    return q0, nq, k0, nk


@triton.jit
def widened(b_x, dtype: tl.constexpr):
    """A K or V tile in ``dtype`` (q's 16-bit type): nothing for a 16-bit tile, Triton's conversion for an FP8 one,
    and for float8_e4m3fn bytes (uint8: NVIDIA GPUs before sm_89, where Triton has no e4m3fn conversion) exact
    integer code into fp32's bits: a normal value's exponent rebiased (7 -> 127), a subnormal one (m x 2^-9)
    converted and scaled, NaN (0x7f) kept, the sign put back (every e4m3fn value is exact in bf16 and fp16)."""
    if b_x.dtype == tl.uint8:
        x = b_x.to(tl.int32)
        mag = x & 0x7F
        small = (mag.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # m x 2^-9, exact
        bits = tl.where(mag >= 8, (mag << 20) + (120 << 23), small)
        bits = tl.where(mag == 0x7F, 0x7FC00000, bits) | ((x & 0x80) << 24)
        b_x = bits.to(tl.float32, bitcast=True)
    return b_x.to(dtype)


@triton.jit
def e4m3_rounded(b_x):
    """Non-negative fp32 ``b_x`` (at most 448) rounded to the nearest float8_e4m3fn value, ties to even, still in
    fp32: what a GPU's conversion gives. Triton 3.6's interpreter converts to e4m3 without carrying a mantissa
    that rounds up into the exponent (0.49 -> 0.25), so under it P is rounded here first and the conversion is
    exact. Normal values keep 4 significant bits (an integer add on the bits carries); below 2^-6 the subnormals
    are multiples of 2^-9 (rounded by adding and removing 2^23)."""
    bits = b_x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = bits.to(tl.float32, bitcast=True)
    small = ((b_x * 512.0 + 8388608.0) - 8388608.0) * (1.0 / 512.0)
    return tl.where(b_x < 0.015625, small, normal)


@triton.jit
def e4m3_quantized(b_x, b_inverse, UPCAST: tl.constexpr):
    """``b_x * b_inverse`` (1 / its descale: one multiply an element, not a division) in float8_e4m3fn, saturated to
    +-448, rounded to nearest even (the FP8 training mode's dO, whose descale is its amax / 448); under the
    interpreter rounded by ``e4m3_rounded`` first, as its conversion would not carry."""
    b_y = tl.clamp(b_x.to(tl.float32) * b_inverse, -448.0, 448.0)
    if UPCAST:
        b_y = tl.where(b_y < 0, -e4m3_rounded(-b_y), e4m3_rounded(b_y))
    return b_y.to(tl.float8e4nv)


# FP8 tensor-core matmuls take P from registers with 4 consecutive keys a thread (k = 32 a step); the first matmul
# leaves each thread pairs of keys 8 apart. Values whose keys are permuted within groups of 32 to match
# (``attend.interleaved_values``) let P stay in its registers: no shuffle between threads (FlashAttention-3's trick).
VALUE_GROUP = tl.constexpr(32)


@triton.jit
def fp8_operand_order(b_p):
    """P (M, N) with its keys in the order of values interleaved by ``attend.interleaved_values``: in every group of
    32, column 16h + 4c + 2g + l takes key 16h + 8g + 2c + l (h, g, l < 2, c < 4). The keys a thread holds as the
    first matmul's result are then the ones the FP8 P V matmul wants in its registers: the compiler moves no data
    between threads (sm_90, d=128: 40 shuffles, selects and byte permutes a trip fewer)."""
    rows: tl.constexpr = b_p.shape[0]
    keys: tl.constexpr = b_p.shape[1]
    b_p = tl.reshape(b_p, (rows, keys // VALUE_GROUP, 2, 2, 4, 2))
    return tl.reshape(tl.permute(b_p, (0, 1, 2, 4, 3, 5)), (rows, keys))


@triton.jit
def key_slots(o_n, keys):
    """Where logical keys ``o_n`` (cache positions k0 + o_n) of the forward's ``KeySlots`` live, as (page, row,
    exists): the memory offset of a key is ``page * stride_page + row * stride_row``.

    Dense (no block table): page 0 and row o_n, from a base that already points at row k0 of the batch entry.
    Paged: row ``p % page_size`` of page ``block_table[kb, p // page_size]``, from the cache's start.
    """
    m_keys = o_n < keys.nk
    if keys.block_table is not None:
        o_pos = (keys.k0 + o_n).to(tl.int32)  # cache positions fit; a 64-bit division would be a subroutine call
        o_page = tl.load(keys.block_table + keys.kb * keys.stride_bt + o_pos // keys.page_size, mask=m_keys,
                         other=0)
        o_page = tl.minimum(tl.maximum(o_page, 0), keys.entries - 1).to(tl.int64)  # a bad id reads a real page
        o_row = (o_pos % keys.page_size).to(tl.int64)  # row x stride stays 64-bit like every address term
    else:
        o_page = 0
        o_row = o_n.to(tl.int64)  # row x stride passes 2^31 on long sequences
    return o_page, o_row, m_keys


@triton.jit
def key_range(start_m, nk, band, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi) of keys any row of the query block may see, lo aligned to BLOCK_N: skips hidden key blocks."""
    lo = 0
    hi = nk
    if band.window_left is not None:
        lo = tl.maximum(start_m + band.diagonal - band.window_left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if band.window_right is not None:
        hi = tl.minimum(start_m + BLOCK_M - 1 + band.diagonal + band.window_right + 1, nk)
    return lo, hi


@triton.jit
def full_key_range(start_m, nk, band, span, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The ``Span`` within ``span``, aligned to BLOCK_N, of the key blocks that every row of the query block sees
    whole: no band, no end of the keys, so they need no mask (empty, lo = hi, when there are none)."""
    lo = 0
    hi = (nk // BLOCK_N) * BLOCK_N
    if band.window_right is not None:  # row start_m sees the fewest on the right: up to start_m + diagonal + right
        hi = tl.minimum(hi, (tl.maximum(start_m + band.diagonal + band.window_right + 1, 0) // BLOCK_N) * BLOCK_N)
    if band.window_left is not None:  # the last row sees the fewest on the left: from its diagonal - left
        lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + band.diagonal - band.window_left, 0), BLOCK_N) * BLOCK_N
    return clip(lo, hi, span)


@triton.jit
def full_query_range(start_n, nq, nk, band, span, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The ``Span`` within ``span``, aligned to BLOCK_M, of the whole query blocks (a partial last one reads its
    statistics masked) that see the whole key block [start_n, start_n + BLOCK_N): no mask needed (none when the key
    block runs past the keys' end; empty when there are none)."""
    lo = 0
    hi = tl.where(start_n + BLOCK_N <= nk, (nq // BLOCK_M) * BLOCK_M, 0)
    if band.window_right is not None:  # query i sees key j iff i >= j - diagonal - right: the last key is the bound
        lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - band.diagonal - band.window_right, 0), BLOCK_M) * BLOCK_M
    if band.window_left is not None:  # and i <= j - diagonal + left: the first key is the bound
        hi = tl.minimum(hi, (tl.maximum(start_n - band.diagonal + band.window_left + 1, 0) // BLOCK_M) * BLOCK_M)
    return clip(lo, hi, span)


@triton.jit
def clip(lo, hi, span):
    """[lo, hi) clipped to ``span``: a ``Span`` inside it, empty (lo = hi) when they do not meet."""
    lo = tl.minimum(tl.maximum(lo, span.lo), span.hi)
    return Span(lo, tl.maximum(tl.minimum(hi, span.hi), lo))


@triton.jit
def query_range(start_n, nq, band, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi) of queries that may see any key of the key block, lo aligned to BLOCK_M."""
    lo = 0
    hi = nq
    if band.window_right is not None:
        lo = tl.maximum(start_n - band.diagonal - band.window_right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if band.window_left is not None:
        hi = tl.minimum(start_n + BLOCK_N - 1 - band.diagonal + band.window_left + 1, nq)
    return lo, hi


@triton.jit
def walk_band(visit: tl.constexpr, carry, args, span, full, scoring, MASK_START: tl.constexpr, BLOCK: tl.constexpr,
              UPCAST: tl.constexpr, PLAIN: tl.constexpr, UNMASKED_FIRST: tl.constexpr = False):
    """``visit`` over the tiles of ``span`` cut by the band: [span.lo, full.lo) with the mask, ``full`` (the whole
    tiles, as ``full_key_range``/``full_query_range`` clip them to span) without any mask code, [full.hi, span.hi)
    with the mask. ``MASK_START`` False: no tile before ``full`` needs the mask (the band is open on that side), so
    the unmasked walk starts at span.lo and the first masked one is not compiled. ``UNMASKED_FIRST``: the unmasked
    walk runs before the first masked one (any order is exact; which compiles leaner depends on the kernel: dK/dV's
    unmasked loop after a masked one copied its wgmma descriptors every trip on sm_90, while the forward and dQ
    spill in some calls with that order). ``visit`` as ``walk_listed``'s."""
    lo = full.lo
    if MASK_START and not UNMASKED_FIRST:
        carry = visit(carry, args, Span(span.lo, full.lo), scoring, BLOCK, UPCAST, True, PLAIN)
    if not MASK_START:
        lo = span.lo
    carry = visit(carry, args, Span(lo, full.hi), scoring, BLOCK, UPCAST, False, PLAIN)
    if MASK_START and UNMASKED_FIRST:
        carry = visit(carry, args, Span(span.lo, full.lo), scoring, BLOCK, UPCAST, True, PLAIN)
    return visit(carry, args, Span(full.hi, span.hi), scoring, BLOCK, UPCAST, True, PLAIN)


@triton.jit
def sparse_lists(blocks, b, h, x):
    """The ``BlockLists`` of row-block ``x`` of (batch b, head h): (full count, pointer to the full blocks' indices,
    partial count, pointer to the partial blocks' indices). A row-block is a query block for the forward and dQ
    (listing key blocks) and a key block for dK/dV (listing query blocks)."""
    at_count = b * blocks.stride_count_b + h * blocks.stride_count_h + x * blocks.stride_count_x
    at_index = b * blocks.stride_index_b + h * blocks.stride_index_h + x * blocks.stride_index_x
    return (tl.load(blocks.full_counts + at_count), blocks.full_index + at_index,
            tl.load(blocks.partial_counts + at_count), blocks.partial_index + at_index)


@triton.jit
def partial_tile(blocks, b, h, qi, kj):
    """The element mask of partial block (qi, kj) of (b, h) as ``score_tile`` reads a user mask: a uint8 pointer
    that ``+ i * kv_block + j`` takes to the element of query i, key j (strides (kv_block, 1))."""
    tile = tl.load(blocks.partial_ids + b * blocks.stride_id_b + h * blocks.stride_id_h + qi * blocks.stride_id_q
                   + kj * blocks.stride_id_k).to(tl.int64)
    return (blocks.partial_masks + (tile * blocks.q_block - qi * blocks.q_block) * blocks.kv_block
            - kj * blocks.kv_block)


@triton.jit
def listed_span(p_list, t, size, span):
    """Entry t of a block list: (the block's index, the ``Span`` of rows or keys it covers, clipped to ``span``)."""
    x = tl.load(p_list + t)
    return x, Span(tl.maximum(x * size, span.lo), tl.minimum(x * size + size, span.hi))


@triton.jit
def walk_listed(visit: tl.constexpr, carry, args, span, x, b, h, blocks, scoring, BY_KEYS: tl.constexpr,
                BLOCK: tl.constexpr, UPCAST: tl.constexpr, PLAIN: tl.constexpr):
    """``visit`` over the blocks the ``BlockLists`` ``blocks`` list for row-block ``x`` of (batch b, head h), each
    clipped to ``span`` (the band) and masked: full blocks with no element mask, partial ones with theirs (and general
    scoring); empty blocks are never visited. ``BY_KEYS``: x is a key block listing query blocks (dK/dV), else a query
    block listing key blocks. ``visit(carry, args, span, scoring, BLOCK, UPCAST, MASKED, PLAIN)`` walks the tiles of
    one span (``args`` its own bundle, ``scoring`` a ``Scoring``) and returns the new carry."""
    n_full, p_full, n_part, p_part = sparse_lists(blocks, b, h, x)
    size = blocks.q_block if BY_KEYS else blocks.kv_block
    whole = Scoring(scoring.nq, scoring.nk, scoring.band, scoring.scale, scoring.softcap, scoring.b_slope, None,
                    scoring.stride_mq, scoring.stride_mk)
    for t in range(0, n_full):
        _, piece = listed_span(p_full, t, size, span)
        carry = visit(carry, args, piece, whole, BLOCK, UPCAST, True, PLAIN)
    for t in range(0, n_part):
        y, piece = listed_span(p_part, t, size, span)
        p_mask = partial_tile(blocks, b, h, y, x) if BY_KEYS else partial_tile(blocks, b, h, x, y)
        tile = Scoring(scoring.nq, scoring.nk, scoring.band, scoring.scale, scoring.softcap, scoring.b_slope, p_mask,
                       blocks.kv_block, 1)
        carry = visit(carry, args, piece, tile, BLOCK, UPCAST, True, False)
    return carry
