"""What gpu-check runs, in order of value: each ``Step`` is one subprocess with its share of the budget.

1. ``info``: versions, the device, which path a call gets, and the facts that decide whether Triton's cache from
   another machine would be reused (``tools.gpu_check.cache``).
2. ``smoke``: every kernel launched once per dtype, head dim and causal, checked against float64
   (``tools.gpu_check.smoke``).
3. ``tests``: the GPU test files on the Triton path (``FLASHATTN_TEST_PATHS=triton``).
4. ``headline``: bf16 forward and forward + backward at 8k tokens per sequence, 16k per batch, head dims 64 and 128,
   causal or not, against SDPA's flash, cuDNN and efficient backends and compiled FlexAttention (compiled last,
   so a cut-off run keeps the rest), and our forward on FP8 inputs beside it; the device's matmul rate and copy
   bandwidth measured in the same run.
5. ``decode`` (against copy bandwidth), ``block-mask`` (against varlen and a dense mask) and ``host`` (the host's
   microseconds per call, queued, beside SDPA's).
6. Whatever time remains: the CUDA C++ kernel, its tests, and the wide sweeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tools/ and tests/ live here
TESTS = ROOT / "tests"
# The suites that run kernels on the GPU (the rest need none), most telling first: xdist hands out tests in order.
GPU_TESTS = ("test_triton.py", "test_flash_api.py", "test_kvcache.py", "test_varlen.py", "test_block_mask.py",
             "test_autograd.py", "test_sdpa.py", "test_sinks.py", "test_value_head_dim.py", "test_dropin.py",
             "test_backends.py", "test_merge.py", "test_nn.py", "test_cuda_graphs.py", "test_vmap.py",
             "test_sdpa_masks.py")
SDPA_BASELINES = "sdpa-flash,sdpa-cudnn,sdpa-efficient,flex"


@dataclass
class Step:
    """One subprocess: ``python -m tools.gpu_check.step <args>`` (the compile clock started first).

    ``share``: the most of the whole budget it may take; it gets ``min(share * budget, what remains)``.
    ``least``: the seconds below which it is not started (``skipped (budget)``). ``files``: what it writes in
    the work folder (``{out}`` in ``args`` is that folder), for the archive and the summary.
    """

    name: str
    args: list[str]
    share: float
    least: float
    env: dict[str, str] = field(default_factory=dict)
    stdout_to: str | None = None  # a file in the work folder that receives stdout (when the step is ok)
    reader: str | None = None  # the ``headlines.HEADLINES`` entry that summarizes it, when not its name
    status: str = "pending"
    seconds: float = 0.0
    allowed: float = 0.0
    compile: dict = field(default_factory=dict)
    headline: str = ""
    extra: dict = field(default_factory=dict)


def _pytest(out: str, files: tuple[str, ...], jobs: int, junit: str) -> list[str]:
    workers = ["-n", str(jobs)] if jobs > 1 else []
    return ["pytest", "-q", *workers, "-p", "no:cacheprovider", "-p", "tools.gpu_check.pytest_plugin",
            f"--junitxml={out}/{junit}", *(str(TESTS / f) for f in files)]


def full(jobs: int) -> list[Step]:
    """The steps on a GPU."""
    bench = ["flashattn", "bench"]
    sweep = [*bench, "sweep", "--modes", "fwd,bwd", "--baselines", SDPA_BASELINES, "--quiet", "--out", "{out}"]
    no_cpu_kernel = {"FLASHATTN_CPU_KERNEL": "0"}  # its first build costs ~30 s of the budget and no GPU answer
    tests_env = {"FLASHATTN_TEST_PATHS": "triton", "GPU_CHECK_TEST_LOG": "{out}/tests.jsonl", **no_cpu_kernel}
    return [
        Step("info", ["tools.gpu_check.info"], 0.08, 5, stdout_to="info.json", env=no_cpu_kernel),
        Step("smoke", ["tools.gpu_check.smoke", "--out", "{out}", "--jobs", str(jobs)], 0.25, 30),
        Step("tests", _pytest("{out}", GPU_TESTS, min(jobs, 12), "tests.xml"), 0.35, 45, env=tests_env),
        Step("headline", [*bench, "sweep", "--seqlens", "8192", "--headdims", "64,128", "--modes", "fwd,fwd+bwd",
                          "--baselines", f"{SDPA_BASELINES},flashattn-fp8,flashattn-fp8-train", "--tokens", "16384",
                          "--repeats", "20", "--ceilings", "--quiet", "--out", "{out}", "--name", "headline"], 0.3, 30),
        # The Gluon (Hopper) forward: every schedule against float64 in its own subprocess, then beside cuDNN.
        Step("gluon", ["tools.gluon.gpu_run", "--out", "{out}", "--budget", "{allowed}", "--jobs", str(jobs)], 0.25,
             60, env=no_cpu_kernel),
        # The training mode with FP8 matmuls in the backward too (opt-in until this step has timed it), beside
        # ours in bf16 in the same run: headline's flashattn-fp8-train has the 16-bit backward.
        Step("fp8-backward", [*bench, "sweep", "--seqlens", "8192", "--headdims", "128", "--modes", "fwd+bwd",
                              "--baselines", "flashattn-fp8-train", "--tokens", "16384", "--repeats", "20", "--quiet",
                              "--out", "{out}", "--name", "fp8-backward"], 0.1, 15,
             env={"FLASHATTN_FP8_BACKWARD": "1"}),
        # The one-pass backwards (dQ by atomics: 5 matmuls a tile, not 7), the portable kernel's and the Hopper
        # tier's (flashattn-hopper), beside the two-pass default and cuDNN, to decide where each is taken by
        # default; the smoke's one-pass and tier cases checked them first. Head dims 64, 128 and 256, the tier's
        # backward's (on sm_90 the portable 16-bit one-pass tiles stop at 64: tables.ONE_PASS; above, its row is
        # the two-pass kernels again).
        Step("one-pass", [*bench, "sweep", "--seqlens", "1024,8192", "--headdims", "64,128,256", "--modes", "bwd",
                          "--baselines", "flashattn-one-pass,flashattn-hopper,sdpa-cudnn", "--tokens", "16384",
                          "--repeats", "20",
                          "--quiet", "--out", "{out}", "--name", "one-pass"], 0.1, 15),
        # The tier's FP8 forward (forced) beside the portable FP8 forward, the tier's bf16 one and cuDNN: issue 45
        # asks 1.5x the bf16 forward; the smoke's tier case checked it against float64 first.
        Step("tier-fp8", [*bench, "sweep", "--seqlens", "1024,8192", "--headdims", "64,128,256", "--modes", "fwd",
                          "--baselines", "flashattn-fp8,flashattn-hopper-fp8,flashattn-hopper,sdpa-cudnn",
                          "--tokens", "16384", "--repeats", "20", "--quiet", "--out", "{out}", "--name", "tier-fp8"],
             0.08, 15),
        Step("decode", [*bench, "decode", "--batches", "1,16", "--cache-lens", "4096,65536", "--repeats", "20",
                        "--profile", "--quiet", "--out", "{out}", "--name", "decode"], 0.1, 15),
        Step("block-mask", [*bench, "block-mask", "--seqlens", "16384", "--dtype", "bfloat16", "--repeats", "10",
                            "--quiet", "--out", "{out}", "--name", "block-mask"], 0.1, 15),
        # Host cost per call, queued calls at tiny shapes beside SDPA (issue 44's budgets on a GPU).
        Step("host", [*bench, "host", "--mode", "gpu", "--calls", "200", "--entries",
                      "fwd,train,decode,decode_tensor_seqlens,sdpa,decode_append,varlen,varlen_train", "--out",
                      "{out}", "--name",
                      "host"], 0.08, 20, env=no_cpu_kernel),
        Step("cuda-kernel", [*bench, "cuda-kernel", "--out", "{out}", "--name", "cuda-kernel"], 0.2, 30),
        Step("tests-cuda", _pytest("{out}", ("test_cuda_backend.py",), min(jobs, 12), "tests-cuda.xml"), 0.3, 30,
             env={"GPU_CHECK_TEST_LOG": "{out}/tests-cuda.jsonl"}),
        Step("sweep-d128", [*sweep, "--headdims", "128", "--name", "sweep-d128"], 1.0, 60),
        Step("sweep-d64", [*sweep, "--headdims", "64", "--name", "sweep-d64"], 1.0, 60),
    ]


def smoke(jobs: int) -> list[Step]:
    """The same steps at toy sizes on the CPU (Triton's interpreter): what the tests run."""
    bench = ["flashattn", "bench"]
    cpu = ["--device", "cpu", "--quiet", "--out", "{out}"]
    # The interpreter runs the Triton kernels; the C++ CPU kernel stays unbuilt (a first build takes ~30 s).
    interpret = {"TRITON_INTERPRET": "1", "FLASHATTN_CPU_KERNEL": "0"}
    steps = [
        Step("info", ["tools.gpu_check.info"], 0.2, 1, stdout_to="info.json"),
        Step("smoke", ["tools.gpu_check.smoke", "--tiny", "--out", "{out}", "--jobs", str(min(jobs, 2))], 0.4, 5),
        Step("tests", _pytest("{out}", ("test_merge.py",), 1, "tests.xml"), 0.3, 5,
             env={"GPU_CHECK_TEST_LOG": "{out}/tests.jsonl"}),
        Step("headline", [*bench, "sweep", "--seqlens", "64", "--headdims", "16", "--causal", "false", "--modes",
                          "fwd", "--baselines", "sdpa", "--repeats", "1", "--tokens", "64", "--hidden", "32",
                          "--in-process", "--ceilings", *cpu, "--name", "headline"], 0.3, 3),
        Step("decode", [*bench, "decode", "--batches", "1", "--cache-lens", "64", "--heads-q", "2", "--heads-kv",
                        "1", "--headdim", "16", "--repeats", "1", *cpu, "--name", "decode"], 0.2, 3),
        Step("block-mask", [*bench, "block-mask", "--seqlens", "512", "--docs", "4", "--heads", "2", "--headdim",
                            "16", "--repeats", "1", *cpu, "--name", "block-mask"], 0.2, 3),
        Step("cuda-kernel", [*bench, "cuda-kernel", "--smoke", "--out", "{out}", "--name", "cuda-kernel"], 0.3, 3),
    ]
    for step in steps:
        step.env = {**interpret, **step.env}
    return steps
