"""The CPU kernel (``flashattn/csrc/cpu_flash.cpp`` and its headers): FlashAttention-2 forward and backward in C++,
built with the host C++ compiler at first use, cached, and the CPU backend's default; where it cannot be built the
tiled PyTorch path runs (``cpu.py``), with one log line saying why.

Why C++: the tiled path issues a dozen torch ops per tile, each its own parallel region that waits for its slowest
thread, so a busy machine slows it several times over. The kernel runs one parallel region per call whose threads
pull tasks (sequence, kv head, query block) longest first, so a thread slowed by another process simply takes fewer;
each task runs its whole key loop with its tiles in cache, the two matmuls of a tile on the BLAS torch ships and the
online softmax, softcap, ALiBi, masks and dropout (Triton's Philox, bit for bit) fused in one vectorised pass. The
backward gives each task the dQ of its rows and its own dK/dV partial: no atomics, deterministic.

What it serves: every dense, packed (varlen) and KV-cache call (dense or paged pages of any size; the whole key range at
once, as split-KV only helps fill a GPU) in fp16, bf16, fp32 (fp32 accumulation) and fp64, with causal or window bands
at any alignment, softcap, ALiBi, learnable sinks, GQA/MQA without copies, SDPA boolean and additive masks (with their
gradient), dropout and a gradient flowing into the log-sum-exp. Returned probabilities (a testing aid) run on the tiled
path. Short query blocks (decode) pack the query heads of a kv head into one tile, so the group shares each K/V tile.

The build (``torch.utils.cpp_extension.load``) lives in ``$FLASHATTN_CACHE/cpu`` (default ``~/.cache/flashattn``),
one folder per sources, compiler flags, CPU (it is compiled for the host's instruction set) and torch version;
cpp_extension locks the folder, so two processes building at once wait for each other, and a failed or broken
build falls back to the tiled path instead of raising. ``FLASHATTN_CPU_KERNEL=0`` turns the kernel off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import torch

from .spec import AttentionSpec, accumulation_dtype

SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "cpu_flash.cpp"
# Every file the build reads: a change to any of them is a new build folder.
SOURCES = (SOURCE, *(SOURCE.parent / name for name in ("cpu_vec.h", "cpu_common.h", "cpu_forward.h", "cpu_backward.h")))
# -fopenmp: at::parallel_for is OpenMP in a header; without it the region runs on one thread and each matmul inside
# opens its own parallel region, which a busy machine slows several times over.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros")
# Query rows x keys of a task's tile, measured on 2 cores (fp32 and bf16, d = 64 and 128, N = 1k..4k, best of
# 64..256 x 128..512, benchmarks/NOTES.md): the forward gains from tall tiles (the BLAS packs each K/V tile once per
# query block), the backward hardly cares and keeps its four tile-sized buffers smaller.
FORWARD_TILE = (256, 256)
BACKWARD_TILE = (128, 128)
_log = logging.getLogger("flashattn")
_enabled: ContextVar[bool] = ContextVar("flashattn_cpu_kernel", default=True)


@contextmanager
def use(enabled: bool) -> Iterator[None]:
    """Run the CPU backend with (True) or without (False: the tiled path only) the kernel inside the block; how
    the tests cover both paths."""
    token = _enabled.set(enabled)
    try:
        yield
    finally:
        _enabled.reset(token)


def cache_dir() -> Path:
    return Path(os.environ.get("FLASHATTN_CACHE") or Path.home() / ".cache" / "flashattn") / "cpu"


def _cpu_signature() -> str:
    """The host's instruction-set flags (a build with -march=native must not run on another CPU)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def build_name() -> str:
    key = "\n".join([*(path.read_text() for path in SOURCES), " ".join(FLAGS), _cpu_signature(), torch.__version__])
    return "flashattn_cpu_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _put_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the pip package's copy sits beside the interpreter, which a venv's
    python run without activating does not have on PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def _load():
    """(module, None) or (None, why not); logged once. A build folder that fails to load (a truncated or foreign
    library left by a killed build) is removed and built once more before giving up."""
    if os.environ.get("FLASHATTN_CPU_KERNEL", "1").strip() == "0":
        return None, "FLASHATTN_CPU_KERNEL=0"
    folder = cache_dir() / build_name()
    try:
        return _build(folder), None
    except Exception as exc:  # no compiler, a failed build, a broken cache: the tiled path runs instead
        error = exc
    if any(folder.glob("*.so")):
        _log.info("flashattn: the CPU kernel's build in %s did not load (%s); rebuilding it", folder, _why(error))
        shutil.rmtree(folder, ignore_errors=True)
        try:
            return _build(folder), None
        except Exception as exc:
            error = exc
    _log.warning("flashattn: the CPU kernel could not be built (%s); using the tiled PyTorch path", _why(error))
    return None, _why(error)


