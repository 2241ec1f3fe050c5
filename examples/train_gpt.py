"""Train a small character-level GPT with flashattn, next to the same run with PyTorch's SDPA, then generate.

    python examples/train_gpt.py                      # CPU: a few minutes; GPU if present (bf16 autocast)
    python examples/train_gpt.py --steps 2000 --compile --out gpt-run

Both runs start from the same weights and see the same batches, so their loss curves should lie on top of each
other: attention is exact, only rounding differs. The model is a pre-norm decoder whose attention is
``flashattn.nn.SelfAttention`` (rotary, GQA); the baseline swaps only the attention call for
``torch.nn.functional.scaled_dot_product_attention``. Generation is greedy and runs on the KV cache
(prefill once, then one token per step); it is checked against recomputing the whole prefix at every step.
Writes ``losses.json`` and, with matplotlib, ``losses.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from flashattn.nn import KVCache, SelfAttention

DATA = Path(__file__).parent / "data" / "sonnets.txt"


@dataclass
class Config:
    vocab: int
    dim: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    seq_len: int = 128
    dropout: float = 0.0


class SDPASelfAttention(SelfAttention):
    """The baseline: the same module with PyTorch's SDPA doing the attention."""

    def attend(self, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                             is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)


class Block(nn.Module):
    def __init__(self, cfg: Config, attention: type[SelfAttention]) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn = attention(cfg.dim, cfg.heads, cfg.kv_heads, dropout=cfg.dropout, max_seqlen=cfg.seq_len)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cache=cache)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """tokens (batch, seqlen) -> logits (batch, seqlen, vocab)."""

    def __init__(self, cfg: Config, attention: type[SelfAttention] = SelfAttention) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, attention) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # GPT-2's init: N(0, 0.02), residual projections scaled down by depth.
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("attn.out.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.head(self.norm(x))

    def new_caches(self, batch_size: int, max_seqlen: int) -> list[KVCache]:
        return [block.attn.new_cache(batch_size, max_seqlen) for block in self.blocks]

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int, use_cache: bool = True) -> torch.Tensor:
        """Greedy continuation of prompt (batch, n): with the cache, the prompt is read once and each step feeds
        only the newest token; without it, every step recomputes the whole sequence."""
        tokens = prompt
        caches = self.new_caches(prompt.shape[0], prompt.shape[1] + new_tokens) if use_cache else None
        step_input = prompt
        for _ in range(new_tokens):
            logits = self(step_input if use_cache else tokens, caches)
            nxt = logits[:, -1].argmax(dim=-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
            step_input = nxt
        return tokens


class Chars:
    """Character vocabulary of the training text."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


def batches(data: torch.Tensor, batch_size: int, seq_len: int, seed: int):
    """An endless stream of (input, target) windows; the same seed gives the same stream."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
        window = torch.stack([data[s:s + seq_len + 1] for s in start.tolist()])
        yield window[:, :-1], window[:, 1:]


def train(model: nn.Module, data: torch.Tensor, args, device: torch.device, label: str) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    step_fn = torch.compile(model, fullgraph=True) if args.compile else model
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    losses, stream, start = [], batches(data, args.batch_size, args.seq_len, args.seed), time.perf_counter()
    for step in range(args.steps):
        x, y = (t.to(device) for t in next(stream))
        for group in opt.param_groups:  # linear warm-up, then cosine decay to 10%
            warm = min(1.0, (step + 1) / max(1, args.steps // 10))
            group["lr"] = args.lr * warm * (0.55 + 0.45 * math.cos(math.pi * step / max(1, args.steps)))
        with autocast:
            logits = step_fn(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"  [{label}] step {step:5d}  loss {loss.item():.4f}  ({time.perf_counter() - start:.1f} s)")
    return losses


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the model")
    p.add_argument("--no-baseline", action="store_true", help="skip the SDPA run")
    p.add_argument("--prompt", default="Shall I compare thee")
    p.add_argument("--sample-len", type=int, default=200)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--text", type=Path, default=DATA, help="training text (default: the shipped sonnets)")
    p.add_argument("--out", type=Path, default=None, help="folder for losses.json and losses.png")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    device = torch.device(args.device)
    text = args.text.read_text()
    chars = Chars(text)
    data = chars.encode(text)
    cfg = Config(vocab=len(chars.chars), dim=args.dim, layers=args.layers, heads=args.heads,
                 kv_heads=args.kv_heads, seq_len=args.seq_len)
    print(f"{len(text)} characters, vocabulary {cfg.vocab}; model {asdict(cfg)} on {device}")

    runs = {"flashattn": SelfAttention} if args.no_baseline else {"flashattn": SelfAttention,
                                                                    "sdpa": SDPASelfAttention}
    models, losses = {}, {}
    for label, attention in runs.items():
        torch.manual_seed(args.seed)  # same initial weights for both runs
        models[label] = GPT(cfg, attention).to(device)
        print(f"training with {label} attention")
        losses[label] = train(models[label], data, args, device, label)

    print("\nloss curve (every 10% of the run):")
    print("  step  " + "  ".join(f"{name:>10}" for name in losses))
    for step in sorted({*range(0, args.steps, max(1, args.steps // 10)), args.steps - 1}):
        print(f"{step:6d}  " + "  ".join(f"{curve[step]:10.4f}" for curve in losses.values()))

    model = models["flashattn"].eval()
    prompt = chars.encode(args.prompt)[None].to(device)
    cached = model.generate(prompt, args.sample_len, use_cache=True)
    recomputed = model.generate(prompt, min(args.sample_len, 32), use_cache=False)
    same = torch.equal(cached[:, :recomputed.shape[1]], recomputed)
    sample = chars.decode(cached[0].tolist())
    checked = recomputed.shape[1] - prompt.shape[1]
    print(f"\ngreedy sample (KV cache; equals recomputing the prefix for the first {checked} tokens: {same}):\n"
          f"{sample}")

    result = {"config": asdict(cfg), "steps": args.steps, "device": str(device), "losses": losses,
              "sample": sample, "cache_matches_recompute": same}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "losses.json").write_text(json.dumps(result, indent=1))
        _plot(losses, args.out / "losses.png")
    return result


def _plot(losses: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for (name, curve), style in zip(losses.items(), ("-", "--"), strict=False):
        ax.plot(curve, style, label=name)
    ax.set(xlabel="step", ylabel="training loss (nats/char)", title="char-level GPT: flashattn vs torch SDPA")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
