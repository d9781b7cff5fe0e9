"""Experts with 3-D weights: `grouped_linear` (grouped_mm's layout and offsets), `ExpertsLinear`, and
`FusedExperts`, the FP8 form of Hugging Face's fused MoE experts (docs/design.md, section 9, "Grouped GEMMs").

The weights of E experts are one tensor (E, out, in): torchtitan's `GroupedExperts` (w1 (E, hidden,
dim), ...) and transformers' fused experts (`gate_up_proj` (E, 2 * intermediate, hidden), `down_proj`
(E, hidden, intermediate)) store them so. The rows of the input are grouped as
`torch.nn.functional.grouped_mm` groups them: `offs` holds each group's end offset (int32), rows
from offs[-1] on belong to no group (their output is 0 here; grouped_mm leaves it undefined). Each
expert is one GEMM of the FP8 module, with its own roles, as in `GroupedLinear` (grouped_linear.py).
The weight's slices are views of it (`unbind`: one backward node stacks the experts' gradients).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..fsdp import wrap_for_fsdp
from .base import FP8Module
from .grouped_linear import (
    check_group_blocks,
    group_block,
    grouped_fp8_linear,
    pad_groups,
    splits_from_offsets,
    unpad_groups,
)
from .linear import init_linear_params

__all__ = ["grouped_linear", "ExpertsLinear", "FusedExperts", "is_hf_fused_experts", "HF_FUSED_EXPERTS"]


def grouped_linear(
    module: FP8Module,
    x: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    first_gemm: int = 0,
    is_first_microbatch: Optional[bool] = None,
    pad_to_blocks: bool = False,
) -> torch.Tensor:
    """y[rows of group e] = x[rows of group e] @ weight[e].T (+ bias[e]), as GEMMs `first_gemm + e` of
    `module` (an FP8Module with that many GEMMs): FP8 inside an FP8 region, under any recipe.
    `x` (tokens, in); `weight` (E, out, in); `offs` (E,) int32 end offsets (grouped_mm's convention,
    read on the host); `bias` (E, out) or None. Under MXFP8 and NVFP4 each group's rows must be whole
    blocks (32, 16): refused otherwise, or with `pad_to_blocks` padded with zero rows for the GEMMs
    (`pad_groups`; the rows of the output are the same, the padding's gradient is dropped).
    `is_first_microbatch`: TransformerEngine's weight caching across microbatches."""
    where = f"{type(module).__name__} grouped_linear"
    if weight.dim() != 3 or x.shape[-1] != weight.shape[2]:
        raise ValueError(
            f"{where}: weight must be (experts, out_features, in_features) with in_features = x's last "
            f"dimension; got weight {tuple(weight.shape)} and x {tuple(x.shape)}"
        )
    experts = weight.shape[0]
    if first_gemm < 0 or first_gemm + experts > module.num_gemms:
        raise ValueError(
            f"{where}: GEMMs {first_gemm}..{first_gemm + experts - 1} are not all GEMMs of the module "
            f"(it has {module.num_gemms}); give the module one GEMM per expert"
        )
    x2d = x.reshape(-1, x.shape[-1])
    splits = splits_from_offsets(offs, experts, x2d.shape[0], where)
    groups, rest = splits[:-1], splits[-1]
    biases = [None] * experts if bias is None else list(bias.unbind(0))
    weights = weight.unbind(0)
    block = group_block(module) if pad_to_blocks else 1
    if block > 1 and any(n % block for n in groups):
        rows, padded = pad_groups(x2d[: x2d.shape[0] - rest], groups, block)
        y = grouped_fp8_linear(module, rows, weights, biases, padded, first_gemm, is_first_microbatch)
        y = unpad_groups(y, groups, padded)
        if rest:  # rows of no group: 0
            y = torch.cat([y, y.new_zeros(rest, y.shape[1])])
    else:
        check_group_blocks(module, groups, where)
        splits = splits if rest else groups
        y = grouped_fp8_linear(module, x2d, weights, biases, splits, first_gemm, is_first_microbatch)
    return y.view(*x.shape[:-1], weight.shape[1])


class ExpertsLinear(FP8Module):
    """One linear layer per expert with the weights as one (num_experts, out, in) tensor `weight`
    (and `bias` (num_experts, out) with bias=True), each initialised as torch.nn.Linear's:
    `forward(x, offs)` with grouped_mm's offsets (`grouped_linear`).

    Args:
        num_experts: the number of experts, each its own GEMM.
        in_features: the input features of every expert.
        out_features: the output features of every expert.
        bias: whether the experts have a bias (one (num_experts, out_features) tensor).
        params_dtype: the parameters' dtype (default: torch's default dtype).
        device: where the parameters are made ("meta" for a deferred build).
        fsdp_fp8_all_gather: FSDP2 gathers the weight in FP8, each expert with its GEMM's scale.

    Raises:
        ValueError: `num_experts` is not an int >= 1."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        device=None,
        fsdp_fp8_all_gather: bool = False,
    ) -> None:
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"ExpertsLinear: num_experts must be an int >= 1, got {num_experts!r}")
        self.num_gemms = num_experts  # before FP8Module's init: it sizes the role layout
        self.gemm_names = tuple(str(i) for i in range(num_experts))
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = torch.nn.Parameter(
            torch.empty(num_experts, out_features, in_features, dtype=dtype, device=device)
        )
        self.bias = (
            torch.nn.Parameter(torch.empty(num_experts, out_features, dtype=dtype, device=device))
            if bias
            else None
        )
        self.reset_parameters()
        if fsdp_fp8_all_gather:
            wrap_for_fsdp(self.weight, 0)

    def reset_parameters(self) -> None:
        """torch.nn.Linear's initialisation of each expert in turn, from the current seed."""
        with torch.no_grad():
            for e in range(self.num_gemms):
                init_linear_params(self.weight[e], None if self.bias is None else self.bias[e])
        self.forget_cached_weights()

    def gemm_weights(self) -> list[torch.Tensor]:
        """The weight of each GEMM, in GEMM order (one per expert): what the module casts to FP8."""
        return list(self.weight.unbind(0))

    def gemm_tokens(self, x: torch.Tensor, offs: torch.Tensor, *args, **kwargs) -> list[int]:
        """The rows each GEMM of a call `forward(x, offs)` multiplies (coverage counts FLOPs)."""
        return splits_from_offsets(offs, self.num_gemms, x.numel() // x.shape[-1], "ExpertsLinear")[:-1]

    def forward(
        self, x: torch.Tensor, offs: torch.Tensor, is_first_microbatch: Optional[bool] = None
    ) -> torch.Tensor:
        """`grouped_linear` of `x` (tokens, in_features) with the end offsets `offs` (num_experts,
        int32) of each expert's rows; `is_first_microbatch` as TransformerEngine's (weight caching).
        Returns (tokens, out_features)."""
        return grouped_linear(self, x, self.weight, offs, self.bias, 0, is_first_microbatch)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_gemms}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )


