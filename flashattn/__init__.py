"""flashattn: exact, IO-aware attention. A drop-in for ``flash_attn`` with a tiled CPU path, and the
FlashAttention derivation as executable code in ``flashattn.reference``."""

from .backends import use_backend
from .compat import install_as_flash_attn
from .errors import ArgumentError, ArgumentTypeError
from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    scaled_dot_product_attention,
)
from .merge import merge_attention_states

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "__version__",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "install_as_flash_attn",
    "merge_attention_states",
    "scaled_dot_product_attention",
    "use_backend",
]
