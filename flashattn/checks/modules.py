"""Checks of the library's other public pieces: merging partial results, padding, context parallelism, and the
``flashattn.nn`` modules' configuration and inputs."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from ._base import fail, validate_real
from .flash import CheckedCall, check_flash


def check_merge(fn: str, *, out_a: object, lse_a: object, out_b: object, lse_b: object) -> None:
    """Two partial results of ``flash_attn_func``'s layouts: out (..., seqlen, nheads, headdim), lse (..., nheads,
    seqlen), floating point, shapes matching pairwise."""
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(t, Tensor):
            raise fail(fn, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if not t.is_floating_point():
            raise fail(fn, f"{name} must be floating point, got {t.dtype}", TypeError)
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise fail(fn, f"out_a/out_b shapes {tuple(out_a.shape)}/{tuple(out_b.shape)} and lse_a/lse_b shapes "
                       f"{tuple(lse_a.shape)}/{tuple(lse_b.shape)} must match pairwise")
    expected = (*out_a.shape[:-3], out_a.shape[-2], out_a.shape[-3]) if out_a.dim() >= 3 else None
    if expected is None or tuple(lse_a.shape) != expected:
        raise fail(fn, f"out (..., seqlen, nheads, headdim) = {tuple(out_a.shape)} needs lse of shape (..., nheads, "
                       f"seqlen) = {expected}, got {tuple(lse_a.shape)}")


def check_padding_mask(fn: str, name: str, *, hidden_states: Tensor, mask: object) -> None:
    """A (batch, seqlen) mask of the tokens of ``hidden_states`` (batch, seqlen, ...)."""
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        raise fail(fn, f"{name} must be a (batch, seqlen) tensor, got "
                       f"{tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__}")
    if tuple(hidden_states.shape[:2]) != tuple(mask.shape):
        raise fail(fn, f"hidden_states starts with {tuple(hidden_states.shape[:2])} but {name} is "
                       f"{tuple(mask.shape)}; they must agree on (batch, seqlen)")


def check_pad(fn: str, *, hidden_states: Tensor, indices: Tensor) -> None:
    if hidden_states.shape[0] != indices.shape[0]:
        raise fail(fn, f"hidden_states has {hidden_states.shape[0]} tokens but indices has {indices.shape[0]}; pass "
                       "the indices unpad_input returned with it")


def check_context_parallel(fn: str, q: object, k: object, v: object, *, layout: str = "contiguous",
                           **options) -> CheckedCall:
    """``flash_attn_func``'s checks on the local shards (``options``: its keyword arguments), plus what context
    parallelism needs: self-attention (q and k/v shards of the same length), no dropout, even zigzag shards. The
    lengths across ranks are checked by ``check_shard_lengths``."""
    if not dist.is_available() or not dist.is_initialized():
        raise fail(fn, "torch.distributed is not initialised; call torch.distributed.init_process_group")
    call = check_flash(fn, q, k, v, **options)
    if call.spec.dropout_p > 0:
        raise fail(fn, "dropout_p must be 0: a dropout mask drawn per block would not match one device's and could "
                       "repeat across blocks; apply dropout outside attention or use one device")
    if call.q.shape[1] != call.k.shape[1]:
        raise fail(fn, f"context parallelism shards one sequence for q, k and v alike; got local lengths "
                       f"{call.q.shape[1]} (q) and {call.k.shape[1]} (k)")
    if layout == "zigzag" and call.q.shape[1] % 2:
        raise fail(fn, f"a zigzag shard holds two equal chunks, so its length must be even; got {call.q.shape[1]}")
    return call


def check_choice(fn: str, name: str, value: object, allowed: tuple[str, ...]) -> str:
    """``value`` of the argument ``name`` is one of the names in ``allowed`` (a sharding layout, say)."""
    if value not in allowed:
        raise fail(fn, f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def check_divisible(fn: str, *, tokens: int, pieces: int, why: str) -> None:
    """A sequence of ``tokens`` splits into ``pieces`` equal chunks (``why`` names the layout and world)."""
    if tokens % pieces:
        raise fail(fn, f"a sequence of {tokens} tokens does not split into {pieces} equal chunks ({why}); pad it to "
                       f"a multiple of {pieces}")


def check_registration_name(fn: str, name: object) -> str:
    if not isinstance(name, str) or not name:
        raise fail(fn, f"name must be a non-empty string, got {name!r}")
    return name


def check_shard_lengths(fn: str, lengths: list[int]) -> None:
    """Every rank holds the same number of tokens."""
    if len(set(lengths)) != 1:
        raise fail(fn, f"every rank must hold the same number of tokens, got {lengths}; shard with "
                       "flashattn.distributed.shard (pad the sequence to a multiple)")


def check_head_parallel(fn: str, *, nheads: int, nheads_k: int, world: int) -> None:
    """Ulysses: heads and key/value heads split evenly over the ranks."""
    if nheads % world or nheads_k % world:
        raise fail(fn, f"nheads ({nheads}) and nheads_k ({nheads_k}) must be multiples of the world size {world}; "
                       "use ring_flash_attn_func or allgather_flash_attn_func")


def check_heads_per_step(fn: str, value: object, default: int) -> int:
    """All-gather: how many key/value heads to gather at a time (None: all)."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise fail(fn, f"kv_heads_per_step must be a positive int or None, got {value!r}")
    return value


