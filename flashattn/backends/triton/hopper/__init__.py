"""The ``triton`` path's Hopper tier: kernels for sm_90 alone (a TMA producer warp, consumer warpgroups with
register reallocation, async wgmma under the softmax; written in Gluon), chosen call by call over the portable
kernels where they serve the call and were measured faster.

Two kernels: the forward (``forward.py``) and a one-pass backward (``backward.py`` and ``backward_wide.py`` over
``backward_parts.py``, taken under ``FLASHATTN_TRITON_TIER=hopper``, and under ``auto`` only where a measured entry
timed it faster: ``backward_declines``). The forward's rule
under ``auto`` (``declines``): bf16 with head dim 64, dense (batch, seqlen, heads, d) q, k and v with as many key as
query heads, causal (bottom-right) or not, and nothing else (no window, softcap, ALiBi, mask, block mask, dropout,
sink, FP8, KV cache or packed sequences). There, on an H200, its schedule ran 1.36-1.40x the portable forward at 8k
tokens, 1.26x at 1k (level when causal), correct against float64 in every case tried (``benchmarks/NOTES.md``); at
head dim 128 it was level, so the portable kernel keeps it. A measured table's ``tier`` entries (``make gpu-tune``:
``measured.load_tier``) replace that rule and the launched schedule per head dim (``measured_faster``,
``launched_schedule``). Its backward is the portable one, from the same out and lse, unless forced as below.

``FLASHATTN_TRITON_TIER`` chooses, for comparison and for users: ``auto`` (the default: the rule above),
``portable`` (never the tier), ``hopper`` (the tier wherever it can run: head dim 128, fp16, and, which the kernel
reads but no GPU has yet checked, head dim 256, the head dims between (multiples of 8 from 8 to 256, on tiles of
the next of 64, 128 and 256: ``tile_dim``), grouped key/value heads (GQA, MQA), sliding windows (any left and
right bound, either alignment, a diagonal offset), a softcap, packed sequences (``flash_attn_varlen_func``'s
q, k and v, each program bounded by its sequence's offsets), and FlashAttention-3's FP8 forward: e4m3 q, k, v with
descales, v handed over as ``attend.interleaved_values`` lays it out).

Example::

    >>> import torch
    >>> q = torch.empty(2, 1024, 16, 64, dtype=torch.bfloat16)
    >>> declines(q, q, q, AttentionSpec(scale=0.125, dropout_p=0.1), probs=False, arch=90)
    'dropout'
    >>> declines(q.half(), q.half(), q.half(), AttentionSpec(scale=0.125), probs=False, arch=90)
    'not measured faster than the portable forward'
"""

from __future__ import annotations

import functools

import torch

from ...environ import Variable, setting
from ...masking import kernel_side
from ...spec import AttentionSpec
from ..configs import DECODE_MAX_ROWS

TIER = Variable("FLASHATTN_TRITON_TIER")
TIERS = ("auto", "portable", "hopper")
MEASURED_FASTER = {(torch.bfloat16, 64)}  # (dtype, head dim) where ``auto`` takes the tier (see above) ...
# ... unless a measured file has an entry for it (``measured.load_tier``: gpu-tune's ``tier`` step): then ``auto``
# takes the tier where that entry reads at least this much faster than the portable forward over its cases
# (geometric mean) and no case slower than the second, and launches the schedule it names.
TAKES_OVER = (1.02, 0.98)
TILE_DIMS = (64, 128, 256)  # the head dims the kernels' tiles have; those below run padded (``tile_dim``)
# What the kernels can run (``hopper``): these dtypes, and head dims that are multiples of 8 (a TMA row is 16
# bytes) up to 256, those between 64, 128 and 256 on padded tiles (FP8 at those three alone).
RUNS = {torch.bfloat16, torch.float16}, range(8, TILE_DIMS[-1] + 1, 8)
INT32 = 2**31 - 1  # the kernel's row and lse offsets are 32-bit
GRID_Y = 65535  # the query blocks are the grid's second axis
GLUON_RELEASE = (3, 6)  # the Triton release the kernel is written and checked for


def tile_dim(d: int) -> int:
    """The head dim of the tiles a head dim ``d`` runs on (the tier's forward and backward): the first of 64, 128
    and 256 that holds it; ``ValueError`` unless d is one ``RUNS`` names.

    >>> tile_dim(96), tile_dim(64), tile_dim(200)
    (128, 64, 256)
    """
    if d not in RUNS[1]:
        raise ValueError(f"head dim {d} not supported (multiples of 8 up to {TILE_DIMS[-1]})")
    return next(tile for tile in TILE_DIMS if d <= tile)


def tier() -> str:
    value = TIER.get("auto")
    if value not in TIERS:
        raise ValueError(f"FLASHATTN_TRITON_TIER={value!r} is not one of {', '.join(TIERS)}")
    return value


