"""The shape of the house, held by tests: data flows one way (API -> checks -> op -> paths -> kernels) with no import
circle, the paths import each other only through shared helpers, and ``import flashattn`` loads neither developer
tooling nor triton. Read from the sources' module-level imports (function-level imports are deliberate and lazy)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flashattn"
# Each path's modules; a path may import shared helpers (backends/spec.py, request.py, masking.py, ...), never
# another path.
PATHS = {"triton": "flashattn.backends.triton", "cpu": "flashattn.backends.cpu", "torch": "flashattn.backends.tiled",
         "cuda": "flashattn.backends.cuda"}
# The C++ kernel's build belongs to the cpu path.
OWNED = {"flashattn.backends.cpu_build": "cpu"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The flashattn modules ``name`` imports at module level (a package's __init__ counts as the package)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = name.split(".") if is_package else name.split(".")[:-1]
            if node.level:
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _path_of(module: str) -> str | None:
    if module in OWNED:
        return OWNED[module]
    return next((p for p, prefix in PATHS.items() if module == prefix or module.startswith(prefix + ".")), None)


def test_no_import_circle():
    """No module reaches itself again through module-level imports (a submodule importing from its own package's
    __init__ is how a package shares its names, not a circle, as long as the __init__ does not import it back)."""
    graph = _graph()
    edges = {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            assert state.get(target) != 1, "import circle: " + " -> ".join([*trail, module, target])
            if target not in state:
                visit(target, [*trail, module])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [])


def test_paths_import_each_other_only_through_shared_helpers():
    for module, targets in _graph().items():
        mine = _path_of(module)
        if mine is None:
            continue
        others = {t for t in targets if _path_of(t) not in (None, mine)}
        assert not others, f"{module} ({mine} path) imports {sorted(others)}"


def test_kernels_and_paths_never_import_the_api():
    api = {"flashattn", "flashattn.interface", "flashattn.ops", "flashattn.nn", "flashattn.checks", "flashattn.cli"}
    for module, targets in _graph().items():
        if module.startswith("flashattn.backends"):
            assert not targets & api, f"{module} imports {sorted(targets & api)}"


def test_import_flashattn_loads_no_tooling_and_no_triton():
    """A user's ``import flashattn`` (and a first call, and a choice for CUDA tensors) loads neither the benchmarks,
    the CLI, the info report nor any developer tooling, and no triton module of ours beyond the triton path's
    declaration (the choice of a path costs nothing where triton is absent), nor ``torch._dynamo`` (which doubled the
    import's time)."""
    code = ("import sys, torch, flashattn; from flashattn.backends import Request, explain;"
            "flashattn.flash_attn_func(*(torch.randn(1, 4, 2, 8) for _ in range(3)));"
            "explain(Request('cuda', torch.float16, 64, 64));"  # the triton path's declaration, consulted
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith(('flashattn', 'tools', 'torch._dy')))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True,
                            cwd=ROOT).stdout.split()
    assert "flashattn.backends.cpu" in loaded
    unwanted = [m for m in loaded if m.startswith(("flashattn.bench", "flashattn.cli", "flashattn.info", "tools",
                                                   "flashattn.backends.triton.", "torch._dynamo"))]
    assert not unwanted, unwanted


def test_tooling_is_not_shipped():
    tomllib = __import__("tomllib")
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["flashattn*"]
    assert not (PACKAGE / "backends" / "triton" / "experimental").exists()


def test_no_module_of_the_package_is_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


def test_the_cpu_build_hashes_every_source_of_the_cpu_kernel():
    # A header left out of SOURCES would let an edit to it reuse a stale cached build.
    from flashattn.backends import cpu_build

    csrc = PACKAGE / "csrc"
    kernel = {p.name for p in [*csrc.glob("cpu_*.h"), *csrc.glob("cpu_*.cpp")]}
    assert {p.name for p in cpu_build.SOURCES} == kernel