# transformers' fused experts whose forward FusedExperts computes (checked line by line: gate and up
# concatenated in gate_up_proj, no bias, act(gate) * up, down_proj, routing weights, index_add)
HF_FUSED_EXPERTS = ("MixtralExperts", "Qwen3MoeExperts")


def is_hf_fused_experts(module: torch.nn.Module) -> bool:
    """A transformers fused-experts module of a layout FusedExperts computes."""
    cls = type(module)
    return (
        cls.__name__ in HF_FUSED_EXPERTS
        and cls.__module__.startswith("transformers.")
        and getattr(module, "has_gate", True)
        and not getattr(module, "has_bias", False)
        and not getattr(module, "is_transposed", False)
        and getattr(module, "is_concatenated", True)
        and not getattr(module, "has_post_expert_norm", False)
    )


class FusedExperts(FP8Module):
    """FP8 version of transformers' fused MoE experts (Mixtral, Qwen3-MoE): the same Parameter
    objects `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I), 2E GEMMs (gate_up of expert e is
    GEMM e, its down_proj GEMM E + e), and transformers' eager forward: tokens in the order its loop
    takes them, act(gate) * up, the routing weights, the sum over a token's experts in expert order.
    Outside an FP8 region it computes exactly what transformers' eager experts compute. Under MXFP8
    and NVFP4 each expert's rows are padded to whole blocks for its GEMMs (zero rows: no amax, no
    output, no weight gradient), so any routing trains."""

    def __init__(self, experts: torch.nn.Module) -> None:
        num_experts = experts.gate_up_proj.shape[0]
        self.num_gemms = 2 * num_experts
        self.gemm_names = tuple(f"gate_up{e}" for e in range(num_experts)) + tuple(
            f"down{e}" for e in range(num_experts)
        )
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.act_fn = experts.act_fn
        self.hidden_dim, self.intermediate_dim = self.down_proj.shape[1], self.down_proj.shape[2]
        self.source_class = type(experts).__name__

    def gemm_weights(self) -> list[torch.Tensor]:
        return list(self.gate_up_proj.unbind(0)) + list(self.down_proj.unbind(0))

    def gemm_tokens(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, *args, **kwargs
    ) -> list[int]:
        counts = torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts + 1)[: self.num_experts]
        return counts.tolist() * 2

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        with torch.no_grad():  # transformers' loop order: expert, then top-k position, then token
            flat = top_k_index.t().reshape(-1)
            order = torch.argsort(flat, stable=True)
            token_idx, position = order % tokens, order // tokens
            counts = torch.bincount(flat, minlength=self.num_experts + 1)  # index E: no expert
            ends = torch.cumsum(counts[: self.num_experts], 0).to(torch.int32)
        x = hidden_states[token_idx]
        gate_up = grouped_linear(self, x, self.gate_up_proj, ends, None, 0, pad_to_blocks=True)
        gate, up = gate_up.chunk(2, dim=-1)
        experts = self.num_experts
        h = grouped_linear(
            self, self.act_fn(gate) * up, self.down_proj, ends, None, experts, pad_to_blocks=True
        )
        h = h * top_k_weights[token_idx, position, None]
        final = torch.zeros_like(hidden_states)
        routed = int(ends[-1]) if self.num_experts else 0  # rows routed to no expert add nothing
        return final.index_add_(0, token_idx[:routed], h[:routed].to(final.dtype))

    def extra_repr(self) -> str:
        return f"{self.source_class}: num_experts={self.num_experts}, hidden={self.hidden_dim}, " + (
            f"intermediate={self.intermediate_dim}"
        )
