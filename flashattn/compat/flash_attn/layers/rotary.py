"""``flash_attn.layers.rotary`` on flashattn: rotary position embeddings (RoPE) with flash_attn 2.8's functions and
``RotaryEmbedding`` module, computed by ``flashattn.rotary`` (float32 arithmetic, the input's dtype out) on any
device, differentiable.

Example (after ``flashattn.install_as_flash_attn()``)::

    >>> from flash_attn.layers.rotary import RotaryEmbedding, apply_rotary_emb
    >>> x = torch.randn(2, 16, 4, 64)
    >>> inv_freq = 1.0 / 10000 ** (torch.arange(0, 32, 2) / 32)
    >>> angles = torch.outer(torch.arange(16.0), inv_freq)  # (seqlen, rotary_dim / 2)
    >>> apply_rotary_emb(x, angles.cos(), angles.sin()).shape
    torch.Size([2, 16, 4, 64])
"""

from __future__ import annotations

import torch
from torch import Tensor

from .... import checks
from ....rotary import apply_rotary, positions

__all__ = ["RotaryEmbedding", "apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_kv_",
           "apply_rotary_emb_qkv_", "apply_rotary_emb_torch", "rotate_half"]


def rotate_half(x: Tensor, interleaved: bool = False) -> Tensor:
    """(-x2, x1) for the halves (x1, x2) of the last dim, or for its (even, odd) pairs when ``interleaved``."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def apply_rotary_emb_torch(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """The textbook formula, x * cos + rotate_half(x) * sin on the first rotary_dim = 2 * cos.shape[-1] dims, in
    x's dtype: x (batch, seqlen, nheads, headdim); cos, sin (seqlen, rotary_dim / 2) or (batch, seqlen, ...)."""
    rotary_dim = cos.shape[-1] * 2
    checks.check_rotary_dim("apply_rotary_emb_torch", rotary_dim=rotary_dim, head_dim=x.shape[-1])
    cos, sin = ((t.repeat_interleave(2, dim=-1) if interleaved else torch.cat((t, t), dim=-1)).unsqueeze(-2)
                for t in (cos, sin))
    rot = x[..., :rotary_dim]
    return torch.cat((rot * cos + rotate_half(rot, interleaved) * sin, x[..., rotary_dim:]), dim=-1)


def _positions(fn: str, x: Tensor, seqlen_offsets: int | Tensor, cu_seqlens: Tensor | None,
               table_rows: int) -> Tensor:
    """Each token's row of the cos/sin table: (batch, seqlen), (1, seqlen), or (1, total) for a packed batch."""
    if cu_seqlens is None:  # flashattn.rotary's positions: start_b + t, one start per sequence or one for all
        start = (seqlen_offsets.reshape(-1) if isinstance(seqlen_offsets, Tensor)
                 else torch.tensor([checks.validate_int(fn, "seqlen_offsets", seqlen_offsets)]))
        pos = positions(start.to(x.device), x.shape[1])
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths, output_size=x.shape[0])
        offsets = (seqlen_offsets.long() if isinstance(seqlen_offsets, Tensor)
                   else torch.full_like(lengths, checks.validate_int(fn, "seqlen_offsets", seqlen_offsets)))
        offsets = torch.repeat_interleave(offsets.to(x.device), lengths, output_size=x.shape[0])
        pos = (torch.arange(x.shape[0], device=x.device) - starts + offsets)[None]
    if pos.numel() and not torch.compiler.is_compiling() and (int(pos.min()) < 0 or int(pos.max()) >= table_rows):
        raise checks.fail(fn, f"positions up to {int(pos.max())} (seqlen plus seqlen_offsets) need a cos/sin table "
                              f"of more than that many rows; cos has {table_rows}")
    return pos


def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, inplace: bool = False,
                     seqlen_offsets: int | Tensor = 0, cu_seqlens: Tensor | None = None,
                     max_seqlen: int | None = None) -> Tensor:
    """Rotate the first rotary_dim = 2 * cos.shape[1] dims of x by the angles of each token's position.

    Args:
        x: (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with ``cu_seqlens``.
        cos, sin: (seqlen_rotary, rotary_dim / 2): row t holds the cos/sin of position t's angles.
        interleaved: rotate pairs (x[2i], x[2i + 1]) (GPT-J) instead of the halves (x[i], x[i + r/2]) (GPT-NeoX).
        inplace: write the result into x (and return x).
        seqlen_offsets: int, or (batch,): the position of each sequence's first token (a KV cache's length).
        cu_seqlens: (batch + 1,) int32 offsets of a packed batch; max_seqlen: its longest sequence (unused: the
            positions follow from the offsets).

    Returns:
        A tensor of x's shape and dtype (x itself when ``inplace``).
    """
    fn = "apply_rotary_emb"
    checks.check_rotary_dim(fn, rotary_dim=2 * cos.shape[-1], head_dim=x.shape[-1])
    packed = cu_seqlens is not None
    pos = _positions(fn, x, seqlen_offsets, cu_seqlens, cos.shape[0])
    out = apply_rotary(x[None] if packed else x, cos, sin, pos, interleaved=interleaved)
    out = out[0] if packed else out
    return x.copy_(out) if inplace else out