def using(chosen: str):
    """``FLASHATTN_TRITON_TIER=chosen`` inside the ``with`` block (``environ.setting``): for tools whose subject is
    one tier's kernels."""
    if chosen not in TIERS:
        raise ValueError(f"using: chosen={chosen!r} is not one of {', '.join(TIERS)}")
    return setting(TIER.name, chosen)


def declines(q, k, v, spec: AttentionSpec, *, probs: bool, arch: int | str | None = None,  # noqa: PLR0911
             values_interleaved: bool = False) -> str | None:
    """Why the tier does not run this forward (None: it does). q (B, Nq, H, D), k and v (B, Nk, Hk, D) as the
    call's; ``probs``: the call returns its probabilities; ``arch`` the target (default ``launch.target_arch()``,
    asked last: the cheap tests decline most calls first); ``values_interleaved``: FP8 v as
    ``attend.interleaved_values`` returns it (keys contiguous, padded to groups of 32), which the FP8 forward reads."""
    chosen = tier()
    if chosen == "portable":
        return "FLASHATTN_TRITON_TIER=portable"
    dtypes, dims = RUNS
    fp8 = q.dtype == torch.float8_e4m3fn
    packed = spec.varlen is not None and spec.cache is None  # (a paged cache's calls: "cache" below)
    if (q.dtype not in dtypes and not fp8) or not q.dtype == k.dtype == v.dtype or q.ndim != (3 if packed else 4) or (
            packed and spec.varlen.batch < 1):
        return "dtype or layout"
    if packed and chosen == "auto":
        return "packed sequences (run by FLASHATTN_TRITON_TIER=hopper until a GPU has checked them)"
    if packed:  # the total rows as one batch: the checks below read it as a dense call
        q, k, v = q[None], k[None], v[None]
    b, nq, h, d = q.shape
    hk = k.shape[2] if k.ndim == 4 else 0
    values = v.shape[0] == b and v.shape[2:] == k.shape[2:] and (  # FP8: interleaved, whole groups of 32 keys
        v.shape[1] >= k.shape[1] and v.shape[1] % 32 == 0 if fp8 else v.shape[1] == k.shape[1])
    if d not in dims or tuple(k.shape) != (b, k.shape[1], hk, d) or not values or not hk or h % hk:
        return "head dims or grouped heads"
    if fp8 and (why := _fp8_declines(d, spec, chosen=chosen, values_interleaved=values_interleaved)):
        return why
    if chosen == "auto" and not measured_faster(q.dtype, d):
        return "not measured faster than the portable forward"
    if chosen == "auto" and hk != h:
        return "grouped heads (run by FLASHATTN_TRITON_TIER=hopper until a GPU has checked them)"
    aligned = nq == k.shape[1]
    if chosen == "auto" and _options_decline(spec, aligned, fp8=fp8) in ("window", "softcap") and (
            _options_decline(spec, aligned, fp8=fp8, band=True) is None):
        return "window or softcap (run by FLASHATTN_TRITON_TIER=hopper until a GPU has checked them)"
    if (spec.varlen.max_seqlen_q if packed else nq) <= DECODE_MAX_ROWS:  # 128-row programs would idle there
        return "decode-shaped (the portable decode kernel)"
    why = "probabilities" if probs else _options_decline(spec, aligned, fp8=fp8, band=True) or _memory_declines(
        q, k, v.permute(0, 2, 3, 1) if fp8 else v, diagonal_offset=spec.diagonal_offset)
    return why or _target_declines(arch)


@functools.cache
def _tier_measured() -> dict:
    from ..measured import load_tier

    return load_tier()


def measured_faster(dtype: torch.dtype, d: int, *, kernel: str = "tier_forward") -> bool:
    """Whether ``auto`` takes the tier's ``kernel`` (``tier_forward`` or ``tier_backward``) at this dtype and head dim
    (``TAKES_OVER``; where no measured entry says, ``MEASURED_FASTER`` for the forward, never for the backward)."""
    entry = _tier_measured().get((kernel, str(dtype).removeprefix("torch."), d))
    if entry is None:
        return kernel == "tier_forward" and (dtype, d) in MEASURED_FASTER
    return entry["vs_portable"] >= TAKES_OVER[0] and entry["worst"] >= TAKES_OVER[1]