def check_multihead_config(fn: str, *, embed_dim: object, num_heads: object, dropout: object) -> None:
    """``MultiheadAttention``'s constructor arguments, as torch's module requires them."""
    if not isinstance(embed_dim, int) or not isinstance(num_heads, int) or embed_dim <= 0 or num_heads <= 0:
        raise fail(fn, f"embed_dim and num_heads must be positive ints, got {embed_dim!r} and {num_heads!r}")
    if embed_dim % num_heads:
        raise fail(fn, f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
    if not 0.0 <= validate_real(fn, "dropout", dropout) < 1.0:
        raise fail(fn, f"dropout must be in [0, 1), got {dropout!r}")


def check_multihead_inputs(fn: str, query: Tensor, key: Tensor, value: Tensor, *, embed_dim: int,
                           batch_first: bool = True, masked: bool = False) -> None:
    """query, key, value: all 3-D (batched) or 2-D (unbatched); nested ones (any of them) as ``_check_nested``.
    ``masked``: an attn_mask or key_padding_mask was passed."""
    if query.is_nested or key.is_nested or value.is_nested:
        _check_nested(fn, query, key, value, batch_first=batch_first, masked=masked)
    if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
        raise fail(fn, f"query, key and value must all be 3-D (batched) or 2-D (unbatched), got {query.dim()}, "
                       f"{key.dim()} and {value.dim()} dims")
    if query.size(-1) != embed_dim:  # size, not shape: a nested tensor has no shape
        raise fail(fn, f"query has embedding size {query.size(-1)}, expected embed_dim = {embed_dim}")


def _check_nested(fn: str, query: Tensor, key: Tensor, value: Tensor, *, batch_first: bool, masked: bool) -> None:
    """Nested inputs hold one (L_i, E) sequence per batch entry, so the module must be batch_first; their lengths
    are the padding, so no masks (torch's MHA refuses them too); keys and values pair up, so both or neither."""
    if not batch_first:
        raise fail(fn, "nested tensor inputs are batch-first; construct the module with batch_first=True")
    if masked:
        raise fail(fn, "attn_mask and key_padding_mask cannot be combined with nested tensor inputs (their lengths "
                       "are the padding); pass padded tensors with a key_padding_mask instead")
    if key.is_nested != value.is_nested:
        raise fail(fn, "key and value must both be nested tensors or both not")
    if any(t.is_nested and t.dim() != 3 for t in (query, key, value)):
        raise fail(fn, "nested tensor inputs must be 3-D: (batch, L_i, embedding) with per-sequence lengths L_i")


def check_multihead_masks(fn: str, *, attn_mask: Tensor | None, key_padding_mask: Tensor | None,
                          shape: tuple[int, int, int, int]) -> None:
    """torch MHA's masks for (N, num_heads, L, S) = ``shape``: attn_mask (L, S) or (N * num_heads, L, S),
    key_padding_mask (N, S)."""
    n, h, length, s = shape
    if attn_mask is not None:
        if attn_mask.dim() == 3 and attn_mask.shape != (n * h, length, s):
            raise fail(fn, f"a 3-D attn_mask must be (N * num_heads, L, S) = {(n * h, length, s)}, got "
                           f"{tuple(attn_mask.shape)}")
        if attn_mask.dim() != 3 and attn_mask.shape != (length, s):
            raise fail(fn, f"a 2-D attn_mask must be (L, S) = {(length, s)}, got {tuple(attn_mask.shape)}")
    if key_padding_mask is not None and key_padding_mask.shape != (n, s):
        raise fail(fn, f"key_padding_mask must be (N, S) = {(n, s)}, got {tuple(key_padding_mask.shape)}")


def check_self_attention_config(fn: str, *, dim: int, heads: tuple[int, int], head_dim: int | None,
                                dropout: float = 0.0, fp8: bool = False) -> int:
    """``SelfAttention``'s sizes, heads = (num_heads, num_kv_heads), and options (the FP8 training mode has no
    dropout). Returns head_dim (default dim // num_heads)."""
    if fp8 and dropout:
        raise fail(fn, f"dropout must be 0 with fp8=True, got {dropout}")
    num_heads, num_kv_heads = heads
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise fail(fn, f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    if head_dim is None:
        if dim % num_heads:
            raise fail(fn, f"dim ({dim}) must be divisible by num_heads ({num_heads}), or pass head_dim")
        head_dim = dim // num_heads
    return head_dim


def check_rotary_dim(fn: str, *, rotary_dim: int, head_dim: int) -> int:
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise fail(fn, f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}")
    return rotary_dim


def check_generation(fn: str, *, causal: bool = True, wants_grad: bool = False) -> None:
    """A KV cache: causal attention (generation attends to the past), and no gradients (inference only)."""
    if not causal:
        raise fail(fn, "a KV cache needs causal=True (generation attends to the past)")
    if wants_grad:
        raise fail(fn, "the KV-cache path is inference only (no gradients); run generation under torch.no_grad() "
                       "or torch.inference_mode()", RuntimeError)


def check_transformers_call(fn: str, *, attention_mask: Tensor | None, softcap: float | None, extra: dict,
                            lengths: tuple[int, int]) -> None:
    """What the transformers integration cannot serve: a paged continuous-batching cache, a mask that is neither
    (batch, kv_len) nor 4-D, a softcap or attention sinks with a 4-D mask (SDPA has neither), and a padding mask
    that does not cover every query, or covers more positions than there are keys (``lengths`` = (q_len,
    kv_len))."""
    if extra.get("cache") is not None:
        raise fail(fn, "cache (a paged continuous-batching cache) is not supported; use 'paged|sdpa'")
    if attention_mask is None:
        return
    if attention_mask.dim() == 4 and softcap:
        raise fail(fn, "softcap cannot be combined with a 4-D attention_mask")
    if attention_mask.dim() == 4 and extra.get("s_aux") is not None:
        raise fail(fn, "s_aux (attention sinks) cannot be combined with a 4-D attention_mask; pass a (batch, "
                       "kv_len) padding mask or none")
    if attention_mask.dim() not in (2, 4):
        raise fail(fn, f"attention_mask must be (batch, kv_len) or 4-D, got shape {tuple(attention_mask.shape)}")
    nq, nk = lengths
    if attention_mask.dim() == 2 and (attention_mask.shape[1] > nk or nq > attention_mask.shape[1]):
        raise fail(fn, f"attention_mask has {attention_mask.shape[1]} positions for {nk} keys and {nq} queries; it "
                       "must cover every query and at most the keys")
