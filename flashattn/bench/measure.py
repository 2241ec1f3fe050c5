"""Time, throughput and peak memory of one attention implementation on one problem.

Implementations take q, k, v in the flash layout (batch, seqlen, heads, headdim) and ``causal``. Modes: ``fwd``
(inference), ``bwd`` (the backward alone, from a saved forward), ``fwd+bwd`` (a training step of attention).

CPU: torch has no peak-memory counter for CPU tensors, so ``measure`` runs each case in a fresh subprocess that
warms up on a tiny problem (loading code, starting threads), resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``), and reports how far the peak rose over what it held just before the call; then calls
it for up to 0.3 s more (``warm_up``: the steady state a loop sees) before the timed calls.
CUDA: CUDA events around each call, L2 flushed before each, and ``torch.cuda.max_memory_allocated``; the first
full-size call, which compiles what the implementation needs (Triton kernels, FlexAttention's graph), runs before
any of them and is reported apart as ``first_call_seconds``.

Run one case by hand::

    python -m flashattn.bench.measure flashattn 4096 --heads 4 --headdim 64 --mode fwd+bwd
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..backends import use_backend
from ..backends.environ import setting
from ..interface import flash_attn_func
from ..quantize import amax_scales, to_fp8

L2_FLUSH_BYTES = 256 * 2**20  # larger than any current GPU's L2 (H100: 50 MB)


def plain_attention(q, k, v, causal):
    """Algorithm 0 in PyTorch: S and P are full (B, H, N, N) tensors."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).transpose(1, 2)


def _sdpa(backend: str | None):
    def run(q, k, v, causal):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        ctx = contextlib.nullcontext()
        if backend is not None:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            ctx = sdpa_kernel(getattr(SDPBackend, backend))
        with ctx:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)

    run.__doc__ = f"torch SDPA restricted to its {backend or 'default'} backend"
    return run


_FLEX: dict[object, object] = {}