def launched_schedule(dtype: torch.dtype, tile: int):
    """The forward schedule the tier launches on tiles of ``tile`` columns: a measured entry's (its dtype's; fp16
    also bf16's, the same instructions), else ``forward.LAUNCHED``'s (FP8's always: it is timed on its own)."""
    from .forward import LAUNCHED, VARIANTS

    found = _tier_measured()
    entry = found.get(("tier_forward", str(dtype).removeprefix("torch."), tile)) or (
        found.get(("tier_forward", "bfloat16", tile)) if dtype == torch.float16 else None)
    if entry is None:
        return LAUNCHED[tile]
    for schedule in VARIANTS:
        if str(schedule) == entry["schedule"]:
            return schedule
    raise ValueError(f"flashattn: the measured tier schedule {entry['schedule']!r} (head dim {tile}) is none of "
                     f"{', '.join(map(str, VARIANTS))}")


def _fp8_declines(d: int, spec: AttentionSpec, *, chosen: str, values_interleaved: bool) -> str | None:
    if d not in TILE_DIMS:
        return "FP8 at a padded head dim"
    if chosen == "auto":
        return "FP8 (run by FLASHATTN_TRITON_TIER=hopper until a GPU has checked it)"
    if not values_interleaved or spec.descale is None or spec.fp8_training:
        return "FP8 without interleaved values and descales (the training mode's, packed sequences')"
    return None


def _target_declines(arch: int | str | None) -> str | None:
    """Why the tier's kernels cannot run here: another Triton than the one they are written for (Gluon's API changes
    between releases; they are 3.6's), or a target (default ``launch.target_arch()``) other than sm_90."""
    from .. import installed_release

    if installed_release() != GLUON_RELEASE:
        return f"triton {installed_release()}, not {GLUON_RELEASE}"
    if arch is None:
        from ..launch import target_arch

        arch = target_arch()
    return None if arch == 90 else f"not sm_90 ({arch or 'the interpreter'})"


def _options_decline(spec: AttentionSpec, causal_alignment: bool, *, fp8: bool = False,
                     band: bool = False) -> str | None:
    """The first option the kernels do not read, or "window"; ``fp8``: the FP8 forward, which reads the descales;
    ``band``: any window and a softcap are read (both kernels do; ``auto`` asks without, until a GPU has checked
    them)."""
    features = {"softcap": spec.softcap > 0 and not band, "dropout": spec.dropout_p > 0,
                "alibi": spec.alibi_slopes is not None, "sink": spec.sink is not None,
                "mask": spec.attn_mask is not None or spec.block_sparse is not None,
                "cache": spec.cache is not None, "fp8": not fp8 and (spec.descale is not None or spec.fp8_training),
                "scale": not spec.scale > 0}
    used = next((name for name, on in features.items() if on), None)
    if used:
        return used
    if band:
        return None
    full = (spec.window_left, spec.window_right) == (-1, -1)
    causal = (spec.window_left, spec.window_right) == (-1, 0) and (spec.bottom_right or causal_alignment)
    return None if (full or causal) and spec.diagonal_offset == 0 else "window"


def _memory_declines(q, k, v, *, diagonal_offset: int = 0) -> str | None:
    b, nq, h, _ = q.shape
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v)):
        return "not contiguous or not 16-byte aligned (TMA)"
    # Row indices are 32-bit, up to a tile past the last row (the kernels form a tile's first row before masking),
    # and so are a row's band bounds: row + diagonal + side, each side at most 2 (nq + nk) + |offset|
    # (masking.kernel_side).
    nk = k.shape[1]
    if -(-nq // 128) > GRID_Y or b * h * nq > INT32 or b * max(nq, nk) + 128 > INT32 or (
            4 * (nq + nk) + 3 * abs(diagonal_offset) + 256 > INT32):
        return "too large for the grid or 32-bit offsets"
    return None


def _band_arguments(q, k, spec: AttentionSpec) -> dict:
    """What both kernels' ``launch_arguments`` take of ``spec``: scale, band (a side past every key read as
    unbounded: ``masking.kernel_side``), softcap and packed sequences' offsets."""
    packed = spec.varlen
    nq, nk = (q.shape[1], k.shape[1]) if packed is None else (packed.max_seqlen_q, packed.max_seqlen_k)
    left, right = (kernel_side(side, nq=nq, nk=nk, diagonal_offset=spec.diagonal_offset)
                   for side in (spec.window_left, spec.window_right))
    return dict(causal=False, scale=spec.scale, window=(left, right), top_left=not spec.bottom_right,
                diagonal_offset=spec.diagonal_offset, softcap=spec.softcap,
                cu_seqlens=None if packed is None else (packed.cu_seqlens_q, packed.cu_seqlens_k))


