"""What ``flashattn info`` reports: the versions, the machine, the compilers each backend needs and whether they
work here, which backend ``auto`` picks for typical inputs and why, the Triton configs of each GPU family, and the
environment variables flashattn reads. Paste it into a bug report (``flashattn info --json``: machine-readable).

Every function returns plain data (JSON-ready) and none raises when something is missing: no GPU, no triton, no
NVRTC, no compiler; each item says what it found, or why not. ``collect()`` gathers them and ``format_text``
prints them aligned::

    >>> facts = collect()
    >>> sorted(facts)
    ['backends', 'compilers', 'cuda', 'environment', 'flashattn', 'gpu_families', 'system', 'versions']
    >>> facts["backends"][0]["device"], facts["backends"][0]["backend"]
    ('cpu', 'cpu')
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from . import __version__
from .host import cpu_model, load_average, usable_cores
from .tables import Col, table

__all__ = ["ENVIRONMENT", "backend_choices", "collect", "compiler", "cuda_devices", "environment", "format_text",
           "nvrtc", "system", "torch_build", "triton", "versions"]

# Every environment variable the package reads: (name, meaning, default).
ENVIRONMENT = (
    ("FLASHATTN_BACKEND", "force a path for every call: auto, triton, cpu, torch or cuda (use_backend() wins)", "auto"),
    ("FLASHATTN_NVRTC", "libnvrtc.so for the cuda backend, tried before torch's and the toolkit's", "searched"),
    ("FLASHATTN_TRITON_MEASURED", "a JSON file of measured Triton configs (tools.gpu_tune's) used first", "unset"),
    ("FLASHATTN_FP8_BACKWARD", "1: the FP8 training mode's backward has S and dP on FP8 tensor cores", "0"),
    ("FLASHATTN_LAUNCH_PLANS", "0: every Triton call runs its full launch code (no launch plans)", "1"),
    ("FLASHATTN_TRITON_TIER", "Hopper kernels: auto (where faster), portable (never), hopper (where they run)", "auto"),
    ("FLASHATTN_TRITON_BACKWARD", "Triton backward's dQ: two-pass (deterministic), one-pass (atomics), auto", "auto"),
    ("FLASHATTN_CACHE", "parent folder of the compiled kernels: the cuda backend's store in <it>/cuda, the CPU "
                        "kernel's build in <it>/cpu", "~/.cache/flashattn"),
    ("FLASHATTN_CPU_KERNEL", "0 turns the C++ kernel off (the torch path serves every CPU call)", "1"),
    ("FLASHATTN_CPU_TILES", "how the C++ kernel multiplies bf16/fp16 tiles: auto, fp32, native, amx, onednn or "
                            "avx512bf16 (flashattn.backends.cpu_tiles)", "auto"),
    ("FLASHATTN_CPU_ISA", "avx2: the C++ kernel as on an AVX2-only CPU (no 16-bit dot engines)", "native"),
    ("TRITON_INTERPRET", "1 runs the Triton kernels in Triton's interpreter on CPU tensors (set before triton is "
                         "imported; slow, for tests)", "unset"),
    ("CUDA_HOME", "CUDA toolkit searched for libnvrtc.so (lib64/) after torch's own", "/usr/local/cuda"),
    ("CUDA_PATH", "the same, when CUDA_HOME is not set", "/usr/local/cuda"),
    ("CXX", "the C++ compiler flashattn info (and torch's build of the CPU kernel) tries first", "c++, g++... on PATH"),
    ("PATH", "searched for a C++ compiler and ninja; the ninja package's copy is put first when none is found",
     "the system's"),
    ("LOCAL_RANK", "set by torchrun: flashattn bench context-parallel then runs as one rank", "unset"),
    ("FLASHATTN_BENCH_LOAD", "internal: the load reading bench context-parallel hands to its ranks", "unset"),
)
# Not read by flashattn, but they change what runs: shown by ``environment()`` too.
RELATED = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")

COMPILERS = ("c++", "g++", "clang++", "cc")
COMPILE_TIMEOUT_S = 60
PROBE_ARCH = "sm_80"  # NVRTC's test compile without a GPU: the oldest architecture the kernels target


def _installed(name: str) -> str | None:
    """The installed distribution's version, without importing it (transformers takes seconds to import)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_build() -> str:
    """"CUDA 12.8", "HIP 6.2" or "CPU only": what this torch was built for."""
    if getattr(torch.version, "hip", None):
        return f"HIP {torch.version.hip}"
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda}"
    return "CPU only"


