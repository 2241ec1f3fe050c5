"""No host synchronisation on a GPU call, and index values still checked and bounded.

A GPU call that reads a device value on the host (``.tolist()``, ``.item()``, ``bool(t)``, a boolean-mask index,
``torch.tensor(data, device=...)``) stalls the stream and cannot be captured in a CUDA graph. Without a GPU this is
proven with the launches stubbed (``flashattn.backends.triton.stub``: CPU tensors stand for an sm_90 GPU's) and a
guard that fails on any such read during a call, for every kind of call: KV-cache decode (tensor and int lengths,
left padding, cache rows, paged, appending, rotary), varlen (packed and paged), forward, training step, SDPA, block
masks, FP8 scales. The checks such calls skip on the host run in a kernel (``flashattn.checks.on_device``): under
Triton's interpreter it finds every bad value the host checks find; and the attention kernels clamp every index they
read, so a bad value that reached them would still stay inside the tensors. On a GPU: tests/test_cuda_graphs.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from triton_versions import TRITON_MISSING

import flashattn
from conftest import INTERPRETED, run_compiled
from flashattn.checks import on_device
from flashattn.checks.values import CacheSizes, VarlenSizes, check_cache_values, check_varlen_values
from flashattn.errors import ArgumentError

ROOT = Path(__file__).resolve().parents[1]
NEEDS_INTERPRETER = pytest.mark.skipif(not INTERPRETED, reason="runs the Triton kernels under TRITON_INTERPRET=1")


@pytest.mark.skipif(bool(TRITON_MISSING), reason=TRITON_MISSING or "")
def test_no_call_reads_a_device_value_on_the_host():
    out = run_compiled(str(ROOT / "tests" / "host_reads.py"))
    assert "calls without a host read: " in out, out


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


_DENSE = CacheSizes(batch=3, capacity=16, new=1, cache_rows=4, paged=False, rotary_positions=20, rotary_reach=1)
_PAGED = CacheSizes(batch=2, capacity=16, new=1, cache_rows=10, paged=True, num_pages=10, page_size=4)
_TABLE = [[1, 2, 3, 4], [5, 6, 7, 8]]
# (sizes, (cache_seqlens, cache_leftpad, cache_batch_idx, block_table), the argument the error names)
_BAD_CACHES = {
    "length past the capacity": (_DENSE, ([3, 16, 2], None, None, None), "cache_seqlens[1]"),
    "negative length": (_DENSE, ([3, -1, 2], None, None, None), "cache_seqlens[1]"),
    "left padding past the length": (_DENSE, ([3, 4, 5], [0, 0, 6], None, None), "cache_leftpad[2]"),
    "negative left padding": (_DENSE, ([3, 4, 5], [-1, 0, 0], None, None), "cache_leftpad[0]"),
    "cache row past the cache": (_DENSE, ([3, 4, 5], None, [0, 4, 1], None), "cache_batch_idx"),
    "negative cache row": (_DENSE, ([3, 4, 5], None, [0, 1, -2], None), "cache_batch_idx"),
    "repeated cache row": (_DENSE, ([3, 4, 5], None, [2, 0, 2], None), "cache_batch_idx"),
    "rotary table too short": (_DENSE._replace(rotary_positions=10), ([3, 12, 5], None, None, None),
                               "rotary_cos/rotary_sin"),
    "page id past the pages": (_PAGED, ([12, 3], None, None, [[1, 2, 10, 4], [5, 6, 7, 8]]), "block_table"),
    "negative page id": (_PAGED, ([3, 3], None, None, [[1, 2, 3, 4], [-1, 6, 7, 8]]), "block_table"),
}


@NEEDS_INTERPRETER
@pytest.mark.parametrize("case", list(_BAD_CACHES))
def test_the_device_check_finds_what_the_host_check_finds(case):
    sizes, values, named = _BAD_CACHES[case]
    tensors = tuple(None if v is None else _i32(*v) if not isinstance(v[0], list) else torch.tensor(
        v, dtype=torch.int32) for v in values)
    with pytest.raises(ArgumentError, match=named.replace("[", r"\[").replace("/", ".")):
        check_cache_values("flash_attn_with_kvcache", tensors, sizes)
    errors = torch.full((4,), -7, dtype=torch.int64)  # poisoned: the kernel writes every field
    on_device.check_cache("flash_attn_with_kvcache", tensors, sizes, errors=errors)
    message = on_device.describe("flash_attn_with_kvcache", errors.tolist())
    assert message is not None and message.startswith("flash_attn_with_kvcache: ")
    assert named.split("[")[0] in message or (named == "rotary_cos/rotary_sin" and "rotary" in message), message


@NEEDS_INTERPRETER
def test_the_device_checks_pass_good_values():
    for sizes, tensors in ((_DENSE, (_i32(3, 15, 0), _i32(0, 15, 0), _i32(3, 0, 1), None)),
                           (_PAGED, (_i32(15, 0), None, None, torch.tensor(_TABLE, dtype=torch.int32)))):
        errors = torch.full((4,), -7, dtype=torch.int64)
        on_device.check_cache("flash_attn_with_kvcache", tensors, sizes, errors=errors)
        assert errors.tolist() == [0, 0, 0, 0]
    errors = torch.full((4,), -7, dtype=torch.int64)
    on_device.check_varlen("f", _i32(0, 5, 5, 10), _i32(0, 6, 12, 12), None, VarlenSizes(10, 12, 5, 6), errors=errors)
    assert errors.tolist() == [0, 0, 0, 0]


_VARLEN = VarlenSizes(total_q=10, total_k=12, max_q=5, max_k=6)
_BAD_OFFSETS = {
    "q not starting at 0": ([1, 5, 10], [0, 6, 12], "cu_seqlens_q must start at 0"),
    "q decreasing": ([0, 5, 4, 10], [0, 6, 6, 12], "cu_seqlens_q must be non-decreasing"),
    "q not ending at the rows": ([0, 5, 9], [0, 6, 12], r"cu_seqlens_q\[-1\]"),
    "k not ending at the rows": ([0, 5, 10], [0, 6, 13], r"cu_seqlens_k\[-1\]"),
    "longer than max_seqlen_q": ([0, 4, 10], [0, 6, 12], "max_seqlen_q"),
    "longer than max_seqlen_k": ([0, 5, 10], [0, 7, 12], "max_seqlen_k"),
}


@NEEDS_INTERPRETER
@pytest.mark.parametrize("case", list(_BAD_OFFSETS))
def test_the_device_check_finds_bad_offsets(case):
    cu_q, cu_k, pattern = _BAD_OFFSETS[case]
    with pytest.raises(ArgumentError, match=pattern):
        check_varlen_values("f", _i32(*cu_q), _i32(*cu_k), None, _VARLEN)
    errors = torch.full((4,), -7, dtype=torch.int64)
    on_device.check_varlen("f", _i32(*cu_q), _i32(*cu_k), None, _VARLEN, errors=errors)
    message = on_device.describe("f", errors.tolist())
    assert message is not None
    import re

    assert re.search(pattern, message), message


def _cache_call(paged: bool):
    from flashattn import checks

    g = torch.Generator().manual_seed(0)
    shape = (8, 4, 2, 16) if paged else (3, 16, 2, 16)
    k_cache, v_cache = (torch.randn(*shape, generator=g) for _ in range(2))
    q = torch.randn(2, 1, 4, 16, generator=g)
    table = torch.tensor([[3, 1, 4, 0], [5, 2, 6, 7]], dtype=torch.int32) if paged else None
    call = checks.check_kvcache(
        "flash_attn_with_kvcache", q=q, k_cache=k_cache, v_cache=v_cache, k=None, v=None, rotary_cos=None,
        rotary_sin=None, cache_seqlens=_i32(9, 5), cache_batch_idx=None, cache_leftpad=None, block_table=table,
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=False,
        alibi_slopes=None, num_splits=1, return_softmax_lse=False, learnable_sink=None)
    return call


def _forward(call, **cache_fields):
    from flashattn.backends.triton import attend

    cache = dataclasses.replace(call.spec.cache, **{k: _i32(*v) for k, v in cache_fields.items()})
    spec = dataclasses.replace(call.spec, cache=cache)
    return attend.forward(call.q, call.k_cache, call.v_cache, spec)[0]


@NEEDS_INTERPRETER
@pytest.mark.parametrize("bad, clamped", [
    ({"k_end": (9, 1000)}, {"k_end": (9, 16)}),  # past the capacity: the capacity
    ({"k_end": (9, -4)}, {"k_end": (9, 0)}),  # negative: no keys (output 0)
    ({"k_start": (-3, 2)}, {"k_start": (0, 2)}),  # negative start: 0
    ({"k_start": (12, 2)}, {"k_start": (9, 2)}),  # start past the end: no keys
    ({"batch_idx": (7, -1)}, {"batch_idx": (2, 0)}),  # rows outside the cache: its first or last
])
def test_the_kernel_clamps_cache_bounds_it_reads(bad, clamped):
    call = _cache_call(paged=False)
    base = {"k_start": (0, 0), "k_end": (9, 5)}
    got = _forward(call, **{**base, **bad})
    want = _forward(call, **{**base, **clamped})
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@NEEDS_INTERPRETER
def test_the_kernel_clamps_page_ids_it_reads():
    call = _cache_call(paged=True)
    bad = dataclasses.replace(call.spec.cache, block_table=torch.tensor([[3, 99, 4, 0], [-8, 2, 6, 7]],
                                                                         dtype=torch.int32))
    fixed = dataclasses.replace(call.spec.cache, block_table=torch.tensor([[3, 7, 4, 0], [0, 2, 6, 7]],
                                                                           dtype=torch.int32))
    from flashattn.backends.triton import attend

    got, want = (attend.forward(call.q, call.k_cache, call.v_cache, dataclasses.replace(call.spec, cache=c))[0]
                 for c in (bad, fixed))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@NEEDS_INTERPRETER
def test_the_kernels_clamp_varlen_offsets_they_read():
    """An end past the packed rows reads up to the last row, forward and backward."""
    from flashattn.backends.spec import Saved, Varlen
    from flashattn.backends.triton import attend

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(40, 2, 16, generator=g) for _ in range(3))
    good = flashattn.checks.check_varlen("f", q, k, v, cu_seqlens_q=_i32(0, 15, 40), cu_seqlens_k=_i32(0, 15, 40),
                                         max_seqlen_q=25, max_seqlen_k=25, dropout_p=0.0, softmax_scale=None,
                                         causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                         deterministic=False, return_attn_probs=False).spec
    bad = dataclasses.replace(good, varlen=Varlen(_i32(0, 15, 4000), _i32(0, 15, 4000), 25, 25))
    outs = [attend.forward(q, k, v, spec) for spec in (good, bad)]
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=0)
    dout = torch.randn(40, 2, 16, generator=g)
    grads = [attend.backward(dout, None, Saved(q, k, v, out, lse), spec)[:3]
             for (out, lse, _), spec in zip(outs, (good, bad), strict=True)]
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
