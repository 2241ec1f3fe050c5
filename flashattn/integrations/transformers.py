"""Hugging Face transformers: ``attn_implementation="flashattn"``.

``register()`` adds our attention to transformers' ``AttentionInterface`` and, under the same name, a mask function
to its ``AttentionMaskInterface``. The mask function matters: transformers builds no mask at all for an
implementation it has no mask function for, so a padded batch would silently attend to its padding. Ours hands the
attention the 2-D padding mask (or None when nothing is padded), as for ``flash_attention_2``; causality comes from
the module's ``is_causal``.

What the attention function does with the inputs it gets:

- no mask: ``flash_attn_func`` (causal per the module, sliding window and softcap per the model);
- a 2-D padding mask: the padding is removed and ``flash_attn_varlen_func`` runs on the packed tokens (a
  padded query position outputs 0);
- packed sequences, given as ``cu_seq_lens_q/k`` and ``max_length_q/k`` (``DataCollatorWithFlattening``) or as
  ``position_ids`` that restart within a row: ``flash_attn_varlen_func``, so no token sees another sequence;
- a 4-D mask passed by the caller (taken as-is by transformers): our ``scaled_dot_product_attention`` with it.

Value head dims that differ from the query's pass through, and gpt-oss's attention sinks (``s_aux``) become
``learnable_sink``, with their gradient.

Example::

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> name = register()
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                   num_attention_heads=4, num_key_value_heads=2)
    >>> model = LlamaForCausalLM._from_config(cfg, attn_implementation=name)
    >>> model(torch.randint(0, 64, (2, 10))).logits.shape
    torch.Size([2, 10, 64])
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import checks
from ..backends.masking import Band
from ..backends.memo import PerTensor
from ..interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, scaled_dot_product_attention
from ..padding import pad_input, plan_unpad, unpad_input

__all__ = ["NAME", "attention_forward", "padding_mask", "register"]

NAME = "flashattn"
FN = "attn_implementation='flashattn'"  # how errors name the caller


def register(name: str = NAME) -> str:
    """Make ``attn_implementation=name`` use flashattn in every transformers model; returns ``name``.

    Registers ``attention_forward`` with ``transformers.AttentionInterface`` and ``padding_mask`` with
    ``transformers.masking_utils.AttentionMaskInterface``. Call it once, before building the model::

        from flashattn.integrations.transformers import register
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=register())
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("flashattn.integrations.transformers needs Hugging Face transformers >= 4.56 "
                          "(pip install transformers)") from err
    checks.check_registration_name("register", name)
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    _serve_flash_functions(name)
    return name


_NAMES: set[str] = set()


def _serve_flash_functions(name: str) -> None:
    """Answer transformers' flash-function loader for ``name``.

    transformers treats every implementation whose name contains "flash" as a FlashAttention flavour: at model
    init it loads that flavour's ``flash_attn_func`` / ``flash_attn_varlen_func`` / ``flash_attn_with_kvcache`` /
    ``pad_input`` / ``unpad_input`` (from the flash_attn package, else from a hub kernel) and fails when it finds
    none. The flavour behaviours that follow from the name (keep the 2-D padding mask, no fullgraph with a static
    cache) are the right ones for us, so rather than pick a name without "flash", the loader is taught to answer
    with our functions, which share flash_attn's signatures. Other names go to the original loader.
    """
    if "flash" not in name:
        return
    try:
        from transformers import modeling_flash_attention_utils as fa_utils
    except ImportError:  # pragma: no cover - versions without the loader have no name rule either
        return
    loader = getattr(fa_utils, "_lazy_imports", None)
    if loader is None:  # pragma: no cover
        return
    _NAMES.add(name)
    if getattr(loader, "_flashattn", False):
        return

    def _lazy_imports(implementation, *args, **kwargs):
        if implementation in _NAMES:
            return flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, pad_input, unpad_input
        return loader(implementation, *args, **kwargs)

    _lazy_imports._flashattn = True
    fa_utils._lazy_imports = _lazy_imports
    _join_compatible_lists()


def _join_compatible_lists() -> None:
    """Models that need FlashAttention-3/4 features (gpt-oss: attention sinks) list the flash implementations they
    accept (``_compatible_flash_implementations``) and swap any other "flash" name for the first of them, a hub
    kernel. Ours has those features, so when such a model checks its implementation, our names join its list."""
    from transformers import PreTrainedModel

    check = getattr(PreTrainedModel, "_check_and_adjust_attn_implementation", None)
    if check is None or getattr(check, "_flashattn", False):  # pragma: no cover - versions without the lists
        return

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        listed = getattr(type(self), "_compatible_flash_implementations", None)
        if attn_implementation in _NAMES and listed is not None and attn_implementation not in listed:
            type(self)._compatible_flash_implementations = [*listed, attn_implementation]
        return check(self, attn_implementation, *args, **kwargs)

    _check_and_adjust_attn_implementation._flashattn = True
    PreTrainedModel._check_and_adjust_attn_implementation = _check_and_adjust_attn_implementation


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Tensor | None = None,
    **kwargs,
) -> Tensor | None:
    """transformers' mask hook: the (batch, kv_length) boolean padding mask, or None if no token is padding.

    Causal, sliding-window and packed-sequence structure is not materialised: the attention function applies it
    from ``is_causal``, ``sliding_window`` and the packing arguments, so no (q, kv) mask is built (except under
    ``torch.compile``, where padding is applied as a boolean mask: ``_masked``).
    """
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:].bool()
    # A mask shorter than kv_length (a static cache) still says which cache slots are valid, so it is kept. A
    # compiled graph keeps it too: whether it is all True is a value, not a shape.
    if attention_mask.shape[1] == kv_length and not torch.compiler.is_compiling() and bool(attention_mask.all()):
        return None
    return attention_mask