def flex_attention(q, k, v, causal):
    """torch.nn.attention.flex_attention, compiled for static shapes (the way it is meant to run), with its
    causal block mask built once per shape, outside the timed calls, as a model would reuse it across layers."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        # One compilation per shape: past dynamo's recompile limit (8) it would fall back to eager flex, several
        # times slower, and the sweep would report that as FlexAttention.
        config = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(config, name):
                setattr(config, name, max(getattr(config, name), 256))
        # The "bwd" mode differentiates one saved forward many times (retain_graph=True), which a compiled
        # backward that donates its saved buffers refuses.
        if hasattr(torch._functorch.config, "donated_buffer"):
            torch._functorch.config.donated_buffer = False
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    block_mask = None
    if causal:
        n = q.shape[-2]
        key = ("causal", n, str(q.device))
        if key not in _FLEX:  # made outside inference mode: a later backward through it saves its tensors
            with torch.inference_mode(False):
                _FLEX[key] = create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n, device=q.device)
        block_mask = _FLEX[key]
    return _FLEX["fn"](q, k, v, block_mask=block_mask).transpose(1, 2)


def ours(q, k, v, causal):
    return flash_attn_func(q, k, v, causal=causal)


def ours_cuda(q, k, v, causal):
    """The CUDA C++ kernel (flashattn/csrc), forward only: chosen explicitly, as it never is automatically."""
    with use_backend("cuda"):
        return flash_attn_func(q, k, v, causal=causal)


# The FP8 copies of the last inputs ours-fp8 saw: quantized once, outside the timed calls.
_FP8: dict[tuple, list] = {}


def ours_fp8(q, k, v, causal):
    """FlashAttention-3's FP8 forward on our kernels: q, k, v quantized to float8_e4m3fn with a scale per (batch,
    kv head) once, outside the timed calls (as a model's projections would hand them over), then attended with
    their descales; bf16 out. Forward only."""
    key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), tuple(q.shape), tuple(k.shape))
    if key not in _FP8:
        _FP8.clear()

        def quantized(x):
            scale = amax_scales(x, heads_k=k.shape[2])
            return to_fp8(x.detach(), scale), scale

        _FP8[key] = [quantized(t) for t in (q, k, v)]
    (qf, qs), (kf, ks), (vf, vs) = _FP8[key]
    return flash_attn_func(qf, kf, vf, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs)


def ours_fp8_train(q, k, v, causal):
    """The FP8 training mode (``fp8=True``): 16-bit q, k, v quantized by the call (inside the timed call: it is
    part of the mode's cost), the FP8 forward, and the backward at the quantized values."""
    return flash_attn_func(q, k, v, causal=causal, fp8=True)


# ALiBi slopes per (heads, device), made once, not inside the timed call.
_ALIBI: dict[tuple[int, torch.device], torch.Tensor] = {}


def _ours_with(feature: str):
    """Ours with one feature on, measured against ours plain (the per-feature cost)."""

    kwargs = {"dropout": {"dropout_p": 0.1}, "softcap": {"softcap": 30.0}, "alibi": {}, "window":
              {"window_size": (256, 256)}, "gqa8": {}}[feature]

    def run(q, k, v, causal):
        h = q.shape[2]
        if feature == "alibi":
            if (h, q.device) not in _ALIBI:
                _ALIBI[h, q.device] = torch.linspace(0.01, 0.3, h, device=q.device)
            kwargs["alibi_slopes"] = _ALIBI[h, q.device]
        if feature == "gqa8":  # 8 query heads per key/value head: views of the first heads, no copies
            k, v = k[:, :, : max(1, h // 8)], v[:, :, : max(1, h // 8)]
        return flash_attn_func(q, k, v, causal=causal, **kwargs)

    run.__doc__ = f"flashattn with {feature}"
    return run


OURS = "flashattn"
OURS_CUDA = "flashattn-cuda"  # our CUDA C++ kernel: timed beside the others, never a baseline for the ratio
OURS_FP8 = "flashattn-fp8"  # ours on FP8 inputs (FlashAttention-3's FP8 forward): beside ours, never a baseline
OURS_FP8_TRAIN = "flashattn-fp8-train"  # ours in the FP8 training mode: beside ours, never a baseline
OURS_ONE_PASS = "flashattn-one-pass"  # ours with the one-pass backward (dQ by atomics): beside ours
OURS_HOPPER = "flashattn-hopper"  # ours with the Hopper tier wherever it runs (its backward too): beside ours
OURS_HOPPER_FP8 = "flashattn-hopper-fp8"  # ours on FP8 inputs with the Hopper tier forced: beside ours
OURS_VARIANTS = (OURS, OURS_CUDA, OURS_FP8, OURS_FP8_TRAIN, OURS_ONE_PASS, OURS_HOPPER, OURS_HOPPER_FP8)
# The environment an implementation's measurement runs in (set for the case, the caller's restored after).
ENVIRONMENT = {OURS_ONE_PASS: {"FLASHATTN_TRITON_BACKWARD": "one-pass"},
               OURS_HOPPER: {"FLASHATTN_TRITON_TIER": "hopper"}, OURS_HOPPER_FP8: {"FLASHATTN_TRITON_TIER": "hopper"}}
FEATURES = ("dropout", "softcap", "alibi", "window", "gqa8")
IMPLEMENTATIONS: dict[str, Callable] = {
    OURS: ours,
    **{f"{OURS}+{feature}": _ours_with(feature) for feature in FEATURES},
    OURS_CUDA: ours_cuda,
    OURS_FP8: ours_fp8,
    OURS_FP8_TRAIN: ours_fp8_train,
    OURS_ONE_PASS: ours,
    OURS_HOPPER: ours,
    OURS_HOPPER_FP8: ours_fp8,
    "sdpa": _sdpa(None),
    "sdpa-math": _sdpa("MATH"),
    "sdpa-flash": _sdpa("FLASH_ATTENTION"),
    "sdpa-efficient": _sdpa("EFFICIENT_ATTENTION"),
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
    "flex": flex_attention,
    "plain": plain_attention,
}
MODES = ("fwd", "bwd", "fwd+bwd")
FORWARD_ONLY = (OURS_CUDA, OURS_FP8, OURS_HOPPER_FP8)  # measured in "fwd" cases only
COMPILED = ("flex",)  # torch.compile'd: seconds of compiling per new shape, so measured after the others


@dataclass
class Case:
    impl: str
    seqlen: int
    batch: int = 1
    heads: int = 4
    headdim: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    causal: bool = False
    repeats: int = 3
    mode: str = "fwd"

    @property
    def plain_attention_bytes(self) -> float:
        """What plain attention's N x N tensors take: S and P, and their gradients when there is a backward."""
        tensors = 2 if self.mode == "fwd" else 4
        return tensors * self.batch * self.heads * self.seqlen**2 * torch.finfo(getattr(torch, self.dtype)).bits / 8

    @property
    def flops(self) -> float:
        """4 B H N^2 D per forward (half when causal); the backward is 2.5 forwards."""
        fwd = 4 * self.batch * self.heads * self.seqlen**2 * self.headdim / (2 if self.causal else 1)
        return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[self.mode]


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: reset VmHWM, the peak resident set size, to the current size
        return True
    except OSError:
        return False


def _make_step(fn, q, k, v, causal: bool, mode: str) -> Callable[[], None]:
    """A zero-argument callable doing one measured unit of work for ``mode``."""
    if mode == "fwd":
        def step():
            with torch.inference_mode():
                fn(q, k, v, causal)
        return step
    if mode == "fwd+bwd":
        def step():
            torch.autograd.grad(fn(q, k, v, causal), (q, k, v), grad)
        grad = torch.randn_like(fn(q, k, v, causal).detach())
        return step
    out = fn(q, k, v, causal)  # "bwd": one saved forward, many backwards through it
    grad = torch.randn_like(out.detach())

    def step():
        torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    return step


def _environment(impl: str) -> contextlib.ExitStack:
    """``ENVIRONMENT[impl]`` set inside the ``with`` block, the variables' values before restored after."""
    stack = contextlib.ExitStack()
    for name, value in ENVIRONMENT.get(impl, {}).items():
        stack.enter_context(setting(name, value))
    return stack


def run_here(case: Case) -> dict:
    """Measure in this process: median seconds of ``repeats`` calls after warm-up, TFLOP/s, peak extra bytes."""
    if case.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {case.mode!r}")
    with _environment(case.impl):
        return _measure(case)


def _measure(case: Case) -> dict:
    fn = IMPLEMENTATIONS[case.impl]
    dtype = getattr(torch, case.dtype)
    shape = (case.batch, case.seqlen, case.heads, case.headdim)
    grad = case.mode != "fwd"
    q, k, v = (torch.randn(shape, dtype=dtype, device=case.device, requires_grad=grad) for _ in range(3))
    cuda = case.device.startswith("cuda")
    start = time.perf_counter()
    if cuda:  # the first full-size call compiles what it needs (Triton kernels, FlexAttention's graph): kept apart
        _make_step(fn, q, k, v, case.causal, case.mode)()
        torch.cuda.synchronize()
    else:  # load code and start thread pools outside the measurement, on a tiny problem (no compiles on CPU)
        tiny = [t.detach()[:, : min(case.seqlen, 16)].requires_grad_(grad) for t in (q, k, v)]
        _make_step(fn, *tiny, case.causal, case.mode)()
    first_call = time.perf_counter() - start
    step = _make_step(fn, q, k, v, case.causal, case.mode)
    peak = peak_bytes(step, case.device)  # also the warm-up of the timing loop
    if not cuda:
        warm_up(step)
    times = time_calls(step, case.repeats, case.device)
    seconds = statistics.median(times)
    device = None  # the GPU's time alone: each call queued behind a spin kernel, so no host time is in it
    if cuda:
        device = statistics.median(time_calls(step, case.repeats, case.device, queue_ahead=True))
    return {**asdict(case), "seconds": seconds, "tflops": case.flops / seconds / 1e12, "peak_bytes": peak,
            "first_call_seconds": first_call if cuda else None, "device_seconds": device,
            "device_tflops": case.flops / device / 1e12 if device else None}


CPU_WARM_UP_SECONDS = 0.3


def warm_up(step: Callable[[], object], seconds: float = CPU_WARM_UP_SECONDS, most: int = 10) -> None:
    """Call ``step`` until ``seconds`` have passed (at most ``most`` times): on CPU the first calls of a size run
    up to a third slower (the allocator maps their blocks anew, every fresh page faulting; the core's clock and
    caches settle), for every implementation alike; a serving or training loop sees the steady state."""
    start = time.perf_counter()
    for _ in range(most):
        if time.perf_counter() - start >= seconds:
            break
        step()


def peak_bytes(step: Callable[[], object], device: str) -> int:
    """Run ``step`` once and return the most memory it held above what was in use before: the allocator's peak on
    CUDA, the resident set's high-water mark on CPU (``ru_maxrss`` where the mark cannot be reset)."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        exact = _reset_peak_rss()
        before = _proc_status("VmRSS")
    step()
    if cuda:
        torch.cuda.synchronize()
        return max(0, torch.cuda.max_memory_allocated() - before)
    high = _proc_status("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(0, high - before)


def time_calls(step: Callable[[], object], repeats: int, device: str, flush_l2: bool = True,
               queue_ahead: bool = False) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``step``: perf_counter on CPU; on CUDA, events around each call
    after two warm-up calls, with L2 flushed before each (``flush_l2``) so inputs come from HBM.

    ``queue_ahead`` (CUDA): before each call, keep the GPU busy in a spin kernel long enough for the host to queue
    the whole call, so the events time the device work alone, not Python and launch overhead. Needed for calls
    whose kernels run for microseconds (decode), where the overhead would otherwise be most of the reading.
    """
    if device.startswith("cuda"):
        return _time_cuda(step, repeats, flush_l2, queue_ahead)
    return _time_cpu(step, repeats)


def _time_cpu(step, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


QUEUE_AHEAD_CYCLES = 2_000_000  # ~1 ms at H100/H200 clocks: far more than one call's host overhead (~10-100 us)


def _time_cuda(step, repeats: int, flush_l2: bool = True, queue_ahead: bool = False) -> list[float]:
    flush = torch.empty(L2_FLUSH_BYTES if flush_l2 else 0, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        if flush_l2:
            flush.zero_()  # evict the inputs from L2 so every call reads them from HBM
        if queue_ahead:
            torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def measure(case: Case, timeout: float = 600, isolate: bool = True) -> dict:
    """Measure ``case``: in a subprocess on CPU when ``isolate`` (a clean peak-RSS reading), else in-process.

    A failing implementation (unsupported on this device, out of memory) gives a row with ``error`` set.
    """
    if case.device.startswith("cuda") or not isolate:
        try:
            return run_here(case)
        except Exception as e:  # a baseline that cannot run here is a result, not a crash
            return {**asdict(case), "seconds": None, "tflops": None, "peak_bytes": None,
                    "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    args = [sys.executable, "-m", "flashattn.bench.measure", case.impl, str(case.seqlen), "--json"]
    for key in ("batch", "heads", "headdim", "dtype", "device", "repeats", "mode"):
        args += [f"--{key}", str(getattr(case, key))]
    if case.causal:
        args.append("--causal")
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        error = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        return {**asdict(case), "seconds": None, "tflops": None, "peak_bytes": None, "error": error}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Time and peak memory of one attention call.")
    p.add_argument("impl", choices=sorted(IMPLEMENTATIONS))
    p.add_argument("seqlen", type=int)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--mode", default="fwd", choices=MODES)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    a = p.parse_args(argv)
    case = Case(a.impl, a.seqlen, a.batch, a.heads, a.headdim, a.dtype, a.device, a.causal, a.repeats, a.mode)
    result = run_here(case)
    print(json.dumps(result) if a.json else result)


if __name__ == "__main__":
    main()
