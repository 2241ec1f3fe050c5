"""Attention modules: ``MultiheadAttention`` (a drop-in for ``torch.nn.MultiheadAttention``) and ``SelfAttention``
(a compact transformer block's attention with rotary embeddings, GQA and a KV cache for generation).

Example::

    >>> attn = SelfAttention(dim=64, num_heads=8, num_kv_heads=2)
    >>> x = torch.randn(2, 10, 64)
    >>> attn(x).shape
    torch.Size([2, 10, 64])
    >>> cache = attn.new_cache(batch_size=2, max_seqlen=32)
    >>> with torch.no_grad():
    ...     prompt = attn(x, cache=cache)           # prefill: 10 tokens into the cache
    ...     step = attn(x[:, :1], cache=cache)      # one decode step
    >>> cache.seqlens.tolist(), torch.allclose(prompt, attn(x), atol=1e-5)
    ([11, 11], True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import checks
from .backends.spec import FP8_DTYPES, accumulation_dtype
from .interface import attention_with_weights, flash_attn_func, flash_attn_with_kvcache, scaled_dot_product_attention
from .rotary import apply_rotary

__all__ = ["KVCache", "MultiheadAttention", "SelfAttention"]


class MultiheadAttention(nn.Module):
    """``torch.nn.MultiheadAttention`` computed by flashattn: same constructor, parameters (state dicts load both
    ways), forward arguments, mask conventions and return values.

    Args:
        embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype:
            as in torch; ``embed_dim`` must divide by ``num_heads``.

    Forward:
        query (L, N, E) or (N, L, E) with ``batch_first``, or unbatched (L, E); key/value (S, N, kdim/vdim) likewise.
        key_padding_mask: (N, S), True (or -inf) = ignore that key. attn_mask: (L, S) or (N * num_heads, L, S),
        True = may NOT attend (torch's MHA convention), or an additive float mask. is_causal: with no attn_mask,
        apply the causal mask (query i sees keys j <= i); with one, attn_mask is used as given.
        need_weights: also return the attention weights (materialised; False is the fast path), averaged over
        heads unless ``average_attn_weights=False``.

    Returns:
        ``(attn_output, attn_weights)``: attn_output like query; attn_weights (N, L, S) or (N, num_heads, L, S),
        or None when ``need_weights=False``.

    Differences from torch: a query that may attend to no key outputs 0 (torch: NaN); ``is_causal`` works
    without an ``attn_mask``; the returned weights carry no gradient.

    Inside torch's transformer modules (``TransformerEncoderLayer``, ``TransformerEncoder``,
    ``TransformerDecoderLayer``, ``TransformerDecoder``, ``nn.Transformer``), put there by replacing
    ``self_attn`` / ``multihead_attn``, this module's attention is what runs, in training and inference: torch's
    fused inference path (``torch._transformer_encoder_layer_fwd``) is not used (see ``__init__``). A nested
    tensor query / key / value (batch-first, no masks; what ``TransformerEncoder`` passes its layers in inference
    with a ``src_key_padding_mask``) is padded, masked by its lengths and the output nested like the query; the
    weights, if asked for, stay padded.

    Example::

        >>> mha = MultiheadAttention(32, 4, batch_first=True)
        >>> x = torch.randn(2, 7, 32)
        >>> out, _ = mha(x, x, x, need_weights=False, is_causal=True)
        >>> out.shape
        torch.Size([2, 7, 32])
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0,  # noqa: PLR0913 (torch's signature)
                 bias: bool = True, add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        checks.check_multihead_config("MultiheadAttention", embed_dim=embed_dim, num_heads=num_heads, dropout=dropout)
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.dropout, self.batch_first = embed_dim, num_heads, dropout, batch_first
        self.head_dim = embed_dim // num_heads
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()
        # torch's TransformerEncoderLayer runs a fused C++ layer in inference (eval, no grad) whenever its self_attn
        # looks like torch's MHA (batch_first, in_proj_bias, _qkv_same_embed_dim, even num_heads), which ours does
        # by design; that kernel reads our weights and never calls us. Of its checks, the one about the module
        # rather than its attributes is that a fused layer cannot run a submodule's hooks, so with any hook present
        # it keeps to its Python path: this pre-hook is that reason, per instance, kept by copies (TransformerEncoder
        # clones its layer), costing one no-op call. The other levers lie or cost more: faking batch_first or
        # _qkv_same_embed_dim misleads code that reads them; has_torch_function needs a Parameter subclass that
        # routes every op through Python; patching torch changes torch's own MHA. There is deliberately no
        # merge_masks (the fused path's first call), so a torch that took that path anyway fails loudly instead of
        # silently bypassing us. TransformerEncoder's nested-tensor conversion ignores hooks: see _forward_nested.
        self.register_forward_pre_hook(_keep_torch_layers_unfused)

    def _reset_parameters(self) -> None:  # torch's initialisation, so that training recipes carry over
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        e = self.embed_dim
        b = (None, None, None) if self.in_proj_bias is None else self.in_proj_bias.split(e)
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight.split(e)
            if query is key and key is value:  # self-attention: one matmul
                return F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        else:
            w = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        return tuple(F.linear(x, wi, bi) for x, wi, bi in zip((query, key, value), w, b, strict=True))

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        checks.check_multihead_inputs("MultiheadAttention", query, key, value, embed_dim=self.embed_dim,
                                      batch_first=self.batch_first,
                                      masked=attn_mask is not None or key_padding_mask is not None)
        if query.is_nested or key.is_nested:
            return self._forward_nested(query, key, value, need_weights=need_weights,
                                        average_attn_weights=average_attn_weights, is_causal=is_causal)
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (x.unsqueeze(0) for x in (query, key, value))
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # work batch-first: (N, L, E)
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        n, length, h, d = query.shape[0], query.shape[1], self.num_heads, self.head_dim
        q, k, v = self._project(query, key, value)
        if self.bias_k is not None:  # one learned key/value appended to every sequence
            k = torch.cat([k, self.bias_k.expand(n, 1, -1)], dim=1)
            v = torch.cat([v, self.bias_v.expand(n, 1, -1)], dim=1)
            attn_mask, key_padding_mask = _pad_key_dim(attn_mask), _pad_key_dim(key_padding_mask)
        if self.add_zero_attn:  # one all-zero key/value appended after the projections
            k = torch.cat([k, k.new_zeros(n, 1, self.embed_dim)], dim=1)
            v = torch.cat([v, v.new_zeros(n, 1, self.embed_dim)], dim=1)
            attn_mask, key_padding_mask = _pad_key_dim(attn_mask), _pad_key_dim(key_padding_mask)
        s = k.shape[1]
        q, k, v = (x.reshape(n, -1, h, d).transpose(1, 2) for x in (q, k, v))  # (N, H, L or S, d) views
        mask = _torch_mha_mask(attn_mask, key_padding_mask, (n, h, length, s), q.dtype)
        causal = is_causal and mask is None
        dropout = self.dropout if self.training else 0.0
        if need_weights:
            out, weights = attention_with_weights(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            out = scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
            weights = None
        out = self.out_proj(out.transpose(1, 2).reshape(n, length, self.embed_dim))
        if unbatched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _forward_nested(self, query: Tensor, key: Tensor, value: Tensor, **options) -> tuple[Tensor, Tensor | None]:
        """Nested (strided or jagged) inputs as padded ones with a key padding mask from the key lengths; the
        output is nested again like the query. Self-attention stays one object, so one projection matmul."""
        q, q_lengths = _unnest(query)
        k, k_lengths = (q, q_lengths) if key is query else _unnest(key)
        v = k if value is key else _unnest(value)[0]
        padding = None if k_lengths is None else torch.arange(k.shape[1], device=k.device) >= k_lengths[:, None]
        out, weights = self.forward(q, k, v, key_padding_mask=padding, **options)
        if q_lengths is None:
            return out, weights
        rows = [o[:n] for o, n in zip(out, q_lengths.tolist(), strict=True)]
        return torch.nested.as_nested_tensor(rows, layout=query.layout), weights


def _keep_torch_layers_unfused(module: nn.Module, args: tuple) -> None:
    """MultiheadAttention's forward pre-hook: does nothing; its presence keeps torch's transformer layers on
    their Python path, which calls our forward (see ``MultiheadAttention.__init__``)."""


def _unnest(x: Tensor) -> tuple[Tensor, Tensor | None]:
    """A nested (N, L_i, E) tensor as a zero-padded (N, max L_i, E) one and the lengths L_i; others as given."""
    if not x.is_nested:
        return x, None
    lengths = torch.tensor([t.shape[0] for t in x.unbind()], device=x.device)
    return torch.nested.to_padded_tensor(x, 0.0), lengths


def _pad_key_dim(mask: Tensor | None) -> Tensor | None:
    """One more key column that everyone may attend (False / 0), for add_bias_kv and add_zero_attn."""
    return None if mask is None else F.pad(mask, (0, 1))


def _torch_mha_mask(attn_mask: Tensor | None, key_padding_mask: Tensor | None, shape: tuple[int, int, int, int],
                    dtype: torch.dtype) -> Tensor | None:
    """torch MHA's masks (True = blocked, or additive) for (N, H, L, S) = ``shape`` merged into one SDPA mask
    (True = allowed, or additive) broadcastable to (N, H, L, S)."""
    checks.check_multihead_masks("MultiheadAttention", attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                 shape=shape)
    n, h, length, s = shape
    masks = []
    if attn_mask is not None:
        masks.append(attn_mask.reshape(n, h, length, s) if attn_mask.dim() == 3 else attn_mask)
    if key_padding_mask is not None:
        masks.append(key_padding_mask.reshape(n, 1, 1, s))
    if not masks:
        return None
    if all(m.dtype == torch.bool for m in masks):
        blocked = masks[0] if len(masks) == 1 else masks[0] | masks[1]
        return ~blocked
    total = None
    for m in masks:
        m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, -math.inf) if m.dtype == torch.bool \
            else m.to(dtype)
        total = m if total is None else total + m
    return total


