"""examples/train_gpt.py: a few training steps of both runs, KV-cache generation equal to recomputation, and
torch.compile(fullgraph=True) of the GPT (no graph breaks) giving eager's logits and gradients."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).parents[1] / "examples" / "train_gpt.py"


def _load():
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module
    spec.loader.exec_module(module)
    return module


TINY = ["--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len", "32", "--batch-size", "4"]


def test_train_gpt_few_steps(tmp_path):
    gpt = _load()
    result = gpt.main([*TINY, "--steps", "4", "--sample-len", "12", "--log-every", "0", "--out", str(tmp_path)])
    ours, sdpa = result["losses"]["flashattn"], result["losses"]["sdpa"]
    assert len(ours) == len(sdpa) == 4 and all(math.isfinite(x) for x in ours + sdpa)
    # Same weights, same batches, exact attention: the curves agree up to float32 rounding.
    for a, b in zip(ours, sdpa, strict=True):
        assert abs(a - b) <= 1e-3 * abs(b), (ours, sdpa)
    assert math.log(result["config"]["vocab"]) - 0.5 < ours[0] < math.log(result["config"]["vocab"]) + 0.5
    assert result["cache_matches_recompute"] is True
    assert result["sample"].startswith("Shall I compare thee") and len(result["sample"]) == 20 + 12
    assert json.loads((tmp_path / "losses.json").read_text())["steps"] == 4
    assert (tmp_path / "losses.png").stat().st_size > 0


def test_gpt_compiles_fullgraph_like_eager():
    gpt = _load()
    torch.manual_seed(0)
    model = gpt.GPT(gpt.Config(vocab=17, dim=32, layers=2, heads=4, kv_heads=2, seq_len=24))
    tokens = torch.randint(0, 17, (2, 24))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break is an error
    eager_logits, compiled_logits = model(tokens), compiled(tokens)
    torch.testing.assert_close(compiled_logits, eager_logits)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(compiled_logits.square().mean(), params),
                    torch.autograd.grad(eager_logits.square().mean(), params), strict=True):
        torch.testing.assert_close(a, b)


def test_generation_with_cache_equals_recompute():
    gpt = _load()
    torch.manual_seed(1)
    model = gpt.GPT(gpt.Config(vocab=11, dim=32, layers=2, heads=4, kv_heads=1, seq_len=16)).eval()
    prompt = torch.randint(0, 11, (3, 5))
    assert torch.equal(model.generate(prompt, 20, use_cache=True), model.generate(prompt, 20, use_cache=False))
