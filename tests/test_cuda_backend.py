"""The CUDA C++ backend (flashattn/csrc/flash_fwd.cu).

Without a GPU: nvcc compiles every variant, with the defines the runtime passes, for sm_80 and sm_90 and the
resource report shows no spills, with the tensor-core (HMMA), cp.async (LDGSTS) and ldmatrix (LDSM) instructions
in the SASS; NVRTC, the runtime's compiler, does the same when it is installed; the source refuses to compile
without the defines; the kernel store keeps one image per variant; the backend refuses what it does not implement
with clear errors. With a GPU: every variant against the float64 reference under the tolerance rule."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from oracle import assert_close, attention_ref

import flashattn
from conftest import nvrtc_available
from flashattn.backends import cuda as cuda_backend
from flashattn.backends.cuda import kernel
from flashattn.backends.spec import AttentionSpec, KeyCache

SOURCE = Path(flashattn.__file__).parent / "csrc" / kernel.SOURCE
HAS_GPU = torch.cuda.is_available()


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return shutil.which("nvcc") or next((p for p in [f"{home}/bin/nvcc"] if os.path.exists(p)), None)


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else None


def resources(cubin: Path) -> dict[str, dict[str, int]]:
    """Kernel name -> {"REG": .., "STACK": .., "LOCAL": .., "SHARED": ..} from cuobjdump's resource report."""
    report = subprocess.run([_cuobjdump(), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                            check=True).stdout
    usage, name = {}, None
    for line in report.splitlines():
        if m := re.search(r"Function (\w+):", line):
            name = m.group(1)
        elif name and "REG:" in line:
            usage[name] = {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", line)}
            name = None
    return usage


def check_cubin(cubin: Path, arch: int, variant: kernel.Variant) -> None:
    usage = resources(cubin)
    assert list(usage) == [kernel.ENTRY]
    res = usage[kernel.ENTRY]
    assert res["STACK"] == 0 and res["LOCAL"] == 0, f"sm_{arch} {variant} spills: {res}"
    assert res["REG"] <= 255, f"sm_{arch} {variant}: {res}"
    sass = subprocess.run([_cuobjdump(), "--dump-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    for instruction in ("HMMA.16816.F32", "LDGSTS", "LDSM.16.M88.4", "LDSM.16.MT88.4"):
        assert instruction in sass, f"sm_{arch} {variant}: no {instruction} in the SASS"


needs_tools = pytest.mark.skipif(_nvcc() is None or _cuobjdump() is None, reason="needs nvcc and cuobjdump")
every_variant = pytest.mark.parametrize("variant", kernel.VARIANTS, ids=str)


@needs_tools
@pytest.mark.parametrize("arch", [80, 90])
@every_variant
def test_nvcc_compiles_without_spills(variant, arch, tmp_path):
    cubin = tmp_path / f"flash_fwd_{variant}_sm{arch}.cubin"
    subprocess.run([_nvcc(), "-cubin", f"-arch=sm_{arch}", "-O3", *kernel.compile_options(variant), "-o",
                    str(cubin), str(SOURCE)], check=True, capture_output=True, text=True)
    check_cubin(cubin, arch, variant)


needs_nvrtc = pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC")


@pytest.mark.skipif(_cuobjdump() is None or not nvrtc_available(), reason="needs NVRTC and cuobjdump")
@pytest.mark.parametrize("arch", [80, 90])
@every_variant
def test_nvrtc_compiles_what_the_runtime_loads(variant, arch, tmp_path):
    """The runtime's own compile path (headerless source, its options and defines), without a GPU."""
    from flashattn.backends.cuda import runtime

    cubin = tmp_path / f"nvrtc_{variant}_sm{arch}.cubin"
    cubin.write_bytes(runtime.compile_variant(f"sm_{arch}", variant))
    check_cubin(cubin, arch, variant)


@needs_nvrtc
def test_source_needs_every_define_from_python():
    """No value Python launches with has a default in the source: leave any define out and it does not compile."""
    from flashattn.backends.cuda import runtime

    options = kernel.compile_options(kernel.Variant("f16", 64, False))
    defines = [o for o in options if o.startswith("-D")]
    assert {d[2:].split("=")[0] for d in defines} >= {"BLOCK_M", "BLOCK_N", "WARPS", "HEAD_DIM", "IS_BF16",
                                                       "IS_CAUSAL", "SHARED_BYTES"}
    for left_out in defines:
        name = left_out[2:].split("=")[0]
        rest = [o for o in options if o != left_out]
        with pytest.raises(runtime.CompileError, match=f"{name} undefined"):
            runtime.compile_source(SOURCE.read_text(), SOURCE.name, "sm_80", rest)
    with pytest.raises(runtime.CompileError, match="kernel.shared_bytes"):  # the launch's shared memory, checked
        runtime.compile_source(SOURCE.read_text(), SOURCE.name, "sm_80",
                               [o for o in options if not o.startswith("-DSHARED_BYTES")] + ["-DSHARED_BYTES=4096"])


@needs_nvrtc
def test_kernel_store_keeps_one_image_per_variant(tmp_path, monkeypatch):
    """FLASHATTN_CACHE places the store; the defines are part of the key; a stored image is not compiled again."""
    from flashattn.backends.cuda import runtime

    monkeypatch.setenv("FLASHATTN_CACHE", str(tmp_path))
    monkeypatch.setattr(runtime, "compile_variant", lambda arch, variant: f"{arch} {variant}".encode())
    images = {v: runtime.compiled("sm_80", v) for v in kernel.VARIANTS}
    assert images == {v: f"sm_80 {v}".encode() for v in kernel.VARIANTS}
    paths = {runtime.store_path("sm_80", v) for v in kernel.VARIANTS}
    assert len(paths) == len(kernel.VARIANTS) and set((tmp_path / "cuda").iterdir()) == paths

    def compile_again(arch, variant):
        raise AssertionError(f"{variant} compiled again")

    monkeypatch.setattr(runtime, "compile_variant", compile_again)
    assert {v: runtime.compiled("sm_80", v) for v in kernel.VARIANTS} == images
    monkeypatch.setattr(kernel, "BLOCK_N", 32)  # another define, another image
    assert runtime.store_path("sm_80", kernel.VARIANTS[0]) not in paths


def test_launch_arguments_match_the_kernel_signature():
    """A mismatch would only show on a GPU, as garbage or a crash: compare with the C parameter list."""
    import ctypes

    text = SOURCE.read_text()
    params = re.search(rf"{kernel.ENTRY}\((.*?)\)\s*\{{", text, re.S).group(1)
    c_types = [" ".join(p.split()[:-1]) for p in params.split(",")]
    expected = {"const u16*": ctypes.c_void_p, "u16*": ctypes.c_void_p, "float*": ctypes.c_void_p,
                "int": ctypes.c_int, "i64": ctypes.c_longlong, "float": ctypes.c_float}
    q = torch.zeros(2, 5, 4, 64, dtype=torch.float16)
    k = torch.zeros(2, 7, 2, 64, dtype=torch.float16)
    out, lse = torch.zeros_like(q), torch.zeros(2, 4, 5)
    args = cuda_backend.launch_args(q, k, k, out, lse, diagonal=2, scale=0.125)
    assert [type(a) for a in args] == [expected[t] for t in c_types], c_types
    assert [a.value for a in args[5:10]] == [4, 2, 5, 7, 2]


def _spec(**kwargs):
    return AttentionSpec(scale=0.125, **kwargs)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"dtype": torch.float32}, "float16 or bfloat16"),
        ({"d": 96}, "head dim 64 or 128"),
        ({"spec": _spec(softcap=5.0)}, "softcap"),
        ({"spec": _spec(dropout_p=0.1)}, "dropout"),
        ({"spec": _spec(window_left=8, window_right=0)}, "window"),
        ({"spec": _spec(alibi_slopes=torch.ones(1, 2))}, "alibi"),
        ({"return_probs": True}, "return_attn_probs"),
        ({}, "CUDA tensors"),  # everything supported but the device
    ],
)
def test_declined_calls_are_named(change, message):
    from flashattn.backends import Request

    dtype, d = change.get("dtype", torch.float16), change.get("d", 64)
    q = torch.zeros(1, 4, 2, d, dtype=dtype)
    request = Request.of(q, q, q, change.get("spec", _spec()), return_probs=change.get("return_probs", False))
    if message != "CUDA tensors":
        request = request._replace(device="cuda")
    reason = cuda_backend.serves(request)
    assert reason is not None and message in reason


