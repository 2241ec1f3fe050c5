"""``flash_attn.flash_attn_interface`` on flashattn: the public functions, and the private entry points that
ring-attention and context-parallel libraries call for a block's ``out`` and ``lse`` (flash_attn 2.8's signatures,
defaults and return tuples), registered as the custom ops ``torch.ops.flash_attn._flash_attn_forward`` and so on,
as flash_attn registers them, with fake implementations for ``torch.compile``. They run on any device flashattn
does (the CPU included).

Differences from flash_attn, all of them widenings: inputs may be float32 or float64 too (lse is then float64 for
float64), strides need not be unit, and ``rng_state`` is (seed, 0), the key of flashattn's counter-based dropout.

Example (after ``flashattn.install_as_flash_attn()``)::

    >>> from flash_attn.flash_attn_interface import _flash_attn_forward
    >>> q, k, v = (torch.randn(1, 16, 2, 32) for _ in range(3))
    >>> out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, 32 ** -0.5, True, -1, 0, 0.0, None, False)
    >>> out.shape, lse.shape
    (torch.Size([1, 16, 2, 32]), torch.Size([1, 2, 16]))
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from ... import checks, interface
from ...backends import choose
from ...backends.spec import Saved, accumulation_dtype
from ...interface import _dropout_seed, flash_attn_with_kvcache
from ...ops import attention, attention_backward
from ._registry import register_op
from .probs import flash_scaled, with_flash_probs

__all__ = [
    "FlashAttnFunc", "FlashAttnKVPackedFunc", "FlashAttnQKVPackedFunc", "FlashAttnVarlenFunc",
    "FlashAttnVarlenKVPackedFunc", "FlashAttnVarlenQKVPackedFunc", "_flash_attn_backward", "_flash_attn_forward",
    "_flash_attn_backward_fake", "_flash_attn_forward_fake", "_flash_attn_varlen_backward_fake",
    "_flash_attn_varlen_forward_fake",
    "_flash_attn_varlen_backward", "_flash_attn_varlen_forward", "_wrapped_flash_attn_backward",
    "_wrapped_flash_attn_forward", "_wrapped_flash_attn_varlen_backward", "_wrapped_flash_attn_varlen_forward",
    "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
    "maybe_contiguous", "round_multiple", "USE_TRITON_ROCM",
]

# flash_attn's switch to its Triton kernels for AMD GPUs (FLASH_ATTENTION_TRITON_AMD_ENABLE). flashattn runs its own
# kernels on every device, so flash_attn's ROCm paths are never taken; its tests read the name to skip ROCm cases.
USE_TRITON_ROCM = False


def maybe_contiguous(x: Tensor | None) -> Tensor | None:
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def round_multiple(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _get_block_size_n(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """The key block by which ``S_dmask`` is scaled (``probs.flash_scaled``), as flash_attn's CUDA kernels' and
    its tests' own; any block size would do, the two need only agree."""
    return 128 if head_dim <= 64 and not is_dropout else 64


# The public functions, with S_dmask scaled as flash_attn's (probs.py); flashattn's own give the weights.
flash_attn_func = with_flash_probs(interface.flash_attn_func, _get_block_size_n)
flash_attn_qkvpacked_func = with_flash_probs(interface.flash_attn_qkvpacked_func, _get_block_size_n)
flash_attn_kvpacked_func = with_flash_probs(interface.flash_attn_kvpacked_func, _get_block_size_n)
flash_attn_varlen_func = with_flash_probs(interface.flash_attn_varlen_func, _get_block_size_n)
flash_attn_varlen_qkvpacked_func = with_flash_probs(interface.flash_attn_varlen_qkvpacked_func, _get_block_size_n)
flash_attn_varlen_kvpacked_func = with_flash_probs(interface.flash_attn_varlen_kvpacked_func, _get_block_size_n)


def _options(dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
             *, deterministic=False, return_softmax=False) -> dict:
    """flash_attn_func's keyword options from the private entry points' flat arguments."""
    return dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                window_size=(window_size_left, window_size_right), softcap=softcap, alibi_slopes=alibi_slopes,
                deterministic=deterministic, return_attn_probs=return_softmax)


def _rng_state(seed: Tensor | None, ref: Tensor) -> Tensor:
    """flash_attn's (seed, offset) pair: flashattn's dropout key and 0 (its generator needs no offset)."""
    state = torch.zeros(2, dtype=torch.int64, device=ref.device)
    return state if seed is None else torch.cat((seed.reshape(1), state[1:]))


def _seed(fn: str, dropout_p: float, rng_state: Tensor | None) -> Tensor | None:
    if dropout_p == 0:
        return None
    if not isinstance(rng_state, Tensor) or rng_state.numel() != 2 or rng_state.dtype != torch.int64:
        raise checks.fail(fn, f"dropout_p = {dropout_p} needs the forward's rng_state, a (2,) int64 tensor; got "
                              f"{rng_state if not isinstance(rng_state, Tensor) else tuple(rng_state.shape)}")
    return rng_state[:1]


