"""LayerNorm and RMSNorm in high precision (FP8 recipes leave normalisation alone)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["LayerNorm", "RMSNorm", "make_norm"]


class _Norm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, params_dtype: Optional[torch.dtype], device, bias: bool):
        super().__init__()
        kw = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, **kw))
        self.bias = torch.nn.Parameter(torch.empty(hidden_size, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight 1, bias 0 (also for the meta-device pattern: `to_empty`, then this)."""
        torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)


class LayerNorm(_Norm):
    """Layer normalisation over the last dimension with a weight and a bias (TransformerEngine's
    `LayerNorm`; a high-precision op: the FP8 modules take its output).

    Args:
        hidden_size: the normalised (last) dimension.
        eps: added to the variance.
        params_dtype: the parameters' dtype (default: `torch.get_default_dtype()`).
        device: where the parameters are made.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, params_dtype: Optional[torch.dtype] = None, device=None
    ):
        super().__init__(hidden_size, eps, params_dtype, device, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (..., hidden_size) normalised over its last dimension, scaled and shifted; `x`'s dtype."""
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(_Norm):
    """Root-mean-square normalisation over the last dimension with a weight, no bias
    (TransformerEngine's `RMSNorm`; a high-precision op).

    Args:
        hidden_size: the normalised (last) dimension.
        eps: added to the mean square.
        params_dtype: the parameters' dtype (default: `torch.get_default_dtype()`).
        device: where the parameters are made.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, params_dtype: Optional[torch.dtype] = None, device=None
    ):
        super().__init__(hidden_size, eps, params_dtype, device, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (..., hidden_size) divided by its root mean square, scaled; `x`'s dtype."""
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def make_norm(normalization: str, hidden_size: int, eps: float, params_dtype, device) -> torch.nn.Module:
    if normalization == "LayerNorm":
        return LayerNorm(hidden_size, eps, params_dtype, device)
    if normalization == "RMSNorm":
        return RMSNorm(hidden_size, eps, params_dtype, device)
    raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
