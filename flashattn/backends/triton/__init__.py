"""The ``triton`` path: fused FlashAttention-2 kernels for NVIDIA GPUs, and what they serve.

This module declares what the path serves (``serves``) without importing triton, so the choice of a path costs
nothing where triton is absent; the kernels (``kernels/``), their launches (``attend.py``, ``launch.py``) and tiles
(``configs.py``) load on the first call. Under ``TRITON_INTERPRET=1`` (set before triton is imported) the kernels
run in Triton's interpreter on CPU tensors: that is how the tests check them without a GPU, and why CPU tensors are
served only under it (the automatic choice never sends CPU tensors here: ``flashattn.backends.ORDER``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
from contextvars import ContextVar

import torch

from ..environ import Variable
from ..request import Request

NAME = "triton"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# A block mask's blocks must be multiples of this for the kernel tiles to divide them (a tile never straddles two).
BLOCK_MULTIPLE = 16


_INTERPRET = Variable("TRITON_INTERPRET")


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (on CPU tensors)."""
    return _INTERPRET.get() == "1"


# The GPU that CPU tensors stand for inside ``stub.stubbed_launches`` (a ``stub.StubDevice``), else None: kept here,
# in the declaration ``serves`` reads, so that choosing a path loads none of the path's modules.
_stubbed: ContextVar[object | None] = ContextVar("flashattn_triton_stub", default=None)


def stubbed_device():
    """The stubbed GPU (``stub.StubDevice``) inside ``stub.stubbed_launches``, else None."""
    return _stubbed.get()


@functools.cache
def installed() -> bool:
    return importlib.util.find_spec("triton") is not None


# The Triton releases the kernels are written and checked for, [first, past the last): pyproject's triton extra.
RELEASES = ((3, 6), (3, 10))


@functools.cache
def installed_release() -> tuple[int, int] | None:
    """(major, minor) of the Triton that ``import triton`` finds, from the metadata of whichever distribution
    provides the module (triton, or torch's pytorch-triton and pytorch-triton-rocm builds), without importing it;
    None if there is none or its version does not read."""
    try:  # the usual case, without scanning every installed distribution (tens of ms)
        distributions = [importlib.metadata.distribution("triton")]
    except importlib.metadata.PackageNotFoundError:
        distributions = [importlib.metadata.distribution(name)
                         for name in importlib.metadata.packages_distributions().get("triton", [])]
    for distribution in distributions:
        found = re.match(r"(\d+)\.(\d+)", distribution.version)
        if found:
            return int(found[1]), int(found[2])
    return None


def unsupported_release() -> str | None:
    """Why the installed Triton cannot run the kernels (a release outside ``RELEASES``: older torch pins older
    Triton, e.g. torch 2.4 its 3.0), else None; read from the package metadata, without importing triton."""
    release = installed_release()
    if release is None or RELEASES[0] <= release < RELEASES[1]:
        return None
    last = (RELEASES[1][0], RELEASES[1][1] - 1)
    return (f"triton {release[0]}.{release[1]} is installed and its kernels need {RELEASES[0][0]}.{RELEASES[0][1]} to "
            f"{last[0]}.{last[1]} (pip install 'flashattn[triton]'; torch before 2.11 pins an older triton)")


