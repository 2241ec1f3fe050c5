"""Context parallelism on CPU: 2 and 4 gloo ranks on localhost, every layout, against a single-process float64
reference: output, log-sum-exp and the three gradients, causal and not, with window, softcap, ALiBi and GQA."""

from __future__ import annotations

import ctypes
import faulthandler
import json
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

FUNCS = {  # name: (function, layout, its own keyword arguments)
    "ring": ("ring_flash_attn_func", "contiguous", {}),
    "zigzag": ("zigzag_ring_flash_attn_func", "zigzag", {}),
    "allgather": ("allgather_flash_attn_func", "contiguous", {}),
    "allgather by head": ("allgather_flash_attn_func", "contiguous", {"kv_heads_per_step": 1}),
    "ulysses": ("ulysses_flash_attn_func", "contiguous", {}),
}
CASES = [
    {"causal": False},
    {"causal": True},
    {"causal": True, "window_size": (5, 0), "softcap": 2.0, "alibi": True},
    {"window_size": (3, 4)},
    {"causal": True, "window_size": (4, 0), "sink": True},  # learnable_sink: its gradient summed over the ranks
]


# The ranks' own limits (see _spawn): to start (import torch and this file: up to 41 s for 4 ranks on 2 busy
# cores), then to run (the slowest case, the Triton interpreter's, 45 s). Together inside these tests' own limit
# (pytest-timeout), so that a rank that hangs fails its test with the ranks' stacks, not with the pytest worker's.
RANKS_START_S = 120
RANKS_RUN_S = 180
pytestmark = pytest.mark.timeout(RANKS_START_S + RANKS_RUN_S + 60)


class RanksFailed(AssertionError):
    """A rank exited with an error, or did not finish in time (the message holds its traceback or stacks)."""


def _spawn(body, world: int, tmp_path: Path, *args, timeout: float = RANKS_RUN_S) -> list:
    """Run ``body(rank, world, *args)`` on ``world`` gloo ranks and return rank 0's answer (a JSON list).

    Raises ``RanksFailed`` as soon as a rank exits with an error (with its traceback), or when the ranks have not
    all finished ``timeout`` seconds after all of them started (``RANKS_START_S`` to start): then with the Python
    stacks of every rank still running, which are then killed. No rank outlives the call."""
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_rank_main, args=(rank, world, str(tmp_path), body, args), daemon=True)
             for rank in range(world)]
    for p in ranks:
        p.start()
    try:
        _join(ranks, tmp_path, timeout)
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
            p.join()
    return json.loads((tmp_path / "answer.json").read_text())


def _join(ranks: list, tmp: Path, timeout: float) -> None:
    """Wait for every rank to exit 0; raise ``RanksFailed`` on the first that does not, or at the deadline."""
    started = None  # when the last rank had started (its stack file exists: SIGUSR1 dumps its stacks there)
    deadline = time.monotonic() + RANKS_START_S
    while True:
        if any(p.exitcode not in (None, 0) for p in ranks):
            time.sleep(1)  # its peers fail within milliseconds on the connections it closed: report them too
            raise RanksFailed(_failures(ranks, tmp))
        live = [p for p in ranks if p.exitcode is None]
        if not live:
            return
        if started is None and all((tmp / f"stacks.{rank}").exists() for rank in range(len(ranks))):
            started = time.monotonic()
            deadline = started + timeout
        if time.monotonic() >= deadline:
            names = ", ".join(str(rank) for rank, p in enumerate(ranks) if p.exitcode is None)
            what = f"running after {timeout:g} s" if started else f"starting after {RANKS_START_S} s"
            raise RanksFailed(f"rank {names} of {len(ranks)} still {what}:\n{_stacks(ranks, tmp)}")
        wait = max(0.0, min(1.0, deadline - time.monotonic()))
        multiprocessing.connection.wait([p.sentinel for p in live], timeout=wait)


def _failures(ranks: list, tmp: Path) -> str:
    """Every rank that exited with an error, the likeliest cause first: a rank without a traceback (it crashed),
    then in the order they failed (the others mostly fail on the connections that the first one closed)."""
    errors = {rank: (tmp / f"error.{rank}").read_text().split("\n", 1) if (tmp / f"error.{rank}").exists()
              else ("0", "no traceback (killed, or it crashed in C)\n") for rank, p in enumerate(ranks)
              if p.exitcode not in (None, 0)}  # rank: (when it failed, on the machine-wide monotonic clock; why)
    return "\n".join(f"rank {rank} of {len(ranks)} exited with code {ranks[rank].exitcode}:\n{why}"
                     for rank, (_, why) in sorted(errors.items(), key=lambda item: int(item[1][0])))


def _stacks(ranks: list, tmp: Path) -> str:
    """Every live rank's Python stacks (all threads), which SIGUSR1 makes it write to its stack file."""
    asked = {rank: tmp / f"stacks.{rank}" for rank, p in enumerate(ranks) if p.is_alive()}
    for rank, path in asked.items():
        if path.exists():  # else its handler is not registered yet and SIGUSR1 would only kill it
            os.kill(ranks[rank].pid, signal.SIGUSR1)
    sizes, until = {}, time.monotonic() + 5
    while time.monotonic() < until:  # until every dump is written in full: not empty and no longer growing
        time.sleep(0.3)
        now = {rank: path.stat().st_size if path.exists() else 0 for rank, path in asked.items()}
        if now == sizes and all(now.values()):
            break
        sizes = now
    return "\n".join(f"--- rank {rank} (pid {ranks[rank].pid}), its stacks:\n" + (
        (path.read_text() or "(none written within 5 s)\n") if path.exists() else "(none: still importing)\n")
        for rank, path in asked.items())


def _rank_main(rank, world, tmp, body, args):
    # First of all, a dump of every thread's Python stack on SIGUSR1, which _join sends to a rank still running at
    # its deadline (faulthandler writes from the signal handler, with or without the GIL; the file stays open).
    # The file takes its name once the handler is in place: _stacks signals only ranks whose file exists.
    stacks = os.path.join(tmp, f"stacks.{rank}")
    faulthandler.register(signal.SIGUSR1, file=os.open(stacks + ".new", os.O_WRONLY | os.O_CREAT), all_threads=True)
    os.rename(stacks + ".new", stacks)
    if sys.platform == "linux":  # and the rank dies with the process that started it, however that one ends
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    try:
        sys.path.insert(0, os.path.dirname(__file__))
        torch.set_num_threads(1)
        # A file store, not TCP: no free-port race with the other test worker, no store server thread in rank 0.
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
        answer = body(rank, world, *args)
        if rank == 0:
            with open(os.path.join(tmp, "answer.json"), "w") as f:
                json.dump(answer, f)
        dist.barrier()
    except BaseException:
        with open(os.path.join(tmp, f"error.{rank}"), "w") as f:
            f.write(f"{time.monotonic_ns()}\n{traceback.format_exc()}")
        _leave(1)
    # The process group is never destroyed: ProcessGroupGloo's destructor joins gloo's threads while holding the GIL,
    # and one of them can be waiting for the GIL to free a tensor (PyObjectSlot::maybe_destroy_pyobj): a deadlock,
    # seen on torch 2.7.1 (a rank hung 9 minutes in destroy_process_group). Interpreter finalization is no better
    # (gloo's threads could abort the process there: "terminate called without an active exception"). So no
    # destructor runs at all: once every rank is past the barrier (a file each, so that no rank closes its sockets
    # while a peer's gloo operation is still under way), each leaves with os._exit and the OS closes the sockets.
    Path(tmp, f"done.{rank}").touch()
    while not all(os.path.exists(os.path.join(tmp, f"done.{r}")) for r in range(world)):
        time.sleep(0.01)
    _leave(0)


def _leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _reference(q, k, v, kwargs):
    from oracle import attention_ref

    window = kwargs.get("window_size", (-1, -1))
    return attention_ref(q, k, v, causal=kwargs.get("causal", False), window=window,
                         softcap=kwargs.get("softcap", 0.0), alibi=kwargs.get("alibi_slopes"),
                         sink=kwargs.get("learnable_sink"))


def _layouts_body(rank, world, dtype_name, backend="auto", names=tuple(FUNCS), cases=None):
    import flashattn
    import flashattn.distributed as fd

    failures = []
    dtype = getattr(torch, dtype_name)
    try:
        for name in names:
            fn_name, layout, own = FUNCS[name]
            for i in range(len(CASES)) if cases is None else cases:
                case = CASES[i]
                torch.manual_seed(1000 + i)  # the same global inputs on every rank
                b, n, h, hk, d = 2, 8 * world, 4, 4 if name == "ulysses" and world == 4 else 2, 16
                q, k, v = (torch.randn(b, n, heads, d, dtype=torch.float64) for heads in (h, hk, hk))
                dout = torch.randn(b, n, h, d, dtype=torch.float64)
                dlse = torch.randn(b, h, n, dtype=torch.float64)
                kwargs = {key: val for key, val in case.items() if key not in ("alibi", "sink")}
                if case.get("alibi"):
                    kwargs["alibi_slopes"] = (torch.rand(h) * 0.5).double()  # values exact in float32 too
                sink = torch.randn(h, dtype=torch.float64) if case.get("sink") else None
                leaves = [t.clone().requires_grad_() for t in (q, k, v, sink) if t is not None]
                ref_out, ref_lse = _reference(*leaves[:3], {**kwargs, "learnable_sink": (leaves[3:] or [None])[0]})
                ref_grads = torch.autograd.grad((ref_out, ref_lse), leaves, (dout, dlse))

                local = [fd.shard(t.to(dtype), layout).requires_grad_() for t in (q, k, v)]
                if "alibi_slopes" in kwargs:
                    kwargs["alibi_slopes"] = kwargs["alibi_slopes"].to(torch.float32)
                if sink is not None:
                    kwargs["learnable_sink"] = sink.detach().to(dtype).requires_grad_()
                    local.append(kwargs["learnable_sink"])
                with flashattn.use_backend(backend):
                    out, lse, _ = getattr(fd, fn_name)(*local[:3], return_attn_probs=True, **kwargs, **own)
                    grads = torch.autograd.grad((out, lse), local, (fd.shard(dout.to(dtype), layout),
                                                                     fd.shard(dlse, layout, dim=2).to(lse.dtype)))
                got = {"out": fd.unshard(out.detach(), layout), "lse": fd.unshard(lse.detach(), layout, dim=2)}
                got.update({g: fd.unshard(x, layout) for g, x in zip(("dq", "dk", "dv"), grads, strict=False)})
                want = {"out": ref_out, "lse": ref_lse, "dq": ref_grads[0], "dk": ref_grads[1], "dv": ref_grads[2]}
                if sink is not None:  # each rank's share of the replicated sink's gradient; DDP would sum them
                    got["dsink"] = grads[3].clone()
                    dist.all_reduce(got["dsink"])
                    want["dsink"] = ref_grads[3]
                tol = 1e-9 if dtype == torch.float64 else 2e-5
                for key, x in got.items():
                    w = want[key]
                    finite = torch.isfinite(w)
                    same_inf = (torch.equal(torch.isfinite(x), finite)
                                and torch.equal(x[~finite], w[~finite].to(x.dtype)))
                    err = (x.double()[finite] - w[finite]).abs().max().item() if finite.any() else 0.0
                    scale = 1 + w[finite].abs().max().item() if finite.any() else 1
                    if not same_inf or err > tol * scale:
                        failures.append(f"{name} case {i} {case} {key}: max error {err:.3g} (infinities match: "
                                        f"{same_inf})")
    except Exception:
        failures.append(traceback.format_exc())
    return failures


@pytest.mark.parametrize("world,dtype", [(2, "float64"), (4, "float64"), (2, "float32")])
def test_every_layout_matches_one_device(world, dtype, tmp_path):
    failures = _spawn(_layouts_body, world, tmp_path, dtype)
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels on CPU need TRITON_INTERPRET")
def test_triton_blocks_match_one_device(tmp_path):
    """The Triton backward on the blocks the layouts hand it: slices of the whole attention's lse (zigzag's two
    chunks, all-gather's head groups)."""
    from triton_versions import TRITON_MISSING  # here, not in every rank: importing triton costs each 2 s of CPU

    if TRITON_MISSING:
        pytest.skip(TRITON_MISSING)
    failures = _spawn(_layouts_body, 2, tmp_path, "float32", "triton", ("zigzag", "allgather by head"), (1, 4))
    assert not failures, "\n".join(failures)


def _without_collectives_body(rank, world):
    """Ulysses and the all-gather layout where the backend has neither all-to-all nor reduce-scatter (gloo in
    torch 2.7): the exchange goes by pairwise sends and receives, the sum by an all-reduce, with the same results."""
    from flashattn.distributed import collectives

    def refuse(what):
        def collective(*args, **kwargs):
            raise RuntimeError(f"ProcessGroupGloo does not support {what}")
        return collective

    dist.all_to_all, dist.reduce_scatter = refuse("alltoall"), refuse("reduce_scatter")
    failures = _layouts_body(rank, world, "float64", names=("ulysses", "allgather by head"), cases=(0, 1))
    used = {name: backends for name, backends in collectives._MISSING.items()}
    return failures + ([] if used == {"all_to_all": {"gloo"}, "reduce_scatter": {"gloo"}} else [f"routes: {used}"])


@pytest.mark.parametrize("world", [2, 4])
def test_without_all_to_all_or_reduce_scatter_the_layouts_take_other_routes(world, tmp_path):
    failures = _spawn(_without_collectives_body, world, tmp_path)
    assert not failures, "\n".join(failures)


def _errors_body(rank, world):
    import flashattn.distributed as fd

    messages = []
    q = torch.randn(1, 4 + rank, 2, 8)  # uneven shards: rank 1 holds one more token
    for call in (
        lambda: fd.ring_flash_attn_func(q, q, q),
        lambda: fd.ring_flash_attn_func(q[:, :4], q[:, :4], q[:, :4], dropout_p=0.1),
        lambda: fd.ulysses_flash_attn_func(*(torch.randn(1, 4, 3, 8) for _ in range(3))),
        lambda: fd.zigzag_ring_flash_attn_func(*(torch.randn(1, 3, 2, 8) for _ in range(3))),
        lambda: fd.shard(torch.randn(1, 5, 2, 8), "zigzag"),
    ):
        try:
            call()
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_refused_combinations_get_clear_errors(tmp_path):
    messages = _spawn(_errors_body, 2, tmp_path)
    expected = ["same number of tokens, got [4, 5]", "dropout_p must be 0", "must be multiples of the world size",
                "length must be even", "does not split into 4 equal chunks"]
    for got, want in zip(messages, expected, strict=True):
        assert want in got, got


def test_segments_and_shard_round_trip_without_a_group():
    from flashattn.distributed import segments

    # Every token of an 8-token sequence is held exactly once in each layout, for 2 ranks.
    for layout in ("contiguous", "zigzag"):
        held = sorted(g + t for r in range(2) for g, _, n in segments(layout, r, 2, 4) for t in range(n))
        assert held == list(range(8))


def _failing_body(rank, world, how):
    if rank == 1:
        if how == "hang":
            _hang_here()
        if how == "raise":
            raise RuntimeError("rank 1 fails on purpose")
        os._exit(3)  # "die": no traceback
    return []


def _hang_here():
    time.sleep(3600)


def test_a_rank_that_hangs_fails_its_test_at_its_deadline_with_its_stacks(tmp_path):
    begun = time.monotonic()
    with pytest.raises(RanksFailed, match="rank 0, 1 of 2 still running after 5 s") as failed:
        _spawn(_failing_body, 2, tmp_path, "hang", timeout=5)
    message = str(failed.value)
    # Rank 1 where it hangs, rank 0 waiting for it in the final barrier.
    assert "in _hang_here" in message.split("--- rank 1")[1], message
    assert "in _rank_main" in message.split("--- rank 0")[1].split("--- rank 1")[0], message
    assert time.monotonic() - begun < RANKS_START_S + 5 + 5  # to start, to run, to dump the stacks
    for pid in re.findall(r"\(pid (\d+)\)", message):  # killed and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)


@pytest.mark.parametrize("how,why", [("raise", "RuntimeError: rank 1 fails on purpose"), ("die", "no traceback")])
def test_a_rank_that_fails_fails_its_test_at_once(how, why, tmp_path):
    begun = time.monotonic()
    with pytest.raises(RanksFailed, match=f"^rank 1 of 2 exited with code {1 if how == 'raise' else 3}:\n") as failed:
        _spawn(_failing_body, 2, tmp_path, how, timeout=RANKS_RUN_S)
    # First (rank 0, in the barrier, may fail after it on the connection it closed, or be killed).
    assert why in str(failed.value).split("rank 0 of 2")[0], str(failed.value)
    assert time.monotonic() - begun < RANKS_RUN_S / 2  # not at the deadline: rank 0, in the barrier, was killed
