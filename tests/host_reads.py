"""The script behind tests/test_no_host_sync.py: every kind of GPU call, with its launches stubbed (CPU tensors
standing for an sm_90 GPU's), made under ``no_host_reads``, a guard that fails on any read of a tensor's values on
the host. Run without Triton's interpreter (the kernels are compiled for sm_90, not run)."""

from __future__ import annotations

import contextlib
import os
import traceback

import torch


class HostRead(AssertionError):
    """A call read a device value on the host."""


@contextlib.contextmanager
def no_host_reads():
    """Inside the block, whatever would read a GPU tensor's values on the host raises ``HostRead``: ``item``,
    ``tolist``, ``numpy``, ``cpu``, ``bool``/``int``/``float``/``index`` of a tensor, ``nonzero``, ``masked_select``,
    indexing with a boolean mask (a nonzero), and ``torch.tensor(data, device=...)`` (a blocking host-to-device
    copy)."""
    saved = []

    def patch(owner, name, replacement):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def refuse(name):
        def read(*args, **kwargs):
            raise HostRead(f"{name} reads a device value on the host")
        return read

    for name in ("item", "tolist", "numpy", "cpu", "nonzero", "__bool__", "__int__", "__float__", "__index__"):
        patch(torch.Tensor, name, refuse(f"Tensor.{name}"))
    for name in ("nonzero", "masked_select"):
        patch(torch, name, refuse(f"torch.{name}"))
    getitem, tensor = torch.Tensor.__getitem__, torch.tensor

    def masked_getitem(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            raise HostRead("indexing with a boolean mask runs a nonzero: a host read")
        return getitem(self, index)

    def host_tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            raise HostRead("torch.tensor(data, device=...) copies host data to the device, blocking")
        return tensor(*args, **kwargs)

    patch(torch.Tensor, "__getitem__", masked_getitem)
    patch(torch, "tensor", host_tensor)
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _calls(flashattn):
    """name -> a call of that kind (CPU tensors: under the stub they stand for the GPU's)."""
    from torch.nn.attention import flex_attention

    bf16, g = torch.bfloat16, torch.Generator().manual_seed(0)

    def randn(*shape, dtype=bf16, grad=False):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)

    def i32(*values):
        return torch.tensor(values, dtype=torch.int32)

    q, k_cache, v_cache = randn(2, 1, 8, 128), randn(3, 1024, 2, 128), randn(3, 1024, 2, 128)
    pages_k, pages_v = randn(16, 64, 2, 128), randn(16, 64, 2, 128)
    table = torch.randperm(16, generator=g).to(torch.int32).view(2, 8)
    new_k, new_v = randn(2, 1, 2, 128), randn(2, 1, 2, 128)
    cos, sin = randn(2048, 32, dtype=torch.float32), randn(2048, 32, dtype=torch.float32)
    lengths = i32(300, 200)
    decode = flashattn.flash_attn_with_kvcache
    packed = [randn(150, h, 64) for h in (4, 2, 2)]
    cu = i32(0, 50, 51, 150)
    paged_table = torch.randperm(16, generator=g)[:15].to(torch.int32).view(3, 5)
    dense = [randn(2, 100, h, 128) for h in (8, 2, 2)]
    trained = [randn(2, 100, h, 128, grad=True) for h in (8, 2, 2)]
    packed_trained = [randn(150, h, 64, grad=True) for h in (4, 2, 2)]
    sdpa = randn(2, 8, 77, 64)
    causal = flex_attention.create_block_mask(lambda b, h, i, j: i >= j, None, None, 256, 256, device="cpu")
    blocked = [randn(1, 256, 4, 64) for _ in range(3)]
    e4m3 = [t.to(torch.float8_e4m3fn) for t in dense]
    scales = [torch.ones(2, 2) for _ in range(3)]
    layer = flashattn.nn.SelfAttention(256, 4, 2, dtype=torch.float32).eval()
    cache = layer.new_cache(1, 64, dtype=torch.float32)
    token = torch.randn(1, 1, 256, generator=g)

    def module_step():
        cache.seqlens.zero_()  # the same step each time
        with torch.no_grad():
            layer(token, cache)

    return {
        "decode, tensor lengths": lambda: decode(q, k_cache, v_cache, cache_seqlens=lengths, causal=True),
        "decode, int length": lambda: decode(q, k_cache, v_cache, cache_seqlens=300, causal=True),
        "decode, split": lambda: decode(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=4),
        "decode, left padding and cache rows": lambda: decode(
            q, k_cache, v_cache, cache_seqlens=lengths, cache_leftpad=i32(3, 0), cache_batch_idx=i32(2, 0)),
        "decode, appending": lambda: decode(q, k_cache, v_cache, new_k, new_v, cache_seqlens=lengths, causal=True),
        "decode, appending with rotary": lambda: decode(q, k_cache, v_cache, new_k, new_v, rotary_cos=cos,
                                                        rotary_sin=sin, cache_seqlens=lengths, causal=True),
        "decode, paged": lambda: decode(q, pages_k, pages_v, cache_seqlens=lengths, block_table=table),
        "decode, paged appending": lambda: decode(q, pages_k, pages_v, new_k, new_v, cache_seqlens=lengths,
                                                  block_table=table, causal=True),
        "varlen": lambda: flashattn.flash_attn_varlen_func(*packed, cu, cu, 99, 99, causal=True),
        "varlen, paged K/V": lambda: flashattn.flash_attn_varlen_func(
            packed[0], pages_k[..., :64], pages_v[..., :64], cu, i32(0, 100, 101, 300), 99, 200, causal=True,
            block_table=paged_table),
        "varlen training step": lambda: flashattn.flash_attn_varlen_func(*packed_trained, cu, cu, 99, 99,
                                                                         causal=True).sum().backward(),
        "forward": lambda: flashattn.flash_attn_func(*dense, causal=True),
        "training step": lambda: flashattn.flash_attn_func(*trained, causal=True).sum().backward(),
        "SDPA": lambda: flashattn.scaled_dot_product_attention(sdpa, sdpa, sdpa, is_causal=True),
        "block mask": lambda: flashattn.flash_attn_func(*blocked, block_mask=causal),
        "FP8 with descales": lambda: flashattn.flash_attn_func(*e4m3, q_descale=scales[0], k_descale=scales[1],
                                                               v_descale=scales[2]),
        "flashattn.nn decode step": module_step,
        "decode, appending to a float32 cache": lambda: decode(
            q.float(), k_cache.float(), v_cache.float(), new_k.float(), new_v.float(), cache_seqlens=lengths),
    }


