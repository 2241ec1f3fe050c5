"""Address arithmetic in the compiled Triton kernels is 64-bit: a row, head or batch index times its stride passes
2^31 elements on long sequences (256k tokens x 64 heads x 128 dims), and a 32-bit product would wrap silently.

The kernels are compiled offline for sm_80 (pointer loads everywhere, no TMA) through the real launcher, and their
Triton IR is read: every use of a ``stride_*`` argument must be its sign extension to i64 (the head-dim column
strides are 1 and specialized away). No GPU needed; the interpreter cannot show this (it computes in Python ints).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from triton_versions import needs_triton

pytestmark = needs_triton


def _calls():
    """(name, call) of representative launches: dense, varlen, split-KV, paged cache, every optional tensor, and
    the backward."""
    import torch

    from flashattn.backends.spec import AttentionSpec, KeyCache, Saved, Varlen
    from flashattn.backends.triton import attend as backend

    b, n, h, hk, d = 2, 256, 4, 2, 64
    q = torch.empty(b, n, h, d, dtype=torch.float16)
    k = torch.empty(b, n, hk, d, dtype=torch.float16)
    packed = torch.empty(b * n, h, d, dtype=torch.float16)
    cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32)
    heavy = AttentionSpec(scale=0.125, window_left=64, window_right=0, softcap=30.0, alibi_slopes=torch.rand(b, h),
                          dropout_p=0.1, seed=torch.zeros(1, dtype=torch.int64),
                          attn_mask=torch.zeros(b, h, n, n, dtype=torch.float16))
    pages = torch.empty(b * n // 16, 16, hk, d, dtype=torch.float16)
    paged = AttentionSpec(scale=0.125, cache=KeyCache(torch.zeros(b, dtype=torch.int32),
                                                      torch.full((b,), n, dtype=torch.int32), n,
                                                      block_table=torch.arange(b * n // 16, dtype=torch.int32)
                                                      .view(b, -1), num_splits=4))
    lse = torch.empty(b, h, n)
    return {
        "dense": lambda: backend.forward(q, k, k, AttentionSpec(scale=0.125, window_right=0)),
        "heavy": lambda: backend.forward(q, k, k, heavy),
        "varlen": lambda: backend.forward(packed, packed, packed, AttentionSpec(scale=0.125,
                                                                               varlen=Varlen(cu, cu, n, n))),
        "paged-split": lambda: backend.forward(q[:, :1], pages, pages, paged),
        "backward": lambda: backend.backward(torch.empty_like(q), None, Saved(q, k, k, q, lse), heavy),
    }


def _narrow(lines: list[str]) -> list[str]:
    """The lines that use a stride argument in 32-bit arithmetic. Allowed: its sign extension to i64, and stepping
    a pointer by one stride (``tt.addptr``, directly or through a ``tt.splat`` that only feeds pointer steps): the
    pointer itself is 64-bit."""
    bad = []
    for line in lines:
        if not re.search(r"%stride_\w+\b", line) or re.search(r"arith\.extsi %stride_\w+ : i32 to i64", line):
            continue
        if "tt.addptr" in line:
            continue
        splat = re.match(r"\s*(%[\w.]+) = tt\.splat %stride_\w+ ", line)
        if splat:
            uses = [u for u in lines if re.search(re.escape(splat.group(1)) + r"\b", u) and u != line]
            if uses and all("tt.addptr" in u for u in uses):
                continue
        bad.append(line.strip())
    return bad


def _narrow_stride_uses() -> dict[str, list[str]]:
    """{call/kernel: IR lines using a stride argument other than by sign-extending it to i64}."""
    from tools.offline.compile import compiled_launches

    found = {}
    for name, call in _calls().items():
        for launch in compiled_launches(80, call):
            ttir = launch.kernel.asm["ttir"]
            body = ttir[ttir.index("tt.func"):]
            body = body[body.index("\n"):]  # past the signature
            found[f"{name}/{launch.name}"] = _narrow(body.splitlines())
    return found


def test_address_arithmetic_is_64_bit(tmp_path):
    # A subprocess without TRITON_INTERPRET: under the interpreter @triton.jit functions cannot be compiled.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "ir.json"
    done = subprocess.run([sys.executable, __file__, str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert out.exists(), done.stderr[-3000:]
    found = json.loads(out.read_text())
    kernels = {key.split("/")[1] for key in found}
    assert {"attention_forward_kernel", "attention_backward_preprocess_kernel",
            "attention_backward_dkdv_kernel", "attention_backward_dq_kernel"} <= kernels
    bad = {key: lines for key, lines in found.items() if lines}
    assert not bad, json.dumps(bad, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(sys.argv[1], "w") as f:
        json.dump(_narrow_stride_uses(), f)