def versions() -> dict:
    """flashattn, Python, torch (and its CUDA/HIP build), triton, transformers, numpy: None when not installed."""
    return {"flashattn": __version__, "python": platform.python_version(),
            "python_implementation": platform.python_implementation(), "python_executable": sys.executable,
            "torch": torch.__version__, "torch_build": torch_build(), "torch_cuda": torch.version.cuda,
            "torch_hip": getattr(torch.version, "hip", None),
            "triton": _installed("triton") or _installed("pytorch-triton") or _installed("pytorch-triton-rocm"),
            "transformers": _installed("transformers"), "numpy": _installed("numpy")}


def system() -> dict:
    """The OS, the CPU (model, cores, those this process may use, torch's intra-op threads) and the load now."""
    load_1m = load_average()
    return {"os": platform.platform(), "machine": platform.machine(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "usable_cores": usable_cores(), "torch_threads": torch.get_num_threads(),
            "load_1m": None if load_1m is None else round(load_1m, 2)}


def cuda_devices() -> dict:
    """Whether torch sees a GPU, and each device's name, compute capability and memory."""
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as err:  # a broken driver raises here rather than answering 0
        return {"available": False, "devices": [], "detail": f"none: {type(err).__name__}: {err}"}
    if not count:
        why = ("torch is a CPU-only build" if torch_build() == "CPU only"
               else f"torch ({torch_build()}) sees no device")
        return {"available": False, "devices": [], "detail": f"none: {why}"}
    devices = []
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        devices.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                        "memory_gib": round(p.total_memory / 2**30, 1)})
    return {"available": True, "devices": devices,
            "detail": "; ".join(f"cuda:{d['index']} {d['name']} (sm_{d['capability'].replace('.', '')}, "
                                f"{d['memory_gib']} GiB)" for d in devices)}


# triton.language, once ``triton()`` has imported it: Triton's interpreter looks the language up in a kernel's
# globals, so the probe kernel below must find it here, and importing triton at module import would tie every
# ``import flashattn.info`` to triton (and to whether TRITON_INTERPRET was set first).
tl = None


def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    """The probe: x[:n] += 1 in one program."""
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


def _run_probe(triton_module, device: str) -> None:
    global tl  # the module-level name the probe kernel reads (see above)
    import triton.language as tl

    x = torch.zeros(8, device=device)
    triton_module.jit(_add_one)[(1,)](x, 5, BLOCK=8)
    if x.tolist() != [1.0] * 5 + [0.0] * 3:
        raise RuntimeError(f"the probe kernel computed {x.tolist()}")


def triton() -> dict:
    """Whether Triton is importable and can run a kernel here: compiled on the GPU, or (no GPU) in the
    interpreter when ``TRITON_INTERPRET=1``, which is what it needs without one."""
    try:
        import triton as triton_module
    except ModuleNotFoundError as err:
        if err.name != "triton":
            return {"usable": False, "version": None, "detail": f"installed but fails to import: {err}"}
        return {"usable": False, "version": None, "detail": "not installed (pip install 'flashattn[triton]')"}
    except Exception as err:
        return {"usable": False, "version": None, "detail": f"installed but fails to import: {err}"}
    version = getattr(triton_module, "__version__", None)
    from .backends.triton import unsupported_release

    if unsupported_release():
        return {"usable": False, "version": version, "detail": unsupported_release()}
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    on_gpu = torch.cuda.is_available() and not interpreting
    if not on_gpu and not interpreting:
        return {"usable": False, "version": version,
                "detail": f"{version} imports; with no CUDA device its kernels would need the interpreter "
                          "(TRITON_INTERPRET=1 before triton is imported; slow, for tests)"}
    try:
        _run_probe(triton_module, "cuda" if on_gpu else "cpu")
    except Exception as err:
        where = "compile and run a kernel on cuda:0" if on_gpu else "run a kernel in the interpreter"
        return {"usable": False, "version": version,
                "detail": f"{version} imports but could not {where}: {type(err).__name__}: {_first_line(err)}"}
    how = ("compiled and ran a test kernel on cuda:0" if on_gpu
           else "ran a test kernel in the interpreter (TRITON_INTERPRET=1: CPU tensors, slow)")
    return {"usable": True, "version": version, "detail": f"{version}: {how}"}


