"""Delayed scaling: each step's scales come from the amax history of earlier steps, which an amax
group shares and MAX-reduces across its ranks (docs/design.md, sections 1-3).

Its calls go through the protocol: a call's plan freezes its region's scales (plans.py), its amaxes
are recorded and its backward asks for the gradient's scale (ops.py). The scale of every tensor is
known before the tensor is cast, so sequence-parallel inputs and FSDP2 weights travel as FP8.
"""

from __future__ import annotations

import torch

from ..amax import backward_scales, forward_scales
from ..cast import amax
from .base import GemmCall, GradOperands, InputOperands, WeightOperands
from .per_tensor import TensorQuantization

__all__ = ["DelayedQuantization"]


class DelayedQuantization(TensorQuantization):
    kind = "delayed"
    reduces_amax = True
    casts_before_gather = True

    def call_scales(self, module, gemm_index: int, x: torch.Tensor, weight_amax, record: bool):
        x_amax = amax(x) if record else None
        w_amax = weight_amax() if record and weight_amax is not None else None
        return forward_scales(module, gemm_index, x_amax, w_amax, x.detach())

    def quantize_weight(self, weight: torch.Tensor, call: GemmCall) -> WeightOperands:
        scales = call.scales
        return WeightOperands.same(self.cast(weight, scales[0, 1], scales[1, 1], "e4m3", call.operand_dtype))

    def quantize_input(self, x2d: torch.Tensor, call: GemmCall) -> InputOperands:
        scales = call.scales
        operand = self.cast(x2d, scales[0, 0], scales[1, 0], "e4m3", call.operand_dtype)
        return InputOperands(operand, operand)

    def quantize_grad(self, g2d: torch.Tensor, call: GemmCall, needs: tuple[bool, bool]) -> GradOperands:
        scales = backward_scales(call.module_handle, call.gemm_index, amax(g2d), call.token)
        return self.grad_operands(g2d, scales[0], scales[1], call)
