"""The KV-cache append kernel (flashattn/kvcache_kernel.py, one launch on a GPU) writes exactly what the torch ops
write, dense or paged, with cache rows, any strides; a slot outside the cache is never written. Run under Triton's
interpreter; on a GPU every appending call of tests/test_kvcache.py goes through it."""

from __future__ import annotations

import pytest
import torch

from conftest import INTERPRETED
from flashattn import kvcache

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="runs the append kernel under TRITON_INTERPRET=1")


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def _caches(paged: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shape = (8, 4, 3, 16) if paged else (4, 16, 3, 16)
    return (torch.randn(*shape, generator=g, dtype=dtype), torch.randn(*shape[:3], 24, generator=g, dtype=dtype))


def _new(n=2, dtype=torch.float32, transposed=False):
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, n, 3, 16, generator=g, dtype=dtype), torch.randn(3, n, 3, 24, generator=g, dtype=dtype)
    if transposed:  # heads outermost in memory: other strides
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    return k, v


@pytest.mark.parametrize("kind", ["dense", "cache rows", "paged", "strided new keys", "bfloat16"])
def test_the_kernel_writes_what_the_torch_ops_write(kind):
    paged = kind == "paged"
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    k_cache, v_cache = _caches(paged, dtype)
    k, v = _new(dtype=dtype, transposed=kind == "strided new keys")
    extra = {"batch_idx": _i32(3, 0, 1)} if kind == "cache rows" else {}
    if paged:
        extra = {"block_table": torch.tensor([[2, 5, 0, 7], [1, 3, 4, 6], [7, 6, 5, 4]], dtype=torch.int32)}
    at = _i32(0, 5, 13)
    want = [t.clone() for t in (k_cache, v_cache)]
    kvcache.append(*want, k, v, at=at, **extra)  # the torch ops (the interpreter never takes the kernel)
    kvcache.append_by_kernel(k_cache, v_cache, k, v, at=at, **extra)
    torch.testing.assert_close(k_cache, want[0], rtol=0, atol=0)
    torch.testing.assert_close(v_cache, want[1], rtol=0, atol=0)


@pytest.mark.parametrize("bad", ["position past the cache", "negative position", "row outside the cache",
                                 "page id outside the cache"])
def test_a_slot_outside_the_cache_is_not_written(bad):
    paged = bad == "page id outside the cache"
    k_cache, v_cache = _caches(paged)
    before = [t.clone() for t in (k_cache, v_cache)]
    k, v = _new(n=1)
    at = {"position past the cache": _i32(16, 3, 15), "negative position": _i32(-1, 3, 2)}.get(bad, _i32(1, 2, 3))
    extra = {"batch_idx": _i32(0, 9, 1)} if bad == "row outside the cache" else {}
    if paged:
        extra = {"block_table": torch.tensor([[2, 5, 0, 7], [1, 30, 4, 6], [7, -6, 5, 4]], dtype=torch.int32)}
        at = _i32(1, 5, 6)  # entry 1 at page 30, entry 2 at page -6: neither exists
    kvcache.append_by_kernel(k_cache, v_cache, k, v, at=at, **extra)
    written = (k_cache != before[0]).any(-1).any(-1).nonzero().tolist()
    expected = {"position past the cache": [[1, 3], [2, 15]], "negative position": [[1, 3], [2, 2]],
                "row outside the cache": [[0, 1], [1, 3]], "page id outside the cache": [[2, 1]]}[bad]
    assert written == expected


@pytest.mark.parametrize("kind", ["dense", "paged", "interleaved", "bfloat16", "queries alone", "queries advance",
                                  "half the dims", "strided new keys"])
def test_the_rotary_kernel_rotates_and_appends_what_the_torch_ops_do(kind):
    """One launch of rotary_append_kernel against apply_rotary's torch ops and the plain append: the rotated queries
    and the caches equal (float32: to rounding; 16-bit: at most one unit in the last place, from fused products)."""
    from flashattn.rotary import apply_rotary, positions

    paged = kind == "paged"
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    g = torch.Generator().manual_seed(2)
    k_cache, _ = _caches(paged, dtype)
    v_cache = torch.randn(*k_cache.shape[:3], 24, generator=g, dtype=dtype)
    k, v = _new(dtype=dtype, transposed=kind == "strided new keys")
    q = torch.randn(3, 2, 6, 16, generator=g, dtype=dtype)
    half = 4 if kind == "half the dims" else 8
    cos, sin = torch.randn(20, half, generator=g), torch.randn(20, half, generator=g)
    table = torch.tensor([[2, 5, 0, 7], [1, 3, 4, 6], [7, 6, 5, 4]], dtype=torch.int32) if paged else None
    at, interleaved, advance = _i32(0, 5, 13), kind == "interleaved", kind == "queries advance"
    new = (None, None) if kind.startswith("queries") else (k, v)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    if new[0] is not None:
        kvcache.append(want_k, want_v, apply_rotary(k, cos, sin, positions(at, 2), interleaved=interleaved), v, at=at,
                       block_table=table)
    want_q = apply_rotary(q, cos, sin, positions(at, 2, advance=advance), interleaved=interleaved)
    got_q = kvcache.rotary_by_kernel((q, k_cache, v_cache, *new), (at, None, table), (cos, sin),
                                     interleaved=interleaved, advance=advance)
    exact = {"rtol": 0, "atol": 0} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 1e-6}
    torch.testing.assert_close(got_q, want_q, **exact)
    torch.testing.assert_close(k_cache, want_k, **exact)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0)
    assert got_q.is_contiguous() and got_q.shape == q.shape
