"""The ``cpu`` path's C++ kernel and the ``torch`` path that serves CPU calls where it cannot be built: every path on
odd shapes and features against the float64 oracle with the same-precision rule, gradients included (the backward
recomputes from the forward's lse); the cpu path against the torch path on everything else it serves; the build and
what happens when it fails."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from oracle import assert_close, attention_ref, check_against_oracle, feature_kwargs, make_inputs

import flashattn
from flashattn.backends import Request, cpu, cpu_build, explain, tiled
from flashattn.backends.spec import AttentionSpec, Saved

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (9, 4)},
    "softcap": {"softcap": 3.0, "causal": True},
    "alibi": {"alibi": True, "window_size": (20, 0)},
}
SHAPES = [  # (b, nq, nk, h, hk, d): odd lengths, q/k lengths that differ, GQA, odd head dims
    (2, 113, 77, 4, 2, 40),
    (1, 1, 1025, 4, 1, 59),
    (1, 300, 300, 2, 2, 96),
]


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_path_against_float64(path, feature, shape, dtype):
    b, nq, nk, h, hk, d = shape
    path.skip_if_declines(dtype, d)
    if path.interpreted:
        pytest.skip("Triton's interpreter runs these features in test_flash_api, on shapes sized for it")
    torch.manual_seed(0)
    q, k, v = path.put(*make_inputs(b, nq, nk, h, hk, d, dtype))
    kwargs = feature_kwargs(FEATURES[feature], b, h)
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = kwargs["alibi_slopes"].to(path.device)
    out = flashattn.flash_attn_func(q, k, v, **kwargs)
    check_against_oracle(q, k, v, kwargs, out, grads=nq < 1000)


def test_the_kernel_serves_dense_calls_here():
    """On a machine with a compiler (CI's has gcc) the kernel builds, and a dense call runs on it."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    built, detail = cpu_build.status()
    assert built, detail
    q, k, v = make_inputs(1, 7, 9, 2, 1, 16, torch.float32, requires_grad=False)
    spec = AttentionSpec(scale=0.25, window_right=0)
    assert cpu.serves(Request.of(q, k, v, spec)) is None
    assert explain(Request.of(q, k, v, spec))[0] == "cpu"
    out, lse, _ = cpu.forward(q, k, v, spec)
    ref, ref_lse = attention_ref(q, k, v, scale=0.25, causal=True)
    assert (out.double() - ref).abs().max() < 1e-5 and (lse.double() - ref_lse).abs().max() < 1e-5


def test_rows_that_see_no_key_give_zero_and_minus_inf(path):
    """Bottom-right causal with more queries than keys: the first rows see nothing (out 0, lse -inf, no NaN)."""
    q, k, v = path.put(*make_inputs(1, 10, 4, 2, 2, 8, torch.float32, requires_grad=False))
    out, lse, _ = flashattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert not torch.isnan(out).any()
    assert (out[:, :6] == 0).all() and torch.isneginf(lse[:, :, :6]).all() and torch.isfinite(lse[:, :, 6:]).all()


@pytest.mark.parametrize("reason", ["FLASHATTN_CPU_KERNEL=0", "a failed build"])
def test_the_torch_path_runs_when_the_kernel_cannot_be_built(reason, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("FLASHATTN_CACHE", str(tmp_path))  # a failed first load removes its build folder
    cpu_build._load.cache_clear()
    if reason == "a failed build":
        from torch.utils import cpp_extension

        def broken(**_):
            raise RuntimeError("Error building extension 'flashattn_cpu': c++: command not found")

        monkeypatch.setattr(cpp_extension, "load", broken)
    else:
        monkeypatch.setenv("FLASHATTN_CPU_KERNEL", "0")
    try:
        with caplog.at_level(logging.WARNING, logger="flashattn"):
            built, detail = cpu_build.status()
            q, k, v = make_inputs(1, 33, 33, 2, 2, 16, torch.float32)
            request = Request.of(q, k, v, AttentionSpec(scale=0.25))
            with flashattn.use_backend("cpu"):  # "cpu" keeps its older meaning: the kernel, else the torch path
                out = flashattn.flash_attn_func(q, k, v, causal=True)
                forced = explain(request)
            check_against_oracle(q, k, v, {"causal": True}, out)
            name, why = explain(request)
        assert not built and ("FLASHATTN_CPU_KERNEL" in detail if reason != "a failed build" else "c++" in detail)
        assert name == forced[0] == "torch" and "C++ kernel is not available" in why and detail in why
        warned = [r for r in caplog.records if "run on the torch path" in r.getMessage()]
        assert len(warned) == (1 if reason == "a failed build" else 0)
    finally:
        cpu_build._load.cache_clear()


def test_a_build_that_does_not_load_is_rebuilt(monkeypatch, tmp_path, caplog):
    """A library left broken in the cache (a killed build, a full disk) makes the import fail: the folder is removed
    and built again, not a crash and not the fallback for good. The build itself is stubbed: the first attempt
    leaves a broken library and fails as its import would, the second finds the folder gone."""
    monkeypatch.setenv("FLASHATTN_CACHE", str(tmp_path))
    seen = []

    def build(folder):
        seen.append(sorted(p.name for p in folder.glob("*")) if folder.exists() else None)
        if len(seen) == 1:
            folder.mkdir(parents=True)
            (folder / f"{folder.name}.so").write_bytes(b"not a shared library")
            raise ImportError(f"{folder.name}.so: invalid ELF header")
        return "module"

    monkeypatch.setattr(cpu_build, "_build", build)
    cpu_build._load.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="flashattn"):
            built, detail = cpu_build.status()
        assert built, detail
        assert seen == [None, None]  # the broken folder was removed before the second build
        assert any("rebuilding" in r.getMessage() for r in caplog.records)
    finally:
        cpu_build._load.cache_clear()


def test_the_first_build_says_what_it_builds_and_keeps_torchs_cuda_notice_out(monkeypatch, tmp_path, caplog):
    """The first call on a machine waits ~30 s for the build: one line says what, where and that it happens once;
    torch's "No CUDA runtime is found" (a CUDA build of torch on a machine without a GPU) is not shown for it. A
    cached build says nothing. The compiler is stubbed (``cpp_extension.load``)."""
    import torch.utils.cpp_extension as cpp_extension

    def load(name, build_directory, **kwargs):
        logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found, using CUDA_HOME='/x'")
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        raise RuntimeError("stub: nothing was compiled")

    monkeypatch.setattr(cpp_extension, "load", load)
    folder = tmp_path / "flashattn_cpu_test"
    for attempt in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO), pytest.raises(RuntimeError, match="stub"):
            cpu_build._build(folder)
        said = [r.getMessage() for r in caplog.records]
        assert not any("No CUDA runtime" in m for m in said), said
        building = [m for m in said if "building the C++ CPU kernel" in m]
        assert len(building) == (1 if attempt == 0 else 0), said
        if building:
            assert str(folder) in building[0] and "once per CPU and torch version" in building[0]


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_one(monkeypatch, tmp_path, caplog):
    """cpp_extension marks a build with a lock file and waits, forever, while one exists: a process killed while
    building (Ctrl-C, the OOM killer, a timeout) left one that hung every later first call on the machine. Under the
    build's own flock nobody else is building, so such a file is stale and removed. The compiler is stubbed: it
    fails where cpp_extension would wait."""
    import torch.utils.cpp_extension as cpp_extension

    def load(name, build_directory, **kwargs):
        if (Path(build_directory) / "lock").exists():
            raise AssertionError("cpp_extension would wait here for ever")
        (Path(build_directory) / f"{name}.so").write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(cpu_build.torch.ops, "flashattn_cpu_stale", SimpleNamespace(forward=1, backward=2, engines=3),
                        raising=False)
    folder = tmp_path / "flashattn_cpu_stale"
    folder.mkdir()
    (folder / "lock").touch()  # what the killed build left
    with caplog.at_level(logging.INFO, logger="flashattn"):
        assert cpu_build._build(folder).engines == 3
    assert not (folder / "lock").exists()
    assert any("left by a build that did not finish" in r.getMessage() for r in caplog.records)