def gpu_families() -> list[dict]:
    """The Triton kernels' GPU family (``backends/triton/families.py``) for each GPU present, or every family when
    there is none: architectures, shared memory per block, tensor-core instructions, a sample of its configs and
    whether they were compiled and checked offline for that architecture. Reads tables only: imports no triton."""
    from .backends.triton import configs, families, tables

    def sample(arch) -> str:  # what this Triton release's calls get (its own entries included)
        chosen = {kernel: configs.lookup(kernel, arch, 128, "plain") for kernel in ("forward", "dkdv", "dq")}
        return ", ".join(f"{kernel} {cfg.block_m}x{cfg.block_n}/{cfg.num_warps}w/{cfg.num_stages}s"
                         for kernel, cfg in chosen.items())

    releases = "; ".join(f"triton {major}.{minor}: {what}" for (major, minor), what in tables.CHECKED_ON.items())
    here = "none installed" if tables.TRITON is None else "{}.{}".format(*tables.TRITON)

    def row(fam: families.Family, archs: list, device: str | None) -> dict:
        name = families.arch_name
        checked = [a for a in archs if a in families.CHECKED_OFFLINE]
        aliases = [a for a in archs if a not in checked and a in families.ARCHITECTURES]
        status = (f"compiled and checked offline for {', '.join(map(name, checked))}" if checked else
                  "not checked offline")
        if aliases:
            status += f" ({', '.join(map(name, aliases))}: as {name(checked[0])})"
        return {"device": device, "family": fam.name, "architectures": [name(a) for a in archs],
                "cards": fam.cards, "shared_kib": fam.shared_bytes // 1024, "tensor_cores": fam.tensor_cores,
                "tma": fam.tma, "configs_d128": sample(archs[0]),
                "health": f"{status} ({releases}; here: triton {here}); not run on hardware here"}

    if torch.cuda.is_available():
        from .backends.triton import device_arch  # torch's device facts only: no triton

        return [row(families.family(arch), [arch], f"cuda:{i} {torch.cuda.get_device_name(i)}")
                for i in range(torch.cuda.device_count()) for arch in [device_arch(i)]]
    return [row(fam, [a for a, n in families.ARCHITECTURES.items() if n == fam.name], None)
            for fam in families.FAMILIES.values()]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def nvrtc() -> dict:
    """Whether the cuda backend's compiler, NVRTC, loads and compiles a test kernel (for this GPU's architecture,
    else for sm_80)."""
    try:
        from .backends.cuda import runtime
    except Exception as err:
        return {"usable": False, "version": None, "detail": f"cannot import the cuda backend: {err}"}
    try:
        library = runtime.nvrtc()
        major, minor = runtime.nvrtc_version()
    except runtime.CompileError as err:
        return {"usable": False, "version": None, "detail": str(err)}
    except Exception as err:  # a library that loads but misbehaves
        return {"usable": False, "version": None, "detail": f"{type(err).__name__}: {err}"}
    version, path = f"{major}.{minor}", getattr(library, "_name", "?")
    arch = PROBE_ARCH
    if torch.cuda.is_available() and not torch.version.hip:  # an AMD GPU's capability is no sm_ architecture
        arch = "sm_{}{}".format(*torch.cuda.get_device_capability(0))
    try:
        runtime.compile_source('extern "C" __global__ void probe(float* x) { x[threadIdx.x] += 1.0f; }',
                               "probe.cu", arch)
    except Exception as err:
        return {"usable": False, "version": version, "path": path,
                "detail": f"{version} ({path}) loads but could not compile for {arch}: {_first_line(err)}"}
    return {"usable": True, "version": version, "path": path,
            "detail": f"{version} ({path}): compiled a test kernel for {arch}"}