def launch_forward(q, k, v, out, lse, spec: AttentionSpec, *, descale: torch.Tensor | None = None) -> None:
    """Run the tier's forward of ``spec`` (its scale, band and softcap: what ``declines`` let through) into ``out``
    (q's shape) and ``lse`` (B, H, Nq) float32, through the path's ``launch`` (compile-only runs and launch plans see
    it as any other kernel: a plan rebuilds its Gluon descriptors around each call's tensors). FP8: ``descale``
    (B, Hk) the scores' scale, out float32."""
    from ..launch import launch
    from .forward import attention_forward_ws_kernel, launch_arguments

    packed = spec.varlen
    schedule = launched_schedule(q.dtype, tile_dim(q.shape[-1]))
    grid, kwargs = launch_arguments(q, k, v, out, lse, schedule=schedule, descale=descale,
                                    max_seqlen_q=0 if packed is None else packed.max_seqlen_q,
                                    **_band_arguments(q, k, spec))
    launch(attention_forward_ws_kernel, grid, **kwargs)


AUTO_BACKWARD = "the tier's backward runs under FLASHATTN_TRITON_TIER=hopper until a GPU has measured it faster"


def backward_declines(q, k, v, dout, spec: AttentionSpec, *, arch: int | str | None = None) -> str | None:
    """Why the tier's one-pass backward does not run this call's backward (None: it does): with
    ``FLASHATTN_TRITON_TIER=hopper``, bf16/fp16 at head dims that are multiples of 8 up to 256 (padded up to 64, 128
    or 256), key/value heads dividing the query heads (GQA, MQA), contiguous q, k, v and dO, dense or packed, any
    band and softcap (the forward's) and no other option; ``deterministic`` orders dQ's atomic adds
    (``launch_backward``). Under ``auto`` only the calls a measured ``tier_backward`` entry timed faster than the
    portable backward (``measured_faster``): its dtype and head dim, dense, as many key as query heads, causal or
    full, not deterministic."""
    chosen = tier()
    if chosen == "portable":
        return "FLASHATTN_TRITON_TIER=portable"
    if chosen == "auto" and not measured_faster(q.dtype, q.shape[-1], kernel="tier_backward"):
        return AUTO_BACKWARD  # (every backward asks: the common answer first, before the layout's checks)
    dtypes, dims = RUNS  # (``backward.py``: tiles of 64 and 128 columns; ``backward_wide.py``: 256)
    packed = spec.varlen is not None and spec.cache is None  # (a paged cache's calls: "cache" below)
    if q.dtype not in dtypes or not q.dtype == k.dtype == v.dtype == dout.dtype or q.ndim != (3 if packed else 4) or (
            packed and spec.varlen.batch < 1):
        return "dtype or layout"
    if packed:  # the total rows as one batch: the checks below read it as a dense call
        q, k, v, dout = q[None], k[None], v[None], dout[None]
    b, nq, h, d = q.shape
    hk = k.shape[2] if k.ndim == 4 else 0
    if d not in dims or tuple(k.shape) != (b, k.shape[1], hk, d) or v.shape != k.shape or not hk or h % hk:
        return "head dims or grouped heads"
    if dout.shape != q.shape:
        return "dtype or layout"
    if chosen == "auto" and (packed or hk != h or spec.deterministic or _options_decline(spec, nq == k.shape[1])):
        return AUTO_BACKWARD
    why = _options_decline(spec, nq == k.shape[1], band=True) or _memory_declines(
        q, k, v, diagonal_offset=spec.diagonal_offset)
    if why:
        return why
    if -(-k.shape[1] // 64) > GRID_Y:  # a program per 64 or 128 keys (backward.py, backward_wide.py)
        return "too large for the grid or 32-bit offsets"
    if not dout.is_contiguous() or dout.data_ptr() % 16:
        return "dout not contiguous or not 16-byte aligned (TMA)"
    return _target_declines(arch)


def launch_backward(q, k, v, dout, stats, grads, spec: AttentionSpec) -> None:
    """Run the tier's one-pass backward of ``spec`` (its scale, band and softcap): ``stats`` = (neg_lse2, delta) as
    the portable preprocess writes them, ``grads`` = (dq_sum fp32 zeroed, dk, dv), through the path's ``launch``
    (plans replay it). ``deterministic``: dQ's atomic adds into each query tile run in a fixed order of the key
    blocks, each waiting on a counter (``tickets``, left at zero) for its turn, so a call's dQ is the same bits
    every time, at the cost of the waits."""
    from .. import plans
    from ..launch import launch
    from ..tickets import tickets
    from .backward import launch_arguments, semaphores_needed

    packed = spec.varlen
    semaphores = None
    if spec.deterministic:
        count = semaphores_needed(q, sequences=0 if packed is None else packed.batch)
        semaphores = plans.counters(tickets(q.device, count), count)
    kernel, grid, kwargs = launch_arguments(q, k, v, dout, stats, grads,
                                            max_seqlen_k=0 if packed is None else packed.max_seqlen_k,
                                            dq_semaphores=semaphores, **_band_arguments(q, k, spec))
    launch(kernel, grid, **kwargs)
