"""The one argument checker: every public entry point and module validates and normalises its arguments here.

Each check raises a ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, bad value) whose message
starts with the function the user called, then names the argument, the value received and what is allowed.
The modules split it by concern: ``_base`` (tensors, dtypes, devices, scalar options), ``flash`` (the flash
layout, varlen offsets, paged keys), ``kvcache`` (cache layout, lengths, rotary), ``sdpa`` (PyTorch's layout and
masks) and ``modules`` (merging, padding, context parallelism, ``flashattn.nn``, the transformers integration).
"""

from ._base import FLOAT_DTYPES, fail, validate_int
from .flash import FLASH_OPTIONS, CheckedCall, check_flash, check_varlen, flash_arguments, unpack
from .kvcache import KVCacheCall, check_kvcache
from .modules import (
    check_choice,
    check_context_parallel,
    check_divisible,
    check_generation,
    check_head_parallel,
    check_heads_per_step,
    check_merge,
    check_multihead_config,
    check_multihead_inputs,
    check_multihead_masks,
    check_pad,
    check_padding_mask,
    check_registration_name,
    check_rotary_dim,
    check_self_attention_config,
    check_shard_lengths,
    check_transformers_call,
)
from .nested import any_nested, check_nested_sdpa
from .sdpa import check_sdpa

__all__ = [
    "any_nested",
    "check_nested_sdpa",
    "FLASH_OPTIONS",
    "FLOAT_DTYPES",
    "CheckedCall",
    "KVCacheCall",
    "check_context_parallel",
    "check_choice",
    "check_divisible",
    "check_flash",
    "check_generation",
    "check_head_parallel",
    "check_heads_per_step",
    "check_kvcache",
    "check_merge",
    "check_multihead_config",
    "check_multihead_inputs",
    "check_multihead_masks",
    "check_pad",
    "check_padding_mask",
    "check_registration_name",
    "check_rotary_dim",
    "check_sdpa",
    "check_self_attention_config",
    "check_shard_lengths",
    "check_transformers_call",
    "check_varlen",
    "fail",
    "flash_arguments",
    "unpack",
    "validate_int",
]
