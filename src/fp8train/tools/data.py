"""The demo's data, deterministic and offline: real text (the Python standard library's own source,
byte-level) by default, or a synthetic Markov language whose entropy is a known loss floor."""

from __future__ import annotations

import os
import sysconfig

import torch

__all__ = ["stdlib_text", "text_batches", "MarkovTask", "TEXT_SOURCE"]

TEXT_SOURCE = "the Python standard library's .py files (sorted by name), byte-level"


def stdlib_text(max_bytes: int = 2_000_000) -> torch.Tensor:
    """The bytes of the standard library's top-level .py files, in sorted order, as int64 tokens
    (0..255): the same on every machine with this Python, nothing downloaded, and heavy-tailed like
    real text (identifiers, indentation runs, rare bytes)."""
    root, data = sysconfig.get_paths()["stdlib"], bytearray()
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and len(data) < max_bytes:
            with open(os.path.join(root, name), "rb") as f:
                data += f.read()
    if not data:
        raise FileNotFoundError(f"no .py files under {root}: use the synthetic data (--data markov)")
    return torch.frombuffer(data[:max_bytes], dtype=torch.uint8).long()


def text_batches(text: torch.Tensor, steps: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """[steps, batch, seq_len + 1] windows of `text` at random offsets drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - seq_len - 1, (steps * batch,), generator=g)
    windows = starts[:, None] + torch.arange(seq_len + 1)
    return text[windows].view(steps, batch, seq_len + 1)


class MarkovTask:
    """A fixed random first-order Markov language: each token has a few likely successors.

    Deterministic from `seed`; nothing is downloaded. Its conditional entropy is the lowest loss any
    model can reach, which the demo prints next to the trained losses.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, successors: int = 4) -> None:
        g = torch.Generator().manual_seed(seed)
        probs = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
        for token in range(vocab_size):
            nxt = torch.randperm(vocab_size, generator=g)[:successors]
            weights = torch.rand(successors, generator=g, dtype=torch.float64) + 0.1
            probs[token, nxt] = weights / weights.sum()
        self.probs = probs
        self.seq_len = seq_len  # model input length; sequences have seq_len + 1 tokens

    def sample(self, n: int, seed: int) -> torch.Tensor:
        """n sequences of seq_len + 1 tokens (int64), the first token uniform."""
        g = torch.Generator().manual_seed(seed)
        vocab = self.probs.shape[0]
        out = torch.empty(n, self.seq_len + 1, dtype=torch.long)
        out[:, 0] = torch.randint(vocab, (n,), generator=g)
        for t in range(1, self.seq_len + 1):
            out[:, t] = torch.multinomial(self.probs[out[:, t - 1]], 1, generator=g).squeeze(1)
        return out

    def loss_floor(self) -> float:
        """Expected cross entropy of the true model over the predicted positions (nats)."""
        p = self.probs
        row_entropy = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(1)
        dist_t = torch.full((p.shape[0],), 1.0 / p.shape[0], dtype=torch.float64)
        total = 0.0
        for _ in range(self.seq_len):
            total += float(dist_t @ row_entropy)
            dist_t = dist_t @ p
        return total / self.seq_len