apply_rotary_emb_func = apply_rotary_emb  # flash_attn's older name


def apply_rotary_emb_qkv_(qkv: Tensor, cos: Tensor, sin: Tensor, cos_k: Tensor | None = None,
                          sin_k: Tensor | None = None, interleaved: bool = False, seqlen_offsets: int | Tensor = 0,
                          num_heads_q: int | None = None) -> Tensor:
    """Rotate q and k of a packed qkv in place: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen,
    num_heads_q + 2 * num_heads_k, headdim) with ``num_heads_q`` (GQA). ``cos_k``/``sin_k`` (default cos/sin)
    rotate k (XPos scales them differently). Returns qkv."""
    if qkv.dim() == 5:
        q, k = qkv[:, :, 0], qkv[:, :, 1]
    else:
        if num_heads_q is None:
            raise checks.fail("apply_rotary_emb_qkv_", f"qkv of shape {tuple(qkv.shape)} (batch, seqlen, "
                                                       "num_heads_q + 2 * num_heads_k, headdim) needs num_heads_q")
        num_heads_k = (qkv.shape[2] - num_heads_q) // 2
        q, k = qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q : num_heads_q + num_heads_k]
    apply_rotary_emb(q, cos, sin, interleaved, inplace=True, seqlen_offsets=seqlen_offsets)
    apply_rotary_emb(k, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k, interleaved, inplace=True,
                     seqlen_offsets=seqlen_offsets)
    return qkv


def apply_rotary_emb_kv_(kv: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False,
                         seqlen_offsets: int | Tensor = 0) -> Tensor:
    """Rotate k of a packed kv (batch, seqlen, 2, nheads, headdim) in place; returns kv."""
    apply_rotary_emb(kv[:, :, 0], cos, sin, interleaved, inplace=True, seqlen_offsets=seqlen_offsets)
    return kv


class RotaryEmbedding(torch.nn.Module):
    """flash_attn's rotary module: cos/sin tables of ``dim`` rotary dims, grown on demand, applied in place to a
    packed qkv (or to q and a packed kv). ``scale_base`` turns on XPos (q scaled up, k down with the distance).

    Example::

        >>> rotary = RotaryEmbedding(32)
        >>> qkv = torch.randn(2, 16, 3, 4, 64)
        >>> rotary(qkv).shape
        torch.Size([2, 16, 3, 4, 64])
    """

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, scale_base: float | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.dim, self.base = dim, float(base)
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        self.interleaved, self.scale_base = interleaved, scale_base
        scale = ((torch.arange(0, dim, 2, device=device, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
                 if scale_base is not None else None)
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _compute_inv_freq(self, device=None) -> Tensor:
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim))

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None) -> None:
        stale = (self._cos_cached is None or seqlen > self._seq_len_cached or self._cos_cached.device != device
                 or self._cos_cached.dtype != dtype or (self.training and self._cos_cached.is_inference()))
        if not stale:
            return
        self._seq_len_cached = seqlen
        # Angles in float32 whatever the module's dtype: positions times frequencies lose too much in bf16.
        inv_freq = self._compute_inv_freq(device) if self.inv_freq.dtype != torch.float32 else self.inv_freq
        freqs = torch.outer(torch.arange(seqlen, device=device, dtype=torch.float32), inv_freq)
        if self.scale is None:
            self._cos_cached, self._sin_cached = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
            return
        power = (torch.arange(seqlen, dtype=self.scale.dtype, device=self.scale.device) - seqlen // 2)
        scale = self.scale.to(device=power.device) ** (power / self.scale_base)[:, None]
        self._cos_cached, self._sin_cached = (torch.cos(freqs) * scale).to(dtype), (torch.sin(freqs) * scale).to(dtype)
        self._cos_k_cached = (torch.cos(freqs) / scale).to(dtype)
        self._sin_k_cached = (torch.sin(freqs) / scale).to(dtype)

    def forward(self, qkv: Tensor, kv: Tensor | None = None, seqlen_offset: int | Tensor = 0,
                max_seqlen: int | None = None, num_heads_q: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """qkv (batch, seqlen, 3, nheads, headdim) (or GQA's (batch, seqlen, num_heads_q + 2 * num_heads_k,
        headdim) with ``num_heads_q``), or q (batch, seqlen, nheads, headdim) when ``kv`` (batch, seqlen, 2,
        nheads_k, headdim) is given; rotated in place and returned. ``seqlen_offset``: int or (batch,); with a
        tensor, pass ``max_seqlen`` to size the tables."""
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        xpos = self.scale is not None
        cos_k = self._cos_k_cached if xpos else self._cos_cached
        sin_k = self._sin_k_cached if xpos else self._sin_cached
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached, cos_k if xpos else None,
                                         sin_k if xpos else None, interleaved=self.interleaved,
                                         seqlen_offsets=seqlen_offset, num_heads_q=num_heads_q)
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, interleaved=self.interleaved, inplace=True,
                             seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, cos_k, sin_k, interleaved=self.interleaved, seqlen_offsets=seqlen_offset)
        return q, kv
