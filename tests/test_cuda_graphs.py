"""CUDA graphs: calls captured with ``torch.cuda.graph`` and replayed on new data equal eager calls (the launch plans
replay into the capturing stream, their allocations come from the graph's pool). Needs a GPU; skipped without one.

Capturable: ``flash_attn_func`` forward and forward + backward, ``flash_attn_with_kvcache`` with an int or tensor
``cache_seqlens`` (dense or paged, appending or not, left padding), ``flash_attn_varlen_func``: the index values of
a GPU call are checked on the GPU (``flashattn.checks.on_device``), so no call synchronises with the host, which
``torch.cuda.set_sync_debug_mode("error")`` proves here."""

from __future__ import annotations

import pytest
import torch

import flashattn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _captured(call, static_inputs: list[torch.Tensor]):
    """``call`` captured after warming up on a side stream (compiles, records its launch plan); returns
    (graph, static outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call(*static_inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = call(*static_inputs)
    return graph, outputs


def _replay_equals_eager(call, make_inputs, *, rtol=0.0, atol=0.0):
    static = make_inputs(0)
    graph, outputs = _captured(call, static)
    for seed in (1, 2):
        fresh = make_inputs(seed)
        with torch.no_grad():
            for s, f in zip(static, fresh, strict=True):
                s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        expected = call(*[f.detach().clone().requires_grad_(f.requires_grad) for f in fresh])
        for got, want in zip(outputs if isinstance(outputs, tuple) else (outputs,),
                             expected if isinstance(expected, tuple) else (expected,), strict=True):
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def _dense(seed, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(2, 256, h, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(grad)
            for h in (8, 2, 2)]


def test_forward_is_capturable():
    _replay_equals_eager(lambda q, k, v: flashattn.flash_attn_func(q, k, v, causal=True), _dense)


def test_forward_and_backward_are_capturable():
    def step(q, k, v):
        out = flashattn.flash_attn_func(q, k, v, causal=True)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))

    _replay_equals_eager(step, lambda seed: _dense(seed, grad=True))


@pytest.mark.parametrize("append", [False, True])
def test_decode_with_an_int_length_is_capturable(append):
    def make(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        new = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        return [new(2, 1, 8, 128), new(2, 1024, 2, 128), new(2, 1024, 2, 128), new(2, 1, 2, 128), new(2, 1, 2, 128)]

    def step(q, k_cache, v_cache, k, v):
        new = (k, v) if append else (None, None)
        return flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, *new, cache_seqlens=700, causal=True)

    _replay_equals_eager(step, make)


def _index_call(kind: str):
    """(call, make_inputs) of a call that takes index tensors, which change from one replay to the next."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    def i32(*values):
        return torch.tensor(values, dtype=torch.int32, device="cuda")

    if kind == "varlen":
        packed = [randn(300, h, 128) for h in (8, 2, 2)]
        cuts = ([0, 100, 300], [0, 170, 300], [0, 1, 300])
        call = lambda q, k, v, cu: flashattn.flash_attn_varlen_func(q, k, v, cu, cu, 299, 299, causal=True)  # noqa: E731
        return call, lambda seed: [*(p.clone() for p in packed), i32(*cuts[seed])]
    paged = "paged" in kind
    cache = [randn(16, 64, 2, 128) if paged else randn(2, 1024, 2, 128) for _ in range(2)]
    q, new = randn(2, 1, 8, 128), [randn(2, 1, 2, 128) for _ in range(2)] if "appending" in kind else [None, None]
    tables = [torch.randperm(16, device="cuda", generator=g).to(torch.int32).view(2, 8) for _ in range(3)]
    lengths = ([300, 200], [511, 17], [0, 400])

    def call(q, k_cache, v_cache, cache_seqlens, table, leftpad):
        return flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, *new, cache_seqlens=cache_seqlens,
                                                 block_table=table if paged else None,
                                                 cache_leftpad=leftpad if "padding" in kind else None, causal=True)

    return call, lambda seed: [q.clone(), *(c.clone() for c in cache), i32(*lengths[seed]), tables[seed].clone(),
                               i32(0, seed)]


INDEX_KINDS = ["tensor lengths", "tensor lengths, appending", "left padding", "paged", "paged, appending", "varlen"]


@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_calls_with_index_tensors_are_capturable(kind):
    """Their checks run on the GPU (no host read), so the graph replays them with the new lengths and pages."""
    call, make = _index_call(kind)
    _replay_equals_eager(call, make)


@pytest.mark.parametrize("kind", [*INDEX_KINDS, "forward and backward"])
def test_no_call_synchronises_with_the_host(kind):
    if kind == "forward and backward":
        def call(q, k, v):
            out = flashattn.flash_attn_func(q, k, v, causal=True)
            return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

        make = lambda seed: _dense(seed, grad=True)  # noqa: E731
    else:
        call, make = _index_call(kind)
    inputs = make(1)
    call(*inputs)  # compiles and records the launch plan
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


BAD_VALUE = """
import torch, flashattn
q = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
cache = torch.randn(2, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
lengths = torch.tensor([5, 200], dtype=torch.int32, device="cuda")
flashattn.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths)
torch.cuda.synchronize()
"""


def test_a_bad_length_stops_the_call_with_its_rule():
    """A length past the cache, given on the GPU, fails the device check: the process stops (as a bad index into
    a PyTorch CUDA op does) and the rule broken is printed."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", BAD_VALUE], capture_output=True, text=True, timeout=240)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "cache_seqlens[b] plus the new keys does not fit the cache" in done.stdout + done.stderr, done.stderr[-3000:]
