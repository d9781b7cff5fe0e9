"""A small GPT built from fp8train modules, for the demo, telemetry tests and benchmarks.

Each block is LayerNormLinear (qkv) + causal attention + Linear (proj), then LayerNormMLP (or, with
`experts` > 0, a mixture of experts: a router and two GroupedLinear), with residual connections; a
final LayerNorm and an LM head follow. The head and the embeddings stay in
high precision (as usual in FP8 recipes: the vocabulary projection is precision-sensitive and cheap).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from fp8train.modules import (
    GroupedLinear,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    pad_groups,
    unpad_groups,
)

__all__ = ["GPTConfig", "GPT", "MoE", "MODEL_SIZES", "next_token_loss"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    seq_len: int = 32
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    ffn: int = 256
    experts: int = 0  # > 0: each block's MLP is a mixture of this many experts (MoE), each ffn / experts wide
    top_k: int = 2  # experts per token (MoE)

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


# Each expert's rows are padded to whole blocks of the largest block a recipe needs along the tokens
# (MXFP8's 32): every recipe trains the same model; zero rows change no amax and no other row.
EXPERT_ROWS_MULTIPLE = 32


class MoE(torch.nn.Module):
    """Pre-norm token-choice top-k mixture of experts: a high-precision router (softmax, top-k, the
    weights renormalised), each expert GELU(x W_up.T) W_down.T, as two GroupedLinear (FP8 GEMMs, a
    role per expert); a token's output is the routing-weighted sum over its experts."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.ffn % cfg.experts or not 1 <= cfg.top_k <= cfg.experts:
            raise ValueError(
                f"MoE: ffn ({cfg.ffn}) must divide by experts ({cfg.experts}), 1 <= top_k <= experts"
            )
        self.experts, self.top_k = cfg.experts, cfg.top_k
        self.norm = LayerNorm(cfg.hidden)
        self.router = torch.nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.up = GroupedLinear(cfg.experts, cfg.hidden, cfg.ffn // cfg.experts)
        self.down = GroupedLinear(cfg.experts, cfg.ffn // cfg.experts, cfg.hidden)
        self.last_tokens_per_expert: list[int] = []  # of the latest call (the report shows them)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).reshape(-1, x.shape[-1])
        weights, chosen = F.softmax(self.router(h).float(), dim=-1).topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(h.dtype)
        order = torch.argsort(chosen.reshape(-1), stable=True)  # rows grouped by expert
        token = order // self.top_k
        splits = torch.bincount(chosen.reshape(-1), minlength=self.experts).tolist()
        self.last_tokens_per_expert = splits
        rows, padded = pad_groups(h[token], splits, EXPERT_ROWS_MULTIPLE)
        y = unpad_groups(self.down(F.gelu(self.up(rows, padded)), padded), splits, padded)
        y = y * weights.reshape(-1)[order, None]
        return torch.zeros_like(h).index_add_(0, token, y).view(x.shape)


class Block(torch.nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MoE(cfg) if cfg.experts else LayerNormMLP(cfg.hidden, cfg.ffn)

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
