"""Per-tensor current scaling (`Float8CurrentScaling`): each tensor's scale from its own amax, just
before its cast; no history and no amax reduction (docs/design.md, section 9)."""

from __future__ import annotations

from typing import Optional

import torch

from ..numerics import kernels
from ..numerics.cast import amax
from ..numerics.formats import FLOAT32_MAX, fp8_dtype, fp8_max
from ..numerics.operand import Operand
from ..runtime import Call
from .base import GradOperands, InputOperands, WeightOperands
from .per_tensor import TensorQuantization, operand_pair, trains

__all__ = ["CurrentQuantization", "scale_from_amax", "current_scales"]


def scale_from_amax(amax: torch.Tensor, fp8_max_value: float, power_2: bool = False) -> torch.Tensor:
    """TransformerEngine's rule: fp8_max / amax, capped at the float32 maximum, and 1 where amax is
    0, inf or NaN; with `power_2`, rounded down to a power of 2 (exactly, through the exponent)."""
    ok = torch.isfinite(amax) & (amax > 0)
    # a true division (python_number / tensor would multiply by a rounded reciprocal)
    quotient = torch.full_like(amax, fp8_max_value).div_(torch.where(ok, amax, 1.0))
    scale = torch.where(ok, quotient, 1.0).clamp(max=FLOAT32_MAX)
    if power_2:
        _, exponent = torch.frexp(scale)  # scale = m * 2**exponent, m in [0.5, 1)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    return scale


def current_scales(x: torch.Tensor, encoding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) of `x` as a whole, float32 scalars."""
    scale = scale_from_amax(amax(x), fp8_max(encoding))
    return scale, scale.reciprocal()


class CurrentQuantization(TensorQuantization):
    kind = "current"

    def current_operands(
        self,
        x: torch.Tensor,
        encoding: str,
        dtype: torch.dtype,
        call: Optional[Call] = None,
        wgrad: bool = False,
    ) -> tuple[Operand, Operand]:
        """x cast with the scale of its own amax: the amax read, then the cast (two reads of x; one
        fused kernel each where `kernels.use_fused_kernels`, the same bits), and the operand of the
        GEMM that takes x in the other layout (`call`, `wgrad`: as `TensorQuantization.cast_operands`)."""
        if kernels.use_fused_kernels(x):
            transposed = dtype.itemsize == 1 and (wgrad or trains(call))
            cast = kernels.amax_then_cast(x, encoding, dtype, transposed=transposed)
            return operand_pair(cast.values, cast.values_t, cast.scale_inv)
        return self.cast_operands(x, *current_scales(x, encoding), encoding, dtype)

    def quantize_weight(self, weight: torch.Tensor, call: Call) -> WeightOperands:
        forward, dgrad = self.current_operands(weight, "e4m3", call.operand_dtype, call)
        return WeightOperands(forward, dgrad)

    def quantize_input(self, x2d: torch.Tensor, call: Call) -> InputOperands:
        forward, wgrad = self.current_operands(x2d, "e4m3", call.operand_dtype, call)
        return InputOperands(forward, wgrad)

    def quantize_grad(self, g2d: torch.Tensor, call: Call, needs: tuple[bool, bool]) -> GradOperands:
        encoding = self.grad_encoding
        dtype = fp8_dtype(encoding) if call.operand_dtype.itemsize == 1 else call.operand_dtype
        dgrad, wgrad = self.current_operands(g2d, encoding, dtype, None, needs[1])
        return GradOperands(dgrad, wgrad)
