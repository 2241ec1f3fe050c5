"""FlexAttention's ``BlockMask`` checked and turned into the backends' ``BlockSparse`` tiles.

A ``BlockMask`` (``torch.nn.attention.flex_attention.create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN)``) lists, per
(batch, head, query block), the key blocks that are partial (``kv_indices``, which need ``mask_mod``) and those that
are full (``full_kv_indices``); blocks in neither are empty. Our tiles are its blocks: ``BLOCK_SIZE`` becomes the
backends' tile, so an empty block is a skipped tile and a full one runs without mask code. ``mask_mod`` is evaluated
here once, on the partial blocks only: memory is the tile map plus those blocks, never Nq x Nk.

A batch or head dimension of 1 in the ``BlockMask`` is broadcast, and ``mask_mod`` is then evaluated at index 0
of it (the block lists were built that way too): it must not depend on that index. The conversion is kept per
``BlockMask`` (``PerTensor``), so the layers of a model that share one convert it once.
"""

from __future__ import annotations

import importlib.util

import torch

from ..backends.memo import PerTensor
from ..backends.spec import BlockSparse
from ._base import fail

_CONVERTED = PerTensor()


# Looked up once, at import (outside any torch.compile trace): torch 2.4 has no FlexAttention, and Dynamo there
# refuses to trace an import that fails instead of raising ImportError.
_HAS_FLEX = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def _block_mask_type() -> type | None:
    if not _HAS_FLEX:
        return None
    from torch.nn.attention.flex_attention import BlockMask

    return BlockMask


def is_block_mask(obj: object) -> bool:
    kind = _block_mask_type()
    return kind is not None and isinstance(obj, kind)


def validate_block_mask(fn: str, name: str, mask: object, *, batch: int, nheads: int, nq: int, nk: int,
                        ref: torch.Tensor) -> BlockSparse:
    """``BlockSparse`` tiles of a ``BlockMask`` for a call of ``batch`` x ``nheads`` x (nq, nk) scores on q's
    device."""
    if not is_block_mask(mask):
        raise fail(fn, f"{name} must be a torch.nn.attention.flex_attention.BlockMask (create_block_mask) or None, "
                       f"got {type(mask).__name__}", TypeError)
    if tuple(mask.seq_lengths) != (nq, nk):
        raise fail(fn, f"{name} was built for (Q_LEN, KV_LEN) = {tuple(mask.seq_lengths)}, but the call has "
                       f"{nq} queries and {nk} keys; build it with create_block_mask(mask_mod, B, H, {nq}, {nk})")
    bm, hm, qb, kb = mask.kv_indices.shape
    if bm not in (1, batch) or hm not in (1, nheads):
        raise fail(fn, f"{name} has (B, H) = ({bm}, {hm}); it must be 1 or the batch ({batch}) and 1 or the query "
                       f"heads ({nheads})")
    if mask.kv_indices.device != ref.device:
        raise fail(fn, f"{name} is on {mask.kv_indices.device} but q is on {ref.device}; move it with .to()")
    q_block, kv_block = (int(b) for b in mask.BLOCK_SIZE)
    if qb != -(-nq // q_block) or kb != -(-nk // kv_block):
        raise fail(fn, f"{name} has {qb} x {kb} blocks of {q_block} x {kv_block}, which do not tile ({nq}, {nk})")
    if torch.compiler.is_compiling():  # traced into the graph: no Python-side cache
        return _convert(fn, name, mask, nq=nq, nk=nk)
    # The same mask (its block lists and mask_mod) converts to the same tiles: once per model forward, not per layer.
    # Every list is part of the key (identity and version, held weakly): masks may share some of them.
    extra = (mask.mask_mod, tuple(mask.BLOCK_SIZE), tuple(mask.seq_lengths))
    return _CONVERTED.get(mask.kv_indices, extra, lambda: _convert(fn, name, mask, nq=nq, nk=nk),
                          also=(mask.kv_num_blocks, mask.full_kv_num_blocks, mask.full_kv_indices))


def _convert(fn: str, name: str, mask, *, nq: int, nk: int) -> BlockSparse:
    q_block, kv_block = (int(b) for b in mask.BLOCK_SIZE)
    kind = _tile_kind(mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)
    partial = kind == 1
    partial_id = torch.where(partial, partial.flatten().cumsum(0).view(partial.shape) - 1, -1).to(torch.int32)
    return BlockSparse(kind, partial_id, _partial_masks(fn, name, mask, partial, nq=nq, nk=nk), q_block, kv_block)


def _tile_kind(num: torch.Tensor, indices: torch.Tensor, full_num: torch.Tensor | None,
               full_indices: torch.Tensor | None) -> torch.Tensor:
    """(B, H, QB, KB) uint8 from the block lists: 1 where listed partial, 2 where listed full, else 0."""
    kind = torch.zeros(indices.shape, dtype=torch.uint8, device=indices.device)
    for count, idx, value in ((num, indices, 1), (full_num, full_indices, 2)):
        if count is None:
            continue
        listed = torch.arange(idx.shape[-1], device=idx.device) < count[..., None]
        # Entries past a row's count are padding (any value, -1 in hand-built masks): scatter them as 0 at 0.
        at = torch.where(listed, idx.long(), 0)
        kind.scatter_reduce_(-1, at, (listed * value).to(torch.uint8), reduce="amax")
    return kind


def _partial_masks(fn: str, name: str, mask, partial: torch.Tensor, *, nq: int, nk: int) -> torch.Tensor:
    """(P, q_block, kv_block) bool: ``mask_mod`` on each partial block's elements (False past the sequences)."""
    q_block, kv_block = (int(b) for b in mask.BLOCK_SIZE)
    device = partial.device
    at = partial.nonzero()  # (P, 4): batch, head, query block, key block
    b, h = at[:, 0, None, None], at[:, 1, None, None]
    rows = at[:, 2, None, None] * q_block + torch.arange(q_block, device=device)[None, :, None]
    cols = at[:, 3, None, None] * kv_block + torch.arange(kv_block, device=device)[None, None, :]
    inside = (rows < nq) & (cols < nk)
    rows, cols = rows.clamp(max=nq - 1), cols.clamp(max=nk - 1)
    try:
        allowed = mask.mask_mod(b, h, rows, cols)
    except Exception as err:
        raise fail(fn, f"{name}.mask_mod(b, h, q_idx, kv_idx) failed on index tensors ({type(err).__name__}: "
                       f"{err}); write it with tensor operations, as FlexAttention requires") from err
    if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
        raise fail(fn, f"{name}.mask_mod must return a boolean tensor, got "
                       f"{getattr(allowed, 'dtype', type(allowed).__name__)}", TypeError)
    return (allowed.expand(at.shape[0], q_block, kv_block) & inside).contiguous()
