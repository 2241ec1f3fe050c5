"""Compile ``flashattn/csrc/*.cu`` at first use with NVRTC and launch kernels through the CUDA driver API, both
through ctypes.

Why NVRTC and not ``torch.utils.cpp_extension``: a CUDA build of torch already ships NVRTC (the
``nvidia-cuda-nvrtc`` wheel it depends on) and the driver ships ``libcuda``, so this needs no nvcc, no host C++
compiler, no ninja and no download, and compiles in about a second. The kernel source includes no headers for
the same reason. Compiled cubins are cached on disk (``$FLASHATTN_CACHE`` or ``~/.cache/flashattn``), keyed by
the source, the options, the NVRTC version and the GPU architecture.
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

SOURCE_DIR = Path(__file__).resolve().parents[2] / "csrc"
OPTIONS = ("-std=c++17",)

_lock = threading.Lock()
_nvrtc: ctypes.CDLL | None = None
_cuda: ctypes.CDLL | None = None
_modules: dict[tuple[str, int], Module] = {}


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
    if result != 0:
        raise CompileError(f"NVRTC {what} failed: {nvrtc().nvrtcGetErrorString(result).decode()}")


def compile_source(source: str, name: str, arch: str) -> bytes:
    """Compile CUDA C++ ``source`` for ``arch`` ("sm_90": a cubin; "compute_90": PTX for the driver to JIT)."""
    lib = nvrtc()
    prog = ctypes.c_void_p()
    _check_nvrtc(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
                 "create")
    try:
        options = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in OPTIONS)]
        result = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        log_size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size))
        log = ctypes.create_string_buffer(log_size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if result != 0:
            raise CompileError(f"NVRTC could not compile {name} for {arch}:\n{log.value.decode(errors='replace')}")
        kind = "CUBIN" if arch.startswith("sm_") else "PTX"
        size = ctypes.c_size_t()
        _check_nvrtc(getattr(lib, f"nvrtcGet{kind}Size")(prog, ctypes.byref(size)), f"get {kind} size")
        image = ctypes.create_string_buffer(size.value)
        _check_nvrtc(getattr(lib, f"nvrtcGet{kind}")(prog, image), f"get {kind}")
        return image.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _cache_dir() -> Path:
    return Path(os.environ.get("FLASHATTN_CACHE") or Path.home() / ".cache" / "flashattn") / "cuda"


def compiled(filename: str, arch: str) -> bytes:
    """The image of ``csrc/<filename>`` for ``arch``, from the disk cache or freshly compiled."""
    source = (SOURCE_DIR / filename).read_text()
    key = hashlib.sha256("\0".join([source, arch, *OPTIONS, str(nvrtc_version())]).encode()).hexdigest()[:24]
    path = _cache_dir() / f"{Path(filename).stem}-{arch}-{key}.bin"
    if path.exists():
        return path.read_bytes()
    image = compile_source(source, filename, arch)
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
        _check_cu(_cuda.cuInit(0), "cuInit")
    return _cuda


def _check_cu(result: int, what: str) -> None:
    if result != 0:
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
        if shared_bytes > self._shared.get(name, 48 * 1024):  # above 48 KiB needs an opt-in per kernel
            _check_cu(cu.cuFuncSetAttribute(fn, 8, shared_bytes), "cuFuncSetAttribute(max dynamic shared)")
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


def module(filename: str, device: torch.device) -> Module:
    """``csrc/<filename>`` compiled for and loaded on ``device`` (once per process and device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (filename, index)
    with _lock:
        if key not in _modules:
            major, minor = torch.cuda.get_device_capability(index)
            try:
                image = compiled(filename, f"sm_{major}{minor}")
            except CompileError:
                # An NVRTC older than the GPU: PTX for the newest architecture it knows, JIT-compiled by the driver.
                image = compiled(filename, f"compute_{min(major * 10 + minor, 90)}")
            _modules[key] = Module(image, index)
        return _modules[key]