@dataclass
class KVCache:
    """One layer's key/value cache for generation: ``k``, ``v`` (batch, max_seqlen, kv_heads, head_dim) and the
    number of tokens stored per sequence, ``seqlens`` (batch,) int32. ``SelfAttention`` appends in place. An FP8
    cache (``new_cache(dtype=torch.float8_e4m3fn)``) also has ``k_descale``, ``v_descale`` (batch, kv_heads)
    float32: new tokens are stored as ``k / k_descale`` (saturated) and read as ``cache * k_descale``."""

    k: Tensor
    v: Tensor
    seqlens: Tensor
    k_descale: Tensor | None = None
    v_descale: Tensor | None = None

    def __post_init__(self) -> None:
        # Fixed addresses for torch.compile, as Hugging Face's StaticCache marks its own: a compiled decode step
        # that appends to the cache in place is then captured in a CUDA graph (mode="reduce-overhead") instead of
        # skipped for mutating its inputs.
        # Unguarded: a new cache must not recompile the step (guarded marks are torch < 2.10's default).
        if torch.compiler.is_compiling():
            return
        for t in (self.k, self.v, self.seqlens, self.k_descale, self.v_descale):
            if t is not None:
                torch._dynamo.mark_static_address(t, guard=False)

    def reset(self) -> None:
        """Forget the stored tokens (the memory is reused)."""
        self.seqlens.zero_()


