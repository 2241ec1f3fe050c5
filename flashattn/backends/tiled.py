"""The ``torch`` path: tiled FlashAttention-2 written with torch ops, every feature on every device torch runs on
(CPU calls where the C++ kernel cannot be built, CUDA float64, head dims past the Triton kernels', mask gradients
on a GPU, other devices).

Never materialises the N x N score matrix: the query rows are cut into blocks (outer loop, FlashAttention-2),
key/value rows into blocks (inner loop), and each score tile is reduced at once with the online softmax. The
backward recomputes the tiles from the saved log-sum-exp. fp16/bf16 inputs are computed in float32, float64
stays float64 (so ``torch.autograd.gradcheck`` holds).

Layout: q (B, Nq, H, D), k (B, Nk, Hk, D), v (B, Nk, Hk, Dv), H % Hk == 0 (GQA/MQA). Internally heads are
viewed as (Hk, G) with G = H // Hk query heads per key/value head, so K and V are never copied per query head.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .masking import Band, sum_to_shape
from .merge import merge_states, with_sink
from .philox import dropout_keep
from .request import Request
from .spec import AttentionSpec, Saved, accumulation_dtype, output_dtype

NAME = "torch"

# A score tile holds about this many elements across batch and heads (2 MB in float32, about an L2 cache;
# measured best of 2^17..2^21 x 256..1024 on 2 cores): large enough that
# Python's loop overhead vanishes behind the matmuls, small enough that memory stays O(N d), never O(N^2).
TILE_ELEMENTS = 1 << 19
MAX_BLOCK_K = 256
# At least this many query rows per block, so a huge batch x heads costs tile memory, not a Python loop per row.
MIN_BLOCK_Q = 64


def _uninitialized(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocation of every output this backend must fill completely (tests poison it with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


def _blocks(n: int, size: int) -> range:
    return range(0, n, size)


def serves(request: Request) -> str | None:
    """Every call: every feature, every float dtype, every device torch runs on."""
    return None


class _TiledCall:
    """One dense attention call cut into tiles: builds the score tile S_ij (scale, softcap, masks, ALiBi) and its
    dropout mask, the pieces shared by the forward, the backward and the probabilities."""

    def __init__(self, q, k, v, spec: AttentionSpec, *, dropout_origin: tuple[int, int, int] | None = None,
                 band: Band | None = None):
        """``dropout_origin`` = (first batch index, Nq, Nk) of the counter layout ((b * H + h) * Nq + i) * Nk + j;
        by default this call's own (0, nq, nk). A varlen sequence b uses (b, max_seqlen_q, max_seqlen_k).
        ``band`` replaces ``spec.band(nq, nk)`` when k is a slice of a longer key sequence (a split)."""
        b, nq, h, d = q.shape
        nk, hk = k.shape[1], k.shape[2]
        g = h // hk
        self.shape = (b, nq, nk, h, hk, g)
        self.spec = spec
        self.acc = accumulation_dtype(q.dtype)
        self.q = q.unflatten(2, (hk, g)).permute(0, 2, 3, 1, 4)  # (B, Hk, G, Nq, D), a view
        self.k = k.permute(0, 2, 1, 3)  # (B, Hk, Nk, D)
        self.v = v.permute(0, 2, 1, 3)  # (B, Hk, Nk, Dv)
        self.band = spec.band(nq, nk) if band is None else band
        alibi, mask = spec.alibi_slopes, spec.attn_mask
        self.alibi = None if alibi is None else alibi.to(self.acc).view(alibi.shape[0], hk, g, 1, 1)
        self.sink = None if spec.sink is None else spec.sink.to(self.acc).view(1, hk, g, 1)
        self.mask = None if mask is None else self._heads5(mask)
        # FP8 inputs: each tile is widened, then scaled per (batch, key/value head), never the whole tensor.
        scales = spec.descale
        self.q_scale = None if scales is None else scales.q.view(b, hk, 1, 1, 1).to(self.acc)
        self.kv_scales = None if scales is None else (scales.k.view(b, hk, 1, 1).to(self.acc),
                                                      scales.v.view(b, hk, 1, 1).to(self.acc))
        self.block_k = max(1, min(nk, MAX_BLOCK_K))
        self.block_q = max(1, min(nq, max(MIN_BLOCK_Q, TILE_ELEMENTS // max(1, b * h * self.block_k))))
        self.blocks = spec.block_sparse
        if self.blocks is not None:  # the tiles are the block mask's; which are visited is read once, on the host
            self.block_q, self.block_k = self.blocks.q_block, self.blocks.kv_block
            kind = self.blocks.tile_kind
            self.tile_visited = (kind != 0).flatten(0, 1).any(0).cpu()
            self.tile_full = (kind == 2).flatten(0, 1).all(0).cpu()
        if spec.dropout_p > 0:
            self.seed = int(spec.seed.item())
            b0, self.counter_rows, self.counter_cols = dropout_origin or (0, nq, nk)
            idx = torch.arange(b0 * h, (b0 + b) * h, device=q.device, dtype=torch.int64).view(b, hk, g, 1, 1)
            self.dropout_base = idx * self.counter_rows  # the counter row of each head's query 0

    def _heads5(self, t: torch.Tensor) -> torch.Tensor:
        """(B|1, H|1, Lq, Lk) -> (B|1, Hk|1, G|1, Lq, Lk) so it broadcasts against a score tile."""
        _, _, _, _, hk, g = self.shape
        return t.unsqueeze(2) if t.shape[1] == 1 else t.unflatten(1, (hk, g))

    def key_blocks(self, r0: int, r1: int):
        """Key blocks [c0, c1) that rows [r0, r1) can see; blocks fully outside the band are skipped."""
        lo, hi = self.band.key_range(r0, r1, self.shape[2])
        start = (lo // self.block_k) * self.block_k
        for c0 in range(start, hi, self.block_k):
            if self.blocks is None or self.tile_visited[r0 // self.block_q, c0 // self.block_k]:
                yield c0, min(c0 + self.block_k, self.shape[2])

    def block_tile(self, r0, r1, c0, c1) -> torch.Tensor | None:
        """The block mask's element mask of tile [r0, r1) x [c0, c1), (Bm, Hk|1, G|1, rows, cols) bool, or None
        when the tile is full for every batch entry and head."""
        qi, kj = r0 // self.block_q, c0 // self.block_k
        if self.tile_full[qi, kj]:
            return None
        blocks = self.blocks
        kind = blocks.tile_kind[:, :, qi, kj, None, None]
        tile = (kind == 2).expand(*kind.shape[:2], r1 - r0, c1 - c0)
        if blocks.partial_masks.shape[0] > 0:
            ids = blocks.partial_id[:, :, qi, kj].clamp(min=0).long()
            tile = torch.where(kind == 1, blocks.partial_masks[ids][..., : r1 - r0, : c1 - c0], tile)
        return self._heads5(tile)

    def q_block(self, r0: int, r1: int) -> torch.Tensor:
        """Q_i * scale in the accumulation dtype: scaling the (rows x D) block, not the (rows x cols) tile."""
        qb = self.q[:, :, :, r0:r1].to(self.acc) * self.spec.scale
        return (qb if self.q_scale is None else qb * self.q_scale).contiguous()

    def kv_block(self, c0: int, c1: int) -> tuple[torch.Tensor, torch.Tensor]:
        kb, vb = self.k[:, :, c0:c1].to(self.acc), self.v[:, :, c0:c1].to(self.acc)
        if self.kv_scales is not None:
            kb, vb = kb * self.kv_scales[0], vb * self.kv_scales[1]
        return kb.contiguous(), vb.contiguous()

    def scores(self, qb, kb, r0, r1, c0, c1, need_tanh=False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """S_ij for rows [r0, r1) x columns [c0, c1) from the scaled ``qb``, shape (B, Hk, G, r1-r0, c1-c0),
        masked entries -inf. A fresh tensor: callers may update it in place.

        With ``need_tanh`` also returns tanh(raw / softcap), which the backward needs for the chain rule.
        """
        spec = self.spec
        s = torch.einsum("bhgqd,bhkd->bhgqk", qb, kb)
        tanh = None
        # Elementwise passes over the tile are this path's cost: update it in place, allocate nothing.
        if spec.softcap > 0 and need_tanh:
            tanh = torch.tanh(s.div_(spec.softcap))
            s = torch.mul(tanh, spec.softcap)
        elif spec.softcap > 0:
            s.div_(spec.softcap).tanh_().mul_(spec.softcap)
        band_mask = not self.band.tile_is_full(r0, r1, c0, c1)
        if self.alibi is not None or band_mask:
            rows = torch.arange(r0, r1, device=s.device)
            cols = torch.arange(c0, c1, device=s.device)
            if self.alibi is not None:
                dist = (rows[:, None] + self.band.diagonal - cols[None, :]).abs().to(self.acc)
                s.sub_(self.alibi * dist)
            if band_mask:
                s.masked_fill_(~self.band.visible(rows, cols), -math.inf)
        if self.blocks is not None:
            m = self.block_tile(r0, r1, c0, c1)
            if m is not None:
                s.masked_fill_(~m, -math.inf)
        if self.mask is not None:
            m = self.mask_tile(self.mask, r0, r1, c0, c1)
            if m.dtype == torch.bool:
                s.masked_fill_(~m, -math.inf)
            else:
                s.add_(m)
        return s, tanh

    def mask_tile(self, m: torch.Tensor, r0, r1, c0, c1) -> torch.Tensor:
        rows = slice(r0, r1) if m.shape[3] > 1 else slice(None)
        cols = slice(c0, c1) if m.shape[4] > 1 else slice(None)
        return m[:, :, :, rows, cols]

    def dropout_scale(self, r0, r1, c0, c1) -> torch.Tensor | None:
        """Keep-mask divided by (1 - p) for the tile, regenerated from the element indices; None if no dropout."""
        spec = self.spec
        if spec.dropout_p <= 0:
            return None
        rows = torch.arange(r0, r1, device=self.dropout_base.device)
        cols = torch.arange(c0, c1, device=self.dropout_base.device)
        keep = dropout_keep(self.seed, self.dropout_base + rows[:, None], cols[None, :], self.counter_cols,
                            spec.dropout_p)
        return keep.to(self.acc) / (1.0 - spec.dropout_p)


def _nonzero_or(x: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(x == 0, torch.full_like(x, fill), x)


def forward(q, k, v, spec: AttentionSpec, *, return_probs: bool = False):
    """Returns out (B, Nq, H, Dv) in q's dtype, lse (B, H, Nq) (float32, or float64 for float64 inputs) and,
    if ``return_probs``, the probabilities (B, H, Nq, Nk) with dropped entries negated (else an empty tensor).

    When ``spec.packed``, q is (total_q, H, D) and k/v (total_k, Hk, D), packed as ``spec.varlen`` says: out is
    (total_q, H, Dv), lse (H, total_q), probs (B, H, max_seqlen_q, max_seqlen_k). Each sequence runs on views.
    With ``spec.cache``, keys come from a KV cache (``_forward_cache``).

    Example::

        >>> q = k = v = torch.randn(1, 5, 2, 8)
        >>> out, lse, _ = forward(q, k, v, AttentionSpec(scale=8 ** -0.5))
        >>> out.shape, lse.shape
        (torch.Size([1, 5, 2, 8]), torch.Size([1, 2, 5]))
    """
    out, lse = _results(q, v, spec)
    if spec.cache is not None:
        _forward_cache(q, k, v, spec, out=out, lse=lse)
        return out, lse, q.new_empty(0)
    h = q.shape[-2]
    if not spec.packed:
        b, nq, nk = q.shape[0], q.shape[1], k.shape[1]
        probs = torch.zeros(b, h, nq, nk, dtype=q.dtype, device=q.device) if return_probs else None
        _forward_into(_TiledCall(q, k, v, spec), out, lse, probs)
        return out, lse, q.new_empty(0) if probs is None else probs
    varlen = spec.varlen
    probs = None
    if return_probs:
        probs = torch.zeros(varlen.batch, h, varlen.max_seqlen_q, varlen.max_seqlen_k, dtype=q.dtype,
                            device=q.device)
    for i, (sq, eq, sk, ek) in enumerate(varlen.bounds()):
        p = _TiledCall(q[None, sq:eq], k[None, sk:ek], v[None, sk:ek], _sequence_spec(spec, i),
                       dropout_origin=(i, varlen.max_seqlen_q, varlen.max_seqlen_k))
        _forward_into(p, out[None, sq:eq], lse[None, :, sq:eq],
                      None if probs is None else probs[i : i + 1, :, : eq - sq, : ek - sk])
    return out, lse, q.new_empty(0) if probs is None else probs


def _results(q, v, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised out (q's layout with v's head dim, q's dtype; bfloat16 for FP8 q) and lse
    (``spec.lse_shape``, in the accumulation dtype): every element is written by the forward (tests poison them
    with NaN)."""
    out = _uninitialized(*q.shape[:-1], v.shape[-1], dtype=output_dtype(q.dtype), device=q.device)
    lse = _uninitialized(*spec.lse_shape(q.shape), dtype=accumulation_dtype(q.dtype), device=q.device)
    return out, lse


