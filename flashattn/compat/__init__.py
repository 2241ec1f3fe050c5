"""Run code written for ``flash_attn`` unchanged: ``install_as_flash_attn()`` makes ``import flash_attn`` (and its
submodules ``flash_attn_interface``, ``bert_padding``, ``layers.rotary``) resolve to flashattn, as
``pymysql.install_as_MySQLdb()`` does for MySQLdb.

    >>> import flashattn
    >>> flashattn.install_as_flash_attn()
    >>> from flash_attn import flash_attn_func  # flashattn's, on any device
    >>> from flash_attn.flash_attn_interface import _flash_attn_forward  # what ring-attention libraries call

The shim modules live in ``flashattn.compat.flash_attn`` and load only when installed: ``import flashattn`` alone
registers nothing under flash_attn's names.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

__all__ = ["install_as_flash_attn"]

# flash_attn's module names -> the shim modules that stand in for them.
MODULES = {
    "flash_attn": "flashattn.compat.flash_attn",
    "flash_attn.flash_attn_interface": "flashattn.compat.flash_attn.flash_attn_interface",
    "flash_attn.bert_padding": "flashattn.compat.flash_attn.bert_padding",
    "flash_attn.layers": "flashattn.compat.flash_attn.layers",
    "flash_attn.layers.rotary": "flashattn.compat.flash_attn.layers.rotary",
}


def install_as_flash_attn(*, force: bool = False) -> None:
    """Make ``import flash_attn`` and its submodules give flashattn's drop-ins. Calling it again does nothing.

    Args:
        force: shadow a real ``flash_attn`` that is installed (or already imported). Without it that is an error:
            code that imported the real package keeps its objects, and two implementations would mix silently.
            Forced, flash_attn's ``torch.ops.flash_attn`` ops stay the real ones where it registered them first.

    Raises:
        RuntimeError: a real flash_attn is installed or imported, and ``force`` is False.
    """
    if _installed():
        return
    real = _real_flash_attn()
    if real is not None and not force:
        raise RuntimeError(f"install_as_flash_attn: a real flash_attn is {real}; flashattn would shadow it. Use it "
                           "as it is, uninstall it (pip uninstall flash-attn), or pass force=True to shadow it.")
    for name, target in MODULES.items():  # parents first, so each submodule can be set on its parent
        module = importlib.import_module(target)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def _installed() -> bool:
    return getattr(sys.modules.get("flash_attn"), "__name__", None) == MODULES["flash_attn"]


def _real_flash_attn() -> str | None:
    """Where a flash_attn other than ours is, described for the error; None if there is none."""
    module = sys.modules.get("flash_attn")
    if module is not None:
        return f"imported (version {getattr(module, '__version__', '?')}, {getattr(module, '__file__', '?')})"
    try:
        spec = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return f"installed at {spec.origin or list(spec.submodule_search_locations or [])}"
