"""``flash_attn`` on flashattn, installed under that name by ``flashattn.install_as_flash_attn()``: the public
functions of flash_attn 2.8, and, as its submodules, ``flash_attn_interface`` (the private entry points and the
``torch.ops.flash_attn`` ops too), ``bert_padding`` and ``layers.rotary``.

    >>> import flashattn
    >>> flashattn.install_as_flash_attn()
    >>> import flash_attn
    >>> flash_attn.__version__.split("+")[1].startswith("flashattn")
    True
"""

from ... import __version__ as _flashattn_version
from .flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

# The flash_attn release whose API this follows, and, as a PEP 440 local label, what really runs it: version checks
# such as ``Version(flash_attn.__version__) >= Version("2.6")`` pass, and the label tells people it is flashattn.
__version__ = f"2.8.4+flashattn.{_flashattn_version}"

__all__ = ["__version__", "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_with_kvcache"]
