"""Public attention functions: drop-ins for the ``flash_attn`` package and for PyTorch's SDPA.

Every function checks its arguments (``flashattn.checks``), then runs the one autograd op
(``flashattn.ops.attention``), which dispatches to a backend by device.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import checks, fastdecode, fastpath, kvcache
from .ops import attention

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

FlashResult = Tensor | tuple[Tensor, Tensor, Tensor]


def _dropout_seed(dropout_p: float, device: torch.device) -> Tensor | None:
    """A fresh 62-bit key for the counter-based dropout generator, drawn from torch's RNG for ``device``.

    Drawing it from torch's generator is what makes dropout reproducible under ``torch.manual_seed``; the key is
    saved for the backward, which regenerates the same mask.
    """
    if dropout_p == 0:
        return None
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def _run(call: checks.CheckedCall, return_probs: bool) -> tuple[Tensor, Tensor, Tensor]:
    spec = call.spec
    if spec.dropout_p > 0:
        spec = dataclasses.replace(spec, seed=_dropout_seed(spec.dropout_p, call.q.device))
    return attention(call.q, call.k, call.v, spec, return_probs=return_probs)


def _flash_result(call: checks.CheckedCall, return_attn_probs: bool) -> FlashResult:
    if call.spec.cache is not None:  # a paged K/V: forward only, probabilities refused by the checker
        return _run(call, False)[0]
    # As in flash_attn, S_dmask exists only with dropout (the mask is what it is for); without dropout the
    # probabilities are never built, so return_attn_probs=True for the log-sum-exp costs no N x N tensor.
    with_mask = return_attn_probs and call.spec.dropout_p > 0
    out, lse, probs = _run(call, with_mask)
    return (out, lse, probs if with_mask else None) if return_attn_probs else out


def flash_attn_func(  # noqa: PLR0913 (flash_attn's signature)
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    deterministic: bool = False, return_attn_probs: bool = False, learnable_sink: Tensor | None = None,
    block_mask: BlockMask | None = None, *, q_descale: Tensor | None = None, k_descale: Tensor | None = None,
    v_descale: Tensor | None = None, fp8: bool = False,
) -> FlashResult:
    """Exact attention, ``softmax(q k^T * softmax_scale) v``, computed tile by tile; a drop-in for
    ``flash_attn.flash_attn_func``.

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        k, v: (batch, seqlen_k, nheads_k, headdim); nheads % nheads_k == 0 gives GQA/MQA. v's head dim may
            differ from q's and k's (as in FlashAttention-3: MLA prefill uses 192 and 128); out then has v's.
        dropout_p: dropout on the attention weights (pass 0.0 in evaluation). Reproducible under
            ``torch.manual_seed``.
        softmax_scale: defaults to headdim ** -0.5.
        causal: query i sees key j iff j <= i + seqlen_k - seqlen_q (aligned to the bottom-right corner).
        window_size: (left, right): query i sees keys in [i + seqlen_k - seqlen_q - left,
            i + seqlen_k - seqlen_q + right]; -1 is unbounded.
        softcap: if > 0, scores are ``softcap * tanh(scores / softcap)``.
        alibi_slopes: (nheads,) or (batch, nheads); adds ``-slope * |i + seqlen_k - seqlen_q - j|``.
        deterministic: bitwise-reproducible backward (always true of the CPU path; also asked for by
            ``torch.use_deterministic_algorithms(True)``, as every PyTorch op is).
        return_attn_probs: also return ``softmax_lse`` and, with dropout, ``S_dmask`` (testing only: it
            materialises a (batch, nheads, seqlen_q, seqlen_k) tensor; without dropout it is None and costs
            nothing).
        learnable_sink: (nheads,), any float dtype: a learned logit per head that joins every query's softmax
            denominator and takes no value (gpt-oss's attention sinks, FlashAttention-4's ``learnable_sink``):
            weights are ``exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))``. Differentiable; softmax_lse includes it.
        block_mask: a FlexAttention ``BlockMask`` (``create_block_mask(mask_mod, B, H, seqlen_q, seqlen_k)``, B
            and H may be None): documents packed in one sequence, prefix-LM, sliding chunks and other patterns
            without an N x N mask. Blocks it marks empty are skipped (forward and backward), full ones run without
            mask code, and partial ones take ``mask_mod``, evaluated once on those blocks only; its block size is
            the kernels' tile. Combines with the other options (causal, window, ...) as an intersection.
        q_descale, k_descale, v_descale: FlashAttention-3's FP8 interface: with q, k, v in
            ``torch.float8_e4m3fn`` (or ``float8_e5m2``), (batch, nheads_k) float32 scales or None (1); the call
            attends ``x.float() * descale`` and returns bfloat16. Forward only.
        fp8: the FP8 training mode, for float16 or bfloat16 q, k, v: the call quantizes them to
            ``float8_e4m3fn`` with a scale per (batch, kv head) (its largest magnitude lands on 448), attends them
            as FP8 inputs do (FP8 tensor cores where the GPU has them, P rounded to e4m3 there; bfloat16
            arithmetic) and returns out in the inputs' dtype; gradients flow back to q, k, v as those of attention
            at the quantized values (straight through the rounding), in the inputs' dtype. No dropout.

    Returns:
        out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse, S_dmask) when ``return_attn_probs``:
        softmax_lse (batch, nheads, seqlen_q) is the natural-log log-sum-exp of the scaled scores (float32;
        float64 for float64 inputs; -inf for a query that sees no key, the sink with ``learnable_sink``);
        S_dmask holds the probabilities, negated where dropout dropped them, or is None when ``dropout_p == 0`` (as
        in flash_attn). A query that sees no key outputs 0.

    Example::

        >>> q, k, v = (torch.randn(2, 128, 8, 64) for _ in range(3))
        >>> flash_attn_func(q, k, v, causal=True).shape
        torch.Size([2, 128, 8, 64])
    """
    key, result = fastpath.flash(  # a signature seen before: its launches directly (fastpath.py)
        q, k, v, (dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs),
        (alibi_slopes, learnable_sink, block_mask, q_descale, k_descale, v_descale, fp8))
    if result is not None:
        return result
    options = checks.flash_arguments(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs)
    call = checks.check_flash(
        "flash_attn_func", q, k, v, **options, learnable_sink=learnable_sink, block_mask=block_mask,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, fp8=fp8)
    result = _flash_result(call, return_attn_probs)
    if key is not None and call.q is q and call.k is k and call.v is v:
        fastpath.learn(key, q, k, v, call.spec)
    return result


def flash_attn_qkvpacked_func(  # noqa: PLR0913 (flash_attn's signature)
    qkv: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    deterministic: bool = False, return_attn_probs: bool = False, learnable_sink: Tensor | None = None,
    block_mask: BlockMask | None = None, *, fp8: bool = False,
) -> FlashResult:
    """``flash_attn_func`` on a packed qkv of shape (batch, seqlen, 3, nheads, headdim); gradients flow back
    into ``qkv``. Same arguments and returns as ``flash_attn_func``.

    Example::

        >>> qkv = torch.randn(2, 64, 3, 4, 32, requires_grad=True)
        >>> flash_attn_qkvpacked_func(qkv, causal=True).sum().backward()
        >>> qkv.grad.shape
        torch.Size([2, 64, 3, 4, 32])
    """
    fn = "flash_attn_qkvpacked_func"
    q, k, v = checks.unpack(fn, "qkv", qkv, 3)
    options = checks.flash_arguments(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs)
    call = checks.check_flash(
        fn, q, k, v, **options, learnable_sink=learnable_sink, block_mask=block_mask, fp8=fp8,
        names=("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"),
    )
    return _flash_result(call, return_attn_probs)


def flash_attn_kvpacked_func(  # noqa: PLR0913 (flash_attn's signature)
    q: Tensor, kv: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    deterministic: bool = False, return_attn_probs: bool = False, learnable_sink: Tensor | None = None,
    block_mask: BlockMask | None = None, *, fp8: bool = False,
) -> FlashResult:
    """``flash_attn_func`` with k and v packed as kv (batch, seqlen_k, 2, nheads_k, headdim).

    Example::

        >>> q, kv = torch.randn(2, 16, 8, 32), torch.randn(2, 48, 2, 2, 32)
        >>> flash_attn_kvpacked_func(q, kv).shape
        torch.Size([2, 16, 8, 32])
    """
    fn = "flash_attn_kvpacked_func"
    k, v = checks.unpack(fn, "kv", kv, 2)
    options = checks.flash_arguments(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs)
    call = checks.check_flash(
        fn, q, k, v, **options, learnable_sink=learnable_sink, block_mask=block_mask, fp8=fp8,
        names=("q", "kv[:, :, 0]", "kv[:, :, 1]"),
    )
    return _flash_result(call, return_attn_probs)


def flash_attn_varlen_func(  # noqa: PLR0913 (flash_attn's signature)
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    deterministic: bool = False, return_attn_probs: bool = False, block_table: Tensor | None = None,
    learnable_sink: Tensor | None = None, *, q_descale: Tensor | None = None, k_descale: Tensor | None = None,
    v_descale: Tensor | None = None, fp8: bool = False,
) -> FlashResult:
    """``flash_attn_func`` on a packed batch of sequences of different lengths, without padding; a drop-in for
    ``flash_attn.flash_attn_varlen_func``.

    Args:
        q: (total_q, nheads, headdim), the batch's queries one sequence after another.
        k, v: (total_k, nheads_k, headdim) (v's head dim may differ, as in flash_attn_func); with
            ``block_table``, paged caches (num_pages, page_size, nheads_k, headdim) where sequence b's key at
            position p is row ``p % page_size`` of page ``block_table[b, p // page_size]`` (any page size).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) offsets: sequence b owns rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q (and likewise for k, v). Empty sequences are allowed.
        max_seqlen_q, max_seqlen_k: at least the longest sequence (they size the kernels' grid).
        block_table: int32 (batch, max_pages_per_seq) for a paged K/V; then ``cu_seqlens_k`` gives each
            sequence's key count, and the call is forward only (inference: no dropout, no gradients, no
            ``return_attn_probs``).
        q_descale, k_descale, v_descale: FP8 inputs' scales, (batch, nheads_k) float32 per sequence, as in
            ``flash_attn_func``.
        fp8: the FP8 training mode of ``flash_attn_func``, a scale per (sequence, kv head).
        The other arguments are those of ``flash_attn_func``, applied per sequence (causal aligns each
        sequence's bottom-right corner).

    Returns:
        out (total_q, nheads, headdim), or (out, softmax_lse (nheads, total_q), S_dmask (batch, nheads,
        max_seqlen_q, max_seqlen_k), None without dropout) when ``return_attn_probs``.

    Example::

        >>> q, k, v = (torch.randn(10, 4, 32) for _ in range(3))
        >>> cu = torch.tensor([0, 3, 10], dtype=torch.int32)  # two sequences: 3 and 7 tokens
        >>> flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True).shape
        torch.Size([10, 4, 32])
    """
    given = (q, k, v, cu_seqlens_q, cu_seqlens_k, block_table)
    key, result = fastpath.varlen(  # a signature seen before: its launches directly (fastpath.py)
        given, (max_seqlen_q, max_seqlen_k),
        (dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs),
        (alibi_slopes, learnable_sink, q_descale, k_descale, v_descale, fp8))
    if result is not None:
        return result
    options = checks.flash_arguments(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs)
    call = checks.check_varlen(
        "flash_attn_varlen_func", q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, block_table=block_table, **options,
        learnable_sink=learnable_sink, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, fp8=fp8,
    )
    result = _flash_result(call, return_attn_probs)
    fastpath.learn_varlen(key, call, given)
    return result


def flash_attn_varlen_qkvpacked_func(  # noqa: PLR0913 (flash_attn's signature)
    qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0, softmax_scale: float | None = None,
    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: Tensor | None = None, deterministic: bool = False, return_attn_probs: bool = False,
    learnable_sink: Tensor | None = None, *, fp8: bool = False,
) -> FlashResult:
    """``flash_attn_varlen_func`` with q, k, v packed as qkv (total, 3, nheads, headdim) and one set of offsets.

    Example::

        >>> qkv = torch.randn(9, 3, 2, 16)
        >>> cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        >>> flash_attn_varlen_qkvpacked_func(qkv, cu, 5).shape
        torch.Size([9, 2, 16])
    """
    fn = "flash_attn_varlen_qkvpacked_func"
    q, k, v = checks.unpack(fn, "qkv", qkv, 3, varlen=True)
    options = checks.flash_arguments(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs)
    call = checks.check_varlen(
        fn, q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen, **options, learnable_sink=learnable_sink, fp8=fp8,
        names=("qkv[:, 0]", "qkv[:, 1]", "qkv[:, 2]"),
    )
    return _flash_result(call, return_attn_probs)


def flash_attn_varlen_kvpacked_func(  # noqa: PLR0913 (flash_attn's signature)
    q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    deterministic: bool = False, return_attn_probs: bool = False, learnable_sink: Tensor | None = None, *,
    fp8: bool = False,
) -> FlashResult:
    """``flash_attn_varlen_func`` with k and v packed as kv (total_k, 2, nheads_k, headdim).

    Example::

        >>> q, kv = torch.randn(6, 4, 16), torch.randn(8, 2, 2, 16)
        >>> cq, ck = (torch.tensor(c, dtype=torch.int32) for c in ([0, 2, 6], [0, 5, 8]))
        >>> flash_attn_varlen_kvpacked_func(q, kv, cq, ck, 4, 5).shape
        torch.Size([6, 4, 16])
    """
    fn = "flash_attn_varlen_kvpacked_func"
    k, v = checks.unpack(fn, "kv", kv, 2, varlen=True)
    options = checks.flash_arguments(
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs)
    call = checks.check_varlen(
        fn, q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, **options, learnable_sink=learnable_sink, fp8=fp8,
        names=("q", "kv[:, 0]", "kv[:, 1]"),
    )
    return _flash_result(call, return_attn_probs)


def flash_attn_with_kvcache(  # noqa: PLR0913 (flash_attn's signature)
    q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = None, v: Tensor | None = None,
    rotary_cos: Tensor | None = None, rotary_sin: Tensor | None = None, cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None, cache_leftpad: Tensor | None = None, block_table: Tensor | None = None,
    softmax_scale: float | None = None, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0, rotary_interleaved: bool = True, alibi_slopes: Tensor | None = None, num_splits: int = 0,
    return_softmax_lse: bool = False, learnable_sink: Tensor | None = None, *, q_descale: Tensor | None = None,
    k_descale: Tensor | None = None, v_descale: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention for inference against a KV cache, appending the new keys and values in place first; a drop-in
    for ``flash_attn.flash_attn_with_kvcache``. No gradients (inference only, as in flash_attn).

    Args:
        q: (batch, seqlen_q, nheads, headdim): the new tokens' queries (seqlen_q = 1 when decoding).
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim) (v_cache's head dim may differ, as in
            flash_attn_func; k and v then follow the caches'), or paged with ``block_table``:
            (num_pages, page_size, nheads_k, headdim), any page size >= 1.
        k, v: optional (batch, seqlen_new, nheads_k, headdim), written into the caches in place at positions
            ``cache_seqlens[b] ..`` (after rotary on k) before attending.
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2); rotate the first rotary_dim dims of q and k.
            New key t sits at position cache_seqlens + t (a position in the cache row, counting left padding, as
            in flash_attn); queries too when causal or local, else every query at cache_seqlens.
        cache_seqlens: int or int32 (batch,): cache lengths before the append (default: the whole cache).
        cache_batch_idx: int32 (batch,): the cache row of each sequence (default: row b; the cache may have more
            rows than the batch).
        cache_leftpad: int32 (batch,): the first valid cache position of each sequence (default 0).
        block_table: int32 (batch, max_pages_per_seq): position p of sequence b is row p % page_size of page
            block_table[b, p // page_size].
        causal, window_size, softcap, alibi_slopes, softmax_scale, learnable_sink: as in ``flash_attn_func``,
            over the keys [cache_leftpad, cache_seqlens + seqlen_new) aligned bottom-right.
        rotary_interleaved: GPT-J pairs (x[2i], x[2i+1]) if True, GPT-NeoX halves if False.
        num_splits: split each sequence's keys into this many chunks on the GPU (flash-decoding) and merge by
            log-sum-exp; 0 chooses from batch, heads, cache length and the number of multiprocessors.
        return_softmax_lse: also return the log-sum-exp (batch, nheads, seqlen_q), float32 (float64 for
            float64 inputs).
        q_descale, k_descale, v_descale: FlashAttention-3's FP8 scales, (batch, nheads_k) float32 or None (1):
            with caches in ``torch.float8_e4m3fn`` or ``float8_e5m2`` the call attends ``cache.float() *
            descale``, read tile by tile. q may be FP8 too (out is then bfloat16) or 16-bit; new k, v in 16-bit
            or float32 are quantized into an FP8 cache (``k / k_descale``, saturated), FP8 ones copied.

    Returns:
        out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse) when ``return_softmax_lse``.

    The lengths and indices are checked on the host where they are there (CPU tensors, an int ``cache_seqlens``), and
    on the GPU by a kernel for a GPU's (no device-to-host copy: a bad value is a device-side assertion naming the rule).

    Example::

        >>> k_cache, v_cache = torch.zeros(2, 64, 2, 32), torch.zeros(2, 64, 2, 32)
        >>> lengths = torch.tensor([10, 3], dtype=torch.int32)  # tokens already in each sequence's cache
        >>> q, k, v = torch.randn(2, 1, 8, 32), torch.randn(2, 1, 2, 32), torch.randn(2, 1, 2, 32)
        >>> out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True)
        >>> out.shape, bool(k_cache[0, 10].eq(k[0, 0]).all())
        (torch.Size([2, 1, 8, 32]), True)
    """
    key, result = fastdecode.kvcache(  # a signature seen before: its launches directly (fastdecode.py)
        (q, k_cache, v_cache, k, v), cache_seqlens, (cache_leftpad, cache_batch_idx, block_table),
        (rotary_cos, rotary_sin, rotary_interleaved),
        (softmax_scale, causal, window_size, softcap, num_splits, return_softmax_lse),
        (alibi_slopes, learnable_sink, q_descale, k_descale, v_descale))
    if result is not None:
        return result
    call = checks.check_kvcache(
        "flash_attn_with_kvcache", q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, block_table=block_table, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes,
        num_splits=num_splits, return_softmax_lse=return_softmax_lse, learnable_sink=learnable_sink,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    learnable = key is not None and all(a is b for a, b in zip(
        (call.q, call.k_cache, call.v_cache, call.k, call.v, *(call.rotary or (None, None))),
        (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin), strict=True))
    with torch.no_grad():
        q = kvcache.rotate_and_append(call)
        out, lse, _ = attention(q, call.k_cache, call.v_cache, call.spec)
    if learnable:
        fastdecode.learn_kvcache(key, call, q)
    return (out, lse) if return_softmax_lse else out


def scaled_dot_product_attention(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
) -> Tensor:
    """A drop-in for ``torch.nn.functional.scaled_dot_product_attention``, computed tile by tile.

    Args:
        query: (..., heads, L, E); key: (..., heads_kv, S, E); value: (..., heads_kv, S, Ev). Any number of
            leading dimensions (none too: (L, E)), broadcast against each other as PyTorch does; heads_kv differs
            from heads only with ``enable_gqa``. Or nested tensors of layout ``torch.jagged``, (batch, heads, j, E),
            ragged in the sequence (no attn_mask then, as in PyTorch): each sequence attends its own keys.
        attn_mask: boolean (True = may attend) or additive mask (of query's dtype or float32), broadcastable to
            (..., heads, L, S). An additive mask that requires grad gets its gradient. Or PyTorch's ``CausalBias``
            (``torch.nn.attention.bias.causal_upper_left(L, S)`` / ``causal_lower_right(L, S)``): causal
            attention aligned to the top-left or the bottom-right corner, no L x S tensor. Or a FlexAttention
            ``BlockMask`` (as ``flash_attn_func``'s ``block_mask``): block-sparse, empty blocks skipped.
        dropout_p: dropout on the attention weights (always applied when > 0, as in PyTorch).
        is_causal: top-left aligned causal mask (query i sees keys j <= i), PyTorch's convention.
        scale: defaults to E ** -0.5.
        enable_gqa: allow heads % heads_kv == 0 grouped-query attention.

    Returns:
        (..., heads, L, Ev), nested like query for nested inputs. A query that sees no key outputs 0 (never NaN).

    Example::

        >>> q, k, v = (torch.randn(2, 8, 128, 64) for _ in range(3))
        >>> scaled_dot_product_attention(q, k, v, is_causal=True).shape
        torch.Size([2, 8, 128, 64])
    """
    signature, result = fastpath.sdpa(  # a signature seen before: its launches directly (fastpath.py)
        query, key, value, attn_mask, (dropout_p, is_causal, scale, enable_gqa))
    if result is not None:
        return result
    if checks.any_nested(query, key, value):  # jagged (B, H, j, E): the packed call of each sequence
        call = checks.check_nested_sdpa("scaled_dot_product_attention", query, key, value, attn_mask=attn_mask,
                                        dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        out, _, _ = _run(call, return_probs=False)
        return torch.nested.nested_tensor_from_jagged(out, offsets=query.transpose(1, 2).offsets()).transpose(1, 2)
    call, leading = checks.check_sdpa(
        "scaled_dot_product_attention", query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
    )
    out, _, _ = _run(call, return_probs=False)
    fastpath.learn_sdpa(signature, call, query, key, value)
    return out.transpose(1, 2).reshape(*leading, *out.shape[1:2], out.shape[-1])


def attention_with_weights(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
) -> tuple[Tensor, Tensor]:
    """``scaled_dot_product_attention`` that also returns the weights it applied, (batch, heads, L, S), after
    dropout (zero where dropped, scaled by 1 / (1 - dropout_p) elsewhere), as ``torch.nn.MultiheadAttention``
    returns them. It materialises the weights: for ``need_weights=True`` only. The weights carry no gradient.

    Example::

        >>> q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
        >>> out, weights = attention_with_weights(q, k, v, is_causal=True)
        >>> out.shape, weights.shape, bool(weights[0, 0, 0, 1] == 0)
        (torch.Size([1, 2, 5, 8]), torch.Size([1, 2, 5, 5]), True)
    """
    call, leading = checks.check_sdpa(
        "attention_with_weights", query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
    )
    out, _, probs = _run(call, return_probs=True)
    probs = probs.detach()
    weights = torch.where(torch.signbit(probs), torch.zeros_like(probs), probs / (1.0 - call.spec.dropout_p))
    return (out.transpose(1, 2).reshape(*leading, *out.shape[1:2], out.shape[-1]),
            weights.reshape(*leading, *weights.shape[-2:]))

