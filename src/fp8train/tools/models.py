"""A small GPT built from fp8train modules, for the demo, telemetry tests and benchmarks.

Each block is LayerNormLinear (qkv) + causal attention + Linear (proj), then LayerNormMLP, with
residual connections; a final LayerNorm and an LM head follow. The head and the embeddings stay in
high precision (as usual in FP8 recipes: the vocabulary projection is precision-sensitive and cheap).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from fp8train.modules import LayerNorm, LayerNormLinear, LayerNormMLP, Linear

__all__ = ["GPTConfig", "GPT", "MODEL_SIZES", "next_token_loss"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    seq_len: int = 32
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    ffn: int = 256

    def as_dict(self) -> dict:
        return asdict(self)


# Dimensions are multiples of 16 so that the hardware FP8 GEMM (torch._scaled_mm) can take them.
MODEL_SIZES = {
    "tiny": GPTConfig(vocab_size=64, seq_len=32, hidden=64, heads=4, layers=2, ffn=256),
    "small": GPTConfig(vocab_size=128, seq_len=64, hidden=128, heads=4, layers=4, ffn=512),
}


class Attention(torch.nn.Module):
    """Pre-norm causal self-attention: the qkv and output projections are FP8 GEMMs."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.hidden % cfg.heads:
            raise ValueError(f"hidden ({cfg.hidden}) must be divisible by heads ({cfg.heads})")
        self.heads = cfg.heads
        self.qkv = LayerNormLinear(cfg.hidden, 3 * cfg.hidden)
        self.proj = Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(torch.nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = LayerNormMLP(cfg.hidden, cfg.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class GPT(torch.nn.Module):
    """Token + position embeddings, `layers` blocks, final LayerNorm, LM head. Returns logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = torch.nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_emb = torch.nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = LayerNorm(cfg.hidden)
        self.head = torch.nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        torch.nn.init.normal_(self.tok_emb.weight, std=0.02)
        torch.nn.init.normal_(self.pos_emb.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross entropy over tokens[:, 1:] given tokens[:, :-1]."""
        return next_token_loss(self(tokens[:, :-1]), tokens)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross entropy (fp32) of `logits` (of tokens[:, :-1]) against tokens[:, 1:]; for callers that
    run the model through a wrapper (DDP), which `GPT.loss` would bypass."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
