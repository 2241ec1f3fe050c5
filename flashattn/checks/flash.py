"""Checks of the ``flash_attn_*func`` family: the flash layout, its options, packed (varlen) batches and paged
keys."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import pairwise

import torch

from ..backends.spec import AttentionSpec, KeyCache, Varlen
from ._base import (
    fail,
    validate_alibi,
    validate_bool,
    validate_dropout,
    validate_heads,
    validate_same,
    validate_scale,
    validate_softcap,
    validate_tensor,
    validate_window,
)


@dataclass(frozen=True)
class CheckedCall:
    """A validated call in the flash layout, ready for ``flashattn.ops.attention``: q (B, Nq, H, D), k (B, Nk, Hk,
    D), v (B, Nk, Hk, Dv), or packed / cached as ``spec`` says."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    spec: AttentionSpec


def flash_layout(fn: str, q: object, k: object, v: object, names=("q", "k", "v")) -> tuple[torch.Tensor, ...]:
    """q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim) of one dtype and device."""
    layouts = ("(batch, seqlen_q, nheads, headdim)", "(batch, seqlen_k, nheads_k, headdim)")
    q = validate_tensor(fn, names[0], q, 4, layouts[0])
    k = validate_tensor(fn, names[1], k, 4, layouts[1])
    v = validate_tensor(fn, names[2], v, 4, layouts[1])
    validate_same(fn, dict(zip(names, (q, k, v), strict=True)))
    if k.shape != v.shape:
        raise fail(fn, f"{names[1]} and {names[2]} must have the same shape, got {tuple(k.shape)} and "
                       f"{tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise fail(fn, f"batch sizes differ: {names[0]} has {q.shape[0]}, {names[1]} has {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise fail(fn, f"head dims differ: {names[0]} has {q.shape[3]}, {names[1]} has {k.shape[3]}")
    validate_heads(fn, q.shape[2], k.shape[2], (names[0], names[1]))
    return q, k, v


def flash_options(fn: str, q: torch.Tensor, *, batch: int, **options) -> AttentionSpec:
    """The options shared by the dense, varlen and KV-cache ``flash_attn_*`` functions (bottom-right causal):
    ``options`` are ``flash_attn_func``'s keyword arguments after q, k, v."""
    causal = validate_bool(fn, "causal", options["causal"])
    validate_bool(fn, "deterministic", options["deterministic"])
    validate_bool(fn, "return_attn_probs", options["return_attn_probs"])
    left, right = validate_window(fn, options["window_size"], causal)
    return AttentionSpec(
        scale=validate_scale(fn, "softmax_scale", options["softmax_scale"], q.shape[-1]),
        window_left=left,
        window_right=right,
        bottom_right=True,
        softcap=validate_softcap(fn, options["softcap"]),
        dropout_p=validate_dropout(fn, options["dropout_p"]),
        deterministic=options["deterministic"],
        alibi_slopes=validate_alibi(fn, options["alibi_slopes"], batch=batch, nheads=q.shape[-2], ref=q),
    )


def check_flash(fn: str, q: object, k: object, v: object, *, names: tuple[str, str, str] = ("q", "k", "v"),
                **options) -> CheckedCall:
    """Validate the arguments of the ``flash_attn_*func`` family (flash layout, bottom-right causal); ``options``
    are the keyword arguments of ``flash_attn_func`` after q, k, v."""
    q, k, v = flash_layout(fn, q, k, v, names)
    return CheckedCall(q, k, v, flash_options(fn, q, batch=q.shape[0], **options))


def _validate_cu_seqlens(fn: str, name: str, cu: object, total: int | None, ref: torch.Tensor) -> list[int]:
    if not isinstance(cu, torch.Tensor):
        raise fail(fn, f"{name} must be an int32 torch.Tensor of shape (batch + 1,), got {type(cu).__name__}",
                   TypeError)
    if cu.dtype != torch.int32:
        raise fail(fn, f"{name} must have dtype torch.int32, got {cu.dtype}", TypeError)
    if cu.dim() != 1 or cu.numel() < 1:
        raise fail(fn, f"{name} must be 1-D of length batch + 1 >= 1, got shape {tuple(cu.shape)}")
    if cu.device != ref.device:
        raise fail(fn, f"{name} is on {cu.device} but the inputs are on {ref.device}")
    values = cu.tolist()  # a host read: the offsets must be right before any kernel trusts them
    if values[0] != 0:
        raise fail(fn, f"{name} must start at 0, got {values[0]}")
    drops = [i for i in range(1, len(values)) if values[i] < values[i - 1]]
    if drops:
        i = drops[0]
        raise fail(fn, f"{name} must be non-decreasing, but {name}[{i}] = {values[i]} < {name}[{i - 1}] = "
                       f"{values[i - 1]}")
    if total is not None and values[-1] != total:
        raise fail(fn, f"{name}[-1] = {values[-1]} must equal the number of packed rows, {total}")
    return values


def _validate_max_seqlen(fn: str, name: str, value: object, lengths: list[int]) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(fn, f"{name} must be an int, got {value!r}", TypeError)
    longest = max(lengths, default=0)
    if value < longest:
        raise fail(fn, f"{name} = {value} is smaller than the longest sequence, {longest}")
    return value


def check_varlen(fn: str, q: object, k: object, v: object, *, names: tuple[str, str, str] = ("q", "k", "v"),
                 **arguments) -> CheckedCall:
    """Validate the ``flash_attn_varlen_*func`` family: packed q (total_q, nheads, headdim), k/v (total_k,
    nheads_k, headdim), and in ``arguments`` the int32 offsets ``cu_seqlens_q``/``cu_seqlens_k`` (batch + 1), the
    maxima ``max_seqlen_q``/``max_seqlen_k``, an optional ``block_table`` and ``flash_attn_func``'s options.
    With ``block_table``, k/v are a paged cache (num_pages, page_size, nheads_k, headdim) holding each sequence's
    keys from position 0."""
    cu_q, cu_k = arguments.pop("cu_seqlens_q"), arguments.pop("cu_seqlens_k")
    max_q, max_k = arguments.pop("max_seqlen_q"), arguments.pop("max_seqlen_k")
    block_table = arguments.pop("block_table", None)
    paged = block_table is not None
    q, k, v = _packed_layout(fn, q, k, v, names=names, paged=paged)
    cq = _validate_cu_seqlens(fn, "cu_seqlens_q", cu_q, q.shape[0], q)
    ck = _validate_cu_seqlens(fn, "cu_seqlens_k", cu_k, None if paged else k.shape[0], q)
    if len(cq) != len(ck):
        raise fail(fn, f"cu_seqlens_q and cu_seqlens_k must describe the same batch, got lengths {len(cq)} and "
                       f"{len(ck)}")
    lengths_k = [b - a for a, b in pairwise(ck)]
    varlen = Varlen(cu_q, cu_k, _validate_max_seqlen(fn, "max_seqlen_q", max_q, [b - a for a, b in pairwise(cq)]),
                    _validate_max_seqlen(fn, "max_seqlen_k", max_k, lengths_k))
    spec = flash_options(fn, q, batch=len(cq) - 1, **arguments)
    cache = None
    if paged:
        _validate_paged_inference(fn, spec, arguments["return_attn_probs"], (q, k, v))
        table = validate_block_table(fn, block_table, k, len(ck) - 1, lengths_k)
        cache = KeyCache(torch.zeros_like(cu_k[1:]), cu_k[1:] - cu_k[:-1], varlen.max_seqlen_k, block_table=table)
    return CheckedCall(q, k, v, dataclasses.replace(spec, varlen=varlen, cache=cache))


def _packed_layout(fn: str, q, k, v, *, names, paged: bool) -> tuple[torch.Tensor, ...]:
    layouts = ("(total_q, nheads, headdim)", "(num_pages, page_size, nheads_k, headdim), a paged cache since "
               "block_table is given" if paged else "(total_k, nheads_k, headdim)")
    for name, t, layout, ndim in zip(names, (q, k, v), (layouts[0], layouts[1], layouts[1]), (3, 3 + paged, 3 + paged),
                                     strict=True):
        validate_tensor(fn, name, t, ndim, layout)
    # The dense checks on a batch of one: same heads, head dims, dtypes and devices rules.
    flash_layout(fn, q[None], k[:1] if paged else k[None], v[:1] if paged else v[None], names)
    return q, k, v


def _validate_paged_inference(fn: str, spec: AttentionSpec, return_attn_probs: bool, tensors) -> None:
    if spec.dropout_p > 0 or return_attn_probs:
        raise fail(fn, "a paged K/V (block_table) is for inference: pass dropout_p=0 and return_attn_probs=False")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise fail(fn, "a paged K/V (block_table) is forward only: no gradients flow through it; run under "
                       "torch.no_grad() or pass detached tensors")


def validate_block_table(fn: str, table: object, k_cache: torch.Tensor, batch: int,
                         ends: list[int] | None = None) -> torch.Tensor:
    """An int32 (batch, pages per sequence) table whose pages hold positions 0..ends[b] - 1 of sequence b (the
    kind and shape alone when ``ends`` is None). Only the pages in use are checked (serving engines pad the rest
    with any value)."""
    if not isinstance(table, torch.Tensor):
        raise fail(fn, f"block_table must be an int32 torch.Tensor (batch, max_pages_per_seq) or None, got "
                       f"{type(table).__name__}", TypeError)
    if table.dtype != torch.int32:
        raise fail(fn, f"block_table must have dtype torch.int32, got {table.dtype}", TypeError)
    if table.dim() != 2 or table.shape[0] != batch:
        raise fail(fn, f"block_table must have shape (batch, max_pages_per_seq) with batch = {batch}, got "
                       f"{tuple(table.shape)}")
    if table.device != k_cache.device:
        raise fail(fn, f"block_table is on {table.device} but the cache is on {k_cache.device}")
    if ends is None:
        return table
    pages, page_size = k_cache.shape[0], k_cache.shape[1]
    needed = [-(-end // page_size) for end in ends]
    if max(needed, default=0) > table.shape[1]:
        b = max(range(len(ends)), key=lambda i: needed[i])
        raise fail(fn, f"sequence {b} reaches position {ends[b] - 1}, which needs {needed[b]} pages of "
                       f"{page_size}, but block_table has {table.shape[1]} per sequence")
    pages_in_use = torch.tensor(needed, device=table.device)[:, None]
    used = table[torch.arange(table.shape[1], device=table.device)[None, :] < pages_in_use]
    if used.numel():
        lo, hi = (int(x) for x in torch.aminmax(used))  # a host read: a bad page id would read stray memory
        if lo < 0 or hi >= pages:
            raise fail(fn, f"block_table holds page ids in [{lo}, {hi}] for the positions in use, but the cache "
                           f"has pages 0..{pages - 1}")
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