def test_what_the_cpu_path_declines_it_says_why_and_the_torch_path_serves():
    q = k = v = torch.zeros(1, 4, 2, 8)
    probs = Request.of(q, k, v, AttentionSpec(scale=1.0), return_probs=True)
    assert "probabilities" in cpu.serves(probs)
    assert explain(probs) == ("torch", "auto: cpu declines: " + cpu.serves(probs) + "; torch (tiled PyTorch) serves it")
    assert "CPU tensors" in cpu.serves(Request("cuda", torch.float32, 8, 8))
    assert "float16, bfloat16" in cpu.serves(Request("cpu", torch.int8, 8, 8))


def test_a_strided_head_dim_is_served(path):
    """SDPA accepts any strides: a head dim with a stride (which the C++ kernel copies) gives the same result."""
    q, k = path.put(*(torch.randn(1, 12, 2, 8) for _ in range(2)))
    v = path.put(torch.randn(1, 12, 2, 16))[0][..., ::2]
    assert v.stride(-1) == 2
    out = flashattn.flash_attn_func(q, k, v, causal=True)
    ref, _ = attention_ref(q, k, v, causal=True)
    assert (out.double() - ref).abs().max() < 1e-5


def test_the_kernel_keeps_the_callers_grad_and_inference_modes():
    """The region's threads take the caller's modes: under inference_mode (the demo's timing) and with inputs
    that require grad outside the op (the distributed blocks) the kernel runs."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    q, k, v = make_inputs(1, 130, 300, 2, 1, 16, torch.float32)
    spec = AttentionSpec(scale=0.25)
    out, _, _ = cpu.forward(q, k, v, spec)
    with torch.inference_mode():
        q2, k2, v2 = (t.detach().clone() for t in (q, k, v))
        out2, _, _ = cpu.forward(q2, k2, v2, spec)
    assert torch.equal(out, out2) and not out.requires_grad


def _both_paths(fn, *tensors):
    """fn(*tensors) on the cpu and on the torch path: (outputs, input gradients) of each, same upstream grads."""
    results = []
    for name in ("cpu", "torch"):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point() and t.requires_grad) for t in tensors]
        with flashattn.use_backend(name):
            torch.manual_seed(7)  # dropout's seed
            out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        diff = [o for o in outs if o.requires_grad]
        grads = torch.autograd.grad(diff, [t for t in leaves if t.requires_grad],
                                    [torch.ones_like(o).mul_(0.5).add_(o.detach().sin()) for o in diff])
        results.append(([o.detach() for o in outs], grads))
    return results


def _assert_paths_agree(results, tol):
    (outs_k, grads_k), (outs_t, grads_t) = results
    for a, b in zip([*outs_k, *grads_k], [*outs_t, *grads_t], strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert not torch.isnan(a).any()
        both_inf = torch.isinf(a) & torch.isinf(b)
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        assert (a.double() - b.double()).masked_fill(both_inf, 0).abs().max() <= tol * max(1.0, b.abs().max())


FEATURE_CALLS = {  # a call per feature the kernel serves beyond the dense forward, over (q, k, v) of (2, 70, 4, 24)
    "dropout": lambda q, k, v: flashattn.flash_attn_func(q, k, v, dropout_p=0.3, causal=True),
    "dropout varlen": lambda q, k, v: flashattn.flash_attn_varlen_func(
        q.flatten(0, 1), k.flatten(0, 1)[:130], v.flatten(0, 1)[:130], torch.tensor([0, 70, 140], dtype=torch.int32),
        torch.tensor([0, 3, 130], dtype=torch.int32), 70, 127, dropout_p=0.2),
    "varlen window": lambda q, k, v: flashattn.flash_attn_varlen_func(
        q.flatten(0, 1)[:120], k.flatten(0, 1), v.flatten(0, 1), torch.tensor([0, 0, 50, 120], dtype=torch.int32),
        torch.tensor([0, 40, 41, 140], dtype=torch.int32), 70, 99, window_size=(16, 3), softcap=2.0),
    "bool mask": lambda q, k, v: flashattn.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=torch.rand(2, 1, 70, 70, generator=torch.Generator().manual_seed(3)) > 0.3),
    "additive mask with its gradient": lambda q, k, v, m: flashattn.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m),
    "lse": lambda q, k, v: flashattn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2],
}


@pytest.mark.parametrize("feature", FEATURE_CALLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_and_the_torch_path_agree(feature, dtype):
    """The C++ kernel against the torch path (itself held to the float64 oracle elsewhere): outputs, lse and every input
    gradient, dropout dropping exactly the same elements (one counter-based generator)."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    torch.manual_seed(0)
    q, k, v = make_inputs(2, 70, 70, 4, 4, 24, dtype)
    tensors = [q, k, v]
    if feature.startswith("additive"):
        tensors.append(torch.randn(1, 4, 70, 1, dtype=dtype, requires_grad=True))
    results = _both_paths(FEATURE_CALLS[feature], *tensors)
    _assert_paths_agree(results, 2e-5 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("paged", [False, True], ids=["dense cache", "paged cache"])
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_kv_cache_calls_agree_on_both_paths(paged, seqlen_q):
    """Decode and short prefill against a cache (GQA 8:1, lengths and left padding per entry, batch_idx, pages of
    5): the kernel packs the group's query heads into one block; the torch path runs each entry separately."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    torch.manual_seed(0)
    b, n_cache, hk, d = 3, 40, 1, 16
    q = torch.randn(b, seqlen_q, 8, d)
    k_cache, v_cache = torch.randn(b + 1, n_cache, hk, d), torch.randn(b + 1, n_cache, hk, d)
    kwargs = {"cache_seqlens": torch.tensor([40, 7, 23], dtype=torch.int32), "causal": True,
              "cache_leftpad": torch.tensor([0, 2, 5], dtype=torch.int32), "return_softmax_lse": True}
    if paged:
        pages = torch.randperm(4 * n_cache // 5)[: b * n_cache // 5].view(b, -1).int()
        paged_k, paged_v = torch.randn(4 * n_cache // 5, 5, hk, d), torch.randn(4 * n_cache // 5, 5, hk, d)
        for i in range(b):
            paged_k[pages[i].long()] = k_cache[i].view(-1, 5, hk, d)
            paged_v[pages[i].long()] = v_cache[i].view(-1, 5, hk, d)
        k_cache, v_cache = paged_k, paged_v
        kwargs["block_table"] = pages
    else:
        kwargs["cache_batch_idx"] = torch.tensor([3, 0, 1], dtype=torch.int32)
    results = []
    for name in ("cpu", "torch"):
        with flashattn.use_backend(name):
            results.append(flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs))
    for a, b_ in zip(*results, strict=True):
        assert not torch.isnan(a).any() and (a - b_).abs().max() < 2e-6


def test_a_gradient_into_lse_reaches_the_kernels_backward():
    """dlse folds into delta: the kernel's backward with a gradient on lse only matches the torch path's, with lse
    and dlse strided differently."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    torch.manual_seed(0)
    q, k, v = make_inputs(1, 50, 60, 4, 2, 16, torch.float64, requires_grad=False)
    spec = AttentionSpec(scale=0.25, window_right=0)
    out, lse, _ = cpu.forward(q, k, v, spec)
    # lse and dlse as views of longer rows (how context parallelism passes a block's share): strides differ.
    longer = torch.full((1, 4, 90), float("nan"), dtype=lse.dtype)
    longer[:, :, 20:70] = lse
    lse = longer[:, :, 20:70]
    dout, dlse = torch.zeros_like(out), torch.randn(1, 4, 100, dtype=lse.dtype)[:, :, 30:80]
    grads = [path.backward(dout, dlse, Saved(q, k, v, out, lse), spec)[:3] for path in (cpu, tiled)]
    for a, b in zip(*grads, strict=True):
        assert (a - b).abs().max() < 1e-12
    assert grads[0][0].abs().max() > 0 and grads[0][1].abs().max() > 0  # dv = P^T dO is 0 here


@pytest.mark.parametrize(("softcap", "bad"), [(0.0, float("-inf")), (50.0, float("nan"))],
                         ids=["fused pass", "softcap's pass"])
def test_a_nan_score_dropped_by_dropout_still_makes_its_row_nan(softcap, bad):
    """A key element of -inf gives some rows a +inf score (a NaN weight), of NaN every row a NaN score (softcap
    would turn an infinite score finite). Where dropout drops that weight the row must still come out NaN, as on
    the torch path, never 0 (a row that saw no key)."""
    if not cpu_build.status()[0]:
        pytest.skip("the C++ kernel is not built here")
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 300, 2, 64), torch.randn(1, 640, 2, 64), torch.randn(1, 640, 2, 64)
    k[0, 300, 1, 2] = bad
    nan_rows = {}
    for name in ("cpu", "torch"):
        with flashattn.use_backend(name):
            torch.manual_seed(7)
            out = flashattn.flash_attn_func(q, k, v, dropout_p=0.3, softcap=softcap)[0, :, 1]
        nan_rows[name] = torch.isnan(out).any(-1)
    assert nan_rows["torch"].sum() > 0
    assert torch.equal(nan_rows["cpu"], nan_rows["torch"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["wide scores", "steep alibi"])
def test_weights_under_2_to_the_minus_126_match_float64(dtype, case):
    """Weights under 2^-126, which the kernel flushes to zero (``cpu_fpenv.h``): scores spread over tens of nats
    (the plain fused pass; 1.5 % of the weights underflow) or ALiBi slopes of 1.5 and 3 over 300 keys (the other
    forward pass and the backward's; 65-81 %). out and the gradients still match the float64 oracle under the
    same-precision rule."""
    if not cpu_build.status()[0]:
        pytest.skip("the C++ kernel is not built here")
    torch.manual_seed(0)
    q, k, v = make_inputs(1, 300, 300, 2, 2, 64, torch.float32, requires_grad=False)
    spread = 4.0 if case == "wide scores" else 1.0
    q, k, v = ((t * s).to(dtype).requires_grad_() for t, s in ((q, spread), (k, spread), (v, 1.0)))
    extra = {} if case == "wide scores" else {"alibi_slopes": torch.tensor([[1.5, 3.0]])}
    for kwargs in ({**extra}, {**extra, "causal": True}):
        out = flashattn.flash_attn_func(q, k, v, **kwargs)
        check_against_oracle(q, k, v, kwargs, out)


@pytest.mark.parametrize("flush", [False, True])
def test_a_call_leaves_the_callers_subnormal_mode_as_it_was(flush):
    """The kernel flushes subnormals inside its parallel regions alone: after a forward and a backward the calling
    thread computes a subnormal product as before the call, and keeps flushing it if it asked to."""
    if not cpu_build.status()[0]:
        pytest.skip("the C++ kernel is not built here")
    if not torch.set_flush_denormal(flush):
        pytest.skip("this CPU has no flush-to-zero mode for torch to set")
    try:
        q, k, v = make_inputs(1, 64, 64, 2, 2, 32, torch.float32)
        flashattn.flash_attn_func(q, k, v, causal=True).sum().backward()
        tiny = torch.tensor([1e-39], dtype=torch.float32)  # subnormal
        assert ((tiny * 0.5).item() == 0.0) == flush
    finally:
        torch.set_flush_denormal(False)


def test_a_row_that_sees_only_a_nan_score_is_nan():
    """A row whose mask leaves it one key, whose score is NaN, comes out NaN, not as a row that saw nothing: the
    maximum of a tile's -inf scores still looks for a NaN among them, in every vector of them. (torch's SDPA adds
    the mask to the scores, so a NaN key there makes every row NaN; ours selects, so only the rows that see it.)"""
    if not cpu_build.status()[0]:
        pytest.skip("the C++ kernel is not built here")
    torch.manual_seed(0)
    n = 64
    q, k, v = (torch.randn(1, 2, n, 32) for _ in range(3))
    k[0, :, 35] = float("nan")  # in the third 16-key vector of the row
    mask = torch.zeros(1, 1, n, n, dtype=torch.bool)
    mask[0, 0, torch.arange(n), torch.arange(n) % 40] = True  # row i sees key i % 40 alone
    nan_rows = torch.isnan(flashattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)).any(-1)
    expected = torch.zeros(1, 2, n, dtype=torch.bool)
    expected[..., 35] = True
    assert torch.equal(nan_rows, expected)