_PLANS = PerTensor()  # a few slots: models alternate full and sliding-window masks between layers


def _packed_offsets(position_ids: Tensor, batch: int) -> tuple[Tensor, int] | None:
    """Sequence offsets of packed rows: a sequence starts at each row start and wherever the position does not
    advance by one. None when every row holds one sequence. Kept per position_ids tensor (``PerTensor``)."""
    return _PLANS.get(position_ids, ("packing", batch), lambda: _find_packing(position_ids, batch))


def _find_packing(position_ids: Tensor, batch: int) -> tuple[Tensor, int] | None:
    pos = position_ids.expand(batch, -1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    first = torch.nonzero(starts.flatten()).flatten()
    cu_seqlens = F.pad(first.to(torch.int32), (0, 1), value=pos.numel())
    return cu_seqlens, int(cu_seqlens.diff().max())


def _varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, options) -> Tensor:
    """Attention over packed (batch, seqlen, heads, dim) rows split by the offsets; returns the same layout."""
    b, nq = q.shape[:2]
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    out = flash_attn_varlen_func(*flat, cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k),
                                 **options)
    return out.reshape(b, nq, *out.shape[1:])


def _unpadded(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, options) -> Tensor:
    """Attention with a (batch, kv_len) padding mask: pad tokens are removed from keys and queries (the queries
    are the last q_len positions of the mask), the rest runs varlen, and pad query positions output 0."""
    b, nq = q.shape[:2]
    nk = mask.shape[1]
    # A static cache holds more slots than the mask covers: the ones past the mask are unused.
    k, v = k[:, :nk], v[:, :nk]
    (k_index, cu_k, max_k, _), (q_index, cu_q, max_q, _) = _PLANS.get(
        mask, ("unpad", nq), lambda: (plan_unpad(mask), plan_unpad(mask[:, -nq:])))
    k_packed, v_packed, q_packed = (t.reshape(-1, *t.shape[2:])[index]
                                    for t, index in ((k, k_index), (v, k_index), (q, q_index)))
    out = flash_attn_varlen_func(q_packed, k_packed, v_packed, cu_q, cu_k, max_q, max_k, **options)
    return pad_input(out, q_index, b, nq)


def _masked(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, *, causal: bool, window: int, dropout: float,
            scale: float | None) -> Tensor:
    """``_unpadded``'s attention for a compiled graph, whose shapes cannot depend on the mask's values: the padding
    mask (batch, kv_len) as a boolean mask over the keys, with the causal band (the queries are the last q_len
    positions) and the window (``window`` keys left of a query, -1: none) folded in; query (batch, heads, q_len,
    dim) -> the same layout. A static cache's slots past the mask are unused."""
    nq, nk = query.shape[2], mask.shape[1]
    band = Band.of(nq, nk, left=window, right=0 if causal else window, bottom_right=True)
    visible = band.visible(torch.arange(nq, device=mask.device), torch.arange(nk, device=mask.device))
    return scaled_dot_product_attention(query, key[:, :, :nk], value[:, :, :nk],
                                        attn_mask=mask[:, None, None, :] & visible, dropout_p=dropout, scale=scale,
                                        enable_gqa=True)


def attention_forward(  # noqa: PLR0913 (transformers' attention-interface signature)
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    position_ids: Tensor | None = None,
    cu_seq_lens_q: Tensor | None = None,
    cu_seq_lens_k: Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention hook: query (batch, heads, q_len, dim), key/value (batch, kv_heads, kv_len, dim)
    -> ((batch, q_len, heads, dim), None)."""
    checks.check_transformers_call(FN, attention_mask=attention_mask, softcap=softcap, extra=kwargs,
                                   lengths=(query.shape[2], key.shape[2]))
    if kwargs.get("output_attentions"):
        warnings.warn("attn_implementation='flashattn' never materialises attention weights; they are returned as "
                      "None. Use attn_implementation='eager' to inspect them.", stacklevel=2)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))

    if attention_mask is not None and attention_mask.dim() == 4:
        out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                           scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), None

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # the flash layout (batch, seqlen, heads, dim)
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    options = dict(dropout_p=dropout, softmax_scale=scaling, causal=causal, window_size=window,
                   softcap=float(softcap or 0.0), deterministic=bool(kwargs.get("deterministic") or False),
                   learnable_sink=kwargs.get("s_aux"))

    if attention_mask is not None and torch.compiler.is_compiling() and not softcap and kwargs.get("s_aux") is None:
        out = _masked(query, key, value, attention_mask.bool(), causal=causal, window=window[0], dropout=dropout,
                      scale=scaling).transpose(1, 2)
    elif attention_mask is not None:
        out = _unpadded(q, k, v, attention_mask.bool(), options)
    elif all(x is not None for x in (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k)):
        out = _varlen(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, options)
    else:
        packed = None
        if position_ids is not None and q.shape[1] == k.shape[1] > 1:
            packed = _packed_offsets(position_ids, q.shape[0])
        if packed is not None:
            out = _varlen(q, k, v, packed[0], packed[0], packed[1], packed[1], options)
        else:
            out = flash_attn_func(q, k, v, **options)
    return out, None