def _padded_probs(probs: Tensor, return_softmax: bool, ref: Tensor) -> Tensor:
    """S_dmask as flash_attn shapes it: (batch, nheads, seqlen_q, seqlen_k) rounded up to 128, or empty."""
    if not return_softmax:
        return ref.new_empty(0)
    nq, nk = probs.shape[-2:]
    return F.pad(probs, (0, round_multiple(nk, 128) - nk, 0, round_multiple(nq, 128) - nq))


def _forward(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: float, causal: bool,
             window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Tensor | None,
             return_softmax: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    fn = "_flash_attn_forward"
    call = checks.check_flash(fn, q, k, v, **_options(dropout_p, softmax_scale, causal, window_size_left,
                                                      window_size_right, softcap, alibi_slopes,
                                                      return_softmax=return_softmax))
    return _run_forward(call, return_softmax, causal=causal)


def _flash_attn_forward_fake(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                             alibi_slopes, return_softmax):
    batch, nq, nheads, _ = q.shape
    lse = q.new_empty(batch, nheads, nq, dtype=accumulation_dtype(q.dtype))
    probs = (q.new_empty(batch, nheads, round_multiple(nq, 128), round_multiple(k.shape[1], 128))
             if return_softmax else q.new_empty(0))
    return q.new_empty(*q.shape[:-1], v.shape[-1]), lse, probs, q.new_empty(2, dtype=torch.int64)


_flash_attn_forward = register_op(
    "_flash_attn_forward", _forward, _flash_attn_forward_fake, mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, float dropout_p, float softmax_scale, bool causal, "
           "SymInt window_size_left, SymInt window_size_right, float softcap, Tensor? alibi_slopes, "
           "bool return_softmax) -> (Tensor, Tensor, Tensor, Tensor)")


def _backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, dq: Tensor | None,
              dk: Tensor | None, dv: Tensor | None, dropout_p: float, softmax_scale: float, causal: bool,
              window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Tensor | None,
              deterministic: bool, rng_state: Tensor | None = None) -> Tensor:
    fn = "_flash_attn_backward"
    call = checks.check_flash(fn, q, k, v, **_options(dropout_p, softmax_scale, causal, window_size_left,
                                                      window_size_right, softcap, alibi_slopes,
                                                      deterministic=deterministic))
    delta = _run_backward(fn, call, dout=dout, out=out, lse=softmax_lse, rng_state=rng_state, dq=dq, dk=dk, dv=dv,
                          lse_shape=(q.shape[0], q.shape[2], q.shape[1]))
    return F.pad(delta, (0, round_multiple(q.shape[1], 128) - q.shape[1]))  # (B, H, Nq rounded up to 128)


def _flash_attn_backward_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                              window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                              rng_state=None):
    batch, nq, nheads, _ = q.shape
    return q.new_empty(batch, nheads, round_multiple(nq, 128), dtype=accumulation_dtype(q.dtype))


_flash_attn_backward = register_op(
    "_flash_attn_backward", _backward, _flash_attn_backward_fake, mutates_args=("dq", "dk", "dv"),
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(a1!)? dq, "
           "Tensor(a2!)? dk, Tensor(a3!)? dv, float dropout_p, float softmax_scale, bool causal, "
           "SymInt window_size_left, SymInt window_size_right, float softcap, Tensor? alibi_slopes, "
           "bool deterministic, Tensor? rng_state=None) -> Tensor")