def _sequence_spec(spec: AttentionSpec, i: int) -> AttentionSpec:
    """The options of batch entry i run on its own (a varlen sequence or a cache row): a dense call with that
    entry's ALiBi slopes (user masks do not go with packed or cached keys)."""
    alibi = spec.alibi_slopes
    row = alibi if alibi is None or alibi.shape[0] == 1 else alibi[i : i + 1]
    descale = None if spec.descale is None else spec.descale.rows(i)
    return dataclasses.replace(spec, alibi_slopes=row, varlen=None, cache=None, descale=descale)


def _forward_cache(q, k_cache, v_cache, spec: AttentionSpec, *, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Attention of q against the keys of a KV cache, forward only, into ``out`` and ``lse`` (``_results``).

    q is (B, Nq, H, D), or packed (total_q, H, D) when ``spec.packed`` (its key offsets unused). ``spec.cache``
    says where each batch entry's keys are in ``k_cache``/``v_cache``, dense (B_cache, N_cache, Hk, D) or paged
    (num_pages, page_size, Hk, D). Each entry runs on a view of its cache rows (a gather of its pages when paged).
    ``cache.num_splits`` > 1 cuts each entry's keys into that many chunks whose results are merged by
    log-sum-exp, as the GPU's split-KV path does (0 means 1 here: splitting only helps fill a GPU).

    Example::

        >>> from flashattn.backends.spec import KeyCache
        >>> q, cache = torch.randn(2, 1, 4, 16), torch.randn(2, 10, 2, 16)
        >>> spec = AttentionSpec(scale=0.25, cache=KeyCache(torch.tensor([0, 0]), torch.tensor([3, 10]), 10))
        >>> out, lse = _results(q, cache, spec)
        >>> _forward_cache(q, cache, cache, spec, out=out, lse=lse)
        >>> out.shape, lse.shape
        (torch.Size([2, 1, 4, 16]), torch.Size([2, 4, 1]))
    """
    cache = spec.cache
    if spec.packed:
        rows = [(out[None, sq:eq], lse[None, :, sq:eq], q[None, sq:eq]) for sq, eq, _, _ in spec.varlen.bounds()]
    else:
        rows = [(out[i : i + 1], lse[i : i + 1], q[i : i + 1]) for i in range(q.shape[0])]
    batch_idx = None if cache.batch_idx is None else cache.batch_idx.tolist()
    for i, ((out_i, lse_i, q_i), (start, end)) in enumerate(zip(rows, cache.bounds(), strict=True)):
        if cache.block_table is not None:
            pos = torch.arange(start, end, device=q.device)
            pages, slots = cache.block_table[i, pos // k_cache.shape[1]].long(), pos % k_cache.shape[1]
            k_i, v_i = k_cache[pages, slots][None], v_cache[pages, slots][None]
        else:
            row = i if batch_idx is None else batch_idx[i]
            k_i, v_i = k_cache[row : row + 1, start:end], v_cache[row : row + 1, start:end]
        parts = _split_forward(q_i, k_i, v_i, _sequence_spec(spec, i), splits=max(1, cache.num_splits))
        out_i.copy_(parts[0])
        lse_i.copy_(parts[1])


def _split_forward(q, k, v, spec: AttentionSpec, *, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a dense call over the keys cut into ``splits`` chunks, merged by log-sum-exp (split-KV)."""
    nk = k.shape[1]
    chunk = max(1, -(-nk // splits))
    merged = None
    whole = spec.band(q.shape[1], nk)
    sink, spec = spec.sink, dataclasses.replace(spec, sink=None)  # joins once, after the chunks merge
    for c0, c1 in [(c0, min(c0 + chunk, nk)) for c0 in range(0, nk, chunk)] or [(0, 0)]:
        part_out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=accumulation_dtype(q.dtype), device=q.device)
        part_lse = torch.empty(spec.lse_shape(q.shape), dtype=part_out.dtype, device=q.device)
        # The chunk's keys are columns c0.. of the whole band: move the diagonal so masks and ALiBi stay put.
        band = dataclasses.replace(whole, diagonal=whole.diagonal - c0)
        _forward_into(_TiledCall(q, k[:, c0:c1], v[:, c0:c1], spec, band=band), part_out, part_lse, None)
        merged = (part_out, part_lse) if merged is None else merge_states(*merged, part_out, part_lse)
    return merged if sink is None else with_sink(*merged, sink)


def _forward_into(p: _TiledCall, out: torch.Tensor, lse: torch.Tensor, probs: torch.Tensor | None) -> None:
    """Write out (B, Nq, H, Dv), lse (B, H, Nq) and, if given, probs (B, H, Nq, Nk) of the call ``p``."""
    b, nq, nk, h, hk, g = p.shape
    dv = out.shape[-1]
    out5 = out.unflatten(2, (hk, g)).permute(0, 2, 3, 1, 4)
    lse5 = lse.unflatten(1, (hk, g))
    for r0 in _blocks(nq, p.block_q):
        r1 = min(r0 + p.block_q, nq)
        qb = p.q_block(r0, r1)
        row_max = torch.full(qb.shape[:-1], -math.inf, dtype=p.acc, device=out.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros(*qb.shape[:-1], dv, dtype=p.acc, device=out.device)
        for c0, c1 in p.key_blocks(r0, r1):
            kb, vb = p.kv_block(c0, c1)
            e, _ = p.scores(qb, kb, r0, r1, c0, c1)
            new_max = torch.maximum(row_max, e.amax(-1))
            # A row that has seen only masked keys keeps max -inf; subtract 0 there so exp gives 0, not NaN.
            safe_max = torch.where(new_max == -math.inf, 0.0, new_max)
            e.sub_(safe_max[..., None]).exp_()
            rescale = torch.exp(row_max - safe_max)
            # The denominator sums the undropped weights: dropout acts on normalised probabilities.
            row_sum = row_sum * rescale + e.sum(-1)
            keep = p.dropout_scale(r0, r1, c0, c1)
            if keep is not None:
                e.mul_(keep)
            acc = acc * rescale[..., None] + torch.einsum("bhgqk,bhkd->bhgqd", e, vb)
            row_max = new_max
        if p.sink is not None:  # one more score in the denominator, with no value: only l and the scale move
            new_max = torch.maximum(row_max, p.sink)
            safe_max = torch.where(new_max == -math.inf, 0.0, new_max)
            rescale = torch.exp(row_max - safe_max)
            row_sum = row_sum * rescale + torch.exp(p.sink - safe_max)
            acc = acc * rescale[..., None]
            row_max = new_max
        # Deferred normalisation (FlashAttention-2): one division per row, at the end; empty rows give 0.
        out5[:, :, :, r0:r1] = (acc / _nonzero_or(row_sum, 1.0)[..., None]).to(out.dtype)
        lse5[:, :, :, r0:r1] = torch.where(row_sum == 0, -math.inf, row_max + torch.log(row_sum))
    if probs is not None:
        _probabilities_into(p, lse, probs)


def _probabilities_into(p: _TiledCall, lse: torch.Tensor, probs: torch.Tensor) -> None:
    """softmax(S) recomputed from lse, dropped entries negated: the S_dmask of ``return_attn_probs``.
    ``probs`` (B, H, Nq, Nk) is zero-filled; tiles hidden by the mask are not visited."""
    b, nq, nk, h, hk, g = p.shape
    probs5 = probs.unflatten(1, (hk, g))
    lse5 = _lse_for_recompute(lse.unflatten(1, (hk, g)))
    for r0 in _blocks(nq, p.block_q):
        r1 = min(r0 + p.block_q, nq)
        qb = p.q_block(r0, r1)
        for c0, c1 in p.key_blocks(r0, r1):
            kb, _ = p.kv_block(c0, c1)
            pt, _ = p.scores(qb, kb, r0, r1, c0, c1)
            pt.sub_(lse5[:, :, :, r0:r1, None]).exp_()
            keep = p.dropout_scale(r0, r1, c0, c1)
            if keep is not None:
                pt = torch.where(keep > 0, pt, -pt)
            probs5[:, :, :, r0:r1, c0:c1] = pt.to(probs.dtype)


def _lse_for_recompute(lse: torch.Tensor) -> torch.Tensor:
    # A row that sees no key has lse = -inf; +inf makes exp(S - lse) = 0 there instead of NaN.
    return torch.where(lse == -math.inf, math.inf, lse)


def fp8_backward(q, k, v, spec: AttentionSpec) -> bool:
    """Whether the backward takes the FP8 training mode's e4m3 q, k, v with ``spec.descale`` (FP8 matmuls): no,
    the op hands this path the 16-bit values they stand for (``quantize.read_back``)."""
    return False


def backward(dout, dlse, saved: Saved, spec: AttentionSpec, *, mask_grad: bool = False):
    """Gradients (dq, dk, dv, dmask) by recomputation from the saved lse (FlashAttention-2 backward).

    ``dlse`` (or None) is the gradient flowing into the returned log-sum-exp: d lse_i / d S_ij = P_ij, so it
    folds into the preprocessing term, delta_i = rowsum(dO_i * O_i) - dlse_i. ``dmask`` is the gradient of the
    additive ``spec.attn_mask`` (its own shape) when ``mask_grad``, else None. Packed input as in ``forward``.
    """
    q, k, v, out, lse = saved
    if spec.cache is not None:  # the op differentiates a cached call as the varlen call of its gathered keys
        raise NotImplementedError("the torch path has no backward through keys in a KV cache")
    grads = tuple(_uninitialized(*t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if not spec.packed:
        p = _TiledCall(q, k, v, spec)
        mask = spec.attn_mask
        dmask = torch.zeros(p.mask.shape, dtype=p.acc, device=q.device) if mask_grad else None
        _backward_into(p, dout=dout, dlse=dlse, out=out, lse=lse, grads=grads, dmask=dmask)
        return *grads, None if dmask is None else dmask.reshape(mask.shape).to(mask.dtype)
    dq, dk, dv = grads
    varlen = spec.varlen
    for i, (sq, eq, sk, ek) in enumerate(varlen.bounds()):
        p = _TiledCall(q[None, sq:eq], k[None, sk:ek], v[None, sk:ek], _sequence_spec(spec, i),
                       dropout_origin=(i, varlen.max_seqlen_q, varlen.max_seqlen_k))
        _backward_into(p, dout=dout[None, sq:eq], dlse=None if dlse is None else dlse[None, :, sq:eq],
                       out=out[None, sq:eq], lse=lse[None, :, sq:eq],
                       grads=(dq[None, sq:eq], dk[None, sk:ek], dv[None, sk:ek]), dmask=None)
    return dq, dk, dv, None


def _backward_into(p: _TiledCall, *, dout, dlse, out, lse, grads, dmask) -> None:
    """Write grads = (dq (B, Nq, H, D), dk, dv (B, Nk, Hk, D)) and, if given, accumulate the mask gradient in
    dmask."""
    dq, dk, dv = grads
    b, nq, nk, h, hk, g = p.shape
    acc_t = p.acc
    dk_acc = torch.zeros(b, hk, nk, dk.shape[-1], dtype=acc_t, device=dq.device)
    dv_acc = torch.zeros(b, hk, nk, dv.shape[-1], dtype=acc_t, device=dq.device)
    dq5 = dq.unflatten(2, (hk, g)).permute(0, 2, 3, 1, 4)
    do5 = dout.unflatten(2, (hk, g)).permute(0, 2, 3, 1, 4)
    o5 = out.unflatten(2, (hk, g)).permute(0, 2, 3, 1, 4)
    lse5 = _lse_for_recompute(lse.unflatten(1, (hk, g)))
    dlse5 = None if dlse is None else dlse.unflatten(1, (hk, g))
    for r0 in _blocks(nq, p.block_q):
        r1 = min(r0 + p.block_q, nq)
        qb = p.q_block(r0, r1)
        dob = do5[:, :, :, r0:r1].to(acc_t)
        delta = (dob * o5[:, :, :, r0:r1].to(acc_t)).sum(-1)
        if dlse5 is not None:
            delta = delta - dlse5[:, :, :, r0:r1].to(acc_t)
        lse_b = lse5[:, :, :, r0:r1, None]
        dqb = torch.zeros_like(qb)
        for c0, c1 in p.key_blocks(r0, r1):
            kb, vb = p.kv_block(c0, c1)
            pt, tanh = p.scores(qb, kb, r0, r1, c0, c1, need_tanh=True)
            pt.sub_(lse_b).exp_()
            dp = torch.einsum("bhgqd,bhkd->bhgqk", dob, vb)
            keep = p.dropout_scale(r0, r1, c0, c1)
            pv = pt if keep is None else pt * keep
            if keep is not None:
                dp.mul_(keep)
            dv_acc[:, :, c0:c1] += torch.einsum("bhgqk,bhgqd->bhkd", pv, dob)
            ds = dp.sub_(delta[..., None]).mul_(pt)
            if dmask is not None:
                tile = p.mask_tile(dmask, r0, r1, c0, c1)
                tile += sum_to_shape(ds, tile.shape)
            if tanh is not None:
                ds.mul_(1 - tanh * tanh)
            dqb += torch.einsum("bhgqk,bhkd->bhgqd", ds, kb)
            # qb carries the scale already, so dK = dS^T (Q * scale) needs no further factor.
            dk_acc[:, :, c0:c1] += torch.einsum("bhgqk,bhgqd->bhkd", ds, qb)
        dq5[:, :, :, r0:r1] = (dqb * p.spec.scale).to(dq.dtype)
    dk.copy_(dk_acc.permute(0, 2, 1, 3))
    dv.copy_(dv_acc.permute(0, 2, 1, 3))
