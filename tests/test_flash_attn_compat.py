"""Code written for flash_attn runs on flashattn after ``install_as_flash_attn()``: every name imported from
``flash_attn``, ``flash_attn.flash_attn_interface``, ``flash_attn.bert_padding`` and ``flash_attn.layers.rotary``,
the ``torch.ops.flash_attn`` ops (eager and under ``torch.compile(fullgraph=True)``), errors that are both
ValueError and RuntimeError, and the refusal to shadow a real flash_attn."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest
import torch

import flashattn

flashattn.install_as_flash_attn()

import flash_attn  # noqa: E402  (resolves to flashattn after the call above)
from flash_attn import bert_padding  # noqa: E402
from flash_attn import flash_attn_interface as fai  # noqa: E402
from flash_attn.layers import rotary  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _qkv(b=2, nq=37, nk=37, h=4, hk=2, d=40, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, n, heads, d, generator=g, dtype=dtype) for n, heads in ((nq, h), (nk, hk), (nk, hk)))


def test_modules_resolve_to_flashattn_and_install_is_idempotent():
    flashattn.install_as_flash_attn()  # again: nothing changes
    assert sys.modules["flash_attn"] is flash_attn and flash_attn.flash_attn_interface is fai
    assert sys.modules["flash_attn.layers.rotary"] is rotary and flash_attn.bert_padding is bert_padding
    assert flash_attn.__version__.startswith("2.8.4+flashattn.")
    from packaging.version import Version

    assert Version(flash_attn.__version__) >= Version("2.6.3")  # what version checks downstream compare
    for name in ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
                 "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
                 "flash_attn_with_kvcache"):
        ours = getattr(flash_attn, name)
        assert ours is getattr(fai, name)
        # flashattn's own function, or (where it returns S_dmask) that function handing S_dmask out scaled as
        # flash_attn's kernels store it (test_s_dmask_reads_back_as_flash_attns_tests_read_it).
        assert getattr(ours, "__wrapped__", ours) is getattr(flashattn, name)
        assert inspect.signature(ours) == inspect.signature(getattr(flashattn, name))


def test_refuses_to_shadow_a_real_flash_attn_unless_forced(tmp_path):
    fake = tmp_path / "flash_attn"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '2.8.3'\n")
    script = textwrap.dedent("""
        import sys, flashattn
        try:
            flashattn.install_as_flash_attn()
        except RuntimeError as err:
            print("refused:", err)
        flashattn.install_as_flash_attn(force=True)
        import flash_attn
        from flash_attn.flash_attn_interface import _flash_attn_forward
        print("forced:", flash_attn.__version__)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert "refused: install_as_flash_attn: a real flash_attn is installed at" in done.stdout
    assert str(fake) in done.stdout and "force=True" in done.stdout
    assert "forced: 2.8.4+flashattn." in done.stdout


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(37, 37), (1, 50), (64, 19)])
def test_private_forward_and_backward_equal_the_public_functions(causal, nq, nk):
    q, k, v = _qkv(nq=nq, nk=nk)
    scale = 0.3
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(q, k, v, 0.0, scale, causal, -1, -1, 0.0, None, False)
    ref_out, ref_lse, _ = flashattn.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal,
                                                    return_attn_probs=True)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    assert s_dmask.numel() == 0 and rng_state.shape == (2,) and rng_state.dtype == torch.int64

    dout = torch.randn_like(out)
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    flashattn.flash_attn_func(q_, k_, v_, softmax_scale=scale, causal=causal).backward(dout)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))  # poisoned: every element is written
    softmax_d = fai._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal, -1, -1, 0.0, None,
                                         False, rng_state)
    for got, want in ((dq, q_.grad), (dk, k_.grad), (dv, v_.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert softmax_d.shape == (2, 4, 128)  # flash_attn pads seqlen_q to a multiple of 128
    torch.testing.assert_close(softmax_d[..., :nq], (dout * out).sum(-1).transpose(1, 2))


def test_dropout_through_rng_state_and_s_dmask():
    q, k, v = _qkv(nq=20, nk=24, d=16)
    torch.manual_seed(7)
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(q, k, v, 0.25, 0.25, False, -1, -1, 0.0, None, True)
    assert s_dmask.shape == (2, 4, 128, 128) and int(rng_state[0]) != 0
    torch.manual_seed(7)  # the public function draws the same dropout key
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, _, ref_dmask = flash_attn.flash_attn_func(q_, k_, v_, 0.25, 0.25, return_attn_probs=True)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(s_dmask[:, :, :20, :24], ref_dmask, rtol=0, atol=0)
    dout = torch.randn_like(out)
    ref_out.backward(dout)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    fai._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.25, 0.25, False, -1, -1, 0.0, None, False,
                             rng_state)
    for got, want in ((dq, q_.grad), (dk, k_.grad), (dv, v_.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="rng_state"):
        fai._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.25, 0.25, False, -1, -1, 0.0, None, False)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("causal", [False, True])
def test_s_dmask_reads_back_as_flash_attns_tests_read_it(dropout_p, causal):
    """flash_attn's kernels store S_dmask per block of ``_get_block_size_n`` keys as exp(score - running max of
    the row when that block was reached, walking from the last block); its tests recover the weights by multiplying
    each block by exp(that max - lse). Under flash_attn's names the same recovery gives flashattn's weights, with
    dropout's sign; flashattn's own functions give the weights directly."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, n, 3, 40, dtype=torch.float64) for n in (37, 150, 150))
    torch.manual_seed(11)
    _, lse, scaled = flash_attn.flash_attn_func(q, k, v, dropout_p, causal=causal, return_attn_probs=True)
    torch.manual_seed(11)
    _, _, weights = flashattn.flash_attn_func(q, k, v, dropout_p, causal=causal, return_attn_probs=True)
    if dropout_p == 0:
        assert scaled is weights is None  # as flash_attn: no S_dmask without dropout
        return
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 40**0.5
    if causal:
        scores = scores.masked_fill(torch.ones(37, 150, dtype=torch.bool).triu(150 - 37 + 1), float("-inf"))
    block = fai._get_block_size_n(q.device, 40, True, causal)
    maxima = torch.stack([s.amax(-1) for s in scores.split(block, -1)], -1)
    running = maxima.flip(-1).cummax(-1).values.flip(-1)
    read = torch.cat([s * torch.exp(m - lse).unsqueeze(-1)
                      for s, m in zip(scaled.split(block, -1), running.unbind(-1), strict=True)], -1)
    torch.testing.assert_close(read, weights, rtol=1e-9, atol=1e-12)
    assert torch.equal(torch.signbit(scaled), torch.signbit(weights))


def _varlen_case(seed=0, d=32):
    g = torch.Generator().manual_seed(seed)
    lens_q, lens_k = [5, 1, 13], [7, 9, 13]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, d, generator=g)
    k, v = (torch.randn(sum(lens_k), 2, d, generator=g) for _ in range(2))
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


def test_private_varlen_forward_and_backward():
    q, k, v, cu_q, cu_k, mq, mk = _varlen_case()
    out, lse, _, rng = fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, 0.2, True)
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse, _ = flashattn.flash_attn_varlen_func(q_, k_, v_, cu_q, cu_k, mq, mk, softmax_scale=0.2,
                                                           causal=True, return_attn_probs=True)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    dout = torch.randn_like(out)
    ref_out.backward(dout)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    softmax_d = fai._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, mq, mk, 0.0, 0.2,
                                                True, -1, -1, 0.0, None, False, rng)
    for got, want in ((dq, q_.grad), (dk, k_.grad), (dv, v_.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert softmax_d.shape == (4, q.shape[0] + 128 * 3)
    delta = (dout * out).sum(-1).T  # (H, total_q); flash_attn puts sequence b's rows at cu_seqlens_q[b] + 128 b
    for b in range(3):
        start, stop = int(cu_q[b]), int(cu_q[b + 1])
        torch.testing.assert_close(softmax_d[:, start + 128 * b : stop + 128 * b], delta[:, start:stop])


def test_private_varlen_forward_with_seqused_and_leftpad_k():
    q, k, v, cu_q, cu_k, mq, mk = _varlen_case(seed=1)
    seqused, leftpad = torch.tensor([6, 2, 13], dtype=torch.int32), torch.tensor([1, 0, 4], dtype=torch.int32)
    out, *_ = fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, 0.2, False, seqused_k=seqused,
                                             leftpad_k=leftpad)
    for b in range(3):  # sequence b attends to its keys [leftpad, seqused)
        keys = slice(int(cu_k[b] + leftpad[b]), int(cu_k[b] + seqused[b]))
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        want = flashattn.flash_attn_func(q[None, rows], k[None, keys], v[None, keys], softmax_scale=0.2)[0]
        torch.testing.assert_close(out[rows], want, rtol=1e-6, atol=1e-6)


def test_the_ops_are_registered_under_flash_attn_and_compile_fullgraph():
    q, k, v = _qkv(nq=16, nk=16, d=32)
    assert fai._wrapped_flash_attn_forward is torch.ops.flash_attn._flash_attn_forward
    for name in ("_flash_attn_forward", "_flash_attn_varlen_forward", "_flash_attn_backward",
                 "_flash_attn_varlen_backward"):
        assert hasattr(torch.ops.flash_attn, name)

    def step(q, k, v, dout):
        out, lse, _, rng = torch.ops.flash_attn._flash_attn_forward(q, k, v, 0.0, 0.25, True, -1, -1, 0.0, None,
                                                                    False)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        torch.ops.flash_attn._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.25, True, -1, -1, 0.0,
                                                  None, False, rng)
        return out, dq, dk, dv

    dout = torch.randn(2, 16, 4, 32)
    eager = step(q, k, v, dout)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, dout)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_defaults_read_as_ring_flash_attention_reads_them():
    """ring-flash-attention builds its calls from the ops' defaults: getfullargspec(op._init_fn), then **params."""
    import inspect

    def get_default_args(func):
        spec = inspect.getfullargspec(func._init_fn if hasattr(func, "_init_fn") else func)
        defaults = spec.defaults if spec.defaults is not None else ()
        args = dict(zip(spec.args, (None,) * (len(spec.args) - len(defaults)) + defaults, strict=True))
        if "softcap" in args:
            args["softcap"] = 0.0
        return args

    q, k, v = _qkv(nq=12, nk=12, d=16)
    params = get_default_args(fai._flash_attn_forward)
    assert list(params)[:4] == ["q", "k", "v", "dropout_p"] and params["return_softmax"] is None
    params.update(q=q, k=k, v=v, dropout_p=0.0, softmax_scale=0.25, causal=True, window_size_left=-1,
                  window_size_right=-1, alibi_slopes=None, return_softmax=False)
    out, lse, _, _ = fai._flash_attn_forward(**params)
    torch.testing.assert_close(out, flashattn.flash_attn_func(q, k, v, softmax_scale=0.25, causal=True))
    params = get_default_args(fai._flash_attn_backward)
    assert params["rng_state"] is None and "dq" in params
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    params.update(dout=torch.ones_like(out), q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                  dropout_p=0.0, softmax_scale=0.25, causal=True, window_size_left=-1, window_size_right=-1,
                  alibi_slopes=None, deterministic=False)
    fai._flash_attn_backward(**params)
    assert torch.isfinite(dq).all() and dq.abs().sum() > 0


def test_autograd_function_names_apply_positionally():
    q, k, v = _qkv(nq=9, nk=9, d=16)
    out = fai.FlashAttnFunc.apply(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, False, True)
    torch.testing.assert_close(out, flashattn.flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)
    qkv = torch.stack((q, q, q), dim=2)
    out = fai.FlashAttnQKVPackedFunc.apply(qkv, 0.0, None, False, (-1, -1), 0.0, None, False, True, True)
    assert out[0].shape == q.shape and out[1].shape == (2, 4, 9)
    leaf = q.clone().requires_grad_()
    assert fai.FlashAttnFunc.apply(leaf, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, False, True).requires_grad
    assert not fai.FlashAttnFunc.apply(leaf, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, False,
                                       False).requires_grad  # is_grad_enabled=False records no graph
    assert fai.maybe_contiguous(q.transpose(1, 3)).is_contiguous() and fai.round_multiple(130, 128) == 256
    assert fai._get_block_size_n(q.device, 64, False, True) == 128
    assert fai._get_block_size_n(q.device, 128, True, False) == 64
    kv = torch.stack((k, v), dim=2)
    out = fai.FlashAttnKVPackedFunc.apply(q, kv, 0.0, None, True, (-1, -1), 0.0, None, False, False, True)
    torch.testing.assert_close(out, flashattn.flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)
    vq, vk, vv, cu_q, cu_k, mq, mk = _varlen_case()
    want = flashattn.flash_attn_varlen_func(vq, vk, vv, cu_q, cu_k, mq, mk, causal=True)
    got = fai.FlashAttnVarlenFunc.apply(vq, vk, vv, cu_q, cu_k, mq, mk, 0.0, None, True, (-1, -1), 0.0, None, False,
                                        False, None, True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got = fai.FlashAttnVarlenKVPackedFunc.apply(vq, torch.stack((vk, vv), 1), cu_q, cu_k, mq, mk, 0.0, None, True,
                                                (-1, -1), 0.0, None, False, False, True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    packed = torch.stack((vq, vq, vq), 1)
    got = fai.FlashAttnVarlenQKVPackedFunc.apply(packed, cu_q, mq, 0.0, None, True, (-1, -1), 0.0, None, False, False,
                                                 True)
    torch.testing.assert_close(got, flashattn.flash_attn_varlen_func(vq, vq, vq, cu_q, cu_q, mq, mq, causal=True),
                               rtol=0, atol=0)
    for name in ("_wrapped_flash_attn_varlen_forward", "_wrapped_flash_attn_backward",
                 "_wrapped_flash_attn_varlen_backward"):
        assert getattr(fai, name) is getattr(torch.ops.flash_attn, name.removeprefix("_wrapped"))


def test_errors_are_value_and_runtime_errors_naming_function_argument_and_value():
    q, k, v = _qkv()
    with pytest.raises(RuntimeError) as caught:  # flash_attn's C++ checks raise RuntimeError
        fai._flash_attn_forward(q, k[..., :8], v, 0.0, 0.2, False, -1, -1, 0.0, None, False)
    assert isinstance(caught.value, ValueError)
    assert "_flash_attn_forward: head dims differ: q has 40, k has 8" in str(caught.value)
    with pytest.raises(RuntimeError) as caught:  # a dtype: a TypeError and a RuntimeError
        flash_attn.flash_attn_func(q.to(torch.int32), k, v)
    assert isinstance(caught.value, TypeError) and "q has dtype torch.int32" in str(caught.value)
    vq, vk, vv, cu_q, cu_k, mq, mk = _varlen_case()
    with pytest.raises(ValueError, match="cu_seqlens_k"):  # an index out of range
        fai._flash_attn_varlen_forward(vq, vk, vv, cu_q, cu_k * 5, mq, mk, 0.0, 0.2, False)
    cache = torch.randn(4, 8, 2, 32)
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn.flash_attn_varlen_func(vq, cache, cache, cu_q, cu_k, mq, mk,
                                          block_table=torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match=r"indices must lie in \[0, 5\)"):
        bert_padding.index_first_axis(torch.randn(5, 3), torch.tensor([0, 7]))


def test_padded_batch_through_bert_padding_and_varlen_equals_dense_per_sequence():
    g = torch.Generator().manual_seed(3)
    batch, seqlen, h, d = 3, 11, 4, 32
    lengths = [11, 4, 7]
    mask = torch.arange(seqlen)[None] < torch.tensor(lengths)[:, None]
    q, k, v = (torch.randn(batch, seqlen, h, d, generator=g, requires_grad=True) for _ in range(3))
    (pq, indices, cu, max_len, used), (pk, *_), (pv, *_) = (bert_padding.unpad_input(t, mask) for t in (q, k, v))
    assert cu.tolist() == [0, 11, 15, 22] and max_len == 11 and used.tolist() == lengths
    out = bert_padding.pad_input(flash_attn.flash_attn_varlen_func(pq, pk, pv, cu, cu, max_len, max_len, causal=True),
                                 indices, batch, seqlen)
    for b, n in enumerate(lengths):
        want = flashattn.flash_attn_func(q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n], causal=True)[0]
        torch.testing.assert_close(out[b, :n], want, rtol=1e-6, atol=1e-6)
        assert out[b, n:].eq(0).all()
    out.sum().backward()
    assert q.grad[~mask].eq(0).all() and q.grad[mask].ne(0).any()


def test_bert_padding_index_helpers():
    x = torch.randn(6, 3, requires_grad=True)
    idx = torch.tensor([4, 0, 2])
    picked = bert_padding.index_first_axis(x, idx)
    assert torch.equal(picked, x[idx]) and torch.equal(bert_padding.IndexFirstAxis.apply(x, idx), picked)
    placed = bert_padding.index_put_first_axis(picked, idx, 6)
    assert torch.equal(placed[idx], picked) and placed[[1, 3, 5]].eq(0).all()
    assert torch.equal(bert_padding.IndexPutFirstAxis.apply(picked, idx, 6), placed)
    placed.sum().backward()
    assert x.grad[idx].eq(1).all() and x.grad[[1, 3, 5]].eq(0).all()
    x.grad = None
    out, residual = bert_padding.index_first_axis_residual(x, idx)
    assert torch.equal(out, x[idx]) and torch.equal(residual, x) and residual.data_ptr() == x.data_ptr()
    (out.sum() + residual.sum()).backward()  # both outputs' gradients reach x, as in flash_attn's Function
    assert x.grad[idx].eq(2).all() and x.grad[[1, 3, 5]].eq(1).all()
    assert bert_padding.IndexFirstAxisResidual.apply(x, idx)[0].shape == (3, 3)


def test_unpad_input_for_concatenated_sequences():
    hidden = torch.arange(3 * 6, dtype=torch.float32).reshape(3, 6, 1)
    in_length = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    packed, indices, cu, max_len = bert_padding.unpad_input_for_concatenated_sequences(hidden, in_length)
    assert cu.tolist() == [0, 2, 5, 8, 10, 16] and max_len == 6 and cu.dtype == torch.int32
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, *range(12, 18)]
    assert torch.equal(packed[:, 0], indices.float())
    with pytest.raises(RuntimeError, match="sum to at most seqlen = 6"):
        bert_padding.unpad_input_for_concatenated_sequences(hidden, in_length * 2)


def _angles(n, rotary_dim, dtype=torch.float32):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_emb_matches_the_formula(interleaved):
    x = torch.randn(2, 9, 3, 40, dtype=torch.float64, requires_grad=True)
    cos, sin = _angles(20, 24, torch.float64)
    offsets = torch.tensor([0, 5])
    got = rotary.apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offsets)
    for b in range(2):
        rows = slice(int(offsets[b]), int(offsets[b]) + 9)
        want = rotary.apply_rotary_emb_torch(x[b : b + 1], cos[rows], sin[rows], interleaved)
        torch.testing.assert_close(got[b : b + 1], want)
    assert torch.equal(got[..., 24:], x[..., 24:])
    torch.autograd.gradcheck(lambda t: rotary.apply_rotary_emb(t, cos, sin, interleaved, seqlen_offsets=3), x[:1, :4])
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)  # packed: positions restart in each sequence
    packed = rotary.apply_rotary_emb(x[0].detach(), cos, sin, interleaved, cu_seqlens=cu, max_seqlen=5)
    torch.testing.assert_close(packed[4:], rotary.apply_rotary_emb(x[0, None, 4:].detach(), cos, sin,
                                                                   interleaved)[0])
    y = x.detach().clone()
    assert rotary.apply_rotary_emb(y, cos, sin, interleaved, inplace=True) is y
    torch.testing.assert_close(y, rotary.apply_rotary_emb(x.detach(), cos, sin, interleaved))
    assert rotary.apply_rotary_emb_func is rotary.apply_rotary_emb
    halves, pairs = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert rotary.rotate_half(halves).tolist() == [-3.0, -4.0, 1.0, 2.0]
    assert rotary.rotate_half(pairs, interleaved=True).tolist() == [-2.0, 1.0, -4.0, 3.0]
    with pytest.raises(ValueError, match="cos has 20"):
        rotary.apply_rotary_emb(x, cos, sin, seqlen_offsets=15)