def _find_compiler() -> tuple[list[str] | None, str]:
    """The compiler command ($CXX, else the first of c++, g++, clang++, cc on PATH), or None and why not."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        command = shlex.split(cxx)
        found = shutil.which(command[0])
        if found is None:
            return None, f"CXX={cxx!r} is not an executable on PATH"
        return [found, *command[1:]], ""
    for name in COMPILERS:
        found = shutil.which(name)
        if found is not None:
            return [found], ""
    return None, f"none found: CXX is not set and none of {', '.join(COMPILERS)} is on PATH"


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def compiler() -> dict:
    """Whether a C/C++ compiler works: found (``$CXX`` or on PATH), its version line, and a one-line program
    compiled and linked in a temporary folder. (Triton builds its GPU launcher with the C compiler;
    ``torch.compile`` on CPU needs the C++ one.)"""
    command, why = _find_compiler()
    if command is None:
        return {"usable": False, "path": None, "version": None, "detail": why}
    name = " ".join(command)
    try:
        lines = (_run([*command, "--version"], 10).stdout or "").splitlines()
        version = lines[0].strip() if lines else "?"
        with tempfile.TemporaryDirectory(prefix="flashattn-info-") as tmp:
            source = Path(tmp) / "probe.cpp"
            source.write_text("int main() { return 0; }\n")
            done = _run([*command, str(source), "-o", str(Path(tmp) / "probe")], COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        return {"usable": False, "path": name, "version": None, "detail": f"{name}: timed out after {err.timeout} s"}
    except OSError as err:
        return {"usable": False, "path": name, "version": None, "detail": f"{name}: cannot run: {err}"}
    if done.returncode != 0:
        error = _first_line(RuntimeError(done.stderr or done.stdout)) or f"exit status {done.returncode}"
        return {"usable": False, "path": name, "version": version,
                "detail": f"{name} ({version}) could not compile a test program: {error}"}
    return {"usable": True, "path": name, "version": version,
            "detail": f"{name} ({version}): compiled and linked a test program"}


# (device type, dtype, head dim) the choice is shown for: typical CPU calls, and on a GPU one call per rule of the
# choice (half precision, fp32, fp64, a head dim beyond the Triton kernels).
CPU_CASES = (("cpu", "float32", 64), ("cpu", "bfloat16", 128), ("cpu", "float16", 128))
CUDA_CASES = (("cuda", "bfloat16", 128), ("cuda", "float16", 64), ("cuda", "float32", 64), ("cuda", "float64", 64),
              ("cuda", "bfloat16", 320))


def backend_choices(cuda: bool | None = None) -> list[dict]:
    """The path each typical call would run on, and why, with the reasons of the paths passed over
    (``flashattn.backends.explain``): CPU calls, and CUDA calls when a GPU is present (``cuda``: None asks torch)."""
    from .backends import Request, explain

    if cuda is None:
        cuda = torch.cuda.is_available()
    rows = []
    for device, dtype, head_dim in CPU_CASES + (CUDA_CASES if cuda else ()):
        try:
            name, reason = explain(Request(device, getattr(torch, dtype), head_dim, head_dim))
        except Exception as err:  # a bad FLASHATTN_BACKEND, a forced path that declines: every call would raise
            name, reason = None, f"{type(err).__name__}: {err}"
        rows.append({"device": device, "dtype": dtype, "head_dim": head_dim, "backend": name, "reason": reason})
    return rows


def environment() -> dict:
    """The variables flashattn reads (``ENVIRONMENT``) and two it does not but that change what runs (``RELATED``):
    their current values, None when unset."""
    return {name: os.environ.get(name) for name in [*(e[0] for e in ENVIRONMENT), *RELATED]}


_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def cpu_kernel() -> dict:
    """Whether the ``cpu`` path's C++ kernel builds (at first use, then cached) and loads here."""
    from .backends import cpu_build

    usable, detail = cpu_build.status()
    if not usable:
        return {"usable": False, "detail": f"{detail}; the torch path serves CPU calls"}
    from .backends import cpu_tiles

    tiles = {}
    for dtype in cpu_tiles.HALF_DTYPES:
        try:
            tiles[_SHORT[dtype]] = "{} tiles: {}".format(*cpu_tiles.explain(dtype))
        except ValueError as err:  # a FLASHATTN_CPU_TILES this machine cannot honour
            tiles[_SHORT[dtype]] = f"error: {err}"
    return {"usable": True, "detail": detail, "tiles": tiles}


def _guarded(fn: Callable[[], object]) -> object:
    """``fn()``, or what went wrong: one broken item must not hide the rest of the report."""
    try:
        return fn()
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}


def collect() -> dict:
    """Everything ``flashattn info`` reports, as JSON-ready data."""
    facts = {"flashattn": __version__, "versions": _guarded(versions), "system": _guarded(system),
             "cuda": _guarded(cuda_devices),
             "compilers": {"triton": _guarded(triton), "nvrtc": _guarded(nvrtc), "c++": _guarded(compiler),
                           "cpu kernel": _guarded(cpu_kernel)}}
    cuda = isinstance(facts["cuda"], dict) and bool(facts["cuda"].get("available"))
    facts["backends"] = _guarded(lambda: backend_choices(cuda))
    facts["gpu_families"] = _guarded(gpu_families)
    facts["environment"] = _guarded(environment)
    return facts


