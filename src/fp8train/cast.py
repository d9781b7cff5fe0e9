"""Quantize to FP8 with a given scale, recording the amax of the same input."""

from __future__ import annotations

import torch

from .recipe import fp8_dtype, fp8_max

__all__ = ["amax", "quantize"]


def amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| as a float32 scalar; NaN propagates, an empty tensor gives 0."""
    if x.numel() == 0:
        return torch.zeros((), device=x.device)
    low, high = torch.aminmax(x.detach())  # one pass; faster than abs().amax() on CPU
    return torch.maximum(high, -low).to(torch.float32)


def quantize(x: torch.Tensor, scale: torch.Tensor, encoding: str) -> torch.Tensor:
    """saturate(x * scale) in FP8. Clamping first makes overflow identical for every FP8 dtype."""
    limit = fp8_max(encoding)
    return (x.to(torch.float32) * scale).clamp_(-limit, limit).to(fp8_dtype(encoding))
