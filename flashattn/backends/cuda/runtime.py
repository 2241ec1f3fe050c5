"""Compile ``flashattn/csrc/flash_fwd.cu`` at first use with NVRTC, one variant at a time (``kernel.py``), and
launch it through the CUDA driver API, both through ctypes.

Why NVRTC and not ``torch.utils.cpp_extension``: a CUDA build of torch already ships NVRTC (the
``nvidia-cuda-nvrtc`` wheel it depends on) and the driver ships ``libcuda``, so this needs no nvcc, no host C++
compiler, no ninja and no download, and compiles a variant in under a second. The kernel source includes no
headers for the same reason. Compiled images are kept on disk in the kernel store (``$FLASHATTN_CACHE/cuda``, by
default ``~/.cache/flashattn/cuda``), keyed by the source, the options with their defines, the NVRTC version and
the GPU architecture.

    module(Variant.of(q.dtype, 128, causal=True), q.device).launch(ENTRY, grid, block, shared, stream, args)
    compile_all("sm_90")  # {variant: cubin}, fresh: how long compiling takes, and what the tests inspect
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import os
import sys
import threading
from pathlib import Path

import torch

from .kernel import SOURCE, VARIANTS, Variant, compile_options

SOURCE_DIR = Path(__file__).resolve().parents[2] / "csrc"

# Status and enum values of the C APIs, as nvrtc.h (nvrtcResult) and cuda.h (CUresult, CUfunction_attribute) name them.
NVRTC_SUCCESS = 0
CUDA_SUCCESS = 0
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
# Dynamic shared memory a kernel may use without opting in through the attribute above.
DEFAULT_MAX_DYNAMIC_SHARED_BYTES = 48 * 1024

_lock = threading.Lock()
_nvrtc: ctypes.CDLL | None = None
_cuda: ctypes.CDLL | None = None
_modules: dict[tuple[Variant, int], Module] = {}


class CompileError(RuntimeError):
    """NVRTC rejected the source, or no NVRTC / driver library could be loaded."""


def _nvrtc_candidates() -> list[str]:
    found = [os.environ["FLASHATTN_NVRTC"]] if os.environ.get("FLASHATTN_NVRTC") else []
    roots = [Path(torch.__file__).parent / "lib", *(Path(p) / "nvidia" for p in sys.path if p)]
    for root in roots:
        for pattern in ("libnvrtc.so*", "*/lib/libnvrtc.so*", "libnvrtc-*.so*"):
            found += sorted(glob.glob(str(root / pattern)))
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found += sorted(glob.glob(os.path.join(cuda_home, "lib64", "libnvrtc.so*")))
    if (name := ctypes.util.find_library("nvrtc")) is not None:
        found.append(name)
    return [f for f in found if "builtins" not in os.path.basename(f)]


def nvrtc() -> ctypes.CDLL:
    """The NVRTC library (the one torch's CUDA build depends on, else the toolkit's)."""
    global _nvrtc
    if _nvrtc is None:
        errors = []
        for path in _nvrtc_candidates():
            try:
                _nvrtc = ctypes.CDLL(path)
                break
            except OSError as err:
                errors.append(f"{path}: {err}")
        else:
            raise CompileError("flashattn's cuda backend needs NVRTC (libnvrtc.so), which a CUDA build of torch "
                               "installs as the nvidia-cuda-nvrtc package; none was found"
                               + (f" ({'; '.join(errors)})" if errors else "") + ". Set FLASHATTN_NVRTC to its path.")
        _nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    return _nvrtc


def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def _check_nvrtc(result: int, what: str) -> None:
    if result != NVRTC_SUCCESS:
        raise CompileError(f"NVRTC {what} failed: {nvrtc().nvrtcGetErrorString(result).decode()}")


def compile_source(source: str, name: str, arch: str, options: list[str] | tuple[str, ...] = ()) -> bytes:
    """Compile CUDA C++ ``source`` for ``arch`` ("sm_90": a cubin; "compute_90": PTX for the driver to JIT) with
    NVRTC ``options``. flash_fwd.cu needs its defines: ``compile_variant`` passes them."""
    lib = nvrtc()
    prog = ctypes.c_void_p()
    _check_nvrtc(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
                 "create")
    try:
        argv = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in options)]
        result = lib.nvrtcCompileProgram(prog, len(argv), (ctypes.c_char_p * len(argv))(*argv))
        log_size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size))
        log = ctypes.create_string_buffer(log_size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if result != NVRTC_SUCCESS:
            raise CompileError(f"NVRTC could not compile {name} for {arch}:\n{log.value.decode(errors='replace')}")
        kind = "CUBIN" if arch.startswith("sm_") else "PTX"
        size = ctypes.c_size_t()
        _check_nvrtc(getattr(lib, f"nvrtcGet{kind}Size")(prog, ctypes.byref(size)), f"get {kind} size")
        image = ctypes.create_string_buffer(size.value)
        _check_nvrtc(getattr(lib, f"nvrtcGet{kind}")(prog, image), f"get {kind}")
        return image.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_variant(arch: str, variant: Variant) -> bytes:
    """The image of one variant of flash_fwd.cu for ``arch``, freshly compiled (the kernel store is not read)."""
    return compile_source((SOURCE_DIR / SOURCE).read_text(), SOURCE, arch, compile_options(variant))


def compile_all(arch: str) -> dict[Variant, bytes]:
    """Every variant's image for ``arch``, freshly compiled: what eight first calls would compile."""
    return {variant: compile_variant(arch, variant) for variant in VARIANTS}