def test_the_path_is_opt_in_and_refusals_are_clear():
    from flashattn.backends import Request, explain

    q = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    on_gpu = Request("cuda", torch.float16, 64, 64)
    assert explain(on_gpu)[0] != "cuda"  # auto never picks it
    with flashattn.use_backend("cuda"):
        assert explain(on_gpu) == ("cuda", "forced by use_backend()")
        with pytest.raises(ValueError, match="the cuda path cannot run this call on cpu .*CUDA tensors"):
            flashattn.flash_attn_func(q, q, q)
        with pytest.raises(ValueError, match="forward-only"):  # refused before the forward, not in the backward
            explain(on_gpu._replace(grad=True))
    with pytest.raises(NotImplementedError, match="forward-only"):
        cuda_backend.backward(q, None, None, _spec())
    cache = KeyCache(torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1)
    assert "kv cache" in cuda_backend.serves(Request.of(q, q, q, _spec(cache=cache))._replace(device="cuda"))


# --------------------------------------------------------------------------------------------------------------
# On a GPU: the kernels against the float64 reference.

gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")

SHAPES = [  # (batch, seqlen_q, seqlen_k, heads, kv_heads)
    (1, 1, 1, 1, 1),
    (2, 113, 113, 4, 2),
    (1, 1025, 1025, 2, 1),
    (2, 64, 200, 4, 4),
    (2, 300, 70, 6, 2),  # causal: the first 230 queries see no key
    (3, 17, 1, 2, 2),
]


