"""Per-tensor current scaling (`Float8CurrentScaling`): each tensor's scale from its own amax, just
before its cast; no history and no amax reduction (docs/design.md, section 9)."""

from __future__ import annotations

import torch

from ..amax import Call
from ..cast import amax
from ..formats import FLOAT32_MAX, fp8_max
from .base import GradOperands, InputOperands, WeightOperands
from .per_tensor import TensorQuantization

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

    def quantize_weight(self, weight: torch.Tensor, call: Call) -> WeightOperands:
        return WeightOperands.same(
            self.cast(weight, *current_scales(weight, "e4m3"), "e4m3", call.operand_dtype)
        )

    def quantize_input(self, x2d: torch.Tensor, call: Call) -> InputOperands:
        operand = self.cast(x2d, *current_scales(x2d, "e4m3"), "e4m3", call.operand_dtype)
        return InputOperands(operand, operand)

    def quantize_grad(self, g2d: torch.Tensor, call: Call, needs: tuple[bool, bool]) -> GradOperands:
        return self.grad_operands(g2d, *current_scales(g2d, self.grad_encoding), call)
