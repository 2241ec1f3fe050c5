"""The fast path of repeated CPU calls (``flashattn.fastpath`` with the cpu path's plans, ``backends/cpu.py``): a
signature seen before calls the kernel with the options decided the first time, and gives what the full way
gives, forward and backward; a changed tile switch, a forced path or a call the plans leave out takes the full
way."""

from __future__ import annotations

import pytest
import torch

import flashattn
from conftest import HAS_COMPILER
from flashattn import fastpath
from flashattn.backends import cpu, cpu_build, cpu_tiles

pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the C++ kernel cannot be built")


@pytest.fixture(autouse=True)
def fresh_entries():
    if not cpu_build.status()[0]:
        pytest.skip(f"the CPU kernel is not available ({cpu_build.status()[1]})")
    fastpath.clear()
    yield
    fastpath.clear()


def _inputs(dtype=torch.bfloat16, grad=False, nq=37, nk=70):
    torch.manual_seed(0)
    return [torch.randn(2, n, h, 40, dtype=dtype, requires_grad=grad) for n, h in ((nq, 4), (nk, 2), (nk, 2))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_repeated_call_replays_its_plan_and_gives_the_full_ways_result(dtype):
    q, k, v = _inputs(dtype)
    before = cpu.FORWARD_PLANS.replays
    full = flashattn.flash_attn_func(q, k, v, causal=True, window_size=(9, -1), softcap=3.0)  # learns the signature
    assert cpu.FORWARD_PLANS.replays == before
    fast = flashattn.flash_attn_func(q, k, v, causal=True, window_size=(9, -1), softcap=3.0)
    assert cpu.FORWARD_PLANS.replays == before + 1
    assert torch.equal(fast, full)
    out, lse, _ = flashattn.flash_attn_func(q, k, v, causal=True, window_size=(9, -1), softcap=3.0,
                                            return_attn_probs=True)  # a signature of its own: the full way
    out, lse, probs = flashattn.flash_attn_func(q, k, v, causal=True, window_size=(9, -1), softcap=3.0,
                                                return_attn_probs=True)
    assert cpu.FORWARD_PLANS.replays == before + 2 and probs is None
    assert torch.equal(out, full) and lse.shape == (2, 4, 37) and lse.dtype == torch.float32


def test_a_training_step_replays_the_forward_and_its_gradients_match():
    q, k, v = _inputs(grad=True)
    g = torch.randn(2, 37, 4, 40, dtype=torch.bfloat16)
    steps = []
    for _ in range(2):
        out = flashattn.flash_attn_func(q, k, v, causal=True)
        steps.append([out.detach(), *torch.autograd.grad(out, (q, k, v), g)])
    assert cpu.FORWARD_PLANS.replays >= 1
    for full, fast in zip(*steps, strict=True):
        assert torch.equal(fast, full)


def test_sdpa_calls_replay_too():
    q, k, v = (t.transpose(1, 2) for t in _inputs())
    before = cpu.FORWARD_PLANS.replays
    full = flashattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    fast = flashattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert cpu.FORWARD_PLANS.replays == before + 1 and torch.equal(fast, full)


def test_a_changed_tile_switch_or_a_forced_path_takes_the_full_way(monkeypatch):
    q, k, v = _inputs()
    for _ in range(2):
        flashattn.flash_attn_func(q, k, v)
    before = cpu.FORWARD_PLANS.replays
    monkeypatch.setenv(cpu_tiles.ENV, "fp32")
    with_fp32_tiles = flashattn.flash_attn_func(q, k, v)
    assert cpu.FORWARD_PLANS.replays == before
    monkeypatch.setenv(cpu_tiles.ENV, "bogus")  # the full way, whose check names the bad value
    with pytest.raises(ValueError, match="FLASHATTN_CPU_TILES='bogus'"):
        flashattn.flash_attn_func(q, k, v)
    monkeypatch.setenv(cpu_tiles.ENV, "fp32")
    assert torch.equal(flashattn.flash_attn_func(q, k, v), with_fp32_tiles)
    with flashattn.use_backend("torch"):
        for _ in range(2):
            flashattn.flash_attn_func(q, k, v)
    assert cpu.FORWARD_PLANS.replays == before + 1  # the fp32-tile signature's second call only


def test_calls_the_plans_leave_out_take_the_full_way_every_time():
    q, k, v = _inputs()
    before = cpu.FORWARD_PLANS.replays
    slopes = torch.rand(4)
    for _ in range(3):
        flashattn.flash_attn_func(q, k, v, alibi_slopes=slopes)  # a tensor option: never on the fast path
        flashattn.flash_attn_func(q, k, v, dropout_p=0.1)  # a fresh seed per call
        flashattn.flash_attn_func(q[:, :, :, ::2], k[:, :, :, ::2], v[:, :, :, ::2])  # rows the kernel copies
        flashattn.flash_attn_func(*(t.to(torch.float8_e4m3fn) for t in (q, k, v)))  # widened first
    assert cpu.FORWARD_PLANS.replays == before


def test_errors_are_raised_after_neighbouring_signatures_ran_fast():
    q, k, v = _inputs()
    for _ in range(2):
        flashattn.flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match="flash_attn_func"):
        flashattn.flash_attn_func(q, k[:, :, :, :32], v)
    with pytest.raises(ValueError, match="window_size"):
        flashattn.flash_attn_func(q, k, v, window_size=(-2, 0))


