"""Hugging Face transformers with attn_implementation="flashattn": small models built from configs with random
weights (no download), against the same weights with transformers' own attention.

Ground truth is the float64 model with "sdpa" (or "eager" where sdpa refuses a feature); a float32 run of ours
must be within the tolerance rule of the float32 run of the reference implementation (tests/oracle.py)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from oracle import assert_close  # noqa: E402

from flashattn.integrations.transformers import attention_forward, padding_mask, register  # noqa: E402

NAME = register()
VOCAB = 61


def _llama(**extra):
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    **extra)


def _gpt2():
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=128,
                                   bos_token_id=0, eos_token_id=0)


def _mistral():  # sliding window of 5 keys
    return transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, sliding_window=5,
                                      max_position_embeddings=128)


def _gemma2():  # logit softcap, and sliding/global layers alternating
    return transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                                     attn_logit_softcapping=20.0, max_position_embeddings=128)


def _gpt_oss():  # learnable attention sinks (s_aux), sliding/full layers alternating, mixture of experts
    return transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                                     num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                                     layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                     experts_implementation="eager")  # grouped_mm has no float64


CONFIGS = {"llama": (_llama, "sdpa"), "gpt2": (_gpt2, "sdpa"), "mistral": (_mistral, "sdpa"),
           "gemma2": (_gemma2, "eager"), "gpt_oss": (_gpt_oss, "eager")}


def _models(kind, dtypes=(torch.float64, torch.float32)):
    """{(impl, dtype): model} sharing one set of random weights, in eval mode (dropout off)."""
    make, baseline = CONFIGS[kind]
    cfg = make()
    torch.manual_seed(0)
    first = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=baseline,
                                                          dtype=torch.float64)
    with torch.no_grad():  # gpt-oss initialises its sinks near 0; trained ones are not
        for name, param in first.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0.0, 2.0)
    state = first.state_dict()
    models = {"exact": baseline == "sdpa"}
    for impl in (baseline, NAME):
        for dtype in dtypes:
            model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl,
                                                                  dtype=dtype)
            model.load_state_dict(state)
            models[impl if impl == NAME else "base", dtype] = model.eval()
    return models


def _run(model, ids, **kwargs):
    """Logits and the gradient of every parameter for a fixed random projection of the logits."""
    model.zero_grad()
    logits = model(ids, use_cache=False, **kwargs).logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    valid = kwargs.get("attention_mask")
    if valid is not None:  # padded query positions are free to differ: nothing reads them
        weights = weights * valid[..., None]
    (logits * weights.to(logits.dtype)).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return logits.detach(), grads


def _compare(models, ids, valid=None, **kwargs):
    """Float64 ours equals float64 reference; float32 ours is within the rule of float32 reference."""
    truth, truth_g = _run(models["base", torch.float64], ids, **kwargs)
    ours64, ours64_g = _run(models[NAME, torch.float64], ids, **kwargs)
    base, base_g = _run(models["base", torch.float32], ids, **kwargs)
    ours, ours_g = _run(models[NAME, torch.float32], ids, **kwargs)
    keep = (lambda x: x[valid]) if valid is not None else (lambda x: x)
    if models["exact"]:
        assert_close("logits fp64", keep(ours64), keep(truth), keep(truth))
        assert_close("grads fp64", ours64_g, truth_g, truth_g)
    else:  # transformers' eager attention takes its softmax in float32 even for a float64 model
        torch.testing.assert_close(keep(ours64), keep(truth), rtol=0, atol=1e-6)
    assert_close("logits", keep(ours), keep(truth), keep(base))
    assert_close("grads", ours_g, truth_g, base_g, factor=3.0)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_logits_and_gradients_match(kind):
    ids = torch.randint(0, VOCAB, (2, 23))
    _compare(_models(kind), ids)


# Not gemma2: its eager reference turns fully masked padded rows into NaN, which then reach the real tokens.
@pytest.mark.parametrize("kind", ["llama", "gpt2", "mistral", "gpt_oss"])
def test_padding_mask_uses_varlen(kind):
    ids = torch.randint(0, VOCAB, (3, 19))
    mask = torch.ones(3, 19, dtype=torch.long)
    mask[0, :6] = 0  # left padding
    mask[2, 11:] = 0  # right padding
    _compare(_models(kind), ids, valid=mask.bool(), attention_mask=mask)


def _split_runs(model, ids, lengths):
    out, start = [], 0
    for n in lengths:
        out.append(model(ids[:, start:start + n], use_cache=False).logits)
        start += n
    return torch.cat(out, dim=1)


def test_packed_position_ids_isolate_sequences():
    models = _models("llama", dtypes=(torch.float64,))
    ours, base = models[NAME, torch.float64], models["base", torch.float64]
    lengths = [7, 1, 12, 4]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = ours(ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(packed, _split_runs(base, ids, lengths), rtol=0, atol=1e-10)
    torch.testing.assert_close(packed, base(ids, position_ids=pos, use_cache=False).logits, rtol=0, atol=1e-10)


def test_packing_is_found_once_per_position_ids_and_redone_after_an_in_place_write():
    from flashattn.integrations import transformers as integration

    pos = torch.tensor([[0, 1, 2, 0, 1]])
    first = integration._packed_offsets(pos, 1)
    assert first[0].tolist() == [0, 3, 5] and integration._packed_offsets(pos, 1) is first
    pos[0, 3:] = torch.tensor([3, 4])  # now one sequence: the kept answer must not be reused
    assert integration._packed_offsets(pos, 1) is None
    mask = torch.tensor([[True, True, False], [True, True, True]])
    plan = integration._PLANS.get(mask, "x", lambda: object())
    assert integration._PLANS.get(mask, "x", lambda: object()) is plan  # kept for the same mask
    assert integration._PLANS.get(mask.clone(), "x", lambda: object()) is not plan


def test_packed_cu_seqlens_kwargs():
    """DataCollatorWithFlattening's arguments (cu_seq_lens_q/k, max_length_q/k) reach the varlen path."""
    models = _models("llama", dtypes=(torch.float64,))
    ours, base = models[NAME, torch.float64], models["base", torch.float64]
    lengths = [5, 9, 3]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    packed = ours(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9,
                  use_cache=False).logits
    torch.testing.assert_close(packed, _split_runs(base, ids, lengths), rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gpt_oss"])
def test_greedy_generation_with_cache_matches(kind):
    """Prefill then one-token decode steps through transformers' DynamicCache, with left padding."""
    models = _models(kind, dtypes=(torch.float64,))
    ids = torch.randint(1, VOCAB, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    outs = [models[key, torch.float64].generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                                pad_token_id=0) for key in ("base", NAME)]
    assert torch.equal(outs[0], outs[1])


def _fp8_quantized_cache(config):
    """transformers' own FP8 KV cache (``QuantizedCache(backend="fp8")``: e4m3 with a per-tensor scale, handed to
    the attention dequantized), or a skip where this transformers has none."""
    try:
        return transformers.QuantizedCache(backend="fp8", config=config)
    except (AttributeError, TypeError, ValueError) as e:
        pytest.skip(f"this transformers ({transformers.__version__}) has no FP8 QuantizedCache: {e}")


def test_generation_with_transformers_fp8_cache_matches():
    """transformers' FP8 cache with attn_implementation="flashattn": the same tokens as sdpa reading the same cache
    (both attend the values it dequantizes), with left padding."""
    models = _models("llama", dtypes=(torch.float64,))
    ids = torch.randint(1, VOCAB, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    outs = []
    for key in ("base", NAME):
        model = models[key, torch.float64]
        cache = _fp8_quantized_cache(model.config)
        outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                   cache=cache))
        assert cache.layers[0]._quantized_keys[0].dtype == torch.float8_e4m3fn
    assert torch.equal(outs[0], outs[1])