def main() -> int:
    import flashattn
    import flashattn.nn
    from flashattn.backends.triton.stub import stubbed_launches

    failed = []
    with stubbed_launches(90), flashattn.use_backend("triton"):
        calls = _calls(flashattn)
        for name, call in calls.items():
            call()  # compiles its kernels and records its launch plan (no read there either, but not asserted)
            try:
                with no_host_reads():
                    call()
                    call()
            except HostRead as read:
                frames = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}"
                          for f in traceback.extract_tb(read.__traceback__)]
                failed.append(f"{name}: {read} (at {' <- '.join(reversed(frames[-4:]))})")
    # Small kernels launched directly (flashattn.backends.direct) reuse a binary only for the same argument kinds:
    # the float32 cache's append has its own, not the bfloat16 one's.
    from flashattn.backends import direct

    appends = {c.src.signature["k_cache"] for key, (c, *_) in direct._COMPILED.items()
               if c.name == "append_kernel" and key[-5:-2] == (2, 128, 128) and c.src.signature["table"] == "constexpr"}
    if appends != {"*bf16", "*fp32"}:  # the dense appends of 2 heads of 128 in bfloat16 and float32
        failed.append(f"the append kernel ran as compiled for {sorted(appends)}")
    # The guard itself: outside the stub, a CPU cache's lengths are read on the host (that is their check).
    try:
        with no_host_reads():
            calls["decode, tensor lengths"]()
        failed.append("the guard missed the host check of CPU lengths")
    except HostRead:
        pass
    for line in failed:
        print("FAILED", line)
    if not failed:
        print(f"calls without a host read: {len(calls)}")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    raise SystemExit(main())