def test_the_plans_pass_the_options_in_the_operators_order():
    schema = cpu_build.module().forward.default._schema
    names = tuple(a.name for a in schema.arguments)
    assert names[5:5 + len(cpu.OPTION_NAMES)] == cpu.OPTION_NAMES
    assert all(not a.kwarg_only for a in schema.arguments[:5 + len(cpu.OPTION_NAMES)])


def _cache(paged=False, dtype=torch.bfloat16):
    torch.manual_seed(1)
    shape = (6, 16) if paged else (3, 96)  # 6 pages of 16 positions, or 3 rows of 96
    k_cache, v_cache = (torch.randn(*shape, 2, 40, dtype=dtype) for _ in range(2))
    q = torch.randn(2, 3, 4, 40, dtype=dtype)
    new = [torch.randn(2, 3, 2, 40, dtype=dtype) for _ in range(2)]
    return q, k_cache, v_cache, new


@pytest.mark.parametrize("kind", ["int", "int_append", "tensor", "append", "batch_idx", "leftpad", "paged", "window"])
def test_decode_steps_replay_and_give_the_full_ways_results(kind):
    q, k_cache, v_cache, new = _cache(paged=kind == "paged")
    kwargs = {"causal": True, "return_softmax_lse": True}
    if kind == "window":
        kwargs.update(window_size=(7, 0), softcap=2.0)
    if kind == "batch_idx":
        kwargs["cache_batch_idx"] = torch.tensor([2, 0], dtype=torch.int32)
    if kind == "leftpad":
        kwargs["cache_leftpad"] = torch.tensor([3, 0], dtype=torch.int32)
    if kind == "paged":
        kwargs["block_table"] = torch.tensor([[5, 1, 3], [0, 2, 4]], dtype=torch.int32)
    added = new if kind in ("int_append", "append", "paged", "leftpad", "batch_idx") else []
    host_lengths = kind in ("int", "int_append", "window")  # one int for every sequence
    rows = kwargs["cache_batch_idx"].tolist() if kind == "batch_idx" else [0, 1]

    def step(lengths, caches):
        seqlens = lengths if host_lengths else torch.tensor([lengths, lengths - 5], dtype=torch.int32)
        return flashattn.flash_attn_with_kvcache(q, *caches, *added, cache_seqlens=seqlens, **kwargs)

    before = cpu.FORWARD_PLANS.replays
    for lengths in (20, 33, 41):  # a growing cache: one signature
        full_caches = [k_cache.clone(), v_cache.clone()]
        fastpath.clear()
        out, lse = step(lengths, full_caches)  # the full way, which learns the signature
        fast_caches = [k_cache.clone(), v_cache.clone()]
        fast_out, fast_lse = step(lengths, fast_caches)
        assert torch.equal(fast_out, out) and torch.equal(fast_lse, lse)
        assert all(torch.equal(a, b) for a, b in zip(fast_caches, full_caches, strict=True))  # the same append
        if added and kind != "paged":  # sequence b's new rows at its length, in its cache row
            for b, (row, at) in enumerate(zip(rows, (lengths, lengths if host_lengths else lengths - 5), strict=True)):
                assert all(torch.equal(c[row, at:at + 3], n[b]) for c, n in zip(fast_caches, new, strict=True))
    assert cpu.FORWARD_PLANS.replays == before + 3


def _lengths(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_decode_values_out_of_range_are_refused_after_fast_steps():
    q, k_cache, v_cache, new = _cache()
    for _ in range(2):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, *new, cache_seqlens=_lengths(4, 9))
    with pytest.raises(ValueError, match="cache_seqlens"):  # 94 + 3 new keys > 96 positions
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, *new, cache_seqlens=_lengths(4, 94))
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, *new, cache_seqlens=_lengths(-1, 9))
    for _ in range(2):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=50)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=97)
