"""Backends behind the one attention op. Each module offers ``forward`` and ``backward`` with the signatures of
``flashattn.backends.cpu``; ``select`` picks one for a device.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import cpu

__all__ = ["select"]


def select(device: torch.device) -> ModuleType:
    """The backend for tensors on ``device``. The tiled PyTorch path runs on every device torch supports."""
    return cpu