def _why(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"


def _build(folder: Path):
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    folder.mkdir(parents=True, exist_ok=True)
    return load(name=folder.name, sources=[str(SOURCE)], extra_cflags=list(FLAGS), extra_ldflags=["-fopenmp"],
                build_directory=str(folder), verbose=False)


def status() -> tuple[bool, str]:
    """(whether the kernel is built and loaded, a line saying so or why not); builds it if needed."""
    module, why = _load()
    return (True, f"built in {cache_dir() / build_name()}") if module is not None else (False, why)


def unserved(q, k, v, spec: AttentionSpec, *, return_probs: bool = False) -> str | None:
    """Why the kernel does not serve this call (None: it does, forward and backward)."""
    if not _enabled.get():
        return "turned off (cpu_kernel.use(False))"
    if q.device.type != "cpu":
        return "not a CPU tensor"
    if return_probs:
        return "returned probabilities"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return f"dtype {q.dtype}"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return "a head dim with a stride"
    return None


def _sequences(q, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(seqs (S, 7) int64: q batch, q start, nq, k batch, k start, nk, diagonal per sequence; the page table or
    None), for varlen and KV-cache calls (the kernel derives a dense batch's itself). One host read of the
    offsets, as the tiled path's ``bounds()``."""
    if spec.packed:
        queries = [(0, sq, eq - sq) for sq, eq, _, _ in spec.varlen.bounds()]
    else:
        queries = [(b, 0, q.shape[1]) for b in range(q.shape[0])]
    cache = spec.cache
    if cache is not None:
        entries = range(len(queries)) if cache.batch_idx is None else cache.batch_idx.tolist()
        keys = [(kb, start, end - start) for kb, (start, end) in zip(entries, cache.bounds(), strict=True)]
    else:  # packed: a dense batch never comes here
        keys = [(0, sk, ek - sk) for _, _, sk, ek in spec.varlen.bounds()]
    rows = [(*qs, *ks, spec.band(qs[2], ks[2]).diagonal) for qs, ks in zip(queries, keys, strict=True)]
    seqs = torch.tensor(rows, dtype=torch.long).view(-1, 7)
    return seqs, None if cache is None else cache.block_table


def _options(q, k, spec: AttentionSpec, *, tile: tuple[int, int]) -> dict:
    """The kernel's options (``cpu_flash.cpp``) for this call, by name."""
    if spec.packed or spec.cache is not None:
        seqs, table = _sequences(q, spec)
        diagonal = 0
    else:
        seqs, table, diagonal = None, None, spec.band(q.shape[1], k.shape[1]).diagonal
    options = {"seqs": seqs, "block_table": table, "diagonal": diagonal, "scale": float(spec.scale),
               "softcap": float(spec.softcap),
               "left": int(spec.window_left), "right": int(spec.window_right), "block_m": tile[0],
               "block_n": tile[1], "alibi": spec.alibi_slopes, "sink": spec.sink, "dropout_p": float(spec.dropout_p),
               "mask": None}
    if spec.dropout_p > 0:
        rows, cols = ((spec.varlen.max_seqlen_q, spec.varlen.max_seqlen_k) if spec.packed
                      else (q.shape[1], k.shape[1]))
        options.update(seed=int(spec.seed.item()), counter_rows=int(rows), counter_cols=int(cols))
    blocks = spec.block_sparse
    if blocks is not None:  # the tiles are the block mask's
        options.update(tile_kind=blocks.tile_kind, partial_id=blocks.partial_id, partial_masks=blocks.partial_masks,
                       block_m=blocks.q_block, block_n=blocks.kv_block)
    mask = spec.attn_mask
    if mask is not None:  # (B|1, H|1, Nq|1, Nk|1) -> a (B, H, Nq, Nk) view; additive masks in the accumulation type
        if mask.dtype != torch.bool:
            mask = mask.to(accumulation_dtype(q.dtype))
        options["mask"] = mask.expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    return options


def _as_batch(t: torch.Tensor, spec: AttentionSpec, *, keys: bool) -> torch.Tensor:
    """Packed (total, H, D) tensors as a batch of one (1, total, H, D); KV caches are already 4-D."""
    return t[None] if spec.packed and not (keys and spec.cache is not None) else t


def forward(q, k, v, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(out, lse) from the kernel, or None when it is not available (the caller runs the tiled path). Shapes as
    the CPU backend's forward: dense, packed (varlen) or keys in a KV cache.

    Example::

        >>> q = k = v = torch.randn(1, 5, 2, 8)
        >>> result = forward(q, k, v, AttentionSpec(scale=8 ** -0.5))
        >>> result is None or result[0].shape == (1, 5, 2, 8)
        True
    """
    module, _ = _load()
    if module is None:
        return None
    h, dv = q.shape[-2], v.shape[-1]
    out = torch.empty(*q.shape[:-1], dv, dtype=q.dtype)
    lse_shape = (h, q.shape[0]) if spec.packed else (q.shape[0], h, q.shape[1])
    lse = torch.empty(lse_shape, dtype=accumulation_dtype(q.dtype))
    q4, k4, v4 = _as_batch(q, spec, keys=False), _as_batch(k, spec, keys=True), _as_batch(v, spec, keys=True)
    module.forward(q4, k4, v4, _as_batch(out, spec, keys=False), lse[None] if spec.packed else lse,
                   _options(q4, k4, spec, tile=FORWARD_TILE))
    return out, lse


def backward(dout, dlse, saved, spec: AttentionSpec, *, mask_grad: bool = False):
    """(dq, dk, dv, dmask) from the kernel, or None when it is not available; as the CPU backend's backward (no
    KV cache), but dmask (with ``mask_grad``) is dS over the whole (B, H, Nq, Nk) in the accumulation dtype."""
    module, _ = _load()
    if module is None:
        return None
    q, k, v, out, lse = saved
    acc = accumulation_dtype(q.dtype)
    # The kernel reads rows through strides with a unit last one (views of longer sequences are fine).
    out, dout = (t if t.stride(-1) == 1 else t.contiguous() for t in (out, dout))
    lse = lse.to(acc) if lse.stride(-1) == 1 else lse.to(acc).contiguous()
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    batch = functools.partial(_as_batch, spec=spec, keys=False)
    dmask = torch.zeros(q.shape[0], q.shape[2], q.shape[1], k.shape[1], dtype=acc) if mask_grad else None
    if dlse is not None:
        dlse = dlse[None] if spec.packed else dlse
    module.backward(batch(q), batch(k), batch(v), batch(out), batch(dout),
                    lse[None] if spec.packed else lse, dlse, batch(dq), batch(dk), batch(dv), dmask,
                    _options(batch(q), batch(k), spec, tile=BACKWARD_TILE))
    return dq, dk, dv, dmask
