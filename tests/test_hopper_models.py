"""The Hopper tier's kernels without a GPU: models of their barrier protocols, the forward's index arithmetic run
from its own source on Python ints, and the kernels themselves emulated on CPU tensors (``tools/gluon/emulate.py``:
every ``@gluon.jit`` body as written, each partition in a thread, Gluon's primitives replaced by what they compute,
barriers that block) against float64: the forward over odd lengths, more queries than keys, grouped heads, windows
of either alignment, softcaps, packed sequences and every schedule; the one-pass backward at head dims 64, 128 (dS
exchanged between the warpgroups) and 256 (the wide kernel). What only a GPU shows (the compiler, layouts, timing,
the interleavings the threads never took): gpu-check's ``gluon`` step."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import assert_close, attention_ref
from triton_versions import needs_triton, recorded_on_oldest

BF16 = torch.bfloat16
on_oldest = recorded_on_oldest("the Hopper tier's Gluon kernel (Gluon's API changes between releases)")


def test_the_backward_ring_protocol_never_deadlocks_or_serves_a_stale_tile():
    """A model of the backward's barriers (``hopper/backward.py``, ``_exchange_model`` without the exchange): the
    producer fills ring slot i % STAGES after waiting on its "empty" barrier (count 2) with parity
    ((i // STAGES) & 1) ^ 1; each consumer waits on the slot's "ready" barrier with parity (i // STAGES) & 1, reads
    it, and arrives on "empty". mbarrier semantics: a wait on parity p passes once the phase of that parity has
    completed (a fresh barrier's phase -1, odd, counts as completed). Random interleavings, every tile count and
    ring depth: all finish and read the tile written."""
    for stages in (1, 2, 3):
        for tiles in range(0, 9):
            for seed in range(30):
                assert _exchange_model(tiles, stages, seed, ds_depth=0) == {"producer": tiles, 0: tiles, 1: tiles}


def _exchange_model(tiles: int, stages: int, seed: int, *, ds_depth: int = 2, empty_flip: int = 1) -> dict:
    """The backward's barriers as a model, one random interleaving (see the tests): where each party stopped, and
    raises AssertionError where a warpgroup read a stale dS^T or Q tile. ``ds_depth`` 0: no exchange between the
    warpgroups (d=64)."""
    import random

    class Barrier:  # mbarrier: a wait on parity p passes once the phase of that parity completed (-1 counts)
        def __init__(self, count):
            self.count, self.arrived, self.completed = count, 0, 0

        def passes(self, parity):
            return self.completed % 2 != parity

        def arrive(self):
            self.arrived += 1
            if self.arrived == self.count:
                self.arrived, self.completed = 0, self.completed + 1

    rng = random.Random(seed)
    ready, empty = [Barrier(1) for _ in range(stages)], [Barrier(2) for _ in range(stages)]
    full_ds, empty_ds = [Barrier(2) for _ in range(max(ds_depth, 1))], [Barrier(2) for _ in range(max(ds_depth, 1))]
    slots, ds = [None] * stages, [[None, None] for _ in range(max(ds_depth, 1))]
    pos = {"producer": 0, 0: 0, 1: 0}  # the next tile of each party
    step = {0: 0, 1: 0}  # a consumer's place in its tile: 0 Q ready?, 1 dS buffer free?, 2 the other's dS?
    for _ in range(20_000):
        movable = []
        i = pos["producer"]
        if i < tiles and empty[i % stages].passes(((i // stages) & 1) ^ 1):
            movable.append("producer")
        for wg in (0, 1):
            i, b, lap = pos[wg], pos[wg] % max(ds_depth, 1), (pos[wg] // max(ds_depth, 1)) & 1
            if i < tiles and [ready[i % stages].passes((i // stages) & 1), empty_ds[b].passes(lap ^ empty_flip),
                              full_ds[b].passes(lap)][step[wg]]:
                movable.append(wg)
        if not movable:
            break
        who = rng.choice(movable)
        i = pos[who]
        if who == "producer":
            slots[i % stages] = i
            ready[i % stages].arrive()
            pos[who] += 1
        elif step[who] == 0 and not ds_depth:  # the whole tile from the ring's Q and dO, the slot released
            assert slots[i % stages] == i, ("stale Q", stages, tiles, seed, who, i)
            empty[i % stages].arrive()
            pos[who] = i + 1
        elif step[who] == 0:  # S^T, dP^T, dS^T from the ring's Q and dO
            assert slots[i % stages] == i, ("stale Q", stages, tiles, seed, who, i)
            step[who] = 1
        elif step[who] == 1:  # its dS^T into the buffer, then "full"
            ds[i % ds_depth][who] = i
            full_ds[i % ds_depth].arrive()
            step[who] = 2
        else:  # dQ over both halves; the buffer and the ring slot released
            assert ds[i % ds_depth] == [i, i], ("stale dS", stages, tiles, seed, who, i)
            assert slots[i % stages] == i, ("stale K-side tile", stages, tiles, seed, who, i)
            empty_ds[i % ds_depth].arrive()
            empty[i % stages].arrive()
            step[who], pos[who] = 0, i + 1
    return pos


def test_the_backward_exchange_between_warpgroups_never_deadlocks_or_reads_a_stale_tile():
    """At d=128 each consumer warpgroup stores its dS^T (64 keys x 64 queries) into buffer 2 * (i % 2) + warpgroup
    (at d=256 its halves of P^T and dS^T into the one pair of tiles: depth 1, parity i & 1),
    arrives on that pair's "full" barrier (count 2), waits for it (parity (i // 2) & 1), computes its half of dQ's
    columns from both buffers, then arrives on "empty" (count 2); before storing it waits on "empty" with parity
    ((i // 2) & 1) ^ 1. With the Q/dO ring as above, random interleavings, every ring depth and tile count: all
    finish, no warpgroup reads a dS^T of another tile. Mutations (one buffer for two tiles in flight, a wait on
    "empty" with the wrong parity) fail the model."""
    for depth in (1, 2):  # d=256 (backward_wide.py) exchanges P^T and dS^T one tile deep
        for stages in (1, 2, 3):
            for tiles in range(0, 8):
                for seed in range(20):
                    assert _exchange_model(tiles, stages, seed, ds_depth=depth) == {"producer": tiles, 0: tiles,
                                                                                    1: tiles}
    with pytest.raises(AssertionError, match="stale dS"):  # a single buffer: a fast warpgroup overwrites it
        for seed in range(200):
            _exchange_model(6, 2, seed, ds_depth=1, empty_flip=2)  # (2: "empty" never waited on)
    stuck = [_exchange_model(4, 2, seed, empty_flip=0) for seed in range(5)]
    assert all(pos[0] == 0 and pos[1] == 0 for pos in stuck)  # the first wait on "empty" never passes



def _on_ints(helper):
    """A Gluon helper's own body (``helper.fn``) run on Python ints, ``gl``'s minimum, maximum and cdiv as plain
    functions: the kernel's index arithmetic checked without a GPU."""
    import types

    gl = types.SimpleNamespace(minimum=min, maximum=max, cdiv=lambda a, b: -(-a // b))
    fn = helper.fn
    return types.FunctionType(fn.__code__, {**fn.__globals__, "gl": gl}, fn.__name__, fn.__defaults__)


BANDS = [(-1, -1), (-1, 0), (0, 0), (64, 0), (100, 30), (300, -1), (0, -1), (5, 200), (-1, 77)]


@needs_triton
@on_oldest
@pytest.mark.parametrize("block_n", [64, 128])
def test_the_key_tiles_a_program_visits_cover_its_band_and_skip_the_rest(block_n):
    """``_key_span`` (the producer's loads and both consumers' loops): every key any row of the 128-row program
    sees lies in the tiles it visits, the first and last visited tiles hold a visible key (hidden tiles are
    skipped), and the tiles it runs unmasked ([lead, plain)) are whole and seen whole by every row; ``_segments``
    splits each schedule's loops into masked, unmasked, masked, in order, covering them once."""
    from flashattn.backends.masking import Band
    from flashattn.backends.triton.hopper.steps import _key_span, _segments

    span, segments = _on_ints(_key_span), _on_ints(_segments)
    for nq, nk in ((300, 500), (500, 300), (1, 1), (129, 1), (128, 1000), (1000, 128), (777, 777), (257, 600)):
        for left, right in BANDS:
            for bottom_right, offset in ((True, 0), (False, 0), (True, -40), (False, 130)):
                band = Band.of(nq, nk, left=left, right=right, bottom_right=bottom_right, diagonal_offset=offset)
                for m0 in range(0, nq, 128):
                    rows = torch.arange(m0, min(m0 + 128, nq))
                    seen = band.visible(rows, torch.arange(nk)) & True
                    first, tiles, lead, plain = span(m0, nq, nk, (band.diagonal, max(left, 0), max(right, 0)),
                                                     left >= 0, right >= 0, 128, block_n)
                    where = (nq, nk, left, right, bottom_right, offset, m0)
                    assert tiles >= 1 and 0 <= lead <= plain <= tiles and 0 <= first * block_n < max(nk, 1), where
                    keys = seen.any(0).nonzero().flatten()
                    if len(keys):
                        assert first == keys[0] // block_n and first + tiles - 1 == keys[-1] // block_n, where
                    for t in range(lead, plain):
                        c0 = (first + t) * block_n
                        assert c0 + block_n <= nk and band.tile_is_full(m0, rows[-1].item() + 1, c0, c0 + block_n)
                    for lo, hi in ((0, tiles - 1), (1, tiles)):  # schedule "qk" peels the last tile, "pv" the first
                        for has_left in {left >= 0, True}:
                            begin, end = segments(lo, hi, lead, plain, has_left)
                            assert lo <= begin <= end <= max(hi, lo), where
                            assert not (begin < end) or lead <= begin and end <= plain, where
                            assert has_left or begin == lo, where


def _emulated(q, k, v, **arguments):
    from tools.gluon.emulate import emulate_forward

    return emulate_forward(q, k, v, scale=q.shape[-1] ** -0.5, **arguments)


def _check(out, lse, q, k, v, **reference):
    """The suite's rule on out (2x plain bf16 attention's error against float64), lse near float64's where a row
    sees a key, out 0 and lse -inf where it sees none, and every element written (out and lse start as NaN)."""
    ref, ref_lse = attention_ref(q, k, v, **reference)
    base, _ = attention_ref(q, k, v, upcast=False, **reference)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close("out", out, ref, base)
    seen = torch.isfinite(ref_lse)
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() < 1e-4 if seen.any() else True
    assert (lse[~seen] == -math.inf).all() and (out.transpose(1, 2)[~seen] == 0).all()


def reference_grads(q, k, v, dout, reference: dict) -> tuple:
    """(dq, dk, dv) of ``attention_ref`` in float64 and in the inputs' dtype (the rule's baseline), and the float64
    ones' largest magnitude: what a backward's gradients are judged against."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(attention_ref(*leaves, **reference)[0], leaves, dout.double())
    plain = [t.detach().requires_grad_() for t in (q, k, v)]
    baseline = torch.autograd.grad(attention_ref(*plain, upcast=False, **reference)[0], plain, dout)
    return want, baseline, max(w.abs().max().item() for w in want)


# (nq, nk, heads, kv heads, d): odd lengths, a tile's edge, more queries than keys (rows that see no key), GQA.
SHAPES = [(113, 251, 2, 2, 64), (300, 100, 4, 2, 64), (129, 129, 2, 1, 128), (1, 77, 2, 2, 64)]
# (causal, window, top-left aligned, softcap)
BANDS_AND_CAPS = [(True, (-1, -1), False, 0.0), (False, (-1, -1), False, 0.0), (False, (77, 20), False, 0.0),
                  (True, (150, -1), False, 30.0), (False, (300, 40), True, 20.0), (False, (40, -1), True, 0.0),
                  (False, (-1, 30), False, 5.0)]


@needs_triton
@on_oldest
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_forward_emulated_from_its_own_source_matches_float64(shape):
    """The launched schedule of each head dim, from the launcher's real arguments to the stored out and lse."""
    from flashattn.backends.triton.hopper.forward import LAUNCHED

    nq, nk, h, hk, d = shape
    torch.manual_seed(nq + nk)
    batch = 2 if nq == SHAPES[0][0] else 1  # (one shape with two sequences in the batch: the programs' batch index)
    q, k, v = (torch.randn(batch, n, heads, d, dtype=BF16) for n, heads in ((nq, h), (nk, hk), (nk, hk)))
    for causal, window, top_left, softcap in BANDS_AND_CAPS:
        out, lse = _emulated(q, k, v, causal=causal, schedule=LAUNCHED[d], window=window, top_left=top_left,
                             softcap=softcap)
        _check(out, lse, q, k, v, causal=causal, window=window, bottom_right=not top_left, softcap=softcap)


@needs_triton
@on_oldest
def test_every_schedule_emulated_matches_float64():
    """The five schedules (ping-pong, the unrolled qk, FlashAttention-3's pv) walk the same tiles the same way."""
    from flashattn.backends.triton.hopper.forward import VARIANTS

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, n, 2, 64, dtype=BF16) for n in (300, 520, 520))
    for schedule in VARIANTS:
        for causal, window, top_left, softcap in BANDS_AND_CAPS[:5]:
            out, lse = _emulated(q, k, v, causal=causal, schedule=schedule, window=window, top_left=top_left,
                                 softcap=softcap)
            _check(out, lse, q, k, v, causal=causal, window=window, bottom_right=not top_left, softcap=softcap)


@needs_triton
@on_oldest
def test_packed_sequences_emulated_match_each_sequence_alone():
    """flash_attn_varlen_func's layout: each sequence's out and lse as that sequence alone gives them, its band
    aligned to its own lengths; programs past a short sequence's queries write nothing (the rows stay theirs)."""
    import itertools

    from flashattn.backends.triton.hopper.forward import LAUNCHED

    lengths = [(113, 251), (1, 77), (300, 300), (0, 5), (200, 90)]
    torch.manual_seed(1)
    qs, ks, vs = ([torch.randn(1, n[i], heads, 64, dtype=BF16) for n in lengths]
                  for i, heads in ((0, 4), (1, 2), (1, 2)))
    q, k, v = (torch.cat([t[0] for t in ts]) for ts in (qs, ks, vs))
    ends = [list(itertools.accumulate((t.shape[1] for t in ts), initial=0)) for ts in (qs, ks)]
    offsets = tuple(torch.tensor(e, dtype=torch.int32) for e in ends)
    for causal, window, top_left, softcap in BANDS_AND_CAPS[:5]:
        out, lse = _emulated(q, k, v, causal=causal, schedule=LAUNCHED[64], window=window, top_left=top_left,
                             softcap=softcap, cu_seqlens=offsets, max_seqlen_q=300)
        for (a, b), qi, ki, vi in zip(itertools.pairwise(ends[0]), qs, ks, vs, strict=True):
            if b > a:
                _check(out[a:b][None], lse[:, a:b][None], qi, ki, vi, causal=causal, window=window,
                       bottom_right=not top_left, softcap=softcap)


@needs_triton
@on_oldest
@pytest.mark.parametrize("block_n", [64, 128])
def test_the_query_tiles_a_backward_program_visits_cover_its_band(block_n):
    """``backward_parts._query_tiles`` from its own source on ints: every query that sees a key of the program's block
    lies in the tiles it visits, the first and last visited tiles hold one, and the unmasked tiles are whole, inside
    both sequences, and see every key of the block."""
    from flashattn.backends.masking import Band
    from flashattn.backends.triton.hopper.backward_parts import _query_tiles

    tiles = _on_ints(_query_tiles)
    for nq, nk in ((300, 500), (500, 300), (1, 1), (129, 1), (128, 1000), (1000, 128), (257, 600)):
        for left, right in BANDS:
            for bottom_right, offset in ((True, 0), (False, 0), (True, -40), (False, 130)):
                band = Band.of(nq, nk, left=left, right=right, bottom_right=bottom_right, diagonal_offset=offset)
                for n0 in range(0, nk, block_n):
                    keys = torch.arange(n0, min(n0 + block_n, nk))
                    seen = band.visible(torch.arange(nq), keys)
                    lo, full_lo, full_hi, hi = tiles(n0, nq, nk, (band.diagonal, max(left, 0), max(right, 0)),
                                                     left >= 0, right >= 0, 64, block_n)
                    where = (nq, nk, left, right, bottom_right, offset, n0)
                    assert 0 <= lo <= full_lo <= full_hi <= hi <= -(-nq // 64), where
                    queries = seen.any(1).nonzero().flatten()
                    if len(queries):
                        assert lo == queries[0] // 64 and hi - 1 == queries[-1] // 64, where
                    for t in range(full_lo, full_hi):
                        assert (t + 1) * 64 <= nq and n0 + block_n <= nk, where
                        assert band.tile_is_full(t * 64, (t + 1) * 64, n0, n0 + block_n), where


@needs_triton
@on_oldest
@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_one_pass_backward_emulated_from_its_own_source_matches_float64(d):
    """dQ, dK and dV of the tier's one-pass backward (never yet run on a GPU) from its own source, from the forward's
    out and lse: within 3x plain bf16 attention's gradient error against float64 (the suite's rule), causal (rows
    that see no key) and full, bands of either alignment and softcaps, grouped key/value heads, lengths off every
    tile."""
    from oracle import max_err

    from flashattn.backends.triton.hopper.forward import LAUNCHED
    from tools.gluon.emulate import emulate_backward

    torch.manual_seed(d)
    cases = [((True, (-1, -1), False, 0.0), (300, 200, 4, 2)), ((False, (-1, -1), False, 0.0), (130, 257, 2, 1))]
    cases += [(band, (173, 251, 4, 2)) for band in BANDS_AND_CAPS[2:]]
    for (causal, window, top_left, softcap), (nq, nk, h, hk) in cases:
        batch = 2 if nq == 300 else 1  # (the first case with two sequences in the batch)
        q, k, v = (torch.randn(batch, n, heads, d, dtype=BF16) for n, heads in ((nq, h), (nk, hk), (nk, hk)))
        dout = torch.randn_like(q)
        band = dict(causal=causal, window=window, top_left=top_left, softcap=softcap)
        reference = dict(causal=causal, window=window, bottom_right=not top_left, softcap=softcap)
        out, lse = _emulated(q, k, v, schedule=LAUNCHED[d], **band)
        grads = emulate_backward(q, k, v, out, lse, dout, scale=d**-0.5, **band)
        want, baseline, magnitude = reference_grads(q, k, v, dout, reference)
        for name, ours, w, b in zip(("dq", "dk", "dv"), grads, want, baseline, strict=True):
            assert not torch.isnan(ours).any(), name
            assert_close(name, ours, w, b, factor=3.0, magnitude=magnitude, precision=BF16)
            assert max_err(ours, w) < 0.05, name


@needs_triton
@on_oldest
@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_one_pass_backward_emulated_on_packed_sequences(d):
    """Packed sequences through both emulated kernels: each sequence's dQ, dK and dV as that sequence alone gives
    them (the suite's rule), one sequence without queries (its dK, dV 0) and one without keys (its dQ 0)."""
    import itertools

    from flashattn.backends.triton.hopper.forward import LAUNCHED
    from tools.gluon.emulate import emulate_backward

    lengths = [(113, 251), (1, 77), (300, 300), (0, 5), (64, 0)]
    torch.manual_seed(d)
    qs, ks, vs, dos = ([torch.randn(1, n[i], heads, d, dtype=BF16) for n in lengths]
                       for i, heads in ((0, 4), (1, 2), (1, 2), (0, 4)))
    q, k, v, dout = (torch.cat([t[0] for t in ts]) for ts in (qs, ks, vs, dos))
    ends = [list(itertools.accumulate((t.shape[1] for t in ts), initial=0)) for ts in (qs, ks)]
    offsets = tuple(torch.tensor(e, dtype=torch.int32) for e in ends)
    for causal, window, top_left, softcap in (BANDS_AND_CAPS[0], BANDS_AND_CAPS[4]):
        band = dict(causal=causal, window=window, top_left=top_left, softcap=softcap)
        out, lse = _emulated(q, k, v, schedule=LAUNCHED[d], cu_seqlens=offsets, max_seqlen_q=300, **band)
        dq, dk, dv = emulate_backward(q, k, v, out, lse, dout, scale=d**-0.5, cu_seqlens=offsets, max_seqlen_k=300,
                                      **band)
        assert not any(torch.isnan(g).any() for g in (dq, dk, dv))
        reference = dict(causal=causal, window=window, bottom_right=not top_left, softcap=softcap)
        rows = zip(itertools.pairwise(ends[0]), itertools.pairwise(ends[1]), qs, ks, vs, dos, strict=True)
        for (a, b), (c, e), qi, ki, vi, doi in rows:
            if b == a or e == c:  # nothing to attend: zero gradients
                assert (dq[a:b] == 0).all() and (dk[c:e] == 0).all() and (dv[c:e] == 0).all()
                continue
            want, baseline, magnitude = reference_grads(qi, ki, vi, doi, reference)
            for name, ours, w, bl in zip(("dq", "dk", "dv"), (dq[a:b], dk[c:e], dv[c:e]), want, baseline,
                                         strict=True):
                assert_close(name, ours[None], w, bl, factor=3.0, magnitude=magnitude, precision=BF16)
