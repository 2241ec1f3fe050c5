"""gpu-check's ``decode-graph`` smoke case: a serving engine's decode step, captured in a CUDA graph.

``flash_attn_with_kvcache`` with a tensor ``cache_seqlens`` and new keys appended is captured with
``torch.cuda.graph`` (after a warm-up on a side stream), then replayed on new queries, keys and lengths copied into
the captured tensors; each replay is judged against float64 over the cache it appended to, and one eager call
runs under ``torch.cuda.set_sync_debug_mode("error")``: no host synchronisation anywhere in the call. Without a GPU
(the interpreter's tiny run) the same steps run eagerly.
"""

from __future__ import annotations


def check_decode_graph(case, sizes, device: str, oracle) -> dict:
    import torch

    import flashattn

    dtype = getattr(torch, case.dtype)
    b, hk, d, n = sizes.batch, sizes.heads_k, case.head_dim, sizes.cache_len

    def inputs(step: int) -> list:
        g = torch.Generator(device=device).manual_seed(step)
        new = [torch.randn(b, 1, h, d, device=device, dtype=dtype, generator=g) for h in (sizes.heads, hk, hk)]
        lengths = torch.tensor([n - 3 - step, n // 3 + step][:b], dtype=torch.int32, device=device)
        return [*new, lengths]

    k_cache, v_cache = (torch.randn(b, n, hk, d, device=device, dtype=dtype) for _ in range(2))

    def step(q, k, v, lengths):
        return flashattn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                                 causal=case.causal)

    static = inputs(0)
    replay = lambda: step(*static)  # noqa: E731
    if device == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(*static)
            step(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(*static)
        replay = lambda: (graph.replay(), out)[1]  # noqa: E731
    worst = 0.0
    for i in (1, 2):
        for s, f in zip(static, inputs(i), strict=True):
            s.copy_(f)
        got = replay()
        for row, length in enumerate(static[3].tolist()):
            keys = (k_cache[row:row + 1, :length + 1], v_cache[row:row + 1, :length + 1])
            ref, _ = oracle.attention_ref(static[0][row:row + 1], *keys, causal=case.causal)
            base, _ = oracle.attention_ref(static[0][row:row + 1], *keys, causal=case.causal, upcast=False)
            oracle.assert_close(f"replay {i}, sequence {row}", got[row:row + 1], ref, base)
            worst = max(worst, oracle.max_err(got[row:row + 1], ref))
    if device == "cuda":
        fresh = inputs(3)  # before the check: torch.tensor(list, device="cuda") copies from pageable memory, a sync
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(*fresh)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return {"out": float(f"{worst:.3g}")}