def _store_dir() -> Path:
    """The kernel store: compiled images on disk. ``FLASHATTN_CACHE`` is the user's name for its parent."""
    return Path(os.environ.get("FLASHATTN_CACHE") or Path.home() / ".cache" / "flashattn") / "cuda"


def store_path(arch: str, variant: Variant) -> Path:
    """Where the kernel store keeps ``variant``'s image for ``arch``: the name changes with anything that changes
    the image (source, options and defines, NVRTC version)."""
    source = (SOURCE_DIR / SOURCE).read_text()
    key = "\0".join([source, arch, *compile_options(variant), str(nvrtc_version())])
    return _store_dir() / f"{Path(SOURCE).stem}-{variant}-{arch}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.bin"


def compiled(arch: str, variant: Variant) -> bytes:
    """The image of ``variant`` for ``arch``, from the kernel store or freshly compiled (and then stored)."""
    path = store_path(arch, variant)
    if path.exists():
        return path.read_bytes()
    image = compile_variant(arch, variant)
    try:  # best effort: a read-only home only costs a recompile next time
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(image)
        tmp.replace(path)
    except OSError:
        pass
    return image


def driver() -> ctypes.CDLL:
    global _cuda
    if _cuda is None:
        try:
            _cuda = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise CompileError(f"flashattn's cuda backend needs the NVIDIA driver (libcuda.so.1): {err}") from err
        _check_cu(_cuda.cuInit(0), "cuInit")  # 0: cuInit takes no flags yet
    return _cuda


def _check_cu(result: int, what: str) -> None:
    if result != CUDA_SUCCESS:
        message = ctypes.c_char_p()
        _cuda.cuGetErrorString(result, ctypes.byref(message))
        raise RuntimeError(f"CUDA driver {what} failed ({result}): {(message.value or b'?').decode()}")


class Module:
    """A loaded cubin/PTX on one device, with its kernels by name."""

    def __init__(self, image: bytes, device: int) -> None:
        cu = driver()
        handle = ctypes.c_int()
        _check_cu(cu.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
        # torch's runtime API works in the device's primary context: load the module there so its kernels run
        # on torch's streams and memory.
        self.context = ctypes.c_void_p()
        _check_cu(cu.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), handle), "cuDevicePrimaryCtxRetain")
        _check_cu(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self.handle = ctypes.c_void_p()
        _check_cu(cu.cuModuleLoadData(ctypes.byref(self.handle), image), "cuModuleLoadData")
        self._functions: dict[str, ctypes.c_void_p] = {}
        self._shared: dict[str, int] = {}

    def function(self, name: str, shared_bytes: int) -> ctypes.c_void_p:
        cu = driver()
        fn = self._functions.get(name)
        if fn is None:
            fn = ctypes.c_void_p()
            _check_cu(cu.cuModuleGetFunction(ctypes.byref(fn), self.handle, name.encode()), f"get {name}")
            self._functions[name] = fn
        if shared_bytes > self._shared.get(name, DEFAULT_MAX_DYNAMIC_SHARED_BYTES):  # opt-in per kernel
            _check_cu(cu.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes),
                      "cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)")
            self._shared[name] = shared_bytes
        return fn

    def launch(self, name: str, grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int,
               stream: int, args: list) -> None:
        """Launch ``name`` with ctypes-typed ``args`` (c_void_p for pointers) on ``stream`` (a CUstream handle)."""
        fn = self.function(name, shared_bytes)
        cu = driver()
        _check_cu(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        params = (ctypes.c_void_p * len(args))(*(ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args))
        _check_cu(cu.cuLaunchKernel(fn, *grid, *block, shared_bytes, ctypes.c_void_p(stream), params, None),
                  f"launch {name}")


def module(variant: Variant, device: torch.device) -> Module:
    """``variant`` compiled for and loaded on ``device`` (once per process, variant and device); its kernel is
    ``kernel.ENTRY``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (variant, index)
    with _lock:
        if key not in _modules:
            major, minor = torch.cuda.get_device_capability(index)
            try:
                image = compiled(f"sm_{major}{minor}", variant)
            except CompileError:
                # An NVRTC older than the GPU: PTX for the newest architecture it knows, JIT-compiled by the driver.
                image = compiled(f"compute_{min(major * 10 + minor, 90)}", variant)
            _modules[key] = Module(image, index)
        return _modules[key]