class SelfAttention(nn.Module):
    """The attention of a decoder block: x (batch, seqlen, dim) -> (batch, seqlen, dim), with rotary position
    embeddings (GPT-NeoX halves, or GPT-J pairs with ``rotary_interleaved``), grouped-query attention
    (``num_kv_heads`` < ``num_heads``), an optional sliding window, logit softcap and learnable attention sinks,
    and a KV cache for generation (``new_cache``; inference only).

    Args:
        dim: model width. num_heads: query heads. num_kv_heads: key/value heads (default num_heads; must divide
            it). head_dim: default dim // num_heads.
        causal: decoder attention (default True). window_size, softcap: as in ``flash_attn_func``.
        rotary: rotate q and k by position (default True); rotary_dim (default head_dim, even), rotary_base.
        dropout: attention dropout while training. bias: biases in the projections.
        learnable_sink: give each head a learned sink logit (the parameter ``sink`` (num_heads,), initialised to
            0) that joins the softmax denominator and takes no value, as gpt-oss does.
        max_seqlen: positions the rotary table starts with (it grows on demand).
        fp8: attend in ``flash_attn_func``'s FP8 training mode (q, k, v quantized to e4m3 per sequence and kv
            head, gradients straight through; for float16 or bfloat16 weights, without dropout); the KV cache
            path is unchanged (``new_cache(dtype=torch.float8_e4m3fn)`` stores the cache in FP8).

    Example::

        >>> layer = SelfAttention(64, 4, 2, learnable_sink=True)
        >>> layer(torch.randn(2, 10, 64)).shape, layer.sink.shape
        (torch.Size([2, 10, 64]), torch.Size([4]))
    """

    def __init__(self, dim: int, num_heads: int,  # noqa: PLR0913 (a module's options, keyword-only after the sizes)
                 num_kv_heads: int | None = None, head_dim: int | None = None, *,
                 causal: bool = True, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 rotary: bool = True, rotary_dim: int | None = None, rotary_base: float = 10000.0,
                 rotary_interleaved: bool = False, dropout: float = 0.0, bias: bool = False,
                 learnable_sink: bool = False, max_seqlen: int = 2048, fp8: bool = False, device=None,
                 dtype=None) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = checks.check_self_attention_config("SelfAttention", dim=dim, heads=(num_heads, num_kv_heads),
                                                      head_dim=head_dim, dropout=dropout, fp8=fp8)
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary:
            checks.check_rotary_dim("SelfAttention", rotary_dim=rotary_dim, head_dim=head_dim)
        factory = {"device": device, "dtype": dtype}
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.causal, self.window_size, self.softcap, self.dropout = causal, tuple(window_size), softcap, dropout
        self.rotary, self.rotary_dim, self.rotary_base = rotary, rotary_dim, rotary_base
        self.rotary_interleaved, self.fp8 = rotary_interleaved, bool(fp8)
        self.qkv = nn.Linear(dim, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias, **factory)
        self.out = nn.Linear(num_heads * head_dim, dim, bias=bias, **factory)
        self.sink = nn.Parameter(torch.zeros(num_heads, **factory)) if learnable_sink else None
        self._cos = self._sin = None
        self._rotary_table(max_seqlen, device)

    def _rotary_table(self, length: int, device, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """cos, sin (length, rotary_dim / 2): the angle of pair i at position p is p * base^(-2i/r), computed in
        float64 (float32 angles are off by ~p * 1e-7 rad) and kept in float32, or float64 for a float64 model."""
        device = torch.device("cpu" if device is None else device)
        table = self._cos
        if table is None or table.shape[0] < length or table.device != device or table.dtype != dtype:
            length = max(length, 0 if table is None else table.shape[0])
            inv_freq = self.rotary_base ** (-torch.arange(0, self.rotary_dim, 2, device=device,
                                                          dtype=torch.float64) / self.rotary_dim)
            angles = torch.outer(torch.arange(length, device=device, dtype=torch.float64), inv_freq)
            self._cos, self._sin = angles.cos().to(dtype), angles.sin().to(dtype)
        return self._cos, self._sin

    def new_cache(self, batch_size: int, max_seqlen: int, *, device=None, dtype=None,
                  descale: float = 1.0) -> KVCache:
        """An empty cache for ``batch_size`` sequences of up to ``max_seqlen`` tokens (prompt + generated), on the
        device and in the dtype of the weights unless given. In FP8 (``torch.float8_e4m3fn`` or ``float8_e5m2``:
        half the bytes of bf16, for 16-bit weights) keys and values are stored divided by ``descale``."""
        checks.check_generation("SelfAttention.new_cache", causal=self.causal)
        weight = self.qkv.weight
        device, dtype = device or weight.device, dtype or weight.dtype
        shape = (batch_size, max_seqlen, self.num_kv_heads, self.head_dim)
        scales = {}
        if dtype in FP8_DTYPES:
            scales = {name: torch.full((batch_size, self.num_kv_heads), float(descale), device=device)
                      for name in ("k_descale", "v_descale")}
        return KVCache(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype),
                       torch.zeros(batch_size, device=device, dtype=torch.int32), **scales)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The attention of the cache-free path: q (batch, seqlen, num_heads, head_dim) and k, v (batch, seqlen,
        num_kv_heads, head_dim), already rotated, -> (batch, seqlen, num_heads, head_dim). A subclass may override
        it to swap the kernel, e.g. for a baseline run with torch's SDPA (examples/train_gpt.py)."""
        return flash_attn_func(q, k, v, dropout_p=self.dropout if self.training else 0.0, causal=self.causal,
                               window_size=self.window_size, softcap=self.softcap, learnable_sink=self.sink,
                               fp8=self.fp8)

    def forward(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        """x (batch, seqlen, dim). With ``cache``, the seqlen new tokens follow the ones already stored: their
        keys/values are appended in place and ``cache.seqlens`` advances by seqlen."""
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        options = {"causal": self.causal, "window_size": self.window_size, "softcap": self.softcap,
                   "learnable_sink": self.sink}
        if cache is None:
            if self.rotary:
                cos, sin = self._rotary_table(n, x.device, accumulation_dtype(x.dtype))
                pos = torch.arange(n, device=x.device)[None]  # (1, n): the gathered angles broadcast over batch
                q = apply_rotary(q, cos, sin, pos, interleaved=self.rotary_interleaved)
                k = apply_rotary(k, cos, sin, pos, interleaved=self.rotary_interleaved)
            out = self.attend(q, k, v)
        else:
            # The weights or x may want gradients that the cache path cannot give.
            checks.check_generation("SelfAttention", wants_grad=qkv.requires_grad)
            rotary = {}
            if self.rotary:
                cos, sin = self._rotary_table(cache.k.shape[1], x.device, accumulation_dtype(x.dtype))
                # float32 tables, as in the training path, so both rotate identically in low precision.
                rotary = {"rotary_cos": cos, "rotary_sin": sin, "rotary_interleaved": self.rotary_interleaved}
            out = flash_attn_with_kvcache(q, cache.k, cache.v, k, v, cache_seqlens=cache.seqlens, **rotary, **options,
                                          k_descale=cache.k_descale, v_descale=cache.v_descale)
            cache.seqlens += n
        return self.out(out.reshape(b, n, self.num_heads * self.head_dim))
