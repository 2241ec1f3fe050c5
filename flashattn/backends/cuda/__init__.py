"""The CUDA C++ backend: one fused FlashAttention-2 forward kernel (``flashattn/csrc/flash_fwd.cu``), compiled
at first use with NVRTC for the variant a call needs (``runtime.py`` says why NVRTC; ``kernel.py`` holds the tile
sizes and the defines each variant is compiled with).

It covers the core of the operator and nothing else: fp16/bf16, head dim 64 or 128, causal or not (diagonal
bottom-right or top-left), GQA/MQA, any sequence lengths, out and the log-sum-exp. Forward only. It is chosen
only when asked for (``use_backend("cuda")`` or ``FLASHATTN_BACKEND=cuda``), never automatically; a call it
cannot serve (``serves``) is refused before it runs, naming what is missing.
"""

from __future__ import annotations

import ctypes
import math

import torch

from ..request import Request
from ..spec import AttentionSpec, Saved
from .kernel import BLOCK_M, DTYPES, ENTRY, HEAD_DIMS, WARPS, Variant, shared_bytes

NAME = "cuda"
FEATURES = ()  # of ``flashattn.backends.request.FEATURES``: none (causal is not a feature: every path serves it)
CHUNK_BYTES = 16  # the kernel moves rows in 16-byte cp.async copies: strides and the base must be whole chunks


def serves(request: Request) -> str | None:
    """fp16/bf16 CUDA tensors of head dim 64 or 128 (the same for v), causal or not, forward only; no other
    feature."""
    if request.dtype not in DTYPES:
        return f"it takes float16 or bfloat16, got {request.dtype}"
    if request.head_dim not in HEAD_DIMS or request.head_dim_v != request.head_dim:
        return (f"it takes head dim 64 or 128 (the same for q, k and v), got {request.head_dim} and "
                f"{request.head_dim_v}")
    missing = [feature for feature in request.features if feature not in FEATURES]
    if missing:
        return f"it does not implement {', '.join(missing)}"
    if request.grad:
        return "it is forward-only: train with the triton path (use_backend('auto') or 'triton')"
    if request.device != "cuda":
        return f"it runs on CUDA tensors, got {request.device} tensors"
    if torch.version.hip:
        return "it is NVIDIA CUDA C++ (NVRTC): a ROCm build of torch runs the triton path"
    return None


def _kernel_ready(x: torch.Tensor) -> torch.Tensor:
    """The kernel reads 16-byte chunks of each row: rows contiguous, strides in whole chunks, base aligned."""
    chunk = CHUNK_BYTES // x.element_size()  # elements per 16-byte copy
    ok = x.stride(-1) == 1 and all(s % chunk == 0 for s in x.stride()[:-1]) and x.data_ptr() % CHUNK_BYTES == 0
    return x if ok else x.clone(memory_format=torch.contiguous_format)


def launch_args(q, k, v, out, lse, *, diagonal: int, scale: float) -> list:
    """The kernel's arguments in the order and C types of ``flash_fwd_kernel`` in flash_fwd.cu: pointers, then
    nheads, nheads_k, seqlen_q, seqlen_k, diagonal (int: query i's diagonal key is i + diagonal), then (batch,
    seq, head) strides of q, k, v, out (int64), then the scale in log2 units (float)."""
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    return [ptr(q.data_ptr()), ptr(k.data_ptr()), ptr(v.data_ptr()), ptr(out.data_ptr()), ptr(lse.data_ptr()),
            i32(q.shape[2]), i32(k.shape[2]), i32(q.shape[1]), i32(k.shape[1]), i32(diagonal),
            *(i64(s) for t in (q, k, v, out) for s in (t.stride(0), t.stride(1), t.stride(2))),
            ctypes.c_float(scale * math.log2(math.e))]


def forward(q, k, v, spec: AttentionSpec, *, return_probs: bool = False):
    """out (B, Nq, H, D) and lse (B, H, Nq) float32, as every path's forward returns them."""
    from . import runtime  # ctypes and NVRTC only when the backend is used

    b, nq, h, d = q.shape
    nk = k.shape[1]
    out = torch.empty(b, nq, h, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, nq, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse, q.new_empty(0)
    q, k, v = (_kernel_ready(t) for t in (q, k, v))
    causal = spec.window_right == 0
    diagonal = spec.band(nq, nk).diagonal
    module = runtime.module(Variant.of(q.dtype, d, causal), q.device)
    args = launch_args(q, k, v, out, lse, diagonal=diagonal, scale=spec.scale)
    with torch.cuda.device(q.device):
        stream = torch.cuda.current_stream(q.device).cuda_stream
        module.launch(ENTRY, (b * h, math.ceil(nq / BLOCK_M), 1), (WARPS * 32, 1, 1), shared_bytes(d), stream, args)
    return out, lse, q.new_empty(0)


def fp8_backward(q, k, v, spec: AttentionSpec) -> bool:
    """Whether the backward takes the FP8 training mode's e4m3 q, k, v with ``spec.descale`` (FP8 matmuls): no,
    the op hands this path the 16-bit values they stand for (``quantize.read_back``)."""
    return False


def backward(dout, dlse, saved: Saved, spec: AttentionSpec, *, mask_grad: bool = False):
    raise NotImplementedError("flashattn's cuda backend is forward-only: it has no backward yet. Train with the "
                              "triton backend (flashattn.use_backend('auto') or 'triton'); use 'cuda' for inference.")