def _poison_allocator(device) -> None:
    """Fill the memory torch's caching allocator will hand out next with NaN, so unwritten outputs show."""
    torch.full((64 << 20,), float("nan"), dtype=torch.float32, device=device)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_float64(shape, causal, d, dtype):
    b, nq, nk, h, hk = shape
    q = torch.randn(b, nq, h, d, dtype=dtype, device="cuda")
    k = torch.randn(b, nk, hk, d, dtype=dtype, device="cuda")
    v = torch.randn(b, nk, hk, d, dtype=dtype, device="cuda")
    _poison_allocator("cuda")
    with flashattn.use_backend("cuda"):
        out = flashattn.flash_attn_func(q, k, v, causal=causal)
    ref, ref_lse = attention_ref(q, k, v, causal=causal)
    base, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close("out", out, ref, base)
    _, lse, _ = cuda_backend.forward(q, k, v, AttentionSpec(scale=d**-0.5, window_right=0 if causal else -1))
    finite = torch.isfinite(ref_lse)
    assert torch.isneginf(lse[~finite]).all() and not torch.isnan(lse).any()
    torch.testing.assert_close(lse[finite], ref_lse[finite].float(), rtol=0, atol=1e-2)


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_lse_and_rows_without_keys(causal):
    q = torch.randn(2, 300, 4, 128, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(2, 70, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    _poison_allocator("cuda")
    spec = AttentionSpec(scale=128**-0.5, window_right=0 if causal else -1)
    out, lse, _ = cuda_backend.forward(q, k, v, spec)
    ref, ref_lse = attention_ref(q, k, v, causal=causal)
    finite = torch.isfinite(ref_lse)
    assert torch.isneginf(lse[~finite]).all() and not torch.isnan(lse).any()
    torch.testing.assert_close(lse[finite], ref_lse[finite].float(), rtol=0, atol=2e-2)
    if causal:
        assert torch.equal(out[:, :230], torch.zeros_like(out[:, :230]))


@gpu
def test_strided_inputs_and_sdpa_top_left_causal():
    qkv = torch.randn(2, 150, 3, 8, 64, dtype=torch.float16, device="cuda")
    q, k, v = qkv.unbind(2)  # strided views into one packed tensor
    with flashattn.use_backend("cuda"):
        out = flashattn.flash_attn_func(q, k, v, causal=True)
        top_left = flashattn.scaled_dot_product_attention(q[:, :40].transpose(1, 2), k.transpose(1, 2),
                                                          v.transpose(1, 2), is_causal=True).transpose(1, 2)
    assert_close("out", out, attention_ref(q, k, v, causal=True)[0],
                 attention_ref(q, k, v, causal=True, upcast=False)[0])
    ref = attention_ref(q[:, :40], k, v, causal=True, bottom_right=False)[0]
    base = attention_ref(q[:, :40], k, v, causal=True, bottom_right=False, upcast=False)[0]
    assert_close("top-left", top_left, ref, base)


@needs_nvrtc
def test_gpu_script_smoke(tmp_path):
    """``flashattn bench cuda-kernel``, the one command a GPU session runs for this kernel, at least starts and
    compiles."""
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, "-m", "flashattn", "bench", "cuda-kernel", "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.glob("cuda-kernel-smoke-*.json"))