def test_compiled_static_cache_generation_matches():
    """transformers' static cache with the model's forward under torch.compile(mode="reduce-overhead",
    fullgraph=True), as its docs compile generation: no graph break (the padding mask is applied as a boolean mask,
    whose shapes do not depend on its values, instead of unpadding), the same tokens and logits as eager sdpa, with
    left padding."""
    from torch._dynamo.utils import counters

    models = _models("mistral", dtypes=(torch.float32,))  # causal, and a sliding window of 5 keys
    ids = torch.randint(1, VOCAB, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                  cache_implementation="static", return_dict_in_generate=True, output_logits=True)
    expected = models["base", torch.float32].generate(ids, **kwargs)
    model = models[NAME, torch.float32]
    torch._dynamo.reset()
    counters.clear()
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    got = model.generate(ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for ours, theirs in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] >= 1


def test_custom_4d_mask_is_honoured():
    models = _models("llama", dtypes=(torch.float64,))
    ids = torch.randint(0, VOCAB, (2, 12))
    mask = torch.rand(2, 1, 12, 12) < 0.6
    mask |= torch.eye(12, dtype=torch.bool)  # every query sees itself
    got = models[NAME, torch.float64](ids, attention_mask=mask, use_cache=False).logits
    want = models["base", torch.float64](ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_padding_mask_hook():
    full = torch.ones(2, 8, dtype=torch.long)
    assert padding_mask(2, 8, 8, attention_mask=full) is None
    assert padding_mask(2, 8, 8, attention_mask=None) is None
    part = full.clone()
    part[0, 0] = 0
    assert padding_mask(2, 3, 6, attention_mask=part) is None  # a sliding layer sees the last 6: no padding there
    part[1, 4] = 0
    got = padding_mask(2, 3, 6, attention_mask=part)
    assert got.dtype == torch.bool and torch.equal(got, part[:, -6:].bool())
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert ALL_MASK_ATTENTION_FUNCTIONS[NAME] is padding_mask
    assert ALL_ATTENTION_FUNCTIONS[NAME] is attention_forward


def test_refusals_are_clear():
    module = torch.nn.Module()
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="s_aux"):
        attention_forward(module, q, q, q, torch.zeros(1, 1, 5, 5), s_aux=torch.zeros(2))
    with pytest.raises(ValueError, match="attention_mask"):
        attention_forward(module, q, q, q, torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="name"):
        register("")


def test_value_head_dim_may_differ():
    """MLA-style models give values a smaller head dim than queries and keys."""
    module = torch.nn.Module()
    module.is_causal = True
    q, k = torch.randn(2, 2, 2, 7, 16, dtype=torch.float64).unbind(0)
    v = torch.randn(2, 2, 7, 8, dtype=torch.float64)
    out, weights = attention_forward(module, q, k, v, None, scaling=0.3)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3).transpose(1, 2)
    assert weights is None
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
