"""fp8train.Linear: torch.nn.Linear with FP8 GEMMs inside an FP8 region."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..fsdp import wrap_for_fsdp
from .base import FP8Module
from .fp8_linear import fp8_linear

__all__ = ["Linear", "init_linear_params"]


def init_linear_params(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """torch.nn.Linear's initialisation."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0
        torch.nn.init.uniform_(bias, -bound, bound)


class Linear(FP8Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        fsdp_fp8_all_gather: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        kw = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **kw))
        self.bias = torch.nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        init_linear_params(self.weight, self.bias)
        if fsdp_fp8_all_gather:
            wrap_for_fsdp(self.weight, 0)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        return fp8_linear(self, x, self.weight, self.bias, 0, is_first_microbatch)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )
