"""Context parallelism on CPU: 2 and 4 gloo ranks on localhost, every layout, against a single-process float64
reference: output, log-sum-exp and the three gradients, causal and not, with window, softcap, ALiBi and GQA."""

from __future__ import annotations

import json
import os
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from triton_versions import TRITON_MISSING

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


def _spawn(body, world: int, tmp_path, *args) -> list:
    """Run ``body(rank, world, *args)`` on ``world`` gloo ranks and return rank 0's answer (a JSON list)."""
    out_path = tmp_path / "answer.json"
    mp.spawn(_rank_main, args=(world, str(tmp_path / "store"), str(out_path), body, args), nprocs=world, join=True)
    return json.loads(out_path.read_text())


def _rank_main(rank, world, store_path, out_path, body, args):
    sys.path.insert(0, os.path.dirname(__file__))
    torch.set_num_threads(1)
    # A file store, not TCP: no free-port race with the other test worker, no store server thread in rank 0.
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    answer = body(rank, world, *args)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(answer, f)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without interpreter finalization: gloo's threads can abort the process there (seen once in CI as
    # "terminate called without an active exception" after every check had passed), which is not ours to test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
