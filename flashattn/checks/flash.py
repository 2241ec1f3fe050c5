"""Checks of the ``flash_attn_*func`` family: the flash layout, its options, packed (varlen) batches and paged
keys."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..backends.spec import AttentionSpec, KeyCache, Varlen
from . import fp8, on_device
from ._base import (
    fail,
    unit_stride,
    validate_alibi,
    validate_dropout,
    validate_flag,
    validate_head_dim,
    validate_heads,
    validate_int,
    validate_same,
    validate_scale,
    validate_sink,
    validate_softcap,
    validate_tensor,
    validate_window,
)
from .block_mask import validate_block_mask
from .deferred import checked_varlen
from .kinds import validate_plain
from .on_device import values_on_host
from .signature import Signatures
from .values import VarlenSizes, check_pages, check_varlen_values, same_batch


@dataclass(frozen=True)
class CheckedCall:
    """A validated call in the flash layout, ready for ``flashattn.ops.attention``: q (B, Nq, H, D), k (B, Nk, Hk,
    D), v (B, Nk, Hk, Dv), or packed / cached as ``spec`` says."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    spec: AttentionSpec


def flash_layout(fn: str, q: object, k: object, v: object, names=("q", "k", "v")) -> tuple[torch.Tensor, ...]:
    """q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_k, headdim) and v (batch, seqlen_k, nheads_k,
    headdim_v) of one dtype and device. v's head dim may differ (FlashAttention-3 and SDPA allow it: MLA prefill
    uses 192 for q/k and 128 for v); out then has v's."""
    layouts = ("(batch, seqlen_q, nheads, headdim)", "(batch, seqlen_k, nheads_k, headdim)",
               "(batch, seqlen_k, nheads_k, headdim_v)")
    q = validate_tensor(fn, names[0], q, 4, layouts[0], fp8=True)
    k = validate_tensor(fn, names[1], k, 4, layouts[1], fp8=True)
    v = validate_tensor(fn, names[2], v, 4, layouts[2], fp8=True)
    validate_same(fn, dict(zip(names, (q, k, v), strict=True)))
    if k.shape[:3] != v.shape[:3]:
        raise fail(fn, f"{names[1]} and {names[2]} must agree on (batch, seqlen_k, nheads_k), got "
                       f"{tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise fail(fn, f"batch sizes differ: {names[0]} has {q.shape[0]}, {names[1]} has {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise fail(fn, f"head dims differ: {names[0]} has {q.shape[3]}, {names[1]} has {k.shape[3]}")
    validate_head_dim(fn, names[0], q.shape[3])
    validate_head_dim(fn, names[2], v.shape[3])
    validate_heads(fn, nheads=q.shape[2], nheads_k=k.shape[2], names=(names[0], names[1]))
    return q, k, v


# The options of flash_attn_func after q, k, v, shared by every flash_attn_* function: the one list of their names.
FLASH_OPTIONS = ("dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
                 "return_attn_probs")


def flash_arguments(**options) -> dict:
    """The ``flash_attn_func`` options of a public function's call, each by name (``FLASH_OPTIONS``, all of them).
    Named one by one, not read from ``locals()``: torch.compile before 2.12 cannot trace ``locals()``."""
    if set(options) != set(FLASH_OPTIONS):  # a programming error inside the library, never the user's
        raise TypeError(f"flash_arguments: expected the options {FLASH_OPTIONS}, got {tuple(options)}")
    return options


def flash_options(fn: str, q: torch.Tensor, *, batch: int, learnable_sink: object = None,
                  **options) -> AttentionSpec:
    """The options shared by the dense, varlen and KV-cache ``flash_attn_*`` functions (bottom-right causal):
    ``options`` are ``flash_attn_func``'s keyword arguments after q, k, v (``FLASH_OPTIONS``), all of them, and
    ``learnable_sink`` FlashAttention-4's sink logits (nheads,)."""
    if set(options) != set(FLASH_OPTIONS):  # a programming error inside the library, never the user's
        raise TypeError(f"flash_options: expected the options {FLASH_OPTIONS}, got {tuple(options)}")
    causal = validate_flag(fn, "causal", options["causal"])
    # PyTorch's convention: torch.use_deterministic_algorithms(True) asks every op for its deterministic kernels.
    deterministic = validate_flag(fn, "deterministic", options["deterministic"]) or (
        torch.are_deterministic_algorithms_enabled())
    validate_flag(fn, "return_attn_probs", options["return_attn_probs"])
    left, right = validate_window(fn, options["window_size"], causal)
    return AttentionSpec(
        scale=validate_scale(fn, "softmax_scale", options["softmax_scale"], q.shape[-1]),
        window_left=left,
        window_right=right,
        bottom_right=True,
        softcap=validate_softcap(fn, options["softcap"]),
        dropout_p=validate_dropout(fn, options["dropout_p"]),
        deterministic=deterministic,
        alibi_slopes=validate_alibi(fn, options["alibi_slopes"], batch=batch, nheads=q.shape[-2], ref=q),
        sink=validate_sink(fn, learnable_sink, nheads=q.shape[-2], ref=q),
    )


def check_flash(fn: str, q: object, k: object, v: object, *, names: tuple[str, str, str] = ("q", "k", "v"),
                block_mask: object = None, **options) -> CheckedCall:
    """Validate the arguments of the ``flash_attn_*func`` family (flash layout, bottom-right causal); ``options``
    are the keyword arguments of ``flash_attn_func`` after q, k, v, and ``block_mask`` a FlexAttention
    ``BlockMask`` or None."""
    signature = _CHECKED.key(fn, (q, k, v), (names, block_mask, torch.are_deterministic_algorithms_enabled(),
                                             *options, *options.values()))
    spec = _CHECKED.get(signature)
    if spec is not None:
        return CheckedCall(q, k, v, spec)
    q, k, v = flash_layout(fn, q, k, v, names)
    given = {n: options.pop(n, None) for n in ("q_descale", "k_descale", "v_descale")}
    training = options.pop("fp8", False)
    spec = flash_options(fn, q, batch=q.shape[0], **options)
    spec = fp8.with_fp8(fn, spec, inputs=dict(zip(names, (q, k, v), strict=True)), given=given, training=training,
                        batch=q.shape[0], nheads_k=k.shape[2], options=options)
    if block_mask is not None:
        spec = dataclasses.replace(spec, block_sparse=validate_block_mask(
            fn, "block_mask", block_mask, batch=q.shape[0], nheads=q.shape[2], nq=q.shape[1], nk=k.shape[1], ref=q))
    if not any(isinstance(a, torch.Tensor) for a in spec.as_args()):  # FP8 inputs' default scales are tensors
        _CHECKED.put(signature, spec)
    return CheckedCall(q, k, v, spec)


_CHECKED = Signatures()  # check_flash's passed signatures


def _validate_offsets(fn: str, name: str, cu: object, ref: torch.Tensor) -> torch.Tensor:
    """An int32 (batch + 1,) offsets tensor on the inputs' device (its values are checked in ``values.py``)."""
    if not isinstance(cu, torch.Tensor):
        raise fail(fn, f"{name} must be an int32 torch.Tensor of shape (batch + 1,), got {type(cu).__name__}",
                   TypeError)
    validate_plain(fn, name, cu)
    if cu.dtype != torch.int32:
        raise fail(fn, f"{name} must have dtype torch.int32, got {cu.dtype}", TypeError)
    if cu.dim() != 1 or cu.numel() < 1:
        raise fail(fn, f"{name} must be 1-D of length batch + 1 >= 1, got shape {tuple(cu.shape)}")
    if cu.device != ref.device:
        raise fail(fn, f"{name} is on {cu.device} but the inputs are on {ref.device}")
    return unit_stride(cu)


def check_varlen(fn: str, q: object, k: object, v: object, *, names: tuple[str, str, str] = ("q", "k", "v"),
                 **arguments) -> CheckedCall:
    """Validate the ``flash_attn_varlen_*func`` family: packed q (total_q, nheads, headdim), k/v (total_k,
    nheads_k, headdim), and in ``arguments`` the int32 offsets ``cu_seqlens_q``/``cu_seqlens_k`` (batch + 1), the
    maxima ``max_seqlen_q``/``max_seqlen_k``, an optional ``block_table`` and ``flash_attn_func``'s options.
    With ``block_table``, k/v are a paged cache (num_pages, page_size, nheads_k, headdim) holding each sequence's
    keys from position 0: forward only for the cache (gradients reach q; asking for the cache's is an error when
    the backward runs)."""
    block_table = arguments.pop("block_table", None)
    paged = block_table is not None
    q, k, v = _packed_layout(fn, q, k, v, names=names, paged=paged)
    cu_q = _validate_offsets(fn, "cu_seqlens_q", arguments.pop("cu_seqlens_q"), q)
    cu_k = _validate_offsets(fn, "cu_seqlens_k", arguments.pop("cu_seqlens_k"), q)
    max_q = validate_int(fn, "max_seqlen_q", arguments.pop("max_seqlen_q"))
    max_k = validate_int(fn, "max_seqlen_k", arguments.pop("max_seqlen_k"))
    sizes = VarlenSizes(q.shape[0], None if paged else k.shape[0], max_q, max_k,
                        num_pages=k.shape[0], page_size=k.shape[1] if paged else 1)
    compiling = torch.compiler.is_compiling()
    # Offsets on the host are checked there; a GPU's by a kernel (no copy to the host), the paged K/V's pages
    # with them; under torch.compile when the graph runs (below). The batch sizes are known now.
    on_host = not compiling and values_on_host(cu_q, cu_k, block_table)
    if not on_host:
        same_batch(fn, cu_q.numel(), cu_k.numel())
    else:
        lengths_k = check_varlen_values(fn, cu_q, cu_k, None, sizes)
    batch = cu_q.numel() - 1
    given = {n: arguments.pop(n, None) for n in ("q_descale", "k_descale", "v_descale")}
    training = arguments.pop("fp8", False)
    spec = flash_options(fn, q, batch=batch, **arguments)
    spec = fp8.with_fp8(fn, spec, inputs=dict(zip(names, (q, k, v), strict=True)), given=given, training=training,
                        batch=batch, nheads_k=k.shape[-2], options=arguments)
    if paged:
        if spec.dropout_p > 0 or spec.fp8_training or validate_flag(fn, "return_attn_probs",
                                                                     arguments["return_attn_probs"]):
            raise fail(fn, "a paged K/V (block_table) is for inference: pass dropout_p=0, fp8=False and "
                           "return_attn_probs=False")
        block_table = unit_stride(validate_block_table(fn, block_table, k, batch))
        if on_host:
            check_pages(fn, block_table, lengths_k, num_pages=k.shape[0], page_size=k.shape[1])
    if not compiling and not on_host:
        on_device.check_varlen(fn, cu_q, cu_k, block_table, sizes)
    if compiling:
        cu_q, cu_k, *table = checked_varlen(fn, cu_q, cu_k, block_table, sizes)
        block_table = table[0] if paged else None
    cache = None
    if paged:
        cache = KeyCache(None, cu_k[1:] - cu_k[:-1], max_k, block_table=block_table)
    return CheckedCall(q, k, v, dataclasses.replace(spec, varlen=Varlen(cu_q, cu_k, max_q, max_k), cache=cache))


def _packed_layout(fn: str, q, k, v, *, names, paged: bool) -> tuple[torch.Tensor, ...]:
    layouts = ("(total_q, nheads, headdim)", "(num_pages, page_size, nheads_k, headdim), a paged cache since "
               "block_table is given" if paged else "(total_k, nheads_k, headdim)")
    for name, t, layout, ndim in zip(names, (q, k, v), (layouts[0], layouts[1], layouts[1]), (3, 3 + paged, 3 + paged),
                                     strict=True):
        validate_tensor(fn, name, t, ndim, layout, fp8=True)
    # The dense checks on a batch of one: same heads, head dims, dtypes and devices rules.
    flash_layout(fn, q[None], k[:1] if paged else k[None], v[:1] if paged else v[None], names)
    return q, k, v


def validate_block_table(fn: str, table: object, k_cache: torch.Tensor, batch: int) -> torch.Tensor:
    """An int32 (batch, pages per sequence) table on the cache's device (the page ids it holds are checked in
    ``values.check_pages``)."""
    if not isinstance(table, torch.Tensor):
        raise fail(fn, f"block_table must be an int32 torch.Tensor (batch, max_pages_per_seq) or None, got "
                       f"{type(table).__name__}", TypeError)
    validate_plain(fn, "block_table", table)
    if table.dtype != torch.int32:
        raise fail(fn, f"block_table must have dtype torch.int32, got {table.dtype}", TypeError)
    if table.dim() != 2 or table.shape[0] != batch:
        raise fail(fn, f"block_table must have shape (batch, max_pages_per_seq) with batch = {batch}, got "
                       f"{tuple(table.shape)}")
    if table.device != k_cache.device:
        raise fail(fn, f"block_table is on {table.device} but the cache is on {k_cache.device}")
    return table


def unpack(fn: str, name: str, packed: object, count: int, varlen: bool = False) -> tuple[torch.Tensor, ...]:
    """Split a packed (batch, seqlen, count, nheads, headdim) tensor, or (total, count, nheads, headdim) when
    ``varlen``, into ``count`` views."""
    layout = f"({'total' if varlen else 'batch, seqlen'}, {count}, nheads, headdim)"
    axis = 1 if varlen else 2
    packed = validate_tensor(fn, name, packed, axis + 3, layout)
    if packed.shape[axis] != count:
        raise fail(fn, f"{name} must have shape {layout}, got {tuple(packed.shape)}")
    return packed.unbind(axis)
