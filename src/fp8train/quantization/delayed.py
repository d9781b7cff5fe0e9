"""Delayed scaling: each step's scales come from the amax history of earlier steps, which an amax
group shares and MAX-reduces across its ranks (docs/design.md, sections 1-3).

Its state is amax/'s, which answers the runtime's hooks (`DelayedRuntime`, amax/hooks.py, its base):
the call's plan freezes its region's scales, its amaxes are recorded and its backward asks for the
gradient's scale, through the `Call` each GEMM hands down. The scale of every tensor is
known before the tensor is cast, so sequence-parallel inputs and FSDP2 weights travel as FP8, and an
eager cast takes its tensor's amax in the same read, MAXed into its recording slot
(`cast.cast_with_amax`'s `amax_out`).
"""

from __future__ import annotations

import torch

from ..amax import DelayedRuntime
from ..amax.roles import INPUT, WEIGHT
from ..numerics.cast import amax
from ..runtime import Call
from .base import AMAX_IN_CAST, GradOperands, InputOperands, WeightOperands
from .per_tensor import TensorQuantization

__all__ = ["DelayedQuantization"]


def _amax_in_cast(call: Call) -> bool:
    """Whether this call's casts take their tensors' amaxes (eager training calls in FP8); under
    torch.compile the amaxes go into the protocol's op first, and inductor fuses them with the casts."""
    return call.record and call.fp8 and not torch.compiler.is_compiling()


class DelayedQuantization(DelayedRuntime, TensorQuantization):
    kind = "delayed"
    reduces_amax = True
    casts_before_gather = True

    def call_scales(self, call: Call, x: torch.Tensor, weight_amax):
        # (_amax_in_cast, inline) x's amax: taken by its cast; the weight's too where it is cast here
        if call.record and call.fp8 and not torch.compiler.is_compiling():
            w_amax = None if weight_amax is None or weight_amax is AMAX_IN_CAST else weight_amax()
            # (eagerly only x's device is read: no detach)
            return self.gemm_scales(call.plan, call.gemm_index, None, w_amax, x)
        x_amax = amax(x) if call.record else None
        # (AMAX_IN_CAST reaches here only for calls that record nothing: eager FP8 calls without grad)
        recorded = call.record and weight_amax is not None and weight_amax is not AMAX_IN_CAST
        w_amax = weight_amax() if recorded else None
        return self.forward_scales(call, x_amax, w_amax, x.detach())

    def quantize_weight(self, weight: torch.Tensor, call: Call) -> WeightOperands:
        # the region's views of this GEMM's scales where the call has them, else selected
        scale, scale_inv = (
            call.pairs[WEIGHT] if call.pairs is not None else (call.scales[0, 1], call.scales[1, 1])
        )
        # its cast takes the weight's amax, into its recording slot
        slot = self.amax_slot(call, WEIGHT) if call.weight_amax_in_cast and call.amax_in_cast else None
        operands = self.cast_operands(weight, scale, scale_inv, "e4m3", call.operand_dtype, slot, call)
        return WeightOperands(*operands)

    def quantize_input(self, x2d: torch.Tensor, call: Call) -> InputOperands:
        scale, scale_inv = (
            call.pairs[INPUT] if call.pairs is not None else (call.scales[0, 0], call.scales[1, 0])
        )
        slot = self.amax_slot(call, INPUT) if call.amax_in_cast else None  # its cast takes x's amax
        operands = self.cast_operands(x2d, scale, scale_inv, "e4m3", call.operand_dtype, slot, call)
        return InputOperands(*operands)

    def quantize_grad(self, g2d: torch.Tensor, call: Call, needs: tuple[bool, bool]) -> GradOperands:
        if call.record and not torch.compiler.is_compiling():  # the amax taken by the cast, into its slot
            scale, scale_inv, slot = self.backward_scale_pair(call)
            return self.grad_cast(g2d, scale, scale_inv, call, slot, needs[1])
        scales = self.backward_scales(call, amax(g2d))
        return self.grad_operands(g2d, scales[0], scales[1], call, needs[1])