def _lines(pairs: list[tuple[str, object]]) -> list[str]:
    width = max(len(k) for k, _ in pairs)
    return [f"  {k.ljust(width)}  {'not installed' if v is None else v}" for k, v in pairs]


def _section(title: str, data: object, pairs: Callable[[dict], list[tuple[str, object]]]) -> list[str]:
    if isinstance(data, dict) and "error" in data and len(data) == 1:
        return [title, f"  could not be read: {data['error']}", ""]
    return [title, *_lines(pairs(data)), ""]


def _version_pairs(v: dict) -> list[tuple[str, object]]:
    return [("Python", f"{v['python']} ({v['python_implementation']}, {v['python_executable']})"),
            ("torch", f"{v['torch']} ({v['torch_build']})"), ("triton", v["triton"]),
            ("transformers", v["transformers"]), ("numpy", v["numpy"])]


def _system_pairs(s: dict) -> list[tuple[str, object]]:
    load_1m = "unknown" if s["load_1m"] is None else f"{s['load_1m']:.2f}"
    return [("OS", s["os"]), ("CPU", f"{s['cpu']} ({s['machine']})"),
            ("cores", f"{s['cores']} ({s['usable_cores']} usable by this process), torch uses "
                      f"{s['torch_threads']} threads"),
            ("load", f"{load_1m} (1-minute average)")]


def _status(item: dict) -> str:
    if "error" in item and len(item) == 1:
        return f"could not be checked: {item['error']}"
    return ("yes: " if item["usable"] else "no: ") + item["detail"]


def _compiler_pairs(c: dict) -> list[tuple[str, object]]:
    tiles = c["cpu kernel"].get("tiles", {})
    return [("Triton", _status(c["triton"])), ("NVRTC", _status(c["nvrtc"])), ("C/C++", _status(c["c++"])),
            ("CPU kernel", _status(c["cpu kernel"])),
            *((f"CPU {dtype}", why) for dtype, why in tiles.items())]


def _backend_lines(rows: object) -> list[str]:
    if not isinstance(rows, list):
        return [f"  could not be decided: {rows['error']}"]
    columns = [Col("device", left=True), Col("dtype", left=True), "head dim", Col("backend", left=True),
               Col("why", left=True)]
    cells = [[r["device"], r["dtype"], r["head_dim"], r["backend"] or "(error)", r["reason"]] for r in rows]
    text = table(cells, columns)
    return ["  " + line for line in text.splitlines()]


def _family_lines(rows: object) -> list[str]:
    if not isinstance(rows, list):
        return [f"  could not be read: {rows['error']}"]
    lines = []
    for r in rows:
        head = f"{r['device']}: " if r["device"] else ""
        lines += [f"  {head}{r['family']} ({', '.join(r['architectures'])}): {r['cards']}",
                  f"      {r['shared_kib']} KiB shared memory per block, {r['tensor_cores']}"
                  f"{', TMA' if r['tma'] else ''}; d=128: {r['configs_d128']}",
                  f"      {r['health']}"]
    return lines


def format_text(facts: dict) -> str:
    """The aligned plain-text report of ``collect()``'s data."""
    cuda = facts["cuda"]
    out = [f"flashattn {facts['flashattn']}", ""]
    out += _section("Versions", facts["versions"], _version_pairs)
    out += _section("System", facts["system"], _system_pairs)
    out += ["CUDA devices", f"  {cuda.get('detail') or cuda.get('error')}", ""]
    out += _section("Compilers", facts["compilers"], _compiler_pairs)
    out += ["Backend chosen for typical calls (auto, unless FLASHATTN_BACKEND or use_backend() forces one)",
            *_backend_lines(facts["backends"])]
    if not cuda.get("available"):
        out.append("  (CUDA calls are listed when a GPU is present)")
    out += ["", "Triton kernel configs by GPU family" + ("" if cuda.get("available") else
                                                          " (no GPU here: every family)"),
            *_family_lines(facts["gpu_families"])]
    env = _section("Environment", facts["environment"],
                   lambda e: [(k, "(unset)" if v is None else v) for k, v in e.items()])
    out += ["", *env[:-1]]
    out.append(f"  ({' and '.join(RELATED)} are read by torch, not flashattn: shown because they change what runs)")
    return "\n".join(out).rstrip() + "\n"
