"""Delayed scaling: each step's scales come from the amax history of earlier steps, which an amax
group shares and MAX-reduces across its ranks (docs/design.md, sections 1-3).

Its calls go through the protocol, by the methods of the `Call` each GEMM hands down (amax/calls.py):
the call's plan freezes its region's scales, its amaxes are recorded and its backward asks for the
gradient's scale. The scale of every tensor is
known before the tensor is cast, so sequence-parallel inputs and FSDP2 weights travel as FP8.
"""

from __future__ import annotations

import torch

from ..amax import Call
from ..cast import amax
from .base import GradOperands, InputOperands, WeightOperands
from .per_tensor import TensorQuantization

__all__ = ["DelayedQuantization"]


class DelayedQuantization(TensorQuantization):
    kind = "delayed"
    reduces_amax = True
    casts_before_gather = True

    def call_scales(self, call: Call, x: torch.Tensor, weight_amax):
        x_amax = amax(x) if call.record else None
        w_amax = weight_amax() if call.record and weight_amax is not None else None
        return call.forward_scales(x_amax, w_amax, x.detach())

    def quantize_weight(self, weight: torch.Tensor, call: Call) -> WeightOperands:
        scales = call.scales
        return WeightOperands.same(self.cast(weight, scales[0, 1], scales[1, 1], "e4m3", call.operand_dtype))

    def quantize_input(self, x2d: torch.Tensor, call: Call) -> InputOperands:
        scales = call.scales
        operand = self.cast(x2d, scales[0, 0], scales[1, 0], "e4m3", call.operand_dtype)
        return InputOperands(operand, operand)

    def quantize_grad(self, g2d: torch.Tensor, call: Call, needs: tuple[bool, bool]) -> GradOperands:
        scales = call.backward_scales(amax(g2d))
        return self.grad_operands(g2d, scales[0], scales[1], call)
