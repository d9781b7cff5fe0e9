"""LayerNormLinear and LayerNormMLP: a norm followed by FP8 GEMMs."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..fsdp import wrap_for_fsdp
from .base import FP8Module
from .fp8_linear import fp8_linear
from .linear import init_linear_params
from .norms import make_norm

__all__ = ["LayerNormLinear", "LayerNormMLP"]

ACTIVATIONS = ("gelu", "swiglu")


class LayerNormLinear(FP8Module):
    """norm(x) @ weight.T + bias; parameters named as in TransformerEngine."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        fsdp_fp8_all_gather: bool = False,
    ) -> None:
        super().__init__()
        kw = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        self.norm = make_norm(normalization, in_features, eps, params_dtype, device)
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **kw))
        self.bias = torch.nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        init_linear_params(self.weight, self.bias)
        if fsdp_fp8_all_gather:
            wrap_for_fsdp(self.weight, 0)

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        return fp8_linear(self, self.norm(x), self.weight, self.bias, 0, is_first_microbatch)


class LayerNormMLP(FP8Module):
    """fc2(act(fc1(norm(x)))) with two FP8 GEMMs; `swiglu` splits fc1's output in two halves."""

    num_gemms = 2
    gemm_names = ("fc1", "fc2")

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        fsdp_fp8_all_gather: bool = False,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        kw = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        fc1_out = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        self.norm = make_norm(normalization, hidden_size, eps, params_dtype, device)
        self.fc1_weight = torch.nn.Parameter(torch.empty(fc1_out, hidden_size, **kw))
        self.fc1_bias = torch.nn.Parameter(torch.empty(fc1_out, **kw)) if bias else None
        self.fc2_weight = torch.nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, **kw))
        self.fc2_bias = torch.nn.Parameter(torch.empty(hidden_size, **kw)) if bias else None
        init_linear_params(self.fc1_weight, self.fc1_bias)
        init_linear_params(self.fc2_weight, self.fc2_bias)
        if fsdp_fp8_all_gather:
            wrap_for_fsdp(self.fc1_weight, 0)
            wrap_for_fsdp(self.fc2_weight, 1)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(h, approximate="tanh")

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        h = fp8_linear(self, self.norm(x), self.fc1_weight, self.fc1_bias, 0, is_first_microbatch)
        return fp8_linear(self, self._act(h), self.fc2_weight, self.fc2_bias, 1, is_first_microbatch)