def serves(request: Request) -> str | None:
    """CUDA tensors (CPU ones under the interpreter) of fp16, bf16 or fp32, FP8 keys and values (and queries)
    forward, head dims up to 256, every feature but the gradient of an additive ``attn_mask``, and block masks
    whose blocks are multiples of 16."""
    if not installed():
        return "triton is not installed (pip install 'flashattn[triton]')"
    stubbed = stubbed_device()  # a GPU stood in for by CPU tensors, to time the host side (stub.stubbed_launches)
    if request.device != "cuda" and not (request.device == "cpu" and (interpreting() or stubbed is not None)):
        return f"it runs on CUDA tensors (CPU tensors under TRITON_INTERPRET=1), got {request.device} tensors"
    old_or_new = unsupported_release()
    if old_or_new is not None:
        return old_or_new
    if request.dtype not in DTYPES and not request.uses("fp8"):
        return f"it takes float16, bfloat16, float32 and FP8, got {request.dtype}"
    if max(request.head_dim, request.head_dim_v) > MAX_HEAD_DIM:
        return f"it takes head dims up to {MAX_HEAD_DIM}, got {max(request.head_dim, request.head_dim_v)}"
    blocks = request.mask_blocks
    if blocks is not None and (blocks[0] % BLOCK_MULTIPLE or blocks[1] % BLOCK_MULTIPLE):
        return (f"its tiles must divide the block mask's blocks, which must be multiples of {BLOCK_MULTIPLE}, got "
                f"{blocks[0]} x {blocks[1]}")
    if request.mask_grad:
        return "it does not compute the gradient of an additive attn_mask that requires grad"
    if request.uses("fp8") and request.uses("return_attn_probs"):
        return "it does not return the probabilities of FP8 inputs"
    if request.device == "cuda" and not interpreting():
        return _family_declines(request, _gpu_family(torch.cuda.current_device()))
    if stubbed is not None:
        from .families import family  # tables only: no triton

        return _family_declines(request, family(stubbed.arch))
    return None


def _family_declines(request: Request, fam) -> str | None:
    """What this GPU's family (``families.Family``) leaves to the torch path: its limits on head dims (with a
    block mask, in the backward) and fp32."""
    largest = max(request.head_dim, request.head_dim_v)
    if request.dtype == torch.float32 and not fam.fp32:
        return f"it takes float16 and bfloat16 on {fam.name} GPUs ({fam.cards}), got {request.dtype}"
    if largest > fam.max_head_dim:
        return f"it takes head dims up to {fam.max_head_dim} on {fam.name} GPUs ({fam.cards}), got {largest}"
    if request.uses("block mask") and largest > fam.max_block_mask_head_dim:
        return (f"it walks block masks at head dims up to {fam.max_block_mask_head_dim} on {fam.name} GPUs "
                f"({fam.cards}), got {largest}")
    declined = _release_declines(request, fam.name)
    if declined is not None:
        return declined
    if request.grad and largest > fam.max_grad_head_dim:
        return (f"its backward takes head dims up to {fam.max_grad_head_dim} on {fam.name} GPUs ({fam.cards}), "
                f"got {largest}")
    return None


def _release_declines(request: Request, family_name: str) -> str | None:
    """A call whose kernel compiles in no tile with the installed Triton on this family (``tables.DECLINED``)."""
    from . import configs, tables  # tables only: no triton

    declined = tables.DECLINED.get(family_name, set())
    if not declined:
        return None
    key = configs.table_key(request.head_dim, request.head_dim_v)
    largest = max(key) if isinstance(key, tuple) else key
    heavy = request.uses("dropout") or request.uses("attn_mask")
    weights = ({"fp32-heavy"} if heavy else {"fp32-light"}) if request.dtype == torch.float32 else (
        {"heavy"} if heavy else {"plain", "light"})
    kernels = {"forward", "decode"} | ({"dkdv", "dq"} if request.grad else set())
    for kernel, head_dim, weight in declined:
        if kernel in kernels and head_dim == largest and weight in weights:
            version = ".".join(map(str, tables.TRITON))
            return (f"Triton {version} compiles its {kernel} kernel for head dim {head_dim} with "
                    f"{'dropout or a mask' if 'heavy' in weight else 'these options'} on {family_name} GPUs in no "
                    "tile (a compiler failure)")
    return None


def device_arch(index: int) -> int | str:
    """GPU ``index``'s architecture as the families key it: 10 x major + minor on CUDA, the gfx name on ROCm."""
    if torch.version.hip:
        return torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


@functools.cache
def _gpu_family(index: int):
    from .families import family  # tables only: no triton

    return family(device_arch(index))
