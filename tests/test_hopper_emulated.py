"""The Hopper tier's kernels emulated on CPU tensors (``tools/gluon/emulate.py``) in what they added beyond
``test_hopper_models.py``'s cases: head dims between 64, 128 and 256 on padded tiles, the persistent forward's walk
over work tiles, and FlashAttention-3's FP8 forward, each against float64 by the suite's rules."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_close, attention_ref, max_err
from test_hopper_models import BANDS_AND_CAPS, _check, _emulated, reference_grads
from triton_versions import needs_triton, recorded_on_oldest

BF16 = torch.bfloat16
on_oldest = recorded_on_oldest("the Hopper tier's Gluon kernel (Gluon's API changes between releases)")


@needs_triton
@on_oldest
@pytest.mark.parametrize("d", [40, 96, 192])
def test_head_dims_between_run_on_padded_tiles_emulated(d):
    """A head dim below 64, 128 or 256 runs on that tile (``forward.tile_dim``), whose columns past the head read the
    next head's: Q's (forward) and K's and V's (backward) are zeroed, and O's, dK's, dV's and dQ's never stored. Out,
    lse and the three gradients against float64 by the suite's rules, grouped heads (so that every operand's padding
    reads a neighbour), causal and a window with a softcap, a dense batch of two and packed sequences."""
    import itertools

    from flashattn.backends.triton.hopper.forward import LAUNCHED, tile_dim
    from tools.gluon.emulate import emulate_backward

    torch.manual_seed(d)
    lengths = [(130, 200), (77, 40)]
    qs, ks, vs, dos = ([torch.randn(1, n[i], heads, d, dtype=BF16) for n in lengths]
                       for i, heads in ((0, 4), (1, 2), (1, 2), (0, 4)))
    packed = tuple(torch.cat([t[0] for t in ts]) for ts in (qs, ks, vs, dos))
    ends = [list(itertools.accumulate((t.shape[1] for t in ts), initial=0)) for ts in (qs, ks)]
    offsets = tuple(torch.tensor(e, dtype=torch.int32) for e in ends)
    # a batch of two: the first sequence cut to the second's 77 queries and 40 keys
    dense = tuple(torch.cat([ts[0][:, : ts[1].shape[1]], ts[1]]) for ts in (qs, ks, vs, dos))
    for (causal, window, top_left, softcap), layout in itertools.product(
            (BANDS_AND_CAPS[0], BANDS_AND_CAPS[4]), ("dense", "packed")):
        band = dict(causal=causal, window=window, top_left=top_left, softcap=softcap)
        reference = dict(causal=causal, window=window, bottom_right=not top_left, softcap=softcap)
        q, k, v, dout = dense if layout == "dense" else packed
        extra = {} if layout == "dense" else dict(cu_seqlens=offsets)
        out, lse = _emulated(q, k, v, schedule=LAUNCHED[tile_dim(d)], max_seqlen_q=130, **band, **extra)
        grads = emulate_backward(q, k, v, out, lse, dout, scale=d**-0.5, max_seqlen_k=200, **band, **extra)
        parts = [(q, k, v, dout, out, lse, grads)] if layout == "dense" else [
            (qi, ki, vi, doi, out[a:b][None], lse[:, a:b][None], (grads[0][a:b][None], grads[1][c:e][None],
                                                               grads[2][c:e][None]))
            for (a, b), (c, e), qi, ki, vi, doi in zip(itertools.pairwise(ends[0]), itertools.pairwise(ends[1]), qs,
                                                       ks, vs, dos, strict=True)]
        for qi, ki, vi, doi, oi, lsei, gi in parts:
            _check(oi, lsei, qi, ki, vi, **reference)
            want, baseline, magnitude = reference_grads(qi, ki, vi, doi, reference)
            for name, ours, w, b in zip(("dq", "dk", "dv"), gi, want, baseline, strict=True):
                assert not torch.isnan(ours).any(), (d, layout, name)
                assert_close(name, ours, w, b, factor=3.0, magnitude=magnitude, precision=BF16)


@needs_triton
@on_oldest
def test_persistent_programs_emulated_run_every_work_tile_once():
    """Persistent (``walk.py``): 5 (packed: 7) programs walk every (sequence, head, 128 rows) work tile in
    serpentine waves, the last one part empty, their rings, Q barrier and ping-pong turns running on from tile to
    tile (a wait on a phase already passed on is raised: ``emulate.py``); out and lse against float64 (outputs
    start as NaN: a tile skipped stays NaN). The two persistent variants causal, full and under a band with a
    softcap, "qk" ones causal; grouped heads, a padded head dim, packed sequences."""
    import dataclasses
    import itertools

    from flashattn.backends.triton.hopper.forward import VARIANTS, Schedule

    schedules = [s for s in VARIANTS if s.persistent] + [Schedule("qk", True, 2, persistent=True),
                                                         Schedule("qk", False, persistent=True)]
    assert len(schedules) == 4 and all(dataclasses.replace(s, persistent=False) in VARIANTS for s in schedules[:2])
    torch.manual_seed(2)
    bands = BANDS_AND_CAPS[:2] + BANDS_AND_CAPS[4:5]  # causal, full, a top-left window with a softcap
    runs = [(s, 64, bands) for s in schedules[:2]] + [(s, 64, bands[:1]) for s in schedules[2:]]
    for schedule, d, its_bands in [*runs, (schedules[0], 96, bands[:1])]:
        q, k, v = (torch.randn(2, n, heads, d, dtype=BF16) for n, heads in ((300, 4), (420, 2), (420, 2)))
        for causal, window, top_left, softcap in its_bands:
            out, lse = _emulated(q, k, v, causal=causal, schedule=schedule, window=window, top_left=top_left,
                                 softcap=softcap, programs=5)  # 24 work tiles
            _check(out, lse, q, k, v, causal=causal, window=window, bottom_right=not top_left, softcap=softcap)
    lengths = [(113, 251), (1, 77), (300, 300), (0, 5), (200, 90)]
    qs, ks, vs = ([torch.randn(1, n[i], heads, 64, dtype=BF16) for n in lengths] for i, heads in ((0, 4), (1, 2),
                                                                                                  (1, 2)))
    q, k, v = (torch.cat([t[0] for t in ts]) for ts in (qs, ks, vs))
    ends = [list(itertools.accumulate((t.shape[1] for t in ts), initial=0)) for ts in (qs, ks)]
    offsets = tuple(torch.tensor(e, dtype=torch.int32) for e in ends)
    out, lse = _emulated(q, k, v, causal=True, schedule=schedules[0], cu_seqlens=offsets, max_seqlen_q=300,
                         programs=7)  # 60 work tiles
    for (a, b), qi, ki, vi in zip(itertools.pairwise(ends[0]), qs, ks, vs, strict=True):
        if b > a:
            _check(out[a:b][None], lse[:, a:b][None], qi, ki, vi, causal=True)


@needs_triton
@on_oldest
@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_fp8_forward_emulated_meets_flashattention_3s_rule(d):
    """FlashAttention-3's FP8 forward (never yet run on a GPU): e4m3 q, k, v, the scores scaled by q's and k's
    descales in the kernel, P rounded to e4m3 and handed to P V in the order of the interleaved values
    (``attend.interleaved_values``); out times v's descale against float64 on the dequantized values, within twice
    the error of float64 attention that rounds P where the kernel does (the portable FP8 forward's bar). Causal
    with rows that see no key, full, and a window with a softcap; grouped heads; keys ending inside a group of 32."""
    from flashattn.backends.triton.attend import interleaved_values
    from flashattn.backends.triton.hopper.forward import LAUNCHED
    from tools.gluon.emulate import emulate_forward

    torch.manual_seed(d)
    b, nq, nk, h, hk = 2, 150, 113, 4, 2
    scales = [torch.rand(b, hk) + 0.25 for _ in range(3)]

    def per_head(scale, heads):  # (b, hk) for each of ``heads`` heads: (b, 1, heads, 1)
        return scale.double().repeat_interleave(heads // hk, 1)[:, None, :, None]

    raw = [torch.randn(b, n, heads, d) for n, heads in ((nq, h), (nk, hk), (nk, hk))]
    q, k, v = ((x / per_head(s, x.shape[2])).to(torch.float8_e4m3fn) for x, s in zip(raw, scales, strict=True))
    wide = [t.double() * per_head(s, t.shape[2]) for t, s in zip((q, k, v), scales, strict=True)]
    for causal, window, top_left, softcap in (BANDS_AND_CAPS[0], BANDS_AND_CAPS[1], BANDS_AND_CAPS[3]):
        out, lse = emulate_forward(q, k, interleaved_values(v), causal=causal, scale=d**-0.5,
                                   schedule=LAUNCHED[d], descale=(scales[0] * scales[1]).contiguous(),
                                   window=window, top_left=top_left, softcap=softcap)
        reference = dict(causal=causal, window=window, bottom_right=not top_left, softcap=softcap)
        truth, truth_lse = attention_ref(*wide, **reference)
        same_way = attention_ref(*wide, round_probs=torch.float8_e4m3fn, **reference)[0]
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        final = out.double() * per_head(scales[2], h)
        assert max_err(final, truth) <= 2 * max_err(same_way, truth), (max_err(final, truth), max_err(same_way, truth))
        seen = torch.isfinite(truth_lse)
        assert (lse[seen].double() - truth_lse[seen]).abs().max() < 1e-3 and (lse[~seen] == -torch.inf).all()


@needs_triton
@on_oldest
@pytest.mark.parametrize("block_n", [64, 128])
def test_deterministic_dq_turns_rank_every_block_that_adds_into_a_tile(block_n):
    """``backward_parts._dq_turn`` from its own source on ints, against ``_query_tiles`` (which tiles each key
    block visits): for every 64-row query tile, the blocks that visit it are consecutive, each is told their count,
    and their ranks are 0 .. count - 1, from the last block down under a right bound (the order the blocks reach
    the tile, and the grid's order: ``_key_block`` reverses it there), from the first up otherwise. A wrong rank
    would hang the launch (a turn that never comes) or reset a semaphore early."""
    from test_hopper_models import BANDS, _on_ints

    from flashattn.backends.masking import Band
    from flashattn.backends.triton.hopper.backward_parts import _dq_turn, _query_tiles

    tiles, turn = _on_ints(_query_tiles), _on_ints(_dq_turn)
    for nq, nk in ((300, 500), (500, 300), (1, 1), (129, 1), (128, 1000), (1000, 128), (257, 600)):
        for left, right in BANDS:
            for bottom_right, offset in ((True, 0), (False, 0), (True, -40), (False, 130), (False, 63), (True, -1)):
                band = Band.of(nq, nk, left=left, right=right, bottom_right=bottom_right, diagonal_offset=offset)
                scoring = (band.diagonal, max(left, 0), max(right, 0))
                visitors = {}
                for n in range(-(-nk // block_n)):
                    lo, _, _, hi = tiles(n * block_n, nq, nk, scoring, left >= 0, right >= 0, 64, block_n)
                    for j in range(lo, hi):
                        visitors.setdefault(j, []).append(n)
                for j, blocks in visitors.items():
                    where = (nq, nk, left, right, bottom_right, offset, j)
                    assert blocks == list(range(blocks[0], blocks[-1] + 1)), where
                    ranks = [turn((None, n, *scoring, nk), j, (left >= 0, right >= 0, False), 64, block_n)
                             for n in blocks]
                    assert all(count == len(blocks) for _, count in ranks), where
                    order = [rank for rank, _ in ranks]
                    assert order == (list(range(len(blocks)))[::-1] if right >= 0 else list(range(len(blocks)))), where


@needs_triton
@on_oldest
@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_deterministic_backward_emulated_adds_dq_in_turn(d):
    """``deterministic``: each warpgroup's adds into a query tile's dQ wait for their turn on a semaphore
    (``backward_parts._dq_turn``; the emulation runs each head's key blocks one after another in the grid's order,
    so a turn that is not exactly the count of the adds before it never comes: a deadlock, raised), every add waits
    for one, and the last add of each tile sets its semaphore back to zero (both checked: ``emulate_backward``).
    The gradients against float64 by the
    suite's rule and against the unordered kernel's (the same sums in another order), causal (the grid reversed),
    full, windows, a softcap, grouped heads, a batch of two, and packed sequences."""
    import itertools

    from flashattn.backends.triton.hopper.forward import LAUNCHED
    from tools.gluon.emulate import emulate_backward

    torch.manual_seed(d + 1)
    q, k, v = (torch.randn(2, n, heads, d, dtype=BF16) for n, heads in ((200, 4), (330, 2), (330, 2)))
    dout = torch.randn_like(q)
    for causal, window, top_left, softcap in BANDS_AND_CAPS[:5]:
        band = dict(causal=causal, window=window, top_left=top_left, softcap=softcap)
        reference = dict(causal=causal, window=window, bottom_right=not top_left, softcap=softcap)
        out, lse = _emulated(q, k, v, schedule=LAUNCHED[d], **band)
        ordered = emulate_backward(q, k, v, out, lse, dout, scale=d**-0.5, deterministic=True, **band)
        unordered = emulate_backward(q, k, v, out, lse, dout, scale=d**-0.5, **band)
        want, baseline, magnitude = reference_grads(q, k, v, dout, reference)
        for name, ours, other, w, b in zip(("dq", "dk", "dv"), ordered, unordered, want, baseline, strict=True):
            assert_close(name, ours, w, b, factor=3.0, magnitude=magnitude, precision=BF16)
            assert (ours.float() - other.float()).abs().max() <= 1e-5 * magnitude, (name, band)
    lengths = [(113, 251), (0, 5), (300, 140), (64, 0)]
    qs, ks, vs, dos = ([torch.randn(1, n[i], heads, d, dtype=BF16) for n in lengths]
                       for i, heads in ((0, 4), (1, 2), (1, 2), (0, 4)))
    q, k, v, dout = (torch.cat([t[0] for t in ts]) for ts in (qs, ks, vs, dos))
    ends = [list(itertools.accumulate((t.shape[1] for t in ts), initial=0)) for ts in (qs, ks)]
    offsets = tuple(torch.tensor(e, dtype=torch.int32) for e in ends)
    out, lse = _emulated(q, k, v, schedule=LAUNCHED[d], causal=True, cu_seqlens=offsets, max_seqlen_q=300)
    dq, dk, dv = emulate_backward(q, k, v, out, lse, dout, scale=d**-0.5, causal=True, cu_seqlens=offsets,
                                  max_seqlen_k=251, deterministic=True)
    for (a, b), (c, e), qi, ki, vi, doi in zip(itertools.pairwise(ends[0]), itertools.pairwise(ends[1]), qs, ks, vs,
                                               dos, strict=True):
        if b == a or e == c:
            assert (dq[a:b] == 0).all() and (dk[c:e] == 0).all() and (dv[c:e] == 0).all()
            continue
        want, baseline, magnitude = reference_grads(qi, ki, vi, doi, dict(causal=True))
        for name, ours, w, bl in zip(("dq", "dk", "dv"), (dq[a:b], dk[c:e], dv[c:e]), want, baseline, strict=True):
            assert_close(name, ours[None], w, bl, factor=3.0, magnitude=magnitude, precision=BF16)