def _hiding_mask(case: str) -> tuple[tuple[int, int, int, int, int], torch.Tensor]:
    """((B, Nq, Nk, H, Hk), a boolean mask) that hides whole 256-key tiles from some query blocks but not others."""
    if case == "key padding":  # sequence 0 sees 200 keys, sequence 1 600: tiles past them hidden
        b, nq, nk, h, hk = 2, 300, 700, 2, 2
        mask = torch.arange(nk)[None, None, None, :] < torch.tensor([200, 600])[:, None, None, None]
    elif case == "first row of each block":  # row i sees every key unless i % 128 == 0 (which sees none)
        b, nq, nk, h, hk = 1, 300, 700, 2, 2
        mask = (torch.arange(nq) % 128 != 0)[None, None, :, None].expand(1, 1, nq, nk)
    else:  # "per head, decode": kv head 0's query heads see keys < 256 only, kv head 1's all of them
        b, nq, nk, h, hk = 2, 2, 1000, 4, 2
        mask = torch.ones(1, h, nq, nk, dtype=torch.bool)
        mask[:, :2, :, 256:] = False
    return (b, nq, nk, h, hk), mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["key padding", "first row of each block", "per head, decode"])
def test_key_tiles_a_boolean_mask_hides_are_skipped_exactly(case, dtype):
    """The forward and the backward skip a key tile that a boolean mask hides from every row of a query block
    (Problem::for_each_tile, mask_hides): out, lse and the gradients stay those of float64 attention, also where
    only the block's other rows, or another kv head of a decode task, see the tile; rows that see no key give 0."""
    if not cpu_build.status()[0]:
        pytest.skip("the C++ kernel is not built here")
    torch.manual_seed(0)
    (b, nq, nk, h, hk), mask = _hiding_mask(case)
    q, k, v = make_inputs(b, nq, nk, h, hk, 64, dtype)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out = flashattn.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    ref, _ = attention_ref(q, k, v, mask=mask)
    base, _ = attention_ref(q, k, v, mask=mask, upcast=False)
    assert_close("out", out, ref, base)
    g = torch.randn_like(out)
    ours, want, plain = (torch.autograd.grad(o, (q, k, v), g.to(o.dtype)) for o in (out, ref, base))
    magnitude = max(w.abs().max().item() for w in want)
    for name, x, w, bl in zip(("dq", "dk", "dv"), ours, want, plain, strict=True):
        assert_close(name, x, w, bl, factor=3.0, magnitude=magnitude, precision=dtype)
    if case == "first row of each block":
        assert (out[0, ::128] == 0).all()
