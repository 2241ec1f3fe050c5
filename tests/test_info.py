"""`flashattn info`: runs here, its JSON has every section, the automatic choice for CPU tensors comes with its
reason, and a missing compiler, triton or NVRTC, or a bad FLASHATTN_BACKEND, is reported, not raised. Also the
packaging facts it relies on: one version, declared once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from triton_versions import needs_triton

import flashattn
from flashattn import info
from flashattn.cli import main

ROOT = Path(__file__).parents[1]
SECTIONS = {"flashattn", "versions", "system", "cuda", "compilers", "backends", "gpu_families", "environment"}


def test_json_has_every_section_and_the_cpu_choice_with_its_reason(capsys, monkeypatch):
    monkeypatch.delenv("FLASHATTN_BACKEND", raising=False)
    assert main(["info", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert set(facts) == SECTIONS and facts["flashattn"] == flashattn.__version__
    assert {"python", "torch", "torch_build", "triton", "transformers"} <= set(facts["versions"])
    assert {"os", "cpu", "cores", "usable_cores", "torch_threads", "load_1m"} <= set(facts["system"])
    assert set(facts["compilers"]) == {"triton", "nvrtc", "c++", "cpu kernel"}
    for item in facts["compilers"].values():
        assert isinstance(item["usable"], bool) and item["detail"]
    cpu = [r for r in facts["backends"] if r["device"] == "cpu"]
    assert [(r["dtype"], r["head_dim"]) for r in cpu] == [("float32", 64), ("bfloat16", 128), ("float16", 128)]
    assert all(r["backend"] in ("cpu", "torch") and r["reason"].startswith("auto: ") for r in cpu)
    assert set(facts["environment"]) >= {"FLASHATTN_BACKEND", "FLASHATTN_NVRTC", "FLASHATTN_CACHE",
                                         "TRITON_INTERPRET", "CUDA_HOME", "CUDA_PATH"}
    assert facts["cuda"]["available"] == bool(facts["cuda"]["devices"])
    families = facts["gpu_families"]
    if not facts["cuda"]["available"]:  # every family, each with the architectures it serves and its health
        assert [f["family"] for f in families] == ["sm75", "sm80", "sm86", "sm90", "sm100", "sm120",
                                                   "cdna2", "cdna3", "rdna3"]
        assert {a for f in families for a in f["architectures"]} >= {"sm_75", "sm_86", "sm_89", "sm_100", "sm_120",
                                                                     "gfx90a", "gfx942", "gfx1100"}
        assert all("checked offline for" in f["health"] for f in families)
    text = info.format_text(facts)
    assert "Triton kernel configs by GPU family" in text and "99 KiB shared memory per block" in text


def test_text_report_is_aligned_sections(capsys):
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"flashattn {flashattn.__version__}\n")
    for heading in ("Versions", "System", "CUDA devices", "Compilers", "Backend chosen", "Environment"):
        assert f"\n{heading}" in text
    assert re.search(r"\n  cpu +float32 +64 +cpu +auto: ", text)


def test_cuda_calls_are_explained_with_a_reason_for_each_rule(monkeypatch):
    monkeypatch.delenv("FLASHATTN_BACKEND", raising=False)
    rows = info.backend_choices(cuda=True)
    cuda = {(r["dtype"], r["head_dim"]): r for r in rows if r["device"] == "cuda"}
    # The first rule that declines names itself (a Triton outside the kernels' range comes before the dtype's).
    assert cuda[("float64", 64)]["backend"] == "torch"
    assert any(why in cuda[("float64", 64)]["reason"] for why in ("float64", "is installed"))
    assert cuda[("bfloat16", 320)]["backend"] == "torch"
    assert any(why in cuda[("bfloat16", 320)]["reason"] for why in ("320", "is installed"))
    # torch where triton is not installed, and the reason says so
    assert {r["backend"] for k, r in cuda.items() if k[1] <= 128 and k[0] != "float64"} <= {"triton", "torch"}


def test_cpu_calls_name_the_path_that_serves_them(monkeypatch):
    """The C++ kernel serves CPU calls where it builds (CI's machine has gcc); the report says so, not "tiled"."""
    monkeypatch.delenv("FLASHATTN_BACKEND", raising=False)
    rows = [r for r in info.backend_choices(cuda=False) if r["device"] == "cpu"]
    built = info.cpu_kernel()["usable"]
    assert {r["backend"] for r in rows} == ({"cpu"} if built else {"torch"})
    assert all(("C++ kernel" in r["reason"]) for r in rows)


def test_forced_and_invalid_backends_are_reported(monkeypatch):
    monkeypatch.setenv("FLASHATTN_BACKEND", "torch")
    assert info.backend_choices(cuda=False)[0]["reason"] == "forced by FLASHATTN_BACKEND"
    monkeypatch.setenv("FLASHATTN_BACKEND", "cuda")  # a forced path that declines CPU calls: reported, not raised
    row = info.backend_choices(cuda=False)[0]
    assert row["backend"] is None and "the cuda path cannot run this call" in row["reason"]
    monkeypatch.setenv("FLASHATTN_BACKEND", "gpu")
    row = info.backend_choices(cuda=False)[0]
    assert row["backend"] is None and "FLASHATTN_BACKEND must be one of" in row["reason"]
    assert "(error)" in info.format_text(info.collect())


def test_missing_compiler_is_reported_not_raised(monkeypatch, tmp_path):
    from flashattn.backends import cpu_build

    cpu_build._load.cache_clear()  # built or not, the report must not raise; no result outlives the test
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no c++, g++, clang++ or cc
    monkeypatch.delenv("CXX", raising=False)
    found = info.compiler()
    assert found["usable"] is False and "none found" in found["detail"] and "c++" in found["detail"]
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert "CXX='no-such-compiler'" in info.compiler()["detail"]
    text = info.format_text(info.collect())
    assert "C/C++       no: CXX='no-such-compiler' is not an executable on PATH" in text
    cpu_build._load.cache_clear()


def test_a_compiler_that_fails_is_reported_with_its_message(monkeypatch, tmp_path):
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\necho 'fake c++ 1.0'\n[ \"$1\" = --version ] || { echo 'error: broken' >&2; exit 1; }\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    found = info.compiler()
    assert found["usable"] is False and found["version"] == "fake c++ 1.0" and "error: broken" in found["detail"]


def test_a_working_compiler_compiles_here():
    found = info.compiler()
    if found["path"] is None:
        pytest.skip("no C/C++ compiler on this machine")
    assert found["usable"] and found["version"], found["detail"]


def test_missing_triton_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail as if it were not installed
    assert info.triton() == {"usable": False, "version": None,
                             "detail": "not installed (pip install 'flashattn[triton]')"}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs Triton's interpreter (conftest.py switches it on where there is no GPU)")
@needs_triton
def test_triton_runs_its_probe_kernel_in_the_interpreter(monkeypatch):
    monkeypatch.setattr(info.torch.cuda, "is_available", lambda: False)
    found = info.triton()
    assert found["usable"] and "ran a test kernel in the interpreter" in found["detail"], found["detail"]


def test_a_triton_outside_the_kernels_range_is_reported_unusable(monkeypatch):
    """torch before 2.11 pins an older Triton (2.7: 3.3): info says so instead of running a probe that fails."""
    pytest.importorskip("triton")
    from flashattn.backends import triton as triton_path

    monkeypatch.setattr(triton_path, "installed_release", lambda: (3, 3))
    found = info.triton()
    assert found["usable"] is False and "triton 3.3 is installed and its kernels need 3.6 to 3.9" in found["detail"]


@needs_triton
def test_triton_without_a_gpu_or_the_interpreter_says_what_it_would_need(monkeypatch):
    monkeypatch.setattr(info.torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    found = info.triton()
    assert found["usable"] is False and "would need the interpreter (TRITON_INTERPRET=1" in found["detail"]


def test_missing_nvrtc_is_reported_not_raised(monkeypatch):
    from flashattn.backends.cuda import runtime

    def missing():
        raise runtime.CompileError("no libnvrtc.so here")

    monkeypatch.setattr(runtime, "nvrtc", missing)
    assert info.nvrtc() == {"usable": False, "version": None, "detail": "no libnvrtc.so here"}


def test_a_section_that_raises_does_not_hide_the_others(monkeypatch):
    def broken():
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(info, "cuda_devices", broken)
    monkeypatch.setattr(info, "system", broken)
    facts = info.collect()
    assert facts["cuda"] == {"error": "RuntimeError: driver exploded"} and facts["versions"]["torch"]
    text = info.format_text(facts)
    assert "could not be read: RuntimeError: driver exploded" in text and "Compilers" in text


def test_every_environment_variable_the_package_reads_is_listed():
    read = set()
    for path in (ROOT / "flashattn").rglob("*.py"):
        read |= set(re.findall(r"""(?:environ(?:\.get)?\(|environ\[|getenv\(|Variable\()\s*["']([A-Z_]+)["']""",
                               path.read_text()))
    listed = {name for name, _, _ in info.ENVIRONMENT}
    assert read and read <= listed, read - listed
    readme = (ROOT / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in listed), [n for n in listed if f"`{n}`" not in readme]


def test_python_m_flashattn_info_runs_as_a_subprocess():
    done = subprocess.run([sys.executable, "-m", "flashattn", "info"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("flashattn ") and "Backend chosen" in done.stdout


def test_version_is_declared_once_in_pyproject():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "flashattn.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", flashattn.__version__)


def test_package_ships_its_type_marker_and_license():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert (ROOT / "flashattn" / "py.typed").exists() and "py.typed" in project["tool"]["setuptools"][
        "package-data"]["flashattn"]
    assert project["project"]["license"] == "BSD-3-Clause" and "BSD 3-Clause" in (ROOT / "LICENSE").read_text()


def test_package_ships_the_kernel_sources_it_compiles_at_first_use():
    tomllib = pytest.importorskip("tomllib")
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["flashattn"]
    sources = sorted((ROOT / "flashattn" / "csrc").iterdir())
    assert sources and all(any(p.relative_to(ROOT / "flashattn").match(g) for g in globs) for p in sources)


def test_runtime_dependencies_leave_numpy_open():
    """numpy < 2.4 is the Triton interpreter's need (the test extra), never a runtime pin: installing flashattn must
    not downgrade anyone's numpy."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    numpy = [d for d in project["dependencies"] if d.startswith("numpy")]
    assert numpy == ["numpy>=1.24"]
    assert "numpy<2.4" in project["optional-dependencies"]["test"]


NEWEST_NUMPY = Path(sys.prefix) / "newest-numpy"  # make test installs the newest numpy there, apart from the venv's
_WITH_NEWEST_NUMPY = """
import json, numpy, torch, flashattn
from flashattn import reference
q = torch.randn(1, 70, 2, 16, requires_grad=True)
out = flashattn.flash_attn_func(q, q, q, causal=True)
out.sum().backward()
x = numpy.random.default_rng(0).standard_normal((37, 16))
o, lse = reference.flash_attention_v2_forward(x, x, x, M=1024, causal=True)
assert numpy.abs(o - reference.standard_attention(x, x, x, causal=True)).max() < 1e-12
print(json.dumps({"numpy": numpy.__version__, "shape": list(out.shape), "finite": bool(q.grad.isfinite().all())}))
"""


def test_the_library_runs_with_the_newest_numpy():
    if not (NEWEST_NUMPY / "numpy").exists():
        pytest.skip(f"no numpy in {NEWEST_NUMPY}: make test installs the newest there")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(NEWEST_NUMPY), str(ROOT)])}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", _WITH_NEWEST_NUMPY], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ran = json.loads(done.stdout)
    assert tuple(int(p) for p in ran["numpy"].split(".")[:2]) >= (2, 4), ran  # past the interpreter's pin
    assert ran["shape"] == [1, 70, 2, 16] and ran["finite"]
