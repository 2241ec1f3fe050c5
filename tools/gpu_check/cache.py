"""Would a Triton cache compiled on another machine be reused on this one? Triton 3.6 files a compiled kernel
under the sha256 of ``triton_key()`` (Triton's own sources and ``libtriton``, a Python extension, so one per
Python minor version), the kernel's source and specialization, ``ptxas --version`` with the target, the compile
options (libdevice by content, not path) and the cache-invalidating environment. Its launcher stubs are C built
per signature against this Python, keyed by their source and the platform.

``facts()`` reads each of those here; ``probe(cache_dir)`` compiles one small kernel for this machine's GPU (or
``--target``) into ``cache_dir`` and says whether it was a cache hit. Run the probe where a cache was built and
again on the GPU with the cache copied there: equal facts and a hit there mean a prebuilt cache saves the compiles.

    python -m tools.gpu_check.cache --facts                          # JSON
    python -m tools.gpu_check.cache --probe DIR [--target 90]       # compile into DIR, report hit or miss
    python -m tools.gpu_check.cache --build DIR [--target 90]       # the smoke's and headline's kernels

``--build`` (``make gpu-cache``) compiles, for the target and without a GPU, every Triton kernel the kernel smoke
and the headline benchmark launch, as they launch them (the public API on CPU tensors served as the GPU would
serve them, ``launch.compile_only`` under the offline driver), into ``DIR``, binaries only, for a GPU machine whose
``facts()`` match (``make gpu-cache``: Python 3.12, the PyPI wheel of Triton 3.6.0, sm_90) to load instead of
compiling (launcher stubs and FlexAttention's ``torch.compile`` are not cached). The probe kernel is reused there;
these kernels were not yet, on the H200 of 2026-11-26 (their keys differ: ``benchmarks/NOTES.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()[:16]


def facts() -> dict:
    """What Triton's cache keys are made of on this machine (hashes shortened to 16 hex digits)."""
    import triton
    from triton.runtime.build import platform_key
    from triton.runtime.cache import triton_key

    out = {"python": platform.python_version(), "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
           "triton": triton.__version__, "triton_path": str(Path(triton.__file__).parent),
           "triton_key": _sha(triton_key()), "platform_key": platform_key()}
    lib = Path(triton.__file__).parent / "_C" / "libtriton.so"
    out["libtriton"] = _sha(lib.read_bytes()) if lib.exists() else None
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        tool = get_ptxas(90).path
        out["ptxas"] = {"path": tool, "version": subprocess.check_output([tool, "--version"], text=True)
                        .strip().splitlines()[-1]}
    except Exception as err:  # no NVIDIA backend in this Triton build
        out["ptxas"] = f"{type(err).__name__}: {err}"
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        out["env"] = get_cache_invalidating_env_vars()
    except ImportError:
        out["env"] = None
    out["cache_dir"] = os.environ.get("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache"))
    return out


def probe(cache_dir: Path, target: int | None = None) -> dict:
    """Compile a small fixed kernel into ``cache_dir`` for ``target`` (10 x major + minor; default: this GPU) and
    report {"hit": bool, "seconds": compile seconds, "hash": the cache entry}."""
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir)
    os.environ.pop("TRITON_INTERPRET", None)  # a compiled kernel is the point (before triton is first imported)
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def scaled_copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2.0, mask=i < n)

    seen = {}
    knobs.compilation.listener = lambda **kw: seen.update(hit=kw["cache_hit"], seconds=kw["times"].total / 1e6)
    if target is None:
        import torch

        major, minor = torch.cuda.get_device_capability()
        target = 10 * major + minor
    src = ASTSource(scaled_copy, signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                    constexprs={"BLOCK": 1024})
    kernel = triton.compile(src, target=GPUTarget("cuda", target, 32))
    return {**seen, "hash": kernel.hash, "target": target}


def _headline_calls() -> list:
    """The calls the headline benchmark times: bf16, 16k tokens at 8k per sequence, hidden 2048, forward under
    inference mode and forward + backward."""
    import torch

    import flashattn

    def call(d: int, causal: bool, train: bool):
        def run():
            q, k, v = (torch.randn(2, 8192, 2048 // d, d, dtype=torch.bfloat16, requires_grad=train)
                       for _ in range(3))
            if train:
                out = flashattn.flash_attn_func(q, k, v, causal=causal)
                torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
            else:
                with torch.inference_mode():
                    flashattn.flash_attn_func(q, k, v, causal=causal)
        return run

    return [call(d, causal, train) for d in (64, 128) for causal in (False, True) for train in (False, True)]


def build(cache_dir: Path, target: int = 90) -> dict:
    """Compile the smoke's and the headline's kernels for ``target`` into ``cache_dir``; {"kernels": entries in
    the cache, "seconds"}."""
    import time

    os.environ["TRITON_CACHE_DIR"] = str(cache_dir)
    os.environ["TRITON_STORE_BINARY_ONLY"] = "1"  # cubin and metadata: what a load needs, a tenth of the bytes
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("FLASHATTN_CPU_KERNEL", "0")
    import flashattn
    import flashattn.backends.triton as triton_path
    import flashattn.backends.triton.launch  # noqa: F401 (bound to the real ``interpreting`` before the patch)
    from tools.offline.compile import compiled_launches

    from . import smoke

    # CPU tensors served as the GPU serves CUDA ones (the family's own limits aside): ``serves`` reads the package's
    # ``interpreting`` at each call, while the launcher keeps its own (imported above), so the launches, arguments
    # and specialization are the GPU's, only compiled instead of run. (Patched before the launcher was imported,
    # the first build compiled the interpreter's upcast variants, which the H200 never asked for.)
    triton_path.interpreting = lambda: True
    start = time.perf_counter()
    calls = [lambda c=case: smoke.CHECKS[c.kernel](c, smoke.FULL, "cpu") for case in smoke.cases(tiny=False)]
    for call in [*calls, *_headline_calls()]:
        # AssertionError: the smoke judging outputs that were never computed.
        with flashattn.use_backend("triton"), contextlib.suppress(AssertionError):
            compiled_launches(target, call)
    return {"kernels": sum(1 for _ in cache_dir.iterdir()), "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_check.cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--facts", action="store_true", help="print what the cache keys are made of here (JSON)")
    p.add_argument("--probe", type=Path, help="compile the probe kernel into this cache folder")
    p.add_argument("--build", type=Path, help="compile the smoke's and headline's kernels into this folder")
    p.add_argument("--target", type=int, default=None,
                   help="architecture for --probe (default: this GPU) and --build (default: 90)")
    args = p.parse_args(argv)
    result = {}
    if args.facts or not (args.probe or args.build):
        result["facts"] = facts()
    if args.build:
        result["build"] = build(args.build, args.target or 90)
    if args.probe:
        result["probe"] = probe(args.probe, args.target)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