def test_rotary_qkv_kv_in_place_and_the_module():
    qkv = torch.randn(2, 8, 3, 4, 32)
    cos, sin = _angles(8, 16)
    ref = qkv.clone()
    assert rotary.apply_rotary_emb_qkv_(qkv, cos, sin) is qkv
    torch.testing.assert_close(qkv[:, :, 0], rotary.apply_rotary_emb(ref[:, :, 0], cos, sin))
    torch.testing.assert_close(qkv[:, :, 1], rotary.apply_rotary_emb(ref[:, :, 1], cos, sin))
    assert torch.equal(qkv[:, :, 2], ref[:, :, 2])
    gqa = torch.randn(2, 8, 4 + 2 * 2, 32)  # 4 query heads, 2 key/value heads
    ref = gqa.clone()
    rotary.apply_rotary_emb_qkv_(gqa, cos, sin, num_heads_q=4)
    torch.testing.assert_close(gqa[:, :, 4:6], rotary.apply_rotary_emb(ref[:, :, 4:6], cos, sin))
    assert torch.equal(gqa[:, :, 6:], ref[:, :, 6:])
    kv = torch.randn(2, 8, 2, 4, 32)
    ref = kv.clone()
    rotary.apply_rotary_emb_kv_(kv, cos, sin)
    assert torch.equal(kv[:, :, 1], ref[:, :, 1])

    module = rotary.RotaryEmbedding(16, interleaved=True)
    x = torch.randn(2, 8, 3, 4, 32)
    out = module(x.clone(), seqlen_offset=2)
    cos, sin = _angles(10, 16)
    torch.testing.assert_close(out[:, :, 0], rotary.apply_rotary_emb(x[:, :, 0], cos, sin, True, seqlen_offsets=2))
    xpos = rotary.RotaryEmbedding(16, scale_base=512)
    q, kv = xpos(x[:, :, 0].clone(), kv=x[:, :, 1:].clone())
    assert q.shape == (2, 8, 4, 32) and kv.shape == (2, 8, 2, 4, 32)
    assert not torch.allclose(q.norm(dim=-1), x[:, :, 0].norm(dim=-1))  # XPos scales q