def _check_saved(fn: str, *, dout: Tensor, out: Tensor, lse: Tensor, q: Tensor, v: Tensor,
                 lse_shape: tuple[int, ...]) -> None:
    """The forward's results, as the backward is given them: out and dout shaped as the output, lse as its lse."""
    out_shape = (*q.shape[:-1], v.shape[-1])
    for name, t in (("out", out), ("dout", dout)):
        if not isinstance(t, Tensor) or tuple(t.shape) != out_shape:
            raise checks.fail(fn, f"{name} must be a tensor of the output's shape {out_shape}, got "
                                  f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    if not isinstance(lse, Tensor) or tuple(lse.shape) != lse_shape or not lse.is_floating_point():
        raise checks.fail(fn, f"softmax_lse must be the forward's float tensor of shape {lse_shape}, got "
                              f"{tuple(lse.shape) if isinstance(lse, Tensor) else type(lse).__name__}")


def _run_forward(call, return_softmax: bool, *, causal: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The checked call's (out, lse, S_dmask, rng_state), as flash_attn's forwards return them."""
    spec = dataclasses.replace(call.spec, seed=_dropout_seed(call.spec.dropout_p, call.q.device))
    out, lse, probs = attention(call.q, call.k, call.v, spec, return_probs=return_softmax)
    if return_softmax:
        block = _get_block_size_n(probs.device, call.q.shape[-1], spec.dropout_p > 0, causal)
        probs = flash_scaled(probs, block=block)
    return out, lse, _padded_probs(probs, return_softmax, call.q), _rng_state(spec.seed, call.q)


def _run_backward(fn: str, call, *, dout: Tensor, out: Tensor, lse: Tensor, rng_state: Tensor | None,
                  lse_shape: tuple[int, ...], **buffers: Tensor | None) -> Tensor:
    """The checked call's gradients into the caller's dq, dk and dv (as flash_attn writes them; a None is
    skipped); returns rowsum(dO * O) in lse's layout, the softmax_d flash_attn's backwards return (unpadded)."""
    _check_saved(fn, dout=dout, out=out, lse=lse, q=call.q, v=call.v, lse_shape=lse_shape)
    spec = dataclasses.replace(call.spec, seed=_seed(fn, call.spec.dropout_p, rng_state))
    saved = Saved(call.q, call.k, call.v, out, lse)
    grads = attention_backward(dout, None, saved, spec, backend=choose(saved.q, saved.k, saved.v, spec))
    for (name, buffer), grad in zip(buffers.items(), grads, strict=True):
        if buffer is None:
            continue
        if not isinstance(buffer, Tensor) or buffer.shape != grad.shape:
            raise checks.fail(fn, f"{name} must be None or a tensor of shape {tuple(grad.shape)}, got "
                                  f"{tuple(buffer.shape) if isinstance(buffer, Tensor) else type(buffer).__name__}")
        buffer.copy_(grad)
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # (B, Nq, H) or (total_q, H)
    return delta.transpose(-1, -2) if delta.dim() == 2 else delta.transpose(1, 2)


def _varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                    max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
                    window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
                    alibi_slopes: Tensor | None = None, return_softmax: bool = False,
                    block_table: Tensor | None = None, leftpad_k: Tensor | None = None,
                    seqused_k: Tensor | None = None, zero_tensors: bool = False,
                    num_splits: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    fn = "_flash_attn_varlen_forward"
    if leftpad_k is not None or seqused_k is not None:
        k, v, cu_seqlens_k = _used_keys(fn, k, v, cu_seqlens_k, leftpad_k=leftpad_k, seqused_k=seqused_k,
                                        paged=block_table is not None)
    call = checks.check_varlen(fn, q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, block_table=block_table,
                               **_options(dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                                          softcap, alibi_slopes, return_softmax=return_softmax))
    return _run_forward(call, return_softmax, causal=causal)


def _used_keys(fn: str, k: Tensor, v: Tensor, cu_seqlens_k: Tensor, *, leftpad_k: Tensor | None,
               seqused_k: Tensor | None, paged: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Sequence b attends to its keys [leftpad_k[b], seqused_k[b]) (flash_attn's meaning): packed keys are
    gathered into a batch of just those; a paged cache holds each sequence from position 0, so only seqused_k
    applies, as the sequences' lengths."""
    if paged:
        if leftpad_k is not None:
            raise checks.fail(fn, "leftpad_k with a paged K/V (block_table) is not supported; pass "
                                  "cache_leftpad to flash_attn_with_kvcache instead")
        return k, v, F.pad(seqused_k.to(torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    starts = cu_seqlens_k[:-1].long()
    ends = cu_seqlens_k[1:].long() if seqused_k is None else starts + seqused_k.long()
    if leftpad_k is not None:
        starts = starts + leftpad_k.long()
    lengths = (ends - starts).clamp(min=0)
    cu = F.pad(lengths.cumsum(0), (1, 0))
    total = int(cu[-1])  # the packed keys' count sizes the gather: one host read, as the varlen checks do anyway
    index = torch.arange(total, device=k.device) + torch.repeat_interleave(starts - cu[:-1], lengths, output_size=total)
    return k[index], v[index], cu.to(torch.int32)


def _flash_attn_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                    softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                                    alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                                    seqused_k=None, zero_tensors=False, num_splits=0):
    batch = cu_seqlens_q.shape[0] - 1
    lse = q.new_empty(q.shape[1], q.shape[0], dtype=accumulation_dtype(q.dtype))
    probs = (q.new_empty(batch, q.shape[1], round_multiple(max_seqlen_q, 128), round_multiple(max_seqlen_k, 128))
             if return_softmax else q.new_empty(0))
    return q.new_empty(*q.shape[:-1], v.shape[-1]), lse, probs, q.new_empty(2, dtype=torch.int64)


_flash_attn_varlen_forward = register_op(
    "_flash_attn_varlen_forward", _varlen_forward, _flash_attn_varlen_forward_fake, mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
           "SymInt max_seqlen_k, float dropout_p, float softmax_scale, bool causal, SymInt window_size_left=-1, "
           "SymInt window_size_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, bool return_softmax=False, "
           "Tensor? block_table=None, Tensor? leftpad_k=None, Tensor? seqused_k=None, bool zero_tensors=False, "
           "SymInt num_splits=0) -> (Tensor, Tensor, Tensor, Tensor)")


def _varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
                     dq: Tensor | None, dk: Tensor | None, dv: Tensor | None, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                     softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                     softcap: float, alibi_slopes: Tensor | None, deterministic: bool,
                     rng_state: Tensor | None = None, zero_tensors: bool = False) -> Tensor:
    fn = "_flash_attn_varlen_backward"
    call = checks.check_varlen(fn, q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                               **_options(dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                                          softcap, alibi_slopes, deterministic=deterministic))
    delta = _run_backward(fn, call, dout=dout, out=out, lse=softmax_lse, rng_state=rng_state, dq=dq, dk=dk, dv=dv,
                          lse_shape=(q.shape[1], q.shape[0]))  # (H, total_q)
    # flash_attn's layout: sequence b's rows start at cu_seqlens_q[b] + 128 b.
    batch = cu_seqlens_q.shape[0] - 1
    lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    sequence = torch.repeat_interleave(torch.arange(batch, device=q.device), lengths, output_size=q.shape[0])
    padded = delta.new_zeros(delta.shape[0], q.shape[0] + 128 * batch)
    padded[:, torch.arange(q.shape[0], device=q.device) + 128 * sequence] = delta
    return padded


def _flash_attn_varlen_backward_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                     window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                                     zero_tensors=False):
    total = q.shape[0] + 128 * (cu_seqlens_q.shape[0] - 1)
    return q.new_empty(q.shape[1], total, dtype=accumulation_dtype(q.dtype))


_flash_attn_varlen_backward = register_op(
    "_flash_attn_varlen_backward", _varlen_backward, _flash_attn_varlen_backward_fake,
    mutates_args=("dq", "dk", "dv"),
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(a1!)? dq, "
           "Tensor(a2!)? dk, Tensor(a3!)? dv, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
           "SymInt max_seqlen_k, float dropout_p, float softmax_scale, bool causal, SymInt window_size_left, "
           "SymInt window_size_right, float softcap, Tensor? alibi_slopes, bool deterministic, "
           "Tensor? rng_state=None, bool zero_tensors=False) -> Tensor")

# flash_attn's names for the registered ops (torch >= 2.4), which its own autograd Functions call.
_wrapped_flash_attn_forward = torch.ops.flash_attn._flash_attn_forward
_wrapped_flash_attn_varlen_forward = torch.ops.flash_attn._flash_attn_varlen_forward
_wrapped_flash_attn_backward = torch.ops.flash_attn._flash_attn_backward
_wrapped_flash_attn_varlen_backward = torch.ops.flash_attn._flash_attn_varlen_backward


class _Applied:
    """``FlashAttnFunc.apply(q, k, v, dropout_p, ...)``: flash_attn's autograd Functions by their positional
    ``apply`` arguments, which some libraries call directly; the public function with those arguments."""

    def __init__(self, function, parameters: str):
        self._function, self._parameters = function, parameters.split()

    def apply(self, *args):
        kwargs = dict(zip(self._parameters, args, strict=True))
        record = torch.is_grad_enabled() and bool(kwargs.pop("is_grad_enabled"))  # False: no graph, as flash_attn
        kwargs["return_attn_probs"] = kwargs.pop("return_softmax")
        with torch.set_grad_enabled(record):
            return self._function(**kwargs)


_OPTIONS = "dropout_p softmax_scale causal window_size softcap alibi_slopes deterministic return_softmax"
FlashAttnFunc = _Applied(flash_attn_func, f"q k v {_OPTIONS} is_grad_enabled")
FlashAttnQKVPackedFunc = _Applied(flash_attn_qkvpacked_func, f"qkv {_OPTIONS} is_grad_enabled")
FlashAttnKVPackedFunc = _Applied(flash_attn_kvpacked_func, f"q kv {_OPTIONS} is_grad_enabled")
FlashAttnVarlenFunc = _Applied(flash_attn_varlen_func, f"q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k "
                                                      f"{_OPTIONS} block_table is_grad_enabled")
FlashAttnVarlenQKVPackedFunc = _Applied(flash_attn_varlen_qkvpacked_func,
                                        f"qkv cu_seqlens max_seqlen {_OPTIONS} is_grad_enabled")
FlashAttnVarlenKVPackedFunc = _Applied(flash_attn_varlen_kvpacked_func, f"q kv cu_seqlens_q cu_seqlens_k max_seqlen_q "
                                                                        f"max_seqlen_k {_OPTIONS} is_grad_enabled")