# Ring attention as libraries write it on flash_attn's private API (the ring-flash-attention pattern): per-block
# _flash_attn_forward merged by log-sum-exp, and a backward of per-block _flash_attn_backward calls given the
# whole attention's out and lse, with dK/dV accumulators travelling around the ring with their block.
def _send_to_next(tensors, world, rank):
    import torch.distributed as dist

    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), (rank + 1) % world) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, (rank - 1) % world) for r in received]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def _ring_forward(q, k, v, scale, causal, world, rank):
    from flash_attn.flash_attn_interface import _flash_attn_forward

    out = lse = None
    for step in range(world):
        if not causal or step <= rank:  # a block from a later rank is hidden entirely by the causal mask
            block_out, block_lse, _, _ = _flash_attn_forward(q, k, v, 0.0, scale, causal and step == 0, -1, -1, 0.0,
                                                             None, False)
            block_out, block_lse = block_out.float(), block_lse.float()
            if out is None:
                out, lse = block_out, block_lse
            else:
                new_lse = torch.logaddexp(lse, block_lse)
                out = (out * torch.exp(lse - new_lse).transpose(1, 2)[..., None]
                       + block_out * torch.exp(block_lse - new_lse).transpose(1, 2)[..., None])
                lse = new_lse
        if step < world - 1:
            k, v = _send_to_next([k, v], world, rank)
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, scale, causal, world, rank):
    from flash_attn.flash_attn_interface import _flash_attn_backward

    dq = torch.zeros_like(q, dtype=torch.float32)
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    buffers = [torch.empty_like(t) for t in (q, k, v)]
    for step in range(world):
        if not causal or step <= rank:
            _flash_attn_backward(dout, q, k, v, out, lse, *buffers, 0.0, scale, causal and step == 0, -1, -1, 0.0,
                                 None, False, None)
            dq += buffers[0]
            dk += buffers[1]
            dv += buffers[2]
        k, v, dk, dv = _send_to_next([k, v, dk, dv], world, rank)  # after `world` steps every block is home
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _ring_body(rank, world):
    import flashattn.distributed as fd

    failures = []
    try:
        for causal in (False, True):
            torch.manual_seed(5)  # the same global inputs on every rank
            b, n, h, hk, d, scale = 2, 6 * world, 4, 2, 32, 0.2
            q, k, v = (torch.randn(b, n, heads, d) for heads in (h, hk, hk))
            dout = torch.randn(b, n, h, d)
            local = [fd.shard(t, "contiguous") for t in (q, k, v)]
            out, lse = _ring_forward(*local, scale, causal, world, rank)
            grads = _ring_backward(fd.shard(dout, "contiguous"), *local, out, lse, scale, causal, world, rank)

            leaves = [t.clone().requires_grad_() for t in local]
            want_out, want_lse, _ = fd.ring_flash_attn_func(*leaves, softmax_scale=scale, causal=causal,
                                                            return_attn_probs=True)
            want_grads = torch.autograd.grad(want_out, leaves, fd.shard(dout, "contiguous"))
            for name, got, want in (("out", out, want_out), ("lse", lse, want_lse),
                                    *zip(("dq", "dk", "dv"), grads, want_grads, strict=True)):
                err = (got - want).abs().max().item()
                if err > 2e-5 * (1 + want.abs().max().item()):
                    failures.append(f"rank {rank} causal={causal} {name}: max error {err:.3g}")
    except Exception:
        failures.append(traceback.format_exc())
    import torch.distributed as dist

    everyone = [None] * world  # every rank's failures, reported by rank 0
    dist.all_gather_object(everyone, failures)
    return [f for rank_failures in everyone for f in rank_failures]


def test_ring_attention_on_the_private_api_equals_flashattn_ring(tmp_path):
    """Two ranks (flashattn's own ring runs on four in test_distributed)."""
    world = 2
    from test_distributed import _spawn

    failures = _spawn(_ring_body, world, tmp_path)
    assert not failures, "\n".join(failures)
